"""``Metrics``: the typed recording calls the runtime makes, over any backend.

Model replicas, the ingress core and the deployments call these methods at the few places
where something happens (a step, a commit, a handoff, a message, a request's end); the
method turns it into ``inc``/``set``/``observe`` on the definitions in ``definitions.py``,
with the served model name appended as the ``model_name`` label. One ``Metrics`` is cheap (a
backend reference, the policy and the served model name); backends are built once per
process.

    metrics = Metrics(PrometheusBackend(CollectorRegistry()), policy="r2r")   # tests
    metrics = Metrics(policy="r2r", model_name="tokenrouter")   # prometheus-client, global
    metrics = ray_metrics(policy="r2r", model_name="tokenrouter")   # deployments/ray_metrics.py
    metrics = Metrics.noop()
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tokenrouter_ray.metrics import definitions as m
from tokenrouter_ray.metrics.backends import Backend, NoopBackend, default_backend

if TYPE_CHECKING:
    from tokenrouter_ray.engine.engine import Engine
    from tokenrouter_ray.engine.request import Request
    from tokenrouter_ray.tuning.decision import TunerDecision
    from tokenrouter_ray.tuning.profile import RoutingProfile

INGRESS = "ingress"  # the `model` label of errors and peer latency seen at the ingress


class Metrics:
    def __init__(
        self, backend: Backend | None = None, policy: str = "", model_name: str = ""
    ) -> None:
        self.backend: Backend = default_backend() if backend is None else backend
        self.policy = policy
        self.model_name = model_name
        # model -> scheduler counts already exported (the scheduler keeps running totals)
        self._preemptions: dict[str, int] = {}
        self._deferred_timeouts: dict[str, int] = {}
        self._cache_queries: dict[str, int] = {}
        self._cache_hits: dict[str, int] = {}

    @classmethod
    def noop(cls) -> Metrics:
        return cls(NoopBackend())

    def _inc(self, metric: m.MetricDef, value: float, *labels: str) -> None:
        self.backend.inc(metric, value, (*labels, self.model_name))

    def _set(self, metric: m.MetricDef, value: float, *labels: str) -> None:
        self.backend.set(metric, value, (*labels, self.model_name))

    def _observe(self, metric: m.MetricDef, value: float, *labels: str) -> None:
        self.backend.observe(metric, value, (*labels, self.model_name))

    # -------------------------------------------------------------- model replicas
    def handoffs(self, src: str, dst: str, sizes: Sequence[int]) -> None:
        """Handoffs from ``src`` to ``dst`` (one step's), the suffix length of each."""
        self._inc(m.HANDOFFS, len(sizes), src, dst, self.policy)
        for num_tokens in sizes:
            self._observe(m.HANDOFF_TOKENS, num_tokens, src, dst)

    def committed(self, model: str, num_tokens: int, num_dropped: int = 0) -> None:
        """One step's commit on ``model``: tokens kept, and sampled tokens the policy dropped
        at a handoff (the receiver regenerates them)."""
        if num_tokens:
            self._inc(m.COMMITTED_TOKENS, num_tokens, model, self.policy)
            self._inc(m.GENERATION_TOKENS, num_tokens)
        if num_dropped:
            self._inc(m.DROPPED_TOKENS, num_dropped, model, self.policy)

    def step(
        self,
        model: str,
        batch_size: int,
        seconds: float,
        route_seconds: float | None,
        first_tokens: Sequence[Request] = (),
        started: float | None = None,
    ) -> None:
        """One launched step; ``route_seconds`` is None when no row sampled (nothing routed).

        ``first_tokens``: the engine requests whose first output token this step sampled,
        picked by the caller before the commit (``started``: the step's start, monotonic;
        default: ``seconds`` and ``route_seconds`` before now). Sampling its first output
        token ends a request's queue and prefill phases on this model: queued from its
        arrival here to this step's start, prefilled during this step. That is the entry
        model for every request, and also the model an escalated first token went to (the
        entry's token was dropped, so later visits otherwise carry output already).
        """
        self._observe(m.BATCH_SIZE, batch_size, model)
        self._observe(m.STEP_SECONDS, seconds, model)
        if route_seconds is not None:
            self._observe(m.ROUTE_SECONDS, route_seconds, model, self.policy)
        if started is None:
            started = time.monotonic() - seconds - (route_seconds or 0.0)
        for request in first_tokens:
            self._observe(m.QUEUE_SECONDS, max(0.0, started - request.arrival_time), model)
            self._observe(m.PREFILL_SECONDS, seconds, model)

    def deferred_wait(self, model: str, seconds: float) -> None:
        self._observe(m.DEFERRED_WAIT_SECONDS, seconds, model)

    def peer_message(self, model: str, sent_at_ns: int) -> None:
        """One received frame's one-way latency (clamped at 0 against clock skew)."""
        seconds = max(0, time.time_ns() - sent_at_ns) / 1e9
        self._observe(m.PEER_LATENCY_SECONDS, seconds, model)

    def engine_state(self, model: str, engine: Engine) -> None:
        """Queue depths, threshold, active count, KV usage (cached free blocks count as
        free), new preemptions, new deferred-launch timeouts and prefix-cache tokens."""
        state = engine.status()
        self._set(m.REQUESTS_WAITING, state.waiting, model)
        self._set(m.REQUESTS_RUNNING, state.running, model)
        self._set(m.REQUESTS_PENDING, state.pending, model)
        self._set(m.BATCH_THRESHOLD, state.threshold, model)
        self._set(m.ACTIVE_REQUESTS, state.active_requests, model)
        used, total = state.kv_blocks_used, state.kv_blocks_total
        self._set(m.KV_USAGE, used / total if total else 0.0, model)
        self._set(m.KV_BLOCKS_USED, used, model)
        self._set(m.KV_BLOCKS_TOTAL, total, model)
        self._count_new(m.PREEMPTIONS, self._preemptions, model, state.preemptions)
        self._count_new(
            m.DEFERRED_TIMEOUTS, self._deferred_timeouts, model, state.deferred_timeouts
        )
        if state.prefix_cache_queries > self._cache_queries.get(model, 0):
            # Hits go out with every growth of the queries, by 0 too: both series exist.
            hits = state.prefix_cache_hits - self._cache_hits.get(model, 0)
            self._inc(m.PREFIX_CACHE_HITS, hits, model)
            self._cache_hits[model] = state.prefix_cache_hits
        queries = state.prefix_cache_queries
        self._count_new(m.PREFIX_CACHE_QUERIES, self._cache_queries, model, queries)

    def _count_new(self, metric: m.MetricDef, seen: dict[str, int], model: str, now: int) -> None:
        """Export the growth of a running total kept elsewhere (the scheduler's)."""
        if now > seen.get(model, 0):
            self._inc(metric, now - seen.get(model, 0), model)
        seen[model] = now

    def error(self, model: str, kind: str) -> None:
        self._inc(m.ERRORS, 1, model, kind)

    def peer_rejected(self, model: str, reason: str, n: int = 1) -> None:
        """``n`` peer-channel frames dropped unread (malformed, bad_mac, replay)."""
        self._inc(m.PEER_REJECTED, n, model, reason)

    # ------------------------------------------------------------------ ingress
    def ingress_active(self, num_active: int) -> None:
        self._set(m.INGRESS_ACTIVE_REQUESTS, num_active)

    def requests_moved(self, reason: str, n: int) -> None:
        """``n`` requests re-created on another replica (``REQUESTS_MOVED``'s reasons)."""
        self._inc(m.REQUESTS_MOVED, n, reason)

    def first_token(self, seconds: float) -> None:
        self._observe(m.TTFT_SECONDS, seconds)

    def inter_token(self, seconds: float) -> None:
        self._observe(m.INTER_TOKEN_SECONDS, seconds)

    def request_done(
        self,
        finish_reason: str,
        e2e_seconds: float,
        prompt_tokens: int,
        output_tokens: int,
        handoffs: int,
        tpot_seconds: float | None,
    ) -> None:
        """A request (choice) released; its decode time is first to last token, which is
        ``tpot * (output_tokens - 1)`` (0 for a one-token answer)."""
        self._inc(m.REQUESTS, 1, finish_reason)
        self._inc(m.PROMPT_TOKENS_TOTAL, prompt_tokens)
        self._observe(m.E2E_SECONDS, e2e_seconds)
        self._observe(m.PROMPT_TOKENS, prompt_tokens)
        self._observe(m.OUTPUT_TOKENS, output_tokens)
        self._observe(m.REQUEST_HANDOFFS, handoffs)
        if tpot_seconds is not None:
            self._observe(m.TPOT_SECONDS, tpot_seconds)
            self._observe(m.DECODE_SECONDS, tpot_seconds * (output_tokens - 1))
        elif output_tokens == 1:
            self._observe(m.DECODE_SECONDS, 0.0)

    # ------------------------------------------------------------- live quality
    def quality_scored(
        self, policy: str, point: str, positions: int, agreeing: int, gap: float, seconds: float
    ) -> None:
        """One answer scored by the top model (tokenrouter_ray/quality/live.py)."""
        labels = (policy, point)
        self._inc(m.QUALITY_ANSWERS, 1, *labels)
        self._inc(m.QUALITY_AGREEING_ANSWERS, int(agreeing == positions), *labels)
        self._inc(m.QUALITY_POSITIONS, positions, *labels)
        self._inc(m.QUALITY_AGREEING_POSITIONS, agreeing, *labels)
        self._observe(m.QUALITY_LOGPROB_GAP, gap, *labels)
        self._observe(m.QUALITY_SCORE_SECONDS, seconds)

    def quality_skipped(self, reason: str) -> None:
        self._inc(m.QUALITY_SKIPPED, 1, reason)

    # -------------------------------------------------------------------- tuner
    def tuner_decision(
        self, decision: TunerDecision, profile: RoutingProfile | None, tuned: list[int]
    ) -> None:
        """One tuner period: its outcome, published thresholds, predictions, estimates."""
        if decision.changed:
            outcome = "moved"
        elif decision.solved:
            outcome = "kept"
        else:
            outcome = "steady" if profile is not None else "waiting"
        self._inc(m.TUNER_DECISIONS, 1, outcome)
        for model, table in decision.thresholds.items():
            for n in tuned:
                self._set(m.TUNER_THRESHOLD, table[n], model, str(n))
        if decision.solved:
            for n, scores in decision.predicted.items():
                label = ",".join(f"{k}={decision.thresholds[k][n]}" for k in decision.thresholds)
                if label in scores:
                    self._set(m.TUNER_PREDICTED, scores[label], str(n))
        self._set(m.TUNER_MAX_CONCURRENCY, decision.max_concurrency or 0)
        if profile is not None:
            for i, src in enumerate(profile.names):
                for j, dst in enumerate(profile.names):
                    self._set(m.TUNER_ROUTE_PROB, profile.route_prob[i][j], src, dst)
