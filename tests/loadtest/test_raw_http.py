"""The probes' bare HTTP/1.1 client against a real uvicorn server: a streamed (chunked)
body timed to the first wanted line, a sized one, keep-alive, an error status, and a
server that closes the connection."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from loadtest.raw_http import RawHttp, RawHttpError

DELAY_S = 0.15  # before the stream's content line


async def stream(request: Request) -> Response:
    body = json.loads(await request.body())

    async def events():
        yield b'data: {"choices": [{"delta": {"role": "assistant"}}]}\n\n'
        await asyncio.sleep(DELAY_S)
        # one line split over two chunks: the client joins them
        yield b'data: {"choices": [{"delta": {"content": "' + body["word"].encode()
        yield b'"}}]}\n\n'
        await asyncio.sleep(DELAY_S)
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


async def sized(request: Request) -> Response:
    await request.body()
    return Response(b"one\ntwo\nthree\n", media_type="text/plain")


async def refused(request: Request) -> Response:
    await request.body()
    return JSONResponse({"error": {"message": "no"}}, status_code=400)


async def closing(request: Request) -> Response:
    await request.body()
    return Response(b"bye\n", headers={"Connection": "close"})


APP = Starlette(routes=[Route(p, f, methods=["POST"]) for p, f in
                        (("/p/stream", stream), ("/p/sized", sized), ("/p/refused", refused),
                         ("/p/closing", closing))])  # fmt: skip


def content(line: str) -> bool:
    return line.startswith("data: {") and '"content"' in line


async def served(test) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(APP, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        await test(f"http://127.0.0.1:{sock.getsockname()[1]}/p")
    finally:
        server.should_exit = True
        await task


def test_a_stream_is_timed_to_its_first_wanted_line_on_one_connection() -> None:
    async def test(url: str) -> None:
        async with RawHttp(url) as http:
            for word in ("Paris", "Rome"):
                found, body = await http.post_until("/stream", b'{"word": "%s"}' % word.encode(),
                                                    content)  # fmt: skip
                assert DELAY_S <= found < 2 * DELAY_S  # the content line, not the first
                assert body.decode().count("data: ") == 3 and word in body.decode()
                assert body.endswith(b"data: [DONE]\n\n")
            found, body = await http.post_until("/sized", b"{}", lambda line: line == "two")
            assert found is not None and body == b"one\ntwo\nthree\n"
            found, _ = await http.post_until("/sized", b"{}", lambda line: line == "four")
            assert found is None
            assert http.connections == 1  # kept alive throughout

    asyncio.run(served(test))


def test_an_error_status_raises_with_its_body_and_a_closing_server_is_redialled() -> None:
    async def test(url: str) -> None:
        async with RawHttp(url) as http:
            with pytest.raises(RawHttpError) as err:
                await http.post_until("/refused", b"{}", content)
            assert err.value.status == 400 and b'"no"' in err.value.body
            for _ in range(2):  # the server closes after each: the next connects again
                found, body = await http.post_until("/closing", b"{}", lambda line: True)
                assert found is not None and body == b"bye\n"
            assert http.connections == 2  # the error kept the first; the first close ended it
            found, _ = await http.post_until("/sized", b"{}", lambda line: line == "one")
            assert found is not None and http.connections == 3

    asyncio.run(served(test))


def test_only_plain_http_urls_are_taken() -> None:
    with pytest.raises(ValueError, match="http://"):
        RawHttp("https://127.0.0.1:1/v1")
