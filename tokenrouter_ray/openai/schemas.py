"""Request bodies of ``POST /v1/completions`` and ``POST /v1/chat/completions``.

A JSON body enters as a dict (or bytes, through `validation.parse_request`) and leaves as a
`CompletionRequest` / `ChatCompletionRequest` whose fields are already normalised: ``prompt``
is one string or one list of token ids, ``stop`` a list of non-empty strings, message
``content`` one string. Everything here is the *shape* of a request; limits that depend on
the served model (context length, vocabulary, ``n`` cap) are checked by `validation`.

Policy on fields:

- Unknown fields are ignored (``extra="ignore"``), as OpenAI's API does for forward
  compatibility; clients that send e.g. ``parallel_tool_calls`` keep working.
- Known fields are strict on type: ``"16"`` is not an integer, ``1`` is not a boolean.
- OpenAI fields this server does not implement (``echo``, ``logprobs``, ``tools``, penalties,
  ...) are declared, accepted at their neutral value (null / false / 0 / empty), and
  rejected with a 400 naming the field (code ``unsupported_value``) otherwise, so a client
  never silently gets something other than what it asked for.
- Optional OpenAI parameters accept ``null``, meaning "the default".
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

MAX_STOP_SEQUENCES = 4
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


def _unsupported(message: str) -> PydanticCustomError:
    """A well-formed value this server does not implement (400, code ``unsupported_value``)."""
    return PydanticCustomError("unsupported_value", message)


def _check_text(value: str, what: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise PydanticCustomError(
            "invalid_value", "{what} is not valid UTF-8 text (lone surrogate)", {"what": what}
        ) from None
    return value


def _prompt(value: Any) -> Any:
    """One string or one list of token ids; a batch of exactly one is unwrapped."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        if not value:
            raise PydanticCustomError("invalid_value", "prompt must not be empty")
        return _check_text(value, "prompt")
    if isinstance(value, list):
        if not value:
            raise PydanticCustomError("invalid_value", "prompt must not be empty")
        if all(type(t) is int for t in value):
            if any(t < 0 for t in value):
                raise PydanticCustomError("invalid_value", "token ids must be >= 0")
            return value
        if all(isinstance(p, (str, list)) for p in value):
            raise _unsupported(
                "Batched prompts are not supported by this server; send one prompt per request"
            )
    raise PydanticCustomError(
        "invalid_type", "prompt must be a string or a list of token ids (integers)"
    )


def _stop(value: Any) -> Any:
    """``null`` → ``[]``; a string → ``[string]``; at most 4 non-empty strings."""
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise PydanticCustomError("invalid_type", "stop must be a string or a list of strings")
    if len(value) > MAX_STOP_SEQUENCES:
        raise PydanticCustomError(
            "invalid_value", "at most {max} stop sequences are allowed", {"max": MAX_STOP_SEQUENCES}
        )
    if any(not s for s in value):
        raise PydanticCustomError("invalid_value", "stop sequences must not be empty strings")
    return [_check_text(s, "stop") for s in value]


def flatten_content(value: Any) -> Any:
    """Message content as one string: text parts joined with ``"\\n"``; ``null`` stays null."""
    if value is None or isinstance(value, str):
        return value if value is None else _check_text(value, "content")
    if not isinstance(value, list):
        raise PydanticCustomError(
            "invalid_type", "content must be a string or a list of content parts"
        )
    texts: list[str] = []
    for part in value:
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise PydanticCustomError(
                "invalid_type", 'each content part must be an object like {"type": "text", ...}'
            )
        if part["type"] != "text":
            raise _unsupported(
                f"Content part type {part['type']!r} is not supported by this server; "
                "only 'text' parts are"
            )
        if not isinstance(part.get("text"), str):
            raise PydanticCustomError("invalid_type", "a text content part needs a string 'text'")
        texts.append(_check_text(part["text"], "content"))
    return "\n".join(texts)


Prompt = Annotated[str | list[int], BeforeValidator(_prompt)]
StopList = Annotated[list[str], BeforeValidator(_stop)]
Content = Annotated[str | None, BeforeValidator(flatten_content)]

_STRICT_LENIENT = ConfigDict(extra="ignore", strict=True)


class StreamOptions(BaseModel):
    """``stream_options``: only ``include_usage`` has an effect."""

    model_config = _STRICT_LENIENT

    include_usage: bool | None = Field(
        None, description="Send a last chunk with empty `choices` and the request's usage."
    )


