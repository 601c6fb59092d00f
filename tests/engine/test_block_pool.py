from __future__ import annotations

import pytest

from tokenrouter_ray.engine.block_pool import (
    BlockPool,
    KVCacheManager,
    ModelFootprint,
    device_budget,
    kv_bytes_per_token,
    plan_joint,
    plan_num_blocks,
)
from tokenrouter_ray.engine.request import Request, SamplingParams


def test_allocate_free_and_ref_counts() -> None:
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert a is not None and len(set(a)) == 3 and pool.num_free_blocks == 1
    assert pool.allocate(2) is None and pool.num_free_blocks == 1  # no partial allocation
    pool.incref(a[:1])
    pool.free(a)
    assert pool.num_free_blocks == 3  # the shared block still has an owner
    pool.free(a[:1])
    assert pool.num_free_blocks == 4
    with pytest.raises(ValueError):
        pool.free(a[:1])


def test_slots_grow_by_block_and_truncate_releases() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    r = Request("r", list(range(10)), SamplingParams(), arrival_time=0.0)
    assert len(kv.allocate_slots(r, 10)) == 3
    r.num_computed_tokens = 10
    assert kv.allocate_slots(r, 2) == []  # position 11 still fits block 3
    assert len(kv.allocate_slots(r, 3)) == 1
    kv.truncate(r, 5)
    assert len(r.block_ids) == 2 and r.num_computed_tokens == 5 and kv.pool.num_free_blocks == 6
    kv.free(r)
    assert kv.pool.num_free_blocks == 8 and r.block_ids == []


def test_capacity_from_memory_budget() -> None:
    per_token = kv_bytes_per_token(num_layers=30, num_kv_heads=3, head_dim=64, dtype_bytes=4)
    assert per_token == 2 * 30 * 3 * 64 * 4
    model = ModelFootprint(weight_bytes=500 * 2**20, kv_bytes_per_token=per_token)
    blocks = plan_num_blocks(2**30, model, block_size=16)
    assert blocks == (2**30 - 500 * 2**20) // per_token // 16
    with pytest.raises(ValueError, match="no room for KV"):
        plan_num_blocks(400 * 2**20, model, block_size=16)


def test_joint_plan_fits_the_budget_with_equal_context() -> None:
    small = ModelFootprint(weight_bytes=1_000, kv_bytes_per_token=10)
    large = ModelFootprint(weight_bytes=5_000, kv_bytes_per_token=40)
    budget = 106_000
    blocks = plan_joint(budget, [small, large], block_size=8)
    assert blocks[0] == blocks[1]
    tokens = blocks[0] * 8
    assert 1_000 + 5_000 + tokens * 50 <= budget < 1_000 + 5_000 + (tokens + 8) * 50


def test_device_budget_never_exceeds_what_the_device_has_free() -> None:
    gib = 2**30
    # A 150 GiB budget on a card with 14 GiB free after 64 GiB of weights: capped.
    assert device_budget(150 * gib, 64 * gib, 14 * gib) == 64 * gib + int(0.9 * 14 * gib)
    assert device_budget(70 * gib, 64 * gib, 60 * gib) == 70 * gib  # the ask fits: kept
    assert device_budget(70 * gib, 64 * gib, None) == 70 * gib  # CPU: no device figure
