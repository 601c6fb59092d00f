"""The app builder: ``import_path: deployments.app:build_app`` in every Serve config.

``build_app(args)`` takes the Serve YAML's ``args`` (typed below), composes the full config
with Hydra from ``conf/`` plus ``args.overrides``, validates it (known policy and options,
sane thresholds, shared tokenizer when the models are local), and binds the endpoint
directory, one deployment per model (named after the model), the threshold tuner when
``tuner.enabled``, and the OpenAI ingress. Models that share a device (``device_group``)
get their memory budgets from one joint plan of that device (``plan_shared_devices``)
before they are bound; a group that cannot fit is a ``ConfigError``.
Any config problem is raised as one ``ConfigError`` with a message to act on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from ray import serve
from ray.serve import Application

from deployments.directory import EndpointDirectory
from deployments.ingress import Ingress
from deployments.model_server import ModelServer, spec_tokenizer
from deployments.tp_workers import worker_bundles
from deployments.tuner import Tuner
from tokenrouter_ray.config import (
    AppConfig,
    ConfigError,
    ModelSpec,
    compose_config,
    plan_shared_devices,
)
from tokenrouter_ray.demo import register_resolver
from tokenrouter_ray.protocol import check_shared_tokenizer
from tokenrouter_ray.routing.policy import build_policy, policy_class


class AppArgs(BaseModel):
    """What a Serve YAML may put under ``args``."""

    model_config = ConfigDict(extra="forbid")

    overrides: list[str] = Field(
        default_factory=list, description="Hydra overrides, e.g. ['policy=rstitch']."
    )
    config_name: str = Field("base", description="Primary config in conf/.")


def validate_app(cfg: AppConfig) -> None:
    local = [name for name, spec in cfg.models.items() if Path(spec.path).is_dir()]
    for name, spec in cfg.models.items():
        if spec.sim is not None:
            from tokenrouter_ray.simulation.served import model_profile

            try:
                model_profile(spec.sim, name, cfg.model_names.index(name))
            except Exception as exc:  # an unknown profile, a file that does not load
                raise ConfigError(f"model {name!r}: {exc}") from None
    try:
        cls = policy_class(cfg.policy.name)
        if cls.needs_tokenizer and cfg.model_names[0] not in local:
            cls.Config(**cfg.policy.options)  # hub ids: the replicas build it with theirs
        else:
            entry = cfg.models[cfg.model_names[0]]
            tokenizer = spec_tokenizer(entry) if cls.needs_tokenizer else None
            build_policy(cfg.policy.name, cfg.policy.options, cfg.model_names, tokenizer)
    except (ValueError, ValidationError) as exc:
        raise ConfigError(f"policy {cfg.policy.name!r}: {exc}") from None
    checkpoint = cfg.policy.options.get("checkpoint")
    if checkpoint and not Path(checkpoint).is_file():
        raise ConfigError(
            f"policy {cfg.policy.name!r}: router checkpoint {checkpoint} does not "
            "exist (train one with `tokenrouter-ray train-router`)"
        )
    if len(local) == len(cfg.models) > 1:  # hub ids are checked when the replicas load
        check_shared_tokenizer({n: spec_tokenizer(cfg.models[n]) for n in local})


def model_options(name: str, spec: ModelSpec) -> dict[str, Any]:
    actor: dict[str, Any] = {"num_cpus": spec.num_cpus, "resources": dict(spec.resources)}
    options: dict[str, Any] = {
        "name": name,
        "num_replicas": spec.num_replicas,
        "max_ongoing_requests": 1000,
    }
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
    try:
        parsed = AppArgs.model_validate(args or {})
    except ValidationError as exc:
        raise ConfigError(
            f"invalid Serve args: {exc.errors()[0]['msg']} at {exc.errors()[0]['loc']}"
        ) from None
    register_resolver()  # ${demo:...} in the shipped configs
    cfg = compose_config(parsed.overrides, parsed.config_name)
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
    return {
        "num_replicas": cfg.ingress.num_replicas,
        "max_queued_requests": cfg.ingress.max_queued_requests,  # issue 26
        "ray_actor_options": actor,
    }


__all__ = ["AppArgs", "bind_app", "build_app", "ingress_options", "serve"]
