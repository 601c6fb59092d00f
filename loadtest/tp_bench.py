"""Tensor parallelism: what it costs rank 0 to drive its workers, and (on GPUs) a TP check.

CPU figure (issue 15's target): per decode step at batch 16 on a demo-sized model (a
random-weight Qwen3 shaped like SmolLM2-135M: 30 layers, hidden 576, 8 heads of 72 with 4
KV heads so it splits over 2 ranks, vocab 49152), the time rank 0 spends sending the step to
its workers (encoding the frame + one socket send per worker) as a share of the TP step;
target <= 5 %. Printed next to it: the frame size, the TP and one-rank step times, and rank
0's whole time outside the forward (schedule, prepare incl. the send, sample, commit).

    .venv/bin/python -m loadtest.tp_bench                     # CPU, batch 16, TP 2 vs 1
    .venv/bin/python -m loadtest.tp_bench --batch 16 --steps 40 --context 256

Every rank runs ``--threads`` torch threads (default 1, TP=1 included: on a shared 2-core
machine a 2-thread process slows down several-fold when other work competes for the cores),
so TP=2 uses two cores where TP=1 uses one; the control share is the figure.

GPU check (needs two GPUs, skipped with the reason otherwise): ``check_tp(tmp, report)``
has the shape of ``loadtest/device/gpu_check.py``'s checks, so that script can call it:
``check_tp(tmp_dir, report)`` returns True/False (None: skipped) and fills
``report["tp"]`` with greedy-token agreement and max |logit difference| of TP=2 vs TP=1 in
float64, and bf16 decode step times at batch 1/8/32 for both. Standalone, and as a CPU dry
run on a small shape (this is how it was checked here; no machine with two GPUs yet):

    .venv/bin/python -m loadtest.tp_bench --gpu-check
    .venv/bin/python -m loadtest.tp_bench --gpu-check --device cpu
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from tokenrouter_ray.engine.config import EngineConfig
from tokenrouter_ray.engine.engine import Engine
from tokenrouter_ray.engine.random_model import save_random_model
from tokenrouter_ray.engine.request import SamplingParams
from tokenrouter_ray.engine.scheduler import SchedulerConfig

DEMO_SHAPE = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=72,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
)
CONTROL_TARGET = 0.05


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


def cpu_bench(args: argparse.Namespace) -> dict[str, Any]:
    cores = torch.get_num_threads()
    report: dict[str, Any] = {
        "batch": args.batch,
        "context": args.context,
        "threads_per_rank": args.threads,
        "layers": args.layers,
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(Path(tmp) / "demo_sized", num_hidden_layers=args.layers)
        for tp in (1, args.tp):
            torch.set_num_threads(args.threads)  # workers inherit this count
            engine = make_engine(path, tp, "cpu", "float32")
            try:
                report[f"tp{tp}"] = decode_steps(
                    engine, args.batch, args.context, args.steps, DEMO_SHAPE["vocab_size"]
                )
            finally:
                engine.close()
        torch.set_num_threads(cores)
    tp = report[f"tp{args.tp}"]
    report["control_share"] = tp["control_ms"] / tp["step_ms"]
    report["overhead_share"] = tp["overhead_ms"] / tp["step_ms"]
    return report


# --------------------------------------------------------------------------- GPU check
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--layers", type=int, default=DEMO_SHAPE["num_hidden_layers"])
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--gpu-check", action="store_true", help="run check_tp on CUDA")
    parser.add_argument(
        "--device", default="cuda", help="--gpu-check on cpu: a dry run on a small shape"
    )
    parser.add_argument("--out", type=Path, help="also write the JSON report here")
    args = parser.parse_args(argv)
    if args.gpu_check:
        report: dict[str, Any] = {}
        with tempfile.TemporaryDirectory() as tmp:
            if args.device == "cpu":
                small = {"num_hidden_layers": 2, "vocab_size": 512}
                ok = check_tp(Path(tmp), report, args.tp, "cpu", small, (1, 4), steps=3)
            else:
                ok = check_tp(Path(tmp), report, args.tp)
        print(json.dumps(report, indent=2))
        print("tp", {None: "SKIP", True: "PASS", False: "FAIL"}[ok])
    else:
        report = cpu_bench(args)
        tp = report[f"tp{args.tp}"]
        print(json.dumps(report, indent=2))
        print(
            f"TP={args.tp} batch {args.batch}: control {tp['control_ms']:.3f} ms of a "
            f"{tp['step_ms']:.1f} ms step = {100 * report['control_share']:.2f} % "
            f"(target <= {100 * CONTROL_TARGET:.0f} %), frame {tp['frame_bytes']} B; "
            f"rank 0 outside its forward: {100 * report['overhead_share']:.1f} %; "
            f"TP=1 step {report['tp1']['step_ms']:.1f} ms"
        )
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
