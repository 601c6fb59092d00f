"""Waiting for a condition in tests: poll it until it holds or a deadline passes (never a
bare sleep standing in for the condition)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def wait_until(
    condition: Callable[[], bool], timeout_s: float = 20.0, what: str = "condition"
) -> None:
    """Until ``condition()`` holds, checking every 10 ms on the running loop;
    AssertionError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached in {timeout_s} s")
        await asyncio.sleep(0.01)


def wait_for(condition: Callable[[], bool], timeout_s: float = 60.0, what: str = "condition"):
    """The blocking twin of ``wait_until`` (checks every 50 ms); returns the condition's
    first true value."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached in {timeout_s} s")
        time.sleep(0.05)
    return value
