"""Responses API answers (``POST /v1/responses``), translated from the chat path's answer
to the request's chat equivalent (openai/responses_input.py).

Every answer starts from `response_head`: a `ResponseObject` with the request's settings as
resolved (temperature and top_p after the model's defaults), status ``in_progress``, no
output. Output items, in the order the parsed answer has its parts:

- ``reasoning`` (the chat message's ``reasoning_content``, when there was thinking): the
  whole text as one ``reasoning_text`` content part (not a summary: ``summary`` is empty);
- ``message`` (its ``content``; absent only when the answer is tool calls alone): one
  ``output_text`` part;
- ``function_call`` per tool call: ``call_id`` is chat's call id (``call_...``).

Items have ids (``rs_``, ``msg_``, ``fc_``) and status ``completed``; a chat finish reason
``length`` makes the response ``incomplete`` (``incomplete_details.reason:
"max_output_tokens"``) and its last item ``incomplete``. ``usage`` is chat's renamed
(``input_tokens`` with ``cached_tokens``, ``output_tokens`` with ``reasoning_tokens``).
Extensions: ``routing`` and the choice's ``metrics``, as on chat.

Non-streamed, `build_response(head, completion)` reads the `ChatCompletion`. Streamed, a
`ResponseStream` is the stream's writer (openai/sse.py `StreamWriter`, driven by
`merge_choice_streams` as the chat chunks are): it reads the same `ChoiceUpdate` s
(openai/choice_update.py: each step's parsed delta), the choice's `ChoiceResult` and the
request's usage that the chat stream is written from, and writes OpenAI's event sequence,
each ``event: <type>\\ndata: <json>\\n\\n`` with a ``sequence_number`` from 0:
``response.created``, ``response.in_progress``; per item ``response.output_item.added``,
then for a message ``response.content_part.added``, ``response.output_text.delta`` (one per
chat delta), ``response.output_text.done``, ``response.content_part.done`` (reasoning: the
same with ``response.reasoning_text.delta`` / ``.done``; a call:
``response.function_call_arguments.delta`` / ``.done``), ``response.output_item.done``;
last ``response.completed`` (``response.incomplete`` at ``max_output_tokens``) with the
whole response and its usage. A failure after the headers is an ``error`` event then
``response.failed``, never a cut connection. Events are dicts encoded with msgspec's JSON
encoder (`openai/sse.py`; no pydantic on the per-token path). The stream hands its last
response (completed, incomplete or failed) to ``keep`` before writing it, so a stored
response is the one the client saw (ingress/responses_api.py stores it; ``keep`` may say
it was not stored).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tokenrouter_ray.openai.chat_output import ChatDelta
from tokenrouter_ray.openai.choice_update import ChoiceUpdate
from tokenrouter_ray.openai.errors import as_openai_error
from tokenrouter_ray.openai.responses import ChatCompletion, ChoiceResult, RoutingInfo, Usage
from tokenrouter_ray.openai.responses_input import ResponsesRequest, new_id
from tokenrouter_ray.openai.sse import encode_json
from tokenrouter_ray.openai.token_reports import RequestMetrics
from tokenrouter_ray.openai.validation import SamplingOptions

Status = Literal["in_progress", "completed", "incomplete", "failed", "cancelled"]
_OUT = ConfigDict(extra="forbid")


class ResponseUsage(BaseModel):
    model_config = _OUT

    input_tokens: int
    input_tokens_details: dict[str, int]  # cached_tokens
    output_tokens: int
    output_tokens_details: dict[str, int]  # reasoning_tokens
    total_tokens: int

    @classmethod
    def of(cls, usage: Usage) -> ResponseUsage:
        """Chat's usage renamed; a detail chat leaves out (no model reported its cache, no
        reasoning parsed) is 0 here, where the fields are required."""
        cached, thinking = usage.prompt_tokens_details, usage.completion_tokens_details
        reasoning_tokens = thinking.reasoning_tokens if thinking is not None else 0
        return cls(
            input_tokens=usage.prompt_tokens,
            input_tokens_details={"cached_tokens": cached.cached_tokens if cached else 0},
            output_tokens=usage.completion_tokens,
            output_tokens_details={"reasoning_tokens": reasoning_tokens},
            total_tokens=usage.total_tokens,
        )


class ResponseObject(BaseModel):
    """``object: "response"``, the shape the ``openai`` client parses, plus ``routing`` and
    ``metrics`` (extensions, reachable through ``model_extra`` there)."""

    model_config = _OUT

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Status = "in_progress"
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, str] | None = None
    model: str
    output: list[dict[str, Any]] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    # the request's settings, as served
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float
    top_p: float
    parallel_tool_calls: bool = True
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    reasoning: dict[str, Any] = Field(default_factory=lambda: {"effort": None, "summary": None})
    truncation: Literal["disabled"] = "disabled"
    previous_response_id: str | None = None
    background: bool = False
    store: bool = True  # false: not stored (asked, or too large for the store)
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    routing: RoutingInfo | None = None
    metrics: RequestMetrics | None = None


def response_head(
    request: ResponsesRequest, sampling: SamplingOptions, model: str
) -> ResponseObject:
    """A fresh response to ``request`` (served as ``model``, sampled by ``sampling``),
    before any output."""
    fmt = request.text.format if request.text is not None else None
    summary = request.reasoning.summary if request.reasoning is not None else None
    return ResponseObject(
        id=new_id("resp"),
        created_at=int(time.time()),
        model=model,
        instructions=request.instructions,
        max_output_tokens=request.max_output_tokens,
        temperature=sampling.spec.temperature,
        top_p=sampling.spec.top_p,
        parallel_tool_calls=request.parallel_tool_calls is not False,
        tool_choice=request.tool_choice or "auto",
        tools=request.tools or [],
        text={"format": fmt or {"type": "text"}},
        reasoning={"effort": None, "summary": summary},
        metadata=request.metadata or {},
        user=request.user,
        previous_response_id=request.previous_response_id,
        background=request.background is True,
        store=request.stored,
    )


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}


def _reasoning_text(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


# a text item's kind -> (id prefix, event name prefix of its text, its content part)
TEXT_ITEMS = {
    "message": ("msg", "response.output_text", _output_text),
    "reasoning": ("rs", "response.reasoning_text", _reasoning_text),
}


def text_item(kind: str, item_id: str, text: str | None, status: Status) -> dict[str, Any]:
    """A ``message`` or ``reasoning`` item with ``text`` as its one content part (None: its
    head, no part yet)."""
    content = [] if text is None else [TEXT_ITEMS[kind][2](text)]
    if kind == "message":
        return {
            "type": "message",
            "id": item_id,
            "status": status,
            "role": "assistant",
            "content": content,
        }
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [], "content": content}


def function_call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: Status
) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "status": status,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
    }


def finished(
    head: ResponseObject,
    output: list[dict[str, Any]],
    finish_reason: str | None,
    usage: ResponseUsage,
    routing: RoutingInfo | None,
    metrics: RequestMetrics | None,
) -> ResponseObject:
    """``head`` with its output and usage: ``incomplete`` (and its last item) when the
    output was cut by its token budget, else ``completed``."""
    cut = finish_reason == "length"
    if cut and output:
        output[-1]["status"] = "incomplete"
    return head.model_copy(
        update={
            "status": "incomplete" if cut else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "output": output,
            "usage": usage,
            "routing": routing,
            "metrics": metrics,
        }
    )


def failed(
    head: ResponseObject, message: str, output: list[dict[str, Any]] | None = None
) -> ResponseObject:
    """``head`` ended by an error after it started (``status: "failed"``), with the
    output so far."""
    error = {"code": "server_error", "message": message}
    return head.model_copy(update={"status": "failed", "error": error, "output": output or []})


def cancelled(head: ResponseObject) -> ResponseObject:
    """``head`` cancelled before it ended (a background response: no output kept)."""
    return head.model_copy(update={"status": "cancelled"})


def build_response(head: ResponseObject, completion: ChatCompletion) -> ResponseObject:
    """The non-streamed response: ``completion``'s one choice as output items."""
    (choice,) = completion.choices
    message = choice.message
    output = []
    if message.reasoning_content:
        reasoning = text_item("reasoning", new_id("rs"), message.reasoning_content, "completed")
        output.append(reasoning)
    if message.content is not None:
        output.append(text_item("message", new_id("msg"), message.content, "completed"))
    for call in message.tool_calls or ():
        name, arguments = call.function.name, call.function.arguments
        output.append(function_call_item(new_id("fc"), call.id, name, arguments, "completed"))
    usage = ResponseUsage.of(completion.usage)
    return finished(head, output, choice.finish_reason, usage, completion.routing, choice.metrics)


