"""The bare unix channel (``transport/unix_channel.py``) where it differs from ZeroMQ: frames
larger than one packet are split and joined in order; a receiver that stops reading makes
the sender queue, then refuse, never block, and what was queued arrives once it reads; a
receiver that is gone is an unreachable peer on both send paths; frames over the limit,
strangers' packets and forgeries are dropped while honest frames pass; the socket file is
private; the loop's ``recv`` does not spin on a signal nobody reads; and the config offers
it as its own kind, without CURVE. (The shared contract: test_channels.py, test_zmq_threads.py,
test_step_thread_receive.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import stat
from collections.abc import AsyncIterator

import pytest
from pydantic import ValidationError

from deployments.peers import make_channel
from tests.transport import handoff, recv_n, wait_for
from tokenrouter_ray.config import TransportSpec, UnixSpec
from tokenrouter_ray.protocol import MsgKind, PeerReq, SamplingSpec, encode_batch
from tokenrouter_ray.transport import (
    InMemoryDirectory,
    PeerUnreachableError,
    UnixChannel,
)
from tokenrouter_ray.transport import unix_channel as unix_module
from tokenrouter_ray.transport.auth import FrameSigner, derive_key

KEY = derive_key(os.urandom(32))


@contextlib.asynccontextmanager
async def pair(**settings: object) -> AsyncIterator[tuple[UnixChannel, UnixChannel]]:
    directory, spec = InMemoryDirectory(), UnixSpec.model_validate(settings)
    async with (
        UnixChannel("large", "0", directory, spec, key=KEY) as large,
        UnixChannel("small", "0", directory, spec, key=KEY) as small,
    ):
        yield small, large


def new(seq: int, n_tokens: int) -> PeerReq:
    """A NEW carrying ``n_tokens`` prompt tokens (a whole request re-created: big; ids past
    2**16, as a real vocabulary's are, take 5 bytes each)."""
    return PeerReq(
        rid=f"r{seq}", src="small/0", dst="large/0", kind=MsgKind.NEW, handoff_seq=seq,
        tokens=list(range(1 << 17, (1 << 17) + n_tokens)), sampling=SamplingSpec(),
    )  # fmt: skip


def seqs(batches: list[list[PeerReq]]) -> list[int]:
    return [m.handoff_seq for batch in batches for m in batch]


def stranger(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect(address.removeprefix(unix_module.SCHEME))
    return sock


@pytest.mark.asyncio
async def test_frames_larger_than_a_packet_are_split_and_joined_in_order() -> None:
    async with pair() as (small, large):
        big = [new(1, 60_000), new(3, 200_000)]  # ~300 KB and ~1 MB: 5 and 16 pieces
        sizes = [len(encode_batch([m])) for m in big]
        assert all(size > 4 * unix_module.PIECE_BYTES for size in sizes)
        await small.send("large/0", [handoff(0)])
        await small.send("large/0", [big[0]])
        await small.send("large/0", [handoff(2)])
        assert small.send_now("large/0", [big[1]])  # the step thread's path splits too
        await small.send("large/0", [handoff(4)])
        got = await recv_n(large, 5, 10.0)
        assert seqs(got) == [0, 1, 2, 3, 4]
        assert got[1][0].tokens == big[0].tokens
        assert got[3][0].tokens == big[1].tokens
        assert large.rejected == {}


@pytest.mark.asyncio
async def test_a_receiver_that_stops_reading_makes_the_sender_queue_then_refuse() -> None:
    """Nobody reads ``large``: the kernel's buffer fills, then frames wait in the sender's
    queue (``send_now`` declines once one waits: the event loop's turn), then past
    ``send_hwm`` queued frames a send fails at once. Every frame accepted arrives, in
    order, once the receiver reads."""
    async with pair(send_hwm=8) as (small, large):
        accepted, refused = [], None
        for seq in range(10_000):
            try:
                await asyncio.wait_for(small.send("large/0", [new(seq, 5_000)]), 1.0)
            except PeerUnreachableError as exc:
                refused = exc
                break
            accepted.append(seq)
        assert refused is not None and "not reading" in str(refused)
        assert len(accepted) > 8  # the kernel took some before the queue held 8
        assert not small.send_now("large/0", [handoff(99_999)])  # one waits: not from here
        got = await recv_n(large, len(accepted), 30.0)
        assert seqs(got) == accepted
        await small.send("large/0", [handoff(123_456)])  # the queue drained: sending again
        assert seqs(await recv_n(large, 1, 10.0)) == [123_456]
        assert large.rejected == {}


@pytest.mark.asyncio
async def test_a_receiver_that_is_gone_is_unreachable_on_both_paths() -> None:
    directory = InMemoryDirectory()
    small = UnixChannel("small", "0", directory, key=KEY)
    large = UnixChannel("large", "0", directory, key=KEY)
    async with small:
        await large.start()
        await small.send("large/0", [handoff(0)])
        assert seqs(await recv_n(large, 1, 5.0)) == [0]
        endpoint = await directory.get("large/0")
        await large.close()
        await directory.register(endpoint)  # a stale entry: its lease has not run out yet
        assert not small.send_now("large/0", [handoff(1)])  # reset: not sent from here
        await asyncio.sleep(0)  # (the connection is forgotten on the loop)
        with pytest.raises(PeerUnreachableError):
            await small.send("large/0", [handoff(2)])  # no socket file now: refused
        assert "large/0" not in small._outgoing


@pytest.mark.asyncio
async def test_oversized_strange_and_forged_packets_are_dropped_and_honest_frames_pass() -> None:
    limit = 200_000
    async with pair(max_frame_mib=limit / 2**20) as (small, large):
        rogue = stranger(large.address)
        try:
            await small.send("large/0", [handoff(0)])
            await small.send("large/0", [new(1, 60_000)])  # ~300 KB: over the limit
            await small.send("large/0", [handoff(2)])
            rogue.send(b"\x07junk")  # no such mark
            rogue.send(b"\x00" + b"\x00" * 40)  # a whole frame without the MAC's layout
            forged = FrameSigner(derive_key(b"guessed")).sign("large/0", encode_batch([handoff(8)]))
            rogue.send(b"\x00" + forged)
            rogue.send(b"\x01" + b"x" * 100)  # a piece, then the stranger leaves
            rogue.close()
            await small.send("large/0", [handoff(3)])
            got = await recv_n(large, 3, 10.0)
            await wait_for(lambda: sum(large.rejected.values()) >= 4)
        finally:
            rogue.close()
        assert seqs(got) == [0, 2, 3]
        # the unknown mark and the MAC-less frame are malformed; the forgery fails its MAC
        assert dict(large.rejected) == {"too_large": 1, "malformed": 2, "bad_mac": 1}
        assert len(large._incoming) == 1  # the stranger's connection dropped with its piece


@pytest.mark.asyncio
async def test_the_socket_file_is_private_and_gone_after_close() -> None:
    async with pair() as (_, large):
        path = large.address.removeprefix(unix_module.SCHEME)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    assert not os.path.exists(path) and not os.path.exists(os.path.dirname(path))


@pytest.mark.asyncio
async def test_a_signal_nobody_reads_does_not_spin_the_loop() -> None:
    """Frames arriving while no ``recv`` waits: the loop's callback takes the epoll set's
    readiness once, and the next ``recv`` reads them all, in order."""
    async with pair() as (small, large):
        await small.send("large/0", [handoff(0)])
        assert seqs(await recv_n(large, 1, 5.0)) == [0]  # the watch is on from here
        calls = 0
        on_signal = large._on_signal

        def counted() -> None:
            nonlocal calls
            calls += 1
            on_signal()

        loop = asyncio.get_running_loop()
        loop.remove_reader(large.fileno())
        loop.add_reader(large.fileno(), counted)
        for seq in range(1, 4):
            await small.send("large/0", [handoff(seq)])
        await wait_for(lambda: calls >= 1, 20, "the loop's callback taking the readiness")
        # A negative check: a loop spinning on the readiness would call back thousands of
        # times in this window; it must not call again (a later frame may still land).
        await asyncio.sleep(0.3)
        assert 1 <= calls <= 3, calls
        assert seqs(await recv_n(large, 3, 5.0)) == [1, 2, 3]
        waiting = asyncio.ensure_future(large.recv())
        await wait_for(lambda: large._waiter is not None, 20, "recv waiting for a signal")
        assert not waiting.done()  # nothing queued: it waits
        await small.send("large/0", [handoff(4)])
        assert seqs([await asyncio.wait_for(waiting, 5.0)]) == [4]


def test_the_config_offers_it_as_its_own_kind_without_curve() -> None:
    spec = TransportSpec.model_validate({"kind": "unix", "unix": {"send_hwm": 7}})
    channel = make_channel(spec, "small", "0", InMemoryDirectory(), key=KEY)
    assert isinstance(channel, UnixChannel) and channel.key == KEY
    assert channel.spec is spec.unix and channel.spec.send_hwm == 7
    with pytest.raises(ValidationError, match="curve"):
        TransportSpec.model_validate({"kind": "unix", "zmq": {"curve": True}})
    with pytest.raises(ValidationError, match="curve"):
        UnixSpec.model_validate({"curve": True})  # not one of its settings
    # the spelling as a ZeroMQ transport names the kind that replaced it
    with pytest.raises(ValidationError, match=r"unix is now transport\.kind: unix"):
        TransportSpec.model_validate({"zmq": {"transport": "unix"}})


@pytest.mark.asyncio
async def test_a_stranger_flooding_its_connection_does_not_crowd_out_honest_frames() -> None:
    """The reader takes a packet from each readable connection in turn (ZeroMQ's fair
    queueing): with a stranger's forgeries queued ahead (as many as its socket buffer takes,
    hundreds) and the pacer's budget spent, an honest frame sent after them waits for one
    junk packet per turn, not for all of them (at 50 rejected frames a second: seconds)."""
    async with pair(reject_rate=50.0) as (small, large):
        rogue = stranger(large.address)  # accepted first: the lower descriptor
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(large.recv(), 0.1)
        try:
            forged = FrameSigner(derive_key(b"guessed")).sign("large/0", encode_batch([handoff(9)]))
            rogue.setblocking(False)
            queued = 0
            with contextlib.suppress(BlockingIOError):
                while queued < 5000:
                    rogue.send(b"\x00" + forged)
                    queued += 1
            assert queued >= 150  # over 3 s of the pacer's budget
            await small.send("large/0", [handoff(1)])  # connects now: a later descriptor
            t0 = asyncio.get_running_loop().time()
            assert seqs(await recv_n(large, 1, 20.0)) == [1]
            took = asyncio.get_running_loop().time() - t0
        finally:
            rogue.close()
        assert took < 2.0, took
        assert 0 < large.rejected["bad_mac"] < queued  # examined at the pacer's rate
