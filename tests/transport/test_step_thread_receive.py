"""A model replica's step thread reads its ZeroMQ socket itself (``ZmqChannel.receive_inline``
and ``replica/waker.py``'s ``FrameWaker``): frames reach the waiting thread with no receiver
thread, a backlog larger than one read is read to the end although ZeroMQ announces only its
first frame, the wait keeps ``threading.Event``'s contract (set from another thread, timed
out; a GPU step's watcher ends it), junk is paced without putting the thread to sleep, a
channel is read one way only, and replicas over it give the same outputs as replicas whose
event loop reads the channel."""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import threading
import time
from collections.abc import AsyncIterator

import pytest
import zmq
import zmq.asyncio

from tests.transport import handoff, wait_for
from tokenrouter_ray.config import UnixSpec, ZmqSpec
from tokenrouter_ray.engine import device_step
from tokenrouter_ray.engine.device_step import DeviceStep, EventWatcher
from tokenrouter_ray.ingress.core import IngressCore
from tokenrouter_ray.protocol import PeerReq, SamplingSpec
from tokenrouter_ray.replica import waker as waker_module
from tokenrouter_ray.replica.step import Replica
from tokenrouter_ray.replica.waker import READ_LIMIT, FrameWaker
from tokenrouter_ray.routing.policy import build_policy
from tokenrouter_ray.simulation.backend import sim_engine
from tokenrouter_ray.transport import InMemoryDirectory, UnixChannel, ZmqChannel
from tokenrouter_ray.transport.auth import derive_key
from tokenrouter_ray.transport.base import endpoint_name

KEY = derive_key(os.urandom(32))


class Waiter:
    """A thread that owns a ``FrameWaker`` over ``channel`` and waits on it in a loop, as a
    step thread does; what it was handed, and on which thread."""

    def __init__(self, channel: ZmqChannel, wait_s: float = 5.0) -> None:
        source = channel.receive_inline()
        assert source is not None
        self.seqs: list[int] = []
        self.threads: set[str] = set()
        self.waker = FrameWaker(source, self._on_batch)
        self.wait_s, self.stop = wait_s, False
        self.thread = threading.Thread(target=self._run, name="steps", daemon=True)
        source.inline_thread = self.thread

    def _on_batch(self, batch: list[PeerReq]) -> None:
        self.seqs += [m.handoff_seq for m in batch]
        self.threads.add(threading.current_thread().name)
        self.waker.set()

    def _run(self) -> None:
        self.waker.own()
        while not self.stop:
            self.waker.clear()
            self.waker.wait(self.wait_s)

    def __enter__(self) -> Waiter:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop = True
        self.waker.set()
        self.thread.join(5)
        assert not self.thread.is_alive()
        self.waker.close()


@contextlib.asynccontextmanager
async def pair(
    kind: str = "zmq", **settings: object
) -> AsyncIterator[tuple[ZmqChannel, ZmqChannel]]:
    """``small/0`` and ``large/0`` of ``kind``: ZeroMQ (ipc), or the bare unix channel."""
    directory = InMemoryDirectory()
    channel, spec = (
        (UnixChannel, UnixSpec.model_validate(settings))
        if kind == "unix"
        else (ZmqChannel, ZmqSpec.model_validate(settings))
    )
    async with (
        channel("large", "0", directory, spec, key=KEY) as large,  # type: ignore[arg-type]
        channel("small", "0", directory, spec, key=KEY) as small,  # type: ignore[arg-type]
    ):
        yield small, large


