"""The prepared device check for the engine's CUDA paths (issue #2), one command on a GPU.

What the CPU cannot run: the engine on CUDA (SDPA over the paged cache), the bucketed
static path captured as CUDA graphs, and flash-attn's paged kernels when ``flash_attn`` is
importable. Models are random-weight checkpoints built here (the device has no hub and the
demo model is too big to carry), so nothing but this repo and its engine's one missing
dependency (pydantic, carried as wheels) is needed:

    PYTHONUNBUFFERED=1 python3 -m loadtest.gpu_check --out $OUT/gpu_check.json

``--device cpu`` dry-runs the same checks here (graphs "on" = the static path run eagerly),
so the script itself is tested before it spends device time.

Checks (each a line of PASS/FAIL and a JSON entry):
1. ``exact``: tiny Llama and Qwen3 in float64 on CUDA, 8 concurrent requests with a pause
   and a 3-token extend: engine greedy tokens == ``model.generate`` (SDPA, no graphs).
2. ``graphs``: the same workload with CUDA graphs on == off, token for token, in float64
   and in bf16; reports how many (batch, rows, width) buckets were captured.
3. ``flash``: if flash-attn imports: bf16, block size 256, graphs off and on; tokens agree
   with the SDPA engine at >= 95 % (bf16 kernels differ in rounding), logits close.
4. ``bench``: decode tokens/s of a ~0.5B-shaped random Qwen3 in bf16 at batch 1, 8, 32,
   graphs off vs on (and flash when present), 64 steps after a warm-up.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from tokenrouter_ray.engine.attention import flash_attn_varlen_func
from tokenrouter_ray.engine.engine import Engine, EngineConfig
from tokenrouter_ray.engine.request import SamplingParams
from tokenrouter_ray.engine.scheduler import SchedulerConfig

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)
MID = dict(  # about Qwen3-0.6B's shape, fewer layers
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=12,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=4096,
)


def save(path: Path, arch: str, shape: dict, dtype: torch.dtype, seed: int = 0) -> str:
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**shape))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**{"head_dim": 16, **shape}))
    model.to(dtype).save_pretrained(path)
    return str(path)


DEVICE = "cuda"


def engine(path: str, dtype: str, graphs: bool, block_size: int = 16) -> Engine:
    return Engine.from_config(
        EngineConfig(
            model=path,
            dtype=dtype,
            device=DEVICE,
            block_size=block_size,
            memory_budget_bytes=(8 if DEVICE == "cuda" else 1) * 2**30,
            cuda_graphs=graphs,
            static_batches=graphs and DEVICE != "cuda",  # the dry run's stand-in
            scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=4096),
        )
    )


def workload(eng: Engine, prompts: list[list[int]], extra: list[int], n: int) -> dict:
    """8 requests; r0 paused after 3 steps and resumed with ``extra`` replacing its last
    token. Returns every request's produced tokens."""
    produced: dict[str, list[int]] = {}

    def run(result: Any) -> None:
        for out in eng.commit(result):
            produced.setdefault(out.request_id, []).extend(out.new_token_ids)

    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=n))
    for _ in range(3):
        run(eng.execute())
    eng.pause("r0")
    run(eng.execute())
    held = eng.requests["r0"].token_ids
    eng.resume("r0", extra, anchor=len(held) - 1)
    while eng.has_unfinished:
        result = eng.execute()
        if result is None:
            break
        run(result)
    return produced


def prompts_of(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(k)] for k in lengths]


def check_exact(tmp: Path, report: dict) -> bool:
    ok = True
    for arch in ("llama", "qwen3"):
        path = save(tmp / f"exact-{arch}", arch, TINY, torch.float64)
        prompts = prompts_of(256, [3, 9, 5, 12, 7, 4, 10, 6], seed=1)
        eng = engine(path, "float64", graphs=False)
        got = workload(eng, prompts[1:], prompts[0][:3], 12)
        ref = eng.runner.model
        same = 0
        for i, p in enumerate(prompts[1:]):
            if i == 0:
                continue  # r0 was rerouted: checked by the extend test on CPU
            out = ref.generate(torch.tensor([p], device=DEVICE), do_sample=False,
                               max_new_tokens=12, min_new_tokens=12)  # fmt: skip
            same += got[f"r{i}"] == out[0, len(p) :].tolist()
        passed = same == len(prompts) - 2
        report[f"exact_{arch}"] = {"requests_equal": same, "of": len(prompts) - 2}
        ok &= passed
    return ok


