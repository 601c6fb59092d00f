"""Failure scenarios on the served demo (docs/reliability.md): the app is deployed on a
private port, each scenario injects one kind of failure through real HTTP (the official
``openai`` client), Serve handles and real ZeroMQ sockets, and reports what it measured.

    python -m loadtest.reliability_bench [--port 18600] [--scenarios cancel,fault,...]
                                         [--json-out reliability.json]

Scenarios: ``cancel`` (streaming and plain requests cut by the client at random points
beside a few kept ones), ``fault`` (a forward step of the large model raises), ``deadline``
(the large model stalls past the requests' ``timeout``), ``kill`` (the large model's
replica process is SIGKILLed with streams in flight), ``bad_json`` (a body nested 5,000
deep), ``forged`` (forged, unsigned, replayed-looking and garbage frames sent to the large
model's ZeroMQ socket); and, from ``loadtest/reliability_more.py``, ``slow_reader``,
``directory_restart``, ``wedged_step`` (pass ``--override models.large.max_step_s=5``) and
``ingress_kill``. Each prints one JSON line; ``leaked`` is what the ingress and the
models still held once the scenario settled (requests, KV blocks).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import random
import signal
import threading
import time
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
    from tokenrouter_ray.config import compose_config
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
    outcomes: dict[str, int] = {}

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

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        for outcome in pool.map(run, range(n)):
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
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
    outcomes: dict[str, int] = {}
    t0 = time.monotonic()

    def run(i: int) -> str:
        body = chat(QUESTIONS[i], 48) | {"timeout": timeout_s}
        r = httpx.post(base + "/chat/completions", json=body, timeout=120)
        code = r.json()["error"]["code"] if r.status_code != 200 else ""
        return f"{r.status_code} {code} retry-after={r.headers.get('retry-after')}"

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        for outcome in pool.map(run, range(n)):
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
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
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        want = list(pool.map(lambda q: stream_answer(client, q, max_tokens), questions))
    before = len(stats(base)["recoveries"])
    started = [threading.Event() for _ in questions]
    outcomes = {"completed": 0, "equal_undisturbed": 0, "failed_with_error": 0, "hung": 0}
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
        done_at = killed
        for f, w in zip(futures, want, strict=True):
            try:
                text = f.result(timeout=300)
                outcomes["completed"] += 1
                outcomes["equal_undisturbed"] += text == w
            except concurrent.futures.TimeoutError:
                outcomes["hung"] += 1
            except openai.APIError:
                outcomes["failed_with_error"] += 1
            done_at = max(done_at, time.monotonic())
    all_done_s = round(done_at - killed, 2)
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


SCENARIOS = {
    "cancel": cancel,
    "fault": fault,
    "deadline": deadline,
    "kill": kill,
    "bad_json": bad_json,
    "forged": forged,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=18600)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="also: slow_reader, "
                        "directory_restart, wedged_step, ingress_kill")  # fmt: skip
    parser.add_argument("--override", action="append", default=[], help="extra Hydra override")
    parser.add_argument("--json-out")
    args = parser.parse_args()
    from loadtest.reliability_more import SCENARIOS as MORE  # issue 26's scenarios

    SCENARIOS.update(MORE)
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
