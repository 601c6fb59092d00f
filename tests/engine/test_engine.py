"""The engine's greedy tokens equal transformers' own generate, through batching, chunking,
pause/resume and preemption."""

from __future__ import annotations

import random

import pytest
import torch

from tests.engine.conftest import assert_blocks_accounted, greedy_reference, make_engine
from tokenrouter_ray.engine.request import RequestStatus, SamplingParams


def prompts_of(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(128) for _ in range(n)] for n in lengths]


def drain(engine, produced: dict[str, list[int]]) -> list:
    results = []
    while engine.has_runnable:
        result = engine.execute(now=float("inf"))
        if result is None:
            continue
        results.append(result)
        for out in engine.commit(result):
            produced.setdefault(out.request_id, []).extend(out.new_token_ids)
    return results


def test_single_request_matches_generate(tiny_model_dir, reference_model) -> None:
    engine = make_engine(tiny_model_dir)
    (prompt,) = prompts_of([7])
    (tokens,) = engine.generate([prompt], SamplingParams(max_tokens=20))
    assert tokens == greedy_reference(reference_model(tiny_model_dir), prompt, 20)
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks


def test_concurrent_requests_share_batches(tiny_model_dir, reference_model) -> None:
    """8 requests of different lengths, arriving in two waves, prefills chunked by a small
    token budget: every request still gets generate()'s tokens."""
    engine = make_engine(tiny_model_dir, max_num_batched_tokens=24)
    prompts = prompts_of([3, 40, 11, 1, 25, 8, 17, 60], seed=1)
    produced: dict[str, list[int]] = {}
    for i, p in enumerate(prompts[:4]):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=12))
    results = []
    for _ in range(2):
        results.append(engine.execute())
        for out in engine.commit(results[-1]):
            produced.setdefault(out.request_id, []).extend(out.new_token_ids)
    for i, p in enumerate(prompts[4:], start=4):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=12))
    results += drain(engine, produced)
    ref = reference_model(tiny_model_dir)
    for i, p in enumerate(prompts):
        assert produced[f"r{i}"] == greedy_reference(ref, p, 12), f"request r{i}"
    assert max(r.batch_size for r in results) >= 6  # batches were really shared
    assert any(r.num_scheduled_tokens > r.batch_size for r in results)  # prefill beside decode


def test_pause_and_multi_token_extend_equal_a_full_recompute(
    tiny_model_dir, reference_model
) -> None:
    engine = make_engine(tiny_model_dir, keep_logits=True)
    ref = reference_model(tiny_model_dir)
    prompt, other, extra = prompts_of([9, 5, 6], seed=2)
    engine.add_request("a", prompt, SamplingParams(max_tokens=30))
    engine.add_request("b", other, SamplingParams(max_tokens=30))
    for _ in range(4):
        engine.step()
    a = engine.requests["a"]
    engine.pause("a")
    for _ in range(3):  # b runs on while a is pending; a's KV stays put
        engine.step()
    assert a.status == RequestStatus.PENDING and a.block_ids
    held = list(a.token_ids)
    # Another model replaced a's last sampled token and added five of its own.
    anchor = len(held) - 1
    engine.resume("a", extra, anchor=anchor)
    context = held[:anchor] + extra
    assert a.num_uncomputed_tokens == len(extra)  # only the unseen suffix is computed
    result = engine.execute()
    row = result.request_ids.index("a")
    with torch.no_grad():
        expected = ref(torch.tensor([context])).logits[0, -1]
    torch.testing.assert_close(result.logits[row], expected.float(), atol=1e-5, rtol=0)
    produced = {"a": [result.token_ids[row]]}
    engine.commit(result)
    drain(engine, produced)
    continuation = greedy_reference(ref, context, 30 - (len(context) - len(prompt)))
    assert produced["a"] == continuation


def test_resume_without_new_tokens_recomputes_last_position(
    tiny_llama_dir, reference_model
) -> None:
    engine = make_engine(tiny_llama_dir)
    (prompt,) = prompts_of([6], seed=3)
    engine.add_request("a", prompt, SamplingParams(max_tokens=8))
    engine.step()
    engine.step()
    engine.pause("a")
    engine.resume("a", [])
    produced = {"a": list(engine.requests["a"].output_token_ids)}
    drain(engine, produced)
    assert produced["a"] == greedy_reference(reference_model(tiny_llama_dir), prompt, 8)


