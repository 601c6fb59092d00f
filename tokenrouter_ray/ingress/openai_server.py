"""``IngressServer``: one ingress replica, everything it does that is not Ray Serve's and
not HTTP's, over an ``IngressCore`` (ingress/core.py: requests on the wire).

The request path is three objects: the Serve deployment (``deployments/ingress.py``, or a
test's harness) builds this server from injected parts and the FastAPI app over it
(ingress/http_app.py, whose routes read it from ``app.state.ingress``); the server admits,
places and answers each request; the core carries it to the models and back. Its jobs:

- requests: admission (503 past the cap, 503 ``model_unavailable`` while a model has no
  replica), placement of every model's replica (ingress/placement.py), one task per choice
  (committed tokens -> its ``ChoiceWriter``, openai/choice_update.py -> a ``ChoiceUpdate``
  per step on the request's queue), the response object or the stream (the chat or
  completions SSE of openai/sse.py, or the Responses events of openai/responses_output.py,
  both written from the same updates), the quality target and the speed bypass;
- what a request is checked against: the request limits, tokenizer and generation
  defaults, the admission queue and cap (``AdmissionQueue``, ``AdmissionCap``: the
  configured cap, or the tuner's SLO cap when lower), and the Responses API's stored
  responses (``responses``: ingress/responses_api.py);
- the replica's upkeep: recovery of requests whose model replica was lost or drained,
  health (``health`` for ``/health``, ``check_health`` for the platform's probe) and the
  statistics of ``/v1/tokenrouter/stats``.

Injected parts, so tests build it for real without Ray:

- ``channel``: this replica's peer channel, started (its endpoint is what ``peers``
  heartbeats); closed by ``close``;
- ``peers``: a ``PeerView`` (model -> live endpoints, refreshed in the background;
  ``deployments/peers.py PeerBook`` in Serve), whose lost endpoints are reported to
  ``on_lost``;
- ``model_infos``: each model's ``info()`` (``max_model_len``, ``vocab_size``), entry first;
- callables for what lives elsewhere: ``admission_cap`` (the tuner's app-wide cap, polled
  in SLO mode), ``tuner_status``, ``model_status`` (model -> its replica's status) and
  ``scorer`` (the top model's teacher-forced score);
- ``core``: by default an ``IngressCore`` over ``channel``; tests pass ``LocalRuntime``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import logging
import os
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tokenrouter_ray.config import AppConfig
from tokenrouter_ray.host_gc import collector_stats
from tokenrouter_ray.ingress.admission import AdmissionQueue
from tokenrouter_ray.ingress.backpressure import Backpressure, StreamGate
from tokenrouter_ray.ingress.core import IngressCore, RequestResult
from tokenrouter_ray.ingress.placement import Placement
from tokenrouter_ray.ingress.recovery import AdmissionCap, Recovery
from tokenrouter_ray.ingress.response_store import ResponseStore
from tokenrouter_ray.ingress.responses_api import ResponsesApi
from tokenrouter_ray.metrics import INGRESS, Metrics
from tokenrouter_ray.openai.choice_update import ChoiceUpdate, ChoiceWriter
from tokenrouter_ray.openai.errors import (
    NotFoundError,
    OpenAIError,
    OverloadedError,
    RequestFailedError,
    RequestTimeoutError,
    ServiceUnavailableError,
)
from tokenrouter_ray.openai.generation_defaults import GenerationDefaults
from tokenrouter_ray.openai.responses import (
    ChatCompletion,
    ChoiceResult,
    build_chat_completion,
    build_completion,
)
from tokenrouter_ray.openai.responses import Completion as TextCompletion
from tokenrouter_ray.openai.sse import (
    ChatStream,
    CompletionStream,
    StreamWriter,
    merge_choice_streams,
)
from tokenrouter_ray.openai.token_reports import TokenText
from tokenrouter_ray.openai.validation import PreparedRequest, RequestLimits, RoutingChoice
from tokenrouter_ray.quality.live import LiveQuality, Scorer
from tokenrouter_ray.quality.speed import SpeedBypass
from tokenrouter_ray.quality.target import QualityTarget
from tokenrouter_ray.tasks import cancel_and_wait
from tokenrouter_ray.transport.base import PeerChannel

logger = logging.getLogger(__name__)

# how long a model endpoint a replica could not reach may stay listed before it counts as
# alive (its request then fails): a directory lease (5 s) and a refresh or two
PEER_LOSS_SETTLE_S = 8.0
PEER_LOSS_POLL_S = 0.1
STATUS_TIMEOUT_S = 5.0  # one model's status in /v1/tokenrouter/stats


class ModelLimits(Protocol):
    """What the server reads of a model's ``info()`` (replica/status.py ``ReplicaInfo``)."""

    max_model_len: int
    vocab_size: int


