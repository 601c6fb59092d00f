"""Fixtures for the offline Kubernetes checks: the binaries, the chart's renders, k8s/'s objects.

A missing `helm` or `kubectl` FAILS the test that needs it (never skips): CI must prove the
chart renders. `render_values` renders the chart with a values dict written to a temp file.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.k8s import manifests, tools

Objects = list[dict[str, Any]]


def _require(name: str) -> Path:
    try:
        return tools.find(name)
    except tools.ToolNotFound as error:
        pytest.fail(f"{error}", pytrace=False)


@pytest.fixture(scope="session")
def helm() -> Path:
    return _require("helm")


@pytest.fixture(scope="session")
def kubectl() -> Path:
    return _require("kubectl")


@pytest.fixture(scope="session")
def default_render(helm: Path) -> Objects:
    return manifests.render(helm=helm)


@pytest.fixture(scope="session")
def k8s_objects() -> Objects:
    """The objects of the files k8s/kustomization.yaml lists (dashboards excluded)."""
    kustomization = yaml.safe_load((manifests.K8S / "kustomization.yaml").read_text())
    objects: Objects = []
    for resource in kustomization["resources"]:
        path = manifests.K8S / resource
        if path.is_file():
            objects.extend(doc for doc in yaml.safe_load_all(path.read_text()) if doc)
    return objects


DIRECT_PORT_OVERRIDES = [  # the chart's own: its ingress replicas on the `ingress` pods
    "ingress.num_replicas=1",
    "ingress.resources={tokenrouter_ingress:1}",
    "ingress.direct_port=8001",
    "ingress.direct_host=null",
]


@pytest.fixture(scope="session")
def conf_serve_config() -> dict[str, Any]:
    """What the chart's default values deploy: conf/r2r_cross_node.yaml, with the direct
    port's overrides after the file's own (directPort is on by default)."""
    config = yaml.safe_load(manifests.CONF.read_text())
    config["applications"][0]["args"]["overrides"] += DIRECT_PORT_OVERRIDES
    return config


@pytest.fixture
def render_values(helm: Path, tmp_path: Path) -> Callable[..., Objects]:
    """render_values(values_dict, chart=CHART) -> the chart's objects with those values."""

    def render(values: dict[str, Any], chart: Path = manifests.CHART) -> Objects:
        path = tmp_path / f"values-{len(list(tmp_path.iterdir()))}.yaml"
        path.write_text(yaml.safe_dump(values))
        return manifests.render("-f", str(path), chart=chart, helm=helm)

    return render
