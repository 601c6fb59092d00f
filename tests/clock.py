"""A fake clock for tests that inject one: seconds move only when the test says so."""

from __future__ import annotations


class FakeClock:
    """Call it for the time (each read counted in ``reads``); ``sleep`` advances it (by
    ``oversleep_s`` more than asked, as a busy machine's timer does) and records the
    request in ``slept``; nothing ever waits. Set ``now`` to jump."""

    def __init__(self, start: float = 0.0, oversleep_s: float = 0.0) -> None:
        self.now = start
        self.oversleep_s = oversleep_s
        self.reads = 0
        self.slept: list[float] = []

    def __call__(self) -> float:
        self.reads += 1
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds + self.oversleep_s
