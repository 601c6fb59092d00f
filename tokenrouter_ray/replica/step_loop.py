"""The engine's own thread: one model replica's step loop, with host work off the critical path.

A ``StepLoop`` owns a thread that is the only code touching its sub-server's engine, and
holds the step's parts (``route``, ``decide_and_commit``, ``report``, ``record``); its
``SubServer`` (replica/subserver.py) keeps the inbox, the per-request state and the event
loop's tasks, and the messages are built by ``replica/messages.py``. The thread never
hops threads or awaits per step. One iteration, with step ``t`` running on the device:

    collect(t)                      wait for the device: sampled tokens (one readback)
    route(t)                        the policy (on the host when it needs no tensor, else on
                                    the step's device tensors); destinations out
    decide + commit(t)              ``Policy.send`` for leaving rows, then the engine's commit
                                    (append, stop checks, pause leavers): engine state only
    apply held / late messages      what arrived for the rows of step t, or after the draft
    launch(t+1)                     the drafted step, checked against what changed, started
                                                                    <- critical path ends
    report(t)                       the tuner's window; HANDOFFs posted at once, then COMMIT
                                    and FINISHED; the event loop encodes and sends them (one
                                    frame per destination); then metrics
    while t+1 runs                  apply messages as they arrive (those for the rows of t+1
                                    held), draft step t+2 (``Engine.draft``), again after
                                    each arrival; wait for the device or the next message

So the step period is max(forward, critical-path host work), and the critical path holds
only what decides the next batch and cannot be known before step t ends: routing, commit,
and checking the draft. A row that leaves after step t costs nothing in step t+1: the draft
assumed it stays, the launch drops it (it was paused at commit) before anything reaches the
device, so no forward row and no KV is spent on it; only its reserved KV slot stays with it
for its return. (Scheduling from the committed state keeps exactness: the reference tests
are unchanged.)

The device side: a runner whose ``launch`` returns before the device is done (the simulated
device; CUDA, ``engine/device_step.py``) gives the loop a step whose ``wait_done(wake)``
returns when the device is done or a message arrives; a CPU runner computes the step in
``launch`` and the overlapped work then runs after it.

The event loop keeps the receive task (frames -> ``SubServer.deliver`` -> the inbox, then
``wake``) and the sender task (messages posted by ``post`` in order, sent per destination).
Errors are contained as before: a failed step fails the requests that could have been in it,
a failed report fails its requests, a failed draft only means the launch schedules from
scratch, and the loop goes on.

``HostProfile`` accumulates where the host time goes per phase (critical vs overlapped), for
``loadtest`` and the status routes.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenrouter_ray.engine.outputs import PendingStep, RequestOutput, StepResult
from tokenrouter_ray.protocol import Dropped, MsgKind, PeerReq
from tokenrouter_ray.routing.policy import (
    RequestView,
    RouteBatch,
    Send,
    host_scores,
    threshold_overrides,
)

if TYPE_CHECKING:
    from tokenrouter_ray.replica.subserver import SubServer

logger = logging.getLogger(__name__)

# Python hands the GIL to a waiting thread only after this long (5 ms by default): a step
# loop waking from a finished forward could sit that long behind the event loop's sends.
GIL_SWITCH_INTERVAL_S = 0.0005

MAX_WAIT_S = 3600.0  # an idle wait re-checks at least this often (also: inf deadlines)
STATE_PERIOD_S = 0.05  # the engine's gauges, at most this often


@dataclass
class HostProfile:
    """Host seconds per phase over ``steps`` steps: on the critical path ``route``,
    ``commit``, ``receive`` and ``launch`` (the drafted step checked and the rest scheduled,
    ``schedule``, then the runner's preparation and start); overlapped ``report``
    (messages, statistics, metrics), ``send`` (the event loop's encoding and sending),
    ``receive_ahead`` (messages applied while the step runs) and ``draft`` (the next step
    scheduled while it runs). ``critical_s`` is the time
    from a forward's end (collect returned) to the next launch returned, summed: the part of
    the step period the host adds; ``wait_s``, the time the host waited for the device."""

    steps: int = 0
    rows: int = 0  # sampled rows, summed over steps
    phases: dict[str, float] = field(default_factory=dict)
    critical_s: float = 0.0
    wait_s: float = 0.0
    period_s: float = 0.0  # launch to launch, summed over back-to-back steps
    periods: int = 0  # back-to-back steps (launched right after the previous one's commit)
    frames: int = 0  # frames handed to the channel
    messages: int = 0
    # messages from peers and ingresses: built -> received (event loop) -> applied (this
    # loop), summed over every message (a wall clock across processes: same host only)
    received: int = 0
    received_after_s: float = 0.0
    applied: int = 0
    applied_after_s: float = 0.0

    def add(self, phase: str, seconds: float) -> None:
        self.phases[phase] = self.phases.get(phase, 0.0) + seconds

    def per_step_us(self) -> dict[str, float]:
        """Mean microseconds per step of each phase, and of the critical path."""
        n = max(1, self.steps)
        out = {k: v / n * 1e6 for k, v in sorted(self.phases.items())}
        out["critical"] = self.critical_s / n * 1e6
        out["wait"] = self.wait_s / n * 1e6
        out["period"] = self.period_s / max(1, self.periods) * 1e6
        return out

    def message_latency_us(self) -> dict[str, float]:
        """Mean microseconds from a message's building at its sender to its receipt here
        and to its application by this loop (what a handoff waits before it can run)."""
        return {
            "received": self.received_after_s / max(1, self.received) * 1e6,
            "applied": self.applied_after_s / max(1, self.applied) * 1e6,
        }

    def snapshot(self) -> dict[str, float | int | dict[str, float]]:
        return {
            "steps": self.steps,
            "rows": self.rows,
            "frames": self.frames,
            "messages": self.messages,
            "per_step_us": self.per_step_us(),
            "message_latency_us": self.message_latency_us(),
        }


@dataclass
class Routed:
    """Step ``t``'s routing, read before its commit: every row's destination, the policy's
    per-row scores on the host (only when some row asked for a routing trace), how long the
    policy took, and the requests whose first output token the step sampled."""

    destinations: list[int]
    scores: list[float | None] | None = None
    route_s: float | None = None
    first_tokens: list = field(default_factory=list)


@dataclass
class Decided:
    """Step ``t``'s commit: rows leaving (rid -> (destination, Send)), rows whose routing
    failed (rid -> error), the rows whose sampled token was dropped, the engine's outputs."""

    leaving: dict[str, tuple[int, Send]]
    failed: dict[str, str]
    drop: set[str]
    outputs: list[RequestOutput]
    committed: int = 0  # tokens reported as committed (set by ``report``)


class _Failed:
    """A launch that raised: the error, reported after the previous step's messages."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class StepLoop:
    """The thread that steps one engine, and the step's parts (see the module docstring)."""

    def __init__(self, server: SubServer) -> None:
        self.server = server
        self.engine = engine = server.engine
        self.policy = policy = server.policy
        # the sub-server's parts the step reads and writes (same objects, same thread)
        self.name, self.index, self.models = server.name, server.index, server.models
        self.metrics, self.messages, self.stats = server.metrics, server.messages, server.stats
        self.tracked = server.tracked
        engine.keep_outputs(logits=policy.needs_logits, hidden=policy.needs_hidden)
        self._embed = engine.embed_tokens if policy.needs_embeddings else None
        self.profile = HostProfile()
        self.num_steps = 0
        self._deferred_since: float | None = None  # when the launch threshold began holding
        self._state_due = 0.0  # monotonic time the engine's gauges are due again
        self._wake = threading.Event()
        self._closing = False
        self._thread: threading.Thread | None = None
        self._launched_at: float | None = None  # when the running step was launched
        self.error: BaseException | None = None  # what stopped the thread, if anything
        # watchdog (``SubServer.health_problem``): since when the current step has run, and
        # how many steps in a row failed
        self.step_since: float | None = None  # monotonic
        self.failed_in_row = 0

    # ------------------------------------------------------------------ control
    def start(self) -> None:
        if sys.getswitchinterval() > GIL_SWITCH_INTERVAL_S:  # process-wide
            sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        self._thread = threading.Thread(
            target=self._run, name=f"{self.server.name}-steps", daemon=True
        )
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def stop(self, timeout: float = 10.0) -> None:
        self._closing = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # --------------------------------------------------------------------- loop
    def _run(self) -> None:
        step: PendingStep | None = None
        try:
            while not self._closing:
                try:
                    step = self._iterate(step)
                except Exception:  # last line of defence: log, count, go on
                    logger.exception("%s: step loop iteration failed", self.server.name)
                    self.server.metrics.error(self.server.name, "loop_error")
                    self.engine.discard_uncommitted()
                    step = None
                    time.sleep(0.01)
        except BaseException as exc:
            self.error = exc
            raise

    def _iterate(self, step: PendingStep | None) -> PendingStep | None:
        server = self.server
        if step is None:
            t0 = time.perf_counter()
            out: list = []
            server.between_steps(out)
            self.profile.add("receive", time.perf_counter() - t0)
            if out:
                server.post(out)
            launched = self._launch()
            if isinstance(launched, _Failed):
                server.post(server.fail_runnable(f"step failed: {launched.error}"))
                return None
            if launched is None:
                self._idle()
            else:  # after an idle spell: not back-to-back
                self._launched_at = time.perf_counter()
                self._while_running(launched)
            return launched
        try:
            result = self.engine.collect(step)
        except Exception as exc:  # a broken step must not take the model down
            logger.exception("%s: step failed", server.name)
            server.metrics.error(server.name, "step_failed")
            self._failed()
            server.post(server.fail_runnable(f"step failed: {exc}"))
            return None
        self.step_since, self.failed_in_row = None, 0
        done = time.perf_counter()
        prof = self.profile
        prof.wait_s += step.waited_s
        prof.steps += 1
        prof.rows += len(result.request_ids)
        try:
            routed = self.route(result)
        except Exception as exc:
            logger.exception("%s: routing failed", server.name)
            server.metrics.error(server.name, "step_failed")
            self._failed()
            server.post(server.fail_runnable(f"step failed: {exc}"))
            return None
        t1 = time.perf_counter()
        prof.add("route", t1 - done)
        decided = self.decide_and_commit(result, routed)
        t2 = time.perf_counter()
        prof.add("commit", t2 - t1)
        out = []
        server.between_steps(out)
        t3 = time.perf_counter()
        prof.add("receive", t3 - t2)
        launched = self._launch()  # the next forward runs from here on
        t4 = time.perf_counter()
        prof.critical_s += t4 - done
        if isinstance(launched, PendingStep) and self._launched_at is not None:
            prof.period_s += t4 - self._launched_at
            prof.periods += 1
        self._launched_at = t4 if isinstance(launched, PendingStep) else None
        self.report(result, routed, decided, out)  # overlaps the forward just launched
        if out:
            server.post(out)
        self.record(result, routed, decided)
        prof.add("report", time.perf_counter() - t4)
        if isinstance(launched, _Failed):
            server.post(server.fail_runnable(f"step failed: {launched.error}"))
            return None
        if launched is not None:
            self._while_running(launched)
        return launched

    def _while_running(self, step: PendingStep) -> None:
        """Until the device is done with ``step``: apply messages as they arrive (held for
        the requests in the step) and draft the next step, again after each arrival so
        that it holds what arrived; the launch after ``collect`` then only checks what
        changed. Returns when the step is done (at once on a runner that computed it at
        launch: the draft would only double the launch's work)."""
        server, engine, prof = self.server, self.engine, self.profile
        drafted = False
        waited = 0.0
        while not self._closing:
            self._wake.clear()
            if step.ready():  # nothing left to overlap (a step computed at launch, too)
                break
            t0 = time.perf_counter()
            arrived = bool(server.inbox)
            if arrived:
                out: list = []
                server.receive_while_running(step.request_ids, out)
                if out:
                    server.post(out)
            t1 = time.perf_counter()
            if arrived or not drafted:
                drafted = True
                try:
                    engine.draft()
                except Exception:  # the launch then schedules from scratch
                    logger.exception("%s: drafting the next step failed", server.name)
                    server.metrics.error(server.name, "loop_error")
                prof.add("draft", time.perf_counter() - t1)
            if arrived:
                prof.add("receive_ahead", t1 - t0)
            t2 = time.perf_counter()
            done = step.wait_done(self._wake)
            waited += time.perf_counter() - t2
            if done:
                break
        prof.wait_s += waited

    def _launch(self) -> PendingStep | _Failed | None:
        """Schedule and start the next step (None: idle or deferred)."""
        server = self.server
        started = time.perf_counter()
        self.step_since = time.monotonic()  # a runner without launch computes in here
        try:
            step = self.engine.launch()
        except Exception as exc:
            logger.exception("%s: step failed", server.name)
            server.metrics.error(server.name, "step_failed")
            self.engine.discard_uncommitted()
            self._failed()
            return _Failed(exc)
        if step is None:
            self.step_since = None
            self.note_deferred(self.engine.deferred_until is not None)
            return None
        self.profile.add("launch", time.perf_counter() - started)
        if step.timings is not None:  # of which the scheduler (the draft checked, the rest)
            self.profile.add("schedule", step.timings.schedule)
        self.note_launched(started)
        return step

    def _failed(self) -> None:
        self.step_since = None
        self.failed_in_row += 1

    def _idle(self) -> None:
        """Nothing to launch: sleep until woken (inbox, thresholds, stop), the deferred
        launch's deadline, or the next expiry sweep while requests are held."""
        self._wake.clear()
        server = self.server
        if server.has_work_waiting:
            return
        deadline = self.engine.deferred_until
        if deadline is None and server.tracked:
            deadline = server.next_sweep
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        self._wake.wait(timeout if timeout is None or timeout < MAX_WAIT_S else MAX_WAIT_S)

    # ------------------------------------------------------------- the step's parts
    # Called by ``_iterate`` and ``_launch``, in this order, on this thread.
    def note_deferred(self, deferred: bool) -> None:
        """Nothing launched: the threshold held runnable work back (``deferred``) or idle.
        The engine's gauges catch up here (a step's report sets them otherwise)."""
        self.metrics.engine_state(self.name, self.engine)
        if deferred and self._deferred_since is None:
            self._deferred_since = time.monotonic()
        elif not deferred:
            self._deferred_since = None

    def note_launched(self, started: float) -> None:
        """A step was launched (``started``: ``time.perf_counter()`` before scheduling)."""
        if self._deferred_since is not None:
            self.metrics.deferred_wait(self.name, time.monotonic() - self._deferred_since)
            self._deferred_since = None
        self.num_steps += 1
        if self.server.unqueued:
            self._note_queued(time.time() - (time.perf_counter() - started))

    def route(self, result: StepResult) -> Routed:
        """The policy's destination for every row of a collected step (before its commit),
        and the per-row scores on the host when some row's request asked for a trace."""
        if not result.request_ids:
            return Routed([])
        requests, is_first = self.engine.step_requests(result), result.is_first
        batch = RouteBatch.of_step(
            self.index,
            result,
            prev_tokens=result.prev_token_ids,
            is_first=is_first,
            seeds=result.seeds,
            embed=self._embed,
            # each row's request's own routing threshold (None when no row has one)
            threshold_overrides=threshold_overrides(
                [r.sampling.route_thresholds for r in requests], self.index
            ),
        )
        t0 = time.perf_counter()
        destinations = self.policy.route_step(batch)
        route_s = time.perf_counter() - t0
        scores = None
        if batch.scores is not None and any(r.sampling.trace for r in requests):
            scores = host_scores(batch)
        firsts = [r for r, first in zip(requests, is_first, strict=True) if first]
        return Routed(destinations, scores, route_s, firsts)

    def decide_and_commit(self, result: StepResult, routed: Routed) -> Decided:
        """The policy's decisions for leaving rows, then the engine's commit (append,
        stop checks, pause leavers): what the next launch must see."""
        leaving, failed = self._decide(result, routed.destinations)
        drop = {rid for rid, (_, send) in leaving.items() if send.drop_sampled}
        outputs = self.engine.commit(result, drop=drop, pause=leaving.keys())
        return Decided(leaving, failed, drop, outputs)

    def report(
        self, result: StepResult, routed: Routed, decided: Decided, out: list[PeerReq]
    ) -> None:
        """After the next step was launched: the tuner's statistics of the step (before any
        of its messages leaves), then the messages reporting the commit. HANDOFFs are
        posted at once (a peer can start on them while the rest is built); COMMIT and
        FINISHED go into ``out``."""
        self._record_step(result, routed.destinations, decided.drop)
        handoffs: list[PeerReq] = []
        decided.committed = self._report(result, routed.scores, decided, handoffs, out)
        self.server.post(handoffs)
        self._fail_requests(decided.failed, out)

    def record(self, result: StepResult, routed: Routed, decided: Decided) -> None:
        """After the step's messages are posted: its metrics. The engine's gauges are set at
        most every ``STATE_PERIOD_S`` (they are exported far less often; an idle loop sets
        them before it sleeps)."""
        timings = result.timings
        self.metrics.step(
            self.name,
            result.batch_size,
            timings.total,
            routed.route_s,
            routed.first_tokens,
            started=time.monotonic() - timings.total - (routed.route_s or 0.0),
        )
        self.metrics.committed(self.name, decided.committed, len(decided.drop))
        now = time.monotonic()
        if now >= self._state_due:
            self._state_due = now + STATE_PERIOD_S
            self.metrics.engine_state(self.name, self.engine)

    def _note_queued(self, started: float) -> None:
        """Queue time (the ingress sent the NEW -> the start of the first step computing
        it here) and the prompt tokens found in the prefix cache, of the new requests this
        step computed."""
        for rid, sent in list(self.server.unqueued.items()):
            request = self.engine.get_request(rid)
            tracked = self.tracked.get(rid)
            if request is None or tracked is None:
                del self.server.unqueued[rid]
            elif request.num_computed_tokens > 0:
                tracked.queue_s = max(0.0, started - sent)
                tracked.cached_tokens = max(0, request.num_cached_tokens)
                del self.server.unqueued[rid]

    def _decide(
        self, result: StepResult, destinations: list[int]
    ) -> tuple[dict[str, tuple[int, Send]], dict[str, str]]:
        """The policy's ``send`` for every row routed elsewhere: rid -> (destination, Send).
        A row whose ``send`` raises stays here and is reported in the second map (rid ->
        error): its request ends with an error once its token is committed."""
        leaving: dict[str, tuple[int, Send]] = {}
        failed: dict[str, str] = {}
        for rid, position, dst in zip(
            result.request_ids, result.positions, destinations, strict=True
        ):
            if dst == self.index:
                continue
            try:
                view = RequestView(rid, self.index, position, self.tracked[rid].policy_state)
                leaving[rid] = (dst, self.policy.send(view, dst))
            except Exception as exc:
                failed[rid] = f"routing to {self.models[dst]} failed: {exc!r}"
        return leaving, failed

    def _record_step(self, result: StepResult, destinations: list[int], drop: set[str]) -> None:
        """The step and every row's move into the threshold tuner's statistics window."""
        now = time.monotonic()
        active = self.engine.active_requests
        self.stats.record_step(
            result.batch_size, result.timings.total, now, active, result.num_scheduled_tokens
        )
        for rid, dst in zip(result.request_ids, destinations, strict=True):
            self.stats.record_move(self.name, self.models[dst], int(rid not in drop), now)

    def _report(
        self,
        result: StepResult,
        scores: list[float | None] | None,
        decided: Decided,
        handoffs: list[PeerReq],
        out: list[PeerReq],
    ) -> int:
        """The messages for one commit: HANDOFF for requests leaving (into ``handoffs``),
        COMMIT (new tokens) and FINISHED to the ingress (into ``out``). A handoff that
        cannot be built adds its request to ``failed``. Returns how many tokens were
        committed.

        Requests that asked for per-token reports (logprobs, routing trace) get one
        ``TokenInfo`` per committed token; a traced request's dropped token travels in
        its route state (``drops``) to the model that fills the position, whose COMMIT
        reports it."""
        leaving, failed, drop = decided.leaving, decided.failed, decided.drop
        rows = {rid: i for i, rid in enumerate(result.request_ids)}
        reports: list[PeerReq] = []
        committed = 0
        for o in decided.outputs:
            rid = o.request_id
            tracked = self.tracked.get(rid)
            if tracked is None:  # aborted or finished since the commit: nothing to report
                continue
            try:
                row = rows[rid]
                if rid in drop:
                    tracked.dropped += 1
                    if tracked.sampling.trace:
                        score = scores[row] if scores is not None else None
                        tracked.drops.append(Dropped(self.name, result.token_ids[row], score))
                if o.new_token_ids:
                    n = len(o.new_token_ids)
                    tracked.counts[self.name] = tracked.counts.get(self.name, 0) + n
                    committed += n
                    info = None
                    if tracked.sampling.reports_tokens:
                        info = [self.messages.token_info(tracked, result, row, scores)]
                    reports.append(
                        self.messages.to_ingress(
                            tracked,
                            MsgKind.COMMIT,
                            o.new_token_ids,
                            result.positions[row],
                            token_info=info,
                        )
                    )
                if o.finished:
                    self.server.finish(tracked, o.finish_reason, reports)
                elif rid in leaving:
                    dst, send = leaving[rid]
                    handoffs.append(
                        self.messages.handoff(tracked, self.engine.sequence(rid), dst, send.extras)
                    )
            except Exception as exc:  # e.g. no replica of the destination is known
                failed[rid] = f"handing {rid} on failed: {exc!r}"
        out += reports
        return committed

    def _fail_requests(self, failed: dict[str, str], out: list[PeerReq]) -> None:
        for rid, error in failed.items():
            logger.warning("%s: %s", self.name, error)
            self.metrics.error(self.name, "request_failed")
            self.server.fail_request(rid, error, out)
