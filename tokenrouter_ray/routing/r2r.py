"""R2R (Roads to Rome): a neural router on the small model's step decides, per token,
whether the large model should produce it.

    at the small model, after sampling token t at position p:
        s = sigmoid(router(hidden_p, embed(t), top100(logits_p)))
        if s >= threshold:  drop t; the large model generates position p (one token)
        else:               commit t
    at the large model: commit its token, return to the small model
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from pydantic import Field

from tokenrouter_ray.routing._neural import NeuralConfig, RouterHolder
from tokenrouter_ray.routing.policy import EscalateOnce, RouteBatch, register_policy


class R2RConfig(NeuralConfig):
    top_k: int = Field(100, ge=1, description="Raw logits fed to the router (paper: 100).")
    width: int = Field(256, ge=3, description="Router width (paper: 1024).")
    num_blocks: int = Field(2, ge=0, description="Residual MLP blocks (paper: 6).")


@register_policy
class R2R(EscalateOnce):
    name = "r2r"
    Config = R2RConfig
    needs_logits = True
    needs_hidden = True
    needs_embeddings = True
    # Its router was trained on the raw top-k logits of unconstrained text; a grammar's
    # -inf would feed its linear layer infinities (docs/user-guide/policies.md, "Structured
    # outputs").
    routes_on_masked_logits = False

    def __init__(self, config: R2RConfig, models: Sequence[str], tokenizer: Any = None) -> None:
        super().__init__(config, models, tokenizer)
        self.router = RouterHolder(
            config, "r2r", top_k=config.top_k, width=config.width, num_blocks=config.num_blocks
        )

    def escalate(self, batch: RouteBatch) -> torch.Tensor:
        step = batch.step
        # (B,) each: the sampled ids too, for a router that owns its embedding table
        score = self.router.score(step.hidden, batch.embed(step.sampled), step.logits, step.sampled)
        batch.scores = score
        return score >= batch.thresholds(self.router.threshold, score.dtype)
