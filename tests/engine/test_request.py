"""A request owns its tokens, and the engine needs only a runner's narrow surface (no HF
model behind it): the ``Runner`` protocol (engine/runner.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tokenrouter_ray.engine.config import EngineConfig
from tokenrouter_ray.engine.engine import Engine
from tokenrouter_ray.engine.outputs import StepResult, StepTimings
from tokenrouter_ray.engine.request import Request, SamplingParams
from tokenrouter_ray.engine.runner import Runner
from tokenrouter_ray.engine.scheduler import SchedulerOutput


def test_request_methods_keep_tokens_and_computed_count_consistent() -> None:
    r = Request("r", [1, 2, 3, 4], SamplingParams(), arrival_time=0.0)
    r.advance_computed(4)
    r.append_tokens([5, 6])
    assert r.token_ids == [1, 2, 3, 4, 5, 6] and r.num_uncomputed_tokens == 2
    assert r.last_token_id == 6 and r.num_output_tokens == 2
    r.truncate(3)  # another model replaced what follows position 3
    assert r.token_ids == [1, 2, 3] and r.num_computed_tokens == 3
    r.keep_computed(1)  # KV past position 1 was freed
    assert r.num_computed_tokens == 1 and r.num_uncomputed_tokens == 2


class CountingRunner:
    """The narrow runner surface, with no model: samples ``7`` for every row."""

    vocab_size = 11
    eos_token_ids = frozenset({9})
    max_positions = 32
    stats = None

    def check_alive(self) -> None:
        pass

    def close(self) -> None:
        pass

    def launch(self, out: SchedulerOutput, timings: StepTimings) -> Callable[[], StepResult]:
        result = self.execute(out, timings)
        return lambda: result

    def __init__(self) -> None:
        self.keep_logits = self.keep_hidden = False

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        return torch.ones((*token_ids.shape, 4))  # (*ids, hidden)

    def execute(self, out: SchedulerOutput, timings: StepTimings) -> StepResult:
        rows = [c for c in out.chunks if c.samples]
        n = len(rows)
        logits = torch.zeros((n, self.vocab_size)) if self.keep_logits else None
        return StepResult(
            request_ids=[c.request.request_id for c in rows],
            sampled=torch.full((n,), 7),
            token_ids=[7] * n,
            positions=[c.request.num_tokens for c in rows],
            logits=logits,
            batch_size=len(out.chunks),
            timings=timings,
        )


def test_engine_runs_on_the_runner_surface_alone() -> None:
    runner = CountingRunner()
    assert isinstance(runner, Runner)
    engine = Engine(runner, EngineConfig(model="none", block_size=4), num_blocks=16)
    assert (engine.vocab_size, engine.eos_token_ids, engine.max_model_len) == (11, {9}, 32)
    engine.keep_outputs(logits=True)
    assert runner.keep_logits and not runner.keep_hidden
    assert engine.embed_tokens(torch.tensor([1, 2])).shape == (2, 4)
    with pytest.raises(ValueError, match="outside this model's vocabulary"):
        engine.add_request("bad", [11])
    assert engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3)) == [[7, 7, 7]]
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=8))
    engine.step()
    assert list(engine.sequence("r")) == [1, 2, 3, 7]


def test_a_request_without_a_seed_draws_one_seed_by_the_one_rule() -> None:
    from tokenrouter_ray.engine.request import SEED_BITS, Request, SamplingParams, draw_seed

    seeds = {draw_seed() for _ in range(64)}
    assert len(seeds) > 60 and all(0 <= s < 1 << SEED_BITS for s in seeds)
    drawn = Request("r", [1, 2], SamplingParams(), arrival_time=0.0)
    given = Request("g", [1, 2], SamplingParams(seed=7), arrival_time=0.0)
    assert 0 <= drawn.seed < 1 << SEED_BITS and given.seed == 7
