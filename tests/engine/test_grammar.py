"""Structured outputs in one engine (engine/grammar.py): the matcher follows the request's
committed tokens, dropped tokens are rolled back (in place, or by reset and replay past
``MAX_ROLLBACK``), a complete grammar leaves only the stop tokens, and a request without
a grammar costs nothing."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from tests.engine.conftest import make_engine
from tests.openai.qwen3_tiny import VOCAB_SIZE, qwen3_tokenizer, save_qwen3
from tokenrouter_ray.engine import grammar as grammar_module
from tokenrouter_ray.engine.grammar import GrammarBook, check_grammar
from tokenrouter_ray.engine.request import GrammarSpec, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999}},
    "required": ["a"],
}


@pytest.fixture(scope="module")
def tokenizer():
    return qwen3_tokenizer()


@pytest.fixture(scope="module")
def book(tokenizer) -> GrammarBook:
    return GrammarBook.for_tokenizer(tokenizer, VOCAB_SIZE, [tokenizer.eos_token_id])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_qwen3(Path(tmp_path_factory.mktemp("qwen3")), 3)


def ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def allowed(book: GrammarBook, state) -> set[int]:
    logits = torch.zeros(1, VOCAB_SIZE)
    book.apply(logits, [(0, state)])
    return set(torch.isfinite(logits[0]).nonzero()[:, 0].tolist())


def test_sync_accepts_new_tokens_and_rolls_back_dropped_ones(book, tokenizer) -> None:
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    prompt = [1, 2, 3]
    state = book.new_state(spec)
    state.sync(prompt + ids(tokenizer, '{"a": 12'), len(prompt))
    assert state.accepted == ids(tokenizer, '{"a": 12')
    # Another model replaced the last two tokens ("12" -> "7"): a truncate at the anchor,
    # then its suffix; the matcher rolls back two tokens and accepts the new one.
    state.sync(prompt + ids(tokenizer, '{"a": 7'), len(prompt))
    assert state.rollbacks == 2 and state.replays == 0
    assert state.accepted == ids(tokenizer, '{"a": 7')
    fresh = book.new_state(spec)
    fresh.sync(ids(tokenizer, '{"a": 7'), 0)
    assert allowed(book, state) == allowed(book, fresh)  # same state as never having seen 12
    state.sync(prompt + ids(tokenizer, '{"a": 7}'), len(prompt))
    assert allowed(book, state) == {tokenizer.eos_token_id}  # complete: only EOS


def test_a_deep_truncate_resets_and_replays(book, tokenizer, monkeypatch) -> None:
    monkeypatch.setattr(grammar_module, "MAX_ROLLBACK", 2)
    spec = GrammarSpec("regex", "[a-z]{0,40}!")
    state = book.new_state(spec)
    state.sync(ids(tokenizer, "abcdefgh"), 0)
    state.sync(ids(tokenizer, "abcx"), 0)  # five dropped, one new: past the bound
    assert state.replays == 1 and state.rollbacks == 0
    assert state.accepted == ids(tokenizer, "abcx")
    state.sync(ids(tokenizer, "abcxy"), 0)  # a one-token drop... none: an append
    state.sync(ids(tokenizer, "abcxz"), 0)  # one dropped: in place
    assert state.rollbacks == 1 and state.replays == 1
    assert not state.broken


def test_a_refused_token_leaves_only_stop_tokens(book, tokenizer) -> None:
    state = book.new_state(GrammarSpec("regex", "[0-9]+"), stop_token_ids=[5])
    state.sync(ids(tokenizer, "12a"), 0)  # "a" cannot be in it (only a bug commits it)
    assert state.broken and state.accepted == ids(tokenizer, "12")
    assert allowed(book, state) == {tokenizer.eos_token_id, 5}


def test_check_grammar_names_the_problem() -> None:
    with pytest.raises(ValueError, match="Unsupported type"):
        check_grammar(GrammarSpec("json_schema", '{"type": "foo"}'))
    with pytest.raises(ValueError, match="parenthesis"):
        check_grammar(GrammarSpec("regex", "(ab"))
    with pytest.raises(ValueError):
        check_grammar(GrammarSpec("ebnf", "root ::= "))
    with pytest.raises(ValueError, match="kind"):
        GrammarSpec("yaml", "x")
    check_grammar(GrammarSpec("json_schema", json.dumps(SCHEMA)))  # a good one passes


def test_engine_masks_every_row_and_follows_an_anchor_truncate(model_dir, tokenizer) -> None:
    """A constrained and an unconstrained request in one batch: the constrained one writes
    only what its grammar allows and stops when it is complete; a resume that drops tokens
    at an anchor rolls its matcher back."""
    engine = make_engine(model_dir, num_blocks=128)
    spec = GrammarSpec("regex", "(yes|no|maybe) [0-9]{1,3}")
    prompt = ids(tokenizer, "Answer:")
    free = engine.add_request("free", prompt, SamplingParams(max_tokens=12))
    req = engine.add_request("c", prompt, SamplingParams(max_tokens=30, grammar=spec))
    for _ in range(4):  # the matcher has accepted the first three (the 4th: next sync)
        engine.step()
    assert engine.runner.grammars is not None
    state = engine.runner.grammars.states[req]
    # Another model replaced the last three output tokens: hand away, come back at an
    # anchor after the first output token, with the next letter of the word it starts.
    engine.pause("c")
    assert req.num_output_tokens == 4 and len(state.accepted) == 3
    first = tokenizer.decode(req.output_token_ids[:1])
    word = next(w for w in ("yes", "no", "maybe") if w.startswith(first))
    engine.resume("c", ids(tokenizer, word[1]), anchor=req.num_prompt_tokens + 1)
    produced = list(req.output_token_ids)
    while "c" in engine.requests:
        engine.step()
    assert state.rollbacks >= 1 and state.replays == 0
    out = state.accepted
    assert out[: len(produced)] == produced
    assert req.finish_reason == "stop"
    assert re.fullmatch(r"(yes|no|maybe) [0-9]{1,3}", tokenizer.decode(out))
    while "free" in engine.requests:
        engine.step()
    # the unconstrained row of the same batches is untouched by its neighbour's mask
    alone = make_engine(model_dir, num_blocks=128)
    assert free.output_token_ids == alone.generate([prompt], SamplingParams(max_tokens=12))[0]


def test_no_grammar_no_matcher(model_dir, tokenizer) -> None:
    engine = make_engine(model_dir, num_blocks=64)
    engine.generate([ids(tokenizer, "hi")], SamplingParams(max_tokens=4))
    assert engine.runner.grammars is None  # nothing built, nothing masked


def test_the_grammar_travels_on_a_first_visit_and_bad_ones_are_refused() -> None:
    import msgspec

    from tokenrouter_ray.protocol import MsgKind, PeerReq, ProtocolError, decode, encode

    spec = SamplingParams(max_tokens=9, grammar=GrammarSpec("regex", "[ab]+"))
    msg = PeerReq("r", "small", "large", MsgKind.HANDOFF, 1, tokens=[1, 2], sampling=spec)
    assert decode(encode(msg)).sampling == spec
    plain = msgspec.structs.replace(msg, sampling=SamplingParams(max_tokens=9))
    assert decode(encode(plain)).sampling.grammar is None
    with pytest.raises(ProtocolError):  # a grammar kind nobody knows: refused on decode
        decode(encode(msg).replace(b"\xa5regex", b"\xa4yaml"))
