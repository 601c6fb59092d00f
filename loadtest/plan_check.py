"""The replica plan against the simulation: ``tokenrouter-ray plan``'s prediction, measured.

    python -m loadtest plan-check [--rates 4,8,12] [--tokens 32] [--window-s 20]

For each offered rate (Poisson arrivals of ``--tokens``-token requests), the plan of
``tuning/capacity.py`` for the paper's step times, R2R's routing (p = 0.35) and replicas of
at most 4 rows per step (small) and 2 (large) at 70 % utilisation; then the simulated
runtime (``simulation/loads.py``: the real engine, schedulers, step threads and protocol
in one process, simulated forward steps, at ``--time-scale`` so the host's own work stays
small beside the steps) runs with exactly those replicas at that rate. Printed: the plan,
the predicted and the measured mean time per output token and mean active requests, and
the target, PASS / MISS: the prediction within 10 % of the measurement. Wall-clock figures
from a shared machine: run it where nothing else loads the cores.
"""

from __future__ import annotations

import argparse
import asyncio
import math

from loadtest.common import command, machine
from tokenrouter_ray.simulation.backend import calibrate_sleep_bias
from tokenrouter_ray.simulation.loads import ClosedLoop
from tokenrouter_ray.tuning.capacity import Load, Targets, plan
from tokenrouter_ray.tuning.profile import ModelProfile, RoutingProfile

TOLERANCE = 0.10
ROWS = {"small": 4, "large": 2}


def profile() -> RoutingProfile:
    return RoutingProfile(
        (
            ModelProfile.constant("small", 6.0, ROWS["small"]),
            ModelProfile.constant("large", 27.9, ROWS["large"]),
        ),
        ((0.65, 0.35), (1.0, 0.0)),
        ((1.0, 0.0), (1.0, 0.0)),
    )


async def measure(
    replicas: dict[str, int], rate: float, tokens: int, window_s: float, scale: float
) -> tuple[float, float]:
    """Mean TPOT (s, profile time) and mean active requests of one open-loop run."""
    loop = ClosedLoop(profile(), 512, (1, 1), time_scale=scale, max_defer_s=math.inf,
                      max_tokens=tokens, clients=0, sleep_bias_s=calibrate_sleep_bias(),
                      replicas=(replicas["small"], replicas["large"]))  # fmt: skip
    async with loop:
        m = await loop.poisson_load(rate, tokens, window_s=window_s, warmup_s=window_s / 4,
                                    drain_timeout_s=60.0, seed=1)  # fmt: skip
    if m.stalled:
        raise RuntimeError(f"{m.stalled} requests never finished")
    return m.mean_tpot_s, m.mean_active


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="4,8,12", help="requests per second")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--window-s", type=float, default=20.0)
    parser.add_argument("--time-scale", type=float, default=2.0)
    args = parser.parse_args()
    print(f"# the replica plan vs the simulated runtime ({machine()})")
    print(f"# reproduce: {command()}")
    targets = Targets({"small": 0.7, "large": 0.7})
    print(f"{'rate/s':>7} {'replicas s/l':>12} {'TPOT plan':>10} {'TPOT sim':>9} "
          f"{'N plan':>7} {'N sim':>6}  target")  # fmt: skip
    missed = 0
    for rate in (float(r) for r in args.rates.split(",")):
        result = plan(profile(), Load(rate, args.tokens), targets, ROWS)
        p = result.prediction
        tpot, active = asyncio.run(
            measure(result.replicas, rate, args.tokens, args.window_s, args.time_scale)
        )
        ok = abs(p.tpot_s - tpot) <= TOLERANCE * tpot
        missed += not ok
        r = result.replicas
        print(
            f"{rate:>7.2f} {r['small']:>6}/{r['large']:<5} {1e3 * p.tpot_s:>8.2f}ms "
            f"{1e3 * tpot:>7.2f}ms {p.mean_active:>7.1f} {active:>6.1f}  "
            f"{'PASS' if ok else 'MISS'} (within {TOLERANCE:.0%}: "
            f"{(p.tpot_s - tpot) / tpot:+.1%})"
        )
    return 0
