"""Attention over the paged KV cache for one packed, variable-length batch.

The model runner registers ``paged_attention_forward`` in transformers' attention
interface under ``ATTN_IMPLEMENTATION`` and loads models with it, so every standard
decoder-only architecture (Llama family, Qwen2, Qwen3, Mistral, ...) runs on our cache
without touching its modelling code. Per-step metadata travels as an explicit forward
kwarg (``paged=PagedBatch``), never through module globals: two models in one process
each pass their own.

A batch packs all scheduled tokens into one row of ``num_tokens``. Each attention layer
writes the new K/V into its blocks, then attends:
- CPU / no flash-attn: decode rows (one query token) go through batched SDPA over their
  gathered blocks, in groups (``DecodeGroup``): rows whose contexts span a similar number
  of blocks (the same power of two) share a gather padded to the group's widest, and a
  group is split so its padded gather stays within ``MAX_DECODE_GATHER_TOKENS`` (a row
  longer than that gathers alone). One 40k-token request beside 63 short ones thus gathers
  about 40k + 63 x short tokens per layer, not 64 x 40k. Prefill and extend rows go
  through one SDPA per sequence with a causal mask offset by the tokens already in cache
  (a long extend in query chunks, so its folded mask stays within
  ``MAX_SPAN_MASK_ELEMENTS``).
- CUDA with flash-attn: one ``flash_attn_varlen_func`` call over the whole batch reading
  K/V straight from the block table. Chosen only where it can run
  (``flash_attn_unusable``): fp16/bf16, head_dim a multiple of 8 up to 256, block_size a
  multiple of 256, compute capability 8.0 or newer.
- Static (bucketed) batches, the CUDA-graph path (``static_forward.py``): every sequence
  has exactly ``L`` query rows, real tokens last (front padding), and fixed-shape metadata
  (``StaticMeta``); flash-attn's ``flash_attn_with_kvcache`` reads the block table, or SDPA
  over the gathered blocks with a precomputed mask. No shape depends on the data, so the
  forward can be captured once per (batch, L) bucket and replayed.

SDPA with grouped-query attention folds each KV head's query group into query rows
(``_attend``) rather than passing ``enable_gqa``: on CUDA a masked GQA call falls back to
SDPA's math kernel (flash rejects masks, mem-efficient rejects ``enable_gqa``), which
materializes fp32 scores of batch x heads x width; the folded call is a plain masked
attention the mem-efficient kernel takes. Attention variants the modelling code passes as
kwargs are honoured on every path: ``sliding_window`` (a token sees itself and the
``sliding_window - 1`` before it: Mistral, sliding-window Qwen2, Gemma 2) and ``softcap``
(Gemma 2's ``tanh`` capping of the scores; SDPA has none, so those layers use the explicit
softmax).

Which SDPA kernels may run is chosen, never left to PyTorch's default (which, on an H100 or
H200 with a recent cuDNN, prefers cuDNN attention: a plan built per new shape, hundreds of
ms each): ``sdpa_backends`` maps the engine's ``sdpa_backend`` setting to the allowed list
and the runner enters ``sdpa_context`` around each forward and each graph capture (CUDA
only; a no-op elsewhere). Host values reach the device through ``device_step.to_device``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from tokenrouter_ray.engine.device_step import host_to_device, to_device
from tokenrouter_ray.engine.kv_cache import PagedKVCache

ATTN_IMPLEMENTATION = "tokenrouter_paged"

try:  # optional GPU extra
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
except ImportError:  # pragma: no cover - depends on the install
    flash_attn_varlen_func = flash_attn_with_kvcache = None


FLASH_DTYPES = (torch.float16, torch.bfloat16)
# SDPA decode: one group's padded K/V gather holds at most this many tokens per layer
# (rows x width x block_size), unless one row alone is longer (it then gathers alone).
MAX_DECODE_GATHER_TOKENS = 64 * 1024
# SDPA extend: the folded mask of one call (query rows x query group x keys) holds at most
# this many elements; a long chunked-prefill extend attends in query chunks under it.
MAX_SPAN_MASK_ELEMENTS = 32 * 2**20
# Attention kwargs of modelling code that change the result and that we do not implement.
UNSUPPORTED_KWARGS = ("s_aux",)

# ``sdpa_backend`` -> the SDPA kernels allowed on CUDA (PyTorch tries them in its own
# priority order; None: PyTorch's default set, cuDNN included). "efficient", the default:
# flash where it takes the call (no mask), the memory-efficient kernel for the masked ones,
# math as the last resort; never cuDNN unless asked for.
SDPA_BACKENDS: dict[str, tuple[SDPBackend, ...] | None] = {
    "auto": None,
    "efficient": (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH),
    "flash": (SDPBackend.FLASH_ATTENTION, SDPBackend.MATH),
    "math": (SDPBackend.MATH,),
    "cudnn": (
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.MATH,
    ),
}


def sdpa_backends(choice: str) -> tuple[SDPBackend, ...] | None:
    """The SDPA kernels ``choice`` allows (None: PyTorch's own choice)."""
    if choice not in SDPA_BACKENDS:
        raise ValueError(f"sdpa_backend must be one of {', '.join(SDPA_BACKENDS)}, not {choice!r}")
    return SDPA_BACKENDS[choice]


def sdpa_context(
    backends: tuple[SDPBackend, ...] | None, device: torch.device
) -> contextlib.AbstractContextManager[None]:
    """Only ``backends`` may run SDPA inside (CUDA; elsewhere, or for None, a no-op)."""
    if backends is None or device.type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel(list(backends))  # pragma: no cover - needs CUDA


def sdpa_params(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool,
    enable_gqa: bool,
) -> torch.backends.cuda.SDPAParams:
    """The call's description PyTorch's ``can_use_*`` checks judge (no dropout): a grouped-
    query call (fewer kv heads than query heads) must say so, or the checks judge another
    call than the one that runs."""
    return torch.backends.cuda.SDPAParams(q, k, v, mask, 0.0, is_causal, enable_gqa)


def sdpa_choice(
    q: torch.Tensor,  # (n, heads, q_len, head_dim)
    k: torch.Tensor,  # (n, kv_heads, k_len, head_dim)
    v: torch.Tensor,
    mask: torch.Tensor | None,
    backends: tuple[SDPBackend, ...] | None,
    is_causal: bool = False,
    enable_gqa: bool = False,
) -> str:
    """The kernel SDPA would run for this call among ``backends`` on CUDA (PyTorch's
    priority order: cuDNN, flash, memory-efficient, math), by its own ``can_use_*`` checks
    (what the device check records); "math" off CUDA."""
    if q.device.type != "cuda":
        return "math"
    allowed = set(SDPA_BACKENDS["cudnn"] if backends is None else backends)  # pragma: no cover
    params = sdpa_params(q, k, v, mask, is_causal, enable_gqa)  # pragma: no cover
    checks = (  # pragma: no cover - needs CUDA
        (SDPBackend.CUDNN_ATTENTION, "cudnn", torch.backends.cuda.can_use_cudnn_attention),
        (SDPBackend.FLASH_ATTENTION, "flash", torch.backends.cuda.can_use_flash_attention),
        (
            SDPBackend.EFFICIENT_ATTENTION,
            "efficient",
            torch.backends.cuda.can_use_efficient_attention,
        ),
    )
    for backend, name, can_use in checks:  # pragma: no cover - needs CUDA
        if backend in allowed and can_use(params, False):
            return name
    return "math"  # pragma: no cover - needs CUDA


def flash_attn_available(device: torch.device) -> bool:
    return flash_attn_varlen_func is not None and device.type == "cuda"


def flash_attn_unusable(
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    block_size: int,
    installed: bool | None = None,
    capability: tuple[int, int] | None = None,
) -> str | None:
    """Why flash-attn's paged kernels cannot run this model here, or None when they can.

    ``installed`` and ``capability`` default to this process's flash-attn import and the
    device's compute capability; tests pass them to check the rules on CPU."""
    if installed is None:
        installed = flash_attn_varlen_func is not None
    if not installed:
        return "flash_attn is not installed"
    if device.type != "cuda":
        return f"flash-attn needs a CUDA device, not {device.type}"
    if dtype not in FLASH_DTYPES:
        return f"flash-attn runs float16/bfloat16 only, the model is {dtype}"
    if head_dim % 8 or head_dim > 256:
        return f"flash-attn needs head_dim a multiple of 8 up to 256, not {head_dim}"
    if block_size % 256:
        return f"flash-attn's paged kernels need block_size % 256 == 0, not {block_size}"
    if capability is None:
        capability = torch.cuda.get_device_capability(device)
    if capability < (8, 0):
        return f"flash-attn 2 needs compute capability 8.0+, the device has {capability}"
    return None


@dataclass
class SeqSpan:
    """A sequence computing more than one token this step (prefill or extend)."""

    q_start: int  # first row in the packed batch
    q_len: int
    ctx_len: int  # tokens in cache after this step, including the new ones
    block_table: torch.Tensor  # (num_blocks,)
    mask: torch.Tensor | None  # (q_len, ctx_len) bool; None: plain causal (fresh prefill)


@dataclass
class DecodeGroup:
    """Decode rows attended together over one padded gather of their blocks."""

    rows: torch.Tensor  # (n,) packed rows with one query token
    blocks: torch.Tensor  # (n, width) block table, padded with block 0 (masked)
    mask: torch.Tensor  # (n, 1, 1, width * block_size) bool: keys within each context


def decode_groups(
    tables: Sequence[Sequence[int]], block_size: int, max_tokens: int = MAX_DECODE_GATHER_TOKENS
) -> list[list[int]]:
    """Indices into ``tables`` (each row's used blocks), grouped: rows whose block counts
    round up to the same power of two, in chunks whose padded gather (rows x the chunk's
    widest x block_size) stays within ``max_tokens``; a longer row forms a chunk alone."""
    by_width: dict[int, list[int]] = {}
    for i, t in enumerate(tables):
        by_width.setdefault(1 << max(len(t) - 1, 0).bit_length(), []).append(i)
    groups: list[list[int]] = []
    for _, members in sorted(by_width.items()):
        members.sort(key=lambda i: len(tables[i]))
        chunk: list[int] = []
        for i in members:  # ascending width: the newest member is the chunk's widest
            if chunk and (len(chunk) + 1) * len(tables[i]) * block_size > max_tokens:
                groups.append(chunk)
                chunk = []
            chunk.append(i)
        groups.append(chunk)
    return groups


def decode_gather_tokens(max_model_len: int, max_tokens: int = MAX_DECODE_GATHER_TOKENS) -> int:
    """The most K/V tokens one decode group gathers per layer: the budget, or one row of
    the longest context (rounded up to whole blocks by the caller's block size)."""
    return max(max_model_len, max_tokens)


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
    decode: list[DecodeGroup]  # decode rows, grouped by context width (SDPA only)
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
                table = to_device(used, torch.long, device)  # (num_used_blocks,)
                spans.append(SeqSpan(row, n, ctx, table, mask))
            row += n
        batch = cls(
            kv=kv,
            slot_mapping=to_device(slots, torch.long, device),  # (num_tokens,)
            spans=spans,
            decode=[],
        )
        if use_flash:
            batch.varlen = _varlen_metadata(seqs, bs, device)
        for group in decode_groups(dec_tables, bs):
            if not group:
                continue
            width = max(len(dec_tables[i]) for i in group)
            table = [list(dec_tables[i]) + [0] * (width - len(dec_tables[i])) for i in group]
            lens = torch.tensor([dec_lens[i] for i in group])  # (n,) on the host
            mask = torch.arange(width * bs)[None, :] < lens[:, None]  # (n, width * bs)
            batch.decode.append(
                DecodeGroup(
                    rows=to_device([dec_rows[i] for i in group], torch.long, device),
                    blocks=to_device(table, torch.long, device),  # (n, width)
                    mask=host_to_device(mask[:, None, None, :], device),  # (n, 1, 1, width * bs)
                )
            )
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
        "cu_seqlens_q": host_to_device(cu(q_lens), device),
        "cu_seqlens_k": host_to_device(cu(k_lens), device),
        "max_seqlen_q": max(q_lens),
        "max_seqlen_k": max(k_lens),
        "block_table": host_to_device(table, device),
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
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """Returns (1, num_tokens, num_heads, head_dim), as transformers' interface expects."""
    if paged is None:  # plain call (e.g. model.generate on the same model): ordinary SDPA
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
            sliding_window=sliding_window, softcap=softcap, **kwargs,
        )  # fmt: skip
    refused = [name for name in UNSUPPORTED_KWARGS if kwargs.get(name) is not None]
    if refused:  # ignoring them would give wrong tokens without an error
        raise NotImplementedError(
            f"{type(module).__name__} passes {', '.join(refused)} (attention sinks), which "
            "the paged attention does not implement: this model cannot run on the engine"
        )
    layer = module.layer_idx
    variant = Variant(scaling, sliding_window or None, softcap or None)
    q = query[0].transpose(0, 1)  # (num_tokens, num_heads, head_dim)
    paged.kv.write(layer, key[0].transpose(0, 1), value[0].transpose(0, 1), paged.slot_mapping)
    if paged.static is not None:
        out = _static_attention(paged, layer, q, variant)
    elif paged.varlen is not None:
        out = _flash_attention(paged, layer, q, variant)
    else:
        out = _sdpa_attention(paged, layer, q, variant)
    return out.unsqueeze(0), None


