"""The served system end to end: the official ``openai`` client against a running app.

    serve run conf/local.yaml &      # or any app; then:
    python -m loadtest.serve_bench [--url http://127.0.0.1:8000/v1] [--concurrency 1,4,8]
                                   [--requests 16] [--max-tokens 64]

For each concurrency C, C client threads stream chat completions (the demo questions, fixed
length: ``ignore_eos`` is not part of the OpenAI API, so answers may stop early and only
tokens actually received count) until ``--requests`` have finished. Printed per C: output
tokens/s, requests/s, time to first token and time per output token (p50 / p99, from the
stream as the client sees it), tokens per model and handoffs per request (the ``routing``
extension), and, when the app runs the tuner, the thresholds it published at the end.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import threading
import time
from dataclasses import dataclass, field

import httpx
import openai

from loadtest.common import QUESTIONS, command, machine


@dataclass
class Sample:
    ttft_s: float
    tpot_s: float | None
    tokens: int
    routing: dict = field(default_factory=dict)


def one_request(client: openai.OpenAI, question: str, max_tokens: int) -> Sample:
    t0 = time.perf_counter()
    first = last = None
    routing: dict = {}
    tokens = 0
    stream = client.chat.completions.create(
        model="tokenrouter",
        messages=[{"role": "user", "content": question}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or now
            last = now
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
            routing = (chunk.model_extra or {}).get("routing") or {}
    ttft = (first or time.perf_counter()) - t0
    tpot = (last - first) / (tokens - 1) if first and last and tokens > 1 else None
    return Sample(ttft, tpot, tokens, routing)


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def run_level(client: openai.OpenAI, concurrency: int, requests: int, max_tokens: int) -> dict:
    lock, counter, samples = threading.Lock(), [0], []

    def worker() -> None:
        while True:
            with lock:
                if counter[0] >= requests:
                    return
                k = counter[0]
                counter[0] += 1
            sample = one_request(client, QUESTIONS[k % len(QUESTIONS)], max_tokens)
            with lock:
                samples.append(sample)

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        for future in [pool.submit(worker) for _ in range(concurrency)]:
            future.result()
    elapsed = time.perf_counter() - t0
    tokens = sum(s.tokens for s in samples)
    per_model: dict[str, int] = {}
    for s in samples:
        for model, n in (s.routing.get("tokens_per_model") or {}).items():
            per_model[model] = per_model.get(model, 0) + n
    tpots = [s.tpot_s for s in samples if s.tpot_s is not None]
    return {
        "concurrency": concurrency,
        "tok_s": tokens / elapsed,
        "req_s": len(samples) / elapsed,
        "ttft_p50": percentile([s.ttft_s for s in samples], 0.5),
        "ttft_p99": percentile([s.ttft_s for s in samples], 0.99),
        "tpot_p50": percentile(tpots, 0.5),
        "tpot_p99": percentile(tpots, 0.99),
        "share": {m: n / max(1, tokens) for m, n in sorted(per_model.items())},
        "handoffs": statistics.fmean(s.routing.get("handoffs", 0) for s in samples),
        "tokens_per_request": tokens / max(1, len(samples)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--concurrency", default="1,4,8")
    parser.add_argument("--requests", type=int, default=16, help="per concurrency level")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=2, help="requests before measuring")
    args = parser.parse_args()
    client = openai.OpenAI(base_url=args.url, api_key="none", max_retries=0, timeout=600)
    for k in range(args.warmup):
        one_request(client, QUESTIONS[k % len(QUESTIONS)], 8)
    levels = [int(c) for c in args.concurrency.split(",")]
    print(f"machine: {machine()}")
    print(f"reproduce: {command()}")
    print(
        "| C | tok/s | req/s | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | tokens/req "
        "| share per model | handoffs/req |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    for c in levels:
        r = run_level(client, c, args.requests, args.max_tokens)
        share = ", ".join(f"{m} {v:.0%}" for m, v in r["share"].items())
        print(
            f"| {c} | {r['tok_s']:.1f} | {r['req_s']:.2f} | {r['ttft_p50'] * 1e3:.0f} ms "
            f"| {r['ttft_p99'] * 1e3:.0f} ms | {r['tpot_p50'] * 1e3:.0f} ms "
            f"| {r['tpot_p99'] * 1e3:.0f} ms | {r['tokens_per_request']:.1f} | {share} "
            f"| {r['handoffs']:.1f} |",
            flush=True,
        )
    tuner = httpx.get(f"{args.url}/tokenrouter/tuner", timeout=30)
    if tuner.status_code == 200:
        status = tuner.json()
        moves = [h["reason"] for h in status["history"]]
        print(f"tuner: {status['decisions']} periods, moves: {moves or 'none'}")
        print(f"tuner thresholds: {status['thresholds']}")


if __name__ == "__main__":
    main()
