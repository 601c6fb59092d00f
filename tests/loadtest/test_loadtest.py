"""`python -m loadtest` end to end at a tiny size, so the harness cannot rot: every system
(tokenrouter tuned, Eager-Async, R-Stitch, Step-Sync, each model alone, the large model's
stock server, Std. Serving on two stock `transformers serve` processes) on the tiny
random-weight pair, a few 8-token requests each, closed and open loop, through the official
`openai` client over HTTP.

The numbers are the benchmark's business; this asserts on behaviour: every request of every
system finishes with the tokens asked for, the routed systems make the same routing decision
at every position as the served tokenrouter (bernoulli's seeded draws), the single-model
systems never hand off, R-Stitch at tau = 0 (every position uncertain: the large model takes
over at once and keeps the request) scores 100 % agreement with the large model alone and a
100 % large share, the Markov prediction is computed from the tuner's step times, and the
report, tables and plots are written. The report's pieces (steady-state rate, agreement,
length and prediction lines) are checked on hand-made rows below, without servers.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from loadtest.__main__ import write_outputs
from loadtest.prediction import predict, prediction_lines, steady_rate
from loadtest.quality import agreement
from loadtest.report import length_lines
from loadtest.run import PRESETS, run_bench
from loadtest.systems import SYSTEMS, Bench
from tests.deployments.conftest import tiny_overrides
from tokenrouter_ray.app_config import compose_config

ROUTED = ["tokenrouter", "eager_async", "step_sync", "std_serving"]
TINY = PRESETS["tiny"]
IMPORTED = time.monotonic()  # the session's fixtures (Ray, the tiny models) start after this


def background_deploy(serve_http: str) -> Callable[[list[str], str], Any]:
    """A deploy that returns at once: the config is composed here, ``serve.run`` (which
    waits until the app runs) goes to a thread, and the harness polls the app's HTTP route
    (``common.wait_ready``). With the tiny preset's ``early_apps`` the three apps start side
    by side; a failed deploy is raised when its context exits."""
    from ray import serve

    from deployments.app import bind_app

    @contextmanager
    def deploy(overrides: list[str], name: str) -> Iterator[str]:
        app = bind_app(compose_config(overrides))  # Hydra's compose: not from threads
        pool = ThreadPoolExecutor(1, thread_name_prefix=f"deploy-{name}")
        running = pool.submit(serve.run, app, name=name, route_prefix=f"/{name}")
        try:
            yield f"{serve_http}/{name}/v1"
            running.result()
        finally:
            pool.shutdown(wait=True)
            serve.delete(name)

    return deploy


@pytest.fixture(scope="module")
def tiny_run(
    served_chain_dirs: dict[str, str],
    serve_http: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[dict[str, Any], Path]:
    fixtures_s = time.monotonic() - IMPORTED  # Ray cluster, Serve, tiny models (shared)
    dirs = served_chain_dirs
    # The tuner starts from a step-time profile (as `tuner.profile` allows), so the
    # prediction has both models' step times even if this short run gives it no decode step
    # of the large model (handoff resumes longer than two tokens are not step times).
    out = tmp_path_factory.mktemp("loadtest")
    seed_profile = out / "profile.json"
    seed_profile.write_text(json.dumps({"models": {
        "small": {"step_ms": {"1": 2.0, "4": 3.0}}, "large": {"step_ms": {"1": 4.0, "4": 6.0}}
    }}))  # fmt: skip
    tuner = ["tuner=live", "tuner.period_s=0.5", f"tuner.profile={seed_profile}"]
    overrides = tiny_overrides(
        dirs, ["small", "large"], "bernoulli", "zmq_ipc", ["policy.options.p=0.4", *tuner]
    )
    # tau = 0: every position is uncertain, so the large model takes the first position and
    # keeps the request (it hands back only at entropy <= tau): the large model alone
    rstitch = tiny_overrides(
        dirs, ["small", "large"], "rstitch", "zmq_ipc", ["policy.options.tau=0.0", "tuner=static"]
    )
    bench = Bench(
        small_dir=dirs["small"],
        large_dir=dirs["large"],
        p=0.4,
        app_overrides=overrides,
        deploy=background_deploy(serve_http),
        log_dir=str(out),
        dtype="float64",
        memory_budget_gb=0.25,
        in_process=True,
        policy_apps={"rstitch": rstitch},
    )
    result = run_bench(bench, TINY, progress=False)
    result["length_n"] = TINY.length_n
    startup = {r["system"]: round(r["startup_s"], 1) for r in result["rows"]}
    walls = {k: round(v, 1) for k, v in result["system_wall_s"].items()}
    print(
        f"loadtest: session fixtures {fixtures_s:.0f} s (shared with other tests), tiny run "
        f"{result['wall_s']:.0f} s; per system {walls}; start-up {startup}"
    )
    return result, out


def rows_of(result: dict[str, Any], system: str, mode: str = "closed") -> list[dict[str, Any]]:
    return [r for r in result["rows"] if r["system"] == system and r["mode"] == mode]


def rows_of_any(result: dict[str, Any], system: str) -> list[dict[str, Any]]:
    return [r for r in result["rows"] if r["system"] == system]


@pytest.mark.slow
def test_every_system_serves_every_request(tiny_run: tuple[dict[str, Any], Path]) -> None:
    result, _ = tiny_run
    assert result["errors"] == {}
    preset = TINY
    assert set(preset.systems) == set(SYSTEMS) - {"r2r"}  # no trained router for tiny models
    for system in preset.systems:
        modes = ["closed"] if system in preset.system_concurrency else ["closed", "open"]
        assert {r["mode"] for r in rows_of_any(result, system)} >= set(modes), system
        for mode in modes:
            (row,) = rows_of(result, system, mode)
            assert row["errors"] == [], (system, mode)
            assert row["requests"] == row["finished"] == 4, (system, mode)
            assert row["output_tokens"] == 4 * preset.max_tokens, (system, mode)  # ignore_eos
            assert row["tok_s"] > 0 and row["ttft_s"]["p50"] > 0
            assert row["e2e_s"]["p99"] >= row["e2e_s"]["p50"] >= row["ttft_s"]["p50"]
    for system in ("tokenrouter", "eager_async"):  # the served app reports its safety net
        assert rows_of(result, system)[0]["deferred_timeouts"] == 0, system
    for system in preset.length_systems:
        (row,) = rows_of(result, system, "length")
        assert row["max_tokens"] == preset.lengths[0]
        assert row["output_tokens"] == row["requests"] * preset.lengths[0]


def per_request_routing(row: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Tokens by model per prompt text (the same requests go to every system)."""
    return {rec["index"]: rec["routing"]["tokens_per_model"] for rec in row["records"]}


