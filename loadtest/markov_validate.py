"""Validate the deferred-batching Markov model against the real runtime on simulated engines.

The paper's R2R setting (p(small->large) = 0.35, 6.0 / 27.9 ms, B_small = 1): for every N in
``--concurrency`` and every admissible B_large (1..N), run ``LocalRuntime`` over simulated
engines (``tokenrouter_ray.tuning.sim_backend``: the real scheduler, sub-servers and
protocol, steps that sleep for the profiled time) with N requests in a closed loop, and
compare the measured committed tokens/s with the exact chain's prediction. Prints the
per-point table and the per-N summary (predicted vs measured best B, whether the predicted
best is within 2 % of the measured best, worst relative error), and with ``--plot FILE``
writes a PNG (a small built-in rasterizer: no matplotlib needed).

Run: ``.venv/bin/python -m loadtest.markov_validate`` (about 4 min; ``--quick`` about 1 min;
``--time-scale 2`` stretches simulated step times 2x to shrink the share of the runtime's
own per-step overhead; ``--plot docs/markov_validation.png``).
"""

from __future__ import annotations

import argparse
import itertools
import struct
import sys
import time
import zlib
from collections.abc import Sequence

import numpy as np

from loadtest.common import command, machine
from tokenrouter_ray.tuning.examples import PAPER_CONCURRENCIES, paper_r2r
from tokenrouter_ray.tuning.validate import (
    DEFAULT_WINDOWS_S,
    QUICK_WINDOWS_S,
    ValidationPoint,
    ValidationRow,
    format_validation,
    validate,
)

# --------------------------------------------------------------------------- tiny PNG
# 3x5 bitmap glyphs (rows top to bottom, 3 bits each) for the labels the plot needs.
_GLYPHS = {
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111",
    "3": "111001111001111", "4": "101101111001001", "5": "111100111001111",
    "6": "111100111101111", "7": "111001010010010", "8": "111101111101111",
    "9": "111101111001111", ".": "000000000000010", "=": "000111000111000",
    "-": "000000111000000", "/": "001001010100100", " ": "000000000000000",
    "%": "101001010100101", ":": "000010000010000", "_": "000000000000111",
    "A": "010101111101101", "B": "110101110101110", "D": "110101101101110",
    "E": "111100110100111", "G": "111100101101111", "I": "111010010010111",
    "K": "101101110101101", "L": "100100100100111", "M": "101111111101101",
    "N": "110101101101101", "O": "111101101101111", "P": "111101111100100",
    "R": "110101110101101", "S": "111100111001111", "T": "111010010010010",
    "U": "101101101101111", "X": "101101010101101", "Y": "101101010010010",
    "C": "111100100100111", "F": "111100110100100", "H": "101101111101101",
    "J": "001001001101111", "V": "101101101101010", "W": "101101111111101",
    "Z": "111001010100111", "^": "010101000000000", ",": "000000000010100",
    "(": "001010010010001", ")": "100010010010100", "+": "000010111010000",
}  # fmt: skip


class Canvas:
    def __init__(self, width: int, height: int) -> None:
        self.px = np.full((height, width, 3), 255, dtype=np.uint8)  # (H, W, RGB)

    def rect(self, x0: int, y0: int, x1: int, y1: int, color: tuple[int, int, int]) -> None:
        h, w = self.px.shape[:2]
        x0, x1 = sorted((max(0, x0), min(w, x1)))
        y0, y1 = sorted((max(0, y0), min(h, y1)))
        self.px[y0:y1, x0:x1] = color

    def line(self, x0: float, y0: float, x1: float, y1: float, color, width: int = 2) -> None:
        steps = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
        for t in np.linspace(0.0, 1.0, steps + 1):
            x, y = round(x0 + (x1 - x0) * t), round(y0 + (y1 - y0) * t)
            self.rect(
                x - width // 2,
                y - width // 2,
                x - width // 2 + width,
                y - width // 2 + width,
                color,
            )

    def text(self, x: int, y: int, s: str, color=(0, 0, 0), scale: int = 2) -> None:
        for ch in s.upper():
            bits = _GLYPHS.get(ch, _GLYPHS[" "])
            for r in range(5):
                for c in range(3):
                    if bits[r * 3 + c] == "1":
                        self.rect(
                            x + c * scale,
                            y + r * scale,
                            x + (c + 1) * scale,
                            y + (r + 1) * scale,
                            color,
                        )
            x += 4 * scale

    def png(self) -> bytes:
        h, w = self.px.shape[:2]
        raw = b"".join(b"\x00" + self.px[y].tobytes() for y in range(h))

        def chunk(kind: bytes, data: bytes) -> bytes:
            body = kind + data
            return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

        header = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
        return (
            b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(raw, 9))
            + chunk(b"IEND", b"")
        )


PRED, MEAS, ADJ = (31, 119, 180), (214, 39, 40), (150, 150, 150)


