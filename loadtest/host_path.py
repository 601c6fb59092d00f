"""The host path: the runtime's own cost, measured on simulated models at GPU step times.

    python -m loadtest host                           # in-process + served, ~6 minutes
    python -m loadtest host --levels 8 --window-s 1 --no-served   # tiny

``SimRunner`` steps take the profile's time while the host works. In process
(``LocalRuntime``): closed loops per N and an open loop; served (``conf/sim_paper.yaml``'s
app on a local Ray cluster): tok/s, host phases, CPU per token (``proc_cpu.py``) and TTFT
(``raw_http.ttft_probe``); ``... tuned`` systems run what the live tuner decides with the
transit the all-ones run measured. docs/benchmarks/README.md, "Host path", says what each
figure is; served targets are in ``host_targets.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from loadtest.common import ServeDeploy, header, print_targets, ray_serve_deploy, wait_ready
from loadtest.host_targets import critical_target, served_targets, via
from loadtest.proc_cpu import (
    CpuWindow,
    app_pids,
    format_cpu,
    format_wakes,
    per_token_us,
    wake_cost_us,
)
from loadtest.raw_http import PROBE_CLIENTS, PROBE_ROUTING, ttft_probe
from tokenrouter_ray.config import TunerSpec
from tokenrouter_ray.replica.profile import latency_quantile_us
from tokenrouter_ray.simulation.loads import ClosedLoop
from tokenrouter_ray.thresholds import ThresholdTable
from tokenrouter_ray.tuning.examples import paper_r2r
from tokenrouter_ray.tuning.markov import throughput
from tokenrouter_ray.tuning.profile import RoutingProfile
from tokenrouter_ray.tuning.search import evaluate, sweep
from tokenrouter_ray.tuning.solver import ThresholdSolver

SOLVE_GRAIN_MS = TunerSpec().grain_ms  # the live tuner's default grain


def best_thresholds(profile: RoutingProfile, n: int) -> tuple[tuple[int, ...], float]:
    """The Markov model's best (B_small = 1, B_large) at N, and its predicted tok/s."""
    best = sweep(profile, n, fixed={profile.names[0]: 1}, method="exact").best
    return best.thresholds, best.throughput


def tuner_choice(profile: RoutingProfile, n: int, max_rounds: int = 20) -> tuple[int, ...]:
    """The live tuner's thresholds at N for a profile that holds still: ``ThresholdSolver``
    (B_small fixed at 1, the tuner's default hysteresis and step bound) from all-ones,
    decided again until it stops moving."""
    spec = TunerSpec()
    solver = ThresholdSolver(profile.names, concurrencies=[n], grain_ms=profile.grain_ms,
                             fixed={profile.names[0]: 1}, min_gain=spec.min_gain,
                             max_step=spec.max_step, drift=spec.drift)  # fmt: skip
    for _ in range(max_rounds):
        if not solver.decide(profile, force=True).changed:
            break
    return tuple(solver.thresholds[m][n] for m in profile.names)


@dataclass
class Level:
    """One closed-loop level of one system."""

    system: str
    n: int
    thresholds: tuple[int, ...]
    tok_s: float
    predicted: float | None
    step_ms: tuple[float, ...]  # step period per model: launch to launch, back-to-back steps
    profiled_ms: tuple[float, ...]  # the profile's step time at the mean batch
    mean_batch: tuple[float, ...]
    host_us: dict[str, dict[str, float]]  # model -> phase -> µs per step
    frames_per_token: float
    messages_per_token: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ratio(self) -> float | None:
        return self.tok_s / self.predicted if self.predicted else None


