"""The socket channels used from threads, as a model replica uses them: frames sent from a
thread (``send_now``) and from the event loop to the same peer all verify and arrive in each
sender's order (signing and sending are one step under the channel's send lock, so the MAC
counters reach the receiver in order); a thread reading the channel itself (a replica's
step thread: ``receive_inline``, test_step_thread_receive.py) delivers only checked frames
and keeps going past junk and a failing callback."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import AsyncIterator, Callable

import pytest
import zmq
import zmq.asyncio

from tests.transport import handoff, wait_for
from tokenrouter_ray.metrics import Metrics
from tokenrouter_ray.protocol import PeerReq, encode_batch
from tokenrouter_ray.replica.mailbox import Mailbox
from tokenrouter_ray.replica.profile import HostProfile
from tokenrouter_ray.replica.waker import FrameWaker
from tokenrouter_ray.transport import InMemoryDirectory, UnixChannel, ZmqChannel
from tokenrouter_ray.transport.auth import FrameSigner, derive_key

KEY = derive_key(os.urandom(32))


class Received:
    """What a reading thread delivered, and on which thread."""

    def __init__(self) -> None:
        self.batches: list[list[PeerReq]] = []
        self.threads: set[str] = set()
        self.lock = threading.Lock()

    def __call__(self, batch: list[PeerReq]) -> None:
        with self.lock:
            self.batches.append(batch)
            self.threads.add(threading.current_thread().name)

    def seqs(self) -> list[int]:
        with self.lock:
            return [m.handoff_seq for b in self.batches for m in b]


class Reader:
    """A thread that reads ``channel`` itself, as a replica's step thread does
    (``receive_inline`` and a ``FrameWaker``): each frame's messages go to ``on_batch`` on
    it. Stopped (``close``) before the channel closes, as a replica's step thread is."""

    def __init__(
        self, channel: ZmqChannel, on_batch: Callable[[list[PeerReq]], None], name: str
    ) -> None:
        source = channel.receive_inline()
        assert source is not None
        self.waker = FrameWaker(source, on_batch)
        self.stop = False
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        source.inline_thread = self.thread
        self.thread.start()

    def _run(self) -> None:
        self.waker.own()
        while not self.stop:
            self.waker.clear()
            self.waker.wait(0.05)

    async def close(self) -> None:
        self.stop = True
        self.waker.set()
        await asyncio.to_thread(self.thread.join, 5)
        assert not self.thread.is_alive()
        self.waker.close()


@pytest.fixture(params=["zmq", "unix"])
def kind(request: pytest.FixtureRequest) -> str:
    """The socket channel under test: ZeroMQ (ipc), or the bare unix one, which keeps the
    same contract from threads (transport/unix_channel.py)."""
    return request.param


@contextlib.asynccontextmanager
async def small_to_large(
    kind: str = "zmq",
) -> AsyncIterator[tuple[ZmqChannel, ZmqChannel, Received]]:
    """Two channels of ``kind``, ``small/0`` and ``large/0``; the large one is read by a
    thread of its own (``Reader``) into the ``Received`` yielded with them."""
    directory = InMemoryDirectory()
    channel = UnixChannel if kind == "unix" else ZmqChannel
    received = Received()
    async with (
        channel("large", "0", directory, key=KEY) as large,
        channel("small", "0", directory, key=KEY) as small,
    ):
        reader = Reader(large, received, "large-receiver")
        try:
            yield small, large, received
        finally:
            await reader.close()


def small_mailbox(
    channel: ZmqChannel, on_undelivered: Callable[..., None] = lambda *a: None
) -> Mailbox:
    """A replica's mailbox over ``channel``, without the replica (no step thread to wake)."""
    return Mailbox("small", channel, Metrics.noop(), HostProfile(), lambda: None, on_undelivered)


@pytest.mark.asyncio
async def test_a_thread_and_the_loop_sending_to_one_peer_lose_nothing_and_keep_order(
    kind: str,
) -> None:
    async with small_to_large(kind) as (small, large, received):
        assert not small.send_now("large/0", [handoff(0)])  # not connected yet: the caller's
        await small.send("large/0", [handoff(0)])  # event-loop path connects
        n = 400
        from_thread = list(range(1, n + 1))
        from_loop = list(range(10_000, 10_000 + n))

        def thread_sends() -> None:
            for seq in from_thread:
                while not small.send_now("large/0", [handoff(seq)]):
                    threading.Event().wait(0.001)  # full for a moment: try again

        sender = threading.Thread(target=thread_sends)
        sender.start()
        for seq in from_loop:
            await small.send("large/0", [handoff(seq)])
        await asyncio.to_thread(sender.join, 30)
        await wait_for(lambda: len(received.seqs()) + sum(large.rejected.values()) >= 1 + 2 * n)
        seqs = received.seqs()
        rejected = dict(large.rejected)
    assert rejected == {}  # no counter arrived behind a later one ("replay")
    assert seqs[0] == 0
    assert [s for s in seqs if 0 < s < 10_000] == from_thread
    assert [s for s in seqs if s >= 10_000] == from_loop
    assert received.threads == {"large-receiver"}


