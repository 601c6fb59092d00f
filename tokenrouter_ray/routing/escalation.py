"""Multi-model escalation over a chain of M >= 2 models (e.g. 0.6B -> 8B -> 32B).

    at level l < M - 1, position p:
        if H_l(p) / log V > tau_l:  drop the token; level l + 1 generates position p
        elif l > 0:                 commit, return to level 0
        else:                       commit, stay
    at the top level: commit, return to level 0

Per-model anchors let every level extend only what it has not seen since its last visit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from pydantic import Field

from tokenrouter_ray.routing.policy import (
    Policy,
    PolicyConfig,
    RouteBatch,
    normalized_entropy,
    register_policy,
)


class EscalationConfig(PolicyConfig):
    thresholds: list[float] = Field(
        default_factory=lambda: [0.3, 0.4],
        description="tau_l for each level but the top (M - 1 values).",
    )


@register_policy
class Escalation(Policy):
    name = "escalation"
    Config = EscalationConfig
    needs_logits = True
    max_models = None

    def __init__(
        self, config: EscalationConfig, models: Sequence[str], tokenizer: Any = None
    ) -> None:
        super().__init__(config, models, tokenizer)
        if len(config.thresholds) != len(models) - 1:
            raise ValueError(
                f"escalation over {len(models)} models needs {len(models) - 1} thresholds, "
                f"got {config.thresholds}"
            )

    def route(self, batch: RouteBatch) -> torch.Tensor:
        level = batch.model
        zeros = torch.zeros(batch.size, dtype=torch.long, device=batch.device)
        if level == len(self.models) - 1:
            return zeros
        batch.scores = entropy = normalized_entropy(batch.step.logits)
        unsure = entropy > batch.thresholds(self.config.thresholds[level], entropy.dtype)
        return torch.where(unsure, level + 1, 0) if level else unsure.long()
