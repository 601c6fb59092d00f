"""One engine = one model (on one device, or over tensor-parallel ranks driven from here):
requests in, committed tokens out.

Requests enter with ``add_request`` (a prefill) or come back with ``resume`` (an extend of
only the tokens this model has not seen). A step is three lines: the scheduler picks
tokens, the runner computes them and samples, and ``commit`` appends the sampled tokens,
applies stop conditions and pauses requests a routing policy sent elsewhere. ``execute`` and
``commit`` are separate so the policy can look at the ``StepResult`` in between; ``step``
runs both with every request staying here. ``execute`` is ``launch`` (schedule and start the
forward) then ``collect`` (wait for it): a serving loop that calls them apart does its other
host work while the forward runs (replica/step.py), including ``draft``, which
schedules the next step ahead so that the next ``launch`` only checks what changed.

Lifecycle calls on unknown or finished requests are no-ops, never exceptions that could kill
a serving loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from tokenrouter_ray.engine.block_pool import KVCacheManager, device_budget, plan_num_blocks
from tokenrouter_ray.engine.config import EngineConfig
from tokenrouter_ray.engine.memory_reserve import forward_reserve
from tokenrouter_ray.engine.model_runner import ModelRunner, model_footprint
from tokenrouter_ray.engine.outputs import (
    EngineStatus,
    PendingStep,
    RequestOutput,
    StepResult,
    StepTimings,
)
from tokenrouter_ray.engine.request import Request, RequestStatus, SamplingParams
from tokenrouter_ray.engine.runner import FAULT_KINDS, FaultyRunner, Runner
from tokenrouter_ray.engine.scheduler import Draft, Scheduler
from tokenrouter_ray.thresholds import ThresholdTable

if TYPE_CHECKING:
    from tokenrouter_ray.engine.taps import LayerTap
    from tokenrouter_ray.engine.tensor_parallel import WorkerLauncher


class Engine:
    def __init__(self, runner: Runner, config: EngineConfig, num_blocks: int) -> None:
        self.config = config
        self.runner = runner
        self.kv = KVCacheManager(num_blocks, config.block_size, config.prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv)
        self.requests: dict[str, Request] = {}
        self._uncommitted: StepResult | None = None
        self._in_flight: PendingStep | None = None
        self._prefilling = False  # some prefill-only request is here (``prefill``)
        self._draft: Draft | None = None  # the next step, drafted while this one runs
        self.deferred_until: float | None = None  # set when the launch threshold held a step
        limit = runner.max_positions or self.kv.capacity_tokens
        self.max_model_len = min(config.max_model_len or limit, limit, self.kv.capacity_tokens)
        self.vocab_size: int = runner.vocab_size
        self.eos_token_ids: frozenset[int] = runner.eos_token_ids

    @classmethod
    def from_config(cls, config: EngineConfig, launcher: WorkerLauncher | None = None) -> Engine:
        """Load the model; with ``tensor_parallel > 1`` start its workers too (``launcher``:
        how, default local processes) and run rank 0 here."""
        if config.tensor_parallel > 1:
            from tokenrouter_ray.engine.tensor_parallel import build_tp_runner

            runner, num_blocks = build_tp_runner(config, launcher)
            return cls(runner, config, num_blocks)
        from tokenrouter_ray.engine.loader import load_causal_lm  # transformers' model stack

        model = load_causal_lm(
            config.model, config.dtype, config.device, config.gguf_file, config.num_hidden_layers
        )
        footprint = model_footprint(model)
        device = next(model.parameters()).device
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
        if free is not None:  # activations and CUDA graphs first, KV gets the rest
            free = max(0, free - forward_reserve(model, config))
        budget = device_budget(config.memory_budget_bytes, footprint.weight_bytes, free)
        num_blocks = config.num_blocks or plan_num_blocks(budget, footprint, config.block_size)
        runner = ModelRunner.for_engine(model, num_blocks, config)
        if runner.capture:  # every bucket's graph now, before any request arrives
            runner.capture_static()
        return cls(runner, config, num_blocks)

    # ------------------------------------------------------------------ lifecycle
    def add_request(
        self,
        request_id: str,
        token_ids: Sequence[int],
        sampling: SamplingParams | None = None,
        num_prompt_tokens: int | None = None,
        now: float | None = None,
    ) -> Request:
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} already exists")
        if not token_ids:
            raise ValueError("a request needs at least one token")
        self._check_ids(token_ids)
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt of {len(token_ids)} tokens leaves no room: this model's limit is "
                f"{self.max_model_len} tokens"
            )
        request = Request(
            request_id=request_id,
            token_ids=list(token_ids),
            sampling=sampling or SamplingParams(),
            arrival_time=time.monotonic() if now is None else now,
            num_prompt_tokens=len(token_ids) if num_prompt_tokens is None else num_prompt_tokens,
        )
        self.requests[request_id] = request
        self.scheduler.add(request)
        return request

    def prefill(
        self, request_id: str, token_ids: Sequence[int], sampling: SamplingParams | None = None
    ) -> Request | None:
        """Compute the KV of ``token_ids`` and end: no token is sampled, and the full blocks
        stay in the prefix cache, where a request that later arrives with these tokens first
        (a handoff's first visit) finds them (a prompt prefilled on the model it will be
        handed to, beside the entry model's prefill). ``sampling`` only lends its
        ``cache_salt`` (the blocks are shared with requests of the same salt). None, and
        nothing queued, without prefix caching or when every full block is cached already."""
        if not self.kv.enable_caching:
            return None
        request = self.add_request(request_id, token_ids, sampling)
        request.prefill_only = True
        self._prefilling = True
        prefix = self.kv.cached_prefix(request)
        full = (len(request.token_ids) - 1) // self.config.block_size  # what can be cached
        cached = prefix.num_tokens if prefix is not None else 0
        if cached >= full * self.config.block_size:
            self.abort(request_id)  # nothing to add to the cache
            return None
        return request

    def pause(self, request_id: str) -> None:
        """Hand the request away: out of the running batch, KV kept."""
        request = self._live(request_id)
        if request is not None and request.status != RequestStatus.PENDING:
            self.scheduler.pause(request)

    def resume(
        self, request_id: str, new_token_ids: Sequence[int], anchor: int | None = None
    ) -> None:
        """Continue a pending request with tokens it has not seen.

        ``anchor`` is the logical position ``new_token_ids`` start at (default: the end of
        what this engine holds). Tokens past the anchor are dropped and their KV released,
        so a routed token this model sampled and another model replaced disappears here.
        """
        request = self._live(request_id)
        if request is None:
            return
        self._check_ids(new_token_ids)
        anchor = request.num_tokens if anchor is None else anchor
        if not 0 < anchor <= request.num_tokens:
            raise ValueError(f"anchor {anchor} outside 1..{request.num_tokens} for {request_id!r}")
        if anchor < request.num_tokens:
            request.truncate(anchor)
            self.kv.truncate(request, anchor)
        request.append_tokens(new_token_ids)
        if request.num_tokens >= self.max_model_len:
            self._finish(request, RequestStatus.FINISHED_LENGTH)
            return
        # The last token must go through the model to give next-token logits.
        self.kv.truncate(request, min(request.num_computed_tokens, request.num_tokens - 1))
        if request.status == RequestStatus.PENDING:
            self.scheduler.make_runnable(request, time.monotonic())

    def finish(self, request_id: str, reason: str = "stop") -> None:
        request = self._live(request_id)
        if request is not None:
            status = (
                RequestStatus.FINISHED_LENGTH
                if reason == "length"
                else RequestStatus.FINISHED_STOPPED
            )
            self._finish(request, status)

    def abort(self, request_id: str) -> None:
        request = self._live(request_id)
        if request is not None:
            self._finish(request, RequestStatus.FINISHED_ABORTED)

    def keep_outputs(self, logits: bool = False, hidden: bool = False) -> None:
        """Also keep next-token logits / last hidden states in every ``StepResult`` (a
        routing policy reads them); what is already kept stays kept."""
        self.runner.keep_logits |= logits
        self.runner.keep_hidden |= hidden

    def tap_layer(self, k: int) -> LayerTap:
        """A context manager that records the residual stream after decoder layer ``k`` for
        every token computed while it is open; ``.states(request_id, length)`` reads it."""
        from tokenrouter_ray.engine.taps import LayerTap

        if not isinstance(self.runner, ModelRunner):
            raise TypeError(f"a layer tap needs a model's runner, not {type(self.runner).__name__}")
        return LayerTap(self.runner, k)

    @property
    def embed_tokens(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """Token ids -> this model's input embeddings (for policies that read them)."""
        return self.runner.embed_tokens

    def sequence(self, request_id: str) -> Sequence[int]:
        """The request's token ids as this model holds them (prompt + output); read-only
        (a view of the request's own list, not a copy: handoffs slice it every step)."""
        return self.requests[request_id].token_ids

    def set_active_requests(self, n: int | None) -> None:
        """The global number of active requests, for deferred-launch thresholds."""
        self.scheduler.active_requests = n

    @property
    def batch_thresholds(self) -> ThresholdTable:
        """The deferred-launch thresholds in use (index = active requests)."""
        return self.scheduler.thresholds

    def set_batch_thresholds(self, thresholds: ThresholdTable | Sequence[int]) -> bool:
        """New deferred-launch thresholds (index = active requests), e.g. the tuner's table;
        True if they differ from the ones in use. ``ValueError`` unless all are >= 1."""
        table = ThresholdTable.of(thresholds)
        if table == self.scheduler.thresholds:
            return False
        self.scheduler.set_thresholds(table)
        return True

    def _check_ids(self, token_ids: Sequence[int]) -> None:
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(
                f"token id {bad} is outside this model's vocabulary (0..{self.vocab_size - 1})"
            )

    def _live(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        return None if request is None or request.is_finished else request

    def _finish(self, request: Request, status: RequestStatus) -> None:
        self.scheduler.finish(request, status)
        del self.requests[request.request_id]

    # ----------------------------------------------------------------------- step
    def execute(self, now: float | None = None) -> StepResult | None:
        """Schedule and run one forward; ``None`` when nothing is due (idle or deferred)."""
        pending = self.launch(now)
        return None if pending is None else self.collect(pending)

    def launch(self, now: float | None = None) -> PendingStep | None:
        """Schedule one forward and start it; ``None`` when nothing is due (idle or
        deferred). The step runs while the caller does other host work (the previous
        step's reports and sends); ``collect`` waits for it. The runner's ``launch``
        (engine/runner.py) returns at once where the device runs on (the simulated
        device; a GPU runner whose sampled tokens are read at collect time) and computes
        the step first on a CPU. A step drafted during the previous one (``draft``) is
        used where it is still valid."""
        if self._uncommitted is not None or self._in_flight is not None:
            raise RuntimeError("commit() the previous step's result before launching another")
        t0 = time.perf_counter()
        draft, self._draft = self._draft, None
        out = self.scheduler.schedule(time.monotonic() if now is None else now, draft)
        self.deferred_until = out.wake_at if out.deferred else None
        if not out:
            return None
        timings = StepTimings(schedule=time.perf_counter() - t0)
        wait = self.runner.launch(out, timings)
        for chunk in out.chunks:  # its KV is being written now
            chunk.request.advance_computed(chunk.num_tokens)
        pending = PendingStep(wait, out.num_tokens, len(out.chunks), out, timings)
        self._in_flight = pending
        return pending

    def draft(self) -> None:
        """While a launched step runs: schedule the one after it (``Scheduler.draft``), so
        that ``launch`` only checks what changed since. Called again, it re-drafts the
        queued part (requests that arrived since); a no-op with no step in flight."""
        if self._in_flight is None:
            return
        previous, self._draft = self._draft, None  # none if drafting fails
        self._draft = self.scheduler.draft(self._in_flight.scheduled, previous)

    def collect(self, pending: PendingStep) -> StepResult:
        """Wait for a launched step; its result must be ``commit``-ed next."""
        if pending is not self._in_flight:
            raise RuntimeError("collect() takes the step of the latest launch(), once")
        self._in_flight = None
        t0 = time.perf_counter()
        result = pending.wait()
        pending.waited_s = time.perf_counter() - t0
        self._annotate(result)
        self._uncommitted = result
        return result

    def _annotate(self, result: StepResult) -> None:
        """Each row's previous token, whether it is the request's first output token (before
        ``commit`` appends the sampled ones) and its seed: what a routing policy reads."""
        rows = self.step_requests(result)
        result.prev_token_ids = [r.last_token_id for r in rows]
        result.is_first = [r.num_output_tokens == 0 for r in rows]
        result.seeds = [r.seed for r in rows]

    def step_requests(self, result: StepResult) -> list[Request]:
        """The requests of a collected, not yet committed step's rows, in row order."""
        return [self.requests[rid] for rid in result.request_ids]

    def commit(
        self,
        result: StepResult,
        drop: Collection[str] = (),
        pause: Collection[str] = (),
    ) -> list[RequestOutput]:
        """Append sampled tokens (except ``drop``), stop finished requests, pause ``pause``."""
        if result is not self._uncommitted:
            raise RuntimeError("commit() takes the result of the latest execute(), once")
        self._uncommitted = None
        t0 = time.perf_counter()
        outputs = []
        for rid, token in zip(result.request_ids, result.token_ids, strict=True):
            request = self.requests.get(rid)
            if request is None:
                continue
            new = [] if rid in drop else [token]
            request.append_tokens(new)
            status = self._stop_status(request, new)
            if status is not None:
                self._finish(request, status)
            elif rid in pause:
                self.scheduler.pause(request)
            outputs.append(RequestOutput(rid, new, status is not None, request.finish_reason))
        if self._prefilling:
            self._end_prefills()
        result.timings.commit = time.perf_counter() - t0
        return outputs

    def _end_prefills(self) -> None:
        """Prefill-only requests whose every token is computed end, their full blocks
        registered in the prefix cache first."""
        for request in [r for r in self.requests.values() if r.prefill_only]:
            if request.num_uncomputed_tokens == 0 and request.status == RequestStatus.RUNNING:
                self.kv.cache_computed(request)
                self._finish(request, RequestStatus.FINISHED_LENGTH)
        self._prefilling = any(r.prefill_only for r in self.requests.values())

    def discard_uncommitted(self) -> None:
        """Forget a step that failed between launch() and commit() (its KV is recomputed)."""
        self._uncommitted = None
        self._in_flight = None
        self._draft = None

    def step(self, now: float | None = None) -> list[RequestOutput]:
        result = self.execute(now)
        return [] if result is None else self.commit(result)

    def _stop_status(self, request: Request, new: list[int]) -> RequestStatus | None:
        sp = request.sampling
        # min_tokens: a token sampled under its mask (engine/logits_processors.py: output
        # number k <= min_tokens) never stops the request, whichever model wrote it.
        if (
            new
            and request.num_output_tokens > sp.min_tokens
            and (
                new[-1] in sp.stop_token_ids
                or (not sp.ignore_eos and new[-1] in self.eos_token_ids)
            )
        ):
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= sp.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    # ------------------------------------------------------------------ helpers
    def check_health(self) -> None:
        """Raise when the engine cannot step (a tensor-parallel worker is gone)."""
        self.runner.check_alive()

    @property
    def device_stats(self) -> Any:
        """The runner's own counters, where it keeps any (the simulated device's)."""
        return self.runner.stats

    def inject_fault(self, kind: str, count: int = 1, seconds: float = 0.0) -> None:
        """Chaos hook: ``step`` makes the next ``count`` steps raise; ``stall`` makes them
        take ``seconds`` longer (a model that stops answering); ``clear`` removes a fault.
        The runner is wrapped in a ``FaultyRunner`` (engine/runner.py) until it is cleared
        (a spent fault stays wrapped, passing every launch through)."""
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault {kind!r} ({', '.join(FAULT_KINDS)})")
        while isinstance(self.runner, FaultyRunner):
            self.runner = self.runner.inner
        if kind != "clear":
            self.runner = FaultyRunner(self.runner, kind, count, seconds)

    def close(self) -> None:
        """Stop tensor-parallel workers, if any (a plain engine holds nothing to close)."""
        self.runner.close()

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def holds(self, request_id: str) -> bool:
        """Whether the request is here and not finished."""
        return request_id in self.requests

    def get_request(self, request_id: str) -> Request | None:
        """The request as this engine holds it (read it; change it only through the
        lifecycle calls), ``None`` when it is not here."""
        return self.requests.get(request_id)

    def request_ids(self, runnable_only: bool = False) -> list[str]:
        """The requests held here, oldest first (``runnable_only``: not paused)."""
        if runnable_only:
            return [rid for rid, r in self.requests.items() if r.is_runnable]
        return list(self.requests)

    @property
    def active_requests(self) -> int:
        """N for the deferred-launch rule: the global count when known, else the local."""
        return self.scheduler.current_n

    def status(self) -> EngineStatus:
        """A snapshot of queue depths, the launch rule, KV blocks and running totals."""
        sched, kv = self.scheduler, self.kv
        pool = kv.pool
        return EngineStatus(
            requests=len(self.requests),
            waiting=len(sched.waiting),
            running=len(sched.running),
            pending=len(sched.pending),
            active_requests=sched.current_n,
            threshold=sched.threshold(),
            kv_blocks_used=pool.num_used_blocks,
            kv_blocks_free=pool.num_free_blocks,
            kv_blocks_total=pool.num_blocks,
            preemptions=sched.num_preemptions,
            deferred_timeouts=sched.deferred_timeouts,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
        )

    @property
    def has_runnable(self) -> bool:
        return self.scheduler.num_runnable > 0

    def generate(
        self, prompts: Iterable[Sequence[int]], sampling: SamplingParams | None = None
    ) -> list[list[int]]:
        """Run prompts to completion together (a convenience for tests and benchmarks)."""
        ids = [
            self.add_request(f"gen-{i}-{time.monotonic_ns()}", p, sampling).request_id
            for i, p in enumerate(prompts)
        ]
        produced: dict[str, list[int]] = {rid: [] for rid in ids}
        while any(rid in self.requests for rid in ids):
            for out in self.step():
                if out.request_id in produced:
                    produced[out.request_id].extend(out.new_token_ids)
        return [produced[rid] for rid in ids]
