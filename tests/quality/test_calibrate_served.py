"""``tokenrouter-ray calibrate`` end to end at a tiny size, over real sockets without Ray:
the sweep sends each threshold per request (``routing: {"threshold": x}``) to one served app
(uvicorn -> ingress app -> ``IngressServer`` -> ``LocalRuntime``, tiny small + large, the
entropy policy), scores a dev split, marks the frontier, chooses for a target on dev only,
scores the choice and the large-model reference on the test split, predicts throughput at
the paper's step times and draws the PNG. The tiny models answer garbage, so the answers
here are the large model's own greedy output: scoring then tells the operating points
apart as a real task set would."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from tests.quality.test_eval_served import serve, words
from tokenrouter_ray.quality.evaluate import run_eval
from tokenrouter_ray.quality.task_files import write_tasks
from tokenrouter_ray.quality.tasks import TaskItem

PROMPTS = [[(11 * i + 3 * j) % 120 + 4 for j in range(3 + i % 3)] for i in range(8)]


def test_calibrate_sweeps_chooses_on_dev_and_reports_on_test(served_chain_dirs, tmp_path) -> None:
    from tokenrouter_ray.cli import main

    async def body(url: str) -> tuple[int, dict]:
        # the answers: the large model writing every token (entropy at threshold 0), first
        # word only, so a point scores where it agrees with the large model there
        probe = [TaskItem(id=f"p{i}", prompt=words(p), answer="w1") for i, p in enumerate(PROMPTS)]
        large = await run_eval(
            url,
            "tokenrouter",
            probe,
            max_tokens=6,
            progress=False,
            extra_body={"routing": {"threshold": 0.0}},
        )
        items = [
            TaskItem(
                id=f"q{i}",
                prompt=words(p),
                answer=r.response.split()[0],
                split="dev" if i % 2 == 0 else "test",
            )
            for i, (p, r) in enumerate(zip(PROMPTS, large.items, strict=True))
        ]
        path = tmp_path / "tasks.jsonl"
        write_tasks(items, path)
        argv = [
            "calibrate",
            "--system",
            f"{url}@tokenrouter",
            "--policy",
            "entropy",
            "--tasks",
            str(path),
            "--thresholds",
            "0.3,0.6",
            "--large",
            "threshold:0",
            "--small",
            "threshold:1",
            "--min-accuracy-of-large",
            "0.5",
            "--max-tokens",
            "6",
            "--concurrency",
            "2",
            "--at-concurrency",
            "4",
            "--quiet",
            "--out",
            str(tmp_path / "calib.json"),
            "--plot",
            str(tmp_path / "f.png"),
        ]
        code = await asyncio.to_thread(main, argv)
        return code, json.loads((tmp_path / "calib.json").read_text())

    code, report = serve(served_chain_dirs, body)
    assert code == 0
    refs = report["references_dev"]
    # the references: every position to the large model / none
    assert refs["large"]["large_share"] == 1.0 and refs["small"]["large_share"] == 0.0
    assert refs["large"]["accuracy"] == 1.0  # the answers are its own output
    points = report["dev"]["points"]
    assert [p["threshold"] for p in points] == [0.3, 0.6] and report["dev"]["n"] == 4
    for p in points:
        assert 0.0 <= p["large_share"] <= 1.0 and p["n"] == 4 and p["failures"] == 0
        assert p["interval"][0] <= p["accuracy"] <= p["interval"][1]
        if p["large_share"] > 0:
            assert 0 < p["route_prob"]["small->large"] <= 1
        assert p["predicted"]["tokens_per_s"] > 0 and p["predicted"]["n"] == 4
    # a higher entropy threshold escalates less
    assert points[0]["large_share"] >= points[1]["large_share"]
    assert any(p["pareto"] for p in points)
    chosen = report["chosen"]
    assert chosen["threshold"] in (0.3, 0.6)
    assert chosen["dev"]["accuracy"] >= 0.5 * refs["large"]["accuracy"]  # the target, on dev
    assert chosen["test"]["n"] == 4 and chosen["large_test"]["accuracy"] == 1.0
    assert chosen["override"]["config"] == f"policy.options.threshold={chosen['threshold']:g}"
    assert chosen["override"]["request"] == {"routing": {"threshold": chosen["threshold"]}}
    assert Path(tmp_path / "f.png").read_bytes()[:4] == b"\x89PNG"


def test_a_set_without_answers_is_calibrated_by_teacher_forced_agreement(
    served_chain_dirs, tmp_path
) -> None:
    """No ``answer``: each point scores the share of answer tokens the large model (the
    ``--judge``) would have written there. Its own greedy answers agree everywhere; the
    small model's alone do not."""
    from tokenrouter_ray.cli import main

    items = [
        TaskItem(id=f"q{i}", prompt=words(p), split="dev" if i % 2 == 0 else "test")
        for i, p in enumerate(PROMPTS)
    ]
    path = tmp_path / "open.jsonl"
    write_tasks(items, path)

    async def body(url: str) -> tuple[int, dict]:
        argv = [
            "calibrate", "--system", f"{url}@tokenrouter", "--policy", "entropy",
            "--tasks", str(path), "--thresholds", "0.3", "--large", "threshold:0",
            "--small", "threshold:1", "--judge", served_chain_dirs["large"],
            "--max-tokens", "6", "--concurrency", "2", "--at-concurrency", "4",
            "--quiet", "--out", str(tmp_path / "open.json"),
        ]  # fmt: skip
        code = await asyncio.to_thread(main, argv)
        return code, json.loads((tmp_path / "open.json").read_text())

    code, report = serve(served_chain_dirs, body)
    assert code == 0
    refs = report["references_dev"]
    assert refs["large"]["accuracy"] == 1.0 and refs["large"]["correct"] == 4
    assert refs["small"]["accuracy"] < 1.0
    (point,) = report["dev"]["points"]
    assert point["interval"][0] <= point["accuracy"] <= point["interval"][1]


def test_eval_refuses_a_set_without_answers_unless_judged(tmp_path, capsys) -> None:
    from tokenrouter_ray.cli import main

    path = tmp_path / "open.jsonl"
    write_tasks([TaskItem(id="a", prompt="w1 w2", split="test")], path)
    assert main(["eval", "--tasks", str(path), "--split", "test"]) != 0
    assert "--judge" in capsys.readouterr().err
    mixed = [
        TaskItem(id="a", prompt="w1", split="test"),
        TaskItem(id="b", prompt="w2", answer="w3", split="test"),
    ]
    write_tasks(mixed, path)
    assert main(["eval", "--tasks", str(path), "--split", "test", "--judge", "x"]) != 0
    assert "1 of 2 items have no 'answer'" in capsys.readouterr().err
