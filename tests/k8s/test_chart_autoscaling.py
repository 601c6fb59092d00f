"""The chart's replica autoscaling (docs/user-guide/scaling.md, "On Kubernetes"): off by
default; on for a
model, its bounds reach the app and Serve's autoscaling_config, its worker group can hold every
replica Serve may ask for (one pod each) and no idle pod at the lower bound, and Ray's in-tree
autoscaler is on to add and remove those pods, as unprivileged as the rest of the release; the
ingress's bounds reach the app without it; values the app, Serve or KubeRay would refuse are
refused at render time."""

from __future__ import annotations

import math
import re
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from deployments.app import ingress_options, model_options
from tests.k8s import manifests
from tests.k8s.manifests import only
from tests.k8s.test_chart_direct_port import advertised, app_config, groups, overrides
from tests.k8s.test_schemas import assert_valid
from tokenrouter_ray.app_config import compose_config
from tokenrouter_ray.config import AppConfig, AutoscalingSpec

Objects = list[dict[str, Any]]

LARGE = {
    "minReplicas": 2,
    "maxReplicas": 4,
    "targetUtilisation": 0.6,
    "upscaleDelayS": 10,
    "downscaleDelayS": 60,
    "metricsIntervalS": 2,
    "lookBackPeriodS": 10,
}
INGRESS = {"maxReplicas": 3, "targetUtilisation": 0.5}


def scaled_values(**autoscaling: Any) -> dict[str, Any]:
    """The default values with ``autoscaling`` set; an autoscaled ingress goes behind Serve's
    proxy (the direct port's pods fix the ingress replica count)."""
    values = manifests.default_values()
    values["autoscaling"].update(autoscaling)
    if autoscaling.get("ingress") is not None:
        values["directPort"]["enabled"] = False
    return values


@pytest.fixture
def scaled_render(render_values: Callable[..., Objects]) -> Objects:
    return render_values(scaled_values(models={"large": LARGE}, ingress=INGRESS))


def cluster(objects: Objects) -> dict[str, Any]:
    return only(objects, "RayService")["spec"]["rayClusterConfig"]


def _cpus(quantity: str | int | float) -> float:
    text = str(quantity)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def offered(group: dict[str, Any]) -> dict[str, float]:
    """The Ray resources one pod of a group gives Ray: its custom resources, and the CPUs and
    GPUs Ray takes from rayStartParams, else from the container's limits (as KubeRay does)."""
    params = group.get("rayStartParams", {})
    limits = group["template"]["spec"]["containers"][0]["resources"].get("limits", {})
    cpus = params.get("num-cpus", limits.get("cpu", 0))
    gpus = params.get("num-gpus", limits.get("nvidia.com/gpu", 0))
    return {**advertised(group), "CPU": _cpus(cpus), "GPU": float(gpus)}


def demand(options: dict[str, Any]) -> dict[str, float]:
    """What one replica of a deployment asks of the one node (pod) it lands on: its actor's
    resources, or the sum of its placement group's bundles (STRICT_PACK: one node)."""
    bundles = options.get("placement_group_bundles")
    if not bundles:
        actor = options["ray_actor_options"]
        bundles = [
            {**actor.get("resources", {}), "CPU": actor["num_cpus"], "GPU": actor["num_gpus"]}
        ]
    total: dict[str, float] = {}
    for bundle in bundles:
        for key, units in bundle.items():
            total[key] = total.get(key, 0.0) + float(units)
    return {key: units for key, units in total.items() if units > 0}


def replicas_per_pod(group: dict[str, Any], need: dict[str, float]) -> int:
    have = offered(group)
    return min(math.floor(have.get(key, 0.0) / units + 1e-9) for key, units in need.items())


def test_off_by_default(default_render: Objects) -> None:
    spec = cluster(default_render)
    assert "enableInTreeAutoscaling" not in spec and "autoscalerOptions" not in spec
    assert not [o for o in overrides(default_render) if ".autoscaling." in o]
    cfg = app_config(default_render)
    assert all(m.autoscaling is None for m in cfg.models.values())
    assert cfg.ingress.autoscaling is None
    for group in spec["workerGroupSpecs"]:
        assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == 1


