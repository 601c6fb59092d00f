"""Request fields beyond the sampling basics: ``chat_template_kwargs`` reaches the template,
unknown fields are logged once per name (never silently dropped), and fields that would
change the output but are not implemented are a 400."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from tokenrouter_ray.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    InvalidRequestError,
    RequestLimits,
    parse_request,
    prepare_chat,
)
from tokenrouter_ray.openai import schemas as schemas_module

# Qwen3's documented chat-template behaviour, written small: ChatML turns, and with
# enable_thinking=false the generation prompt is followed by an empty think block, so the model
# answers without reasoning. (Not Qwen's file: only the part this server must get right.)
QWEN3_STYLE_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
EMPTY_THINK = "<think>\n\n</think>\n\n"


@pytest.fixture(scope="module")
def qwen3_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A tiny byte-level tokenizer with Qwen3's special tokens and a Qwen3-style template,
    saved to a directory and loaded back the way a model server loads one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tk = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>")
    fast.add_tokens(["<|im_start|>", "<think>", "</think>"], special_tokens=True)
    fast.chat_template = QWEN3_STYLE_TEMPLATE
    path: Path = tmp_path_factory.mktemp("qwen3-tokenizer")
    fast.save_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "2+2?"}], **fields}


def rendered(tokenizer: Any, body: dict[str, Any]) -> str:
    request = parse_request(ChatCompletionRequest, body)
    prepared = prepare_chat(request, tokenizer, RequestLimits(max_model_len=512))
    return tokenizer.decode(prepared.prompt_token_ids)


def test_enable_thinking_false_renders_an_empty_think_block(qwen3_tokenizer: Any) -> None:
    thinking = rendered(qwen3_tokenizer, chat())
    assert thinking == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    direct = rendered(qwen3_tokenizer, chat(chat_template_kwargs={"enable_thinking": False}))
    assert direct == thinking + EMPTY_THINK
    # the think markers are single special tokens, as in Qwen3's vocabulary
    think_id = qwen3_tokenizer.convert_tokens_to_ids("<think>")
    request = parse_request(
        ChatCompletionRequest, chat(chat_template_kwargs={"enable_thinking": False})
    )
    prompt = prepare_chat(request, qwen3_tokenizer, RequestLimits(max_model_len=512))
    assert prompt.prompt_token_ids.count(think_id) == 1
    # true or null: the template's default (thinking on)
    on = rendered(qwen3_tokenizer, chat(chat_template_kwargs={"enable_thinking": True}))
    assert on == thinking == rendered(qwen3_tokenizer, chat(chat_template_kwargs=None))


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"add_generation_prompt": False}, "chat_template_kwargs"),
        ({"tokenize": False, "enable_thinking": False}, "chat_template_kwargs"),
        ("enable_thinking", "chat_template_kwargs"),
    ],
)
def test_bad_chat_template_kwargs_are_400(kwargs: Any, param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse_request(ChatCompletionRequest, chat(chat_template_kwargs=kwargs))
    assert info.value.status_code == 400 and info.value.param == param


@pytest.fixture
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(schemas_module, "_warned_unknown", set())


def _unknown_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == schemas_module.__name__ and r.levelno == logging.WARNING
    ]


def test_unknown_fields_are_logged_once_per_name(
    fresh_warnings: None, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=schemas_module.__name__)
    body = chat(frobnicate=1, spaces_between_special_tokens=False)
    body["messages"][0]["weight"] = "hmm"
    for _ in range(3):
        request = parse_request(ChatCompletionRequest, body)
        assert not hasattr(request, "frobnicate")
    parse_request(CompletionRequest, {"model": "m", "prompt": "hi", "frobnicate": 2})
    warnings = _unknown_warnings(caplog)
    assert len(warnings) == 3, warnings  # once each, however many requests
    assert any("'frobnicate'" in w and "request" in w for w in warnings)
    assert any("'spaces_between_special_tokens'" in w for w in warnings)
    assert any("'weight'" in w and "message" in w for w in warnings)


def test_harmless_known_fields_are_accepted_without_a_warning(
    fresh_warnings: None, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=schemas_module.__name__)
    body = chat(
        user="u1", store=False, metadata={"k": "v"}, service_tier="auto",
        parallel_tool_calls=True, safety_identifier="s", prompt_cache_key="p",
        add_generation_prompt=True, modalities=["text"], min_tokens=0, use_beam_search=False,
        length_penalty=1.0, guided_json=None, documents=[], echo=False,
    )  # fmt: skip
    body["messages"] = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "tool_calls": []},
        {"role": "tool", "content": "r", "tool_call_id": "t1"},
    ]
    parse_request(ChatCompletionRequest, body)
    assert _unknown_warnings(caplog) == []


@pytest.mark.parametrize(
    "fields",
    [
        {"use_beam_search": True},
        {"length_penalty": 0.5},
        {"allowed_token_ids": [1, 2]},
        {"bad_words": ["x"]},
        {"prompt_logprobs": 1},
        {"truncate_prompt_tokens": 10},
        {"echo": True},
        {"add_generation_prompt": False},
        {"continue_final_message": True},
        {"chat_template": "{{ messages }}"},
        {"documents": [{"text": "d"}]},
        {"reasoning_effort": "low"},
        {"prediction": {"type": "content", "content": "x"}},
        {"modalities": ["text", "audio"]},
        {"audio": {"voice": "alloy"}},
        {"web_search_options": {}},
    ],
    ids=lambda f: next(iter(f)),
)
def test_output_changing_fields_not_implemented_are_400(fields: dict[str, Any]) -> None:
    (name,) = fields
    with pytest.raises(InvalidRequestError) as info:
        parse_request(ChatCompletionRequest, chat(**fields))
    error = info.value.to_dict()["error"]
    assert info.value.status_code == 400
    assert (error["param"], error["code"]) == (name, "unsupported_value"), error


def test_malformed_tool_calls_in_messages_are_400() -> None:
    """Tool calls in the history are served (rendered by the template); a malformed one
    (no function) is a 400 naming it."""
    body = chat()
    body["messages"].append(
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function"}]}
    )
    with pytest.raises(InvalidRequestError) as info:
        parse_request(ChatCompletionRequest, body)
    assert info.value.to_dict()["error"]["code"] == "missing_required_parameter"
    assert info.value.param == "messages[1].tool_calls[0].function"