@pytest.fixture(params=["select", "poll"])
def sleeps_in(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways a ``FrameWaker`` sleeps: ``select`` (sub-millisecond timeouts), and
    ``poll`` where a descriptor is past ``select``'s limit (made so here by a limit of 0)."""
    if request.param == "poll":
        monkeypatch.setattr(waker_module, "SELECT_LIMIT", 0)
    return request.param


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["zmq", "unix"])
async def test_frames_reach_the_waiting_thread_itself_in_order(sleeps_in: str, kind: str) -> None:
    async with pair(kind) as (small, large):
        threads_before = {t.name for t in threading.enumerate()}
        with Waiter(large) as waiter:
            for seq in range(200):
                await small.send("large/0", [handoff(seq)])
            await wait_for(lambda: len(waiter.seqs) == 200)
            started = {t.name for t in threading.enumerate()} - threads_before
        assert waiter.seqs == list(range(200))
        assert waiter.threads == {"steps"}  # read and handed on by the waiting thread
        assert started == {"steps"}  # and no receiver thread beside it
        assert large.rejected == {}


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["zmq", "unix"])
async def test_a_backlog_beyond_one_read_is_read_to_the_end_without_another_signal(
    kind: str,
) -> None:
    """ZeroMQ signals the descriptor when a frame reaches a drained socket, not per frame: a
    wait that reads ``READ_LIMIT`` frames and leaves the rest must come back for them by
    itself. Each ``wait`` below returns at once with the next ``READ_LIMIT`` (one that
    relied on the descriptor would sleep its full timeout and return False). The unix
    channel's epoll set signals edges too."""
    async with pair(kind) as (small, large):
        total = 3 * READ_LIMIT + 5
        for seq in range(total):
            await small.send("large/0", [handoff(seq)])
        source = large.receive_inline()
        assert source is not None
        got: list[int] = []
        waker = FrameWaker(source, lambda batch: (got.extend(m.handoff_seq for m in batch),
                                                  waker.set()))  # fmt: skip
        waker.own()
        try:
            deadline = time.monotonic() + 10
            while len(got) < total and time.monotonic() < deadline:  # all queued first
                await asyncio.sleep(0.05)
                if waker.poll():
                    waker.clear()
                    break
            waits: list[tuple[bool, float]] = []
            while len(got) < total:
                waker.clear()
                t0 = time.monotonic()
                woke = waker.wait(2.0)
                waits.append((woke, time.monotonic() - t0))
                assert len(waits) <= 4, waits
        finally:
            waker.close()
        assert got == list(range(total))
        assert all(woke and took < 0.5 for woke, took in waits), waits


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["zmq", "unix"])
async def test_the_wait_keeps_the_event_contract(sleeps_in: str, kind: str) -> None:
    async with pair(kind) as (_, large):
        source = large.receive_inline()
        assert source is not None
        waker = FrameWaker(source, lambda batch: None)
        assert (waker._poller is not None) == (sleeps_in == "poll")
        waker.own()
        try:
            t0 = time.monotonic()
            assert waker.wait(0.003) is False  # a sub-millisecond-precise timeout
            took = time.monotonic() - t0
            assert 0.003 <= took < 0.1, took
            threading.Timer(0.05, waker.set).start()  # from another thread
            t0 = time.monotonic()
            assert waker.wait(5.0) is True
            assert 0.04 <= time.monotonic() - t0 < 2.0
            assert waker.is_set() and waker.wait(5.0) is True  # stays set until cleared
            waker.clear()
            assert not waker.is_set() and waker.wait(0.001) is False
            # another thread's set while nobody waits: the clear drains it (no spurious wake)
            setter = threading.Thread(target=waker.set)
            setter.start()
            setter.join()
            assert waker.is_set() and select.select([waker._fd], [], [], 0)[0] == [waker._fd]
            waker.clear()
            assert select.select([waker._fd], [], [], 0)[0] == []
            # a count written after a drain (a set racing a clear) does not end a wait
            os.eventfd_write(waker._fd, 1)
            t0 = time.monotonic()
            assert waker.wait(0.05) is False
            assert time.monotonic() - t0 >= 0.05
            assert select.select([waker._fd], [], [], 0)[0] == []  # drained by the wait
        finally:
            waker.close()


class DeviceWork:
    """A device event done ``seconds`` after it was made (the GPU runner's ``done``)."""

    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds

    def query(self) -> bool:
        return time.monotonic() >= self.at

    def synchronize(self) -> None:
        time.sleep(max(0.0, self.at - time.monotonic()))  # blocks until the device is done


