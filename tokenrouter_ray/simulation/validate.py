"""Check the Markov model against the real runtime on simulated engines.

For each concurrency ``N`` and each admissible threshold vector of a sweep (the paper's
setting: ``B_small = 1``, ``B_large = 1..N``), run ``LocalRuntime`` over ``SimRunner``
engines (``sim_backend``) in a closed loop of ``N`` requests, and put the measured committed
tokens per second next to the exact prediction (``markov.throughput``). Per ``N`` it reports
the predicted and the measured best ``B``, whether choosing the predicted best costs at most
``best_tolerance`` (2 %) of the measured best throughput, and the worst relative error
``|pred - meas| / meas`` over the sweep.

Two things separate a measurement from the prediction besides the model itself, and each
gets its own column so they can be told apart:

* **Routing noise.** The ``bernoulli`` policy draws each position's escalation from (request
  seed, position); over a window of a few hundred draws the realized escalation rate ``p^``
  is off 0.35 by several percent, which moves throughput almost proportionally. Every run
  uses the same request seeds (common random numbers, so B values are compared on the same
  routing decisions) and reports ``p^``; ``pred@p^`` is the exact prediction at that rate.
* **Runtime overhead.** Per step the runtime does work the chain does not model: the
  worker-thread hand-off (``asyncio.to_thread`` and back), the routing policy, commit and
  message encoding. Each run measures it (the median gap between the end of one small-model
  step and the start of the next: most of its steps follow one another directly) and
  ``pred@p^+ovh`` lengthens every step time of both models by that run's value.

Step times can be stretched by ``time_scale`` to shrink the overhead's relative share;
measured throughputs are multiplied back by it, so every number is in the profile's time
base.
"""

from __future__ import annotations

import asyncio
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenrouter_ray.simulation.backend import calibrate_sleep_bias, escalation_probability
from tokenrouter_ray.simulation.loads import (
    ClosedLoop,
    OpenLoopMeasurement,
    SimMeasurement,
    StepLoadTrace,
    measure_closed_loop,
)
from tokenrouter_ray.thresholds import ThresholdTable
from tokenrouter_ray.tuning.markov import throughput
from tokenrouter_ray.tuning.open_loop import (
    OpenLoopPrediction,
    SojournSample,
    markov_token_rates,
    predict_open_loop,
    simulate_processor_sharing,
)
from tokenrouter_ray.tuning.profile import ModelProfile, RoutingProfile
from tokenrouter_ray.tuning.search import candidates, threshold_lists, tune

DEFAULT_WINDOWS_S = {1: 6.0, 2: 4.0, 4: 4.0, 8: 5.0, 16: 6.0}
QUICK_WINDOWS_S = {1: 1.5, 2: 1.5, 4: 1.5, 8: 2.0, 16: 2.0}


@dataclass(frozen=True)
class ValidationPoint:
    thresholds: tuple[int, ...]
    predicted: float  # exact chain at the profile, tokens/s
    measured: float  # simulated runtime, tokens/s (profile time base)
    predicted_realized: float  # exact chain at the realized escalation rate
    predicted_overhead: float | None  # ... and step times + the loop overhead
    measurement: SimMeasurement

    @property
    def overhead_ms(self) -> float:
        """This run's loop overhead per step, wall clock ms (nan if unmeasured)."""
        return self.measurement.median_gap_ms[0]

    def _err(self, value: float | None) -> float | None:
        return None if value is None else abs(value - self.measured) / self.measured

    @property
    def rel_error(self) -> float:
        """``|pred - meas| / meas``."""
        return abs(self.predicted - self.measured) / self.measured

    @property
    def rel_error_realized(self) -> float:
        return abs(self.predicted_realized - self.measured) / self.measured

    @property
    def rel_error_overhead(self) -> float | None:
        return self._err(self.predicted_overhead)


