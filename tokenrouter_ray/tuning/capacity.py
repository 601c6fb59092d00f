"""Capacity: how many replicas of each model an offered load needs, and the time per token.

The exact chain (``markov.py``) has one replica per model and grows as N²; a capacity plan
needs T(n) for every n up to hundreds, for many replica vectors. This module predicts it
with a mean-value model of the same system, checked against the exact chain (one replica)
and the Monte Carlo chain (replicas, ``montecarlo.monte_carlo_bound``) in
tests/tuning/test_capacity.py, and against the simulated runtime (docs/user-guide/scaling.md,
"Measured").

**Closed system, n requests** (``closed_point``). A request at model i steps there, then
moves to j with ``p_ij`` and commits ``c_ij`` tokens. With ``nu`` the stationary
distribution of ``p`` (visits per step of the routing chain) a request commits
``kappa = sum_i nu_i sum_j p_ij c_ij`` tokens per chain step, and a chain step takes it

    C = sum_i nu_i V_i,   V_i = tau_i(b_i) + e_i (x + u_i' tau_i(b_i) / 2)

where ``e_i`` is the share of visits to i that arrive from another model (they wait for the
step in progress there, half a step on average when the replica is busy, and ``x`` in
transit: ``transit_s``, else the profile's ``transit_ms`` for the moves into i),
``u_i' = u_i (n - 1) / n`` the busy share seen by an arriving request (the other
n - 1 keep it busy: the arrival theorem), and ``b_i`` the mean rows per step of one of the
``R_i`` replicas of model i, from its visit rate ``lambda_i = n nu_i / (C R_i)``: under
eager launch (thresholds of 1) a busy replica steps back to back and runs what arrived
during the last step, ``b = lambda_i tau_i(b)``, between 1 and its most rows per step
``m_i`` (``max_batch``: the scheduler's ``max_num_seqs``). ``u_i = lambda_i tau_i(b_i) /
b_i``. ``C`` is the fixed point (one root: the right side falls as C grows), and never below
the bottleneck bound ``n nu_i / (R_i m_i / tau_i(m_i))``, where model i runs full batches
back to back and the rest queue. Then ``T(n) = n kappa / C``. The replicas of a model share
its load evenly (placement balances them, ``ingress/placement.py``).

**Open loop** (``predict``): Poisson arrivals of ``lambda`` requests/s, each ``L`` output
tokens, are the birth-death process of ``open_loop.py`` over these ``T(n)``: the mean time per
output token (arrival to finish, over L), the mean rows per step of every model's replicas
and their utilisation (rows per step against ``m_i``), and stability.

**The plan** (``plan``): the fewest GPUs (replicas times GPUs per replica, within each
model's bounds) whose prediction keeps every model's utilisation at or below its target and
the mean time per token at or below the TPOT target, found by adding one replica at a time
to the model that most needs it. Prefill is not modelled beyond the step that carries it
(the step-time profiles are decode steps, as the simulation's are).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from tokenrouter_ray.tuning.open_loop import OpenLoopPrediction, predict_open_loop
from tokenrouter_ray.tuning.profile import ModelProfile, RoutingProfile

DEFAULT_MAX_ROWS = 64  # the scheduler's max_num_seqs default
BISECT_STEPS = 40  # 2^-40 of the bracket: far below any step time's precision
MASS_LEFT = 1e-9  # the open loop's states are computed until this much mass is left out
MAX_STATES = 1 << 14


@dataclass(frozen=True)
class Load:
    """An offered load: Poisson arrivals of requests with these mean lengths."""

    arrival_rate: float  # requests per second
    output_tokens: float  # committed tokens per request
    prompt_tokens: float = 0.0  # informative: prefill is one step (see the module docstring)

    def __post_init__(self) -> None:
        if not self.arrival_rate >= 0 or not self.output_tokens > 0:
            raise ValueError(
                f"need arrival_rate >= 0 and output_tokens > 0, got {self.arrival_rate}, "
                f"{self.output_tokens}"
            )

    @property
    def tokens_per_s(self) -> float:
        return self.arrival_rate * self.output_tokens


@dataclass(frozen=True)
class ClosedPoint:
    """The mean-value model at n active requests."""

    n_requests: int
    throughput: float  # committed tokens per second
    cycle_s: float  # one step of the routing chain, for one request
    rows: tuple[float, ...]  # mean rows per step of one replica, per model
    busy: tuple[float, ...]  # share of time one replica steps, per model
    saturated: tuple[bool, ...]  # per model: full batches back to back, the rest queue


@dataclass(frozen=True)
class Chain:
    """The routing chain's per-step quantities the model needs."""

    visits: np.ndarray  # (M,) nu: share of chain steps at each model
    entries: np.ndarray  # (M,) e: share of visits to each model that arrive from another
    tokens_per_step: float  # kappa

    @classmethod
    def of(cls, profile: RoutingProfile) -> Chain:
        p = profile.route_matrix()  # (M, M)
        m = p.shape[0]
        system = np.vstack([(p.T - np.eye(m))[:-1], np.ones(m)])
        rhs = np.zeros(m)
        rhs[-1] = 1.0
        nu = np.clip(np.linalg.lstsq(system, rhs, rcond=None)[0], 0.0, None)
        nu = nu / nu.sum()
        inflow = nu @ (p - np.diag(np.diag(p)))  # (M,) arrivals from other models per step
        entries = np.divide(inflow, nu, out=np.zeros(m), where=nu > 0)
        return cls(nu, entries, float(nu @ profile.tokens_per_step()))


