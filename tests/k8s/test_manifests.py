"""k8s/: in sync with the chart, buildable by kustomize, deploying conf/r2r_cross_node.yaml."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from tests.k8s import manifests
from tests.k8s.manifests import only

Objects = list[dict[str, Any]]


def test_k8s_is_generated_from_the_chart(helm: Path) -> None:
    stale = manifests.stale_files(helm=helm)
    if stale:
        pytest.fail(
            "k8s/ is stale (" + ", ".join(sorted(stale)) + "); regenerate it with\n"
            "    python -m tests.k8s.manifests --write",
            pytrace=False,
        )


def test_k8s_serve_config_is_conf_r2r_cross_node(
    k8s_objects: Objects, conf_serve_config: dict[str, Any]
) -> None:
    rayservice = only(k8s_objects, "RayService")
    assert yaml.safe_load(rayservice["spec"]["serveConfigV2"]) == conf_serve_config


@pytest.mark.parametrize("source", ["k8s", "chart"])
def test_serve_config_passes_ray_serve_schema(
    source: str, k8s_objects: Objects, default_render: Objects
) -> None:
    objects = k8s_objects if source == "k8s" else default_render
    config = yaml.safe_load(only(objects, "RayService")["spec"]["serveConfigV2"])
    schema = ServeDeploySchema.model_validate(config)
    assert [app.import_path for app in schema.applications] == ["deployments.app:build_app"]


def test_kustomize_builds_the_files(kubectl: Path, k8s_objects: Objects) -> None:
    built = manifests.kustomize(manifests.K8S, kubectl)
    key = lambda obj: (obj["kind"], obj["metadata"]["name"])  # noqa: E731
    plain = [obj for obj in built if obj["kind"] != "ConfigMap"]
    assert sorted(plain, key=key) == sorted(k8s_objects, key=key)
    configmaps = [obj for obj in built if obj["kind"] == "ConfigMap"]
    dashboards = {name: text for obj in configmaps for name, text in obj["data"].items()}
    files = {p.name: p.read_text() for p in (manifests.K8S / "dashboards").glob("*.json")}
    assert dashboards == files


def test_k8s_matches_the_chart_in_what_matters(
    k8s_objects: Objects, default_render: Objects
) -> None:
    """Worker groups, resources and rayStartParams agree (the sync test checks everything;
    this one names the parts a hand edit of k8s/ would most likely break)."""
    plain = only(k8s_objects, "RayService")["spec"]["rayClusterConfig"]
    chart = only(default_render, "RayService")["spec"]["rayClusterConfig"]
    assert plain["headGroupSpec"]["rayStartParams"] == chart["headGroupSpec"]["rayStartParams"]
    assert plain["workerGroupSpecs"] == chart["workerGroupSpecs"]
