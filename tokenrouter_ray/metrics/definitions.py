"""Every metric tokenrouter-ray exports, in one list: the single source of truth for both
backends (prometheus-client and Ray) and for the Grafana dashboards.

A ``MetricDef`` is a name, a kind, a help text, its label names and (histograms) its bucket
boundaries. Names follow Prometheus conventions: base units (``_seconds``), ``_total`` on
counters. Where vLLM exports a metric with the same meaning, ours has vLLM's name after the
``tokenrouter_`` prefix (``kv_cache_usage_perc``, ``inter_token_latency_seconds``,
``request_queue_time_seconds``, ``prompt_tokens_total``, ``prefix_cache_hits_total``,
``request_success_total`` with ``finished_reason``, ...), so queries written for vLLM carry
over by swapping the prefix. The routing counters are modelled on vLLM's speculative-decoding
counters (``spec_decode_num_drafts``, ``_num_draft_tokens``, ``_num_accepted_tokens``): plain
event and token counts whose ratios are the rates a dashboard shows.

Every metric carries ``model_name`` (the served model name clients ask for, vLLM's label),
last in its label order, so several apps can share one Prometheus. Labels are
low-cardinality only: model names, policy name, finish reason, error type; never request ids.

``exported_names(prefix)`` is what a scraper sees: Ray's metrics agent puts ``ray_`` in
front of every application metric; histograms appear as ``_bucket``/``_sum``/``_count``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["counter", "gauge", "histogram"]

RAY_PREFIX = "ray_"  # what Ray's metrics agent prepends on its Prometheus endpoint
MODEL_NAME = "model_name"  # on every metric: the served model name (AppConfig.served_model_name)

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
    labels: tuple[str, ...] = ()  # model_name is always the last one
    buckets: tuple[float, ...] = ()

    def exported(self, prefix: str = "") -> tuple[str, ...]:
        """The series names a scrape shows for this metric."""
        name = prefix + self.name
        if self.kind == "histogram":
            return (f"{name}_bucket", f"{name}_sum", f"{name}_count")
        return (name,)


def _counter(name: str, help: str, *labels: str) -> MetricDef:
    assert name.endswith("_total"), name
    return MetricDef(name, "counter", help, (*labels, MODEL_NAME))


def _gauge(name: str, help: str, *labels: str) -> MetricDef:
    return MetricDef(name, "gauge", help, (*labels, MODEL_NAME))


def _histogram(name: str, help: str, buckets: tuple[float, ...], *labels: str) -> MetricDef:
    return MetricDef(
        name, "histogram", help, (*labels, MODEL_NAME), tuple(float(b) for b in buckets)
    )


# ------------------------------------------------ routing (vLLM's spec_decode_* counters)
HANDOFFS = _counter(
    "tokenrouter_routing_num_handoffs_total",
    "Handoffs sent from one model to another (as vLLM's spec_decode_num_drafts).",
    "src_model",
    "dst_model",
    "policy",
)
COMMITTED_TOKENS = _counter(
    "tokenrouter_routing_num_committed_tokens_total",
    "Output tokens committed, by the model that produced them (routing fraction rho; as "
    "vLLM's spec_decode_num_accepted_tokens).",
    "model",
    "policy",
)
DROPPED_TOKENS = _counter(
    "tokenrouter_routing_num_dropped_tokens_total",
    "Sampled tokens the policy dropped at a handoff for the receiver to regenerate (R2R: "
    "the small model's token at the routed position; as a rejected draft token).",
    "model",
    "policy",
)
HANDOFF_TOKENS = _histogram(
    "tokenrouter_routing_handoff_tokens",
    "Tokens a handoff carried (the suffix the receiver had not seen).",
    COUNT_BUCKETS,
    "src_model",
    "dst_model",
)
ROUTE_SECONDS = _histogram(
    "tokenrouter_routing_decision_seconds",
    "Time in the routing policy's route() for one step's batch.",
    FAST_BUCKETS,
    "model",
    "policy",
)

# ------------------------------------------------------------------ model replicas
BATCH_SIZE = _histogram(
    "tokenrouter_batch_size", "Requests in one forward step.", BATCH_BUCKETS, "model"
)
STEP_SECONDS = _histogram(
    "tokenrouter_step_seconds",
    "One step's time, each phase once: schedule, prepare, forward (on a GPU the device time "
    "of forward and sampler), sample (the read-back), commit.",
    LATENCY_BUCKETS,
    "model",
)
QUEUE_SECONDS = _histogram(
    "tokenrouter_request_queue_time_seconds",
    "A request's arrival on a model to the start of the step that sampled its first output "
    "token there (vLLM's WAITING phase; deferred launch included).",
    LATENCY_BUCKETS,
    "model",
)
PREFILL_SECONDS = _histogram(
    "tokenrouter_request_prefill_time_seconds",
    "The step that sampled a request's first output token (vLLM's PREFILL phase).",
    LATENCY_BUCKETS,
    "model",
)
DEFERRED_WAIT_SECONDS = _histogram(
    "tokenrouter_deferred_wait_seconds",
    "How long a launch was held back by the batch threshold before the step ran.",
    FAST_BUCKETS,
    "model",
)
DEFERRED_TIMEOUTS = _counter(
    "tokenrouter_deferred_timeouts_total",
    "Launches below the threshold forced by max_defer_s (the safety net fired).",
    "model",
)
PEER_LATENCY_SECONDS = _histogram(
    "tokenrouter_peer_latency_seconds",
    "One-way latency of a PeerReq frame (receiver wall clock minus sender's sent_at).",
    FAST_BUCKETS,
    "model",
)
REQUESTS_WAITING = _gauge(
    "tokenrouter_num_requests_waiting", "Requests queued for a step (prefill or extend).", "model"
)
REQUESTS_RUNNING = _gauge(
    "tokenrouter_num_requests_running", "Requests in the running batch.", "model"
)
REQUESTS_PENDING = _gauge(
    "tokenrouter_num_requests_pending", "Requests handed to another model, KV kept here.", "model"
)
BATCH_THRESHOLD = _gauge(
    "tokenrouter_batch_threshold", "Current deferred-launch threshold B of the model.", "model"
)
ACTIVE_REQUESTS = _gauge(
    "tokenrouter_active_requests",
    "Global active-request count N as this model last heard it (indexes the thresholds).",
    "model",
)
KV_USAGE = _gauge(
    "tokenrouter_kv_cache_usage_perc",
    "Fraction of KV-cache blocks in use (0 to 1).",
    "model",
)
KV_BLOCKS_USED = _gauge("tokenrouter_kv_blocks_used", "KV-cache blocks in use.", "model")
KV_BLOCKS_TOTAL = _gauge("tokenrouter_kv_blocks_total", "KV-cache blocks in the pool.", "model")
PREEMPTIONS = _counter(
    "tokenrouter_num_preemptions_total",
    "Requests preempted (KV freed, recomputed later).",
    "model",
)
PREFIX_CACHE_QUERIES = _counter(
    "tokenrouter_prefix_cache_queries_total",
    "Prompt tokens looked up in the prefix cache (a request's first computation on a model: "
    "its prompt, a handoff's first visit, a recompute).",
    "model",
)
PREFIX_CACHE_HITS = _counter(
    "tokenrouter_prefix_cache_hits_total",
    "Of the tokens looked up in the prefix cache, those whose KV was found cached.",
    "model",
)
GENERATION_TOKENS = _counter(
    "tokenrouter_generation_tokens_total", "Output tokens committed, all models together."
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
    "tokenrouter_request_success_total",
    "Requests (choices) ended, by finish reason (as vLLM's, errors and aborts included).",
    "finished_reason",
)
PROMPT_TOKENS_TOTAL = _counter(
    "tokenrouter_prompt_tokens_total", "Prompt tokens of the requests ended."
)
REQUESTS_MOVED = _counter(
    "tokenrouter_requests_moved_total",
    "Requests re-created on another replica of their model from their committed tokens, by "
    "reason: drain (the replica left on purpose: scale-down, rolling update), lost (it "
    "died, or a handoff found it gone).",
    "reason",
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
    "tokenrouter_request_time_per_output_token_seconds",
    "Per request: (last token - first token) / (output tokens - 1).",
    (*FAST_BUCKETS, 2.5, 5.0, 10.0),
)
DECODE_SECONDS = _histogram(
    "tokenrouter_request_decode_time_seconds",
    "Per request: first to last output token at the ingress (vLLM's DECODE phase).",
    (*LATENCY_BUCKETS, 120.0, 300.0),
)
E2E_SECONDS = _histogram(
    "tokenrouter_e2e_request_latency_seconds",
    "Submit to release of a request at the ingress.",
    (*LATENCY_BUCKETS, 120.0, 300.0),
)
OUTPUT_TOKENS = _histogram(
    "tokenrouter_request_generation_tokens", "Output tokens per request.", COUNT_BUCKETS
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

# ------------------------------------------------------------- live quality
# A sample of finished answers, scored by the top model by teacher forcing
# (tokenrouter_ray/quality/live.py). ``point``: where the answer was routed
# (``default``, a preset's name, ``custom``, or ``alone:<model>``).
QUALITY_ANSWERS = _counter(
    "tokenrouter_quality_scored_answers_total",
    "Finished answers the top model scored by teacher forcing.",
    "policy",
    "point",
)
QUALITY_AGREEING_ANSWERS = _counter(
    "tokenrouter_quality_agreeing_answers_total",
    "Scored answers the top model agrees with at every position (under greedy decoding: "
    "the answer it would have written alone).",
    "policy",
    "point",
)
QUALITY_POSITIONS = _counter(
    "tokenrouter_quality_scored_positions_total",
    "Output positions scored.",
    "policy",
    "point",
)
QUALITY_AGREEING_POSITIONS = _counter(
    "tokenrouter_quality_agreeing_positions_total",
    "Scored positions where the top model's greedy token is the committed one.",
    "policy",
    "point",
)
QUALITY_LOGPROB_GAP = _histogram(
    "tokenrouter_quality_logprob_gap",
    "Per scored answer: mean over its positions of the top model's log-probability of its "
    "own greedy token minus that of the committed token (0: it agrees everywhere).",
    (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0),
    "policy",
    "point",
)
QUALITY_SKIPPED = _counter(
    "tokenrouter_quality_skipped_total",
    "Sampled answers not scored, by reason: budget (the top replica's scoring share is "
    "spent), queue_full, unsupported, failed.",
    "reason",
)
QUALITY_SCORE_SECONDS = _histogram(
    "tokenrouter_quality_score_seconds",
    "Time one teacher-forced scoring took on the top model's replica.",
    LATENCY_BUCKETS,
)

DEFINITIONS: tuple[MetricDef, ...] = (
    HANDOFFS,
    COMMITTED_TOKENS,
    DROPPED_TOKENS,
    HANDOFF_TOKENS,
    ROUTE_SECONDS,
    BATCH_SIZE,
    STEP_SECONDS,
    QUEUE_SECONDS,
    PREFILL_SECONDS,
    DEFERRED_WAIT_SECONDS,
    DEFERRED_TIMEOUTS,
    PEER_LATENCY_SECONDS,
    REQUESTS_WAITING,
    REQUESTS_RUNNING,
    REQUESTS_PENDING,
    BATCH_THRESHOLD,
    ACTIVE_REQUESTS,
    KV_USAGE,
    KV_BLOCKS_USED,
    KV_BLOCKS_TOTAL,
    PREEMPTIONS,
    PREFIX_CACHE_QUERIES,
    PREFIX_CACHE_HITS,
    GENERATION_TOKENS,
    ERRORS,
    PEER_REJECTED,
    REQUESTS,
    PROMPT_TOKENS_TOTAL,
    REQUESTS_MOVED,
    INGRESS_ACTIVE_REQUESTS,
    TTFT_SECONDS,
    INTER_TOKEN_SECONDS,
    TPOT_SECONDS,
    DECODE_SECONDS,
    E2E_SECONDS,
    OUTPUT_TOKENS,
    PROMPT_TOKENS,
    REQUEST_HANDOFFS,
    TUNER_THRESHOLD,
    TUNER_PREDICTED,
    TUNER_ROUTE_PROB,
    TUNER_DECISIONS,
    TUNER_MAX_CONCURRENCY,
    QUALITY_ANSWERS,
    QUALITY_AGREEING_ANSWERS,
    QUALITY_POSITIONS,
    QUALITY_AGREEING_POSITIONS,
    QUALITY_LOGPROB_GAP,
    QUALITY_SKIPPED,
    QUALITY_SCORE_SECONDS,
)
BY_NAME: dict[str, MetricDef] = {d.name: d for d in DEFINITIONS}
assert len(BY_NAME) == len(DEFINITIONS), "duplicate metric name"


def exported_names(prefix: str = RAY_PREFIX) -> set[str]:
    """Every series name a scrape can show (``prefix`` as the exporter adds it)."""
    return {name for d in DEFINITIONS for name in d.exported(prefix)}
