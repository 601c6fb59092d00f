"""Sockets for tests: a free port to bind (never a fixed one: two test sessions on one
machine must not reach each other's servers)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A loopback TCP port nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
