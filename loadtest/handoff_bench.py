"""One-way latency of a PeerReq handoff between two endpoints, per transport.

    python -m loadtest.handoff_bench [--rounds 2000] [--two-nodes]

Two endpoints play ping-pong with a realistic handoff (8 tokens, sampling params, the
request's `RouteState` as every real HANDOFF carries it: ingress, both models' anchors and
replica endpoints, committed counts, handoffs, deadline; a small `extras`). The encoded
frame size is printed first. Each message is stamped with `time.time_ns()` when built
(`PeerReq.sent_at`) and the receiver records `time.time_ns() - sent_at` on arrival: on one
machine both ends read the same clock, so this is a true one-way figure (encode, transport,
wake-up, decode). Only one message is in flight at a time, so there is no queueing; RTT/2
is printed as a check.

Endpoints: `inproc` is two channels on one event loop of this process. The others are two
Ray actors (separate processes) on one node: ZeroMQ ipc://, ZeroMQ tcp://127.0.0.1, and
the Ray channel in inbox mode (the one Serve replicas use) and direct mode. `--two-nodes`
starts a two-node `ray.cluster_utils.Cluster` on this machine, pins the two actors to
different nodes (custom resources node_a / node_b) and runs zmq-tcp and Ray.

Data enters as command-line flags; results leave as a table on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

from loadtest.common import percentile
from tokenrouter_ray.protocol import MsgKind, PeerReq, RouteState, SamplingSpec, encode_batch
from tokenrouter_ray.transport import (
    Directory,
    InMemoryDirectory,
    InProcChannel,
    InProcHub,
    PeerChannel,
    ZmqChannel,
    ZmqConfig,
)

SINGLE_NODE_KINDS = ("inproc", "zmq-ipc", "zmq-tcp", "ray-inbox", "ray-direct")
TWO_NODE_KINDS = ("zmq-tcp", "ray-inbox", "ray-direct")
PEER_NAMESPACE = "tokenrouter-bench"
SAMPLING = SamplingSpec(temperature=0.7, top_p=0.95, top_k=50, seed=1234, max_tokens=512)
# Serve replica ids are 8 characters (``replica_id.unique_id``); endpoints are model/replica.
ROUTE = RouteState(
    ingress="ingress/k3x9q2wa",
    prompt_len=412,
    anchors={"small": 812, "large": 805},
    endpoints={"small": "small/p0d7m1zc", "large": "large/7hn2v8re"},
    counts={"small": 261, "large": 139},
    handoffs=118,
    deadline=1_767_225_600.125,
)


def handoff_msg(i: int, src: str, dst: str) -> PeerReq:
    """A realistic mid-request handoff (with its ``RouteState``); `sent_at` is stamped now."""
    return PeerReq(
        rid=f"chatcmpl-{i:012d}",
        src=src,
        dst=dst,
        kind=MsgKind.HANDOFF,
        handoff_seq=i,
        tokens=[151644 - k * 977 for k in range(8)],
        anchor=812 + i,
        committed=7,
        sampling=SAMPLING,
        route=ROUTE,
        extras={"router_score": 0.83},
    )


def frame_bytes() -> int:
    """Bytes of one handoff as it leaves a channel (a one-message batch frame)."""
    return len(encode_batch([handoff_msg(0, "small/p0d7m1zc", "large/7hn2v8re")]))


def make_channel(
    kind: str, model: str, directory: Directory, hub: InProcHub | None, tcp_host: str = "127.0.0.1"
) -> Any:
    if kind == "inproc":
        assert hub is not None
        return InProcChannel(model, "0", directory, hub)
    if kind in ("zmq-ipc", "zmq-tcp"):
        transport = "ipc" if kind == "zmq-ipc" else "tcp"
        config = ZmqConfig(transport=transport, bind_host=tcp_host)
        return ZmqChannel(model, "0", directory, config)
    from tokenrouter_ray.transport.ray_channel import RayChannel, RayHost

    host = RayHost.current("peer_deliver", PEER_NAMESPACE) if kind == "ray-direct" else None
    return RayChannel(model, "0", directory, host=host)


@dataclass
class Samples:
    one_way_ns: list[int]
    rtt_ns: list[int]


async def ping(
    channel: PeerChannel, dst: str, rounds: int, warmup: int, budget_s: float
) -> Samples:
    """Ping-pong `rounds` times after `warmup`; one-way samples of the pong direction."""
    one_way, rtt = [], []
    deadline = time.monotonic() + budget_s
    for i in range(warmup + rounds):
        start = time.perf_counter_ns()
        await channel.send(dst, [handoff_msg(i, channel.name, dst)])
        reply = (await channel.recv())[0]
        arrived = time.time_ns()
        if i >= warmup:
            rtt.append(time.perf_counter_ns() - start)
            one_way.append(arrived - reply.sent_at)
            if time.monotonic() > deadline:
                break
    return Samples(one_way, rtt)


async def pong(channel: PeerChannel, warmup: int, one_way: list[int]) -> None:
    """Answer every ping with a fresh message; record one-way samples of the ping direction."""
    async for batch in channel:
        arrived = time.time_ns()
        msg = batch[0]
        if msg.handoff_seq >= warmup:
            one_way.append(arrived - msg.sent_at)
        await channel.send(msg.src, [handoff_msg(msg.handoff_seq, channel.name, msg.src)])


async def bench_inproc(rounds: int, warmup: int, budget_s: float) -> Samples:
    directory, hub = InMemoryDirectory(), InProcHub()
    a = make_channel("inproc", "ping", directory, hub)
    b = make_channel("inproc", "pong", directory, hub)
    await a.start()
    await b.start()
    forward: list[int] = []
    ponger = asyncio.create_task(pong(b, warmup, forward))
    samples = await ping(a, "pong/0", rounds, warmup, budget_s)
    await b.close()
    await ponger
    await a.close()
    return Samples(forward + samples.one_way_ns, samples.rtt_ns)


def define_peer_actor() -> Any:
    import ray

    @ray.remote(num_cpus=0)
    class BenchPeer:
        """One endpoint in its own process; hosts one channel at a time."""

        def __init__(self, directory: Directory, model: str) -> None:
            self.directory, self.model = directory, model
            self.channel: Any = None
            self.forward: list[int] = []
            self.ponger: asyncio.Task[None] | None = None

        async def open(self, kind: str, node_ip: bool) -> str:
            host = ray.util.get_node_ip_address() if node_ip else "127.0.0.1"
            self.channel = make_channel(kind, self.model, self.directory, None, host)
            await self.channel.start()
            return self.channel.address

        async def peer_deliver(self, sender: str, n: int, frame: bytes) -> None:
            self.channel.deliver(sender, n, frame)

        async def serve_pongs(self, warmup: int) -> None:
            self.forward = []
            self.ponger = asyncio.create_task(pong(self.channel, warmup, self.forward))

        async def ping(self, dst: str, rounds: int, warmup: int, budget_s: float) -> Samples:
            return await ping(self.channel, dst, rounds, warmup, budget_s)

        async def close(self) -> list[int]:
            await self.channel.close()
            if self.ponger is not None:
                await self.ponger
                self.ponger = None
            return self.forward

        def node_id(self) -> str:
            return ray.get_runtime_context().get_node_id()

    return BenchPeer


async def bench_actors(peers: tuple[Any, Any], kind: str, args: argparse.Namespace) -> Samples:
    """Ping-pong between the two actors over a fresh `kind` channel.

    With `--two-nodes` the tcp mailboxes bind the node IP instead of the loopback address.
    """
    pinger, ponger = peers
    addresses = await asyncio.gather(
        pinger.open.remote(kind, args.two_nodes), ponger.open.remote(kind, args.two_nodes)
    )
    print(f"{kind:<11} {addresses[0]}  <->  {addresses[1]}", flush=True)
    await ponger.serve_pongs.remote(args.warmup)
    samples: Samples = await pinger.ping.remote("pong/0", args.rounds, args.warmup, args.budget_s)
    forward = await ponger.close.remote()
    await pinger.close.remote()
    return Samples(forward + samples.one_way_ns, samples.rtt_ns)


def start_ray(two_nodes: bool) -> tuple[Any, Any]:
    """Start Ray (one node, or a two-node local Cluster); returns (ray, cluster or None)."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    cluster = None
    if two_nodes:
        from ray.cluster_utils import Cluster

        cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 1, "resources": {"node_a": 1}, "include_dashboard": False},
        )
        cluster.add_node(num_cpus=1, resources={"node_b": 1})
        ray.init(address=cluster.address, log_to_driver=False)
    else:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    return ray, cluster


