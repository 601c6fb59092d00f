"""Optional ingress API keys (TOKENROUTER_API_KEYS): the real ingress app in-process (no Ray),
through the official `openai` client: the right key is served, a wrong or missing one is a
401 envelope (`openai.AuthenticationError`); /health stays open; unset = off."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient

from tests.openai.ingress_app import SERVED, ingress_app
from tokenrouter_ray.openai.auth import API_KEYS_ENV, ApiKeys, is_protected, parse_keys

KEYS = "sk-alpha-0123456789, sk-beta-9876543210"
RIGHT = "sk-beta-9876543210"
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def http() -> Iterator[TestClient]:
    from transformers import AutoTokenizer

    from tokenrouter_ray.demo.large import prepare_demo

    app, _ = ingress_app(AutoTokenizer.from_pretrained(prepare_demo(quiet=True)))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client
    app.dependency_overrides.clear()


@pytest.fixture
def keys_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEYS_ENV, KEYS)


def api(http: TestClient, key: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url="http://testserver/v1", api_key=key, http_client=http, max_retries=0, timeout=30
    )


def assert_401(response: Any) -> dict:
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"] == "Bearer"
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    error = body["error"]
    assert (error["type"], error["code"], error["param"]) == (
        "invalid_request_error",
        "invalid_api_key",
        None,
    )
    return error


def test_right_key_is_served_on_both_endpoints(http: TestClient, keys_on: None) -> None:
    client = api(http, RIGHT)
    chat = client.chat.completions.create(model=SERVED, messages=CHAT, max_tokens=2)
    assert chat.choices[0].message.content and chat.usage.completion_tokens == 2
    text = client.completions.create(model=SERVED, prompt="hi", max_tokens=2)
    assert text.choices[0].text and text.choices[0].finish_reason == "length"
    stream = client.chat.completions.create(model=SERVED, messages=CHAT, max_tokens=2, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert [m.id for m in client.models.list()] == [SERVED]


@pytest.mark.parametrize(
    "key", ["sk-wrong", "sk-beta-987654321", "sk-beta-98765432100", "sk-alpha-0123456789x"]
)
def test_wrong_key_is_an_authentication_error(http: TestClient, keys_on: None, key: str) -> None:
    client = api(http, key)
    with pytest.raises(openai.AuthenticationError) as info:
        client.chat.completions.create(model=SERVED, messages=CHAT, max_tokens=2)
    assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
    assert info.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.AuthenticationError):
        client.completions.create(model=SERVED, prompt="hi", max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"authorization": ""},
        {"authorization": "Bearer"},
        {"authorization": "Bearer "},
        {"authorization": f"Basic {RIGHT}"},
        {"authorization": RIGHT},
        {"x-api-key": RIGHT},
    ],
)
def test_missing_or_malformed_header_is_401(http: TestClient, keys_on: None, headers: dict) -> None:
    for path, body in [
        ("/v1/chat/completions", {"model": SERVED, "messages": CHAT, "max_tokens": 1}),
        ("/v1/completions", {"model": SERVED, "prompt": "hi", "max_tokens": 1}),
        ("/v1/completions", b"{not json"),  # authentication comes before parsing
    ]:
        kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
        assert_401(http.post(path, headers=headers, **kwargs))
    assert_401(http.get("/v1/models", headers=headers))
    assert_401(http.get("/v1/tokenrouter/stats", headers=headers))


def test_health_stays_open_and_bearer_is_case_insensitive(http: TestClient, keys_on: None) -> None:
    assert http.get("/health").status_code == 200
    r = http.get("/v1/models", headers={"authorization": f"bearer  {RIGHT} "})
    assert r.status_code == 200, r.text


def test_off_by_default(http: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(API_KEYS_ENV, raising=False)
    r = api(http, "anything").completions.create(model=SERVED, prompt="hi", max_tokens=1)
    assert r.choices[0].text
    assert http.get("/v1/models").status_code == 200
    monkeypatch.setenv(API_KEYS_ENV, " , ")  # blank: still off
    assert http.get("/v1/models").status_code == 200


def test_keys_parsing_and_paths() -> None:
    assert parse_keys(" a, b,,c ,") == ("a", "b", "c") and parse_keys(None) == ()
    keys = ApiKeys(["abc", "déf"])
    assert keys.accepts("abc") and keys.accepts("déf")
    assert not any(keys.accepts(k) for k in ["ab", "abcd", "", "ABC", "\ud800"])
    assert not ApiKeys().enabled and ApiKeys.from_env({API_KEYS_ENV: "x"}).enabled
    assert is_protected({"path": "/v1/models"}) and is_protected({"path": "/v1"})
    assert is_protected({"path": "/app/v1/completions", "root_path": "/app"})
    assert not is_protected({"path": "/app/health", "root_path": "/app"})
    assert not is_protected({"path": "/health"}) and not is_protected({"path": "/metrics/"})
    assert is_protected({"path": "/v1x"}) and is_protected({"path": "/"})  # fails closed
    assert is_protected({"path": "/other/health", "root_path": "/app"})
