"""ZeroMQ peer channel: a PULL mailbox per replica, lazily created PUSH sockets to peers.

Data enters through the replica's PULL socket, bound either on ipc:// (a socket file in a
temp dir: replicas on one node) or tcp:// (host and port from `ZmqConfig`; port 0 lets the
OS pick a free one). The bound address is registered in the directory. Data leaves through
one PUSH socket per destination, connected on first use and cached: each `send` is one
single-part message holding `encode_batch(msgs)`. ZeroMQ keeps per-connection FIFO order.

The PUSH sockets are `zmq.asyncio` sockets owned by the event loop that called `start()`:
use the channel from that loop only. The PULL socket is a plain one, read with non-blocking
receives by one reader: `recv` on that loop (which watches its descriptor), a receiver
thread (`start_receiver`), or a replica's step thread (`receive_inline`). Every socket has
linger 0, so `close()` never blocks on undelivered frames (they are dropped; the protocol
tolerates loss at shutdown).

With `ZmqConfig.key` set (the deployments always set it), every frame is signed and checked
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
- with ``curve`` set (``transport.curve``: a CURVE key pair derived from the peer key, the
  same for every replica of the app), the PULL socket is a CURVE server whose ZAP handler
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
from dataclasses import dataclass
from typing import Literal

import zmq
import zmq.asyncio

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
RECEIVER_POLL_MS = 100  # a receiver thread looks for a stop this often while nothing comes
RECEIVE_RETRY_S = 0.05  # after a failed receive, the socket is left alone this long
_GET = zmq.Socket.get  # ``read``'s readiness check, with plain ints
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)


FRAME_BYTES_PER_TOKEN = 9  # msgpack: an int up to 2**64 (token ids are far below)
FRAME_BYTES_PER_MESSAGE = 64 << 10  # ids, RouteState, sampling, extras, token reports


def largest_frame_bytes(max_model_len: int, max_num_seqs: int) -> int:
    """An upper bound on a legitimate frame: one step's batch to one destination holds at
    most ``max_num_seqs`` messages, each at most a whole sequence of token ids (a NEW that
    re-creates a request) plus its bounded per-message fields."""
    return max_num_seqs * (max_model_len * FRAME_BYTES_PER_TOKEN + FRAME_BYTES_PER_MESSAGE)


@dataclass(frozen=True)
class ZmqConfig:
    """How a replica's mailbox is bound and advertised."""

    transport: Literal["ipc", "tcp", "unix"] = "ipc"  # unix: ``UnixChannel``, no ZeroMQ
    bind_host: str | None = None  # tcp: interface to bind; None: this node's own address
    advertise_host: str | None = None  # tcp: host peers connect to; default: bind_host or IP
    port: int = 0  # tcp: 0 picks a free port (or one of port_range)
    port_range: tuple[int, int] | None = None  # tcp: bind the first free port in [lo, hi]
    ipc_dir: str | None = None  # ipc: directory for socket files; default: a fresh temp dir
    send_hwm: int = 1024  # frames queued per peer before sends fail fast
    recv_hwm: int = 1024  # frames queued per incoming connection
    key: bytes | None = None  # MAC key (`auth.derive_key`); None: frames are not signed
    max_frame_bytes: int = 16 << 20  # larger frames are dropped by ZeroMQ
    reject_rate: float = 1000.0  # rejected frames examined per second (``RejectPacer``)
    curve: CurveKeys | None = None  # CURVE handshake with the app's own key pair only
    # a replica's step thread reads its PULL socket itself (``receive_inline``), with no
    # receiver thread; False: a receiver thread hands it the frames (``start_receiver``)
    receive_on_step_thread: bool = True


