"""A Serve YAML's app config, composed and checked without Ray: what ``build_app``
(deployments/app.py) does before it binds deployments, and what ``tokenrouter-ray config
check|show`` runs.

``compose_config(overrides)`` runs Hydra's compose API over ``conf/`` (groups: models,
policy, transport, placement, scheduler, tuner; primary config ``conf/base.yaml``) plus the
overrides, resolves interpolations (the entry points register ``${demo:...}`` for the
cached demo models: ``demo.register_resolver()``) and validates an ``AppConfig``.
``args`` of an application (``AppArgs``) name the overrides and the primary config;
``TOKENROUTER_OVERRIDES`` in the environment adds overrides at launch, after the config's
own (``serve run`` takes none after a config file)."""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tokenrouter_ray.config import CONF_DIR, AppConfig, ConfigError, ModelSpec
from tokenrouter_ray.errors import UserFacingError

OVERRIDES_ENV = "TOKENROUTER_OVERRIDES"  # launch-time overrides, after the config's own
BUILDER = "deployments.app:build_app"  # the import_path of this project's apps


class AppArgs(BaseModel):
    """What a Serve YAML may put under ``args``."""

    model_config = ConfigDict(extra="forbid")

    overrides: list[str] = Field(
        default_factory=list, description="Hydra overrides, e.g. ['policy=rstitch']."
    )
    config_name: str = Field("base", description="Primary config in conf/.")


def compose_config(
    overrides: list[str] | tuple[str, ...] = (), config_name: str = "base"
) -> AppConfig:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    GlobalHydra.instance().clear()
    # Any dotted key may be set, present in the YAML or not (pydantic's extra="forbid"
    # still rejects typos); group choices (`policy=rstitch`) stay as they are.
    overrides = [
        f"++{o}" if "=" in o and "." in o.split("=", 1)[0] and o[0] not in "+~" else o
        for o in overrides
    ]
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            cfg = compose(config_name=config_name, overrides=list(overrides))
        data = OmegaConf.to_container(cfg, resolve=True)
    except (HydraException, OmegaConfBaseException) as exc:
        hint = ""
        if "Unsupported interpolation type demo" in str(exc):
            hint = " (call tokenrouter_ray.demo.register_resolver() before composing)"
        raise ConfigError(f"cannot compose the config: {exc}{hint}") from exc
    except (UserFacingError, OSError) as exc:
        raise ConfigError(f"cannot resolve a model path: {exc}") from exc
    try:
        return AppConfig.model_validate(data)
    except ValidationError as exc:
        problems = list(dict.fromkeys(_problem(e, data) for e in exc.errors()))
        raise ConfigError(f"invalid config: {'; '.join(problems)}") from None


def _problem(error: Any, data: Any) -> str:
    """One validation error as ``dotted.key: message``; a model entry that lacks its path
    is a misspelt model name (``models.smal.dtype=...`` creates one)."""
    loc = [str(p) for p in error["loc"]]
    models = data.get("models") if isinstance(data, dict) else None
    if len(loc) == 3 and loc[0] == "models" and loc[2] == "path" and error["type"] == "missing":
        known = [
            m for m, spec in (models or {}).items() if isinstance(spec, dict) and "path" in spec
        ]
        return f"models.{loc[1]}: no such model; models are {', '.join(known) or 'none'}"
    return f"{'.'.join(loc) or 'config'}: {error['msg']}"


def launch_overrides() -> list[str]:
    """The overrides in ``TOKENROUTER_OVERRIDES`` (none when unset)."""
    try:
        return shlex.split(os.environ.get(OVERRIDES_ENV, ""))
    except ValueError as exc:  # an unbalanced quote
        raise ConfigError(f"{OVERRIDES_ENV}: {exc}") from None


def parse_args(args: dict[str, Any] | None) -> AppArgs:
    try:
        return AppArgs.model_validate(args or {})
    except ValidationError as exc:
        first = exc.errors()[0]
        raise ConfigError(f"invalid Serve args: {first['msg']} at {first['loc']}") from None


def compose_app(args: dict[str, Any] | None, extra: list[str] = ()) -> AppConfig:
    """The app config of one Serve application's ``args``, then ``extra`` overrides, then
    the launch-time ones."""
    from tokenrouter_ray.demo import register_resolver

    parsed = parse_args(args)
    register_resolver()  # ${demo:...} in the shipped configs
    return compose_config(parsed.overrides + list(extra) + launch_overrides(), parsed.config_name)


