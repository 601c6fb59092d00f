"""Speed next to quality: agreement with the large model alone, and its share of the tokens.

Every system answers the same requests, so each answer has a reference: the large model
alone on the same prompt and level. **match**: the share of positions whose token equals
the reference's; **prefix**: the share before the first divergence. Once texts diverge they
shift, so the figure that follows routing token by token is **teacher-forced agreement**:
the large model (plain ``transformers``, after every server is down) predicts each answer
position from the answer's own prefix, and the share where its choice is the answer's token
is reported (means over positions). The large model's share is its tokens over all tokens
of the level's finished requests (their final chunks' ``routing``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

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


Scorer = Callable[[int, str], tuple[int, int]]  # (request index, answer) -> (agree, positions)


class TeacherForced:
    """The large model as a greedy judge of answers (see module docstring): ``(k, text)``
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
    per_model = row.get("tokens_per_model") or {}
    total = sum(per_model.values())
    share = (per_model.get("large", 0) / total) if total else math.nan
    if total and row["system"] in ONE_MODEL:  # one model, reported as "alone"
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


def _pct(x: float) -> str:
    return "–" if x is None or math.isnan(x) else f"{x:.0%}"


def quality_table(entries: Sequence[Mapping[str, Any]]) -> str:
    head = (
        "| system | load | max tok | tok/s | large model's share | handoffs/req "
        "| teacher-forced agreement | match with large alone | prefix agreement | compared |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"
    )
    lines = [head]
    for q in entries:
        h = q["handoffs_per_request"]
        lines.append(
            f"| {q['label']} | N={q['concurrency']} | {q['max_tokens']} | {q['tok_s']:.1f} "
            f"| {_pct(q['large_share'])} | {'–' if h is None or math.isnan(h) else f'{h:.1f}'} "
            f"| {_pct(q.get('teacher_forced', math.nan))} | {_pct(q['match'])} "
            f"| {_pct(q['prefix'])} "
            f"| {q['compared_requests']} req, {q['compared_positions']} tok |"
        )
    return "\n".join(lines)
