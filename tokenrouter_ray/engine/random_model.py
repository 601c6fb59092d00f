"""Random-weight causal LMs: the one factory the tests, the benchmarks and the GPU check
build their models with.

``random_causal_lm(arch, seed, **config)`` draws a model of a transformers architecture
(``llama``, ``qwen3``, ``mistral``, ``gemma2``, or a class prefix such as ``"Qwen3"``) after
``torch.manual_seed(seed)``; ``config`` is the architecture's config fields (the shape). By
default it is drawn on the host in float32; with ``device`` and ``dtype`` it is drawn there,
in that dtype (a 32B shape never sits in host memory). ``save_random_model`` stores one
for the engine to load through its own code path. ``save_windowed`` adds the attention
variants the exactness checks cover: Mistral's sliding window, Gemma 2's window and softcaps
(with ``bend_attention_scores``: query and key projections scaled, so that scores are large
enough for the cap to bend them).

The shapes themselves belong to their callers (``tests/tiny_models.py``,
``loadtest/device/gpu_check.py``, ...). Needs only torch and transformers, which the engine
already needs: ``loadtest/device/`` runs on the GPU image with this package alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers

ARCHS = {"llama": "Llama", "qwen3": "Qwen3", "mistral": "Mistral", "gemma2": "Gemma2"}


def random_causal_lm(
    arch: str,
    seed: int = 0,
    adjust: Callable[[torch.nn.Module], None] | None = None,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    **config: Any,
) -> transformers.PreTrainedModel:
    """A seeded random-weight ``arch`` model with ``config``'s fields, in eval mode.
    ``device`` / ``dtype``: where and in what the weights are drawn (default: the host,
    float32). ``adjust(model)`` runs after the draw, under ``no_grad``."""
    prefix = ARCHS.get(arch, arch)
    cfg = getattr(transformers, f"{prefix}Config")(**config)
    model_cls = getattr(transformers, f"{prefix}ForCausalLM")
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    if dtype is not None:
        torch.set_default_dtype(dtype)
    try:
        with torch.device(device) if device is not None else contextlib.nullcontext():
            model = model_cls(cfg)
    finally:
        torch.set_default_dtype(previous)
    if adjust is not None:
        with torch.no_grad():
            adjust(model)
    return model.eval()


def save_random_model(
    path: Path | str,
    arch: str,
    dtype: torch.dtype | None = None,
    seed: int = 0,
    adjust: Callable[[torch.nn.Module], None] | None = None,
    **config: Any,
) -> str:
    """``random_causal_lm(arch, seed, adjust, **config)``, drawn on the host in float32,
    stored to ``path`` in ``dtype`` (default float32); returns the path as a string."""
    model = random_causal_lm(arch, seed, adjust, **config)
    model.to(dtype or torch.float32).save_pretrained(path)
    return str(path)


def bend_attention_scores(model: torch.nn.Module, factor: float = 40.0) -> None:
    """Scale every layer's query and key projections by ``factor`` (in place): attention
    scores then grow past a softcap, so a capped model's math differs from an uncapped one's."""
    for layer in model.model.layers:  # type: ignore[union-attr]
        layer.self_attn.q_proj.weight.mul_(factor)
        layer.self_attn.k_proj.weight.mul_(factor)


WINDOW = 6  # tokens: short, so that a short prompt already reaches past it
WINDOWED: dict[str, dict[str, Any]] = {
    "mistral": {"sliding_window": WINDOW},
    "gemma2": {
        "sliding_window": WINDOW,
        "query_pre_attn_scalar": 16,
        "attn_logit_softcapping": 2.0,
        "final_logit_softcapping": 5.0,
    },
}


def save_windowed(
    path: Path | str, arch: str, dtype: torch.dtype | None = None, seed: int = 0, **shape: Any
) -> str:
    """``save_random_model`` of ``arch`` with ``shape``; ``mistral`` with a sliding window of
    ``WINDOW``, ``gemma2`` with that window and softcaps on scores bent to reach them;
    any other architecture as it is."""
    adjust = bend_attention_scores if arch == "gemma2" else None
    return save_random_model(path, arch, dtype, seed, adjust, **WINDOWED.get(arch, {}), **shape)
