"""The chart's direct port (docs/deployment/kubernetes.md, "The direct port"), on by default:
the ingress replicas' own port (`ingress.direct_port`) reaches the app, the replicas can run
only on the pods of the `ingress` worker group and fill each of them, the Service in front of
the port selects exactly those pods, a pod is ready only while its replicas answer there, the
Ingress routes to it, and the NetworkPolicy admits it from the release and the ingress
controller only."""

from __future__ import annotations

import http.server
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

from deployments.app import AppArgs, ingress_options
from tests.k8s import manifests, tools
from tests.k8s.manifests import only
from tests.k8s.test_chart import pod_templates, ports, ray_resources
from tests.k8s.test_chart_security import tcp_ports
from tests.k8s.test_schemas import assert_valid
from tokenrouter_ray.app_config import compose_config
from tokenrouter_ray.config import AppConfig

Objects = list[dict[str, Any]]


def direct_values(**direct: Any) -> dict[str, Any]:
    values = manifests.default_values()
    values["directPort"].update(enabled=True, **direct)
    return values


@pytest.fixture
def direct_render(render_values: Callable[..., Objects]) -> Objects:
    values = direct_values(replicasPerPod=2, sendBufferKiB=16)
    values["directPort"]["worker"]["replicas"] = 3
    return render_values(values)


def overrides(objects: Objects) -> list[str]:
    config = yaml.safe_load(only(objects, "RayService")["spec"]["serveConfigV2"])
    return AppArgs.model_validate(config["applications"][0]["args"]).overrides


def app_config(objects: Objects) -> AppConfig:
    """The AppConfig the app composes from the rendered Serve config (as build_app does)."""
    return compose_config(overrides(objects))


def advertised(group: dict[str, Any]) -> dict[str, float]:
    """The custom Ray resources a group's pods advertise (the head: none)."""
    param = group.get("rayStartParams", {}).get("resources")
    return ray_resources(param) if param else {}


def groups(objects: Objects) -> dict[str, dict[str, Any]]:
    cluster = only(objects, "RayService")["spec"]["rayClusterConfig"]
    found = {"head": cluster["headGroupSpec"]}
    found.update({g["groupName"]: g for g in cluster["workerGroupSpecs"]})
    return found


def test_on_by_default_and_off_when_asked(
    default_render: Objects, render_values: Callable[..., Objects]
) -> None:
    cfg = app_config(default_render)
    assert cfg.ingress.direct_port == 8001 and cfg.ingress.direct_host is None
    assert only(default_render, "Service")["metadata"]["name"].endswith("-direct")
    values = manifests.default_values()
    values["directPort"]["enabled"] = False
    proxied = render_values(values)
    assert not [o for o in proxied if o["kind"] == "Service"]
    assert set(groups(proxied)) == {"head", "small", "large"}
    assert not [o for o in overrides(proxied) if o.startswith("ingress.")]
    cfg = app_config(proxied)
    assert cfg.ingress.direct_port is None and cfg.ingress.resources == {}
    for name, template in pod_templates(only(proxied, "RayService")).items():
        assert "direct" not in ports(template), name
        assert "readinessProbe" not in template["spec"]["containers"][0], name  # KubeRay's own
    backend = only(proxied, "Ingress")["spec"]["rules"][0]["http"]["paths"][0]["backend"]
    assert backend["service"]["name"].endswith("-serve-svc")


def test_the_direct_port_reaches_the_app(direct_render: Objects) -> None:
    cfg = app_config(direct_render)
    assert cfg.ingress.direct_port == 8001
    assert cfg.ingress.direct_host is None  # the pod's own address (Ray's node address)
    assert cfg.ingress.direct_send_buffer_kib == 16
    assert cfg.ingress.num_replicas == 3 * 2  # pods x replicasPerPod
    # the rest of the app is the default layout's
    default = compose_config(overrides(manifests.render()))
    assert cfg.model_dump(exclude={"ingress"}) == default.model_dump(exclude={"ingress"})


