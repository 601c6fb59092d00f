"""Request schemas: normalised on the way in, strict on types, lenient on unknown fields, and
every bad input a 400 naming its field."""

from __future__ import annotations

from typing import Any

import pytest

from tokenrouter_ray.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    InvalidRequestError,
    parse_request,
)


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": "hi", **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


def rejects(cls: type, body: Any) -> dict[str, Any]:
    with pytest.raises(InvalidRequestError) as info:
        parse_request(cls, body)
    status, error = info.value.status_code, info.value.to_dict()["error"]
    assert status == 400 and error["type"] == "invalid_request_error"
    return error


def test_completion_defaults_and_normalisation() -> None:
    req = parse_request(CompletionRequest, completion(prompt=["one string"], stop="\n"))
    assert req.prompt == "one string" and req.stop == ["\n"] and req.max_tokens == 16
    assert parse_request(CompletionRequest, completion(prompt=[[1, 2]])).prompt == [1, 2]
    assert parse_request(CompletionRequest, completion(prompt=[5])).prompt == [5]
    assert not parse_request(CompletionRequest, completion()).include_usage


def test_unknown_fields_are_ignored_and_nulls_mean_default() -> None:
    body = completion(
        temperature=None, top_p=None, n=None, stop=None, seed=None, max_tokens=None,
        presence_penalty=0, logprobs=None, echo=False, some_future_field={"x": 1},
    )  # fmt: skip
    req = parse_request(CompletionRequest, body)
    assert req.temperature is None and req.stop == [] and req.max_tokens is None
    assert not hasattr(req, "some_future_field")


def test_stream_options() -> None:
    req = parse_request(
        ChatCompletionRequest, chat(stream=True, stream_options={"include_usage": True})
    )
    assert req.include_usage
    assert parse_request(ChatCompletionRequest, chat(stream=False, stream_options=None))


def test_chat_content_parts_are_flattened_and_assistant_may_be_null() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    messages = [
        {"role": "developer", "content": parts},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None},
        {"role": "tool", "content": "result", "tool_call_id": "t1"},
    ]
    req = parse_request(ChatCompletionRequest, chat(messages=messages))
    assert [m.content for m in req.messages] == ["a\nb", "q", None, "result"]


def test_chat_completion_budget_takes_the_smaller() -> None:
    budget = parse_request(ChatCompletionRequest, chat(max_tokens=10, max_completion_tokens=5))
    assert budget.completion_budget == (5, "max_completion_tokens")
    budget = parse_request(ChatCompletionRequest, chat(max_tokens=3, max_completion_tokens=5))
    assert budget.completion_budget == (3, "max_tokens")
    assert parse_request(ChatCompletionRequest, chat()).completion_budget[0] is None


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        ({"model": None}, "model", "invalid_type"),
        ({"model": ""}, "model", "invalid_value"),
        ({"prompt": ""}, "prompt", "invalid_value"),
        ({"prompt": []}, "prompt", "invalid_value"),
        ({"prompt": ["a", "b"]}, "prompt", "unsupported_value"),
        ({"prompt": [1, -2]}, "prompt", "invalid_value"),
        ({"prompt": [1, True]}, "prompt", "invalid_type"),
        ({"prompt": {"text": "x"}}, "prompt", "invalid_type"),
        ({"prompt": "\ud800"}, "prompt", "invalid_value"),
        ({"max_tokens": 0}, "max_tokens", "invalid_value"),
        ({"max_tokens": -5}, "max_tokens", "invalid_value"),
        ({"max_tokens": "16"}, "max_tokens", "invalid_type"),
        ({"max_tokens": 1.5}, "max_tokens", "invalid_type"),
        ({"temperature": 2.5}, "temperature", "invalid_value"),
        ({"temperature": -0.1}, "temperature", "invalid_value"),
        ({"temperature": "1"}, "temperature", "invalid_type"),
        ({"top_p": 0}, "top_p", "invalid_value"),
        ({"top_p": 1.1}, "top_p", "invalid_value"),
        ({"n": 0}, "n", "invalid_value"),
        ({"top_k": -1}, "top_k", "invalid_value"),
        ({"stream": "yes"}, "stream", "invalid_type"),
        ({"stream": 1}, "stream", "invalid_type"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_value"),
        ({"stop": [""]}, "stop", "invalid_value"),
        ({"stop": 5}, "stop", "invalid_type"),
        ({"seed": 1 << 64}, "seed", "invalid_value"),
        ({"echo": True}, "echo", "unsupported_value"),
        ({"logprobs": 6}, "logprobs", "invalid_value"),
        ({"logprobs": -1}, "logprobs", "invalid_value"),
        ({"routing_trace": "true"}, "routing_trace", "invalid_type"),
        ({"best_of": 3}, "best_of", "unsupported_value"),
        ({"suffix": "x"}, "suffix", "unsupported_value"),
        ({"presence_penalty": 2.5}, "presence_penalty", "invalid_value"),
        ({"logit_bias": {"50256": -101}}, "logit_bias", "invalid_value"),
        ({"logit_bias": {"-1": 1}}, "logit_bias", "invalid_value"),
        ({"logit_bias": {"007": 1}}, "logit_bias", "invalid_value"),
        ({"logit_bias": {"hi": 1}}, "logit_bias", "invalid_value"),
        ({"logit_bias": {"5": "1"}}, "logit_bias.5", "invalid_type"),
        ({"min_tokens": -1}, "min_tokens", "invalid_value"),
        ({"min_p": 1.5}, "min_p", "invalid_value"),
        ({"repetition_penalty": 0}, "repetition_penalty", "invalid_value"),
        ({"repetition_penalty": 11}, "repetition_penalty", "invalid_value"),
        ({"include_stop_str_in_output": 1}, "include_stop_str_in_output", "invalid_type"),
        ({"skip_special_tokens": "no"}, "skip_special_tokens", "invalid_type"),
        ({"stop_token_ids": [-1]}, "stop_token_ids[0]", "invalid_value"),
    ],
)
def test_bad_completion_fields(fields: dict[str, Any], param: str, code: str) -> None:
    error = rejects(CompletionRequest, completion(**fields))
    assert (error["param"], error["code"]) == (param, code), error
    assert param in error["message"] or code == "unsupported_value"


