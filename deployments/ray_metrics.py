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

import atexit
import bisect
import contextlib
import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from ray.serve import metrics as serve_metrics

from tokenrouter_ray.metrics import DEFINITIONS, MetricDef, Metrics

Labels = tuple[str, ...]
FLUSH_S = 1.0  # counters and histogram values reach Ray at most this late (it exports every ~10 s)
HELD_VALUES_MAX = 200_000  # histogram values held for the flusher; past that, recorded at once
_FLUSHER_LOCK = threading.Lock()
logger = logging.getLogger(__name__)


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


class CounterSums:
    """Counter increments summed per (metric, labels) until `drain` takes them; safe to add
    to from the step thread and the event loop at once."""

    def __init__(self) -> None:
        self._sums: dict[tuple[str, Labels], float] = {}
        self._lock = threading.Lock()

    def add(self, key: tuple[str, Labels], value: float) -> None:
        with self._lock:
            self._sums[key] = self._sums.get(key, 0.0) + value

    def drain(self) -> dict[tuple[str, Labels], float]:
        with self._lock:
            sums, self._sums = self._sums, {}
        return sums


def direct_record(instrument: Any, tags: dict[str, str], public: str) -> Callable[[float], None]:
    """One labelled series of a Ray instrument as a one-argument call: the tags merged with
    the instrument's default (Serve) tags and checked once, each value handed straight to the
    Cython metric. Ray's public call merges, type-checks and validates the tags on every
    value, several times the cost of the direct call. Falls back to the public method
    ``public`` (``inc``, ``set``, ``observe``) where a Ray version lacks these internals."""
    bound = getattr(instrument, public)
    if getattr(instrument, "_discard_metric", False):
        return lambda value: None
    cython = getattr(instrument, "_metric", None)
    try:
        final = instrument._get_final_tags(tags)
        instrument._validate_tags(final)
    except AttributeError:
        cython = None
    if cython is None:
        return lambda value: bound(value, tags=tags)
    record = cython.record
    return lambda value: record(value, tags=final)


