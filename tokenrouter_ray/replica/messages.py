"""The messages one model replica puts on the wire for its requests.

``Messages`` builds every ``PeerReq`` a model replica sends about a request it holds: the
HANDOFF to the next model (carrying only the suffix that model has not seen, the sampling
parameters on its first visit there, and the request's route state), COMMIT and FINISHED to
the request's ingress, and FINISHED to every other model holding it. It reads and advances
the request's ``Tracked`` record (anchors, handoff sequence, the replica chosen for each
model) but never touches the engine: the model replica decides, this module writes it down.
The handoffs it built are kept in ``log`` (tests, benchmarks).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import NamedTuple

from tokenrouter_ray.engine.outputs import StepResult
from tokenrouter_ray.metrics import Metrics
from tokenrouter_ray.protocol import FinishSummary, MsgKind, PeerReq, TokenInfo, with_own_size
from tokenrouter_ray.replica.tracking import Tracked


class HandoffRecord(NamedTuple):
    """What one handoff put on the wire (for tests, metrics and benchmarks). A named tuple:
    built once per handoff on the step thread, where it is several times cheaper to build
    than a frozen dataclass."""

    rid: str
    seq: int  # handoff_seq of the message
    src: str
    dst: str
    anchor: int  # where the suffix starts: what dst already held
    end: int  # sequence length at the handoff
    num_tokens: int  # suffix length actually sent
    first_visit: bool


class Messages:
    """The message builder of one model replica (``name``, reachable at ``endpoint``)."""

    def __init__(
        self,
        models: list[str],
        name: str,
        endpoint: str,
        pick_endpoint: Callable[[str, str], str],
        metrics: Metrics,
    ) -> None:
        self.models = models
        self.name = name
        self.endpoint = endpoint
        self.pick_endpoint = pick_endpoint  # (model, request id) -> endpoint, first visit
        self.metrics = metrics
        self.log: deque[HandoffRecord] = deque(maxlen=100_000)
        # model -> suffix lengths of the handoffs built since `record_handoffs`
        self._sizes: dict[str, list[int]] = {}

    def handoff(self, tracked: Tracked, sequence: Sequence[int], dst: int, extras: dict) -> PeerReq:
        """HANDOFF of ``tracked`` (paused here with its KV) to model ``dst``."""
        model = self.models[dst]
        first_visit = not tracked.anchors.visited(model)
        anchor, suffix = tracked.anchors.suffix_for(model, sequence)
        tracked.anchors.advance(self.name, len(sequence))  # both now hold the whole sequence
        tracked.anchors.advance(model, len(sequence))
        endpoint = tracked.endpoints.get(model) or self.pick_endpoint(model, tracked.rid)
        tracked.endpoints[model] = endpoint
        tracked.handoffs += 1
        tracked.seq += 1
        tracked.went_pending(self.name)
        self._sizes.setdefault(model, []).append(len(suffix))
        self.log.append(
            HandoffRecord(
                tracked.rid,
                tracked.seq,
                self.name,
                model,
                anchor,
                len(sequence),
                len(suffix),
                first_visit,
            )
        )
        msg = with_own_size(  # peer_bytes counts this message too
            PeerReq(
                rid=tracked.rid,
                src=self.endpoint,
                dst=endpoint,
                kind=MsgKind.HANDOFF,
                handoff_seq=tracked.seq,
                tokens=suffix,
                anchor=anchor,
                committed=max(0, len(sequence) - max(anchor, tracked.prompt_len)),
                sampling=tracked.sampling if first_visit else None,
                route=tracked.route_state(),
                extras=extras,
            )
        )
        tracked.peer_bytes = msg.route.peer_bytes
        tracked.drops = []  # they travel with the route now
        return msg

    def record_handoffs(self) -> None:
        """The handoffs built since the last call into the metrics: a count per destination
        (one counter call a step, not one a handoff) and each suffix length."""
        if self._sizes:
            sizes, self._sizes = self._sizes, {}
            for model, lengths in sizes.items():
                self.metrics.handoffs(self.name, model, lengths)

    def to_ingress(
        self,
        tracked: Tracked,
        kind: MsgKind,
        tokens: list[int],
        anchor: int,
        reason: str | None = None,
        summary: FinishSummary | None = None,
        token_info: list[TokenInfo] | None = None,
    ) -> PeerReq:
        """COMMIT (``tokens`` at ``anchor``) or FINISHED to the request's ingress."""
        return PeerReq(
            rid=tracked.rid,
            src=self.endpoint,
            dst=tracked.ingress,
            kind=kind,
            handoff_seq=tracked.seq,
            tokens=tokens,
            anchor=anchor,
            committed=len(tokens),
            finish_reason=reason,
            summary=summary,
            token_info=token_info or [],
        )

    def finished(
        self,
        tracked: Tracked,
        reason: str | None,
        error: str | None = None,
        lost_peer: str | None = None,
    ) -> list[PeerReq]:
        """FINISHED to the ingress (with the final counts) and to every other holder."""
        total = tracked.prompt_len + sum(tracked.counts.values())
        summary = tracked.summary(error, lost_peer=lost_peer)
        out = [self.to_ingress(tracked, MsgKind.FINISHED, [], total, reason, summary)]
        for model, endpoint in tracked.endpoints.items():
            if model != self.name:
                out.append(
                    PeerReq(
                        rid=tracked.rid,
                        src=self.endpoint,
                        dst=endpoint,
                        kind=MsgKind.FINISHED,
                        handoff_seq=tracked.seq + 1,
                        finish_reason=reason,
                    )
                )
        return out

    @staticmethod
    def token_info(
        tracked: Tracked, result: StepResult, row: int, scores: list[float | None] | None
    ) -> TokenInfo:
        """The report on the token a row committed (what the request asked for)."""
        score, dropped = None, []
        if tracked.sampling.trace:
            score = scores[row] if scores is not None else None
            dropped, tracked.drops = tracked.drops, []
        lp = result.logprobs[row] if result.logprobs is not None else None
        if lp is None:
            return TokenInfo(score=score, dropped=dropped)
        return TokenInfo(score, lp[0], lp[1], lp[2], dropped)
