"""Speed next to quality: greedy agreement with the large model alone, and the share of
tokens the large model wrote.

Every system answers the same requests (request k is prompt ``k mod P`` of the workload,
seed ``7 + k``, greedy, ``ignore_eos``), so each answer has a reference: the large model
alone (``large_alone``, our engine) on the same prompt, same level (N, max_tokens). Both
answers are re-tokenized from their streamed text with the pair's tokenizer and compared
over the positions both have (a request cut at the time limit is compared over what it
received):

- **match**: the share of positions whose token equals the large model's token at the same
  position (after a first divergence the texts shift, so this counts re-converged stretches
  too, and is an upper bound on prefix agreement);
- **prefix**: the share of positions before the first divergence (1.0: the whole answer is
  the large model's own greedy answer).

Both are means over requests. The large model's share is its tokens over all tokens of the
level's finished requests (the ``routing`` object of their final chunks).
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


def level_quality(
    row: Mapping[str, Any],
    reference: Mapping[str, Any],
    tokenize: Callable[[str], list[int]],
    num_prompts: int,
) -> dict[str, Any]:
    """Agreement of one level's answers with the reference level's, per prompt."""
    ref_by_prompt: dict[int, list[int]] = {}
    for rec in sorted(reference["records"], key=lambda r: r["index"]):
        ref_by_prompt.setdefault(rec["index"] % num_prompts, tokenize(rec["text"]))
    matches, prefixes, positions = [], [], 0
    for rec in row["records"]:
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
        "compared_requests": len(matches),
        "compared_positions": positions,
    }


def quality(
    rows: Sequence[Mapping[str, Any]],
    tokenize: Callable[[str], list[int]],
    num_prompts: int,
    n: int,
    max_tokens: int,
) -> list[dict[str, Any]]:
    """One entry per system measured closed-loop at (n, max_tokens), the reference first;
    empty when the reference was not measured there."""

    def level(system: str) -> Mapping[str, Any] | None:
        for r in rows:
            if (
                r["system"] == system
                and r["mode"] == "closed"
                and r["concurrency"] == n
                and r["max_tokens"] == max_tokens
            ):
                return r
        return None

    reference = level(REFERENCE)
    if reference is None:
        return []
    systems = [REFERENCE] + [s for s in dict.fromkeys(r["system"] for r in rows) if s != REFERENCE]
    out = []
    for system in systems:
        row = level(system)
        if row is not None:
            out.append(level_quality(row, reference, tokenize, num_prompts))
    return out


def _pct(x: float) -> str:
    return "–" if x is None or math.isnan(x) else f"{x:.0%}"


def quality_table(entries: Sequence[Mapping[str, Any]]) -> str:
    head = (
        "| system | load | max tok | tok/s | large model's share | handoffs/req "
        "| match with large alone | prefix agreement | compared |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|---|"
    )
    lines = [head]
    for q in entries:
        h = q["handoffs_per_request"]
        lines.append(
            f"| {q['label']} | N={q['concurrency']} | {q['max_tokens']} | {q['tok_s']:.1f} "
            f"| {_pct(q['large_share'])} | {'–' if h is None or math.isnan(h) else f'{h:.1f}'} "
            f"| {_pct(q['match'])} | {_pct(q['prefix'])} "
            f"| {q['compared_requests']} req, {q['compared_positions']} tok |"
        )
    return "\n".join(lines)
