"""Ray-native peer channel and directory, for clusters where opening ports is unwanted.

Frames travel as Ray actor calls: `send` calls `deliver(sender, n, frame)` on the
destination's mailbox actor and does not wait for it. It keeps the last `max_in_flight`
calls per peer and awaits the oldest beyond that, which bounds memory and surfaces a dead
peer as `PeerUnreachableError` on a later send.
Ray runs async-actor calls out of order, so every sender numbers its frames per destination
and the mailbox restores the order (`InOrder`).
The calls are issued by one sender task the channel starts with itself, never by the task
that called `send`: Ray cancels the calls a cancelled actor task made (Serve cancels the
request's task when its client disconnects), and one cancelled delivery would leave a gap
the receiver waits on for ever (the ABORTs behind it never arrive).

A channel's mailbox is a small `PeerInbox` actor that `start()` creates pinned to this node
(it works inside Ray Serve replicas, which cannot take calls of their own); the channel
long-polls it with `take()`.

`RayDirectory` is the directory as a named Ray actor, shared by every process of the
cluster. Nothing here blocks the event loop: object refs are awaited, and the blocking
`ray.get_actor` lookup runs in a thread once per peer. Ray is imported only in this module.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import threading
import uuid
from collections.abc import Sequence
from typing import Any

import ray
from ray.exceptions import RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from tokenrouter_ray.protocol import PeerReq, encode_batch
from tokenrouter_ray.transport.base import (
    ChannelClosed,
    Directory,
    Endpoint,
    FrameQueue,
    InMemoryDirectory,
    InOrder,
    PeerChannel,
    PeerUnreachableError,
)

logger = logging.getLogger(__name__)

NAMESPACE = "tokenrouter"
_SCHEME = "ray-actor"


def actor_address(namespace: str, name: str, method: str) -> str:
    """The address of a named actor's delivery method: `ray-actor:<ns>:<method>:<name>`."""
    return f"{_SCHEME}:{namespace}:{method}:{name}"


def parse_actor_address(address: str) -> tuple[str, str, str]:
    """(namespace, name, method) of a `ray-actor:` address."""
    scheme, namespace, method, name = address.split(":", 3)
    if scheme != _SCHEME:
        raise ValueError(f"not a Ray actor address: {address!r}")
    return namespace, name, method


@ray.remote(num_cpus=0, max_concurrency=4)
class PeerInbox:
    """A replica's mailbox actor: frames in by `deliver`, out by `take`.

    A threaded actor (methods run in a small thread pool; a condition variable wakes the
    waiting `take`), not an async one: it gives lower one-way latency on this hop.
    """

    def __init__(self) -> None:
        self._order = InOrder()
        self._frames: collections.deque[bytes] = collections.deque()
        self._cv = threading.Condition()

    def ready(self) -> bool:
        return True

    def deliver(self, sender: str, n: int, frame: bytes) -> None:
        with self._cv:
            ready = self._order.push(sender, n, frame)
            if ready:
                self._frames.extend(ready)
                self._cv.notify_all()

    def take(self) -> list[bytes]:
        """Every frame waiting, in order; waits for at least one."""
        with self._cv:
            while not self._frames:
                self._cv.wait()
            frames = list(self._frames)
            self._frames.clear()
        return frames


class _Target:
    """A resolved destination: its delivery method, frame counter and calls in flight.
    Each resolution numbers its frames from 0 under its own sender id: a destination
    resolved again (after a failed delivery) must not restart a sequence the receiver has
    already seen, or it would drop the new frames as duplicates until the count caught up."""

    def __init__(self, method: Any, sender: str) -> None:
        self.method = method
        self.sender = sender
        self.next_n = 0
        self.in_flight: collections.deque[ray.ObjectRef] = collections.deque()


