"""``tokenrouter-ray profile`` on real (tiny) checkpoints, and its output feeding ``tune``."""

from __future__ import annotations

import json

import pytest

from tests.engine.conftest import make_engine, save_tiny
from tokenrouter_ray import cli
from tokenrouter_ray.tuning.profile import load_profile
from tokenrouter_ray.tuning.step_times import measure_step_times


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return {
        "small": save_tiny(tmp_path_factory.mktemp("small"), "llama", seed=1),
        "large": save_tiny(tmp_path_factory.mktemp("large"), "qwen3", seed=2),
    }


def test_each_batch_size_runs_as_asked_and_frees_its_kv(tiny_dirs) -> None:
    engine = make_engine(tiny_dirs["small"], num_blocks=128)
    seen: list[int] = []
    table = measure_step_times(
        engine, [1, 3, 5], prompt_len=6, steps=3, warmup=1, progress=lambda b, ms: seen.append(b)
    )
    assert sorted(table) == seen == [1, 3, 5]
    assert all(ms > 0 for ms in table.values())
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks  # nothing leaked
    assert not engine.scheduler.num_active


def test_profile_file_feeds_tune(tiny_dirs, tmp_path, capsys) -> None:
    out = tmp_path / "profile.json"
    argv = ["profile", "--model", f"small={tiny_dirs['small']}", "--model",
            f"large={tiny_dirs['large']}", "--batch-sizes", "1,2,4", "--prompt-len", "8",
            "--steps", "2", "--warmup", "1", "--out", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    data = json.loads(out.read_text())
    assert list(data["models"]) == ["small", "large"]
    assert list(data["models"]["large"]["step_ms"]) == ["1", "2", "4"]
    capsys.readouterr()
    # Step times only: tune needs the routing too, and says so.
    assert cli.main(["tune", "--profile", str(out), "--concurrency-levels", "2"]) == 2
    assert "sum to 0" in capsys.readouterr().err
    routing = ["--route-prob", "small:small=0.7,small:large=0.3,large:small=1",
               "--commit", "small:small=1,large:small=1"]  # fmt: skip
    assert cli.main(["tune", "--profile", str(out), *routing, "--concurrency-levels", "2,4",
                     "--grain-ms", "0.05", "--json"]) == 0  # fmt: skip
    result = json.loads(capsys.readouterr().out)
    assert set(result) == {"2", "4"} and set(result["4"]["best"]) == {"small", "large"}
    # Routing stored with the profile gives the same file tune reads directly.
    both = tmp_path / "both.json"
    assert cli.main([*argv[:-1], str(both), *routing]) == 0
    profile = load_profile(both)
    assert profile.names == ("small", "large") and profile.route_prob[0][1] == 0.3


def test_bad_model_path_is_one_clear_error(tmp_path, capsys) -> None:
    missing = tmp_path / "nope"
    assert cli.main(["profile", "--model", f"x={missing}", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "x" in err and "nope" in err and "Traceback" not in err
