"""Per-process CPU time from ``/proc``: what each process of a served app spends per token.

A process's CPU time is ``utime + stime`` of ``/proc/<pid>/stat`` (all its threads; not its
children), in clock ticks (``SC_CLK_TCK``, 100 a second on Linux: a 4 s window resolves
0.25 %). ``CpuWindow`` reads it for a set of named processes at the start and the end of a
measurement window; ``per_token_us`` divides each process's share by the tokens committed in
it; ``format_cpu`` writes the line the host-path benchmark prints beside each level
(``ingress 227 / small 316 / large 195 / proxy 58 µs per token; app 738``).

The processes: the ingress and each model replica say their own pid on the app's stats route
(``GET /v1/tokenrouter/stats``: ``pid``, ``models.<m>.pid``); Serve's HTTP proxy is found
by its process title (``ray::ProxyActor``, which Ray sets; ``find_pids``); under Serve's
HAProxy ingress (``RAY_SERVE_ENABLE_HA_PROXY=1``) also the actor that configures HAProxy
(``ray::HAProxyManager``) and HAProxy itself (``find_program``). These are Serve's front
(``FRONT``), reported beside the app but not in its total. A process that went away
mid-window reads as missing, not as zero.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping

PROXY_TITLE = "ray::ProxyActor"
HAPROXY_MANAGER_TITLE = "ray::HAProxyManager"
HAPROXY_PROGRAM = "haproxy"
FRONT = ("proxy", "haproxy manager", "haproxy")  # Serve's processes before the app's


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


def find_pids(title: str, proc: str = "/proc") -> list[int]:
    """Processes whose command line starts with ``title`` (a Ray worker's title)."""
    return sorted(pid for pid, argv in _command_lines(proc) if " ".join(argv).startswith(title))


def find_program(name: str, proc: str = "/proc") -> list[int]:
    """Processes whose program (the command line's first word) is called ``name``."""
    return sorted(pid for pid, argv in _command_lines(proc) if os.path.basename(argv[0]) == name)


class CpuWindow:
    """CPU seconds of named processes between ``start`` and ``stop``."""

    def __init__(self, pids: Mapping[str, int], proc: str = "/proc") -> None:
        self.pids, self.proc = dict(pids), proc
        self.before: dict[str, float | None] = {}

    def start(self) -> None:
        self.before = {name: cpu_seconds(pid, self.proc) for name, pid in self.pids.items()}

    def stop(self) -> dict[str, float]:
        """Seconds each process used since ``start`` (those gone or not found left out)."""
        out = {}
        for name, pid in self.pids.items():
            now, then = cpu_seconds(pid, self.proc), self.before.get(name)
            if now is not None and then is not None:
                out[name] = now - then
        return out


def per_token_us(seconds: Mapping[str, float], tokens: float) -> dict[str, float]:
    """Microseconds of each process's CPU per committed token."""
    return {name: s / tokens * 1e6 for name, s in seconds.items()} if tokens > 0 else {}


def app_total_us(per_token: Mapping[str, float]) -> float:
    """The app's own processes together: the ingress and the model replicas (not Serve's
    front, ``FRONT``, which the direct port does without)."""
    return sum(v for name, v in per_token.items() if name not in FRONT)


def format_cpu(per_token: Mapping[str, float]) -> str:
    """``ingress 227 / small 316 / large 195 / proxy 58 µs per token; app 738``."""
    if not per_token:
        return "CPU per token: -"
    parts = " / ".join(f"{name} {v:.0f}" for name, v in per_token.items())
    return f"CPU {parts} µs per token; app {app_total_us(per_token):.0f}"
