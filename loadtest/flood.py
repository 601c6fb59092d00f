"""What a stranger's junk flood at a model's peer socket costs the served demo (issue 37).

    python -m loadtest flood [--seconds 15] [--rate 5000] [--runs 2]

The demo app (``conf/local.yaml``'s overrides) is deployed on a Ray cluster started here.
The probe: four greedy chat completions of 48 tokens at once, through the official
``openai`` client. It runs twice undisturbed and twice flooded, best of each:

- undisturbed, beside the same flooder aimed at a decoy socket that a thread of this
  process drains, so both timings carry the flooder's own CPU on these cores;
- flooded: junk frames (the frame magic and random MACs, each worth a full MAC check; a
  stranger without the key can do no better) pushed at the large model's peer socket
  (its address from ``/v1/tokenrouter/stats``) at ``--rate`` frames a second.

Printed: both times, their ratio against the target (flooded / undisturbed <= 1.5), the
frames sent and what the large model rejected, the large replica's CPU seconds per probe
both ways (from /proc: what the junk costs it), whether the outputs were equal, and the
``/health`` codes seen during the flood. ``--overrides transport.zmq.reject_rate=1e9``
turns the receiver's pacing off, for the comparison.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx

from loadtest.common import QUESTIONS, command, machine, ray_serve_deploy
from loadtest.proc_cpu import cpu_seconds
from loadtest.systems import wait_ready

DEMO = ["models=demo_pair", "policy=r2r_demo", "transport=zmq_ipc", "placement=local"]
TARGET = 1.5


def junk_flood(address: str, stop: threading.Event, sent: list[int], rate: float = 5000) -> None:
    """Junk frames (the frame magic, random MACs: each costs the receiver an HMAC) pushed
    at ``address`` until ``stop``, about ``rate`` a second; what cannot be queued is
    dropped (a stranger's sender). Appends the number sent to ``sent``."""
    import zmq

    from tokenrouter_ray.transport.auth import MAGIC

    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    n, t0 = 0, time.monotonic()
    try:
        while not stop.is_set():
            frame = MAGIC + os.urandom(56) + os.urandom(200)
            try:
                sock.send(frame, flags=zmq.NOBLOCK)
                n += 1
            except zmq.Again:
                time.sleep(0.001)
            if n % 100 == 0 and n / rate > time.monotonic() - t0:
                time.sleep(0.01)
    finally:
        sock.close(linger=0)
        sent.append(n)


@contextlib.contextmanager
def decoy_flood(rate: float = 5000) -> Iterator[None]:
    """The junk flood at a PULL socket of this process, drained by a thread: the flooder's
    own cost, with nothing of the app's paying for it."""
    import zmq

    with tempfile.TemporaryDirectory() as tmp:
        address = f"ipc://{tmp}/decoy.sock"
        pull = zmq.Context.instance().socket(zmq.PULL)
        pull.setsockopt(zmq.LINGER, 0)
        pull.setsockopt(zmq.RCVTIMEO, 100)
        pull.bind(address)
        stop, sent = threading.Event(), []

        def drain() -> None:
            while not stop.is_set():
                with contextlib.suppress(zmq.Again):
                    pull.recv()

        threads = [
            threading.Thread(target=drain, daemon=True),
            threading.Thread(target=junk_flood, args=(address, stop, sent, rate), daemon=True),
        ]
        for t in threads:
            t.start()
        try:
            time.sleep(0.5)
            yield
        finally:
            stop.set()
            for t in threads:
                t.join(30)
            pull.close(linger=0)


def probe(url: str, max_tokens: int = 48) -> tuple[list[str], float]:
    """Four greedy chat completions at once: their texts and the wall time."""
    import openai

    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)

    def one(question: str) -> str:
        out = client.chat.completions.create(
            model="tokenrouter",
            messages=[{"role": "user", "content": question}],
            max_tokens=max_tokens,
            temperature=0,
        )
        return out.choices[0].message.content or ""

    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(one, QUESTIONS[:4]))
    return texts, time.monotonic() - t0


def large_status(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/tokenrouter/stats", timeout=30).json()["models"]["large"]


def cpu_s(pid: int) -> float:
    """A process's CPU seconds so far (user + system, from /proc)."""
    return cpu_seconds(pid) or 0.0


def timed_probes(url: str, pid: int, runs: int) -> tuple[list[tuple[list[str], float]], float]:
    """``runs`` probes, and the large replica's CPU seconds per probe over them."""
    c0 = cpu_s(pid)
    out = [probe(url) for _ in range(runs)]
    return out, (cpu_s(pid) - c0) / runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=5000.0, help="junk frames a second")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--http-port", type=int, default=8766)
    parser.add_argument("--overrides", nargs="*", default=[], help="more app overrides")
    args = parser.parse_args(argv)
    print(f"# {command()}\n# machine: {machine()}")
    with ray_serve_deploy(args.http_port)(DEMO + args.overrides, "flood") as url:
        wait_ready(url)
        probe(url)  # warm-up
        status = large_status(url)
        pid, address = status["pid"], status["address"]
        with decoy_flood(args.rate):
            calm, calm_cpu = timed_probes(url, pid, args.runs)
        before = large_status(url)["peer_rejected"]
        stop, sent, health = threading.Event(), [], []
        root = url.removesuffix("/v1")

        def watch() -> None:
            while not stop.is_set():
                with contextlib.suppress(httpx.HTTPError):
                    health.append(httpx.get(f"{root}/health", timeout=10).status_code)
                time.sleep(0.2)

        threads = [
            threading.Thread(target=junk_flood, args=(address, stop, sent, args.rate)),
            threading.Thread(target=watch),
        ]
        for t in threads:
            t.daemon = True
            t.start()
        try:
            time.sleep(1.0)  # the flood is on before the probe starts
            flooded, flooded_cpu = timed_probes(url, pid, args.runs)
        finally:
            stop.set()
            for t in threads:
                t.join(30)
        after = large_status(url)["peer_rejected"]
    calm_s, flooded_s = min(t for _, t in calm), min(t for _, t in flooded)
    same = all(texts == calm[0][0] for texts, _ in calm + flooded)
    rejected = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    ratio = flooded_s / calm_s
    print(f"undisturbed (decoy flood) {calm_s:.2f} s, flooded {flooded_s:.2f} s")
    print(f"junk frames sent {sent[0] if sent else 0}, rejected by the large model {rejected}")
    print(f"large replica CPU per probe: undisturbed {calm_cpu:.2f} s, flooded {flooded_cpu:.2f} s")
    print(f"outputs equal: {same}; /health during the flood: {sorted(set(health))}")
    verdict = "PASS" if ratio <= TARGET else "MISS"
    print(f"target: flooded / undisturbed <= {TARGET}: {ratio:.2f} {verdict}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
