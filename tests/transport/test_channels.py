"""The PeerChannel contract, run against inproc, ZeroMQ ipc://, ZeroMQ tcp://127.0.0.1 and the
unix (SOCK_SEQPACKET) channel."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import pytest_asyncio
import zmq
import zmq.asyncio

from tests.transport import handoff, recv_n
from tokenrouter_ray.config import ZmqSpec
from tokenrouter_ray.protocol import MsgKind
from tokenrouter_ray.transport import (
    ChannelClosed,
    InMemoryDirectory,
    InProcChannel,
    InProcHub,
    PeerChannel,
    UnixChannel,
    UnknownPeerError,
    ZmqChannel,
)
from tokenrouter_ray.transport.base import InOrder

MakeChannel = Callable[[str, str], Awaitable[PeerChannel]]


@pytest_asyncio.fixture(params=["inproc", "zmq-ipc", "zmq-tcp", "unix"])
async def make_channel(request: pytest.FixtureRequest) -> AsyncIterator[MakeChannel]:
    """Builds started channels of one kind sharing one directory; closes them afterwards."""
    directory, hub = InMemoryDirectory(), InProcHub()
    opened: list[PeerChannel] = []

    async def make(model: str, replica: str = "0") -> PeerChannel:
        if request.param == "inproc":
            channel: PeerChannel = InProcChannel(model, replica, directory, hub)
        elif request.param == "unix":
            channel = UnixChannel(model, replica, directory)
        else:
            transport = "ipc" if request.param == "zmq-ipc" else "tcp"
            channel = ZmqChannel(model, replica, directory, ZmqSpec(transport=transport))
        await channel.start()
        opened.append(channel)
        return channel

    yield make
    for channel in opened:
        await channel.close()


@pytest.mark.asyncio
async def test_messages_arrive_in_order(make_channel: MakeChannel) -> None:
    small, large = await make_channel("small"), await make_channel("large")
    sent = [handoff(seq) for seq in range(100)]
    for m in sent:
        await small.send("large/0", [m])
    batches = await recv_n(large, 100)
    assert [m for b in batches for m in b] == sent  # in order, every field intact


@pytest.mark.asyncio
async def test_batched_send_arrives_as_one_batch(make_channel: MakeChannel) -> None:
    small, large = await make_channel("small"), await make_channel("large")
    sent = [handoff(seq, rid=f"r{seq}") for seq in range(5)]
    await small.send("large/0", sent)
    assert await recv_n(large, 5) == [sent]


@pytest.mark.asyncio
async def test_send_grouped_makes_one_frame_per_destination(make_channel: MakeChannel) -> None:
    small, large, mid = [await make_channel(m) for m in ("small", "large", "mid")]
    msgs = [handoff(i, dst="large/0" if i % 2 else "mid/0", rid=f"r{i}") for i in range(6)]
    await small.send_grouped(msgs)
    assert await recv_n(large, 3) == [[m for m in msgs if m.dst == "large/0"]]
    assert await recv_n(mid, 3) == [[m for m in msgs if m.dst == "mid/0"]]


@pytest.mark.asyncio
async def test_many_senders_concurrently(make_channel: MakeChannel) -> None:
    receiver = await make_channel("large")
    senders = [await make_channel("small", str(i)) for i in range(4)]
    per_sender = 200

    async def blast(channel: PeerChannel) -> None:
        for seq in range(per_sender):
            await channel.send("large/0", [handoff(seq, src=channel.name)])
            if seq % 50 == 0:
                await asyncio.sleep(0)

    receiving = asyncio.create_task(recv_n(receiver, per_sender * len(senders)))
    await asyncio.gather(*(blast(s) for s in senders))
    msgs = [m for b in await receiving for m in b]
    for sender in senders:  # per-sender order holds
        seqs = [m.handoff_seq for m in msgs if m.src == sender.name]
        assert seqs == list(range(per_sender))


@pytest.mark.asyncio
async def test_send_to_unknown_destination_raises(make_channel: MakeChannel) -> None:
    small = await make_channel("small")
    await make_channel("large")
    with pytest.raises(UnknownPeerError, match=r"'nope/0'.*known: large/0, small/0"):
        await small.send("nope/0", [handoff(0)])


@pytest.mark.asyncio
async def test_close_is_clean(make_channel: MakeChannel) -> None:
    small, large = await make_channel("small"), await make_channel("large")
    await small.send("large/0", [handoff(0)])
    received: list[int] = []

    async def loop() -> None:
        async for batch in large:  # ends when the channel closes
            received.extend(m.handoff_seq for m in batch)

    task = asyncio.create_task(loop())
    for _ in range(200):
        if received:
            break
        await asyncio.sleep(0.01)
    await large.close()
    await asyncio.wait_for(task, 2.0)  # the pending recv was woken, not left hanging
    assert received == [0]
    await large.close()  # idempotent
    assert await large.directory.get("large/0") is None
    with pytest.raises(ChannelClosed):
        await large.recv()
    with pytest.raises(ChannelClosed):
        await large.send("small/0", [handoff(1)])


@pytest.mark.asyncio
async def test_unknown_kinds_of_frames_are_dropped_not_fatal() -> None:
    directory = InMemoryDirectory()
    async with ZmqChannel("large", "0", directory) as large:
        ctx = zmq.asyncio.Context.instance()
        rogue = ctx.socket(zmq.PUSH)
        rogue.setsockopt(zmq.LINGER, 0)
        rogue.connect(large.address)
        await rogue.send(b"not a frame")
        async with ZmqChannel("small", "0", directory) as small:
            await small.send("large/0", [handoff(0)])
            batches = await recv_n(large, 1)
        rogue.close()
    assert batches[0][0].kind is MsgKind.HANDOFF


@pytest.mark.asyncio
async def test_zmq_tcp_binds_configured_port_and_host() -> None:
    import socket

    import zmq

    directory = InMemoryDirectory()
    for _ in range(10):  # a port found free can be taken by another process before we bind
        with socket.socket() as probe:
            probe.bind(("0.0.0.0", 0))
            port = probe.getsockname()[1]
        config = ZmqSpec(
            transport="tcp", bind_host="0.0.0.0", advertise_host="127.0.0.1", port=port
        )
        large = ZmqChannel("large", "0", directory, config)
        try:
            await large.start()
        except zmq.ZMQError:
            await large.close()
            continue
        break
    else:
        pytest.fail("no free TCP port found in 10 tries")
    try:
        assert large.address == f"tcp://127.0.0.1:{port}"
        async with ZmqChannel("small", "0", directory, ZmqSpec(transport="tcp")) as small:
            await small.send("large/0", [handoff(3)])
            assert (await recv_n(large, 1))[0][0].handoff_seq == 3
    finally:
        await large.close()


@pytest.mark.asyncio
async def test_inproc_receiver_on_another_thread() -> None:
    """The local runtime may run model replicas on their own loops: frames cross threads."""
    import threading

    directory, hub = InMemoryDirectory(), InProcHub()
    ready, received = threading.Event(), []
    large = InProcChannel("large", "0", directory, hub)

    def serve() -> None:
        async def main() -> None:
            await large.start()
            ready.set()
            received.extend(await recv_n(large, 3))

        asyncio.run(main())

    thread = threading.Thread(target=serve)
    thread.start()
    assert await asyncio.to_thread(ready.wait, 5.0)
    async with InProcChannel("small", "0", directory, hub) as small:
        await small.send("large/0", [handoff(0)])
        await small.send("large/0", [handoff(1), handoff(2)])
    await asyncio.to_thread(thread.join, 5.0)
    assert [[m.handoff_seq for m in b] for b in received] == [[0], [1, 2]]


def test_in_order_restores_per_sender_order() -> None:
    order = InOrder()
    assert order.push("a", 1, b"a1") == []
    assert order.push("b", 0, b"b0") == [b"b0"]
    assert order.push("a", 2, b"a2") == []
    assert order.push("a", 0, b"a0") == [b"a0", b"a1", b"a2"]
    assert order.push("a", 1, b"a1") == []  # duplicate
    assert order.push("a", 3, b"a3") == [b"a3"]


@pytest.mark.asyncio
async def test_an_inproc_hub_with_a_transit_time_delivers_later_and_in_order() -> None:
    """``InProcHub(transit_s)``: a simulated network; frames arrive no sooner than that
    after their send, in the order sent."""
    import time

    directory, hub = InMemoryDirectory(), InProcHub(transit_s=0.05)
    async with (
        InProcChannel("small", "0", directory, hub) as small,
        InProcChannel("large", "0", directory, hub) as large,
    ):
        sent = time.monotonic()
        await small.send("large/0", [handoff(0)])
        await small.send("large/0", [handoff(1), handoff(2)])
        batches = await recv_n(large, 3)
        assert time.monotonic() - sent >= 0.05
    assert [[m.handoff_seq for m in b] for b in batches] == [[0], [1, 2]]
    with pytest.raises(ValueError, match="transit_s"):
        InProcHub(transit_s=-1.0)
