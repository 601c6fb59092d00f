"""Request bodies of ``POST /v1/completions`` and ``POST /v1/chat/completions``.

A JSON body enters as a dict (or bytes, through `validation.parse_request`) and leaves as a
`CompletionRequest` / `ChatCompletionRequest` whose fields are already normalised: ``prompt``
is one string or one list of token ids, ``stop`` a list of non-empty strings, message
``content`` one string. Everything here is the *shape* of a request; limits that depend on
the served model (context length, vocabulary, ``n`` cap) are checked by `validation`.

Policy on fields:

- Unknown fields are ignored (``extra="ignore"``), as OpenAI's API does for forward
  compatibility, but never silently: like vLLM, the server logs a warning naming the field,
  here only for the first request that sends it (once per field name and request part, so a
  busy server's log is not flooded). Fields known to be harmless (``user``, ``store``,
  ``metadata``, ...) are declared and accepted without a warning.
- Known fields are strict on type: ``"16"`` is not an integer, ``1`` is not a boolean.
- OpenAI fields this server does not implement (``echo``, ``functions``, ...) are
  declared, accepted at their neutral value (null / false / 0 / empty), and
  rejected with a 400 naming the field (code ``unsupported_value``) otherwise, so a client
  never silently gets something other than what it asked for.
  That includes vLLM extensions that change the output (``use_beam_search``,
  ``allowed_token_ids``, ``chat_template``, ...).
- Sampling parity with vLLM: ``presence_penalty`` / ``frequency_penalty`` (-2..2),
  ``logit_bias`` (token ids as decimal strings -> -100..100; ids inside the vocabulary are
  checked by `validation`), and vLLM's ``repetition_penalty`` (0 < p <= 10), ``min_p``
  (0..1), ``min_tokens`` (>= 0, at most the completion budget: `validation`),
  ``include_stop_str_in_output`` and ``skip_special_tokens`` are served.
- ``chat_template_kwargs`` (vLLM's extension) reaches the model's chat template, e.g.
  ``{"enable_thinking": false}`` for Qwen3; keys the renderer itself owns are a 400.
- ``tools`` (function tools), ``tool_choice`` and, in the history, assistant ``tool_calls``
  and ``tool`` messages reach the chat template; ``"required"`` and a named function are
  enforced by a grammar (openai/structured.py), as are ``response_format`` (json_object,
  json_schema), ``structured_outputs`` and the ``guided_*`` fields.
- Optional OpenAI parameters accept ``null``, meaning "the default".
- ``logprobs`` (chat: a boolean, with ``top_logprobs`` 0..20; completions: 0..5) are
  served, from the model that wrote each token; ``routing_trace`` (a boolean, this
  server's extension) asks for the per-token routing trace.
- ``routing`` (this server's extension, an object with exactly one of ``threshold`` and
  ``quality``) sets the routing policy's decision threshold for this request only; its
  shape and range ([0, 1], finite) are checked here, its fit to the served policy (how many
  values, which presets exist) by `validation`.
"""

from __future__ import annotations

import json
import logging
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

logger = logging.getLogger(__name__)

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
_warned_unknown: set[str] = set()  # "<part>.<field>" already logged


class _Lenient(BaseModel):
    """Strict on known fields; unknown ones are dropped, each name logged once (warning)."""

    model_config = _STRICT_LENIENT
    PART: ClassVar[str] = "request"  # where the field sits, for the log line
    KNOWN_EXTRA: ClassVar[frozenset[str]] = frozenset()  # undeclared names handled elsewhere

    @model_validator(mode="before")
    @classmethod
    def _log_unknown_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            known = cls.model_fields.keys() | {f.alias for f in cls.model_fields.values()}
            known |= cls.KNOWN_EXTRA
            for name in data.keys() - known:
                key = f"{cls.PART}.{name}"
                if key not in _warned_unknown:
                    _warned_unknown.add(key)
                    logger.warning(
                        "Ignoring the unknown field %r in a %s (not implemented by this "
                        "server; logged once per field name)",
                        str(name),
                        cls.PART,
                    )
        return data


class StreamOptions(_Lenient):
    """``stream_options``: only ``include_usage`` has an effect."""

    PART: ClassVar[str] = "stream_options"

    include_usage: bool | None = Field(
        None, description="Send a last chunk with empty `choices` and the request's usage."
    )


MAX_ROUTING_THRESHOLDS = 16  # values in one ``routing.threshold`` list (escalation levels)


