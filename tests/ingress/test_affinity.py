"""PrefixAffinity: prompts sharing a prefix go to the replica that served it, unless that
replica is too busy; everything else is balanced by load."""

from __future__ import annotations

import random

import pytest

from tokenrouter_ray.ingress.affinity import PrefixAffinity

BS = 4


def prompt(head: list[int], tail_len: int, rng: random.Random) -> list[int]:
    return head + [rng.randrange(1000) for _ in range(tail_len)]


def test_a_shared_prefix_follows_its_replica_and_new_ones_are_balanced() -> None:
    rng = random.Random(0)
    affinity = PrefixAffinity(block_size=BS, max_imbalance=2)
    loads = {"a": 0, "b": 0, "c": 0}
    systems = [[rng.randrange(1000) for _ in range(12)] for _ in range(3)]
    homes = []
    for system in systems:  # three tenants' first requests spread over three replicas
        home = affinity.choose(prompt(system, 3, rng), loads)
        loads[home] += 1
        homes.append(home)
    assert sorted(homes) == ["a", "b", "c"] and affinity.balanced == 3
    for system, home in zip(systems, homes, strict=True):  # follow-ups find their home
        assert affinity.choose(prompt(system, 5, rng), loads) == home
    assert affinity.affine == 3


def test_the_deepest_remembered_prefix_wins() -> None:
    affinity = PrefixAffinity(block_size=BS, max_imbalance=2)
    system = list(range(8))
    turn1 = [*system, 10, 11, 12, 13, 14]
    assert affinity.choose(turn1, {"a": 0, "b": 0}) == "a"
    other = [*system, 20, 21, 22, 23, 24]  # the same system prompt, another conversation
    assert affinity.choose(other, {"a": 3, "b": 0}) == "b"  # a is too busy: balanced
    # The first conversation's next turn shares more blocks with "a" than with "b".
    assert affinity.choose([*turn1, 15, 16, 17], {"a": 1, "b": 1}) == "a"
    assert affinity.choose([*other, 25, 26, 27], {"a": 1, "b": 1}) == "b"


def test_load_bounds_affinity() -> None:
    affinity = PrefixAffinity(block_size=BS, max_imbalance=2)
    p = list(range(20))
    assert affinity.choose(p, {"a": 0, "b": 0}) == "a"
    assert affinity.choose(p, {"a": 2, "b": 0}) == "a"  # within the bound: stays
    assert affinity.choose(p, {"a": 3, "b": 0}) == "b"  # past it: the least loaded
    assert affinity.choose(p, {"a": 0, "b": 0}) == "b"  # and the prefix moved with it


def test_short_prompts_salts_dead_replicas_and_capacity() -> None:
    affinity = PrefixAffinity(block_size=BS, capacity=8)
    assert affinity.choose([1, 2, 3], {"a": 1, "b": 0}) == "b"  # no full block: by load
    assert len(affinity) == 0
    p = list(range(16))
    assert affinity.choose(p, {"a": 0, "b": 1}) == "a"
    assert affinity.choose(p, {"a": 1, "b": 0}, cache_salt="t2") == "b"  # other tenant
    assert affinity.choose(p, {"b": 0, "c": 0}) == "b"  # "a" is gone: ignored
    assert affinity.forget("b") == 8 and len(affinity) == 0  # capacity kept it to 8
    for i in range(5):
        affinity.choose([i, *p], {"a": 0})
    assert len(affinity) == 8
    with pytest.raises(ValueError):
        affinity.choose(p, {})


def test_the_ingress_places_every_model_by_prefix_and_releases_the_load() -> None:
    from tests.ingress.test_ingress_service import Tokenizer
    from tests.openai.ingress_app import FakePeers, fake_config, fake_ingress

    peers = FakePeers()
    peers.by_model = {"small": ["small/0", "small/1"], "large": ["large/0", "large/1", "large/2"]}
    specs = {name: {"path": name, "block_size": 4} for name in ("small", "large")}
    server = fake_ingress(Tokenizer(), peers=peers, cfg=fake_config(models=specs))
    system = list(range(100, 140))  # a shared 40-token system prompt: ten full blocks
    first = server.entry([*system, 1, 2, 3])
    server.entry_load[first] = 1
    placed = server._endpoints("r1", [*system, 1, 2, 3], None)
    again = server.entry([*system, 7, 8])  # same prefix: same replica despite its load
    placed_again = server._endpoints("r2", [*system, 7, 8], None)
    assert again == first and placed_again == placed
    assert server.assigned_load[placed["large"]] == 2
    other = server.entry([9] * 43)  # nothing shared: the least loaded replica
    assert other != first
    server._unassign("r1")
    server._unassign("r2")
    assert all(n == 0 for n in server.assigned_load.values())
    server.forget_replica(first)  # lost: its prefixes go to whoever is least loaded now
    server.entry_load = {first: 5}
    assert server.entry([*system, 4]) != first
