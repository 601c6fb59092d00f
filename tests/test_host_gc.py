"""The serving processes' garbage-collector setting (tokenrouter_ray/host_gc.py, config
``gc``): applied in a fresh interpreter, as a replica applies it once started."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tokenrouter_ray.config import GcSpec

PROBE = """
import gc, json, sys
from tokenrouter_ray.config import GcSpec
from tokenrouter_ray.host_gc import collector_stats, tune_gc
before = collector_stats()
junk = [[i] for i in range(50_000)]  # alive at start-up: frozen with the rest
applied = tune_gc(GcSpec(**json.loads(sys.argv[1])))
cycle = []
cycle.append(cycle)  # garbage only a collection frees
del cycle
gc.collect()
print(json.dumps({"before": before, "applied": applied, "stats": collector_stats(),
                  "threshold": list(gc.get_threshold()), "frozen": gc.get_freeze_count()}))
"""


def _probe(spec: dict) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(spec)], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout)


def test_the_default_freezes_the_start_up_heap_and_raises_the_young_threshold() -> None:
    got = _probe({})
    assert got["before"] == {}  # nothing reported before the process applied it
    assert got["threshold"] == [20_000, 20, 100] == got["applied"]["threshold"]
    assert got["frozen"] >= 50_000 and got["applied"]["frozen_objects"] >= 50_000
    stats = got["stats"]
    assert stats["collections"][2] >= 1  # the explicit full collection was timed
    assert stats["seconds"][2] > 0 and stats["longest_pause_s"] > 0


def test_python_defaults_are_kept_when_asked() -> None:
    got = _probe({"freeze_after_start": False, "threshold": None})
    assert got["threshold"] == [700, 10, 10] and got["frozen"] == 0
    assert got["applied"]["frozen_objects"] == 0


@pytest.mark.parametrize("threshold", [[0, 10, 10], [10, 10], [1, 2, 3, 4]])
def test_a_bad_threshold_is_refused(threshold) -> None:
    with pytest.raises(ValueError, match="threshold"):
        GcSpec(threshold=threshold)