@pytest.mark.asyncio
async def test_a_gpu_step_wait_ends_on_the_watcher_or_on_a_frame(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The CUDA runner's ``wait_done(wake)`` over a ``FrameWaker``: the event watcher's
    ``set`` (another thread: the eventfd) ends the wait when the device is done, long before
    the runner's own bounded poll (made 5 s here) would notice; a frame arriving first ends
    it early, read and handed on."""
    monkeypatch.setattr(device_step, "WAKE_POLL_S", 5.0)
    async with pair() as (small, large):
        source = large.receive_inline()
        assert source is not None
        got: list[int] = []
        waker = FrameWaker(source, lambda batch: (got.extend(m.handoff_seq for m in batch),
                                                  waker.set()))  # fmt: skip
        watcher = EventWatcher()
        try:
            step = DeviceStep(DeviceWork(0.02), lambda: None, watcher)  # type: ignore[arg-type]
            t0 = time.monotonic()
            done = await asyncio.to_thread(lambda: (waker.own(), step.wait_done(waker))[1])
            assert done and 0.015 <= time.monotonic() - t0 < 2.0, time.monotonic() - t0

            waker.clear()
            step = DeviceStep(DeviceWork(3.0), lambda: None, watcher)  # type: ignore[arg-type]
            asyncio.get_running_loop().call_later(0.05, lambda: asyncio.ensure_future(
                small.send("large/0", [handoff(4)])))  # fmt: skip
            t0 = time.monotonic()
            done = await asyncio.to_thread(lambda: (waker.own(), step.wait_done(waker))[1])
            assert not done and got == [4] and time.monotonic() - t0 < 2.0
        finally:
            waker.close()


@pytest.mark.asyncio
async def test_junk_is_paced_without_putting_the_thread_to_sleep() -> None:
    """Past the reject budget the reader leaves the socket alone for a while; the thread's
    own waits still end on time, and an honest frame behind the junk still arrives."""
    async with pair(reject_rate=20.0) as (small, large):
        rogue = zmq.asyncio.Context.instance().socket(zmq.PUSH)
        rogue.setsockopt(zmq.LINGER, 0)
        rogue.connect(large.address)
        try:
            for _ in range(60):
                await rogue.send(b"\x00" * 8)
            # the junk is queued ahead of the honest frame (the waker's first wait reads
            # without a signal, so this look at the socket takes nothing from it)
            assert large._pull_now is not None
            pull = large._pull_now
            await wait_for(lambda: pull.getsockopt(zmq.EVENTS) & zmq.POLLIN, 30, "the junk queued")
            source = large.receive_inline()
            assert source is not None
            got: list[int] = []
            waker = FrameWaker(source, lambda batch: got.extend(m.handoff_seq for m in batch))
            waker.own()
            try:
                longest = 0.0
                await small.send("large/0", [handoff(7)])
                deadline = time.monotonic() + 5
                while not got and time.monotonic() < deadline:
                    t0 = time.monotonic()
                    waker.wait(0.01)
                    longest = max(longest, time.monotonic() - t0)
                    await asyncio.sleep(0)
                rejected = sum(large.rejected.values())
            finally:
                waker.close()
        finally:
            rogue.close()
        assert got == [7]
        assert longest < 0.2, longest  # no wait outlived its timeout by a pacer's sleep
        assert 0 < rejected < 60  # examined at the pacer's rate, not all at once


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["zmq", "unix"])
async def test_a_channel_is_read_one_way_only(kind: str) -> None:
    """``recv`` on the event loop and the step thread would race for frames: once one is in
    use, the other is refused; a channel not open is read by neither."""
    async with pair(kind) as (_, large):
        assert large.receive_inline() is not None
        with pytest.raises(RuntimeError):
            await large.recv()
    async with pair(kind) as (_, large):
        receiving = asyncio.ensure_future(large.recv())
        await wait_for(large._loop_watching, 20, "recv watching the channel")
        assert large.receive_inline() is None
        receiving.cancel()
    closed = (UnixChannel if kind == "unix" else ZmqChannel)("large", "1", InMemoryDirectory())
    assert closed.receive_inline() is None  # not open


MODELS = ["small", "large"]


async def _outputs(
    inline: bool, kind: str = "zmq"
) -> tuple[dict[str, list[int]], list[int], set[str]]:
    """Twelve greedy requests through an ingress and small/0 + large/0 replicas over ZeroMQ
    (Bernoulli routing: handoffs both ways): the outputs, the frames each replica's step
    thread read itself, and the names of the threads the replicas started. ``inline``
    False: the replicas' channels refuse the step thread, so their event loops read them
    (the mailbox's receive task)."""
    directory = InMemoryDirectory()
    policy = build_policy("bernoulli", {"p": 0.3}, MODELS)
    before = {t.name for t in threading.enumerate()}
    servers: list[Replica] = []
    channels: list[ZmqChannel] = []
    kind_of = UnixChannel if kind == "unix" else ZmqChannel
    for index, model in enumerate(MODELS):
        channel = kind_of(model, "0", directory, key=KEY)
        if not inline:
            channel.receive_inline = lambda: None  # type: ignore[method-assign]
        await channel.start()
        channels.append(channel)
        server = Replica(
            MODELS, index, sim_engine(lambda b: 0.001), policy, channel,
            pick_endpoint=lambda m, rid: endpoint_name(m, "0"),
        )  # fmt: skip
        await server.start()
        servers.append(server)
    ingress_channel = kind_of("ingress", "0", directory, key=KEY)
    await ingress_channel.start()
    core = IngressCore(ingress_channel, lambda: "small/0", lambda: ["small/0", "large/0"])
    await core.start()
    try:
        started = {t.name for t in threading.enumerate()} - before
        sampling = SamplingSpec(temperature=0.0, max_tokens=24, ignore_eos=True)
        rids = [f"r{k}" for k in range(12)]
        for k, rid in enumerate(rids):
            await core.submit(rid, list(range(5 + k)), sampling)
        outputs = {}
        for rid in rids:
            result = await asyncio.wait_for(core.result(rid), 30)
            outputs[rid] = list(result.token_ids)
        read = [s._frames.frames if s._frames is not None else 0 for s in servers]
    finally:
        await core.stop()
        for server in servers:
            await server.stop()
        for channel in [ingress_channel, *channels]:
            await channel.close()
    return outputs, read, started


@pytest.mark.asyncio
async def test_replicas_reading_on_their_step_threads_give_the_event_loops_outputs() -> None:
    inline, read, started = await _outputs(inline=True)
    on_loop, unread, started_on_loop = await _outputs(inline=False)
    assert inline == on_loop
    assert all(len(tokens) == 24 for tokens in inline.values())
    assert all(n > 0 for n in read), read  # both replicas read their frames themselves
    assert unread == [0, 0]
    assert not any(name.endswith("-recv") for name in started | started_on_loop), started
    # the bare unix channel: the same outputs, read by the step threads themselves too
    over_unix, read_unix, _ = await _outputs(inline=True, kind="unix")
    assert over_unix == inline
    assert all(n > 0 for n in read_unix), read_unix
