"""Task files: loading (errors name the file and line), writing back, dev/test splits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenrouter_ray.errors import UserFacingError
from tokenrouter_ray.quality.task_files import load_tasks, write_tasks
from tokenrouter_ray.quality.tasks import TaskItem, hash_split, split_items


def write_lines(path: Path, *lines: str) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


GOOD = [
    {"id": "a", "prompt": "What is 1 + 1?", "answer": "2", "scorer": "numeric"},
    {"id": "b", "messages": [{"role": "user", "content": "Hi"}], "answer": "hello"},
    {"id": "c", "prompt": "Pick", "answer": "B", "choices": ["x", "y"], "split": "test"},
]


def test_load_round_trips_through_write(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "t.jsonl", *(json.dumps(g) for g in GOOD), "")
    items = load_tasks(path)
    assert [i.id for i in items] == ["a", "b", "c"]
    assert items[1].messages == GOOD[1]["messages"] and items[2].scorer_name == "choice"
    again = tmp_path / "again.jsonl"
    assert write_tasks(items, again) == 3
    assert load_tasks(again) == items


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        ("{not json", "Expecting property name"),
        ("[1, 2]", "expected a JSON object"),
        ('{"id": "x", "answer": "1"}', "exactly one of 'prompt' and 'messages'"),
        ('{"id": "x", "prompt": "p", "messages": [{"role": "user"}], "answer": "1"}', "exactly"),
        ('{"id": "x", "prompt": "p", "answer": 2}', "answer"),  # strict: not a string
        ('{"id": "x", "prompt": "p", "answer": "1", "colour": "red"}', "colour"),
        ('{"id": "x", "prompt": "p", "answer": "1", "split": "train"}', "split"),
        ('{"id": "x", "prompt": "p", "answer": "1", "scorer": "fuzzy"}', "unknown scorer"),
        ('{"id": "x", "prompt": "p", "answer": "(", "scorer": "regex"}', "regular expression"),
        ('{"id": "x", "prompt": "p", "answer": "two", "scorer": "numeric"}', "not a number"),
        ('{"id": "x", "prompt": "p", "answer": "Q", "choices": ["a", "b"]}', "not a letter"),
        ('{"id": "a", "prompt": "p", "answer": "1"}', "already used on line 1"),
    ],
)
def test_bad_line_names_file_and_line(tmp_path: Path, bad: str, reason: str) -> None:
    path = write_lines(tmp_path / "t.jsonl", json.dumps(GOOD[0]), "", bad)
    with pytest.raises(UserFacingError) as info:
        load_tasks(path)
    message = str(info.value)
    assert message.startswith(f"{path}, line 3: ") and reason in message


def test_missing_and_empty_files(tmp_path: Path) -> None:
    with pytest.raises(UserFacingError, match="cannot read task file"):
        load_tasks(tmp_path / "nope.jsonl")
    with pytest.raises(UserFacingError, match="no task items"):
        load_tasks(write_lines(tmp_path / "empty.jsonl", "", ""))


def test_splits_are_disjoint_stable_and_honour_the_item() -> None:
    items = [TaskItem(id=f"item-{i}", prompt="p", answer="a") for i in range(400)]
    dev, test = split_items(items, "dev"), split_items(items, "test")
    assert {i.id for i in dev}.isdisjoint(i.id for i in test)
    assert len(dev) + len(test) == 400 and 150 < len(dev) < 250  # about half each
    assert split_items(items, "all") == items
    reordered = list(reversed(items))  # a hash of the id: order and neighbours do not matter
    assert {i.id for i in split_items(reordered, "dev")} == {i.id for i in dev}
    # blake2b of the id, the same on every machine and Python (no PYTHONHASHSEED)
    pinned_splits = ["test", "dev", "test", "dev", "test", "test"]
    assert [hash_split(f"item-{i}") for i in range(6)] == pinned_splits
    pinned = items[0].model_copy(update={"split": "test" if items[0] in dev else "dev"})
    assert split_items([pinned], pinned.split) == [pinned]
    with pytest.raises(UserFacingError, match="unknown split"):
        split_items(items, "train")
