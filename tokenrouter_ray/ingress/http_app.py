"""The OpenAI HTTP app of an ingress: ``router``, the routes, and ``build_app(ingress)``, a
FastAPI app serving them over one ``IngressServer`` (ingress/openai_server.py), which every
route reads from ``request.app.state.ingress``. Servable by Ray Serve
(``deployments/ingress.py`` returns it from ``__serve_build_asgi_app__``) or by plain
uvicorn; no Ray in it.

A request is admitted (past ``max_active_requests`` it waits in a short bounded queue, then
429 with Retry-After), its body read (past ``ingress.limits.max_body_mib``: 413, from
Content-Length or while reading), parsed and tokenized (big bodies off the event loop), then
answered by the ingress: a JSON response, or an SSE stream whose choices are cancelled
however the response ends and which is cut once its client stops reading
(ingress/backpressure.py). Every error is the OpenAI envelope. ``POST /v1/responses`` (the
Responses API) is served as the chat request it maps to, its answer translated
(openai/responses_input.py, responses_output.py); its stored responses and the routes on
them (``GET``, ``DELETE``, ``cancel``, ``input_items``) are the ingress's ``ResponsesApi``
(ingress/responses_api.py).

Middlewares: optional API keys (``TOKENROUTER_API_KEYS``; every route but ``/health``, 401
envelope) and ``X-Request-Id`` (accepted or made, the prefix of the request's rids on every
model; echoed on every response when ``echo_request_id``: Serve's proxy echoes it itself, so
the Serve shim turns it off).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokenrouter_ray import __version__
from tokenrouter_ray.ingress.openai_server import IngressServer, StreamedChoices
from tokenrouter_ray.metrics import INGRESS
from tokenrouter_ray.openai import tokenize as token_ids
from tokenrouter_ray.openai.auth import ApiKeyMiddleware
from tokenrouter_ray.openai.errors import (
    InvalidRequestError,
    NotFoundError,
    OpenAIError,
    as_openai_error,
    error_response,
    from_json_error,
)
from tokenrouter_ray.openai.request_id import RequestIdMiddleware, request_id_of, rid_prefix
from tokenrouter_ray.openai.responses_input import ResponsesRequest
from tokenrouter_ray.openai.schemas import ChatCompletionRequest, CompletionRequest
from tokenrouter_ray.openai.sse import SSE_HEADERS, SSE_MEDIA_TYPE
from tokenrouter_ray.openai.validation import (
    PayloadTooLargeError,
    PreparedRequest,
    RequestLimits,
    check_model,
    check_raw_limits,
    parse_request,
    prepare_chat,
    prepare_completion,
)

logger = logging.getLogger(__name__)
MAX_TIMEOUT_S = 24 * 3600.0
PARSE_INLINE_BYTES = 64 << 10  # bodies above this are parsed off the event loop
# Bodies above this are templated and tokenized off the event loop. Below it the work (a
# chat template and the tokenizer) costs about what a thread hop does (latency and a pool
# wake-up), and it holds the interpreter lock in a thread too. A request with any of these
# fields goes off the loop whatever its size: its grammar is parsed while preparing (the
# first one imports xgrammar, which takes about a second).
PREPARE_INLINE_BYTES = 1 << 10
CONSTRAINT_FIELDS = frozenset(
    {
        "response_format",
        "structured_outputs",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "tools",
        "tool_choice",
    }
)


def load_json(body: bytes) -> Any:
    """The body as JSON; malformed or absurdly nested bodies are a 400, never a 500."""
    try:
        return json.loads(body)
    except ValueError as exc:  # JSONDecodeError, and UnicodeDecodeError for bytes
        raise from_json_error(exc) from None
    except RecursionError:
        raise InvalidRequestError(
            "The JSON body is nested too deeply to parse.", code="invalid_json"
        ) from None


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The body, refused with 413 past ``max_bytes``: from Content-Length before reading,
    and while reading (a chunked or lying client never makes the ingress buffer more)."""
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise InvalidRequestError("Invalid Content-Length header.")
        if int(length) > max_bytes:
            raise _too_large(max_bytes)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(max_bytes: int) -> PayloadTooLargeError:
    return PayloadTooLargeError(
        f"The request body is larger than this server accepts ({max_bytes} bytes)."
    )


def _parse(cls: type, body: bytes, limits: RequestLimits) -> tuple[Any, Any]:
    """JSON, the cheap count limits, then the schema: ``(data, parsed request)``."""
    data = load_json(body)
    check_raw_limits(data, limits)
    return data, parse_request(cls, data)


async def parse_off_loop(cls: type, body: bytes, limits: RequestLimits) -> tuple[Any, Any]:
    if len(body) <= PARSE_INLINE_BYTES:  # a thread hop costs more than a small parse
        return _parse(cls, body, limits)
    return await asyncio.to_thread(_parse, cls, body, limits)


