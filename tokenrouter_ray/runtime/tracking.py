"""Per-request routing state a sub-server keeps, and how it travels as ``RouteState``.

The owner of a request (the model generating it now) holds the authoritative copy; it
travels with every HANDOFF (``PeerReq.route``) so the next owner knows every model's anchor
(which suffix to send it), which replica of each model holds the request, where commits go,
and the running per-model token counts. A NEW from the ingress carries one too (no anchors).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenrouter_ray.protocol import Anchors, FinishSummary, RouteState, SamplingSpec


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

    def route_state(self) -> RouteState:
        return RouteState(
            ingress=self.ingress,
            prompt_len=self.prompt_len,
            anchors=self.anchors.as_dict(),
            endpoints=dict(self.endpoints),
            counts=dict(self.counts),
            handoffs=self.handoffs,
            deadline=self.deadline,
        )

    def summary(self, error: str | None = None) -> FinishSummary:
        return FinishSummary(counts=dict(self.counts), handoffs=self.handoffs, error=error)
