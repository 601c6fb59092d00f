"""Serve apps on the shared two-node test cluster, built from conf/ with overrides that point
the models at tiny float64 checkpoints (with a word-level tokenizer)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from tests.tiny_models import chain_engines
from tests.waiting import wait_for
from tokenrouter_ray.app_config import compose_config
from tokenrouter_ray.local import LocalRuntime
from tokenrouter_ray.protocol import SamplingSpec
from tokenrouter_ray.routing.policy import build_policy


def tiny_overrides(
    dirs: dict[str, str], names: list[str], policy: str, transport: str, extra: list[str] = ()
) -> list[str]:
    models = "qwen3_escalation" if len(names) == 3 else "qwen3_r2r"  # shape only; paths replaced
    out = [f"models={models}", f"policy={policy}", f"transport={transport}"]
    for name in names:
        out += [
            f"models.{name}.path={dirs[name]}",
            f"models.{name}.dtype=float64",
            f"models.{name}.num_gpus=0",
            f"models.{name}.tensor_parallel=1",
            f"models.{name}.num_cpus=0.5",
            f"models.{name}.block_size=4",
            f"models.{name}.memory_budget_gb=0.25",
            f"models.{name}.max_model_len=256",
        ]
    if not any(e.startswith("quality_monitor.sample_rate=") for e in extra):
        # no random sample of answers scored unless a test asks (tests/.../test_live_quality.py)
        out.append("quality_monitor.sample_rate=0")
    return out + list(extra)


@pytest.fixture(scope="session")
def serve_app(serve_http: str) -> Callable[..., Any]:
    """Context manager: deploy an app from overrides, yield its OpenAI base URL, delete it."""
    from ray import serve

    from deployments.app import bind_app

    @contextmanager
    def deploy(overrides: list[str], name: str) -> Iterator[str]:
        cfg = compose_config(overrides)
        serve.run(bind_app(cfg), name=name, route_prefix=f"/{name}", blocking=False)
        try:
            yield f"{serve_http}/{name}/v1"
        finally:
            serve.delete(name)

    return deploy


@pytest.fixture(scope="session")
def serve_apps(serve_http: str) -> Callable[..., Any]:
    """Context manager: deploy several apps side by side (``{name: overrides}``, one
    ``serve.run_many``, so their replicas start together), yield ``{name: base URL}`` once
    every one runs (with ``wait=False`` at once: the caller calls ``wait_running`` before
    its first request, and works meanwhile), delete them all."""
    from ray import serve

    from deployments.app import bind_app

    @contextmanager
    def deploy(apps: dict[str, list[str]], wait: bool = True) -> Iterator[dict[str, str]]:
        targets = [
            serve.RunTarget(bind_app(compose_config(o)), name=name, route_prefix=f"/{name}")
            for name, o in apps.items()
        ]
        try:
            serve.run_many(
                targets,
                wait_for_ingress_deployment_creation=wait,
                wait_for_applications_running=wait,
            )
            yield {name: f"{serve_http}/{name}/v1" for name in apps}
        finally:
            for name in apps:
                serve.delete(name, _blocking=False)
            wait_for(lambda: not set(apps) & set(serve.status().applications), 120, "apps deleted")

    return deploy


def wait_running(names: list[str], timeout_s: float = 300.0) -> None:
    """Until every app in ``names`` runs (Serve's status); fails at once on a failed deploy."""
    from ray import serve

    def running() -> bool:
        apps = serve.status().applications
        for name in names:
            if name in apps and apps[name].status == "DEPLOY_FAILED":
                raise AssertionError(f"{name}: {apps[name].message}")
        return all(name in apps and apps[name].status == "RUNNING" for name in names)

    wait_for(running, timeout_s, f"apps {names} running")


def local_outputs(
    dirs: dict[str, str],
    names: list[str],
    policy: str,
    options: dict,
    prompts: list[list[int]],
    max_tokens: int,
) -> list[Any]:
    async def go() -> list[Any]:
        engines = chain_engines(dirs, names)
        async with LocalRuntime(engines, build_policy(policy, options, names)) as runtime:
            spec = SamplingSpec(temperature=0.0, max_tokens=max_tokens, seed=0)
            return await runtime.complete_all(prompts, spec)

    return asyncio.run(go())
