"""Every failure leaves as OpenAI's envelope with the right status; FastAPI's 422 becomes 400."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from tokenrouter_ray.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    ContextLengthExceededError,
    InternalServerError,
    InvalidRequestError,
    ModelNotFoundError,
    OverloadedError,
    error_response,
    exc_headers,
    from_validation_error,
)


def envelope(status: int, body: dict) -> dict:
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


@pytest.mark.parametrize(
    ("exc", "status", "type_", "code"),
    [
        (InvalidRequestError("bad", param="n"), 400, "invalid_request_error", None),
        (
            ContextLengthExceededError("long"),
            400,
            "invalid_request_error",
            "context_length_exceeded",
        ),
        (ModelNotFoundError("gpt-9"), 404, "invalid_request_error", "model_not_found"),
        (OverloadedError(), 503, "server_error", "overloaded"),
        (InternalServerError(), 500, "server_error", None),
    ],
)
def test_error_classes(exc: Exception, status: int, type_: str, code: str | None) -> None:
    got_status, body = error_response(exc)
    error = envelope(got_status, body)
    assert (got_status, error["type"], error["code"]) == (status, type_, code)


def test_model_not_found_names_the_model() -> None:
    error = envelope(*error_response(ModelNotFoundError("gpt-9")))
    assert "gpt-9" in error["message"] and error["param"] == "model"


def test_unknown_exception_is_a_500_that_hides_its_text() -> None:
    status, body = error_response(RuntimeError("secret /etc/path"))
    assert status == 500 and "secret" not in body["error"]["message"]


def test_overloaded_asks_for_retry_after() -> None:
    assert exc_headers(OverloadedError(retry_after_s=2)) == {"Retry-After": "2"}
    assert exc_headers(ValueError()) == {}


def test_json_decode_error_is_400() -> None:
    with pytest.raises(json.JSONDecodeError) as info:
        json.loads('{"model": "m",}')
    status, body = error_response(info.value)
    error = envelope(status, body)
    assert status == 400 and error["code"] == "invalid_json" and "line 1" in error["message"]


def validation_error(cls: type, body: object) -> ValidationError:
    with pytest.raises(ValidationError) as info:
        cls.model_validate(body)
    return info.value


def test_pydantic_validation_error_names_the_nested_field() -> None:
    exc = validation_error(
        ChatCompletionRequest,
        {"model": "m", "messages": [{"role": "user", "content": "hi"}, {"role": "robot"}]},
    )
    status, body = error_response(exc)
    error = envelope(status, body)
    assert status == 400
    assert error["param"] == "messages[1].role"
    assert "messages[1].role" in error["message"]


def test_validation_error_of_a_non_request_model_is_a_server_bug() -> None:
    from tokenrouter_ray.openai import RoutingInfo

    exc = validation_error(RoutingInfo, {"handoffs": -1})
    assert error_response(exc)[0] == 500


def test_several_errors_are_all_in_the_message() -> None:
    exc = validation_error(CompletionRequest, {"prompt": "x", "temperature": "hot", "n": 0})
    error = from_validation_error(exc).to_dict()["error"]
    assert error["param"] == "model" and error["code"] == "missing_required_parameter"
    assert "'temperature'" in error["message"] and "'n'" in error["message"]


def test_fastapi_request_validation_error_drops_the_body_prefix() -> None:
    fastapi = pytest.importorskip("fastapi")
    exc = fastapi.exceptions.RequestValidationError(
        [
            {
                "type": "int_type",
                "loc": ("body", "max_tokens"),
                "msg": "Input should be a valid integer",
                "input": "5",
            }
        ]
    )
    status, body = error_response(exc)
    error = envelope(status, body)
    assert (status, error["param"], error["code"]) == (400, "max_tokens", "invalid_type")
    assert "(got string)" in error["message"]


def test_fastapi_app_answers_400_envelopes_not_422() -> None:
    """The handlers an ingress registers, on a real FastAPI app."""
    fastapi = pytest.importorskip("fastapi")
    from fastapi.responses import JSONResponse
    from fastapi.testclient import TestClient

    app = fastapi.FastAPI()

    async def handler(request: object, exc: Exception) -> JSONResponse:
        status, body = error_response(exc)
        return JSONResponse(body, status_code=status, headers=exc_headers(exc))

    app.add_exception_handler(fastapi.exceptions.RequestValidationError, handler)
    app.add_exception_handler(Exception, handler)

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest) -> dict:
        raise OverloadedError(retry_after_s=1)

    client = TestClient(app, raise_server_exceptions=False)
    cases = [
        (b'{"model": "m", "prompt": "x", "max_tokens": -1}', 400, "max_tokens"),
        (b'{"model": "m", "prompt": "x",', 400, None),
        (b'{"prompt": "x"}', 400, "model"),
        (b'["not", "an", "object"]', 400, None),
    ]
    for raw, status, param in cases:
        r = client.post(
            "/v1/completions", content=raw, headers={"content-type": "application/json"}
        )
        assert r.status_code == status, r.text
        assert envelope(r.status_code, r.json())["param"] == param
    r = client.post("/v1/completions", json={"model": "m", "prompt": "x"})
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
