"""The ingress side of the protocol: submit requests, assemble their commits, abort and
recover them. The OpenAI flow on top (admission, one loop per choice) is
``ingress/openai_server.py``.

``IngressCore`` is the single holder of each request's committed output. It sends NEW to
the entry model, orders COMMITs from whichever model committed (``CommitLog``), completes a
request once FINISHED arrived *and* every committed token up to the final length is in, and
broadcasts ABORT to every model endpoint (receivers that never held the request ignore it).
``IngressServer`` (``ingress/openai_server.py``) drives it for the OpenAI API (the Serve
ingress ``deployments/ingress.py`` is a shim around that server); ``LocalRuntime`` drives the
core directly. Neither needs Ray.

Reliability rules (docs/user-guide/reliability.md):
- cleanup never awaits: ``abort_nowait`` and ``release`` change state at once and the ABORT
  broadcast runs as a background task the core owns, so a cancelled caller (a client that
  disconnected) cannot leave a request behind on any model or in the active count;
- every request has a deadline: ``stream`` waits no longer than it, then ends the request
  with ``error_kind="timeout"`` and aborts it everywhere;
- the active count (the global N of the models' launch thresholds) is published to every
  model endpoint in an ACTIVE frame whenever it changes, coalesced: the changes within
  ``ACTIVE_COALESCE_S`` send one frame per endpoint, and only to the endpoints whose count
  from here (the last ACTIVE, or the NEW sent there) differs from the count then (in a
  closed loop a completion and the next arrival cancel out: nothing is sent); and again to
  every endpoint every ``ACTIVE_REFRESH_S`` while it is not 0, so a model can tell a live
  ingress from a dead one;
- ``recreate`` re-submits requests whose models were lost from the committed sequence held
  here, under a new wire id (``<rid>~<k>``): the old incarnation is aborted everywhere, the
  new one is a NEW to the entry model carrying prompt + committed tokens, the original
  prompt length (so ``max_tokens`` and first-token logic keep their meaning) and the
  replicas to use. Anchors and policy state start afresh;
- copies this ingress no longer wants are stopped: a COMMIT for a wire id it does not hold
  (an incarnation superseded by ``recreate`` on a replica that only stalled past its lease,
  or a request whose submission was cancelled after its NEW was queued) brings an ABORT to
  every model endpoint and its sender, once per id; and an endpoint that (re)appears gets
  the ABORTs of the incarnations superseded lately, for copies held there that report
  nothing (paused while another model writes).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from tokenrouter_ray.engine.request import draw_seed
from tokenrouter_ray.metrics import INGRESS, Metrics
from tokenrouter_ray.metrics.latency import mean_itl
from tokenrouter_ray.protocol import (
    CommitLog,
    FinishSummary,
    MsgKind,
    PeerReq,
    ProtocolError,
    RouteState,
    SamplingSpec,
    TokenInfo,
    by_destination,
)
from tokenrouter_ray.transport.base import (
    ChannelClosed,
    PeerChannel,
    PeerUnreachableError,
    endpoint_model,
)

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 600.0
ACTIVE_REFRESH_S = 1.0  # a non-zero active count is republished this often
# changes of the active count within this long go out as one ACTIVE per endpoint, and none
# where it ends as it began (each frame into a replica costs CPU on several of its threads)
ACTIVE_COALESCE_S = 0.005
STOPPED_REMEMBERED = 4096  # wire ids told to stop, and superseded incarnations, remembered
# a request ended by a peer model endpoint's loss is re-created at most this often
MAX_PEER_LOSS_RECREATES = 3
SUPERSEDED_RESEND_S = 60.0  # superseded incarnations are ABORTed everywhere this long


@dataclass
class RequestResult:
    """A request's committed output, how it ended, and its metrics: what the ingress hands
    the OpenAI layer (and `LocalRuntime` its caller) once the request is done."""

    request_id: str
    prompt_len: int
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    counts: dict[str, int] = field(default_factory=dict)  # committed tokens per model
    handoffs: int = 0
    error: str | None = None
    error_kind: str | None = None  # "model" (a model failed it), "timeout", "unavailable"
    recreated: int = 0  # times it was re-created after losing a model replica
    # per-request metrics: ingress clock (monotonic seconds) ...
    ttft_s: float | None = None  # submit -> first committed token here
    e2e_s: float | None = None  # submit -> release
    mean_itl_s: float | None = None  # (last - first token) / (tokens - 1)
    # ... and what the models reported (None: the request ended before they did, e.g. cut
    # by a stop string or aborted)
    summary: FinishSummary | None = None
    writers: list[str | None] = field(default_factory=list)  # model of each output token
    infos: list[TokenInfo | None] = field(default_factory=list)  # if the request asked


class TokenChunks:
    """One request's committed tokens for its reader, in order, then ``None`` (the end): the
    ``asyncio.Queue`` calls the core and ``stream`` use, with one difference. With
    ``each_chunk`` False the reader is woken only by the end, not by every chunk: a
    non-streamed choice without stop strings reads all its tokens at once (its writer's
    text does not depend on how the tokens are grouped), so a token costs it no task wake."""

    __slots__ = ("_ended", "_items", "_waiter", "each_chunk")

    def __init__(self) -> None:
        self._items: deque[list[int] | None] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._ended = False
        self.each_chunk = True

    def put_nowait(self, item: list[int] | None) -> None:
        self._items.append(item)
        if item is None:
            self._ended = True
        waiter = self._waiter
        if waiter is not None and not waiter.done() and (self.each_chunk or self._ended):
            waiter.set_result(None)

    def empty(self) -> bool:
        return not self._items

    def get_nowait(self) -> list[int] | None:
        return self._items.popleft()

    async def get(self) -> list[int] | None:
        while not self._items or not (self.each_chunk or self._ended):
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()


def _starts_on(entry: str | None, alone: str | None) -> bool:
    """Whether a request may start on ``entry`` (one given, and a replica of the model
    that serves it alone, if one does)."""
    return entry is not None and (alone is None or endpoint_model(entry) == alone)


class _Live:
    def __init__(self, rid: str, prompt: list[int], sampling: SamplingSpec, timeout_s: float):
        self.rid = rid
        self.wire_rid = rid  # the id models know it by (changes when it is re-created)
        self.prompt = prompt
        self.sampling = sampling
        self.log = CommitLog(len(prompt))
        self.completion = RequestResult(rid, len(prompt))
        self.final_len: int | None = None
        self.aborted = False
        self.counts: dict[str, int] = {}  # committed tokens per model, as seen here
        self.updates = TokenChunks()
        self.submitted_at = time.monotonic()  # for TTFT / ITL / end-to-end metrics
        self.deadline = self.submitted_at + timeout_s
        self.deadline_wall = time.time() + timeout_s  # travels to the models
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.timer: asyncio.TimerHandle | None = None  # fires at the deadline
        self.holders: set[str] | None = None  # endpoints it may be on (None: any)
        self.seen_seq = 0  # highest handoff_seq on a commit: handoffs so far, at least
        self.alone: str | None = None  # the model serving it alone (bypass), if any
        self.max_share: float | None = None  # its cap on the top model's share, if any
        self.thresholds: tuple[float, ...] = ()  # its own decision threshold(s), if any

    @property
    def complete(self) -> bool:
        return self.final_len is not None and self.log.end >= self.final_len

    @property
    def done(self) -> bool:
        return self.complete or self.aborted


class IngressCore:
    def __init__(
        self,
        channel: PeerChannel,
        entry_endpoint: Callable[[], str],
        all_endpoints: Callable[[], list[str]],
        metrics: Metrics | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        prefill_at: Mapping[str, int] | None = None,
    ) -> None:
        """``prefill_at``: model -> the prompt length from which a new request's prompt is
        also prefilled on that model at admission (``ModelSpec.prefill_at_admission``)."""
        self.channel = channel
        self.prefill_at = dict(prefill_at or {})
        self.metrics = metrics if metrics is not None else Metrics()
        self.entry_endpoint = entry_endpoint
        self.all_endpoints = all_endpoints
        self.timeout_s = timeout_s
        self.live: dict[str, _Live] = {}  # by client request id
        self._wire: dict[str, _Live] = {}  # by the id models know (differs once re-created)
        self._task: asyncio.Task | None = None
        self._refresh: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()
        self._publish_timer: asyncio.TimerHandle | None = None  # the ACTIVEs scheduled
        self._published: int | None = None  # the count last sent in an ACTIVE
        self._told: dict[str, int] = {}  # endpoint -> the count last sent there (ACTIVE, NEW)
        self.tokens_received = 0  # committed tokens received (for host-path benchmarks)
        self.frames_received = 0
        self._told_to_stop: dict[str, None] = {}  # orphan wire ids aborted (insertion order)
        self._superseded: dict[str, None] = {}  # wire ids replaced by ``recreate``
        self._recent: dict[str, float] = {}  # of those, the recent ones -> when superseded
        self._endpoints_seen: set[str] = set()  # model endpoints at the last refresh
        self.orphans_aborted = 0  # orphan copies told to stop (stats)
        # a model replica that is leaving (MsgKind.DRAIN): its endpoint; the owner stops
        # placing requests there and moves them (``IngressServer.on_drain``: ``move_off``)
        self.on_drain: Callable[[str], None] | None = None
        # a model ended a request because a HANDOFF could not reach a peer model endpoint
        # (``FinishSummary.lost_peer``): (request id, wire id, that endpoint, the error); the
        # owner re-creates the request if the endpoint has left, else fails it
        # (``IngressServer.on_peer_lost``). None: such a request fails at once.
        self.on_peer_lost: Callable[[str, str, str, str], None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._receive_loop(), name="ingress-recv")
        self._refresh = asyncio.create_task(self._refresh_loop(), name="ingress-active")

    async def stop(self) -> None:
        if self._publish_timer is not None:  # no ACTIVE from a stopped core
            self._publish_timer.cancel()
            self._publish_timer = None
        tasks = [t for t in (self._task, self._refresh, *self._background) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, ChannelClosed, Exception):
                await task

    @property
    def num_active(self) -> int:
        return len(self.live)

    def health_problem(self) -> str | None:
        """Why this ingress cannot serve (its receive or refresh loop stopped, its channel
        closed), or None."""
        for task in (self._task, self._refresh):
            if task is None or task.done():
                why = "not started" if task is None else repr(task)
                return f"ingress loop stopped: {why}"
        if self.channel.closed:
            return "ingress channel closed"
        return None

    # ------------------------------------------------------------- active count
    def _active_changed(self) -> None:
        """The active count changed: metrics now, the ACTIVEs ``ACTIVE_COALESCE_S`` later."""
        self.metrics.ingress_active(self.num_active)
        if self._publish_timer is None:
            self._publish_timer = asyncio.get_running_loop().call_later(
                ACTIVE_COALESCE_S, self._publish_changed
            )

    def _publish_changed(self) -> None:
        self._publish_timer = None
        self._publish_active(only_changed=True)

    def _publish_active(self, only_changed: bool = False) -> None:
        """The active count to every model endpoint (``only_changed``: to those told another
        count last)."""
        n = self._published = self.num_active
        told = self._told
        msgs = [
            PeerReq(
                rid="",
                src=self.channel.name,
                dst=dst,
                kind=MsgKind.ACTIVE,
                handoff_seq=0,
                active_requests=n,
            )
            for dst in self.all_endpoints()
            if not only_changed or told.get(dst) != n
        ]
        for msg in msgs:  # a send that fails is made good by the next refresh
            told[msg.dst] = n
        if msgs:
            self._spawn(self._send_each(msgs))

    async def _refresh_loop(self) -> None:
        """Republish a non-zero count: models drop an ingress silent for long (its replica
        died) and would otherwise hold its last count forever."""
        while True:
            await asyncio.sleep(ACTIVE_REFRESH_S)
            if self._published or self.num_active:
                self._publish_active()
            self._abort_superseded_on_new_endpoints()
            self._told = {dst: n for dst, n in self._told.items() if dst in self._endpoints_seen}

    def _abort_superseded_on_new_endpoints(self) -> None:
        """An endpoint that appeared since the last refresh (a replica back from a stall
        past its lease, or a new one) may hold copies of incarnations ``recreate``
        superseded while it was away: ABORT them there (unknown ids are ignored). The
        incarnations superseded in the last ``SUPERSEDED_RESEND_S`` are ABORTed at every
        endpoint on every refresh too: a replica that stalled only briefly may never have
        left the endpoint list between two refreshes (so it never looks new), and an ABORT
        sent while it was frozen may have been dropped with its connection."""
        now = set(self.all_endpoints())
        new, self._endpoints_seen = now - self._endpoints_seen, now
        cutoff = time.monotonic() - SUPERSEDED_RESEND_S
        for rid in [r for r, at in self._recent.items() if at < cutoff]:
            del self._recent[rid]
        targets = {dst: list(self._superseded) for dst in new if self._superseded}
        for dst in now - new if self._recent else ():
            targets[dst] = list(self._recent)
        msgs = [
            PeerReq(rid=rid, src=self.channel.name, dst=dst, kind=MsgKind.ABORT, handoff_seq=0)
            for dst in sorted(targets)
            for rid in targets[dst]
        ]
        if msgs:
            self._spawn(self._send_grouped(msgs))

    async def submit(
        self,
        rid: str,
        prompt: list[int],
        sampling: SamplingSpec,
        entry: str | None = None,
        timeout_s: float | None = None,
        endpoints: Mapping[str, str] | None = None,
        alone: str | None = None,
        max_share: float | None = None,
        thresholds: tuple[float, ...] = (),
    ) -> str:
        """Send NEW to ``entry`` (default: ``entry_endpoint()``); ``endpoints`` (model ->
        the replica to use) ride on it. ``alone``: the model that serves the request by
        itself (single-model bypass: no policy, no handoffs); ``entry`` is then one of its
        replicas (default: the first). ``max_share``: its cap on the top model's share of the
        output (``routing/policy.py capped_dst``); ``thresholds``: its own decision
        threshold(s) (``RouteState.thresholds``). Returns the endpoint it was sent to. A
        failed send forgets the request and raises (nothing was started)."""
        if rid in self.live:
            raise ValueError(f"request {rid!r} is already running")
        if sampling.seed is None:  # one seed for every model the request visits
            sampling = msgspec.structs.replace(sampling, seed=draw_seed())
        timeout_s = timeout_s or self.timeout_s
        live = _Live(rid, list(prompt), sampling, timeout_s)
        live.alone, live.max_share, live.thresholds = alone, max_share, tuple(thresholds)
        live.timer = asyncio.get_running_loop().call_later(timeout_s, self._expire, rid)
        self.live[rid] = self._wire[rid] = live
        try:
            dst = entry if _starts_on(entry, alone) else self._entry_of(live, endpoints)
            live.holders = _holders(dst, endpoints)
            new = self._new_msg(live, dst, endpoints)
            await self.channel.send(dst, [new])
            self._told[dst] = new.active_requests  # the NEW told it the count
            if self.prefill_at and alone is None:
                await self._send_prefills(live, dst, endpoints)
        except BaseException:
            live.timer.cancel()  # set just above
            self.live.pop(rid, None)
            self._wire.pop(rid, None)
            # a send cancelled while it waited (the Ray channel's window) may have queued the
            # NEW already: the request would run with nobody holding it here
            self._broadcast_abort(rid)
            raise
        self._active_changed()
        return dst

    async def _send_prefills(
        self, live: _Live, entry: str, endpoints: Mapping[str, str] | None
    ) -> None:
        """PREFILL the prompt on each model configured for it (``prefill_at``), at the
        replica the request will use there, beside the entry model's prefill: the first
        handoff there then finds the prompt's KV in that replica's prefix cache, so its
        time to first token is the longer prefill, not the sum. Best effort: a PREFILL that
        cannot be sent changes nothing but that (the handoff prefills as usual)."""
        n = len(live.prompt)
        entry_model = endpoint_model(entry)
        for model, at in self.prefill_at.items():
            if model == entry_model or n < at:
                continue
            dst = (endpoints or {}).get(model) or next(
                (e for e in self.all_endpoints() if endpoint_model(e) == model), None
            )
            if dst is None:
                continue
            msg = PeerReq(
                rid=live.wire_rid,
                src=self.channel.name,
                dst=dst,
                kind=MsgKind.PREFILL,
                handoff_seq=0,
                tokens=live.prompt,
                sampling=live.sampling,
            )
            try:
                await self.channel.send(dst, [msg])
            except Exception as exc:
                logger.info("ingress: no prefill of %s on %s: %s", live.rid, dst, exc)

    def _entry_of(self, live: _Live, endpoints: Mapping[str, str] | None) -> str:
        """Where a request starts (or starts again): the entry model's replica, or for a
        request served alone, that model's (the one ``endpoints`` names, else the first)."""
        entry = self.entry_endpoint()
        model = live.alone
        if model is None or endpoint_model(entry) == model:
            return entry
        named = (endpoints or {}).get(model)
        if named is not None:
            return named
        for endpoint in self.all_endpoints():
            if endpoint_model(endpoint) == model:
                return endpoint
        raise PeerUnreachableError(f"model {model!r} has no replica to serve the request")

    def _new_msg(self, live: _Live, dst: str, endpoints: Mapping[str, str] | None) -> PeerReq:
        route = RouteState(
            ingress=self.channel.name,
            prompt_len=len(live.prompt),
            endpoints=dict(endpoints or {}),
            counts=dict(live.counts),
            deadline=live.deadline_wall,
            alone=live.alone,
            max_share=live.max_share,
            thresholds=live.thresholds,
        )
        return PeerReq(
            rid=live.wire_rid,
            src=self.channel.name,
            dst=dst,
            kind=MsgKind.NEW,
            handoff_seq=0,
            tokens=live.prompt + live.log.tokens,
            sampling=live.sampling,
            route=route,
            active_requests=self.num_active,
        )

    async def stream(self, rid: str, each_chunk: bool = True) -> AsyncIterator[list[int]]:
        """Newly committed tokens as they become contiguous, until the request completes,
        is aborted, fails, or reaches its deadline (then it fails with ``timeout``). Tokens
        that arrived together (one frame, or while the reader was busy) come as one list.
        ``each_chunk`` False: all of them at the end, as one list (``TokenChunks``)."""
        live = self.live[rid]
        updates = live.updates
        updates.each_chunk = each_chunk
        while (chunk := await updates.get()) is not None:
            ended = False
            while not updates.empty():  # what else arrived: one piece, one SSE chunk
                more = updates.get_nowait()
                if more is None:
                    ended = True
                    break
                chunk = chunk + more
            yield chunk
            if ended:
                return

    def _expire(self, rid: str) -> None:
        """The request's deadline timer fired."""
        live = self.live.get(rid)
        if live is not None and not live.done:
            waited = time.monotonic() - live.submitted_at
            self.fail(rid, f"no answer within the request's deadline ({waited:.0f} s)", "timeout")

    def abort_nowait(self, rid: str, reason: str = "abort") -> asyncio.Task | None:
        """Stop the request on every model (unless it already completed); ``reason`` is its
        finish reason (``"stop"`` when the caller saw a stop string). Changes state at once;
        the ABORT broadcast runs in the background (returned, to await if wanted)."""
        live = self.live.get(rid)
        if live is None or live.done:
            return None
        live.aborted = True
        live.completion.finish_reason = reason
        live.updates.put_nowait(None)
        return self._broadcast_abort(live.wire_rid)

    async def abort(self, rid: str, reason: str = "abort") -> None:
        task = self.abort_nowait(rid, reason)
        if task is not None:
            await asyncio.shield(task)

    def fail_wire(self, wire_rid: str, error: str, kind: str = "model") -> None:
        """``fail`` the request ``wire_rid`` is the current copy of (a no-op once it was
        re-created or ended)."""
        live = self._wire.get(wire_rid)
        if live is not None and live.wire_rid == wire_rid:
            self.fail(live.rid, error, kind)

    def fail(self, rid: str, error: str, kind: str = "model") -> None:
        """End a request here with an error, and abort it on every model."""
        live = self.live.get(rid)
        if live is None or live.done:
            return
        live.completion.error, live.completion.error_kind = error, kind
        self.metrics.error(INGRESS, kind)
        self.abort_nowait(rid, reason="error")

    def _broadcast_abort(self, wire_rid: str, also: str | None = None) -> asyncio.Task:
        """ABORT ``wire_rid`` at every model endpoint (and ``also``)."""
        targets = self.all_endpoints()
        if also is not None and also not in targets:
            targets = [*targets, also]
        msgs = [
            PeerReq(
                rid=wire_rid,
                src=self.channel.name,
                dst=dst,
                kind=MsgKind.ABORT,
                handoff_seq=0,
            )
            for dst in targets
        ]
        return self._spawn(self._send_each(msgs))

    async def _send_each(self, msgs: list[PeerReq]) -> None:
        """One frame per destination; one unreachable destination does not stop the rest."""
        for msg in msgs:
            try:
                await self.channel.send(msg.dst, [msg])
            except ChannelClosed:
                return
            except Exception as exc:
                logger.warning(
                    "ingress: %s for %s to %s failed: %s", msg.kind.name, msg.rid, msg.dst, exc
                )
                self.metrics.error(INGRESS, "send_failed")

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def release(self, rid: str) -> RequestResult:
        """Forget a completed, failed or aborted request; its final record. Never awaits."""
        live = self.live.pop(rid)
        if live.timer is not None:
            live.timer.cancel()
        self._wire.pop(live.wire_rid, None)
        self._finish_record(live)
        self._record_done(live)
        return live.completion

    def commit_log(self, rid: str) -> CommitLog:
        """A live request's committed output with its writers and token reports."""
        return self.live[rid].log

    @staticmethod
    def _finish_record(live: _Live) -> None:
        """The request's metrics and per-token record, into its `RequestResult`."""
        done, now = live.completion, time.monotonic()
        done.e2e_s = now - live.submitted_at
        if live.first_token_at is not None:
            done.ttft_s = live.first_token_at - live.submitted_at
            if live.last_token_at is not None:
                done.mean_itl_s = mean_itl(
                    live.first_token_at, live.last_token_at, len(done.token_ids)
                )
        if done.summary is None:  # no FINISHED (cut by a stop string, aborted, failed)
            done.counts = done.counts or dict(live.counts)
            done.handoffs = done.handoffs or live.seen_seq
        done.writers, done.infos = live.log.writers, live.log.infos

    def _record_done(self, live: _Live) -> None:
        done, n = live.completion, len(live.completion.token_ids)
        tpot = None
        if n > 1 and live.first_token_at is not None and live.last_token_at is not None:
            tpot = (live.last_token_at - live.first_token_at) / (n - 1)
        self.metrics.request_done(
            done.finish_reason or "unknown",
            time.monotonic() - live.submitted_at,
            done.prompt_len,
            n,
            done.handoffs,
            tpot,
        )
        if done.error or done.finish_reason == "error":
            self.metrics.error(INGRESS, "request_failed")
        self._active_changed()

    async def result(self, rid: str) -> RequestResult:
        try:
            async for _ in self.stream(rid):
                pass
        finally:
            self.abort_nowait(rid)  # no-op once complete; frees the models if cancelled
            done = self.release(rid)
        return done

    # ----------------------------------------------------------------- recovery
    async def recreate(
        self,
        endpoints: Callable[[str], Mapping[str, str]] | None = None,
        entry: str | None = None,
        reason: str = "a model replica was lost",
        lost: set[str] | None = None,
        leaving: str | None = None,
    ) -> int:
        """Re-create unfinished requests from their committed sequence (see the module
        docstring): those that may be on an endpoint in ``lost`` (every one when None, or
        when a request was not told its replicas); ``endpoints(rid)`` (model -> endpoint)
        are the replicas it must use now. ``leaving``: an endpoint that is still up but
        no longer among the model endpoints (a draining replica): it gets the ABORTs too,
        which free the old copies' KV there. Returns how many were re-created."""
        news: list[PeerReq] = []
        for live in list(self.live.values()):
            if live.done:
                continue
            if lost is not None and live.holders is not None and not live.holders & lost:
                continue
            self._broadcast_abort(live.wire_rid, leaving)
            self._wire.pop(live.wire_rid, None)
            _remember(self._superseded, live.wire_rid)
            self._recent[live.wire_rid] = time.monotonic()
            live.completion.recreated += 1
            live.wire_rid = f"{live.rid}~{live.completion.recreated}"
            self._wire[live.wire_rid] = live
            live.log = live.log.settled()  # drop commits waiting on a gap
            assigned = endpoints(live.rid) if endpoints is not None else None
            try:
                dst = entry if _starts_on(entry, live.alone) else self._entry_of(live, assigned)
            except PeerUnreachableError as exc:  # a request served alone, its model gone
                self.fail(live.rid, f"{reason}; {exc}", "unavailable")
                continue
            live.holders = _holders(dst, assigned)
            news.append(self._new_msg(live, dst, assigned))
        for dst, msgs in by_destination(news).items():
            logger.warning("ingress: re-creating %d requests on %s: %s", len(msgs), dst, reason)
            self.metrics.error(INGRESS, "moved" if leaving is not None else "recreated")
            try:
                await self.channel.send(dst, msgs)
            except Exception as exc:
                for msg in msgs:
                    live = self._wire.get(msg.rid)
                    if live is not None:
                        self.fail(
                            live.rid, f"{reason}; re-creating it failed: {exc}", "unavailable"
                        )
        return len(news)

    async def move_off(
        self, endpoint: str, endpoints: Callable[[str], Mapping[str, str]] | None = None
    ) -> int:
        """A model replica is leaving (it sent DRAIN): re-create every request that may be
        on it elsewhere, as ``recreate`` does for a lost one, and ABORT the old copies there
        too. The caller has stopped placing requests on ``endpoint`` (its endpoints no
        longer list it), so ``endpoints`` and the entry choose other replicas."""
        return await self.recreate(
            endpoints, reason=f"replica {endpoint} is leaving", lost={endpoint}, leaving=endpoint
        )

    # ------------------------------------------------------------------ receive
    async def _receive_loop(self) -> None:
        while True:
            try:
                batch = await self.channel.recv()
            except ChannelClosed:
                return
            except Exception:  # a transport hiccup must not stop every request
                logger.exception("ingress: receive failed")
                self.metrics.error(INGRESS, "recv_failed")
                await asyncio.sleep(0.05)
                continue
            self.frames_received += 1
            if batch:  # the frame's latency: its oldest message's
                self.metrics.peer_message(INGRESS, min(msg.sent_at for msg in batch))
            for msg in batch:
                try:
                    self._on_message(msg)
                except Exception as exc:
                    logger.exception("ingress: message %s for %s failed", msg.kind.name, msg.rid)
                    self.metrics.error(INGRESS, "bad_message")
                    live = self._wire.get(msg.rid)
                    if live is not None:
                        self.fail(live.rid, f"bad {msg.kind.name} message: {exc}")

    def _on_message(self, msg: PeerReq) -> None:
        if msg.kind == MsgKind.DRAIN:
            if self.on_drain is not None:
                self.on_drain(msg.src)
            return
        live = self._wire.get(msg.rid)
        if live is None:
            if msg.kind == MsgKind.COMMIT:
                self._abort_orphan(msg)
            return
        if live.done:
            return
        if msg.kind == MsgKind.COMMIT:
            model = endpoint_model(msg.src)
            try:
                fresh = live.log.add(msg.anchor, msg.tokens, model, msg.token_info or None)
            except ProtocolError as exc:
                self.metrics.error(INGRESS, "protocol_error")
                self.fail(live.rid, str(exc))
                return
            if msg.handoff_seq > live.seen_seq:
                live.seen_seq = msg.handoff_seq
            if fresh:
                for writer in live.log.writers[len(live.log.writers) - len(fresh) :]:
                    live.counts[writer] = live.counts.get(writer, 0) + 1
                self._record_tokens(live, len(fresh))
                self.tokens_received += len(fresh)
                live.completion.token_ids += fresh
                live.updates.put_nowait(fresh)
        elif msg.kind == MsgKind.FINISHED:
            summary = msg.summary or FinishSummary()
            live.completion.counts = dict(summary.counts)
            lost = summary.lost_peer
            if (
                summary.error
                and lost is not None
                and self.on_peer_lost is not None
                and live.completion.recreated < MAX_PEER_LOSS_RECREATES
            ):
                if live.holders is not None:  # a re-creation for ``lost`` includes it
                    live.holders.add(lost)
                self.on_peer_lost(live.rid, live.wire_rid, lost, summary.error)
                return
            if summary.error:
                self.fail(live.rid, summary.error, "model")
                return
            live.final_len = msg.anchor
            live.completion.finish_reason = msg.finish_reason
            live.completion.handoffs = summary.handoffs
            live.completion.summary = summary
        if live.complete:
            live.updates.put_nowait(None)

    def _abort_orphan(self, msg: PeerReq) -> None:
        """A model still generates a request this ingress does not hold (see the module
        docstring): ABORT it on every model endpoint and its sender, once per wire id.
        Every holder, not only the sender: a copy paused on another model (waiting for
        this one to hand it back) would otherwise be held there for good."""
        if msg.rid in self._told_to_stop:
            return
        _remember(self._told_to_stop, msg.rid)
        self.orphans_aborted += 1
        self.metrics.error(INGRESS, "orphan_aborted")
        logger.info("ingress: %s commits %s, which it no longer holds: aborting", msg.src, msg.rid)
        msgs = [
            PeerReq(rid=msg.rid, src=self.channel.name, dst=dst, kind=MsgKind.ABORT, handoff_seq=0)
            for dst in dict.fromkeys([msg.src, *self.all_endpoints()])
        ]
        self._spawn(self._send_each(msgs))

    async def _send_grouped(self, msgs: list[PeerReq]) -> None:
        """One frame per destination, each destination on its own (like ``_send_each``)."""
        for dst, group in by_destination(msgs).items():
            try:
                await self.channel.send(dst, group)
            except ChannelClosed:
                return
            except Exception as exc:
                logger.warning("ingress: %d ABORTs to %s failed: %s", len(group), dst, exc)
                self.metrics.error(INGRESS, "send_failed")

    def _record_tokens(self, live: _Live, n: int) -> None:
        now = time.monotonic()
        if live.first_token_at is None:
            live.first_token_at = now
            self.metrics.first_token(now - live.submitted_at)
        else:
            # this COMMIT's n tokens after the last one seen: n gaps
            gap = mean_itl(live.last_token_at, now, n + 1)
            if gap is not None:
                self.metrics.inter_token(gap)
        live.last_token_at = now


def _remember(ids: dict[str, None], rid: str) -> None:
    """Add to a bounded insertion-ordered set (the oldest falls out)."""
    ids[rid] = None
    if len(ids) > STOPPED_REMEMBERED:
        ids.pop(next(iter(ids)))


def _holders(entry: str, assigned: Mapping[str, str] | None) -> set[str] | None:
    """The endpoints a request can be on: its entry and the replicas it was told to use
    (None when it was not told: a model may pick any replica then)."""
    return {entry, *assigned.values()} if assigned else None
