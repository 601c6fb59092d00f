"""``tokenrouter-ray dashboards render|push``: write the dashboard JSON files, or upload the
dashboards to a Grafana over its HTTP API with grafana-client (POST /api/dashboards/db,
``overwrite: true``, so pushing again updates them in place by uid).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from tokenrouter_ray.dashboards import render, write
from tokenrouter_ray.errors import UserFacingError
from tokenrouter_ray.metrics import RAY_PREFIX

DEFAULT_OUT = Path("k8s/dashboards")


def push(
    url: str,
    token: str | None,
    boards: list[dict[str, Any]],
    folder_uid: str | None = None,
    message: str = "tokenrouter-ray dashboards push",
    timeout: float = 10.0,
) -> list[dict[str, Any]]:
    """Create or update each dashboard; Grafana's replies (uid, url, version, ...)."""
    from grafana_client import GrafanaApi

    api = GrafanaApi.from_url(url, credential=token or None, timeout=timeout)
    replies = []
    for board in boards:
        payload: dict[str, Any] = {"dashboard": board, "overwrite": True, "message": message}
        if folder_uid:
            payload["folderUid"] = folder_uid
        try:
            replies.append(api.dashboard.update_dashboard(payload))
        except Exception as exc:  # grafana-client / niquests errors: report, no traceback
            raise UserFacingError(f"pushing {board['uid']!r} to {url} failed: {exc}") from exc
    return replies


def _render(args: argparse.Namespace) -> int:
    for path in write(args.out, args.prefix):
        print(f"wrote {path}")
    return 0


def _push(args: argparse.Namespace) -> int:
    boards = list(render(args.prefix).values())
    token = args.token or os.environ.get("GRAFANA_TOKEN")
    for reply in push(args.url, token, boards, args.folder_uid):
        print(f"{reply.get('status', 'ok')}: {reply.get('uid', '?')} {reply.get('url', '')}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "dashboards",
        help="render the Grafana dashboards to JSON, or push them to a Grafana",
        description="The Grafana dashboards (overview, routing, scheduler) for the metrics "
        "the app exports: write them as JSON files to provision, or create them in a running "
        "Grafana through its HTTP API (docs/user-guide/observability.md).",
        epilog="example:\n  tokenrouter-ray dashboards push --url http://grafana:3000",
    )
    sub = parser.add_subparsers(dest="dashboards_command", required=True, metavar="ACTION")
    prefix_help = (
        f"metric name prefix the exporter adds (default {RAY_PREFIX!r}: Ray's metrics agent; "
        "'' for prometheus-client outside Ray)"
    )

    rnd = sub.add_parser(
        "render",
        help="write overview/routing/scheduler.json",
        description="Write the dashboards as Grafana JSON files, ready to provision.",
        epilog="example:\n  tokenrouter-ray dashboards render --out dashboards/",
    )
    rnd.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"a directory (default {DEFAULT_OUT})"
    )
    rnd.add_argument("--prefix", default=RAY_PREFIX, help=prefix_help)
    rnd.set_defaults(func=_render)

    psh = sub.add_parser(
        "push",
        help="create or update the dashboards in a Grafana",
        description="Create or update the dashboards in a running Grafana through its HTTP "
        "API, authenticated by a service-account token.",
        epilog="example:\n  GRAFANA_TOKEN=... tokenrouter-ray dashboards push --url "
        "http://grafana:3000",
    )
    psh.add_argument("--url", required=True, help="Grafana base URL, e.g. http://grafana:3000")
    psh.add_argument("--token", help="service-account token (default: $GRAFANA_TOKEN)")
    psh.add_argument("--folder-uid", help="folder to put them in (default: General)")
    psh.add_argument("--prefix", default=RAY_PREFIX, help=prefix_help)
    psh.set_defaults(func=_push)
