"""The global active-request count N a model replica runs its deferred launches under.

Every ingress publishes its own count of active requests (on each admission and completion,
and again every second while non-zero: ``ACTIVE_REFRESH_S`` in ``ingress/core.py``). A
model replica's ``ActiveCount`` keeps the latest count from each ingress and their sum is N:
within one message delay of the truth. An ingress silent for longer than ``silence_s`` while
its count was non-zero is gone (its replica died); ``forget_silent`` drops it, so its count
no longer holds launches back, and returns it so its requests can be ended.
"""

from __future__ import annotations

import time

INGRESS_SILENCE_S = 10.0  # an ingress count not refreshed for this long is dropped


class ActiveCount:
    """The latest active-request count of every ingress, and their sum."""

    def __init__(self, silence_s: float = INGRESS_SILENCE_S) -> None:
        self.silence_s = silence_s
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
        """Drop the ingresses whose non-zero count was not refreshed for ``silence_s``."""
        cutoff = (time.monotonic() if now is None else now) - self.silence_s
        silent = {src for src, (n, t) in self._counts.items() if n and t < cutoff}
        for src in silent:
            del self._counts[src]
        if silent:
            self.total = sum(c for c, _ in self._counts.values())
        return silent
