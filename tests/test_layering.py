"""The layering rules of docs/architecture.md, checked on the source and in fresh interpreters.

- ``engine/`` imports neither ``routing/`` nor ``runtime/`` (anywhere in a module, lazy
  imports included), and its modules import one another without a circle.
- ``runtime/`` loads neither torch nor ray when imported (a fresh interpreter imports each
  runtime module and looks at ``sys.modules``).
- Ray is imported only in ``deployments/`` and ``tokenrouter_ray/transport/ray*``.
- ``config.py`` imports no ``tuning/`` module.

Imports under ``if TYPE_CHECKING:`` never run and are not counted. A rule that cannot hold
is written into ``ALLOWED`` with the module and the reason, never skipped.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tokenrouter_ray"

# (rule, module) -> why it may break the rule this session. Empty: every rule holds.
ALLOWED: dict[tuple[str, str], str] = {}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def runtime_imports(source: str) -> set[str]:
    """Every module a source imports when it runs: top level, in functions, in ``try``;
    not under ``if TYPE_CHECKING:``."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, ast.Import):
                found.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
                found.add(child.module)
                found.update(f"{child.module}.{alias.name}" for alias in child.names)
            visit(child)

    visit(ast.parse(source))
    return found


def modules_under(*parts: str) -> dict[str, Path]:
    base = PACKAGE.joinpath(*parts)
    return {module_name(p): p for p in sorted(base.rglob("*.py"))}


def violations(rule: str, found: dict[str, set[str]]) -> dict[str, list[str]]:
    return {mod: sorted(bad) for mod, bad in found.items() if bad and (rule, mod) not in ALLOWED}


def test_the_scanner_sees_lazy_imports_and_skips_type_checking_ones() -> None:
    """The rules below can fail: the scanner finds a function-level import."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import torch\n"
        "def f():\n    import ray\n    from tokenrouter_ray.routing import policy\n"
    )
    got = runtime_imports(source)
    assert {"ray", "tokenrouter_ray.routing", "tokenrouter_ray.routing.policy"} <= got
    assert "torch" not in got


def test_engine_imports_neither_routing_nor_runtime() -> None:
    banned = ("tokenrouter_ray.routing", "tokenrouter_ray.runtime")
    found = {
        mod: {name for name in runtime_imports(path.read_text()) if name.startswith(banned)}
        for mod, path in modules_under("engine").items()
    }
    assert violations("engine", found) == {}


def test_engine_modules_import_without_a_circle() -> None:
    engine = modules_under("engine")
    graph = {
        mod: {name for name in runtime_imports(path.read_text()) if name in engine and name != mod}
        for mod, path in engine.items()
    }
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def cycle_from(mod: str, path: list[str]) -> list[str] | None:
        state[mod] = 1
        for dep in sorted(graph[mod]):
            if state.get(dep) == 1:
                return [*path[path.index(dep) :], dep] if dep in path else [mod, dep]
            if dep not in state:
                found = cycle_from(dep, [*path, dep])
                if found:
                    return found
        state[mod] = 2
        return None

    for mod in sorted(graph):
        if mod not in state:
            cycle = cycle_from(mod, [mod])
            assert cycle is None, "import circle in engine/: " + " -> ".join(cycle)


def test_the_app_config_imports_no_tuning_module() -> None:
    """``config.py`` is the schema every entry point loads: the tuner's section is defined
    there, so loading a config never pulls in the Markov model and its numerics."""
    names = runtime_imports((PACKAGE / "config.py").read_text())
    found = {"tokenrouter_ray.config": {n for n in names if n.startswith("tokenrouter_ray.tuning")}}
    assert violations("config", found) == {}


def test_ray_is_imported_only_in_deployments_and_ray_transports() -> None:
    found = {}
    for mod, path in modules_under().items():
        if mod.startswith("tokenrouter_ray.transport.ray"):
            continue
        names = runtime_imports(path.read_text())
        found[mod] = {n for n in names if n == "ray" or n.startswith("ray.")}
    assert violations("ray", found) == {}


_HEAVY_PROBE = """
import importlib, json, sys
heavy = ("torch", "ray")
out = {}
for name in sys.argv[1:]:
    before = {h for h in heavy if h in sys.modules}
    importlib.import_module(name)
    out[name] = sorted(h for h in heavy if h in sys.modules and h not in before)
print(json.dumps(out))
"""


def test_runtime_loads_neither_torch_nor_ray() -> None:
    """Each runtime module imported in turn in a fresh interpreter: the first one that
    pulls torch or ray in is named (the ones after it would hide theirs)."""
    names = sorted(modules_under("runtime"))
    proc = subprocess.run(
        [sys.executable, "-c", _HEAVY_PROBE, *names],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    loaded = {mod: set(heavy) for mod, heavy in json.loads(proc.stdout).items()}
    assert violations("runtime", loaded) == {}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(modules_under("engine")))
def test_each_engine_module_imports_first_in_a_fresh_interpreter(name: str) -> None:
    """A circle that only bites when a given module is imported first shows here."""
    proc = subprocess.run(
        [sys.executable, "-c", f"import {name}"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
