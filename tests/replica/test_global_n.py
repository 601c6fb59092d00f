"""Every model replica knows the true global N: with two ingress replicas
and two replicas of the large model, each model's N follows arrivals and completions at
both ingresses, down to 0, within a message delay; a silent (dead) ingress stops counting."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.waiting import wait_until
from tokenrouter_ray.ingress import core as ingress_module
from tokenrouter_ray.ingress.core import IngressCore
from tokenrouter_ray.protocol import MsgKind, PeerReq, SamplingSpec
from tokenrouter_ray.replica import requests as requests_module
from tokenrouter_ray.replica.step import Replica
from tokenrouter_ray.routing.policy import build_policy
from tokenrouter_ray.simulation.backend import sim_engine
from tokenrouter_ray.transport.base import InMemoryDirectory, endpoint_name
from tokenrouter_ray.transport.inproc import InProcChannel, InProcHub

MODELS = ["small", "large"]
LONG = SamplingSpec(temperature=0.0, max_tokens=100_000, ignore_eos=True)


class Cluster:
    """small/0, large/0, large/1 and two ingresses on one in-process hub."""

    def __init__(self) -> None:
        self.servers: list[Replica] = []
        self.ingresses: list[IngressCore] = []

    async def __aenter__(self) -> Cluster:
        hub, directory = InProcHub(), InMemoryDirectory()
        policy = build_policy("bernoulli", {"p": 0.3}, MODELS)
        for index, (model, replica) in enumerate([("small", "0"), ("large", "0"), ("large", "1")]):
            channel = InProcChannel(model, replica, directory, hub)
            await channel.start()
            # Thresholds that defer on a large N: a stale N would hold launches back.
            engine = sim_engine(lambda b: 0.002, batch_thresholds=[1, 1, 1, 2, 2, 3])
            server = Replica(
                MODELS,
                min(index, 1),
                engine,
                policy,
                channel,
                pick_endpoint=lambda model, rid: (
                    endpoint_name(model, str(hash(rid) % 2))
                    if model == "large"
                    else endpoint_name(model, "0")
                ),
            )
            await server.start()
            self.servers.append(server)
        endpoints = [s.endpoint for s in self.servers]
        for k in range(2):
            channel = InProcChannel("ingress", str(k), directory, hub)
            await channel.start()
            core = IngressCore(channel, lambda: endpoints[0], lambda: endpoints)
            await core.start()
            self.ingresses.append(core)
        return self

    async def __aexit__(self, *exc: object) -> None:
        for core in self.ingresses:
            await core.stop()
            await core.channel.close()
        for server in self.servers:
            await server.stop()
            await server.channel.close()

    @property
    def truth(self) -> int:
        return sum(core.num_active for core in self.ingresses)

    async def settled(self, timeout_s: float = 20.0) -> float:
        """Seconds until every model replica's N (and its scheduler's) equals the truth."""
        start = time.monotonic()
        while True:
            seen = [
                (s.requests.active.total, s.engine.scheduler.active_requests) for s in self.servers
            ]
            if all(n == self.truth and e == self.truth for n, e in seen):
                return time.monotonic() - start
            if time.monotonic() - start > timeout_s:
                raise AssertionError(f"models see N {seen}, truth is {self.truth}")
            await asyncio.sleep(0.002)


def test_every_model_replica_tracks_the_global_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each arrival and completion reaches every replica by itself: the periodic refresh is
    switched off, so only the per-change publish can deliver the count (``settled`` fails
    after its timeout otherwise)."""
    monkeypatch.setattr(ingress_module, "ACTIVE_REFRESH_S", 3600.0)

    async def go() -> None:
        async with Cluster() as cluster:
            a, b = cluster.ingresses
            for i in range(5):  # arrivals at both ingresses
                await a.submit(f"a{i}", [1, 2, 3], LONG)
                await cluster.settled()
                await b.submit(f"b{i}", [1, 2, 3], LONG)
                await cluster.settled()
            assert cluster.truth == 10
            for i in range(5):  # completions (client aborts) at both
                await a.abort(f"a{i}")
                a.release(f"a{i}")
                await cluster.settled()
            for i in range(5):
                await b.abort(f"b{i}")
                b.release(f"b{i}")
                await cluster.settled()
            assert cluster.truth == 0  # the drop to 0 reaches every replica
            # A request that finishes on its own (max_tokens) is a completion too.
            await a.submit("short", [1, 2], SamplingSpec(temperature=0.0, max_tokens=4))
            await cluster.settled()
            done = await a.result("short")
            assert done.finish_reason == "length" and len(done.token_ids) == 4
            await cluster.settled()
            assert all(s.requests.active.total == 0 for s in cluster.servers)

    asyncio.run(go())


def _recording(core: IngressCore) -> list[PeerReq]:
    """Every message ``core`` sends from now on, in order."""
    sent: list[PeerReq] = []
    send = core.channel.send

    async def recording_send(dst: str, msgs: list[PeerReq]) -> None:
        sent.extend(msgs)
        await send(dst, msgs)

    core.channel.send = recording_send  # type: ignore[method-assign]
    return sent


