"""``loadtest/hop_floor.py``: both kinds carry every frame to another process and time it
one way, and the verdict compares ZeroMQ's median with the bare socket's at each gap."""

from __future__ import annotations

import pytest

from loadtest.hop_floor import KINDS, Hop, measure, pool, targets


@pytest.mark.parametrize("kind", KINDS)
def test_every_frame_arrives_and_is_timed_one_way(kind: str) -> None:
    hop = measure(kind, gap_s=0.002, frames=20)
    assert len(hop.one_way_us) == 20
    assert hop.one_way_us == sorted(hop.one_way_us)
    assert all(0 < v < 5e6 for v in hop.one_way_us)  # positive, and not a stale stamp
    assert hop.send_cpu_us > 0
    with pytest.raises(ValueError):
        measure("carrier-pigeon", 0.0, 1)


def test_the_verdict_is_per_gap_on_pooled_rounds() -> None:
    hops = [
        Hop("zeromq-ipc", 0.006, [100.0, 120.0, 140.0], 20.0),
        Hop("zeromq-ipc", 0.006, [110.0], 30.0),
        Hop("unix-datagram", 0.006, [10.0, 12.0], 5.0),
        Hop("zeromq-ipc", 0.02, [30.0], 20.0),
        Hop("unix-datagram", 0.02, [20.0], 5.0),
    ]
    zmq_6 = pool(hops, "zeromq-ipc", 0.006)
    assert zmq_6.one_way_us == [100.0, 110.0, 120.0, 140.0] and zmq_6.send_cpu_us == 25.0
    pooled = [pool(hops, k, g) for g in (0.006, 0.02) for k in KINDS]
    verdicts = {name: ok for name, ok, _ in targets(pooled)}
    assert verdicts == {
        "gap 6 ms: ZeroMQ's hop p50 <= 2x a bare datagram's": False,  # 120 vs 12
        "gap 20 ms: ZeroMQ's hop p50 <= 2x a bare datagram's": True,  # 30 vs 20
    }
