"""The tuner deployment in a served app: model replicas report their statistics windows,
the tuner solves, publishes thresholds that the replicas adopt, and explains itself at
``GET /v1/tokenrouter/tuner`` (an app without a tuner answers 404 there: test_cross_node)."""

from __future__ import annotations

import concurrent.futures

import httpx
import openai

from tests.deployments.conftest import tiny_overrides
from tests.deployments.test_serve_app import prompts
from tests.waiting import wait_for
from tokenrouter_ray.thresholds import is_admissible

TWO = ["small", "large"]
TUNER = [
    "tuner=live",
    "tuner.period_s=0.5",
    "tuner.min_moves=10",
    "tuner.concurrencies=[1,2,4,8]",
    "tuner.grain_ms=1.0",  # a coarse grain: the first solve stays short on a loaded host
    "policy.options.threshold=0.45",
    "tuner.min_tokens_per_s=1e9",  # an SLO nothing meets: admit the smallest tuned N (1)
    "ingress.admission_queue=0",  # past the cap: refused at once (no wait for a slot)
]


def test_replicas_follow_the_tuner(serve_app, served_chain_dirs) -> None:
    from ray import serve

    overrides = tiny_overrides(served_chain_dirs, TWO, "entropy", "zmq_ipc", TUNER)
    with serve_app(overrides, "tuned") as base:
        client = openai.OpenAI(base_url=base, api_key="none", max_retries=0)

        def call(prompt: list[int]) -> openai.types.Completion:
            return client.completions.create(
                model="tokenrouter", prompt=prompt, max_tokens=24, temperature=0
            )

        with concurrent.futures.ThreadPoolExecutor(8) as pool:  # statistics to tune from
            list(pool.map(call, prompts() * 2))

        def solved() -> dict | None:
            status = httpx.get(f"{base}/tokenrouter/tuner", timeout=10).json()
            return status if status["last"]["predicted_tokens_per_s"] else None

        status = wait_for(solved, 180.0)  # the first solve runs in a worker thread
        assert status["replicas"] == {"small": [status["replicas"]["small"][0]],
                                      "large": [status["replicas"]["large"][0]]}  # fmt: skip
        assert status["replica_counts"] == {"small": 1, "large": 1}  # from the reports
        assert set(status["last"]["predicted_tokens_per_s"]) == {"1", "2", "4", "8"}
        assert 0 < status["last"]["route_prob"]["small->large"] < 1
        assert status["step_ms"]["small"] and status["step_ms"]["large"]
        assert sum(status["active_requests"].values()) > 0  # steps seen per active count N
        thresholds = status["thresholds"]
        for n in range(1, len(thresholds["small"])):
            assert is_admissible(n, [thresholds[m][n] for m in TWO])

        def adopted() -> bool:  # replicas pull what the tuner published
            now = httpx.get(f"{base}/tokenrouter/tuner", timeout=10).json()["thresholds"]
            infos = {m: serve.get_deployment_handle(m, "tuned").info.remote().result() for m in TWO}
            infos = {m: info.to_json() for m, info in infos.items()}  # ReplicaInfo
            return all(infos[m]["batch_thresholds"] == now[m] for m in TWO)

        wait_for(adopted, 60.0)
        ok = call(prompts()[0])  # still serving under the tuned thresholds
        assert ok.usage.completion_tokens == 24

        # SLO mode: the ingress admits what the tuner's cap allows and refuses the rest
        # (429 with Retry-After: the admission queue's answer, here with no queue).
        assert status["last"]["max_concurrency"] == 1

        def burst() -> list[int]:
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                return list(pool.map(lambda p: post(base, p), prompts()[:4]))

        codes = wait_for(lambda: (c := burst()) and 429 in c and c, 120.0)
        assert 200 in codes  # one at a time still gets through


def post(base: str, prompt: list[int]) -> int:
    body = {"model": "tokenrouter", "prompt": prompt, "max_tokens": 48, "temperature": 0}
    response = httpx.post(f"{base}/completions", json=body, timeout=60)
    if response.status_code == 429:
        assert response.json()["error"]["code"] == "rate_limit_exceeded"
        assert response.headers.get("retry-after")
    return response.status_code
