"""The application config's schema: every section as a pydantic model, validated as a
whole by ``AppConfig`` (every problem one ``ConfigError`` whose message says what to fix).
Composing it with Hydra from ``conf/`` and a Serve YAML's overrides is
``app_config.compose_config``; the live-quality sections are in ``quality/settings.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from tokenrouter_ray.engine.config import EngineOptions
from tokenrouter_ray.engine.scheduler import SchedulerConfig
from tokenrouter_ray.errors import UserFacingError
from tokenrouter_ray.quality.settings import (
    QualityMonitorSpec,
    QualityTargetSpec,
    SpeedBypassSpec,
)
from tokenrouter_ray.routing import threshold_levels
from tokenrouter_ray.thresholds import ThresholdTable, check_tables

# The Hydra configs: package data (in a checkout, tokenrouter_ray/conf links to ../conf).
CONF_DIR = (Path(__file__).resolve().parent / "conf").resolve()


class ConfigError(UserFacingError):
    """The composed configuration is invalid."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SimSpec(_Strict):
    """A simulated model (``simulation/served.py``): the real serving path, a profiled step
    time instead of a forward, no model files."""

    profile: str = Field(
        "paper", description="paper | h200 | zero | a profile JSON/YAML file (per-model steps)."
    )
    time_scale: float = Field(1.0, gt=0, description="Every step time is multiplied by this.")


class AutoscalingSpec(_Strict):
    """Replica autoscaling of one deployment through Ray Serve's autoscaler
    (docs/user-guide/scaling.md).

    It becomes the deployment's Serve ``autoscaling_config`` with this project's policy
    (``deployments/autoscaling.py``): a model deployment follows the replica plan the tuner
    solves for all models together from the live routing, step times and offered load
    (``tuning/capacity.py``), and its own load signal (the rows its replicas run against
    the rows they can run) when no plan is fresh; the ingress follows its active requests
    against ``ingress.max_active_requests``. Serve applies the bounds and the delays."""

    min_replicas: int = Field(
        1,
        ge=1,
        description="Fewest replicas. At least 1: a request may be handed to any model at any "
        "token, so a model with no replica would stall every request (no scale to zero).",
    )
    max_replicas: int = Field(ge=1, description="Most replicas.")
    initial_replicas: int | None = Field(
        None, ge=1, description="Replicas at deploy time (default: min_replicas)."
    )
    target_utilisation: float = Field(
        0.7,
        gt=0,
        le=1,
        description="Load a replica is planned at: a model replica's mean rows per step "
        "against its max_num_seqs (the ingress: active requests against "
        "max_active_requests). Lower: more headroom, more replicas.",
    )
    upscale_delay_s: float = Field(
        5.0, ge=0, description="A higher replica count must be wanted this long before it is set."
    )
    downscale_delay_s: float = Field(
        30.0, ge=0, description="A lower replica count must be wanted this long before it is set."
    )
    metrics_interval_s: float = Field(
        1.0, gt=0, description="How often each replica sends Serve its load signal."
    )
    look_back_period_s: float = Field(
        5.0, gt=0, description="Serve averages each replica's load signal over this window."
    )

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingSpec:
        if self.max_replicas < self.min_replicas:
            raise ValueError(
                f"max_replicas ({self.max_replicas}) is below min_replicas ({self.min_replicas})"
            )
        start = self.initial_replicas
        if start is not None and not self.min_replicas <= start <= self.max_replicas:
            raise ValueError(
                f"initial_replicas ({start}) is outside [{self.min_replicas}, {self.max_replicas}]"
            )
        return self

    @property
    def start_replicas(self) -> int:
        return self.initial_replicas if self.initial_replicas is not None else self.min_replicas


