"""Replicas in the throughput model: prediction vs the simulated runtime with R_large = 2.

The paper's R2R setting (p(small->large) = 0.35, 6.0 / 27.9 ms, B_small = 1) with two
replicas of the large model, each applying B_large to the requests placed on it: for every N
in ``--concurrency`` and every admissible B_large (``2 (B_large - 1) < N``), the Monte Carlo
prediction of sticky placement (``montecarlo.monte_carlo_bound``) next to the closed-loop
measurement on ``ReplicatedRuntime`` (simulated engines, production's placement,
ingress/placement.py), and the predicted best B against the measured best, and how often
the ``max_defer_s`` safety net (0.05 s, the config default) fired in each steady-state
window. Then, with ``max_defer_s = inf``, an open-loop burst (Poisson arrivals, then none)
counts the requests that never finish: nonzero while models learn N only from NEW frames
(issue 14 part 1).

Run: ``.venv/bin/python -m loadtest.markov_replicas`` (about 2 min on 2 cores).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import time

from loadtest.common import command, machine
from tokenrouter_ray.simulation.backend import calibrate_sleep_bias
from tokenrouter_ray.simulation.loads import ClosedLoop, measure_closed_loop
from tokenrouter_ray.thresholds import is_admissible
from tokenrouter_ray.tuning.examples import paper_r2r
from tokenrouter_ray.tuning.montecarlo import monte_carlo
from tokenrouter_ray.tuning.search import threshold_lists, tune


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", default="2,4,6,8")
    parser.add_argument("--window-s", type=float, default=3.0)
    parser.add_argument("--time-scale", type=float, default=2.0)
    parser.add_argument(
        "--max-defer-s", type=float, default=0.05, help="the safety net (default: the config's)"
    )
    args = parser.parse_args()
    profile = paper_r2r()
    replicas = (1, 2)
    bias = calibrate_sleep_bias()
    start = time.perf_counter()
    print(f"# {command()}\n# {machine()}\n")
    print("| N | B_large | predicted tok/s | measured tok/s | err | p^ | mean large batch "
          "| deferred timeouts |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    summary = []
    for n in (int(x) for x in args.concurrency.split(",")):
        combos = [(1, b) for b in range(1, n + 1) if is_admissible(n, (1, b), replicas)]
        predicted = {p.thresholds: p.throughput
                     for p in monte_carlo(profile, n, combos, model_replicas=replicas)}  # fmt: skip
        measured = {}
        for combo in combos:
            m = measure_closed_loop(profile, n, combo, window_s=args.window_s, warmup_s=0.7,
                                    time_scale=args.time_scale, sleep_bias_s=bias,
                                    replicas=replicas, max_defer_s=args.max_defer_s)  # fmt: skip
            measured[combo] = m.throughput
            err = abs(predicted[combo] - m.throughput) / m.throughput
            print(f"| {n} | {combo[1]} | {predicted[combo]:.1f} | {m.throughput:.1f} | "
                  f"{100 * err:.1f} % | {m.escalation_rate:.3f} | {m.mean_batch[1]:.2f} | "
                  f"{m.deferred_timeouts} |", flush=True)  # fmt: skip
        pred_best = max(predicted, key=predicted.__getitem__)
        meas_best = max(measured, key=measured.__getitem__)
        gap = 1 - measured[pred_best] / measured[meas_best]
        summary.append((n, pred_best[1], meas_best[1], gap))
    print("\n| N | predicted best B_large | measured best B_large | cost of the predicted best |")
    print("|---|---|---|---|")
    for n, pb, mb, gap in summary:
        print(f"| {n} | {pb} | {mb} | {100 * gap:.1f} % |")
    worst = max(gap for *_, gap in summary)
    verdict = "PASS" if worst <= 0.02 else "MISS"
    print(f"\ntarget: the predicted best B_large measures within 2 % of the measured best at "
          f"every N: {verdict} (worst {100 * worst:.1f} %)")  # fmt: skip

    async def burst() -> tuple[int, int, int]:
        lists = threshold_lists(tune(profile, [1, 2, 4, 8], {"small": 1}), max_n=48)
        loop = ClosedLoop(profile, 48, (lists["small"], lists["large"]), sleep_bias_s=bias,
                          max_defer_s=math.inf, max_tokens=16, clients=0)  # fmt: skip
        async with loop:
            r = await loop.open_loop(rate_per_s=200.0, count=40, max_tokens=16, timeout_s=5.0)
        return r.submitted, r.finished, r.stalled

    submitted, finished, stalled = asyncio.run(burst())
    print(f"\nopen loop, max_defer_s = inf, one replica each: {submitted} submitted, "
          f"{finished} finished, {stalled} never finished (5 s)")  # fmt: skip
    print(f"\n{time.perf_counter() - start:.0f} s\nReproduce: {command()}")


if __name__ == "__main__":
    main()
