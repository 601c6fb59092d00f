"""Backpressure for streaming responses: a bounded buffer per choice, and the rule that
ends a stream whose client stopped reading.

One ``StreamGate`` per streaming request (all ``n`` choices). Data enters from two sides:

- each choice task calls ``produced(index, n_tokens)`` for every text piece it hands to the
  SSE writer, then, while its choice has ``max_buffered_tokens`` or more produced but not
  yet taken by the client, ``await wait_for_room(index)`` instead of reading more committed
  tokens (those wait at the core, and the request keeps its admission slot);
- the SSE writer (the body generator of the HTTP response) calls ``sending()`` right before
  it yields a frame and ``sent(pieces)`` when it is resumed: an ASGI server resumes the body
  generator only once its ``send`` returned, and ``send`` blocks while the client's socket
  is full (uvicorn's flow control), so "time since the writer began to wait in ``send``" is
  the time since the client last took a chunk.

``stalled()`` is the rule: the writer has waited in ``send`` for ``client_stall_s`` or more
while a choice's buffer is full, or while every choice finished generating (nothing more
will come to unblock it). ``watch()`` returns when that happens; the response then aborts
the choices everywhere (ABORT to the models, KV freed, admission slot released) and stops,
which closes the connection. A reader that is slow but reading is never stalled: every
token reaches it, in order (the buffer only makes the choice wait).

The clock is injected (tests drive the rule with a fake one). No Ray, no HTTP.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Backpressure:
    """The limits of a streaming response (``ingress.stream_buffer_tokens`` and
    ``ingress.client_stall_s`` in the config)."""

    max_buffered_tokens: int = 256
    client_stall_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_buffered_tokens < 1:
            raise ValueError("max_buffered_tokens must be >= 1")
        if self.client_stall_s <= 0:
            raise ValueError("client_stall_s must be > 0")


class StreamGate:
    """One streaming request's view of its client (see the module docstring)."""

    def __init__(
        self, n: int, limits: Backpressure, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.limits = limits
        self.clock = clock
        self.buffered = [0] * n  # tokens produced, not yet taken by the client, per choice
        self._pieces: list[collections.deque[int]] = [collections.deque() for _ in range(n)]
        self.generating = n  # choices still reading committed tokens
        self.waiting_since: float | None = None  # the writer is blocked in send since then
        self.stalled_at: float | None = None  # when the rule fired (None: it did not)
        self._room = asyncio.Event()
        self._changed = asyncio.Event()

    # --------------------------------------------------------------- choice side
    def produced(self, index: int, n_tokens: int) -> None:
        """A piece of ``n_tokens`` tokens of choice ``index`` went to the writer."""
        self._pieces[index].append(n_tokens)
        self.buffered[index] += n_tokens
        if self.full(index):
            self._changed.set()

    def full(self, index: int) -> bool:
        return self.buffered[index] >= self.limits.max_buffered_tokens

    async def wait_for_room(self, index: int) -> None:
        """Until choice ``index`` is below its bound again (the client took chunks)."""
        while self.full(index):
            self._room.clear()
            await self._room.wait()

    def finished(self) -> None:
        """A choice stopped generating (it ended, failed or was cancelled)."""
        self.generating -= 1
        self._changed.set()

    # --------------------------------------------------------------- writer side
    def sending(self) -> None:
        """The writer is about to hand a frame to the server (and may block there)."""
        self.waiting_since = self.clock()

    def sent(self, pieces: Iterable[int] = ()) -> None:
        """The server took the frame, which carried a piece of each choice in ``pieces``
        (one entry per piece, in the order they were produced)."""
        self.waiting_since = None
        for index in pieces:
            self.buffered[index] -= self._pieces[index].popleft()
        self._room.set()

    # --------------------------------------------------------------- the rule
    @property
    def buffered_total(self) -> int:
        return sum(self.buffered)

    def stalled(self) -> bool:
        """The client has not taken a chunk for ``client_stall_s`` while output waits for it
        that cannot move otherwise (a full choice, or no choice generating any more)."""
        if self.waiting_since is None:
            return False
        if self.clock() - self.waiting_since < self.limits.client_stall_s:
            return False
        return self.generating <= 0 or any(map(self.full, range(len(self.buffered))))

    def check_in_s(self) -> float:
        """How long until ``stalled()`` could first turn true (inf: not while nothing
        changes)."""
        if self.waiting_since is None:
            return float("inf")
        return max(0.0, self.waiting_since + self.limits.client_stall_s - self.clock())

    async def watch(self) -> None:
        """Returns once ``stalled()`` (and records when); runs until cancelled otherwise.

        It does not wake per frame: it sleeps until the current wait in ``send`` would reach
        ``client_stall_s``, or a quarter of that while the writer is not waiting (a wait
        that began meanwhile is then seen at most that late, and still cut on its own
        deadline), or after the deadline while the rule's other half does not hold (it was
        spinning there before). A choice filling up or ending wakes it at once."""
        poll_s = self.limits.client_stall_s / 4
        while not self.stalled():
            self._changed.clear()
            wait = self.check_in_s()
            timeout = wait if 0 < wait < poll_s else poll_s
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout)
        self.stalled_at = self.clock()