class ModelSpec(EngineOptions):
    """One model: what its engine takes as written (dtype, KV blocks, longest sequence,
    prefix caching, attention kernels, tensor parallel: engine/config.py ``EngineOptions``,
    which this extends), then its checkpoint and how Serve runs it (resources, replicas,
    watchdog, memory budget, scheduler overrides)."""

    path: str = Field(description="HF causal-LM directory or hub id (`sim` with `sim` set).")
    sim: SimSpec | None = Field(
        None, description="Serve a simulated model of this profile instead of a checkpoint."
    )
    max_step_s: float = Field(
        300.0,
        gt=0,
        description="Watchdog: a step running longer fails the replica's health check (Serve "
        "restarts it; its requests recover elsewhere).",
    )
    max_failed_steps: int = Field(
        3, ge=1, description="Watchdog: this many failed steps in a row fail the health check."
    )
    num_gpus: float = Field(0, ge=0, description="GPUs per replica (0: CPU).")
    num_cpus: float = Field(1, ge=0, description="CPUs reserved per replica.")
    num_replicas: int = Field(
        1,
        ge=1,
        description="Data-parallel replicas, fixed (leave at 1 with autoscaling, whose bounds "
        "set the count).",
    )
    autoscaling: AutoscalingSpec | None = Field(
        None,
        description="Let Serve's autoscaler set this model's replica count between bounds "
        "(instead of num_replicas), jointly with the other models (docs/user-guide/scaling.md).",
    )
    drain_timeout_s: float = Field(
        20.0,
        gt=0,
        description="A replica being stopped (scale-down, rolling update) moves its requests "
        "to another replica of the model and waits at most this long for them to leave "
        "before it exits (Serve's graceful shutdown gets this plus a margin).",
    )
    resources: dict[str, float] = Field(
        default_factory=dict, description="Custom Ray resources: pins the model to nodes."
    )
    prefill_at_admission: int | None = Field(
        None,
        ge=1,
        description="Prefill a new request's prompt on this model at admission, beside the "
        "entry model's prefill, when the prompt has at least this many tokens: the request's "
        "first handoff here then finds the prompt's KV in the prefix cache, so its time to "
        "first token is the longer prefill, not the sum. Costs that prefill for requests "
        "that never come here. None: off. Ignored on the entry model; needs prefix_caching.",
    )
    memory_budget_gb: float = Field(
        2.0, gt=0, description="Weights + KV budget per replica (per rank with tensor_parallel)."
    )
    scheduler: dict[str, Any] = Field(
        default_factory=dict, description="Overrides of the shared scheduler settings."
    )
    device_group: str | None = Field(
        None,
        description="Models naming the same group share one device (e.g. num_gpus 0.5 each "
        "on one GPU): their weights + KV are planned together within shared_devices[group] "
        "GiB, and each gets its share of it as its memory budget (memory_budget_gb ignored).",
    )

    @model_validator(mode="after")
    def _replicas_fixed_or_scaled(self) -> ModelSpec:
        if self.autoscaling is not None and self.num_replicas != 1:
            raise ValueError(
                f"num_replicas={self.num_replicas} with autoscaling: set num_replicas or "
                "autoscaling, not both (autoscaling's bounds set the count)"
            )
        return self

    @property
    def max_replicas(self) -> int:
        """The most replicas this model can have (what deadlock-freedom must hold for)."""
        return self.autoscaling.max_replicas if self.autoscaling else self.num_replicas

    @property
    def start_replicas(self) -> int:
        return self.autoscaling.start_replicas if self.autoscaling else self.num_replicas

    @model_validator(mode="after")
    def _prefill_needs_the_cache(self) -> ModelSpec:
        if self.prefill_at_admission is not None and not self.prefix_caching:
            raise ValueError("prefill_at_admission needs prefix_caching (the KV waits there)")
        return self

    @model_validator(mode="after")
    def _heads_split(self) -> ModelSpec:
        """A local checkpoint's heads must split evenly over the ranks (hub ids: at load)."""
        if self.tensor_parallel > 1 and Path(self.path).is_dir():
            from tokenrouter_ray.engine.tensor_parallel import check_local_model

            check_local_model(self.path, self.tensor_parallel, self.gguf_file)
        return self


PresetValue = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]


