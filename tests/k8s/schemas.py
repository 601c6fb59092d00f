"""Offline schema validation of Kubernetes objects: built-in kinds and our two custom resources.

Built-in kinds (Ingress, ConfigMap, ...) are checked against the strict JSON schemas that the
`kubernetes-validate` package ships per Kubernetes minor version (unknown fields rejected).
Custom resources (RayService, PodMonitor) are checked against the CRD extracts in `crds/`: their
openAPIV3Schema becomes a JSON Schema with
- `additionalProperties: false` on every object that lists properties (what `kubectl apply`'s
  strict server-side field validation enforces),
- `x-tokenrouter-ref: <definition>` resolved to that definition in kubernetes-validate's
  `_definitions.json` of the same Kubernetes version (so pod templates get the full PodSpec),
- `x-tokenrouter-trimmed` subtrees accepted as any object.
Validation errors come back as readable strings, one per problem, with the path to the field.
"""

from __future__ import annotations

import copy
import functools
import importlib.resources
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate.utils as kv_utils
import yaml
from referencing import Registry, Resource

CRD_DIR = Path(__file__).parent / "crds"
K8S_DEFINITIONS_URI = "https://kubernetes.io/api/_definitions.json"
# The object metadata a CRD may embed in a pod or service template (controller-gen's
# EmbeddedObjectMeta): these five fields only.
EMBEDDED_OBJECT_META = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
        "finalizers": {"type": "array", "items": {"type": "string"}},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "name": {"type": "string"},
        "namespace": {"type": "string"},
    },
}
CRD_FILES = {
    ("ray.io/v1", "RayService"): "ray.io_rayservices.yaml",
    ("monitoring.coreos.com/v1", "PodMonitor"): "monitoring.coreos.com_podmonitors.yaml",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "monitoring.coreos.com_prometheusrules.yaml",
}


def supported_versions() -> list[str]:
    """Kubernetes minor versions (e.g. "1.35") kubernetes-validate has schemas for."""
    return [kv_utils.major_minor(v) for v in kv_utils.all_versions()]


@functools.cache
def _k8s_schema_dir(version: str) -> Any:
    full = next(v for v in kv_utils.all_versions() if kv_utils.major_minor(v) == version)
    root = importlib.resources.files("kubernetes_validate") / "kubernetes-json-schema"
    return root / f"v{full}-local-strict"


@functools.cache
def _registry(version: str) -> Registry:
    definitions = json.loads((_k8s_schema_dir(version) / "_definitions.json").read_text())
    return Resource.from_contents(definitions) @ Registry()


def _to_json_schema(node: Any) -> Any:
    """Rewrites a CRD openAPIV3Schema subtree into JSON Schema (see the module docstring)."""
    if isinstance(node, list):
        return [_to_json_schema(item) for item in node]
    if not isinstance(node, dict):
        return node
    if node.get("x-tokenrouter-trimmed"):
        return {"type": "object"}
    ref = node.get("x-tokenrouter-ref")
    if ref == "embeddedObjectMeta":
        return copy.deepcopy(EMBEDDED_OBJECT_META)
    if ref:
        return {"$ref": f"{K8S_DEFINITIONS_URI}#/$defs/{ref}"}
    out = {key: _to_json_schema(value) for key, value in node.items()}
    closed = "properties" in node and "additionalProperties" not in node
    if closed and not node.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    if node.get("nullable"):
        out = {"anyOf": [out, {"type": "null"}]}
    return out


@functools.cache
def crd_schema(api_version: str, kind: str) -> dict[str, Any]:
    """The JSON Schema of a custom resource, from its CRD extract in crds/."""
    crd = yaml.safe_load((CRD_DIR / CRD_FILES[(api_version, kind)]).read_text())
    version = api_version.split("/")[1]
    served = next(v for v in crd["spec"]["versions"] if v["name"] == version)
    schema = _to_json_schema(served["schema"]["openAPIV3Schema"])
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    return schema


def is_custom(obj: dict[str, Any]) -> bool:
    return (obj.get("apiVersion"), obj.get("kind")) in CRD_FILES


def _schema_for(obj: dict[str, Any], version: str) -> dict[str, Any]:
    if is_custom(obj):
        return crd_schema(obj["apiVersion"], obj["kind"])
    # networking.k8s.io/v1 -> networking-v1; v1 (core) stays v1: kubernetes-validate's naming.
    api_group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", obj["apiVersion"])
    path = _k8s_schema_dir(version) / f"{obj['kind'].lower()}-{api_group_version}.json"
    if not path.is_file():
        raise KeyError(f"no Kubernetes {version} schema for {obj['apiVersion']} {obj['kind']}")
    return json.loads(path.read_text())


def errors(obj: dict[str, Any], version: str) -> list[str]:
    """Schema violations of one object against Kubernetes `version` ("1.30"); [] when valid."""
    validator = jsonschema.Draft202012Validator(
        _schema_for(obj, version), registry=_registry(version)
    )
    name = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
    return [
        f"{name}: {'/'.join(str(p) for p in error.absolute_path) or '<root>'}: {error.message}"
        for error in sorted(validator.iter_errors(obj), key=lambda e: list(e.absolute_path))
    ]
