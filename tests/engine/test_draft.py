"""The next step drafted while the current one runs (``Engine.draft``, ``Scheduler.draft``):
a launch that takes a draft schedules exactly what a fresh ``schedule`` would have, whatever
happened in between (rows routed away, finished, aborted, requests arriving), and a tight
KV pool leaks nothing. On simulated engines: no model, no torch math."""

from __future__ import annotations

import random

import pytest

from tests.engine.conftest import assert_blocks_accounted
from tokenrouter_ray.engine.engine import Engine
from tokenrouter_ray.engine.request import RequestStatus, SamplingParams
from tokenrouter_ray.simulation.backend import sim_engine


def engines(**options: object) -> tuple[Engine, Engine]:
    """Two identical engines: ``drafting`` drafts during every forward, ``plain`` never."""
    return sim_engine(lambda b: 0.0, **options), sim_engine(lambda b: 0.0, **options)


def batch(out_chunks: list) -> list[tuple[str, int, int]]:
    return [(c.request.request_id, c.start, c.num_tokens) for c in out_chunks]


def both(action: str, pair: tuple[Engine, Engine], *args: object, **kwargs: object) -> None:
    for engine in pair:
        getattr(engine, action)(*args, **kwargs)


@pytest.mark.parametrize(
    "options",
    [
        {"num_blocks": 4096},  # plenty of everything
        {"num_blocks": 4096, "max_num_seqs": 5},  # the draft cut by the batch size
        {"num_blocks": 4096, "max_num_seqs": 64},
    ],
)
def test_a_drafted_launch_schedules_what_a_fresh_schedule_would(options: dict) -> None:
    rng = random.Random(3)
    pair = engines(**options)
    drafting, plain = pair
    # a small token budget for one run: chunked prefills beside decodes
    budget = 24 if options.get("max_num_seqs") == 64 else None
    for engine in pair:
        if budget:
            engine.scheduler.config = engine.scheduler.config.model_copy(
                update={"max_num_batched_tokens": budget}
            )
    n = 0
    compared = drafted_rows = 0

    def add(k: int) -> None:
        nonlocal n
        for _ in range(k):
            prompt = [rng.randrange(30) for _ in range(rng.randint(1, 40))]
            sampling = SamplingParams(max_tokens=rng.randint(1, 25))
            both("add_request", pair, f"q{n}", prompt, sampling, now=0.0)
            n += 1

    def pending() -> list[str]:
        return sorted(rid for rid, r in plain.requests.items() if r.status == RequestStatus.PENDING)

    add(6)
    for _ in range(300):
        steps = [e.launch(now=float("inf")) for e in pair]
        if steps[0] is None:
            assert steps[1] is None
            add(rng.randint(1, 3))
            continue
        in_flight = steps[1].request_ids
        assert steps[0].request_ids == in_flight
        drafting.draft()
        # while it runs: arrivals, returns of requests handed away, aborts of others
        for _ in range(rng.randint(0, 3)):
            op = rng.choice(["add", "resume", "resume_queued", "abort"])
            queued = sorted(
                rid
                for rid, r in plain.requests.items()
                if r.status == RequestStatus.WAITING and r.num_computed_tokens > 1
            )
            if op == "add":
                add(1)
            elif op.startswith("resume") and (queued if op == "resume_queued" else pending()):
                # a return, or (a peer's duplicate) new tokens for a request already queued
                rid = rng.choice(queued if op == "resume_queued" else pending())
                held = plain.requests[rid].num_tokens
                extra = [rng.randrange(30) for _ in range(rng.randint(0, 3))]
                both("resume", pair, rid, extra, anchor=rng.randint(max(1, held - 1), held))
            elif op == "abort":
                idle = sorted(set(plain.requests) - in_flight)
                if idle:
                    both("abort", pair, rng.choice(idle))
            drafting.draft()  # again: picks up what queued since
        results = [e.collect(s) for e, s in zip(pair, steps, strict=True)]
        rows = results[1].request_ids
        assert results[0].request_ids == rows
        leave = {rid for rid in sorted(rows) if rng.random() < 0.35}  # sorted: any hash seed
        drop = {rid for rid in sorted(leave) if rng.random() < 0.5}
        for engine, result in zip(pair, results, strict=True):
            engine.commit(result, drop=drop, pause=leave)
        if rng.random() < 0.2 and plain.requests:  # between steps: an abort of anything
            both("abort", pair, rng.choice(sorted(plain.requests)))
        if rng.random() < 0.3:
            add(1)
        drafted = drafting._draft
        drafted_rows += len(drafted.running) + len(drafted.waiting) if drafted else 0
        # the comparison: the next launch of each engine, from the same state
        outs = [e.scheduler.schedule(float("inf"), e._draft) for e in pair]
        drafting._draft = None
        assert batch(outs[0].chunks) == batch(outs[1].chunks)
        assert [r.request_id for r in outs[0].preempted] == [
            r.request_id for r in outs[1].preempted
        ]
        compared += 1
        # undo the comparison's schedule on both the same way: run it as the step
        for engine, out in zip(pair, outs, strict=True):
            for chunk in out.chunks:
                chunk.request.advance_computed(chunk.num_tokens)
            for chunk in out.chunks:
                if chunk.samples:
                    chunk.request.append_tokens([1])
                    request = chunk.request
                    if request.num_output_tokens >= request.sampling.max_tokens:
                        engine.finish(request.request_id, "length")
    assert compared > 150 and drafted_rows > 500


