"""What every socket channel does with a frame it received, whatever carried it: check its
MAC (``transport.auth``) and its encoding, count what it rejects, and pace a flood of
rejected frames (``RejectPacer``). ``ZmqChannel`` and ``UnixChannel`` share it
(``FrameChecks``), so a forged, replayed or malformed frame meets the same rules on both;
and who reads them (``ChannelReaders``: the event loop or the owner's own thread, one at a
time).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from typing import Self

from tokenrouter_ray.protocol import PeerReq
from tokenrouter_ray.transport.auth import FrameVerifier
from tokenrouter_ray.transport.base import ChannelClosed, decode_frame

logger = logging.getLogger(__name__)

YIELD_EVERY = 64  # frames received back to back before recv yields to the event loop
YIELD_S = 0.005  # or this long since it last yielded


class RejectPacer:
    """A token bucket over rejected frames: ``rate`` a second, a burst of ``rate / 4``.
    ``wait_s`` after each rejected frame: how long the receiver waits before reading the
    next one (0 within the budget). The clock is injected (tests drive it)."""

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.burst, self.clock = rate, max(1.0, rate / 4), clock
        self.tokens, self.at = self.burst, clock()
        self.paced = 0  # rejected frames that made the receiver wait

    def wait_s(self) -> float:
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate) - 1.0
        self.at = now
        if self.tokens >= 0:
            return 0.0
        self.paced += 1
        return -self.tokens / self.rate


class FrameChecks:
    """The receiving side's checks, for a channel class (a mixin: ``name`` is the
    channel's). ``_init_checks`` sets its state; ``_accept`` checks one frame."""

    name: str

    def _init_checks(
        self,
        key: bytes | None,
        reject_rate: float,
        on_reject: Callable[[str], None] | None,
    ) -> None:
        self._verifier = FrameVerifier(key, self.name) if key is not None else None
        self.rejected: collections.Counter[str] = collections.Counter()
        self._pacer = RejectPacer(reject_rate)
        self.on_reject = on_reject
        self._paused_until = 0.0  # the reject pacer's wait, for a reader of its own
        self._last_yield = time.monotonic()
        self._burst = 0  # frames received since recv last yielded
        self._last_good: float | None = None  # when a frame last verified
        self._bad_since: float | None = None  # first bad_mac after the last good frame
        self._last_bad: float | None = None

    def _accept(self, frame: bytes) -> tuple[list[PeerReq] | None, float]:
        """A received frame's messages once its MAC and encoding check out; else None and
        how long the receiver should pause (the reject pacer's budget)."""
        if self._verifier is not None:
            frame, reason = self._verifier.open(frame)  # type: ignore[assignment]
            if reason is not None:
                self._reject(reason)
                return None, self._pacer.wait_s()
        batch = decode_frame(frame, self.name)
        if batch is not None:
            self._last_good, self._bad_since = time.monotonic(), None
            return batch, 0.0
        self._reject("undecodable")
        return None, 0.0

    def _deliver(self, frame: bytes, on_batch: Callable[[list[PeerReq]], None]) -> bool:
        """Check ``frame`` and hand its messages to ``on_batch`` (one that raises is logged:
        reading goes on). False: it was rejected past the pacer's budget, and the reader
        leaves the socket alone for ``paused_s``."""
        batch, wait_s = self._accept(frame)
        if batch is not None:
            try:
                on_batch(batch)
            except Exception:  # one bad delivery must not stop receiving
                logger.exception("%s: delivering a frame failed", self.name)
        elif wait_s > 0:  # past the budget: a flood pays in time, not in our CPU
            self._paused_until = time.monotonic() + wait_s
            return False
        return True

    def paused_s(self) -> float:
        """How much longer the reject pacer keeps the reader off the socket (0: reading)."""
        if not self._paused_until:
            return 0.0
        left = self._paused_until - time.monotonic()
        if left <= 0:
            self._paused_until = 0.0
            return 0.0
        return left

    async def _maybe_yield(self) -> None:
        """Let the event loop run every ``YIELD_EVERY`` frames or ``YIELD_S`` seconds: a
        receive on a socket with queued frames completes without ever suspending."""
        self._burst += 1
        now = time.monotonic()
        if self._burst >= YIELD_EVERY or now - self._last_yield >= YIELD_S:
            await asyncio.sleep(0)
            self._burst, self._last_yield = 0, time.monotonic()

    def _reject(self, reason: str) -> None:
        n = self.rejected[reason] = self.rejected[reason] + 1
        if reason == "bad_mac":
            now = self._last_bad = time.monotonic()
            if self._bad_since is None:
                self._bad_since = now
        if n in (1, 10, 100, 1000):
            logger.warning("channel %s rejected %d frame(s): %s", self.name, n, reason)
        if self.on_reject is not None:
            self.on_reject(reason)

    def key_mismatch_s(self, recent_s: float = 5.0) -> float:
        """For how long every frame this channel received was ``bad_mac`` (0.0 when a frame
        verified since, or no bad frame came within ``recent_s``): its peers sign with
        another key, so nothing they send gets through."""
        if self._bad_since is None or self._last_bad is None:
            return 0.0
        now = time.monotonic()
        if now - self._last_bad > recent_s:
            return 0.0
        return now - self._bad_since


class ChannelReaders:
    """Who reads a socket channel, one way at a time (a mixin: ``name`` is the channel's):
    ``recv`` on the event loop, or the caller's own thread (``receive_inline``: a replica's
    step thread). The channel says whether its socket is open (``_readable``) and whether
    the event loop watches it (``_loop_watching``)."""

    name: str

    def _init_readers(self) -> None:
        self._waiter: asyncio.Future[None] | None = None  # the ``recv`` waiting, if any
        self._inline = False  # ``receive_inline``: the caller's thread reads

    def _readable(self) -> bool:
        raise NotImplementedError

    def _loop_watching(self) -> bool:
        raise NotImplementedError

    def receive_inline(self) -> Self | None:
        """From now on the caller's own thread reads the channel (``fileno``, ``paused_s``,
        ``read``): no receiver thread, so a frame costs no thread wake-up, hand-off or
        contention for the interpreter lock. None: not here (the channel is not open, or
        ``recv`` is in use)."""
        if not self._readable() or self._loop_watching():
            return None
        self._inline = True
        return self

    def _may_recv(self) -> None:
        """Raise unless ``recv`` may read now: the channel is open, no other reader is in
        use, and no other ``recv`` waits."""
        if not self._readable():
            raise ChannelClosed(f"channel {self.name!r} is closed")
        if self._inline:
            raise RuntimeError(f"channel {self.name!r} receives on another thread")
        if self._waiter is not None:
            raise RuntimeError(f"channel {self.name!r}: one recv at a time")

    async def _signalled(self) -> None:
        """Until the loop's reader callback calls ``_wake_recv``."""
        if not self._readable():
            raise ChannelClosed(f"channel {self.name!r} is closed")
        waiter = self._waiter = asyncio.get_running_loop().create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    def _wake_recv(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
