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
    from tokenrouter_ray.engine.scheduler import SchedulerOutput


class LayerTap:
    """Records the residual stream after decoder layer ``k`` while open (a context manager).

    A forward hook on that layer sees one packed row of all scheduled tokens; the runner's
    ``SchedulerOutput`` (handed to the tap at each launch: ``ModelRunner.taps``) says which
    request and
    positions each slice belongs to. On the bucketed static path the row is padded: each
    sequence owns ``q_len`` rows with its real tokens last (``static_forward.py``), and
    while a tap is open the runner runs those buckets eagerly instead of replaying their
    CUDA graphs (a replay runs no Python hook). Chunks are kept in order, so a recomputed
    (preempted) request overwrites its earlier states. States are kept in bf16.
    """

    def __init__(self, runner: ModelRunner, k: int) -> None:
        self.runner = runner
        self.layer = runner.model.get_decoder().layers[k - 1]
        self.chunks: dict[str, list[tuple[int, torch.Tensor]]] = {}
        self._scheduled: list[tuple[str, int, int, int]] = []  # (rid, start, n, first row)

    def __enter__(self) -> LayerTap:
        self.runner.taps.append(self._launching)  # and static buckets run eagerly: hooks run
        self._hook = self.layer.register_forward_hook(self._record)
        return self

    def __exit__(self, *exc: object) -> None:
        self._hook.remove()
        self.runner.taps.remove(self._launching)

    def _launching(self, out: SchedulerOutput) -> None:
        self._scheduled = self.layout(out)

    def layout(self, out: SchedulerOutput) -> list[tuple[str, int, int, int]]:
        """Per chunk (request id, start, tokens, its first row in the layer's output):
        packed back to back on the dynamic path; on a static (batch, q_len) bucket
        sequence i owns rows i*q_len .. i*q_len + q_len - 1, its tokens last."""
        shape = self.runner._static_bucket(out)
        rows: list[tuple[str, int, int, int]] = []
        row = 0
        for i, c in enumerate(out.chunks):
            first = row if shape is None else i * shape[1] + shape[1] - c.num_tokens
            rows.append((c.request.request_id, c.start, c.num_tokens, first))
            row += c.num_tokens
        return rows

    def _record(self, module: torch.nn.Module, args: tuple, output: object) -> None:
        hidden = output[0] if isinstance(output, tuple) else output  # (1, rows, hidden)
        for rid, start, n, first in self._scheduled:
            self.chunks.setdefault(rid, []).append(
                (start, hidden[0, first : first + n].to(torch.bfloat16))
            )

    def states(self, request_id: str, length: int) -> torch.Tensor:
        """(length, hidden) bf16 states of the request's first ``length`` tokens."""
        chunks = self.chunks[request_id]
        out = torch.zeros(length, chunks[0][1].shape[-1], dtype=torch.bfloat16)
        for start, part in chunks:
            out[start : start + len(part)] = part[: max(length - start, 0)]
        return out
