"""The ``Runner`` protocol (engine/runner.py): the engine's three runners implement it, and a
fault is a ``FaultyRunner`` wrapped around the real runner, never a patched method."""

from __future__ import annotations

import time

import pytest

from tests.engine.conftest import make_engine
from tokenrouter_ray.engine.model_runner import ModelRunner
from tokenrouter_ray.engine.request import SamplingParams
from tokenrouter_ray.engine.runner import FaultyRunner, Runner
from tokenrouter_ray.engine.tensor_parallel import TensorParallelRunner
from tokenrouter_ray.simulation.backend import SimRunner, sim_engine

MEMBERS = {*Runner.__annotations__, *(n for n in vars(Runner) if not n.startswith("_"))}


def test_the_protocol_names_what_the_engine_uses() -> None:
    assert {
        "launch", "execute", "check_alive", "close", "stats", "embed_tokens",
        "vocab_size", "eos_token_ids", "max_positions", "keep_logits", "keep_hidden",
    } <= MEMBERS  # fmt: skip


def test_the_three_runners_implement_it(tiny_llama_dir: str) -> None:
    model_runner = make_engine(tiny_llama_dir).runner
    sim_runner = sim_engine(lambda b: 0.0).runner
    assert isinstance(model_runner, ModelRunner) and isinstance(model_runner, Runner)
    assert isinstance(sim_runner, SimRunner) and isinstance(sim_runner, Runner)
    assert model_runner.stats is None and sim_runner.stats is not None
    # the tensor-parallel runner is rank 0's ModelRunner with its own launch, check and close
    for name in ("launch", "check_alive", "close"):
        assert name in vars(TensorParallelRunner)
    assert issubclass(TensorParallelRunner, ModelRunner)
    assert isinstance(FaultyRunner(sim_runner, "step"), Runner)


def test_an_injected_fault_wraps_the_runner_and_clear_unwraps_it(tiny_llama_dir: str) -> None:
    engine = make_engine(tiny_llama_dir)
    real = engine.runner
    sp = SamplingParams(max_tokens=4)
    want = engine.generate([[1, 2, 3]], sp)
    engine.inject_fault("step", count=2)
    engine.inject_fault("step", count=2)  # a second fault replaces the first
    assert isinstance(engine.runner, FaultyRunner) and engine.runner.inner is real
    engine.add_request("r", [1, 2, 3], sp)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="injected step failure"):
            engine.step()
        engine.discard_uncommitted()
    assert engine.runner.vocab_size == real.vocab_size  # the rest is the real runner's
    engine.abort("r")
    assert engine.generate([[1, 2, 3]], sp) == want  # spent: every launch passes through
    engine.inject_fault("stall", count=1, seconds=0.2)
    t0 = time.perf_counter()
    assert engine.generate([[1, 2, 3]], sp) == want
    assert time.perf_counter() - t0 >= 0.2
    engine.inject_fault("clear")
    assert engine.runner is real
    with pytest.raises(ValueError, match="unknown fault"):
        engine.inject_fault("melt")
