"""From an HTTP body to what the engine needs: prompt token ids, `SamplingOptions` (the
engine's `SamplingSpec` plus what only the ingress reads) and the request's `RoutingChoice`.

Data enters as raw bytes (or an already-parsed dict) and the served model's `RequestLimits`;
it leaves as a `PreparedRequest` or as an `OpenAIError` (400 / 404) raised on the way:

0. `check_raw_limits(data, limits)`: counts a decoded body may not exceed, checked with
   ``len`` before the schema builds anything (messages, stop, stop_token_ids, logit_bias
   entries): each a 400 ``limit_exceeded`` naming the limit. The body's byte size is the
   ingress's (413 ``PayloadTooLargeError``, from Content-Length and while reading).
1. `parse_request(cls, body)`: JSON and schema (malformed JSON and schema errors → 400).
2. `check_model(name, served)`: 404 ``model_not_found`` for a model not served.
3. `prepare_completion` / `prepare_chat`: check content length (characters of the prompt or
   of all messages) before tokenizing (chat: apply the chat template), then the limits that
   depend on the model: ``n`` cap, ``n × max_tokens``, token ids inside the vocabulary,
   prompt plus completion within the context (400 ``context_length_exceeded``), and the
   ``routing`` extension against the served policy (``routing_levels``, ``routing_presets``).

The model's generation_config.json sampling values (`GenerationDefaults`) fill what a
request omits, before OpenAI's defaults (vLLM's behaviour; ``ingress.generation_config``
``"none"`` turns it off). A chat request also gets its output parsers (`ChatOutputSpec`:
the template's reasoning format, the tool-call parser when tools are offered).

Tokenizing is CPU work; the ingress runs step 3 (and steps 0-1 for large bodies) off its
event loop.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tokenrouter_ray.engine.request import GrammarSpec
from tokenrouter_ray.openai.chat import render_chat, template_supports_tools
from tokenrouter_ray.openai.chat_output import ChatOutputParser, ChatOutputSpec
from tokenrouter_ray.openai.detokenizer import IncrementalDetokenizer
from tokenrouter_ray.openai.errors import (
    INVALID_REQUEST,
    ContextLengthExceededError,
    InvalidRequestError,
    ModelNotFoundError,
    OpenAIError,
    from_json_error,
    from_validation_error,
)
from tokenrouter_ray.openai.generation_defaults import GenerationDefaults
from tokenrouter_ray.openai.reasoning import (
    ReasoningFormat,
    prompt_opens_reasoning,
    reasoning_parser_for,
)
from tokenrouter_ray.openai.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    RoutingRequest,
)
from tokenrouter_ray.openai.structured import structured_grammar
from tokenrouter_ray.openai.tool_parser import tool_format_for
from tokenrouter_ray.protocol import SamplingSpec

RequestT = TypeVar("RequestT", bound=BaseModel)


class RequestLimits(BaseModel):
    """What one served model allows; built by the ingress from the model's config."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_model_len: int = Field(ge=2, description="Context length: prompt + completion tokens.")
    max_n: int = Field(16, ge=1, description="Largest `n` (choices per request) accepted.")
    vocab_size: int | None = Field(
        None, ge=1, description="Token ids in a prompt must be below this; None: unchecked."
    )
    max_output_tokens: int | None = Field(
        None, ge=1, description="Server cap on completion tokens; None: only the context."
    )
    max_messages: int = Field(1024, ge=1, description="Most chat messages in one request.")
    max_content_chars: int = Field(
        1 << 20, ge=1, description="Most characters of prompt text (all messages together)."
    )
    max_stop: int = Field(4, ge=0, description="Most stop strings.")
    max_stop_chars: int = Field(256, ge=1, description="Longest stop string, in characters.")
    max_stop_token_ids: int = Field(64, ge=0, description="Most stop_token_ids.")
    max_logit_bias: int = Field(300, ge=0, description="Most logit_bias entries.")
    max_total_tokens: int | None = Field(
        None,
        ge=1,
        description="Cap on n x max_tokens (completion tokens one request may ask for); "
        "None: n cap x context length.",
    )
    structured_outputs: bool = Field(
        True,
        description="Grammars (response_format, structured_outputs, guided_*, a forced "
        "tool_choice) are served; false for simulated models (no real vocabulary).",
    )
    routing_levels: int = Field(
        1,
        ge=0,
        description="Thresholds the routing policy has (config.py PolicySpec."
        "threshold_levels): 0: `routing` is refused; k > 1 (escalation): `routing.threshold` "
        "gives one value or k.",
    )
    routing_presets: dict[str, tuple[float, ...]] = Field(
        default_factory=dict,
        description="`routing.quality` presets (the config's policy.presets), name -> thresholds.",
    )
    models: tuple[str, ...] = Field(
        (), description="The deployment's models, entry first (what `routing.model` may name)."
    )
    alone: str | None = Field(
        None,
        description="The model that serves a request without `routing` alone (the config's "
        "policy.alone; None: such requests are routed).",
    )


