"""``tokenrouter-ray calibrate``: sweep a policy's threshold over a dev split of a task set
through the served API, and choose an operating point that is reported on a test split.

Each threshold is sent per request (the ``routing: {"threshold": x}`` extension, so one
served app covers the whole sweep). Per point: accuracy with its interval, the large
model's token share, the routing probabilities the responses imply and the throughput the
Markov model predicts for them at a step-time profile with the tuner's best thresholds
(``frontier.py``). The Pareto points are marked, the frontier drawn (PNG), and a target
(``--min-accuracy-of-large``, ``--max-large-share``) picks a point on the dev split only;
that point (and the large model alone, as the reference) is then scored on the disjoint
test split, which is what the report quotes. ``--check-sim K`` runs K chosen points'
induced routing on the simulated runtime (the real scheduler and step loops on simulated
models, ``simulation/loads.py``) and prints measured against predicted tok/s.

Data enters as task items and HTTP responses (``evaluate.run_eval``); it leaves as a
table on stdout, a JSON report (``--out``) and a PNG (``--plot``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenrouter_ray.cli import deprecated_alias
from tokenrouter_ray.errors import UserFacingError
from tokenrouter_ray.quality.frontier import (
    FrontierPoint,
    RoutingCounts,
    choose,
    induced_profile,
    mark_pareto,
    plot_frontier,
    predict_throughput,
    route_probs,
    sum_counts,
)
from tokenrouter_ray.tuning.profile import ModelProfile, RoutingProfile

# The config key each policy's per-request threshold stands for (docs/reference/api.md).
OVERRIDE_KEY = {
    "r2r": "threshold",
    "entropy": "threshold",
    "citer": "threshold",
    "co_llm": "eta",
    "rstitch": "tau",
    "glimprouter": "tau",
    "escalation": "tau",
    "bernoulli": "p",
}


def parse_thresholds(text: str) -> list[float]:
    try:
        values = sorted({float(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise UserFacingError(f"--thresholds: not a list of numbers: {text!r}") from None
    if not values:
        raise UserFacingError("--thresholds: give at least one value")
    return values


def counts_of(result: Any) -> RoutingCounts:
    """Routing counts summed over a system result's answered items."""
    return sum_counts(
        RoutingCounts.of_response(
            list((item.tokens_per_model or {}).values()), item.handoffs or 0, item.dropped
        )
        for item in result.items
        if item.error is None and item.tokens_per_model
    )


