"""Structured outputs on a real Serve app (local Ray cluster, ZeroMQ between replicas):
the official client's ``chat.completions.parse`` with a pydantic model gets a parsed,
validated object from two tiny random-weight Qwen3 models that hand the request back and
forth, each masking its logits with the request's grammar."""

from __future__ import annotations

from pathlib import Path

import openai

from tests.deployments.conftest import tiny_overrides
from tests.openai.qwen3_tiny import save_qwen3
from tests.openai.test_structured_served import NO_THINKING, Person

TWO = ["small", "large"]


def test_parse_with_a_pydantic_model_on_serve(serve_app, tmp_path: Path) -> None:
    dirs = {name: save_qwen3(tmp_path / name, seed) for name, seed in zip(TWO, (3, 4), strict=True)}
    overrides = tiny_overrides(dirs, TWO, "entropy", "zmq_ipc", ["policy.options.threshold=0.05"])
    with serve_app(overrides, "structured") as base:
        client = openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=120)
        for seed in range(2):
            done = client.chat.completions.parse(
                model="tokenrouter",
                messages=[{"role": "user", "content": f"Person {seed} as JSON"}],
                response_format=Person,
                temperature=1.0,
                seed=seed,
                max_tokens=150,
                extra_body=NO_THINKING,
            )
            choice = done.choices[0]
            assert choice.finish_reason == "stop"
            assert isinstance(choice.message.parsed, Person)
            assert set(choice.model_extra["routing"]["tokens_per_model"]) == set(TWO)
