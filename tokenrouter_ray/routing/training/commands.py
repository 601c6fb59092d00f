"""The ``tokenrouter-ray train-router`` command: train an R2R, CITER or Co-LLM router from
data the small/large model pair generates, print held-out metrics, save the checkpoint.

Arguments map one to one onto ``train_router`` options (``TrainOptions``); a flag left
unset keeps the library default (or the ``--quick`` value). This module imports no torch
until the command runs, so building the CLI parser stays fast.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

POLICIES = ("r2r", "citer", "co_llm")
# For the help text only; tests check they equal TrainOptions' defaults.
DEFAULTS = dict(num_prompts=192, max_tokens=48, epochs=8, batch_size=128, lr=1e-3, seed=0,
                target_rate=0.3, test_fraction=0.2, top_k=100)  # fmt: skip
OPTION_FLAGS = (
    "num_prompts", "max_tokens", "epochs", "target_rate", "seed", "test_fraction",
    "batch_size", "lr", "top_k", "width", "depth", "small_layers", "verify_steps", "device",
    "quick",
)  # fmt: skip


def register(subparsers: argparse._SubParsersAction) -> None:
    d = DEFAULTS
    p = subparsers.add_parser(
        "train-router",
        help="train a routing policy's router (r2r, citer, co_llm) on the models' own outputs",
        description="Train an R2R, CITER or Co-LLM router from data the small/large model "
        "pair generates (the large model's answers to generated chat prompts, labelled where "
        "the small model diverges), print held-out metrics and the threshold that routes "
        "--target-rate of positions to the large model, and save the checkpoint.",
        epilog="example:\n  tokenrouter-ray train-router --policy r2r --small /models/small "
        "--large /models/large \\\n      --out routers/r2r.safetensors",
    )
    p.add_argument("--policy", required=True, choices=POLICIES, help="the router to train")
    p.add_argument("--small", required=True, help="small model directory")
    p.add_argument("--large", required=True, help="large model directory (same tokenizer)")
    p.add_argument(
        "--out", required=True, help="checkpoint file to write (e.g. routers/r2r.safetensors)"
    )
    data = p.add_argument_group("data")
    data.add_argument(
        "--prompts", type=int, dest="num_prompts",
        help=f"generated chat prompts (default {d['num_prompts']})",
    )  # fmt: skip
    data.add_argument(
        "--max-tokens", type=int,
        help=f"large-model tokens per prompt (default {d['max_tokens']})",
    )  # fmt: skip
    data.add_argument(
        "--test-fraction", type=float,
        help=f"prompts held out for the metrics (default {d['test_fraction']})",
    )  # fmt: skip
    data.add_argument(
        "--small-layers", type=int,
        help="use only the first N layers of --small (an early-exit small model)",
    )  # fmt: skip
    data.add_argument(
        "--verify-steps", type=int,
        help="R2R: continue each divergence N tokens with the large model and keep only "
        "those that change the continuation (default 0: plain divergence labels)",
    )  # fmt: skip
    train = p.add_argument_group("training")
    train.add_argument("--epochs", type=int, help=f"default {d['epochs']}")
    train.add_argument("--batch-size", type=int, help=f"default {d['batch_size']}")
    train.add_argument("--lr", type=float, help=f"Adam learning rate (default {d['lr']})")
    train.add_argument("--seed", type=int, help=f"prompts, split and init (default {d['seed']})")
    train.add_argument(
        "--target-rate", type=float,
        help="fraction of held-out positions the recommended threshold routes to the large "
        f"model (default {d['target_rate']})",
    )  # fmt: skip
    train.add_argument(
        "--top-k", type=int, help=f"R2R: raw logits the router sees (default {d['top_k']})"
    )
    train.add_argument("--width", type=int, help="router width (default 256; R2R paper: 1024)")
    train.add_argument(
        "--depth", type=int,
        help="R2R residual blocks / CITER hidden layers (default 2; R2R paper: 6)",
    )  # fmt: skip
    run = p.add_argument_group("run")
    run.add_argument("--device", help="torch device (default cpu)")
    run.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    run.add_argument(
        "--quick", action="store_true", default=None,
        help="a smoke run: 24 prompts, 12 tokens, 2 epochs",
    )  # fmt: skip
    run.add_argument("--quiet", action="store_true", help="no progress bars")
    run.add_argument("--json", action="store_true", help="print the metrics as JSON")
    p.set_defaults(func=run_train_router)


def run_train_router(args: argparse.Namespace) -> int:
    import torch

    from tokenrouter_ray.routing.training.train import train_router

    if args.threads:
        torch.set_num_threads(args.threads)
    options = {name: getattr(args, name) for name in OPTION_FLAGS}
    metrics = train_router(
        args.policy, args.small, args.large, args.out, progress=not args.quiet, **options
    )
    print(json.dumps(metrics, indent=2) if args.json else format_metrics(metrics, args.out))
    return 0


def format_metrics(m: dict[str, Any], out: str) -> str:
    rate = m["target_rate"]
    auc = "n/a" if m["auc"] is None else f"{m['auc']:.3f}"
    seconds = [(k.removeprefix("seconds_"), v) for k, v in m.items() if k.startswith("seconds_")]
    return "\n".join(
        [
            f"{m['policy']} router -> {out}",
            f"  label: {m['label']}",
            f"  data: {m['positions']} positions from {m['prompts']} prompts "
            f"({m['test_positions']} positions / {m['test_prompts']} prompts held out)",
            f"  train loss by epoch: {', '.join(f'{x:.4f}' for x in m['train_loss'])}",
            f"  held out: positive rate {m['positive_rate']:.3f} (needs large "
            f"{m['needs_large_rate']:.3f}), weighted BCE {m['test_loss']:.4f}, AUC {auc}",
            f"  at threshold 0.5: accuracy {m['accuracy']:.3f} (majority "
            f"{m['majority_accuracy']:.3f}), precision {m['precision']:.3f}, "
            f"recall {m['recall']:.3f}, routed {m['route_rate']:.3f}",
            f"  at threshold {m['threshold_for_rate']:.4f} (routes {rate:.0%}): accuracy "
            f"{m['accuracy_at_threshold']:.3f}, precision {m['precision_at_threshold']:.3f}, "
            f"recall {m['recall_at_threshold']:.3f}, routed {m['route_rate_at_threshold']:.3f}",
            f"  time: {', '.join(f'{name} {v:.1f}s' for name, v in seconds)}",
            f"  use: policy options {{checkpoint: {out}, "
            f"threshold: {m['threshold_for_rate']:.6g}}}",
        ]
    )
