"""Placement, the one rule for a request's replica of each model: prefix affinity bounded by
load, counted until released; a lost replica's requests are re-placed, the live ones kept."""

from __future__ import annotations

import pytest

from tokenrouter_ray.ingress.placement import Placement

SYSTEM = list(range(100, 132))  # two full blocks of 16


def test_place_counts_until_release_and_follows_a_shared_prefix() -> None:
    replicas = {"small": ["s0", "s1"], "large": ["l0", "l1", "l2"]}
    placement = Placement(replicas.__getitem__)
    first = placement.place("a", ["small", "large"], [*SYSTEM, 1])
    assert placement.load_of("small") == {first["small"]: 1}
    other = placement.place("b", ["small", "large"], [7] * 40)  # nothing shared: balanced
    assert other["small"] != first["small"] and other["large"] != first["large"]
    again = placement.place("c", ["small", "large"], [*SYSTEM, 2])  # its prefix's replicas
    assert again == first and placement.load_of("large")[first["large"]] == 2
    assert placement.placed("c") == again
    for rid in "abc":
        placement.release(rid)
    placement.release("never placed")  # a no-op
    assert not any(n for m in replicas for n in placement.load_of(m).values())


def test_load_bounds_affinity_and_no_prompt_is_least_loaded() -> None:
    placement = Placement(lambda model: ["r0", "r1"], max_imbalance=1)
    homes = [placement.place(f"x{i}", ["m"], [*SYSTEM, i])["m"] for i in range(3)]
    assert homes == ["r0", "r0", "r1"]  # r0 got 2 > 0 + 1: the third goes to r1
    assert placement.choose("m") == "r1"  # r0: 2, r1: 1
    with pytest.raises(LookupError):
        Placement(lambda model: []).place("y", ["m"], SYSTEM)


def test_a_model_without_replica_counts_nothing() -> None:
    replicas = {"small": ["s0"], "large": []}
    placement = Placement(replicas.__getitem__)
    with pytest.raises(LookupError):
        placement.place("a", ["small", "large"], SYSTEM)
    assert placement.load_of("small") == {} and placement.placed("a") == {}


def test_replace_keeps_live_replicas_and_re_places_lost_ones() -> None:
    replicas = {"small": ["s0"], "large": ["l0", "l1"]}
    placement = Placement(replicas.__getitem__)
    placed = {rid: placement.place(rid, ["small", "large"], [i] * 40)
              for i, rid in enumerate("abcd")}  # fmt: skip
    assert sorted(p["large"] for p in placed.values()) == ["l0", "l0", "l1", "l1"]
    replicas["large"] = ["l1", "l2"]  # l0 is gone, l2 is new
    placement.forget("l0")
    moved = {rid: placement.replace(rid, ["large"])["large"] for rid in "abcd"}
    for rid in "abcd":
        if placed[rid]["large"] == "l1":
            assert moved[rid] == "l1"  # kept: its KV may still be there
    assert sorted(moved.values()) == ["l1", "l1", "l2", "l2"]  # the lost ones balanced
    assert placement.load_of("large") == {"l0": 0, "l1": 2, "l2": 2}
    placement.release_model("a", ["large"])
    assert placement.placed("a") == {"small": "s0"}