def test_a_burst_of_arrivals_sends_at_most_one_active_frame_per_endpoint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Eight arrivals at once: each endpoint learns the final 8, by one ACTIVE at most; the
    entry endpoint, told 8 by the last NEW, gets none. (The periodic refresh is switched
    off: a slow run must not see its ACTIVEs among the per-change ones counted here.)"""
    monkeypatch.setattr(ingress_module, "ACTIVE_REFRESH_S", 3600.0)

    async def go() -> tuple[dict[str, list[int]], str, list[int], int]:
        async with Cluster() as cluster:
            a = cluster.ingresses[0]
            sent = _recording(a)
            await asyncio.gather(*(a.submit(f"r{i}", [1, 2], LONG) for i in range(8)))
            await cluster.settled()
            actives: dict[str, list[int]] = {}
            for m in sent:
                if m.kind == MsgKind.ACTIVE:
                    actives.setdefault(m.dst, []).append(m.active_requests)
            news = [m.active_requests for m in sent if m.kind == MsgKind.NEW]
            seen = [s.requests.active.total for s in cluster.servers]
            for i in range(8):
                a.abort_nowait(f"r{i}")
                a.release(f"r{i}")
            await cluster.settled()
            assert seen == [8, 8, 8]
            return actives, cluster.servers[0].endpoint, news, len(cluster.servers)

    actives, entry, news, n_servers = asyncio.run(go())
    assert news[-1] == 8 and entry not in actives  # the NEW carried the count there
    assert len(actives) == n_servers - 1 and all(v == [8] for v in actives.values())


def test_a_completion_and_the_next_arrival_send_no_active_frame(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A closed loop's completion followed at once by the next arrival leaves the count
    where it was: no endpoint is told anything; a completion alone reaches every one. (The
    periodic refresh is switched off, as above.)"""
    monkeypatch.setattr(ingress_module, "ACTIVE_REFRESH_S", 3600.0)

    async def go() -> tuple[list[PeerReq], list[PeerReq], list[int]]:
        async with Cluster() as cluster:
            a = cluster.ingresses[0]
            await a.submit("r0", [1, 2], LONG)
            await cluster.settled()
            sent = _recording(a)
            a.abort_nowait("r0")  # completed ...
            a.release("r0")
            await a.submit("r1", [1, 2], LONG)  # ... and the client's next request
            await cluster.settled()
            # past the coalescing window: its timer fired (and found nothing changed) ...
            await wait_until(lambda: a._publish_timer is None, 20, "the coalescing timer")
            # ... and a negative check: a few turns of the loop for a send it set off to show
            await asyncio.sleep(0.05)
            swapped = [m for m in sent if m.kind == MsgKind.ACTIVE]
            sent.clear()
            a.abort_nowait("r1")
            a.release("r1")
            await cluster.settled()
            ended = [m for m in sent if m.kind == MsgKind.ACTIVE]
            return swapped, ended, [s.requests.active.total for s in cluster.servers]

    swapped, ended, seen = asyncio.run(go())
    assert swapped == []
    assert sorted(m.active_requests for m in ended) == [0, 0, 0] and seen == [0, 0, 0]


def test_a_silent_ingress_stops_counting(monkeypatch: pytest.MonkeyPatch) -> None:
    """b goes silent: every model replica drops its count; a, which keeps refreshing its own
    well inside the silence (as production's 1 s refresh does inside 10 s), keeps its
    entry, its count and its request throughout."""
    monkeypatch.setattr(ingress_module, "ACTIVE_REFRESH_S", 0.1)
    monkeypatch.setattr(requests_module, "INGRESS_SILENCE_S", 1.5)

    async def go() -> tuple[list[int], list[list[str]], list[str], bool]:
        async with Cluster() as cluster:
            a, b = cluster.ingresses
            await a.submit("a", [1, 2], LONG)
            await b.submit("b", [1, 2], LONG)
            await cluster.settled()
            await b.stop()  # b's replica dies: its count of 1 is never refreshed
            await wait_until(
                lambda: all(
                    b.channel.name not in s.requests.active.ingresses() for s in cluster.servers
                ),
                30,
                "every model replica dropping the silent ingress",
            )
            seen = [s.requests.active.total for s in cluster.servers]
            heard = [s.requests.active.ingresses() for s in cluster.servers]
            kept = any("a" in s.requests.tracked for s in cluster.servers)  # not ended as orphaned
            await a.abort("a")
            a.release("a")
            return seen, heard, [a.channel.name], kept

    seen, heard, live, kept = asyncio.run(go())
    assert seen == [1, 1, 1]  # b's 1 is gone, a's 1 counts
    assert heard == [live] * 3  # the live ingress's entry survived on every replica
    assert kept


def test_models_end_the_requests_of_a_silent_ingress(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ingress_module, "ACTIVE_REFRESH_S", 0.1)  # a live ingress: 10 per s
    monkeypatch.setattr(requests_module, "INGRESS_SILENCE_S", 1.5)

    async def go() -> tuple[bool, bool]:
        async with Cluster() as cluster:
            a, b = cluster.ingresses
            await a.submit("a", [1, 2], LONG)
            await b.submit("b", [1, 2], LONG)
            await cluster.settled()
            held_before = any("b" in s.requests.tracked for s in cluster.servers)
            assert a.health_problem() is None and b.health_problem() is None
            await b.stop()  # b's replica dies: nobody will read request b again
            assert "stopped" in (b.health_problem() or "")  # what its check_health raises

            def b_gone() -> bool:
                return all("b" not in s.requests.tracked and "b" not in s.engine.requests
                           for s in cluster.servers)  # fmt: skip

            await wait_until(b_gone, 30, "request b ended on every model")
            gone = b_gone()
            kept = any("a" in s.requests.tracked for s in cluster.servers)  # a's request goes on
            await a.abort("a")
            a.release("a")
            return held_before and gone, kept

    assert asyncio.run(go()) == (True, True)
