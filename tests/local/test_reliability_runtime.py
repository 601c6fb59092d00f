"""Reliability of the runtime itself (no Ray): cancellation at random points frees every
model, a bad send or a failing route is contained to its request, deadlines end stalled
requests, and re-creating requests from the ingress's committed sequence reproduces the
undisturbed greedy output."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest
from prometheus_client import CollectorRegistry

from tests.local.test_protocol_runtime import all_free
from tests.tiny_models import chain_engines
from tests.waiting import wait_until
from tokenrouter_ray.local import LocalRuntime
from tokenrouter_ray.metrics import Metrics, PrometheusBackend
from tokenrouter_ray.protocol import SamplingSpec
from tokenrouter_ray.routing.policy import build_policy
from tokenrouter_ray.transport.base import endpoint_name

TWO = ["small", "large"]
SPEC = SamplingSpec(temperature=0.0, max_tokens=40, seed=3, ignore_eos=True)


def prompts(n: int) -> list[list[int]]:
    return [[(5 * i + j) % 120 + 1 for j in range(3 + i % 5)] for i in range(n)]


def committed(rt: LocalRuntime) -> int:
    """Tokens the ingress has committed for the requests it holds."""
    return sum(len(live.log.tokens) for live in rt.ingress.live.values())


def test_random_cancellations_free_every_model_and_leave_the_others_exact(chain_dirs) -> None:
    policy = build_policy("bernoulli", {"p": 0.4}, TWO)
    keep = prompts(4)
    rng = random.Random(7)

    async def go() -> None:
        async with LocalRuntime(chain_engines(chain_dirs, TWO), policy) as rt:
            want = [c.token_ids for c in await rt.complete_all(keep, SPEC)]
            await rt.wait_idle()
            kept = [asyncio.ensure_future(rt.complete(p, SPEC)) for p in keep]
            doomed = [asyncio.ensure_future(rt.complete(p, SPEC)) for p in prompts(120)]
            for task in rng.sample(doomed, len(doomed)):  # cancel in random order and moments
                await asyncio.sleep(rng.random() * 0.01)  # a random moment, by design
                task.cancel()
            got = await asyncio.wait_for(asyncio.gather(*kept), 120)
            await asyncio.gather(*doomed, return_exceptions=True)
            await rt.wait_idle()
            assert all_free(rt)
            assert rt.ingress.num_active == 0
            assert [c.token_ids for c in got] == want

    asyncio.run(go())


def test_an_unreachable_or_unknown_peer_fails_only_its_request(chain_dirs) -> None:
    policy = build_policy("bernoulli", {"p": 0.5}, TWO)
    registry = CollectorRegistry()
    metrics = Metrics(PrometheusBackend(registry), policy="bernoulli")

    def errors(model: str, kind: str) -> float:
        labels = {"model": model, "type": kind, "model_name": ""}
        return registry.get_sample_value("tokenrouter_errors_total", labels) or 0.0

    async def go() -> None:
        async with LocalRuntime(chain_engines(chain_dirs, TWO), policy, metrics=metrics) as rt:
            small = rt.model_replicas[0]
            real = small.pick_endpoint

            def ghost(model: str, rid: str) -> str:
                if rid == "lost":
                    return endpoint_name(model, "ghost")  # never registered
                if rid == "nowhere":
                    raise LookupError(f"no replica of {model!r} known")
                return real(model, rid)

            small.pick_endpoint = ghost
            lost, nowhere, fine = await asyncio.wait_for(
                asyncio.gather(
                    rt.complete([1, 2, 3], SPEC, "lost"),
                    rt.complete([1, 2, 3], SPEC, "nowhere"),
                    rt.complete([1, 2, 3], SPEC, "fine"),
                ),
                60,
            )
            assert lost.finish_reason == "error" and "ghost" in lost.error
            assert nowhere.finish_reason == "error" and "no replica" in nowhere.error
            assert fine.finish_reason == "length" and len(fine.token_ids) == SPEC.max_tokens
            await rt.wait_idle()
            assert all_free(rt)
            assert all(s.alive for s in rt.model_replicas)
            assert errors("small", "send_failed") >= 1  # the ghost
            assert errors("small", "request_failed") >= 1  # no replica to hand to
            assert errors("ingress", "model") == 2  # both ended with the model's error

    asyncio.run(go())


def test_a_failing_route_fails_its_batch_not_the_loop(chain_dirs, caplog) -> None:
    """The request whose ``send`` raised ends with the error, alone: it is out of the step
    launched meanwhile, so ending it does not fail that step (and the requests beside it,
    when there are any: the count below held only when there were none)."""
    policy = build_policy("bernoulli", {"p": 0.5}, TWO)

    async def go() -> None:
        async with LocalRuntime(chain_engines(chain_dirs, TWO), policy) as rt:
            real = policy.send
            calls = {"n": 0}

            def flaky(view, dst):  # type: ignore[no-untyped-def]
                calls["n"] += 1
                if calls["n"] == 3:
                    raise RuntimeError("policy bug")
                return real(view, dst)

            policy.send = flaky
            done = await asyncio.wait_for(rt.complete_all(prompts(3), SPEC), 60)
            failed = [c for c in done if c.finish_reason == "error"]
            assert len(failed) == 1 and "policy bug" in failed[0].error
            assert "step failed" not in caplog.text
            await rt.wait_idle()
            assert all_free(rt) and all(s.alive for s in rt.model_replicas)
            again = await asyncio.wait_for(rt.complete([4, 5], SPEC), 60)
            assert len(again.token_ids) == SPEC.max_tokens

    asyncio.run(go())


def test_a_stalled_model_ends_the_request_at_its_deadline(chain_dirs) -> None:
    policy = build_policy("always", {}, TWO)

    async def go() -> None:
        async with LocalRuntime(chain_engines(chain_dirs, TWO), policy) as rt:
            runner = rt.model_replicas[1].engine.runner
            real = runner.launch

            def stalled(out, timings):  # type: ignore[no-untyped-def]
                time.sleep(1.5)  # a step three times the request's deadline
                return real(out, timings)

            runner.launch = stalled
            rid = "slow"
            await rt.ingress.submit(rid, [1, 2, 3], SPEC, timeout_s=0.5)
            t0 = time.monotonic()
            done = await asyncio.wait_for(rt.ingress.result(rid), 30)
            assert time.monotonic() - t0 < 10
            assert done.finish_reason == "error" and done.error_kind == "timeout"
            runner.launch = real
            await rt.wait_idle()
            assert all_free(rt)

    asyncio.run(go())


@pytest.mark.parametrize("caching", [True, False])
def test_recreated_requests_reproduce_the_undisturbed_greedy_output(chain_dirs, caching) -> None:
    """Re-created mid-generation, with prefix caching on and off: the same tokens as an
    undisturbed run; with caching on, the re-created copies reuse the cached blocks of what
    the first copies had computed (their prompts and committed tokens)."""
    policy = build_policy("bernoulli", {"p": 0.4}, TWO)
    batch = prompts(6)

    async def go() -> None:
        async with LocalRuntime(chain_engines(chain_dirs, TWO), policy) as rt:
            want = await rt.complete_all(batch, SPEC)
        engines = chain_engines(chain_dirs, TWO, prefix_caching=caching)  # nothing cached yet
        async with LocalRuntime(engines, policy) as rt:
            tasks = [asyncio.ensure_future(rt.complete(p, SPEC)) for p in batch]
            await wait_until(lambda: committed(rt) >= 60, 60, "60 tokens committed")
            hits_before = sum(e.kv.prefix_cache_hits for _, e in engines)  # ~0: fresh
            recreated = await rt.ingress.recreate(reason="test")
            assert recreated > 0
            got = await asyncio.wait_for(asyncio.gather(*tasks), 120)
            await rt.wait_idle()
            assert all_free(rt)
            assert [c.token_ids for c in got] == [c.token_ids for c in want]
            assert [sum(c.counts.values()) for c in got] == [SPEC.max_tokens] * len(batch)
            assert sum(c.recreated for c in got) == recreated
            hits = sum(e.kv.prefix_cache_hits for _, e in engines) - hits_before
            assert (hits > 0) == caching

    asyncio.run(go())


def test_models_free_requests_whose_ingress_is_gone_after_the_deadline(
    chain_dirs, monkeypatch
) -> None:
    from tokenrouter_ray.replica import requests

    monkeypatch.setattr(requests, "EXPIRY_GRACE_S", 0.0)
    policy = build_policy("bernoulli", {"p": 0.5}, TWO)
    spec = SamplingSpec(temperature=0.0, max_tokens=200, seed=3, ignore_eos=True)

    async def go() -> None:
        async with LocalRuntime(chain_engines(chain_dirs, TWO), policy) as rt:
            runner = rt.model_replicas[1].engine.runner
            real = runner.launch

            def slow(out, timings):  # type: ignore[no-untyped-def]
                time.sleep(0.2)  # 200 tokens would take far longer than the test waits
                return real(out, timings)

            runner.launch = slow
            # (a deadline that leaves the models holding them long enough to be seen)
            for i in range(4):
                await rt.ingress.submit(f"orphan{i}", [1, 2, 3 + i], spec, timeout_s=2.0)
            rt.ingress._abort_orphan = lambda msg: None  # a dead ingress answers nothing
            for i in range(4):  # the ingress dies: nobody will ever abort them
                live = rt.ingress.live.pop(f"orphan{i}")
                rt.ingress._wire.pop(live.wire_rid)
                live.timer.cancel()  # (its deadline's timer dies with it)
            await wait_until(
                lambda: any(s.requests.tracked for s in rt.model_replicas),
                20,
                "the requests on a model",
            )
            await rt.wait_idle(timeout=10)
            assert all_free(rt)
            runner.launch = real

    asyncio.run(go())


def test_only_requests_assigned_to_a_lost_replica_are_recreated(chain_dirs) -> None:
    policy = build_policy("bernoulli", {"p": 0.4}, TWO)
    batch = prompts(4)

    async def go() -> None:
        async with LocalRuntime(chain_engines(chain_dirs, TWO), policy) as rt:
            want = await rt.complete_all(batch, SPEC)
            await rt.wait_idle()
            assigned = {"large": endpoint_name("large", "0")}
            for i, p in enumerate(batch):
                await rt.ingress.submit(f"a{i}", p, SPEC, endpoints=assigned)
            results = [asyncio.ensure_future(rt.ingress.result(f"a{i}")) for i in range(4)]
            await wait_until(lambda: committed(rt) >= 30, 60, "30 tokens committed")
            assert await rt.ingress.recreate(lost={endpoint_name("large", "9")}) == 0
            assert await rt.ingress.recreate(lost={endpoint_name("large", "0")}) > 0
            got = await asyncio.wait_for(asyncio.gather(*results), 120)
            await rt.wait_idle()
            assert all_free(rt)
            assert [c.token_ids for c in got] == [c.token_ids for c in want]

    asyncio.run(go())


def slow_steps(rt: LocalRuntime, seconds: float) -> None:
    for server in rt.model_replicas:
        runner = server.engine.runner

        def slow(out, timings, real=runner.launch):  # type: ignore[no-untyped-def]
            time.sleep(seconds)
            return real(out, timings)

        runner.launch = slow


def test_a_copy_the_ingress_no_longer_holds_is_aborted_on_every_model(chain_dirs) -> None:
    """A model still committing for a request the ingress forgot (a submission cancelled
    after its NEW was queued, say) is stopped by its next COMMIT: on every model, including
    one where the copy only waits paused (an ABORT to the sender alone would leave such a
    copy held for good over the Ray transport)."""
    policy = build_policy("bernoulli", {"p": 0.3}, TWO)
    spec = SamplingSpec(temperature=0.0, max_tokens=10_000, seed=3, ignore_eos=True)

    async def go() -> None:
        async with LocalRuntime(chain_engines(chain_dirs, TWO), policy) as rt:
            slow_steps(rt, 0.04)  # 40 ms steps: its context limit is many seconds away
            await rt.ingress.submit("stale", [1, 2, 3], spec, timeout_s=600)
            await wait_until(  # on both models
                lambda: all(s.requests.tracked for s in rt.model_replicas),
                60,
                "the request on both",
            )
            live = rt.ingress.live.pop("stale")  # the ingress forgets it
            rt.ingress._wire.pop(live.wire_rid)
            live.timer.cancel()
            await rt.wait_idle(timeout=10)  # long before its deadline or any sweep
            assert all_free(rt) and rt.ingress.orphans_aborted == 1

    asyncio.run(go())


def test_copies_on_a_replica_that_stalled_past_its_lease_are_aborted(chain_dirs) -> None:
    """The large model's replica stalls; its lease runs out (it leaves the ingress's
    endpoints) and its requests are re-created; then it answers again, still holding the
    old incarnations. Those are aborted once it reports (or reappears), nothing is left
    on any model, and the re-created requests finish equal to an undisturbed run."""
    policy = build_policy("bernoulli", {"p": 0.4}, TWO)
    batch = prompts(4)

    async def go() -> None:
        async with LocalRuntime(chain_engines(chain_dirs, TWO), policy) as rt:
            want = await rt.complete_all(batch, SPEC)
            await rt.wait_idle()
            small, large = rt.model_replicas
            armed, stalled = threading.Event(), threading.Event()
            real = large.engine.runner.launch

            def stalling(out, timings):  # type: ignore[no-untyped-def]
                if armed.is_set() and out.chunks:  # the first step with rows once armed
                    armed.clear()
                    stalled.set()  # mid-step, holding its rows: it stops answering
                while stalled.is_set():  # (a polling loop: until the test releases it)
                    time.sleep(0.01)
                return real(out, timings)

            large.engine.runner.launch = stalling
            tasks = [asyncio.ensure_future(rt.complete(p, SPEC)) for p in batch]
            await wait_until(lambda: committed(rt) >= 20, 60, "20 tokens committed")
            # Stalled from its own step thread: a stall set from here could land after the
            # large model had handed its rows back, and then it would hold none.
            armed.set()
            await wait_until(stalled.is_set, 60, "the large replica stalled")
            every = rt.ingress.all_endpoints
            rt.ingress.all_endpoints = lambda: [small.endpoint]  # its lease ran out
            old = set(rt.ingress._wire)
            assert await rt.ingress.recreate(lost={large.endpoint}) > 0
            await wait_until(  # the re-created copies run on the small model meanwhile
                lambda: bool((set(rt.ingress._wire) - old) & set(small.requests.tracked)),
                60,
                "the re-created copies on the small model",
            )
            assert old & set(large.requests.tracked)  # it still holds old incarnations
            rt.ingress.all_endpoints = every  # its heartbeat registers it again
            stalled.clear()
            got = await asyncio.wait_for(asyncio.gather(*tasks), 120)
            await rt.wait_idle(timeout=10)  # the old copies too: within a step or a refresh
            assert all_free(rt)
            assert [c.token_ids for c in got] == [c.token_ids for c in want]
            assert all(c.recreated for c in got)
            large.engine.runner.launch = real

    asyncio.run(go())