async def in_process_level(
    system: str,
    profile: RoutingProfile,
    n: int,
    thresholds: tuple[int, ...],
    window_s: float,
    warmup_s: float,
    predicted: float | None,
) -> Level:
    loop = ClosedLoop(profile, n, thresholds, max_defer_s=float("inf"))
    async with loop:
        await asyncio.sleep(warmup_s)
        before = [_host(s) for s in loop.servers]
        ingress0 = loop.runtime.ingress.frames_received if loop.runtime.ingress else 0
        channels = [s.channel for s in loop.servers] + [loop.runtime.ingress.channel]
        bytes0 = sum(c.bytes_sent for c in channels)
        m = await loop.measure(window_s, thresholds)
        windows = [_window(b, _host(s)) for b, s in zip(before, loop.servers, strict=True)]
        ingress1 = loop.runtime.ingress.frames_received if loop.runtime.ingress else 0
        bytes1 = sum(c.bytes_sent for c in channels)
    periods = tuple(math.nan if w["period_ms"] is None else w["period_ms"] for w in windows)
    tokens = max(1.0, m.tokens)
    frames = ingress1 - ingress0 + sum(w["frames"] for w in windows)
    profiled = tuple(mp.step_time_ms(max(1, round(b)))
                     for mp, b in zip(profile.models, m.mean_batch, strict=True))  # fmt: skip
    extra = {"median_gap_ms": m.median_gap_ms, "oversleep_ms": m.oversleep_ms,
             "bytes_per_token": (bytes1 - bytes0) / tokens}  # fmt: skip
    return Level(system, n, thresholds, m.throughput, predicted, periods, profiled,
                 m.mean_batch, {w["name"]: w["us"] for w in windows}, frames / tokens,
                 sum(w["messages"] for w in windows) / tokens, extra)  # fmt: skip


def _host(server: Any) -> dict[str, Any]:
    """A server's host counters now (``_window`` takes two reads apart)."""
    p = server.profile
    return {
        "name": server.name,
        "steps": p.steps,
        "rows": p.rows,
        "phases": dict(p.phases),
        "critical_s": p.critical_s,
        "frames": p.frames,
        "messages": p.messages,
        "period_s": p.period_s,
        "periods": p.periods,
    }


def _window(b: dict[str, Any], a: dict[str, Any]) -> dict[str, Any]:
    """A server's host between two ``_host`` reads: µs per step by phase (``critical``
    included), ``rows`` per step, the step period in ms (None: no back-to-back steps),
    frames and messages."""
    steps, periods = max(1, a["steps"] - b["steps"]), a["periods"] - b["periods"]
    us = {k: (v - b["phases"].get(k, 0.0)) / steps * 1e6 for k, v in sorted(a["phases"].items())}
    us["critical"] = (a["critical_s"] - b["critical_s"]) / steps * 1e6
    us["rows"] = (a["rows"] - b["rows"]) / steps
    period = (a["period_s"] - b["period_s"]) / periods * 1e3 if periods else None
    return {"name": a["name"], "us": us, "period_ms": period, "frames": a["frames"] - b["frames"],
            "messages": a["messages"] - b["messages"]}  # fmt: skip


def run_in_process(levels: list[int], window_s: float, warmup_s: float) -> list[Level]:
    out: list[Level] = []
    paper, zero = paper_r2r(), served_profile("zero")

    def run(system: str, profile: RoutingProfile, n: int, b: tuple[int, ...], pred: float | None):
        level = asyncio.run(in_process_level(system, profile, n, b, window_s, warmup_s, pred))
        out.append(level)
        _print_level(level)

    for n in levels:
        run("paper eager", paper, n, (1, 1), throughput(paper, n, (1, 1)).throughput)
        tuned_b, tuned = best_thresholds(paper, n)
        if tuned_b != (1, 1):
            run("paper tuned", paper, n, tuned_b, tuned)
        run("zero", zero, n, (1, 1), None)
    return out


OPEN_LOOP_LOADS = (0.25, 0.5, 0.75)  # offered tokens/s over Eager-Async's at N = 32
OPEN_LOOP_TOKENS = 64


