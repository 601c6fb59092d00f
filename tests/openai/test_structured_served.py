"""Structured outputs and forced tool calls through the whole OpenAI flow, with real tiny
random-weight Qwen3 models that hand each request back and forth: the official ``openai``
client -> the real FastAPI app over ASGI -> ``IngressServer`` -> two model replicas
(``LocalRuntime``). A random-weight model writes valid JSON, a valid call or one of the
choices only because every model masks its logits with the request's grammar."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.engine.conftest import make_engine
from tests.openai.ingress_app import SERVED, served
from tests.openai.qwen3_tiny import save_qwen3_models
from tokenrouter_ray.openai.validation import RequestLimits
from tokenrouter_ray.routing.policy import build_policy

TWO = ["small", "large"]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
FORECAST = {
    "type": "function",
    "function": {
        "name": "forecast",
        "description": "Weather forecast for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Rome", "Oslo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "clock",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
        },
    },
}


class Person(BaseModel):
    name: Annotated[str, Field(pattern=r"^[a-z]{1,6}$")]
    age: Annotated[int, Field(ge=0, le=120)]
    color: Literal["red", "green"]
    ok: bool


def person_request(model: str, content: str, seed: int) -> dict[str, Any]:
    """``chat.completions.parse`` arguments asking for a ``Person``, sampled with ``seed``
    (also what tests/deployments/test_structured_serve.py sends a Serve app)."""
    return dict(
        model=model,
        messages=[{"role": "user", "content": content}],
        response_format=Person,
        temperature=1.0,
        seed=seed,
        max_tokens=150,
        extra_body=NO_THINKING,
    )


def assert_person_by_both(choice: Any) -> None:
    """The answer is a parsed, validated ``Person`` that both models wrote parts of."""
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Person)  # parsed and validated
    writers = choice.model_extra["routing"]["tokens_per_model"]
    assert set(writers) == set(TWO)  # both models wrote parts of it


@pytest.fixture(scope="module")
def qwen_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = Path(tmp_path_factory.mktemp("qwen3served"))
    return save_qwen3_models(root, TWO)


def serve(dirs: dict[str, str], body: Callable[[openai.AsyncOpenAI, Any], Awaitable[None]]):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(dirs["small"])
    limits = RequestLimits(max_model_len=4096, vocab_size=len(tokenizer))

    async def go() -> None:
        engines = [(n, make_engine(dirs[n], num_blocks=512)) for n in TWO]
        policy = build_policy("bernoulli", {"p": 0.35}, TWO)  # hands off every few tokens
        async with served(engines, policy, tokenizer, limits=limits) as flow:
            await body(flow.client, flow.runtime)

    asyncio.run(go())


def test_parse_with_a_pydantic_model(qwen_dirs) -> None:
    async def body(client: openai.AsyncOpenAI, runtime: Any) -> None:
        for seed in range(3):
            content = f"Describe person {seed} as JSON."
            done = await client.chat.completions.parse(**person_request(SERVED, content, seed))
            assert_person_by_both(done.choices[0])
        assert sum(h.rid is not None for h in runtime.handoffs) > 0

    serve(qwen_dirs, body)


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_calls_are_valid(qwen_dirs, stream: bool) -> None:
    params = {t["function"]["name"]: t["function"]["parameters"] for t in (FORECAST, CLOCK)}

    async def call(client: openai.AsyncOpenAI, tool_choice: Any, **kw: Any) -> tuple:
        args = dict(
            model=SERVED,
            messages=[{"role": "user", "content": "What should I pack?"}],
            tools=[FORECAST, CLOCK],
            tool_choice=tool_choice,
            temperature=0,
            seed=1,
            max_tokens=200,
            extra_body=NO_THINKING,
            **kw,
        )
        if not stream:
            done = await client.chat.completions.create(**args)
            calls = [
                (c.function.name, c.function.arguments) for c in done.choices[0].message.tool_calls
            ]
            return calls, done.choices[0].finish_reason
        calls: dict[int, list[str]] = {}
        reason = None
        async for chunk in await client.chat.completions.create(stream=True, **args):
            for c in chunk.choices[0].delta.tool_calls or []:
                entry = calls.setdefault(c.index, ["", ""])
                entry[0] += c.function.name or ""
                entry[1] += c.function.arguments or ""
            reason = chunk.choices[0].finish_reason or reason
        return [tuple(v) for _, v in sorted(calls.items())], reason

    async def body(client: openai.AsyncOpenAI, runtime: Any) -> None:
        calls, reason = await call(client, "required")
        # one or more calls: a random-weight model may keep adding calls up to max_tokens
        # (a real one writes EOS after its calls); each complete one is valid
        assert reason in ("tool_calls", "length") and calls
        for name, arguments in calls if reason == "tool_calls" else calls[:-1]:
            jsonschema.validate(json.loads(arguments), params[name])
        named = {"type": "function", "function": {"name": "clock"}}
        calls, reason = await call(client, named)
        assert reason == "tool_calls" and [n for n, _ in calls] == ["clock"]
        jsonschema.validate(json.loads(calls[0][1]), params["clock"])
        calls, reason = await call(client, "required", parallel_tool_calls=False)
        assert reason == "tool_calls" and len(calls) == 1

    serve(qwen_dirs, body)


def test_completions_choice_regex_and_json_object(qwen_dirs) -> None:
    async def body(client: openai.AsyncOpenAI, runtime: Any) -> None:
        async def text(**kw: Any) -> tuple[str, str]:
            done = await client.completions.create(
                model=SERVED, prompt="Answer:", max_tokens=60, temperature=1.0, seed=3,
                extra_body=kw,
            )  # fmt: skip
            return done.choices[0].text, done.choices[0].finish_reason

        got = [await text(guided_choice=["yes", "no", "maybe not"]) for _ in range(2)]
        assert all(t in ("yes", "no", "maybe not") and r == "stop" for t, r in got)
        t, r = await text(structured_outputs={"regex": "[0-9]{2}-[a-c]{3}"})
        assert re.fullmatch("[0-9]{2}-[a-c]{3}", t) and r == "stop"
        t, r = await text(structured_outputs={"choice": ["left", "right"]})
        assert t in ("left", "right") and r == "stop"
        schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 9,
                  "minimum": 0}}, "required": ["n"]}  # fmt: skip
        t, r = await text(guided_json=schema)
        assert r == "stop"
        jsonschema.validate(json.loads(t), schema)
        done = await client.chat.completions.create(
            model=SERVED, messages=[{"role": "user", "content": "JSON!"}], max_tokens=200,
            response_format={"type": "json_object"}, temperature=0, extra_body=NO_THINKING,
        )  # fmt: skip
        content = done.choices[0].message.content
        assert content.startswith("{")  # an object from its first token
        if done.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(content), dict)

    serve(qwen_dirs, body)


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
      "schema": {"type": "foo"}}}}, "response_format", "Unsupported type"),
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs.regex", "parenthesis"),
    ({"guided_grammar": "root ::= "}, "guided_grammar", "EBNF"),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice", "at most one"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "schema"),
    ({"guided_regex": "a+", "ignore_eos": True}, "ignore_eos", "ignore_eos"),
    ({"tool_choice": "required"}, "tool_choice", "no 'tools'"),
]  # fmt: skip


def test_bad_constraints_are_400_naming_the_field(qwen_dirs) -> None:
    async def body(client: openai.AsyncOpenAI, runtime: Any) -> None:
        for extra, param, says in BAD:
            with pytest.raises(openai.BadRequestError) as bad:
                await client.chat.completions.create(
                    model=SERVED, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                    extra_body=extra,
                )  # fmt: skip
            assert bad.value.status_code == 400 and bad.value.param == param, extra
            assert says in bad.value.message, (extra, bad.value.message)
        assert runtime.ingress.num_active == 0  # none reached a model

    serve(qwen_dirs, body)


@pytest.mark.parametrize("thinking", [False, True])
def test_the_grammar_leaves_thinking_free(thinking: bool) -> None:
    """Qwen3 thinking on: an optional <think> block first, then the constrained answer
    (the matcher accepts both shapes); thinking off: the answer from the first token."""
    from tests.openai.qwen3_tiny import VOCAB_SIZE, qwen3_tokenizer
    from tokenrouter_ray.engine.grammar import GrammarBook
    from tokenrouter_ray.openai import ChatCompletionRequest, parse_request
    from tokenrouter_ray.openai.validation import prepare_chat

    tokenizer = qwen3_tokenizer()
    body = {
        "model": SERVED,
        "messages": [{"role": "user", "content": "hi"}],
        "guided_choice": ["yes", "no"],
        "chat_template_kwargs": {"enable_thinking": thinking},
    }
    prepared = prepare_chat(
        parse_request(ChatCompletionRequest, body),
        tokenizer,
        RequestLimits(max_model_len=4096, vocab_size=len(tokenizer)),
    )
    spec = prepared.sampling.spec.grammar
    book = GrammarBook.for_tokenizer(tokenizer, VOCAB_SIZE, [tokenizer.eos_token_id])

    def accepts(text: str) -> bool:
        state = book.new_state(spec)
        state.sync(list(tokenizer.encode(text, add_special_tokens=False)), 0)
        return not state.broken and state.matcher.is_completed()

    assert accepts("yes") and not accepts("maybe")
    assert accepts("<think>\nhmm, yes or no\n</think>\n\nno") == thinking


def test_simulated_models_refuse_grammars() -> None:
    from tests.openai.qwen3_tiny import qwen3_tokenizer
    from tokenrouter_ray.openai import ChatCompletionRequest, InvalidRequestError, parse_request
    from tokenrouter_ray.openai.validation import prepare_chat

    tokenizer = qwen3_tokenizer()
    limits = RequestLimits(max_model_len=4096, structured_outputs=False)
    body = {"model": SERVED, "messages": [{"role": "user", "content": "hi"}]}
    prepare_chat(parse_request(ChatCompletionRequest, body), tokenizer, limits)  # plain: fine
    body["response_format"] = {"type": "json_object"}
    with pytest.raises(InvalidRequestError, match="simulated") as bad:
        prepare_chat(parse_request(ChatCompletionRequest, body), tokenizer, limits)
    assert bad.value.status_code == 400 and bad.value.code == "unsupported_value"
    assert bad.value.param == "response_format"


def test_an_agent_exchange_with_real_models(qwen_dirs) -> None:
    """The agent loop with real (tiny) models handing off: the client offers a tool and
    forces it, gets one valid call (``finish_reason: tool_calls``), sends the call and the
    tool's result back with ``tool_choice: none``, and gets a plain answer; the second prompt
    is the chat template's rendering of the whole conversation, tool result included."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(qwen_dirs["small"])
    params = FORECAST["function"]["parameters"]
    question = {"role": "user", "content": "Should I take an umbrella to Rome?"}
    forced = {"type": "function", "function": {"name": "forecast"}}
    common = dict(model=SERVED, tools=[FORECAST], temperature=0, seed=5, extra_body=NO_THINKING)

    async def body(client: openai.AsyncOpenAI, runtime: Any) -> None:
        first = await client.chat.completions.create(
            messages=[question], tool_choice=forced, max_tokens=200, **common
        )
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        assert call.function.name == "forecast"
        jsonschema.validate(json.loads(call.function.arguments), params)
        assert sum(first.model_extra["routing"]["tokens_per_model"].values()) > 0
        conversation = [
            question,
            {
                "role": "assistant",
                "content": choice.message.content or "",
                "tool_calls": [
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {"name": "forecast", "arguments": call.function.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.id, "content": '{"rain": 0.8}'},
        ]
        second = await client.chat.completions.create(
            messages=conversation, tool_choice="none", max_tokens=12, **common
        )
        answer = second.choices[0]
        assert answer.finish_reason in ("stop", "length") and not answer.message.tool_calls
        assert isinstance(answer.message.content, str)
        # tool_choice "none": the tools are not rendered (vLLM's rule), the history is; the
        # template sees a call's arguments as the object (as vLLM passes them)
        history = [dict(m) for m in conversation]
        history[1]["tool_calls"] = [
            {"id": call.id, "type": "function",
             "function": {"name": "forecast", "arguments": json.loads(call.function.arguments)}}
        ]  # fmt: skip
        rendered = tokenizer.apply_chat_template(
            history, add_generation_prompt=True, enable_thinking=False, tokenize=True
        )
        ids = rendered["input_ids"] if hasattr(rendered, "keys") else rendered
        assert second.usage.prompt_tokens == len(ids)
        assert "0.8" in tokenizer.decode(ids)  # the tool's result reached the models

    serve(qwen_dirs, body)
