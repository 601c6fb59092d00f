"""The ``tokenrouter-ray`` console script.

Each sub-command lives next to the code it drives and registers itself here through a
``register(subparsers)`` function; this module only collects them and dispatches.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
import textwrap

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


class HelpFormatter(argparse.HelpFormatter):
    """Every command's help format: prose paragraphs are wrapped to the terminal, indented
    lines (examples) are kept as written, and each option with a default shows it."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        blocks = []
        for block in re.split(r"\n\s*\n", text.strip("\n")):
            if block.startswith((" ", "\t")) or "\n " in block:
                blocks.append(textwrap.indent(textwrap.dedent(block), indent))
            else:
                blocks.append(
                    textwrap.fill(
                        " ".join(block.split()),
                        width,
                        initial_indent=indent,
                        subsequent_indent=indent,
                    )
                )
        return "\n\n".join(blocks)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            not action.option_strings
            or default is None
            or default is False
            or default == argparse.SUPPRESS
            or isinstance(action, argparse._StoreConstAction)
            or "default" in text.lower()
        ):
            return text
        return f"{text} (default: %(default)s)"


class _DeprecatedAlias(argparse.Action):
    def __init__(self, option_strings, dest, replacement: str, **kwargs) -> None:
        self.replacement = replacement
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(
            f"{parser.prog}: warning: {option_string} is deprecated; use {self.replacement}",
            file=sys.stderr,
        )
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)


def deprecated_alias(parser: argparse.ArgumentParser, old: str, new: argparse.Action) -> None:
    """Accept ``old`` as a hidden spelling of the option ``new`` for one release: it sets the
    same value and prints a one-line warning naming the new spelling."""
    parser.add_argument(
        old,
        dest=new.dest,
        action=_DeprecatedAlias,
        replacement=new.option_strings[0],
        nargs=new.nargs,
        const=new.const,
        type=new.type,
        choices=new.choices,
        default=argparse.SUPPRESS,
        help=argparse.SUPPRESS,
    )


def _use_formatter(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = HelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _use_formatter(sub)


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
    _use_formatter(parser)
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
