"""Per-request routing state a sub-server keeps, and how it rides on ``PeerReq.extras``.

The owner of a request (the model generating it now) holds the authoritative copy; it
travels with every HANDOFF so the next owner knows every model's anchor (which suffix to
send it), which replica of each model holds the request, where commits go, and the running
per-model token counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenrouter_ray.engine.request import SamplingParams
from tokenrouter_ray.protocol import SamplingSpec


@dataclass
class Tracked:
    rid: str
    ingress: str  # endpoint that receives COMMIT / FINISHED
    prompt_len: int
    sampling: SamplingSpec
    seq: int = 0  # handoff_seq of the latest message acted on or sent
    anchors: dict[str, int] = field(default_factory=dict)  # model -> tokens it holds
    endpoints: dict[str, str] = field(default_factory=dict)  # model -> endpoint holding it
    counts: dict[str, int] = field(default_factory=dict)  # model -> committed output tokens
    handoffs: int = 0
    policy_state: dict[str, Any] = field(default_factory=dict)
    deadline: float | None = None  # wall clock (time.time()) past which nobody waits for it

    def to_extras(self, policy_extras: dict[str, Any] | None = None) -> dict[str, Any]:
        return {
            "ingress": self.ingress,
            "prompt_len": self.prompt_len,
            "anchors": dict(self.anchors),
            "endpoints": dict(self.endpoints),
            "counts": dict(self.counts),
            "handoffs": self.handoffs,
            "deadline": self.deadline,
            "policy": policy_extras or {},
        }

    def update_from(self, extras: dict[str, Any], seq: int) -> None:
        self.seq = seq
        self.anchors = dict(extras["anchors"])
        self.endpoints = dict(extras["endpoints"])
        self.counts = dict(extras["counts"])
        self.handoffs = int(extras["handoffs"])
        self.deadline = extras.get("deadline")

    @classmethod
    def from_handoff(
        cls, rid: str, extras: dict[str, Any], sampling: SamplingSpec, seq: int
    ) -> Tracked:
        tracked = cls(rid, extras["ingress"], int(extras["prompt_len"]), sampling)
        tracked.update_from(extras, seq)
        return tracked


def engine_sampling(spec: SamplingSpec) -> SamplingParams:
    """The engine's sampling parameters from the wire spec (seed always resolved)."""
    return SamplingParams(
        temperature=spec.temperature,
        top_p=spec.top_p,
        top_k=spec.top_k,
        max_tokens=spec.max_tokens,
        seed=spec.seed,
        stop_token_ids=tuple(spec.stop_token_ids),
        ignore_eos=spec.ignore_eos,
    )
