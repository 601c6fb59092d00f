"""The replica step's order (replica/step.py): the previous step's reports run while the next
forward is in flight, a row routed away is never in the next batch, and the loop survives
an unbounded deferral; on simulated engines (no model)."""

from __future__ import annotations

import asyncio
import itertools
import math
import threading
import time

from tests.waiting import wait_until
from tokenrouter_ray.replica.step import STATE_PERIOD_S
from tokenrouter_ray.simulation.loads import ClosedLoop
from tokenrouter_ray.tuning.examples import paper_r2r
from tokenrouter_ray.tuning.profile import ModelProfile, RoutingProfile


def slow_profile(ms: float = 5.0) -> RoutingProfile:
    p = paper_r2r()
    models = (ModelProfile.constant("small", ms), ModelProfile.constant("large", ms))
    return RoutingProfile(models, p.route_prob, p.commit, p.grain_ms)


def leavers_checked(seq: list[tuple[str, str, set[str], int]], strict: bool = False) -> int:
    """How many (rows that left after a step, the batch launched right after it on that
    model with no step of the other model in between) pairs ``seq`` holds; ``strict``:
    assert that no such batch holds a row that left."""
    checked = 0
    seq = list(seq)  # (the step threads append to it)
    for model in {name for name, *_ in seq}:
        mine = [e for e in seq if e[0] == model]
        for (_, kind, rids, n), (_, next_kind, next_rids, n_next) in itertools.pairwise(mine):
            if kind == "leaving" and next_kind == "batch" and rids and n_next == n:
                assert not (strict and rids & next_rids)
                checked += 1
    return checked


def test_reports_overlap_the_next_forward_and_leavers_skip_the_next_batch() -> None:
    async def go() -> None:
        loop = ClosedLoop(slow_profile(), 6, (1, 1), max_tokens=40)
        async with loop:
            # (next step in flight, runnable work here) whenever a step is reported
            reports: list[tuple[bool, bool]] = []
            # (model, kind, rids, steps the other model had launched by then)
            seq: list[tuple[str, str, set[str], int]] = []
            launches = {server.name: 0 for server in loop.servers}
            other = {"small": "large", "large": "small"}
            for server in loop.servers:
                engine, real_report, real_commit = (
                    server.engine,
                    server.report,
                    server.commit,
                )
                runner, real_launch = engine.runner, engine.runner.launch

                def report(result, routed, decided, out, engine=engine, real=real_report):  # type: ignore[no-untyped-def]
                    reports.append((engine._in_flight is not None, engine.has_runnable))
                    return real(result, routed, decided, out)

                def commit(result, routed, name=server.name, real=real_commit):  # type: ignore[no-untyped-def]
                    decided = real(result, routed)
                    seq.append((name, "leaving", set(decided.leaving), launches[other[name]]))
                    return decided

                def launch(out, timings, name=server.name, real=real_launch):  # type: ignore[no-untyped-def]
                    rids = {c.request.request_id for c in out.chunks}
                    seq.append((name, "batch", rids, launches[other[name]]))
                    launches[name] += 1
                    return real(out, timings)

                server.report, server.commit, runner.launch = report, commit, launch
            # as long as it takes to see the evidence the checks below need (and some more)
            await wait_until(
                lambda: len(reports) > 200 and leavers_checked(seq) > 40,
                60,
                "200 reports and 40 leaving rows checked",
            )
            servers = list(loop.servers)
        assert len(reports) > 50
        # whenever there was work, the next step was launched before the last was reported
        assert all(in_flight or not runnable for in_flight, runnable in reports)
        assert sum(in_flight for in_flight, _ in reports) > len(reports) / 2
        # a row that left after step t is not in the batch launched right after, whenever
        # the other model launched no step in between (so none of them can be back yet)
        assert leavers_checked(seq, strict=True) > 10
        for server in servers:
            profile = server.profile
            assert profile.steps > 0 and profile.critical_s > 0
            assert {"route", "commit", "launch", "report"} <= set(profile.phases)

    asyncio.run(go())


def test_an_unbounded_deferral_waits_without_failing_the_loop() -> None:
    async def go() -> None:
        # B_large = 3 at N = 4 with no max wait: the large model holds requests until three
        # are runnable there, sleeping with an infinite deadline in between.
        loop = ClosedLoop(slow_profile(2.0), 4, (1, 3), max_defer_s=math.inf, max_tokens=30)
        async with loop:
            m = await loop.measure(1.0, (1, 3))
            assert all(s.alive and s.error is None for s in loop.servers)
        assert m.tokens > 0 and m.finished_requests > 0

    asyncio.run(go())


