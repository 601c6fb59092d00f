"""``POST /v1/responses`` requests (OpenAI's Responses API), served as the chat request each
one maps to.

A JSON body enters as a `ResponsesRequest` (through `validation.parse_request`; the policy on
fields is chat's: strict types, an unknown field logged once and dropped, a field this
server does not implement accepted only at its neutral value). `prepare_responses` builds
the equivalent ``ChatCompletionRequest`` body (`chat_body`), validates it with chat's schema
and prepares it with `validation.prepare_chat`, so the request is rendered, limited, sampled
and its answer parsed exactly as that chat request. It leaves as the chat path's
`PreparedRequest`, or as a 400 whose ``param`` names the Responses field (``input[2]``,
``max_output_tokens``, ``text.format``, ``tools[0].name``), not the chat one it became.

The mapping (chat fields on the right):

- ``instructions`` -> a first ``system`` message; ``input`` -> ``messages``: a string is
  one ``user`` message; a ``message`` item (``type`` optional; role ``user``, ``system``,
  ``developer`` or ``assistant``; content a string or ``input_text`` / ``output_text``
  parts, joined with ``"\\n"``) is that message; a ``function_call`` item is a call in
  ``tool_calls`` of the assistant message before it (or of a new one); a
  ``function_call_output`` item is a ``tool`` message; a ``reasoning`` item's text (its
  ``content``, else its ``summary``) is the ``reasoning_content`` of the next assistant
  message (dropped when a non-assistant message comes first). So a client that sends a
  response's ``output`` items back gets the prompt chat would render for that history.
- ``max_output_tokens`` -> ``max_completion_tokens``; ``temperature``, ``top_p``,
  ``parallel_tool_calls`` as they are; function ``tools`` (``{type, name, description,
  parameters, strict}``) -> ``{type, function: {...}}``; ``tool_choice`` ``{type:
  "function", name}`` -> ``{type, function: {name}}``; ``text.format`` ->
  ``response_format``; ``stream`` -> ``stream`` with ``stream_options.include_usage`` (the
  stream's last event carries the usage).
- `PASSTHROUGH`: chat's extensions (``seed``, ``routing``, ``top_k``, ``ignore_eos``, ...),
  copied verbatim, so chat's schema checks them and its errors name them as sent.
- ``previous_response_id``: the ingress (ingress/responses_api.py) finds the stored
  response and sets the request's `ResponsesRequest.context` (that response's input items,
  then its output items); they come before ``input``, and an error in them names
  ``previous_response_id``. ``instructions`` are the request's own (OpenAI's rule: a previous
  response's are not carried over).

`stored_items` gives the request's input as the items a stored response keeps (OpenAI's
item shapes, each with an id), which ``GET /v1/responses/{id}/input_items`` lists.
"""

from __future__ import annotations

import re
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic_core import PydanticCustomError

from tokenrouter_ray.openai.errors import (
    ContextLengthExceededError,
    InvalidRequestError,
    OpenAIError,
    from_validation_error,
)
from tokenrouter_ray.openai.generation_defaults import GenerationDefaults
from tokenrouter_ray.openai.schemas import (
    ChatCompletionRequest,
    _check_text,
    _Lenient,
    _unsupported,
)
from tokenrouter_ray.openai.validation import (
    PreparedRequest,
    RequestLimits,
    parse_request,
    prepare_chat,
)

# chat fields a Responses body may carry, passed on verbatim (chat's schema checks them)
PASSTHROUGH = frozenset(
    {
        "seed", "top_k", "min_p", "repetition_penalty", "presence_penalty",
        "frequency_penalty", "logit_bias", "stop", "stop_token_ids", "ignore_eos",
        "min_tokens", "include_stop_str_in_output", "skip_special_tokens", "cache_salt",
        "routing", "chat_template_kwargs", "timeout",
    }
)  # fmt: skip
TEXT_PARTS = ("input_text", "output_text")
INCLUDE_ACCEPTED = ("reasoning.encrypted_content",)  # accepted; nothing is encrypted
RESPONSE_ID_PREFIX = "resp_"


def new_id(prefix: str) -> str:
    """``resp``, ``msg``, ``rs``, ``fc``: OpenAI's id prefixes."""
    return f"{prefix}_{uuid.uuid4().hex}"


