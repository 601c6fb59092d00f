"""What an ingress does when a model replica is lost, and how many requests it admits.

``Recovery``: model endpoints whose lease ran out (their replicas died) are reported with
``lost``; once every model has a replica again (``missing()`` empty, waited for at most
``timeout_s``), the unfinished requests assigned to the lost endpoints are re-created
(``IngressCore.recreate``) on the replicas ``endpoints_for`` picks. Losses reported while a
recovery runs join it. Each recovery is recorded in ``log`` (what ``/v1/tokenrouter/stats``
shows); ``running`` tells the admission check to answer 503 meanwhile.

``AdmissionCap``: the most requests one ingress replica admits at once, the configured
``max_active_requests`` or, in SLO mode, the tuner's cap for the whole app split over the
ingress replicas, whichever is lower; ``follow`` polls the tuner for it.

Both are plain asyncio, without Ray: ``IngressServer`` (ingress/openai_server.py) wires
them to its peer view, its placement (``endpoints_for`` re-places by ingress/placement.py)
and the tuner's cap; the tests drive them over ``LocalRuntime`` and that server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from tokenrouter_ray.ingress.core import IngressCore

logger = logging.getLogger(__name__)


class Recovery:
    """Re-creates the requests of lost model replicas (see the module docstring)."""

    def __init__(
        self,
        core: IngressCore,
        missing: Callable[[], list[str]],
        endpoints_for: Callable[[str], dict[str, str]],
        timeout_s: float,
        poll_s: float = 0.1,
        recreated: Callable[[int], None] | None = None,
    ) -> None:
        self.core = core
        self.missing = missing  # models without a live replica now
        self.endpoints_for = endpoints_for  # rid -> the replica of each non-entry model
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.recreated = recreated  # told how many requests each recovery re-created
        self.log: list[dict[str, Any]] = []
        self._lost: set[str] = set()
        self._task: asyncio.Task | None = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def lost(self, endpoints: set[str]) -> None:
        """These endpoints' replicas are gone: recover their requests (once per loss)."""
        self._lost |= endpoints
        if not self.running:
            self._task = asyncio.create_task(self._run(), name="ingress-recover")

    async def wait(self) -> None:
        """Until the current recovery, if any, is done (tests)."""
        if self._task is not None:
            await asyncio.shield(self._task)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while self._lost:
            lost, self._lost = sorted(self._lost), set()
            started = loop.time()
            while self.missing() and loop.time() - started < self.timeout_s:
                await asyncio.sleep(self.poll_s)  # requests wait (bounded by their deadlines)
            try:
                n = await self.core.recreate(
                    self.endpoints_for, reason=f"replica {', '.join(lost)} lost", lost=set(lost)
                )
            except Exception:
                logger.exception("ingress: re-creating requests failed")
                n = -1
            self.log.append(
                {"lost": lost, "recreated": n, "waited_s": round(loop.time() - started, 3)}
            )
            logger.warning("ingress: lost %s, re-created %d requests", lost, n)
            if n > 0 and self.recreated is not None:
                self.recreated(n)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


class AdmissionCap:
    """The admission limit of one ingress replica (see the module docstring)."""

    def __init__(self, configured: int, ingress_replicas: int = 1) -> None:
        self.configured = configured
        self.ingress_replicas = max(1, ingress_replicas)
        self.slo: int | None = None  # the tuner's cap, this replica's share

    @property
    def limit(self) -> int:
        return min(self.configured, self.slo if self.slo is not None else 1 << 30)

    def adopt(self, app_cap: int | None) -> None:
        """The tuner's cap for the whole app (None: no cap); each replica takes its share."""
        self.slo = None if app_cap is None else max(1, -(-app_cap // self.ingress_replicas))

    async def follow(
        self, fetch: Callable[[], Awaitable[int | None]], period_s: float, timeout_s: float = 10
    ) -> None:
        """Poll ``fetch`` (the tuner's ``admission_cap``) every ``period_s``, forever; a
        failed poll keeps the last cap (the tuner may be restarting)."""
        while True:
            await asyncio.sleep(period_s)
            with contextlib.suppress(Exception):
                self.adopt(await asyncio.wait_for(fetch(), timeout=timeout_s))
