"""Autoscaling's config and policies without a cluster: the config keys
map onto Serve's own ``AutoscalingConfig`` (validated by Serve's model, the policy
importable and built with its kwargs as Serve's controller does), and the policies follow
the plan, or the replicas' load when no plan is fresh."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from ray.serve.config import AutoscalingConfig

from deployments.app import ingress_options, model_options
from deployments.autoscaling import IngressPolicy, ModelPolicy
from tokenrouter_ray.app_config import compose_config
from tokenrouter_ray.config import ConfigError

SIM = ["models=sim_paper", "policy=bernoulli"]


def ctx(metrics: dict[str, dict[str, float]], target: int = 2) -> Any:
    """The part of Serve's ``AutoscalingContext`` the policies read."""
    return SimpleNamespace(aggregated_metrics=metrics, target_num_replicas=target)


def built(options: dict[str, Any]) -> tuple[AutoscalingConfig, Any]:
    """Serve's config from the options, and the policy as the controller instantiates it."""
    config = AutoscalingConfig(**options["autoscaling_config"])
    cls = config.policy.get_policy()
    return config, cls(**config.policy.policy_kwargs)


def test_model_autoscaling_maps_onto_serves_config() -> None:
    cfg = compose_config(
        [
            *SIM,
            "models.large.autoscaling.min_replicas=2",
            "models.large.autoscaling.max_replicas=6",
            "models.large.autoscaling.target_utilisation=0.5",
            "models.large.autoscaling.downscale_delay_s=12",
        ]
    )
    options = model_options("large", cfg.models["large"])
    assert "num_replicas" not in options  # Serve refuses both
    config, policy = built(options)
    assert (config.min_replicas, config.max_replicas, config.initial_replicas) == (2, 6, 2)
    assert config.downscale_delay_s == 12
    assert isinstance(policy, ModelPolicy) and policy.target == 0.5
    fixed = model_options("small", cfg.models["small"])
    assert fixed["num_replicas"] == 1 and "autoscaling_config" not in fixed
    # a replica being stopped drains first: Serve's graceful shutdown leaves it the time
    assert options["graceful_shutdown_timeout_s"] > cfg.models["large"].drain_timeout_s


def test_ingress_autoscaling_maps_onto_serves_config() -> None:
    cfg = compose_config([*SIM, "+ingress.autoscaling.max_replicas=3"])
    options = ingress_options(cfg)
    config, policy = built(options)
    assert config.max_replicas == 3 and isinstance(policy, IngressPolicy)
    assert options["graceful_shutdown_timeout_s"] > cfg.ingress.request_timeout_s


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["models.large.num_replicas=2", "models.large.autoscaling.max_replicas=3"],
            "num_replicas or autoscaling",
        ),
        (
            ["models.large.autoscaling.min_replicas=4", "models.large.autoscaling.max_replicas=3"],
            "max_replicas .3. is below min_replicas .4.",
        ),
        (["models.large.autoscaling.min_replicas=0"], "min_replicas"),
        (
            [
                "models.large.autoscaling.max_replicas=3",
                "models.large.autoscaling.initial_replicas=5",
            ],
            "initial_replicas",
        ),
        (
            ["models.large.autoscaling.max_replicas=3", "models.large.autoscaling.bogus=1"],
            "bogus",
        ),
    ],
)
def test_bad_autoscaling_is_one_clear_error(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        compose_config([*SIM, *overrides])


def test_the_deadlock_check_holds_at_the_most_replicas() -> None:
    """Thresholds must be deadlock-free at any count the autoscaler may set."""
    base = [*SIM, "models.large.scheduler.batch_thresholds=[1,1,1,2]"]
    compose_config([*base, "models.large.autoscaling.max_replicas=2"])
    with pytest.raises(ConfigError, match="deadlock at 3 active requests"):
        compose_config([*base, "models.large.autoscaling.max_replicas=3"])


def test_the_model_policy_follows_the_plan() -> None:
    policy = ModelPolicy(0.7)
    planned = {"planned_replicas": {"r1": 3.0, "r2": 2.4}, "utilisation": {"r1": 0.1, "r2": 0.1}}
    assert policy(ctx(planned)) == (3, {"source": "plan"})  # the newest (largest) wins
    fewer = {"planned_replicas": {"r1": 1.0, "r2": 1.0}, "utilisation": {"r1": 0.3, "r2": 0.2}}
    assert policy(ctx(fewer)) == (1, {"source": "plan"})  # down, as planned


def test_a_saturated_model_scales_past_a_plan_that_undercounts() -> None:
    """Replicas at their row cap while the plan (solved from admitted arrivals) says no
    more: their load decides."""
    policy = ModelPolicy(0.7)
    full = {"planned_replicas": {"r1": 2.0, "r2": 2.0}, "utilisation": {"r1": 1.0, "r2": 1.0}}
    assert policy(ctx(full)) == (3, {"source": "utilisation"})  # 2 / 0.7 -> 3


def test_without_a_plan_the_model_policy_scales_on_load() -> None:
    policy = ModelPolicy(0.5)
    busy = {"planned_replicas": {"r1": 0.0, "r2": 0.0}, "utilisation": {"r1": 0.9, "r2": 0.8}}
    assert policy(ctx(busy)) == (4, {"source": "utilisation"})  # 1.7 / 0.5 -> 4
    idle = {"planned_replicas": {"r1": 0.0}, "utilisation": {"r1": 0.0}}
    assert policy(ctx(idle))[0] == 1
    assert policy(ctx({}, target=3))[0] == 3  # no report yet: stay


def test_the_ingress_policy_scales_on_active_requests() -> None:
    policy = IngressPolicy(0.5)
    assert policy(ctx({"utilisation": {"a": 0.9, "b": 0.6}}))[0] == 3
    assert policy(ctx({"utilisation": {"a": 0.1}}))[0] == 1
