"""Per-request routing state a model replica keeps, and how it travels as ``RouteState``.

``Tracked`` has every field of ``RouteState`` under the same name (and a test checks it), so
the two conversions below are written once, by field name. The owner of a request (the
model generating it now) holds the authoritative copy; it
travels with every HANDOFF (``PeerReq.route``) so the next owner knows every model's anchor
(which suffix to send it), which replica of each model holds the request, where commits go,
and the running per-model token counts. A NEW from the ingress carries one too (no anchors).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from typing import Any

from tokenrouter_ray.protocol import Anchors, Dropped, FinishSummary, RouteState, SamplingSpec

_ROUTE_FIELDS = RouteState.__struct_fields__  # Tracked has each, under the same name
_ADOPTED = tuple(f for f in _ROUTE_FIELDS if f not in ("ingress", "prompt_len", "anchors"))


@dataclass
class Tracked:
    rid: str
    ingress: str  # endpoint that receives COMMIT / FINISHED
    prompt_len: int
    sampling: SamplingSpec
    seq: int = 0  # handoff_seq of the latest message acted on or sent
    anchors: Anchors = field(default_factory=Anchors)  # model -> tokens it holds in KV
    endpoints: dict[str, str] = field(default_factory=dict)  # model -> endpoint holding it
    counts: dict[str, int] = field(default_factory=dict)  # model -> committed output tokens
    handoffs: int = 0
    policy_state: dict[str, Any] = field(default_factory=dict)
    deadline: float | None = None  # wall clock (time.time()) past which nobody waits for it
    # per-request metrics (RouteState), wall-clock seconds
    queue_s: float | None = None
    pending_s: dict[str, float] = field(default_factory=dict)
    pending_since: dict[str, float] = field(default_factory=dict)
    peer_bytes: int = 0
    dropped: int = 0
    drops: list[Dropped] = field(default_factory=list)  # at the next position (traced)
    cached_tokens: int | None = None  # prompt tokens the entry model found in its cache
    alone: str | None = None  # the model serving it alone (bypass): never routed elsewhere
    max_share: float | None = None  # cap on the top model's share of the output
    thresholds: tuple[float, ...] = ()  # its own decision threshold(s); (): the policy's

    @classmethod
    def from_route(cls, rid: str, route: RouteState, sampling: SamplingSpec, seq: int) -> Tracked:
        tracked = cls(rid, route.ingress, route.prompt_len, sampling)
        tracked.adopt(route, seq)
        return tracked

    def adopt(self, route: RouteState, seq: int) -> None:
        """Take the state the previous owner sent (its copy is authoritative)."""
        self.seq = seq
        _adopt_fields(self, route)
        self.anchors = Anchors(route.anchors)

    def owned_by(self, model: str, now: float | None = None) -> None:
        """``model`` owns the request again: the time it held it pending ends."""
        since = self.pending_since.pop(model, None)
        if since is not None:
            now = time.time() if now is None else now
            self.pending_s[model] = self.pending_s.get(model, 0.0) + max(0.0, now - since)

    def went_pending(self, model: str, now: float | None = None) -> None:
        """``model`` handed the request on and keeps its KV (the scheduler's PENDING)."""
        self.pending_since[model] = time.time() if now is None else now

    def route_state(self) -> RouteState:
        """The state that travels with a HANDOFF: every ``RouteState`` field, by name."""
        return _route_state(self)

    def summary(
        self, error: str | None = None, now: float | None = None, lost_peer: str | None = None
    ) -> FinishSummary:
        """The finish report: counts and the metrics, pending intervals still open (models
        holding the request while this one finishes it) closed at ``now``."""
        now = time.time() if now is None else now
        pending = dict(self.pending_s)
        for model, since in self.pending_since.items():
            pending[model] = pending.get(model, 0.0) + max(0.0, now - since)
        return FinishSummary(
            counts=dict(self.counts),
            handoffs=self.handoffs,
            error=error,
            queue_s=self.queue_s,
            pending_s=pending,
            peer_bytes=self.peer_bytes,
            dropped=self.dropped,
            cached_tokens=self.cached_tokens,
            lost_peer=lost_peer,
        )


def _converters() -> tuple[Any, Any]:
    """``Tracked`` -> ``RouteState`` and back, field by field under the same names, written
    out once here from the two classes' fields (a HANDOFF builds one per request: a
    generated function is several times faster than a loop over the names with
    ``getattr``). Containers are copied both ways: the message is encoded on the event loop while
    the step thread goes on changing its request's state."""
    copies = {
        f.name: f.default_factory.__name__
        for f in fields(Tracked)
        if f.default_factory in (dict, list)
    }

    def value(obj: str, name: str) -> str:
        kind = copies.get(name)
        return f"{kind}({obj}.{name})" if kind else f"{obj}.{name}"

    args = ", ".join(
        "t.anchors.as_dict()" if name == "anchors" else value("t", name) for name in _ROUTE_FIELDS
    )
    assigns = "\n".join(f"    t.{name} = {value('r', name)}" for name in _ADOPTED) or "    pass"
    source = f"def to_route(t):\n    return RouteState({args})\n\ndef adopt(t, r):\n{assigns}\n"
    namespace: dict[str, Any] = {"RouteState": RouteState}
    exec(compile(source, "<tracking converters>", "exec"), namespace)
    return namespace["to_route"], namespace["adopt"]


_route_state, _adopt_fields = _converters()
