"""``FrameWaker``: the step thread's wake-up where it reads its channel itself.

A replica's step thread sleeps in three places: while the device runs a step (the runner's
``wait_done(wake)``), while it is idle, and in ``Event.wait`` calls the runners make. With a
receiver thread, a frame costs that thread a wake-up, a MAC check and a decode under the
interpreter lock beside the step thread, and a hand-off that wakes the step thread again
(docs/benchmarks/README.md). ``FrameWaker`` is a ``threading.Event`` for those callers
whose ``wait`` also watches the channel (``transport.base.InlineSource``): it sleeps in one
``select`` on an eventfd (``set`` from other threads: the event loop's calls, a device
watcher) and the channel's descriptor, and reads the frames that arrived when it wakes,
handing their messages to ``on_batch`` on this thread. So a frame
that arrives while the step thread waits costs one wake-up of the thread that applies it,
and one that arrives while it works is read between steps (``poll``).

``select`` and not ``poll``/``epoll``: their timeouts are whole milliseconds, and the step
thread's waits (a simulated device's remaining step time, a GPU runner's bounded polls) are
often shorter. In a process whose descriptors reach ``select``'s limit (FD_SETSIZE, 1,024)
it waits in ``poll``, its timeouts rounded up to the millisecond.

ZeroMQ's descriptor signals edges: it turns readable when a frame reaches a socket that was
left drained, not once per frame. So a read that stops at ``READ_LIMIT`` with frames left
remembers it (``_more``) and the next wait or poll reads on without waiting for a signal.
"""

from __future__ import annotations

import contextlib
import math
import os
import select
import threading
import time
from collections.abc import Callable

from tokenrouter_ray.protocol import PeerReq
from tokenrouter_ray.transport.base import InlineSource

# frames read in one go before the step thread goes back to its work (a flood of queued
# frames is read over several turns, between steps)
READ_LIMIT = 64
SELECT_LIMIT = 1024  # the first descriptor ``select.select`` cannot watch (FD_SETSIZE)


class FrameWaker:
    """``set`` / ``clear`` / ``is_set`` / ``wait`` as ``threading.Event``'s, for one waiting
    thread (the step thread, ``owner``); ``wait`` and ``poll`` also read the channel."""

    def __init__(self, source: InlineSource, on_batch: Callable[[list[PeerReq]], None]) -> None:
        self.source, self.on_batch = source, on_batch
        self._flag = False
        self._fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._written = False  # another thread wrote the eventfd since the last drain
        self._owner: int | None = None  # the waiting thread's ident (``own``)
        self._source_fd = source.fileno()  # fixed for the socket's life
        self._edge = select.poll()  # the zero-wait look at it (``poll``)
        self._edge.register(self._source_fd, select.POLLIN)
        # where ``select`` cannot watch both descriptors: ``poll``, in whole milliseconds
        self._poller: select.poll | None = None
        if max(self._fd, self._source_fd) >= SELECT_LIMIT:
            self._poller = select.poll()
            self._poller.register(self._fd, select.POLLIN)
        self._more = True  # frames may wait that no edge announces (read until drained)
        self.frames = 0  # frames read (status and tests)

    def own(self) -> None:
        """The calling thread is the one that waits and reads (the step thread)."""
        self._owner = threading.get_ident()

    def close(self) -> None:
        """Close the eventfd now (tests). A replica leaves it to ``__del__``: a thread that
        still holds the waker (a device watcher finishing late) could ``set`` it after an
        explicit close, into whatever reused the descriptor's number."""
        fd, self._fd = getattr(self, "_fd", -1), -1
        if fd >= 0:
            os.close(fd)

    def __del__(self) -> None:
        self.close()

    # ------------------------------------------------------------ threading.Event's
    def is_set(self) -> bool:
        return self._flag

    def set(self) -> None:
        """From any thread. The waiting thread's own ``set`` (a frame it read, handed on)
        needs no system call: it is not asleep."""
        if self._flag:
            return
        self._flag = True
        if threading.get_ident() != self._owner and self._fd >= 0:
            self._written = True  # before the write: ``clear`` then drains it
            with contextlib.suppress(OSError):  # closed at shutdown
                os.eventfd_write(self._fd, 1)

    def clear(self) -> None:
        """Drains the eventfd only when another thread wrote it since: the step thread
        clears once per turn of its wait loop, and a read that finds nothing is a system
        call and a raised ``OSError`` (1.6 % of the small replica's interpreter time at
        h200 N = 64). A write that lands after the drain is only a stale count: ``wait``
        drains it when it wakes on it, and sleeps again unless the flag is set."""
        self._flag = False  # before the drain: a ``set`` in between stays seen
        if self._written:
            self._written = False
            with contextlib.suppress(OSError):  # nothing written yet (EAGAIN), or closed
                os.eventfd_read(self._fd)

    def wait(self, timeout: float | None = None) -> bool:
        """Until ``set`` or a frame arrived (read and handed on first), or ``timeout``:
        whether it was set."""
        deadline = None if timeout is None else time.monotonic() + timeout
        source, fd, source_fd = self.source, self._fd, self._source_fd
        while not self._flag:
            paused = source.paused_s()
            if self._more and not paused:  # frames left behind: no edge will say so
                self._read()
                continue
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            if paused and (left is None or paused < left):
                left = paused
            try:
                ready = self._sleep(fd, None if paused else source_fd, left)
            except (OSError, ValueError):  # a descriptor closed under us: shutting down
                return self._flag
            if fd in ready:
                with contextlib.suppress(OSError):
                    os.eventfd_read(fd)
            if source_fd in ready:
                self._read()
        return self._flag

    def _sleep(self, fd: int, source_fd: int | None, left: float | None) -> list[int]:
        """Until ``fd`` or ``source_fd`` (None: not watched) is readable, or ``left``
        seconds: the readable ones."""
        poller = self._poller
        if poller is None:
            watch = [fd] if source_fd is None else [fd, source_fd]
            return select.select(watch, (), (), left)[0]
        if source_fd is None:
            with contextlib.suppress(KeyError):
                poller.unregister(self._source_fd)
        else:
            poller.register(self._source_fd, select.POLLIN)  # (again: a modify)
        timeout = None if left is None else math.ceil(left * 1000)
        return [ready for ready, _ in poller.poll(timeout)]

    # -------------------------------------------------------------------- frames
    def poll(self) -> bool:
        """Read what arrived since the last read (at most ``READ_LIMIT`` frames), without
        waiting; whether the flag is set (a message was handed on)."""
        if (self._more or self._edge.poll(0)) and not self.source.paused_s():
            self._read()
        return self._flag

    def _read(self) -> None:
        read, drained = self.source.read(self.on_batch, READ_LIMIT)
        self.frames += read
        self._more = not drained
