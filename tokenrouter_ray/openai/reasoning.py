"""Reasoning parsers: split a chat answer's thinking from its content, one text delta at a time.

Text enters as the detokenizer's pieces (`push`, any split, even inside a tag) and leaves as
``(reasoning, content)`` pairs; `finish` flushes what a possible partial tag held back. One
parser per choice. The split follows vLLM's names: the thinking goes to the message's (and
streamed delta's) ``reasoning_content``, the rest to ``content``.

Families (`reasoning_parser_for` picks one from the chat template):

- ``qwen3``: ``<think>...</think>``. The model writes ``<think>`` itself (Qwen3), or the
  prompt already ends inside an open ``<think>`` (templates that open the block for the
  model; ``opens_in_reasoning``). With ``enable_thinking=False`` the template renders an
  empty closed block, the output carries no tag, and everything is content. A block cut by
  ``max_tokens`` before ``</think>`` is all reasoning. The newlines right after
  ``</think>`` are dropped (the template drops them too when the answer is sent back).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


def held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


@dataclass(frozen=True)
class ReasoningFormat:
    """A family's thinking markers."""

    name: str
    start: str
    end: str


QWEN3 = ReasoningFormat("qwen3", "<think>", "</think>")
REASONING_FORMATS = {f.name: f for f in (QWEN3,)}


class ReasoningParser:
    """The stateful splitter of one choice's text (see the module docstring)."""

    _START, _REASONING, _CONTENT = range(3)

    def __init__(self, fmt: ReasoningFormat = QWEN3, in_reasoning: bool = False) -> None:
        self.fmt = fmt
        self._state = self._REASONING if in_reasoning else self._START
        self.thought = in_reasoning  # a thinking block opened (possibly empty)
        self._held = ""
        self._strip_newlines = False  # just after the end tag

    @property
    def in_reasoning(self) -> bool:
        return self._state == self._REASONING

    def push(self, text: str) -> tuple[str, str]:
        """``(reasoning, content)`` that ``text`` (after what was held) makes safe to show."""
        buf = self._held + text
        self._held = ""
        reasoning = content = ""
        if self._state == self._START:
            head = buf.lstrip()
            if not head or (len(head) < len(self.fmt.start) and self.fmt.start.startswith(head)):
                self._held = buf  # could still become the start tag
                return "", ""
            if head.startswith(self.fmt.start):
                self._state, buf = self._REASONING, head[len(self.fmt.start) :]
                self.thought = True
            else:
                self._state = self._CONTENT
        if self._state == self._REASONING:
            end = buf.find(self.fmt.end)
            if end < 0:
                keep = held_prefix(buf, self.fmt.end)
                self._held = buf[len(buf) - keep :] if keep else ""
                return buf[: len(buf) - keep], ""
            reasoning, buf = buf[:end], buf[end + len(self.fmt.end) :]
            self._state, self._strip_newlines = self._CONTENT, True
        if self._strip_newlines:
            buf = buf.lstrip("\n")
            self._strip_newlines = not buf
        content = buf
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back: reasoning inside an unclosed block, content otherwise."""
        held, self._held = self._held, ""
        if self._state == self._REASONING:
            return held, ""
        return "", held.lstrip() if self._state == self._START else held


def reasoning_token_count(
    text: str, token_ends: Sequence[int], num_tokens: int, fmt: ReasoningFormat, thought: bool
) -> int:
    """How many of a choice's ``num_tokens`` output tokens were thinking (OpenAI's
    ``completion_tokens_details.reasoning_tokens``): those up to and including the one that
    completes the end tag in the decoded ``text`` (``token_ends[i]``: where token i's text
    ends); all of them when the block never closed; 0 when the answer had no thinking."""
    if not thought:
        return 0
    end = text.find(fmt.end)
    if end < 0:
        return num_tokens
    return min(num_tokens, bisect_left(token_ends, end + len(fmt.end)) + 1)


def reasoning_parser_for(tokenizer: Any) -> ReasoningFormat | None:
    """The reasoning format the tokenizer's chat template uses; None when it has no
    thinking (the parser is then off and everything is content)."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return None
    for fmt in REASONING_FORMATS.values():
        if fmt.start in template and fmt.end in template:
            return fmt
    return None


def prompt_opens_reasoning(tokenizer: Any, prompt_ids: Sequence[int], fmt: ReasoningFormat) -> bool:
    """Whether the rendered prompt ends inside an open thinking block (the template wrote
    the start tag for the model)."""
    tail = tokenizer.decode(list(prompt_ids[-8:]), skip_special_tokens=False)
    return tail.rfind(fmt.start) > tail.rfind(fmt.end)
