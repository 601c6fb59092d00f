"""The ingress's own HTTP listener, beside Serve's proxy (``ingress.direct_port``).

Behind Serve's proxy a streamed chunk crosses three queues before the client's socket: the
replica's ASGI message queue, a Ray object per chunk to the proxy, and the proxy's own
send. None of them is bounded and none waits for the client, so the ingress cannot see a
client that stopped reading (ingress/backpressure.py never fires;
docs/user-guide/reliability.md), and
every request and chunk pays the extra process hop (docs/benchmarks/README.md, "Host
path", measures it). With ``direct_port`` each ingress replica also serves the
same FastAPI app with uvicorn on that port: the response's ``send`` blocks on the client's
socket, so backpressure works, and the hop is gone.

Every ingress replica on a node binds the same port with ``SO_REUSEPORT``; the kernel spreads
new connections over them (Linux). A replica that stops closes its listener, and the kernel
sends new connections to the others. Serve's proxy keeps serving on its port either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import Any

logger = logging.getLogger(__name__)


def reuseport_listener(host: str, port: int, send_buffer_bytes: int | None = None) -> socket.socket:
    """A listening TCP socket on ``(host, port)`` that other processes may bind too
    (``SO_REUSEPORT``). ``send_buffer_bytes`` caps the kernel's send buffer of accepted
    connections (they inherit it), which bounds what a non-reading client can absorb
    before the server's send blocks."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if send_buffer_bytes:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
        sock.bind((host, port))
        sock.listen(2048)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


class DirectHttp:
    """``app`` served by uvicorn on a shared port, on the running event loop."""

    def __init__(
        self,
        app: Any,
        host: str,
        port: int,
        send_buffer_bytes: int | None = None,
        keep_alive_s: float = 30.0,
    ) -> None:
        self.app, self.host, self.port = app, host, port
        self.send_buffer_bytes = send_buffer_bytes
        self.keep_alive_s = keep_alive_s
        self._server: Any = None
        self._task: asyncio.Task | None = None
        self._sock: socket.socket | None = None

    async def start(self, timeout_s: float = 10.0) -> None:
        import uvicorn

        self._sock = reuseport_listener(self.host, self.port, self.send_buffer_bytes)
        self.port = self._sock.getsockname()[1]  # the port bound (0: one chosen)
        config = uvicorn.Config(
            self.app,
            log_level="warning",
            lifespan="off",
            access_log=False,
            timeout_keep_alive=int(self.keep_alive_s),
        )
        self._server = uvicorn.Server(config)
        self._server.install_signal_handlers = lambda: None  # the host process owns signals
        self._task = asyncio.create_task(self._server.serve(sockets=[self._sock]))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self._server.started:
            if self._task.done():
                self._task.result()  # its error
                raise RuntimeError("the direct HTTP server stopped while starting")
            if loop.time() > deadline:
                raise TimeoutError(f"the direct HTTP server did not start in {timeout_s} s")
            await asyncio.sleep(0.01)
        logger.info("ingress: serving HTTP directly on %s:%d", self.host, self.port)

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Stop accepting, let open responses end for up to ``timeout_s``, then close."""
        if self._server is None:
            return
        self._server.should_exit = True
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout_s)
            except (TimeoutError, asyncio.CancelledError):
                self._server.force_exit = True
                self._task.cancel()
                with contextlib.suppress(BaseException):
                    await self._task
            except Exception:
                logger.exception("ingress: the direct HTTP server failed")
        if self._sock is not None:
            self._sock.close()
        self._server = self._task = self._sock = None
