"""``loadtest/front_floor.py``: the one-line app answers through bare uvicorn and through
Serve's proxy on the shared test cluster, each probe times every request to its content
line, and the verdict is what the front adds over uvicorn, per gap, against 5 ms."""

from __future__ import annotations

import asyncio

import httpx

from loadtest.front_floor import (
    FRONT_BUDGET_MS,
    SERVE_APP,
    Floor,
    pool,
    probe,
    serve_floor,
    targets,
    uvicorn_server,
)


def test_the_probe_times_each_request_through_uvicorn_and_through_serve(serve_http) -> None:
    port = int(serve_http.rsplit(":", 1)[1])
    with uvicorn_server() as bare, serve_floor(port) as served:
        assert served == f"{serve_http}/{SERVE_APP}"
        for url in (bare, served):
            first = asyncio.run(probe(url, requests=4, gap_s=0.001))
            assert len(first) == 4 and first == sorted(first)
            assert all(0 < ms < 5_000 for ms in first)
            body = httpx.post(f"{url}/v1/chat/completions", json={}, timeout=30).text
            assert body.endswith("data: [DONE]\n\n") and '"content":"x"' in body
    # deleted on the way out: Serve's port no longer routes to it
    assert httpx.get(f"{served}/health", timeout=30).status_code == 404


def test_the_verdict_is_what_the_front_adds_over_uvicorn_per_gap() -> None:
    floors = [
        Floor("uvicorn", 0.006, [1.0, 1.2]),
        Floor("uvicorn", 0.006, [1.1]),
        Floor("proxy", 0.006, [7.0, 8.0, 9.0]),
        Floor("uvicorn", 0.03, [2.0]),
        Floor("proxy", 0.03, [6.5]),
        Floor("proxy", 0.1, [1.0]),  # no uvicorn figure at this gap: no verdict
    ]
    six = pool(floors, "uvicorn", 0.006)
    assert six.first_ms == [1.0, 1.1, 1.2] and six.p50 == 1.1
    pooled = [pool(floors, f, g) for g in (0.006, 0.03, 0.1) for f in ("uvicorn", "proxy")]
    verdicts = {name.split(":")[0]: (ok, detail) for name, ok, detail in targets(pooled, "proxy")}
    assert FRONT_BUDGET_MS == 5.0
    assert verdicts == {
        "gap 6 ms": (False, "6.9 ms (8.00 vs 1.10 ms)"),
        "gap 30 ms": (True, "4.5 ms (6.50 vs 2.00 ms)"),
    }