async def open_loop_level(
    profile: RoutingProfile, load: float, window_s: float, warmup_s: float
) -> dict[str, Any]:
    """Poisson arrivals of ``OPEN_LOOP_TOKENS``-token requests at ``load`` times the paper
    profile's Eager-Async throughput at N = 32, all-1 thresholds, in process: committed
    tok/s beside the offered rate, the mean N, TPOT and TTFT beside the birth-death model's,
    and each model's critical path and step period."""
    from tokenrouter_ray.simulation.validate import open_loop_predictions

    tokens = OPEN_LOOP_TOKENS
    rate = load * throughput(profile, 32, (1, 1)).throughput / tokens  # requests/s
    loop = ClosedLoop(profile, 256, (1, 1), max_defer_s=float("inf"), max_tokens=tokens,
                      clients=0)  # fmt: skip
    async with loop:
        before = [_host(s) for s in loop.servers]
        m = await loop.poisson_load(rate, tokens, window_s=window_s, warmup_s=warmup_s,
                                    drain_timeout_s=10.0)  # fmt: skip
        windows = [_window(b, _host(s)) for b, s in zip(before, loop.servers, strict=True)]
    rates = _eager_token_rates(profile)
    predicted, _ = open_loop_predictions(profile, [[1], [1]], rate, tokens, max_n=len(rates),
                                         requests=2000, token_rates=rates)  # fmt: skip
    host = {w["name"]: {"critical_us": w["us"]["critical"], "period_ms": w["period_ms"],
                        "rows": w["us"]["rows"]} for w in windows}  # fmt: skip
    row = {
        "load": load,
        "offered_tok_s": m.offered,
        "tok_s": m.throughput,
        "mean_n": m.mean_active,
        "predicted_mean_n": predicted.mean_active,
        "tpot_ms": 1e3 * m.mean_tpot_s,
        "predicted_tpot_ms": 1e3 * predicted.mean_latency_s / tokens,
        "ttft_ms_p50": 1e3 * statistics.median(m.ttft_s) if m.ttft_s else None,
        "stalled": m.stalled,
        "host": host,
    }
    hosts = ", ".join(
        f"{name}: crit {h['critical_us']:.0f} µs ({h['rows']:.1f} rows)"
        + (f", step {h['period_ms']:.2f} ms" if h["period_ms"] else "")
        for name, h in host.items()
    )
    print(
        f"open loop {load:.0%} of eager N=32: {row['tok_s']:8.1f} tok/s (offered "
        f"{row['offered_tok_s']:.1f})  mean N {row['mean_n']:.1f} (model "
        f"{row['predicted_mean_n']:.1f})  TPOT {row['tpot_ms']:.2f} ms (model "
        f"{row['predicted_tpot_ms']:.2f})  TTFT p50 {row['ttft_ms_p50'] or 0:.1f} ms  "
        f"stalled {row['stalled']}  [{hosts}]",
        flush=True,
    )
    return row


@functools.cache
def _eager_token_rates(profile: RoutingProfile, max_n: int = 24) -> tuple[float, ...]:
    """T(n), n = 1..max_n, at all-1 thresholds (the open loop's birth-death model extends it
    linearly past max_n: at 24 the predictions move by under 0.1 % against 96)."""
    from tokenrouter_ray.tuning.open_loop import markov_token_rates

    return tuple(markov_token_rates(profile, [[1], [1]], max_n))


def _print_level(level: Level) -> None:
    ratio = f"{level.ratio:6.1%}" if level.ratio is not None else "   -  "
    pred = f"{level.predicted:8.1f}" if level.predicted else "       -"
    host = "; ".join(
        f"{m}: crit {h.get('critical', 0):.0f} µs ({h.get('rows', 0):.0f} rows: route "
        f"{h.get('route', 0):.0f}, commit {h.get('commit', 0):.0f}, receive "
        f"{h.get('receive', 0):.0f}, launch {h.get('launch', 0):.0f} of which schedule "
        f"{h.get('schedule', 0):.0f}), overlapped: report {h.get('report', 0):.0f}, send "
        f"{h.get('send', 0):.0f}, receive {h.get('receive_ahead', 0):.0f}, draft "
        f"{h.get('draft', 0):.0f}"
        for m, h in level.host_us.items()
    )
    print(
        f"{level.system:12} N={level.n:3} B={level.thresholds} {level.tok_s:9.1f} tok/s "
        f"pred {pred} ({ratio})  step ms {level.step_ms[0]:.2f}/{level.step_ms[1]:.2f} "
        f"(profile {level.profiled_ms[0]:.2f}/{level.profiled_ms[1]:.2f}, batch "
        f"{level.mean_batch[0]:.1f}/{level.mean_batch[1]:.1f})  frames/tok "
        f"{level.frames_per_token:.2f} msgs/tok {level.messages_per_token:.2f} bytes/tok "
        f"{level.extra.get('bytes_per_token', 0):.0f}  [{host}]",
        flush=True,
    )


