"""Tensor parallelism on CPU: a tiny Qwen3 split over two real ranks (a spawned worker
process, gloo all-reduces) gives the same greedy tokens, logits and hidden states as the
same checkpoint on one rank, through batching, chunked prefill, pauses, extends after a
handoff and KV rollback; bad head counts fail before anything starts; a dead worker fails
the health check and the next step raises instead of hanging.

One TP=2 engine serves the whole module (starting a worker costs seconds); the failure test
runs last and kills its worker."""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.engine.conftest import make_engine
from tests.tiny_models import save_tiny
from tokenrouter_ray.config import ModelSpec
from tokenrouter_ray.engine.engine import Engine
from tokenrouter_ray.engine.model_runner import ModelRunner, model_footprint
from tokenrouter_ray.engine.outputs import StepTimings
from tokenrouter_ray.engine.request import SamplingParams
from tokenrouter_ray.engine.tensor_parallel import (
    TensorParallelRunner,
    decode_step,
    encode_step,
    tp_footprint,
)
from tokenrouter_ray.errors import ModelLoadError


def save_qwen3(path: Path, **overrides: object) -> str:
    return save_tiny(path, "qwen3", 0, **overrides)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    # 4 heads, 2 KV heads; tied embeddings: the plan's sharded lm_head shares its table
    return save_qwen3(tmp_path_factory.mktemp("tp_qwen3"), tie_word_embeddings=True)


@pytest.fixture(scope="module")
def engines(qwen3_dir: str) -> Iterator[tuple[Engine, Engine]]:
    """(TP=1, TP=2) engines of one checkpoint; TP=2 decodes on the static (bucketed) path,
    so both forward paths run sharded."""
    opts = dict(keep_logits=True, keep_hidden=True, max_num_batched_tokens=24)
    one = make_engine(qwen3_dir, **opts)
    two = make_engine(
        qwen3_dir, tensor_parallel=2, static_batches=True, collective_timeout_s=20, **opts
    )
    yield one, two
    two.close()


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(128) for _ in range(n)] for n in lengths]


def lockstep(one: Engine, two: Engine, produced: dict[str, list[int]], steps: int) -> int:
    """Step both engines together; every step must sample the same tokens with the same
    logits and hidden states. Returns the number of steps run."""
    ran = 0
    for _ in range(steps):
        a, b = one.execute(now=float("inf")), two.execute(now=float("inf"))
        if a is None and b is None:
            break
        assert a is not None and b is not None
        assert a.request_ids == b.request_ids and a.token_ids == b.token_ids
        torch.testing.assert_close(b.logits, a.logits, rtol=0, atol=1e-9)
        torch.testing.assert_close(b.hidden, a.hidden, rtol=0, atol=1e-9)
        one.commit(a)
        for out in two.commit(b):
            produced.setdefault(out.request_id, []).extend(out.new_token_ids)
        ran += 1
    return ran


def test_step_frame_round_trips() -> None:
    seqs = [(0, [5, 6, 7], [3, 9], False), (12, [4], [1, 2, 8, 11], True)]
    frame = encode_step(seqs)
    assert decode_step(frame) == seqs
    assert len(frame) == 8 * (2 + 4 * 2 + 4 + 6)  # header, per-sequence meta, tokens, blocks


def test_ranks_hold_half_the_kv_heads_and_agree_on_blocks(engines) -> None:
    one, two = engines
    assert one.runner.kv.num_kv_heads == 2 and two.runner.kv.num_kv_heads == 1
    assert two.kv.pool.num_blocks == one.kv.pool.num_blocks
    q_proj = two.runner.model.model.layers[0].self_attn.q_proj.weight
    assert q_proj.to_local().shape == (32, 64)  # 2 of 4 heads x head_dim 16
    two.check_health()
    # Memory planning counts what one rank holds: half the KV per token, and its shards of
    # the weights (plus the replicated embeddings and norms).
    full, rank = model_footprint(one.runner.model), tp_footprint(two.runner.model, 2)
    assert rank.kv_bytes_per_token * 2 == full.kv_bytes_per_token
    assert full.weight_bytes / 2 < rank.weight_bytes < full.weight_bytes


