"""Time between models in the throughput model: the exact chain with requests in flight, its
Monte Carlo and request-level cross-checks, the tuner's measured transit, and the choice it
leads to (tokenrouter_ray.tuning: profile, chain, montecarlo, simulate, search, tuner)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.waiting import wait_until
from tokenrouter_ray.cli import main as cli_main
from tokenrouter_ray.replica.window import WindowStats
from tokenrouter_ray.simulation.loads import ClosedLoop
from tokenrouter_ray.thresholds import ThresholdTable
from tokenrouter_ray.tuning import search
from tokenrouter_ray.tuning.chain import build_chain
from tokenrouter_ray.tuning.decision import TunerDecision
from tokenrouter_ray.tuning.examples import paper_r2r
from tokenrouter_ray.tuning.markov import chain_inputs, single_request_throughput, throughput
from tokenrouter_ray.tuning.montecarlo import monte_carlo, monte_carlo_bound
from tokenrouter_ray.tuning.profile import ModelProfile, RoutingProfile, profile_from_mapping
from tokenrouter_ray.tuning.search import evaluate, sweep
from tokenrouter_ray.tuning.simulate import simulate
from tokenrouter_ray.tuning.solver import ThresholdSolver
from tokenrouter_ray.tuning.tuner import TunerCore, TunerSpec

FAST = settings(max_examples=25, deadline=None, database=None)


@st.composite
def transit_profiles(draw: st.DrawFn, max_models: int = 3) -> RoutingProfile:
    """Small random profiles (dense routing, steps 2..6 grains) with a transit on every move
    between two models of 0 up to the sender's step (what the exact chain holds)."""
    m = draw(st.integers(2, max_models))
    weights = np.array(draw(st.lists(st.floats(0.05, 1.0), min_size=m * m, max_size=m * m)))
    route = (weights / weights.reshape(m, m).sum(axis=1).repeat(m)).reshape(m, m)
    commit = np.ones((m, m))
    steps = draw(st.lists(st.integers(2, 6), min_size=m, max_size=m))
    transit = [
        [0.0 if i == j else float(draw(st.integers(0, steps[i]))) for j in range(m)]
        for i in range(m)
    ]
    models = tuple(ModelProfile.constant(f"m{i}", float(steps[i])) for i in range(m))
    return RoutingProfile(
        models, tuple(map(tuple, route.tolist())), tuple(map(tuple, commit.tolist())), 1.0
    ).with_transit(transit)


@FAST
@given(data=st.data())
def test_rows_sum_to_one_and_requests_in_flight_are_conserved(data: st.DataObject) -> None:
    profile = data.draw(transit_profiles())
    n = data.draw(st.integers(1, 4))
    inputs = chain_inputs(profile, n, (1,) * profile.num_models)
    chain = build_chain(inputs)
    np.testing.assert_allclose(np.asarray(chain.transition.sum(axis=1)).ravel(), 1.0, atol=1e-12)
    m, pairs = profile.num_models, inputs.transit_pairs()
    assert chain.fields.shape[1] == 3 * m + 2 * len(pairs)
    models, flights = chain.fields[:, : 3 * m], chain.fields[:, 3 * m :]
    held = models[:, 0::3].sum(axis=1) + models[:, 1::3].sum(axis=1) + flights[:, 0::2].sum(axis=1)
    assert (held == n).all()  # waiting + running + in flight
    assert ((flights[:, 0::2] > 0) == (flights[:, 1::2] > 0)).all()  # a group has a time left
    assert (chain.tau > 0).all()


