"""What a replica needs to reach its peers: a channel of the configured kind, and a cached
view of every model's endpoints (refreshed in the background) for choosing replicas.

The refresh is also this replica's heartbeat: it re-registers its own endpoint (the
directory's registrations are leases), and it reports model endpoints that disappeared
(their replica died and its lease ran out) to ``on_lost``."""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
import zlib
from collections.abc import Callable
from typing import Any

import ray

from deployments.directory import ENDPOINT_TTL_S, ServeDirectory
from tokenrouter_ray.config import TransportSpec
from tokenrouter_ray.metrics import Metrics
from tokenrouter_ray.tasks import cancel_and_wait
from tokenrouter_ray.transport.auth import SECRET_ENV, derive_key
from tokenrouter_ray.transport.base import Directory, Endpoint, PeerChannel
from tokenrouter_ray.transport.unix_channel import UnixChannel
from tokenrouter_ray.transport.zmq_channel import ZmqChannel


async def peer_key(directory: ServeDirectory) -> bytes:
    """The MAC key for peer frames: from ``TOKENROUTER_PEER_SECRET`` (the same on every
    node), else from the app's generated secret held by the endpoint directory."""
    secret = os.environ.get(SECRET_ENV) or await directory.peer_secret()
    return derive_key(secret)


def make_channel(
    spec: TransportSpec,
    model: str,
    replica: str,
    directory: Directory,
    key: bytes | None = None,
    metrics: Metrics | None = None,
) -> PeerChannel:
    """A channel of the configured kind, given its validated section whole; its frames are
    signed with ``key`` (zmq and unix)."""
    if spec.kind == "ray":
        from tokenrouter_ray.transport.ray_channel import RayChannel

        return RayChannel(model, replica, directory)
    on_reject = RejectCounter(metrics, model) if metrics is not None else None
    if spec.kind == "unix":
        return UnixChannel(model, replica, directory, spec.unix, key=key, on_reject=on_reject)
    # tcp binds (and advertises) the pod's own address where the spec names no host
    node_ip = ray.util.get_node_ip_address() if spec.zmq.transport == "tcp" else None
    return ZmqChannel(
        model, replica, directory, spec.zmq, key=key, node_ip=node_ip, on_reject=on_reject
    )


logger = logging.getLogger("ray.serve")


class RejectCounter:
    """Rejected peer frames into ``tokenrouter_peer_rejected_total``, exported at most every
    ``FLUSH_S`` (a junk flood would otherwise pay one Ray metric call per frame on the
    model's event loop, beside its step loop); the first rejection after a quiet spell is
    exported at once, and ``flush`` (the health check calls it) exports the rest."""

    FLUSH_S = 0.5

    def __init__(self, metrics: Any, model: str) -> None:
        self.metrics = metrics
        self.model = model
        self.pending: collections.Counter[str] = collections.Counter()
        self.flushed_at = 0.0

    def __call__(self, reason: str) -> None:
        self.pending[reason] += 1
        if time.monotonic() - self.flushed_at >= self.FLUSH_S:
            self.flush()

    def flush(self) -> None:
        for reason, n in self.pending.items():
            self.metrics.peer_rejected(self.model, reason, n)
        self.pending.clear()
        self.flushed_at = time.monotonic()


class PeerBook:
    """model -> sorted endpoint names, refreshed every ``period_s``; heartbeats ``own``."""

    def __init__(
        self,
        directory: Directory,
        models: list[str],
        period_s: float = 0.5,
        own: Endpoint | None = None,
        on_lost: Callable[[set[str]], None] | None = None,
        alive: Callable[[], bool] | None = None,
    ) -> None:
        self.directory = directory
        self.models = models
        self.period_s = period_s
        self.own = own
        self.on_lost = on_lost
        self.alive = alive  # heartbeat only while this is true (a broken replica lapses)
        self.lease_s = ENDPOINT_TTL_S
        self.by_model: dict[str, list[str]] = {m: [] for m in models}
        self.excluded: set[str] = set()  # leaving replicas (DRAIN): never listed again
        self.last_refresh = time.monotonic()
        self._task: asyncio.Task | None = None

    async def start(self, wait_for_all: bool = True, timeout_s: float = 600) -> None:
        await self.refresh()
        deadline = asyncio.get_running_loop().time() + timeout_s
        while wait_for_all and not all(self.by_model.values()):
            if asyncio.get_running_loop().time() > deadline:
                missing = [m for m, e in self.by_model.items() if not e]
                raise TimeoutError(f"no replica of {missing} registered its endpoint")
            await asyncio.sleep(0.2)
            await self.refresh()
        self._task = asyncio.create_task(self._loop(), name="peerbook-refresh")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)

    async def refresh(self) -> None:
        beat = self.own is not None and (self.alive is None or self.alive())
        endpoints = await self.directory.heartbeat(self.own if beat else None)
        by_model: dict[str, list[str]] = {m: [] for m in self.models}
        for e in endpoints:
            if e.model in by_model and e.name not in self.excluded:
                by_model[e.model].append(e.name)
        listed = {e.name for e in endpoints}
        gone = self.excluded - listed  # left replicas whose lease has ended: lost now
        lost = (set(self.all()) | gone) - {n for names in by_model.values() for n in names}
        if lost and await self._directory_is_new():
            return  # it restarted: endpoints come back with their next heartbeat
        self.excluded &= listed
        self.by_model = by_model
        self.last_refresh = time.monotonic()
        if lost and self.on_lost is not None:
            self.on_lost(lost)

    async def _directory_is_new(self) -> bool:
        """The directory restarted less than one lease ago (it knows only the endpoints
        that heartbeat since): missing endpoints are not lost yet."""
        uptime = getattr(self.directory, "uptime_s", None)
        if uptime is None:
            return False
        try:
            return await uptime() < self.lease_s
        except Exception:  # an older directory without uptime_s: decide as before
            return False

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            try:
                await asyncio.wait_for(self.refresh(), timeout=max(2.0, 4 * self.period_s))
            except Exception as exc:  # the directory restarting must not stop the loop
                logger.warning("peer book refresh failed: %r", exc)

    @property
    def healthy(self) -> bool:
        """Every model has a replica, and the view is recent."""
        return all(self.by_model.values()) and self.refreshing

    @property
    def refreshing(self) -> bool:
        return self._task is not None and not self._task.done()

    def exclude(self, endpoint: str) -> None:
        """A replica that is leaving (it sent DRAIN): out of ``by_model`` now and at every
        refresh while its lease lasts; reported to ``on_lost`` once the lease ends."""
        self.excluded.add(endpoint)
        for names in self.by_model.values():
            if endpoint in names:
                names.remove(endpoint)

    def missing(self) -> list[str]:
        return [m for m, names in self.by_model.items() if not names]

    def all(self) -> list[str]:
        return [e for m in self.models for e in self.by_model[m]]

    def sticky(self, model: str, key: str) -> str:
        """A model server's fallback for a request that names no replica of ``model``
        (never one from this app's ingress: it places every model, ingress/placement.py):
        spread by request id."""
        options = self.by_model[model]
        if not options:
            raise LookupError(f"no replica of model {model!r} is registered")
        return options[zlib.crc32(key.encode()) % len(options)]
