"""Tensor parallel check for the device check (``gpu_check``'s ``tensor_parallel``): TP=k
against TP=1 on a random-weight Qwen3 shaped like the demo model, greedy tokens and logits in
float64, then bf16 decode step times. ``device="cpu"`` with a small shape dry-runs it."""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from tokenrouter_ray.engine.config import EngineConfig
from tokenrouter_ray.engine.engine import Engine
from tokenrouter_ray.engine.random_model import save_random_model
from tokenrouter_ray.engine.request import SamplingParams
from tokenrouter_ray.engine.scheduler import SchedulerConfig

DEMO_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                  num_hidden_layers=30, num_attention_heads=8, num_key_value_heads=4,
                  head_dim=72, max_position_embeddings=2048, tie_word_embeddings=True)  # fmt: skip


def build_model(path: Path, dtype: torch.dtype = torch.float32, **shape: Any) -> str:
    fields = {**DEMO_SHAPE, **shape, "bos_token_id": None, "eos_token_id": None}
    return save_random_model(path, "Qwen3", dtype, seed=0, **fields)


def make_engine(path: str, tp: int, device: str, dtype: str, **kwargs: Any) -> Engine:
    return Engine.from_config(
        EngineConfig(
            model=path,
            dtype=dtype,
            device=device,
            tensor_parallel=tp,
            block_size=16,
            num_blocks=kwargs.pop("num_blocks", 1024),
            max_model_len=2048,
            scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=4096),
            **kwargs,
        )
    )


def decode_steps(
    engine: Engine, batch: int, context: int, steps: int, vocab: int
) -> dict[str, float]:
    """Prefill ``batch`` prompts of ``context`` tokens, then time ``steps`` decode steps."""
    rng = random.Random(0)
    for i in range(batch):
        prompt = [rng.randrange(vocab) for _ in range(context)]
        engine.add_request(f"b{i}", prompt, SamplingParams(max_tokens=steps + 8, ignore_eos=True))
    while any(r.num_computed_tokens < r.num_tokens - 1 for r in engine.requests.values()):
        engine.step()  # prefill
    for _ in range(3):
        engine.step()  # warm-up decodes
    runner = engine.runner
    control0, forwards0 = getattr(runner, "control_s", 0.0), getattr(runner, "num_forwards", 0)
    walls, overheads, forwards = [], [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        result = engine.execute()
        engine.commit(result)
        walls.append(time.perf_counter() - t0)
        overheads.append(result.timings.overhead)
        forwards.append(result.timings.forward)
    n = getattr(runner, "num_forwards", 0) - forwards0
    for rid in list(engine.requests):
        engine.abort(rid)
    return {
        "step_ms": 1e3 * statistics.median(walls),
        "forward_ms": 1e3 * statistics.median(forwards),
        "overhead_ms": 1e3 * statistics.median(overheads),
        "control_ms": 1e3 * (getattr(runner, "control_s", 0.0) - control0) / n if n else 0.0,
        "frame_bytes": getattr(runner, "control_bytes", 0),
    }


def check_tp(
    tmp: Path,
    report: dict[str, Any],
    tp: int = 2,
    device: str = "cuda",
    shape: dict[str, Any] | None = None,
    batches: tuple[int, ...] = (1, 8, 32),
    steps: int = 30,
) -> bool | None:
    """TP=k vs TP=1: greedy tokens equal and max |logit difference| in float64 (exact
    arithmetic's stand-in, as in gpu_check), then decode step times at ``batches`` in bf16.
    None (skipped, the reason in ``report["tp"]``) with fewer than k GPUs. ``device="cpu"``
    with a small ``shape`` dry-runs it (how this code was checked without GPUs)."""
    if device == "cuda":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus < tp:
            report["tp"] = {"skipped": f"needs {tp} GPUs, found {gpus}"}
            return None
    shape = {"num_hidden_layers": 8, **(shape or {})}
    vocab = shape.get("vocab_size", DEMO_SHAPE["vocab_size"])
    out: dict[str, Any] = {}
    report["tp"] = out
    path = build_model(tmp / "tp_f64", torch.float64, **shape)
    rng = random.Random(1)
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (5, 40, 17, 90)]
    runs = {}
    for k in (1, tp):
        engine = make_engine(path, k, device, "float64", keep_logits=True, num_blocks=256)
        try:
            tokens: dict[str, list[int]] = {}
            logits: list[torch.Tensor] = []
            for i, p in enumerate(prompts):
                engine.add_request(f"p{i}", p, SamplingParams(max_tokens=24, ignore_eos=True))
            while engine.has_unfinished:
                result = engine.execute()
                if result is None:
                    continue
                logits.append(result.logits.cpu())
                for o in engine.commit(result):
                    tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            runs[k] = (tokens, logits)
        finally:
            engine.close()
    (t1, l1), (t2, l2) = runs[1], runs[tp]
    out["tokens_equal"] = t1 == t2
    out["max_logit_diff"] = max(float((a - b).abs().max()) for a, b in zip(l1, l2, strict=True))
    path = build_model(tmp / "tp_bf16", torch.bfloat16, **{**shape, "num_hidden_layers": 30})
    for k in (1, tp):
        engine = make_engine(path, k, device, "bfloat16")
        try:
            for batch in batches:
                out[f"tp{k}_batch{batch}"] = decode_steps(engine, batch, 256, steps, vocab)
        finally:
            engine.close()
    return bool(out["tokens_equal"])
