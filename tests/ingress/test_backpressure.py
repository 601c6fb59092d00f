"""The stream gate's rule (ingress/backpressure.py) with an injected clock, no Ray, no HTTP:
a full choice waits for the client; a client blocked in ``send`` for ``client_stall_s``
while output waits for it is stalled; a client that keeps taking chunks never is."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.clock import FakeClock
from tests.waiting import wait_until
from tokenrouter_ray.ingress.backpressure import Backpressure, StreamGate


def gate(n: int = 2, tokens: int = 4, stall_s: float = 10.0) -> tuple[StreamGate, FakeClock]:
    clock = FakeClock(start=100.0)
    return StreamGate(n, Backpressure(tokens, stall_s), clock), clock


def test_the_buffer_counts_tokens_produced_and_not_taken_per_choice() -> None:
    g, _ = gate()
    g.produced(0, 3)
    g.produced(1, 1)
    g.produced(0, 2)
    assert g.buffered == [5, 1] and g.full(0) and not g.full(1)
    g.sending()
    g.sent([0])  # the frame carried choice 0's first piece (3 tokens)
    assert g.buffered == [2, 1] and not g.full(0)
    g.sending()
    g.sent([1, 0])
    assert g.buffered == [0, 0] and g.buffered_total == 0


def test_a_client_blocked_past_the_stall_time_with_a_full_choice_is_stalled() -> None:
    g, clock = gate()
    g.produced(0, 4)
    g.sending()  # the server's send blocks from here
    clock.now += 9.9
    assert not g.stalled() and g.check_in_s() == pytest.approx(0.1)
    clock.now += 0.1
    assert g.stalled()


def test_a_blocked_client_with_room_left_is_not_stalled_while_choices_generate() -> None:
    g, clock = gate()
    g.produced(0, 3)  # below the bound: the choice keeps reading
    g.sending()
    clock.now += 60
    assert not g.stalled()
    g.finished()
    assert not g.stalled()  # one choice still generates: it will fill or finish
    g.finished()
    assert g.stalled()  # nothing more will come: the blocked client is all that is left


def test_a_slow_reader_that_keeps_taking_chunks_is_never_stalled() -> None:
    g, clock = gate(n=1, tokens=2, stall_s=1.0)
    for _ in range(100):  # 0.9 s per chunk: slower than the bound needs, never stopped
        g.produced(0, 1)
        g.produced(0, 1)
        assert g.full(0)
        g.sending()
        clock.now += 0.9
        assert not g.stalled()
        g.sent([0])
        assert g.check_in_s() == float("inf")
        clock.now += 5.0  # waiting for the models is not the client's stall
        assert not g.stalled()
        g.sending()
        g.sent([0])
    assert g.buffered == [0]


def test_a_full_choice_waits_until_the_client_takes_a_chunk() -> None:
    async def go() -> None:
        g = StreamGate(1, Backpressure(2, 5.0))
        g.produced(0, 1)
        g.produced(0, 1)
        waiter = asyncio.create_task(g.wait_for_room(0))
        await asyncio.sleep(0)  # one turn: the waiter runs up to its wait (or returns)
        assert not waiter.done()
        g.sending()
        g.sent([0])
        await asyncio.wait_for(waiter, 20)

    asyncio.run(go())


def test_watch_returns_once_the_rule_fires_and_not_before() -> None:
    """On a clock the test drives (the watcher's own waits are real time: a quarter stall
    time at most, 50 ms here)."""

    async def go() -> None:
        clock = FakeClock(start=100.0)
        g = StreamGate(1, Backpressure(1, 0.2), clock)
        watcher = asyncio.create_task(g.watch())
        g.produced(0, 1)
        g.sending()
        clock.now += 0.1
        reads = clock.reads
        # the watcher looked at the blocked writer half a stall time in: not stalled
        await wait_until(lambda: clock.reads > reads, 20, "the watcher checking")
        assert not watcher.done()
        g.sent([0])  # took it in time
        clock.now += 0.3
        # A negative check: with nothing waiting for the client no time is a stall; a few
        # of the watcher's wake-ups (50 ms each) for it to fire wrongly
        await asyncio.sleep(0.3)
        assert not watcher.done() and g.stalled_at is None
        g.produced(0, 1)
        g.sending()  # and now it stops reading
        clock.now += 0.25  # past the stall time
        await asyncio.wait_for(watcher, 20)
        assert g.stalled_at == clock.now

    asyncio.run(go())


def test_watch_neither_spins_past_a_deadline_nor_wakes_per_frame() -> None:
    """A writer blocked past the stall time while its choice still has room is not stalled;
    the watcher then waits (it used to spin on a zero timeout), and frames taken quickly do
    not wake it each: it reads the clock a few times per quarter stall time."""
    reads = [0]

    def clock() -> float:
        reads[0] += 1
        return time.monotonic()

    async def go() -> None:
        g = StreamGate(1, Backpressure(100, 0.2), clock=clock)
        watcher = asyncio.create_task(g.watch())
        g.produced(0, 1)
        g.sending()  # blocked from now on, with room left: not stalled
        # By design: three stall times pass with the writer blocked (the window in which
        # a watcher spinning past its deadline would read the clock thousands of times)
        await asyncio.sleep(0.6)
        assert not watcher.done()
        for _ in range(2000):  # a fast reader: frame after frame
            g.sent([0])
            g.produced(0, 1)
            g.sending()
        g.sent([0])
        await asyncio.sleep(0.1)  # (a negative check: the watcher's reads in this window too)
        assert not watcher.done() and reads[0] < 2000 + 2000 + 100
        watcher.cancel()

    asyncio.run(go())


def test_limits_are_validated() -> None:
    with pytest.raises(ValueError):
        Backpressure(0, 1.0)
    with pytest.raises(ValueError):
        Backpressure(1, 0.0)
