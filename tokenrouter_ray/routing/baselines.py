"""Baselines for experiments: never / always hand off, a fixed probability, an entropy bar.

- ``never``: model 0 writes everything.
- ``always``: every position goes to model 1 (model 0's token is dropped each time).
- ``bernoulli(p)``: a position escalates with probability p, drawn from (request seed,
  position) so it does not depend on batching, replicas or timing.
- ``entropy(threshold)``: R2R's non-neural baseline, escalate when model 0's normalized
  entropy exceeds the threshold.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from pydantic import Field

from tokenrouter_ray.routing.policy import (
    EscalateOnce,
    PolicyConfig,
    RouteBatch,
    normalized_entropy,
    register_policy,
)


@register_policy
class Never(EscalateOnce):
    name = "never"

    def escalate(self, batch: RouteBatch) -> torch.Tensor:
        return torch.zeros(batch.size, dtype=torch.bool, device=batch.device)

    def escalate_host(self, batch: RouteBatch) -> list[bool]:
        return [False] * batch.size


@register_policy
class Always(EscalateOnce):
    name = "always"

    def escalate(self, batch: RouteBatch) -> torch.Tensor:
        return torch.ones(batch.size, dtype=torch.bool, device=batch.device)

    def escalate_host(self, batch: RouteBatch) -> list[bool]:
        return [True] * batch.size


SCALAR_ROWS = 24  # up to this many rows, per-row Python draws beat one numpy pass


class BernoulliConfig(PolicyConfig):
    p: float = Field(0.35, ge=0, le=1, description="Probability that a position escalates.")


def seeded_uniform(seed: int, position: int) -> float:
    """A uniform draw in [0, 1) from (seed, position): splitmix64, no generator state."""
    z = seed * 0x9E3779B97F4A7C15 + position * 0xD1B54A32D192ED03 + 0x632BE59BD9B4E019
    z &= (1 << 64) - 1
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return ((z ^ (z >> 31)) >> 11) / float(1 << 53)


def seeded_uniforms(seeds: Sequence[int], positions: Sequence[int]) -> np.ndarray:
    """``seeded_uniform`` for a whole batch at once (uint64 arithmetic wraps as the masks
    do, so every draw is bit-identical to the scalar one): (B,) float64."""
    z = np.array(seeds, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    z += np.array(positions, dtype=np.uint64) * np.uint64(0xD1B54A32D192ED03)
    z += np.uint64(0x632BE59BD9B4E019)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return ((z ^ (z >> np.uint64(31))) >> np.uint64(11)).astype(np.float64) / float(1 << 53)


@register_policy
class Bernoulli(EscalateOnce):
    name = "bernoulli"
    Config = BernoulliConfig

    def escalate(self, batch: RouteBatch) -> torch.Tensor:
        draws = seeded_uniforms(batch.seeds, batch.host_positions)
        return torch.from_numpy(draws).to(batch.device) < batch.thresholds(self.config.p)

    def escalate_host(self, batch: RouteBatch) -> list[bool]:
        """The same draws, compared on the host: seeds and positions are host facts, so a
        device would only add two copies. A request's own ``p`` (its routing threshold)
        replaces the configured one for its rows."""
        seeds, positions = batch.seeds, batch.host_positions
        p = batch.host_thresholds(self.config.p)
        if isinstance(p, list):  # some row overrides: one p per row
            draws = [seeded_uniform(s, x) for s, x in zip(seeds, positions, strict=True)]
            return [d < q for d, q in zip(draws, p, strict=True)]
        if len(seeds) <= SCALAR_ROWS:  # numpy's fixed cost is larger than a few rows'
            return [seeded_uniform(s, x) < p for s, x in zip(seeds, positions, strict=True)]
        return (seeded_uniforms(seeds, positions) < p).tolist()


class EntropyConfig(PolicyConfig):
    threshold: float = Field(
        0.3, ge=0, le=1, description="Escalate when H/log V of model 0 exceeds this."
    )


@register_policy
class Entropy(EscalateOnce):
    name = "entropy"
    Config = EntropyConfig
    needs_logits = True

    def escalate(self, batch: RouteBatch) -> torch.Tensor:
        batch.scores = entropy = normalized_entropy(batch.step.logits)
        return entropy > batch.thresholds(self.config.threshold, entropy.dtype)
