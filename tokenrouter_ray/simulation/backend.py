"""A simulated model backend: the real engine, scheduler, model replicas and protocol, no network.

``SimRunner`` stands in for ``ModelRunner``: a step launched on it takes the profiled step time
of the batch it was given (``ModelProfile.step_time_ms(batch size)`` times ``time_scale``) and
returns a ``StepResult`` with one token (id ``token_id``) per request that samples. Everything
else is the production code path: ``Engine`` + ``Scheduler`` (deferred launch with the
thresholds under test), ``Replica`` step threads (``execute`` in a worker thread, the
routing policy, ``commit``, handoffs over in-process channels) and the ingress, all wired by
``LocalRuntime``. Routing follows the profile's ``p(small->large)`` through the
``bernoulli`` policy, so the measured throughput includes every real overhead of the runtime
(event-loop wake-ups, thread hand-offs, message encoding) on top of the simulated compute.

Only two-model escalate-once routing is supported (R2R's shape, the ``bernoulli`` policy):
``p = ((1 - q, q), (1, 0))`` and commits ``c = ((1, 0), (1, 0))`` -- the small model commits
its token unless the position escalates, the large model then writes that one token and
hands back. ``check_supported`` rejects anything else.

Data-parallel replicas: ``ClosedLoop(..., replicas=(1, 2))`` runs model i as ``R_i``
model replicas (``ReplicatedRuntime``), each with its own scheduler applying the model's
thresholds to the requests it holds, so a model with R replicas runs up to R batches at once.

The loads that drive it (closed loop, open loop, stepped load) and their measurements live
in ``simulation/loads.py``.
"""

from __future__ import annotations

import itertools
import statistics
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tokenrouter_ray.engine.config import EngineConfig
from tokenrouter_ray.engine.engine import Engine
from tokenrouter_ray.engine.outputs import StepResult, StepTimings
from tokenrouter_ray.engine.scheduler import SchedulerConfig, SchedulerOutput
from tokenrouter_ray.ingress.core import IngressCore
from tokenrouter_ray.local import LocalRuntime
from tokenrouter_ray.metrics import definitions as m
from tokenrouter_ray.replica.step import Replica
from tokenrouter_ray.transport.base import InMemoryDirectory, endpoint_name
from tokenrouter_ray.transport.inproc import InProcHub
from tokenrouter_ray.tuning.profile import ModelProfile, RoutingProfile

SIM_VOCAB_SIZE = 32
SIM_HIDDEN_SIZE = 8
PROB_TOLERANCE = 1e-9


# --------------------------------------------------------------------------- the runner
@dataclass
class SimStats:
    """What a ``SimRunner`` did: steps, batch sizes, simulated busy time, idle gaps."""

    steps: int = 0
    batch_sum: int = 0
    busy_s: float = 0.0  # wall time spent inside execute (the simulated compute)
    gaps_s: list[float] = field(default_factory=list)  # previous step end -> this step start
    oversleep_s: float = 0.0  # sum of (actual - requested) step time

    @property
    def mean_batch(self) -> float:
        return self.batch_sum / self.steps if self.steps else 0.0


