"""The ingress side of the protocol: submit requests, assemble commits, abort, recover;
and the OpenAI flow on top of it (admission, entry load-balancing, one loop per choice).

``IngressCore`` is the single holder of each request's committed output. It sends NEW to
the entry model, orders COMMITs from whichever model committed (``CommitLog``), completes a
request once FINISHED arrived *and* every committed token up to the final length is in, and
broadcasts ABORT to every model endpoint (receivers that never held the request ignore it).
``IngressServer`` (at the end) drives it for the OpenAI API: the Serve ingress
(``deployments/ingress.py``) is HTTP routes around one; ``LocalRuntime`` drives the core
directly. Neither needs Ray.

Reliability rules (docs/reliability.md):
- cleanup never awaits: ``abort_nowait`` and ``release`` change state at once and the ABORT
  broadcast runs as a background task the core owns, so a cancelled caller (a client that
  disconnected) cannot leave a request behind on any model or in the active count;
- every request has a deadline: ``stream`` waits no longer than it, then ends the request
  with ``error_kind="timeout"`` and aborts it everywhere;
- the active count (the global N of the models' launch thresholds) is published to every
  model endpoint in an ACTIVE frame whenever it changes, coalesced (changes within one
  event-loop turn send one frame per endpoint), and again every ``ACTIVE_REFRESH_S`` while
  it is not 0, so a model can tell a live ingress from a dead one;
- ``recreate`` re-submits requests whose models were lost from the committed sequence held
  here, under a new wire id (``<rid>~<k>``): the old incarnation is aborted everywhere, the
  new one is a NEW to the entry model carrying prompt + committed tokens, the original
  prompt length (so ``max_tokens`` and first-token logic keep their meaning) and the
  replicas to use. Anchors and policy state start afresh.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from tokenrouter_ray.metrics import INGRESS, Metrics
from tokenrouter_ray.openai.detokenizer import IncrementalDetokenizer
from tokenrouter_ray.openai.errors import (
    OpenAIError,
    OverloadedError,
    RequestFailedError,
    RequestTimeoutError,
    ServiceUnavailableError,
)
from tokenrouter_ray.openai.responses import (
    ChatCompletion,
    ChoiceResult,
    build_chat_completion,
    build_completion,
    finish_reason,
)
from tokenrouter_ray.openai.responses import Completion as TextCompletion
from tokenrouter_ray.openai.sse import (
    SSE_DONE,
    ChatStream,
    CompletionStream,
    merge_choice_streams,
    sse_error,
)
from tokenrouter_ray.openai.token_reports import (
    TokenText,
    chat_logprobs_part,
    completion_logprobs_part,
    request_metrics,
    trace_part,
)
from tokenrouter_ray.openai.validation import PreparedRequest
from tokenrouter_ray.protocol import (
    CommitLog,
    FinishSummary,
    MsgKind,
    PeerReq,
    ProtocolError,
    RouteState,
    SamplingSpec,
    TokenInfo,
)
from tokenrouter_ray.runtime.affinity import PrefixAffinity
from tokenrouter_ray.transport.base import ChannelClosed, PeerChannel

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 600.0
ACTIVE_REFRESH_S = 1.0  # a non-zero active count is republished this often


@dataclass
class Completion:
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


class _Live:
    def __init__(self, rid: str, prompt: list[int], sampling: SamplingSpec, timeout_s: float):
        self.rid = rid
        self.wire_rid = rid  # the id models know it by (changes when it is re-created)
        self.prompt = prompt
        self.sampling = sampling
        self.log = CommitLog(len(prompt))
        self.completion = Completion(rid, len(prompt))
        self.final_len: int | None = None
        self.aborted = False
        self.counts: dict[str, int] = {}  # committed tokens per model, as seen here
        self.updates: asyncio.Queue[list[int] | None] = asyncio.Queue()
        self.submitted_at = time.monotonic()  # for TTFT / ITL / end-to-end metrics
        self.deadline = self.submitted_at + timeout_s
        self.deadline_wall = time.time() + timeout_s  # travels to the models
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.timer: asyncio.TimerHandle | None = None  # fires at the deadline
        self.holders: set[str] | None = None  # endpoints it may be on (None: any)
        self.seen_seq = 0  # highest handoff_seq on a commit: handoffs so far, at least

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
    ) -> None:
        self.channel = channel
        self.metrics = metrics if metrics is not None else Metrics()
        self.entry_endpoint = entry_endpoint
        self.all_endpoints = all_endpoints
        self.timeout_s = timeout_s
        self.live: dict[str, _Live] = {}  # by client request id
        self._wire: dict[str, _Live] = {}  # by the id models know (differs once re-created)
        self._task: asyncio.Task | None = None
        self._refresh: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()
        self._publish_due = False  # an ACTIVE broadcast is scheduled for this loop turn
        self._published: int | None = None  # the count last sent in an ACTIVE
        self.tokens_received = 0  # committed tokens received (for host-path benchmarks)
        self.frames_received = 0

    async def start(self) -> None:
        self._task = asyncio.create_task(self._receive_loop(), name="ingress-recv")
        self._refresh = asyncio.create_task(self._refresh_loop(), name="ingress-active")

    async def stop(self) -> None:
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
        """The active count changed: metrics now, one ACTIVE broadcast per loop turn."""
        self.metrics.ingress_active(self.num_active)
        if not self._publish_due:
            self._publish_due = True
            asyncio.get_running_loop().call_soon(self._publish_active)

    def _publish_active(self) -> None:
        self._publish_due = False
        n = self._published = self.num_active
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
        ]
        self._spawn(self._send_each(msgs))

    async def _refresh_loop(self) -> None:
        """Republish a non-zero count: models drop an ingress silent for long (its replica
        died) and would otherwise hold its last count forever."""
        while True:
            await asyncio.sleep(ACTIVE_REFRESH_S)
            if self._published or self.num_active:
                self._publish_active()

    async def submit(
        self,
        rid: str,
        prompt: list[int],
        sampling: SamplingSpec,
        entry: str | None = None,
        timeout_s: float | None = None,
        endpoints: Mapping[str, str] | None = None,
    ) -> None:
        """Send NEW to ``entry`` (default: ``entry_endpoint()``); ``endpoints`` (model ->
        the replica to use) ride on it. A failed send forgets the request and raises
        (nothing was started)."""
        if rid in self.live:
            raise ValueError(f"request {rid!r} is already running")
        if sampling.seed is None:  # one seed for every model the request visits
            sampling = msgspec.structs.replace(sampling, seed=secrets.randbits(62))
        timeout_s = timeout_s or self.timeout_s
        live = _Live(rid, list(prompt), sampling, timeout_s)
        live.timer = asyncio.get_running_loop().call_later(timeout_s, self._expire, rid)
        self.live[rid] = self._wire[rid] = live
        try:
            dst = entry or self.entry_endpoint()
            live.holders = _holders(dst, endpoints)
            await self.channel.send(dst, [self._new_msg(live, dst, endpoints)])
        except BaseException:
            live.timer.cancel()  # set just above
            self.live.pop(rid, None)
            self._wire.pop(rid, None)
            raise
        self._active_changed()

    def _new_msg(self, live: _Live, dst: str, endpoints: Mapping[str, str] | None) -> PeerReq:
        route = RouteState(
            ingress=self.channel.name,
            prompt_len=len(live.prompt),
            endpoints=dict(endpoints or {}),
            counts=dict(live.counts),
            deadline=live.deadline_wall,
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

    async def stream(self, rid: str) -> AsyncIterator[list[int]]:
        """Newly committed tokens as they become contiguous, until the request completes,
        is aborted, fails, or reaches its deadline (then it fails with ``timeout``). Tokens
        that arrived together (one frame, or while the reader was busy) come as one list."""
        live = self.live[rid]
        updates = live.updates
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

    def fail(self, rid: str, error: str, kind: str = "model") -> None:
        """End a request here with an error, and abort it on every model."""
        live = self.live.get(rid)
        if live is None or live.done:
            return
        live.completion.error, live.completion.error_kind = error, kind
        self.metrics.error(INGRESS, kind)
        self.abort_nowait(rid, reason="error")

    def _broadcast_abort(self, wire_rid: str) -> asyncio.Task:
        msgs = [
            PeerReq(
                rid=wire_rid,
                src=self.channel.name,
                dst=dst,
                kind=MsgKind.ABORT,
                handoff_seq=0,
            )
            for dst in self.all_endpoints()
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

    def release(self, rid: str) -> Completion:
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
        """The request's metrics and per-token record, into its `Completion`."""
        done, now = live.completion, time.monotonic()
        done.e2e_s = now - live.submitted_at
        if live.first_token_at is not None:
            done.ttft_s = live.first_token_at - live.submitted_at
            n = len(done.token_ids)
            if n > 1 and live.last_token_at is not None:
                done.mean_itl_s = (live.last_token_at - live.first_token_at) / (n - 1)
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

    async def result(self, rid: str) -> Completion:
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
    ) -> int:
        """Re-create unfinished requests from their committed sequence (see the module
        docstring): those that may be on an endpoint in ``lost`` (every one when None, or
        when a request was not told its replicas); ``endpoints(rid)`` (model -> endpoint)
        are the replicas it must use now. Returns how many were re-created."""
        frames: dict[str, list[PeerReq]] = {}
        for live in list(self.live.values()):
            if live.done:
                continue
            if lost is not None and live.holders is not None and not live.holders & lost:
                continue
            self._broadcast_abort(live.wire_rid)
            self._wire.pop(live.wire_rid, None)
            live.completion.recreated += 1
            live.wire_rid = f"{live.rid}~{live.completion.recreated}"
            self._wire[live.wire_rid] = live
            live.log = live.log.settled()  # drop commits waiting on a gap
            assigned = endpoints(live.rid) if endpoints is not None else None
            dst = entry or self.entry_endpoint()
            live.holders = _holders(dst, assigned)
            frames.setdefault(dst, []).append(self._new_msg(live, dst, assigned))
        for dst, msgs in frames.items():
            logger.warning("ingress: re-creating %d requests on %s: %s", len(msgs), dst, reason)
            self.metrics.error(INGRESS, "recreated")
            try:
                await self.channel.send(dst, msgs)
            except Exception as exc:
                for msg in msgs:
                    live = self._wire.get(msg.rid)
                    if live is not None:
                        self.fail(
                            live.rid, f"{reason}; re-creating it failed: {exc}", "unavailable"
                        )
        return sum(len(m) for m in frames.values())

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
            for msg in batch:
                try:
                    self.metrics.peer_message(INGRESS, msg.sent_at)
                    self._on_message(msg)
                except Exception as exc:
                    logger.exception("ingress: message %s for %s failed", msg.kind.name, msg.rid)
                    self.metrics.error(INGRESS, "bad_message")
                    live = self._wire.get(msg.rid)
                    if live is not None:
                        self.fail(live.rid, f"bad {msg.kind.name} message: {exc}")

    def _on_message(self, msg: PeerReq) -> None:
        live = self._wire.get(msg.rid)
        if live is None or live.done:
            return
        if msg.kind == MsgKind.COMMIT:
            model = msg.src.split("/", 1)[0]
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
            if summary.error:
                self.fail(live.rid, summary.error, "model")
                return
            live.final_len = msg.anchor
            live.completion.finish_reason = msg.finish_reason
            live.completion.handoffs = summary.handoffs
            live.completion.summary = summary
        if live.complete:
            live.updates.put_nowait(None)

    def _record_tokens(self, live: _Live, n: int) -> None:
        now = time.monotonic()
        if live.first_token_at is None:
            live.first_token_at = now
            self.metrics.first_token(now - live.submitted_at)
        else:
            self.metrics.inter_token((now - live.last_token_at) / n)
        live.last_token_at = now


