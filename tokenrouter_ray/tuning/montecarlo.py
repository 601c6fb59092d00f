"""Monte Carlo estimate of the same chain, vectorized: the approximation for large state spaces.

When the exact chain is too big to enumerate (three or more models at N of about 10 and up),
the throughput of each candidate B is estimated by running many independent copies of the
chain side by side in numpy: one array row per (candidate, replica), one vectorized event per
step for all rows. The dynamics are exactly those of ``chain.py`` (same grains, same launch
rule, multinomial routing), so the only error is sampling error, reported as a standard
error from the spread across replicas. Input: a profile, N, a list of threshold vectors and a
``MonteCarloConfig``; output: one ``ThroughputResult`` per candidate with ``stderr`` set.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tokenrouter_ray.tuning.markov import ThroughputResult, check_admissible
from tokenrouter_ray.tuning.profile import RoutingProfile


@dataclass(frozen=True)
class MonteCarloConfig:
    """How much to simulate per candidate B."""

    replicas: int = 64  # independent copies of the chain per candidate
    warmup_events: int = 300  # batch completions discarded from each copy's start
    events: int = 2_000  # batch completions measured per copy
    seed: int = 0


def monte_carlo(
    profile: RoutingProfile,
    n_requests: int,
    candidates: Sequence[Sequence[int]],
    config: MonteCarloConfig | None = None,
) -> list[ThroughputResult]:
    """Estimate T(B) for every candidate B at once."""
    config = config or MonteCarloConfig()
    for thresholds in candidates:
        check_admissible(n_requests, thresholds)
    if not candidates:
        return []
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
    for event in range(config.warmup_events + config.events):
        running = batch > 0
        step = np.where(running, left, never).min(axis=1)  # (C,)
        finishing = running & (left == step[:, None])
        done = np.where(finishing, batch, 0)  # (C, M) requests leaving each model
        if event >= config.warmup_events:
            tokens += done @ per_request
            grains_elapsed += step
        left[:] = np.where(running & ~finishing, left - step[:, None], 0)
        batch[finishing] = 0
        for i in range(m):
            moving = np.flatnonzero(done[:, i])
            if moving.size:
                waiting[moving] += rng.multinomial(done[moving, i], route[i])
        launch()

    tokens = tokens.reshape(-1, reps)  # (candidates, replicas)
    seconds = grains_elapsed.reshape(-1, reps) * profile.grain_ms / 1000.0
    rate = tokens.sum(axis=1) / seconds.sum(axis=1)
    # ratio-estimator standard error across replicas
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
