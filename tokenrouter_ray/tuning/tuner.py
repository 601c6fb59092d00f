"""The live threshold tuner: replicas' statistics in, threshold tables out.

``TunerCore`` is the tuner without Ray: the core of the tuner deployment
(``deployments/tuner.py``) and of ``drive_local`` (the same loop over a ``LocalRuntime``'s
model replicas); both run ``run_tuner``, the one tuner loop. Every model replica reports its
``WindowSnapshot`` (``replica/window.py``) each ``period_s`` and gets back the
``ThresholdTable`` it should run with (replicas pull; the tuner never needs to reach a
replica).
Each period the core merges the fresh reports into a ``RoutingProfile`` (``build_profile``)
and hands it to ``ThresholdSolver`` (``solver.py``), which re-solves when the statistics
drift (or every ``resolve_every_s``) and moves thresholds with hysteresis, a bounded step,
and only deadlock-free sets. The reporting replicas of each model are counted: thresholds
are per replica and the deadlock-free sets depend on the counts (``sum_i R_i (B_i - 1) <
N``), so a count that changes forces a re-solve.

Routing probabilities, commits and the transit between models (each handoff's time from its
building at the sender to its application at the receiver, recorded by the receiver) come
from the current window only (they follow the traffic and the load); step times are
remembered per batch size across windows (they follow the hardware), so a threshold that
stopped producing small batches does not erase what a small batch costs. Batch sizes never
observed are filled from a straight line fitted to the observed ones (a decode step is a
fixed cost plus a per-sequence cost), not held flat: a flat extrapolation below the smallest
observed batch would make small thresholds look as slow as large ones and the tuner could
never lower a threshold it had raised. A profile file (``tokenrouter-ray profile``) seeds
the table before traffic arrives. Each period's outcome is a ``TunerDecision``; everything
it decided, and why, is ``snapshot()``, a ``TunerStatus`` (both typed, ``decision.py``),
whose ``to_json`` is ``status()``.

Names: the *tuner* is this whole loop (config section ``tuner``, the ``Tuner`` deployment,
``GET /v1/tokenrouter/tuner``); ``ThresholdSolver`` is its decision step; ``tokenrouter-ray
tune`` solves the same model offline (``search.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np
from msgspec.structs import replace

from tokenrouter_ray.config import TunerSpec  # the app config's tuner section
from tokenrouter_ray.replica.window import WindowSnapshot
from tokenrouter_ray.thresholds import ThresholdTable
from tokenrouter_ray.tuning.decision import Pair, ScalingPlan, TunerDecision, TunerStatus
from tokenrouter_ray.tuning.profile import (
    ModelProfile,
    RoutingProfile,
    models_from_mapping,
    read_profile_file,
)
from tokenrouter_ray.tuning.scaling import ReplicaPlanner
from tokenrouter_ray.tuning.solver import ThresholdSolver

logger = logging.getLogger(__name__)


class _Reporter(Protocol):  # what drive_local needs from a replica (replica/step.py)
    name: str

    async def window(self) -> WindowSnapshot: ...

    def set_batch_thresholds(self, thresholds: ThresholdTable) -> None: ...


class TunerCore:
    """Reports in, thresholds out: the tuner without Ray (see module docstring)."""

    def __init__(
        self,
        models: Sequence[str],
        spec: TunerSpec,
        initial: Mapping[str, ThresholdTable | Sequence[int]] | None = None,
        clock: Callable[[], float] = time.monotonic,
        replicas: Mapping[str, int] | None = None,
        planner: ReplicaPlanner | None = None,
    ) -> None:
        self.models = list(models)
        self.planner = planner  # models with autoscaling: the replica plan
        self.spec = spec
        self.clock = clock
        self.solver = ThresholdSolver(
            self.models,
            concurrencies=spec.concurrencies,
            grain_ms=spec.grain_ms,
            fixed=spec.fixed,
            min_gain=spec.min_gain,
            max_step=spec.max_step,
            drift=spec.drift,
            min_tokens_per_s=spec.min_tokens_per_s,
            initial=initial,
            replicas=replicas,
        )
        self.reports: dict[str, dict[str, tuple[float, WindowSnapshot]]] = {
            m: {} for m in self.models
        }
        self.step_ms: dict[str, dict[int, float]] = {m: {} for m in self.models}
        if spec.profile:
            for model in models_from_mapping(read_profile_file(spec.profile)):
                if model.name in self.step_ms:
                    self.step_ms[model.name].update(dict(model.step_ms))
        self.history: deque[TunerDecision] = deque(maxlen=50)  # decisions that changed B
        self.decisions = 0
        self.replica_changes = 0  # times the reporting replica counts changed
        self.profile: RoutingProfile | None = None
        # the last recorded decision with the routing it was decided from: what ``status``
        # shows (``solver.last`` moves in the solving thread before ``record`` runs)
        self._recorded: TunerDecision = self.solver.last
        self._last_solve = clock()
        self.windows: dict[str, WindowSnapshot] = {}  # each model's fresh reports, merged
        self.plan: ScalingPlan | None = None  # the last plan, and the clock when it came
        self._planned_at = -math.inf

    @property
    def thresholds(self) -> dict[str, ThresholdTable]:
        return self.solver.thresholds

    @property
    def last(self) -> TunerDecision:
        return self.solver.last

    def report(self, model: str, replica: str, snapshot: WindowSnapshot) -> ThresholdTable:
        """Store one replica's window; answer with the thresholds that model should use."""
        if model not in self.reports:
            raise ValueError(f"unknown model {model!r}; tuned models are {self.models}")
        self.reports[model][replica] = (self.clock(), snapshot)
        return self.solver.thresholds[model]

    def collect(self) -> RoutingProfile | None:
        """The profile of the fresh reports (older than 3 periods: a replica that went away).
        The number of fresh reporters per model is its replica count: a change (Serve
        autoscaling, a restart) is passed to the solver, which re-solves on its next decision
        with ``sum_i R_i (B_i - 1) < N``."""
        now = self.clock()
        stale = now - 3 * self.spec.period_s
        merged: dict[str, list[WindowSnapshot]] = {}  # model -> [all replicas' window]
        counts: dict[str, int] = {}
        transit: dict[Pair, float] = {}
        for model, replicas in self.reports.items():
            for replica in [r for r, (at, _) in replicas.items() if at < stale]:
                del replicas[replica]
            window = WindowSnapshot.merge(snap for _, snap in replicas.values())
            if replicas:  # the fresh reporters are the live replicas of the model
                counts[model] = len(replicas)
            self.step_ms[model].update(window.step_means_ms())
            transit.update(window.transit_ms())  # pairs into this model: recorded here
            merged[model] = [window]
            self.windows[model] = window
        if self.solver.set_replicas(counts):
            self.replica_changes += 1
        top = max(self.spec.concurrencies)
        filled = {m: fill_step_times(self.step_ms[m], top) for m in self.models}
        return build_profile(merged, self.models, self.spec.grain_ms, self.spec.min_moves, filled,
                             transit if self.spec.transit else None)  # fmt: skip

    def step(self) -> TunerDecision:
        """One tuning period: collect, maybe re-solve, maybe move the thresholds."""
        return self.decide(self.collect())

    def decide(self, profile: RoutingProfile | None) -> TunerDecision:
        """Maybe re-solve and move, and record the outcome."""
        decision = self.solve(profile)
        self.record(decision, profile)
        return decision

    def solve(self, profile: RoutingProfile | None) -> TunerDecision:
        """The solver's decision, with the replica plan when there is a planner. Touches
        neither reports nor history, so it may run in a worker thread while ``report`` and
        ``status`` keep answering on the event loop."""
        force = self.clock() - self._last_solve >= self.spec.resolve_every_s
        decision = self.solver.decide(profile, force=force)
        if self.planner is not None:
            plan = self.planner.plan(profile, dict(self.windows))
            if plan is not None:
                decision = replace(decision, plan=plan)
        return decision

    def planned(self, model: str) -> int | None:
        """The replica count the last plan gives ``model``; None without a plan or when it
        is older than three periods (the statistics stopped: let the replicas' own load
        signal decide)."""
        if self.plan is None or self.clock() - self._planned_at > 3 * self.spec.period_s:
            return None
        return self.plan.replicas.get(model)

    def record(self, decision: TunerDecision, profile: RoutingProfile | None) -> None:
        """Book-keeping of one period (on the event loop, next to ``status``)."""
        if decision.solved:
            self._last_solve = self.clock()
        self.decisions += 1
        if decision.plan is not None:
            self.plan, self._planned_at = decision.plan, self.clock()
        if profile is not None:
            self.profile = profile
        self._recorded = decision.with_routes(route_probs(self.profile), transits(self.profile))
        if decision.changed:
            self.history.append(decision.with_routes(route_probs(profile), transits(profile)))

    def _active_histogram(self) -> dict[int, int]:
        """Steps run under each active-request count N, all replicas' windows together."""
        snaps = [snap for replicas in self.reports.values() for _, snap in replicas.values()]
        merged = WindowSnapshot.merge(snaps).active
        return {n: merged[n].count for n in sorted(merged)}

    def snapshot(self) -> TunerStatus:
        """What the tuner decided and why, and the statistics it decided from (typed: what
        the Tuner deployment answers over Ray)."""
        return TunerStatus(
            thresholds=dict(self.solver.thresholds),
            last=self._recorded,
            history=list(self.history),
            decisions=self.decisions,
            replicas={m: sorted(r) for m, r in self.reports.items()},
            replica_counts=dict(self.solver.replicas),
            active_requests=self._active_histogram(),
            step_ms={m: dict(sorted(v.items())) for m, v in self.step_ms.items()},
            spec=self.spec.model_dump(),
            plan=self.plan,
        )

    def status(self) -> dict[str, Any]:
        """``snapshot()`` as JSON: the body of ``GET /v1/tokenrouter/tuner``."""
        return self.snapshot().to_json()


