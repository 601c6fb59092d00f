"""Stored responses of the Responses API (ingress/responses_api.py, response_store.py)
through the official ``openai`` client against the real FastAPI app over ``LocalRuntime``
on two tiny models that hand tokens back and forth:

- ``previous_response_id`` continues a conversation exactly as chat would for the same
  history (the previous response's input and output items, then the new input; its
  ``instructions`` not carried over), streamed or not; ``retrieve``, ``input_items``,
  ``delete`` and ``store: false`` behave as OpenAI's;
- ``background`` answers at once and the stored response ends as the foreground one does;
  cancelling one in progress aborts it on every model (every KV block free, the request gone
  at the ingress) and stores it ``cancelled``; cancelling any other is OpenAI's 400;
- bad ids, unknown ids, bad queries and the store's bounds are OpenAI error objects with the
  right status and ``param``, never a 5xx, and the server keeps answering.

Every flow ends with nothing held anywhere (``run_served_flow`` checks it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from tests.openai.ingress_app import SERVED, run_served_flow
from tests.openai.test_responses_api import INSTRUCTIONS, POLICY, PROMPT, events_of, extra

GREEDY: dict[str, Any] = {"model": SERVED, "temperature": 0}


async def chat_text(client: openai.AsyncOpenAI, messages: list[dict], max_tokens: int) -> Any:
    return await client.chat.completions.create(messages=messages, max_tokens=max_tokens, **GREEDY)


def test_previous_response_id_continues_as_chat_would(served_chain_dirs: dict[str, str]) -> None:
    async def body(client: openai.AsyncOpenAI, _rt: Any, http: httpx.AsyncClient) -> None:
        first = await client.responses.create(
            input=PROMPT, instructions=INSTRUCTIONS, max_output_tokens=6, **GREEDY
        )
        assert extra(first, "store") is True
        second = await client.responses.create(
            input="w7 w8", previous_response_id=first.id, max_output_tokens=6, **GREEDY
        )
        # the previous input and output, then the new input; no system message: the first
        # response's instructions are not carried over
        history = [
            {"role": "user", "content": PROMPT},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "w7 w8"},
        ]
        chat = await chat_text(client, history, 6)
        assert second.output_text == chat.choices[0].message.content and second.output_text
        assert second.usage.input_tokens == chat.usage.prompt_tokens
        assert second.previous_response_id == first.id and second.instructions is None

        # streamed, with new instructions: they apply to the whole continued conversation
        third_kw = dict(input="w9", previous_response_id=second.id, instructions="w40")
        events = await events_of(
            await client.responses.create(**third_kw, max_output_tokens=8, stream=True, **GREEDY)
        )
        third = events[-1]["response"]
        history3 = [
            {"role": "system", "content": "w40"},
            *history,
            {"role": "assistant", "content": second.output_text},
            {"role": "user", "content": "w9"},
        ]
        chat3 = await chat_text(client, history3, 8)
        text3 = chat3.choices[0].message.content
        assert third["output"][0]["content"][0]["text"] == text3
        assert third["usage"]["input_tokens"] == chat3.usage.prompt_tokens
        assert third["store"] is True and third["previous_response_id"] == second.id

        # stored as the client saw them
        for response in (first, second):
            got = await client.responses.retrieve(response.id)
            assert got.model_dump() == response.model_dump()
        assert (await http.get(f"/v1/responses/{third['id']}")).json() == third

        # the responses.stream helper, continuing without storing (a stop string ends the
        # output: the helper's final response needs response.completed)
        stop = f" {text3.split()[3]} "
        async with client.responses.stream(
            **third_kw, max_output_tokens=8, store=False, extra_body={"stop": [stop]}, **GREEDY
        ) as stream:
            final = await stream.get_final_response()
        assert final.output_text == text3[: text3.index(stop)] and final.status == "completed"
        assert extra(final, "store") is False
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(final.id)

        # input items: every item the response was made from, OpenAI's cursor pages
        page = await client.responses.input_items.list(second.id, order="asc")
        got_items = [(i.type, i.role, i.content[0].text) for i in page.data]
        assert got_items == [
            ("message", "user", PROMPT),
            ("message", "assistant", first.output_text),
            ("message", "user", "w7 w8"),
        ]
        assert page.data[1].id == first.output[0].id  # the output item, as it was
        assert page.data[0].content[0].type == "input_text"
        ids = [item.id for item in page.data]
        newest_first = [i.id async for i in client.responses.input_items.list(second.id, limit=1)]
        assert newest_first == ids[::-1]
        raw = await http.get(
            f"/v1/responses/{second.id}/input_items", params={"limit": 2, "order": "asc"}
        )
        assert raw.json()["first_id"] == ids[0] and raw.json()["last_id"] == ids[1]
        assert raw.json()["has_more"] is True and raw.json()["object"] == "list"
        third_items = await client.responses.input_items.list(third["id"], order="asc")
        assert len(third_items.data) == 5  # instructions are not an item

        # delete: OpenAI's deletion object; a later continuation of it is a 404
        deleted = await http.delete(f"/v1/responses/{first.id}")
        assert deleted.json() == {"id": first.id, "object": "response.deleted", "deleted": True}
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(first.id)
        with pytest.raises(openai.NotFoundError) as raised:
            await client.responses.create(input="w1", previous_response_id=first.id, **GREEDY)
        assert raised.value.body["param"] == "previous_response_id"
        assert raised.value.body["code"] == "previous_response_not_found"
        assert await client.responses.delete(second.id) is None  # the client's own call
        # a stored response holds its whole context: it continues with its ancestors gone
        fourth = await client.responses.create(
            input="w3", previous_response_id=third["id"], max_output_tokens=2, **GREEDY
        )
        assert fourth.usage.output_tokens == 2
        assert len((await client.responses.input_items.list(fourth.id)).data) == 7

        # store: false is not stored, and cannot be continued
        unstored = await client.responses.create(
            input=PROMPT, store=False, max_output_tokens=2, **GREEDY
        )
        assert extra(unstored, "store") is False
        with pytest.raises(openai.NotFoundError):
            await client.responses.create(input="w1", previous_response_id=unstored.id, **GREEDY)

    run_served_flow(served_chain_dirs, POLICY, body)


async def ended(client: openai.AsyncOpenAI, response_id: str, timeout_s: float = 60) -> Any:
    """The stored response once it is no longer in progress."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while (got := await client.responses.retrieve(response_id)).status == "in_progress":
        assert asyncio.get_running_loop().time() < deadline, "the response never ended"
        await asyncio.sleep(0.02)
    return got


