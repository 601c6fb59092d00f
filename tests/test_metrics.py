"""Metrics: a LocalRuntime run with bernoulli routing, recorded by the prometheus-client
backend into a fresh registry, counts exactly what happened; the Ray backend defines the
same names, labels and buckets (checked without starting Ray)."""

from __future__ import annotations

import asyncio
import random
import threading
from collections import Counter

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from deployments import ray_metrics as ray_layer
from deployments.ray_metrics import CounterSums, RayBackend, direct_record, ray_instrument_specs
from tests.engine.conftest import make_engine
from tests.tiny_models import save_chain_model
from tokenrouter_ray.local import LocalRuntime
from tokenrouter_ray.metrics import (
    DEFINITIONS,
    RAY_PREFIX,
    Metrics,
    PrometheusBackend,
    exported_names,
)
from tokenrouter_ray.metrics import definitions as defs
from tokenrouter_ray.protocol import SamplingSpec
from tokenrouter_ray.routing.policy import build_policy

TWO = ["small", "large"]
NUM_PROMPTS, MAX_TOKENS = 8, 24


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("metrics_pair")
    return {
        name: save_chain_model(root / name, layers, seed)
        for name, layers, seed in (("small", 1, 11), ("large", 2, 12))
    }


@pytest.fixture(scope="module")
def run(pair_dirs: dict[str, str]) -> dict:
    """One bernoulli run; the large model defers launches until 2-4 requests are runnable."""
    registry = CollectorRegistry()
    policy = build_policy("bernoulli", {"p": 0.35}, TWO)
    engines = [
        ("small", make_engine(pair_dirs["small"])),
        ("large", make_engine(pair_dirs["large"], batch_thresholds=[1, 2, 4], max_defer_s=0.003)),
    ]
    rng = random.Random(0)
    prompts = [[rng.randrange(128) for _ in range(rng.randint(1, 20))] for _ in range(NUM_PROMPTS)]
    metrics = Metrics(PrometheusBackend(registry), policy="bernoulli")

    async def go() -> dict:
        async with LocalRuntime(engines, policy, metrics=metrics) as runtime:
            spec = SamplingSpec(temperature=0.0, max_tokens=MAX_TOKENS, seed=7)
            completions = await asyncio.wait_for(runtime.complete_all(prompts, spec), 60)
            await runtime.wait_idle()
            return {
                "registry": registry,
                "completions": completions,
                "handoffs": runtime.handoffs,
                "num_blocks": {s.name: s.engine.kv.pool.num_blocks for s in runtime.model_replicas},
                "schedulers": {s.name: s.engine.scheduler for s in runtime.model_replicas},
            }

    return asyncio.run(go())


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    """A sample's value; ``model_name`` is the served name ("" in LocalRuntime tests)."""
    return registry.get_sample_value(name, {"model_name": "", **labels}) or 0.0


def test_counters_match_what_happened(run: dict) -> None:
    reg, completions, handoffs = run["registry"], run["completions"], run["handoffs"]
    assert all(c.error is None for c in completions)
    pairs = Counter((h.src, h.dst) for h in handoffs)
    assert sum(pairs.values()) >= 20  # routing really happened, both ways
    assert set(pairs) == {("small", "large"), ("large", "small")}
    for (src, dst), n in pairs.items():
        labels = {"src_model": src, "dst_model": dst}
        got = value(reg, "tokenrouter_routing_num_handoffs_total", **labels, policy="bernoulli")
        assert got == n
        assert value(reg, "tokenrouter_routing_handoff_tokens_count", **labels) == n
        tokens = sum(h.num_tokens for h in handoffs if (h.src, h.dst) == (src, dst))
        assert value(reg, "tokenrouter_routing_handoff_tokens_sum", **labels) == tokens

    for model in TWO:
        want = sum(c.counts.get(model, 0) for c in completions)
        assert want > 0
        labels = {"model": model, "policy": "bernoulli"}
        assert value(reg, "tokenrouter_routing_num_committed_tokens_total", **labels) == want
        # escalating drops the token just sampled (the larger model regenerates it); going
        # back keeps it: one dropped token per small -> large handoff, none on the large
        escalations = pairs[("small", "large")] if model == "small" else 0
        assert value(reg, "tokenrouter_routing_num_dropped_tokens_total", **labels) == escalations

    outputs = sum(len(c.token_ids) for c in completions)
    assert value(reg, "tokenrouter_generation_tokens_total") == outputs
    assert value(reg, "tokenrouter_request_success_total", finished_reason="length") == NUM_PROMPTS
    assert value(reg, "tokenrouter_request_generation_tokens_sum") == outputs
    prompts = value(reg, "tokenrouter_request_prompt_tokens_sum")
    assert prompts > 0 and value(reg, "tokenrouter_prompt_tokens_total") == prompts
    assert value(reg, "tokenrouter_request_handoffs_sum") == len(handoffs)
    assert value(reg, "tokenrouter_request_handoffs_sum") == sum(c.handoffs for c in completions)
    assert not [s for s in _samples(reg) if s.name.startswith("tokenrouter_errors")]


