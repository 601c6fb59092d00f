"""Data-parallel replicas in the throughput model: one model with R replicas as R models.

Each replica of model i runs its own scheduler and applies the same threshold list
``B_i = batch_thresholds[min(N, len - 1)]`` to the requests it holds, with ``N`` the global
active count (thresholds are per *replica*; N is not split). A model with ``R_i`` replicas can
therefore hold up to ``R_i (B_i - 1)`` requests without launching anything, and the
no-deadlock rule becomes

    sum_i R_i (B_i - 1) < N                    (``markov.is_admissible(..., replicas)``)

and it serves up to ``R_i`` batches at once. It is what the config check (``AppConfig``), the
tuner (``solver.ThresholdSolver``) and the search (``search.sweep``) apply.

**The launch rule alone keeps every admitted request moving** (no ``max_defer_s`` needed)
under three conditions: (a) every replica evaluates ``B_i(N)`` with the true N, re-evaluated
when N changes; (b) ``sum_i R_i (B_i(n) - 1) < n`` for every n; (c) every request ends after
finitely many of its own steps (``max_tokens``) and commits at least one token every few
steps (true of every policy here: the model a request is handed to writes a token).

1. *Progress.* Look at any moment when no replica is running a batch and no message is in
   flight. Each active request waits at exactly one replica, so ``sum_r k_r = N``. If no
   replica could launch, ``k_r <= B_i(N) - 1`` at each of the ``R_i`` replicas of every
   model i, so ``N <= sum_i R_i (B_i(N) - 1) < N``: impossible. Some replica launches.
2. *Every request finishes.* With finitely many arrivals (any finite run), after the last
   one the active requests only leave. By 1 some replica is always stepping while any is
   active; every step advances the requests in it, and by (c) the total work left (tokens
   still to commit) is finite and falls by at least one every few steps. So N reaches 0 in
   finite time: every request, including any that waited below a threshold, finished. At
   each finish N drops, and by (a) the thresholds drop with it, so a request left waiting
   below ``B_i(N_old)`` is released as soon as ``B_i(N_new)`` allows (by 1, at the latest
   when everyone else is waiting too). In a closed loop (finishing requests replaced) 1
   holds at all times; a request waiting at replica r is joined by the others placed on r
   (each reaches r with positive probability at every routing decision, and new requests
   are placed on r with positive probability), so it waits a finite time with
   probability 1. Part 1 needs no assumption about placement; part 2 only that every
   replica keeps receiving new requests.

Without (a) neither holds: a replica that keeps ``B_i`` of an old, larger N can hold the
last requests forever (``tests/simulation/test_no_timeout.py``, open loop, shows it while N
is carried only by NEW frames); ``max_defer_s`` is then what moves them.

Placement is sticky: a request is placed on a replica of each model and stays there (its KV
lives there). Production, ``LocalRuntime`` and the simulation place with one rule
(``ingress/placement.py``): when the request is submitted, every model's replica by prefix
affinity bounded by load, which is least-loaded placement when prompts share no prefix. The
throughput model therefore keeps track of *which* replica each request uses: ``binding``
splits the N requests into classes, one per combination of replica choices, as evenly as a
least-loaded choice makes them,
and ``montecarlo.monte_carlo_bound`` simulates the chain over model replicas ("units") with
per-class counts. Measured on the simulated runtime (paper profile, R_large = 2,
``docs/user-guide/tuning.md``) this placement is what the runtime does; a model that draws the
replica
afresh on every move (R copies of the model, ``p_ij / R_j``) predicted B_large = 1 best at
N = 4 where the runtime measured B_large = 2 best by 10 %, so it was dropped. With one
replica per model the classes collapse to one and the result equals the exact chain's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from tokenrouter_ray.tuning.profile import RoutingProfile


def replica_counts(
    profile: RoutingProfile, replicas: Mapping[str, int] | Sequence[int] | None
) -> tuple[int, ...]:
    """Per-model replica counts in profile order (missing names: 1); ``ValueError`` if < 1."""
    if replicas is None:
        return (1,) * profile.num_models
    if isinstance(replicas, Mapping):
        unknown = set(replicas) - set(profile.names)
        if unknown:
            raise ValueError(f"replica counts name unknown models {sorted(unknown)}")
        counts = tuple(int(replicas.get(name, 1)) for name in profile.names)
    else:
        counts = tuple(int(r) for r in replicas)
        if len(counts) != profile.num_models:
            raise ValueError(
                f"need one replica count per model ({profile.num_models}), got {len(counts)}"
            )
    if any(r < 1 for r in counts):
        raise ValueError(f"replica counts must be >= 1, got {counts}")
    return counts


def binding(replicas: Sequence[int], n_requests: int) -> tuple[list[int], np.ndarray, np.ndarray]:
    """Sticky, balanced placement of N requests over replicas.

    Returns ``units`` (the model of each model replica, models in order, replicas
    consecutive), ``bound`` (C, M): the unit each request class uses for each model, and
    ``population`` (C,): requests per class. A class is one combination of replica choices
    (C = lcm of the replica counts: class c uses replica ``c mod R_i`` of model i), and the
    N requests are spread over the classes as evenly as possible -- what a least-loaded
    choice on first visit converges to.
    """
    units = [i for i, r in enumerate(replicas) for _ in range(r)]
    first = np.cumsum([0, *replicas[:-1]])  # unit index of each model's replica 0
    classes = math.lcm(*replicas)
    bound = np.array(
        [[first[i] + c % r for i, r in enumerate(replicas)] for c in range(classes)],
        dtype=np.int64,
    )
    population = np.full(classes, n_requests // classes, dtype=np.int64)
    population[: n_requests % classes] += 1
    keep = population > 0
    return units, bound[keep], population[keep]
