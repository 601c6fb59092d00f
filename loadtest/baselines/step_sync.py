"""Step-Sync: one batch advances in lock-step across models (the offline loop of R2R and
CITER), served over the same chat API; with one model, that model alone on our engine.

Both models are our ``Engine`` (KV kept across handoffs), so the only difference from
tokenrouter is the barrier: the next small step waits for the large model's escalated
positions. Routing is ``bernoulli(p)`` with the engine's seeded draw, as in tokenrouter.

    python -m loadtest.baselines.step_sync --models SMALL_DIR,LARGE_DIR --p 0.35 --port 18212
"""

from __future__ import annotations

import argparse
import asyncio
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI
from transformers import AutoTokenizer

from loadtest.baselines.api import Answer, ChatRequest, chat_app, posted_tokens
from tokenrouter_ray.engine.config import EngineConfig
from tokenrouter_ray.engine.engine import Engine
from tokenrouter_ray.engine.request import SamplingParams
from tokenrouter_ray.openai.chat import render_chat
from tokenrouter_ray.openai.detokenizer import IncrementalDetokenizer
from tokenrouter_ray.routing.baselines import seeded_uniform


@dataclass
class Live:
    """One request in the loop: its committed sequence and where its tokens go."""

    seed: int
    sequence: list[int]
    sampling: SamplingParams
    num_prompt_tokens: int
    out: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    large_anchor: int = 0  # tokens the large engine holds
    per_model: dict[str, int] = field(default_factory=dict)
    handoffs: int = 0

    def emit(self, item: tuple[str, list[int]] | tuple[str, str]) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, item)


class LockStep:
    """The engine loop, on its own thread; requests enter through a queue."""

    def __init__(self, engines: list[Engine], p: float) -> None:
        self.engines = engines  # [small, large] or [alone]
        self.names = ["small", "large"] if len(engines) == 2 else ["alone"]
        self.p = p
        self.inbox: queue.Queue[tuple[str, Live]] = queue.Queue()
        self.live: dict[str, Live] = {}
        self.thread = threading.Thread(target=self._run, daemon=True, name="step-sync")
        self.thread.start()

    def _run(self) -> None:
        while True:
            self._admit(block=not self.live)
            self._step()

    def _admit(self, block: bool) -> None:
        try:
            item = self.inbox.get(timeout=1.0) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            rid, live = item
            if live is None:  # the client went away
                self._end(rid, None)
            else:
                try:
                    self.engines[0].add_request(rid, live.sequence, live.sampling)
                except ValueError as exc:  # the loop outlives a bad request
                    live.emit(("error", str(exc)))
                else:
                    self.live[rid] = live
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _step(self) -> None:
        small = self.engines[0]
        result = small.execute()
        if result is None:
            return
        escalate = set()
        if len(self.engines) == 2:
            for rid, pos in zip(result.request_ids, result.positions, strict=True):
                live = self.live.get(rid)
                if live is not None and seeded_uniform(live.seed, pos) < self.p:
                    escalate.add(rid)
        outputs = small.commit(result, drop=escalate, pause=escalate)
        for out in outputs:
            self._commit(out.request_id, self.names[0], out.new_token_ids, out.finished)
        handed = [rid for rid in escalate if rid in self.live]
        if handed:
            self._large_turn(handed)

    def _large_turn(self, handed: list[str]) -> None:
        """The barrier: the large model produces every escalated position, then returns."""
        small, large = self.engines
        for rid in handed:
            live = self.live[rid]
            live.handoffs += 2  # there and back
            if rid in large.requests:
                large.resume(rid, live.sequence[live.large_anchor :])
            else:
                large.add_request(rid, live.sequence, live.sampling, live.num_prompt_tokens)
            live.large_anchor = len(live.sequence)
        waiting = set(handed)
        while waiting:
            result = large.execute()
            if result is None:
                break
            outputs = large.commit(result, pause=set(result.request_ids))
            for out in outputs:
                waiting.discard(out.request_id)
                live = self.live.get(out.request_id)
                if live is None:
                    continue
                self._commit(out.request_id, "large", out.new_token_ids, out.finished)
                if not out.finished:
                    live.large_anchor = len(live.sequence)
                    small.resume(out.request_id, out.new_token_ids)

    def _commit(self, rid: str, model: str, tokens: list[int], finished: bool) -> None:
        live = self.live.get(rid)
        if live is None:
            return
        live.sequence.extend(tokens)
        live.per_model[model] = live.per_model.get(model, 0) + len(tokens)
        live.emit(("tokens", tokens))
        if finished:
            self._end(rid, "done")

    def _end(self, rid: str, how: str | None) -> None:
        live = self.live.pop(rid, None)
        for engine in self.engines:
            engine.abort(rid)  # frees its KV; a no-op where it holds nothing
        if live is not None and how is not None:
            live.emit(("end", how))


class StepSyncServer:
    def __init__(self, model_dirs: list[str], p: float, dtype: str, budget_gb: float) -> None:
        budget = int(budget_gb * 2**30)
        engines = [
            Engine.from_config(EngineConfig(model=d, dtype=dtype, memory_budget_bytes=budget))
            for d in model_dirs
        ]
        self.tokenizer = AutoTokenizer.from_pretrained(model_dirs[-1])
        self.loop = LockStep(engines, p)
        self.count = 0

    async def generate(self, req: ChatRequest, answer: Answer) -> AsyncIterator[str]:
        prompt = render_chat(self.tokenizer, req.messages)
        self.count += 1
        rid = f"ss-{self.count}"
        sampling = SamplingParams(
            temperature=0.0, max_tokens=req.max_tokens, seed=req.seed, ignore_eos=req.ignore_eos
        )
        out: asyncio.Queue = asyncio.Queue()
        live = Live(req.seed, list(prompt), sampling, len(prompt), out, asyncio.get_running_loop())
        detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids=prompt)
        answer.prompt_tokens = len(prompt)
        self.loop.inbox.put((rid, live))
        try:
            async for value in posted_tokens(out):
                answer.completion_tokens += len(value)
                yield detok.push(value)
        finally:
            if rid in self.loop.live:
                self.loop.inbox.put((rid, None))
        answer.tokens_per_model = dict(live.per_model)
        answer.handoffs = live.handoffs
        answer.finish_reason = "length" if answer.completion_tokens >= req.max_tokens else "stop"


def build_app(
    model_dirs: list[str], p: float, dtype: str = "auto", budget_gb: float = 1.5
) -> FastAPI:
    server = StepSyncServer(model_dirs, p, dtype, budget_gb)
    return chat_app(server.generate, "step-sync")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", required=True, help="SMALL,LARGE (Step-Sync) or one model")
    parser.add_argument("--p", type=float, default=0.35)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--memory-budget-gb", type=float, default=1.5)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    app = build_app(args.models.split(","), args.p, args.dtype, args.memory_budget_gb)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
