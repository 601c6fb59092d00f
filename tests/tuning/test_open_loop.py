"""The open-loop (Poisson arrivals) prediction, tokenrouter_ray.tuning.open_loop, against
queueing closed forms: constant service is M/M/1 (or M/M/1/K with a cap), service growing
with n is M/M/inf, and the processor-sharing simulation gives M/G/1-PS's mean sojourn."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import binom, poisson

from tokenrouter_ray.tuning.examples import paper_r2r
from tokenrouter_ray.tuning.markov import throughput
from tokenrouter_ray.tuning.open_loop import (
    birth_death_stationary,
    markov_token_rates,
    predict_open_loop,
    simulate_processor_sharing,
    stability_limit,
)


def test_constant_service_is_mm1() -> None:
    lam, mu, tokens = 3.0, 4.0, 10  # requests/s; T = mu L tokens/s in every state
    rho = lam / mu
    p = predict_open_loop(lam, tokens, [mu * tokens], tail="hold")
    n = np.arange(len(p.pi))
    np.testing.assert_allclose(p.pi, (1 - rho) * rho**n, rtol=1e-9, atol=1e-15)
    assert p.left_out < 1e-12
    assert p.throughput == pytest.approx(lam * tokens)  # stable: everything offered is served
    assert p.served_rate == pytest.approx(lam)
    assert p.mean_active == pytest.approx(rho / (1 - rho))  # 3
    assert p.mean_latency_s == pytest.approx(1 / (mu - lam))  # 1 s
    assert p.mean_tpot_s == pytest.approx(1 / (mu - lam) / tokens)
    assert p.busy_fraction == pytest.approx(rho)
    assert p.stability_limit == pytest.approx(mu) and p.load == pytest.approx(rho)
    # Tokens are served at the same rate in every busy state, so the token-weighted state
    # distribution is N | N >= 1, geometric: P(N <= n | N >= 1) = 1 - rho^n. Its 99th
    # percentile is the smallest n with rho^n <= 0.01 (n = 17), i.e. 17 / 40 s per token.
    n99 = math.ceil(math.log(0.01) / math.log(rho))
    assert n99 == 17
    assert p.tpot_quantile(0.99) == pytest.approx(n99 / (mu * tokens))
    assert p.tpot_quantile(0.5) == pytest.approx(3 / (mu * tokens))  # 1 - .75^3 = .578


def test_hold_tail_past_the_computed_states() -> None:
    """mu(1) = 1, mu(2) = 2, then held at 2: pi(n) = pi0 lam^n / (1 * 2^(n-1)) for n >= 1."""
    lam = 1.5
    pi, _ = birth_death_stationary(lam, [1.0, 2.0], tail="hold")
    r = lam / 2
    pi0 = 1 / (1 + lam / (1 - r))  # 1 + sum_{n>=1} lam r^(n-1)
    assert pi[0] == pytest.approx(pi0)
    assert pi[1] == pytest.approx(pi0 * lam)
    assert pi[5] == pytest.approx(pi0 * lam * r**4)
    assert stability_limit([1.0, 2.0], "hold") == 2.0


def test_linear_service_is_mm_infinity() -> None:
    lam, mu = 5.0, 2.0  # mu(n) = n mu: every request served on its own
    p = predict_open_loop(lam, 1, [mu * n for n in (1, 2, 3)], tail="linear")
    n = np.arange(len(p.pi))
    np.testing.assert_allclose(p.pi, poisson.pmf(n, lam / mu), rtol=1e-9, atol=1e-15)
    assert p.mean_active == pytest.approx(lam / mu)
    assert p.mean_latency_s == pytest.approx(1 / mu)  # no waiting at all
    assert math.isinf(p.stability_limit) and p.load == 0.0


def test_block_tail_is_mm1k() -> None:
    lam, mu, cap = 6.0, 4.0, 5  # overloaded, but at most 5 admitted
    rho = lam / mu
    p = predict_open_loop(lam, 1, [mu] * cap, tail="block")
    assert len(p.pi) == cap + 1
    weights = rho ** np.arange(cap + 1)
    np.testing.assert_allclose(p.pi, weights / weights.sum())
    assert p.blocking == pytest.approx(weights[-1] / weights.sum())
    assert p.served_rate == pytest.approx(lam * (1 - p.blocking))
    assert p.mean_latency_s == pytest.approx(p.mean_active / p.served_rate)


def test_unstable_and_bad_inputs_are_errors() -> None:
    with pytest.raises(ValueError, match="unstable"):
        predict_open_loop(4.0, 1, [4.0], tail="hold")
    with pytest.raises(ValueError, match="positive"):
        predict_open_loop(1.0, 1, [1.0, 0.0])
    with pytest.raises(ValueError, match="tail"):
        predict_open_loop(1.0, 1, [2.0], tail="nope")
    with pytest.raises(ValueError, match="unstable"):
        simulate_processor_sharing(4.0, 1, [4.0], requests=10, warmup=1)


def test_markov_token_rates_read_the_table_at_each_n() -> None:
    profile = paper_r2r()
    rates = markov_token_rates(profile, ([1], [1, 1, 2, 3, 3]), max_n=6)
    assert rates[0] == pytest.approx(63.43, abs=0.01)  # N = 1, closed form
    assert rates[3] == pytest.approx(throughput(profile, 4, (1, 3)).throughput)
    assert rates[5] == pytest.approx(throughput(profile, 6, (1, 3)).throughput)  # last repeats


def test_processor_sharing_matches_mg1_ps() -> None:
    """M/G/1-PS: a request needing x seconds alone stays x / (1 - rho) on average, whatever
    the service distribution (here every request is the same L tokens)."""
    lam, mu, tokens = 3.0, 4.0, 10
    sample = simulate_processor_sharing(lam, tokens, [mu * tokens], requests=20_000,
                                        warmup=1_000, seed=3)  # fmt: skip
    assert sample.sojourn_s.mean() == pytest.approx(1 / (mu - lam), rel=0.08)
    assert sample.mean_active == pytest.approx(lam / (mu - lam), rel=0.08)
    assert not np.isnan(sample.sojourn_s).any()


def test_processor_sharing_routing_noise_alone() -> None:
    """At a vanishing arrival rate every request is alone (N = 1): its time is exactly
    L a + K e with K ~ Binomial(L, q); in the paper setting e = 27.9 ms."""
    q, small, tokens = 0.35, 0.006, 32
    t1 = 1 / (small + q * 0.0279)  # T(1) = 63.43 tokens/s
    sample = simulate_processor_sharing(1e-3, tokens, [t1], requests=4_000, warmup=10,
                                        seed=1, escalation=(q, small))  # fmt: skip
    expected = tokens * small + binom.ppf(0.99, tokens, q) * 0.0279
    assert np.quantile(sample.sojourn_s, 0.99) == pytest.approx(expected, rel=1e-3)
    assert sample.sojourn_s.mean() == pytest.approx(tokens / t1, rel=0.01)