async def until(condition: Callable[[], bool], timeout_s: float = 60) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def fault(rt: Any, kind: str, **kw: Any) -> None:
    """A fault on every model's engine, on its step thread (``stall``: slower steps)."""
    for s in rt.model_replicas:
        await s.call(lambda s=s: s.engine.inject_fault(kind, **kw))


def kv_free(rt: Any) -> bool:
    pools = [s.engine.kv.pool for s in rt.model_replicas]
    return all(pool.num_free_blocks == pool.num_blocks for pool in pools)


def test_background_responses_and_cancel(served_chain_dirs: dict[str, str]) -> None:
    async def body(client: openai.AsyncOpenAI, rt: Any, _http: httpx.AsyncClient) -> None:
        kw = dict(input=PROMPT, max_output_tokens=8, **GREEDY)
        foreground = await client.responses.create(**kw)
        background = await client.responses.create(**kw, background=True)
        assert background.status == "in_progress" and background.background is True
        assert background.output == [] and background.usage is None
        done = await ended(client, background.id)
        assert done.status == foreground.status == "incomplete"  # the budget ended both
        assert done.output_text == foreground.output_text and done.usage.output_tokens == 8
        assert extra(done, "routing") == extra(foreground, "routing")

        # OpenAI's 400s: a foreground response, an ended background one
        with pytest.raises(openai.BadRequestError) as raised:
            await client.responses.cancel(foreground.id)
        assert raised.value.body["message"] == "Cannot cancel a synchronous response."
        with pytest.raises(openai.BadRequestError) as raised:
            await client.responses.cancel(background.id)
        assert raised.value.body["message"] == "Cannot cancel an incomplete response."
        # a background response is continued like any other once it ended
        follow = await client.responses.create(
            input="w7", previous_response_id=background.id, max_output_tokens=2, **GREEDY
        )
        assert follow.usage.input_tokens > done.usage.input_tokens + 8

        # in progress: every model's steps slowed, cancelled once tokens came (its KV held)
        await fault(rt, "stall", count=10**6, seconds=0.05)
        for how in ("cancel", "delete"):
            before = rt.ingress.tokens_received
            slow = await client.responses.create(
                input=PROMPT, max_output_tokens=100, background=True, **GREEDY
            )
            await until(lambda before=before: rt.ingress.tokens_received > before)
            assert not kv_free(rt) and rt.ingress.num_active == 1
            with pytest.raises(openai.BadRequestError) as raised:  # not while it runs
                await client.responses.create(input="w1", previous_response_id=slow.id, **GREEDY)
            assert raised.value.body["param"] == "previous_response_id"
            if how == "cancel":
                got = await client.responses.cancel(slow.id)
                assert got.status == "cancelled" and got.id == slow.id
                again = await client.responses.cancel(slow.id)  # cancelling again: the same
                assert again.status == "cancelled"
                assert (await client.responses.retrieve(slow.id)).status == "cancelled"
            else:
                assert await client.responses.delete(slow.id) is None
                with pytest.raises(openai.NotFoundError):
                    await client.responses.retrieve(slow.id)
            assert rt.ingress.num_active == 0  # gone at the ingress as the call returned
            await rt.wait_idle()
            assert kv_free(rt)  # and on every model: nothing leaks
            assert rt.ingress.tokens_received - before < 100  # stopped, not run to the end
        # a background response that fails (here its `timeout` extension) is stored failed
        late = await client.responses.create(
            input=PROMPT, max_output_tokens=100, background=True, extra_body={"timeout": 0.3},
            **GREEDY,
        )  # fmt: skip
        failed = await ended(client, late.id)
        assert failed.status == "failed" and failed.error.code == "server_error"
        assert "timed out" in failed.error.message
        await rt.wait_idle()
        assert kv_free(rt) and rt.ingress.num_active == 0
        await fault(rt, "clear")
        ok = await client.responses.create(input=PROMPT, max_output_tokens=3, **GREEDY)
        assert ok.usage.output_tokens == 3

    run_served_flow(served_chain_dirs, POLICY, body)


