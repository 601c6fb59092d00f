"""The OpenAI HTTP ingress (FastAPI inside Serve): parse, tokenize, submit, stream.

A request is validated and tokenized (``tokenrouter_ray.openai``), then answered by an
``IngressServer`` (``tokenrouter_ray/runtime/ingress.py``, no Ray in it): admitted (past
``max_active_requests`` a request waits in a short bounded queue, then 429 with
Retry-After; bodies past ``ingress.limits.max_body_mib`` are a 413), and submitted ``n``
times as NEW PeerReqs to the least-loaded replica of the entry model. Commits come back over
this replica's peer channel from whichever model committed; ``IngressCore`` orders them and
the incremental detokenizer turns them into text (stop strings cut the text and abort the
request everywhere). A client
disconnect or cancellation aborts every choice on every model (the cleanup never awaits, so
a cancelled handler cannot skip it).

Reliability (docs/reliability.md): every request has a deadline (``ingress.request_timeout_s``,
or the request's ``timeout`` extension, seconds); a choice that fails, times out or loses its
model ends with an OpenAI error (non-streaming: the envelope, 503 with ``Retry-After`` when a
retry should work; streaming: an error event, then ``[DONE]``). When a model replica
disappears from the directory (its lease ran out: the process died), every unfinished
request is re-created from its committed sequence on the replicas that remain or replace it.
``/health`` is 503 while a model has no replica. A streamed choice waits once it is
``ingress.stream_buffer_tokens`` ahead of its client, and a client blocked for
``ingress.client_stall_s`` is cut (runtime/backpressure.py; Serve's proxy, which buffers
what the client does not read, hides that from this replica: docs/reliability.md).
"""

# No `from __future__ import annotations` here: FastAPI resolves the route methods'
# annotations (`request: Request`) at runtime, and string annotations on Serve's class-based
# routes are not resolved.

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments.directory import ServeDirectory
from deployments.model_server import spec_tokenizer
from deployments.peers import PeerBook, make_channel, peer_key
from deployments.ray_metrics import ray_metrics
from tokenrouter_ray import __version__
from tokenrouter_ray.config import AppConfig
from tokenrouter_ray.metrics import INGRESS
from tokenrouter_ray.openai.auth import ApiKeyMiddleware
from tokenrouter_ray.openai.errors import (
    InvalidRequestError,
    NotFoundError,
    OpenAIError,
    as_openai_error,
    error_response,
    from_json_error,
)
from tokenrouter_ray.openai.generation_defaults import GenerationDefaults
from tokenrouter_ray.openai.request_id import RequestIdMiddleware, request_id_of, rid_prefix
from tokenrouter_ray.openai.schemas import ChatCompletionRequest, CompletionRequest
from tokenrouter_ray.openai.sse import (
    SSE_HEADERS,
    SSE_MEDIA_TYPE,
)
from tokenrouter_ray.openai.tokenize import detokenize, model_of, tokenize
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
from tokenrouter_ray.runtime.admission import AdmissionQueue
from tokenrouter_ray.runtime.backpressure import Backpressure
from tokenrouter_ray.runtime.ingress import IngressCore
from tokenrouter_ray.runtime.openai_server import IngressServer, StreamedChoices
from tokenrouter_ray.runtime.recovery import AdmissionCap, Recovery

logger = logging.getLogger("ray.serve")
MAX_TIMEOUT_S = 24 * 3600.0
PARSE_INLINE_BYTES = 64 << 10  # bodies above this are parsed off the event loop

app = FastAPI(title="tokenrouter-ray", docs_url=None, redoc_url=None)


def _count_rejected_key() -> None:
    ray_metrics().error(INGRESS, "invalid_request_error_401")


# Optional API keys (TOKENROUTER_API_KEYS): every route but /health, 401 envelope; off if unset.
app.add_middleware(ApiKeyMiddleware, on_reject=_count_rejected_key)
# X-Request-Id: accepted or made, returned on every response (added last: outermost, so a
# 401 carries it too), and the prefix of the request's rids on every model.
app.add_middleware(RequestIdMiddleware, echo=lambda: not _Serve.running)


