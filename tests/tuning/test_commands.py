"""The ``tune`` command, in-process through the main CLI and through its own module."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from tokenrouter_ray import cli
from tokenrouter_ray.errors import UserFacingError
from tokenrouter_ray.tuning import commands
from tokenrouter_ray.tuning.examples import paper_r2r
from tokenrouter_ray.tuning.search import sweep

PAPER_FLAGS = [
    "--step-ms", "small=6.0,large=27.9",
    "--route-prob", "small:small=0.65,small:large=0.35,large:small=1.0",
    "--commit", "small:small=1,small:large=0,large:small=1",
    "--grain-ms", "0.1",
]  # fmt: skip


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    commands.register(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_cli_json_matches_the_library(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["tune", *PAPER_FLAGS, "--concurrency-levels", "1,2,4", "--fix", "small=1", "--json"]
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out) == ["1", "2", "4"]
    for n in (1, 2, 4):
        expected = sweep(paper_r2r(), n, {"small": 1})
        assert out[str(n)]["best"] == expected.best_by_name()
        assert list(out[str(n)]["throughput"]) == [str(b) for b in range(1, n + 1)]
        for point in expected.points:
            label = str(point.thresholds[1])
            assert out[str(n)]["throughput"][label] == pytest.approx(point.throughput, abs=1e-3)


def test_command_table_and_threshold_lists(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lists_file = tmp_path / "lists.json"
    args = _parse(
        ["tune", *PAPER_FLAGS, "--concurrency-levels", "1-3", "--fix", "small=1",
         "--batch-thresholds-out", str(lists_file)]
    )  # fmt: skip
    assert args.func(args) == 0
    text = capsys.readouterr().out
    assert "N=3" in text and "<- best" in text and "best thresholds:" in text
    lists = json.loads(lists_file.read_text())
    assert set(lists) == {"small", "large"} and len(lists["large"]) == 4
    assert lists["small"] == [1, 1, 1, 1]


def test_profile_file_with_joint_labels(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile = {
        "models": {"a": {"step_ms": {"1": 2.0, "4": 3.0}}, "b": 5.0, "c": 9.0},
        "route_prob": {"a:a": 0.6, "a:b": 0.4, "b:a": 0.7, "b:c": 0.3, "c:a": 1.0},
        "commit": {"a:a": 1, "b:a": 1, "c:a": 1},
        "grain_ms": 1.0,
    }
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    argv = ["tune", "--profile", str(path), "--concurrency-levels", "3", "--fix", "a=1", "--json"]
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out)["3"]
    assert "b=1,c=1" in out["throughput"] and "b=2,c=2" in out["throughput"]
    assert "b=2,c=3" not in out["throughput"]  # deadlocks at N=3
    assert set(out["best"]) == {"a", "b", "c"}


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--route-prob", "small:small=0.6,small:large=0.35,large:small=1"], "sum to 0.95"),
        (["--fix", "large=9", "--concurrency-levels", "4"], "deadlock at N=4"),
        (["--fix", "medium=1"], "unknown model 'medium'"),
        (["--concurrency-levels", "0,2"], "positive integers"),
        (["--step-ms", "small=fast,large=27.9"], "not a number"),
    ],
)
def test_bad_input_is_a_user_error(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = dict(zip(PAPER_FLAGS[::2], PAPER_FLAGS[1::2], strict=True))
    flags.update(dict(zip(extra[::2], extra[1::2], strict=True)))
    argv = ["tune", *[item for pair in flags.items() for item in pair]]
    args = _parse(argv)
    with pytest.raises(UserFacingError, match=message):
        args.func(args)
    assert cli.main(argv) == 2
    assert message.split()[0] in capsys.readouterr().err


def test_profile_and_inline_flags_are_exclusive(tmp_path: Path) -> None:
    args = _parse(["tune", "--profile", str(tmp_path / "x.json"), *PAPER_FLAGS])
    with pytest.raises(UserFacingError, match="replaces"):
        args.func(args)
    args = _parse(["tune", "--step-ms", "a=1"])
    with pytest.raises(UserFacingError, match="give --profile FILE"):
        args.func(args)
