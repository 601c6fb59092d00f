"""One replica's live routing and step-time statistics, the input of the threshold tuner.

Every sub-server keeps a ``WindowStats``: over a sliding window, every request leaving a step
on model i is a move i -> j (j = i when it stays) with the tokens it committed, and every
step adds (batch size, seconds) and the active-request count N it ran under. ``snapshot()``
is a plain dict (cheap to ship to the tuner: ``{"moves": {"a->b": [n, tokens]}, "steps":
{"b": [n, seconds]}, "active": {"N": [steps, rows]}}``); ``merge_snapshots`` adds several up
(the replicas of a model, or the buckets of one window) and ``step_means_ms`` reads the mean
step time per batch size from one. The tuner (``tuning/tuner.py``) turns merged snapshots
into a ``RoutingProfile``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any


class WindowStats:
    """One replica's routing and step-time statistics over the last ``window_s`` seconds.

    Recording is on the decode loop's hot path (one move per request per step), so counts
    are added into one-second buckets as they happen: a snapshot merges at most
    ``window_s`` small buckets instead of walking every event of the window.
    """

    BUCKET_S = 1.0

    def __init__(self, window_s: float = 60.0) -> None:
        self.window_s = window_s
        self._buckets: deque[tuple[float, dict[str, Any]]] = deque()  # (start, counts)

    def _bucket(self, now: float | None) -> dict[str, Any]:
        now = time.monotonic() if now is None else now
        start = now - now % self.BUCKET_S
        if not self._buckets or self._buckets[-1][0] != start:
            self._buckets.append((start, {"moves": {}, "steps": {}, "active": {}}))
        return self._buckets[-1][1]

    @staticmethod
    def _add(part: dict[str, list[float]], key: str, total: float) -> None:
        entry = part.get(key)
        if entry is None:
            part[key] = [1, total]
        else:
            entry[0] += 1
            entry[1] += total

    def record_move(self, src: str, dst: str, committed: int, now: float | None = None) -> None:
        self._add(self._bucket(now)["moves"], f"{src}->{dst}", committed)

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
            self._add(bucket["steps"], str(batch_size), seconds)
        if active is not None:  # N -> [steps, batch rows] run under it
            self._add(bucket["active"], str(active), batch_size)

    def snapshot(self, now: float | None = None) -> dict[str, Any]:
        now = time.monotonic() if now is None else now
        while self._buckets and self._buckets[0][0] + self.BUCKET_S <= now - self.window_s:
            self._buckets.popleft()
        return merge_snapshots([counts for _, counts in self._buckets])


def merge_snapshots(snapshots: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {"moves": {}, "steps": {}, "active": {}}
    for snap in snapshots:
        for part in ("moves", "steps", "active"):
            for key, (n, total) in snap.get(part, {}).items():
                entry = merged[part].setdefault(key, [0, 0])
                entry[0] += n
                entry[1] += total
    return merged


def step_means_ms(snapshot: Mapping[str, Any]) -> dict[int, float]:
    """Mean step time (ms) per batch size in a (merged) snapshot."""
    return {int(b): 1e3 * s / n for b, (n, s) in snapshot["steps"].items() if n}
