"""The KV tensors of one model: per layer, keys and values in fixed-size blocks.

Layout per layer: ``(num_blocks, block_size, num_kv_heads, head_dim)`` for K and for V, the
layout flash-attn's paged kernels read. Block ids come from ``block_pool``; this module only
stores and gathers.
"""

from __future__ import annotations

import torch


class PagedKVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def write(
        self, layer: int, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """Store new tokens: key/value (num_tokens, num_kv_heads, head_dim), slots (num_tokens,)."""
        flat = (-1, self.num_kv_heads, self.head_dim)
        self.keys[layer].view(flat).index_copy_(0, slots, key)
        self.values[layer].view(flat).index_copy_(0, slots, value)

    def gather(self, layer: int, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous KV of whole blocks.

        block_table: (num_seqs, max_blocks) -> K, V: (num_seqs, max_blocks * block_size,
        num_kv_heads, head_dim); positions past a sequence's length are junk to be masked.
        """
        n, m = block_table.shape
        shape = (n, m * self.block_size, self.num_kv_heads, self.head_dim)
        k = self.keys[layer].index_select(0, block_table.reshape(-1)).view(shape)
        v = self.values[layer].index_select(0, block_table.reshape(-1)).view(shape)
        return k, v
