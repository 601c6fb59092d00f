"""Validate the deferred-batching Markov model against the real runtime on simulated engines.

The paper's R2R setting (p(small->large) = 0.35, 6.0 / 27.9 ms, B_small = 1): for every N in
``--concurrency`` and every admissible B_large (1..N), run ``LocalRuntime`` over simulated
engines (``tokenrouter_ray.simulation.backend``: the real scheduler, sub-servers and
protocol, steps that sleep for the profiled time) with N requests in a closed loop, and
compare the measured committed tokens/s with the exact chain's prediction. Prints the
per-point table and the per-N summary (predicted vs measured best B, whether the predicted
best is within 2 % of the measured best, worst relative error), and with ``--plot FILE``
writes a PNG (``plot``: one panel per N, throughput against B_large, the prediction, the
measured points and the prediction at the realized rate plus the loop overhead; matplotlib,
the ``bench`` extra).

Run: ``.venv/bin/python -m loadtest.markov_validate`` (about 4 min; ``--quick`` about 1 min;
``--time-scale 2`` stretches simulated step times 2x to shrink the share of the runtime's
own per-step overhead; ``--plot docs/images/markov_validation.png``).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

from loadtest.common import command, machine
from tokenrouter_ray.simulation.validate import (
    DEFAULT_WINDOWS_S,
    QUICK_WINDOWS_S,
    ValidationPoint,
    format_validation,
    validate,
)
from tokenrouter_ray.tuning.examples import PAPER_CONCURRENCIES, paper_r2r


def plot(rows: Sequence[Any], path: str, title: str) -> None:
    """``rows``: ``ValidationRow``s (``n_requests``, ``free``, ``points`` with ``thresholds``,
    ``predicted``, ``measured``, ``predicted_overhead``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, len(rows), figsize=(3.6 * len(rows), 3.6), squeeze=False)
    for ax, row in zip(axes[0], rows, strict=True):
        bs = [p.thresholds[row.free] for p in row.points]
        overhead = [p.predicted_overhead for p in row.points]
        if all(v is not None for v in overhead):
            ax.plot(bs, overhead, "o-", color="0.6", ms=3,
                    label="predicted at realized p + loop overhead")  # fmt: skip
        ax.plot(bs, [p.predicted for p in row.points], "o-", ms=3, label="predicted (p = 0.35)")
        ax.plot(bs, [p.measured for p in row.points], "s", color="tab:red", label="measured")
        ax.set(title=f"N = {row.n_requests}", xlabel="B_large", ylabel="tokens/s")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
            f"Markov model vs simulated runtime (R2R, time scale x{args.time_scale:g})",
        )
        print(f"plot: {args.plot}")
    print(f"total {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
