"""Tools and reasoning with real (tiny, random-weight) Qwen3 models that hand a request back
and forth: the official ``openai`` client -> the real FastAPI app over ASGI ->
``IngressServer`` -> two model replicas (``LocalRuntime``). What reaches the models is
the chat template's rendering with the tools, and the served message is exactly the
reasoning / tool-call parse of the tokens the models wrote (the runtime's own answer to
the same prompt), streamed or not."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from tests.engine.conftest import make_engine
from tests.openai.ingress_app import SERVED, served
from tests.openai.qwen3_tiny import save_qwen3_models
from tests.openai.test_reasoning_tools import WEATHER, streamed
from tokenrouter_ray.openai.chat_output import ChatOutputSpec
from tokenrouter_ray.openai.reasoning import QWEN3
from tokenrouter_ray.openai.validation import RequestLimits
from tokenrouter_ray.protocol import SamplingSpec
from tokenrouter_ray.routing.policy import build_policy

TWO = ["small", "large"]
MESSAGES = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 18}'},
]  # fmt: skip


def test_tools_and_reasoning_with_real_models(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    dirs = save_qwen3_models(tmp_path, TWO)
    tokenizer = AutoTokenizer.from_pretrained(dirs["small"])
    limits = RequestLimits(max_model_len=4096, vocab_size=len(tokenizer))

    async def go() -> None:
        engines = [(n, make_engine(dirs[n], num_blocks=512)) for n in TWO]
        policy = build_policy("entropy", {"threshold": 0.45}, TWO)
        async with served(engines, policy, tokenizer, limits=limits) as flow:
            runtime, client = flow.runtime, flow.client
            prompt = tokenizer.apply_chat_template(
                MESSAGES, tools=[WEATHER], add_generation_prompt=True, tokenize=True
            )
            prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
            want = await runtime.complete(prompt, SamplingSpec(temperature=0.0, max_tokens=40))
            parser = ChatOutputSpec(reasoning=QWEN3, tools=True).parser()
            parser.push(tokenizer.decode(want.token_ids, skip_special_tokens=True))
            parser.end("")
            expected = parser.message
            got = await client.chat.completions.create(
                model=SERVED, messages=MESSAGES, tools=[WEATHER], temperature=0,
                max_tokens=40,
            )  # fmt: skip
            s = await streamed(
                client, messages=MESSAGES, tools=[WEATHER], temperature=0, max_tokens=40,
                logprobs=True,
            )  # fmt: skip
            assert got.usage.prompt_tokens == len(prompt)  # the template's rendering, tools in
            assert got.usage.completion_tokens == len(want.token_ids)
            assert got.choices[0].model_extra["routing"]["tokens_per_model"] == want.counts
            message = got.choices[0].message
            reasoning = (message.model_extra or {}).get("reasoning_content") or ""
            calls = [(c.function.name, json.loads(c.function.arguments))
                     for c in message.tool_calls or ()]  # fmt: skip
            assert reasoning == expected.reasoning and s["reasoning"] == expected.reasoning
            assert (message.content or "") == expected.content == s["content"]
            assert calls == [(c.name, json.loads(c.arguments)) for c in expected.tool_calls]
            assert len(s["calls"]) == len(calls)
            # every token's logprob once, though the parsers hold text back across steps
            assert len(s["logprobs"]) == len(want.token_ids)
            await runtime.wait_idle()
        assert sum(want.counts.values()) == len(want.token_ids)
        assert want.handoffs > 0 and all(want.counts.get(m) for m in TWO)  # both wrote

    asyncio.run(go())
