"""Every metric tokenrouter-ray exports, in one list: the single source of truth for both
backends (prometheus-client and Ray) and for the Grafana dashboards.

A ``MetricDef`` is a name, a kind, a help text, its label names and (histograms) its bucket
boundaries. Names follow Prometheus conventions: base units (``_seconds``), ``_total`` on
counters. Labels are low-cardinality only: model names, policy name, finish reason, error
type; never request ids.

``exported_names(prefix)`` is what a scraper sees: Ray's metrics agent puts ``ray_`` in
front of every application metric; histograms appear as ``_bucket``/``_sum``/``_count``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["counter", "gauge", "histogram"]

RAY_PREFIX = "ray_"  # what Ray's metrics agent prepends on its Prometheus endpoint

# Bucket presets. Ray rejects a boundary <= 0, so none starts at zero.
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
FAST_BUCKETS = (
    0.00001,
    0.000025,
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    1.0,
)  # routing decisions, peer messages, deferred waits: microseconds to ms
COUNT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 512)


@dataclass(frozen=True)
class MetricDef:
    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()

    def exported(self, prefix: str = "") -> tuple[str, ...]:
        """The series names a scrape shows for this metric."""
        name = prefix + self.name
        if self.kind == "histogram":
            return (f"{name}_bucket", f"{name}_sum", f"{name}_count")
        return (name,)


def _counter(name: str, help: str, *labels: str) -> MetricDef:
    assert name.endswith("_total"), name
    return MetricDef(name, "counter", help, labels)


def _gauge(name: str, help: str, *labels: str) -> MetricDef:
    return MetricDef(name, "gauge", help, labels)


def _histogram(name: str, help: str, buckets: tuple[float, ...], *labels: str) -> MetricDef:
    return MetricDef(name, "histogram", help, labels, tuple(float(b) for b in buckets))


# ------------------------------------------------------------------ model sub-servers
HANDOFFS = _counter(
    "tokenrouter_handoffs_total",
    "Handoffs sent from one model to another.",
    "src_model",
    "dst_model",
    "policy",
)
COMMITTED_TOKENS = _counter(
    "tokenrouter_committed_tokens_total",
    "Output tokens committed, by the model that produced them (routing fraction rho).",
    "model",
    "policy",
)
HANDOFF_TOKENS = _histogram(
    "tokenrouter_handoff_tokens",
    "Tokens a handoff carried (the suffix the receiver had not seen).",
    COUNT_BUCKETS,
    "src_model",
    "dst_model",
)
BATCH_SIZE = _histogram(
    "tokenrouter_batch_size", "Requests in one forward step.", BATCH_BUCKETS, "model"
)
STEP_SECONDS = _histogram(
    "tokenrouter_step_seconds",
    "Host time of one step (schedule, prepare, forward, sample; commit excluded).",
    LATENCY_BUCKETS,
    "model",
)
ROUTE_SECONDS = _histogram(
    "tokenrouter_route_seconds",
    "Time in the routing policy's route() for one step's batch.",
    FAST_BUCKETS,
    "model",
    "policy",
)
DEFERRED_WAIT_SECONDS = _histogram(
    "tokenrouter_deferred_wait_seconds",
    "How long a launch was held back by the batch threshold before the step ran.",
    FAST_BUCKETS,
    "model",
)
PEER_LATENCY_SECONDS = _histogram(
    "tokenrouter_peer_latency_seconds",
    "One-way latency of a PeerReq frame (receiver wall clock minus sender's sent_at).",
    FAST_BUCKETS,
    "model",
)
REQUESTS_WAITING = _gauge(
    "tokenrouter_requests_waiting", "Requests queued for a step (prefill or extend).", "model"
)
REQUESTS_RUNNING = _gauge("tokenrouter_requests_running", "Requests in the running batch.", "model")
REQUESTS_PENDING = _gauge(
    "tokenrouter_requests_pending", "Requests handed to another model, KV kept here.", "model"
)
BATCH_THRESHOLD = _gauge(
    "tokenrouter_batch_threshold", "Current deferred-launch threshold B of the model.", "model"
)
ACTIVE_REQUESTS = _gauge(
    "tokenrouter_active_requests",
    "Global active-request count N as this model last heard it (indexes the thresholds).",
    "model",
)
KV_BLOCKS_USED = _gauge("tokenrouter_kv_blocks_used", "KV-cache blocks in use.", "model")
KV_BLOCKS_TOTAL = _gauge("tokenrouter_kv_blocks_total", "KV-cache blocks in the pool.", "model")
PREEMPTIONS = _counter(
    "tokenrouter_preemptions_total", "Requests preempted (KV freed, recomputed later).", "model"
)
ERRORS = _counter(
    "tokenrouter_errors_total",
    "Errors by where (a model name or 'ingress') and type.",
    "model",
    "type",
)
PEER_REJECTED = _counter(
    "tokenrouter_peer_rejected_total",
    "Peer-channel frames dropped before decoding: malformed, bad_mac (forged or wrong "
    "key), replay (duplicate or replayed counter).",
    "model",
    "reason",
)

# ------------------------------------------------------------------------ ingress
REQUESTS = _counter(
    "tokenrouter_requests_total", "Requests (choices) ended, by finish reason.", "finish_reason"
)
INGRESS_ACTIVE_REQUESTS = _gauge(
    "tokenrouter_ingress_active_requests", "Requests the ingress holds right now."
)
TTFT_SECONDS = _histogram(
    "tokenrouter_time_to_first_token_seconds",
    "Submit to the first committed output token at the ingress.",
    LATENCY_BUCKETS,
)
INTER_TOKEN_SECONDS = _histogram(
    "tokenrouter_inter_token_latency_seconds",
    "Gap between consecutive commits reaching the ingress, per token of the chunk.",
    (*FAST_BUCKETS, 2.5, 5.0, 10.0),
)
TPOT_SECONDS = _histogram(
    "tokenrouter_time_per_output_token_seconds",
    "Per request: (last token - first token) / (output tokens - 1).",
    (*FAST_BUCKETS, 2.5, 5.0, 10.0),
)
E2E_SECONDS = _histogram(
    "tokenrouter_e2e_request_latency_seconds",
    "Submit to release of a request at the ingress.",
    (*LATENCY_BUCKETS, 120.0, 300.0),
)
OUTPUT_TOKENS = _histogram(
    "tokenrouter_request_output_tokens", "Output tokens per request.", COUNT_BUCKETS
)
PROMPT_TOKENS = _histogram(
    "tokenrouter_request_prompt_tokens", "Prompt tokens per request.", COUNT_BUCKETS
)
REQUEST_HANDOFFS = _histogram(
    "tokenrouter_request_handoffs",
    "Handoffs per request.",
    (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
)

# -------------------------------------------------------------------------- tuner
TUNER_THRESHOLD = _gauge(
    "tokenrouter_tuner_threshold",
    "Threshold B the tuner publishes for a model at a tuned active-request count N.",
    "model",
    "active_requests",
)
TUNER_PREDICTED = _gauge(
    "tokenrouter_tuner_predicted_tokens_per_second",
    "Throughput the Markov model predicts for the published thresholds at N.",
    "active_requests",
)
TUNER_ROUTE_PROB = _gauge(
    "tokenrouter_tuner_route_probability",
    "p(src -> dst) the tuner last solved with (window estimate).",
    "src_model",
    "dst_model",
)
TUNER_DECISIONS = _counter(
    "tokenrouter_tuner_decisions_total",
    "Tuner periods by outcome: moved, kept (solved, no gain), steady (no drift), waiting.",
    "outcome",
)
TUNER_MAX_CONCURRENCY = _gauge(
    "tokenrouter_tuner_max_concurrency",
    "SLO mode: active requests the tuner admits (0 without an SLO).",
)

DEFINITIONS: tuple[MetricDef, ...] = (
    HANDOFFS,
    COMMITTED_TOKENS,
    HANDOFF_TOKENS,
    BATCH_SIZE,
    STEP_SECONDS,
    ROUTE_SECONDS,
    DEFERRED_WAIT_SECONDS,
    PEER_LATENCY_SECONDS,
    REQUESTS_WAITING,
    REQUESTS_RUNNING,
    REQUESTS_PENDING,
    BATCH_THRESHOLD,
    ACTIVE_REQUESTS,
    KV_BLOCKS_USED,
    KV_BLOCKS_TOTAL,
    PREEMPTIONS,
    ERRORS,
    PEER_REJECTED,
    REQUESTS,
    INGRESS_ACTIVE_REQUESTS,
    TTFT_SECONDS,
    INTER_TOKEN_SECONDS,
    TPOT_SECONDS,
    E2E_SECONDS,
    OUTPUT_TOKENS,
    PROMPT_TOKENS,
    REQUEST_HANDOFFS,
    TUNER_THRESHOLD,
    TUNER_PREDICTED,
    TUNER_ROUTE_PROB,
    TUNER_DECISIONS,
    TUNER_MAX_CONCURRENCY,
)
BY_NAME: dict[str, MetricDef] = {d.name: d for d in DEFINITIONS}
assert len(BY_NAME) == len(DEFINITIONS), "duplicate metric name"


def exported_names(prefix: str = RAY_PREFIX) -> set[str]:
    """Every series name a scrape can show (``prefix`` as the exporter adds it)."""
    return {name for d in DEFINITIONS for name in d.exported(prefix)}