class StepCurve:
    """One model's step time (seconds) as a function of a fractional batch:
    ``ModelProfile.step_time_ms`` as linear pieces ``tau(b) = a + c b`` (flat below the first
    point, the last slope extended, never falling), so the batch a rate leads to has a
    closed form on each piece."""

    def __init__(self, model: ModelProfile) -> None:
        sizes = [float(b) for b, _ in model.step_ms]
        times = [t / 1e3 for _, t in model.step_ms]
        tail = 0.0 if len(sizes) == 1 else (times[-1] - times[-2]) / (sizes[-1] - sizes[-2])
        pieces = [(-math.inf, sizes[0], times[0], 0.0)]  # (from, to, a, c)
        for k in range(1, len(sizes)):
            c = (times[k] - times[k - 1]) / (sizes[k] - sizes[k - 1])
            pieces.append((sizes[k - 1], sizes[k], times[k - 1] - c * sizes[k - 1], c))
        c = max(tail, 0.0)
        pieces.append((sizes[-1], math.inf, times[-1] - c * sizes[-1], c))
        self.pieces = pieces
        self.starts = [p[0] for p in pieces]

    def seconds(self, b: float) -> float:
        _, _, a, c = self.pieces[bisect.bisect_right(self.starts, b) - 1]
        return a + c * b

    def batch(self, rate: float, most: int) -> float:
        """Rows per step of a replica receiving ``rate`` rows/s: the root of ``b = rate
        tau(b)`` in [1, most] (1 when even one row finishes before the next arrives; most
        when full batches cannot keep up)."""
        if rate * self.seconds(1.0) <= 1.0:
            return 1.0
        if rate * self.seconds(float(most)) >= most:
            return float(most)
        for lo, hi, a, c in self.pieces:  # rate tau(b) - b falls through 0 on one piece
            if hi < 1.0 or rate * c >= 1.0:
                continue
            b = rate * a / (1.0 - rate * c)
            if max(lo, 1.0) - 1e-12 <= b <= hi + 1e-12:
                return min(max(b, 1.0), float(most))
        return float(most)


