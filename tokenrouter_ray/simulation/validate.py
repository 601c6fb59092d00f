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

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tokenrouter_ray.simulation.backend import SimMeasurement, measure_closed_loop
from tokenrouter_ray.tuning.markov import throughput
from tokenrouter_ray.tuning.profile import ModelProfile, RoutingProfile
from tokenrouter_ray.tuning.search import candidates

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
            meas = measure_closed_loop(
                profile,
                n,
                thresholds,
                window_s=window,
                warmup_s=warmup_s,
                time_scale=time_scale,
                seed=seed,
            )
            realized = meas.realized_profile(profile)
            with_ovh = None
            overhead_ms = meas.median_gap_ms[0]
            if math.isfinite(overhead_ms):
                ovh_profile = with_overhead(realized, overhead_ms / time_scale)
                with_ovh = throughput(ovh_profile, n, thresholds).throughput
            point = ValidationPoint(
                thresholds,
                throughput(profile, n, thresholds).throughput,
                meas.throughput,
                throughput(realized, n, thresholds).throughput,
                with_ovh,
                meas,
            )
            row.points.append(point)
            if progress is not None:
                progress(n, thresholds, point)
        rows.append(row)
    gaps = [p.overhead_ms for row in rows for p in row.points if math.isfinite(p.overhead_ms)]
    return rows, (statistics.median(gaps) if gaps else float("nan"))


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f} %"


def format_validation(
    rows: Sequence[ValidationRow], names: Sequence[str], overhead_ms: float, time_scale: float
) -> str:
    """The per-point table and the per-N summary (markdown)."""
    free = names[rows[0].free] if rows else "?"
    lines = [
        f"| N | B_{free} | predicted | measured | err | p^ | pred@p^ | err | ovh ms "
        "| pred@p^+ovh | err | best |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
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
    free = names[rows[0].free] if rows else "?"
    lines = [
        f"| N | predicted best B_{free} | measured best B_{free} | predicted best within 2 % "
        "| max err pred | max err pred@p^ | max err pred@p^+ovh |",
        "|---|---|---|---|---|---|---|",
    ]
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