class _SamplingRequest(BaseModel):
    """Fields shared by both endpoints: model, sampling, streaming, stop, extensions."""

    model_config = _STRICT_LENIENT
    # field -> value(s) it may take although the feature is not implemented (besides null)
    NEUTRAL: ClassVar[dict[str, tuple[Any, ...]]] = {
        "presence_penalty": (0, 0.0),
        "frequency_penalty": (0, 0.0),
        "logit_bias": ({},),
    }

    model: str = Field(min_length=1, description="Served model name (see GET /v1/models).")
    temperature: float | None = Field(None, ge=0, le=2, description="0 is greedy; default 1.")
    top_p: float | None = Field(None, gt=0, le=1, description="Nucleus mass; default 1.")
    n: int | None = Field(None, ge=1, description="Choices to generate; default 1.")
    stream: bool | None = Field(None, description="Answer with server-sent events.")
    stream_options: StreamOptions | None = Field(None, description="Only with `stream`.")
    stop: StopList = Field(
        default_factory=list, description="Up to 4 strings; output ends before the first."
    )
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX, description="Sampling seed.")
    user: str | None = Field(None, description="End-user id; accepted and ignored.")
    presence_penalty: float | None = Field(None, ge=-2, le=2, description="Only 0 supported.")
    frequency_penalty: float | None = Field(None, ge=-2, le=2, description="Only 0 supported.")
    logit_bias: dict[str, float] | None = Field(None, description="Only empty supported.")
    # extensions (vLLM-compatible names)
    top_k: int | None = Field(None, ge=0, description="Extension: top-k filter; 0 or null = off.")
    min_p: float | None = Field(None, ge=0, le=1, description="Extension: min-p filter.")
    repetition_penalty: float | None = Field(None, gt=0, le=10, description="Extension: 1 = off.")
    ignore_eos: bool | None = Field(None, description="Extension: keep generating past EOS.")
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(
        None, description="Extension: token ids that end the output (besides EOS)."
    )

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None and not info.data.get("stream"):
            raise PydanticCustomError(
                "invalid_value",
                "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            )
        return value

    @field_validator("presence_penalty", "frequency_penalty", "logit_bias")
    @classmethod
    def _neutral_only(cls, value: Any, info: ValidationInfo) -> Any:
        return cls.check_neutral(value, info)

    @classmethod
    def check_neutral(cls, value: Any, info: ValidationInfo) -> Any:
        name = info.field_name or "?"
        if value is not None and value is not False and value not in cls.NEUTRAL.get(name, ()):
            raise _unsupported(
                f"'{name}' = {json.dumps(value)} is not supported by this server; "
                "leave it unset or null"
            )
        return value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``. ``max_tokens`` defaults to 16 (OpenAI's default); an
    explicit ``null`` means "up to the context length"."""

    NEUTRAL: ClassVar[dict[str, tuple[Any, ...]]] = {
        **_SamplingRequest.NEUTRAL,
        "echo": (),
        "logprobs": (),
        "best_of": (1,),
        "suffix": ("",),
    }

    prompt: Prompt = Field(description="One string or one list of token ids.")
    max_tokens: int | None = Field(16, ge=1, description="Completion tokens at most.")
    echo: bool | None = Field(None, description="Only false supported.")
    logprobs: int | None = Field(None, ge=0, le=5, description="Only null supported.")
    best_of: int | None = Field(None, ge=1, description="Only 1 supported.")
    suffix: str | None = Field(None, description="Only null supported.")

    @field_validator("echo", "logprobs", "best_of", "suffix")
    @classmethod
    def _completion_neutral_only(cls, value: Any, info: ValidationInfo) -> Any:
        return cls.check_neutral(value, info)


Role = Literal["system", "user", "assistant", "tool", "developer"]


class ChatMessage(BaseModel):
    """One message. Content parts are flattened to text; only ``assistant`` may have null
    content (it is rendered as empty)."""

    model_config = _STRICT_LENIENT

    role: Role = Field(description="`developer` is rendered as `system`.")
    content: Content = Field(
        None, validate_default=True, description="A string or a list of text parts."
    )
    name: str | None = Field(None, description="Accepted; not passed to the template.")

    @field_validator("content")
    @classmethod
    def _content_required(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None and info.data.get("role") not in (None, "assistant"):
            raise PydanticCustomError(
                "invalid_value",
                "content is required for role '{role}'",
                {"role": info.data["role"]},
            )
        return value


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``. The completion budget is ``max_completion_tokens``
    or ``max_tokens``; given both, the smaller wins (both limits hold). Neither: up to the
    context length."""

    NEUTRAL: ClassVar[dict[str, tuple[Any, ...]]] = {
        **_SamplingRequest.NEUTRAL,
        "logprobs": (),
        "top_logprobs": (0,),
        "tools": ([],),
        "functions": ([],),
        "tool_choice": ("none", "auto"),
        "response_format": ({"type": "text"},),
    }

    messages: list[ChatMessage] = Field(min_length=1, description="The conversation so far.")
    max_tokens: int | None = Field(None, ge=1, description="Deprecated alias of the next.")
    max_completion_tokens: int | None = Field(None, ge=1, description="Completion tokens at most.")
    logprobs: bool | None = Field(None, description="Only false supported.")
    top_logprobs: int | None = Field(None, ge=0, le=20, description="Only null/0 supported.")
    tools: list[dict[str, Any]] | None = Field(None, description="Only empty supported.")
    functions: list[dict[str, Any]] | None = Field(None, description="Only empty supported.")
    tool_choice: str | dict[str, Any] | None = Field(None, description="Only none/auto.")
    response_format: dict[str, Any] | None = Field(None, description='Only {"type": "text"}.')

    @field_validator(
        "logprobs", "top_logprobs", "tools", "functions", "tool_choice", "response_format"
    )
    @classmethod
    def _chat_neutral_only(cls, value: Any, info: ValidationInfo) -> Any:
        return cls.check_neutral(value, info)

    @property
    def completion_budget(self) -> tuple[int | None, str]:
        """``(max tokens or None, name of the field that set it)``."""
        given = [
            (v, name)
            for v, name in (
                (self.max_completion_tokens, "max_completion_tokens"),
                (self.max_tokens, "max_tokens"),
            )
            if v is not None
        ]
        return min(given) if given else (None, "max_completion_tokens")