class RayChannel(PeerChannel):
    def __init__(
        self,
        model: str,
        replica: str,
        directory: Directory,
        max_in_flight: int = 64,
    ) -> None:
        super().__init__(model, replica, directory)
        self.max_in_flight = max_in_flight
        self._sender_id = f"{self.name}#{uuid.uuid4().hex[:12]}"
        self._resolutions = itertools.count()  # numbers each target's own sender id
        self._queue: FrameQueue | None = None
        self._inbox: Any = None  # the PeerInbox actor's handle
        self._pump: asyncio.Task[None] | None = None
        self._targets: dict[str, _Target] = {}
        self._resolving: dict[str, asyncio.Task[_Target]] = {}
        self._outbox: asyncio.Queue[tuple[_Target, int, bytes]] | None = None
        self._sender: asyncio.Task[None] | None = None

    async def _open(self) -> str:
        self._queue = FrameQueue()
        self._outbox = asyncio.Queue()
        self._sender = asyncio.create_task(self._send_loop(), name=f"{self.name}-sender")
        name = f"tokenrouter-inbox:{self.name}:{uuid.uuid4().hex[:8]}"
        here = ray.get_runtime_context().get_node_id()
        self._inbox = PeerInbox.options(
            name=name,
            namespace=NAMESPACE,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=here, soft=False),
        ).remote()
        await self._inbox.ready.remote()
        self._pump = asyncio.create_task(self._pump_inbox(), name=f"{name}-pump")
        return actor_address(NAMESPACE, name, "deliver")

    async def _pump_inbox(self) -> None:
        assert self._queue is not None
        try:
            while True:
                for frame in await self._inbox.take.remote():
                    self._queue.put(frame)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the inbox actor died
            logger.error("channel %s lost its inbox: %s", self.name, exc)
            self._queue.close(exc)

    async def _send_frame(self, dst: Endpoint, msgs: Sequence[PeerReq]) -> int:
        target = self._targets.get(dst.name) or await self._target(dst)
        n = target.next_n
        target.next_n += 1
        assert self._outbox is not None
        frame = encode_batch(msgs)
        self._outbox.put_nowait((target, n, frame))  # numbered now, in order
        while len(target.in_flight) > self.max_in_flight:
            ref = target.in_flight.popleft()
            try:  # almost always long done: the window only bounds memory. Shielded: a
                # cancelled sender (a client that left) must not cancel a delivery, or the
                # receiver waits forever for the missing frame number
                await asyncio.shield(asyncio.wrap_future(ref.future()))
            except RayError as exc:
                self._targets.pop(dst.name, None)
                self.forget_peer(dst.name)
                raise PeerUnreachableError(
                    f"peer {dst.name!r} did not take a frame: {exc}"
                ) from exc
        return len(frame)

    async def _send_loop(self) -> None:
        """Issue the delivery calls, in order, from this long-lived task (see the module
        docstring for why not from the caller)."""
        assert self._outbox is not None
        while True:
            target, n, frame = await self._outbox.get()
            try:
                target.in_flight.append(target.method.remote(target.sender, n, frame))
            except Exception as exc:  # e.g. the handle is gone: later sends will notice
                logger.warning("channel %s: delivery call failed: %s", self.name, exc)
            finally:
                self._outbox.task_done()

    async def _target(self, dst: Endpoint) -> _Target:
        task = self._resolving.get(dst.name)
        if task is None:
            task = asyncio.create_task(self._resolve_target(dst))
            self._resolving[dst.name] = task
            task.add_done_callback(lambda _: self._resolving.pop(dst.name, None))
        return await asyncio.shield(task)

    async def _resolve_target(self, dst: Endpoint) -> _Target:
        namespace, name, method = parse_actor_address(dst.address)
        try:
            handle = await asyncio.to_thread(ray.get_actor, name, namespace=namespace)
        except ValueError as exc:
            raise PeerUnreachableError(f"peer {dst.name!r}: no actor {name!r} ({exc})") from exc
        target = _Target(getattr(handle, method), f"{self._sender_id}.{next(self._resolutions)}")
        self._targets[dst.name] = target
        return target

    async def recv(self) -> list[PeerReq]:
        if self._queue is None:
            raise ChannelClosed(f"channel {self.name!r} is not started")
        return await self._queue.get(self.name)

    async def flush(self, timeout_s: float = 5.0) -> None:
        """Wait until every frame sent so far was taken by its mailbox."""
        if self._outbox is not None and self._sender is not None and not self._sender.done():
            await asyncio.wait_for(self._outbox.join(), timeout_s)
        refs = [ref for target in self._targets.values() for ref in target.in_flight]
        if refs:
            await asyncio.wait_for(asyncio.gather(*refs, return_exceptions=True), timeout_s)
        for target in self._targets.values():
            target.in_flight.clear()

    async def _shut(self) -> None:
        with contextlib.suppress(Exception):
            await self.flush(timeout_s=1.0)
        if self._sender is not None:
            self._sender.cancel()
            with contextlib.suppress(BaseException):
                await self._sender
        if self._pump is not None:
            self._pump.cancel()
            with contextlib.suppress(BaseException):
                await self._pump
        if self._inbox is not None:
            ray.kill(self._inbox, no_restart=True)
        if self._queue is not None:
            self._queue.close()


# The directory actor is the in-memory directory, hosted by Ray.
_DirectoryActor = ray.remote(num_cpus=0)(InMemoryDirectory)


class RayDirectory(Directory):
    """The endpoint directory as a named actor; picklable, so it can be passed to actors."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle

    @classmethod
    def get_or_create(
        cls, name: str = "tokenrouter-directory", namespace: str = NAMESPACE, detached: bool = False
    ) -> RayDirectory:
        """Connect to the named directory actor, creating it if needed.

        Blocking (a GCS round trip): call it outside an event loop, or through
        `asyncio.to_thread`. A non-detached directory dies with the process that created it.
        """
        handle = _DirectoryActor.options(
            name=name,
            namespace=namespace,
            get_if_exists=True,
            lifetime="detached" if detached else None,
        ).remote()
        return cls(handle)

    async def _call(self, method: str, *args: Any) -> Any:
        """One call of the directory actor's ``method`` (subclasses resolve the actor)."""
        return await getattr(self._handle, method).remote(*args)

    async def register(self, endpoint: Endpoint) -> None:
        await self._call("register", endpoint)

    async def unregister(self, name: str) -> None:
        await self._call("unregister", name)

    async def get(self, name: str) -> Endpoint | None:
        return await self._call("get", name)

    async def endpoints(self, model: str | None = None) -> list[Endpoint]:
        return await self._call("endpoints", model)

    async def heartbeat(self, endpoint: Endpoint | None = None) -> list[Endpoint]:
        return await self._call("heartbeat", endpoint)
