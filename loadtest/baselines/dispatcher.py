"""Std. Serving: an external per-token dispatcher over one stock server per model.

On every handoff it sends the *full context* as text to the chosen model's server (a fresh
request: re-tokenize, re-prefill), and a run of positions routed to one model as one
streamed request. Routing is ``bernoulli(p)`` with the engine's seeded draw, so every
position goes where it goes in the tokenrouter run; since that draw does not depend on the
small model's output, an escalated position goes straight to the large model (the routed
system samples it on the small model first), which favours this baseline.

    python -m loadtest.baselines.dispatcher --small-url URL --large-url URL \
        --tokenizer DIR --p 0.35 --port 18211
"""

from __future__ import annotations

import argparse
import json
from collections.abc import AsyncIterator

import httpx
import uvicorn
from fastapi import FastAPI
from transformers import AutoTokenizer

from loadtest.baselines.api import Answer, ChatRequest, chat_app
from tokenrouter_ray.routing.baselines import seeded_uniform


class Dispatcher:
    def __init__(self, urls: dict[str, str], tokenizer: object, p: float) -> None:
        self.urls = urls  # {"small": base URL, "large": base URL}
        self.tokenizer = tokenizer
        self.p = p
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(900.0),
            limits=httpx.Limits(max_connections=512, max_keepalive_connections=512),
        )
        self.model_ids: dict[str, str] = {}

    async def model_id(self, name: str) -> str:
        if name not in self.model_ids:
            r = await self.client.get(f"{self.urls[name]}/v1/models")
            self.model_ids[name] = r.json()["data"][0]["id"]
        return self.model_ids[name]

    def route(self, seed: int, position: int) -> str:
        return "large" if seeded_uniform(seed, position) < self.p else "small"

    async def generate(self, req: ChatRequest, answer: Answer) -> AsyncIterator[str]:
        tok = self.tokenizer
        prompt_ids = tok.apply_chat_template(req.messages, add_generation_prompt=True)
        if not isinstance(prompt_ids, list):  # a BatchEncoding on newer tokenizers
            prompt_ids = list(prompt_ids["input_ids"])
        context_ids = list(prompt_ids)
        context = tok.decode(context_ids, clean_up_tokenization_spaces=False)
        answer.prompt_tokens = position = len(prompt_ids)
        previous = None
        while answer.completion_tokens < req.max_tokens:
            name = self.route(req.seed, position)
            run = 1  # the positions routed to the same model, sent as one request
            while (
                answer.completion_tokens + run < req.max_tokens
                and self.route(req.seed, position + run) == name
            ):
                run += 1
            if previous is not None and name != previous:
                answer.handoffs += 1
            previous = name
            text, produced, stopped = "", 0, False
            async for piece, usage, finish in self._stream(name, context, run, req.ignore_eos):
                if piece:
                    text += piece
                    yield piece
                if usage is not None:
                    produced = usage
                    stopped = finish == "stop" and produced < run
            context = self.extend(context_ids, text)
            position += produced
            answer.completion_tokens += produced
            answer.tokens_per_model[name] = answer.tokens_per_model.get(name, 0) + produced
            if stopped or produced == 0:
                answer.finish_reason = "stop"
                return
        answer.finish_reason = "length"

    def extend(self, context_ids: list[int], text: str) -> str:
        """The context as text again after a model's answer: through token ids, so pieces
        join as the tokenizer joins them (a word-level tokenizer's words need a space that
        neither piece carries; byte-level BPE round-trips exactly)."""
        context_ids += self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self.tokenizer.decode(context_ids, clean_up_tokenization_spaces=False)

    async def _stream(
        self, name: str, context: str, max_tokens: int, ignore_eos: bool
    ) -> AsyncIterator[tuple[str, int | None, str | None]]:
        eos = None if ignore_eos else self.tokenizer.eos_token_id
        body = {
            "model": await self.model_id(name),
            "prompt": context,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            # Usage comes in a stream only when asked (OpenAI's rule; transformers >= 5.25
            # follows it), and the produced count is read from it.
            "stream_options": {"include_usage": True},
            "generation_config": json.dumps({"do_sample": False, "eos_token_id": eos}),
        }
        async with self.client.stream(
            "POST", f"{self.urls[name]}/v1/completions", json=body
        ) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(f"{name} server: {chunk['error']}")
                choice = (chunk.get("choices") or [{}])[0]
                usage = chunk.get("usage")
                yield (
                    choice.get("text") or "",
                    None if usage is None else int(usage["completion_tokens"]),
                    choice.get("finish_reason"),
                )


def build_app(urls: dict[str, str], tokenizer_dir: str, p: float) -> FastAPI:
    dispatcher = Dispatcher(urls, AutoTokenizer.from_pretrained(tokenizer_dir), p)
    return chat_app(dispatcher.generate, "std-serving dispatcher")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small-url", required=True)
    parser.add_argument("--large-url", required=True)
    parser.add_argument("--tokenizer", required=True, help="model directory with the tokenizer")
    parser.add_argument("--p", type=float, default=0.35)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    app = build_app({"small": args.small_url, "large": args.large_url}, args.tokenizer, args.p)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
