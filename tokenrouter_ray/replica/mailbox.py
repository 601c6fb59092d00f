"""The event loop's side of one model replica: ``Mailbox``, between the peer channel and the
step thread.

It owns the two event-loop tasks, and the three queues that cross to the step thread:
- the receive side drains the channel into ``inbox`` (NEW / HANDOFF / FINISHED / ABORT /
  ACTIVE from the ingress and from peers) and wakes the step thread, which applies it
  between steps (``replica/step.py``): over the socket transports the step thread reads
  its socket itself (``replica/waker.py``: ``_received`` runs on the step thread), else a
  receive task on the event loop; ``deliver`` does the same for messages from anywhere
  else;
- ``post`` (from the step thread) sends messages, one frame per destination: on the step
  thread itself when nothing it posted earlier is still waiting for the event loop and the
  destination is connected and can take the frame (``PeerChannel.send_now``; no wake-up,
  queue or task per frame), otherwise through the send task, which sends them in order;
  posts made before the event loop runs again share one wake-up of it. A destination that
  cannot take its frame is reported back to the step thread (``on_undelivered``, through
  the call queue): the requests it concerned end there;
- the call queue (``call``, from the event loop) runs a function on the step thread between
  two steps and hands its result back: the tuner's thresholds, status and info reads. So
  only the step thread ever touches the engine and the per-request state.

Nothing here touches the engine. Neither task dies on one batch: a failed receive or send
is logged, counted in ``tokenrouter_errors_total{type}`` and the task goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import TypeVar

from tokenrouter_ray.metrics import Metrics
from tokenrouter_ray.protocol import MsgKind, PeerReq, by_destination
from tokenrouter_ray.replica.profile import HostProfile
from tokenrouter_ray.transport.base import ChannelClosed, PeerChannel

logger = logging.getLogger(__name__)

T = TypeVar("T")
# what the step thread runs between steps; messages it produces go into the list
Call = Callable[[list[PeerReq]], None]
Undelivered = list[tuple[PeerReq, str]]  # (message, why it could not be sent)


class Mailbox:
    def __init__(
        self,
        name: str,
        channel: PeerChannel,
        metrics: Metrics,
        profile: HostProfile,
        wake: Callable[[], None],
        on_undelivered: Callable[[Undelivered, list[PeerReq]], None],
    ) -> None:
        self.name = name
        self.channel = channel
        self.metrics = metrics
        self.profile = profile
        self.wake = wake  # the step thread's wake-up
        self.on_undelivered = on_undelivered  # on the step thread: end what could not go
        self.inbox: deque[PeerReq] = deque()  # for the step thread
        self.calls: deque[Call] = deque()  # for the step thread, between steps
        self._outbox: asyncio.Queue[tuple[list[PeerReq], bool]] | None = None
        self._posted: deque[tuple[list[PeerReq], bool]] = deque()  # for the event loop
        self._post_due = False  # the event loop is due to take ``_posted``
        # posts handed to the event loop, and those it has finished sending: each written by
        # one thread only. While they differ, the step thread sends nothing itself (order)
        self._handed = 0
        self._finished = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task] = []
        self._closing = False

    async def start(self, receive: bool = True) -> None:
        """The send task, and the receive side (``receive``: False where the step thread
        reads the channel itself, ``replica/waker.py``)."""
        self._loop = asyncio.get_running_loop()
        self._outbox = asyncio.Queue()
        self._tasks = [asyncio.create_task(self._sender(), name=f"{self.name}-send")]
        if receive:
            self._tasks.append(asyncio.create_task(self._receive_loop(), name=f"{self.name}-recv"))

    async def stop(self) -> None:
        self._closing = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, ChannelClosed):
                await task

    @property
    def running(self) -> bool:
        """The tasks started and none stopped."""
        return bool(self._tasks) and not any(t.done() for t in self._tasks)

    def dead_tasks(self) -> list[str]:
        """Names of stopped tasks, with why (for health-check messages)."""
        return [
            f"{t.get_name()}: {'cancelled' if t.cancelled() else t.exception()!r}"
            for t in self._tasks
            if t.done()
        ]

    @property
    def sending(self) -> bool:
        """Messages posted and not yet sent."""
        return bool(self._posted) or (self._outbox is not None and not self._outbox.empty())

    # ------------------------------------------------------------ to the step thread
    def deliver(self, msgs: list[PeerReq]) -> None:
        """Queue messages for the step thread (from any thread)."""
        self.inbox.extend(msgs)
        self.wake()

    async def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the step thread between two steps and return its result (or raise
        its exception), from the event loop."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[T] = loop.create_future()

        def settle(result: T | None, error: BaseException | None) -> None:
            if done.done():  # the caller gave up
                return
            if error is not None:
                done.set_exception(error)
            else:
                done.set_result(result)  # type: ignore[arg-type]

        def run(out: list[PeerReq]) -> None:
            try:
                result, error = fn(), None
            except Exception as exc:
                result, error = None, exc
            with contextlib.suppress(RuntimeError):  # the event loop closed: shutting down
                loop.call_soon_threadsafe(settle, result, error)

        self.calls.append(run)
        self.wake()
        return await done

    # ---------------------------------------------------------- from the step thread
    def post(self, out: list[PeerReq], notify: bool = True) -> None:
        """Hand messages to the send task (from the step thread). ``notify``: a frame that
        cannot be sent is reported back (``on_undelivered``)."""
        if not out or self._loop is None or self._outbox is None:
            return
        if self._handed == self._finished:  # nothing earlier still queued: send from here
            out = self._send_here(out)
            if not out:
                return
        self._handed += 1
        self._posted.append((out, notify))
        if not self._post_due:
            self._post_due = True
            with contextlib.suppress(RuntimeError):  # the event loop closed: shutting down
                self._loop.call_soon_threadsafe(self._take_posted)

    def _send_here(self, out: list[PeerReq]) -> list[PeerReq]:
        """Send what can go from this thread, one frame per destination; what cannot (a
        destination not connected yet, or full), and every destination after it, is left
        for the send task, in order."""
        groups = list(by_destination(out).items())
        profile = self.profile
        for k, (dst, msgs) in enumerate(groups):
            if not self.channel.send_now(dst, msgs):
                return [msg for _, rest in groups[k:] for msg in rest]
            profile.frames += 1
            profile.messages += len(msgs)
        return []

    def _take_posted(self) -> None:
        """On the event loop: move what the step thread posted to the sender's queue."""
        assert self._outbox is not None
        self._post_due = False
        while self._posted:
            self._outbox.put_nowait(self._posted.popleft())

    # ------------------------------------------------------------------ the tasks
    async def _receive_loop(self) -> None:
        while not self._closing:
            try:
                batch = await self.channel.recv()
            except ChannelClosed:
                return
            except Exception:  # one bad receive must not stop the model
                logger.exception("%s: receive failed", self.name)
                self.metrics.error(self.name, "recv_failed")
                await asyncio.sleep(0.05)
                continue
            self._received(batch)

    def _received(self, batch: list[PeerReq]) -> None:
        """One received frame (on the step thread or the event loop): counted, then handed
        to the step thread."""
        now = time.time_ns()
        profile = self.profile
        if batch:  # the frame's latency: its oldest message's
            self.metrics.peer_message(self.name, min(msg.sent_at for msg in batch))
        for msg in batch:
            if msg.kind != MsgKind.ACTIVE:  # counted as applied messages are
                profile.received += 1
                profile.received_after_s += max(0, now - msg.sent_at) / 1e9
        self.deliver(batch)

    async def _sender(self) -> None:
        """Send what the step thread posts, in order (one frame per destination)."""
        assert self._outbox is not None
        while True:
            out, notify = await self._outbox.get()
            t0 = time.perf_counter()
            try:
                await self._send(out, notify)
            except ChannelClosed:
                return
            except Exception:  # never stop sending over one batch
                logger.exception("%s: send failed", self.name)
                self.metrics.error(self.name, "send_failed")
            finally:
                self._finished += 1
            self.profile.add("send", time.perf_counter() - t0)

    async def _send(self, out: list[PeerReq], notify: bool = True) -> None:
        """One frame per destination. The messages of a destination that cannot take its
        frame (unknown, unreachable) go back to the step thread (``on_undelivered``) when
        ``notify``."""
        undelivered: Undelivered = []
        profile = self.profile
        for dst, msgs in by_destination(out).items():
            try:
                await self.channel.send(dst, msgs)
                profile.frames += 1
                profile.messages += len(msgs)
            except ChannelClosed:
                raise
            except Exception as exc:
                logger.warning("%s: send to %s failed: %s", self.name, dst, exc)
                self.metrics.error(self.name, "send_failed")
                self.channel.forget_peer(dst)
                undelivered += [(msg, f"peer {dst} unreachable: {exc}") for msg in msgs]
        if undelivered and notify:

            def fail(out: list[PeerReq]) -> None:
                mine: list[PeerReq] = []
                self.on_undelivered(undelivered, mine)
                self.post(mine, notify=False)

            self.calls.append(fail)
            self.wake()
