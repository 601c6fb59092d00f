"""One replica's live routing and step-time statistics, the input of the threshold tuner.

Every model replica keeps a ``WindowStats``: over a sliding window, every request leaving a step
on model i is a move i -> j (j = i when it stays) with the tokens it committed, and every
step adds (batch size, seconds) and the active-request count N it ran under, and every
HANDOFF applied here from another model adds its transit (seconds from its building at the
sender to its application here: what the request spent between the models). ``snapshot()``
is a ``WindowSnapshot``, a typed struct that crosses Ray as it is (pickled; msgpack would do
too): ``moves`` and ``transit`` keyed by the model pair ``(src, dst)``, ``steps`` by batch
size, ``active`` by N, each a ``Tally`` (how many, and their total).
``WindowSnapshot.merge`` adds several up (the replicas of a model, or the buckets of one
window), ``step_means_ms`` reads the mean step time per batch size and ``transit_ms`` the
mean transit per pair. The tuner (``tuning/tuner.py``) turns merged snapshots into a
``RoutingProfile``; ``to_json`` is the readable form a status route shows.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from typing import Any

import msgspec

Pair = tuple[str, str]  # (source model, destination model) of a move


class Tally(msgspec.Struct, array_like=True):
    """How many events, and the sum of their quantity (tokens, seconds or rows)."""

    count: int = 0
    total: float = 0.0

    def add(self, count: int, total: float) -> None:
        self.count += count
        self.total += total


class WindowSnapshot(msgspec.Struct):
    """A window's counts: moves (requests, committed tokens) per model pair, steps (steps,
    seconds) per batch size, (steps, batch rows) per active-request count N, and transit
    (handoffs, seconds between the models) per model pair, recorded by the receiver; the
    offered load: requests that arrived here new (requests, prompt tokens) and requests that
    finished here (requests, output tokens); ``span_s``, the seconds the counts cover."""

    moves: dict[Pair, Tally] = msgspec.field(default_factory=dict)
    steps: dict[int, Tally] = msgspec.field(default_factory=dict)
    active: dict[int, Tally] = msgspec.field(default_factory=dict)
    arrivals: Tally = msgspec.field(default_factory=Tally)
    finished: Tally = msgspec.field(default_factory=Tally)
    span_s: float = 0.0
    transit: dict[Pair, Tally] = msgspec.field(default_factory=dict)

    @classmethod
    def merge(cls, snapshots: Iterable[WindowSnapshot]) -> WindowSnapshot:
        """The counts added up; the span is the longest (replicas report the same window;
        a replica's buckets lie inside its own window)."""
        merged = cls()
        for snap in snapshots:
            for mine, theirs in (
                (merged.moves, snap.moves),
                (merged.steps, snap.steps),
                (merged.active, snap.active),
                (merged.transit, snap.transit),
            ):
                for key, tally in theirs.items():
                    mine.setdefault(key, Tally()).add(tally.count, tally.total)
            merged.arrivals.add(snap.arrivals.count, snap.arrivals.total)
            merged.finished.add(snap.finished.count, snap.finished.total)
            merged.span_s = max(merged.span_s, snap.span_s)
        return merged

    def rows_per_step(self) -> float:
        """Mean rows per step (decode steps: those in ``steps``); 0 without a step."""
        count = sum(t.count for t in self.steps.values())
        return sum(b * t.count for b, t in self.steps.items()) / count if count else 0.0

    def step_means_ms(self) -> dict[int, float]:
        """Mean step time (ms) per batch size."""
        return {b: 1e3 * t.total / t.count for b, t in self.steps.items() if t.count}

    def transit_ms(self) -> dict[Pair, float]:
        """Mean transit (ms) per model pair, for the pairs some handoff was applied on."""
        return {pair: 1e3 * t.total / t.count for pair, t in self.transit.items() if t.count}

    def moves_from(self, src: str, models: Iterable[str]) -> list[Tally]:
        """The moves out of ``src`` to each of ``models``, in order (zero where none)."""
        return [self.moves.get((src, dst), Tally()) for dst in models]

    def to_json(self) -> dict[str, Any]:
        """The readable form for status routes: ``{"moves": {"a->b": [n, tokens]}, "steps":
        {"b": [n, seconds]}, "active": {"N": [steps, rows]}, "transit": {"a->b": [n,
        seconds]}}``."""
        return {
            "moves": {f"{a}->{b}": [t.count, t.total] for (a, b), t in self.moves.items()},
            "steps": {str(b): [t.count, t.total] for b, t in self.steps.items()},
            "active": {str(n): [t.count, t.total] for n, t in self.active.items()},
            "transit": {f"{a}->{b}": [t.count, t.total] for (a, b), t in self.transit.items()},
        }


class WindowStats:
    """One replica's routing and step-time statistics over the last ``window_s`` seconds.

    Recording is on the decode loop's hot path (one move per request per step), so counts
    are added into one-second buckets as they happen: a snapshot merges at most
    ``window_s`` small buckets instead of walking every event of the window.
    """

    BUCKET_S = 1.0

    def __init__(self, window_s: float = 60.0) -> None:
        self.window_s = window_s
        self._buckets: deque[tuple[float, WindowSnapshot]] = deque()  # (start, counts)

    def _bucket(self, now: float | None) -> WindowSnapshot:
        now = time.monotonic() if now is None else now
        start = now - now % self.BUCKET_S
        if not self._buckets or self._buckets[-1][0] != start:
            self._buckets.append((start, WindowSnapshot()))
        return self._buckets[-1][1]

    def record_move(
        self, src: str, dst: str, committed: int, now: float | None = None, rows: int = 1
    ) -> None:
        """``rows`` requests moved from ``src`` to ``dst`` (``dst == src``: stayed), with
        ``committed`` tokens kept between them (a dropped token is not)."""
        moves = self._bucket(now).moves
        tally = moves.get((src, dst))
        if tally is None:
            moves[(src, dst)] = Tally(rows, committed)
        else:
            tally.add(rows, committed)

    def record_step(
        self,
        batch_size: int,
        seconds: float,
        now: float | None = None,
        active: int | None = None,
        num_tokens: int | None = None,
    ) -> None:
        """One step; ``active`` is the global active-request count N it ran under. A step
        that computed more than two tokens per request (prefill chunks) counts towards N
        but not towards the step-time table: the throughput model's steps are decodes and
        short extends, and a prefill's cost would read as a slow batch size."""
        bucket = self._bucket(now)
        if num_tokens is None or num_tokens <= 2 * batch_size:
            bucket.steps.setdefault(batch_size, Tally()).add(1, seconds)
        if active is not None:  # N -> (steps, batch rows) run under it
            bucket.active.setdefault(active, Tally()).add(1, batch_size)

    def record_arrival(self, prompt_tokens: int, now: float | None = None) -> None:
        """A request that entered the system here (a NEW, not a re-created one)."""
        self._bucket(now).arrivals.add(1, prompt_tokens)

    def record_finish(self, output_tokens: int, now: float | None = None) -> None:
        """A request that finished here (EOS, a stop, max_tokens) with its output length."""
        self._bucket(now).finished.add(1, output_tokens)

    def record_transit(self, src: str, dst: str, seconds: float, now: float | None = None) -> None:
        """A handoff from model ``src`` applied here (``dst``), ``seconds`` after its sender
        built it."""
        transit = self._bucket(now).transit
        tally = transit.get((src, dst))
        if tally is None:
            transit[(src, dst)] = Tally(1, seconds)
        else:
            tally.add(1, seconds)

    def snapshot(self, now: float | None = None) -> WindowSnapshot:
        now = time.monotonic() if now is None else now
        while self._buckets and self._buckets[0][0] + self.BUCKET_S <= now - self.window_s:
            self._buckets.popleft()
        merged = WindowSnapshot.merge(counts for _, counts in self._buckets)
        if self._buckets:  # from the oldest bucket's start, at most the window
            merged.span_s = min(self.window_s, now - self._buckets[0][0])
        return merged
