"""``IngressService``: everything an OpenAI ingress replica does that is not Ray Serve's.

It owns the request core (``IngressCore``), the OpenAI server (``IngressServer``), the
Responses API's stored responses (``ResponsesApi`` over a ``ResponseStore``), admission
(``AdmissionQueue`` and ``AdmissionCap``, with the loop that follows the tuner's SLO cap),
recovery (``Recovery``), the request limits, the tokenizer and generation defaults, health
(``health`` for ``/health``, ``check_health`` for the platform's probe) and the statistics
of ``/v1/tokenrouter/stats``. It is built from injected parts, so tests build it for real
without Ray:

- ``channel``: this replica's peer channel, started (its endpoint is what ``peers``
  heartbeats); the service closes it on ``stop``;
- ``peers``: a ``PeerView`` (model -> live endpoints, refreshed in the background;
  ``deployments/peers.py PeerBook`` in Serve), whose lost endpoints are reported to
  ``on_lost``;
- ``model_infos``: each model's ``info()`` (``max_model_len``, ``vocab_size``), entry first;
- callables for what lives elsewhere: ``admission_cap`` (the tuner's app-wide cap, polled
  in SLO mode), ``tuner_status``, and ``model_status`` (model -> its replica's status).

The HTTP app over it is ``ingress/http_app.py build_app``; the Serve deployment
(``deployments/ingress.py``) builds the Ray parts, this service and that app. No Ray here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol

from tokenrouter_ray.config import AppConfig
from tokenrouter_ray.host_gc import collector_stats
from tokenrouter_ray.ingress.admission import AdmissionQueue
from tokenrouter_ray.ingress.backpressure import Backpressure
from tokenrouter_ray.ingress.core import IngressCore
from tokenrouter_ray.ingress.openai_server import IngressServer
from tokenrouter_ray.ingress.recovery import AdmissionCap, Recovery
from tokenrouter_ray.ingress.response_store import ResponseStore
from tokenrouter_ray.ingress.responses_api import ResponsesApi
from tokenrouter_ray.metrics import Metrics
from tokenrouter_ray.openai.errors import NotFoundError
from tokenrouter_ray.openai.generation_defaults import GenerationDefaults
from tokenrouter_ray.openai.validation import RequestLimits
from tokenrouter_ray.quality.live import LiveQuality, Scorer
from tokenrouter_ray.quality.speed import SpeedBypass
from tokenrouter_ray.quality.target import QualityTarget
from tokenrouter_ray.transport.base import PeerChannel

# how long a model endpoint a replica could not reach may stay listed before it counts as
# alive (its request then fails): a directory lease (5 s) and a refresh or two
PEER_LOSS_SETTLE_S = 8.0
PEER_LOSS_POLL_S = 0.1
STATUS_TIMEOUT_S = 5.0  # one model's status in /v1/tokenrouter/stats

logger = logging.getLogger(__name__)


class ModelLimits(Protocol):
    """What the service reads of a model's ``info()`` (replica/status.py ``ReplicaInfo``)."""

    max_model_len: int
    vocab_size: int


class PeerView(Protocol):
    """What the service needs of a peer book (``deployments/peers.py PeerBook``)."""

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


