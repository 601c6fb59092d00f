"""The trace as a PNG (matplotlib, Agg): the strip of handoffs on top, the text below.

Top: one column per output token in its writer's colour, the router score as a black line
over it (on [0, 1], or [0, largest score] where a score exceeds 1), red crosses at the
score of each dropped proposal and red triangles above the strip where drops happened,
black ticks under it where the writer changes. Below: the text, monospaced, each token on a
background of its writer's colour shaded by the score (the HTML page's colours); dropped
proposals in dashed boxes, struck through, before their replacement. The text shows at
most ``MAX_TEXT_TOKENS`` tokens (the figure says so); the strip shows them all.

matplotlib comes with the ``bench`` extra and is imported only when a PNG is drawn.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from pathlib import Path

from tokenrouter_ray.errors import UserFacingError
from tokenrouter_ray.traceview.model import (
    RoutingTrace,
    alpha_of,
    ink_for,
    model_colours,
    shade,
)

MAX_TEXT_TOKENS = 600
WIDTH_IN = 12.0
DPI = 110
FONT_SIZE = 10.0
LINE_IN = 0.25  # text line height
MARGIN_IN = 0.45


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise UserFacingError(
            "drawing the PNG needs matplotlib, which comes with the bench extra: "
            "pip install 'tokenrouter-ray[bench]' (or pass --html only)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


@dataclass
class _Box:
    line: int
    col: int
    width: int
    face: str
    dropped: bool = False
    edge: str = ""


def _display(text: str) -> str:
    return text.replace("\t", "    ").replace("\r", "")


def _layout(trace: RoutingTrace, cols: int, limit: int):
    """Monospace layout: returns (boxes, lines of (col, text, ink) runs, number of lines)."""
    colours = model_colours(trace.models)
    drops = trace.dropped_before()
    scale = trace.score_scale()
    boxes: list[_Box] = []
    runs: list[list[tuple[int, str, str]]] = [[]]
    line, col = 0, 0

    def newline() -> None:
        nonlocal line, col
        line, col = line + 1, 0
        runs.append([])

    def put(text: str, face: str, ink: str, dropped: bool = False, edge: str = "") -> None:
        nonlocal col
        if col + len(text) > cols and len(text) <= cols and col > 0:
            newline()
        while text:
            piece, text = text[: cols - col], text[cols - col :]
            boxes.append(_Box(line, col, len(piece), face, dropped, edge))
            runs[line].append((col, piece, ink))
            col += len(piece)
            if text:
                newline()

    for i, t in enumerate(trace.tokens[:limit]):
        for d in drops.get(i, ()):
            put(_display(d.text) or "·", "#ffffff", colours[d.model], True, colours[d.model])
        face = shade(colours[t.model], alpha_of(t.score, scale))
        ink = ink_for(face)
        pieces = _display(t.text).split("\n")
        if pieces == [""]:
            put("∅", face, ink)
        for n, piece in enumerate(pieces):
            if n > 0:
                put("↵", face, ink)
                newline()
            if piece:
                put(piece, face, ink)
    return boxes, runs, line + 1


def render_png(trace: RoutingTrace, path: str | Path, title: str = "Routing trace") -> Path:
    plt = _pyplot()
    from matplotlib.colors import ListedColormap
    from matplotlib.font_manager import FontProperties
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch, Rectangle

    path = Path(path)
    colours = model_colours(trace.models)
    index = {m: k for k, m in enumerate(trace.models)}
    n = len(trace.tokens)
    scale = trace.score_scale()
    limit = min(n, MAX_TEXT_TOKENS)

    mono = FontProperties(family="DejaVu Sans Mono", size=FONT_SIZE)
    probe = plt.figure(dpi=DPI)
    width_px, _, _ = probe.canvas.get_renderer().get_text_width_height_descent(
        "M" * 100, mono, ismath=False
    )
    plt.close(probe)
    char_in = width_px / 100 / DPI
    cols = max(20, int((WIDTH_IN - 2 * MARGIN_IN) / char_in))
    boxes, runs, lines = _layout(trace, cols, limit)

    head_in, strip_in, gap_in = 0.9, 1.4, 0.75
    text_in = lines * LINE_IN + 0.1
    height = head_in + strip_in + gap_in + text_in + 0.15
    fig = plt.figure(figsize=(WIDTH_IN, height), dpi=DPI, facecolor="white")

    def rect(left: float, top: float, w: float, h: float) -> list[float]:
        return [left / WIDTH_IN, 1 - (top + h) / height, w / WIDTH_IN, h / height]

    counts = trace.tokens_per_model()
    parts = [f"{m} {counts[m]} ({100 * counts[m] / n:.0f} %)" if n else m for m in trace.models]
    fig.suptitle(
        f"{title}: {n} tokens · " + " · ".join(parts)
        + f" · {len(trace.writer_changes())} writer changes · {len(trace.dropped)} dropped",
        x=MARGIN_IN / WIDTH_IN, y=1 - 0.18 / height, ha="left", va="top", fontsize=12,
    )  # fmt: skip

    # ---- the strip ----------------------------------------------------------------------
    ax = fig.add_axes(rect(MARGIN_IN, head_in, WIDTH_IN - 2 * MARGIN_IN, strip_in))
    cmap = ListedColormap([colours[m] for m in trace.models])
    writers = [[index[t.model] for t in trace.tokens]] if n else [[0]]
    ax.imshow(
        writers, cmap=cmap, vmin=-0.5, vmax=len(trace.models) - 0.5, aspect="auto",
        interpolation="nearest", extent=(-0.5, max(n, 1) - 0.5, 0, 1),
    )  # fmt: skip
    scores = [math.nan if t.score is None else t.score / scale for t in trace.tokens]
    if any(not math.isnan(s) for s in scores):
        ax.plot(range(n), scores, color="black", lw=1.0, marker="." if n <= 200 else None, ms=3)
    if trace.dropped:
        xs = [d.index for d in trace.dropped]
        ys = [d.score / scale if d.score is not None else 1.0 for d in trace.dropped]
        ax.scatter(xs, ys, marker="x", color="#d00000", s=36, lw=1.6, zorder=3)
        ax.scatter(xs, [1.07] * len(xs), marker="v", color="#d00000", s=30, clip_on=False)
    changes = trace.writer_changes()
    if changes:
        ax.vlines([c - 0.5 for c in changes], -0.1, 0, color="black", lw=1.0, clip_on=False)
    ax.set_xlim(-0.5, max(n, 1) - 0.5)
    ax.set_ylim(0, 1)
    ax.set_yticks([0, 0.5, 1], ["0", f"{scale / 2:g}", f"{scale:g}"])
    ax.set_ylabel("router score", fontsize=9)
    ax.set_xlabel("output token", fontsize=9)
    ax.tick_params(labelsize=8)
    handles = [Patch(color=colours[m], label=m) for m in trace.models]
    handles += [
        Line2D([], [], color="black", lw=1, label="router score"),
        Line2D([], [], color="#d00000", marker="x", lw=0, label="dropped proposal (score)"),
        Line2D([], [], color="black", marker="|", lw=0, ms=8, label="writer changes"),
    ]
    ax.legend(
        handles=handles, loc="lower left", bbox_to_anchor=(0, 1.09), ncol=len(handles),
        fontsize=8, frameon=False, borderaxespad=0,
    )  # fmt: skip

    # ---- the text -----------------------------------------------------------------------
    top = head_in + strip_in + gap_in
    tx = fig.add_axes(rect(MARGIN_IN, top, cols * char_in, lines * LINE_IN))
    tx.set_xlim(0, cols)
    tx.set_ylim(lines, 0)
    tx.axis("off")
    shown = "" if limit == n else f" (first {limit} of {n} tokens shown)"
    tx.set_title(
        "text: background = writer, darker = higher router score; dashed, struck: dropped"
        + shown, loc="left", fontsize=9, pad=6,
    )  # fmt: skip
    for b in boxes:
        tx.add_patch(Rectangle(
            (b.col, b.line + 0.06), b.width, 0.88, facecolor=b.face, lw=0.9 if b.dropped else 0,
            edgecolor=b.edge or b.face, linestyle="--" if b.dropped else "-",
        ))  # fmt: skip
        if b.dropped:
            tx.plot([b.col, b.col + b.width], [b.line + 0.5] * 2, color="#d00000", lw=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # glyphs DejaVu lacks (CJK, emoji) draw as boxes
        for line, line_runs in enumerate(runs):
            by_ink: dict[str, list[str]] = {}
            for col, piece, ink in line_runs:  # one Text per ink colour and line
                row = by_ink.setdefault(ink, [" "] * cols)
                row[col : col + len(piece)] = list(piece)
            for ink, row in by_ink.items():
                tx.text(
                    0, line + 0.5, "".join(row).rstrip(), color=ink, fontproperties=mono,
                    va="center_baseline", ha="left", parse_math=False,
                )  # fmt: skip
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=DPI, facecolor="white")
    plt.close(fig)
    return path