class PolicySpec(_Strict):
    name: str = Field(description="A registered policy (see docs/user-guide/policies.md).")
    options: dict[str, Any] = Field(default_factory=dict, description="The policy's config.")
    presets: dict[str, PresetValue | list[PresetValue]] = Field(
        default_factory=dict,
        description="Per-request quality presets (a request's `routing.quality`, "
        "docs/reference/api.md): name (e.g. high, balanced, fast) -> the decision threshold it "
        "stands "
        "for, in the policy's own terms (r2r/entropy/citer/co_llm threshold, rstitch/"
        "glimprouter tau, bernoulli p); escalation: one value for every level or one per "
        "level. Empty: requests may give only `routing.threshold`.",
    )
    alone: str | None = Field(
        None,
        description="Serve every request that asks for no `routing` by this model alone "
        "(single-model bypass: no policy, no handoffs), e.g. `large` where routing costs "
        "more than it saves; requests that give `routing.threshold` or `routing.quality` "
        "are still routed. None: route every request.",
    )

    def threshold_levels(self, num_models: int) -> int:
        """How many thresholds a request's ``routing.threshold`` may give (besides one for
        every level): 0 for a policy without one, ``num_models - 1`` for escalation, else 1
        (routing/__init__.py ``THRESHOLDS``, torch-free)."""
        return threshold_levels(self.name, num_models)

    def preset_thresholds(self) -> dict[str, tuple[float, ...]]:
        """Every preset as the ``RouteState.thresholds`` it stands for."""
        return {
            name: tuple(value) if isinstance(value, list) else (value,)
            for name, value in self.presets.items()
        }


FRAME_BYTES_PER_TOKEN = 9  # msgpack: an int up to 2**64 (token ids are far below)
FRAME_BYTES_PER_MESSAGE = 64 << 10  # ids, RouteState, sampling, extras, token reports


def largest_frame_bytes(max_model_len: int, max_num_seqs: int) -> int:
    """An upper bound on a legitimate peer frame: one step's batch to one destination holds
    at most ``max_num_seqs`` messages, each at most a whole sequence of token ids (a NEW
    that re-creates a request) plus its bounded per-message fields."""
    return max_num_seqs * (max_model_len * FRAME_BYTES_PER_TOKEN + FRAME_BYTES_PER_MESSAGE)


class FrameSpec(_Strict):
    """The signed peer frames' settings, the same on both socket transports (zmq, unix)."""

    send_hwm: int = Field(1024, ge=1, description="Frames queued per peer before sends fail.")
    max_frame_mib: float = Field(
        16.0,
        gt=0,
        description="Largest frame accepted (bigger ones are dropped); must hold the "
        "largest legitimate frame (max_num_seqs whole sequences: the config check).",
    )
    reject_rate: float = Field(
        1000.0,
        gt=0,
        description="Rejected frames (bad MAC, malformed, replayed) a replica examines per "
        "second, with a burst of a quarter second's worth; past it the receiver waits before "
        "reading the next frame, so a stranger's flood costs at most this many MAC checks a "
        "second, and the fair queueing across connections keeps serving the honest ones "
        "between them (each waits at most 1/reject_rate per junk frame ahead of it).",
    )
    bad_mac_unhealthy_s: float = Field(
        15.0,
        gt=0,
        description="A replica that received only bad_mac frames for this long (its peers "
        "sign with another secret) fails its health check and is restarted.",
    )

    @property
    def max_frame_bytes(self) -> int:
        return int(self.max_frame_mib * 2**20)


