"""The reasoning and tool-call parsers on text alone: what they split, whatever the split of
the input into deltas (every piece size, tags cut anywhere)."""

from __future__ import annotations

import json

import pytest

from tokenrouter_ray.openai.chat_output import ChatDelta, ChatOutputSpec, ParsedMessage
from tokenrouter_ray.openai.reasoning import QWEN3

BOTH = ChatOutputSpec(reasoning=QWEN3, tools=True)


def run(spec: ChatOutputSpec, text: str, size: int) -> tuple[ParsedMessage, list[ChatDelta]]:
    """Feed ``text`` in pieces of ``size``; check that the streamed deltas, accumulated as
    a client does, are the whole message; return both."""
    parser = spec.parser()
    deltas = [parser.push(text[i : i + size]) for i in range(0, len(text), size)]
    deltas.append(parser.finish())
    message = parser.message
    assert "".join(d.content for d in deltas) == message.content
    assert "".join(d.reasoning for d in deltas) == message.reasoning
    calls: dict[int, dict[str, str]] = {}
    for d in deltas:
        for piece in d.tool_calls:
            slot = calls.setdefault(piece.index, {"id": "", "name": "", "arguments": ""})
            slot["id"] += piece.id or ""
            slot["name"] += piece.name or ""
            slot["arguments"] += piece.arguments
    assert calls == {
        c.index: {"id": c.id, "name": c.name, "arguments": c.arguments} for c in message.tool_calls
    }
    return message, deltas


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_thinking_then_answer(size: int) -> None:
    text = "<think>\nLet me see: 2 < 3 </thin k.\n</think>\n\nThe answer is 3."
    total, deltas = run(ChatOutputSpec(reasoning=QWEN3), text, size)
    assert total.reasoning == "\nLet me see: 2 < 3 </thin k.\n"
    assert total.content == "The answer is 3."
    assert not any("<think>" in d.reasoning + d.content or "</think>" in d.content for d in deltas)


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_without_think_block_everything_is_content(size: int) -> None:
    total, _ = run(ChatOutputSpec(reasoning=QWEN3), "  <thinking is not a tag> ok", size)
    assert total.reasoning == "" and total.content == "  <thinking is not a tag> ok"


def test_unclosed_block_is_reasoning_and_an_open_prompt_starts_inside() -> None:
    total, _ = run(ChatOutputSpec(reasoning=QWEN3), "<think>cut by max_tok", 3)
    assert (total.reasoning, total.content) == ("cut by max_tok", "")
    opened = ChatOutputSpec(reasoning=QWEN3, opens_in_reasoning=True)
    total, _ = run(opened, "hmm</think>\nyes", 2)
    assert (total.reasoning, total.content) == ("hmm", "yes")


@pytest.mark.parametrize("size", [1, 5, 1000])
def test_tool_calls_are_parsed_and_removed_from_content(size: int) -> None:
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    call2 = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    text = f"<think>I should call <tool_call> it</think>\n\nChecking.\n{call}\n{call2}\n"
    total, deltas = run(BOTH, text, size)
    assert total.reasoning == "I should call <tool_call> it"  # a call while thinking is not one
    assert total.content == "Checking.\n"
    assert [(c.index, c.name, json.loads(c.arguments)) for c in total.tool_calls] == [
        (0, "get_weather", {"city": "Paris"}),
        (1, "get_time", {}),
    ]
    assert len({c.id for c in total.tool_calls}) == 2
    first = next(d.to_dict()["tool_calls"][0] for d in deltas if d.tool_calls)
    assert first["index"] == 0 and first["type"] == "function" and first["id"].startswith("call_")
    assert first["function"]["name"] == "get_weather"
    pieces = [p for d in deltas for p in d.tool_calls if p.index == 0]
    if size < 10:  # the arguments stream as they are written, not at the end
        assert len(pieces) > 2 and pieces[0].arguments == "" and pieces[0].name is not None


def test_arguments_stream_up_to_their_own_closing_brace() -> None:
    text = '<tool_call>{"name": "f", "arguments": {"s": "a}\\"b", "l": [1, {"x": 2}]}}</tool_call>'
    total, deltas = run(BOTH, text, 1)
    assert json.loads(total.tool_calls[0].arguments) == {"s": 'a}"b', "l": [1, {"x": 2}]}
    text = '<tool_call>{"arguments": {"x": 1}, "name": "g"}</tool_call>'  # other key order
    total, deltas = run(BOTH, text, 2)
    assert [(c.name, json.loads(c.arguments)) for c in total.tool_calls] == [("g", {"x": 1})]
    assert sum(len(d.tool_calls) for d in deltas) == 1  # reported whole


def test_bad_call_json_stays_content_and_an_unclosed_call_is_parsed_at_the_end() -> None:
    total, _ = run(BOTH, "<tool_call>{not json}</tool_call>", 4)
    assert total.content == "<tool_call>{not json}</tool_call>" and not total.tool_calls
    total, _ = run(BOTH, '<tool_call>{"name": "f", "arguments": {"x": 1}}', 4)
    assert total.content == "" and [c.name for c in total.tool_calls] == ["f"]
    total, _ = run(BOTH, '<tool_call>{"name": "f", "arguments": {"x": </tool_call>', 3)
    assert [(c.name, c.arguments) for c in total.tool_calls] == [("f", '{"x": ')]  # as sent
    one = ChatOutputSpec(tools=True, max_tool_calls=1)
    call = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    total, _ = run(one, call + call, 3)
    assert len(total.tool_calls) == 1
