"""A guard that records every device read and synchronous host-to-device copy a block of
engine code asks for, on CPU: used by tests/engine/test_no_host_sync.py around
``Engine.launch``, the window between a step's launch and its collect.

On CPU every tensor lives on the host, so the guard judges what the code *asks for*, the
things that on CUDA would make the host wait for the kernels queued before them (the
forward):

- a value read into Python: ``aten.item`` / ``aten.is_nonzero`` / ``aten.equal`` /
  ``aten._local_scalar_dense`` (``item``, ``int``, ``bool``, ``float``), ``Tensor.tolist``,
  ``Tensor.cpu``, ``Tensor.numpy``;
- an output size only the data knows: ``nonzero``, ``masked_select``, ``bincount``,
  ``unique``, indexing by a boolean mask (read or write), ``repeat_interleave`` without
  ``output_size``;
- a synchronous host-to-device copy: ``torch.tensor(..., device=...)`` /
  ``torch.as_tensor(..., device=...)``, or a ``copy_`` / ``.to(device)`` from a *host*
  tensor without ``non_blocking=True``. Host tensors are the ones built in the window from
  Python values (``torch.tensor``, ``torch.as_tensor``, ``torch.from_numpy``), by a factory
  given no device (``torch.zeros(n)``, ``torch.arange(n)``, ...) or pinned, and whatever
  is computed from host tensors only; what the staging helpers return
  (``device_step.to_device`` / ``host_to_device``: pinned and non-blocking on CUDA) is the
  device's;
- a synchronous device-to-host copy: ``.to("cpu")`` / ``.to(device="cpu")`` of a device
  tensor (the host named as a string: on CPU a ``torch.device`` is cpu either way), or a
  ``copy_`` from a device tensor into host memory, without ``non_blocking=True`` (the
  readback into pinned memory is the one way back);
- a host tensor (not 0-dim) beside a device tensor in one op: an error on CUDA, where the
  CPU runs it;
- an explicit wait: ``torch.cuda.synchronize``, a CUDA event's or stream's
  ``synchronize``, or a stand-in event's.

Everything found is kept with a short stack, so a failing test says where.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from tokenrouter_ray.engine import device_step

aten = torch.ops.aten
READS = {  # under inference mode the composites arrive undecomposed: item, is_nonzero
    aten._local_scalar_dense.default,
    aten.item.default,
    aten.is_nonzero.default,
    aten.equal.default,
}
DATA_SIZED = {  # an output whose size only the data knows: the host must read it
    aten.nonzero.default,
    aten.masked_select.default,
    aten.bincount.default,
    aten._unique.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
}
MASK_INDEXED = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default}
COPIES = {aten.copy_.default, aten._to_copy.default}
MOVES = {aten.to.device, aten.to.dtype_layout, aten.to.other}
# the staging helper's frames: tensors built inside them are the device's
STAGING = {device_step.to_device.__code__, device_step.host_to_device.__code__}


FACTORIES = ("zeros", "ones", "empty", "full", "arange")  # host tensors when given no device


def _staging() -> bool:
    """Whether the caller runs inside the staging helper."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in STAGING:
            return True
        frame = frame.f_back
    return False


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _tensors(v)


class HostSyncGuard(TorchDispatchMode):
    """Records (in ``found``) every op that would read a device tensor's value on the host
    or copy a host tensor to the device synchronously (module docstring)."""

    active: HostSyncGuard | None = None  # the guard in force, for the patched callables

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []
        self.host = WeakIdKeyDictionary()  # host tensors (by identity: never ``==``)

    def note(self, what: str) -> None:
        where = "".join(traceback.format_stack(limit=8)[:-2])
        self.found.append(f"{what}\n{where}")

    def mark_host(self, t: object) -> None:
        if isinstance(t, torch.Tensor) and not _staging():
            self.host[t] = True

    def is_host(self, t: object) -> bool:
        return isinstance(t, torch.Tensor) and t in self.host

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in READS:
            self.note(f"{func}: a device value read on the host")
        elif func in DATA_SIZED:
            self.note(f"{func}: an output size only the device's data knows")
        elif func in MASK_INDEXED and any(
            t.dtype == torch.bool for t in _tensors(args[1] if len(args) > 1 else ())
        ):
            self.note(f"{func} by a boolean mask: an output size only the data knows")
        elif (
            func.overloadpacket is aten.repeat_interleave
            and _output_size(func, args, kwargs) is None
        ):
            self.note("repeat_interleave without output_size")
        elif func in COPIES or func in MOVES:
            self._check_copy(func, args, kwargs)
        inputs = list(_tensors(args)) + list(_tensors(list(kwargs.values())))
        host = [self.is_host(t) for t in inputs]
        mixed = any(h and t.dim() for h, t in zip(host, inputs, strict=True)) and not all(host)
        if mixed and func not in COPIES and func not in MOVES:
            self.note(f"{func}: a host tensor beside a device tensor (an error on CUDA)")
        out = func(*args, **kwargs)
        if func is aten.lift_fresh.default or func is aten._pin_memory.default:
            self.mark_host(out)  # torch.tensor(data) / pin_memory(): the host's
        elif inputs and all(host):
            for t in _tensors(out):  # computed from host tensors only: the host's
                self.host[t] = True
        return out

    def _check_copy(self, func, args: tuple, kwargs: dict) -> None:
        non_blocking = kwargs.get("non_blocking", False)
        if func is aten.copy_.default:
            dst, src = args[0], args[1]
            non_blocking = args[2] if len(args) > 2 else non_blocking
            if non_blocking or self.is_host(src) == self.is_host(dst):
                return
            if self.is_host(src):
                self.note("copy_ from a host tensor without non_blocking=True")
            else:
                self.note("copy_ of a device tensor into host memory without non_blocking=True")
            return
        names = [a.name for a in func._schema.arguments]
        given = dict(zip(names, args, strict=False)) | kwargs
        if "device" in given and self.is_host(args[0]) and not given.get("non_blocking"):
            self.note(f"{func} of a host tensor to a device without non_blocking=True")


