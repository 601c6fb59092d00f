"""IncrementalDetokenizer: the concatenation of everything emitted equals a full decode, no
U+FFFD mid-stream for valid text, stop strings cut exactly, special tokens silent."""

from __future__ import annotations

import random
from typing import Any

import pytest

from tokenrouter_ray.openai.detokenizer import IncrementalDetokenizer, plain_decoder

pytestmark = pytest.mark.demo

TEXTS = [
    "Hello, world! How are you today?",
    "Héllo wörld — naïve café, façade, Ångström, crème brûlée.",
    "日本語のテキストと中文文本，还有한국어 텍스트。",
    "Emoji: 😀😃😄 👩‍👩‍👧 🏳️‍🌈 🇯🇵 👍🏽 and text after.",
    "multiple   spaces    here\tand\ttabs",
    "lines\n\n\nwith\r\nbreaks\n  indented\n",
    "   leading and trailing   ",
    "code: def f(x):\n    return x ** 2  # ½ ≥ ∑ ∞",
    "a\u0301e\u0301 combining marks, zero\u200bwidth, RTL עברית العربية",
    "x",
]


def run(
    detok: IncrementalDetokenizer, ids: list[int], rng: random.Random | None = None
) -> list[str]:
    """Push ``ids`` one at a time, or in random chunks of 1..4 with ``rng``; then finish."""
    pieces, i = [], 0
    while i < len(ids):
        step = rng.randint(1, 4) if rng else 1
        pieces.append(detok.push(ids[i : i + step]))
        i += step
    pieces.append(detok.finish())
    return pieces


def random_text(rng: random.Random, length: int) -> str:
    pools = [(32, 127), (0xA0, 0x250), (0x4E00, 0x9FFF), (0x1F600, 0x1F650), (0x3040, 0x30FF)]
    out = []
    for _ in range(length):
        lo, hi = rng.choice(pools)
        out.append(rng.choice([chr(rng.randrange(lo, hi)), " ", "  ", "\n"]))
    return "".join(out)


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("text", TEXTS)
def test_real_texts_concat_equals_decode_and_no_replacement_char(
    demo_tokenizer: Any, text: str, chunked: bool
) -> None:
    ids = demo_tokenizer.encode(text)
    pieces = run(IncrementalDetokenizer(demo_tokenizer), ids, random.Random(1) if chunked else None)
    assert "".join(pieces) == demo_tokenizer.decode(ids, skip_special_tokens=True) == text
    assert not any("\ufffd" in p for p in pieces)


def test_random_valid_texts(demo_tokenizer: Any, sp_tokenizer: Any) -> None:
    rng = random.Random(0)
    for tokenizer in (demo_tokenizer, sp_tokenizer):
        for _ in range(60):
            ids = tokenizer.encode(random_text(rng, rng.randint(1, 40)), add_special_tokens=False)
            pieces = run(IncrementalDetokenizer(tokenizer), ids, rng)
            assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
            assert not any("\ufffd" in p for p in pieces), pieces


def test_random_token_ids_concat_equals_decode(demo_tokenizer: Any, sp_tokenizer: Any) -> None:
    """Arbitrary ids (invalid UTF-8, special tokens anywhere): still exactly the decode.

    The SentencePiece tokenizer draws no ``<0xNN>`` byte tokens: its ByteFallback decoder turns
    a whole run of byte tokens into U+FFFDs once the run stops being valid UTF-8, which
    rewrites text that was valid (and already shown) when it was decoded incrementally.
    """
    rng = random.Random(7)
    sp_ids = [i for i in range(len(sp_tokenizer)) if not (3 <= i < 3 + 256)]
    for tokenizer, pool in ((demo_tokenizer, range(len(demo_tokenizer))), (sp_tokenizer, sp_ids)):
        for _ in range(150):
            ids = [rng.choice(pool) for _ in range(rng.randint(1, 30))]
            pieces = run(IncrementalDetokenizer(tokenizer), ids, rng)
            assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True), ids


def test_split_character_is_held_until_complete(demo_tokenizer: Any) -> None:
    ids = demo_tokenizer.encode("a😀")
    assert len(ids) > 2  # the emoji spans several byte-level tokens
    detok = IncrementalDetokenizer(demo_tokenizer)
    outs = [detok.push([t]) for t in ids]
    assert outs[0] == "a"
    assert outs[1:-1] == [""] * (len(ids) - 2)
    assert outs[-1] == "😀"
    assert detok.finish() == ""


