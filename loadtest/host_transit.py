"""Tuned vs all-ones with time between the models: transit-aware thresholds, in process.

    python -m loadtest host --no-served --levels 8,32 --transit-ms 0,1,3

The paper profile (R2R, 6.0 / 27.9 ms, p(small->large) = 0.35) on the simulated runtime
(``LocalRuntime`` over ``SimRunner``: the real scheduler, replicas, policy and protocol), every
frame delayed by ``--transit-ms`` (``InProcHub(transit_s)``, a simulated network). At each
transit and N, three tables, each in its own closed-loop run:

1. **all-ones** (Eager-Async): tok/s, and from the replicas' tuner windows the realized
   escalation rate and the transit each handoff took (its building at the sender to its
   application at the receiver: the configured delay plus the runtime's own);
2. **tuned without transit**: the Markov model's best B at the profile, as thresholds were
   chosen before the model had a transit;
3. **tuned with transit**: what the live tuner decides from step 1's window (the profile at
   the realized routing and the measured transit, grain 0.5 ms, ``ThresholdSolver`` with its
   hysteresis and bounded steps, re-solved until it stops moving). When it keeps all-ones it
   is step 1's run, not a second one (the same table).

Target (PASS / MISS, never a failure): transit-aware tuned >= all-ones at every point.
Printed beside: the transit-free table's tok/s over all-ones, measured and as the transit-aware
model predicts it. Wall-clock figures: on a shared machine each run moves by a few percent.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from tokenrouter_ray.config import TunerSpec
from tokenrouter_ray.simulation.loads import ClosedLoop, SimMeasurement
from tokenrouter_ray.thresholds import is_admissible
from tokenrouter_ray.tuning.examples import paper_r2r
from tokenrouter_ray.tuning.markov import throughput
from tokenrouter_ray.tuning.profile import RoutingProfile
from tokenrouter_ray.tuning.search import evaluate
from tokenrouter_ray.tuning.solver import ThresholdSolver

SOLVE_GRAIN_MS = TunerSpec().grain_ms  # the live tuner's default grain


def best_thresholds(profile: RoutingProfile, n: int) -> tuple[tuple[int, int], float]:
    """The Markov model's best (B_small = 1, B_large) at N, and its predicted tok/s."""
    best = ((1, 1), throughput(profile, n, (1, 1)).throughput)
    for b in range(2, n + 1):
        if not is_admissible(n, (1, b)):
            break
        value = throughput(profile, n, (1, b)).throughput
        if value > best[1]:
            best = ((1, b), value)
    return best


def tuner_choice(profile: RoutingProfile, n: int, max_rounds: int = 20) -> tuple[int, ...]:
    """The live tuner's thresholds at N for a profile that holds still: ``ThresholdSolver``
    (B_small fixed at 1, the tuner's default hysteresis and step bound) from all-ones,
    decided again until it stops moving."""
    spec = TunerSpec()
    solver = ThresholdSolver(profile.names, concurrencies=[n], grain_ms=profile.grain_ms,
                             fixed={profile.names[0]: 1}, min_gain=spec.min_gain,
                             max_step=spec.max_step, drift=spec.drift)  # fmt: skip
    for _ in range(max_rounds):
        if not solver.decide(profile, force=True).changed:
            break
    return tuple(solver.thresholds[m][n] for m in profile.names)


def predict(profile: RoutingProfile, n: int, b: tuple[int, ...]) -> float:
    """T(B) by the tuner's method (exact where it can be, Monte Carlo beyond)."""
    return evaluate(profile, n, [b])[0][0].throughput


async def closed_loop(
    profile: RoutingProfile, n: int, b: tuple[int, ...], transit_s: float, window_s: float,
    warmup_s: float, time_scale: float = 1.0,
) -> SimMeasurement:  # fmt: skip
    """One closed loop; ``transit_s`` in the profile's time base (stretched by the scale)."""
    loop = ClosedLoop(profile, n, b, max_defer_s=float("inf"), transit_s=transit_s * time_scale,
                      time_scale=time_scale)  # fmt: skip
    async with loop:
        await asyncio.sleep(warmup_s)
        return await loop.measure(window_s, b)


