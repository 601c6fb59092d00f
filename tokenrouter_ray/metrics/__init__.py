"""Prometheus metrics: what is measured (``definitions``), where values go (``backends``:
prometheus-client, Ray, no-op) and the calls the runtime makes (``recorder.Metrics``).

Nothing here imports Ray or torch at import time; docs/observability.md lists the metrics
and how they reach Prometheus and Grafana.
"""

from __future__ import annotations

from tokenrouter_ray.metrics.backends import (
    Backend,
    NoopBackend,
    PrometheusBackend,
    RayBackend,
    default_backend,
    ray_backend,
    ray_instrument_specs,
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
    "RayBackend",
    "default_backend",
    "exported_names",
    "ray_backend",
    "ray_instrument_specs",
]
