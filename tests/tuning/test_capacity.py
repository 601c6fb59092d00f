"""The capacity model and the replica plan: the mean-value T(n) against the
exact chain (one replica per model) and the Monte Carlo chain (replicas, row caps), the
open-loop prediction, and the plan's choices: within its targets, minimal, bounded, and
the ratio of large to small replicas following the routing."""

from __future__ import annotations

import math

import pytest

from tokenrouter_ray.tuning.capacity import (
    Chain,
    Load,
    StepCurve,
    Targets,
    closed_point,
    plan,
    predict,
)
from tokenrouter_ray.tuning.examples import paper_r2r
from tokenrouter_ray.tuning.markov import throughput
from tokenrouter_ray.tuning.montecarlo import MonteCarloConfig, monte_carlo_bound
from tokenrouter_ray.tuning.profile import ModelProfile, RoutingProfile

CAPPED = RoutingProfile(
    (ModelProfile.constant("small", 6.0, 8), ModelProfile.constant("large", 27.9, 4)),
    ((0.65, 0.35), (1.0, 0.0)),
    ((1.0, 0.0), (1.0, 0.0)),
    0.5,
)
ROWS = {"small": 8, "large": 4}


def r2r(q: float, max_batch: tuple[int, int] = (8, 4)) -> RoutingProfile:
    models = (
        ModelProfile.constant("small", 6.0, max_batch[0]),
        ModelProfile.constant("large", 27.9, max_batch[1]),
    )
    return RoutingProfile(models, ((1 - q, q), (1.0, 0.0)), ((1.0, 0.0), (1.0, 0.0)), 0.5)


def test_the_routing_chain_of_r2r() -> None:
    chain = Chain.of(paper_r2r())
    assert chain.visits == pytest.approx([1 / 1.35, 0.35 / 1.35])
    assert chain.entries == pytest.approx([0.35, 1.0])  # every large visit comes from small
    assert chain.tokens_per_step == pytest.approx(1 / 1.35)  # one token per small step


def test_step_curve_matches_the_profile_and_solves_the_batch() -> None:
    model = ModelProfile("m", ((1, 2.0), (8, 4.0), (32, 10.0)))
    curve = StepCurve(model)
    for b in (1, 3, 8, 20, 32, 64):
        assert curve.seconds(b) == pytest.approx(model.step_time_ms(b) / 1e3)
    assert curve.batch(100.0, 64) == 1.0  # 100 rows/s at 2 ms: one row at a time
    b = curve.batch(2000.0, 64)
    assert b == pytest.approx(2000.0 * curve.seconds(b))  # b = rate tau(b)
    assert curve.batch(1e6, 64) == 64.0  # more than full batches keep up with


@pytest.mark.parametrize("n", [1, 4, 8, 16, 32])
def test_mean_value_throughput_is_near_the_exact_chain(n: int) -> None:
    """One replica per model, the paper's profile: within 8 % of the exact chain (it is
    exact at n = 1; the largest gap, at small n, is the waiting it averages)."""
    profile = paper_r2r().with_grain(0.5)
    exact = throughput(profile, n, (1, 1)).throughput
    assert closed_point(profile, n).throughput == pytest.approx(exact, rel=0.08)


@pytest.mark.parametrize("replicas", [(1, 1), (1, 2), (2, 3)])
@pytest.mark.parametrize("n", [4, 16, 32])
def test_mean_value_throughput_is_near_the_monte_carlo_chain_with_replicas(
    replicas: tuple[int, int], n: int
) -> None:
    """Replicas and row caps (8 small, 4 large): within 8 % of the Monte Carlo chain, which
    simulates sticky balanced placement and capped launches exactly (seeded)."""
    mc = monte_carlo_bound(CAPPED, n, [(1, 1)], replicas, MonteCarloConfig(replicas=32))[0]
    mv = closed_point(CAPPED, n, replicas, (8, 4)).throughput
    assert mv == pytest.approx(mc.throughput, rel=0.08)


def test_a_saturated_model_caps_the_throughput_at_full_batches() -> None:
    point = closed_point(CAPPED, 64, (1, 1), (8, 4))
    # the large model: 4 rows per 27.9 ms, 0.35 visits per token
    assert point.throughput == pytest.approx(4 / 0.0279 / 0.35, rel=1e-6)
    assert point.saturated == (False, True) and point.rows[1] == 4.0