class ZmqSpec(FrameSpec):
    """``transport.kind: zmq``: ZeroMQ sockets (transport/zmq_channel.py)."""

    transport: Literal["ipc", "tcp"] = Field(
        "ipc", description="ipc: ZeroMQ over socket files (one node); tcp: between nodes."
    )
    bind_host: str | None = Field(
        None,
        description="tcp: interface to bind; default: this node's (pod's) own address. "
        "0.0.0.0 (all interfaces) only when set explicitly.",
    )
    advertise_host: str | None = Field(
        None, description="tcp: address peers dial (the RoCE NIC's IP); default: node IP."
    )
    port: int = Field(0, ge=0, le=65535, description="tcp: 0 picks a free port per replica.")
    port_range: tuple[int, int] | None = Field(
        None,
        description="tcp (with port 0): bind a free port in [lo, hi], so a NetworkPolicy can "
        "name the peer ports (the Helm chart's zmqPorts); default: any free port.",
    )
    recv_hwm: int = Field(
        1024, ge=1, description="Frames queued per incoming connection (bounds a flood)."
    )
    curve: bool = Field(
        False,
        description="ZeroMQ CURVE: encrypt peer traffic and refuse, in the handshake, any "
        "client without the app's key pair (derived from the peer secret).",
    )

    @field_validator("transport", mode="before")
    @classmethod
    def _unix_is_a_kind(cls, value: Any) -> Any:
        if value == "unix":
            raise ValueError("unix is now transport.kind: unix (its settings: transport.unix)")
        return value

    @model_validator(mode="after")
    def _ports(self) -> ZmqSpec:
        if self.port_range is not None:
            lo, hi = self.port_range
            if not 0 < lo <= hi <= 65535:
                raise ValueError(f"port_range {list(self.port_range)}: need 1 <= lo <= hi")
        return self


class UnixSpec(FrameSpec):
    """``transport.kind: unix``: the kernel's SOCK_SEQPACKET sockets on one node, written and
    read by the replicas' own threads, without ZeroMQ's I/O threads
    (transport/unix_channel.py). No CURVE: its socket files are private to this user (mode
    0600), as ZeroMQ's ipc ones."""


class TransportSpec(_Strict):
    kind: Literal["zmq", "unix", "ray"] = Field(
        "zmq",
        description="zmq: ZeroMQ (transport.zmq); unix: bare Unix sockets on one node "
        "(transport.unix); ray: Ray actor calls.",
    )
    zmq: ZmqSpec = Field(default_factory=ZmqSpec)
    unix: UnixSpec = Field(default_factory=UnixSpec)

    @model_validator(mode="after")
    def _no_curve_on_unix(self) -> TransportSpec:
        if self.kind == "unix" and self.zmq.curve:
            raise ValueError(
                "transport.zmq.curve is ZeroMQ's (its answer to strangers on the network): "
                "transport.kind: unix has none (its socket files are private to this user)"
            )
        return self

    @property
    def frames(self) -> FrameSpec:
        """The frame settings of the configured kind: ``unix``'s, else ``zmq``'s (a ray
        channel sends no frames of its own and reads none of them)."""
        return self.unix if self.kind == "unix" else self.zmq


class RequestLimitSpec(_Strict):
    """What one request may ask for (each past-limit request is a 400 naming the limit)."""

    max_body_mib: float = Field(
        8.0, gt=0, description="Largest HTTP body (413, from Content-Length and while reading)."
    )
    max_messages: int = Field(1024, ge=1, description="Most chat messages in one request.")
    max_content_chars: int = Field(
        1 << 20, ge=1, description="Most characters of prompt text (all messages together)."
    )
    max_stop_chars: int = Field(256, ge=1, description="Longest stop string.")
    max_stop_token_ids: int = Field(64, ge=0, description="Most stop_token_ids.")
    max_logit_bias: int = Field(300, ge=0, description="Most logit_bias entries.")
    max_total_tokens: int | None = Field(
        None, ge=1, description="Cap on n x max_tokens; None: the n cap x the context."
    )


class ResponseStoreSpec(_Strict):
    """The Responses API's stored responses (``store``, ``previous_response_id``, ``GET``):
    kept in memory by the ingress replica that made them, least recently used evicted
    first (docs/reference/api.md, "Stored responses")."""

    max_responses: int = Field(
        2048,
        ge=1,
        description="Most responses one ingress replica keeps; past it the least recently "
        "used (created, read or continued) is evicted. Responses still generating in the "
        "background are never evicted.",
    )
    max_mib: float = Field(
        128.0,
        gt=0,
        description="Most MiB of stored responses (their JSON: the response object and the "
        "input items it was made from, a continued conversation's included) one ingress "
        "replica keeps; past it the least recently used are evicted. A request whose input "
        "alone is larger is a 400 unless it sets store: false.",
    )

    @property
    def max_bytes(self) -> int:
        return int(self.max_mib * 2**20)


