"""One app across the two Ray nodes of the test cluster: the small model (2 replicas) pinned
to the node advertising `tokenrouter_small`, the large one to `tokenrouter_large`, PeerReqs
over ZeroMQ TCP. Outputs still equal LocalRuntime's; bad inputs get OpenAI errors."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import openai
import pytest

from tests.deployments.conftest import local_outputs, tiny_overrides
from tests.deployments.test_serve_app import ids_of, prompts

TWO = ["small", "large"]
OVERRIDES = ["placement=cross_node", "policy.options.threshold=0.45", "models.small.num_replicas=2"]


@pytest.fixture(scope="module")
def cross_node_app(serve_app, served_chain_dirs):
    overrides = tiny_overrides(served_chain_dirs, TWO, "entropy", "zmq_tcp", OVERRIDES)
    with serve_app(overrides, "crossnode") as base:
        yield base


def test_outputs_equal_local_runtime_across_nodes(cross_node_app, served_chain_dirs) -> None:
    from ray import serve

    expected = local_outputs(served_chain_dirs, TWO, "entropy", {"threshold": 0.45}, prompts(), 20)
    client = openai.OpenAI(base_url=cross_node_app, api_key="none", max_retries=0)

    def call(prompt: list[int]) -> openai.types.Completion:
        return client.completions.create(
            model="tokenrouter", prompt=prompt, max_tokens=20, temperature=0
        )

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(call, prompts()))
    for want, response in zip(expected, got, strict=True):
        assert ids_of(response.choices[0].text) == want.token_ids
    # The replicas really ran on different nodes, and ZeroMQ spoke TCP between them.
    infos = {
        name: serve.get_deployment_handle(name, "crossnode").info.remote().result().to_json()
        for name in TWO
    }
    assert infos["small"]["node_id"] != infos["large"]["node_id"]
    stats = httpx.get(f"{cross_node_app}/tokenrouter/stats").json()
    small_endpoints = stats["endpoints"]["small"]
    assert len(small_endpoints) == 2
    # New requests went to both small replicas (least-loaded choice at the ingress).
    assert all(stats["entry_requests"].get(e, 0) > 0 for e in small_endpoints)


def test_chat_and_streaming(cross_node_app) -> None:
    client = openai.OpenAI(base_url=cross_node_app, api_key="none", max_retries=0)
    chat = client.chat.completions.create(
        model="tokenrouter",
        messages=[{"role": "user", "content": "w5 w6 w7"}],
        max_tokens=8,
        temperature=0,
    )
    assert chat.choices[0].message.role == "assistant"
    assert len(ids_of(chat.choices[0].message.content)) == 8
    assert chat.usage.completion_tokens == 8
    stream = client.chat.completions.create(
        model="tokenrouter",
        messages=[{"role": "user", "content": "w5 w6 w7"}],
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert ids_of(text) == ids_of(chat.choices[0].message.content)
    assert chunks[-1].usage.completion_tokens == 8
    completion = client.completions.create(
        model="tokenrouter", prompt="w1 w2", max_tokens=6, temperature=0, n=2, stream=True
    )
    pieces: dict[int, str] = {0: "", 1: ""}
    for chunk in completion:
        for choice in chunk.choices:
            pieces[choice.index] += choice.text
    assert pieces[0] == pieces[1] and len(ids_of(pieces[0])) == 6  # greedy: n choices agree


def test_stop_strings_are_cut(cross_node_app) -> None:
    client = openai.OpenAI(base_url=cross_node_app, api_key="none", max_retries=0)
    full = (
        client.completions.create(model="tokenrouter", prompt="w3 w4", max_tokens=10, temperature=0)
        .choices[0]
        .text
    )
    words = full.split()
    stop = f" {words[4]}"
    cut = client.completions.create(
        model="tokenrouter", prompt="w3 w4", max_tokens=10, temperature=0, stop=[stop]
    ).choices[0]
    assert cut.text == full[: full.index(stop)] and cut.finish_reason == "stop"


BAD = [
    ("completions", "{not json", 400, None),
    ("completions", json.dumps({"prompt": "w1"}), 400, "model"),
    ("completions", json.dumps({"model": "tokenrouter"}), 400, "prompt"),
    ("completions", json.dumps({"model": "tokenrouter", "prompt": 5}), 400, "prompt"),
    (
        "completions",
        json.dumps({"model": "tokenrouter", "prompt": "w1", "max_tokens": -3}),
        400,
        "max_tokens",
    ),
    (
        "completions",
        json.dumps({"model": "tokenrouter", "prompt": "w1", "max_tokens": 10**9}),
        400,
        "max_tokens",
    ),
    ("completions", json.dumps({"model": "gpt-9", "prompt": "w1"}), 404, "model"),
    ("chat/completions", json.dumps({"model": "tokenrouter", "messages": []}), 400, "messages"),
    ("chat/completions", json.dumps({"model": "tokenrouter", "messages": "hi"}), 400, "messages"),
    ("completions", json.dumps({"model": "tokenrouter", "prompt": "w1 " * 300}), 400, "prompt"),
    (
        "completions",
        json.dumps({"model": "tokenrouter", "prompt": "w1", "temperature": "hot"}),
        400,
        "temperature",
    ),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD)
def test_bad_input_gets_openai_error_and_server_keeps_serving(
    cross_node_app, path, body, status, param
) -> None:
    response = httpx.post(
        f"{cross_node_app}/{path}",
        content=body,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error"
    assert error["param"] == param
    ok = httpx.post(
        f"{cross_node_app}/completions",
        timeout=30,
        json={"model": "tokenrouter", "prompt": "w1", "max_tokens": 2},
    )
    assert ok.status_code == 200


def test_tuner_status_without_a_tuner_is_a_404(cross_node_app) -> None:
    response = httpx.get(f"{cross_node_app}/tokenrouter/tuner", timeout=10)
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and "tuner=live" in error["message"]
