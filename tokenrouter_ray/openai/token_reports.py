"""What a choice reports about its tokens when asked, in the response's shapes: the routing
trace (``routing_trace``), OpenAI's ``logprobs`` (chat and completions), and the
per-request ``metrics`` object every choice carries.

Input: the choice's output token ids and, per token, the model that wrote it and the
`TokenInfo` its COMMIT carried (`protocol.CommitLog` keeps both at the ingress). Output:
typed parts (`RoutingTrace`, `ChatLogprobs`, `CompletionLogprobs`), paired per range of
tokens as one `TokenDetails`; each turns into its JSON object with ``to_dict()`` where a
chunk or a response is encoded (no pydantic on the per-token path). A range ``[start,
end)`` of output tokens becomes one part: the whole output for a response, the tokens a
chunk settles when streaming (their concatenation over chunks is the response's).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from tokenrouter_ray.protocol import FinishSummary, TokenInfo


class TokenText:
    """Token id -> its text decoded alone (cached: the vocabulary bounds the cache)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self.tokenizer.decode(
                [token_id], skip_special_tokens=True
            )
        return text


def _at(items: Sequence[Any], i: int) -> Any:
    return items[i] if i < len(items) else None


@dataclass(frozen=True, slots=True)
class TracedToken:
    """One output token of a ``routing_trace``: its id and text, the model that wrote it
    and the router's score (None: not scored)."""

    id: int
    text: str
    model: str | None
    score: float | None

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "text": self.text, "model": self.model, "score": self.score}


@dataclass(frozen=True, slots=True)
class DroppedToken:
    """A proposal the policy dropped at output position ``index``, and who replaced it."""

    index: int
    id: int
    text: str
    model: str
    score: float | None
    replaced_by: str | None

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "id": self.id, "text": self.text, "model": self.model,
                "score": self.score, "replaced_by": self.replaced_by}  # fmt: skip


@dataclass(frozen=True, slots=True)
class RoutingTrace:
    """The ``routing_trace`` of a range of output tokens (drop indices absolute)."""

    models: list[str]
    tokens: list[TracedToken]
    dropped: list[DroppedToken]

    def to_dict(self) -> dict[str, Any]:
        return {
            "models": self.models,
            "tokens": [t.to_dict() for t in self.tokens],
            "dropped": [d.to_dict() for d in self.dropped],
        }


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """Chat's entry for one token: its text, logprob and UTF-8 bytes; a sampled token's
    entry has its ``top_logprobs`` (None: this is one of them)."""

    token: str
    logprob: float | None
    bytes: list[int]
    top_logprobs: list[TokenLogprob] | None = None

    def to_dict(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"token": self.token, "logprob": self.logprob,
                                 "bytes": self.bytes}  # fmt: skip
        if self.top_logprobs is not None:
            entry["top_logprobs"] = [t.to_dict() for t in self.top_logprobs]
        return entry


@dataclass(frozen=True, slots=True)
class ChatLogprobs:
    """Chat's ``choice.logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""

    content: list[TokenLogprob]

    def to_dict(self) -> dict[str, Any]:
        return {"content": [t.to_dict() for t in self.content]}


@dataclass(frozen=True, slots=True)
class CompletionLogprobs:
    """Completions' ``choice.logprobs``: per token its text, logprob, the most likely
    tokens' text -> logprob, and where its text starts in the choice's text."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]

    def to_dict(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs,
                "top_logprobs": self.top_logprobs, "text_offset": self.text_offset}  # fmt: skip


@dataclass(frozen=True, slots=True)
class TokenDetails:
    """What a range of output tokens reports, each part only when the request asked for
    it (None: not asked): ``logprobs`` in the endpoint's shape and the ``routing_trace``."""

    logprobs: ChatLogprobs | CompletionLogprobs | None = None
    routing_trace: RoutingTrace | None = None

    def to_fields(self) -> dict[str, Any]:
        """The choice fields they set: ``logprobs`` and/or ``routing_trace``, as JSON
        objects (a part not asked for is left out)."""
        fields: dict[str, Any] = {}
        if self.logprobs is not None:
            fields["logprobs"] = self.logprobs.to_dict()
        if self.routing_trace is not None:
            fields["routing_trace"] = self.routing_trace.to_dict()
        return fields


def trace_part(
    token_ids: Sequence[int],
    writers: Sequence[str | None],
    infos: Sequence[TokenInfo | None],
    start: int,
    end: int,
    text: Callable[[int], str],
    models: Sequence[str],
) -> RoutingTrace:
    """The ``routing_trace`` of output tokens ``[start, end)`` (drop indices absolute)."""
    tokens: list[TracedToken] = []
    dropped: list[DroppedToken] = []
    for i in range(start, end):
        token, writer, info = token_ids[i], _at(writers, i), _at(infos, i)
        tokens.append(TracedToken(token, text(token), writer, None if info is None else info.score))
        for d in () if info is None else info.dropped:
            dropped.append(DroppedToken(i, d.token, text(d.token), d.model, d.score, writer))
    return RoutingTrace(list(models), tokens, dropped)


