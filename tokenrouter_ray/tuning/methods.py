"""How the throughput model is solved: the methods ``tune`` offers and the Monte Carlo
settings. Kept apart from the solvers so the CLI's parser is built without numpy or scipy."""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("auto", "exact", "monte-carlo")


@dataclass(frozen=True)
class MonteCarloConfig:
    """How much to simulate per candidate B."""

    replicas: int = 64  # independent copies of the chain per candidate
    warmup_events: int = 300  # batch completions discarded from each copy's start
    events: int = 2_000  # batch completions measured per copy
    seed: int = 0
