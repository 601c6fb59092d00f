"""Per-request routing state a sub-server keeps, and how it travels as ``RouteState``.

The owner of a request (the model generating it now) holds the authoritative copy; it
travels with every HANDOFF (``PeerReq.route``) so the next owner knows every model's anchor
(which suffix to send it), which replica of each model holds the request, where commits go,
and the running per-model token counts. A NEW from the ingress carries one too (no anchors).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tokenrouter_ray.protocol import Anchors, Dropped, FinishSummary, RouteState, SamplingSpec


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

    @classmethod
    def from_route(cls, rid: str, route: RouteState, sampling: SamplingSpec, seq: int) -> Tracked:
        tracked = cls(rid, route.ingress, route.prompt_len, sampling)
        tracked.adopt(route, seq)
        return tracked

    def adopt(self, route: RouteState, seq: int) -> None:
        """Take the state the previous owner sent (its copy is authoritative)."""
        self.seq = seq
        self.anchors = Anchors(route.anchors)
        self.endpoints = dict(route.endpoints)
        self.counts = dict(route.counts)
        self.handoffs = route.handoffs
        self.deadline = route.deadline
        self.queue_s = route.queue_s
        self.pending_s = dict(route.pending_s)
        self.pending_since = dict(route.pending_since)
        self.peer_bytes = route.peer_bytes
        self.dropped = route.dropped
        self.drops = list(route.drops)

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
        return RouteState(
            ingress=self.ingress,
            prompt_len=self.prompt_len,
            anchors=self.anchors.as_dict(),
            endpoints=dict(self.endpoints),
            counts=dict(self.counts),
            handoffs=self.handoffs,
            deadline=self.deadline,
            queue_s=self.queue_s,
            pending_s=dict(self.pending_s),
            pending_since=dict(self.pending_since),
            peer_bytes=self.peer_bytes,
            dropped=self.dropped,
            drops=list(self.drops),
        )

    def summary(self, error: str | None = None, now: float | None = None) -> FinishSummary:
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
        )