class HistogramSeries:
    """One labelled histogram series, aggregated in this process: exact bucket counts
    (Prometheus's ``le``: a value goes into the first bucket whose bound is >= it), sum and
    count. It is added to (`add`) and exported (`export`) under the backend's fold lock:
    by the flusher, and by a recording thread only past ``HELD_VALUES_MAX`` held values.
    ``export`` sets the three gauges Prometheus reads a histogram from, cumulative as a
    Prometheus histogram's series are."""

    __slots__ = ("bounds", "count", "counts", "labels", "metric", "setters", "sum")

    def __init__(self, metric: MetricDef, labels: Labels) -> None:
        self.metric, self.labels = metric, labels
        self.bounds = tuple(float(b) for b in metric.buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0
        self.count = 0
        self.setters: tuple[list[Callable[[float], None]], Callable, Callable] | None = None

    def add(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def export(self, gauges: tuple[Any, Any, Any]) -> None:
        """Set the series' ``_bucket`` (one per ``le``, cumulative), ``_sum`` and ``_count``
        gauges to what it holds now (all of them, every time: Ray's agent drops a gauge
        not set again within two export intervals)."""
        if self.setters is None:  # made once, here on the flusher (each costs a tag merge)
            buckets, total, count = gauges
            tags = dict(zip(self.metric.labels, self.labels, strict=True))
            self.setters = (
                [
                    direct_record(buckets, {**tags, "le": le}, "set")
                    for le in (*(f"{b}" for b in self.bounds), "+Inf")
                ],
                direct_record(total, tags, "set"),
                direct_record(count, tags, "set"),
            )
        bucket_setters, set_sum, set_count = self.setters
        running = 0
        for setter, n in zip(bucket_setters, self.counts, strict=True):
            running += n
            setter(running)
        set_sum(self.sum)
        set_count(self.count)


class RayBackend:
    """``ray.serve.metrics`` instruments (``ray.util.metrics`` plus the replica's Serve tags).

    Ray exports a process's metrics every ~10 s; what the runtime records is far more
    frequent (a histogram value per committed token at the ingress, a counter per step and
    handoff in a replica). So the cost per call is kept small, and off the threads that
    record: counters are summed here, histogram values are queued (a deque append),
    and a daemon thread hands both to Ray once per ``flush_s`` (and on `flush`). Gauges go
    to Ray directly (last value wins; they are set far less often). Every series merges its
    tags once (`direct_record`).

    **Histograms are aggregated here, not in Ray.** A Ray histogram takes one value a call
    and converts its tags on each (no call takes a count), and at the ingress there is a
    value per token: handing each value to Ray would be a large share of the app's CPU
    per token under load. So the flusher adds the
    held values to a `HistogramSeries` (exact bucket counts, sum and count) and sets, per
    series, the gauges a Prometheus histogram is read from: ``<name>_bucket`` with ``le``
    (cumulative, ``le`` written as Ray's exporter writes it, ``+Inf`` last), ``<name>_sum``
    and ``<name>_count``. The scrape shows the same series names and label sets as a Ray
    histogram did (``ray_<name>_bucket`` ...), so ``histogram_quantile`` and ``rate`` read
    them as before; the values are exact (Ray's own pre-aggregated path approximates the sum
    by bucket midpoints). What differs is the ``# TYPE`` line (gauge) and the cadence: one
    set per bucket per flush, whatever the rate of values. A restarted process starts its
    series at zero, which ``rate`` takes as a counter reset, as before."""

    def __init__(self, flush_s: float = FLUSH_S) -> None:
        # name -> a Ray instrument; a histogram's: its (_bucket, _sum, _count) gauges
        self.instruments: dict[str, Any] = {}
        for spec in ray_instrument_specs():
            name, desc, keys = spec["name"], spec["description"], spec["tag_keys"]
            if spec["kind"] == "counter":
                inst = serve_metrics.Counter(name, desc, tag_keys=keys)
            elif spec["kind"] == "gauge":
                inst = serve_metrics.Gauge(name, desc, tag_keys=keys)
            else:
                inst = (
                    serve_metrics.Gauge(f"{name}_bucket", desc, tag_keys=(*keys, "le")),
                    serve_metrics.Gauge(f"{name}_sum", desc, tag_keys=keys),
                    serve_metrics.Gauge(f"{name}_count", desc, tag_keys=keys),
                )
            self.instruments[name] = inst
        self.flush_s = flush_s
        self.counts = CounterSums()
        # (series, value) of every histogram observation not yet aggregated; appended from
        # any thread, drained by the flusher (deque's append and popleft are atomic)
        self.held: deque[tuple[HistogramSeries, float]] = deque()
        self._series: dict[tuple[str, Labels], Callable[[float], None]] = {}
        self._histograms: dict[tuple[str, Labels], HistogramSeries] = {}
        self._fold = threading.Lock()  # the flusher's pass, or a writer past HELD_VALUES_MAX
        self._flusher: threading.Thread | None = None

    def _series_of(self, metric: MetricDef, labels: Labels, public: str) -> Callable[[float], None]:
        key = (metric.name, labels)
        series = self._series.get(key)
        if series is None:
            tags = dict(zip(metric.labels, labels, strict=True))
            series = direct_record(self.instruments[metric.name], tags, public)
            series = self._series.setdefault(key, series)  # two threads: one series
        return series

    def histogram(self, metric: MetricDef, labels: Labels) -> HistogramSeries:
        """The aggregate of one labelled histogram series (made on first use)."""
        key = (metric.name, labels)
        series = self._histograms.get(key)
        if series is None:  # setdefault: two threads at once still share one aggregate
            series = self._histograms.setdefault(key, HistogramSeries(metric, labels))
        return series

    def inc(self, metric: MetricDef, value: float, labels: Labels) -> None:
        if value > 0:
            self.counts.add((metric.name, labels), value)
            if self._flusher is None:
                self._start_flusher()
        elif value == 0 and (metric.name, labels) not in self._series:
            # A series that exists before its first event (a rate of 0, not no data). Ray's
            # public ``inc`` refuses 0; its Cython record takes it.
            with contextlib.suppress(ValueError):  # a Ray without those internals
                self._series_of(metric, labels, "inc")(0.0)

    def set(self, metric: MetricDef, value: float, labels: Labels) -> None:
        self._series_of(metric, labels, "set")(value)

    def observe(self, metric: MetricDef, value: float, labels: Labels) -> None:
        series = self.histogram(metric, labels)
        if len(self.held) >= HELD_VALUES_MAX:  # the flusher is behind: no unbounded queue
            with self._fold:
                series.add(value)
            return
        self.held.append((series, value))
        if self._flusher is None:
            self._start_flusher()

    def flush(self) -> None:
        """Hand the summed counter increments to Ray, add the held histogram values to their
        series and set every series' gauges, now."""
        by_name = {d.name: d for d in DEFINITIONS}
        for (name, labels), total in self.counts.drain().items():
            self._series_of(by_name[name], labels, "inc")(total)
        held = self.held
        with self._fold:
            for _ in range(len(held)):  # what is there now; later values wait for the next
                series, value = held.popleft()
                series.add(value)
            for series in list(self._histograms.values()):
                series.export(self.instruments[series.metric.name])

    def _start_flusher(self) -> None:
        with _FLUSHER_LOCK:
            if self._flusher is not None:
                return
            self._flusher = threading.Thread(
                target=self._flush_loop, name="metrics-flush", daemon=True
            )
            self._flusher.start()
            atexit.register(self._flush_quietly)  # before Ray's own exit handler (LIFO)

    def _flush_loop(self) -> None:
        while True:
            time.sleep(self.flush_s)
            self._flush_quietly()

    def _flush_quietly(self) -> None:
        try:
            self.flush()
        except Exception:  # a metrics hiccup must not end the flushing (or the exit)
            logger.exception("metrics flush failed")


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
