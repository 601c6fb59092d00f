"""Structured outputs on a real Serve app (local Ray cluster, ZeroMQ between replicas):
the official client's ``chat.completions.parse`` with a pydantic model gets a parsed,
validated object from two tiny random-weight Qwen3 models that hand the request back and
forth, each masking its logits with the request's grammar."""

from __future__ import annotations

from pathlib import Path

import openai

from tests.deployments.conftest import tiny_overrides
from tests.openai.qwen3_tiny import save_qwen3_models
from tests.openai.test_structured_served import TWO, assert_person_by_both, person_request


def test_parse_with_a_pydantic_model_on_serve(serve_app, tmp_path: Path) -> None:
    dirs = save_qwen3_models(tmp_path, TWO)
    overrides = tiny_overrides(dirs, TWO, "entropy", "zmq_ipc", ["policy.options.threshold=0.05"])
    with serve_app(overrides, "structured") as base:
        client = openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=120)
        for seed in range(2):
            request = person_request("tokenrouter", f"Person {seed} as JSON", seed)
            assert_person_by_both(client.chat.completions.parse(**request).choices[0])
