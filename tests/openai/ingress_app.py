"""The real ingress FastAPI app (ingress/http_app.py: routes, validation, error handlers,
API-key middleware) served in-process, without Ray, over a real ``IngressService`` built
with its public constructor from fakes: a peer view with one replica per model, a channel
that sends nothing, and a core that "generates" the token ids of ``FILLER`` (one per step,
up to ``max_tokens``), so valid requests are answered quickly."""

from __future__ import annotations

from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

from tokenrouter_ray.config import AppConfig
from tokenrouter_ray.ingress.core import RequestResult
from tokenrouter_ray.ingress.http_app import build_app
from tokenrouter_ray.ingress.service import IngressService
from tokenrouter_ray.metrics import Metrics
from tokenrouter_ray.openai.generation_defaults import GenerationDefaults
from tokenrouter_ray.protocol import CommitLog, MsgKind, PeerReq, encode_batch

SERVED = "tokenrouter"
MAX_MODEL_LEN = 64
FILLER = " the quick brown fox jumps over the lazy dog" * 4


class FakeCore:
    """What the routes and the service use of `IngressCore`: submit, stream, abort, release."""

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
    """A peer view (``ingress/service.py PeerView``) with one replica per model."""

    def __init__(self) -> None:
        self.refreshing = True
        self.by_model = {"small": ["small#0"], "large": ["large#0"]}

    def missing(self) -> list[str]:
        return [m for m, names in self.by_model.items() if not names]

    def all(self) -> list[str]:
        return [e for names in self.by_model.values() for e in names]

    async def start(self, wait_for_all: bool = True) -> None:
        pass

    async def stop(self) -> None:
        pass


class FakeChannel:
    """A peer channel that is never used to send (the fake core does not)."""

    bytes_sent = 0
    closed = False

    def forget_peer(self, name: str) -> None:
        pass

    async def close(self) -> None:
        self.closed = True


def fake_config(tuner: dict[str, Any] | None = None, **ingress: Any) -> AppConfig:
    """Two real (not simulated) models; no generation_config.json is read."""
    return AppConfig.model_validate({
        "served_model_name": SERVED,
        "models": {"small": {"path": "small"}, "large": {"path": "large"}},
        "policy": {"name": "bernoulli", "options": {"p": 0.5}},
        "ingress": {"generation_config": "none", **ingress},
        "tuner": tuner or {},
    })  # fmt: skip


def ingress_service(tokenizer: Any, **ingress: Any) -> IngressService:
    """A real ``IngressService`` over the fakes (``ingress``: config overrides)."""
    info = SimpleNamespace(max_model_len=MAX_MODEL_LEN, vocab_size=len(tokenizer))
    return IngressService(
        fake_config(**ingress),
        FakeChannel(),  # type: ignore[arg-type]
        FakePeers(),
        tokenizer,
        [info, info],
        metrics=Metrics.noop(),
        generation_defaults=GenerationDefaults(),
        core=FakeCore(list(tokenizer.encode(FILLER, add_special_tokens=False))),  # type: ignore[arg-type]
    )


def ingress_app(tokenizer: Any, **ingress: Any) -> tuple[Any, IngressService]:
    """``(app, service)``: the ingress's FastAPI app over a Ray-less service (``ingress``:
    config overrides)."""
    service = ingress_service(tokenizer, **ingress)
    return build_app(service), service


def run_served_flow(
    dirs: dict[str, str], policy: tuple[str, dict], body: Any, **ingress: Any
) -> Any:
    """``await body(client, runtime, http)`` against this app over a real ``LocalRuntime``
    of the tiny small + large models with ``policy`` (the official ``openai`` client over
    ASGI, no Ray; ``ingress``: config overrides); checks nothing is left anywhere
    afterwards (no request at the ingress or on a model, every KV block free)."""
    import asyncio

    import httpx
    import openai
    from transformers import AutoTokenizer

    from tests.tiny_models import chain_engines
    from tokenrouter_ray.ingress.openai_server import IngressServer
    from tokenrouter_ray.local import LocalRuntime
    from tokenrouter_ray.openai.validation import RequestLimits
    from tokenrouter_ray.routing.policy import build_policy

    models = ["small", "large"]
    tokenizer = AutoTokenizer.from_pretrained(dirs["small"])
    app, ingress = ingress_app(tokenizer, **ingress)
    ingress.limits = RequestLimits(max_model_len=256, vocab_size=128)

    async def go() -> Any:
        async with LocalRuntime(chain_engines(dirs, models), build_policy(*policy, models)) as rt:
            entry = [rt.model_replicas[0].endpoint]
            server = IngressServer(rt.ingress, tokenizer, SERVED, lambda: entry, models=models)
            ingress.core, ingress.server = rt.ingress, server
            transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://in") as http:
                client = openai.AsyncOpenAI(
                    base_url="http://in/v1", api_key="none", http_client=http, max_retries=0
                )
                result = await body(client, rt, http)
            await rt.wait_idle()
            assert rt.ingress.num_active == 0
            assert all(s.engine.kv.pool.num_free_blocks == s.engine.kv.pool.num_blocks
                       for s in rt.model_replicas)  # fmt: skip
            return result

    try:
        return asyncio.run(go())
    finally:
        app.dependency_overrides.clear()
