"""The ``tokenrouter-ray eval`` command: score served systems on a task set.

Systems come as ``--system LABEL=URL[@MODEL]`` (repeatable), tasks as ``--tasks`` (a JSONL
path or ``builtin:NAME``). Each system answers the chosen split through `run_eval`; the
command prints one table row per system (accuracy with its Wilson 95 % interval, n, the
large model's token share, handoffs per request, output tokens/s, failures) and with
``--out`` writes everything, per-item answers included, as JSON. ``--write-tasks SPEC
--out FILE.jsonl`` writes a task set as JSONL instead (to read or edit it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenrouter_ray.cli import deprecated_alias
from tokenrouter_ray.errors import UserFacingError
from tokenrouter_ray.quality.builtin import builtin_names, tasks_from_spec
from tokenrouter_ray.quality.evaluate import SystemResult, run_eval
from tokenrouter_ray.quality.judge import TeacherForcedJudge, judged, needs_judge
from tokenrouter_ray.quality.task_files import write_tasks
from tokenrouter_ray.quality.tasks import SPLITS, TaskItem, split_items

DEFAULT_SYSTEM = "served=http://127.0.0.1:8000/v1@tokenrouter"
DEFAULT_MODEL = "tokenrouter"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "eval",
        help="score served systems' answers on a task set (accuracy, large share, tok/s)",
        description=(
            "Send every task item to each --system (OpenAI API, no retries), score the "
            "answers, and report accuracy with a Wilson 95% interval, the large model's "
            "share of the routed tokens, handoffs and throughput."
        ),
        epilog="example (the served app on the capital-city questions, wrong answers shown):\n"
        "  tokenrouter-ray eval --tasks builtin:capitals --answers",
    )
    parser.add_argument(
        "--system",
        action="append",
        metavar="LABEL=URL[@MODEL]",
        help=f"a system to score (repeatable; default {DEFAULT_SYSTEM}; "
        f"the model follows the last '@', default {DEFAULT_MODEL})",
    )
    parser.add_argument(
        "--tasks",
        default="builtin:demo",
        help=f"a JSONL file or builtin:NAME ({', '.join(builtin_names())}); default builtin:demo",
    )
    parser.add_argument(
        "--split", choices=SPLITS, default="test", help="which items (default test)"
    )
    parser.add_argument("--limit", type=int, help="the first N items of the split only")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    parser.add_argument("--seed", type=int, default=0, help="the requests' seed")
    parser.add_argument("--max-tokens", type=int, default=32, help="completion tokens at most")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument(
        "--extra-body",
        help='JSON merged into every request, e.g. \'{"routing": {"threshold": 0.3}}\'',
    )
    parser.add_argument("--api-key", default="none", help="sent as the bearer token")
    parser.add_argument(
        "--completions",
        action="store_true",
        help="send prompts to /v1/completions instead of the chat endpoint",
    )
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--answers", action="store_true", help="print every wrong answer")
    parser.add_argument(
        "--judge",
        metavar="MODEL_DIR",
        help="for a task set without answers: the large model's directory; answers are "
        "scored by teacher-forced agreement with it (quality/judge.py)",
    )
    quiet = parser.add_argument("--quiet", action="store_true", help="no progress bar")
    deprecated_alias(parser, "--no-progress", quiet)
    parser.add_argument(
        "--write-tasks",
        metavar="SPEC",
        help="write the task set SPEC (builtin:NAME or a file) to --out as JSONL and exit",
    )
    parser.set_defaults(func=run_eval_command)


def parse_system(text: str) -> tuple[str, str, str]:
    """``LABEL=URL[@MODEL]`` -> ``(label, url, model)``; the model follows the last '@'."""
    label, sep, rest = text.partition("=")
    if not sep or not label.strip() or not rest.strip():
        raise UserFacingError(f"--system: expected LABEL=URL[@MODEL], got {text!r}")
    url, at, model = rest.rpartition("@")
    if not at:
        url, model = rest, DEFAULT_MODEL
    if not url.strip() or not model.strip():
        raise UserFacingError(f"--system: expected LABEL=URL[@MODEL], got {text!r}")
    if "://" not in url:
        raise UserFacingError(f"--system {label}: {url!r} is not a URL (http://host:port/v1)")
    return label.strip(), url.strip(), model.strip()


def load_items(spec: str) -> list[TaskItem]:
    """The task set a ``--tasks`` value names."""
    return tasks_from_spec(spec)


def parse_extra_body(text: str | None) -> dict[str, Any] | None:
    if not text:
        return None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserFacingError(f"--extra-body: not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise UserFacingError("--extra-body: expected a JSON object")
    return body


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def format_table(results: list[SystemResult]) -> str:
    head = ("system", "accuracy [95% interval]", "n", "large share", "handoffs/req", "tok/s",
            "failures")  # fmt: skip
    rows = [head]
    for r in results:
        lo, hi = r.interval
        rows.append((
            r.label, f"{_pct(r.accuracy)} [{_pct(lo)}, {_pct(hi)}]", str(r.n),
            _pct(r.large_share), f"{r.handoffs_per_request:.2f}", f"{r.output_tok_s:.1f}",
            str(r.failures),
        ))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = []
    for row in rows:
        cells = [row[0].ljust(widths[0])]
        cells += [cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells))
    return "\n".join(lines)


def format_wrong(result: SystemResult) -> str:
    lines = [f"{result.label}: wrong answers"]
    for item in result.items:
        if not item.correct:
            got = f"error: {item.error}" if item.error else repr(item.response)
            lines.append(f"  {item.id}: expected {item.answer!r}, got {got}")
    return "\n".join(lines)


def _write_tasks(args: argparse.Namespace) -> int:
    if args.out is None:
        raise UserFacingError("--write-tasks needs --out FILE.jsonl")
    count = write_tasks(split_items(load_items(args.write_tasks), args.split), args.out)
    print(f"wrote {count} items ({args.split} split) to {args.out}")
    return 0


def run_eval_command(args: argparse.Namespace) -> int:
    if args.write_tasks:
        return _write_tasks(args)
    systems = [parse_system(s) for s in args.system or [DEFAULT_SYSTEM]]
    if len({label for label, _, _ in systems}) < len(systems):
        raise UserFacingError("--system: every system needs its own label")
    if args.limit is not None and args.limit < 1:
        raise UserFacingError(f"--limit must be positive, got {args.limit}")
    extra_body = parse_extra_body(args.extra_body)
    items = split_items(load_items(args.tasks), args.split)[: args.limit]
    if not items:
        raise UserFacingError(f"{args.tasks}: no items in the {args.split} split")
    judge = make_judge(items, args.judge)
    results = [
        asyncio.run(
            run_eval(
                url, model, items, concurrency=args.concurrency, seed=args.seed,
                max_tokens=args.max_tokens, temperature=args.temperature,
                extra_body=extra_body, api_key=args.api_key, progress=not args.quiet,
                chat=not args.completions, label=label,
            )
        )
        for label, url, model in systems
    ]  # fmt: skip
    if judge is not None:
        results = [judged(r, items, judge) for r in results]
    print(format_table(results))
    silent = [r for r in results if r.n and r.failures == r.n]
    for r in silent:
        print(f"{r.label}: every request failed ({r.items[0].error})", file=sys.stderr)
    if args.answers:
        for result in results:
            print("\n" + format_wrong(result))
    if args.out is not None:
        report = {
            "tasks": args.tasks,
            "split": args.split,
            "settings": {
                "limit": args.limit, "concurrency": args.concurrency, "seed": args.seed,
                "max_tokens": args.max_tokens, "temperature": args.temperature,
                "extra_body": extra_body, "chat": not args.completions,
            },
            "systems": [r.to_json() for r in results],
        }  # fmt: skip
        args.out.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
        print(f"\nwrote {args.out}", file=sys.stderr)
    return 1 if silent else 0


def make_judge(items: Sequence[TaskItem], model_dir: str | None) -> Any:
    """The teacher-forced judge a set without answers needs (None for one with answers)."""
    if not needs_judge(items):
        return None
    if not model_dir:
        raise UserFacingError(
            "these items have no 'answer': pass --judge MODEL_DIR (the large model) to score "
            "the answers by teacher-forced agreement with it"
        )
    return TeacherForcedJudge(model_dir)
