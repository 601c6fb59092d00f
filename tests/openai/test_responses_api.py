"""``POST /v1/responses`` through the official ``openai`` client (``responses.create``,
streamed and not, and the ``responses.stream`` helper) against the real FastAPI app:

- over ``LocalRuntime`` on two tiny models that hand tokens back and forth (entropy
  policy): at temperature 0 the text, usage and routing equal ``/v1/chat/completions``'
  for the same messages (``instructions`` as a system message), the budget cut is an
  ``incomplete`` response, the streamed events are OpenAI's sequence and add up to the
  non-streamed response, and bad requests are 4xx error objects naming the Responses
  field, leaving nothing behind;
- over a scripted core with Qwen3's chat template (tests/openai/qwen3_tiny.py): thinking
  becomes a ``reasoning`` item, a tool call a ``function_call`` item, and sending the output
  items back with the call's output (or only the output, with ``previous_response_id``)
  renders the prompt chat renders for that history.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import openai
import pytest

from tests.openai.ingress_app import SERVED, run_served_flow
from tests.openai.qwen3_tiny import ScriptedCore
from tests.openai.test_reasoning_tools import RESULT, THINK_1, THINK_2, WEATHER, serve
from tokenrouter_ray.openai import schemas

POLICY = ("entropy", {"threshold": 0.45})
PROMPT = "w5 w9 w3 w17 w22 w31 w8 w64 w90 w11"  # two full KV blocks and a bit
INSTRUCTIONS = "w40 w41"
FUNCTION = {"type": "function", **WEATHER["function"]}  # the Responses shape of the tool

Body = Callable[[openai.AsyncOpenAI, httpx.AsyncClient], Awaitable[Any]]


def run(dirs: dict[str, str], body: Body) -> Any:
    """``body(client, http)`` against the app over a LocalRuntime of small + large; checks
    nothing is left anywhere afterwards."""
    return run_served_flow(dirs, POLICY, lambda client, _rt, http: body(client, http))


def extra(obj: Any, name: str) -> Any:
    return (obj.model_extra or {}).get(name)


async def events_of(stream: Any) -> list[dict[str, Any]]:
    return [event.model_dump(mode="json", exclude_unset=True) async for event in stream]


def check_sequence(events: list[dict[str, Any]], last: str) -> None:
    """OpenAI's order for a one-message answer, sequence numbers 0, 1, ..."""
    kinds = [e["type"] for e in events]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        last,
    ]
    ids = {e["response"]["id"] for e in events if "response" in e}
    assert len(ids) == 1 and ids.pop().startswith("resp_")
    item_ids = {e.get("item_id") or e["item"]["id"] for e in events[2:-1]}
    assert len(item_ids) == 1 and item_ids.pop().startswith("msg_")