def test_rank0_embeds_ids_alone(engines) -> None:
    """A policy (R2R's router) embeds sampled ids on rank 0 only, outside any step: no
    collective may hide in that lookup (it would time out here)."""
    one, two = engines
    ids = torch.tensor([1, 64, 127])
    with torch.inference_mode():
        got = two.runner.model.get_input_embeddings()(ids)
        want = one.runner.model.get_input_embeddings()(ids)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_batched_greedy_tokens_and_logits_match_one_rank(engines) -> None:
    """Two waves of requests, prefills chunked beside decodes: same tokens and logits."""
    one, two = engines
    prompts = prompts_of([3, 40, 11, 1, 25, 8, 17, 30], seed=1)
    produced: dict[str, list[int]] = {}
    for i, p in enumerate(prompts[:4]):
        for engine in engines:
            engine.add_request(f"w{i}", p, SamplingParams(max_tokens=10))
    lockstep(one, two, produced, steps=2)
    for i, p in enumerate(prompts[4:], start=4):
        for engine in engines:
            engine.add_request(f"w{i}", p, SamplingParams(max_tokens=10))
    lockstep(one, two, produced, steps=200)
    assert all(len(produced[f"w{i}"]) == 10 for i in range(8))
    assert not one.requests and not two.requests
    assert two.runner.static_steps > 0  # decodes took the bucketed path on both ranks
    assert two.kv.pool.num_free_blocks == two.kv.pool.num_blocks


def test_extend_after_handoff_and_kv_rollback_match_one_rank(engines) -> None:
    """Pause (handoff away), resume with a rolled-back anchor and another model's tokens,
    twice, while a neighbour keeps decoding: every step still matches one rank."""
    one, two = engines
    prompt, other, extra, more = prompts_of([9, 5, 6, 3], seed=2)
    produced: dict[str, list[int]] = {}
    for engine in engines:
        engine.add_request("a", prompt, SamplingParams(max_tokens=40))
        engine.add_request("b", other, SamplingParams(max_tokens=40))
    lockstep(one, two, produced, steps=4)
    for engine in engines:
        engine.pause("a")
    lockstep(one, two, produced, steps=3)
    held = list(two.requests["a"].token_ids)
    assert held == one.requests["a"].token_ids
    for engine in engines:  # the routed token is replaced, five new ones follow
        engine.resume("a", extra, anchor=len(held) - 1)
    lockstep(one, two, produced, steps=3)
    for engine in engines:  # a second handoff rolls back further, past a block boundary
        engine.pause("a")
        engine.resume("a", more, anchor=len(held) - 6)
    lockstep(one, two, produced, steps=200)
    assert not two.requests and len(produced["b"]) == 40


def test_a_second_tp_model_in_the_process_is_refused(engines, qwen3_dir) -> None:
    with pytest.raises(RuntimeError, match="one tensor-parallel model per process"):
        make_engine(qwen3_dir, tensor_parallel=2)


def test_kv_heads_not_divisible_is_a_clear_error(tmp_path: Path) -> None:
    path = save_qwen3(tmp_path / "odd", num_attention_heads=6, num_key_value_heads=3)
    t0 = time.monotonic()
    with pytest.raises(ModelLoadError, match="3 KV heads"):
        make_engine(path, tensor_parallel=2)
    assert time.monotonic() - t0 < 5  # refused before any worker started
    with pytest.raises(ValueError, match=r"tensor_parallel=2 must divide .* 3 KV heads"):
        ModelSpec(path=path, tensor_parallel=2)
    assert ModelSpec(path=path, tensor_parallel=3).tensor_parallel == 3


def test_a_step_failing_on_rank0_after_the_send_fails_the_group(monkeypatch) -> None:
    """The workers already run that step, so the ranks may be out of step: every later step
    and the health check fail (Serve restarts the group) instead of pairing collectives."""
    runner = TensorParallelRunner.__new__(TensorParallelRunner)  # no model: rank 0's logic
    runner.kv = SimpleNamespace(block_size=4)
    runner.attach([], launcher=None)

    def boom(self: object, out: object, timings: object) -> None:
        raise RuntimeError("rank 0 forward failed")

    monkeypatch.setattr(ModelRunner, "launch", boom)  # rank 0 queues its own shard there
    step = SimpleNamespace(chunks=[])
    with pytest.raises(RuntimeError, match="rank 0 forward failed"):
        runner.execute(step, StepTimings())
    with pytest.raises(RuntimeError, match="out of step"):
        runner.check_alive()
    with pytest.raises(RuntimeError, match="out of step"):
        runner.execute(step, StepTimings())
    assert runner.num_forwards == 1  # the second step was never sent


def test_dead_worker_fails_health_and_the_next_step_raises(engines) -> None:
    """Runs last: it kills the module's worker."""
    _, two = engines
    (worker,) = two.runner.launcher.processes
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(timeout=10)
    with pytest.raises(RuntimeError, match="rank 1 is gone"):
        two.check_health()
    two.add_request("late", [1, 2, 3], SamplingParams(max_tokens=2))
    t0 = time.monotonic()
    with pytest.raises((RuntimeError, OSError)):
        two.execute(now=float("inf"))
    assert time.monotonic() - t0 < 30  # never waits forever on the collective
