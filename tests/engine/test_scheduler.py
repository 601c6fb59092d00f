"""Scheduler decisions from tiny factories: no model, no torch."""

from __future__ import annotations

import itertools

import pytest

from tokenrouter_ray.engine.block_pool import KVCacheManager
from tokenrouter_ray.engine.request import Request, RequestStatus, SamplingParams
from tokenrouter_ray.engine.scheduler import Scheduler, SchedulerConfig

_ids = itertools.count()


def create_scheduler(num_blocks: int = 100, block_size: int = 4, **cfg: object) -> Scheduler:
    return Scheduler(SchedulerConfig(**cfg), KVCacheManager(num_blocks, block_size))


def create_requests(sizes: list[int], arrival: float = 0.0) -> list[Request]:
    return [
        Request(f"r{next(_ids)}", list(range(n)), SamplingParams(), arrival_time=arrival + i * 1e-3)
        for i, n in enumerate(sizes)
    ]


def run(sched: Scheduler, now: float = 0.0) -> dict[str, int]:
    """Schedule once and apply the result as the engine would (one sampled token each)."""
    out = sched.schedule(now)
    for c in out.chunks:
        c.request.advance_computed(c.num_tokens)
        if c.samples:
            c.request.token_ids.append(0)
    return {c.request.request_id: c.num_tokens for c in out.chunks}


def test_prefill_decode_and_extend_are_one_thing_at_different_sizes() -> None:
    sched = create_scheduler()
    a, b = create_requests([10, 3])
    sched.add(a)
    assert run(sched) == {a.request_id: 10}
    sched.add(b)
    assert run(sched) == {a.request_id: 1, b.request_id: 3}  # decode beside a prefill
    sched.pause(a)
    assert run(sched) == {b.request_id: 1}  # pending requests are not scheduled
    a.token_ids.extend([7, 7, 7])  # the tokens another model produced
    sched.make_runnable(a, now=0.0)
    assert run(sched) == {b.request_id: 1, a.request_id: 4}  # extend: only the unseen suffix


def test_long_prompt_is_chunked_by_the_token_budget_and_samples_once() -> None:
    sched = create_scheduler(max_num_batched_tokens=32)
    (r,) = create_requests([100])
    sched.add(r)
    sizes, samples = [], []
    while r.num_computed_tokens < 100:
        out = sched.schedule(0.0)
        (chunk,) = out.chunks
        sizes.append(chunk.num_tokens)
        samples.append(chunk.samples)
        r.advance_computed(chunk.num_tokens)
    assert sizes == [32, 32, 32, 4]
    assert samples == [False, False, False, True]


def test_token_budget_is_shared_running_first() -> None:
    sched = create_scheduler(max_num_batched_tokens=8)
    a, b, c = create_requests([4, 6, 6])
    sched.add(a)
    run(sched)
    sched.add(b)
    sched.add(c)
    assert run(sched) == {a.request_id: 1, b.request_id: 6, c.request_id: 1}


def test_max_num_seqs_caps_the_batch() -> None:
    sched = create_scheduler(max_num_seqs=2)
    for r in create_requests([2, 2, 2]):
        sched.add(r)
    assert len(run(sched)) == 2


def test_kv_full_queues_new_requests_instead_of_failing() -> None:
    sched = create_scheduler(num_blocks=4, block_size=4)
    a, b = create_requests([12, 8])
    sched.add(a)
    sched.add(b)
    assert run(sched) == {a.request_id: 12}  # b needs 2 more blocks; only 1 is free
    assert b.status == RequestStatus.WAITING and not b.block_ids


def test_running_request_preempts_latest_arrival_by_recompute() -> None:
    sched = create_scheduler(num_blocks=4, block_size=4)
    a, b = create_requests([8, 8])
    sched.add(a)
    sched.add(b)
    run(sched)  # both prefilled, all 4 blocks used, each holds a sampled token
    out = sched.schedule(0.0)  # a needs a 3rd block: b (later arrival) pays
    assert [c.request.request_id for c in out.chunks] == [a.request_id]
    assert out.preempted == [b]
    assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 0 and not b.block_ids
    assert sched.waiting[0] is b


def test_pending_requests_are_preempted_before_running_ones() -> None:
    sched = create_scheduler(num_blocks=4, block_size=4)
    a, b = create_requests([8, 8])
    sched.add(a)
    sched.add(b)
    run(sched)
    sched.pause(a)  # a's KV waits idle while another model works on it
    out = sched.schedule(0.0)
    assert out.preempted == [a] and a.status == RequestStatus.PENDING and not a.block_ids
    assert [c.request for c in out.chunks] == [b]


def test_idle_kv_holders_yield_when_nothing_can_run() -> None:
    sched = create_scheduler(num_blocks=3, block_size=4)
    a, b = create_requests([8, 8])
    sched.add(a)
    run(sched)
    sched.pause(a)  # a holds 2 of 3 blocks, b needs 2
    sched.add(b)
    out = sched.schedule(0.0)
    assert out.preempted == [a] and [c.request for c in out.chunks] == [b]


def test_deferred_launch_waits_for_threshold_then_launches() -> None:
    sched = create_scheduler(batch_thresholds=[1, 1, 3], max_defer_s=0.5)
    a, b, c = create_requests([2, 2, 2], arrival=10.0)
    sched.add(a)
    sched.add(b)
    sched.active_requests = 5  # table is clipped: B = 3
    out = sched.schedule(10.1)
    assert out.deferred and not out.chunks and out.threshold == 3
    assert out.wake_at == pytest.approx(10.5)
    sched.add(c)
    assert len(run(sched, now=10.1)) == 3


def test_deferred_launch_max_wait_bounds_a_stale_count() -> None:
    sched = create_scheduler(batch_thresholds=[1, 1, 4], max_defer_s=0.2)
    (a,) = create_requests([2], arrival=5.0)
    sched.add(a)
    sched.active_requests = 9
    assert sched.schedule(5.19).deferred
    assert run(sched, now=5.2) == {a.request_id: 2}


def test_threshold_follows_global_active_count_then_local_count() -> None:
    sched = create_scheduler(batch_thresholds=[1, 1, 2, 3])
    for r in create_requests([2, 2]):
        sched.add(r)
    assert sched.threshold() == 2  # local: 2 active
    sched.active_requests = 1  # stale: the 2 held here are part of the global count
    assert sched.threshold() == 2
    sched.active_requests = 3
    assert sched.threshold() == 3
    sched.active_requests = 100
    assert sched.threshold() == 3


def test_config_rejects_bad_thresholds() -> None:
    with pytest.raises(ValueError):
        SchedulerConfig(batch_thresholds=[])
    with pytest.raises(ValueError):
        SchedulerConfig(batch_thresholds=[1, 0])
    with pytest.raises(ValueError):
        SchedulerConfig(unknown=1)
