"""Built-in task sets, made here (no download): capitals and arithmetic.

``capitals``: "What is the capital of France?" for each row of ``data/capitals.tsv``
(well-known countries first; scorer ``exact``). ``arithmetic``: addition, subtraction
(non-negative results) and multiplication of single-digit and of two-digit numbers, drawn
from a fixed seed, "What is 7 + 5? Answer with the number only." (scorer ``numeric``).
``demo`` is both. Every item has a stable id and an explicit split: alternating dev/test
down each list (per operation and size for arithmetic), so each half has as many
well-known countries and as many of every kind of sum as the other.

`tasks_from_spec` is how the commands name a set: ``builtin:NAME`` or a JSONL path.
"""

from __future__ import annotations

import random
import re
from importlib import resources

from tokenrouter_ray.errors import UserFacingError
from tokenrouter_ray.quality.task_files import load_tasks
from tokenrouter_ray.quality.tasks import TaskItem

BUILTIN_PREFIX = "builtin:"
ARITHMETIC_SEED = 36
PER_KIND = 20  # arithmetic items per (operation, digits)
OPERATIONS = {"add": "+", "sub": "-", "mul": "×"}
_SPLITS = ("dev", "test")


def capital_rows() -> list[tuple[str, str]]:
    """``(country, capital)`` rows of the shipped TSV, in file order."""
    text = (
        resources.files("tokenrouter_ray.quality")
        .joinpath("data/capitals.tsv")
        .read_text(encoding="utf-8")
    )
    rows = []
    for line in text.splitlines():
        if line.strip() and not line.startswith("#"):
            country, capital = line.split("\t")
            rows.append((country.strip(), capital.strip()))
    return rows


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower().removeprefix("the ")).strip("-")


def capitals() -> list[TaskItem]:
    return [
        TaskItem(
            id=f"capital-{_slug(country)}",
            prompt=f"What is the capital of {country}?",
            answer=capital,
            scorer="exact",
            split=_SPLITS[i % 2],
        )
        for i, (country, capital) in enumerate(capital_rows())
    ]


def _operands(rng: random.Random, op: str, digits: int) -> tuple[int, int]:
    low, high = (1, 9) if digits == 1 else (10, 99)
    a, b = rng.randint(low, high), rng.randint(low, high)
    return (max(a, b), min(a, b)) if op == "sub" else (a, b)


def arithmetic() -> list[TaskItem]:
    items = []
    for op, symbol in OPERATIONS.items():
        for digits in (1, 2):
            rng = random.Random(f"{ARITHMETIC_SEED}-{op}-{digits}")
            seen: set[tuple[int, int]] = set()
            while len(seen) < PER_KIND:
                a, b = _operands(rng, op, digits)
                if (a, b) in seen:
                    continue
                index = len(seen)
                seen.add((a, b))
                value = a + b if op == "add" else a - b if op == "sub" else a * b
                items.append(
                    TaskItem(
                        id=f"arith-{op}{digits}-{index:02d}",
                        prompt=f"What is {a} {symbol} {b}? Answer with the number only.",
                        answer=str(value),
                        scorer="numeric",
                        split=_SPLITS[index % 2],
                    )
                )
    return items


BUILTIN = {"capitals": capitals, "arithmetic": arithmetic}


def builtin_names() -> list[str]:
    return [*BUILTIN, "demo"]


def builtin_tasks(name: str) -> list[TaskItem]:
    """The built-in set ``name``: ``capitals``, ``arithmetic`` or ``demo`` (both)."""
    if name == "demo":
        return capitals() + arithmetic()
    if name not in BUILTIN:
        raise UserFacingError(
            f"unknown built-in task set {name!r}; expected one of {', '.join(builtin_names())}"
        )
    return BUILTIN[name]()


def tasks_from_spec(spec: str) -> list[TaskItem]:
    """``builtin:NAME`` or the path of a JSONL task file."""
    if spec.startswith(BUILTIN_PREFIX):
        return builtin_tasks(spec.removeprefix(BUILTIN_PREFIX))
    return load_tasks(spec)
