"""Non-streaming response bodies, shaped exactly like OpenAI's, plus the `routing` extension.

The ingress collects one `ChoiceResult` per choice (text from its detokenizer, the finish
reason, its token count, and the routing stats the runtime reports) and calls
`build_completion` / `build_chat_completion`; the returned model is serialised with
``model_dump(mode="json")``. The official ``openai`` client parses these bodies; the extra
``routing`` field (response-level: summed over choices; choice-level: that choice's) is
reachable there through ``model_extra``, as are each choice's ``metrics`` (always) and
``routing_trace`` (when asked; absent otherwise). A chat message parsed for reasoning or
tools carries ``reasoning_content`` (vLLM's field; absent when there was no thinking) and
``tool_calls`` (absent when none; ``content`` is null when only calls came; each a
`MessageToolCall`). ``logprobs`` (when asked) has OpenAI's shapes: a choice's reports come
typed (`token_reports.TokenDetails`) and become its JSON objects here.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tokenrouter_ray.openai.chat_output import ParsedMessage
from tokenrouter_ray.openai.errors import InternalServerError
from tokenrouter_ray.openai.token_reports import RequestMetrics, TokenDetails
from tokenrouter_ray.openai.tool_parser import ToolCall

FinishReason = Literal["stop", "length", "tool_calls"]

_OUT = ConfigDict(extra="forbid")


def completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def chat_completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def finish_reason(engine_reason: str | None, stopped_by_string: bool = False) -> FinishReason:
    """OpenAI's finish reason from the engine's (``"stop"``, ``"length"``, ...).

    A stop string seen by the detokenizer is ``"stop"`` whatever the engine says (it was
    aborted). ``"error"`` is a server fault and raises `InternalServerError`.
    """
    if stopped_by_string:
        return "stop"
    if engine_reason == "error":
        raise InternalServerError()
    return "length" if engine_reason == "length" else "stop"


class RoutingInfo(BaseModel):
    """Extension: which model produced the output, and how often control moved."""

    model_config = _OUT

    tokens_per_model: dict[str, int] = Field(
        default_factory=dict, description="Committed output tokens per model name."
    )
    handoffs: int = Field(0, ge=0, description="Times control passed between models.")
    mode: Literal["routed", "alone"] = Field(
        "routed",
        description="routed: the routing policy chose a model at every position; alone: one "
        "model served the request by itself (`routing.model`, or the server's policy.alone).",
    )
    reason: str | None = Field(
        None,
        description="Why this mode: request (its `routing`), config (the server's "
        "policy.alone), quality (the quality target's operating point), speed (the faster "
        "mode at this load, tuner.speed_bypass), learning or explore (the speed bypass "
        "measuring a mode); null: the policy's default routing.",
    )

    @classmethod
    def of(
        cls, metrics: RequestMetrics, handoffs: int, alone: bool = False, reason: str | None = None
    ) -> RoutingInfo:
        """A choice's routing, from the one count of its tokens per writer (its metrics':
        the tokens of the response, so a stop string's cut is not counted)."""
        counts = {m: n for m, n in metrics.tokens_per_model.items() if n}
        mode = "alone" if alone else "routed"
        return cls(tokens_per_model=counts, handoffs=handoffs, mode=mode, reason=reason)

    @classmethod
    def merge(cls, infos: Iterable[RoutingInfo | None]) -> RoutingInfo:
        """The sum over choices."""
        tokens: dict[str, int] = {}
        handoffs = 0
        mode, reason = "routed", None
        for info in infos:
            if info is None:
                continue
            handoffs += info.handoffs
            mode, reason = info.mode, info.reason  # a request's choices are served alike
            for name, count in info.tokens_per_model.items():
                tokens[name] = tokens.get(name, 0) + count
        return cls(tokens_per_model=tokens, handoffs=handoffs, mode=mode, reason=reason)


class PromptTokensDetails(BaseModel):
    model_config = _OUT

    cached_tokens: int = Field(
        description="Prompt tokens the entry model found in its prefix cache (their KV was "
        "reused, not computed)."
    )


class CompletionTokensDetails(BaseModel):
    model_config = _OUT

    reasoning_tokens: int = Field(
        description="Completion tokens inside the thinking block (its tags included)."
    )


class Usage(BaseModel):
    model_config = _OUT

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None

    @classmethod
    def of(
        cls,
        prompt_tokens: int,
        completion_tokens: int,
        cached_tokens: int | None = None,
        reasoning_tokens: int | None = None,
    ) -> Usage:
        """``cached_tokens`` None (no model reported it: every choice ended before its
        model's report) leaves ``prompt_tokens_details`` out; ``reasoning_tokens`` None (no
        reasoning parsed: completions, a template without thinking) leaves
        ``completion_tokens_details`` out."""
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=(
                None if cached_tokens is None else PromptTokensDetails(cached_tokens=cached_tokens)
            ),
            completion_tokens_details=(
                None
                if reasoning_tokens is None
                else CompletionTokensDetails(reasoning_tokens=reasoning_tokens)
            ),
        )

    @classmethod
    def of_choices(cls, prompt_tokens: int, choices: Iterable[ChoiceResult]) -> Usage:
        """The response's usage: completion and reasoning tokens summed over its choices;
        cached prompt tokens as the choice whose model found the most (each choice is its
        own request at the entry model; the prompt is counted once, as OpenAI does)."""
        choices = list(choices)
        cached = [
            c.metrics.cached_tokens
            for c in choices
            if c.metrics is not None and c.metrics.cached_tokens is not None
        ]
        thinking = [c.reasoning_tokens for c in choices if c.reasoning_tokens is not None]
        return cls.of(
            prompt_tokens,
            sum(c.num_tokens for c in choices),
            max(cached) if cached else None,
            sum(thinking) if thinking else None,
        )


