"""What one model replica says about itself: ``ReplicaInfo`` and ``ReplicaStatus``.

Both are msgspec structs built here, from a ``Replica`` and its engine, without Ray, on the
replica's step thread (``replica_info`` and ``replica_status`` send the build through its
call queue): the model-server deployment (``deployments/model_server.py``) returns them from
its ``info`` and ``status`` handle methods and they cross Ray typed. ``ReplicaInfo`` is what
the ingress needs to start (``max_model_len``, ``vocab_size``) plus where the replica runs,
its statistics window and the thresholds it runs with; ``ReplicaStatus`` is cheap (no window
snapshot): what the replica holds now, its channel's counts, host time per step phase
(``HostSteps``) and, for a simulated model, its device (``SimDevice``). ``to_json`` is the
readable form: ``ReplicaStatus.to_json()`` is each model's entry of ``GET
/v1/tokenrouter/stats``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import msgspec

from tokenrouter_ray.host_gc import collector_stats
from tokenrouter_ray.replica.window import WindowSnapshot
from tokenrouter_ray.thresholds import ThresholdTable, json_hook

if TYPE_CHECKING:
    from tokenrouter_ray.replica.profile import HostProfile
    from tokenrouter_ray.replica.step import Replica


class HostSteps(msgspec.Struct):
    """The step loop's host time so far: steps, sampled rows, frames and messages handed to
    the channel, and the mean microseconds per step of each phase (``critical``, ``wait``,
    ``period`` included: ``HostProfile.per_step_us``)."""

    steps: int
    rows: int
    frames: int
    messages: int
    per_step_us: dict[str, float]
    message_latency_us: dict[str, float]  # built -> received here, -> applied by the loop
    periods: int  # back-to-back steps: what ``per_step_us["period"]`` averages over
    # messages applied by latency bucket (``replica/profile.py`` ``LATENCY_EDGES_US``)
    applied_hist: list[int] = []

    @classmethod
    def of(cls, profile: HostProfile) -> HostSteps:
        return cls(
            profile.steps,
            profile.rows,
            profile.frames,
            profile.messages,
            profile.per_step_us(),
            profile.message_latency_us(),
            profile.periods,
            list(profile.applied_hist),
        )


class SimDevice(msgspec.Struct):
    """A simulated model's device: steps, mean batch, busy seconds, mean gap between steps."""

    steps: int
    mean_batch: float
    busy_s: float
    mean_gap_ms: float

    @classmethod
    def of(cls, stats: Any) -> SimDevice | None:
        """From a simulated runner's ``stats`` (``simulation/backend.py`` ``SimStats``);
        None for anything else (a real model's runner has none)."""
        if stats is None or not hasattr(stats, "busy_s"):
            return None
        gaps = stats.gaps_s[-10_000:]
        mean_gap_ms = 1e3 * sum(gaps) / len(gaps) if gaps else 0.0
        return cls(stats.steps, stats.mean_batch, stats.busy_s, mean_gap_ms)


class ReplicaInfo(msgspec.Struct):
    """A replica's identity, limits and statistics (``ModelServer.info``)."""

    model: str
    endpoint: str
    max_model_len: int
    vocab_size: int
    node_id: str | None  # the Ray node it runs on (None outside Ray)
    active_requests: int
    steps: int
    kv_blocks_free: int
    kv_blocks_total: int
    routing_stats: WindowSnapshot  # the tuner's statistics window, now
    batch_thresholds: ThresholdTable  # the deferred-launch thresholds in use

    @classmethod
    def of(cls, server: Replica, node_id: str | None = None) -> ReplicaInfo:
        engine, status = server.engine, server.engine.status()
        return cls(
            model=server.name,
            endpoint=server.endpoint,
            max_model_len=engine.max_model_len,
            vocab_size=engine.vocab_size,
            node_id=node_id,
            active_requests=status.requests,
            steps=server.num_steps,
            kv_blocks_free=status.kv_blocks_free,
            kv_blocks_total=status.kv_blocks_total,
            routing_stats=server.stats.snapshot(),
            batch_thresholds=engine.batch_thresholds,
        )

    def to_json(self) -> dict[str, Any]:
        """The readable form (thresholds as a list, the window as ``WindowSnapshot.to_json``)."""
        return {
            name: (
                self.routing_stats.to_json()
                if name == "routing_stats"
                else msgspec.to_builtins(getattr(self, name), enc_hook=json_hook)
            )
            for name in self.__struct_fields__
        }


class ReplicaStatus(msgspec.Struct):
    """What a replica holds now (``ModelServer.status``; cheap: no statistics snapshot)."""

    model: str
    endpoint: str
    pid: int
    requests: int
    tracked: int  # requests with routing state here
    waiting: int
    running: int
    pending: int
    active_requests: int  # N the launch rule reads (the global count when known)
    threshold: int  # B at that N
    deferred_timeouts: int  # launches forced by max_defer_s
    kv_blocks_used: int
    kv_blocks_total: int
    alive: bool  # the model replica's loops run
    address: str  # the channel's address
    peer_rejected: dict[str, int]  # frames the channel refused, by reason
    steps: int
    host: HostSteps  # per-phase host time per step
    bytes_sent: int
    frames_sent: int
    sim: SimDevice | None  # a simulated model's device
    gc: dict[str, Any] = {}  # the garbage collector since start-up (host_gc.collector_stats)

    @classmethod
    def of(cls, server: Replica, sim: SimDevice | None = None) -> ReplicaStatus:
        status, channel = server.engine.status(), server.channel
        return cls(
            model=server.name,
            endpoint=server.endpoint,
            pid=os.getpid(),
            requests=status.requests,
            tracked=len(server.requests.tracked),
            waiting=status.waiting,
            running=status.running,
            pending=status.pending,
            active_requests=status.active_requests,
            threshold=status.threshold,
            deferred_timeouts=status.deferred_timeouts,
            kv_blocks_used=status.kv_blocks_used,
            kv_blocks_total=status.kv_blocks_total,
            alive=server.alive,
            address=channel.address,
            peer_rejected=dict(getattr(channel, "rejected", {})),
            steps=server.num_steps,
            host=HostSteps.of(server.profile),
            bytes_sent=channel.bytes_sent,
            frames_sent=channel.frames_sent,
            sim=sim,
            gc=collector_stats(),
        )

    def to_json(self) -> dict[str, Any]:
        """The readable form: one model's entry of ``GET /v1/tokenrouter/stats``."""
        return msgspec.to_builtins(self)


async def replica_info(replica: Replica, node_id: str | None = None) -> ReplicaInfo:
    """``ReplicaInfo.of(replica)``, built on its step thread."""
    return await replica.call(lambda: ReplicaInfo.of(replica, node_id), read_only=True)


async def replica_status(replica: Replica) -> ReplicaStatus:
    """``ReplicaStatus.of(replica)`` with a simulated model's device, built on its step
    thread."""

    def build() -> ReplicaStatus:
        return ReplicaStatus.of(replica, SimDevice.of(replica.engine.device_stats))

    return await replica.call(build, read_only=True)
