"""Routing policies (one file each), their registry, and the neural routers they use."""

from __future__ import annotations

import importlib

BUILTIN = ("baselines", "r2r", "citer", "co_llm", "rstitch", "glimprouter", "escalation")


def load_builtin_policies() -> None:
    for module in BUILTIN:
        importlib.import_module(f"tokenrouter_ray.routing.{module}")