@dataclass(frozen=True)
class ChoiceResult:
    """What the ingress knows about one finished choice."""

    index: int
    text: str
    finish_reason: FinishReason
    num_tokens: int  # completion tokens (the detokenizer's `num_tokens`)
    routing: RoutingInfo | None = None
    metrics: RequestMetrics | None = None
    # non-streaming: the whole output's ``routing_trace`` / ``logprobs`` when asked;
    # streaming: those of the tokens no earlier chunk reported (the finish chunk's)
    details: TokenDetails | None = None
    # chat, when the output was parsed: its reasoning / content / tool calls (None: all
    # of ``text`` is content)
    message: ParsedMessage | None = None
    # chat with reasoning parsed: how many of ``num_tokens`` were thinking (None: not parsed)
    reasoning_tokens: int | None = None


class CompletionChoice(BaseModel):
    model_config = _OUT

    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: FinishReason
    routing: RoutingInfo | None = None
    metrics: RequestMetrics | None = None
    routing_trace: dict[str, Any] | None = Field(None, exclude_if=lambda v: v is None)


class Completion(BaseModel):
    """``POST /v1/completions`` response (``object: "text_completion"``)."""

    model_config = _OUT

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    system_fingerprint: str | None = None
    routing: RoutingInfo | None = None


class CalledFunction(BaseModel):
    model_config = _OUT

    name: str
    arguments: str = Field(description="A JSON object as text, as the model wrote it.")


class MessageToolCall(BaseModel):
    """One tool call in a message, OpenAI's shape."""

    model_config = _OUT

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction

    @classmethod
    def of(cls, call: ToolCall) -> MessageToolCall:
        return cls(id=call.id, function=CalledFunction(name=call.name, arguments=call.arguments))


class AssistantMessage(BaseModel):
    model_config = _OUT

    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: None = None
    reasoning_content: str | None = Field(None, exclude_if=lambda v: v is None)
    tool_calls: list[MessageToolCall] | None = Field(None, exclude_if=lambda v: v is None)

    @classmethod
    def of(cls, choice: ChoiceResult) -> AssistantMessage:
        """``content`` alone, or the parsed parts (content null when only calls came)."""
        parts = choice.message
        if parts is None:
            return cls(content=choice.text)
        calls = [MessageToolCall.of(c) for c in parts.tool_calls] or None
        return cls(
            content=None if calls and not parts.content else parts.content,
            reasoning_content=parts.reasoning or None,
            tool_calls=calls,
        )


class ChatChoice(BaseModel):
    model_config = _OUT

    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: FinishReason
    routing: RoutingInfo | None = None
    metrics: RequestMetrics | None = None
    routing_trace: dict[str, Any] | None = Field(None, exclude_if=lambda v: v is None)


class ChatCompletion(BaseModel):
    """``POST /v1/chat/completions`` response (``object: "chat.completion"``)."""

    model_config = _OUT

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    routing: RoutingInfo | None = None


def _choice_fields(choice: ChoiceResult) -> dict[str, Any]:
    """What a completion choice and a chat choice both carry of a ``ChoiceResult``."""
    return dict(
        index=choice.index,
        finish_reason=choice.finish_reason,
        routing=choice.routing,
        metrics=choice.metrics,
        **(choice.details.to_fields() if choice.details is not None else {}),
    )


def _response_fields(
    rid: str, created: int | None, model: str, prompt_tokens: int, ordered: list[ChoiceResult]
) -> dict[str, Any]:
    """What a completion and a chat completion both carry: id, time, model, usage, routing."""
    return dict(
        id=rid,
        created=int(time.time()) if created is None else created,
        model=model,
        usage=Usage.of_choices(prompt_tokens, ordered),
        routing=RoutingInfo.merge(c.routing for c in ordered),
    )


def build_completion(
    model: str,
    prompt_tokens: int,
    choices: Sequence[ChoiceResult],
    *,
    request_id: str | None = None,
    created: int | None = None,
) -> Completion:
    ordered = sorted(choices, key=lambda c: c.index)
    return Completion(
        choices=[CompletionChoice(text=c.text, **_choice_fields(c)) for c in ordered],
        **_response_fields(request_id or completion_id(), created, model, prompt_tokens, ordered),
    )


def build_chat_completion(
    model: str,
    prompt_tokens: int,
    choices: Sequence[ChoiceResult],
    *,
    request_id: str | None = None,
    created: int | None = None,
) -> ChatCompletion:
    ordered = sorted(choices, key=lambda c: c.index)
    rid = request_id or chat_completion_id()
    return ChatCompletion(
        choices=[ChatChoice(message=AssistantMessage.of(c), **_choice_fields(c)) for c in ordered],
        **_response_fields(rid, created, model, prompt_tokens, ordered),
    )
