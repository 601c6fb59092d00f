"""The frontier's arithmetic (``tokenrouter_ray/quality/frontier.py``): routing counts to the
Markov profile they imply, the throughput predicted for it, Pareto marking and the choice a
target makes; and the simulated runtime agrees with a point's prediction."""

from __future__ import annotations

import pytest

from tokenrouter_ray.quality.calibrate import escalate_once
from tokenrouter_ray.quality.frontier import (
    FrontierPoint,
    RoutingCounts,
    choose,
    induced_profile,
    mark_pareto,
    plot_frontier,
    predict_throughput,
)
from tokenrouter_ray.simulation.served import profile_models
from tokenrouter_ray.tuning.markov import throughput

PAPER = profile_models("paper")


def test_counts_of_an_escalate_once_response() -> None:
    # 10 tokens: 7 by the small model, 3 by the large one, 3 escalations and 3 returns,
    # each escalation dropped the small model's proposal (R2R)
    counts = RoutingCounts.of_response([7, 3], handoffs=6, dropped=3)
    assert (counts.to_large, counts.to_small) == (3, 3)
    assert counts.large_share == pytest.approx(0.3)
    # an odd count ends on the large model: one more move up than down
    odd = RoutingCounts.of_response([7, 3], handoffs=5, dropped=3)
    assert (odd.to_large, odd.to_small) == (3, 2)
    both = counts + odd
    assert (both.small_tokens, both.large_tokens, both.dropped) == (14, 6, 6)


def test_the_induced_profile_is_the_routing_the_counts_describe() -> None:
    counts = RoutingCounts(small_tokens=65, large_tokens=35, to_large=35, to_small=35, dropped=35)
    profile = induced_profile(counts, PAPER)
    # the small model ran 65 + 35 steps, 35 of them escalated; the large model always returns
    assert profile.route_prob[0][1] == pytest.approx(0.35)
    assert profile.route_prob[1][0] == pytest.approx(1.0)
    assert profile.commit[0][1] == pytest.approx(0.0)  # the proposal was dropped
    # the same routing written by hand predicts the same throughput
    by_hand = escalate_once(0.35, PAPER)
    assert throughput(profile, 8, (1, 3)).throughput == pytest.approx(
        throughput(by_hand, 8, (1, 3)).throughput, rel=1e-6
    )
    # a stretch policy (R-Stitch): the large model keeps 3 of every 4 steps, tokens kept
    stretch = induced_profile(
        RoutingCounts(small_tokens=60, large_tokens=40, to_large=10, to_small=10), PAPER
    )
    assert stretch.route_prob[1][0] == pytest.approx(0.25)
    assert stretch.commit[0][1] == pytest.approx(1.0)


def test_more_escalation_predicts_less_throughput() -> None:
    low = predict_throughput(escalate_once(0.1, PAPER), 16)
    high = predict_throughput(escalate_once(0.5, PAPER), 16)
    assert low.tokens_per_s > high.tokens_per_s > 0
    assert low.thresholds["small"] == 1 and 1 <= high.thresholds["large"] <= 16


def point(threshold: float, accuracy: float, share: float) -> FrontierPoint:
    return FrontierPoint(threshold, 100, round(100 * accuracy), accuracy, (0.0, 1.0), share, 0.0,
                         {})  # fmt: skip


def test_pareto_points_and_targets() -> None:
    points = [
        point(0.9, 0.10, 0.05),
        point(0.5, 0.30, 0.20),
        point(0.4, 0.25, 0.30),  # dominated by 0.5: less accurate with more large tokens
        point(0.2, 0.70, 0.45),
        point(0.05, 0.80, 0.90),
    ]
    front = mark_pareto(points)
    assert [p.threshold for p in front] == [0.9, 0.5, 0.2, 0.05]
    assert not points[2].pareto
    # fewest large tokens keeping 85 % of a large model that scores 0.8 (>= 0.68)
    assert choose(points, 0.8, min_accuracy_of_large=0.85).threshold == 0.2
    assert choose(points, 0.8, min_accuracy_of_large=0.99).threshold == 0.05
    assert choose(points, 0.8, min_accuracy_of_large=1.1) is None
    assert choose(points, max_large_share=0.3).threshold == 0.5
    assert choose(points, max_large_share=0.01) is None
    assert choose(points).threshold == 0.05  # no target: the most accurate
    with pytest.raises(ValueError, match="large model's accuracy"):
        choose(points, None, min_accuracy_of_large=0.9)


def test_the_frontier_is_drawn(tmp_path) -> None:
    points = [point(0.5, 0.3, 0.2), point(0.1, 0.7, 0.5)]
    mark_pareto(points)
    out = plot_frontier(points, tmp_path / "f.png", "test", {"large alone": 0.8}, points[1])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000


def test_check_sim_runs_each_point_at_each_step_time_scale() -> None:
    """``--check-sim``: the Pareto point first, one row per step-time scale, each against
    the prediction for that point's induced routing (speed is the benchmark's to judge)."""
    from tokenrouter_ray.quality.calibrate import check_sim
    from tokenrouter_ray.quality.frontier import FrontierPoint, predict_throughput

    steps = profile_models("paper")
    points = [
        FrontierPoint(t, 10, 5, 0.5, (0.2, 0.8), q, 1.0, {"small->large": q, "large->small": 1.0})
        for t, q in ((0.2, 0.6), (0.1, 0.8))
    ]
    for p in points:
        p.predicted = predict_throughput(escalate_once(p.route_prob["small->large"], steps), 4)
    points[1].pareto = True
    rows = check_sim(points, steps, 4, 1, time_scales=(1.0, 2.0), window_s=0.5)
    assert [(r["threshold"], r["time_scale"]) for r in rows] == [(0.1, 1.0), (0.1, 2.0)]
    want = predict_throughput(escalate_once(0.8, steps), 4).tokens_per_s
    for r in rows:
        assert r["predicted_tok_s"] == pytest.approx(want)
        assert r["measured_tok_s"] > 0 and r["ratio"] == r["measured_tok_s"] / want


@pytest.mark.parametrize(
    ("dev_correct", "test_correct", "holds"),
    [(30, 28, True), (30, 12, False), (12, 30, False)],
)
def test_the_choice_holds_when_its_dev_accuracy_lies_in_the_test_splits_interval(
    dev_correct, test_correct, holds
) -> None:
    """calibrate's verdict on the test split: the chosen point "holds" when the accuracy it
    was chosen at (dev) lies inside the test split's Wilson 95 % interval, both ways; it is
    printed as the verdict line."""
    from tokenrouter_ray.quality.calibrate import _holds, format_choice
    from tokenrouter_ray.quality.frontier import FrontierPoint
    from tokenrouter_ray.quality.stats import wilson_interval

    def point(correct: int) -> FrontierPoint:
        return FrontierPoint(0.3, 40, correct, correct / 40, wilson_interval(correct, 40),
                             0.5, 1.0, {"small->large": 0.3, "large->small": 1.0})  # fmt: skip

    dev, test = point(dev_correct), point(test_correct)
    assert _holds(dev, test) is holds
    chosen = {"holds": holds, "override": {"config": "policy.options.threshold=0.3",
              "request": {"routing": {"threshold": 0.3}}}}  # fmt: skip
    verdict = format_choice(chosen, dev, test, None)
    assert ("yes" if holds else "NO") in verdict
