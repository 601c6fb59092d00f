"""LocalRuntime vs. a glue dispatcher on the demo pair, with bernoulli(p) routing.

The glue dispatcher is what stock servers plus an external per-token router amount to: each
model is a plain continuous-batching engine, and every handoff re-submits the whole context
to the other model (a fresh prefill, no KV kept) while the two models step in lock-step.
LocalRuntime keeps pending requests' KV, sends only the unseen suffix, and lets each model
step on its own. Both make the same routing decisions (seeded per request and position),
so their greedy outputs must match; the benchmark checks that before printing figures.

    python -m loadtest.local_bench [--concurrency 1,4,8] [--tokens 48] [--p 0.35]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from loadtest.common import chat_prompts, command, demo_pair, machine
from tokenrouter_ray.engine.engine import Engine
from tokenrouter_ray.engine.request import SamplingParams
from tokenrouter_ray.local import LocalRuntime
from tokenrouter_ray.protocol import SamplingSpec
from tokenrouter_ray.routing.baselines import seeded_uniform
from tokenrouter_ray.routing.policy import build_policy

SEED = 7


def glue_dispatch(
    engines: list[Engine], prompts: list[list[int]], n: int, p: float
) -> tuple[list[list[int]], float, list[int]]:
    """Lock-step glue: returns outputs, seconds, and tokens sent per handoff."""
    state = {i: {"seq": list(pr), "out": [], "model": 0} for i, pr in enumerate(prompts)}
    sent: list[int] = []
    greedy = SamplingParams(max_tokens=10**6, ignore_eos=True)
    t0 = time.perf_counter()
    for i, s in state.items():
        engines[0].add_request(f"g{i}-0", s["seq"], greedy)
    live = set(state)
    version = {i: 0 for i in state}
    while live:
        for m, engine in enumerate(engines):
            result = engine.execute()
            if result is None:
                continue
            moves = {}
            for rid, token, pos in zip(
                result.request_ids, result.token_ids, result.positions, strict=True
            ):
                i = int(rid[1:].split("-")[0])
                escalate = m == 0 and seeded_uniform(SEED, pos) < p
                moves[rid] = (i, token, escalate)
            engine.commit(result, drop=[r for r, (_, _, e) in moves.items() if e])
            for rid, (i, token, escalate) in moves.items():
                s = state[i]
                if not escalate:
                    s["seq"].append(token)
                    s["out"].append(token)
                dst = 1 if escalate else 0
                if len(s["out"]) >= n:
                    engine.abort(rid)
                    live.discard(i)
                elif dst != m:
                    engine.abort(rid)  # the stock server forgets the request and its KV
                    version[i] += 1
                    engines[dst].add_request(f"g{i}-{version[i]}", s["seq"], greedy)
                    sent.append(len(s["seq"]))
    return [state[i]["out"] for i in state], time.perf_counter() - t0, sent


async def local_run(
    engines: list[Engine], prompts: list[list[int]], n: int, p: float
) -> tuple[list[list[int]], float, list[int]]:
    policy = build_policy("bernoulli", {"p": p}, ["small", "large"])
    async with LocalRuntime([("small", engines[0]), ("large", engines[1])], policy) as rt:
        spec = SamplingSpec(temperature=0.0, max_tokens=n, seed=SEED, ignore_eos=True)
        t0 = time.perf_counter()
        results = await rt.complete_all(prompts, spec)
        elapsed = time.perf_counter() - t0
        sent = [h.num_tokens for h in rt.handoffs]
    return [r.token_ids for r in results], elapsed, sent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,4,8")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--p", type=float, default=0.35)
    args = parser.parse_args()
    engines, tokenizer, label = demo_pair()
    rows = []
    for n in (int(c) for c in args.concurrency.split(",")):
        prompts = chat_prompts(tokenizer, n)
        glue_out, glue_s, glue_sent = glue_dispatch(engines, prompts, args.tokens, args.p)
        local_out, local_s, local_sent = asyncio.run(
            local_run(engines, prompts, args.tokens, args.p)
        )
        same = glue_out == local_out
        total = n * args.tokens
        rows.append(
            (
                n,
                total / glue_s,
                total / local_s,
                statistics.fmean(glue_sent or [0]),
                statistics.fmean(local_sent or [0]),
                len(local_sent) / n,
                same,
            )
        )
    print(
        f"\nMachine: {machine()}\nPair: SmolLM2-135M-Instruct (large) + {label} (small); "
        f"bernoulli(p={args.p}); {args.tokens} tokens per request\n"
    )
    print(
        "| N | glue tok/s | LocalRuntime tok/s | speed-up | tokens/handoff glue | "
        "tokens/handoff LocalRuntime | handoffs/request | same tokens |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---|")
    for n, g, loc, gs, ls, h, same in rows:
        print(
            f"| {n} | {g:.1f} | {loc:.1f} | {loc / g:.2f}× | {gs:.1f} | {ls:.1f} | {h:.1f} | "
            f"{'yes' if same else 'NO'} |"
        )
    print(f"\nReproduce: {command()}")


if __name__ == "__main__":
    main()
