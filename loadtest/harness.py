"""The load generator: closed- or open-loop streaming chat requests against one OpenAI base
URL with the official ``openai`` client, as a user sees it; every system speaks the same
API (``seed``, ``ignore_eos``, a ``routing`` object in the final usage chunk). A request
still streaming at the time limit is cut and counted with the tokens it had received.
``main`` is the ``serve`` benchmark: closed-loop levels against an app already running.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import openai
from tqdm import tqdm

from loadtest.common import header, markdown_row, markdown_table, percentile
from loadtest.workloads import WORKLOADS, Workload
from tokenrouter_ray.metrics.latency import token_gaps


@dataclass
class Record:
    """One request as the client saw it (times in seconds from the run's start)."""

    index: int  # the k-th request of the run: prompt k of the workload, seed spec.seed + k
    start: float
    first: float | None = None
    end: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    tokens: int = 0
    text: str = ""
    routing: dict[str, Any] = field(default_factory=dict)
    finished: bool = False
    error: str | None = None


@dataclass
class LoadSpec:
    workload: Workload
    concurrency: int = 1  # closed loop: clients; ignored when rate is set
    rate: float | None = None  # open loop: Poisson arrivals per second
    max_requests: int = 16
    time_limit_s: float = 60.0
    max_tokens: int | None = None  # overrides the workload's cap
    seed: int = 7
    ignore_eos: bool = True
    routing: dict[str, Any] | None = None  # the requests' `routing` (None: the server's)


async def one_request(
    client: openai.AsyncOpenAI,
    model: str,
    spec: LoadSpec,
    k: int,
    t0: float,
    count_tokens: Callable[[str], int] | None = None,
) -> Record:
    record = Record(index=k, start=time.perf_counter() - t0)
    try:
        stream = await client.chat.completions.create(
            model=model,
            messages=spec.workload.request(k),
            max_tokens=spec.max_tokens or spec.workload.max_tokens,
            temperature=0,
            seed=spec.seed + k,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": spec.ignore_eos}
            | ({"routing": spec.routing} if spec.routing is not None else {}),
        )
        async for chunk in stream:
            now = time.perf_counter() - t0
            if chunk.choices and chunk.choices[0].delta.content:
                record.first = record.first if record.first is not None else now
                record.chunk_times.append(now)
                record.text += chunk.choices[0].delta.content
            if chunk.usage is not None:
                record.tokens = chunk.usage.completion_tokens
                record.routing = (chunk.model_extra or {}).get("routing") or {}
        record.finished = True
    except asyncio.CancelledError:
        record.error = "time limit"
    except openai.APIError as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    record.end = time.perf_counter() - t0
    if not record.finished:  # cut: count what it had received
        record.tokens = count_tokens(record.text) if count_tokens else len(record.chunk_times)
    return record


async def run_load(
    base_url: str,
    spec: LoadSpec,
    model: str = "tokenrouter",
    desc: str = "",
    progress: bool = True,
    count_tokens: Callable[[str], int] | None = None,
) -> dict[str, Any]:
    """Run one load level; returns the summary (``summarize``) with the raw records.
    ``count_tokens(text)`` counts the tokens of a request cut at the time limit (default:
    one per received chunk)."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=900)
    records: list[Record] = []
    t0 = time.perf_counter()
    deadline = t0 + spec.time_limit_s
    issued = 0
    tasks: set[asyncio.Task] = set()

    bar = tqdm(total=spec.max_requests, desc=desc, unit="req", leave=False, disable=not progress)

    def done(task: asyncio.Task) -> None:
        tasks.discard(task)
        if not task.cancelled():  # cancelled before it started: nothing was sent
            records.append(task.result())
            bar.update()

    def launch() -> asyncio.Task:
        nonlocal issued
        task = asyncio.ensure_future(one_request(client, model, spec, issued, t0, count_tokens))
        issued += 1
        tasks.add(task)
        task.add_done_callback(done)
        return task

    async def closed_client() -> None:
        while issued < spec.max_requests and time.perf_counter() < deadline:
            await launch()

    async def open_arrivals() -> None:
        rng = random.Random(spec.seed)
        next_at = t0
        while issued < spec.max_requests:
            next_at += rng.expovariate(spec.rate)
            if next_at >= deadline:
                return
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
            launch()
        await asyncio.gather(*list(tasks), return_exceptions=True)

    drivers = [open_arrivals()] if spec.rate else [closed_client() for _ in range(spec.concurrency)]
    driver = asyncio.gather(*drivers)
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(driver, timeout=max(0.1, deadline - time.perf_counter()))
    if tasks:  # past the time limit: cut what is still streaming
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*list(tasks), return_exceptions=True)
    await asyncio.sleep(0)  # let the last done-callbacks run
    elapsed = time.perf_counter() - t0
    bar.close()
    await client.close()
    return summarize(records, elapsed) | {"records": [asdict(r) for r in records]}


def percentiles(values: list[float]) -> dict[str, float]:
    return {f"p{round(100 * q)}": percentile(values, q) for q in (0.5, 0.9, 0.99)}


def summarize(records: list[Record], elapsed: float) -> dict[str, Any]:
    """Output tokens/s, per-request tokens/s, TTFT / inter-token / end-to-end latency
    percentiles, handoffs per request and tokens per model."""
    done = [r for r in records if r.finished]
    tokens = sum(r.tokens for r in records)
    itl = [gap for r in records for gap in token_gaps(r.chunk_times)]
    per_request = [
        r.tokens / (r.end - r.start) for r in done if r.end is not None and r.end > r.start
    ]
    per_model: dict[str, int] = {}
    for r in done:
        for name, n in (r.routing.get("tokens_per_model") or {}).items():
            per_model[name] = per_model.get(name, 0) + int(n)
    return {
        "elapsed_s": elapsed,
        "requests": len(records),
        "finished": len(done),
        "errors": sorted({r.error for r in records if r.error and r.error != "time limit"}),
        "cut_at_time_limit": sum(r.error == "time limit" for r in records),
        "output_tokens": tokens,
        "tok_s": tokens / elapsed if elapsed > 0 else 0.0,
        "per_request_tok_s": statistics.fmean(per_request) if per_request else math.nan,
        "ttft_s": percentiles([r.first - r.start for r in records if r.first is not None]),
        "itl_s": percentiles(itl),
        "e2e_s": percentiles([r.end - r.start for r in done if r.end is not None]),
        "handoffs_per_request": (
            statistics.fmean(float(r.routing.get("handoffs", 0)) for r in done)
            if done
            else math.nan
        ),
        "tokens_per_model": dict(sorted(per_model.items())),
    }


def parse_mode(text: str) -> tuple[str, dict[str, Any] | None]:
    """A ``--compare`` entry: ``default`` (no ``routing``: what the server does by itself),
    ``model=NAME`` (that model alone), ``quality=PRESET`` or ``threshold=X``."""
    if text == "default":
        return text, None
    key, _, value = text.partition("=")
    if key == "threshold":
        return text, {"threshold": float(value)}
    if key in ("model", "quality") and value:
        return text, {key: value}
    raise argparse.ArgumentTypeError(
        f"{text!r}: expected default, model=NAME, quality=PRESET or threshold=X"
    )


def compare_verdict(levels: dict[int, dict[str, float]], target: float = 0.95) -> list[str]:
    """One line per concurrency: the server's default against the best mode measured beside
    it, PASS when it makes at least ``target`` of that mode's throughput."""
    lines = []
    for c, rates in levels.items():
        best_mode = max(rates, key=rates.__getitem__)
        ratio = rates["default"] / rates[best_mode] if rates[best_mode] > 0 else math.nan
        verdict = "PASS" if ratio >= target else "MISS"
        lines.append(
            f"C={c}: default {rates['default']:.1f} tok/s = {ratio:.2f}x of the best "
            f"({best_mode}, {rates[best_mode]:.1f}); target >= {target}: {verdict}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    """``python -m loadtest serve``: the closed-loop levels against a running app."""
    parser = argparse.ArgumentParser(prog="python -m loadtest serve", description=__doc__)
    parser.add_argument("--url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default="tokenrouter", help="the served model name")
    parser.add_argument("--concurrency", default="1,4,8")
    parser.add_argument("--requests", type=int, default=16, help="per concurrency level")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--time-limit", type=float, default=600.0, help="seconds per level")
    parser.add_argument("--warmup", type=int, default=0,
                        help="unmeasured requests per mode before each level's measured "
                        "ones (a server that learns, e.g. the speed bypass, has learned by "
                        "then)")  # fmt: skip
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="short_chat")
    parser.add_argument(
        "--stop-at-eos", action="store_true", help="let answers end early (no ignore_eos)"
    )
    parser.add_argument(
        "--compare",
        type=lambda text: [parse_mode(m) for m in text.split(",")],
        default=[parse_mode("default")],
        help="routing modes measured side by side at each level, in turns: default (no "
        "`routing`), model=NAME (one model alone), quality=PRESET, threshold=X; with more "
        "than one, a verdict per level: the default within 5 %% of the best mode "
        "(default: %(default)s)",
    )
    args = parser.parse_args(argv)
    workload = WORKLOADS[args.workload]()
    modes = args.compare if any(m == "default" for m, _ in args.compare) else [
        parse_mode("default"), *args.compare
    ]  # fmt: skip
    print(header())
    print(markdown_table(["C:", "mode", "tok/s:", "TTFT p50:", "TTFT p99:", "ITL p50:", "ITL p99:",
                          "e2e p99:", "tokens per model", "handoffs/req:"], []))  # fmt: skip
    levels: dict[int, dict[str, float]] = {}
    for c in [int(n) for n in args.concurrency.split(",")]:
        for mode, routing in modes:
            spec = LoadSpec(workload, concurrency=c, max_requests=args.requests,
                            time_limit_s=args.time_limit, max_tokens=args.max_tokens,
                            ignore_eos=not args.stop_at_eos, routing=routing)  # fmt: skip
            if args.warmup:
                warm = replace(spec, max_requests=args.warmup)
                asyncio.run(run_load(args.url, warm, args.model, f"C={c} {mode} warm-up"))
            r = asyncio.run(run_load(args.url, spec, model=args.model, desc=f"C={c} {mode}"))
            levels.setdefault(c, {})[mode] = r["tok_s"]
            ms = [f"{1e3 * r[k][q]:.0f} ms" for k in ("ttft_s", "itl_s", "e2e_s")
                  for q in ("p50", "p99") if (k, q) != ("e2e_s", "p50")]  # fmt: skip
            per_model = ", ".join(f"{m} {n}" for m, n in r["tokens_per_model"].items())
            cells = [
                c,
                mode,
                f"{r['tok_s']:.1f}",
                *ms,
                per_model,
                f"{r['handoffs_per_request']:.1f}",
            ]
            print(markdown_row(cells), flush=True)
            if r["errors"]:
                print(f"C={c} {mode} errors: {r['errors']}")
    if len(modes) > 1:
        print("\n".join(compare_verdict(levels)))
    import httpx

    tuner = httpx.get(f"{args.url}/tokenrouter/tuner", timeout=30)
    if tuner.status_code == 200:
        status = tuner.json()
        print(f"tuner: {status['decisions']} periods, thresholds {status['thresholds']}")
    quality = httpx.get(f"{args.url}/tokenrouter/quality", timeout=30)
    bypass = quality.json().get("speed_bypass") if quality.status_code == 200 else None
    for level in (bypass or {}).get("levels", []):
        means = ", ".join(
            f"{m} {level[f'{m}_ms_per_token']:.1f} ms/token"
            for m in ("routed", "alone")
            if level[f"{m}_ms_per_token"] is not None
        )
        print(f"speed bypass at load {level['load']}: {level['mode']} ({means})")
    return 0
