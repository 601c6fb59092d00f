"""Seeded sampling does not depend on batch neighbours; filters keep what they promise."""

from __future__ import annotations

import math

import torch

from tests.engine.conftest import make_engine
from tokenrouter_ray.engine.request import SamplingParams
from tokenrouter_ray.engine.sampler import filter_logits, sample, token_logprobs

HOT = SamplingParams(temperature=1.3, top_p=0.95, top_k=50, max_tokens=16, seed=1234)


def test_same_seed_same_tokens_alone_and_in_a_batch_of_8(tiny_model_dir) -> None:
    prompt = [5, 17, 3, 99, 42]
    alone = make_engine(tiny_model_dir).generate([prompt], HOT)[0]
    engine = make_engine(tiny_model_dir)
    neighbours = [[i + 1] * (i + 2) for i in range(7)]
    for i, p in enumerate(neighbours):
        engine.add_request(f"n{i}", p, SamplingParams(temperature=1.0, max_tokens=16, seed=i))
    batched = engine.generate([prompt], HOT)[0]
    assert batched == alone
    other_seed = make_engine(tiny_model_dir).generate(
        [prompt], SamplingParams(temperature=1.3, top_p=0.95, top_k=50, max_tokens=16, seed=99)
    )[0]
    assert other_seed != alone  # the seed matters (16 draws at temperature 1.3)


def test_top_k_one_is_greedy() -> None:
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=2.0, top_k=1)] * 4
    assert sample(logits, params, [1, 2, 3, 4], [0, 0, 0, 0]).tolist() == logits.argmax(-1).tolist()


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    kept = filter_logits(probs.log(), SamplingParams(temperature=1.0, top_p=0.8))
    assert torch.isfinite(kept).tolist() == [True, True, False, False]
    kept = filter_logits(probs.log(), SamplingParams(temperature=1.0, top_p=0.81))
    assert torch.isfinite(kept).tolist() == [True, True, True, False]


def test_draws_follow_the_distribution() -> None:
    """Across positions, frequencies match softmax(logits / T) within 4 standard deviations."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 4000
    logits = probs.log().repeat(n, 1)
    params = [SamplingParams(temperature=1.0)] * n
    tokens = sample(logits, params, [7] * n, list(range(n)))
    counts = torch.bincount(tokens, minlength=4).double() / n
    for p, f in zip(probs.tolist(), counts.tolist(), strict=True):
        assert abs(f - p) < 4 * math.sqrt(p * (1 - p) / n)


def test_logprobs_are_the_raw_log_softmax_of_the_asked_rows_only() -> None:
    """Before temperature and filters (vLLM's "raw" logprobs); rows that did not ask get
    None; the top-k come in descending order."""
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(0))
    tokens = torch.tensor([5, 7, 11])
    got = token_logprobs(logits, tokens, [2, None, 0])
    want = torch.log_softmax(logits.double(), -1)
    assert got[1] is None
    for row, k in ((0, 2), (2, 0)):
        logprob, ids, values = got[row]
        assert math.isclose(logprob, want[row, tokens[row]].item(), abs_tol=1e-6)
        assert ids == torch.topk(want[row], k).indices.tolist()
        assert all(
            math.isclose(v, want[row, i].item(), abs_tol=1e-6)
            for i, v in zip(ids, values, strict=True)
        )
    assert token_logprobs(logits, tokens, [None] * 3) == [None] * 3


def test_the_engine_reports_logprobs_for_requests_that_ask(tiny_llama_dir, reference_model) -> None:
    engine = make_engine(tiny_llama_dir)
    prompt = [5, 17, 3, 99, 42]
    engine.add_request("asks", prompt, SamplingParams(max_tokens=4, logprobs=3))
    engine.add_request("not", [1, 2, 3], SamplingParams(max_tokens=4))
    result = engine.execute()
    rows = dict(zip(result.request_ids, result.logprobs, strict=True))
    assert rows["not"] is None
    logprob, ids, _ = rows["asks"]
    with torch.no_grad():
        ref = reference_model(tiny_llama_dir)(torch.tensor([prompt])).logits[0, -1]
    ref = torch.log_softmax(ref.double(), -1)
    token = result.token_ids[result.request_ids.index("asks")]
    assert math.isclose(logprob, ref[token].item(), abs_tol=1e-4)
    assert ids == torch.topk(ref, 3).indices.tolist()
    engine.commit(result)
    engine.abort("asks")
    engine.abort("not")
    engine.add_request("none", prompt, SamplingParams(max_tokens=4))
    assert engine.execute().logprobs is None  # no row asked: nothing computed
