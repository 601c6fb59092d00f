"""Loads on the simulated runtime (``simulation/backend.py``) and what they measure.

``measure_closed_loop`` runs a closed system like the Markov model's: ``N`` client loops,
each keeping one request in flight (a finished request is replaced at once), and counts
committed tokens per second over a window after a warm-up (``SimMeasurement``).
``ClosedLoop.set_clients`` changes the number of clients mid-run (removed clients' requests
are aborted, as when HTTP clients leave) and ``ClosedLoop.step_load`` samples committed
tokens through a schedule of client counts (``StepLoadTrace``). ``ClosedLoop.poisson_load``
is the open loop: Poisson arrivals of fixed-length requests, with per-request time per
output token, the time-average number active and the deferred timeouts
(``OpenLoopMeasurement``; ``tuning/open_loop.py`` predicts the same quantities).
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import math
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenrouter_ray.engine.engine import Engine
from tokenrouter_ray.local import LocalRuntime
from tokenrouter_ray.metrics.latency import token_gaps
from tokenrouter_ray.metrics.recorder import Metrics
from tokenrouter_ray.protocol import SamplingSpec
from tokenrouter_ray.replica.window import WindowSnapshot
from tokenrouter_ray.routing.policy import build_policy
from tokenrouter_ray.simulation.backend import (
    CountingBackend,
    ReplicatedRuntime,
    SimStats,
    calibrate_sleep_bias,
    escalation_probability,
    profile_step_seconds,
    sim_engine,
)
from tokenrouter_ray.thresholds import ThresholdTable, check_admissible
from tokenrouter_ray.tuning.profile import RoutingProfile


@dataclass(frozen=True)
class SimMeasurement:
    """One closed-loop run of the simulated runtime (throughput in the profile's time base)."""

    n_requests: int
    thresholds: tuple[int, ...]
    throughput: float  # committed tokens/s, multiplied back by time_scale
    tokens: float  # committed in the window
    window_s: float  # wall seconds of the window
    time_scale: float
    steps: tuple[int, ...]  # per model, in the window
    mean_batch: tuple[float, ...]  # per model, in the window
    busy_fraction: tuple[float, ...]  # simulated compute / window, per model
    median_gap_ms: tuple[float, ...]  # per model: previous step end -> next step start
    oversleep_ms: tuple[float, ...]  # per model: mean (slept - requested) per step
    handoffs: int
    finished_requests: int
    escalation_rate: float  # realized p(small->large): escalations / small-model rows
    deferred_timeouts: int = 0  # launches forced by max_defer_s in the window, all engines
    # (src, dst) -> mean ms (profile time base) from a handoff's building to its application
    # at the receiver, over the window: the transit the tuner's window records
    transit_ms: dict[tuple[str, str], float] = field(default_factory=dict)

    def realized_profile(self, profile: RoutingProfile) -> RoutingProfile:
        """``profile`` (its transit too) with the routing probability this run drew."""
        q = self.escalation_rate
        return RoutingProfile(profile.models, ((1 - q, q), (1.0, 0.0)), profile.commit,
                              profile.grain_ms, profile.transit_ms)  # fmt: skip

    def measured_profile(self, profile: RoutingProfile) -> RoutingProfile:
        """``realized_profile`` with the transit this run measured (what the live tuner
        solves from)."""
        names = profile.names
        matrix = [[0.0 if a == b else self.transit_ms.get((a, b), 0.0) for b in names]
                  for a in names]  # fmt: skip
        return self.realized_profile(profile).with_transit(matrix)

    @property
    def raw_throughput(self) -> float:
        """Tokens per wall-clock second (not rescaled)."""
        return self.tokens / self.window_s


@dataclass(frozen=True)
class OpenLoopResult:
    """One open-loop run: how many requests finished, and how many never did (stalled)."""

    submitted: int
    finished: int
    stalled: int
    elapsed_s: float
    deferred_timeouts: int  # launches below the threshold forced by max_defer_s, all engines


def poisson_arrivals(
    rate: float, segments: Sequence[float], rng: random.Random, exact_count: bool = True
) -> list[float]:
    """Arrival times over consecutive segments of the given lengths (seconds).

    ``exact_count=False``: a Poisson process of ``rate`` (exponential gaps). ``True``: each
    segment gets ``round(rate * length)`` arrivals at independent uniform times, sorted --
    the Poisson process conditioned on that count (given its count, a Poisson process's
    points are uniform order statistics), so gaps stay exponential-like while the offered
    load per segment is exact."""
    out: list[float] = []
    offset = 0.0
    for length in segments:
        if exact_count:
            count = round(rate * length)
            out.extend(sorted(offset + rng.uniform(0.0, length) for _ in range(count)))
        else:
            at = offset + rng.expovariate(rate)
            while at < offset + length:
                out.append(at)
                at += rng.expovariate(rate)
        offset += length
    return out


@dataclass(frozen=True)
class OpenLoopMeasurement:
    """One Poisson-arrival run of ``ClosedLoop.poisson_load`` (profile time base)."""

    arrival_rate: float  # requests/s offered
    tokens_per_request: int
    window_s: float
    throughput: float  # committed tokens/s in the window
    mean_active: float  # time-average of requests submitted and not finished, in the window
    max_active: int
    arrivals_in_window: int
    submitted: int  # in all (warm-up and window)
    finished: int  # by the end of the drain
    finished_by_window_end: int
    stalled: int  # never finished within the drain timeout
    tpot_s: tuple[float, ...]  # per request arriving in the window: (finish - arrival) / L
    ttft_s: tuple[float, ...]
    gaps_s: tuple[float, ...]  # inter-token gaps of those requests
    escalation_rate: float  # realized p(small->large) in the window
    deferred_timeouts: int  # launches forced by max_defer_s in the window (steady state)
    deferred_timeouts_total: int  # ... over the whole run, the drain included
    time_scale: float = 1.0
    oversleep_ms: tuple[float, ...] = ()  # per model: mean wall ms a step ran past its time

    @property
    def offered(self) -> float:
        """Tokens/s the arrivals ask for, ``lambda L``."""
        return self.arrival_rate * self.tokens_per_request

    def tpot_quantile(self, q: float) -> float:
        return _quantile(self.tpot_s, q)

    def gap_quantile(self, q: float) -> float:
        return _quantile(self.gaps_s, q)

    @property
    def mean_tpot_s(self) -> float:
        return statistics.fmean(self.tpot_s) if self.tpot_s else float("nan")


def _quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default), nan when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True)
class StepLoadTrace:
    """What ``ClosedLoop.step_load`` sampled (profile time base, from the first phase)."""

    clients: tuple[int, ...]  # per phase
    starts_s: tuple[float, ...]  # when each phase's client count was set
    end_s: float
    times_s: tuple[float, ...]
    committed: tuple[float, ...]  # cumulative committed tokens at each sample
    deferred_timeouts: tuple[int, ...]  # cumulative, all engines

    def phase_end(self, phase: int) -> float:
        return self.starts_s[phase + 1] if phase + 1 < len(self.starts_s) else self.end_s

    def _at(self, t: float) -> float:
        """Committed tokens at time t (linear between samples)."""
        return float(_interp(t, self.times_s, self.committed))

    def rate(self, t0: float, t1: float) -> float:
        """Committed tokens/s over [t0, t1]."""
        return (self._at(t1) - self._at(t0)) / (t1 - t0)

    def timeouts_between(self, t0: float, t1: float) -> int:
        """Deferred timeouts counted by the samples taken in (t0, t1]."""

        def at(t: float) -> int:
            i = bisect.bisect_right(self.times_s, t)
            return self.deferred_timeouts[max(0, i - 1)]

        return at(t1) - at(t0)