@dataclass
class ValidationRow:
    """One concurrency N: the sweep over the free model's threshold."""

    n_requests: int
    free: int  # index of the swept model
    points: list[ValidationPoint] = field(default_factory=list)
    best_tolerance: float = 0.02

    @property
    def predicted_best(self) -> ValidationPoint:
        return max(self.points, key=lambda p: p.predicted)

    @property
    def measured_best(self) -> ValidationPoint:
        return max(self.points, key=lambda p: p.measured)

    @property
    def same_best(self) -> bool:
        return self.predicted_best is self.measured_best

    @property
    def best_gap(self) -> float:
        """How much measured throughput choosing the predicted best B gives up (>= 0)."""
        return 1.0 - self.predicted_best.measured / self.measured_best.measured

    @property
    def best_ok(self) -> bool:
        return self.same_best or self.best_gap <= self.best_tolerance

    @property
    def max_rel_error(self) -> float:
        return max(p.rel_error for p in self.points)

    @property
    def max_rel_error_realized(self) -> float:
        return max(p.rel_error_realized for p in self.points)

    @property
    def max_rel_error_overhead(self) -> float | None:
        errs = [p.rel_error_overhead for p in self.points]
        return None if any(e is None for e in errs) else max(errs)


def with_overhead(profile: RoutingProfile, overhead_ms: float) -> RoutingProfile:
    """The profile with ``overhead_ms`` added to every step time of every model."""
    models = tuple(
        ModelProfile(m.name, tuple((b, t + overhead_ms) for b, t in m.step_ms), m.max_batch)
        for m in profile.models
    )
    return RoutingProfile(models, profile.route_prob, profile.commit, profile.grain_ms)


def measure_point(
    profile: RoutingProfile,
    n: int,
    thresholds: tuple[int, ...],
    time_scale: float,
    **kwargs: Any,
) -> ValidationPoint:
    """One closed-loop measurement at (N, B) with the three predictions next to it (at p, at
    the realized ``p^``, and at ``p^`` with the run's loop overhead added to every step).
    ``kwargs`` go to ``measure_closed_loop`` (``window_s``, ``warmup_s``, ``seed``, ...)."""
    meas = measure_closed_loop(profile, n, thresholds, time_scale=time_scale, **kwargs)
    realized = meas.realized_profile(profile)
    with_ovh = None
    overhead_ms = meas.median_gap_ms[0]
    if math.isfinite(overhead_ms):
        ovh_profile = with_overhead(realized, overhead_ms / time_scale)
        with_ovh = throughput(ovh_profile, n, thresholds).throughput
    return ValidationPoint(
        thresholds,
        throughput(profile, n, thresholds).throughput,
        meas.throughput,
        throughput(realized, n, thresholds).throughput,
        with_ovh,
        meas,
    )


def validate(
    profile: RoutingProfile,
    concurrencies: Sequence[int],
    fixed: dict[int, int] | None = None,
    free: int = 1,
    time_scale: float = 2.0,
    windows_s: dict[int, float] | None = None,
    warmup_s: float = 0.8,
    seed: int = 0,
    best_tolerance: float = 0.02,
    progress: Callable[[int, tuple[int, ...], ValidationPoint], None] | None = None,
    max_defer_s: float = 1.0,
) -> tuple[list[ValidationRow], float]:
    """Sweep every N; returns the rows and the median loop overhead (ms, wall clock)."""
    fixed = {0: 1} if fixed is None else fixed
    windows_s = windows_s or DEFAULT_WINDOWS_S
    rows = []
    for n in concurrencies:
        window = windows_s.get(n) or max(windows_s.values())
        row = ValidationRow(n, free, best_tolerance=best_tolerance)
        pinned = {name: fixed.get(i, 1) for i, name in enumerate(profile.names) if i != free}
        for thresholds in candidates(profile, n, pinned):  # model `free` over 1..N
            point = measure_point(
                profile, n, thresholds, window_s=window, warmup_s=warmup_s,
                time_scale=time_scale, seed=seed, max_defer_s=max_defer_s,
            )  # fmt: skip
            row.points.append(point)
            if progress is not None:
                progress(n, thresholds, point)
        rows.append(row)
    gaps = [p.overhead_ms for row in rows for p in row.points if math.isfinite(p.overhead_ms)]
    return rows, (statistics.median(gaps) if gaps else float("nan"))