@FAST
@given(profile=transit_profiles())
def test_one_request_pays_each_transit_it_crosses(profile: RoutingProfile) -> None:
    """N = 1: per visit to i, the step plus the transit of where it goes next."""
    p = profile.route_matrix()
    values, vectors = np.linalg.eig(p.T)
    nu = np.real(vectors[:, np.argmin(np.abs(values - 1.0))])
    nu /= nu.sum()
    per_visit_ms = profile.grains(1)[:, 1] + (p * profile.transit_matrix()).sum(axis=1)
    expected = 1000.0 * float(nu @ profile.tokens_per_step()) / float(nu @ per_visit_ms)
    assert throughput(profile, 1, (1,) * profile.num_models).throughput == pytest.approx(expected)
    assert single_request_throughput(profile) == pytest.approx(expected)


@pytest.mark.parametrize("transit_ms", [1.0, 3.0, 5.0])
def test_the_chain_agrees_with_the_request_level_simulation(transit_ms: float) -> None:
    """The exact chain against ``simulate.py``, which shares nothing with it but the grains
    and holds any number of requests in flight (fixed seed: deterministic)."""
    profile = paper_r2r().with_grain(0.5).with_transit(transit_ms)
    for b in (1, 3, 5):
        exact = throughput(profile, 8, (1, b)).throughput
        walked = simulate(profile, 8, (1, b), events=40_000, seed=1).throughput
        assert walked == pytest.approx(exact, rel=0.015)


def test_no_transit_is_the_chain_without_it() -> None:
    paper = paper_r2r().with_grain(0.5)
    assert paper.with_transit(0.0).transit_ms is None
    assert paper.with_transit(0.2).transit_grains().sum() == 0  # rounds to no grain
    plain = throughput(paper, 8, (1, 5))
    assert throughput(paper.with_transit(0.2), 8, (1, 5)).throughput == plain.throughput
    slowed = throughput(paper.with_transit(2.0), 8, (1, 5))
    assert slowed.throughput < plain.throughput and slowed.num_states > plain.num_states


def test_a_transit_longer_than_a_step_goes_to_monte_carlo() -> None:
    """The exact chain holds one group in flight per pair; past the sender's shortest step
    it refuses, ``auto`` takes Monte Carlo, which agrees with the request-level walk."""
    profile = paper_r2r().with_grain(0.5).with_transit(8.0)  # small's step: 6 ms
    with pytest.raises(ValueError, match="Monte Carlo"):
        throughput(profile, 4, (1, 1))
    assert search.resolve_method(profile, 4, "auto") == "monte-carlo"
    points, method = evaluate(profile, 4, [(1, 1), (1, 3)])
    assert method == "monte-carlo"
    for point in points:
        walked = simulate(profile, 4, point.thresholds, events=40_000, seed=2).throughput
        assert point.throughput == pytest.approx(walked, rel=0.03)


def test_monte_carlo_with_transit_matches_the_exact_chain() -> None:
    profile = paper_r2r().with_grain(0.5).with_transit(2.0)
    candidates = [(1, 1), (1, 5)]
    exact = [throughput(profile, 8, c).throughput for c in candidates]
    for estimate, value in zip(monte_carlo(profile, 8, candidates), exact, strict=True):
        assert estimate.throughput == pytest.approx(value, rel=0.02)
    for estimate, value in zip(
        monte_carlo_bound(profile, 8, candidates, (1, 1)), exact, strict=True
    ):  # the replicas' model with one replica each
        assert estimate.throughput == pytest.approx(value, rel=0.02)


def test_auto_leaves_the_exact_chain_past_its_state_budget(monkeypatch) -> None:
    profile = paper_r2r().with_grain(0.5).with_transit(2.0)
    assert sweep(profile, 6, fixed={"small": 1}).method == "exact"
    monkeypatch.setattr(search, "TRANSIT_MAX_STATES", 50)
    result = sweep(profile, 6, fixed={"small": 1})
    assert result.method == "monte-carlo" and len(result.points) == 6
    assert sweep(profile, 6, fixed={"small": 1}, method="exact").method == "exact"  # asked


