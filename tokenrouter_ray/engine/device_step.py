"""A step whose kernels are queued on a device, read back when the host asks (CUDA).

``ModelRunner.launch`` queues a step's forward and sampler and returns at once on CUDA; the
host does the previous step's reports and sends, applies arriving messages and drafts the
next step while the device computes (replica/step.py). ``DeviceStep`` is that
launched step: calling it waits for its ``done`` event and reads the sampled tokens back
(one device-to-host copy, started at launch into pinned memory); ``wait_done(wake)``
returns once the device is done or ``wake`` is set first, whichever comes first. One
``EventWatcher`` thread per runner waits on each step's event and sets the step loop's wake
event, so the loop sleeps on a single event for both.

The event only needs ``query()`` and ``synchronize()`` (a ``torch.cuda.Event``); a test
passes a stand-in to check the logic on CPU.

Host values reach the device through ``to_device`` / ``host_to_device`` only: a pinned
staging copy queued without blocking on CUDA (a copy from pageable memory, or a
``torch.tensor(..., device=cuda)``, would wait for every kernel queued before it: the whole
forward, between launch and collect), the host tensor itself on CPU.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Protocol

import torch

from tokenrouter_ray.engine.outputs import StepResult

# How long one ``wait_done`` sleeps on its wake event before it polls the device again (a
# lost wake-up, or a watcher thread that died, then costs this much, never a hang).
WAKE_POLL_S = 0.05


def to_device(
    values: object, dtype: torch.dtype | None, device: torch.device | str
) -> torch.Tensor:
    """Python values (a list, nested lists or a scalar) as a tensor on ``device``: built on
    the host, then, on CUDA, copied once from pinned memory without blocking the host."""
    device = torch.device(device)
    if device.type != "cuda":  # the host itself, or a device without pinned staging (meta)
        host = torch.tensor(values, dtype=dtype)
        return host if device.type == "cpu" else host.to(device)
    host = torch.tensor(values, dtype=dtype, pin_memory=True)  # pragma: no cover - needs CUDA
    return host.to(device, non_blocking=True)  # pragma: no cover - needs CUDA


def host_to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on ``device``: on CUDA copied into fresh pinned memory (the caching
    host allocator keeps it until the copy ran), then queued without blocking; on CPU
    ``host`` itself."""
    device = torch.device(device)
    if device.type != "cuda":
        return host if device.type == "cpu" else host.to(device)
    pinned = host if host.is_pinned() else host.pin_memory()  # pragma: no cover - needs CUDA
    return pinned.to(device, non_blocking=True)  # pragma: no cover - needs CUDA


def host_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty host tensor a device result is copied back into: pinned when ``device`` is
    CUDA (so the copy does not block), plain otherwise."""
    return torch.empty(shape, dtype=dtype, pin_memory=torch.device(device).type == "cuda")


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
        while not wake.wait(WAKE_POLL_S):  # bounded sleeps: a lost wake-up cannot hang
            if self.done.query():
                return True
        return self.done.query()

    def __call__(self) -> StepResult:
        self.done.synchronize()
        return self.finish()