def test_the_bounds_reach_the_app_and_serve(scaled_render: Objects) -> None:
    cfg = app_config(scaled_render)
    assert cfg.models["large"].autoscaling == AutoscalingSpec(
        min_replicas=2,
        max_replicas=4,
        initial_replicas=2,
        target_utilisation=0.6,
        upscale_delay_s=10,
        downscale_delay_s=60,
        metrics_interval_s=2,
        look_back_period_s=10,
    )
    assert cfg.models["small"].autoscaling is None
    serve = model_options("large", cfg.models["large"])
    assert "num_replicas" not in serve
    scaling = serve["autoscaling_config"]
    assert (scaling["min_replicas"], scaling["max_replicas"], scaling["initial_replicas"]) == (
        2,
        4,
        2,
    )
    assert scaling["policy"]["policy_kwargs"] == {"target_utilisation": 0.6}
    assert model_options("small", cfg.models["small"])["num_replicas"] == 1
    # the ingress: its bounds, the app's defaults for the keys left out
    assert cfg.ingress.autoscaling == AutoscalingSpec(max_replicas=3, target_utilisation=0.5)
    assert ingress_options(cfg)["autoscaling_config"]["max_replicas"] == 3
    # the rest of the app is the default layout's behind Serve's proxy
    default = compose_config(overrides(manifests.render("--set", "directPort.enabled=false")))
    changed = {"models": {"large": {"autoscaling"}}, "ingress": {"autoscaling"}}
    assert cfg.model_dump(exclude=changed) == default.model_dump(exclude=changed)


def _hosts(objects: Objects, cfg: AppConfig, model: str) -> dict[str, int]:
    """Worker group -> replicas of `model` one of its pods can run."""
    need = demand(model_options(model, cfg.models[model]))
    fits = {name: replicas_per_pod(group, need) for name, group in groups(objects).items()}
    return {name: n for name, n in fits.items() if n >= 1}


@pytest.mark.parametrize("initial", [None, 3])
def test_the_worker_group_holds_every_replica_serve_may_ask_for(
    render_values: Callable[..., Objects], initial: int | None
) -> None:
    """Each model's replicas fit only its own group's pods, one per pod; the group may grow to
    the model's max_replicas pods, starts with a pod per initial replica and keeps none idle
    at min_replicas. A model without autoscaling keeps its fixed pods."""
    objects = render_values(
        scaled_values(models={"large": {**LARGE, "initialReplicas": initial}}, ingress=INGRESS)
    )
    cfg = app_config(objects)
    for name, spec in cfg.models.items():
        hosts = _hosts(objects, cfg, name)
        assert hosts == {name: 1}, (name, hosts)  # one replica per pod, on its group only
        group = groups(objects)[name]
        if spec.autoscaling is None:
            counts = (group["replicas"], group["minReplicas"], group["maxReplicas"])
            assert counts == (spec.num_replicas,) * 3, name
            continue
        assert group["maxReplicas"] == spec.autoscaling.max_replicas == 4
        assert group["minReplicas"] == spec.autoscaling.min_replicas == 2
        assert group["replicas"] == spec.start_replicas == (initial or 2)


def test_ray_adds_and_removes_the_pods(scaled_render: Objects) -> None:
    spec = cluster(scaled_render)
    assert spec["enableInTreeAutoscaling"] is True
    options = spec["autoscalerOptions"]
    values = manifests.default_values()
    ray = values["autoscaling"]["ray"]
    assert options["upscalingMode"] == ray["upscalingMode"] == "Default"
    assert options["idleTimeoutSeconds"] == ray["idleTimeoutSeconds"] == 60
    assert options["resources"] == ray["resources"]
    assert "version" not in options  # KubeRay's default
    # the sidecar is as unprivileged as the Ray containers, its root filesystem read-only too
    assert options["securityContext"] == values["containerSecurityContext"]
    head = spec["headGroupSpec"]["template"]["spec"]
    assert options["securityContext"] == head["containers"][0]["securityContext"]
    volumes = {v["name"] for v in head["volumes"]}
    assert {m["name"] for m in options["volumeMounts"]} <= volumes
    assert {m["mountPath"] for m in options["volumeMounts"]} == set(values["writableDirs"])
    assert options["imagePullPolicy"] == values["image"]["pullPolicy"]
    assert "env" not in options and "envFrom" not in options  # no secret reaches it


