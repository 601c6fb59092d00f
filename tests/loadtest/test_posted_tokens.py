"""The baselines' one reading of what a generating thread posts (loadtest/baselines/api.py):
token lists until the end, an error raised with its message."""

from __future__ import annotations

import asyncio

import pytest

from loadtest.baselines.api import posted_tokens


async def read(items: list[tuple[str, object]]) -> list[list[int]]:
    out: asyncio.Queue = asyncio.Queue()
    for item in items:
        out.put_nowait(item)
    return [ids async for ids in posted_tokens(out)]


def test_token_lists_until_the_end() -> None:
    items = [("tokens", [1, 2]), ("tokens", [3]), ("end", "length"), ("tokens", [9])]
    assert asyncio.run(read(items)) == [[1, 2], [3]]


def test_an_error_is_raised_with_its_message() -> None:
    with pytest.raises(ValueError, match="device lost"):
        asyncio.run(read([("tokens", [1]), ("error", "device lost")]))