def _interp(t: float, xs: Sequence[float], ys: Sequence[float]) -> float:
    i = bisect.bisect_right(xs, t)
    if i == 0:
        return float(ys[0])
    if i >= len(xs):
        return float(ys[-1])
    x0, x1 = xs[i - 1], xs[i]
    return float(ys[i - 1] + (ys[i] - ys[i - 1]) * (t - x0) / (x1 - x0)) if x1 > x0 else ys[i]


def _merged_stats(parts: Sequence[SimStats]) -> SimStats:
    """One model's statistics over its replicas (busy time summed: up to R x the window)."""
    return SimStats(
        steps=sum(p.steps for p in parts),
        batch_sum=sum(p.batch_sum for p in parts),
        busy_s=sum(p.busy_s for p in parts),
        gaps_s=[g for p in parts for g in p.gaps_s],
        oversleep_s=sum(p.oversleep_s for p in parts),
    )


def thresholds_table(n_requests: int, value: int) -> list[int]:
    """A scheduler ``batch_thresholds`` list with ``value`` at index N (1 below it)."""
    return ThresholdTable.from_tuned({n_requests: value}).to_list()


class ClosedLoop:
    """``N`` client loops, each keeping one request in flight, over a ``LocalRuntime`` of
    simulated engines (``async with``). ``measure(window_s)`` counts what the runtime
    committed in a window; ``servers`` and ``policy`` stay reachable, so a caller can attach
    the tuner (``tuning.tuner.drive_local``) or change the routing probability mid-run
    (``set_escalation``).

    ``thresholds`` per model is one B (``thresholds_table``: B at index N, 1 below) or a
    full scheduler ``batch_thresholds`` list. With ``replicas`` above one per model it runs
    ``ReplicatedRuntime``; ``assignment`` is its replica placement (default: production's
    rule, ingress/placement.py). ``transit_s``: every frame (handoffs, commits, the
    ingress's messages) takes this long to arrive (a simulated network).
    """

    def __init__(
        self,
        profile: RoutingProfile,
        n_requests: int,
        thresholds: Sequence[int | Sequence[int]],
        time_scale: float = 1.0,
        seed: int = 0,
        max_defer_s: float = 1.0,
        max_tokens: int = 1 << 14,
        sleep_bias_s: float = 0.0,
        prompt_len: int = 4,
        replicas: Sequence[int] | None = None,
        clients: int | None = None,
        assignment: str = "placement",
        transit_s: float = 0.0,
    ) -> None:
        q = escalation_probability(profile)
        self.clients = n_requests if clients is None else clients
        if len(thresholds) != 2:
            raise ValueError(f"need one threshold per model (2), got {thresholds}")
        counts = [1, 1] if replicas is None else [int(r) for r in replicas]
        if len(counts) != 2 or min(counts) < 1:
            raise ValueError(f"need one replica count >= 1 per model (2), got {replicas}")
        tables = [
            thresholds_table(n_requests, b) if isinstance(b, int) else [int(x) for x in b]
            for b in thresholds
        ]
        self.time_scale = time_scale
        block_size = 16
        per_request_blocks = math.ceil((prompt_len + max_tokens + 2) / block_size) + 1
        num_blocks = n_requests * per_request_blocks + 8
        engines: list[tuple[str, list[Engine]]] = []
        for model, table, count in zip(profile.models, tables, counts, strict=True):
            replica_engines = [
                sim_engine(
                    profile_step_seconds(model, time_scale),
                    table,
                    max_defer_s=max_defer_s,
                    max_num_seqs=model.max_batch or max(n_requests, 1),
                    num_blocks=num_blocks,
                    block_size=block_size,
                    sleep_bias_s=sleep_bias_s,
                )
                for _ in range(count)
            ]
            engines.append((model.name, replica_engines))
        self.names = [name for name, _ in engines]
        self.replicas = tuple(counts)
        self.model_runners = [[e.runner for e in group] for _, group in engines]
        self.runners = [group[0] for group in self.model_runners]  # first replica of each
        self.policy = build_policy("bernoulli", {"p": q}, self.names)
        self.backend = CountingBackend()
        metrics = Metrics(self.backend, policy="bernoulli")
        if counts == [1, 1]:
            self.runtime = LocalRuntime(
                [(name, group[0]) for name, group in engines],
                self.policy,
                metrics=metrics,
                transit_s=transit_s,
            )
        else:
            self.runtime = ReplicatedRuntime(
                engines, self.policy, assignment=assignment, metrics=metrics, transit_s=transit_s
            )
        self.n_requests = n_requests
        self.finished = 0
        self.finished_by_client: list[int] = []
        self._rng = random.Random(seed)
        self._prompt = [1] * prompt_len
        self._max_tokens = max_tokens
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._client_ids = itertools.count()

    @property
    def servers(self) -> list[Any]:
        return self.runtime.model_replicas

    def set_escalation(self, q: float) -> None:
        """Change p(small->large) of the running policy (a shift in the traffic)."""
        self.policy.config = self.policy.config.model_copy(update={"p": float(q)})

    async def __aenter__(self) -> ClosedLoop:
        await self.runtime.start()
        self.finished_by_client = []
        self._tasks = [self._spawn_client() for _ in range(self.clients)]
        return self

    def _spawn_client(self) -> asyncio.Task:
        k = next(self._client_ids)  # never reused: request ids stay unique
        self.finished_by_client.append(0)
        return asyncio.create_task(self._client(k))

    async def set_clients(self, n: int) -> None:
        """Change the number of closed-loop clients at once: new clients start submitting;
        removed ones (the newest first) are cancelled with their request in flight, which
        the ingress aborts on every model, as when an HTTP client goes away."""
        if n < 0:
            raise ValueError(f"client count must be >= 0, got {n}")
        while len(self._tasks) < n:
            self._tasks.append(self._spawn_client())
        extra, self._tasks = self._tasks[n:], self._tasks[:n]
        for task in extra:
            task.cancel()
        await asyncio.gather(*extra, return_exceptions=True)
        self.clients = n

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.runtime.stop()

    async def _client(self, k: int) -> None:
        serial = 0
        while not self._stop.is_set():
            spec = SamplingSpec(
                temperature=0.0,
                max_tokens=self._max_tokens,
                ignore_eos=True,
                seed=self._rng.getrandbits(62),
            )
            await self.runtime.complete(self._prompt, spec, request_id=f"sim-{k}-{serial}")
            serial += 1
            self.finished += 1
            self.finished_by_client[k] += 1

    async def open_loop(
        self, rate_per_s: float, count: int, max_tokens: int, timeout_s: float, seed: int = 0
    ) -> OpenLoopResult:
        """Submit ``count`` requests of ``max_tokens`` tokens with Poisson arrivals at
        ``rate_per_s`` (profile time base: wall rate = rate / time_scale) and wait up to
        ``timeout_s`` wall seconds for all of them; the ones still unfinished then stalled."""
        rng = random.Random(seed)
        done: list[float] = []
        started = time.perf_counter()

        async def one(k: int) -> None:
            spec = SamplingSpec(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                seed=rng.getrandbits(62))  # fmt: skip
            await self.runtime.complete(self._prompt, spec, request_id=f"open-{k}")
            done.append(time.perf_counter() - started)

        tasks = []
        for k in range(count):
            tasks.append(asyncio.create_task(one(k)))
            await asyncio.sleep(rng.expovariate(rate_per_s / self.time_scale))
        finished, unfinished = await asyncio.wait(tasks, timeout=timeout_s)
        for task in unfinished:
            task.cancel()
        await asyncio.gather(*unfinished, return_exceptions=True)
        errors = [t.exception() for t in finished if t.exception() is not None]
        if errors:
            raise errors[0]
        return OpenLoopResult(
            submitted=count,
            finished=len(finished),
            stalled=len(unfinished),
            elapsed_s=time.perf_counter() - started,
            deferred_timeouts=sum(e.scheduler.deferred_timeouts for e in self.engines),
        )

    async def _timed_request(self, rid: str, spec: SamplingSpec) -> list[float]:
        """Submit one request and stream it to the end; the wall time of every token."""
        ingress = self.runtime.ingress
        try:
            await self.runtime.submit(rid, self._prompt, spec)
        except BaseException:
            self.runtime.placement.release(rid)
            raise
        stamps: list[float] = []
        try:
            async for chunk in ingress.stream(rid):
                now = time.perf_counter()
                stamps.extend([now] * len(chunk))
        finally:
            ingress.abort_nowait(rid)  # no-op once complete; frees the models if cancelled
            done = ingress.release(rid)
            self.runtime.placement.release(rid)
        if done.error:
            raise RuntimeError(f"request {rid} failed: {done.error}")
        return stamps

    async def poisson_load(
        self,
        rate_per_s: float,
        tokens: int,
        window_s: float,
        warmup_s: float = 1.0,
        drain_timeout_s: float = 10.0,
        seed: int = 0,
        exact_count: bool = True,
    ) -> OpenLoopMeasurement:
        """Open loop: Poisson arrivals at ``rate_per_s`` (profile time base) of requests of
        exactly ``tokens`` output tokens for ``warmup_s + window_s``, then none; measured
        over the window: committed tokens/s, the time-average number of active requests
        (submitted, not finished), the deferred timeouts; per request arriving in the
        window, its time per output token ``(finish - arrival) / tokens``, time to first
        token and inter-token gaps. Then it waits up to ``drain_timeout_s`` (wall) for the
        rest: what never finishes stalled. Times and rates are in the profile's time base.
        ``exact_count`` (default): the arrivals of the warm-up and of the window are each a
        Poisson process conditioned on its expected count (``poisson_arrivals``), so the
        offered load in the window is ``lambda L`` up to rounding rather than up to the
        count's ``1 / sqrt(count)`` noise; ``False``: plain exponential gaps."""
        if not rate_per_s > 0 or tokens < 1:
            raise ValueError(f"need a positive rate and tokens >= 1, got {rate_per_s}, {tokens}")
        scale = self.time_scale
        rng = random.Random(seed)
        records: list[tuple[float, list[float]]] = []  # (submitted, token stamps), window only
        active = [0, 0]  # now, max
        area = [0.0, 0.0]  # integral of active over the window, last change (wall)
        window = [math.inf, math.inf]  # wall start, end
        start = time.perf_counter()

        def change(delta: int) -> None:
            now = time.perf_counter()
            lo, hi = max(area[1], window[0]), min(now, window[1])
            if hi > lo:
                area[0] += active[0] * (hi - lo)
            area[1] = now
            active[0] += delta
            active[1] = max(active[1], active[0]) if now >= lo else active[1]

        async def one(k: int, submitted: float, keep: bool) -> None:
            spec = SamplingSpec(temperature=0.0, max_tokens=tokens, ignore_eos=True,
                                seed=rng.getrandbits(62))  # fmt: skip
            change(+1)
            try:
                stamps = await self._timed_request(f"poisson-{seed}-{k}", spec)
            finally:
                change(-1)
            if keep:
                records.append((submitted, stamps))

        tasks: list[asyncio.Task] = []
        horizon = (warmup_s + window_s) * scale
        window[0], window[1] = start + warmup_s * scale, start + horizon
        schedule = poisson_arrivals(rate_per_s, [warmup_s, window_s], rng, exact_count)
        snap: dict[str, Any] = {}
        in_window = [0]

        async def mark_start() -> None:
            await asyncio.sleep(max(0.0, window[0] - time.perf_counter()))
            snap.update(self._window_snapshot())

        marker = asyncio.create_task(mark_start())
        for at in schedule:
            delay = start + at * scale - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            now = time.perf_counter()
            in_window[0] += now >= window[0]
            tasks.append(asyncio.create_task(one(len(tasks), now, now >= window[0])))
        await marker
        delay = window[1] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        change(0)  # close the integral at the window's end
        end_snap = self._window_snapshot()
        finished_in_window = sum(t.done() for t in tasks)
        unfinished: set[asyncio.Task] = set()
        if tasks:
            _, unfinished = await asyncio.wait(tasks, timeout=drain_timeout_s)
        for task in unfinished:
            task.cancel()
        await asyncio.gather(*unfinished, return_exceptions=True)
        errors = [t.exception() for t in tasks if not t.cancelled() and t.exception()]
        if errors:
            raise errors[0]
        elapsed = end_snap["t"] - snap["t"]
        oversleep = tuple(
            1000.0 * (o1 - o0) / (n1 - n0) if n1 > n0 else 0.0
            for (o0, n0), (o1, n1) in zip(snap["oversleep"], end_snap["oversleep"], strict=True)
        )
        small_rows = end_snap["small_rows"] - snap["small_rows"]
        tpot, ttft, gaps = [], [], []
        for submitted, stamps in records:
            if len(stamps) == tokens:
                tpot.append((stamps[-1] - submitted) / tokens / scale)
                ttft.append((stamps[0] - submitted) / scale)
                gaps.extend(token_gaps(stamps, scale))
        return OpenLoopMeasurement(
            arrival_rate=rate_per_s,
            tokens_per_request=tokens,
            window_s=elapsed / scale,
            throughput=(end_snap["committed"] - snap["committed"]) / elapsed * scale,
            mean_active=area[0] / (window[1] - window[0]),
            max_active=active[1],
            arrivals_in_window=in_window[0],
            submitted=len(tasks),
            finished=len(tasks) - len(unfinished),
            finished_by_window_end=finished_in_window,
            stalled=len(unfinished),
            tpot_s=tuple(tpot),
            ttft_s=tuple(ttft),
            gaps_s=tuple(gaps),
            escalation_rate=(end_snap["escalations"] - snap["escalations"]) / small_rows
            if small_rows
            else float("nan"),
            deferred_timeouts=end_snap["timeouts"] - snap["timeouts"],
            deferred_timeouts_total=self._deferred_timeouts(),
            oversleep_ms=oversleep,
            time_scale=scale,
        )

    def _deferred_timeouts(self) -> int:
        return sum(e.scheduler.deferred_timeouts for e in self.engines)

    def _window_snapshot(self) -> dict[str, Any]:
        snap = self.backend.snapshot()
        stats = [_merged_stats([r.stats for r in group]) for group in self.model_runners]
        return {
            "oversleep": [(st.oversleep_s, st.steps) for st in stats],
            "t": time.perf_counter(),
            "committed": snap["committed"],
            "small_rows": snap["batch_rows"].get(self.names[0], 0.0),
            "escalations": snap["handoffs"].get((self.names[0], self.names[1]), 0),
            "timeouts": self._deferred_timeouts(),
        }

    async def step_load(
        self, phases: Sequence[tuple[int, float]], sample_s: float = 0.02
    ) -> StepLoadTrace:
        """Closed loop whose client count follows ``phases`` (``(clients, seconds)``, seconds
        in the profile time base): committed tokens and deferred timeouts sampled every
        ``sample_s`` (profile time) from the first phase's start to the last one's end."""
        scale = self.time_scale
        times: list[float] = []
        committed: list[float] = []
        timeouts: list[int] = []
        start = time.perf_counter()

        def sample() -> None:
            times.append((time.perf_counter() - start) / scale)
            committed.append(self.backend.total_committed)
            timeouts.append(self._deferred_timeouts())

        async def sampler() -> None:
            while True:
                sample()
                await asyncio.sleep(sample_s * scale)

        boundaries = []
        task = asyncio.create_task(sampler())
        try:
            offset = 0.0
            for clients, seconds in phases:
                delay = start + offset * scale - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                boundaries.append((time.perf_counter() - start) / scale)
                await self.set_clients(clients)
                offset += seconds
            delay = start + offset * scale - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            sample()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return StepLoadTrace(
            clients=tuple(c for c, _ in phases),
            starts_s=tuple(boundaries),
            end_s=times[-1],
            times_s=tuple(times),
            committed=tuple(committed),
            deferred_timeouts=tuple(timeouts),
        )

    async def drain(self, timeout_s: float) -> int:
        """Stop submitting and wait up to ``timeout_s`` for the clients' requests in flight to
        finish; returns how many did not (stalled)."""
        self._stop.set()
        if not self._tasks:
            return 0
        _, unfinished = await asyncio.wait(self._tasks, timeout=timeout_s)
        return len(unfinished)

    @property
    def engines(self) -> list[Engine]:
        """Every replica's engine, all models."""
        return [s.engine for s in self.servers]

    async def measure(self, window_s: float, thresholds: tuple[int, ...] = ()) -> SimMeasurement:
        """Committed tokens/s (profile time base) and runner statistics over one window."""
        for group in self.model_runners:
            for runner in group:
                runner.reset_stats()
        before, fin0 = self.backend.snapshot(), self.finished
        timeouts0 = sum(e.scheduler.deferred_timeouts for e in self.engines)
        transit0 = await self._transit()
        t0 = time.perf_counter()
        await asyncio.sleep(window_s)
        elapsed = time.perf_counter() - t0
        after, fin = self.backend.snapshot(), self.finished - fin0
        transit1 = await self._transit()
        stats = [_merged_stats([r.stats for r in group]) for group in self.model_runners]

        def delta(key: str, name: Any) -> float:
            return after[key].get(name, 0) - before[key].get(name, 0)

        tokens = after["committed"] - before["committed"]
        small_rows = delta("batch_rows", self.names[0])
        escalations = delta("handoffs", (self.names[0], self.names[1]))
        handoffs = sum(after["handoffs"].values()) - sum(before["handoffs"].values())
        return SimMeasurement(
            n_requests=self.n_requests,
            thresholds=thresholds,
            throughput=tokens / elapsed * self.time_scale,
            tokens=tokens,
            window_s=elapsed,
            time_scale=self.time_scale,
            steps=tuple(int(delta("steps", n)) for n in self.names),
            mean_batch=tuple(s.mean_batch for s in stats),
            busy_fraction=tuple(s.busy_s / elapsed for s in stats),
            median_gap_ms=tuple(
                1000.0 * statistics.median(s.gaps_s) if s.gaps_s else float("nan") for s in stats
            ),
            oversleep_ms=tuple(1000.0 * s.oversleep_s / s.steps if s.steps else 0.0 for s in stats),
            handoffs=int(handoffs),
            finished_requests=fin,
            escalation_rate=escalations / small_rows if small_rows else float("nan"),
            deferred_timeouts=sum(e.scheduler.deferred_timeouts for e in self.engines) - timeouts0,
            transit_ms=_transit_delta(transit0, transit1, self.time_scale),
        )

    async def _transit(self) -> dict[tuple[str, str], tuple[int, float]]:
        """Every replica's transit tallies now (through its call queue), merged: (handoffs,
        seconds) per pair. A window outlives any measurement here (60 s): two reads
        subtract."""
        windows = [await server.window() for server in self.servers]
        return {
            pair: (t.count, t.total) for pair, t in WindowSnapshot.merge(windows).transit.items()
        }


