"""In-process peer channel: several model replicas wired together in one process.

An `InProcHub` is the "network": it maps inproc:// addresses to the receivers' frame queues.
`send` encodes the batch (so sender and receiver never share mutable lists) and puts the
frame on the destination's queue; `recv` decodes it on the receiver's loop. Receivers may
run on other event loops or threads of the same process: frames cross with
`call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from tokenrouter_ray.protocol import PeerReq, encode_batch
from tokenrouter_ray.transport.base import (
    ChannelClosed,
    Directory,
    Endpoint,
    FrameQueue,
    PeerChannel,
    PeerUnreachableError,
)


class InProcHub:
    """inproc:// address -> frame queue, shared by the channels of one process.

    ``transit_s``: every frame reaches its receiver this long after it was sent (a network
    between nodes, simulated; 0: at once). The simulation uses it to show what the time a
    handoff spends between models costs (docs/benchmarks/README.md, "Host path")."""

    def __init__(self, transit_s: float = 0.0) -> None:
        if transit_s < 0:
            raise ValueError(f"transit_s must be >= 0, got {transit_s}")
        self._queues: dict[str, FrameQueue] = {}
        self.transit_s = transit_s

    def bind(self, name: str, queue: FrameQueue) -> str:
        address = f"inproc://{name}"
        if address in self._queues:
            raise RuntimeError(f"address {address} is already bound")
        self._queues[address] = queue
        return address

    def unbind(self, address: str) -> None:
        self._queues.pop(address, None)

    def deliver(self, address: str, frame: bytes) -> None:
        queue = self._queues.get(address)
        if queue is None:
            raise PeerUnreachableError(f"nothing is bound at {address} (its channel closed?)")
        if self.transit_s:  # sends run on an event loop: deliver from it, later
            asyncio.get_running_loop().call_later(self.transit_s, queue.put, frame)
        else:
            queue.put(frame)


class InProcChannel(PeerChannel):
    """A mailbox on an `InProcHub`. All channels that talk must share the hub and directory."""

    def __init__(self, model: str, replica: str, directory: Directory, hub: InProcHub) -> None:
        super().__init__(model, replica, directory)
        self.hub = hub
        self._queue: FrameQueue | None = None

    async def _open(self) -> str:
        self._queue = FrameQueue()
        return self.hub.bind(self.name, self._queue)

    async def _send_frame(self, dst: Endpoint, msgs: Sequence[PeerReq]) -> int:
        frame = encode_batch(msgs)
        self.hub.deliver(dst.address, frame)
        return len(frame)

    async def recv(self) -> list[PeerReq]:
        if self._queue is None:
            raise ChannelClosed(f"channel {self.name!r} is not started")
        return await self._queue.get(self.name)

    async def _shut(self) -> None:
        if self._address is not None:
            self.hub.unbind(self._address)
        if self._queue is not None:
            self._queue.close()