class MeanValueModel:
    """``closed_point`` for one profile, replica vector, row caps and transit."""

    def __init__(
        self,
        profile: RoutingProfile,
        replicas: Sequence[int],
        max_rows: Sequence[int],
        transit_s: float = 0.0,
    ) -> None:
        if len(replicas) != profile.num_models or len(max_rows) != profile.num_models:
            raise ValueError("need one replica count and one row cap per model")
        if min(replicas) < 1 or min(max_rows) < 1:
            raise ValueError(f"replicas and row caps must be >= 1, got {replicas}, {max_rows}")
        self.profile = profile
        self.replicas = tuple(int(r) for r in replicas)
        self.max_rows = tuple(int(m) for m in max_rows)
        self.chain = Chain.of(profile)
        # seconds an entry into each model spends in transit: ``transit_s``, or the
        # profile's per-pair transit averaged over the moves that enter the model
        p, x = profile.route_matrix(), profile.transit_matrix() / 1e3  # (M, M)
        inflow = self.chain.visits @ (p - np.diag(np.diag(p)))  # (M,)
        carried = self.chain.visits @ (p * x)  # (M,) diagonal of x is 0
        mean = np.divide(carried, inflow, out=np.zeros_like(carried), where=inflow > 0)
        self.transit_s = [float(transit_s) or float(t) for t in mean]
        self.curves = [StepCurve(model) for model in profile.models]
        # the most visits per second one replica of each model can take: full batches
        self.capacity = tuple(
            m / self.curves[i].seconds(float(m)) for i, m in enumerate(self.max_rows)
        )

    def _visit(self, n: int, cycle_s: float) -> tuple[float, list[float], list[float]]:
        """At chain-step time ``cycle_s``: the time the per-model visits add up to, and each
        model's rows per step and busy share."""
        total, rows, busy = 0.0, [], []
        others = (n - 1) / n
        for i, nu in enumerate(self.chain.visits):
            if nu <= 0:
                rows.append(0.0)
                busy.append(0.0)
                continue
            rate = n * nu / (cycle_s * self.replicas[i])  # visits/s at one replica
            b = self.curves[i].batch(rate, self.max_rows[i])
            tau = self.curves[i].seconds(b)
            u = min(1.0, rate * tau / b)
            wait = self.chain.entries[i] * (self.transit_s[i] + others * u * tau / 2)
            total += nu * (tau + wait)
            rows.append(b)
            busy.append(u)
        return total, rows, busy

    def point(self, n: int) -> ClosedPoint:
        """C solves C = visits(C) (one root: the right side falls as C grows), and is never
        below the bottleneck bound, where a model runs full batches back to back and the
        rest of the cycle is queueing there."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        nu = self.chain.visits
        lo = float(sum(v * self.curves[i].seconds(1.0) for i, v in enumerate(nu) if v > 0))
        hi = max(self._visit(n, lo)[0], lo)
        for _ in range(BISECT_STEPS):
            mid = 0.5 * (lo + hi)
            if self._visit(n, mid)[0] > mid:
                lo = mid
            else:
                hi = mid
        cycle = hi
        bounds = [
            n * v / (self.replicas[i] * self.capacity[i]) if v > 0 else 0.0
            for i, v in enumerate(nu)
        ]
        saturated = [False] * len(nu)
        if max(bounds) > cycle:
            cycle = max(bounds)
            saturated = [b >= cycle * (1 - 1e-9) for b in bounds]
        _, rows, busy = self._visit(n, cycle)
        return ClosedPoint(
            n_requests=n,
            throughput=n * self.chain.tokens_per_step / cycle,
            cycle_s=cycle,
            rows=tuple(float(self.max_rows[i]) if s else r for i, (r, s) in
                       enumerate(zip(rows, saturated, strict=True))),
            busy=tuple(1.0 if s else u for u, s in zip(busy, saturated, strict=True)),
            saturated=tuple(saturated),
        )  # fmt: skip


def closed_point(
    profile: RoutingProfile,
    n_requests: int,
    replicas: Sequence[int] | None = None,
    max_rows: Sequence[int] | None = None,
    transit_s: float = 0.0,
) -> ClosedPoint:
    """The mean-value model at ``n_requests`` (see the module docstring)."""
    return MeanValueModel(
        profile,
        replicas or (1,) * profile.num_models,
        max_rows or row_caps(profile),
        transit_s,
    ).point(n_requests)


def row_caps(profile: RoutingProfile, max_rows: Mapping[str, int] | None = None) -> tuple[int, ...]:
    """Each model's most rows per step: ``max_rows`` by name, else the profile's
    ``max_batch``, else the scheduler's default ``max_num_seqs``."""
    given = dict(max_rows or {})
    unknown = set(given) - set(profile.names)
    if unknown:
        raise ValueError(f"row caps name unknown models {sorted(unknown)}")
    return tuple(int(given.get(m.name, m.max_batch or DEFAULT_MAX_ROWS)) for m in profile.models)


