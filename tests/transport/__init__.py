"""Channel tests; this package also holds the message factory and receive helper they share."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from tests.waiting import wait_until
from tokenrouter_ray.protocol import MsgKind, PeerReq, SamplingSpec
from tokenrouter_ray.transport import PeerChannel


def handoff(seq: int, src: str = "small/0", dst: str = "large/0", rid: str = "r") -> PeerReq:
    return PeerReq(
        rid=rid,
        src=src,
        dst=dst,
        kind=MsgKind.HANDOFF,
        handoff_seq=seq,
        tokens=[seq, seq + 1, seq + 2],
        anchor=seq,
        committed=2,
        sampling=SamplingSpec(temperature=0.7, seed=seq) if seq == 0 else None,
    )


async def recv_n(channel: PeerChannel, n: int, timeout_s: float = 10.0) -> list[list[PeerReq]]:
    """Batches from `channel` until `n` messages arrived."""
    batches: list[list[PeerReq]] = []

    async def drain() -> None:
        got = 0
        while got < n:
            batch = await channel.recv()
            batches.append(batch)
            got += len(batch)

    await asyncio.wait_for(drain(), timeout_s)
    return batches


async def wait_for(
    cond: Callable[[], bool], timeout_s: float = 20.0, what: str = "condition"
) -> None:
    """``tests.waiting.wait_until`` under the name these tests have always used (one home
    for waiting: tests/waiting.py)."""
    await wait_until(cond, timeout_s, what)
