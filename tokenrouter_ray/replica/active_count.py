"""The global active-request count N a model replica runs its deferred launches under.

Every ingress publishes its own count of active requests (on each admission and completion,
and again every second while non-zero: ``ACTIVE_REFRESH_S`` in ``ingress/core.py``). A
model replica's ``ActiveCount`` keeps the latest count from each ingress and their sum is N:
within one message delay of the truth. An ingress silent for longer than ``silence_s`` while
its count was non-zero is gone (its replica died); ``forget_silent`` drops it, so its count
no longer holds launches back, and returns it so its requests can be ended.

Silence is counted in the replica's own running time. A replica that was itself away
(its process frozen or descheduled, its loop stalled: no check for ``absent_after_s``) has
heard nothing because it was not listening; the ingresses' refreshes are waiting in its
socket. So after such a gap nobody is dropped, and the gap is added to every ingress's
last-heard time. (Without this, a replica resuming after a stop longer than ``silence_s``
ended every request it held, with "its ingress is gone", before it read a single frame.)
"""

from __future__ import annotations

import time

INGRESS_SILENCE_S = 10.0  # an ingress count not refreshed for this long is dropped
ABSENT_AFTER_S = 3.0  # no check for this long (checks run every second): this replica was away


class ActiveCount:
    """The latest active-request count of every ingress, and their sum."""

    def __init__(
        self, silence_s: float = INGRESS_SILENCE_S, absent_after_s: float = ABSENT_AFTER_S
    ) -> None:
        self.silence_s = silence_s
        self.absent_after_s = absent_after_s
        self._checked: float | None = None  # monotonic time of the last forget_silent
        self._counts: dict[str, tuple[int, float]] = {}  # ingress -> (n, monotonic when)
        self.total = 0

    @property
    def known(self) -> bool:
        """Some ingress has spoken (before that, N is unknown and launches are not held)."""
        return bool(self._counts)

    def ingresses(self) -> list[str]:
        """The ingress endpoints heard from (and not yet dropped as silent)."""
        return list(self._counts)

    def update(self, ingress: str, n: int, now: float | None = None) -> None:
        self._counts[ingress] = (n, time.monotonic() if now is None else now)
        self.total = sum(c for c, _ in self._counts.values())

    def forget_silent(self, now: float | None = None) -> set[str]:
        """Drop the ingresses whose non-zero count was not refreshed for ``silence_s`` of
        this replica's running time (none after a gap of ``absent_after_s`` since the last
        check: that time was this replica's absence, and is added to their last-heard)."""
        now = time.monotonic() if now is None else now
        last, self._checked = self._checked, now
        if last is not None and now - last > self.absent_after_s:
            away = now - last
            self._counts = {src: (n, t + away) for src, (n, t) in self._counts.items()}
            return set()
        cutoff = now - self.silence_s
        silent = {src for src, (n, t) in self._counts.items() if n and t < cutoff}
        for src in silent:
            del self._counts[src]
        if silent:
            self.total = sum(c for c, _ in self._counts.values())
        return silent
