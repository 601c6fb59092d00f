"""Bucketed, fixed-shape forwards: the CUDA-graph path for decodes and small extends.

After the prefill, almost every step is a batch of decodes (one token per request) and, on
a routed model, small extends (a handoff resumes a pending request with the few tokens it
has not seen). ``StaticForward`` runs such a batch in a fixed shape: ``batch`` sequences of
``q_len`` query rows each, both rounded up to a bucket. Real tokens sit in the *last* rows
of their sequence (front padding), so causal attention aligned bottom-right (flash-attn's
convention) is right for them; padded rows and padded sequences read and write a scratch KV
block that the block pool never hands out. Only the last row of every sequence goes through
``lm_head``: a static batch is eligible only when every chunk samples.

All metadata is built on the host and copied into preallocated device buffers, then the
forward runs on those buffers. On CUDA each bucket's forward is captured once as a CUDA
graph (``StaticForward.capture``) and replayed; elsewhere the same code runs eagerly, which
is how the CPU tests check the path token for token against the dynamic one. A graph's
outputs stay allocated in the shared pool, so no other bucket's replay overwrites them;
``run`` copies them out all the same, for the policy to keep.

Buckets: batch size, query rows per sequence, and KV width in blocks (powers of two up to
``MAX_STATIC_CONTEXT`` tokens for SDPA, whose longer contexts take the dynamic path), so the
SDPA fallback gathers at most twice the longest context; flash-attn reads the block table
in place and needs one width, the model length. On CUDA every bucket is captured when the
replica starts (``ModelRunner.capture_static``), largest first into one shared memory
pool, never mid-serving: a step whose bucket has no graph takes the dynamic path.

A bucket's buffers start as an all-padding batch (``padding_batch``: every slot and block
in the scratch block), so warming up and capturing, which run the forward for real, write
only into the scratch block and never into a block the pool hands to a request.

Models whose RoPE reads positions back to the host as the cache grows (``dynamic`` NTK,
``longrope``) cannot be captured: ``static_path_blocker`` names them and they run eagerly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenrouter_ray.engine.attention import PagedBatch, StaticMeta
from tokenrouter_ray.engine.kv_cache import PagedKVCache

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_QUERY_BUCKETS = (1, 2, 4, 8)
# Longest context a static bucket covers. Past it the dynamic path runs: the SDPA fallback
# gathers batch x width tokens of K/V per layer, and every width is one more graph.
MAX_STATIC_CONTEXT = 4096
# SDPA fallback only: a bucket may gather at most this many tokens of K/V per layer
# (batch x width x block_size); bigger (batch, width) pairs take the dynamic path.
MAX_STATIC_GATHER_TOKENS = 64 * 1024


def bucket(value: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket >= value, or None when the value is past the largest."""
    return next((b for b in buckets if b >= value), None)


