"""The Helm chart: lint, the default layout, value variants, rejected values, dashboards."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.k8s import manifests, tools
from tests.k8s.conftest import DIRECT_PORT_OVERRIDES
from tests.k8s.manifests import only

Objects = list[dict[str, Any]]


def serve_config(objects: Objects) -> dict[str, Any]:
    return yaml.safe_load(only(objects, "RayService")["spec"]["serveConfigV2"])


def ray_resources(param: str) -> dict[str, float]:
    """Parses rayStartParams.resources the way Ray's KubeRay autoscaler does: the value is a
    double-quoted JSON object with backslash-escaped inner quotes, as a shell would read it."""
    assert param.startswith('"') and param.endswith('"'), param
    return json.loads(param[1:-1].replace('\\"', '"'))


def pod_templates(rayservice: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Group name ("head" for the head) -> pod template."""
    cluster = rayservice["spec"]["rayClusterConfig"]
    templates = {"head": cluster["headGroupSpec"]["template"]}
    templates.update({g["groupName"]: g["template"] for g in cluster["workerGroupSpecs"]})
    return templates


def ports(template: dict[str, Any]) -> dict[str, int]:
    container = template["spec"]["containers"][0]
    return {p["name"]: p["containerPort"] for p in container["ports"]}


def test_helm_is_the_official_binary(helm: Path) -> None:
    result = tools.run(helm, "version", "--short")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(("v3.", "v4.")), result.stdout


def test_lint_strict(helm: Path) -> None:
    result = tools.run(helm, "lint", "--strict", str(manifests.CHART))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


def kinds(objects: Objects) -> list[str]:
    """Sorted kinds, dashboard ConfigMaps left out (they follow k8s/dashboards/*.json)."""
    return sorted(obj["kind"] for obj in objects if obj["kind"] != "ConfigMap")


def test_default_render_is_the_cross_node_layout(default_render: Objects) -> None:
    assert kinds(default_render) == [
        "Ingress",
        "NetworkPolicy",
        "PodMonitor",
        "PrometheusRule",
        "RayService",
        "Secret",
        "Service",  # the direct port's (test_chart_direct_port.py)
    ]
    dashboards = sorted(k for o in default_render if o["kind"] == "ConfigMap" for k in o["data"])
    assert dashboards == sorted(p.name for p in (manifests.K8S / "dashboards").glob("*.json"))


def test_default_serve_config_is_conf_r2r_cross_node(
    default_render: Objects, conf_serve_config: dict[str, Any]
) -> None:
    assert serve_config(default_render) == conf_serve_config


def test_head_group(default_render: Objects) -> None:
    head = only(default_render, "RayService")["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert head["rayStartParams"] == {
        "num-cpus": "0",
        "dashboard-host": "$(POD_IP)",  # the pod's own address, not every interface
        "metrics-export-port": "8080",
        "node-manager-port": "6380",
        "object-manager-port": "6381",
        "runtime-env-agent-port": "6382",
        "dashboard-agent-grpc-port": "6383",
        "dashboard-agent-listen-port": "52365",
        "min-worker-port": "10002",
        "max-worker-port": "10999",
    }
    assert ports(head["template"]) == {
        "gcs-server": 6379,
        "dashboard": 8265,
        "client": 10001,
        "serve": 8000,
        "metrics": 8080,
    }


def test_one_gpu_worker_group_per_model(default_render: Objects) -> None:
    cluster = only(default_render, "RayService")["spec"]["rayClusterConfig"]
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    expected = {"small": (1, "tokenrouter_small"), "large": (1, "tokenrouter_large")}
    assert set(groups) == {*expected, "ingress"}  # the direct port's CPU-only group
    for name, (gpus, node_resource) in expected.items():
        group = groups[name]
        assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == 1
        assert ray_resources(group["rayStartParams"]["resources"]) == {node_resource: 1}
        assert group["rayStartParams"]["metrics-export-port"] == "8080"
        spec = group["template"]["spec"]
        container = spec["containers"][0]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == gpus
        assert ports(group["template"]) == {"serve": 8000, "metrics": 8080}
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert mounts["dshm"] == "/dev/shm"
        assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec[
            "tolerations"
        ]


