"""Shared by the policies with a trained router: config fields and lazy loading.

The checkpoint named in the config is checked (exists, our format, right kind) when the
policy is built, which the app builder does at ``serve run`` time; its weights are read on
the first step that needs them.
"""

from __future__ import annotations

import torch
from pydantic import Field
from torch import nn

from tokenrouter_ray.routing.policy import PolicyConfig
from tokenrouter_ray.routing.routers import (
    RouterCheckpointError,
    inspect_router,
    load_router,
    random_router,
)


class NeuralConfig(PolicyConfig):
    checkpoint: str | None = Field(
        None,
        description="Router checkpoint (safetensors) from `tokenrouter-ray train-router` or "
        "`tokenrouter-ray import-router`. None: an untrained router with seeded random "
        "weights (tests and wiring experiments only).",
    )
    threshold: float | None = Field(
        0.5,
        ge=0,
        le=1,
        description="Decision threshold on the score. None: the threshold the checkpoint "
        "recommends (an imported R2R router's own, or train-router's threshold_for_rate).",
    )
    seed: int = Field(0, description="Seed of the untrained router when no checkpoint is set.")
    hidden_size: int | None = Field(
        None, description="Hidden size for an untrained router (a checkpoint records its own)."
    )


class RouterHolder:
    """Loads the router once and scores features with it, in float32 (float64 when the
    model runs in float64): a bf16 sigmoid cannot resolve thresholds near 0 or 1.
    Integer features (token ids) pass through unchanged."""

    def __init__(self, config: NeuralConfig, kind: str, **arch: object) -> None:
        self.config = config
        self.kind = kind
        self.arch = arch
        self.module: nn.Module | None = None
        self.threshold = config.threshold
        if config.checkpoint:  # a bad path fails now, at build time, not mid-request
            metrics = inspect_router(config.checkpoint, kind)["metrics"]
            recorded = metrics.get("threshold", metrics.get("threshold_for_rate"))
            if self.threshold is None and recorded is None:
                raise RouterCheckpointError(
                    f"{config.checkpoint} records no threshold: set the policy's threshold"
                )
            self.threshold = recorded if self.threshold is None else self.threshold
        elif self.threshold is None:
            raise ValueError("threshold: None (the checkpoint's own) needs a checkpoint")
        self.threshold = float(self.threshold)

    def score(self, *features: torch.Tensor | None) -> torch.Tensor:
        """sigmoid(router(*features)), (B,), on the features' device."""
        like = features[0]
        dtype = torch.float64 if like.dtype == torch.float64 else torch.float32
        if self.module is None:
            if self.config.checkpoint:
                self.module, _ = load_router(self.config.checkpoint, self.kind)
            else:
                size = self.config.hidden_size or like.shape[-1]
                self.module = random_router(
                    self.kind, self.config.seed, hidden_size=size, **self.arch
                )
        param = next(self.module.parameters())
        if param.dtype != dtype or param.device != like.device:
            self.module = self.module.to(device=like.device, dtype=dtype)
        cast = [f.to(dtype) if f is not None and f.is_floating_point() else f for f in features]
        return torch.sigmoid(self.module(*cast))
