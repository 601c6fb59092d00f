"""One Serve deployment per model: a replica hosts one ``Replica`` (replica/step.py: engine +
policy + peer channel, and the thread that steps them). Requests reach it as PeerReqs over
the channel, not as handle calls; the handle serves only ``info`` and ``status``
(``ReplicaInfo`` / ``ReplicaStatus``, typed: ``replica/status.py``), health checks and
``inject_fault`` (chaos tests). With the tuner enabled, each replica reports its statistics
window to the tuner every period and adopts the thresholds it answers (and, with
autoscaling, the replica count the tuner's plan gives the model, which
``record_autoscaling_stats`` hands to Serve's autoscaler beside this replica's own load). A
replica being stopped (scale-down, rolling update) first moves its requests to the model's
other replicas (``_leave``: drain, docs/user-guide/scaling.md). Serve's ``check_health`` fails (and
Serve restarts the replica) when the replica's receive or send task or its step thread
stopped, the channel closed, the endpoint heartbeat stopped, a step ran past ``max_step_s``
(a wedged device) or ``max_failed_steps`` steps in a row failed (a sticky device error)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from msgspec.structs import asdict
from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments.autoscaling import PLANNED, UTILISATION
from deployments.directory import ServeDirectory
from deployments.peers import PeerBook, make_channel, peer_key
from deployments.ray_metrics import ray_metrics
from tokenrouter_ray.app_config import spec_tokenizer
from tokenrouter_ray.config import AppConfig
from tokenrouter_ray.engine.config import EngineConfig
from tokenrouter_ray.engine.engine import Engine
from tokenrouter_ray.host_gc import tune_gc
from tokenrouter_ray.quality.live import Score, ScoreBudget, plain_model, teacher_forced
from tokenrouter_ray.replica.status import ReplicaInfo, ReplicaStatus, replica_info, replica_status
from tokenrouter_ray.replica.step import Replica
from tokenrouter_ray.routing.policy import build_policy, policy_class
from tokenrouter_ray.tasks import cancel_and_wait

logger = logging.getLogger("ray.serve")


def engine_config(cfg: AppConfig, name: str) -> EngineConfig:
    """Model ``name``'s section as its engine's config: its ``EngineOptions`` as they stand,
    and what serving derives from the rest (device, budget in bytes, merged scheduler)."""
    spec = cfg.models[name]
    return EngineConfig(
        **spec.engine_options(),
        model=spec.path,
        device="cuda" if spec.num_gpus > 0 else "cpu",
        memory_budget_bytes=int(spec.memory_budget_gb * 2**30),
        scheduler=cfg.scheduler_for(name),
    )


def build_engine(cfg: AppConfig, name: str, launcher: Any) -> Engine:
    """The engine of one replica of model ``name``: loaded from its checkpoint, or a
    simulated one (``ModelSpec.sim``: simulation/served.py)."""
    spec = cfg.models[name]
    if spec.sim is not None:
        from tokenrouter_ray.simulation.served import sim_engine_for

        index = cfg.model_names.index(name)
        return sim_engine_for(
            spec.sim,
            name,
            index,
            cfg.scheduler_for(name),
            spec.max_model_len,
            spec.block_size,
            spec.prefix_caching,
        )
    return Engine.from_config(engine_config(cfg, name), launcher)


@serve.deployment(health_check_period_s=5, graceful_shutdown_timeout_s=5)
class ModelServer:
    async def __init__(
        self,
        model: str,
        cfg: AppConfig,
        directory: DeploymentHandle,
        tuner: DeploymentHandle | None = None,
    ) -> None:
        self.model = model
        self.spec = cfg.models[model]
        index = cfg.model_names.index(model)
        self._left = False  # drained and leaving: no more heartbeats
        launcher = None
        if cfg.models[model].tensor_parallel > 1:
            # ranks 1..k-1 are actors in this replica's placement group; imported here, as
            # the distributed stack is heavy to import and only tensor parallelism needs it
            from deployments.tp_workers import RayWorkerLauncher

            launcher = RayWorkerLauncher()
        self.engine = await asyncio.to_thread(build_engine, cfg, model, launcher)
        needs_tokenizer = policy_class(cfg.policy.name).needs_tokenizer
        tokenizer = spec_tokenizer(cfg.models[model]) if needs_tokenizer else None
        policy = build_policy(cfg.policy.name, cfg.policy.options, cfg.model_names, tokenizer)
        replica = serve.get_replica_context().replica_id.unique_id
        self.directory = ServeDirectory(directory)
        key = await peer_key(self.directory)
        metrics = ray_metrics(policy=cfg.policy.name, model_name=cfg.served_model_name)
        self.channel = make_channel(cfg.transport, model, replica, self.directory, key, metrics)
        self.bad_mac_unhealthy_s = cfg.transport.frames.bad_mac_unhealthy_s
        await self.channel.start()
        self.peers = PeerBook(
            self.directory,
            cfg.model_names,
            own=self.channel.endpoint,
            on_lost=self._on_lost,
            # heartbeat while serving, and while draining (peers still reach it then)
            alive=lambda: not hasattr(self, "server") or (self.server.alive and not self._left),
        )
        await self.peers.start(wait_for_all=False)
        self.server = Replica(
            cfg.model_names,
            index,
            self.engine,
            policy,
            self.channel,
            pick_endpoint=self._pick,
            metrics=metrics,
        )
        self.server.stats.window_s = cfg.tuner.window_s
        await self.server.start()
        self.replica = replica
        self.max_rows = cfg.scheduler_for(model).max_num_seqs
        self.planned: int | None = None  # replicas the tuner's plan gives this model
        self._stepped = (0, 0)  # (rows, steps) at the last autoscaling report
        self._tuning = (
            asyncio.create_task(self._follow_tuner(tuner, cfg.tuner.period_s), name="tuner")
            if tuner is not None
            else None
        )
        # live quality: answers scored here when this is the top model (quality/live.py)
        self.scoring = ScoreBudget(cfg.quality_monitor.max_share)
        tune_gc(cfg.gc)  # started: what is alive now lives as long as the replica

    async def score(self, prompt: list[int], answer: list[int]) -> Score:
        """Live quality: ``answer`` after ``prompt``, teacher-forced on this replica's model
        on the step thread between two steps, while scoring stays within its share of the
        replica's time (else skipped, saying why)."""
        refusal = self.scoring.refusal()
        if refusal is not None:
            return Score(skipped=refusal)
        model = plain_model(self.engine)
        if model is None:
            return Score(skipped="unsupported")
        score = await self.server.call(lambda: teacher_forced(model, prompt, answer))
        self.scoring.spend(score.seconds)
        return score

    async def _follow_tuner(self, tuner: DeploymentHandle, period_s: float) -> None:
        """Report this replica's window; adopt the ``ThresholdTable`` the tuner answers (both
        through the step thread's call queue)."""
        while True:
            await asyncio.sleep(period_s)
            try:
                snapshot = await asyncio.wait_for(self.server.window(), timeout=period_s)
                report = tuner.report.remote(self.model, self.replica, snapshot)
                answer = await asyncio.wait_for(report, timeout=max(10.0, 2 * period_s))
            except Exception as exc:  # the tuner restarting must not stop serving
                logger.warning("%s: tuner report failed: %s", self.model, exc)
                self.planned = None
                continue
            self.server.set_batch_thresholds(answer.thresholds)
            self.planned = answer.replicas

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """What Serve's autoscaler reads of this replica (``deployments/autoscaling.py``,
        every ``metrics_interval_s``): the replica count the tuner's plan gives this model
        (0: no fresh plan), and this replica's load, its mean rows per step since the last
        call against ``max_num_seqs`` (0 when it did not step)."""
        rows, steps = self.server.rows_stepped, self.server.steps_recorded
        d_rows, d_steps = rows - self._stepped[0], steps - self._stepped[1]
        self._stepped = (rows, steps)
        load = d_rows / d_steps / self.max_rows if d_steps else 0.0
        return {PLANNED: float(self.planned or 0), UTILISATION: min(load, 1.0)}

    def _on_lost(self, lost: set[str]) -> None:
        for name in lost:  # its replica died: close the socket, re-resolve if it returns
            self.channel.forget_peer(name)

    def _pick(self, model: str, rid: str) -> str:
        if not self.peers.by_model.get(model):
            raise LookupError(f"no replica of {model!r} known yet")
        return self.peers.sticky(model, rid)

    async def info(self) -> ReplicaInfo:
        import ray

        return await replica_info(self.server, ray.get_runtime_context().get_node_id())

    async def status(self) -> ReplicaStatus:
        """What this replica holds now (cheap: no statistics snapshot)."""
        return await replica_status(self.server)

    async def explain(self, rid: str | None = None) -> dict[str, Any]:
        """Debugging: what this replica knows of one request (default: its oldest)."""

        def read() -> dict[str, Any]:
            key = rid if rid is not None else next(iter(self.engine.request_ids()), None)
            if key is None:
                return {}
            request, tracked = self.engine.get_request(key), self.server.requests.tracked.get(key)
            return {
                "rid": key,
                "status": request.status.name if request is not None else None,
                "num_tokens": request.num_tokens if request is not None else None,
                "route": None if tracked is None else asdict(tracked.route_state()),
                "seq": None if tracked is None else tracked.seq,
                "ledger_finished": self.server.requests.ledger.is_finished(key),
                "ledger_seq": self.server.requests.ledger.held_seq(key),
            }

        return await self.server.call(read, read_only=True)

    async def check_health(self) -> None:
        flush = getattr(self.channel, "on_reject", None)
        if hasattr(flush, "flush"):  # rejected-frame counts the channel held back
            flush.flush()
        problem = self.server.health_problem(self.spec.max_step_s, self.spec.max_failed_steps)
        if problem is not None:
            raise RuntimeError(f"{self.model}: {problem}")
        if not self.peers.refreshing:
            raise RuntimeError(f"{self.model}: endpoint heartbeat stopped")
        bad_mac_s = getattr(self.channel, "key_mismatch_s", lambda: 0.0)()
        if bad_mac_s > self.bad_mac_unhealthy_s:
            raise RuntimeError(f"{self.model}: every peer frame bad_mac for {bad_mac_s:.0f} s")
        self.engine.check_health()  # tensor parallel: every worker rank is alive

    async def inject_fault(self, kind: str, count: int = 1, seconds: float = 0.0) -> None:
        """Chaos hook: ``step`` makes the next ``count`` forward steps raise; ``stall``
        makes the next ``count`` steps take ``seconds`` longer (a model that stops
        answering); ``clear`` removes any fault. To kill a replica, kill its process
        (``status().pid``)."""
        await self.server.call(lambda: self.engine.inject_fault(kind, count, seconds))

    async def _leave(self) -> None:
        """Before stopping (Serve scales this replica down, or replaces it): when another
        replica of this model is up, drain (``Replica.drain``: every ingress stops placing
        requests here and moves the ones that may be here to another replica, from their
        committed sequence; this waits until none is left, at most ``drain_timeout_s``),
        then stop the heartbeat and leave the directory. The endpoint stays registered
        while it drains: a peer may still hand it a request the ingress has not moved yet
        (the ingress's ABORT follows), and that must not fail as unreachable. Without
        another replica (the app is being deleted, or this is the last one) there is
        nowhere to move them: no wait."""
        others = [e for e in self.peers.by_model.get(self.model, []) if e != self.channel.name]
        if not others or not self.server.alive:
            return
        left = await self.server.drain(self.spec.drain_timeout_s)
        self._left = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.directory.unregister(self.channel.name), timeout=2.0)
        logger.info("%s: left after draining (%d requests still here)", self.model, left)

    async def __del__(self) -> None:
        if hasattr(self, "server"):
            try:
                await self._leave()
            except Exception:  # stopping must go on
                logger.exception("%s: draining failed", self.model)
        await cancel_and_wait(self._tuning)
        await self.server.stop()
        self.engine.close()  # tensor parallel: stop the worker ranks
        await self.peers.stop()
        await self.channel.close()
