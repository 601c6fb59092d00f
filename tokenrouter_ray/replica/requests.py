"""What one model replica knows of its requests, and how a message changes it: ``Requests``.

It keeps the per-request routing state (``tracked``: ``replica/tracking.py``), the ledger that
drops stale and duplicate messages, the global active count N (``active_count.py``) and the
messages held while the step that computes their request runs. Messages enter through
``apply_inbox`` (NEW / HANDOFF / FINISHED / ABORT / ACTIVE, drained from the mailbox's inbox)
and change the engine and ``tracked``; requests leave through ``finish`` (KV freed, FINISHED
to the ingress and every other holder, built by ``replica/messages.py``). Every method runs
on the step thread (``replica/step.py``): no lock.

A message that cannot be applied ends its request with ``finish_reason="error"``, counted
in ``tokenrouter_errors_total{type}``; the other requests are unaffected
(docs/user-guide/reliability.md).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Container
from typing import TYPE_CHECKING

from tokenrouter_ray.metrics import Metrics
from tokenrouter_ray.protocol import MsgKind, PeerReq, RequestLedger, RouteState
from tokenrouter_ray.replica.active_count import INGRESS_SILENCE_S, ActiveCount
from tokenrouter_ray.replica.messages import Messages
from tokenrouter_ray.replica.profile import HostProfile
from tokenrouter_ray.replica.tracking import Tracked
from tokenrouter_ray.replica.window import WindowStats
from tokenrouter_ray.routing.policy import Policy, RequestView
from tokenrouter_ray.transport.base import endpoint_model

if TYPE_CHECKING:
    from tokenrouter_ray.engine.engine import Engine
    from tokenrouter_ray.replica.window import WindowStats

logger = logging.getLogger(__name__)

SWEEP_PERIOD_S = 1.0
PREFILL_SUFFIX = "~prefill"  # the engine's id of a request's admission prefill (its own)
EXPIRY_GRACE_S = 10.0  # past a request's deadline, before a model frees it on its own


class Requests:
    def __init__(
        self,
        name: str,
        index: int,
        endpoint: str,
        engine: Engine,
        policy: Policy,
        messages: Messages,
        metrics: Metrics,
        profile: HostProfile,
        stats: WindowStats,
    ) -> None:
        self.name, self.index, self.endpoint = name, index, endpoint
        self.engine, self.policy, self.messages = engine, policy, messages
        self.metrics, self.profile = metrics, profile
        self.stats = stats  # the tuner's window: arrivals, finishes, each handoff's transit
        self.tracked: dict[str, Tracked] = {}
        self.ledger = RequestLedger()
        self.active = ActiveCount(INGRESS_SILENCE_S)  # global N, from every ingress's count
        # messages for requests in the running step, held until it is committed
        self.held: deque[PeerReq] = deque()
        self.unqueued: dict[str, float] = {}  # rid -> NEW's sent_at (s), until first computed
        self.next_sweep = 0.0  # monotonic time of the next expired-request sweep

    # ------------------------------------------------------------------- applying
    def apply_held(self, out: list[PeerReq]) -> None:
        """The messages held while the last step ran (counted when they arrived)."""
        while self.held:
            self.apply_one(self.held.popleft(), out)

    def apply_inbox(
        self, inbox: deque[PeerReq], out: list[PeerReq], hold: Container[str] = ()
    ) -> None:
        """Drain ``inbox``: active counts taken, messages applied, except those for the
        requests in ``hold`` (the running step's), kept in ``held``."""
        counted = False
        while inbox:
            msg = inbox.popleft()
            if msg.active_requests is not None:  # from an ingress, 0 included
                self.active.update(msg.src, msg.active_requests)
                counted = True
            if msg.kind == MsgKind.ACTIVE:
                continue
            if msg.rid in hold:
                self.held.append(msg)
            else:
                self.apply_one(msg, out)
        if counted:
            self.update_active()

    def apply_one(self, msg: PeerReq, out: list[PeerReq]) -> None:
        """One message, unless stale; a failure is contained to its request."""
        profile = self.profile
        after_s = max(0, time.time_ns() - msg.sent_at) / 1e9
        profile.note_applied(after_s)
        if msg.kind == MsgKind.HANDOFF:
            self.stats.record_transit(endpoint_model(msg.src), self.name, after_s)
        if msg.kind == MsgKind.PREFILL:  # no request state: outside the ledger
            self._prefill(msg)
            return
        if not self.ledger.accept(msg):
            return
        try:
            self._apply(msg, out)
        except Exception as exc:  # contained to this message's request
            logger.warning("%s: dropping %s for %s: %s", self.name, msg.kind.name, msg.rid, exc)
            self.metrics.error(self.name, "bad_message")
            try:
                self._fail(msg, str(exc), out)
            except Exception:
                logger.exception("%s: could not fail %s", self.name, msg.rid)

    def _apply(self, msg: PeerReq, out: list[PeerReq]) -> None:
        rid = msg.rid
        if msg.kind.is_terminal:
            self.engine.abort(rid)
            self.tracked.pop(rid, None)
            return
        if msg.kind == MsgKind.NEW:
            if msg.sampling is None:
                raise ValueError("NEW without sampling parameters")
            # A re-created request (the ingress lost a replica) carries its committed output
            # after the prompt, the prompt's length, its counts and the replicas to use.
            route = msg.route or RouteState(ingress=msg.src, prompt_len=len(msg.tokens))
            tracked = Tracked.from_route(rid, route, msg.sampling, msg.handoff_seq)
            tracked.endpoints[self.name] = self.endpoint
            self.engine.add_request(
                rid, msg.tokens, msg.sampling, num_prompt_tokens=route.prompt_len
            )
            self.tracked[rid] = tracked
            self.unqueued[rid] = msg.sent_at / 1e9
            fresh = len(msg.tokens) == route.prompt_len and not route.counts
            if fresh:  # a new request, not a re-created one
                self.stats.record_arrival(route.prompt_len)
            return
        if msg.kind != MsgKind.HANDOFF:
            return
        if msg.route is None:
            raise ValueError("HANDOFF without route state")
        tracked = self.tracked.get(rid)
        if tracked is None:
            if msg.sampling is None:
                raise ValueError("first visit without sampling parameters")
            tracked = self.tracked[rid] = Tracked.from_route(
                rid, msg.route, msg.sampling, msg.handoff_seq
            )
        else:
            tracked.adopt(msg.route, msg.handoff_seq)
            tracked.owned_by(self.name)
        view = RequestView(rid, self.index, msg.anchor + len(msg.tokens), tracked.policy_state)
        tokens = self.policy.receive(view, list(msg.tokens), dict(msg.extras))
        if self.engine.holds(rid):
            self.engine.resume(rid, tokens, anchor=msg.anchor)
        elif msg.anchor == 0:
            self.engine.add_request(
                rid, tokens, tracked.sampling, num_prompt_tokens=tracked.prompt_len
            )
        else:
            raise ValueError(f"extend at {msg.anchor} but this replica holds no state")
        if not self.engine.holds(rid):  # the extend reached the context limit
            self.finish(tracked, "length", out)

    def _prefill(self, msg: PeerReq) -> None:
        """A prompt to prefill for a request's first handoff here (``Engine.prefill``): its
        KV waits in the prefix cache. Best effort: one that cannot run (the prompt too long,
        the request already here) is only counted; the handoff then prefills as usual."""
        if self.engine.holds(msg.rid):
            return
        try:
            self.engine.prefill(msg.rid + PREFILL_SUFFIX, msg.tokens, msg.sampling)
        except ValueError as exc:
            logger.info("%s: no prefill for %s: %s", self.name, msg.rid, exc)
            self.metrics.error(self.name, "prefill_refused")

    # ------------------------------------------------------------------ global N
    def update_active(self) -> None:
        """The engine's deferred launches follow N; None until some ingress has spoken."""
        self.engine.set_active_requests(self.active.total if self.active.known else None)

    def _forget_silent_ingresses(self, out: list[PeerReq]) -> None:
        """An ingress silent for ``INGRESS_SILENCE_S`` is gone (its replica died): its
        count no longer holds launches back, and its requests, which nobody will read, are
        ended here and on every other model that holds them (not generated to their
        length limit)."""
        silent = self.active.forget_silent()
        for src in silent:
            logger.warning("%s: no active count from %s for %.0f s", self.name, src,
                           self.active.silence_s)  # fmt: skip
        if silent:
            self.update_active()
            for tracked in [t for t in self.tracked.values() if t.ingress in silent]:
                self.metrics.error(self.name, "orphaned")
                self.finish(tracked, "error", out, error="its ingress is gone")

    def sweep_expired(self, out: list[PeerReq]) -> None:
        """End requests held past their deadline plus ``EXPIRY_GRACE_S`` (their ingress
        normally aborts them at the deadline; this frees state whose ingress is gone), and
        those of silent ingresses; the step thread calls it when ``next_sweep`` is due."""
        self.next_sweep = time.monotonic() + SWEEP_PERIOD_S
        self._forget_silent_ingresses(out)
        cutoff = time.time() - EXPIRY_GRACE_S
        for tracked in [t for t in self.tracked.values() if t.deadline and t.deadline < cutoff]:
            self.metrics.error(self.name, "expired")
            self.finish(tracked, "error", out, error="deadline passed")

    # ------------------------------------------------------------------ ending
    def finish(
        self,
        tracked: Tracked,
        reason: str | None,
        out: list[PeerReq],
        error: str | None = None,
        lost_peer: str | None = None,
    ) -> None:
        """End ``tracked`` here: KV freed, FINISHED to the ingress and every other holder
        (``lost_peer``: the endpoint whose loss ended it, see ``undeliverable``)."""
        rid = tracked.rid
        self.tracked.pop(rid, None)
        self.ledger.finish(rid)
        self.engine.abort(rid)
        if error is None:
            self.stats.record_finish(sum(tracked.counts.values()))
        out += self.messages.finished(tracked, reason, error, lost_peer)

    def fail_request(self, rid: str, error: str, out: list[PeerReq]) -> None:
        """End ``rid`` with an error: reported where it is tracked, else only freed."""
        tracked = self.tracked.get(rid)
        if tracked is not None:
            self.finish(tracked, "error", out, error=error)
        else:
            self.engine.abort(rid)

    def fail_runnable(self, error: str) -> list[PeerReq]:
        """End every request that could have been in the failed step, with an error."""
        self.engine.discard_uncommitted()
        out: list[PeerReq] = []
        for rid in self.engine.request_ids(runnable_only=True):
            self.fail_request(rid, error, out)
        return out

    def undeliverable(self, undelivered: list[tuple[PeerReq, str]], out: list[PeerReq]) -> None:
        """Messages the mailbox could not send: a HANDOFF's request ends here with an error
        naming the peer (FINISHED to the ingress and the other holders; the ingress
        re-creates the request elsewhere if that peer has left); for a frame to the ingress,
        the request is only dropped here (nobody to report to)."""
        for msg, error in undelivered:
            tracked = self.tracked.get(msg.rid)
            if tracked is None or msg.kind.is_terminal:
                continue
            if msg.dst == tracked.ingress:
                self.tracked.pop(msg.rid, None)
                self.ledger.finish(msg.rid)
                self.engine.abort(msg.rid)
            else:
                self.finish(tracked, "error", out, error=error, lost_peer=msg.dst)

    def _fail(self, msg: PeerReq, error: str, out: list[PeerReq]) -> None:
        """A message this replica cannot serve ends its request with an error."""
        tracked = self.tracked.get(msg.rid)
        if tracked is None:
            if msg.kind != MsgKind.NEW:
                return
            tracked = Tracked(msg.rid, msg.src, len(msg.tokens), msg.sampling)
        self.finish(tracked, "error", out, error=error)
