"""The built-in task sets: right answers, unique stable ids, balanced deterministic splits."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

from tokenrouter_ray.errors import UserFacingError
from tokenrouter_ray.quality.builtin import (
    arithmetic,
    builtin_tasks,
    capital_rows,
    capitals,
    tasks_from_spec,
)
from tokenrouter_ray.quality.scorers import normalise, score
from tokenrouter_ray.quality.task_files import write_tasks
from tokenrouter_ray.quality.tasks import split_items

EXPRESSION = re.compile(r"^What is (\d+) ([+\-×]) (\d+)\? Answer with the number only\.$")


def test_arithmetic_answers_equal_the_expression() -> None:
    items = arithmetic()
    assert len(items) == 120
    kinds = Counter()
    for it in items:
        a, op, b = EXPRESSION.match(it.prompt).groups()
        value = {"+": int(a) + int(b), "-": int(a) - int(b), "×": int(a) * int(b)}[op]
        assert it.answer == str(value) and value >= 0
        assert len(a) == len(b)  # single-digit with single-digit, two with two
        kinds[(op, len(a))] += 1
        assert score(it, f"{value}") and not score(it, f"{value + 1}")
    assert set(kinds.values()) == {20} and len(kinds) == 6
    assert len({it.prompt for it in items}) == len(items)


def test_capitals_table_is_clean() -> None:
    rows = capital_rows()
    assert len(rows) >= 120
    countries = [normalise(c) for c, _ in rows]
    assert len(set(countries)) == len(countries)
    assert len({normalise(cap) for _, cap in rows}) == len(rows)
    assert rows[0] == ("France", "Paris")
    known = dict(rows)
    assert known["Japan"] == "Tokyo" and known["Australia"] == "Canberra"
    assert known["Canada"] == "Ottawa" and known["Turkey"] == "Ankara"
    items = capitals()
    assert items[0].prompt == "What is the capital of France?" and items[0].answer == "Paris"
    assert score(items[0], "The capital of France is Paris.")


def test_demo_ids_unique_and_stable_and_splits_balanced() -> None:
    demo = builtin_tasks("demo")
    ids = [it.id for it in demo]
    assert len(set(ids)) == len(ids) and len(demo) == len(capitals()) + 120
    assert builtin_tasks("demo") == demo  # deterministic
    assert all(it.split in ("dev", "test") for it in demo)
    dev, test = split_items(demo, "dev"), split_items(demo, "test")
    assert abs(len(dev) - len(test)) <= 1
    assert "capital-france" in {i.id for i in dev} and "capital-germany" in {i.id for i in test}
    assert {i.id for i in dev}.isdisjoint(i.id for i in test)


def test_specs(tmp_path) -> None:
    assert tasks_from_spec("builtin:capitals") == capitals()
    path = tmp_path / "a.jsonl"
    write_tasks(arithmetic(), path)
    assert tasks_from_spec(str(path)) == arithmetic()
    with pytest.raises(UserFacingError, match="unknown built-in task set 'trivia'"):
        tasks_from_spec("builtin:trivia")


def test_data_file_ships_with_the_package() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["tokenrouter_ray"]
    assert "quality/data/*" in patterns