# ------------------------------------------------------------------------------- served
PEER_TRANSPORTS = {"ipc": "transport=zmq_ipc", "unix": "transport=unix"}


def sim_overrides(
    profile: str, large_thresholds: list[int] | None = None, peer_transport: str = "ipc"
) -> list[str]:
    """``conf/sim_paper.yaml``'s app with both models on ``profile`` (and, if given, the large
    model's deferred-launch table, index = N, with no max wait), its peers on
    ``peer_transport`` (``PEER_TRANSPORTS``: ZeroMQ ipc, or the bare unix sockets)."""
    out = [
        "models=sim_paper",
        "policy=bernoulli",
        PEER_TRANSPORTS[peer_transport],
        "placement=local",
        f"models.small.sim.profile={profile}",
        f"models.large.sim.profile={profile}",
    ]
    if large_thresholds is not None:
        table = ",".join(str(b) for b in large_thresholds)
        out += [f"models.large.scheduler.batch_thresholds=[{table}]",
                "scheduler.max_defer_s=1000000"]  # fmt: skip
    return out


def served_profile(profile: str) -> RoutingProfile:
    """The routing profile of a served sim profile (``simulation/served.py``): its step
    times, the paper's R2R routing (the ``bernoulli`` policy at p = 0.35)."""
    from tokenrouter_ray.simulation.served import profile_models

    paper = paper_r2r()
    return RoutingProfile(tuple(profile_models(profile)), paper.route_prob, paper.commit,
                          paper.grain_ms)  # fmt: skip


def tuned_table(
    levels: list[int], profile: str = "paper", transit_ms: dict[int, float] | None = None
) -> list[int]:
    """The large model's table up to the largest served level. Without ``transit_ms``: the
    model's best B at every N (served clients reconnect between requests, so the active count
    moves below the level). With it (level -> ms a handoff took in the all-ones run there):
    what the live tuner decides at each level with that transit priced in, filled between
    levels as the tuner fills."""
    routing = served_profile(profile)
    if transit_ms and any(n > 1 for n in transit_ms):
        tuned = {n: tuner_choice(routing.with_grain(SOLVE_GRAIN_MS).with_transit(d), n)[1]
                 for n, d in transit_ms.items() if n > 1}  # fmt: skip
        return ThresholdTable.from_tuned(tuned, max(levels)).to_list()
    return [1, 1] + [best_thresholds(routing, n)[0][1] for n in range(2, max(levels) + 1)]


# Serve's front on the local cluster: its Python proxy (the default), or its HAProxy ingress
# (``RAY_SERVE_ENABLE_HA_PROXY=1``, read when the cluster starts: ``--front haproxy``).
FRONTS = {"proxy": {}, "haproxy": {"RAY_SERVE_ENABLE_HA_PROXY": "1"}}

# each on Serve's front, then on the ingress's own port
SERVED_SYSTEMS = tuple(
    f"{s}{d}" for d in ("", " direct") for s in ("paper eager", "paper tuned", "zero")
)
DIRECT_PORT = 18190  # "... direct": the clients talk to the ingress's own port (no proxy)


