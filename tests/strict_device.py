"""A second device on a CPU: run code as if the model were on a GPU, so that CI catches what
only a GPU run would (tests/test_strict_device.py runs every command under it).

On a CPU the model's device is the host: ``t.to(model.device)`` returns ``t`` itself, and a
tensor made without ``device=`` meets the model's tensors without complaint. On a GPU the first
is a copy (made inside ``torch.inference_mode`` it is an inference tensor, which autograd refuses
to save) and the second fails with "Expected all tensors to be on the same device".
:class:`StrictDevice` gives the CPU those two behaviours:

- The model lives on :data:`DEVICE`, ``cpu:0``: a CPU device that compares unequal to ``cpu``.
  ``--device cpu`` resolves to it (:func:`strict_device`), so the model is moved there as it is
  to ``cuda``; the tensors on it (their storage) are tracked, and their ``.device`` says
  ``cpu:0``. Everything else is on the host, ``cpu``.
- A move between the host and the device (``.to(...)``, ``.cpu()``, ``torch.as_tensor(...,
  device=...)``) always makes a copy, as on a GPU.
- A call that mixes tensors of both (a 0-dim host tensor excepted, as CUDA allows), converts a
  device tensor to numpy, or indexes one with a host tensor, raises :class:`DeviceMismatch`; so
  does a random draw on the device (:data:`_RANDOM`): a GPU draws other numbers for the same seed,
  and headprobe's results are the same on every device.
  Host index tensors are refused though CUDA copies them over on each call: an index meant for
  the model's tensors is made on their device.

Where a tensor lives follows the data: a factory call is on the host unless given
``device=``, an op with a device tensor among its inputs is on the device, a move goes where it
is told, gradients are where their inputs are (``.grad``, ``torch.autograd.grad``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

DEVICE = torch.device("cpu", 0)
"""The model's device under :class:`StrictDevice`."""


FLOORS = ("probe", "analyses", "headprobe")
"""The package's folders: where :func:`strict_device`'s survey says a mismatch was made."""


class DeviceMismatch(RuntimeError):
    """What a GPU run would raise: tensors on two devices in one call, or a device tensor to numpy."""


