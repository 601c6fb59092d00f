"""Where each process of the served app spends its CPU: py-spy on every app process during a
closed loop, the samples summed by area.

    pip install py-spy                                   # not a dependency: a dev tool
    python -m loadtest host-profile                      # h200 sim, N = 64, direct port, 15 s
    python -m loadtest host-profile --n 32 --proxy --profile paper --seconds 20
    python -m loadtest host-profile --summarize /tmp/host-profile   # re-read saved samples

The app is ``conf/sim_paper.yaml``'s (``loadtest/host_path.py``'s ``sim_overrides``) on a
local Ray cluster; ``n`` ``openai`` clients (streaming, or ``--client completions``) keep it
busy (the host path's served level). py-spy samples every app process (the ingress, each
model replica, Serve's proxy) at 200 Hz with ``--gil``: only the thread that holds the
interpreter is sampled, so a sample is Python CPU time (what the issue calls CPU per token,
less native work done without the GIL: ZeroMQ's I/O threads, the kernel's socket work).
The raw stacks go to ``<out>/<process>.txt``; the summary prints, per process,

- **areas**: each sample goes to the area of the innermost frame that belongs to one (Ray
  metrics, ZeroMQ's asyncio layer, frame MAC and codec, the detokenizer, the SSE writer,
  the HTTP server, asyncio's own machinery, the replica's step, the ingress core, Ray Serve
  and Ray internals); so "Ray metrics 11 %" is the share of the process's Python CPU spent
  inside Ray's metric calls and ours around them;
- the functions with the most **self** samples and the most **inclusive** samples.

Shares, not absolute time: multiply by the process's CPU per committed token from
``python -m loadtest host`` (``loadtest/proc_cpu.py``) for microseconds. py-spy costs the
sampled processes a little (it stops them for each sample), so take tok/s from a run
without it.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

from loadtest.common import command, machine
from loadtest.proc_cpu import HAPROXY_PROGRAM

# (area, path fragments of the frames that belong to it): the innermost frame that matches
# any area decides a sample's area; the order only breaks ties within one frame.
AREAS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Ray metrics", ("ray/util/metrics.py", "ray/serve/metrics.py", "deployments/ray_metrics.py",
                     "tokenrouter_ray/metrics/")),
    ("ZeroMQ asyncio layer", ("zmq/",)),
    ("frame MAC and codec", ("transport/auth.py", "/hmac.py", "tokenrouter_ray/protocol.py",
                             "msgspec")),
    ("detokenizer", ("openai/detokenizer.py", "transformers/tokenization", "transformers/utils")),
    ("SSE writer and choice updates", ("openai/sse.py", "openai/choice_update.py",
                                       "openai/token_reports.py", "/json/")),
    ("HTTP server (uvicorn, Starlette, FastAPI, our middleware)",
     ("uvicorn/", "starlette/", "fastapi/", "anyio/", "openai/request_id.py", "openai/auth.py",
      "ingress/direct_http.py", "ingress/http_app.py")),
    ("asyncio machinery", ("asyncio/",)),
    ("transport (channel, directory)", ("tokenrouter_ray/transport/",)),
    ("replica step (route, commit, messages, scheduler, engine)",
     ("tokenrouter_ray/replica/", "tokenrouter_ray/engine/", "tokenrouter_ray/routing/",
      "tokenrouter_ray/simulation/", "scheduler.py", "block_pool.py", "engine.py")),
    ("ingress core and OpenAI server", ("tokenrouter_ray/ingress/", "tokenrouter_ray/openai/")),
    ("Ray Serve and Ray internals", ("ray/",)),
)  # fmt: skip
OTHER = "other"
_FRAME = re.compile(r"^(?P<func>.*) \((?P<path>.*?)(?::(?P<line>\d+))?\)$")


@dataclass
class Profile:
    """One process's samples: totals by area, by function (self and inclusive), by thread."""

    samples: int
    areas: collections.Counter[str]
    self_time: collections.Counter[str]
    inclusive: collections.Counter[str]
    threads: collections.Counter[str]

    def share(self, counter: collections.Counter[str], key: str) -> float:
        return counter[key] / self.samples if self.samples else 0.0


def area_of(path: str) -> str | None:
    for area, fragments in AREAS:
        if any(f in path for f in fragments):
            return area
    return None


def _short(path: str) -> str:
    """A frame's file as a short name: from the package or site-packages root on."""
    for root in ("site-packages/", "tokenrouter_ray/", "deployments/", "loadtest/"):
        i = path.rfind(root)
        if i != -1:
            return path[i + (len(root) if root == "site-packages/" else 0) :]
    return os.path.basename(path)


