"""The served first-token probe (``host_path``'s N = 1 rows): one streamed chat request at a
time on an otherwise idle app, timed from sending it to reading its first content token,
for each first-token path (``PROBE_ROUTING``), by a bare HTTP client (``raw_http.py``: the
figure the targets read) and by httpx beside it."""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

# The probe's routing: the served policy as configured (p = 0.35: a third of the first
# tokens escalate, so the median sits high in the kept ones' spread), and the two paths a
# first token takes, each on its own (the Bernoulli policy's per-request ``p``): kept by
# the entry model (p = 0) and escalated to the large model (p = 1).
PROBE_ROUTING: dict[str, float | None] = {"mixed": None, "kept": 0.0, "escalated": 1.0}


# The probe's clients: "raw", a bare HTTP/1.1 client (``loadtest/raw_http.py``: the figure
# the targets read), and "httpx", printed beside it (its own ~2 ms per request at idle on
# the 2-core machine is the client's, not the server's: docs/benchmarks/README.md).
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
    ``url`` (the app's base, without ``/v1``). Also ``front_floor.py``'s client."""
    path = "/v1/chat/completions"
    if client == "raw":
        from loadtest.raw_http import RawHttp

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
    return line.startswith("data: {") and _has_content(line)


def _has_content(line: str) -> bool:
    choices = json.loads(line[len("data: ") :]).get("choices") or [{}]
    return bool((choices[0].get("delta") or {}).get("content"))
