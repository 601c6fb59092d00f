"""``tokenrouter-ray eval``'s argument handling, --write-tasks, and a system that is down."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.net import free_port
from tokenrouter_ray.cli import main
from tokenrouter_ray.errors import UserFacingError
from tokenrouter_ray.quality.builtin import builtin_tasks
from tokenrouter_ray.quality.commands import parse_extra_body, parse_system
from tokenrouter_ray.quality.task_files import load_tasks
from tokenrouter_ray.quality.tasks import split_items


def test_parse_system() -> None:
    assert parse_system("a=http://h:1/v1@m") == ("a", "http://h:1/v1", "m")
    assert parse_system("a=http://h:1/v1") == ("a", "http://h:1/v1", "tokenrouter")
    assert parse_system("b = http://h/v1@Qwen/Qwen3-8B") == ("b", "http://h/v1", "Qwen/Qwen3-8B")
    for bad in ("http://h/v1", "a=", "=http://h/v1", "a=http://h/v1@", "a=localhost:8000@m"):
        with pytest.raises(UserFacingError, match="--system"):
            parse_system(bad)


def test_parse_extra_body() -> None:
    assert parse_extra_body('{"routing": {"threshold": 0.3}}') == {"routing": {"threshold": 0.3}}
    assert parse_extra_body(None) is None
    for bad in ("{", "[1]"):
        with pytest.raises(UserFacingError, match="--extra-body"):
            parse_extra_body(bad)


def test_write_tasks_writes_an_editable_split(tmp_path: Path, capsys) -> None:
    out = tmp_path / "demo.jsonl"
    assert main(["eval", "--write-tasks", "builtin:demo", "--split", "dev", "--out", str(out)]) == 0
    assert load_tasks(out) == split_items(builtin_tasks("demo"), "dev")
    assert "wrote" in capsys.readouterr().out
    assert main(["eval", "--write-tasks", "builtin:demo"]) == 2  # no --out
    assert "needs --out" in capsys.readouterr().err


def test_a_system_that_is_down_is_all_failures(tmp_path: Path, capsys) -> None:
    out = tmp_path / "r.json"
    url = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    argv = ["eval", "--tasks", "builtin:arithmetic", "--limit", "3", "--system", f"down={url}",
            "--out", str(out), "--quiet"]  # fmt: skip
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert "down: every request failed (APIConnectionError" in captured.err
    (system,) = json.loads(out.read_text())["systems"]
    assert system["n"] == system["failures"] == 3 and system["large_share"] is None
    assert [i["id"] for i in system["items"]] == [
        i.id for i in split_items(builtin_tasks("arithmetic"), "test")[:3]
    ]
    assert captured.out.splitlines()[1].split()[:2] == ["down", "0.0%"]


def test_user_errors(capsys) -> None:
    assert main(["eval", "--tasks", "builtin:nope"]) == 2
    assert "unknown built-in task set 'nope'" in capsys.readouterr().err
    assert main(["eval", "--system", "a=http://x/v1", "--system", "a=http://y/v1"]) == 2
    assert "its own label" in capsys.readouterr().err
