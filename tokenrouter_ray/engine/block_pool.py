"""KV block accounting: which physical blocks each request owns. No tensors here.

``BlockPool`` hands out fixed-size block ids from an O(1) free list and keeps a reference
count per block (a block shared by several requests, e.g. ``n > 1`` samples of one prompt,
is freed when the last owner lets go). ``KVCacheManager`` maps requests to block tables:
the scheduler asks it for slots before scheduling tokens and gets blocks or ``None``.
Capacity planning from a memory budget lives here too.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from tokenrouter_ray.engine.request import Request


class BlockPool:
    """Fixed-size blocks with ref counts and a FIFO free list (O(1) allocate and free)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """Return ``n`` fresh blocks (ref count 1), or ``None`` without side effects."""
        if n > len(self._free):
            return None
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def incref(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            if self.ref_counts[b] == 0:
                raise ValueError(f"block {b} is free; cannot share it")
            self.ref_counts[b] += 1

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block; blocks reaching zero return to the free list."""
        for b in blocks:
            if self.ref_counts[b] <= 0:
                raise ValueError(f"double free of block {b}")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free.append(b)


class KVCacheManager:
    """Per-request block tables over one ``BlockPool``."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Make room for KV of ``num_new_tokens`` past ``request.num_computed_tokens``.

        Returns the newly allocated blocks (possibly empty) or ``None`` if the pool cannot
        supply them, in which case nothing changed.
        """
        total = request.num_computed_tokens + num_new_tokens
        missing = self.blocks_needed(total) - len(request.block_ids)
        if missing <= 0:
            return []
        blocks = self.pool.allocate(missing)
        if blocks is None:
            return None
        request.block_ids.extend(blocks)
        return blocks

    def truncate(self, request: Request, num_tokens: int) -> None:
        """Keep KV for the first ``num_tokens`` positions only; free the blocks past them."""
        keep = self.blocks_needed(num_tokens)
        if keep < len(request.block_ids):
            self.pool.free(request.block_ids[keep:])
            del request.block_ids[keep:]
        request.keep_computed(num_tokens)

    def free(self, request: Request) -> None:
        if request.block_ids:
            self.pool.free(request.block_ids)
            request.block_ids = []
        request.keep_computed(0)


@dataclass(frozen=True)
class ModelFootprint:
    """What one model costs on a device: its weights and its KV bytes per token."""

    weight_bytes: int
    kv_bytes_per_token: int


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Keys and values for one token across all layers."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def device_budget(budget_bytes: int, weight_bytes: int, free_bytes: int | None) -> int:
    """The budget a device can honour: with its free memory known (after the weights were
    loaded), weights plus at most 90 % of what is free, never more than asked for."""
    if free_bytes is None:
        return budget_bytes
    return min(budget_bytes, weight_bytes + int(0.9 * free_bytes))


def plan_num_blocks(budget_bytes: int, model: ModelFootprint, block_size: int) -> int:
    """Blocks that fit in ``budget_bytes`` after the weights; a clear error if none do."""
    return plan_joint(budget_bytes, [model], block_size)[0]


def plan_joint(
    budget_bytes: int, models: Sequence[ModelFootprint], block_size: int | Sequence[int]
) -> list[int]:
    """Blocks per model for several models sharing one device (``block_size``: one for all,
    or one per model).

    Each model must be able to hold the same K tokens of context (every active request may
    visit every model), so K is the largest value with
    ``sum_i(weight_i + K * kv_bytes_per_token_i) <= budget``; each model gets K tokens,
    rounded down to whole blocks of its own size.
    """
    sizes = [block_size] * len(models) if isinstance(block_size, int) else list(block_size)
    if len(sizes) != len(models):
        raise ValueError(f"need one block size per model ({len(models)}), got {len(sizes)}")
    weights = sum(m.weight_bytes for m in models)
    per_token = sum(m.kv_bytes_per_token for m in models)
    free = budget_bytes - weights
    tokens = free // per_token if per_token > 0 else 0
    blocks = [tokens // size for size in sizes]
    if min(blocks) < 1:
        one_block = per_token * max(sizes)  # K >= the largest block size
        raise ValueError(
            f"memory budget {budget_bytes / 2**20:.0f} MiB leaves no room for KV: weights take "
            f"{weights / 2**20:.0f} MiB and one block of {max(sizes)} tokens on every model "
            f"needs {one_block / 2**20:.1f} MiB"
        )
    return blocks
