"""The chart against strangers on the pod network (docs/deployment/kubernetes.md "Threat
model"): a default-on NetworkPolicy that opens Ray's ports and the ZeroMQ range to this
release's pods only, the Serve port to the ingress controller; no dashboard on every
interface; a ClusterIP-only head service; non-root, read-only pods; one peer secret."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import yaml

from tests.k8s import manifests
from tests.k8s.manifests import only

Objects = list[dict[str, Any]]


def pods(objects: Objects) -> dict[str, dict[str, Any]]:
    cluster = only(objects, "RayService")["spec"]["rayClusterConfig"]
    found = {"head": cluster["headGroupSpec"]}
    found.update({g["groupName"]: g for g in cluster["workerGroupSpecs"]})
    return found


def tcp_ports(rule: dict[str, Any]) -> set[tuple[int, int]]:
    """(first, last) of every port (range) a rule opens."""
    assert all(p["protocol"] == "TCP" for p in rule["ports"])
    return {(p["port"], p.get("endPort", p["port"])) for p in rule["ports"]}


def release_selector(objects: Objects) -> dict[str, str]:
    return only(objects, "NetworkPolicy")["spec"]["podSelector"]["matchLabels"]


def test_network_policy_opens_ray_and_zmq_to_the_release_only(default_render: Objects) -> None:
    policy = only(default_render, "NetworkPolicy")["spec"]
    assert policy["policyTypes"] == ["Ingress"]
    selector = release_selector(default_render)
    for name, group in pods(default_render).items():  # it covers every Ray pod
        assert selector.items() <= group["template"]["metadata"]["labels"].items(), name
    internal, controller, operator, prometheus = policy["ingress"]
    assert internal["from"] == [{"podSelector": {"matchLabels": selector}}]
    values = manifests.default_values()
    zmq = values["transport"]["zmqPorts"]
    rp = values["rayPorts"]
    assert tcp_ports(internal) == {
        *((p, p) for p in (rp["gcs"], rp["dashboard"], rp["client"], rp["nodeManager"])),
        *((p, p) for p in (rp["objectManager"], rp["runtimeEnvAgent"])),
        *((p, p) for p in (rp["dashboardAgentGrpc"], rp["dashboardAgentListen"], 8000, 8080)),
        (8001, 8001),  # the direct port (on by default)
        (rp["minWorker"], rp["maxWorker"]),
        (zmq["first"], zmq["last"]),
    }
    # Every Ray port the pods are started with is one the policy names.
    opened = tcp_ports(internal)
    for name, group in pods(default_render).items():
        params = group["rayStartParams"]
        for key in ("node-manager-port", "object-manager-port", "runtime-env-agent-port"):
            assert (int(params[key]),) * 2 in opened, (name, key)
        assert (int(params["min-worker-port"]), int(params["max-worker-port"])) in opened
    # The app binds its peer mailboxes in exactly the range the policy opens.
    overrides = yaml.safe_load(only(default_render, "RayService")["spec"]["serveConfigV2"])[
        "applications"
    ][0]["args"]["overrides"]
    assert f"transport.zmq.port_range=[{zmq['first']},{zmq['last']}]" in overrides
    assert tcp_ports(controller) == {(8000, 8000), (8001, 8001)}
    assert controller["from"][0]["namespaceSelector"] == {
        "matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}
    }
    assert tcp_ports(operator) == {(rp["dashboard"],) * 2, (rp["dashboardAgentListen"],) * 2}
    assert operator["from"][0]["podSelector"]["matchLabels"] == {
        "app.kubernetes.io/name": "kuberay-operator"
    }
    assert tcp_ports(prometheus) == {(8080, 8080)}


def test_network_policy_follows_its_values(render_values: Callable[..., Objects]) -> None:
    values = manifests.default_values()
    values["networkPolicy"]["ingressController"]["namespaceSelector"] = {  # null: drop a default
        "matchLabels": {"kubernetes.io/metadata.name": None, "team": "edge"}
    }
    values["transport"]["name"] = "ray"
    values["metrics"]["podMonitor"]["enabled"] = False
    policy = only(render_values(values), "NetworkPolicy")["spec"]
    internal, controller, _operator = policy["ingress"]  # no Prometheus rule
    assert controller["from"][0]["namespaceSelector"] == {"matchLabels": {"team": "edge"}}
    assert (30500, 30531) not in tcp_ports(internal)  # ray transport: no ZeroMQ range
    values["networkPolicy"]["enabled"] = False
    assert not [o for o in render_values(values) if o["kind"] == "NetworkPolicy"]


@pytest.mark.parametrize("service_type", ["NodePort", "LoadBalancer"])
def test_the_head_service_is_cluster_ip_only(
    render_values: Callable[..., Objects], service_type: str
) -> None:
    values = manifests.default_values()
    values["head"]["serviceType"] = service_type
    with pytest.raises(manifests.HelmError, match="serviceType"):
        render_values(values)


def test_no_dashboard_on_every_interface_unless_asked(
    default_render: Objects, render_values: Callable[..., Objects]
) -> None:
    head = pods(default_render)["head"]
    assert head["rayStartParams"]["dashboard-host"] == "$(POD_IP)"
    env = {e["name"]: e for e in head["template"]["spec"]["containers"][0]["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert (
        only(default_render, "RayService")["spec"]["rayClusterConfig"]["headGroupSpec"][
            "serviceType"
        ]
        == "ClusterIP"
    )
    values = manifests.default_values()
    values["head"]["dashboardHost"] = "0.0.0.0"
    asked = pods(render_values(values))["head"]["rayStartParams"]["dashboard-host"]
    assert asked == "0.0.0.0"


def test_pods_run_non_root_read_only_without_escalation(default_render: Objects) -> None:
    writable = manifests.default_values()["writableDirs"]
    assert "/tmp" in writable
    for name, group in pods(default_render).items():
        spec = group["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert spec["securityContext"]["runAsUser"] == 1000, name
        container = spec["containers"][0]
        ctx = container["securityContext"]
        assert ctx["allowPrivilegeEscalation"] is False, name
        assert ctx["readOnlyRootFilesystem"] is True, name
        assert ctx["capabilities"] == {"drop": ["ALL"]}, name
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["volumes"]}
        for path in writable:  # each writable path is an emptyDir
            assert "emptyDir" in volumes[mounts[path]], (name, path)


def test_schema_refuses_privilege_escalation(render_values: Callable[..., Objects]) -> None:
    values = manifests.default_values()
    values["containerSecurityContext"]["allowPrivilegeEscalation"] = True
    with pytest.raises(manifests.HelmError, match="allowPrivilegeEscalation"):
        render_values(values)


def test_one_peer_secret_for_every_pod(
    default_render: Objects, render_values: Callable[..., Objects]
) -> None:
    secret = only(default_render, "Secret")
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert len(secret["data"]["peer-secret"]) >= 48  # random, base64
    for name, group in pods(default_render).items():
        env = {e["name"]: e for e in group["template"]["spec"]["containers"][0]["env"]}
        ref = env["TOKENROUTER_PEER_SECRET"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": secret["metadata"]["name"], "key": "peer-secret"}, name
    values = manifests.default_values()
    values["peerSecret"] = {"existingSecret": "my-peer-secret", "key": "s"}
    objects = render_values(values)
    assert not [o for o in objects if o["kind"] == "Secret"]
    for group in pods(objects).values():
        env = {e["name"]: e for e in group["template"]["spec"]["containers"][0]["env"]}
        ref = env["TOKENROUTER_PEER_SECRET"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "my-peer-secret", "key": "s"}


def test_curve_and_the_serve_timeout_reach_the_app(render_values: Callable[..., Objects]) -> None:
    values = manifests.default_values()  # CURVE on by default
    config = yaml.safe_load(only(render_values(values), "RayService")["spec"]["serveConfigV2"])
    assert "transport.zmq.curve=true" in config["applications"][0]["args"]["overrides"]
    values["transport"]["curve"] = False
    off = yaml.safe_load(only(render_values(values), "RayService")["spec"]["serveConfigV2"])
    assert "transport.zmq.curve=true" not in off["applications"][0]["args"]["overrides"]
    from tokenrouter_ray.config import IngressSpec

    assert config["http_options"]["request_timeout_s"] > IngressSpec().request_timeout_s
