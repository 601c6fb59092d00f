"""One model's autonomous sub-server: an engine, a routing policy and a peer channel.

This file holds what a model replica keeps between steps: the inbox and how each message is
applied, the per-request routing state (``tracked``), ending a request, and the two event-loop
tasks. The engine is stepped by its own thread, and the step itself (collect, route, commit,
launch the next step, then report the last one while the next forward runs) is in
``replica/step_loop.py``; the messages a step sends are built by ``replica/messages.py``.
The event loop keeps two tasks that never wait for another model:
- the receive task drains the channel into the inbox (NEW / HANDOFF / FINISHED / ABORT from
  the ingress and from peers) and wakes the step loop, which applies it between steps;
- the sender task sends what the step loop posts, in order, one frame per destination:
  HANDOFFs carrying only the suffix the receiver has not seen, COMMITs and FINISHEDs to the
  request's ingress.

Only the step loop's thread touches the engine and the per-request state (``tracked``), so
no lock is needed: what the event loop learns (a frame, a failed send) reaches that thread
through the inbox and the call queue. Neither loop dies on one request: an exception
applying a message, building a handoff, routing or sending a frame is contained to the
requests concerned, which end with ``finish_reason="error"`` (FINISHED with the error to the
ingress and to every other holder, KV freed here), is counted in
``tokenrouter_errors_total{type}``, and the loop goes on (docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Container
from typing import TYPE_CHECKING

from tokenrouter_ray.metrics import Metrics
from tokenrouter_ray.protocol import (
    MsgKind,
    PeerReq,
    RequestLedger,
    RouteState,
    by_destination,
)
from tokenrouter_ray.replica.active_count import INGRESS_SILENCE_S, ActiveCount
from tokenrouter_ray.replica.messages import HandoffRecord, Messages
from tokenrouter_ray.replica.step_loop import StepLoop
from tokenrouter_ray.replica.tracking import Tracked
from tokenrouter_ray.routing.policy import Policy, RequestView
from tokenrouter_ray.thresholds import ThresholdTable
from tokenrouter_ray.transport.base import ChannelClosed, PeerChannel
from tokenrouter_ray.tuning.window import WindowStats

if TYPE_CHECKING:
    from tokenrouter_ray.engine.engine import Engine

logger = logging.getLogger(__name__)

SWEEP_PERIOD_S = 1.0
EXPIRY_GRACE_S = 10.0  # past a request's deadline, before a model frees it on its own


class SubServer:
    def __init__(
        self,
        models: list[str],
        index: int,
        engine: Engine,
        policy: Policy,
        channel: PeerChannel,
        pick_endpoint: Callable[[str, str], str],
        metrics: Metrics | None = None,
    ) -> None:
        self.models = models
        self.index = index
        self.name = models[index]
        self.engine = engine
        self.policy = policy
        self.channel = channel
        self.ledger = RequestLedger()
        self.tracked: dict[str, Tracked] = {}
        self.inbox: deque[PeerReq] = deque()
        # messages for requests in the running step, held until it is committed
        self._held: deque[PeerReq] = deque()
        self.stats = WindowStats()  # for the threshold tuner
        self.active = ActiveCount(INGRESS_SILENCE_S)  # global N, from every ingress's count
        self.metrics = metrics if metrics is not None else Metrics(policy=policy.name)
        self.pick_endpoint = pick_endpoint  # (model, request id) -> endpoint, first visit
        self.messages = Messages(
            models, self.name, channel.name, lambda m, r: self.pick_endpoint(m, r), self.metrics
        )
        self.unqueued: dict[str, float] = {}  # rid -> NEW's sent_at (s), until first computed
        self.next_sweep = 0.0  # monotonic time of the next expired-request sweep
        self._calls: deque[Callable[[list[PeerReq]], None]] = deque()  # for the step loop
        self._outbox: asyncio.Queue[tuple[list[PeerReq], bool]] | None = None
        self._posted: deque[tuple[list[PeerReq], bool]] = deque()  # for the event loop
        self._post_due = False  # the event loop is due to take ``_posted``
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task] = []
        self._closing = False
        self.steps = StepLoop(self)  # the engine's thread and the step's parts

    @property
    def endpoint(self) -> str:
        return self.channel.name

    @property
    def num_steps(self) -> int:
        return self.steps.num_steps

    @property
    def active_requests(self) -> int:
        """Global N: the sum of the latest active count of every ingress."""
        return self.active.total

    @property
    def handoff_log(self) -> deque[HandoffRecord]:
        return self.messages.log

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._outbox = asyncio.Queue()
        self._tasks = [
            asyncio.create_task(self._receive_loop(), name=f"{self.name}-recv"),
            asyncio.create_task(self._sender(), name=f"{self.name}-send"),
        ]
        self.steps.start()

    async def stop(self) -> None:
        self._closing = True
        await asyncio.to_thread(self.steps.stop)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, ChannelClosed):
                await task

    def set_batch_thresholds(self, thresholds: ThresholdTable) -> None:
        """Adopt the tuner's table; a sleeping step loop re-checks at once."""
        if self.engine.set_batch_thresholds(thresholds):
            self.steps.wake()

    def deliver(self, msgs: list[PeerReq]) -> None:
        """Queue messages for the step loop (from any thread)."""
        self.inbox.extend(msgs)
        self.steps.wake()

    @property
    def alive(self) -> bool:
        """The receive and send tasks and the step loop running, the channel open (what
        a health check asks)."""
        return (
            bool(self._tasks)
            and not any(t.done() for t in self._tasks)
            and self.steps.alive
            and not self.channel.closed
        )

    def dead_tasks(self) -> list[str]:
        """Names of stopped loops, with why (for health-check messages)."""
        dead = [
            f"{t.get_name()}: {'cancelled' if t.cancelled() else t.exception()!r}"
            for t in self._tasks
            if t.done()
        ]
        if self._tasks and not self.steps.alive:
            dead.append(f"{self.name}-steps: {self.steps.error!r}")
        return dead

    def health_problem(
        self, max_step_s: float, max_failed_steps: int, now: float | None = None
    ) -> str | None:
        """Why this replica should fail its health check (Serve then restarts it and its
        requests recover elsewhere), or None: a loop stopped, a step running past
        ``max_step_s`` (a wedged device), or ``max_failed_steps`` steps in a row failed (a
        sticky device error). ``now``: the monotonic time to judge at (default: now)."""
        if not self.alive:
            return f"sub-server stopped: {self.dead_tasks()}"
        since = self.steps.step_since
        now = time.monotonic() if now is None else now
        if since is not None and now - since > max_step_s:
            return f"a step has run for {now - since:.0f} s (limit {max_step_s:g} s)"
        if self.steps.failed_in_row >= max_failed_steps:
            return f"{self.steps.failed_in_row} steps in a row failed"
        return None

    @property
    def holds_anything(self) -> bool:
        """Requests, messages to apply or messages to send (``LocalRuntime.wait_idle``)."""
        return bool(
            self.engine.has_unfinished
            or self.tracked
            or self.has_work_waiting
            or self._posted
            or (self._outbox is not None and not self._outbox.empty())
        )

    @property
    def has_work_waiting(self) -> bool:
        """Messages or calls the step loop has not applied yet."""
        return bool(self.inbox or self._held or self._calls)

    def post(self, out: list[PeerReq], notify: bool = True) -> None:
        """Hand messages to the event loop's sender task (from the step loop's thread). Posts
        made before the event loop runs again share one wake-up of it."""
        if not out or self._loop is None or self._outbox is None:
            return
        self._posted.append((out, notify))
        if not self._post_due:
            self._post_due = True
            with contextlib.suppress(RuntimeError):  # the event loop closed: shutting down
                self._loop.call_soon_threadsafe(self._take_posted)

    def _take_posted(self) -> None:
        """On the event loop: move what the step loop posted to the sender's queue."""
        assert self._outbox is not None
        self._post_due = False
        while self._posted:
            self._outbox.put_nowait(self._posted.popleft())

        # ------------------------------------------------------------------- receive

    async def _receive_loop(self) -> None:
        while not self._closing:
            try:
                batch = await self.channel.recv()
            except ChannelClosed:
                return
            except Exception:  # one bad receive must not stop the model
                logger.exception("%s: receive failed", self.name)
                self.metrics.error(self.name, "recv_failed")
                await asyncio.sleep(0.05)
                continue
            now = time.time_ns()
            profile = self.steps.profile
            for msg in batch:
                self.metrics.peer_message(self.name, msg.sent_at)
                if msg.kind != MsgKind.ACTIVE:  # counted as applied messages are
                    profile.received += 1
                    profile.received_after_s += max(0, now - msg.sent_at) / 1e9
            self.deliver(batch)

    def between_steps(self, out: list[PeerReq]) -> None:
        """On the step loop's thread, before a launch: what the event loop asked for
        (failed sends), the messages held while the last step ran, the inbox, and the
        expiry sweep when it is due."""
        while self._calls:
            self._calls.popleft()(out)
        while self._held:  # counted when they arrived
            self._apply_one(self._held.popleft(), out)
        if self.inbox:
            self._apply_inbox(out)
        if time.monotonic() >= self.next_sweep:
            self._sweep_expired(out)

    def receive_while_running(self, running: Container[str], out: list[PeerReq]) -> None:
        """On the step loop's thread while a step runs: apply the inbox, except messages
        for the requests in that step (``running``), held until it is committed (only a
        FINISHED or ABORT can concern them: the engine must not free or change a request
        the device is computing)."""
        self._apply_inbox(out, hold=running)

    def _apply_inbox(self, out: list[PeerReq], hold: Container[str] = ()) -> None:
        counted = False
        while self.inbox:
            msg = self.inbox.popleft()
            if msg.active_requests is not None:  # from an ingress, 0 included
                self.active.update(msg.src, msg.active_requests)
                counted = True
            if msg.kind == MsgKind.ACTIVE:
                continue
            if msg.rid in hold:
                self._held.append(msg)
            else:
                self._apply_one(msg, out)
        if counted:
            self._update_active()

    def _apply_one(self, msg: PeerReq, out: list[PeerReq]) -> None:
        """One message, unless stale; a failure is contained to its request."""
        profile = self.steps.profile
        profile.applied += 1
        profile.applied_after_s += max(0, time.time_ns() - msg.sent_at) / 1e9
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

    def _update_active(self) -> None:
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
            self._update_active()
            for tracked in [t for t in self.tracked.values() if t.ingress in silent]:
                self.metrics.error(self.name, "orphaned")
                self.finish(tracked, "error", out, error="its ingress is gone")

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

    # ------------------------------------------------------------------ sending
    async def _sender(self) -> None:
        """Send what the step loop posts, in order (one frame per destination)."""
        assert self._outbox is not None
        while True:
            out, notify = await self._outbox.get()
            t0 = time.perf_counter()
            try:
                await self._send(out, notify)
            except ChannelClosed:
                return
            except Exception:  # never stop sending over one batch
                logger.exception("%s: send failed", self.name)
                self.metrics.error(self.name, "send_failed")
            self.steps.profile.add("send", time.perf_counter() - t0)

    async def _send(self, out: list[PeerReq], notify: bool = True) -> None:
        """One frame per destination. A destination that cannot take its frame (unknown,
        unreachable) fails the requests it concerned, on the step loop's thread: a
        HANDOFF's request ends with an error (FINISHED to the ingress and the other
        holders, sent with ``notify=False``); for a frame to the ingress, the requests are
        dropped here."""
        undelivered: list[tuple[PeerReq, str]] = []
        profile = self.steps.profile
        for dst, msgs in by_destination(out).items():
            try:
                await self.channel.send(dst, msgs)
                profile.frames += 1
                profile.messages += len(msgs)
            except ChannelClosed:
                raise
            except Exception as exc:
                logger.warning("%s: send to %s failed: %s", self.name, dst, exc)
                self.metrics.error(self.name, "send_failed")
                self.channel.forget_peer(dst)
                undelivered += [(msg, f"peer {dst} unreachable: {exc}") for msg in msgs]
        if undelivered and notify:

            def fail(follow_up: list[PeerReq]) -> None:
                mine: list[PeerReq] = []
                for msg, error in undelivered:
                    self._undeliverable(msg, error, mine)
                self.post(mine, notify=False)

            self._calls.append(fail)
            self.steps.wake()

    def _undeliverable(self, msg: PeerReq, error: str, out: list[PeerReq]) -> None:
        tracked = self.tracked.get(msg.rid)
        if tracked is None or msg.kind.is_terminal:
            return
        if msg.dst == tracked.ingress:  # nobody to report to: free it here
            self.tracked.pop(msg.rid, None)
            self.ledger.finish(msg.rid)
            self.engine.abort(msg.rid)
            return
        self.finish(tracked, "error", out, error=error)

    def _sweep_expired(self, out: list[PeerReq]) -> None:
        """End requests held past their deadline plus ``EXPIRY_GRACE_S`` (their ingress
        normally aborts them at the deadline; this frees state whose ingress is gone)."""
        self.next_sweep = time.monotonic() + SWEEP_PERIOD_S
        self._forget_silent_ingresses(out)
        cutoff = time.time() - EXPIRY_GRACE_S
        for tracked in [t for t in self.tracked.values() if t.deadline and t.deadline < cutoff]:
            self.metrics.error(self.name, "expired")
            self.finish(tracked, "error", out, error="deadline passed")

    def finish(
        self, tracked: Tracked, reason: str | None, out: list[PeerReq], error: str | None = None
    ) -> None:
        """End ``tracked`` here: KV freed, FINISHED to the ingress and every other holder."""
        rid = tracked.rid
        self.tracked.pop(rid, None)
        self.ledger.finish(rid)
        self.engine.abort(rid)
        out += self.messages.finished(tracked, reason, error)

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

    def _fail(self, msg: PeerReq, error: str, out: list[PeerReq]) -> None:
        """A message this replica cannot serve ends its request with an error."""
        tracked = self.tracked.get(msg.rid)
        if tracked is None:
            if msg.kind != MsgKind.NEW:
                return
            tracked = Tracked(msg.rid, msg.src, len(msg.tokens), msg.sampling)
        self.finish(tracked, "error", out, error=error)
