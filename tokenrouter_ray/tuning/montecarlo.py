"""Monte Carlo estimate of the same chain, vectorized: the approximation for large state spaces.

When the exact chain is too big to enumerate (three or more models at N of about 10 and up),
the throughput of each candidate B is estimated by running many independent copies of the
chain side by side in numpy: one array row per (candidate, replica), one vectorized event per
step for all rows. The dynamics are exactly those of ``chain.py`` (same grains, same launch
rule, multinomial routing), so the only error is sampling error, reported as a standard
error from the spread across replicas. Input: a profile, N, a list of threshold vectors and a
``MonteCarloConfig``; output: one ``ThroughputResult`` per candidate with ``stderr`` set.

A profile's transit (``transit_ms``: a request moving i -> j waits ``d_ij`` grains before it
is runnable at j) is a calendar per copy: arrivals due at each of the next ``max d`` grains,
so any number of groups may be in flight (the exact chain holds one per pair). An event is
then a batch completion or a landing, whichever comes first; ``warmup_events`` and
``events`` count both.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from tokenrouter_ray.thresholds import check_admissible
from tokenrouter_ray.tuning.markov import ThroughputResult
from tokenrouter_ray.tuning.methods import MonteCarloConfig
from tokenrouter_ray.tuning.profile import RoutingProfile
from tokenrouter_ray.tuning.replicas import binding, replica_counts


def monte_carlo(
    profile: RoutingProfile,
    n_requests: int,
    candidates: Sequence[Sequence[int]],
    config: MonteCarloConfig | None = None,
    model_replicas: Sequence[int] | None = None,
) -> list[ThroughputResult]:
    """Estimate T(B) for every candidate B at once (per-replica B; ``model_replicas[i]``
    data-parallel replicas of model i, expanded as in ``replicas.py``)."""
    config = config or MonteCarloConfig()
    counts = replica_counts(profile, model_replicas)
    for thresholds in candidates:
        check_admissible(n_requests, thresholds, counts)
    if not candidates:
        return []
    if any(r > 1 for r in counts):
        return monte_carlo_bound(profile, n_requests, candidates, counts, config)
    start = time.perf_counter()
    rng = np.random.default_rng(config.seed)
    m = profile.num_models
    reps = config.replicas
    grains = profile.grains(n_requests)  # (M, N + 1)
    caps = profile.max_batches(n_requests)  # (M,)
    route = profile.route_matrix()  # (M, M)
    per_request = profile.tokens_per_step()  # (M,)
    model = np.arange(m)
    need = np.repeat(np.asarray(candidates, dtype=np.int64), reps, axis=0)  # (C, M)
    rows = need.shape[0]

    waiting = np.zeros((rows, m), dtype=np.int64)  # (C, M)
    waiting[:, 0] = n_requests
    batch = np.zeros_like(waiting)
    left = np.zeros_like(waiting)

    def launch() -> None:
        go = (batch == 0) & (waiting >= need) & (waiting > 0)
        size = np.minimum(waiting, caps)
        batch[go] = size[go]
        left[go] = grains[np.broadcast_to(model, go.shape)[go], size[go]]
        waiting[go] -= size[go]

    launch()
    tokens = np.zeros(rows)
    grains_elapsed = np.zeros(rows)
    never = np.iinfo(np.int64).max
    calendar = _Calendar(profile.transit_grains(), rows, (m,))
    for event in range(config.warmup_events + config.events):
        running = batch > 0
        step = np.minimum(np.where(running, left, never).min(axis=1), calendar.next_due())  # (C,)
        finishing = running & (left == step[:, None])
        done = np.where(finishing, batch, 0)  # (C, M) requests leaving each model
        if event >= config.warmup_events:
            tokens += done @ per_request
            grains_elapsed += step
        left[:] = np.where(running & ~finishing, left - step[:, None], 0)
        batch[finishing] = 0
        waiting += calendar.advance(step)
        for i in range(m):
            moving = np.flatnonzero(done[:, i])
            if moving.size:
                arrivals = rng.multinomial(done[moving, i], route[i])  # (k, M)
                for j in calendar.delayed(i):
                    calendar.add(moving, calendar.transit[i, j], (j,), arrivals[:, j])
                    arrivals[:, j] = 0
                waiting[moving] += arrivals
        launch()

    return _results(tokens, grains_elapsed, reps, profile, n_requests, candidates, start)


def monte_carlo_bound(
    profile: RoutingProfile,
    n_requests: int,
    candidates: Sequence[Sequence[int]],
    replicas: Sequence[int],
    config: MonteCarloConfig | None = None,
) -> list[ThroughputResult]:
    """T(B) with data-parallel replicas and sticky, balanced request placement.

    ``replicas.binding`` splits the N requests into classes, each bound to one replica of
    every model (a request keeps the replica its KV is on). A *unit* is one model replica; it
    runs the model's step times and threshold, and launches all its waiting requests, of any
    class, once at least B of them wait. The state per copy is, per unit, the waiting and
    running requests of each class and the grains left of its batch. Requests leaving a unit
    route with ``p_ij`` and arrive at their class's replica of j. A ``max_batch`` caps a
    launch (the lowest classes first; the rest keep waiting).
    """
    config = config or MonteCarloConfig()
    units, bound, population = binding(replicas, n_requests)  # (U,), (C, M), (C,)
    start = time.perf_counter()
    rng = np.random.default_rng(config.seed)
    unit_model = np.asarray(units)  # (U,) model of each unit
    u_count, c_count = unit_model.size, population.size
    grains = profile.grains(n_requests)[unit_model]  # (U, N + 1)
    caps = profile.max_batches(n_requests)[unit_model]  # (U,)
    route = profile.route_matrix()  # (M, M)
    per_request = profile.tokens_per_step()[unit_model]  # (U,)
    reps = config.replicas
    need = np.repeat(np.asarray(candidates, dtype=np.int64), reps, axis=0)[:, unit_model]
    rows = need.shape[0]  # (rows, U) thresholds per unit

    waiting = np.zeros((rows, u_count, c_count), dtype=np.int64)
    for c in range(c_count):
        waiting[:, bound[c, 0], c] = population[c]  # everyone starts at the entry model
    batch = np.zeros_like(waiting)
    left = np.zeros((rows, u_count), dtype=np.int64)
    unit_index = np.broadcast_to(np.arange(u_count), left.shape)

    def launch() -> None:
        total = waiting.sum(axis=2)  # (rows, U)
        go = (batch.sum(axis=2) == 0) & (total >= need) & (total > 0)
        # at most max_batch requests, taken class by class in order
        before = np.cumsum(waiting, axis=2) - waiting  # (rows, U, C) taken by earlier classes
        take = np.clip(caps[None, :, None] - before, 0, waiting)
        take[~go] = 0
        batch[go] = take[go]
        left[go] = grains[unit_index[go], take.sum(axis=2)[go]]
        waiting[:] -= take

    launch()
    tokens = np.zeros(rows)
    grains_elapsed = np.zeros(rows)
    never = np.iinfo(np.int64).max
    transit = profile.transit_grains()  # (M, M)
    calendar = _Calendar(transit, rows, (u_count, c_count))
    for event in range(config.warmup_events + config.events):
        size = batch.sum(axis=2)  # (rows, U)
        running = size > 0
        step = np.minimum(np.where(running, left, never).min(axis=1), calendar.next_due())
        finishing = running & (left == step[:, None])
        if event >= config.warmup_events:
            tokens += np.where(finishing, size, 0) @ per_request
            grains_elapsed += step
        left[:] = np.where(running & ~finishing, left - step[:, None], 0)
        done = np.where(finishing[:, :, None], batch, 0)  # (rows, U, C)
        batch[finishing] = 0
        waiting += calendar.advance(step)
        for u in range(u_count):
            src = unit_model[u]
            for c in range(c_count):
                moving = np.flatnonzero(done[:, u, c])
                if moving.size:
                    arrivals = rng.multinomial(done[moving, u, c], route[src])
                    for j in np.flatnonzero(route[src]):
                        if transit[src, j]:
                            calendar.add(moving, transit[src, j], (bound[c, j], c), arrivals[:, j])
                        else:
                            waiting[moving, bound[c, j], c] += arrivals[:, j]
        launch()

    return _results(tokens, grains_elapsed, reps, profile, n_requests, candidates, start)


class _Calendar:
    """Requests in transit per copy: ``due[row, t % L, *where]`` arrive ``t`` grains from the
    start (``L`` = longest transit + 1, so a ring of one slot per grain ahead suffices)."""

    def __init__(self, transit: np.ndarray, rows: int, shape: tuple[int, ...]) -> None:
        self.transit = transit  # (M, M) grains
        self.length = int(transit.max()) + 1
        self.rows = np.arange(rows)
        self.clock = np.zeros(rows, dtype=np.int64)  # grains since the start, per copy
        self.due = (
            np.zeros((rows, self.length, *shape), dtype=np.int64) if self.length > 1 else None
        )

    def delayed(self, src: int) -> list[int]:
        """Destinations a request leaving model ``src`` reaches only after a transit."""
        return [int(j) for j in np.flatnonzero(self.transit[src])]

    def next_due(self) -> np.ndarray:
        """(rows,) grains until the next landing (int64 max when nothing is in flight)."""
        never = np.iinfo(np.int64).max
        if self.due is None:
            return np.full(self.rows.size, never)
        ahead = (self.clock[:, None] + np.arange(1, self.length)) % self.length  # (rows, L-1)
        flat = self.due.reshape(self.rows.size, self.length, -1).sum(axis=2)  # (rows, L)
        pending = np.take_along_axis(flat, ahead, axis=1) > 0  # (rows, L - 1)
        return np.where(pending.any(axis=1), pending.argmax(axis=1) + 1, never)

    def advance(self, step: np.ndarray) -> np.ndarray:
        """Move every copy's clock on by ``step`` grains; returns what landed (rows, *shape)
        (at most one slot per copy: ``step`` never passes a landing)."""
        if self.due is None:
            return 0  # type: ignore[return-value]
        self.clock += step
        slot = self.clock % self.length
        landed = self.due[self.rows, slot].copy()
        self.due[self.rows, slot] = 0
        return landed

    def add(
        self, rows: np.ndarray, grains: int, where: tuple[int, ...], counts: np.ndarray
    ) -> None:
        """``counts[k]`` requests of copy ``rows[k]`` land at ``where`` ``grains`` from now."""
        slot = (self.clock[rows] + int(grains)) % self.length
        self.due[(rows, slot, *where)] += counts


def _results(
    tokens: np.ndarray,
    grains_elapsed: np.ndarray,
    reps: int,
    profile: RoutingProfile,
    n_requests: int,
    candidates: Sequence[Sequence[int]],
    start: float,
) -> list[ThroughputResult]:
    """One result per candidate: tokens over time pooled across its ``reps`` independent
    copies, with the ratio estimator's standard error across those copies."""
    tokens = tokens.reshape(-1, reps)  # (candidates, copies)
    seconds = grains_elapsed.reshape(-1, reps) * profile.grain_ms / 1000.0
    rate = tokens.sum(axis=1) / seconds.sum(axis=1)
    spread = (tokens - rate[:, None] * seconds).std(axis=1, ddof=1)
    stderr = spread / np.sqrt(reps) / seconds.mean(axis=1)
    elapsed = (time.perf_counter() - start) / len(candidates)
    return [
        ThroughputResult(
            n_requests=n_requests,
            thresholds=tuple(int(b) for b in thresholds),
            throughput=float(rate[c]),
            num_states=0,
            num_transitions=0,
            build_s=0.0,
            solve_s=elapsed,
            stderr=float(stderr[c]),
        )
        for c, thresholds in enumerate(candidates)
    ]
