"""Attention over the paged KV cache for one packed, variable-length batch.

The model runner registers ``paged_attention_forward`` in transformers' attention
interface under ``ATTN_IMPLEMENTATION`` and loads models with it, so every standard
decoder-only architecture (Llama family, Qwen2, Qwen3, Mistral, ...) runs on our cache
without touching its modelling code. Per-step metadata travels as an explicit forward
kwarg (``paged=PagedBatch``), never through module globals: two models in one process
each pass their own.

A batch packs all scheduled tokens into one row of ``num_tokens``. Each attention layer
writes the new K/V into its blocks, then attends:
- CPU / no flash-attn: decode rows (one query token) go through one batched SDPA over
  their gathered blocks; prefill and extend rows go through one SDPA per sequence with a
  causal mask offset by the tokens already in cache.
- CUDA with flash-attn: one ``flash_attn_varlen_func`` call over the whole batch reading
  K/V straight from the block table (requires block_size % 256 == 0).
- Static (bucketed) batches, the CUDA-graph path (``static_forward.py``): every sequence
  has exactly ``L`` query rows, real tokens last (front padding), and fixed-shape metadata
  (``StaticMeta``); flash-attn's ``flash_attn_with_kvcache`` reads the block table, or SDPA
  over the gathered blocks with a precomputed mask. No shape depends on the data, so the
  forward can be captured once per (batch, L) bucket and replayed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from tokenrouter_ray.engine.kv_cache import PagedKVCache

ATTN_IMPLEMENTATION = "tokenrouter_paged"

try:  # optional GPU extra
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
except ImportError:  # pragma: no cover - depends on the install
    flash_attn_varlen_func = flash_attn_with_kvcache = None


def flash_attn_available(device: torch.device) -> bool:
    return flash_attn_varlen_func is not None and device.type == "cuda"


@dataclass
class SeqSpan:
    """A sequence computing more than one token this step (prefill or extend)."""

    q_start: int  # first row in the packed batch
    q_len: int
    ctx_len: int  # tokens in cache after this step, including the new ones
    block_table: torch.Tensor  # (num_blocks,)
    mask: torch.Tensor | None  # (q_len, ctx_len) bool; None: plain causal (fresh prefill)


@dataclass
class StaticMeta:
    """Fixed-shape metadata of a bucketed batch: ``batch`` sequences x ``q_len`` rows."""

    batch: int
    q_len: int
    block_table: torch.Tensor  # (batch, max_blocks) int32
    ctx_lens: torch.Tensor  # (batch,) int32: tokens in cache after this step
    mask: torch.Tensor | None  # (batch, 1, q_len, max_blocks * block_size) bool; SDPA only


@dataclass
class PagedBatch:
    kv: PagedKVCache
    slot_mapping: torch.Tensor  # (num_tokens,) cache slot of every new token
    spans: list[SeqSpan]
    decode_rows: torch.Tensor | None  # (num_decode,) packed rows with one query token
    decode_blocks: torch.Tensor | None  # (num_decode, max_blocks)
    decode_mask: torch.Tensor | None  # (num_decode, 1, 1, max_blocks * block_size)
    varlen: dict[str, torch.Tensor | int] | None = None  # flash-attn metadata
    static: StaticMeta | None = None  # bucketed batch (static_forward.py)

    @classmethod
    def build(
        cls,
        kv: PagedKVCache,
        seqs: Sequence[tuple[int, int, Sequence[int]]],
        device: torch.device,
        use_flash: bool = False,
    ) -> PagedBatch:
        """``seqs``: per sequence (start, num_new_tokens, block_ids), in packed order."""
        bs = kv.block_size
        slots: list[int] = []
        spans: list[SeqSpan] = []
        dec_rows: list[int] = []
        dec_tables: list[Sequence[int]] = []
        dec_lens: list[int] = []
        row = 0
        for start, n, blocks in seqs:
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, start + n))
            ctx = start + n
            used = blocks[: -(-ctx // bs)]
            if n == 1 and not use_flash:
                dec_rows.append(row)
                dec_tables.append(used)
                dec_lens.append(ctx)
            elif not use_flash:
                mask = None
                if start > 0:  # query i sits at position start + i and sees keys <= it
                    q_pos = torch.arange(start, ctx, device=device)[:, None]
                    mask = torch.arange(ctx, device=device)[None, :] <= q_pos
                table = torch.tensor(used, dtype=torch.long, device=device)
                spans.append(SeqSpan(row, n, ctx, table, mask))
            row += n
        batch = cls(
            kv=kv,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            spans=spans,
            decode_rows=None,
            decode_blocks=None,
            decode_mask=None,
        )
        if use_flash:
            batch.varlen = _varlen_metadata(seqs, bs, device)
        elif dec_rows:
            width = max(len(t) for t in dec_tables)
            table = torch.zeros((len(dec_rows), width), dtype=torch.long)
            for i, t in enumerate(dec_tables):
                table[i, : len(t)] = torch.tensor(t, dtype=torch.long)
            lens = torch.tensor(dec_lens)
            mask = torch.arange(width * bs)[None, :] < lens[:, None]  # (num_decode, width*bs)
            batch.decode_rows = torch.tensor(dec_rows, dtype=torch.long, device=device)
            batch.decode_blocks = table.to(device)
            batch.decode_mask = mask[:, None, None, :].to(device)
        return batch


def _varlen_metadata(
    seqs: Sequence[tuple[int, int, Sequence[int]]], block_size: int, device: torch.device
) -> dict[str, torch.Tensor | int]:
    q_lens = [n for _, n, _ in seqs]
    k_lens = [s + n for s, n, _ in seqs]
    width = max(-(-k // block_size) for k in k_lens)
    table = torch.zeros((len(seqs), width), dtype=torch.int32)
    for i, (_, _, blocks) in enumerate(seqs):
        used = blocks[: -(-k_lens[i] // block_size)]
        table[i, : len(used)] = torch.tensor(used, dtype=torch.int32)

    def cu(lens: list[int]) -> torch.Tensor:
        return torch.tensor([0, *lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)

    return {
        "cu_seqlens_q": cu(q_lens).to(device),
        "cu_seqlens_k": cu(k_lens).to(device),
        "max_seqlen_q": max(q_lens),
        "max_seqlen_k": max(k_lens),
        "block_table": table.to(device),
    }


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # (1, num_heads, num_tokens, head_dim)
    key: torch.Tensor,  # (1, num_kv_heads, num_tokens, head_dim)
    value: torch.Tensor,  # (1, num_kv_heads, num_tokens, head_dim)
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    paged: PagedBatch | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """Returns (1, num_tokens, num_heads, head_dim), as transformers' interface expects."""
    if paged is None:  # plain call (e.g. model.generate on the same model): ordinary SDPA
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    layer = module.layer_idx
    q = query[0].transpose(0, 1)  # (num_tokens, num_heads, head_dim)
    paged.kv.write(layer, key[0].transpose(0, 1), value[0].transpose(0, 1), paged.slot_mapping)
    if paged.static is not None:
        out = _static_attention(paged, layer, q, scaling)
    elif paged.varlen is not None:
        out = _flash_attention(paged, layer, q, scaling)
    else:
        out = _sdpa_attention(paged, layer, q, scaling)
    return out.unsqueeze(0), None


