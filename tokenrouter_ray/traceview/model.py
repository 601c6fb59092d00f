"""The routing trace as data: parsing a response (or its streamed chunks), the summary
numbers, and the colours both renderers share.

A trace is what a response choice carries under ``routing_trace`` when the request asked
for it (``extra_body={"routing_trace": True}``)::

    {"models": ["small", "large"],
     "tokens": [{"id": 9906, "text": "Hello", "model": "small", "score": 0.031}, ...],
     "dropped": [{"index": 1, "id": 13, "text": ".", "model": "small", "score": 0.71,
                  "replaced_by": "large"}]}

``tokens[i]`` is output token i and the model that wrote it; ``score`` is the router's
score at that position (None where the policy computes none). A dropped token was proposed
by ``model`` and replaced by ``tokens[index]``, which ``replaced_by`` wrote. Streamed
chunks carry the tokens (and drops, with absolute indices) of that chunk only.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenrouter_ray.errors import UserFacingError

# One hue per model, entry (smallest) model first: blue, orange, green, red, purple, ...
PALETTE = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#17becf",
    "#bcbd22",
    "#7f7f7f",
)
# Shading: a token's background is its model's colour over white at this opacity.
MIN_ALPHA = 0.15  # score 0
MAX_ALPHA = 0.9  # score 1 (or the largest score, when scores exceed 1)
UNSCORED_ALPHA = 0.4  # no score at that position


class TraceError(UserFacingError):
    """The input holds no usable routing trace (the message says what was found)."""


@dataclass(frozen=True)
class TraceToken:
    id: int
    text: str
    model: str
    score: float | None


@dataclass(frozen=True)
class DroppedToken:
    index: int  # position in tokens of the replacement
    id: int
    text: str
    model: str  # the model that proposed it
    score: float | None  # the router's score that dropped it
    replaced_by: str


@dataclass
class RoutingTrace:
    models: list[str]
    tokens: list[TraceToken]
    dropped: list[DroppedToken] = field(default_factory=list)

    # ---- summary numbers -------------------------------------------------------------

    def tokens_per_model(self) -> dict[str, int]:
        counts = Counter(t.model for t in self.tokens)
        return {m: counts.get(m, 0) for m in self.models}

    def dropped_per_model(self) -> dict[str, int]:
        """Dropped proposals per proposing model."""
        counts = Counter(d.model for d in self.dropped)
        return {m: counts.get(m, 0) for m in self.models}

    def writer_changes(self) -> list[int]:
        """Positions i > 0 whose writer differs from token i-1's: the handoffs that show in
        the output. (The response's ``routing.handoffs`` counts HANDOFF messages; it can be
        larger where the output was cut after a handoff or a receiver wrote nothing.)"""
        writers = [t.model for t in self.tokens]
        return [i for i in range(1, len(writers)) if writers[i] != writers[i - 1]]

    def mean_score_per_model(self) -> dict[str, float | None]:
        sums: dict[str, list[float]] = {m: [] for m in self.models}
        for t in self.tokens:
            if t.score is not None:
                sums[t.model].append(t.score)
        return {m: (sum(v) / len(v) if v else None) for m, v in sums.items()}

    def score_scale(self) -> float:
        """Scores are shaded on [0, scale]: 1, or the largest score where one exceeds 1."""
        scores = [t.score for t in self.tokens if t.score is not None]
        scores += [d.score for d in self.dropped if d.score is not None]
        return max([1.0, *scores])

    def dropped_before(self) -> dict[int, list[DroppedToken]]:
        """Dropped proposals grouped by the position of their replacement."""
        out: dict[int, list[DroppedToken]] = {}
        for d in self.dropped:
            out.setdefault(d.index, []).append(d)
        return out

    def summary(self) -> dict[str, Any]:
        return {
            "tokens": len(self.tokens),
            "tokens_per_model": self.tokens_per_model(),
            "writer_changes": len(self.writer_changes()),
            "dropped": len(self.dropped),
            "dropped_per_model": self.dropped_per_model(),
            "mean_score_per_model": self.mean_score_per_model(),
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "models": list(self.models),
            "tokens": [vars(t) for t in self.tokens],
            "dropped": [vars(d) for d in self.dropped],
        }


# ---- colours ---------------------------------------------------------------------------


def model_colours(models: Sequence[str]) -> dict[str, str]:
    return {m: PALETTE[i % len(PALETTE)] for i, m in enumerate(models)}


def hex_to_rgb(colour: str) -> tuple[int, int, int]:
    c = colour.lstrip("#")
    return int(c[0:2], 16), int(c[2:4], 16), int(c[4:6], 16)


def rgb_to_hex(rgb: Iterable[float]) -> str:
    return "#" + "".join(f"{round(v):02x}" for v in rgb)


def alpha_of(score: float | None, scale: float = 1.0) -> float:
    if score is None or not math.isfinite(score):
        return UNSCORED_ALPHA
    s = min(max(score / scale, 0.0), 1.0)
    return MIN_ALPHA + (MAX_ALPHA - MIN_ALPHA) * s


def shade(colour: str, alpha: float) -> str:
    """``colour`` at ``alpha`` over white, as an opaque hex colour (what both renderers
    paint, so a screenshot can be checked for it exactly)."""
    return rgb_to_hex(255 + (c - 255) * alpha for c in hex_to_rgb(colour))


def ink_for(background: str) -> str:
    """Dark text on light backgrounds, white on dark ones (relative luminance)."""

    def lin(c: int) -> float:
        v = c / 255
        return v / 12.92 if v <= 0.04045 else ((v + 0.055) / 1.055) ** 2.4

    r, g, b = (lin(c) for c in hex_to_rgb(background))
    return "#ffffff" if 0.2126 * r + 0.7152 * g + 0.0722 * b < 0.25 else "#111111"


# ---- parsing ---------------------------------------------------------------------------


def _score(value: Any, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TraceError(f"{where}: score must be a number or null, got {value!r}")
    return float(value)


def _token(obj: Any, where: str) -> TraceToken:
    if not isinstance(obj, Mapping):
        raise TraceError(f"{where}: expected an object, got {type(obj).__name__}")
    try:
        return TraceToken(
            id=int(obj["id"]),
            text=str(obj.get("text") or ""),
            model=str(obj["model"]),
            score=_score(obj.get("score"), where),
        )
    except KeyError as exc:
        raise TraceError(f"{where}: missing key {exc.args[0]!r}") from None


def _dropped(obj: Any, where: str) -> DroppedToken:
    token = _token(obj, where)
    try:
        return DroppedToken(
            index=int(obj["index"]),
            id=token.id,
            text=token.text,
            model=token.model,
            score=token.score,
            replaced_by=str(obj["replaced_by"]),
        )
    except KeyError as exc:
        raise TraceError(f"{where}: missing key {exc.args[0]!r}") from None


def _is_trace(obj: Any) -> bool:
    return isinstance(obj, Mapping) and "tokens" in obj and "choices" not in obj


def build_trace(parts: Sequence[Mapping[str, Any]]) -> RoutingTrace:
    """One trace from one or more ``routing_trace`` objects (a response's, or each chunk's
    in stream order): tokens and drops concatenated, drop indices taken as absolute."""
    models: list[str] = []
    tokens: list[TraceToken] = []
    dropped: list[DroppedToken] = []
    for part in parts:
        for m in part.get("models") or ():
            if str(m) not in models:
                models.append(str(m))
        for t in part.get("tokens") or ():
            tokens.append(_token(t, f"tokens[{len(tokens)}]"))
        for d in part.get("dropped") or ():
            dropped.append(_dropped(d, f"dropped[{len(dropped)}]"))
    for name in [t.model for t in tokens] + [d.model for d in dropped]:
        if name not in models:  # a writer the models list left out: keep it, after the rest
            models.append(name)
    for d in dropped:
        if not 0 <= d.index < len(tokens):
            raise TraceError(
                f"a dropped token's index {d.index} is outside the {len(tokens)} output tokens"
            )
    dropped.sort(key=lambda d: d.index)  # stable: drops at one position keep their order
    return RoutingTrace(models=models, tokens=tokens, dropped=dropped)


def trace_from_json(obj: Any, choice: int = 0) -> RoutingTrace:
    """A trace from a parsed response: a ``chat.completion`` / ``text_completion`` object,
    a list of streamed chunk objects, or a bare ``routing_trace`` object."""
    if _is_trace(obj):
        return build_trace([obj])
    chunks = obj if isinstance(obj, list) else [obj]
    if not chunks or not all(isinstance(c, Mapping) and "choices" in c for c in chunks):
        raise TraceError(
            "expected a chat.completion or text_completion response, a JSON list of its "
            "streamed chunks, or a routing_trace object"
        )
    parts: list[Mapping[str, Any]] = []
    seen: set[int] = set()
    for chunk in chunks:
        for position, c in enumerate(chunk["choices"] or ()):
            index = c.get("index", position)
            seen.add(index)
            if index == choice and isinstance(c.get("routing_trace"), Mapping):
                parts.append(c["routing_trace"])
    if choice not in seen:
        raise TraceError(f"the response has no choice {choice} (choices: {sorted(seen)})")
    if not parts:
        raise TraceError(
            f"choice {choice} of the response carries no routing_trace: ask for it with "
            '"routing_trace": true in the request body (openai client: '
            'extra_body={"routing_trace": True}), from a tokenrouter-ray server that has it'
        )
    return build_trace(parts)


def parse_text(text: str) -> Any:
    """JSON, else server-sent events or JSON lines (one chunk per line; ``[DONE]`` and
    blank lines skipped) as a list of chunks."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as first:
        chunks = []
        for line in text.splitlines():
            line = line.strip()
            if line.startswith("data:"):
                line = line[len("data:") :].strip()
            if not line or line == "[DONE]" or line.startswith((":", "event:", "id:")):
                continue
            try:
                chunks.append(json.loads(line))
            except json.JSONDecodeError:
                raise TraceError(f"not JSON, JSON lines or server-sent events: {first}") from None
        if not chunks:
            raise TraceError(f"not JSON: {first}") from None
        return chunks


def load_trace(path: str | Path, choice: int = 0) -> RoutingTrace:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"cannot read {path}: {exc.strerror or exc}") from None
    return trace_from_json(parse_text(text), choice)
