"""Scorers on known strings (hits and misses) and the Wilson interval's known values."""

from __future__ import annotations

import pytest

from tokenrouter_ray.errors import UserFacingError
from tokenrouter_ray.quality.scorers import SCORERS, extract_number, get_scorer, normalise, score
from tokenrouter_ray.quality.stats import wilson_interval
from tokenrouter_ray.quality.tasks import TaskItem


def item(answer: str, scorer: str | None = None, choices: list[str] | None = None) -> TaskItem:
    return TaskItem(id="q", prompt="?", answer=answer, scorer=scorer, choices=choices)


def test_normalise_folds_case_accents_punctuation_and_space() -> None:
    assert normalise("  Brasília!! ") == "brasilia"
    assert normalise("Port-au-Prince") == "port au prince"
    assert normalise("Chișinău") == "chisinau"
    assert normalise("MEXICO\n  City.") == "mexico city"


@pytest.mark.parametrize(
    "response",
    ["Paris", "paris.", " PARIS ", "The capital of France is Paris.", "Paris. It has 2 million"],
)
def test_exact_hits(response: str) -> None:
    assert score(item("Paris"), response)


@pytest.mark.parametrize(
    "response",
    ["Parisian food", "Lyon", "", "I am not sure. Maybe Paris", "Lyon\nParis"],
)
def test_exact_misses(response: str) -> None:
    assert not score(item("Paris"), response)


def test_exact_phrases_and_accents() -> None:
    assert score(item("Mexico City"), "It is Mexico City, of course.")
    assert not score(item("Mexico City"), "Mexico")
    assert score(item("Brasília"), "Brasilia")
    assert score(item("Port-au-Prince"), "The capital is Port au Prince!")


@pytest.mark.parametrize(
    ("response", "answer", "hit"),
    [
        ("12", "12", True),
        ("7 + 5 = 12", "12", True),
        ("The answer is 1,234.", "1234", True),
        ("12.0", "12", True),
        ("-3", "-3", True),
        ("9-5=4", "4", True),
        ("reasoning 3 then 4\n#### 7\nmore 9", "7", True),  # #### wins over the last number
        ("7 + 5 is twelve", "12", False),
        ("12 or 13", "12", False),  # the last number counts
        ("no number", "0", False),
        ("5", "-5", False),
    ],
)
def test_numeric(response: str, answer: str, hit: bool) -> None:
    assert score(item(answer, "numeric"), response) is hit


def test_extract_number_edge_cases() -> None:
    assert extract_number("a7b") is None  # inside a word is not a number
    assert str(extract_number("total: 3,000,000")) == "3000000"
    assert extract_number("#### 1,000") == 1000


def test_regex_searches_the_pattern() -> None:
    assert score(item(r"\b(Kyiv|Kiev)\b", "regex"), "It is Kiev.")
    assert not score(item(r"^Kyiv$", "regex"), "It is Kyiv.")


CHOICES = ["Paris", "Lyon", "Marseille", "Nice"]


@pytest.mark.parametrize(
    ("response", "hit"),
    [
        ("A", True),
        ("(A)", True),
        ("A. Paris", True),
        ("A) because", True),
        ("The answer is A", True),
        ("Paris", True),
        ("It is Paris.", True),
        ("B", False),
        ("Lyon", False),
        ("Paris or Lyon", False),  # two options named: no choice
        ("A city in France", False),  # a bare article is not the letter A
        ("E", False),  # out of range
    ],
)
def test_choice(response: str, hit: bool) -> None:
    assert score(item("A", choices=CHOICES), response) is hit
    assert score(item("Paris", choices=CHOICES), response) is hit  # answer as text


def test_default_scorer_and_registry() -> None:
    assert item("x").scorer_name == "exact"
    assert item("A", choices=CHOICES).scorer_name == "choice"
    assert set(SCORERS) == {"exact", "numeric", "regex", "choice"}
    with pytest.raises(UserFacingError, match="unknown scorer 'fuzzy'"):
        get_scorer("fuzzy")


@pytest.mark.parametrize(
    ("k", "n", "low", "high"),
    [(8, 10, 0.490, 0.943), (0, 10, 0.0, 0.278), (10, 10, 0.722, 1.0), (50, 100, 0.404, 0.596)],
)
def test_wilson_known_values(k: int, n: int, low: float, high: float) -> None:
    lo, hi = wilson_interval(k, n)
    assert lo == pytest.approx(low, abs=5e-4) and hi == pytest.approx(high, abs=5e-4)
    assert lo <= k / n <= hi


def test_wilson_edges() -> None:
    assert wilson_interval(0, 0) == (0.0, 1.0)
    narrow, wide = wilson_interval(800, 1000), wilson_interval(8, 10)
    assert wide[0] < narrow[0] < narrow[1] < wide[1]
    with pytest.raises(ValueError):
        wilson_interval(3, 2)
