"""Per-process CPU time from ``/proc``: what each process of a served app spends per token.

CPU time is ``utime + stime`` of ``/proc/<pid>/stat`` (all threads, not children), wake-ups
``voluntary_ctxt_switches`` over its threads; ``CpuWindow`` reads both at a window's start
and end. A process that went away mid-window reads as missing, not as zero.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

PROXY_TITLE = "ray::ProxyActor"
HAPROXY_MANAGER_TITLE = "ray::HAProxyManager"
HAPROXY_PROGRAM = "haproxy"
FRONT = ("proxy", "haproxy manager", "haproxy")  # Serve's processes before the app's
# the app's deployments besides the ingress and the models: name -> Serve deployment
SUPPORT = {"directory": "EndpointDirectory", "tuner": "Tuner"}
# plain Ray actors the app's deployments own: name -> the actor's process title (Ray's
# ``ray::<class>``, ``ray::<class>.<method>()`` during a call); counted beside SUPPORT
SUPPORT_ACTORS = {"directory state": "ray::EndpointDirectoryState"}


def cpu_seconds(pid: int, proc: str = "/proc") -> float | None:
    """CPU seconds a process has used (user + system), None if it is gone."""
    try:
        with open(f"{proc}/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()  # the name, in parentheses, may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _command_lines(proc: str) -> Iterator[tuple[int, list[str]]]:
    """``(pid, argv)`` of every process readable under ``proc``."""
    for entry in os.listdir(proc):
        if not entry.isdigit():
            continue
        try:
            with open(f"{proc}/{entry}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        yield int(entry), argv


def _titles(proc: str) -> Iterator[tuple[int, str]]:
    """``(pid, title)``: a process's command line as one string, without the padding a
    process title set by Ray ends in."""
    for pid, argv in _command_lines(proc):
        yield pid, " ".join(argv).rstrip()


def find_pids(title: str, proc: str = "/proc") -> list[int]:
    """Processes whose command line starts with ``title`` (a Ray worker's title)."""
    return sorted(pid for pid, text in _titles(proc) if text.startswith(title))


def find_deployment_pids(deployment: str, proc: str = "/proc") -> list[int]:
    """Serve replicas of ``deployment`` (any app): Ray titles a replica's process
    ``ray::ServeReplica:<app>:<deployment>``, and while it runs one of the actor's methods
    ``...:<deployment>.<method>()`` (a read during a call found no directory once in twelve
    runs)."""
    title = re.compile(rf"ray::ServeReplica:.*:{re.escape(deployment)}(\.\w+(\(\))?)?")
    return sorted(pid for pid, text in _titles(proc) if title.fullmatch(text))


def find_program(name: str, proc: str = "/proc") -> list[int]:
    """Processes whose program (the command line's first word) is called ``name``."""
    return sorted(pid for pid, argv in _command_lines(proc) if os.path.basename(argv[0]) == name)


def wakeups(pid: int, proc: str = "/proc") -> int | None:
    """Times the threads of a process blocked and were woken again, since each started
    (``voluntary_ctxt_switches`` of every ``/proc/<pid>/task/<tid>/status``); None if it is
    gone. Threads that ended before the read are not counted."""
    try:
        tids = os.listdir(f"{proc}/{pid}/task")
    except OSError:
        return None
    total = 0
    for tid in tids:
        try:
            with open(f"{proc}/{pid}/task/{tid}/status") as f:
                total += next(
                    int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt")
                )
        except (OSError, StopIteration, ValueError, IndexError):
            continue  # the thread ended meanwhile
    return total


def wake_cost_us(rounds: int = 2000) -> float:
    """CPU microseconds one block-and-wake costs this machine: two threads hand a
    ``threading.Event`` back and forth ``rounds`` times (two wake-ups a round), their own
    CPU time (each thread's ``time.thread_time``: other threads of the process, Ray's in a
    test, do not count) divided by the wake-ups. Bare metal takes a few µs; a small VM tens.
    """
    ping, pong = threading.Event(), threading.Event()
    other_used: list[float] = []

    def other() -> None:
        started = time.thread_time()
        for _ in range(rounds):
            ping.wait()
            ping.clear()
            pong.set()
        other_used.append(time.thread_time() - started)

    thread = threading.Thread(target=other, daemon=True)
    thread.start()
    started = time.thread_time()
    for _ in range(rounds):
        ping.set()
        pong.wait()
        pong.clear()
    used = time.thread_time() - started
    thread.join()
    return (used + sum(other_used)) / (2 * rounds) * 1e6


class CpuWindow:
    """CPU seconds of named processes between ``start`` and ``stop``, and their wake-ups
    (``wakes`` after ``stop``)."""

    def __init__(self, pids: Mapping[str, int], proc: str = "/proc") -> None:
        self.pids, self.proc = dict(pids), proc
        self.before: dict[str, float | None] = {}
        self.woken: dict[str, int | None] = {}
        self.wakes: dict[str, int] = {}  # each process's wake-ups in the window

    def start(self) -> None:
        self.before = {name: cpu_seconds(pid, self.proc) for name, pid in self.pids.items()}
        self.woken = {name: wakeups(pid, self.proc) for name, pid in self.pids.items()}

    def stop(self) -> dict[str, float]:
        """Seconds each process used since ``start`` (those gone or not found left out)."""
        out = {}
        self.wakes = {}
        for name, pid in self.pids.items():
            now, then = cpu_seconds(pid, self.proc), self.before.get(name)
            if now is not None and then is not None:
                out[name] = now - then
            woken, was = wakeups(pid, self.proc), self.woken.get(name)
            if woken is not None and was is not None:
                self.wakes[name] = max(0, woken - was)
        return out


def app_pids(stats: dict[str, Any], proc: str = "/proc") -> dict[str, int]:
    """The served app's processes by name: the ingress and each model replica (their pids
    from the stats route), the app's other deployments and actors (``SUPPORT``,
    ``SUPPORT_ACTORS``) and Serve's front (``FRONT``), by process title or program. One app
    is served at a time: where a title matches several processes, the newest is taken."""
    pids = {"ingress": stats["pid"]} if "pid" in stats else {}
    pids |= {m: st["pid"] for m, st in stats.get("models", {}).items() if "pid" in st}
    found = {name: find_deployment_pids(d, proc) for name, d in SUPPORT.items()}
    found |= {name: find_pids(title, proc) for name, title in SUPPORT_ACTORS.items()}
    found |= {"proxy": find_pids(PROXY_TITLE, proc),
              "haproxy manager": find_pids(HAPROXY_MANAGER_TITLE, proc),  # Serve's HAProxy
              "haproxy": find_program(HAPROXY_PROGRAM, proc)}  # fmt: skip
    return pids | {name: p[-1] for name, p in found.items() if p}


def per_token_us(seconds: Mapping[str, float], tokens: float) -> dict[str, float]:
    """Microseconds of each process's CPU per committed token."""
    return {name: s / tokens * 1e6 for name, s in seconds.items()} if tokens > 0 else {}


def app_total_us(per_token: Mapping[str, float]) -> float:
    """The app's own processes together: the ingress and the model replicas (not Serve's
    front, ``FRONT``, which the direct port does without)."""
    return sum(v for name, v in per_token.items() if name not in FRONT)


def format_wakes(per_token: Mapping[str, float]) -> str:
    """``wake-ups per token ingress 0.10 / small 0.35``: how often each process's threads
    blocked and were woken again, per committed token."""
    if not per_token:
        return "wake-ups per token -"
    return "wake-ups per token " + " / ".join(f"{name} {v:.2f}" for name, v in per_token.items())


def format_cpu(per_token: Mapping[str, float]) -> str:
    """``ingress 227 / small 316 / large 195 / proxy 58 µs per token; app 738``."""
    if not per_token:
        return "CPU per token: -"
    parts = " / ".join(f"{name} {v:.0f}" for name, v in per_token.items())
    return f"CPU {parts} µs per token; app {app_total_us(per_token):.0f}"