@pytest.mark.slow
def test_routed_systems_make_the_same_decisions(tiny_run: tuple[dict[str, Any], Path]) -> None:
    result, _ = tiny_run
    for mode in ("closed", "open"):
        reference = per_request_routing(rows_of(result, "tokenrouter", mode)[0])
        assert any(t.get("large", 0) > 0 for t in reference.values())  # p = 0.4 escalates
        assert any(t.get("small", 0) > 0 for t in reference.values())
        for system in ROUTED[1:]:
            assert per_request_routing(rows_of(result, system, mode)[0]) == reference, system
    for system in ("large_alone", "small_alone", "large_stock"):
        (row,) = rows_of(result, system)
        assert row["handoffs_per_request"] == 0
        assert len(row["tokens_per_model"]) == 1
    assert rows_of(result, "std_serving")[0]["handoffs_per_request"] > 0


@pytest.mark.slow
def test_quality_against_the_large_model_alone(tiny_run: tuple[dict[str, Any], Path]) -> None:
    result, _ = tiny_run
    by_system = {q["system"]: q for q in result["quality"]}
    assert result["quality"][0]["system"] == "large_alone"
    assert set(by_system) == {r["system"] for r in result["rows"] if r["mode"] == "closed"}
    ref = by_system["large_alone"]
    assert ref["match"] == ref["prefix"] == 1.0 and ref["large_share"] == 1.0
    assert ref["teacher_forced"] == 1.0  # the served engine's greedy = transformers' (float64)
    assert ref["compared_positions"] == ref["compared_requests"] * TINY.max_tokens
    stitch = by_system["rstitch"]  # tau = 0: the large model wrote every token
    assert stitch["large_share"] == 1.0
    assert stitch["match"] == stitch["prefix"] == stitch["teacher_forced"] == 1.0
    assert by_system["small_alone"]["large_share"] == 0.0
    bern = by_system["tokenrouter"]  # p = 0.4: a mix, and no better than the large model
    assert 0.0 < bern["large_share"] < 1.0
    assert 0.0 <= bern["prefix"] <= bern["match"] <= 1.0
    # every position the large model wrote is its own greedy choice given that prefix
    assert bern["large_share"] <= bern["teacher_forced"] <= 1.0


