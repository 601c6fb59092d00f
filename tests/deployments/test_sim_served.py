"""Simulated models behind the real app (conf/sim_paper.yaml's models=sim_paper): the official
openai client against Serve, ZeroMQ and the real step loop, no model files; and the host-path
benchmark end to end at a tiny size, so it cannot rot (its figures are not asserted)."""

from __future__ import annotations

import httpx
import openai

from loadtest.host_path import main as host_main
from loadtest.host_path import run_served, sim_overrides
from tokenrouter_ray.simulation.served import FILLER, sim_tokenizer


def expected_text(prompt_tokens: int, n: int) -> str:
    """What the simulated models write: the filler's tokens, by position."""
    tok = sim_tokenizer()
    filler = tok.encode(FILLER, add_special_tokens=False)
    return tok.decode([filler[(prompt_tokens + i) % len(filler)] for i in range(n)])


def test_sim_app_answers_the_openai_client_and_reports_its_host_path(serve_app) -> None:
    with serve_app(sim_overrides("zero"), "sim-zero") as base:
        client = openai.OpenAI(base_url=base, api_key="none", max_retries=0)
        messages = [{"role": "user", "content": "Plan a trip to Lisbon."}]
        reply = client.chat.completions.create(
            model="tokenrouter", messages=messages, max_tokens=64, temperature=0
        )
        chunks = [
            c.choices[0].delta.content
            for c in client.chat.completions.create(
                model="tokenrouter", messages=messages, max_tokens=64, stream=True
            )
            if c.choices and c.choices[0].delta.content
        ]
        stats = httpx.get(base.removesuffix("/v1") + "/v1/tokenrouter/stats", timeout=10).json()
    usage = reply.usage
    assert usage.completion_tokens == 64 and reply.choices[0].finish_reason == "length"
    assert reply.choices[0].message.content == expected_text(usage.prompt_tokens, 64)
    assert "".join(chunks) == reply.choices[0].message.content
    assert 1 <= len(chunks) <= 64  # one SSE chunk per arrival, several tokens when queued
    counts = reply.model_extra["routing"]["tokens_per_model"]
    assert sum(counts.values()) == 64 and counts["small"] > 0 and counts["large"] > 0
    assert stats["tokens_received"] >= 128
    for name in ("small", "large"):
        model = stats["models"][name]
        assert model["sim"]["steps"] > 0 and model["host"]["steps"] > 0
        assert model["host"]["per_step_us"]["critical"] > 0


def test_host_benchmark_runs_end_to_end_at_a_tiny_size(serve_app, capsys) -> None:
    assert host_main(["--levels", "4", "--window-s", "0.5", "--warmup-s", "0.2", "--no-served"])\
        == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert "paper eager  N=  4" in printed and "zero         N=  4" in printed
    assert "PASS" in printed or "MISS" in printed
    rows = run_served([1], 1.0, 16, serve_app, systems=("zero",))
    (row,) = rows
    assert row["tok_s"] > 0 and row["ttft_ms_p50"] is not None
    assert set(row["models"]) == {"small", "large"}
    assert row["ingress_cpu_us_per_token"] > 0
