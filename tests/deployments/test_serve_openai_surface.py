"""The OpenAI surface of issue 28 on a real Serve app (local Ray cluster): the entry model's
generation_config.json defaults reach the models, X-Request-Id comes back, and the extra
endpoints answer through Serve's proxy."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import openai

from tests.deployments.conftest import local_outputs, tiny_overrides

TWO = ["small", "large"]
POLICY = ["policy.options.threshold=0.45"]
PROMPTS = [[(7 * i + j) % 128 for j in range(3 + 2 * i)] for i in range(3)]


def test_generation_defaults_request_id_and_endpoints(
    serve_app, served_chain_dirs, tmp_path: Path
) -> None:
    dirs = {}
    for name in TWO:  # the chain models, with a generation_config that makes them greedy
        dirs[name] = str(shutil.copytree(served_chain_dirs[name], tmp_path / name))
        (Path(dirs[name]) / "generation_config.json").write_text(json.dumps({"temperature": 0.0}))
    overrides = tiny_overrides(dirs, TWO, "entropy", "zmq_ipc", POLICY)
    expected = local_outputs(dirs, TWO, "entropy", {"threshold": 0.45}, PROMPTS, 16)
    with serve_app(overrides, "surface") as base:
        client = openai.OpenAI(base_url=base, api_key="none", max_retries=0)
        got = [  # no temperature: the model's default (0) applies, so greedy
            client.completions.create(model="tokenrouter", prompt=p, max_tokens=16) for p in PROMPTS
        ]
        raw = client.chat.completions.with_raw_response.create(
            model="tokenrouter",
            messages=[{"role": "user", "content": "w1 w2 w3"}],
            max_tokens=4,
            extra_headers={"X-Request-Id": "trace-7"},
        )
        root = base.removesuffix("/v1")
        version = httpx.get(f"{root}/version", timeout=30).json()
        card = client.models.retrieve("tokenrouter")
        tokens = httpx.post(f"{root}/tokenize", json={"prompt": "w5 w6"}, timeout=30).json()
    for want, response in zip(expected, got, strict=True):
        assert [int(w[1:]) for w in response.choices[0].text.split()] == want.token_ids
    assert raw.headers["x-request-id"] == "trace-7" and raw.parse().choices
    assert "version" in version and card.id == "tokenrouter"
    assert tokens["tokens"] == [5, 6] and tokens["count"] == 2
