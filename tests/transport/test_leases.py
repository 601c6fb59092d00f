"""Directory registrations as leases: an endpoint that stops heartbeating disappears, the
peer book reports it lost, and one that heartbeats stays."""

from __future__ import annotations

import pytest

from deployments.peers import PeerBook
from tests.clock import FakeClock
from tests.waiting import wait_until
from tokenrouter_ray.transport import InMemoryDirectory
from tokenrouter_ray.transport.base import Endpoint


@pytest.mark.asyncio
async def test_endpoints_expire_without_heartbeats() -> None:
    clock = FakeClock()
    directory = InMemoryDirectory(ttl_s=0.2, clock=clock)
    await directory.register(Endpoint("large", "a", "ipc:///tmp/a"))
    assert [e.name for e in await directory.endpoints()] == ["large/a"]
    for _ in range(8):  # other peers keep calling; "large/a" never heartbeats
        clock.sleep(0.05)
        await directory.endpoints()
    assert await directory.endpoints() == [] and await directory.get("large/a") is None
    await directory.register(Endpoint("large", "a", "ipc:///tmp/a"))  # it came back
    assert await directory.get("large/a") is not None


@pytest.mark.asyncio
async def test_a_stalled_directory_does_not_expire_everyone() -> None:
    clock = FakeClock()
    directory = InMemoryDirectory(ttl_s=0.2, clock=clock)
    await directory.register(Endpoint("large", "a", "ipc:///tmp/a"))
    clock.sleep(0.3)  # nobody could reach the directory (its process stalled)
    assert [e.name for e in await directory.endpoints()] == ["large/a"]


class CountingDirectory(InMemoryDirectory):
    """An in-memory directory that counts the peer book's refreshes (its heartbeats)."""

    heartbeats = 0

    async def heartbeat(self, endpoint: Endpoint | None = None) -> list[Endpoint]:
        self.heartbeats += 1
        return await super().heartbeat(endpoint)


async def run_for(directory: CountingDirectory, clock: FakeClock, seconds: float) -> None:
    """Move the directory's clock on by ``seconds`` while a peer book refreshes: in steps
    of a sixth of a lease (a gap of half a lease between calls reads as a stalled
    directory), each followed by one of the book's refreshes. The book's own period is
    real time; the leases only see this clock, so a busy machine changes nothing."""
    assert directory.ttl_s is not None
    step = directory.ttl_s / 6
    for _ in range(round(seconds / step)):
        clock.sleep(step)
        seen = directory.heartbeats
        await wait_until(lambda n=seen: directory.heartbeats > n, 20, "the peer book's refresh")


@pytest.mark.asyncio
async def test_peer_book_heartbeats_its_own_endpoint_and_reports_lost_ones() -> None:
    clock = FakeClock()
    directory = CountingDirectory(ttl_s=0.3, clock=clock)
    small, dead = Endpoint("small", "s", "ipc:///tmp/s"), Endpoint("large", "d", "ipc:///tmp/d")
    await directory.register(small)
    await directory.register(dead)
    lost: list[set[str]] = []
    book = PeerBook(directory, ["small", "large"], period_s=0.05, own=small, on_lost=lost.append)
    await book.start(wait_for_all=True, timeout_s=5)
    assert book.missing() == [] and book.refreshing
    await run_for(directory, clock, 0.6)  # `dead` never heartbeats; `small` does, through the book
    await book.stop()
    assert lost == [{"large/d"}]
    assert book.by_model == {"small": ["small/s"], "large": []}
    assert book.missing() == ["large"]
    assert await directory.get("small/s") is not None  # two leases on: renewed by the book


@pytest.mark.asyncio
async def test_a_broken_replica_stops_heartbeating() -> None:
    clock = FakeClock()
    directory = CountingDirectory(ttl_s=0.3, clock=clock)
    own = Endpoint("large", "b", "ipc:///tmp/b")
    healthy = {"ok": True}
    book = PeerBook(directory, ["large"], period_s=0.05, own=own, alive=lambda: healthy["ok"])
    await book.start(wait_for_all=True, timeout_s=5)
    await run_for(directory, clock, 0.5)
    assert await directory.get("large/b") is not None
    healthy["ok"] = False  # e.g. its decode loop died: its lease lapses, peers recover
    await run_for(directory, clock, 0.5)
    await book.stop()
    assert await directory.get("large/b") is None


@pytest.mark.asyncio
async def test_an_excluded_endpoint_stays_out_while_listed_and_is_lost_once_gone() -> None:
    """A replica that drains: the ingress's peer book excludes it at once, a
    refresh does not list it again while its lease lasts, and it is reported lost only when
    it has left the directory."""
    directory = InMemoryDirectory()
    one, two = Endpoint("large", "1", "ipc:///tmp/1"), Endpoint("large", "2", "ipc:///tmp/2")
    for endpoint in (Endpoint("small", "s", "ipc:///tmp/s"), one, two):
        await directory.register(endpoint)
    lost: list[set[str]] = []
    book = PeerBook(directory, ["small", "large"], on_lost=lost.append)
    await book.refresh()
    assert book.by_model["large"] == ["large/1", "large/2"]
    book.exclude("large/2")
    assert book.by_model["large"] == ["large/1"]
    await book.refresh()  # still registered: still out, not lost
    assert book.by_model["large"] == ["large/1"] and lost == []
    await directory.unregister("large/2")  # it left
    await book.refresh()
    assert lost == [{"large/2"}] and book.excluded == set()
    await directory.register(two)  # a new replica under that name is a replica again
    await book.refresh()
    assert book.by_model["large"] == ["large/1", "large/2"]
