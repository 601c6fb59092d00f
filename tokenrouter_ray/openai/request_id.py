"""``X-Request-Id``: accepted from the client (or made here), returned, carried to the models.

`RequestIdMiddleware` (plain ASGI, like `auth.ApiKeyMiddleware`, so streaming and client
disconnects pass through untouched) reads the request's ``X-Request-Id`` header, or makes
one (``uuid4().hex``) when it is absent or unusable, puts it in ``scope["state"]``
(Starlette's ``request.state.request_id``) and adds it to the response's headers, errors
and streams included (inside Ray Serve, whose proxy does the same, it only reads the
header, so it is not sent twice). The routes pass `rid_prefix` of it on the `PreparedRequest`; the
ingress starts every wire request id with it, so each model's log lines about that request
(they name the rid) carry the client's id without a protocol field.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from typing import Any

HEADER = b"x-request-id"
MAX_LEN = 256  # a longer header is replaced by a fresh id
_UNSAFE = re.compile(r"[^A-Za-z0-9._:-]")
RID_PREFIX_LEN = 64


def rid_prefix(request_id: str) -> str:
    """The request id as a rid prefix: characters outside ``[A-Za-z0-9._:-]`` become
    ``_``, at most 64 of them (rids travel on every frame and appear in logs)."""
    return _UNSAFE.sub("_", request_id)[:RID_PREFIX_LEN] or "req"


def _usable(value: bytes) -> str | None:
    try:
        text = value.decode("ascii")
    except UnicodeDecodeError:
        return None
    if not text or len(text) > MAX_LEN or not text.isprintable():
        return None
    return text


class RequestIdMiddleware:
    """ASGI middleware: ``scope["state"]["request_id"]``, echoed as ``X-Request-Id`` while
    ``echo()`` is true (Ray Serve's proxy echoes the header itself, and makes one when the
    client sent none: inside Serve this middleware only reads it)."""

    def __init__(self, app: Any, echo: Callable[[], bool] = lambda: True) -> None:
        self.app = app
        self.echo = echo

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope.get("headers", ()) if k.lower() == HEADER), None)
        request_id = (_usable(given) if given is not None else None) or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        if not self.echo():
            await self.app(scope, receive, send)
            return

        async def send_with_id(message: Any) -> None:
            if message.get("type") == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != HEADER]
                headers.append((HEADER, request_id.encode("ascii")))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)


def request_id_of(request: Any) -> str | None:
    """The id the middleware set on a Starlette request (None without the middleware)."""
    return getattr(getattr(request, "state", None), "request_id", None)