class PeerView(Protocol):
    """What the server needs of a peer book (``deployments/peers.py PeerBook``)."""

    by_model: dict[str, list[str]]  # model -> its live endpoints

    @property
    def refreshing(self) -> bool: ...  # the background refresh runs

    def missing(self) -> list[str]: ...  # models without a live endpoint

    def all(self) -> list[str]: ...  # every model endpoint, in model order

    def exclude(self, endpoint: str) -> None: ...  # a leaving replica: out of by_model now

    async def start(self, wait_for_all: bool = True) -> None: ...

    async def stop(self) -> None: ...


def generation_defaults_of(cfg: AppConfig) -> GenerationDefaults:
    """The entry model's ``generation_config.json`` defaults (``ingress.generation_config``
    = auto, real models), else none."""
    spec = cfg.models[cfg.model_names[0]]
    if cfg.ingress.generation_config == "auto" and spec.sim is None:
        return GenerationDefaults.from_model_dir(spec.path)
    return GenerationDefaults()


def request_limits_of(
    cfg: AppConfig, tokenizer: Any, model_infos: Sequence[ModelLimits]
) -> RequestLimits:
    """What one request may ask: the configured limits, within every model's length and
    vocabulary (and the tokenizer's)."""
    entry = cfg.models[cfg.model_names[0]]
    return RequestLimits(
        max_model_len=min(i.max_model_len for i in model_infos),
        vocab_size=min([len(tokenizer), *(i.vocab_size for i in model_infos)]),
        structured_outputs=entry.sim is None,  # grammars need a real vocabulary
        routing_levels=cfg.policy.threshold_levels(len(cfg.models)),
        routing_presets=cfg.policy.preset_thresholds(),
        models=tuple(cfg.model_names),
        alone=cfg.policy.alone,
        **cfg.ingress.limits.model_dump(exclude={"max_body_mib"}),
    )


def choice_error(done: RequestResult) -> OpenAIError:
    """The OpenAI error a failed choice ends with."""
    if done.error_kind == "timeout":
        return RequestTimeoutError(f"The request timed out: {done.error}.")
    if done.error_kind == "unavailable":
        return ServiceUnavailableError(f"The request could not be completed: {done.error}.")
    return RequestFailedError(f"The request failed: {done.error}.")


@dataclass
class StreamedChoices:
    """A streaming answer: the SSE body, the choice tasks to cancel however the response
    ends (a client that leaves before the first byte never starts the body), and
    ``stalled()``, which returns once the client stopped reading (ingress/backpressure.py;
    the choices are aborted by then): the HTTP response must then stop, closing the
    connection."""

    tasks: list[asyncio.Future]
    body: AsyncIterator[bytes]
    stalled: Callable[[], Coroutine[Any, Any, None]] | None = None