def _transit_delta(
    before: dict[tuple[str, str], tuple[int, float]],
    after: dict[tuple[str, str], tuple[int, float]],
    time_scale: float,
) -> dict[tuple[str, str], float]:
    """Mean transit (ms, profile time base) per pair between two tally reads."""
    out = {}
    for pair, (count, total) in after.items():
        count0, total0 = before.get(pair, (0, 0.0))
        if count > count0:
            out[pair] = 1e3 * (total - total0) / (count - count0) / time_scale
    return out


async def measure_closed_loop_async(
    profile: RoutingProfile,
    n_requests: int,
    thresholds: Sequence[int],
    window_s: float = 5.0,
    warmup_s: float = 1.0,
    time_scale: float = 1.0,
    seed: int = 0,
    max_defer_s: float = 1.0,
    max_tokens: int | None = None,
    sleep_bias_s: float | None = None,
    prompt_len: int = 4,
    replicas: Sequence[int] | None = None,
    transit_s: float = 0.0,
) -> SimMeasurement:
    """Run N requests in a closed loop on the simulated runtime; measure committed tok/s.
    ``replicas``: data-parallel replicas per model (each applies B on its own);
    ``transit_s``: every frame arrives this long after it was sent (wall clock)."""
    q = escalation_probability(profile)
    thresholds = tuple(int(b) for b in thresholds)
    check_admissible(n_requests, thresholds, replicas)
    if sleep_bias_s is None:
        sleep_bias_s = calibrate_sleep_bias()
    if max_tokens is None:
        # Enough that a request rarely finishes inside the run: >= 4x the tokens one request
        # commits at the single-request rate (an upper bound on its share of throughput).
        single = 1.0 / (
            profile.models[0].step_time_ms(1) + q * profile.models[1].step_time_ms(1)
        )  # tokens per ms for one request alone
        duration_ms = (window_s + warmup_s) * 1000.0 / time_scale
        max_tokens = max(64, int(4 * single * duration_ms) + 16)
    loop = ClosedLoop(
        profile,
        n_requests,
        thresholds,
        time_scale=time_scale,
        seed=seed,
        max_defer_s=max_defer_s,
        max_tokens=max_tokens,
        sleep_bias_s=sleep_bias_s,
        prompt_len=prompt_len,
        replicas=replicas,
        transit_s=transit_s,
    )
    async with loop:
        await asyncio.sleep(warmup_s)
        return await loop.measure(window_s, thresholds)


def measure_closed_loop(
    profile: RoutingProfile, n_requests: int, thresholds: Sequence[int], **kwargs: Any
) -> SimMeasurement:
    """Synchronous ``measure_closed_loop_async`` (its own event loop)."""
    return asyncio.run(measure_closed_loop_async(profile, n_requests, thresholds, **kwargs))
