"""The one in-process harness of the ingress: the real FastAPI app (ingress/http_app.py:
routes, validation, error handlers, API-key middleware) over a real ``IngressServer`` built
with its public constructor, without Ray.

- ``ingress_app(tokenizer)``: over fakes: a peer view with one replica per model, a channel
  that sends nothing, and a core that "generates" the token ids of ``FILLER`` (one per
  step, up to ``max_tokens``), so valid requests are answered quickly (or over ``core``);
- ``served(engines, policy, tokenizer)``: over a real ``LocalRuntime`` (its core, its
  replicas as the peer view), with the official ``openai`` client over ASGI and, with
  ``socket=True``, the app served by uvicorn on a free port (tests/net.py ``serve_asgi``);
- ``run_served_flow``: ``served`` over the tiny small + large models, checked idle after.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from tokenrouter_ray.config import AppConfig
from tokenrouter_ray.ingress.core import RequestResult
from tokenrouter_ray.ingress.http_app import build_app
from tokenrouter_ray.ingress.openai_server import IngressServer
from tokenrouter_ray.metrics import Metrics
from tokenrouter_ray.openai.generation_defaults import GenerationDefaults
from tokenrouter_ray.protocol import CommitLog, MsgKind, PeerReq, encode_batch

if TYPE_CHECKING:
    import httpx
    import openai

    from tokenrouter_ray.local import LocalRuntime
    from tokenrouter_ray.openai.validation import RequestLimits

SERVED = "tokenrouter"
MAX_MODEL_LEN = 64
FILLER = " the quick brown fox jumps over the lazy dog" * 4


class FakeCore:
    """What the ingress uses of `IngressCore`: submit, stream, abort, release."""

    def __init__(self, filler_ids: list[int]) -> None:
        self.filler = filler_ids
        self.live: dict[str, tuple[list[int], Any]] = {}
        self.submitted = 0
        self.tokens_received = self.frames_received = self.orphans_aborted = 0

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    @property
    def num_active(self) -> int:
        return len(self.live)

    async def submit(self, rid: str, prompt: list[int], spec: Any, entry: str, **_: Any) -> None:
        # what the real core sends: the NEW message must encode (msgpack ints are 64-bit)
        new = PeerReq(rid, "ingress", entry, MsgKind.NEW, 0, tokens=list(prompt), sampling=spec)
        encode_batch([new])
        self.live[rid] = (prompt, spec)
        self.submitted += 1

    async def stream(self, rid: str, each_chunk: bool = True) -> AsyncIterator[list[int]]:
        _, spec = self.live[rid]
        tokens = [self.filler[i % len(self.filler)] for i in range(spec.max_tokens)]
        if not each_chunk:  # the real core's: everything at the end, as one list
            yield tokens
            return
        for token in tokens:
            yield [token]

    def abort_nowait(self, rid: str, reason: str | None = None) -> None:
        pass

    def commit_log(self, rid: str) -> CommitLog:
        """No writers or token reports here: traces name no model, logprobs are null."""
        return CommitLog(len(self.live[rid][0]))

    def release(self, rid: str) -> RequestResult:
        prompt, _ = self.live.pop(rid)
        return RequestResult(rid, len(prompt), finish_reason="length", counts={"small": 1})


class FakePeers:
    """A peer view (``ingress/openai_server.py PeerView``) with one replica per model."""

    def __init__(self) -> None:
        self.refreshing = True
        self.by_model = {"small": ["small#0"], "large": ["large#0"]}

    def missing(self) -> list[str]:
        return [m for m, names in self.by_model.items() if not names]

    def all(self) -> list[str]:
        return [e for names in self.by_model.values() for e in names]

    def exclude(self, endpoint: str) -> None:
        for names in self.by_model.values():
            if endpoint in names:
                names.remove(endpoint)

    async def start(self, wait_for_all: bool = True) -> None:
        pass

    async def stop(self) -> None:
        pass


class RuntimePeers(FakePeers):
    """The peer view of a ``LocalRuntime``: its replicas (``runtime.replicas``, live)."""

    def __init__(self, runtime: LocalRuntime) -> None:
        self.refreshing = True
        self.by_model = runtime.replicas


class FakeChannel:
    """A peer channel that is never used to send (the fake core does not)."""

    bytes_sent = 0
    closed = False

    def forget_peer(self, name: str) -> None:
        pass

    async def close(self) -> None:
        self.closed = True


def fake_config(
    tuner: dict[str, Any] | None = None,
    models: Sequence[str] | dict[str, Any] = ("small", "large"),
    **ingress: Any,
) -> AppConfig:
    """Real (not simulated) models (``models``: names, or name -> spec); no
    generation_config.json is read."""
    specs = models if isinstance(models, dict) else {name: {"path": name} for name in models}
    return AppConfig.model_validate({
        "served_model_name": SERVED,
        "models": specs,
        "policy": {"name": "bernoulli", "options": {"p": 0.5}},
        "ingress": {"generation_config": "none", **ingress},
        "tuner": tuner or {},
    })  # fmt: skip


def fake_ingress(
    tokenizer: Any,
    *,
    core: Any = None,
    peers: Any = None,
    channel: Any = None,
    cfg: AppConfig | None = None,
    infos: Sequence[Any] | None = None,
    **kwargs: Any,
) -> IngressServer:
    """A real ``IngressServer`` over the fakes, or over the parts given (``kwargs``: its
    other keyword arguments)."""
    info = SimpleNamespace(max_model_len=MAX_MODEL_LEN, vocab_size=len(tokenizer))
    cfg = cfg if cfg is not None else fake_config()
    if core is None:
        core = FakeCore(list(tokenizer.encode(FILLER, add_special_tokens=False)))
    return IngressServer(
        cfg,
        channel if channel is not None else FakeChannel(),  # type: ignore[arg-type]
        peers if peers is not None else FakePeers(),
        tokenizer,
        infos if infos is not None else [info] * len(cfg.models),
        metrics=kwargs.pop("metrics", Metrics.noop()),
        generation_defaults=kwargs.pop("generation_defaults", GenerationDefaults()),
        core=core,
        **kwargs,
    )


def ingress_app(tokenizer: Any, core: Any = None, **ingress: Any) -> tuple[Any, IngressServer]:
    """``(app, ingress)``: the ingress's FastAPI app over a Ray-less ``IngressServer``
    (over ``core``, else the fake core; ``ingress``: config overrides)."""
    server = fake_ingress(tokenizer, core=core, cfg=fake_config(**ingress))
    return build_app(server), server


@dataclass
class Served:
    """What ``served`` yields: the runtime, the ingress over it, its app (``asgi``: what
    is served, the app or what ``wrap`` put around it), an ``httpx`` client and the
    ``openai`` client over ASGI, and the port when served on a socket."""

    runtime: LocalRuntime
    ingress: IngressServer
    app: Any
    asgi: Any
    http: httpx.AsyncClient
    client: openai.AsyncOpenAI
    port: int | None = None

    @property
    def url(self) -> str:
        """The socket's OpenAI base URL (``socket=True``)."""
        return f"http://127.0.0.1:{self.port}/v1"

    async def idle(self) -> None:
        """Wait until the runtime is idle; check nothing is left anywhere (no request at
        the ingress or on a model, every KV block free, no entry load)."""
        rt = self.runtime
        await rt.wait_idle()
        assert rt.ingress.num_active == 0 and not any(self.ingress.entry_load.values())
        assert all(s.engine.kv.pool.num_free_blocks == s.engine.kv.pool.num_blocks
                   for s in rt.model_replicas)  # fmt: skip
        assert all(not s.engine.requests for s in rt.model_replicas)