def test_prediction_follows_the_load_and_the_replicas() -> None:
    light = predict(CAPPED, (1, 2), Load(2.0, 64), ROWS)
    heavy = predict(CAPPED, (1, 2), Load(10.0, 64), ROWS)
    assert light.stable and heavy.stable
    assert light.utilisation["large"] < heavy.utilisation["large"] <= 1.0
    assert light.tpot_s <= heavy.tpot_s
    assert heavy.mean_active == pytest.approx(10.0 * 64 * heavy.tpot_s, rel=1e-6)  # Little
    more = predict(CAPPED, (1, 3), Load(10.0, 64), ROWS)
    assert more.utilisation["large"] < heavy.utilisation["large"]
    over = predict(CAPPED, (1, 1), Load(10.0, 64), ROWS)  # 640 tokens/s > 410 at most
    assert not over.stable and math.isinf(over.tpot_s)
    assert over.max_tokens_per_s == pytest.approx(4 / 0.0279 / 0.35, rel=1e-3)


def test_the_plan_keeps_its_targets_with_the_fewest_replicas() -> None:
    targets = Targets({"small": 0.7, "large": 0.7})
    load = Load(20.0, 64)
    result = plan(CAPPED, load, targets, ROWS)
    assert result.feasible
    p = result.prediction
    assert all(p.utilisation[m] <= 0.7 for m in ("small", "large"))
    assert result.gpus == sum(result.replicas.values())
    for m in ("small", "large"):  # one replica fewer of either misses a target
        fewer = {**result.replicas, m: result.replicas[m] - 1}
        if fewer[m] < 1:
            continue
        q = predict(CAPPED, fewer, load, ROWS)
        assert not q.stable or q.utilisation[m] > 0.7


def test_the_plans_ratio_follows_the_routing() -> None:
    """More escalation: more of the work is the large model's, and the plan's share of
    large replicas grows with it (the models are planned together)."""
    targets = Targets({"small": 0.7, "large": 0.7})
    shares = []
    for q in (0.15, 0.35, 0.6):
        result = plan(r2r(q), Load(20.0, 64), targets, ROWS)
        assert result.feasible
        shares.append(result.replicas["large"] / sum(result.replicas.values()))
    assert shares[0] < shares[1] < shares[2]


def test_a_tpot_target_adds_replicas_and_is_kept() -> None:
    profile = RoutingProfile(
        (
            ModelProfile("small", ((1, 2.0), (64, 6.0))),
            ModelProfile("large", ((1, 16.0), (64, 40.0))),
        ),
        ((0.65, 0.35), (1.0, 0.0)),
        ((1.0, 0.0), (1.0, 0.0)),
    )
    load = Load(40.0, 128)
    loose = plan(profile, load, Targets({"small": 0.9, "large": 0.9}))
    tight = plan(
        profile, load, Targets({"small": 0.9, "large": 0.9}, tpot_s=0.8 * loose.prediction.tpot_s)
    )
    assert tight.feasible and tight.prediction.tpot_s <= 0.8 * loose.prediction.tpot_s
    assert tight.gpus > loose.gpus


def test_bounds_and_gpus_per_replica_shape_the_plan() -> None:
    load = Load(20.0, 64)
    capped = plan(
        CAPPED, load, Targets({"small": 0.7, "large": 0.7}, max_replicas={"large": 2}), ROWS
    )
    assert not capped.feasible and capped.replicas["large"] == 2
    assert "max_replicas" in capped.reason
    floor = plan(
        CAPPED, load, Targets({"small": 0.7, "large": 0.7}, min_replicas={"small": 4}), ROWS
    )
    assert floor.replicas["small"] == 4
    costly = plan(
        CAPPED, load, Targets({"small": 0.7, "large": 0.7}, gpus_per_replica={"large": 2}), ROWS
    )
    assert costly.gpus == costly.replicas["small"] + 2 * costly.replicas["large"]
    with pytest.raises(ValueError, match="max_replicas"):
        plan(CAPPED, load, Targets({"small": 0.7, "large": 0.7}, min_replicas={"large": 3},
                                   max_replicas={"large": 2}), ROWS)  # fmt: skip
    with pytest.raises(ValueError, match="utilisation"):
        plan(CAPPED, load, Targets({"small": 0.7}), ROWS)
    with pytest.raises(ValueError, match="arrival_rate"):
        Load(-1.0, 64)


def test_transit_from_the_profile_slows_each_token_as_given_transit_does() -> None:
    """A profile's per-pair transit (the live tuner measures it) is the time an entry into
    a model spends between the models: the same prediction as that transit given alone."""
    base = paper_r2r()
    slow = RoutingProfile(base.models, base.route_prob, base.commit, base.grain_ms,
                          transit_ms=((0.0, 2.0), (2.0, 0.0)))  # fmt: skip
    given = closed_point(base, 8, transit_s=0.002)
    measured = closed_point(slow, 8)
    assert measured.throughput == pytest.approx(given.throughput)
    assert measured.throughput < closed_point(base, 8).throughput
