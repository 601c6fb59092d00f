"""Sampling parity on one model: the engine's penalties, logit_bias, min_tokens and min_p
against plain transformers (its own generate and logits processors / warpers), and the
batched processors against the same processors applied one row at a time."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
)

from tests.engine.conftest import greedy_reference, make_engine
from tokenrouter_ray.engine.logits_processors import apply_processors, uses_processors
from tokenrouter_ray.engine.request import SamplingParams
from tokenrouter_ray.engine.sampler import filter_rows

PROMPT = [3, 17, 17, 42, 9, 3, 17]
N = 24


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's presence / frequency penalties, written plainly (a loop over the output)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        for row, ids in enumerate(input_ids.tolist()):
            counts: dict[int, int] = {}
            for t in ids[self.prompt_len :]:
                counts[t] = counts.get(t, 0) + 1
            for t, c in counts.items():
                scores[row, t] -= self.frequency * c + self.presence
        return scores


def engine_greedy(path: str, n: int = N, **sampling: object) -> list[int]:
    engine = make_engine(path)
    return engine.generate([PROMPT], SamplingParams(max_tokens=n, **sampling))[0]


def hf_greedy(model: torch.nn.Module, n: int = N, **kwargs: object) -> list[int]:
    out = model.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=n, **kwargs)
    return out[0, len(PROMPT) :].tolist()


@pytest.mark.parametrize("penalty", [1.5, 0.7])
def test_repetition_penalty_equals_transformers_greedy(
    tiny_model_dir: str, reference_model, penalty: float
) -> None:
    model = reference_model(tiny_model_dir)
    want = hf_greedy(model, repetition_penalty=penalty, min_new_tokens=N)
    assert engine_greedy(tiny_model_dir, repetition_penalty=penalty) == want
    assert want != greedy_reference(model, PROMPT, N)  # the penalty changed the output


def test_presence_and_frequency_penalties_equal_openai_definition(
    tiny_model_dir: str, reference_model
) -> None:
    model = reference_model(tiny_model_dir)
    for presence, frequency in [(1.5, 0.0), (0.0, 1.0), (0.5, 0.8), (-1.0, 0.0)]:
        procs = LogitsProcessorList([OpenAIPenalties(len(PROMPT), presence, frequency)])
        want = hf_greedy(model, logits_processor=procs, min_new_tokens=N)
        got = engine_greedy(tiny_model_dir, presence_penalty=presence, frequency_penalty=frequency)
        assert got == want, (presence, frequency)
    assert want != greedy_reference(model, PROMPT, N)


def test_logit_bias_equals_transformers_sequence_bias(tiny_model_dir: str, reference_model) -> None:
    model = reference_model(tiny_model_dir)
    plain = greedy_reference(model, PROMPT, N)
    bias = {plain[2]: -100.0, 5: 4.0, 77: 2.5}
    want = hf_greedy(model, sequence_bias={(t,): b for t, b in bias.items()}, min_new_tokens=N)
    assert engine_greedy(tiny_model_dir, logit_bias=tuple(sorted(bias.items()))) == want
    assert want != plain and plain[2] not in want


def test_min_tokens_equals_transformers_min_new_tokens(
    tiny_model_dir: str, reference_model
) -> None:
    """A stop token the model writes early: min_tokens masks it (and it does not stop) until
    that many tokens exist, as transformers' MinNewTokensLengthLogitsProcessor does."""
    model = reference_model(tiny_model_dir)
    plain = greedy_reference(model, PROMPT, N)
    stop = plain[1]
    assert engine_greedy(tiny_model_dir, stop_token_ids=(stop,)) == plain[:2]
    for min_tokens in (2, 6):
        want = hf_greedy(model, eos_token_id=stop, min_new_tokens=min_tokens)
        got = engine_greedy(tiny_model_dir, stop_token_ids=(stop,), min_tokens=min_tokens)
        assert got == want and len(got) > min_tokens, min_tokens
        assert stop not in got[:min_tokens]


def test_min_tokens_stop_check_agrees_with_the_mask(tiny_llama_dir: str) -> None:
    """A stop token that reaches the engine while the mask is on (here: written into the
    sequence by hand, as a peer's token would be) does not stop the request."""
    engine = make_engine(tiny_llama_dir)
    plain = engine_greedy(tiny_llama_dir, n=4)
    sp = SamplingParams(max_tokens=8, stop_token_ids=(plain[0],), min_tokens=3)
    request = engine.add_request("r", PROMPT, sp)
    assert engine._stop_status(request, []) is None
    request.append_tokens([plain[0]])  # output token 1 <= min_tokens: no stop
    assert engine._stop_status(request, [plain[0]]) is None
    request.append_tokens([1, 2, plain[0]])  # output token 4 > min_tokens: stops
    assert engine._stop_status(request, [plain[0]]) is not None


def test_min_p_equals_transformers_min_p_after_temperature() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 500, generator=gen) * 3
    for temperature, min_p in [(1.0, 0.05), (0.7, 0.2), (1.5, 0.01), (1.0, 1.0)]:
        params = [SamplingParams(temperature=temperature, min_p=min_p)] * 6
        got = filter_rows(logits, params)
        warp = LogitsProcessorList([TemperatureLogitsWarper(temperature), MinPLogitsWarper(min_p)])
        want = warp(torch.zeros(6, 1, dtype=torch.long), logits.clone())
        assert torch.isfinite(got).tolist() == torch.isfinite(want).tolist()
    one = filter_rows(logits[:1], [SamplingParams(temperature=1.0, min_p=1.0)])
    assert int(torch.isfinite(one).sum()) == 1  # only the top token survives min_p = 1