def test_incomplete_character_at_the_end_is_flushed_as_decode_does(demo_tokenizer: Any) -> None:
    ids = demo_tokenizer.encode("ok😀")[:-1]
    detok = IncrementalDetokenizer(demo_tokenizer)
    assert detok.push(ids) == "ok"
    assert detok.finish() == demo_tokenizer.decode(ids)[2:]
    assert detok.finish() == ""  # idempotent
    assert detok.push([5]) == ""  # nothing after finish


def test_leading_space_tokens_sentencepiece(sp_tokenizer: Any) -> None:
    ids = sp_tokenizer.convert_tokens_to_ids(["▁the", "▁", "▁", "he", "llo", "▁wor", "l", "d"])
    assert sp_tokenizer.decode(ids[1:2]) == ""  # a lone "▁" decodes to nothing on its own
    pieces = run(IncrementalDetokenizer(sp_tokenizer), ids)
    assert "".join(pieces) == sp_tokenizer.decode(ids) == "the  hello world"


def test_prompt_context_makes_the_first_token_a_continuation(sp_tokenizer: Any) -> None:
    prompt = sp_tokenizer.encode("the", add_special_tokens=False)
    output = sp_tokenizer.convert_tokens_to_ids(["▁wor", "l", "d"])
    alone = "".join(run(IncrementalDetokenizer(sp_tokenizer), output))
    with_context = "".join(
        run(IncrementalDetokenizer(sp_tokenizer, prompt_token_ids=prompt), output)
    )
    assert alone == sp_tokenizer.decode(output)  # decoded on its own: space stripped
    full = sp_tokenizer.decode(prompt + output)
    assert with_context == full[len(sp_tokenizer.decode(prompt)) :] == " world"


def test_prompt_context_byte_level(demo_tokenizer: Any) -> None:
    prompt = demo_tokenizer.encode("User: hi 😀")
    output = demo_tokenizer.encode(" Réponse: 世界 👍🏽")
    pieces = run(IncrementalDetokenizer(demo_tokenizer, prompt_token_ids=prompt), output)
    assert "".join(pieces) == " Réponse: 世界 👍🏽"


def test_special_tokens_are_not_text(demo_tokenizer: Any) -> None:
    eos = demo_tokenizer.eos_token_id
    ids = [*demo_tokenizer.encode("Hi there"), eos]
    detok = IncrementalDetokenizer(demo_tokenizer)
    assert "".join(run(detok, ids)) == "Hi there"
    assert detok.text == "Hi there"
    raw = "".join(run(IncrementalDetokenizer(demo_tokenizer, skip_special_tokens=False), ids))
    assert raw == "Hi there" + demo_tokenizer.eos_token


# ---- stop strings ----------------------------------------------------------------------------


def test_stop_string_spanning_tokens_is_cut_exactly(demo_tokenizer: Any) -> None:
    text = "The answer is 42. END OF ANSWER and more text"
    ids = demo_tokenizer.encode(text)
    detok = IncrementalDetokenizer(demo_tokenizer, stop=["END OF ANSWER"])
    pieces = [detok.push([t]) for t in ids]
    assert "".join(pieces) == "The answer is 42. "
    assert detok.stopped and detok.stop_reason == "END OF ANSWER"
    consumed = detok.num_tokens
    assert demo_tokenizer.decode(ids[:consumed]).endswith("END OF ANSWER")
    assert not demo_tokenizer.decode(ids[: consumed - 1]).endswith("END OF ANSWER")
    assert detok.push(ids) == "" and detok.finish() == ""


def test_no_part_of_a_stop_string_is_ever_emitted(demo_tokenizer: Any) -> None:
    """Each emitted prefix of the output is a prefix of the text before the stop."""
    text = "abc <|stop|> def"
    ids = demo_tokenizer.encode(text)
    detok = IncrementalDetokenizer(demo_tokenizer, stop=["<|stop|>"])
    emitted = ""
    for t in ids:
        emitted += detok.push([t])
        assert "abc ".startswith(emitted)
    assert emitted == "abc "


def test_held_stop_prefix_is_released_when_it_does_not_match(demo_tokenizer: Any) -> None:
    ids = demo_tokenizer.encode("say STO then STOP")
    detok = IncrementalDetokenizer(demo_tokenizer, stop=["STOP!"])
    out = "".join(detok.push([t]) for t in ids)
    assert out == "say STO then "  # "STOP" could still become "STOP!"
    assert detok.finish() == "STOP"
    assert not detok.stopped


