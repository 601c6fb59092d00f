"""``LocalRuntime``: M model replicas and an ingress in one process and one event loop,
wired by in-process channels (the same code the Ray Serve deployments run over ZeroMQ or
Ray). Used by tests, benchmarks and anyone routing on one machine without Ray.

Replicas are chosen by production's rule (ingress/placement.py ``Placement``): with one
replica per model that is the only one, picked by each model on a request's first visit
(``pick_endpoint``). ``ReplicatedRuntime`` (simulation/backend.py) runs several replicas
and places every request at the ingress, as the Serve ingress does (``place_at_ingress``:
each model's replica named in the NEW).

    async with LocalRuntime([("small", e0), ("large", e1)], policy) as runtime:
        completion = await runtime.complete(prompt_ids, SamplingSpec(temperature=0))
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tokenrouter_ray.ingress.core import IngressCore, RequestResult
from tokenrouter_ray.ingress.placement import Placement
from tokenrouter_ray.metrics import Metrics
from tokenrouter_ray.protocol import SamplingSpec
from tokenrouter_ray.replica.messages import HandoffRecord
from tokenrouter_ray.replica.step import Replica
from tokenrouter_ray.routing.policy import Policy
from tokenrouter_ray.transport.base import InMemoryDirectory, endpoint_model, endpoint_name
from tokenrouter_ray.transport.inproc import InProcChannel, InProcHub

if TYPE_CHECKING:
    from tokenrouter_ray.engine.engine import Engine


class LocalRuntime:
    def __init__(
        self,
        engines: Sequence[tuple[str, Engine]],
        policy: Policy,
        channel_type: type[InProcChannel] = InProcChannel,
        metrics: Metrics | None = None,
        transit_s: float = 0.0,
        prefill_at: dict[str, int] | None = None,
    ) -> None:
        """``transit_s``: each frame between the models and the ingress arrives this long
        after it was sent (``InProcHub``: a simulated network; 0 by default).
        ``prefill_at``: model -> prompt length from which prompts are prefilled there at
        admission too (``ModelSpec.prefill_at_admission``; ``IngressCore``)."""
        self.models = [name for name, _ in engines]
        if policy.models != self.models:
            raise ValueError(f"policy routes {policy.models}, runtime has {self.models}")
        self.engines = dict(engines)
        self.policy = policy
        self.channel_type = channel_type
        # Default: prometheus-client on its global registry, labelled with the policy.
        self.metrics = metrics if metrics is not None else Metrics(policy=policy.name)
        self.model_replicas: list[Replica] = []
        self.ingress: IngressCore | None = None
        self._ids = itertools.count()
        # model -> its replicas' endpoints; what the placement chooses from
        self.replicas: dict[str, list[str]] = {m: [endpoint_name(m, "0")] for m in self.models}
        self.placement = Placement(self.replicas.__getitem__, self._block_sizes())
        self.place_at_ingress = False  # True: every model's replica named in the NEW
        self.transit_s = transit_s
        self.prefill_at = prefill_at
        self._moving: set[asyncio.Task] = set()  # requests being moved off a drained replica

    def _block_sizes(self) -> dict[str, int]:
        return {
            name: getattr(getattr(engine, "config", None), "block_size", 16)
            for name, engine in self.engines.items()
        }

    async def __aenter__(self) -> LocalRuntime:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        hub, directory = InProcHub(self.transit_s), InMemoryDirectory()
        for index, name in enumerate(self.models):
            channel = self.channel_type(name, "0", directory, hub)
            await channel.start()
            server = Replica(
                self.models,
                index,
                self.engines[name],
                self.policy,
                channel,
                pick_endpoint=lambda model, rid: self.placement.choose(model),
                metrics=self.metrics,
            )
            await server.start()
            self.model_replicas.append(server)
        channel = self.channel_type("ingress", "0", directory, hub)
        await channel.start()
        endpoints = [s.endpoint for s in self.model_replicas]
        self.ingress = IngressCore(
            channel,
            lambda: endpoints[0],
            lambda: endpoints,
            metrics=self.metrics,
            prefill_at=self.prefill_at,
        )
        self.ingress.on_drain = self.on_drain
        await self.ingress.start()

    def on_drain(self, endpoint: str) -> None:
        """A replica is leaving (``Replica.drain`` sent DRAIN): production's rule
        (``IngressServer.on_drain``): no longer placed, and its requests moved to the
        model's other replicas (``IngressCore.move_off``)."""
        model = endpoint_model(endpoint)
        if endpoint in self.replicas.get(model, []):
            self.replicas[model].remove(endpoint)
        self.placement.forget(endpoint)
        replace = None
        if self.place_at_ingress:  # the requests name their replicas: choose them anew
            others = self.models[1:]

            def replace(rid: str) -> dict[str, str]:
                return self.placement.replace(rid, others)

        task = asyncio.get_running_loop().create_task(self.ingress.move_off(endpoint, replace))
        self._moving.add(task)
        task.add_done_callback(self._moving.discard)

    async def drain(self, endpoint: str, timeout_s: float = 30.0) -> int:
        """Stop one replica the way Serve's scale-down does (``ModelServer._leave``): drain
        it (its requests move to the model's other replicas), then stop its loops. Returns
        how many requests were still on it when it stopped (0: nothing lost)."""
        server = next(s for s in self.model_replicas if s.endpoint == endpoint)
        left = await server.drain(timeout_s)
        await server.stop()
        return left

    async def stop(self) -> None:
        """Every model replica's loops first (nothing sends after this), then the ingress, then
        the channels: a channel closed while a peer still runs makes that peer's last sends
        fail ("nothing is bound at ...") at every teardown."""
        for server in self.model_replicas:
            await server.stop()
        if self.ingress is not None:
            await self.ingress.stop()
            await self.ingress.channel.close()
        for server in self.model_replicas:
            await server.channel.close()
        self.model_replicas = []

    async def complete(
        self,
        prompt: Sequence[int],
        sampling: SamplingSpec,
        request_id: str | None = None,
        alone: str | None = None,
        max_share: float | None = None,
        thresholds: tuple[float, ...] = (),
    ) -> RequestResult:
        """One request to its end; ``alone``: served by that model by itself (bypass);
        ``max_share``: its cap on the top model's share (``capped_dst``); ``thresholds``:
        its own decision threshold(s) (``RouteState.thresholds``; (): the policy's)."""
        rid = request_id or f"local-{next(self._ids)}"
        try:
            await self.submit(rid, prompt, sampling, alone, max_share, thresholds)
            return await self.ingress.result(rid)
        finally:
            self.placement.release(rid)

    async def submit(
        self,
        rid: str,
        prompt: Sequence[int],
        sampling: SamplingSpec,
        alone: str | None = None,
        max_share: float | None = None,
        thresholds: tuple[float, ...] = (),
    ) -> None:
        """Send a request to the ingress core; with ``place_at_ingress``, placed first (its
        replicas stay counted until ``placement.release(rid)``)."""
        own = {"alone": alone, "max_share": max_share, "thresholds": thresholds}
        if not self.place_at_ingress or alone is not None:
            await self.ingress.submit(rid, list(prompt), sampling, **own)
            return
        placed = self.placement.place(rid, self.models, prompt)
        entry, *others = (placed[m] for m in self.models)
        endpoints = dict(zip(self.models[1:], others, strict=True))
        await self.ingress.submit(rid, list(prompt), sampling, entry, endpoints=endpoints, **own)

    async def complete_all(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingSpec
    ) -> list[RequestResult]:
        return list(await asyncio.gather(*(self.complete(p, sampling) for p in prompts)))

    async def wait_idle(self, timeout: float = 30.0) -> None:
        """Until no model holds any request (after aborts, finishes and late messages) and
        every model's gauges say so (an idle step thread sets them within ``STATE_PERIOD_S``
        of its last step)."""
        deadline = asyncio.get_running_loop().time() + timeout
        while any(s.holds_anything or s.gauges_stale for s in self.model_replicas):
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError("models still hold requests")
            await asyncio.sleep(0.01)

    @property
    def handoffs(self) -> list[HandoffRecord]:
        return [h for s in self.model_replicas for h in s.messages.log]
