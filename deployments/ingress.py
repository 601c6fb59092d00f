"""The OpenAI HTTP ingress (FastAPI inside Serve): parse, tokenize, submit, stream.

A request is validated and tokenized (``tokenrouter_ray.openai``), admitted (503 past
``max_active_requests``), and submitted ``n`` times as NEW PeerReqs to the least-loaded
replica of the entry model. Commits come back over this replica's peer channel from
whichever model committed; ``IngressCore`` orders them and the incremental detokenizer turns
them into text (stop strings cut the text and abort the request everywhere). A client
disconnect or cancellation aborts every choice on every model.
"""

# No `from __future__ import annotations` here: FastAPI resolves the route methods'
# annotations (`request: Request`) at runtime, and string annotations on Serve's class-based
# routes are not resolved.

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments.directory import ServeDirectory
from deployments.model_server import load_tokenizer
from deployments.peers import PeerBook, make_channel
from tokenrouter_ray.config import AppConfig
from tokenrouter_ray.metrics import INGRESS, Metrics
from tokenrouter_ray.openai.detokenizer import IncrementalDetokenizer
from tokenrouter_ray.openai.errors import (
    InvalidRequestError,
    NotFoundError,
    OverloadedError,
    as_openai_error,
    error_response,
)
from tokenrouter_ray.openai.responses import (
    ChoiceResult,
    build_chat_completion,
    build_completion,
    finish_reason,
)
from tokenrouter_ray.openai.schemas import ChatCompletionRequest, CompletionRequest
from tokenrouter_ray.openai.sse import (
    SSE_HEADERS,
    SSE_MEDIA_TYPE,
    ChatStream,
    CompletionStream,
    merge_choice_streams,
)
from tokenrouter_ray.openai.validation import (
    PreparedRequest,
    RequestLimits,
    check_model,
    parse_request,
    prepare_chat,
    prepare_completion,
)
from tokenrouter_ray.runtime.ingress import IngressCore

app = FastAPI(title="tokenrouter-ray", docs_url=None, redoc_url=None)