class PayloadTooLargeError(OpenAIError):
    """413: the body is larger than the server accepts (read no further)."""

    status_code = 413
    error_type = INVALID_REQUEST
    default_code = "request_too_large"


class LimitExceededError(InvalidRequestError):
    """400 naming the server limit a request exceeds."""

    default_code = "limit_exceeded"

    def __init__(self, field: str, got: int, limit: int, what: str) -> None:
        super().__init__(
            f"Invalid value for '{field}': {got} {what}, more than this server allows ({limit}).",
            param=field,
        )
        self.limit = limit


def check_raw_limits(data: Any, limits: RequestLimits) -> None:
    """Counts of a decoded JSON body, checked before the schema validates (and copies) it:
    a million ``stop_token_ids`` or ``logit_bias`` entries cost one ``len``, not a parse."""
    if not isinstance(data, Mapping):
        return  # parse_request reports the shape
    for field, limit, what in (
        ("messages", limits.max_messages, "messages"),
        ("input", limits.max_messages, "input items"),  # POST /v1/responses
        ("stop", limits.max_stop, "stop sequences"),
        ("stop_token_ids", limits.max_stop_token_ids, "stop token ids"),
        ("logit_bias", limits.max_logit_bias, "logit_bias entries"),
    ):
        value = data.get(field)
        if isinstance(value, (list, dict)) and len(value) > limit:
            raise LimitExceededError(field, len(value), limit, what)
    stop = data.get("stop")
    for text in [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []:
        if isinstance(text, str) and len(text) > limits.max_stop_chars:
            raise LimitExceededError("stop", len(text), limits.max_stop_chars, "characters")


@dataclass(frozen=True)
class SamplingOptions:
    """Everything about how to generate, from either request kind, with OpenAI's defaults
    resolved (temperature 1): ``spec`` is the engine's `SamplingSpec`, built once here and
    passed whole (``to_spec`` gives each choice its own seed); the rest (stop strings,
    ``n``, streaming, the detokenizer's options) is the ingress's."""

    spec: SamplingSpec
    stop: tuple[str, ...] = ()
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    include_stop_str_in_output: bool = False  # the ingress's (detokenizer), not the engine's
    skip_special_tokens: bool = True

    def to_spec(self, choice_index: int = 0) -> SamplingSpec:
        """The engine's `SamplingSpec` for one choice.

        With a seed, choice ``i`` samples with ``seed + i`` (mod 2**63, so non-negative), so
        the ``n`` choices of a seeded request differ but are reproducible.
        """
        seed = self.spec.seed
        if seed is None:
            return self.spec
        return msgspec.structs.replace(self.spec, seed=(seed + choice_index) % (1 << 63))


@dataclass(frozen=True)
class RoutingChoice:
    """How a request is routed, from its ``routing`` field (or its absence): what travels to
    the models with its `RouteState` (``thresholds``, ``alone``, ``max_share``) and what the
    ingress keeps (``default``, ``why``, ``level``)."""

    thresholds: tuple[float, ...] = ()  # its own decision threshold(s); (): the policy's
    alone: str | None = None  # the model serving it alone (bypass); None: routed
    max_share: float | None = None  # cap on the top model's share of the output
    default: bool = True  # asked for no `routing`: a quality target may choose it
    # why it is served routed or alone: request, config (policy.alone), quality (the quality
    # target's rung), speed / learning / explore (the speed bypass, quality/speed.py)
    why: str | None = None
    level: int | None = None  # the speed bypass's load level; None: not its request


@dataclass(frozen=True)
class PreparedRequest:
    """A validated request, ready to submit ``sampling.n`` times. ``output``: how a chat
    answer is split into reasoning, content and tool calls (None: all content);
    ``request_id``: the client's ``X-Request-Id`` (its rids start with it); ``routing``:
    how it is routed."""

    model: str
    prompt_token_ids: list[int]
    sampling: SamplingOptions
    output: ChatOutputSpec | None = None
    request_id: str | None = None
    routing: RoutingChoice = RoutingChoice()

    def detokenizer(self, tokenizer: Any) -> IncrementalDetokenizer:
        """A fresh detokenizer for one choice: its stop strings and stop tokens (held back,
        and left out of the text unless ``include_stop_str_in_output``; not before
        ``min_tokens``), ``skip_special_tokens``."""
        s, spec = self.sampling, self.sampling.spec
        eos = getattr(tokenizer, "eos_token_id", None)
        stop_ids = set(spec.stop_token_ids) | (
            {eos} if eos is not None and not spec.ignore_eos else set()
        )
        return IncrementalDetokenizer(
            tokenizer,
            stop=s.stop,
            prompt_token_ids=self.prompt_token_ids,
            skip_special_tokens=s.skip_special_tokens,
            include_stop_str_in_output=s.include_stop_str_in_output,
            stop_token_ids=stop_ids,
            min_tokens=spec.min_tokens,
        )

    def chat_parser(self) -> ChatOutputParser | None:
        """A fresh parser for one choice, or None when nothing is parsed."""
        return self.output.parser() if self.output is not None and self.output.active else None


def parse_request(cls: type[RequestT], body: bytes | str | Mapping[str, Any]) -> RequestT:
    """Parse a JSON body (bytes / str) or a decoded dict into ``cls``; errors → 400."""
    if isinstance(body, (bytes, bytearray, str)):
        try:
            body = json.loads(body)
        except ValueError as exc:  # JSONDecodeError, and UnicodeDecodeError for bytes
            raise from_json_error(exc) from None
    if not isinstance(body, Mapping):
        raise InvalidRequestError("The request body must be a JSON object.")
    try:
        return cls.model_validate(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def check_model(name: str, served: Collection[str]) -> None:
    """404 ``model_not_found`` unless ``name`` is one of ``served``."""
    if name not in served:
        raise ModelNotFoundError(name)


def prepare_completion(
    request: CompletionRequest,
    tokenizer: Any,
    limits: RequestLimits,
    defaults: GenerationDefaults | None = None,
) -> PreparedRequest:
    """Tokenize ``prompt`` (with the tokenizer's special tokens) and resolve sampling
    (``defaults``: the model's generation_config values for what the request omits)."""
    _check_cheap_limits(request, limits)
    if len(request.prompt) > limits.max_content_chars:
        what = "characters" if isinstance(request.prompt, str) else "token ids"
        raise LimitExceededError("prompt", len(request.prompt), limits.max_content_chars, what)
    if isinstance(request.prompt, str):
        prompt_ids = list(tokenizer.encode(request.prompt, add_special_tokens=True))
    else:
        prompt_ids = list(request.prompt)
        _check_vocab(prompt_ids, "prompt", limits)
    max_tokens = _max_tokens(request.max_tokens, "max_tokens", len(prompt_ids), "prompt", limits)
    _check_total(request.n, max_tokens, "max_tokens", limits)
    sampling = _sampling(request, max_tokens, _grammar(request, limits), defaults, limits)
    return PreparedRequest(
        request.model, prompt_ids, sampling, routing=_routing(request.routing, limits)
    )


def prepare_chat(
    request: ChatCompletionRequest,
    tokenizer: Any,
    limits: RequestLimits,
    defaults: GenerationDefaults | None = None,
) -> PreparedRequest:
    """Render ``messages`` (with ``chat_template_kwargs`` and the offered ``tools``) through
    the chat template, resolve sampling, and pick the output parsers: the template's
    reasoning format (off when it has none) and, when tools are offered, the tool-call
    parser. ``max_tokens`` counts reasoning and content alike (they are one output)."""
    _check_cheap_limits(request, limits)
    if (
        request.offers_tools
        and template_supports_tools(tokenizer)
        and not tool_format_for(tokenizer)
    ):
        raise InvalidRequestError(
            "This model's chat template uses a tool-call format this server cannot parse yet "
            "(only Hermes-style <tool_call> blocks, as Qwen's), so 'tools' cannot be used "
            "with it.",
            param="tools",
            code="unsupported_value",
        )
    tools = (
        [t.model_dump(exclude_none=True) for t in request.tools or ()]
        if request.offers_tools
        else None
    )
    chars = sum(len(m.content or "") for m in request.messages)
    if chars > limits.max_content_chars:
        raise LimitExceededError("messages", chars, limits.max_content_chars, "content characters")
    prompt_ids = render_chat(tokenizer, request.messages, request.chat_template_kwargs, tools)
    budget, field = request.completion_budget
    max_tokens = _max_tokens(budget, field, len(prompt_ids), "messages", limits)
    _check_total(request.n, max_tokens, field, limits)
    fmt = reasoning_parser_for(tokenizer)
    output = ChatOutputSpec(
        reasoning=fmt,
        opens_in_reasoning=fmt is not None and prompt_opens_reasoning(tokenizer, prompt_ids, fmt),
        tools=request.offers_tools,
        max_tool_calls=1 if request.parallel_tool_calls is False else None,
    )
    grammar = _grammar(request, limits, fmt, _thinking(tokenizer, prompt_ids, fmt))
    sampling = _sampling(request, max_tokens, grammar, defaults, limits)
    return PreparedRequest(
        request.model, prompt_ids, sampling, output, routing=_routing(request.routing, limits)
    )


def _thinking(tokenizer: Any, prompt_ids: Sequence[int], fmt: ReasoningFormat | None) -> str:
    """Where the output starts relative to thinking: inside an open block (``open``), free
    to open one (``may``), or with none (``off``: no format, or the template closed it)."""
    if fmt is None:
        return "off"
    tail = tokenizer.decode(list(prompt_ids[-8:]), skip_special_tokens=False)
    if tail.rfind(fmt.start) > tail.rfind(fmt.end):
        return "open"
    return "off" if fmt.end in tail else "may"


def _grammar(
    request: CompletionRequest | ChatCompletionRequest,
    limits: RequestLimits,
    fmt: ReasoningFormat | None = None,
    thinking: str = "off",
) -> GrammarSpec | None:
    """The request's output grammar (openai/structured.py), or None; a 400 where the served
    models cannot run one."""
    found = structured_grammar(request, fmt, thinking)  # type: ignore[arg-type]
    if found is None:
        return None
    grammar, field = found
    if not limits.structured_outputs:
        raise InvalidRequestError(
            f"'{field}' is not available here: structured outputs need the models' real "
            "vocabulary, and the served models are simulated.",
            param=field,
            code="unsupported_value",
        )
    return grammar


def _check_cheap_limits(
    request: CompletionRequest | ChatCompletionRequest, limits: RequestLimits
) -> None:
    """Limits that need no tokenizer, checked before tokenizing."""
    if request.n is not None and request.n > limits.max_n:
        raise InvalidRequestError(
            f"Invalid value for 'n': {request.n} is more than this server allows ({limits.max_n}).",
            param="n",
            code="invalid_value",
        )
    stop_ids = request.stop_token_ids or ()
    if len(stop_ids) > limits.max_stop_token_ids:
        raise LimitExceededError(
            "stop_token_ids", len(stop_ids), limits.max_stop_token_ids, "stop token ids"
        )
    _check_vocab(stop_ids, "stop_token_ids", limits)


def _check_total(n: int | None, max_tokens: int, field: str, limits: RequestLimits) -> None:
    """``n × max_tokens`` (the resolved budget: an unset one is what is left of the context)
    within the server's cap."""
    cap = limits.max_total_tokens
    if cap is None:
        return
    total = (n or 1) * max_tokens
    if total > cap:
        raise LimitExceededError(f"n x {field}", total, cap, "completion tokens in all")


def _check_vocab(token_ids: Sequence[int], field: str, limits: RequestLimits) -> None:
    if limits.vocab_size is not None:
        bad = next((t for t in token_ids if t >= limits.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(
                f"Invalid value for '{field}': token id {bad} is outside the vocabulary "
                f"(size {limits.vocab_size}).",
                param=field,
                code="invalid_value",
            )


def _max_tokens(
    requested: int | None, field: str, prompt_len: int, prompt_field: str, limits: RequestLimits
) -> int:
    """The completion budget: the request's, else what is left of the context (and cap)."""
    ctx = limits.max_model_len
    if prompt_len >= ctx:
        raise ContextLengthExceededError(
            f"This model's maximum context length is {ctx} tokens. However, your {prompt_field} "
            f"resulted in {prompt_len} tokens, which leaves no room for a completion. Please "
            f"reduce the length of the {prompt_field}.",
            param=prompt_field,
        )
    cap = limits.max_output_tokens
    if requested is None:
        left = ctx - prompt_len
        return left if cap is None else min(left, cap)
    if cap is not None and requested > cap:
        raise InvalidRequestError(
            f"Invalid value for '{field}': {requested} is more than this server allows ({cap}).",
            param=field,
            code="invalid_value",
        )
    if prompt_len + requested > ctx:
        raise ContextLengthExceededError(
            f"This model's maximum context length is {ctx} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the {prompt_field}, {requested} "
            f"in the completion). Please reduce the length of the {prompt_field} or completion.",
            param=field,
        )
    return requested


def _sampling(
    request: CompletionRequest | ChatCompletionRequest,
    max_tokens: int,
    grammar: GrammarSpec | None = None,
    defaults: GenerationDefaults | None = None,
    limits: RequestLimits | None = None,
) -> SamplingOptions:
    defaults = defaults or GenerationDefaults()
    if isinstance(request, ChatCompletionRequest):
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
    else:
        logprobs = request.logprobs
    spec = SamplingSpec(
        max_tokens=max_tokens,
        temperature=_default(request.temperature, defaults.temperature, 1.0),
        top_p=_default(request.top_p, defaults.top_p, 1.0),
        top_k=_default(request.top_k, defaults.top_k, 0),
        seed=request.seed,
        stop_token_ids=tuple(request.stop_token_ids or ()),
        ignore_eos=bool(request.ignore_eos),
        logprobs=logprobs,
        trace=bool(request.routing_trace),
        cache_salt=request.cache_salt,
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        repetition_penalty=_default(request.repetition_penalty, defaults.repetition_penalty, 1.0),
        min_p=_default(request.min_p, defaults.min_p, 0.0),
        logit_bias=_logit_bias(request.logit_bias, limits),
        min_tokens=_min_tokens(request.min_tokens, max_tokens),
        grammar=grammar,
    )
    return SamplingOptions(
        spec,
        stop=tuple(request.stop),
        n=1 if request.n is None else request.n,
        stream=bool(request.stream),
        include_usage=request.include_usage,
        include_stop_str_in_output=bool(request.include_stop_str_in_output),
        skip_special_tokens=request.skip_special_tokens is not False,
    )


def _routing(routing: RoutingRequest | None, limits: RequestLimits | None) -> RoutingChoice:
    """The request's ``routing`` field (or its absence) as its `RoutingChoice`."""
    return RoutingChoice(
        thresholds=_route_thresholds(routing, limits),
        alone=_route_alone(routing, limits),
        max_share=None if routing is None else routing.max_large_share,
        default=routing is None,
        why=_route_why(routing, limits),
    )


def _route_why(routing: RoutingRequest | None, limits: RequestLimits | None) -> str | None:
    if routing is not None:
        return "request"
    return "config" if limits is not None and limits.alone is not None else None


def _route_alone(routing: RoutingRequest | None, limits: RequestLimits | None) -> str | None:
    """The model a request is served by alone: the one ``routing.model`` names (a 400
    naming the field when the deployment has no such model), else the server's default
    for requests without ``routing``."""
    if routing is None:
        return None if limits is None else limits.alone
    if routing.model is None:  # routed: a threshold, a preset or a cap
        return None
    models = () if limits is None else limits.models
    if routing.model not in models:
        raise InvalidRequestError(
            f"Invalid value for 'routing.model': {routing.model!r} is not a model of this "
            f"deployment (models: {', '.join(models) or 'none'}).",
            param="routing.model",
            code="invalid_value",
        )
    return routing.model


def _route_thresholds(
    routing: RoutingRequest | None, limits: RequestLimits | None
) -> tuple[float, ...]:
    """The request's ``routing`` (shape and range checked by the schema) as the
    ``RouteState.thresholds`` the served policy takes: a 400 naming the field when
    the policy has no threshold, the preset is not configured, or a list has the wrong
    length."""
    if routing is None or (routing.threshold is None and routing.quality is None):
        return ()
    levels = 1 if limits is None else limits.routing_levels
    presets = {} if limits is None else limits.routing_presets
    if levels == 0:
        raise InvalidRequestError(
            "Invalid value for 'routing': this server's routing policy has no decision "
            "threshold to set.",
            param="routing",
            code="unsupported_value",
        )
    if routing.quality is not None:
        thresholds = presets.get(routing.quality)
        if thresholds is None:
            known = ", ".join(sorted(presets)) or "none"
            raise InvalidRequestError(
                f"Invalid value for 'routing.quality': preset {routing.quality!r} is not "
                f"configured on this server (configured: {known}).",
                param="routing.quality",
                code="invalid_value",
            )
        return thresholds
    value = routing.threshold
    thresholds = tuple(value) if isinstance(value, list) else (value,)
    if len(thresholds) not in (1, levels):
        takes = f"one value or {levels} (one per level)" if levels > 1 else "one value"
        raise InvalidRequestError(
            f"Invalid value for 'routing.threshold': {len(thresholds)} values; this server's "
            f"routing policy takes {takes}.",
            param="routing.threshold",
            code="invalid_value",
        )
    return thresholds


def _logit_bias(
    bias: Mapping[str, float] | None, limits: RequestLimits | None
) -> tuple[tuple[int, float], ...]:
    """``{"id": bias}`` (keys checked by the schema) as (id, bias) pairs, ids ascending;
    an id outside the vocabulary is a 400 naming ``logit_bias``."""
    pairs = sorted((int(k), float(v)) for k, v in (bias or {}).items())
    vocab = limits.vocab_size if limits is not None else None
    if vocab is not None and pairs and pairs[-1][0] >= vocab:
        raise InvalidRequestError(
            f"Invalid value for 'logit_bias': token id {pairs[-1][0]} is outside the "
            f"vocabulary (size {vocab}).",
            param="logit_bias",
            code="invalid_value",
        )
    return tuple(pairs)  # distinct ids: the schema takes canonical decimal keys only


def _min_tokens(min_tokens: int | None, max_tokens: int) -> int:
    if min_tokens and min_tokens > max_tokens:
        raise InvalidRequestError(
            f"Invalid value for 'min_tokens': {min_tokens} is more than the completion budget "
            f"({max_tokens} tokens).",
            param="min_tokens",
            code="invalid_value",
        )
    return min_tokens or 0


_T = TypeVar("_T")


def _default(value: _T | None, model_default: _T | None, default: _T) -> _T:
    """The request's value, else the model's generation_config value, else OpenAI's."""
    if value is not None:
        return value
    return default if model_default is None else model_default
