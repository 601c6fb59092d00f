"""The one inter-token-time rule (metrics/latency.py): gaps from arrival stamps, the mean
from the two ends, and the two agree."""

from __future__ import annotations

import statistics

import pytest

from loadtest.harness import Record, summarize
from tokenrouter_ray.metrics.latency import mean_itl, token_gaps


def test_gaps_are_consecutive_differences() -> None:
    assert token_gaps([1.0, 1.5, 3.0, 3.25]) == [0.5, 1.5, 0.25]
    assert token_gaps([2.0]) == []
    assert token_gaps([]) == []


def test_gaps_are_scaled() -> None:
    assert token_gaps([0.0, 4.0, 10.0], scale=2.0) == [2.0, 3.0]


def test_mean_needs_two_tokens() -> None:
    assert mean_itl(1.0, 1.0, 0) is None
    assert mean_itl(1.0, 1.0, 1) is None
    assert mean_itl(1.0, 3.0, 2) == 2.0
    assert mean_itl(1.0, 4.0, 4) == 1.0


def test_mean_from_the_ends_is_the_mean_of_the_gaps() -> None:
    stamps = [0.2, 0.3, 0.75, 0.8, 1.9]
    gaps = token_gaps(stamps)
    assert mean_itl(stamps[0], stamps[-1], len(stamps)) == pytest.approx(statistics.fmean(gaps))


def test_load_test_summary_uses_the_gaps() -> None:
    records = [
        Record(0, start=0.0, first=1.0, end=2.0, chunk_times=[1.0, 1.5, 2.0], finished=True),
        Record(1, start=0.0, first=1.0, end=4.0, chunk_times=[1.0, 4.0], finished=True),
    ]
    itl = summarize(records, elapsed=4.0)["itl_s"]  # gaps 0.5, 0.5, 3.0 (nearest rank)
    assert (itl["p50"], itl["p99"]) == (0.5, 3.0)
