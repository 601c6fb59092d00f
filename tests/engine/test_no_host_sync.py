"""Between ``launch`` and ``collect`` nothing reads the device and nothing copies host values
synchronously, for every kind of row.

On CPU every tensor lives on the host, so the guard (tests/engine/host_sync_guard.py) is
defined on what the code asks for while ``Engine.launch`` runs (the runner on its CUDA
path, device events stood in for): no value read (``item``, ``int``, ``bool``, ``tolist``,
``cpu``, ``numpy``), no output sized by the data (``nonzero``, boolean masks, ``bincount``,
``repeat_interleave`` without ``output_size``), no synchronous host-to-device copy (values
reach the device through ``device_step.to_device`` / ``host_to_device`` only: pinned and
non-blocking on CUDA), no explicit wait. The self-tests plant each offence in the sampler
and check the guard reports it.

The same steps also check the timings of that path: ``forward`` once (the device time
between the events), the host's queuing apart in ``launch``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.engine.conftest import make_engine
from tests.engine.host_sync_guard import HostSyncGuard, no_host_sync
from tests.openai.qwen3_tiny import qwen3_tokenizer, save_qwen3
from tokenrouter_ray.engine import logits_processors, sampler
from tokenrouter_ray.engine.device_step import EventWatcher, host_buffer, to_device
from tokenrouter_ray.engine.engine import Engine
from tokenrouter_ray.engine.outputs import StepTimings
from tokenrouter_ray.engine.request import GrammarSpec, SamplingParams

KINDS = {
    "greedy": SamplingParams(max_tokens=4),
    "temperature": SamplingParams(temperature=0.8, max_tokens=4),
    "top_k": SamplingParams(temperature=1.0, top_k=5, max_tokens=4),
    "top_p": SamplingParams(temperature=0.7, top_p=0.9, max_tokens=4, seed=7),
    "top_k_top_p": SamplingParams(temperature=1.2, top_k=20, top_p=0.8, max_tokens=4),
    "min_p": SamplingParams(temperature=1.0, min_p=0.1, max_tokens=4),
    "seeded": SamplingParams(temperature=1.0, max_tokens=4, seed=1234),
    "presence": SamplingParams(presence_penalty=0.5, max_tokens=4),
    "frequency": SamplingParams(temperature=0.9, frequency_penalty=0.7, max_tokens=4),
    "repetition": SamplingParams(repetition_penalty=1.3, max_tokens=4),
    "logit_bias": SamplingParams(logit_bias=((3, 5.0), (11, -100.0)), max_tokens=4),
    "min_tokens": SamplingParams(min_tokens=3, stop_token_ids=(4,), max_tokens=4),
    "grammar": SamplingParams(max_tokens=4, grammar=GrammarSpec("regex", "(yes|no) [0-9]{1,3}")),
    "logprobs": SamplingParams(temperature=0.5, top_p=0.95, logprobs=3, max_tokens=4),
    "everything": SamplingParams(
        temperature=0.7,
        top_p=0.9,
        top_k=20,
        min_p=0.05,
        seed=99,
        presence_penalty=0.3,
        frequency_penalty=0.2,
        repetition_penalty=1.1,
        logit_bias=((5, 2.0),),
        min_tokens=2,
        logprobs=2,
        max_tokens=4,
        grammar=GrammarSpec("regex", "(yes|no) [0-9]{1,3}"),
    ),
}


class StandInEvent:
    """A device event on the host clock: recorded, always done."""

    def __init__(self) -> None:
        self.at = 0.0

    def record(self) -> None:
        self.at = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        if HostSyncGuard.active is not None:  # the host waiting for the "device"
            HostSyncGuard.active.note("a device event's synchronize")

    def elapsed_time(self, end: StandInEvent) -> float:
        return (end.at - self.at) * 1e3  # ms, as torch.cuda.Event's


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_qwen3(Path(tmp_path_factory.mktemp("qwen3")), 3)


def overlapped_engine(model_dir: str, static: bool = False) -> Engine:
    """An engine whose runner takes its CUDA launch/collect path with stand-in events."""
    engine = make_engine(model_dir, num_blocks=128, static_batches=static)
    runner = engine.runner
    runner.overlap = True
    runner._new_event = StandInEvent  # type: ignore[method-assign]
    runner._watcher = EventWatcher()
    return engine


def prompt() -> list[int]:
    return list(qwen3_tokenizer().encode("Answer:", add_special_tokens=False))


def guarded_steps(engine: Engine, monkeypatch: pytest.MonkeyPatch, steps: int) -> list[str]:
    found: list[str] = []
    for _ in range(steps):
        with no_host_sync(monkeypatch) as guard:
            pending = engine.launch()
            engine.draft()  # what the step loop does before collect: the next step's draft
        found += guard.found
        if pending is None:
            break
        engine.commit(engine.collect(pending))
    return found


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_launch_reads_nothing_back(model_dir: str, monkeypatch, kind: str, static: bool) -> None:
    engine = overlapped_engine(model_dir, static)
    engine.add_request(kind, prompt(), KINDS[kind])
    found = guarded_steps(engine, monkeypatch, 3)  # a prefill, then decodes
    assert not found, "\n".join(found)
    assert (engine.runner.static_steps > 0) == static  # the decodes took the asked path


def test_a_mixed_batch_reads_nothing_back(model_dir: str, monkeypatch) -> None:
    engine = overlapped_engine(model_dir)
    for kind, params in KINDS.items():
        engine.add_request(kind, prompt(), params)
    found = guarded_steps(engine, monkeypatch, 3)
    assert not found, "\n".join(found)
    assert engine.runner.grammars is not None  # the grammar row was masked in those steps


def _staged_buffer(logits: torch.Tensor) -> torch.Tensor:
    return to_device([0, 0], torch.long, logits.device)  # a device tensor


# Offences a launch must not commit: (name, the planted code, what the guard reports).
OFFENCES: dict[str, tuple[Callable[[torch.Tensor], object], str]] = {
    "int(tensor)": (lambda x: int(x.argmax(-1)[0]), "_local_scalar_dense"),
    "item": (lambda x: x.max().item(), "item"),
    "bool(tensor.any())": (lambda x: bool((x > 0).any()), "is_nonzero"),
    "tolist": (lambda x: x.argmax(-1).tolist(), "Tensor.tolist"),
    "cpu": (lambda x: x.cpu(), "Tensor.cpu"),
    "numpy": (lambda x: x.detach().numpy(), "Tensor.numpy"),
    "nonzero": (lambda x: (x[0] > 0).nonzero(), "nonzero"),
    "boolean mask": (lambda x: x[x > 0], "boolean mask"),
    "bincount": (lambda x: torch.bincount(x.argmax(-1)), "bincount"),
    "tensor(device=)": (
        lambda x: torch.tensor([1, 2], device=x.device),
        "tensor(..., device=...) outside the staging helper",
    ),
    "sync .to(device)": (
        lambda x: torch.tensor([1, 2]).to(x.device),
        "of a host tensor to a device without non_blocking=True",
    ),
    "sync copy_": (
        lambda x: _staged_buffer(x).copy_(torch.tensor([1, 2])),
        "copy_ from a host tensor without non_blocking=True",
    ),
    "synchronize": (lambda x: torch.cuda.synchronize(), "torch.cuda.synchronize"),
    "event synchronize": (
        lambda x: torch.cuda.Event.synchronize(None),
        "torch.cuda.Event.synchronize",
    ),
    "stream synchronize": (
        lambda x: torch.cuda.Stream.synchronize(None),
        "torch.cuda.Stream.synchronize",
    ),
    'to("cpu")': (lambda x: x.to("cpu"), "Tensor.to a host device"),
    "to(device=cpu)": (
        lambda x: x.argmax(-1).to(device="cpu"),
        "Tensor.to a host device",
    ),
    "copy_ into host memory": (
        lambda x: torch.empty(2, dtype=torch.long).copy_(x.argmax(-1)[:2]),
        "copy_ of a device tensor into host memory",
    ),
    "readback without non_blocking": (
        lambda x: host_buffer((2,), torch.long, x.device).copy_(x.argmax(-1)[:2]),
        "copy_ of a device tensor into host memory",
    ),
    "host operand": (
        lambda x: x.index_select(0, torch.zeros(1, dtype=torch.long)),
        "a host tensor beside a device tensor",
    ),
    "sync .to(device) of a factory's tensor": (
        lambda x: torch.zeros(2, dtype=torch.long).to(x.device),
        "of a host tensor to a device without non_blocking=True",
    ),
}
ALLOWED: dict[str, Callable[[torch.Tensor], object]] = {  # the same needs, done right
    "staged": lambda x: to_device([1, 2], torch.long, x.device),
    "non-blocking .to": lambda x: torch.tensor([1, 2]).to(x.device, non_blocking=True),
    "non-blocking copy_": lambda x: _staged_buffer(x).copy_(
        torch.tensor([1, 2]), non_blocking=True
    ),
    "device-side argmax": lambda x: x.argmax(-1),
    "device to device copy_": lambda x: _staged_buffer(x).copy_(x.argmax(-1)[:2]),
    "non-blocking readback": lambda x: host_buffer((2,), torch.long, x.device).copy_(
        x.argmax(-1)[:2], non_blocking=True
    ),
    "to a dtype": lambda x: x.to(torch.float64),
    "sized repeat_interleave": lambda x: torch.repeat_interleave(
        torch.arange(2, device=x.device), to_device([1, 2], torch.long, x.device), output_size=3
    ),
}


def _planted(monkeypatch: pytest.MonkeyPatch, code: Callable[[torch.Tensor], object]) -> None:
    """``code`` runs on the logits inside the sampler, in every launch."""
    filter_rows = sampler.filter_rows

    def planted(logits: torch.Tensor, params) -> torch.Tensor:
        code(logits)
        return filter_rows(logits, params)

    monkeypatch.setattr(sampler, "filter_rows", planted)


@pytest.mark.parametrize("offence", sorted(OFFENCES))
def test_the_guard_catches(model_dir: str, monkeypatch, offence: str) -> None:
    """The guard is not vacuous: each planted read, data-sized op, synchronous copy or wait
    in the launch window is reported, and nothing else is."""
    code, reported = OFFENCES[offence]
    _planted(monkeypatch, code)
    engine = overlapped_engine(model_dir)
    engine.add_request("k", prompt(), KINDS["top_k"])
    found = guarded_steps(engine, monkeypatch, 1)
    assert found and all(reported in f for f in found), "\n".join(found)


@pytest.mark.parametrize("way", sorted(ALLOWED))
def test_the_guard_lets_the_staged_ways_through(model_dir: str, monkeypatch, way: str) -> None:
    _planted(monkeypatch, ALLOWED[way])
    engine = overlapped_engine(model_dir)
    engine.add_request("k", prompt(), KINDS["top_k"])
    found = guarded_steps(engine, monkeypatch, 1)
    assert not found, "\n".join(found)


def test_the_guard_catches_an_unsized_repeat_interleave(model_dir: str, monkeypatch) -> None:
    def unsized(seqs, m, vocab, device):
        lengths = torch.tensor([len(s) for s in seqs])
        rows = torch.repeat_interleave(torch.arange(m), lengths)
        ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long)
        counts = torch.zeros(m * vocab, dtype=torch.float32)
        counts.index_add_(0, rows * vocab + ids, torch.ones_like(ids, dtype=torch.float32))
        return counts.view(m, vocab)

    monkeypatch.setattr(logits_processors, "_bincount", unsized)
    engine = overlapped_engine(model_dir)
    engine.add_request("p", prompt(), KINDS["presence"])
    found = guarded_steps(engine, monkeypatch, 1)
    assert any("repeat_interleave" in f for f in found)


def test_device_timings_count_the_forward_once(model_dir: str) -> None:
    """On the device path ``forward`` is the events' time (forward and sampler), the host's
    queuing is ``launch`` and stays out of ``total``; the read-back is ``sample``."""
    engine = overlapped_engine(model_dir)
    engine.add_request("s", prompt(), KINDS["top_p"])
    pending = engine.launch()
    queued = pending.timings
    assert queued.launch > 0 and queued.forward == 0.0 and queued.sample == 0.0
    result = engine.collect(pending)
    engine.commit(result)
    t = result.timings
    assert t.forward > 0 and t.launch > 0
    # the stand-in events bracket the host's queuing: the device time covers it
    assert t.forward >= t.launch * 0.99
    assert t.total == pytest.approx(t.schedule + t.prepare + t.forward + t.sample + t.commit)
    assert t.total < t.schedule + t.prepare + t.forward + t.sample + t.commit + t.launch


def test_host_timings_on_cpu_add_up() -> None:
    t = StepTimings(schedule=1, prepare=2, forward=3, sample=4, commit=5, launch=100)
    assert t.overhead == 12 and t.total == 15  # launch overlaps the forward: never added
