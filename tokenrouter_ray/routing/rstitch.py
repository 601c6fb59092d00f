"""R-Stitch: entropy-gated stitching. The *active* model's normalized entropy decides.

at the small model, position p:
    if H_small(p) / log V > tau:  drop the small token; the large model takes over at p
at the large model, position p:
    commit its token (always kept)
    if H_large(p) / log V <= tau:  hand back to the small model for p + 1
    else:                          keep decoding
"""

from __future__ import annotations

import torch
from pydantic import Field

from tokenrouter_ray.routing.policy import (
    Policy,
    PolicyConfig,
    RouteBatch,
    normalized_entropy,
    register_policy,
)


class RStitchConfig(PolicyConfig):
    tau: float = Field(0.3, ge=0, le=1, description="Normalized-entropy threshold.")


@register_policy
class RStitch(Policy):
    name = "rstitch"
    Config = RStitchConfig
    needs_logits = True

    def route(self, batch: RouteBatch) -> torch.Tensor:
        batch.scores = entropy = normalized_entropy(batch.step.logits)  # (B,)
        uncertain = entropy > batch.thresholds(self.config.tau, entropy.dtype)  # per row
        # Small: escalate when uncertain. Large: stay while uncertain, else return.
        return uncertain.long()