class IngressSpec(_Strict):
    num_replicas: int = Field(
        1, ge=1, description="Ingress replicas (fixed; leave at 1 with autoscaling)."
    )
    autoscaling: AutoscalingSpec | None = Field(
        None,
        description="Let Serve's autoscaler set the ingress replicas between bounds (instead "
        "of num_replicas), from their active requests against max_active_requests.",
    )
    num_cpus: float = Field(
        0, ge=0, description="CPUs reserved per ingress replica (I/O bound: 0 by default)."
    )
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources per ingress replica: pins the replicas to the nodes "
        "that advertise them (the Helm chart's direct port: its ingress pods).",
    )
    max_active_requests: int = Field(
        256, ge=1, description="Requests in flight per ingress replica before 503."
    )
    request_timeout_s: float = Field(
        600.0,
        gt=0,
        description="Deadline of a request (its `timeout` extension may change it): past "
        "it, the request ends with a 503 timeout error and is aborted on every model.",
    )
    generation_config: Literal["auto", "none"] = Field(
        "auto",
        description="`auto`: the entry model's generation_config.json sampling values "
        "(temperature, top_p, top_k) apply when a request omits them, as vLLM does; `none`: "
        "OpenAI's defaults only.",
    )
    admission_queue: int = Field(
        32,
        ge=0,
        description="Requests that may wait for a slot when all max_active_requests are taken "
        "(first come, first served); past it, or past admission_wait_s, a 429 with "
        "Retry-After. 0: refuse at once.",
    )
    admission_wait_s: float = Field(
        1.0, ge=0, description="Longest wait in the admission queue before a 429."
    )
    max_queued_requests: int = Field(
        1024,
        ge=-1,
        description="Serve's own queue in front of each ingress replica (max_queued_requests; "
        "-1: unbounded); Serve answers 503 past it.",
    )
    stream_buffer_tokens: int = Field(
        256,
        ge=1,
        description="Tokens a streamed choice may be ahead of its client: past it the choice "
        "reads no more committed tokens until the client takes a chunk (backpressure).",
    )
    client_stall_s: float = Field(
        30.0,
        gt=0,
        description="A streaming client that took no chunk for this long while output waits "
        "for it (a full choice, or generation over) is cut: its request is aborted on every "
        "model and its memory freed. Seen only where the HTTP server blocks on a full socket "
        "(docs/user-guide/reliability.md, backpressure).",
    )
    direct_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="Also serve the OpenAI API from each ingress replica on this port "
        "(ingress/direct_http.py; replicas on one node share it with SO_REUSEPORT), beside "
        "Serve's proxy: one process hop less per request and per chunk, and a client that "
        "stops reading is seen (client_stall_s). null: Serve's proxy only.",
    )
    direct_host: str | None = Field(
        "127.0.0.1",
        description="Address the direct port binds: 127.0.0.1 (this host only) by default; "
        "null: this node's (pod's) own address, to take traffic from elsewhere; 0.0.0.0 (all "
        "interfaces) only when set explicitly.",
    )
    direct_send_buffer_kib: int | None = Field(
        None,
        ge=4,
        description="Kernel send buffer of each direct-port connection (KiB; null: the "
        "kernel's default, which autotunes up to megabytes): what a client that stops reading "
        "can absorb before the ingress sees it.",
    )
    limits: RequestLimitSpec = Field(default_factory=RequestLimitSpec)
    responses: ResponseStoreSpec = Field(
        default_factory=ResponseStoreSpec,
        description="Stored responses of the Responses API (per ingress replica).",
    )

    @model_validator(mode="after")
    def _replicas_fixed_or_scaled(self) -> IngressSpec:
        if self.autoscaling is not None and self.num_replicas != 1:
            raise ValueError(
                f"ingress.num_replicas={self.num_replicas} with ingress.autoscaling: set "
                "num_replicas or autoscaling, not both (autoscaling's bounds set the count)"
            )
        return self

    @property
    def start_replicas(self) -> int:
        return self.autoscaling.start_replicas if self.autoscaling else self.num_replicas


