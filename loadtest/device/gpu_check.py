"""The prepared device check for the engine's CUDA paths: one run on a GPU, a full verdict.

    python -m loadtest gpu-check [--out report.json] [--only NAME,...] [--device cpu]

Models are random-weight and built here (the device has no network). Checks run in
``CHECKS`` order, each printing ``name PASS|FAIL|SKIP``; the JSON report is rewritten after
every check, none starts after ``--budget-s``, and the last line is the ``--only`` of what
did not finish. ``--device cpu`` dry-runs every check at toy sizes (a CPU test runs it).
docs/deployment/gpu-check.md says what each check covers and what it cannot.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import platform
import random
import shlex
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM

from loadtest.device import gpu_flagship
from loadtest.device.gpu_flagship import release, sync
from tokenrouter_ray.engine.attention import flash_attn_unusable
from tokenrouter_ray.engine.config import EngineConfig
from tokenrouter_ray.engine.engine import Engine
from tokenrouter_ray.engine.loader import load_causal_lm
from tokenrouter_ray.engine.model_runner import ModelRunner
from tokenrouter_ray.engine.random_model import save_windowed
from tokenrouter_ray.engine.request import SamplingParams
from tokenrouter_ray.engine.scheduler import SchedulerConfig

# 256 positions: 16 KV widths of 16, fewer buckets to capture
TINY = gpu_flagship.DRY_SHAPE | dict(
    vocab_size=256, num_hidden_layers=3, max_position_embeddings=256
)
FLASH_HEAD_DIM = 64  # flash-attn needs head_dim % 8 == 0: the tiny models' 16 qualifies too
FLASH_LOGIT_RTOL = 0.03  # bf16 flash vs SDPA: |logit diff| <= this x max |logit|
PROMPT_LENGTHS = [3, 9, 5, 12, 7, 4, 10, 6]
NEW_TOKENS = 12  # per request in the exactness workloads (twice that for bf16)
CAPTURE_BUCKETS: dict[str, tuple[int, ...]] = {}  # the default buckets on CUDA
DEVICE = "cuda"


def dry_run_sizes() -> None:
    """The CPU dry run exercises every line at a fraction of the work."""
    global PROMPT_LENGTHS, NEW_TOKENS, CAPTURE_BUCKETS
    PROMPT_LENGTHS = [3, 9, 5, 6]
    NEW_TOKENS = 6
    CAPTURE_BUCKETS = {"batch_buckets": (1, 4), "query_buckets": (1, 2)}


def build(path: Path, arch: str, dtype: torch.dtype, seed: int = 0, shape: dict = TINY) -> str:
    """A random-weight checkpoint of ``arch``: llama, qwen3, mistral (sliding window 6) or
    gemma2 (window 6, softcap 2 on scores made large enough to bend)."""
    no_specials = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    return save_windowed(path, arch, dtype, seed, **{**shape, **no_specials})


def engine(
    path: str, dtype: str, graphs: bool, block_size: int = 16, static_eager: bool = False,
    keep_logits: bool = False, max_model_len: int | None = None, memory_gib: float = 1.0,
) -> Engine:  # fmt: skip
    """``graphs``: CUDA graphs (on CPU: the static path eagerly, the dry run's stand-in).
    ``static_eager``: the static path run eagerly on CUDA (graphs off)."""
    cuda = DEVICE == "cuda"
    return Engine.from_config(
        EngineConfig(
            model=path,
            dtype=dtype,
            device=DEVICE,
            block_size=block_size,
            memory_budget_bytes=int(memory_gib * 2**30) if cuda else 64 * 2**20,
            max_model_len=max_model_len,
            keep_logits=keep_logits,
            cuda_graphs=graphs and cuda,
            static_batches=static_eager or (graphs and not cuda),
            scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=4096),
        )
    )


class Run:
    """What a workload produced: sampled tokens and (kept) logits per request per step,
    committed tokens per request, and r0's context after its extend."""

    def __init__(self) -> None:
        self.sampled: dict[str, list[int]] = {}
        self.logits: dict[str, list[torch.Tensor]] = {}
        self.committed: dict[str, list[int]] = {}
        self.r0_context: list[int] = []
        self.r0_after: int = 0  # committed tokens of r0 before its extend


def workload(
    eng: Engine, prompts: list[list[int]], extra: list[int], n: int,
    force: dict[str, list[int]] | None = None,
) -> Run:  # fmt: skip
    """Requests r0..r7 with ``ignore_eos``; r0 paused after 3 steps and resumed with
    ``extra`` replacing its last token. ``force``: teacher forcing, each step's sampled
    token replaced by the reference run's."""
    run = Run()

    def step() -> bool:
        result = eng.execute()
        if result is None:
            return False
        if force is not None:
            result.token_ids = [force[r][len(run.sampled.get(r, []))] for r in result.request_ids]
        for i, rid in enumerate(result.request_ids):
            run.sampled.setdefault(rid, []).append(result.token_ids[i])
            if result.logits is not None:
                run.logits.setdefault(rid, []).append(result.logits[i].float().cpu())
        for out in eng.commit(result):
            run.committed.setdefault(out.request_id, []).extend(out.new_token_ids)
        return True

    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=n, ignore_eos=True))
    for _ in range(3):
        step()
    eng.pause("r0")
    step()
    held = list(eng.requests["r0"].token_ids)
    eng.resume("r0", extra, anchor=len(held) - 1)
    run.r0_context = held[:-1] + list(extra)
    run.r0_after = len(run.committed.get("r0", []))
    while eng.has_unfinished and step():
        pass
    sync()
    return run


def greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding by full forwards, no generation processors (eos is a token)."""
    ids = torch.tensor([prompt], device=DEVICE)
    with torch.no_grad():
        for _ in range(n):
            nxt = model(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return ids[0, len(prompt) :].tolist()


def prompts_of(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(k)] for k in lengths]


# ---------------------------------------------------------------------------- checks


def check_capture(tmp: Path, report: dict, background: bool = False) -> bool:
    """Capture every bucket of a runner over a randomly filled cache: K/V outside the
    scratch block unchanged; then an engine with graphs serves static steps by replay."""
    path = build(tmp / "capture", "qwen3", torch.bfloat16, seed=7)
    model = load_causal_lm(path, "bfloat16", DEVICE)
    runner = ModelRunner(model, num_blocks=64, block_size=16, cuda_graphs=True,
                         static_batches=DEVICE != "cuda", **CAPTURE_BUCKETS)  # fmt: skip
    kv = runner.kv
    for t in (*kv.keys, *kv.values):
        t.normal_()
    before = [t[: runner.scratch_block].clone() for t in (*kv.keys, *kv.values)]
    busy = BusyThread(DEVICE) if background else None
    if busy is not None:
        busy.start()
    try:
        mem0 = torch.cuda.memory_reserved() if DEVICE == "cuda" else 0
        before_capture = busy.iterations if busy is not None else 0
        built = runner.capture_static()
        sync()
        during = (busy.iterations - before_capture) if busy is not None else 0
        grown = (torch.cuda.memory_reserved() - mem0) if DEVICE == "cuda" else 0
        # the graphs' own pool: its segments in the allocator's snapshot (the pool's memory
        # is reserved, and memory_allocated misses what it caches between replays)
        pool = (
            pool_segment_bytes(torch.cuda.memory_snapshot(), runner._graph_pool)
            if DEVICE == "cuda"
            else 0
        )
    finally:
        if busy is not None:
            busy.stop()
    untouched = all(
        torch.equal(b, t[: runner.scratch_block])
        for b, t in zip(before, (*kv.keys, *kv.values), strict=True)
    )
    graphs = sum(f.graph is not None for f in runner.static.values())
    if DEVICE != "cuda":
        graphs = len(runner.static)  # dry run: warmed up eagerly, nothing captured
    name = "capture_threads" if background else "capture"
    report[name] = {
        "buckets": built,
        "graphs": graphs,
        "capture_seconds": round(runner.capture_seconds, 2),
        "graph_pool_mib": round(pool / 2**20, 1),
        "reserved_growth_mib": round(grown / 2**20, 1),  # the pool, warm-up and outputs
        "kv_outside_scratch_unchanged": untouched,
    }
    ok = untouched and built > 0 and graphs == built
    if busy is not None:  # the thread must have lived and worked through the capture
        problem = busy_problem(busy, during, MIN_BUSY_ITERATIONS[DEVICE == "cuda"])
        report[name]["busy_thread"] = {
            "iterations": busy.iterations,
            "iterations_during_capture": during,
            "error": busy.error,
            "problem": problem,
        }
        ok &= problem is None
    if not background:  # and the engine's start-up capture serves steps by replay
        eng = engine(path, "bfloat16", graphs=True)
        run = workload(eng, prompts_of(256, PROMPT_LENGTHS, seed=7), [1, 2, 3], 8)
        report[name]["engine_static_steps"] = eng.runner.static_steps
        report[name]["engine_buckets"] = len(eng.runner.static)
        ok &= eng.runner.static_steps > 0 and len(run.committed) == len(PROMPT_LENGTHS)
    sync()
    return ok


def pool_segment_bytes(segments: list[dict[str, Any]], pool: object) -> int:
    """Bytes of the allocator segments (``torch.cuda.memory_snapshot()``) owned by the
    memory pool ``pool`` (a ``torch.cuda.graph_pool_handle()``: an (int, int) id); 0 for
    None."""
    if pool is None:
        return 0
    want = tuple(pool)
    return sum(
        int(seg["total_size"])
        for seg in segments
        if tuple(seg.get("segment_pool_id") or ()) == want
    )


# Iterations the busy thread must finish while the buckets are captured (CPU dry run, CUDA).
MIN_BUSY_ITERATIONS = {False: 2, True: 10}


class BusyThread:
    """Another serving thread: ``work`` (default: a matrix product) on its own stream until
    ``stop``, counting iterations and keeping its exception. No random numbers: a draw from
    the default CUDA generator, in capture mode during every capture, would raise."""

    def __init__(self, device: str, work: Callable[[], None] | None = None) -> None:
        self.device = device
        self.work = work or self._matmul
        self.iterations = 0
        self.error: str | None = None
        self._stop = threading.Event()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _matmul(self) -> None:
        n = 512 if self.device == "cuda" else 64
        a = torch.full((n, n), 1.0 / n, device=self.device)
        (a @ a).sum()

    def _run(self) -> None:
        try:
            stream = torch.cuda.Stream() if self.device == "cuda" else None
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                while not self._stop.is_set():
                    self.work()
                    if stream is not None:
                        stream.synchronize()
                    self.iterations += 1
                    self._started.set()
        except Exception:  # kept for the report: a dead thread fails the check
            self.error = traceback.format_exc()
        finally:
            self._started.set()

    def start(self, timeout: float = 30.0) -> None:
        """Start, and return once the first iteration finished (or the thread died)."""
        self._thread.start()
        self._started.wait(timeout)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30.0)


def busy_problem(busy: BusyThread, during: int, minimum: int) -> str | None:
    """Why the busy thread does not count as having run beside the capture, or None."""
    if busy.error is not None:
        last = busy.error.strip().splitlines()[-1]
        return f"the busy thread died after {busy.iterations} iterations: {last}"
    if during < minimum:
        return f"the busy thread did {during} iterations during the capture, under {minimum}"
    return None


def check_exact(tmp: Path, report: dict) -> bool:
    ok = True
    prompts = prompts_of(256, PROMPT_LENGTHS, seed=1)
    for arch in ("llama", "qwen3", "mistral", "gemma2"):
        path = build(tmp / f"exact-{arch}", arch, torch.float64, seed=1)
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64,
                                                   attn_implementation="eager")  # fmt: skip
        ref = ref.to(DEVICE).eval()
        n = NEW_TOKENS
        want = {f"r{i}": greedy(ref, p, n) for i, p in enumerate(prompts) if i}
        for graphs in (False, True):
            eng = engine(path, "float64", graphs=graphs)
            run = workload(eng, prompts, [5, 6, 7], n)
            equal = sum(run.committed[r] == want[r] for r in want)
            r0_want = greedy(ref, run.r0_context, n - (len(run.r0_context) - len(prompts[0])))
            r0_equal = run.committed["r0"][run.r0_after :] == r0_want
            report[f"exact_{arch}_graphs_{graphs}"] = {
                "requests_equal": equal + r0_equal,
                "of": len(prompts),
                "static_steps": eng.runner.static_steps,
            }
            ok &= equal == len(want) and r0_equal
            del eng
        del ref
    sync()
    return ok


def check_graphs_bf16(tmp: Path, report: dict) -> bool:
    path = build(tmp / "graphs-bf16", "qwen3", torch.bfloat16, seed=2)
    prompts = prompts_of(256, PROMPT_LENGTHS, seed=2)
    eager = workload(engine(path, "bfloat16", graphs=False, static_eager=True,
                            keep_logits=True), prompts, [1, 2, 3], 2 * NEW_TOKENS)  # fmt: skip
    eng = engine(path, "bfloat16", graphs=True, keep_logits=True)
    captured = workload(eng, prompts, [1, 2, 3], 2 * NEW_TOKENS)
    tokens_equal = eager.sampled == captured.sampled
    diffs = [
        (a - b).abs().max().item()
        for r in eager.logits
        for a, b in zip(eager.logits[r], captured.logits.get(r, []), strict=False)
    ]
    report["graphs_bf16"] = {
        "tokens_equal": tokens_equal,
        "logits_bitwise_equal": bool(diffs) and max(diffs) == 0.0,
        "logits_max_abs_diff": max(diffs, default=None),
        "static_steps": eng.runner.static_steps,
        "buckets": len(eng.runner.static),
    }
    sync()
    return tokens_equal and bool(diffs) and max(diffs) == 0.0 and eng.runner.static_steps > 0


def flash_skip_reason() -> str | None:
    dev = torch.device(DEVICE)
    return flash_attn_unusable(dev, torch.bfloat16, FLASH_HEAD_DIM, 256)


def check_flash(tmp: Path, report: dict) -> bool | None:
    """On CPU the harness (teacher forcing, tolerances, bitwise graphs) runs with SDPA
    standing in for flash-attn, and the verdict is SKIP unless the harness itself fails."""
    why = flash_skip_reason()
    stand_in = DEVICE != "cuda"
    if why is not None and not stand_in:
        report["flash"] = {"skipped": why}
        return None
    block = 16 if stand_in else 256
    shape = {**TINY, "head_dim": FLASH_HEAD_DIM, "max_position_embeddings": 1024}
    path = build(tmp / "flash", "qwen3", torch.bfloat16, seed=3, shape=shape)
    prompts = prompts_of(256, PROMPT_LENGTHS, seed=3)
    sdpa = engine(path, "bfloat16", graphs=False, keep_logits=True)
    assert not sdpa.runner.use_flash
    ref = workload(sdpa, prompts, [4, 5, 6], 2 * NEW_TOKENS)
    out: dict[str, Any] = {"logit_rtol": FLASH_LOGIT_RTOL}
    ok = True
    runs = {}
    for mode in ("eager", "static_eager", "graphs"):
        eng = engine(path, "bfloat16", graphs=mode == "graphs", block_size=block,
                     static_eager=mode == "static_eager", keep_logits=True)  # fmt: skip
        if not eng.runner.use_flash and not stand_in:
            raise RuntimeError(f"flash-attn not chosen: {eng.runner.flash_unusable}")
        got = runs[mode] = workload(eng, prompts, [4, 5, 6], 2 * NEW_TOKENS, force=ref.sampled)
        out[mode] = entry = _teacher_forced(ref, got)
        entry["static_steps"] = eng.runner.static_steps
        ok &= entry["pass"]
    a, b = runs["static_eager"], runs["graphs"]
    bitwise = all(
        torch.equal(x, y) for r in a.logits for x, y in zip(a.logits[r], b.logits[r], strict=True)
    )
    out["graphs_equal_static_eager_bitwise"] = bitwise
    sync()
    if stand_in:
        report["flash"] = {"skipped": why, "harness_dry_run": out}
        return None if ok and bitwise else False
    report["flash"] = out
    return ok and bitwise


def _teacher_forced(ref: Run, got: Run) -> dict[str, Any]:
    """Logit distance and the first argmax divergence of ``got`` against ``ref``."""
    scale = max(x.abs().max().item() for v in ref.logits.values() for x in v)
    worst, divergence = 0.0, None
    for rid, rows in ref.logits.items():
        for k, (x, y) in enumerate(zip(rows, got.logits[rid], strict=True)):
            worst = max(worst, (x - y).abs().max().item())
            if divergence is None and y.argmax().item() != ref.sampled[rid][k]:
                top2 = x.topk(2).values
                divergence = {"request": rid, "step": k,
                              "ref_top2_margin": (top2[0] - top2[1]).item()}  # fmt: skip
    tol = FLASH_LOGIT_RTOL * scale
    near_tie = divergence is None or divergence["ref_top2_margin"] <= 2 * tol
    return {
        "logit_scale": scale,
        "max_abs_diff": worst,
        "first_divergence": divergence,
        "pass": worst <= tol and near_tie,
    }


def check_tensor_parallel(tmp: Path, report: dict) -> bool | None:
    """TP=2 against TP=1 (``loadtest.device.tp_check.check_tp``): SKIP with fewer than two GPUs."""
    from loadtest.device.tp_check import check_tp

    if DEVICE == "cuda":
        return check_tp(tmp, report)
    small = {"num_hidden_layers": 2, "vocab_size": 512}  # the dry run: gloo, two CPU ranks
    return check_tp(tmp, report, 2, "cpu", small, (1, 4), steps=3)


CHECKS: list[tuple[str, Callable[[Path, dict], bool | None]]] = [
    ("capture", check_capture),
    ("capture_threads", functools.partial(check_capture, background=True)),
    ("exact", check_exact),
    ("graphs_bf16", check_graphs_bf16),
    ("flash", check_flash),
    ("flagship_qwen3_0.6b", lambda _, report: gpu_flagship.check_flagship("qwen3_0.6b", report)),
    ("flagship_qwen3_32b", lambda _, report: gpu_flagship.check_flagship("qwen3_32b", report)),
    ("nccl_graph", lambda _, report: gpu_flagship.check_nccl_graph(report)),
    ("tensor_parallel", check_tensor_parallel),
]
# Checks whose failure leaves the engine's speed meaningful: they run after the benchmark
# (``nccl_graph``, the likeliest hang, last but one) and do not gate it.
NOT_GATING = {"nccl_graph", "tensor_parallel"}
BUDGET_S = 300  # every check and the benchmark start within this; the device kills at 360
VERDICT = {None: "SKIP", True: "PASS", False: "FAIL", "DONE": "DONE"}  # DONE: the benchmark


def sdpa_report() -> dict[str, Any]:
    """The SDPA kernels the engine allows (its default ``sdpa_backend``), cuDNN's version,
    and the kernel SDPA picks for the Qwen3-0.6B shape (16/8 heads of 128, bf16, block 256)
    in a static decode bucket, a decode group and a fresh prefill."""
    from tokenrouter_ray.engine.attention import sdpa_backends, sdpa_choice

    choice = EngineConfig.model_fields["sdpa_backend"].default
    backends = sdpa_backends(choice)
    out: dict[str, Any] = {
        "sdpa_backend": choice,
        "allowed": None if backends is None else [b.name for b in backends],
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
    }
    dev, dt, kv, group, hd, bs = torch.device(DEVICE), torch.bfloat16, 8, 2, 128, 256
    if dev.type != "cuda":
        dt = torch.float32

    def folded(n: int, width: int) -> dict[str, Any]:  # q (n, kv, group, hd) over n x width
        q = torch.zeros(n, kv, group, hd, dtype=dt, device=dev)
        k = torch.zeros(n, kv, width, hd, dtype=dt, device=dev)
        mask = torch.ones(n, 1, group, width, dtype=torch.bool, device=dev)
        return {"shape": [n, width], "kernel": sdpa_choice(q, k, k, mask, backends)}

    out["static_bucket"] = folded(32, 16 * bs)  # batch 32, 16 blocks: a captured decode
    out["decode_group"] = folded(8, 4 * bs)  # 8 rows gathered 4 blocks wide
    q = torch.zeros(1, kv * group, 512, hd, dtype=dt, device=dev)
    k = torch.zeros(1, kv, 512, hd, dtype=dt, device=dev)
    kernel = sdpa_choice(q, k, k, None, backends, is_causal=True, enable_gqa=True)
    out["prefill"] = {"shape": [1, 512], "kernel": kernel}
    return out


def parse_only(values: list[str] | None) -> list[str] | None:
    """``--only a,b c`` -> ["a", "b", "c"] (None: everything)."""
    if not values:
        return None
    return [n for v in values for n in v.split(",") if n]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest gpu-check", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--out", type=Path, help="write the JSON report here (after each check)")
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--device", default="cuda", help="cpu: dry-run the checks here")
    parser.add_argument("--only", nargs="*", help="run only these checks: NAME,NAME or NAME NAME")
    parser.add_argument(
        "--budget-s", type=float, default=BUDGET_S, help="no check starts after this many seconds"
    )
    args = parser.parse_args(argv)
    # the reproduce line (loadtest.common would pull Ray into the device's import closure)
    given = sys.argv[1:] if argv is None else argv
    print("command: python -m loadtest gpu-check", *map(shlex.quote, given), flush=True)
    only = parse_only(args.only)
    known = [n for n, _ in CHECKS] + ["bench"]
    unknown = sorted(set(only or ()) - set(known))
    if unknown:  # a typo would otherwise run nothing and say PASS
        print(f"--only: no check named {', '.join(unknown)}; known: {', '.join(known)}",
              file=sys.stderr)  # fmt: skip
        return 2
    global DEVICE
    DEVICE = args.device
    gpu_flagship.DEVICE = args.device
    deadline = time.monotonic() + args.budget_s
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run on a GPU machine, or --device cpu", file=sys.stderr)
        return 2
    if DEVICE != "cuda":
        dry_run_sizes()
    if DEVICE == "cuda":  # exactness in float64; float32 matmuls must not use TF32
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "transformers": transformers.__version__,
        "capability": list(torch.cuda.get_device_capability()) if DEVICE == "cuda" else None,
        "flash_attn": flash_skip_reason() or "usable",
        "budget_s": args.budget_s,
        "verdicts": {},
        "skipped": {},
        "errors": {},
        "seconds": {},
    }

    try:  # recorded, never fatal
        report["sdpa"] = sdpa_report()
    except Exception as exc:
        report["sdpa"] = {"error": f"{type(exc).__name__}: {exc}"}
    # Gating checks first, then the benchmark, then NCCL and tensor parallel.
    gating = [(n, c) for n, c in CHECKS if n not in NOT_GATING]
    late = [(n, c) for n, c in CHECKS if n in NOT_GATING]
    order = [n for n, _ in gating] + ["bench"] + [n for n, _ in late]
    wanted = [n for n in order if only is None or n in only]
    finished: set[str] = set()

    def save() -> None:
        left = [n for n in wanted if n not in finished]
        report["rerun"] = f"--only {','.join(left)}" if left else None
        text = json.dumps(report, indent=2, default=str)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(text)

    def run_check(tmp: str, name: str, check: Callable[[Path, dict], bool | str | None]) -> None:
        if time.monotonic() > deadline:
            report["verdicts"][name] = "SKIP"
            report["skipped"][name] = f"time budget ({args.budget_s:.0f} s) spent"
            save()
            return
        print(f"{name:16} ...", flush=True)  # a hang shows where it is
        t0 = time.perf_counter()
        try:
            result = check(Path(tmp), report)
            sync()  # an asynchronous error surfaces here, still blamed on this check
        except Exception:  # report and go on: one run must say everything
            result = False
            report["errors"][name] = traceback.format_exc()
        report["verdicts"][name] = VERDICT[result]
        report["seconds"][name] = round(time.perf_counter() - t0, 1)
        release()
        finished.add(name)
        print(f"{name:16} {VERDICT[result]}  ({report['seconds'][name]} s)", flush=True)
        if name in report["errors"]:
            print(report["errors"][name], file=sys.stderr, flush=True)
        save()

    def bench(_: Path, report: dict) -> str:
        try:
            gpu_flagship.bench_flagship(report, deadline, save)
        finally:
            gpu_flagship.drop_models()
        return "DONE"

    save()
    with tempfile.TemporaryDirectory() as tmp:
        for name, check in gating:
            if name in wanted:
                run_check(tmp, name, check)
        failed = any(v == "FAIL" for k, v in report["verdicts"].items() if k not in NOT_GATING)
        if args.skip_bench or "bench" not in wanted or failed:
            if failed and not args.skip_bench and "bench" in wanted:
                report["bench"] = "skipped: a check failed, so speed would mean nothing"
            report["verdicts"]["bench"] = "SKIP"
            finished.add("bench")
            print(f"{'bench':16} SKIP", flush=True)
        else:
            run_check(tmp, "bench", bench)
        for name, check in late:
            if name in wanted:
                run_check(tmp, name, check)
        gpu_flagship.drop_models()
        save()
    print(json.dumps(report, indent=2, default=str))
    failed = "FAIL" in report["verdicts"].values()
    print("verdict:", "FAIL" if failed else "PASS", flush=True)
    if report["rerun"]:  # what a spent budget (or a kill) left undone
        print(f"rerun: python3 -m loadtest.device.gpu_check {report['rerun']}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
