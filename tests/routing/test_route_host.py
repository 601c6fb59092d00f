"""A policy's host path (``route_host``) gives the same destinations as its device path
(``route``), row for row, at every batch size (both of bernoulli's draw paths) and at both
models, and ``decide`` gives them by either path; ``RouteBatch.of_step`` moves a per-row
field to the device only when read."""

from __future__ import annotations

import random

import pytest
import torch

from tokenrouter_ray.engine.outputs import StepResult
from tokenrouter_ray.routing.baselines import SCALAR_ROWS
from tokenrouter_ray.routing.policy import EscalateOnce, RouteBatch, build_policy, decide

VOCAB = 11


def _batch(model: int, size: int, rng: random.Random) -> RouteBatch:
    positions = [rng.randrange(0, 1 << 20) for _ in range(size)]
    step = StepResult(
        request_ids=[f"r{i}" for i in range(size)],
        sampled=torch.tensor([rng.randrange(VOCAB) for _ in range(size)], dtype=torch.long),
        token_ids=[0] * size,
        positions=positions,
        logits=torch.randn(size, VOCAB, dtype=torch.float64),
    )
    return RouteBatch.of_step(
        model,
        step,
        prev_tokens=[rng.randrange(VOCAB) for _ in range(size)],
        is_first=[rng.random() < 0.2 for _ in range(size)],
        seeds=[rng.getrandbits(62) for _ in range(size)],
    )


@pytest.mark.parametrize(
    "name,options",
    [
        ("bernoulli", {"p": 0.35}),
        ("bernoulli", {"p": 0.9}),
        ("never", {}),
        ("always", {}),
        ("entropy", {"threshold": 0.5}),
    ],
)
def test_host_route_equals_device_route(name: str, options: dict) -> None:
    policy = build_policy(name, options, ["small", "large"])
    rng = random.Random(name + str(options))
    hosted = 0
    for size in (1, 2, SCALAR_ROWS, SCALAR_ROWS + 1, 64):
        for model in (0, 1):
            for _ in range(5):
                batch = _batch(model, size, rng)
                host = policy.route_host(batch)
                with torch.inference_mode():
                    device = policy.route(batch).tolist()
                if host is not None:
                    hosted += 1
                    assert host == device, (name, size, model)
                assert decide(policy, batch) == device
                assert decide(policy, batch, host=False) == device
    # the large model of an escalate-once policy never needs the device
    assert hosted >= 25


def test_a_policy_routing_its_own_way_keeps_the_device_path() -> None:
    class Custom(EscalateOnce):
        name = "custom-test"

        def escalate(self, batch: RouteBatch) -> torch.Tensor:
            return batch.prev_tokens > 5

        def route(self, batch: RouteBatch) -> torch.Tensor:
            return torch.ones(batch.size, dtype=torch.long)

    policy = Custom(Custom.Config(), ["small", "large"])
    batch = _batch(1, 4, random.Random(3))
    assert policy.route_host(batch) is None
    assert decide(policy, batch) == [1, 1, 1, 1]


def test_of_step_moves_a_field_to_the_device_only_when_read() -> None:
    batch = _batch(0, 3, random.Random(5))
    assert not hasattr(batch.__dict__["_prev_tokens"], "device")  # still the host list
    assert batch.host_positions == batch.step.positions
    prev = list(batch.__dict__["_prev_tokens"])
    tensor = batch.prev_tokens
    assert isinstance(tensor, torch.Tensor) and tensor.tolist() == prev
    assert batch.prev_tokens is tensor  # moved once
    assert batch.positions.tolist() == batch.step.positions
    with pytest.raises(TypeError):
        RouteBatch(model=0, step=batch.step)  # the per-row fields have no default


def test_a_host_only_step_builds_its_sampled_tensor_only_when_read() -> None:
    """A runner with its tokens on the host (the simulated device) passes ``sampled=None``:
    a policy that routes on the host never builds the tensor; one that reads it (the device
    path, here the same draws) gets the step's tokens, built once."""
    rng = random.Random(9)
    policy = build_policy("bernoulli", {"p": 0.5}, ["small", "large"])
    for size in (3, SCALAR_ROWS + 5):
        tokens = [rng.randrange(VOCAB) for _ in range(size)]
        step = StepResult([f"r{i}" for i in range(size)], None, tokens, list(range(size)))
        batch = RouteBatch.of_step(
            0, step, prev_tokens=[0] * size, is_first=[False] * size, seeds=list(range(size))
        )
        host = decide(policy, batch)
        assert step.__dict__["_sampled"] is None  # routed without it
        with torch.inference_mode():
            assert policy.route(batch).tolist() == host  # reads the device: built now
        sampled = step.sampled
        assert sampled.dtype == torch.long and sampled.tolist() == tokens
        assert step.sampled is sampled
    given = torch.tensor([4, 2])
    assert StepResult(["a", "b"], given, [4, 2], [0, 0]).sampled is given
    with pytest.raises(TypeError):
        StepResult(["a"])  # sampled, token_ids and positions stay required