def check_graphs(tmp: Path, report: dict) -> bool:
    ok = True
    for dtype, torch_dtype in (("float64", torch.float64), ("bfloat16", torch.bfloat16)):
        path = save(tmp / f"graphs-{dtype}", "qwen3", TINY, torch_dtype, seed=2)
        prompts = prompts_of(256, [3, 9, 5, 12, 7, 4, 10, 6], seed=2)
        eager = workload(engine(path, dtype, graphs=False), prompts, [1, 2, 3], 24)
        captured_engine = engine(path, dtype, graphs=True)
        captured = workload(captured_engine, prompts, [1, 2, 3], 24)
        runner = captured_engine.runner
        graphs = sum(f.graph is not None for f in runner.static.values())
        if DEVICE != "cuda":
            graphs = len(runner.static)  # dry run: buckets built (eagerly), not captured
        equal = eager == captured
        report[f"graphs_{dtype}"] = {
            "tokens_equal": equal,
            "static_steps": runner.static_steps,
            "buckets_captured": graphs,
            "buckets": sorted(map(list, runner.static)),
        }
        ok &= equal and graphs > 0
    return ok


def check_flash(tmp: Path, report: dict) -> bool | None:
    if flash_attn_varlen_func is None or DEVICE != "cuda":
        report["flash"] = "flash_attn not importable: skipped"
        return None
    path = save(tmp / "flash", "qwen3", TINY, torch.bfloat16, seed=3)
    prompts = prompts_of(256, [3, 9, 5, 12, 7, 4, 10, 6], seed=3)
    sdpa = workload(engine(path, "bfloat16", graphs=False), prompts, [4, 5, 6], 24)
    out: dict[str, Any] = {}
    ok = True
    for graphs in (False, True):
        eng = engine(path, "bfloat16", graphs=graphs, block_size=256)
        assert eng.runner.use_flash
        got = workload(eng, prompts, [4, 5, 6], 24)
        total = sum(len(v) for v in sdpa.values())
        agree = sum(a == b for k in sdpa for a, b in zip(sdpa[k], got[k], strict=False))
        out[f"graphs_{graphs}"] = {"token_agreement": agree / total}
        ok &= agree / total >= 0.95
    report["flash"] = out
    return ok


def bench(tmp: Path, report: dict) -> None:
    shape = MID if DEVICE == "cuda" else TINY  # the dry run only exercises the code
    path = save(tmp / "mid", "qwen3", shape, torch.bfloat16, seed=4)
    variants = [("sdpa", 16, False), ("sdpa+graphs", 16, True)]
    if flash_attn_varlen_func is not None:
        variants += [("flash", 256, False), ("flash+graphs", 256, True)]
    rows: dict[str, dict[str, float]] = {}
    for name, block, graphs in variants:
        eng = engine(path, "bfloat16", graphs=graphs, block_size=block)
        rows[name] = {}
        for batch in (1, 8, 32):
            prompts = prompts_of(shape["vocab_size"], [128] * batch, seed=batch)
            for i, p in enumerate(prompts):
                sampling = SamplingParams(max_tokens=80, ignore_eos=True)
                eng.add_request(f"{name}-{batch}-{i}", p, sampling)
            for _ in range(16):  # prefill + warm-up (captures this bucket)
                eng.step()
            sync()
            t0 = time.perf_counter()
            tokens = 0
            for _ in range(64):
                tokens += len(eng.step())
            sync()
            rows[name][str(batch)] = round(tokens / (time.perf_counter() - t0), 1)
            for i in range(batch):
                eng.abort(f"{name}-{batch}-{i}")
        del eng
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    report["bench_decode_tokens_per_s"] = rows


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="write the JSON report here")
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--device", default="cuda", help="cpu: dry-run the checks here")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run on a GPU machine, or --device cpu", file=sys.stderr)
        return 2
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "flash_attn": flash_attn_varlen_func is not None,
    }
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, check in (("exact", check_exact), ("graphs", check_graphs),
                            ("flash", check_flash)):  # fmt: skip
            try:
                results[name] = check(Path(tmp), report)
            except Exception as exc:  # report and go on: one run must say everything
                results[name] = False
                report[f"{name}_error"] = f"{type(exc).__name__}: {exc}"
            verdict = {None: "SKIP", True: "PASS", False: "FAIL"}[results[name]]
            print(f"{name:8} {verdict}", flush=True)
        if not args.skip_bench:
            try:
                bench(Path(tmp), report)
            except Exception as exc:
                report["bench_error"] = f"{type(exc).__name__}: {exc}"
    report["results"] = results
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)
    print("reproduce: python3 -m loadtest.gpu_check", file=sys.stderr)
    return 0 if all(v is not False for v in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
