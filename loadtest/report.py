"""A run's results: the Markdown table, the targets (PASS / MISS, never an error) and the
plots (throughput vs N, latency CDFs, throughput vs output length), by ``write_outputs``."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from typing import Any

from loadtest.common import markdown_table, number, pyplot
from loadtest.prediction import predict, prediction_lines
from loadtest.quality import closed_row, quality_table
from tokenrouter_ray.metrics.latency import token_gaps

TARGET_N = 8


def _ms(x: float | None) -> str:
    return number(None if x is None else x * 1e3, ".0f")


def _share(tokens: dict[str, int]) -> str:
    total = sum(tokens.values())
    return ", ".join(f"{m} {n / total:.0%}" for m, n in tokens.items()) if total else "–"


COLUMNS = ["system", "load", "max tok:", "tok/s:", "per-req tok/s:", "TTFT p50/p90/p99 ms",
           "ITL p50/p99 ms", "e2e p50/p90/p99 ms", "handoffs/req:", "tokens by model",
           "finished", "deferred timeouts:"]  # fmt: skip


def table_row(r: dict[str, Any]) -> list[str]:
    t, i, e = r["ttft_s"], r["itl_s"], r["e2e_s"]
    return [r["label"], f"rate {r['rate']}/s" if r["rate"] else f"N={r['concurrency']}",
            r["max_tokens"], f"{r['tok_s']:.1f}", number(r["per_request_tok_s"]),
            "/".join(_ms(t[q]) for q in ("p50", "p90", "p99")),
            "/".join(_ms(i[q]) for q in ("p50", "p99")),
            "/".join(_ms(e[q]) for q in ("p50", "p90", "p99")),
            number(r["handoffs_per_request"]), _share(r["tokens_per_model"]),
            f"{r['finished']}/{r['requests']}", r.get("deferred_timeouts", "–")]  # fmt: skip


def targets(result: dict[str, Any]) -> list[str]:
    """The issue's targets on this run, each PASS / MISS / n/a with its figures, at N = 8
    (or the largest N the run measured)."""
    rows = result["rows"]
    if not rows:
        return []
    measured = {r["concurrency"] for r in rows if r["mode"] == "closed"}
    n = TARGET_N if TARGET_N in measured or not measured else max(measured)
    base = min((r["max_tokens"] for r in rows if r["mode"] == "closed"), default=None)
    ours = closed_row(rows, "tokenrouter", n, base)
    out = []

    def ratio(name: str, other: str, need: float) -> None:
        theirs = closed_row(rows, other, n, base)
        if ours is None or theirs is None or theirs["tok_s"] == 0:
            out.append(f"n/a  {name}: not measured at N={n}")
            return
        x = ours["tok_s"] / theirs["tok_s"]
        note = ""
        if other == "eager_async" and _all_one(ours, n):
            note = (f"; the tuner ran every threshold 1 at N={n}, Eager-Async's table, so the "
                    "difference is run-to-run noise")  # fmt: skip
        out.append(
            f"{'PASS' if x >= need else 'MISS'} {name}: {ours['tok_s']:.1f} vs "
            f"{theirs['tok_s']:.1f} tok/s = {x:.2f}x (target >= {need}x{note})"
        )

    ratio("tokenrouter vs Std. Serving", "std_serving", 5.0)
    ratio("tokenrouter vs Step-Sync", "step_sync", 1.5)
    ratio("tuned vs Eager-Async", "eager_async", 1.0)
    out += length_lines(rows, result.get("length_n", TARGET_N))
    if ours is not None and ours.get("tuner"):
        out += prediction_lines(predict(ours, ours["tuner"]))
    elif ours is not None:
        out.append(f"n/a  measured vs Markov prediction at N={n}: the app runs no tuner")
    timeouts = [r["deferred_timeouts"] for r in rows if "deferred_timeouts" in r]
    if timeouts:
        out.append(f"{'MISS' if sum(timeouts) else 'PASS'} deferred-timeout count: "
                   f"{sum(timeouts)} (target 0)")  # fmt: skip
    else:
        out.append("n/a  deferred-timeout count: the app does not report it")
    return out


def _all_one(row: dict[str, Any], n: int) -> bool:
    tables = (row.get("tuner") or {}).get("thresholds") or {}
    return bool(tables) and all(t[min(n, len(t) - 1)] == 1 for t in tables.values())


LENGTHS = (256, 1024)  # the target: throughput at 1,024 >= 85 % of that at 256


def length_lines(rows: list[dict[str, Any]], n: int) -> list[str]:
    """Throughput at max_tokens 1,024 vs 256 at N = n: PASS / MISS for tokenrouter, the loss
    for Std. Serving; with other lengths only, the longest vs the shortest as info."""
    out = []
    for system in ("tokenrouter", "std_serving"):
        by_len = {r["max_tokens"]: r for r in rows if r["system"] == system
                  and r["concurrency"] == n and r["mode"] in ("closed", "length")}  # fmt: skip
        if len(by_len) < 2:
            continue
        target = all(x in by_len for x in LENGTHS)
        short, long = LENGTHS if target else (min(by_len), max(by_len))
        a, b = by_len[short], by_len[long]
        keep = b["tok_s"] / a["tok_s"] if a["tok_s"] else math.nan
        done = f"finished {a['finished']}/{a['requests']} and {b['finished']}/{b['requests']}"
        figures = (f"{b['tok_s']:.1f} tok/s at max_tokens {long} vs {a['tok_s']:.1f} at "
                   f"{short}, N={n} = {keep:.0%}; {done}")  # fmt: skip
        if not target:
            out.append(f"info {system} {figures} (the target compares {LENGTHS[1]} with "
                       f"{LENGTHS[0]}: python -m loadtest --preset lengths)")  # fmt: skip
        elif system == "tokenrouter":
            verdict = "PASS" if keep >= 0.85 else "MISS"
            out.append(f"{verdict} tokenrouter keeps its throughput: {figures} (target >= 85 %)")
        else:
            out.append(f"info Std. Serving loses {1 - keep:.0%} of its throughput: {figures}")
    return out


def plots(result: dict[str, Any], prefix: str) -> list[str]:
    """PNG files written (empty, with a printed note, when matplotlib is missing)."""
    plt = pyplot()
    if plt is None:
        return []
    rows = result["rows"]
    written = []
    systems = list(dict.fromkeys(r["system"] for r in rows))
    labels = {r["system"]: r["label"] for r in rows}
    colors = {s: f"C{k}" for k, s in enumerate(systems)}
    base = min((r["max_tokens"] for r in rows if r["mode"] == "closed"), default=None)

    def throughput(x: str, keep: Callable[[dict], bool], least: int, **axis: str) -> Any:
        """tok/s against ``x`` per system with at least ``least`` rows that ``keep`` takes;
        the figure, and how many systems it draws."""
        fig, ax = plt.subplots(figsize=(7, 4.5))
        drawn = 0
        for s in systems:
            pts = sorted((r[x], r["tok_s"]) for r in rows if r["system"] == s and keep(r))
            if len(pts) >= least:
                ax.plot(*zip(*pts, strict=True), marker="o", label=labels[s], color=colors[s])
                drawn += 1
        ax.set(ylabel="output tokens/s", **axis)
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize=8)
        return fig, drawn

    fig, _ = throughput("concurrency", lambda r: r["mode"] == "closed" and r["max_tokens"] == base,
                        1, xlabel="concurrent clients N",
                        title=f"Throughput vs N ({base}-token answers)")  # fmt: skip
    written.append(_save(fig, f"{prefix}_throughput.png"))

    n_max = max((r["concurrency"] or 0 for r in rows if r["mode"] == "closed"), default=0)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for s in systems:
        row = closed_row(rows, s, n_max, base)
        if row is None:
            continue
        for ax, key in zip(axes, ("ttft", "itl"), strict=True):
            values = _latencies(row, key)
            if values:
                ys = [(k + 1) / len(values) for k in range(len(values))]
                ax.step(values, ys, where="post", label=labels[s], color=colors[s])
    titles = ("time to first token (per request)", "inter-token latency (per chunk)")
    for ax, title in zip(axes, titles, strict=True):
        ax.set(xlabel="seconds", ylabel="fraction", title=f"{title}, N={n_max}")
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    written.append(_save(fig, f"{prefix}_latency_cdf.png"))

    n_len = result.get("length_n", TARGET_N)
    fig, drawn = throughput("max_tokens", lambda r: r["mode"] in ("closed", "length")
                            and r["concurrency"] == n_len, 2, xlabel="max output tokens",
                            title="Throughput vs max output length")  # fmt: skip
    if drawn:
        fig.axes[0].set_xscale("log", base=2)
        written.append(_save(fig, f"{prefix}_lengths.png"))
    plt.close("all")
    return written


def _latencies(row: dict[str, Any], key: str) -> list[float]:
    out = []
    for rec in row.get("records", []):
        if key == "ttft" and rec["first"] is not None:
            out.append(rec["first"] - rec["start"])
        elif key == "itl":
            out += token_gaps(rec["chunk_times"])
    return sorted(out)


def _save(fig: Any, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def write_outputs(result: dict, out_dir: str, header: str) -> str:
    """``results.json``, the PNG plots and ``results.md`` (``header``, the table, the targets,
    speed next to quality, wall times, failed systems) in ``out_dir``; returns the Markdown."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    table = markdown_table(COLUMNS, map(table_row, result["rows"]))
    checks = targets(result)
    pngs = plots(result, os.path.join(out_dir, "loadtest")) if result["rows"] else []
    md = [header, "", table, "", "Targets (they never fail the run):", ""]
    md += [f"- {c}" for c in checks]
    if result.get("quality"):
        md += [
            "",
            "Speed next to quality (greedy answers re-tokenized and compared position by "
            "position with the large model alone's on the same prompt; loadtest/quality.py):",
            "",
            quality_table(result["quality"]),
        ]
    if result.get("system_wall_s"):
        walls = ", ".join(f"{k} {v:.0f} s" for k, v in result["system_wall_s"].items())
        md += ["", f"Wall time {result.get('wall_s', 0):.0f} s: {walls}"]
    if result["errors"]:
        md += ["", "Systems that failed:", ""] + [
            f"- {k}: {v}" for k, v in result["errors"].items()
        ]
    md += ["", *[f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in pngs]]
    text = "\n".join(md) + "\n"
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(text)
    return text