@pytest.mark.slow
def test_prediction_from_the_tuners_step_times(tiny_run: tuple[dict[str, Any], Path]) -> None:
    result, _ = tiny_run
    (row,) = rows_of(result, "tokenrouter")
    tuner = row["tuner"]
    assert set(tuner["step_ms"]) == {"small", "large"}
    assert "1" in tuner["step_ms"]["large"]  # the seeded profile (or a measured step)
    pred = predict(row, tuner)
    assert "error" not in pred, pred
    assert pred["n"] == TINY.concurrency[0]
    assert pred["thresholds"] == [tuner["thresholds"][m][pred["n"]] for m in ("small", "large")]
    assert pred["predicted_tok_s"] > 0 and pred["measured_tok_s"] > 0
    assert pred["best_tok_s"] >= max(pred["predicted_tok_s"], pred["all_one_tok_s"])
    assert abs(pred["escalation_rate"] - 0.4) < 0.4  # the level's large share, p = 0.4


@pytest.mark.slow
def test_report_table_targets_and_plots(tiny_run: tuple[dict[str, Any], Path]) -> None:
    result, out = tiny_run
    text = write_outputs(result, str(out), "tiny run")
    for system in TINY.systems:
        assert SYSTEMS[system][0] in text
    assert any(line.startswith(("- PASS", "- MISS")) for line in text.splitlines())
    assert "measured vs Markov prediction at N=2" in text
    assert "tuner's thresholds at N=2" in text
    assert "| R-Stitch | N=2 |" in text  # the speed-next-to-quality table
    saved = json.loads((out / "results.json").read_text())
    assert len(saved["rows"]) == len(result["rows"])
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == ["loadtest_latency_cdf.png", "loadtest_lengths.png", "loadtest_throughput.png"]
    for png in out.glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------ the report's pieces, no servers
def record(index: int, first: float, end: float, chunks: list[float], tokens: int) -> dict:
    return {"index": index, "first": first, "end": end, "chunk_times": chunks, "tokens": tokens,
            "start": 0.0, "text": "", "routing": {}}  # fmt: skip


def test_steady_rate_counts_only_the_time_all_n_decode() -> None:
    """Two requests: both decode from t = 1 to t = 3; one token per 0.1 s each in between,
    and tokens outside that window (ramp-up, tail) do not count."""
    a = record(0, 0.5, 3.0, [0.5 + 0.1 * k for k in range(26)], 26)
    b = record(1, 1.0, 4.0, [1.0 + 0.1 * k for k in range(31)], 31)
    rate, seconds = steady_rate({"records": [a, b]}, 2)
    assert seconds == pytest.approx(2.0)
    assert rate == pytest.approx(20.0, rel=0.06)  # 2 requests x 10 tokens/s
    assert steady_rate({"records": [a, b]}, 3) == (pytest.approx(float("nan"), nan_ok=True), 0.0)