def _sdpa_attention(
    paged: PagedBatch, layer: int, q: torch.Tensor, scaling: float | None
) -> torch.Tensor:
    out = torch.empty_like(q)  # (num_tokens, num_heads, head_dim)
    if paged.decode_rows is not None:
        k, v = paged.kv.gather(layer, paged.decode_blocks)  # (nd, L, num_kv_heads, head_dim)
        q_dec = q.index_select(0, paged.decode_rows).unsqueeze(2)  # (nd, num_heads, 1, head_dim)
        o = F.scaled_dot_product_attention(
            q_dec,
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=paged.decode_mask,
            scale=scaling,
            enable_gqa=True,
        )  # (nd, num_heads, 1, head_dim)
        out.index_copy_(0, paged.decode_rows, o.squeeze(2))
    for span in paged.spans:
        k, v = paged.kv.gather(layer, span.block_table[None])  # (1, L, num_kv_heads, head_dim)
        k, v = k[:, : span.ctx_len].transpose(1, 2), v[:, : span.ctx_len].transpose(1, 2)
        q_seq = q[span.q_start : span.q_start + span.q_len].transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(
            q_seq,
            k,
            v,
            attn_mask=span.mask,
            is_causal=span.mask is None,
            scale=scaling,
            enable_gqa=True,
        )  # (1, num_heads, q_len, head_dim)
        out[span.q_start : span.q_start + span.q_len] = o[0].transpose(0, 1)
    return out


def _flash_attention(
    paged: PagedBatch, layer: int, q: torch.Tensor, scaling: float | None
) -> torch.Tensor:  # pragma: no cover - needs CUDA and flash-attn
    meta = paged.varlen
    return flash_attn_varlen_func(
        q,
        paged.kv.keys[layer],
        paged.kv.values[layer],
        meta["cu_seqlens_q"],
        meta["cu_seqlens_k"],
        meta["max_seqlen_q"],
        meta["max_seqlen_k"],
        softmax_scale=scaling,
        causal=True,  # bottom-right aligned: extends see their whole prefix
        block_table=meta["block_table"],
    )


def _static_attention(
    paged: PagedBatch, layer: int, q: torch.Tensor, scaling: float | None
) -> torch.Tensor:
    meta = paged.static
    b, n = meta.batch, meta.q_len
    q = q.view(b, n, q.shape[1], q.shape[2])  # (batch, q_len, num_heads, head_dim)
    if meta.mask is None:  # pragma: no cover - needs CUDA and flash-attn
        out = flash_attn_with_kvcache(
            q,
            paged.kv.keys[layer],
            paged.kv.values[layer],
            cache_seqlens=meta.ctx_lens,
            block_table=meta.block_table,
            softmax_scale=scaling,
            causal=True,  # bottom-right aligned: the real (last) rows see their prefix
        )  # (batch, q_len, num_heads, head_dim)
    else:
        k, v = paged.kv.gather(layer, meta.block_table)  # (batch, W*bs, kv_heads, head_dim)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=meta.mask,
            scale=scaling,
            enable_gqa=True,
        ).transpose(1, 2)  # (batch, q_len, num_heads, head_dim)
    return out.reshape(b * n, out.shape[2], out.shape[3])


def register_attention() -> str:
    """Make the paged kernel available to ``from_pretrained(attn_implementation=...)``."""
    if ATTN_IMPLEMENTATION not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION
