"""Per-frame authentication for the socket transport: keyed BLAKE2b from a cluster secret.

A signed frame is ``MAGIC | sender (16 B) | counter (8 B, big endian) | mac (32 B) | payload``
with ``mac = BLAKE2b-256(key=key; MAGIC | sender | counter | receiver name | payload)``, the
MAC mode BLAKE2 defines (RFC 7693), cheaper per frame on a replica's step thread than an
HMAC through OpenSSL (CPython's own code: no OpenSSL context copied per frame):

- ``sender`` is random per channel (a restarted replica is a new sender);
- ``counter`` grows by one per frame for each (sender, receiver) pair; the receiver accepts
  only a counter above the highest it accepted from that sender, so a duplicated or replayed
  frame is rejected (ZeroMQ keeps per-connection order, so honest frames always increase);
- the receiver's endpoint name is inside the MAC, so a frame captured on its way to one
  replica is no good at another.

``FrameVerifier.open`` returns the payload, or the reason it was rejected: ``malformed``
(too short, wrong magic), ``bad_mac`` (forged, tampered, or another key), ``replay``.

The key comes from ``TOKENROUTER_PEER_SECRET`` when set (the same value on every node),
otherwise from a random per-app secret the endpoint directory generates at start-up. It is
never a constant in the repository.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from collections import OrderedDict

MAGIC = b"TRR2"  # TRR1 frames (HMAC-SHA256) are refused as malformed
SECRET_ENV = "TOKENROUTER_PEER_SECRET"
_HEADER = struct.Struct(">4s16sQ32s")  # magic, sender, counter, mac
_COUNTER = struct.Struct(">Q")
HEADER_SIZE = _HEADER.size


def derive_key(secret: str | bytes) -> bytes:
    """The HMAC key for a cluster secret (any length, any text)."""
    raw = secret.encode() if isinstance(secret, str) else bytes(secret)
    if not raw:
        raise ValueError("the peer secret is empty")
    return hashlib.sha256(b"tokenrouter-peer-frame-v1\0" + raw).digest()


class _Mac:
    """Keyed BLAKE2b-256 under one key: the keyed state is computed once and each frame's
    MAC starts from a copy of it."""

    __slots__ = ("_keyed",)

    def __init__(self, key: bytes) -> None:
        self._keyed = hashlib.blake2b(key=key, digest_size=32)

    def __call__(self, sender: bytes, counter: int, receiver: bytes, payload: bytes) -> bytes:
        """The MAC of ``MAGIC | sender | counter | receiver | payload`` (``receiver``: the
        receiver's name, UTF-8, with its terminating NUL)."""
        mac = self._keyed.copy()
        mac.update(MAGIC + sender + _COUNTER.pack(counter) + receiver)
        mac.update(payload)
        return mac.digest()


def _receiver_bytes(receiver: str) -> bytes:
    return receiver.encode() + b"\0"


class FrameSigner:
    """Signs this channel's outgoing frames, one counter per receiver."""

    def __init__(self, key: bytes) -> None:
        self.key = key
        self.sender = os.urandom(16)
        self._mac = _Mac(key)
        self._counters: dict[str, int] = {}

    def sign(self, receiver: str, payload: bytes) -> bytes:
        counter = self._counters.get(receiver, 0) + 1
        self._counters[receiver] = counter
        mac = self._mac(self.sender, counter, _receiver_bytes(receiver), payload)
        return _HEADER.pack(MAGIC, self.sender, counter, mac) + payload


class FrameVerifier:
    """Checks the frames one receiver gets; remembers the newest counter per sender (an LRU
    of ``max_senders``)."""

    def __init__(self, key: bytes, receiver: str, max_senders: int = 1 << 16) -> None:
        self.key = key
        self.receiver = receiver
        self.max_senders = max_senders
        self._mac = _Mac(key)
        self._name = _receiver_bytes(receiver)
        self._newest: OrderedDict[bytes, int] = OrderedDict()

    def open(self, frame: bytes) -> tuple[bytes | None, str | None]:
        """``(payload, None)`` for a good frame, ``(None, reason)`` for a rejected one."""
        if len(frame) < HEADER_SIZE:
            return None, "malformed"
        magic, sender, counter, mac = _HEADER.unpack_from(frame)
        if magic != MAGIC:
            return None, "malformed"
        payload = frame[HEADER_SIZE:]
        want = self._mac(sender, counter, self._name, payload)
        if not hmac.compare_digest(mac, want):
            return None, "bad_mac"
        if counter <= self._newest.get(sender, 0):
            return None, "replay"
        self._newest[sender] = counter
        self._newest.move_to_end(sender)
        if len(self._newest) > self.max_senders:
            self._newest.popitem(last=False)
        return payload, None