def test_ingress_targets_the_serve_service_without_the_direct_port(
    render_values: Callable[..., Objects],
) -> None:
    values = manifests.default_values()
    values["directPort"]["enabled"] = False
    objects = render_values(values)
    rayservice = only(objects, "RayService")
    backend = only(objects, "Ingress")["spec"]["rules"][0]["http"]["paths"][0]["backend"]
    assert backend["service"]["name"] == f"{rayservice['metadata']['name']}-serve-svc"
    assert backend["service"]["port"]["number"] == serve_config(objects)["http_options"]["port"]


def test_pod_monitor_scrapes_every_ray_pod(default_render: Objects) -> None:
    rayservice = only(default_render, "RayService")
    monitor = only(default_render, "PodMonitor")["spec"]
    selector = monitor["selector"]["matchLabels"]
    [endpoint] = monitor["podMetricsEndpoints"]
    cluster = rayservice["spec"]["rayClusterConfig"]
    params = [cluster["headGroupSpec"]["rayStartParams"]] + [
        g["rayStartParams"] for g in cluster["workerGroupSpecs"]
    ]
    for name, template in pod_templates(rayservice).items():
        assert selector.items() <= template["metadata"]["labels"].items(), name
        assert ports(template)[endpoint["port"]] == 8080, name
    assert all(p["metrics-export-port"] == "8080" for p in params)


def test_live_quality_alert(default_render: Objects, render_values: Callable[..., Objects]) -> None:
    """The PrometheusRule alerts on the live-quality counters the app exports (the ``ray_``
    names a scrape shows), with the floor, window and count from the values."""
    from tokenrouter_ray.metrics import exported_names

    [rule] = only(default_render, "PrometheusRule")["spec"]["groups"][0]["rules"]
    assert rule["alert"] == "TokenrouterLiveAgreementLow" and rule["for"] == "15m"
    used = set(re.findall(r"ray_tokenrouter_\w+", rule["expr"]))
    assert used and used <= exported_names()
    assert ") < 0.8" in rule["expr"] and ">= 20" in rule["expr"] and "[30m]" in rule["expr"]
    values = manifests.default_values()
    values["metrics"]["alerts"] |= {"agreementFloor": 0.9, "window": "1h"}
    [rule] = only(render_values(values), "PrometheusRule")["spec"]["groups"][0]["rules"]
    assert ") < 0.9" in rule["expr"] and "[1h]" in rule["expr"]
    values["metrics"]["alerts"]["enabled"] = False
    assert not [o for o in render_values(values) if o["kind"] == "PrometheusRule"]


def test_transport_ray_opens_no_peer_port(render_values: Callable[..., Objects]) -> None:
    values = manifests.default_values()
    values["transport"]["name"] = "ray"
    objects = render_values(values)
    assert serve_config(objects)["applications"][0]["args"]["overrides"][2] == "transport=ray"
    for name, template in pod_templates(only(objects, "RayService")).items():
        assert "peer-zmq" not in ports(template), name