def point_of(threshold: float, result: Any, step_models: Sequence[Any], n: int) -> FrontierPoint:
    counts = counts_of(result)
    profile = induced_profile(counts, step_models)
    answered = max(1, result.n - result.failures)
    point = FrontierPoint(
        threshold=threshold,
        n=result.n,
        correct=result.correct,
        accuracy=result.accuracy,
        interval=tuple(result.interval),
        large_share=counts.large_share,
        handoffs_per_request=(counts.to_large + counts.to_small) / answered,
        route_prob=route_probs(profile),
        failures=result.failures,
    )
    if counts.small_tokens + counts.large_tokens:
        point.predicted = predict_throughput(profile, n)
    return point


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "calibrate",
        help="sweep a policy's threshold on a dev split: accuracy vs large share vs speed",
        description=(
            "Sweep the served policy's threshold per request over a dev split, mark the "
            "Pareto points, draw the frontier and choose a point for a target; the choice is "
            "reported on the disjoint test split (docs/user-guide/quality.md)."
        ),
        epilog="example (a served R2R app, the large model alone as the reference):\n"
        "  tokenrouter-ray calibrate --large threshold:0 --min-accuracy-of-large 0.95",
    )
    parser.add_argument(
        "--system",
        default="http://127.0.0.1:8000/v1@tokenrouter",
        help="the routed app: URL[@MODEL]",
    )
    parser.add_argument(
        "--large",
        help="the large model alone, the reference: URL[@MODEL], or threshold:X for the "
        "routed system at a threshold that sends every position to it (R2R: threshold:0)",
    )
    parser.add_argument(
        "--small", help="the small model alone, for the table and plot (URL[@MODEL] or threshold:X)"
    )
    parser.add_argument(
        "--policy",
        default="r2r",
        choices=sorted(OVERRIDE_KEY),
        help="the served policy (names the config key of the override)",
    )
    parser.add_argument(
        "--thresholds",
        default="0.02,0.05,0.1,0.2,0.3,0.5,0.7,0.9",
        help="the routing thresholds to sweep, comma-separated",
    )
    parser.add_argument("--tasks", default="builtin:demo", help="JSONL file or builtin:NAME")
    parser.add_argument("--limit", type=int, help="at most this many items per split")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    parser.add_argument("--max-tokens", type=int, default=32, help="completion tokens at most")
    parser.add_argument("--seed", type=int, default=0, help="the requests' seed")
    parser.add_argument(
        "--step-profile",
        default="paper",
        help="step times for the predicted throughput: paper | h200 | FILE",
    )
    parser.add_argument(
        "--at-concurrency",
        type=int,
        default=32,
        help="active requests N the throughput is predicted at",
    )
    target = parser.add_mutually_exclusive_group()
    target.add_argument(
        "--min-accuracy-of-large",
        type=float,
        help="fewest large tokens keeping this fraction of the large model's "
        "accuracy (needs --large)",
    )
    target.add_argument(
        "--max-large-share", type=float, help="most accurate point with at most this large share"
    )
    parser.add_argument(
        "--check-sim",
        type=int,
        default=0,
        metavar="K",
        help="run K points' induced routing on the simulated runtime",
    )
    parser.add_argument(
        "--check-sim-scale",
        type=float,
        default=(1.0, 4.0),
        nargs="+",
        metavar="S",
        help="step times x S for the simulated runtime (tok/s scaled back): at 1 the "
        "runtime's own host cost per step counts, at 4 it weighs a quarter as much "
        "(default: both)",
    )
    parser.add_argument("--out", type=Path, help="write the report as JSON")
    parser.add_argument("--plot", type=Path, help="draw the frontier (PNG)")
    parser.add_argument(
        "--judge",
        metavar="MODEL_DIR",
        help="for a task set without answers: the large model's directory; answers are "
        "scored by teacher-forced agreement with it (quality/judge.py)",
    )
    quiet = parser.add_argument("--quiet", action="store_true", help="no progress bar")
    deprecated_alias(parser, "--no-progress", quiet)
    parser.set_defaults(func=run_calibrate)


def _system(text: str) -> tuple[str, str]:
    from tokenrouter_ray.quality.commands import parse_system

    _, url, model = parse_system(f"x={text}")
    return url, model


def _reference(text: str, routed: tuple[str, str]) -> tuple[tuple[str, str], float | None]:
    """A reference system: ``threshold:X`` is the routed system at threshold X (R2R at 0
    sends every position to the large model, at 1 none), else URL[@MODEL] as it serves."""
    if text.startswith("threshold:"):
        try:
            return routed, float(text.removeprefix("threshold:"))
        except ValueError:
            raise UserFacingError(f"not a threshold: {text!r}") from None
    return _system(text), None


def run_calibrate(args: argparse.Namespace) -> int:
    return asyncio.run(calibrate(args))