def test_scaled_renders_are_valid(render_values: Callable[..., Objects]) -> None:
    values = scaled_values(
        models={"small": {"maxReplicas": 8}, "large": LARGE},
        ray={
            "upscalingMode": "Conservative",
            "idleTimeoutSeconds": 600,
            "version": "v2",
            "resources": {"limits": {"cpu": "1", "memory": "1Gi"}},
        },
    )
    objects = render_values(values)
    assert_valid(objects)
    options = cluster(objects)["autoscalerOptions"]
    assert (options["upscalingMode"], options["idleTimeoutSeconds"], options["version"]) == (
        "Conservative",
        600,
        "v2",
    )
    cfg = app_config(objects)
    assert [n for n, m in cfg.models.items() if m.autoscaling] == ["small", "large"]
    values["models"][1].update(gpus=2, tensorParallel=2)
    values["serve"]["modelsConfig"] = "qwen3_r2r_tp2"
    objects = render_values(values)
    assert_valid(objects)
    cfg = app_config(objects)
    assert cfg.models["large"].tensor_parallel == 2
    assert _hosts(objects, cfg, "large") == {"large": 1}  # one replica's ranks fill a pod


def test_the_ingress_alone_adds_no_node_autoscaler(render_values: Callable[..., Objects]) -> None:
    """Ingress replicas ask for no CPU, so they fit any pod: no pod to add for them."""
    objects = render_values(scaled_values(ingress={"maxReplicas": 4}))
    assert "enableInTreeAutoscaling" not in cluster(objects)
    cfg = app_config(objects)
    assert cfg.ingress.autoscaling == AutoscalingSpec(max_replicas=4)
    assert ingress_options(cfg)["ray_actor_options"] == {"num_cpus": 0}
    proxied = cluster(manifests.render("--set", "directPort.enabled=false"))
    assert cluster(objects)["workerGroupSpecs"] == proxied["workerGroupSpecs"]


def test_set_flags_work(helm: Path) -> None:
    """The --set / --set-json forms docs/user-guide/scaling.md shows (Helm's --set keeps 0.6 a
    string,
    which the schema refuses: fractions go through --set-json or a values file)."""
    objects = manifests.render(
        "--set",
        "autoscaling.models.large.maxReplicas=4",
        "--set",
        "directPort.enabled=false",
        "--set-json",
        'autoscaling.ingress={"maxReplicas": 2, "targetUtilisation": 0.5}',
        helm=helm,
    )
    cfg = app_config(objects)
    # a model's initial count is always written: it is also its group's initial pod count
    assert cfg.models["large"].autoscaling == AutoscalingSpec(max_replicas=4, initial_replicas=1)
    assert cfg.ingress.autoscaling == AutoscalingSpec(max_replicas=2, target_utilisation=0.5)
    with pytest.raises(manifests.HelmError, match="targetUtilisation"):
        manifests.render("--set", "autoscaling.ingress.targetUtilisation=0.5", helm=helm)


