"""One frame's hop between two processes on one node, at idle: ZeroMQ over ipc:// (what the
app's replicas use) against a bare AF_UNIX datagram socket (the floor of a same-node
transport without an I/O thread).

    python -m loadtest hop-floor                      # gaps 0.5, 6 and 20 ms, 200 frames each
    python -m loadtest hop-floor --gaps-ms 6 --frames 400

A sender process sends one ~320-byte frame, stamped with ``time.perf_counter_ns()``, every
``gap`` (so each frame finds both sides asleep when the gap is long, as a first token does
behind a prefill); the receiver waits in ``select`` as a replica's step thread does and
records the one-way time on arrival (one machine, one clock). The sender's CPU per send is
its thread's CPU time around the send call. With ZeroMQ a frame crosses four threads: the
sender's, its I/O thread, the receiver's I/O thread and the receiver's; with a datagram
socket it goes from the sender's thread to the receiver's, and a wake-up after an idle
spell costs this VM the most (docs/benchmarks/README.md). What it measures is the
platform's floor, not the app: the target says whether a transport without an I/O thread
would have room to pay here.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import select
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass

import zmq

from loadtest.common import command, machine, percentile

KINDS = ("zeromq-ipc", "unix-datagram")
PAYLOAD = b"x" * 300
STAMP = 20  # digits of the send time at the frame's start
TARGET_RATIO = 2.0  # ZeroMQ's p50 within this factor of the bare socket's


@dataclass
class Hop:
    kind: str
    gap_s: float
    one_way_us: list[float]  # sorted
    send_cpu_us: float  # the sender's CPU per send, mean

    @property
    def p50(self) -> float:
        return percentile(self.one_way_us, 0.5)

    @property
    def p90(self) -> float:
        return percentile(self.one_way_us, 0.9)


def _receive(kind: str, address: str, frames: int, out: mp.Queue, ready: mp.Event) -> None:
    """The receiving process: bind, then wait in ``select`` for each frame; one-way µs."""
    one_way: list[float] = []
    if kind == "zeromq-ipc":
        sock = zmq.Context.instance().socket(zmq.PULL)
        sock.bind(address)
        fd = sock.getsockopt(zmq.FD)
        ready.set()
        while len(one_way) < frames:
            if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # its descriptor signals edges
                select.select([fd], [], [])
                continue
            frame = sock.recv(zmq.NOBLOCK)
            one_way.append((time.perf_counter_ns() - int(frame[:STAMP])) / 1e3)
        sock.close(linger=0)
    else:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(address)
        sock.setblocking(False)
        ready.set()
        while len(one_way) < frames:
            select.select([sock], [], [])
            try:
                frame = sock.recv(1 << 16)
            except BlockingIOError:
                continue
            one_way.append((time.perf_counter_ns() - int(frame[:STAMP])) / 1e3)
        sock.close()
    out.put(one_way)


def measure(kind: str, gap_s: float, frames: int) -> Hop:
    """``frames`` frames of ``kind``, one every ``gap_s``, to a receiver in another process."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}: one of {', '.join(KINDS)}")
    folder = tempfile.mkdtemp(prefix="hop-floor-")
    path = os.path.join(folder, "s")
    address = f"ipc://{path}" if kind == "zeromq-ipc" else path
    ctx = mp.get_context("spawn")
    out, ready = ctx.Queue(), ctx.Event()
    receiver = ctx.Process(target=_receive, args=(kind, address, frames, out, ready))
    receiver.start()
    close = None  # the sending socket's, once it exists
    try:
        if not ready.wait(60):
            raise RuntimeError("the receiving process did not start")
        if kind == "zeromq-ipc":
            push = zmq.Context.instance().socket(zmq.PUSH)
            close = lambda: push.close(linger=0)  # noqa: E731
            push.connect(address)
            send = push.send
            time.sleep(0.2)  # connected before the first frame
        else:
            sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            close = sender.close
            sender.connect(address)
            send = sender.send
        cpu_ns = 0
        for _ in range(frames):
            time.sleep(gap_s)
            c0 = time.thread_time_ns()
            send(b"%0*d" % (STAMP, time.perf_counter_ns()) + PAYLOAD)
            cpu_ns += time.thread_time_ns() - c0
        one_way = sorted(out.get(timeout=60))
    finally:
        receiver.join(10)
        if receiver.is_alive():
            receiver.kill()
        if close is not None:
            close()
        shutil.rmtree(folder, ignore_errors=True)
    return Hop(kind, gap_s, one_way, cpu_ns / frames / 1e3)


def pool(hops: list[Hop], kind: str, gap_s: float) -> Hop:
    """The rounds of one kind and gap as one sample."""
    same = [h for h in hops if h.kind == kind and h.gap_s == gap_s]
    one_way = sorted(v for h in same for v in h.one_way_us)
    return Hop(kind, gap_s, one_way, sum(h.send_cpu_us for h in same) / max(1, len(same)))


def targets(hops: list[Hop]) -> list[tuple[str, bool, str]]:
    """Per gap: ZeroMQ's one-way p50 within ``TARGET_RATIO`` of the bare socket's."""
    out = []
    for gap in sorted({h.gap_s for h in hops}):
        by_kind = {h.kind: h for h in hops if h.gap_s == gap}
        if set(by_kind) != set(KINDS):
            continue
        zmq_p50, floor = by_kind["zeromq-ipc"].p50, by_kind["unix-datagram"].p50
        ok = zmq_p50 <= TARGET_RATIO * floor
        out.append(
            (
                f"gap {gap * 1e3:g} ms: ZeroMQ's hop p50 <= {TARGET_RATIO:g}x a bare datagram's",
                ok,
                f"{zmq_p50:.0f} vs {floor:.0f} µs ({zmq_p50 / floor:.1f}x)",
            )
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gaps-ms", default="0.5,6,20", help="idle time before each frame")
    parser.add_argument("--frames", type=int, default=200, help="frames per kind and gap")
    parser.add_argument("--rounds", type=int, default=2, help="each kind, alternately")
    args = parser.parse_args(argv)
    gaps = [float(g) / 1e3 for g in args.gaps_ms.split(",")]
    print(f"# hop floor: {machine()}")
    print(f"# {command()}")
    hops: list[Hop] = []
    for gap in gaps:
        for _ in range(args.rounds):
            for kind in KINDS:
                hop = measure(kind, gap, args.frames)
                hops.append(hop)
                print(
                    f"{kind:14s} gap {gap * 1e3:5.1f} ms: one-way p50 {hop.p50:6.0f} µs, "
                    f"p90 {hop.p90:6.0f} µs; sender CPU per send {hop.send_cpu_us:5.1f} µs"
                )
    pooled = [pool(hops, kind, gap) for gap in gaps for kind in KINDS]  # the verdict's
    print("\n# targets (PASS / MISS; they never fail the run)")
    for name, ok, detail in targets(pooled):
        print(f"{'PASS' if ok else 'MISS'}  {name}: {detail}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