def test_the_service_selects_exactly_the_pods_that_run_ingress_replicas(
    direct_render: Objects,
) -> None:
    cfg = app_config(direct_render)
    ask = ingress_options(cfg)["ray_actor_options"]["resources"]
    assert ask  # without it the replicas could land on any pod, the head included
    service = only(direct_render, "Service")
    selector = service["spec"]["selector"]
    [port] = service["spec"]["ports"]
    assert port["port"] == cfg.ingress.direct_port
    selected, hosting, capacity = set(), set(), 0
    for name, group in groups(direct_render).items():
        labels = group["template"]["metadata"]["labels"]
        if selector.items() <= labels.items():
            selected.add(name)
            # the Service's target port is where the replicas listen on those pods
            assert ports(group["template"])[port["targetPort"]] == cfg.ingress.direct_port
        offered = advertised(group)
        fits = min(offered.get(key, 0) / units for key, units in ask.items())
        if fits >= 1:
            hosting.add(name)
            assert group["replicas"] == group["minReplicas"] == group["maxReplicas"], name
            capacity += int(fits) * group["replicas"]
    assert selected == hosting == {"ingress"}
    # every unit is taken, so each pod runs exactly replicasPerPod replicas: none stays empty
    assert capacity == cfg.ingress.num_replicas
    assert advertised(groups(direct_render)["ingress"]) == {"tokenrouter_ingress": 2}
    # no model may land there: each model asks for a resource only its own group advertises
    for name, spec in cfg.models.items():
        hosts = {
            g
            for g, group in groups(direct_render).items()
            if spec.resources.keys() <= advertised(group).keys()
        }
        assert hosts == {name}, name


def test_the_ingress_routes_to_the_direct_service(direct_render: Objects) -> None:
    service = only(direct_render, "Service")
    backend = only(direct_render, "Ingress")["spec"]["rules"][0]["http"]["paths"][0]["backend"]
    assert backend["service"] == {
        "name": service["metadata"]["name"],
        "port": {"number": service["spec"]["ports"][0]["port"]},
    }


def test_the_network_policy_admits_the_port_from_the_release_and_controller_only(
    direct_render: Objects,
) -> None:
    policy = only(direct_render, "NetworkPolicy")["spec"]
    internal, controller, operator, prometheus = policy["ingress"]
    release = policy["podSelector"]["matchLabels"]
    assert internal["from"] == [{"podSelector": {"matchLabels": release}}]
    assert (8001, 8001) in tcp_ports(internal)
    assert tcp_ports(controller) == {(8000, 8000), (8001, 8001)}  # the API, both ways in
    for rule in (operator, prometheus):
        assert not any(lo <= 8001 <= hi for lo, hi in tcp_ports(rule))
    # the Service's pods are the policy's pods
    selector = only(direct_render, "Service")["spec"]["selector"]
    assert release.items() <= selector.items()


def test_the_enabled_render_is_valid(direct_render: Objects, helm: Path) -> None:
    assert_valid(direct_render)
    result = tools.run(
        helm, "lint", "--strict", str(manifests.CHART), "--set", "directPort.enabled=true"
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.update(port=80), "directPort/port"),  # unprivileged pods
        (lambda d: d.update(port="8001"), "directPort/port"),
        (lambda d: d.update(replicasPerPod=0), "replicasPerPod"),
        (lambda d: d.update(sendBufferKiB=2), "sendBufferKiB"),
        (lambda d: d.update(host="0.0.0.0"), "host"),
        (lambda d: d["worker"].update(replicas=0), "directPort/worker/replicas"),
        (lambda d: d["worker"].update(gpus=1), "gpus"),
        (lambda d: d.update(port=8000), "already one of the Serve, metrics or Ray ports"),
        (lambda d: d.update(port=8080), "already one of the Serve, metrics or Ray ports"),
        (lambda d: d.update(port=6379), "already one of the Serve, metrics or Ray ports"),
        (lambda d: d.update(port=10500), "Ray worker or ZeroMQ port range"),
        (lambda d: d.update(port=30510), "Ray worker or ZeroMQ port range"),
    ],
    ids=[
        "privileged-port",
        "port-type",
        "no-replica-per-pod",
        "send-buffer",
        "unknown-key",
        "no-pod",
        "gpus",
        "serve-port",
        "metrics-port",
        "gcs-port",
        "ray-worker-range",
        "zmq-range",
    ],
)
def test_invalid_direct_port_values_are_rejected(
    render_values: Callable[..., Objects], change: Callable[[dict[str, Any]], None], message: str
) -> None:
    values = direct_values()
    change(values["directPort"])
    with pytest.raises(manifests.HelmError, match=message):
        render_values(values)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda v: v["serve"].update(extraOverrides=["ingress.direct_port=9000"]),
            "ingress.direct_port is set by directPort",
        ),
        (
            lambda v: v["serve"].update(extraOverrides=["++ingress.num_replicas=4"]),
            "ingress.num_replicas is set by directPort",
        ),
        (
            lambda v: v["serve"].update(extraOverrides=["ingress.resources.gpu_box=1"]),
            "ingress.resources.gpu_box is set by directPort",
        ),
        (lambda v: v["models"][0].update(name="ingress"), "direct port's worker group"),
        (
            lambda v: v["models"][0].update(nodeResource="tokenrouter_ingress"),
            'nodeResource "tokenrouter_ingress" is the direct port\'s',
        ),
    ],
    ids=["direct-override", "replicas-override", "resources-override", "model-name", "resource"],
)
def test_what_the_direct_port_owns_cannot_be_set_twice(
    render_values: Callable[..., Objects], change: Callable[[dict[str, Any]], None], message: str
) -> None:
    values = direct_values()
    change(values)
    with pytest.raises(manifests.HelmError, match=message):
        render_values(values)
    values["directPort"]["enabled"] = False
    if values["models"][0]["name"] != "ingress":  # allowed while the port is off
        render_values(values)


