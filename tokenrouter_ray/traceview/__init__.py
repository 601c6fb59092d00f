"""Routing-trace viewer: which model wrote each token of a response, the router's score
there, and the proposals it dropped, as an HTML heatmap and a PNG.

- ``model.py``: the trace (``RoutingTrace``), parsed from a response, its streamed chunks or
  a bare ``routing_trace`` object; summary numbers; the colours both renderers share.
- ``html.py``: ``render_html`` (one self-contained page, inline CSS, no scripts).
- ``png.py``: ``render_png`` (matplotlib, imported lazily: the ``bench`` extra).
- ``commands.py``: ``tokenrouter-ray trace`` (from a saved response, or a prompt sent to a
  running server with ``extra_body={"routing_trace": True}``).
"""

from tokenrouter_ray.traceview.html import render_html
from tokenrouter_ray.traceview.model import (
    DroppedToken,
    RoutingTrace,
    TraceError,
    TraceToken,
    load_trace,
    trace_from_json,
)
from tokenrouter_ray.traceview.png import render_png

__all__ = [
    "DroppedToken",
    "RoutingTrace",
    "TraceError",
    "TraceToken",
    "load_trace",
    "render_html",
    "render_png",
    "trace_from_json",
]
