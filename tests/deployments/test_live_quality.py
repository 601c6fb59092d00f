"""Live quality in the served app: finished answers are scored by a replica of the top model
(teacher forcing between two of its steps) and shown at ``GET /v1/tokenrouter/quality``, per
operating point; each score equals the same model's greedy choices computed here, outside
the app, with plain ``transformers``.

The two tests' apps are deployed side by side, once for the module (their replicas start
together on the shared cluster), and deleted together after both."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest
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
TARGET_EXTRA = [
    "+policy.presets={fast: [0.99]}",
    "quality_monitor.sample_rate=1.0",
    "quality_monitor.max_share=1.0",
    "++tuner.quality_target={target: 0.9, ladder: [fast], start: fast, min_samples: 4}",
]


@pytest.fixture(scope="module")
def quality_apps(
    serve_apps: Callable[..., Any], served_chain_dirs: dict[str, str]
) -> Iterator[dict[str, str]]:
    """``quality`` (EXTRA) and ``quality-target`` (TARGET_EXTRA): name -> OpenAI base URL."""
    apps = {
        name: tiny_overrides(served_chain_dirs, TWO, "entropy", "zmq_ipc", extra)
        for name, extra in (("quality", EXTRA), ("quality-target", TARGET_EXTRA))
    }
    with serve_apps(apps) as urls:
        yield urls


def reference_agreement(model, prompt: list[int], answer: list[int]) -> int:
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + answer])).logits[0]
    chosen = logits[len(prompt) - 1 : len(prompt) + len(answer) - 1].argmax(-1)
    return int((chosen == torch.tensor(answer)).sum())


def test_answers_are_scored_by_the_top_model(quality_apps, served_chain_dirs) -> None:
    large = AutoModelForCausalLM.from_pretrained(served_chain_dirs["large"], dtype=torch.float64)
    asked = {  # request id -> (routing, the point it is labelled with)
        "q-default": (None, "default"),
        "q-high": ({"quality": "high"}, "high"),
        "q-custom": ({"threshold": 0.9}, "custom"),
        "q-alone": ({"model": "large"}, "alone:large"),
    }
    base = quality_apps["quality"]
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


def test_the_quality_target_moves_default_requests_off_a_rung_that_disagrees(
    quality_apps,
) -> None:
    """``tuner.quality_target`` served: requests without ``routing`` start on the ``fast``
    preset (the small model writes almost every token, and these two random models never
    agree on a whole answer); once ``min_samples`` of its answers are scored, the rung is
    judged under the target and the next requests are served by the top model alone
    (``routing.mode`` alone, no handoffs), while a request that names its preset keeps it."""
    base = quality_apps["quality-target"]
    client = openai.OpenAI(base_url=base, api_key="none", max_retries=0)

    def ask(k: int, routing: dict | None = None) -> dict:
        out = client.completions.create(
            model="tokenrouter", prompt=prompts()[k % len(prompts())], max_tokens=16,
            temperature=0, extra_body={} if routing is None else {"routing": routing},
        )  # fmt: skip
        return out.model_extra["routing"]

    def status() -> dict:
        return httpx.get(f"{base}/tokenrouter/quality", timeout=10).json()["target"]

    first = [ask(k) for k in range(4)]
    assert all(r["mode"] == "routed" for r in first)
    moved = wait_for(lambda: status() if status()["rung"] == "alone" else None, 120.0,
                     "the fast rung judged")  # fmt: skip
    (move,) = moved["moves"]
    assert (move["from"], move["to"], move["answers"]) == ("fast", "alone", 4)
    assert move["agreement"] == 0.0 and move["bounds"][1] < 0.9
    after = ask(5)
    assert after["mode"] == "alone" and after["handoffs"] == 0
    assert set(after["tokens_per_model"]) == {"large"}
    assert ask(6, {"quality": "fast"})["mode"] == "routed"  # its own preset wins
