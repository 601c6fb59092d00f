"""Shared by the benchmarks: the machine description, the command that reproduces a run, demo
prompts, the one percentile rule and the random-weight model factory."""

from __future__ import annotations

import math
import os
import platform
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# Set by ``python -m loadtest <benchmark>`` so ``command()`` reproduces the subcommand.
INVOKED_AS: str | None = None


def machine() -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import torch

    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{os.cpu_count()} cores ({cpu}), {dev}, torch {torch.__version__}"


def command() -> str:
    """The command line that reproduces this run."""
    module = INVOKED_AS or sys.modules["__main__"].__spec__.name.removesuffix(".__main__")
    return "python -m " + " ".join(shlex.quote(a) for a in [module, *sys.argv[1:]])


QUESTIONS = [
    "What is the capital of France?",
    "Explain photosynthesis in one paragraph.",
    "Write a short poem about the sea.",
    "List five uses of a paperclip.",
    "How do I boil an egg?",
    "Summarise the plot of Hamlet.",
    "What is 17 times 23?",
    "Give three tips for learning a language.",
]


def chat_prompts(tokenizer: object, n: int) -> list[list[int]]:
    """``n`` chat-templated prompts (cycling through QUESTIONS) as token ids."""
    from tokenrouter_ray.openai.chat import render_chat

    return [
        render_chat(tokenizer, [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}])
        for i in range(n)
    ]


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (0 <= q <= 1) of ``values``; NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def save_random_model(
    path: Path | str,
    arch: str,
    dtype: Any = None,
    seed: int = 0,
    adjust: Callable[[Any], None] | None = None,
    **config: Any,
) -> str:
    """A random-weight causal LM saved to ``path``: ``arch`` names a transformers config
    class without ``Config`` (``Llama``, ``Qwen3``, ``Mistral``, ``Gemma2``), ``config`` its
    fields; weights drawn after ``torch.manual_seed(seed)``, then ``adjust(model)`` (under
    ``no_grad``), stored in ``dtype`` (default float32)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = getattr(transformers, f"{arch}Config")(**config)
    model = getattr(transformers, f"{arch}ForCausalLM")(cfg)
    if adjust is not None:
        with torch.no_grad():
            adjust(model)
    model.to(dtype or torch.float32).save_pretrained(path)
    return str(path)
