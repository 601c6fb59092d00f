"""The speed bypass's rule (quality/speed.py): learn both modes per load level, serve the
faster, switch back only past the margin, explore a share."""

from __future__ import annotations

import pytest

from tokenrouter_ray.quality.settings import SpeedBypassSpec
from tokenrouter_ray.quality.speed import SpeedBypass, load_level


def serve(bypass: SpeedBypass, active: int, ms_per_token: dict[str, float], n: int) -> list[str]:
    """``n`` requests at ``active``, each finished at its mode's speed: the modes served."""
    modes = []
    for _ in range(n):
        mode, _why, level = bypass.choose(active)
        bypass.observe(mode, level, ms_per_token[mode] * 64 / 1e3, 64)
        modes.append(mode)
    return modes


def test_load_levels_are_powers_of_two() -> None:
    assert [load_level(n) for n in (0, 1, 2, 3, 4, 7, 8, 15, 16)] == [0, 0, 1, 1, 2, 2, 3, 3, 4]


def test_learns_both_modes_then_serves_the_faster_per_load_level() -> None:
    spec = SpeedBypassSpec(explore_every=4, min_samples=3)
    bypass = SpeedBypass(spec, "large")
    slow_routing = {"routed": 30.0, "alone": 20.0}
    # nothing decided: both modes, alternately, starting alone (the configured start)
    first = serve(bypass, 1, slow_routing, 6)
    assert first == ["alone", "routed"] * 3
    # decided at load 1: alone, and every 4th request explores routing
    assert serve(bypass, 1, slow_routing, 8) == ["alone"] * 3 + ["routed"] + ["alone"] * 3 + [
        "routed"
    ]
    # load 8 starts from load 1's choice, measures routing by its explorations, and moves
    # to it once both modes have 3 requests there: routing is faster at this load
    fast_routing = {"routed": 10.0, "alone": 20.0}
    start = serve(bypass, 8, fast_routing, 12)
    assert start[:4] == ["alone"] * 3 + ["routed"]
    assert serve(bypass, 8, fast_routing, 4) == ["routed"] * 3 + ["alone"]
    status = bypass.status()
    assert [(lv["load"], lv["mode"]) for lv in status["levels"]] == [
        ("1", "alone"),
        ("8-15", "routed"),
    ]
    assert status["levels"][0]["alone_ms_per_token"] == pytest.approx(20.0)


def test_switches_only_past_the_margin() -> None:
    spec = SpeedBypassSpec(explore_every=0, min_samples=2, margin=0.1, window=4)
    bypass = SpeedBypass(spec, "large")
    serve(bypass, 1, {"routed": 30.0, "alone": 20.0}, 4)
    assert bypass.choose(1)[0] == "alone"
    # routed becomes 5 % faster than alone: inside the margin, alone stays
    for _ in range(4):
        bypass.observe("routed", 0, 19.0 * 64 / 1e3, 64)
    assert bypass.choose(1)[0] == "alone"
    # 25 % faster: it takes over, and the move is listed with both means
    for _ in range(4):
        bypass.observe("routed", 0, 15.0 * 64 / 1e3, 64)
    assert bypass.choose(1)[:2] == ("routed", "speed")
    (move,) = [m for m in bypass.status()["moves"] if m["from"] is not None]
    assert (move["from"], move["to"]) == ("alone", "routed")
    # at the first mean at least 10 % under alone's 20 ms
    assert move["routed_ms_per_token"] <= 18.0 < 19.0
    assert move["alone_ms_per_token"] == pytest.approx(20.0)


def test_explores_the_slower_mode_every_nth_request() -> None:
    spec = SpeedBypassSpec(explore_every=10, min_samples=2)
    bypass = SpeedBypass(spec, "large")
    serve(bypass, 1, {"routed": 30.0, "alone": 20.0}, 4)
    whys = [bypass.choose(1)[:2] for _ in range(30)]
    assert [k for k, w in enumerate(whys) if w[1] == "explore"] == [9, 19, 29]
    assert {w for w in whys if w[1] == "explore"} == {("routed", "explore")}


def test_short_answers_are_not_measured() -> None:
    bypass = SpeedBypass(SpeedBypassSpec(min_tokens=4), "large")
    bypass.observe("alone", 0, 1.0, 3)
    bypass.observe("alone", 0, 0.0, 64)
    assert bypass.status()["levels"] == []


def test_status_shows_the_predicted_ratio_beside_the_measured_one() -> None:
    bypass = SpeedBypass(SpeedBypassSpec(explore_every=0, min_samples=2), "large")
    serve(bypass, 1, {"routed": 30.0, "alone": 20.0}, 4)
    serve(bypass, 5, {"routed": 10.0, "alone": 20.0}, 4)
    predicted = ({1: 30.0, 4: 150.0, 16: 600.0}, {1: 40.0, 4: 100.0, 16: 640.0})  # tok/s per N
    levels = {lv["load"]: lv["routed_over_alone"] for lv in bypass.status(predicted)["levels"]}
    assert levels["1"] == {"measured": pytest.approx(20 / 30, abs=1e-3), "predicted": 0.75}
    # a level reads the prediction at its lowest N (4 for 4-7), or the nearest predicted
    assert levels["4-7"] == {"measured": 2.0, "predicted": 1.5}
    assert bypass.status()["levels"][0]["routed_over_alone"]["predicted"] is None