def test_agreement_match_and_prefix() -> None:
    assert agreement([1, 2, 3, 4], [1, 2, 3, 4]) == (1.0, 1.0, 4)
    assert agreement([1, 9, 3, 4], [1, 2, 3, 4]) == (0.75, 0.25, 4)
    assert agreement([1, 2], [1, 2, 3, 4]) == (1.0, 1.0, 2)  # a cut answer: what it has
    assert agreement([], [1])[2] == 0  # nothing to compare


def level(system: str, max_tokens: int, tok_s: float, n: int = 8) -> dict[str, Any]:
    return {"system": system, "label": system, "mode": "length", "concurrency": n,
            "max_tokens": max_tokens, "tok_s": tok_s, "finished": n, "requests": n}  # fmt: skip


def test_length_lines_compare_1024_with_256() -> None:
    rows = [
        level("tokenrouter", 256, 20.0),
        level("tokenrouter", 1024, 18.0),
        level("std_serving", 256, 4.0),
        level("std_serving", 1024, 1.0),
    ]
    ours, theirs = length_lines(rows, 8)
    assert ours.startswith("PASS tokenrouter") and "90%" in ours
    assert theirs.startswith("info Std. Serving loses 75%")
    (miss,) = length_lines([level("tokenrouter", 256, 20.0), level("tokenrouter", 1024, 10.0)], 8)
    assert miss.startswith("MISS")
    (other,) = length_lines([level("tokenrouter", 64, 20.0), level("tokenrouter", 256, 19.0)], 8)
    assert other.startswith("info") and "--preset lengths" in other


def test_prediction_explains_an_all_one_table() -> None:
    """Step times that grow steeply with the batch (a CPU): deferring cannot pay, the tuner
    kept every threshold 1, and the report says what the model predicts for the best
    deferring table next to all-1."""
    steps = {m: {"1": 50.0, "2": 100.0, "4": 200.0, "8": 400.0} for m in ("small", "large")}
    tuner = {
        "thresholds": {"small": [1] * 9, "large": [1] * 9},
        "step_ms": steps,
        "spec": {"grain_ms": 5.0},
        "decisions": 3,
        "last": {"reason": "current thresholds best"},
        "history": [],
    }
    recs = [record(k, 1.0, 9.0, [1.0 + 0.5 * j for j in range(17)], 17) for k in range(8)]
    row = {"concurrency": 8, "tok_s": 10.0, "records": recs,
           "tokens_per_model": {"small": 650, "large": 350}}  # fmt: skip
    pred = predict(row, tuner)
    assert pred["escalation_rate"] == pytest.approx(0.35)
    assert pred["thresholds"] == [1, 1] and pred["best"] == [1, 1]
    assert pred["best_deferring_tok_s"] < pred["all_one_tok_s"]
    assert pred["measured_tok_s"] == pytest.approx(16.0, rel=0.1)  # 8 x 2 tokens/s steady
    target, why = prediction_lines(pred)
    assert target.startswith(("PASS", "MISS")) and "N=8" in target
    assert "all-1 predicts" in why and "best table that defers" in why


def test_serve_compares_routing_modes_side_by_side() -> None:
    """``python -m loadtest serve --compare``: each mode is the `routing` its requests send,
    and the verdict holds the default to 0.95x of the best mode at every level."""
    from loadtest.harness import compare_verdict, parse_mode

    assert parse_mode("default") == ("default", None)
    assert parse_mode("model=large") == ("model=large", {"model": "large"})
    assert parse_mode("quality=fast") == ("quality=fast", {"quality": "fast"})
    assert parse_mode("threshold=0.3") == ("threshold=0.3", {"threshold": 0.3})
    with pytest.raises(argparse.ArgumentTypeError):
        parse_mode("fast")
    lines = compare_verdict({1: {"default": 10.0, "quality=fast": 10.4}, 8: {"default": 9.0,
                             "quality=fast": 10.0}})  # fmt: skip
    assert lines[0].endswith("PASS") and "quality=fast" in lines[0]
    assert lines[1].endswith("MISS") and "0.90x" in lines[1]
