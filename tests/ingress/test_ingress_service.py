"""``IngressServer``'s replica upkeep without Ray: built with its public constructor from
injected parts (a peer view, a channel, the tuner's and the models' callables), it follows
the tuner's SLO cap, answers ``/health`` 503 while a model has no replica, raises from
``check_health`` while its loops are down, refuses requests while a model is missing, and
hands lost replicas to recovery, which re-places the requests by the placement rule."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.openai.ingress_app import FakeChannel, FakeCore, FakePeers, fake_config, fake_ingress
from tests.waiting import wait_until
from tokenrouter_ray.ingress.http_app import build_app
from tokenrouter_ray.ingress.openai_server import IngressServer
from tokenrouter_ray.metrics import Metrics
from tokenrouter_ray.openai.errors import NotFoundError, ServiceUnavailableError
from tokenrouter_ray.openai.generation_defaults import GenerationDefaults
from tokenrouter_ray.transport.base import InMemoryDirectory
from tokenrouter_ray.transport.inproc import InProcChannel, InProcHub

INFO = SimpleNamespace(max_model_len=64, vocab_size=50)  # what a ReplicaInfo carries


class AsJson(dict):
    """A status as a Ray handle returns it: a struct written as JSON by ``to_json``."""

    def to_json(self) -> dict[str, Any]:
        return dict(self)


class Tokenizer:
    """What the service reads of a tokenizer before any request: its size."""

    def __len__(self) -> int:
        return 40

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) % 40 for c in text]


def service(
    core: Any = None, channel: Any = None, peers: Any = None, **kwargs: Any
) -> IngressServer:
    tuner = kwargs.pop("tuner", None)
    return fake_ingress(
        Tokenizer(),
        core=core if core is not None else FakeCore([1, 2, 3]),
        peers=peers,
        channel=channel,
        cfg=fake_config(tuner, **kwargs.pop("ingress", {})),
        infos=[INFO, SimpleNamespace(max_model_len=32, vocab_size=60)],
        **kwargs,
    )


def test_limits_and_caps_come_from_the_config_and_the_models() -> None:
    s = service(ingress={"max_active_requests": 7, "num_replicas": 2, "admission_queue": 3})
    assert s.limits.max_model_len == 32  # the shortest model
    assert s.limits.vocab_size == 40  # the tokenizer is smaller than both vocabularies
    assert s.limits.structured_outputs  # real models
    assert s.cap.limit == 7 and s.admission.max_waiting == 3
    assert s.max_body_bytes == 8 << 20
    assert s.has_room(6) and not s.has_room(7)


def test_the_slo_cap_follows_the_tuner_and_stops_with_the_service() -> None:
    answers = [10, RuntimeError("tuner restarting"), 3]
    polls: list[int | None] = []

    async def admission_cap() -> int | None:
        polls.append(s.cap.slo)
        if not answers:
            return 3
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    s = service(
        tuner={"enabled": True, "min_tokens_per_s": 100.0, "period_s": 0.001},
        ingress={"max_active_requests": 64, "num_replicas": 2},
        admission_cap=admission_cap,
    )

    async def go() -> None:
        assert s.cap.limit == 64
        await s.open()
        await wait_until(lambda: len(polls) >= 5, 20, "five polls of the tuner")
        assert s.cap.limit == 2  # ceil(3 / 2): this replica's share
        await s.close()
        n = len(polls)
        assert s._slo is not None and s._slo.done()
        # A negative check besides: ten of its periods, and no poll
        await asyncio.sleep(0.01)
        assert len(polls) == n  # the loop stopped with the service

    asyncio.run(go())
    assert polls[:4] == [None, 5, 5, 2]  # 10 -> 5 each; a failed poll keeps 5; 3 -> 2


def test_without_slo_mode_the_tuner_is_not_polled() -> None:
    async def admission_cap() -> int:
        raise AssertionError("polled")

    s = service(tuner={"enabled": True, "period_s": 0.001}, admission_cap=admission_cap)

    async def go() -> None:
        await s.open()
        # A negative check: ten of the tuner's periods, in which nothing may poll it
        await asyncio.sleep(0.01)
        assert s._slo is None and s.cap.limit == 256
        await s.close()

    asyncio.run(go())


def test_health_is_503_while_a_model_has_no_replica_and_requests_are_refused() -> None:
    peers = FakePeers()
    s = service(peers=peers)
    http = TestClient(build_app(s), raise_server_exceptions=False)
    assert http.get("/health").json() == {"status": "ok"}
    peers.by_model["large"] = []
    r = http.get("/health")
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json() == {"status": "unavailable", "models_without_replica": ["large"]}
    assert s.unavailable() == "large"
    body = {"model": "tokenrouter", "prompt": [1, 2], "max_tokens": 2}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 503 and r.json()["error"]["code"] == "model_unavailable"
    peers.by_model["large"] = ["large#1"]
    peers.refreshing = False  # the view is stale: not healthy either
    assert http.get("/health").status_code == 503
    peers.refreshing = True
    assert http.get("/health").json() == {"status": "ok"} and s.unavailable() is None


def test_check_health_raises_while_the_core_is_down() -> None:
    async def go() -> None:
        hub, directory = InProcHub(), InMemoryDirectory()
        channel = InProcChannel("ingress", "0", directory, hub)
        await channel.start()
        s = IngressServer(  # the default core: a real IngressCore over the channel
            fake_config(), channel, FakePeers(), Tokenizer(), [INFO, INFO],
            metrics=Metrics.noop(), generation_defaults=GenerationDefaults(),
        )  # fmt: skip
        with pytest.raises(RuntimeError, match="not started"):
            s.check_health()
        await s.open()
        s.check_health()  # running: no problem
        await s.close()
        with pytest.raises(RuntimeError):
            s.check_health()

    asyncio.run(go())


def test_stats_and_tuner_status_use_the_injected_callables() -> None:
    async def small() -> AsJson:
        return AsJson(requests=1)

    async def large() -> dict[str, Any]:
        raise ConnectionError("replica gone")

    async def tuner() -> AsJson:
        return AsJson(thresholds={})

    s = service(model_status={"small": small, "large": large})

    async def go() -> None:
        stats = await s.stats()
        assert stats["models"] == {
            "small": {"requests": 1},
            "large": {"error": "ConnectionError('replica gone')"},
        }
        assert stats["endpoints"] == {"small": ["small#0"], "large": ["large#0"]}
        with pytest.raises(NotFoundError):
            await s.tuner_status()
        assert await service(tuner_status=tuner).tuner_status() == {"thresholds": {}}

    asyncio.run(go())


def test_a_lost_replica_is_recovered_on_the_replicas_the_placement_keeps_or_picks() -> None:
    class Peers(FakePeers):
        def __init__(self) -> None:
            super().__init__()
            self.by_model = {"small": ["small#0"], "large": ["large#0", "large#1"]}

    class Core(FakeCore):
        recreated: list[dict[str, str]]

        async def recreate(self, endpoints: Any, reason: str, lost: set[str]) -> int:
            placed = [dict(endpoints(rid)) for rid in sorted(self.live)]
            self.recreated.extend(placed)
            return len(placed)

    peers, channel, core = Peers(), FakeChannel(), Core([1, 2, 3])
    core.recreated = []
    forgotten: list[str] = []
    channel.forget_peer = forgotten.append  # type: ignore[method-assign]
    s = service(core=core, channel=channel, peers=peers)

    async def go() -> None:
        prompts = {f"r{i}": [i] * 40 for i in range(4)}
        for rid, prompt in prompts.items():
            s.placement.place(rid, ["small", "large"], prompt)
            core.live[rid] = (prompt, None)
        before = {rid: s.placement.placed(rid)["large"] for rid in prompts}
        assert sorted(before.values()) == ["large#0", "large#0", "large#1", "large#1"]
        peers.by_model["large"] = ["large#1"]  # large#0 died
        s.on_lost({"large#0"})
        assert s.unavailable() == "being recovered"
        with pytest.raises(ServiceUnavailableError):
            await s.submit(SimpleNamespace(sampling=SimpleNamespace(n=1), routing=None))  # type: ignore[arg-type]
        await s.recovery.wait()
        assert forgotten == ["large#0"]
        assert [p["large"] for p in core.recreated] == ["large#1"] * 4
        assert s.recovery.log[0]["recreated"] == 4
        assert s.placement.load_of("large") == {"large#0": 0, "large#1": 4}

    asyncio.run(go())


def test_a_request_ended_by_an_unreachable_peer_is_recreated_once_the_peer_has_left(
    monkeypatch,
) -> None:
    """A model ended a request because its HANDOFF could not reach a peer replica
    (``on_peer_lost``): once the peer view no longer lists that replica, its requests go to
    recovery (re-created from their committed sequence); a replica still listed after the
    settle time is alive, and the request fails with the model's error."""
    monkeypatch.setattr("tokenrouter_ray.ingress.openai_server.PEER_LOSS_SETTLE_S", 0.3)

    class Peers(FakePeers):
        def __init__(self) -> None:
            super().__init__()
            self.by_model = {"small": ["small#0"], "large": ["large#0", "large#1"]}

    class Core(FakeCore):
        def __init__(self) -> None:
            super().__init__([1, 2, 3])
            self.recreated: list[set[str]] = []
            self.failed: list[tuple[str, str]] = []

        async def recreate(self, endpoints: Any, reason: str, lost: set[str]) -> int:
            self.recreated.append(lost)
            return 1

        def fail_wire(self, wire_rid: str, error: str, kind: str = "model") -> None:
            self.failed.append((wire_rid, error))

    peers, core = Peers(), Core()
    s = service(core=core, peers=peers)

    async def go() -> None:
        s.on_peer_lost("r1", "r1", "large#0", "peer large#0 unreachable")
        await asyncio.sleep(0)  # one turn: the settling task starts
        assert core.recreated == [] and core.failed == []  # still listed: settling
        peers.by_model["large"] = ["large#1"]  # its lease ran out
        await wait_until(lambda: not s._moving, 20, "the settling done")
        await s.recovery.wait()
        assert core.recreated == [{"large#0"}] and core.failed == []

        s.on_peer_lost("r2", "r2~1", "large#1", "peer large#1 unreachable")
        await wait_until(lambda: not s._moving, 20, "the settling done")  # listed throughout
        assert core.failed == [("r2~1", "peer large#1 unreachable")]
        assert core.recreated == [{"large#0"}]

    asyncio.run(go())
