"""The first-token probe (``host_path``'s N = 1 rows, ``front_floor``): one streamed chat
request at a time on an idle app, timed from sending it to reading its first content token.

``RawHttp`` writes the HTTP/1.1 request by hand on one keep-alive connection and reads the
response as bytes, because a probe of the server should not carry its client's own time:
``httpx`` spends about 2 ms of its own per streamed request at idle on the 2-core machine,
most of a 3 ms target (docs/benchmarks/README.md, "Host path"). The probes print both.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit


class RawHttpError(RuntimeError):
    """The server answered with a status other than 200."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}: {body[:300]!r}")
        self.status, self.body = status, body


class RawHttp:
    """One connection to ``base_url`` (``http://host:port[/prefix]``), reused across
    requests. Not for concurrent use: one request at a time, as a probe sends them."""

    def __init__(self, base_url: str, timeout_s: float = 30.0) -> None:
        url = urlsplit(base_url)
        if url.scheme != "http" or not url.hostname:
            raise ValueError(f"RawHttp takes an http:// URL, not {base_url!r}")
        self.host, self.port = url.hostname, url.port or 80
        self.prefix = url.path.rstrip("/")
        self.timeout_s = timeout_s
        self.connections = 0  # connections opened (keep-alive: one for a whole probe)
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def close(self) -> None:
        writer, self._reader, self._writer = self._writer, None, None
        if writer is not None:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def __aenter__(self) -> RawHttp:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def post_until(
        self, path: str, body: bytes, wanted: Callable[[str], bool]
    ) -> tuple[float | None, bytes]:
        """POST ``body`` (JSON) to ``path`` and read the whole response: the seconds from
        writing the request to reading the first body line for which ``wanted`` is true
        (None: no such line), and the body."""
        return await asyncio.wait_for(self._post(path, body, wanted), self.timeout_s)

    async def _post(
        self, path: str, body: bytes, wanted: Callable[[str], bool]
    ) -> tuple[float | None, bytes]:
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
            self.connections += 1
        reader, writer = self._reader, self._writer
        assert reader is not None
        head = (
            f"POST {self.prefix}{path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        try:
            t0 = time.perf_counter()
            writer.write(head + body)
            status, headers = await _head(reader)
            lines = _Lines(wanted, t0)
            if headers.get("transfer-encoding", "").lower() == "chunked":
                while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
                    lines.feed(await reader.readexactly(size + 2), size)
                await reader.readuntil(b"\r\n")  # the (empty) trailer section
            else:
                length = int(headers.get("content-length", "0"))
                lines.feed(await reader.readexactly(length), length)
        except BaseException:
            await self.close()  # a half-read response leaves the connection unusable
            raise
        if headers.get("connection", "").lower() == "close":
            await self.close()
        if status != 200:
            raise RawHttpError(status, lines.body)
        return lines.found_s, lines.body


async def _head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    """The status code and the headers (names lower-cased)."""
    raw = await reader.readuntil(b"\r\n\r\n")
    status_line, *fields = raw.decode("latin-1").split("\r\n")
    parts = status_line.split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
        raise ValueError(f"not an HTTP/1.x response: {status_line!r}")
    headers = {}
    for field in fields:
        if field:
            name, _, value = field.partition(":")
            headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers


class _Lines:
    """The body as it arrives, split into lines, timed to the first ``wanted`` one."""

    def __init__(self, wanted: Callable[[str], bool], t0: float) -> None:
        self.wanted, self.t0 = wanted, t0
        self.found_s: float | None = None
        self.body = b""
        self._partial = b""

    def feed(self, data: bytes, size: int) -> None:
        data = data[:size]  # a chunk's data without its CRLF
        self.body += data
        if self.found_s is not None:
            return
        *complete, self._partial = (self._partial + data).split(b"\n")
        for line in complete:
            if self.wanted(line.decode("utf-8", "replace").rstrip("\r")):
                self.found_s = time.perf_counter() - self.t0
                return


# The probe's routing: the policy's mix (p = 0.35), and each path a first token takes on its
# own (the Bernoulli policy's per-request ``p``): kept by the entry model, or escalated.
PROBE_ROUTING: dict[str, float | None] = {"mixed": None, "kept": 0.0, "escalated": 1.0}


# The probe's clients: the bare ``RawHttp`` (what the targets read), and httpx beside it.
PROBE_CLIENTS = ("raw", "httpx")


async def ttft_probe(
    url: str, requests: int = 40, p: float | None = None, client: str = "raw"
) -> float:
    """Median time from sending a streaming chat request to reading its first content
    token off the socket, one request at a time on an otherwise idle app, by ``client``
    (``PROBE_CLIENTS``; the closed loop's TTFT includes the ``openai`` client's own).
    ``p``: the request's own routing threshold (None: the policy's)."""
    body: dict[str, Any] = {
        "model": "tokenrouter",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
    }
    if p is not None:
        body["routing"] = {"threshold": p}
    times = []
    async with first_token_client(url, client) as first_of:
        for i in range(requests + 5):  # the first five warm the connection
            first = await first_of(body)
            if i >= 5 and first is not None:
                times.append(first)
    return 1e3 * statistics.median(times)


@contextlib.asynccontextmanager
async def first_token_client(
    url: str, client: str
) -> AsyncIterator[Callable[[dict[str, Any]], Awaitable[float | None]]]:
    """``first(body)``: the seconds from sending a streamed chat request to reading its
    first content line (None: none came), on one keep-alive connection of ``client`` to
    ``url`` (the app's base, without ``/v1``)."""
    path = "/v1/chat/completions"
    if client == "raw":
        async with RawHttp(url) as raw:

            async def first_raw(body: dict[str, Any]) -> float | None:
                payload = json.dumps(body).encode()
                return (await raw.post_until(path, payload, _is_content_line))[0]

            yield first_raw
        return
    if client != "httpx":
        raise ValueError(f"probe client {client!r}: not one of {PROBE_CLIENTS}")
    import httpx

    async with httpx.AsyncClient(timeout=30) as http:

        async def first_httpx(body: dict[str, Any]) -> float | None:
            t0, first = time.perf_counter(), None
            async with http.stream("POST", f"{url}{path}", json=body) as r:
                async for line in r.aiter_lines():
                    if first is None and _is_content_line(line):
                        first = time.perf_counter() - t0
            return first

        yield first_httpx


def _is_content_line(line: str) -> bool:
    if not line.startswith("data: {"):
        return False
    choices = json.loads(line[len("data: ") :]).get("choices") or [{}]
    return bool((choices[0].get("delta") or {}).get("content"))
