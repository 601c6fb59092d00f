"""Re-solving deferred-batching thresholds from a live profile: ``ThresholdSolver``.

``decide(profile)`` re-solves the Markov model when the statistics drifted (or when forced,
or while a bounded move is still converging) and publishes a ``ThresholdTable`` per model
(indexed by the active-request count), with hysteresis (a new set must promise a real gain),
a bound on how fast a threshold may move, and only deadlock-free sets; between tuned N the
tables follow the fill rule of ``ThresholdTable.from_tuned``. Thresholds are per model
*replica*: with ``R_i`` replicas of model i (``set_replicas``) the sets are deadlock-free
iff ``sum_i R_i (B_i - 1) < N`` and throughput comes from the Monte Carlo model of sticky
placement (``replicas.py``); a change of a count forces a re-solve, and a set the new counts
make inadmissible is replaced even without a gain. The outcome is a ``TunerDecision``
(``decision.py``): one ``ThresholdTable`` per model.

SLO mode: in a closed system a request's mean speed at N active requests is T(B, N) / N, so
at a given N the throughput-optimal B is also the speed-optimal one; what an SLO (minimum
tokens per second per request) decides is how many requests may be active. The decision
then carries ``max_concurrency``: the largest tuned N whose best B still meets the SLO, for
the ingress to admit up to.

The tuner (``tuner.py``) feeds it profiles built from the replicas' windows; it touches no
I/O and no clock but ``TunerDecision.at``.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import numpy as np
from msgspec.structs import replace

from tokenrouter_ray.thresholds import ThresholdTable, is_admissible
from tokenrouter_ray.tuning.decision import TunerDecision
from tokenrouter_ray.tuning.profile import RoutingProfile
from tokenrouter_ray.tuning.search import evaluate


class ThresholdSolver:
    """Profile in, per-model threshold tables out, with hysteresis (see module docstring)."""

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
        initial: Mapping[str, ThresholdTable | Sequence[int]] | None = None,
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
        self.thresholds: dict[str, ThresholdTable] = {
            m: ThresholdTable.of((initial or {}).get(m) or [1]).extended(top) for m in self.models
        }
        self.last_profile: RoutingProfile | None = None
        self.converging = False  # the last move was bounded by max_step: keep solving
        self.last = TunerDecision(self.thresholds, False, "no statistics yet")

    def set_replicas(self, replicas: Mapping[str, int]) -> bool:
        """Adopt new replica counts (Serve autoscaling, a restart); True if any changed.
        A change forces the next decision to re-solve: the chain and the admissible set
        both depend on the counts."""
        new = {m: max(1, int(replicas.get(m, self.replicas[m]))) for m in self.models}
        if new == self.replicas:
            return False
        self.replicas, self.replicas_changed = new, True
        return True

    def _clamped(self) -> dict[str, ThresholdTable]:
        """The current tables, with the largest free threshold lowered wherever a set is not
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
        return {m: ThresholdTable(v) for m, v in out.items()}

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
        # the transit: re-solve when it moved by a tenth of the shortest step (or a grain)
        moved_d = float(np.abs(old.transit_matrix() - new.transit_matrix()).max())
        shortest = min(m.step_time_ms(1) for m in new.models)
        return (
            moved_p > self.drift or max(steps) > 0.2 or moved_d > max(0.1 * shortest, new.grain_ms)
        )

    def decide(self, profile: RoutingProfile | None, force: bool = False) -> TunerDecision:
        if profile is None:
            clamped = self._clamped()  # new replica counts may have made a set deadlock
            changed = clamped != self.thresholds
            self.thresholds = clamped
            why = "too few observations" + ("; lowered to stay deadlock-free" if changed else "")
            self.last = self._carry(TunerDecision(self.thresholds, changed, why))
            return self.last
        if (
            not force
            and not self.converging
            and not self.replicas_changed
            and not self.drifted(profile)
        ):
            self.last = self._carry(
                TunerDecision(self.thresholds, False, "statistics within the drift bound")
            )
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
        tables = {
            m: ThresholdTable.from_tuned({n: new[m][n] for n in self.concurrencies}, top)
            for m in self.models
        }
        changed = tables != self.thresholds
        self.converging = changed  # a bounded move may not have reached the optimum yet
        self.thresholds = tables
        cap = None
        if self.min_tokens_per_s is not None:
            meets = [
                n
                for n in self.concurrencies
                if max(predicted[n].values()) / n >= self.min_tokens_per_s
            ]
            cap = max(meets, default=min(self.concurrencies))
        top_model = profile.models[-1]  # the chain's top: what the speed bypass serves alone
        self.last = TunerDecision(
            tables, changed, "; ".join(reasons) or "current thresholds best", predicted, cap, True,
            predicted_routed={
                n: predicted[n].get(_label(self.models, [new[m][n] for m in self.models]), 0.0)
                for n in self.concurrencies
            },
            predicted_alone={n: n * 1e3 / top_model.step_time_ms(n) for n in self.concurrencies},
        )  # fmt: skip
        return self.last

    def _carry(self, decision: TunerDecision) -> TunerDecision:
        """``decision`` with the latest solve's per-N prediction (it solved nothing)."""
        return replace(
            decision,
            predicted_routed=self.last.predicted_routed,
            predicted_alone=self.last.predicted_alone,
        )

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
        points, _ = evaluate(profile, n, combos, "auto", replicas=counts)
        scores = {_label(self.models, p.thresholds): p.throughput for p in points}
        best = max(points, key=lambda p: p.throughput, default=None)
        return (current if best is None else tuple(best.thresholds)), scores


def _label(models: Sequence[str], combo: Sequence[int]) -> str:
    return ",".join(f"{m}={b}" for m, b in zip(models, combo, strict=True))