def test_responses_equal_chat_streamed_or_not(served_chain_dirs: dict[str, str]) -> None:
    async def body(client: openai.AsyncOpenAI, _: httpx.AsyncClient) -> None:
        for messages, kw in [
            ([{"role": "user", "content": PROMPT}], {"input": PROMPT}),
            (
                [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": PROMPT}],
                {"input": PROMPT, "instructions": INSTRUCTIONS},
            ),
            (  # items: a typed message with parts, an untyped one, an assistant turn
                [
                    {"role": "developer", "content": "w1 w2"},
                    {"role": "user", "content": "w3\nw4"},
                    {"role": "assistant", "content": "w60"},
                    {"role": "user", "content": PROMPT},
                ],
                {
                    "input": [
                        {"type": "message", "role": "developer", "content": "w1 w2"},
                        {
                            "type": "message",
                            "role": "user",
                            "content": [
                                {"type": "input_text", "text": "w3"},
                                {"type": "input_text", "text": "w4"},
                            ],
                        },
                        {"role": "assistant", "content": [
                            {"type": "output_text", "text": "w60", "annotations": []}]},
                        {"role": "user", "content": PROMPT},
                    ]
                },
            ),
        ]:  # fmt: skip
            chat = await client.chat.completions.create(
                model=SERVED, messages=messages, max_tokens=12, temperature=0
            )
            got = await client.responses.create(
                model=SERVED, max_output_tokens=12, temperature=0, **kw
            )
            text = chat.choices[0].message.content
            assert got.output_text == text and text
            assert got.object == "response" and got.id.startswith("resp_")
            assert got.model == SERVED and got.temperature == 0 and got.max_output_tokens == 12
            assert got.instructions == kw.get("instructions")
            # the word-level tokenizer has no EOS: the budget ends it
            assert chat.choices[0].finish_reason == "length"
            assert got.status == "incomplete"
            assert got.incomplete_details.reason == "max_output_tokens"
            (item,) = got.output
            assert item.type == "message" and item.role == "assistant"
            assert item.status == "incomplete" and item.id.startswith("msg_")
            assert [(c.type, c.annotations) for c in item.content] == [("output_text", [])]
            usage = got.usage
            assert usage.input_tokens == chat.usage.prompt_tokens
            assert usage.output_tokens == chat.usage.completion_tokens == 12
            assert usage.total_tokens == usage.input_tokens + usage.output_tokens
            # chat ran first, so the entry model had the prompt's blocks cached: as chat
            # finds them now
            again = await client.chat.completions.create(
                model=SERVED, messages=messages, max_tokens=12, temperature=0
            )
            cached = again.usage.prompt_tokens_details.cached_tokens
            assert usage.input_tokens_details.cached_tokens == cached > 0
            assert usage.output_tokens_details.reasoning_tokens == 0  # no thinking here
            routing = extra(got, "routing")
            assert routing == chat.model_extra["routing"]
            assert sum(routing["tokens_per_model"].values()) == 12
            assert extra(got, "metrics")["tokens_per_model"] == routing["tokens_per_model"]

            # streamed: OpenAI's event sequence; the deltas and the last event are the
            # non-streamed response
            stream = await client.responses.create(
                model=SERVED, max_output_tokens=12, temperature=0, stream=True, **kw
            )
            events = await events_of(stream)
            check_sequence(events, "response.incomplete")
            deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
            assert "".join(deltas) == text
            final = events[-1]["response"]
            assert final["status"] == "incomplete"
            assert final["incomplete_details"] == {"reason": "max_output_tokens"}
            assert final["usage"] == got.usage.model_dump(mode="json", exclude_unset=True)
            assert final["routing"] == routing
            (done,) = final["output"]
            assert done == events[-2]["item"]
            assert done["content"] == [{"type": "output_text", "text": text, "annotations": []}]
            assert done["status"] == "incomplete"
            assert events[0]["response"]["status"] == "in_progress"
            assert events[0]["response"]["output"] == []

    run(served_chain_dirs, body)


def test_completed_response_and_the_stream_helper(served_chain_dirs: dict[str, str]) -> None:
    """A stop string (chat's extension, passed through) ends the output: ``completed``."""

    async def body(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> None:
        kw = dict(model=SERVED, input=PROMPT, temperature=0, max_output_tokens=12)
        long = await client.responses.create(**kw)
        text = long.output_text
        stop = {"stop": [f" {text.split()[3]} "]}
        cut = text[: text.index(stop["stop"][0])]
        chat = await client.chat.completions.create(
            model=SERVED, messages=[{"role": "user", "content": PROMPT}], max_tokens=12,
            temperature=0, stop=stop["stop"],
        )  # fmt: skip
        assert chat.choices[0].message.content == cut
        got = await client.responses.create(**kw, extra_body=stop)
        assert got.status == "completed" and got.incomplete_details is None
        assert got.output_text == cut and got.output[0].status == "completed"
        assert got.usage.output_tokens == chat.usage.completion_tokens

        events = await events_of(await client.responses.create(**kw, stream=True, extra_body=stop))
        check_sequence(events, "response.completed")
        assert events[-1]["response"]["output"][0]["content"][0]["text"] == cut

        # on the wire: each event named on its own line, as OpenAI sends them; no [DONE]
        async with http.stream("POST", "/v1/responses", json={**kw, **stop, "stream": True}) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            raw = (await r.aread()).decode()
        frames = raw.removesuffix("\n\n").split("\n\n")
        wire = []
        for frame in frames:
            name, data = frame.split("\n")
            wire.append(json.loads(data.removeprefix("data: ")))
            assert name.removeprefix("event: ") == wire[-1]["type"]
        # the same sequence as the client's (how tokens group into deltas is timing)
        check_sequence(wire, "response.completed")
        assert wire[-1]["response"]["output"][0]["content"][0]["text"] == cut
        assert "[DONE]" not in raw

        async with client.responses.stream(**kw, extra_body=stop) as stream:
            texts = [e.delta async for e in stream if e.type == "response.output_text.delta"]
            final = await stream.get_final_response()
        assert "".join(texts) == cut == final.output_text
        assert final.status == "completed"
        assert final.usage.output_tokens == got.usage.output_tokens

    run(served_chain_dirs, body)


async def error_of(http: httpx.AsyncClient, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    response = await http.post("/v1/responses", json=body)
    return response.status_code, response.json()


BAD = [
    # (what, body changes, status, param, code)
    ("previous_response_id of another kind", {"previous_response_id": "msg_1"}, 400,
     "previous_response_id", "invalid_value"),
    ("previous_response_id unknown", {"previous_response_id": "resp_1"}, 404,
     "previous_response_id", "previous_response_not_found"),
    ("input a number", {"input": 5}, 400, "input", "invalid_type"),
    ("input missing", {"input": None}, 400, "input", "invalid_type"),
    ("wrong model", {"model": "gpt-9"}, 404, "model", "model_not_found"),
    ("image part", {"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "http://x/y.png"}]}]}, 400, "input[0].content",
     "unsupported_value"),
    ("item without role", {"input": [{"type": "message", "content": "w1"}]}, 400,
     "input[0].role", "missing_required_parameter"),
    ("bad role", {"input": [{"role": "robot", "content": "w1"}]}, 400, "input[0].role",
     "invalid_value"),
    ("item reference", {"input": [{"type": "item_reference", "id": "msg_1"}]}, 400,
     "input[0].type", "unsupported_value"),
    ("built-in tool", {"tools": [{"type": "web_search"}]}, 400, "tools[0].type",
     "unsupported_value"),
    ("bad tool name", {"tools": [{"type": "function", "name": "a b"}]}, 400, "tools[0].name",
     "invalid_value"),
    ("tool_choice built-in", {"tool_choice": {"type": "file_search"}}, 400, "tool_choice",
     "unsupported_value"),
    ("budget past the context", {"max_output_tokens": 1000}, 400, "max_output_tokens",
     "context_length_exceeded"),
    ("budget zero", {"max_output_tokens": 0}, 400, "max_output_tokens", "invalid_value"),
    ("background not stored", {"background": True, "store": False}, 400, "background",
     "invalid_value"),
    ("background streamed", {"background": True, "stream": True}, 400, "stream",
     "unsupported_value"),
    ("truncation auto", {"truncation": "auto"}, 400, "truncation", "unsupported_value"),
    ("reasoning effort", {"reasoning": {"effort": "high"}}, 400, "reasoning.effort",
     "unsupported_value"),
    ("bad format", {"text": {"format": {"type": "xml"}}}, 400, "text.format.type",
     "invalid_value"),
    ("routing (passed through)", {"routing": {"threshold": 2}}, 400, "routing.threshold",
     "invalid_value"),
    ("seed a string (passed through)", {"seed": "1"}, 400, "seed", "invalid_type"),
    ("temperature", {"temperature": 3}, 400, "temperature", "invalid_value"),
    ("call arguments not JSON", {"input": [{"type": "function_call", "call_id": "c",
     "name": "f", "arguments": "nope"}]}, 400, "input[0]", "invalid_value"),
]  # fmt: skip


def test_bad_requests_are_openai_errors_naming_the_field(
    served_chain_dirs: dict[str, str],
) -> None:
    async def body(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> None:
        base = {"model": SERVED, "input": PROMPT, "max_output_tokens": 4}
        for what, changes, status, param, code in BAD:
            got, answer = await error_of(http, {**base, **changes})
            error = answer["error"]
            assert (got, error["param"], error["code"]) == (status, param, code), (what, error)
            assert error["type"] == "invalid_request_error" and error["message"]
            assert "messages" not in error["message"] and "max_completion" not in error["message"]
        # an unknown response: retrieving or deleting it is a 404 error object
        for method in ("GET", "DELETE"):
            r = await http.request(method, "/v1/responses/resp_1")
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve("resp_1")
        # the official client raises the same error objects
        with pytest.raises(openai.BadRequestError) as raised:
            await client.responses.create(model=SERVED, input=PROMPT, previous_response_id="r1")
        assert raised.value.body["param"] == "previous_response_id"
        # and the server still answers
        ok = await client.responses.create(model=SERVED, input=PROMPT, max_output_tokens=3)
        assert ok.usage.output_tokens == 3

    run(served_chain_dirs, body)


def test_ignored_and_unknown_fields(
    served_chain_dirs: dict[str, str],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the Agents SDK and other clients send is accepted: ``store`` (either way, echoed;
    tests/openai/test_responses_store.py stores), ``metadata`` (echoed), ``include`` of
    encrypted reasoning; an unknown field is dropped with one warning, as on chat."""
    monkeypatch.setattr(schemas, "_warned_unknown", set())

    async def body(client: openai.AsyncOpenAI, _: httpx.AsyncClient) -> None:
        for store in (True, False):
            got = await client.responses.create(
                model=SERVED, input=PROMPT, max_output_tokens=3, store=store,
                metadata={"k": "v"}, user="u", include=["reasoning.encrypted_content"],
                truncation="disabled", parallel_tool_calls=False, text={"format": {"type": "text"}},
                extra_body={"some_new_field": 1},
            )  # fmt: skip
            assert got.usage.output_tokens == 3
            assert got.metadata == {"k": "v"} and got.user == "u"
            assert extra(got, "store") is store and got.parallel_tool_calls is False
            assert got.text.format.type == "text" and got.tools == []

    with caplog.at_level(logging.WARNING):
        run(served_chain_dirs, body)
    warned = [r.getMessage() for r in caplog.records if "some_new_field" in r.getMessage()]
    assert len(warned) == 1


def test_reasoning_and_tool_calls_round_trip() -> None:
    """The agent exchange of test_reasoning_tools.py over the Responses API: the output
    items of turn 1 and the call's output sent back make the prompt chat makes for the
    same history."""

    async def body(client: openai.AsyncOpenAI, core: ScriptedCore, _: Any) -> None:
        question = "Weather in Paris?"
        first = await client.responses.create(model=SERVED, input=question, tools=[FUNCTION])
        assert first.status == "completed"
        reasoning, call = first.output
        assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_")
        assert reasoning.summary == []
        assert [(c.type, c.text) for c in reasoning.content] == [
            ("reasoning_text", f"\n{THINK_1}\n")
        ]
        assert call.type == "function_call" and call.name == "get_weather"
        assert call.call_id.startswith("call_") and call.id.startswith("fc_")
        assert json.loads(call.arguments) == {"city": "Paris"}
        assert first.output_text == ""
        assert first.tools[0].name == "get_weather"

        # streamed: reasoning text events, then the call's argument events
        stream = await client.responses.create(
            model=SERVED, input=question, tools=[FUNCTION], stream=True
        )
        events = await events_of(stream)
        kinds = [e["type"] for e in events]
        assert kinds[:4] == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
        ]
        assert "response.reasoning_text.delta" in kinds
        assert kinds[-1] == "response.completed"
        text = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
        assert text == f"\n{THINK_1}\n"
        arguments = "".join(
            e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"
        )
        assert json.loads(arguments) == {"city": "Paris"}
        (args_done,) = [e for e in events if e["type"] == "response.function_call_arguments.done"]
        assert args_done["arguments"] == arguments and args_done["name"] == "get_weather"
        final = events[-1]["response"]["output"]
        assert [i["type"] for i in final] == ["reasoning", "function_call"]
        assert final[1]["arguments"] == arguments == call.arguments
        done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
        assert done == final

        # turn 2: the output items and the call's output go back
        history = [
            {"role": "user", "content": question},
            *[item.model_dump(mode="json", exclude_none=True) for item in first.output],
            {"type": "function_call_output", "call_id": call.call_id, "output": RESULT},
        ]
        second = await client.responses.create(model=SERVED, input=history, tools=[FUNCTION])
        responses_prompt = core.sent[-1][1]
        assert [i.type for i in second.output] == ["reasoning", "message"]
        assert second.output[0].content[0].text == f"\n{THINK_2}\n"
        assert second.output_text == "It is 18 °C in Paris."
        # the same turn by previous_response_id: the stored question, reasoning and call
        # come first, and render the same prompt
        chained = await client.responses.create(
            model=SERVED, previous_response_id=first.id, tools=[FUNCTION],
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": RESULT}],
        )  # fmt: skip
        assert core.sent[-1][1] == responses_prompt
        assert chained.output_text == second.output_text
        # the same history through chat renders the same prompt
        chat_history = [
            {"role": "user", "content": question},
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": f"\n{THINK_1}\n",
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": call.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": RESULT},
        ]
        chat = await client.chat.completions.create(
            model=SERVED, messages=chat_history, tools=[WEATHER]
        )
        assert core.sent[-1][1] == responses_prompt
        assert chat.choices[0].message.content == second.output_text

        # a forced call, by name (Responses' shape of a named tool_choice)
        named = await client.responses.create(
            model=SERVED, input=question, tools=[FUNCTION],
            tool_choice={"type": "function", "name": "get_weather"},
        )  # fmt: skip
        assert core.sent[-1][2].grammar is not None
        assert named.tool_choice.name == "get_weather"

    serve(body)  # test_reasoning_tools.py's agent script


def test_thinking_cut_by_the_budget() -> None:
    def script(prompt: str) -> str:
        return "<think>\nlong thoughts here\n</think>\n\nThe answer."

    async def body(client: openai.AsyncOpenAI, core: ScriptedCore, _: Any) -> None:
        kw = dict(model=SERVED, input="Hi", max_output_tokens=12)
        got = await client.responses.create(**kw)
        reasoning, message = got.output
        assert (reasoning.status, message.status) == ("completed", "incomplete")
        assert reasoning.content[0].text == "\nlong thoug" and message.content[0].text == ""
        assert got.status == "incomplete" and got.usage.output_tokens == 12
        chat = await client.chat.completions.create(
            model=SERVED, messages=[{"role": "user", "content": "Hi"}], max_tokens=12
        )
        thinking = chat.usage.completion_tokens_details.reasoning_tokens
        assert got.usage.output_tokens_details.reasoning_tokens == thinking == 12
        events = await events_of(await client.responses.create(**kw, stream=True))
        assert events[-1]["type"] == "response.incomplete"
        final = events[-1]["response"]["output"]
        assert [(i["type"], i["status"]) for i in final] == [
            ("reasoning", "completed"),
            ("message", "incomplete"),
        ]
        assert events[-1]["response"]["usage"]["output_tokens_details"] == {"reasoning_tokens": 12}
        whole = await client.responses.create(model=SERVED, input="Hi")
        assert whole.output_text == "The answer." and whole.status == "completed"
        full = await client.chat.completions.create(
            model=SERVED, messages=[{"role": "user", "content": "Hi"}]
        )
        thinking = full.usage.completion_tokens_details.reasoning_tokens
        assert whole.usage.output_tokens_details.reasoning_tokens == thinking > 0

    serve(body, script)


def test_a_failure_mid_stream_is_an_error_event_then_failed() -> None:
    """A choice that fails after its first tokens (its model lost): streamed, an ``error``
    event and ``response.failed`` with the output so far, no cut connection; not streamed,
    the 503 error object."""

    async def body(client: openai.AsyncOpenAI, core: ScriptedCore, _: Any) -> None:
        release = core.release

        def lost(rid: str) -> Any:
            done = release(rid)
            done.error, done.error_kind = "the entry model stopped answering", "unavailable"
            return done

        core.release = lost  # type: ignore[method-assign]
        kw = dict(model=SERVED, input="Hi")
        events = await events_of(await client.responses.create(**kw, stream=True))
        kinds = [e["type"] for e in events]
        assert kinds[:2] == ["response.created", "response.in_progress"]
        assert "response.reasoning_text.delta" in kinds  # tokens came before the failure
        assert kinds[-2:] == ["error", "response.failed"]
        error, failed = events[-2], events[-1]["response"]
        assert error["code"] == "service_unavailable" and "stopped answering" in error["message"]
        assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
        assert failed["output"] and failed["output"][-1]["status"] == "incomplete"
        with pytest.raises(openai.InternalServerError) as raised:
            await client.responses.create(**kw)
        assert raised.value.status_code == 503

    serve(body, lambda _: "<think>\nhmm\n</think>\n\nThe answer.")


def test_text_format_json_schema_is_chats_response_format() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

    async def body(client: openai.AsyncOpenAI, core: ScriptedCore, _: Any) -> None:
        fmt = {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}
        got = await client.responses.create(model=SERVED, input="Hi", text={"format": fmt})
        grammar = core.sent[-1][2].grammar
        assert grammar is not None and json.loads(got.output_text) == {"a": 1}
        assert got.text.format.type == "json_schema" and got.text.format.name == "thing"
        await client.chat.completions.create(
            model=SERVED, messages=[{"role": "user", "content": "Hi"}],
            response_format={"type": "json_schema", "json_schema": {
                "name": "thing", "schema": schema, "strict": True}},
        )  # fmt: skip
        assert core.sent[-1][2].grammar == grammar
        assert core.sent[-1][1] == core.sent[-2][1]  # the same prompt

    serve(body, lambda _: '{"a": 1}')
