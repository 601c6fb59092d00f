"""Live quality: a sample of finished answers scored by the top model of the chain.

Routing trades answer quality for speed, and offline evaluation (``eval``, ``calibrate``)
measures that trade on a task set, not on the traffic a deployment serves. The live monitor
measures it on that traffic. A share of finished choices (``quality_monitor.sample_rate``)
goes, as prompt and committed answer, to a replica of the top model, which reads both in one
forward (teacher forcing) and reports, per answer:

- ``agreeing`` of ``positions``: where its own greedy token, given the answer's prefix, is
  the committed token. For a greedy answer, agreement everywhere means the answer is the one
  the top model would have written alone; the large model's own positions always agree.
- ``logprob_gap``: the mean, over positions, of its log-probability of its own greedy token
  minus that of the committed token (0 where it agrees; for sampled answers the size of the
  disagreement, not only its count).

The replica runs the forward on its step thread between two steps, so a scoring never runs
beside a step, and a ``ScoreBudget`` keeps it under ``quality_monitor.max_share`` of the
replica's time: past it, a sampled answer is skipped and counted, never queued behind decode
work. The ingress (``LiveQuality``) aggregates the scores per operating point: the request's
preset, ``default``, ``custom`` (its own threshold) or ``alone:<model>`` (single-model
bypass). They are exported as Prometheus counters and shown at ``GET
/v1/tokenrouter/quality``.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenrouter_ray.metrics import Metrics
from tokenrouter_ray.quality.stats import wilson_interval

if TYPE_CHECKING:
    from tokenrouter_ray.quality.target import QualityTarget

logger = logging.getLogger(__name__)

RECENT = 20  # scored answers the status route lists one by one


@dataclass(frozen=True)
class Score:
    """One answer scored by teacher forcing; ``skipped`` names why it was not (then the
    counts are 0)."""

    positions: int = 0
    agreeing: int = 0
    logprob_gap: float = 0.0
    seconds: float = 0.0
    skipped: str | None = None


def teacher_forced(model: Any, prompt: Sequence[int], answer: Sequence[int]) -> Score:
    """Score ``answer`` after ``prompt`` with a causal LM: one forward over both, no KV
    cache (the engine's paged attention runs as plain SDPA outside a step)."""
    import torch

    if not answer or not prompt:
        return Score()
    t0 = time.perf_counter()
    device = next(model.parameters()).device
    ids = torch.tensor([[*prompt, *answer]], device=device)
    with torch.inference_mode():
        # positions len(prompt)-1 .. end-1 predict the answer's tokens: the last
        # len(answer)+1 positions' logits, less the final one
        logits = model(input_ids=ids, use_cache=False, logits_to_keep=len(answer) + 1).logits
        logits = logits[0, :-1].float()
        target = torch.tensor(answer, device=device)
        logp = torch.log_softmax(logits, dim=-1)
        best = logp.max(dim=-1)
        agreeing = int((best.indices == target).sum())
        gap = float((best.values - logp.gather(1, target[:, None])[:, 0]).mean())
    return Score(len(answer), agreeing, max(gap, 0.0), time.perf_counter() - t0)


def plain_model(engine: Any) -> Any:
    """The causal LM an engine steps, for a plain forward; None where the engine's weights
    are split over processes (tensor parallel: a forward needs every rank)."""
    from tokenrouter_ray.engine.runner import FaultyRunner
    from tokenrouter_ray.engine.tensor_parallel import TensorParallelRunner

    runner = engine.runner
    while isinstance(runner, FaultyRunner):
        runner = runner.inner
    if isinstance(runner, TensorParallelRunner):
        return None
    return getattr(runner, "model", None)


class ScoreBudget:
    """Scoring time on one replica, held under ``max_share`` of the last ``window_s``."""

    def __init__(
        self, max_share: float, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_share = max_share
        self.window_s = window_s
        self.clock = clock
        self.started = clock()
        self.spent: deque[tuple[float, float]] = deque()  # (ended at, seconds)

    def share(self) -> float:
        """Scoring time over the window (or the time since start, when shorter)."""
        now = self.clock()
        while self.spent and self.spent[0][0] < now - self.window_s:
            self.spent.popleft()
        span = max(min(now - self.started, self.window_s), 1.0)
        return sum(s for _, s in self.spent) / span

    def refusal(self) -> str | None:
        """``budget`` when a scoring may not start now, None when it may."""
        return "budget" if self.share() >= self.max_share else None

    def spend(self, seconds: float) -> None:
        self.spent.append((self.clock(), seconds))


@dataclass
class _Point:
    """One operating point's scores: running counts and the last ``window`` answers."""

    window: deque[Score]
    answers: int = 0
    positions: int = 0

    def add(self, score: Score) -> None:
        self.window.append(score)
        self.answers += 1
        self.positions += score.positions

    def summary(self) -> dict[str, Any]:
        scores = list(self.window)
        positions = sum(s.positions for s in scores)
        agreeing = sum(s.agreeing for s in scores)
        whole = sum(s.agreeing == s.positions for s in scores)
        return {
            "answers": self.answers,
            "positions": self.positions,
            "window": {
                "answers": len(scores),
                "position_agreement": agreeing / positions if positions else None,
                "position_interval": list(wilson_interval(agreeing, positions)),
                "answer_agreement": whole / len(scores) if scores else None,
                "answer_interval": list(wilson_interval(whole, len(scores))),
                "mean_logprob_gap": sum(s.logprob_gap for s in scores) / len(scores)
                if scores
                else None,
            },
        }


Scorer = Callable[[list[int], list[int]], Awaitable[Score]]


class LiveQuality:
    """The ingress's side: samples finished choices, sends them to ``scorer`` (a replica of
    the top model), aggregates and exports the scores."""

    def __init__(
        self,
        scorer: Scorer | None,
        metrics: Metrics,
        policy: str,
        presets: Mapping[str, Sequence[float]],
        sample_rate: float,
        max_pending: int = 4,
        window: int = 200,
        timeout_s: float = 60.0,
        rng: random.Random | None = None,
    ) -> None:
        self.scorer = scorer
        self.metrics = metrics
        self.policy = policy
        self.presets = {tuple(float(x) for x in v): k for k, v in presets.items()}
        self.sample_rate = sample_rate if scorer is not None else 0.0
        self.max_pending = max_pending
        self.window = window
        self.timeout_s = timeout_s
        self.rng = rng or random.Random()
        self.points: dict[str, _Point] = {}
        self.skipped: dict[str, int] = {}
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT)
        self.pending: set[asyncio.Task] = set()
        self.target: QualityTarget | None = None  # tuner.quality_target: fed every score

    def point_of(self, thresholds: Sequence[float], alone: str | None) -> str:
        """The operating point label of a request's routing."""
        if alone is not None:
            return f"alone:{alone}"
        if not thresholds:
            return "default"
        return self.presets.get(tuple(float(x) for x in thresholds), "custom")

    def offer(
        self,
        rid: str,
        prompt: Sequence[int],
        answer: Sequence[int],
        thresholds: Sequence[float],
        alone: str | None,
    ) -> bool:
        """Maybe score a finished choice (never awaits); True when it was sent."""
        if not answer or self.sample_rate <= 0 or self.rng.random() >= self.sample_rate:
            return False
        if len(self.pending) >= self.max_pending:
            self._skip("queue_full")
            return False
        point = self.point_of(thresholds, alone)
        task = asyncio.get_running_loop().create_task(
            self._score(rid, point, list(prompt), list(answer))
        )
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)
        return True

    async def _score(self, rid: str, point: str, prompt: list[int], answer: list[int]) -> None:
        assert self.scorer is not None
        try:
            score = await asyncio.wait_for(self.scorer(prompt, answer), self.timeout_s)
        except Exception as exc:  # a scorer's failure costs a sample, never a request
            logger.warning("quality monitor: scoring %s failed: %r", rid, exc)
            self._skip("failed")
            return
        if score.skipped is not None:
            self._skip(score.skipped)
            return
        self.add(rid, point, score)

    def add(self, rid: str, point: str, score: Score) -> None:
        """Record one scored answer."""
        entry = self.points.get(point)
        if entry is None:
            entry = self.points[point] = _Point(deque(maxlen=self.window))
        entry.add(score)
        if self.target is not None:
            self.target.observe(point, score.positions, score.agreeing)
        self.metrics.quality_scored(
            self.policy, point, score.positions, score.agreeing, score.logprob_gap, score.seconds
        )
        self.recent.append({
            "request_id": rid, "point": point, "positions": score.positions,
            "agreeing": score.agreeing, "logprob_gap": round(score.logprob_gap, 6),
            "seconds": round(score.seconds, 6),
        })  # fmt: skip

    def _skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        self.metrics.quality_skipped(reason)

    def status(self) -> dict[str, Any]:
        """The body of ``GET /v1/tokenrouter/quality``."""
        return {
            "enabled": self.sample_rate > 0,
            "sample_rate": self.sample_rate,
            "policy": self.policy,
            "pending": len(self.pending),
            "skipped": dict(sorted(self.skipped.items())),
            "points": {k: v.summary() for k, v in sorted(self.points.items())},
            "target": None if self.target is None else self.target.status(),
            "recent": list(self.recent),
        }

    async def stop(self) -> None:
        for task in list(self.pending):
            task.cancel()
        await asyncio.gather(*self.pending, return_exceptions=True)
