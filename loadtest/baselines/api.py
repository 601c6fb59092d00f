"""What the baseline servers share: the slice of the chat API the harness sends, the SSE
chunks it reads back (with the same ``routing`` object as the tokenrouter ingress, so the
harness reads every system the same way), the token lists a generating thread posts
(``posted_tokens``), and starting / stopping a server process.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tokenrouter_ray.openai.errors import InvalidRequestError


class ChatRequest(BaseModel):
    """The fields the harness sends; anything else is ignored, as a glue script would."""

    model_config = ConfigDict(extra="ignore")
    model: str = Field("tokenrouter", description="Ignored: one model set per server.")
    messages: list[dict] = Field(min_length=1, description="Chat messages.")
    max_tokens: int = Field(16, ge=1, le=65536, description="Output token cap.")
    seed: int = Field(0, ge=0, lt=2**62, description="Seed of the routing draws.")
    ignore_eos: bool = Field(False, description="Extension: keep generating past EOS.")
    stream: bool = Field(False, description="Server-sent events.")


@dataclass
class Answer:
    """A response as it is produced: text pieces, then usage and routing."""

    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex[:16]}")
    prompt_tokens: int = 0
    completion_tokens: int = 0
    tokens_per_model: dict[str, int] = field(default_factory=dict)
    handoffs: int = 0
    finish_reason: str = "length"

    def chunk(self, text: str | None = None, final: bool = False) -> str:
        body: dict = {"id": self.id, "object": "chat.completion.chunk", "model": "tokenrouter"}
        if final:
            body["choices"] = [{"index": 0, "delta": {}, "finish_reason": self.finish_reason}]
            body["usage"] = self.usage()
            body["routing"] = self.routing()
        else:
            body["choices"] = [{"index": 0, "delta": {"content": text}, "finish_reason": None}]
        return f"data: {json.dumps(body)}\n\n"

    def usage(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }

    def routing(self) -> dict:
        return {"tokens_per_model": dict(self.tokens_per_model), "handoffs": self.handoffs}


async def posted_tokens(out: asyncio.Queue) -> AsyncIterator[list[int]]:
    """The token lists a generating thread posts to ``out`` as ``("tokens", ids)``, until
    its ``("end", ...)``; an ``("error", message)`` raises ``ValueError(message)``."""
    while True:
        kind, value = await out.get()
        if kind == "error":
            raise ValueError(value)
        if kind == "end":
            return
        yield value


def bad_request(message: str) -> JSONResponse:
    return JSONResponse(InvalidRequestError(message).to_dict(), 400)


def chat_app(generate: object, title: str) -> FastAPI:
    """A FastAPI app whose chat route runs ``generate(request, answer) -> AsyncIterator[str]``
    (text pieces; it fills ``answer`` as it goes)."""
    app = FastAPI(title=title, docs_url=None, redoc_url=None)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.post("/v1/chat/completions")
    async def chat(raw: Request) -> Response:
        try:
            req = ChatRequest.model_validate_json(await raw.body())
        except ValidationError as exc:
            return bad_request(str(exc.errors(include_url=False)[:3]))
        answer = Answer()
        pieces: AsyncIterator[str] = generate(req, answer)  # type: ignore[operator]
        try:  # the first piece before answering: a bad request is a 400, not a broken stream
            first = await anext(pieces, "")
        except ValueError as exc:
            return bad_request(str(exc))
        if req.stream:

            async def events() -> AsyncIterator[str]:
                if first:
                    yield answer.chunk(first)
                async for text in pieces:
                    if text:
                        yield answer.chunk(text)
                yield answer.chunk(final=True)
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        message = {"role": "assistant", "content": first + "".join([t async for t in pieces])}
        choice = {"index": 0, "message": message, "finish_reason": answer.finish_reason}
        return JSONResponse({"id": answer.id, "object": "chat.completion", "model": "tokenrouter",
                             "choices": [choice], "usage": answer.usage(),
                             "routing": answer.routing()})  # fmt: skip

    return app


# ------------------------------------------------------------------ server processes
@dataclass
class ServerProcess:
    """A server started as a child process; ``stop()`` ends it (and only it)."""

    name: str
    url: str
    proc: subprocess.Popen
    log: str

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def dies_with_parent(argv: Sequence[str], signal_name: str = "TERM") -> list[str]:
    """``argv`` started so that it gets ``SIG<signal_name>`` when the thread that starts it
    ends: a benchmark or a test run killed by a signal no longer leaves its servers running
    (and holding their ports). util-linux's ``setpriv --pdeathsig`` where it is installed
    (Linux); elsewhere ``argv`` as it is. (A parent killed within the millisecond before
    ``setpriv`` has set the signal still leaves its server running.)"""
    setpriv = shutil.which("setpriv") if sys.platform == "linux" else None
    return [setpriv, "--pdeathsig", signal_name, "--", *argv] if setpriv else list(argv)


def launch_server(
    name: str, argv: Sequence[str], port: int, log_dir: str, env: dict[str, str] | None = None
) -> ServerProcess:
    """Start ``argv`` in its own process group (``wait_healthy`` waits for it); it is
    killed with the thread that starts it (``dies_with_parent``: SIGKILL, which a server
    can neither catch nor have blocked; its ``stop`` is the graceful way)."""
    log = os.path.join(log_dir, f"{name}.log")
    with open(log, "w") as out:
        proc = subprocess.Popen(
            dies_with_parent(argv, "KILL"),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
    return ServerProcess(name, f"http://127.0.0.1:{port}", proc, log)


def wait_healthy(server: ServerProcess, health: str = "/health", timeout_s: float = 300.0) -> None:
    """Until ``health`` answers 200; a server that exits or stays down is stopped and named
    in the error with its log's tail."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and server.proc.poll() is None:
        try:
            if httpx.get(server.url + health, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.stop()
    with open(server.log) as f:
        tail = f.read()[-3000:]
    raise RuntimeError(f"{server.name} did not come up at {server.url}:\n{tail}")


def start_server(
    name: str, argv: Sequence[str], port: int, log_dir: str, health: str = "/health"
) -> ServerProcess:
    server = launch_server(name, argv, port, log_dir)
    wait_healthy(server, health)
    return server


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


class ThreadServer:
    """A baseline app served from a thread of this process (tests: no interpreter start-up
    per server); the same ``url`` / ``stop()`` as ``ServerProcess``."""

    def __init__(self, name: str, app: FastAPI, port: int) -> None:
        import threading

        import uvicorn

        self.name, self.url = name, f"http://127.0.0.1:{port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name=name, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start on port {port}")
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
