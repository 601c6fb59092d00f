"""docs/reference/api.md lists every request field the schemas declare, with its status."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tokenrouter_ray.openai import responses_input, schemas

DOC = Path(__file__).parents[2] / "docs" / "reference" / "api.md"
MODELS = [
    schemas.CompletionRequest,
    schemas.ChatCompletionRequest,
    schemas.ChatMessage,
    schemas.StreamOptions,
    schemas.FunctionDef,
]


def documented() -> set[str]:
    text = DOC.read_text()
    section = text[text.index("## Request fields") :]
    section = section[: section.index("\n## ", 1)]
    names = set()
    for line in section.splitlines():
        if line.startswith("| `") or "`function." in line or "stream_options." in line:
            names |= set(re.findall(r"`(?:function\.|stream_options\.)?([a-z_]+)`", line))
    return names


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
def test_every_declared_field_is_in_the_table(model: type) -> None:
    missing = sorted(set(model.model_fields) - documented())
    assert not missing, f"docs/reference/api.md 'Request fields' lacks {missing}"


def test_every_responses_field_is_in_its_section() -> None:
    """The Responses API section lists the request's fields, the chat fields it passes on
    and every input item's fields."""
    text = DOC.read_text()
    section = text[text.index("## Responses API") :]
    section = section[: section.index("\n## ", 1)]
    names = set(re.findall(r"`([a-z_]+)`", section))
    declared = set(responses_input.ResponsesRequest.model_fields) | responses_input.PASSTHROUGH
    for item in responses_input.ITEMS.values():
        declared |= set(item.model_fields)
    missing = sorted(declared - names)
    assert not missing, f"docs/reference/api.md 'Responses API' lacks {missing}"
