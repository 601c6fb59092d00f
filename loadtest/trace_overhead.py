"""What the routing trace and the per-request metrics cost (issue 16): LocalRuntime on the
demo pair under R2R with its trained router, N concurrent greedy requests of a fixed length.

Rounds alternate between modes so that load from other processes hits them alike:

- ``off``: plain requests (the per-request metrics are always on, so this is also the
  build's baseline for them);
- ``on``: every request with ``routing_trace`` (scores copied to the host, a TokenInfo per
  committed token, drops carried to the ingress);
- ``logprobs``: every request with logprobs and 5 alternatives.

Each round reports output tokens per wall second, process CPU seconds per 1000 tokens
(CPU time is less disturbed by other processes on a shared machine than wall time), and the
CPU time per token of the host code the feature touches, measured with the thread's CPU
clock around it: ``Replica.commit`` (the policy's sends, the engine's commit),
``Replica.report`` (the COMMIT / HANDOFF / FINISHED messages: TokenInfo, HANDOFF sizes,
route-state metrics), ``Replica._note_queued``, ``IngressCore._on_message`` (the commit log
with writers and reports) and ``IngressCore.release`` (what a build lacks is named at the
start and not timed; a build from before ``ingress/`` and ``replica/`` needs the copy of this
file from its own tree). That figure is precise where wall time is not: the
feature's cost at N is its change divided by the CPU per token. The summary gives the
median per mode and each mode's ratio to ``off``. Run it from a checkout
of an older commit (``git worktree add /tmp/base <commit>``, copy this file there, run it
from there with ``--modes off``) to compare builds: that build has no trace field, so only
``off`` runs there.

    python -m loadtest.trace_overhead [--concurrency 8] [--tokens 64] [--rounds 6]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import threading
import time

import msgspec

from loadtest.common import chat_prompts, command, demo_pair, demo_r2r_policy, machine
from tokenrouter_ray.engine.engine import Engine
from tokenrouter_ray.ingress.core import IngressCore
from tokenrouter_ray.local import LocalRuntime
from tokenrouter_ray.protocol import SamplingSpec
from tokenrouter_ray.replica.step import Replica

MODES = {"off": {}, "on": {"trace": True}, "logprobs": {"logprobs": 5}}
HOST = [  # (class, method) timed with the thread's CPU clock, where this build has them
    (Replica, "commit"),
    (Replica, "report"),
    (Replica, "_note_queued"),
    (IngressCore, "_on_message"),
    (IngressCore, "release"),
]
host_cpu = [0.0]  # seconds in the HOST methods
host_lock = threading.Lock()


def time_host_code() -> None:
    timed_names, missing = [], []
    for cls, name in HOST:
        method = getattr(cls, name, None)
        if method is None:
            missing.append(name if cls is None else f"{cls.__name__}.{name}")
            continue
        timed_names.append(f"{cls.__name__}.{name}")

        def timed(*args, _method=method, **kwargs):
            t0 = time.thread_time()
            try:
                return _method(*args, **kwargs)
            finally:
                spent = time.thread_time() - t0
                with host_lock:  # the models' worker threads time _note_queued
                    host_cpu[0] += spent

        setattr(cls, name, timed)
    print(f"host code timed: {', '.join(timed_names)} (not in this build: {', '.join(missing)})")


async def run_rounds(
    engines: list[Engine], prompts: list[list[int]], tokens: int, modes: list[str], rounds: int
) -> dict[str, list[tuple[float, float]]]:
    policy = demo_r2r_policy()
    base = SamplingSpec(temperature=0.0, max_tokens=tokens, seed=7, ignore_eos=True)
    results: dict[str, list[tuple[float, float, float]]] = {m: [] for m in modes}
    async with LocalRuntime([("small", engines[0]), ("large", engines[1])], policy) as rt:
        await rt.complete_all(prompts, base)  # warm-up
        for r in range(rounds):
            for mode in modes if r % 2 == 0 else modes[::-1]:
                spec = msgspec.structs.replace(base, **MODES[mode])
                wall, cpu, host_cpu[0] = time.perf_counter(), time.process_time(), 0.0
                done = await rt.complete_all(prompts, spec)
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                n = sum(len(d.token_ids) for d in done)
                assert n == len(prompts) * tokens, n
                host_us = 1e6 * host_cpu[0] / n
                results[mode].append((n / wall, 1000 * cpu / n, host_us))
                print(
                    f"round {r} {mode:>8}: {n / wall:7.1f} tok/s  {1000 * cpu / n:6.3f} "
                    f"CPU s/1k tok  host {host_us:6.1f} us/tok  load {os.getloadavg()[0]:.2f}",
                    flush=True,
                )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--modes", default="off,on", help="of: " + ",".join(MODES))
    args = parser.parse_args()
    modes = args.modes.split(",")
    engines, tokenizer, label = demo_pair()
    prompts = chat_prompts(tokenizer, args.concurrency)
    start_load = os.getloadavg()
    time_host_code()
    results = asyncio.run(run_rounds(engines, prompts, args.tokens, modes, args.rounds))
    print(
        f"\nMachine: {machine()}\nPair: SmolLM2-135M-Instruct (large) + {label} (small); R2R "
        f"with the demo router; N={args.concurrency}, {args.tokens} tokens per request, "
        f"{args.rounds} rounds per mode, alternating\nLoad average: start "
        f"{start_load[0]:.2f} {start_load[1]:.2f} {start_load[2]:.2f}, end "
        + " ".join(f"{v:.2f}" for v in os.getloadavg())
        + "\n"
    )
    print(
        "| mode | median tok/s | vs off | median CPU s / 1k tok | vs off | "
        "host code µs / tok | host change / CPU per tok |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    med = {
        mode: [statistics.median(r[i] for r in rows) for i in range(3)]
        for mode, rows in results.items()
    }
    for mode, (tps, cpu, host) in med.items():
        if "off" in med and mode != "off":
            off_tps, off_cpu, off_host = med["off"]
            print(
                f"| {mode} | {tps:.1f} | {tps / off_tps - 1:+.1%} | {cpu:.3f} | "
                f"{cpu / off_cpu - 1:+.1%} | {host:.1f} | {(host - off_host) / (1e3 * cpu):+.2%} |"
            )
        else:
            print(f"| {mode} | {tps:.1f} | – | {cpu:.3f} | – | {host:.1f} | – |")
    print(f"\nReproduce: {command()}")


if __name__ == "__main__":
    main()
