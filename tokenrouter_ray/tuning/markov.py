"""Predicted throughput of deferred batching: the exact Markov-chain model.

The model and its use: docs/user-guide/tuning.md.

Input: a ``RoutingProfile`` (step times, routing and commit matrices, grain), the number of
active requests N and the per-model thresholds B (model i launches only when idle with at
least ``B_i`` requests waiting, and then takes all of them). Output: a ``ThroughputResult``
with the long-run committed tokens per second

    T(B) = sum_s pi(s) reward(s) / sum_s pi(s) tau(s)

where ``reward(s) = sum_{i finishing} sum_j b_i c_ij p_ij`` and ``tau(s)`` is the time to the
next batch completion. The chain itself is built in ``chain.py`` and solved in
``stationary.py``; this module validates the inputs and forms the ratio.

The exact chain has one replica per model. With ``R_i`` data-parallel replicas (each applying
``B_i`` to the requests placed on it) the admissibility rule is ``sum_i R_i (B_i - 1) < N``
(``thresholds.is_admissible(..., replicas)``) and the throughput comes from the Monte Carlo
model of sticky placement (``montecarlo.monte_carlo_bound``, ``replicas.py``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tokenrouter_ray.thresholds import check_admissible
from tokenrouter_ray.tuning.chain import Chain, ChainInputs, build_chain
from tokenrouter_ray.tuning.profile import RoutingProfile
from tokenrouter_ray.tuning.stationary import stationary


@dataclass(frozen=True)
class ThroughputResult:
    """One evaluated (N, B) point: exact (``stderr`` None) or a Monte Carlo estimate."""

    n_requests: int
    thresholds: tuple[int, ...]
    throughput: float  # committed tokens per second
    num_states: int  # reachable states of the exact chain; 0 for an estimate
    num_transitions: int
    build_s: float
    solve_s: float
    stderr: float | None = None  # standard error of a Monte Carlo estimate, tokens per second


def chain_inputs(
    profile: RoutingProfile, n_requests: int, thresholds: Sequence[int]
) -> ChainInputs:
    """Validate (N, B) against the profile and turn them into the chain's arrays."""
    if len(thresholds) != profile.num_models:
        raise ValueError(
            f"need one threshold per model ({profile.num_models}), got {len(thresholds)}"
        )
    check_admissible(n_requests, thresholds)
    return ChainInputs(
        n_requests=n_requests,
        thresholds=np.asarray(thresholds, dtype=np.int64),
        grains=profile.grains(n_requests),
        max_batch=profile.max_batches(n_requests),
        route_prob=profile.route_matrix(),
        tokens_per_request=profile.tokens_per_step(),
        transit=profile.transit_grains() if profile.transit_ms is not None else None,
    )


def chain_throughput(chain: Chain, grain_ms: float) -> tuple[float, np.ndarray]:
    """Tokens per second of a built chain, and its stationary distribution."""
    pi = stationary(chain.transition, start=0)
    seconds = float(pi @ chain.tau) * grain_ms / 1000.0
    return float(pi @ chain.reward) / seconds, pi


def throughput(
    profile: RoutingProfile,
    n_requests: int,
    thresholds: Sequence[int],
    max_states: int | None = None,
) -> ThroughputResult:
    """Exact predicted throughput for N active requests under thresholds B (``ChainTooLarge``
    past ``max_states`` reachable states)."""
    inputs = chain_inputs(profile, n_requests, thresholds)
    t0 = time.perf_counter()
    chain = build_chain(inputs, max_states)
    t1 = time.perf_counter()
    value, _ = chain_throughput(chain, profile.grain_ms)
    t2 = time.perf_counter()
    return ThroughputResult(
        n_requests=n_requests,
        thresholds=tuple(int(b) for b in thresholds),
        throughput=value,
        num_states=chain.num_states,
        num_transitions=chain.num_transitions,
        build_s=t1 - t0,
        solve_s=t2 - t1,
    )


def transit_fits(profile: RoutingProfile, n_requests: int) -> bool:
    """Whether the exact chain can hold the profile's transit at N (one group in flight per
    pair: no transit longer than its sender's shortest step); always with no transit."""
    if profile.transit_ms is None:
        return True
    ones = (1,) * profile.num_models
    return chain_inputs(profile, n_requests, ones).transit_fits()


def single_request_throughput(profile: RoutingProfile) -> float:
    """Closed form at N = 1: one request walking the routing chain, one step per visit.

    With nu the stationary distribution of p (nu p = nu), the request commits
    ``sum_i nu_i sum_j p_ij c_ij`` tokens per ``sum_i nu_i (t_i(1) + sum_j p_ij d_ij)``
    seconds (``d_ij`` the transit of a move i -> j, in whole grains as the chain has it).
    """
    p = profile.route_matrix()
    m = p.shape[0]
    system = np.vstack([(p.T - np.eye(m))[:-1], np.ones(m)])
    rhs = np.zeros(m)
    rhs[-1] = 1.0
    nu = np.linalg.lstsq(system, rhs, rcond=None)[0]
    step_s = profile.grains(1)[:, 1] * profile.grain_ms / 1000.0
    step_s = step_s + (p * profile.transit_grains()).sum(axis=1) * profile.grain_ms / 1000.0
    return float(nu @ profile.tokens_per_step()) / float(nu @ step_s)
