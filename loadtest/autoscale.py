"""Autoscaling on the served simulation: an open-loop ramp from idle to the top and back.

    python -m loadtest autoscale [--peak-rps 11] [--up-s 60] [--hold-s 60] [--down-s 45]

``conf/sim_paper.yaml``'s app with both models autoscaling, Poisson arrivals following the
ramp, replicas and the tuner's plan read every half second; printed per 10 s, then the
targets (nothing lost or hung, answers exact, both models up and back down, the top in the
planner's ratio). ``--out`` gets the rows as JSON and a plot.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from loadtest.common import (
    header,
    markdown_table,
    print_targets,
    pyplot,
    ray_serve_deploy,
    wait_ready,
)
from tokenrouter_ray.simulation.served import sim_answer
from tokenrouter_ray.tuning.capacity import Load, Targets, plan, predict
from tokenrouter_ray.tuning.examples import paper_r2r

MODELS = ("small", "large")
SIM_PROFILE = paper_r2r()  # the capacity model's view of the app: 6.0 / 27.9 ms, R2R's routing
ESCALATION = SIM_PROFILE.route_prob[0][1]  # p(small->large) = 0.35, the app's policy too
ROWS = {"small": 2, "large": 2}  # most rows per step of one replica
BOUNDS = {"small": (1, 3), "large": (1, 4)}
TARGET_UTILISATION = 0.7
REQUEST_TIMEOUT_S = 120.0


def ramp_overrides(
    upscale_delay_s: float = 2.0, downscale_delay_s: float = 8.0, period_s: float = 1.0
) -> list[str]:
    """The simulated app with both models autoscaling between ``BOUNDS``, thresholds held
    at 1 (eager launch: what the plan assumes), a tuner that reports every ``period_s``."""
    out = ["models=sim_paper", "policy=bernoulli", f"policy.options.p={ESCALATION}",
           "transport=zmq_ipc", "placement=local", "tuner=live", f"tuner.period_s={period_s}",
           f"tuner.window_s={6 * period_s}", "tuner.min_moves=20", "tuner.concurrencies=[1]",
           "+tuner.fixed.small=1", "+tuner.fixed.large=1", "models.small.num_cpus=0.25",
           "models.large.num_cpus=0.25"]  # fmt: skip
    for name in MODELS:
        low, high = BOUNDS[name]
        scaling = dict(min_replicas=low, max_replicas=high, target_utilisation=TARGET_UTILISATION,
                       upscale_delay_s=upscale_delay_s, downscale_delay_s=downscale_delay_s,
                       metrics_interval_s=period_s / 2,
                       look_back_period_s=2 * period_s)  # fmt: skip
        out.append(f"models.{name}.scheduler.max_num_seqs={ROWS[name]}")
        out += [f"+models.{name}.autoscaling.{k}={v}" for k, v in scaling.items()]
    return out


@dataclass
class Ramp:
    """The offered rate over time: up from 0 to ``peak_rps``, hold, down, then nothing.
    ``hold_s`` and ``idle_s`` are the longest those phases last; with ``until_scaled`` the
    hold ends once every model runs more than its minimum (after ``min_hold_s``) and the
    idle phase once every model is back at its minimum: ``end_hold`` / ``end_idle`` record
    when they did (what a test on a machine of any speed waits for)."""

    peak_rps: float
    up_s: float
    hold_s: float
    down_s: float
    idle_s: float
    until_scaled: bool = False
    min_hold_s: float = 0.0

    def __post_init__(self) -> None:
        self.hold_end = self.up_s + self.hold_s  # moved earlier by end_hold

    @property
    def load_s(self) -> float:
        return self.hold_end + self.down_s

    @property
    def total_s(self) -> float:
        return self.load_s + self.idle_s

    def end_hold(self, t: float) -> None:
        self.hold_end = max(self.up_s, min(self.hold_end, t))

    def rate(self, t: float) -> float:
        if t < self.up_s:
            return self.peak_rps * t / self.up_s
        if t < self.hold_end:
            return self.peak_rps
        if t < self.load_s:
            return self.peak_rps * (self.load_s - t) / self.down_s
        return 0.0


@dataclass
class Sample:
    t: float
    running: dict[str, int]
    planned: dict[str, int] | None


@dataclass
class Sent:
    t: float  # when it was sent, from the ramp's start
    latency_s: float | None = None  # None: it never answered
    status: int | None = None
    tokens: int = 0
    exact: bool = False
    error: str | None = None


@dataclass
class RampResult:
    ramp: Ramp
    tokens: int
    samples: list[Sample] = field(default_factory=list)
    sent: list[Sent] = field(default_factory=list)

    def peak(self, model: str) -> int:
        return max((s.running.get(model, 0) for s in self.samples), default=0)

    def at_end(self, model: str) -> int:
        return self.samples[-1].running.get(model, 0) if self.samples else 0

    def top_counts(self) -> dict[str, int]:
        """The replicas running at the end of the hold phase (the top of the ramp)."""
        held = [s for s in self.samples if s.t <= self.ramp.hold_end]
        return dict(held[-1].running) if held else {}


def replica_counts(app: str) -> dict[str, int]:
    """Replicas RUNNING per model deployment of ``app`` (Serve's own status)."""
    from ray import serve

    status = serve.status().applications.get(app)
    if status is None:
        return {}
    return {
        m: int(status.deployments[m].replica_states.get("RUNNING", 0))
        for m in MODELS
        if m in status.deployments
    }


def poll(app: str, url: str, started: float, stop: threading.Event, out: list[Sample]) -> None:
    """Every half second until ``stop``: running replicas and the tuner's planned ones."""
    base = url.removesuffix("/v1")
    with httpx.Client(timeout=5.0) as client:
        while not stop.is_set():
            try:
                plan_json = client.get(f"{base}/v1/tokenrouter/tuner").json().get("plan")
            except Exception:
                plan_json = None
            planned = plan_json["replicas"] if plan_json else None
            out.append(Sample(time.monotonic() - started, replica_counts(app), planned))
            stop.wait(0.5)


def scaled_up(samples: list[Sample]) -> bool:
    return bool(samples) and all(samples[-1].running.get(m, 0) > BOUNDS[m][0] for m in MODELS)


def at_minimum(samples: list[Sample]) -> bool:
    return bool(samples) and all(samples[-1].running.get(m, 0) == BOUNDS[m][0] for m in MODELS)


async def drive(
    url: str, ramp: Ramp, tokens: int, started: float, samples: list[Sample], seed: int = 0
) -> list[Sent]:
    """The ramp's requests, each sent at its arrival time (open loop: Poisson arrivals at
    ``ramp.rate``, by thinning a process at the peak rate); with ``until_scaled`` the hold
    ends once every model has scaled up."""
    sent: list[Sent] = []
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:

        async def one(k: int, at: float) -> None:
            record = Sent(at)
            sent.append(record)
            body = {
                "model": "tokenrouter",
                "messages": [{"role": "user", "content": f"Request {k}: plan a trip."}],
                "max_tokens": tokens,
                "temperature": 0,
            }
            t0 = time.monotonic()
            try:
                reply = await client.post(f"{url}/chat/completions", json=body)
            except Exception as exc:  # a timeout is a hung request
                record.error = repr(exc)
                return
            record.latency_s, record.status = time.monotonic() - t0, reply.status_code
            if reply.status_code != 200:
                record.error = reply.text[:200]
                return
            data = reply.json()
            usage = data["usage"]
            text = data["choices"][0]["message"]["content"]
            record.tokens = usage["completion_tokens"]
            record.exact = text == sim_answer(usage["prompt_tokens"], tokens)

        tasks, t, k = [], 0.0, 0
        while True:
            t += rng.expovariate(ramp.peak_rps)
            await asyncio.sleep(max(0.0, started + t - time.monotonic()))
            holding = ramp.up_s + ramp.min_hold_s <= t < ramp.hold_end
            if ramp.until_scaled and holding and scaled_up(samples):
                ramp.end_hold(t)
            if t >= ramp.load_s:
                break
            if rng.random() * ramp.peak_rps < ramp.rate(t):
                tasks.append(asyncio.create_task(one(k, t)))
                k += 1
        await asyncio.gather(*tasks)
    return sent


def run_ramp(
    deploy: Callable[[list[str], str], Any],
    ramp: Ramp,
    tokens: int = 32,
    overrides: list[str] | None = None,
    name: str = "autoscale",
    seed: int = 0,
) -> RampResult:
    """Deploy the app with ``deploy(overrides, name)``, wait until it answers, run the ramp
    with the poller beside it, and keep polling through the idle phase."""
    result = RampResult(ramp, tokens)
    with deploy(overrides if overrides is not None else ramp_overrides(), name) as url:
        wait_ready(f"{url}/models", timeout_s=900.0)
        stop = threading.Event()
        started = time.monotonic()
        poller = threading.Thread(
            target=poll, args=(name, url, started, stop, result.samples), daemon=True
        )
        poller.start()
        try:
            result.sent = asyncio.run(drive(url, ramp, tokens, started, result.samples, seed))
            while time.monotonic() < started + ramp.total_s:
                if ramp.until_scaled and at_minimum(result.samples):
                    break
                time.sleep(0.5)
            time.sleep(1.0)  # one more sample
        finally:
            stop.set()
            poller.join(timeout=10)
    return result


def planned_top(ramp: Ramp, tokens: int) -> dict[str, int]:
    """The plan for the peak (what ``tokenrouter-ray plan`` prints for it)."""
    targets = Targets(utilisation=dict.fromkeys(MODELS, TARGET_UTILISATION),
                      min_replicas={m: BOUNDS[m][0] for m in MODELS},
                      max_replicas={m: BOUNDS[m][1] for m in MODELS})  # fmt: skip
    return plan(SIM_PROFILE, Load(ramp.peak_rps, tokens), targets, ROWS).replicas


def failure_detail(failed: list[Sent], total: int) -> str:
    """``"3 of 120 (429: 2, 500: 1); first: <its error body>"``."""
    if not failed:
        return f"0 of {total}"
    by_status = collections.Counter(s.status for s in failed)
    counts = ", ".join(f"{status}: {n}" for status, n in sorted(by_status.items()))
    return f"{len(failed)} of {total} ({counts}); first: {failed[0].error}"


def verdicts(result: RampResult) -> list[tuple[str, bool, str]]:
    """(target, met, detail) for every target of the ramp."""
    sent = result.sent
    failed = [s for s in sent if s.status is not None and s.status != 200]
    hung = [s for s in sent if s.status is None]
    inexact = [s for s in sent if s.status == 200 and not s.exact]
    top, want = result.top_counts(), planned_top(result.ramp, result.tokens)
    held = [s for s in result.samples if s.t <= result.ramp.hold_end and s.planned]
    live = held[-1].planned if held else None
    lows = {m: BOUNDS[m][0] for m in MODELS}
    return [
        ("no request failed", not failed, failure_detail(failed, len(sent))),
        ("no request hung", not hung, f"{len(hung)} of {len(sent)}"),
        ("answers equal an undisturbed run's", not inexact, f"{len(inexact)} differ"),
        (
            "both models scaled up",
            all(result.peak(m) > lows[m] for m in MODELS),
            ", ".join(f"{m} peak {result.peak(m)}" for m in MODELS),
        ),
        (
            "both back to their minimum after the ramp",
            all(result.at_end(m) == lows[m] for m in MODELS),
            ", ".join(f"{m} {result.at_end(m)}" for m in MODELS),
        ),
        (
            "replicas at the top within one of the plan for the peak, each model",
            bool(top) and all(abs(top.get(m, 0) - want[m]) <= 1 for m in MODELS),
            f"running {top}, planned {want} (offline), {live} (the tuner's, live)",
        ),
    ]


def table(result: RampResult, bin_s: float = 10.0) -> list[dict[str, Any]]:
    """Per ``bin_s``: offered rate, replicas (running, planned), TPOT measured / predicted."""
    rows = []
    for start in range(0, int(result.ramp.total_s + bin_s), int(bin_s)):
        end = start + bin_s
        samples = [s for s in result.samples if start <= s.t < end]
        done = [s for s in result.sent if start <= s.t < end and s.latency_s and s.tokens]
        if not samples:
            continue
        last = samples[-1]
        rate = result.ramp.rate(start + bin_s / 2)
        predicted = None
        if rate > 0 and all(last.running.get(m, 0) for m in MODELS):
            p = predict(SIM_PROFILE, last.running, Load(rate, result.tokens), ROWS)
            predicted = 1e3 * p.tpot_s if p.stable else None
        tpot = [1e3 * s.latency_s / s.tokens for s in done]
        rows.append(
            {
                "t_s": start,
                "offered_rps": round(rate, 2),
                "running": last.running,
                "planned": last.planned,
                "requests": len(done),
                "tpot_ms": round(sum(tpot) / len(tpot), 2) if tpot else None,
                "tpot_predicted_ms": round(predicted, 2) if predicted else None,
            }
        )
    return rows


def plot(result: RampResult, path: str) -> str | None:
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(9, 4.5))
    times = [s.t for s in result.samples]
    for m, style in zip(MODELS, ("-", "--"), strict=True):
        ax.step(times, [s.running.get(m, 0) for s in result.samples], style, where="post",
                label=f"{m} replicas running")  # fmt: skip
        planned = [(s.t, s.planned[m]) for s in result.samples if s.planned and m in s.planned]
        if planned:
            ax.plot(*zip(*planned, strict=True), ":", alpha=0.6, label=f"{m} planned")
    ax.set_xlabel("seconds")
    ax.set_ylabel("replicas")
    rate = ax.twinx()
    grid = [i * 0.5 for i in range(int(result.ramp.total_s * 2) + 1)]
    rate.plot(grid, [result.ramp.rate(t) for t in grid], color="grey", alpha=0.4)
    rate.set_ylabel("offered requests/s")
    ax.legend(loc="upper right", fontsize=8)
    ax.set_title("Replicas following an open-loop ramp (served simulation)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest autoscale", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--peak-rps", type=float, default=11.0)
    parser.add_argument("--up-s", type=float, default=60.0)
    parser.add_argument("--hold-s", type=float, default=60.0)
    parser.add_argument("--down-s", type=float, default=45.0)
    parser.add_argument("--idle-s", type=float, default=75.0)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--port", type=int, default=8310, help="Serve's HTTP port here")
    parser.add_argument("--out", default="outputs/autoscale")
    args = parser.parse_args(argv)
    ramp = Ramp(args.peak_rps, args.up_s, args.hold_s, args.down_s, args.idle_s)
    print(header(), flush=True)
    result = run_ramp(ray_serve_deploy(args.port), ramp, args.tokens)
    rows = table(result)

    def pair(counts: dict[str, int] | None, missing: object) -> str:  # small/large
        return "/".join(str((counts or {}).get(m, missing)) for m in MODELS)

    print(markdown_table(
        ["t (s):", "offered/s:", "running s/l", "planned s/l", "reqs:", "TPOT ms:", "model ms:"],
        ([r["t_s"], f"{r['offered_rps']:.2f}", pair(r["running"], 0), pair(r["planned"], "-"),
          r["requests"], r["tpot_ms"] or "-", r["tpot_predicted_ms"] or "-"] for r in rows),
    ))  # fmt: skip
    print_targets(verdicts(result))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "autoscale.json"), "w") as f:
        json.dump({"ramp": asdict(ramp), "rows": rows,
                   "sent": [asdict(s) for s in result.sent],
                   "samples": [asdict(s) for s in result.samples]}, f)  # fmt: skip
    png = plot(result, os.path.join(args.out, "autoscale.png"))
    print(f"written: {args.out}/autoscale.json" + (f", {png}" if png else ""))
    return 0
