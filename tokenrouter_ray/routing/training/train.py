"""Training a router on ``RouterData``: the loop, held-out metrics, and ``train_router``.

``train_router(policy, small_dir, large_dir, out, **options)`` runs the whole pipeline:
prompts -> the large model's greedy continuations (our batched ``Engine``) -> small-model
features by teacher forcing -> labels -> a split BY PROMPT -> class-weighted BCE with Adam
over the cached features -> held-out metrics -> ``save_router(module, out, metrics)``.

Every metric is stated in routing terms, with the policy's own decision rule (R2R routes
to the large model when score >= t, CITER when score < t, Co-LLM when score > t):
"positive" means "routed to the large model" and "needs large" means the label says the
large model should produce the position (R2R/Co-LLM label 1, CITER label 0).
``threshold_for_rate`` is the threshold at which ``target_rate`` of the held-out positions
route to the large model; set the policy's ``threshold`` to it.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from scipy.stats import rankdata
from torch import nn
from tqdm import tqdm

from tokenrouter_ray.errors import UserFacingError
from tokenrouter_ray.routing.routers import HiddenMLPRouter, R2RRouter, save_router
from tokenrouter_ray.routing.training.data import (
    POLICY_LABELS,
    RouterData,
    chat_prompts,
    check_model_dir,
    encode_prompts,
    labels,
    load_feature_model,
    run_engine,
    teacher_forced_features,
    verify_divergences,
)

POLICIES = tuple(POLICY_LABELS)
ENGINE_SEQS, ENGINE_BLOCK = 64, 16  # the generating engine: batch size, KV block size


@dataclass
class TrainOptions:
    """Defaults sized for the demo pair on a laptop CPU (a few minutes end to end)."""

    num_prompts: int = 192  # generated chat prompts (ignored when ``prompts`` is given)
    prompts: Sequence[Sequence[int]] | None = None  # token ids: no tokenizer needed
    max_tokens: int = 48  # length of the large model's continuation per prompt
    epochs: int = 8
    batch_size: int = 128
    lr: float = 1e-3
    target_rate: float = 0.3  # fraction of positions the chosen threshold routes to large
    test_fraction: float = 0.2  # of the prompts, held out
    seed: int = 0
    top_k: int = 100  # raw logits the R2R router sees
    width: int | None = None  # router width (default: the policy config's, 256)
    depth: int | None = None  # R2R residual blocks / CITER hidden layers (default 2)
    small_layers: int | None = None  # run only the first N layers of the small model dir
    verify_steps: int = 0  # R2R: >0 keeps only divergences that matter (see data.py)
    device: str = "cpu"
    token_budget: int = 4096  # padded tokens per teacher-forced forward
    progress: bool = True
    quick: bool = False  # a smoke run: see QUICK


QUICK = dict(num_prompts=24, max_tokens=12, epochs=2)


def resolve_options(options: dict[str, Any]) -> TrainOptions:
    known = {f.name for f in dataclasses.fields(TrainOptions)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise UserFacingError(f"unknown train_router option(s): {', '.join(unknown)}")
    given = {k: v for k, v in options.items() if v is not None}
    merged = {**(QUICK if given.get("quick") else {}), **given}
    opts = TrainOptions(**merged)
    checks = [
        (opts.num_prompts >= 2, "need at least 2 prompts (one to train on, one to test)"),
        (opts.max_tokens >= 1, "max_tokens must be >= 1"),
        (opts.epochs >= 1, "epochs must be >= 1"),
        (0 < opts.target_rate < 1, "target_rate must be in (0, 1)"),
        (0 < opts.test_fraction < 1, "test_fraction must be in (0, 1)"),
    ]
    for ok, message in checks:
        if not ok:
            raise UserFacingError(message)
    return opts


# --------------------------------------------------------------------------- routers
def make_router(
    policy: str, hidden_size: int, top_k: int, width: int | None = None, depth: int | None = None
) -> nn.Module:
    """The network each policy loads; by default at the policy config's default size (the
    checkpoint records its own size, which wins over the policy config's)."""
    size = {"width": width or 256}
    if policy == "r2r":
        return R2RRouter(hidden_size, top_k=top_k, num_blocks=2 if depth is None else depth, **size)
    if policy == "citer":
        return HiddenMLPRouter(hidden_size, num_layers=2 if depth is None else depth, **size)
    return HiddenMLPRouter(hidden_size, width=1, num_layers=0)  # Co-LLM: a linear head


