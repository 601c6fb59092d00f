"""The endpoint directory as a one-replica Serve deployment: lives and dies with the app.

Model servers and ingress replicas register their peer-channel endpoint here and look each
other up; ``ServeDirectory`` adapts it to the transport layer's ``Directory``.
Registrations are leases (``ENDPOINT_TTL_S``): every replica re-registers each
``HEARTBEAT_S`` (``PeerBook``), so a replica whose process died (and never unregistered)
disappears within the TTL, which is how the ingress learns to re-create its requests.

The registrations live in a plain Ray actor that the deployment's replica creates and owns
(``EndpointDirectoryState``: it dies with the replica, and a restarted replica makes a new
one), and peers call that actor directly; the Serve handle only hands its handle out
(``state``) and the peer secret. Why not Serve handle calls: Ray Serve 2.60 runs every handle
call as a streaming generator (``handle_request_with_rejection``), and a caller whose process
freezes in the middle of one (SIGSTOP, a VM paused, swap) stalls the callee's replica for
every other caller until the caller runs again (measured: a frozen caller stalled its callee
in 5 of 6 tries through Serve and 4 of 5 with Ray's own streaming generators, never with plain
actor calls; ``tests/deployments/test_directory_state.py``). A model replica stalled past
its lease then froze the directory, no lease could run out, and its requests were never
re-created (``tests/deployments/test_orphans.py`` failed so about one run in six).

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
from typing import Any

import ray
from ray import serve
from ray.experimental import internal_kv

from tokenrouter_ray.transport.base import Endpoint, InMemoryDirectory
from tokenrouter_ray.transport.ray_channel import RayDirectory

HEARTBEAT_S = 0.5
ENDPOINT_TTL_S = 5.0
STATE_HEALTH_TIMEOUT_S = 10.0  # the replica's health check waits this long for its state
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


class EndpointDirectoryState(InMemoryDirectory):
    """The registrations (leases), as a plain Ray actor owned by the directory's replica."""

    def __init__(self, ttl_s: float = ENDPOINT_TTL_S) -> None:
        super().__init__(ttl_s)
        self._started = time.monotonic()

    async def uptime_s(self) -> float:
        """Seconds since this state started (a new one knows no endpoint until each
        replica's next heartbeat)."""
        return time.monotonic() - self._started


DirectoryStateActor = ray.remote(num_cpus=0)(EndpointDirectoryState)


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
class EndpointDirectory:
    """The directory's replica: it owns the state actor and hands out its handle and the
    app's peer secret. A health check that cannot reach the state fails the replica, so
    Serve restarts it with a new state."""

    async def __init__(self, ttl_s: float = ENDPOINT_TTL_S) -> None:
        app_name = serve.get_replica_context().app_name
        self._peer_secret = await asyncio.to_thread(PeerSecretStore(app_name).get_or_create)
        self._state = DirectoryStateActor.remote(ttl_s)  # owned here: it dies with this replica
        await self._state.uptime_s.remote()  # up before this replica reports ready

    async def state(self) -> Any:
        """The state actor's handle (peers call it directly: see the module docstring)."""
        return self._state

    async def peer_secret(self) -> bytes:
        """The app's generated peer-channel secret (used when TOKENROUTER_PEER_SECRET is
        not set), the same across restarts of this replica. Only code inside the Ray
        cluster can call this handle."""
        return self._peer_secret

    async def uptime_s(self) -> float:
        return await self._state.uptime_s.remote()

    async def endpoints(self, model: str | None = None) -> list[Endpoint]:
        """Every registered endpoint (or one model's), for operators and tests."""
        return await self._state.endpoints.remote(model)

    async def check_health(self) -> None:
        await asyncio.wait_for(self._state.uptime_s.remote(), STATE_HEALTH_TIMEOUT_S)


class ServeDirectory(RayDirectory):
    """The directory as a peer sees it: ``RayDirectory``'s calls, made to the state actor,
    whose handle the Serve deployment hands out on first use and again after a call failed
    (the replica restarted with a new state, or the state is gone). Picklable."""

    def __init__(self, handle: Any) -> None:
        super().__init__(None)  # the state actor, once asked for
        self._serve = handle  # the EndpointDirectory deployment's handle

    async def _call(self, method: str, *args: Any) -> Any:
        if self._handle is None:
            self._handle = await self._serve.state.remote()
        try:
            return await super()._call(method, *args)
        except Exception:
            self._handle = None  # ask the deployment again next time
            raise

    async def uptime_s(self) -> float:
        return await self._call("uptime_s")

    async def peer_secret(self) -> bytes:
        return await self._serve.peer_secret.remote()
