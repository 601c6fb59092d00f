"""A replica that leaves on purpose (Serve's scale-down, a rolling update) drains first:
it tells the ingress, which stops placing requests there and re-creates
every request that may be on it on the model's other replicas from its committed sequence;
the old copies are ABORTed there, so its KV empties before it stops. Nothing fails, hangs
or changes: greedy output equals an undisturbed run."""

from __future__ import annotations

import asyncio
import time

from tests.local.test_protocol_runtime import all_free
from tests.tiny_models import chain_engines
from tests.waiting import wait_until
from tokenrouter_ray.ingress.recovery import Recovery
from tokenrouter_ray.protocol import MsgKind, SamplingSpec
from tokenrouter_ray.routing.policy import build_policy
from tokenrouter_ray.simulation.backend import ReplicatedRuntime
from tokenrouter_ray.transport.base import endpoint_name

TWO = ["small", "large"]
SPEC = SamplingSpec(temperature=0.0, max_tokens=48, seed=3, ignore_eos=True)


def prompts(n: int) -> list[list[int]]:
    return [[(7 * i + j) % 120 + 1 for j in range(3 + i % 4)] for i in range(n)]


def replicated(chain_dirs: dict[str, str], small: int, large: int) -> ReplicatedRuntime:
    engines = {
        name: [e for _, e in chain_engines(chain_dirs, [name] * count)]
        for name, count in (("small", small), ("large", large))
    }
    policy = build_policy("bernoulli", {"p": 0.4}, TWO)
    return ReplicatedRuntime([(name, engines[name]) for name in TWO], policy)


async def undisturbed(chain_dirs: dict[str, str], batch: list[list[int]]) -> list[list[int]]:
    """The batch's outputs on one small and two large replicas, nothing disturbed."""
    async with replicated(chain_dirs, 1, 2) as rt:
        want = [c.token_ids for c in await rt.complete_all(batch, SPEC)]
        await rt.wait_idle()
    return want


def slow(server, seconds: float) -> None:  # type: ignore[no-untyped-def]
    runner, real = server.engine.runner, server.engine.runner.launch

    def launch(out, timings):  # type: ignore[no-untyped-def]
        time.sleep(seconds)  # a slower device step
        return real(out, timings)

    runner.launch = launch


def test_a_draining_replica_moves_every_request_and_outputs_stay_exact(chain_dirs) -> None:
    """Two replicas of the large model; one drains while requests run on both (some in
    its step, some paused there while the small model writes, some not arrived yet): it
    ends holding nothing, its KV all free, the ingress moved its requests (and only
    those), and every output equals the undisturbed run's."""
    batch = prompts(8)

    async def go() -> None:
        want = await undisturbed(chain_dirs, batch)
        async with replicated(chain_dirs, 1, 2) as rt:
            for server in rt.model_replicas:
                slow(server, 0.01)  # long enough that the drain lands mid-generation
            leaving = endpoint_name("large", "1")
            server = next(s for s in rt.model_replicas if s.endpoint == leaving)
            tasks = [asyncio.ensure_future(rt.complete(p, SPEC)) for p in batch]
            await wait_until(
                lambda: bool(server.requests.tracked), 60, "requests on the leaving replica"
            )
            held = set(server.requests.tracked)
            left = await rt.drain(leaving, timeout_s=30)
            assert left == 0 and not server.requests.tracked
            pool = server.engine.kv.pool
            assert pool.num_free_blocks == pool.num_blocks  # its KV freed before it stopped
            assert leaving not in rt.replicas["large"]
            got = await asyncio.wait_for(asyncio.gather(*tasks), 120)
            assert [c.token_ids for c in got] == want
            assert all(c.error is None and c.finish_reason == "length" for c in got)
            moved = sum(c.recreated for c in got)
            assert moved >= len({rid.split("~")[0] for rid in held})
            assert moved < len(batch) or len(held) == len(batch)  # only those that could be there
            others = [s for s in rt.model_replicas if s is not server]
            await wait_until(  # the finished requests' state leaves the other replicas too
                lambda: all(
                    s.engine.kv.pool.num_free_blocks == s.engine.kv.pool.num_blocks
                    and not s.requests.tracked
                    for s in others
                ),
                30,
                "the other replicas freeing every request",
            )

    asyncio.run(go())


def test_drain_tells_the_ingresses_it_has_heard_from_and_waits_for_nothing_idle(
    chain_dirs,
) -> None:
    """An idle replica drains at once; its DRAIN goes to the ingress it heard ACTIVE counts
    from (a replica knows no other way to reach an ingress that placed a request there not
    yet arrived)."""

    async def go() -> None:
        async with replicated(chain_dirs, 1, 2) as rt:
            await rt.complete_all(prompts(2), SPEC)  # the ingress's ACTIVE counts arrive
            await rt.wait_idle()
            leaving = rt.model_replicas[-1]
            seen: list[tuple[str, MsgKind]] = []
            real = leaving.channel.send

            async def send(dst, msgs):  # type: ignore[no-untyped-def]
                seen.extend((dst, m.kind) for m in msgs)
                await real(dst, msgs)

            leaving.channel.send = send
            t0 = time.monotonic()
            assert await leaving.drain(timeout_s=30) == 0
            assert time.monotonic() - t0 < 5
            assert (rt.ingress.channel.name, MsgKind.DRAIN) in seen
            await wait_until(  # the ingress applies the DRAIN
                lambda: leaving.endpoint not in rt.replicas["large"], 30, "the replica unlisted"
            )
            got = await rt.complete_all(prompts(3), SPEC)  # served by the replicas left
            assert all(c.error is None for c in got)
            assert not leaving.requests.tracked
            await rt.wait_idle()
            assert all_free(rt)

    asyncio.run(go())


def test_a_handoff_to_a_replica_that_left_recreates_the_request_exactly(chain_dirs) -> None:
    """A replica left without draining (killed, or its drain raced a handoff) while the
    ingress still lists it: requests placed there start on the entry model, whose first
    handoff there cannot be delivered. The model ends each such request naming the peer
    (``FinishSummary.lost_peer``) and the ingress, told the peer has gone, re-creates it on
    the replica left instead of failing it: every output equals an undisturbed run's."""
    batch = prompts(6)

    async def go() -> None:
        want = await undisturbed(chain_dirs, batch)
        async with replicated(chain_dirs, 1, 2) as rt:
            gone = endpoint_name("large", "1")
            server = next(s for s in rt.model_replicas if s.endpoint == gone)
            await server.stop()
            await server.channel.close()
            reports: list[tuple[str, str]] = []
            recovery = Recovery(
                rt.ingress,
                lambda: [],
                lambda rid: rt.placement.replace(rid, ["large"]),
                timeout_s=30,
            )

            def on_peer_lost(rid: str, wire_rid: str, endpoint: str, error: str) -> None:
                reports.append((rid, endpoint))
                if endpoint in rt.replicas["large"]:  # the directory drops it
                    rt.replicas["large"].remove(endpoint)
                    rt.placement.forget(endpoint)
                recovery.lost({endpoint})

            rt.ingress.on_peer_lost = on_peer_lost
            got = await asyncio.wait_for(rt.complete_all(batch, SPEC), 120)
            assert [c.token_ids for c in got] == want
            assert all(c.error is None for c in got)
            assert reports and {endpoint for _, endpoint in reports} == {gone}
            assert sum(c.recreated for c in got) >= len({rid for rid, _ in reports})
            await recovery.wait()

    asyncio.run(go())
