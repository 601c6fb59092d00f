"""From request to prompt ids + SamplingOptions, and the limits that depend on the model."""

from __future__ import annotations

from typing import Any

import pytest

from tokenrouter_ray.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    ContextLengthExceededError,
    InvalidRequestError,
    ModelNotFoundError,
    RequestLimits,
    SamplingOptions,
    check_model,
    error_response,
    parse_request,
    prepare_chat,
    prepare_completion,
)
from tokenrouter_ray.protocol import SamplingSpec

LIMITS = RequestLimits(max_model_len=64, vocab_size=49152)


def completion(tokenizer: Any, limits: RequestLimits = LIMITS, **fields: Any) -> Any:
    body = {"model": "m", "prompt": "Hello there", **fields}
    return prepare_completion(parse_request(CompletionRequest, body), tokenizer, limits)


def chat(tokenizer: Any, limits: RequestLimits = LIMITS, **fields: Any) -> Any:
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], **fields}
    return prepare_chat(parse_request(ChatCompletionRequest, body), tokenizer, limits)


def test_completion_prompt_is_tokenized(demo_tokenizer: Any) -> None:
    prepared = completion(demo_tokenizer)
    assert prepared.prompt_token_ids == demo_tokenizer.encode("Hello there")
    assert prepared.sampling == SamplingOptions(
        SamplingSpec(max_tokens=16, temperature=1.0)
    )  # OpenAI's defaults
    assert completion(demo_tokenizer, prompt=[5, 6, 7]).prompt_token_ids == [5, 6, 7]


def test_sampling_options_carry_every_field(demo_tokenizer: Any) -> None:
    s = completion(
        demo_tokenizer, temperature=0, top_p=0.9, top_k=40, min_p=0, seed=7, stop=["\n", "##"],
        n=3, stream=True, stream_options={"include_usage": True}, ignore_eos=True,
        stop_token_ids=[2], repetition_penalty=1, max_tokens=8,
    ).sampling  # fmt: skip
    assert s == SamplingOptions(
        SamplingSpec(
            max_tokens=8, temperature=0.0, top_p=0.9, top_k=40, seed=7, stop_token_ids=(2,),
            ignore_eos=True,
        ),
        stop=("\n", "##"), n=3, stream=True, include_usage=True,
    )  # fmt: skip


def test_to_spec_gives_each_choice_its_own_seed() -> None:
    options = SamplingOptions(
        SamplingSpec(max_tokens=5, seed=10, stop_token_ids=(2,), top_k=3, temperature=1.0), n=2
    )
    specs = [options.to_spec(i) for i in range(2)]
    assert [s.seed for s in specs] == [10, 11]
    assert specs[0].max_tokens == 5 and specs[0].stop_token_ids == (2,) and specs[0].top_k == 3
    assert SamplingOptions(SamplingSpec(max_tokens=1, seed=-1)).to_spec(0).seed == (1 << 63) - 1
    unseeded = SamplingOptions(SamplingSpec(max_tokens=1))
    assert unseeded.to_spec(1).seed is None  # the ingress picks one


def test_sampling_parity_fields_reach_the_engine_spec(demo_tokenizer: Any) -> None:
    """Penalties, min_p, logit_bias and min_tokens travel to every model in the spec; the
    output options stay with the ingress's detokenizer. One rule for both endpoints."""
    fields = dict(
        presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.2, min_p=0.05,
        logit_bias={"17": 2.5, "3": -100}, min_tokens=4, include_stop_str_in_output=True,
        skip_special_tokens=False, max_tokens=8,
    )  # fmt: skip
    for prepare in (completion, chat):
        prepared = prepare(demo_tokenizer, **fields)
        spec = prepared.sampling.to_spec(0)
        assert (spec.presence_penalty, spec.frequency_penalty) == (0.5, -0.25)
        assert (spec.repetition_penalty, spec.min_p, spec.min_tokens) == (1.2, 0.05, 4)
        assert spec.logit_bias == ((3, -100.0), (17, 2.5))  # ids ascending
        detok = prepared.detokenizer(demo_tokenizer)
        assert detok.include_stop and not detok.skip_special_tokens and detok.min_tokens == 4
    plain = completion(demo_tokenizer).sampling
    assert plain.to_spec(0) == SamplingOptions(
        SamplingSpec(max_tokens=16, temperature=1.0)
    ).to_spec(0)
    assert not plain.to_spec(0).has_processors and plain.skip_special_tokens


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"logit_bias": {"49152": 1.0}}, "logit_bias"),  # outside the demo vocabulary
        ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),  # more than the budget
    ],
)
def test_sampling_parity_limits_that_need_the_model(
    demo_tokenizer: Any, fields: dict[str, Any], param: str
) -> None:
    limits = RequestLimits(max_model_len=64, vocab_size=49152)
    for prepare in (completion, chat):
        with pytest.raises(InvalidRequestError) as caught:
            prepare(demo_tokenizer, limits, **fields)
        assert caught.value.status_code == 400 and caught.value.param == param


