"""Peer-channel authentication: MAC-signed ZeroMQ frames (keyed BLAKE2b). Forged, replayed,
duplicated and malformed frames injected over the real socket are dropped and counted;
honest traffic goes on; ipc socket files are private."""

from __future__ import annotations

import asyncio
import hashlib
import os
import stat
import struct

import pytest
import zmq
import zmq.asyncio

from tests.transport import handoff, recv_n
from tokenrouter_ray.config import ZmqSpec
from tokenrouter_ray.protocol import encode_batch
from tokenrouter_ray.transport import InMemoryDirectory, ZmqChannel
from tokenrouter_ray.transport.auth import MAGIC, FrameSigner, FrameVerifier, derive_key
from tokenrouter_ray.transport.base import Endpoint

KEY = derive_key(os.urandom(32))


def test_a_frame_is_laid_out_and_signed_as_the_module_documents() -> None:
    """The MAC is BLAKE2b-256 keyed with the key over MAGIC | sender | counter | receiver
    NUL | payload, computed here from scratch: peers of another build verify the same
    bytes."""
    signer = FrameSigner(KEY)
    for counter, (receiver, payload) in enumerate(
        [("large/0", b"a"), ("large/0", b"b" * 5000), ("ingress/é", b"")], start=1
    ):
        frame = signer.sign(receiver, payload)
        if receiver == "ingress/é":
            counter = 1  # one counter per receiver
        head = MAGIC + signer.sender + struct.pack(">Q", counter)
        want = hashlib.blake2b(head + receiver.encode() + b"\0" + payload, key=KEY, digest_size=32)
        assert head.startswith(b"TRR2") and frame == head + want.digest() + payload
        assert FrameVerifier(KEY, receiver).open(frame) == (payload, None)


def test_signed_frames_verify_once_and_only_for_their_receiver() -> None:
    signer = FrameSigner(KEY)
    verifier = FrameVerifier(KEY, "large/0")
    frame = signer.sign("large/0", b"payload")
    assert verifier.open(frame) == (b"payload", None)
    assert verifier.open(frame) == (None, "replay")  # duplicate
    assert verifier.open(signer.sign("large/0", b"next")) == (b"next", None)
    assert FrameVerifier(KEY, "large/1").open(signer.sign("large/0", b"x"))[1] == "bad_mac"
    tampered = bytearray(signer.sign("large/0", b"tokens"))
    tampered[-1] ^= 1
    assert verifier.open(bytes(tampered)) == (None, "bad_mac")
    other = FrameSigner(derive_key(b"another cluster")).sign("large/0", b"x")
    assert verifier.open(other) == (None, "bad_mac")
    assert verifier.open(b"short") == (None, "malformed")
    assert verifier.open(b"XXXX" + frame[4:]) == (None, "malformed")
    with pytest.raises(ValueError):
        derive_key(b"")


@pytest.mark.asyncio
@pytest.mark.parametrize("transport", ["ipc", "tcp"])
async def test_injected_frames_are_rejected_and_honest_traffic_flows(transport: str) -> None:
    directory = InMemoryDirectory()
    spec = ZmqSpec(transport=transport)
    rejected: list[str] = []
    async with (
        ZmqChannel("large", "0", directory, spec, key=KEY, on_reject=rejected.append) as large,
        ZmqChannel("small", "0", directory, spec, key=KEY) as small,
    ):
        captured: list[bytes] = []
        await small.send("large/0", [handoff(0)])
        push = small._push_now["large/0"]

        class Wiretap:  # sees each frame the channel sends, then sends it
            def send(self, frame: bytes, **kwargs: object) -> None:
                captured.append(frame)
                push.send(frame, **kwargs)

        small._push_now["large/0"] = Wiretap()  # type: ignore[assignment]
        await small.send("large/0", [handoff(1)])
        assert [b[0].handoff_seq for b in await recv_n(large, 2)] == [0, 1]

        rogue = zmq.asyncio.Context.instance().socket(zmq.PUSH)
        rogue.setsockopt(zmq.LINGER, 0)
        rogue.connect(large.address)
        valid_unsigned = encode_batch([handoff(7)])
        forged = FrameSigner(derive_key(b"guessed secret")).sign("large/0", valid_unsigned)
        for frame in (
            valid_unsigned,  # a well-formed PeerReq batch without a signature
            forged,  # signed with the wrong key
            captured[0],  # replay of a frame already delivered
            captured[0],  # and once more
            b"\x00" * 3,  # garbage
        ):
            await rogue.send(frame)
        receiving = asyncio.ensure_future(recv_n(large, 1))
        for _ in range(500):  # the attack is read (and dropped) by the receive call
            if len(rejected) == 5:
                break
            await asyncio.sleep(0.01)
        await small.send("large/0", [handoff(2)])  # honest traffic after the attack
        got = await receiving
        rogue.close()
    assert [m.handoff_seq for b in got for m in b] == [2]
    assert sorted(rejected) == ["bad_mac", "malformed", "malformed", "replay", "replay"]
    assert large.rejected == {"malformed": 2, "bad_mac": 1, "replay": 2}


@pytest.mark.asyncio
async def test_ipc_socket_files_are_private() -> None:
    async with ZmqChannel("large", "0", InMemoryDirectory(), key=KEY) as large:
        path = large.address.removeprefix("ipc://")
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700


@pytest.mark.asyncio
async def test_a_peer_that_stopped_reading_fails_sends_instead_of_blocking() -> None:
    from tokenrouter_ray.transport import PeerUnreachableError

    directory = InMemoryDirectory()
    tight = ZmqSpec(send_hwm=4)
    await directory.register(Endpoint("large", "dead", "ipc:///nonexistent/dead.sock"))
    async with ZmqChannel("small", "0", directory, tight, key=KEY) as small:
        with pytest.raises(PeerUnreachableError, match="not reading"):
            for seq in range(100):  # nobody reads: the queue fills, then sends fail fast
                await asyncio.wait_for(small.send("large/dead", [handoff(seq)]), 5)
