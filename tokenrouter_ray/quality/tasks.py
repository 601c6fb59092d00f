"""Task items: what one evaluation question is, and dev/test splits.

A `TaskItem` is strict: unknown fields and wrong types are errors (reading and writing JSONL
files is ``quality/task_files.py``). `split_items` picks the dev or test half: an item's own
``split`` when it has one, else a stable hash of its id, so the two halves are disjoint and
the same on every machine and run.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tokenrouter_ray.errors import UserFacingError

Split = Literal["dev", "test"]
SPLITS = ("dev", "test", "all")


class TaskItem(BaseModel):
    """One question: a ``prompt`` or chat ``messages``, the expected ``answer``."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    id: str = Field(min_length=1, description="Unique within a task set; stable.")
    prompt: str | None = Field(None, description="Sent as one user message (or as a prompt).")
    messages: list[dict[str, Any]] | None = Field(
        None, description="OpenAI chat messages, sent as they are."
    )
    answer: str | None = Field(
        None,
        description="The expected answer (a pattern for the regex scorer). None: a set "
        "without answers, which `calibrate --judge` measures by teacher-forced agreement.",
    )
    choices: list[str] | None = Field(None, description="Multiple choice: the options A, B, ...")
    scorer: str | None = Field(None, description="A scorer name; default exact or choice.")
    split: Split | None = Field(None, description="dev or test; default: a hash of the id.")

    @model_validator(mode="after")
    def _one_input(self) -> TaskItem:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' and 'messages'")
        if self.messages is not None:
            if not self.messages:
                raise ValueError("'messages' is empty")
            for m in self.messages:
                if not isinstance(m.get("role"), str):
                    raise ValueError("every message needs a string 'role'")
        if self.choices is not None and len(self.choices) < 2:
            raise ValueError("'choices' needs at least two options")
        return self

    @property
    def scorer_name(self) -> str:
        """The scorer that grades this item: its own, else ``choice`` or ``exact``."""
        if self.scorer:
            return self.scorer
        return "choice" if self.choices else "exact"

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_none=True)


def hash_split(item_id: str) -> Split:
    """The split of an id without one: the low bit of its blake2b hash."""
    digest = hashlib.blake2b(item_id.encode("utf-8"), digest_size=8).digest()
    return "dev" if digest[-1] % 2 == 0 else "test"


def item_split(item: TaskItem) -> Split:
    return item.split or hash_split(item.id)


def split_items(items: Sequence[TaskItem], split: str) -> list[TaskItem]:
    """The items of ``split`` (``dev``, ``test`` or ``all``), in their order."""
    if split not in SPLITS:
        raise UserFacingError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
    if split == "all":
        return list(items)
    return [item for item in items if item_split(item) == split]