@dataclass(frozen=True)
class Prediction:
    """What a replica vector gives at an offered load."""

    replicas: dict[str, int]
    load: Load
    stable: bool  # the offered tokens/s are below what the most requests can commit
    tpot_s: float  # mean (finish - arrival) / output tokens; inf when unstable
    mean_active: float
    rows: dict[str, float]  # mean rows per step of one replica, per model
    utilisation: dict[str, float]  # rows per step against the model's row cap
    busy: dict[str, float]  # share of time one replica steps
    max_tokens_per_s: float  # the most this replica vector commits (its largest T(n))
    open_loop: OpenLoopPrediction | None = field(default=None, repr=False)

    def gpus(self, per_replica: Mapping[str, float]) -> float:
        return sum(r * float(per_replica.get(m, 1.0)) for m, r in self.replicas.items())


def predict(
    profile: RoutingProfile,
    replicas: Mapping[str, int] | Sequence[int],
    load: Load,
    max_rows: Mapping[str, int] | None = None,
    transit_s: float = 0.0,
) -> Prediction:
    """The open-loop prediction for one replica vector (see the module docstring)."""
    names = profile.names
    counts = (
        tuple(int(replicas.get(m, 1)) for m in names)
        if isinstance(replicas, Mapping)
        else tuple(int(r) for r in replicas)
    )
    model = MeanValueModel(profile, counts, row_caps(profile, max_rows), transit_s)
    by_name = dict(zip(names, counts, strict=True))
    caps = dict(zip(names, model.max_rows, strict=True))
    points: list[ClosedPoint] = []
    top = 64
    while True:  # T(n) for n = 1..K, K doubled until the open loop leaves no mass past it
        points += [model.point(n) for n in range(len(points) + 1, top + 1)]
        rates = [p.throughput for p in points]
        most = max(rates)
        if load.tokens_per_s >= most * (1 - 1e-9):  # beyond what the system commits
            if points[-1].throughput <= points[-2].throughput * 1.001 or top >= MAX_STATES:
                return Prediction(
                    replicas=by_name,
                    load=load,
                    stable=False,
                    tpot_s=math.inf,
                    mean_active=math.inf,
                    rows={m: float(caps[m]) for m in names},
                    utilisation={m: 1.0 for m in names},
                    busy={m: 1.0 for m in names},
                    max_tokens_per_s=most,
                )
            top *= 2
            continue
        if load.arrival_rate == 0:
            return Prediction(by_name, load, True, points[0].cycle_s / model.chain.tokens_per_step,
                              0.0, {m: 0.0 for m in names}, {m: 0.0 for m in names},
                              {m: 0.0 for m in names}, most)  # fmt: skip
        prediction = predict_open_loop(load.arrival_rate, load.output_tokens, rates, "hold")
        if prediction.left_out <= MASS_LEFT or top >= MAX_STATES:
            break
        top *= 2
    pi = prediction.pi[1 : len(points) + 1]  # (K,) the states with n >= 1
    rows = np.asarray([p.rows for p in points])  # (K, M)
    busy = np.asarray([p.busy for p in points])  # (K, M)
    weight = pi.sum()
    mean_rows = (pi @ rows) / weight if weight > 0 else np.zeros(len(names))
    mean_busy = pi @ busy  # idle (n = 0) counts as not busy
    return Prediction(
        replicas=by_name,
        load=load,
        stable=True,
        tpot_s=prediction.mean_tpot_s,
        mean_active=prediction.mean_active,
        rows={m: float(r) for m, r in zip(names, mean_rows, strict=True)},
        utilisation={m: float(r) / caps[m] for m, r in zip(names, mean_rows, strict=True)},
        busy={m: float(u) for m, u in zip(names, mean_busy, strict=True)},
        max_tokens_per_s=most,
        open_loop=prediction,
    )