def _free_name(rows: Sequence[ValidationRow], names: Sequence[str]) -> str:
    """The model whose threshold the rows vary."""
    return names[rows[0].free] if rows else "?"


def _header(*cells: str) -> list[str]:
    """A markdown table's header row and its separator row."""
    return ["| " + " | ".join(cells) + " |", "|" + "---|" * len(cells)]


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f} %"


def format_validation(
    rows: Sequence[ValidationRow], names: Sequence[str], overhead_ms: float, time_scale: float
) -> str:
    """The per-point table and the per-N summary (markdown)."""
    free = _free_name(rows, names)
    lines = _header("N", f"B_{free}", "predicted", "measured", "err", "p^", "pred@p^", "err",
                    "ovh ms", "pred@p^+ovh", "err", "best")  # fmt: skip
    for row in rows:
        for p in row.points:
            mark = []
            if p is row.predicted_best:
                mark.append("pred")
            if p is row.measured_best:
                mark.append("meas")
            ovh = "-" if p.predicted_overhead is None else f"{p.predicted_overhead:.1f}"
            lines.append(
                f"| {row.n_requests} | {p.thresholds[row.free]} | {p.predicted:.1f} "
                f"| {p.measured:.1f} | {_pct(p.rel_error)} "
                f"| {p.measurement.escalation_rate:.3f} | {p.predicted_realized:.1f} "
                f"| {_pct(p.rel_error_realized)} | {p.overhead_ms:.2f} | {ovh} "
                f"| {_pct(p.rel_error_overhead)} "
                f"| {' '.join(mark)} |"
            )
    lines.append("")
    lines.append(summary_table(rows, names, overhead_ms, time_scale))
    return "\n".join(lines)


def summary_table(
    rows: Sequence[ValidationRow], names: Sequence[str], overhead_ms: float, time_scale: float
) -> str:
    free = _free_name(rows, names)
    lines = _header("N", f"predicted best B_{free}", f"measured best B_{free}",
                    "predicted best within 2 %", "max err pred", "max err pred@p^",
                    "max err pred@p^+ovh")  # fmt: skip
    for row in rows:
        if row.same_best:
            match = "yes (same B)"
        elif row.best_ok:
            match = f"yes ({100 * row.best_gap:.1f} % below)"
        else:
            match = f"NO ({100 * row.best_gap:.1f} % below)"
        lines.append(
            f"| {row.n_requests} | {row.predicted_best.thresholds[row.free]} "
            f"| {row.measured_best.thresholds[row.free]} | {match} "
            f"| {_pct(row.max_rel_error)} | {_pct(row.max_rel_error_realized)} "
            f"| {_pct(row.max_rel_error_overhead)} |"
        )
    lines.append("")
    lines.append(
        f"time scale x{time_scale:g} (simulated step times {time_scale:g}x the profile, "
        f"measured tok/s multiplied back by {time_scale:g}); runtime loop overhead "
        f"(median over runs) {overhead_ms:.2f} ms per step (wall clock) = "
        f"{overhead_ms / time_scale:.2f} ms in the profile's time base"
    )
    return "\n".join(lines)


# ----------------------------------------------------- targets: tuned table, open loop, steps
CLOSED_TARGET = 0.05  # measured within 5 % of the prediction, closed loop, tuned B
STEP_TOLERANCE = 0.10  # after a step in N: within 10 % of the new N's steady state ...
STEP_LIMIT_S = 2.0  # ... within 2 s


