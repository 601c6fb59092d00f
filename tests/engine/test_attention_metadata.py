"""Attention metadata built for a packed batch: slots, decode/extend split, and the
flash-attn varlen layout (built on CPU; the kernel itself needs CUDA)."""

from __future__ import annotations

import torch

from tokenrouter_ray.engine.attention import PagedBatch, sdpa_choice, sdpa_params
from tokenrouter_ray.engine.kv_cache import PagedKVCache


def cache() -> PagedKVCache:
    return PagedKVCache(
        num_layers=1,
        num_blocks=8,
        block_size=4,
        num_kv_heads=1,
        head_dim=2,
        dtype=torch.float32,
        device="cpu",
    )


SEQS = [(0, 5, [3, 6]), (6, 1, [1, 2]), (2, 3, [7, 0])]  # prefill, decode, extend


def test_slots_and_split_for_sdpa() -> None:
    batch = PagedBatch.build(cache(), SEQS, torch.device("cpu"))
    # prefill 0..4 -> blocks 3,6; decode at 6 -> block 2 slot 2; extend 2..4 -> block 7, 0
    assert batch.slot_mapping.tolist() == [12, 13, 14, 15, 24, 10, 30, 31, 0]
    (decode,) = batch.decode
    assert decode.rows.tolist() == [5]
    assert decode.blocks.tolist() == [[1, 2]]
    assert decode.mask[0, 0, 0].tolist() == [True] * 7 + [False]
    fresh, extend = batch.spans
    assert (fresh.q_start, fresh.q_len, fresh.ctx_len, fresh.mask) == (0, 5, 5, None)
    assert (extend.q_start, extend.q_len, extend.ctx_len) == (6, 3, 5)
    # query at position 2 sees keys 0..2, at 4 sees 0..4
    assert extend.mask.tolist()[0] == [True, True, True, False, False]
    assert extend.mask.tolist()[2] == [True] * 5


def test_varlen_metadata_for_flash_attn() -> None:
    batch = PagedBatch.build(cache(), SEQS, torch.device("cpu"), use_flash=True)
    meta = batch.varlen
    assert meta["cu_seqlens_q"].tolist() == [0, 5, 6, 9]
    assert meta["cu_seqlens_k"].tolist() == [0, 5, 12, 17]
    assert (meta["max_seqlen_q"], meta["max_seqlen_k"]) == (5, 7)
    assert meta["block_table"].tolist() == [[3, 6], [1, 2], [7, 0]]
    assert meta["block_table"].dtype == torch.int32
    assert not batch.decode and not batch.spans


def test_the_kernel_check_judges_a_grouped_query_prefill_as_one() -> None:
    """``sdpa_choice`` asks PyTorch's ``can_use_*`` checks about the call that runs: a
    grouped-query prefill (16 query heads over 8 kv heads) says ``enable_gqa``."""
    q = torch.zeros(1, 16, 12, 8)
    k = torch.zeros(1, 8, 12, 8)
    params = sdpa_params(q, k, k, None, is_causal=True, enable_gqa=True)
    assert (params.enable_gqa, params.is_causal) == (True, True)
    assert not sdpa_params(q, q, q, None, is_causal=False, enable_gqa=False).enable_gqa
    assert sdpa_choice(q, k, k, None, None, is_causal=True, enable_gqa=True) == "math"  # CPU
