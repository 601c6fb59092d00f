"""Benchmark of the deferred-batching throughput model (tokenrouter_ray.tuning).

Prints, with wall-clock timings on this machine:

1. ``paper``: the TokenRouter paper's R2R validation setting (p(small->large) = 0.35,
   6.0 / 27.9 ms, 0.1 ms grain, B_small = 1): predicted tokens/s for every (N, B_large),
   N in {1, 2, 4, 8, 16}, and the optimum per N.
2. ``scale``: two models, exhaustive B_large sweeps at larger N (state and transition counts,
   build and solve time per point, total per N), and the single largest solve (the live
   re-solve case).
3. ``m3``: the three-model escalation chain: the Monte Carlo approximation against the exact
   chain on every admissible B where exact is computable (worst relative error), and the
   Monte Carlo sweep time for N up to 16.
4. ``validate`` (not in the default sections, about 4 minutes): the model against
   ``LocalRuntime`` over simulated engines (the real scheduler, model replicas and protocol,
   steps that sleep for the profiled time), every admissible B_large per N, measured vs
   predicted tokens/s and whether the predicted best is within 2 % of the measured best.

Run: ``python -m loadtest markov`` (``--sections paper,scale,m3,validate``,
``--scale-n 16,32,48,64``, ``--m3-n 1,2,4,8,16``, ``--validate-n 1,2,4,8,16 --quick``;
``--smoke`` runs every section at a toy size in seconds).
"""

from __future__ import annotations

import argparse
import sys
import time

from loadtest.common import command, machine
from tokenrouter_ray.tuning.examples import PAPER_CONCURRENCIES, escalation_chain, paper_r2r
from tokenrouter_ray.tuning.markov import throughput
from tokenrouter_ray.tuning.montecarlo import MonteCarloConfig, monte_carlo
from tokenrouter_ray.tuning.search import SweepResult, candidates, sweep


def _print_sweep(result: SweepResult, show_states: bool = True) -> None:
    best = result.best
    for point in result.points:
        label = result.point_label(point)
        states = (
            f" {point.num_states:>8} states {point.num_transitions:>9} transitions"
            f"  build {point.build_s:6.3f} s  solve {point.solve_s:6.3f} s"
            if show_states
            else ""
        )
        mark = "  <- best" if point is best else ""
        print(f"    B={label:<6} {point.throughput:10.2f} tok/s{states}{mark}")


def paper_section(concurrencies: list[int]) -> None:
    print("== paper setting: R2R small/large, p(s->l)=0.35, 6.0/27.9 ms, delta=0.1 ms ==")
    profile = paper_r2r()
    summary = []
    for n in concurrencies:
        result = sweep(profile, n, {"small": 1}, method="exact")
        print(f"  N={n}: sweep of B_large in {result.elapsed_s:.2f} s")
        _print_sweep(result, show_states=False)
        summary.append((n, result.best.thresholds[1], result.best.throughput))
    print(
        "  optimum per N:  "
        + "  ".join(f"N={n}: B_large={b} ({t:.1f} tok/s)" for n, b, t in summary)
    )


def scale_section(concurrencies: list[int]) -> None:
    print("== scale: two models (paper profile), exhaustive B_large sweep per N ==")
    profile = paper_r2r()
    for n in concurrencies:
        result = sweep(profile, n, {"small": 1}, method="exact")
        biggest = max(result.points, key=lambda p: p.num_states)
        print(
            f"  N={n}: {len(result.points)} points in {result.elapsed_s:.2f} s total; "
            f"largest chain B={biggest.thresholds}: {biggest.num_states} states, "
            f"{biggest.num_transitions} transitions, build {biggest.build_s:.2f} s + "
            f"solve {biggest.solve_s:.2f} s; best B_large={result.best.thresholds[1]} "
            f"({result.best.throughput:.2f} tok/s)"
        )
        if n == concurrencies[-1]:
            start = time.perf_counter()
            again = throughput(profile, n, biggest.thresholds)
            print(
                f"  single live re-solve N={n} B={again.thresholds}: "
                f"{time.perf_counter() - start:.2f} s ({again.num_states} states)"
            )