def _bad(**change: Any) -> dict[str, Any]:
    values = scaled_values(models={"large": {"maxReplicas": 4}})
    for key, value in change.items():
        section, _, name = key.partition("__")
        if section == "large":
            values["autoscaling"]["models"]["large"][name] = value
        elif section == "top":
            values[name] = value
        else:
            values["autoscaling"][section] = value
    return values


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (_bad(large__minReplicas=5), "maxReplicas 4 is below minReplicas 5"),
        (_bad(large__minReplicas=0), "minReplicas"),
        (_bad(large__maxReplicas=-1), "maxReplicas"),
        (_bad(large__initialReplicas=5), r"initialReplicas 5 is outside \[minReplicas 1"),
        (_bad(large__targetUtilisation=1.5), "targetUtilisation"),
        (_bad(large__targetUtilisation=0), "targetUtilisation"),
        (_bad(large__downscaleDelayS=-5), "downscaleDelayS"),
        (_bad(large__metricsIntervalS=0), "metricsIntervalS"),
        (_bad(large__max_replicas=4), "max_replicas"),
        (_bad(models={"medium": {"maxReplicas": 2}}), '"medium" is not the name of a model'),
        (_bad(models={"large": {"minReplicas": 2}}), "maxReplicas"),
        (_bad(top__tuner="static"), "set tuner: live"),
        (_bad(ingress={"maxReplicas": 2, "minReplicas": 3}), "autoscaling.ingress: maxReplicas"),
        (_bad(ray={"upscalingMode": "Fast"}), "upscalingMode"),
        (_bad(ray={"idleTimeoutSeconds": -1}), "idleTimeoutSeconds"),
    ],
    ids=[
        "max-below-min",
        "min-zero",
        "max-negative",
        "initial-outside",
        "target-above-one",
        "target-zero",
        "delay-negative",
        "interval-zero",
        "app-key-spelling",
        "unknown-model",
        "no-max",
        "tuner-static",
        "ingress-max-below-min",
        "upscaling-mode",
        "idle-negative",
    ],
)
def test_invalid_values_are_rejected(
    render_values: Callable[..., Objects], values: dict[str, Any], message: str
) -> None:
    with pytest.raises(manifests.HelmError, match=message):
        render_values(values)


def test_the_app_keys_are_the_charts_alone(render_values: Callable[..., Objects]) -> None:
    """An extra override of a model's or the ingress's autoscaling would move Serve's bounds
    away from the worker groups' (replicas waiting for pods Ray may not add): refused."""
    for override in (
        "models.large.autoscaling.max_replicas=8",
        "+models.small.autoscaling={max_replicas: 2}",
        "ingress.autoscaling.max_replicas=2",
    ):
        values = manifests.default_values()
        values["serve"]["extraOverrides"] = [override]
        with pytest.raises(manifests.HelmError, match="set through autoscaling"):
            render_values(values)
    values = manifests.default_values()
    values["serve"]["extraOverrides"] = ["models.large.drain_timeout_s=40"]  # not a bound
    assert app_config(render_values(values)).models["large"].drain_timeout_s == 40


def test_ingress_autoscaling_is_refused_with_the_direct_port(
    render_values: Callable[..., Objects],
) -> None:
    values = scaled_values(ingress={"maxReplicas": 2})
    values["directPort"]["enabled"] = True
    with pytest.raises(manifests.HelmError, match="not with directPort"):
        render_values(values)


SCALING_DOC = manifests.REPO / "docs" / "user-guide" / "scaling.md"
SCALING_SECTION = "## On Kubernetes: replica autoscaling meets node autoscaling"


def _section(text: str) -> str:
    start = text.index(f"\n{SCALING_SECTION}\n") if not text.startswith(SCALING_SECTION) else 0
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else None]


def test_the_docs_values_render(render_values: Callable[..., Objects], helm: Path) -> None:
    """docs/user-guide/scaling.md's values file and `helm upgrade` line render to what the text
    says."""
    section = _section(SCALING_DOC.read_text())
    [block] = re.findall(r"```yaml\n(.*?)```", section, re.S)
    objects = render_values(yaml.safe_load(block))  # over the chart's defaults, as `-f` is
    assert_valid(objects)
    cfg = app_config(objects)
    assert cfg.models["large"].autoscaling == AutoscalingSpec(
        max_replicas=4, initial_replicas=2, target_utilisation=0.7
    )
    assert cfg.tuner.target_tpot_ms == 60
    assert cluster(objects)["autoscalerOptions"]["idleTimeoutSeconds"] == 120
    large = groups(objects)["large"]
    assert (large["minReplicas"], large["replicas"], large["maxReplicas"]) == (1, 2, 4)

    [command] = re.findall(r"```bash\n(helm upgrade .*?)```", section, re.S)
    words = shlex.split(command.replace("\\\n", " "))
    flags = [w for i, w in enumerate(words) if words[i - 1] == "--set" or w == "--set"]
    cfg = app_config(manifests.render(*flags, helm=helm))
    assert cfg.models["large"].autoscaling == AutoscalingSpec(max_replicas=4, initial_replicas=1)
