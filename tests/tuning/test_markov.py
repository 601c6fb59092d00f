"""Properties of the exact chain and its throughput (tokenrouter_ray.tuning.markov/chain)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenrouter_ray.thresholds import check_admissible, is_admissible
from tokenrouter_ray.tuning.chain import build_chain
from tokenrouter_ray.tuning.examples import paper_r2r
from tokenrouter_ray.tuning.markov import chain_inputs, single_request_throughput, throughput
from tokenrouter_ray.tuning.profile import ModelProfile, RoutingProfile
from tokenrouter_ray.tuning.search import sweep
from tokenrouter_ray.tuning.simulate import simulate

FAST = settings(max_examples=25, deadline=None, database=None)


@st.composite
def profiles(draw: st.DrawFn, max_models: int = 3) -> RoutingProfile:
    """Small random profiles: dense routing (every p_ij >= 0.05), step times 1..6 grains."""
    m = draw(st.integers(1, max_models))
    weights = np.array(
        draw(st.lists(st.floats(0.05, 1.0), min_size=m * m, max_size=m * m))
    ).reshape(m, m)
    route = weights / weights.sum(axis=1, keepdims=True)
    commit = np.array(
        draw(st.lists(st.sampled_from([0.0, 1.0, 2.0]), min_size=m * m, max_size=m * m))
    ).reshape(m, m)
    commit[0, 0] = 1.0  # something is always committed
    steps = draw(st.lists(st.integers(1, 6), min_size=m, max_size=m))
    slopes = draw(st.lists(st.integers(0, 2), min_size=m, max_size=m))
    models = tuple(
        ModelProfile(f"m{i}", ((1, float(steps[i])), (4, float(steps[i] + 3 * slopes[i]))))
        for i in range(m)
    )
    return RoutingProfile(
        models, tuple(map(tuple, route.tolist())), tuple(map(tuple, commit.tolist())), 1.0
    )


def admissible_thresholds(draw: st.DrawFn, m: int, n: int) -> tuple[int, ...]:
    thresholds = [1] * m
    for i in draw(st.permutations(range(m))):
        room = n - 1 - sum(b - 1 for b in thresholds)  # keep sum(B - 1) < n
        thresholds[i] = draw(st.integers(1, 1 + room))
    return tuple(thresholds)


@FAST
@given(data=st.data())
def test_rows_sum_to_one_and_states_conserve_requests(data: st.DataObject) -> None:
    profile = data.draw(profiles())
    n = data.draw(st.integers(1, 4))
    thresholds = admissible_thresholds(data.draw, profile.num_models, n)
    chain = build_chain(chain_inputs(profile, n, thresholds))
    rows = np.asarray(chain.transition.sum(axis=1)).ravel()
    np.testing.assert_allclose(rows, 1.0, atol=1e-12)
    assert (chain.transition.data > 0).all()
    waiting, batch, left = chain.fields[:, 0::3], chain.fields[:, 1::3], chain.fields[:, 2::3]
    assert (waiting.sum(axis=1) + batch.sum(axis=1) == n).all()
    assert ((batch > 0) == (left > 0)).all()
    assert (batch > 0).any(axis=1).all()  # admissible B never leaves every model idle
    assert (chain.tau > 0).all()


def _closed_form_single_request(profile: RoutingProfile) -> float:
    """nu p = nu by eigenvector; T = sum nu_i sum_j p_ij c_ij / sum nu_i t_i(1)."""
    p, c = profile.route_matrix(), profile.commit_matrix()
    values, vectors = np.linalg.eig(p.T)
    nu = np.real(vectors[:, np.argmin(np.abs(values - 1.0))])
    nu = nu / nu.sum()
    step_s = np.array([profile.grains(1)[i, 1] for i in range(p.shape[0])]) * profile.grain_ms
    return float(nu @ (p * c).sum(axis=1)) / float(nu @ step_s / 1000.0)


@FAST
@given(profile=profiles())
def test_single_request_matches_closed_form(profile: RoutingProfile) -> None:
    expected = _closed_form_single_request(profile)
    exact = throughput(profile, 1, (1,) * profile.num_models).throughput
    assert exact == pytest.approx(expected, rel=1e-9)
    assert single_request_throughput(profile) == pytest.approx(expected, rel=1e-9)


def test_single_request_paper_value() -> None:
    paper = paper_r2r()
    # one request: 1/1.35 tokens per (6.0 + 0.35 * 27.9) / 1.35 ms -> 1 token per 15.765 ms
    assert throughput(paper, 1, (1, 1)).throughput == pytest.approx(1000 / 15.765, rel=1e-12)


@pytest.mark.parametrize(
    ("n", "thresholds"), [(1, (1, 2)), (4, (3, 3)), (4, (5, 1)), (8, (4, 4, 3)), (3, (0, 1))]
)
def test_deadlocking_thresholds_are_rejected(n: int, thresholds: tuple[int, ...]) -> None:
    assert not is_admissible(n, thresholds)
    with pytest.raises(ValueError, match=r"deadlock|>= 1"):
        check_admissible(n, thresholds)


def test_deadlock_rejected_before_building() -> None:
    paper = paper_r2r()
    with pytest.raises(ValueError, match=r"deadlock at N=4"):
        throughput(paper, 4, (2, 4))
    assert is_admissible(4, (2, 3))
    assert throughput(paper, 4, (2, 3)).throughput > 0


@FAST
@given(data=st.data())
def test_relabelling_models_changes_nothing(data: st.DataObject) -> None:
    profile = data.draw(profiles(max_models=3))
    n = data.draw(st.integers(1, 4))
    thresholds = admissible_thresholds(data.draw, profile.num_models, n)
    order = data.draw(st.permutations(range(profile.num_models)))
    original = throughput(profile, n, thresholds)
    relabelled = throughput(profile.permuted(order), n, tuple(thresholds[i] for i in order))
    assert relabelled.throughput == pytest.approx(original.throughput, rel=1e-9)


def test_paper_setting_optimum_behaviour() -> None:
    paper = paper_r2r()
    # N = 1: B_large = 1 is the only admissible choice, and it is what the search returns.
    assert sweep(paper, 1, {"small": 1}).best_by_name() == {"small": 1, "large": 1}
    # N = 16: deferring the large model pays; the best B_large is strictly above 1.
    result = sweep(paper, 16, {"small": 1})
    assert [p.thresholds[1] for p in result.points] == list(range(1, 17))
    assert result.best_by_name()["large"] > 1
    assert result.best.throughput > result.points[0].throughput
    # B_large = N makes the large model wait for every request: worse than the optimum
    assert result.points[-1].throughput < result.best.throughput


@pytest.mark.parametrize(("n", "thresholds"), [(4, (1, 1)), (4, (1, 3)), (3, (2, 1))])
def test_exact_matches_independent_simulation(n: int, thresholds: tuple[int, int]) -> None:
    paper = paper_r2r()
    exact = throughput(paper, n, thresholds).throughput
    simulated = simulate(paper, n, thresholds, events=20_000, seed=n).throughput
    assert simulated == pytest.approx(exact, rel=0.02)


def test_exact_matches_simulation_with_batch_dependent_steps() -> None:
    profile = RoutingProfile(
        models=(
            ModelProfile("a", ((1, 2.0), (3, 4.0))),
            ModelProfile("b", ((1, 5.0), (2, 6.0), (4, 9.0))),
            ModelProfile("c", ((1, 3.0),), max_batch=2),
        ),
        route_prob=((0.5, 0.3, 0.2), (0.6, 0.2, 0.2), (0.5, 0.5, 0.0)),
        commit=((1, 0, 0), (1, 1, 0), (2, 1, 0)),
        grain_ms=1.0,
    )
    exact = throughput(profile, 4, (1, 2, 1)).throughput
    simulated = simulate(profile, 4, (1, 2, 1), events=20_000, seed=3).throughput
    assert simulated == pytest.approx(exact, rel=0.02)


def test_single_model_closed_form() -> None:
    # one model, every request always back to it: N requests commit N tokens per t(N)
    profile = RoutingProfile(
        (ModelProfile("only", ((1, 2.0), (8, 9.0))),), ((1.0,),), ((1.0,),), 0.5
    )
    for n in (1, 3, 8):
        step_s = profile.grains(n)[0, n] * 0.5 / 1000
        assert throughput(profile, n, (1,)).throughput == pytest.approx(n / step_s)


def test_max_batch_caps_launches() -> None:
    capped = RoutingProfile(
        (ModelProfile("a", ((1, 1.0),), max_batch=2), ModelProfile.constant("b", 3.0)),
        ((0.5, 0.5), (1.0, 0.0)),
        ((1.0, 0.0), (1.0, 0.0)),
        1.0,
    )
    chain = build_chain(chain_inputs(capped, 5, (1, 1)))
    assert chain.fields[:, 1].max() == 2  # model a never runs more than 2 at once
    assert ((chain.fields[:, 0] > 0) & (chain.fields[:, 1] == 2)).any()  # the cap binds


def test_grain_rounding_is_to_nearest() -> None:
    paper = paper_r2r()
    grains = paper.grains(4)
    assert grains[0, 1] == 60 and grains[1, 1] == 279  # 27.9 / 0.1 is 278.999... in floats
    assert paper.with_grain(4.0).grains(1)[:, 1].tolist() == [2, 7]  # 1.5 -> 2, 6.975 -> 7
