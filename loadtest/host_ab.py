"""Before / after for the host path: one measurement that runs on any checkout of this project.

    python -m loadtest.host_ab --levels 1,8,32,64                    # this checkout
    cd /path/to/older/checkout && PYTHONPATH=$PWD python /path/to/loadtest/host_ab.py ...

Closed loop on the in-process runtime (``simulation.loads.ClosedLoop``, which every tree
since the simulation backend has) at the ``paper`` (6.0 / 27.9 ms) and ``zero`` (1 µs) step
times, all-1 thresholds, and per level: committed tok/s (paper: beside the Markov
prediction), the process's CPU time per committed token (every sub-server, the ingress,
the event loop: the host path's whole cost on the zero profile), frames and messages
sent per committed token (counted by wrapping ``PeerChannel.send``, which every channel
goes through), and each model's critical path per step and launch-to-launch step period
(the step loop's ``HostProfile``: the profiled step is 6.0 / 27.9 ms on ``paper``). Only
APIs both trees share are used, so two checkouts run the same code.
Run the trees alternately, twice, on a quiet machine: the ratios mean more than the values.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from tokenrouter_ray.simulation.loads import ClosedLoop
from tokenrouter_ray.transport.base import PeerChannel
from tokenrouter_ray.tuning.examples import paper_r2r
from tokenrouter_ray.tuning.markov import throughput
from tokenrouter_ray.tuning.profile import ModelProfile, RoutingProfile

SENT = {"frames": 0, "messages": 0}
_send = PeerChannel.send


async def _counting_send(self, dst, msgs):  # type: ignore[no-untyped-def]
    if msgs:
        SENT["frames"] += 1
        SENT["messages"] += len(msgs)
    return await _send(self, dst, msgs)


PeerChannel.send = _counting_send  # type: ignore[method-assign]


def profile(name: str) -> RoutingProfile:
    p = paper_r2r()
    if name == "paper":
        return p
    models = (ModelProfile.constant("small", 0.001), ModelProfile.constant("large", 0.001))
    return RoutingProfile(models, p.route_prob, p.commit, p.grain_ms)


async def level(name: str, n: int, window_s: float, warmup_s: float) -> dict[str, float]:
    loop = ClosedLoop(profile(name), n, (1, 1))
    async with loop:
        await asyncio.sleep(warmup_s)
        sent0, cpu0 = dict(SENT), time.process_time()
        host0 = [host_totals(s) for s in loop.servers]
        m = await loop.measure(window_s, (1, 1))
        sent1, cpu1 = dict(SENT), time.process_time()
        host1 = [host_totals(s) for s in loop.servers]
    tokens = max(1.0, m.tokens)
    out = {
        "tok_s": m.throughput,
        "cpu_us_per_token": (cpu1 - cpu0) / tokens * 1e6,
        "frames_per_token": (sent1["frames"] - sent0["frames"]) / tokens,
        "messages_per_token": (sent1["messages"] - sent0["messages"]) / tokens,
    }
    for model, a, b in zip(("small", "large"), host0, host1, strict=True):
        steps, periods = b[0] - a[0], b[3] - a[3]
        out[f"{model}_critical_us"] = (b[1] - a[1]) / max(1, steps) * 1e6
        out[f"{model}_period_ms"] = (b[2] - a[2]) / periods * 1e3 if periods else float("nan")
    return out


def host_totals(server: object) -> tuple[int, float, float, int]:
    """(steps, critical-path seconds, launch-to-launch seconds, back-to-back steps) so far:
    the replica's ``HostProfile`` (every tree with the step loop has these fields: on the
    replica itself since replica/step.py, on its ``steps`` before)."""
    p = getattr(server, "profile", None) or server.steps.profile  # type: ignore[attr-defined]
    return p.steps, p.critical_s, p.period_s, p.periods


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--levels", default="1,8,32,64")
    parser.add_argument("--profiles", default="paper,zero")
    parser.add_argument("--window-s", type=float, default=4.0)
    parser.add_argument("--warmup-s", type=float, default=1.0)
    parser.add_argument("--label", default="", help="printed in front of each line")
    args = parser.parse_args(argv)
    for name in args.profiles.split(","):
        for n in (int(x) for x in args.levels.split(",")):
            r = asyncio.run(level(name, n, args.window_s, args.warmup_s))
            pred = throughput(paper_r2r(), n, (1, 1)).throughput if name == "paper" else None
            ratio = f" ({r['tok_s'] / pred:.1%} of Markov {pred:.1f})" if pred else ""
            print(
                f"{args.label}{name:5} N={n:3} {r['tok_s']:9.1f} tok/s{ratio}  CPU "
                f"{r['cpu_us_per_token']:6.0f} µs/token  frames/token "
                f"{r['frames_per_token']:.3f}  messages/token {r['messages_per_token']:.3f}  "
                f"critical path small/large {r['small_critical_us']:4.0f}/"
                f"{r['large_critical_us']:4.0f} µs  step period small/large "
                f"{r['small_period_ms']:.2f}/{r['large_period_ms']:.2f} ms",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