async def error_of(
    http: httpx.AsyncClient, method: str, path: str, **kw: Any
) -> tuple[int, str | None, str | None]:
    response = await http.request(method, path, **kw)
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    return response.status_code, error["param"], error["code"]


def test_bad_ids_queries_and_the_count_bound(served_chain_dirs: dict[str, str]) -> None:
    async def body(client: openai.AsyncOpenAI, _rt: Any, http: httpx.AsyncClient) -> None:
        routes = [
            ("GET", "/v1/responses/{}"),
            ("DELETE", "/v1/responses/{}"),
            ("POST", "/v1/responses/{}/cancel"),
            ("GET", "/v1/responses/{}/input_items"),
        ]
        for method, route in routes:
            for other_kind in ("msg_1", "chatcmpl-1", "x"):
                got = await error_of(http, method, route.format(other_kind))
                assert got == (400, "response_id", "invalid_value"), (method, route, got)
            got = await error_of(http, method, route.format("resp_unknown"))
            assert got == (404, "response_id", "not_found"), (method, route)
        assert (await http.post("/v1/responses/resp_1/bogus")).status_code == 404
        with pytest.raises(openai.BadRequestError):
            await client.responses.retrieve("msg_1")

        kw = dict(input=PROMPT, max_output_tokens=2, **GREEDY)
        a = await client.responses.create(**kw)
        b = await client.responses.create(**kw)
        path = f"/v1/responses/{a.id}"
        for query, param in [({"limit": 0}, "limit"), ({"limit": 101}, "limit"),
                             ({"limit": "x"}, "limit"), ({"order": "up"}, "order"),
                             ({"after": "msg_nope"}, "after")]:  # fmt: skip
            got = await error_of(http, "GET", f"{path}/input_items", params=query)
            assert got == (400, param, "invalid_value"), query
        assert await error_of(http, "GET", path, params={"stream": "true"}) == (
            400, "stream", "unsupported_value",
        )  # fmt: skip

        # the count bound (2 here): the least recently used goes; a was read since b
        c = await client.responses.create(**kw)
        with pytest.raises(openai.NotFoundError) as raised:
            await client.responses.retrieve(b.id)
        assert "evicted" in raised.value.body["message"]
        with pytest.raises(openai.NotFoundError) as raised:
            await client.responses.create(**kw, previous_response_id=b.id)
        assert raised.value.body["code"] == "previous_response_not_found"
        # continuing a is a use too: c is now the oldest, and goes for d
        d = await client.responses.create(**kw, previous_response_id=a.id)
        assert (await client.responses.retrieve(a.id)).id == a.id
        assert (await client.responses.retrieve(d.id)).id == d.id
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(c.id)

    run_served_flow(served_chain_dirs, POLICY, body, responses={"max_responses": 2})


def test_the_byte_bound(served_chain_dirs: dict[str, str]) -> None:
    """838 bytes here: a short input fits, its response does not (returned with ``store``
    false, not stored); an input larger alone is a 400 naming ``store``, served without it."""
    long_input = " ".join(f"w{10 + i % 100}" for i in range(200))

    async def body(client: openai.AsyncOpenAI, _rt: Any, http: httpx.AsyncClient) -> None:
        kw = dict(max_output_tokens=2, **GREEDY)
        short = await client.responses.create(input=PROMPT, **kw)
        assert extra(short, "store") is False and short.usage.output_tokens == 2
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(short.id)
        events = await events_of(await client.responses.create(input=PROMPT, stream=True, **kw))
        assert events[0]["response"]["store"] is True and events[-1]["response"]["store"] is False

        response = await http.post("/v1/responses", json={"input": long_input, **kw})
        error = response.json()["error"]
        assert (response.status_code, error["param"], error["code"]) == (
            400, "store", "invalid_value",
        )  # fmt: skip
        assert "store: false" in error["message"]
        served = await client.responses.create(input=long_input, store=False, **kw)
        assert served.usage.output_tokens == 2

    run_served_flow(served_chain_dirs, POLICY, body, responses={"max_mib": 0.0008})
