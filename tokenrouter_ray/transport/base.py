"""The peer-channel interface, the endpoint directory, and pieces the channels share.

A `PeerChannel` is one replica's mailbox plus its way of reaching other mailboxes. Data
leaves through `send(dst, msgs)`: the messages become one frame (`protocol.encode_batch`)
for the endpoint named `dst`. Data enters through `recv()`: one call returns the batch of
one frame, in the order frames from one sender were sent. A receiver loop is

    async for batch in channel:       # ends when the channel is closed
        for msg in batch: ...

Endpoint names are `endpoint_name(model, replica)`; a `Directory` maps them to transport
addresses (ipc:// or tcp:// for ZeroMQ, inproc:// in one process, ray-actor: for Ray).
`InMemoryDirectory` serves one process; `ray_channel.RayDirectory` serves a Ray cluster.

Delivery is at-most-once and ordered per (sender, receiver) pair; the protocol's
`RequestLedger` makes duplicates and stale messages harmless, so no channel retries.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, Protocol

from tokenrouter_ray.protocol import PeerReq, ProtocolError, by_destination, decode_batch

logger = logging.getLogger(__name__)


class ChannelClosed(Exception):
    """The channel was closed: no more sends, and `recv` has nothing more to give."""


class UnknownPeerError(LookupError):
    """No endpoint is registered under the destination name."""


class PeerUnreachableError(ConnectionError):
    """The destination is registered but cannot take frames (its receiver is gone)."""


def endpoint_name(model: str, replica: str) -> str:
    """The name a replica's channel is registered and addressed under (``model/replica``;
    ``endpoint_model`` reads the model back: the one place names are built and split)."""
    return f"{model}/{replica}"


@functools.lru_cache(maxsize=1024)  # the ingress asks once per COMMIT; endpoints are few
def endpoint_model(name: str) -> str:
    """The model of an endpoint name (``endpoint_name``'s first part)."""
    return name.split("/", 1)[0]


@dataclass(frozen=True)
class Endpoint:
    """A registered mailbox: which model and replica own it and where frames go."""

    model: str
    replica: str
    address: str

    @property
    def name(self) -> str:
        return endpoint_name(self.model, self.replica)


class Directory(ABC):
    """Where endpoints are registered and looked up. Async so a remote one can back it."""

    @abstractmethod
    async def register(self, endpoint: Endpoint) -> None: ...

    @abstractmethod
    async def unregister(self, name: str) -> None: ...

    @abstractmethod
    async def get(self, name: str) -> Endpoint | None: ...

    @abstractmethod
    async def endpoints(self, model: str | None = None) -> list[Endpoint]:
        """All endpoints, or those of one model, sorted by name."""

    async def heartbeat(self, endpoint: Endpoint | None = None) -> list[Endpoint]:
        """Renew ``endpoint``'s lease (register it; None: nothing to renew) and return every
        endpoint, sorted by name: what a peer book does every half second, in one round
        trip where the directory is remote (two Serve handle calls a refresh would
        double each replica's CPU spent on it)."""
        if endpoint is not None:
            await self.register(endpoint)
        return await self.endpoints()

    async def lookup(self, name: str) -> Endpoint:
        endpoint = await self.get(name)
        if endpoint is None:
            known = ", ".join(e.name for e in await self.endpoints()) or "none"
            raise UnknownPeerError(f"no endpoint {name!r} in the directory (known: {known})")
        return endpoint


class InMemoryDirectory(Directory):
    """A directory for channels living in one process (tests, the local runtime), and the
    state behind the Serve and Ray directories.

    With ``ttl_s``, an endpoint is a lease: owners re-register (heartbeat) more often than
    ``ttl_s``, and one not refreshed for ``ttl_s`` seconds (its process died without
    unregistering) is dropped, so peers stop choosing it and notice it is gone. ``clock``
    (monotonic seconds) is what leases are timed by; tests drive their own.
    """

    def __init__(
        self, ttl_s: float | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self._endpoints: dict[str, Endpoint] = {}
        self._seen: dict[str, float] = {}
        self._last_call = clock()

    async def register(self, endpoint: Endpoint) -> None:
        self._endpoints[endpoint.name] = endpoint
        self._seen[endpoint.name] = self.clock()

    async def unregister(self, name: str) -> None:
        self._endpoints.pop(name, None)
        self._seen.pop(name, None)

    async def get(self, name: str) -> Endpoint | None:
        self._expire()
        return self._endpoints.get(name)

    async def endpoints(self, model: str | None = None) -> list[Endpoint]:
        self._expire()
        found = [e for e in self._endpoints.values() if model is None or e.model == model]
        return sorted(found, key=lambda e: e.name)

    def _expire(self) -> None:
        if self.ttl_s is None:
            return
        now = self.clock()
        if now - self._last_call > self.ttl_s / 2:  # this process stalled, not its callers:
            self._seen = dict.fromkeys(self._seen, now)  # heartbeats may be queued behind it
        self._last_call = now
        oldest = now - self.ttl_s
        for name in [n for n, seen in self._seen.items() if seen < oldest]:
            logger.warning("directory: %s missed heartbeats for %.1f s", name, self.ttl_s)
            del self._endpoints[name], self._seen[name]


class InlineSource(Protocol):
    """A channel read by its owner thread itself (``PeerChannel.receive_inline``)."""

    inline_thread: threading.Thread | None  # the reader (the channel's close waits for it)

    def fileno(self) -> int:
        """A descriptor that turns readable when a frame arrives at a channel that ``read``
        left drained (an edge: a ``read`` that was not drained leaves no signal)."""
        ...

    def paused_s(self) -> float:
        """How much longer the reader must leave the channel alone (0: not paused)."""
        ...

    def read(self, on_batch: Callable[[list[PeerReq]], None], limit: int = ...) -> tuple[int, bool]:
        """Read queued frames without waiting (at most ``limit``), each frame's messages to
        ``on_batch``: the number read, and whether the channel was left drained."""
        ...


class PeerChannel(ABC):
    """One replica's mailbox and its way to other mailboxes. Used from one event loop.

    Subclasses implement `_open` (bind, return the address to register), `_send_frame`,
    `recv` and `_shut`. The base class registers and unregisters the endpoint, resolves and
    caches destinations, and groups messages per destination.
    """

    def __init__(self, model: str, replica: str, directory: Directory) -> None:
        self.model = model
        self.replica = replica
        self.directory = directory
        self._address: str | None = None
        self._peers: dict[str, Endpoint] = {}
        self._closed = False
        self.frames_sent = 0  # frames handed to the transport (for the host-path benchmarks)
        self.bytes_sent = 0  # their encoded size, signature included

    @property
    def name(self) -> str:
        return endpoint_name(self.model, self.replica)

    @property
    def address(self) -> str:
        if self._address is None:
            raise RuntimeError(f"channel {self.name!r} is not started")
        return self._address

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(self.model, self.replica, self.address)

    @property
    def closed(self) -> bool:
        return self._closed

    async def start(self) -> None:
        """Bind the mailbox and register it in the directory."""
        if self._address is not None:
            raise RuntimeError(f"channel {self.name!r} is already started")
        self._address = await self._open()
        await self.directory.register(self.endpoint)

    async def send(self, dst: str, msgs: Sequence[PeerReq]) -> None:
        """Send `msgs` to the endpoint named `dst` as one frame. Returns once queued."""
        if self._closed:
            raise ChannelClosed(f"channel {self.name!r} is closed")
        if not msgs:
            return
        size = await self._send_frame(await self._resolve(dst), msgs)
        self.frames_sent += 1
        self.bytes_sent += size or 0

    def send_now(self, dst: str, msgs: Sequence[PeerReq]) -> bool:
        """Send ``msgs`` to ``dst`` as one frame from the calling thread, without the event
        loop, when that costs no wait: ``dst`` already resolved and connected, and its queue
        not full. False: nothing was sent (the caller sends through ``send``). Transports
        without such a path always say False."""
        return False

    def receive_inline(self) -> InlineSource | None:
        """Let the calling thread read the channel itself from now on (``InlineSource``: a
        replica's step thread, in its waits), instead of ``recv``. None: not supported (use
        ``recv``)."""
        return None

    async def send_grouped(self, msgs: Sequence[PeerReq]) -> None:
        """Send messages leaving in one step: one frame per distinct `msg.dst`."""
        for dst, group in by_destination(msgs).items():
            await self.send(dst, group)

    @abstractmethod
    async def recv(self) -> list[PeerReq]:
        """The next frame's messages. Raises `ChannelClosed` once the channel is closed.

        One receiver loop per channel: concurrent `recv` calls are not supported.
        """

    async def close(self) -> None:
        """Unregister, stop receiving, release sockets. Idempotent; never hangs."""
        if self._closed:
            return
        self._closed = True
        if self._address is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.directory.unregister(self.name), timeout=2.0)
        await self._shut()

    def forget_peer(self, dst: str) -> None:
        """Drop the cached address of `dst` (e.g. after its replica restarted)."""
        self._peers.pop(dst, None)

    async def _resolve(self, dst: str) -> Endpoint:
        endpoint = self._peers.get(dst)
        if endpoint is None:
            endpoint = await self.directory.lookup(dst)
            self._peers[dst] = endpoint
        return endpoint

    @abstractmethod
    async def _open(self) -> str: ...

    @abstractmethod
    async def _send_frame(self, dst: Endpoint, msgs: Sequence[PeerReq]) -> int | None:
        """Send one frame; its size in bytes (None: not known)."""

    @abstractmethod
    async def _shut(self) -> None: ...

    async def __aenter__(self) -> PeerChannel:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __aiter__(self) -> PeerChannel:
        return self

    async def __anext__(self) -> list[PeerReq]:
        try:
            return await self.recv()
        except ChannelClosed:
            raise StopAsyncIteration from None


_CLOSED: Final = object()


class FrameQueue:
    """Encoded frames waiting for `recv`, fed from any thread, read on the owner's loop.

    Used by channels whose frames arrive by a call (in-process, Ray) rather than a socket.
    """

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[bytes | object] = asyncio.Queue()
        self._error: BaseException | None = None

    def put(self, frame: bytes) -> None:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            self._queue.put_nowait(frame)
        else:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, frame)

    def close(self, error: BaseException | None = None) -> None:
        """Wake the reader; it raises ChannelClosed (chained to `error`, if any)."""
        self._error = error
        if self._loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            self._queue.put_nowait(_CLOSED)
        else:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, _CLOSED)

    async def get(self, owner: str) -> list[PeerReq]:
        while True:
            frame = await self._queue.get()
            if frame is _CLOSED:
                self._queue.put_nowait(_CLOSED)  # keep later calls failing too
                raise ChannelClosed(f"channel {owner!r} is closed") from self._error
            assert isinstance(frame, bytes)
            batch = decode_frame(frame, owner)
            if batch is not None:
                return batch


def decode_frame(frame: bytes | memoryview, owner: str) -> list[PeerReq] | None:
    """Decode one frame; a bad one is logged and dropped (None) so the loop survives it."""
    try:
        return decode_batch(frame)
    except ProtocolError as exc:
        logger.warning("channel %s dropped a frame: %s", owner, exc)
        return None


class InOrder:
    """Restores per-sender order for transports that may deliver calls out of order.

    Each sender numbers its frames 0, 1, 2, ... per receiver; `push` returns the frames that
    are now deliverable in order (possibly none, possibly several).
    """

    def __init__(self) -> None:
        self._next: dict[str, int] = {}
        self._early: dict[str, dict[int, bytes]] = {}

    def push(self, sender: str, n: int, frame: bytes) -> list[bytes]:
        expected = self._next.get(sender, 0)
        if n < expected:
            return []  # a duplicate
        if n > expected:
            self._early.setdefault(sender, {})[n] = frame
            return []
        ready = [frame]
        expected += 1
        early = self._early.get(sender)
        while early and expected in early:
            ready.append(early.pop(expected))
            expected += 1
        self._next[sender] = expected
        return ready
