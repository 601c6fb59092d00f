"""Prometheus metrics: what is measured (``definitions``), where values go (``backends``:
prometheus-client, no-op; the Ray backend is in ``deployments/ray_metrics.py``) and the
calls the runtime makes (``recorder.Metrics``).

Nothing here imports Ray, nor torch at import time; docs/user-guide/observability.md lists the
metrics
and how they reach Prometheus and Grafana.
"""

from __future__ import annotations

from tokenrouter_ray.metrics.backends import (
    Backend,
    NoopBackend,
    PrometheusBackend,
    default_backend,
)
from tokenrouter_ray.metrics.definitions import (
    BY_NAME,
    DEFINITIONS,
    RAY_PREFIX,
    MetricDef,
    exported_names,
)
from tokenrouter_ray.metrics.recorder import INGRESS, Metrics

__all__ = [
    "BY_NAME",
    "DEFINITIONS",
    "INGRESS",
    "RAY_PREFIX",
    "Backend",
    "MetricDef",
    "Metrics",
    "NoopBackend",
    "PrometheusBackend",
    "default_backend",
    "exported_names",
]