def _text(value: Any) -> Any:
    """Content as one string: a string, or ``input_text`` / ``output_text`` parts joined
    with ``"\\n"`` (their other keys, e.g. an output part's ``annotations``, ignored)."""
    if isinstance(value, str):
        return _check_text(value, "content")
    if not isinstance(value, list):
        raise PydanticCustomError(
            "invalid_type", "content must be a string or a list of input_text parts"
        )
    texts: list[str] = []
    for part in value:
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise PydanticCustomError(
                "invalid_type",
                'each content part must be an object like {"type": "input_text", "text": ...}',
            )
        if part["type"] not in TEXT_PARTS:
            raise _unsupported(
                f"Content part type {part['type']!r} is not supported by this server; only "
                "input_text and output_text parts are"
            )
        if not isinstance(part.get("text"), str):
            raise PydanticCustomError("invalid_type", "a text content part needs a string 'text'")
        texts.append(_check_text(part["text"], "content"))
    return "\n".join(texts)


Text = Annotated[str, BeforeValidator(_text)]


def _input(value: Any) -> Any:
    """A string, or a list of objects (each checked as its item type by `chat_body`)."""
    if isinstance(value, str):
        return _check_text(value, "input")
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise PydanticCustomError(
            "invalid_type", "input must be a string or a list of input items (objects)"
        )
    return value


class InputMessage(_Lenient):
    """An ``input`` message (an output ``message`` item sent back is one too)."""

    PART: ClassVar[str] = "input message"

    type: Literal["message"] = Field("message", description="Optional on input.")
    role: Literal["user", "system", "developer", "assistant"]
    content: Text = Field(description="A string or a list of input_text / output_text parts.")
    id: str | None = Field(None, description="Accepted (an output item's id); ignored.")
    status: str | None = Field(None, description="Accepted (an output item's); ignored.")


class FunctionCallItem(_Lenient):
    """A call the model made (an output ``function_call`` item sent back)."""

    PART: ClassVar[str] = "function_call item"

    type: Literal["function_call"]
    call_id: str = Field(min_length=1, description="The call's id; its output names it.")
    name: str = Field(min_length=1, description="The function called.")
    arguments: str = Field(description="A JSON object, as text.")
    id: str | None = Field(None, description="Accepted; ignored.")
    status: str | None = Field(None, description="Accepted; ignored.")


class FunctionCallOutputItem(_Lenient):
    """The result of a call, for the model (a ``tool`` message)."""

    PART: ClassVar[str] = "function_call_output item"

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, description="The call it answers.")
    output: Text = Field(description="A string or a list of input_text parts.")
    id: str | None = Field(None, description="Accepted; ignored.")
    status: str | None = Field(None, description="Accepted; ignored.")


class ReasoningPart(_Lenient):
    PART: ClassVar[str] = "reasoning part"

    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(_Lenient):
    """A response's reasoning sent back: the next assistant message's thinking."""

    PART: ClassVar[str] = "reasoning item"

    type: Literal["reasoning"]
    id: str | None = Field(None, description="Accepted; ignored.")
    summary: list[ReasoningPart] = Field(default_factory=list, description="Used without content.")
    content: list[ReasoningPart] | None = Field(None, description="The reasoning text.")
    encrypted_content: str | None = Field(None, description="Only null (none is ever issued).")
    status: str | None = Field(None, description="Accepted; ignored.")

    @field_validator("encrypted_content")
    @classmethod
    def _not_encrypted(cls, value: str | None) -> str | None:
        if value is not None:
            raise _unsupported(
                "Encrypted reasoning is not supported by this server (it never issues any); "
                "send the reasoning item's text in 'content' instead"
            )
        return value

    @property
    def text(self) -> str:
        return "\n".join(p.text for p in (self.content or self.summary))


ITEMS: dict[str, type[BaseModel]] = {
    "message": InputMessage,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}


class ReasoningOptions(_Lenient):
    """``reasoning``: no effort levels here (Qwen3: ``chat_template_kwargs``)."""

    PART: ClassVar[str] = "reasoning"

    effort: str | None = Field(None, description="Only null.")
    summary: str | None = Field(None, description="Accepted; the item has the whole text.")
    generate_summary: str | None = Field(None, description="Deprecated alias; accepted.")

    @field_validator("effort")
    @classmethod
    def _no_effort(cls, value: str | None) -> str | None:
        if value is not None:
            raise _unsupported(
                f"'reasoning.effort' = {value!r} is not supported by this server; leave it "
                "unset or null (Qwen3: chat_template_kwargs.enable_thinking)"
            )
        return value