class SimRunner:
    """A ``ModelRunner`` that computes nothing: it sleeps for the profiled step time.

    ``step_seconds(batch)`` gives the step duration for a batch of that many requests (all
    scheduled requests count, sampling or not). ``launch`` starts a step on a simulated
    device and returns at once; the model replica's step loop does its host work meanwhile and
    then waits (sleeps) for the rest of the step, so the step period is
    max(step time, host work on the critical path), as on a GPU.
    The OS timer oversleeps (timer slack, wake-up latency: ~0.1-0.3 ms on a busy machine),
    so every sleep is shortened by ``sleep_bias_s``, which adapts after each step (an
    exponential average of the error) so that on average a step lasts its profiled time;
    ``stats`` records what actually happened. ``adaptive=False`` keeps the bias fixed.
    """

    def __init__(
        self,
        step_seconds: Callable[[int], float],
        vocab_size: int = SIM_VOCAB_SIZE,
        max_position_embeddings: int = 1 << 20,
        token_id: int = 1,
        sleep_bias_s: float = 0.0,
        keep_logits: bool = False,
        keep_hidden: bool = False,
        record_gaps: bool = True,
        adaptive: bool = True,
        token_of: Callable[[int], int] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """``clock`` / ``sleep``: the host's (``time.perf_counter`` / ``time.sleep``) unless
        a test injects a fake pair to check the timing logic without waiting."""
        if not 0 <= token_id < vocab_size:
            raise ValueError(f"token_id {token_id} outside the vocabulary 0..{vocab_size - 1}")
        self.step_seconds = step_seconds
        self.vocab_size = vocab_size  # what the engine reads of a runner's model
        self.max_positions = max_position_embeddings
        self.eos_token_ids: frozenset[int] = frozenset()
        self.token_id = token_id
        self.token_of = token_of  # position -> token id (default: token_id everywhere)
        self.sleep_bias_s = sleep_bias_s
        self.keep_logits = keep_logits
        self.keep_hidden = keep_hidden
        self.record_gaps = record_gaps
        self.adaptive = adaptive
        self.stats = SimStats()
        self._last_end: float | None = None
        self._clock = clock
        self._sleep = sleep

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Zero embeddings (policies that read embeddings see a constant)."""
        return torch.zeros((*token_ids.shape, SIM_HIDDEN_SIZE))

    def reset_stats(self) -> None:
        self.stats = SimStats()
        self._last_end = None

    def execute(self, out: SchedulerOutput, timings: StepTimings) -> StepResult:
        """One step, start to finish (what a caller that does not overlap sees)."""
        return self.launch(out, timings)()

    def check_alive(self) -> None:
        """A simulated device never goes away."""

    def close(self) -> None:
        """Nothing to release."""

    def launch(self, out: SchedulerOutput, timings: StepTimings) -> Callable[[], StepResult]:
        """Start one step on the simulated device and return at once; the returned call
        waits until the device is done (the profiled step time after the launch) and gives
        the result. Host work done between the two overlaps the step, as it does on a GPU
        whose kernels are queued and whose sampled tokens are read back at the end."""
        t0 = self._clock()
        sampling = [c.request for c in out.chunks if c.samples]
        batch = len(out.chunks)
        duration = self.step_seconds(batch)
        n = len(sampling)
        positions = [r.num_tokens for r in sampling]
        tokens = [self.token_of(p) for p in positions] if self.token_of else [self.token_id] * n
        result = StepResult(
            request_ids=[r.request_id for r in sampling],
            sampled=None,  # built from token_ids if a policy reads it (StepResult)
            token_ids=tokens,
            positions=positions,
            logits=torch.zeros((n, self.vocab_size)) if self.keep_logits else None,
            hidden=torch.zeros((n, SIM_HIDDEN_SIZE)) if self.keep_hidden else None,
            num_scheduled_tokens=out.num_tokens,
            batch_size=batch,
            timings=timings,
        )
        stats = self.stats
        if self.record_gaps and self._last_end is not None:
            stats.gaps_s.append(t0 - self._last_end)
        stats.steps += 1
        stats.batch_sum += batch

        return _SimStep(self, result, t0, duration, timings)


class _SimStep:
    """A step on the simulated device: calling it waits until the device is done and gives
    the result; ``wait_done(wake)`` waits for the device or ``wake``, whichever is first
    (the step loop applies arriving messages meanwhile). Either wait shortens its sleep by
    the runner's ``sleep_bias_s`` and teaches it the timer's oversleep."""

    __slots__ = ("duration", "ready_at", "result", "runner", "t0", "timings", "woke_at")

    def __init__(
        self,
        runner: SimRunner,
        result: StepResult,
        t0: float,
        duration: float,
        timings: StepTimings,
    ) -> None:
        self.runner, self.result, self.timings = runner, result, timings
        self.t0, self.duration, self.ready_at = t0, duration, t0 + duration
        self.woke_at: float | None = None  # when a wait that slept to the end woke

    def ready(self) -> bool:
        return self.woke_at is not None or (
            self.ready_at - self.runner._clock() - self.runner.sleep_bias_s <= 0
        )

    def wait_done(self, wake: threading.Event) -> bool:
        if self.ready():
            return True
        remaining = self.ready_at - self.runner._clock() - self.runner.sleep_bias_s
        if wake.wait(max(0.0, remaining)):
            return False  # woken first: the step still runs
        self.woke_at = self.runner._clock()
        return True

    def __call__(self) -> StepResult:
        runner = self.runner
        if self.woke_at is None:
            remaining = self.ready_at - runner._clock() - runner.sleep_bias_s
            if remaining > 0:
                runner._sleep(remaining)
                self.woke_at = runner._clock()
        slept = self.woke_at is not None
        t1 = self.woke_at if slept else runner._clock()
        ready_at, duration = self.ready_at, self.duration
        if slept and runner.adaptive:  # learn the timer's oversleep
            error = t1 - ready_at
            runner.sleep_bias_s = min(max(0.0, runner.sleep_bias_s + 0.2 * error), duration / 2)
        done = max(t1, ready_at) if slept else ready_at  # when the device finished
        runner._last_end = done
        stats = runner.stats
        stats.busy_s += done - self.t0
        stats.oversleep_s += done - ready_at
        self.timings.forward = done - self.t0
        return self.result


def profile_step_seconds(model: ModelProfile, time_scale: float = 1.0) -> Callable[[int], float]:
    """``batch -> seconds`` from a model's profiled table (``ModelProfile.step_time_ms``)."""
    if not time_scale > 0:
        raise ValueError(f"time_scale must be positive, got {time_scale}")
    cache: dict[int, float] = {}

    def step_seconds(batch: int) -> float:
        if batch not in cache:
            cache[batch] = model.step_time_ms(max(1, batch)) * time_scale / 1000.0
        return cache[batch]

    return step_seconds


def calibrate_sleep_bias(target_s: float = 0.002, samples: int = 30) -> float:
    """Median oversleep of ``time.sleep(target_s)`` on this machine (seconds, >= 0)."""
    over = []
    for _ in range(samples):
        t0 = time.perf_counter()
        time.sleep(target_s)
        over.append(time.perf_counter() - t0 - target_s)
    return max(0.0, statistics.median(over))


def sim_engine(
    step_seconds: Callable[[int], float],
    batch_thresholds: Sequence[int] = (1,),
    max_defer_s: float = 1.0,
    max_num_seqs: int = 256,
    num_blocks: int = 4096,
    block_size: int = 16,
    sleep_bias_s: float = 0.0,
    **runner_options: Any,
) -> Engine:
    """An ``Engine`` over a ``SimRunner`` with the given deferred-launch settings
    (``runner_options``: more ``SimRunner`` arguments, e.g. an injected ``clock`` and ``sleep``)."""
    runner = SimRunner(step_seconds, sleep_bias_s=sleep_bias_s, **runner_options)
    config = EngineConfig(
        model="sim",
        block_size=block_size,
        num_blocks=num_blocks,
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=1 << 20,
            batch_thresholds=list(batch_thresholds),
            max_defer_s=max_defer_s,
        ),
    )
    return Engine(runner, config, num_blocks)