def test_the_engine_gauges_are_set_at_most_every_period_and_once_idle() -> None:
    """Short requests that leave each model idle or deferred between steps (the large one
    holds launches for B = 2): the gauges are set at most every ``STATE_PERIOD_S`` per model
    (setting them on every idle launch put ~10 gauge calls before the step's HANDOFF or
    FINISHED), and once the load stops each model's last setting shows it empty."""

    async def go() -> tuple[dict[str, list[float]], dict[str, int]]:
        loop = ClosedLoop(slow_profile(1.0), 3, (1, 2), max_defer_s=0.004, max_tokens=3)
        calls: dict[str, list[float]] = {"small": [], "large": []}
        running: dict[str, int] = {}
        async with loop:
            metrics = loop.servers[0].metrics
            real = metrics.engine_state

            def engine_state(model, engine):  # type: ignore[no-untyped-def]
                calls[model].append(time.monotonic())
                running[model] = engine.status().running + engine.status().waiting
                return real(model, engine)

            for server in loop.servers:
                server.metrics.engine_state = engine_state  # type: ignore[method-assign]
            m = await loop.measure(1.0, (1, 2))
            assert m.finished_requests > 50  # many idle spells on both models
            await loop.set_clients(0)
            await loop.runtime.wait_idle()
        return calls, running

    calls, running = asyncio.run(go())
    for model, times in calls.items():
        assert len(times) >= 10, model
        gaps = [b - a for a, b in itertools.pairwise(times)]
        # (half: a thread preempted between its clock read and the call must not fail it)
        assert min(gaps) >= STATE_PERIOD_S / 2, (model, min(gaps))
    assert running == {"small": 0, "large": 0}


def test_the_watchdog_sees_a_wedged_step_and_a_run_of_failed_steps() -> None:
    async def go() -> tuple[str | None, str | None, str | None]:
        loop = ClosedLoop(slow_profile(1.0), 2, (1, 1), max_tokens=1000)
        async with loop:
            small = loop.servers[0]
            runner, real = small.engine.runner, small.engine.runner.launch
            await wait_until(lambda: small.profile.steps >= 20, 60, "the small model stepping")
            healthy = small.health_problem(max_step_s=0.5, max_failed_steps=3)
            entered, release = threading.Event(), threading.Event()

            def wedged(out, timings):  # type: ignore[no-untyped-def]
                entered.set()
                release.wait(30)
                return real(out, timings)

            runner.launch = wedged  # the instance's launch: the engine calls it
            assert await asyncio.to_thread(entered.wait, 30)
            since = small.step_since
            assert since is not None
            # judged 1 s into the wedged step (the clock driven, not slept through)
            stuck = small.health_problem(max_step_s=0.5, max_failed_steps=3, now=since + 1.0)

            def broken(out, timings):  # type: ignore[no-untyped-def]
                raise RuntimeError("device lost")

            runner.launch = broken
            release.set()  # the wedged step ends, then every step fails
            await wait_until(lambda: small.failed_in_row >= 3, 60, "three failed steps")
            failing = small.health_problem(max_step_s=60, max_failed_steps=3)
            del runner.launch
        return healthy, stuck, failing

    healthy, stuck, failing = asyncio.run(go())
    assert healthy is None
    assert stuck is not None and "a step has run" in stuck
    assert failing is not None and "steps in a row failed" in failing


def test_messages_apply_while_a_step_runs_and_wait_for_it_when_they_concern_its_rows() -> None:
    """With 40 ms steps: requests arriving mid-step are applied before the step ends (so the
    next launch only checks them), and an ABORT of a request in the running step is held
    until that step is committed: the engine never frees a request the device computes."""
    from tests.local.test_protocol_runtime import all_free
    from tokenrouter_ray.local import LocalRuntime
    from tokenrouter_ray.protocol import SamplingSpec
    from tokenrouter_ray.routing.policy import build_policy
    from tokenrouter_ray.simulation.backend import sim_engine

    models = ["small", "large"]
    engines = [(m, sim_engine(lambda b: 0.04)) for m in models]
    small = engines[0][1]
    aborts: list[tuple[str, bool]] = []  # (rid, in the step the device was computing)
    real_abort = small.abort

    def abort(rid: str) -> None:
        running = small._in_flight
        aborts.append((rid, running is not None and rid in running.request_ids))
        real_abort(rid)

    small.abort = abort  # type: ignore[method-assign]
    spec = SamplingSpec(temperature=0.0, max_tokens=10_000, ignore_eos=True)

    async def go() -> None:
        async with LocalRuntime(engines, build_policy("never", None, models)) as rt:
            server = rt.model_replicas[0]
            tasks = [asyncio.ensure_future(rt.complete([1, 2, 3], spec)) for _ in range(3)]
            await wait_until(  # every request in the small model's batch
                lambda: len(small.scheduler.running) == 3, 60, "three requests running"
            )
            late = asyncio.ensure_future(rt.complete([4, 5], spec))  # arrives mid-step
            for task in tasks:
                await asyncio.sleep(0.013)  # spread over a 40 ms step, by design
                task.cancel()  # the ingress ABORTs it everywhere: mid-step here
            await wait_until(  # the three ABORTs applied, and the late request running
                lambda: len(aborts) >= 3 and len(small.scheduler.running) == 1,
                60,
                "the aborts applied and the late request running",
            )
            late.cancel()
            await asyncio.gather(*tasks, late, return_exceptions=True)
            await rt.wait_idle()
            assert all_free(rt)
            assert server.profile.phases.get("receive_ahead", 0.0) > 0

    asyncio.run(go())
    cancelled = [rid for rid, _ in aborts]
    assert len(cancelled) >= 4  # the three, and the late one
    assert not [rid for rid, in_step in aborts if in_step]  # none while its step ran