def run_transit_sweep(
    levels: list[int],
    transits_ms: list[float],
    window_s: float,
    warmup_s: float,
    measure: Callable[..., SimMeasurement] | None = None,
    time_scale: float = 1.0,
) -> list[dict[str, Any]]:
    """Each (transit, N): all-ones, tuned without transit and tuned with it (module
    docstring). ``measure(profile, n, b, transit_s, window_s, warmup_s)`` runs one closed
    loop (default: the simulated runtime, steps and transit ``time_scale`` times longer,
    every figure in the profile's time base)."""
    paper, rows = paper_r2r(), []
    if measure is None:

        def measure(*args: Any) -> SimMeasurement:
            return asyncio.run(closed_loop(*args, time_scale=time_scale))

    for transit in transits_ms:
        for n in levels:
            ones = measure(paper, n, (1, 1), transit / 1e3, window_s, warmup_s)
            seen = ones.measured_profile(paper).with_grain(SOLVE_GRAIN_MS)
            free_b, free_pred = best_thresholds(paper, n)
            aware_b = tuner_choice(seen, n)
            free = measure(paper, n, free_b, transit / 1e3, window_s, warmup_s)
            aware = ones if aware_b == (1, 1) else measure(paper, n, aware_b, transit / 1e3,
                                                            window_s, warmup_s)  # fmt: skip
            seen_ones = predict(seen, n, (1, 1))
            row = {
                "transit_ms": transit,
                "n": n,
                "measured_transit_ms": {f"{a}->{b}": v for (a, b), v in ones.transit_ms.items()},
                "escalation_rate": ones.escalation_rate,
                "ones_tok_s": ones.throughput,
                "free_b": free_b,
                "free_tok_s": free.throughput,
                "free_ratio": free.throughput / ones.throughput,
                "free_model_ratio": free_pred / throughput(paper, n, (1, 1)).throughput,
                "free_transit_model_ratio": predict(seen, n, free_b) / seen_ones,
                "aware_b": aware_b,
                "aware_tok_s": aware.throughput,
                "aware_ratio": aware.throughput / ones.throughput,
                "aware_model_ratio": predict(seen, n, aware_b) / seen_ones,
                "same_run": aware is ones,
            }
            rows.append(row)
            print_row(row)
    return rows


def print_row(row: dict[str, Any]) -> None:
    seen = ", ".join(f"{k} {v:.2f}" for k, v in row["measured_transit_ms"].items())
    same = " (all-ones: the same run)" if row["same_run"] else ""
    print(
        f"transit {row['transit_ms']:4.1f} ms N={row['n']:3}: measured {seen} ms, p^ "
        f"{row['escalation_rate']:.3f}; all-ones {row['ones_tok_s']:8.1f} tok/s; tuned without "
        f"transit B={row['free_b']} {row['free_tok_s']:8.1f} ({row['free_ratio']:.3f}x; model "
        f"{row['free_model_ratio']:.3f}, with transit {row['free_transit_model_ratio']:.3f}); "
        f"tuned with transit B={row['aware_b']} {row['aware_tok_s']:8.1f} "
        f"({row['aware_ratio']:.3f}x; model {row['aware_model_ratio']:.3f}){same}",
        flush=True,
    )


def targets(rows: list[dict[str, Any]]) -> list[tuple[str, bool, str]]:
    return [
        (
            f"transit {r['transit_ms']:g} ms N={r['n']}: tuned with transit >= all-ones",
            r["aware_ratio"] >= 1.0,
            f"{r['aware_ratio']:.3f}x (B={r['aware_b']}); tuned without transit "
            f"{r['free_ratio']:.3f}x (B={r['free_b']})",
        )
        for r in rows
    ]
