"""Python's garbage collector in a long-running serving process (the ingress, each model
replica): what it costs and how it is set (`GcSpec`, config ``gc``).

A replica's heap after start-up is mostly long-lived (torch, transformers, Ray, the model's
modules: about half a million objects), and the step loop allocates a few containers per
row and message. At Python's default thresholds (700, 10, 10) that means a young collection
every few milliseconds and, every few seconds, a full collection that walks the whole heap
and stops the step thread for hundreds of milliseconds (docs/design/architecture.md gives
the measured cost). So, once a process has started:

- ``gc.freeze()`` moves everything alive to a permanent generation that collections skip
  (what start-up built is not garbage);
- the young generation's threshold is raised (default 20,000 allocations), so collections
  are rarer and each finds most of what it would collect anyway (reference cycles are
  rare on the per-token path: messages and rows are freed by reference counting).

`collector_stats()` reports what the collector did since the
setting was applied (collections and seconds per generation, the longest pause).
"""

from __future__ import annotations

import gc
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from tokenrouter_ray.config import GcSpec


@dataclass
class _Clock:
    """Collections and seconds per generation, timed by a ``gc.callbacks`` hook."""

    collections: list[int] = field(default_factory=lambda: [0, 0, 0])
    seconds: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    longest_s: float = 0.0
    _started: float = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        took = time.perf_counter() - self._started
        generation = info.get("generation", 2)
        self.collections[generation] += 1
        self.seconds[generation] += took
        self.longest_s = max(self.longest_s, took)


_LOCK = threading.Lock()
_CLOCK: _Clock | None = None
_APPLIED: dict[str, Any] = {}


def tune_gc(spec: GcSpec) -> dict[str, Any]:
    """Apply ``spec`` to this process (once its start-up is done) and time collections from
    now on. Returns what was applied."""
    global _CLOCK
    with _LOCK:
        if spec.threshold is not None:
            gc.set_threshold(*spec.threshold)
        frozen = 0
        if spec.freeze_after_start:
            gc.collect()  # what start-up left as garbage goes first, then the rest is frozen
            gc.freeze()
            frozen = gc.get_freeze_count()
        if _CLOCK is None:
            _CLOCK = _Clock()
            gc.callbacks.append(_CLOCK)
        _APPLIED.update(threshold=list(gc.get_threshold()), frozen_objects=frozen)
        return dict(_APPLIED)


def collector_stats() -> dict[str, Any]:
    """What the collector did in this process since `tune_gc` (empty before it ran)."""
    clock = _CLOCK
    if clock is None:
        return {}
    return {
        **_APPLIED,
        "collections": list(clock.collections),
        "seconds": [round(s, 6) for s in clock.seconds],
        "longest_pause_s": round(clock.longest_s, 6),
    }
