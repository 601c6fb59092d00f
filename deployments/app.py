"""The app builder: ``import_path: deployments.app:build_app`` in every Serve config.

``build_app(args)`` takes the Serve YAML's ``args`` (typed below), composes the full config
with Hydra from ``conf/`` plus ``args.overrides``, validates it (known policy and options,
sane thresholds, shared tokenizer when the models are local), and binds the endpoint
directory, one deployment per model (named after the model), the threshold tuner when
``tuner.enabled``, and the OpenAI ingress. A model (or the ingress) with ``autoscaling``
gets Serve's ``autoscaling_config`` with this project's policy (``deployments/autoscaling.py``,
docs/user-guide/scaling.md) instead of a fixed ``num_replicas``. Models that share a device
(``device_group``)
get their memory budgets from one joint plan of that device (``plan_shared_devices``)
before they are bound; a group that cannot fit is a ``ConfigError``.
Any config problem is raised as one ``ConfigError`` with a message to act on.

Overrides at launch: ``TOKENROUTER_OVERRIDES`` (Hydra overrides separated by spaces, quoted
as in a shell) in the environment of the process that builds the app are applied after the
config's own, e.g. ``TOKENROUTER_OVERRIDES='policy.alone=null' serve run conf/local.yaml``
(Ray's ``serve run`` takes no overrides after a config file).
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve import Application

from deployments.autoscaling import INGRESS_POLICY, MODEL_POLICY
from deployments.directory import EndpointDirectory
from deployments.ingress import Ingress
from deployments.model_server import ModelServer
from deployments.tp_workers import worker_bundles
from deployments.tuner import Tuner
from tokenrouter_ray.app_config import (  # noqa: F401  (AppArgs, launch_overrides: the app's API)
    OVERRIDES_ENV,
    AppArgs,
    compose_app,
    launch_overrides,
    validate_app,
)
from tokenrouter_ray.config import (
    AppConfig,
    AutoscalingSpec,
    ModelSpec,
    plan_shared_devices,
)

DRAIN_MARGIN_S = 10.0  # Serve's graceful shutdown: the drain's timeout plus this


def autoscaling_config(spec: AutoscalingSpec, policy: str) -> dict[str, Any]:
    """Serve's ``autoscaling_config`` for ``spec`` with this project's ``policy``
    (``deployments/autoscaling.py``; it gets the utilisation target, Serve the rest)."""
    return {
        "min_replicas": spec.min_replicas,
        "max_replicas": spec.max_replicas,
        "initial_replicas": spec.start_replicas,
        "upscale_delay_s": spec.upscale_delay_s,
        "downscale_delay_s": spec.downscale_delay_s,
        "metrics_interval_s": spec.metrics_interval_s,
        "look_back_period_s": spec.look_back_period_s,
        "policy": {
            "policy_function": policy,
            "policy_kwargs": {"target_utilisation": spec.target_utilisation},
        },
    }


def model_options(name: str, spec: ModelSpec) -> dict[str, Any]:
    actor: dict[str, Any] = {"num_cpus": spec.num_cpus, "resources": dict(spec.resources)}
    options: dict[str, Any] = {
        "name": name,
        "max_ongoing_requests": 1000,
        # a replica being stopped moves its requests first (ModelServer.__del__)
        "graceful_shutdown_timeout_s": spec.drain_timeout_s + DRAIN_MARGIN_S,
    }
    if spec.autoscaling is not None:
        options["autoscaling_config"] = autoscaling_config(spec.autoscaling, MODEL_POLICY)
    else:
        options["num_replicas"] = spec.num_replicas
    if spec.tensor_parallel > 1:  # one bundle per rank, one node (deployments/tp_workers.py)
        options["placement_group_bundles"] = worker_bundles(
            spec.tensor_parallel, spec.num_cpus, spec.num_gpus, spec.resources
        )
        options["placement_group_strategy"] = "STRICT_PACK"
        actor["num_gpus"] = spec.num_gpus / spec.tensor_parallel
    else:
        actor["num_gpus"] = spec.num_gpus
    options["ray_actor_options"] = actor
    return options


def build_app(args: dict[str, Any] | None = None) -> Application:
    cfg = compose_app(args)
    validate_app(cfg)
    return bind_app(cfg)


def bind_app(cfg: AppConfig) -> Application:
    cfg = plan_shared_devices(cfg)  # co-located models: budgets from one joint plan
    directory = EndpointDirectory.bind()
    tuner = Tuner.bind(cfg) if cfg.tuner.enabled else None
    models = {
        name: ModelServer.options(**model_options(name, spec)).bind(name, cfg, directory, tuner)
        for name, spec in cfg.models.items()
    }
    return Ingress.options(**ingress_options(cfg)).bind(cfg, directory, models, tuner)


def ingress_options(cfg: AppConfig) -> dict[str, Any]:
    """The Ingress deployment's options; ``ingress.resources`` pins its replicas to the nodes
    that advertise them (the Helm chart's direct port needs them on its ingress pods)."""
    actor: dict[str, Any] = {"num_cpus": cfg.ingress.num_cpus}
    if cfg.ingress.resources:
        actor["resources"] = dict(cfg.ingress.resources)
    options: dict[str, Any] = {
        "max_queued_requests": cfg.ingress.max_queued_requests,
        "ray_actor_options": actor,
    }
    if cfg.ingress.autoscaling is not None:
        options["autoscaling_config"] = autoscaling_config(cfg.ingress.autoscaling, INGRESS_POLICY)
        # a replica scaled down lets its requests end (Ingress.__del__)
        options["graceful_shutdown_timeout_s"] = cfg.ingress.request_timeout_s + DRAIN_MARGIN_S
    else:
        options["num_replicas"] = cfg.ingress.num_replicas
    return options


__all__ = ["AppArgs", "bind_app", "build_app", "ingress_options", "serve"]