# ---------------------------------------------------------------------- profile shape
def escalation_probability(profile: RoutingProfile) -> float:
    """``p(small->large)`` of a profile the simulation can run, else ``ValueError``.

    Supported: two models, the first (entry) escalating with probability q, the second
    always handing straight back; commits c(small->small) = 1, c(small->large) = 0,
    c(large->small) = 1 (what the ``bernoulli`` policy does).
    """
    if profile.num_models != 2:
        raise ValueError(
            f"the simulation backend supports two models (small -> large escalation), "
            f"the profile has {profile.num_models}"
        )
    (_, p01), (p10, p11) = profile.route_prob
    if abs(p10 - 1.0) > PROB_TOLERANCE or abs(p11) > PROB_TOLERANCE:
        raise ValueError(
            "the simulation backend routes with the bernoulli policy: the second model must "
            f"hand every request back (p(large->small) = 1), got p = {profile.route_prob}"
        )
    expected = ((1.0, 0.0), (1.0, 0.0))
    for i in range(2):
        for j in range(2):
            if profile.route_prob[i][j] > 0 and abs(profile.commit[i][j] - expected[i][j]) > 1e-9:
                raise ValueError(
                    "the simulation backend commits like R2R: c(small->small) = 1, "
                    f"c(small->large) = 0, c(large->small) = 1; got c = {profile.commit}"
                )
    return float(p01)


