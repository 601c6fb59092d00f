"""Loading a Hugging Face causal LM for the engine, with errors a user can act on.

Accepts a local directory, a hub id, or a directory/file holding a GGUF checkpoint
(``gguf_file``). The model comes back in eval mode on the requested device and dtype, with
our paged attention as its attention implementation (a model whose modelling code does not
take it is refused: its attention would silently bypass the paged cache). Weights load
straight onto the device (``device_map``): a 32B model is never materialised in host RAM
first.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from tokenrouter_ray.engine.attention import ATTN_IMPLEMENTATION, register_attention
from tokenrouter_ray.errors import ModelLoadError

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto``: bf16 on CUDA, fp32 elsewhere."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; choose one of auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def load_causal_lm(
    model: str,
    dtype: str = "auto",
    device: str = "cpu",
    gguf_file: str | None = None,
    num_hidden_layers: int | None = None,
) -> PreTrainedModel:
    dev = torch.device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    looks_local = model.startswith(("/", ".", "~")) or Path(model).exists()
    path = Path(model).expanduser()
    if looks_local and not path.is_dir():
        raise ModelLoadError(f"model directory {model!r} does not exist")
    try:
        config = AutoConfig.from_pretrained(
            str(path) if looks_local else model, gguf_file=gguf_file
        )
    except (OSError, ValueError) as exc:
        where = "directory" if looks_local else "hub id"
        raise ModelLoadError(f"cannot read a model config from {where} {model!r}: {exc}") from exc
    archs = getattr(config, "architectures", None) or []
    if archs and not any(a.endswith("ForCausalLM") for a in archs):
        raise ModelLoadError(f"{model!r} is a {', '.join(archs)}, not a causal LM")
    overrides = {} if num_hidden_layers is None else {"num_hidden_layers": num_hidden_layers}
    try:
        lm = AutoModelForCausalLM.from_pretrained(
            str(path) if looks_local else model,
            gguf_file=gguf_file,
            dtype=torch_dtype,
            device_map=dev,  # straight to the device, not through host RAM
            attn_implementation=register_attention(),
            **overrides,
        )
    except (
        ValueError
    ) as exc:  # e.g. "Unrecognized configuration class ... for AutoModelForCausalLM"
        raise ModelLoadError(f"{model!r} cannot be loaded as a causal LM: {exc}") from exc
    except OSError as exc:
        raise ModelLoadError(f"cannot load weights of {model!r}: {exc}") from exc
    if getattr(lm.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
        # Its attention would ignore the paged cache: wrong tokens, no error. Refuse.
        raise ModelLoadError(
            f"{model!r} ({', '.join(archs) or config.model_type}) does not route attention "
            "through transformers' AttentionInterface, which the engine's paged cache needs"
        )
    return lm.eval()
