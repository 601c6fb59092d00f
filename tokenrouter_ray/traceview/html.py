"""The trace as one self-contained HTML page (inline CSS; no scripts, fonts or images).

- Summary: tokens per model, writer changes, drops, mean score per model; a legend.
- Strip of handoffs: one cell per output token in its writer's colour, rows of
  ``STRIP_ROW`` tokens; a black bar at the left of a cell marks a writer change, a red
  triangle above it a drop (the cell holds the replacement); under each cell a bar as high
  as the router score.
- Text: every token a ``<span class="t m{k}">`` whose background is its writer's colour,
  darker the higher the router score (``data-score``; a tooltip gives position, id, model,
  score); dropped proposals struck through, small, right before their replacement.
  Whitespace is kept (``white-space: pre-wrap``); a newline token shows a faint ``↵``.
"""

from __future__ import annotations

from html import escape

from tokenrouter_ray.traceview.model import (
    RoutingTrace,
    alpha_of,
    ink_for,
    model_colours,
    shade,
)

STRIP_ROW = 100  # tokens per strip row


def _score_text(score: float | None) -> str:
    return "none" if score is None else f"{score:.3f}"


def _attr(value: object) -> str:
    return escape(str(value), quote=True)


def _css(trace: RoutingTrace, colours: dict[str, str]) -> str:
    # strip cells: 9 px in full rows, wider (up to 24 px) when the whole output is short
    columns = max(1, min(len(trace.tokens), STRIP_ROW))
    cell = max(9, min(24, 1000 // columns - 1))
    per_model = "\n".join(
        f".m{k} {{ --c: {colours[m]}; }}\n.cell.m{k}, .sw.m{k} {{ background: {colours[m]}; }}"
        for k, m in enumerate(trace.models)
    )
    return f"""
body {{ font-family: system-ui, sans-serif; margin: 24px; color: #111; background: #fff; }}
h1 {{ font-size: 20px; margin: 0 0 12px; }}
h2 {{ font-size: 15px; margin: 22px 0 8px; }}
table.summary {{ border-collapse: collapse; font-size: 14px; }}
table.summary td, table.summary th {{ padding: 3px 12px 3px 0; text-align: left; }}
table.summary td.n {{ text-align: right; font-variant-numeric: tabular-nums; }}
.sw {{ display: inline-block; width: 14px; height: 14px; vertical-align: middle;
  border-radius: 2px; }}
.legend {{ font-size: 13px; color: #444; margin-top: 8px; }}
.strip {{ display: grid; grid-template-columns: repeat({columns}, minmax(0, {cell}px));
  column-gap: 1px; margin: 10px 0 4px; }}
.cell {{ height: 22px; position: relative; }}
.cell.h {{ box-shadow: inset 3px 0 0 #000; }}
.cell.d::before {{ content: ""; position: absolute; left: 50%; top: -8px;
  margin-left: -4px; border: 4px solid transparent; border-top: 6px solid #d00;
  border-bottom: 0; }}
.bar {{ height: 18px; position: relative; background: #f3f3f3; }}
.bar i {{ position: absolute; left: 0; right: 0; bottom: 0; background: var(--c); }}
.rowlabel {{ font-size: 11px; color: #666; }}
.text {{ white-space: pre-wrap; font-family: ui-monospace, monospace; font-size: 15px;
  line-height: 1.9; border: 1px solid #ddd; padding: 12px; border-radius: 4px; }}
.t {{ border-radius: 2px; }}
.t.nl::before {{ content: "\\21B5"; opacity: 0.35; }}
.t.empty::before {{ content: "\\2205"; opacity: 0.35; font-size: 10px; }}
.drop {{ text-decoration: line-through; text-decoration-color: #d00; font-size: 13px;
  color: var(--c); background: #fff4f4; border: 1px dashed var(--c); border-radius: 2px;
  padding: 0 2px; margin-right: 1px; }}
{per_model}
"""


def _summary(trace: RoutingTrace, colours: dict[str, str]) -> str:
    total = len(trace.tokens)
    counts = trace.tokens_per_model()
    drops = trace.dropped_per_model()
    means = trace.mean_score_per_model()
    rows = []
    for k, m in enumerate(trace.models):
        share = f"{100 * counts[m] / total:.1f} %" if total else "-"
        mean = "-" if means[m] is None else f"{means[m]:.3f}"
        rows.append(
            f'<tr class="model" data-model="{_attr(m)}"><td><span class="sw m{k}"></span> '
            f'{escape(m)}</td><td class="n count">{counts[m]}</td><td class="n">{share}</td>'
            f'<td class="n">{drops[m]}</td><td class="n">{mean}</td></tr>'
        )
    changes = len(trace.writer_changes())
    return (
        '<table class="summary"><tr><th>model</th><th>tokens</th><th>share</th>'
        "<th>proposals dropped</th><th>mean score</th></tr>"
        + "".join(rows)
        + f'<tr><td>total</td><td class="n" id="total">{total}</td><td></td>'
        f'<td class="n" id="dropped">{len(trace.dropped)}</td><td></td></tr></table>'
        f'<p>writer changes (handoffs that show in the output): <b id="changes">{changes}</b>'
        f" &middot; dropped proposals: <b>{len(trace.dropped)}</b></p>"
    )


def _strip(trace: RoutingTrace) -> str:
    index = {m: k for k, m in enumerate(trace.models)}
    changes = set(trace.writer_changes())
    drops = trace.dropped_before()
    scale = trace.score_scale()
    parts = []
    for start in range(0, len(trace.tokens), STRIP_ROW):
        row = trace.tokens[start : start + STRIP_ROW]
        cells, bars = [], []
        for i, t in enumerate(row, start):
            k = index[t.model]
            flags = (" h" if i in changes else "") + (" d" if i in drops else "")
            tip = f"#{i} {t.model}, score {_score_text(t.score)}"
            if i in drops:
                tip += "; dropped here: " + ", ".join(
                    f"{d.model} {_score_text(d.score)}" for d in drops[i]
                )
            cells.append(f'<div class="cell m{k}{flags}" title="{_attr(tip)}"></div>')
            height = 0 if t.score is None else min(max(t.score / scale, 0.0), 1.0) * 100
            bars.append(f'<div class="bar m{k}"><i style="height:{height:.0f}%"></i></div>')
        parts.append(
            f'<div class="rowlabel">tokens {start}&ndash;{start + len(row) - 1}</div>'
            f'<div class="strip">{"".join(cells)}</div>'
            f'<div class="strip" style="margin-top:0">{"".join(bars)}</div>'
        )
    return "".join(parts)


def _token_span(i: int, t, k: int, colour: str, scale: float) -> str:
    background = shade(colour, alpha_of(t.score, scale))
    classes = f"t m{k}" + (" nl" if "\n" in t.text else "") + ("" if t.text else " empty")
    tip = f"#{i} id {t.id} · {t.model} · score {_score_text(t.score)}"
    score = "" if t.score is None else f' data-score="{t.score:g}"'
    return (
        f'<span class="{classes}" data-i="{i}" data-id="{t.id}" data-model="{_attr(t.model)}"'
        f'{score} style="background:{background};color:{ink_for(background)}"'
        f' title="{_attr(tip)}">{escape(t.text)}</span>'
    )


def _text(trace: RoutingTrace, colours: dict[str, str]) -> str:
    index = {m: k for k, m in enumerate(trace.models)}
    drops = trace.dropped_before()
    scale = trace.score_scale()
    out = []
    for i, t in enumerate(trace.tokens):
        for d in drops.get(i, ()):
            tip = (
                f"dropped: id {d.id}, proposed by {d.model}, score {_score_text(d.score)}; "
                f"replaced by {d.replaced_by}"
            )
            out.append(
                f'<span class="drop m{index[d.model]}" data-i="{i}" data-id="{d.id}"'
                f' data-model="{_attr(d.model)}" title="{_attr(tip)}">{escape(d.text)}</span>'
            )
        out.append(_token_span(i, t, index[t.model], colours[t.model], scale))
    return "".join(out)


def render_html(trace: RoutingTrace, title: str = "Routing trace") -> str:
    colours = model_colours(trace.models)
    legend = " ".join(
        f'<span class="sw m{k}"></span> {escape(m)}' for k, m in enumerate(trace.models)
    )
    scale = trace.score_scale()
    scale_note = "" if scale == 1.0 else f" (scores divided by {scale:g}, the largest)"
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<title>{escape(title)}</title>
<style>{_css(trace, colours)}</style></head>
<body>
<h1>{escape(title)}</h1>
{_summary(trace, colours)}
<div class="legend">{legend} &middot; token shade: the router score at that position,
light = 0, dark = 1{scale_note}; unscored tokens at a fixed light shade</div>
<h2>Strip of handoffs</h2>
<div class="legend">one cell per output token in its writer's colour; black edge: the writer
changes; red triangle: a proposal was dropped there; bars: the router score</div>
{_strip(trace)}
<h2>Text</h2>
<div class="text" id="text">{_text(trace, colours)}</div>
</body></html>
"""