class ZmqChannel(FrameChecks, ChannelReaders, PeerChannel):
    def __init__(
        self,
        model: str,
        replica: str,
        directory: Directory,
        config: ZmqConfig | None = None,
        context: zmq.asyncio.Context | None = None,
        on_reject: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(model, replica, directory)
        self.config = config or ZmqConfig()
        self._context = context
        key = self.config.key
        self._signer = FrameSigner(key) if key is not None else None
        self._init_checks(key, self.config.reject_rate, on_reject)
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
        # a receiver thread (``start_receiver``) must not share. ``recv`` wraps it.
        pull = zmq.Context.shadow(self.context.underlying).socket(zmq.PULL)
        pull.setsockopt(zmq.LINGER, 0)
        pull.setsockopt(zmq.RCVHWM, self.config.recv_hwm)
        pull.setsockopt(zmq.MAXMSGSIZE, self.config.max_frame_bytes)
        try:
            if self.config.curve is not None:
                curve_allowlist(self.context, self.config.curve)
                self.config.curve.serve(pull)
            address = self._bind(pull)
        except BaseException:
            pull.close(linger=0)
            raise
        self._pull_now = pull
        return address

    def _bind(self, pull: zmq.Socket) -> str:
        cfg = self.config
        if cfg.transport == "ipc":
            directory = cfg.ipc_dir
            if directory is None:
                directory = self._ipc_dir_owned = tempfile.mkdtemp(prefix="trr-")
            safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in self.name)
            path = os.path.join(directory, f"{safe[:40]}-{uuid.uuid4().hex[:8]}.sock")
            if len(path) > _IPC_PATH_MAX:
                raise ValueError(f"ipc socket path too long ({len(path)} chars): {path}")
            pull.bind(f"ipc://{path}")
            os.chmod(path, 0o600)  # only this user's processes may connect
            return f"ipc://{path}"
        if cfg.transport != "tcp":
            raise ValueError(f"unknown zmq transport {cfg.transport!r} (ipc or tcp)")
        host = cfg.bind_host or self._advertised_host()
        if cfg.port_range is not None and cfg.port == 0:
            bound = _bind_in_range(pull, host, cfg.port_range)
        else:
            pull.bind(f"tcp://{host}:{'*' if cfg.port == 0 else cfg.port}")
            bound = pull.getsockopt_string(zmq.LAST_ENDPOINT)  # tcp://host:port
        bound_port = bound.rsplit(":", 1)[1]
        return f"tcp://{self._advertised_host()}:{bound_port}"

    def _advertised_host(self) -> str:
        cfg = self.config
        if cfg.advertise_host:
            return cfg.advertise_host
        if cfg.bind_host is not None and cfg.bind_host not in ("0.0.0.0", "*", "::"):
            return cfg.bind_host
        return _node_ip()

    async def _send_frame(self, dst: Endpoint, msgs: Sequence[PeerReq]) -> int:
        if dst.name not in self._push_now:
            await self._connect(dst)
        frame = encode_batch(msgs)
        with self._push_lock:  # signed in the order sent: the receiver's counter check
            push = self._push_now.get(dst.name)
            if push is None:  # forgotten meanwhile
                raise PeerUnreachableError(f"{dst.name} was forgotten while connecting")
            if self._signer is not None:
                frame = self._signer.sign(dst.name, frame)
            try:  # never wait: a peer that stopped reading must not stall the sender's loop
                push.send(frame, flags=zmq.NOBLOCK, copy=True)
            except zmq.Again:
                raise PeerUnreachableError(
                    f"{dst.name} is not reading: {self.config.send_hwm} frames already queued"
                ) from None
        return len(frame)

    def send_now(self, dst: str, msgs: Sequence[PeerReq]) -> bool:
        """The frame sent from the calling thread (a replica's step thread) when ``dst`` is
        connected and can take it: no event-loop wake, queue or task per frame (ZeroMQ does
        the I/O on its own thread either way)."""
        if self._closed or not msgs or dst not in self._push_now:
            return False
        frame = encode_batch(msgs)
        with self._push_lock:
            push = self._push_now.get(dst)
            if push is None or self._closed:
                return False
            if self._signer is not None:  # signed in the order sent, under the same lock
                frame = self._signer.sign(dst, frame)
            try:
                push.send(frame, flags=zmq.NOBLOCK, copy=True)
            except zmq.Again:  # full: the event loop's path reports it (a counter skipped
                return False  # is harmless: the receiver wants each above the last)
            self.frames_sent += 1
            self.bytes_sent += len(frame)
        return True

    async def _connect(self, dst: Endpoint) -> zmq.asyncio.Socket:
        pending = self._connecting.get(dst.name)
        if pending is not None:  # another send is connecting to the same peer
            return await pending
        future: asyncio.Future[zmq.asyncio.Socket] = asyncio.get_running_loop().create_future()
        self._connecting[dst.name] = future
        try:
            push = self.context.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.setsockopt(zmq.SNDHWM, self.config.send_hwm)
            if self.config.curve is not None:
                self.config.curve.dial(push)
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

    # -------------------------------------------------------------- receiver thread
    def _receive_thread(self, on_batch: Callable[[list[PeerReq]], None]) -> None:
        """``start_receiver``'s thread: it waits inside ZeroMQ without the interpreter lock,
        and a frame costs no event-loop wake, Future or callback."""
        pull = self._pull_now
        assert pull is not None
        more = False  # frames left by the last read, which no poll announces
        while not (self._receiver_stop or self._closed):
            paused = self.paused_s()
            if paused:  # past the reject budget: a flood pays in time, not in our CPU
                time.sleep(min(paused, RECEIVER_POLL_MS / 1e3))
                continue
            try:
                if not more and not pull.poll(RECEIVER_POLL_MS):  # without the interpreter lock
                    continue
            except zmq.ZMQError:
                if self._receiver_stop or self._closed:
                    return
                logger.exception("%s: receive failed", self.name)
                time.sleep(RECEIVE_RETRY_S)
                continue
            more = not self.read(on_batch)[1]

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
        receiver = self._receiver
        if receiver is not None:  # it owns the PULL socket until it has stopped
            self._receiver_stop = True
            await asyncio.to_thread(receiver.join, 2.0)
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
        if pull_now is not None and not _alive(receiver) and not _alive(self.inline_thread):
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
