"""The live quality target (``tuner.quality_target``, quality/target.py): fed scored answers
of a synthetic chain whose rungs agree with the top model at known rates, it settles on
the cheapest rung that meets the target from above and from below, follows a shift of the
prompt mix both ways, judges with confidence bounds (no move before ``min_samples``), and
waits ``retry_after`` before trying a rung that failed. Requests that ask for no
``routing`` take its operating point; the others keep theirs. The scores are drawn from a
seeded generator: each run sees the same sequence."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from tests.ingress.test_ingress_service import Tokenizer
from tests.openai.ingress_app import fake_ingress
from tokenrouter_ray.config import AppConfig
from tokenrouter_ray.openai.validation import PreparedRequest, RoutingChoice, SamplingOptions
from tokenrouter_ray.protocol import SamplingSpec
from tokenrouter_ray.quality.settings import QualityTargetSpec
from tokenrouter_ray.quality.target import QualityTarget

PRESETS = {"fast": [0.7], "balanced": [0.5], "high": [0.2]}
LADDER = ["fast", "balanced", "high"]


def target(**kwargs) -> QualityTarget:  # type: ignore[no-untyped-def]
    spec = QualityTargetSpec(target=kwargs.pop("target", 0.8), ladder=LADDER, **kwargs)
    return QualityTarget(spec, PRESETS, "large")


def serve(t: QualityTarget, rates: dict[str, float], answers: int, rng: random.Random) -> list[str]:
    """``answers`` answers at the target's current rung, each scored (16 positions) with
    whole-answer agreement at that rung's rate; the rung each was served at."""
    served = []
    for _ in range(answers):
        rung = t.current
        served.append(rung.name)
        agree = rng.random() < rates[rung.name]
        t.observe(rung.point, 16, 16 if agree else 15)
    return served


RATES = {"fast": 0.35, "balanced": 0.7, "high": 0.9, "alone": 1.0}