def run_served(
    levels: list[int], window_s: float, max_tokens: int, deploy: ServeDeploy,
    systems: tuple[str, ...] = SERVED_SYSTEMS, direct_port: int = DIRECT_PORT,
    client: str = "stream", front: str = "proxy", peer_transport: str = "ipc",
) -> list[dict[str, Any]]:  # fmt: skip
    """Each system's app deployed with ``deploy(overrides, name)``, driven at each level; a
    ``... direct`` system's clients use the ingress's own port instead of Serve's front.
    ``client``, ``front``, ``peer_transport``: ``CLIENTS``, ``FRONTS``, ``PEER_TRANSPORTS``
    (rows carry them)."""
    rows: list[dict[str, Any]] = []
    for system in systems:
        profile, direct = system.split()[0], system.endswith(" direct")
        table = None
        if system.split()[1:2] == ["tuned"]:  # priced with the transit all-ones measured
            eager = system.replace(" tuned", " eager")
            seen = {r["n"]: r["handoff_ms"] for r in rows if r["system"] == eager}
            table = tuned_table(levels, profile, seen)
        name = "host-" + system.replace(" ", "-")
        overrides = sim_overrides(profile, table, peer_transport)
        if direct:
            overrides.append(f"ingress.direct_port={direct_port}")
        with deploy(overrides, name) as base:
            url = base.removesuffix("/v1")
            client_url = f"http://127.0.0.1:{direct_port}" if direct else url
            wait_ready(f"{url}/health")
            if direct:  # the ingress's own port answers once its replica started it
                wait_ready(f"{client_url}/health")
            for n in levels:
                if table is not None and table[n] == 1:  # tuned is all-1: the eager run's
                    eager = system.replace(" tuned", " eager")
                    same = next((r for r in rows if (r["n"], r["system"]) == (n, eager)), None)
                    if same is not None:
                        rows.append({**same, "system": system, "same_as": same["system"]})
                        print(f"served {system} N={n}: all-1 is the tuned table ({eager}'s run)")
                    continue
                row = asyncio.run(_served_level(url, n, window_s, max_tokens, client_url, client))
                row.update(profile=profile, system=system, n=n, client=client, front=front,
                           transport=peer_transport)  # fmt: skip
                if profile != "zero":
                    b = (1, table[n] if table else 1)
                    row["thresholds"] = b
                    row["predicted"] = evaluate(served_profile(profile), n, [b])[0][0].throughput
                rows.append(row)
                _print_served(row)
    return rows


def _window_host(h0: dict[str, Any], h1: dict[str, Any]) -> dict[str, float]:
    """A replica's host phases per step (µs) in the window between two status reads (the
    route returns means since the replica started): each phase weighted by steps, the
    step period by back-to-back steps; ``rows``: sampled rows per step."""
    steps = h1.get("steps", 0) - h0.get("steps", 0)
    p0, p1 = h0.get("per_step_us") or {}, h1.get("per_step_us") or {}
    out = {}
    for phase, mean in p1.items():
        n0, n1 = (h.get("periods" if phase == "period" else "steps", 0) for h in (h0, h1))
        out[phase] = (mean * n1 - p0.get(phase, 0.0) * n0) / (n1 - n0) if n1 > n0 else 0.0
    out["rows"] = (h1.get("rows", 0) - h0.get("rows", 0)) / steps if steps else 0.0
    return out


def _bytes_sent(stats: dict[str, Any]) -> int:
    return stats["bytes_sent"] + sum(m.get("bytes_sent", 0) for m in stats["models"].values())


async def _stats(url: str) -> dict[str, Any]:
    import httpx

    async with httpx.AsyncClient() as client:
        return (await client.get(f"{url}/v1/tokenrouter/stats", timeout=30)).json()


# The closed loop's clients: streamed chat completions, or non-streamed completions.
CLIENTS = ("stream", "completions")