async def calibrate(args: argparse.Namespace) -> int:
    from tokenrouter_ray.quality.commands import load_items, make_judge
    from tokenrouter_ray.quality.evaluate import run_eval
    from tokenrouter_ray.quality.judge import judged
    from tokenrouter_ray.quality.tasks import split_items
    from tokenrouter_ray.simulation.served import profile_models

    if args.min_accuracy_of_large is not None and not args.large:
        raise UserFacingError("--min-accuracy-of-large needs --large (the reference system)")
    thresholds = parse_thresholds(args.thresholds)
    try:
        step_models = profile_models(args.step_profile)
    except ValueError as exc:
        raise UserFacingError(str(exc)) from None
    items = load_items(args.tasks)
    dev, test = split_items(items, "dev"), split_items(items, "test")
    if args.limit:
        dev, test = dev[: args.limit], test[: args.limit]
    if not dev or not test:
        raise UserFacingError(f"{args.tasks}: need items in both the dev and the test split")
    url, model = _system(args.system)
    judge = make_judge(items, args.judge)  # a set without answers: agreement, not accuracy
    common = dict(
        concurrency=args.concurrency,
        seed=args.seed,
        max_tokens=args.max_tokens,
        progress=not args.quiet,
    )

    async def run(on: list, where: tuple[str, str], threshold: float | None, label: str) -> Any:
        extra = None if threshold is None else {"routing": {"threshold": threshold}}
        result = await run_eval(where[0], where[1], on, extra_body=extra, **common)
        if judge is not None:
            result = await asyncio.to_thread(judged, result, on, judge)
        result.label = label
        return result

    references: dict[str, Any] = {}
    for name in ("large", "small"):
        if getattr(args, name):
            where, at = _reference(getattr(args, name), (url, model))
            references[name] = await run(dev, where, at, f"{name} (dev)")
    points = []
    for t in thresholds:
        result = await run(dev, (url, model), t, f"{args.policy} {t:g} (dev)")
        points.append(point_of(t, result, step_models, args.at_concurrency))
    mark_pareto(points)
    large_dev = references["large"].accuracy if "large" in references else None
    chosen = choose(points, large_dev, args.min_accuracy_of_large, args.max_large_share)
    report: dict[str, Any] = {
        "policy": args.policy,
        "tasks": args.tasks,
        "step_profile": args.step_profile,
        "at_concurrency": args.at_concurrency,
        "dev": {"n": len(dev), "points": [p.to_json() for p in points]},
        "references_dev": {k: _summary(r) for k, r in references.items()},
    }
    print(format_points(points, references, f"dev split ({len(dev)} items)"))
    if chosen is None:
        print("\nno swept threshold meets the target on the dev split")
    else:
        test_result = await run(test, (url, model), chosen.threshold, "chosen (test)")
        test_point = point_of(chosen.threshold, test_result, step_models, args.at_concurrency)
        large_test = None
        if args.large:
            where, at = _reference(args.large, (url, model))
            large_test = await run(test, where, at, "large (test)")
        report["chosen"] = {
            "threshold": chosen.threshold,
            "dev": chosen.to_json(),
            "test": test_point.to_json(),
            "large_test": _summary(large_test) if large_test else None,
            "holds": _holds(chosen, test_point),
            "override": {
                "config": f"policy.options.{OVERRIDE_KEY[args.policy]}={chosen.threshold:g}",
                "request": {"routing": {"threshold": chosen.threshold}},
            },
        }
        print(format_choice(report["chosen"], chosen, test_point, large_test))
    if args.check_sim:
        report["sim_check"] = check_sim(
            points, step_models, args.at_concurrency, args.check_sim, args.check_sim_scale
        )
        print(format_sim_check(report["sim_check"]))
    if args.plot:
        refs = {f"{k} alone (dev)": r.accuracy for k, r in references.items()}
        plot_frontier(points, args.plot, f"{args.policy}: {args.tasks}, dev split", refs, chosen)
        print(f"\nfrontier: {args.plot}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"report: {args.out}")
    return 0


def _summary(result: Any) -> dict[str, Any]:
    return {
        "n": result.n,
        "correct": result.correct,
        "accuracy": result.accuracy,
        "interval": list(result.interval),
        "large_share": result.large_share,
        "failures": result.failures,
    }


def _holds(dev: FrontierPoint, test: FrontierPoint) -> bool:
    """The dev accuracy the choice was made on lies within the test split's interval."""
    return test.interval[0] <= dev.accuracy <= test.interval[1]


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:5.1f} %"


def format_points(points: Sequence[FrontierPoint], refs: dict[str, Any], title: str) -> str:
    lines = [
        title,
        f"{'':>2} {'threshold':>9}  {'accuracy':>8}  {'95 % interval':>15}  "
        f"{'large':>7}  {'p(s->l)':>7}  {'predicted tok/s (B)':>22}",
    ]
    for name, r in refs.items():
        lo, hi = r.interval
        lines.append(
            f"{'':>2} {name + ' alone':>9}  {_pct(r.accuracy)}  "
            f"[{_pct(lo)}, {_pct(hi)}]  {_pct(r.large_share)}"
        )
    for p in points:
        lo, hi = p.interval
        speed = "-"
        if p.predicted is not None:
            bs = ",".join(f"{v}" for v in p.predicted.thresholds.values())
            speed = f"{p.predicted.tokens_per_s:8.1f} ({bs})"
        lines.append(
            f"{'*' if p.pareto else ' ':>2} {p.threshold:>9g}  {_pct(p.accuracy)}  "
            f"[{_pct(lo)}, {_pct(hi)}]  {_pct(p.large_share)}  "
            f"{p.route_prob['small->large']:7.3f}  {speed:>22}"
        )
    lines.append("(* Pareto: no other point is as accurate with fewer large-model tokens)")
    return "\n".join(lines)


