"""SSE framing and chunk sequences, parsed by the official client's chunk types and by the
client itself (over an in-memory transport); plus the whole streaming path an ingress runs."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types import Completion as OpenAICompletion
from openai.types.chat import ChatCompletionChunk

from tokenrouter_ray.openai import (
    SSE_DONE,
    ChatCompletionRequest,
    ChatStream,
    CompletionStream,
    IncrementalDetokenizer,
    InvalidRequestError,
    RequestLimits,
    RoutingInfo,
    Usage,
    parse_request,
    prepare_chat,
    sse_error,
    sse_event,
)


def events(stream: bytes) -> list[Any]:
    """Decoded ``data:`` payloads, ``"[DONE]"`` kept as the string."""
    out = []
    for block in stream.decode().split("\n\n"):
        if block:
            assert block.startswith("data: ") and "\n" not in block
            data = block.removeprefix("data: ")
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def client_for(body: bytes) -> openai.OpenAI:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    return openai.OpenAI(
        api_key="-",
        base_url="http://test/v1",
        max_retries=0,
        http_client=httpx.Client(transport=httpx.MockTransport(handler)),
    )


def test_sse_event_framing() -> None:
    assert sse_event({"a": "é"}) == 'data: {"a":"é"}\n\n'.encode()
    assert sse_event(RoutingInfo(handoffs=1)) == (
        b'data: {"tokens_per_model":{},"handoffs":1,"mode":"routed","reason":null}\n\n'
    )


def test_sse_event_is_strict_json_with_the_same_values() -> None:
    """Floats keep their value (shortest round-trip form); a non-finite float is ``null``
    (strict JSON: a client's parser need not accept ``-Infinity``)."""
    data = {
        "logprob": -1.2345678901234567e-05,
        "big": 1e22,
        "s": "a\u2028\x00😀",
        "inf": float("-inf"),
    }
    event = sse_event(data)
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")

    def strict(token: str) -> None:
        raise AssertionError(f"non-standard JSON token {token}")

    back = json.loads(event[6:-2], parse_constant=strict)
    assert back == {**data, "inf": None}
    assert SSE_DONE == b"data: [DONE]\n\n"


def test_chat_stream_sequence_with_usage() -> None:
    s = ChatStream("tiny", n=2, include_usage=True, request_id="chatcmpl-x", created=1)
    body = (
        s.start()
        + s.delta(0, "Hel")
        + s.delta(1, "Yo")
        + s.delta(0, "")
        + s.delta(0, "lo")
        + s.finish(0, "stop", RoutingInfo(tokens_per_model={"small": 2}))
        + s.finish(1, "length", RoutingInfo(tokens_per_model={"large": 1}, handoffs=1), text="!")
        + s.end(Usage.of(5, 4), RoutingInfo(tokens_per_model={"small": 2, "large": 1}, handoffs=1))
    )
    got = events(body)
    assert got[-1] == "[DONE]"
    chunks = [ChatCompletionChunk.model_validate(e) for e in got[:-1]]
    assert [c.choices[0].delta.role for c in chunks[:2]] == ["assistant", "assistant"]
    assert [c.choices[0].index for c in chunks[:2]] == [0, 1]
    assert all(c.id == "chatcmpl-x" and c.object == "chat.completion.chunk" for c in chunks)
    assert all(c.usage is None and "usage" in e for c, e in zip(chunks[:-1], got, strict=False))
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [(c.choices[0].index, c.choices[0].finish_reason) for c in finish] == [
        (0, "stop"),
        (1, "length"),
    ]
    assert finish[0].choices[0].delta.content is None and finish[1].choices[0].delta.content == "!"
    assert finish[1].model_extra["routing"] == {
        "tokens_per_model": {"large": 1},
        "handoffs": 1,
        "mode": "routed",
        "reason": None,
    }
    last = chunks[-1]
    assert last.choices == [] and last.usage.total_tokens == 9
    assert last.model_extra["routing"]["tokens_per_model"] == {"small": 2, "large": 1}


def test_chat_stream_without_usage_has_no_usage_chunk() -> None:
    s = ChatStream("tiny")
    got = events(s.start() + s.delta(0, "x") + s.finish(0, "stop") + s.end(Usage.of(1, 1)))
    assert got[-1] == "[DONE]" and all("usage" not in e for e in got[:-1])
    assert all(e["choices"] for e in got[:-1])


def test_completion_stream_parses_as_completion_chunks() -> None:
    s = CompletionStream("tiny", n=1, include_usage=True)
    assert s.start() == b""
    body = (
        s.delta(0, "a b") + s.finish(0, "length", text="c") + s.end(Usage.of(3, 2), RoutingInfo())
    )
    got = events(body)
    # Mid-stream chunks have `finish_reason: null`, as OpenAI's do, which the client's
    # `Completion` type (shared with non-streaming) does not allow; the client builds stream
    # chunks without validation, so only the finish and usage chunks are validated here.
    assert got[0]["choices"][0] == {
        "index": 0,
        "text": "a b",
        "logprobs": None,
        "finish_reason": None,
    }
    assert got[0]["id"].startswith("cmpl-") and got[0]["object"] == "text_completion"
    finish, usage = (OpenAICompletion.model_validate(e) for e in got[1:3])
    assert finish.choices[0].text == "c" and finish.choices[0].finish_reason == "length"
    assert usage.choices == [] and usage.usage.completion_tokens == 2


def test_openai_client_streams_completions() -> None:
    s = CompletionStream("tiny", include_usage=True)
    body = s.delta(0, "Hello") + s.delta(0, " world") + s.finish(0, "stop") + s.end(Usage.of(2, 2))
    stream = client_for(body).completions.create(model="tiny", prompt="x", stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "Hello world"
    assert chunks[-1].usage.total_tokens == 4


def test_error_mid_stream_raises_in_the_client() -> None:
    s = ChatStream("tiny")
    body = s.start() + s.delta(0, "partial") + sse_error(InvalidRequestError("boom")) + SSE_DONE
    stream = client_for(body).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], stream=True
    )
    with pytest.raises(openai.APIError, match="boom"):
        list(stream)


