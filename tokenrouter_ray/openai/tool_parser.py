"""Tool-call parsers: find the function calls a model writes in its content, one delta at a time.

Content text enters through `push` (any split, even inside a tag; after the reasoning
parser, so a call the model only thinks about is not a call) and leaves as ``(content,
calls)``: the text to show and the calls completed by this piece; `finish` flushes what was
held back. One parser per choice.

Format ``hermes`` (Qwen2.5 / Qwen3 and other Hermes-style templates): each call is
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. A call is parsed when its
closing tag arrives. A block
whose JSON does not parse, or has no string ``name``, stays in the content as the model wrote
it (vLLM does the same), so nothing the model wrote is lost. Whitespace between and after
calls is dropped; text before the first call is content.

Streaming (`ToolCallDelta`): as vLLM does, a call's first delta carries its ``index``,
``id`` and ``name`` as soon as the block's head is in, and the ``arguments`` text follows
as the model writes it, in OpenAI's streamed shape; the non-streamed message's
``arguments`` is the same text (what the model wrote, not re-encoded). A call whose head
went out is a call, even if its arguments turn out malformed (the client saw it start); a
block written another way is reported in one delta when it closes.
"""

from __future__ import annotations

import json
import re
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
    arguments: str  # a message carries it as ``responses.MessageToolCall``


def tool_format_for(tokenizer: Any) -> str | None:
    """The tool-call format the chat template teaches the model: ``"hermes"`` when it
    names ``<tool_call>``; None when this server has no parser for it."""
    template = getattr(tokenizer, "chat_template", None)
    return "hermes" if isinstance(template, str) and TOOL_CALL_START in template else None


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


class _CallStream:
    """One ``<tool_call>`` block as it arrives: once its head (``{"name": "...",
    "arguments": {``) is in, a header delta (id, name) goes out, then the arguments object's
    text as it is written, ending where the object closes (a JSON scan that knows strings
    and escapes). A block written another way (keys in the other order, arguments as a
    string) is reported whole when it closes."""

    HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\{)')
    NOT_HEAD = re.compile(r'"arguments"\s*:\s*\S')  # the arguments began, and HEAD did not match
    MAX_HEAD = 512  # no head within this many characters: report the block whole

    def __init__(self, index: int) -> None:
        self.index = index
        self.body = ""
        self.id: str | None = None  # set once the header delta went out
        self.name = ""
        self._start = 0  # where the arguments object starts in ``body``
        self._pos = 0  # scanned up to here
        self._depth = 0
        self._in_string = self._escaped = False
        self.end: int | None = None  # where the arguments object ends (exclusive)
        self._whole = False

    @property
    def streaming(self) -> bool:
        return self.id is not None

    @property
    def arguments(self) -> str:
        return self.body[self._start : self.end if self.end is not None else self._pos]

    def feed(self, text: str) -> list[ToolCallDelta]:
        """The deltas ``text`` (more of the block's body) makes safe to send."""
        self.body += text
        deltas = []
        if not self.streaming and not self._whole:
            head = self.HEAD.match(self.body)
            if head is not None:
                name = json.loads(f'"{head.group(1)}"')
                self.id, self.name, self._start = new_call_id(), name, head.end()
                self._pos = self._start
                deltas.append(ToolCallDelta(self.index, "", self.id, self.name))
            elif self.NOT_HEAD.search(self.body) or len(self.body) > self.MAX_HEAD:
                self._whole = True
        if self.streaming and self.end is None:
            sent = self._pos
            self._scan()
            if self._pos > sent:
                deltas.append(ToolCallDelta(self.index, self.body[sent : self._pos]))
        return deltas

    def _scan(self) -> None:
        for i in range(self._pos, len(self.body)):
            ch = self.body[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._pos = self.end = i + 1
                    return
        self._pos = len(self.body)


@dataclass(frozen=True)
class ToolCallDelta:
    """A streamed piece of call ``index``: the first carries its id and name."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """OpenAI's streamed shape: ``{index, id?, type?, function: {name?, arguments}}``."""
        function: dict[str, Any] = {"arguments": self.arguments}
        if self.name is not None:
            function = {"name": self.name, **function}
        head = {"id": self.id, "type": "function"} if self.id is not None else {}
        return {"index": self.index, **head, "function": function}

    @classmethod
    def whole(cls, call: ToolCall) -> ToolCallDelta:
        return cls(call.index, call.arguments, call.id, call.name)


class HermesToolParser:
    """The stateful finder of one choice's calls (see the module docstring)."""

    def __init__(self, max_calls: int | None = None) -> None:
        self.max_calls = max_calls  # 1 with parallel_tool_calls=false: later calls dropped
        self.calls: list[ToolCall] = []  # complete calls, in order
        self._call: _CallStream | None = None  # the block being read
        self._held = ""  # a possible partial tag, or whitespace after a call

    @property
    def _room(self) -> bool:
        return self.max_calls is None or len(self.calls) < self.max_calls

    def push(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """``(content, call deltas)`` that ``text`` makes safe to send."""
        buf, self._held = self._held + text, ""
        content, deltas = "", []
        while buf:
            if self._call is not None:
                end = buf.find(TOOL_CALL_END)  # the body so far holds no (partial) end tag
                if end < 0:  # keep a possible partial end tag out of the body
                    keep = held_prefix(buf, TOOL_CALL_END)
                    part, self._held = buf[: len(buf) - keep], buf[len(buf) - keep :]
                    deltas += self._feed(part)
                    break
                part, buf = buf[:end], buf[end + len(TOOL_CALL_END) :]
                deltas += self._feed(part)
                text_out, closed = self._close()
                content += text_out
                deltas += closed
                continue
            start = buf.find(TOOL_CALL_START)
            if start >= 0:
                content += self._text(buf[:start])
                buf, self._call = buf[start + len(TOOL_CALL_START) :], _CallStream(len(self.calls))
                continue
            keep = held_prefix(buf, TOOL_CALL_START)
            text, self._held = buf[: len(buf) - keep], buf[len(buf) - keep :]
            if self.calls and not text.strip():  # whitespace after a call: wait and see
                self._held = text + self._held
            else:
                content += self._text(text)
            break
        return content, deltas

    def _feed(self, part: str) -> list[ToolCallDelta]:
        assert self._call is not None
        deltas = self._call.feed(part)
        return deltas if self._room else []  # past max_calls: read, never sent

    def _close(self) -> tuple[str, list[ToolCallDelta]]:
        """The block ended: record its call; a block that is not a call is content."""
        call, self._call = self._call, None
        assert call is not None
        if not self._room:
            return "", []
        if call.streaming:  # its deltas went out already: it is a call, as sent
            self.calls.append(ToolCall(call.index, call.id or "", call.name, call.arguments))
            return "", []
        parsed = parse_call(call.body, call.index)
        if parsed is None:
            return TOOL_CALL_START + call.body + TOOL_CALL_END, []
        self.calls.append(parsed)
        return "", [ToolCallDelta.whole(parsed)]

    def _text(self, text: str) -> str:
        return text.strip() if self.calls and not text.strip() else text

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """An unclosed block is taken as if closed (a model may stop right before the
        tag); if it is not a call, it is content. Trailing whitespace after calls goes."""
        held, self._held = self._held, ""
        if self._call is not None:
            deltas = self._feed(held)
            if not self._call.streaming and parse_call(self._call.body, 0) is None:
                body, self._call = self._call.body, None
                return TOOL_CALL_START + body, []
            text, closed = self._close()
            return text, deltas + closed
        return ("" if self.calls and not held.strip() else held), []
