"""One model replica: ``Replica``, the thread that steps its engine under a routing policy.

A ``Replica`` owns the engine, the policy, the per-request state (``replica/requests.py``:
routing state, ledger, global N, held messages), the message builder (``replica/messages.py``)
and the tuner's statistics window; its ``Mailbox`` (``replica/mailbox.py``) is the event
loop's side: frames in, frames out, and the call queue (``call``) through which the event
loop asks for anything that touches the engine (thresholds, the tuner's window, status and
info: ``replica/status.py``). So the step thread is the
only code touching the engine, by construction, and it never hops threads or awaits per step.

``step`` is one turn of that thread, with step ``t`` running on the device:

    collect(t)        wait for the device: sampled tokens (one readback)
    route(t)          the policy (on the host when it needs no tensor, else on the step's
                      device tensors); destinations out
    commit(t)         ``Policy.send`` for leaving rows, then the engine's commit (append,
                      stop checks, pause leavers): engine state only
    apply inbox       the event loop's calls, messages held for the rows of step t, what
                      arrived since, the expiry sweep
    launch(t+1)       the drafted step, checked against what changed, started
                                                          <- critical path ends
    report(t)         the tuner's window; HANDOFFs, COMMIT and FINISHED posted in one go
                      (one frame per destination, sent back to back); then metrics
    overlap(t+1)      while it runs: apply messages as they arrive (those for its rows held),
                      draft step t+2 (``Engine.draft``), again after each arrival

So the step period is max(forward, critical-path host work), and the critical path holds
only what decides the next batch and cannot be known before step t ends: routing, commit,
and checking the draft. A row that leaves after step t costs nothing in step t+1: the draft
assumed it stays, the launch drops it (it was paused at commit) before anything reaches the
device. (Scheduling from the committed state keeps exactness: the reference tests are
unchanged.)

The device side: a runner whose ``launch`` returns before the device is done (the simulated
device; CUDA, ``engine/device_step.py``) gives a step whose ``wait_done(wake)`` returns when
the device is done or a message arrives; a CPU runner computes the step in ``launch`` and
the overlapped work then runs after it.

Neither the thread nor the event loop dies on one request: a failed step fails the requests
that could have been in it, a failed report fails its requests, a failed draft only means
the launch schedules from scratch; each ends its requests with ``finish_reason="error"``,
is counted in ``tokenrouter_errors_total{type}``, and the loop goes on
(docs/user-guide/reliability.md).
``profile`` (``replica/profile.py``) sums the host time of each phase.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from tokenrouter_ray.engine.outputs import PendingStep, RequestOutput, StepResult
from tokenrouter_ray.metrics import Metrics
from tokenrouter_ray.protocol import Dropped, MsgKind, PeerReq
from tokenrouter_ray.replica.mailbox import Mailbox
from tokenrouter_ray.replica.messages import Messages
from tokenrouter_ray.replica.profile import HostProfile
from tokenrouter_ray.replica.requests import Requests
from tokenrouter_ray.replica.tracking import Tracked
from tokenrouter_ray.replica.waker import FrameWaker
from tokenrouter_ray.replica.window import WindowSnapshot, WindowStats
from tokenrouter_ray.routing.policy import (
    Policy,
    RequestView,
    RouteBatch,
    Send,
    capped_dst,
    decide,
    host_scores,
    threshold_overrides,
)
from tokenrouter_ray.thresholds import ThresholdTable
from tokenrouter_ray.transport.base import PeerChannel

if TYPE_CHECKING:
    from tokenrouter_ray.engine.engine import Engine

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Python hands the GIL to a waiting thread only after this long (5 ms by default): a step
# thread waking from a finished forward could sit that long behind the event loop's sends.
GIL_SWITCH_INTERVAL_S = 0.0005

MAX_WAIT_S = 3600.0  # an idle wait re-checks at least this often (also: inf deadlines)
STATE_PERIOD_S = 0.05  # the engine's gauges, at most this often
# a call from the event loop not served within this long (a step wedged on its device, the
# watchdog's case) is answered there instead, read-only
CALL_WAIT_S = 2.0


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


class Replica:
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
        self.models, self.index, self.name = models, index, models[index]
        self.engine, self.policy, self.channel = engine, policy, channel
        self.metrics = metrics if metrics is not None else Metrics(policy=policy.name)
        self.pick_endpoint = pick_endpoint  # (model, request id) -> endpoint, first visit
        self.messages = Messages(
            models, self.name, channel.name, lambda m, r: self.pick_endpoint(m, r), self.metrics
        )
        self.profile = HostProfile()
        self.stats = WindowStats()  # for the threshold tuner
        self.requests = Requests(
            self.name, index, channel.name, engine, policy, self.messages, self.metrics,
            self.profile, self.stats,
        )  # fmt: skip
        # the step thread's wake-up: a ``FrameWaker`` where it reads the channel itself
        self._wake: threading.Event | FrameWaker = threading.Event()
        self._frames: FrameWaker | None = None
        self.mailbox = Mailbox(
            self.name, channel, self.metrics, self.profile, self._wake.set,
            self.requests.undeliverable,
        )  # fmt: skip
        engine.keep_outputs(logits=policy.needs_logits, hidden=policy.needs_hidden)
        self._embed = engine.embed_tokens if policy.needs_embeddings else None
        self.running: PendingStep | None = None  # the step on the device
        self.num_steps = 0
        self.rows_stepped = 0  # rows of every step recorded (the autoscaler's load signal)
        self.steps_recorded = 0
        self.draining = False  # leaving: its requests are being moved elsewhere
        self._launch_error: BaseException | None = None  # a failed launch, reported after
        self._launched_at: float | None = None  # when the running step was launched
        self._deferred_since: float | None = None  # when the launch threshold began holding
        self._state_due = 0.0  # monotonic time the engine's gauges are due again
        self._state_stale = False  # the engine changed since its gauges were last set
        self._closing = False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None  # what stopped the thread, if anything
        # the watchdog (``health_problem``): since when the current step has run, and how
        # many steps in a row failed
        self.step_since: float | None = None  # monotonic
        self.failed_in_row = 0

    # ------------------------------------------------------------------ what it holds
    @property
    def endpoint(self) -> str:
        return self.channel.name

    @property
    def has_work_waiting(self) -> bool:
        """Messages or calls the step thread has not applied yet."""
        return bool(self.mailbox.inbox or self.requests.held or self.mailbox.calls)

    @property
    def holds_anything(self) -> bool:
        """Requests, messages to apply or messages to send (``LocalRuntime.wait_idle``)."""
        return bool(
            self.engine.has_unfinished
            or self.requests.tracked
            or self.has_work_waiting
            or self.mailbox.sending
        )

    @property
    def gauges_stale(self) -> bool:
        """The engine changed since the step thread last set its gauges (it sets them at
        most every ``STATE_PERIOD_S``, and when it goes idle)."""
        return self._state_stale and self.thread_alive

    # ------------------------------------------------------------------ control
    async def start(self) -> None:
        source = self.channel.receive_inline()
        if source is not None:  # the step thread reads the channel in its own waits
            waker = FrameWaker(source, self.mailbox._received)
            self._wake = self._frames = waker
            self.mailbox.wake = waker.set
        await self.mailbox.start(receive=source is None)
        if sys.getswitchinterval() > GIL_SWITCH_INTERVAL_S:  # process-wide
            sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        self._thread = threading.Thread(target=self._run, name=f"{self.name}-steps", daemon=True)
        if source is not None:
            source.inline_thread = self._thread  # the channel's close waits for it
        self._thread.start()

    async def stop(self) -> None:
        self._closing = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10.0)
        await self.mailbox.stop()

    @property
    def thread_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def alive(self) -> bool:
        """The receive and send tasks and the step thread running, the channel open (what
        a health check asks)."""
        return self.mailbox.running and self.thread_alive and not self.channel.closed

    def dead_tasks(self) -> list[str]:
        """Names of stopped loops, with why (for health-check messages)."""
        dead = self.mailbox.dead_tasks()
        if self._thread is not None and not self.thread_alive:
            dead.append(f"{self.name}-steps: {self.error!r}")
        return dead

    def health_problem(
        self, max_step_s: float, max_failed_steps: int, now: float | None = None
    ) -> str | None:
        """Why this replica should fail its health check (Serve then restarts it and its
        requests recover elsewhere), or None: a loop stopped, a step running past
        ``max_step_s`` (a wedged device), or ``max_failed_steps`` steps in a row failed (a
        sticky device error). ``now``: the monotonic time to judge at (default: now)."""
        if not self.alive:
            return f"model replica stopped: {self.dead_tasks()}"
        since = self.step_since
        now = time.monotonic() if now is None else now
        if since is not None and now - since > max_step_s:
            return f"a step has run for {now - since:.0f} s (limit {max_step_s:g} s)"
        if self.failed_in_row >= max_failed_steps:
            return f"{self.failed_in_row} steps in a row failed"
        return None

    # ------------------------------------------------- from the event loop (or any thread)
    def deliver(self, msgs: list[PeerReq]) -> None:
        """Queue messages for the step thread."""
        self.mailbox.deliver(msgs)

    def set_batch_thresholds(self, thresholds: ThresholdTable) -> None:
        """Adopt the tuner's table between two steps; a sleeping thread re-checks at once."""
        self.mailbox.calls.append(lambda out: self.engine.set_batch_thresholds(thresholds))
        self._wake.set()

    async def call(self, fn: Callable[[], T], read_only: bool = False) -> T:
        """``fn()`` on the step thread between two steps. With the thread gone there is no
        other thread to mind: it runs here. A ``read_only`` call not served within
        ``CALL_WAIT_S`` (a wedged step) runs here too."""
        if not self.thread_alive:
            return fn()
        served = asyncio.ensure_future(self.mailbox.call(fn))
        if not read_only:
            return await served
        done, _ = await asyncio.wait({served}, timeout=CALL_WAIT_S)
        if done:
            return served.result()
        served.cancel()
        return fn()

    async def window(self) -> WindowSnapshot:
        """The tuner's statistics window, now."""
        return await self.call(self.stats.snapshot)

    @property
    def holds_requests(self) -> bool:
        """A request is here (tracked, or in the engine: a prefill-only one included)."""
        return bool(self.requests.tracked) or self.engine.has_unfinished

    async def drain(self, timeout_s: float, ingresses: Iterable[str] = ()) -> int:
        """Leave without losing a request (scale-down, a rolling update): tell every ingress
        that may have a request here (those heard from, those of the requests held, and
        ``ingresses``) to move its requests off this replica (``MsgKind.DRAIN``): each
        re-creates them on another replica from its committed sequence and ABORTs them
        here, which frees their KV. Waits until none is left, at most ``timeout_s``.
        Returns how many were still here then."""
        self.draining = True

        def holders() -> set[str]:
            held = self.requests.tracked.values()
            return {t.ingress for t in held} | set(self.requests.active.ingresses())

        told = set(await self.call(holders, read_only=True)) | set(ingresses)
        msgs = [
            PeerReq(rid="", src=self.endpoint, dst=dst, kind=MsgKind.DRAIN, handoff_seq=0)
            for dst in sorted(told)
        ]
        for msg in msgs:
            try:
                await self.channel.send(msg.dst, [msg])
            except Exception as exc:  # that ingress is gone: its requests went with it
                logger.warning("%s: DRAIN to %s failed: %s", self.name, msg.dst, exc)
        deadline = time.monotonic() + timeout_s
        while self.holds_requests and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        left = len(self.requests.tracked)
        if left:
            logger.warning("%s: drained with %d requests still here", self.name, left)
        return left

    # ----------------------------------------------------------------- the thread
    def _run(self) -> None:
        if self._frames is not None:
            self._frames.own()
        try:
            while not self._closing:
                try:
                    self.step()
                except Exception:  # last line of defence: log, count, go on
                    logger.exception("%s: step loop iteration failed", self.name)
                    self.metrics.error(self.name, "loop_error")
                    self.engine.discard_uncommitted()
                    self.running = None
                    time.sleep(0.01)
        except BaseException as exc:
            self.error = exc
            raise

    def step(self) -> None:
        """One turn of the step thread (see the module docstring)."""
        running, prof = self.running, self.profile
        if running is None:  # idle, or after a failed step: nothing to collect
            self.post(self.apply_inbox())
            self.running = self.launch()
            if self.running is not None:  # after an idle spell: not back-to-back
                self._launched_at = time.perf_counter()
            elif self._launch_error is None:
                self.idle()
            self.report_failed_launch()
            if self.running is not None:
                self.overlap(self.running)
            return
        try:
            result = self.collect(running)
            collected = time.perf_counter()
            with prof.phase("route"):
                routed = self.route(result)
        except Exception as exc:  # a broken step must not take the model down
            logger.exception("%s: step failed", self.name)
            self.fail_step(exc)
            return
        with prof.phase("commit"):
            decided = self.commit(result, routed)
        out = self.apply_inbox()
        self.running = self.launch()  # the next forward runs from here on
        self.critical_path_ended(collected)
        with prof.phase("report"):
            self.report(result, routed, decided, out)  # overlaps the forward just launched
            self.record(result, routed, decided)
        self.report_failed_launch()
        if self.running is not None:
            self.overlap(self.running)

    # ------------------------------------------------------------- the step's phases
    def collect(self, step: PendingStep) -> StepResult:
        """Wait for the device: the step's sampled tokens."""
        result = self.engine.collect(step)
        self.running, self.step_since, self.failed_in_row = None, None, 0
        prof = self.profile
        prof.wait_s += step.waited_s
        prof.steps += 1
        prof.rows += len(result.request_ids)
        return result

    def route(self, result: StepResult) -> Routed:
        """The policy's destination for every row of a collected step (before its commit),
        and the per-row scores on the host when some row's request asked for a trace."""
        if not result.request_ids:
            return Routed([])
        requests, is_first = self.engine.step_requests(result), result.is_first
        firsts = [r for r, first in zip(requests, is_first, strict=True) if first]
        # each row's routing state: rows whose request is served alone (bypass) or caps the
        # top model's share, and each row's own threshold(s) ((): the policy's)
        tracked = self.requests.tracked
        rows = [tracked.get(rid) for rid in result.request_ids]
        own = [
            (row, t)
            for row, t in enumerate(rows)
            if t is not None and (t.alone or t.max_share is not None)
        ]
        if len(own) == len(rows) and all(t.alone for _, t in own):
            return Routed([self.index] * len(own), first_tokens=firsts)  # no policy at all
        batch = RouteBatch.of_step(
            self.index,
            result,
            prev_tokens=result.prev_token_ids,
            is_first=is_first,
            seeds=result.seeds,
            embed=self._embed,
            threshold_overrides=threshold_overrides(
                [() if t is None else t.thresholds for t in rows], self.index
            ),
        )
        t0 = time.perf_counter()
        destinations = decide(self.policy, batch)
        route_s = time.perf_counter() - t0
        if own:
            destinations = self._own_routing(result, destinations, own)
        scores = None
        if batch.scores is not None and any(r.sampling.trace for r in requests):
            scores = host_scores(batch)
        return Routed(destinations, scores, route_s, firsts)

    def _own_routing(
        self, result: StepResult, destinations: list[int], own: list[tuple[int, Tracked]]
    ) -> list[int]:
        """The policy's destinations with each request's own routing applied: a request
        served alone stays here; a capped one goes where ``capped_dst`` lets it."""
        destinations = list(destinations)
        top, here = len(self.models) - 1, self.index
        for row, t in own:
            if t.alone:
                destinations[row] = here
            else:
                committed = result.positions[row] - t.prompt_len
                top_tokens = t.counts.get(self.models[top], 0)
                destinations[row] = capped_dst(
                    destinations[row], here, top, top_tokens, committed, t.max_share
                )
        return destinations

    def commit(self, result: StepResult, routed: Routed) -> Decided:
        """The policy's decisions for leaving rows, then the engine's commit (append,
        stop checks, pause leavers): what the next launch must see. A row whose ``send``
        raised is paused too: the report ends its request after the next launch, and a
        request in that step must not change until it is collected (ended there, it took
        the whole step down with it)."""
        leaving, failed = self._decide(result, routed.destinations)
        drop = {rid for rid, (_, send) in leaving.items() if send.drop_sampled}
        outputs = self.engine.commit(result, drop=drop, pause=leaving.keys() | failed.keys())
        return Decided(leaving, failed, drop, outputs)

    def apply_inbox(self) -> list[PeerReq]:
        """Between steps, before a launch: what the event loop asked for (calls, failed
        sends), the messages held while the last step ran, the inbox, and the expiry sweep
        when it is due. Returns the messages that produced."""
        out: list[PeerReq] = []
        with self.profile.phase("receive"):
            if self._frames is not None:  # what arrived while this thread worked
                self._frames.poll()
            calls, requests, inbox = self.mailbox.calls, self.requests, self.mailbox.inbox
            while calls:
                calls.popleft()(out)
            if requests.held:
                requests.apply_held(out)
            if inbox:
                requests.apply_inbox(inbox, out)
            if time.monotonic() >= requests.next_sweep:
                requests.sweep_expired(out)
        return out

    def launch(self) -> PendingStep | None:
        """Schedule and start the next step (None: idle, deferred, or failed: the failure
        is reported after the last step's messages, ``report_failed_launch``)."""
        started = time.perf_counter()
        self.step_since = time.monotonic()  # a runner without launch computes in here
        try:
            step = self.engine.launch()
        except Exception as exc:
            logger.exception("%s: step failed", self.name)
            self.metrics.error(self.name, "step_failed")
            self.engine.discard_uncommitted()
            self.step_since = None
            self.failed_in_row += 1
            self._launch_error = exc
            return None
        if step is None:
            self.step_since = None
            self._note_deferred(self.engine.deferred_until is not None)
            return None
        self.profile.add("launch", time.perf_counter() - started)
        if step.timings is not None:  # of which the scheduler (the draft checked, the rest)
            self.profile.add("schedule", step.timings.schedule)
        self._note_launched(started)
        return step

    def report(
        self, result: StepResult, routed: Routed, decided: Decided, out: list[PeerReq]
    ) -> None:
        """After the next step was launched: the tuner's statistics of the step (before any
        of its messages leaves), then its messages, posted in one go: its HANDOFFs first,
        then ``out`` (what the inbox produced before the launch), its COMMITs and FINISHEDs,
        and the ends of requests whose report failed. One post sends a frame per
        destination back to back, so ZeroMQ's I/O thread can take them in one wake-up (a
        post of the handoffs alone could wake it once more a step), and a destination that
        has handoffs and a FINISHED gets one frame, not two."""
        self._record_step(result, routed.destinations, decided.drop)
        handoffs: list[PeerReq] = []
        decided.committed = self._report(result, routed.scores, decided, handoffs, out)
        self._fail_requests(decided.failed, out)
        self.post(handoffs + out)
        self.messages.record_handoffs()

    def record(self, result: StepResult, routed: Routed, decided: Decided) -> None:
        """After the step's messages are posted: its metrics. The engine's gauges are set at
        most every ``STATE_PERIOD_S`` (they are exported far less often; an idle thread sets
        them before it sleeps, ``idle``)."""
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
        self._state_stale = True
        now = time.monotonic()
        if now >= self._state_due:
            self._set_engine_state(now)

    def overlap(self, step: PendingStep) -> None:
        """Until the device is done with ``step``: apply messages as they arrive (held for
        the requests in the step) and draft the next step, again after each arrival so
        that it holds what arrived; the launch after ``collect`` then only checks what
        changed. Returns when the step is done (at once on a runner that computed it at
        launch: the draft would only double the launch's work)."""
        engine, prof, inbox = self.engine, self.profile, self.mailbox.inbox
        drafted = False
        waited = 0.0
        while not self._closing:
            self._wake.clear()
            if step.ready():  # nothing left to overlap (a step computed at launch, too)
                break
            arrived = bool(inbox)
            if arrived:
                with prof.phase("receive_ahead"):
                    out: list[PeerReq] = []
                    self.requests.apply_inbox(inbox, out, hold=step.request_ids)
                    self.post(out)
            if arrived or not drafted:
                drafted = True
                with prof.phase("draft"):
                    try:
                        engine.draft()
                    except Exception:  # the launch then schedules from scratch
                        logger.exception("%s: drafting the next step failed", self.name)
                        self.metrics.error(self.name, "loop_error")
            t0 = time.perf_counter()
            done = step.wait_done(self._wake)
            waited += time.perf_counter() - t0
            if done:
                break
        prof.wait_s += waited

    def idle(self) -> None:
        """Nothing to launch: sleep until woken (inbox, calls, stop), the deferred launch's
        deadline, or the next expiry sweep while requests are held. The engine's gauges are
        set first when they are stale and due (else the sleep ends when they are due)."""
        self._wake.clear()
        if self.has_work_waiting:
            return
        deadline = self.engine.deferred_until
        if deadline is None and self.requests.tracked:
            deadline = self.requests.next_sweep
        if self._state_stale:  # the gauges say what it holds while it sleeps
            now = time.monotonic()
            if now >= self._state_due:
                self._set_engine_state(now)
            elif deadline is None or self._state_due < deadline:
                deadline = self._state_due  # wake then to set them
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        self._wake.wait(timeout if timeout is None or timeout < MAX_WAIT_S else MAX_WAIT_S)

    # ------------------------------------------------------------------ helpers
    def post(self, out: list[PeerReq]) -> None:
        if out:
            self.mailbox.post(out)

    def critical_path_ended(self, collected: float) -> None:
        """The next step is launched (or none is): the host's share of the step period."""
        now, prof = time.perf_counter(), self.profile
        prof.critical_s += now - collected
        if self.running is not None and self._launched_at is not None:
            prof.period_s += now - self._launched_at
            prof.periods += 1
        self._launched_at = now if self.running is not None else None

    def fail_step(self, exc: BaseException) -> None:
        """Collecting or routing a step raised: end every request that could have been in
        it, with an error."""
        self.metrics.error(self.name, "step_failed")
        self.running, self.step_since = None, None
        self.failed_in_row += 1
        self.post(self.requests.fail_runnable(f"step failed: {exc}"))

    def report_failed_launch(self) -> None:
        error, self._launch_error = self._launch_error, None
        if error is not None:
            self.post(self.requests.fail_runnable(f"step failed: {error}"))

    def _set_engine_state(self, now: float) -> None:
        self._state_due, self._state_stale = now + STATE_PERIOD_S, False
        self.metrics.engine_state(self.name, self.engine)

    def _note_deferred(self, deferred: bool) -> None:
        """Nothing launched: the threshold held runnable work back (``deferred``) or idle.
        The engine's gauges are set by ``idle``, at most every ``STATE_PERIOD_S``, not here:
        here is on the critical path of the step's messages (the HANDOFF of a request whose
        first token escalated, the FINISHED of the last one), and ~10 Ray gauge calls would
        delay them."""
        self._state_stale = True
        if deferred and self._deferred_since is None:
            self._deferred_since = time.monotonic()
        elif not deferred:
            self._deferred_since = None

    def _note_launched(self, started: float) -> None:
        """A step was launched (``started``: ``time.perf_counter()`` before scheduling)."""
        if self._deferred_since is not None:
            self.metrics.deferred_wait(self.name, time.monotonic() - self._deferred_since)
            self._deferred_since = None
        self.num_steps += 1
        if self.requests.unqueued:
            self._note_queued(time.time() - (time.perf_counter() - started))

    def _note_queued(self, started: float) -> None:
        """Queue time (the ingress sent the NEW -> the start of the first step computing
        it here) and the prompt tokens found in the prefix cache, of the new requests this
        step computed."""
        unqueued = self.requests.unqueued
        for rid, sent in list(unqueued.items()):
            request = self.engine.get_request(rid)
            tracked = self.requests.tracked.get(rid)
            if request is None or tracked is None:
                del unqueued[rid]
            elif request.num_computed_tokens > 0:
                tracked.queue_s = max(0.0, started - sent)
                tracked.cached_tokens = max(0, request.num_cached_tokens)
                del unqueued[rid]

    def _decide(
        self, result: StepResult, destinations: list[int]
    ) -> tuple[dict[str, tuple[int, Send]], dict[str, str]]:
        """The policy's ``send`` for every row routed elsewhere: rid -> (destination, Send).
        A row whose ``send`` raises stays here (paused, out of the next step) and is
        reported in the second map (rid -> error): its request ends with an error once its
        token is committed."""
        leaving: dict[str, tuple[int, Send]] = {}
        failed: dict[str, str] = {}
        tracked = self.requests.tracked
        for rid, position, dst in zip(
            result.request_ids, result.positions, destinations, strict=True
        ):
            if dst == self.index:
                continue
            try:
                view = RequestView(rid, self.index, position, tracked[rid].policy_state)
                leaving[rid] = (dst, self.policy.send(view, dst))
            except Exception as exc:
                failed[rid] = f"routing to {self.models[dst]} failed: {exc!r}"
        return leaving, failed

    def _record_step(self, result: StepResult, destinations: list[int], drop: set[str]) -> None:
        """The step and every row's move into the threshold tuner's statistics window."""
        now = time.monotonic()
        active = self.engine.active_requests
        self.rows_stepped += result.batch_size
        self.steps_recorded += 1
        self.stats.record_step(
            result.batch_size, result.timings.total, now, active, result.num_scheduled_tokens
        )
        # one tally per destination, not per row (list.count: a Counter's set-up cost more)
        pairs = zip(result.request_ids, destinations, strict=True)
        dropped = [dst for rid, dst in pairs if rid in drop] if drop else []
        for dst, model in enumerate(self.models):
            n = destinations.count(dst)
            if n:
                self.stats.record_move(self.name, model, n - dropped.count(dst), now, rows=n)

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
        held = self.requests.tracked
        for o in decided.outputs:
            rid = o.request_id
            tracked = held.get(rid)
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
                    self.requests.finish(tracked, o.finish_reason, reports)
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
            self.requests.fail_request(rid, error, out)
