"""Stopping a background asyncio task for good.

``asyncio.wait_for`` before Python 3.12 can swallow a cancellation that arrives as the call
it waits on completes (CPython gh-86296): a polling loop around it (``while True: sleep;
wait_for(poll)``) then goes on as if never cancelled, and ``task.cancel(); await task``
waits forever. ``cancel_and_wait`` cancels again until the task has ended.
"""

from __future__ import annotations

import asyncio
import contextlib

RECANCEL_S = 0.05  # how long a cancelled task may take to end before it is cancelled again


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancel ``task`` (None: nothing) and wait until it has ended; its cancellation is not
    an error, any other exception it ended with is raised."""
    if task is None:
        return
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=RECANCEL_S)
    with contextlib.suppress(asyncio.CancelledError):
        await task
