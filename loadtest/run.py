"""A benchmark run: presets, the sweep over systems and loads, and the results it writes.

A preset fixes the workload, the closed-loop client counts N, the open-loop rates, the
output-length sweep and the per-level bounds. ``run_bench`` brings each system up once,
measures every level on it (closed loop over N, then open loop over the rates, then the
output-length sweep where the preset asks for it), and tears it down; the result is a plain
dict that ``loadtest.report`` turns into JSON, Markdown and plots.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace
from typing import Any

from loadtest.harness import LoadSpec, run_load
from loadtest.systems import SYSTEMS, Bench, app_status
from loadtest.workloads import WORKLOADS, Workload

ALL_SYSTEMS = list(SYSTEMS)


@dataclass
class Preset:
    workload: str = "short_chat"
    concurrency: list[int] = field(default_factory=lambda: [1, 4, 8])
    rates: list[float] = field(default_factory=list)  # open-loop arrivals per second
    max_tokens: int = 64
    lengths: list[int] = field(default_factory=list)  # output-length sweep at length_n
    length_n: int = 8
    length_systems: list[str] = field(default_factory=lambda: ["tokenrouter", "std_serving"])
    requests_per_client: int = 3  # a level ends after N * this many requests ...
    time_limit_s: float = 20.0  # ... or after this long (in-flight requests are cut)
    systems: list[str] = field(default_factory=lambda: list(ALL_SYSTEMS))
    warmup_tokens: int = 8
    settle_s: float = 3.0  # pause before each level (a cut level's requests may still run)


PRESETS: dict[str, Preset] = {
    # The demo pair on a 2-core CPU in <= 10 minutes: every system at N = 1, 4, 8 with
    # 64-token answers, and the 256- vs 64-token comparison on tokenrouter and Std. Serving.
    "quick": Preset(
        concurrency=[1, 4, 8],
        max_tokens=64,
        lengths=[256],
        length_n=8,
        requests_per_client=2,
        time_limit_s=12.0,
        warmup_tokens=16,
    ),
    # The GPU sweep: same code, bigger N and lengths, open loop too.
    "paper": Preset(
        concurrency=[1, 4, 8, 16, 32, 64],
        rates=[1.0, 4.0, 16.0],
        max_tokens=256,
        lengths=[1024, 8192],
        length_n=8,
        requests_per_client=8,
        time_limit_s=300.0,
    ),
    # The CI smoke run: a few requests, 8 tokens, every system.
    "tiny": Preset(
        workload="tiny_words",
        concurrency=[2],
        rates=[4.0],
        max_tokens=8,
        lengths=[12],
        length_n=2,
        requests_per_client=2,
        time_limit_s=30.0,
        warmup_tokens=4,
        settle_s=0.0,
    ),
}


def level_spec(preset: Preset, workload: Workload, **kw: Any) -> LoadSpec:
    base = LoadSpec(
        workload=workload,
        max_tokens=preset.max_tokens,
        time_limit_s=preset.time_limit_s,
    )
    return replace(base, **kw)


def measure(
    url: str, spec: LoadSpec, desc: str, progress: bool, count_tokens: Any = None
) -> dict[str, Any]:
    before = app_status(url)
    result = asyncio.run(
        run_load(url, spec, desc=desc, progress=progress, count_tokens=count_tokens)
    )
    after = app_status(url)
    if "deferred_timeouts" in after:
        result["deferred_timeouts"] = after["deferred_timeouts"] - before.get(
            "deferred_timeouts", 0
        )
    if "tuner_thresholds" in after:
        result["tuner_thresholds"] = after["tuner_thresholds"]
        result["tuner_moves"] = after.get("tuner_moves", [])
    return result


def run_system(
    bench: Bench, name: str, preset: Preset, progress: bool = True
) -> list[dict[str, Any]]:
    """Every level of ``preset`` on one system; one row per level."""
    label, up = SYSTEMS[name]
    workload = WORKLOADS[preset.workload]()
    rows = []
    t_up = time.perf_counter()
    with up(bench) as url:
        startup = time.perf_counter() - t_up
        n_warm = max(preset.concurrency)  # every batch size up to the largest N, once
        warm = level_spec(
            preset,
            workload,
            concurrency=n_warm,
            max_requests=n_warm,
            max_tokens=preset.warmup_tokens,
        )
        asyncio.run(run_load(url, warm, progress=False))
        levels: list[tuple[str, LoadSpec]] = []
        for n in preset.concurrency:
            spec = level_spec(
                preset, workload, concurrency=n, max_requests=n * preset.requests_per_client
            )
            levels.append(("closed", spec))
        for rate in preset.rates:
            spec = level_spec(
                preset,
                workload,
                rate=rate,
                max_requests=max(preset.concurrency) * preset.requests_per_client,
            )
            levels.append(("open", spec))
        if name in preset.length_systems:
            for length in preset.lengths:
                spec = level_spec(
                    preset,
                    workload,
                    concurrency=preset.length_n,
                    max_requests=preset.length_n,
                    max_tokens=length,
                )
                levels.append(("length", spec))
        for mode, spec in levels:
            desc = f"{name} {mode} " + (
                f"rate={spec.rate}" if spec.rate else f"N={spec.concurrency}"
            )
            time.sleep(preset.settle_s)  # let work a cut level left behind drain
            result = measure(url, spec, desc, progress, bench.count_tokens)
            result |= {
                "system": name,
                "label": label,
                "mode": mode,
                "concurrency": None if spec.rate else spec.concurrency,
                "rate": spec.rate,
                "max_tokens": spec.max_tokens,
                "workload": workload.name,
                "startup_s": startup,
            }
            rows.append(result)
            if progress:
                print(
                    f"  {desc} max_tokens={spec.max_tokens}: {result['tok_s']:.1f} tok/s, "
                    f"{result['finished']}/{result['requests']} finished",
                    flush=True,
                )
    return rows


def run_bench(bench: Bench, preset: Preset, progress: bool = True) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    errors: dict[str, str] = {}
    t0 = time.perf_counter()
    try:
        for name in preset.systems:
            if progress:
                print(f"[{time.perf_counter() - t0:6.0f} s] {SYSTEMS[name][0]}", flush=True)
            try:
                rows += run_system(bench, name, preset, progress)
            except Exception as exc:  # one system failing is reported, not fatal
                errors[name] = f"{type(exc).__name__}: {exc}"
                if progress:
                    print(f"  FAILED: {errors[name]}", flush=True)
            finally:
                # Fresh stock servers per system: a stock server keeps generating for a
                # client that went away, so a cut level leaves work behind on it.
                bench.close()
    finally:
        bench.close()
    return {"rows": rows, "errors": errors, "wall_s": time.perf_counter() - t0, "p": bench.p}