@pytest.mark.asyncio
async def test_a_reading_thread_delivers_checked_frames_past_junk_and_a_failing_callback() -> None:
    directory = InMemoryDirectory()
    received = Received()
    failed_once = threading.Event()

    def deliver(batch: list[PeerReq]) -> None:
        if not failed_once.is_set():  # the first delivery raises: receiving goes on
            failed_once.set()
            raise RuntimeError("a consumer's bug")
        received(batch)

    large = ZmqChannel("large", "0", directory, key=KEY)
    await large.start()
    reader = Reader(large, deliver, "large-receiver")
    rogue = zmq.asyncio.Context.instance().socket(zmq.PUSH)
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.connect(large.address)
    try:
        async with ZmqChannel("small", "0", directory, key=KEY) as small:
            await small.send("large/0", [handoff(0)])  # delivered to the failing callback
            await wait_for(failed_once.is_set)
            forged = FrameSigner(derive_key(b"guessed")).sign("large/0", encode_batch([handoff(9)]))
            await rogue.send(forged)
            await rogue.send(b"\x00" * 3)
            await wait_for(lambda: sum(large.rejected.values()) == 2)
            await small.send("large/0", [handoff(1), handoff(2)])
            await wait_for(lambda: received.seqs() == [1, 2])
    finally:
        rogue.close()
        await reader.close()
        await large.close()
    assert large.rejected == {"bad_mac": 1, "malformed": 1}
    assert received.threads == {"large-receiver"}


@pytest.mark.asyncio
async def test_a_mailbox_posts_in_order_whichever_thread_sends(kind: str) -> None:
    """A replica's step thread posts: the first post to a peer not connected yet goes
    through the event loop (which connects), and every post behind it waits its turn there;
    once the loop has caught up the step thread sends its own frames. The peer gets every
    message once, in post order, and no frame is rejected."""

    undelivered: list = []
    async with small_to_large(kind) as (small, large, received):
        mailbox = small_mailbox(small, lambda lost, out: undelivered.append(lost))
        await mailbox.start()
        n = 300

        def step_thread() -> None:
            for seq in range(n):
                mailbox.post([handoff(seq)])
                if seq % 50 == 0:
                    threading.Event().wait(0.01)  # let the loop catch up now and then

        poster = threading.Thread(target=step_thread)
        poster.start()
        await asyncio.to_thread(poster.join, 30)
        await wait_for(lambda: len(received.seqs()) + sum(large.rejected.values()) >= n)
        await mailbox.stop()
        seqs, rejected = received.seqs(), dict(large.rejected)
        by_loop = mailbox._finished  # posts the event loop sent; the step thread sent the rest
    assert seqs == list(range(n))
    assert rejected == {}
    assert undelivered == []
    assert small.frames_sent == n
    assert 1 <= by_loop < n


@pytest.mark.asyncio
async def test_a_post_behind_one_the_event_loop_holds_waits_its_turn(kind: str) -> None:
    """A frame the step thread could not send (the peer full for a moment) goes through the
    event loop; every post after it goes there too until the loop has sent it, even though
    the peer takes frames again: nothing overtakes it."""

    async with small_to_large(kind) as (small, _, received):
        await small.send("large/0", [handoff(0)])  # connected
        mailbox = small_mailbox(small)
        await mailbox.start()
        send_now, full = small.send_now, threading.Event()
        full.set()

        def once_full(dst: str, msgs: list[PeerReq]) -> bool:
            if full.is_set():  # the first frame finds the peer full
                full.clear()
                return False
            return send_now(dst, msgs)

        small.send_now = once_full  # type: ignore[method-assign]
        loop = asyncio.get_running_loop()
        blocked = threading.Event()

        def hold_the_loop() -> None:  # the event loop busy while the step thread posts
            blocked.set()
            threading.Event().wait(0.3)

        def step_thread() -> None:
            loop.call_soon_threadsafe(hold_the_loop)
            blocked.wait(5)
            for seq in range(1, 21):
                mailbox.post([handoff(seq)])

        poster = threading.Thread(target=step_thread)
        poster.start()
        await asyncio.to_thread(poster.join, 30)
        await wait_for(lambda: len(received.seqs()) >= 21)
        await mailbox.stop()
    assert received.seqs() == list(range(21))
