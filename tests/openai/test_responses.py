"""Non-streaming bodies parse as the official client's types; `routing` rides in model_extra."""

from __future__ import annotations

import openai
import pytest
from openai.types import Completion as OpenAICompletion
from openai.types.chat import ChatCompletion as OpenAIChatCompletion

from tokenrouter_ray.openai import (
    ChoiceResult,
    InternalServerError,
    RoutingInfo,
    build_chat_completion,
    build_completion,
    finish_reason,
)

CHOICES = [
    ChoiceResult(1, "second", "length", 4, RoutingInfo(tokens_per_model={"large": 4}, handoffs=1)),
    ChoiceResult(
        0, "first 😀", "stop", 3, RoutingInfo(tokens_per_model={"small": 2, "large": 1}, handoffs=2)
    ),
]


def test_completion_parses_with_the_openai_client_types() -> None:
    body = build_completion("tiny", 7, CHOICES, created=123).model_dump(mode="json")
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    parsed = OpenAICompletion.model_validate(body)
    assert [c.text for c in parsed.choices] == ["first 😀", "second"]
    assert [c.finish_reason for c in parsed.choices] == ["stop", "length"]
    assert parsed.choices[0].logprobs is None and "logprobs" in body["choices"][0]
    assert parsed.usage.model_dump() == {
        "prompt_tokens": 7, "completion_tokens": 7, "total_tokens": 14,
        "completion_tokens_details": None, "prompt_tokens_details": None,
    }  # fmt: skip
    assert parsed.model_extra["routing"] == {
        "tokens_per_model": {"small": 2, "large": 5},
        "handoffs": 3,
        "mode": "routed",
        "reason": None,
    }
    assert parsed.choices[1].model_extra["routing"]["tokens_per_model"] == {"large": 4}


def test_chat_completion_parses_with_the_openai_client_types() -> None:
    body = build_chat_completion("tiny", 7, CHOICES).model_dump(mode="json")
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    parsed = OpenAIChatCompletion.model_validate(body)
    assert parsed.choices[0].message.role == "assistant"
    assert parsed.choices[0].message.content == "first 😀"
    assert parsed.usage.total_tokens == 14
    assert parsed.model_extra["routing"]["handoffs"] == 3


def test_routing_merge_skips_missing() -> None:
    merged = RoutingInfo.merge([None, RoutingInfo(tokens_per_model={"a": 1}, handoffs=0)])
    assert merged == RoutingInfo(tokens_per_model={"a": 1}, handoffs=0)
    assert build_completion("m", 1, [ChoiceResult(0, "x", "stop", 1)]).routing == RoutingInfo()


def test_finish_reason_mapping() -> None:
    assert finish_reason("length") == "length"
    assert finish_reason("stop") == finish_reason(None) == finish_reason("abort") == "stop"
    assert finish_reason("length", stopped_by_string=True) == "stop"
    with pytest.raises(InternalServerError):
        finish_reason("error")


def test_openai_client_sees_errors_as_its_exceptions() -> None:
    """A 400/404/503 envelope from this layer becomes the client's typed exception."""
    import httpx

    from tokenrouter_ray.openai import (
        ContextLengthExceededError,
        ModelNotFoundError,
        OverloadedError,
        error_response,
    )

    errors = iter(
        [
            ContextLengthExceededError("too long", param="messages"),
            ModelNotFoundError("x"),
            OverloadedError(),
        ]
    )

    def handler(request: httpx.Request) -> httpx.Response:
        status, body = error_response(next(errors))
        return httpx.Response(status, json=body)

    client = openai.OpenAI(
        api_key="-", base_url="http://test/v1", max_retries=0,
        http_client=httpx.Client(transport=httpx.MockTransport(handler)),
    )  # fmt: skip
    kwargs = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(**kwargs)
    assert bad.value.code == "context_length_exceeded" and bad.value.param == "messages"
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(**kwargs)
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.InternalServerError) as busy:
        client.chat.completions.create(**kwargs)
    assert busy.value.status_code == 503
