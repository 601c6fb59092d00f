"""``tokenrouter-ray plan`` against the simulation it is compared with
(docs/user-guide/scaling.md, "The plan against the simulated runtime"): the plan the CLI
prints for the paper's step times, R2R at p = 0.35 and replicas of at most 4 (small) and
2 (large) rows per step, at 8 requests/s of 32-token answers; then exactly those replicas,
with the thresholds the plan assumes, run in the simulated runtime (the real engine,
schedulers, step threads and protocol in one process, simulated forwards at time scale 2)
at that Poisson rate. The plan's mean time per output token must lie within 10 % of the
simulated one, the target that section states; its mean active requests are the same
figure by Little's law (rate x tokens x TPOT).

The simulated runtime runs in wall-clock time, and a burst of other work on a shared
machine makes it slower than its profile (that section records -5 to -12 % with three
other jobs on two cores): a miss is measured once more with other arrivals and routing
draws, and two misses in a row fail."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math

import pytest

from tokenrouter_ray.cli import main
from tokenrouter_ray.simulation.backend import calibrate_sleep_bias
from tokenrouter_ray.simulation.loads import ClosedLoop
from tokenrouter_ray.simulation.served import profile_models
from tokenrouter_ray.tuning.profile import RoutingProfile

TOLERANCE = 0.10  # the plan within 10 % of the simulated runtime (docs/user-guide/scaling.md)
ROWS = {"small": 4, "large": 2}
RATE, TOKENS, ESCALATION = 8.0, 32, 0.35
PLAN = [
    "plan", "--rate", str(RATE), "--output-tokens", str(TOKENS), "--step-profile", "paper",
    "--escalation", str(ESCALATION), "--max-rows", "small=4,large=2", "--json",
]  # fmt: skip


def simulated_tpot_s(replicas: dict[str, int], thresholds: dict[str, int], seed: int) -> float:
    """Mean time per output token (s, profile time) of the simulated runtime with
    ``replicas`` and ``thresholds`` at ``RATE`` requests/s of ``TOKENS``-token answers, over
    an 8 s window (about 64 arrivals) after a 1 s warm-up."""
    models = [dataclasses.replace(m, max_batch=ROWS[m.name]) for m in profile_models("paper")]
    profile = RoutingProfile(
        tuple(models), ((1 - ESCALATION, ESCALATION), (1.0, 0.0)), ((1.0, 0.0), (1.0, 0.0))
    )
    names = [m.name for m in models]

    async def run():
        loop = ClosedLoop(profile, 256, [thresholds[m] for m in names], time_scale=2.0,
                          max_defer_s=math.inf, max_tokens=TOKENS, clients=0,
                          sleep_bias_s=calibrate_sleep_bias(),
                          replicas=[replicas[m] for m in names])  # fmt: skip
        async with loop:
            return await loop.poisson_load(RATE, TOKENS, window_s=8.0, warmup_s=1.0,
                                           drain_timeout_s=20.0, seed=seed)  # fmt: skip

    m = asyncio.run(run())
    assert m.stalled == 0 and m.deferred_timeouts_total == 0 and m.finished == m.submitted
    return m.mean_tpot_s


@pytest.mark.slow
def test_the_plan_predicts_the_simulated_runtime(capsys) -> None:
    assert main(PLAN) == 0
    planned = json.loads(capsys.readouterr().out)
    assert planned["feasible"] and planned["replicas"] == {"small": 1, "large": 2}
    assert planned["thresholds"] == {"small": 1, "large": 1}  # eager launch
    tpot_s = planned["tpot_ms"] / 1e3
    assert planned["offered_tokens_per_s"] == RATE * TOKENS < planned["max_tokens_per_s"]
    assert planned["mean_active"] == pytest.approx(RATE * TOKENS * tpot_s, rel=1e-9)
    measured = []
    for seed in (1, 2):
        measured.append(simulated_tpot_s(planned["replicas"], planned["thresholds"], seed))
        if abs(tpot_s - measured[-1]) <= TOLERANCE * measured[-1]:
            return
    pytest.fail(f"plan {1e3 * tpot_s:.2f} ms per token, simulated {[1e3 * t for t in measured]}")