def m3_section(
    exact_ns: list[int],
    mc_ns: list[int],
    spots: list[tuple[int, tuple[int, ...]]],
    config: MonteCarloConfig,
) -> None:
    profile = escalation_chain()
    steps = "/".join(f"{m.step_time_ms(1):g}" for m in profile.models)
    print(f"== three models: escalation chain {'->'.join(profile.names)}, {steps} ms ==")
    print(
        f"  Monte Carlo: {config.replicas} replicas x {config.events} events "
        f"(+{config.warmup_events} warm-up) per candidate B, seed {config.seed}"
    )
    worst_overall = 0.0
    for n in exact_ns:
        grid = candidates(profile, n, {"small": 1})
        start = time.perf_counter()
        exact = {b: throughput(profile, n, b) for b in grid}
        exact_s = time.perf_counter() - start
        start = time.perf_counter()
        estimates = monte_carlo(profile, n, grid, config)
        mc_s = time.perf_counter() - start
        errors = [
            abs(e.throughput - exact[e.thresholds].throughput) / exact[e.thresholds].throughput
            for e in estimates
        ]
        worst_overall = max(worst_overall, *errors)
        best_exact = max(exact.values(), key=lambda p: p.throughput)
        best_mc = max(estimates, key=lambda p: p.throughput)
        regret = 1 - exact[best_mc.thresholds].throughput / best_exact.throughput
        print(
            f"  N={n}: {len(grid)} candidates; exact {exact_s:.2f} s (largest "
            f"{max(p.num_states for p in exact.values())} states), Monte Carlo {mc_s:.2f} s; "
            f"error worst {100 * max(errors):.2f}% mean {100 * sum(errors) / len(errors):.2f}%; "
            f"best exact {best_exact.thresholds} / MC {best_mc.thresholds} "
            f"(throughput lost by the MC pick: {100 * regret:.2f}%)"
        )
    for n, thresholds in spots:
        exact = throughput(profile, n, thresholds)
        (estimate,) = monte_carlo(profile, n, [thresholds], config)
        error = (estimate.throughput - exact.throughput) / exact.throughput
        worst_overall = max(worst_overall, abs(error))
        print(
            f"  spot N={n} B={thresholds}: exact {exact.throughput:.2f} tok/s "
            f"({exact.num_states} states, {exact.build_s + exact.solve_s:.2f} s), "
            f"Monte Carlo {estimate.throughput:.2f} +/- {estimate.stderr:.2f} "
            f"({100 * error:+.2f}%)"
        )
    if exact_ns or spots:
        print(f"  worst Monte Carlo error against exact: {100 * worst_overall:.2f}%")
    for n in mc_ns:
        result = sweep(profile, n, {"small": 1}, method="monte-carlo", mc_config=config)
        best = result.best
        print(
            f"  N={n}: Monte Carlo sweep of {len(result.points)} candidates in "
            f"{result.elapsed_s:.2f} s; best {result.best_by_name()} "
            f"{best.throughput:.1f} +/- {best.stderr:.1f} tok/s"
        )


def validate_section(ns: list[int], quick: bool, time_scale: float, window_s: float | None) -> None:
    """The model against the runtime on simulated engines (B_small = 1, B_large free)."""
    from tokenrouter_ray.simulation.validate import (
        DEFAULT_WINDOWS_S,
        QUICK_WINDOWS_S,
        format_validation,
        validate,
    )

    profile = paper_r2r()
    windows = dict(QUICK_WINDOWS_S if quick else DEFAULT_WINDOWS_S)
    if window_s is not None:
        windows = {n: window_s for n in ns}
    print(f"== validation: the model vs the simulated runtime, time scale x{time_scale:g} ==")
    rows, overhead_ms = validate(
        profile, ns, fixed={0: 1}, free=1, time_scale=time_scale, windows_s=windows,
        warmup_s=0.5 if quick else min(0.8, window_s or 0.8), seed=0,
    )  # fmt: skip
    print(format_validation(rows, profile.names, overhead_ms, time_scale))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest markov", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--sections", default="paper,scale,m3", help="and/or validate")
    parser.add_argument("--paper-n", default=",".join(map(str, PAPER_CONCURRENCIES)))
    parser.add_argument("--scale-n", default="16,32,48,64")
    parser.add_argument("--m3-exact-n", default="2,4,6,8")
    parser.add_argument("--m3-n", default="1,2,4,8,16")
    parser.add_argument(
        "--m3-spot",
        default="16:1,3,3;16:1,4,4",
        help="exact-vs-Monte-Carlo spot checks beyond the exhaustive ones, N:B;N:B",
    )
    parser.add_argument("--mc-replicas", type=int, default=MonteCarloConfig.replicas)
    parser.add_argument("--mc-events", type=int, default=MonteCarloConfig.events)
    parser.add_argument("--validate-n", default=",".join(map(str, PAPER_CONCURRENCIES)))
    parser.add_argument("--quick", action="store_true", help="validate: short windows (~1 min)")
    parser.add_argument("--time-scale", type=float, default=2.0, help="validate: step times x")
    parser.add_argument("--window-s", type=float, help="validate: measurement window per point")
    parser.add_argument("--smoke", action="store_true", help="every section at a toy size")
    args = parser.parse_args(argv)
    if args.smoke:
        args.sections, args.paper_n, args.scale_n = "paper,scale,m3,validate", "1,2", "4"
        args.m3_exact_n, args.m3_n, args.m3_spot = "2", "2", ""
        args.mc_replicas, args.mc_events, args.validate_n, args.window_s = 2, 2000, "2", 0.3
    ints = lambda text: [int(x) for x in text.split(",") if x]  # noqa: E731
    sections = set(args.sections.split(","))
    print(f"command: {command()}")
    print(f"machine: {machine()}")
    start = time.perf_counter()
    if "paper" in sections:
        paper_section(ints(args.paper_n))
    if "scale" in sections:
        scale_section(ints(args.scale_n))
    if "m3" in sections:
        config = MonteCarloConfig(replicas=args.mc_replicas, events=args.mc_events)
        spots = [
            (int(n), tuple(ints(b)))
            for n, b in (item.split(":") for item in args.m3_spot.split(";") if item)
        ]
        m3_section(ints(args.m3_exact_n), ints(args.m3_n), spots, config)
    if "validate" in sections:
        validate_section(ints(args.validate_n), args.quick, args.time_scale, args.window_s)
    print(f"total {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
