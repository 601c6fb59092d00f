"""Tracked <-> RouteState: one rule, by field name, with nothing shared between the copies."""

from __future__ import annotations

import dataclasses

from tokenrouter_ray.protocol import Dropped, RouteState, SamplingSpec
from tokenrouter_ray.replica.tracking import Tracked


def _route() -> RouteState:
    return RouteState(
        ingress="ingress/0",
        prompt_len=5,
        anchors={"small": 9, "large": 7},
        endpoints={"small": "small/0", "large": "large/1"},
        counts={"small": 3, "large": 1},
        handoffs=2,
        deadline=1e10,
        queue_s=0.25,
        pending_s={"small": 0.5},
        pending_since={"large": 123.0},
        peer_bytes=640,
        dropped=1,
        drops=[Dropped("small", 42, 0.9)],
    )


def test_tracked_has_every_route_field() -> None:
    names = {f.name for f in dataclasses.fields(Tracked)}
    assert set(RouteState.__struct_fields__) <= names


def test_a_route_survives_adopt_and_route_state_unchanged() -> None:
    route = _route()
    tracked = Tracked.from_route("r1", route, SamplingSpec(max_tokens=8), seq=4)
    assert tracked.seq == 4 and tracked.ingress == "ingress/0" and tracked.prompt_len == 5
    assert tracked.route_state() == route
    tracked.counts["small"] += 1  # the owner's changes never reach the message it adopted
    tracked.drops.append(Dropped("large", 7, None))
    tracked.anchors.advance("small", 12)
    assert route.counts == {"small": 3, "large": 1} and len(route.drops) == 1
    assert route.anchors == {"small": 9, "large": 7}
    sent = tracked.route_state()
    assert sent.counts["small"] == 4 and sent.anchors["small"] == 12 and len(sent.drops) == 2


def test_a_sent_route_shares_no_container_with_its_owner() -> None:
    """The message is encoded on the event loop while the step thread changes its request:
    every dict and list in a sent route is a copy."""
    tracked = Tracked.from_route("r1", _route(), SamplingSpec(max_tokens=8), seq=4)
    sent = tracked.route_state()
    before = {name: getattr(sent, name) for name in RouteState.__struct_fields__}
    before = {k: (dict(v) if isinstance(v, dict) else list(v) if isinstance(v, list) else v)
              for k, v in before.items()}  # fmt: skip
    for name in RouteState.__struct_fields__:
        value = getattr(tracked, name)
        if isinstance(value, dict):
            value["x"] = 1
        elif isinstance(value, list):
            value.append(Dropped("x", 1, None))
    tracked.anchors.advance("x", 3)
    assert {name: getattr(sent, name) for name in RouteState.__struct_fields__} == before
