"""The ingress's direct HTTP listener (ingress/direct_http.py), without Ray: two servers
share one port (SO_REUSEPORT) and both answer; a streamed response to a client that never
reads stops being produced once the sockets are full (what Serve's proxy never lets the
ingress see); stopping one server leaves the other serving, and frees the port."""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from tests.waiting import wait_until
from tokenrouter_ray.ingress.direct_http import DirectHttp

CHUNK = b"x" * 1024


def make_app(name: str, produced: list[int]) -> FastAPI:
    app = FastAPI()

    @app.get("/who")
    async def who() -> dict[str, str]:
        return {"server": name}

    @app.get("/stream")
    async def stream() -> StreamingResponse:
        async def body():
            for _ in range(100_000):  # 100 MB if nothing held it back
                produced[0] += 1
                yield CHUNK

        return StreamingResponse(body())

    return app


def test_two_servers_share_a_port_and_a_non_reading_client_stops_production() -> None:
    async def go() -> None:
        produced = [0]
        first = DirectHttp(make_app("a", produced), "127.0.0.1", 0, send_buffer_bytes=8192)
        await first.start()
        second = DirectHttp(make_app("b", produced), "127.0.0.1", first.port)
        await second.start()
        try:
            seen = set()
            for _ in range(40):  # a new connection each time: the kernel spreads them
                async with httpx.AsyncClient() as client:
                    r = await client.get(f"http://127.0.0.1:{first.port}/who")
                    seen.add(r.json()["server"])
            assert seen == {"a", "b"}

            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", first.port))
            sock.send(b"GET /stream HTTP/1.1\r\nHost: t\r\n\r\n")  # then never read
            await wait_until(lambda: produced[0] > 0, 30, "the stream producing")
            # until the sockets are full: no chunk produced for half a second
            deadline = time.monotonic() + 60
            held = -1
            while produced[0] != held:
                assert time.monotonic() < deadline, "production never stopped"
                held = produced[0]
                await asyncio.sleep(0.5)
            # A negative check: held, it stays held
            await asyncio.sleep(1.0)
            assert produced[0] == held  # production waits for the client
            assert held < 5_000  # a few MB at most, in socket buffers: not the 100 MB
            sock.close()

            await second.stop()
            assert not second.running
            async with httpx.AsyncClient() as client:
                for _ in range(10):  # everything goes to the one left
                    r = await client.get(f"http://127.0.0.1:{first.port}/who")
                    assert r.json() == {"server": "a"}
        finally:
            await first.stop()
            await second.stop()
        # the port is free again
        probe = socket.socket()
        probe.bind(("127.0.0.1", first.port))
        probe.close()

    asyncio.run(go())
