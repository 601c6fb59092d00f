"""``Metrics``: the typed recording calls the runtime makes, over any backend.

Sub-servers, the ingress core and the deployments call these methods at the few places
where something happens (a step, a commit, a handoff, a message, a request's end); the
method turns it into ``inc``/``set``/``observe`` on the definitions in ``definitions.py``.
One ``Metrics`` is cheap (a backend reference and the policy name); backends are built once
per process.

    metrics = Metrics(PrometheusBackend(CollectorRegistry()), policy="r2r")   # tests
    metrics = Metrics(policy="r2r")              # prometheus-client, global registry
    metrics = Metrics.ray(policy="r2r")          # inside Ray Serve deployments
    metrics = Metrics.noop()
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from tokenrouter_ray.metrics import definitions as m
from tokenrouter_ray.metrics.backends import Backend, NoopBackend, default_backend, ray_backend

if TYPE_CHECKING:
    from tokenrouter_ray.engine.engine import Engine
    from tokenrouter_ray.tuning.profile import RoutingProfile
    from tokenrouter_ray.tuning.solver import Decision

INGRESS = "ingress"  # the `model` label of errors and peer latency seen at the ingress


class Metrics:
    def __init__(self, backend: Backend | None = None, policy: str = "") -> None:
        self.backend: Backend = default_backend() if backend is None else backend
        self.policy = policy
        self._preemptions: dict[str, int] = {}  # model -> scheduler count already exported

    @classmethod
    def ray(cls, policy: str = "") -> Metrics:
        return cls(ray_backend(), policy)

    @classmethod
    def noop(cls) -> Metrics:
        return cls(NoopBackend())

    # -------------------------------------------------------------- sub-servers
    def handoff(self, src: str, dst: str, num_tokens: int) -> None:
        self.backend.inc(m.HANDOFFS, 1, (src, dst, self.policy))
        self.backend.observe(m.HANDOFF_TOKENS, num_tokens, (src, dst))

    def committed(self, model: str, num_tokens: int) -> None:
        if num_tokens:
            self.backend.inc(m.COMMITTED_TOKENS, num_tokens, (model, self.policy))

    def step(
        self, model: str, batch_size: int, seconds: float, route_seconds: float | None
    ) -> None:
        """One launched step; ``route_seconds`` is None when no row sampled (nothing routed)."""
        self.backend.observe(m.BATCH_SIZE, batch_size, (model,))
        self.backend.observe(m.STEP_SECONDS, seconds, (model,))
        if route_seconds is not None:
            self.backend.observe(m.ROUTE_SECONDS, route_seconds, (model, self.policy))

    def deferred_wait(self, model: str, seconds: float) -> None:
        self.backend.observe(m.DEFERRED_WAIT_SECONDS, seconds, (model,))

    def peer_message(self, model: str, sent_at_ns: int) -> None:
        """One received frame's one-way latency (clamped at 0 against clock skew)."""
        seconds = max(0, time.time_ns() - sent_at_ns) / 1e9
        self.backend.observe(m.PEER_LATENCY_SECONDS, seconds, (model,))

    def engine_state(self, model: str, engine: Engine) -> None:
        """Queue depths, threshold, active count, KV usage and new preemptions."""
        sched, pool = engine.scheduler, engine.kv.pool
        labels = (model,)
        self.backend.set(m.REQUESTS_WAITING, len(sched.waiting), labels)
        self.backend.set(m.REQUESTS_RUNNING, len(sched.running), labels)
        self.backend.set(m.REQUESTS_PENDING, len(sched.pending), labels)
        self.backend.set(m.BATCH_THRESHOLD, sched.threshold(), labels)
        n = sched.active_requests if sched.active_requests is not None else sched.num_active
        self.backend.set(m.ACTIVE_REQUESTS, n, labels)
        self.backend.set(m.KV_BLOCKS_USED, pool.num_used_blocks, labels)
        self.backend.set(m.KV_BLOCKS_TOTAL, pool.num_blocks, labels)
        seen = self._preemptions.get(model, 0)
        if sched.num_preemptions > seen:
            self.backend.inc(m.PREEMPTIONS, sched.num_preemptions - seen, labels)
        self._preemptions[model] = sched.num_preemptions

    def error(self, model: str, kind: str) -> None:
        self.backend.inc(m.ERRORS, 1, (model, kind))

    def peer_rejected(self, model: str, reason: str) -> None:
        """A peer-channel frame dropped unread (malformed, bad_mac, replay)."""
        self.backend.inc(m.PEER_REJECTED, 1, (model, reason))

    # ------------------------------------------------------------------ ingress
    def ingress_active(self, num_active: int) -> None:
        self.backend.set(m.INGRESS_ACTIVE_REQUESTS, num_active, ())

    def first_token(self, seconds: float) -> None:
        self.backend.observe(m.TTFT_SECONDS, seconds, ())

    def inter_token(self, seconds: float) -> None:
        self.backend.observe(m.INTER_TOKEN_SECONDS, seconds, ())

    def request_done(
        self,
        finish_reason: str,
        e2e_seconds: float,
        prompt_tokens: int,
        output_tokens: int,
        handoffs: int,
        tpot_seconds: float | None,
    ) -> None:
        self.backend.inc(m.REQUESTS, 1, (finish_reason,))
        self.backend.observe(m.E2E_SECONDS, e2e_seconds, ())
        self.backend.observe(m.PROMPT_TOKENS, prompt_tokens, ())
        self.backend.observe(m.OUTPUT_TOKENS, output_tokens, ())
        self.backend.observe(m.REQUEST_HANDOFFS, handoffs, ())
        if tpot_seconds is not None:
            self.backend.observe(m.TPOT_SECONDS, tpot_seconds, ())

    # -------------------------------------------------------------------- tuner
    def tuner_decision(
        self, decision: Decision, profile: RoutingProfile | None, tuned: list[int]
    ) -> None:
        """One tuner period: its outcome, published thresholds, predictions, estimates."""
        if decision.changed:
            outcome = "moved"
        elif decision.solved:
            outcome = "kept"
        else:
            outcome = "steady" if profile is not None else "waiting"
        self.backend.inc(m.TUNER_DECISIONS, 1, (outcome,))
        for model, table in decision.thresholds.items():
            for n in tuned:
                self.backend.set(m.TUNER_THRESHOLD, table[n], (model, str(n)))
        if decision.solved:
            for n, scores in decision.predicted.items():
                label = ",".join(f"{k}={decision.thresholds[k][n]}" for k in decision.thresholds)
                if label in scores:
                    self.backend.set(m.TUNER_PREDICTED, scores[label], (str(n),))
        self.backend.set(m.TUNER_MAX_CONCURRENCY, decision.max_concurrency or 0, ())
        if profile is not None:
            for i, src in enumerate(profile.names):
                for j, dst in enumerate(profile.names):
                    self.backend.set(m.TUNER_ROUTE_PROB, profile.route_prob[i][j], (src, dst))