def _encode(data: Mapping[str, Any]) -> bytes:
    return encode_json(data)


class ResponseStream:
    """The Responses events of one streamed request (one choice), from its choice's
    updates, its result and the request's usage (the module docstring has the sequence).
    An item stays open while deltas of its kind come; another kind closes it and opens the
    next. ``done``: the last event (completed, incomplete or failed) was written. ``keep``:
    called with the last response before its event is written; what it returns is
    written (the response, or it with ``store`` false when it could not be stored)."""

    def __init__(
        self,
        head: ResponseObject,
        keep: Callable[[ResponseObject], ResponseObject] | None = None,
    ) -> None:
        self.head = head
        self.keep = keep
        self.items: list[dict[str, Any]] = []  # the last one is open until closed
        self.open = False
        self.text = ""  # the open item's text (a call: its arguments) so far
        self.answered = False  # a message or a call was opened
        self.finish_reason: str | None = None
        self.metrics: RequestMetrics | None = None
        self.sequence = 0
        self.done = False

    def event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + _encode(data) + b"\n\n"

    def start(self) -> bytes:
        """``response.created`` and ``response.in_progress``."""
        head = self.head.model_dump(mode="json")
        return self.event("response.created", response=head) + self.event(
            "response.in_progress", response=head
        )

    def update(self, update: ChoiceUpdate) -> bytes:
        """The events of one step's delta (``b""``: none)."""
        if self.done:
            return b""
        delta = update.delta
        if not isinstance(delta, ChatDelta):  # no output parser: all of it is content
            return self._text("message", delta) if delta else b""
        out = []
        if delta.reasoning:
            out.append(self._text("reasoning", delta.reasoning))
        if delta.content:
            out.append(self._text("message", delta.content))
        for call in delta.tool_calls:
            out.append(self._call(call.to_dict()))
        return b"".join(out)

    def finish_choice(self, choice: ChoiceResult) -> bytes:
        """The choice ended: its open item closes (``incomplete`` when cut by the token
        budget); an answer with no message or call is an empty message."""
        if self.done:
            return b""
        self.finish_reason = choice.finish_reason
        if choice.metrics is not None:
            self.metrics = choice.metrics
        out = b""
        if not self.answered:  # an empty answer is an empty message
            out = self._open(text_item("message", new_id("msg"), None, "in_progress"))
        cut = self.finish_reason == "length"
        return out + self._close("incomplete" if cut else "completed")

    def end(self, usage: Usage, routing: RoutingInfo | None = None) -> bytes:
        """The last event: the whole response with the request's usage and routing."""
        if self.done:
            return b""
        return self._end(ResponseUsage.of(usage), routing)

    def error(self, exc: BaseException) -> bytes:
        """A failure after the first event: ``error``, then ``response.failed``."""
        if self.done:
            return b""
        return self.fail(as_openai_error(exc).to_dict()["error"])

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def _open(self, item: dict[str, Any]) -> bytes:
        """Close the open item, open ``item`` (its head; a text item's empty part too)."""
        out = self._close("completed") if self.open else b""
        self.items.append(item)
        self.open, self.text = True, ""
        self.answered = self.answered or item["type"] != "reasoning"
        index = len(self.items) - 1
        out += self.event("response.output_item.added", output_index=index, item=item)
        if item["type"] in TEXT_ITEMS:
            part = TEXT_ITEMS[item["type"]][2]("")
            out += self.event(
                "response.content_part.added", **self._where(), content_index=0, part=part
            )
        return out

    def _text(self, kind: str, delta: str) -> bytes:
        """A text delta of a ``message`` or ``reasoning`` item (opened if another is)."""
        prefix, events, _ = TEXT_ITEMS[kind]
        out = b""
        if not self.open or self.items[-1]["type"] != kind:
            out = self._open(text_item(kind, new_id(prefix), None, "in_progress"))
        self.text += delta
        extra = {"logprobs": []} if kind == "message" else {}
        where = self._where()
        return out + self.event(f"{events}.delta", **where, content_index=0, delta=delta, **extra)

    def _call(self, call: Mapping[str, Any]) -> bytes:
        """A streamed tool call piece: the first (with ``id``) opens its item."""
        function = call.get("function") or {}
        out = b""
        if call.get("id") is not None:
            name = function.get("name") or ""
            out = self._open(function_call_item(new_id("fc"), call["id"], name, "", "in_progress"))
        arguments = function.get("arguments") or ""
        if arguments and self.open and self.items[-1]["type"] == "function_call":
            self.text += arguments
            out += self.event(
                "response.function_call_arguments.delta", **self._where(), delta=arguments
            )
        return out

    def _close(self, status: Status) -> bytes:
        """The open item's done events, and the item itself in its final state."""
        if not self.open:
            return b""
        item, where, text = self.items[-1], self._where(), self.text
        item["status"] = status
        self.open = False
        if item["type"] in TEXT_ITEMS:
            _, events, make = TEXT_ITEMS[item["type"]]
            item["content"] = [make(text)]
            extra = {"logprobs": []} if item["type"] == "message" else {}
            out = self.event(f"{events}.done", **where, content_index=0, text=text, **extra)
            out += self.event(
                "response.content_part.done", **where, content_index=0, part=item["content"][0]
            )
        else:
            item["arguments"] = text
            out = self.event(
                "response.function_call_arguments.done", **where, name=item["name"], arguments=text
            )
        index = where["output_index"]
        return out + self.event("response.output_item.done", output_index=index, item=item)

    def _end(self, usage: ResponseUsage, routing: RoutingInfo | None) -> bytes:
        """The last event: the whole response with its usage."""
        response = finished(self.head, self.items, self.finish_reason, usage, routing, self.metrics)
        self.done = True
        if self.keep is not None:
            response = self.keep(response)
        kind = "response.incomplete" if response.status == "incomplete" else "response.completed"
        return self.event(kind, response=response.model_dump(mode="json"))

    def fail(self, error: Mapping[str, Any]) -> bytes:
        """``error`` (OpenAI's error object) as an ``error`` event, then
        ``response.failed`` with the output so far (an open item ``incomplete``)."""
        message = str(error.get("message") or "The server had an error.")
        code = error.get("code") or error.get("type")
        out = self.event("error", code=code, message=message, param=error.get("param"))
        if self.open:
            item = self.items[-1]
            item["status"] = "incomplete"
            if item["type"] in TEXT_ITEMS:
                item["content"] = [TEXT_ITEMS[item["type"]][2](self.text)]
            else:
                item["arguments"] = self.text
            self.open = False
        response = failed(self.head, message, self.items)
        self.done = True
        if self.keep is not None:
            response = self.keep(response)
        return out + self.event("response.failed", response=response.model_dump(mode="json"))
