"""One decision table per policy, on CPU: given scores or confidences, the route each row
takes. Every table states the policy's rule (from its paper) and the expected destinations
follow from that rule, not from running the policy: ``route`` must agree with it row by row.

Confidences are built exactly: a row whose logits put equal mass on ``k`` of ``V = 16``
tokens (the rest at -1e9) has normalized entropy ``log k / log 16 = log2(k) / 4``, so k = 1,
2, 4, 8, 16 give 0, 0.25, 0.5, 0.75, 1. Neural routers' scores are set directly (the
router network is stubbed): the table is about the decision, not the network.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

from tokenrouter_ray.engine.outputs import StepResult
from tokenrouter_ray.routing.baselines import seeded_uniform
from tokenrouter_ray.routing.policy import Policy, RouteBatch, build_policy, host_scores

VOCAB = 16


def entropy_logits(ks: Sequence[int]) -> torch.Tensor:
    """(B, V): row b spreads its mass evenly over its first ``ks[b]`` tokens."""
    logits = torch.full((len(ks), VOCAB), -1e9, dtype=torch.float64)
    for row, k in enumerate(ks):
        logits[row, :k] = 0.0
    return logits


def entropy_of(k: int) -> float:
    return math.log(k) / math.log(VOCAB)


def batch(
    model: int,
    size: int,
    logits: torch.Tensor | None = None,
    sampled: Sequence[int] | None = None,
    prev: Sequence[int] | None = None,
    first: Sequence[bool] | None = None,
    seeds: Sequence[int] | None = None,
    positions: Sequence[int] | None = None,
) -> RouteBatch:
    sampled = list(sampled or [0] * size)
    positions = list(positions or range(10, 10 + size))
    step = StepResult(
        request_ids=[f"r{i}" for i in range(size)],
        sampled=torch.tensor(sampled),
        token_ids=sampled,
        positions=positions,
        logits=logits,
        hidden=torch.zeros(size, 8, dtype=torch.float64),
    )
    return RouteBatch(
        model=model,
        step=step,
        positions=torch.tensor(positions),
        prev_tokens=torch.tensor(list(prev or [0] * size)),
        is_first=torch.tensor(list(first or [False] * size)),
        seeds=list(seeds or range(size)),
        embed=lambda ids: torch.zeros(len(ids), 8, dtype=torch.float64),
    )


def routes(policy: Policy, b: RouteBatch) -> list[int]:
    out = policy.route(b)
    assert out.dtype == torch.long and out.shape == (b.size,)
    return out.tolist()


# ------------------------------------------------------------------ neural routers
# (score, threshold) -> does model 0's position go to the large model?
NEURAL_RULES = {
    "r2r": lambda s, t: s >= t,  # R2R: the router flags a divergent token (>= threshold)
    "citer": lambda s, t: s < t,  # CITER: the small token is *acceptable* below threshold
    "co_llm": lambda s, t: s > t,  # Co-LLM: defer when P(defer) exceeds eta
}
SCORES = [0.0, 0.2, 0.49, 0.5, 0.51, 0.8, 1.0]


@pytest.mark.parametrize("name", sorted(NEURAL_RULES))
@pytest.mark.parametrize("threshold", [0.2, 0.5, 0.8])
def test_neural_policies_compare_the_router_score_with_the_threshold(
    name: str, threshold: float
) -> None:
    policy = build_policy(name, {"threshold": threshold, "hidden_size": 8}, ["small", "large"])
    policy.router.score = lambda *features: torch.tensor(SCORES, dtype=torch.float64)
    rule = NEURAL_RULES[name]
    expected = [int(rule(s, threshold)) for s in SCORES]
    assert routes(policy, batch(0, len(SCORES))) == expected
    assert 0 < sum(expected) < len(SCORES)  # the table has both outcomes
    # The large model writes its one token and always hands back.
    assert routes(policy, batch(1, len(SCORES))) == [0] * len(SCORES)


# ------------------------------------------------------------------ entropy rules
KS = [1, 2, 4, 8, 16]  # normalized entropies 0, .25, .5, .75, 1


@pytest.mark.parametrize("tau", [0.1, 0.3, 0.6, 0.9])
def test_entropy_baseline_escalates_above_tau(tau: float) -> None:
    policy = build_policy("entropy", {"threshold": tau}, ["small", "large"])
    logits = entropy_logits(KS)
    assert routes(policy, batch(0, len(KS), logits)) == [int(entropy_of(k) > tau) for k in KS]
    assert routes(policy, batch(1, len(KS), logits)) == [0] * len(KS)


@pytest.mark.parametrize("tau", [0.1, 0.6])
def test_rstitch_goes_large_while_uncertain_and_back_once_confident(tau: float) -> None:
    """R-Stitch: the small model hands over when its entropy exceeds tau; the large model
    keeps decoding while *its* entropy exceeds tau and returns when it falls below."""
    policy = build_policy("rstitch", {"tau": tau}, ["small", "large"])
    logits = entropy_logits(KS)
    unsure = [entropy_of(k) > tau for k in KS]
    assert routes(policy, batch(0, len(KS), logits)) == [1 if u else 0 for u in unsure]
    assert routes(policy, batch(1, len(KS), logits)) == [1 if u else 0 for u in unsure]


def test_escalation_climbs_one_level_when_unsure_and_falls_back_to_the_entry() -> None:
    """Multi-model escalation: level l < top goes to l + 1 when its entropy exceeds tau_l,
    else back to level 0; the top level always returns to 0."""
    taus = [0.3, 0.6]
    policy = build_policy("escalation", {"thresholds": taus}, ["small", "mid", "large"])
    logits = entropy_logits(KS)
    for level in range(3):
        if level == 2:
            expected = [0] * len(KS)
        else:
            expected = [level + 1 if entropy_of(k) > taus[level] else 0 for k in KS]
        assert routes(policy, batch(level, len(KS), logits)) == expected, level


def test_glimprouter_glimpses_at_step_starts_and_stays_large_until_the_step_ends() -> None:
    """GlimpRouter: at the first token of a reasoning step (first output token, or the token
    after a step end) the small model's glimpse decides: unsure (entropy > tau) -> the large
    model writes the step; the large model keeps it until it samples a step end."""
    end = 7
    policy = build_policy(
        "glimprouter", {"tau": 0.4, "step_end_token_ids": [end]}, ["small", "large"]
    )
    #       (first, prev token, k)  -> step start?  unsure (log2 k / 4 > 0.4)?
    rows = [
        (True, 0, 8),  # first token, unsure -> large
        (True, 0, 2),  # first token, confident -> stays
        (False, end, 16),  # after a step end, unsure -> large
        (False, end, 1),  # after a step end, confident -> stays
        (False, 3, 16),  # mid-step, unsure: no glimpse here -> stays
        (False, 3, 1),  # mid-step, confident -> stays
    ]
    b = batch(
        0,
        len(rows),
        entropy_logits([k for _, _, k in rows]),
        prev=[p for _, p, _ in rows],
        first=[f for f, _, _ in rows],
    )
    expected = [int((f or p == end) and entropy_of(k) > 0.4) for f, p, k in rows]
    assert routes(policy, b) == expected == [1, 0, 1, 0, 0, 0]
    sampled = [end, 3, 0, end]
    large = batch(1, len(sampled), entropy_logits([16] * len(sampled)), sampled=sampled)
    assert routes(policy, large) == [0 if t == end else 1 for t in sampled]


# ------------------------------------------------------------------ baselines
def test_bernoulli_escalates_where_the_seeded_draw_falls_below_p() -> None:
    seeds, positions = [1, 2, 3, 4, 5, 6], [5, 9, 13, 2, 40, 41]
    draws = [seeded_uniform(s, p) for s, p in zip(seeds, positions, strict=True)]
    p = sorted(draws)[3]  # half of the rows below, half at or above
    policy = build_policy("bernoulli", {"p": p}, ["small", "large"])
    b = batch(0, len(seeds), seeds=seeds, positions=positions)
    assert routes(policy, b) == [int(d < p) for d in draws]
    assert routes(build_policy("bernoulli", {"p": 0.0}, ["s", "l"]), b) == [0] * len(seeds)
    assert routes(build_policy("bernoulli", {"p": 1.0}, ["s", "l"]), b) == [1] * len(seeds)


@pytest.mark.parametrize(("name", "dst"), [("never", 0), ("always", 1)])
def test_never_and_always(name: str, dst: int) -> None:
    policy = build_policy(name, {}, ["small", "large"])
    assert routes(policy, batch(0, 3)) == [dst] * 3
    assert routes(policy, batch(1, 3)) == [0] * 3


# ------------------------------------------------------------------ scores (routing trace)
def scored(policy: Policy, b: RouteBatch) -> list[float | None] | None:
    routes(policy, b)
    return host_scores(b)


@pytest.mark.parametrize("name", sorted(NEURAL_RULES))
def test_neural_policies_expose_their_router_score(name: str) -> None:
    """The score a trace shows is the router's output, oriented so that higher is closer to
    escalating (CITER's router scores safety: its score is 1 - s)."""
    policy = build_policy(name, {"threshold": 0.5, "hidden_size": 8}, ["small", "large"])
    policy.router.score = lambda *features: torch.tensor(SCORES, dtype=torch.float64)
    want = [1 - s for s in SCORES] if name == "citer" else SCORES
    assert scored(policy, batch(0, len(SCORES))) == pytest.approx(want)
    assert scored(policy, batch(1, len(SCORES))) is None  # the large model scores nothing


def test_entropy_policies_expose_the_entropy_they_decided_on() -> None:
    logits, entropies = entropy_logits(KS), [entropy_of(k) for k in KS]
    two = ["small", "large"]
    entropy = build_policy("entropy", {"threshold": 0.3}, two)
    assert scored(entropy, batch(0, len(KS), logits)) == pytest.approx(entropies)
    assert scored(entropy, batch(1, len(KS), logits)) is None
    rstitch = build_policy("rstitch", {"tau": 0.3}, two)  # both models decide by entropy
    for model in (0, 1):
        assert scored(rstitch, batch(model, len(KS), logits)) == pytest.approx(entropies)
    escalation = build_policy("escalation", {"thresholds": [0.3, 0.6]}, ["s", "m", "l"])
    for level in (0, 1):
        assert scored(escalation, batch(level, len(KS), logits)) == pytest.approx(entropies)
    assert scored(escalation, batch(2, len(KS), logits)) is None  # the top never escalates
    glimp = build_policy("glimprouter", {"tau": 0.4, "step_end_token_ids": [7]}, two)
    b = batch(0, 3, entropy_logits([8, 8, 8]), prev=[0, 7, 3], first=[True, False, False])
    assert scored(glimp, b) == [pytest.approx(0.75), pytest.approx(0.75), None]  # glimpses
    assert scored(glimp, batch(1, 2, entropy_logits([8, 8]))) is None


@pytest.mark.parametrize("name", ["bernoulli", "never", "always"])
def test_fixed_and_random_policies_have_no_score(name: str) -> None:
    policy = build_policy(name, {}, ["small", "large"])
    assert scored(policy, batch(0, 3)) is None and scored(policy, batch(1, 3)) is None
