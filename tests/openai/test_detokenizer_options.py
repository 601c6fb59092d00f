"""vLLM's output options in the detokenizer: include_stop_str_in_output, a stop token's text
left out of the output, min_tokens before stop strings count, skip_special_tokens, built
from a request by `PreparedRequest.detokenizer`."""

from __future__ import annotations

import random
from typing import Any

import pytest

from tests.openai.test_detokenizer import run
from tokenrouter_ray.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestLimits,
    parse_request,
    prepare_chat,
    prepare_completion,
)
from tokenrouter_ray.openai.detokenizer import IncrementalDetokenizer

pytestmark = pytest.mark.demo

TEXT = "The answer is 42. END OF ANSWER and more text"
LIMITS = RequestLimits(max_model_len=64, vocab_size=49152)


@pytest.mark.parametrize("chunked", [False, True])
def test_include_stop_str_keeps_the_stop_string(demo_tokenizer: Any, chunked: bool) -> None:
    ids = demo_tokenizer.encode(TEXT)
    rng = random.Random(3) if chunked else None
    cut = IncrementalDetokenizer(demo_tokenizer, stop=["END OF ANSWER"])
    kept = IncrementalDetokenizer(
        demo_tokenizer, stop=["END OF ANSWER"], include_stop_str_in_output=True
    )
    assert "".join(run(cut, ids, rng)) == "The answer is 42. "
    assert "".join(run(kept, ids, random.Random(3) if chunked else None)) == (
        "The answer is 42. END OF ANSWER"
    )
    assert kept.stopped and kept.stop_reason == "END OF ANSWER"
    assert kept.num_tokens == cut.num_tokens  # the token that completed it, no further


def test_a_stop_token_text_is_left_out_unless_asked(demo_tokenizer: Any) -> None:
    """A stop token id that ends the output has no text in it (vLLM); one that did not end
    it (more tokens followed) is text like any other."""
    ids = demo_tokenizer.encode("Hi there, friend")
    stop = ids[2]  # ","
    plain = IncrementalDetokenizer(demo_tokenizer, stop_token_ids={stop})
    assert "".join(run(plain, ids[:3])) == "Hi there"
    assert plain.num_tokens == 3 and plain.settled() == 3
    kept = IncrementalDetokenizer(
        demo_tokenizer, stop_token_ids={stop}, include_stop_str_in_output=True
    )
    assert "".join(run(kept, ids[:3])) == "Hi there,"
    passing = IncrementalDetokenizer(demo_tokenizer, stop_token_ids={stop})
    assert "".join(run(passing, ids)) == "Hi there, friend"
    eos = demo_tokenizer.eos_token_id
    raw = IncrementalDetokenizer(demo_tokenizer, skip_special_tokens=False, stop_token_ids={eos})
    assert "".join(run(raw, [*ids, eos])) == "Hi there, friend"  # EOS ended it: not text


def test_stop_strings_count_only_after_min_tokens(demo_tokenizer: Any) -> None:
    ids = demo_tokenizer.encode("yes no yes no yes and the rest")
    first = len(demo_tokenizer.encode("yes"))
    early = IncrementalDetokenizer(demo_tokenizer, stop=["yes"])
    assert "".join(run(early, ids)) == ""
    late = IncrementalDetokenizer(demo_tokenizer, stop=["yes"], min_tokens=first)
    assert "".join(run(late, ids)) == "yes no "  # the first "yes" came within min_tokens
    later = IncrementalDetokenizer(demo_tokenizer, stop=["yes"], min_tokens=len(ids))
    assert "".join(run(later, ids)) == "yes no yes no yes and the rest"
    assert not later.stopped


def test_prepared_request_builds_the_request_detokenizer(demo_tokenizer: Any) -> None:
    eos = demo_tokenizer.eos_token_id
    body: dict[str, Any] = {"model": "m", "prompt": "Hi", "max_tokens": 8}
    options = {"skip_special_tokens": False, "stop_token_ids": [5], "min_tokens": 2}
    prepared = prepare_completion(
        parse_request(CompletionRequest, {**body, **options}), demo_tokenizer, LIMITS
    )
    detok = prepared.detokenizer(demo_tokenizer)
    assert not detok.skip_special_tokens and detok.min_tokens == 2
    assert detok.stop_token_ids == {5, eos}
    chat = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "ignore_eos": True}
    prepared = prepare_chat(parse_request(ChatCompletionRequest, chat), demo_tokenizer, LIMITS)
    detok = prepared.detokenizer(demo_tokenizer)
    assert detok.skip_special_tokens and detok.stop_token_ids == frozenset()  # EOS ignored