class _Serve:
    """Whether this app runs inside Serve, whose proxy echoes X-Request-Id (and makes one
    when the client sent none), so the app must not add a second."""

    running = False


def _load_json(body: bytes) -> Any:
    """The body as JSON; malformed or absurdly nested bodies are a 400, never a 500."""
    try:
        return json.loads(body)
    except ValueError as exc:  # JSONDecodeError, and UnicodeDecodeError for bytes
        raise from_json_error(exc) from None
    except RecursionError:
        raise InvalidRequestError(
            "The JSON body is nested too deeply to parse.", code="invalid_json"
        ) from None


async def _read_body(request: Request, max_bytes: int) -> bytes:
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
    data = _load_json(body)
    check_raw_limits(data, limits)
    return data, parse_request(cls, data)


async def _parse_off_loop(cls: type, body: bytes, limits: RequestLimits) -> tuple[Any, Any]:
    if len(body) <= PARSE_INLINE_BYTES:  # a thread hop costs more than a small parse
        return _parse(cls, body, limits)
    return await asyncio.to_thread(_parse, cls, body, limits)


def _timeout_of(data: Any) -> float | None:
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


class _ChoicesResponse(StreamingResponse):
    """A stream whose choices are cancelled however the response ends (a client that
    disconnects before the first byte never starts the body generator, so the body's own
    cleanup would not run), and that stops, unfinished, once ``stalled`` returns (the client
    stopped reading: runtime/backpressure.py); the server then closes the connection."""

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


# OpenAIError and RequestValidationError are handled inside the middleware stack (Starlette's
# ExceptionMiddleware), so their responses carry X-Request-Id; any other exception reaches
# the outermost ServerErrorMiddleware (a 500 envelope, without it).
@app.exception_handler(OpenAIError)
@app.exception_handler(RequestValidationError)
@app.exception_handler(Exception)
async def _openai_errors(_: Request, exc: Exception) -> JSONResponse:
    status, body = error_response(exc)
    if status >= 500 and not isinstance(exc, OpenAIError):
        logger.error("ingress: unexpected error", exc_info=exc)
    ray_metrics().error(INGRESS, f"{as_openai_error(exc).error_type}_{status}")  # bounded
    return JSONResponse(body, status_code=status, headers=getattr(exc, "headers", None))


