"""The ZeroMQ limits in the config: the frame cap holds the largest legitimate frame (a whole
step's batch of NEW frames re-creating full-length requests), a config whose cap is below it
is refused, and port ranges are checked."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tokenrouter_ray.config import AppConfig, ZmqSpec, largest_frame_bytes
from tokenrouter_ray.protocol import MsgKind, PeerReq, RouteState, SamplingSpec, encode_batch


def app(
    max_model_len: int, max_frame_mib: float, max_num_seqs: int = 64, kind: str = "zmq"
) -> AppConfig:
    return AppConfig.model_validate(
        {
            "models": {"m": {"path": "/nonexistent", "max_model_len": max_model_len}},
            "policy": {"name": "entropy"},
            "scheduler": {"max_num_seqs": max_num_seqs},
            "transport": {"kind": kind, kind: {"max_frame_mib": max_frame_mib}},
        }
    )


def test_the_largest_legitimate_frame_fits_the_bound() -> None:
    max_model_len, seqs = 4096, 8
    route = RouteState(
        ingress="ingress/" + "x" * 64,
        prompt_len=max_model_len // 2,
        anchors={f"model{i}": max_model_len for i in range(4)},
        endpoints={f"model{i}": f"model{i}/" + "r" * 64 for i in range(4)},
        counts={f"model{i}": max_model_len for i in range(4)},
        deadline=1e12,
    )
    sampling = SamplingSpec(temperature=0.7, seed=1 << 62, stop_token_ids=tuple(range(256)))
    batch = [
        PeerReq(
            rid=f"req-{i:064x}",
            src="ingress/" + "x" * 64,
            dst="model0/" + "r" * 64,
            kind=MsgKind.NEW,
            handoff_seq=1 << 40,
            tokens=[(1 << 31) - 1 - j for j in range(max_model_len)],
            committed=max_model_len,
            sampling=sampling,
            route=route,
        )
        for i in range(seqs)
    ]
    assert len(encode_batch(batch)) <= largest_frame_bytes(max_model_len, seqs)


def test_a_frame_cap_below_the_largest_frame_is_refused() -> None:
    assert app(8192, 16.0).transport.zmq.max_frame_bytes == 16 << 20  # 64 x 8192 fits 16 MiB
    with pytest.raises(ValidationError, match="max_frame_mib=1 is below model 'm'"):
        app(8192, 1.0)
    assert app(8192, 1.0, max_num_seqs=1).transport.zmq.max_frame_mib == 1.0
    # the unix transport's own cap, named by its own key
    assert app(8192, 16.0, kind="unix").transport.frames.max_frame_bytes == 16 << 20
    with pytest.raises(ValidationError, match=r"transport\.unix\.max_frame_mib=1 is below"):
        app(8192, 1.0, kind="unix")


def test_port_ranges_are_checked() -> None:
    assert ZmqSpec(port_range=(30000, 30015)).port_range == (30000, 30015)
    for bad in ((0, 10), (20, 10), (1, 70000)):
        with pytest.raises(ValidationError, match="port_range"):
            ZmqSpec(port_range=bad)