def test_histograms_and_gauges_have_observations(run: dict) -> None:
    reg = run["registry"]
    for model in TWO:
        assert value(reg, "tokenrouter_batch_size_count", model=model) > 0
        assert value(reg, "tokenrouter_step_seconds_count", model=model) > 0
        labels = {"model": model, "policy": "bernoulli"}
        assert value(reg, "tokenrouter_routing_decision_seconds_count", **labels) > 0
        assert value(reg, "tokenrouter_peer_latency_seconds_count", model=model) > 0
        # after the run every model is idle and its KV free
        assert value(reg, "tokenrouter_kv_blocks_total", model=model) == run["num_blocks"][model]
        for gauge in (
            "kv_blocks_used",
            "kv_cache_usage_perc",
            "num_requests_waiting",
            "num_requests_running",
            "num_requests_pending",
        ):
            assert value(reg, f"tokenrouter_{gauge}", model=model) == 0
    assert value(reg, "tokenrouter_peer_latency_seconds_count", model="ingress") > 0
    # the large model's threshold held launches back
    assert value(reg, "tokenrouter_deferred_wait_seconds_count", model="large") > 0
    for model, sched in run["schedulers"].items():
        assert value(reg, "tokenrouter_batch_threshold", model=model) == sched.threshold()
        got = value(reg, "tokenrouter_deferred_timeouts_total", model=model)
        assert got == sched.deferred_timeouts
        assert value(reg, "tokenrouter_num_preemptions_total", model=model) == (
            sched.num_preemptions
        )
    # the large model's 3 ms safety net fired as the last requests drained (N < B)
    assert run["schedulers"]["large"].deferred_timeouts > 0
    n = NUM_PROMPTS
    for name in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_time_per_output_token_seconds",
        "request_decode_time_seconds",
        "request_prompt_tokens",
    ):
        assert value(reg, f"tokenrouter_{name}_count") == n
    # A model observes queue and prefill time when it samples a request's first output
    # token: the entry model for every request, and the large model again for a request
    # whose first token the small one escalated (dropped, so nothing was committed yet).
    prompt_len = {c.request_id: c.prompt_len for c in run["completions"]}
    regenerated = {
        h.rid for h in run["handoffs"] if h.src == "small" and h.end == prompt_len[h.rid]
    }
    for name in ("request_queue_time_seconds", "request_prefill_time_seconds"):
        assert value(reg, f"tokenrouter_{name}_count", model="small") == n
        assert value(reg, f"tokenrouter_{name}_count", model="large") == len(regenerated)
    assert value(reg, "tokenrouter_inter_token_latency_seconds_count") > 0
    assert value(reg, "tokenrouter_ingress_active_requests") == 0


def _samples(registry: CollectorRegistry) -> list:
    return [s for family in registry.collect() for s in family.samples]


def test_scrape_names_are_the_definitions(run: dict) -> None:
    """Every series a prometheus-client scrape shows is an exported name (plus the
    `_created` timestamps prometheus-client adds)."""
    text = generate_latest(run["registry"]).decode()
    names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    names = {n for n in names if not n.endswith("_created")}
    assert names <= exported_names(prefix="")
    assert "tokenrouter_routing_num_handoffs_total" in names  # `_total` exactly once


