"""The live replica plan: the offered load read from the replicas'
windows, the plan the tuner makes from them for every model together, what it answers
each model, and when a plan stops counting (the statistics stopped)."""

from __future__ import annotations

import pytest

from tokenrouter_ray.app_config import compose_config
from tokenrouter_ray.replica.window import WindowSnapshot, WindowStats
from tokenrouter_ray.tuning.capacity import Load, plan
from tokenrouter_ray.tuning.profile import ModelProfile, RoutingProfile
from tokenrouter_ray.tuning.scaling import ReplicaPlanner, ScalingSpec, offered_load
from tokenrouter_ray.tuning.tuner import TunerCore

SIM = ["models=sim_paper", "policy=bernoulli"]
SCALED = [
    *SIM,
    "models.small.autoscaling.max_replicas=4",
    "models.large.autoscaling.max_replicas=8",
    "scheduler.max_num_seqs=8",
    "models.large.scheduler.max_num_seqs=4",
]


def traffic(
    window: WindowStats, model: str, q: float, steps: int, rows: int, step_s: float, now: float
) -> None:
    """``steps`` steps of ``rows`` rows on ``model`` in a window: R2R's moves."""
    for k in range(steps):
        t = now + k * 0.01
        window.record_step(rows, step_s, t, active=rows)
        for r in range(rows):
            if model == "small":
                dst = "large" if (k * rows + r) % round(1 / q) == 0 else "small"
                window.record_move("small", dst, int(dst == "small"), t)
            else:
                window.record_move("large", "small", 1, t)


def test_offered_load_is_arrivals_over_the_span_and_mean_output_length() -> None:
    entry, other = WindowStats(window_s=10), WindowStats(window_s=10)
    for k in range(50):  # 50 arrivals over 10 s, 40 of them finished with 64 tokens
        entry.record_arrival(12, now=100.0 + 0.2 * k)
        if k < 20:
            entry.record_finish(64, now=100.0 + 0.2 * k)
        elif k < 40:
            other.record_finish(64, now=100.0 + 0.2 * k)
    windows = {"small": entry.snapshot(now=110.0), "large": other.snapshot(now=110.0)}
    load = offered_load(windows, "small")
    assert load == Load(arrival_rate=5.0, output_tokens=64.0, prompt_tokens=12.0)
    assert offered_load({"small": WindowSnapshot()}, "small") is None  # nothing seen yet
    few = WindowStats(window_s=10)
    few.record_arrival(1, now=100.0)
    few.record_finish(8, now=100.0)
    assert offered_load({"small": few.snapshot(now=101.0)}, "small") is None  # one finish


def test_the_spec_comes_from_the_models_autoscaling() -> None:
    assert ScalingSpec.of(compose_config(SIM)) is None  # nothing autoscales
    spec = ScalingSpec.of(compose_config([*SCALED, "models.large.num_gpus=2"]))
    assert spec.models == ("small", "large")
    assert spec.max_rows == {"small": 8, "large": 4}
    assert spec.targets.max_replicas == {"small": 4, "large": 8}
    assert spec.targets.gpus_per_replica == {"small": 1.0, "large": 2.0}
    fixed = ScalingSpec.of(compose_config([*SIM, "models.large.autoscaling.max_replicas=3"]))
    assert fixed.targets.min_replicas["small"] == fixed.targets.max_replicas["small"] == 1


def test_the_tuner_plans_every_model_from_its_windows() -> None:
    """Windows of R2R traffic at 20 requests/s of 64 tokens: the tuner's plan is what the
    capacity model plans for that load and the routing the windows show, it answers each
    model its count, and a plan older than three periods no longer counts."""
    cfg = compose_config([*SCALED, "tuner.min_moves=10"])
    spec = ScalingSpec.of(cfg)
    clock = [1000.0]
    core = TunerCore(cfg.model_names, cfg.tuner, planner=ReplicaPlanner(spec),
                     clock=lambda: clock[0])  # fmt: skip
    small, large = WindowStats(window_s=10), WindowStats(window_s=10)
    now = 990.0
    traffic(small, "small", 0.25, 200, 4, 0.006, now)
    traffic(large, "large", 0.25, 100, 2, 0.0279, now)
    for k in range(200):
        small.record_arrival(8, now=now + 0.05 * k)
        small.record_finish(64, now=now + 0.05 * k)
    core.report("small", "s0", small.snapshot(now=1000.0))
    core.report("large", "l0", large.snapshot(now=1000.0))
    assert core.planned("small") is None  # nothing planned yet
    decision = core.step()
    assert decision.plan is not None
    profile = core.profile
    want = plan(
        profile, Load(20.0, 64.0, 8.0), spec.targets, spec.max_rows
    )  # the same model, the same inputs
    assert decision.plan.replicas == want.replicas
    assert decision.plan.arrival_rate == pytest.approx(20.0)
    assert core.planned("large") == want.replicas["large"] > core.planned("small") >= 1
    assert core.snapshot().to_json()["plan"]["replicas"] == want.replicas
    clock[0] += 3 * cfg.tuner.period_s + 1
    assert core.planned("large") is None  # stale: the replicas' own load decides


def test_a_model_without_autoscaling_keeps_its_count_in_the_plan() -> None:
    profile = RoutingProfile(
        (ModelProfile.constant("small", 6.0, 8), ModelProfile.constant("large", 27.9, 4)),
        ((0.65, 0.35), (1.0, 0.0)),
        ((1.0, 0.0), (1.0, 0.0)),
    )
    spec = ScalingSpec.of(compose_config([*SIM, "models.large.autoscaling.max_replicas=9"]))
    small = WindowStats(window_s=10)
    for k in range(100):
        small.record_arrival(4, now=100.0 + 0.1 * k)
        small.record_finish(32, now=100.0 + 0.1 * k)
    result = ReplicaPlanner(spec).plan(profile, {"small": small.snapshot(now=110.0)})
    assert result.replicas["small"] == 1 and 1 <= result.replicas["large"] <= 9
    assert ReplicaPlanner(spec).plan(None, {"small": small.snapshot(now=110.0)}) is None
