"""``tokenrouter-ray simulate``: the real runtime on simulated models, next to the prediction.

The statistics come in as ``tune`` takes them (a profile file or inline ``--step-ms``,
``--route-prob``, ``--commit``; ``tuning/commands.py`` parses them); ``--batch-thresholds`` or
``--batch-thresholds-in`` say which B to run at each ``--concurrency-levels`` N (B at N read from a
threshold list by ``ThresholdTable``'s lookup rule; inadmissible B skipped). Each point runs
``loads.measure_closed_loop`` and prints measured tokens/s beside the Markov prediction
(a table, or JSON with ``--json``). ``--transit-ms X`` delays every frame of the simulated
runtime by X ms (in the profile's time base) and prices X into the prediction; each point
then also prints the transit the replicas measured (a handoff's building to its
application) and the prediction at it and at the realized routing (``pred@meas``).
"""

from __future__ import annotations

import argparse
import json
import sys
from itertools import product
from pathlib import Path
from typing import Any

from tokenrouter_ray.cli import deprecated_alias
from tokenrouter_ray.errors import UserFacingError
from tokenrouter_ray.thresholds import ThresholdTable, is_admissible
from tokenrouter_ray.tuning.commands import (
    _add_statistics,
    _int_list,
    add_concurrency_levels,
    build_profile,
)
from tokenrouter_ray.tuning.profile import RoutingProfile


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "simulate",
        help="measure throughput of the real runtime on simulated engines (profiled step times)",
        description=(
            "Run the real runtime (its scheduler, model replicas and protocol) in one process on "
            "engines that "
            "sleep for the profiled step time, N requests in a closed loop, and print the "
            "measured committed tokens/s next to the Markov prediction. Two models only: the "
            "first escalates to the second with p(small->large) (bernoulli policy), the "
            "second writes one token and hands back; --commit defaults to that "
            "(small:small=1, large:small=1)."
        ),
        epilog="example (the paper's step times, 35 % escalation, B = 1..3 on the large model):"
        "\n  tokenrouter-ray simulate --step-ms small=6.0,large=27.9 --route-prob "
        "small:small=0.65,small:large=0.35,large:small=1 \\\n"
        "      --concurrency-levels 4,16 --batch-thresholds large=1-3",
    )
    _add_statistics(parser)
    add_concurrency_levels(parser, "4", "to run")
    batch = parser.add_argument(
        "--batch-thresholds",
        dest="thresholds",
        metavar="MODEL=B,...",
        help="B per model, one value, a list or a range per model, e.g. small=1,large=1,2,3 "
        "or large=1-4 or large=all (1..N); models not named use 1; inadmissible B are skipped",
    )
    deprecated_alias(parser, "--thresholds", batch)
    batch_in = parser.add_argument(
        "--batch-thresholds-in",
        dest="thresholds_in",
        metavar="FILE",
        type=Path,
        help="{model: [B at N=0..]} JSON, as tune --batch-thresholds-out writes it",
    )
    deprecated_alias(parser, "--thresholds-in", batch_in)
    parser.add_argument("--window-s", type=float, default=5.0, help="measurement window (s)")
    parser.add_argument("--warmup-s", type=float, default=1.0, help="warm-up before it (s)")
    parser.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="run every step this many times slower (less relative runtime overhead); "
        "throughput is reported in the profile's time base",
    )
    parser.add_argument("--max-defer-s", type=float, default=1.0, help="scheduler max_defer_s")
    parser.add_argument("--seed", type=int, default=0, help="request seeds (routing draws)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=run_simulate)


def _threshold_values(text: str, n: int, what: str) -> list[int]:
    values: list[int] = []
    for item in text.split("|"):
        item = item.strip()
        if item == "all":
            values += list(range(1, n + 1))
        else:
            values += _int_list(item, what)
    return sorted(set(values))


def _threshold_spec(text: str | None, names: tuple[str, ...]) -> dict[str, str]:
    """``small=1,large=1,2,3`` to ``{"small": "1", "large": "1|2|3"}`` (bare items continue
    the previous model's list)."""
    spec: dict[str, list[str]] = {}
    current: str | None = None
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, value = item.partition("=")
        if sep:
            current = key.strip()
            if current not in names:
                raise UserFacingError(
                    f"--batch-thresholds: unknown model {current!r} (models: {list(names)})"
                )
            spec.setdefault(current, []).append(value.strip())
        elif current is None:
            raise UserFacingError(f"--batch-thresholds: expected name=B, got {item!r}")
        else:
            spec[current].append(key.strip())
    return {k: "|".join(v) for k, v in spec.items()}


def _simulation_points(args: argparse.Namespace, profile: RoutingProfile, n: int) -> list[tuple]:
    names = profile.names
    if args.thresholds_in is not None:
        try:
            lists = json.loads(args.thresholds_in.read_text())
            point = tuple(
                ThresholdTable.of(lists[name]).at(n) if name in lists else 1 for name in names
            )
        except (OSError, ValueError, TypeError, KeyError, IndexError) as exc:
            raise UserFacingError(
                f"--batch-thresholds-in: cannot read {args.thresholds_in}: {exc}"
            ) from None
        return [point] if is_admissible(n, point) else []
    spec = _threshold_spec(args.thresholds, names)
    per_model = [
        _threshold_values(spec[name], n, "--batch-thresholds") if name in spec else [1]
        for name in names
    ]
    return [b for b in product(*per_model) if is_admissible(n, b)]


def _uniform_transit_ms(profile: RoutingProfile) -> float:
    """The one transit of every move between the two models (the simulated network delays
    every frame alike), 0 without; a per-pair transit is refused."""
    values = {v for i, row in enumerate(profile.transit_matrix()) for j, v in enumerate(row)
              if i != j and profile.route_prob[i][j] > 0}  # fmt: skip
    if len(values) > 1:
        raise UserFacingError(
            "simulate: --transit-ms must be one number (every frame is delayed alike)"
        )
    return values.pop() if values else 0.0


def run_simulate(args: argparse.Namespace) -> int:
    from tokenrouter_ray.simulation.backend import escalation_probability
    from tokenrouter_ray.simulation.loads import measure_closed_loop
    from tokenrouter_ray.tuning.search import evaluate

    def throughput(profile: RoutingProfile, n: int, b: tuple[int, ...]) -> Any:
        return evaluate(profile, n, [b])[0][0]  # exact, or Monte Carlo where it must

    if args.thresholds and args.thresholds_in:
        raise UserFacingError("give --batch-thresholds or --batch-thresholds-in, not both")
    profile = build_profile(args)
    try:
        escalation_probability(profile)
    except ValueError as exc:
        raise UserFacingError(str(exc)) from None
    if not args.window_s > 0 or args.warmup_s < 0 or not args.time_scale > 0:
        raise UserFacingError("--window-s and --time-scale must be > 0, --warmup-s >= 0")
    transit_s = _uniform_transit_ms(profile) / 1e3 * args.time_scale
    concurrencies = _int_list(args.concurrency, "--concurrency-levels")
    plan = {n: _simulation_points(args, profile, n) for n in concurrencies}
    if not any(plan.values()):
        raise UserFacingError("no admissible thresholds: need sum(B_i - 1) < N")
    names = profile.names
    results = []
    if not args.json:
        steps = " / ".join(f"{m.name} {m.step_time_ms(1):g} ms" for m in profile.models)
        print(
            f"simulated runtime: {steps}"
            f", p({names[0]}->{names[1]}) = {profile.route_prob[0][1]:g}, time scale "
            f"x{args.time_scale:g}, window {args.window_s:g} s after {args.warmup_s:g} s warm-up"
        )
        print(
            f"  {'N':>4}  {'B':<18} {'predicted':>10} {'measured':>10} {'diff':>7}"
            f"  {'p^':>6} {'pred@p^':>9}  mean batch"
        )
    for n, points in plan.items():
        if not points:
            print(f"  {n:>4}  (no admissible thresholds given: need sum(B_i - 1) < N)")
            continue
        for b in points:
            meas = measure_closed_loop(
                profile, n, b,
                window_s=args.window_s, warmup_s=args.warmup_s, time_scale=args.time_scale,
                seed=args.seed, max_defer_s=args.max_defer_s, transit_s=transit_s,
            )  # fmt: skip
            predicted = throughput(profile, n, b).throughput
            realized = throughput(meas.realized_profile(profile), n, b).throughput
            label = ",".join(f"{name}={v}" for name, v in zip(names, b, strict=True))
            entry = {
                "n": n,
                "thresholds": dict(zip(names, b, strict=True)),
                "predicted": round(predicted, 3),
                "measured": round(meas.throughput, 3),
                "escalation_rate": round(meas.escalation_rate, 4),
                "predicted_at_realized": round(realized, 3),
                "mean_batch": dict(zip(names, (round(x, 3) for x in meas.mean_batch), strict=True)),
                "steps": dict(zip(names, meas.steps, strict=True)),
                "window_s": round(meas.window_s, 3),
            }
            extra = ""
            if transit_s:
                at_measured = throughput(meas.measured_profile(profile), n, b).throughput
                entry["transit_ms_measured"] = {
                    f"{a}->{d}": round(v, 3) for (a, d), v in meas.transit_ms.items()
                }
                entry["predicted_at_measured"] = round(at_measured, 3)
                seen = " ".join(f"{a}->{d} {v:.2f}" for (a, d), v in meas.transit_ms.items())
                extra = f"  transit ms {seen}  pred@meas {at_measured:.1f}"
            results.append(entry)
            if not args.json:
                diff = 100 * (meas.throughput - predicted) / predicted
                batches = " ".join(f"{x:.2f}" for x in meas.mean_batch)
                print(
                    f"  {n:>4}  {label:<18} {predicted:10.1f} {meas.throughput:10.1f} "
                    f"{diff:+6.1f}%  {meas.escalation_rate:6.3f} {realized:9.1f}  {batches}"
                    f"{extra}",
                    flush=True,
                )
    if args.json:
        json.dump(results, sys.stdout, indent=2)
        sys.stdout.write("\n")
    return 0
