"""Grafana JSON building blocks as plain dicts: PromQL over known metric names, panels,
template variables and a dashboard that lays its panels out on Grafana's 24-column grid.

``Promql(prefix)`` is the only way a board names a metric: it looks the name up in
``tokenrouter_ray.metrics.DEFINITIONS`` (a typo fails at render time) and adds the
exporter's prefix (``ray_`` behind Ray's metrics agent, empty for prometheus-client).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenrouter_ray.metrics import BY_NAME

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
RATE = "$__rate_interval"
TAG = "tokenrouter-ray"
SCHEMA_VERSION = 39  # Grafana 10.4 / 11


class Promql:
    """PromQL fragments over tokenrouter metrics, with the exporter's name prefix."""

    def __init__(self, prefix: str, selector: str = "") -> None:
        self.prefix = prefix
        self.selector = selector  # e.g. 'model=~"$model"', added to every series selector

    def name(self, metric: str, suffix: str = "") -> str:
        d = BY_NAME[metric]  # KeyError: not a metric the code exports
        if (d.kind == "histogram") != (suffix in ("_bucket", "_sum", "_count")):
            raise ValueError(f"{metric} is a {d.kind}: suffix {suffix!r} does not fit")
        return self.prefix + metric + suffix

    def series(self, metric: str, suffix: str = "") -> str:
        sel = f"{{{self.selector}}}" if self.selector else ""
        return self.name(metric, suffix) + sel

    def rate(
        self, metric: str, by: Sequence[str] = (), suffix: str = "", window: str = RATE
    ) -> str:
        return f"sum{_by(by)}(rate({self.series(metric, suffix)}[{window}]))"

    def value(self, metric: str, by: Sequence[str] = (), agg: str = "sum") -> str:
        return f"{agg}{_by(by)}({self.series(metric)})"

    def quantile(self, q: float, metric: str, by: Sequence[str] = ()) -> str:
        inner = self.rate(metric, ("le", *by), "_bucket")
        return f"histogram_quantile({q}, {inner})"

    def mean(self, metric: str, by: Sequence[str] = ()) -> str:
        """Mean observation over the rate window (histogram sum / count)."""
        return f"{self.rate(metric, by, '_sum')} / {self.rate(metric, by, '_count')}"


def _by(labels: Sequence[str]) -> str:
    return f" by ({', '.join(labels)}) " if labels else ""


# --------------------------------------------------------------------------- panels
def target(expr: str, legend: str = "", *, instant: bool = False) -> dict[str, Any]:
    t: dict[str, Any] = {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend}
    if instant:
        t |= {"instant": True, "range": False, "format": "table"}
    return t


def quantiles(
    q: Promql,
    metric: str,
    by: Sequence[str] = (),
    legend: str = "",
    qs: Sequence[float] = (0.5, 0.99),
) -> list[dict[str, Any]]:
    """One target per quantile, legends like ``p50 {{model}}``."""
    return [target(q.quantile(x, metric, by), f"p{round(x * 100)} {legend}".strip()) for x in qs]


