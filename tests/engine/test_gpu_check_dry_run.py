"""``loadtest.gpu_check`` dry-runs on CPU, so the one device command cannot rot: every check
runs (graphs "on" = the static path eagerly), flash-attn reports SKIP with its reason, a
failing check is recorded with its traceback, the rest still run, and the benchmark is
skipped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest import gpu_check


def test_dry_run_gives_a_full_verdict(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    assert gpu_check.main(["--device", "cpu", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["verdicts"] == {
        "capture": "PASS",
        "capture_threads": "PASS",
        "exact": "PASS",
        "graphs_bf16": "PASS",
        "flash": "SKIP",
        "tensor_parallel": "PASS",  # two gloo ranks on CPU stand in for two GPUs
        "bench": "DONE",
    }
    assert report["flash"]["skipped"]  # the reason, e.g. "flash_attn is not installed"
    harness = report["flash"]["harness_dry_run"]  # SDPA standing in for flash-attn
    assert harness["graphs_equal_static_eager_bitwise"] is True
    assert all(harness[m]["pass"] for m in ("eager", "static_eager", "graphs"))
    assert harness["eager"]["max_abs_diff"] == 0.0  # the same dynamic path, teacher-forced
    assert report["capture"]["kv_outside_scratch_unchanged"] is True
    for arch in ("llama", "qwen3", "mistral", "gemma2"):
        entry = report[f"exact_{arch}_graphs_True"]
        assert entry["requests_equal"] == entry["of"] and entry["static_steps"] > 0
    assert report["graphs_bf16"]["logits_bitwise_equal"] is True
    assert set(report["bench"]) == {"sdpa", "sdpa+graphs"}
    assert report["tp"]["tokens_equal"] is True


def test_a_failing_check_is_reported_and_the_rest_still_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(tmp: Path, report: dict) -> bool:
        report["boom"] = {"ran": True}
        return 1 / 0 > 0

    def fine(tmp: Path, report: dict) -> bool:
        return True

    monkeypatch.setattr(gpu_check, "CHECKS", [("boom", boom), ("fine", fine)])
    out = tmp_path / "report.json"
    assert gpu_check.main(["--device", "cpu", "--out", str(out)]) == 1
    report = json.loads(out.read_text())
    assert report["verdicts"] == {"boom": "FAIL", "fine": "PASS", "bench": "SKIP"}
    assert "ZeroDivisionError" in report["errors"]["boom"]
    assert "Traceback" in report["errors"]["boom"]
    assert report["boom"] == {"ran": True} and "skipped" in report["bench"]
