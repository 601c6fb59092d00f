"""The three Grafana dashboards: overview (traffic, latency, errors), routing (who hands off
to whom, routing fractions, handoff sizes) and scheduler (batches, queues, deferred launch,
KV). Each ``build(prefix)`` returns the dashboard JSON as a dict; ``prefix`` is the metric
name prefix of the exporter (``ray_`` for the Ray Serve deployments). Every query filters on
``$model_name`` (one served app); the scheduler board also on ``$model``.
"""

from __future__ import annotations

from typing import Any

from tokenrouter_ray.dashboards.panels import (
    Promql,
    dashboard,
    label_variable,
    matrix,
    model_name_variable,
    quantiles,
    row,
    stat,
    target,
    timeseries,
)

PAIR = ("src_model", "dst_model")
PAIR_LEGEND = "{{src_model}} → {{dst_model}}"
APP = 'model_name="$model_name"'


def overview(prefix: str) -> dict[str, Any]:
    q = Promql(prefix, selector=APP)
    reqs, toks = "tokenrouter_request_success_total", "tokenrouter_generation_tokens_total"
    by_model = "tokenrouter_routing_num_committed_tokens_total"
    errors = "tokenrouter_errors_total"
    return dashboard(
        "tokenrouter-overview",
        "tokenrouter-ray / Overview",
        "Request rate, token throughput, latency (TTFT, ITL, TPOT, request phases, end to "
        "end) and errors.",
        [
            row("Traffic"),
            stat("Requests / s", q.rate(reqs), "reqps", "Requests (choices) ending per second."),
            stat("Output tokens / s", q.rate(toks), "short", "Committed tokens, all models."),
            stat("Active requests", q.value("tokenrouter_ingress_active_requests"), "short"),
            stat("Errors / s", q.rate(errors), "short", "Errors anywhere (models, ingress)."),
            timeseries(
                "Requests by finish reason",
                [target(q.rate(reqs, ["finished_reason"]), "{{finished_reason}}")],
                "reqps",
                stack=True,
            ),
            timeseries(
                "Tokens / s",
                [
                    target(q.rate("tokenrouter_prompt_tokens_total"), "prompt"),
                    target(q.rate(toks), "generation"),
                ],
                "short",
                "Prompt tokens of the requests ended; output tokens as they are committed.",
            ),
            timeseries(
                "Output tokens / s by model",
                [target(q.rate(by_model, ["model"]), "{{model}}")],
                "short",
                "Committed tokens per second, by the model that produced them.",
                stack=True,
            ),
            row("Latency"),
            timeseries(
                "Time to first token",
                quantiles(q, "tokenrouter_time_to_first_token_seconds"),
                "s",
                "Submit to the first committed token, at the ingress.",
            ),
            timeseries(
                "Time per output token",
                quantiles(q, "tokenrouter_request_time_per_output_token_seconds"),
                "s",
                "Per request: (last token - first token) / (tokens - 1).",
            ),
            timeseries(
                "Inter-token latency",
                quantiles(q, "tokenrouter_inter_token_latency_seconds"),
                "s",
                "Gap between consecutive commits at the ingress, per token.",
            ),
            timeseries(
                "End-to-end latency",
                quantiles(q, "tokenrouter_e2e_request_latency_seconds"),
                "s",
            ),
            timeseries(
                "Request phases",
                [
                    *quantiles(q, "tokenrouter_request_queue_time_seconds", legend="queue"),
                    *quantiles(q, "tokenrouter_request_prefill_time_seconds", legend="prefill"),
                    *quantiles(q, "tokenrouter_request_decode_time_seconds", legend="decode"),
                ],
                "s",
                "Queue: arrival at the entry model to the start of the step that sampled the "
                "first token; prefill: that step; decode: first to last token at the ingress.",
            ),
            timeseries(
                "Tokens per request",
                [
                    target(q.mean("tokenrouter_request_generation_tokens"), "output (mean)"),
                    target(q.mean("tokenrouter_request_prompt_tokens"), "prompt (mean)"),
                    *quantiles(q, "tokenrouter_request_generation_tokens", legend="output"),
                ],
                "short",
            ),
            timeseries(
                "Errors / s by type",
                [
                    target(q.rate(errors, ["model", "type"]), "{{model}}: {{type}}"),
                    target(
                        q.rate("tokenrouter_peer_rejected_total", ["model", "reason"]),
                        "{{model}}: peer frame rejected ({{reason}})",
                    ),
                    target(
                        q.rate("tokenrouter_requests_moved_total", ["reason"]),
                        "requests moved off a replica ({{reason}})",
                    ),
                ],
                "short",
                "Model errors (step_failed, bad_message) and ingress errors "
                "(<OpenAI type>_<HTTP status>, request_failed, protocol_error); peer-channel "
                "frames rejected by authentication; requests re-created on another replica "
                "(drain: scale-down or update; lost).",
                width=24,
            ),
        ],
        variables=[model_name_variable(prefix)],
    )