def _tensors(obj: Any, out: list[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            _tensors(o, out)
    elif isinstance(obj, dict):
        for o in obj.values():
            _tensors(o, out)
    return out


def _is_target(spec: Any) -> bool | None:
    """Whether a ``device`` argument names :data:`DEVICE` (True), the host (False), or is no device (None)."""
    if isinstance(spec, (str, torch.device)):
        try:
            d = torch.device(spec)
        except RuntimeError:
            return None
        return d == DEVICE
    if isinstance(spec, int) and not isinstance(spec, bool):
        return None  # a dtype-less positional int is not a device in this project
    return None


_TO = torch.Tensor.to
_CPU = torch.Tensor.cpu
_COPY = torch.Tensor.copy_
_SETITEM = torch.Tensor.__setitem__
_GETITEM = torch.Tensor.__getitem__
_NUMPY = {torch.Tensor.numpy, torch.Tensor.__array__}
_FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray}
_METADATA = {torch._has_compatible_shallow_copy_type, torch.Tensor.is_set_to}
"""Calls that compare tensors' metadata, not their values: any devices."""
_RANDOM = {
    torch.rand,
    torch.randn,
    torch.randint,
    torch.randperm,
    torch.normal,
    torch.rand_like,
    torch.randn_like,
    torch.randint_like,
    torch.multinomial,
    torch.bernoulli,
    torch.poisson,
    torch.Tensor.multinomial,
    torch.Tensor.bernoulli,
    torch.Tensor.bernoulli_,
    torch.Tensor.uniform_,
    torch.Tensor.normal_,
    torch.Tensor.random_,
    torch.Tensor.exponential_,
    torch.Tensor.cauchy_,
    torch.Tensor.log_normal_,
    torch.Tensor.geometric_,
}
"""Calls that draw random numbers: on a GPU they come from the CUDA generator, other numbers than
the CPU's for the same seed."""


class StrictDevice(TorchFunctionMode):
    """A :class:`~torch.overrides.TorchFunctionMode` that keeps the model's tensors on :data:`DEVICE`
    apart from the host's (see the module docstring)."""

    def __init__(self, survey: bool = False) -> None:
        super().__init__()
        self.survey = survey
        self.found: dict[str, int] = {}
        self.moves = 0
        """Tensors put on the device so far (moved there or made there)."""
        self._on_device: dict[StorageWeakRef, StorageWeakRef] = {}
        self._added = 0

    # ---- where a tensor lives ------------------------------------------------------------------

    def on_device(self, t: torch.Tensor) -> bool:
        try:
            ref = StorageWeakRef(t.untyped_storage())
        except (RuntimeError, NotImplementedError):  # no storage (sparse, nested): the host
            return False
        kept = self._on_device.get(ref)
        return kept is not None and not kept.expired()

    def put(self, t: torch.Tensor) -> None:
        """Mark ``t``'s storage as on the device (views and ``.data`` share it)."""
        ref = StorageWeakRef(t.untyped_storage())
        self._on_device[ref] = ref
        self._added += 1
        if self._added % 20000 == 0:  # forget freed storages
            self._on_device = {k: k for k in self._on_device if not k.expired()}

    def place(self, out: Any, inputs: list[torch.Tensor], device: bool) -> Any:
        """``out`` (a call's result) on the device or the host; a result that is one of ``inputs``'
        storages on the other side is copied first, as a move between devices is."""
        if isinstance(out, torch.Tensor):
            if self.on_device(out) != device and any(_same_storage(out, t) for t in inputs):
                out = out.clone()
            if device and not self.on_device(out):
                self.moves += 1
                self.put(out)
            return out
        if isinstance(out, (list, tuple)) and not hasattr(out, "_fields"):
            return type(out)(self.place(o, inputs, device) for o in out)
        return out

    # ---- the calls -----------------------------------------------------------------------------

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "__get__":
            return self._get(func, args, kwargs)
        if name == "__set__":
            return func(*args, **kwargs)
        if func is _TO or func is _CPU:
            return self._move(func, args, kwargs)
        if func in _NUMPY and self.on_device(args[0]):
            self._fail(
                f"can't convert {DEVICE} device type tensor to numpy: use Tensor.cpu() first "
                f"(on a GPU: can't convert cuda:0 device type tensor to numpy)"
            )
        if func is torch.autograd.grad:
            return self._grad(func, args, kwargs)
        if func in _METADATA:
            return func(*args, **kwargs)
        inputs = _tensors(args, _tensors(kwargs, []))
        target = _is_target(kwargs.get("device"))
        if func in _RANDOM and (target or any(self.on_device(t) for t in inputs)):
            self._fail(
                f"{_name(func)}: random numbers drawn on {DEVICE} (on a GPU the CUDA generator draws other "
                f"numbers than the CPU's for the same seed): draw on the host with a seeded torch.Generator()"
            )
        if target is not None:
            return self.place(func(*args, **_host(kwargs)), inputs, target)
        if func in _device_constructors() and not (func in _FROM_DATA and inputs):
            return func(*args, **kwargs)  # made on the host
        dev = [t for t in inputs if self.on_device(t)]
        if dev:
            self._check_mixing(func, args, inputs)
        out = func(*args, **kwargs)
        if dev and func is not _COPY:
            host = [t for t in inputs if not self.on_device(t)]
            self._put_all(out, host)
        return out

    def _get(self, func: Any, args: tuple, kwargs: dict) -> Any:
        prop = func.__self__.__name__
        out = func(*args, **kwargs)
        if prop == "device" and self.on_device(args[0]):
            return DEVICE
        if prop == "grad" and isinstance(out, torch.Tensor) and self.on_device(args[0]):
            self.put(out)  # a gradient is where its tensor is
        return out

    def _move(self, func: Any, args: tuple, kwargs: dict) -> Any:
        src = args[0]
        if func is _CPU:
            target: bool | None = False
        else:
            target = None
            for a in (*args[1:], kwargs.get("device")):
                if isinstance(a, torch.Tensor):
                    target = self.on_device(a)
                elif _is_target(a) is not None:
                    target = _is_target(a)
        out = func(*_host(args), **_host(kwargs))
        return self.place(out, [src], self.on_device(src) if target is None else target)

    def _grad(self, func: Any, args: tuple, kwargs: dict) -> Any:
        inputs = kwargs.get("inputs", args[1] if len(args) > 1 else None)
        inputs = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
        grads = func(*args, **kwargs)
        for g, x in zip(grads, inputs, strict=True):
            if g is not None and self.on_device(x):
                self.put(g)
        return grads

    def _check_mixing(self, func: Any, args: tuple, inputs: list[torch.Tensor]) -> None:
        if func is _COPY:
            return  # copies between devices are what copy_ is for
        if func is _GETITEM or func is _SETITEM:
            index = _tensors(args[1], [])
            host_index = [t for t in index if not self.on_device(t) and t.dim() > 0]
            if host_index and self.on_device(args[0]):
                return self._fail(
                    f"a tensor on {DEVICE} indexed by a tensor on the host {_shapes(host_index)}: "
                    f"make the index on the tensor's device (device=x.device)"
                )
            if func is _SETITEM and not index:
                return  # x[a:b] = y copies y over
            inputs = [args[0], *_tensors(args[2:], [])] if func is _SETITEM else [args[0]]
        host = [t for t in inputs if not self.on_device(t) and t.dim() > 0]
        if host and any(self.on_device(t) for t in inputs):
            return self._fail(
                f"{_name(func)}: tensors on {DEVICE} and on the host {_shapes(host)} in one call "
                f"(on a GPU: Expected all tensors to be on the same device)"
            )

    def _fail(self, message: str) -> None:
        if not self.survey:
            raise DeviceMismatch(message)
        import traceback

        root = str(Path(__file__).resolve().parents[1]) + os.sep
        where = [
            f"{f.filename.removeprefix(root)}:{f.lineno}"
            for f in traceback.extract_stack()
            if f.filename.startswith(root) and f.filename.removeprefix(root).split(os.sep)[0] in FLOORS
        ]
        key = f"{where[-1] if where else '?'} {message[:90]}"
        self.found[key] = self.found.get(key, 0) + 1

    def _put_all(self, out: Any, host: list[torch.Tensor]) -> None:
        for t in _tensors(out, []):
            if not any(_same_storage(t, h) for h in host):
                self.put(t)


def _host(obj: Any) -> Any:
    """``obj`` (a call's arguments) with :data:`DEVICE` replaced by the host it really is, so that
    a move to where a tensor already is returns the tensor, as it does on a GPU."""
    if isinstance(obj, tuple):
        return tuple(_host(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _host(v) for k, v in obj.items()}
    if isinstance(obj, (str, torch.device)) and _is_target(obj):
        return torch.device("cpu")
    return obj


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and a.untyped_storage().nbytes() > 0
    except (RuntimeError, NotImplementedError):
        return False


def _shapes(ts: list[torch.Tensor]) -> str:
    return ", ".join(f"{list(t.shape)}" for t in ts[:3])


def _name(func: Any) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))


@contextlib.contextmanager
def strict_device(survey: bool = False) -> Iterator[StrictDevice]:
    """Run the body under :class:`StrictDevice`, with ``--device cpu`` (and ``auto`` without a GPU)
    resolving to :data:`DEVICE`. ``survey``: a mismatch is counted in ``mode.found`` (by the line
    of headprobe's code that made the call) and the call goes on, to list every place at once."""
    from headprobe.probe.backends import loading

    resolve = loading.device_auto

    def device_auto(device: str = "auto") -> str:
        d = resolve(device)
        return str(DEVICE) if d == "cpu" else d

    mode = StrictDevice(survey)
    loading.device_auto = device_auto
    try:
        with mode:
            yield mode
    finally:
        loading.device_auto = resolve
