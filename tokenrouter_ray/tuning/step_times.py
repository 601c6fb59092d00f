"""``tokenrouter-ray profile``: a real model's step time across batch sizes, as a profile.

For each batch size ``b`` the engine prefills ``b`` requests of ``--prompt-len`` random
tokens, runs ``--warmup`` decode steps, then times ``--steps`` more (execute + commit, what a
model replica's step costs) and keeps the median. The result is the ``models`` section of the
profile file ``tune``, ``simulate`` and the live tuner read (docs/user-guide/tuning.md); routing
probabilities and commits can be added inline (``--route-prob``, ``--commit``) or later on
``tune``'s command line.

    tokenrouter-ray profile --demo --batch-sizes 1,2,4,8,16 --out demo-profile.json
    tokenrouter-ray profile --model small=/models/qwen3-0.6b --model large=/models/qwen3-8b \\
        --device cuda --batch-sizes 1-32 --out profile.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenrouter_ray.errors import UserFacingError

if TYPE_CHECKING:
    from tokenrouter_ray.engine.engine import Engine


def measure_step_times(
    engine: Engine,
    batch_sizes: Sequence[int],
    prompt_len: int = 64,
    steps: int = 10,
    warmup: int = 2,
    seed: int = 0,
    progress: Callable[[int, float], None] | None = None,
) -> dict[int, float]:
    """Median decode-step milliseconds of ``engine`` per batch size; ``progress(b, ms)``
    after each."""
    from tokenrouter_ray.engine.request import SamplingParams

    rng = random.Random(seed)
    vocab = engine.vocab_size
    out: dict[int, float] = {}
    for b in batch_sizes:
        ids = [f"profile-{b}-{i}" for i in range(b)]
        sampling = SamplingParams(max_tokens=warmup + steps + 2, ignore_eos=True)
        for rid in ids:
            engine.add_request(rid, [rng.randrange(vocab) for _ in range(prompt_len)], sampling)
        try:
            while any(engine.requests[r].num_output_tokens == 0 for r in ids):
                engine.step()  # prefill (chunked if the token budget says so)
            times = []
            for k in range(warmup + steps):
                t0 = time.perf_counter()
                result = engine.execute()
                engine.commit(result)
                elapsed = time.perf_counter() - t0
                if result.batch_size != b:
                    raise UserFacingError(
                        f"batch size {b} ran as {result.batch_size}: raise the scheduler's "
                        "max_num_seqs or the KV budget (--memory-gb)"
                    )
                if k >= warmup:
                    times.append(elapsed)
        finally:
            for rid in ids:
                engine.abort(rid)
        out[b] = 1000.0 * statistics.median(times)
        if progress is not None:
            progress(b, out[b])
    return out


def _model_args(args: argparse.Namespace) -> dict[str, str]:
    from tokenrouter_ray.tuning.commands import _pairs

    models: dict[str, str] = {}
    if args.demo:
        from tokenrouter_ray.demo.large import prepare_demo
        from tokenrouter_ray.demo.small import prepare_small_model

        large = prepare_demo(quiet=True)
        models = {"small": str(prepare_small_model(large, quiet=True)), "large": str(large)}
    for item in args.model or []:
        models.update(_pairs(item, "--model"))
    if not models:
        raise UserFacingError("name the models to profile: --model NAME=PATH (repeat), or --demo")
    return models


def run_profile(args: argparse.Namespace) -> int:
    from tokenrouter_ray.engine.config import EngineConfig
    from tokenrouter_ray.engine.engine import Engine
    from tokenrouter_ray.engine.scheduler import SchedulerConfig
    from tokenrouter_ray.tuning.commands import _int_list, _pairs
    from tokenrouter_ray.tuning.profile import profile_from_mapping

    batch_sizes = _int_list(args.batch_sizes, "--batch-sizes")
    if args.steps < 1 or args.warmup < 0 or args.prompt_len < 1:
        raise UserFacingError("--steps and --prompt-len must be >= 1, --warmup >= 0")
    models = _model_args(args)
    data: dict[str, Any] = {"models": {}}
    if args.route_prob:  # refuse a bad routing spec before measuring anything
        data["route_prob"] = _pairs(args.route_prob, "--route-prob")
        data["commit"] = _pairs(args.commit, "--commit")
        profile_from_mapping({**data, "models": {name: 1.0 for name in models}})
    for name, path in models.items():
        if not Path(path).is_dir() and "/" not in path:
            raise UserFacingError(f"model {name!r}: {path} is not a model directory")
        config = EngineConfig(
            model=path,
            dtype=args.dtype,
            device=args.device,
            memory_budget_bytes=int(args.memory_gb * 2**30),
            scheduler=SchedulerConfig(
                max_num_seqs=max(batch_sizes),
                max_num_batched_tokens=max(2048, args.prompt_len * max(batch_sizes)),
            ),
        )
        try:
            engine = Engine.from_config(config)
        except (OSError, ValueError) as exc:
            raise UserFacingError(f"model {name!r}: cannot load {path}: {exc}") from None

        def report(b: int, ms: float, name: str = name) -> None:
            print(f"{name:>12}  batch {b:>4}  {ms:9.2f} ms/step", file=sys.stderr, flush=True)

        table = measure_step_times(
            engine, batch_sizes, args.prompt_len, args.steps, args.warmup, progress=report
        )
        data["models"][name] = {"step_ms": {str(b): round(ms, 3) for b, ms in table.items()}}
        del engine
    if args.grain_ms is not None:
        data["grain_ms"] = args.grain_ms
    text = json.dumps(data, indent=2) + "\n"
    if args.out is None:
        sys.stdout.write(text)
    else:
        args.out.write_text(text)
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "profile",
        help="measure models' step times across batch sizes (a profile for tune/simulate)",
        description="Measure a real model's step time across batch sizes and write it as a "
        "profile, the models section tune, simulate, plan and the live tuner read "
        "(docs/user-guide/tuning.md). For each batch size b the engine prefills b requests of "
        "--prompt-len random tokens, runs --warmup decode steps, then times --steps more and "
        "keeps the median. Routing probabilities and commits may be added here (--route-prob, "
        "--commit) or on tune's command line.",
        epilog="examples:\n"
        "  tokenrouter-ray profile --demo --batch-sizes 1,2,4,8,16 --out demo-profile.json\n"
        "  tokenrouter-ray profile --model small=/models/qwen3-0.6b --model "
        "large=/models/qwen3-8b \\\n      --device cuda --batch-sizes 1-32 --out profile.json",
    )
    parser.add_argument("--model", action="append", help="NAME=PATH (repeat per model)")
    parser.add_argument("--demo", action="store_true", help="the demo pair (small, large)")
    parser.add_argument("--batch-sizes", default="1,2,4,8,16", help="e.g. 1,2,4,8 or 1-16")
    parser.add_argument("--prompt-len", type=int, default=64, help="tokens of context per request")
    parser.add_argument("--steps", type=int, default=10, help="timed decode steps per batch size")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    parser.add_argument(
        "--dtype", default="auto", help="weights' dtype: auto (bf16 on GPU, fp32 on CPU) or a name"
    )
    parser.add_argument("--memory-gb", type=float, default=2.0, help="weights + KV budget")
    parser.add_argument("--route-prob", help="add p(src->dst), as for tune")
    parser.add_argument("--commit", help="add commits per move src:dst, as for tune")
    parser.add_argument("--grain-ms", type=float, help="time grain to store in the profile")
    parser.add_argument("--out", type=Path, help="write the JSON here (default: stdout)")
    parser.set_defaults(func=run_profile)
