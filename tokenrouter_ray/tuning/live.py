"""Live statistics and the threshold autoscaler.

Each model replica keeps a ``WindowStats``: over a sliding window, every request leaving a
step on model i is a move i -> j (j = i when it stays) with the tokens it committed, and
every step adds (batch size, seconds). Snapshots (plain dicts, cheap to ship) go to the
``ThresholdTuner``, which merges them into a ``RoutingProfile``, re-solves the Markov model
when the statistics drift (or every ``period_s``), and publishes per-model threshold lists
indexed by the active-request count, with hysteresis (a new set must promise a real gain),
a bound on how fast a threshold may move, and only deadlock-free sets. Thresholds are per
model *replica*: with ``R_i`` replicas of model i (``set_replicas``, from the reporting
replicas) the sets are deadlock-free iff ``sum_i R_i (B_i - 1) < N`` and throughput comes
from the Monte Carlo model of sticky placement (``replicas.py``); a change of a count forces
a re-solve, and a set the new counts make inadmissible is replaced even without a gain.

SLO mode: in a closed system a request's mean speed at N active requests is T(B, N) / N, so
at a given N the throughput-optimal B is also the speed-optimal one; what an SLO (minimum
tokens per second per request) decides is how many requests may be active. The decision
then carries ``max_concurrency``: the largest tuned N whose best B still meets the SLO, for
the ingress to admit up to.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenrouter_ray.thresholds import ThresholdTable, is_admissible
from tokenrouter_ray.tuning.markov import throughput
from tokenrouter_ray.tuning.montecarlo import monte_carlo
from tokenrouter_ray.tuning.profile import ModelProfile, RoutingProfile
from tokenrouter_ray.tuning.search import resolve_method


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


def build_profile(
    per_model: Mapping[str, Sequence[Mapping[str, Any]]],
    models: Sequence[str],
    grain_ms: float,
    min_moves: int = 50,
    step_ms: Mapping[str, Mapping[int, float]] | None = None,
) -> RoutingProfile | None:
    """A profile from each model's replica snapshots; None while any model has fewer than
    ``min_moves`` observed moves or no step times yet. ``step_ms`` (model -> batch -> ms)
    replaces the snapshots' step times when given: step times are a property of the
    hardware, so a caller may remember batch sizes the current window has not seen."""
    merged = {m: merge_snapshots(per_model.get(m, ())) for m in models}
    p, c, profiles = [], [], []
    for src in models:
        moves = merged[src]["moves"]
        counts = [moves.get(f"{src}->{dst}", [0, 0]) for dst in models]
        total = sum(n for n, _ in counts)
        table = step_ms[src] if step_ms is not None else step_means_ms(merged[src])
        points = sorted((int(b), float(ms)) for b, ms in table.items())
        if total < min_moves or not points:
            return None
        p.append(tuple(n / total for n, _ in counts))
        c.append(tuple(tok / n if n else 0.0 for n, tok in counts))
        profiles.append(ModelProfile(src, tuple(points)))
    return RoutingProfile(tuple(profiles), tuple(p), tuple(c), grain_ms)


@dataclass
class Decision:
    thresholds: dict[str, list[int]]  # per model, indexed by active-request count
    changed: bool
    reason: str
    predicted: dict[int, dict[str, float]] = field(default_factory=dict)  # N -> {B label: tok/s}
    max_concurrency: int | None = None  # SLO mode: admit at most this many requests
    solved: bool = False  # the Markov model was solved for this decision
    at: float = field(default_factory=time.time)


class ThresholdTuner:
    def __init__(
        self,
        models: Sequence[str],
        concurrencies: Sequence[int] = (1, 2, 4, 8, 16),
        grain_ms: float = 0.5,
        fixed: Mapping[str, int] | None = None,
        min_gain: float = 0.02,
        max_step: int = 4,
        drift: float = 0.05,
        min_tokens_per_s: float | None = None,
        initial: Mapping[str, Sequence[int]] | None = None,
        replicas: Mapping[str, int] | None = None,
    ) -> None:
        self.models = list(models)
        # data-parallel replicas per model: B is per replica, sum_i R_i (B_i - 1) < N
        self.replicas = {m: int((replicas or {}).get(m, 1)) for m in self.models}
        self.replicas_changed = False
        self.concurrencies = sorted(concurrencies)
        self.grain_ms = grain_ms
        self.fixed = dict(fixed or {})
        self.min_gain = min_gain  # hysteresis: adopt only if predicted throughput gains this
        self.max_step = max_step  # a threshold moves by at most this much per decision
        self.drift = drift  # re-solve when a routing probability moved by this much
        self.min_tokens_per_s = min_tokens_per_s  # SLO: per-request generation speed
        top = max(self.concurrencies)
        self.thresholds = {
            m: ThresholdTable.of((initial or {}).get(m) or [1]).extended(top).to_list()
            for m in self.models
        }
        self.last_profile: RoutingProfile | None = None
        self.converging = False  # the last move was bounded by max_step: keep solving
        self.last = Decision(self.thresholds, False, "no statistics yet")

    def set_replicas(self, replicas: Mapping[str, int]) -> bool:
        """Adopt new replica counts (Serve autoscaling, a restart); True if any changed.
        A change forces the next decision to re-solve: the chain and the admissible set
        both depend on the counts."""
        new = {m: max(1, int(replicas.get(m, self.replicas[m]))) for m in self.models}
        if new == self.replicas:
            return False
        self.replicas, self.replicas_changed = new, True
        return True

    def _clamped(self) -> dict[str, list[int]]:
        """The current lists, with the largest free threshold lowered wherever a set is not
        deadlock-free under the current replica counts (no solve needed)."""
        out = {m: list(v) for m, v in self.thresholds.items()}
        counts = self._counts()
        free = [k for k, m in enumerate(self.models) if m not in self.fixed]
        for n in range(1, len(out[self.models[0]])):
            combo = [out[m][n] for m in self.models]
            while not is_admissible(n, combo, counts) and any(combo[k] > 1 for k in free):
                k = max(free, key=lambda k: combo[k])
                combo[k] -= 1
            for m, value in zip(self.models, combo, strict=True):
                out[m][n] = value
        return out

    def _counts(self) -> tuple[int, ...]:
        return tuple(self.replicas[m] for m in self.models)

    def drifted(self, profile: RoutingProfile) -> bool:
        if self.last_profile is None:
            return True
        old, new = self.last_profile, profile
        moved_p = max(
            abs(a - b)
            for ra, rb in zip(old.route_prob, new.route_prob, strict=True)
            for a, b in zip(ra, rb, strict=True)
        )
        steps = [
            abs(a.step_time_ms(1) - b.step_time_ms(1)) / a.step_time_ms(1)
            for a, b in zip(old.models, new.models, strict=True)
        ]
        return moved_p > self.drift or max(steps) > 0.2

    def decide(self, profile: RoutingProfile | None, force: bool = False) -> Decision:
        if profile is None:
            clamped = self._clamped()  # new replica counts may have made a set deadlock
            changed = clamped != self.thresholds
            self.thresholds = clamped
            why = "too few observations" + ("; lowered to stay deadlock-free" if changed else "")
            self.last = Decision(self.thresholds, changed, why)
            return self.last
        if (
            not force
            and not self.converging
            and not self.replicas_changed
            and not self.drifted(profile)
        ):
            self.last = Decision(self.thresholds, False, "statistics within the drift bound")
            return self.last
        self.last_profile = profile
        self.replicas_changed = False
        counts = self._counts()
        new = {m: list(v) for m, v in self.thresholds.items()}
        predicted: dict[int, dict[str, float]] = {}
        reasons = []
        for n in self.concurrencies:
            current = tuple(self.thresholds[m][n] for m in self.models)
            best, scores = self._best(profile, n, current)
            predicted[n] = scores
            cur = scores.get(_label(self.models, current), 0.0)
            forced = not is_admissible(n, current, counts)  # e.g. a replica was added
            gain = scores.get(_label(self.models, best), 0.0) >= cur * (1 + self.min_gain)
            if best != current and (forced or gain):
                for m, value in zip(self.models, best, strict=True):
                    new[m][n] = value
                reasons.append(
                    f"N={n}: {_label(self.models, current)} -> {_label(self.models, best)}"
                )
        top = len(new[self.models[0]]) - 1  # fill between tuned N: admissible as they are
        for m in self.models:
            tuned = {n: new[m][n] for n in self.concurrencies}
            new[m] = ThresholdTable.from_tuned(tuned, top).to_list()
        changed = new != self.thresholds
        self.converging = changed  # a bounded move may not have reached the optimum yet
        self.thresholds = new
        cap = None
        if self.min_tokens_per_s is not None:
            meets = [
                n
                for n in self.concurrencies
                if max(predicted[n].values()) / n >= self.min_tokens_per_s
            ]
            cap = max(meets, default=min(self.concurrencies))
        self.last = Decision(
            new, changed, "; ".join(reasons) or "current thresholds best", predicted, cap, True
        )
        return self.last

    def _best(
        self, profile: RoutingProfile, n: int, current: tuple[int, ...]
    ) -> tuple[tuple[int, ...], dict[str, float]]:
        """Best admissible B (``sum_i R_i (B_i - 1) < N``) within ``max_step`` of the current
        one; anywhere in 1..N when the current one is no longer admissible (the replica
        counts grew). Exact for two models (or small N); Monte Carlo where exact chains
        explode (three or more models past ``AUTO_EXACT_MAX_N``) and with replicas
        (sticky placement, ``monte_carlo_bound``), as ``tune --method auto`` does."""
        counts = self._counts()
        reach = self.max_step if is_admissible(n, current, counts) else n
        grids = []
        for m, cur in zip(self.models, current, strict=True):
            if m in self.fixed:
                grids.append([self.fixed[m]])
            else:
                grids.append(range(max(1, cur - reach), min(n, cur + reach) + 1))
        combos = [c for c in itertools.product(*grids) if is_admissible(n, c, counts)]
        if resolve_method(profile, n, "auto", counts) == "exact":
            points = [throughput(profile, n, combo) for combo in combos]
        else:
            points = monte_carlo(profile, n, combos, model_replicas=counts)
        scores = {_label(self.models, p.thresholds): p.throughput for p in points}
        best = max(points, key=lambda p: p.throughput, default=None)
        return (current if best is None else tuple(best.thresholds)), scores


def _label(models: Sequence[str], combo: Sequence[int]) -> str:
    return ",".join(f"{m}={b}" for m, b in zip(models, combo, strict=True))
