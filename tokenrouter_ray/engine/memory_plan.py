"""Joint memory planning for models that share one device.

Two models on one GPU (or one CPU host) must not each size their KV pool from the whole
device. ``plan_shared_device`` takes the device's memory and every co-located model's
``ModelFootprint`` (weights + KV bytes per token) and returns each model's budget from one
plan (``block_pool.plan_joint``: every model can hold the same K tokens of context, the
largest K with ``sum_i (weights_i + K * kv_i) <= memory``). The app builder calls it for each
``device_group`` of the config and hands every model its budget as its
``memory_budget_gb``; the engine then sizes its pool from that budget exactly as for a model
alone (``plan_num_blocks`` of the budget gives the plan's block count), capped on CUDA by
what is free after loading (``device_budget``). Prefix caching needs no memory of its own:
cached blocks are free blocks of each pool that still hold a prefix (``block_pool.py``), so
the plan's K tokens per model are what admission can use, cached or not.

Footprints come from the checkpoint without loading it (``footprint_from_checkpoint``): the
model config gives layers, KV heads and head size; the weight files' headers give the
parameter count (safetensors headers, GGUF tensor infos); the dtype is the one the engine
will load in.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Sequence
from pathlib import Path

from tokenrouter_ray.engine.block_pool import ModelFootprint, kv_bytes_per_token, plan_joint

DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}


def dtype_bytes(dtype: str, on_gpu: bool) -> int:
    """Bytes per element of the dtype the engine loads in (``auto``: bf16 on GPU, fp32 on CPU,
    as ``loader.resolve_dtype``)."""
    if dtype == "auto":
        return 2 if on_gpu else 4
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of auto, {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


def _safetensors_params(path: Path) -> int:
    """Parameters in one safetensors file, from its JSON header only."""
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    return sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")


def _gguf_params(path: Path) -> int:
    from gguf import GGUFReader

    return sum(math.prod(int(d) for d in t.shape) for t in GGUFReader(str(path)).tensors)


def checkpoint_parameters(path: str | Path, gguf_file: str | None = None) -> int:
    """Parameter count of a local checkpoint directory (safetensors or GGUF)."""
    root = Path(path)
    if gguf_file is not None:
        return _gguf_params(root / gguf_file)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{root}: no *.safetensors weights to size the model from")
    return sum(_safetensors_params(f) for f in files)


def footprint_from_checkpoint(
    path: str | Path, gguf_file: str | None, element_bytes: int
) -> ModelFootprint:
    """Weights and KV bytes per token of a local checkpoint loaded at ``element_bytes``."""
    from transformers import AutoConfig

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    cfg = AutoConfig.from_pretrained(str(path), **kwargs)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    return ModelFootprint(
        weight_bytes=checkpoint_parameters(path, gguf_file) * element_bytes,
        kv_bytes_per_token=kv_bytes_per_token(
            cfg.num_hidden_layers, kv_heads, head_dim, element_bytes
        ),
    )


def plan_shared_device(
    memory_bytes: int, models: Sequence[ModelFootprint], block_sizes: Sequence[int]
) -> list[int]:
    """Each co-located model's budget (weights + its KV blocks) from one joint plan; their sum
    is at most ``memory_bytes``. ``ValueError`` (saying what does not fit) otherwise."""
    blocks = plan_joint(memory_bytes, models, block_sizes)
    return [
        m.weight_bytes + n * size * m.kv_bytes_per_token
        for m, n, size in zip(models, blocks, block_sizes, strict=True)
    ]
