"""Token-budget continuous batching with deferred launch. Moves requests and token counts
only; never imports torch.

Requests arrive through ``add`` (new prefills) and ``make_runnable`` (extends after a
handoff); ``schedule`` returns a ``SchedulerOutput`` naming how many tokens of each request
the next forward computes, or an empty output saying why it waits. Prefill, extend and
decode are one thing at different sizes: a request needs ``num_tokens -
num_computed_tokens`` tokens computed, and a long need is cut into chunks by the token
budget. A request computing its tokens for the first time here (a prompt, a handoff's
first visit, a recompute after preemption) starts past its cached prefix
(``KVCacheManager.cached_prefix``). When KV is full, new work queues; a running request
that cannot grow preempts the most recently arrived request (pending ones first) by
recompute.

Deferred launch: a step starts only once at least ``B`` requests are runnable, ``B`` read
from the scheduler's ``ThresholdTable`` (``thresholds.py``: the lookup rule) at ``N``, the
global number of active requests (supplied from outside, else the local count), or once the
oldest runnable request has waited ``max_defer_s`` (a counted safety net), so a stale ``N``
can never stall the model. The table starts as the config's ``batch_thresholds`` and is
scheduler state from then on: the tuner replaces it through ``set_thresholds``.

Drafting the next step while the current one runs: ``draft(in_flight)`` schedules step
t+1 during step t as if every row of t that samples keeps its token and stays (KV for it
reserved ahead), then the queued requests' head (prefix lookup and KV allocation done
ahead too). It changes no queue. ``schedule(now, draft)`` then keeps each drafted chunk
that is still what it would have chosen (the request still running or at the queue's
head, the same start and size) and schedules the rest as usual, so rows that left or
finished after step t are simply not in t+1 and nothing depends on the draft being right.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tokenrouter_ray.engine.block_pool import KVCacheManager
from tokenrouter_ray.engine.request import Request, RequestStatus
from tokenrouter_ray.thresholds import ThresholdTable


class SchedulerConfig(BaseModel):
    """How one model batches. Thresholds usually come from the tuner (docs/user-guide/tuning.md)."""

    model_config = ConfigDict(extra="forbid")

    max_num_seqs: int = Field(64, ge=1, description="Most requests in one forward.")
    max_num_batched_tokens: int = Field(
        2048, ge=1, description="Token budget of one forward; longer prefills are chunked."
    )
    batch_thresholds: list[int] = Field(
        default_factory=lambda: [1],
        min_length=1,
        description="Deferred launch: B = batch_thresholds[min(N, len - 1)], N = active "
        "requests system-wide. [1] launches as soon as anything is runnable.",
    )
    max_defer_s: float = Field(
        1.0,
        ge=0,
        description="Safety net: longest a runnable request waits for the batch to fill "
        "(inf: never). Every ingress publishes its active count on each change, so N is "
        "true within a message delay and the launch rule alone keeps requests moving; the "
        "net covers a count left by an ingress that died (dropped after 10 s of silence). "
        "Each launch it forces is counted (Scheduler.deferred_timeouts).",
    )

    @field_validator("batch_thresholds")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        return ThresholdTable.of(v).to_list()


@dataclass(frozen=True)
class ScheduledChunk:
    """Compute KV for ``token_ids[start : start + num_tokens]`` of ``request``."""

    request: Request
    start: int
    num_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the request's last token, so a token is sampled (never
        for a prefill-only request)."""
        r = self.request
        return self.start + self.num_tokens == r.num_tokens and not r.prefill_only


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    deferred: bool = False  # runnable work exists but the launch threshold holds it back
    wake_at: float | None = None  # when a deferred launch is due anyway (max wait)
    threshold: int = 1  # the B this decision used

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    def __bool__(self) -> bool:
        return bool(self.chunks)


