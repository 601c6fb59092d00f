"""Hold a live quality target (``tuner.quality_target``): which routing operating point the
requests that ask for no ``routing`` get.

The rungs are the configured presets, cheapest first (the lowest large-model share), and
the top model alone (bypass) above them. Every answer the live monitor scores
(``quality/live.py``) at a rung's operating point is one observation of that rung's
agreement with the top model: whether the whole answer is the one the top model would have
written (``metric: answer``) or the share of its positions that are (``position``).

The rule, judged on the current rung once it has ``min_samples`` scored answers (in a
window of the last ``window``), with one-sided bounds at ``confidence``:

- agreement's upper bound under the target: the rung fails; move one rung up (more of the
  top model), and do not try the failed rung again for ``retry_after`` scored answers;
- its lower bound at least ``target + margin``: move one rung down (cheaper), unless that
  rung failed within the last ``retry_after`` scored answers;
- otherwise stay and gather.

A rung entered is judged afresh (its window is cleared), so each move waits for
``min_samples`` new answers: the hysteresis in time; ``margin`` is the one in level.
Answer agreement uses Wilson's interval; position agreement the normal interval of the mean
of per-answer shares (positions within one answer are not independent)."""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenrouter_ray.quality.stats import wilson_interval

if TYPE_CHECKING:
    from tokenrouter_ray.quality.settings import QualityTargetSpec

HISTORY = 200  # moves the status route lists


@dataclass(frozen=True)
class Rung:
    """One operating point: a preset's thresholds, or the top model alone."""

    name: str
    thresholds: tuple[float, ...] = ()
    alone: str | None = None

    @property
    def point(self) -> str:
        """The live monitor's label for answers served here (``LiveQuality.point_of``)."""
        return f"alone:{self.alone}" if self.alone is not None else self.name


@dataclass(frozen=True)
class Judgement:
    """A rung's agreement over its window: the mean and its one-sided bounds."""

    answers: int
    mean: float | None
    low: float
    high: float


class QualityTarget:
    """The operating point requests without ``routing`` get, moved by live scores."""

    def __init__(
        self, spec: QualityTargetSpec, presets: Mapping[str, Sequence[float]], top: str
    ) -> None:
        self.spec = spec
        self.rungs = [Rung(name, tuple(float(x) for x in presets[name])) for name in spec.ladder]
        if spec.bypass:
            self.rungs.append(Rung("alone", (), top))
        names = [r.name for r in self.rungs]
        self.index = names.index(spec.start) if spec.start is not None else len(names) - 1
        self.z = statistics.NormalDist().inv_cdf(spec.confidence)
        self.windows: dict[str, deque[float]] = {
            r.point: deque(maxlen=spec.window) for r in self.rungs
        }
        self.scored = 0  # answers observed on any rung: the clock of ``retry_after``
        self.blocked: dict[int, int] = {}  # rung -> the ``scored`` count it may be tried at
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY)

    @property
    def current(self) -> Rung:
        return self.rungs[self.index]

    def routing(self) -> tuple[tuple[float, ...], str | None]:
        """(route thresholds, the model serving alone) for a request without ``routing``."""
        rung = self.current
        return rung.thresholds, rung.alone

    def observe(self, point: str, positions: int, agreeing: int) -> None:
        """One answer served at ``point``, scored: ``agreeing`` of its ``positions`` are the
        top model's greedy tokens. Only the rungs' points are counted."""
        window = self.windows.get(point)
        if window is None or positions <= 0:
            return
        if self.spec.metric == "answer":
            window.append(1.0 if agreeing == positions else 0.0)
        else:
            window.append(agreeing / positions)
        self.scored += 1
        if point == self.current.point:
            self._decide()

    def judge(self, index: int) -> Judgement:
        values = self.windows[self.rungs[index].point]
        n = len(values)
        if n == 0:
            return Judgement(0, None, 0.0, 1.0)
        mean = sum(values) / n
        if self.spec.metric == "answer":
            low, high = wilson_interval(round(sum(values)), n, self.z)
        else:
            sd = statistics.stdev(values) if n > 1 else 0.0
            half = self.z * sd / math.sqrt(n)
            low, high = max(0.0, mean - half), min(1.0, mean + half)
        return Judgement(n, mean, low, high)

    def _decide(self) -> None:
        spec, i = self.spec, self.index
        j = self.judge(i)
        if j.answers < spec.min_samples:
            return
        if j.high < spec.target and i + 1 < len(self.rungs):
            self.blocked[i] = self.scored + spec.retry_after
            self._move(i + 1, "agreement under the target", j)
        elif (
            j.low >= spec.target + spec.margin
            and i > 0
            and self.blocked.get(i - 1, 0) <= self.scored
        ):
            self._move(i - 1, "agreement above the target and margin", j)

    def _move(self, to: int, reason: str, j: Judgement) -> None:
        self.history.append({
            "at": time.time(), "from": self.current.name, "to": self.rungs[to].name,
            "reason": reason, "answers": j.answers, "agreement": j.mean,
            "bounds": [j.low, j.high],
        })  # fmt: skip
        self.index = to
        self.windows[self.current.point].clear()  # judged afresh

    def status(self) -> dict[str, Any]:
        """The ``target`` part of ``GET /v1/tokenrouter/quality``."""
        spec = self.spec
        rungs = []
        for k, rung in enumerate(self.rungs):
            j = self.judge(k)
            rungs.append({
                "name": rung.name, "point": rung.point, "thresholds": list(rung.thresholds),
                "answers": j.answers, "agreement": j.mean, "bounds": [j.low, j.high],
                "retry_at": self.blocked.get(k),
            })  # fmt: skip
        return {
            "target": spec.target,
            "metric": spec.metric,
            "confidence": spec.confidence,
            "margin": spec.margin,
            "rung": self.current.name,
            "scored": self.scored,
            "rungs": rungs,
            "moves": list(self.history),
        }