def _to_host(args: tuple, kwargs: dict) -> bool:
    """Whether ``Tensor.to(*args, **kwargs)`` names the host: ``"cpu"`` as a string (on CPU
    a ``torch.device`` cannot tell the host from the device, ``x.device`` is cpu too)."""
    target = kwargs.get("device", args[0] if args else None)
    return isinstance(target, str) and torch.device(target).type == "cpu"


def _output_size(func, args: tuple, kwargs: dict) -> object:
    """``output_size`` of a ``repeat_interleave`` call, by name or position."""
    if "output_size" in kwargs:
        return kwargs["output_size"]
    names = [a.name for a in func._schema.arguments]
    at = names.index("output_size")
    return args[at] if len(args) > at else None


@contextmanager
def no_host_sync(monkeypatch: pytest.MonkeyPatch) -> Iterator[HostSyncGuard]:
    """The guard in force for the ``with`` block; ``found`` lists what it saw."""
    guard = HostSyncGuard()
    tensor, as_tensor, from_numpy = torch.tensor, torch.as_tensor, torch.from_numpy

    def built(make: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def call(*args: object, **kwargs: object) -> torch.Tensor:
            if kwargs.get("device") is not None and not _staging():
                guard.note(f"{make.__name__}(..., device=...) outside the staging helper")
            out = make(*args, **kwargs)
            guard.mark_host(out)  # also when no dispatch saw it (as_tensor of a tensor)
            return out

        return call

    def read(name: str) -> Callable[..., object]:
        original = getattr(torch.Tensor, name)

        def call(self: torch.Tensor, *args: object, **kwargs: object) -> object:
            guard.note(f"Tensor.{name}: a device value read on the host")
            return original(self, *args, **kwargs)

        return call

    def factory(make: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def call(*args: object, **kwargs: object) -> torch.Tensor:
            out = make(*args, **kwargs)
            if kwargs.get("device") is None:
                guard.mark_host(out)
            return out

        return call

    def staged(helper: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def call(*args: object, **kwargs: object) -> torch.Tensor:
            out = helper(*args, **kwargs)
            guard.host.pop(out, None)  # on CPU the host tensor itself stands for the copy
            return out

        return call

    def waits(*args: object, **kwargs: object) -> None:
        guard.note("torch.cuda.synchronize: the host waits for the device")

    def waits_on(what: str) -> Callable[..., None]:
        def call(*args: object, **kwargs: object) -> None:
            guard.note(f"{what}: the host waits for the device")

        return call

    to = torch.Tensor.to

    def moved(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        # on CPU ``.to("cpu")`` returns the tensor itself: no op reaches the dispatcher
        if _to_host(args, kwargs) and not guard.is_host(self) and not kwargs.get("non_blocking"):
            guard.note("Tensor.to a host device without non_blocking=True: a device read")
        return to(self, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(torch, "tensor", built(tensor))
        m.setattr(torch, "as_tensor", built(as_tensor))
        m.setattr(torch, "from_numpy", built(from_numpy))
        for name in FACTORIES:
            m.setattr(torch, name, factory(getattr(torch, name)))
        for name in ("tolist", "cpu", "numpy"):
            m.setattr(torch.Tensor, name, read(name))
        helpers = {device_step.to_device, device_step.host_to_device}
        for module in [
            sys.modules[n] for n in list(sys.modules) if n.startswith("tokenrouter_ray")
        ]:
            for name in ("to_device", "host_to_device"):  # wherever a module imported them
                if getattr(module, name, None) in helpers:
                    m.setattr(module, name, staged(getattr(module, name)))
        m.setattr(torch.cuda, "synchronize", waits)
        m.setattr(torch.cuda.Event, "synchronize", waits_on("torch.cuda.Event.synchronize"))
        m.setattr(torch.cuda.Stream, "synchronize", waits_on("torch.cuda.Stream.synchronize"))
        m.setattr(torch.Tensor, "to", moved)
        HostSyncGuard.active = guard
        try:
            with guard:
                yield guard
        finally:
            HostSyncGuard.active = None
