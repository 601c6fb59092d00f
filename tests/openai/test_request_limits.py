"""Server limits on what one request may ask for: each past-limit request is a 400
``limit_exceeded`` naming the limit, the counts checked on the decoded body before the
schema builds anything; an oversized body is a 413 envelope."""

from __future__ import annotations

from typing import Any

import pytest

from tokenrouter_ray.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestLimits,
    error_response,
    parse_request,
    prepare_chat,
    prepare_completion,
)
from tokenrouter_ray.openai.validation import (
    LimitExceededError,
    PayloadTooLargeError,
    check_raw_limits,
)

LIMITS = RequestLimits(
    max_model_len=4096,
    vocab_size=1000,
    max_messages=8,
    max_content_chars=100,
    max_stop_chars=10,
    max_stop_token_ids=4,
    max_logit_bias=3,
    max_total_tokens=64,
)
USER = {"role": "user", "content": "hi"}


def refused(exc: pytest.ExceptionInfo[LimitExceededError], param: str, limit: int) -> None:
    status, body = error_response(exc.value)
    assert status == 400
    assert body["error"]["code"] == "limit_exceeded"
    assert body["error"]["param"] == param
    assert f"({limit})" in body["error"]["message"]


@pytest.mark.parametrize(
    ("field", "value", "limit"),
    [
        ("messages", [USER] * 9, 8),
        ("input", [USER] * 9, 8),  # POST /v1/responses
        ("stop_token_ids", list(range(5)), 4),
        ("logit_bias", {str(i): 1.0 for i in range(4)}, 3),
        ("stop", ["x" * 11], 10),
        ("stop", "y" * 11, 10),
    ],
)
def test_counts_past_a_limit_are_a_400_naming_it(field: str, value: Any, limit: int) -> None:
    body = {"model": "m", "messages": [USER], field: value}
    with pytest.raises(LimitExceededError) as exc:
        check_raw_limits(body, LIMITS)
    refused(exc, field, limit)


def test_counts_at_the_limit_pass() -> None:
    body = {
        "model": "m",
        "messages": [USER] * 8,
        "stop_token_ids": [1, 2, 3, 4],
        "logit_bias": {"1": 0, "2": 0, "3": 0},
        "stop": ["x" * 10],
    }
    check_raw_limits(body, LIMITS)
    check_raw_limits([1, 2], LIMITS)  # not an object: the schema's error, not ours


def test_a_million_stop_token_ids_cost_a_len_not_a_parse() -> None:
    body = {"model": "m", "prompt": [1, 2], "stop_token_ids": [1] * 1_000_000}
    with pytest.raises(LimitExceededError) as exc:
        check_raw_limits(body, LIMITS)
    refused(exc, "stop_token_ids", 4)


def test_prompt_and_message_content_length() -> None:
    long_prompt = parse_request(CompletionRequest, {"model": "m", "prompt": "a" * 101})
    with pytest.raises(LimitExceededError) as exc:
        prepare_completion(long_prompt, None, LIMITS)  # refused before tokenizing
    refused(exc, "prompt", 100)
    ids = parse_request(CompletionRequest, {"model": "m", "prompt": [1] * 101})
    with pytest.raises(LimitExceededError) as exc:
        prepare_completion(ids, None, LIMITS)
    refused(exc, "prompt", 100)
    messages = [{"role": "user", "content": "b" * 60}] * 2
    chat = parse_request(ChatCompletionRequest, {"model": "m", "messages": messages})
    with pytest.raises(LimitExceededError) as exc:
        prepare_chat(chat, None, LIMITS)
    refused(exc, "messages", 100)


def test_stop_token_ids_count_is_checked_after_parsing_too() -> None:
    body = {"model": "m", "prompt": [1, 2], "stop_token_ids": [1, 2, 3, 4, 5]}
    with pytest.raises(LimitExceededError) as exc:
        prepare_completion(parse_request(CompletionRequest, body), None, LIMITS)
    refused(exc, "stop_token_ids", 4)


def test_n_times_max_tokens() -> None:
    body = {"model": "m", "prompt": [1, 2, 3], "n": 4, "max_tokens": 16}
    prepared = prepare_completion(parse_request(CompletionRequest, body), None, LIMITS)
    assert prepared.sampling.n == 4 and prepared.sampling.spec.max_tokens == 16  # 64: at the cap
    with pytest.raises(LimitExceededError) as exc:
        prepare_completion(
            parse_request(CompletionRequest, body | {"max_tokens": 17}), None, LIMITS
        )
    refused(exc, "n x max_tokens", 64)
    unset = {"model": "m", "prompt": [1, 2, 3], "n": 5}  # completions' default budget: 16
    with pytest.raises(LimitExceededError):
        prepare_completion(parse_request(CompletionRequest, unset), None, LIMITS)


def test_a_body_too_large_is_a_413_envelope() -> None:
    status, body = error_response(PayloadTooLargeError("The request body is too large."))
    assert status == 413
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["code"] == "request_too_large"


# ------------------------------------------------ the real ingress routes, in-process
@pytest.fixture()
def routes(demo_tokenizer: Any) -> Any:
    from fastapi.testclient import TestClient

    from tests.openai.ingress_app import ingress_app

    app, obj = ingress_app(demo_tokenizer)
    obj.max_body_bytes = 4096
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, obj
    app.dependency_overrides.clear()


@pytest.mark.demo
def test_the_routes_refuse_big_bodies_with_413_and_serve_small_ones(routes: Any) -> None:
    http, _ = routes
    big = b'{"model": "tokenrouter", "prompt": "' + b"a" * 8192 + b'"}'
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
        r = http.post(path, content=big, headers={"content-type": "application/json"})
        assert r.status_code == 413, r.text
        assert r.json()["error"]["code"] == "request_too_large"

    def chunks() -> Any:  # no Content-Length: refused while reading
        for i in range(0, len(big), 1024):
            yield big[i : i + 1024]

    r = http.post("/v1/completions", content=chunks())
    assert r.status_code == 413, r.text
    body = {"model": "tokenrouter", "prompt": "Hello", "max_tokens": 4}
    assert http.post("/v1/completions", json=body).status_code == 200
    body["stop_token_ids"] = list(range(65))  # the default limit: 64
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids"


@pytest.mark.demo
def test_the_routes_answer_429_with_retry_after_past_the_admission_queue(routes: Any) -> None:
    from tokenrouter_ray.ingress.admission import AdmissionQueue

    http, obj = routes
    obj.admission = AdmissionQueue(max_waiting=0, max_wait_s=0.1)
    obj.cap.configured = 0  # every slot taken
    body = {"model": "tokenrouter", "prompt": "Hello", "max_tokens": 4}
    r = http.post("/v1/chat/completions", json=body | {"messages": [USER]})
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "rate_limit_exceeded"
    obj.admission = AdmissionQueue(max_waiting=4, max_wait_s=0.1)
    r = http.post("/v1/completions", json=body)  # waited 0.1 s in the queue, then refused
    assert r.status_code == 429 and obj.admission.stats.refused_timeout == 1
    obj.cap.configured = 256
    assert http.post("/v1/completions", json=body).status_code == 200
