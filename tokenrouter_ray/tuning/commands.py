"""The ``tokenrouter-ray tune`` and ``simulate`` commands.

``tune`` solves deferred-batching thresholds from statistics.

Statistics come either inline (``--step-ms``, ``--route-prob``, ``--commit``) or from a
``--profile`` JSON/YAML file (format in docs/user-guide/tuning.md). For each ``--concurrency`` N the
command sweeps the free thresholds, prints the predicted throughput of every B and the best
one (a table, or JSON with ``--json``), and with ``--thresholds-out`` writes the per-model
threshold lists (index = active requests) a scheduler config takes.

``simulate`` runs the real runtime (``LocalRuntime``: scheduler, model replicas, protocol) on
simulated engines that sleep for the profiled step time (``sim_backend``), N requests in a
closed loop, and prints the measured committed tokens/s next to the prediction, for
capacity planning. It supports two-model escalate-once routing (small -> large with
probability p, the large model writes one token and hands back), the ``bernoulli`` policy.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenrouter_ray.cli import deprecated_alias
from tokenrouter_ray.errors import UserFacingError
from tokenrouter_ray.tuning.methods import METHODS, MonteCarloConfig
from tokenrouter_ray.tuning.profile import (
    RoutingProfile,
    models_from_mapping,
    profile_from_mapping,
    read_profile_file,
)

if TYPE_CHECKING:
    from tokenrouter_ray.tuning.search import SweepResult


def _add_statistics(parser: argparse.ArgumentParser) -> None:
    source = parser.add_argument_group(
        "statistics (inline, or --profile; --route-prob/--commit may complete a profile file "
        "that holds only step times, as `tokenrouter-ray profile` writes it)"
    )
    source.add_argument("--profile", type=Path, help="JSON or YAML profile file")
    source.add_argument("--step-ms", help="step time per model, e.g. small=6.0,large=27.9")
    source.add_argument(
        "--route-prob",
        help="p(src->dst), e.g. small:small=0.65,small:large=0.35,large:small=1 (missing = 0)",
    )
    source.add_argument(
        "--commit",
        help="tokens committed per move src:dst (missing = 0); default with two models: "
        "a:a=1,b:a=1 (the second writes one token and hands back)",
    )
    source.add_argument("--grain-ms", type=float, help="time grain delta in ms (default 0.1)")
    source.add_argument(
        "--transit-ms",
        help="time a request moving between two models spends in transit: one number for "
        "every move, or src:dst=ms pairs (missing = 0); replaces the profile's transit_ms",
    )


def add_concurrency_levels(parser: argparse.ArgumentParser, default: str, purpose: str) -> None:
    """``--concurrency-levels N,...`` (``args.concurrency``; ``--concurrency`` deprecated)."""
    levels = parser.add_argument(
        "--concurrency-levels",
        dest="concurrency",
        metavar="N,...",
        default=default,
        help=f"active-request counts N {purpose}, e.g. 1,4,16 or 1-16",
    )
    deprecated_alias(parser, "--concurrency", levels)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "tune",
        help="predict throughput per batching threshold B and pick the best per concurrency",
        description=(
            "Solve the deferred-batching Markov model (docs/user-guide/tuning.md). Models are "
            "given in "
            "--step-ms order (or the profile's order); requests enter at the first one."
        ),
        epilog="example (the paper's step times, 35 % of positions escalated):\n"
        "  tokenrouter-ray tune --step-ms small=6.0,large=27.9 \\\n"
        "      --route-prob small:small=0.65,small:large=0.35,large:small=1",
    )
    _add_statistics(parser)
    add_concurrency_levels(parser, "1,2,4,8,16", "to tune for")
    parser.add_argument("--fix", help="thresholds held fixed, e.g. small=1")
    parser.add_argument(
        "--replicas",
        help="data-parallel replicas per model, e.g. large=2 (B is per replica; admissible "
        "iff sum R_i (B_i - 1) < N; solved by Monte Carlo)",
    )
    parser.add_argument(
        "--method",
        choices=METHODS,
        default="auto",
        help="how the model is solved: exact (the Markov chain), Monte Carlo, or auto "
        "(exact where the state space is small enough)",
    )
    parser.add_argument(
        "--patience",
        type=int,
        help="stop a model's sweep after this many B in a row below its best (default: all B)",
    )
    parser.add_argument(
        "--mc-replicas",
        type=int,
        default=MonteCarloConfig.replicas,
        help="Monte Carlo: independent copies of the chain per candidate",
    )
    parser.add_argument(
        "--mc-events",
        type=int,
        default=MonteCarloConfig.events,
        help="Monte Carlo: batch completions measured per copy",
    )
    parser.add_argument("--seed", type=int, default=0, help="Monte Carlo seed")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    out = parser.add_argument(
        "--batch-thresholds-out",
        dest="thresholds_out",
        metavar="FILE",
        type=Path,
        help="write the chosen B per model as {model: [B at N=0..max]} JSON here",
    )
    deprecated_alias(parser, "--thresholds-out", out)
    parser.set_defaults(func=run_tune)


def _pairs(text: str | None, what: str) -> dict[str, str]:
    """``a=1,b=2`` to ``{"a": "1", "b": "2"}``, keeping order."""
    out: dict[str, str] = {}
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise UserFacingError(f"{what}: expected name=value, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def _int_list(text: str, what: str) -> list[int]:
    values: list[int] = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        lo, dash, hi = item.partition("-")
        try:
            values += list(range(int(lo), int(hi) + 1)) if dash else [int(item)]
        except ValueError:
            raise UserFacingError(f"{what}: {item!r} is not an integer or range") from None
    if not values or min(values) < 1:
        raise UserFacingError(f"{what}: need positive integers, got {text!r}")
    return sorted(set(values))


def _inline_profile(args: argparse.Namespace) -> RoutingProfile:
    if not args.step_ms or not args.route_prob:
        raise UserFacingError("give --profile FILE, or both --step-ms and --route-prob")
    models: dict[str, Any] = {}
    for name, ms in _pairs(args.step_ms, "--step-ms").items():
        try:
            models[name] = {"step_ms": float(ms)}
        except ValueError:
            raise UserFacingError(f"--step-ms: {name}={ms!r} is not a number") from None
    return profile_from_mapping(
        {
            "models": models,
            "route_prob": _pairs(args.route_prob, "--route-prob"),
            "commit": _commits(args.commit, list(models)),
        }
    )


def _commits(text: str | None, names: list[str]) -> dict[str, str]:
    """``--commit``; left out with two models, R2R's shape: each escalation commits one token
    of the second model, every other step one token of the first (a:a=1, b:a=1)."""
    if text is None and len(names) == 2:
        first, second = names
        return {f"{first}:{first}": "1", f"{second}:{first}": "1"}
    return _pairs(text, "--commit")


def build_profile(args: argparse.Namespace) -> RoutingProfile:
    """The profile the arguments describe (file or inline), with --grain-ms applied."""
    if args.profile is not None:
        if args.step_ms:
            raise UserFacingError("--profile replaces --step-ms")
        data = read_profile_file(args.profile)
        if args.route_prob:  # step times from the file (`profile`), routing given here
            data["route_prob"] = _pairs(args.route_prob, "--route-prob")
            names = [m.name for m in models_from_mapping(data)]
            data["commit"] = _commits(args.commit, names)
        elif args.commit:
            raise UserFacingError("--commit with --profile needs --route-prob too")
        profile = profile_from_mapping(data)
    else:
        profile = _inline_profile(args)
    if not any(any(row) for row in profile.commit):
        raise UserFacingError("every commit count is 0: nothing would ever be committed")
    if args.grain_ms is not None:
        if not args.grain_ms > 0:
            raise UserFacingError(f"--grain-ms must be positive, got {args.grain_ms}")
        profile = profile.with_grain(args.grain_ms)
    if getattr(args, "transit_ms", None):
        profile = _with_transit(profile, args.transit_ms)
    return profile


def _with_transit(profile: RoutingProfile, text: str) -> RoutingProfile:
    """``--transit-ms``: one number (every move between two models) or ``src:dst=ms`` pairs."""
    try:
        if ":" not in text:
            return profile.with_transit(float(text))
        names = profile.names
        matrix = [[0.0] * len(names) for _ in names]
        for key, value in _pairs(text, "--transit-ms").items():
            src, _, dst = key.partition(":")
            if src not in names or dst not in names:
                raise UserFacingError(f"--transit-ms: unknown model in {key!r} (models: {names})")
            matrix[names.index(src)][names.index(dst)] = float(value)
        return profile.with_transit(matrix)
    except ValueError as exc:
        raise UserFacingError(f"--transit-ms: {exc}") from None


def _fixed(args: argparse.Namespace, profile: RoutingProfile) -> dict[str, int]:
    fixed = {}
    for name, value in _pairs(args.fix, "--fix").items():
        if name not in profile.names:
            raise UserFacingError(f"--fix: unknown model {name!r} (models: {list(profile.names)})")
        try:
            fixed[name] = int(value)
        except ValueError:
            raise UserFacingError(f"--fix: {name}={value!r} is not an integer") from None
    return fixed


def results_to_json(results: Mapping[int, SweepResult]) -> dict[str, Any]:
    """``{"<N>": {"best": {model: B}, "throughput": {label: tok/s}, "method": ...}}``."""
    out: dict[str, Any] = {}
    for n, result in results.items():
        entry: dict[str, Any] = {
            "best": result.best_by_name(),
            "throughput": {result.point_label(p): round(p.throughput, 3) for p in result.points},
            "method": result.method,
        }
        if result.method == "monte-carlo":
            entry["stderr"] = {
                result.point_label(p): round(p.stderr or 0.0, 3) for p in result.points
            }
        out[str(n)] = entry
    return out


def format_table(results: Mapping[int, SweepResult]) -> str:
    lines = []
    for n, result in results.items():
        free = ",".join(result.names[i] for i in result.free) or "(none free)"
        lines.append(f"N={n}  sweeping B[{free}]  {result.method}, {result.elapsed_s:.2f} s")
        best = result.best
        for point in result.points:
            label = result.point_label(point)
            label = f"B[{free}]={label}" if len(result.free) == 1 else label
            extra = (
                f"+/- {point.stderr:7.2f}"
                if point.stderr is not None
                else f"{point.num_states:>8} states"
            )
            mark = "  <- best" if point is best else ""
            lines.append(f"  {label:<20} {point.throughput:11.2f} tok/s  {extra}{mark}")
    lines.append("")
    lines.append("best thresholds:")
    for n, result in results.items():
        chosen = " ".join(f"{k}={v}" for k, v in result.best_by_name().items())
        lines.append(f"  N={n:<4} {chosen}   ({result.best.throughput:.2f} tok/s)")
    return "\n".join(lines)


def run_tune(args: argparse.Namespace) -> int:
    from tokenrouter_ray.tuning.search import threshold_lists, tune

    profile = build_profile(args)
    concurrencies = _int_list(args.concurrency, "--concurrency-levels")
    fixed = _fixed(args, profile)
    if args.patience is not None and args.patience < 1:
        raise UserFacingError("--patience must be >= 1")
    if args.mc_replicas < 2 or args.mc_events < 1:
        raise UserFacingError("--mc-replicas must be >= 2 and --mc-events >= 1")
    mc_config = MonteCarloConfig(replicas=args.mc_replicas, events=args.mc_events, seed=args.seed)
    replicas = {}
    for name, value in _pairs(args.replicas, "--replicas").items():
        if name not in profile.names or not value.isdigit() or int(value) < 1:
            raise UserFacingError(f"--replicas: need model=count >= 1, got {name}={value}")
        replicas[name] = int(value)
    try:
        results = tune(
            profile, concurrencies, fixed, args.method, args.patience, mc_config, replicas
        )
    except ValueError as exc:
        raise UserFacingError(str(exc)) from None
    if args.json:
        json.dump(results_to_json(results), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(format_table(results))
    if args.thresholds_out is not None:
        lists = threshold_lists(results)
        args.thresholds_out.write_text(json.dumps(lists, indent=2) + "\n")
    return 0


# ---------------------------------------------------------------------------- simulate
