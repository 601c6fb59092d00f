"""Where metric values go: interchangeable backends behind one tiny interface.

A backend is built from ``DEFINITIONS`` and takes ``inc`` / ``set`` / ``observe`` with a
``MetricDef`` and its label values (in the definition's label order):

- ``PrometheusBackend``: prometheus-client instruments in a ``CollectorRegistry`` (the
  global one by default; tests inject a fresh one). The default outside Ray.
- ``RayBackend`` (``ray.serve.metrics`` instruments) lives in the Ray layer,
  ``deployments/ray_metrics.py``: nothing in this package imports Ray.
- ``NoopBackend``: drops everything.

Both real backends name counters with their ``_total`` suffix: prometheus-client strips it
and puts it back, and Ray's agent exports a counter named ``x_total`` as ``ray_x_total``
(without the deprecated duplicate gauge it emits for counters not ending in ``_total``).
"""

from __future__ import annotations

import functools
from typing import Any, Protocol

from tokenrouter_ray.metrics.definitions import DEFINITIONS, MetricDef

Labels = tuple[str, ...]


class Backend(Protocol):
    def inc(self, metric: MetricDef, value: float, labels: Labels) -> None: ...

    def set(self, metric: MetricDef, value: float, labels: Labels) -> None: ...

    def observe(self, metric: MetricDef, value: float, labels: Labels) -> None: ...


class NoopBackend:
    def inc(self, metric: MetricDef, value: float, labels: Labels) -> None:
        pass

    def set(self, metric: MetricDef, value: float, labels: Labels) -> None:
        pass

    def observe(self, metric: MetricDef, value: float, labels: Labels) -> None:
        pass


class PrometheusBackend:
    """prometheus-client instruments, registered once in ``registry``."""

    def __init__(self, registry: Any = None) -> None:
        import prometheus_client as pc

        self.registry = pc.REGISTRY if registry is None else registry
        self.instruments: dict[str, Any] = {}
        for d in DEFINITIONS:
            kw: dict[str, Any] = {"labelnames": d.labels, "registry": self.registry}
            if d.kind == "counter":
                inst = pc.Counter(d.name, d.help, **kw)
            elif d.kind == "gauge":
                inst = pc.Gauge(d.name, d.help, **kw)
            else:
                inst = pc.Histogram(d.name, d.help, buckets=d.buckets, **kw)
            self.instruments[d.name] = inst
        self._children: dict[tuple[str, Labels], Any] = {}

    def _child(self, metric: MetricDef, labels: Labels) -> Any:
        key = (metric.name, labels)
        child = self._children.get(key)
        if child is None:
            inst = self.instruments[metric.name]
            child = self._children[key] = inst.labels(*labels) if labels else inst
        return child

    def inc(self, metric: MetricDef, value: float, labels: Labels) -> None:
        self._child(metric, labels).inc(value)

    def set(self, metric: MetricDef, value: float, labels: Labels) -> None:
        self._child(metric, labels).set(value)

    def observe(self, metric: MetricDef, value: float, labels: Labels) -> None:
        self._child(metric, labels).observe(value)


@functools.cache
def default_backend() -> PrometheusBackend:
    """The process-wide prometheus-client backend on the global registry (built once:
    registering the same names twice in one registry is an error)."""
    return PrometheusBackend()
