"""Dashboards proven live: the demo app (conf/local.yaml) on the shared test cluster, a little
traffic, a real Prometheus (Debian's `prometheus` package, on a loopback port) scraping Ray's
per-node metrics endpoints, and every PromQL expression of every dashboard panel evaluated
against it: each must return data. A renamed metric or label, a broken join or a Ray export
change can no longer empty a panel silently.

The app is the demo with settings that make every event a panel shows happen within seconds:
a KV cache of a few blocks on the small model (preemptions), a deferred-launch threshold on the
large one with a short safety net (deferred waits and timeouts), a tuner deciding every second,
one bad request (an ingress error) and one garbage frame at a model's peer socket (a rejected
frame).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from tests.net import free_port
from tokenrouter_ray.app_config import compose_config
from tokenrouter_ray.dashboards import render
from tokenrouter_ray.engine.memory_plan import footprint_from_checkpoint
from tokenrouter_ray.metrics.definitions import E2E_SECONDS

REPO = Path(__file__).resolve().parents[2]
APP = "metrics_live"
SERVED = "live-demo"
SCRAPE_S = 1
DEADLINE_S = 90  # after the traffic: Ray exports every few seconds, then two scrapes
SMALL_KV_BLOCKS, BLOCK = 6, 16
TOPICS = ["tides", "rainbows", "volcanoes", "magnets"]  # one streamed request each

pytestmark = pytest.mark.skipif(
    shutil.which("prometheus") is None or shutil.which("promtool") is None,
    reason="needs Debian's `prometheus` package (scripts/_env.sh installs it where apt-get "
    "is available): apt-get install -y prometheus",
)


def demo_overrides() -> list[str]:
    """conf/local.yaml's app, as `serve run conf/local.yaml` deploys it."""
    conf = yaml.safe_load((REPO / "conf" / "local.yaml").read_text())
    overrides = conf["applications"][0]["args"]["overrides"]
    # on the shared cluster, through its proxy: not the user's port 8000 (the direct port)
    return [o for o in overrides if not o.startswith("ingress.direct_port=")]


def small_kv_budget_gb() -> float:
    """Weights plus SMALL_KV_BLOCKS blocks of fp32 KV for the demo's small model."""
    small = compose_config(demo_overrides()).models["small"]
    fp = footprint_from_checkpoint(small.path, small.gguf_file, element_bytes=4)
    return (fp.weight_bytes + SMALL_KV_BLOCKS * BLOCK * fp.kv_bytes_per_token) / 2**30


def scrape_config(targets: list[str], interval_s: int) -> str:
    """A Prometheus config scraping Ray's metrics agents at ``targets`` (host:port)."""
    config = {
        "global": {"scrape_interval": f"{interval_s}s", "evaluation_interval": f"{interval_s}s"},
        "scrape_configs": [{"job_name": "ray", "static_configs": [{"targets": targets}]}],
    }
    return yaml.safe_dump(config, sort_keys=False)


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url

    def get(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=10) as reply:
            body = json.load(reply)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        return self.get("/api/v1/query", query=expr)["result"]

    def eventually(self, expr: str, want: Callable[[float], bool], timeout_s: float = 30) -> float:
        """The value of a one-series ``expr`` once ``want`` holds (the last one otherwise)."""
        deadline = time.monotonic() + timeout_s
        while True:
            result = self.query(expr)
            got = float(result[0]["value"][1]) if len(result) == 1 else float("nan")
            if want(got) or time.monotonic() > deadline:
                return got
            time.sleep(1)


