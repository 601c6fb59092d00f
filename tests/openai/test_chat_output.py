"""The reasoning and tool-call parsers on text alone: what they split, whatever the split of
the input into deltas (every piece size, tags cut anywhere)."""

from __future__ import annotations

import json

import pytest

from tokenrouter_ray.openai.chat_output import ChatDelta, ChatOutputSpec
from tokenrouter_ray.openai.reasoning import QWEN3

BOTH = ChatOutputSpec(reasoning=QWEN3, tools=True)


def run(spec: ChatOutputSpec, text: str, size: int) -> tuple[ChatDelta, list[ChatDelta]]:
    parser = spec.parser()
    deltas = [parser.push(text[i : i + size]) for i in range(0, len(text), size)]
    deltas.append(parser.finish())
    total = ChatDelta()
    for d in deltas:
        total.add(d)
    assert total.content == parser.message.content and total.reasoning == parser.message.reasoning
    return total, deltas


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
    streamed = [d.to_dict() for d in deltas if d.tool_calls]
    assert streamed[0]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert streamed[0]["tool_calls"][0]["index"] == 0


def test_bad_call_json_stays_content_and_an_unclosed_call_is_parsed_at_the_end() -> None:
    total, _ = run(BOTH, "<tool_call>{not json}</tool_call>", 4)
    assert total.content == "<tool_call>{not json}</tool_call>" and not total.tool_calls
    total, _ = run(BOTH, '<tool_call>{"name": "f", "arguments": {"x": 1}}', 4)
    assert total.content == "" and [c.name for c in total.tool_calls] == ["f"]
    one = ChatOutputSpec(tools=True, max_tool_calls=1)
    call = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    total, _ = run(one, call + call, 3)
    assert len(total.tool_calls) == 1
