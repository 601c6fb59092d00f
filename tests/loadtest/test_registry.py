"""Every benchmark in loadtest/ is reachable from ``python -m loadtest``: each module with a
``main`` is in ``BENCHMARKS`` (or is the harness's own entry), each entry names a module with
a ``main``, says what it needs, and is in docs/benchmarks/README.md's table."""

from __future__ import annotations

import ast
from pathlib import Path

from loadtest.__main__ import BENCHMARKS

LOADTEST = Path(__file__).resolve().parents[2] / "loadtest"
# Modules with a ``main`` that are not benchmarks: the entry itself and two servers the
# harness starts as systems under test.
NOT_BENCHMARKS = {
    "loadtest.__main__",
    "loadtest.baselines.dispatcher",
    "loadtest.baselines.step_sync",
}


def modules_with_main() -> set[str]:
    found = set()
    for path in LOADTEST.rglob("*.py"):
        tree = ast.parse(path.read_text())
        if any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body):
            rel = path.relative_to(LOADTEST.parent).with_suffix("")
            found.add(".".join(rel.parts))
    return found


def test_every_benchmark_module_is_a_subcommand() -> None:
    registered = {b.module for b in BENCHMARKS.values()}
    assert modules_with_main() - NOT_BENCHMARKS - registered == set()


def test_every_subcommand_names_a_module_with_main() -> None:
    assert {b.module for b in BENCHMARKS.values()} <= modules_with_main()


def test_the_reproduce_line_of_a_subcommand_is_a_command_that_runs_it(monkeypatch) -> None:
    import shlex

    from loadtest import common

    monkeypatch.setattr(common, "INVOKED_AS", "loadtest host")
    monkeypatch.setattr("sys.argv", ["python -m loadtest host", "--served-systems", "zero x"])
    line = common.command()
    assert shlex.split(line) == [
        "python", "-m", "loadtest", "host", "--served-systems", "zero x"
    ]  # fmt: skip


def test_docs_benchmarks_lists_every_subcommand_with_its_command() -> None:
    doc = (LOADTEST.parent / "docs" / "benchmarks" / "README.md").read_text()
    section = doc.split("\n## Every benchmark and the command that runs it\n", 1)[1]
    section = section.split("\n## ", 1)[0]
    rows = {
        line.split("|")[1].strip().strip("`"): line
        for line in section.splitlines()
        if line.startswith("| `")
    }
    assert set(rows) == set(BENCHMARKS)
    for name, bench in BENCHMARKS.items():
        assert f"`python -m loadtest {name}" in rows[name], name
        assert f"`{bench.module.replace('.', '/')}.py`" in rows[name], name


def test_list_says_what_each_benchmark_needs(capsys) -> None:
    from loadtest.__main__ import list_benchmarks

    listing = list_benchmarks()
    for name, bench in BENCHMARKS.items():
        assert f"  {name} " in listing and f"needs: {bench.needs}" in listing


def test_the_programs_are_named_as_they_are_run() -> None:
    """``--help`` names ``python -m loadtest`` and ``python -m loadtest <name>``, not the
    file's name."""
    for path in LOADTEST.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "ArgumentParser":
                rel = path.relative_to(LOADTEST.parent).with_suffix("")
                module = ".".join(rel.parts)
                names = [n for n, b in BENCHMARKS.items() if b.module == module]
                if module in NOT_BENCHMARKS - {"loadtest.__main__"}:
                    continue
                want = f"python -m loadtest {names[0]}" if names else "python -m loadtest"
                prog = [k.value.value for k in node.keywords if k.arg == "prog"]
                assert prog == [want], (module, prog)
