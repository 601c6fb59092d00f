"""ZeroMQ CURVE for the peer channel: one key pair per app, and a ZAP allowlist of it.

Every replica of an app derives the same Curve25519 key pair from the app's peer key
(``CurveKeys.from_key``: the MAC key of ``transport.auth``, itself from the one peer
secret). A replica's PULL socket is a CURVE server with that secret key; its PUSH sockets
dial with the same pair and expect the same server key. A ZAP handler (pyzmq's
``ThreadAuthenticator``, one per ZeroMQ context, in its own thread so no event loop has
to run for a handshake) admits a client only if its public key is one of the allowlisted
keys of the socket's ZAP domain, so a stranger without the secret is refused in the
handshake: it never delivers a frame, and nothing of its traffic reaches the event loop.
Frames stay MAC-signed on top (CURVE adds encryption and handshake refusal).
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85


@dataclass(frozen=True)
class CurveKeys:
    """The app's CURVE key pair (z85 text, as ZeroMQ takes them)."""

    public: bytes
    secret: bytes

    @classmethod
    def from_key(cls, key: bytes) -> CurveKeys:
        """The pair every replica holding ``key`` derives identically."""
        if not zmq.has("curve"):
            raise RuntimeError("this libzmq was built without CURVE (transport.zmq.curve)")
        raw = hashlib.sha256(b"tokenrouter-curve-v1\0" + key).digest()
        secret = z85.encode(raw)
        return cls(public=zmq.curve_public(secret), secret=secret)

    @property
    def domain(self) -> str:
        """The ZAP domain of sockets serving with this pair (one allowlist per app)."""
        return "trr-" + hashlib.sha256(self.public).hexdigest()[:16]

    def serve(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (before bind) a CURVE server checked against this app's list."""
        sock.setsockopt(zmq.ZAP_DOMAIN, self.domain.encode())
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True

    def dial(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (before connect) a CURVE client of a server of this app."""
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_serverkey = self.public


class _Allowlist:
    """The public keys a ZAP domain admits (called from the authenticator's thread)."""

    def __init__(self) -> None:
        self.keys: set[bytes] = set()

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


_lock = threading.Lock()
_authenticators: dict[int, tuple[zmq.Context, ThreadAuthenticator, dict[str, _Allowlist]]] = {}


def curve_allowlist(context: zmq.Context, keys: CurveKeys) -> None:
    """Ensure ``context`` has a running ZAP handler admitting ``keys.public`` in
    ``keys.domain`` (idempotent; other domains keep their own lists)."""
    with _lock:
        entry = _authenticators.get(id(context))
        if entry is None or entry[0] is not context or not entry[1].is_alive():
            auth = ThreadAuthenticator(context)
            auth.start()
            entry = _authenticators[id(context)] = (context, auth, {})
        _, auth, lists = entry
        allow = lists.get(keys.domain)
        if allow is None:
            allow = lists[keys.domain] = _Allowlist()
            auth.configure_curve_callback(keys.domain, credentials_provider=allow)
        allow.keys.add(keys.public)
