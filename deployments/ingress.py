"""The OpenAI HTTP ingress in Ray Serve: a thin shim over ``IngressServer``.

Everything an ingress does (admission, parsing, submitting, streaming, recovery, the SLO
cap, health, statistics) is Ray-free: ``IngressServer``
(tokenrouter_ray/ingress/openai_server.py) over an ``IngressCore``, and the FastAPI app over
it (tokenrouter_ray/ingress/http_app.py ``build_app``; docs/user-guide/reliability.md for
the rules). This deployment builds what only Ray knows and injects it: the endpoint directory
(``ServeDirectory``), the peer key and channel (``make_channel``), the peer book
(``PeerBook``: model endpoints, heartbeat, lost replicas), the models' infos and status and
the tuner's handle. Serve takes the app from ``__serve_build_asgi_app__``, called after the
constructor (Ray >= 2.60: ``@serve.ingress()`` without an app), and its health probe is
``check_health``, delegated to the server. Serve's proxy echoes ``X-Request-Id`` itself,
so the app does not add a second. With ``ingress.direct_port`` the replica also serves the
app itself on that port (ingress/direct_http.py: no proxy hop, and backpressure works), on
``ingress.direct_host`` (null: the node's own address, which only Ray knows here).
"""

from __future__ import annotations

import asyncio

import ray
from fastapi import FastAPI
from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments.autoscaling import ACTIVE, UTILISATION
from deployments.directory import ServeDirectory
from deployments.peers import PeerBook, make_channel, peer_key
from deployments.ray_metrics import ray_metrics
from tokenrouter_ray.app_config import spec_tokenizer
from tokenrouter_ray.config import AppConfig
from tokenrouter_ray.host_gc import tune_gc
from tokenrouter_ray.ingress.direct_http import DirectHttp
from tokenrouter_ray.ingress.http_app import build_app
from tokenrouter_ray.ingress.openai_server import IngressServer


@serve.deployment(max_ongoing_requests=1000, graceful_shutdown_timeout_s=5)
@serve.ingress()
class Ingress:
    async def __init__(
        self,
        cfg: AppConfig,
        directory: DeploymentHandle,
        models: dict[str, DeploymentHandle],
        tuner: DeploymentHandle | None = None,
    ) -> None:
        entry = cfg.model_names[0]
        tokenizer = await asyncio.to_thread(spec_tokenizer, cfg.models[entry])
        infos = [await models[name].info.remote() for name in cfg.model_names]
        metrics = ray_metrics(model_name=cfg.served_model_name)  # labels every ray_metrics()
        replica = serve.get_replica_context().replica_id.unique_id
        serve_directory = ServeDirectory(directory)
        key = await peer_key(serve_directory)
        channel = make_channel(cfg.transport, "ingress", replica, serve_directory, key, metrics)
        await channel.start()
        peers = PeerBook(
            serve_directory, cfg.model_names, own=channel.endpoint, on_lost=self._on_lost
        )
        self.ingress = IngressServer(
            cfg,
            channel,
            peers,
            tokenizer,
            infos,
            metrics=metrics,
            admission_cap=tuner.admission_cap.remote if tuner is not None else None,
            tuner_status=tuner.status.remote if tuner is not None else None,
            model_status={name: handle.status.remote for name, handle in models.items()},
            scorer=models[cfg.model_names[-1]].score.remote,  # the top model scores
        )
        await self.ingress.open()
        self.direct: DirectHttp | None = None
        if cfg.ingress.direct_port is not None:  # the same API on the replica's own port
            # no Serve proxy there: the app makes and echoes X-Request-Id itself
            app = build_app(self.ingress, echo_request_id=True)
            kib = cfg.ingress.direct_send_buffer_kib
            host = cfg.ingress.direct_host
            if host is None:  # the pod's own address (as the ZeroMQ mailboxes), not all
                host = ray.util.get_node_ip_address()
            self.direct = DirectHttp(
                app,
                host,
                cfg.ingress.direct_port,
                send_buffer_bytes=kib * 1024 if kib else None,
            )
            await self.direct.start()
        tune_gc(cfg.gc)  # started: what is alive now lives as long as the replica

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_app(self.ingress, echo_request_id=False)

    def _on_lost(self, lost: set[str]) -> None:
        self.ingress.on_lost(lost)

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """What Serve's autoscaler reads of this replica with ``ingress.autoscaling``
        (``deployments/autoscaling.py``): its active requests, and them against the most it
        admits (``max_active_requests``). Requests through the direct port count too, which
        Serve's own signal (ongoing requests through its proxy) would miss."""
        active = self.ingress.core.num_active
        return {ACTIVE: float(active), UTILISATION: active / max(1, self.ingress.cap.limit)}

    async def check_health(self) -> None:
        """Serve's health check (a failure restarts this replica): the server's, and the
        direct port's HTTP server when there is one."""
        self.ingress.check_health()
        if self.direct is not None and not self.direct.running:
            raise RuntimeError("the direct HTTP server stopped")

    async def __del__(self) -> None:
        """Serve stops this replica (scale-down, an update, the app deleted). Serve has let
        the requests through its proxy finish; those on the direct port may still run: with
        ingress autoscaling they get until ``request_timeout_s`` to end."""
        ingress = getattr(self, "ingress", None)
        if ingress is not None and ingress.cfg.ingress.autoscaling is not None:
            deadline = asyncio.get_running_loop().time() + ingress.timeout_s
            while ingress.core.num_active and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.1)
        if getattr(self, "direct", None) is not None:
            await self.direct.stop()
        if ingress is not None:
            await ingress.close()
