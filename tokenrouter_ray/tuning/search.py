"""Choosing thresholds: the search for ``B*(N) = argmax_B T(B)`` and the per-N threshold lists.

Input: a profile, the concurrencies N to tune, and optionally some thresholds held fixed
(e.g. ``{"small": 1}``). Each free model's B ranges over ``1..N`` subject to the no-deadlock
rule ``sum_i R_i (B_i - 1) < N`` (``R_i`` data-parallel replicas of model i, default 1; B is
per replica, see ``replicas.py``; with replicas the method is Monte Carlo). Output: a
``SweepResult`` per N (every evaluated point and the best), and ``threshold_lists`` turns
those into the per-model lists a scheduler config takes
(index = number of active requests).

Methods: ``exact`` solves the Markov chain for every admissible B; ``monte-carlo`` estimates
all of them at once with the vectorized simulation of the same chain (``montecarlo.py``);
``auto`` takes exact for two models, or for more models up to ``AUTO_EXACT_MAX_N``, and Monte
Carlo beyond. With a transit between models (``RoutingProfile.transit_ms``) the exact chain
grows by the requests in flight: ``auto`` takes it while it can hold the transit (none
longer than its sender's shortest step) and stays under ``TRANSIT_MAX_STATES`` states, and
Monte Carlo otherwise (``evaluate``). The exact sweep is exhaustive by default.
``patience=k`` stops a free model's sweep after k values in a row below its best so far;
T(B) is *not* always single-peaked (at N=64 in the paper setting it dips near B=22 before its
maximum at B=40, see docs/user-guide/tuning.md), so early stopping is an opt-in speed/accuracy
trade.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tokenrouter_ray.thresholds import ThresholdTable, is_admissible
from tokenrouter_ray.tuning.chain import ChainTooLarge
from tokenrouter_ray.tuning.markov import ThroughputResult, throughput, transit_fits
from tokenrouter_ray.tuning.methods import METHODS, MonteCarloConfig
from tokenrouter_ray.tuning.montecarlo import monte_carlo
from tokenrouter_ray.tuning.profile import RoutingProfile
from tokenrouter_ray.tuning.replicas import replica_counts

AUTO_EXACT_MAX_N = 8  # with 3+ models, exact chains past this N reach 10^5..10^6 states
# with a transit, ``auto`` gives up the exact chain past this many states: the chain's
# build and solve time grows faster than its state count, from about a second here to
# minutes at a few times this size
TRANSIT_MAX_STATES = 150_000


@dataclass(frozen=True)
class SweepResult:
    """All evaluated thresholds for one N, and the best of them."""

    n_requests: int
    names: tuple[str, ...]
    free: tuple[int, ...]  # indices of the models whose B was swept
    points: tuple[ThroughputResult, ...]  # in evaluation order
    method: str  # "exact" or "monte-carlo"
    elapsed_s: float

    @property
    def best(self) -> ThroughputResult:
        return max(self.points, key=lambda point: point.throughput)

    def best_by_name(self) -> dict[str, int]:
        return dict(zip(self.names, self.best.thresholds, strict=True))

    def point_label(self, point: ThroughputResult) -> str:
        """The swept B alone with one free model, else ``name=B`` pairs for the free ones."""
        if len(self.free) == 1:
            return str(point.thresholds[self.free[0]])
        return ",".join(f"{self.names[i]}={point.thresholds[i]}" for i in self.free)


def _base_and_free(
    profile: RoutingProfile,
    n_requests: int,
    fixed: Mapping[str, int] | None,
    replicas: Sequence[int] | None = None,
) -> tuple[list[int], tuple[int, ...]]:
    pinned = {}
    for name, value in (fixed or {}).items():
        if int(value) < 1:
            raise ValueError(f"fixed threshold for {name!r} must be >= 1, got {value}")
        pinned[profile.index(name)] = int(value)
    base = [pinned.get(i, 1) for i in range(profile.num_models)]
    if not is_admissible(n_requests, base, replicas):
        raise ValueError(
            f"fixed thresholds {dict(fixed or {})} deadlock at N={n_requests}: "
            "sum(R_i (B_i - 1)) must be < N"
        )
    return base, tuple(i for i in range(profile.num_models) if i not in pinned)


def candidates(
    profile: RoutingProfile,
    n_requests: int,
    fixed: Mapping[str, int] | None = None,
    replicas: Mapping[str, int] | Sequence[int] | None = None,
) -> list[tuple[int, ...]]:
    """Every admissible threshold vector with the fixed entries pinned."""
    counts = replica_counts(profile, replicas)
    base, free = _base_and_free(profile, n_requests, fixed, counts)
    out = []
    for values in itertools.product(range(1, n_requests + 1), repeat=len(free)):
        trial = base.copy()
        for i, value in zip(free, values, strict=True):
            trial[i] = value
        if is_admissible(n_requests, trial, counts):
            out.append(tuple(trial))
    return out


def _climb_exact(
    profile: RoutingProfile,
    n_requests: int,
    base: list[int],
    free: tuple[int, ...],
    patience: int | None,
    max_states: int | None = None,
) -> list[ThroughputResult]:
    points: list[ThroughputResult] = []

    def climb(axis: int, thresholds: list[int]) -> float:
        """Best throughput over free axes ``axis..`` with the earlier ones set."""
        if axis == len(free):
            point = throughput(profile, n_requests, tuple(thresholds), max_states)
            points.append(point)
            return point.throughput
        best, worse_in_a_row = float("-inf"), 0
        for value in range(1, n_requests + 1):
            trial = thresholds.copy()
            trial[free[axis]] = value
            if not is_admissible(n_requests, trial):
                break
            found = climb(axis + 1, trial)
            if found > best:
                best, worse_in_a_row = found, 0
            else:
                worse_in_a_row += 1
                if patience is not None and worse_in_a_row >= patience:
                    break
        return best

    climb(0, base)
    return points


def resolve_method(
    profile: RoutingProfile, n_requests: int, method: str, replicas: Sequence[int] | None = None
) -> str:
    """``auto``: exact for two models, or small N; Monte Carlo beyond, and always with
    data-parallel replicas (the exact chain has one replica per model)."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {METHODS}")
    replicated = replicas is not None and any(r > 1 for r in replicas)
    if method == "exact" and replicated:
        raise ValueError("the exact chain has one replica per model; with replicas use monte-carlo")
    if method != "auto":
        return method
    if replicated or not transit_fits(profile, n_requests):
        return "monte-carlo"
    if profile.num_models <= 2 or n_requests <= AUTO_EXACT_MAX_N:
        return "exact"
    return "monte-carlo"


