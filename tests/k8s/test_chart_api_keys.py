"""The chart's optional ingress API keys: TOKENROUTER_API_KEYS from a Secret's key on every
Ray container when `apiKeys.existingSecret` is set; nothing by default."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tests.k8s import manifests
from tests.k8s.manifests import only

Objects = list[dict[str, Any]]


def containers(objects: Objects) -> list[dict[str, Any]]:
    cluster = only(objects, "RayService")["spec"]["rayClusterConfig"]
    templates = [cluster["headGroupSpec"]["template"]]
    templates += [g["template"] for g in cluster["workerGroupSpecs"]]
    return [t["spec"]["containers"][0] for t in templates]


def api_key_env(container: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in container.get("env", []) if e["name"] == "TOKENROUTER_API_KEYS"]


def test_no_api_keys_by_default(default_render: Objects) -> None:
    assert all(not api_key_env(c) for c in containers(default_render))


def test_api_keys_from_an_existing_secret(render_values: Callable[..., Objects]) -> None:
    values = manifests.default_values()
    values["apiKeys"] = {"existingSecret": "tokenrouter-api-keys", "key": "keys"}
    found = [api_key_env(c) for c in containers(render_values(values))]
    assert len(found) == 4  # the head, one worker group per model, the direct port's
    ref = {"secretKeyRef": {"name": "tokenrouter-api-keys", "key": "keys"}}
    assert all(env == [{"name": "TOKENROUTER_API_KEYS", "valueFrom": ref}] for env in found)