def test_earliest_stop_wins(demo_tokenizer: Any) -> None:
    ids = demo_tokenizer.encode("one two three four")
    detok = IncrementalDetokenizer(demo_tokenizer, stop=["four", "o th", "two"])
    assert "".join(run(detok, ids)) == "one " and detok.stop_reason == "two"


def test_stop_strings_with_multibyte_characters(demo_tokenizer: Any) -> None:
    ids = demo_tokenizer.encode("Réponse: 世界😀 fin")
    detok = IncrementalDetokenizer(demo_tokenizer, stop=["界😀"])
    pieces = run(detok, ids)
    assert "".join(pieces) == "Réponse: 世"
    assert not any("\ufffd" in p for p in pieces)


def test_random_stops_cut_at_the_first_occurrence(demo_tokenizer: Any, sp_tokenizer: Any) -> None:
    rng = random.Random(3)
    for tokenizer in (demo_tokenizer, sp_tokenizer):
        for _ in range(80):
            ids = tokenizer.encode(random_text(rng, rng.randint(5, 40)), add_special_tokens=False)
            full = tokenizer.decode(ids, skip_special_tokens=True)
            start = rng.randrange(len(full))
            stop = full[start : start + rng.randint(1, 6)]
            detok = IncrementalDetokenizer(tokenizer, stop=[stop, "\x00never"])
            emitted = ""
            for piece in run(detok, ids, rng):
                emitted += piece
                assert full[: full.find(stop)].startswith(emitted)
            assert emitted == full[: full.find(stop)]
            assert detok.stopped and detok.stop_reason == stop


@pytest.mark.parametrize("stop", [(), ("brû", "ö")])
@pytest.mark.parametrize("text", TEXTS)
def test_settled_tokens_are_those_whose_text_was_emitted(
    demo_tokenizer: Any, text: str, stop: tuple[str, ...]
) -> None:
    """What a streamed chunk reports per token (logprobs, routing trace): after each push,
    ``settled()`` tokens, decoded, are a prefix of the text emitted so far (held-back text,
    an incomplete character or a possible stop string, holds its tokens back too); it never
    moves back; at the end it is ``num_tokens`` (the usage), stop string or not."""
    ids = demo_tokenizer.encode(text)
    detok = IncrementalDetokenizer(demo_tokenizer, stop=stop)
    emitted, settled = "", 0
    for token in ids:
        emitted += detok.push([token])
        now = detok.settled()
        assert now >= settled
        settled = now
        if not detok.stopped:
            assert emitted.startswith(demo_tokenizer.decode(ids[:settled]))
        else:
            break
    detok.finish()
    assert detok.settled() == detok.num_tokens == len(detok.token_ends)
    assert detok.token_ends == sorted(detok.token_ends)


@pytest.mark.parametrize("skip", [True, False])
def test_the_plain_decoder_is_the_tokenizers_decode(
    demo_tokenizer: Any, sp_tokenizer: Any, skip: bool
) -> None:
    """The direct call into the Rust decoder (taken where transformers adds no clean-up)
    decodes every id sequence, special tokens included, as ``tokenizer.decode`` does."""
    rng = random.Random(3)
    for tokenizer in (demo_tokenizer, sp_tokenizer):
        decode = plain_decoder(tokenizer, skip)
        for _ in range(200):
            ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(0, 12))]
            assert decode(ids) == tokenizer.decode(ids, skip_special_tokens=skip), ids


def test_a_tokenizer_that_cleans_up_spaces_keeps_its_own_decode(demo_tokenizer: Any) -> None:
    """With ``clean_up_tokenization_spaces`` on, transformers rewrites the decoded text
    (" ," -> ","): the plain decoder must be transformers' decode then, not the Rust one."""
    ids = demo_tokenizer.encode("a , b .", add_special_tokens=False)
    raw = demo_tokenizer.decode(ids)
    demo_tokenizer.clean_up_tokenization_spaces = True
    try:
        decode = plain_decoder(demo_tokenizer, True)
        assert decode(ids) == demo_tokenizer.decode(ids, skip_special_tokens=True)
        assert decode.func == demo_tokenizer.decode  # transformers' own path
    finally:
        demo_tokenizer.clean_up_tokenization_spaces = False
    assert plain_decoder(demo_tokenizer, True)(ids) == raw
