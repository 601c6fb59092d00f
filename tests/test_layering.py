"""The layering rules of docs/design/architecture.md, checked on the source and in fresh
interpreters.

- ``engine/`` imports neither ``routing/`` nor the processes' packages (``ingress/``,
  ``replica/``, ``local.py``), anywhere in a module, lazy imports included.
- The ingress process and a model replica are two processes: ``ingress/`` imports nothing
  from ``replica/`` and ``replica/`` nothing from ``ingress/`` (``local.py`` wires both).
- No import circle anywhere in the package, ``deployments/`` or ``loadtest/``, inside a folder
  or across folders. Here every import counts, ``TYPE_CHECKING`` ones too (two modules that
  each need the other to be read are one module in two files), except a module's import of
  its own package (``from pkg import sub`` is an arrow to ``pkg.sub``, and importing a
  sibling runs the package's ``__init__`` anyway).
- ``ingress/`` and ``replica/`` load neither torch nor ray when imported (a fresh
  interpreter imports each of their modules and looks at ``sys.modules``).
- Ray is imported only in ``deployments/`` and ``tokenrouter_ray/transport/ray*``.
- ``config.py`` imports no ``tuning/`` module.
- The server never imports an offline tool (``TOOLS``: the CLI, the demo build, the eval
  harness, the planner and simulator commands, traceview, dashboards generation), and
  ``replica/`` nothing from ``tuning/``.

Imports under ``if TYPE_CHECKING:`` never run and are not counted, except by the circle
rule. A rule that cannot hold
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

# (rule, module) -> why it may break the rule. Empty: every rule holds.
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


PROCESSES = ("tokenrouter_ray.ingress", "tokenrouter_ray.replica", "tokenrouter_ray.local")


def test_engine_imports_neither_routing_nor_the_processes() -> None:
    banned = ("tokenrouter_ray.routing", *PROCESSES)
    found = {
        mod: {name for name in runtime_imports(path.read_text()) if name.startswith(banned)}
        for mod, path in modules_under("engine").items()
    }
    assert violations("engine", found) == {}


@pytest.mark.parametrize(("side", "other"), [("ingress", "replica"), ("replica", "ingress")])
def test_the_ingress_and_a_replica_import_nothing_of_each_other(side: str, other: str) -> None:
    banned = f"tokenrouter_ray.{other}"
    found = {
        mod: {n for n in all_imports(path.read_text()) if n == banned or n.startswith(banned + ".")}
        for mod, path in modules_under(side).items()
    }
    assert violations("processes", found) == {}


def all_imports(source: str) -> set[str]:
    """Every module a source names in an import, ``TYPE_CHECKING`` ones included."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """module -> the modules of ``sources`` (module -> its text) it imports, by the circle
    rule's count."""
    graph: dict[str, set[str]] = {}
    for mod, source in sources.items():
        names = all_imports(source)
        deps = {name for name in names if name in sources}
        # ``from pkg import sub``: the arrow goes to pkg.sub, not to pkg's __init__
        deps -= {n for n in deps if any(other.startswith(n + ".") for other in deps & names)}
        graph[mod] = {d for d in deps if d != mod and not mod.startswith(d + ".")}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_circle_finder_sees_a_type_checking_circle_and_skips_the_package() -> None:
    """The rule below can fail: a circle through a ``TYPE_CHECKING`` import is found, and a
    submodule's import of its own package is not an arrow."""
    sources = {
        "p": "from p import a\n",
        "p.a": "from p import b\n",
        "p.b": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p.a import X\n",
    }
    graph = import_graph(sources)
    assert graph == {"p": {"p.a"}, "p.a": {"p.b"}, "p.b": {"p.a"}}
    assert circles(graph) == [["p.a", "p.b"]]
    assert circles({**graph, "p.b": set()}) == []


def test_no_import_circle_in_the_package_the_deployments_or_the_benchmarks() -> None:
    paths = {
        **modules_under(),
        **{module_name(p): p for p in sorted((ROOT / "deployments").rglob("*.py"))},
        **{module_name(p): p for p in sorted((ROOT / "loadtest").rglob("*.py"))},
    }
    sources = {mod: path.read_text() for mod, path in paths.items()}
    found = [c for c in circles(import_graph(sources)) if ("circle", c[0]) not in ALLOWED]
    assert found == [], "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_the_app_config_imports_no_tuning_module() -> None:
    """``config.py`` is the schema every entry point loads: the tuner's section is defined
    there, so loading a config never pulls in the Markov model and its numerics."""
    names = runtime_imports((PACKAGE / "config.py").read_text())
    found = {"tokenrouter_ray.config": {n for n in names if n.startswith("tokenrouter_ray.tuning")}}
    assert violations("config", found) == {}


