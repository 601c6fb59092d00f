"""The live replica plan: every model's replica count, solved together by the tuner.

The tuner (``tuning/tuner.py``) already merges every replica's statistics window into a
``RoutingProfile`` (routing probabilities, commits, step times per batch size). The windows
also count the offered load: requests that entered at the entry model (``arrivals``) and
requests that finished with their output length (``finished``), over ``span_s`` seconds.
``ReplicaPlanner.plan`` turns profile and load into a ``ScalingPlan`` with
``capacity.plan``: the fewest GPUs whose predicted utilisation (rows per step against
``max_num_seqs``) stays at each model's ``autoscaling.target_utilisation`` and whose mean
time per output token stays at ``tuner.target_tpot_ms``, within each model's bounds (a model
without autoscaling keeps its ``num_replicas``). The plan rides on the tuner's decision; each
model replica gets its model's count with the thresholds it pulls and reports it to Serve's
autoscaler (``deployments/autoscaling.py``), which applies the delays and bounds.
No Ray here: ``TunerCore`` holds a planner, and tests drive it on made-up windows.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from tokenrouter_ray.config import AppConfig
from tokenrouter_ray.replica.window import WindowSnapshot
from tokenrouter_ray.tuning.capacity import Load, Targets, plan
from tokenrouter_ray.tuning.decision import ScalingPlan
from tokenrouter_ray.tuning.profile import RoutingProfile

MIN_FINISHED = 5  # finished requests a window needs before their mean length is used


@dataclass(frozen=True)
class ScalingSpec:
    """What the planner keeps: per model its row cap, and the targets and bounds."""

    models: tuple[str, ...]  # entry first
    max_rows: dict[str, int]  # the scheduler's max_num_seqs per model
    targets: Targets
    transit_s: float = 0.0

    @classmethod
    def of(cls, cfg: AppConfig) -> ScalingSpec | None:
        """The app's spec, or None when no model autoscales (nothing to plan)."""
        if not any(spec.autoscaling is not None for spec in cfg.models.values()):
            return None
        low, high, utilisation, gpus = {}, {}, {}, {}
        for name, spec in cfg.models.items():
            scaling = spec.autoscaling
            low[name] = scaling.min_replicas if scaling else spec.num_replicas
            high[name] = scaling.max_replicas if scaling else spec.num_replicas
            utilisation[name] = scaling.target_utilisation if scaling else 1.0
            gpus[name] = spec.num_gpus or 1.0  # a CPU replica counts as one
        tpot = cfg.tuner.target_tpot_ms
        return cls(
            models=tuple(cfg.model_names),
            max_rows={m: cfg.scheduler_for(m).max_num_seqs for m in cfg.model_names},
            targets=Targets(
                utilisation=utilisation,
                tpot_s=None if tpot is None else tpot / 1e3,
                min_replicas=low,
                max_replicas=high,
                gpus_per_replica=gpus,
            ),
        )


def offered_load(windows: Mapping[str, WindowSnapshot], entry: str) -> Load | None:
    """Requests/s that entered at ``entry`` and the mean output length of those that
    finished anywhere, over the windows' span; None until they say enough."""
    arrived = windows.get(entry)
    if arrived is None or arrived.span_s <= 0:
        return None
    finished = WindowSnapshot.merge(windows.values()).finished
    if finished.count < MIN_FINISHED:
        return None
    prompt = arrived.arrivals.total / arrived.arrivals.count if arrived.arrivals.count else 0.0
    return Load(
        arrival_rate=arrived.arrivals.count / arrived.span_s,
        output_tokens=max(1.0, finished.total / finished.count),
        prompt_tokens=prompt,
    )


class ReplicaPlanner:
    """Profile and windows in, a ``ScalingPlan`` out (see the module docstring)."""

    def __init__(self, spec: ScalingSpec) -> None:
        self.spec = spec

    def plan(
        self, profile: RoutingProfile | None, windows: Mapping[str, WindowSnapshot]
    ) -> ScalingPlan | None:
        """None until the profile and the load are known. With no arrivals the plan is
        every model's lower bound."""
        load = offered_load(windows, self.spec.models[0])
        if profile is None or load is None:
            return None
        result = plan(profile, load, self.spec.targets, self.spec.max_rows, self.spec.transit_s)
        tpot = result.prediction.tpot_s
        return ScalingPlan(
            replicas=dict(result.replicas),
            feasible=result.feasible,
            reason=result.reason,
            arrival_rate=load.arrival_rate,
            output_tokens=load.output_tokens,
            tpot_ms=1e3 * tpot if math.isfinite(tpot) else None,
            utilisation=dict(result.prediction.utilisation),
        )
