"""The endpoint directory as a one-replica Serve deployment: lives and dies with the app.

Model servers and ingress replicas register their peer-channel endpoint here and look each
other up; ``ServeDirectory`` adapts its handle to the transport layer's ``Directory``.
Registrations are leases (``ENDPOINT_TTL_S``): every replica re-registers each
``HEARTBEAT_S`` (``PeerBook``), so a replica whose process died (and never unregistered)
disappears within the TTL, which is how the ingress learns to re-create its requests.
"""

from __future__ import annotations

import secrets

from ray import serve

from tokenrouter_ray.transport.base import InMemoryDirectory
from tokenrouter_ray.transport.ray_channel import RayDirectory

HEARTBEAT_S = 0.5
ENDPOINT_TTL_S = 5.0


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
class EndpointDirectory(InMemoryDirectory):
    """The in-memory directory, hosted as the app's one-replica deployment."""

    def __init__(self, ttl_s: float = ENDPOINT_TTL_S) -> None:
        super().__init__(ttl_s)
        self._peer_secret = secrets.token_bytes(32)  # per app, unless the env var is set

    async def peer_secret(self) -> bytes:
        """The app's generated peer-channel secret (used when TOKENROUTER_PEER_SECRET is
        not set). Only code inside the Ray cluster can call this handle."""
        return self._peer_secret


class ServeDirectory(RayDirectory):
    """The deployment's handle as a ``Directory``: a Serve handle's methods are called and
    awaited like a Ray actor's, so the Ray directory client serves as it is."""

    async def peer_secret(self) -> bytes:
        return await self._handle.peer_secret.remote()