class TunerSpec(_Strict):
    """The ``tuner`` section of an app config (Hydra group ``conf/tuner/``)."""

    enabled: bool = Field(False, description="Run the tuner deployment and follow it.")
    period_s: float = Field(10.0, gt=0, description="Replicas report and the tuner decides.")
    window_s: float = Field(60.0, gt=0, description="Statistics window on every replica.")
    resolve_every_s: float = Field(300.0, gt=0, description="Re-solve even without drift.")
    concurrencies: list[int] = Field(
        default_factory=lambda: [1, 2, 4, 8, 16], description="Active-request counts N tuned."
    )
    grain_ms: float = Field(0.5, gt=0, description="Markov time grain (coarser = faster).")
    fixed: dict[str, int] = Field(default_factory=dict, description="Thresholds held fixed.")
    min_gain: float = Field(0.02, ge=0, description="Adopt a new B only for this gain.")
    max_step: int = Field(4, ge=1, description="Largest threshold move per decision.")
    drift: float = Field(0.05, gt=0, description="Re-solve when a p_ij moves this much.")
    min_moves: int = Field(50, ge=1, description="Observations per model before tuning.")
    quality_target: QualityTargetSpec | None = Field(
        None,
        description="Hold a live quality target: requests without `routing` take the "
        "cheapest preset (or the top model alone) whose live agreement meets it "
        "(docs/user-guide/quality.md). null: they take policy.alone or the policy's own "
        "threshold.",
    )
    speed_bypass: SpeedBypassSpec | None = Field(
        None,
        description="Serve requests without `routing` by the top model alone at the load "
        "levels where that is measured faster than routing (docs/user-guide/quality.md). "
        "null: they are routed whenever their quality rung routes.",
    )
    min_tokens_per_s: float | None = Field(
        None, gt=0, description="SLO: per-request speed; caps admitted concurrency."
    )
    profile: str | None = Field(
        None, description="Step-time profile (JSON/YAML, `tokenrouter-ray profile`) to start from."
    )
    target_tpot_ms: float | None = Field(
        None,
        gt=0,
        description="Replica plan (models with autoscaling): the mean time per output token "
        "the planned replica counts must keep at the offered load (null: each model's "
        "target_utilisation only).",
    )
    transit: bool = Field(
        True,
        description="Price the measured time between models (each handoff's built -> applied "
        "latency) into the throughput model; false: a handoff takes no time there.",
    )

    @field_validator("concurrencies")
    @classmethod
    def _positive(cls, value: list[int]) -> list[int]:
        if not value or min(value) < 1:
            raise ValueError("concurrencies must be a non-empty list of positive integers")
        return sorted(set(value))


class GcSpec(_Strict):
    """Python's garbage collector in each serving process (tokenrouter_ray/host_gc.py):
    applied once the process has started (models loaded, sockets open)."""

    freeze_after_start: bool = Field(
        True,
        description="gc.freeze() once started: the start-up heap (torch, the model, Ray) "
        "moves to a generation collections skip.",
    )
    threshold: tuple[Annotated[int, Field(ge=1)], ...] | None = Field(
        (20_000, 20, 100),
        min_length=3,
        max_length=3,
        description="gc.set_threshold for (young, middle, old); null keeps Python's (700, 10, 10).",
    )


