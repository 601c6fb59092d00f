"""Grafana dashboards generated from Python: one source of truth for the JSON checked into
``k8s/dashboards/`` (which the Helm chart and kustomize turn into ConfigMaps) and for
``tokenrouter-ray dashboards push``.

``render(prefix)`` returns ``{file name: dashboard dict}``; ``to_json`` is the exact text
written to disk (tests compare the checked-in files with a fresh render).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenrouter_ray.dashboards.boards import BOARDS
from tokenrouter_ray.metrics import RAY_PREFIX


def render(prefix: str = RAY_PREFIX) -> dict[str, dict[str, Any]]:
    return {f"{name}.json": build(prefix) for name, build in BOARDS.items()}


def to_json(board: dict[str, Any]) -> str:
    return json.dumps(board, indent=2, ensure_ascii=False) + "\n"


def write(out_dir: Path, prefix: str = RAY_PREFIX) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, board in render(prefix).items():
        path = out_dir / name
        path.write_text(to_json(board))
        paths.append(path)
    return paths