class TextOptions(_Lenient):
    """``text``: the output format."""

    PART: ClassVar[str] = "text"

    format: dict[str, Any] | None = Field(
        None, description="text, json_object or json_schema {type, name, schema, strict}."
    )
    verbosity: str | None = Field(None, description='Only null or "medium".')

    @field_validator("verbosity")
    @classmethod
    def _no_verbosity(cls, value: str | None) -> str | None:
        if value not in (None, "medium"):
            raise _unsupported(
                f"'text.verbosity' = {value!r} is not supported by this server; leave it "
                "unset, null or medium"
            )
        return value


class ResponsesStreamOptions(_Lenient):
    PART: ClassVar[str] = "stream_options"

    include_obfuscation: bool | None = Field(None, description="Accepted; none is added.")


class ResponsesRequest(_Lenient):
    """``POST /v1/responses``: OpenAI's fields, plus chat's extensions (`PASSTHROUGH`, kept
    in ``model_extra``). `context`: the items of the response ``previous_response_id``
    names, set by the ingress from its store (none until then)."""

    model_config = ConfigDict(extra="allow", strict=True)
    KNOWN_EXTRA: ClassVar[frozenset[str]] = PASSTHROUGH
    # field -> value(s) it may take although the feature is not implemented (besides null
    # and false)
    NEUTRAL: ClassVar[dict[str, tuple[Any, ...]]] = {
        "conversation": (),
        "prompt": (),
        "truncation": ("disabled",),
        "top_logprobs": (0,),
        "routing_trace": (),
    }

    model: str = Field(min_length=1, description="Served model name (see GET /v1/models).")
    input: Annotated[str | list[dict[str, Any]], BeforeValidator(_input)] = Field(
        description="A string (one user message) or a list of input items."
    )
    instructions: str | None = Field(None, description="A system message before the input.")
    max_output_tokens: int | None = Field(
        None, ge=1, description="Output tokens at most (reasoning included)."
    )
    temperature: float | None = Field(None, ge=0, le=2, description="0 is greedy; default 1.")
    top_p: float | None = Field(None, gt=0, le=1, description="Nucleus mass; default 1.")
    stream: bool | None = Field(None, description="Answer with server-sent events.")
    stream_options: ResponsesStreamOptions | None = Field(None, description="Accepted.")
    tools: list[dict[str, Any]] | None = Field(None, description="Function tools only.")
    tool_choice: str | dict[str, Any] | None = Field(
        None, description='"auto", "none", "required" or {"type": "function", "name": ...}.'
    )
    parallel_tool_calls: bool | None = Field(None, description="false: one call at most.")
    text: TextOptions | None = Field(None, description="`format`: the output's format.")
    reasoning: ReasoningOptions | None = Field(None, description="Accepted; effort only null.")
    include: list[str] | None = Field(None, description="Only reasoning.encrypted_content.")
    max_tool_calls: int | None = Field(None, ge=1, description="Accepted (built-in tools only).")
    user: str | None = Field(None, description="Accepted and ignored.")
    store: bool | None = Field(
        None, description="false: not stored (no GET, no previous_response_id); default true."
    )
    metadata: dict[str, str] | None = Field(None, description="Accepted; echoed back.")
    service_tier: str | None = Field(None, description="Accepted and ignored.")
    safety_identifier: str | None = Field(None, description="Accepted and ignored.")
    prompt_cache_key: str | None = Field(None, description="Accepted and ignored.")
    prompt_cache_retention: str | None = Field(None, description="Accepted and ignored.")
    previous_response_id: str | None = Field(
        None, description="A stored response this one continues (its input and output first)."
    )
    conversation: str | dict[str, Any] | None = Field(None, description="Only null.")
    prompt: dict[str, Any] | None = Field(None, description="Only null (no stored prompts).")
    background: bool | None = Field(
        None, description="Answer at once (in_progress); poll GET, cancel. Needs store."
    )
    truncation: str | None = Field(None, description='Only "disabled" (too long: a 400).')
    top_logprobs: int | None = Field(None, description="Only 0 or null.")
    routing_trace: bool | None = Field(None, description="Only false (chat serves it).")
    _context: list[dict[str, Any]] = PrivateAttr(default_factory=list)

    @field_validator(*NEUTRAL)
    @classmethod
    def _neutral_only(cls, value: Any, info: ValidationInfo) -> Any:
        name = info.field_name or "?"
        if value is not None and value is not False and value not in cls.NEUTRAL[name]:
            stored = name in ("conversation", "prompt")
            why = "no conversations or prompts are stored here" if stored else "not implemented"
            raise _unsupported(
                f"'{name}' is not supported by this server ({why}); leave it unset or null"
            )
        return value

    @field_validator("include")
    @classmethod
    def _include(cls, value: list[str] | None) -> list[str] | None:
        for name in value or ():
            if name not in INCLUDE_ACCEPTED:
                raise _unsupported(
                    f"'include' value {name!r} is not supported by this server; only "
                    f"{', '.join(INCLUDE_ACCEPTED)} is accepted"
                )
        return value

    @property
    def extensions(self) -> dict[str, Any]:
        """The `PASSTHROUGH` fields sent, as sent."""
        return {k: v for k, v in (self.model_extra or {}).items() if k in PASSTHROUGH}

    @property
    def context(self) -> list[dict[str, Any]]:
        """The items before ``input``: the ``previous_response_id`` response's input items
        and output items, in order (stored items: never changed)."""
        return self._context

    def continue_from(self, items: list[dict[str, Any]]) -> None:
        """Set `context` (the ingress, from the stored response)."""
        self._context = items

    @property
    def stored(self) -> bool:
        """``store`` as OpenAI defaults it (true unless false)."""
        return self.store is not False


