"""``loadtest.device.gpu_check`` must start on the GPU image as it is: every third-party module it
can import (through our own modules, at the top of a file or inside a function) is in the
image's package list (``loadtest/device/image_packages_*.txt``, a dated copy) or among the
wheels ``scripts/device_wheels.sh`` prepares. Optional imports (inside ``try`` with an
``except ImportError``) and ``TYPE_CHECKING`` blocks do not count.

The closure is computed from the source (an AST walk), not by importing: importing here
would succeed from the venv and prove nothing about the image."""

from __future__ import annotations

import ast
import re
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OURS = ("tokenrouter_ray", "loadtest")
ENTRY = "loadtest.device.gpu_check"


def module_file(name: str) -> Path | None:
    """The source file of one of our modules (a package's ``__init__.py``), or None."""
    base = ROOT.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _optional(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """Inside ``try: ... except ImportError`` or ``if TYPE_CHECKING:``."""
    while node in parents:
        parent = parents[node]
        if isinstance(parent, ast.Try) and node in parent.body:
            caught = {ast.unparse(h.type) for h in parent.handlers if h.type is not None}
            if caught & {"ImportError", "ModuleNotFoundError", "(ImportError, OSError)"}:
                return True
        if isinstance(parent, ast.If) and "TYPE_CHECKING" in ast.unparse(parent.test):
            return True
        node = parent
    return False


def imports_of(path: Path, package: str) -> set[str]:
    """Absolute names of the modules ``path`` imports, optional ones left out."""
    tree = ast.parse(path.read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    names: set[str] = set()
    for node in ast.walk(tree):
        if _optional(node, parents):
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join([*base, node.module] if node.module else base)
            else:
                mod = node.module or ""
            names.add(mod)
            names.update(f"{mod}.{alias.name}" for alias in node.names)  # maybe submodules
    return names


def closure(entry: str) -> tuple[set[str], set[str]]:
    """(our modules reachable from ``entry``, top-level third-party names they import)."""
    seen: set[str] = set()
    third: set[str] = set()
    todo = [entry]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        path = module_file(name)
        if path is None:
            continue  # ``from x import function``: not a module
        seen.add(name)
        parts = name.split(".")
        for i in range(1, len(parts)):  # importing a.b.c runs a/__init__ and a/b/__init__
            todo.append(".".join(parts[:i]))
        package = name if path.name == "__init__.py" else ".".join(parts[:-1])
        for imported in imports_of(path, package):
            top = imported.split(".")[0]
            if top in OURS:
                todo.append(imported)
            elif top and top not in sys.stdlib_module_names and top != "__future__":
                third.add(top)
    return seen, third


def normalize(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def image_packages() -> tuple[Path, set[str]]:
    lists = sorted((ROOT / "loadtest" / "device").glob("image_packages_*.txt"))
    assert lists, "no dated copy of the device image's package list in loadtest/device/"
    newest = lists[-1]
    names = {
        normalize(line.split("==")[0].strip())
        for line in newest.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    return newest, names


def prepared_wheels() -> dict[str, str]:
    """NAME -> VERSION pinned in scripts/device_wheels.sh's PINS list."""
    text = (ROOT / "scripts" / "device_wheels.sh").read_text()
    block = re.search(r"^PINS=\((.*?)\)", text, re.S | re.M)
    assert block, "scripts/device_wheels.sh has no PINS=( ... ) list"
    pins = re.findall(r"([A-Za-z0-9_.-]+)==([A-Za-z0-9_.+-]+)", block.group(1))
    return {normalize(n): v for n, v in pins}


def test_the_closure_walk_sees_our_lazy_and_package_imports() -> None:
    ours, third = closure(ENTRY)
    assert {"loadtest.device.tp_check", "tokenrouter_ray.engine.request", "tokenrouter_ray"} <= ours
    assert {"torch", "transformers", "msgspec", "pydantic"} <= third  # what gpu_check needs
    assert "flash_attn" not in third  # optional: imported under try/except ImportError


def test_every_third_party_import_of_the_gpu_check_is_on_the_image_or_carried() -> None:
    _, third = closure(ENTRY)
    listing, image = image_packages()
    wheels = prepared_wheels()
    dists = packages_distributions()
    missing = []
    for name in sorted(third):
        candidates = {normalize(d) for d in dists.get(name, [])} or {normalize(name)}
        if not candidates & (image | set(wheels)):
            missing.append(f"{name} (distribution {', '.join(sorted(candidates))})")
    assert not missing, (
        f"loadtest.device.gpu_check imports modules that neither {listing.name} nor "
        f"scripts/device_wheels.sh provides: {missing}; add their wheels to PINS"
    )


def test_the_wheels_are_what_the_tests_here_ran() -> None:
    """The pinned versions are this venv's, so the device runs what CI ran; nothing is
    carried that the image already holds (two versions of one package stop the install),
    except typing-extensions, which pydantic needs newer than the image may have."""
    from importlib.metadata import version

    _, image = image_packages()
    wheels = prepared_wheels()
    assert {"msgspec", "pydantic", "pydantic-core"} <= set(wheels)
    for name, pinned in wheels.items():
        assert version(name) == pinned, f"{name}: device_wheels.sh pins {pinned}"
    assert set(wheels) & image <= {"typing-extensions"}