def test_min_p_rows_mixed_with_plain_rows() -> None:
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(1)) * 4
    params = [
        SamplingParams(temperature=0.8, min_p=0.1),
        SamplingParams(temperature=0.8, top_k=20),
        SamplingParams(temperature=1.2, min_p=0.3, top_p=0.9),
        SamplingParams(temperature=1.0),
    ]
    got = filter_rows(logits, params)
    for i, p in enumerate(params):
        assert torch.equal(got[i], filter_rows(logits[i : i + 1], [p])[0])
    plain = filter_rows(logits[1:2], [params[1]])[0]
    assert torch.equal(got[1], plain)  # no min_p: the former filters, untouched


def random_params(rng: random.Random) -> SamplingParams:
    return SamplingParams(
        presence_penalty=rng.choice([0.0, 0.0, 1.0, -0.5]),
        frequency_penalty=rng.choice([0.0, 0.0, 0.4]),
        repetition_penalty=rng.choice([1.0, 1.0, 1.3, 0.8]),
        logit_bias=rng.choice([(), ((1, 5.0), (40, -3.0))]),
        min_tokens=rng.choice([0, 0, 3]),
        stop_token_ids=(7,),
    )


@pytest.mark.parametrize("trial", range(10))
def test_batched_processors_equal_one_row_at_a_time(trial: int) -> None:
    rng = random.Random(trial)
    rows, vocab = 12, 64
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(trial))
    params = [random_params(rng) for _ in range(rows)]
    seqs = [[rng.randrange(vocab) for _ in range(rng.randrange(2, 20))] for _ in range(rows)]
    prompts = [rng.randrange(1, len(s) + 1) for s in seqs]
    raw = logits.clone()
    got = apply_processors(logits, params, seqs, prompts, {0})
    assert torch.equal(logits, raw)  # the raw logits are left as they were
    for i, p in enumerate(params):
        one = apply_processors(logits[i : i + 1], [p], [seqs[i]], [prompts[i]], {0})[0]
        assert torch.equal(got[i], one)
        if not p.has_processors:
            assert torch.equal(got[i], logits[i])
        if p.min_tokens and len(seqs[i]) - prompts[i] < p.min_tokens:
            assert got[i, 0] == got[i, 7] == float("-inf")  # EOS and the stop token


def test_no_processor_costs_nothing() -> None:
    logits = torch.randn(3, 10)
    params = [SamplingParams(temperature=0.5, top_k=3, min_p=0.1)] * 3
    assert not uses_processors(params)
    assert apply_processors(logits, params, [[1]] * 3, [1] * 3, {0}) is logits


def test_penalties_read_prompt_and_output_as_vllm_defines() -> None:
    """Repetition covers prompt and output; presence and frequency the output only."""
    logits = torch.tensor([[2.0, -2.0, 2.0, 2.0, 1.0]])
    seq, prompt_len = [0, 1, 2, 2], 2  # prompt (0, 1), output (2, 2)
    rep = apply_processors(logits, [SamplingParams(repetition_penalty=2.0)], [seq], [2], ())
    assert rep[0].tolist() == [1.0, -4.0, 1.0, 2.0, 1.0]
    sp = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    pf = apply_processors(logits, [sp], [seq], [prompt_len], ())
    assert pf[0].tolist() == [2.0, -2.0, 2.0 - 0.5 - 0.5, 2.0, 1.0]


def test_a_request_without_processors_is_unchanged_in_a_mixed_batch(tiny_llama_dir: str) -> None:
    plain = engine_greedy(tiny_llama_dir, n=12)
    engine = make_engine(tiny_llama_dir)
    a = engine.add_request("a", PROMPT, SamplingParams(max_tokens=12)).request_id
    engine.add_request("b", PROMPT, SamplingParams(max_tokens=12, repetition_penalty=1.8))
    got: dict[str, list[int]] = {"a": [], "b": []}
    while engine.has_unfinished:
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    assert got[a] == plain and got["b"] != plain


@pytest.mark.parametrize(
    "fields",
    [
        {"presence_penalty": 2.5},
        {"frequency_penalty": -2.1},
        {"repetition_penalty": 0.0},
        {"repetition_penalty": 11.0},
        {"min_p": 1.5},
        {"min_tokens": -1},
        {"logit_bias": ((5, 1.0), (3, 1.0))},  # not ascending
        {"logit_bias": ((5, 1.0), (5, 2.0))},  # not distinct
        {"logit_bias": ((5, 101.0),)},
    ],
    ids=str,
)
def test_bad_processor_params_are_refused_on_the_wire_too(fields: dict[str, object]) -> None:
    import msgspec

    from tokenrouter_ray.protocol import MsgKind, PeerReq, ProtocolError, decode, encode

    with pytest.raises(ValueError):
        SamplingParams(**fields)
    good = SamplingParams(min_tokens=3, repetition_penalty=1.2, logit_bias=((2, 1.0),))
    m = PeerReq("r", "ingress/0", "small/0", MsgKind.NEW, 0, [1], sampling=good)
    assert decode(encode(m)).sampling == good
    raw = msgspec.msgpack.decode(encode(m))
    names = list(SamplingParams.__struct_fields__)
    for name, value in fields.items():  # the same values in a frame: refused, not run
        raw[10][names.index(name)] = value
    with pytest.raises(ProtocolError):
        decode(msgspec.msgpack.encode(raw))