class AppConfig(_Strict):
    served_model_name: str = Field("tokenrouter", description="The `model` clients ask for.")
    models: dict[str, ModelSpec] = Field(description="Ordered from the entry (smallest) model.")
    policy: PolicySpec
    transport: TransportSpec = Field(default_factory=TransportSpec)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    ingress: IngressSpec = Field(default_factory=IngressSpec)
    tuner: TunerSpec = Field(default_factory=TunerSpec)
    gc: GcSpec = Field(default_factory=GcSpec)
    quality_monitor: QualityMonitorSpec = Field(default_factory=QualityMonitorSpec)
    shared_devices: dict[str, float] = Field(
        default_factory=dict,
        description="Memory (GiB) of each device that several models share (the models name "
        "it as their device_group): weights + KV of all of them must fit in it.",
    )

    @model_validator(mode="after")
    def _check(self) -> AppConfig:
        if len(self.models) < 1:
            raise ValueError("at least one model is needed")
        for name in self.models:
            self.scheduler_for(name)  # each merged scheduler config must validate
        self._check_deadlock_free()
        self._check_device_groups()
        self._check_frame_limit()
        self._check_presets()
        if self.policy.alone is not None and self.policy.alone not in self.models:
            raise ValueError(
                f"policy.alone: {self.policy.alone!r} is not a model "
                f"(models are {', '.join(self.models)})"
            )
        self._check_quality_target()
        unknown = set(self.tuner.fixed) - set(self.models)
        if unknown:
            raise ValueError(f"tuner.fixed names unknown models {sorted(unknown)}")
        return self

    def _check_quality_target(self) -> None:
        """The quality target's rungs are presets, it starts on one of them (or alone), and
        answers are scored for it to read."""
        qt = self.tuner.quality_target
        if qt is None:
            return
        presets = self.policy.presets
        unknown = [name for name in qt.ladder if name not in presets]
        if unknown:
            raise ValueError(
                f"tuner.quality_target.ladder: {unknown} are not policy.presets "
                f"(configured: {sorted(presets) or 'none'})"
            )
        if len(set(qt.ladder)) != len(qt.ladder):
            raise ValueError("tuner.quality_target.ladder names a preset twice")
        rungs = [*qt.ladder, *(["alone"] if qt.bypass else [])]
        if qt.start is not None and qt.start not in rungs:
            raise ValueError(f"tuner.quality_target.start: {qt.start!r} is not one of {rungs}")
        if self.quality_monitor.sample_rate <= 0:
            raise ValueError(
                "tuner.quality_target needs scored answers: set quality_monitor.sample_rate > 0"
            )

    def _check_presets(self) -> None:
        """Every preset gives one threshold, or (escalation) one per level."""
        levels = self.policy.threshold_levels(len(self.models))
        for name, values in self.policy.preset_thresholds().items():
            if levels == 0:
                raise ValueError(f"policy {self.policy.name!r} has no threshold to preset")
            if len(values) not in (1, levels):
                raise ValueError(
                    f"policy.presets.{name}: {len(values)} thresholds; the policy takes one"
                    + (f" or {levels} (one per level)" if levels > 1 else "")
                )

    def scheduler_for(self, name: str) -> SchedulerConfig:
        merged = {**self.scheduler.model_dump(), **self.models[name].scheduler}
        return SchedulerConfig(**merged)

    def _check_deadlock_free(self) -> None:
        """sum_i R_i (B_i(N) - 1) < N for every active count N (docs/user-guide/tuning.md,
        ``thresholds.check_tables``): every one of the R_i replicas of model i applies B_i(N)
        to the requests placed on it; R_i is num_replicas, or autoscaling's max_replicas
        (the configured tables must hold at any count the autoscaler may set; the live
        tuner re-solves for the count there is)."""
        tables = {n: ThresholdTable.of(self.scheduler_for(n).batch_thresholds) for n in self.models}
        check_tables(tables, {name: spec.max_replicas for name, spec in self.models.items()})

    def _check_frame_limit(self) -> None:
        """The peer frame limit must hold every model's largest legitimate frame."""
        frames = self.transport.frames
        section = "unix" if self.transport.kind == "unix" else "zmq"
        for name, spec in self.models.items():
            if spec.max_model_len is None:
                continue  # the model's own context length is read at load
            need = largest_frame_bytes(spec.max_model_len, self.scheduler_for(name).max_num_seqs)
            if need > frames.max_frame_bytes:
                raise ValueError(
                    f"transport.{section}.max_frame_mib={frames.max_frame_mib:g} is below "
                    f"model {name!r}'s largest legitimate frame ({need / 2**20:.1f} MiB: "
                    "max_num_seqs whole sequences of max_model_len tokens); raise it"
                )

    def device_groups(self) -> dict[str, list[str]]:
        """Shared device -> the models on it, in config order."""
        groups: dict[str, list[str]] = {}
        for name, spec in self.models.items():
            if spec.device_group is not None:
                groups.setdefault(spec.device_group, []).append(name)
        return groups

    def _check_device_groups(self) -> None:
        groups = self.device_groups()
        for group, members in groups.items():
            if group not in self.shared_devices:
                raise ValueError(
                    f"models {members} name device_group {group!r} but shared_devices has no "
                    f"entry for it (add shared_devices.{group}=<GiB>)"
                )
            if not self.shared_devices[group] > 0:
                raise ValueError(f"shared_devices.{group} must be positive GiB")
            specs = [self.models[m] for m in members]
            if any(s.tensor_parallel > 1 for s in specs):
                raise ValueError(f"device_group {group!r}: tensor_parallel models cannot share")
            if any(s.autoscaling is not None for s in specs):
                raise ValueError(
                    f"device_group {group!r}: models {members} share devices, so their replica "
                    "counts cannot vary apart; drop their autoscaling"
                )
            if len({s.num_replicas for s in specs}) > 1:
                raise ValueError(
                    f"device_group {group!r}: models {members} need the same num_replicas "
                    "(each device holds one replica of every model in the group)"
                )
            gpus = sum(s.num_gpus for s in specs)
            if gpus > 1 + 1e-9:
                raise ValueError(
                    f"device_group {group!r}: models {members} ask for {gpus:g} GPUs in all; "
                    "models sharing one GPU must split it (num_gpus summing to at most 1)"
                )
        unused = set(self.shared_devices) - set(groups)
        if unused:
            raise ValueError(f"shared_devices {sorted(unused)} are named by no device_group")

    @property
    def model_names(self) -> list[str]:
        return list(self.models)


