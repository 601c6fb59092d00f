"""Bucketed, fixed-shape forwards: the CUDA-graph path for decodes and small extends.

After the prefill, almost every step is a batch of decodes (one token per request) and, on
a routed model, small extends (a handoff resumes a pending request with the few tokens it
has not seen). ``StaticForward`` runs such a batch in a fixed shape: ``batch`` sequences of
``q_len`` query rows each, both rounded up to a bucket. Real tokens sit in the *last* rows
of their sequence (front padding), so causal attention aligned bottom-right (flash-attn's
convention) is right for them; padded rows and padded sequences read and write a scratch KV
block that the block pool never hands out. Only the last row of every sequence goes through
``lm_head``: a static batch is eligible only when every chunk samples.

All metadata is built on the host as plain lists, one tensor per field, and copied into
preallocated device buffers; the SDPA mask is computed on the device from the context
lengths inside the forward (``static_mask``), so no mask crosses the bus. The last rows'
logits and hidden states land in one set of output buffers all buckets share
(``StaticOutputs``). On CUDA each bucket's forward is captured once as a CUDA
graph (``StaticForward.capture``) and replayed; elsewhere the same code runs eagerly, which
is how the CPU tests check the path token for token against the dynamic one. A graph's
outputs are copied into the shared output buffers, and ``run`` copies them out, for the
policy to keep.

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
    each with 1..``q_len`` new tokens. Filled as Python lists, then one tensor per field
    (no small tensor op per sequence). ``with_mask``: build the SDPA mask here too (the
    runner leaves it to the forward, which computes it on the device from ``ctx_lens``)."""
    rows = batch * q_len
    scratch_slot = scratch_block * block_size
    ids = [0] * rows
    pos = [0] * rows
    slots = [scratch_slot] * rows
    table = [[scratch_block] * max_blocks for _ in range(batch)]
    ctx = [1] * batch  # padded sequences: one scratch token
    for i, (start, tokens, blocks) in enumerate(seqs):
        n = len(tokens)
        end = start + n
        first = i * q_len + q_len - n  # front padding: real rows last
        ids[first : first + n] = tokens
        pos[first : first + n] = range(start, end)
        slots[first : first + n] = [
            blocks[p // block_size] * block_size + p % block_size for p in range(start, end)
        ]
        used = -(-end // block_size)
        table[i][:used] = blocks[:used]
        ctx[i] = end
    ctx_lens = torch.tensor(ctx, dtype=torch.int32)
    mask = static_mask(ctx_lens, q_len, max_blocks * block_size) if with_mask else None
    return HostBatch(
        torch.tensor(ids, dtype=torch.long),
        torch.tensor(pos, dtype=torch.long),
        torch.tensor(slots, dtype=torch.long),
        torch.tensor(table, dtype=torch.int32),
        ctx_lens,
        mask,
        len(seqs),
    )


def static_mask(ctx_lens: torch.Tensor, q_len: int, width: int) -> torch.Tensor:
    """(B, 1, L, width) bool SDPA mask from ``ctx_lens`` (B,), on their device. Query row j
    of sequence i sits at ctx_i - q_len + j (bottom-right) and sees keys up to it; rows
    before the sequence start see key 0 only (never an empty row). No host read: the
    captured forward computes it on the device."""
    rows = torch.arange(q_len, device=ctx_lens.device)
    q_pos = (ctx_lens[:, None].long() - q_len + rows[None, :]).clamp(min=0)  # (B, L)
    k_pos = torch.arange(width, device=ctx_lens.device)  # (width,)
    return (k_pos[None, None, :] <= q_pos[:, :, None])[:, None]  # (B, 1, L, width)


def padding_batch(
    batch: int, q_len: int, max_blocks: int, block_size: int, scratch_block: int, with_mask: bool
) -> HostBatch:
    """A bucket with no real sequence: every row reads and writes the scratch block."""
    return build_host_batch([], batch, q_len, max_blocks, block_size, scratch_block, with_mask)


@dataclass
class StaticOutputs:
    """Output buffers every bucket writes into (allocated once, outside any graph): the
    last rows' fp32 logits and hidden states. A graph's own outputs would stay allocated
    in the pool per graph (about 1 GiB of fp32 logits over the buckets at Qwen3's
    vocabulary); steps run one at a time and ``run`` copies out, so one set serves all."""

    logits: torch.Tensor  # (max_batch, vocab) float32
    hidden: torch.Tensor  # (max_batch, hidden)

    @classmethod
    def allocate(
        cls, max_batch: int, vocab: int, hidden: int, dtype: torch.dtype, device: torch.device
    ) -> StaticOutputs:
        return cls(
            torch.zeros((max_batch, vocab), dtype=torch.float32, device=device),
            torch.zeros((max_batch, hidden), dtype=dtype, device=device),
        )


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
        outputs: StaticOutputs | None = None,
    ) -> None:
        self.decoder, self.lm_head = decoder, lm_head
        self.outputs = outputs
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
            decode=[],
            static=self.meta,
        )
        # Buffers start as padding, aimed at the scratch block (see the module doc).
        self.padding = padding_batch(batch, q_len, max_blocks, kv.block_size, scratch_block,
                                     with_mask=False)  # fmt: skip
        self.load(self.padding)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.hidden: torch.Tensor | None = None  # (batch, hidden) outputs of the last run
        self.logits: torch.Tensor | None = None  # (batch, vocab)

    def _forward(self) -> None:
        if self.meta.mask is not None:  # SDPA: the mask from ctx_lens, on the device
            width = self.meta.mask.shape[-1]
            self.meta.mask.copy_(static_mask(self.meta.ctx_lens, self.q_len, width))
        hidden = self.decoder(
            input_ids=self.input_ids,
            position_ids=self.positions,
            use_cache=False,
            paged=self.paged,
        ).last_hidden_state[0]  # (batch*q_len, hidden)
        last = hidden.view(self.batch, self.q_len, -1)[:, -1]  # last row per sequence
        logits = self.lm_head(last)  # (batch, vocab)
        out = self.outputs
        if out is None or out.logits.shape[1] != logits.shape[-1] or len(out.logits) < self.batch:
            self.hidden, self.logits = last, logits.float()  # this bucket's own outputs
            return
        self.hidden, self.logits = out.hidden[: self.batch], out.logits[: self.batch]
        self.hidden.copy_(last)
        self.logits.copy_(logits)  # to fp32 in place

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

    def run(self, host: HostBatch, replay: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, last hidden) of the real sequences; copies, so the next replay cannot
        overwrite what a policy still reads. ``replay=False``: run the forward eagerly even
        when captured (forward hooks, e.g. a layer tap, run only then)."""
        self.load(host)
        if self.graph is not None and replay:  # pragma: no cover - needs CUDA
            self.graph.replay()
        else:
            self._forward()
        n = host.num_seqs
        return self.logits[:n].clone(), self.hidden[:n].clone()
