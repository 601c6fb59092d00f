"""Confidence intervals for an accuracy: Wilson's score interval for k successes in n.

Numbers enter as counts and leave as a ``(low, high)`` pair of proportions in [0, 1].
"""

from __future__ import annotations

import math

Z95 = 1.959963984540054  # the standard normal's 97.5 % quantile


def wilson_interval(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson's score interval for the proportion k/n (95 % by default); (0, 1) for n = 0."""
    if n < 0 or not 0 <= k <= n:
        raise ValueError(f"need 0 <= k <= n, got k={k}, n={n}")
    if n == 0:
        return 0.0, 1.0
    p = k / n
    z2 = z * z
    denominator = 1 + z2 / n
    centre = (p + z2 / (2 * n)) / denominator
    margin = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / denominator
    low = 0.0 if k == 0 else max(0.0, centre - margin)  # exact at the ends (no rounding)
    high = 1.0 if k == n else min(1.0, centre + margin)
    return low, high
