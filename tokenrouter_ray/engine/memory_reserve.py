"""Device memory a replica needs beyond weights and KV: activations and CUDA graphs.

The KV cache is sized from what is free after the weights load (``Engine.from_config``).
Before it takes its share, ``forward_reserve_bytes`` is set aside for what a forward
allocates on top: the largest dynamic step (``max_num_batched_tokens`` tokens through the
MLP, one prefill span's gathered K/V, the sampled rows' fp32 logits), the static buckets'
shared graph pool (the largest bucket's activations and its SDPA K/V gather), and a fixed
margin for the CUDA context, cuBLAS workspaces and allocator fragmentation. It is an
estimate with generous factors, not a measurement: the device check reports the peak.
"""

from __future__ import annotations

from transformers import PretrainedConfig

from tokenrouter_ray.engine.static_forward import MAX_STATIC_GATHER_TOKENS

FIXED_MARGIN_BYTES = 1 << 30  # context, cuBLAS/cuDNN workspaces, fragmentation


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
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    inter = getattr(cfg, "intermediate_size", None) or 4 * hidden
    vocab = cfg.vocab_size

    def step(tokens: int, gathered: int, sampled: int) -> int:
        per_token = 6 * hidden + 3 * inter + (heads + 2 * kv_heads) * head_dim
        kv_gather = 2 * gathered * kv_heads * head_dim
        return (tokens * per_token + kv_gather) * dtype_bytes + sampled * vocab * 4 * 2

    dynamic = step(max_num_batched_tokens, max_model_len, max_num_seqs)
    static = step(static_rows, MAX_STATIC_GATHER_TOKENS, max_num_seqs) if graphs else 0
    return 2 * (dynamic + static) + FIXED_MARGIN_BYTES
