"""Every object (k8s/, the chart's renders) against Kubernetes and CRD schemas, offline."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from tests.k8s import manifests, schemas
from tests.k8s.manifests import only

Objects = list[dict[str, Any]]
# The oldest Kubernetes the chart supports that kubernetes-validate has schemas for, and the
# newest it has.
KUBE_VERSIONS = ("1.25", schemas.supported_versions()[-1])


def assert_valid(objects: Objects) -> None:
    problems = [
        problem
        for obj in objects
        for version in KUBE_VERSIONS
        for problem in schemas.errors(obj, version)
    ]
    assert not problems, "\n".join(problems)


def test_k8s_objects_are_valid(k8s_objects: Objects) -> None:
    kinds = {obj["kind"] for obj in k8s_objects}
    assert kinds == {
        "RayService",
        "Ingress",
        "PodMonitor",
        "PrometheusRule",
        "NetworkPolicy",
        "Service",
    }
    assert_valid(k8s_objects)


def test_default_render_is_valid(default_render: Objects) -> None:
    assert_valid(default_render)


def test_variant_render_is_valid(render_values: Callable[..., Objects]) -> None:
    values = manifests.default_values()
    values["transport"]["name"] = "ray"
    values["head"]["nodeSelector"] = {"node-role/cpu": "true"}
    values["env"] = [
        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
    ]
    values["modelCache"]["existingClaim"] = "hf-cache"
    values["imagePullSecrets"] = [{"name": "ghcr"}]
    values["ingress"].update(
        className="nginx",
        host="tokenrouter.example.com",
        tls=[{"secretName": "t", "hosts": ["tokenrouter.example.com"]}],
    )
    values["metrics"]["podMonitor"]["labels"] = {"release": "kube-prometheus-stack"}
    assert_valid(render_values(values))
    values["routers"]["fetch"].update(
        files=[{"name": "r2r.safetensors", "url": "https://example.com/r2r.safetensors"}],
        env=[{"name": "HTTPS_PROXY", "value": "http://proxy:3128"}],
        resources={"limits": {"cpu": "1", "memory": "512Mi"}},
    )
    assert_valid(render_values(values))  # with the init container
    values["routers"] = {"mountPath": "/routers", "existingClaim": "routers"}
    assert_valid(render_values(values))  # with the PVC


def _mutated(obj: dict[str, Any], change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    obj = copy.deepcopy(obj)
    change(obj)
    return obj


def _cluster(obj: dict[str, Any]) -> dict[str, Any]:
    return obj["spec"]["rayClusterConfig"]


def _worker(obj: dict[str, Any]) -> dict[str, Any]:
    return _cluster(obj)["workerGroupSpecs"][0]


def _autoscaler(obj: dict[str, Any], **options: Any) -> None:
    _cluster(obj).update(enableInTreeAutoscaling=True, autoscalerOptions=options)


RAYSERVICE_MISTAKES: dict[str, Callable[[dict[str, Any]], None]] = {
    "misspelled-field": lambda o: _cluster(o).update(workerGroupSpec=[]),
    "non-string-param": lambda o: _worker(o)["rayStartParams"].update({"num-gpus": 1}),
    "missing-group-name": lambda o: _worker(o).pop("groupName"),
    "bad-container-field": lambda o: _worker(o)["template"]["spec"]["containers"][0].update(gpus=1),
    "bad-quantity": lambda o: _worker(o)["template"]["spec"]["containers"][0]["resources"][
        "limits"
    ].update(memory={"Gi": 32}),
    "missing-cluster": lambda o: o["spec"].pop("rayClusterConfig"),
    "bad-template-metadata": lambda o: _worker(o)["template"]["metadata"].update(uid="x"),
    # autoscalerOptions (the chart sets it with autoscaling; docs/user-guide/scaling.md)
    "bad-upscaling-mode": lambda o: _autoscaler(o, upscalingMode="Fast"),
    "bad-idle-timeout": lambda o: _autoscaler(o, idleTimeoutSeconds="1m"),
    "unknown-autoscaler-field": lambda o: _autoscaler(o, idleTimeout=60),
    "bad-autoscaler-mount": lambda o: _autoscaler(o, volumeMounts=[{"name": "writable-0"}]),
    "bad-autoscaler-security": lambda o: _autoscaler(o, securityContext={"privileged": "yes"}),
}
PODMONITOR_MISTAKES: dict[str, Callable[[dict[str, Any]], None]] = {
    "bad-interval": lambda o: o["spec"]["podMetricsEndpoints"][0].update(interval="15 seconds"),
    "missing-selector": lambda o: o["spec"].pop("selector"),
    "bad-relabel-action": lambda o: o["spec"]["podMetricsEndpoints"][0]["relabelings"][0].update(
        action="rename"
    ),
}


@pytest.mark.parametrize("mistake", sorted(RAYSERVICE_MISTAKES))
def test_rayservice_schema_catches(default_render: Objects, mistake: str) -> None:
    broken = _mutated(only(default_render, "RayService"), RAYSERVICE_MISTAKES[mistake])
    assert schemas.errors(broken, KUBE_VERSIONS[-1])


@pytest.mark.parametrize("mistake", sorted(PODMONITOR_MISTAKES))
def test_podmonitor_schema_catches(default_render: Objects, mistake: str) -> None:
    broken = _mutated(only(default_render, "PodMonitor"), PODMONITOR_MISTAKES[mistake])
    assert schemas.errors(broken, KUBE_VERSIONS[-1])


def test_builtin_schema_catches(default_render: Objects) -> None:
    # networking.k8s.io/v1beta1's backend.serviceName, gone from v1.
    ingress = _mutated(
        only(default_render, "Ingress"),
        lambda o: o["spec"]["rules"][0]["http"]["paths"][0]["backend"].update(
            serviceName="tokenrouter-ray-serve-svc"
        ),
    )
    assert schemas.errors(ingress, KUBE_VERSIONS[-1])