def _as(label: str, source: str, expr: str) -> str:
    """``expr`` with ``source``'s values copied into ``label`` (to join on it)."""
    return f'label_replace({expr}, "{label}", "$1", "{source}", "(.*)")'


POINT = ["point"]  # live quality: the operating point an answer was routed at


def routing(prefix: str) -> dict[str, Any]:
    q = Promql(prefix, selector=APP)
    handoffs = "tokenrouter_routing_num_handoffs_total"
    toks = "tokenrouter_routing_num_committed_tokens_total"
    dropped = "tokenrouter_routing_num_dropped_tokens_total"
    per_model_commits = q.rate(toks, ["model"])
    per_model_dropped = q.rate(dropped, ["model"])
    answers = "tokenrouter_quality_scored_answers_total"
    agree_ans = "tokenrouter_quality_agreeing_answers_total"
    positions = "tokenrouter_quality_scored_positions_total"
    agree_pos = "tokenrouter_quality_agreeing_positions_total"
    gap = "tokenrouter_quality_logprob_gap"

    def agreement(agreeing: str, scored: str) -> str:
        """agreeing / scored over 5 minutes; 0 (not "no data") where none agreed (a counter
        that was never incremented has no series)."""
        total = q.rate(scored, POINT, window="5m")
        return f"({q.rate(agreeing, POINT, window='5m')} or {total} * 0) / {total}"

    return dashboard(
        "tokenrouter-routing",
        "tokenrouter-ray / Routing",
        "Token-level routing: handoffs between models, routing fractions, dropped tokens, "
        "handoff sizes and the cost of deciding.",
        [
            row("Handoffs"),
            matrix(
                "Handoff rate matrix (src → dst), over the time range",
                q.rate(handoffs, PAIR, window="$__range"),
                "src_model",
                "dst_model",
                "short",
                "Handoffs per second from the row's model to the column's model.",
            ),
            timeseries(
                "Handoffs / s",
                [target(q.rate(handoffs, PAIR), PAIR_LEGEND)],
                "short",
            ),
            timeseries(
                "Handoff probability per committed token (≈ p_ij)",
                [
                    target(
                        f"{q.rate(handoffs, PAIR)} / on (src_model) group_left "
                        f"{_as('src_model', 'model', per_model_commits)}",
                        PAIR_LEGEND,
                    )
                ],
                "percentunit",
                "Handoffs i → j divided by tokens committed on i: the p_ij of the "
                "throughput model (docs/user-guide/tuning.md).",
            ),
            timeseries(
                "Routing fraction ρ by model",
                [
                    target(
                        f"{per_model_commits} / ignoring (model) group_left {q.rate(toks)}",
                        "{{model}}",
                    )
                ],
                "percentunit",
                "Share of committed tokens each model produced.",
                stack=True,
                max_value=1,
            ),
            row("Runs and dropped tokens"),
            timeseries(
                "Tokens per visit",
                [
                    target(
                        f"{per_model_commits} / on (model) "
                        f"{_as('model', 'src_model', q.rate(handoffs, ['src_model']))}",
                        "{{model}}",
                    )
                ],
                "short",
                "Tokens a model commits per handoff it sends: the mean run length before "
                "control moves on (as vLLM's mean acceptance length from its spec_decode "
                "counters).",
            ),
            timeseries(
                "Dropped-token fraction",
                [
                    target(
                        f"{per_model_dropped} / on (model) "
                        f"({per_model_dropped} + {per_model_commits})",
                        "{{model}}",
                    )
                ],
                "percentunit",
                "Sampled tokens the policy dropped at a handoff for the receiver to "
                "regenerate, over all tokens the model sampled (as 1 - acceptance rate).",
                max_value=1,
            ),
            row("Handoff sizes"),
            timeseries(
                "Tokens per handoff",
                [
                    target(
                        q.mean("tokenrouter_routing_handoff_tokens", PAIR), f"mean {PAIR_LEGEND}"
                    ),
                    *quantiles(q, "tokenrouter_routing_handoff_tokens", PAIR, PAIR_LEGEND),
                ],
                "short",
                "Suffix tokens a handoff carried (what the receiver had not seen).",
            ),
            timeseries(
                "Handoffs per request",
                [
                    target(q.mean("tokenrouter_request_handoffs"), "mean"),
                    *quantiles(q, "tokenrouter_request_handoffs"),
                ],
                "short",
            ),
            row("Live quality (a sample of answers scored by the top model)"),
            timeseries(
                "Agreement with the top model, by operating point",
                [
                    target(agreement(agree_pos, positions), "positions {{point}}"),
                    target(agreement(agree_ans, answers), "whole answers {{point}}"),
                ],
                "percentunit",
                "Of the sampled answers (quality_monitor.sample_rate): the share of positions "
                "where the top model's greedy token is the committed one, and the share of "
                "answers it agrees with everywhere (greedy: the answer it would have written "
                "alone), over 5 minutes.",
                max_value=1,
            ),
            timeseries(
                "Log-probability gap per answer",
                [
                    target(q.mean(gap, POINT), "mean {{point}}"),
                    *quantiles(q, gap, POINT, "{{point}}"),
                ],
                "short",
                "The top model's log-probability of its own greedy token minus that of the "
                "committed one, averaged over an answer's positions.",
            ),
            timeseries(
                "Scored and skipped answers / s",
                [
                    target(q.rate(answers, POINT), "scored {{point}}"),
                    target(
                        q.rate("tokenrouter_quality_skipped_total", ["reason"]),
                        "skipped: {{reason}}",
                    ),
                ],
                "short",
                "Skipped: the top replica's scoring share was spent (budget), too many in "
                "flight (queue_full), a tensor-parallel model (unsupported), or an error.",
            ),
            timeseries(
                "Scoring time on the top model",
                quantiles(q, "tokenrouter_quality_score_seconds"),
                "s",
                "One teacher-forced forward over prompt and answer, between two steps.",
            ),
            row("Routing overhead"),
            timeseries(
                "Routing decision time per step",
                quantiles(q, "tokenrouter_routing_decision_seconds", ["model"], "{{model}}"),
                "s",
                "Time in the policy's route() for one step's batch.",
            ),
            timeseries(
                "PeerReq one-way latency",
                quantiles(q, "tokenrouter_peer_latency_seconds", ["model"], "{{model}}"),
                "s",
                "Receiver's clock minus the sender's sent_at (cross-node: includes skew).",
            ),
        ],
        variables=[model_name_variable(prefix)],
    )