def tuned_tables(
    profile: RoutingProfile,
    concurrencies: Sequence[int] = (1, 2, 4, 8, 16),
    fixed: dict[str, int] | None = None,
    top: int = 64,
) -> tuple[list[int], ...]:
    """Per-model ``batch_thresholds`` lists (index N = 0..top) as the tuner would set them:
    the best B at each tuned N, filled between (``search.threshold_lists``)."""
    lists = threshold_lists(tune(profile, concurrencies, fixed or {"small": 1}), max_n=top)
    return tuple(lists[name] for name in profile.names)


def validate_tuned(
    profile: RoutingProfile,
    concurrencies: Sequence[int],
    tables: Sequence[Sequence[int]],
    time_scale: float = 2.0,
    windows_s: dict[int, float] | None = None,
    warmup_s: float = 0.8,
    seed: int = 0,
    max_defer_s: float = math.inf,
    progress: Callable[[ValidationPoint], None] | None = None,
) -> list[ValidationPoint]:
    """Closed loop at each N with the thresholds the tables give at N (no sweep): the
    measurement and the predictions, for the 5 % target."""
    windows_s = windows_s or DEFAULT_WINDOWS_S
    points = []
    for n in concurrencies:
        thresholds = tuple(ThresholdTable.of(t).at(n) for t in tables)
        window = windows_s.get(n) or max(windows_s.values())
        point = measure_point(
            profile, n, thresholds, window_s=window, warmup_s=warmup_s,
            time_scale=time_scale, seed=seed, max_defer_s=max_defer_s,
        )  # fmt: skip
        points.append(point)
        if progress is not None:
            progress(point)
    return points