def format_choice(
    chosen: dict[str, Any], dev: FrontierPoint, test: FrontierPoint, large_test: Any
) -> str:
    lo, hi = test.interval
    lines = [
        "",
        f"chosen on dev: threshold {dev.threshold:g} (dev accuracy {_pct(dev.accuracy)}, "
        f"large share {_pct(dev.large_share)})",
        f"on the test split: accuracy {_pct(test.accuracy)} [{_pct(lo)}, {_pct(hi)}], "
        f"large share {_pct(test.large_share)}; dev accuracy inside the test interval: "
        f"{'yes' if chosen['holds'] else 'NO'}",
    ]
    if large_test is not None:
        lines.append(f"large model alone on the test split: {_pct(large_test.accuracy)}")
    lines.append(
        f"override: {chosen['override']['config']}   "
        f"(per request: {json.dumps(chosen['override']['request'])})"
    )
    return "\n".join(lines)


def check_sim(
    points: Sequence[FrontierPoint],
    step_models: Sequence[Any],
    n: int,
    k: int,
    time_scales: Sequence[float] = (1.0,),
    window_s: float = 8.0,
) -> list[dict[str, Any]]:
    """Run the induced routing of ``k`` points (the Pareto ones first) on the simulated
    runtime at the tuner's thresholds, at each of ``time_scales`` (step times multiplied,
    tok/s scaled back); measured against predicted tok/s. The Markov model has no host
    cost; at scale 1 the runtime's own per-step cost counts in full, at larger scales it
    shrinks next to the steps, so the two rows tell the model's error from the host's.
    ``window_s``: measured seconds per row at scale 1 (longer in proportion to the scale)."""
    from tokenrouter_ray.simulation.loads import measure_closed_loop

    ranked = sorted(points, key=lambda p: (not p.pareto, p.large_share))
    out = []
    for p in [q for q in ranked if q.predicted is not None][:k]:
        q = p.route_prob["small->large"]
        profile = escalate_once(q, step_models)
        b = tuple(p.predicted.thresholds.values())
        predicted = predict_throughput(profile, n).tokens_per_s
        for scale in time_scales:
            meas = measure_closed_loop(
                profile, n, b, window_s=window_s * scale, warmup_s=1.0, time_scale=scale
            )
            out.append(
                {
                    "threshold": p.threshold,
                    "p_small_large": q,
                    "thresholds": list(b),
                    "time_scale": scale,
                    "predicted_tok_s": predicted,
                    "measured_tok_s": meas.throughput,
                    "ratio": meas.throughput / predicted if predicted else None,
                }
            )
    return out


def escalate_once(q: float, step_models: Sequence[Any]) -> RoutingProfile:
    """The bernoulli policy's profile at p(small->large) = q: the small proposal dropped,
    the large model writes one token and hands back (what the simulated runtime runs)."""
    small, large = step_models[0], step_models[1]
    return RoutingProfile(
        (ModelProfile("small", small.step_ms), ModelProfile("large", large.step_ms)),
        ((1.0 - q, q), (1.0, 0.0)),
        ((1.0, 0.0), (1.0, 0.0)),
        0.5,
    )


def format_sim_check(rows: Sequence[dict[str, Any]]) -> str:
    lines = ["", "simulated runtime (escalate-once at each point's p, tuner's B):"]
    for r in rows:
        ok = r["ratio"] is not None and abs(r["ratio"] - 1) <= 0.05
        lines.append(
            f"  threshold {r['threshold']:g}: p={r['p_small_large']:.3f} B={r['thresholds']} "
            f"steps x{r.get('time_scale', 1.0):g}: "
            f"predicted {r['predicted_tok_s']:.1f} measured {r['measured_tok_s']:.1f} tok/s "
            f"({r['ratio']:.3f}) {'PASS' if ok else 'MISS'} (target within 5 %)"
        )
    return "\n".join(lines)