def test_kv_full_requests_queue_and_all_finish_exactly(tiny_llama_dir, reference_model) -> None:
    engine = make_engine(tiny_llama_dir, num_blocks=14, block_size=4)  # 56 slots for 6 requests
    prompts = prompts_of([10, 12, 9, 14, 11, 8], seed=4)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=10))
    first = engine.execute()
    assert first.batch_size < 6  # admission stopped at the KV limit
    assert any(r.status == RequestStatus.WAITING for r in engine.requests.values())
    produced: dict[str, list[int]] = {}
    for out in engine.commit(first):
        produced.setdefault(out.request_id, []).extend(out.new_token_ids)
    drain(engine, produced)
    ref = reference_model(tiny_llama_dir)
    for i, p in enumerate(prompts):
        assert produced[f"r{i}"] == greedy_reference(ref, p, 10), f"request r{i}"
    assert engine.kv.pool.num_free_blocks == 14


def test_preempted_request_recomputes_to_the_same_tokens(tiny_llama_dir, reference_model) -> None:
    engine = make_engine(tiny_llama_dir, num_blocks=8, block_size=4)
    prompts = prompts_of([12, 12], seed=5)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=12))
    produced: dict[str, list[int]] = {}
    drain(engine, produced)
    ref = reference_model(tiny_llama_dir)
    assert [produced[f"r{i}"] for i in range(2)] == [greedy_reference(ref, p, 12) for p in prompts]


def test_lifecycle_calls_on_unknown_or_finished_requests_are_no_ops(tiny_llama_dir) -> None:
    engine = make_engine(tiny_llama_dir)
    for call in (engine.finish, engine.abort, engine.pause):
        call("nope")
    engine.resume("nope", [1, 2])
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=2))
    engine.abort("a")
    engine.abort("a")
    engine.finish("a")
    engine.resume("a", [4])
    assert not engine.has_unfinished and engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks
    with pytest.raises(ValueError, match="already exists"):
        engine.add_request("b", [1], SamplingParams())
        engine.add_request("b", [1], SamplingParams())
    with pytest.raises(ValueError, match="limit"):
        engine.add_request("c", [1] * engine.max_model_len, SamplingParams())
    with pytest.raises(ValueError, match="at least one token"):
        engine.add_request("d", [], SamplingParams())


def test_execute_twice_without_commit_is_refused(tiny_llama_dir) -> None:
    engine = make_engine(tiny_llama_dir)
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=4))
    result = engine.execute()
    with pytest.raises(RuntimeError, match="commit"):
        engine.execute()
    engine.commit(result)
    assert engine.execute() is not None


def test_stop_tokens_and_max_tokens_finish_requests(tiny_llama_dir) -> None:
    engine = make_engine(tiny_llama_dir)
    (prompt,) = prompts_of([5], seed=6)
    (free_run,) = engine.generate([prompt], SamplingParams(max_tokens=10))
    stop = free_run[3]
    engine.add_request("s", prompt, SamplingParams(max_tokens=10, stop_token_ids=(stop,)))
    outs = []
    while engine.has_unfinished:
        outs += engine.step()
    tokens = [t for o in outs for t in o.new_token_ids]
    assert tokens == free_run[: free_run.index(stop) + 1]
    assert outs[-1].finished and outs[-1].finish_reason == "stop"
    (short,) = engine.generate([prompt], SamplingParams(max_tokens=4))
    assert short == free_run[:4]


def test_random_operations_leave_every_block_free(tiny_llama_dir) -> None:
    """200 random add/step/pause/resume/finish/abort operations on a KV pool small enough to
    force queueing and preemption; afterwards every block is free."""
    rng = random.Random(7)
    engine = make_engine(tiny_llama_dir, num_blocks=12, block_size=4)
    pool = engine.kv.pool
    n = 0
    queued_at_full = False
    for _ in range(200):
        op = rng.choice(
            ["add", "add", "step", "step", "step", "pause", "resume", "finish", "abort"]
        )
        live = list(engine.requests)
        if op == "add":
            prompt = [rng.randrange(128) for _ in range(rng.randint(1, 20))]
            engine.add_request(f"q{n}", prompt, SamplingParams(max_tokens=rng.randint(1, 30)))
            n += 1
        elif op == "step":
            engine.step(now=float("inf"))
        elif live:
            rid = rng.choice([*live, "ghost"])
            if op == "pause":
                engine.pause(rid)
            elif op == "resume" and rid in engine.requests:
                held = engine.requests[rid].num_tokens
                extra = [rng.randrange(128) for _ in range(rng.randint(0, 5))]
                engine.resume(rid, extra, anchor=rng.randint(max(1, held - 2), held))
            elif op == "finish":
                engine.finish(rid)
            else:
                engine.abort(rid)
        assert_blocks_accounted(engine)
        queued_at_full |= pool.num_free_blocks < 3 and bool(engine.scheduler.waiting)
    for rid in list(engine.requests):
        engine.resume(rid, [])
    while engine.has_unfinished:
        engine.step(now=float("inf"))
    assert pool.num_free_blocks == pool.num_blocks
    assert queued_at_full and engine.scheduler.num_preemptions > 0  # the run hit the hard paths
