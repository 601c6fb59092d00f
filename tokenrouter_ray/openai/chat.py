"""Chat messages → prompt token ids, through the tokenizer's own chat template.

Messages enter as `ChatMessage` models (already validated) or plain dicts with ``role`` and
``content`` (a string, a list of text parts, or null); they leave as one list of token ids
ending with the template's generation prompt (``add_generation_prompt=True``). The template
is the only place that knows the model's turn markers, so nothing here builds a prompt by
hand (tools, assistant tool calls and tool results included: the template renders them). A
request's ``chat_template_kwargs`` become extra template variables (Qwen3:
``enable_thinking=False`` renders an empty think block, so the model answers directly). A
model without a template, or a template that rejects the conversation (e.g. roles that do
not alternate), is a 400 for the client, not a 500.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic_core import PydanticCustomError

from tokenrouter_ray.openai.errors import InvalidRequestError
from tokenrouter_ray.openai.schemas import ChatMessage, MessageToolCall, flatten_content

# Roles OpenAI has that chat templates of open models rarely know.
_TEMPLATE_ROLE = {"developer": "system"}


def template_messages(messages: Sequence[ChatMessage | Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``[{"role", "content", ...}]`` with content flattened to text, roles templates know,
    and, where given, an assistant's ``tool_calls`` (arguments as a dict, as transformers'
    templates expect) and ``reasoning_content``, a tool message's ``tool_call_id``."""
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
        entry: dict[str, Any] = {
            "role": _TEMPLATE_ROLE.get(str(role), str(role)),
            "content": content or "",
        }
        if isinstance(message, ChatMessage):
            if message.tool_calls:
                entry["tool_calls"] = [_template_call(c) for c in message.tool_calls]
            if message.tool_call_id is not None:
                entry["tool_call_id"] = message.tool_call_id
            if message.reasoning_content is not None:
                entry["reasoning_content"] = message.reasoning_content
        out.append(entry)
    return out


def _template_call(call: MessageToolCall) -> dict[str, Any]:
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.function.name, "arguments": json.loads(call.function.arguments)},
    }


def template_supports_tools(tokenizer: Any) -> bool:
    """Whether the chat template renders ``tools`` (it names the variable)."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template


def render_chat(
    tokenizer: Any,
    messages: Sequence[ChatMessage | Mapping[str, Any]],
    template_kwargs: Mapping[str, Any] | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[int]:
    """Token ids of ``messages`` rendered by the tokenizer's chat template, ready to generate;
    ``template_kwargs`` are extra variables the template sees (``enable_thinking``, ...);
    ``tools`` (OpenAI's tool objects) are passed as the template's ``tools``."""
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError(
            "This model has no chat template, so /v1/chat/completions cannot be used with it; "
            "use /v1/completions with a raw prompt instead.",
            param="messages",
            code="chat_template_missing",
        )
    if tools and not template_supports_tools(tokenizer):
        raise InvalidRequestError(
            "This model's chat template cannot render tools, so 'tools' cannot be used with it.",
            param="tools",
            code="unsupported_value",
        )
    from jinja2.exceptions import TemplateError  # a dependency of transformers' chat templates

    try:
        rendered = tokenizer.apply_chat_template(
            template_messages(messages),
            tools=list(tools) if tools else None,
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
