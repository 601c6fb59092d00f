"""Routing policies (one file each), their registry, and the neural routers they use.

This package's ``__init__`` is torch-free: the ingress reads ``threshold_levels`` from it
without loading a policy module (they import torch)."""

from __future__ import annotations

import importlib
from typing import Literal

BUILTIN = ("baselines", "r2r", "citer", "co_llm", "rstitch", "glimprouter", "escalation")

# How many decision thresholds a request may set (its ``routing.threshold``), per built-in
# policy that does not take exactly one: "none" decides without a threshold, "per_level"
# takes one per level but the top (escalation's tau_l). Every other policy takes one.
THRESHOLDS: dict[str, Literal["none", "per_level"]] = {
    "never": "none",
    "always": "none",
    "escalation": "per_level",
}


def threshold_levels(policy: str, num_models: int) -> int:
    """How many thresholds policy ``policy`` takes over ``num_models`` models: 0, one per
    level but the top (``num_models - 1``), or 1 (``THRESHOLDS``)."""
    kind = THRESHOLDS.get(policy)
    if kind == "none":
        return 0
    return num_models - 1 if kind == "per_level" else 1


def load_builtin_policies() -> None:
    for module in BUILTIN:
        importlib.import_module(f"tokenrouter_ray.routing.{module}")
