"""The demo's small model: the large model's first layers, saved as a standard checkpoint.

``prepare_small_model(large_dir)`` builds (once, cached beside the large model) a
``LlamaForCausalLM`` made of SmolLM2's first ``EXIT_LAYER`` decoder layers plus its final
norm and (tied) LM head: same tokenizer, loadable anywhere, a fraction of the cost. Plain
early exit agrees with the full model's greedy token only rarely (about 5 % at layer 8), so
this is a placeholder pair for wiring and load tests; the trained exit layer that makes the
pair useful (>= 50 % agreement) is tracked in the routing issue.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from tokenrouter_ray.demo import cache_dir

EXIT_LAYER = 8


def small_model_dir() -> Path:
    return cache_dir() / f"smollm2-135m-instruct-exit{EXIT_LAYER}"


def prepare_small_model(large_dir: str | Path, force: bool = False, quiet: bool = False) -> Path:
    target = small_model_dir()
    if (target / "tokenrouter_build.json").is_file() and not force:
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        str(large_dir), num_hidden_layers=EXIT_LAYER, dtype=torch.float32
    )
    staging = target.with_name(target.name + ".tmp")
    if staging.exists():
        shutil.rmtree(staging)
    model.save_pretrained(staging)
    AutoTokenizer.from_pretrained(str(large_dir)).save_pretrained(staging)
    (staging / "tokenrouter_build.json").write_text(
        json.dumps({"large": str(large_dir), "exit_layer": EXIT_LAYER, "trained_layers": 0})
    )
    if target.exists():
        shutil.rmtree(target)
    staging.rename(target)
    if not quiet:
        print(f"small model: first {EXIT_LAYER} layers of {large_dir} -> {target}")
    return target


def _cmd(args: argparse.Namespace) -> int:
    from tokenrouter_ray.demo import prepare_demo

    print(prepare_small_model(prepare_demo(quiet=args.quiet), force=args.force, quiet=args.quiet))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("prepare-demo-pair", help="build the demo's small model")
    p.add_argument("--force", action="store_true")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=_cmd)
