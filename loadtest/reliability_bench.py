"""Failure scenarios on the served demo (docs/user-guide/reliability.md): the app is deployed on a
private port, each scenario injects one kind of failure through real HTTP (the official
``openai`` client), Serve handles and real ZeroMQ sockets, and reports what it measured.

    python -m loadtest.reliability_bench [--port 18600] [--scenarios cancel,fault,...]
                                         [--json-out reliability.json]
    python -m loadtest reliability ...   # the same

Scenarios run by default: ``cancel`` (streaming and plain requests cut by the client at
random points beside a few kept ones), ``fault`` (a forward step of the large model raises),
``deadline`` (the large model stalls past the requests' ``timeout``), ``kill`` (the large
model's replica process is SIGKILLed with streams in flight), ``bad_json`` (a body nested
5,000 deep), ``forged`` (forged, unsigned, replayed-looking and garbage frames sent to the
large model's ZeroMQ socket). Issue 26's, on request (``--scenarios``):

- ``slow_reader``: two raw-socket clients send a streaming ``n=16`` request each and never
  read; the ingress's and Serve proxy's resident memory (psutil) and the ingress's own
  count of buffered tokens are sampled; then the sockets close and everything must be free.
- ``directory_restart``: the EndpointDirectory replica's process is killed mid-stream, then
  the large model's: every stream must finish (none hangs), equal to an undisturbed run.
- ``wedged_step`` (pass ``--override models.large.max_step_s=5``): the large model's next
  step sleeps for an hour; its health check fails, Serve restarts it, and the requests in
  flight are re-created: how long each phase took.
- ``ingress_kill``: SIGKILL of the ingress replica with 4 streams in flight: how long until
  the app answers again, and how long the models keep the orphaned requests.

Each scenario returns one JSON-able dict, printed as one JSON line (and written to
``--json-out``); ``leaked`` is what the ingress and the models still held once the scenario
settled (requests, KV blocks).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import random
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import openai

from loadtest.common import QUESTIONS, command, machine

APP = "reliability-bench"
DEMO = ["models=demo_pair", "policy=r2r_demo", "transport=zmq_ipc", "placement=local"]


def deploy(port: int, overrides: list[str]) -> str:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray import serve

    from deployments.app import bind_app
    from tokenrouter_ray.app_config import compose_config
    from tokenrouter_ray.demo import register_resolver

    register_resolver()

    ray.init(include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(bind_app(compose_config(overrides)), name=APP, route_prefix="/", blocking=False)
    base = f"http://127.0.0.1:{port}/v1"
    wait_healthy(base, 600)
    return base


def handle(model: str) -> Any:
    from ray import serve

    return serve.get_deployment_handle(model, app_name=APP)


def wait_healthy(base: str, timeout_s: float) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        try:
            if httpx.get(base.removesuffix("/v1") + "/health", timeout=5).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    return None


def stats(base: str) -> dict[str, Any]:
    return httpx.get(base + "/tokenrouter/stats", timeout=30).json()


def held(state: dict[str, Any]) -> dict[str, Any]:
    models = state["models"]
    return {
        "ingress_active": state["active_requests"],
        "requests": {m: s.get("requests") for m, s in models.items()},
        "kv_blocks": {m: s.get("kv_blocks_used") for m, s in models.items()},
    }


def settle(base: str, timeout_s: float = 120) -> tuple[float | None, dict[str, Any]]:
    """Seconds until nothing is held anywhere (None: still held at ``timeout_s``)."""
    t0 = time.monotonic()
    while True:
        state = held(stats(base))
        clean = state["ingress_active"] == 0 and not any(state["requests"].values())
        clean = clean and not any(state["kv_blocks"].values())
        if clean:
            return round(time.monotonic() - t0, 2), state
        if time.monotonic() - t0 > timeout_s:
            return None, state
        time.sleep(0.25)


def api(base: str, timeout: float = 300) -> openai.OpenAI:
    return openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=timeout)


def chat(question: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return dict(
        model="tokenrouter",
        messages=[{"role": "user", "content": question}],
        max_tokens=max_tokens,
        temperature=0,
        **extra,
    )


def answer(client: openai.OpenAI, question: str, max_tokens: int) -> str:
    return client.chat.completions.create(**chat(question, max_tokens)).choices[0].message.content


def stream_answer(
    client: openai.OpenAI, question: str, max_tokens: int, started: threading.Event | None = None
) -> str:
    text = ""
    for n, chunk in enumerate(
        client.chat.completions.create(stream=True, **chat(question, max_tokens))
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
        if n == 4 and started is not None:
            started.set()
    return text


def _processes() -> dict[str, Any]:
    """The app's replica processes by deployment name, and Serve's proxy."""
    import psutil

    prefix = f"ServeReplica:{APP}:"
    found: dict[str, Any] = {}
    for proc in psutil.process_iter(["cmdline"]):
        title = " ".join(proc.info["cmdline"] or [])
        if prefix in title:
            found[title.split(prefix, 1)[1].split()[0].split(".")[0]] = proc
        elif "ProxyActor" in title:
            found["proxy"] = proc
    return found


def _model_states() -> dict[str, dict[str, Any]]:
    return {m: handle(m).status.remote().result(timeout_s=30).to_json() for m in ("small", "large")}


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


def _streams(base: str, n: int, max_tokens: int) -> list[Any]:
    """``n`` streams in flight (futures of their texts), each past its fifth chunk."""
    client = api(base)
    started = [threading.Event() for _ in range(n)]
    pool = concurrent.futures.ThreadPoolExecutor(n)
    futures = [
        pool.submit(stream_answer, client, QUESTIONS[i % len(QUESTIONS)], max_tokens, ev)
        for i, ev in enumerate(started)
    ]
    pool.shutdown(wait=False)
    for ev in started:
        ev.wait(120)
    return futures


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
    client = api(base)
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        return list(
            pool.map(
                lambda i: stream_answer(client, QUESTIONS[i % len(QUESTIONS)], max_tokens),
                range(n),
            )
        )


def _tally(run: Callable[[int], str], n: int) -> dict[str, int]:
    """``run(0)`` .. ``run(n - 1)`` on ``n`` threads: how many returned each outcome."""
    outcomes: dict[str, int] = {}
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        for outcome in pool.map(run, range(n)):
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
    return outcomes


# -------------------------------------------------------------------------- scenarios
def cancel(base: str, streams: int = 40, plain: int = 20, kept: int = 4) -> dict[str, Any]:
    client, rng = api(base), random.Random(0)
    questions = QUESTIONS[:kept]
    with concurrent.futures.ThreadPoolExecutor(kept) as pool:
        want = list(pool.map(lambda q: answer(client, q, 48), questions))
    cut = {"stream": 0, "plain": 0, "refused": 0}
    lock = threading.Lock()

    def doomed(i: int) -> None:
        body = chat(QUESTIONS[i % len(QUESTIONS)], 256, extra_body={"ignore_eos": True})
        time.sleep(rng.random() * 2)
        try:
            if i < streams:
                stream = client.chat.completions.create(stream=True, **body)
                for n, _ in enumerate(stream):
                    if n >= rng.randint(1, 40):
                        break
                stream.close()
                kind = "stream"
            else:
                with contextlib.suppress(openai.APITimeoutError):
                    api(base, timeout=0.2 + rng.random() * 4).chat.completions.create(**body)
                kind = "plain"
        except openai.APIStatusError:
            kind = "refused"
        with lock:
            cut[kind] += 1

    with concurrent.futures.ThreadPoolExecutor(streams + plain + kept) as pool:
        keep = [pool.submit(answer, client, q, 48) for q in questions]
        list(pool.map(doomed, range(streams + plain)))
        got = [f.result() for f in keep]
    seconds, state = settle(base)
    return {
        "cut": cut,
        "kept": kept,
        "kept_equal_undisturbed": sum(g == w for g, w in zip(got, want, strict=True)),
        "settled_s": seconds,
        "leaked": state,
    }


def fault(base: str, n: int = 8) -> dict[str, Any]:
    client = api(base)
    handle("large").inject_fault.remote("step", 1).result()

    def run(i: int) -> str:
        try:
            if i % 2:
                stream_answer(client, QUESTIONS[i % len(QUESTIONS)], 48)
            else:
                answer(client, QUESTIONS[i % len(QUESTIONS)], 48)
            return "completed"
        except openai.APIError as exc:
            code = getattr(exc, "code", None) or (exc.body or {}).get("code")
            return f"error:{code}"

    outcomes = _tally(run, n)
    seconds, state = settle(base)
    after = answer(client, QUESTIONS[0], 16)
    return {
        "requests": n,
        "outcomes": outcomes,
        "settled_s": seconds,
        "leaked": state,
        "served_after": bool(after),
    }


def deadline(base: str, n: int = 4, stall_s: float = 6.0, timeout_s: float = 2.0) -> dict[str, Any]:
    handle("large").inject_fault.remote("stall", 1, stall_s).result()
    t0 = time.monotonic()

    def run(i: int) -> str:
        body = chat(QUESTIONS[i], 48) | {"timeout": timeout_s}
        r = httpx.post(base + "/chat/completions", json=body, timeout=120)
        code = r.json()["error"]["code"] if r.status_code != 200 else ""
        return f"{r.status_code} {code} retry-after={r.headers.get('retry-after')}"

    outcomes = _tally(run, n)
    answered_s = round(time.monotonic() - t0, 2)
    seconds, state = settle(base)
    return {
        "requests": n,
        "timeout_s": timeout_s,
        "stall_s": stall_s,
        "outcomes": outcomes,
        "all_answered_s": answered_s,
        "settled_s": seconds,
        "leaked": state,
    }


def kill(base: str, n: int = 8, max_tokens: int = 64) -> dict[str, Any]:
    client = api(base)
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(n)]
    want = _undisturbed(base, n, max_tokens)
    before = len(stats(base)["recoveries"])
    started = [threading.Event() for _ in questions]
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        futures = [
            pool.submit(stream_answer, client, q, max_tokens, ev)
            for q, ev in zip(questions, started, strict=True)
        ]
        for ev in started:
            ev.wait(120)
        pid = handle("large").status.remote().result().pid
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        health: dict[str, float | None] = {"first_503_s": None, "back_200_s": None}

        def watch() -> None:
            while time.monotonic() - killed < 120 and health["back_200_s"] is None:
                try:
                    r = httpx.get(base.removesuffix("/v1") + "/health", timeout=5)
                    since = round(time.monotonic() - killed, 2)
                    if r.status_code == 503 and health["first_503_s"] is None:
                        health["first_503_s"] = since
                    elif r.status_code == 200 and health["first_503_s"] is not None:
                        health["back_200_s"] = since
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        outcomes = _outcomes(futures, want, killed)
    all_done_s = outcomes.pop("all_done_s")
    watcher.join(timeout=130)
    fresh = stream_answer(client, questions[0], max_tokens)
    seconds, state = settle(base)
    return {
        "requests_in_flight": n,
        "outcomes": outcomes,
        "kill_to_all_done_s": all_done_s,
        "health_first_503_s": health["first_503_s"],
        "health_back_200_s": health["back_200_s"],
        "recoveries": stats(base)["recoveries"][before:],
        "new_request_equal_undisturbed": fresh == want[0],
        "settled_s": seconds,
        "leaked": state,
    }


def bad_json(base: str) -> dict[str, Any]:
    body = b'{"model": "tokenrouter", "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    r = httpx.post(base + "/chat/completions", content=body, timeout=60)
    return {"status": r.status_code, "error": r.json()["error"]}


def forged(base: str) -> dict[str, Any]:
    import zmq

    from tokenrouter_ray.protocol import MsgKind, PeerReq, encode_batch
    from tokenrouter_ray.transport.auth import FrameSigner, derive_key

    status = handle("large").status.remote().result().to_json()  # ReplicaStatus
    before = status["peer_rejected"]
    msg = PeerReq(rid="evil", src="x/y", dst=status["endpoint"], kind=MsgKind.ABORT, handoff_seq=0)
    frames = [
        encode_batch([msg]),  # unsigned
        FrameSigner(derive_key(b"guess")).sign(status["endpoint"], encode_batch([msg])),
        b"\x00" * 7,  # garbage
    ]
    ctx = zmq.Context.instance()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 1000)
    push.connect(status["address"])
    for frame in frames * 10:
        push.send(frame)
    push.close()
    time.sleep(1.0)
    after = handle("large").status.remote().result().peer_rejected
    rejected = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    served = answer(api(base), QUESTIONS[0], 16)
    return {"frames_sent": len(frames) * 10, "rejected": rejected, "served_after": bool(served)}


# ------------------------------------------------- issue 26's scenarios (on request)
def slow_reader(
    base: str, n: int = 16, max_tokens: int = 256, hold_s: float = 40
) -> dict[str, Any]:
    port = int(base.split(":")[2].split("/")[0])
    procs = _processes()
    rss0 = {k: procs[k].memory_info().rss for k in ("Ingress", "proxy") if k in procs}
    body = chat(QUESTIONS[0], max_tokens, n=n, stream=True, ignore_eos=True)
    socks = [_raw_stream(port, body) for _ in range(2)]
    peak = {k: 0 for k in rss0}
    buffered_peak, t0 = 0, time.monotonic()
    stalls = 0
    while time.monotonic() - t0 < hold_s:
        for k in rss0:
            peak[k] = max(peak[k], procs[k].memory_info().rss - rss0[k])
        state = stats(base)
        buffered_peak = max(buffered_peak, state.get("stream_buffered_tokens", 0))
        stalls = state.get("client_stalls", 0)
        time.sleep(0.5)
    held_open = held(stats(base))
    tokens = {m: s.get("steps") for m, s in _model_states().items()}
    for sock in socks:
        sock.close()
    closed = time.monotonic()
    seconds, state = settle(base)
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


def directory_restart(base: str, n: int = 8, max_tokens: int = 64) -> dict[str, Any]:
    want = _undisturbed(base, n, max_tokens)
    secret = handle("EndpointDirectory").peer_secret.remote().result()
    before = len(stats(base)["recoveries"])
    futures = _streams(base, n, max_tokens)
    t0 = time.monotonic()
    _processes()["EndpointDirectory"].kill()
    time.sleep(1.0)
    os.kill(handle("large").status.remote().result().pid, signal.SIGKILL)
    outcomes = _outcomes(futures, want, t0)
    back = wait_healthy(base, 180)
    same_secret = handle("EndpointDirectory").peer_secret.remote().result() == secret
    fresh = stream_answer(api(base), QUESTIONS[0], max_tokens)
    seconds, state = settle(base)
    return {
        "requests_in_flight": n,
        "outcomes": outcomes,
        "same_secret_after_restart": same_secret,
        "healthy_checked_after_streams_s": None
        if back is None
        else round(time.monotonic() - t0, 1),
        "recoveries": stats(base)["recoveries"][before:],
        "bad_mac_on_new_large": _model_states()["large"]["peer_rejected"].get("bad_mac", 0),
        "new_request_equal_undisturbed": fresh == want[0],
        "settled_s": seconds,
        "leaked": state,
    }


def wedged_step(base: str, n: int = 4, max_tokens: int = 64) -> dict[str, Any]:
    want = _undisturbed(base, n, max_tokens)
    old_pid = handle("large").status.remote().result().pid
    before = len(stats(base)["recoveries"])
    futures = _streams(base, n, max_tokens)
    handle("large").inject_fault.remote("stall", 1, 3600.0).result()
    t0 = time.monotonic()
    replaced_s = None
    while time.monotonic() - t0 < 240 and replaced_s is None:
        try:
            pid = handle("large").status.remote().result(timeout_s=5).pid
            if pid != old_pid:
                replaced_s = round(time.monotonic() - t0, 1)
        except Exception:  # the old replica is being stopped
            pass
        time.sleep(0.5)
    outcomes = _outcomes(futures, want, t0)
    with_old = [p.pid for p in _processes().values() if p.pid == old_pid]
    seconds, state = settle(base)
    return {
        "requests_in_flight": n,
        "wedge_to_new_replica_s": replaced_s,
        "outcomes": outcomes,
        "recoveries": stats(base)["recoveries"][before:],
        "old_process_left": bool(with_old),
        "settled_s": seconds,
        "leaked": state,
    }


def ingress_kill(base: str, n: int = 4, max_tokens: int = 512) -> dict[str, Any]:
    futures = _streams(base, n, max_tokens)
    ingress = _processes()["Ingress"]
    t0 = time.monotonic()
    ingress.send_signal(signal.SIGKILL)
    answered_s = None
    orphans_gone_s = None
    held_max = 0
    while time.monotonic() - t0 < 180 and (answered_s is None or orphans_gone_s is None):
        if orphans_gone_s is None:
            states = _model_states()
            held_now = sum(s["requests"] for s in states.values())
            held_max = max(held_max, held_now)
            if held_now == 0:
                orphans_gone_s = round(time.monotonic() - t0, 1)
        if answered_s is None:
            try:
                r = httpx.post(base + "/chat/completions", json=chat(QUESTIONS[1], 8), timeout=10)
                if r.status_code == 200:
                    answered_s = round(time.monotonic() - t0, 1)
            except httpx.HTTPError:
                pass
        time.sleep(0.5)
    cut = sum(1 for f in futures if f.exception(timeout=60) is not None)
    seconds, state = settle(base)
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
    "cancel": cancel,
    "fault": fault,
    "deadline": deadline,
    "kill": kill,
    "bad_json": bad_json,
    "forged": forged,
    "slow_reader": slow_reader,
    "directory_restart": directory_restart,
    "wedged_step": wedged_step,
    "ingress_kill": ingress_kill,
}
DEFAULT_SCENARIOS = ["cancel", "fault", "deadline", "kill", "bad_json", "forged"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=18600)
    parser.add_argument(
        "--scenarios",
        default=",".join(DEFAULT_SCENARIOS),
        help="also: slow_reader, directory_restart, wedged_step, ingress_kill",
    )
    parser.add_argument("--override", action="append", default=[], help="extra Hydra override")
    parser.add_argument("--json-out")
    args = parser.parse_args()
    print(f"# {command()}\n# {machine()}", flush=True)
    t0 = time.monotonic()
    base = deploy(args.port, DEMO + args.override)
    print(f"# deployed in {time.monotonic() - t0:.0f} s", flush=True)
    results = {}
    for name in args.scenarios.split(","):
        t0 = time.monotonic()
        results[name] = SCENARIOS[name](base)
        results[name]["scenario_s"] = round(time.monotonic() - t0, 1)
        print(json.dumps({name: results[name]}), flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
