"""``ZmqChannel.recv`` on the event loop (the ingress's way): a plain PULL socket whose
descriptor the loop watches, one Future per wait. ZeroMQ's descriptor signals a change, not a
level, so the tests aim at the ways an edge can be lost or repeated: frames queued before the
first ``recv``, frames that arrive while nobody waits (the loop's callback takes the signal,
the next ``recv`` must still read them), a loop that must not spin on a signal nobody reads,
and a close while a ``recv`` waits."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator

import pytest

from tests.transport import handoff, recv_n, wait_for
from tokenrouter_ray.transport import ChannelClosed, InMemoryDirectory, ZmqChannel
from tokenrouter_ray.transport.auth import derive_key

KEY = derive_key(os.urandom(32))


@contextlib.asynccontextmanager
async def pair() -> AsyncIterator[tuple[ZmqChannel, ZmqChannel]]:
    directory = InMemoryDirectory()
    async with (
        ZmqChannel("large", "0", directory, key=KEY) as large,
        ZmqChannel("small", "0", directory, key=KEY) as small,
    ):
        yield small, large


def seqs(batches: list) -> list[int]:
    return [m.handoff_seq for batch in batches for m in batch]


async def drain_then_leave(channel: ZmqChannel) -> None:
    """A ``recv`` that finds the socket empty (so ZeroMQ signals the next frame) and is then
    given up: nobody waits when that signal comes."""
    waiting = asyncio.ensure_future(channel.recv())
    await wait_for(lambda: channel._waiter is not None, 20, "recv waiting for a signal")
    assert not waiting.done()
    waiting.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await waiting


def count_signals(channel: ZmqChannel) -> list[int]:
    """From now on, how many times the loop called ``channel``'s reader callback (the
    watch must be on: after a ``recv``)."""
    calls = [0]
    on_signal = channel._on_signal

    def counted() -> None:
        calls[0] += 1
        on_signal()

    assert channel._watch is not None
    loop, fd = channel._watch
    loop.remove_reader(fd)
    loop.add_reader(fd, counted)
    return calls


@pytest.mark.asyncio
async def test_frames_queued_before_and_while_nobody_waits_are_all_read() -> None:
    """Frames sent before the first ``recv`` (no watch yet), then frames that arrive while
    the receiver is busy elsewhere (the loop's callback runs with no waiter and takes the
    signal): every one is read, in order, and a ``recv`` then waits for the next one."""
    async with pair() as (small, large):
        for i in range(3):
            await small.send("large/0", [handoff(i)])
        assert seqs(await recv_n(large, 3, 5.0)) == [0, 1, 2]
        await drain_then_leave(large)
        signals = count_signals(large)
        for i in range(3, 8):  # nobody in recv: the loop sees the signal with no waiter
            await small.send("large/0", [handoff(i)])
        await wait_for(lambda: signals[0] >= 1, 20, "the loop's callback taking the signal")
        assert seqs(await recv_n(large, 5, 5.0)) == [3, 4, 5, 6, 7]
        waiting = asyncio.ensure_future(large.recv())
        await wait_for(lambda: large._waiter is not None, 20, "recv waiting for a signal")
        assert not waiting.done()  # nothing queued: it waits
        await small.send("large/0", [handoff(8)])
        assert seqs([await asyncio.wait_for(waiting, 5.0)]) == [8]


@pytest.mark.asyncio
async def test_a_signal_nobody_reads_does_not_spin_the_loop() -> None:
    """With frames queued and no ``recv`` waiting, the reader callback takes the signal once:
    the descriptor would otherwise stay readable and the loop would call it on every turn
    (a busy event loop while the ingress sleeps)."""
    async with pair() as (small, large):
        await small.send("large/0", [handoff(0)])
        await recv_n(large, 1, 5.0)  # the watch is on from here
        await drain_then_leave(large)
        calls = count_signals(large)
        for i in range(1, 4):
            await small.send("large/0", [handoff(i)])
        await wait_for(lambda: calls[0] >= 1, 20, "the loop's callback taking the signal")
        # A negative check: a loop spinning on the signal would call back thousands of
        # times in this window; it must not call again (frames after the first may still
        # land, hence a few calls at most).
        await asyncio.sleep(0.3)
        assert 1 <= calls[0] <= 6, calls
        assert seqs(await recv_n(large, 3, 5.0)) == [1, 2, 3]


@pytest.mark.asyncio
async def test_close_ends_a_waiting_recv_and_one_recv_at_a_time() -> None:
    """A second concurrent ``recv`` is refused; closing the channel ends the waiting one
    with ``ChannelClosed`` and takes the descriptor off the loop."""
    async with pair() as (_small, large):
        waiting = asyncio.ensure_future(large.recv())
        await wait_for(lambda: large._waiter is not None, 20, "recv waiting for a signal")
        with pytest.raises(RuntimeError, match="one recv at a time"):
            await large.recv()
        loop, fd = large._watch
        await large.close()
        with pytest.raises(ChannelClosed):
            await asyncio.wait_for(waiting, 5.0)
        assert large._watch is None
        assert not loop.remove_reader(fd)  # nothing was left registered
