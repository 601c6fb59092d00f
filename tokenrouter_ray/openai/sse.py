"""Server-sent events: framing, and the chunk sequence of one streaming request.

Each choice's `ChoiceUpdate` s (openai/choice_update.py: a step's text or parsed chat
delta, with its token reports) and its `ChoiceResult` enter a `ChatStream` /
`CompletionStream` (one per request, all ``n`` choices; `merge_choice_streams` interleaves
them); ready-to-send SSE bytes leave. The order is OpenAI's:

- chat: one role chunk per choice (``delta: {"role": "assistant", "content": ""}``), then
  content chunks (a parsed answer's deltas carry ``reasoning_content``, ``content`` and
  ``tool_calls`` in OpenAI's streamed shape, each call with its ``index``), then per choice
  a chunk with empty ``delta`` and its ``finish_reason`` (``"tool_calls"`` after calls);
- completions: text chunks, then per choice a chunk with ``text: ""`` and ``finish_reason``;
- with ``stream_options.include_usage``: every chunk carries ``"usage": null`` and a last
  chunk has ``choices: []`` and the request's usage;
- ``data: [DONE]``.

Extension: each finish chunk carries a top-level ``routing`` with that choice's stats and,
in its choice, that choice's ``metrics``; the usage chunk, when sent, carries ``routing``
summed over choices. A request that asked for ``logprobs`` or a ``routing_trace`` gets, in
each chunk's choice, those of the tokens whose text the chunk carries (the finish chunk:
the rest). Chunks are built as dicts (the typed reports' ``to_dict``) and encoded with
msgspec's JSON encoder (no pydantic on the per-token path, and several times faster
than `json.dumps`). It writes the same JSON values: floats in their shortest
round-trip form (``0.00001`` where `json.dumps` wrote ``1e-05``), and a non-finite float
as ``null`` (valid JSON, where `json.dumps` wrote ``-Infinity``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import Any, Protocol

import msgspec
from pydantic import BaseModel

from tokenrouter_ray.openai.chat_output import ChatDelta
from tokenrouter_ray.openai.choice_update import ChoiceUpdate
from tokenrouter_ray.openai.errors import as_openai_error
from tokenrouter_ray.openai.responses import (
    ChoiceResult,
    FinishReason,
    RoutingInfo,
    Usage,
    chat_completion_id,
    completion_id,
)
from tokenrouter_ray.openai.token_reports import RequestMetrics, TokenDetails

SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
SSE_MEDIA_TYPE = "text/event-stream"

encode_json = msgspec.json.Encoder().encode  # compact; non-ASCII kept as UTF-8


def sse_event(obj: BaseModel | Mapping[str, Any]) -> bytes:
    """One event: ``data: {json}\\n\\n`` (compact JSON, non-ASCII kept as UTF-8)."""
    data = obj.model_dump(mode="json") if isinstance(obj, BaseModel) else obj
    return b"data: " + encode_json(data) + b"\n\n"


def sse_error(exc: BaseException) -> bytes:
    """An error after the stream started (status already sent): the envelope as an event.
    The ``openai`` client raises ``APIError`` on it. Send `SSE_DONE` after it."""
    return sse_event(as_openai_error(exc).to_dict())


class _Stream:
    object: str = ""
    content_key: str = ""  # the choice's field for its new output: "delta" / "text"

    def __init__(
        self,
        model: str,
        n: int = 1,
        *,
        include_usage: bool = False,
        request_id: str | None = None,
        created: int | None = None,
    ) -> None:
        self.id = request_id or self._new_id()
        self.model = model
        self.n = n
        self.include_usage = include_usage
        self.created = int(time.time()) if created is None else created

    def _new_id(self) -> str:
        raise NotImplementedError

    def _choice(
        self,
        index: int,
        content: Any,
        finish: FinishReason | None = None,
        details: TokenDetails | None = None,
        metrics: RequestMetrics | None = None,
    ) -> dict[str, Any]:
        """One choice of a chunk: its new output under ``content_key``; its tokens'
        ``logprobs`` / ``routing_trace`` (``details``) over the defaults, then the choice's
        ``metrics`` (finish chunks)."""
        choice = {"index": index, self.content_key: content, "logprobs": None,
                  "finish_reason": finish}  # fmt: skip
        if details is not None:
            choice.update(details.to_fields())
        if metrics is not None:
            choice["metrics"] = metrics.model_dump()
        return choice

    def _chunk(
        self, choices: list[dict[str, Any]], routing: RoutingInfo | None = None
    ) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            chunk["usage"] = None
        if routing is not None:
            chunk["routing"] = routing.model_dump()
        return chunk

    def update(self, update: ChoiceUpdate) -> bytes:
        """The content chunk of one choice's update (``b""`` when empty)."""
        return self.delta(update.index, update.delta, update.details)

    def finish_choice(self, choice: ChoiceResult) -> bytes:
        """The finish chunk of a finished choice: its reason, routing and metrics, and the
        reports of the tokens no update carried."""
        return self.finish(
            choice.index, choice.finish_reason, choice.routing,
            details=choice.details, metrics=choice.metrics,
        )  # fmt: skip

    def delta(self, index: int, text: Any, details: TokenDetails | None = None) -> bytes:
        raise NotImplementedError

    def finish(
        self,
        index: int,
        reason: FinishReason,
        routing: RoutingInfo | None = None,
        text: Any = "",
        details: TokenDetails | None = None,
        metrics: RequestMetrics | None = None,
    ) -> bytes:
        raise NotImplementedError

    def end(self, usage: Usage, routing: RoutingInfo | None = None) -> bytes:
        """The usage chunk (only with ``include_usage``), then ``[DONE]``. ``usage``: the
        request's (``Usage.of_choices``); ``routing``: summed over choices (see `merge`)."""
        if not self.include_usage:
            return SSE_DONE
        chunk = self._chunk([], routing)
        chunk["usage"] = usage.model_dump(exclude_none=True)
        return sse_event(chunk) + SSE_DONE

    def error(self, exc: BaseException) -> bytes:
        """The end of a stream that failed after it started: the error event, then
        ``[DONE]``."""
        return sse_error(exc) + SSE_DONE


