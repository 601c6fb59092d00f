"""The bundled workloads: chat prompts built in code from fixed text, no downloads.

- ``short_chat``: ~100-token questions with a little context, answers up to 256 tokens.
- ``long_generation``: short instructions asking for long text (1,024 tokens on CPU, up to
  8,192 on GPU).
- ``long_input``: ~2k-token prompts (a seeded inventory ledger) with a short question.

A workload is a list of chat messages and a token cap per request; the harness cycles
through the prompts, so the same run always sends the same requests in the same order.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

CHAT_QUESTIONS = [
    "I am planning a small vegetable garden on a sunny balcony of about four square metres. "
    "I have a few large pots, a watering can and a bag of compost, and I can spend half an "
    "hour a day on it. Which vegetables should I start with, and in which order should I sow "
    "them through the spring so that something is ready to eat every few weeks?",
    "My team keeps missing deadlines because tasks are estimated by whoever is free at the "
    "time, and estimates are often off by a factor of two. We are five people, we use a "
    "shared board, and we meet every Monday. Suggest a simple way to make our estimates more "
    "reliable without adding a lot of process or new tools.",
    "Explain to a curious twelve year old why the sky is blue during the day but red and "
    "orange at sunset. Use one everyday comparison they would recognise, keep it short, and "
    "end with a small experiment they could try at home with a glass of water and a torch.",
    "I have a Python script that reads a large CSV file line by line, converts a few columns "
    "to numbers and writes a summary at the end. It takes ten minutes on a file of two "
    "gigabytes. What are the first three things I should check or change to make it faster, "
    "and how would I measure whether each change helped?",
    "Write a friendly message to a neighbour asking whether they could water my plants while "
    "I am away for a week in August. Mention that I will leave a key and written instructions, "
    "offer to return the favour, and keep the tone warm but not too formal.",
    "Compare travelling from Paris to Rome by train and by plane for a family of four with two "
    "small children. Consider total travel time from door to door, cost, comfort, luggage and "
    "how tiring the day will be. Give a short recommendation at the end.",
    "Summarise the main causes of the French Revolution for a student revising for an exam "
    "tomorrow. Group them into economic, political and social causes, give one concrete "
    "example for each group, and keep the whole answer easy to remember.",
    "I want to start running but I have never done any sport regularly and I get out of "
    "breath quickly. I can run three times a week for about thirty minutes. Propose a plan for "
    "the first six weeks that avoids injury and keeps me motivated.",
]

LONG_TASKS = [
    "Write a long, detailed story about a lighthouse keeper who finds a message in a bottle.",
    "Write a thorough guide to baking bread at home, from choosing flour to the first slice.",
    "Describe, in great detail, a walk through a busy city market from dawn until dusk.",
    "Write a long essay on how the printing press changed science, religion and politics.",
]

_ITEMS = ["crate", "barrel", "sack", "box", "drum", "case", "bundle", "tin", "jar", "roll"]
_GOODS = ["flour", "nails", "rope", "salt", "coffee", "wool", "oil", "tea", "rice", "paint"]
_PLACES = ["north shed", "south dock", "east loft", "west yard", "cellar", "main hall"]


def inventory_ledger(seed: int, lines: int) -> str:
    """A seeded, plausible ledger: one entry per line (~25 tokens each)."""
    rng = random.Random(seed)
    out = []
    for i in range(lines):
        out.append(
            f"Entry {i + 1}: one {rng.choice(_ITEMS)} of {rng.choice(_GOODS)}, "
            f"{rng.randint(2, 95)} kg, stored in the {rng.choice(_PLACES)} on day "
            f"{rng.randint(1, 28)}, checked by clerk {rng.randint(1, 12)}."
        )
    return "\n".join(out)


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[dict[str, str]]]  # chat messages per prompt
    max_tokens: int

    def request(self, k: int) -> list[dict[str, str]]:
        return self.prompts[k % len(self.prompts)]


def short_chat(max_tokens: int = 256) -> Workload:
    prompts = [[{"role": "user", "content": q}] for q in CHAT_QUESTIONS]
    return Workload("short_chat", prompts, max_tokens)


def long_generation(max_tokens: int = 1024) -> Workload:
    prompts = [[{"role": "user", "content": t}] for t in LONG_TASKS]
    return Workload("long_generation", prompts, max_tokens)


def long_input(max_tokens: int = 32, lines: int = 80) -> Workload:
    """``lines`` = 80 gives prompts of about 2k tokens with the demo tokenizer."""
    prompts = []
    for seed in range(4):
        ledger = inventory_ledger(seed, lines)
        question = "Which entry is the heaviest, and where is it stored? Answer in one sentence."
        prompts.append([{"role": "user", "content": f"{ledger}\n\n{question}"}])
    return Workload("long_input", prompts, max_tokens)


def tiny_words(max_tokens: int = 8, vocab: int = 100) -> Workload:
    """Prompts in the tiny test tokenizer's words (``w0``..``w{vocab-1}``), for the CI run
    on random-weight models."""
    rng = random.Random(0)
    prompts = [
        [{"role": "user", "content": " ".join(f"w{rng.randrange(vocab)}" for _ in range(12))}]
        for _ in range(4)
    ]
    return Workload("tiny_words", prompts, max_tokens)


WORKLOADS = {
    "short_chat": short_chat,
    "long_generation": long_generation,
    "long_input": long_input,
    "tiny_words": tiny_words,
}