# ---------------------------------------------------------------- readiness, run for real
class _Health(http.server.BaseHTTPRequestHandler):
    """GET /health answers `status`; GET /-/healthz answers "success" (Serve's proxy)."""

    status = 200

    def do_GET(self) -> None:
        if self.path == "/-/healthz":
            code, body = 200, b"success"
        elif self.path == "/health":
            code, body = self.status, b"{}"
        else:
            code, body = 404, b""
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@contextmanager
def serving(status: int) -> Iterator[int]:
    handler = type("Health", (_Health,), {"status": status})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def free_port() -> int:
    with serving(200) as port:
        return port


def probe_passes(objects: Objects) -> bool:
    """Runs the `ingress` pods' readiness probe here, with this host as the pod."""
    container = groups(objects)["ingress"]["template"]["spec"]["containers"][0]
    command = container["readinessProbe"]["exec"]["command"]
    timeout = container["readinessProbe"]["timeoutSeconds"]
    env = {"PATH": "/usr/bin:/bin", "POD_IP": "127.0.0.1"}
    return subprocess.run(command, env=env, timeout=timeout, capture_output=True).returncode == 0


@pytest.mark.skipif(shutil.which("wget") is None, reason="the probe runs wget (as in Ray's image)")
def test_a_pod_is_ready_only_while_its_replicas_answer_on_the_port(
    render_values: Callable[..., Objects],
) -> None:
    with serving(200) as proxy, serving(200) as healthy, serving(503) as starting:

        def render(direct: int, serve: int = proxy) -> Objects:
            values = direct_values(port=direct)
            values["serve"]["port"] = serve
            return render_values(values)

        ready = render(healthy)
        assert probe_passes(ready)
        assert not probe_passes(render(starting))  # a model without a replica: 503
        assert not probe_passes(render(free_port()))  # no replica listening yet
        assert not probe_passes(render(healthy, serve=free_port()))  # the pod's proxy is down
    # the models' pods and the head keep KubeRay's probes (no readiness depends on the app
    # there: KubeRay waits for the head to be ready before it deploys the Serve config)
    for name, group in groups(ready).items():
        has_probe = "readinessProbe" in group["template"]["spec"]["containers"][0]
        assert has_probe == (name == "ingress"), name


def test_the_docs_command_turns_it_off(helm: Path) -> None:
    from tests.k8s.test_docs_commands import DOCS, find, section_commands

    commands = section_commands(DOCS, "## The direct port (`directPort`)")
    upgrade = find(commands, "helm", "upgrade", "tokenrouter-ray")
    assert manifests.REPO / upgrade[3] == manifests.CHART
    flags = [f for f in upgrade[4:] if f != "--reuse-values"]  # not a `helm template` flag
    objects = manifests.render(*flags, helm=helm)
    backend = only(objects, "Ingress")["spec"]["rules"][0]["http"]["paths"][0]["backend"]
    assert backend["service"]["name"].endswith("-serve-svc")
    assert not [o for o in objects if o["kind"] == "Service"]
    assert app_config(objects).ingress.direct_port is None
