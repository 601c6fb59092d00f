"""``${demo:...}`` in Serve configs: the path (or threshold) of a demo artifact already built.

The resolver never builds: inside ``serve run`` a build would run in the Serve controller
with no visible progress, for minutes. The entry points that compose configs (the CLI, the
Serve app builder, the benchmarks, the test session) call ``register_resolver()``; the
config layer itself knows nothing about the demo.
"""

from __future__ import annotations

from tokenrouter_ray.demo.cache import cache_dir, demo_model_dir, is_prepared
from tokenrouter_ray.errors import UserFacingError

RESOLVER = "demo"


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
    from tokenrouter_ray.demo.router import (
        demo_router_path,
        demo_router_threshold,
        router_is_current,
    )
    from tokenrouter_ray.demo.small import is_current, small_model_dir

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
        return str(demo_router_threshold(None if rate is None else float(rate)))
    return str({"large": large, "small": small, "router": demo_router_path()}[which])