def test_a_request_put_at_the_queue_head_goes_before_the_drafted_ones() -> None:
    """A preemption puts its victim back at the head of the queue: the drafted queued
    requests follow it, in order, as a fresh schedule would have them."""
    engine = sim_engine(lambda b: 0.0, num_blocks=64)
    sched = engine.scheduler
    for rid, size in (("a", 5), ("b", 3), ("c", 4)):
        engine.add_request(rid, list(range(size)), now=0.0)
    step = engine.launch(now=float("inf"))  # a, b and c run
    engine.commit(engine.collect(step))
    engine.pause("b")
    engine.pause("c")
    step = engine.launch(now=float("inf"))  # a alone
    engine.resume("b", [7])
    engine.resume("c", [7])
    engine.draft()  # queued part: b, c
    assert [c.request.request_id for c in engine._draft.waiting] == ["b", "c"]
    engine.add_request("x", [1, 2], now=0.0)
    sched.waiting.appendleft(sched.waiting.pop())  # x at the head, as a preempted request
    engine.commit(engine.collect(step))
    out = sched.schedule(float("inf"), engine._draft)
    assert [c.request.request_id for c in out.chunks] == ["a", "x", "b", "c"]
    assert [r.request_id for r in sched.waiting] == []


def test_a_request_cut_back_since_the_draft_is_scheduled_from_where_it_now_is() -> None:
    """A queued request whose tokens were cut back after the draft (a resume at an earlier
    anchor) computes from its new start, although its chunk keeps its size."""
    engine = sim_engine(lambda b: 0.0, num_blocks=64)
    engine.add_request("a", list(range(6)), now=0.0)
    engine.add_request("b", [1, 2], now=0.0)
    step = engine.launch(now=float("inf"))
    engine.commit(engine.collect(step), drop={"a"}, pause={"a"})  # a escalated: 6 tokens
    step = engine.launch(now=float("inf"))  # b alone
    engine.resume("a", [9])  # back with the large model's token: 7 tokens, 6 computed
    engine.draft()
    drafted = {c.request.request_id: (c.start, c.num_tokens) for c in engine._draft.waiting}
    assert drafted == {"a": (6, 1)}
    engine.resume("a", [], anchor=6)  # cut back: 6 tokens, its last one to recompute
    engine.commit(engine.collect(step))
    out = engine.scheduler.schedule(float("inf"), engine._draft)
    chunks = {c.request.request_id: (c.start, c.num_tokens) for c in out.chunks}
    assert chunks == {"b": (3, 1), "a": (5, 1)}


def test_drafting_on_a_tight_pool_leaks_no_block() -> None:
    """Random traffic on a pool small enough to queue and preempt, drafting during every
    forward: each block's reference count always equals its holders (a prefix hit may
    share a block: the simulated model repeats tokens), and all are free at the end."""
    rng = random.Random(11)
    engine = sim_engine(lambda b: 0.0, num_blocks=14, block_size=4)
    pool = engine.kv.pool
    n = 0
    for _ in range(400):
        if rng.random() < 0.3:
            prompt = [rng.randrange(30) for _ in range(rng.randint(1, 20))]
            engine.add_request(f"q{n}", prompt, SamplingParams(max_tokens=rng.randint(1, 30)))
            n += 1
        step = engine.launch(now=float("inf"))
        if step is None:
            continue
        engine.draft()
        idle = sorted(set(engine.requests) - step.request_ids)
        for rid in idle:
            request = engine.requests[rid]
            if request.status == RequestStatus.PENDING and rng.random() < 0.5:
                engine.resume(rid, [rng.randrange(30)])
            elif rng.random() < 0.05:
                engine.abort(rid)
        engine.draft()
        result = engine.collect(step)
        # Sorted: the same draws whatever the hash seed (sets of str iterate by hash).
        leave = {rid for rid in sorted(result.request_ids) if rng.random() < 0.3}
        drop = {rid for rid in sorted(leave) if rng.random() < 0.5}
        engine.commit(result, drop=drop, pause=leave)
        assert_blocks_accounted(engine)
    for rid in list(engine.requests):
        engine.resume(rid, [])
    while engine.has_unfinished:
        step = engine.launch(now=float("inf"))
        engine.draft()
        engine.commit(engine.collect(step))
    assert pool.num_free_blocks == pool.num_blocks
    assert engine.scheduler.num_preemptions > 0  # the run took the hard paths