# The offline tools: commands a user runs beside the server, clients of it or of its
# configs. The server (engine, replicas, ingress, transports, routing, the tuner, live
# quality, the simulated engines a config can serve) never imports one of them; a tool may
# import the server.
TOOLS = (
    "tokenrouter_ray.cli",
    "tokenrouter_ray.docs_gen",
    "tokenrouter_ray.dashboards",
    "tokenrouter_ray.traceview",
    "tokenrouter_ray.demo.commands",
    "tokenrouter_ray.demo.large",
    "tokenrouter_ray.demo.small",
    "tokenrouter_ray.demo.router",
    "tokenrouter_ray.quality.builtin",
    "tokenrouter_ray.quality.calibrate",
    "tokenrouter_ray.quality.commands",
    "tokenrouter_ray.quality.evaluate",
    "tokenrouter_ray.quality.frontier",
    "tokenrouter_ray.quality.judge",
    "tokenrouter_ray.quality.scorers",
    "tokenrouter_ray.quality.task_files",
    "tokenrouter_ray.quality.tasks",
    "tokenrouter_ray.simulation.commands",
    "tokenrouter_ray.simulation.loads",
    "tokenrouter_ray.simulation.validate",
    "tokenrouter_ray.tuning.commands",
    "tokenrouter_ray.tuning.examples",
    "tokenrouter_ray.tuning.plan_command",
    "tokenrouter_ray.tuning.simulate",
    "tokenrouter_ray.tuning.step_times",
)


def is_tool(module: str) -> bool:
    return any(module == t or module.startswith(t + ".") for t in TOOLS)


def test_every_tool_named_exists() -> None:
    modules = set(modules_under())
    assert [t for t in TOOLS if t not in modules] == []


def test_the_server_imports_no_offline_tool() -> None:
    """The server sits below its tools: no server module (or ``deployments/``) imports a
    tool, lazily or not, so a replica or the ingress never loads the demo build, the eval
    harness or the planner."""
    paths = {
        **modules_under(),
        **{module_name(p): p for p in sorted((ROOT / "deployments").rglob("*.py"))},
    }
    found = {
        mod: {n for n in runtime_imports(path.read_text()) if is_tool(n)}
        for mod, path in paths.items()
        if not is_tool(mod)
    }
    assert violations("tools", found) == {}


def test_a_replica_imports_nothing_of_the_tuner() -> None:
    """The statistics window a replica records into is the replica's (``replica/window.py``);
    the tuner reads its snapshots, the replica never imports ``tuning/``."""
    found = {
        mod: {
            n for n in runtime_imports(path.read_text()) if n.startswith("tokenrouter_ray.tuning")
        }
        for mod, path in modules_under("replica").items()
    }
    assert violations("replica-tuner", found) == {}


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


def test_the_ingress_and_a_replica_load_neither_torch_nor_ray() -> None:
    """Each ingress and replica module imported in turn in a fresh interpreter: the first
    one that pulls torch or ray in is named (the ones after it would hide theirs)."""
    names = sorted({**modules_under("ingress"), **modules_under("replica")})
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


# Each module imported first in a child forked from one interpreter that holds only the
# third-party libraries (their import is most of the cost, and no circle of ours can hide in
# them): what each child printed when its import failed, "" when it succeeded.
_FORK_EACH = """
import json, os, sys, traceback
import numpy, torch, transformers, transformers.modeling_utils
out = {}
for name in sys.argv[1:]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            __import__(name)
            text = ""
        except BaseException:
            text = traceback.format_exc() or "failed"
        os.write(w, text.encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as pipe:
        out[name] = pipe.read()
    os.waitpid(pid, 0)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def imported_first() -> dict[str, str]:
    proc = subprocess.run(
        [sys.executable, "-c", _FORK_EACH, *sorted(modules_under("engine"))],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(modules_under("engine")))
def test_each_engine_module_imports_first_in_a_fresh_interpreter(
    name: str, imported_first: dict[str, str]
) -> None:
    """A circle that only bites when a given module is imported first shows here."""
    assert imported_first[name] == "", imported_first[name][-2000:]
