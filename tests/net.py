"""Sockets for tests: a free port to bind (never a fixed one: two test sessions on one
machine must not reach each other's servers), and an ASGI app served on one."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import uvicorn

from loadtest.common import free_port  # the one home, shared with the benchmarks
from tests.waiting import wait_until

__all__ = ["free_port", "serve_asgi"]


@contextlib.asynccontextmanager
async def serve_asgi(
    app: Any, *, send_buffer: int | None = None, log_level: str = "critical"
) -> AsyncIterator[int]:
    """Serve an ASGI app with uvicorn on this event loop, on a free loopback port (bound
    here, so no other process can take it first); yields the port once uvicorn accepts.
    ``send_buffer``: SO_SNDBUF of the listener, which accepted sockets inherit (a small one
    makes the server's sends block soon against a client that does not read)."""
    listener = socket.socket()
    if send_buffer is not None:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
    listener.bind(("127.0.0.1", 0))
    http = uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="off"))
    serving = asyncio.create_task(http.serve(sockets=[listener]))
    try:
        await wait_until(lambda: http.started or serving.done(), timeout_s=30, what="uvicorn")
        if serving.done():
            serving.result()  # uvicorn's own error
        yield listener.getsockname()[1]
    finally:
        http.should_exit = True
        await serving