def settled(served: list[str]) -> str:
    """The rung most of the last third was served at."""
    tail = served[-len(served) // 3 :]
    return max(set(tail), key=tail.count)


def test_it_settles_on_the_cheapest_rung_that_meets_the_target_from_either_side() -> None:
    for start in (None, "fast"):  # from the top model alone, and from the cheapest rung
        t = target(start=start)
        served = serve(t, RATES, 3000, random.Random(1))
        assert settled(served) == "high", (start, t.status()["moves"])
        tail = served[-1000:]
        assert tail.count("high") >= 800  # probes below are short and rare
        assert "fast" not in tail  # judged failing, not tried again within retry_after


def test_it_follows_the_prompt_mix_both_ways() -> None:
    t, rng = target(), random.Random(2)
    assert settled(serve(t, RATES, 2000, rng)) == "high"
    easy = {**RATES, "balanced": 0.97, "fast": 0.6}  # chit-chat: cheaper rungs agree
    assert settled(serve(t, easy, 2000, rng)) == "balanced"
    hard = {**RATES, "high": 0.6}  # factual questions: only the top model alone holds
    assert settled(serve(t, hard, 2000, rng)) == "alone"
    assert settled(serve(t, RATES, 3000, rng)) == "high"


def test_no_move_before_min_samples_and_bounds_decide() -> None:
    t = target(min_samples=30, start="fast")
    for _ in range(29):
        t.observe("fast", 10, 0)  # plainly failing, but too few answers to judge
    assert t.current.name == "fast"
    t.observe("fast", 10, 0)
    assert t.current.name == "balanced"
    (move,) = t.status()["moves"]
    assert move["from"] == "fast" and move["reason"] == "agreement under the target"
    assert move["bounds"][1] < 0.8
    for _ in range(30):
        t.observe("fast", 10, 10)  # answers at another rung (a request's own preset)
    assert t.current.name == "balanced"  # judge only the rung in use
    # just at the target: its bounds straddle it, so it stays and gathers
    for k in range(100):
        t.observe("balanced", 10, 10 if k % 5 else 9)
    assert t.current.name == "balanced"


def test_position_agreement_judges_the_mean_share_per_answer() -> None:
    t = target(metric="position", target=0.9, start="balanced")
    for _ in range(30):
        t.observe("balanced", 10, 10)
    assert t.current.name == "fast"
    status = t.status()
    assert status["rung"] == "fast" and status["metric"] == "position"
    assert status["rungs"][1]["retry_at"] is None
    for _ in range(30):
        t.observe("fast", 10, 8)  # every answer 80 %: under 0.9 with no spread
    assert t.current.name == "balanced"
    assert status["rungs"][0]["name"] == "fast"
    assert t.status()["rungs"][0]["retry_at"] == 60 + 200


def test_a_failed_rung_waits_retry_after_scored_answers() -> None:
    t = target(min_samples=10, retry_after=50, start="balanced")
    for _ in range(10):
        t.observe("balanced", 8, 0)
    assert t.current.name == "high"  # balanced failed at scored = 10: retried at 60
    for _ in range(49):
        t.observe("high", 8, 8)
    assert t.current.name == "high"
    t.observe("high", 8, 8)
    assert t.current.name == "balanced"


def test_without_bypass_the_top_rung_is_the_last_preset() -> None:
    t = target(bypass=False)
    assert [r.name for r in t.rungs] == LADDER and t.current.name == "high"
    for _ in range(50):
        t.observe("high", 5, 0)
    assert t.current.name == "high"  # nowhere above to go
    assert t.routing() == ((0.2,), None)
    assert target().routing() == ((), "large")


def prepared(routing_default: bool) -> PreparedRequest:
    sampling = SamplingOptions(SamplingSpec(max_tokens=4))
    routing = RoutingChoice(thresholds=(0.5,), default=routing_default)
    return PreparedRequest("m", [1, 2], sampling, routing=routing)


def test_only_requests_without_routing_follow_the_target() -> None:
    server = fake_ingress(Tokenizer())
    assert server.follow_target(prepared(True)) == prepared(True)  # no monitor: unchanged
    t = target()
    server.quality = SimpleNamespace(target=t)  # type: ignore[assignment]
    followed = server.follow_target(prepared(True)).routing
    assert (followed.thresholds, followed.alone) == ((), "large")
    assert not followed.default
    kept = server.follow_target(prepared(False)).routing
    assert (kept.thresholds, kept.alone) == ((0.5,), None)
    t.index = 1
    assert server.follow_target(prepared(True)).routing.thresholds == (0.5,)


def test_config_checks_the_ladder_start_and_sampling() -> None:
    def config(sample_rate: float = 0.1, **fields):  # type: ignore[no-untyped-def]
        return AppConfig.model_validate({
            "models": {"small": {"path": "small"}, "large": {"path": "large"}},
            "policy": {"name": "bernoulli", "options": {"p": 0.5},
                       "presets": {"fast": 0.7, "high": 0.2}},
            "quality_monitor": {"sample_rate": sample_rate},
            "tuner": {"quality_target": {"target": 0.8, "ladder": ["fast", "high"], **fields}},
        })  # fmt: skip

    assert config().tuner.quality_target.ladder == ["fast", "high"]
    assert config(start="alone").tuner.quality_target.start == "alone"
    for sample_rate, bad, says in (
        (0.1, {"ladder": ["fast", "turbo"]}, "not policy.presets"),
        (0.1, {"ladder": ["fast", "fast"]}, "twice"),
        (0.1, {"start": "turbo"}, "start"),
        (0.1, {"bypass": False, "start": "alone"}, "start"),
        (0.0, {}, "sample_rate"),
        (0.1, {"target": 1.5}, "target"),
    ):
        with pytest.raises(ValidationError, match=says):
            config(sample_rate, **bad)