async def run_actor_benches(
    args: argparse.Namespace, kinds: list[str], results: dict[str, Samples]
) -> None:
    from tokenrouter_ray.transport.ray_channel import RayDirectory

    directory = await asyncio.to_thread(RayDirectory.get_or_create, "bench-directory")
    peer = define_peer_actor()
    pins = [{"node_a": 0.01}, {"node_b": 0.01}] if args.two_nodes else [{}, {}]
    peers = tuple(
        peer.options(name=model, namespace=PEER_NAMESPACE, resources=pin).remote(directory, model)
        for model, pin in zip(("ping", "pong"), pins, strict=True)
    )
    nodes = await asyncio.gather(*(p.node_id.remote() for p in peers))
    print(
        f"endpoints on {'different nodes' if nodes[0] != nodes[1] else 'one node'}: "
        f"{[n[:12] for n in nodes]}",
        flush=True,
    )
    for kind in kinds:
        results[kind] = await bench_actors(peers, kind, args)
        report_line(kind, results[kind])


def report_line(kind: str, s: Samples) -> None:
    us = [v / 1000 for v in s.one_way_ns]
    half_rtt = [v / 2000 for v in s.rtt_ns]
    print(
        f"{kind:<11} n={len(us):>5}  one-way p50 {percentile(us, 0.5):8.1f} us  "
        f"p99 {percentile(us, 0.99):8.1f} us  mean {statistics.fmean(us):8.1f} us   "
        f"(RTT/2 p50 {percentile(half_rtt, 0.5):8.1f} us)",
        flush=True,
    )


