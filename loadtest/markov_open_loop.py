"""Issue 14's measurements on the simulation backend: closed loop at the tuned thresholds,
open loop (Poisson arrivals), and a load that steps N 16 -> 4 -> 16.

The paper's R2R setting (p(small->large) = 0.35, 6.0 / 27.9 ms, B_small = 1), thresholds as
the tuner would set them (best B_large at N = 1, 2, 4, 8, 16, filled between), no safety net
(``max_defer_s = inf`` unless ``--max-defer-s``), the real scheduler, sub-servers, protocol
and ingress over simulated engines (``tokenrouter_ray.simulation``). Three parts, each
printed as a markdown table with its target:

1. ``closed``: N clients in a closed loop at N = 1, 2, 4, 8, 16 (5-6 s windows in the
   profile's time base, 2 s with ``--quick``); measured committed tok/s within 5 % of the
   exact chain's prediction (PASS/MISS), deferred timeouts (target 0).
2. ``open``: Poisson arrivals of fixed-length requests at 30/50/70/90 % of the closed-loop
   prediction at N = 16 (``tuning/open_loop.py``: birth-death N over the Markov T(n));
   measured tok/s against the offered lambda L (5 %), mean N, mean and p99 time per output
   token against the state-only and the processor-sharing predictions, stalls and deferred
   timeouts (target 0).
3. ``step``: 16 clients, then 4, then 16 (8 s each); after each step the trailing 0.5 s
   throughput must be within 10 % of the new N's steady state within 2 s and stay there.
   The steady state is the rate over the second half of the same phase (same run, same
   machine conditions; the settle time is taken over the first half); part 1's
   measurement and the prediction at that N are printed beside it.

Run: ``.venv/bin/python -m loadtest.markov_open_loop`` (about 8 min on 2 shared cores;
``--quick`` about 3 min; ``--parts open,step``; ``--plot FILE`` draws the open-loop and step
panels with matplotlib, the ``bench`` extra). Times and rates are in the profile's time base
(``--time-scale 2`` runs every step 2x slower and divides wall times by 2, which halves the
share of the runtime's own per-step overhead).
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import statistics
import sys
import time
from collections.abc import Sequence

from loadtest.common import machine
from tokenrouter_ray.simulation.validate import (
    OpenLoopPoint,
    StepSettle,
    ValidationPoint,
    format_open_loop,
    format_step_load,
    format_tuned,
    tuned_tables,
    validate_open_loop,
    validate_step_load,
    validate_tuned,
)
from tokenrouter_ray.tuning.examples import PAPER_CONCURRENCIES, paper_r2r
from tokenrouter_ray.tuning.markov import throughput

PARTS = ("closed", "open", "step")
# closed-loop windows per N, profile time base (wall: x time scale)
CLOSED_S = {1: 6.0, 2: 5.0, 4: 5.0, 8: 5.0, 16: 5.0}
QUICK_CLOSED_S = {1: 2.0, 2: 2.0, 4: 2.0, 8: 2.0, 16: 2.0}


def _load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f}"


def plot(open_points: Sequence[OpenLoopPoint], step: tuple | None, path: str) -> None:
    """Open loop: p99 TPOT and mean N against the load; step: trailing-window throughput."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (2 if open_points else 0) + (1 if step else 0)
    fig, axes = plt.subplots(1, panels, figsize=(4.2 * panels, 3.6), squeeze=False)
    col = 0
    if open_points:
        loads = [100 * p.load for p in open_points]
        ax = axes[0][col]
        ax.plot(loads, [p.prediction.mean_active for p in open_points], "o-", label="predicted")
        ax.plot(loads, [p.measurement.mean_active for p in open_points], "s", color="tab:red",
                label="measured")  # fmt: skip
        ax.set(xlabel="load (% of T(16))", ylabel="mean active requests N", title="open loop")
        ax.legend(fontsize=7)
        ax = axes[0][col + 1]
        p99 = [p.p99() for p in open_points]
        ax.plot(loads, [1000 * v["states"] for v in p99], "o--", color="0.6", label="state-only")
        ax.plot(loads, [1000 * v["ps"] for v in p99], "o-", label="processor sharing + routing")
        ax.plot(loads, [1000 * v["measured"] for v in p99], "s", color="tab:red",
                label="measured")  # fmt: skip
        ax.set(xlabel="load (% of T(16))", ylabel="p99 time per output token (ms)",
               title="open loop, p99 TPOT")  # fmt: skip
        ax.legend(fontsize=7)
        col += 2
    if step:
        trace, settles = step
        ax = axes[0][col]
        window = 0.5
        ts = [t for t in trace.times_s if t >= window]
        ax.plot(ts, [trace.rate(t - window, t) for t in ts], lw=1,
                label="trailing 0.5 s; green: new N's reference ± 10 %")  # fmt: skip
        for s in settles:
            ax.axvline(s.at_s, color="0.5", lw=0.8)
        for phase, clients in enumerate(trace.clients):
            lo, hi = trace.starts_s[phase], trace.phase_end(phase)
            ref = next((s.reference for s in settles if s.at_s == lo), None)
            if ref is not None:
                ax.hlines([ref * 0.9, ref * 1.1], lo, hi, colors="tab:green", lw=0.8)
            ax.text((lo + hi) / 2, 0.97, f"N={clients}", ha="center", va="top",
                    transform=ax.get_xaxis_transform())  # fmt: skip
        ax.set(xlabel="s", ylabel="tokens/s", title="closed loop, N 16 → 4 → 16")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default=",".join(PARTS), help="closed,open,step")
    parser.add_argument("--quick", action="store_true", help="short windows (about 3 min)")
    parser.add_argument("--concurrency", default=",".join(map(str, PAPER_CONCURRENCIES)))
    parser.add_argument("--loads", default="0.3,0.5,0.7,0.9",
                        help="open-loop offered tok/s as fractions of T(16)")  # fmt: skip
    parser.add_argument("--tokens", type=int, default=32, help="output tokens per request")
    parser.add_argument("--requests", type=int, help="open-loop arrivals per window")
    parser.add_argument("--time-scale", type=float, default=2.0)
    parser.add_argument("--max-defer-s", type=float, default=math.inf)
    parser.add_argument("--phase-s", type=float, help="length of each step-load phase")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", help="write a PNG here (matplotlib)")
    args = parser.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    if unknown := set(parts) - set(PARTS):
        parser.error(f"unknown parts {sorted(unknown)}; choose from {PARTS}")
    ns = [int(x) for x in args.concurrency.split(",") if x]
    loads = [float(x) for x in args.loads.split(",") if x]
    requests = args.requests or (120 if args.quick else 400)
    phase_s = args.phase_s or (6.0 if args.quick else 8.0)
    profile = paper_r2r()
    tables = tuned_tables(profile)
    start = time.perf_counter()
    shown = sys.argv[1:] if argv is None else argv
    print("command: python -m loadtest.markov_open_loop " + " ".join(map(shlex.quote, shown)))
    print(f"machine: {machine()}")
    print(f"{_load()} at the start")
    print(
        f"paper setting: R2R p(small->large)=0.35, 6.0/27.9 ms, B_small=1, B_large as tuned at "
        f"N=1,2,4,8,16: {[tables[1][n] for n in (1, 2, 4, 8, 16)]}; time scale "
        f"x{args.time_scale:g}; max_defer_s={args.max_defer_s:g}"
    )
    closed: list[ValidationPoint] = []
    references: dict[int, float] = {}
    overhead_ms = None
    if "closed" in parts:
        print("\n## Closed loop, tuned thresholds (target: within 5 % of the prediction)\n")

        def progress(p: ValidationPoint) -> None:
            print(f"  N={p.measurement.n_requests} B={p.thresholds} pred {p.predicted:.1f} "
                  f"meas {p.measured:.1f} [{time.perf_counter() - start:.0f} s]",
                  flush=True)  # fmt: skip

        windows = {n: w * args.time_scale for n, w in
                   (QUICK_CLOSED_S if args.quick else CLOSED_S).items()}  # fmt: skip
        closed = validate_tuned(profile, ns, tables, time_scale=args.time_scale,
                                windows_s=windows,
                                warmup_s=0.5 if args.quick else 0.8, seed=args.seed,
                                max_defer_s=args.max_defer_s, progress=progress)  # fmt: skip
        print()
        print(format_tuned(closed))
        print("\ngap: median wall ms between consecutive small-model steps (the runtime's own "
              "per-step cost, in pred@p^+ovh); oversleep: mean wall ms a simulated step ran past "
              "its profiled time (the worse model; near 0 on an idle machine)")  # fmt: skip
        references = {p.measurement.n_requests: p.measured for p in closed}
        gaps = [p.overhead_ms for p in closed if math.isfinite(p.overhead_ms)]
        if gaps:
            overhead_ms = statistics.median(gaps) / args.time_scale
            print(f"\nloop overhead (median gap between small-model steps): "
                  f"{overhead_ms * args.time_scale:.2f} ms wall = {overhead_ms:.2f} ms in the "
                  f"profile's time base; {_load()}")  # fmt: skip
    open_points: list[OpenLoopPoint] = []
    if "open" in parts:
        t16 = throughput(profile, 16, (tables[0][16], tables[1][16])).throughput
        print(f"\n## Open loop: Poisson arrivals of {args.tokens}-token requests "
              f"(loads relative to the prediction at N = 16, {t16:.1f} tok/s)\n")  # fmt: skip

        def progress_open(p: OpenLoopPoint) -> None:
            m = p.measurement
            print(f"  load {p.load:.2f}: {m.arrivals_in_window} arrivals in "
                  f"{m.window_s:.1f} s, {m.throughput:.1f} tok/s, mean N {m.mean_active:.2f}, "
                  f"p99 TPOT {1000 * m.tpot_quantile(0.99):.1f} ms "
                  f"[{time.perf_counter() - start:.0f} s]", flush=True)  # fmt: skip

        open_points = validate_open_loop(
            profile, tables, loads, t16, tokens=args.tokens, requests_per_point=requests,
            min_window_s=5.0 if args.quick else 10.0, time_scale=args.time_scale,
            max_defer_s=args.max_defer_s, overhead_ms=overhead_ms, seed=args.seed,
            progress=progress_open,
        )  # fmt: skip
        print()
        print(format_open_loop(open_points))
        print(
            "\nerr: measured tok/s against the offered λ L (target 5 %); TPOT = (finish - "
            "arrival) / L per request arriving in the window; 'states': token-weighted n/T(n) "
            "over the birth-death states, 'PS': processor sharing with per-request routing "
            "noise (tuning/open_loop.py); +ovh: T(n) with the measured loop overhead added to "
            f"every step. Targets: 0 stalled, 0 deferred timeouts. {_load()}"
        )
        limit = open_points[0].prediction.stability_limit if open_points else math.inf
        print(f"stability limit: {'none' if math.isinf(limit) else f'{limit:.2f} req/s'} "
              "(T(n) computed exactly for n <= 48, extended linearly past it: with constant "
              "step times a larger batch costs nothing, T(n)/n tends to 45.7 tok/s)")  # fmt: skip
    step = None
    if "step" in parts:
        phases = ((16, phase_s), (4, phase_s), (16, phase_s))
        print(f"\n## Step load: closed loop, N {' → '.join(str(c) for c, _ in phases)}, "
              f"{phase_s:g} s each\n")  # fmt: skip
        trace, settles = validate_step_load(
            profile, tables, phases, closed_loop=references, time_scale=args.time_scale,
            max_defer_s=args.max_defer_s, seed=args.seed,
        )  # fmt: skip
        step = (trace, settles)
        print(format_step_load(settles, trace))
        print(f"\nsteady state: the rate over the second half of the phase (same run, same "
              "machine conditions); 'within 10 % after': the first trailing 0.5-s window "
              "(evaluated every 0.05 s, 0.5 s is the earliest possible) within 10 % of it, "
              "the target; 'stays within from': from then on every window of the first half "
              "stays within (stricter, sensitive to machine noise); 'first 2 s': the rate over "
              f"the 2 s after the step against the steady state. {_load()}")  # fmt: skip
        _print_step_rates(settles)
    if args.plot:
        plot(open_points, step, args.plot)
        print(f"\nplot: {args.plot}")
    verdicts = _verdicts(closed, open_points, step[1] if step else [])
    if math.isinf(args.max_defer_s):
        verdicts += ("; max_defer_s = inf: the safety net cannot fire, stalls are the check "
                     "(--max-defer-s 1, the config default, counts it)")  # fmt: skip
    print(f"\nsummary: {verdicts}")
    print(f"total {time.perf_counter() - start:.0f} s; {_load()} at the end")
    return 0


