"""Reference profiles: the paper's R2R validation setting and a three-model escalation chain.

Used by `tokenrouter-ray tune` and `simulate`, the docs and the tests, so that all of
them talk about the same numbers.
"""

from __future__ import annotations

from tokenrouter_ray.tuning.profile import ModelProfile, RoutingProfile

PAPER_CONCURRENCIES = (1, 2, 4, 8, 16)


def paper_r2r() -> RoutingProfile:
    """R2R small/large (TokenRouter paper): p(small->large) = 0.35, 6.0 / 27.9 ms, 0.1 ms grain.

    The small model's token at a routed position is dropped (c = 0) and the large model
    regenerates it (c = 1) before handing back.
    """
    return RoutingProfile(
        models=(ModelProfile.constant("small", 6.0), ModelProfile.constant("large", 27.9)),
        route_prob=((0.65, 0.35), (1.0, 0.0)),
        commit=((1.0, 0.0), (1.0, 0.0)),
        grain_ms=0.1,
    )


def escalation_chain() -> RoutingProfile:
    """Three models small -> mid -> large (think 0.6B -> 8B -> 32B), 6 / 15 / 28 ms.

    Small escalates 30% of positions to mid (its token dropped); mid commits its own token
    and returns to small (60%), keeps going (10%), or escalates to large (30%, token
    dropped); large commits one token and returns to small.
    """
    return RoutingProfile(
        models=(
            ModelProfile.constant("small", 6.0),
            ModelProfile.constant("mid", 15.0),
            ModelProfile.constant("large", 28.0),
        ),
        route_prob=((0.7, 0.3, 0.0), (0.6, 0.1, 0.3), (1.0, 0.0, 0.0)),
        commit=((1.0, 0.0, 0.0), (1.0, 1.0, 0.0), (1.0, 0.0, 0.0)),
        grain_ms=0.1,
    )
