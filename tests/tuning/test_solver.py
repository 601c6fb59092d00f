"""Live statistics -> profile -> thresholds, with hysteresis, bounded moves, the SLO."""

from __future__ import annotations

import random

import pytest

from tokenrouter_ray.replica.window import Tally, WindowStats
from tokenrouter_ray.thresholds import is_admissible
from tokenrouter_ray.tuning.solver import ThresholdSolver
from tokenrouter_ray.tuning.tuner import build_profile

MODELS = ["small", "large"]


def observed(p_large: float, n: int = 4000, seed: int = 0) -> dict[str, list[dict]]:
    """What the replicas of an R2R pair record: small escalates with p_large (its token is
    dropped), large always returns committing one token; steps 6 ms / 28 ms."""
    rng = random.Random(seed)
    small, large = WindowStats(), WindowStats()
    for _ in range(n):
        if rng.random() < p_large:
            small.record_move("small", "large", 0, now=0)
            large.record_move("large", "small", 1, now=0)
        else:
            small.record_move("small", "small", 1, now=0)
    for b in (1, 2, 4, 8):
        small.record_step(b, 0.006 + 0.0002 * b, now=0)
        large.record_step(b, 0.028 + 0.0005 * b, now=0)
    return {"small": [small.snapshot(now=1)], "large": [large.snapshot(now=1)]}


def test_window_forgets_old_observations() -> None:
    stats = WindowStats(window_s=10)
    stats.record_move("small", "large", 0, now=0)
    stats.record_move("small", "small", 1, now=8)
    snap = stats.snapshot(now=12)
    assert snap.moves == {("small", "small"): Tally(1, 1)}


def test_window_counts_steps_per_active_request_count() -> None:
    stats = WindowStats(window_s=10)
    stats.record_step(2, 0.01, now=0, active=4)
    stats.record_step(3, 0.01, now=1, active=4)
    stats.record_step(1, 0.01, now=2, active=1)
    stats.record_step(1, 0.01, now=3)  # N unknown: not counted
    stats.record_step(2, 0.9, now=4, active=4, num_tokens=60)  # a prefill: N yes, time no
    snap = stats.snapshot(now=5)
    assert snap.active == {4: Tally(3, 7), 1: Tally(1, 1)}
    assert snap.steps == {2: Tally(1, 0.01), 3: Tally(1, 0.01), 1: Tally(2, 0.02)}


def test_profile_matches_what_was_observed() -> None:
    profile = build_profile(observed(0.35), MODELS, grain_ms=0.5)
    p = profile.route_prob
    assert abs(p[0][1] - 0.35) < 0.03 and p[1][0] == 1.0
    assert profile.commit[0][1] == 0 and profile.commit[0][0] == 1 and profile.commit[1][0] == 1
    assert build_profile({"small": [], "large": []}, MODELS, 0.5) is None


def test_tuner_moves_to_the_new_optimum_when_routing_changes() -> None:
    tuner = ThresholdSolver(MODELS, concurrencies=[8], fixed={"small": 1}, max_step=8, grain_ms=0.5)
    first = tuner.decide(build_profile(observed(0.35), MODELS, 0.5))
    b_before = first.thresholds["large"][8]
    assert first.changed and b_before > 1  # batching the large model pays at N = 8
    same = tuner.decide(build_profile(observed(0.35, seed=1), MODELS, 0.5))
    assert same.solved and not same.changed  # after a move it checks that it arrived
    again = tuner.decide(build_profile(observed(0.35, seed=2), MODELS, 0.5))
    assert not again.solved and "drift" in again.reason  # noise does not move thresholds
    after = tuner.decide(build_profile(observed(0.15), MODELS, 0.5))
    scores = after.predicted[8]
    best = max(scores, key=scores.get)
    assert after.thresholds["large"][8] == int(best.split("large=")[1])
    assert after.thresholds["large"][8] != b_before
    for n in range(1, 9):  # every published set is deadlock-free
        assert is_admissible(n, [after.thresholds[m][n] for m in MODELS])