def chat_body(request: ResponsesRequest) -> tuple[dict[str, Any], list[str]]:
    """The chat body ``request`` maps to (the module docstring), and for each of its
    messages the field it came from (``instructions``, ``input`` or ``input[i]``). A
    Responses-only shape error is a 400 here: an item or tool type this server has no
    chat equivalent for, a malformed item."""
    messages, origins = _messages(request)
    body: dict[str, Any] = {"model": request.model, "messages": messages}
    mapped = {
        "max_completion_tokens": request.max_output_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "tools": _tools(request.tools),
        "tool_choice": _tool_choice(request.tool_choice),
        "parallel_tool_calls": request.parallel_tool_calls,
        "response_format": _response_format(request.text),
    }
    body.update({k: v for k, v in mapped.items() if v is not None})
    body.update(request.extensions)
    if request.stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body, origins


def _sources(request: ResponsesRequest) -> list[tuple[dict[str, Any], tuple[str | int, ...]]]:
    """Every input item with where it came from (an error's ``param``): `context` first
    (``previous_response_id``), then ``input`` (``input``, a string, or ``input[i]``)."""
    out: list[tuple[dict[str, Any], tuple[str | int, ...]]]
    out = [(raw, ("previous_response_id",)) for raw in request.context]
    if isinstance(request.input, str):
        return [*out, ({"role": "user", "content": request.input}, ("input",))]
    return [*out, *((raw, ("input", i)) for i, raw in enumerate(request.input))]


def _messages(request: ResponsesRequest) -> tuple[list[dict[str, Any]], list[str]]:
    messages: list[dict[str, Any]] = []
    origins: list[str] = []
    if request.instructions is not None:
        messages.append({"role": "system", "content": request.instructions})
        origins.append("instructions")
    reasoning: str | None = None  # for the next assistant message
    for raw, loc in _sources(request):
        item = _item(raw, loc)
        if isinstance(item, ReasoningItem):
            reasoning = item.text or None
            continue
        if isinstance(item, FunctionCallItem):
            function = {"name": item.name, "arguments": item.arguments}
            call = {"id": item.call_id, "type": "function", "function": function}
            last = messages[-1] if messages else None
            if reasoning is None and last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
                continue
            message: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [call]}
        elif isinstance(item, FunctionCallOutputItem):
            message = {"role": "tool", "tool_call_id": item.call_id, "content": item.output}
        else:
            assert isinstance(item, InputMessage)
            message = {"role": item.role, "content": item.content}
        if message["role"] == "assistant" and reasoning is not None:
            message["reasoning_content"] = reasoning
        reasoning = None
        messages.append(message)
        origins.append(_param(loc))
    return messages, origins


def _param(loc: tuple[str | int, ...]) -> str:
    """``("input", 2)`` -> ``input[2]``."""
    return "".join(f"[{part}]" if isinstance(part, int) else part for part in loc)


def _item(raw: dict[str, Any], loc: tuple[str | int, ...]) -> BaseModel:
    """The input item at ``loc`` (``("input", i)``) as its model; errors name ``loc...``."""
    kind = raw.get("type", "message")
    model = ITEMS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise InvalidRequestError(
            f"Input items of type {kind!r} are not supported by this server; only message, "
            "function_call, function_call_output and reasoning items are (item_reference is "
            "not resolved: continue a stored response with previous_response_id instead).",
            param=f"{_param(loc)}.type",
            code="unsupported_value",
        )
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        errors = [{**e, "loc": (*loc, *e["loc"])} for e in exc.errors()]
        raise from_validation_error(errors) from None