def _prepare_inline(body: bytes, data: Any, resolve: Callable[[Any], None] | None) -> bool:
    """Whether a request is templated and tokenized on the event loop: a small body whose
    size bounds the work (no grammar to parse, no stored turns to add: ``resolve``)."""
    return (
        resolve is None
        and len(body) <= PREPARE_INLINE_BYTES
        and isinstance(data, dict)
        and CONSTRAINT_FIELDS.isdisjoint(data)
    )


def timeout_of(data: Any) -> float | None:
    """The ``timeout`` extension (seconds until the request is ended with an error)."""
    value = data.get("timeout") if isinstance(data, dict) else None
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequestError("'timeout' must be a number of seconds.", param="timeout")
    if not 0 < value <= MAX_TIMEOUT_S:
        raise InvalidRequestError(
            f"'timeout' must be in (0, {MAX_TIMEOUT_S:.0f}] seconds.", param="timeout"
        )
    return float(value)


def _with_request_id(prepared: PreparedRequest, request: Request) -> PreparedRequest:
    """The request's ``X-Request-Id`` (set by `RequestIdMiddleware`) as its rid prefix."""
    request_id = request_id_of(request)
    if request_id is None:
        return prepared
    return dataclasses.replace(prepared, request_id=rid_prefix(request_id))


