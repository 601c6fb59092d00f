"""Reasoning, tools, generation_config defaults, the extra endpoints and X-Request-Id, through
the official ``openai`` client and the real FastAPI app (over ASGI, without Ray), with
Qwen3's chat template and a scripted core (tests/openai/qwen3_tiny.py) in place of models.

The agent-style exchange: the client offers a tool, the answer thinks and calls it, the
client sends the call and the tool's result back, and the answer thinks and replies; the
prompt of the second turn is checked against the template's own rendering of the whole
conversation."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import openai
import pytest

from tests.openai.ingress_app import SERVED, ingress_app
from tests.openai.qwen3_tiny import ScriptedCore, qwen3_tokenizer
from tokenrouter_ray.openai.generation_defaults import GenerationDefaults
from tokenrouter_ray.openai.validation import RequestLimits

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
THINK_1 = "The user wants the weather; I will call the tool."
THINK_2 = "The tool says 18 degrees."
ANSWER = "It is 18 °C in Paris."
RESULT = '{"temp_c": 18}'


def agent_script(prompt: str) -> str:
    """A Qwen3-like answer: call the tool first, answer once its result is in the prompt."""
    if "<tool_response>" not in prompt:
        return f"<think>\n{THINK_1}\n</think>\n\n{CALL}"
    return f"<think>\n{THINK_2}\n</think>\n\n{ANSWER}"


Body = Callable[[openai.AsyncOpenAI, ScriptedCore, Any], Awaitable[Any]]


def serve(body: Body, script: Callable[[str], str] = agent_script, **attrs: Any) -> Any:
    """Run ``body(client, core, ingress)`` against the app with a `ScriptedCore`."""
    tokenizer = qwen3_tokenizer()
    core = ScriptedCore(tokenizer, script)
    app, ingress = ingress_app(tokenizer, core=core)
    ingress.limits = RequestLimits(max_model_len=4096, vocab_size=len(tokenizer))
    for name, value in attrs.items():
        setattr(ingress, name, value)

    async def go() -> Any:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://in") as http:
            client = openai.AsyncOpenAI(
                base_url="http://in/v1", api_key="none", http_client=http, max_retries=0
            )
            result = await body(client, core, ingress)
        assert core.num_active == 0
        return result

    return asyncio.run(go())


async def streamed(client: openai.AsyncOpenAI, **kwargs: Any) -> dict[str, Any]:
    """A streamed answer accumulated the way agent frameworks do."""
    out: dict[str, Any] = {"reasoning": "", "content": "", "calls": {}, "finish": None}
    logprobs: list[Any] = []
    stream = await client.chat.completions.create(model=SERVED, stream=True, **kwargs)
    async for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            out["reasoning"] += (delta.model_extra or {}).get("reasoning_content") or ""
            out["content"] += delta.content or ""
            for call in delta.tool_calls or ():
                slot = out["calls"].setdefault(call.index, {"id": "", "name": "", "args": ""})
                slot["id"] += call.id or ""
                slot["name"] += (call.function and call.function.name) or ""
                slot["args"] += (call.function and call.function.arguments) or ""
            out["finish"] = choice.finish_reason or out["finish"]
            logprobs += choice.logprobs.content if choice.logprobs else []
    if kwargs.get("logprobs"):
        out["logprobs"] = logprobs
    return out


def test_agent_exchange_call_result_answer() -> None:
    async def body(client: openai.AsyncOpenAI, core: ScriptedCore, _: Any) -> None:
        question = [{"role": "user", "content": "Weather in Paris?"}]
        first = await client.chat.completions.create(
            model=SERVED, messages=question, tools=[WEATHER]
        )
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        assert choice.message.model_extra["reasoning_content"] == f"\n{THINK_1}\n"
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris"}
        # the usage counts the thinking and the call: every token the model wrote
        tokenizer = core.tokenizer
        assert first.usage.completion_tokens == len(tokenizer.encode(agent_script("")))
        # the tools reached the template
        assert '"name": "get_weather"' in tokenizer.decode(core.sent[0][1])

        # the same first turn streamed: the same call in OpenAI's streamed shape
        s = await streamed(client, messages=question, tools=[WEATHER])
        assert s["finish"] == "tool_calls" and s["content"] == ""
        assert s["reasoning"] == f"\n{THINK_1}\n"
        assert [(c["name"], json.loads(c["args"])) for c in s["calls"].values()] == [
            ("get_weather", {"city": "Paris"})
        ]

        # turn 2: the assistant's call and the tool's result go back in the history
        history = [
            *question,
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": RESULT},
        ]
        final = await streamed(client, messages=history, tools=[WEATHER])
        assert final == {"reasoning": f"\n{THINK_2}\n", "content": ANSWER, "calls": {},
                         "finish": "stop"}  # fmt: skip
        want = tokenizer.apply_chat_template(
            [
                *question,
                {
                    "role": "assistant",
                    "content": "",
                    "reasoning_content": f"\n{THINK_1}\n",
                    "tool_calls": [
                        {
                            "id": call.id,
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": call.id, "content": RESULT},
            ],
            tools=[WEATHER],
            add_generation_prompt=True,
            tokenize=False,
        )
        prompt = tokenizer.decode(core.sent[-1][1])
        assert prompt == want
        assert CALL in prompt and f"<tool_response>\n{RESULT}\n</tool_response>" in prompt
        assert f"<think>\n{THINK_1}\n</think>" in prompt  # Qwen3 keeps this turn's thinking

    serve(body)


def test_thinking_is_split_and_max_tokens_counts_both() -> None:
    def script(prompt: str) -> str:
        if prompt.endswith("<think>\n\n</think>\n\n"):  # enable_thinking=false
            return "Direct answer."
        return "<think>\nlong thoughts here\n</think>\n\nThe answer."

    async def body(client: openai.AsyncOpenAI, core: ScriptedCore, _: Any) -> None:
        messages = [{"role": "user", "content": "Hi"}]
        full = await client.chat.completions.create(model=SERVED, messages=messages)
        msg = full.choices[0].message
        assert (msg.model_extra["reasoning_content"], msg.content) == (
            "\nlong thoughts here\n",
            "The answer.",
        )
        assert full.choices[0].finish_reason == "stop"
        # usage: the tokens of the thinking block, its tags included, of all the answer's
        think = len(qwen3_tokenizer()("<think>\nlong thoughts here\n</think>")["input_ids"])
        assert 0 < think < full.usage.completion_tokens
        assert full.usage.completion_tokens_details.reasoning_tokens == think
        chunks = [c async for c in await client.chat.completions.create(
            model=SERVED, messages=messages, stream=True,
            stream_options={"include_usage": True})]  # fmt: skip
        assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == think
        cut = await client.chat.completions.create(model=SERVED, messages=messages, max_tokens=12)
        assert cut.usage.completion_tokens == 12 and cut.choices[0].finish_reason == "length"
        assert cut.usage.completion_tokens_details.reasoning_tokens == 12  # never closed
        assert (
            cut.choices[0].message.model_extra["reasoning_content"] == "\nlong thoug"
        )  # <think> is one token
        assert cut.choices[0].message.content == ""
        off = await client.chat.completions.create(
            model=SERVED, messages=messages, extra_body={"chat_template_kwargs": {
                "enable_thinking": False}}
        )  # fmt: skip
        assert off.choices[0].message.content == "Direct answer."
        assert off.usage.completion_tokens_details.reasoning_tokens == 0
        assert "reasoning_content" not in (off.choices[0].message.model_extra or {})
        s = await streamed(client, messages=messages)
        assert (s["reasoning"], s["content"]) == ("\nlong thoughts here\n", "The answer.")

    serve(body, script)


def test_tool_choice_none_required_and_named() -> None:
    async def body(client: openai.AsyncOpenAI, core: ScriptedCore, _: Any) -> None:
        messages = [{"role": "user", "content": "Weather?"}]
        none = await client.chat.completions.create(
            model=SERVED, messages=messages, tools=[WEATHER], tool_choice="none"
        )
        assert "# Tools" not in core.tokenizer.decode(core.sent[-1][1])  # not offered
        assert none.choices[0].message.tool_calls is None
        assert CALL in none.choices[0].message.content  # text, not a call
        assert none.choices[0].finish_reason == "stop"
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            forced = await client.chat.completions.create(
                model=SERVED, messages=messages, tools=[WEATHER], tool_choice=choice
            )  # enforced by a grammar the models apply (the scripted core only records it)
            assert core.sent[-1][2].grammar.kind == "structural_tag"
            assert "get_weather" in core.sent[-1][2].grammar.text
            assert forced.choices[0].finish_reason == "tool_calls"
        for choice in ({"type": "function", "function": {"name": "nope"}}, "required"):
            with pytest.raises(openai.BadRequestError) as bad:  # not offered / no tools
                await client.chat.completions.create(
                    model=SERVED, messages=messages, tool_choice=choice,
                    **({"tools": [WEATHER]} if isinstance(choice, dict) else {}),
                )  # fmt: skip
            assert bad.value.status_code == 400 and bad.value.param == "tool_choice"
        a_call = {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        with pytest.raises(openai.BadRequestError) as bad:  # only an assistant calls tools
            await client.chat.completions.create(
                model=SERVED,
                messages=[*messages, {"role": "tool", "content": "r", "tool_calls": [a_call]}],
            )
        assert bad.value.param is not None and "tool_calls" in bad.value.param
        with pytest.raises(openai.BadRequestError) as bad:  # arguments must be a JSON object
            await client.chat.completions.create(
                model=SERVED,
                messages=[
                    *messages,
                    {"role": "assistant", "tool_calls": [
                        {**a_call, "function": {"name": "f", "arguments": "[1]"}}
                    ]},
                ],
            )  # fmt: skip
        assert bad.value.status_code == 400
        assert len(core.sent) == 3  # refusals never reached a model

    serve(body)


def test_a_template_without_tools_refuses_them(demo_tokenizer: Any) -> None:
    from tokenrouter_ray.openai import ChatCompletionRequest, InvalidRequestError, parse_request
    from tokenrouter_ray.openai.validation import prepare_chat

    template = getattr(demo_tokenizer, "chat_template", "")
    if "tools" in template:
        pytest.skip("the demo model's template renders tools")
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [WEATHER]}
    limits = RequestLimits(max_model_len=4096)
    with pytest.raises(InvalidRequestError) as bad:
        prepare_chat(parse_request(ChatCompletionRequest, body), demo_tokenizer, limits)
    assert bad.value.param == "tools"
    other = type(demo_tokenizer).from_pretrained(demo_tokenizer.name_or_path)
    other.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{{ tools }}"
    with pytest.raises(InvalidRequestError) as bad:  # renders tools, in a format not parsed
        prepare_chat(parse_request(ChatCompletionRequest, body), other, limits)
    assert bad.value.param == "tools" and "format" in bad.value.message
    plain = {**body, "tools": None}
    prepared = prepare_chat(parse_request(ChatCompletionRequest, plain), demo_tokenizer, limits)
    assert prepared.chat_parser() is None  # no thinking, no tools: content as it was


def test_generation_config_defaults_apply_when_omitted(tmp_path: Any) -> None:
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.1})
    )
    defaults = GenerationDefaults.from_model_dir(tmp_path)
    assert defaults.repetition_penalty == 1.1 and defaults.min_p is None

    async def body(client: openai.AsyncOpenAI, core: ScriptedCore, ingress: Any) -> None:
        messages = [{"role": "user", "content": "Hi"}]
        await client.chat.completions.create(model=SERVED, messages=messages)
        spec = core.sent[-1][2]
        assert (spec.temperature, spec.top_p, spec.top_k) == (0.6, 0.95, 20)
        assert spec.repetition_penalty == 1.1
        await client.completions.create(
            model=SERVED,
            prompt="Hi",
            temperature=0,
            top_p=0.5,
            extra_body={"top_k": 0, "repetition_penalty": 1.0},
        )
        spec = core.sent[-1][2]
        assert (spec.temperature, spec.top_p, spec.top_k) == (0.0, 0.5, 0)
        assert spec.repetition_penalty == 1.0
        ingress.generation_defaults = GenerationDefaults()  # generation_config: none
        await client.chat.completions.create(model=SERVED, messages=messages)
        spec = core.sent[-1][2]
        assert (spec.temperature, spec.top_p, spec.top_k) == (1.0, 1.0, 0)
        assert spec.repetition_penalty == 1.0

    serve(body, generation_defaults=defaults)


def test_generation_config_switch_is_a_config_field() -> None:
    from tokenrouter_ray.config import IngressSpec

    assert IngressSpec().generation_config == "auto"
    assert IngressSpec(generation_config="none").generation_config == "none"
    with pytest.raises(ValueError):
        IngressSpec(generation_config="vllm")


def test_endpoints_and_request_id() -> None:
    async def body(client: openai.AsyncOpenAI, core: ScriptedCore, _: Any) -> None:
        card = await client.models.retrieve(SERVED)
        assert card.id == SERVED and card.model_extra["max_model_len"] == 4096
        with pytest.raises(openai.NotFoundError) as missing:
            await client.models.retrieve("nope")
        assert missing.value.code == "model_not_found"
        http = client._client
        version = (await http.get("http://in/version")).json()
        from tokenrouter_ray import __version__

        assert version == {"version": __version__}
        tok = await http.post(
            "http://in/tokenize", json={"prompt": "hé", "return_token_strs": True}
        )
        ids = core.tokenizer.encode("hé", add_special_tokens=False)
        assert tok.json()["tokens"] == ids and tok.json()["count"] == len(ids)
        assert len(tok.json()["token_strs"]) == len(ids)
        chat = await http.post(
            "http://in/tokenize",
            json={"model": SERVED, "messages": [{"role": "user", "content": "Hi"}],
                  "tools": [WEATHER]},
        )  # fmt: skip
        want = core.tokenizer.apply_chat_template(
            [{"role": "user", "content": "Hi"}], tools=[WEATHER], add_generation_prompt=True
        )
        want = want["input_ids"] if hasattr(want, "keys") else want
        assert chat.json()["tokens"] == list(want)
        detok = await http.post("http://in/detokenize", json={"tokens": ids})
        assert detok.json() == {"prompt": "hé"}
        bad = await http.post("http://in/detokenize", json={"tokens": [10**6]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
        wrong = await http.post("http://in/tokenize", json={"model": "nope", "prompt": "x"})
        assert wrong.status_code == 404
        assert wrong.headers["x-request-id"]  # errors carry one too

        raw = await client.chat.completions.with_raw_response.create(
            model=SERVED,
            messages=[{"role": "user", "content": "Hi"}],
            extra_headers={"X-Request-Id": "agent-42/turn 1"},
        )
        assert raw.headers["x-request-id"] == "agent-42/turn 1"
        assert core.sent[-1][0].startswith("agent-42_turn_1-")  # every model logs this rid
        raw = await client.chat.completions.with_raw_response.create(
            model=SERVED, messages=[{"role": "user", "content": "Hi"}], stream=True
        )
        made = raw.headers["x-request-id"]
        async for _ in raw.parse():
            pass
        assert len(made) == 32 and core.sent[-1][0].startswith(made + "-")

    serve(body)