class ChatStream(_Stream):
    """The ``chat.completion.chunk`` events of one chat request."""

    object = "chat.completion.chunk"
    content_key = "delta"

    def _new_id(self) -> str:
        return chat_completion_id()

    def start(self) -> bytes:
        """One role chunk per choice; send before any content."""
        return b"".join(
            sse_event(self._chunk([self._choice(i, {"role": "assistant", "content": ""})]))
            for i in range(self.n)
        )

    def delta(
        self, index: int, text: str | ChatDelta, details: TokenDetails | None = None
    ) -> bytes:
        """A content chunk for choice ``index`` (``details``: its tokens' ``logprobs`` /
        ``routing_trace``); ``text`` is the content, or a parsed `ChatDelta` (its
        ``reasoning_content`` / ``content`` / ``tool_calls``); ``b""`` when empty."""
        if not text:
            return b""
        delta = text.to_dict() if isinstance(text, ChatDelta) else {"content": text}
        return sse_event(self._chunk([self._choice(index, delta, None, details)]))

    def finish(
        self,
        index: int,
        reason: FinishReason,
        routing: RoutingInfo | None = None,
        text: str | ChatDelta = "",
        details: TokenDetails | None = None,
        metrics: RequestMetrics | None = None,
    ) -> bytes:
        """The last chunk of choice ``index``: ``finish_reason``, its routing and metrics;
        its delta is empty, or carries ``text`` (e.g. the detokenizer's `finish` output)."""
        delta = text.to_dict() if isinstance(text, ChatDelta) else {"content": text} if text else {}
        choice = self._choice(index, delta, reason, details, metrics)
        return sse_event(self._chunk([choice], routing))


class CompletionStream(_Stream):
    """The ``text_completion`` events of one completions request."""

    object = "text_completion"
    content_key = "text"

    def _new_id(self) -> str:
        return completion_id()

    def start(self) -> bytes:
        """Nothing: completions streams have no role chunk (here for symmetry)."""
        return b""

    def delta(self, index: int, text: str, details: TokenDetails | None = None) -> bytes:
        """A text chunk for choice ``index`` (``details``: its tokens' ``logprobs`` /
        ``routing_trace``); ``b""`` for empty text."""
        if not text:
            return b""
        return sse_event(self._chunk([self._choice(index, text, None, details)]))

    def finish(
        self,
        index: int,
        reason: FinishReason,
        routing: RoutingInfo | None = None,
        text: str = "",
        details: TokenDetails | None = None,
        metrics: RequestMetrics | None = None,
    ) -> bytes:
        """The last chunk of choice ``index``: ``finish_reason``, its routing and metrics,
        and ``text`` (default ``""``; e.g. the detokenizer's `finish` output)."""
        choice = self._choice(index, text, reason, details, metrics)
        return sse_event(self._chunk([choice], routing))