def test_ray_backend_defines_the_same_metrics() -> None:
    """Built without ray.init: ray.util.metrics instruments only record once Ray runs."""
    backend = RayBackend()
    reg = CollectorRegistry()
    PrometheusBackend(reg)
    prom_types = {f.name: f.type for f in reg.collect()}
    specs = ray_instrument_specs()
    assert [s["name"] for s in specs] == [d.name for d in DEFINITIONS]
    for spec, d in zip(specs, DEFINITIONS, strict=True):
        if d.kind == "histogram":  # the gauges Prometheus reads a histogram from
            assert spec["boundaries"] == list(d.buckets)
            buckets, total, count = (g.info for g in backend.instruments[d.name])
            assert buckets["name"] == f"{d.name}_bucket"
            assert tuple(buckets["tag_keys"]) == (*d.labels, "le")
            assert (total["name"], count["name"]) == (f"{d.name}_sum", f"{d.name}_count")
            assert tuple(total["tag_keys"]) == tuple(count["tag_keys"]) == d.labels
        else:
            info = backend.instruments[d.name].info
            assert info["name"] == d.name and tuple(info["tag_keys"]) == d.labels
        # prometheus-client names a counter family without `_total`
        family = d.name.removesuffix("_total") if d.kind == "counter" else d.name
        assert prom_types[family] == d.kind
        assert set(d.labels) <= {
            "model",
            "src_model",
            "dst_model",
            "policy",
            "type",
            "finished_reason",  # vLLM's label name: stop, length, abort, error
            "model_name",  # the served model name, on every metric
            "active_requests",  # the tuner's tuned N: a handful of configured values
            "outcome",  # tuner decision outcome: 4 values
            "reason",  # peer frame rejections; live-quality skips: a few fixed values
            "point",  # live quality: default, custom, a configured preset, alone:<model>
        }


