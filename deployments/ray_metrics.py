"""Metrics in the Ray layer: the ``ray.serve.metrics`` backend and the ``Metrics`` the
deployments record with.

``RayBackend`` builds one ``ray.serve.metrics`` instrument per definition in
``tokenrouter_ray.metrics.DEFINITIONS`` (``ray_instrument_specs``: the same set as plain
data) and takes the same ``inc`` / ``set`` / ``observe`` calls as the prometheus-client
backend. Instruments work in any process of a Ray job (values are dropped while Ray is not
initialised); in a Serve replica they carry its ``deployment``, ``replica`` and
``application`` tags and reach Prometheus through the node's metrics agent, names gaining
Ray's ``ray_`` prefix (a counter named ``x_total`` is exported as ``ray_x_total``).

``ray_metrics(policy, model_name)`` is what every deployment calls: one backend per process,
and the served model name given once by a replica's constructor labels its later calls that
do not know it (the ingress's exception handlers), since a replica belongs to one app.
"""

from __future__ import annotations

import functools
from typing import Any

from ray.serve import metrics as serve_metrics

from tokenrouter_ray.metrics import DEFINITIONS, MetricDef, Metrics

Labels = tuple[str, ...]


def ray_instrument_specs() -> list[dict[str, Any]]:
    """What ``RayBackend`` builds, as plain data (name, kind, tag keys, boundaries)."""
    return [
        {
            "name": d.name,
            "kind": d.kind,
            "description": d.help,
            "tag_keys": d.labels,
            "boundaries": list(d.buckets) if d.kind == "histogram" else None,
        }
        for d in DEFINITIONS
    ]


class RayBackend:
    """``ray.serve.metrics`` instruments (``ray.util.metrics`` plus the replica's Serve tags,
    at no measurable cost per call)."""

    def __init__(self) -> None:
        self.instruments: dict[str, Any] = {}
        for spec in ray_instrument_specs():
            name, desc, keys = spec["name"], spec["description"], spec["tag_keys"]
            if spec["kind"] == "counter":
                inst = serve_metrics.Counter(name, desc, tag_keys=keys)
            elif spec["kind"] == "gauge":
                inst = serve_metrics.Gauge(name, desc, tag_keys=keys)
            else:
                inst = serve_metrics.Histogram(
                    name, desc, boundaries=spec["boundaries"], tag_keys=keys
                )
            self.instruments[name] = inst

    def inc(self, metric: MetricDef, value: float, labels: Labels) -> None:
        if value > 0:  # Ray refuses non-positive increments
            self.instruments[metric.name].inc(
                value, tags=dict(zip(metric.labels, labels, strict=True))
            )

    def set(self, metric: MetricDef, value: float, labels: Labels) -> None:
        self.instruments[metric.name].set(value, tags=dict(zip(metric.labels, labels, strict=True)))

    def observe(self, metric: MetricDef, value: float, labels: Labels) -> None:
        self.instruments[metric.name].observe(
            value, tags=dict(zip(metric.labels, labels, strict=True))
        )


@functools.cache
def ray_backend() -> RayBackend:
    """The process-wide Ray backend (built once)."""
    return RayBackend()


_served_name = {"model_name": ""}  # this process's served model name, once a replica set it


def ray_metrics(policy: str = "", model_name: str | None = None) -> Metrics:
    """A ``Metrics`` over the process's Ray backend. ``model_name`` given once labels the
    later calls that omit it (a Serve replica belongs to one app)."""
    if model_name is not None:
        _served_name["model_name"] = model_name
    return Metrics(ray_backend(), policy, _served_name["model_name"])
