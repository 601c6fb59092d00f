"""Scorers: does a response text answer a task item correctly? One function per rule.

A scorer takes ``(response, item)`` and returns a bool; `SCORERS` maps names to them and
`score` grades an item with its `TaskItem.scorer_name`. The rules:

- ``exact``: both sides normalised (case-folded, accents removed, punctuation turned into
  spaces, whitespace collapsed). Correct if the normalised answer equals the normalised
  response, or appears as a whole word or phrase in the response's *first sentence* (up to
  the first newline, or ``.``/``!``/``?`` followed by whitespace). So "Paris",
  "Paris." and "The capital of France is Paris." score for ``Paris``; "Parisian" does not,
  nor does a first sentence without it followed by "Paris" later.
- ``numeric``: the number after GSM8K's ``#### `` marker if there is one, else the last
  number in the response; commas are stripped and both sides compared as decimals
  (``12.0`` equals ``12``).
- ``regex``: the answer is a Python regular expression, searched anywhere in the response.
- ``choice``: multiple choice. The letter the response starts with (``B``, ``(B)``, ``B.``,
  ``B) ...``; not a bare letter before a word, as in "A city ..."), else "answer is B",
  else the one option whose text appears (as ``exact`` matches) in the first sentence;
  correct if that is the answer's option. The answer is a letter or the option's text.
"""

from __future__ import annotations

import re
import string
import unicodedata
from collections.abc import Callable
from decimal import Decimal, InvalidOperation

from tokenrouter_ray.errors import UserFacingError
from tokenrouter_ray.quality.tasks import TaskItem

Scorer = Callable[[str, TaskItem], bool]

_PUNCT = re.compile(f"[{re.escape(string.punctuation)}\u2018\u2019\u201c\u201d\u2013\u2014]")
_SENTENCE_END = re.compile(r"[.!?](?=\s|$)|\n")
_NUMBER = re.compile(r"(?<![\w.])-?\d[\d,]*(?:\.\d+)?|(?<![\w.-])\.\d+")
_GSM8K = re.compile(r"####\s*(-?[\d,]*\.?\d+)")
_LETTER = re.compile(r"^\s*[\(\[]?([A-Z])(?:[\)\].:,]|\s*$)")
_ANSWER_IS = re.compile(r"answer\s+is\s*:?\s*[\(\[]?([A-Z])\b")


def normalise(text: str) -> str:
    """Case-folded, accents removed, punctuation as spaces, whitespace collapsed."""
    decomposed = unicodedata.normalize("NFKD", text)
    bare = "".join(c for c in decomposed if not unicodedata.combining(c))
    return " ".join(_PUNCT.sub(" ", bare.casefold()).split())


def first_sentence(text: str) -> str:
    stripped = text.strip()
    end = _SENTENCE_END.search(stripped)
    return stripped if end is None else stripped[: end.start()]


def contains_phrase(text: str, phrase: str) -> bool:
    """Whether normalised ``phrase`` occurs in normalised ``text`` on word boundaries."""
    words, target = normalise(text), normalise(phrase)
    return bool(target) and f" {target} " in f" {words} "


def exact(response: str, item: TaskItem) -> bool:
    answer = normalise(item.answer)
    return normalise(response) == answer or contains_phrase(first_sentence(response), answer)


def _decimal(text: str) -> Decimal | None:
    try:
        return Decimal(text.replace(",", ""))
    except InvalidOperation:
        return None


def extract_number(response: str) -> Decimal | None:
    """GSM8K's ``#### N`` if present, else the last number in ``response``."""
    marked = _GSM8K.findall(response)
    if marked:
        return _decimal(marked[-1])
    found = _NUMBER.findall(response)
    return _decimal(found[-1]) if found else None


def numeric(response: str, item: TaskItem) -> bool:
    want, got = _decimal(item.answer.strip()), extract_number(response)
    return want is not None and got is not None and got == want


def regex(response: str, item: TaskItem) -> bool:
    return re.search(item.answer, response) is not None


def _answer_index(item: TaskItem) -> int | None:
    choices = item.choices or []
    answer = item.answer.strip()
    if len(answer) == 1 and answer.upper().isalpha():
        index = ord(answer.upper()) - ord("A")
        return index if index < len(choices) else None
    wanted = normalise(answer)
    return next((i for i, c in enumerate(choices) if normalise(c) == wanted), None)


def chosen_index(response: str, choices: list[str]) -> int | None:
    """The option a response picks: a leading letter, "answer is X", or the one named."""
    letter = _LETTER.match(response) or _ANSWER_IS.search(response)
    if letter is not None:
        index = ord(letter.group(1)) - ord("A")
        if index < len(choices):
            return index
    head = first_sentence(response)
    named = [i for i, c in enumerate(choices) if contains_phrase(head, c)]
    return named[0] if len(named) == 1 else None


def choice(response: str, item: TaskItem) -> bool:
    want = _answer_index(item)
    return want is not None and chosen_index(response, item.choices or []) == want


SCORERS: dict[str, Scorer] = {"exact": exact, "numeric": numeric, "regex": regex, "choice": choice}


def get_scorer(name: str) -> Scorer:
    try:
        return SCORERS[name]
    except KeyError:
        raise UserFacingError(
            f"unknown scorer {name!r}; expected one of {', '.join(SCORERS)}"
        ) from None


def score(item: TaskItem, response: str) -> bool:
    """Whether ``response`` answers ``item`` correctly, by the item's scorer (False for an
    item without an answer: those are judged, not scored, ``judge.py``)."""
    if item.answer is None:
        return False
    return get_scorer(item.scorer_name)(response, item)


def check_item(item: TaskItem) -> None:
    """Raise ``ValueError`` for an item no scorer could grade (loading reports the line)."""
    name = item.scorer_name
    if name not in SCORERS:
        raise ValueError(f"unknown scorer {name!r}; expected one of {', '.join(SCORERS)}")
    if item.answer is None:
        if item.scorer or item.choices:
            raise ValueError("a scorer or choices need an 'answer'")
        return
    if name == "regex":
        try:
            re.compile(item.answer)
        except re.error as exc:
            raise ValueError(f"answer is not a valid regular expression: {exc}") from None
    elif name == "numeric" and _decimal(item.answer.strip()) is None:
        raise ValueError(f"numeric scorer: answer {item.answer!r} is not a number")
    elif name == "choice":
        if not item.choices:
            raise ValueError("choice scorer: the item has no 'choices'")
        if _answer_index(item) is None:
            raise ValueError(f"choice scorer: answer {item.answer!r} is not a letter or option")