class StreamWriter(Protocol):
    """What writes one streaming request's events from its choices' updates: a
    `ChatStream` / `CompletionStream`, or the Responses API's ``ResponseStream``
    (openai/responses_output.py)."""

    def start(self) -> bytes: ...  # before any update

    def update(self, update: ChoiceUpdate) -> bytes: ...  # one choice's step

    def finish_choice(self, choice: ChoiceResult) -> bytes: ...  # one choice's end

    def end(self, usage: Usage, routing: RoutingInfo | None = None) -> bytes: ...  # the last

    def error(self, exc: BaseException) -> bytes: ...  # a failure after the start


class WriterHooks(Protocol):
    """What the writer tells a backpressure gate (``ingress/backpressure.py``'s
    ``StreamGate``): it is about to hand a frame to the server, and the server took it."""

    def sending(self) -> None: ...

    def sent(self, pieces: Iterable[int] = ()) -> None: ...


class _NoHooks:
    def sending(self) -> None:
        pass

    def sent(self, pieces: Iterable[int] = ()) -> None:
        pass


class _Ended:
    """In a request's update queue after a choice's last update: its task ended."""

    __slots__ = ("task",)

    def __init__(self, task: asyncio.Future[ChoiceResult]) -> None:
        self.task = task


async def merge_choice_streams(
    stream: StreamWriter,
    tasks: Sequence[asyncio.Future[ChoiceResult]],
    updates: asyncio.Queue[Any],
    prompt_len: int,
    hooks: WriterHooks | None = None,
) -> AsyncIterator[bytes]:
    """The SSE frames of one request whose ``n`` choices run as ``tasks``, as ``stream``
    writes them: each `ChoiceUpdate` from ``updates`` as it comes, each choice's finish
    chunk as its task ends (after its last updates), then usage and ``[DONE]`` (a
    ``ResponseStream``: its events). A choice that fails ends the stream with the writer's
    ``error`` (the OpenAI error event and ``[DONE]``; the other choices are cancelled),
    never a cut connection. Closing the generator early (a client disconnect) cancels
    every choice's task. ``hooks`` hear of every frame handed to the server and of the
    choices whose update it carried (backpressure: a frame is taken by the client when the
    generator is resumed after yielding it).

    A task's end is queued behind its updates (a done callback), so one ``updates.get()``
    waits for either; whatever is queued when the writer wakes goes out as one frame (its
    events in order), one hand-over to the server however many choices and steps it
    carries."""
    hooks = hooks or _NoHooks()
    try:
        hooks.sending()
        yield stream.start()
        hooks.sent()
        for task in tasks:
            task.add_done_callback(lambda t: updates.put_nowait(_Ended(t)))
        running = len(tasks)
        while running:
            queued = [await updates.get()]
            while not updates.empty():
                queued.append(updates.get_nowait())
            frame: list[bytes] = []
            pieces: list[int] = []
            for item in queued:
                if not isinstance(item, _Ended):
                    frame.append(stream.update(item))
                    pieces.append(item.index)
                    continue
                running -= 1
                try:
                    choice = item.task.result()
                except Exception as exc:
                    if frame:
                        hooks.sending()
                        yield b"".join(frame)
                        hooks.sent(pieces)
                    yield stream.error(exc)
                    return
                frame.append(stream.finish_choice(choice))
            hooks.sending()
            data = b"".join(frame)
            if data:  # updates with no text (held back) send nothing
                yield data
            hooks.sent(pieces)
        results = [t.result() for t in tasks]
        hooks.sending()
        yield stream.end(
            Usage.of_choices(prompt_len, results), RoutingInfo.merge(c.routing for c in results)
        )
        hooks.sent()
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
