"""Grafana dashboards: the checked-in JSON is a fresh render; every PromQL expression names
only metrics the code exports (under Ray's `ray_` prefix, histogram suffixes included) and
every exported metric appears somewhere; `dashboards push` posts each dashboard to
/api/dashboards/db of a (fake, local) Grafana."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import ClassVar

import pytest

from tokenrouter_ray.cli import main
from tokenrouter_ray.dashboards import render, to_json
from tokenrouter_ray.metrics import BY_NAME, DEFINITIONS, RAY_PREFIX, MetricDef, exported_names

REPO = Path(__file__).resolve().parents[1]
CHECKED_IN = REPO / "k8s" / "dashboards"
FILES = ("overview.json", "routing.json", "scheduler.json")

# --------------------------------------------------------------------- PromQL names
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_LABEL_LIST = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGE = re.compile(r"\[[^\]]*\]")
_IDENT = re.compile(r"(?<![\w$.])([A-Za-z_:][\w:]*)\b(?!\s*\()")
_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
    "inf",
    "nan",
}
_LABEL_VALUES = re.compile(r"label_values\(\s*([A-Za-z_:][\w:]*)")


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers that are not functions (followed by
    `(`), keywords, label names (in `by (...)`, `on (...)`, matchers), strings or ranges."""
    assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
    text = _STRING.sub('""', expr)
    text = _MATCHERS.sub("{}", text)
    text = _RANGE.sub("[]", text)
    text = _LABEL_LIST.sub(" ", text)
    return {m for m in _IDENT.findall(text) if m.lower() not in _KEYWORDS}


def test_extractor() -> None:
    expr = (
        'sum by (src_model) (rate(ray_a_total{model=~"$model"}[$__rate_interval])) / on '
        '(src_model) group_left label_replace(sum(ray_b), "src_model", "$1", "model", "(.*)")'
        " > bool 0.5 * histogram_quantile(0.9, sum by (le) (rate(ray_c_bucket[5m])))"
    )
    assert metric_names(expr) == {"ray_a_total", "ray_b", "ray_c_bucket"}


# ----------------------------------------------------------------------- dashboards
@pytest.fixture(scope="module")
def boards() -> dict[str, dict]:
    return render()


def test_checked_in_json_is_a_fresh_render(boards: dict[str, dict]) -> None:
    assert tuple(sorted(boards)) == FILES
    for name, board in boards.items():
        path = CHECKED_IN / name
        assert path.is_file(), f"{path} missing: run `tokenrouter-ray dashboards render`"
        assert path.read_text() == to_json(board), (
            f"{path} is stale: run `tokenrouter-ray dashboards render`"
        )


def _exprs(board: dict) -> Iterator[str]:
    for panel in board["panels"]:
        for t in panel.get("targets", []):
            yield t["expr"]


def test_promql_uses_only_exported_metrics(boards: dict[str, dict]) -> None:
    exported = exported_names(RAY_PREFIX)
    used: set[str] = set()
    for name, board in boards.items():
        for expr in _exprs(board):
            names = metric_names(expr)
            assert names, f"{name}: no metric in {expr!r}"
            assert names <= exported, f"{name}: unknown {names - exported} in {expr!r}"
            used |= names
        for var in board["templating"]["list"]:
            if var["type"] == "query":
                series = _LABEL_VALUES.findall(var["query"]["query"])
                assert series and set(series) <= exported, var
    for d in DEFINITIONS:  # every metric is on some dashboard
        assert used & set(d.exported(RAY_PREFIX)), f"{d.name} is on no dashboard"


def test_structure(boards: dict[str, dict]) -> None:
    uids = {b["uid"] for b in boards.values()}
    assert uids == {"tokenrouter-overview", "tokenrouter-routing", "tokenrouter-scheduler"}
    for board in boards.values():
        variables = {v["name"]: v for v in board["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource"
        assert variables["datasource"]["query"] == "prometheus"
        ids = [p["id"] for p in board["panels"]]
        assert len(set(ids)) == len(ids)
        for panel in board["panels"]:
            pos = panel["gridPos"]
            assert pos["x"] + pos["w"] <= 24
            if panel["type"] != "row":
                assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
                assert all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"])


_SELECTED = re.compile(r"\b(ray_tokenrouter_\w+)(\{[^}]*\})?")


def _definition(series: str) -> MetricDef:
    name = series.removeprefix(RAY_PREFIX)
    for suffix in ("_bucket", "_sum", "_count"):
        if name.removesuffix(suffix) in BY_NAME:
            return BY_NAME[name.removesuffix(suffix)]
    return BY_NAME[name]


def test_every_query_is_one_app(boards: dict[str, dict]) -> None:
    """Every series a board reads is filtered on the `$model_name` variable (one served app,
    so several apps can share a Prometheus), and the scheduler board's on `$model` too."""
    for name, board in boards.items():
        variables = {v["name"]: v for v in board["templating"]["list"]}
        assert variables["model_name"]["multi"] is False
        assert variables["model_name"]["query"]["query"].startswith("label_values(ray_")
        for expr in _exprs(board):
            selected = _SELECTED.findall(expr)
            assert selected, expr
            for metric, matchers in selected:
                assert 'model_name="$model_name"' in matchers, f"{name}: {metric} in {expr}"
                if name == "scheduler.json" and "model" in _definition(metric).labels:
                    assert 'model=~"$model"' in matchers, f"{name}: {metric} in {expr}"


def test_prefix_is_configurable() -> None:
    """`--prefix ''` gives dashboards for prometheus-client outside Ray."""
    board = render(prefix="")["overview.json"]
    for expr in _exprs(board):
        assert metric_names(expr) <= exported_names(prefix="")


# ------------------------------------------------------------------------------ push
class FakeGrafana(BaseHTTPRequestHandler):
    requests: ClassVar[list[dict]] = []
    status = 200

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FakeGrafana.requests.append(
            {"path": self.path, "auth": self.headers.get("Authorization"), "body": body}
        )
        uid = body["dashboard"]["uid"]
        reply = {"id": 1, "uid": uid, "url": f"/d/{uid}/x", "status": "success", "version": 1}
        if self.status != 200:
            reply = {"message": "Dashboard not found", "status": "not-found"}
        data = json.dumps(reply).encode()
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def grafana() -> Iterator[str]:
    FakeGrafana.requests, FakeGrafana.status = [], 200
    server = HTTPServer(("127.0.0.1", 0), FakeGrafana)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_push_posts_every_dashboard(grafana: str, capsys: pytest.CaptureFixture) -> None:
    argv = ["dashboards", "push", "--url", grafana, "--token", "s3cret", "--folder-uid", "f1"]
    assert main(argv) == 0
    posts = FakeGrafana.requests
    assert [p["path"] for p in posts] == ["/api/dashboards/db"] * 3
    assert {p["auth"] for p in posts} == {"Bearer s3cret"}
    assert [p["body"]["dashboard"] for p in posts] == list(render().values())
    assert all(p["body"]["overwrite"] is True and p["body"]["folderUid"] == "f1" for p in posts)
    assert "tokenrouter-routing" in capsys.readouterr().out


def test_push_failure_is_a_clear_error(grafana: str, capsys: pytest.CaptureFixture) -> None:
    FakeGrafana.status = 404
    assert main(["dashboards", "push", "--url", grafana, "--token", "t"]) == 2
    err = capsys.readouterr().err
    assert "pushing 'tokenrouter-overview'" in err and "Traceback" not in err
