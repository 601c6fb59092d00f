"""``${demo:...}`` in Serve configs: the path (or threshold) of a demo artifact already built.

The resolver never builds: inside ``serve run`` a build would run in the Serve controller
with no visible progress, for minutes. The entry points that compose configs (the CLI, the
Serve app builder, the benchmarks, the test session) call ``register_resolver()``; the
config layer itself knows nothing about the demo.

It also holds the readers of a build (where each artifact lives, whether it is current for
its recipe, the router's stored thresholds): serving needs them, the build modules
(``small``, ``router``) use them, and a server never imports the build itself.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from tokenrouter_ray.demo.cache import DEMO_NAME, cache_dir, demo_model_dir, is_prepared
from tokenrouter_ray.errors import UserFacingError

RESOLVER = "demo"
BUILD_FILE = "tokenrouter_build.json"
ROUTER_TARGET_RATE = 0.3  # share of positions the demo's R2R router sends to the large model


@dataclass(frozen=True)
class Recipe:
    """Everything that decides the small model; a cached build is reused only if it matches."""

    exit_layer: int = 8  # k: large-model layers copied exactly and frozen
    extra_layers: int = 2  # m: the next layers, initialized from the large model and trained
    train_prompts: int = 960
    eval_prompts: int = 64
    max_tokens: int = 64  # answer length, training and held-out alike
    heldout_every: int = 5  # every 5th topic is held out from training
    epochs: int = 4
    lr: float = 3e-3
    batch_seqs: int = 4
    top_k: int = 64  # teacher log-probs kept per position
    negatives: int = 2048  # random vocabulary rows added to each batch's softmax
    hard_weight: float = 1.0  # extra cross-entropy on the teacher's greedy token
    seed: int = 0

    @property
    def num_layers(self) -> int:
        return self.exit_layer + self.extra_layers


def small_model_dir(large_dir: Path | str, recipe: Recipe = Recipe()) -> Path:
    return cache_dir() / f"{Path(large_dir).name}-exit{recipe.exit_layer}"


def read_build_info(path: Path | str) -> dict | None:
    try:
        return json.loads((Path(path) / BUILD_FILE).read_text())
    except (OSError, ValueError):
        return None


def is_current(target: Path, recipe: Recipe = Recipe()) -> bool:
    """Whether ``target`` holds a finished build of ``recipe``."""
    info = read_build_info(target)
    return (
        is_prepared(target)
        and info is not None
        and info.get("recipe") == dataclasses.asdict(recipe)
    )


def demo_router_path() -> Path:
    return cache_dir() / f"{DEMO_NAME}-r2r-router.pt"


def build_fingerprint(small: Path) -> str:
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
    return metrics.get("small_build_sha256") == build_fingerprint(small)


def stored_router_threshold(rate: float | None = None) -> float:
    """The built router's threshold for ``rate`` (``demo_router_threshold``), read from its
    training metrics without building anything."""
    metrics = json.loads(demo_router_path().with_suffix(".json").read_text())
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


def register_resolver() -> None:
    """Make ``${demo:large|small|router|router_threshold}`` (and
    ``${demo:router_threshold,RATE}``) resolvable (idempotent)."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver(RESOLVER):
        OmegaConf.register_new_resolver(RESOLVER, built_artifact)


def built_artifact(which: str, rate: float | None = None) -> str:
    """The path (or, for ``router_threshold``, the value) of a demo artifact that
    ``prepare-demo`` has built; a clear error naming that command when it has not.
    ``router_threshold`` with a ``rate``: the threshold that routed that share of the
    held-out chat positions to the large model (``demo_router_threshold``).

    Serve configs resolve ``${demo:...}`` through this; it never builds.
    """
    large = demo_model_dir()
    small = small_model_dir(large)
    built = {
        "large": is_prepared(large),
        "small": is_prepared(large) and is_current(small),
        "router": is_prepared(large) and is_current(small) and router_is_current(small),
    }
    built["router_threshold"] = built["router"]
    if which not in built:
        raise ValueError(f"unknown demo artifact {which!r}: large, small, router, router_threshold")
    if not built[which]:
        raise UserFacingError(
            f"the demo models are not built yet (looked in {cache_dir()}): run "
            "`tokenrouter-ray prepare-demo` first. It builds them once, with a progress bar "
            "(a few minutes on 2 CPU cores; see docs/getting-started/demo-pair.md), and caches "
            "them; set "
            "TOKENROUTER_CACHE to use another cache directory."
        )
    if rate is not None and which != "router_threshold":
        raise ValueError(f"demo artifact {which!r} takes no rate")
    if which == "router_threshold":
        return str(stored_router_threshold(None if rate is None else float(rate)))
    return str({"large": large, "small": small, "router": demo_router_path()}[which])
