"""The demo pair's R2R router: trained once for one build of the small model, cached beside it.

The router file and a JSON of its training metrics sit in the cache. The JSON records the
fingerprint of the small model's build file, so a rebuilt small model makes the router stale.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from tokenrouter_ray.demo.cache import DEMO_NAME, cache_dir
from tokenrouter_ray.demo.large import prepare_demo
from tokenrouter_ray.demo.small import BUILD_FILE, prepare_small_model
from tokenrouter_ray.errors import UserFacingError

ROUTER_TARGET_RATE = 0.3  # share of positions the demo's R2R router sends to the large model


def demo_router_path() -> Path:
    return cache_dir() / f"{DEMO_NAME}-r2r-router.pt"


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
    metrics["small_build_sha256"] = _build_fingerprint(small)
    target.with_suffix(".json").write_text(json.dumps(metrics, indent=2, default=str))
    staging.rename(target)
    return target


def _build_fingerprint(small: Path) -> str:
    return hashlib.sha256((small / BUILD_FILE).read_bytes()).hexdigest()


def router_is_current(small: Path) -> bool:
    """The router belongs to one build of the small model: stale when that build changed."""
    target = demo_router_path()
    info = target.with_suffix(".json")
    if not (target.is_file() and info.is_file() and (small / "config.json").is_file()):
        return False
    from tokenrouter_ray.routing.routers import is_router_file

    if not is_router_file(target, "r2r"):  # e.g. a pickled router from an older release
        return False
    metrics = json.loads(info.read_text())
    if "test_score_quantiles" not in metrics:  # trained before rates could be asked for
        return False
    return metrics.get("small_build_sha256") == _build_fingerprint(small)


def demo_router_threshold(rate: float | None = None) -> float:
    """The threshold that routed ``rate`` of the held-out chat positions to the large model
    in training (default ROUTER_TARGET_RATE, the one training chose). A rate names the same
    operating point on every build of the demo pair, whose scores differ (bf16 or fp32
    distillation, docs/getting-started/demo-pair.md), where a fixed threshold would not."""
    metrics = json.loads(prepare_demo_router(quiet=True).with_suffix(".json").read_text())
    if rate is None:
        return float(metrics["threshold_for_rate"])
    return threshold_at_rate(metrics["test_score_quantiles"], rate)


def threshold_at_rate(quantiles: list[float], rate: float) -> float:
    """The R2R threshold (score >= threshold routes) that would send ``rate`` of the
    held-out positions to the large model, from their score quantiles at evenly spaced
    levels 0 ... 1 (``test_score_quantiles``), linearly interpolated."""
    if not 0 <= rate <= 1:
        raise UserFacingError(f"route rate {rate}: must be in [0, 1]")
    if len(quantiles) < 2:
        raise UserFacingError("the router's metrics hold no score quantiles: retrain it")
    at = (1 - rate) * (len(quantiles) - 1)  # the (1 - rate) quantile
    i = min(int(at), len(quantiles) - 2)
    return quantiles[i] + (at - i) * (quantiles[i + 1] - quantiles[i])
