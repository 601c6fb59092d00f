"""KV block accounting: which physical blocks each request owns, and which blocks hold a
cached prefix. No tensors here.

``BlockPool`` hands out fixed-size block ids and keeps a reference count per block (a
block shared by several requests is freed when the last owner lets go). With prefix caching
(on by default), a full block whose KV is computed is registered under its content hash
(``block_hash.py``: chained over the blocks before it, salted by the request's
``cache_salt``); when its last owner frees it, it stays in the free queue *and* in the
cache until it is reused for new KV, least recently freed first. Free blocks that hold no
cached prefix are handed out before cached ones. Cached free blocks count as free.

``KVCacheManager`` maps requests to block tables. The scheduler asks ``cached_prefix`` for a
request computing its tokens for the first time here (a prompt, a handoff's first visit, a
recompute after preemption) and passes the hit to ``allocate_slots``, which adopts those
blocks and allocates the rest, or returns ``None`` without side effects.

The one invariant: a block in the cache (or shared) is full and never written again. Only
full blocks with computed KV are registered; a hit never covers a request's last token (it
must go through the model to give logits); ``truncate`` into a registered block takes it
out of the cache when this request is its only owner, and otherwise gives the block up so
the request recomputes those positions in a block of its own.
Capacity planning from a memory budget lives here too.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tokenrouter_ray.engine.block_hash import BlockHash, extend_block_hashes, extra_keys
from tokenrouter_ray.engine.request import Request


class BlockPool:
    """Fixed-size blocks with ref counts, an O(1) free queue and a content-hash cache."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        # Free blocks in reuse order: plain ones first, then cached ones least recently
        # freed first (an ordered dict: O(1) pops at the front and removal of a hit).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self._cached: dict[BlockHash, int] = {}
        self.evictions = 0  # cached blocks reused for new KV, since start

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached or not): what admission may use."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks some request holds (cached free blocks excluded)."""
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache (held or free)."""
        return len(self._cached)

    def allocate(self, n: int) -> list[int] | None:
        """Return ``n`` fresh blocks (ref count 1), or ``None`` without side effects. A
        cached free block handed out leaves the cache (evicted)."""
        if n > len(self._free):
            return None
        blocks = [self._free.popitem(last=False)[0] for _ in range(n)]
        for b in blocks:
            self.ref_counts[b] = 1
            if self.block_hash[b] is not None:
                self.uncache(b)
                self.evictions += 1
        return blocks

    def incref(self, blocks: Sequence[int]) -> None:
        """Share blocks some request holds."""
        for b in blocks:
            if self.ref_counts[b] == 0:
                raise ValueError(f"block {b} is free; cannot share it")
            self.ref_counts[b] += 1

    def touch(self, blocks: Sequence[int]) -> None:
        """Take a reference to cached blocks (a prefix hit), reviving free ones."""
        for b in blocks:
            if self.block_hash[b] is None:
                raise ValueError(f"block {b} holds no cached prefix")
            if self.ref_counts[b] == 0:
                del self._free[b]
            self.ref_counts[b] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each block. A block reaching zero becomes free: at the back
        of the queue if cached (so pass a request's blocks tail first: its prefix is kept
        longest), at the front if not."""
        for b in blocks:
            if self.ref_counts[b] <= 0:
                raise ValueError(f"double free of block {b}")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free[b] = None
                if self.block_hash[b] is None:
                    self._free.move_to_end(b, last=False)

    # ----------------------------------------------------------- the prefix cache
    def lookup(self, block_hash: BlockHash) -> int | None:
        return self._cached.get(block_hash)

    def cache(self, block: int, block_hash: BlockHash) -> None:
        """Register a held, full, computed block under its hash (a duplicate of a block
        already cached stays private)."""
        if self.ref_counts[block] == 0:
            raise ValueError(f"block {block} is free; only held blocks are cached")
        if self.block_hash[block] is None and block_hash not in self._cached:
            self._cached[block_hash] = block
            self.block_hash[block] = block_hash

    def uncache(self, block: int) -> None:
        """Take a block out of the cache (its KV is about to change)."""
        h = self.block_hash[block]
        if h is not None:
            del self._cached[h]
            self.block_hash[block] = None
            if self.ref_counts[block] == 0:  # a free block: now a plain one, reused first
                self._free.move_to_end(block, last=False)


@dataclass(frozen=True)
class PrefixHit:
    """A request's cached prefix: ``blocks`` cover its first ``num_tokens`` tokens;
    ``num_query_tokens`` is the length it was looked up for (the prefix-cache counters)."""

    blocks: list[int]
    num_query_tokens: int
    block_size: int

    @property
    def num_tokens(self) -> int:
        return len(self.blocks) * self.block_size


