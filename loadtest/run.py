"""A benchmark run: the presets and ``run_bench``, which brings each system up once, measures
every level of the preset on it (closed loop over N, open loop over the rates, the
output-length sweep) and tears it down, then scores the answers (``loadtest.quality``). The
stock servers are shared and restarted only after a cut level: a stock server keeps
generating for a client that went away."""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import dataclass, field
from typing import Any

from loadtest.harness import LoadSpec, run_load
from loadtest.quality import quality
from loadtest.systems import SYSTEMS, Bench, app_status, predeploy
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
    # systems measured at these N only (closed loop), e.g. the quality-only systems at N = 8
    system_concurrency: dict[str, list[int]] = field(default_factory=dict)
    warmup_tokens: int = 8
    settle_s: float = 3.0  # pause before each level (a cut level's requests may still run)
    stock_warm: tuple[int, int] = (8, 48)  # stock servers' warm-up: concurrent requests, tokens
    early_stock: bool = False  # start the stock servers at once (CI: overlaps start-ups)
    early_apps: bool = False  # deploy every Serve app at once (CI, non-blocking deploys)


QUALITY_ONLY = ["r2r", "rstitch"]  # speed next to quality, at N = 8 only

PRESETS: dict[str, Preset] = {
    # The demo pair on a 2-core CPU in <= 10 minutes; one request per client, so every
    # answer is complete and can be scored (docs/benchmarks/README.md, "Presets").
    "quick": Preset(concurrency=[1, 8], lengths=[256], length_systems=["tokenrouter"],
                    requests_per_client=1, time_limit_s=60.0, settle_s=1.0, stock_warm=(8, 16),
                    system_concurrency={s: [8] for s in QUALITY_ONLY}),
    # The output-length target on the demo pair: N = 8, 256- and 1,024-token answers, one
    # request per client, tokenrouter and Std. Serving only.
    "lengths": Preset(concurrency=[], lengths=[256, 1024], requests_per_client=1,
                      time_limit_s=600.0, systems=["tokenrouter", "std_serving"], settle_s=1.0),
    # The GPU sweep: same code, bigger N and lengths, open loop too.
    "paper": Preset(concurrency=[1, 4, 8, 16, 32, 64], rates=[1.0, 4.0, 16.0], max_tokens=256,
                    lengths=[1024, 8192], requests_per_client=8, time_limit_s=300.0,
                    system_concurrency={s: [8] for s in QUALITY_ONLY}),
    # The CI smoke run: a few requests, 8 tokens, every system (R-Stitch as the quality
    # system: the tiny models have no trained R2R router); stock_warm (0, 0): only the
    # request that sets the shared generation config.
    "tiny": Preset(workload="tiny_words", concurrency=[2], rates=[4.0], max_tokens=8,
                   lengths=[12], length_n=2, requests_per_client=2, time_limit_s=30.0,
                   systems=[s for s in ALL_SYSTEMS if s != "r2r"],
                   system_concurrency={"rstitch": [2]}, warmup_tokens=4, settle_s=0.0,
                   stock_warm=(0, 0), early_stock=True, early_apps=True),
}  # fmt: skip


def level_spec(preset: Preset, workload: Workload, **kw: Any) -> LoadSpec:
    defaults = {"max_tokens": preset.max_tokens, "time_limit_s": preset.time_limit_s}
    return LoadSpec(workload, **(defaults | kw))


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
    if "tuner" in after:
        result["tuner"] = after["tuner"]
        result["tuner_thresholds"] = after["tuner"].get("thresholds")
        result["tuner_moves"] = [h.get("reason") for h in after["tuner"].get("history", [])]
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
        concurrency = preset.system_concurrency.get(name, preset.concurrency)
        closed_only = name in preset.system_concurrency
        spec = functools.partial(level_spec, preset, workload)
        n_warm = max([*concurrency, preset.length_n if preset.lengths else 1])
        warm = spec(concurrency=n_warm, max_requests=n_warm, max_tokens=preset.warmup_tokens)
        asyncio.run(run_load(url, warm, progress=False))
        per, n_len = preset.requests_per_client, preset.length_n
        levels = [("closed", spec(concurrency=n, max_requests=n * per)) for n in concurrency]
        for rate in [] if closed_only else preset.rates:
            levels.append(("open", spec(rate=rate, max_requests=max(preset.concurrency) * per)))
        if name in preset.length_systems and not closed_only:
            levels += [("length", spec(concurrency=n_len, max_requests=n_len * per, max_tokens=k))
                       for k in preset.lengths]  # fmt: skip
        for mode, level in levels:
            desc = f"{name} {mode} " + (
                f"rate={level.rate}" if level.rate else f"N={level.concurrency}"
            )
            time.sleep(preset.settle_s)  # let work a cut level left behind drain
            result = measure(url, level, desc, progress, bench.count_tokens)
            result |= {
                "system": name,
                "label": label,
                "mode": mode,
                "concurrency": None if level.rate else level.concurrency,
                "rate": level.rate,
                "max_tokens": level.max_tokens,
                "workload": workload.name,
                "startup_s": startup,
            }
            rows.append(result)
            if progress:
                print(
                    f"  {desc} max_tokens={level.max_tokens}: {result['tok_s']:.1f} tok/s, "
                    f"{result['finished']}/{result['requests']} finished",
                    flush=True,
                )
    return rows


def run_bench(bench: Bench, preset: Preset, progress: bool = True) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    errors: dict[str, str] = {}
    walls: dict[str, float] = {}
    result: dict[str, Any] = {}
    t0 = time.perf_counter()
    bench.stock_warm = preset.stock_warm
    if preset.early_stock and {"std_serving", "large_stock"} & set(preset.systems):
        bench.launch_stock()
    try:
        if preset.early_apps:
            t_sys = time.perf_counter()
            predeploy(bench, preset.systems)
            walls["deploy_apps"] = time.perf_counter() - t_sys
        for name in preset.systems:
            if progress:
                print(f"[{time.perf_counter() - t0:6.0f} s] {SYSTEMS[name][0]}", flush=True)
            t_sys = time.perf_counter()
            cut = True
            try:
                new = run_system(bench, name, preset, progress)
                rows += new
                cut = any(r["cut_at_time_limit"] or r["errors"] for r in new)
            except Exception as exc:  # one system failing is reported, not fatal
                errors[name] = f"{type(exc).__name__}: {exc}"
                if progress:
                    print(f"  FAILED: {errors[name]}", flush=True)
            finally:
                if cut:  # a cut level may have left work on the stock servers
                    bench.close()
                walls[name] = time.perf_counter() - t_sys
    finally:
        bench.close_all()
    workload = WORKLOADS[preset.workload]()
    n = preset.length_n if preset.length_n in preset.concurrency else max(preset.concurrency or [0])
    if n and rows:
        t_sys = time.perf_counter()
        try:
            from loadtest.quality import TeacherForced

            judge = TeacherForced(bench.large_dir, workload.request, bench.dtype)
            result["quality"] = quality(
                rows, bench.tokenize, len(workload.prompts), n, preset.max_tokens, judge
            )
        except Exception as exc:
            errors["quality"] = f"{type(exc).__name__}: {exc}"
        walls["quality"] = time.perf_counter() - t_sys
    return result | {
        "rows": rows,
        "errors": errors,
        "wall_s": time.perf_counter() - t0,
        "system_wall_s": walls,
        "p": bench.p,
    }
