"""The real ingress FastAPI app (deployments/ingress.py: routes, validation, error handlers,
API-key middleware) served in-process, without Ray: the class-based routes get a bare
``Ingress`` instance whose peer channel is a stand-in that "generates" the token ids of
``FILLER`` (one per step, up to ``max_tokens``), so valid requests are answered quickly."""

from __future__ import annotations

from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

from tokenrouter_ray.openai.generation_defaults import GenerationDefaults
from tokenrouter_ray.openai.validation import RequestLimits
from tokenrouter_ray.protocol import CommitLog, MsgKind, PeerReq, encode_batch
from tokenrouter_ray.runtime.admission import AdmissionQueue
from tokenrouter_ray.runtime.ingress import Completion
from tokenrouter_ray.runtime.openai_server import IngressServer
from tokenrouter_ray.runtime.recovery import AdmissionCap, Recovery

SERVED = "tokenrouter"
MAX_MODEL_LEN = 64
FILLER = " the quick brown fox jumps over the lazy dog" * 4


class FakeCore:
    """What the routes use of `IngressCore`: submit, stream, abort, release."""

    def __init__(self, filler_ids: list[int]) -> None:
        self.filler = filler_ids
        self.live: dict[str, tuple[list[int], Any]] = {}
        self.submitted = 0

    @property
    def num_active(self) -> int:
        return len(self.live)

    async def submit(self, rid: str, prompt: list[int], spec: Any, entry: str, **_: Any) -> None:
        # what the real core sends: the NEW message must encode (msgpack ints are 64-bit)
        new = PeerReq(rid, "ingress", entry, MsgKind.NEW, 0, tokens=list(prompt), sampling=spec)
        encode_batch([new])
        self.live[rid] = (prompt, spec)
        self.submitted += 1

    async def stream(self, rid: str) -> AsyncIterator[list[int]]:
        _, spec = self.live[rid]
        for i in range(spec.max_tokens):
            yield [self.filler[i % len(self.filler)]]

    def abort_nowait(self, rid: str, reason: str | None = None) -> None:
        pass

    def commit_log(self, rid: str) -> CommitLog:
        """No writers or token reports here: traces name no model, logprobs are null."""
        return CommitLog(len(self.live[rid][0]))

    def release(self, rid: str) -> Completion:
        prompt, _ = self.live.pop(rid)
        return Completion(rid, len(prompt), finish_reason="length", counts={"small": 1})


class FakePeers:
    def __init__(self) -> None:
        self.refreshing = True
        self.by_model = {"small": ["small#0"], "large": ["large#0"]}

    def missing(self) -> list[str]:
        return []

    def sticky(self, model: str, rid: str) -> str:
        return self.by_model[model][0]


def ingress_app(tokenizer: Any) -> tuple[Any, Any]:
    """``(app, instance)``: the ingress's FastAPI app bound to a Ray-less instance."""
    from deployments.ingress import Ingress, app

    cls = Ingress.func_or_class
    obj = object.__new__(cls)
    obj.cfg = SimpleNamespace(
        served_model_name=SERVED,
        model_names=["small", "large"],
        ingress=SimpleNamespace(max_active_requests=256, num_replicas=1),
    )
    obj.tuner = None
    obj.cap = AdmissionCap(256)
    obj.tokenizer = tokenizer
    obj.limits = RequestLimits(max_model_len=MAX_MODEL_LEN, vocab_size=len(tokenizer))
    obj.generation_defaults = GenerationDefaults()
    obj.max_body_bytes = 8 << 20  # issue 26: the route's body limit and admission queue
    obj.admission = AdmissionQueue(max_waiting=32, max_wait_s=1.0)
    obj.core = FakeCore(list(tokenizer.encode(FILLER, add_special_tokens=False)))
    obj.peers = FakePeers()
    obj.models = {}
    obj.timeout_s = 600.0
    obj.recovery = Recovery(obj.core, obj.peers.missing, lambda rid: {}, timeout_s=600.0)
    obj.server = IngressServer(
        obj.core, tokenizer, SERVED, entries=lambda: obj.peers.by_model["small"]
    )
    obj._slo = None
    for dep in _self_dependencies(app):
        app.dependency_overrides[dep] = lambda: obj
    return app, obj


def _self_dependencies(app: Any) -> set[Any]:
    """Serve's injected ``self=Depends(...)`` of the class-based routes."""
    import inspect

    from ray.serve._private.http_util import _walk_fastapi_routes

    found = set()
    for route, _, _ in _walk_fastapi_routes(app):
        if getattr(route.endpoint, "_serve_cls", None) is None:
            continue
        self_param = next(iter(inspect.signature(route.endpoint).parameters.values()))
        found.add(self_param.default.dependency)
    assert found, "no class-based routes found on the ingress app"
    return found
