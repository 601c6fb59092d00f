"""The SDPA decode gather without flash-attn: rows are grouped by context width and a
group's padded gather stays within a bound, so one long request beside many short ones does
not pad every row to its length; the activation reserve covers the largest gather. Shapes
and bytes are checked on the meta device at Qwen3-32B's attention shape (no memory spent);
tokens on CPU against the ungrouped path."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config

from tests.engine.conftest import make_engine
from tests.engine.test_engine import prompts_of
from tokenrouter_ray.engine import attention
from tokenrouter_ray.engine.attention import (
    MAX_DECODE_GATHER_TOKENS,
    PagedBatch,
    Variant,
    decode_groups,
)
from tokenrouter_ray.engine.kv_cache import PagedKVCache
from tokenrouter_ray.engine.memory_reserve import dynamic_gather_bytes, forward_reserve_bytes
from tokenrouter_ray.engine.request import SamplingParams

QWEN3_32B = Qwen3Config(
    vocab_size=151936, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
    num_attention_heads=64, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
)  # fmt: skip
BLOCK = 256


def long_beside_short(long_ctx: int = 40_000, short_ctx: int = 600, shorts: int = 63):
    """Decode rows (start, 1, blocks): one long context and many short ones, all blocks
    distinct."""
    seqs, next_block = [], 0
    for ctx in [long_ctx] + [short_ctx] * shorts:
        n = -(-ctx // BLOCK)
        seqs.append((ctx - 1, 1, list(range(next_block, next_block + n))))
        next_block += n
    return seqs, next_block


def test_groups_bound_the_padded_gather() -> None:
    tables = [list(range(157))] + [list(range(3))] * 63  # 40k tokens and 63 x 600
    groups = decode_groups(tables, BLOCK)
    assert sorted(i for g in groups for i in g) == list(range(64))
    for g in groups:
        width = max(len(tables[i]) for i in g)
        assert len(g) == 1 or len(g) * width * BLOCK <= MAX_DECODE_GATHER_TOKENS
    assert [0] in groups  # the long row gathers alone


def test_meta_gather_at_qwen3_32b_shape_stays_within_the_reserve(monkeypatch) -> None:
    """One 40k-token decode beside 63 short ones: the gathers of one layer total about
    40k + 63 x 768 tokens (not 64 x 40k, about 10 GiB in bf16), and the largest is within
    what the reserve sets aside for a dynamic step's gather."""
    seqs, blocks = long_beside_short()
    kv = PagedKVCache(num_layers=1, num_blocks=blocks, block_size=BLOCK, num_kv_heads=8,
                      head_dim=128, dtype=torch.bfloat16, device="meta")  # fmt: skip
    meta = torch.device("meta")
    batch = PagedBatch.build(kv, seqs, meta)
    gathered: list[tuple[int, ...]] = []
    real_gather = kv.gather

    def gather(layer: int, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = real_gather(layer, table)
        gathered.append(tuple(k.shape))
        return k, v

    monkeypatch.setattr(kv, "gather", gather)
    q = torch.empty((len(seqs), 64, 128), dtype=torch.bfloat16, device=meta)
    kv.write(0, q[:, :8], q[:, :8], batch.slot_mapping)
    out = attention._sdpa_attention(batch, 0, q, Variant(None))
    assert out.shape == (64, 64, 128) and out.device.type == "meta"
    tokens = [n * width for n, width, _, _ in gathered]
    assert sum(tokens) <= 40_000 + BLOCK + 63 * 1024  # padding within a group only
    ungrouped = 64 * 157 * BLOCK  # what the single padded gather took
    assert sum(tokens) * 10 < ungrouped
    per_token = 2 * 8 * 128 * 2  # K and V, bf16
    largest = max(tokens) * per_token
    assert largest <= dynamic_gather_bytes(QWEN3_32B, 2, 40960)
    reserve = forward_reserve_bytes(QWEN3_32B, 2, 4096, 64, 40960, 256, graphs=True)
    assert ungrouped * per_token > reserve  # the old gather did not fit what is reserved
    assert largest < reserve


@pytest.mark.parametrize("budget", [16, 64])
def test_grouped_decodes_give_the_tokens_of_one_gather(tiny_llama_dir, monkeypatch, budget):
    """Mixed context lengths, with a gather budget small enough to split them into many
    groups and chunks: the same greedy tokens as with every row in one gather."""
    prompts = prompts_of([3, 40, 5, 22, 9, 61, 4, 17], seed=11)

    def run() -> list[list[int]]:
        engine = make_engine(tiny_llama_dir, max_num_seqs=8)
        return engine.generate(prompts, SamplingParams(max_tokens=6))

    real = attention.decode_groups
    one_gather = lambda t, bs, max_tokens=0: [list(range(len(t)))] if t else []  # noqa: E731
    monkeypatch.setattr(attention, "decode_groups", one_gather)  # the former layout
    want = run()
    calls: list[int] = []
    monkeypatch.setattr(
        attention,
        "decode_groups",
        lambda t, bs, max_tokens=budget: calls.append(len(g := real(t, bs, max_tokens))) or g,
    )
    assert run() == want
    assert max(calls) > 2  # the budget really split the decode rows
