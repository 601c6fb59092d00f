"""The endpoint directory as a one-replica Serve deployment: lives and dies with the app.

Model servers and ingress replicas register their peer-channel endpoint here and look each
other up; ``ServeDirectory`` adapts its handle to the transport layer's ``Directory``.
"""

from __future__ import annotations

from ray import serve
from ray.serve.handle import DeploymentHandle

from tokenrouter_ray.transport.base import Directory, Endpoint


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
class EndpointDirectory:
    def __init__(self) -> None:
        self.endpoints: dict[str, Endpoint] = {}

    async def register(self, endpoint: Endpoint) -> None:
        self.endpoints[endpoint.name] = endpoint

    async def unregister(self, name: str) -> None:
        self.endpoints.pop(name, None)

    async def get(self, name: str) -> Endpoint | None:
        return self.endpoints.get(name)

    async def list(self, model: str | None) -> list[Endpoint]:
        found = [e for e in self.endpoints.values() if model is None or e.model == model]
        return sorted(found, key=lambda e: e.name)


class ServeDirectory(Directory):
    def __init__(self, handle: DeploymentHandle) -> None:
        self.handle = handle

    async def register(self, endpoint: Endpoint) -> None:
        await self.handle.register.remote(endpoint)

    async def unregister(self, name: str) -> None:
        await self.handle.unregister.remote(name)

    async def get(self, name: str) -> Endpoint | None:
        return await self.handle.get.remote(name)

    async def endpoints(self, model: str | None = None) -> list[Endpoint]:
        return await self.handle.list.remote(model)
