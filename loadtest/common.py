"""Shared by the benchmarks: the machine description and demo prompts."""

from __future__ import annotations

import os
import platform
import shlex
import sys


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
    module = sys.modules["__main__"].__spec__.name.removesuffix(".__main__")
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
