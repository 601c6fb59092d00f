"""A model deployment scaled down, and rolled to a new version, while streams are in flight,
deployed the way ``serve deploy`` and KubeRay's RayService update an app: a new Serve config
whose ``deployments:`` section changes only the large model (its replica count; its actor
options, which makes Serve replace its replicas one by one). Each replica Serve stops drains
first (it sends DRAIN; the ingress moves its requests to another replica of the model from
their committed sequence), so every stream finishes with exactly what an undisturbed run
writes (the simulated models write a filler by position: a lost or repeated token shows),
and what was moved shows on the ingress's stats route and in Ray's Prometheus export."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from loadtest.host_path import sim_overrides
from tests.waiting import wait_for
from tokenrouter_ray.simulation.served import sim_answer

pytestmark = pytest.mark.slow

APP = "rolling"
STREAMS = 8
TOKENS = 1200  # ~20 ms a token at the paper's step times: every stream outlives the update
READY_S = 240.0


def serve_config(large: dict[str, Any]) -> dict[str, Any]:
    """The app's Serve config: the simulated pair, the large model's deployment options
    ``large`` (Serve's ``deployments:`` section)."""
    overrides = [*sim_overrides("paper"), "models.large.num_replicas=2", "tuner.enabled=false"]
    return {
        "applications": [
            {
                "name": APP,
                "route_prefix": f"/{APP}",
                "import_path": "deployments.app:build_app",
                "args": {"overrides": overrides},
                "deployments": [{"name": "large", **large}],
            }
        ]
    }


def deploy(config: dict[str, Any]) -> None:
    """What ``serve deploy`` (and KubeRay, from a RayService's serveConfigV2) does."""
    from ray.serve._private.api import serve_start
    from ray.serve.schema import ServeDeploySchema

    serve_start().deploy_apps(ServeDeploySchema.model_validate(config))


def large_replicas() -> int:
    """Running replicas of the large model once Serve has settled the app (0 before)."""
    from ray import serve

    app = serve.status().applications.get(APP)
    if app is None or app.status != "RUNNING":
        return 0
    large = app.deployments["large"]
    return large.replica_states.get("RUNNING", 0) if large.status == "HEALTHY" else 0


def stats(base: str) -> dict[str, Any]:
    return httpx.get(base.removesuffix("/v1") + "/v1/tokenrouter/stats", timeout=30).json()


def drained_counter(node_ports: list[int]) -> float:
    """``tokenrouter_requests_moved_total{reason="drain"}`` summed over every node's Ray
    metrics export (what Prometheus scrapes; Ray prefixes application metrics ``ray_``)."""
    total = 0.0
    pattern = re.compile(
        r'^(?:ray_)?tokenrouter_requests_moved_total\{[^}]*reason="drain"[^}]*\} (\S+)$'
    )
    for port in node_ports:
        try:
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        except httpx.HTTPError:
            continue
        for line in text.splitlines():
            match = pattern.match(line)
            if match:
                total += float(match.group(1))
    return total


def streams_through(base: str, change: Callable[[], None]) -> list[tuple[str, str, int]]:
    """``STREAMS`` streamed completions, each a different prompt; once every one has its first
    token, ``change()`` runs; returns (text, finish_reason, prompt_tokens) per stream."""
    client = openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=300)
    started = [threading.Event() for _ in range(STREAMS)]

    def one(i: int) -> tuple[str, str, int]:
        stream = client.completions.create(
            model="tokenrouter", prompt=f"Stream {i}: tell a long story.", max_tokens=TOKENS,
            temperature=0, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        text, finish, prompt_tokens = [], "", 0
        for chunk in stream:
            if chunk.choices:
                text.append(chunk.choices[0].text or "")
                finish = chunk.choices[0].finish_reason or finish
                started[i].set()
            if chunk.usage is not None:
                prompt_tokens = chunk.usage.prompt_tokens
        return "".join(text), finish, prompt_tokens

    with ThreadPoolExecutor(STREAMS) as pool:
        futures = [pool.submit(one, i) for i in range(STREAMS)]
        wait_for(lambda: all(e.is_set() for e in started) or any(f.done() for f in futures),
                 READY_S, "every stream's first token")  # fmt: skip
        assert not any(f.done() for f in futures), "a stream ended before the update"
        change()
        return [f.result() for f in futures]


@pytest.fixture(scope="module")
def rolling_app(serve_http: str) -> Iterator[str]:
    from ray import serve

    deploy(serve_config({}))
    wait_for(lambda: large_replicas() == 2, READY_S, "the app with two large replicas")
    try:
        yield f"{serve_http}/{APP}/v1"
    finally:
        serve.delete(APP)


def moved_entries(base: str) -> list[dict[str, Any]]:
    return stats(base)["moved_off"]


def test_rolling_update_then_scale_down_with_streams_in_flight(rolling_app: str) -> None:
    import ray

    ports = [n["MetricsExportPort"] for n in ray.nodes() if n["Alive"]]
    base = rolling_app
    before = drained_counter(ports)

    # A rolling update: new actor options for the large model only. Serve starts new
    # replicas and stops the old ones; each drains first.
    new_options = {"ray_actor_options": {"num_cpus": 0.4}}
    rolled = streams_through(base, lambda: deploy(serve_config(new_options)))
    for text, finish, prompt_tokens in rolled:
        assert finish == "length" and text == sim_answer(prompt_tokens, TOKENS)
    wait_for(lambda: large_replicas() == 2, READY_S, "the large model's two new replicas")
    after_roll = moved_entries(base)
    assert after_roll and all(e["moved"] >= 0 for e in after_roll), after_roll
    assert sum(e["moved"] for e in after_roll) > 0, after_roll

    # A scale-down: two large replicas to one; the one Serve removes drains first.
    shrunk = streams_through(base, lambda: deploy(serve_config({**new_options, "num_replicas": 1})))
    for text, finish, prompt_tokens in shrunk:
        assert finish == "length" and text == sim_answer(prompt_tokens, TOKENS)
    wait_for(lambda: large_replicas() == 1, READY_S, "one large replica")
    moves = moved_entries(base)
    assert len(moves) > len(after_roll) and moves[-1]["moved"] > 0, moves
    assert stats(base)["active_requests"] == 0

    # What was moved reaches Prometheus (Ray exports every few seconds).
    moved = sum(e["moved"] for e in moves)
    wait_for(lambda: drained_counter(ports) - before >= moved, 90.0,
             f"{moved} drained requests in Ray's metrics export")  # fmt: skip
