"""``run_eval`` and ``tokenrouter-ray eval`` end to end over real sockets, without Ray: the
official ``openai`` client -> uvicorn serving the ingress app (tests/openai/ingress_app.py)
-> ``IngressServer`` -> ``LocalRuntime`` with the tiny chain (small + large, entropy
policy). The tiny random models answer garbage, so this checks structure and accounting:
every item answered or failed, per-model tokens summing to the completion tokens, the
large share and handoffs as the items report them, a bad request recorded as a failure
without disturbing the others, and the CLI's JSON report."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from tokenrouter_ray.errors import UserFacingError
from tokenrouter_ray.quality.evaluate import SystemResult, run_eval
from tokenrouter_ray.quality.task_files import write_tasks
from tokenrouter_ray.quality.tasks import TaskItem

TWO = ["small", "large"]
MAX_MODEL_LEN = 256


def words(ids: list[int]) -> str:
    """Text the tiny word-level tokenizer maps back to ``ids``."""
    return " ".join(f"w{t}" for t in ids)


GOOD = [
    TaskItem(id=f"q{i}", prompt=words([(7 * i + j) % 128 for j in range(3 + i)]), answer="w1")
    for i in range(4)
]
CHAT = TaskItem(id="chat", messages=[{"role": "user", "content": words([9, 8, 7])}], answer="w1")
TOO_LONG = TaskItem(id="too-long", prompt=words([5] * (MAX_MODEL_LEN + 10)), answer="w1")
ITEMS = [*GOOD[:2], TOO_LONG, *GOOD[2:], CHAT]


def serve(dirs: dict[str, str], body: Callable[[str], Awaitable[Any]]) -> Any:
    """``body(base_url)`` against the ingress app served by uvicorn on a free port."""
    from transformers import AutoTokenizer

    from tests.openai.ingress_app import served
    from tests.tiny_models import chain_engines
    from tokenrouter_ray.openai.validation import RequestLimits
    from tokenrouter_ray.routing.policy import build_policy

    tokenizer = AutoTokenizer.from_pretrained(dirs["small"])
    limits = RequestLimits(max_model_len=MAX_MODEL_LEN, vocab_size=128)

    async def go() -> Any:
        policy = build_policy("entropy", {"threshold": 0.45}, TWO)
        engines = chain_engines(dirs, TWO)
        async with served(engines, policy, tokenizer, limits=limits, socket=True) as flow:
            result = await body(flow.url)
            await flow.runtime.wait_idle()
            assert flow.runtime.ingress.num_active == 0
            return result

    return asyncio.run(go())


def check_accounting(result: SystemResult | dict[str, Any]) -> None:
    """The per-item and summed fields agree (a result object or its JSON)."""
    data = result.to_json() if isinstance(result, SystemResult) else result
    items = {item["id"]: item for item in data["items"]}
    assert list(items) == [item.id for item in ITEMS]  # the items' order, each once
    assert data["n"] == len(ITEMS) and data["failures"] == 1
    bad = items["too-long"]
    assert bad["error"] and "400" in bad["error"] and bad["correct"] is False
    assert bad["response"] == "" and bad["completion_tokens"] == 0
    answered = [item for item in data["items"] if item["error"] is None]
    assert len(answered) == len(ITEMS) - 1
    for item in answered:
        counts = item["tokens_per_model"]
        assert list(counts) == TWO  # every model, in config order
        assert sum(counts.values()) == item["completion_tokens"] > 0
        assert item["completion_tokens"] <= 8 and item["handoffs"] >= 0
        assert item["correct"] is ("w1" in item["response"].split())  # exact: a whole word
        assert item["latency_s"] > 0
    total = sum(item["completion_tokens"] for item in answered)
    assert data["completion_tokens"] == total
    large = sum(item["tokens_per_model"]["large"] for item in answered)
    assert data["large_model"] == "large"
    assert data["large_share"] == pytest.approx(large / total)
    assert data["handoffs"] == sum(item["handoffs"] for item in answered)
    assert data["correct"] == sum(item["correct"] for item in answered)
    assert data["accuracy"] == pytest.approx(data["correct"] / data["n"])
    low, high = data["interval"]
    assert 0 <= low <= data["accuracy"] <= high <= 1
    assert data["output_tok_s"] == pytest.approx(total / data["wall_s"])


def test_run_eval_and_the_cli_against_a_served_chain(served_chain_dirs, tmp_path: Path) -> None:
    from tests.openai.ingress_app import SERVED
    from tokenrouter_ray.cli import main

    tasks = tmp_path / "tasks.jsonl"
    write_tasks(ITEMS, tasks)
    out = tmp_path / "results.json"

    async def body(url: str) -> tuple[SystemResult, SystemResult, SystemResult, int]:
        common = {"max_tokens": 8, "concurrency": 2, "progress": False}
        result = await run_eval(url, SERVED, ITEMS, label="direct", **common)
        # greedy, so the same prompts answer the same: items 0 and 2 now expect a word of
        # their answer, and score
        said = {item.id: item.response.split() for item in result.items}
        known = [
            item.model_copy(update={"answer": said[item.id][2]}) if i % 2 == 0 else item
            for i, item in enumerate(GOOD)
        ]
        rescored = await run_eval(url, SERVED, known, label="known", **common)
        wrong = await run_eval(url, "no-such-model", GOOD[:2], label="wrong", **common)
        plain = await run_eval(url, SERVED, GOOD[:2], chat=False, **common)  # /v1/completions
        assert plain.failures == 0 and plain.label == url
        for item in plain.items:
            assert sum(item.tokens_per_model.values()) == item.completion_tokens > 0
        with pytest.raises(UserFacingError, match="need the chat endpoint"):
            await run_eval(url, SERVED, [CHAT], chat=False, **common)
        argv = ["eval", "--tasks", str(tasks), "--split", "all", "--max-tokens", "8",
                "--system", f"served={url}@{SERVED}", "--system", f"again={url}",
                "--extra-body", '{"routing_trace": false}', "--out", str(out),
                "--quiet", "--answers"]  # fmt: skip
        rc = await asyncio.to_thread(main, argv)  # the CLI runs its own event loop
        return result, rescored, wrong, rc

    result, rescored, wrong, rc = serve(served_chain_dirs, body)
    assert result.label == "direct" and result.model == SERVED
    check_accounting(result)
    hits = [item.correct for item in rescored.items]
    assert hits[0] and hits[2] and rescored.failures == 0
    assert rescored.correct == sum(hits) and rescored.accuracy == sum(hits) / len(GOOD)
    assert wrong.n == wrong.failures == 2 and wrong.correct == 0
    assert all("404" in item.error or "model" in item.error for item in wrong.items)
    assert wrong.large_share is None and wrong.interval == (0.0, pytest.approx(0.658, abs=1e-3))

    assert rc == 0
    report = json.loads(out.read_text())
    assert report["split"] == "all" and report["tasks"] == str(tasks)
    assert report["settings"]["extra_body"] == {"routing_trace": False}
    assert [s["label"] for s in report["systems"]] == ["served", "again"]
    for system in report["systems"]:
        assert system["model"] == SERVED  # "again" took the default model name
        check_accounting(system)
    # greedy on the same server: the same answers, whichever way they were asked
    responses = {item.id: item.response for item in result.items}
    for system in report["systems"]:
        assert {i["id"]: i["response"] for i in system["items"]} == responses
