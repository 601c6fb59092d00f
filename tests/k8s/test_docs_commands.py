"""The commands of README's "On a GPU cluster" and docs/deployment/kubernetes.md's "Install",
run as far
as a machine without Docker, GPU or cluster allows: the `docker build` tag is the image the
chart renders, the exact `helm install` flags render (as `helm template`) to pods on that image
that fetch the router, the `import-router` line parses with the real CLI, and the `curl`
body is a valid request."""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.k8s import manifests
from tests.k8s.manifests import only
from tests.k8s.test_schemas import assert_valid

README = manifests.REPO / "README.md"
DOCS = manifests.REPO / "docs" / "deployment" / "kubernetes.md"
ENV = {"REGISTRY": "registry.example.com/ml", "ROUTER_URL": "https://x.example/r2r.safetensors"}


def section_commands(path: Path, heading: str) -> list[list[str]]:
    """The shell commands of the first fenced block under ``heading``: continuation lines
    joined, comments dropped, ``export`` applied, words split and expanded as a shell would."""
    text = path.read_text()
    start = text.index(f"\n{heading}\n")
    block = re.search(r"```(?:bash|sh)\n(.*?)```", text[start:], re.S)
    assert block, f"no shell block under {heading}"
    env = dict(ENV)
    commands = []
    for line in block.group(1).replace("\\\n", " ").splitlines():
        line = line.split(" #", 1)[0].strip() if not line.lstrip().startswith("#") else ""
        if not line:
            continue
        words = shlex.split(line.rstrip("&").strip())
        if words[0] == "export":
            name, value = words[1].split("=", 1)
            env.setdefault(name, value)  # the test's values win over the docs' examples
            continue
        commands.append([_expand(w, env) for w in words])
    return commands


def _expand(word: str, env: dict[str, str]) -> str:
    return re.sub(r"\$(\w+)", lambda m: env[m.group(1)], word)


def find(commands: list[list[str]], *prefix: str) -> list[str]:
    matches = [c for c in commands if c[: len(prefix)] == list(prefix)]
    assert len(matches) == 1, f"{prefix}: {matches}"
    return matches[0]


SECTIONS = [(README, "## On a GPU cluster"), (DOCS, "## Install")]


@pytest.mark.parametrize(("path", "heading"), SECTIONS, ids=["readme", "kubernetes.md"])
def test_helm_install_renders_the_pushed_image_and_fetches_the_router(
    path: Path, heading: str, helm: Path, conf_serve_config: dict[str, Any]
) -> None:
    commands = section_commands(path, heading)
    install = find(commands, "helm", "install", "tokenrouter-ray")
    chart, flags = install[3], install[4:]
    assert manifests.REPO / chart == manifests.CHART
    flags = [f for f in flags if f not in ("--create-namespace",)]
    objects = manifests.render(*flags, helm=helm)
    assert_valid(objects)
    rayservice = only(objects, "RayService")
    assert yaml.safe_load(rayservice["spec"]["serveConfigV2"]) == conf_serve_config

    app_version = yaml.safe_load((manifests.CHART / "Chart.yaml").read_text())["appVersion"]
    image = f"{ENV['REGISTRY']}/tokenrouter-ray:{app_version}"
    cluster = rayservice["spec"]["rayClusterConfig"]
    templates = [cluster["headGroupSpec"]["template"]] + [
        g["template"] for g in cluster["workerGroupSpecs"]
    ]
    router_url = ENV["ROUTER_URL"] if path == README else None
    for template in templates:
        spec = template["spec"]
        assert spec["containers"][0]["image"] == image
        env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
        assert env["TOKENROUTER_ROUTER_DIR"] == "/routers"
        [init] = spec["initContainers"]
        script = init["command"][-1]
        assert script.startswith("curl -fsSL --retry 5 -o '/routers/r2r.safetensors' '")
        if router_url:
            assert f"'{router_url}'" in script

    if path == README:  # the build and push before it name the same image
        assert find(commands, "docker", "build") == ["docker", "build", "-t", image, "."]
        assert find(commands, "docker", "push") == ["docker", "push", image]


def test_docs_build_and_push_the_image_the_values_point_at() -> None:
    commands = section_commands(DOCS, "## The image: build and push")
    app_version = yaml.safe_load((manifests.CHART / "Chart.yaml").read_text())["appVersion"]
    image = f"{ENV['REGISTRY']}/tokenrouter-ray:{app_version}"
    assert find(commands, "docker", "build") == ["docker", "build", "-t", image, "."]
    assert find(commands, "docker", "push") == ["docker", "push", image]


def test_readme_import_router_line_parses() -> None:
    from tokenrouter_ray.cli import build_parser

    command = find(section_commands(README, "## On a GPU cluster"), "tokenrouter-ray")
    args = build_parser().parse_args(command[1:])
    assert args.command == "import-router"
    out = next(v for k, v in vars(args).items() if k in ("out", "output"))
    assert Path(str(out)).name == "r2r.safetensors"  # the file conf/policy/r2r.yaml reads
    assert "r2r.safetensors" in (manifests.REPO / "conf" / "policy" / "r2r.yaml").read_text()


def test_readme_curl_body_is_a_valid_request() -> None:
    from tokenrouter_ray.openai import ChatCompletionRequest, parse_request

    curl = find(section_commands(README, "## On a GPU cluster"), "curl")
    body = json.loads(curl[curl.index("-d") + 1])
    request = parse_request(ChatCompletionRequest, body)
    assert request.model == "tokenrouter"
    assert request.chat_template_kwargs == {"enable_thinking": False}
    assert os.path.basename(curl[2]) == "completions"
