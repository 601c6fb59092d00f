"""Measured throughput next to the Markov model's prediction at the step times the tuner
measured, and why the tuner chose its thresholds (docs/benchmarks/README.md, "Measured vs
the Markov prediction"). The measured figure is the level's steady state (all N decoding),
the closed system the model describes."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from typing import Any

from loadtest.quality import large_share
from tokenrouter_ray.thresholds import is_admissible
from tokenrouter_ray.tuning.markov import throughput
from tokenrouter_ray.tuning.profile import ModelProfile, RoutingProfile
from tokenrouter_ray.tuning.tuner import fill_step_times

TARGET = 0.9  # measured >= 90 % of the prediction
MIN_STEADY_S = 1.0  # a shorter all-N window is too noisy: fall back to the whole level


def steady_rate(row: Mapping[str, Any], n: int) -> tuple[float, float]:
    """(tokens/s, seconds) over the time exactly ``n`` requests were decoding (between their
    first token and their end), from the level's records; tokens per chunk is the level's
    mean (a chunk is usually one token). (nan, 0) when there was no such time."""
    records = [r for r in row.get("records", []) if r["first"] is not None and r["end"]]
    events = sorted(
        [(r["first"], 1) for r in records] + [(r["end"], -1) for r in records],
        key=lambda e: (e[0], e[1]),  # an end before a start at the same instant
    )
    windows, active, opened = [], 0, None
    for t, delta in events:
        if active == n and opened is not None and t > opened:
            windows.append((opened, t))
        active += delta
        opened = t
    seconds = sum(b - a for a, b in windows)
    chunks = sum(len(r["chunk_times"]) for r in records)
    if seconds <= 0 or chunks == 0:
        return math.nan, 0.0
    per_chunk = sum(r["tokens"] for r in records) / chunks
    inside = sum(
        1 for r in records for t in r["chunk_times"] if any(a < t <= b for a, b in windows)
    )
    return inside * per_chunk / seconds, seconds


def escalate_once_profile(
    step_ms: Mapping[str, Mapping[str, float]], q: float, grain_ms: float, top: int
) -> RoutingProfile:
    """The two-model escalate-once profile (``small``, ``large``) at escalation rate ``q``
    with the tuner's step-time tables (batch -> ms), filled up to batch ``top``."""
    models = []
    for name in ("small", "large"):
        table = {int(b): float(ms) for b, ms in (step_ms.get(name) or {}).items()}
        if not table:
            raise ValueError(f"no step times for {name!r} yet")
        filled = fill_step_times(table, top)
        models.append(ModelProfile(name, tuple(sorted(filled.items()))))
    return RoutingProfile(
        tuple(models), ((1.0 - q, q), (1.0, 0.0)), ((1.0, 0.0), (1.0, 0.0)), grain_ms
    )


def threshold_at(tuner: Mapping[str, Any], model: str, n: int) -> int:
    table = tuner["thresholds"][model]
    return int(table[min(n, len(table) - 1)])


