"""Speed next to quality (docs/benchmarks/README.md, "Speed next to quality"): each answer
against the large model alone's (match, prefix) and, since texts shift once they diverge,
teacher-forced: the share of positions where the large model, reading the answer's own
prefix, picks the answer's token; and the large model's share of the tokens."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from loadtest.common import markdown_table, number

REFERENCE = "large_alone"
ONE_MODEL = {"large_alone": 1.0, "large_stock": 1.0, "small_alone": 0.0}  # large's share


def agreement(tokens: Sequence[int], reference: Sequence[int]) -> tuple[float, float, int]:
    """(match, prefix, positions compared) of one answer against its reference."""
    length = min(len(tokens), len(reference))
    if length == 0:
        return math.nan, math.nan, 0
    same = [a == b for a, b in zip(tokens[:length], reference[:length], strict=True)]
    prefix = same.index(False) if False in same else length
    return sum(same) / length, prefix / length, length


def large_share(row: Mapping[str, Any]) -> float:
    """Share of output tokens written by the large model, over the finished requests."""
    per_model = row.get("tokens_per_model") or {}
    total = sum(per_model.values())
    return per_model.get("large", 0) / total if total else math.nan


Scorer = Callable[[int, str], tuple[int, int]]  # (request index, answer) -> (agree, positions)


class TeacherForced:
    """The large model as a greedy judge of answers: ``(k, text)``
    -> (positions where its greedy choice given the answer's prefix equals the answer's
    token, positions), for request k's prompt. Identical answers are scored once."""

    def __init__(self, large_dir: str, messages: Callable[[int], list[dict]], dtype: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from tokenrouter_ray.openai.chat import render_chat

        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(large_dir)
        torch_dtype = torch.float32 if dtype == "auto" else getattr(torch, dtype)
        self.model = AutoModelForCausalLM.from_pretrained(large_dir, dtype=torch_dtype).eval()
        self.prompt = lambda k: list(render_chat(self.tokenizer, messages(k)))
        self.cache: dict[tuple[int, str], tuple[int, int]] = {}

    def __call__(self, k: int, text: str) -> tuple[int, int]:
        key = (k, text)
        if key not in self.cache:
            prompt = self.prompt(k)
            answer = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
            if not answer:
                return 0, 0
            # a text the tokenizer reads back as a token the model does not have (an unknown
            # word from a stock server's text): fed as id 0, and never an agreement
            vocab = self.model.get_input_embeddings().num_embeddings
            ids = self.torch.tensor([[i if i < vocab else 0 for i in prompt + answer]])
            with self.torch.inference_mode():
                logits = self.model(ids).logits[0, len(prompt) - 1 : -1]
            greedy = logits.argmax(-1).tolist()
            agree = sum(int(a == b) for a, b in zip(greedy, answer, strict=True))
            self.cache[key] = (agree, len(answer))
        return self.cache[key]


def level_quality(
    row: Mapping[str, Any],
    reference: Mapping[str, Any] | None,
    tokenize: Callable[[str], list[int]],
    num_prompts: int,
    scorer: Scorer | None = None,
) -> dict[str, Any]:
    """Agreement of one level's answers with the reference level's, per prompt, and with
    the large model's teacher-forced choices (``scorer``)."""
    ref_by_prompt: dict[int, list[int]] = {}
    for rec in sorted((reference or {}).get("records", []), key=lambda r: r["index"]):
        ref_by_prompt.setdefault(rec["index"] % num_prompts, tokenize(rec["text"]))
    matches, prefixes, positions = [], [], 0
    forced = [0, 0]
    for rec in row["records"]:
        if scorer is not None:
            agree, n = scorer(rec["index"], rec["text"])
            forced[0] += agree
            forced[1] += n
        ref = ref_by_prompt.get(rec["index"] % num_prompts)
        if ref is None:
            continue
        match, prefix, length = agreement(tokenize(rec["text"]), ref)
        if length:
            matches.append(match)
            prefixes.append(prefix)
            positions += length
    share = large_share(row)
    if not math.isnan(share) and row["system"] in ONE_MODEL:  # one model, reported as "alone"
        share = ONE_MODEL[row["system"]]
    return {
        "system": row["system"],
        "label": row["label"],
        "concurrency": row["concurrency"],
        "max_tokens": row["max_tokens"],
        "tok_s": row["tok_s"],
        "large_share": share,
        "handoffs_per_request": row["handoffs_per_request"],
        "match": statistics.fmean(matches) if matches else math.nan,
        "prefix": statistics.fmean(prefixes) if prefixes else math.nan,
        "teacher_forced": forced[0] / forced[1] if forced[1] else math.nan,
        "compared_requests": len(matches),
        "compared_positions": positions,
    }


def closed_row(
    rows: Sequence[Mapping[str, Any]], system: str, n: int, max_tokens: int | None = None,
    modes: tuple[str, ...] = ("closed", "length"),
) -> Mapping[str, Any] | None:  # fmt: skip
    """The first row of ``system`` at N = ``n`` (a closed-loop mode, ``max_tokens`` if given)."""
    return next((r for r in rows if r["system"] == system and r["concurrency"] == n and
                 r["mode"] in modes and max_tokens in (None, r["max_tokens"])), None)  # fmt: skip


def quality(
    rows: Sequence[Mapping[str, Any]],
    tokenize: Callable[[str], list[int]],
    num_prompts: int,
    n: int,
    max_tokens: int,
    scorer: Scorer | None = None,
) -> list[dict[str, Any]]:
    """One entry per system measured closed-loop at (n, max_tokens), the reference first
    (match and prefix are nan without it)."""

    reference = closed_row(rows, REFERENCE, n, max_tokens, ("closed",))
    systems = [REFERENCE] + [s for s in dict.fromkeys(r["system"] for r in rows) if s != REFERENCE]
    out = []
    for system in systems:
        row = closed_row(rows, system, n, max_tokens, ("closed",))
        if row is not None:
            out.append(level_quality(row, reference, tokenize, num_prompts, scorer))
    return out


COLUMNS = ["system", "load", "max tok:", "tok/s:", "large model's share:", "handoffs/req:",
           "teacher-forced agreement:", "match with large alone:", "prefix agreement:",
           "compared"]  # fmt: skip


def quality_table(entries: Sequence[Mapping[str, Any]]) -> str:
    rows = [[q["label"], f"N={q['concurrency']}", q["max_tokens"], f"{q['tok_s']:.1f}",
             number(q["large_share"], ".0%"), number(q["handoffs_per_request"]),
             number(q.get("teacher_forced", math.nan), ".0%"), number(q["match"], ".0%"),
             number(q["prefix"], ".0%"),
             f"{q['compared_requests']} req, {q['compared_positions']} tok"]
            for q in entries]  # fmt: skip
    return markdown_table(COLUMNS, rows)
