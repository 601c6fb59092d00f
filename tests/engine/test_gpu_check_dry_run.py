"""``loadtest.device.gpu_check`` dry-runs on CPU, so the one device command cannot rot: every check
runs (graphs "on" = the static path eagerly; the flagship shapes at toy sizes), flash-attn
reports SKIP with its reason, a failing check is recorded with its traceback, the rest still
run, and the benchmark is skipped; a spent time budget skips what is left and names it in
the ``--only`` rerun line; the benchmark has a seeded sampled row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest.device import gpu_check


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
        "flagship_qwen3_0.6b": "PASS",
        "flagship_qwen3_32b": "PASS",
        "nccl_graph": "PASS",  # gloo, one rank, eagerly
        "tensor_parallel": "PASS",  # two gloo ranks on CPU stand in for two GPUs
        "bench": "DONE",
    }
    assert report["transformers"] and report["torch"] and "cuda" in report
    busy = report["capture_threads"]["busy_thread"]
    assert busy["error"] is None and busy["problem"] is None
    assert busy["iterations_during_capture"] >= 2
    for name in ("qwen3_0.6b", "qwen3_32b"):
        flagship = report[f"flagship_{name}"]
        assert flagship["decode_buckets"] > 0 and flagship["extend_buckets"] > 0
        assert flagship["sampled_tokens_equal"] and flagship["logprobs_equal"]
        assert flagship["logprobs_present"] and flagship["mixed"]["all_finished"]
        assert flagship["plan"]["layers"] == flagship["plan"]["of"]
        rows = report["bench_flagship"][name]
        assert {"batch_1", "batch_2"} <= set(rows)
        assert rows["batch_1"]["step_ms"] > 0 and rows["batch_1"]["static_share"] == 1.0
        sampled = rows["sampled_batch_2"]  # the dry run's largest batch stands in for 8
        assert sampled["params"] == {"temperature": 0.7, "top_p": 0.9}
        assert sampled["steps"] > 0 and 0.0 <= sampled["host_free_share"] <= 1.0
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
    assert report["tp"]["tokens_equal"] is True
    assert report["rerun"] is None  # everything finished
    assert report["sdpa"]["sdpa_backend"] == "efficient"
    assert "CUDNN_ATTENTION" not in report["sdpa"]["allowed"]
    assert {"static_bucket", "decode_group", "prefill"} <= set(report["sdpa"])


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


def test_the_busy_thread_check_fails_when_its_thread_died() -> None:
    def draw_in_capture_mode() -> None:  # what torch.randn on the captured generator did
        raise RuntimeError("Offset increment outside graph capture")

    busy = gpu_check.BusyThread("cpu", work=draw_in_capture_mode)
    busy.start()
    busy.stop()
    problem = gpu_check.busy_problem(busy, during=0, minimum=2)
    assert busy.iterations == 0 and "Offset increment" in busy.error
    assert problem is not None and "died" in problem


def test_the_busy_thread_check_fails_when_its_thread_did_too_little() -> None:
    import threading

    gate = threading.Event()
    busy = gpu_check.BusyThread("cpu", work=lambda: gate.wait(0.01))
    busy.start()
    before = busy.iterations
    after = busy.iterations  # no time passed: a thread blocked through the "capture"
    busy.stop()
    assert busy.error is None and busy.iterations >= 1
    problem = gpu_check.busy_problem(busy, during=after - before, minimum=2)
    assert problem is not None and "did 0 iterations" in problem


def test_the_busy_thread_check_passes_a_thread_that_worked() -> None:
    import time

    busy = gpu_check.BusyThread("cpu")
    busy.start()
    before = busy.iterations
    time.sleep(0.2)
    during = busy.iterations - before
    busy.stop()
    assert busy.error is None and during >= 2
    assert gpu_check.busy_problem(busy, during, minimum=2) is None


def test_a_spent_time_budget_skips_the_remaining_checks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fine(tmp: Path, report: dict) -> bool:
        return True

    monkeypatch.setattr(gpu_check, "CHECKS", [("fine", fine), ("late", fine)])
    out = tmp_path / "report.json"
    assert gpu_check.main(["--device", "cpu", "--out", str(out), "--budget-s", "0"]) == 0
    report = json.loads(out.read_text())
    assert report["verdicts"]["fine"] == "SKIP" and report["verdicts"]["late"] == "SKIP"
    assert "time budget" in report["skipped"]["late"]


def test_the_rerun_line_names_what_did_not_finish(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Gating checks first, then the benchmark, then the non-gating ones; what a spent
    budget skipped comes back as one ``--only`` line (in the JSON and printed last)."""
    ran: list[str] = []

    def check(name: str):
        def run(tmp: Path, report: dict) -> bool:
            ran.append(name)
            return True

        return run

    names = ["capture", "nccl_graph", "exact", "tensor_parallel"]
    monkeypatch.setattr(gpu_check, "CHECKS", [(n, check(n)) for n in names])
    out = tmp_path / "report.json"
    args = ["--device", "cpu", "--out", str(out), "--skip-bench"]
    assert gpu_check.main(args) == 0
    assert ran == ["capture", "exact", "nccl_graph", "tensor_parallel"]
    assert json.loads(out.read_text())["rerun"] is None
    ran.clear()
    assert gpu_check.main([*args, "--budget-s", "0", "--only", "exact,nccl_graph"]) == 0
    report = json.loads(out.read_text())
    assert ran == [] and report["rerun"] == "--only exact,nccl_graph"
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == "rerun: python3 -m loadtest.device.gpu_check --only exact,nccl_graph"


def test_the_graph_pool_is_measured_from_its_own_segments() -> None:
    """``graph_pool_mib`` sums the allocator segments the graphs' pool owns, not every
    reserved byte (nor ``memory_allocated``, which misses the pool's cached blocks)."""
    segments = [
        {"total_size": 2 << 20, "segment_pool_id": (0, 0)},  # the default pool
        {"total_size": 6 << 20, "segment_pool_id": (1, 3)},
        {"total_size": 4 << 20, "segment_pool_id": [1, 3]},  # a list in some versions
        {"total_size": 8 << 20, "segment_pool_id": (1, 4)},  # another graph pool
    ]
    assert gpu_check.pool_segment_bytes(segments, (1, 3)) == 10 << 20
    assert gpu_check.pool_segment_bytes(segments, None) == 0


def test_the_kernel_count_loads_its_padding_in_inference_mode(tmp_path: Path) -> None:
    """A bucket's buffers are inference tensors (made under ``launch`` or the capture): an
    in-place load outside inference mode raises, so the device check's kernel count was
    always "not counted"; ``load_padding`` loads inside it."""
    import torch

    from loadtest.device.gpu_flagship import load_padding
    from tests.engine.conftest import make_engine, save_tiny
    from tokenrouter_ray.engine.request import SamplingParams

    engine = make_engine(save_tiny(tmp_path / "m", "qwen3"), static_batches=True)
    engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=3))
    while engine.has_unfinished:
        engine.commit(engine.execute())
    fwd = next(iter(engine.runner.static.values()))
    with pytest.raises(RuntimeError, match=r"[Ii]nference"):
        fwd.load(fwd.padding)
    load_padding(fwd)
    assert torch.equal(fwd.input_ids[0], fwd.padding.input_ids)


def test_an_unknown_only_name_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A typo in ``--only`` must not run nothing and print PASS."""
    args = ["--device", "cpu", "--out", str(tmp_path / "r.json"), "--only", "exact,nccl"]
    assert gpu_check.main(args) == 2
    assert "no check named nccl" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()
