"""What the live tuner decided and what it knows: typed records that cross Ray as they are.

``TunerDecision`` is one period's outcome of ``ThresholdSolver.decide``: a
``ThresholdTable`` per model, whether it changed and why, the predicted tokens per second of
the threshold sets it compared (per active-request count N), the SLO admission cap, and,
once the tuner recorded it, the routing probabilities and the transit between models it
decided from (``route_prob``, ``transit_ms``, keyed by the model pair) and, with
autoscaling, the replica plan (``ScalingPlan``, ``tuning/scaling.py``). ``TunerStatus`` is
``TunerCore.snapshot()``: the thresholds in use, the last decision and the recent changes,
the reporting replicas and the statistics the decisions came from. Both are msgspec structs:
the Tuner deployment returns them to its callers (the ingress, the replicas) typed;
``to_json`` writes the body of ``GET /v1/tokenrouter/tuner`` (model pairs as ``"a->b"``, N
and batch sizes as string keys, thresholds as lists), the only place their JSON shape is
decided.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import msgspec
from msgspec.structs import replace

from tokenrouter_ray.thresholds import ThresholdTable, json_hook

Pair = tuple[str, str]  # (source model, destination model)


class ScalingPlan(msgspec.Struct):
    """One planning outcome: replicas per model, and what it was planned from."""

    replicas: dict[str, int]
    feasible: bool
    reason: str
    arrival_rate: float  # requests per second offered
    output_tokens: float  # mean committed tokens per request
    tpot_ms: float | None  # predicted mean time per output token (None: unstable)
    utilisation: dict[str, float]  # predicted rows per step against max_num_seqs
    at: float = msgspec.field(default_factory=time.time)

    def to_json(self) -> dict[str, Any]:
        return {
            "replicas": dict(self.replicas),
            "feasible": self.feasible,
            "reason": self.reason,
            "arrival_rate": round(self.arrival_rate, 3),
            "output_tokens": round(self.output_tokens, 2),
            "tpot_ms": None if self.tpot_ms is None else round(self.tpot_ms, 3),
            "utilisation": {m: round(u, 3) for m, u in self.utilisation.items()},
            "at": self.at,
        }


class TunerDecision(msgspec.Struct):
    """One decision of the threshold solver (see module docstring)."""

    thresholds: dict[str, ThresholdTable]  # per model, indexed by active-request count N
    changed: bool
    reason: str
    predicted: dict[int, dict[str, float]] = {}  # N -> {"small=1,large=2": tokens/s}
    max_concurrency: int | None = None  # SLO mode: admit at most this many requests
    solved: bool = False  # the Markov model was solved for this decision
    at: float = msgspec.field(default_factory=time.time)
    route_prob: dict[Pair, float] | None = None  # the profile it was decided from, if any
    plan: ScalingPlan | None = None  # replicas per model (models with autoscaling)
    transit_ms: dict[Pair, float] | None = None  # ... and its time between models
    # The latest solve's prediction per N (carried by the decisions that do not solve):
    # tokens/s routed at the thresholds in force, and served by the top model alone
    # (N requests per step at its step time for N rows). The speed bypass shows them
    # beside what it measures (quality/speed.py).
    predicted_routed: dict[int, float] = {}
    predicted_alone: dict[int, float] = {}

    def with_routes(
        self,
        route_prob: Mapping[Pair, float] | None,
        transit_ms: Mapping[Pair, float] | None = None,
    ) -> TunerDecision:
        """The same decision, carrying the routing probabilities (and the transit) it was
        decided from."""
        routes = None if route_prob is None else dict(route_prob)
        transit = None if transit_ms is None else dict(transit_ms)
        return replace(self, route_prob=routes, transit_ms=transit)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "changed": self.changed,
            "reason": self.reason,
            "at": self.at,
            "thresholds": _plain(self.thresholds),
            "predicted_tokens_per_s": {
                str(n): {label: round(v, 3) for label, v in scores.items()}
                for n, scores in self.predicted.items()
            },
            "max_concurrency": self.max_concurrency,
            "predicted_routed_tokens_per_s": {
                str(n): round(v, 3) for n, v in self.predicted_routed.items()
            },
            "predicted_alone_tokens_per_s": {
                str(n): round(v, 3) for n, v in self.predicted_alone.items()
            },
        }
        if self.route_prob is not None:
            out["route_prob"] = {f"{a}->{b}": round(p, 4) for (a, b), p in self.route_prob.items()}
        if self.plan is not None:
            out["plan"] = self.plan.to_json()
        if self.transit_ms is not None:
            out["transit_ms"] = {f"{a}->{b}": round(d, 3) for (a, b), d in self.transit_ms.items()}
        return out


class TunerAnswer(msgspec.Struct):
    """What the tuner answers a replica's report: the thresholds its model runs with, and
    with autoscaling the replica count the plan gives its model (None: no fresh plan)."""

    thresholds: ThresholdTable
    replicas: int | None = None


class TunerStatus(msgspec.Struct):
    """What the tuner decided and why, and the statistics it decided from."""

    thresholds: dict[str, ThresholdTable]
    last: TunerDecision
    history: list[TunerDecision]  # the recent decisions that changed a threshold
    decisions: int  # periods decided so far
    replicas: dict[str, list[str]]  # model -> the replicas whose reports are fresh
    replica_counts: dict[str, int]  # what the last solve assumed
    active_requests: dict[int, int]  # N -> steps run under it, all fresh windows together
    step_ms: dict[str, dict[int, float]]  # model -> batch size -> mean step time (ms)
    spec: dict[str, Any]  # the tuner's config section
    plan: ScalingPlan | None = None  # the replica plan in force (models with autoscaling)

    def to_json(self) -> dict[str, Any]:
        """The body of ``GET /v1/tokenrouter/tuner``."""
        return {
            "thresholds": _plain(self.thresholds),
            "last": self.last.to_json(),
            "history": [d.to_json() for d in self.history],
            "decisions": self.decisions,
            "replicas": _plain(self.replicas),
            "replica_counts": _plain(self.replica_counts),
            "active_requests": _plain(self.active_requests),  # N as a string key
            "step_ms": {
                m: {str(b): round(t, 3) for b, t in sorted(v.items())}
                for m, v in self.step_ms.items()
            },
            "spec": _plain(self.spec),
            "plan": None if self.plan is None else self.plan.to_json(),
        }


def _plain(value: Any) -> Any:
    """JSON-ready builtins: tables as lists, integer keys as strings."""
    return msgspec.to_builtins(value, enc_hook=json_hook, str_keys=True)