def build_profile(
    per_model: Mapping[str, Sequence[WindowSnapshot]],
    models: Sequence[str],
    grain_ms: float,
    min_moves: int = 50,
    step_ms: Mapping[str, Mapping[int, float]] | None = None,
    transit_ms: Mapping[Pair, float] | None = None,
) -> RoutingProfile | None:
    """A profile from each model's replica snapshots; None while any model has fewer than
    ``min_moves`` observed moves or no step times yet. ``step_ms`` (model -> batch -> ms)
    replaces the snapshots' step times when given: step times are a property of the
    hardware, so a caller may remember batch sizes the current window has not seen.
    ``transit_ms`` (model pair -> mean ms between the models) becomes the profile's
    transit; pairs not in it take none."""
    merged = {m: WindowSnapshot.merge(per_model.get(m, ())) for m in models}
    p, c, profiles = [], [], []
    for src in models:
        counts = [(t.count, t.total) for t in merged[src].moves_from(src, models)]
        total = sum(n for n, _ in counts)
        table = step_ms[src] if step_ms is not None else merged[src].step_means_ms()
        points = sorted((int(b), float(ms)) for b, ms in table.items())
        if total < min_moves or not points:
            return None
        p.append(tuple(n / total for n, _ in counts))
        c.append(tuple(tok / n if n else 0.0 for n, tok in counts))
        profiles.append(ModelProfile(src, tuple(points)))
    profile = RoutingProfile(tuple(profiles), tuple(p), tuple(c), grain_ms)
    if transit_ms:
        matrix = [[0.0 if a == b else float(transit_ms.get((a, b), 0.0)) for b in models]
                  for a in models]  # fmt: skip
        profile = profile.with_transit(matrix)
    return profile