async def _served_level(
    url: str, n: int, window_s: float, max_tokens: int, client_url: str | None = None,
    client_kind: str = "stream",
) -> dict[str, Any]:  # fmt: skip
    """One closed-loop level: ``n`` clients of ``client_kind`` (``CLIENTS``) on
    ``client_url`` (default: ``url``, Serve's proxy), the app's counters read from ``url``."""
    import openai

    client_url = client_url or url
    client = openai.AsyncOpenAI(base_url=f"{client_url}/v1", api_key="unused", max_retries=0)
    stop = asyncio.Event()
    ttfts: list[float] = []
    chunks = [0]

    async def one_client() -> None:
        while not stop.is_set():
            if client_kind == "completions":  # one response per request
                await client.completions.create(
                    model="tokenrouter", prompt="hello", max_tokens=max_tokens, temperature=0
                )
                continue
            t0 = time.perf_counter()
            first = True
            stream = await client.chat.completions.create(
                model="tokenrouter",
                messages=[{"role": "user", "content": "hello"}],
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
            )
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    chunks[0] += 1
                    if first:
                        ttfts.append(time.perf_counter() - t0)
                        first = False

    import httpx

    async with httpx.AsyncClient() as http:  # the HTTP round trip alone, for comparison
        rtts = []
        for _ in range(20):
            t0 = time.perf_counter()
            await http.get(f"{client_url}/health", timeout=5)
            rtts.append(time.perf_counter() - t0)
    tasks = [asyncio.create_task(one_client()) for _ in range(n)]
    await asyncio.sleep(min(2.0, window_s))  # warm-up
    s0, t0, c0, ttft0 = await _stats(url), time.perf_counter(), chunks[0], len(ttfts)
    cpu = CpuWindow(app_pids(s0))
    cpu.start()
    await asyncio.sleep(window_s)
    used = cpu.stop()
    s1, t1, c1 = await _stats(url), time.perf_counter(), chunks[0]
    stop.set()
    await asyncio.wait(tasks, timeout=60)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await client.close()
    elapsed = t1 - t0
    tokens = s1["tokens_received"] - s0["tokens_received"]
    models = {}
    for name, st in s1["models"].items():
        before = s0["models"][name]
        sim0, sim1 = before.get("sim") or {}, st.get("sim") or {}
        steps = max(1, sim1.get("steps", 0) - sim0.get("steps", 0))
        h0, h1 = before.get("host") or {}, st.get("host") or {}
        host = _window_host(h0, h1)
        summed = [(x.get("mean_batch") or 0.0) * x.get("steps", 0) for x in (sim0, sim1)]
        models[name] = {
            "step_ms": host.get("period", 0.0) / 1e3 or elapsed / steps * 1e3,
            "mean_batch": (summed[1] - summed[0]) / steps,  # in the window
            "rows": host.pop("rows", 0.0),
            "host_us": host,
            "message_latency_us": h1.get("message_latency_us"),
            "applied_p50_us": _applied_p50(h0, h1),
            "applied_mean_us": _applied_mean(h0, h1),
        }
    window_ttfts = ttfts[ttft0:] or ttfts
    probe = probe_httpx = None
    if n == 1:  # one request at a time: each first-token path, and the policy's mix
        probe, probe_httpx = [
            {path: await ttft_probe(client_url, p=p, client=c) for path, p in PROBE_ROUTING.items()}
            for c in PROBE_CLIENTS
        ]
    return {
        "tok_s": tokens / elapsed,
        "sse_chunks_per_token": (c1 - c0) / max(1, tokens),
        "frames_per_token": (s1["frames_received"] - s0["frames_received"]) / max(1, tokens),
        "bytes_per_token": (_bytes_sent(s1) - _bytes_sent(s0)) / max(1, tokens),
        "ingress_cpu_us_per_token": (s1["cpu_s"] - s0["cpu_s"]) / max(1, tokens) * 1e6,
        "cpu_us_per_token": per_token_us(used, tokens),  # per process, from /proc
        "wakeups_per_token": {name: w / max(1, tokens) for name, w in cpu.wakes.items()},
        # ms a message took from its sender to its application, the mean over both models
        "handoff_ms": statistics.mean(m["applied_mean_us"] or 0.0 for m in models.values()) / 1e3,
        "ttft_ms_p50": 1e3 * statistics.median(window_ttfts) if window_ttfts else None,
        "ttft_probe_ms_p50": probe and probe["mixed"],
        "ttft_probe_paths_ms_p50": probe,  # mixed / kept / escalated (PROBE_ROUTING), raw
        "ttft_probe_httpx_paths_ms_p50": probe_httpx,  # the same through httpx
        "health_rtt_ms_p50": 1e3 * statistics.median(rtts),  # GET /health, same path
        "models": models,
    }


