"""The inter-token time (ITL), one rule for every place that reports it.

An inter-token time is the gap between two consecutive output tokens as one observer saw
them arrive. ``token_gaps`` lists those gaps from arrival stamps (the load test's chunk
times, the simulation's commit stamps). ``mean_itl`` is their mean when only the ends are
known: ``tokens`` tokens, the first at ``first``, the last at ``last``, have
``tokens - 1`` gaps between them. The ingress uses it for a request's ``mean_itl_s`` and,
per COMMIT of several tokens, for the inter-token histogram.

Pure arithmetic: no clock, no imports outside the standard library, so the runtime, the
simulation and ``loadtest/`` (also on a bare GPU machine) may all import it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable


def token_gaps(stamps: Iterable[float], scale: float = 1.0) -> list[float]:
    """The gaps between consecutive arrival ``stamps``, each divided by ``scale`` (a
    simulation's time scale; 1 for real seconds)."""
    return [(b - a) / scale for a, b in itertools.pairwise(stamps)]


def mean_itl(first: float, last: float, tokens: int) -> float | None:
    """The mean inter-token time of ``tokens`` tokens, the first seen at ``first`` and the
    last at ``last``: ``(last - first) / (tokens - 1)``. None below two tokens (no gap)."""
    if tokens < 2:
        return None
    return (last - first) / (tokens - 1)
