"""What leaves the engine: per-step results for routing policies and per-request updates."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# one row's logprobs: the sampled token's, then the top-k ids and their logprobs
TokenLogprobs = tuple[float, list[int], list[float]]


@dataclass
class StepTimings:
    """Seconds spent in each phase of one step (host clock)."""

    schedule: float = 0.0
    prepare: float = 0.0  # building input ids, positions and attention metadata
    forward: float = 0.0  # the model, lm_head included
    sample: float = 0.0
    commit: float = 0.0  # appending tokens, stop checks, status changes

    @property
    def overhead(self) -> float:
        """Everything outside the model forward."""
        return self.schedule + self.prepare + self.sample + self.commit

    @property
    def total(self) -> float:
        return self.overhead + self.forward


@dataclass
class StepResult:
    """One forward's output, one row per request that sampled a token this step.

    Device tensors are batched so a policy can decide for all rows at once; ``logits`` and
    ``hidden`` are kept only when the engine was asked for them.
    """

    request_ids: list[str]
    sampled: torch.Tensor  # (num_rows,) long, on device
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


@dataclass
class RequestOutput:
    """Tokens a request gained in one commit, and whether it just finished."""

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