def _applied_p50(h0: dict[str, Any], h1: dict[str, Any]) -> float | None:
    """The median µs from a message's building to its application at this replica, over
    the messages applied between two status reads."""
    a, b = h0.get("applied_hist") or [], h1.get("applied_hist") or []
    if not b:
        return None
    return latency_quantile_us([y - (a[k] if k < len(a) else 0) for k, y in enumerate(b)], 0.5)


def _applied_mean(h0: dict[str, Any], h1: dict[str, Any]) -> float | None:
    """The mean of the same (the status route's means since start, weighted by counts)."""
    c0, c1 = sum(h0.get("applied_hist") or []), sum(h1.get("applied_hist") or [])
    m0 = (h0.get("message_latency_us") or {}).get("applied", 0.0)
    m1 = (h1.get("message_latency_us") or {}).get("applied", 0.0)
    return (m1 * c1 - m0 * c0) / (c1 - c0) if c1 > c0 else None


def _print_served(row: dict[str, Any]) -> None:
    pred = row.get("predicted")
    ratio = f" ({row['tok_s'] / pred:.1%} of {pred:.1f})" if pred else ""
    steps = ", ".join(
        f"{m}: step {v['step_ms']:.2f} ms, batch {v['mean_batch'] or 0:.1f}, "
        f"crit {(v['host_us'] or {}).get('critical', 0):.0f} µs, message applied p50 "
        f"{v['applied_p50_us'] or 0:.0f} µs"
        for m, v in row["models"].items()
    )
    paths = row.get("ttft_probe_paths_ms_p50")
    alone = ""
    if paths:
        each = " / ".join(f"{paths[k]:.1f}" for k in PROBE_ROUTING)
        alone = f", one at a time {each} ms ({' / '.join(PROBE_ROUTING)}"
        by_httpx = row.get("ttft_probe_httpx_paths_ms_p50")
        if by_httpx:
            alone += "; through httpx " + " / ".join(f"{by_httpx[k]:.1f}" for k in PROBE_ROUTING)
        alone += ")"
    path = via(row["system"], row.get("front", "proxy"))
    name = row["system"] + (
        f" via {path}" if path not in ("Serve's proxy", "the direct port") else ""
    )
    print(
        f"served {name:11} N={row['n']:3} {row['tok_s']:9.1f} tok/s{ratio}  TTFT p50 "
        f"{row['ttft_ms_p50'] or 0:.1f} ms{alone} (GET /health {row['health_rtt_ms_p50']:.1f} ms)  "
        f"{format_cpu(row['cpu_us_per_token'])}  {format_wakes(row.get('wakeups_per_token', {}))}"
        f"  client {row.get('client', 'stream')}  "
        f"SSE chunks/token {row['sse_chunks_per_token']:.2f}  frames/token "
        f"{row['frames_per_token']:.2f}  bytes/token {row['bytes_per_token']:.0f}  [{steps}]",
        flush=True,
    )


