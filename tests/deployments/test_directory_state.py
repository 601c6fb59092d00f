"""The endpoint directory keeps answering while a peer's process is frozen in the middle of
a call to it, and the frozen peer's lease runs out (deployments/directory.py). Real Ray
Serve on the shared test cluster; the peer is a plain Ray actor heartbeating through
``ServeDirectory`` as the ingress and the model replicas do, without a pause."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from deployments.directory import ENDPOINT_TTL_S, ServeDirectory
from tokenrouter_ray.transport.base import Endpoint

APP = "directory-state"
FREEZES = 3  # a frozen caller stalled a Serve handle's callee in 5 of 6 tries (module doc)


@pytest.fixture(scope="module")
def directory(serve_http: str) -> Iterator[Any]:
    from ray import serve

    from deployments.directory import EndpointDirectory

    handle = serve.run(EndpointDirectory.bind(), name=APP, route_prefix=f"/{APP}")
    try:
        yield handle
    finally:
        serve.delete(APP)


def busy_peer_class() -> Any:
    import ray

    @ray.remote(num_cpus=0)
    class BusyPeer:
        """Heartbeats through ``ServeDirectory`` back to back: nearly always mid-call."""

        def __init__(self, handle: Any) -> None:
            self.directory = ServeDirectory(handle)
            self.beats = 0

        def pid(self) -> int:
            return os.getpid()

        async def run(self) -> None:
            me = Endpoint("large", "frozen", "ipc:///nowhere")
            while True:
                await self.directory.heartbeat(me)
                self.beats += 1

        async def count(self) -> int:
            return self.beats

    return BusyPeer


def test_a_peer_frozen_mid_call_neither_stalls_the_directory_nor_keeps_its_lease(
    directory: Any,
) -> None:
    import ray

    own = ServeDirectory(directory)
    peer = busy_peer_class().remote(directory)
    pid = ray.get(peer.pid.remote())
    peer.run.remote()

    def listed() -> set[str]:
        return {e.name for e in asyncio.run(own.endpoints())}

    deadline = time.monotonic() + 30
    while "large/frozen" not in listed():
        assert time.monotonic() < deadline, "the peer never registered"
        time.sleep(0.05)
    try:
        for _ in range(FREEZES):
            os.kill(pid, signal.SIGSTOP)
            try:
                time.sleep(0.3)  # frozen with a heartbeat in flight, almost surely
                t0 = time.monotonic()
                asyncio.run(asyncio.wait_for(own.heartbeat(None), timeout=3))
                assert time.monotonic() - t0 < 3
            finally:
                os.kill(pid, signal.SIGCONT)
            time.sleep(0.3)
        # frozen past its lease: it leaves the listing while it is frozen
        os.kill(pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            while "large/frozen" in listed():
                assert time.monotonic() - t0 < ENDPOINT_TTL_S + 5, "the lease never ran out"
                time.sleep(0.2)
            gone_s = time.monotonic() - t0
        finally:
            os.kill(pid, signal.SIGCONT)
        assert gone_s >= ENDPOINT_TTL_S - 1  # not before its lease could end
        before = ray.get(peer.count.remote())
        t0 = time.monotonic()
        while "large/frozen" not in listed():  # running again, it registers again
            assert time.monotonic() - t0 < 10
            time.sleep(0.1)
        assert ray.get(peer.count.remote()) > before
    finally:
        ray.kill(peer)