def fake_engine(tokenizer: Any, outputs: list[str], seed: int) -> Iterator[tuple[int, list[int]]]:
    """Committed token ids of ``n`` choices, interleaved in uneven batches, as the runtime
    would deliver them: ``(choice index, new ids)``; each choice ends with EOS."""
    import random

    rng = random.Random(seed)
    pending = [[*tokenizer.encode(text), tokenizer.eos_token_id] for text in outputs]
    while any(pending):
        i = rng.choice([i for i, ids in enumerate(pending) if ids])
        k = rng.randint(1, 3)
        yield i, pending[i][:k]
        pending[i] = pending[i][k:]


@pytest.mark.demo
def test_streaming_chat_n2_end_to_end(demo_tokenizer: Any) -> None:
    """What the ingress does for a streaming chat request with n=2 and a stop string."""
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Say something"}],
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
        "stop": ["STOP"],
        "max_tokens": 50,
    }
    request = parse_request(ChatCompletionRequest, json.dumps(body))
    prepared = prepare_chat(request, demo_tokenizer, RequestLimits(max_model_len=2048))
    opts = prepared.sampling
    stream = ChatStream(request.model, n=opts.n, include_usage=opts.include_usage)
    detoks = [
        IncrementalDetokenizer(
            demo_tokenizer, stop=opts.stop, prompt_token_ids=prepared.prompt_token_ids
        )
        for _ in range(opts.n)
    ]
    outputs = ["Bonjour 😀 le monde, 世界! STOP ignored", "Hola 👋🏽 amigos\n\nfin"]
    sent = stream.start()
    done = [False] * opts.n
    for i, ids in fake_engine(demo_tokenizer, outputs, seed=5):
        if done[i]:
            continue  # already aborted; tokens in flight are dropped
        sent += stream.delta(i, detoks[i].push(ids))
        if detoks[i].stopped or ids[-1] == demo_tokenizer.eos_token_id:
            done[i] = True
            tail = detoks[i].finish()
            sent += stream.finish(i, "stop", RoutingInfo(tokens_per_model={"small": 1}), text=tail)
    completion_tokens = sum(d.num_tokens for d in detoks)
    sent += stream.end(Usage.of(len(prepared.prompt_token_ids), completion_tokens), RoutingInfo())

    chunks = list(client_for(sent).chat.completions.create(**body))
    texts = ["", ""]
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == ["Bonjour 😀 le monde, 世界! ", "Hola 👋🏽 amigos\n\nfin"]
    assert detoks[0].stop_reason == "STOP" and not detoks[1].stopped
    assert chunks[-1].usage.completion_tokens == completion_tokens
    assert chunks[-1].usage.prompt_tokens == len(prepared.prompt_token_ids)


def test_merged_choice_streams_order_and_early_close() -> None:
    """Two choices producing pieces concurrently: every piece of a choice comes before its
    finish chunk, usage sums both, [DONE] last; closing the stream early cancels them."""
    import asyncio

    from tokenrouter_ray.openai.choice_update import ChoiceUpdate
    from tokenrouter_ray.openai.responses import ChoiceResult
    from tokenrouter_ray.openai.sse import merge_choice_streams

    async def choice(index: int, words: list[str], pieces: asyncio.Queue) -> ChoiceResult:
        for w in words:
            await asyncio.sleep(0.001 * (index + 1))
            pieces.put_nowait(ChoiceUpdate(index, w))
        routing = RoutingInfo(tokens_per_model={"small": len(words)}, handoffs=index)
        return ChoiceResult(index, "".join(words), "stop", len(words), routing)

    async def collect() -> list[Any]:
        pieces: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.ensure_future(choice(i, w, pieces))
                 for i, w in enumerate([["a", "b", "c"], ["x", "y"]])]  # fmt: skip
        stream = CompletionStream("tiny", n=2, include_usage=True)
        return [f async for f in merge_choice_streams(stream, tasks, pieces, prompt_len=4)]

    frames = events(b"".join(asyncio.run(collect())))
    assert frames[-1] == "[DONE]"
    usage = frames[-2]
    assert usage["usage"]["completion_tokens"] == 5 and usage["usage"]["prompt_tokens"] == 4
    assert usage["routing"] == {
        "tokens_per_model": {"small": 5},
        "handoffs": 1,
        "mode": "routed",
        "reason": None,
    }
    for index, words in ((0, "abc"), (1, "xy")):
        mine = [f["choices"][0] for f in frames[:-2] if f["choices"] and
                f["choices"][0]["index"] == index]  # fmt: skip
        text = "".join(c["text"] for c in mine)
        assert text == words and mine[-1]["finish_reason"] == "stop"
        assert all(c["finish_reason"] is None for c in mine[:-1])

    async def close_early() -> list[bool]:
        pieces: asyncio.Queue = asyncio.Queue()
        never = asyncio.ensure_future(asyncio.sleep(3600))
        frames = merge_choice_streams(CompletionStream("tiny"), [never], pieces, prompt_len=1)
        await frames.__anext__()  # the first chunk, then the client goes away
        await frames.aclose()
        return [never.cancelled()]

    assert asyncio.run(close_early()) == [True]