# ------------------------------------------------------------------------------ targets
def targets(levels: list[Level], served: list[dict[str, Any]]) -> list[tuple[str, bool, str]]:
    out: list[tuple[str, bool, str]] = []

    def level(system: str, n: int) -> Level | None:
        return next((x for x in levels if x.system == system and x.n == n), None)

    for n, goal in ((8, 0.93), (32, 0.90)):
        x = level("paper eager", n)
        if x is not None and x.ratio is not None:
            out.append((f"paper N={n} >= {goal:.0%} of Markov", x.ratio >= goal, f"{x.ratio:.1%}"))
    for n in sorted({x.n for x in levels}):
        eager, tuned = level("paper eager", n), level("paper tuned", n)
        if eager and tuned and eager.predicted and tuned.predicted:
            measured = tuned.tok_s / eager.tok_s
            model = tuned.predicted / eager.predicted
            out.append((
                f"N={n} tuned/eager within 3 points of the model",
                abs(measured - model) <= 0.03,
                f"measured {measured:.3f}, model {model:.3f}",
            ))  # fmt: skip
    out += [critical_target(f"in-process zero N={x.n} {model}", h)
            for x in levels if x.system == "zero" for model, h in x.host_us.items()]  # fmt: skip
    for x in (x for x in levels if x.system == "paper eager" and x.n >= 32):
        ratio = x.step_ms[1] / x.profiled_ms[1]
        out.append((
            f"{x.system} N={x.n}: large step period <= 1.05x profile",
            ratio <= 1.05,
            f"{x.step_ms[1]:.2f} ms vs {x.profiled_ms[1]:.2f} ({ratio:.3f}x)",
        ))  # fmt: skip

    return out + served_targets(served)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest host", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--levels", default="1,8,32,64", help="closed-loop N, e.g. 1,8,32")
    parser.add_argument("--window-s", type=float, default=4.0)
    parser.add_argument("--warmup-s", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=128, help="served answers' length")
    parser.add_argument("--no-served", action="store_true", help="skip the Serve app part")
    parser.add_argument("--no-in-process", action="store_true", help="skip the in-process part")
    parser.add_argument(
        "--open-loop-loads",
        default=",".join(str(x) for x in OPEN_LOOP_LOADS),
        help="open loop (in process): offered load as a fraction of Eager-Async's tok/s at "
        "N = 32, comma list; empty: skip",
    )
    parser.add_argument("--served-levels", default="1,8,32")
    parser.add_argument(
        "--served-systems", default=",".join(SERVED_SYSTEMS), help="comma list of served systems"
    )
    parser.add_argument(
        "--client", choices=CLIENTS, default="stream",
        help="served clients: streamed chat completions (an SSE chunk per token) or "
        "non-streamed completions",
    )  # fmt: skip
    parser.add_argument(
        "--front", choices=sorted(FRONTS), default="proxy",
        help="Serve's front for the systems not named 'direct': its Python proxy, or its "
        "HAProxy ingress (RAY_SERVE_ENABLE_HA_PROXY=1 on the cluster this starts)",
    )  # fmt: skip
    parser.add_argument(
        "--peer-transport", choices=sorted(PEER_TRANSPORTS), default="ipc",
        help="how the served app's processes reach each other: ZeroMQ over ipc, or the bare "
        "unix sockets (transport/unix_channel.py)",
    )  # fmt: skip
    parser.add_argument("--port", type=int, default=18170)
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args(argv)
    levels = [int(x) for x in args.levels.split(",")]
    print(f"{header()}\na thread's wake-up costs {wake_cost_us():.0f} µs of CPU here", flush=True)
    in_process = [] if args.no_in_process else run_in_process(levels, args.window_s, args.warmup_s)
    loads = [] if args.no_in_process else [float(x) for x in args.open_loop_loads.split(",") if x]
    open_loop = [
        asyncio.run(open_loop_level(paper_r2r(), load, args.window_s, args.warmup_s))
        for load in loads
    ]
    served: list[dict[str, Any]] = []
    if not args.no_served:
        served_levels = [int(x) for x in args.served_levels.split(",")]
        os.environ.update(FRONTS[args.front])  # before the cluster starts (on first deploy)
        deploy = ray_serve_deploy(args.port)
        systems = tuple(args.served_systems.split(","))
        served = run_served(served_levels, args.window_s, args.max_tokens, deploy, systems,
                            client=args.client, front=args.front,
                            peer_transport=args.peer_transport)  # fmt: skip
    print_targets(targets(in_process, served))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"in_process": [x.__dict__ for x in in_process], "served": served,
                       "open_loop": open_loop}, f, indent=1, default=str)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
