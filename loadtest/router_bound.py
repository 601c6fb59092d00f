"""What a router could reach on a task set, teacher-forced: the oracle bound and how close
the demo's R2R router and the entropy rule come to it.

    python -m loadtest router-bound                       # demo pair, capitals dev split
    python -m loadtest router-bound --tasks builtin:demo --split all --max-tokens 24

Along the large model's greedy answer, the small model predicts every position from the
large model's prefix. Routing exactly the disagreeing positions (the **oracle**) reproduces
the large model's answer at a large share equal to the disagreement rate; a scored router
reproduces it when every disagreeing position scores above its threshold, so per target
share the table gives the recall of disagreements and the accuracy of the answers kept
exact (a floor on the served accuracy). docs/user-guide/quality.md has the figures.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from loadtest.common import command, machine, print_targets

SHARES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def greedy_answers(
    model: Any, prompts: list[list[int]], max_tokens: int, eos: set[int]
) -> list[list[int]]:
    """The large model's greedy answers, one prompt at a time (no padding to get wrong)."""
    answers = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids, max_new_tokens=max_tokens, do_sample=False, attention_mask=torch.ones_like(ids)
            )[0, len(prompt) :].tolist()
            cut = next((i + 1 for i, t in enumerate(out) if t in eos), len(out))
            answers.append(out[:cut])
    return answers


def entropy_scores(top_logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the small model's next-token distribution (over its top-k logits)."""
    logp = torch.log_softmax(top_logits.double(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def bound_table(
    scores: torch.Tensor,  # (N,) higher: more reason to route to the large model
    disagree: torch.Tensor,  # (N,) bool
    item_of: torch.Tensor,  # (N,) long: the item each position belongs to
    correct: torch.Tensor,  # (items,) bool: the large model's answer is right
    shares: tuple[float, ...] = SHARES,
) -> list[dict[str, float]]:
    """Per target share: the threshold's recall of disagreements and the accuracy (over all
    items) of the answers every one of whose disagreements scores at or above it."""
    n = scores.numel()
    order = scores.sort(descending=True).values
    rows = []
    for share in shares:
        k = max(1, min(n, round(share * n)))
        t = float(order[k - 1])
        routed = scores >= t
        missed = disagree & ~routed
        missed_items = torch.zeros_like(correct)
        missed_items[item_of[missed]] = True
        exact = ~missed_items
        rows.append({
            "share": float(routed.float().mean()),
            "recall": float((routed & disagree).sum()) / max(1, int(disagree.sum())),
            "exact": float(exact.float().mean()),
            "accuracy": float((exact & correct).float().mean()),
        })  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest router-bound", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--tasks", default="builtin:capitals")
    parser.add_argument("--split", default="dev", choices=["dev", "test", "all"])
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--large", help="large model directory (default: the demo's)")
    parser.add_argument("--small", help="small model directory (default: the demo's)")
    parser.add_argument("--router", help="R2R router file (default: the demo's)")
    parser.add_argument("--out", help="write the figures as JSON here")
    parser.add_argument("--limit", type=int, help="only the first LIMIT items")
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    from tokenrouter_ray.demo.large import prepare_demo
    from tokenrouter_ray.demo.router import prepare_demo_router
    from tokenrouter_ray.demo.small import prepare_small_model
    from tokenrouter_ray.openai.chat import render_chat
    from tokenrouter_ray.quality.commands import load_items
    from tokenrouter_ray.quality.scorers import score
    from tokenrouter_ray.quality.tasks import split_items
    from tokenrouter_ray.routing.routers import load_router
    from tokenrouter_ray.routing.training.data import (
        eos_token_ids,
        load_feature_model,
        teacher_forced_features,
    )

    large_dir = args.large or str(prepare_demo(quiet=True))  # the demo's, built once
    small_dir = args.small or str(prepare_small_model(Path(large_dir), quiet=True))
    router_path = args.router or str(prepare_demo_router(quiet=True))

    items = split_items(load_items(args.tasks), args.split)[: args.limit]
    tokenizer = AutoTokenizer.from_pretrained(large_dir)
    prompts = [
        list(render_chat(tokenizer, item.messages or [{"role": "user", "content": item.prompt}]))
        for item in items
    ]
    large = load_feature_model(large_dir)
    eos = {int(tokenizer.eos_token_id), *eos_token_ids(large)}
    answers = greedy_answers(large, prompts, args.max_tokens, eos)
    texts = [tokenizer.decode(a, skip_special_tokens=True) for a in answers]
    correct = torch.tensor([score(item, text) for item, text in zip(items, texts, strict=True)])
    del large

    router, _meta = load_router(router_path, "r2r")
    router.eval()
    small = load_feature_model(small_dir)
    sequences = [p + a for p, a in zip(prompts, answers, strict=True)]
    data = teacher_forced_features(
        small, sequences, [len(p) for p in prompts], router.top_k, progress=False
    )
    disagree = data.small_token != data.large_token
    with torch.inference_mode():
        r2r = torch.sigmoid(router(data.hidden, data.token_embedding, data.top_logits))
    scores = {"R2R router (demo)": r2r, "entropy (small, top-k)": entropy_scores(data.top_logits)}

    large_acc = float(correct.float().mean())
    oracle_share = float(disagree.float().mean())
    per_item = torch.bincount(data.prompt_index[disagree], minlength=len(items))
    print(f"{len(items)} items ({args.tasks}, {args.split}), {data.size} answer positions, "
          f"max_tokens {args.max_tokens}; machine: {machine()}")  # fmt: skip
    print(f"large alone: {100 * large_acc:.1f} % right; small disagrees with the large model "
          f"at {100 * oracle_share:.1f} % of positions (median {int(per_item.median())} per "
          f"answer): the oracle router reaches {100 * large_acc:.1f} % at a "
          f"{100 * oracle_share:.1f} % large share")  # fmt: skip
    result: dict[str, Any] = {
        "tasks": args.tasks, "split": args.split, "items": len(items), "positions": data.size,
        "large_accuracy": large_acc, "oracle_share": oracle_share, "scores": {},
    }  # fmt: skip
    for name, s in scores.items():
        rows = bound_table(s, disagree, data.prompt_index, correct)
        result["scores"][name] = rows
        print(f"\n{name}: share -> recall of disagreements, answers kept exact, accuracy floor")
        for row in rows:
            of_large = 100 * row["accuracy"] / max(large_acc, 1e-9)
            print(
                f"  {100 * row['share']:5.1f} %  recall {100 * row['recall']:5.1f} %  "
                f"exact {100 * row['exact']:5.1f} %  "
                f"accuracy >= {100 * row['accuracy']:5.1f} % ({of_large:5.1f} % of large)"
            )
    want = "80 % of the large model's accuracy at <= 50 % large share"
    targets = [(f"oracle: {want}", oracle_share <= 0.5, f"share {100 * oracle_share:.1f} %")]
    for name, rows in result["scores"].items():
        met = any(r["share"] <= 0.5 + 1e-9 and r["accuracy"] >= 0.8 * large_acc for r in rows)
        targets.append((f"{name} (floor): {want}", met, "the answers kept exact"))
    print_targets(targets)
    print(f"reproduce: {command()}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
