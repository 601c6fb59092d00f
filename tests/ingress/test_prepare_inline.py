"""Which requests the ingress templates and tokenizes on its event loop (small plain ones:
their body bounds the work) and which it sends to a worker thread (large bodies, any
grammar to parse — the first imports xgrammar —, Responses requests that add stored turns)."""

from __future__ import annotations

import json

import pytest

from tokenrouter_ray.ingress.http_app import (
    CONSTRAINT_FIELDS,
    PREPARE_INLINE_BYTES,
    _prepare_inline,
)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


def _body(data: dict) -> bytes:
    return json.dumps(data).encode()


def test_a_small_plain_request_is_prepared_on_the_loop() -> None:
    assert _prepare_inline(_body(CHAT), CHAT, None)
    completion = {"model": "m", "prompt": "hello", "max_tokens": 4}
    assert _prepare_inline(_body(completion), completion, None)


def test_a_body_past_the_bound_goes_to_a_thread() -> None:
    data = {**CHAT, "messages": [{"role": "user", "content": "x" * PREPARE_INLINE_BYTES}]}
    assert not _prepare_inline(_body(data), data, None)


@pytest.mark.parametrize("field", sorted(CONSTRAINT_FIELDS))
def test_a_request_with_a_grammar_field_goes_to_a_thread(field: str) -> None:
    data = {**CHAT, field: {"type": "json_object"}}
    assert not _prepare_inline(_body(data), data, None)


def test_a_request_that_adds_stored_turns_goes_to_a_thread() -> None:
    assert not _prepare_inline(_body(CHAT), CHAT, lambda parsed: None)
