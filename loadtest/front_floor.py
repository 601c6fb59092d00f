"""The first streamed line's floor through Serve's front, at idle: a FastAPI app that answers a
chat request with one content line, on Ray Serve and under bare uvicorn, probed alternately.

    python -m loadtest front-floor                    # Serve's Python proxy vs bare uvicorn
    python -m loadtest front-floor --front haproxy    # Serve's HAProxy ingress vs uvicorn

What the front adds over uvicorn no app behind it can cut; the host path's first-token
targets (8 ms through Serve's port, 3 ms on the direct port) leave it 5 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from loadtest.common import free_port, header, percentile, print_targets, start_serve, wait_ready
from loadtest.raw_http import first_token_client

SERVE_APP = "front-floor"  # the app's name and route prefix on Serve's port
FRONT_BUDGET_MS = 8.0 - 3.0  # 8 ms through Serve's port, 3 ms on the direct port
WARMUP = 5  # requests before the timed ones, on the same connection
BODY = {
    "model": "floor",
    "messages": [{"role": "user", "content": "hello"}],
    "max_tokens": 4,
    "stream": True,
}


def make_app() -> FastAPI:
    """One content line, then ``[DONE]``, for every chat request; ``/health`` answers 200.
    (uvicorn's ``--factory`` target, and the Serve deployment's ingress.)"""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> StreamingResponse:
        await request.body()

        async def lines():  # type: ignore[no-untyped-def]
            yield b'data: {"choices":[{"index":0,"delta":{"content":"x"}}]}\n\n'
            yield b"data: [DONE]\n\n"

        return StreamingResponse(lines(), media_type="text/event-stream")

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return app


@dataclass
class Floor:
    front: str  # "uvicorn", "proxy" or "haproxy"
    gap_s: float
    first_ms: list[float]  # sorted

    @property
    def p50(self) -> float:
        return percentile(self.first_ms, 0.5)

    @property
    def p90(self) -> float:
        return percentile(self.first_ms, 0.9)


async def probe(url: str, requests: int, gap_s: float) -> list[float]:
    """Milliseconds to the first content line of ``requests`` chat requests to ``url``, one
    at a time on one keep-alive connection, ``gap_s`` idle before each (sorted)."""
    times = []
    async with first_token_client(url, "raw") as first_of:
        for i in range(WARMUP + requests):
            await asyncio.sleep(gap_s)
            first = await first_of(BODY)
            if first is None:
                raise RuntimeError(f"{url}: a response without a content line")
            if i >= WARMUP:
                times.append(1e3 * first)
    return sorted(times)


@contextlib.contextmanager
def uvicorn_server() -> Iterator[str]:
    """The app under uvicorn in its own process (as the ingress's direct port serves)."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "loadtest.front_floor:make_app", "--factory",
         "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(f"{url}/health", timeout_s=120.0)
        yield url
    finally:
        server.terminate()
        server.wait(30)


@contextlib.contextmanager
def serve_floor(http_port: int) -> Iterator[str]:
    """The app as a Serve deployment on the Ray cluster of this process (started here, Serve
    on ``http_port``, when none is), reached through Serve's front; deleted on the way out."""
    from ray import serve

    start_serve(http_port, num_cpus=2)

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    @serve.ingress(make_app())
    class FrontFloor:
        pass

    serve.run(FrontFloor.bind(), name=SERVE_APP, route_prefix=f"/{SERVE_APP}")
    url = f"http://127.0.0.1:{http_port}/{SERVE_APP}"
    try:
        wait_ready(f"{url}/health", timeout_s=120.0)
        yield url
    finally:
        serve.delete(SERVE_APP)


def targets(floors: list[Floor], front: str) -> list[tuple[str, bool, str]]:
    """Per gap: what Serve's front adds to the first line's p50 over bare uvicorn, against
    the 5 ms that the two first-token targets leave it."""
    out = []
    for gap in sorted({f.gap_s for f in floors}):
        by_front = {f.front: f for f in floors if f.gap_s == gap and f.first_ms}
        if front not in by_front or "uvicorn" not in by_front:
            continue
        added = by_front[front].p50 - by_front["uvicorn"].p50
        out.append((
            f"gap {gap * 1e3:g} ms: Serve's {front} adds <= {FRONT_BUDGET_MS:g} ms to the "
            "first line (8 ms via Serve's port minus 3 ms direct)",
            added <= FRONT_BUDGET_MS,
            f"{added:.1f} ms ({by_front[front].p50:.2f} vs {by_front['uvicorn'].p50:.2f} ms)",
        ))  # fmt: skip
    return out


def pool(floors: list[Floor], front: str, gap_s: float) -> Floor:
    """The rounds of one front and gap as one sample."""
    same = sorted(v for f in floors if f.front == front and f.gap_s == gap_s for v in f.first_ms)
    return Floor(front, gap_s, same)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest front-floor", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--front", choices=("proxy", "haproxy"), default="proxy",
                        help="Serve's front: its Python proxy, or its HAProxy ingress")  # fmt: skip
    parser.add_argument("--gaps-ms", default="0,6,30", help="idle time before each request")
    parser.add_argument("--requests", type=int, default=60, help="per front, gap and round")
    parser.add_argument("--rounds", type=int, default=2, help="each front, alternately")
    parser.add_argument("--port", type=int, default=18171, help="Serve's HTTP port")
    args = parser.parse_args(argv)
    if args.front == "haproxy":  # read when the Ray cluster starts
        os.environ["RAY_SERVE_ENABLE_HA_PROXY"] = "1"
    gaps = [float(g) / 1e3 for g in args.gaps_ms.split(",")]
    print(header(), flush=True)
    floors: list[Floor] = []
    with uvicorn_server() as bare, serve_floor(args.port) as served:
        for gap in gaps:
            for _ in range(args.rounds):
                for front, url in (("uvicorn", bare), (args.front, served)):
                    floor = Floor(front, gap, asyncio.run(probe(url, args.requests, gap)))
                    floors.append(floor)
                    print(
                        f"{front:8s} gap {gap * 1e3:4.0f} ms: first line p50 {floor.p50:6.2f} "
                        f"ms, p90 {floor.p90:6.2f} ms"
                    )
    pooled = [pool(floors, f, g) for g in gaps for f in ("uvicorn", args.front)]
    print_targets(targets(pooled, args.front))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