@dataclass(frozen=True)
class Targets:
    """What a plan must keep, and what it may use."""

    utilisation: Mapping[str, float]  # model -> rows per step against its cap, at most
    tpot_s: float | None = None  # mean time per output token, at most
    min_replicas: Mapping[str, int] = field(default_factory=dict)
    max_replicas: Mapping[str, int] = field(default_factory=dict)
    gpus_per_replica: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Plan:
    """A replica vector and its prediction; ``feasible`` False when the bounds cannot keep
    the targets (then the replicas are the most the bounds allow where it fell short)."""

    replicas: dict[str, int]
    prediction: Prediction
    feasible: bool
    reason: str
    gpus: float


def _shortfall(p: Prediction, targets: Targets) -> float:
    """How far a prediction is from the targets (0: within them): the sum of each model's
    utilisation over its target and the time per token over its target, relative."""
    if not p.stable:
        return math.inf
    over = sum(max(0.0, u / targets.utilisation[m] - 1.0) for m, u in p.utilisation.items())
    if targets.tpot_s is not None:
        over += max(0.0, p.tpot_s / targets.tpot_s - 1.0)
    return over


def plan(
    profile: RoutingProfile,
    load: Load,
    targets: Targets,
    max_rows: Mapping[str, int] | None = None,
    transit_s: float = 0.0,
) -> Plan:
    """The fewest GPUs that keep ``targets`` at ``load`` (see the module docstring): from
    the lower bounds, one replica at a time to the model whose next replica closes the
    most of the gap per GPU (while unstable: raises the most the replicas commit)."""
    names = profile.names
    low = {m: max(1, int(targets.min_replicas.get(m, 1))) for m in names}
    high = {m: int(targets.max_replicas.get(m, 1 << 10)) for m in names}
    for m in names:
        if high[m] < low[m]:
            raise ValueError(f"model {m!r}: max_replicas {high[m]} < min_replicas {low[m]}")
    missing = set(names) - set(targets.utilisation)
    if missing:
        raise ValueError(f"no utilisation target for {sorted(missing)}")
    gpus = {m: float(targets.gpus_per_replica.get(m, 1.0)) for m in names}
    replicas = dict(low)
    current = predict(profile, replicas, load, max_rows, transit_s)
    while True:
        gap = _shortfall(current, targets)
        if gap <= 0:
            return Plan(dict(replicas), current, True, "within the targets", current.gpus(gpus))
        best: tuple[float, str, Prediction] | None = None
        for m in (m for m in names if replicas[m] < high[m]):
            trial = predict(profile, {**replicas, m: replicas[m] + 1}, load, max_rows, transit_s)
            if math.isinf(gap):
                gain = trial.max_tokens_per_s - current.max_tokens_per_s
            else:
                gain = gap - _shortfall(trial, targets)
            if best is None or gain / gpus[m] > best[0]:
                best = (gain / gpus[m], m, trial)
        if best is None or best[0] <= 0:
            why = _why(current, targets)
            return Plan(dict(replicas), current, False, f"at max_replicas: {why}",
                        current.gpus(gpus))  # fmt: skip
        replicas[best[1]] += 1
        current = best[2]


def _why(p: Prediction, targets: Targets) -> str:
    parts = [
        f"{m} utilisation {u:.2f} > {targets.utilisation[m]:.2f}"
        for m, u in p.utilisation.items()
        if u > targets.utilisation[m]
    ]
    if targets.tpot_s is not None and p.tpot_s > targets.tpot_s:
        parts.append(f"TPOT {1e3 * p.tpot_s:.1f} ms > {1e3 * targets.tpot_s:.1f} ms")
    return "; ".join(parts) or "unstable"
