"""What prefix caching costs when nothing is shared, and what it gives on the long-input
workload: the demo pair, caching on vs off.

    python -m loadtest.prefix_cost [--rounds 3] [--n 8] [--tokens 64]
    python -m loadtest.prefix_cost --workload long_input [--rounds 3] [--n 8]

N requests at once through ``LocalRuntime`` (bernoulli 0.35 routing between the demo's small
and large model), every prompt unique from its first token on (so no block is ever shared:
the cache only hashes, registers and evicts), greedy, ``ignore_eos``. The on and off engines
run alternately, ``--rounds`` times each, in one process; printed: committed tok/s per run,
the median of each, their ratio, and PASS/MISS against the target (caching costs <= 2 %).
The outputs must be identical both ways; the run checks it.

``--workload long_input`` runs the harness's long-input workload instead (``workloads.py``:
~2k-token inventory ledgers, a one-sentence question, 32 tokens out): N requests at once
over its 4 ledgers, so requests on the same ledger share their prompt. Printed the same way:
tok/s on and off, and the ratio (the target there is a gain, not a cost).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from loadtest.common import command, demo_pair_engines, machine
from tokenrouter_ray.local import LocalRuntime
from tokenrouter_ray.protocol import SamplingSpec
from tokenrouter_ray.routing.policy import build_policy


def prompts(n: int, length: int, salt: int) -> list[list[int]]:
    """Unique prompts: each starts with its own token, so no full block matches another."""
    return [[1000 + 97 * i + salt] + [(31 * i + 7 * j + salt) % 9000 + 200 for j in range(length)]
            for i in range(n)]  # fmt: skip


def long_input_prompts(n: int) -> list[list[int]]:
    """The long-input workload's prompts, rendered with the demo tokenizer, N in turn."""
    from transformers import AutoTokenizer

    from loadtest.workloads import long_input
    from tokenrouter_ray.demo import prepare_demo
    from tokenrouter_ray.openai.chat import render_chat

    tokenizer = AutoTokenizer.from_pretrained(str(prepare_demo(quiet=True)))
    rendered = [render_chat(tokenizer, m) for m in long_input().prompts]
    return [rendered[i % len(rendered)] for i in range(n)]


async def run(
    caching: bool, n: int, tokens: int, salt: int, workload: list[list[int]] | None = None
) -> tuple[float, list[list[int]]]:
    engines, _ = demo_pair_engines(caching)
    policy = build_policy("bernoulli", {"p": 0.35}, [name for name, _ in engines])
    spec = SamplingSpec(temperature=0.0, max_tokens=tokens, seed=1, ignore_eos=True)
    async with LocalRuntime(engines, policy) as runtime:
        await runtime.complete_all(prompts(n, 24, salt + 1), spec)  # warm-up
        t0 = time.perf_counter()
        done = await runtime.complete_all(workload or prompts(n, 120, salt), spec)
        elapsed = time.perf_counter() - t0
    return sum(len(c.token_ids) for c in done) / elapsed, [c.token_ids for c in done]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=None, help="default 64; long_input 32")
    parser.add_argument("--workload", choices=["unique", "long_input"], default="unique")
    args = parser.parse_args(argv)
    long = args.workload == "long_input"
    workload = long_input_prompts(args.n) if long else None
    tokens = args.tokens or (32 if long else 64)
    what = "long-input workload" if long else "nothing shared"
    print(f"# prefix caching, {what}: {machine()}\n# {command()}", flush=True)
    rates: dict[bool, list[float]] = {True: [], False: []}
    outputs: dict[bool, list[list[int]]] = {}
    for k in range(args.rounds):
        for caching in (False, True) if k % 2 == 0 else (True, False):
            rate, out = asyncio.run(run(caching, args.n, tokens, salt=0, workload=workload))
            rates[caching].append(rate)
            outputs[caching] = out
            print(f"round {k + 1} caching {'on ' if caching else 'off'} {rate:7.2f} tok/s",
                  flush=True)  # fmt: skip
    on, off = statistics.median(rates[True]), statistics.median(rates[False])
    same = outputs[True] == outputs[False]
    cost = 1.0 - on / off
    print(f"median: on {on:.2f} tok/s, off {off:.2f} tok/s: caching costs {cost:+.1%}; "
          f"outputs identical: {same}")  # fmt: skip
    if long:
        print(f"caching on / off on the long-input workload: {on / off:.2f}x")
    else:
        print(f"{'PASS' if cost <= 0.02 else 'MISS'}  caching costs <= 2 % when nothing is shared")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