def _entry(
    token: int,
    logprob: float | None,
    text: Callable[[int], str],
    top: list[TokenLogprob] | None = None,
) -> TokenLogprob:
    piece = text(token)
    return TokenLogprob(piece, logprob, list(piece.encode("utf-8")), top)


def chat_logprobs_part(
    token_ids: Sequence[int],
    infos: Sequence[TokenInfo | None],
    start: int,
    end: int,
    text: Callable[[int], str],
) -> ChatLogprobs:
    """Chat's ``choice.logprobs`` of output tokens ``[start, end)``."""
    content = []
    for i in range(start, end):
        info = _at(infos, i)
        top = (
            []
            if info is None
            else [
                _entry(t, lp, text) for t, lp in zip(info.top_ids, info.top_logprobs, strict=True)
            ]
        )
        content.append(_entry(token_ids[i], None if info is None else info.logprob, text, top))
    return ChatLogprobs(content)


def completion_logprobs_part(
    token_ids: Sequence[int],
    infos: Sequence[TokenInfo | None],
    start: int,
    end: int,
    text: Callable[[int], str],
    token_ends: Sequence[int],
) -> CompletionLogprobs:
    """Completions' ``choice.logprobs`` of output tokens ``[start, end)``;
    ``top_logprobs[i]`` maps the k most likely tokens' text to their logprob, plus the
    sampled token's when it is not among them (OpenAI's rule); ``text_offset[i]`` is where
    token i's text starts in the choice's text."""
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float]] = []
    offsets: list[int] = []
    for i in range(start, end):
        token, info = token_ids[i], _at(infos, i)
        tokens.append(text(token))
        values.append(None if info is None else info.logprob)
        top: dict[str, float] = {}
        if info is not None:
            for t, lp in zip(info.top_ids, info.top_logprobs, strict=True):
                top.setdefault(text(t), lp)
            if token not in info.top_ids and info.logprob is not None:
                top.setdefault(text(token), info.logprob)
        tops.append(top)
        if i == 0 or not token_ends:
            offsets.append(0)
        else:
            offsets.append(token_ends[min(i, len(token_ends)) - 1])
    return CompletionLogprobs(tokens, values, tops, offsets)


class RequestMetrics(BaseModel):
    """Extension: one choice's timings and routing, like vLLM's per-request metrics.

    Ingress clock: ``ttft_s``, ``mean_itl_s``, ``e2e_s``, ``tokens_per_s``,
    ``tokens_per_model`` (of the ``completion_tokens``). Reported by the models with the
    request's end (None when the choice ended before they reported: cut by a stop string,
    aborted): ``queue_s``, ``handoffs``, ``dropped_tokens``, ``pending_s``, ``peer_bytes``.
    """

    model_config = ConfigDict(extra="forbid")

    ttft_s: float | None = Field(None, description="Submit to the first committed token.")
    queue_s: float | None = Field(
        None, description="Submit to the start of the first step computing it (entry model)."
    )
    mean_itl_s: float | None = Field(None, description="Mean gap between output tokens.")
    e2e_s: float | None = Field(None, description="Submit to the end of the choice.")
    tokens_per_s: float | None = Field(None, description="completion_tokens / e2e_s.")
    tokens_per_model: dict[str, int] = Field(
        default_factory=dict, description="Completion tokens by the model that wrote them."
    )
    handoffs: int | None = Field(None, description="HANDOFF messages between models.")
    dropped_tokens: int | None = Field(
        None, description="Sampled tokens the policy dropped for another model to redo."
    )
    pending_s: dict[str, float] | None = Field(
        None, description="Per model: time it kept the request's KV while another owned it."
    )
    peer_bytes: int | None = Field(
        None, description="Encoded bytes of the HANDOFF messages sent for this request."
    )
    cached_tokens: int | None = Field(
        None, description="Prompt tokens the entry model found in its prefix cache."
    )


def request_metrics(
    num_tokens: int,
    writers: Sequence[str | None],
    models: Sequence[str],
    ttft_s: float | None,
    mean_itl_s: float | None,
    e2e_s: float | None,
    handoffs: int,
    summary: FinishSummary | None,
) -> RequestMetrics:
    """The metrics of a choice of ``num_tokens`` completion tokens."""
    per_model: dict[str, int] = dict.fromkeys(models, 0)
    for writer in writers[:num_tokens]:
        if writer is not None:
            per_model[writer] = per_model.get(writer, 0) + 1
    rate = num_tokens / e2e_s if e2e_s else None
    pending: Mapping[str, float] | None = None
    if summary is not None:
        pending = {**dict.fromkeys(models, 0.0), **summary.pending_s}
    return RequestMetrics(
        ttft_s=ttft_s,
        queue_s=None if summary is None else summary.queue_s,
        mean_itl_s=mean_itl_s,
        e2e_s=e2e_s,
        tokens_per_s=rate,
        tokens_per_model=per_model,
        handoffs=handoffs,
        dropped_tokens=None if summary is None else summary.dropped,
        pending_s=None if pending is None else dict(pending),
        peer_bytes=None if summary is None else summary.peer_bytes,
        cached_tokens=None if summary is None else summary.cached_tokens,
    )
