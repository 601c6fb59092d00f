"""A step whose kernels are queued on a device, read back when the host asks (CUDA).

``ModelRunner.launch`` queues a step's forward and sampler and returns at once on CUDA; the
host does the previous step's reports and sends, applies arriving messages and drafts the
next step while the device computes (runtime/step_loop.py). ``DeviceStep`` is that
launched step: calling it waits for its ``done`` event and reads the sampled tokens back
(one device-to-host copy, started at launch into pinned memory); ``wait_done(wake)``
returns once the device is done or ``wake`` is set first, whichever comes first. One
``EventWatcher`` thread per runner waits on each step's event and sets the step loop's wake
event, so the loop sleeps on a single event for both.

The event only needs ``query()`` and ``synchronize()`` (a ``torch.cuda.Event``); a test
passes a stand-in to check the logic on CPU.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Protocol

from tokenrouter_ray.engine.outputs import StepResult


class DeviceEvent(Protocol):
    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class EventWatcher:
    """A daemon thread that waits for each event it is handed, then sets its wake event.
    ``on_start`` runs first on that thread (the runner makes its device current there)."""

    def __init__(
        self, name: str = "device-events", on_start: Callable[[], None] | None = None
    ) -> None:
        self._pending: queue.SimpleQueue[tuple[DeviceEvent, threading.Event]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._name = name
        self._on_start = on_start

    def watch(self, event: DeviceEvent, wake: threading.Event) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        self._pending.put((event, wake))

    def _run(self) -> None:
        if self._on_start is not None:
            self._on_start()
        while True:
            event, wake = self._pending.get()
            with contextlib.suppress(Exception):  # the step's read-back raises it
                event.synchronize()  # releases the GIL while the device works
            wake.set()


class DeviceStep:
    """A launched step: ``step()`` waits and returns its ``StepResult`` (``finish`` builds
    it once ``done`` completed); ``wait_done(wake)`` as ``PendingStep.wait_done``."""

    __slots__ = ("_watched", "done", "finish", "watcher")

    def __init__(
        self, done: DeviceEvent, finish: Callable[[], StepResult], watcher: EventWatcher
    ) -> None:
        self.done, self.finish, self.watcher = done, finish, watcher
        self._watched = False

    def ready(self) -> bool:
        return self.done.query()

    def wait_done(self, wake: threading.Event) -> bool:
        if self.done.query():
            return True
        if not self._watched:  # the watcher sets ``wake`` when the device is done
            self.watcher.watch(self.done, wake)
            self._watched = True
        wake.wait()
        return self.done.query()

    def __call__(self) -> StepResult:
        self.done.synchronize()
        return self.finish()