class IngressServer:
    """One ingress replica's serving logic over injected parts (see the module docstring).

    ``respond`` answers a prepared request: the response object, or ``StreamedChoices``.
    ``ingress/http_app.py`` puts the HTTP routes around it; tests build it over
    ``LocalRuntime`` on CPU (tests/openai/ingress_app.py)."""

    def __init__(
        self,
        cfg: AppConfig,
        channel: PeerChannel,
        peers: PeerView,
        tokenizer: Any,
        model_infos: Sequence[ModelLimits],
        *,
        metrics: Metrics | None = None,
        generation_defaults: GenerationDefaults | None = None,
        admission_cap: Callable[[], Awaitable[int | None]] | None = None,
        tuner_status: Callable[[], Awaitable[Any]] | None = None,
        model_status: Mapping[str, Callable[[], Awaitable[Any]]] | None = None,
        core: IngressCore | None = None,
        scorer: Scorer | None = None,
    ) -> None:
        ing = cfg.ingress
        self.cfg = cfg
        self.channel = channel
        self.peers = peers
        self.metrics = metrics if metrics is not None else Metrics()
        for reason in ("drain", "lost"):  # both series exist before the first move
            self.metrics.requests_moved(reason, 0)
        self.served_model_name = cfg.served_model_name
        self.models = list(cfg.model_names)  # entry first
        self.entry_model = self.models[0]
        self.tokenizer = tokenizer
        self.token_text = TokenText(tokenizer)
        self.generation_defaults = (
            generation_defaults if generation_defaults is not None else generation_defaults_of(cfg)
        )
        self.limits = request_limits_of(cfg, tokenizer, model_infos)
        self.max_body_bytes = int(ing.limits.max_body_mib * 2**20)
        self.timeout_s = ing.request_timeout_s
        # admission limit: the configured cap, or the tuner's SLO cap when lower
        self.cap = AdmissionCap(ing.max_active_requests, ing.num_replicas)
        self.admission = AdmissionQueue(ing.admission_queue, ing.admission_wait_s)
        self.admission_cap = admission_cap
        self.tuner_status_of = tuner_status
        self.model_status = dict(model_status or {})
        if core is None:
            prefill_at = {
                name: spec.prefill_at_admission
                for name, spec in cfg.models.items()
                if spec.prefill_at_admission is not None
            }
            core = IngressCore(
                channel, self.entry, peers.all, self.metrics, self.timeout_s, prefill_at
            )
        self.core = core
        self.core.on_drain = self.on_drain
        self.core.on_peer_lost = self.on_peer_lost
        # one placement rule for every model's replica (ingress/placement.py), over the
        # peer view's live endpoints
        block_sizes = {name: spec.block_size for name, spec in cfg.models.items()}
        self.placement = Placement(self._replicas, block_sizes)
        self.recovery = Recovery(
            self.core, peers.missing, self.replace, timeout_s=self.timeout_s,
            recreated=self._recreated,
        )  # fmt: skip
        # backpressure (ingress/backpressure.py): each stream's choices wait while they are
        # ``max_buffered_tokens`` ahead of their client; a client that stops reading is cut
        self.backpressure = Backpressure(ing.stream_buffer_tokens, ing.client_stall_s)
        self._gates: weakref.WeakSet[StreamGate] = weakref.WeakSet()  # open streams
        self.client_stalls = 0  # streams ended because their client stopped reading
        self._ids = itertools.count()
        self.entry_total: dict[str, int] = {}  # choices ever sent per entry replica
        # the Responses API's stored responses: this replica's own (docs/reference/api.md)
        self.responses = ResponsesApi(
            ResponseStore(ing.responses.max_responses, ing.responses.max_bytes),
            cfg.served_model_name,
            ingress_replicas=ing.num_replicas,
        )
        qm = cfg.quality_monitor
        # live quality (quality/live.py): finished choices offered for scoring, teacher-forced
        # by ``scorer`` on a replica of the top model
        self.live_quality = LiveQuality(
            scorer, self.metrics, cfg.policy.name, cfg.policy.preset_thresholds(),
            qm.sample_rate, qm.max_pending, qm.window, qm.timeout_s,
        )  # fmt: skip
        if cfg.tuner.quality_target is not None and self.live_quality.sample_rate > 0:
            self.live_quality.target = QualityTarget(
                cfg.tuner.quality_target, cfg.policy.preset_thresholds(), self.models[-1]
            )
        # what the choices offer their results to: None while sampling is off
        self.quality: LiveQuality | None = (
            self.live_quality if self.live_quality.sample_rate > 0 else None
        )
        # the speed bypass (quality/speed.py): routed or the top model alone; None: off
        self.bypass: SpeedBypass | None = None
        if cfg.tuner.speed_bypass is not None and len(self.models) > 1:
            self.bypass = SpeedBypass(cfg.tuner.speed_bypass, self.models[-1])
        self._slo: asyncio.Task | None = None
        self.drained: set[str] = set()  # model endpoints that left on purpose (DRAIN)
        self.moves: list[dict[str, Any]] = []  # what each DRAIN moved (stats)
        self._moving: set[asyncio.Task] = set()

    # ---------------------------------------------------------------- placement
    def _replicas(self, model: str) -> Sequence[str]:
        return self.peers.by_model.get(model, [])

    @property
    def entry_load(self) -> dict[str, int]:
        """Choices in flight per entry replica."""
        return self.placement.load_of(self.entry_model)

    @entry_load.setter
    def entry_load(self, value: dict[str, int]) -> None:
        self.placement.load[self.entry_model] = dict(value)

    @property
    def assigned_load(self) -> dict[str, int]:
        """Choices in flight per replica of the other models (a copy)."""
        return {e: n for m in self.models[1:] for e, n in self.placement.load_of(m).items()}

    def entry(self, prompt: Sequence[int] | None = None, cache_salt: str | None = None) -> str:
        """The entry replica for a prompt, by the placement rule (ingress/placement.py):
        the one that last got its longest prefix unless it is too busy; the least loaded
        replica without a prompt. Nothing is counted."""
        return self.placement.choose(self.entry_model, prompt, cache_salt)

    def forget_replica(self, endpoint: str) -> None:
        """A replica is gone: no prefix is sent to it for its cache any more."""
        self.placement.forget(endpoint)

    def _endpoints(
        self, rid: str, prompt: Sequence[int], cache_salt: str | None
    ) -> Mapping[str, str]:
        """The replica of each non-entry model a choice will use (counted)."""
        return self.placement.place(rid, self.models[1:], prompt, cache_salt)

    def replace(self, rid: str) -> dict[str, str]:
        """After a replica loss: a re-created choice's replica of each non-entry model, kept
        where it is still live, placed anew where it was lost (ingress/recovery.py)."""
        return self.placement.replace(rid, self.models[1:])

    def _unassign(self, rid: str) -> None:
        self.placement.release_model(rid, self.models[1:])

    def _place_entry(
        self, rid: str, prompt: Sequence[int], cache_salt: str | None, alone: str | None = None
    ) -> str:
        """The replica a choice starts on: the entry model's, or the one model's that serves
        it alone (``alone``)."""
        model = alone or self.entry_model
        return self.placement.place(rid, [model], prompt, cache_salt)[model]

    def follow_target(self, prepared: PreparedRequest) -> PreparedRequest:
        """A request that asked for no ``routing`` takes the quality target's operating
        point (``tuner.quality_target``: a preset's thresholds, or the top model alone);
        where that point routes, the speed bypass (``tuner.speed_bypass``) may serve it by
        the top model alone instead. Any other request is left as it is."""
        routing = prepared.routing
        target = self.quality.target if self.quality is not None else None
        bypass = self.bypass
        if not routing.default or (target is None and bypass is None):
            return prepared
        thresholds, alone, why = routing.thresholds, routing.alone, routing.why
        if target is not None:
            thresholds, alone = target.routing()
            why = "quality" if alone is not None else None
        level = None
        if bypass is not None and alone is None:
            mode, why, level = bypass.choose(self.core.num_active + 1)
            if mode == "alone":
                thresholds, alone = (), bypass.top
        routing = RoutingChoice(
            thresholds, alone, routing.max_share, default=False, why=why, level=level
        )
        return dataclasses.replace(prepared, routing=routing)

    async def respond(
        self,
        prepared: PreparedRequest,
        chat: bool,
        timeout_s: float | None = None,
        writer: StreamWriter | None = None,
    ) -> ChatCompletion | TextCompletion | StreamedChoices:
        """The answer to a prepared request: the response object, or (``stream``) its
        stream, written from the choices' updates by ``writer``: by default the chat or
        completions chunks (openai/sse.py); the Responses API passes its event writer
        (openai/responses_output.py ``ResponseStream``)."""
        if not prepared.sampling.stream:
            return await self.collect(prepared, await self.start(prepared, chat, timeout_s), chat)
        prepared = self.follow_target(prepared)
        submitted = await self.submit(prepared, timeout_s)
        prompt_len = len(prepared.prompt_token_ids)
        if writer is None:
            stream_cls = ChatStream if chat else CompletionStream
            writer = stream_cls(
                self.served_model_name,
                prepared.sampling.n,
                include_usage=prepared.sampling.include_usage,
            )
        updates: asyncio.Queue[ChoiceUpdate] = asyncio.Queue()
        gate = StreamGate(len(submitted), self.backpressure)
        self._gates.add(gate)
        # Started now: the body may never be iterated if the client leaves first.
        tasks = self.start_choices(submitted, prepared, updates, chat, gate)
        body = self._sse(writer, tasks, updates, prompt_len, gate)
        return StreamedChoices(tasks, body, functools.partial(self._cut_when_stalled, gate, tasks))

    async def start(
        self, prepared: PreparedRequest, chat: bool, timeout_s: float | None = None
    ) -> list[asyncio.Task]:
        """A non-streamed request submitted, its choices started (one task each); `collect`
        waits for them. Cancelling a task aborts its choice on every model."""
        prepared = self.follow_target(prepared)
        submitted = await self.submit(prepared, timeout_s)
        return self.start_choices(submitted, prepared, None, chat)

    async def collect(
        self, prepared: PreparedRequest, tasks: list[asyncio.Task], chat: bool
    ) -> ChatCompletion | TextCompletion:
        """The response of choices `start` started; however it ends (cancelled too), every
        choice is ended with it."""
        try:
            choices = await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
        build = build_chat_completion if chat else build_completion
        return build(self.served_model_name, len(prepared.prompt_token_ids), choices)

    @property
    def buffered_tokens(self) -> int:
        """Tokens produced for open streams that their clients have not taken yet."""
        return sum(gate.buffered_total for gate in list(self._gates))

    async def _cut_when_stalled(self, gate: StreamGate, tasks: list[asyncio.Future]) -> None:
        """Returns once the stream's client stopped reading, with its choices aborted
        everywhere (their tasks' cleanup: ABORT to the models, slots released)."""
        await gate.watch()
        self.client_stalls += 1
        self.core.metrics.error(INGRESS, "client_stalled")
        logger.warning(
            "ingress: a streaming client took nothing for %.0f s with %d tokens waiting for it;"
            " its request is aborted", gate.limits.client_stall_s, gate.buffered_total,
        )  # fmt: skip
        for task in tasks:
            task.cancel()

    def check_admission(self, n: int = 1) -> None:
        """503 ``OverloadedError`` when ``n`` more choices would pass the cap. The
        HTTP routes call it with ``n = 1`` before reading the body, so a refusal costs no
        parsing or tokenizing (512 clients at once: docs/user-guide/reliability.md); ``submit``
        checks
        again with the request's ``n``."""
        if self.core.num_active + n > self.cap.limit:
            raise OverloadedError("Too many requests in flight; retry shortly.", retry_after_s=1)

    async def submit(
        self, prepared: PreparedRequest, timeout_s: float | None = None
    ) -> list[tuple[str, str]]:
        """Admit the request and send its ``n`` choices: [(request id, entry endpoint)]."""
        sampling, routing = prepared.sampling, prepared.routing
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
            prompt, salt = prepared.prompt_token_ids, sampling.spec.cache_salt
            alone = routing.alone
            for i in range(sampling.n):
                rid = f"{base}-{i}"
                entry = self._place_entry(rid, prompt, salt, alone)  # counted before the await
                try:
                    endpoints = {} if alone else self._endpoints(rid, prompt, salt)
                    entry = await self.core.submit(
                        rid,
                        prompt,
                        sampling.to_spec(i),
                        entry,
                        timeout_s=timeout_s,
                        endpoints=endpoints,
                        alone=alone,
                        max_share=routing.max_share,
                        thresholds=routing.thresholds,
                    )
                except BaseException:
                    self.placement.release(rid)
                    raise
                self.entry_total[entry] = self.entry_total.get(entry, 0) + 1
                submitted.append((rid, entry))
        except BaseException as exc:  # incl. cancellation: free the choices already sent
            for rid, _ in submitted:
                self.placement.release(rid)
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
        updates: asyncio.Queue[ChoiceUpdate] | None,
        chat: bool = False,
        gate: StreamGate | None = None,
    ) -> ChoiceResult:
        """One choice to its end: a `ChoiceUpdate` per step with text to ``updates``
        (streaming; openai/choice_update.py makes them, with the logprobs or routing trace
        of the tokens they settle when asked), the `ChoiceResult` back.

        Streaming with a ``gate``: once the choice is ``max_buffered_tokens`` ahead of its
        client it reads no more committed tokens until the client takes some (they wait at
        the core; the request keeps its slot)."""
        writer = ChoiceWriter(
            index, prepared, self.tokenizer, self.token_text, self.model_names,
            chat=chat, streaming=updates is not None,
        )  # fmt: skip
        # Read as committed when something is done with each step's tokens: a streamed
        # update, or a stop string that must end the choice where it appears
        each_chunk = updates is not None or bool(prepared.sampling.stop)
        try:
            async for tokens in self.core.stream(rid, each_chunk):
                update = writer.push(tokens, lambda: self.core.commit_log(rid))
                if update is not None and updates is not None:
                    self._put(updates, update, gate)
                    if gate is not None and gate.full(index):
                        await gate.wait_for_room(index)
                if writer.stopped:
                    self.core.abort_nowait(rid, reason="stop")
                    break
        finally:  # no await here: a cancelled task (client gone) must still clean up
            done = self.close_choice(rid, entry)
        assert done is not None  # only this finally or the task's done callback close it
        if done.error is not None:
            raise choice_error(done)
        routing = prepared.routing
        if self.bypass is not None and routing.level is not None:
            mode = "routed" if routing.alone is None else "alone"
            self.bypass.observe(mode, routing.level, done.e2e_s or 0.0, len(done.token_ids))
        if self.quality is not None:
            self.quality.offer(rid, prepared.prompt_token_ids, done.token_ids,
                               routing.thresholds, routing.alone)  # fmt: skip
        last = writer.end(done.writers, done.infos)
        if last is not None and updates is not None:
            self._put(updates, last, gate)
        return writer.result(done)

    @staticmethod
    def _put(
        updates: asyncio.Queue[ChoiceUpdate], update: ChoiceUpdate, gate: StreamGate | None
    ) -> None:
        """An update to the stream, counted by its gate."""
        updates.put_nowait(update)
        if gate is not None:
            gate.produced(update.index, update.num_tokens)

    def model_names(self, writers: Sequence[str | None] = ()) -> list[str]:
        """The deployment's models, entry first (a ``ChoiceWriter`` names them in traces
        and metrics)."""
        return self.models

    def start_choices(
        self,
        submitted: list[tuple[str, str]],
        prepared: PreparedRequest,
        updates: asyncio.Queue[ChoiceUpdate] | None,
        chat: bool = False,
        gate: StreamGate | None = None,
    ) -> list[asyncio.Task]:
        """One task per choice. Each also closes its request when the task ends: a task
        cancelled before it first ran never enters ``choice``'s ``finally``."""
        tasks = []
        for i, (rid, entry) in enumerate(submitted):
            task = asyncio.ensure_future(self.choice(i, rid, entry, prepared, updates, chat, gate))
            task.add_done_callback(
                lambda _, rid=rid, entry=entry: self._choice_ended(rid, entry, gate)
            )
            tasks.append(task)
        return tasks

    def _choice_ended(self, rid: str, entry: str, gate: StreamGate | None) -> None:
        self.close_choice(rid, entry)
        if gate is not None:
            gate.finished()

    def close_choice(self, rid: str, entry: str) -> RequestResult | None:
        """Abort (a no-op once complete) and release a choice, once; None if already."""
        if rid not in self.core.live:
            return None
        self.placement.release(rid)
        self.core.abort_nowait(rid)
        return self.core.release(rid)

    async def _sse(
        self,
        writer: StreamWriter,
        tasks: list[asyncio.Future],
        updates: asyncio.Queue[ChoiceUpdate],
        prompt_len: int,
        gate: StreamGate | None = None,
    ) -> AsyncIterator[bytes]:
        frames = merge_choice_streams(writer, tasks, updates, prompt_len, gate)
        try:
            async with contextlib.aclosing(frames):  # a disconnect aborts the choices now
                async for frame in frames:
                    yield frame
        except Exception as exc:  # never a cut connection: the error's events
            logger.exception("ingress: stream failed")
            yield writer.error(exc)

    # ---------------------------------------------------------------- lifecycle
    async def open(self) -> None:
        """Wait until every model has a replica, start the core, and in SLO mode follow the
        tuner's admission cap."""
        await self.peers.start(wait_for_all=True)
        await self.core.start()
        if self.cfg.tuner.min_tokens_per_s and self.admission_cap is not None:
            self._slo = asyncio.create_task(
                self.cap.follow(self.admission_cap, self.cfg.tuner.period_s), name="ingress-slo"
            )

    async def close(self) -> None:
        await cancel_and_wait(self._slo)
        await self.recovery.stop()
        await self.live_quality.stop()
        await self.responses.stop()
        await self.admission.close()
        await self.core.stop()
        await self.peers.stop()
        await self.channel.close()

    # ------------------------------------------------------------------- health
    def health(self) -> tuple[int, dict[str, Any]]:
        """``/health``: 503 while a model has no replica or the peer view is not refreshed."""
        missing = self.peers.missing()
        if missing or not self.peers.refreshing:
            return 503, {"status": "unavailable", "models_without_replica": missing}
        return 200, {"status": "ok"}

    def check_health(self) -> None:
        """The platform's probe: raises while the receive or refresh loop stopped or the
        channel closed (a failure restarts this replica; its streams end, and the models end
        its requests once its active count goes silent)."""
        problem = self.core.health_problem()
        if problem is not None:
            raise RuntimeError(problem)

    def unavailable(self) -> str | None:
        """The models without a healthy replica (or recovery in progress); None: none."""
        missing = self.peers.missing()
        if missing or self.recovery.running:
            return ", ".join(missing) or "being recovered"
        return None

    def has_room(self, reserved: int) -> bool:
        """A slot is free for one more request, counting those the admission queue let in
        that have not been submitted yet."""
        return self.core.num_active + reserved < self.cap.limit

    # ------------------------------------------------------------------ reports
    def model_card(self) -> dict[str, Any]:
        return {
            "id": self.served_model_name,
            "object": "model",
            "created": 0,
            "owned_by": "tokenrouter-ray",
            "max_model_len": self.limits.max_model_len,
            "models": self.models,
        }

    async def stats(self) -> dict[str, Any]:
        """This ingress's counts, and what one replica of each model holds now."""
        models: dict[str, Any] = {}
        for name, status in self.model_status.items():
            try:
                status_now = await asyncio.wait_for(status(), timeout=STATUS_TIMEOUT_S)
                models[name] = status_now.to_json()  # a ReplicaStatus (replica/status.py)
            except Exception as exc:
                models[name] = {"error": repr(exc)}
        return {
            "active_requests": self.core.num_active,
            "entry_requests": self.entry_total,
            "tokens_received": self.core.tokens_received,  # committed tokens seen here
            "frames_received": self.core.frames_received,
            "bytes_sent": self.channel.bytes_sent,  # NEW, ACTIVE, ABORT frames
            "cpu_s": time.process_time(),  # this ingress process's CPU time
            "pid": os.getpid(),  # this ingress process (for per-process CPU from /proc)
            "gc": collector_stats(),  # this process's garbage collector since start-up
            "endpoints": self.peers.by_model,
            "recoveries": self.recovery.log[-20:],
            "moved_off": self.moves[-20:],  # requests moved off replicas that drained
            "stream_buffered_tokens": self.buffered_tokens,  # not yet taken by clients
            "client_stalls": self.client_stalls,  # streams cut: client stopped reading
            "orphans_aborted": self.core.orphans_aborted,  # copies told to stop
            "stored_responses": self.responses.store.stats(),  # the Responses API's store
            "models": models,
        }

    async def quality_status(self) -> dict[str, Any]:
        """Live quality (quality/live.py) and the speed bypass's choice per load level
        (quality/speed.py)."""
        bypass = self.bypass
        return {
            **self.live_quality.status(),
            "speed_bypass": None
            if bypass is None
            else bypass.status(await self.tuner_prediction()),
        }

    async def tuner_prediction(self) -> tuple[dict[int, float], dict[int, float]] | None:
        """The tuner's latest predicted tokens/s per N, routed and by the top model alone
        (None: no tuner, no solve yet, or it did not answer in time)."""
        if self.tuner_status_of is None:
            return None
        try:
            status = await asyncio.wait_for(self.tuner_status_of(), timeout=STATUS_TIMEOUT_S)
        except Exception:
            return None
        last = status.last
        return (last.predicted_routed, last.predicted_alone) if last.predicted_alone else None

    async def tuner_status(self) -> Any:
        if self.tuner_status_of is None:
            raise NotFoundError("The threshold tuner is not enabled (set `tuner=live`).")
        return (await self.tuner_status_of()).to_json()  # a TunerStatus (tuning/decision.py)

    # ----------------------------------------------------------------- recovery
    def on_lost(self, lost: set[str]) -> None:
        """Model endpoints whose lease ran out: their replicas died. Their channels and
        prefix memories are dropped, and their unfinished requests re-created once each
        model has a replica again (``ingress/recovery.py``). A replica that drained first
        has nothing left here: only its channel is dropped."""
        for name in lost:
            self.channel.forget_peer(name)
            self.forget_replica(name)
        dead = lost - self.drained
        self.drained -= lost
        if dead:
            self.recovery.lost(dead)

    def on_peer_lost(self, rid: str, wire_rid: str, endpoint: str, error: str) -> None:
        """A model replica ended ``rid`` because a HANDOFF could not reach ``endpoint``
        (that replica left between the request's placement and the handoff: a scale-down
        racing a handoff back). Once ``endpoint`` has left the directory (or is draining),
        every request that may be there is re-created from its committed sequence, as for
        a lost replica (``ingress/recovery.py``); an endpoint still listed after
        ``PEER_LOSS_SETTLE_S`` is alive, and the request fails with the replica's error."""
        loop = asyncio.get_running_loop()

        def gone() -> bool:
            return endpoint in self.drained or endpoint not in self.peers.all()

        async def settle() -> None:
            deadline = loop.time() + PEER_LOSS_SETTLE_S
            while not gone() and loop.time() < deadline:
                await asyncio.sleep(PEER_LOSS_POLL_S)  # the peer view refreshes meanwhile
            if gone():
                self.recovery.lost({endpoint})
            else:
                self.core.fail_wire(wire_rid, error)

        task = loop.create_task(settle(), name=f"peer-lost-{rid}")
        self._moving.add(task)
        task.add_done_callback(self._moving.discard)

    def on_drain(self, endpoint: str) -> None:
        """A model replica is leaving on purpose (Serve scales it down or replaces it; it
        sent DRAIN): placement stops choosing it at once, and every request that may be on
        it is re-created on another replica of its model from its committed sequence
        (``IngressCore.move_off``; its copy there is ABORTed, which frees its KV). No 503
        meanwhile: the model still has replicas. Once its lease ends, ``on_lost`` only
        drops its channel."""
        if endpoint in self.drained:
            return
        self.drained.add(endpoint)
        self.peers.exclude(endpoint)
        self.forget_replica(endpoint)
        started = time.monotonic()

        async def move() -> None:
            try:
                n = await self.core.move_off(endpoint, self.replace)
            except Exception:
                logger.exception("ingress: moving the requests off %s failed", endpoint)
                n = -1
            self.moves.append(
                {"left": endpoint, "moved": n, "took_s": round(time.monotonic() - started, 3)}
            )
            if n > 0:
                self.metrics.requests_moved("drain", n)
            del self.moves[:-20]

        task = asyncio.get_running_loop().create_task(move(), name=f"move-off-{endpoint}")
        self._moving.add(task)
        task.add_done_callback(self._moving.discard)

    def _recreated(self, n: int) -> None:
        self.metrics.requests_moved("lost", n)
