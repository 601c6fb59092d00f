"""The Serve app on a real local Ray cluster, called with the official openai client."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator

import openai
import pytest

from tests.deployments.conftest import local_outputs, tiny_overrides

TWO = ["small", "large"]
POLICY = ["policy.options.threshold=0.45"]  # entropy policy: deterministic routing


def prompts() -> list[list[int]]:
    return [[(7 * i + j) % 128 for j in range(3 + 2 * i)] for i in range(8)]


def ids_of(text: str) -> list[int]:
    return [int(w[1:]) for w in text.split()]


TRANSPORTS = ["zmq_ipc", "ray"]


@pytest.fixture(scope="module")
def apps(serve_apps, served_chain_dirs) -> Iterator[dict[str, str]]:
    """The pair over each transport, deployed side by side: transport -> base URL."""
    named = {
        f"equiv-{t.replace('_', '-')}": tiny_overrides(served_chain_dirs, TWO, "entropy", t, POLICY)
        for t in TRANSPORTS
    }
    with serve_apps(named) as bases:
        yield dict(zip(TRANSPORTS, bases.values(), strict=True))


@pytest.fixture(scope="module")
def expected(served_chain_dirs) -> list:
    """The in-process runtime's answers: what every transport must serve."""
    return local_outputs(served_chain_dirs, TWO, "entropy", {"threshold": 0.45}, prompts(), 24)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_served_greedy_equals_local_runtime(transport, apps, expected) -> None:
    client = openai.OpenAI(base_url=apps[transport], api_key="none", max_retries=0)

    def call(prompt: list[int]) -> openai.types.Completion:
        return client.completions.create(
            model="tokenrouter", prompt=prompt, max_tokens=24, temperature=0
        )

    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # 8 concurrent clients
        got = list(pool.map(call, prompts()))
    traced = client.completions.create(  # trace, logprobs, metrics over Serve
        model="tokenrouter", prompt=prompts()[3], max_tokens=24, temperature=0,
        logprobs=2, extra_body={"routing_trace": True},
    )  # fmt: skip
    for want, response in zip(expected, got, strict=True):
        assert ids_of(response.choices[0].text) == want.token_ids
        assert response.model_extra["routing"]["tokens_per_model"] == want.counts
        assert response.usage.completion_tokens == len(want.token_ids)
    assert sum(w.handoffs for w in expected) > 20  # the comparison covers real routing
    choice, want = traced.choices[0], expected[3]
    trace, metrics = choice.model_extra["routing_trace"], choice.model_extra["metrics"]
    assert trace["models"] == TWO and [t["id"] for t in trace["tokens"]] == want.token_ids
    assert {m: n for m, n in metrics["tokens_per_model"].items() if n} == want.counts
    assert metrics["handoffs"] == want.handoffs and (metrics["peer_bytes"] > 0) == (
        want.handoffs > 0
    )
    assert 0 <= metrics["queue_s"] <= metrics["ttft_s"] <= metrics["e2e_s"]
    assert len(choice.logprobs.token_logprobs) == len(want.token_ids)
