"""Per-request routing thresholds in a batch: ``RouteBatch.thresholds`` is the
configured float when no row overrides (no tensor, no copy), else one threshold per row;
``row_threshold`` picks a request's value per escalation level; bernoulli's host path and
device path agree with overrides; how many thresholds each policy takes is declared once
(routing/__init__.py ``THRESHOLDS``), and both a built policy and the ingress's
``PolicySpec`` read it."""

from __future__ import annotations

import math
import random

import pytest
import torch

from tokenrouter_ray.config import PolicySpec
from tokenrouter_ray.engine.outputs import StepResult
from tokenrouter_ray.routing import THRESHOLDS, load_builtin_policies, threshold_levels
from tokenrouter_ray.routing.baselines import SCALAR_ROWS
from tokenrouter_ray.routing.policy import (
    POLICIES,
    Policy,
    RouteBatch,
    build_policy,
    row_threshold,
    threshold_overrides,
)

VOCAB = 11


def _batch(size: int, overrides: list[float] | None, rng: random.Random) -> RouteBatch:
    step = StepResult(
        request_ids=[f"r{i}" for i in range(size)],
        sampled=torch.zeros(size, dtype=torch.long),
        token_ids=[0] * size,
        positions=[rng.randrange(1 << 20) for _ in range(size)],
        logits=torch.randn(size, VOCAB, dtype=torch.float64),
    )
    return RouteBatch.of_step(
        0,
        step,
        prev_tokens=[0] * size,
        is_first=[False] * size,
        seeds=[rng.getrandbits(62) for _ in range(size)],
        threshold_overrides=overrides,
    )


def test_no_override_is_the_configured_float_and_no_tensor() -> None:
    batch = _batch(4, None, random.Random(0))
    assert batch.thresholds(0.3) == 0.3 and isinstance(batch.thresholds(0.3), float)
    assert batch.host_thresholds(0.3) == 0.3
    assert batch.threshold_overrides is None  # nothing was made


def test_overrides_replace_the_configured_value_per_row() -> None:
    batch = _batch(3, [math.nan, 0.0, 1.0], random.Random(0))
    assert batch.host_thresholds(0.3) == [0.3, 0.0, 1.0]
    assert isinstance(batch.threshold_overrides, list)  # still on the host
    got = batch.thresholds(0.3, torch.float32)
    assert got.dtype == torch.float32 and got.tolist() == pytest.approx([0.3, 0.0, 1.0])
    assert batch.host_thresholds(0.3) == pytest.approx([0.3, 0.0, 1.0])  # from the tensor


def test_row_threshold_per_level() -> None:
    assert math.isnan(row_threshold((), 0))
    assert row_threshold((0.2,), 0) == row_threshold((0.2,), 2) == 0.2
    assert [row_threshold((0.1, 0.7), m) for m in range(3)] == [0.1, 0.7, 0.7]
    assert threshold_overrides([(), ()], 0) is None
    got = threshold_overrides([(), (0.1, 0.7)], 1)
    assert math.isnan(got[0]) and got[1] == 0.7


@pytest.mark.parametrize("size", [1, SCALAR_ROWS, SCALAR_ROWS + 1, 64])
def test_bernoulli_host_path_equals_device_path_with_overrides(size: int) -> None:
    policy = build_policy("bernoulli", {"p": 0.35}, ["small", "large"])
    rng = random.Random(size)
    for _ in range(5):
        overrides = [rng.choice([math.nan, 0.0, 1.0, rng.random()]) for _ in range(size)]
        batch = _batch(size, overrides, rng)
        host = policy.route_host(batch)
        with torch.inference_mode():
            device = policy.route(batch).tolist()  # reads the overrides' tensor
        assert host == device
        for row, p in enumerate(overrides):
            if p in (0.0, 1.0):
                assert host[row] == int(p)  # p = 0 never escalates, p = 1 always


def test_threshold_levels_are_declared_once() -> None:
    load_builtin_policies()
    assert set(THRESHOLDS) <= set(POLICIES)  # it names registered policies only
    takes = {name: threshold_levels(name, 4) for name in POLICIES}
    assert takes == {
        name: {"never": 0, "always": 0, "escalation": 3}.get(name, 1) for name in POLICIES
    }
    # no policy class says it again: the base class's property reads the declaration
    assert [name for name, cls in POLICIES.items() if "threshold_levels" in vars(cls)] == []
    assert "threshold_levels" in vars(Policy)
    escalation = build_policy("escalation", {"thresholds": [0.3, 0.4]}, ["s", "m", "l"])
    assert escalation.threshold_levels == 2 == PolicySpec(name="escalation").threshold_levels(3)
    never = build_policy("never", {}, ["s", "l"])
    assert never.threshold_levels == 0 == PolicySpec(name="never").threshold_levels(2)
