"""Live quality in the served app: finished answers are scored by a replica of the top model
(teacher forcing between two of its steps) and shown at ``GET /v1/tokenrouter/quality``, per
operating point; each score equals the same model's greedy choices computed here, outside
the app, with plain ``transformers``."""

from __future__ import annotations

import httpx
import openai
import torch
from transformers import AutoModelForCausalLM

from tests.deployments.conftest import tiny_overrides
from tests.deployments.test_serve_app import ids_of, prompts
from tests.waiting import wait_for

TWO = ["small", "large"]
EXTRA = [
    "policy.options.threshold=0.45",
    "+policy.presets={high: [0.2]}",
    "quality_monitor.sample_rate=1.0",  # every answer: the test checks each one
    "quality_monitor.max_share=1.0",
]


def reference_agreement(model, prompt: list[int], answer: list[int]) -> int:
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + answer])).logits[0]
    chosen = logits[len(prompt) - 1 : len(prompt) + len(answer) - 1].argmax(-1)
    return int((chosen == torch.tensor(answer)).sum())


def test_answers_are_scored_by_the_top_model(serve_app, served_chain_dirs) -> None:
    overrides = tiny_overrides(served_chain_dirs, TWO, "entropy", "zmq_ipc", EXTRA)
    large = AutoModelForCausalLM.from_pretrained(served_chain_dirs["large"], dtype=torch.float64)
    asked = {  # request id -> (routing, the point it is labelled with)
        "q-default": (None, "default"),
        "q-high": ({"quality": "high"}, "high"),
        "q-custom": ({"threshold": 0.9}, "custom"),
        "q-alone": ({"model": "large"}, "alone:large"),
    }
    with serve_app(overrides, "quality") as base:
        client = openai.OpenAI(base_url=base, api_key="none", max_retries=0)
        answers: dict[str, tuple[list[int], list[int]]] = {}
        for k, (rid, (routing, _)) in enumerate(asked.items()):
            prompt = prompts()[k + 2]
            extra = {} if routing is None else {"routing": routing}
            out = client.completions.create(
                model="tokenrouter", prompt=prompt, max_tokens=16, temperature=0,
                extra_body=extra, extra_headers={"X-Request-Id": rid},
            )  # fmt: skip
            answers[rid] = (prompt, ids_of(out.choices[0].text))

        def scored() -> dict | None:
            status = httpx.get(f"{base}/tokenrouter/quality", timeout=10).json()
            return status if len(status["recent"]) == len(asked) else None

        status = wait_for(scored, 120.0, "every answer scored")
    assert status["enabled"] and status["skipped"] == {} and status["policy"] == "entropy"
    for entry in status["recent"]:
        rid = entry["request_id"].split("-")[0] + "-" + entry["request_id"].split("-")[1]
        prompt, answer = answers[rid]
        assert entry["point"] == asked[rid][1]
        assert entry["positions"] == len(answer) == 16
        assert entry["agreeing"] == reference_agreement(large, prompt, answer), rid
    # the top model alone, greedy: its own answer, every position agrees
    alone = status["points"]["alone:large"]["window"]
    assert alone["answer_agreement"] == 1.0 and alone["mean_logprob_gap"] < 1e-9
    assert set(status["points"]) == {"default", "high", "custom", "alone:large"}