def fill_step_times(table: Mapping[int, float], top: int) -> dict[int, float]:
    """Observed step times (batch -> ms) plus every batch 1..top that was not observed, from
    a least-squares line through the observed points (slope >= 0, time > 0)."""
    out = {int(b): float(t) for b, t in table.items()}
    if len(out) < 2:
        return out  # one point: a constant (ModelProfile holds it flat)
    xs, ys = np.array(list(out), dtype=float), np.array(list(out.values()))
    slope, intercept = np.polyfit(xs, ys, 1)
    slope = max(float(slope), 0.0)
    if slope == 0.0:
        intercept = float(ys.mean())
    floor = 0.25 * float(ys.min())
    for b in range(1, top + 1):
        if b not in out:
            out[b] = max(floor, float(intercept) + slope * b)
    return out


def route_probs(profile: RoutingProfile | None) -> dict[Pair, float] | None:
    """The nonzero routing probabilities of a profile, by model pair (None without one)."""
    if profile is None:
        return None
    return {
        (a, b): profile.route_prob[i][j]
        for i, a in enumerate(profile.names)
        for j, b in enumerate(profile.names)
        if profile.route_prob[i][j] > 0
    }


def transits(profile: RoutingProfile | None) -> dict[Pair, float] | None:
    """The nonzero transits (ms) of a profile, by model pair (None without any)."""
    if profile is None or profile.transit_ms is None:
        return None
    return {
        (a, b): profile.transit_ms[i][j]
        for i, a in enumerate(profile.names)
        for j, b in enumerate(profile.names)
        if profile.transit_ms[i][j] > 0
    }


async def run_tuner(
    core: TunerCore,
    stop: asyncio.Event,
    gather: Callable[[], Awaitable[None]] | None = None,
    publish: Callable[[TunerDecision, RoutingProfile | None], None] | None = None,
) -> None:
    """The tuner loop, shared by the Serve deployment and ``drive_local``: every
    ``period_s`` until ``stop`` is set, ``gather`` reports (when the loop pulls them itself),
    collect the fresh ones, re-solve in a worker thread (the event loop keeps answering
    ``report`` and ``status``), record, and ``publish`` the decision. A period that raises is
    logged and skipped: a bad window must not stop the tuner."""
    while not stop.is_set():
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), core.spec.period_s)
        if stop.is_set():
            return
        try:
            if gather is not None:
                await gather()
            profile = core.collect()
            decision = await asyncio.to_thread(core.solve, profile)
            core.record(decision, profile)
            if publish is not None:
                publish(decision, profile)
        except Exception:
            logger.exception("tuner: a period failed; keeping the current thresholds")


async def drive_local(
    core: TunerCore,
    servers: Iterable[_Reporter],
    stop: asyncio.Event,
    on_decision: Callable[[TunerDecision], None] | None = None,
) -> None:
    """The tuner loop over in-process replicas (a ``LocalRuntime``'s ``model_replicas``): it
    pulls their windows and pushes the thresholds back each period (both through each
    replica's call queue)."""
    servers = list(servers)

    async def gather() -> None:
        for k, server in enumerate(servers):
            core.report(server.name, f"local-{k}", await server.window())

    def publish(decision: TunerDecision, profile: RoutingProfile | None) -> None:
        for server in servers:
            server.set_batch_thresholds(core.thresholds[server.name])
        if on_decision is not None:
            on_decision(decision)

    await run_tuner(core, stop, gather, publish)
