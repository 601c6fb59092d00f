"""A short, bounded admission queue in front of the ingress's slots (``max_active``).

When every slot is taken, a request does not fail at once with 503: it waits, first come
first served, up to ``max_wait_s`` for a slot, and only ``max_waiting`` requests may wait at
a time. Past either bound it is refused with 429 and ``Retry-After`` (the OpenAI envelope),
so a burst slightly above capacity is absorbed and a flood is refused cheaply (no body read
yet, nothing parsed).

Data enters as ``async with queue.admit(has_room):`` around everything a request does
before its submission (leave the block right before submitting, with no await in between:
the core counts the request before anything suspends). ``has_room(reserved)`` says whether
a slot is free now, given the ``reserved`` requests admitted by the queue that have not
submitted yet (they read, parse and tokenize before ``IngressCore`` counts them). It leaves
as the entered block, or as ``QueueFullError``. Slots are counted by the caller
(``IngressCore.num_active``); the queue only polls ``has_room`` (every ``poll_s`` while
someone waits), so it needs no hook in the core. Wiring (ingress/openai_server.py
``IngressServer.has_room``): ``num_active + reserved < max_active``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from tokenrouter_ray.openai.errors import OpenAIError


class QueueFullError(OpenAIError):
    """429: every slot is taken and the admission queue is full (or the wait ran out)."""

    status_code = 429
    error_type = "rate_limit_error"
    default_code = "rate_limit_exceeded"

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message, headers={"Retry-After": str(max(1, math.ceil(retry_after_s)))})


@dataclass
class AdmissionStats:
    admitted_at_once: int = 0
    admitted_after_wait: int = 0
    refused_full: int = 0
    refused_timeout: int = 0


class AdmissionQueue:
    """FIFO waiters for a slot: at most ``max_waiting`` at once, each at most ``max_wait_s``."""

    def __init__(
        self, max_waiting: int = 64, max_wait_s: float = 2.0, poll_s: float = 0.005
    ) -> None:
        if max_waiting < 0 or max_wait_s < 0 or poll_s <= 0:
            raise ValueError("max_waiting and max_wait_s must be >= 0, poll_s > 0")
        self.max_waiting = max_waiting
        self.max_wait_s = max_wait_s
        self.poll_s = poll_s
        self.stats = AdmissionStats()
        self.reserved = 0  # admitted here, not yet out of the `admit` block
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._pump: asyncio.Task | None = None
        self._has_room: Callable[[int], bool] | None = None

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @contextlib.asynccontextmanager
    async def admit(self, has_room: Callable[[int], bool]) -> AsyncIterator[None]:
        """Enter when the caller may take a slot (held until the block exits); raise
        ``QueueFullError`` (429 with Retry-After) when the queue is full or the wait ran out."""
        if not await self._wait(has_room):
            self.reserved += 1  # admitted at once (the pump reserves for those it wakes)
        try:
            yield
        finally:
            self.reserved -= 1

    async def _wait(self, has_room: Callable[[int], bool]) -> bool:
        """False: admitted at once; True: woken by the pump, which reserved its slot."""
        if not self._waiters and has_room(self.reserved):
            self.stats.admitted_at_once += 1
            return False
        if len(self._waiters) >= self.max_waiting:
            self.stats.refused_full += 1
            raise QueueFullError(
                f"Too many requests in flight and {self.max_waiting} already waiting; "
                "retry shortly.",
                retry_after_s=self.max_wait_s,
            )
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self._has_room = has_room
        if self._pump is None or self._pump.done():
            self._pump = asyncio.create_task(self._run(), name="admission-queue")
        try:
            await asyncio.wait_for(asyncio.shield(waiter), self.max_wait_s)
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.reserved -= 1  # woken, but its caller went away
            raise
        except TimeoutError:
            if waiter.done() and not waiter.cancelled():  # woken as the wait ran out
                self.stats.admitted_after_wait += 1
                return True
            self.stats.refused_timeout += 1
            raise QueueFullError(
                f"No slot became free within {self.max_wait_s:g} s; retry shortly.",
                retry_after_s=self.max_wait_s,
            ) from None
        finally:
            if not waiter.done():
                waiter.cancel()
            with contextlib.suppress(ValueError):
                self._waiters.remove(waiter)
        self.stats.admitted_after_wait += 1
        return True

    async def _run(self) -> None:
        """Hand free slots to the waiters in arrival order."""
        while self._waiters:
            head = self._waiters[0]
            if head.done():  # its caller gave up
                self._waiters.popleft()
                continue
            if self._has_room is not None and self._has_room(self.reserved):
                self._waiters.popleft()
                head.set_result(None)
                self.reserved += 1  # its slot, released when its `admit` block exits
                continue
            await asyncio.sleep(self.poll_s)

    async def close(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pump
        for waiter in self._waiters:
            waiter.cancel()
        self._waiters.clear()
