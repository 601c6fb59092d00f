"""Fuzzing both endpoints of the real ingress app (deployments/ingress.py, in-process, no Ray;
valid requests are "generated" by a stand-in core that encodes the real NEW message):
never a 5xx, every error in OpenAI's envelope with the right 4xx.

Named cases cover invalid JSON, wrong types, NaN, huge integers, empty prompt / messages,
lone surrogates, non-UTF-8 bytes, a prompt over the context, out-of-vocabulary token ids,
max_tokens <= 0 and past the context, too many stop strings, huge n, an unknown model; then
hypothesis mutates a valid body field by field from the request schemas' own fields."""

# ruff: noqa: E501  (the table of named cases: one case a line)

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.openai.ingress_app import MAX_MODEL_LEN, SERVED, ingress_app
from tokenrouter_ray.openai.schemas import ChatCompletionRequest, CompletionRequest

CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
USER = [{"role": "user", "content": "hi"}]
BASE = {
    CHAT: {"model": SERVED, "messages": USER, "max_tokens": 2},
    TEXT: {"model": SERVED, "prompt": "hi", "max_tokens": 2},
}
FIELDS = {
    CHAT: [*sorted(ChatCompletionRequest.model_fields), "timeout", "unknown_field"],
    TEXT: [*sorted(CompletionRequest.model_fields), "timeout", "unknown_field"],
}


@pytest.fixture(scope="module")
def http(demo_tokenizer: Any) -> Iterator[TestClient]:
    app, _ = ingress_app(demo_tokenizer)
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client
    app.dependency_overrides.clear()


def post(http: TestClient, path: str, body: Any) -> Any:
    """``body``: bytes as they are, str encoded as UTF-8 (surrogates passed through, so they
    arrive as invalid UTF-8), anything else as JSON (NaN / Infinity literals allowed,
    surrogates as ``\\ud800`` escapes)."""
    if isinstance(body, str):
        body = body.encode("utf-8", "surrogatepass")
    elif not isinstance(body, bytes):
        body = json.dumps(body, allow_nan=True).encode()
    return http.post(path, content=body, headers={"content-type": "application/json"})


def check(response: Any) -> dict | None:
    """Never a 5xx; an error is the envelope with a 4xx; a 200 is a complete answer.
    Returns the error object, or None for a 200."""
    status = response.status_code
    assert status < 500, response.text
    if status == 200:
        if response.headers["content-type"].startswith("text/event-stream"):
            lines = [x for x in response.text.split("\n") if x.startswith("data: ")]
            assert lines[-1] == "data: [DONE]"
            assert all('"error"' not in x for x in lines), response.text
        else:
            assert response.json()["choices"], response.text
        return None
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], body
    assert error["type"] == "invalid_request_error", body
    if status == 404:
        assert error["code"] == "model_not_found" and error["param"] == "model", body
    else:
        assert status == 400, body
    return error


def with_(path: str, **fields: Any) -> dict:
    return {**BASE[path], **fields}


NESTED = "[" * 5000 + "]" * 5000
OOV = 10**6  # far past the vocabulary
BOTH = [CHAT, TEXT]