def _print_step_rates(settles: Sequence[StepSettle]) -> None:
    for s in settles:
        shown = [f"{t:.2f}:{r:.0f}" for t, r in s.rates[::4]]
        print(f"  {s.before} → {s.after} (s after step: tok/s): {' '.join(shown)}")


def _verdicts(
    closed: Sequence[ValidationPoint],
    open_points: Sequence[OpenLoopPoint],
    settles: Sequence[StepSettle],
) -> str:
    out = []
    if closed:
        ok = sum(p.rel_error <= 0.05 for p in closed)
        timeouts = sum(p.measurement.deferred_timeouts for p in closed)
        out.append(f"closed {ok}/{len(closed)} within 5 %, {timeouts} deferred timeouts")
    if open_points:
        ok = sum(p.throughput_error <= 0.05 for p in open_points)
        stalled = sum(p.measurement.stalled for p in open_points)
        timeouts = sum(p.measurement.deferred_timeouts_total for p in open_points)
        out.append(f"open {ok}/{len(open_points)} throughput within 5 %, {stalled} stalled, "
                   f"{timeouts} deferred timeouts")  # fmt: skip
    if settles:
        ok = sum(s.passed for s in settles)
        timeouts = sum(s.timeouts for s in settles)
        out.append(f"step {ok}/{len(settles)} settled within 2 s, {timeouts} deferred timeouts")
    return "; ".join(out)


if __name__ == "__main__":
    sys.exit(main())