@app.exception_handler(RequestValidationError)
@app.exception_handler(Exception)
async def _openai_errors(_: Request, exc: Exception) -> JSONResponse:
    status, body = error_response(exc)
    Metrics.ray().error(INGRESS, f"{as_openai_error(exc).error_type}_{status}")  # bounded
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
        self.cfg = cfg
        self.tuner = tuner
        self.slo_cap: int | None = None  # the tuner's SLO-mode concurrency, per replica
        entry = cfg.model_names[0]
        self.tokenizer = await asyncio.to_thread(load_tokenizer, cfg.models[entry].path)
        infos = [await models[name].info.remote() for name in cfg.model_names]
        self.limits = RequestLimits(
            max_model_len=min(i["max_model_len"] for i in infos),
            vocab_size=min([len(self.tokenizer), *(i["vocab_size"] for i in infos)]),
        )
        replica = serve.get_replica_context().replica_id.unique_id
        serve_directory = ServeDirectory(directory)
        self.channel = make_channel(cfg.transport, "ingress", replica, serve_directory)
        await self.channel.start()
        self.peers = PeerBook(serve_directory, cfg.model_names)
        await self.peers.start(wait_for_all=True)
        self.core = IngressCore(self.channel, self._entry, self.peers.all, Metrics.ray())
        await self.core.start()
        self.entry_load: dict[str, int] = {}
        self.entry_total: dict[str, int] = {}
        self._ids = itertools.count()
        self._slo = asyncio.create_task(self._follow_slo()) if cfg.tuner.min_tokens_per_s else None

    # ------------------------------------------------------------------ routes
    @app.get("/v1/models")
    async def list_models(self) -> dict[str, Any]:
        card = {
            "id": self.cfg.served_model_name,
            "object": "model",
            "created": 0,
            "owned_by": "tokenrouter-ray",
            "models": self.cfg.model_names,
        }
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health(self) -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/tokenrouter/stats")
    async def stats(self) -> dict[str, Any]:
        return {
            "active_requests": self.core.num_active,
            "entry_requests": self.entry_total,
            "endpoints": self.peers.by_model,
        }

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        parsed = parse_request(CompletionRequest, await request.body())
        check_model(parsed.model, [self.cfg.served_model_name])
        prepared = await asyncio.to_thread(prepare_completion, parsed, self.tokenizer, self.limits)
        return await self._respond(prepared, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        parsed = parse_request(ChatCompletionRequest, await request.body())
        check_model(parsed.model, [self.cfg.served_model_name])
        prepared = await asyncio.to_thread(prepare_chat, parsed, self.tokenizer, self.limits)
        return await self._respond(prepared, chat=True)

    @app.get("/v1/tokenrouter/tuner")
    async def tuner_status(self) -> dict[str, Any]:
        if self.tuner is None:
            raise NotFoundError("The threshold tuner is not enabled (set `tuner=live`).")
        return await self.tuner.status.remote()

    async def _follow_slo(self) -> None:
        """SLO mode: admit no more than the tuner's cap, split over the ingress replicas."""
        while True:
            await asyncio.sleep(self.cfg.tuner.period_s)
            with contextlib.suppress(Exception):  # keep the last cap while the tuner restarts
                cap = await self.tuner.admission_cap.remote()
                replicas = self.cfg.ingress.num_replicas
                self.slo_cap = None if cap is None else max(1, -(-cap // replicas))

    # ---------------------------------------------------------------- serving
    def _entry(self) -> str:
        options = self.peers.by_model[self.cfg.model_names[0]]
        return min(options, key=lambda e: self.entry_load.get(e, 0))

    async def _submit(self, prepared: PreparedRequest) -> list[tuple[str, str]]:
        sampling = prepared.sampling
        if sampling.min_p or sampling.repetition_penalty != 1.0:
            raise InvalidRequestError(
                "min_p and repetition_penalty are not supported yet.",
                param="min_p" if sampling.min_p else "repetition_penalty",
            )
        limit = min(self.cfg.ingress.max_active_requests, self.slo_cap or 1 << 30)
        if self.core.num_active + sampling.n > limit:
            raise OverloadedError("Too many requests in flight; retry shortly.")
        base = f"req-{time.time_ns():x}-{next(self._ids)}"
        submitted = []
        for i in range(sampling.n):
            rid, entry = f"{base}-{i}", self._entry()
            self.entry_load[entry] = self.entry_load.get(entry, 0) + 1
            self.entry_total[entry] = self.entry_total.get(entry, 0) + 1
            await self.core.submit(rid, prepared.prompt_token_ids, sampling.to_spec(i), entry)
            submitted.append((rid, entry))
        return submitted

    async def _choice(
        self,
        index: int,
        rid: str,
        entry: str,
        prepared: PreparedRequest,
        pieces: asyncio.Queue | None,
    ) -> ChoiceResult:
        detok = IncrementalDetokenizer(
            self.tokenizer, stop=prepared.sampling.stop, prompt_token_ids=prepared.prompt_token_ids
        )
        try:
            async for tokens in self.core.stream(rid):
                text = detok.push(tokens)
                if text and pieces is not None:
                    pieces.put_nowait((index, text))
                if detok.stopped:
                    await self.core.abort(rid, reason="stop")
                    break
            tail = detok.finish()
            if tail and pieces is not None:
                pieces.put_nowait((index, tail))
        finally:
            self.entry_load[entry] -= 1
            await self.core.abort(rid)  # no-op once complete; frees KV on disconnect
            done = self.core.release(rid)
        reason = finish_reason(done.finish_reason, stopped_by_string=detok.stopped)
        return ChoiceResult(
            index,
            detok.text,
            reason,
            detok.num_tokens,
            ChoiceResult.routing_of(done.counts, done.handoffs),
        )

    async def _respond(self, prepared: PreparedRequest, chat: bool) -> Response:
        submitted = await self._submit(prepared)
        prompt_len = len(prepared.prompt_token_ids)
        name = self.cfg.served_model_name
        if not prepared.sampling.stream:
            tasks = [
                asyncio.ensure_future(self._choice(i, rid, entry, prepared, None))
                for i, (rid, entry) in enumerate(submitted)
            ]
            try:
                choices = await asyncio.gather(*tasks)
            finally:
                for task in tasks:
                    task.cancel()
            build = build_chat_completion if chat else build_completion
            return JSONResponse(build(name, prompt_len, choices).model_dump(mode="json"))
        stream_cls = ChatStream if chat else CompletionStream
        stream = stream_cls(
            name, prepared.sampling.n, include_usage=prepared.sampling.include_usage
        )
        body = self._sse(stream, submitted, prepared, prompt_len)
        return StreamingResponse(body, media_type=SSE_MEDIA_TYPE, headers=SSE_HEADERS)

    async def _sse(
        self,
        stream: Any,
        submitted: list[tuple[str, str]],
        prepared: PreparedRequest,
        prompt_len: int,
    ) -> AsyncIterator[bytes]:
        pieces: asyncio.Queue = asyncio.Queue()
        tasks = [
            asyncio.ensure_future(self._choice(i, rid, entry, prepared, pieces))
            for i, (rid, entry) in enumerate(submitted)
        ]
        frames = merge_choice_streams(stream, tasks, pieces, prompt_len)
        async with contextlib.aclosing(frames):  # a disconnect aborts the choices now
            async for frame in frames:
                yield frame

    async def __del__(self) -> None:
        if self._slo is not None:
            self._slo.cancel()
        await self.core.stop()
        await self.peers.stop()
        await self.channel.close()