def test_counter_increments_from_two_threads_are_summed_exactly() -> None:
    """The step thread and the event loop add to the same counter: no increment is lost."""
    sums = CounterSums()
    key = ("c", ("small", ""))

    def add() -> None:
        for _ in range(20_000):
            sums.add(key, 1.0)

    threads = [threading.Thread(target=add) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sums.drain() == {key: 40_000.0}
    assert sums.drain() == {}


def test_ray_counters_reach_ray_once_per_flush_as_their_sum() -> None:
    """A counter's increments are handed to Ray's metric as one sum per flush; a flush with
    nothing new hands nothing."""
    backend = RayBackend(flush_s=3600.0)
    labels = ("small", "large", "r2r", "m")
    handed: list[float] = []
    backend._series[(defs.HANDOFFS.name, labels)] = handed.append  # Ray's side of the series
    for value in (1, 2, 0, 3):
        backend.inc(defs.HANDOFFS, value, labels)
    assert handed == []
    backend.flush()
    assert handed == [6.0]
    backend.flush()
    assert handed == [6.0]


class FakeGauge:
    """Ray's side of a gauge: every ``set`` kept in order as (tags, value)."""

    def __init__(self) -> None:
        self.sets: list[tuple[dict[str, str], float]] = []

    def set(self, value: float, tags: dict[str, str]) -> None:
        self.sets.append((dict(tags), value))

    def last(self) -> dict[tuple[tuple[str, str], ...], float]:
        return {tuple(sorted(tags.items())): value for tags, value in self.sets}


def fake_histogram_gauges(backend: RayBackend, metric: defs.MetricDef) -> tuple[FakeGauge, ...]:
    gauges = (FakeGauge(), FakeGauge(), FakeGauge())
    backend.instruments[metric.name] = gauges
    return gauges


def test_ray_histograms_export_what_prometheus_client_would(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Values observed from two threads at once reach the flush's aggregate each once, and
    the flush sets ``_bucket`` (per ``le``), ``_sum`` and ``_count`` to what a
    prometheus-client histogram with the same buckets shows for the same values (values on
    a bucket bound included: ``le`` is inclusive). Past ``HELD_VALUES_MAX`` held, a value
    goes into its series at once (a stalled flusher cannot grow the queue)."""
    import deployments.ray_metrics as ray_metrics_module

    metric, labels = defs.TTFT_SECONDS, ("m",)
    backend = RayBackend(flush_s=3600.0)
    backend._flusher = threading.current_thread()  # no flusher thread: this test flushes
    buckets, total, count = fake_histogram_gauges(backend, metric)
    bounds = list(metric.buckets)
    rng = random.Random(3)
    values = [rng.choice(bounds) if i % 5 == 0 else rng.uniform(0, 80) for i in range(20_000)]
    reg = CollectorRegistry()
    reference = Metrics(PrometheusBackend(reg))

    def observe(part: list[float]) -> None:
        for v in part:
            backend.observe(metric, v, labels)

    threads = [threading.Thread(target=observe, args=(values[k::2],)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for v in values:
        reference.first_token(v)
    assert buckets.sets == total.sets == count.sets == []  # nothing before the flush
    backend.flush()

    def expect(suffix: str, **extra: str) -> float:
        return reg.get_sample_value(f"{metric.name}{suffix}", {"model_name": "", **extra})

    got = buckets.last()
    assert len(got) == len(bounds) + 1
    for le in [*(str(b) for b in bounds), "+Inf"]:
        key = tuple(sorted({"model_name": "m", "le": le}.items()))
        want = expect("_bucket", le="+Inf" if le == "+Inf" else str(float(le)))
        assert got[key] == want, le
    assert count.sets == [({"model_name": "m"}, 20_000)] and expect("_count") == 20_000
    assert total.sets[-1][1] == pytest.approx(expect("_sum"), rel=1e-12)
    # a second flush sets the same values again (Ray's agent drops a gauge not set again)
    backend.flush()
    assert count.sets[-1][1] == 20_000 and buckets.last() == got
    monkeypatch.setattr(ray_metrics_module, "HELD_VALUES_MAX", 2)
    for v in (1.0, 2.0, 3.0):
        backend.observe(metric, v, labels)
    series = backend.histogram(metric, labels)
    assert series.count == 20_001  # the third, at once
    backend.flush()
    assert series.count == 20_003 and count.sets[-1][1] == 20_003


def test_a_series_merges_its_tags_once_and_refuses_a_missing_one() -> None:
    """`direct_record` checks the tags when the series is made, as Ray's call does on each
    value: a label missing from the instrument's keys fails there, not silently later."""
    from ray.util import metrics as ray_util_metrics

    histogram = ray_util_metrics.Histogram(
        "trr_test_seconds", "test", boundaries=[0.1, 1.0], tag_keys=("model", "zone")
    )
    histogram.set_default_tags({"zone": "z1"})
    direct_record(histogram, {"model": "small"}, "observe")(0.5)  # both tags present
    with pytest.raises(ValueError, match="model"):
        direct_record(histogram, {}, "observe")


def test_model_name_labels_every_metric(monkeypatch: pytest.MonkeyPatch) -> None:
    """model_name (vLLM's label) is last on every metric; a Serve replica's name, given once
    to ray_metrics(), labels its later ray_metrics() calls (the ingress's error handlers)."""
    assert all(d.labels[-1] == "model_name" for d in DEFINITIONS)
    reg = CollectorRegistry()
    Metrics(PrometheusBackend(reg), "r2r", model_name="app-a").error("ingress", "timeout")
    labels = {"model": "ingress", "type": "timeout", "model_name": "app-a"}
    assert reg.get_sample_value("tokenrouter_errors_total", labels) == 1
    monkeypatch.setitem(ray_layer._served_name, "model_name", "")
    assert ray_layer.ray_metrics(policy="r2r", model_name="app-b").model_name == "app-b"
    assert ray_layer.ray_metrics().model_name == "app-b"


def test_ray_agent_keeps_total_once() -> None:
    """Ray's agent exports a counter as a CounterMetricFamily named ray_<name>: a name that
    already ends in `_total` keeps exactly one `_total` on the scrape."""

    class Agent:
        def collect(self):  # what Ray's metrics agent hands prometheus-client
            family = CounterMetricFamily(
                RAY_PREFIX + "tokenrouter_routing_num_handoffs_total", "", labels=[]
            )
            family.add_metric([], 3)
            yield family

    reg = CollectorRegistry()
    reg.register(Agent())
    assert reg.get_sample_value("ray_tokenrouter_routing_num_handoffs_total") == 3
    assert "ray_tokenrouter_routing_num_handoffs_total" in exported_names()


def test_noop_metrics_accept_every_call() -> None:
    m = Metrics.noop()
    m.handoffs("a", "b", [3, 1])
    m.committed("a", 2)
    m.step("a", 4, 0.01, None)
    m.deferred_wait("a", 0.001)
    m.peer_message("a", 0)
    m.error("a", "step_failed")
    m.request_done("stop", 1.0, 3, 4, 1, 0.1)