def width_buckets(
    max_blocks: int, block_size: int, max_context: int | None = MAX_STATIC_CONTEXT
) -> tuple[int, ...]:
    """KV widths in blocks: powers of two, then the cap (the model length or
    ``max_context`` tokens, whichever is smaller; None: the model length)."""
    cap = max_blocks if max_context is None else min(max_blocks, -(-max_context // block_size))
    cap = max(1, cap)
    widths, w = [], 1
    while w < cap:
        widths.append(w)
        w *= 2
    return (*widths, cap)


def static_shapes(
    batch_buckets: Sequence[int],
    query_buckets: Sequence[int],
    widths: Sequence[int],
    block_size: int,
    use_flash: bool,
    max_gather_tokens: int = MAX_STATIC_GATHER_TOKENS,
) -> list[tuple[int, int, int]]:
    """Every (batch, q_len, width) bucket the static path serves, largest first (the order
    to capture them in: later, smaller graphs reuse the shared pool's memory). flash-attn
    reads the block table in place, so it needs only the widest width; SDPA gathers, so it
    gets every width within the gather budget."""
    if use_flash:
        widths = widths[-1:]
    shapes = [
        (b, q, w)
        for b in batch_buckets
        for q in query_buckets
        for w in widths
        if use_flash or b * w * block_size <= max_gather_tokens
    ]
    return sorted(shapes, key=lambda s: (s[0] * s[1] * s[2], s), reverse=True)


def static_path_blocker(model: torch.nn.Module) -> str | None:
    """Why this model cannot run the static path, or None. RoPE variants that grow their
    cache from the positions seen (``dynamic``, ``longrope``) read them on the host."""
    for module in model.modules():
        rope_type = getattr(module, "rope_type", None)
        kinds = rope_type.values() if isinstance(rope_type, dict) else [rope_type]
        for kind in kinds:
            if isinstance(kind, str) and ("dynamic" in kind or kind == "longrope"):
                return f"{kind} RoPE reads positions on the host (no CUDA graphs)"
    return None


@dataclass
class HostBatch:
    """One step's static metadata on the host (CPU tensors), ready to copy."""

    input_ids: torch.Tensor  # (B*L,)
    positions: torch.Tensor  # (B*L,)
    slots: torch.Tensor  # (B*L,)
    block_table: torch.Tensor  # (B, W) int32
    ctx_lens: torch.Tensor  # (B,) int32
    mask: torch.Tensor | None  # (B, 1, L, W*bs) bool (SDPA)
    num_seqs: int  # real sequences (rows 0..num_seqs-1)


def build_host_batch(
    seqs: Sequence[tuple[int, Sequence[int], Sequence[int]]],
    batch: int,
    q_len: int,
    max_blocks: int,
    block_size: int,
    scratch_block: int,
    with_mask: bool,
) -> HostBatch:
    """``seqs``: per sequence (start, new token ids, block ids), at most ``batch`` of them,
    each with 1..``q_len`` new tokens."""
    rows = batch * q_len
    scratch_slot = scratch_block * block_size
    ids = torch.zeros(rows, dtype=torch.long)
    pos = torch.zeros(rows, dtype=torch.long)
    slots = torch.full((rows,), scratch_slot, dtype=torch.long)
    table = torch.full((batch, max_blocks), scratch_block, dtype=torch.int32)
    ctx = torch.ones(batch, dtype=torch.int32)  # padded sequences: one scratch token
    for i, (start, tokens, blocks) in enumerate(seqs):
        n = len(tokens)
        end = start + n
        first = i * q_len + q_len - n  # front padding: real rows last
        ids[first : first + n] = torch.as_tensor(tokens, dtype=torch.long)
        pos[first : first + n] = torch.arange(start, end)
        p = torch.arange(start, end)
        used = torch.as_tensor(blocks[: -(-end // block_size)], dtype=torch.long)
        slots[first : first + n] = used[p // block_size] * block_size + p % block_size
        table[i, : len(used)] = used.to(torch.int32)
        ctx[i] = end
    mask = None
    if with_mask:
        # Query row j of sequence i sits at ctx_i - q_len + j (bottom-right) and sees keys
        # up to it; rows before the sequence start see key 0 only (never an empty row).
        q_pos = ctx[:, None].long() - q_len + torch.arange(q_len)[None, :]  # (B, L)
        k_pos = torch.arange(max_blocks * block_size)  # (W*bs,)
        mask = k_pos[None, None, :] <= q_pos.clamp(min=0)[:, :, None]  # (B, L, W*bs)
        mask = mask[:, None]  # (B, 1, L, W*bs)
    return HostBatch(ids, pos, slots, table, ctx, mask, len(seqs))


def padding_batch(
    batch: int, q_len: int, max_blocks: int, block_size: int, scratch_block: int, with_mask: bool
) -> HostBatch:
    """A bucket with no real sequence: every row reads and writes the scratch block."""
    return build_host_batch([], batch, q_len, max_blocks, block_size, scratch_block, with_mask)


class StaticForward:
    """One (batch, q_len) bucket: device buffers, the forward on them, maybe a CUDA graph."""

    def __init__(
        self,
        decoder: torch.nn.Module,
        lm_head: torch.nn.Module,
        kv: PagedKVCache,
        batch: int,
        q_len: int,
        max_blocks: int,
        use_flash: bool,
        scratch_block: int,
    ) -> None:
        self.decoder, self.lm_head = decoder, lm_head
        self.batch, self.q_len, self.max_blocks = batch, q_len, max_blocks
        device = kv.keys[0].device
        rows = batch * q_len
        width = max_blocks * kv.block_size
        self.input_ids = torch.zeros((1, rows), dtype=torch.long, device=device)
        self.positions = torch.zeros((1, rows), dtype=torch.long, device=device)
        mask = None if use_flash else torch.ones((batch, 1, q_len, width), dtype=torch.bool,
                                                 device=device)  # fmt: skip
        self.meta = StaticMeta(
            batch=batch,
            q_len=q_len,
            block_table=torch.zeros((batch, max_blocks), dtype=torch.int32, device=device),
            ctx_lens=torch.ones(batch, dtype=torch.int32, device=device),
            mask=mask,
        )
        self.paged = PagedBatch(
            kv=kv,
            slot_mapping=torch.zeros(rows, dtype=torch.long, device=device),
            spans=[],
            decode_rows=None,
            decode_blocks=None,
            decode_mask=None,
            static=self.meta,
        )
        # Buffers start as padding, aimed at the scratch block (see the module doc).
        self.padding = padding_batch(batch, q_len, max_blocks, kv.block_size, scratch_block,
                                     with_mask=not use_flash)  # fmt: skip
        self.load(self.padding)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.hidden: torch.Tensor | None = None  # (batch, hidden) outputs of the last run
        self.logits: torch.Tensor | None = None  # (batch, vocab)

    def _forward(self) -> None:
        hidden = self.decoder(
            input_ids=self.input_ids,
            position_ids=self.positions,
            use_cache=False,
            paged=self.paged,
        ).last_hidden_state[0]  # (batch*q_len, hidden)
        self.hidden = hidden.view(self.batch, self.q_len, -1)[:, -1]  # last row per sequence
        self.logits = self.lm_head(self.hidden).float()

    def warm_up(self, steps: int = 2) -> None:
        """Run the all-padding batch ``steps`` times (allocator, kernel autotuning): reads
        and writes only the scratch block. On CUDA on a side stream, as capture wants."""
        self.load(self.padding)
        if self.input_ids.device.type != "cuda":
            for _ in range(steps):
                self._forward()
            return
        stream = torch.cuda.Stream()  # pragma: no cover - needs CUDA
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(steps):
                self._forward()
        torch.cuda.current_stream().wait_stream(stream)

    def capture(self, pool: object | None) -> None:  # pragma: no cover - needs CUDA
        """Warm up, then record the forward on the padding batch into ``pool``.
        ``thread_local``: another thread's CUDA call (a serving thread, a Ray thread)
        cannot invalidate this capture, and this capture cannot break theirs."""
        self.warm_up()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            self._forward()
        torch.cuda.current_stream().synchronize()
        self.graph = graph

    def load(self, host: HostBatch) -> None:
        self.input_ids[0].copy_(host.input_ids, non_blocking=True)
        self.positions[0].copy_(host.positions, non_blocking=True)
        self.paged.slot_mapping.copy_(host.slots, non_blocking=True)
        self.meta.block_table.copy_(host.block_table, non_blocking=True)
        self.meta.ctx_lens.copy_(host.ctx_lens, non_blocking=True)
        if self.meta.mask is not None:
            self.meta.mask.copy_(host.mask, non_blocking=True)

    def run(self, host: HostBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, last hidden) of the real sequences; copies, so the next replay cannot
        overwrite what a policy still reads."""
        self.load(host)
        if self.graph is not None:  # pragma: no cover - needs CUDA
            self.graph.replay()
        else:
            self._forward()
        n = host.num_seqs
        return self.logits[:n].clone(), self.hidden[:n].clone()