def summarize(lines: Iterable[str]) -> Profile:
    """Sum py-spy's raw (collapsed) output: ``thread;frame;...;frame count`` per line, each
    frame ``function (path:line)``, outermost first."""
    areas: collections.Counter[str] = collections.Counter()
    self_time: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    threads: collections.Counter[str] = collections.Counter()
    total = 0
    for line in lines:
        line = line.rstrip("\n")
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        thread, *frames = stack.split(";")
        threads[thread] += n
        parsed = []
        for frame in frames:
            match = _FRAME.match(frame)
            func, path = (match["func"], match["path"]) if match else (frame, "")
            parsed.append((func, path))
        names = [f"{func} ({_short(path)})" for func, path in parsed]
        if names:
            self_time[names[-1]] += n
        for name in set(names):
            inclusive[name] += n
        area = next((a for _, p in reversed(parsed) if (a := area_of(p))), OTHER)
        areas[area] += n
    return Profile(total, areas, self_time, inclusive, threads)


def report(name: str, profile: Profile, top: int = 15) -> str:
    out = [f"== {name}: {profile.samples} samples (interpreter held)"]
    out.append("  by area:")
    for area, n in profile.areas.most_common():
        out.append(f"    {n / profile.samples:6.1%}  {area}")
    out.append("  self:")
    for func, n in profile.self_time.most_common(top):
        out.append(f"    {n / profile.samples:6.1%}  {func[:110]}")
    out.append("  inclusive:")
    skip = ("Thread.run", "Thread._bootstrap", "<module>")
    shown = [(f, n) for f, n in profile.inclusive.most_common() if not f.startswith(skip)]
    for func, n in shown[:top]:
        out.append(f"    {n / profile.samples:6.1%}  {func[:110]}")
    return "\n".join(out)


def summarize_dir(out: str, top: int) -> None:
    for entry in sorted(os.listdir(out)):
        if entry.endswith(".txt"):
            with open(os.path.join(out, entry)) as f:
                print(report(entry.removesuffix(".txt"), summarize(f), top))


def record(args: argparse.Namespace) -> int:
    from loadtest import host_path
    from loadtest.common import ray_serve_deploy

    spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    if not os.path.exists(spy):
        print("host-profile needs py-spy: pip install py-spy", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    overrides = host_path.sim_overrides(args.profile)
    if not args.proxy:
        overrides.append(f"ingress.direct_port={host_path.DIRECT_PORT}")
    deploy = ray_serve_deploy(args.port)
    with deploy(overrides, "host-profile") as base:
        url = base.removesuffix("/v1")
        client_url = url if args.proxy else f"http://127.0.0.1:{host_path.DIRECT_PORT}"
        asyncio.run(host_path._wait_ready(url))
        asyncio.run(host_path._wait_ready(client_url))
        pids = host_path.app_pids(asyncio.run(host_path._stats(url)))
        spies: list[subprocess.Popen[bytes]] = []

        def start_spies() -> None:  # after the level's warm-up
            time.sleep(args.warmup_s)
            for name, pid in pids.items():
                if name == HAPROXY_PROGRAM:  # Serve's HAProxy ingress: C, no Python stacks
                    continue
                out = f"{args.out}/{name}.txt"
                cmd = [spy, "record", "-p", str(pid), "-d", str(args.seconds), "-r", "200",
                       "-f", "raw", "--gil", "--threads", "-o", out]  # fmt: skip
                quiet = subprocess.DEVNULL
                spies.append(subprocess.Popen(cmd, stdout=quiet, stderr=quiet))

        starter = threading.Thread(target=start_spies)
        starter.start()
        window = args.seconds + args.warmup_s + 2.0
        row = asyncio.run(
            host_path._served_level(url, args.n, window, args.max_tokens, client_url, args.client)
        )
        starter.join()
        for p in spies:
            p.wait()
    cpu = row["cpu_us_per_token"]
    print(f"host-profile: {args.profile}, N={args.n}, {'proxy' if args.proxy else 'direct'}; "
          f"{row['tok_s']:.0f} tok/s under py-spy; CPU µs per committed token: "
          + " / ".join(f"{k} {v:.0f}" for k, v in cpu.items() if v is not None))  # fmt: skip
    summarize_dir(args.out, args.top)
    print(f"machine: {machine()}")
    print(f"reproduce: {command()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest host-profile",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--n", type=int, default=64, help="closed-loop clients")
    parser.add_argument("--profile", default="h200", help="sim step-time profile: h200, paper")
    parser.add_argument("--proxy", action="store_true", help="clients on Serve's proxy")
    parser.add_argument(
        "--client", choices=("stream", "completions"), default="stream",
        help="streamed chat completions or non-streamed completions (loadtest host's)",
    )  # fmt: skip
    parser.add_argument("--seconds", type=int, default=15, help="sampled window")
    parser.add_argument("--warmup-s", type=float, default=4.0)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--port", type=int, default=18124, help="Serve's HTTP port")
    parser.add_argument("--out", default="/tmp/host-profile", help="raw samples go here")
    parser.add_argument("--summarize", metavar="DIR", help="only summarize saved samples")
    args = parser.parse_args(argv)
    if args.summarize:
        summarize_dir(args.summarize, args.top)
        return 0
    return record(args)


if __name__ == "__main__":
    raise SystemExit(main())
