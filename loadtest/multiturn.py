"""Multi-turn conversations on the demo pair, with prefix caching on and off: prompt tokens
prefilled and time to first token, per turn.

Every conversation starts with the same system prompt; turn k+1's prompt is turn k's prompt
plus its answer plus a new user message (in token ids, so it extends turn k exactly, the way
an agent loop or a chat client resends the history). The conversations of one turn are
submitted together through ``LocalRuntime`` (bernoulli routing between the small and the
large model, so handoffs' first visits reach the large model's cache too), one turn after
the other. "Prefill" counts the prompt tokens each model really computed (prompt positions
in the scheduled chunks, recomputes included), summed over the models; output tokens are the
same with and without caching, so they are left out. Greedy outputs must be identical with
caching on and off; the run checks that before printing figures.

Expected: from the second turn on, caching prefills at least 5x fewer prompt tokens (PASS /
MISS on the last turns' total).

    python -m loadtest.multiturn [--conversations 2] [--turns 4] [--tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from transformers import AutoTokenizer

from loadtest.common import command, demo_pair_engines, machine
from tokenrouter_ray.demo import prepare_demo
from tokenrouter_ray.engine.scheduler import Scheduler, SchedulerOutput
from tokenrouter_ray.local import LocalRuntime
from tokenrouter_ray.openai.chat import render_chat
from tokenrouter_ray.protocol import SamplingSpec
from tokenrouter_ray.routing.policy import build_policy

SYSTEM = (
    "You are a careful assistant for a small engineering team. Answer in plain English, "
    "keep every answer short, give one concrete example when it helps, say when you are not "
    "sure, never invent references, and prefer simple words over jargon. When asked about "
    "code, name the function or file first, then explain what it does and why. When asked "
    "for a plan, give at most three steps. When a question is ambiguous, state the reading "
    "you chose. Keep a friendly, direct tone and do not repeat the question back."
)
MESSAGES = [
    "What is a hash table?",
    "How does it handle collisions?",
    "Which one would you pick for a cache?",
    "Give me a one-line summary of all that.",
    "And what about memory use?",
    "Thanks. Anything else I should know?",
]
TOPICS = ["a hash table", "a linked list", "a binary heap", "a bloom filter"]


@dataclass
class Turn:
    prefill: list[int] = field(default_factory=list)  # prompt tokens computed, per run
    ttft_s: list[float] = field(default_factory=list)
    prompt_len: list[int] = field(default_factory=list)


class PrefillCounter:
    """Counts prompt positions in every chunk a scheduler hands out (wraps ``schedule``)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.tokens = 0
        inner = scheduler.schedule

        def schedule(now: float) -> SchedulerOutput:
            out = inner(now)
            for c in out.chunks:
                prompt_end = c.request.num_prompt_tokens
                self.tokens += max(0, min(c.start + c.num_tokens, prompt_end) - c.start)
            return out

        scheduler.schedule = schedule  # type: ignore[method-assign]


def next_prompt(tokenizer: object, prompt: list[int], answer: list[int], msg: str) -> list[int]:
    """Turn k+1: turn k's prompt + its answer + the next user message (ChatML)."""
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")  # type: ignore[attr-defined]
    closed = answer if answer and answer[-1] == end else [*answer, end]
    text = f"\n<|im_start|>user\n{msg}<|im_end|>\n<|im_start|>assistant\n"
    return [*prompt, *closed, *tokenizer.encode(text, add_special_tokens=False)]  # type: ignore[attr-defined]


async def conversations(
    caching: bool, tokenizer: object, n: int, turns: int, tokens: int
) -> tuple[list[Turn], list[list[int]], str]:
    engines, label = demo_pair_engines(caching)
    counters = [PrefillCounter(e.scheduler) for _, e in engines]
    policy = build_policy("bernoulli", {"p": 0.2}, ["small", "large"])
    spec = SamplingSpec(temperature=0.0, max_tokens=tokens, seed=7)
    prompts = [
        render_chat(
            tokenizer,
            [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Tell me about {TOPICS[i % len(TOPICS)]}."},
            ],
        )
        for i in range(n)
    ]
    per_turn, outputs = [], []
    async with LocalRuntime(engines, policy) as runtime:
        warm = render_chat(tokenizer, [{"role": "user", "content": "Hello there."}])
        await runtime.complete_all([warm], spec)  # first-step costs out of turn 1's TTFT
        await runtime.wait_idle()
        for k in range(turns):
            before = sum(c.tokens for c in counters)
            done = await runtime.complete_all(prompts, spec)
            await runtime.wait_idle()
            turn = Turn(
                prefill=[sum(c.tokens for c in counters) - before],
                ttft_s=[d.ttft_s or 0.0 for d in done],
                prompt_len=[len(p) for p in prompts],
            )
            per_turn.append(turn)
            outputs += [d.token_ids for d in done]
            msg = MESSAGES[k % len(MESSAGES)]
            prompts = [
                next_prompt(tokenizer, p, d.token_ids, msg)
                for p, d in zip(prompts, done, strict=True)
            ]
    return per_turn, outputs, label


def report(on: Sequence[Turn], off: Sequence[Turn]) -> bool:
    print("| turn | prompt tokens (mean) | prefilled off | prefilled on | ratio | "
          "TTFT off (median) | TTFT on (median) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for k, (a, b) in enumerate(zip(off, on, strict=True), start=1):
        ratio = a.prefill[0] / max(1, b.prefill[0])
        print(
            f"| {k} | {statistics.mean(a.prompt_len):.0f} | {a.prefill[0]} | {b.prefill[0]} | "
            f"{ratio:.1f}x | {1e3 * statistics.median(a.ttft_s):.0f} ms | "
            f"{1e3 * statistics.median(b.ttft_s):.0f} ms |"
        )
    later_off = sum(t.prefill[0] for t in off[1:])
    later_on = sum(t.prefill[0] for t in on[1:])
    ratio = later_off / max(1, later_on)
    ok = ratio >= 5
    verdict = "PASS" if ok else "MISS"
    print(f"turns 2..{len(off)}: {later_off} vs {later_on} prompt tokens prefilled, "
          f"{ratio:.1f}x fewer with caching: {verdict} (target >= 5x)")  # fmt: skip
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=2, help="conversations per turn")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32, help="max answer tokens per turn")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(str(prepare_demo(quiet=True)))
    runs = {}
    for caching in (False, True):
        runs[caching] = asyncio.run(
            conversations(caching, tokenizer, args.conversations, args.turns, args.tokens)
        )
    (off, out_off, label), (on, out_on, _) = runs[False], runs[True]
    if out_off != out_on:
        raise SystemExit("greedy outputs differ with caching on and off")
    print(f"# {command()}\n# {machine()}; small model: {label}; outputs identical on/off")
    report(on, off)


if __name__ == "__main__":
    main()