def timeseries(
    title: str,
    targets: list[dict[str, Any]],
    unit: str = "short",
    description: str = "",
    *,
    stack: bool = False,
    width: int = 12,
    max_value: float | None = None,
) -> dict[str, Any]:
    custom: dict[str, Any] = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10}
    if stack:
        custom |= {"stacking": {"mode": "normal", "group": "A"}, "fillOpacity": 60}
    defaults: dict[str, Any] = {"unit": unit, "custom": custom}
    if max_value is not None:
        defaults |= {"min": 0, "max": max_value}
    return _panel(
        "timeseries",
        title,
        targets,
        description,
        width,
        {"defaults": defaults, "overrides": []},
        {
            "legend": {
                "displayMode": "table",
                "placement": "bottom",
                "showLegend": True,
                "calcs": ["mean", "max"],
            },
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
    )


def stat(title: str, expr: str, unit: str, description: str = "", width: int = 6) -> dict:
    return _panel(
        "stat",
        title,
        [target(expr)],
        description,
        width,
        {"defaults": {"unit": unit, "decimals": 2}, "overrides": []},
        {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
            "graphMode": "area",
            "textMode": "value",
        },
        height=4,
    )


def matrix(
    title: str, expr: str, row: str, column: str, unit: str, description: str = ""
) -> dict[str, Any]:
    """A table with one row per ``row`` label value and one column per ``column`` value."""
    panel = _panel(
        "table",
        title,
        [target(expr, instant=True)],
        description,
        12,
        {"defaults": {"unit": unit, "decimals": 3}, "overrides": []},
        {"showHeader": True, "cellHeight": "sm"},
    )
    panel["transformations"] = [
        {
            "id": "groupingToMatrix",
            "options": {
                "rowField": row,
                "columnField": column,
                "valueField": "Value",
                "emptyValue": "zero",
            },
        }
    ]
    return panel


def row(title: str) -> dict[str, Any]:
    return {"type": "row", "title": title, "collapsed": False, "panels": []}


def _panel(
    kind: str,
    title: str,
    targets: list[dict[str, Any]],
    description: str,
    width: int,
    field_config: dict[str, Any],
    options: dict[str, Any],
    height: int = 8,
) -> dict[str, Any]:
    refs = [{**t, "refId": chr(ord("A") + i)} for i, t in enumerate(targets)]
    return {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "gridPos": {"w": width, "h": height},
        "targets": refs,
        "fieldConfig": field_config,
        "options": options,
    }


# ------------------------------------------------------------------------ variables
def datasource_variable() -> dict[str, Any]:
    return {
        "name": "datasource",
        "label": "Data source",
        "type": "datasource",
        "query": "prometheus",
        "current": {},
        "hide": 0,
        "refresh": 1,
        "regex": "",
        "options": [],
    }


def label_variable(name: str, label: str, series: str, multi: bool = True) -> dict[str, Any]:
    """A variable over the values of ``label`` on ``series``: multi-value with All selected
    by default, or (``multi=False``) one value, the first one found."""
    query = f"label_values({series}, {label})"
    current: dict[str, Any] = (
        {"selected": True, "text": ["All"], "value": ["$__all"]} if multi else {}
    )
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DATASOURCE,
        "query": {"query": query, "refId": f"{name}-values"},
        "definition": query,
        "current": current,
        "hide": 0,
        "refresh": 2,
        "multi": multi,
        "includeAll": multi,
        "allValue": ".*" if multi else None,
        "sort": 1,
        "regex": "",
        "options": [],
    }


def model_name_variable(prefix: str) -> dict[str, Any]:
    """``$model_name``: the served model name (one app) every query of a board filters on,
    so several apps can share one Prometheus."""
    series = Promql(prefix).name("tokenrouter_batch_size", "_count")
    return label_variable("model_name", "model_name", series, multi=False)


# ------------------------------------------------------------------------ dashboard
def dashboard(
    uid: str,
    title: str,
    description: str,
    panels: list[dict[str, Any]],
    variables: Sequence[dict[str, Any]] = (),
) -> dict[str, Any]:
    """The dashboard JSON; panels get ids and grid positions in order, wrapping at 24."""
    x = y = row_height = 0
    placed = []
    for i, panel in enumerate(panels, start=1):
        panel = {"id": i, **panel}
        if panel["type"] == "row":
            y, x, row_height = y + row_height, 0, 0
            panel["gridPos"] = {"h": 1, "w": 24, "x": 0, "y": y}
            y += 1
        else:
            w, h = panel["gridPos"]["w"], panel["gridPos"]["h"]
            if x + w > 24:
                y, x, row_height = y + row_height, 0, 0
            panel["gridPos"] = {"h": h, "w": w, "x": x, "y": y}
            x, row_height = x + w, max(row_height, h)
        placed.append(panel)
    return {
        "id": None,
        "uid": uid,
        "title": title,
        "description": description,
        "tags": [TAG],
        "timezone": "",
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": [datasource_variable(), *variables]},
        "annotations": {"list": []},
        "links": [
            {
                "type": "dashboards",
                "tags": [TAG],
                "title": "tokenrouter-ray",
                "asDropdown": True,
                "includeVars": True,
                "keepTime": True,
            }
        ],
        "panels": placed,
    }
