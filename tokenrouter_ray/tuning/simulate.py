"""A plain discrete-event simulation of the deferred-batching system, request by request.

This is the independent cross-check of the exact chain: it shares nothing with ``chain.py``
but the profile's grain table. Requests are individual objects in per-model queues; every
event, the running batches with the least time left finish, each request picks its next
model from ``p`` on its own, and idle models with enough waiting requests launch. It walks
one trajectory with Python's ``random`` and reports committed tokens over elapsed time.
It is slow (pure Python) and meant for small cases and tests; ``montecarlo.py`` holds the
vectorized estimator used for tuning. A profile's transit (``transit_ms``) holds each
request moving i -> j in flight for ``d_ij`` grains before it waits at j; any number of
groups may be in flight at once.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Sequence
from dataclasses import dataclass

from tokenrouter_ray.thresholds import check_admissible
from tokenrouter_ray.tuning.profile import RoutingProfile


@dataclass(frozen=True)
class SimulationResult:
    """Totals of one simulated trajectory after warm-up."""

    throughput: float  # committed tokens per second
    tokens: float
    seconds: float
    events: int


def simulate(
    profile: RoutingProfile,
    n_requests: int,
    thresholds: Sequence[int],
    events: int = 50_000,
    warmup_events: int = 1_000,
    seed: int = 0,
) -> SimulationResult:
    """Simulate ``warmup_events + events`` events (batch completions, and landings of requests
    in transit); measure the last ``events``."""
    check_admissible(n_requests, thresholds)
    rng = random.Random(seed)
    m = profile.num_models
    grains = profile.grains(n_requests).tolist()
    caps = profile.max_batches(n_requests).tolist()
    route = profile.route_matrix().tolist()
    commit = profile.commit_matrix().tolist()
    destinations = list(range(m))
    transit = profile.transit_grains().tolist()
    flights: list[tuple[int, int, int]] = []  # heap of (landing time, dst, request id)
    clock = 0

    queue: list[list[int]] = [[] for _ in range(m)]  # request ids waiting at each model
    batch: list[list[int]] = [[] for _ in range(m)]  # request ids in each running step
    left = [0] * m  # grains until the running step ends
    queue[0] = list(range(n_requests))

    def launch() -> None:
        for j in range(m):
            if not batch[j] and queue[j] and len(queue[j]) >= thresholds[j]:
                take = min(len(queue[j]), caps[j])
                batch[j], queue[j] = queue[j][:take], queue[j][take:]
                left[j] = grains[j][take]

    launch()
    tokens = 0.0
    elapsed = 0
    for event in range(warmup_events + events):
        step = min([left[i] for i in range(m) if batch[i]] + [t - clock for t, _, _ in flights[:1]])
        clock += step
        while flights and flights[0][0] == clock:
            _, dst, rid = heapq.heappop(flights)
            queue[dst].append(rid)
        moving: list[tuple[int, int]] = []
        for i in range(m):
            if not batch[i]:
                continue
            left[i] -= step
            if left[i] == 0:
                moving += [(i, rid) for rid in batch[i]]
                batch[i] = []
        for src, rid in moving:
            dst = rng.choices(destinations, weights=route[src])[0]
            if event >= warmup_events:
                tokens += commit[src][dst]
            if transit[src][dst]:
                heapq.heappush(flights, (clock + transit[src][dst], dst, rid))
            else:
                queue[dst].append(rid)
        if event >= warmup_events:
            elapsed += step
        launch()
    seconds = elapsed * profile.grain_ms / 1000.0
    return SimulationResult(
        throughput=tokens / seconds, tokens=tokens, seconds=seconds, events=events
    )