def _tuner_choice(profile: RoutingProfile, n: int) -> tuple[int, ...]:
    """What the live solver settles on from all-ones for a profile that holds still."""
    solver = ThresholdSolver(profile.names, concurrencies=[n], fixed={"small": 1})
    for _ in range(10):
        if not solver.decide(profile, force=True).changed:
            break
    return tuple(solver.thresholds[m][n] for m in profile.names)


@pytest.mark.parametrize(("n", "transit_ms"), [(8, 5.0), (4, 2.0)])
def test_tuned_with_transit_never_loses_to_all_ones(n: int, transit_ms: float) -> None:
    """Judged by the independent request-level simulation of the system with the transit
    (fixed seeds): the table the model without transit picks loses to all-ones at 8 and
    5 ms (the model with it says so too); the tuner with the transit keeps all-ones there,
    and at 4 and 2 ms picks a deferral that does gain."""
    plain = paper_r2r().with_grain(0.5)
    timed = plain.with_transit(transit_ms)
    blind, aware = _tuner_choice(plain, n), _tuner_choice(timed, n)
    assert blind == (1, 5 if n == 8 else 3)

    def walked(b: tuple[int, ...]) -> float:
        return simulate(timed, n, b, events=40_000, seed=3).throughput

    ones = walked((1, 1))
    assert walked(aware) >= ones * 0.995  # never below all-ones (0.5 %: the walk's noise)
    if n == 8:
        assert aware == (1, 1)
        assert walked(blind) < ones * 0.97  # what choosing without the transit costs
        assert throughput(timed, n, blind).throughput < throughput(timed, n, (1, 1)).throughput
    else:
        assert aware == (1, 3) and walked(aware) > ones * 1.02


def test_the_window_records_transit_per_pair_and_the_tuner_prices_it() -> None:
    small, large = WindowStats(), WindowStats()
    for k in range(100):
        small.record_move("small", "large" if k % 3 == 0 else "small", int(k % 3 != 0), now=0)
        large.record_move("large", "small", 1, now=0)
        small.record_step(4, 0.006, now=0)
        large.record_step(2, 0.028, now=0)
    large.record_transit("small", "large", 0.002, now=0)
    large.record_transit("small", "large", 0.004, now=0)
    small.record_transit("large", "small", 0.001, now=0)
    snaps = {"small": small.snapshot(now=0), "large": large.snapshot(now=0)}
    assert snaps["large"].transit_ms() == {("small", "large"): pytest.approx(3.0)}
    assert snaps["large"].to_json()["transit"] == {"small->large": [2, pytest.approx(0.006)]}
    for priced in (True, False):
        core = TunerCore(
            ["small", "large"], TunerSpec(transit=priced, min_moves=10), clock=lambda: 0
        )
        for model, snap in snaps.items():
            core.report(model, "r0", snap)
        profile = core.collect()
        if priced:
            assert profile.transit_matrix() == pytest.approx(np.array([[0.0, 3.0], [1.0, 0.0]]))
        else:
            assert profile.transit_ms is None
    decision = core.decide(core.collect().with_transit(2.0))
    body = core.status()["last"]
    assert decision.solved and body["transit_ms"] == {"small->large": 2.0, "large->small": 2.0}


def test_a_decision_carries_its_transit_into_json() -> None:
    d = TunerDecision({"small": ThresholdTable.of([1])}, False, "x").with_routes(
        {("small", "large"): 0.35}, {("small", "large"): 1.25}
    )
    assert d.to_json()["transit_ms"] == {"small->large": 1.25}


