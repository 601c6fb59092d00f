"""Between ``launch`` and ``collect`` nothing reads the device and nothing copies host values
synchronously, for every kind of row (issue 39).

On CPU every tensor lives on the host, so the guard is defined on what the code asks for:
while ``Engine.launch`` runs (the runner on its CUDA path, device events stood in for),

- no op reads a tensor's value into Python: ``aten.item`` / ``aten.is_nonzero`` /
  ``aten._local_scalar_dense`` (``item``, ``bool``, ``int``, ``float``), ``nonzero`` /
  ``masked_select`` (an output size only the data knows), ``repeat_interleave`` without
  ``output_size``, and ``Tensor.tolist``;
- no tensor is built from Python values straight onto a device (``torch.tensor(...,
  device=...)``, ``torch.as_tensor(..., device=...)``): those go through the one staging
  helper (``device_step.to_device``: pinned and non-blocking on CUDA), which builds on the
  host.

The same steps also check the timings of that path: ``forward`` once (the device time
between the events), the host's queuing apart in ``launch``.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.engine.conftest import make_engine
from tests.openai.qwen3_tiny import qwen3_tokenizer, save_qwen3
from tokenrouter_ray.engine import logits_processors, sampler
from tokenrouter_ray.engine.device_step import EventWatcher
from tokenrouter_ray.engine.engine import Engine
from tokenrouter_ray.engine.outputs import StepTimings
from tokenrouter_ray.engine.request import GrammarSpec, SamplingParams

aten = torch.ops.aten
READS = {  # under inference mode the composites arrive undecomposed: item, is_nonzero
    aten._local_scalar_dense.default,
    aten.item.default,
    aten.is_nonzero.default,
    aten.equal.default,
    aten.nonzero.default,
    aten.masked_select.default,
}

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
}


class HostReads(TorchDispatchMode):
    """Records every op that would read a device tensor's value on the host."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def note(self, what: str) -> None:
        where = "".join(traceback.format_stack(limit=6)[:-2])
        self.found.append(f"{what}\n{where}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in READS:
            self.note(str(func))
        if (
            func.overloadpacket is aten.repeat_interleave
            and _output_size(func, args, kwargs) is None
        ):
            self.note("repeat_interleave without output_size")
        return func(*args, **kwargs)


def _output_size(func, args: tuple, kwargs: dict) -> object:
    """``output_size`` of a ``repeat_interleave`` call, by name or position."""
    if func.overloadpacket is not aten.repeat_interleave:
        return 0
    if "output_size" in kwargs:
        return kwargs["output_size"]
    names = [a.name for a in func._schema.arguments]
    at = names.index("output_size")
    return args[at] if len(args) > at else None


@contextmanager
def no_host_sync(monkeypatch: pytest.MonkeyPatch) -> Iterator[HostReads]:
    mode = HostReads()
    tensor, as_tensor, tolist = torch.tensor, torch.as_tensor, torch.Tensor.tolist

    def direct(make):
        def call(*args, **kwargs):
            if kwargs.get("device") is not None:
                mode.note(f"{make.__name__}(..., device=...) outside the staging helper")
            return make(*args, **kwargs)

        return call

    def read(self, *args, **kwargs):
        mode.note("Tensor.tolist")
        return tolist(self, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(torch, "tensor", direct(tensor))
        m.setattr(torch, "as_tensor", direct(as_tensor))
        m.setattr(torch.Tensor, "tolist", read)
        with mode:
            yield mode


class StandInEvent:
    """A device event on the host clock: recorded, always done."""

    def __init__(self) -> None:
        self.at = 0.0

    def record(self) -> None:
        self.at = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

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


def test_a_mixed_batch_reads_nothing_back(model_dir: str, monkeypatch) -> None:
    engine = overlapped_engine(model_dir)
    for kind, params in KINDS.items():
        engine.add_request(kind, prompt(), params)
    found = guarded_steps(engine, monkeypatch, 3)
    assert not found, "\n".join(found)
    assert engine.runner.grammars is not None  # the grammar row was masked in those steps


def test_the_guard_catches_a_device_read(model_dir: str, monkeypatch) -> None:
    """The guard is not vacuous: the former top-k branch's ``unlimited.any()`` and a
    ``torch.tensor(..., device=...)`` are caught."""
    filter_rows = sampler.filter_rows

    def reads(logits: torch.Tensor, params) -> torch.Tensor:
        unlimited = torch.tensor([p.top_k == 0 for p in params], device=logits.device)
        if not unlimited.any():  # a host read of a device value
            pass
        return filter_rows(logits, params)

    monkeypatch.setattr(sampler, "filter_rows", reads)
    engine = overlapped_engine(model_dir)
    engine.add_request("k", prompt(), KINDS["top_k"])
    found = guarded_steps(engine, monkeypatch, 1)
    assert any("is_nonzero" in f for f in found)
    assert any("device=..." in f for f in found)


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
