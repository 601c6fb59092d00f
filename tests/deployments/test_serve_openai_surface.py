"""The OpenAI sampling surface on a real Serve app (local Ray cluster): the entry model's
generation_config.json defaults (repetition_penalty included) reach the models, the sampling
parity fields (penalties, logit_bias, min_tokens) reach every model over ZeroMQ and give the
local runtime's tokens, X-Request-Id comes back, and the extra endpoints answer through
Serve's proxy."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import openai

from tests.deployments.conftest import tiny_overrides
from tests.tiny_models import chain_engines
from tokenrouter_ray.local import LocalRuntime
from tokenrouter_ray.protocol import SamplingSpec
from tokenrouter_ray.routing.policy import build_policy

TWO = ["small", "large"]
POLICY = ["policy.options.threshold=0.45"]
PROMPTS = [[(7 * i + j) % 128 for j in range(3 + 2 * i)] for i in range(3)]
DEFAULTS = {"temperature": 0.0, "repetition_penalty": 1.3}  # the models' generation_config
# (request fields, the SamplingSpec fields they mean on top of DEFAULTS)
FIELDS: list[tuple[dict[str, Any], dict[str, Any]]] = [
    ({"presence_penalty": 1.0, "frequency_penalty": 0.5, "extra_body": {"repetition_penalty": 1}},
     {"presence_penalty": 1.0, "frequency_penalty": 0.5, "repetition_penalty": 1.0}),
    ({"logit_bias": {"9": 5.0}}, {"logit_bias": ((9, 5.0),)}),
    ({"extra_body": {"min_tokens": 6, "stop_token_ids": [15, 60, 94],
                     "include_stop_str_in_output": True}},
     {"min_tokens": 6, "stop_token_ids": (15, 60, 94)}),
]  # fmt: skip


def local_outputs(dirs: dict[str, str], specs: list[SamplingSpec]) -> list[Any]:
    """The local runtime's answer to PROMPTS[0] under each spec, then to every prompt
    under the first (the same models and policy as the served app)."""

    async def go() -> list[Any]:
        policy = build_policy("entropy", {"threshold": 0.45}, TWO)
        async with LocalRuntime(chain_engines(dirs, TWO), policy) as runtime:
            out = await runtime.complete_all(PROMPTS, specs[0])
            for spec in specs[1:]:
                out.append(await runtime.complete(PROMPTS[0], spec))
            return out

    return asyncio.run(go())


def test_generation_defaults_request_id_and_endpoints(
    serve_app, served_chain_dirs, tmp_path: Path
) -> None:
    dirs = {}
    for name in TWO:  # the chain models, with a generation_config: greedy, penalized
        dirs[name] = str(shutil.copytree(served_chain_dirs[name], tmp_path / name))
        (Path(dirs[name]) / "generation_config.json").write_text(json.dumps(DEFAULTS))
    overrides = tiny_overrides(dirs, TWO, "entropy", "zmq_ipc", POLICY)
    base_spec = {"max_tokens": 16, "seed": 0, **DEFAULTS}
    specs = [SamplingSpec(**base_spec)] + [SamplingSpec(**{**base_spec, **f}) for _, f in FIELDS]
    expected = local_outputs(dirs, specs)
    plain = local_outputs(dirs, [SamplingSpec(temperature=0.0, max_tokens=16, seed=0)])
    assert [w.token_ids for w in expected[: len(PROMPTS)]] != [w.token_ids for w in plain]
    assert all(w.token_ids != expected[0].token_ids for w in expected[len(PROMPTS) :])
    with serve_app(overrides, "surface") as base:
        client = openai.OpenAI(base_url=base, api_key="none", max_retries=0)
        got = [  # no temperature: the model's defaults (0, repetition 1.3) apply
            client.completions.create(model="tokenrouter", prompt=p, max_tokens=16) for p in PROMPTS
        ]
        got += [
            client.completions.create(model="tokenrouter", prompt=PROMPTS[0], max_tokens=16, **f)
            for f, _ in FIELDS
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