def test_max_tokens_null_means_rest_of_context(demo_tokenizer: Any) -> None:
    prompt_len = len(demo_tokenizer.encode("Hello there"))
    assert completion(demo_tokenizer, max_tokens=None).sampling.spec.max_tokens == 64 - prompt_len
    capped = RequestLimits(max_model_len=64, max_output_tokens=10)
    assert completion(demo_tokenizer, capped, max_tokens=None).sampling.spec.max_tokens == 10
    chat_prompt_len = len(chat(demo_tokenizer, RequestLimits(max_model_len=4096)).prompt_token_ids)
    big = RequestLimits(max_model_len=4096)
    assert chat(demo_tokenizer, big).sampling.spec.max_tokens == 4096 - chat_prompt_len


def test_chat_budget(demo_tokenizer: Any) -> None:
    big = RequestLimits(max_model_len=4096)
    assert (
        chat(demo_tokenizer, big, max_tokens=9, max_completion_tokens=20).sampling.spec.max_tokens
        == 9
    )


@pytest.mark.parametrize(("param", "value"), [("max_tokens", 63), ("max_tokens", 10**30)])
def test_completion_over_context_is_400_context_length_exceeded(
    demo_tokenizer: Any, param: str, value: int
) -> None:
    with pytest.raises(ContextLengthExceededError) as info:
        completion(demo_tokenizer, **{param: value})
    status, body = error_response(info.value)
    assert status == 400
    assert body["error"]["code"] == "context_length_exceeded"
    assert body["error"]["param"] == param and "64" in body["error"]["message"]


def test_prompt_over_context(demo_tokenizer: Any) -> None:
    with pytest.raises(ContextLengthExceededError) as info:
        completion(demo_tokenizer, prompt="word " * 200, max_tokens=None)
    assert info.value.param == "prompt"
    long_chat = [{"role": "user", "content": "word " * 200}]
    with pytest.raises(ContextLengthExceededError) as info:
        chat(demo_tokenizer, messages=long_chat)
    assert info.value.param == "messages"
    with pytest.raises(ContextLengthExceededError) as info:
        chat(demo_tokenizer, max_completion_tokens=60)
    assert info.value.param == "max_completion_tokens"


def test_server_caps(demo_tokenizer: Any) -> None:
    limits = RequestLimits(max_model_len=64, vocab_size=100, max_n=2, max_output_tokens=8)
    for fields, param in [
        ({"n": 3}, "n"),
        ({"max_tokens": 9}, "max_tokens"),
        ({"prompt": [1, 100], "max_tokens": 4}, "prompt"),
        ({"stop_token_ids": [5000]}, "stop_token_ids"),
    ]:
        with pytest.raises(InvalidRequestError) as info:
            completion(demo_tokenizer, limits, **fields)
        assert info.value.param == param and info.value.status_code == 400


def test_unknown_model_is_404() -> None:
    check_model("small", {"small", "large"})
    with pytest.raises(ModelNotFoundError) as info:
        check_model("gpt-4", {"small", "large"})
    status, body = error_response(info.value)
    assert status == 404 and body["error"]["code"] == "model_not_found"
    assert body["error"]["type"] == "invalid_request_error"
