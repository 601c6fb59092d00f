"""Co-LLM: the base model carries a deferral head; when it defers, the assistant model
generates that token.

    at the base model (0), position p:
        p_defer = sigmoid(w . hidden_p + b)
        if p_defer > eta:  drop the base token; the assistant (1) generates position p
    at the assistant: commit, return to the base model
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tokenrouter_ray.routing._neural import NeuralConfig, RouterHolder
from tokenrouter_ray.routing.policy import EscalateOnce, RouteBatch, register_policy


class CoLLMConfig(NeuralConfig):
    """``threshold`` is the paper's eta."""


@register_policy
class CoLLM(EscalateOnce):
    name = "co_llm"
    Config = CoLLMConfig
    needs_hidden = True

    def __init__(self, config: CoLLMConfig, models: Sequence[str], tokenizer: Any = None) -> None:
        super().__init__(config, models, tokenizer)
        self.router = RouterHolder(config, "hidden_mlp", width=1, num_layers=0)

    def escalate(self, batch: RouteBatch) -> torch.Tensor:
        batch.scores = p_defer = self.router.score(batch.step.hidden)
        return p_defer > batch.thresholds(self.router.threshold, p_defer.dtype)
