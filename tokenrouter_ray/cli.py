"""The ``tokenrouter-ray`` console script.

Each sub-command lives next to the code it drives and registers itself here through a
``register(subparsers)`` function; this module only collects them and dispatches.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from tokenrouter_ray.errors import UserFacingError

# Modules that expose ``register(subparsers: argparse._SubParsersAction) -> None``.
COMMAND_MODULES = (
    "tokenrouter_ray.app_config",
    "tokenrouter_ray.dashboards.commands",
    "tokenrouter_ray.demo.commands",
    "tokenrouter_ray.quality.calibrate",
    "tokenrouter_ray.quality.commands",
    "tokenrouter_ray.routing.importing",
    "tokenrouter_ray.routing.training.commands",
    "tokenrouter_ray.simulation.commands",
    "tokenrouter_ray.traceview.commands",
    "tokenrouter_ray.tuning.commands",
    "tokenrouter_ray.tuning.plan_command",
    "tokenrouter_ray.tuning.step_times",
)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tokenrouter-ray")
    except PackageNotFoundError:  # run from a checkout that is not installed
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenrouter-ray",
        description="Token-level LLM routing on Ray Serve.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:  # a real missing dependency, not an absent command module
                raise
            continue
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    from tokenrouter_ray.demo import register_resolver

    register_resolver()  # commands that compose configs resolve ${demo:...}
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UserFacingError as exc:
        print(f"tokenrouter-ray {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into `head` and closed early
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
