"""Backpressure over real sockets, without Ray: uvicorn serving deployments/ingress.py's app
-> ``IngressServer`` -> ``LocalRuntime`` with the tiny chain. Two clients that send a
streaming ``n=16`` request and never read are cut once their send has been blocked for
``client_stall_s`` with a choice's buffer full: their requests are aborted on every model
(KV freed, slots released) while the ingress never holds more than the bound for them; a
client that reads slowly beside them gets every token, equal to an undisturbed run."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import Any

from tokenrouter_ray.ingress.backpressure import Backpressure
from tokenrouter_ray.protocol import SamplingSpec

TWO = ["small", "large"]
BUFFER_TOKENS = 8  # per choice
STALL_S = 1.0
N = 16
LONG = 200  # tokens per choice of the non-reading clients


def http_post(path: str, body: dict[str, Any]) -> bytes:
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    return head.encode() + data


def small_socket(port: int, host: str = "127.0.0.1") -> socket.socket:
    """A client socket whose receive buffer is small, so the server's send blocks soon."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, port))
    return sock


def dechunk(raw: bytes) -> bytes:
    """The body of a chunked HTTP/1.1 response."""
    _, _, rest = raw.partition(b"\r\n\r\n")
    out = b""
    while rest:
        size, _, rest = rest.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            break
        out, rest = out + rest[:n], rest[n + 2 :]
    return out


def texts_of(body: bytes) -> dict[int, str]:
    texts: dict[int, str] = {}
    for line in body.decode().splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    return texts


def slow_read(port: int, body: dict[str, Any], pause_s: float) -> bytes:
    """Read the whole response 512 bytes at a time, pausing between reads."""
    with small_socket(port) as sock:
        sock.sendall(http_post("/v1/completions", body))
        raw = b""
        while b"data: [DONE]" not in raw:
            part = sock.recv(512)
            if not part:
                break
            raw += part
            time.sleep(pause_s)
        return raw


def test_clients_that_never_read_are_cut_and_a_slow_reader_is_exact(served_chain_dirs) -> None:
    from transformers import AutoTokenizer

    from tests.openai.ingress_app import SERVED, served
    from tests.tiny_models import chain_engines
    from tokenrouter_ray.openai.validation import RequestLimits
    from tokenrouter_ray.routing.policy import build_policy

    tokenizer = AutoTokenizer.from_pretrained(served_chain_dirs["small"])
    limits = RequestLimits(max_model_len=256, vocab_size=128)
    slow_prompt = [5, 17, 3, 99]

    async def go() -> dict[str, Any]:
        policy = build_policy("entropy", {"threshold": 0.45}, TWO)
        engines = chain_engines(served_chain_dirs, TWO)
        # accepted sockets inherit the listener's small send buffer: the kernel's (autotuned,
        # it could absorb megabytes of a non-reading client's stream before any send
        # blocks; that is the kernel's bound, not the ingress's) stays out of the way
        async with served(
            engines, policy, tokenizer, limits=limits, socket=True, send_buffer=8192,
            stream_buffer_tokens=BUFFER_TOKENS, client_stall_s=STALL_S,
        ) as flow:  # fmt: skip
            runtime, server, port = flow.runtime, flow.ingress, flow.port
            want = await runtime.complete(slow_prompt, SamplingSpec(temperature=0.0, max_tokens=60))
            assert server.backpressure == Backpressure(BUFFER_TOKENS, STALL_S)
            peak = {"buffered": 0, "active": 0}

            async def sample() -> None:
                while True:
                    peak["buffered"] = max(peak["buffered"], server.buffered_tokens)
                    peak["active"] = max(peak["active"], runtime.ingress.num_active)
                    await asyncio.sleep(0.01)

            sampler = asyncio.create_task(sample())
            try:
                long_body = {"model": SERVED, "prompt": [7, 8, 9], "max_tokens": LONG, "n": N,
                             "stream": True, "temperature": 0, "ignore_eos": True}  # fmt: skip
                stuck = [small_socket(port) for _ in range(2)]
                for sock in stuck:
                    sock.sendall(http_post("/v1/completions", long_body))  # then never read
                slow_body = {"model": SERVED, "prompt": slow_prompt, "max_tokens": 60,
                             "stream": True, "temperature": 0}  # fmt: skip
                t0 = time.monotonic()
                slow = await asyncio.to_thread(slow_read, port, slow_body, 0.01)
                deadline = time.monotonic() + 60
                while server.client_stalls < 2 and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                cut_after_s = time.monotonic() - t0
                await runtime.wait_idle()
                held_while_open = runtime.ingress.num_active  # the stuck sockets still open
                for sock in stuck:
                    sock.close()
            finally:
                sampler.cancel()
            pools = [s.engine.kv.pool for s in runtime.model_replicas]
            return {
                "slow": texts_of(dechunk(slow)).get(0, ""),
                "want": want.token_ids,
                "stalls": server.client_stalls,
                "cut_after_s": cut_after_s,
                "peak": peak,
                "held_while_open": held_while_open,
                "kv_free": all(p.num_free_blocks == p.num_blocks for p in pools),
                "tokens_generated": runtime.ingress.tokens_received,
            }

    got = asyncio.run(go())
    print(f"backpressure: {got}")
    assert [int(w[1:]) for w in got["slow"].split()] == got["want"]  # every token, in order
    assert got["stalls"] == 2  # both non-reading clients were cut, the slow reader was not
    # their requests were aborted everywhere while their sockets were still open
    assert got["held_while_open"] == 0 and got["kv_free"]
    # the ingress never held more than the bound for them: n choices x the per-choice buffer
    # (plus one piece per choice in flight)
    assert got["peak"]["buffered"] <= 2 * N * (BUFFER_TOKENS + 1)
    # and the models did not generate their whole answers (aborted well before the end)
    assert got["tokens_generated"] < 2 * N * LONG
