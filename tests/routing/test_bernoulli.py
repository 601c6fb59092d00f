"""The bernoulli policy's batched draws equal its scalar definition bit for bit (the
simulation and the reference tests depend on the exact draws)."""

from __future__ import annotations

import random

from tokenrouter_ray.routing.baselines import seeded_uniform, seeded_uniforms


def test_batched_draws_equal_the_scalar_draws_bit_for_bit() -> None:
    rng = random.Random(7)
    seeds = [rng.getrandbits(62) for _ in range(2000)] + [0, 1, (1 << 62) - 1]
    positions = [rng.randrange(0, 1 << 24) for _ in seeds]
    batched = seeded_uniforms(seeds, positions).tolist()
    assert batched == [seeded_uniform(s, p) for s, p in zip(seeds, positions, strict=True)]
    assert all(0.0 <= u < 1.0 for u in batched)
    assert seeded_uniforms([], []).shape == (0,)
