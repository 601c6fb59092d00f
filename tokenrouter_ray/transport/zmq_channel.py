"""ZeroMQ peer channel: a PULL mailbox per replica, lazily created PUSH sockets to peers.

Data enters through the replica's PULL socket, bound either on ipc:// (a socket file in a
temp dir: replicas on one node) or tcp:// (host and port from the `ZmqSpec`; port 0 lets the
OS pick a free one). The bound address is registered in the directory. Data leaves through
one PUSH socket per destination, connected on first use and cached: each `send` is one
single-part message holding `encode_batch(msgs)`. ZeroMQ keeps per-connection FIFO order.

The PUSH sockets are `zmq.asyncio` sockets owned by the event loop that called `start()`:
use the channel from that loop only. The PULL socket is a plain one, read with non-blocking
receives by one reader: `recv` on that loop (which watches its descriptor), or a replica's
step thread (`receive_inline`). Every socket has
linger 0, so `close()` never blocks on undelivered frames (they are dropped; the protocol
tolerates loss at shutdown).

With a `key` (the deployments always pass one), every frame is signed and checked
(`transport.auth`: keyed BLAKE2b over sender, counter, receiver and payload); forged,
replayed, duplicated and malformed frames are dropped unread and counted in `rejected`
(and passed to `on_reject`, which the deployments export as
``tokenrouter_peer_rejected_total{reason}``). ipc socket files are mode 0600 in a private
(0700) directory; frames above `max_frame_bytes` are refused by ZeroMQ itself.

Strangers on the network (docs/user-guide/reliability.md, "junk flood"):
- ``recv`` yields to the event loop every ``YIELD_EVERY`` frames or ``YIELD_S`` seconds, so a
  flood of queued junk (pyzmq completes each receive at once) cannot starve decode,
  heartbeats or health checks;
- each connection queues at most ``recv_hwm`` frames of at most ``max_frame_bytes``;
- rejected frames are examined at most ``reject_rate`` a second (``RejectPacer``): past
  that budget the receiver sleeps before its next read, so a flood costs the replica a
  bounded number of MAC checks (and interpreter time beside the step thread) a second
  whatever its rate, and ZeroMQ's fair queueing across connections keeps delivering the
  honest peers' frames in between;
- tcp binds this node's own address by default (``bind_host=None``), never 0.0.0.0 unless
  asked, and a ``port_range`` gives the fixed ports a NetworkPolicy can name;
- with ``curve`` keys (``transport.zmq.curve``: a CURVE key pair derived from the peer key,
  the same for every replica of the app), the PULL socket is a CURVE server whose ZAP handler
  admits only the app's own public key: a stranger is refused in the handshake and never
  delivers a frame;
- ``key_mismatch_s()`` says for how long every frame received was ``bad_mac`` (this replica
  holds another key than its peers): the model server fails its health check past a bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import shutil
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence

import zmq
import zmq.asyncio

from tokenrouter_ray.config import ZmqSpec
from tokenrouter_ray.protocol import PeerReq, encode_batch
from tokenrouter_ray.transport.auth import FrameSigner
from tokenrouter_ray.transport.base import (
    ChannelClosed,
    Directory,
    Endpoint,
    PeerChannel,
    PeerUnreachableError,
)
from tokenrouter_ray.transport.checks import YIELD_EVERY, ChannelReaders, FrameChecks
from tokenrouter_ray.transport.curve import CurveKeys, curve_allowlist

logger = logging.getLogger(__name__)

_IPC_PATH_MAX = 100  # sun_path is 108 bytes on Linux, 104 on macOS
RECEIVE_RETRY_S = 0.05  # after a failed receive, the socket is left alone this long
_GET = zmq.Socket.get  # ``read``'s readiness check, with plain ints
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)
_ALL_INTERFACES = ("0.0.0.0", "*", "::")


class ZmqChannel(FrameChecks, ChannelReaders, PeerChannel):
    """``PeerChannel`` over ZeroMQ (module docstring), configured by ``spec``
    (``transport.zmq``, validated); beside it what is known only at run time: the MAC
    ``key`` (``auth.derive_key``; None: frames are not signed; with ``spec.curve`` the CURVE
    key pair is derived from it) and ``node_ip``, this node's address, which tcp binds and
    advertises where the spec names no host (None: the host's outward address)."""

    def __init__(
        self,
        model: str,
        replica: str,
        directory: Directory,
        spec: ZmqSpec | None = None,
        *,
        key: bytes | None = None,
        node_ip: str | None = None,
        context: zmq.asyncio.Context | None = None,
        on_reject: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(model, replica, directory)
        self.spec = spec or ZmqSpec()
        self.key, self.node_ip = key, node_ip
        if self.spec.curve and key is None:
            raise ValueError("transport.zmq.curve needs the peer key (derived from the secret)")
        self.curve = CurveKeys.from_key(key) if self.spec.curve and key is not None else None
        self._context = context
        self._signer = FrameSigner(key) if key is not None else None
        self._init_checks(key, self.spec.reject_rate, on_reject)
        # ``recv``: the event loop that watches the PULL socket's descriptor (set at the
        # first ``recv``); one reader at a time (``ChannelReaders``)
        self._watch: tuple[asyncio.AbstractEventLoop, int] | None = None
        self._init_readers()
        # Plain (not asyncio) views of the same sockets: a receive of a queued frame and a
        # non-blocking send need no Future and no event-loop callback (a sixth of the
        # ingress's CPU per token went to pyzmq's asyncio layer; docs/benchmarks/README.md).
        self._pull_now: zmq.Socket | None = None
        self._pushes: dict[str, zmq.asyncio.Socket] = {}
        # Held around every use of a send socket: ``send_now`` runs on a replica's step
        # thread, connecting, forgetting and closing on the event loop (a ZeroMQ socket is
        # safe to move between threads, never to use from two at once).
        self._push_lock = threading.Lock()
        self._push_now: dict[str, zmq.Socket] = {}
        self._connecting: dict[str, asyncio.Future[zmq.asyncio.Socket]] = {}
        # ``receive_inline``: the thread that reads the PULL socket itself
        self.inline_thread: threading.Thread | None = None
        self._ipc_dir_owned: str | None = None

    @property
    def context(self) -> zmq.asyncio.Context:
        if self._context is None:
            self._context = zmq.asyncio.Context.instance()
        return self._context

    async def _open(self) -> str:
        # A plain socket: an asyncio one watches its descriptor from the event loop, which
        # a step thread reading it (``receive_inline``) must not share. ``recv`` wraps it.
        pull = zmq.Context.shadow(self.context.underlying).socket(zmq.PULL)
        pull.setsockopt(zmq.LINGER, 0)
        pull.setsockopt(zmq.RCVHWM, self.spec.recv_hwm)
        pull.setsockopt(zmq.MAXMSGSIZE, self.spec.max_frame_bytes)
        try:
            if self.curve is not None:
                curve_allowlist(self.context, self.curve)
                self.curve.serve(pull)
            address = self._bind(pull)
        except BaseException:
            pull.close(linger=0)
            raise
        self._pull_now = pull
        return address

    def _bind(self, pull: zmq.Socket) -> str:
        cfg = self.spec
        if cfg.transport == "ipc":
            directory = self._ipc_dir_owned = tempfile.mkdtemp(prefix="trr-")
            safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in self.name)
            path = os.path.join(directory, f"{safe[:40]}-{uuid.uuid4().hex[:8]}.sock")
            if len(path) > _IPC_PATH_MAX:
                raise ValueError(f"ipc socket path too long ({len(path)} chars): {path}")
            pull.bind(f"ipc://{path}")
            os.chmod(path, 0o600)  # only this user's processes may connect
            return f"ipc://{path}"
        host = cfg.bind_host or self._node_ip()  # this node's own, never all interfaces
        if cfg.port_range is not None and cfg.port == 0:
            bound = _bind_in_range(pull, host, cfg.port_range)
        else:
            pull.bind(f"tcp://{host}:{'*' if cfg.port == 0 else cfg.port}")
            bound = pull.getsockopt_string(zmq.LAST_ENDPOINT)  # tcp://host:port
        bound_port = bound.rsplit(":", 1)[1]
        return f"tcp://{self._advertised_host()}:{bound_port}"

    def _advertised_host(self) -> str:
        cfg = self.spec
        if cfg.advertise_host:
            return cfg.advertise_host
        if cfg.bind_host is not None and cfg.bind_host not in _ALL_INTERFACES:
            return cfg.bind_host
        return self._node_ip()

    def _node_ip(self) -> str:
        return self.node_ip or _node_ip()

    async def _send_frame(self, dst: Endpoint, msgs: Sequence[PeerReq]) -> int:
        if dst.name not in self._push_now:
            await self._connect(dst)
        return self._write(dst.name, msgs)

    def send_now(self, dst: str, msgs: Sequence[PeerReq]) -> bool:
        """The frame sent from the calling thread (a replica's step thread) when ``dst`` is
        connected and can take it: no event-loop wake, queue or task per frame (ZeroMQ does
        the I/O on its own thread either way)."""
        if self._closed or not msgs or dst not in self._push_now:
            return False
        try:
            self._write(dst, msgs, count=True)
        except PeerUnreachableError:  # full: the event loop's path reports it (a counter
            return False  # skipped is harmless: the receiver wants each above the last)
        return True

    def _write(self, dst: str, msgs: Sequence[PeerReq], count: bool = False) -> int:
        """One frame to the connected ``dst``, signed and sent under the send lock (in the
        order sent: the receiver's counter check), never waiting: a peer that stopped
        reading must not stall the sender. Its size; ``count``: counted in ``frames_sent``
        here, under the lock (``send`` counts its own). ``PeerUnreachableError``: ``dst``
        was forgotten meanwhile, or its queue is full."""
        frame = encode_batch(msgs)
        with self._push_lock:
            push = self._push_now.get(dst)
            if push is None or self._closed:
                raise PeerUnreachableError(f"{dst} was forgotten while connecting")
            if self._signer is not None:
                frame = self._signer.sign(dst, frame)
            try:
                push.send(frame, flags=zmq.NOBLOCK, copy=True)
            except zmq.Again:
                raise PeerUnreachableError(
                    f"{dst} is not reading: {self.spec.send_hwm} frames already queued"
                ) from None
            if count:
                self.frames_sent += 1
                self.bytes_sent += len(frame)
        return len(frame)

    async def _connect(self, dst: Endpoint) -> zmq.asyncio.Socket:
        pending = self._connecting.get(dst.name)
        if pending is not None:  # another send is connecting to the same peer
            return await pending
        future: asyncio.Future[zmq.asyncio.Socket] = asyncio.get_running_loop().create_future()
        self._connecting[dst.name] = future
        try:
            push = self.context.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.setsockopt(zmq.SNDHWM, self.spec.send_hwm)
            if self.curve is not None:
                self.curve.dial(push)
            push.connect(dst.address)
            with self._push_lock:
                self._pushes[dst.name] = push
                self._push_now[dst.name] = zmq.Socket.shadow(push.underlying)
            future.set_result(push)
            return push
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # mark retrieved: no "never retrieved" warning
            raise
        finally:
            del self._connecting[dst.name]

    def forget_peer(self, dst: str) -> None:
        super().forget_peer(dst)
        with self._push_lock:
            self._push_now.pop(dst, None)
            push = self._pushes.pop(dst, None)
            if push is not None:
                push.close(linger=0)

    async def recv(self) -> list[PeerReq]:
        """The next accepted frame's messages, read on the event loop. A queued frame is
        read without waiting; with none, one Future waits for the socket's descriptor to
        signal (``_on_signal``), not pyzmq's asyncio socket, which made a Future, a poll
        registration and callbacks per frame: about a fifth of the ingress's CPU
        (docs/benchmarks/README.md). One ``recv`` at a time."""
        self._may_recv()
        if self._watch is None:
            loop, fd = asyncio.get_running_loop(), self.fileno()
            loop.add_reader(fd, self._on_signal)
            self._watch = (loop, fd)
        while True:
            await self._maybe_yield()
            frame = self._queued_frame()
            if frame is None:  # nothing queued: wait for the descriptor's signal. libzmq
                # processed its pending commands before it said so, so the next frame to
                # arrive signals the descriptor (ZeroMQ signals a change, not a level: a
                # check of the socket's events here would only repeat that work)
                await self._signalled()
                continue
            batch, wait_s = self._accept(frame)
            if batch is not None:
                return batch
            if wait_s > 0:  # past the budget: a flood pays in time, not in our CPU
                await asyncio.sleep(wait_s)

    def _readable(self) -> bool:
        return self._pull_now is not None and not self._closed

    def _loop_watching(self) -> bool:
        return self._watch is not None

    def _on_signal(self) -> None:
        """The event loop's reader callback: the descriptor turned readable. Reading the
        socket's events takes the signal (the descriptor stays readable until then, and the
        loop would call again at once); the waiting ``recv``, if any, then reads."""
        pull = self._pull_now
        if pull is None or self._closed:
            return
        try:
            _GET(pull, _EVENTS)
        except zmq.ZMQError:
            logger.exception("%s: reading the socket's events failed", self.name)
        self._wake_recv()

    # ----------------------------------------------------- read by the step thread
    def fileno(self) -> int:
        """The PULL socket's descriptor. ZeroMQ signals edges on it: it turns readable when
        a frame arrives at a socket that ``read`` left drained, and stays so until the next
        ``read``; a ``read`` that was not drained leaves no signal for what it left."""
        assert self._pull_now is not None
        return self._pull_now.getsockopt(zmq.FD)

    def read(
        self, on_batch: Callable[[list[PeerReq]], None], limit: int = YIELD_EVERY
    ) -> tuple[int, bool]:
        """Read at most ``limit`` queued frames without waiting, each accepted frame's
        messages to ``on_batch`` (one that raises is logged: reading goes on); stops early
        past the reject pacer's budget, or after a failed receive (``paused_s`` then says
        for how long to leave the socket alone). The frames read, and whether the socket was
        left drained (its descriptor then signals the next frame)."""
        pull, read = self._pull_now, 0
        while pull is not None and not self._closed:
            if read >= limit:
                return read, False
            try:  # a plain int option: pyzmq's enum conversions cost more than the call
                if not _GET(pull, _EVENTS) & _POLLIN:
                    return read, True
                frame = pull.recv(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return read, True
            except zmq.ZMQError:
                if self._closed:
                    return read, True
                logger.exception("%s: receive failed", self.name)
                self._paused_until = time.monotonic() + RECEIVE_RETRY_S
                return read, False
            read += 1
            if not self._deliver(frame, on_batch):  # past the reject budget
                return read, False
        return read, True

    def _queued_frame(self) -> bytes | None:
        """A frame already queued on the socket, without a Future; None when none is."""
        if self._closed or self._pull_now is None:
            raise ChannelClosed(f"channel {self.name!r} is closed")
        try:
            return self._pull_now.recv(zmq.NOBLOCK, copy=True)
        except zmq.Again:
            return None

    async def _shut(self) -> None:
        watch, self._watch = self._watch, None
        if watch is not None:  # before the socket closes: its descriptor goes with it
            loop, fd = watch
            if not loop.is_closed():
                loop.remove_reader(fd)
        waiter = self._waiter
        if waiter is not None and not waiter.done():  # the waiting recv raises ChannelClosed
            waiter.set_exception(ChannelClosed(f"channel {self.name!r} is closed"))
        with self._push_lock:
            for push in self._pushes.values():
                push.close(linger=0)
            self._pushes.clear()
            self._push_now.clear()
        pull_now, self._pull_now = self._pull_now, None
        if pull_now is not None and not _alive(self.inline_thread):
            pull_now.close(linger=0)  # (a thread still reading it keeps it: never two)
        if self._ipc_dir_owned is not None:
            shutil.rmtree(self._ipc_dir_owned, ignore_errors=True)


def _alive(thread: threading.Thread | None) -> bool:
    return thread is not None and thread.is_alive()


def _bind_in_range(pull: zmq.Socket, host: str, ports: tuple[int, int]) -> str:
    """Bind the first free port of ``[lo, hi]``, starting at a random one (replicas on one
    node race for ports); the bound endpoint, or ``OSError`` when every port is taken."""
    lo, hi = ports
    if not 0 < lo <= hi <= 65535:
        raise ValueError(f"port_range {ports} must be 1 <= lo <= hi <= 65535")
    start = random.randrange(hi - lo + 1)
    for i in range(hi - lo + 1):
        port = lo + (start + i) % (hi - lo + 1)
        try:
            pull.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE:
                raise
            continue
        return pull.getsockopt_string(zmq.LAST_ENDPOINT)
    raise OSError(f"every port of {lo}-{hi} on {host} is taken (widen transport.zmq.port_range)")


def _node_ip() -> str:
    """This host's outward IP address (no packet is sent: UDP connect only picks a route)."""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_DGRAM)) as probe:
        try:
            probe.connect(("10.255.255.255", 1))
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"