@contextlib.asynccontextmanager
async def served(
    engines: Sequence[tuple[str, Any]],
    policy: Any,
    tokenizer: Any,
    *,
    limits: RequestLimits | None = None,
    socket: bool = False,
    wrap: Callable[[Any], Any] | None = None,
    send_buffer: int | None = None,
    log_level: str = "critical",
    **ingress: Any,
) -> AsyncIterator[Served]:
    """A ``LocalRuntime`` of ``engines`` routed by ``policy``, the ingress over it (its
    config: the runtime's models and ``ingress`` overrides; ``limits``: the request limits
    instead of the config's), and its app: over ASGI, and with ``socket`` served on a free
    port (``send_buffer``: the listener's SO_SNDBUF; ``wrap``: an ASGI app around it)."""
    import httpx
    import openai

    from tests.net import serve_asgi
    from tokenrouter_ray.local import LocalRuntime

    async with LocalRuntime(engines, policy) as runtime:
        core = runtime.ingress
        server = fake_ingress(
            tokenizer,
            core=core,
            peers=RuntimePeers(runtime),
            channel=core.channel,
            cfg=fake_config(models=runtime.models, **ingress),
        )
        if limits is not None:
            server.limits = limits
        app = build_app(server)
        outer = wrap(app) if wrap is not None else app
        transport = httpx.ASGITransport(app=outer, raise_app_exceptions=False)  # as Serve
        async with contextlib.AsyncExitStack() as stack:
            http = await stack.enter_async_context(
                httpx.AsyncClient(transport=transport, base_url="http://in")
            )
            client = openai.AsyncOpenAI(
                base_url="http://in/v1", api_key="none", http_client=http, max_retries=0
            )
            port = None
            if socket:
                port = await stack.enter_async_context(
                    serve_asgi(outer, send_buffer=send_buffer, log_level=log_level)
                )
            yield Served(runtime, server, app, outer, http, client, port)


def run_served_flow(
    dirs: dict[str, str], policy: tuple[str, dict], body: Any, **ingress: Any
) -> Any:
    """``await body(client, runtime, http)`` against the app over a real ``LocalRuntime``
    of the tiny small + large models with ``policy`` (the official ``openai`` client over
    ASGI, no Ray; ``ingress``: config overrides); checks nothing is left anywhere
    afterwards (no request at the ingress or on a model, every KV block free)."""
    from transformers import AutoTokenizer

    from tests.tiny_models import chain_engines
    from tokenrouter_ray.openai.validation import RequestLimits
    from tokenrouter_ray.routing.policy import build_policy

    models = ["small", "large"]
    tokenizer = AutoTokenizer.from_pretrained(dirs["small"])
    limits = RequestLimits(max_model_len=256, vocab_size=128)

    async def go() -> Any:
        engines, routing = chain_engines(dirs, models), build_policy(*policy, models)
        async with served(engines, routing, tokenizer, limits=limits, **ingress) as s:
            result = await body(s.client, s.runtime, s.http)
            await s.idle()
            return result

    return asyncio.run(go())