@dataclass(frozen=True)
class Variant:
    """What one layer's attention is, beyond plain causal softmax attention."""

    scale: float | None  # None: 1 / sqrt(head_dim)
    window: int | None = None  # sliding window: keys within the last ``window`` positions
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap)

    @property
    def flash_kwargs(self) -> dict[str, object]:
        left = -1 if self.window is None else self.window - 1
        return {
            "softmax_scale": self.scale,
            "window_size": (left, 0 if self.window is not None else -1),
            "softcap": self.softcap or 0.0,
        }


def _windowed(mask: torch.Tensor, window: int) -> torch.Tensor:
    """A causal-prefix mask (..., q, k) cut to a sliding window. Each row of such a mask
    sees keys 0..p, so its query position p is its count of visible keys minus one; no
    host read, so this runs inside a captured graph."""
    q_pos = mask.sum(-1, keepdim=True) - 1  # (..., q, 1)
    k_pos = torch.arange(mask.shape[-1], device=mask.device)  # (k,)
    return mask & (k_pos > q_pos - window)


def _attend(
    q: torch.Tensor,  # (n, num_heads, q_len, head_dim)
    k: torch.Tensor,  # (n, num_kv_heads, k_len, head_dim)
    v: torch.Tensor,  # (n, num_kv_heads, k_len, head_dim)
    mask: torch.Tensor | None,  # (n or 1, 1, q_len, k_len) bool; None: plain causal
    variant: Variant,
) -> torch.Tensor:
    """Attention of every query row over its keys, (n, num_heads, q_len, head_dim).

    Grouped-query attention folds the query heads that share a KV head into rows:
    (n, kv_heads, group * q_len) against (n, kv_heads, k_len), the mask repeated per group.
    Same arithmetic per row as repeating K/V, without ``enable_gqa`` (see the module doc)."""
    n, heads, q_len, head_dim = q.shape
    kv_heads, k_len = k.shape[1], k.shape[2]
    group = heads // kv_heads
    plain = mask is None and variant.window is None and variant.softcap is None
    if plain and (group == 1 or q.dtype in FLASH_DTYPES):
        # Fresh prefill: SDPA's own causal mask; with GQA only where SDPA's flash kernel
        # takes it (fp16/bf16): fp32 would fall back to the math kernel, so it folds too.
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=variant.scale, enable_gqa=group > 1
        )
    if mask is None:  # plain causal (q_len == k_len), made explicit to add a window
        mask = torch.ones((q_len, k_len), dtype=torch.bool, device=q.device).tril()[None, None]
    if variant.window is not None:
        mask = _windowed(mask, variant.window)
    q = q.reshape(n, kv_heads, group * q_len, head_dim)  # heads h*group..: KV head h
    if group > 1:
        m = mask.shape[0]
        mask = mask[:, :, None].expand(m, 1, group, q_len, k_len).reshape(m, 1, -1, k_len)
    if variant.softcap is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=variant.scale)
    else:  # SDPA cannot cap scores: the explicit softmax (what Gemma 2's eager path does)
        scale = variant.scale if variant.scale is not None else head_dim**-0.5
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # (n, kv_heads, rows, k_len)
        scores = torch.tanh(scores / variant.softcap) * variant.softcap
        scores = scores.masked_fill(~mask, float("-inf"))
        wide = torch.promote_types(scores.dtype, torch.float32)  # fp32 at least
        probs = torch.softmax(scores, dim=-1, dtype=wide).to(v.dtype)
        out = torch.matmul(probs, v)
    return out.reshape(n, heads, q_len, head_dim)


