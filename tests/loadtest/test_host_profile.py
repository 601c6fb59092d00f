"""host-profile's summary of py-spy's raw stacks: areas by innermost frame, self and
inclusive time (the recording itself needs py-spy and a served app: a benchmark, not a test)."""

from __future__ import annotations

from loadtest.host_profile import OTHER, summarize

SITE = "/venv/lib/python3.12/site-packages"
STEP = "Replica.step (/x/tokenrouter_ray/replica/step.py:10)"
RECV = "ZmqChannel.recv (/x/tokenrouter_ray/transport/zmq_channel.py:260)"
OBSERVE = "Metrics._observe (/x/tokenrouter_ray/metrics/recorder.py:58)"
RECORD = f"Metric._record ({SITE}/ray/util/metrics.py:130)"
ROUTE = "Replica.route (/x/tokenrouter_ray/replica/step.py:40)"
ZMQ = f"_AsyncSocket._add_recv_event ({SITE}/zmq/_future.py:480)"
T1, T2 = "thread (1): small-steps", "thread (2): Thread-1 (loop)"
STACKS = [
    (T1, [STEP, OBSERVE, RECORD], 6),
    (T1, [STEP, ROUTE], 3),
    (T2, [RECV, ZMQ], 2),
    (T2, [RECV], 1),
    (T2, ["somewhere (/usr/lib/python3.12/weird.py:1)"], 1),
]
RAW = "\n".join(f"{t};{';'.join(frames)} {n}" for t, frames, n in STACKS) + "\nnot a sample\n"


def test_each_sample_goes_to_the_area_of_its_innermost_known_frame() -> None:
    profile = summarize(RAW.splitlines())
    assert profile.samples == 13
    assert profile.areas == {
        "Ray metrics": 6,  # the innermost frame is Ray's, inside ours: one area
        "replica step (route, commit, messages, scheduler, engine)": 3,
        "ZeroMQ asyncio layer": 2,
        "transport (channel, directory)": 1,
        OTHER: 1,
    }
    assert profile.threads == {T1: 9, T2: 4}


def test_self_time_is_the_leaf_and_inclusive_counts_a_frame_once_per_sample() -> None:
    profile = summarize(RAW.splitlines())
    assert profile.self_time["Metric._record (ray/util/metrics.py)"] == 6
    assert profile.self_time["ZmqChannel.recv (tokenrouter_ray/transport/zmq_channel.py)"] == 1
    assert profile.inclusive["Replica.step (tokenrouter_ray/replica/step.py)"] == 9
    assert profile.inclusive["ZmqChannel.recv (tokenrouter_ray/transport/zmq_channel.py)"] == 3
    assert (
        profile.share(profile.inclusive, "Replica.step (tokenrouter_ray/replica/step.py)") == 9 / 13
    )
