"""Read a layer's output while the engine runs: the residual stream after decoder layer
``k`` for every token the engine computes, per request.

The demo's small-model build uses it to record the large model's layer-``k`` states while
the large model answers the training prompts (the trained layers' inputs), so training never
runs the large model again. ``Engine.tap_layer(k)`` hands one out; outside ``engine/``
nothing touches the runner or its model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tokenrouter_ray.engine.model_runner import ModelRunner
    from tokenrouter_ray.engine.outputs import StepResult, StepTimings
    from tokenrouter_ray.engine.scheduler import SchedulerOutput


class LayerTap:
    """Records the residual stream after decoder layer ``k`` while open (a context manager).

    A forward hook on that layer sees one packed row of all scheduled tokens; the runner's
    ``SchedulerOutput`` (captured by wrapping ``runner.execute``) says which request and
    positions each slice belongs to. Chunks are kept in order, so a recomputed (preempted)
    request overwrites its earlier states. States are kept in bf16.
    """

    def __init__(self, runner: ModelRunner, k: int) -> None:
        self.runner = runner
        self.layer = runner.model.get_decoder().layers[k - 1]
        self.chunks: dict[str, list[tuple[int, torch.Tensor]]] = {}
        self._scheduled: list[tuple[str, int, int]] = []

    def __enter__(self) -> LayerTap:
        execute = self.runner.execute

        def tapped(out: SchedulerOutput, timings: StepTimings) -> StepResult:
            self._scheduled = [(c.request.request_id, c.start, c.num_tokens) for c in out.chunks]
            return execute(out, timings)

        self.runner.execute = tapped
        self._hook = self.layer.register_forward_hook(self._record)
        return self

    def __exit__(self, *exc: object) -> None:
        self._hook.remove()
        del self.runner.execute  # back to the class's method

    def _record(self, module: torch.nn.Module, args: tuple, output: object) -> None:
        hidden = output[0] if isinstance(output, tuple) else output  # (1, num_tokens, hidden)
        row = 0
        for rid, start, n in self._scheduled:
            self.chunks.setdefault(rid, []).append(
                (start, hidden[0, row : row + n].to(torch.bfloat16))
            )
            row += n

    def states(self, request_id: str, length: int) -> torch.Tensor:
        """(length, hidden) bf16 states of the request's first ``length`` tokens."""
        chunks = self.chunks[request_id]
        out = torch.zeros(length, chunks[0][1].shape[-1], dtype=torch.bfloat16)
        for start, part in chunks:
            out[start : start + len(part)] = part[: max(length - start, 0)]
        return out