def test_profiles_and_the_cli_take_a_transit(tmp_path: Path, capsys) -> None:
    base = {"models": {"small": 6.0, "large": 27.9},
            "route_prob": {"small": {"small": 0.65, "large": 0.35}, "large:small": 1},
            "commit": {"small:small": 1, "large:small": 1}, "grain_ms": 0.5}  # fmt: skip
    both = profile_from_mapping({**base, "transit_ms": 1.5})
    assert both.transit_matrix().tolist() == [[0.0, 1.5], [1.5, 0.0]]
    one = profile_from_mapping({**base, "transit_ms": {"small:large": 2}})
    assert one.transit_matrix().tolist() == [[0.0, 2.0], [0.0, 0.0]]
    with pytest.raises(ValueError, match="diagonal"):
        both.with_transit([[1.0, 0.0], [0.0, 0.0]])
    path = tmp_path / "p.json"
    path.write_text(json.dumps(base))
    args = [
        "tune",
        "--profile",
        str(path),
        "--concurrency-levels",
        "8",
        "--fix",
        "small=1",
        "--json",
    ]
    assert cli_main(args) == 0
    assert json.loads(capsys.readouterr().out)["8"]["best"]["large"] == 5
    assert cli_main([*args, "--transit-ms", "small:large=5,large:small=5"]) == 0
    assert json.loads(capsys.readouterr().out)["8"]["best"]["large"] == 2  # 0.1 % over 1
    assert cli_main([*args, "--transit-ms", "small:huge=1"]) == 2
    assert "--transit-ms: unknown model" in capsys.readouterr().err


def test_the_simulated_runtime_measures_at_least_its_network_delay() -> None:
    """The simulated runtime with every frame 3 ms late: each handoff's measured transit
    (built at the sender -> applied at the receiver), read from the replicas' tuner windows,
    is at least the delay, and the tuner's profile carries it (nothing here depends on how
    fast the machine is: a busy machine only measures more)."""

    async def run() -> tuple[dict, RoutingProfile | None]:
        loop = ClosedLoop(paper_r2r(), 4, (1, 1), max_defer_s=float("inf"), transit_s=0.003)
        async with loop:
            # handoffs under way both ways, then a warm-up by design (as the simulate CLI's
            # --warmup-s) before the measured window
            await wait_until(
                lambda: (
                    {("small", "large"), ("large", "small")}
                    <= set(loop.backend.snapshot()["handoffs"])
                ),
                60,
                "handoffs both ways",
            )
            await asyncio.sleep(0.3)
            measured = await loop.measure(1.0, (1, 1))
            core = TunerCore(["small", "large"], TunerSpec(min_moves=1), clock=lambda: 0)
            for server in loop.servers:
                core.report(server.name, "r0", await server.window())
        return measured.transit_ms, core.collect()

    measured, profile = asyncio.run(run())
    assert set(measured) == {("small", "large"), ("large", "small")}
    assert min(measured.values()) >= 3.0
    assert profile is not None
    d = profile.transit_matrix()
    assert d[0, 1] >= 3.0 and d[1, 0] >= 3.0 and d[0, 0] == d[1, 1] == 0.0


def test_simulate_delays_every_frame_and_prices_the_delay(capsys) -> None:
    """``simulate --transit-ms``: the runtime's frames are that late (the replicas measure at
    least it), the prediction is the chain's with it, and a per-pair transit is refused
    (the simulated network delays every frame alike)."""
    inline = ["--step-ms", "small=6,large=27.9", "--route-prob",
              "small:small=0.65,small:large=0.35,large:small=1", "--grain-ms", "0.5"]  # fmt: skip
    args = [
        "simulate",
        *inline,
        "--concurrency-levels",
        "2",
        "--window-s",
        "0.5",
        "--warmup-s",
        "0.2",
    ]
    assert cli_main([*args, "--transit-ms", "2", "--json"]) == 0
    (entry,) = json.loads(capsys.readouterr().out)
    timed = paper_r2r().with_grain(0.5).with_transit(2.0)
    assert entry["predicted"] == pytest.approx(throughput(timed, 2, (1, 1)).throughput, abs=1e-3)
    assert min(entry["transit_ms_measured"].values()) >= 2.0
    assert cli_main([*args, "--transit-ms", "small:large=2"]) == 2
    assert "must be one number" in capsys.readouterr().err