@serve.deployment(max_ongoing_requests=1000, graceful_shutdown_timeout_s=5)
@serve.ingress(app)
class Ingress:
    async def __init__(
        self,
        app_config: dict,
        directory: DeploymentHandle,
        models: dict[str, DeploymentHandle],
        tuner: DeploymentHandle | None = None,
    ) -> None:
        cfg = AppConfig.model_validate(app_config)
        _Serve.running = True
        self.cfg = cfg
        self.tuner = tuner
        # admission limit: the configured cap, or the tuner's SLO cap when lower
        self.cap = AdmissionCap(cfg.ingress.max_active_requests, cfg.ingress.num_replicas)
        entry = cfg.model_names[0]
        self.tokenizer = await asyncio.to_thread(spec_tokenizer, cfg.models[entry])
        self.generation_defaults = (
            GenerationDefaults.from_model_dir(cfg.models[entry].path)
            if cfg.ingress.generation_config == "auto" and cfg.models[entry].sim is None
            else GenerationDefaults()
        )
        infos = [await models[name].info.remote() for name in cfg.model_names]
        lim = cfg.ingress.limits
        self.limits = RequestLimits(
            max_model_len=min(i.max_model_len for i in infos),  # ReplicaInfo
            vocab_size=min([len(self.tokenizer), *(i.vocab_size for i in infos)]),
            structured_outputs=cfg.models[entry].sim is None,  # grammars need a real vocabulary
            **lim.model_dump(exclude={"max_body_mib"}),
        )
        self.max_body_bytes = int(lim.max_body_mib * 2**20)
        self.admission = AdmissionQueue(cfg.ingress.admission_queue, cfg.ingress.admission_wait_s)
        ray_metrics(model_name=cfg.served_model_name)  # labels every ray_metrics() here
        replica = serve.get_replica_context().replica_id.unique_id
        serve_directory = ServeDirectory(directory)
        key = await peer_key(serve_directory)
        self.channel = make_channel(
            cfg.transport, "ingress", replica, serve_directory, key, ray_metrics()
        )
        await self.channel.start()
        self.models = models
        self.timeout_s = cfg.ingress.request_timeout_s
        self.core = IngressCore(
            self.channel, self._entry, self.peers_all, ray_metrics(), timeout_s=self.timeout_s
        )
        self.peers = PeerBook(
            serve_directory, cfg.model_names, own=self.channel.endpoint, on_lost=self._on_lost
        )
        self.recovery = Recovery(
            self.core, self.peers.missing, self._endpoints_for, timeout_s=self.timeout_s
        )
        await self.peers.start(wait_for_all=True)
        await self.core.start()
        self.server = IngressServer(
            self.core,
            self.tokenizer,
            cfg.served_model_name,
            entries=lambda: self.peers.by_model[cfg.model_names[0]],
            endpoints_for=self._endpoints_for,
            max_active=lambda: self.cap.limit,
            unavailable=self._unavailable,
            models=cfg.model_names,
            # cache-aware placement of every model's replica (runtime/affinity.py)
            replicas_of=lambda model: self.peers.by_model.get(model, []),
            block_sizes={name: spec.block_size for name, spec in cfg.models.items()},
            backpressure=Backpressure(cfg.ingress.stream_buffer_tokens, cfg.ingress.client_stall_s),
        )
        self._slo = None
        if cfg.tuner.min_tokens_per_s and tuner is not None:  # SLO mode: follow the tuner's cap
            fetch = tuner.admission_cap.remote
            self._slo = asyncio.create_task(self.cap.follow(fetch, cfg.tuner.period_s))

    # ------------------------------------------------------------------ routes
    def _model_card(self) -> dict[str, Any]:
        return {
            "id": self.cfg.served_model_name,
            "object": "model",
            "created": 0,
            "owned_by": "tokenrouter-ray",
            "max_model_len": self.limits.max_model_len,
            "models": self.cfg.model_names,
        }

    @app.get("/v1/models")
    async def list_models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self._model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(self, model_id: str) -> dict[str, Any]:
        check_model(model_id, [self.cfg.served_model_name])
        return self._model_card()

    @app.get("/version")
    async def version(self) -> dict[str, Any]:
        return {"version": __version__}

    @app.post("/tokenize")
    async def tokenize(self, request: Request) -> Response:
        data = _load_json(await request.body())
        self._check_optional_model(data)
        out = await asyncio.to_thread(tokenize, data, self.tokenizer, self.limits)
        return JSONResponse(out.model_dump(mode="json", exclude_none=True))

    @app.post("/detokenize")
    async def detokenize(self, request: Request) -> Response:
        data = _load_json(await request.body())
        self._check_optional_model(data)
        out = await asyncio.to_thread(detokenize, data, self.tokenizer, self.limits)
        return JSONResponse(out.model_dump(mode="json"))

    def _check_optional_model(self, data: Any) -> None:
        name = model_of(data)
        if name is not None:
            check_model(name, [self.cfg.served_model_name])

    async def check_health(self) -> None:
        """Serve's health check: the receive and refresh loops and the channel (a failure
        restarts this replica; its streams end, and the models end its requests once its
        active count goes silent)."""
        problem = self.core.health_problem()
        if problem is not None:
            raise RuntimeError(problem)

    @app.get("/health")
    async def health(self) -> Response:
        missing = self.peers.missing()
        if missing or not self.peers.refreshing:
            body = {"status": "unavailable", "models_without_replica": missing}
            return JSONResponse(body, status_code=503, headers={"Retry-After": "1"})
        return JSONResponse({"status": "ok"})

    @app.get("/v1/tokenrouter/stats")
    async def stats(self) -> dict[str, Any]:
        """This ingress's counts, and what one replica of each model holds now."""
        models: dict[str, Any] = {}
        for name, handle in self.models.items():
            try:
                status = await asyncio.wait_for(handle.status.remote(), timeout=5)
                models[name] = status.to_json()  # ReplicaStatus
            except Exception as exc:
                models[name] = {"error": repr(exc)}
        return {
            "active_requests": self.core.num_active,
            "entry_requests": self.server.entry_total,
            "tokens_received": self.core.tokens_received,  # committed tokens seen here
            "frames_received": self.core.frames_received,
            "bytes_sent": self.channel.bytes_sent,  # NEW, ACTIVE, ABORT frames
            "cpu_s": time.process_time(),  # this ingress process's CPU time
            "endpoints": self.peers.by_model,
            "recoveries": self.recovery.log[-20:],
            "stream_buffered_tokens": self.server.buffered_tokens,  # not yet taken by clients
            "client_stalls": self.server.client_stalls,  # streams cut: client stopped reading
            "orphans_aborted": self.core.orphans_aborted,  # copies told to stop (issue 26)
            "models": models,
        }

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._complete_request(
            request, CompletionRequest, prepare_completion, chat=False
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._complete_request(request, ChatCompletionRequest, prepare_chat, chat=True)

    async def _complete_request(
        self, request: Request, schema: type, prepare: Any, chat: bool
    ) -> Response:
        """Admission, body, parsing and tokenizing (off the loop), then the response."""
        async with self.admission.admit(self._has_room):  # before any reading: 429 is cheap
            self.server.check_admission()
            body = await _read_body(request, self.max_body_bytes)
            data, parsed = await _parse_off_loop(schema, body, self.limits)
            check_model(parsed.model, [self.cfg.served_model_name])
            prepared = await asyncio.to_thread(
                prepare, parsed, self.tokenizer, self.limits, self.generation_defaults
            )
            prepared = _with_request_id(prepared, request)
            timeout_s = _timeout_of(data)
        # Out of the queue's block: nothing suspends before the core counts the request.
        return await self._respond(prepared, chat=chat, timeout_s=timeout_s)

    @app.get("/v1/tokenrouter/tuner")
    async def tuner_status(self) -> dict[str, Any]:
        if self.tuner is None:
            raise NotFoundError("The threshold tuner is not enabled (set `tuner=live`).")
        return (await self.tuner.status.remote()).to_json()  # TunerStatus

    # ---------------------------------------------------------------- recovery
    def peers_all(self) -> list[str]:
        return self.peers.all()

    def _on_lost(self, lost: set[str]) -> None:
        """Model endpoints whose lease ran out: their replicas died. Their channels and
        affinity entries are dropped, and their unfinished requests re-created once each
        model has a replica again (``runtime/recovery.py``)."""
        for name in lost:
            self.channel.forget_peer(name)
            if hasattr(self, "server"):
                self.server.forget_replica(name)
        self.recovery.lost(lost)

    def _endpoints_for(self, rid: str) -> dict[str, str]:
        """The replica of each non-entry model a request uses (sticky by request id)."""
        return {m: self.peers.sticky(m, rid) for m in self.cfg.model_names[1:]}

    # ---------------------------------------------------------------- serving
    # Admission, entry load-balancing and the per-choice loop live in ``IngressServer``
    # (tokenrouter_ray/runtime/ingress.py); this class adds what only Serve knows.
    def _entry(self) -> str:
        return self.server.entry()

    def _has_room(self, reserved: int) -> bool:
        """A slot is free for one more request, counting those the admission queue let in
        that have not been submitted yet."""
        return self.core.num_active + reserved < self.cap.limit

    def _unavailable(self) -> str | None:
        """The models without a healthy replica (or recovery in progress); None: none."""
        missing = self.peers.missing()
        if missing or self.recovery.running:
            return ", ".join(missing) or "being recovered"
        return None

    async def _respond(
        self, prepared: PreparedRequest, chat: bool, timeout_s: float | None = None
    ) -> Response:
        result = await self.server.respond(prepared, chat, timeout_s)
        if isinstance(result, StreamedChoices):
            return _ChoicesResponse(
                result.tasks,
                result.stalled,
                result.body,
                media_type=SSE_MEDIA_TYPE,
                headers=SSE_HEADERS,
            )
        return JSONResponse(result.model_dump(mode="json"))

    async def __del__(self) -> None:
        if self._slo is not None:
            self._slo.cancel()
        await self.recovery.stop()
        await self.admission.close()
        await self.core.stop()
        await self.peers.stop()
        await self.channel.close()