def _threshold_value(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PydanticCustomError(
            "invalid_type", "routing.threshold must be a number or a list of numbers"
        )
    if not 0 <= value <= 1:  # NaN fails too; infinities are out of range
        raise PydanticCustomError(
            "invalid_value",
            "routing.threshold values must be in [0, 1], got {value}",
            {"value": json.dumps(value)},
        )
    return float(value)


class RoutingRequest(BaseModel):
    """``routing`` (extension): this request's own routing threshold, given directly or as a
    preset the config names (``policy.presets``), or one model that serves it alone
    (``model``: no routing, no handoffs); at most one of the three, with or without a cap on
    the large model's share (``max_large_share``). Unknown keys are a 400 (a misspelt knob
    must not silently route by the default)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    threshold: Any = Field(
        None,
        description="The policy's decision threshold for this request, in [0, 1] (r2r, "
        "entropy, citer, co_llm: threshold; rstitch, glimprouter: tau; bernoulli: p); "
        "escalation: one value for every level or a list, one per level.",
    )
    quality: str | None = Field(
        None,
        min_length=1,
        max_length=64,
        description="A preset of the config's policy.presets (e.g. high, balanced, fast).",
    )
    model: str | None = Field(
        None,
        min_length=1,
        max_length=128,
        description="Serve this request by one of the deployment's models alone (e.g. "
        "large): no routing policy, no handoffs, the model's own output.",
    )
    max_large_share: Any = Field(
        None,
        description="At most this share of the output, in [0, 1], from the largest model "
        "(the top of the chain): the policy's moves to it are refused once they would pass "
        "the cap.",
    )

    @field_validator("max_large_share", mode="after")
    @classmethod
    def _share(cls, value: Any) -> float | None:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
            raise PydanticCustomError(
                "invalid_value",
                "routing.max_large_share must be a number in [0, 1], got {value}",
                {"value": json.dumps(value)},
            )
        return float(value)

    @field_validator("threshold", mode="after")
    @classmethod
    def _threshold(cls, value: Any) -> float | list[float] | None:
        if value is None or not isinstance(value, list):
            return value if value is None else _threshold_value(value)
        if not 1 <= len(value) <= MAX_ROUTING_THRESHOLDS:
            raise PydanticCustomError(
                "invalid_value",
                "routing.threshold as a list needs 1..{most} values, got {got}",
                {"most": MAX_ROUTING_THRESHOLDS, "got": len(value)},
            )
        return [_threshold_value(v) for v in value]

    @model_validator(mode="after")
    def _exactly_one(self) -> RoutingRequest:
        given = [v for v in (self.threshold, self.quality, self.model) if v is not None]
        if len(given) > 1 or not (given or self.max_large_share is not None):
            raise PydanticCustomError(
                "invalid_value",
                "routing takes one of 'threshold', 'quality' and 'model', and/or 'max_large_share'",
            )
        if self.model is not None and self.max_large_share is not None:
            raise PydanticCustomError(
                "invalid_value",
                "routing.max_large_share caps a routed request; one served by 'model' alone "
                "has no share to cap",
            )
        return self


class JsonSchemaFormat(_Lenient):
    """``response_format.json_schema`` (OpenAI's shape)."""

    PART: ClassVar[str] = "json_schema"

    name: str = Field("response", min_length=1, max_length=64, description="Schema name.")
    description: str | None = Field(None, description="Accepted; not shown to the model.")
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="A JSON schema.")
    strict: bool | None = Field(None, description="Output always follows the schema here.")


class ResponseFormat(_Lenient):
    """``response_format``: text, json_object or json_schema."""

    PART: ClassVar[str] = "response_format"

    type: Literal["text", "json_object", "json_schema"] = Field(description="The format.")
    json_schema: JsonSchemaFormat | None = Field(None, description="With type json_schema.")


class StructuredOutputs(_Lenient):
    """vLLM's ``structured_outputs``: exactly one constraint."""

    PART: ClassVar[str] = "structured_outputs"

    json_: dict[str, Any] | str | None = Field(None, alias="json", description="A JSON schema.")
    regex: str | None = Field(None, description="A regular expression the output matches.")
    choice: list[str] | None = Field(None, description="The output is one of these strings.")
    grammar: str | None = Field(None, description="An EBNF grammar (rule 'root').")
    json_object: bool | None = Field(None, description="true: any JSON object.")
    structural_tag: str | None = Field(None, description="An xgrammar structural tag (JSON).")


class _SamplingRequest(_Lenient):
    """Fields shared by both endpoints: model, sampling, streaming, stop, extensions."""

    # field -> value(s) it may take although the feature is not implemented (besides null
    # and false)
    NEUTRAL: ClassVar[dict[str, tuple[Any, ...]]] = {
        # vLLM extensions that would change the output
        "use_beam_search": (),
        "length_penalty": (1, 1.0),
        "allowed_token_ids": ([],),
        "bad_words": ([],),
        "prompt_logprobs": (),
        "truncate_prompt_tokens": (),
        "logits_processors": ([],),
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
    store: bool | None = Field(None, description="Accepted and ignored (nothing is stored).")
    metadata: dict[str, str] | None = Field(None, description="Accepted and ignored.")
    service_tier: str | None = Field(None, description="Accepted and ignored.")
    safety_identifier: str | None = Field(None, description="Accepted and ignored.")
    prompt_cache_key: str | None = Field(None, description="Accepted and ignored.")
    presence_penalty: float | None = Field(
        None, ge=-2, le=2, description="Minus this for each token already in the output."
    )
    frequency_penalty: float | None = Field(
        None, ge=-2, le=2, description="Minus this times each token's count in the output."
    )
    logit_bias: dict[str, float] | None = Field(
        None, description="Token id (a decimal string) -> bias in [-100, 100], added to logits."
    )
    # extensions (vLLM-compatible names)
    top_k: int | None = Field(  # bounded: the NEW message carries it as a 64-bit integer
        None, ge=0, le=INT64_MAX, description="Extension: top-k filter; 0 or null = off."
    )
    min_p: float | None = Field(
        None, ge=0, le=1, description="Extension: drop tokens below min_p x the top probability."
    )
    repetition_penalty: float | None = Field(
        None,
        gt=0,
        le=10,
        description="Extension: tokens of the prompt or output, logit / p if > 0 else x p.",
    )
    min_tokens: int | None = Field(
        None, ge=0, description="Extension: EOS, stop tokens and stop strings only after this many."
    )
    include_stop_str_in_output: bool | None = Field(
        None, description="Extension: keep the stop string (or stop token's text) in the output."
    )
    skip_special_tokens: bool | None = Field(
        None, description="Extension: leave special tokens out of the text (default true)."
    )
    ignore_eos: bool | None = Field(None, description="Extension: keep generating past EOS.")
    timeout: object = Field(  # checked by the ingress (ingress/http_app.py, timeout_of)
        None, description="Extension: seconds until the request ends with an error."
    )
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(
        None, description="Extension: token ids that end the output (besides EOS)."
    )
    routing_trace: bool | None = Field(
        None, description="Extension: per choice, which model wrote each token and why."
    )
    routing: RoutingRequest | None = Field(
        None,
        description="Extension: this request's routing threshold (`threshold`) or preset "
        "(`quality`), instead of the policy's configured one.",
    )
    cache_salt: str | None = Field(
        None,
        min_length=1,
        max_length=256,
        description="Extension (vLLM's): prefix-cache salt; only requests with the same salt "
        "share cached KV (keeps tenants apart).",
    )
    # vLLM extensions this server does not implement: only their neutral values pass
    use_beam_search: bool | None = Field(None, description="Extension: only false supported.")
    length_penalty: float | None = Field(None, description="Extension: only 1 supported.")
    allowed_token_ids: list[int] | None = Field(None, description="Only empty supported.")
    bad_words: list[str] | None = Field(None, description="Only empty supported.")
    prompt_logprobs: int | None = Field(None, description="Only null supported.")
    truncate_prompt_tokens: int | None = Field(None, description="Only null supported.")
    logits_processors: list[Any] | None = Field(None, description="Only empty supported.")
    # structured outputs (openai/structured.py): at most one constraint per request
    response_format: ResponseFormat | None = Field(
        None, description="text, json_object or json_schema (enforced by a grammar)."
    )
    structured_outputs: StructuredOutputs | None = Field(
        None, description="Extension (vLLM's): json, regex, choice, grammar, json_object."
    )
    guided_json: dict[str, Any] | str | None = Field(None, description="Extension: a schema.")
    guided_regex: str | None = Field(None, description="Extension: a regular expression.")
    guided_choice: list[str] | None = Field(None, description="Extension: one of these.")
    guided_grammar: str | None = Field(None, description="Extension: an EBNF grammar.")

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None and not info.data.get("stream"):
            raise PydanticCustomError(
                "invalid_value",
                "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            )
        return value

    @field_validator(
        "use_beam_search", "length_penalty", "allowed_token_ids", "bad_words", "prompt_logprobs",
        "truncate_prompt_tokens", "logits_processors",
    )  # fmt: skip
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

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not (key.isascii() and key.isdigit() and len(key) <= 18 and str(int(key)) == key):
                raise PydanticCustomError(
                    "invalid_value",
                    "logit_bias keys must be token ids as decimal strings (no sign, no leading "
                    "zero), got {key}",
                    {"key": json.dumps(key)},
                )
            if not -100 <= bias <= 100:
                raise PydanticCustomError(
                    "invalid_value",
                    "logit_bias values must be in [-100, 100], got {bias} for token {key}",
                    {"bias": bias, "key": key},
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
        "best_of": (1,),
        "suffix": ("",),
    }

    prompt: Prompt = Field(description="One string or one list of token ids.")
    max_tokens: int | None = Field(16, ge=1, description="Completion tokens at most.")
    echo: bool | None = Field(None, description="Only false supported.")
    logprobs: int | None = Field(
        None, ge=0, le=5, description="Log-probabilities of each token and the k most likely."
    )
    best_of: int | None = Field(None, ge=1, description="Only 1 supported.")
    suffix: str | None = Field(None, description="Only null supported.")

    @field_validator("echo", "best_of", "suffix")
    @classmethod
    def _completion_neutral_only(cls, value: Any, info: ValidationInfo) -> Any:
        return cls.check_neutral(value, info)


Role = Literal["system", "user", "assistant", "tool", "developer"]


class FunctionCall(_Lenient):
    """The function of an assistant message's tool call."""

    PART: ClassVar[str] = "tool call"

    name: str = Field(min_length=1, description="The function called.")
    arguments: str = Field(description="Its arguments: a JSON object, as text.")

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, value: str) -> str:
        try:
            parsed = json.loads(value)
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            raise PydanticCustomError(
                "invalid_value", "'arguments' must be a JSON object encoded as a string"
            )
        return value


class MessageToolCall(_Lenient):
    """One call in an assistant message's ``tool_calls`` (OpenAI's shape)."""

    PART: ClassVar[str] = "tool call"

    id: str = Field(min_length=1, description="The call's id; the `tool` answer names it.")
    type: Literal["function"] = Field("function", description="Only function calls exist.")
    function: FunctionCall


class FunctionDef(_Lenient):
    """A tool's function: name, description and JSON-schema parameters."""

    PART: ClassVar[str] = "tool"

    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.-]+$")
    description: str | None = Field(None, description="Shown to the model by the template.")
    parameters: dict[str, Any] | None = Field(None, description="A JSON schema object.")
    strict: bool | None = Field(
        None,
        description="Accepted; with tool_choice required or named the arguments always match "
        "the parameters (a grammar); with auto calls are parsed, not forced.",
    )


class ToolDef(_Lenient):
    """One entry of ``tools``."""

    PART: ClassVar[str] = "tool"

    type: Literal["function"] = Field(description="Only function tools exist.")
    function: FunctionDef


class ChatMessage(_Lenient):
    """One message. Content parts are flattened to text; only ``assistant`` may have null
    content (it is rendered as empty)."""

    PART: ClassVar[str] = "message"

    role: Role = Field(description="`developer` is rendered as `system`.")
    content: Content = Field(
        None, validate_default=True, description="A string or a list of text parts."
    )
    name: str | None = Field(None, description="Accepted; not passed to the template.")
    tool_call_id: str | None = Field(
        None, description="A `tool` message: the call it answers (passed to the template)."
    )
    tool_calls: list[MessageToolCall] | None = Field(
        None, description="An `assistant` message: the calls it made (rendered by the template)."
    )
    reasoning_content: str | None = Field(
        None, description="An `assistant` message's thinking (vLLM's field; Qwen3's template)."
    )

    @field_validator("tool_calls")
    @classmethod
    def _tool_calls_on_assistant(
        cls, value: list[MessageToolCall] | None, info: ValidationInfo
    ) -> list[MessageToolCall] | None:
        if value and info.data.get("role") != "assistant":
            raise PydanticCustomError(
                "invalid_value", "only assistant messages may have 'tool_calls'"
            )
        return value

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
        "functions": ([],),
        "echo": (),
        "continue_final_message": (),
        "chat_template": (),
        "documents": ([],),
        "reasoning_effort": (),
        "prediction": (),
        "modalities": (["text"],),
        "audio": (),
        "web_search_options": (),
    }
    # apply_chat_template arguments the renderer sets itself
    RESERVED_TEMPLATE_KWARGS: ClassVar[frozenset[str]] = frozenset(
        {
            "conversation", "messages", "tools", "documents", "chat_template",
            "add_generation_prompt", "continue_final_message", "tokenize", "padding",
            "truncation", "max_length", "return_tensors", "return_dict",
            "return_assistant_tokens_mask", "tokenizer_kwargs",
        }
    )  # fmt: skip

    messages: list[ChatMessage] = Field(min_length=1, description="The conversation so far.")
    max_tokens: int | None = Field(None, ge=1, description="Deprecated alias of the next.")
    max_completion_tokens: int | None = Field(None, ge=1, description="Completion tokens at most.")
    logprobs: bool | None = Field(None, description="Log-probability of each output token.")
    top_logprobs: int | None = Field(
        None, ge=0, le=20, description="With logprobs: the k most likely tokens at each."
    )
    tools: list[ToolDef] | None = Field(
        None, description="Functions the model may call (rendered by the chat template)."
    )
    functions: list[dict[str, Any]] | None = Field(None, description="Only empty supported.")
    tool_choice: str | dict[str, Any] | None = Field(
        None,
        description='"auto" (default with tools), "none", "required" or a named function '
        "(the last two enforced by a grammar).",
    )
    parallel_tool_calls: bool | None = Field(
        None, description="false: only the first call the model writes is returned."
    )
    echo: bool | None = Field(None, description="Extension: only false supported.")
    add_generation_prompt: bool | None = Field(None, description="Extension: only true.")
    continue_final_message: bool | None = Field(None, description="Extension: only false.")
    chat_template: str | None = Field(None, description="Extension: only null (the model's).")
    documents: list[dict[str, Any]] | None = Field(None, description="Only empty supported.")
    reasoning_effort: str | None = Field(
        None, description="Only null; for Qwen3 use chat_template_kwargs.enable_thinking."
    )
    prediction: dict[str, Any] | None = Field(None, description="Only null supported.")
    modalities: list[str] | None = Field(None, description='Only ["text"] supported.')
    audio: dict[str, Any] | None = Field(None, description="Only null supported.")
    web_search_options: dict[str, Any] | None = Field(None, description="Only null supported.")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None,
        description="Extension: extra variables for the model's chat template, e.g. "
        '{"enable_thinking": false} for Qwen3.',
    )

    @field_validator(
        "functions", "echo", "continue_final_message",
        "chat_template", "documents", "reasoning_effort",
        "prediction", "modalities", "audio", "web_search_options",
    )  # fmt: skip
    @classmethod
    def _chat_neutral_only(cls, value: Any, info: ValidationInfo) -> Any:
        return cls.check_neutral(value, info)

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, value: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        if value is None or value in ("none", "auto", "required"):
            return value
        name = value.get("function", {}).get("name") if isinstance(value, dict) else None
        if isinstance(value, dict) and value.get("type") == "function" and isinstance(name, str):
            return value
        raise PydanticCustomError(
            "invalid_value",
            '\'tool_choice\' must be "none", "auto", "required" or a named function',
        )

    @property
    def offers_tools(self) -> bool:
        """Tools are rendered and calls parsed: tools given and ``tool_choice`` not none."""
        return bool(self.tools) and self.tool_choice != "none"

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise PydanticCustomError(
                "invalid_value", "'top_logprobs' needs 'logprobs' to be true."
            )
        return value

    @field_validator("add_generation_prompt")
    @classmethod
    def _generation_prompt(cls, value: bool | None) -> bool | None:
        if value is False:
            raise _unsupported(
                "'add_generation_prompt' = false is not supported by this server; leave it "
                "unset, null or true"
            )
        return value

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        reserved = sorted(set(value or ()) & cls.RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise PydanticCustomError(
                "invalid_value",
                "chat_template_kwargs may not set {keys}: the server sets those itself",
                {"keys": ", ".join(repr(k) for k in reserved)},
            )
        return value

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
