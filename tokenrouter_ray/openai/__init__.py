"""The OpenAI-compatible API layer, without a server: schemas, validation, detokenization, SSE.

A request body enters through `parse_request` and leaves `prepare_completion` /
`prepare_chat` as prompt token ids, `SamplingOptions` and a `RoutingChoice`; committed token
ids come back through one `ChoiceWriter` per choice (its `IncrementalDetokenizer`, output
parsers and token reports: a `ChoiceUpdate` per step, a `ChoiceResult` at the end), and
leave as a `Completion` / `ChatCompletion` body or as SSE bytes from a `CompletionStream` /
`ChatStream`.
Every failure is an `OpenAIError`, rendered by `error_response` as OpenAI's error envelope.
Nothing here imports Ray or FastAPI.
"""

from __future__ import annotations

from tokenrouter_ray.openai.chat import render_chat, template_messages
from tokenrouter_ray.openai.detokenizer import IncrementalDetokenizer
from tokenrouter_ray.openai.errors import (
    ContextLengthExceededError,
    InternalServerError,
    InvalidRequestError,
    ModelNotFoundError,
    OpenAIError,
    OverloadedError,
    as_openai_error,
    error_body,
    error_response,
    exc_headers,
    from_json_error,
    from_validation_error,
)
from tokenrouter_ray.openai.responses import (
    ChatCompletion,
    ChoiceResult,
    Completion,
    FinishReason,
    RoutingInfo,
    Usage,
    build_chat_completion,
    build_completion,
    chat_completion_id,
    completion_id,
    finish_reason,
)
from tokenrouter_ray.openai.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    StreamOptions,
)
from tokenrouter_ray.openai.sse import (
    SSE_DONE,
    SSE_HEADERS,
    SSE_MEDIA_TYPE,
    ChatStream,
    CompletionStream,
    sse_error,
    sse_event,
)
from tokenrouter_ray.openai.validation import (
    PreparedRequest,
    RequestLimits,
    RoutingChoice,
    SamplingOptions,
    check_model,
    parse_request,
    prepare_chat,
    prepare_completion,
)

__all__ = [
    "SSE_DONE",
    "SSE_HEADERS",
    "SSE_MEDIA_TYPE",
    "ChatCompletion",
    "ChatCompletionRequest",
    "ChatMessage",
    "ChatStream",
    "ChoiceResult",
    "Completion",
    "CompletionRequest",
    "CompletionStream",
    "ContextLengthExceededError",
    "FinishReason",
    "IncrementalDetokenizer",
    "InternalServerError",
    "InvalidRequestError",
    "ModelNotFoundError",
    "OpenAIError",
    "OverloadedError",
    "PreparedRequest",
    "RequestLimits",
    "RoutingChoice",
    "RoutingInfo",
    "SamplingOptions",
    "StreamOptions",
    "Usage",
    "as_openai_error",
    "build_chat_completion",
    "build_completion",
    "chat_completion_id",
    "check_model",
    "completion_id",
    "error_body",
    "error_response",
    "exc_headers",
    "finish_reason",
    "from_json_error",
    "from_validation_error",
    "parse_request",
    "prepare_chat",
    "prepare_completion",
    "render_chat",
    "sse_error",
    "sse_event",
    "template_messages",
]
