"""Device memory a replica needs beyond weights and KV: activations and CUDA graphs.

The KV cache is sized from what is free after the weights load (``Engine.from_config``).
Before it takes its share, ``forward_reserve`` (a loaded model and its ``EngineConfig``;
``forward_reserve_bytes`` on the raw shapes) is set aside for what a forward
allocates on top: the largest dynamic step (``max_num_batched_tokens`` tokens through the
MLP; the largest SDPA K/V gather one layer makes, which is one decode group's, at most
``MAX_DECODE_GATHER_TOKENS`` or one row of the longest context, or one prefill span's
whole context, with its folded mask; the sampled rows' fp32 logits), the static buckets'
shared graph pool (the largest bucket's activations and its SDPA K/V gather), and a fixed
margin for the CUDA context, cuBLAS workspaces and allocator fragmentation. Gathers are
transient (one layer's at a time), so the largest one counts, not their sum. It is an
estimate with generous factors, not a measurement: the device check reports the peak.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenrouter_ray.engine.attention import MAX_SPAN_MASK_ELEMENTS, decode_gather_tokens
from tokenrouter_ray.engine.static_forward import (
    DEFAULT_BATCH_BUCKETS,
    DEFAULT_QUERY_BUCKETS,
    MAX_STATIC_GATHER_TOKENS,
)

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

    from tokenrouter_ray.engine.config import EngineConfig

FIXED_MARGIN_BYTES = 1 << 30  # context, cuBLAS/cuDNN workspaces, fragmentation


@dataclass(frozen=True)
class AttentionShape:
    heads: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, cfg: PretrainedConfig) -> AttentionShape:
        heads = cfg.num_attention_heads
        return cls(
            heads=heads,
            kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        )


def gather_bytes(cfg: PretrainedConfig, dtype_bytes: int, tokens: int) -> int:
    """One layer's SDPA gather of ``tokens`` K/V tokens: K and V, each maybe copied once
    more when SDPA wants them contiguous, plus the folded mask (one query row per token
    at most per group) as bool and as the additive float mask SDPA makes of it."""
    shape = AttentionShape.of(cfg)
    kv = 2 * 2 * tokens * shape.kv_heads * shape.head_dim * dtype_bytes
    group = shape.heads // shape.kv_heads
    mask = group * tokens * (1 + dtype_bytes)
    return kv + mask


def dynamic_gather_bytes(cfg: PretrainedConfig, dtype_bytes: int, max_model_len: int) -> int:
    """The largest gather a dynamic step makes in one layer: a decode group's (the budget,
    or a lone row of the longest context) or a span's context, plus an extend's chunked
    mask (bool and float)."""
    tokens = decode_gather_tokens(max_model_len)
    return gather_bytes(cfg, dtype_bytes, tokens) + MAX_SPAN_MASK_ELEMENTS * (1 + dtype_bytes)


def forward_reserve_bytes(
    cfg: PretrainedConfig,
    dtype_bytes: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    static_rows: int,
    graphs: bool,
) -> int:
    """Bytes to keep free for activations (and graphs when ``graphs``)."""
    hidden = cfg.hidden_size
    shape = AttentionShape.of(cfg)
    inter = getattr(cfg, "intermediate_size", None) or 4 * hidden
    vocab = cfg.vocab_size

    def step(tokens: int, gather: int, sampled: int) -> int:
        per_token = 6 * hidden + 3 * inter + (shape.heads + 2 * shape.kv_heads) * shape.head_dim
        return tokens * per_token * dtype_bytes + gather + sampled * vocab * 4 * 2

    dynamic = step(
        max_num_batched_tokens, dynamic_gather_bytes(cfg, dtype_bytes, max_model_len), max_num_seqs
    )
    static_gather = gather_bytes(cfg, dtype_bytes, MAX_STATIC_GATHER_TOKENS)
    static = step(static_rows, static_gather, max_num_seqs) if graphs else 0
    return 2 * (dynamic + static) + FIXED_MARGIN_BYTES


def forward_reserve(model: torch.nn.Module, config: EngineConfig) -> int:
    """Device bytes a replica of ``model`` built from ``config`` keeps free for activations
    and CUDA graphs before the KV cache takes the rest (one rank's share under tensor
    parallel: ``model`` is that rank's shard)."""
    cfg = model.config
    limit = getattr(cfg, "max_position_embeddings", None) or 4096
    return forward_reserve_bytes(
        cfg,
        next(model.parameters()).element_size(),
        config.scheduler.max_num_batched_tokens,
        config.scheduler.max_num_seqs,
        min(config.max_model_len or limit, limit),
        static_rows=max(DEFAULT_BATCH_BUCKETS) * max(DEFAULT_QUERY_BUCKETS),
        graphs=config.cuda_graphs,
    )
