"""The threshold tuner's step table and the step-time metric read ``StepTimings.total``:
on the device path the forward's device time once, the host's queuing in ``launch`` never
added. The engine runs its CUDA launch/collect path on CPU with stand-in events
that report a fixed device time while the host's queuing is made long."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.engine.test_no_host_sync import KINDS, StandInEvent, overlapped_engine, prompt
from tests.openai.qwen3_tiny import save_qwen3
from tokenrouter_ray.metrics import definitions as m
from tokenrouter_ray.metrics.recorder import Metrics
from tokenrouter_ray.replica.step import Decided, Replica, Routed
from tokenrouter_ray.routing.policy import build_policy
from tokenrouter_ray.transport.base import InMemoryDirectory
from tokenrouter_ray.transport.inproc import InProcChannel, InProcHub

DEVICE_MS = 7.0  # what the stand-in events say the forward and sampler took
QUEUING_S = 0.25  # the host's time queuing them (inside the device time on a GPU)


class SlowQueueEvent(StandInEvent):
    """The step's events: a fixed device time between them; recording the ``done`` event
    (the last thing ``launch`` queues) takes the host ``QUEUING_S``."""

    recorded = 0

    def record(self) -> None:
        SlowQueueEvent.recorded += 1
        if SlowQueueEvent.recorded % 2 == 0:  # start, done, start, done, ...
            time.sleep(QUEUING_S)

    def elapsed_time(self, end: StandInEvent) -> float:
        return DEVICE_MS


class Recording:
    """A metrics backend that keeps every observation."""

    def __init__(self) -> None:
        self.observed: list[tuple[str, float]] = []

    def inc(self, metric: m.MetricDef, value: float, labels: tuple) -> None:
        pass

    def set(self, metric: m.MetricDef, value: float, labels: tuple) -> None:
        pass

    def observe(self, metric: m.MetricDef, value: float, labels: tuple) -> None:
        self.observed.append((metric.name, value))


def test_the_tuner_and_the_metrics_read_the_step_once(tmp_path: Path) -> None:
    engine = overlapped_engine(save_qwen3(tmp_path / "qwen3", 3))
    engine.runner._new_event = SlowQueueEvent  # type: ignore[method-assign]
    engine.add_request("s", prompt(), KINDS["top_p"])
    engine.commit(engine.collect(engine.launch()))  # the prefill (not in the step table)
    result = engine.collect(engine.launch())  # a decode
    engine.commit(result)
    t = result.timings
    assert t.forward == pytest.approx(DEVICE_MS / 1e3)  # the device's time, once
    assert t.launch >= QUEUING_S  # the host's queuing, apart
    assert t.total == pytest.approx(t.schedule + t.prepare + t.forward + t.sample + t.commit)

    backend = Recording()
    models = ["small", "large"]
    channel = InProcChannel("small", "0", InMemoryDirectory(), InProcHub())
    replica = Replica(
        models, 0, engine, build_policy("never", {}, models), channel,
        pick_endpoint=lambda model, rid: model, metrics=Metrics(backend),
    )  # fmt: skip
    rows = len(result.request_ids)
    replica._record_step(result, [0] * rows, set())  # what report() gives the tuner
    replica.record(result, Routed([0] * rows, route_s=0.001), Decided({}, {}, set(), []))

    (tally,) = replica.stats.snapshot().steps.values()
    steps = [v for name, v in backend.observed if name == m.STEP_SECONDS.name]
    assert tally.count == 1 and tally.total == pytest.approx(t.total)
    assert steps == [pytest.approx(t.total)]
    assert t.total < QUEUING_S  # the queuing is not in what either reads
