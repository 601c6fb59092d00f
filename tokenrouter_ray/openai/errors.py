"""OpenAI's error envelope, the exceptions that carry it, and the map from any exception to it.

Every failure the HTTP layer reports leaves as ``(status, {"error": {message, type, param,
code}})``. Errors enter this module three ways:

- raised directly as an `OpenAIError` subclass by validation, model lookup or admission;
- a pydantic ``ValidationError`` of a request model, or FastAPI's ``RequestValidationError``
  (same ``.errors()`` shape, ``loc`` starting with ``"body"``), converted by
  `from_validation_error`;
- a ``json.JSONDecodeError`` (malformed body) converted by `from_json_error`.

`error_response(exc)` turns any exception into the pair a FastAPI exception handler returns
as ``JSONResponse(body, status_code=status, headers=exc_headers(exc))``. Bad input is always
400; any other exception becomes a 500 whose text is not sent (the ingress logs it).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"


class OpenAIError(Exception):
    """An error the API reports to the client as OpenAI's envelope with `status_code`."""

    status_code: int = 500
    error_type: str = SERVER_ERROR
    default_code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code
        self.headers = dict(headers or {})

    def to_dict(self) -> dict[str, Any]:
        return error_body(self.message, self.error_type, self.param, self.code)


class InvalidRequestError(OpenAIError):
    """400: the request is malformed or asks for something this server does not do."""

    status_code = 400
    error_type = INVALID_REQUEST


class ContextLengthExceededError(InvalidRequestError):
    """400: prompt (plus requested completion) does not fit the model's context."""

    default_code = "context_length_exceeded"


class AuthenticationError(OpenAIError):
    """401: the API key is missing or not one of the ingress's keys (OpenAI's shape:
    ``invalid_request_error`` / ``invalid_api_key``; ``WWW-Authenticate: Bearer``)."""

    status_code = 401
    error_type = INVALID_REQUEST
    default_code = "invalid_api_key"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"WWW-Authenticate": "Bearer"})


class ModelNotFoundError(OpenAIError):
    """404: the request names a model this deployment does not serve."""

    status_code = 404
    error_type = INVALID_REQUEST
    default_code = "model_not_found"

    def __init__(self, model: str) -> None:
        super().__init__(
            f"The model `{model}` does not exist or you do not have access to it.",
            param="model",
        )


class NotFoundError(OpenAIError):
    """404: the path names something this deployment does not run (e.g. no tuner)."""

    status_code = 404
    error_type = INVALID_REQUEST
    default_code = "not_found"


class OverloadedError(OpenAIError):
    """503: admission refused (queue full); the client should retry after a while."""

    status_code = 503
    error_type = SERVER_ERROR
    default_code = "overloaded"

    def __init__(
        self,
        message: str = "The server is currently overloaded, please try again later.",
        *,
        retry_after_s: int | None = None,
    ) -> None:
        headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
        super().__init__(message, headers=headers)


class ServiceUnavailableError(OpenAIError):
    """503: a model the request needs has no healthy replica now, or stopped answering;
    retrying after ``Retry-After`` seconds should succeed once it is back."""

    status_code = 503
    error_type = SERVER_ERROR
    default_code = "service_unavailable"

    def __init__(self, message: str, *, retry_after_s: int = 1, code: str | None = None) -> None:
        super().__init__(message, code=code, headers={"Retry-After": str(retry_after_s)})


class RequestTimeoutError(ServiceUnavailableError):
    """503: the request reached its deadline (``timeout``) before it finished."""

    default_code = "timeout"


class RequestFailedError(OpenAIError):
    """500 whose message is shown: a model failed this request (the others are unharmed)."""

    status_code = 500
    error_type = SERVER_ERROR
    default_code = "request_failed"


class InternalServerError(OpenAIError):
    """500: a fault of the server. Never raised for bad input."""

    status_code = 500
    error_type = SERVER_ERROR

    def __init__(
        self, message: str = "The server had an error while processing your request."
    ) -> None:
        super().__init__(message)


