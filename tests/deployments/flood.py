"""A stranger's junk flood at a model's peer socket, for tests/deployments/test_reliability.py:
junk frames (the frame magic and random MACs, each worth a full MAC check) pushed at a ZeroMQ
address, and the same flood at a decoy socket this process drains (the flooder's own cost)."""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import time
from collections.abc import Iterator


def junk_flood(address: str, stop: threading.Event, sent: list[int], rate: float = 5000) -> None:
    """Junk frames (the frame magic, random MACs: each costs the receiver an HMAC) pushed
    at ``address`` until ``stop``, about ``rate`` a second; what cannot be queued is
    dropped (a stranger's sender). Appends the number sent to ``sent``."""
    import zmq

    from tokenrouter_ray.transport.auth import MAGIC

    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    n, t0 = 0, time.monotonic()
    try:
        while not stop.is_set():
            frame = MAGIC + os.urandom(56) + os.urandom(200)
            try:
                sock.send(frame, flags=zmq.NOBLOCK)
                n += 1
            except zmq.Again:
                time.sleep(0.001)
            if n % 100 == 0 and n / rate > time.monotonic() - t0:
                time.sleep(0.01)
    finally:
        sock.close(linger=0)
        sent.append(n)


@contextlib.contextmanager
def decoy_flood(rate: float = 5000) -> Iterator[None]:
    """The junk flood at a PULL socket of this process, drained by a thread: the flooder's
    own cost, with nothing of the app's paying for it."""
    import zmq

    with tempfile.TemporaryDirectory() as tmp:
        address = f"ipc://{tmp}/decoy.sock"
        pull = zmq.Context.instance().socket(zmq.PULL)
        pull.setsockopt(zmq.LINGER, 0)
        pull.setsockopt(zmq.RCVTIMEO, 100)
        pull.bind(address)
        stop, sent = threading.Event(), []

        def drain() -> None:
            while not stop.is_set():
                with contextlib.suppress(zmq.Again):
                    pull.recv()

        threads = [
            threading.Thread(target=drain, daemon=True),
            threading.Thread(target=junk_flood, args=(address, stop, sent, rate), daemon=True),
        ]
        for t in threads:
            t.start()
        try:
            time.sleep(0.5)
            yield
        finally:
            stop.set()
            for t in threads:
                t.join(30)
            pull.close(linger=0)
