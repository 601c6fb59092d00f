"""What the engine needs of a runner: the ``Runner`` protocol, and ``FaultyRunner``, a runner
that injects faults into the one it wraps.

Three runners implement ``Runner``: ``ModelRunner`` (engine/model_runner.py: a transformers
model over the paged KV cache, on CPU or CUDA), ``TensorParallelRunner``
(engine/tensor_parallel.py: rank 0 of a tensor-parallel group) and ``SimRunner``
(simulation/backend.py: a simulated device that sleeps for a profiled step time). The engine
reaches each only through these members.

A step enters as a ``SchedulerOutput`` and a ``StepTimings`` to fill; ``launch`` starts it
and returns the call that waits for it and gives the ``StepResult`` (engine/outputs.py
``PendingStep``: a call that also has ``ready()`` and ``wait_done(wake)`` lets the caller
overlap host work with the device; a plain call means the step was computed in ``launch``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from tokenrouter_ray.engine.outputs import StepResult, StepTimings
from tokenrouter_ray.engine.scheduler import SchedulerOutput

StepWait = Callable[[], StepResult]
FAULT_KINDS = ("step", "stall", "clear")


@runtime_checkable
class Runner(Protocol):
    vocab_size: int
    eos_token_ids: frozenset[int]
    max_positions: int | None  # the model's position limit (None: unknown)
    keep_logits: bool  # keep each step's logits on its result (policies that read them)
    keep_hidden: bool  # keep the last hidden states (policies that read them)

    @property
    def embed_tokens(self) -> Callable[[Any], Any]:
        """Token ids -> input embeddings (for policies that read them)."""
        ...

    @property
    def stats(self) -> Any:
        """The runner's own counters (a simulated device's), or None."""
        ...

    def launch(self, out: SchedulerOutput, timings: StepTimings) -> StepWait:
        """Start one step; the returned call waits for it and gives its result."""
        ...

    def execute(self, out: SchedulerOutput, timings: StepTimings) -> StepResult:
        """One step, start to finish: ``launch(out, timings)()``."""
        ...

    def check_alive(self) -> None:
        """Raise when the runner cannot step (a tensor-parallel worker is gone)."""
        ...

    def close(self) -> None:
        """Release what the runner holds outside this process (worker ranks)."""
        ...


class FaultyRunner:
    """A ``Runner`` that makes the next ``count`` launches of the runner it wraps fail
    (``kind="step"``: they raise) or take ``seconds`` longer (``"stall"``: a model that stops
    answering), then behaves as the wrapped runner. ``Engine.inject_fault`` installs it (the
    chaos hook) and ``inner`` is the runner it wraps."""

    def __init__(self, inner: Runner, kind: str, count: int = 1, seconds: float = 0.0) -> None:
        if kind not in ("step", "stall"):
            raise ValueError(f"unknown fault {kind!r} ({', '.join(FAULT_KINDS)})")
        self.inner, self.kind, self.left, self.seconds = inner, kind, count, seconds

    def launch(self, out: SchedulerOutput, timings: StepTimings) -> StepWait:
        if self.left > 0:
            self.left -= 1
            if self.kind == "step":
                raise RuntimeError("injected step failure")
            time.sleep(self.seconds)
        return self.inner.launch(out, timings)

    def execute(self, out: SchedulerOutput, timings: StepTimings) -> StepResult:
        return self.launch(out, timings)()

    # the rest is the wrapped runner's
    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.inner.eos_token_ids

    @property
    def max_positions(self) -> int | None:
        return self.inner.max_positions

    @property
    def keep_logits(self) -> bool:
        return self.inner.keep_logits

    @keep_logits.setter
    def keep_logits(self, value: bool) -> None:
        self.inner.keep_logits = value

    @property
    def keep_hidden(self) -> bool:
        return self.inner.keep_hidden

    @keep_hidden.setter
    def keep_hidden(self, value: bool) -> None:
        self.inner.keep_hidden = value

    @property
    def embed_tokens(self) -> Callable[[Any], Any]:
        return self.inner.embed_tokens

    @property
    def stats(self) -> Any:
        return self.inner.stats

    def check_alive(self) -> None:
        self.inner.check_alive()

    def close(self) -> None:
        self.inner.close()
