"""Profiles: step-time tables, validation, and the JSON/YAML file format."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tokenrouter_ray.errors import UserFacingError
from tokenrouter_ray.tuning.examples import paper_r2r
from tokenrouter_ray.tuning.profile import (
    ModelProfile,
    RoutingProfile,
    load_profile,
    profile_from_mapping,
)

PROFILE = {
    "grain_ms": 0.5,
    "models": {
        "small": {"step_ms": {"1": 6.0, "8": 7.5, "32": 10.0}},
        "large": {"step_ms": 27.9, "max_batch": 16},
    },
    "route_prob": {"small": {"small": 0.65, "large": 0.35}, "large:small": 1.0},
    "commit": {"small:small": 1, "large:small": 1},
}


def test_step_time_table_interpolates_and_extrapolates() -> None:
    model = ModelProfile("m", ((8, 7.5), (1, 6.0), (32, 10.0)))
    assert model.step_time_ms(1) == 6.0
    assert model.step_time_ms(4) == pytest.approx(6.0 + 3 * 1.5 / 7)
    assert model.step_time_ms(32) == 10.0
    assert model.step_time_ms(40) == pytest.approx(10.0 + 8 * 2.5 / 24)  # last slope kept
    assert ModelProfile.constant("c", 3.0).step_time_ms(50) == 3.0


def test_profile_file_json_and_yaml_agree(tmp_path: Path) -> None:
    yaml = pytest.importorskip("yaml")
    (tmp_path / "p.json").write_text(json.dumps(PROFILE))
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(PROFILE, sort_keys=False))
    from_json = load_profile(tmp_path / "p.json")
    assert load_profile(tmp_path / "p.yaml") == from_json
    assert from_json.names == ("small", "large")
    assert from_json.grain_ms == 0.5
    np.testing.assert_allclose(from_json.route_matrix(), [[0.65, 0.35], [1.0, 0.0]])
    np.testing.assert_allclose(from_json.commit_matrix(), [[1, 0], [1, 0]])
    assert from_json.models[1].max_batch == 16
    assert from_json.grains(2)[:, 1:].tolist() == [[12, 12], [56, 56]]


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"route_prob": {"small:large": 0.35, "large:small": 1.0}}, "sum to 0.35"),
        ({"route_prob": {"small:huge": 1.0}}, "unknown model 'huge'"),
        ({"route_prob": {"smalllarge": 1.0}}, "not of the form src:dst"),
        ({"commit": {"small:small": "lots"}}, "not a number"),
        ({"models": {"small": {"ms": 3}}}, "needs 'step_ms'"),
        ({"models": {"small": {"step_ms": -1.0}}}, "positive finite"),
        ({"grain_ms": 0}, "grain_ms must be positive"),
    ],
)
def test_bad_profiles_are_refused_with_a_message(patch: dict, message: str) -> None:
    with pytest.raises(UserFacingError, match=message):
        profile_from_mapping({**PROFILE, **patch})


def test_unreadable_files_are_user_errors(tmp_path: Path) -> None:
    with pytest.raises(UserFacingError, match="cannot read"):
        load_profile(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(UserFacingError, match="not valid JSON"):
        load_profile(tmp_path / "bad.json")


def test_rows_are_renormalised_within_tolerance() -> None:
    profile = RoutingProfile(
        (ModelProfile.constant("a", 1.0), ModelProfile.constant("b", 2.0)),
        ((0.5, 0.5 + 5e-7), (1.0, 0.0)),
        ((1, 0), (1, 0)),
    )
    assert profile.route_matrix().sum(axis=1) == pytest.approx([1.0, 1.0], abs=1e-15)


def test_permuted_reorders_everything() -> None:
    paper = paper_r2r()
    swapped = paper.permuted([1, 0])
    assert swapped.names == ("large", "small")
    np.testing.assert_allclose(swapped.route_matrix(), [[0.0, 1.0], [0.35, 0.65]])
    np.testing.assert_allclose(swapped.commit_matrix(), [[0.0, 1.0], [0.0, 1.0]])
    assert swapped.permuted([1, 0]) == paper