def test_missing_fields() -> None:
    assert rejects(CompletionRequest, {"model": "m"})["param"] == "prompt"
    error = rejects(ChatCompletionRequest, {"messages": []})
    assert error["code"] == "missing_required_parameter"
    assert error["message"].startswith("Missing required parameter: 'model'.")


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        ({"messages": []}, "messages", "invalid_value"),
        ({"messages": "hi"}, "messages", "invalid_type"),
        ({"messages": [{"content": "x"}]}, "messages[0].role", "missing_required_parameter"),
        ({"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role", "invalid_value"),
        ({"messages": [{"role": "user"}]}, "messages[0].content", "invalid_value"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content", "invalid_type"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content",
            "unsupported_value",
        ),
        ({"max_completion_tokens": 0}, "max_completion_tokens", "invalid_value"),
        ({"logprobs": 1}, "logprobs", "invalid_type"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "invalid_value"),
        ({"top_logprobs": 3}, "top_logprobs", "invalid_value"),
        ({"tools": [{"type": "function"}]}, "tools[0].function", "missing_required_parameter"),
        (
            {"tools": [{"type": "retrieval", "function": {"name": "f"}}]},
            "tools[0].type",
            "invalid_value",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "a b"}}]},
            "tools[0].function.name",
            "invalid_value",
        ),
        ({"tool_choice": "sometimes"}, "tool_choice", "invalid_value"),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "invalid_value"),
        ({"frequency_penalty": 3}, "frequency_penalty", "invalid_value"),
    ],
)
def test_bad_chat_fields(fields: dict[str, Any], param: str, code: str) -> None:
    error = rejects(ChatCompletionRequest, chat(**fields))
    assert (error["param"], error["code"]) == (param, code), error


def test_neutral_values_of_unsupported_features_are_accepted() -> None:
    body = chat(logprobs=False, tools=[], tool_choice="none", response_format={"type": "text"})
    assert parse_request(ChatCompletionRequest, body)


@pytest.mark.parametrize(
    "raw", [b"", b"{", b'{"model": "m",}', b"\xff\xfe", "not json", b"null", b"[]"]
)
def test_malformed_bodies(raw: bytes | str) -> None:
    error = rejects(CompletionRequest, raw)
    assert error["param"] is None
