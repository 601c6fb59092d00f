"""Chat messages → prompt token ids, through the tokenizer's own chat template.

Messages enter as `ChatMessage` models (already validated) or plain dicts with ``role`` and
``content`` (a string, a list of text parts, or null); they leave as one list of token ids
ending with the template's generation prompt (``add_generation_prompt=True``). The template
is the only place that knows the model's turn markers, so nothing here builds a prompt by
hand. A request's ``chat_template_kwargs`` become extra template variables (Qwen3:
``enable_thinking=False`` renders an empty think block, so the model answers directly). A
model without a template, or a template that rejects the conversation (e.g. roles that do
not alternate), is a 400 for the client, not a 500.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic_core import PydanticCustomError

from tokenrouter_ray.openai.errors import InvalidRequestError
from tokenrouter_ray.openai.schemas import ChatMessage, flatten_content

# Roles OpenAI has that chat templates of open models rarely know.
_TEMPLATE_ROLE = {"developer": "system"}


def template_messages(messages: Sequence[ChatMessage | Mapping[str, Any]]) -> list[dict[str, str]]:
    """``[{"role", "content"}]`` with content flattened to text and roles templates know."""
    out = []
    for i, message in enumerate(messages):
        if isinstance(message, ChatMessage):
            role, content = message.role, message.content
        else:
            role, content = message.get("role"), message.get("content")
            try:
                content = flatten_content(content)
            except PydanticCustomError as exc:
                raise InvalidRequestError(
                    f"Invalid value for 'messages[{i}].content': {exc.message()}.",
                    param=f"messages[{i}].content",
                ) from None
        out.append({"role": _TEMPLATE_ROLE.get(str(role), str(role)), "content": content or ""})
    return out


def render_chat(
    tokenizer: Any,
    messages: Sequence[ChatMessage | Mapping[str, Any]],
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """Token ids of ``messages`` rendered by the tokenizer's chat template, ready to generate;
    ``template_kwargs`` are extra variables the template sees (``enable_thinking``, ...)."""
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError(
            "This model has no chat template, so /v1/chat/completions cannot be used with it; "
            "use /v1/completions with a raw prompt instead.",
            param="messages",
            code="chat_template_missing",
        )
    from jinja2.exceptions import TemplateError  # a dependency of transformers' chat templates

    try:
        rendered = tokenizer.apply_chat_template(
            template_messages(messages),
            add_generation_prompt=True,
            tokenize=True,
            **dict(template_kwargs or {}),
        )
    except TemplateError as exc:
        raise InvalidRequestError(
            f"The model's chat template rejected these messages: {exc}", param="messages"
        ) from None
    return _token_ids(rendered)


def _token_ids(rendered: Any) -> list[int]:
    """transformers 5 returns a ``BatchEncoding``; older versions a plain list."""
    if isinstance(rendered, Mapping) or hasattr(rendered, "input_ids"):
        rendered = rendered["input_ids"]
    if hasattr(rendered, "tolist"):
        rendered = rendered.tolist()
    ids = list(rendered)
    if ids and isinstance(ids[0], list):  # a batch of one
        ids = ids[0]
    return [int(t) for t in ids]
