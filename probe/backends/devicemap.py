"""Models larger than one device: a native model split over GPUs, CPU memory and disk with
accelerate (``device_map``), as transformers' ``from_pretrained(device_map=...)`` and
TransformerLens' bridge do it.

The unit of placement is a top-level piece of :class:`~headprobe.probe.model.transformer.Transformer`:
``embed``, ``ln_embed`` (encoders), ``blocks.0`` ... ``blocks.{n-1}``, ``ln_final`` and ``unembed``.
The embedding, the final norm and the unembedding always sit on the first device of the
memory budget (the *main device*, :attr:`LoadedModel.device`, where inputs go and logits come
out; the embedding and unembedding are one tied tensor in most models), and the blocks fill the
devices in order. accelerate's own ``infer_auto_device_map`` cannot be used on the native model:
it fails on the tied embedding (``IndexError`` in ``get_module_size_with_ties``, accelerate 1.15).

``accelerate.dispatch_model`` then attaches its hooks: a block on another GPU runs there (its
input moved to it), a block mapped to ``cpu`` while the main device is a GPU is kept in CPU
memory and copied to the GPU for its forward, and a block mapped to ``disk`` is saved to an
offload folder (numpy memory maps) and read back for each forward. Code that reads weights
outside a forward (``W_O(layer)``, the unembedding in the exact sweep, resuming a block) goes
through :func:`aligned`, accelerate's ``align_module_device``, which materialises an offloaded
module's weights for the ``with`` body.

The transformer-lens backend is split by transformers instead, as it loads the Hugging Face model
(``from_pretrained(device_map=, max_memory=, offload_folder=)``, :func:`headprobe.probe.backends.loading.load_model`);
the same :func:`aligned` serves its weight reads.

The numbers are those of the unsplit model (tests/test_device_map.py: scan scores, captured
patterns and the exact sweep to 1e-6 on a split forced onto CPU and disk).
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from collections.abc import Iterator, Mapping, Sized
from typing import Any, cast

import torch

from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.core.registry import did_you_mean
from headprobe.probe.core.vocabulary import DEVICE_MAPS
from headprobe.probe.hooks.names import block_path

NO_SPLIT = ["Block"]
"""Module classes accelerate must keep whole on one device."""


def placement_units(model: torch.nn.Module) -> tuple[list[str], list[str]]:
    """``(pinned, blocks)``: the names of the native model's top-level pieces that stay on the
    main device (embedding, embedding norm, final norm, unembedding) and of its blocks, in order."""
    pinned = [n for n in ("embed", "ln_embed", "ln_final", "unembed") if getattr(model, n, None) is not None]
    return pinned, [block_path(i) for i in range(len(cast(Sized, model.blocks)))]  # an nn.ModuleList


def _sizes(model: torch.nn.Module) -> dict[str, int]:
    from accelerate.utils import compute_module_sizes

    return compute_module_sizes(model)  # bytes per module name; a tied tensor counted once (under embed)


def infer_device_map(
    model: torch.nn.Module, strategy: str = "auto", max_memory: Mapping[int | str, int | str] | None = None
) -> dict[str, int | str]:
    """A device map ``{piece name: device}`` for the native ``model`` (see the module docstring).

    Args:
        strategy: one of :data:`DEVICE_MAPS`.
        max_memory: bytes (or accelerate's size strings, ``"2GiB"``) each device may hold, keys
            GPU indices, ``"cpu"``, ``"mps"``, ``"disk"``; None: what every GPU and the CPU have
            free (accelerate's ``get_max_memory``). Disk is unlimited unless named. The budget
            counts weights only; activations need room besides.

    Raises:
        HeadprobeError: an unknown strategy or device, a size accelerate cannot read, the main
            device being ``disk``, or the embedding and unembedding not fitting on the main device.
    """
    from accelerate.utils import get_balanced_memory, get_max_memory

    if strategy not in DEVICE_MAPS:
        raise HeadprobeError(
            f"unknown device map {strategy!r}{did_you_mean(str(strategy), DEVICE_MAPS)}; choose one of {', '.join(DEVICE_MAPS)}"
        )
    try:
        budget = dict(get_max_memory(dict(max_memory) if max_memory is not None else None))
        if strategy != "sequential":  # accelerate balances over real devices: disk joins afterwards
            disk = budget.pop("disk", None)
            budget = dict(get_balanced_memory(model, budget, no_split_module_classes=NO_SPLIT))
            if disk is not None:
                budget["disk"] = disk
    except (ValueError, RuntimeError) as e:
        raise HeadprobeError(f"--max-memory: {' '.join(str(e).split())}") from None
    devices = list(budget)
    if not devices or devices[0] == "disk":
        raise HeadprobeError(
            "--max-memory names no device but disk: the embedding needs a GPU or the CPU (e.g. cpu=2GiB)"
        )
    if "disk" not in budget:
        budget["disk"] = float("inf")
        devices.append("disk")
    sizes = _sizes(model)
    pinned, blocks = placement_units(model)
    main = devices[0]
    need = sum(sizes.get(n, 0) for n in pinned)
    if need > budget[main]:
        raise HeadprobeError(
            f"the embedding, final norm and unembedding ({need / 2**20:.1f} MiB) do not fit in "
            f"--max-memory's {budget[main] / 2**20:.1f} MiB on {_name(main)}, the main device"
        )
    left = dict(budget)
    left[main] -= need
    device_map: dict[str, int | str] = {n: main for n in pinned}
    d = 0
    for name in blocks:
        while sizes[name] > left[devices[d]] and devices[d] != "disk":
            d += 1
        device_map[name] = devices[d]
        left[devices[d]] -= sizes[name]
    order = {n: i for i, n in enumerate(["embed", "ln_embed", *blocks, "ln_final", "unembed"])}
    return dict(sorted(device_map.items(), key=lambda kv: order[kv[0]]))


def _name(device: int | str) -> str:
    return f"cuda:{device}" if isinstance(device, int) else str(device)


def check_device_map(model: torch.nn.Module, device_map: Mapping[str, int | str]) -> dict[str, int | str]:
    """A device map given by hand, checked: it places every piece of :func:`placement_units`
    (and nothing else), the pinned pieces together on one device that is not ``disk``.

    Raises:
        HeadprobeError: a missing, unknown or misplaced piece (one line).
    """
    pinned, blocks = placement_units(model)
    want = set(pinned) | set(blocks)
    got = set(device_map)
    if got != want:
        extra, missing = sorted(got - want), sorted(want - got, key=lambda n: (len(n), n))
        raise HeadprobeError(
            f"device map must place exactly {', '.join(pinned)} and blocks.0 .. blocks.{len(blocks) - 1}"
            + (f"; missing {', '.join(missing)}" if missing else "")
            + (f"; unknown {', '.join(extra)}" if extra else "")
        )
    mains = {device_map[n] for n in pinned}
    if len(mains) > 1 or "disk" in mains:
        raise HeadprobeError(
            f"device map must put {', '.join(pinned)} together on one device that is not disk "
            f"(the embedding and unembedding are tied), got {', '.join(f'{n}={device_map[n]}' for n in pinned)}"
        )
    return dict(device_map)


def dispatch(
    model: torch.nn.Module,
    device_map: str | Mapping[str, int | str],
    max_memory: Mapping[int | str, int | str] | None = None,
    offload_dir: str | None = None,
) -> tuple[torch.nn.Module, torch.device, Any]:
    """Split the native ``model`` (on the CPU, in its final dtype) over devices with
    ``accelerate.dispatch_model``.

    Args:
        device_map: a strategy of :data:`DEVICE_MAPS` (:func:`infer_device_map`) or a map
            ``{piece: device}`` (:func:`check_device_map`).
        max_memory: the per-device budget of a strategy (refused with a map given by hand).
        offload_dir: where pieces mapped to ``disk`` are saved; None: a temporary directory,
            removed when the returned handle is garbage-collected.

    Returns:
        ``(model, main device, handle)``: the handle (a ``TemporaryDirectory`` or None) must live
        as long as the model.

    Raises:
        HeadprobeError: as :func:`infer_device_map` / :func:`check_device_map`.
    """
    from accelerate import dispatch_model

    if isinstance(device_map, str):
        device_map = infer_device_map(model, device_map, max_memory)
    else:
        if max_memory is not None:
            raise HeadprobeError(
                "max_memory applies to a placement strategy (auto, balanced, sequential), not to a device map given by hand"
            )
        device_map = check_device_map(model, device_map)
    main = device_map["embed"]
    handle = None
    if "disk" in device_map.values() and offload_dir is None:
        handle = tempfile.TemporaryDirectory(prefix="headprobe-offload-")
        offload_dir = handle.name
    main_device = torch.device(_name(main))
    with quiet_accelerate():
        model = dispatch_model(
            model, device_map, main_device=main, offload_dir=offload_dir
        )  # accelerate compares it with "cpu"
    return model, main_device, handle


@contextlib.contextmanager
def quiet_accelerate() -> Iterator[None]:
    """Silence accelerate's "Some parameters are on the meta device because they were offloaded"
    warning (what it says is the point of a device map) for the ``with`` body."""
    log = logging.getLogger("accelerate.big_modeling")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


@contextlib.contextmanager
def aligned(module: torch.nn.Module) -> Iterator[None]:
    """The weights of ``module`` and its submodules real and on their execution device for the
    ``with`` body, where accelerate offloaded them (``accelerate.utils.align_module_device`` on
    every submodule carrying an offloading hook: ``dispatch_model`` hooks the leaves); otherwise
    nothing happens. Tensors read inside stay valid after it (they keep their storage)."""
    from accelerate.utils import align_module_device, has_offloaded_params

    with contextlib.ExitStack() as stack:
        for m in module.modules():
            if has_offloaded_params(m):
                stack.enter_context(align_module_device(m))
        yield