def format_tuned(points: Sequence[ValidationPoint], target: float = CLOSED_TARGET) -> str:
    lines = [
        "| N | B | predicted | measured | err | target | p^ | pred@p^+ovh | err "
        "| gap / oversleep ms | deferred timeouts |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in points:
        ovh = "-" if p.predicted_overhead is None else f"{p.predicted_overhead:.1f}"
        verdict = "PASS" if p.rel_error <= target else "MISS"
        lines.append(
            f"| {p.measurement.n_requests} | {','.join(map(str, p.thresholds))} "
            f"| {p.predicted:.1f} | {p.measured:.1f} | {_pct(p.rel_error)} "
            f"| {verdict} (<= {100 * target:g} %) | {p.measurement.escalation_rate:.3f} "
            f"| {ovh} | {_pct(p.rel_error_overhead)} "
            f"| {p.overhead_ms:.2f} / {max(p.measurement.oversleep_ms):.2f} "
            f"| {p.measurement.deferred_timeouts} |"
        )
    return "\n".join(lines)


@dataclass(frozen=True)
class OpenLoopPoint:
    """One arrival rate: the measurement and the open-loop predictions."""

    load: float  # arrival rate as a fraction of the reference throughput (offered tok/s)
    measurement: OpenLoopMeasurement
    prediction: OpenLoopPrediction  # birth-death on the Markov T(n)
    processor_sharing: SojournSample  # the fluid queue with routing noise
    prediction_overhead: OpenLoopPrediction | None = None  # T(n) with the loop overhead
    processor_sharing_overhead: SojournSample | None = None

    @property
    def throughput_error(self) -> float:
        """Measured committed tokens/s against the offered ``lambda L``."""
        m = self.measurement
        return abs(m.throughput - m.offered) / m.offered

    def p99(self) -> dict[str, float]:
        """p99 TPOT (s): measured, state-only, processor sharing (+ the overhead variants)."""
        out = {
            "measured": self.measurement.tpot_quantile(0.99),
            "states": self.prediction.tpot_quantile(0.99),
            "ps": self.processor_sharing.tpot_quantile(0.99),
        }
        if self.processor_sharing_overhead is not None:
            out["ps+ovh"] = self.processor_sharing_overhead.tpot_quantile(0.99)
        return out


def open_loop_predictions(
    profile: RoutingProfile,
    tables: Sequence[Sequence[int]],
    rate_per_s: float,
    tokens: int,
    max_n: int = 48,
    tail: str = "linear",
    overhead_ms: float = 0.0,
    requests: int = 20_000,
    seed: int = 0,
    token_rates: Sequence[float] | None = None,
) -> tuple[OpenLoopPrediction, SojournSample]:
    """The birth-death prediction and the processor-sharing sample for one arrival rate.
    ``overhead_ms`` lengthens every step (``with_overhead``); routing noise uses the entry
    model's escalation probability and its batch-1 step as the time of a kept token."""
    base = with_overhead(profile, overhead_ms) if overhead_ms else profile
    rates = token_rates if token_rates is not None else markov_token_rates(base, tables, max_n)
    prediction = predict_open_loop(rate_per_s, tokens, rates, tail=tail)
    q = escalation_probability(profile)
    small_s = base.models[0].step_time_ms(1) / 1000.0
    sample = simulate_processor_sharing(rate_per_s, tokens, rates, tail=tail,
                                        requests=requests, warmup=min(1000, requests // 10),
                                        seed=seed, escalation=(q, small_s))  # fmt: skip
    return prediction, sample


def validate_open_loop(
    profile: RoutingProfile,
    tables: Sequence[Sequence[int]],
    loads: Sequence[float],
    reference: float,
    tokens: int = 32,
    requests_per_point: int = 400,
    min_window_s: float = 10.0,
    warmup_s: float = 1.0,
    time_scale: float = 2.0,
    max_defer_s: float = math.inf,
    drain_timeout_s: float = 10.0,
    overhead_ms: float | None = None,
    max_n: int = 48,
    seed: int = 0,
    progress: Callable[[OpenLoopPoint], None] | None = None,
) -> list[OpenLoopPoint]:
    """Poisson arrivals at ``load x reference`` offered tokens/s for each load; each window
    is long enough for about ``requests_per_point`` arrivals (at least ``min_window_s``).
    ``overhead_ms`` (profile time base), when given, adds the predictions with that much
    loop overhead per step."""
    base_rates = markov_token_rates(profile, tables, max_n)
    ovh_rates = None
    if overhead_ms:
        ovh_rates = markov_token_rates(with_overhead(profile, overhead_ms), tables, max_n)
    bias = calibrate_sleep_bias()
    points = []
    for k, load in enumerate(loads):
        rate = load * reference / tokens
        window = max(min_window_s, requests_per_point / rate)

        async def run(
            rate: float = rate, window: float = window, k: int = k
        ) -> OpenLoopMeasurement:
            loop = ClosedLoop(profile, 256, tables, time_scale=time_scale, seed=seed,
                              max_defer_s=max_defer_s, max_tokens=tokens, sleep_bias_s=bias,
                              clients=0)  # fmt: skip
            async with loop:
                return await loop.poisson_load(rate, tokens, window, warmup_s=warmup_s,
                                               drain_timeout_s=drain_timeout_s,
                                               seed=seed + k)  # fmt: skip

        measurement = asyncio.run(run())
        prediction, sample = open_loop_predictions(
            profile, tables, rate, tokens, max_n, token_rates=base_rates, seed=seed
        )
        pred_ovh = sample_ovh = None
        if ovh_rates is not None:
            pred_ovh, sample_ovh = open_loop_predictions(
                profile, tables, rate, tokens, max_n, overhead_ms=overhead_ms,
                token_rates=ovh_rates, seed=seed,
            )  # fmt: skip
        point = OpenLoopPoint(load, measurement, prediction, sample, pred_ovh, sample_ovh)
        points.append(point)
        if progress is not None:
            progress(point)
    return points


def format_open_loop(points: Sequence[OpenLoopPoint], target: float = CLOSED_TARGET) -> str:
    """Predicted vs measured per arrival rate (markdown); TPOT in ms."""
    ovh = any(p.prediction_overhead is not None for p in points)
    head = ("| load | λ req/s | busy 1-π(0) | offered tok/s | measured tok/s | err "
            "| mean N pred / meas "
            "| mean TPOT pred / meas ms | p99 TPOT states / PS / meas ms |")  # fmt: skip
    sep = "|---|---|---|---|---|---|---|---|---|"
    if ovh:
        head += " +ovh: mean N / p99 PS |"
        sep += "---|"
    head += " finished / stalled | deferred timeouts (window / run) | oversleep ms |"
    sep += "---|---|---|"
    lines = [head, sep]
    for p in points:
        m, pr, p99 = p.measurement, p.prediction, p.p99()
        verdict = "PASS" if p.throughput_error <= target else "MISS"
        row = (
            f"| {100 * p.load:.0f} % | {m.arrival_rate:.2f} | {pr.busy_fraction:.3f} "
            f"| {m.offered:.1f} | "
            f"{m.throughput:.1f} | {_pct(p.throughput_error)} {verdict} "
            f"| {pr.mean_active:.2f} / {m.mean_active:.2f} "
            f"| {1000 * pr.mean_tpot_s:.2f} / {1000 * m.mean_tpot_s:.2f} "
            f"| {1000 * p99['states']:.1f} / {1000 * p99['ps']:.1f} / "
            f"{1000 * p99['measured']:.1f} |"
        )
        if ovh:
            po = p.prediction_overhead
            row += (f" {po.mean_active:.2f} / {1000 * p99['ps+ovh']:.1f} |" if po is not None
                    else " - |")  # fmt: skip
        row += (
            f" {m.finished} / {m.stalled} | {m.deferred_timeouts} / {m.deferred_timeouts_total} "
            f"| {max(m.oversleep_ms, default=0.0):.2f} |"
        )
        lines.append(row)
    return "\n".join(lines)


@dataclass(frozen=True)
class StepSettle:
    """One step of the client count: how soon throughput reached the new N's steady state."""

    before: int
    after: int
    at_s: float
    reference: float  # steady-state tok/s at the new N: the phase's last reference_s
    predicted: float  # the Markov prediction at the new N
    settle_s: float | None  # first trailing window within tolerance (s after the step)
    stays_s: float | None  # from when on every trailing window stays within tolerance
    rates: tuple[tuple[float, float], ...]  # (s after the step, trailing-window tok/s)
    timeouts: int  # deferred timeouts in the phase
    reference_s: float  # the reference is the rate over the phase's last reference_s
    closed_loop: float | None = None  # a separate closed-loop measurement at the new N
    tolerance: float = STEP_TOLERANCE
    limit_s: float = STEP_LIMIT_S

    @property
    def passed(self) -> bool:
        """Within tolerance of the new steady state within the limit (the issue's target)."""
        return self.settle_s is not None and self.settle_s <= self.limit_s

    def mean_error(self, trace: StepLoadTrace) -> float:
        """The rate over the first ``limit_s`` after the step against the reference."""
        return trace.rate(self.at_s, self.at_s + self.limit_s) / self.reference - 1.0


def settle_time(
    trace: StepLoadTrace,
    phase: int,
    reference: float,
    tolerance: float = STEP_TOLERANCE,
    window_s: float = 0.5,
    every_s: float = 0.05,
    until_s: float | None = None,
) -> tuple[float | None, float | None, tuple[tuple[float, float], ...]]:
    """Trailing-window throughput after the start of ``phase`` (window ``window_s``,
    evaluated every ``every_s``, never reaching back past the step, up to the phase's end
    or ``until_s`` after its start) against ``reference``. Returns ``(first, stays,
    rates)``: the first evaluation point within ``tolerance`` of it, the one from which
    every later point stays within (``None``: never / the last one is outside), both in
    seconds after the step (the smallest possible value is ``window_s``), and the points."""
    start, end = trace.starts_s[phase], trace.phase_end(phase)
    if until_s is not None:
        end = min(end, start + until_s)
    rates = []
    k = 0
    while (t := start + window_s + k * every_s) <= end + 1e-9:
        rates.append((window_s + k * every_s, trace.rate(t - window_s, t)))
        k += 1

    def inside(rate: float) -> bool:
        return abs(rate - reference) <= tolerance * reference

    first = next((offset for offset, rate in rates if inside(rate)), None)
    stays = None
    for offset, rate in reversed(rates):
        if not inside(rate):
            break
        stays = offset
    return first, stays, tuple(rates)


def validate_step_load(
    profile: RoutingProfile,
    tables: Sequence[Sequence[int]],
    phases: Sequence[tuple[int, float]] = ((16, 8.0), (4, 8.0), (16, 8.0)),
    reference_s: float | None = None,
    closed_loop: dict[int, float] | None = None,
    time_scale: float = 2.0,
    max_defer_s: float = math.inf,
    window_s: float = 0.5,
    seed: int = 0,
) -> tuple[StepLoadTrace, list[StepSettle]]:
    """Closed loop whose client count steps through ``phases`` (seconds in the profile's
    time base). For every step, the new N's steady state is the throughput over the last
    ``reference_s`` of its phase (default: half the phase), measured in the same run so
    that it shares the machine's conditions; the settle time is taken over the part of the
    phase before it (``settle_time``). ``closed_loop`` (N -> tok/s, e.g. a separate
    closed-loop measurement) is reported beside it."""
    top = max(c for c, _ in phases)

    async def run() -> StepLoadTrace:
        loop = ClosedLoop(profile, top, tables, time_scale=time_scale, seed=seed,
                          max_defer_s=max_defer_s, sleep_bias_s=calibrate_sleep_bias(),
                          clients=0)  # fmt: skip
        async with loop:
            return await loop.step_load(phases)

    trace = asyncio.run(run())
    settles = []
    for phase in range(1, len(phases)):
        n = phases[phase][0]
        start, end = trace.starts_s[phase], trace.phase_end(phase)
        tail = reference_s if reference_s is not None else (end - start) / 2
        reference = trace.rate(end - tail, end)
        predicted = throughput(profile, n, tuple(ThresholdTable.of(t).at(n) for t in tables))
        first, stays, rates = settle_time(trace, phase, reference, window_s=window_s,
                                          until_s=end - tail - start)  # fmt: skip
        settles.append(StepSettle(
            phases[phase - 1][0], n, start, reference, predicted.throughput, first, stays,
            rates, trace.timeouts_between(start, end), tail, (closed_loop or {}).get(n),
        ))  # fmt: skip
    return trace, settles


def format_step_load(settles: Sequence[StepSettle], trace: StepLoadTrace) -> str:
    lines = [
        "| step | at s | steady state tok/s (phase's 2nd half) | closed-loop run | predicted "
        "| first 0.5 s tok/s | within 10 % after | target | stays within from "
        "| first 2 s vs steady | deferred timeouts |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in settles:
        first = s.rates[0][1] if s.rates else float("nan")
        after = "never" if s.settle_s is None else f"{s.settle_s:.2f} s"
        stays = "never" if s.stays_s is None else f"{s.stays_s:.2f} s"
        verdict = "PASS" if s.passed else "MISS"
        closed = "-" if s.closed_loop is None else f"{s.closed_loop:.1f}"
        lines.append(
            f"| {s.before} → {s.after} | {s.at_s:.2f} | {s.reference:.1f} | {closed} "
            f"| {s.predicted:.1f} | {first:.1f} | {after} | {verdict} (<= {s.limit_s:g} s) "
            f"| {stays} | {100 * s.mean_error(trace):+.1f} % | {s.timeouts} |"
        )
    return "\n".join(lines)
