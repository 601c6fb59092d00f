"""Live quality (tokenrouter_ray/quality/live.py): teacher-forced scores on the engine's own
model, the scoring budget, and the ingress's sampling, labels, skips and metrics."""

from __future__ import annotations

import asyncio
import random

import pytest
from prometheus_client import CollectorRegistry

from tests.engine.conftest import make_engine
from tests.test_metrics import value
from tokenrouter_ray.engine.request import SamplingParams
from tokenrouter_ray.metrics import Metrics, PrometheusBackend
from tokenrouter_ray.quality.live import (
    LiveQuality,
    Score,
    ScoreBudget,
    plain_model,
    teacher_forced,
)

PROMPTS = [[5, 9, 17], [40, 2, 77, 3, 11], [100]]


@pytest.fixture(scope="module")
def large(chain_dirs: dict[str, str]):
    return make_engine(chain_dirs["large"])


def test_the_models_own_greedy_answer_agrees_everywhere(large) -> None:
    """The engine's greedy answers, scored on the engine's model outside a step: every
    position agrees and the gap is 0; a token changed to another one is the one position
    that disagrees, with a positive gap."""
    answers = large.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12))
    model = plain_model(large)
    for prompt, answer in zip(PROMPTS, answers, strict=True):
        score = teacher_forced(model, prompt, answer)
        assert (score.positions, score.agreeing) == (12, 12)
        assert score.logprob_gap == pytest.approx(0.0, abs=1e-9) and score.skipped is None
        changed = [*answer[:5], (answer[5] + 1) % 128, *answer[6:]]
        worse = teacher_forced(model, prompt, changed)
        assert worse.positions == 12 and worse.agreeing <= 11 and worse.logprob_gap > 0
        # the positions before the change are the same as the answer's
        assert teacher_forced(model, prompt, changed[:5]).agreeing == 5
    assert teacher_forced(model, PROMPTS[0], []) == Score()


def test_a_faulty_runner_is_seen_through(large) -> None:
    model = plain_model(large)
    large.inject_fault("stall", 1, 0.0)
    try:
        assert plain_model(large) is model
    finally:
        large.inject_fault("clear")


def test_budget_holds_the_share_over_the_window() -> None:
    now = [0.0]
    budget = ScoreBudget(0.1, window_s=10.0, clock=lambda: now[0])
    assert budget.refusal() is None
    now[0] = 5.0
    budget.spend(0.4)  # 0.4 s of 5 s: 8 %
    assert budget.share() == pytest.approx(0.08) and budget.refusal() is None
    budget.spend(0.2)  # 12 %
    assert budget.refusal() == "budget"
    now[0] = 10.0  # 0.6 s of 10 s
    assert budget.share() == pytest.approx(0.06) and budget.refusal() is None
    now[0] = 15.1  # both spendings left the window
    assert budget.share() == 0.0


def monitor(scorer, sample_rate: float = 1.0, max_pending: int = 4):
    registry = CollectorRegistry()
    metrics = Metrics(PrometheusBackend(registry), model_name="tr")
    live = LiveQuality(scorer, metrics, "r2r", {"high": [0.2], "fast": [0.7]}, sample_rate,
                       max_pending=max_pending, window=3, rng=random.Random(0))  # fmt: skip
    return live, registry


def test_points_samples_skips_and_metrics() -> None:
    async def scorer(prompt: list[int], answer: list[int]) -> Score:
        if prompt == [0]:
            return Score(skipped="budget")
        if prompt == [1]:
            raise RuntimeError("replica gone")
        return Score(len(answer), len(answer) - answer.count(0), 0.5 * answer.count(0), 0.01)

    async def run() -> tuple[LiveQuality, CollectorRegistry]:
        live, registry = monitor(scorer)
        assert live.point_of((), None) == "default"
        assert live.point_of((0.2,), None) == "high"
        assert live.point_of((0.3,), None) == "custom"
        assert live.point_of((), "large") == "alone:large"
        assert live.offer("a", [7], [1, 2, 3, 4], (0.2,), None)
        assert live.offer("b", [7], [1, 0, 3, 4], (0.2,), None)
        assert live.offer("c", [7], [5, 6], (), "large")
        assert live.offer("d", [0], [5], (), None)  # the replica refused: budget
        assert not live.offer("e", [7], [5, 6, 7], (0.2,), None)  # 4 in flight: queue full
        assert not live.offer("f", [7], [], (0.2,), None)  # nothing to score
        await asyncio.gather(*live.pending)
        assert live.offer("g", [1], [5], (), None)  # the scorer raised
        await asyncio.gather(*live.pending)
        return live, registry

    live, registry = asyncio.run(run())
    status = live.status()
    assert status["skipped"] == {"budget": 1, "failed": 1, "queue_full": 1}
    high = status["points"]["high"]
    assert high["answers"] == 2 and high["positions"] == 8
    assert high["window"]["position_agreement"] == pytest.approx(7 / 8)
    assert high["window"]["answer_agreement"] == pytest.approx(1 / 2)
    assert high["window"]["mean_logprob_gap"] == pytest.approx(0.25)
    assert status["points"]["alone:large"]["window"]["answer_agreement"] == 1.0
    assert [r["request_id"] for r in status["recent"]] == ["a", "b", "c"]
    labels = {"policy": "r2r", "point": "high", "model_name": "tr"}
    assert value(registry, "tokenrouter_quality_scored_answers_total", **labels) == 2
    assert value(registry, "tokenrouter_quality_agreeing_answers_total", **labels) == 1
    assert value(registry, "tokenrouter_quality_scored_positions_total", **labels) == 8
    assert value(registry, "tokenrouter_quality_agreeing_positions_total", **labels) == 7
    assert value(registry, "tokenrouter_quality_logprob_gap_count", **labels) == 2
    skipped = {"reason": "queue_full", "model_name": "tr"}
    assert value(registry, "tokenrouter_quality_skipped_total", **skipped) == 1


def test_sampling_rate_and_window() -> None:
    async def scorer(prompt: list[int], answer: list[int]) -> Score:
        return Score(len(answer), len(answer), 0.0, 0.0)

    async def run() -> LiveQuality:
        live, _ = monitor(scorer, sample_rate=0.25, max_pending=1000)
        sent = sum(live.offer(str(i), [1], [2], (), None) for i in range(400))
        await asyncio.gather(*live.pending)
        assert sent == live.status()["points"]["default"]["answers"]
        assert 60 < sent < 140  # Random(0): a fixed draw near 100
        return live

    live = asyncio.run(run())
    assert live.status()["points"]["default"]["window"]["answers"] == 3  # the last ``window``
    off, _ = monitor(None)
    assert off.sample_rate == 0 and not off.status()["enabled"]
