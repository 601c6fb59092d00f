"""Issue 26's served scenarios for ``loadtest.reliability_bench`` (same deployment, same
helpers): a client that stops reading, a restarted endpoint directory, a wedged step, and
a killed ingress. Each returns one JSON-able dict; see docs/reliability.md for the figures.

- ``slow_reader``: two raw-socket clients send a streaming ``n=16`` request each and never
  read; the ingress's and Serve proxy's resident memory (psutil) and the ingress's own
  count of buffered tokens are sampled; then the sockets close and everything must be free.
- ``directory_restart``: the EndpointDirectory replica's process is killed mid-stream, then
  the large model's: every stream must finish (none hangs), equal to an undisturbed run.
- ``wedged_step``: the large model's next step sleeps for an hour; with
  ``models.large.max_step_s`` set low, its health check fails, Serve restarts it, and the
  requests in flight are re-created: how long each phase took.
- ``ingress_kill``: SIGKILL of the ingress replica with 4 streams in flight: how long until
  the app answers again, and how long the models keep the orphaned requests.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import threading
import time
from typing import Any

import httpx
import openai

from loadtest import reliability_bench as rb
from loadtest.common import QUESTIONS


def _processes() -> dict[str, Any]:
    """The app's replica processes by deployment name, and Serve's proxy."""
    import psutil

    prefix = f"ServeReplica:{rb.APP}:"
    found: dict[str, Any] = {}
    for proc in psutil.process_iter(["cmdline"]):
        title = " ".join(proc.info["cmdline"] or [])
        if prefix in title:
            found[title.split(prefix, 1)[1].split()[0].split(".")[0]] = proc
        elif "ProxyActor" in title:
            found["proxy"] = proc
    return found


def _model_states() -> dict[str, dict[str, Any]]:
    return {
        m: rb.handle(m).status.remote().result(timeout_s=30).to_json() for m in ("small", "large")
    }


def _raw_stream(port: int, body: dict[str, Any]) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json"
        + f"\r\nContent-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return sock


def slow_reader(
    base: str, n: int = 16, max_tokens: int = 256, hold_s: float = 40
) -> dict[str, Any]:
    port = int(base.split(":")[2].split("/")[0])
    procs = _processes()
    rss0 = {k: procs[k].memory_info().rss for k in ("Ingress", "proxy") if k in procs}
    body = rb.chat(QUESTIONS[0], max_tokens, n=n, stream=True, ignore_eos=True)
    socks = [_raw_stream(port, body) for _ in range(2)]
    peak = {k: 0 for k in rss0}
    buffered_peak, t0 = 0, time.monotonic()
    stalls = 0
    while time.monotonic() - t0 < hold_s:
        for k in rss0:
            peak[k] = max(peak[k], procs[k].memory_info().rss - rss0[k])
        state = rb.stats(base)
        buffered_peak = max(buffered_peak, state.get("stream_buffered_tokens", 0))
        stalls = state.get("client_stalls", 0)
        time.sleep(0.5)
    held_open = rb.held(rb.stats(base))
    tokens = {m: s.get("steps") for m, s in _model_states().items()}
    for sock in socks:
        sock.close()
    closed = time.monotonic()
    seconds, state = rb.settle(base)
    return {
        "clients": 2,
        "n": n,
        "max_tokens": max_tokens,
        "held_s": hold_s,
        "rss_growth_mib": {k: round(v / 2**20, 1) for k, v in peak.items()},
        "ingress_buffered_tokens_peak": buffered_peak,
        "client_stalls": stalls,
        "held_while_open": held_open,
        "model_steps": tokens,
        "settled_after_close_s": seconds if seconds is None else round(seconds, 2),
        "close_to_clean_s": round(time.monotonic() - closed, 2),
        "leaked": state,
    }


def _streams(base: str, n: int, max_tokens: int) -> tuple[list[Any], list[threading.Event]]:
    client = rb.api(base)
    started = [threading.Event() for _ in range(n)]
    pool = concurrent.futures.ThreadPoolExecutor(n)
    futures = [
        pool.submit(rb.stream_answer, client, QUESTIONS[i % len(QUESTIONS)], max_tokens, ev)
        for i, ev in enumerate(started)
    ]
    pool.shutdown(wait=False)
    return futures, started


def _outcomes(futures: list[Any], want: list[str] | None, t_ref: float) -> dict[str, Any]:
    out = {"completed": 0, "equal_undisturbed": 0, "failed_with_error": 0, "hung": 0}
    done_at = t_ref
    for i, f in enumerate(futures):
        try:
            text = f.result(timeout=300)
            out["completed"] += 1
            out["equal_undisturbed"] += want is not None and text == want[i]
        except concurrent.futures.TimeoutError:
            out["hung"] += 1
        except openai.APIError:
            out["failed_with_error"] += 1
        done_at = max(done_at, time.monotonic())
    out["all_done_s"] = round(done_at - t_ref, 2)
    return out


def _undisturbed(base: str, n: int, max_tokens: int) -> list[str]:
    client = rb.api(base)
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        return list(
            pool.map(
                lambda i: rb.stream_answer(client, QUESTIONS[i % len(QUESTIONS)], max_tokens),
                range(n),
            )
        )


def directory_restart(base: str, n: int = 8, max_tokens: int = 64) -> dict[str, Any]:
    want = _undisturbed(base, n, max_tokens)
    secret = rb.handle("EndpointDirectory").peer_secret.remote().result()
    before = len(rb.stats(base)["recoveries"])
    futures, started = _streams(base, n, max_tokens)
    for ev in started:
        ev.wait(120)
    t0 = time.monotonic()
    _processes()["EndpointDirectory"].kill()
    time.sleep(1.0)
    os.kill(rb.handle("large").status.remote().result().pid, signal.SIGKILL)
    outcomes = _outcomes(futures, want, t0)
    back = rb.wait_healthy(base, 180)
    same_secret = rb.handle("EndpointDirectory").peer_secret.remote().result() == secret
    fresh = rb.stream_answer(rb.api(base), QUESTIONS[0], max_tokens)
    seconds, state = rb.settle(base)
    return {
        "requests_in_flight": n,
        "outcomes": outcomes,
        "same_secret_after_restart": same_secret,
        "healthy_checked_after_streams_s": None
        if back is None
        else round(time.monotonic() - t0, 1),
        "recoveries": rb.stats(base)["recoveries"][before:],
        "bad_mac_on_new_large": _model_states()["large"]["peer_rejected"].get("bad_mac", 0),
        "new_request_equal_undisturbed": fresh == want[0],
        "settled_s": seconds,
        "leaked": state,
    }


def wedged_step(base: str, n: int = 4, max_tokens: int = 64) -> dict[str, Any]:
    want = _undisturbed(base, n, max_tokens)
    old_pid = rb.handle("large").status.remote().result().pid
    before = len(rb.stats(base)["recoveries"])
    futures, started = _streams(base, n, max_tokens)
    for ev in started:
        ev.wait(120)
    rb.handle("large").inject_fault.remote("stall", 1, 3600.0).result()
    t0 = time.monotonic()
    replaced_s = None
    while time.monotonic() - t0 < 240 and replaced_s is None:
        try:
            pid = rb.handle("large").status.remote().result(timeout_s=5).pid
            if pid != old_pid:
                replaced_s = round(time.monotonic() - t0, 1)
        except Exception:  # the old replica is being stopped
            pass
        time.sleep(0.5)
    outcomes = _outcomes(futures, want, t0)
    with_old = [p for p in _processes_pids() if p == old_pid]
    seconds, state = rb.settle(base)
    return {
        "requests_in_flight": n,
        "wedge_to_new_replica_s": replaced_s,
        "outcomes": outcomes,
        "recoveries": rb.stats(base)["recoveries"][before:],
        "old_process_left": bool(with_old),
        "settled_s": seconds,
        "leaked": state,
    }


def _processes_pids() -> list[int]:
    return [p.pid for p in _processes().values()]


def ingress_kill(base: str, n: int = 4, max_tokens: int = 512) -> dict[str, Any]:
    futures, started = _streams(base, n, max_tokens)
    for ev in started:
        ev.wait(120)
    ingress = _processes()["Ingress"]
    t0 = time.monotonic()
    ingress.send_signal(signal.SIGKILL)
    answered_s = None
    orphans_gone_s = None
    held_max = 0
    while time.monotonic() - t0 < 180 and (answered_s is None or orphans_gone_s is None):
        if orphans_gone_s is None:
            states = _model_states()
            held = sum(s["requests"] for s in states.values())
            held_max = max(held_max, held)
            if held == 0:
                orphans_gone_s = round(time.monotonic() - t0, 1)
        if answered_s is None:
            try:
                r = httpx.post(
                    base + "/chat/completions", json=rb.chat(QUESTIONS[1], 8), timeout=10
                )
                if r.status_code == 200:
                    answered_s = round(time.monotonic() - t0, 1)
            except httpx.HTTPError:
                pass
        time.sleep(0.5)
    cut = sum(1 for f in futures if f.exception(timeout=60) is not None)
    seconds, state = rb.settle(base)
    return {
        "streams_in_flight": n,
        "max_tokens": max_tokens,
        "streams_cut": cut,
        "app_answers_again_s": answered_s,
        "models_hold_orphans_until_s": orphans_gone_s,
        "orphans_held_max": held_max,
        "settled_s": seconds,
        "leaked": state,
    }


SCENARIOS = {
    "slow_reader": slow_reader,
    "directory_restart": directory_restart,
    "wedged_step": wedged_step,
    "ingress_kill": ingress_kill,
}