class KVCacheManager:
    """Per-request block tables over one ``BlockPool``, with automatic prefix caching when
    ``enable_caching`` (the engine sets it from ``EngineConfig.prefix_caching``, on by
    default; a bare manager, as in scheduler tests, has it off)."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.enable_caching = enable_caching
        self.prefix_cache_queries = 0  # tokens looked up, since start (vLLM's counters)
        self.prefix_cache_hits = 0  # of those, tokens found cached

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    # ---------------------------------------------------------------- hit path
    def cached_prefix(self, request: Request) -> PrefixHit | None:
        """The cached full blocks at the start of a request about to compute its tokens
        for the first time here (no blocks, nothing computed), never covering its last
        token; ``None`` when caching is off or the request already has KV here."""
        if not self.enable_caching or request.block_ids or request.num_computed_tokens:
            return None
        hashes = self._hashes(request, (request.num_tokens - 1) // self.block_size)
        blocks = []
        for h in hashes:
            block = self.pool.lookup(h)
            if block is None:
                break
            blocks.append(block)
        return PrefixHit(blocks, request.num_tokens, self.block_size)

    def allocate_slots(
        self, request: Request, num_new_tokens: int, prefix: PrefixHit | None = None
    ) -> list[int] | None:
        """Make room for KV of ``num_new_tokens`` past ``request.num_computed_tokens`` (past
        ``prefix``, when given: its blocks are adopted and count as computed).

        Returns the newly allocated blocks (possibly empty) or ``None`` if the pool cannot
        supply them, in which case nothing changed.
        """
        self.cache_computed(request)
        hit = prefix.blocks if prefix is not None else []
        total = request.num_computed_tokens + len(hit) * self.block_size + num_new_tokens
        missing = self.blocks_needed(total) - len(request.block_ids) - len(hit)
        revived = sum(1 for b in hit if self.pool.ref_counts[b] == 0)
        if max(missing, 0) > self.pool.num_free_blocks - revived:
            return None
        if request.num_cached_tokens < 0:  # its first computation here
            request.num_cached_tokens = prefix.num_tokens if prefix is not None else 0
        if prefix is not None:
            self.pool.touch(hit)
            request.block_ids.extend(hit)
            request.num_hashed_blocks = len(hit)
            request.advance_computed(prefix.num_tokens)
            self.prefix_cache_queries += prefix.num_query_tokens
            self.prefix_cache_hits += prefix.num_tokens
        if missing <= 0:
            return []
        blocks = self.pool.allocate(missing)
        assert blocks is not None  # checked above
        request.block_ids.extend(blocks)
        return blocks

    # ---------------------------------------------------------------- release
    def truncate(self, request: Request, num_tokens: int) -> None:
        """Keep KV for the first ``num_tokens`` positions only; free the blocks past them.

        ``request.token_ids`` may have been cut to ``num_tokens`` already (an anchor). The
        block the request writes next must be its own and uncached: a cached block it alone
        holds leaves the cache; one it shares is given up and its positions recomputed.
        """
        del request.block_hashes[num_tokens // self.block_size :]  # tokens past it may change
        self.cache_computed(request)
        keep = self.blocks_needed(num_tokens)
        if keep < len(request.block_ids):
            self._release(request, keep)
        request.keep_computed(num_tokens)
        nxt = request.num_computed_tokens // self.block_size
        if (
            nxt < len(request.block_ids)
            and self.pool.block_hash[request.block_ids[nxt]] is not None
        ):
            if self.pool.ref_counts[request.block_ids[nxt]] == 1:
                self.pool.uncache(request.block_ids[nxt])
            else:  # shared: never written; recompute its positions in a fresh block
                self._release(request, nxt)
                request.keep_computed(nxt * self.block_size)
        request.num_hashed_blocks = min(request.num_hashed_blocks, nxt)

    def free(self, request: Request) -> None:
        """Release all of a request's blocks; its computed full blocks stay cached."""
        self.cache_computed(request)
        if request.block_ids:
            self._release(request, 0)
        request.num_hashed_blocks = 0
        request.keep_computed(0)

    # ---------------------------------------------------------------- helpers
    def _release(self, request: Request, keep: int) -> None:
        """Drop the request's blocks past its first ``keep``, tail first."""
        self.pool.free(reversed(request.block_ids[keep:]))
        del request.block_ids[keep:]

    def _hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """The chained hashes of the request's first ``num_blocks`` full blocks (kept on the
        request, so each block is hashed once)."""
        extend_block_hashes(
            request.block_hashes,
            request.token_ids,
            self.block_size,
            num_blocks,
            extra_keys(request.sampling.cache_salt),
        )
        return request.block_hashes[:num_blocks]

    def cache_computed(self, request: Request) -> None:
        """Cache the request's full blocks whose KV is computed and not yet registered.
        Called before its next allocation, when it is paused, truncated or freed: always
        after the forward that computed them, never while it may still be running."""
        if not self.enable_caching:
            return
        full = min(request.num_computed_tokens // self.block_size, len(request.block_ids))
        if full <= request.num_hashed_blocks:
            return
        hashes = self._hashes(request, full)
        for i in range(request.num_hashed_blocks, len(hashes)):
            self.pool.cache(request.block_ids[i], hashes[i])
        request.num_hashed_blocks = len(hashes)


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
