"""The B search, threshold lists, the stationary solver and the Monte Carlo approximation."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from tokenrouter_ray.tuning.chain import build_chain
from tokenrouter_ray.tuning.examples import escalation_chain, paper_r2r
from tokenrouter_ray.tuning.markov import chain_inputs, throughput
from tokenrouter_ray.tuning.montecarlo import MonteCarloConfig, monte_carlo
from tokenrouter_ray.tuning.search import candidates, resolve_method, sweep, threshold_lists
from tokenrouter_ray.tuning.stationary import _direct, _gauss_seidel, stationary


def test_stationary_of_a_reducible_chain_weights_closed_classes() -> None:
    # 0 is transient; {1, 3} is a periodic closed class; {2} is absorbing
    p = sp.csr_matrix(
        np.array(
            [
                [0.0, 0.3, 0.7, 0.0],
                [0.0, 0.0, 0.0, 1.0],
                [0.0, 0.0, 1.0, 0.0],
                [0.0, 1.0, 0.0, 0.0],
            ]
        )
    )
    np.testing.assert_allclose(stationary(p, start=0), [0.0, 0.15, 0.7, 0.15], atol=1e-12)
    np.testing.assert_allclose(stationary(p, start=3), [0.0, 0.5, 0.0, 0.5], atol=1e-12)


def test_gauss_seidel_agrees_with_direct_solve() -> None:
    chain = build_chain(chain_inputs(paper_r2r(), 8, (1, 2)))
    pi = stationary(chain.transition)
    closed = pi > 0
    block = chain.transition[closed][:, closed].tocsr()
    np.testing.assert_allclose(_gauss_seidel(block), _direct(block), atol=1e-10)
    residual = pi @ chain.transition - pi
    assert np.abs(residual).sum() < 1e-10


def test_sweep_is_exhaustive_by_default_and_patience_prunes() -> None:
    paper = paper_r2r()
    full = sweep(paper, 8, {"small": 1})
    assert [p.thresholds for p in full.points] == [(1, b) for b in range(1, 9)]
    assert full.method == "exact"
    pruned = sweep(paper, 8, {"small": 1}, patience=1)
    best_large = full.best_by_name()["large"]
    assert [p.thresholds[1] for p in pruned.points] == list(range(1, best_large + 2))
    assert pruned.best.thresholds == full.best.thresholds


def test_candidates_respect_fixed_and_deadlock_rule() -> None:
    grid = candidates(escalation_chain(), 4, {"small": 1})
    assert all(b[0] == 1 and (b[1] - 1) + (b[2] - 1) < 4 for b in grid)
    assert len(grid) == 10  # pairs (B_mid, B_large) with B_mid + B_large <= 5
    with pytest.raises(ValueError, match="deadlock"):
        candidates(escalation_chain(), 2, {"small": 3})
    with pytest.raises(ValueError, match="unknown model"):
        candidates(escalation_chain(), 2, {"tiny": 1})


def test_joint_labels_with_several_free_models() -> None:
    result = sweep(escalation_chain(), 3, {"small": 1}, method="exact")
    labels = [result.point_label(p) for p in result.points]
    assert labels[0] == "mid=1,large=1"
    assert len(labels) == len(candidates(escalation_chain(), 3, {"small": 1}))


def test_monte_carlo_within_five_percent_of_exact() -> None:
    profile = escalation_chain()
    grid = candidates(profile, 5, {"small": 1})
    config = MonteCarloConfig(replicas=16, warmup_events=200, events=1500, seed=1)
    for estimate in monte_carlo(profile, 5, grid, config):
        exact = throughput(profile, 5, estimate.thresholds).throughput
        assert estimate.throughput == pytest.approx(exact, rel=0.05)
        assert estimate.stderr is not None and estimate.stderr < 0.02 * exact


def test_auto_method_uses_exact_for_two_models_and_small_n() -> None:
    assert resolve_method(paper_r2r(), 64, "auto") == "exact"
    assert resolve_method(escalation_chain(), 8, "auto") == "exact"
    assert resolve_method(escalation_chain(), 16, "auto") == "monte-carlo"
    with pytest.raises(ValueError, match="unknown method"):
        resolve_method(paper_r2r(), 4, "guess")


def test_threshold_lists_step_between_tuned_concurrencies() -> None:
    paper = paper_r2r()
    results = {n: sweep(paper, n, {"small": 1}) for n in (2, 4)}
    lists = threshold_lists(results, max_n=6)
    best2 = results[2].best_by_name()["large"]
    best4 = results[4].best_by_name()["large"]
    assert lists["small"] == [1] * 7
    assert lists["large"] == [1, 1, best2, best2, best4, best4, best4]