def router_inputs(policy: str, data: RouterData) -> tuple[torch.Tensor, ...]:
    if policy == "r2r":
        return data.hidden, data.token_embedding, data.top_logits
    return (data.hidden,)


def split_by_prompt(
    prompt_index: torch.Tensor, test_fraction: float, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(train rows, test rows): every prompt's positions fall on exactly one side."""
    prompts = torch.unique(prompt_index)
    if prompts.numel() < 2:
        raise UserFacingError("need positions from at least 2 prompts to hold some out")
    order = prompts[torch.randperm(prompts.numel(), generator=torch.Generator().manual_seed(seed))]
    num_test = min(max(1, round(test_fraction * prompts.numel())), prompts.numel() - 1)
    is_test = torch.isin(prompt_index, order[:num_test])
    return torch.nonzero(~is_test).flatten(), torch.nonzero(is_test).flatten()


def _loss_fn(target: torch.Tensor) -> nn.BCEWithLogitsLoss:
    """Class-weighted BCE: positives weigh n_neg / n_pos, so both classes count equally."""
    num_pos = float(target.sum())
    return nn.BCEWithLogitsLoss(pos_weight=torch.tensor((target.numel() - num_pos) / num_pos))


def fit(
    module: nn.Module,
    inputs: tuple[torch.Tensor, ...],
    target: torch.Tensor,  # (N,) float 0/1
    rows: torch.Tensor,  # (n,) training rows
    epochs: int,
    batch_size: int = 256,
    lr: float = 1e-3,
    seed: int = 0,
    progress: bool = True,
) -> list[float]:
    """Adam over shuffled mini-batches; returns the mean training loss of every epoch."""
    train_target = target[rows]
    if train_target.min() == train_target.max():
        value = int(train_target[0])
        raise UserFacingError(
            f"every training label is {value}: nothing to learn (are the small and large "
            "models the same, or are there too few prompts/tokens?)"
        )
    loss_fn = _loss_fn(train_target)
    optimizer = torch.optim.Adam(module.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    steps = math.ceil(rows.numel() / batch_size)
    losses = []
    module.train()
    with tqdm(total=epochs * steps, desc="train", unit="step", disable=not progress) as bar:
        for epoch in range(epochs):
            total = 0.0
            shuffled = rows[torch.randperm(rows.numel(), generator=gen)]
            for batch in shuffled.split(batch_size):
                loss = loss_fn(module(*(x[batch] for x in inputs)), target[batch])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                total += float(loss.detach()) * batch.numel()
                bar.update()
            losses.append(total / rows.numel())
            bar.set_postfix(epoch=epoch + 1, loss=f"{losses[-1]:.4f}")
    module.eval()
    return losses


@torch.inference_mode()
def predict(
    module: nn.Module, inputs: tuple[torch.Tensor, ...], rows: torch.Tensor, batch_size: int = 4096
) -> torch.Tensor:
    """(n,) router logits on ``rows`` (the policy's score is their sigmoid)."""
    return torch.cat([module(*(x[b] for x in inputs)) for b in rows.split(batch_size)])


# --------------------------------------------------------------------------- metrics
def routes(policy: str, scores: torch.Tensor, threshold: float) -> torch.Tensor:
    """The policy's own decision rule: True where the position goes to the large model."""
    if policy == "citer":
        return scores < threshold
    return scores >= threshold if policy == "r2r" else scores > threshold


def needs_large(policy: str, target: torch.Tensor) -> torch.Tensor:
    return target == 0 if policy == "citer" else target == 1


def threshold_for_rate(policy: str, scores: torch.Tensor, rate: float) -> float:
    """The threshold at which ``rate`` of these scores route to the large model."""
    n = scores.numel()
    k = min(n, max(0, round(rate * n)))
    desc = scores.sort(descending=True).values
    if policy == "r2r":  # score >= t: t is the k-th largest
        return 1.0 if k == 0 else float(desc[k - 1])
    if policy == "co_llm":  # score > t: t is the (k+1)-th largest
        return 0.0 if k == n else float(desc[k])
    return 1.0 if k == n else float(desc.flip(0)[k])  # citer, score < t: the (k+1)-th least


SCORE_QUANTILES = 101  # held-out score quantiles kept in the metrics (0 %, 1 %, ..., 100 %)


def routing_metrics(
    policy: str, scores: torch.Tensor, target: torch.Tensor, threshold: float
) -> dict[str, float]:
    routed, need = routes(policy, scores, threshold), needs_large(policy, target)
    hits = float((routed & need).sum())
    return {
        "accuracy": float((routed == need).float().mean()),
        "precision": hits / max(1.0, float(routed.sum())),
        "recall": hits / max(1.0, float(need.sum())),
        "route_rate": float(routed.float().mean()),
    }


def auc(score: torch.Tensor, positive: torch.Tensor) -> float | None:
    """ROC AUC (Mann-Whitney, ties averaged); None when one class is missing."""
    num_pos, num_neg = int(positive.sum()), int((~positive).sum())
    if num_pos == 0 or num_neg == 0:
        return None
    ranks = torch.from_numpy(rankdata(score.double().numpy()))
    return float((ranks[positive].sum() - num_pos * (num_pos + 1) / 2) / (num_pos * num_neg))


def evaluate(
    policy: str, logits: torch.Tensor, target: torch.Tensor, target_rate: float,
    train_target: torch.Tensor,
) -> dict[str, Any]:  # fmt: skip
    """Held-out metrics at the default threshold 0.5 and at ``threshold_for_rate``."""
    scores = torch.sigmoid(logits)
    need = needs_large(policy, target)
    route_score = 1 - scores if policy == "citer" else scores
    t = threshold_for_rate(policy, scores, target_rate)
    at_t = routing_metrics(policy, scores, target, t)
    base = float(need.float().mean())
    levels = torch.linspace(0, 1, SCORE_QUANTILES, dtype=torch.float64)
    quantiles = torch.quantile(scores.double(), levels)
    return {
        "positive_rate": float(target.mean()),  # the router's own label
        "needs_large_rate": base,
        "majority_accuracy": max(base, 1 - base),
        "test_loss": float(_loss_fn(train_target)(logits, target)),
        "auc": auc(route_score, need),
        **routing_metrics(policy, scores, target, 0.5),
        "target_rate": target_rate,
        "threshold_for_rate": t,
        **{f"{k}_at_threshold": v for k, v in at_t.items()},
        # the held-out scores' quantiles at 0, 1, ..., 100 %: a threshold for any route rate
        # later (``threshold_at_rate``), without the data
        "test_score_quantiles": [float(q) for q in quantiles],
    }


# ----------------------------------------------------------------------- pipeline
def _tokenizer_prompts(opts: TrainOptions, small_dir: str, large_dir: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    for path in (large_dir, small_dir):
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
            break
        except (OSError, ValueError, TypeError):
            continue
    else:
        raise UserFacingError(
            f"no tokenizer in {large_dir!r} or {small_dir!r}; pass prompt token ids "
            "(train_router(..., prompts=[[...], ...]))"
        )
    return encode_prompts(tokenizer, chat_prompts(opts.num_prompts, opts.seed))


def build_data(
    policy: str, small_dir: str, large_dir: str, opts: TrainOptions
) -> tuple[RouterData, torch.Tensor, dict[str, float]]:
    """(features, labels, seconds per phase): generate with the large model, then teacher
    force the small one (and the large one for Co-LLM)."""
    from tokenrouter_ray.engine.config import EngineConfig
    from tokenrouter_ray.engine.engine import Engine

    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    prompts = [list(p) for p in opts.prompts] if opts.prompts is not None else None
    if prompts is None:
        prompts = _tokenizer_prompts(opts, small_dir, large_dir)
    prompts = [list(p) for p in dict.fromkeys(map(tuple, prompts))]  # a repeat would leak
    longest = max(len(p) for p in prompts) + opts.max_tokens + opts.verify_steps + 1
    num_blocks = ENGINE_SEQS * (-(-longest // ENGINE_BLOCK) + 1)  # KV for a full batch
    config = EngineConfig(
        model=large_dir, device=opts.device, block_size=ENGINE_BLOCK, num_blocks=num_blocks
    )
    engine = Engine.from_config(config)
    continuations = run_engine(engine, prompts, opts.max_tokens, "generate", opts.progress)
    sequences = [p + c for p, c in zip(prompts, continuations, strict=True)]
    seconds["seconds_generate"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    small = load_feature_model(small_dir, opts.small_layers, opts.device)
    large = load_feature_model(large_dir, None, opts.device) if policy == "co_llm" else None
    if small.config.vocab_size != engine.vocab_size:
        raise UserFacingError(
            f"the small model's vocabulary ({small.config.vocab_size}) differs from the large "
            f"model's ({engine.vocab_size}): they must share a tokenizer"
        )
    data = teacher_forced_features(
        small, sequences, [len(p) for p in prompts], opts.top_k, large, opts.token_budget,
        opts.progress,
    )  # fmt: skip
    seconds["seconds_features"] = time.perf_counter() - t0
    if policy == "r2r" and opts.verify_steps > 0:
        t0 = time.perf_counter()
        eos = set(engine.eos_token_ids)
        target = verify_divergences(
            partial(run_engine, engine, desc="verify", progress=opts.progress),
            sequences, data, opts.verify_steps, eos,
        )  # fmt: skip
        seconds["seconds_verify"] = time.perf_counter() - t0
    else:
        target = labels(policy, data)
    engine = small = large = None  # free the models before training
    gc.collect()
    return data, target, seconds


def train_router(policy: str, small_dir: str, large_dir: str, out: str, **options: Any) -> dict:
    """Generate data, train the policy's router, save it to ``out``; returns the metrics
    stored in the checkpoint. Options: the fields of ``TrainOptions``."""
    if policy not in POLICIES:
        raise UserFacingError(f"no router training for policy {policy!r}; choose {POLICIES}")
    opts = resolve_options(options)
    check_model_dir(small_dir, "small")
    check_model_dir(large_dir, "large")
    torch.manual_seed(opts.seed)
    data, target, seconds = build_data(policy, small_dir, large_dir, opts)

    t0 = time.perf_counter()
    train_rows, test_rows = split_by_prompt(data.prompt_index, opts.test_fraction, opts.seed)
    top_k = data.top_logits.shape[1]
    module = make_router(policy, data.hidden.shape[1], top_k, opts.width, opts.depth)
    inputs = router_inputs(policy, data)
    losses = fit(
        module, inputs, target, train_rows, opts.epochs, opts.batch_size, opts.lr, opts.seed,
        opts.progress,
    )  # fmt: skip
    metrics: dict[str, Any] = {
        "policy": policy,
        "label": POLICY_LABELS[policy] + (" (verified)" if opts.verify_steps else ""),
        "small": small_dir,
        "large": large_dir,
        "small_layers": opts.small_layers,
        "prompts": int(torch.unique(data.prompt_index).numel()),
        "test_prompts": int(torch.unique(data.prompt_index[test_rows]).numel()),
        "positions": data.size,
        "train_positions": train_rows.numel(),
        "test_positions": test_rows.numel(),
        "max_tokens": opts.max_tokens,
        "epochs": opts.epochs,
        "seed": opts.seed,
        "train_loss": losses,
        **evaluate(
            policy, predict(module, inputs, test_rows), target[test_rows], opts.target_rate,
            target[train_rows],
        ),
    }  # fmt: skip
    seconds["seconds_train"] = time.perf_counter() - t0
    metrics.update({k: round(v, 2) for k, v in seconds.items()})
    save_router(module, out, metrics)
    return metrics
