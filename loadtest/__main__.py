"""``python -m loadtest``: the paper's comparison on the served system, one entry point.

    python -m loadtest --preset quick                # demo pair, 2-core CPU, <= 10 minutes
    python -m loadtest --preset lengths              # 256- vs 1,024-token answers at N = 8
    python -m loadtest --preset host                 # the host path (loadtest/host_path.py)
    python -m loadtest --preset paper --small DIR --large DIR --app-overrides ...   # GPU
    python -m loadtest list                          # every other benchmark, one line each
    python -m loadtest <benchmark> [its arguments]   # e.g. `engine --help`, `serve --url ...`

Brings each system up in turn (tokenrouter tuned, Eager-Async, R2R and R-Stitch, Step-Sync,
each model alone, the large model on its stock server, Std. Serving on stock ``transformers
serve`` / vLLM), drives it with the preset's closed- and open-loop load over the HTTP API,
and writes ``<out>/results.json``, ``<out>/results.md`` and PNG plots (``bench`` extra).
Targets are printed PASS / MISS; they never fail the run.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from dataclasses import dataclass, replace

import yaml

from loadtest import common
from loadtest.common import command, machine, ray_serve_deploy
from loadtest.report import write_outputs
from loadtest.run import ALL_SYSTEMS, PRESETS, run_bench
from loadtest.systems import Bench


@dataclass(frozen=True)
class Benchmark:
    """One ``python -m loadtest <name>``: the module whose ``main(argv)`` runs it, what it
    measures and needs, and its arguments at the tiniest size, which tests/loadtest/test_smoke.py
    runs (``{port}``: a free port, ``{out}``: a scratch directory, ``{url}``: a server's v1 URL)."""

    module: str
    what: str
    needs: str
    smoke: str


SERVE = "nothing: starts Ray Serve here (simulated models)"
DEMO = "the demo build (tokenrouter-ray prepare-demo)"

BENCHMARKS: dict[str, Benchmark] = {
    "serve": Benchmark(
        "loadtest.harness",
        "closed-loop levels against an app that is already running",
        "a running server (--url)",
        "--url {url} --concurrency 1,2 --requests 2 --max-tokens 4",
    ),
    "quality-target": Benchmark(
        "loadtest.quality_target",
        "the quality target's operating point over time as the prompt mix shifts (plot)",
        "a running server (--url) with tuner.quality_target",
        "--url {url} --phases chat=2,capitals=2 --max-tokens 4 --poll-s 0.1 --out {out}",
    ),
    "host": Benchmark(
        "loadtest.host_path",
        "the runtime's host path on simulated models, in process and served (= --preset host)",
        SERVE,
        "--levels 2 --window-s 1 --warmup-s 0.2 --open-loop-loads 0.5 --served-levels 1 "
        "--served-systems zero --max-tokens 16 --port {port} --out {out}/host.json",
    ),
    "front-floor": Benchmark(
        "loadtest.front_floor",
        "the first streamed line through Serve's front vs bare uvicorn, at idle (the floor)",
        "nothing: starts Ray Serve here (--front haproxy: HAProxy)",
        "--gaps-ms 0 --requests 3 --rounds 1 --port {port}",
    ),
    "autoscale": Benchmark(
        "loadtest.autoscale",
        "autoscaling on the served simulation: an open-loop ramp up and back down",
        SERVE,
        "--peak-rps 2 --up-s 1 --hold-s 1 --down-s 1 --idle-s 1 --tokens 8 --port {port} "
        "--out {out}",
    ),
    "router-bound": Benchmark(
        "loadtest.router_bound",
        "what a router could reach on a task set: the oracle bound vs R2R and entropy",
        DEMO,
        "--limit 2 --max-tokens 4",
    ),
    "gpu-check": Benchmark(
        "loadtest.device.gpu_check",
        "the prepared device check (docs/deployment/gpu-check.md)",
        "a GPU (--device cpu: a dry run here)",
        "--device cpu --only exact --skip-bench --out {out}/gpu.json",
    ),
}


def run_benchmark(name: str, argv: list[str]) -> int:
    """Run one benchmark's ``main`` with ``argv`` as its command line."""
    module = importlib.import_module(BENCHMARKS[name].module)
    common.INVOKED_AS = f"loadtest {name}"
    sys.argv = [f"python -m loadtest {name}", *argv]
    code = module.main(argv)
    return code if isinstance(code, int) else 0


def list_benchmarks() -> str:
    width = max(map(len, BENCHMARKS))
    lines = [
        f"  {name:<{width}}  {b.what}\n  {'':<{width}}  needs: {b.needs}"
        for name, b in BENCHMARKS.items()
    ]
    return "python -m loadtest <benchmark> [--help]:\n" + "\n".join(lines)


def local_yaml_overrides(path: str = "conf/local.yaml") -> list[str]:
    """The overrides ``serve run conf/local.yaml`` deploys (the tuned demo app)."""
    with open(path) as f:
        return list(yaml.safe_load(f)["applications"][0]["args"]["overrides"])


def with_policy(overrides: list[str], p: float) -> list[str]:
    return [*without_policy(overrides), "policy=bernoulli", f"policy.options.p={p}"]


def without_policy(overrides: list[str]) -> list[str]:
    return [o for o in overrides if not o.lstrip("+~").startswith("policy")]


def policy_apps(overrides: list[str]) -> dict[str, list[str]]:
    """The quality systems' apps: the given app with R2R (``conf/local.yaml``'s policy,
    the demo's trained router) and with R-Stitch (its defaults, tau 0.3)."""
    base = without_policy(overrides)
    return {"r2r": [*base, "policy=r2r_demo"], "rstitch": [*base, "policy=rstitch"]}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in (*BENCHMARKS, "list"):
        if sys.argv[1] == "list":
            print(list_benchmarks())
            return
        raise SystemExit(run_benchmark(sys.argv[1], sys.argv[2:]))
    parser = argparse.ArgumentParser(
        prog="python -m loadtest",
        description=__doc__.splitlines()[0],
        epilog=list_benchmarks(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--preset", choices=sorted([*PRESETS, "host"]), default="quick")
    parser.add_argument("--systems", help=f"comma list of {', '.join(ALL_SYSTEMS)}")
    parser.add_argument("--concurrency", help="override the preset's N list")
    parser.add_argument("--max-tokens", type=int)
    parser.add_argument("--time-limit", type=float, help="seconds per level")
    parser.add_argument("--p", type=float, default=0.35, help="bernoulli routing probability")
    parser.add_argument("--small", help="small model dir (default: the demo's)")
    parser.add_argument("--large", help="large model dir (default: the demo's)")
    parser.add_argument("--app-overrides", nargs="*",
                        help="tuned app overrides (default: conf/local.yaml's)")  # fmt: skip
    parser.add_argument("--serve-port", type=int, default=18230)
    parser.add_argument("--port-base", type=int, help="the baselines' servers on this port and "
                        "the next three (stock small, stock large, dispatcher, step-sync); "
                        "default: free ports")  # fmt: skip
    parser.add_argument("--out", default="loadtest-results")
    parser.add_argument("--render", metavar="RESULTS_JSON",
                        help="only redraw the tables and plots of an earlier run")  # fmt: skip
    args, rest = parser.parse_known_args()
    if args.preset == "host":  # the host path on simulated models (loadtest/host_path.py)
        raise SystemExit(run_benchmark("host", rest))
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.render:
        with open(args.render) as f:
            result = json.load(f)
        header = f"machine: {result['machine']}\nreproduce: {result['command']}"
        print(write_outputs(result, args.out, header))
        return

    preset = PRESETS[args.preset]
    if args.systems:
        preset = replace(preset, systems=args.systems.split(","))
    if args.concurrency:
        preset = replace(preset, concurrency=[int(n) for n in args.concurrency.split(",")])
    if args.max_tokens:
        preset = replace(preset, max_tokens=args.max_tokens)
    if args.time_limit:
        preset = replace(preset, time_limit_s=args.time_limit)
    small, large = args.small, args.large
    if (small is None or large is None) and preset.systems:
        from tokenrouter_ray.demo import built_artifact  # `tokenrouter-ray prepare-demo` builds

        large, small = large or built_artifact("large"), small or built_artifact("small")
    app = args.app_overrides or local_yaml_overrides()
    overrides = with_policy(app, args.p)
    os.makedirs(args.out, exist_ok=True)
    bench = Bench(
        small or "",
        large or "",
        args.p,
        overrides,
        ray_serve_deploy(args.serve_port),
        log_dir=args.out,
        port_base=args.port_base,
        policy_apps=policy_apps(app),
    )
    header = (
        f"machine: {machine()}\nreproduce: {command()}\npreset: {args.preset} {preset}\n"
        f"policy: bernoulli(p={args.p}); tuned app overrides: {overrides}"
    )
    print(header, flush=True)
    result = run_bench(bench, preset)
    result |= {
        "machine": machine(),
        "command": command(),
        "preset": args.preset,
        "length_n": preset.length_n,
    }
    print(write_outputs(result, args.out, header))
    print(f"wall time: {result['wall_s']:.0f} s; results in {args.out}/")


if __name__ == "__main__":
    main()
