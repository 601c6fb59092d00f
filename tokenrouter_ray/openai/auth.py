"""Optional API keys for the OpenAI routes: ``Authorization: Bearer <key>``.

Off by default. Keys come from ``TOKENROUTER_API_KEYS`` (comma-separated; whitespace around
each key is ignored; the Helm chart can fill it from a Kubernetes Secret). When at least one
key is set, every request (every ``/v1`` route, and any other path but ``/health`` and
``/metrics``, which stay open for probes and scrapes) must carry one of them, or it is
answered 401 in OpenAI's envelope (``invalid_request_error`` / ``invalid_api_key``) before
any route runs.

`ApiKeyMiddleware` is a plain ASGI middleware (not Starlette's ``BaseHTTPMiddleware``), so
streaming responses and client disconnects reach the routes exactly as without it. Keys are
compared as SHA-256 digests with `hmac.compare_digest`, against every key, so neither the
time taken nor an early exit tells how much of a guess was right.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from tokenrouter_ray.openai.errors import AuthenticationError, error_response

API_KEYS_ENV = "TOKENROUTER_API_KEYS"


def parse_keys(raw: str | None) -> tuple[str, ...]:
    """``"a, b,,c"`` → ``("a", "b", "c")``; unset or blank → ``()`` (keys off)."""
    return tuple(k.strip() for k in (raw or "").split(",") if k.strip())


class ApiKeys:
    """A set of accepted keys, held as digests; empty means every request is allowed."""

    def __init__(self, keys: Iterable[str] = ()) -> None:
        self._digests = tuple(_digest(k) for k in keys if k)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ApiKeys:
        return cls(parse_keys((os.environ if env is None else env).get(API_KEYS_ENV)))

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def accepts(self, key: str) -> bool:
        """Whether ``key`` is one of the keys; constant time in the key's content."""
        got = _digest(key)
        ok = False
        for want in self._digests:  # no early exit
            ok |= hmac.compare_digest(got, want)
        return ok

    def check(self, authorization: str | None) -> None:
        """Raise `AuthenticationError` unless the header is ``Bearer <an accepted key>``."""
        if not self.enabled:
            return
        scheme, _, key = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise AuthenticationError(
                "You didn't provide an API key. You need to provide your API key in an "
                "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
            )
        if not self.accepts(key.strip()):
            raise AuthenticationError("Incorrect API key provided.")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


OPEN_PATHS = frozenset({"/health", "/metrics"})  # probes and scrapes: never need a key


def is_protected(scope: Mapping[str, Any]) -> bool:
    """Whether a request needs a key: every path (below the app's route prefix) but
    `OPEN_PATHS`; failing closed, so a route added later is covered too."""
    path = scope.get("path", "")
    root = scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root) :]
    return (path.rstrip("/") or "/") not in OPEN_PATHS


class ApiKeyMiddleware:
    """ASGI middleware: 401 envelope for a protected request without an accepted key.

    ``keys`` is an `ApiKeys` or a callable returning one (read per request, so a test or a
    replica can change ``TOKENROUTER_API_KEYS`` without rebuilding the app); default: the
    environment, re-parsed only when the variable changes. ``on_reject`` (no arguments) is
    called for each request refused (the ingress counts them).
    """

    def __init__(
        self, app: Any, keys: Any = None, on_reject: Callable[[], None] | None = None
    ) -> None:
        self.app = app
        self._keys = keys
        self._on_reject = on_reject
        self._cached: tuple[str | None, ApiKeys] = (None, ApiKeys())

    def keys(self) -> ApiKeys:
        if isinstance(self._keys, ApiKeys):
            return self._keys
        if callable(self._keys):
            return self._keys()
        raw = os.environ.get(API_KEYS_ENV)
        if raw != self._cached[0]:
            self._cached = (raw, ApiKeys(parse_keys(raw)))
        return self._cached[1]

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope.get("type") == "http" and is_protected(scope):
            keys = self.keys()
            if keys.enabled:
                header = _header(scope, b"authorization")
                try:
                    keys.check(header)
                except AuthenticationError as exc:
                    if self._on_reject is not None:
                        self._on_reject()
                    await _send_error(send, exc)
                    return
        await self.app(scope, receive, send)


def _header(scope: Mapping[str, Any], name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


async def _send_error(send: Any, exc: AuthenticationError) -> None:
    status, body = error_response(exc)
    payload = json.dumps(body).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
        *((k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in exc.headers.items()),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
