"""``TokenChunks``: a streamed reader is woken by every chunk, an unstreamed one only by the
end (and then reads everything, in order)."""

from __future__ import annotations

import asyncio

import pytest

from tests.waiting import wait_until
from tokenrouter_ray.ingress.core import TokenChunks


async def _wakes(chunks: TokenChunks, puts: list[list[int] | None]) -> tuple[int, list]:
    """Put ``puts`` one per event-loop turn while a reader waits; how many times the
    reader's ``get`` returned before the end, and everything it read."""
    got: list[list[int] | None] = []
    wakes = 0

    async def reader() -> None:
        nonlocal wakes
        while True:
            item = await chunks.get()
            got.append(item)
            if item is None:
                return
            wakes += 1
            while not chunks.empty():
                got.append(more := chunks.get_nowait())
                if more is None:
                    return

    task = asyncio.create_task(reader())
    for item in puts:
        await asyncio.sleep(0)  # the reader is waiting again
        chunks.put_nowait(item)
    await asyncio.wait_for(task, 5)
    return wakes, got


@pytest.mark.parametrize("each_chunk", [True, False])
def test_a_reader_is_woken_per_chunk_only_when_it_asks(each_chunk: bool) -> None:
    chunks = TokenChunks()
    chunks.each_chunk = each_chunk
    puts: list[list[int] | None] = [[1], [2, 3], [4], None]
    wakes, got = asyncio.run(_wakes(chunks, puts))
    assert got == puts  # same items, same order either way
    assert wakes == (3 if each_chunk else 1)


def test_an_unstreamed_reader_waits_for_the_end_even_with_tokens_queued() -> None:
    async def run() -> bool:
        chunks = TokenChunks()
        chunks.each_chunk = False
        chunks.put_nowait([7])
        waiting = asyncio.create_task(chunks.get())
        # the reader waits (had it been woken by the queued tokens, it would have returned)
        await wait_until(lambda: chunks._waiter is not None or waiting.done(), 20, "get waiting")
        early = waiting.done()
        chunks.put_nowait(None)  # an abort or a failure ends it the same way
        assert await asyncio.wait_for(waiting, 5) == [7]
        return early

    assert asyncio.run(run()) is False


def test_a_cancelled_reader_leaves_no_waiter_behind() -> None:
    async def run() -> None:
        chunks = TokenChunks()
        task = asyncio.create_task(chunks.get())
        await asyncio.sleep(0)  # one turn: the reader starts waiting
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        chunks.put_nowait([1])  # no waiter left to set: must not raise
        assert chunks.get_nowait() == [1]

    asyncio.run(run())
