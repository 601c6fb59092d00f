"""`python -m loadtest` end to end at a tiny size, so the harness cannot rot: every system
(tokenrouter tuned, Eager-Async, Step-Sync, Std. Serving on two stock `transformers serve`
processes, each model alone) on the tiny random-weight pair, a few 8-token requests each,
closed and open loop, through the official `openai` client over HTTP.

The numbers are the benchmark's business; this asserts on behaviour: every request of every
system finishes with the tokens asked for, the routed systems make the same routing decision
at every position as the served tokenrouter (bernoulli's seeded draws), the single-model
systems never hand off, and the report, table and plots are written.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from loadtest.__main__ import write_outputs
from loadtest.run import PRESETS, run_bench
from loadtest.systems import SYSTEMS, Bench
from tests.deployments.conftest import serve_app, tiny_overrides  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow
PORT_BASE = int(os.environ.get("TOKENROUTER_TEST_LOADTEST_PORT", "18240"))
ROUTED = ["tokenrouter", "eager_async", "step_sync", "std_serving"]


@pytest.fixture(scope="module")
def tiny_run(
    served_chain_dirs: dict[str, str],
    serve_app: Any,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[dict[str, Any], Path]:
    dirs = served_chain_dirs
    overrides = tiny_overrides(
        dirs, ["small", "large"], "bernoulli", "zmq_ipc", ["policy.options.p=0.4", "tuner=live"]
    )
    out = tmp_path_factory.mktemp("loadtest")
    bench = Bench(
        small_dir=dirs["small"],
        large_dir=dirs["large"],
        p=0.4,
        app_overrides=overrides,
        deploy=serve_app,
        log_dir=str(out),
        port_base=PORT_BASE,
        dtype="float64",
        memory_budget_gb=0.25,
        in_process=True,
    )
    result = run_bench(bench, PRESETS["tiny"], progress=False)
    result["length_n"] = PRESETS["tiny"].length_n
    return result, out


def rows_of(result: dict[str, Any], system: str, mode: str = "closed") -> list[dict[str, Any]]:
    return [r for r in result["rows"] if r["system"] == system and r["mode"] == mode]


def test_every_system_serves_every_request(tiny_run: tuple[dict[str, Any], Path]) -> None:
    result, _ = tiny_run
    assert result["errors"] == {}
    preset = PRESETS["tiny"]
    for system in SYSTEMS:
        for mode in ("closed", "open"):
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


def test_report_table_targets_and_plots(tiny_run: tuple[dict[str, Any], Path]) -> None:
    result, out = tiny_run
    text = write_outputs(result, str(out), "tiny run")
    for label, _ in SYSTEMS.values():
        assert label in text
    assert any(line.startswith(("- PASS", "- MISS")) for line in text.splitlines())
    saved = json.loads((out / "results.json").read_text())
    assert len(saved["rows"]) == len(result["rows"])
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == ["loadtest_latency_cdf.png", "loadtest_lengths.png", "loadtest_throughput.png"]
    for png in out.glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