def scheduler(prefix: str) -> dict[str, Any]:
    q = Promql(prefix, selector=f'{APP}, model=~"$model"')
    t = Promql(prefix, selector=APP)  # tuner series without a model label
    model = ["model"]
    by_model = "{{model}}"
    queries = q.rate("tokenrouter_prefix_cache_queries_total", model)
    # Ray exports a counter from its first increment: a model with no hit yet reads 0.
    hits = f"({q.rate('tokenrouter_prefix_cache_hits_total', model)} or 0 * {queries})"
    return dashboard(
        "tokenrouter-scheduler",
        "tokenrouter-ray / Scheduler",
        "Per-model batching: batch sizes, queues, deferred launch, thresholds and KV cache.",
        [
            row("Batches"),
            timeseries(
                "Batch size",
                [
                    target(q.mean("tokenrouter_batch_size", model), f"mean {by_model}"),
                    *quantiles(q, "tokenrouter_batch_size", model, by_model),
                ],
                "short",
                "Requests per forward step.",
            ),
            timeseries(
                "Step time",
                quantiles(q, "tokenrouter_step_seconds", model, by_model),
                "s",
                "Host time of a step (schedule, prepare, forward, sample).",
            ),
            timeseries(
                "Steps / s",
                [target(q.rate("tokenrouter_batch_size", model, "_count"), by_model)],
                "short",
            ),
            timeseries(
                "Queue depth",
                [
                    target(
                        q.value("tokenrouter_num_requests_waiting", model), f"waiting {by_model}"
                    ),
                    target(
                        q.value("tokenrouter_num_requests_running", model), f"running {by_model}"
                    ),
                    target(
                        q.value("tokenrouter_num_requests_pending", model), f"pending {by_model}"
                    ),
                ],
                "short",
                "Waiting: queued for a step; running: in the batch; pending: handed to "
                "another model with KV kept here.",
            ),
            row("Deferred launch"),
            timeseries(
                "Deferred-launch wait",
                [
                    target(q.mean("tokenrouter_deferred_wait_seconds", model), f"mean {by_model}"),
                    *quantiles(q, "tokenrouter_deferred_wait_seconds", model, by_model),
                ],
                "s",
                "How long a step was held back by the threshold before it launched.",
            ),
            timeseries(
                "Deferred-launch timeouts / s",
                [target(q.rate("tokenrouter_deferred_timeouts_total", model), by_model)],
                "short",
                "Launches below B forced by max_defer_s: the safety net fired. Steady "
                "non-zero means N or B is off (docs/user-guide/tuning.md).",
            ),
            timeseries(
                "Threshold B vs active requests N",
                [
                    target(q.value("tokenrouter_batch_threshold", model, "max"), f"B {by_model}"),
                    target(q.value("tokenrouter_active_requests", model, "max"), f"N {by_model}"),
                ],
                "short",
                "B = batch_thresholds[min(N, len - 1)]; no deadlock while sum(B_i - 1) < N.",
            ),
            row("Threshold tuner"),
            timeseries(
                "Published thresholds",
                [
                    target(
                        q.value("tokenrouter_tuner_threshold", ["model", "active_requests"], "max"),
                        "B {{model}} at N={{active_requests}}",
                    )
                ],
                "short",
                "What the tuner deployment pushes to the replicas, per tuned N.",
            ),
            timeseries(
                "Predicted vs committed tokens / s",
                [
                    target(
                        t.value(
                            "tokenrouter_tuner_predicted_tokens_per_second",
                            ["active_requests"],
                            "max",
                        ),
                        "predicted at N={{active_requests}}",
                    ),
                    target(t.rate("tokenrouter_generation_tokens_total"), "committed"),
                ],
                "short",
                "The Markov model's throughput for the published B; compare at the current N.",
            ),
            timeseries(
                "Routing probabilities solved with",
                [
                    target(
                        t.value(
                            "tokenrouter_tuner_route_probability", ["src_model", "dst_model"], "max"
                        ),
                        "{{src_model}} -> {{dst_model}}",
                    )
                ],
                "percentunit",
                "p(src -> dst) over the tuner's statistics window.",
                max_value=1,
            ),
            timeseries(
                "Tuner decisions / s",
                [target(t.rate("tokenrouter_tuner_decisions_total", ["outcome"]), "{{outcome}}")],
                "short",
                "moved: thresholds changed; kept: re-solved, no gain; steady: no drift; "
                "waiting: too few observations.",
            ),
            stat(
                "SLO concurrency cap",
                t.value("tokenrouter_tuner_max_concurrency", (), "max"),
                "short",
                "Active requests the SLO admits (0: no SLO configured).",
            ),
            row("KV cache"),
            timeseries(
                "KV usage",
                [target(q.value("tokenrouter_kv_cache_usage_perc", model, "max"), by_model)],
                "percentunit",
                "Fraction of KV blocks in use (the busiest replica).",
                max_value=1,
            ),
            timeseries(
                "KV blocks",
                [
                    target(q.value("tokenrouter_kv_blocks_used", model), f"used {by_model}"),
                    target(q.value("tokenrouter_kv_blocks_total", model), f"total {by_model}"),
                ],
                "short",
            ),
            timeseries(
                "Prefix cache hit rate",
                [target(f"{hits} / {queries}", by_model)],
                "percentunit",
                "Of the prompt tokens looked up on a model (prompts, handoffs' first visits, "
                "recomputes), the fraction whose KV was cached (vLLM's prefix_cache_hits / "
                "prefix_cache_queries).",
                max_value=1,
            ),
            timeseries(
                "Prefix cache tokens / s",
                [
                    target(queries, f"queried {by_model}"),
                    target(hits, f"hit {by_model}"),
                ],
                "short",
                "Prompt tokens looked up in the prefix cache and those found (not prefilled).",
            ),
            timeseries(
                "Preemptions / s",
                [target(q.rate("tokenrouter_num_preemptions_total", model), by_model)],
                "short",
                "Requests whose KV was freed to make room (recomputed later).",
            ),
        ],
        variables=[
            model_name_variable(prefix),
            label_variable(
                "model", "model", Promql(prefix, APP).series("tokenrouter_batch_size", "_count")
            ),
        ],
    )


BOARDS = {"overview": overview, "routing": routing, "scheduler": scheduler}
