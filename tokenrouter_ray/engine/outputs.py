"""What leaves the engine: per-step results for routing policies, per-request updates, and
the handle of a launched step.

Torch-free at import time (tensors appear in annotations only), so the runtime's step loop
and the routing interface import these types without loading torch.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import threading

    import torch

    from tokenrouter_ray.engine.scheduler import SchedulerOutput

# one row's logprobs: the sampled token's, then the top-k ids and their logprobs
TokenLogprobs = tuple[float, list[int], list[float]]


@dataclass
class StepTimings:
    """Seconds spent in each phase of one step, each counted once.

    ``forward`` is the model (lm_head included) and, on a device, the sampler: on CUDA the
    device time from the forward's start event to the step's done event, on CPU the host's
    compute time. The host phases (schedule, prepare, sample, commit) are host clock;
    ``launch`` is the host time spent queuing the forward and sampler on a device, which
    runs inside ``forward``'s device time and so is reported apart, never added.
    """

    schedule: float = 0.0
    prepare: float = 0.0  # building input ids, positions and attention metadata
    forward: float = 0.0  # the model (and on CUDA the sampler): device time there
    sample: float = 0.0  # host: the sampler on CPU; the read-back of tokens and logprobs
    commit: float = 0.0  # appending tokens, stop checks, status changes
    launch: float = 0.0  # host, CUDA only: queuing forward + sampler (inside ``forward``)

    @property
    def overhead(self) -> float:
        """The host's phases outside the forward (``launch`` overlaps it: not counted)."""
        return self.schedule + self.prepare + self.sample + self.commit

    @property
    def total(self) -> float:
        """The step's time, each phase once: what the tuner and the step metrics read."""
        return self.overhead + self.forward


class _SampledTensor:
    """``StepResult.sampled``: the runner's tensor of sampled tokens, or, from a runner that
    has its tokens on the host only (``None``: the simulated device), a CPU tensor built from
    ``token_ids`` the first time it is read. A policy that routes on the host never reads
    it, and building a tensor nobody reads costs the step thread tens of microseconds with
    cold caches. (A descriptor of a dataclass field: ``__init__`` goes through
    ``__set__``; no default, so the field stays positional and required.)"""

    def __get__(self, obj: StepResult | None, owner: type | None = None) -> torch.Tensor:
        if obj is None:
            raise AttributeError("sampled")  # no default: the field is required
        value = obj.__dict__["_sampled"]
        if value is None:
            value = obj.__dict__["_sampled"] = long_tensor(obj.token_ids)
        return value

    def __set__(self, obj: StepResult, value: torch.Tensor | None) -> None:
        obj.__dict__["_sampled"] = value


def long_tensor(values: list[int]) -> torch.Tensor:
    """``torch.tensor(values, dtype=torch.long)`` through a packed buffer, several times
    faster than ``torch.tensor`` walking the list element by element."""
    import torch

    if not values:
        return torch.empty(0, dtype=torch.long)
    return torch.frombuffer(array("q", values), dtype=torch.long)


@dataclass
class StepResult:
    """One forward's output, one row per request that sampled a token this step.

    Device tensors are batched so a policy can decide for all rows at once; ``logits`` and
    ``hidden`` are kept only when the engine was asked for them.
    """

    request_ids: list[str]
    # (num_rows,) long, on device; a runner without one passes None (built on first read)
    sampled: torch.Tensor = _SampledTensor()  # type: ignore[assignment]
    token_ids: list[int]  # the same tokens on the host
    positions: list[int]  # logical position of each sampled token
    logits: torch.Tensor | None = None  # (num_rows, vocab) raw next-token logits
    hidden: torch.Tensor | None = None  # (num_rows, hidden_size) last hidden state
    num_scheduled_tokens: int = 0
    batch_size: int = 0  # requests in the forward, sampling or not
    timings: StepTimings = field(default_factory=StepTimings)
    # per row: (logprob of the sampled token, top ids, their logprobs) for rows whose
    # request asked for logprobs, else None; the list itself is None when no row asked
    logprobs: list[TokenLogprobs | None] | None = None
    # (num_rows, vocab) the logits the rows were sampled from, a structured-output grammar's
    # mask applied (engine/grammar.py); None when no row was constrained (then: ``logits``)
    masked_logits: torch.Tensor | None = None
    # per row, filled by ``Engine.collect`` (what a routing policy reads besides tensors):
    prev_token_ids: list[int] = field(default_factory=list)  # the token before the sampled
    is_first: list[bool] = field(default_factory=list)  # the request's first output token
    seeds: list[int] = field(default_factory=list)  # the request's sampling seed


@dataclass(frozen=True)
class EngineStatus:
    """What an engine holds now (``Engine.status()``): queue depths, the launch rule's N and
    B, KV blocks (cached free blocks count as free) and the running totals since start."""

    requests: int  # held, finished ones excluded
    waiting: int
    running: int
    pending: int  # paused: handed to another model, KV kept
    active_requests: int  # N for the deferred-launch rule (global when known)
    threshold: int  # B at that N
    kv_blocks_used: int
    kv_blocks_free: int
    kv_blocks_total: int
    preemptions: int
    deferred_timeouts: int  # launches below the threshold forced by max_defer_s
    prefix_cache_queries: int  # tokens looked up in the prefix cache
    prefix_cache_hits: int  # of those, tokens found cached


@dataclass
class RequestOutput:
    """Tokens a request gained in one commit, and whether it just finished."""

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None


class PendingStep:
    """A launched forward: ``wait()`` returns its ``StepResult`` once the device is done
    (``Engine.collect`` calls it); ``waited_s`` is how long the host then waited for it.

    A runner whose step runs on after ``launch`` returns a ``wait`` that also has
    ``ready()`` (is the device done?) and ``wait_done(wake)`` (wait until it is, or until
    ``wake`` is set first: False then); any other ``wait`` means the step was computed at
    launch and is done. ``request_ids`` are the requests the step computes (their state must
    not change until it is collected)."""

    __slots__ = ("_ids", "batch_size", "num_tokens", "scheduled", "timings", "wait", "waited_s")

    def __init__(
        self,
        wait: Callable[[], StepResult],
        num_tokens: int,
        batch_size: int,
        scheduled: SchedulerOutput | None = None,
        timings: StepTimings | None = None,
    ) -> None:
        self.wait = wait
        self.num_tokens = num_tokens
        self.batch_size = batch_size
        self.scheduled = scheduled
        self.timings = timings  # the step's host timings so far (schedule, prepare)
        self.waited_s = 0.0
        self._ids: frozenset[str] | None = None

    def ready(self) -> bool:
        """Whether the device is done with the step (never blocks)."""
        ready = getattr(self.wait, "ready", None)
        return True if ready is None else ready()

    def wait_done(self, wake: threading.Event) -> bool:
        """Wait for the device or ``wake``, whichever comes first; True: the step is done."""
        wait_done = getattr(self.wait, "wait_done", None)
        return True if wait_done is None else wait_done(wake)

    @property
    def request_ids(self) -> frozenset[str]:
        if self._ids is None:
            chunks = self.scheduled.chunks if self.scheduled is not None else ()
            self._ids = frozenset(c.request.request_id for c in chunks)
        return self._ids
