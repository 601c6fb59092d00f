"""Renders the Helm chart and generates the plain manifests in k8s/ from it.

k8s/ is the chart rendered with its default values (release name `tokenrouter-ray`), minus
the Helm-only labels, split into one file per object, plus two kustomizations: k8s/ itself,
and k8s/dashboards/, whose configMapGenerator lists every k8s/dashboards/*.json (the chart
reads the same files through its dashboards/ link). Regenerate after changing the chart or
adding a dashboard; the tests fail while k8s/ is stale:

    python -m tests.k8s.manifests --write     # rewrite k8s/
    python -m tests.k8s.manifests             # check only (exit 1 and list stale files)
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any

import yaml

from tests.k8s import tools

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "tokenrouter-ray"
K8S = REPO / "k8s"
CONF = REPO / "conf" / "r2r_cross_node.yaml"
RELEASE = "tokenrouter-ray"
KUBE_VERSION = "1.30.0"  # what `helm template` reports as the cluster version
HELM_ONLY_LABELS = ("helm.sh/chart", "app.kubernetes.io/managed-by")
# One k8s/ file per kind; dashboards (ConfigMaps) come from k8s/dashboards/ instead.
FILE_BY_KIND = {
    "RayService": "rayservice.yaml",
    "NetworkPolicy": "networkpolicy.yaml",
    "Ingress": "ingress.yaml",
    "Service": "direct-service.yaml",
    "PodMonitor": "podmonitor.yaml",
    "PrometheusRule": "prometheusrule.yaml",
}
HEADER = (
    "# Generated from helm/tokenrouter-ray (default values) by\n"
    "#   python -m tests.k8s.manifests --write\n"
    "# Do not edit: change the chart, then regenerate. docs/deployment/kubernetes.md explains "
    "the layout.\n"
)


class HelmError(RuntimeError):
    pass


def render(*args: str, chart: Path = CHART, helm: Path | None = None) -> list[dict[str, Any]]:
    """`helm template` of the chart with extra args (e.g. "--set", "k=v"); the objects."""
    helm = helm or tools.find("helm")
    result = tools.run(helm, "template", RELEASE, str(chart), "--kube-version", KUBE_VERSION, *args)
    if result.returncode != 0:
        raise HelmError(f"helm template failed ({result.returncode}):\n{result.stderr}")
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def kustomize(directory: Path, kubectl: Path | None = None) -> list[dict[str, Any]]:
    """`kubectl kustomize` of a directory (offline); the objects."""
    kubectl = kubectl or tools.find("kubectl")
    result = tools.run(kubectl, "kustomize", str(directory))
    if result.returncode != 0:
        raise HelmError(f"kubectl kustomize failed ({result.returncode}):\n{result.stderr}")
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def default_values() -> dict[str, Any]:
    """The chart's values.yaml, parsed (a fresh copy each call)."""
    return yaml.safe_load((CHART / "values.yaml").read_text())


def only(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    """The single object of `kind` among `objects`."""
    found = [obj for obj in objects if obj["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def strip_helm_labels(obj: dict[str, Any]) -> dict[str, Any]:
    """A copy without the labels that only make sense for a Helm release."""
    obj = copy.deepcopy(obj)
    labels = obj.get("metadata", {}).get("labels", {})
    for key in HELM_ONLY_LABELS:
        labels.pop(key, None)
    return obj


def dashboard_configmap_name(fullname: str, filename: str) -> str:
    """The chart's ConfigMap name for a dashboard file (templates/dashboards.yaml)."""
    stem = filename.removesuffix(".json").lower().replace("_", "-").replace(".", "-")
    return f"{fullname}-dashboard-{stem}"[:63].rstrip("-")


class _Dumper(yaml.SafeDumper):
    pass


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None  # serveConfigV2 stays a readable block
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _represent_str)


def _dump(obj: Any) -> str:
    return yaml.dump(obj, Dumper=_Dumper, sort_keys=False, width=100)


def generate(objects: list[dict[str, Any]], dashboards_dir: Path) -> dict[str, str]:
    """The k8s/ files (relative path -> text) for the chart's default render."""
    files: dict[str, str] = {}
    for obj in objects:
        if obj["kind"] in ("ConfigMap", "Secret"):
            # the peer Secret is random: k8s/ users create it (docs/deployment/kubernetes.md)
            continue
        if obj["kind"] not in FILE_BY_KIND:
            raise HelmError(f"no k8s/ file for kind {obj['kind']}: extend FILE_BY_KIND")
        files[FILE_BY_KIND[obj["kind"]]] = HEADER + _dump(strip_helm_labels(obj))
    rayservice = strip_helm_labels(next(o for o in objects if o["kind"] == "RayService"))
    fullname = rayservice["metadata"]["name"]
    resources = [name for name in FILE_BY_KIND.values() if name in files]
    files["kustomization.yaml"] = HEADER + _dump(
        {
            "apiVersion": "kustomize.config.k8s.io/v1beta1",
            "kind": "Kustomization",
            "resources": [*resources, "dashboards"],
        }
    )
    # The labels the chart gives a dashboard ConfigMap, less the Helm-only ones.
    labels = {**rayservice["metadata"]["labels"], "grafana_dashboard": "1"}
    dashboards = sorted(p.name for p in dashboards_dir.glob("*.json"))
    files["dashboards/kustomization.yaml"] = HEADER + _dump(
        {
            "apiVersion": "kustomize.config.k8s.io/v1beta1",
            "kind": "Kustomization",
            "generatorOptions": {"disableNameSuffixHash": True, "labels": labels},
            "configMapGenerator": [
                {"name": dashboard_configmap_name(fullname, name), "files": [name]}
                for name in dashboards
            ],
        }
    )
    return files


def stale_files(
    k8s_dir: Path = K8S, chart: Path = CHART, helm: Path | None = None
) -> dict[str, str]:
    """Files of k8s/ that differ from a fresh generation (path -> expected text)."""
    expected = generate(render(chart=chart, helm=helm), k8s_dir / "dashboards")
    return {
        path: text
        for path, text in expected.items()
        if not (k8s_dir / path).is_file() or (k8s_dir / path).read_text() != text
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the stale files")
    args = parser.parse_args(argv)
    stale = stale_files()
    if not stale:
        print("k8s/ is in sync with helm/tokenrouter-ray")
        return 0
    for path, text in stale.items():
        if args.write:
            (K8S / path).parent.mkdir(parents=True, exist_ok=True)
            (K8S / path).write_text(text)
        print(("wrote " if args.write else "stale: ") + f"k8s/{path}")
    return 0 if args.write else 1


if __name__ == "__main__":
    sys.exit(main())