def _holders(entry: str, assigned: Mapping[str, str] | None) -> set[str] | None:
    """The endpoints a request can be on: its entry and the replicas it was told to use
    (None when it was not told: a model may pick any replica then)."""
    return {entry, *assigned.values()} if assigned else None


# --------------------------------------------------------------------------- OpenAI flow
def choice_error(done: Completion) -> OpenAIError:
    """The OpenAI error a failed choice ends with."""
    if done.error_kind == "timeout":
        return RequestTimeoutError(f"The request timed out: {done.error}.")
    if done.error_kind == "unavailable":
        return ServiceUnavailableError(f"The request could not be completed: {done.error}.")
    return RequestFailedError(f"The request failed: {done.error}.")


@dataclass
class StreamedChoices:
    """A streaming answer: the SSE body, and the choice tasks to cancel however the
    response ends (a client that leaves before the first byte never starts the body)."""

    tasks: list[asyncio.Future]
    body: AsyncIterator[bytes]


class IngressServer:
    """The OpenAI side of an ingress over an ``IngressCore``, with no Ray and no HTTP in it.

    - admission: 503 ``OverloadedError`` when ``n`` more choices would pass ``max_active()``,
      503 ``model_unavailable`` while ``unavailable()`` names a model without a replica;
    - entry load-balancing: each choice goes to the least loaded replica of the entry
      model (``entries()``), counted before the await so concurrent submits spread;
    - the per-choice loop: committed tokens -> incremental detokenizer -> text pieces; a
      stop string aborts the choice everywhere; a failed choice is its OpenAI error.

    ``respond`` answers a prepared request: the response object, or ``StreamedChoices``.
    ``deployments/ingress.py`` puts HTTP routes around it; tests drive it over
    ``LocalRuntime`` on CPU.
    """

    def __init__(
        self,
        core: IngressCore,
        tokenizer: Any,
        served_model_name: str,
        entries: Callable[[], Sequence[str]],
        endpoints_for: Callable[[str], Mapping[str, str]] | None = None,
        max_active: Callable[[], int] = lambda: 1 << 30,
        unavailable: Callable[[], str | None] = lambda: None,
        models: Sequence[str] = (),
        replicas_of: Callable[[str], Sequence[str]] | None = None,
        block_sizes: Mapping[str, int] | None = None,
    ) -> None:
        self.core = core
        self.models = list(models)  # entry first; (): the core's endpoints name them
        self.token_text = TokenText(tokenizer)
        self.tokenizer = tokenizer
        self.served_model_name = served_model_name
        self.entries = entries
        self.endpoints_for = endpoints_for
        self.max_active = max_active
        self.unavailable = unavailable
        self.entry_load: dict[str, int] = {}  # choices in flight per entry replica
        self.entry_total: dict[str, int] = {}  # choices ever sent per entry replica
        # cache-aware placement (runtime/affinity.py): with ``replicas_of`` (model -> its
        # live endpoints), the other models' replicas are chosen like the entry's
        self.replicas_of = replicas_of
        self.block_sizes = dict(block_sizes or {})
        self.affinity: dict[str, PrefixAffinity] = {}  # model ("" = the entry) -> chooser
        self.assigned_load: dict[str, int] = {}  # choices in flight per non-entry endpoint
        self._assigned: dict[str, list[str]] = {}  # rid -> its non-entry endpoints
        self._ids = itertools.count()

    def entry(self, prompt: Sequence[int] | None = None, cache_salt: str | None = None) -> str:
        """The entry replica for a prompt: the one that last got its longest prefix (its
        KV cache likely holds it) unless that one is busier than the least loaded by more
        than the chooser's bound; the least loaded replica without a prompt."""
        loads = {e: self.entry_load.get(e, 0) for e in self.entries()}
        if prompt is None or len(loads) < 2:
            return min(loads, key=loads.__getitem__)
        return self._chooser("").choose(prompt, loads, cache_salt)

    def _chooser(self, model: str) -> PrefixAffinity:
        chooser = self.affinity.get(model)
        if chooser is None:
            name = model or (self.models[0] if self.models else "")
            chooser = self.affinity[model] = PrefixAffinity(self.block_sizes.get(name, 16))
        return chooser

    def forget_replica(self, endpoint: str) -> None:
        """A replica is gone: no prefix is sent to it for its cache any more."""
        for chooser in self.affinity.values():
            chooser.forget(endpoint)

    def _endpoints(
        self, rid: str, prompt: Sequence[int], cache_salt: str | None
    ) -> Mapping[str, str] | None:
        """The replica of each non-entry model a choice will use."""
        if self.replicas_of is None:
            return self.endpoints_for(rid) if self.endpoints_for else None
        out: dict[str, str] = {}
        for model in self.models[1:]:
            options = list(self.replicas_of(model))
            if not options:
                raise LookupError(f"no replica of model {model!r} is registered")
            loads = {e: self.assigned_load.get(e, 0) for e in options}
            out[model] = self._chooser(model).choose(prompt, loads, cache_salt)
        for endpoint in out.values():
            self.assigned_load[endpoint] = self.assigned_load.get(endpoint, 0) + 1
        self._assigned[rid] = list(out.values())
        return out

    def _unassign(self, rid: str) -> None:
        for endpoint in self._assigned.pop(rid, ()):
            self.assigned_load[endpoint] -= 1

    async def respond(
        self, prepared: PreparedRequest, chat: bool, timeout_s: float | None = None
    ) -> ChatCompletion | TextCompletion | StreamedChoices:
        submitted = await self.submit(prepared, timeout_s)
        prompt_len = len(prepared.prompt_token_ids)
        name = self.served_model_name
        if not prepared.sampling.stream:
            tasks = self.start_choices(submitted, prepared, None, chat)
            try:
                choices = await asyncio.gather(*tasks)
            finally:
                for task in tasks:
                    task.cancel()
            build = build_chat_completion if chat else build_completion
            return build(name, prompt_len, choices)
        stream_cls = ChatStream if chat else CompletionStream
        stream = stream_cls(
            name, prepared.sampling.n, include_usage=prepared.sampling.include_usage
        )
        pieces: asyncio.Queue = asyncio.Queue()
        # Started now: the body may never be iterated if the client leaves first.
        tasks = self.start_choices(submitted, prepared, pieces, chat)
        return StreamedChoices(tasks, self._sse(stream, tasks, pieces, prompt_len))

    def check_admission(self, n: int = 1) -> None:
        """503 ``OverloadedError`` when ``n`` more choices would pass ``max_active()``. The
        HTTP routes call it with ``n = 1`` before reading the body, so a refusal costs no
        parsing or tokenizing (512 clients at once: docs/reliability.md); ``submit`` checks
        again with the request's ``n``."""
        if self.core.num_active + n > self.max_active():
            raise OverloadedError("Too many requests in flight; retry shortly.", retry_after_s=1)

    async def submit(
        self, prepared: PreparedRequest, timeout_s: float | None = None
    ) -> list[tuple[str, str]]:
        """Admit the request and send its ``n`` choices: [(request id, entry endpoint)]."""
        sampling = prepared.sampling
        self.check_admission(sampling.n)
        missing = self.unavailable()
        if missing is not None:
            raise ServiceUnavailableError(
                f"Model(s) {missing} have no healthy replica right now; retry shortly.",
                code="model_unavailable",
            )
        # the client's X-Request-Id leads every rid, so each model's log lines name it
        base = f"{prepared.request_id or 'req'}-{time.time_ns():x}-{next(self._ids)}"
        submitted = []
        try:
            prompt, salt = prepared.prompt_token_ids, sampling.cache_salt
            for i in range(sampling.n):
                rid, entry = f"{base}-{i}", self.entry(prompt, salt)
                self.entry_load[entry] = self.entry_load.get(entry, 0) + 1  # before the await
                try:
                    endpoints = self._endpoints(rid, prompt, salt)
                    await self.core.submit(
                        rid,
                        prompt,
                        sampling.to_spec(i),
                        entry,
                        timeout_s=timeout_s,
                        endpoints=endpoints,
                    )
                except BaseException:
                    self.entry_load[entry] -= 1
                    self._unassign(rid)
                    raise
                self.entry_total[entry] = self.entry_total.get(entry, 0) + 1
                submitted.append((rid, entry))
        except BaseException as exc:  # incl. cancellation: free the choices already sent
            for rid, entry in submitted:
                self.entry_load[entry] -= 1
                self._unassign(rid)
                self.core.abort_nowait(rid)
                self.core.release(rid)
            if isinstance(exc, OpenAIError) or not isinstance(exc, Exception):
                raise
            logger.warning("ingress: submitting failed: %r", exc)
            raise ServiceUnavailableError(
                "The entry model cannot take requests right now; retry shortly.",
                code="model_unavailable",
            ) from exc
        return submitted

    async def choice(
        self,
        index: int,
        rid: str,
        entry: str,
        prepared: PreparedRequest,
        pieces: asyncio.Queue | None,
        chat: bool = False,
    ) -> ChoiceResult:
        """One choice to its end: text pieces to ``pieces`` (streaming), the result back.

        A request that asked for logprobs or a routing trace gets them per token: in a
        streamed chunk for the tokens whose text it carries (``detok.settled()``), the
        rest in the finish chunk; non-streaming, for the whole output. Both stop at the
        ``completion_tokens`` (a token past a stop string is never reported)."""
        detok = IncrementalDetokenizer(
            self.tokenizer, stop=prepared.sampling.stop, prompt_token_ids=prepared.prompt_token_ids
        )
        reports = prepared.sampling.reports_tokens
        parser = prepared.chat_parser() if chat else None  # reasoning / tool calls
        out: list[int] = []  # output token ids received
        sent = 0  # tokens already reported in a chunk
        try:
            async for tokens in self.core.stream(rid):
                text = detok.push(tokens)
                text = parser.push(text) if parser is not None else text
                if pieces is not None and text:
                    extra = None
                    if reports:
                        out += tokens
                        settled = detok.settled()
                        if settled > sent:
                            log = self.core.commit_log(rid)
                            extra = self._details(
                                prepared, chat, out, log.writers, log.infos, sent, settled, detok
                            )
                            sent = settled
                    pieces.put_nowait((index, text, extra))
                elif reports:
                    out += tokens
                if detok.stopped:
                    self.core.abort_nowait(rid, reason="stop")
                    break
        finally:  # no await here: a cancelled task (client gone) must still clean up
            done = self.close_choice(rid, entry)
        assert done is not None  # only this finally or the task's done callback close it
        if done.error is not None:
            raise choice_error(done)
        tail = detok.finish()
        tail = parser.end(tail) if parser is not None else tail
        n = detok.num_tokens
        details = None
        if reports:  # the tokens no chunk reported yet (all of them when not streaming)
            details = self._details(prepared, chat, out, done.writers, done.infos, sent, n, detok)
            if tail and pieces is not None:
                pieces.put_nowait((index, tail, details))
                details = None
        elif tail and pieces is not None:
            pieces.put_nowait((index, tail, None))
        reason = finish_reason(done.finish_reason, stopped_by_string=detok.stopped)
        reason = parser.finish_reason(reason) if parser is not None else reason
        models = self.model_names(done.writers)
        metrics = request_metrics(
            n, done.writers, models, done.ttft_s, done.mean_itl_s, done.e2e_s,
            done.handoffs, done.summary,
        )  # fmt: skip
        return ChoiceResult(
            index,
            detok.text,
            reason,
            n,
            ChoiceResult.routing_of(done.counts, done.handoffs),
            metrics,
            details,
            parser.message if parser is not None else None,
        )

    def _details(
        self,
        prepared: PreparedRequest,
        chat: bool,
        token_ids: Sequence[int],
        writers: Sequence[str | None],
        infos: Sequence[Any],
        start: int,
        end: int,
        detok: IncrementalDetokenizer,
    ) -> dict[str, Any]:
        """``routing_trace`` and/or ``logprobs`` of output tokens ``[start, end)``."""
        sampling, text = prepared.sampling, self.token_text
        details: dict[str, Any] = {}
        if sampling.logprobs is not None:
            details["logprobs"] = (
                chat_logprobs_part(token_ids, infos, start, end, text)
                if chat
                else completion_logprobs_part(token_ids, infos, start, end, text, detok.token_ends)
            )
        if sampling.routing_trace:
            models = self.model_names(writers)
            details["routing_trace"] = trace_part(
                token_ids, writers, infos, start, end, text, models
            )
        return details

    def model_names(self, writers: Sequence[str | None] = ()) -> list[str]:
        """The deployment's models, entry first: as given, else from the core's model
        endpoints (``model/replica``, in model order), else the writers seen."""
        if self.models:
            return self.models
        endpoints = getattr(self.core, "all_endpoints", None)
        names = [e.split("/", 1)[0] for e in endpoints()] if endpoints is not None else []
        return list(dict.fromkeys(names or [w for w in writers if w is not None]))

    def start_choices(
        self,
        submitted: list[tuple[str, str]],
        prepared: PreparedRequest,
        pieces: asyncio.Queue | None,
        chat: bool = False,
    ) -> list[asyncio.Task]:
        """One task per choice. Each also closes its request when the task ends: a task
        cancelled before it first ran never enters ``choice``'s ``finally``."""
        tasks = []
        for i, (rid, entry) in enumerate(submitted):
            task = asyncio.ensure_future(self.choice(i, rid, entry, prepared, pieces, chat))
            task.add_done_callback(lambda _, rid=rid, entry=entry: self.close_choice(rid, entry))
            tasks.append(task)
        return tasks

    def close_choice(self, rid: str, entry: str) -> Completion | None:
        """Abort (a no-op once complete) and release a choice, once; None if already."""
        if rid not in self.core.live:
            return None
        self.entry_load[entry] -= 1
        self._unassign(rid)
        self.core.abort_nowait(rid)
        return self.core.release(rid)

    async def _sse(
        self,
        stream: ChatStream | CompletionStream,
        tasks: list[asyncio.Future],
        pieces: asyncio.Queue,
        prompt_len: int,
    ) -> AsyncIterator[bytes]:
        frames = merge_choice_streams(stream, tasks, pieces, prompt_len)
        try:
            async with contextlib.aclosing(frames):  # a disconnect aborts the choices now
                async for frame in frames:
                    yield frame
        except Exception as exc:  # never a cut connection: the error event, then [DONE]
            logger.exception("ingress: stream failed")
            yield sse_error(exc) + SSE_DONE