class ChoicesResponse(StreamingResponse):
    """A stream whose choices are cancelled however the response ends (a client that
    disconnects before the first byte never starts the body generator, so the body's own
    cleanup would not run), and that stops, unfinished, once ``stalled`` returns (the client
    stopped reading: ingress/backpressure.py); the server then closes the connection."""

    def __init__(
        self, tasks: list[asyncio.Future], stalled: Any, *args: Any, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.tasks = tasks
        self.stalled = stalled

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        respond = asyncio.ensure_future(super().__call__(scope, receive, send))
        watch = asyncio.ensure_future(self.stalled()) if self.stalled is not None else None
        try:
            await asyncio.wait([t for t in (respond, watch) if t is not None],
                               return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
            if respond.done():
                respond.result()  # its exception, if any
        finally:
            for task in (respond, watch, *self.tasks):
                if task is not None:
                    task.cancel()
            with contextlib.suppress(BaseException):
                await respond


router = APIRouter()


def ingress_of(request: Request) -> IngressServer:
    """The ingress the app serves (``build_app`` puts it in the app's state)."""
    return request.app.state.ingress


def build_app(ingress: IngressServer, echo_request_id: bool = True) -> FastAPI:
    """The ingress's FastAPI app over ``ingress`` (see the module docstring)."""
    app = FastAPI(title="tokenrouter-ray", docs_url=None, redoc_url=None)
    app.state.ingress = ingress
    count_rejected_key = functools.partial(
        ingress.metrics.error, INGRESS, "invalid_request_error_401"
    )
    app.add_middleware(ApiKeyMiddleware, on_reject=count_rejected_key)
    # added last: outermost, so a 401 carries X-Request-Id too
    app.add_middleware(RequestIdMiddleware, echo=functools.partial(bool, echo_request_id))
    # OpenAIError and RequestValidationError are handled inside the middleware stack
    # (Starlette's ExceptionMiddleware), so their responses carry X-Request-Id; any other
    # exception reaches the outermost ServerErrorMiddleware (a 500 envelope, without it).
    for exc_class in (OpenAIError, RequestValidationError, Exception):
        app.add_exception_handler(exc_class, openai_errors)
    app.include_router(router)
    return app


async def openai_errors(request: Request, exc: Exception) -> JSONResponse:
    """Every error as the OpenAI envelope, counted by type and status."""
    status, body = error_response(exc)
    if status >= 500 and not isinstance(exc, OpenAIError):
        logger.error("ingress: unexpected error", exc_info=exc)
    metrics = ingress_of(request).metrics
    metrics.error(INGRESS, f"{as_openai_error(exc).error_type}_{status}")  # bounded
    return JSONResponse(body, status_code=status, headers=getattr(exc, "headers", None))


def check_optional_model(ingress: IngressServer, data: Any) -> None:
    name = token_ids.model_of(data)
    if name is not None:
        check_model(name, [ingress.served_model_name])


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [ingress_of(request).model_card()]}


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> dict[str, Any]:
    ingress = ingress_of(request)
    check_model(model_id, [ingress.served_model_name])
    return ingress.model_card()


@router.get("/version")
async def version() -> dict[str, Any]:
    return {"version": __version__}


async def _with_tokenizer(request: Request, convert: Callable[..., Any], **dump: Any) -> Response:
    """``/tokenize`` and ``/detokenize``: the body converted off the event loop by the
    ingress's tokenizer, within its limits."""
    ingress = ingress_of(request)
    data = load_json(await request.body())
    check_optional_model(ingress, data)
    out = await asyncio.to_thread(convert, data, ingress.tokenizer, ingress.limits)
    return JSONResponse(out.model_dump(mode="json", **dump))


@router.post("/tokenize")
async def tokenize(request: Request) -> Response:
    return await _with_tokenizer(request, token_ids.tokenize, exclude_none=True)


@router.post("/detokenize")
async def detokenize(request: Request) -> Response:
    return await _with_tokenizer(request, token_ids.detokenize)


@router.get("/health")
async def health(request: Request) -> Response:
    status, body = ingress_of(request).health()
    headers = {"Retry-After": "1"} if status == 503 else None
    return JSONResponse(body, status_code=status, headers=headers)


@router.get("/v1/tokenrouter/stats")
async def stats(request: Request) -> dict[str, Any]:
    """This ingress's counts, and what one replica of each model holds now."""
    return await ingress_of(request).stats()


@router.get("/v1/tokenrouter/quality")
async def quality_status(request: Request) -> dict[str, Any]:
    """Live quality: sampled answers scored by the top model (quality/live.py), and the
    speed bypass's choice per load level (quality/speed.py)."""
    return await ingress_of(request).quality_status()


@router.get("/v1/tokenrouter/tuner")
async def tuner_status(request: Request) -> Any:
    return await ingress_of(request).tuner_status()


async def admit(
    request: Request,
    schema: type,
    prepare: Any,
    resolve: Callable[[Any], None] | None = None,
) -> tuple[Any, Any, float | None]:
    """Admission, body, parsing, ``resolve`` (on the loop) and tokenizing (off it, but for
    a small plain request: `_prepare_inline`): ``(parsed request, prepared request,
    timeout)``. The caller submits it at once: out of the queue's block, nothing may
    suspend before the core counts the request."""
    ingress = ingress_of(request)
    async with ingress.admission.admit(ingress.has_room):  # before any reading: cheap 429
        ingress.check_admission()
        body = await read_body(request, ingress.max_body_bytes)
        data, parsed = await parse_off_loop(schema, body, ingress.limits)
        check_model(parsed.model, [ingress.served_model_name])
        if resolve is not None:
            resolve(parsed)
        args = (parsed, ingress.tokenizer, ingress.limits, ingress.generation_defaults)
        if _prepare_inline(body, data, resolve):
            prepared = prepare(*args)
        else:
            prepared = await asyncio.to_thread(prepare, *args)
        prepared = _with_request_id(prepared, request)
        timeout_s = timeout_of(data)
    return parsed, prepared, timeout_s


def stream_response(result: StreamedChoices) -> Response:
    """A streamed answer (the choices' SSE, or the Responses events) as the HTTP response."""
    return ChoicesResponse(
        result.tasks, result.stalled, result.body, media_type=SSE_MEDIA_TYPE, headers=SSE_HEADERS
    )


async def complete_request(request: Request, schema: type, prepare: Any, chat: bool) -> Any:
    _, prepared, timeout_s = await admit(request, schema, prepare)
    result = await ingress_of(request).respond(prepared, chat, timeout_s)
    if isinstance(result, StreamedChoices):
        return stream_response(result)
    # serialized by pydantic's own (compiled) encoder: no dict, no json.dumps
    return Response(result.model_dump_json(), media_type="application/json")


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await complete_request(request, CompletionRequest, prepare_completion, chat=False)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await complete_request(request, ChatCompletionRequest, prepare_chat, chat=True)


@router.post("/v1/responses")
async def responses(request: Request) -> Response:
    """The Responses API, served as the chat request it maps to (openai/responses_*.py);
    stored unless ``store`` is false."""
    ingress = ingress_of(request)
    api = ingress.responses
    parsed, prepared, timeout_s = await admit(
        request, ResponsesRequest, api.prepare, resolve=api.resolve
    )
    result = await api.create(ingress, parsed, prepared, timeout_s)
    if isinstance(result, StreamedChoices):
        return stream_response(result)
    return JSONResponse(result.model_dump(mode="json"))


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, request: Request) -> Response:
    return JSONResponse(ingress_of(request).responses.retrieve(response_id, request.query_params))


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> Response:
    return JSONResponse(await ingress_of(request).responses.delete(response_id))


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, request: Request) -> Response:
    return JSONResponse(await ingress_of(request).responses.cancel(response_id))


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(response_id: str, request: Request) -> Response:
    api = ingress_of(request).responses
    return JSONResponse(api.input_items(response_id, request.query_params))


@router.api_route("/v1/responses/{rest:path}", methods=["GET", "POST", "DELETE"])
async def no_such_route(rest: str) -> Response:
    raise NotFoundError(f"No route '/v1/responses/{rest[:80]}' on this server.")