def predict(row: Mapping[str, Any], tuner: Mapping[str, Any]) -> dict[str, Any]:
    """Measured vs predicted for one level (see module docstring); a JSON-able dict, with
    ``error`` set (and no figures) when the tuner had no step times yet."""
    n = int(row["concurrency"])
    q = large_share(row)  # escalate-once: each escalated position is one large token
    source = "large share of the level's finished tokens"
    if math.isnan(q):
        q = float((tuner.get("last") or {}).get("route_prob", {}).get("small->large", math.nan))
        source = "the tuner's window"
    out: dict[str, Any] = {"n": n, "escalation_rate": q, "escalation_source": source}
    grain = float((tuner.get("spec") or {}).get("grain_ms", 0.5))
    try:
        if math.isnan(q):
            raise ValueError("no escalation rate measured")
        profile = escalate_once_profile(tuner.get("step_ms") or {}, q, grain, n)
    except ValueError as exc:
        return out | {"error": str(exc)}
    in_use = (threshold_at(tuner, "small", n), threshold_at(tuner, "large", n))
    scores = {
        combo: throughput(profile, n, combo).throughput
        for combo in itertools.product(range(1, n + 1), repeat=2)
        if is_admissible(n, combo)
    }
    eager = scores[(1, 1)]
    deferring = max((c for c in scores if max(c) > 1), key=scores.get, default=None)
    best = max(scores, key=scores.get)
    steady, steady_s = steady_rate(row, n)
    measured, basis = steady, f"steady state, all {n} decoding for {steady_s:.1f} s"
    if steady_s < MIN_STEADY_S:
        measured, basis = row["tok_s"], "whole level (no steady window of >= 1 s)"
    predicted = scores[in_use]
    return out | {
        "step_ms": {m.name: {b: round(t, 2) for b, t in m.step_ms} for m in profile.models},
        "grain_ms": grain,
        "thresholds": list(in_use),
        "predicted_tok_s": predicted,
        "measured_tok_s": measured,
        "measured_basis": basis,
        "level_tok_s": row["tok_s"],
        "ratio": measured / predicted if predicted else math.nan,
        "all_one_tok_s": eager,
        "best_deferring": None if deferring is None else list(deferring),
        "best_deferring_tok_s": None if deferring is None else scores[deferring],
        "best": list(best),
        "best_tok_s": scores[best],
        "tuner_decisions": tuner.get("decisions"),
        "min_gain": float((tuner.get("spec") or {}).get("min_gain", 0.02)),
        "tuner_reason": (tuner.get("last") or {}).get("reason"),
        "tuner_history": [h.get("reason") for h in tuner.get("history", [])],
    }


def prediction_lines(pred: Mapping[str, Any]) -> list[str]:
    """The target line and the tuner's choice (Markdown list items, without '- ')."""
    n = pred["n"]
    if "error" in pred:
        return [f"n/a  measured vs Markov prediction at N={n}: {pred['error']}"]
    x = pred["ratio"]
    verdict = "PASS" if x >= TARGET else "MISS"
    label = f"B_small={pred['thresholds'][0]}, B_large={pred['thresholds'][1]}"
    steps = "; ".join(
        f"{m} " + ", ".join(f"b{b} {t:.1f}" for b, t in sorted(tab.items()) if b in (1, 2, 4, n))
        for m, tab in pred["step_ms"].items()
    )
    lines = [
        f"{verdict} measured vs Markov prediction at N={n} ({label}): {pred['measured_tok_s']:.1f}"
        f" vs {pred['predicted_tok_s']:.1f} tok/s = {x:.0%} (target >= {TARGET:.0%}; measured "
        f"{pred['measured_basis']}; whole level {pred['level_tok_s']:.1f} tok/s; escalation "
        f"rate {pred['escalation_rate']:.3f} from {pred['escalation_source']}; step ms {steps})",
    ]
    chosen = f"tuner's thresholds at N={n}: {label} after {pred['tuner_decisions']} decisions"
    chosen += f" (last: {pred['tuner_reason']!r})"
    min_gain = pred.get("min_gain", 0.02)
    if pred["thresholds"] == [1, 1] and pred["best_deferring"] is not None:
        b = pred["best_deferring"]
        gain = pred["best_deferring_tok_s"] / pred["all_one_tok_s"] - 1
        chosen += (
            f"; all 1. Why, by the Markov model at the measured step times: all-1 predicts "
            f"{pred['all_one_tok_s']:.1f} tok/s, the best table that defers (B_small={b[0]}, "
            f"B_large={b[1]}) {pred['best_deferring_tok_s']:.1f} ({gain:+.1%}"
        )
        if gain <= 0:
            chosen += "): deferring loses, a CPU step grows with the batch"
        elif gain < min_gain:
            chosen += f", below the tuner's min_gain of {min_gain:.0%}): deferring does not pay"
        else:
            chosen += (
                f", above min_gain {min_gain:.0%}): the model would defer; the tuner moves by "
                "at most max_step per decision, or had too few observations yet"
            )
    else:
        chosen += (
            f"; Markov model at the measured step times: this table {pred['predicted_tok_s']:.1f}"
            f" tok/s, all-1 {pred['all_one_tok_s']:.1f}, best (B_small={pred['best'][0]}, "
            f"B_large={pred['best'][1]}) {pred['best_tok_s']:.1f}"
        )
    return [lines[0], "info " + chosen]
