"""Chat messages through the model's own template."""

from __future__ import annotations

from typing import Any

import pytest

from tokenrouter_ray.openai import (
    ChatCompletionRequest,
    InvalidRequestError,
    parse_request,
    render_chat,
    template_messages,
)
from tokenrouter_ray.openai.chat import _token_ids


@pytest.mark.demo
def test_render_chat_equals_the_template(demo_tokenizer: Any) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi 😀"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    expected = demo_tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True
    )["input_ids"]
    assert render_chat(demo_tokenizer, messages) == list(expected)
    parsed = parse_request(ChatCompletionRequest, {"model": "m", "messages": messages}).messages
    assert render_chat(demo_tokenizer, parsed) == list(expected)
    text = demo_tokenizer.decode(render_chat(demo_tokenizer, messages))
    assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.demo
def test_developer_role_and_content_parts(demo_tokenizer: Any) -> None:
    parts = [{"type": "text", "text": "Be"}, {"type": "text", "text": "brief."}]
    messages = [{"role": "developer", "content": parts}, {"role": "user", "content": "Hi"}]
    assert template_messages(messages) == [
        {"role": "system", "content": "Be\nbrief."},
        {"role": "user", "content": "Hi"},
    ]
    text = demo_tokenizer.decode(render_chat(demo_tokenizer, messages))
    assert text.startswith("<|im_start|>system\nBe\nbrief.<|im_end|>")


def test_bad_content_in_plain_dicts_is_400() -> None:
    with pytest.raises(InvalidRequestError) as info:
        template_messages([{"role": "user", "content": [{"type": "image_url"}]}])
    assert info.value.param == "messages[0].content"


def test_no_chat_template_is_400(sp_tokenizer: Any) -> None:
    assert not sp_tokenizer.chat_template
    with pytest.raises(InvalidRequestError) as info:
        render_chat(sp_tokenizer, [{"role": "user", "content": "hi"}])
    assert info.value.code == "chat_template_missing" and info.value.status_code == 400


def test_template_that_rejects_the_conversation_is_400(
    sp_tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('must start with user') }}"
        "{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    monkeypatch.setattr(sp_tokenizer, "chat_template", template)
    assert render_chat(sp_tokenizer, [{"role": "user", "content": "the"}])
    with pytest.raises(InvalidRequestError) as info:
        render_chat(sp_tokenizer, [{"role": "system", "content": "x"}])
    assert "must start with user" in info.value.message


def test_token_ids_from_any_apply_chat_template_result() -> None:
    from transformers import BatchEncoding

    assert _token_ids([1, 2]) == [1, 2]
    assert _token_ids([[1, 2]]) == [1, 2]
    assert _token_ids({"input_ids": [1, 2]}) == [1, 2]
    assert _token_ids(BatchEncoding({"input_ids": [1, 2], "attention_mask": [1, 1]})) == [1, 2]
