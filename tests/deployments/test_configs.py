"""Every Serve config in conf/ parses with Ray Serve's own schema and composes to a valid
AppConfig; config mistakes are one clear error."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from deployments.app import AppArgs, build_app, ingress_options
from tokenrouter_ray.app_config import compose_config
from tokenrouter_ray.config import CONF_DIR, ConfigError

SERVE_CONFIGS = sorted(p for p in Path(CONF_DIR).glob("*.yaml") if p.name != "base.yaml")
HUB_ONLY = {"r2r_cross_node.yaml", "rstitch.yaml", "citer.yaml", "escalation.yaml"}


@pytest.mark.parametrize("path", SERVE_CONFIGS, ids=lambda p: p.name)
def test_serve_configs_parse_and_compose(path: Path) -> None:
    data = yaml.safe_load(path.read_text())
    ServeDeploySchema.model_validate(data)
    (app,) = data["applications"]
    assert app["import_path"] == "deployments.app:build_app"
    args = AppArgs.model_validate(app["args"])
    if path.name in HUB_ONLY:  # demo paths would build the demo models: compose hub ones
        cfg = compose_config(args.overrides)
        assert cfg.policy.name in {"r2r", "rstitch", "citer", "escalation"}
        assert len(cfg.models) >= 2


def test_cross_node_pins_each_model_to_its_node_resource() -> None:
    args = AppArgs.model_validate(
        yaml.safe_load((CONF_DIR / "r2r_cross_node.yaml").read_text())["applications"][0]["args"]
    )
    cfg = compose_config(args.overrides)
    assert cfg.models["small"].resources == {"tokenrouter_small": 0.001}
    assert cfg.models["large"].resources == {"tokenrouter_large": 0.001}
    assert cfg.models["large"].tensor_parallel == 1  # one card; models=qwen3_r2r_tp2: two
    assert cfg.models["large"].num_gpus == 1
    assert cfg.transport.kind == "zmq" and cfg.transport.zmq.transport == "tcp"


def test_ingress_resources_pin_its_replicas() -> None:
    """What the Helm chart's direct port writes (docs/deployment/kubernetes.md, "The direct
    port"): the
    replicas ask for one unit of the ingress pods' resource and bind the pod's own address."""
    base = ["models=qwen3_r2r", "policy=rstitch"]
    assert ingress_options(compose_config(base))["ray_actor_options"] == {"num_cpus": 0}
    assert compose_config(base).ingress.direct_host == "127.0.0.1"
    cfg = compose_config(
        [
            *base,
            "ingress.num_replicas=2",
            "ingress.resources={tokenrouter_ingress: 1}",
            "ingress.direct_port=8001",
            "ingress.direct_host=null",
        ]
    )
    options = ingress_options(cfg)
    assert options["num_replicas"] == 2
    assert options["ray_actor_options"] == {
        "num_cpus": 0,
        "resources": {"tokenrouter_ingress": 1},
    }
    assert cfg.ingress.direct_port == 8001
    assert cfg.ingress.direct_host is None  # the node's own address, resolved in the replica


def test_the_embedded_default_serves_the_api_on_the_ingress_own_port() -> None:
    """conf/local.yaml: the URL users call (8000) is the ingress replica's own port, where a
    client that stops reading is seen (docs/user-guide/reliability.md, "Slow readers"); Serve's
    proxy
    serves the same API elsewhere."""
    data = yaml.safe_load((CONF_DIR / "local.yaml").read_text())
    args = AppArgs.model_validate(data["applications"][0]["args"])
    assert "ingress.direct_port=8000" in args.overrides
    assert data["http_options"] == {"host": "127.0.0.1", "port": 8010}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["policy=nope"], "Could not find 'policy/nope'"),
        (["models=qwen3_r2r", "policy=rstitch", "models.small.dtpye=fp8"], "dtpye"),
        (["models=qwen3_r2r", "policy=rstitch", "policy.options.tau=7"], "tau"),
        (["models=qwen3_r2r", "policy=rstitch", "scheduler.batch_thresholds=[1,4,4]"], "deadlock"),
        (
            ["models=qwen3_r2r", "policy=rstitch", "tuner=live", "tuner.fixed={medium: 1}"],
            "tuner.fixed names unknown models",
        ),
        (
            ["models=qwen3_r2r", "policy=rstitch", "tuner=live", "tuner.concurrencies=[0,4]"],
            "concurrencies",
        ),
        (["models=qwen3_r2r", "policy=rstitch", "tuner=sometimes"], "Could not find 'tuner/"),
        (
            ["models=qwen3_r2r", "policy=rstitch", "models.large.tensor_parallel=0"],
            r"models.large.tensor_parallel: Input should be greater than or equal to 1",
        ),
        (
            ["models=qwen3_r2r", "policy=rstitch", "models.large.sdpa_backend=fastest"],
            r"models.large.sdpa_backend: Input should be 'auto', 'efficient', 'flash', 'math' "
            r"or 'cudnn'",
        ),
        # thresholds are per replica: 3 large replicas at B=2 hold 3 requests, N=3 deadlocks
        (
            [
                "models=qwen3_r2r",
                "policy=rstitch",
                "models.large.num_replicas=3",
                "models.large.scheduler.batch_thresholds=[1,1,1,2]",
            ],
            r"deadlock at 3 active requests: sum\(R_i \(B_i - 1\)\) = 1\*\(1-1\) \[small\] "
            r"\+ 3\*\(2-1\) \[large\] = 3",
        ),
        # models sharing a device: one joint plan, which needs the checkpoints on disk
        (
            [
                "models=qwen3_r2r",
                "policy=rstitch",
                "models.small.device_group=gpu0",
                "models.large.device_group=gpu0",
                "models.small.num_gpus=0.5",
                "models.large.num_gpus=0.5",
                "shared_devices.gpu0=80",
            ],
            "device_group 'gpu0': model 'small' .* is not a local directory",
        ),
        (
            ["models=qwen3_r2r", "policy=rstitch", "models.small.device_group=gpu0"],
            "shared_devices has no entry",
        ),
    ],
)
def test_config_errors_are_one_clear_message(overrides, message) -> None:
    with pytest.raises(ConfigError, match=message):
        build_app({"overrides": overrides})


def test_the_sdpa_backend_is_chosen_per_model() -> None:
    """``models.<m>.sdpa_backend`` reaches that model's engine (and its tensor-parallel
    ranks, which get the same EngineConfig); unset, cuDNN stays off ("efficient")."""
    from deployments.model_server import engine_config
    from tokenrouter_ray.engine.attention import SDPA_BACKENDS
    from tokenrouter_ray.engine.config import SdpaBackend

    cfg = compose_config(["models=qwen3_r2r", "policy=rstitch", "models.large.sdpa_backend=cudnn"])
    assert engine_config(cfg, "large").sdpa_backend == "cudnn"
    assert engine_config(cfg, "small").sdpa_backend == "efficient"
    assert set(SdpaBackend.__args__) == set(SDPA_BACKENDS)  # every name has its kernels


def test_deadlock_check_counts_replicas() -> None:
    base = ["models=qwen3_r2r", "policy=rstitch",
            "models.large.scheduler.batch_thresholds=[1,1,1,2]"]  # fmt: skip
    cfg = compose_config([*base, "models.large.num_replicas=2"])  # 2 * (2 - 1) = 2 < 3
    assert cfg.models["large"].num_replicas == 2
    with pytest.raises(ConfigError, match="deadlock at 3 active requests"):
        compose_config([*base, "models.large.num_replicas=3"])


def test_unknown_serve_args_are_refused() -> None:
    with pytest.raises(ConfigError, match="overides"):
        build_app({"overides": []})


def test_launch_overrides_come_from_the_environment(monkeypatch) -> None:
    """`TOKENROUTER_OVERRIDES='k=v ...' serve run CONF`: applied after the config's own (Ray's
    `serve run` ignores arguments after a config file); a bad one is a ConfigError."""
    from deployments.app import launch_overrides

    monkeypatch.delenv("TOKENROUTER_OVERRIDES", raising=False)
    assert launch_overrides() == []
    monkeypatch.setenv("TOKENROUTER_OVERRIDES", "policy.alone=large 'ingress.direct_port=8123'")
    base = ["models=qwen3_r2r", "policy=rstitch"]
    cfg = compose_config(base + launch_overrides())
    assert (cfg.policy.alone, cfg.ingress.direct_port) == ("large", 8123)
    monkeypatch.setenv("TOKENROUTER_OVERRIDES", "policy.alone=smal")
    with pytest.raises(ConfigError, match=r"policy\.alone"):
        compose_config(base + launch_overrides())
    monkeypatch.setenv("TOKENROUTER_OVERRIDES", "policy.alone='large")
    with pytest.raises(ConfigError, match="TOKENROUTER_OVERRIDES"):
        launch_overrides()