@pytest.fixture(scope="module")
def prometheus(ray_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    """Prometheus on a loopback port, scraping every node's metrics agent of the test
    cluster (each node's `MetricsExportPort`; all nodes of the test cluster are local)."""
    import ray

    targets = [f"127.0.0.1:{n['MetricsExportPort']}" for n in ray.nodes() if n["Alive"]]
    root = tmp_path_factory.mktemp("prometheus")
    config = root / "prometheus.yml"
    config.write_text(scrape_config(targets, SCRAPE_S))
    check = subprocess.run(
        ["promtool", "check", "config", str(config)], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr
    port = free_port()
    log = (root / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={config}",
            f"--storage.tsdb.path={root / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    prom = Prometheus(f"http://127.0.0.1:{port}")
    try:
        for _ in range(100):
            try:
                urllib.request.urlopen(f"{prom.url}/-/ready", timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None, (root / "prometheus.log").read_text()
                time.sleep(0.1)
        yield prom
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()


def panel_queries() -> list[tuple[str, str, str]]:
    """(board, panel title, PromQL) for every target, with Grafana's variables filled in
    as a user would see them: this app's model name, every model, a 1 m rate window."""
    values = {
        "$model_name": SERVED,
        '"$model"': '".*"',
        "$__rate_interval": "1m",
        "$__range": "5m",
    }
    out = []
    for board, dash in render().items():
        for panel in dash["panels"]:
            for t in panel.get("targets", []):
                expr = t["expr"]
                for var, value in values.items():
                    expr = expr.replace(var, value)
                assert "$" not in expr.replace('"$1"', ""), expr
                out.append((board, panel["title"], expr))
    return out


def send_traffic(base_url: str) -> None:
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)

    def ask(topic: str) -> None:
        messages = [{"role": "user", "content": f"Explain {topic} in one short paragraph."}]
        stream = client.chat.completions.create(
            model=SERVED, messages=messages, max_tokens=24, temperature=0, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    with pytest.raises(openai.BadRequestError):  # counted as an ingress error
        client.chat.completions.create(
            model=SERVED, messages=[{"role": "user", "content": "hi"}], temperature=-1
        )
    with ThreadPoolExecutor(len(TOPICS)) as pool:
        list(pool.map(ask, TOPICS))


def send_garbage_frame() -> None:
    """Three bytes at the small model's ZeroMQ socket: dropped unread, counted malformed."""
    import zmq
    from ray import serve

    directory = serve.get_deployment_handle("EndpointDirectory", app_name=APP)
    (endpoint,) = directory.endpoints.remote("small").result()
    rogue = zmq.Context.instance().socket(zmq.PUSH)
    rogue.setsockopt(zmq.LINGER, 1000)
    rogue.connect(endpoint.address)
    rogue.send(b"\x00" * 3)
    rogue.close()


def wait_for_data(
    prom: Prometheus, queries: list[tuple[str, str, str]], deadline_s: float
) -> list[tuple[str, str, str]]:
    """The queries still empty when every one returned data or the deadline passed."""
    empty = queries
    deadline = time.monotonic() + deadline_s
    while empty and time.monotonic() < deadline:
        time.sleep(2)
        empty = [q for q in empty if not prom.query(q[2])]
    return empty


def test_documented_scrape_config_is_valid(tmp_path: Path) -> None:
    """The config docs/user-guide/observability.md gives for scraping a local cluster passes
    promtool."""
    text = (REPO / "docs" / "user-guide" / "observability.md").read_text()
    section = text[text.index("## Scraping locally") :]
    block = section[
        section.index("```yaml\n") + 8 : section.index("```\n", section.index("```yaml"))
    ]
    config = yaml.safe_load(block)
    assert config["scrape_configs"][0]["file_sd_configs"]  # the discovery file Ray writes
    path = tmp_path / "prometheus.yml"
    path.write_text(block)
    check = subprocess.run(
        ["promtool", "check", "config", str(path)], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_every_dashboard_query_returns_data(
    serve_app: Callable[..., Any], prometheus: Prometheus
) -> None:
    overrides = [
        *demo_overrides(),
        f"served_model_name={SERVED}",
        # every request routed (the demo's default serves the large model alone where that
        # is faster): the routing, handoff and small-model panels need routed traffic
        "tuner.speed_bypass=null",
        # preemptions: a few KV blocks on the small model
        f"models.small.memory_budget_gb={small_kv_budget_gb()}",
        f"models.small.max_model_len={SMALL_KV_BLOCKS * BLOCK}",
        f"models.small.block_size={BLOCK}",
        "models.small.num_cpus=0.5",
        "models.large.num_cpus=0.5",
        # deferred launches on the large model, and the safety net firing
        "models.large.scheduler.batch_thresholds=[1,1,2,2]",
        "scheduler.max_defer_s=0.01",
        # a tuner that decides (and solves) within seconds, but never adopts a new table: on a
        # quiet machine it would set the large model to B = 1 before the first escalation
        # reached it, and no launch would ever be deferred
        "tuner.min_gain=1000000",
        "tuner.period_s=1",
        "tuner.min_moves=5",
        "tuner.concurrencies=[1,2]",
        # live quality: every answer sampled; the first scored, the rest past the (tiny)
        # scoring budget skipped
        "quality_monitor.sample_rate=1.0",
        "quality_monitor.max_share=1e-9",
    ]
    queries = panel_queries()
    assert len(queries) > 40  # every board's every target
    with serve_app(overrides, APP) as base_url:
        send_garbage_frame()  # first: its count is exported while the traffic runs
        send_traffic(base_url)
        empty = wait_for_data(prometheus, queries, DEADLINE_S)
        assert not empty, "panels without data:\n" + "\n".join(
            f"  {board} / {title}: {expr}" for board, title, expr in empty
        )
        # the counts are what happened: four requests, one garbage frame, preemptions
        app = f'model_name="{SERVED}"'
        ended = f"sum(ray_tokenrouter_request_success_total{{{app}}})"
        assert prometheus.eventually(ended, lambda v: v == len(TOPICS)) == len(TOPICS)
        rejected = f'sum(ray_tokenrouter_peer_rejected_total{{{app}, reason="malformed"}})'
        assert prometheus.eventually(rejected, lambda v: v == 1) == 1
        preempted = f'sum(ray_tokenrouter_num_preemptions_total{{{app}, model="small"}})'
        assert prometheus.eventually(preempted, lambda v: v > 0) > 0
        # histograms (aggregated in the process, set as gauges): one observation per request,
        # the `le` buckets cumulative and written as Ray's histograms wrote them
        e2e = "ray_tokenrouter_e2e_request_latency_seconds"
        n = len(TOPICS)
        assert prometheus.eventually(f"sum({e2e}_count{{{app}}})", lambda v: v == n) == n
        assert (
            prometheus.eventually(f'sum({e2e}_bucket{{{app}, le="+Inf"}})', lambda v: v == n) == n
        )
        les = {
            s["metric"]["le"]: float(s["value"][1])
            for s in prometheus.query(f"sum by (le) ({e2e}_bucket{{{app}}})")
        }
        assert set(les) == {*(str(b) for b in E2E_SECONDS.buckets), "+Inf"}
        ordered = [les[str(b)] for b in E2E_SECONDS.buckets] + [les["+Inf"]]
        assert ordered == sorted(ordered)
        assert prometheus.eventually(f"sum({e2e}_sum{{{app}}})", lambda v: v > 0) > 0
        # Serve's tags come with ray.serve.metrics; model_name with every metric
        (sample,) = prometheus.query(
            f'ray_tokenrouter_batch_size_count{{model_name="{SERVED}", model="small"}}'
        )
        labels = sample["metric"]
        assert labels["model_name"] == SERVED and labels["application"] == APP
        assert labels["deployment"] and labels["replica"]
        # the boards' variables list this app and its models
        names = prometheus.get("/api/v1/label/model_name/values")
        assert SERVED in names
        models = prometheus.get(
            "/api/v1/label/model/values",
            **{"match[]": f'ray_tokenrouter_batch_size_count{{model_name="{SERVED}"}}'},
        )
        assert sorted(models) == ["large", "small"]
