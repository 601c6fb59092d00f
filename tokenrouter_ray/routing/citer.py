"""CITER: a router on the small model's last hidden state scores how safe its token is;
a low score hands that one token to the large model.

    at the small model, position p:
        s = sigmoid(mlp(hidden_p))
        if s < threshold:  drop the small token; the large model replaces it (one token)
    at the large model: commit, return
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from pydantic import Field

from tokenrouter_ray.routing._neural import NeuralConfig, RouterHolder
from tokenrouter_ray.routing.policy import EscalateOnce, RouteBatch, register_policy


class CiterConfig(NeuralConfig):
    width: int = Field(256, ge=1, description="MLP width.")
    num_layers: int = Field(2, ge=0, description="Hidden layers of the MLP.")


@register_policy
class Citer(EscalateOnce):
    name = "citer"
    Config = CiterConfig
    needs_hidden = True

    def __init__(self, config: CiterConfig, models: Sequence[str], tokenizer: Any = None) -> None:
        super().__init__(config, models, tokenizer)
        self.router = RouterHolder(
            config, "hidden_mlp", width=config.width, num_layers=config.num_layers
        )

    def escalate(self, batch: RouteBatch) -> torch.Tensor:
        safe = self.router.score(batch.step.hidden)
        batch.scores = 1 - safe  # higher: closer to escalating, as for every policy
        return safe < batch.thresholds(self.router.threshold, safe.dtype)
