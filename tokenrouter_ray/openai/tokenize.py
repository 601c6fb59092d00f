"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's shapes), without a server.

A body enters as a `TokenizeCompletionRequest` (``prompt``), a `TokenizeChatRequest`
(``messages``, rendered by the chat template exactly as ``/v1/chat/completions`` renders
them, ``tools`` and ``chat_template_kwargs`` included) or a `DetokenizeRequest`
(``tokens``); it leaves as `TokenizeResponse` / `DetokenizeResponse`. ``model`` is optional
(checked when given). Token ids outside the vocabulary are a 400, as everywhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from tokenrouter_ray.openai.chat import render_chat
from tokenrouter_ray.openai.errors import InvalidRequestError
from tokenrouter_ray.openai.schemas import ChatMessage, ToolDef, _Lenient
from tokenrouter_ray.openai.validation import RequestLimits, parse_request


class TokenizeCompletionRequest(_Lenient):
    PART: ClassVar[str] = "tokenize request"

    model: str | None = Field(None, description="Checked when given.")
    prompt: str = Field(description="Text to tokenize.")
    add_special_tokens: bool | None = Field(None, description="Default true (as completions).")
    return_token_strs: bool | None = Field(None, description="Also return each token's text.")


class TokenizeChatRequest(_Lenient):
    PART: ClassVar[str] = "tokenize request"

    model: str | None = Field(None, description="Checked when given.")
    messages: list[ChatMessage] = Field(min_length=1, description="Rendered as in chat.")
    tools: list[ToolDef] | None = Field(None, description="Rendered by the chat template.")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="As in chat.")
    return_token_strs: bool | None = Field(None, description="Also return each token's text.")


class DetokenizeRequest(_Lenient):
    PART: ClassVar[str] = "detokenize request"

    model: str | None = Field(None, description="Checked when given.")
    tokens: list[int] = Field(description="Token ids to decode.")


class TokenizeResponse(BaseModel):
    model_config = ConfigDict(extra="forbid")

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: str


def tokenize(body: Mapping[str, Any], tokenizer: Any, limits: RequestLimits) -> TokenizeResponse:
    """The body's prompt or messages as token ids (chat: with the generation prompt)."""
    if "messages" in body:
        chat = parse_request(TokenizeChatRequest, body)
        tools = [t.model_dump(exclude_none=True) for t in chat.tools or ()] or None
        ids = render_chat(tokenizer, chat.messages, chat.chat_template_kwargs, tools)
        strs = chat.return_token_strs
    else:
        plain = parse_request(TokenizeCompletionRequest, body)
        special = plain.add_special_tokens is not False
        ids = list(tokenizer.encode(plain.prompt, add_special_tokens=special))
        strs = plain.return_token_strs
    return TokenizeResponse(
        count=len(ids),
        max_model_len=limits.max_model_len,
        tokens=ids,
        token_strs=tokenizer.convert_ids_to_tokens(ids) if strs else None,
    )


def detokenize(
    body: Mapping[str, Any], tokenizer: Any, limits: RequestLimits
) -> DetokenizeResponse:
    """The text of the body's token ids (special tokens included, as vLLM does)."""
    request = parse_request(DetokenizeRequest, body)
    bad = [t for t in request.tokens if t < 0 or (limits.vocab_size and t >= limits.vocab_size)]
    if bad:
        raise InvalidRequestError(
            f"Invalid value for 'tokens': token id {bad[0]} is outside the vocabulary "
            f"(size {limits.vocab_size}).",
            param="tokens",
            code="invalid_value",
        )
    return DetokenizeResponse(prompt=tokenizer.decode(request.tokens))


def model_of(body: Any) -> str | None:
    """The optional ``model`` of a tokenize / detokenize body (None: not given)."""
    value = body.get("model") if isinstance(body, Mapping) else None
    return value if isinstance(value, str) else None
