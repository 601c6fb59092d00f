"""The demo pair's R2R router: trained once for one build of the small model, cached beside it.

The router file and a JSON of its training metrics sit in the cache. The JSON records the
fingerprint of the small model's build file, so a rebuilt small model makes the router stale.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenrouter_ray.demo.artifacts import (
    ROUTER_TARGET_RATE,
    build_fingerprint,
    demo_router_path,
    router_is_current,
    stored_router_threshold,
    threshold_at_rate,
)
from tokenrouter_ray.demo.large import prepare_demo
from tokenrouter_ray.demo.small import prepare_small_model

__all__ = ["demo_router_threshold", "prepare_demo_router", "threshold_at_rate"]


def prepare_demo_router(force: bool = False, quiet: bool = False) -> Path:
    """Train (once) the demo pair's R2R router; its metrics go to a JSON file beside it."""
    large = prepare_demo(quiet=quiet)
    small = prepare_small_model(large, quiet=quiet)
    target = demo_router_path()
    if not force and router_is_current(small):
        return target
    from tokenrouter_ray.routing.training import train_router

    staging = target.with_suffix(".tmp.pt")
    metrics = train_router(
        "r2r",
        str(small),
        str(large),
        str(staging),
        progress=not quiet,
        target_rate=ROUTER_TARGET_RATE,
    )
    metrics["small_build_sha256"] = build_fingerprint(small)
    target.with_suffix(".json").write_text(json.dumps(metrics, indent=2, default=str))
    staging.rename(target)
    return target


def demo_router_threshold(rate: float | None = None) -> float:
    """The threshold that routed ``rate`` of the held-out chat positions to the large model
    in training (default ROUTER_TARGET_RATE, the one training chose). A rate names the same
    operating point on every build of the demo pair, whose scores differ (bf16 or fp32
    distillation, docs/getting-started/demo-pair.md), where a fixed threshold would not.
    Builds the router first if it is not built."""
    prepare_demo_router(quiet=True)
    return stored_router_threshold(rate)