# (name, path(s), body, status, param or None to skip, code or None to skip)
CASES: list[tuple[str, list[str], Any, int, str | None, str | None]] = [
    ("empty body", BOTH, b"", 400, None, "invalid_json"),
    ("truncated", BOTH, b'{"model": "tokenrouter",', 400, None, "invalid_json"),
    ("trailing comma", BOTH, b'{"model": "tokenrouter",}', 400, None, "invalid_json"),
    ("not an object", BOTH, b'["model"]', 400, None, None),
    ("null", BOTH, b"null", 400, None, None),
    ("nested 5000 deep", BOTH, NESTED, 400, None, "invalid_json"),
    ("non-UTF-8 bytes", BOTH, b'{"model": "tokenrouter\xff\xfe"}', 400, None, "invalid_json"),
    ("4301-digit integer", BOTH, '{"max_tokens": ' + "9" * 4301 + "}", 400, None, "invalid_json"),
    ("raw surrogate bytes", [TEXT], '{"model": "tokenrouter", "prompt": "\ud800"}', 400, None, None),
    ("model missing", BOTH, {"prompt": "x", "messages": USER}, 400, "model", None),
    ("unknown model", [CHAT], with_(CHAT, model="gpt-9"), 404, "model", "model_not_found"),
    ("unknown model", [TEXT], with_(TEXT, model="gpt-9"), 404, "model", "model_not_found"),
    ("model surrogate", [TEXT], with_(TEXT, model="\ud800"), 400, "model", None),
    ("model wrong type", [TEXT], with_(TEXT, model=7), 400, "model", "invalid_type"),
    ("temperature NaN", [TEXT], '{"model":"tokenrouter","prompt":"x","temperature":NaN}', 400, "temperature", None),
    ("top_p Infinity", [CHAT], '{"model":"tokenrouter","messages":[{"role":"user","content":"x"}],"top_p":Infinity}', 400, "top_p", None),
    ("timeout NaN", [TEXT], '{"model":"tokenrouter","prompt":"x","timeout":NaN}', 400, "timeout", None),
    ("timeout 1e400", [TEXT], '{"model":"tokenrouter","prompt":"x","timeout":1e400}', 400, "timeout", None),
    ("temperature string", [TEXT], with_(TEXT, temperature="0.5"), 400, "temperature", "invalid_type"),
    ("stream int", [CHAT], with_(CHAT, stream=1), 400, "stream", "invalid_type"),
    ("max_tokens float", [TEXT], with_(TEXT, max_tokens=2.0), 400, "max_tokens", "invalid_type"),
    ("max_tokens 0", BOTH, {"max_tokens": 0}, 400, "max_tokens", None),
    ("max_tokens -1", BOTH, {"max_tokens": -1}, 400, "max_tokens", None),
    ("max_tokens = context", BOTH, {"max_tokens": MAX_MODEL_LEN}, 400, None, "context_length_exceeded"),
    ("max_tokens huge", BOTH, {"max_tokens": 10**30}, 400, None, "context_length_exceeded"),
    ("max_completion_tokens 0", [CHAT], with_(CHAT, max_completion_tokens=0), 400, "max_completion_tokens", None),
    ("n huge", BOTH, {"n": 10**30}, 400, "n", "invalid_value"),
    ("n 17", BOTH, {"n": 17}, 400, "n", "invalid_value"),
    ("n 0", BOTH, {"n": 0}, 400, "n", None),
    ("seed 2**64", BOTH, {"seed": 2**64}, 400, "seed", None),
    ("top_k 10**30", BOTH, {"top_k": 10**30}, 400, "top_k", None),
    ("top_k -1", BOTH, {"top_k": -1}, 400, "top_k", None),
    ("5 stop strings", BOTH, {"stop": ["a", "b", "c", "d", "e"]}, 400, "stop", None),
    ("empty stop string", BOTH, {"stop": [""]}, 400, "stop", None),
    ("stop surrogate", BOTH, {"stop": "\udc00"}, 400, "stop", None),
    ("stop_token_ids OOV", BOTH, {"stop_token_ids": [OOV]}, 400, "stop_token_ids", "invalid_value"),
    ("stop_token_ids 10**30", BOTH, {"stop_token_ids": [10**30]}, 400, "stop_token_ids", None),
    ("empty prompt", [TEXT], with_(TEXT, prompt=""), 400, "prompt", None),
    ("empty prompt list", [TEXT], with_(TEXT, prompt=[]), 400, "prompt", None),
    ("empty prompt batch", [TEXT], with_(TEXT, prompt=[""]), 400, "prompt", None),
    ("prompt surrogate", [TEXT], with_(TEXT, prompt="a\ud800b"), 400, "prompt", None),
    ("prompt OOV id", [TEXT], with_(TEXT, prompt=[1, OOV]), 400, "prompt", "invalid_value"),
    ("prompt id 10**30", [TEXT], with_(TEXT, prompt=[10**30]), 400, "prompt", None),
    ("prompt id -1", [TEXT], with_(TEXT, prompt=[-1]), 400, "prompt", None),
    ("prompt ids bool", [TEXT], with_(TEXT, prompt=[True]), 400, "prompt", None),
    ("prompt mixed", [TEXT], with_(TEXT, prompt=[1, "a"]), 400, "prompt", None),
    ("prompt batch", [TEXT], with_(TEXT, prompt=["a", "b"]), 400, "prompt", "unsupported_value"),
    ("prompt over context (ids)", [TEXT], with_(TEXT, prompt=[1] * MAX_MODEL_LEN), 400, "prompt", "context_length_exceeded"),
    ("prompt over context (text)", [TEXT], with_(TEXT, prompt="word " * 200), 400, "prompt", "context_length_exceeded"),
    ("empty messages", [CHAT], with_(CHAT, messages=[]), 400, "messages", None),
    ("messages not a list", [CHAT], with_(CHAT, messages="hi"), 400, "messages", None),
    ("message not an object", [CHAT], with_(CHAT, messages=["hi"]), 400, "messages[0]", None),
    ("unknown role", [CHAT], with_(CHAT, messages=[{"role": "robot", "content": "x"}]), 400, "messages[0].role", None),
    ("content missing", [CHAT], with_(CHAT, messages=[{"role": "user"}]), 400, "messages[0].content", None),
    ("content surrogate", [CHAT], with_(CHAT, messages=[{"role": "user", "content": "\ud800"}]), 400, "messages[0].content", None),
    ("content part surrogate", [CHAT], with_(CHAT, messages=[{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]), 400, "messages[0].content", None),
    ("image part", [CHAT], with_(CHAT, messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400, "messages[0].content", "unsupported_value"),
    ("messages over context", [CHAT], with_(CHAT, messages=[{"role": "user", "content": "word " * 200}]), 400, "messages", "context_length_exceeded"),
    ("reserved template kwarg", [CHAT], with_(CHAT, chat_template_kwargs={"tokenize": False}), 400, "chat_template_kwargs", None),
    ("logprobs over 5", [TEXT], with_(TEXT, logprobs=6), 400, "logprobs", "invalid_value"),
    ("logprobs bool (completions)", [TEXT], with_(TEXT, logprobs=True), 400, "logprobs", "invalid_type"),
    ("logprobs int (chat)", [CHAT], with_(CHAT, logprobs=1), 400, "logprobs", "invalid_type"),
    ("top_logprobs over 20", [CHAT], with_(CHAT, logprobs=True, top_logprobs=21), 400, "top_logprobs", "invalid_value"),
    ("top_logprobs without logprobs", [CHAT], with_(CHAT, top_logprobs=2), 400, "top_logprobs", "invalid_value"),
    ("routing_trace not a bool", BOTH, {"routing_trace": "yes"}, 400, "routing_trace", "invalid_type"),
    ("routing_trace 1", BOTH, {"routing_trace": 1}, 400, "routing_trace", "invalid_type"),
    ("tools", [CHAT], with_(CHAT, tools=[{"type": "function"}]), 400, "tools[0].function",
     "missing_required_parameter"),
    ("tool_choice", [CHAT], with_(CHAT, tool_choice="sometimes"), 400, "tool_choice",
     "invalid_value"),
    ("min_p over 1", BOTH, {"min_p": 1.5}, 400, "min_p", "invalid_value"),
    ("stream_options without stream", BOTH, {"stream_options": {"include_usage": True}}, 400, "stream_options", None),
]  # fmt: skip


def cases() -> Iterator[Any]:
    for name, paths, body, status, param, code in CASES:
        for path in paths:
            if isinstance(body, dict) and "model" not in body and "prompt" not in body:
                body_for = with_(path, **body)  # field overrides on the path's valid body
            else:
                body_for = body
            yield pytest.param(path, body_for, status, param, code, id=f"{path[4:]}: {name}")


@pytest.mark.parametrize(("path", "body", "status", "param", "code"), list(cases()))
def test_named_case_is_the_right_4xx_envelope(
    http: TestClient, path: str, body: Any, status: int, param: str | None, code: str | None
) -> None:
    r = post(http, path, body)
    error = check(r)
    assert r.status_code == status, r.text
    assert error is not None
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error


@pytest.mark.parametrize("path", BOTH)
@pytest.mark.parametrize("stream", [False, True])
def test_valid_requests_are_answered(http: TestClient, path: str, stream: bool) -> None:
    r = post(http, path, with_(path, n=2, stream=stream, seed=-(2**63), top_k=2**40))
    assert check(r) is None


SURROGATES = st.sampled_from(["\ud800", "\udfff", "a\udc80b"])
TEXTS = st.one_of(st.text(max_size=12), SURROGATES, st.sampled_from(["", " ", SERVED, "user"]))
NUMBERS = st.one_of(
    st.integers(min_value=-3, max_value=70),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(min_value=-1, max_value=3),
)
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, TEXTS)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=5), st.dictionaries(TEXTS, inner, max_size=4)),
    max_leaves=10,
)
MESSAGES = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "tool", "developer", "x"])},
        optional={"content": st.one_of(TEXTS, JSON), "name": TEXTS},
    ),
    max_size=3,
)
PROMPTS = st.one_of(TEXTS, st.lists(st.integers(min_value=-2, max_value=60_000), max_size=70), JSON)


def bodies(path: str) -> st.SearchStrategy[Any]:
    """A valid body with some fields replaced by arbitrary values, or dropped."""
    special = {"messages": MESSAGES, "prompt": PROMPTS, "model": TEXTS}
    fields = st.sampled_from(FIELDS[path])

    @st.composite
    def mutate(draw: Any) -> Any:
        body = dict(BASE[path])
        for name in draw(st.lists(fields, min_size=1, max_size=4, unique=True)):
            if draw(st.integers(0, 9)) == 0:
                body.pop(name, None)
            else:
                body[name] = draw(special.get(name, JSON))
        if draw(st.integers(0, 19)) == 0:  # sometimes as raw UTF-8 (surrogates: invalid)
            return json.dumps(body, allow_nan=True, ensure_ascii=False)
        return body

    return mutate()


FUZZ = settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@FUZZ
@given(data=st.data())
def test_fuzzed_chat_bodies_never_5xx(http: TestClient, data: Any) -> None:
    check(post(http, CHAT, data.draw(bodies(CHAT))))


@FUZZ
@given(data=st.data())
def test_fuzzed_completion_bodies_never_5xx(http: TestClient, data: Any) -> None:
    check(post(http, TEXT, data.draw(bodies(TEXT))))
