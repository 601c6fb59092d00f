"""The Markov-vs-simulated-runtime plot of ``markov_validate --plot``, drawn with matplotlib
(the ``bench`` extra): one panel per concurrency N, throughput against B_large, the model's
prediction, the measured points and the prediction at the realized escalation rate plus the
loop overhead."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


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