def _sdpa_attention(
    paged: PagedBatch, layer: int, q: torch.Tensor, variant: Variant
) -> torch.Tensor:
    out = torch.empty_like(q)  # (num_tokens, num_heads, head_dim)
    for group in paged.decode:
        k, v = paged.kv.gather(layer, group.blocks)  # (nd, L, num_kv_heads, head_dim)
        q_dec = q.index_select(0, group.rows).unsqueeze(2)  # (nd, num_heads, 1, head_dim)
        o = _attend(q_dec, k.transpose(1, 2), v.transpose(1, 2), group.mask, variant)
        out.index_copy_(0, group.rows, o.squeeze(2))  # o: (nd, num_heads, 1, head_dim)
    group = q.shape[1] // paged.kv.num_kv_heads
    for span in paged.spans:
        k, v = paged.kv.gather(layer, span.block_table[None])  # (1, L, num_kv_heads, head_dim)
        k, v = k[:, : span.ctx_len].transpose(1, 2), v[:, : span.ctx_len].transpose(1, 2)
        step = span.q_len  # an extend's mask, folded per query group, is cut into chunks
        if span.mask is not None:
            step = max(1, MAX_SPAN_MASK_ELEMENTS // (span.ctx_len * group))
        for lo in range(0, span.q_len, step):
            hi = min(lo + step, span.q_len)
            rows = slice(span.q_start + lo, span.q_start + hi)
            q_seq = q[rows].transpose(0, 1)[None]  # (1, num_heads, hi - lo, head_dim)
            mask = None if span.mask is None else span.mask[lo:hi][None, None]
            o = _attend(q_seq, k, v, mask, variant)  # (1, num_heads, hi - lo, head_dim)
            out[rows] = o[0].transpose(0, 1)
    return out


def _flash_attention(
    paged: PagedBatch, layer: int, q: torch.Tensor, variant: Variant
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
        causal=True,  # bottom-right aligned: extends see their whole prefix
        block_table=meta["block_table"],
        **variant.flash_kwargs,
    )


def _static_attention(
    paged: PagedBatch, layer: int, q: torch.Tensor, variant: Variant
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
            causal=True,  # bottom-right aligned: the real (last) rows see their prefix
            **variant.flash_kwargs,
        )  # (batch, q_len, num_heads, head_dim)
    else:
        k, v = paged.kv.gather(layer, meta.block_table)  # (batch, W*bs, kv_heads, head_dim)
        out = _attend(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), meta.mask, variant
        ).transpose(1, 2)  # (batch, q_len, num_heads, head_dim)
    return out.reshape(b * n, out.shape[2], out.shape[3])


def register_attention() -> str:
    """Make the paged kernel available to ``from_pretrained(attn_implementation=...)``."""
    from transformers import AttentionInterface  # the model stack: imported when models load

    if ATTN_IMPLEMENTATION not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION
