"""The ZeroMQ peer channel against strangers on the network: a queued junk flood is drained
without starving the event loop, oversized frames never arrive, tcp binds the node's own
address and a fixed port range, CURVE refuses keys outside the app's own in the handshake,
and a replica whose peers all sign with another key says so (``key_mismatch_s``)."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import zmq
import zmq.asyncio

from tests.transport import handoff, recv_n, wait_for
from tokenrouter_ray.config import ZmqSpec
from tokenrouter_ray.protocol import encode_batch
from tokenrouter_ray.transport import InMemoryDirectory, ZmqChannel
from tokenrouter_ray.transport.auth import MAGIC, FrameSigner, derive_key
from tokenrouter_ray.transport.checks import YIELD_EVERY, RejectPacer
from tokenrouter_ray.transport.curve import CurveKeys

KEY = derive_key(os.urandom(32))


def junk(i: int) -> bytes:
    """A frame with the right magic and a random MAC: costs the receiver a full MAC."""
    return MAGIC + os.urandom(16) + i.to_bytes(8, "big") + os.urandom(32) + os.urandom(200)


def rogue(address: str, curve: CurveKeys | None = None) -> zmq.asyncio.Socket:
    sock = zmq.asyncio.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)  # a flood queues without limit on the stranger's side
    if curve is not None:
        sock.curve_secretkey, sock.curve_publickey = curve.secret, curve.public
        sock.curve_serverkey = curve.public
    sock.connect(address)
    return sock


def queued(channel: ZmqChannel) -> bool:
    """A frame waits on ``channel``'s socket (nobody reads it yet: its first ``recv`` or
    read takes it without waiting for a signal)."""
    assert channel._pull_now is not None
    return bool(channel._pull_now.getsockopt(zmq.EVENTS) & zmq.POLLIN)


@pytest.mark.asyncio
async def test_a_queued_junk_flood_is_drained_while_the_loop_keeps_running() -> None:
    n = 16 * YIELD_EVERY
    async with ZmqChannel("large", "0", InMemoryDirectory(), key=KEY) as large:
        sock = rogue(large.address)
        for i in range(n):
            await sock.send(junk(i))
        await wait_for(lambda: queued(large), 30, "the flood reaching the receiver")
        # The rest of the flood comes across behind its first frame meanwhile (libzmq's I/O
        # thread; nothing says when the last one is in): the test's premise, not a condition
        # the checks below need (a flood still arriving makes the loop run all the more).
        await asyncio.sleep(0.5)
        seen: list[int] = []

        async def ticker() -> None:  # what decode, heartbeats and health checks need
            while True:
                seen.append(large.rejected["bad_mac"])
                await asyncio.sleep(0)

        receiving = asyncio.ensure_future(recv_n(large, 1, timeout_s=60))
        ticking = asyncio.ensure_future(ticker())
        await wait_for(lambda: large.rejected["bad_mac"] >= n, 60)
        small = ZmqChannel("small", "0", large.directory, key=KEY)
        async with small:
            await small.send("large/0", [handoff(0)])
            got = await receiving
        ticking.cancel()
        sock.close()
    assert [m.handoff_seq for b in got for m in b] == [0]
    during = {c for c in seen if 0 < c < n}
    assert len(during) >= 10, f"the loop ran only at {sorted(during)} rejected frames"


@pytest.mark.asyncio
async def test_frames_over_the_limit_never_arrive_and_honest_ones_do() -> None:
    directory = InMemoryDirectory()
    spec = ZmqSpec(max_frame_mib=4096 / 2**20)
    async with (
        ZmqChannel("large", "0", directory, spec, key=KEY) as large,
        ZmqChannel("small", "0", directory, spec, key=KEY) as small,
    ):
        sock = rogue(large.address)
        big = FrameSigner(KEY).sign("large/0", b"\x00" * 8192)  # correctly signed, too big
        await sock.send(big)
        await small.send("large/0", [handoff(0)])
        got = await recv_n(large, 1)
        sock.close()
    assert [m.handoff_seq for b in got for m in b] == [0]
    assert sum(large.rejected.values()) == 0  # ZeroMQ dropped it before any read


@pytest.mark.asyncio
async def test_tcp_binds_the_node_address_and_the_configured_port_range() -> None:
    probe = zmq.Context.instance().socket(zmq.PULL)  # find two free neighbouring ports
    base = probe.bind_to_random_port("tcp://127.0.0.1", min_port=30000, max_port=60000)
    probe.close(linger=0)
    spec = ZmqSpec(transport="tcp", port_range=(base, base + 1))
    directory = InMemoryDirectory()
    async with (
        ZmqChannel("large", "0", directory, spec, key=KEY) as a,
        ZmqChannel("large", "1", directory, spec, key=KEY) as b,
    ):
        bound = [c._pull_now.getsockopt_string(zmq.LAST_ENDPOINT) for c in (a, b)]
        assert not any("0.0.0.0" in e or "*" in e for e in bound)
        assert sorted(int(e.rsplit(":", 1)[1]) for e in bound) == [base, base + 1]
        with pytest.raises(OSError, match="every port"):
            async with ZmqChannel("large", "2", directory, spec, key=KEY):
                pass
        async with ZmqChannel("small", "0", directory, ZmqSpec(transport="tcp"), key=KEY) as s:
            await s.send("large/1", [handoff(0, dst="large/1")])
            got = await recv_n(b, 1)
    assert [m.handoff_seq for batch in got for m in batch] == [0]


@pytest.mark.asyncio
@pytest.mark.parametrize("transport", ["ipc", "tcp"])
async def test_curve_refuses_strangers_in_the_handshake(transport: str) -> None:
    curve = CurveKeys.from_key(KEY)
    other = CurveKeys.from_key(derive_key(b"another app"))
    assert CurveKeys.from_key(KEY) == curve  # every replica derives the same pair
    directory = InMemoryDirectory()
    spec = ZmqSpec(transport=transport, curve=True)
    async with (
        ZmqChannel("large", "0", directory, spec, key=KEY) as large,
        ZmqChannel("small", "0", directory, spec, key=KEY) as small,
    ):
        strangers = [rogue(large.address), rogue(large.address, other)]
        signer = FrameSigner(KEY)  # even frames that would pass the MAC (a replayed capture)
        for sock in strangers:  # a plain socket, and CURVE with another app's key pair
            for seq in range(5, 25):
                await sock.send(signer.sign("large/0", encode_batch([handoff(seq)])))
        await small.send("large/0", [handoff(0)])
        await small.send("large/0", [handoff(1)])
        got = await recv_n(large, 2)
        # A negative check: had a stranger's connection been accepted, its frames (sent
        # before the honest ones) would be read now. None may come within the window.
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(large.recv(), 0.3)
        for sock in strangers:
            sock.close()
    assert [m.handoff_seq for b in got for m in b] == [0, 1]
    assert sum(large.rejected.values()) == 0  # nothing of theirs was ever read


@pytest.mark.asyncio
async def test_only_bad_mac_frames_mean_a_key_mismatch_until_one_verifies() -> None:
    directory = InMemoryDirectory()
    async with (
        ZmqChannel("large", "0", directory, key=KEY) as large,
        ZmqChannel("small", "0", directory, key=derive_key(b"old secret")) as stale,
        ZmqChannel("small", "1", directory, key=KEY) as good,
    ):
        receiving = asyncio.ensure_future(recv_n(large, 1, timeout_s=30))
        assert large.key_mismatch_s() == 0.0
        await stale.send("large/0", [handoff(0)])
        await wait_for(lambda: large.rejected["bad_mac"] == 1, 30, "the first bad frame")
        first_seen = time.monotonic()  # the mismatch began no later than this
        for seq in (1, 2):
            await asyncio.sleep(0.1)  # the stale peer goes on sending for a while
            await stale.send("large/0", [handoff(seq)])
        await wait_for(lambda: large.rejected["bad_mac"] == 3, 30, "three bad frames")
        lasted = time.monotonic() - first_seen
        assert lasted >= 0.2 and large.key_mismatch_s() >= lasted
        assert large.key_mismatch_s(recent_s=0.0) == 0.0  # no bad frame that recent
        await good.send("large/0", [handoff(0)])
        await receiving
        assert large.key_mismatch_s() == 0.0


def test_the_reject_pacer_lets_a_burst_through_then_paces_to_its_rate() -> None:
    now = [0.0]
    pacer = RejectPacer(100.0, clock=lambda: now[0])  # a burst of 25
    assert [pacer.wait_s() for _ in range(25)] == [0.0] * 25
    waits = [pacer.wait_s() for _ in range(3)]
    assert waits == pytest.approx([0.01, 0.02, 0.03]) and pacer.paced == 3
    now[0] += 10.0  # a quiet spell refills the burst, never more
    assert [pacer.wait_s() for _ in range(25)] == [0.0] * 25
    assert pacer.wait_s() > 0


@pytest.mark.asyncio
async def test_honest_frames_pass_a_flood_that_is_examined_at_the_paced_rate() -> None:
    """A stranger queues 3,000 junk frames; an honest peer's 20 frames still arrive while
    most of the junk waits (ZeroMQ fair-queues the two connections, the receiver paces
    what it rejects), and the junk examined stays within the pacer's budget."""
    rate, n = 200.0, 3000
    directory = InMemoryDirectory()
    spec = ZmqSpec(reject_rate=rate)
    async with (
        ZmqChannel("large", "0", directory, spec, key=KEY) as large,
        ZmqChannel("small", "0", directory, key=KEY) as small,
    ):
        sock = rogue(large.address)
        for i in range(n):
            await sock.send(junk(i))
        await wait_for(lambda: queued(large), 30, "the flood reaching the receiver")
        await asyncio.sleep(0.2)  # more of it comes across meanwhile (the premise, as above)
        t0 = asyncio.get_running_loop().time()
        receiving = asyncio.ensure_future(recv_n(large, 20, timeout_s=60))
        for seq in range(20):
            await small.send("large/0", [handoff(seq)])
        got = await receiving
        elapsed = asyncio.get_running_loop().time() - t0
        sock.close()
    assert [m.handoff_seq for b in got for m in b] == list(range(20))
    examined = sum(large.rejected.values())
    assert examined < n / 2  # the honest frames did not wait for the flood to drain
    assert examined <= rate / 4 + rate * elapsed + 2  # the budget, whatever the machine