class IngressService:
    """One ingress replica's serving logic over injected parts (see the module docstring)."""

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
        self.tokenizer = tokenizer
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
                channel, self._entry, peers.all, self.metrics, self.timeout_s, prefill_at
            )
        self.core = core
        self.recovery = Recovery(
            self.core, peers.missing, self._replace, timeout_s=self.timeout_s,
            recreated=lambda n: self.metrics.requests_moved("lost", n),
        )  # fmt: skip
        names = cfg.model_names
        self.server = IngressServer(
            self.core,
            tokenizer,
            cfg.served_model_name,
            entries=lambda: self.peers.by_model[names[0]],
            max_active=lambda: self.cap.limit,
            unavailable=self.unavailable,
            models=names,
            # every model's replica by the one placement rule (ingress/placement.py)
            replicas_of=lambda model: self.peers.by_model.get(model, []),
            block_sizes={name: spec.block_size for name, spec in cfg.models.items()},
            backpressure=Backpressure(ing.stream_buffer_tokens, ing.client_stall_s),
        )
        # the Responses API's stored responses: this replica's own (docs/reference/api.md)
        self.responses = ResponsesApi(
            lambda: self.server,
            ResponseStore(ing.responses.max_responses, ing.responses.max_bytes),
            cfg.served_model_name,
            ingress_replicas=ing.num_replicas,
        )
        qm = cfg.quality_monitor
        # live quality: ``scorer`` teacher-forces on a replica of the top model
        self.quality = LiveQuality(
            scorer, self.metrics, cfg.policy.name, cfg.policy.preset_thresholds(),
            qm.sample_rate, qm.max_pending, qm.window, qm.timeout_s,
        )  # fmt: skip
        if cfg.tuner.quality_target is not None and self.quality.sample_rate > 0:
            self.quality.target = QualityTarget(
                cfg.tuner.quality_target, cfg.policy.preset_thresholds(), names[-1]
            )
        self.server.quality = self.quality if self.quality.sample_rate > 0 else None
        if cfg.tuner.speed_bypass is not None and len(names) > 1:
            self.server.bypass = SpeedBypass(cfg.tuner.speed_bypass, names[-1])
        self._slo: asyncio.Task | None = None
        self.core.on_drain = self.on_drain
        self.core.on_peer_lost = self.on_peer_lost
        self.drained: set[str] = set()  # model endpoints that left on purpose (DRAIN)
        self.moves: list[dict[str, Any]] = []  # what each DRAIN moved (stats)
        self._moving: set[asyncio.Task] = set()

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Wait until every model has a replica, start the core, and in SLO mode follow the
        tuner's admission cap."""
        await self.peers.start(wait_for_all=True)
        await self.core.start()
        if self.cfg.tuner.min_tokens_per_s and self.admission_cap is not None:
            self._slo = asyncio.create_task(
                self.cap.follow(self.admission_cap, self.cfg.tuner.period_s), name="ingress-slo"
            )

    async def stop(self) -> None:
        if self._slo is not None:
            self._slo.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._slo
        await self.recovery.stop()
        await self.quality.stop()
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
            "id": self.cfg.served_model_name,
            "object": "model",
            "created": 0,
            "owned_by": "tokenrouter-ray",
            "max_model_len": self.limits.max_model_len,
            "models": self.cfg.model_names,
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
            "entry_requests": self.server.entry_total,
            "tokens_received": self.core.tokens_received,  # committed tokens seen here
            "frames_received": self.core.frames_received,
            "bytes_sent": self.channel.bytes_sent,  # NEW, ACTIVE, ABORT frames
            "cpu_s": time.process_time(),  # this ingress process's CPU time
            "pid": os.getpid(),  # this ingress process (for per-process CPU from /proc)
            "gc": collector_stats(),  # this process's garbage collector since start-up
            "endpoints": self.peers.by_model,
            "recoveries": self.recovery.log[-20:],
            "moved_off": self.moves[-20:],  # requests moved off replicas that drained
            "stream_buffered_tokens": self.server.buffered_tokens,  # not yet taken by clients
            "client_stalls": self.server.client_stalls,  # streams cut: client stopped reading
            "orphans_aborted": self.core.orphans_aborted,  # copies told to stop
            "stored_responses": self.responses.store.stats(),  # the Responses API's store
            "models": models,
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
            self.server.forget_replica(name)
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
        self.server.forget_replica(endpoint)
        started = time.monotonic()

        async def move() -> None:
            try:
                n = await self.core.move_off(endpoint, self._replace)
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

    def _replace(self, rid: str) -> dict[str, str]:
        """A re-created request's replica of each non-entry model, by the placement rule:
        kept where it is still live, placed anew where it was lost."""
        return self.server.replace(rid)

    def _entry(self) -> str:
        return self.server.entry()
