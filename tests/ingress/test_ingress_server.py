"""The whole OpenAI flow on CPU without Ray: the official ``openai`` client -> the real
FastAPI app of deployments/ingress.py (over ASGI, in-process) -> ``IngressServer``
(admission, placement, one loop per choice) -> ``IngressCore`` -> two model
model replicas with tiny real models (``LocalRuntime``), and back. Ray Serve LLM tests its
server the same way, with the engine injected."""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest
from transformers import AutoTokenizer

from tests.openai.ingress_app import SERVED, served
from tests.tiny_models import chain_engines
from tokenrouter_ray.ingress.openai_server import IngressServer
from tokenrouter_ray.local import LocalRuntime
from tokenrouter_ray.openai.schemas import CompletionRequest
from tokenrouter_ray.openai.validation import RequestLimits, parse_request, prepare_completion
from tokenrouter_ray.protocol import SamplingSpec
from tokenrouter_ray.routing.policy import build_policy

TWO = ["small", "large"]
PROMPTS = [[(5 * i + j) % 128 for j in range(4 + 3 * i)] for i in range(3)]


def ids_of(text: str) -> list[int]:
    return [int(w[1:]) for w in text.split()]


def run_flow(dirs: dict[str, str], body: Any) -> Any:
    """Start the runtime and the app, run ``body(client, runtime, server)``, check that
    nothing is left on any model, return what the body returned."""
    tokenizer = AutoTokenizer.from_pretrained(dirs["small"])
    limits = RequestLimits(max_model_len=256, vocab_size=128)

    async def go() -> Any:
        policy = build_policy("entropy", {"threshold": 0.45}, TWO)
        async with served(chain_engines(dirs, TWO), policy, tokenizer, limits=limits) as s:
            result = await body(s.client, s.runtime, s.ingress)
            await s.idle()
            return result

    return asyncio.run(go())


def test_completions_equal_the_runtime_and_stream_the_same_text(served_chain_dirs) -> None:
    async def body(client: Any, runtime: LocalRuntime, server: IngressServer) -> None:
        spec = SamplingSpec(temperature=0.0, max_tokens=20, seed=0)
        want = [await runtime.complete(p, spec) for p in PROMPTS]
        got = await asyncio.gather(*(
            client.completions.create(model=SERVED, prompt=p, max_tokens=20, temperature=0, n=2)
            for p in PROMPTS
        ))  # fmt: skip
        for w, response in zip(want, got, strict=True):
            assert [ids_of(c.text) for c in response.choices] == [w.token_ids] * 2
            assert response.usage.completion_tokens == 2 * len(w.token_ids)
            routing = response.choices[0].model_extra["routing"]
            assert routing["tokens_per_model"] == w.counts
        assert sum(w.handoffs for w in want) > 3  # both models answered
        assert sum(server.entry_total.values()) == 2 * len(PROMPTS)
        stream = await client.chat.completions.create(
            model=SERVED, max_tokens=20, temperature=0, stream=True,
            messages=[{"role": "user", "content": " ".join(f"w{t}" for t in PROMPTS[1])}],
        )  # fmt: skip
        pieces, reasons = [], []
        async for chunk in stream:
            for choice in chunk.choices:
                pieces.append(choice.delta.content or "")
                reasons.append(choice.finish_reason)
        plain = await client.chat.completions.create(
            model=SERVED, max_tokens=20, temperature=0,
            messages=[{"role": "user", "content": " ".join(f"w{t}" for t in PROMPTS[1])}],
        )  # fmt: skip
        assert "".join(pieces) == plain.choices[0].message.content and pieces
        assert reasons[-1] == plain.choices[0].finish_reason == "length"

    run_flow(served_chain_dirs, body)


def test_admission_stop_strings_and_refused_fields(served_chain_dirs) -> None:
    async def body(client: Any, runtime: LocalRuntime, server: IngressServer) -> None:
        server.cap.configured = 1
        with pytest.raises(openai.InternalServerError) as full:  # n=2 > the limit
            await client.completions.create(model=SERVED, prompt=PROMPTS[0], max_tokens=4, n=2)
        assert full.value.status_code == 503 and full.value.response.headers["retry-after"]
        large = runtime.replicas["large"]
        runtime.replicas["large"] = []  # no replica of the large model
        with pytest.raises(openai.InternalServerError) as down:
            await client.completions.create(model=SERVED, prompt=PROMPTS[0], max_tokens=4)
        assert down.value.status_code == 503 and down.value.code == "model_unavailable"
        server.cap.configured, runtime.replicas["large"] = 8, large
        for field, value in (("min_p", 1.1), ("repetition_penalty", 0)):
            with pytest.raises(openai.BadRequestError) as bad:
                await client.completions.create(
                    model=SERVED, prompt=PROMPTS[0], max_tokens=4, extra_body={field: value}
                )
            assert bad.value.param == field
        full_text = (
            (
                await client.completions.create(
                    model=SERVED, prompt=PROMPTS[2], max_tokens=20, temperature=0
                )
            )
            .choices[0]
            .text
        )
        words = full_text.split()
        stop = words[3]
        cut = await client.completions.create(
            model=SERVED, prompt=PROMPTS[2], max_tokens=20, temperature=0, stop=[stop]
        )
        assert cut.choices[0].finish_reason == "stop"
        assert cut.choices[0].text == full_text[: full_text.index(stop)]

    run_flow(served_chain_dirs, body)


def test_a_choice_cancelled_before_it_ever_ran_is_still_closed(served_chain_dirs) -> None:
    """The race the Serve cancellation test found: the handler is cancelled right after
    admission, before the choice tasks' first step, so ``choice``'s ``finally`` never runs;
    the tasks' done callbacks must still close every choice."""
    tokenizer = AutoTokenizer.from_pretrained(served_chain_dirs["small"])

    async def go() -> None:
        policy = build_policy("bernoulli", {"p": 0.5}, TWO)
        engines = chain_engines(served_chain_dirs, TWO)
        async with served(engines, policy, tokenizer) as flow:
            rt, server = flow.runtime, flow.ingress
            (entry,) = rt.replicas["small"]
            body = {"model": SERVED, "prompt": [1, 2, 3], "max_tokens": 100, "n": 3}
            limits = RequestLimits(max_model_len=256, vocab_size=128)
            prepared = prepare_completion(parse_request(CompletionRequest, body), tokenizer, limits)
            submitted = await server.submit(prepared)
            assert server.entry_load == {entry: 3}
            tasks = server.start_choices(submitted, prepared, None)
            for task in tasks:
                task.cancel()  # before any of them first runs
            await asyncio.gather(*tasks, return_exceptions=True)
            assert rt.ingress.num_active == 0 and server.entry_load == {entry: 0}
            await rt.wait_idle()
            assert all(not s.engine.requests for s in rt.model_replicas)

    asyncio.run(go())
