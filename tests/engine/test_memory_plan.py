"""Joint memory planning for models sharing one device: footprints read from the checkpoint
match the loaded model, budgets from one plan fit the device, the engine sizes its pool to the
plan, and the config refuses a shared device that cannot hold its models."""

from __future__ import annotations

import pytest

from tests.engine.conftest import save_tiny
from tokenrouter_ray.app_config import compose_config
from tokenrouter_ray.config import ConfigError, plan_shared_devices
from tokenrouter_ray.engine.block_pool import ModelFootprint, plan_joint, plan_num_blocks
from tokenrouter_ray.engine.config import EngineConfig
from tokenrouter_ray.engine.engine import Engine
from tokenrouter_ray.engine.memory_plan import footprint_from_checkpoint, plan_shared_device
from tokenrouter_ray.engine.model_runner import model_footprint

MIB = 2**20


@pytest.fixture(scope="module")
def two_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("shared")
    small = save_tiny(root / "small", "llama", seed=0)
    large = save_tiny(root / "large", "qwen3", seed=1)
    return {"small": small, "large": large}


def test_checkpoint_footprint_matches_the_loaded_model(two_dirs: dict[str, str]) -> None:
    for path in two_dirs.values():
        engine = Engine.from_config(EngineConfig(model=path, dtype="float64", num_blocks=4))
        assert footprint_from_checkpoint(path, None, 8) == model_footprint(engine.runner.model)


def test_budgets_from_one_plan_fit_and_give_the_plans_blocks() -> None:
    small = ModelFootprint(weight_bytes=100 * MIB, kv_bytes_per_token=4096)
    large = ModelFootprint(weight_bytes=700 * MIB, kv_bytes_per_token=16384)
    memory = 1024 * MIB
    budgets = plan_shared_device(memory, [small, large], [16, 32])
    assert sum(budgets) <= memory
    blocks = plan_joint(memory, [small, large], [16, 32])
    assert blocks[0] * 16 // 32 == blocks[1]  # the same context on both (whole blocks)
    # each engine, sizing its pool alone from its budget, gets the plan's blocks
    assert [plan_num_blocks(b, m, s) for b, m, s in zip(budgets, [small, large], [16, 32],
                                                        strict=True)] == blocks  # fmt: skip
    with pytest.raises(ValueError, match="leaves no room for KV"):
        plan_shared_device(800 * MIB, [small, large], [16, 16])


def _overrides(dirs: dict[str, str], extra: list[str]) -> list[str]:
    out = ["models=qwen3_r2r", "policy=r2r"]
    for name, path in dirs.items():
        out += [f"models.{name}.path={path}", f"models.{name}.dtype=float64",
                f"models.{name}.num_gpus=0", f"models.{name}.block_size=4",
                f"models.{name}.device_group=cpu0"]  # fmt: skip
    return out + extra


def test_config_plans_co_located_models_and_the_engine_follows(two_dirs: dict[str, str]) -> None:
    cfg = plan_shared_devices(compose_config(_overrides(two_dirs, ["shared_devices.cpu0=0.01"])))
    memory = int(0.01 * 2**30)
    budgets = {n: int(cfg.models[n].memory_budget_gb * 2**30) for n in two_dirs}
    assert sum(budgets.values()) <= memory
    prints = [footprint_from_checkpoint(p, None, 8) for p in two_dirs.values()]
    blocks = plan_joint(memory, prints, 4)
    assert blocks[0] >= 1
    for (name, path), planned in zip(two_dirs.items(), blocks, strict=True):
        config = EngineConfig(model=path, dtype="float64", block_size=4,
                              memory_budget_bytes=budgets[name])  # fmt: skip
        assert Engine.from_config(config).kv.pool.num_blocks == planned
    alone = plan_num_blocks(memory, prints[0], 4)  # what it took before: the whole device
    assert alone > blocks[0]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["shared_devices.cpu0=0.0001"], r"do not fit on shared device 'cpu0' .*no room for KV"),
        ([], r"name device_group 'cpu0' but shared_devices has no entry"),
        (["shared_devices.cpu0=1", "shared_devices.gpu9=1"], r"\['gpu9'\] are named by no"),
        (
            ["shared_devices.cpu0=1", "models.small.num_gpus=0.7", "models.large.num_gpus=0.7"],
            "models sharing one GPU must split it",
        ),
    ],
)
def test_shared_device_errors_are_one_clear_message(
    two_dirs: dict[str, str], extra: list[str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        plan_shared_devices(compose_config(_overrides(two_dirs, extra)))


def test_hub_models_cannot_be_planned_jointly(two_dirs: dict[str, str]) -> None:
    dirs = {"small": two_dirs["small"], "large": "Qwen/Qwen3-32B"}
    cfg = compose_config(_overrides(dirs, ["shared_devices.cpu0=1"]))
    with pytest.raises(ConfigError, match="not a local directory"):
        plan_shared_devices(cfg)