def plan_shared_devices(cfg: AppConfig) -> AppConfig:
    """``cfg`` with every co-located model's ``memory_budget_gb`` set from one joint plan per
    shared device (``engine.memory_plan.plan_shared_device``: weights + KV of all models on
    the device within ``shared_devices[group]``, every model holding the same context).
    Footprints are read from local checkpoints; a group that cannot fit, or names a model
    that is not a local directory, is one ``ConfigError``."""
    groups = cfg.device_groups()
    if not groups:
        return cfg
    from tokenrouter_ray.engine.memory_plan import (
        dtype_bytes,
        footprint_from_checkpoint,
        plan_shared_device,
    )

    specs = dict(cfg.models)
    for group, members in groups.items():
        memory = int(cfg.shared_devices[group] * 2**30)
        footprints = []
        for name in members:
            spec = cfg.models[name]
            if not Path(spec.path).is_dir():
                raise ConfigError(
                    f"device_group {group!r}: model {name!r} ({spec.path}) is not a local "
                    "directory; joint memory planning reads the checkpoint's size from disk"
                )
            try:
                element = dtype_bytes(spec.dtype, spec.num_gpus > 0)
                footprints.append(footprint_from_checkpoint(spec.path, spec.gguf_file, element))
            except (ValueError, OSError) as exc:
                raise ConfigError(f"device_group {group!r}: model {name!r}: {exc}") from None
        try:
            budgets = plan_shared_device(
                memory, footprints, [cfg.models[m].block_size for m in members]
            )
        except ValueError as exc:
            raise ConfigError(
                f"models {members} do not fit on shared device {group!r} "
                f"({cfg.shared_devices[group]:g} GiB): {exc}"
            ) from None
        for name, budget in zip(members, budgets, strict=True):
            specs[name] = specs[name].model_copy(update={"memory_budget_gb": budget / 2**30})
    return cfg.model_copy(update={"models": specs})
