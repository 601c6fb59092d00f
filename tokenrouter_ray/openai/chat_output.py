"""A chat choice's output as OpenAI's message parts: reasoning, content and tool calls.

`ChatOutputSpec` (built by `validation.prepare_chat`, carried on the `PreparedRequest`) says
which parsers a request's answer goes through; `ChatOutputSpec.parser()` makes one
`ChatOutputParser` per choice. The ingress calls `push` once per step with the text the
detokenizer released (any number of tokens' worth) and `finish` once at the end; each
returns one `ChatDelta`, the typed delta of that step (``reasoning_content``, ``content``,
``tool_calls``), which the SSE layer turns into a chunk and which accumulates into the
non-streamed message (`ChatOutputParser.message`, a `ParsedMessage`). Text flows
reasoning parser → tool parser: a call written while thinking is thinking, not a call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tokenrouter_ray.openai.reasoning import (
    QWEN3,
    ReasoningFormat,
    ReasoningParser,
    reasoning_token_count,
)
from tokenrouter_ray.openai.tool_parser import HermesToolParser, ToolCall, ToolCallDelta

FinishReasonT = TypeVar("FinishReasonT", bound=str)


@dataclass
class ChatDelta:
    """What one step adds to a chat choice (empty parts are not sent)."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)

    def add(self, other: ChatDelta) -> None:
        self.content += other.content
        self.reasoning += other.reasoning
        self.tool_calls += other.tool_calls

    def to_dict(self) -> dict[str, Any]:
        """The streamed ``delta`` object (vLLM's field name ``reasoning_content``)."""
        delta: dict[str, Any] = {}
        if self.reasoning:
            delta["reasoning_content"] = self.reasoning
        if self.content:
            delta["content"] = self.content
        if self.tool_calls:
            delta["tool_calls"] = [c.to_dict() for c in self.tool_calls]
        return delta


@dataclass(frozen=True)
class ParsedMessage:
    """A whole parsed answer: what the non-streamed message carries."""

    content: str
    reasoning: str
    tool_calls: list[ToolCall]


@dataclass(frozen=True)
class ChatOutputSpec:
    """Which parsers a chat request's output goes through (None: that part is off)."""

    reasoning: ReasoningFormat | None = None
    opens_in_reasoning: bool = False  # the prompt ends inside an open thinking block
    tools: bool = False  # the request offered tools (tool_choice not "none")
    max_tool_calls: int | None = None  # 1 with parallel_tool_calls=false

    @property
    def active(self) -> bool:
        return self.reasoning is not None or self.tools

    def parser(self) -> ChatOutputParser:
        return ChatOutputParser(self)


class ChatOutputParser:
    """One choice's parsers, chained; `message` is everything so far."""

    def __init__(self, spec: ChatOutputSpec) -> None:
        self.reasoning = (
            ReasoningParser(spec.reasoning or QWEN3, spec.opens_in_reasoning)
            if spec.reasoning is not None
            else None
        )
        self.tools = HermesToolParser(spec.max_tool_calls) if spec.tools else None
        self._sent = ChatDelta()  # every delta so far, summed

    @property
    def message(self) -> ParsedMessage:
        calls = list(self.tools.calls) if self.tools is not None else []
        return ParsedMessage(self._sent.content, self._sent.reasoning, calls)

    @property
    def has_tool_calls(self) -> bool:
        return self.tools is not None and bool(self.tools.calls)

    def push(self, text: str) -> ChatDelta:
        """The typed delta of one step's text."""
        return self._route(*self.reasoning.push(text) if self.reasoning else ("", text))

    def finish(self) -> ChatDelta:
        """The delta of what the parsers held back; call once, after the last `push`."""
        delta = ChatDelta()
        if self.reasoning is not None:
            delta.add(self._route(*self.reasoning.finish()))
        if self.tools is not None:
            content, calls = self.tools.finish()
            delta.add(self._record(ChatDelta(content, "", calls)))
        return delta

    def end(self, tail: str) -> ChatDelta:
        """The last delta: ``tail`` (the detokenizer's `finish`) and what was held back."""
        delta = self.push(tail) if tail else ChatDelta()
        delta.add(self.finish())
        return delta

    def reasoning_tokens(self, text: str, token_ends: Sequence[int], num_tokens: int) -> int | None:
        """The output tokens that were thinking (``reasoning_token_count`` over the
        detokenizer's ``text`` and ``token_ends``); None when reasoning is not parsed."""
        if self.reasoning is None:
            return None
        return reasoning_token_count(
            text, token_ends, num_tokens, self.reasoning.fmt, self.reasoning.thought
        )

    def finish_reason(self, reason: FinishReasonT) -> FinishReasonT:
        """``"tool_calls"`` for an answer that ended by itself after calling tools."""
        return "tool_calls" if reason == "stop" and self.has_tool_calls else reason  # type: ignore[return-value]

    def _route(self, reasoning: str, content: str) -> ChatDelta:
        calls: list[ToolCallDelta] = []
        if self.tools is not None and content:
            content, calls = self.tools.push(content)
        return self._record(ChatDelta(content, reasoning, calls))

    def _record(self, delta: ChatDelta) -> ChatDelta:
        self._sent.add(delta)
        return delta