def _state_cap(profile: RoutingProfile, method: str) -> int | None:
    """``auto`` with a transit: the exact chain up to ``TRANSIT_MAX_STATES`` states."""
    return TRANSIT_MAX_STATES if method == "auto" and profile.transit_ms is not None else None


def evaluate(
    profile: RoutingProfile,
    n_requests: int,
    combos: Sequence[Sequence[int]],
    method: str = "auto",
    mc_config: MonteCarloConfig | None = None,
    replicas: Sequence[int] | None = None,
) -> tuple[list[ThroughputResult], str]:
    """T(B) of every threshold vector in ``combos`` by ``method`` (see the module docstring),
    and the method used."""
    chosen = resolve_method(profile, n_requests, method, replicas)
    if chosen == "exact":
        try:
            cap = _state_cap(profile, method)
            return [throughput(profile, n_requests, c, cap) for c in combos], chosen
        except ChainTooLarge:
            pass
    return monte_carlo(profile, n_requests, combos, mc_config, replicas), "monte-carlo"


def sweep(
    profile: RoutingProfile,
    n_requests: int,
    fixed: Mapping[str, int] | None = None,
    method: str = "auto",
    patience: int | None = None,
    mc_config: MonteCarloConfig | None = None,
    replicas: Mapping[str, int] | Sequence[int] | None = None,
) -> SweepResult:
    """Evaluate thresholds for one N and return every point tried (see module docstring).
    ``replicas``: data-parallel replicas per model (B is per replica; see ``replicas.py``)."""
    counts = replica_counts(profile, replicas)
    base, free = _base_and_free(profile, n_requests, fixed, counts)
    chosen = resolve_method(profile, n_requests, method, counts)
    start = time.perf_counter()
    points = None
    if chosen == "exact":
        try:
            cap = _state_cap(profile, method)
            points = _climb_exact(profile, n_requests, base, free, patience, cap)
        except ChainTooLarge:
            chosen = "monte-carlo"
    if points is None:
        cands = candidates(profile, n_requests, fixed, counts)
        points = monte_carlo(profile, n_requests, cands, mc_config, counts)
    return SweepResult(
        n_requests=n_requests,
        names=profile.names,
        free=free,
        points=tuple(points),
        method=chosen,
        elapsed_s=time.perf_counter() - start,
    )


def tune(
    profile: RoutingProfile,
    concurrencies: Sequence[int],
    fixed: Mapping[str, int] | None = None,
    method: str = "auto",
    patience: int | None = None,
    mc_config: MonteCarloConfig | None = None,
    replicas: Mapping[str, int] | Sequence[int] | None = None,
) -> dict[int, SweepResult]:
    """``sweep`` for each N, keyed by N."""
    return {
        n: sweep(profile, n, fixed, method, patience, mc_config, replicas) for n in concurrencies
    }


def threshold_lists(
    results: Mapping[int, SweepResult], max_n: int | None = None
) -> dict[str, list[int]]:
    """Per-model threshold lists indexed by the number of active requests (0..max_n).

    The fill rule of ``ThresholdTable.from_tuned``: entry n uses the best B of the largest
    tuned N <= n; below the smallest tuned N, and at index 0, it is 1.
    """
    if not results:
        return {}
    names = next(iter(results.values())).names
    top = max(results) if max_n is None else max_n
    return {
        name: ThresholdTable.from_tuned(
            {n: result.best.thresholds[i] for n, result in results.items()}, top
        ).to_list()
        for i, name in enumerate(names)
    }
