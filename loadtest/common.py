"""Shared by the benchmarks: the machine description, the command that reproduces a run, demo
prompts, the one percentile rule and the demo pair's R2R policy (the random-weight model
factory is the package's ``tokenrouter_ray/engine/random_model.py``, which the tests share)."""

from __future__ import annotations

import math
import os
import platform
import shlex
import sys
from collections.abc import Sequence
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
    # ``python -m loadtest <benchmark>`` sets INVOKED_AS = "loadtest <benchmark>": two words
    module = INVOKED_AS or sys.modules["__main__"].__spec__.name.removesuffix(".__main__")
    return "python -m " + " ".join([module, *(shlex.quote(a) for a in sys.argv[1:])])


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


def demo_r2r_policy() -> Any:
    """The demo pair's trained R2R router (``prepare_demo``'s artifacts) as a policy."""
    from tokenrouter_ray.demo import register_resolver
    from tokenrouter_ray.demo.artifacts import built_artifact
    from tokenrouter_ray.routing.policy import build_policy

    register_resolver()
    options = {
        "checkpoint": built_artifact("router"),
        "threshold": float(built_artifact("router_threshold")),
    }
    return build_policy("r2r", options, ["small", "large"])