def serve_apps(path: str | Path) -> dict[str, dict[str, Any]]:
    """The applications of a Serve YAML built by this project: name -> its ``args``."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}: not YAML: {getattr(exc, 'problem', exc)}{where}") from None
    apps = (data or {}).get("applications") if isinstance(data, dict) else None
    if not isinstance(apps, list):
        raise ConfigError(f"{path}: not a Serve config (no 'applications' list)")
    found = {
        str(app.get("name", "default")): app.get("args") or {}
        for app in apps
        if isinstance(app, dict) and app.get("import_path") == BUILDER
    }
    if not found:
        raise ConfigError(f"{path}: no application with import_path {BUILDER}")
    return found


def spec_tokenizer(spec: ModelSpec) -> Any:
    """The tokenizer of a configured model (a simulated one's is built in memory)."""
    if spec.sim is not None:
        from tokenrouter_ray.simulation.served import sim_tokenizer

        return sim_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(spec.path)


def validate_app(cfg: AppConfig) -> None:
    """What the schema cannot check: simulated profiles load, the policy builds with its
    options (and its router checkpoint exists), local models share a tokenizer. Each
    problem is one ``ConfigError`` naming the key."""
    from tokenrouter_ray.protocol import check_shared_tokenizer
    from tokenrouter_ray.routing.policy import build_policy, policy_class

    local = [name for name, spec in cfg.models.items() if Path(spec.path).is_dir()]
    for name, spec in cfg.models.items():
        if spec.sim is not None:
            from tokenrouter_ray.simulation.served import model_profile

            try:
                model_profile(spec.sim, name, cfg.model_names.index(name))
            except Exception as exc:  # an unknown profile, a file that does not load
                raise ConfigError(f"models.{name}.sim: {exc}") from None
    try:
        cls = policy_class(cfg.policy.name)
        if cls.needs_tokenizer and cfg.model_names[0] not in local:
            cls.Config(**cfg.policy.options)  # hub ids: the replicas build it with theirs
        else:
            entry = cfg.models[cfg.model_names[0]]
            tokenizer = spec_tokenizer(entry) if cls.needs_tokenizer else None
            build_policy(cfg.policy.name, cfg.policy.options, cfg.model_names, tokenizer)
    except ValidationError as exc:
        problems = "; ".join(
            f"policy.options.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
        )
        raise ConfigError(f"policy {cfg.policy.name!r}: {problems}") from None
    except ValueError as exc:
        raise ConfigError(f"policy {cfg.policy.name!r}: {exc}") from None
    checkpoint = cfg.policy.options.get("checkpoint")
    if checkpoint and not Path(checkpoint).is_file():
        raise ConfigError(
            f"policy.options.checkpoint: {checkpoint} does not exist (train one with "
            "`tokenrouter-ray train-router`)"
        )
    if len(local) == len(cfg.models) > 1:  # hub ids are checked when the replicas load
        check_shared_tokenizer({n: spec_tokenizer(cfg.models[n]) for n in local})


# ------------------------------------------------------------------ tokenrouter-ray config
def _load(args: Any) -> list[tuple[str, AppConfig]]:
    apps = serve_apps(args.conf)
    if args.app is not None:
        if args.app not in apps:
            raise ConfigError(f"{args.conf}: no application {args.app!r} (has {', '.join(apps)})")
        apps = {args.app: apps[args.app]}
    return [(name, compose_app(app_args, args.overrides)) for name, app_args in apps.items()]


def _check(args: Any) -> int:
    for name, cfg in _load(args):
        validate_app(cfg)
        routing = f"policy {cfg.policy.name}"
        if cfg.policy.alone is not None:
            routing += f", requests without routing served by {cfg.policy.alone} alone"
        print(f"{args.conf} [{name}]: ok: models {', '.join(cfg.model_names)}; {routing}")
    return 0


def _show(args: Any) -> int:
    import yaml

    loaded = _load(args)
    for k, (name, cfg) in enumerate(loaded):
        if len(loaded) > 1:
            print(f"{'---' if k else ''}\n# application {name}")
        print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False).rstrip())
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "config",
        help="check a Serve config, or print the app config it resolves to (no Ray)",
        description="Compose a Serve config's app config as `serve run` would (its "
        "args.overrides, then OVERRIDE arguments, then $TOKENROUTER_OVERRIDES) without "
        "starting Ray. check: also build the routing policy and compare the models' "
        "tokenizers; every problem is one line naming the key.",
        epilog="example:\n  tokenrouter-ray config check conf/local.yaml policy.alone=null",
    )
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    for action, func, text in (
        ("check", _check, "compose and validate; prints one ok line per application"),
        ("show", _show, "print the resolved app config as YAML"),
    ):
        example = f"tokenrouter-ray config {action} conf/local.yaml models.large.num_replicas=2"
        sub = actions.add_parser(
            action, help=text, description=text, epilog=f"example:\n  {example}"
        )
        sub.add_argument("conf", metavar="CONF", help="a Serve YAML, e.g. conf/local.yaml")
        sub.add_argument(
            "overrides", nargs="*", metavar="OVERRIDE",
            help="Hydra overrides applied after the config's own, e.g. models.large.num_replicas=2",
        )  # fmt: skip
        sub.add_argument(
            "--app", default=None, help="only this application of CONF (default: every one)"
        )
        sub.set_defaults(func=func)
