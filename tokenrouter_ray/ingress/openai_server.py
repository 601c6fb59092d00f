"""The OpenAI side of an ingress, over an ``IngressCore`` (ingress/core.py): admission,
placement of every model's replica (ingress/placement.py), one task per choice (committed
tokens -> its ``ChoiceWriter``, openai/choice_update.py -> a ``ChoiceUpdate`` per step on the
request's queue), non-streaming responses and SSE streams. ``IngressService``
(ingress/service.py) owns one, the HTTP routes (ingress/http_app.py) call it, and the Serve
ingress (``deployments/ingress.py``) is a shim around both; tests drive it over
``LocalRuntime``. No Ray, no HTTP in it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
import weakref
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tokenrouter_ray.ingress.backpressure import Backpressure, StreamGate
from tokenrouter_ray.ingress.core import IngressCore, RequestResult
from tokenrouter_ray.ingress.placement import Placement
from tokenrouter_ray.metrics import INGRESS
from tokenrouter_ray.openai.choice_update import ChoiceUpdate, ChoiceWriter
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
)
from tokenrouter_ray.openai.responses import Completion as TextCompletion
from tokenrouter_ray.openai.sse import (
    SSE_DONE,
    ChatStream,
    CompletionStream,
    merge_choice_streams,
    sse_error,
)
from tokenrouter_ray.openai.token_reports import TokenText
from tokenrouter_ray.openai.validation import PreparedRequest, RoutingChoice
from tokenrouter_ray.quality.live import LiveQuality
from tokenrouter_ray.quality.speed import SpeedBypass
from tokenrouter_ray.transport.base import endpoint_model

logger = logging.getLogger(__name__)


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
    """The OpenAI side of an ingress over an ``IngressCore``, with no Ray and no HTTP in it.

    - admission: 503 ``OverloadedError`` when ``n`` more choices would pass ``max_active()``,
      503 ``model_unavailable`` while ``unavailable()`` names a model without a replica;
    - placement (ingress/placement.py, the one rule): each choice's replica of the entry
      model (``entries()``) and, with ``replicas_of``, of every other model, by prefix
      affinity bounded by load, counted before the await so concurrent submits spread;
      ``replace`` re-places a re-created choice after a replica loss;
    - the per-choice loop: committed tokens -> the choice's ``ChoiceWriter`` (detokenizer,
      output parsers, token reports) -> ``ChoiceUpdate`` s to the stream's queue, behind its
      backpressure gate; a stop string aborts the choice everywhere; a failed choice is its
      OpenAI error.

    ``respond`` answers a prepared request: the response object, or ``StreamedChoices``.
    ``ingress/http_app.py`` puts HTTP routes around it; tests drive it over
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
        backpressure: Backpressure | None = None,
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
        self.entry_total: dict[str, int] = {}  # choices ever sent per entry replica
        # live quality (quality/live.py): finished choices offered for scoring; None: off
        self.quality: LiveQuality | None = None
        # the speed bypass (quality/speed.py): routed or the top model alone; None: off
        self.bypass: SpeedBypass | None = None
        # one placement rule for every model's replica (ingress/placement.py): the entry's
        # from ``entries()``; with ``replicas_of`` (model -> its live endpoints), the other
        # models' too (without it, ``endpoints_for`` or the models themselves pick them)
        self.replicas_of = replicas_of
        self.entry_model = self.models[0] if self.models else ""
        self.placement = Placement(self._replicas, block_sizes)
        self._ids = itertools.count()
        # backpressure (ingress/backpressure.py): each stream's choices wait while they are
        # ``max_buffered_tokens`` ahead of their client; a client that stops reading is cut
        self.backpressure = backpressure or Backpressure()
        self._gates: weakref.WeakSet[StreamGate] = weakref.WeakSet()  # open streams
        self.client_stalls = 0  # streams ended because their client stopped reading

    def _replicas(self, model: str) -> Sequence[str]:
        if model == self.entry_model:
            return self.entries()
        return self.replicas_of(model) if self.replicas_of is not None else ()

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
    ) -> Mapping[str, str] | None:
        """The replica of each non-entry model a choice will use (counted)."""
        if self.replicas_of is None:
            return self.endpoints_for(rid) if self.endpoints_for else None
        return self.placement.place(rid, self.models[1:], prompt, cache_salt)

    def replace(self, rid: str) -> dict[str, str]:
        """After a replica loss: a re-created choice's replica of each non-entry model, kept
        where it is still live, placed anew where it was lost (ingress/recovery.py)."""
        if self.replicas_of is None:
            return dict(self.endpoints_for(rid)) if self.endpoints_for else {}
        return self.placement.replace(rid, self.models[1:])

    def _unassign(self, rid: str) -> None:
        self.placement.release_model(rid, self.models[1:])

    def _place_entry(
        self, rid: str, prompt: Sequence[int], cache_salt: str | None, alone: str | None = None
    ) -> str | None:
        """The replica a choice starts on: the entry model's, or the one model's that serves
        it alone (``alone``; without ``replicas_of``, the core picks one of its replicas)."""
        model = alone or self.entry_model
        if model != self.entry_model and self.replicas_of is None:
            return None
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
        self, prepared: PreparedRequest, chat: bool, timeout_s: float | None = None
    ) -> ChatCompletion | TextCompletion | StreamedChoices:
        if not prepared.sampling.stream:
            return await self.collect(prepared, await self.start(prepared, chat, timeout_s), chat)
        prepared = self.follow_target(prepared)
        submitted = await self.submit(prepared, timeout_s)
        prompt_len = len(prepared.prompt_token_ids)
        name = self.served_model_name
        stream_cls = ChatStream if chat else CompletionStream
        stream = stream_cls(
            name, prepared.sampling.n, include_usage=prepared.sampling.include_usage
        )
        updates: asyncio.Queue[ChoiceUpdate] = asyncio.Queue()
        gate = StreamGate(len(submitted), self.backpressure)
        self._gates.add(gate)
        # Started now: the body may never be iterated if the client leaves first.
        tasks = self.start_choices(submitted, prepared, updates, chat, gate)
        body = self._sse(stream, tasks, updates, prompt_len, gate)
        return StreamedChoices(tasks, body, lambda: self._cut_when_stalled(gate, tasks))

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
        """503 ``OverloadedError`` when ``n`` more choices would pass ``max_active()``. The
        HTTP routes call it with ``n = 1`` before reading the body, so a refusal costs no
        parsing or tokenizing (512 clients at once: docs/user-guide/reliability.md); ``submit``
        checks
        again with the request's ``n``."""
        if self.core.num_active + n > self.max_active():
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
        """The deployment's models, entry first: as given, else from the core's model
        endpoints (``model/replica``, in model order), else the writers seen."""
        if self.models:
            return self.models
        endpoints = getattr(self.core, "all_endpoints", None)
        names = [endpoint_model(e) for e in endpoints()] if endpoints is not None else []
        return list(dict.fromkeys(names or [w for w in writers if w is not None]))

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
        stream: ChatStream | CompletionStream,
        tasks: list[asyncio.Future],
        updates: asyncio.Queue[ChoiceUpdate],
        prompt_len: int,
        gate: StreamGate | None = None,
    ) -> AsyncIterator[bytes]:
        frames = merge_choice_streams(stream, tasks, updates, prompt_len, gate)
        try:
            async with contextlib.aclosing(frames):  # a disconnect aborts the choices now
                async for frame in frames:
                    yield frame
        except Exception as exc:  # never a cut connection: the error event, then [DONE]
            logger.exception("ingress: stream failed")
            yield sse_error(exc) + SSE_DONE