def plot(rows: Sequence[ValidationRow], path: str, title: str) -> None:
    """One panel per N: predicted (blue), measured (red squares), pred@p^+overhead (grey)."""
    pw, ph, margin = 300, 240, 50
    canvas = Canvas(pw * len(rows) + 20, ph + 70)
    canvas.text(12, 10, title, scale=2)
    canvas.rect(12, 32, 30, 36, PRED)
    canvas.text(36, 30, "PREDICTED (P=0.35)", PRED)
    canvas.rect(236, 29, 244, 37, MEAS)
    canvas.text(250, 30, "MEASURED", MEAS)
    canvas.rect(370, 32, 388, 36, ADJ)
    canvas.text(394, 30, "PREDICTED AT REALIZED P + LOOP OVERHEAD", ADJ)
    for k, row in enumerate(rows):
        x0, y0 = 10 + k * pw + margin, 60
        w, h = pw - margin - 20, ph - 40
        bs = [p.thresholds[row.free] for p in row.points]
        values = [p.predicted for p in row.points] + [p.measured for p in row.points]
        values += [p.predicted_overhead for p in row.points if p.predicted_overhead]
        lo, hi = min(values), max(values)
        pad = 0.08 * (hi - lo or hi)
        lo, hi = lo - pad, hi + pad
        bmin, bmax = min(bs), max(max(bs), min(bs) + 1)

        def xy(b: float, v: float, box=(x0, y0, w, h, bmin, bmax, lo, hi)) -> tuple[float, float]:
            bx, by, bw, bh, b0, b1, v0, v1 = box
            return bx + (b - b0) / (b1 - b0) * bw, by + bh - (v - v0) / (v1 - v0) * bh

        canvas.rect(x0, y0 + h, x0 + w + 1, y0 + h + 2, (0, 0, 0))
        canvas.rect(x0 - 2, y0, x0, y0 + h + 2, (0, 0, 0))
        for v in (lo + pad, hi - pad):
            _, y = xy(bmin, v)
            canvas.rect(x0 - 6, int(y), x0, int(y) + 1, (0, 0, 0))
            canvas.text(x0 - 48, int(y) - 4, f"{v:.0f}", scale=1)
        for b in sorted({bmin, bmax, *bs[:: max(1, len(bs) // 4)]}):
            x, _ = xy(b, lo)
            canvas.rect(int(x), y0 + h, int(x) + 1, y0 + h + 5, (0, 0, 0))
            canvas.text(int(x) - 3, y0 + h + 8, str(b), scale=1)
        canvas.text(x0 + w // 2 - 40, y0 + h + 20, "B_LARGE", scale=2)
        canvas.text(x0 + 10, y0 - 14, f"N={row.n_requests}  TOK/S", scale=2)
        for series, color in (
            ([p.predicted_overhead for p in row.points], ADJ),
            ([p.predicted for p in row.points], PRED),
        ):
            if any(v is None for v in series):
                continue
            pts = [xy(b, v) for b, v in zip(bs, series, strict=True)]
            for (ax, ay), (bx, by) in itertools.pairwise(pts):
                canvas.line(ax, ay, bx, by, color)
            for ax, ay in pts:
                canvas.rect(int(ax) - 2, int(ay) - 2, int(ax) + 3, int(ay) + 3, color)
        for b, p in zip(bs, row.points, strict=True):
            x, y = xy(b, p.measured)
            canvas.rect(int(x) - 4, int(y) - 4, int(x) + 5, int(y) + 5, MEAS)
    with open(path, "wb") as f:
        f.write(canvas.png())


# ------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--concurrency", default=",".join(map(str, PAPER_CONCURRENCIES)), help="N values"
    )
    parser.add_argument("--quick", action="store_true", help="short windows (about 1 min)")
    parser.add_argument("--time-scale", type=float, default=2.0)
    parser.add_argument("--window-s", type=float, help="measurement window per point")
    parser.add_argument("--warmup-s", type=float, default=0.8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", help="write a PNG plot here")
    args = parser.parse_args(argv)
    ns = [int(x) for x in args.concurrency.split(",") if x]
    windows = dict(QUICK_WINDOWS_S if args.quick else DEFAULT_WINDOWS_S)
    if args.window_s is not None:
        windows = {n: args.window_s for n in ns}
    warmup = min(args.warmup_s, 0.5) if args.quick else args.warmup_s
    print(f"command: {command()}")
    print(f"machine: {machine()}")
    print(
        f"paper setting: R2R p(small->large)=0.35, 6.0/27.9 ms, B_small=1; time scale "
        f"x{args.time_scale:g}; warm-up {warmup:g} s; windows {[windows.get(n) for n in ns]} s"
    )
    profile = paper_r2r()
    start = time.perf_counter()

    def progress(n: int, thresholds: tuple[int, ...], p: ValidationPoint) -> None:
        m = p.measurement
        print(
            f"  N={n:<3} B={thresholds}  pred {p.predicted:8.1f}  meas {p.measured:8.1f}"
            f"  err {100 * (p.predicted - p.measured) / p.measured:+5.1f}%"
            f"  p^ {m.escalation_rate:.3f} pred@p^ {p.predicted_realized:8.1f}"
            f"  steps {m.steps}  mean batch {tuple(round(b, 2) for b in m.mean_batch)}"
            f"  [{time.perf_counter() - start:6.1f} s]",
            flush=True,
        )

    rows, overhead_ms = validate(
        profile,
        ns,
        fixed={0: 1},
        free=1,
        time_scale=args.time_scale,
        windows_s=windows,
        warmup_s=warmup,
        seed=args.seed,
        progress=progress,
    )
    print()
    print(format_validation(rows, profile.names, overhead_ms, args.time_scale))
    if args.plot:
        plot(
            rows,
            args.plot,
            f"MARKOV MODEL VS SIMULATED RUNTIME (R2R, TIME SCALE X{args.time_scale:g})",
        )
        print(f"plot: {args.plot}")
    print(f"total {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