# ----------------------------------------------------------------------- measurement
class CountingBackend:
    """A metrics backend that only counts committed tokens, steps, batch rows and handoffs."""

    def __init__(self) -> None:
        self.committed: dict[str, float] = {}
        self.steps: dict[str, int] = {}
        self.batch_rows: dict[str, float] = {}  # sum of batch sizes per model
        self.handoffs: dict[tuple[str, str], int] = {}  # (src, dst) -> count

    def inc(self, metric: Any, value: float, labels: tuple[str, ...]) -> None:
        if metric is m.COMMITTED_TOKENS:
            self.committed[labels[0]] = self.committed.get(labels[0], 0.0) + value
        elif metric is m.HANDOFFS:
            key = (labels[0], labels[1])
            self.handoffs[key] = self.handoffs.get(key, 0) + int(value)

    def set(self, metric: Any, value: float, labels: tuple[str, ...]) -> None:
        pass

    def observe(self, metric: Any, value: float, labels: tuple[str, ...]) -> None:
        if metric is m.BATCH_SIZE:
            self.steps[labels[0]] = self.steps.get(labels[0], 0) + 1
            self.batch_rows[labels[0]] = self.batch_rows.get(labels[0], 0.0) + value

    @property
    def total_committed(self) -> float:
        return sum(self.committed.values())

    def snapshot(self) -> dict[str, Any]:
        return {
            "committed": self.total_committed,
            "steps": dict(self.steps),
            "batch_rows": dict(self.batch_rows),
            "handoffs": dict(self.handoffs),
        }


class ReplicatedRuntime(LocalRuntime):
    """``LocalRuntime`` with several data-parallel replicas per model, as Serve runs them.

    ``replicas`` maps a model to its engines (one per replica). Every replica is its own
    model replica with its own scheduler and thresholds; a request keeps its replica of each
    model (its KV lives there). ``assignment`` says who picks it:

    - ``"placement"`` (default): production's rule (ingress/placement.py, what the Serve
      ingress does): when the request is submitted, one replica of every model by prefix
      affinity bounded by load (requests placed there and not finished; ties: the first
      replica), named in its NEW;
    - ``"least-loaded"``: the model picks on the request's first visit, the replica whose
      engine holds the fewest requests (ties: from the request id);
    - ``"hash"``: the model picks on the first visit by request id alone (crc32).

    With the last two the ingress spreads new requests over the entry model's replicas
    round-robin. The ingress sends its active-count updates to every replica.
    """

    ASSIGNMENTS = ("placement", "least-loaded", "hash")

    def __init__(
        self,
        replicas: Sequence[tuple[str, Sequence[Engine]]],
        policy: Any,
        assignment: str = "placement",
        **kwargs: Any,
    ) -> None:
        super().__init__([(name, engines[0]) for name, engines in replicas], policy, **kwargs)
        if assignment not in self.ASSIGNMENTS:
            raise ValueError(f"assignment must be one of {self.ASSIGNMENTS}, got {assignment!r}")
        self.replica_engines = {name: list(engines) for name, engines in replicas}
        self.assignment = assignment
        self.place_at_ingress = assignment == "placement"
        for name, engines in self.replica_engines.items():
            self.replicas[name] = [endpoint_name(name, str(k)) for k in range(len(engines))]

    async def start(self) -> None:
        hub, directory = InProcHub(self.transit_s), InMemoryDirectory()
        names = {m: [str(k) for k in range(len(self.replica_engines[m]))] for m in self.models}

        held: dict[str, list[Engine]] = self.replica_engines

        def pick(model: str, rid: str) -> str:
            if self.assignment == "placement":  # a request placed at the ingress names it
                return self.placement.choose(model)
            options = names[model]
            start = zlib.crc32(rid.encode()) % len(options)
            if self.assignment == "least-loaded":  # fewest requests held, ties from the hash
                order = options[start:] + options[:start]
                load = {k: len(held[model][int(k)].requests) for k in options}
                return endpoint_name(model, min(order, key=load.__getitem__))
            return endpoint_name(model, options[start])

        for index, name in enumerate(self.models):
            for replica, engine in zip(names[name], self.replica_engines[name], strict=True):
                channel = self.channel_type(name, replica, directory, hub)
                await channel.start()
                server = Replica(
                    self.models, index, engine, self.policy, channel, pick, metrics=self.metrics
                )
                await server.start()
                self.model_replicas.append(server)
        channel = self.channel_type("ingress", "0", directory, hub)
        await channel.start()
        endpoints = [s.endpoint for s in self.model_replicas]
        turn = itertools.count()
        entries = self.replicas[self.models[0]]  # drained ones leave it (``on_drain``)

        def entry() -> str:  # round robin over the entry model's replicas
            return entries[next(turn) % len(entries)]

        self.ingress = IngressCore(channel, entry, lambda: endpoints, metrics=self.metrics)
        self.ingress.on_drain = self.on_drain
        await self.ingress.start()
