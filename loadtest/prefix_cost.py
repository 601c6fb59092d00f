"""What prefix caching costs when nothing is shared: the demo pair, caching on vs off.

    python -m loadtest.prefix_cost [--rounds 3] [--n 8] [--tokens 64]

N requests at once through ``LocalRuntime`` (bernoulli 0.35 routing between the demo's small
and large model), every prompt unique from its first token on (so no block is ever shared:
the cache only hashes, registers and evicts), greedy, ``ignore_eos``. The on and off engines
run alternately, ``--rounds`` times each, in one process; printed: committed tok/s per run,
the median of each, their ratio, and PASS/MISS against the target (caching costs <= 2 %).
The outputs must be identical both ways; the run checks it.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from loadtest.common import command, machine
from loadtest.multiturn import pair
from tokenrouter_ray.protocol import SamplingSpec
from tokenrouter_ray.routing.policy import build_policy
from tokenrouter_ray.runtime.local import LocalRuntime


def prompts(n: int, length: int, salt: int) -> list[list[int]]:
    """Unique prompts: each starts with its own token, so no full block matches another."""
    return [[1000 + 97 * i + salt] + [(31 * i + 7 * j + salt) % 9000 + 200 for j in range(length)]
            for i in range(n)]  # fmt: skip


async def run(caching: bool, n: int, tokens: int, salt: int) -> tuple[float, list[list[int]]]:
    engines, _ = pair(caching)
    policy = build_policy("bernoulli", {"p": 0.35}, [name for name, _ in engines])
    spec = SamplingSpec(temperature=0.0, max_tokens=tokens, seed=1, ignore_eos=True)
    async with LocalRuntime(engines, policy) as runtime:
        await runtime.complete_all(prompts(n, 24, salt + 1), spec)  # warm-up
        t0 = time.perf_counter()
        done = await runtime.complete_all(prompts(n, 120, salt), spec)
        elapsed = time.perf_counter() - t0
    return sum(len(c.token_ids) for c in done) / elapsed, [c.token_ids for c in done]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args(argv)
    print(f"# prefix caching, nothing shared: {machine()}\n# {command()}", flush=True)
    rates: dict[bool, list[float]] = {True: [], False: []}
    outputs: dict[bool, list[list[int]]] = {}
    for k in range(args.rounds):
        for caching in (False, True) if k % 2 == 0 else (True, False):
            rate, out = asyncio.run(run(caching, args.n, args.tokens, salt=0))
            rates[caching].append(rate)
            outputs[caching] = out
            print(f"round {k + 1} caching {'on ' if caching else 'off'} {rate:7.2f} tok/s",
                  flush=True)  # fmt: skip
    on, off = statistics.median(rates[True]), statistics.median(rates[False])
    same = outputs[True] == outputs[False]
    cost = 1.0 - on / off
    print(f"median: on {on:.2f} tok/s, off {off:.2f} tok/s: caching costs {cost:+.1%}; "
          f"outputs identical: {same}")  # fmt: skip
    print(f"{'PASS' if cost <= 0.02 else 'MISS'}  caching costs <= 2 % when nothing is shared")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
