"""A step queued on a device (engine/device_step.py), with a stand-in for a CUDA event: the
step loop's wait returns on a message or when the device is done, whichever is first, and
reads the step back only then; a device error still wakes the loop."""

from __future__ import annotations

import threading

import pytest

from tokenrouter_ray.engine.device_step import DeviceStep, EventWatcher


class FakeEvent:
    """Completes when ``device`` is set (or fails, when ``error`` is given)."""

    def __init__(self, device: threading.Event, error: Exception | None = None) -> None:
        self.device, self.error, self.synced = device, error, 0

    def query(self) -> bool:
        return self.device.is_set()

    def synchronize(self) -> None:
        self.device.wait()
        self.synced += 1
        if self.error is not None:
            raise self.error


def in_thread(call: object) -> tuple[threading.Thread, list]:
    out: list = []
    thread = threading.Thread(target=lambda: out.append(call()))  # type: ignore[operator]
    thread.start()
    return thread, out


def test_the_wait_returns_on_a_message_first_then_when_the_device_is_done() -> None:
    device, wake = threading.Event(), threading.Event()
    event = FakeEvent(device)
    step = DeviceStep(event, lambda: "result", EventWatcher())
    thread, out = in_thread(lambda: step.wait_done(wake))
    wake.set()  # a message arrived: the step still runs
    thread.join(10)
    assert out == [False] and not device.is_set()
    wake.clear()
    thread, out = in_thread(lambda: step.wait_done(wake))
    device.set()  # the device finished: the watcher wakes the loop
    thread.join(10)
    assert out == [True] and wake.is_set()
    assert step() == "result"


def test_the_watcher_runs_its_start_hook_on_its_own_thread_first() -> None:
    started: list[str] = []
    device, wake = threading.Event(), threading.Event()
    watcher = EventWatcher(on_start=lambda: started.append(threading.current_thread().name))
    step = DeviceStep(FakeEvent(device), lambda: "result", watcher)
    thread, out = in_thread(lambda: step.wait_done(wake))
    device.set()
    thread.join(10)
    assert out == [True] and started == ["device-events"]


def test_a_step_already_done_needs_no_watcher() -> None:
    device, wake = threading.Event(), threading.Event()
    device.set()
    watcher = EventWatcher()
    step = DeviceStep(FakeEvent(device), lambda: "result", watcher)
    assert step.wait_done(wake) is True
    assert watcher._thread is None  # nothing was waited for
    assert step() == "result"


def test_a_failing_device_still_wakes_the_loop_and_the_read_back_raises() -> None:
    device, wake = threading.Event(), threading.Event()
    event = FakeEvent(device, RuntimeError("device lost"))
    step = DeviceStep(event, lambda: "result", EventWatcher())
    thread, out = in_thread(lambda: step.wait_done(wake))
    device.set()
    thread.join(10)
    assert out == [True] and wake.is_set()
    with pytest.raises(RuntimeError, match="device lost"):
        step()
    # the watcher lives on for the next step
    device2, wake2 = threading.Event(), threading.Event()
    step2 = DeviceStep(FakeEvent(device2), lambda: "next", step.watcher)
    thread, out = in_thread(lambda: step2.wait_done(wake2))
    device2.set()
    thread.join(10)
    assert out == [True] and step2() == "next"
