"""The package as a user gets it: ``pip install .`` (not editable) into a fresh venv, then,
from outside the checkout, every Serve config in the *installed* ``conf/`` composes and
``deployments.app:build_app`` builds its app with tiny models, and the console script loads
and runs a model. Nothing of the dev extra is installed, so an import that needs it fails.

The venv has no system site packages; the installer's cache is reused (uv's, as
``scripts/_env.sh`` installs with uv; pip where uv is missing), and torch comes from
``constraints/cpu.txt`` (the local CPU wheel). Slow (a full dependency install), but it is
the only test that sees what a wheel really ships.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    from pip._vendor import tomli as tomllib

from tests.tiny_models import save_chain

REPO = Path(__file__).resolve().parent.parent

# Runs inside the fresh venv with `python -I` from a temp directory: neither the checkout nor
# PYTHONPATH is on sys.path, so every import below comes from the installed wheel.
CHECK_INSTALLED = r"""
import importlib, json, sys
from pathlib import Path

import yaml
from ray.serve import Application

import deployments.app
import tokenrouter_ray
from tokenrouter_ray.config import CONF_DIR
from tokenrouter_ray.app_config import compose_config

model_dirs = json.loads(sys.argv[1])
prefix = Path(sys.prefix).resolve()
for module in (tokenrouter_ray, deployments.app):
    assert Path(module.__file__).resolve().is_relative_to(prefix), module.__file__
assert CONF_DIR.is_relative_to(prefix) and not CONF_DIR.is_symlink(), CONF_DIR


def choice(overrides, group, default):
    return next((o.split("=", 1)[1] for o in overrides if o.startswith(group + "=")), default)


base = yaml.safe_load((CONF_DIR / "base.yaml").read_text())
defaults = {k: v for d in base["defaults"] if isinstance(d, dict) for k, v in d.items()}
report = {}
for path in sorted(CONF_DIR.glob("*.yaml")):
    if path.name == "base.yaml":
        continue
    (app,) = yaml.safe_load(path.read_text())["applications"]
    assert app["import_path"] == "deployments.app:build_app", path
    args = dict(app["args"])
    overrides = list(args.get("overrides", []))
    group = choice(overrides, "models", defaults["models"])
    names = list(yaml.safe_load((CONF_DIR / "models" / f"{group}.yaml").read_text()))
    for name in names:  # tiny local checkpoints in place of hub ids / demo models
        overrides += [
            f"models.{name}.path={model_dirs[name]}",
            f"models.{name}.num_gpus=0",
            f"models.{name}.num_cpus=0.5",
        ]
    policy = choice(overrides, "policy", defaults["policy"])
    policy_file = yaml.safe_load((CONF_DIR / "policy" / f"{policy}.yaml").read_text())
    options = policy_file.get("options") or {}  # always / never have none
    if "checkpoint" in options:  # an untrained router: no router file in a fresh install
        overrides.append("policy.options.checkpoint=null")
        if "threshold" in options:  # null / demo: "the file's own", and there is no file
            overrides.append("policy.options.threshold=0.5")
        if policy_file.get("presets"):  # the demo's: rates of the router's training scores
            overrides.append("policy.presets={}")
    args["overrides"] = overrides
    module_name, attr = app["import_path"].split(":")  # what Serve does with import_path
    built = getattr(importlib.import_module(module_name), attr)(args)
    assert isinstance(built, Application), type(built)
    cfg = compose_config(overrides, args.get("config_name", "base"))
    report[path.name] = {"models": cfg.model_names, "policy": cfg.policy.name}
print(json.dumps(report))
"""


def _serve_configs() -> list[str]:
    return sorted(p.name for p in (REPO / "conf").glob("*.yaml") if p.name != "base.yaml")


def test_package_data_and_dependencies_are_declared() -> None:
    """Cheap checks of pyproject.toml that the slow test below proves for real."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    deps = " ".join(project["project"]["dependencies"])
    assert "fastapi" in deps  # deployments/ingress.py imports it
    assert "accelerate" in deps  # transformers requires it to load the demo's GGUF file
    assert project["tool"]["setuptools"]["packages"]["find"]["include"] == [
        "tokenrouter_ray*",
        "deployments*",
    ]  # loadtest/ needs the dev extra: it is not installed
    link = REPO / "tokenrouter_ray" / "conf"
    assert link.is_symlink() and link.resolve() == (REPO / "conf").resolve()


def _copy_source(dest: Path) -> Path:
    """The checkout as pip would see it, without venvs, caches or build leftovers."""
    ignore = shutil.ignore_patterns(
        ".venv", ".git", "build", "dist", "*.egg-info", "__pycache__", ".*_cache"
    )
    shutil.copytree(REPO, dest, symlinks=True, ignore=ignore)
    return dest


def _pip_find_links() -> list[str]:
    """pip's configured find-links (where this kind of machine keeps its CPU torch wheel):
    uv does not read pip's configuration."""
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True
    ).stdout
    return [
        link
        for line in listed.splitlines()
        if line.split("=", 1)[0].endswith("find-links")
        for link in line.split("=", 1)[1].strip("'\"").split()
    ]


def _install(
    python: Path, src: Path, env: dict[str, str], cwd: Path
) -> subprocess.CompletedProcess:
    """``<installer> install -c constraints/cpu.txt <src>``: uv where the dev venv has it (the
    same PEP 517 build, so the same wheel; about 10 s here from a warm cache, against about
    90 s for pip's resolver), else pip. No byte-compiling: the venv runs a few imports."""
    constraint = str(src / "constraints" / "cpu.txt")
    uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    if uv:
        links = [arg for link in _pip_find_links() for arg in ("--find-links", link)]
        cmd = [uv, "pip", "install", "--quiet", "--python", str(python), *links]
    else:
        cmd = [str(python), "-m", "pip", "install", "--quiet", "--no-compile"]
    return subprocess.run(
        [*cmd, "-c", constraint, str(src)],
        capture_output=True, text=True, env=env, cwd=cwd, timeout=840,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_non_editable_install_composes_and_builds_every_config(tmp_path: Path) -> None:
    src = _copy_source(tmp_path / "src")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled")
    install = _install(python, src, env, tmp_path)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]

    dirs = save_chain(tmp_path / "models", with_tokenizer=True)
    script = tmp_path / "check_installed.py"
    script.write_text(CHECK_INSTALLED)
    run = subprocess.run(
        [str(python), "-I", str(script), json.dumps(dirs)],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert sorted(report) == _serve_configs()
    assert report["escalation.yaml"]["models"] == ["small", "mid", "large"]
    assert report["local.yaml"] == {"models": ["small", "large"], "policy": "r2r"}

    # the console script loads a model and generates through the engine
    gen = subprocess.run(
        [str(venv / "bin" / "tokenrouter-ray"), "generate", "w1 w2 w3", "--model", dirs["small"],
         "--max-tokens", "4"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert gen.returncode == 0, gen.stdout[-2000:] + gen.stderr[-3000:]
    assert gen.stdout.strip(), gen.stderr[-2000:]
    for dev_only in ("loadtest", "pytest", "openai"):
        probe = subprocess.run(
            [str(python), "-I", "-c", f"import {dev_only}"], capture_output=True, cwd=tmp_path
        )
        assert probe.returncode != 0, f"{dev_only} is importable from the installed package"
