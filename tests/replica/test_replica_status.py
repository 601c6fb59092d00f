"""A replica's info and status (``replica/status.py``): built from a running model replica
without Ray, typed across the process boundary (pickled, as Ray sends them), and written as
the JSON the stats route has always served."""

from __future__ import annotations

import asyncio
import json
import pickle

from tokenrouter_ray.replica.status import (
    HostSteps,
    ReplicaInfo,
    ReplicaStatus,
    SimDevice,
    replica_info,
    replica_status,
)
from tokenrouter_ray.replica.window import WindowSnapshot
from tokenrouter_ray.simulation.loads import ClosedLoop
from tokenrouter_ray.thresholds import ThresholdTable
from tokenrouter_ray.tuning.examples import paper_r2r

STATUS_KEYS = [
    "model", "endpoint", "pid", "requests", "tracked", "waiting", "running", "pending",
    "active_requests", "threshold", "deferred_timeouts", "kv_blocks_used", "kv_blocks_total",
    "alive", "address", "peer_rejected", "steps", "host", "bytes_sent", "frames_sent", "sim",
    "gc",
]  # fmt: skip


def test_info_and_status_of_a_running_sub_server() -> None:
    async def run() -> list[tuple[ReplicaInfo, ReplicaStatus, ThresholdTable]]:
        loop = ClosedLoop(paper_r2r(), 4, (1, [1, 1, 2]), time_scale=0.05)
        async with loop:
            await loop.measure(0.3)
            for server in loop.servers:  # through the call queue, as the deployment asks
                assert isinstance(await replica_info(server, "node-1"), ReplicaInfo)
                assert isinstance(await replica_status(server), ReplicaStatus)

            def now(server) -> tuple[ReplicaInfo, ReplicaStatus, ThresholdTable]:  # type: ignore[no-untyped-def]
                sim = SimDevice.of(server.engine.device_stats)
                info, status = ReplicaInfo.of(server, "node-1"), ReplicaStatus.of(server, sim)
                return info, status, server.engine.batch_thresholds

            # all three at one point between two steps, on the step thread
            return [await server.call(lambda s=server: now(s)) for server in loop.servers]

    for info, status, table in asyncio.run(run()):
        assert isinstance(info.batch_thresholds, ThresholdTable)
        assert info.batch_thresholds == table
        assert isinstance(info.routing_stats, WindowSnapshot) and info.routing_stats.steps
        assert info.node_id == "node-1" and info.steps == status.steps > 0
        assert pickle.loads(pickle.dumps(info)) == info  # what crosses Ray
        assert pickle.loads(pickle.dumps(status)) == status
        assert isinstance(status.host, HostSteps) and status.host.steps > 0
        assert status.sim is not None and status.sim.steps > 0 and status.alive

        body = json.loads(json.dumps(status.to_json()))
        assert list(body) == STATUS_KEYS
        assert body["host"]["per_step_us"]["critical"] > 0
        assert set(body["host"]["message_latency_us"]) == {"received", "applied"}
        assert body["active_requests"] >= body["requests"] and body["threshold"] >= 1
        assert set(body["sim"]) == {"steps", "mean_batch", "busy_s", "mean_gap_ms"}
        readable = json.loads(json.dumps(info.to_json()))
        assert readable["batch_thresholds"] == list(table)
        assert readable["routing_stats"] == info.routing_stats.to_json()


def test_a_real_runner_has_no_sim_device() -> None:
    assert SimDevice.of(None) is None
    assert SimDevice.of(object()) is None
