"""RayChannel and RayDirectory on a real local Ray cluster: driver <-> echo actors."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
import pytest_asyncio
import ray

from tests.transport import handoff, recv_n, wait_for
from tokenrouter_ray.protocol import PeerReq
from tokenrouter_ray.transport import ChannelClosed, PeerUnreachableError, UnknownPeerError
from tokenrouter_ray.transport.ray_channel import RayChannel, RayDirectory

pytestmark = pytest.mark.asyncio

NAMESPACE = "tokenrouter-tests"


@ray.remote(num_cpus=0)
class Echo:
    """Hosts a RayChannel and sends every batch back to its source."""

    def __init__(self, directory: RayDirectory, model: str) -> None:
        self.directory, self.model = directory, model

    async def start(self) -> str:
        self.channel = RayChannel(self.model, "0", self.directory)
        await self.channel.start()
        self.loop = asyncio.create_task(self.echo())
        return self.channel.address

    async def echo(self) -> None:
        async for batch in self.channel:
            back = [msgspec.structs.replace(m, src=m.dst, dst=m.src) for m in batch]
            await self.channel.send(back[0].dst, back)

    async def stop(self) -> None:
        await self.channel.close()
        await self.loop


@pytest.fixture(scope="module")
def directory(ray_cluster: Any) -> RayDirectory:
    return RayDirectory.get_or_create(name="test-directory")


@pytest_asyncio.fixture
async def driver(directory: RayDirectory) -> AsyncIterator[RayChannel]:
    channel = RayChannel("driver", "0", directory)
    await channel.start()
    yield channel
    await channel.close()


async def start_echo(directory: RayDirectory, model: str) -> Any:
    name = f"echo-{model}"
    echo = Echo.options(name=name, namespace=NAMESPACE).remote(directory, model)
    address = await echo.start.remote()
    assert address.startswith("ray-actor:")
    return echo


async def test_round_trip_in_order_and_batched(driver: RayChannel, directory: RayDirectory) -> None:
    model = "large"
    echo = await start_echo(directory, model)
    dst = f"{model}/0"
    sent = [handoff(seq, src="driver/0", dst=dst) for seq in range(300)]
    for m in sent[:-3]:  # fast, un-awaited calls: the actor may run them out of order
        await driver.send(dst, [m])
    await driver.send(dst, sent[-3:])  # one batch
    batches = await recv_n(driver, len(sent), timeout_s=30)
    assert batches[-1] == [echoed(m) for m in sent[-3:]]
    assert [m for b in batches for m in b] == [echoed(m) for m in sent]
    await echo.stop.remote()
    assert await directory.get(dst) is None
    ray.kill(echo)


def echoed(m: PeerReq) -> PeerReq:
    return msgspec.structs.replace(m, src=m.dst, dst=m.src)


async def test_a_destination_resolved_again_keeps_receiving(
    driver: RayChannel, directory: RayDirectory
) -> None:
    """After a failed delivery the channel forgets a destination and resolves it again: the
    frames sent then must arrive, not be taken for duplicates of the earlier sequence."""
    echo = await start_echo(directory, "again")
    dst = "again/0"
    first = [handoff(seq, src="driver/0", dst=dst) for seq in range(5)]
    for m in first:
        await driver.send(dst, [m])
    assert [m for b in await recv_n(driver, 5, timeout_s=30) for m in b] == [
        echoed(m) for m in first
    ]
    driver._targets.pop(dst)  # as after a delivery that raised
    driver.forget_peer(dst)
    later = [handoff(seq, src="driver/0", dst=dst) for seq in range(5, 8)]
    for m in later:
        await driver.send(dst, [m])
    got = [m for b in await recv_n(driver, 3, timeout_s=30) for m in b]
    assert got == [echoed(m) for m in later]
    await echo.stop.remote()
    ray.kill(echo)


async def test_unknown_destination(driver: RayChannel) -> None:
    with pytest.raises(UnknownPeerError, match="'ghost/0'"):
        await driver.send("ghost/0", [handoff(0)])


async def test_dead_peer_is_reported(directory: RayDirectory) -> None:
    echo = await start_echo(directory, "doomed")
    async with RayChannel("sender", "0", directory, max_in_flight=1) as sender:
        await sender.send("doomed/0", [handoff(0)])
        ray.kill(echo)  # dies without unregistering
        with pytest.raises(PeerUnreachableError, match="doomed/0"):
            for seq in range(1, 50):
                await sender.send("doomed/0", [handoff(seq)])
                await asyncio.sleep(0.05)
    await directory.unregister("doomed/0")


async def test_close_is_clean(directory: RayDirectory) -> None:
    channel = RayChannel("closing", "0", directory)
    await channel.start()
    inbox_name = channel.address.split(":", 3)[3]
    pending = asyncio.create_task(channel.recv())
    queue = channel._queue._queue  # the frame queue's asyncio.Queue
    await wait_for(lambda: bool(queue._getters), 20, "recv waiting on the empty queue")
    await channel.close()
    with pytest.raises(ChannelClosed):
        await asyncio.wait_for(pending, 2.0)
    assert await directory.get("closing/0") is None

    def inbox_gone() -> bool:
        try:
            ray.get_actor(inbox_name, namespace="tokenrouter")
        except ValueError:
            return True
        return False

    await wait_for(inbox_gone, 30, "the inbox actor going away after close")


async def test_a_heartbeat_renews_its_lease_and_lists_everyone_in_one_call(
    directory: RayDirectory,
) -> None:
    """The peer book's refresh: one call to the directory actor registers the caller and
    returns every endpoint (a refresh without an endpoint only lists)."""
    from tokenrouter_ray.transport.base import Endpoint

    mine = Endpoint(model="beat", replica="0", address="ipc:///nowhere")
    listed = await directory.heartbeat(mine)
    assert mine.name in [e.name for e in listed]
    assert [e.name for e in listed] == sorted(e.name for e in listed)
    assert [e.name for e in await directory.heartbeat()] == [e.name for e in listed]
    await directory.unregister(mine.name)
    assert mine.name not in [e.name for e in await directory.heartbeat()]
