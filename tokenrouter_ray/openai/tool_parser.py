"""Tool-call parsers: find the function calls a model writes in its content, one delta at a time.

Content text enters through `push` (any split, even inside a tag; after the reasoning
parser, so a call the model only thinks about is not a call) and leaves as ``(content,
calls)``: the text to show and the calls completed by this piece; `finish` flushes what was
held back. One parser per choice.

Format ``hermes`` (Qwen2.5 / Qwen3 and other Hermes-style templates): each call is
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. A call is reported once its
closing tag arrives (streaming: one tool-call delta carrying the id, name and the whole
``arguments`` string, a shape the OpenAI client accumulates like a fragmented one). A block
whose JSON does not parse, or has no string ``name``, stays in the content as the model wrote
it (vLLM does the same), so nothing the model wrote is lost. Whitespace between and after
calls is dropped; text before the first call is content.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from tokenrouter_ray.openai.reasoning import held_prefix

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    """One parsed call; ``arguments`` is a JSON object as text (OpenAI's type)."""

    index: int
    id: str
    name: str
    arguments: str

    def to_dict(self, with_index: bool = False) -> dict[str, Any]:
        """OpenAI's shape (``with_index``: a streamed delta's, which carries ``index``)."""
        call: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return {"index": self.index, **call} if with_index else call


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_call(body: str, index: int) -> ToolCall | None:
    """The call in one ``<tool_call>`` block's text, or None if it is not one."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments pre-encoded
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(index, new_call_id(), obj["name"], json.dumps(args, ensure_ascii=False))


class HermesToolParser:
    """The stateful finder of one choice's calls (see the module docstring)."""

    def __init__(self, max_calls: int | None = None) -> None:
        self.max_calls = max_calls  # 1 with parallel_tool_calls=false: later calls dropped
        self.calls: list[ToolCall] = []
        self._in_call = False
        self._held = ""  # a possible partial tag, a call's body, or whitespace after a call

    def push(self, text: str) -> tuple[str, list[ToolCall]]:
        buf, self._held = self._held + text, ""
        content, calls = "", []
        while buf:
            if self._in_call:
                end = buf.find(TOOL_CALL_END)
                if end < 0:
                    self._held = buf
                    break
                body, buf = buf[:end], buf[end + len(TOOL_CALL_END) :]
                self._in_call = False
                call = parse_call(body, len(self.calls))
                if call is None:
                    content += TOOL_CALL_START + body + TOOL_CALL_END
                elif self.max_calls is None or len(self.calls) < self.max_calls:
                    self.calls.append(call)
                    calls.append(call)
                continue
            start = buf.find(TOOL_CALL_START)
            if start >= 0:
                content += self._text(buf[:start])
                buf, self._in_call = buf[start + len(TOOL_CALL_START) :], True
                continue
            keep = held_prefix(buf, TOOL_CALL_START)
            text, self._held = buf[: len(buf) - keep], buf[len(buf) - keep :]
            if self.calls and not text.strip():  # whitespace after a call: wait and see
                self._held = text + self._held
            else:
                content += self._text(text)
            break
        return content, calls

    def _text(self, text: str) -> str:
        return text.strip() if self.calls and not text.strip() else text

    def finish(self) -> tuple[str, list[ToolCall]]:
        """An unclosed block is parsed as if closed (a model may stop right before the
        tag); if it does not parse, it is content. Trailing whitespace after calls goes."""
        held, self._held = self._held, ""
        if self._in_call:
            self._in_call = False
            call = parse_call(held, len(self.calls))
            if call is None:
                return TOOL_CALL_START + held, []
            if self.max_calls is not None and len(self.calls) >= self.max_calls:
                return "", []
            self.calls.append(call)
            return "", [call]
        return ("" if self.calls and not held.strip() else held), []