@dataclass
class Draft:
    """Step t+1 as scheduled while step t runs (``Scheduler.draft``): the running requests'
    chunks (arrival order, KV reserved) and the queued requests' head (FCFS, KV allocated).
    ``schedule`` validates each chunk before it uses it."""

    running: list[ScheduledChunk] = field(default_factory=list)
    waiting: list[ScheduledChunk] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.thresholds = ThresholdTable.of(config.batch_thresholds)  # the tuner replaces it
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.pending: dict[str, Request] = {}
        self.active_requests: int | None = None  # global N from outside; None: local count
        self.num_preemptions = 0  # since start, for metrics
        self.deferred_timeouts = 0  # launches below the threshold forced by max_defer_s

    # ----------------------------------------------------------------- transitions
    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def make_runnable(self, request: Request, now: float) -> None:
        """A pending request came back with new tokens: queue its extend."""
        self.pending.pop(request.request_id, None)
        request.status = RequestStatus.WAITING
        request.runnable_since = now
        self.waiting.append(request)

    def pause(self, request: Request) -> None:
        """Out of the batch, KV kept (and its computed full blocks cached for others)."""
        self._remove(request)
        self.kv.cache_computed(request)
        request.status = RequestStatus.PENDING
        self.pending[request.request_id] = request

    def finish(self, request: Request, status: RequestStatus) -> None:
        self._remove(request)
        self.pending.pop(request.request_id, None)
        request.status = status
        self.kv.free(request)

    def _remove(self, request: Request) -> None:
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.WAITING:
            self.waiting.remove(request)

    # ------------------------------------------------------------------- queries
    @property
    def num_runnable(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def num_active(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.pending)

    @property
    def current_n(self) -> int:
        """N for the launch rule: the global count when known, else the local one. The
        requests held here are part of the global count, so a global count below the local
        one is stale (an update still on its way) and the local one is used."""
        if self.active_requests is None:
            return self.num_active
        return max(self.num_active, self.active_requests)

    def threshold(self) -> int:
        """B at the current N."""
        return self.thresholds.at(self.current_n)

    def set_thresholds(self, thresholds: ThresholdTable) -> None:
        """New deferred-launch thresholds (e.g. from the tuner); the next ``schedule`` uses
        them. The config keeps the start-up table."""
        self.thresholds = thresholds

    # ------------------------------------------------------------------ schedule
    def schedule(self, now: float, draft: Draft | None = None) -> SchedulerOutput:
        """The next step: which tokens of which requests it computes (``draft``: the step
        drafted during the previous one; its chunks are used where still valid)."""
        threshold = self.threshold()
        runnable = self.num_runnable
        if runnable == 0:
            return SchedulerOutput(threshold=threshold)
        if runnable < threshold:
            oldest = min(r.runnable_since for r in (*self.waiting, *self.running))
            wake_at = oldest + self.config.max_defer_s
            if now < wake_at:
                return SchedulerOutput(deferred=True, wake_at=wake_at, threshold=threshold)
            self.deferred_timeouts += 1  # the safety net fired: launching below B

        out = SchedulerOutput(threshold=threshold)
        budget = self.config.max_num_batched_tokens
        scheduled: set[int] = set()
        if draft is not None:
            budget = self._take_drafted(draft.running, out, budget, scheduled, False)

        # Running requests first (FCFS); they may preempt later arrivals to grow.
        queue = [] if len(scheduled) == len(self.running) else self.running
        for request in sorted(queue, key=lambda r: r.arrival_time):
            if id(request) in scheduled:
                continue
            if budget == 0 or len(out.chunks) == self.config.max_num_seqs:
                break
            if request.status != RequestStatus.RUNNING:  # preempted by an earlier one
                continue
            n = min(request.num_uncomputed_tokens, budget)
            while self.kv.allocate_slots(request, n) is None:
                victim = self._pick_victim(exclude=scheduled | {id(request)})
                if victim is None:
                    break
                self._preempt(victim, now)
                out.preempted.append(victim)
            else:
                out.chunks.append(ScheduledChunk(request, request.num_computed_tokens, n))
                scheduled.add(id(request))
                budget -= n
                continue
            # Nothing left to preempt: this request yields its own KV and waits.
            self._preempt(request, now)
            out.preempted.append(request)

        # Then waiting requests (prefills, extends, recomputes), FCFS, while KV lasts.
        if draft is not None:
            budget = self._take_drafted(draft.waiting, out, budget, scheduled, True)
        while self.waiting and budget > 0 and len(out.chunks) < self.config.max_num_seqs:
            request = self.waiting[0]
            prefix = self.kv.cached_prefix(request)  # a first computation: reuse cached KV
            cached = prefix.num_tokens if prefix is not None else 0
            n = min(request.num_uncomputed_tokens - cached, budget)
            if self.kv.allocate_slots(request, n, prefix) is None:
                # KV full: the request stays queued, unless nothing runs at all and idle
                # requests hold the KV (then they pay by recompute, not a stall).
                victim = None if out.chunks else self._idle_victim(exclude=request)
                if victim is None:
                    break
                self._preempt(victim, now)
                out.preempted.append(victim)
                continue
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.chunks.append(ScheduledChunk(request, request.num_computed_tokens, n))
            budget -= n
        return out

    def _take_drafted(
        self,
        chunks: list[ScheduledChunk],
        out: SchedulerOutput,
        budget: int,
        taken: set[int],
        queued: bool,
    ) -> int:
        """Move the drafted chunks that are still what ``schedule`` would choose into
        ``out``, in order, until the first that is not: the request still running (or, when
        ``queued``, still at the queue's head) with the same start and size (its KV was
        reserved or allocated by the draft). A request no longer running or queued is
        skipped. Returns the budget left."""
        wanted = RequestStatus.WAITING if queued else RequestStatus.RUNNING
        for chunk in chunks:
            r = chunk.request
            if r.status != wanted:
                continue  # paused, finished or preempted since the draft
            if (
                (queued and self.waiting[0] is not r)
                or r.num_computed_tokens != chunk.start
                or min(r.num_uncomputed_tokens, budget) != chunk.num_tokens
                or len(out.chunks) == self.config.max_num_seqs
            ):
                break  # from here on, as usual
            if queued:
                self.waiting.popleft()
                r.status = RequestStatus.RUNNING
                self.running.append(r)
            else:
                self.kv.cache_computed(r)  # what allocate_slots would have registered
            out.chunks.append(chunk)
            taken.add(id(r))
            budget -= chunk.num_tokens
        return budget

    def draft(self, in_flight: SchedulerOutput | None, previous: Draft | None = None) -> Draft:
        """Schedule the step after ``in_flight`` while it runs, changing no queue: every
        running request as if the rows of ``in_flight`` that sample keep their token (the
        KV for it reserved now, without registering blocks the running step still writes),
        then the queue's head (prefix lookup and KV allocation now). No preemption: a chunk
        that does not fit ends that part of the draft, and ``schedule`` does the rest.
        With ``previous`` (an earlier draft of the same step) the running part is kept and
        the queued part drafted again (it picks up what arrived since)."""
        if previous is None:
            running, waiting = self._draft_running(in_flight), []
        else:  # keep what is still queued, add what queued since
            running = previous.running
            waiting = [c for c in previous.waiting if c.request.status == RequestStatus.WAITING]
        drafted = {id(c.request) for c in waiting}
        budget = self.config.max_num_batched_tokens - sum(c.num_tokens for c in running + waiting)
        for r in self.waiting:
            if budget <= 0 or len(running) + len(waiting) >= self.config.max_num_seqs:
                break
            if id(r) in drafted:
                continue
            prefix = self.kv.cached_prefix(r)
            cached = prefix.num_tokens if prefix is not None else 0
            n = min(r.num_uncomputed_tokens - cached, budget)
            if self.kv.allocate_slots(r, n, prefix) is None:
                break
            waiting.append(ScheduledChunk(r, r.num_computed_tokens, n))
            budget -= n
        return Draft(running, waiting)

    def _draft_running(self, in_flight: SchedulerOutput | None) -> list[ScheduledChunk]:
        samples = {id(c.request) for c in in_flight.chunks if c.samples} if in_flight else set()
        budget = self.config.max_num_batched_tokens
        pool, chunks = self.kv.pool, []
        for r in sorted(self.running, key=lambda r: r.arrival_time):
            if budget == 0 or len(chunks) == self.config.max_num_seqs:
                break
            n = min(r.num_uncomputed_tokens + (id(r) in samples), budget)
            missing = self.kv.blocks_needed(r.num_computed_tokens + n) - len(r.block_ids)
            if missing > 0:
                blocks = pool.allocate(missing)
                if blocks is None:
                    break
                r.block_ids.extend(blocks)
            chunks.append(ScheduledChunk(r, r.num_computed_tokens, n))
            budget -= n
        return chunks

    def _pick_victim(self, exclude: set[int]) -> Request | None:
        """Pending requests first (their KV waits idle), then the latest-arrived running."""
        return self._idle_victim(waiting=False) or self._latest_running(exclude)

    def _idle_victim(self, exclude: Request | None = None, waiting: bool = True) -> Request | None:
        """The latest-arrived request holding KV while out of the batch: pending ones first,
        then (if ``waiting``) queued ones such as extends that kept their blocks."""
        for group in (self.pending.values(), self.waiting if waiting else ()):
            holders = [r for r in group if r.block_ids and r is not exclude]
            if holders:
                return max(holders, key=lambda r: r.arrival_time)
        return None

    def _latest_running(self, exclude: set[int]) -> Request | None:
        candidates = [r for r in self.running if id(r) not in exclude]
        return max(candidates, key=lambda r: r.arrival_time, default=None)

    def _preempt(self, request: Request, now: float) -> None:
        """Free the request's KV; it recomputes from scratch when scheduled again."""
        self.kv.free(request)
        request.num_preemptions += 1
        self.num_preemptions += 1
        if request.status != RequestStatus.RUNNING:
            return  # stays pending or queued; it recomputes its whole context when run
        self.running.remove(request)
        request.status = RequestStatus.WAITING
        request.runnable_since = now
        self.waiting.appendleft(request)