def test_threshold_moves_are_bounded() -> None:
    tuner = ThresholdSolver(
        MODELS, concurrencies=[16], fixed={"small": 1}, max_step=2, grain_ms=0.5
    )
    decision = tuner.decide(build_profile(observed(0.35), MODELS, 0.5))
    assert decision.thresholds["large"][16] <= 1 + 2


def test_slo_caps_concurrency_at_the_speed_it_can_keep() -> None:
    profile = build_profile(observed(0.35), MODELS, 0.5)
    tuned = [1, 2, 4, 8, 16]
    free = ThresholdSolver(
        MODELS, concurrencies=tuned, fixed={"small": 1}, max_step=16, grain_ms=0.5
    ).decide(profile)
    speed = {n: max(free.predicted[n].values()) / n for n in tuned}
    assert speed[1] > speed[16]  # sharing the models slows each request down
    bar = (speed[4] + speed[8]) / 2  # N = 4 keeps it, N = 8 does not
    slo = ThresholdSolver(
        MODELS,
        concurrencies=tuned,
        fixed={"small": 1},
        max_step=16,
        grain_ms=0.5,
        min_tokens_per_s=bar,
    ).decide(profile)
    assert slo.max_concurrency == max(n for n in tuned if speed[n] >= bar)
    assert free.max_concurrency is None


def test_three_models_past_the_exact_range_use_monte_carlo() -> None:
    from tokenrouter_ray.tuning.examples import escalation_chain
    from tokenrouter_ray.tuning.markov import throughput
    from tokenrouter_ray.tuning.search import AUTO_EXACT_MAX_N

    n = AUTO_EXACT_MAX_N + 1  # past it the tuner estimates; exact is still computable here
    profile = escalation_chain().with_grain(1.0)
    names = list(profile.names)
    decision = ThresholdSolver(names, concurrencies=[n], max_step=2, grain_ms=1.0).decide(profile)
    scores = decision.predicted[n]
    assert decision.solved and len(scores) == 27  # every admissible B within 2 of (1, 1, 1)
    best = max(scores, key=scores.get)
    for label in {"small=1,mid=1,large=1", best}:
        combo = tuple(int(part.split("=")[1]) for part in label.split(","))
        exact = throughput(profile, n, combo).throughput
        assert scores[label] == pytest.approx(exact, rel=0.05)  # the bound


def test_each_solve_predicts_routed_and_alone_and_later_decisions_carry_it() -> None:
    """Per N: routed tokens/s at the thresholds in force (the Markov model's score for
    them) and the top model alone (N rows per step at its step time for N rows); the
    decisions that solve nothing keep the latest prediction for the speed bypass."""
    tuner = ThresholdSolver(MODELS, concurrencies=[1, 8], fixed={"small": 1}, grain_ms=0.5)
    first = tuner.decide(build_profile(observed(0.35), MODELS, 0.5))
    assert first.solved and set(first.predicted_alone) == {1, 8}
    for n in (1, 8):
        label = f"small=1,large={first.thresholds['large'][n]}"
        assert first.predicted_routed[n] == pytest.approx(first.predicted[n][label])
    large_ms = {1: 28.5, 8: 32.0}  # observed(): 28 ms + 0.5 ms per row
    for n, ms in large_ms.items():
        assert first.predicted_alone[n] == pytest.approx(n * 1e3 / ms, rel=1e-3)
    second = tuner.decide(build_profile(observed(0.35, seed=1), MODELS, 0.5))  # arrived?
    quiet = tuner.decide(build_profile(observed(0.35, seed=2), MODELS, 0.5))
    assert second.solved and not quiet.solved
    assert quiet.predicted_routed == second.predicted_routed
    assert quiet.predicted_alone == second.predicted_alone
    shown = quiet.to_json()["predicted_alone_tokens_per_s"]
    assert shown["8"] == round(second.predicted_alone[8], 3)
