"""What the model replica and model server read of an engine, through its public surface:
``holds`` / ``get_request`` / ``request_ids`` / ``step_requests``, ``active_requests``,
``status()``, and the per-row facts a collected ``StepResult`` carries for the policy."""

from __future__ import annotations

import time

import pytest

from tokenrouter_ray.engine.outputs import EngineStatus
from tokenrouter_ray.engine.request import SamplingParams
from tokenrouter_ray.simulation.backend import sim_engine

GREEDY = SamplingParams(max_tokens=3, ignore_eos=True, seed=11)


def test_a_collected_step_carries_previous_tokens_first_flags_and_seeds() -> None:
    engine = sim_engine(lambda b: 0.0, num_blocks=64, block_size=4)
    engine.add_request("a", [5, 6, 7], GREEDY)
    engine.add_request("b", [9], SamplingParams(max_tokens=3, ignore_eos=True, seed=4))
    first = engine.execute()
    assert first.request_ids == ["a", "b"]
    assert first.prev_token_ids == [7, 9] and first.is_first == [True, True]
    assert first.seeds == [11, 4]
    assert [r.request_id for r in engine.step_requests(first)] == ["a", "b"]
    engine.commit(first)
    second = engine.execute()
    assert second.prev_token_ids == first.token_ids  # the tokens the first step appended
    assert second.is_first == [False, False]
    engine.commit(second)


def test_status_and_lookups_follow_the_lifecycle() -> None:
    engine = sim_engine(lambda b: 0.0, num_blocks=64, block_size=4)
    empty = engine.status()
    assert isinstance(empty, EngineStatus)
    assert (empty.requests, empty.kv_blocks_used, empty.kv_blocks_free) == (0, 0, 64)
    engine.add_request("a", [1, 2, 3, 4, 5], GREEDY)
    engine.add_request("b", [1, 2], GREEDY)
    assert engine.holds("a") and not engine.holds("zz") and engine.get_request("zz") is None
    assert engine.request_ids() == ["a", "b"] and engine.status().waiting == 2
    engine.commit(engine.execute())
    engine.pause("b")
    state = engine.status()
    assert (state.requests, state.running, state.pending) == (2, 1, 1)
    assert state.kv_blocks_used == 3 and state.kv_blocks_free == 61  # 5 + 2 tokens computed
    assert engine.request_ids(runnable_only=True) == ["a"]
    assert state.active_requests == engine.active_requests == 2
    engine.set_active_requests(7)
    assert engine.active_requests == 7 and engine.status().active_requests == 7
    engine.abort("a")
    engine.abort("b")
    assert not engine.holds("a") and engine.status().kv_blocks_used == 0


def test_injected_faults_fail_or_stall_the_next_steps_then_clear() -> None:
    engine = sim_engine(lambda b: 0.0, num_blocks=64, block_size=4)
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True, seed=1))
    engine.inject_fault("step", count=2)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="injected step failure"):
            engine.launch()
        engine.discard_uncommitted()
    engine.commit(engine.execute())  # the third step runs
    engine.inject_fault("stall", count=1, seconds=0.05)
    t0 = time.perf_counter()
    engine.commit(engine.execute())
    assert time.perf_counter() - t0 >= 0.05
    engine.inject_fault("step", count=5)
    engine.inject_fault("clear")
    engine.commit(engine.execute())  # cleared: no failure left
    assert engine.get_request("a").num_output_tokens == 3
    assert engine.device_stats is not None  # the simulated device counts its steps
    with pytest.raises(ValueError, match="unknown fault"):
        engine.inject_fault("melt")