def machine() -> str:
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    python = platform.python_version()
    return f"{platform.node()}: {os.cpu_count()} CPUs (nproc), {model}; Python {python}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2000, help="ping-pong rounds per transport")
    parser.add_argument("--warmup", type=int, default=200, help="rounds discarded first")
    parser.add_argument("--budget-s", type=float, default=8.0, help="time cap per transport")
    parser.add_argument("--two-nodes", action="store_true", help="two-node local Ray cluster")
    parser.add_argument("--kinds", nargs="*", help=f"subset of {', '.join(SINGLE_NODE_KINDS)}")
    args = parser.parse_args(argv)
    kinds = args.kinds or list(TWO_NODE_KINDS if args.two_nodes else SINGLE_NODE_KINDS)
    print("handoff latency:", machine())
    print(
        "reproduce: python -m loadtest.handoff_bench "
        + " ".join(sys.argv[1:] if argv is None else argv)
    )
    print(
        "one-way = receiver's time.time_ns() - PeerReq.sent_at, one message in flight",
        flush=True,
    )
    print(f"handoff frame: {frame_bytes()} bytes (8 tokens, sampling, RouteState, extras)\n")

    began = time.monotonic()
    results: dict[str, Samples] = {}
    if "inproc" in kinds:
        results["inproc"] = asyncio.run(bench_inproc(args.rounds, args.warmup, args.budget_s))
        report_line("inproc", results["inproc"])
    actor_kinds = [k for k in kinds if k != "inproc"]
    if actor_kinds:
        t0 = time.monotonic()
        ray, cluster = start_ray(args.two_nodes)
        print(f"(ray started in {time.monotonic() - t0:.1f} s)", flush=True)
        try:
            asyncio.run(run_actor_benches(args, actor_kinds, results))
        finally:
            ray.shutdown()
            if cluster is not None:
                cluster.shutdown()
    print(f"\ntotal {time.monotonic() - began:.1f} s")


if __name__ == "__main__":
    main()
