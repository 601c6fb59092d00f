"""Task files: `TaskItem` objects read from and written to JSONL, one object a line.

A line enters as a JSON object and leaves as a `TaskItem` that some scorer can grade
(``scorers.check_item``); a bad line is a `UserFacingError` naming the file and the line.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from tokenrouter_ray.errors import UserFacingError
from tokenrouter_ray.quality.scorers import check_item
from tokenrouter_ray.quality.tasks import TaskItem


def parse_item(data: Any) -> TaskItem:
    """A `TaskItem` from a decoded JSON object (raises ``ValueError`` with the reason)."""
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object, got {type(data).__name__}")
    try:
        item = TaskItem.model_validate(data)
    except ValidationError as exc:
        reasons = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'item'}: {e['msg']}" for e in exc.errors()
        )
        raise ValueError(reasons) from None
    check_item(item)
    return item


def load_tasks(path: str | Path) -> list[TaskItem]:
    """Items of a JSONL file, one object a line (blank lines skipped); ids must be unique."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise UserFacingError(f"cannot read task file {path}: {exc.strerror or exc}") from None
    items: list[TaskItem] = []
    seen: dict[str, int] = {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = parse_item(json.loads(line))
        except ValueError as exc:  # json.JSONDecodeError is a ValueError
            raise UserFacingError(f"{path}, line {number}: {exc}") from None
        if item.id in seen:
            raise UserFacingError(
                f"{path}, line {number}: id {item.id!r} already used on line {seen[item.id]}"
            )
        seen[item.id] = number
        items.append(item)
    if not items:
        raise UserFacingError(f"{path}: no task items")
    return items


def write_tasks(items: Iterable[TaskItem], path: str | Path) -> int:
    """Write ``items`` as JSONL (the format `load_tasks` reads); returns how many."""
    lines = [json.dumps(item.to_json(), ensure_ascii=False) for item in items]
    Path(path).write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return len(lines)
