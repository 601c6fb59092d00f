"""The ``tokenrouter-ray plan`` command: replicas per model and GPUs for an offered load.

Input: the offered load (``--rate`` requests/s, ``--output-tokens``, ``--prompt-tokens``), the
routing (``--escalation Q`` for R2R's shape, or ``--route-prob`` / ``--commit``), step times
(``--step-profile paper | h200 | FILE``, the served simulation's profiles, or a ``--profile`` file
with routing and step times together), each replica's most rows per step (``--max-rows``,
the scheduler's ``max_num_seqs``), GPUs per replica and the targets (``--utilisation``,
``--tpot-ms``). Output: the plan of ``tuning/capacity.py`` (a table, or JSON with
``--json``): replicas, GPUs, rows per step, utilisation and busy share per model, the
predicted mean time per output token, and the thresholds the prediction assumes.
docs/user-guide/scaling.md compares a plan with the simulated runtime.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenrouter_ray.cli import deprecated_alias
from tokenrouter_ray.errors import UserFacingError
from tokenrouter_ray.tuning.commands import _pairs
from tokenrouter_ray.tuning.profile import (
    ModelProfile,
    RoutingProfile,
    profile_from_mapping,
    read_profile_file,
)

if TYPE_CHECKING:
    from tokenrouter_ray.tuning.capacity import Plan, Targets


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="replicas per model and GPUs for an offered load and a TPOT target",
        description=(
            "Plan replica counts for every model together from the routing, the step times "
            "and the offered load (docs/user-guide/scaling.md). Models in routing order, entry "
            "first."
        ),
        epilog="example (20 requests/s of 256-token answers, at most 40 ms per token):\n"
        "  tokenrouter-ray plan --rate 20 --output-tokens 256 --tpot-ms 40",
    )
    load = parser.add_argument_group("offered load")
    load.add_argument("--rate", type=float, required=True, help="requests per second")
    load.add_argument("--output-tokens", type=float, required=True, help="per request, mean")
    load.add_argument("--prompt-tokens", type=float, default=0.0, help="per request, mean")
    stats = parser.add_argument_group("routing and step times")
    step_profile = stats.add_argument(
        "--step-profile",
        dest="steps",
        metavar="PROFILE",
        default="paper",
        help="step times: paper | h200 | a profile file (the served simulation's profiles)",
    )
    deprecated_alias(stats, "--steps", step_profile)
    stats.add_argument(
        "--escalation",
        type=float,
        default=0.35,
        help="two models, R2R's shape: p(small->large); the large model writes one token "
        "(not used with --route-prob or --profile)",
    )
    stats.add_argument("--route-prob", help="p(src->dst) instead, e.g. a:a=0.6,a:b=0.4,b:a=1")
    stats.add_argument("--commit", help="tokens committed per move src:dst (with --route-prob)")
    stats.add_argument("--profile", type=Path, help="routing and step times from one file")
    stats.add_argument("--transit-ms", type=float, default=0.0, help="per handoff, one way")
    fleet = parser.add_argument_group("replicas")
    fleet.add_argument("--max-rows", help="most rows per step of a replica, e.g. small=64")
    fleet.add_argument("--gpus-per-replica", help="e.g. small=1,large=2 (default 1)")
    fleet.add_argument("--min-replicas", help="e.g. small=1,large=1 (default 1)")
    fleet.add_argument("--max-replicas", help="e.g. small=8,large=16 (default unbounded)")
    targets = parser.add_argument_group("targets")
    targets.add_argument(
        "--utilisation",
        default="0.7",
        help="rows per step against max rows, at most: one value or per model (small=0.8)",
    )
    targets.add_argument("--tpot-ms", type=float, help="mean time per output token, at most")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=run_plan)


def step_models(steps: str) -> list[ModelProfile]:
    from tokenrouter_ray.simulation.served import profile_models

    try:
        return profile_models(steps)
    except ValueError as exc:
        raise UserFacingError(str(exc)) from None


def routing_profile(args: argparse.Namespace) -> RoutingProfile:
    """The profile the arguments describe: a --profile file, or --steps with the routing."""
    if args.profile is not None:
        return profile_from_mapping(read_profile_file(args.profile))
    models = step_models(args.steps)
    names = [m.name for m in models]
    if args.route_prob:
        return profile_from_mapping(
            {
                "models": {m.name: {"step_ms": dict(m.step_ms)} for m in models},
                "route_prob": _pairs(args.route_prob, "--route-prob"),
                "commit": _pairs(args.commit, "--commit"),
            }
        )
    if len(models) != 2:
        raise UserFacingError(f"--escalation needs two models; {args.steps} has {names}")
    q = args.escalation
    if not 0 <= q <= 1:
        raise UserFacingError(f"--escalation must be a probability, got {q}")
    return RoutingProfile(tuple(models), ((1 - q, q), (1.0, 0.0)), ((1.0, 0.0), (1.0, 0.0)))


def _numbers(text: str | None, what: str, names: tuple[str, ...], kind: type) -> dict[str, Any]:
    out = {}
    for name, value in _pairs(text, what).items():
        if name not in names:
            raise UserFacingError(f"{what}: unknown model {name!r} (models: {list(names)})")
        try:
            out[name] = kind(value)
        except ValueError:
            raise UserFacingError(f"{what}: {name}={value!r} is not a number") from None
    return out


def run_plan(args: argparse.Namespace) -> int:
    from tokenrouter_ray.tuning.capacity import Load, Targets, plan

    profile = routing_profile(args)
    names = profile.names
    try:
        load = Load(args.rate, args.output_tokens, args.prompt_tokens)
    except ValueError as exc:
        raise UserFacingError(str(exc)) from None
    if "=" in args.utilisation:
        utilisation = _numbers(args.utilisation, "--utilisation", names, float)
        missing = set(names) - set(utilisation)
        if missing:
            raise UserFacingError(f"--utilisation: no target for {sorted(missing)}")
    else:
        try:
            utilisation = {m: float(args.utilisation) for m in names}
        except ValueError:
            raise UserFacingError(f"--utilisation: {args.utilisation!r} is not a number") from None
    if not all(0 < u <= 1 for u in utilisation.values()):
        raise UserFacingError("--utilisation: targets must lie in (0, 1]")
    if args.tpot_ms is not None and not args.tpot_ms > 0:
        raise UserFacingError("--tpot-ms must be positive")
    targets = Targets(
        utilisation=utilisation,
        tpot_s=args.tpot_ms / 1e3 if args.tpot_ms is not None else None,
        min_replicas=_numbers(args.min_replicas, "--min-replicas", names, int),
        max_replicas=_numbers(args.max_replicas, "--max-replicas", names, int),
        gpus_per_replica=_numbers(args.gpus_per_replica, "--gpus-per-replica", names, float),
    )
    max_rows = _numbers(args.max_rows, "--max-rows", names, int)
    try:
        result = plan(profile, load, targets, max_rows, args.transit_ms / 1e3)
    except ValueError as exc:
        raise UserFacingError(str(exc)) from None
    if args.json:
        print(json.dumps(plan_to_json(result, targets), indent=2))
    else:
        print(format_plan(result, targets))
    return 0 if result.feasible else 1


def plan_to_json(result: Plan, targets: Targets) -> dict[str, Any]:
    p = result.prediction
    return {
        "feasible": result.feasible,
        "reason": result.reason,
        "replicas": result.replicas,
        "gpus": result.gpus,
        "thresholds": {m: 1 for m in result.replicas},
        "tpot_ms": 1e3 * p.tpot_s if math.isfinite(p.tpot_s) else None,
        "mean_active": p.mean_active if math.isfinite(p.mean_active) else None,
        "offered_tokens_per_s": p.load.tokens_per_s,
        "max_tokens_per_s": p.max_tokens_per_s,
        "rows_per_step": p.rows,
        "utilisation": p.utilisation,
        "busy": p.busy,
        "targets": {"utilisation": dict(targets.utilisation), "tpot_ms": _ms(targets.tpot_s)},
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1e3 * seconds


def format_plan(result: Plan, targets: Targets) -> str:
    p = result.prediction
    lines = [
        f"offered: {p.load.arrival_rate:g} requests/s x {p.load.output_tokens:g} tokens = "
        f"{p.load.tokens_per_s:,.0f} tokens/s",
        f"{'model':<12} {'replicas':>8} {'rows/step':>10} {'utilisation':>12} {'busy':>6}",
    ]
    for m, r in result.replicas.items():
        lines.append(
            f"{m:<12} {r:>8} {p.rows[m]:>10.2f} {p.utilisation[m]:>8.2f} (<= "
            f"{targets.utilisation[m]:.2f}) {p.busy[m]:>5.2f}"
        )
    tpot = f"{1e3 * p.tpot_s:.2f} ms" if math.isfinite(p.tpot_s) else "unbounded (unstable)"
    goal = f" (target {1e3 * targets.tpot_s:.2f} ms)" if targets.tpot_s is not None else ""
    lines += [
        f"predicted mean time per output token: {tpot}{goal}",
        f"mean active requests: {p.mean_active:.1f}; the most these replicas commit: "
        f"{p.max_tokens_per_s:,.0f} tokens/s",
        "thresholds: 1 per model (eager launch, what the prediction assumes; the live tuner "
        "defers only where it predicts a gain)",
        f"GPUs: {result.gpus:g}",
        ("feasible" if result.feasible else "NOT feasible") + f": {result.reason}",
    ]
    return "\n".join(lines)
