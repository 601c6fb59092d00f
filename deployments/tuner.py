"""The threshold tuner as a one-replica Serve deployment (live re-solve, docs/user-guide/tuning.md).

Model replicas call ``report(model, replica, snapshot)`` every ``tuner.period_s`` with their
sliding-window statistics (a ``WindowSnapshot``) and adopt the ``ThresholdTable`` it returns
(replicas pull, so the tuner never has to find a replica, and a new replica converges on its
first report). With autoscaling (``models.<m>.autoscaling``) the answer also carries the
replica count the tuner's plan gives the model (``tuning/scaling.py``), which each replica
reports to Serve's autoscaler (``deployments/autoscaling.py``). The reporting replicas are
counted per model; a count that changes (Serve autoscaling, a restart) makes the tuner
re-solve under ``sum_i R_i (B_i - 1) < N``. Every period the tuner loop
(``tuning.tuner.run_tuner``, the one ``drive_local`` runs too) merges the fresh reports,
re-solves the Markov model when the statistics drifted (in a worker thread: the event loop
keeps answering reports), and exports what it decided (a ``TunerDecision``) as metrics.
``status()`` says what it decided and why: a ``TunerStatus`` (typed over Ray; the ingress
serves its ``to_json()`` at ``GET /v1/tokenrouter/tuner``).
"""

from __future__ import annotations

import asyncio
import logging

from ray import serve

from deployments.ray_metrics import ray_metrics
from tokenrouter_ray.config import AppConfig
from tokenrouter_ray.replica.window import WindowSnapshot
from tokenrouter_ray.thresholds import ThresholdTable
from tokenrouter_ray.tuning.decision import TunerAnswer, TunerDecision, TunerStatus
from tokenrouter_ray.tuning.profile import RoutingProfile
from tokenrouter_ray.tuning.scaling import ReplicaPlanner, ScalingSpec
from tokenrouter_ray.tuning.tuner import TunerCore, run_tuner

logger = logging.getLogger("ray.serve")


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000)
class Tuner:
    async def __init__(self, cfg: AppConfig) -> None:
        initial = {
            m: ThresholdTable.of(cfg.scheduler_for(m).batch_thresholds) for m in cfg.model_names
        }
        replicas = {m: spec.start_replicas for m, spec in cfg.models.items()}  # until reports
        scaling = ScalingSpec.of(cfg)  # models with autoscaling: plan their replicas too
        planner = ReplicaPlanner(scaling) if scaling is not None else None
        self.core = TunerCore(
            cfg.model_names, cfg.tuner, initial, replicas=replicas, planner=planner
        )
        self.metrics = ray_metrics(policy=cfg.policy.name, model_name=cfg.served_model_name)
        self._stop = asyncio.Event()
        self._task = asyncio.create_task(
            run_tuner(self.core, self._stop, publish=self._publish), name="tuner"
        )

    async def report(self, model: str, replica: str, snapshot: WindowSnapshot) -> TunerAnswer:
        """Store a replica's window; answer its model's thresholds and planned replicas."""
        table = self.core.report(model, replica, snapshot)
        return TunerAnswer(table, self.core.planned(model))

    async def status(self) -> TunerStatus:
        return self.core.snapshot()

    async def admission_cap(self) -> int | None:
        """SLO mode: how many requests may be active (None: no cap)."""
        return self.core.last.max_concurrency

    def _publish(self, decision: TunerDecision, profile: RoutingProfile | None) -> None:
        """After each period of the tuner loop: log a change, export the decision."""
        if decision.changed:
            logger.info("tuner: %s", decision.reason)
        self.metrics.tuner_decision(decision, profile, self.core.spec.concurrencies)

    async def check_health(self) -> None:
        if self._task.done():
            why = "cancelled" if self._task.cancelled() else self._task.exception()
            raise RuntimeError(f"tuner loop stopped: {why}")

    async def __del__(self) -> None:
        self._stop.set()
        self._task.cancel()