def error_body(
    message: str, error_type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's envelope: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_response(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """``(status, body)`` for any exception; unknown ones are a 500 that hides their text."""
    error = as_openai_error(exc)
    return error.status_code, error.to_dict()


def exc_headers(exc: BaseException) -> dict[str, str]:
    """Extra response headers an error asks for (``Retry-After`` on 503), else empty."""
    return dict(exc.headers) if isinstance(exc, OpenAIError) else {}


def as_openai_error(exc: BaseException) -> OpenAIError:
    """Normalise: `OpenAIError` as is; validation / JSON errors → 400; anything else → 500."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, json.JSONDecodeError):
        return from_json_error(exc)
    if isinstance(exc, RecursionError):  # json.loads of a body nested thousands deep
        return InvalidRequestError(
            "The JSON body is nested too deeply to parse.", code="invalid_json"
        )
    if _is_request_validation_error(exc):
        return from_validation_error(exc)
    return InternalServerError()


REQUEST_MODELS = frozenset({"CompletionRequest", "ChatCompletionRequest", "ResponsesRequest"})


def _is_request_validation_error(exc: BaseException) -> bool:
    """FastAPI's ``RequestValidationError`` (checked by name: no FastAPI import), or pydantic's
    ``ValidationError`` of a request model. A ``ValidationError`` of anything else (a response
    or config model) is a server bug, so it stays a 500."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    if "RequestValidationError" in names:
        return True
    return "ValidationError" in names and getattr(exc, "title", None) in REQUEST_MODELS


def from_json_error(exc: json.JSONDecodeError | ValueError) -> InvalidRequestError:
    """A body that is not JSON: 400 naming where parsing stopped."""
    if isinstance(exc, json.JSONDecodeError):
        detail = f" ({exc.msg} at line {exc.lineno} column {exc.colno})"
    else:
        detail = f" ({exc})" if str(exc) else ""
    return InvalidRequestError(
        f"We could not parse the JSON body of your request{detail}. The body must be a "
        "JSON object; check for a trailing comma, missing quotes or an empty body.",
        code="invalid_json",
    )


def from_validation_error(exc: Any) -> InvalidRequestError:
    """A pydantic / FastAPI validation error as one 400 naming the first bad field.

    ``exc`` is anything with ``.errors()`` in pydantic's shape, or that list itself.
    ``param`` is the path of the first error (``"messages[0].role"``); every error is in the
    message, so a client fixing one field learns about the others too.
    """
    raw = exc.errors() if hasattr(exc, "errors") else exc
    errors = list(_as_dicts(raw))
    if not errors:
        return InvalidRequestError("Invalid request.")
    first = errors[0]
    if first.get("type") == "json_invalid":  # FastAPI: the body is not JSON
        return from_json_error(ValueError(first.get("ctx", {}).get("error", "")))
    parts = [_describe(e) for e in errors[:5]]
    if len(errors) > 5:
        parts.append(f"(and {len(errors) - 5} more errors)")
    return InvalidRequestError(
        " ".join(parts), param=_param(first.get("loc", ())), code=_code(first)
    )


def _as_dicts(raw: Iterable[Any]) -> Iterable[Mapping[str, Any]]:
    return (e for e in raw if isinstance(e, Mapping))


def _param(loc: Sequence[Any]) -> str | None:
    """``("body", "messages", 0, "role")`` → ``"messages[0].role"``; the body itself → None."""
    path = ""
    for i, part in enumerate(loc):
        if i == 0 and part == "body":
            continue
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path or None


def _code(error: Mapping[str, Any]) -> str:
    kind = str(error.get("type", ""))
    if kind == "missing":
        return "missing_required_parameter"
    if kind == "unsupported_value":
        return kind
    if kind.endswith("_type") or kind.endswith("_parsing") or kind == "model_attributes_type":
        return "invalid_type"
    if kind == "json_invalid":
        return "invalid_json"
    return "invalid_value"


def _describe(error: Mapping[str, Any]) -> str:
    param = _param(error.get("loc", ()))
    kind = str(error.get("type", ""))
    msg = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
    if param is None:
        if kind in ("model_type", "model_attributes_type", "dict_type"):
            return "The request body must be a JSON object."
        return f"{msg.rstrip('.')}."
    if kind == "missing":
        return f"Missing required parameter: '{param}'."
    if kind == "unsupported_value":
        return f"{msg.rstrip('.')}."
    got = ""  # pydantic's own type errors say what was expected, not what came
    if "input" in error and kind != "invalid_type" and _code(error) == "invalid_type":
        got = f" (got {_json_type(error['input'])})"
    return f"Invalid value for '{param}': {msg.rstrip('.')}{got}."


def _json_type(value: Any) -> str:
    """The JSON name of a decoded value's type, for messages like "(got string)"."""
    names = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array"}
    if value is None:
        return "null"
    if isinstance(value, Mapping):
        return "object"
    return names.get(type(value), type(value).__name__)