def test_values_variant(render_values: Callable[..., Objects]) -> None:
    values = manifests.default_values()
    values["serve"]["extraOverrides"] = ["tuner.period_s=5"]
    values["transport"]["zmqPorts"] = {"first": 6000, "last": 6007}
    values["ingress"].update(
        className="nginx",
        host="tokenrouter.example.com",
        tls=[{"secretName": "tokenrouter-tls", "hosts": ["tokenrouter.example.com"]}],
    )
    values["metrics"]["podMonitor"]["enabled"] = False
    values["metrics"]["alerts"]["enabled"] = False
    medium = json.loads(json.dumps(values["models"][0]))
    medium.update(name="medium", hfId="Qwen/Qwen3-8B", nodeResource="tokenrouter_medium")
    values["models"].insert(1, medium)
    values["models"][2]["worker"]["nodeSelector"] = {"nvidia.com/gpu.product": "NVIDIA-H100"}
    objects = render_values(values)

    assert kinds(objects) == ["Ingress", "NetworkPolicy", "RayService", "Secret", "Service"]
    overrides = serve_config(objects)["applications"][0]["args"]["overrides"]
    assert overrides[5:] == [
        "tuner.speed_bypass={}",  # on by default (speedBypass)
        "transport.zmq.port_range=[6000,6007]",
        "transport.zmq.curve=true",  # on by default
        *DIRECT_PORT_OVERRIDES,  # on by default (directPort)
        "tuner.period_s=5",
    ]
    groups = only(objects, "RayService")["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert [g["groupName"] for g in groups] == ["small", "medium", "large", "ingress"]
    assert groups[2]["template"]["spec"]["nodeSelector"] == {
        "nvidia.com/gpu.product": "NVIDIA-H100"
    }
    ingress = only(objects, "Ingress")["spec"]
    assert ingress["ingressClassName"] == "nginx"
    assert ingress["rules"][0]["host"] == "tokenrouter.example.com"
    assert ingress["tls"][0]["secretName"] == "tokenrouter-tls"


def test_tensor_parallel_large_model(render_values: Callable[..., Objects]) -> None:
    """TP 2 on the large model: its pod gets both GPUs (all ranks of a replica share a pod)
    and the Serve config uses the models group that sets tensor_parallel 2."""
    values = manifests.default_values()
    values["serve"]["modelsConfig"] = "qwen3_r2r_tp2"
    values["models"][1].update(gpus=2, tensorParallel=2)
    objects = render_values(values)
    assert "models=qwen3_r2r_tp2" in serve_config(objects)["applications"][0]["args"]["overrides"]
    spec, container = _ray_containers(objects)["large"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert spec["containers"][0] is container


def _ray_containers(objects: Objects) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """Group name -> (pod spec, Ray container)."""
    return {
        name: (template["spec"], template["spec"]["containers"][0])
        for name, template in pod_templates(only(objects, "RayService")).items()
    }


def test_default_image_is_the_documented_build(default_render: Objects) -> None:
    chart = yaml.safe_load((manifests.CHART / "Chart.yaml").read_text())
    for name, (_, container) in _ray_containers(default_render).items():
        assert container["image"] == f"tokenrouter-ray:{chart['appVersion']}", name


def test_routers_default_to_an_empty_dir_named_by_the_env(default_render: Objects) -> None:
    for name, (spec, container) in _ray_containers(default_render).items():
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["TOKENROUTER_ROUTER_DIR"] == "/routers", name
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        assert mounts["routers"]["mountPath"] == "/routers", name
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["routers"] == {"name": "routers", "emptyDir": {}}, name
        assert "initContainers" not in spec, name


def test_routers_from_an_existing_claim(render_values: Callable[..., Objects]) -> None:
    values = manifests.default_values()
    values["routers"].update(existingClaim="tokenrouter-routers", mountPath="/srv/routers")
    for name, (spec, container) in _ray_containers(render_values(values)).items():
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["TOKENROUTER_ROUTER_DIR"] == "/srv/routers", name
        mount = next(m for m in container["volumeMounts"] if m["name"] == "routers")
        assert mount == {"name": "routers", "mountPath": "/srv/routers", "readOnly": True}
        volume = next(v for v in spec["volumes"] if v["name"] == "routers")
        assert volume["persistentVolumeClaim"] == {
            "claimName": "tokenrouter-routers",
            "readOnly": True,
        }
        assert "initContainers" not in spec, name


def test_routers_fetched_by_an_init_container(render_values: Callable[..., Objects]) -> None:
    url = "https://models.example.com/routers/qwen3-r2r.safetensors"
    values = manifests.default_values()
    values["routers"]["fetch"]["files"] = [
        {"name": "r2r.safetensors", "url": url},
        {"name": "citer.safetensors", "url": url.replace("r2r", "citer")},
    ]
    for name, (spec, _) in _ray_containers(render_values(values)).items():
        [init] = spec["initContainers"]
        assert init["image"] == "curlimages/curl:8.11.1"
        assert init["volumeMounts"] == [{"name": "routers", "mountPath": "/routers"}]
        script = init["command"][-1].splitlines()
        assert init["command"][:2] == ["sh", "-ec"], name
        assert script == [
            f"curl -fsSL --retry 5 -o '/routers/r2r.safetensors' '{url}'",
            f"curl -fsSL --retry 5 -o '/routers/citer.safetensors' '{url.replace('r2r', 'citer')}'",
        ]
        assert next(v for v in spec["volumes"] if v["name"] == "routers")["emptyDir"] == {}

    values["routers"]["fetch"] = {
        "image": "amazon/aws-cli:2.22.0",
        "command": ["aws", "s3", "cp", "--recursive", "s3://bucket/routers/", "/routers/"],
        "env": [{"name": "AWS_REGION", "value": "us-east-1"}],
    }
    for spec, _ in _ray_containers(render_values(values)).values():
        [init] = spec["initContainers"]
        assert init["image"] == "amazon/aws-cli:2.22.0"
        assert init["command"] == values["routers"]["fetch"]["command"]
        assert init["env"] == [{"name": "AWS_REGION", "value": "us-east-1"}]


def _bad_values(change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    values = manifests.default_values()
    change(values)
    return values


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (_bad_values(lambda v: v["transport"].update(name="grpc")), "transport/name"),
        (_bad_values(lambda v: v.update(colour="blue")), "colour"),
        (
            _bad_values(lambda v: v["models"][1].update(gpus=1, tensorParallel=2)),
            r"models\[large\]: tensorParallel 2 needs gpus >= 2",
        ),
        (
            _bad_values(
                lambda v: v["routers"].update(
                    existingClaim="routers", fetch={"command": ["sh", "-c", "echo"]}
                )
            ),
            "either existingClaim or fetch",
        ),
        (
            _bad_values(
                lambda v: v["routers"]["fetch"].update(
                    files=[{"name": "r2r.pt", "url": "https://x/a'; rm -rf /"}]
                )
            ),
            "url",
        ),
        (_bad_values(lambda v: v["models"][1].update(name="small")), "appears twice"),
        (_bad_values(lambda v: v["models"][0]["worker"].update(replicas=2)), "replicas must"),
        (_bad_values(lambda v: v["head"]["rayStartParams"].update({"num-gpus": 0})), "num-gpus"),
    ],
    ids=[
        "transport",
        "unknown-key",
        "tensor-parallel",
        "routers-pvc-and-fetch",
        "router-url",
        "duplicate-model",
        "replicas",
        "param-type",
    ],
)
def test_invalid_values_are_rejected(
    render_values: Callable[..., Objects], values: dict[str, Any], message: str
) -> None:
    with pytest.raises(manifests.HelmError, match=message):
        render_values(values)


def test_dashboards_render_from_json_files(
    tmp_path: Path, helm: Path, kubectl: Path, render_values: Callable[..., Objects]
) -> None:
    """A JSON file dropped into k8s/dashboards/ becomes the same ConfigMap in the chart's
    render and in k8s/ (after regeneration); disabled, nothing renders."""
    shutil.copytree(manifests.K8S, tmp_path / "k8s")
    (tmp_path / "helm").mkdir()
    shutil.copytree(manifests.CHART, tmp_path / "helm" / "tokenrouter-ray", symlinks=True)
    chart, k8s = tmp_path / "helm" / "tokenrouter-ray", tmp_path / "k8s"
    dashboard = {"title": "TokenRouter overview", "panels": [], "schemaVersion": 39}
    (k8s / "dashboards" / "tokenrouter_overview.json").write_text(json.dumps(dashboard) + "\n")

    name = "tokenrouter_overview.json"
    [from_chart] = [
        o for o in manifests.render(chart=chart, helm=helm) if name in o.get("data", {})
    ]
    assert from_chart["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(from_chart["data"]["tokenrouter_overview.json"]) == dashboard

    files = manifests.generate(manifests.render(chart=chart, helm=helm), k8s / "dashboards")
    for path, text in files.items():
        (k8s / path).write_text(text)
    [from_kustomize] = [o for o in manifests.kustomize(k8s, kubectl) if name in o.get("data", {})]
    assert from_kustomize == manifests.strip_helm_labels(from_chart)

    values = manifests.default_values()
    values["dashboards"]["enabled"] = False
    assert "ConfigMap" not in {o["kind"] for o in render_values(values, chart=chart)}
