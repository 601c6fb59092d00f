"""Where one replica's host time goes: ``HostProfile``, summed per step phase.

The step thread (``replica/step.py``) times its phases with ``with profile.phase("route"):``
and adds the critical path, the device wait and the launch-to-launch period; the mailbox's
sender adds ``send`` and the frame counts, its receiver the message latencies. Read by the
status route (``replica/status.py`` ``HostSteps``) and by ``loadtest``. One writer per
field (the step thread, or the event loop for ``send`` and the receive counts): no lock.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType

# upper edges (µs) of the buckets of ``HostProfile.applied_hist``; the last bucket is open
LATENCY_EDGES_US = (
    20, 50, 100, 150, 200, 300, 400, 500, 700, 1_000, 1_500, 2_000, 3_000, 5_000, 7_000,
    10_000, 20_000, 50_000, 100_000, 1_000_000,
)  # fmt: skip


def latency_quantile_us(hist: Sequence[int], q: float) -> float | None:
    """The ``q`` quantile (µs) of an ``applied_hist`` (or the difference of two), linear
    within its bucket; None when it counts nothing. The open last bucket reads as its
    lower edge."""
    total = sum(hist)
    if total <= 0:
        return None
    rank, seen = q * total, 0
    for k, count in enumerate(hist):
        if count > 0 and seen + count >= rank:
            lo = LATENCY_EDGES_US[k - 1] if k else 0
            if k == len(LATENCY_EDGES_US):
                return float(lo)
            return lo + (LATENCY_EDGES_US[k] - lo) * (rank - seen) / count
        seen += count
    return float(LATENCY_EDGES_US[-1])


class _Phase:
    """A reusable timer for one phase name: ``with profile.phase(name):`` adds its seconds."""

    __slots__ = ("name", "phases", "started")

    def __init__(self, phases: dict[str, float], name: str) -> None:
        self.phases, self.name, self.started = phases, name, 0.0

    def __enter__(self) -> None:
        self.started = time.perf_counter()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        phases = self.phases
        phases[self.name] = phases.get(self.name, 0.0) + time.perf_counter() - self.started


@dataclass
class HostProfile:
    """Host seconds per phase over ``steps`` steps: on the critical path ``route``,
    ``commit``, ``receive`` and ``launch`` (the drafted step checked and the rest scheduled,
    ``schedule``, then the runner's preparation and start); overlapped ``report``
    (messages, statistics, metrics), ``send`` (the event loop's encoding and sending),
    ``receive_ahead`` (messages applied while the step runs) and ``draft`` (the next step
    scheduled while it runs). ``critical_s`` is the time from a forward's end (collect
    returned) to the next launch returned, summed: the part of the step period the host
    adds; ``wait_s``, the time the host waited for the device."""

    steps: int = 0
    rows: int = 0  # sampled rows, summed over steps
    phases: dict[str, float] = field(default_factory=dict)
    critical_s: float = 0.0
    wait_s: float = 0.0
    period_s: float = 0.0  # launch to launch, summed over back-to-back steps
    periods: int = 0  # back-to-back steps (launched right after the previous one's commit)
    frames: int = 0  # frames handed to the channel
    messages: int = 0
    # messages from peers and ingresses: built -> received (event loop) -> applied (the step
    # thread), summed over every message (a wall clock across processes: same host only)
    received: int = 0
    received_after_s: float = 0.0
    applied: int = 0
    applied_after_s: float = 0.0
    # messages applied, by latency bucket (``LATENCY_EDGES_US``): for the median
    applied_hist: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_EDGES_US) + 1))
    _timers: dict[str, _Phase] = field(default_factory=dict, repr=False, compare=False)

    def phase(self, name: str) -> _Phase:
        """A context manager adding the seconds it encloses to ``phases[name]``."""
        timer = self._timers.get(name)
        if timer is None:
            timer = self._timers[name] = _Phase(self.phases, name)
        return timer

    def add(self, phase: str, seconds: float) -> None:
        self.phases[phase] = self.phases.get(phase, 0.0) + seconds

    def per_step_us(self) -> dict[str, float]:
        """Mean microseconds per step of each phase, and of the critical path."""
        n = max(1, self.steps)
        out = {k: v / n * 1e6 for k, v in sorted(self.phases.items())}
        out["critical"] = self.critical_s / n * 1e6
        out["wait"] = self.wait_s / n * 1e6
        out["period"] = self.period_s / max(1, self.periods) * 1e6
        return out

    def note_applied(self, seconds: float) -> None:
        """One message applied by the step thread, ``seconds`` after its sender built it."""
        self.applied += 1
        self.applied_after_s += seconds
        self.applied_hist[bisect.bisect_left(LATENCY_EDGES_US, seconds * 1e6)] += 1

    def message_latency_us(self) -> dict[str, float]:
        """Mean microseconds from a message's building at its sender to its receipt here
        and to its application by the step thread (what a handoff waits before it runs)."""
        return {
            "received": self.received_after_s / max(1, self.received) * 1e6,
            "applied": self.applied_after_s / max(1, self.applied) * 1e6,
        }
