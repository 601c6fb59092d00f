"""The endpoint directory as a one-replica Serve deployment: lives and dies with the app.

Model servers and ingress replicas register their peer-channel endpoint here and look each
other up; ``ServeDirectory`` adapts its handle to the transport layer's ``Directory``.
Registrations are leases (``ENDPOINT_TTL_S``): every replica re-registers each
``HEARTBEAT_S`` (``PeerBook``), so a replica whose process died (and never unregistered)
disappears within the TTL, which is how the ingress learns to re-create its requests.

The app's peer secret (used when ``TOKENROUTER_PEER_SECRET`` is not set) outlives this
replica: it is generated once per app and kept in Ray's internal KV store (GCS), so a
restarted directory hands replicas started afterwards the same key as their peers
(``PeerSecretStore``). A restarted directory starts with no registrations; ``uptime_s``
lets the peer book wait out one lease before calling missing endpoints lost.
"""

from __future__ import annotations

import asyncio
import secrets
import time

from ray import serve
from ray.experimental import internal_kv

from tokenrouter_ray.transport.base import InMemoryDirectory
from tokenrouter_ray.transport.ray_channel import RayDirectory

HEARTBEAT_S = 0.5
ENDPOINT_TTL_S = 5.0
KV_NAMESPACE = "tokenrouter-ray"


class PeerSecretStore:
    """One app's generated peer secret in Ray's internal KV (the GCS): the first caller's
    random value wins (``overwrite=False``), every later one reads it back. Only code inside
    the Ray cluster can read it (the same boundary as calling the directory's handle)."""

    def __init__(self, app_name: str) -> None:
        self.key = f"peer-secret/{app_name}"

    def get_or_create(self) -> bytes:
        """Blocking (GCS round trips): call it through ``asyncio.to_thread``."""
        found = internal_kv._internal_kv_get(self.key, namespace=KV_NAMESPACE)
        if found:
            return found
        internal_kv._internal_kv_put(
            self.key, secrets.token_bytes(32), overwrite=False, namespace=KV_NAMESPACE
        )
        return internal_kv._internal_kv_get(self.key, namespace=KV_NAMESPACE)

    def delete(self) -> None:
        internal_kv._internal_kv_del(self.key, namespace=KV_NAMESPACE)


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
class EndpointDirectory(InMemoryDirectory):
    """The in-memory directory, hosted as the app's one-replica deployment."""

    async def __init__(self, ttl_s: float = ENDPOINT_TTL_S) -> None:
        super().__init__(ttl_s)
        self._started = time.monotonic()
        app_name = serve.get_replica_context().app_name
        self._peer_secret = await asyncio.to_thread(PeerSecretStore(app_name).get_or_create)

    async def peer_secret(self) -> bytes:
        """The app's generated peer-channel secret (used when TOKENROUTER_PEER_SECRET is
        not set), the same across restarts of this replica. Only code inside the Ray
        cluster can call this handle."""
        return self._peer_secret

    async def uptime_s(self) -> float:
        """Seconds since this replica started (a restarted directory knows no endpoint
        until each replica's next heartbeat)."""
        return time.monotonic() - self._started


class ServeDirectory(RayDirectory):
    """The deployment's handle as a ``Directory``: a Serve handle's methods are called and
    awaited like a Ray actor's, so the Ray directory client serves as it is."""

    async def peer_secret(self) -> bytes:
        return await self._handle.peer_secret.remote()

    async def uptime_s(self) -> float:
        return await self._handle.uptime_s.remote()
