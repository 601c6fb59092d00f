"""The same-node peer channel without ZeroMQ: kernel ``SOCK_SEQPACKET`` Unix sockets.

A ZeroMQ frame crosses four threads: the sender, its context's I/O thread, the receiver's
I/O thread, and the receiver. At idle each crossing is a wake-up, so one frame's hop
between two processes takes several times as long as on a bare Unix socket written and read
by the two threads themselves (docs/benchmarks/README.md, "Host path"), and a first token
that escalates crosses three hops. This channel is that bare socket,
with what the ZeroMQ channel gives beside the hop:

- **Mailbox.** A replica listens on a socket file (mode 0600, in a private 0700 directory,
  as ZeroMQ's ipc files: only this user's processes connect). Each peer that sends to it
  connects once (lazily, on its first frame) and keeps the connection: one connection per
  (sender, receiver) pair, which the kernel keeps in order. ``SOCK_SEQPACKET`` keeps message
  boundaries and, for a connected pair, has no datagram queue limit
  (``net.unix.max_dgram_qlen``, 10 by default, bounds only unconnected datagrams).
- **Large frames.** One packet is at most the sender's socket buffer (``net.core.wmem_max``
  caps what an unprivileged process may ask for; 208 KiB on many hosts). A frame goes as one
  packet when it fits ``PIECE_BYTES``, else as pieces, each marked "more" or "last", joined
  by the receiver per connection (a NEW re-creating a 32k-token request is ~300 KB).
  A frame whose pieces pass ``max_frame_bytes`` is dropped (``too_large``).
- **Never blocking the sender.** Sockets are non-blocking. A piece the kernel cannot take
  now (the receiver is behind) waits in the destination's queue, in order, and the event
  loop sends it when the socket turns writable; later frames queue behind it. Past
  ``send_hwm`` queued frames the send fails (``PeerUnreachableError``), as ZeroMQ's does.
  A receiver that is gone (no socket file, refused, reset) is ``PeerUnreachableError``.
- **The same checks.** Every frame is signed and checked as on ZeroMQ
  (``transport.checks``): MAC, replay counter, encoding, the reject pacer.
- **Read by the step thread.** The receiving sockets are gathered in one epoll set,
  edge-triggered, whose descriptor is ``fileno``: readable when a frame arrives at a channel
  that ``read`` left drained (``transport.base.InlineSource``'s contract). ``recv`` (the
  ingress's event loop) reads the same set.

Configured as ``transport.kind: unix`` (``UnixSpec``: the frame settings only). One node
only: peers on other nodes use ZeroMQ over tcp (``transport.zmq.transport: tcp``). CURVE is
not offered here (it is the tcp transport's answer to strangers on the network).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import logging
import os
import select
import shutil
import socket
import tempfile
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from tokenrouter_ray.config import UnixSpec
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

logger = logging.getLogger(__name__)

SCHEME = "unix://"
PIECE_BYTES = 64 << 10  # the largest packet sent (fits any socket buffer of 128 KiB up)
SOCKET_BUFFER_BYTES = 1 << 20  # asked for; the kernel caps it at net.core.wmem_max
WHOLE, MORE, LAST = 0, 1, 2  # a packet's first byte: a whole frame, or a piece of one
_MARKS = (bytes([WHOLE]), bytes([MORE]), bytes([LAST]))
MAX_CONNECTIONS = 1024  # incoming connections kept; past it new ones are closed at once
_IPC_PATH_MAX = 100  # sun_path is 108 bytes on Linux
_GONE = (errno.ENOENT, errno.ECONNREFUSED, errno.ECONNRESET, errno.EPIPE, errno.ENOTCONN)
_EDGE = select.EPOLLIN | select.EPOLLET


class _Incoming:
    """One peer's connection to this mailbox: its socket and a frame being joined."""

    __slots__ = ("parts", "size", "skip", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.parts: list[bytes] = []
        self.size = 0
        self.skip = False  # the frame being joined is over the limit: drop to its last piece


class _Outgoing:
    """This channel's connection to one peer: the socket and what waits for it, in order
    (each entry one frame's packets, the first possibly partly sent already)."""

    __slots__ = ("armed", "queue", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.queue: collections.deque[collections.deque[bytes]] = collections.deque()
        self.armed = False  # the event loop watches the socket for room


class UnixChannel(FrameChecks, ChannelReaders, PeerChannel):
    """``PeerChannel`` over ``SOCK_SEQPACKET`` Unix sockets (module docstring), configured by
    ``spec`` (``transport.unix``, validated); ``key``: the MAC key, known at run time
    (``auth.derive_key``; None: frames are not signed)."""

    def __init__(
        self,
        model: str,
        replica: str,
        directory: Directory,
        spec: UnixSpec | None = None,
        *,
        key: bytes | None = None,
        on_reject: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(model, replica, directory)
        self.spec = spec or UnixSpec()
        self.key = key
        self._signer = FrameSigner(key) if key is not None else None
        self._init_checks(key, self.spec.reject_rate, on_reject)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._listener: socket.socket | None = None
        self._epoll: select.epoll | None = None
        self._incoming: dict[int, _Incoming] = {}
        self._hot: set[int] = set()  # descriptors reported readable and not yet drained
        self._buffer = bytearray(PIECE_BYTES + 1)
        # Held around every use of an outgoing socket and its queue: ``send_now`` runs on a
        # replica's step thread, the rest on the event loop.
        self._out_lock = threading.Lock()
        self._outgoing: dict[str, _Outgoing] = {}
        self._dir_owned: str | None = None
        self._path: str | None = None
        # one reader: ``recv`` on the event loop, or the step thread
        self._watching = False
        self._ready: collections.deque[list[PeerReq]] = collections.deque()  # for ``recv``
        self._init_readers()
        self.inline_thread: threading.Thread | None = None

    # ------------------------------------------------------------------ binding
    async def _open(self) -> str:
        self._loop = asyncio.get_running_loop()
        directory = self._dir_owned = tempfile.mkdtemp(prefix="trr-")
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in self.name)
        path = os.path.join(directory, f"{safe[:40]}-{uuid.uuid4().hex[:8]}.pkt")
        if len(path) > _IPC_PATH_MAX:
            raise ValueError(f"unix socket path too long ({len(path)} chars): {path}")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_NONBLOCK)
        try:
            listener.bind(path)
            os.chmod(path, 0o600)  # only this user's processes may connect
            listener.listen(128)
            self._epoll = select.epoll()
            self._epoll.register(listener.fileno(), _EDGE)
        except BaseException:
            listener.close()
            raise
        self._listener, self._path = listener, path
        return SCHEME + path

    # ------------------------------------------------------------------ sending
    def _packets(self, dst: str, msgs: Sequence[PeerReq]) -> collections.deque[bytes]:
        """One frame, signed (under the lock: in the order sent), as its packets."""
        frame = encode_batch(msgs)
        if self._signer is not None:
            frame = self._signer.sign(dst, frame)
        if len(frame) <= PIECE_BYTES:
            return collections.deque((_MARKS[WHOLE] + frame,))
        view = memoryview(frame)
        ends = range(PIECE_BYTES, len(frame) + PIECE_BYTES, PIECE_BYTES)
        return collections.deque(
            (_MARKS[LAST] if end >= len(frame) else _MARKS[MORE]) + view[end - PIECE_BYTES : end]
            for end in ends
        )

    async def _send_frame(self, dst: Endpoint, msgs: Sequence[PeerReq]) -> int:
        if dst.name not in self._outgoing:
            self._connect(dst)
        return self._write(dst.name, msgs, self.spec.send_hwm)

    def send_now(self, dst: str, msgs: Sequence[PeerReq]) -> bool:
        """The frame sent from the calling thread (a replica's step thread) when ``dst`` is
        connected and nothing waits for it; what the kernel cannot take at once waits for
        the event loop, in order (the frame counts as sent)."""
        if self._closed or not msgs or dst not in self._outgoing:
            return False
        try:
            self._write(dst, msgs, 1, count=True)
        except PeerUnreachableError:  # gone: the event loop's send reports it (a counter
            return False  # skipped is harmless: the receiver wants each above the last)
        return True

    def _write(self, dst: str, msgs: Sequence[PeerReq], queued: int, count: bool = False) -> int:
        """One frame to the connected ``dst``, behind what waits for it and sent as far as
        the kernel takes it, under the send lock (signed in the order sent); refused when
        ``queued`` frames wait already (the step thread's path: 1, so it never overtakes
        the event loop's). Its size; ``count``: counted in ``frames_sent`` here, under the
        lock (``send`` counts its own). ``PeerUnreachableError``: ``dst`` was forgotten
        meanwhile, too many frames wait, or its connection broke."""
        with self._out_lock:
            out = self._outgoing.get(dst)
            if out is None or self._closed:
                raise PeerUnreachableError(f"{dst} was forgotten while connecting")
            if len(out.queue) >= queued:
                raise PeerUnreachableError(f"{dst} is not reading: {queued} frames already queued")
            packets = self._packets(dst, msgs)
            size = sum(len(p) for p in packets)
            out.queue.append(packets)
            if not self._flush(dst, out):
                raise PeerUnreachableError(f"{dst} is gone (its connection broke)")
            if count:
                self.frames_sent += 1
                self.bytes_sent += size
        return size

    def _flush(self, dst: str, out: _Outgoing) -> bool:
        """Send what waits for ``dst`` until the kernel takes no more (the event loop then
        waits for room); under the lock. False: the peer is gone: its queue is dropped and
        the connection forgotten (the next send connects again, or reports it gone)."""
        sock, queue = out.sock, out.queue
        try:
            while queue:
                packets = queue[0]
                while packets:
                    sock.send(packets[0])
                    packets.popleft()
                queue.popleft()
        except BlockingIOError:
            if not out.armed:
                out.armed = True
                self._call_on_loop(self._watch_room, dst)
            return True
        except OSError as exc:
            if exc.errno not in _GONE:
                logger.warning("%s: sending to %s failed: %s", self.name, dst, exc)
            queue.clear()
            if self._outgoing.get(dst) is out:
                del self._outgoing[dst]
            PeerChannel.forget_peer(self, dst)  # its address is looked up again
            self._call_on_loop(self._close_outgoing, out)
            return False
        return True

    def _on_loop(self) -> bool:
        try:
            return asyncio.get_running_loop() is self._loop
        except RuntimeError:
            return False

    def _call_on_loop(self, fn: Callable[[Any], None], arg: Any) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        if self._on_loop():
            fn(arg)
        else:
            with contextlib.suppress(RuntimeError):  # the loop closed: shutting down
                loop.call_soon_threadsafe(fn, arg)

    def _close_outgoing(self, out: _Outgoing) -> None:
        """On the event loop: stop watching a forgotten connection and close it."""
        if out.armed and self._loop is not None and not self._loop.is_closed():
            with contextlib.suppress(Exception):
                self._loop.remove_writer(out.sock.fileno())
        out.sock.close()

    def _watch_room(self, dst: str) -> None:
        """On the event loop: send ``dst``'s queue once its socket has room."""
        out = self._outgoing.get(dst)
        if out is None or self._loop is None or self._closed:
            return
        self._loop.add_writer(out.sock.fileno(), self._on_room, dst)

    def _on_room(self, dst: str) -> None:
        out = self._outgoing.get(dst)
        if out is None or self._loop is None:
            return
        with self._out_lock:
            self._loop.remove_writer(out.sock.fileno())
            out.armed = False
            self._flush(dst, out)  # gone: forgotten there; the sender's next send reports it

    def _connect(self, dst: Endpoint) -> None:
        if not dst.address.startswith(SCHEME):
            raise PeerUnreachableError(f"{dst.name} is not on this transport: {dst.address}")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_NONBLOCK)
        try:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
            sock.connect(dst.address[len(SCHEME) :])
        except OSError as exc:
            sock.close()
            raise PeerUnreachableError(f"cannot reach {dst.name}: {exc}") from None
        with self._out_lock:
            if dst.name in self._outgoing:  # another send connected meanwhile
                sock.close()
            else:
                self._outgoing[dst.name] = _Outgoing(sock)

    def forget_peer(self, dst: str) -> None:
        super().forget_peer(dst)
        with self._out_lock:
            out = self._outgoing.pop(dst, None)
        if out is not None:
            self._close_outgoing(out)

    # ---------------------------------------------------------------- receiving
    def fileno(self) -> int:
        """The epoll set's descriptor: readable when a frame (or a new peer) arrived at a
        channel that ``read`` left drained."""
        assert self._epoll is not None
        return self._epoll.fileno()

    def read(
        self, on_batch: Callable[[list[PeerReq]], None], limit: int = YIELD_EVERY
    ) -> tuple[int, bool]:
        """Read at most ``limit`` frames without waiting, each accepted frame's messages to
        ``on_batch`` (one that raises is logged: reading goes on); stops early past the
        reject pacer's budget. The frames read, and whether the channel was left drained."""
        epoll, read = self._epoll, 0
        if epoll is None or self._closed:
            return 0, True
        # what turned readable since (each connection's edge), beside what a read left
        self._hot.update(fd for fd, _ in epoll.poll(0))
        listener = self._listener
        while self._hot and not self._closed:
            for fd in list(self._hot):  # a packet from each in turn: a flooding peer
                if read >= limit:  # cannot crowd out the others (ZeroMQ's fair queueing)
                    return read, False
                if listener is not None and fd == listener.fileno():
                    self._accept_peers(listener)
                    self._hot.discard(fd)
                    continue
                conn = self._incoming.get(fd)
                frame = None if conn is None else self._receive(conn)
                if frame is None:  # drained (or closed)
                    self._hot.discard(fd)
                    continue
                if not frame:
                    continue  # a piece of a frame, or a packet dropped
                read += 1
                if not self._deliver(frame, on_batch):  # past the reject budget
                    return read, False
        return read, True

    def _accept_peers(self, listener: socket.socket) -> None:
        assert self._epoll is not None
        while True:
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                logger.warning("%s: accepting a peer failed: %s", self.name, exc)
                return
            if len(self._incoming) >= MAX_CONNECTIONS:
                logger.warning("%s: %d peers connected; refused one", self.name, MAX_CONNECTIONS)
                sock.close()
                continue
            sock.setblocking(False)
            self._incoming[sock.fileno()] = _Incoming(sock)
            self._epoll.register(sock.fileno(), _EDGE)
            self._hot.add(sock.fileno())  # it may have sent already: read it now

    def _receive(self, conn: _Incoming) -> bytes | None:
        """The next whole frame on ``conn``; ``b""`` after a piece of one; None when nothing
        is left (or the peer closed: the connection is dropped)."""
        buffer = self._buffer
        try:
            n = conn.sock.recv_into(buffer, len(buffer), socket.MSG_TRUNC)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:
            n = 0
        if n == 0:  # the peer closed (or reset) its connection
            self._drop(conn)
            return None
        if n > len(buffer) or buffer[0] > LAST:  # no peer of ours sends these
            self._reject("malformed")
            return b""
        mark, data = buffer[0], bytes(buffer[1:n])
        if mark == WHOLE and not conn.parts and not conn.skip:
            return data
        if mark == WHOLE:  # a whole frame inside a joined one: the joined one is broken
            self._reject("malformed")
            conn.parts, conn.size, conn.skip = [], 0, False
            return data
        conn.size += len(data)
        if conn.size > self.spec.max_frame_bytes:
            if not conn.skip:
                self._reject("too_large")
            conn.parts, conn.skip = [], True
        elif not conn.skip:
            conn.parts.append(data)
        if mark == MORE:
            return b""
        frame = b"".join(conn.parts)
        skipped = conn.skip
        conn.parts, conn.size, conn.skip = [], 0, False
        return b"" if skipped else frame

    def _drop(self, conn: _Incoming) -> None:
        fd = conn.sock.fileno()
        self._incoming.pop(fd, None)
        self._hot.discard(fd)
        if self._epoll is not None:
            with contextlib.suppress(OSError, ValueError):
                self._epoll.unregister(fd)
        conn.sock.close()

    def _readable(self) -> bool:
        return self._epoll is not None and not self._closed

    def _loop_watching(self) -> bool:
        return self._watching

    async def recv(self) -> list[PeerReq]:
        """The next accepted frame's messages, read on the event loop (one ``recv`` at a
        time). The epoll set's descriptor is watched by the loop; its callback takes the
        readiness (so a signal nobody reads yet does not spin the loop)."""
        self._may_recv()
        if not self._watching:
            asyncio.get_running_loop().add_reader(self.fileno(), self._on_signal)
            self._watching = True
        ready = self._ready
        while True:
            if ready:
                await self._maybe_yield()
                return ready.popleft()
            _, drained = self.read(ready.append)  # a batch of frames per look
            if ready:
                continue
            paused = self.paused_s()
            if paused:
                await asyncio.sleep(paused)
            elif drained:
                await self._signalled()
            else:  # junk read and dropped, more queued: the loop's other work first
                await self._maybe_yield()

    def _on_signal(self) -> None:
        """The loop's reader callback: take the epoll set's readiness (its descriptor turns
        quiet) and wake the waiting ``recv``."""
        epoll = self._epoll
        if epoll is None or self._closed:
            return
        for fd, _ in epoll.poll(0):
            self._hot.add(fd)
        self._wake_recv()

    # ------------------------------------------------------------------ closing
    async def _shut(self) -> None:
        loop = self._loop
        if self._watching and self._epoll is not None and loop is not None:
            if not loop.is_closed():
                loop.remove_reader(self._epoll.fileno())
            self._watching = False
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(ChannelClosed(f"channel {self.name!r} is closed"))
        with self._out_lock:
            outgoing, self._outgoing = self._outgoing, {}
        for out in outgoing.values():
            self._close_outgoing(out)
        if not _alive(self.inline_thread):  # (a thread still reading keeps them: never
            # closed under it)
            for conn in list(self._incoming.values()):
                self._drop(conn)
            if self._epoll is not None:
                self._epoll.close()
            self._epoll = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._path)
        if self._dir_owned is not None:
            shutil.rmtree(self._dir_owned, ignore_errors=True)


def _alive(thread: threading.Thread | None) -> bool:
    return thread is not None and thread.is_alive()
