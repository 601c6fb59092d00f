"""The ingress side of the protocol: submit requests, assemble commits, abort.

``IngressCore`` is the single holder of each request's committed output. It sends NEW to
the entry model, orders COMMITs from whichever model committed (``CommitLog``), completes a
request once FINISHED arrived *and* every committed token up to the final length is in, and
broadcasts ABORT to every model endpoint (receivers that never held the request ignore it).
The OpenAI server and ``LocalRuntime`` both drive it.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import msgspec

from tokenrouter_ray.metrics import INGRESS, Metrics
from tokenrouter_ray.protocol import CommitLog, MsgKind, PeerReq, ProtocolError, SamplingSpec
from tokenrouter_ray.transport.base import ChannelClosed, PeerChannel


@dataclass
class Completion:
    request_id: str
    prompt_len: int
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    counts: dict[str, int] = field(default_factory=dict)  # committed tokens per model
    handoffs: int = 0
    error: str | None = None


class _Live:
    def __init__(self, rid: str, prompt_len: int) -> None:
        self.log = CommitLog(prompt_len)
        self.completion = Completion(rid, prompt_len)
        self.final_len: int | None = None
        self.aborted = False
        self.updates: asyncio.Queue[list[int] | None] = asyncio.Queue()
        self.submitted_at = time.monotonic()  # for TTFT / ITL / end-to-end metrics
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None

    @property
    def complete(self) -> bool:
        return self.final_len is not None and self.log.end >= self.final_len


class IngressCore:
    def __init__(
        self,
        channel: PeerChannel,
        entry_endpoint: Callable[[], str],
        all_endpoints: Callable[[], list[str]],
        metrics: Metrics | None = None,
    ) -> None:
        self.channel = channel
        self.metrics = metrics if metrics is not None else Metrics()
        self.entry_endpoint = entry_endpoint
        self.all_endpoints = all_endpoints
        self.live: dict[str, _Live] = {}
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._receive_loop(), name="ingress-recv")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, ChannelClosed):
                await self._task

    @property
    def num_active(self) -> int:
        return len(self.live)

    async def submit(
        self, rid: str, prompt: list[int], sampling: SamplingSpec, entry: str | None = None
    ) -> None:
        """Send NEW to ``entry`` (default: ``entry_endpoint()``)."""
        if rid in self.live:
            raise ValueError(f"request {rid!r} is already running")
        if sampling.seed is None:  # one seed for every model the request visits
            sampling = msgspec.structs.replace(sampling, seed=secrets.randbits(62))
        self.live[rid] = _Live(rid, len(prompt))
        self.metrics.ingress_active(self.num_active)
        dst = entry or self.entry_endpoint()
        msg = PeerReq(
            rid=rid,
            src=self.channel.name,
            dst=dst,
            kind=MsgKind.NEW,
            handoff_seq=0,
            tokens=list(prompt),
            sampling=sampling,
            active_requests=self.num_active,
        )
        await self.channel.send(dst, [msg])

    async def stream(self, rid: str) -> AsyncIterator[list[int]]:
        """Newly committed tokens as they become contiguous, until the request completes
        or is aborted."""
        live = self.live[rid]
        while (chunk := await live.updates.get()) is not None:
            yield chunk

    async def abort(self, rid: str, reason: str = "abort") -> None:
        """Stop the request on every model (unless it already completed); ``reason`` is its
        finish reason (``"stop"`` when the caller saw a stop string)."""
        live = self.live.get(rid)
        if live is None or live.complete or live.aborted:
            return
        live.aborted = True
        live.completion.finish_reason = reason
        live.updates.put_nowait(None)
        msgs = [
            PeerReq(
                rid=rid,
                src=self.channel.name,
                dst=dst,
                kind=MsgKind.ABORT,
                handoff_seq=0,
                active_requests=self.num_active - 1,
            )
            for dst in self.all_endpoints()
        ]
        await self.channel.send_grouped(msgs)

    def release(self, rid: str) -> Completion:
        """Forget a completed or aborted request; its final record."""
        live = self.live.pop(rid)
        self._record_done(live)
        return live.completion

    def _record_done(self, live: _Live) -> None:
        done, n = live.completion, len(live.completion.token_ids)
        tpot = None
        if n > 1 and live.first_token_at is not None and live.last_token_at is not None:
            tpot = (live.last_token_at - live.first_token_at) / (n - 1)
        self.metrics.request_done(
            done.finish_reason or "unknown",
            time.monotonic() - live.submitted_at,
            done.prompt_len,
            n,
            done.handoffs,
            tpot,
        )
        if done.error or done.finish_reason == "error":
            self.metrics.error(INGRESS, "request_failed")
        self.metrics.ingress_active(self.num_active)

    async def result(self, rid: str) -> Completion:
        async for _ in self.stream(rid):
            pass
        return self.release(rid)

    async def _receive_loop(self) -> None:
        async for batch in self.channel:
            for msg in batch:
                self.metrics.peer_message(INGRESS, msg.sent_at)
                self._on_message(msg)

    def _on_message(self, msg: PeerReq) -> None:
        live = self.live.get(msg.rid)
        if live is None or live.aborted:
            return
        if msg.kind == MsgKind.COMMIT:
            try:
                fresh = live.log.add(msg.anchor, msg.tokens)
            except ProtocolError as exc:
                self.metrics.error(INGRESS, "protocol_error")
                live.completion.error = str(exc)
                live.final_len = live.log.end
                fresh = []
            if fresh:
                self._record_tokens(live, len(fresh))
                live.completion.token_ids += fresh
                live.updates.put_nowait(fresh)
        elif msg.kind == MsgKind.FINISHED:
            live.final_len = msg.anchor
            live.completion.finish_reason = msg.finish_reason
            live.completion.counts = dict(msg.extras.get("counts", {}))
            live.completion.handoffs = int(msg.extras.get("handoffs", 0))
            live.completion.error = msg.extras.get("error")
            if live.completion.error:
                live.final_len = live.log.end
        if live.complete:
            live.updates.put_nowait(None)

    def _record_tokens(self, live: _Live, n: int) -> None:
        now = time.monotonic()
        if live.first_token_at is None:
            live.first_token_at = now
            self.metrics.first_token(now - live.submitted_at)
        else:
            self.metrics.inter_token((now - live.last_token_at) / n)
        live.last_token_at = now