ITEM_ID_PREFIXES = {
    "message": "msg",
    "function_call": "fc",
    "function_call_output": "fco",
    "reasoning": "rs",
}


def stored_items(request: ResponsesRequest) -> list[dict[str, Any]]:
    """``request.input`` (not its `context`) as a stored response keeps it: each item in
    OpenAI's shape with an id (the client's, else a new one), a message's content as
    ``input_text`` parts (``output_text`` for the assistant's). Sent back as input, the
    items render the same prompt (the items were checked by `chat_body` already)."""
    sources = _sources(request)[len(request.context) :]
    return [_stored(raw, _item(raw, loc)) for raw, loc in sources]


def _stored(raw: dict[str, Any], item: BaseModel) -> dict[str, Any]:
    kind = raw.get("type", "message")
    out: dict[str, Any] = {
        "type": kind,
        "id": getattr(item, "id", None) or new_id(ITEM_ID_PREFIXES[kind]),
    }
    if isinstance(item, InputMessage):
        part = "output_text" if item.role == "assistant" else "input_text"
        parts = raw["content"] if isinstance(raw["content"], list) else [{"text": raw["content"]}]
        out.update(role=item.role, content=[_part(p.get("type", part), p["text"]) for p in parts])
    elif isinstance(item, ReasoningItem):
        out.update(item.model_dump(include={"summary", "content"}, exclude_none=True))
    elif isinstance(item, FunctionCallItem):
        out.update(call_id=item.call_id, name=item.name, arguments=item.arguments)
    else:
        assert isinstance(item, FunctionCallOutputItem)
        out.update(call_id=item.call_id, output=item.output)
    out["status"] = getattr(item, "status", None) or "completed"
    return out


def _part(kind: str, text: str) -> dict[str, Any]:
    """A text content part (an ``output_text`` one with OpenAI's empty annotations)."""
    return {"type": kind, "text": text, **({"annotations": []} if kind == "output_text" else {})}


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise InvalidRequestError(
                f"Tools of type {tool.get('type')!r} are not supported by this server; only "
                "function tools are (no built-in tools).",
                param=f"tools[{i}].type",
                code="unsupported_value",
            )
        out.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
    return out


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice  # chat's schema checks the word
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise InvalidRequestError(
        '\'tool_choice\' must be "none", "auto", "required" or {"type": "function", "name": '
        "...} on this server (no built-in tools).",
        param="tool_choice",
        code="unsupported_value",
    )


def _response_format(text: TextOptions | None) -> dict[str, Any] | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.get("type") != "json_schema":
        return fmt
    return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}


# chat parameter -> the Responses one (applied in order, to the start of ``param``)
_PARAMS = (
    (re.compile(r"^(n x )?max_completion_tokens"), "max_output_tokens"),
    (re.compile(r"^response_format(\.json_schema)?"), "text.format"),
    (re.compile(r"^tools\[(\d+)\]\.function"), r"tools[\1]"),
    (re.compile(r"^messages$"), "input"),
)
_MESSAGE = re.compile(r"^messages\[(\d+)\]")


def responses_param(param: str, origins: list[str]) -> str:
    """A chat error's ``param`` as the Responses field it came from (``messages[k]...``:
    the origin of message k, without the chat path inside it)."""
    found = _MESSAGE.match(param)
    if found is not None and int(found.group(1)) < len(origins):
        return origins[int(found.group(1))]
    for pattern, name in _PARAMS:
        param = pattern.sub(name, param)
    return param


def prepare_responses(
    request: ResponsesRequest,
    tokenizer: Any,
    limits: RequestLimits,
    defaults: GenerationDefaults | None = None,
) -> PreparedRequest:
    """The chat body of ``request``, validated and prepared as chat's (`prepare_chat`);
    an error on the way names the Responses field (`responses_param`)."""
    body, origins = chat_body(request)
    try:
        return prepare_chat(parse_request(ChatCompletionRequest, body), tokenizer, limits, defaults)
    except OpenAIError as exc:
        if exc.param is not None:
            old, exc.param = exc.param, responses_param(exc.param, origins)
            exc.message = exc.message.replace(f"'{old}'", f"'{exc.param}'")
        if isinstance(exc, ContextLengthExceededError):  # "your messages resulted in ..."
            exc.message = re.sub(r"\bmessages\b", "input", exc.message)
        raise
