"""The working-memory budget of batched work: how many bytes a command may fill beyond the weights
and the one rule that turns a per-item estimate into a batch size, or a refusal.

The budget is, in this order: the one stated for the process (:func:`set_budget`, from the shared
``--memory-budget`` setting), the ``HEADPROBE_MEMORY_BUDGET`` environment variable, else
:data:`HEADROOM` of the device's free memory (CUDA: ``torch.cuda.mem_get_info`` once the caching
allocator's unused blocks are released; CPU: the kernel's ``MemAvailable`` in ``/proc/meminfo``, or
``os.sysconf`` where there is none). A stated budget above that free memory is refused
(:func:`within_free`). Sizes are bytes,
read and printed by :mod:`headprobe.probe.core.sizes` (``4GiB``, ``500MB``, a bare ``1000``).
Torch is imported only to read a GPU's free memory.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.core.sizes import format_bytes, parse_bytes

BUDGET_ENV = "HEADPROBE_MEMORY_BUDGET"
"""The environment variable that states the budget when no setting does (a size, e.g. ``4GiB``)."""

HEADROOM = 0.8
"""The share of the device's free memory a batch may fill when no budget is stated (allocator
fragmentation, the caching allocator's blocks and the estimate's error take the rest)."""

_stated: int | None = None


def set_budget(value: str | int | None) -> None:
    """State the process's budget (bytes, or text :func:`parse_bytes` reads); None: none stated.

    Raises:
        HeadprobeError: as :func:`parse_bytes`.
    """
    global _stated
    _stated = None if value is None else parse_bytes(value, "memory budget")


@contextlib.contextmanager
def budget_restored() -> Iterator[None]:
    """Within the block, :func:`set_budget` may state a budget; on leaving (however the block ends)
    the budget stated before is back: a command's Python function (``headprobe.scan(...,
    memory_budget="2GiB")``) states it for its own run only, not for what the notebook runs next."""
    global _stated
    before = _stated
    try:
        yield
    finally:
        _stated = before


def free_bytes(device) -> int:
    """Free memory of ``device`` (a ``torch.device`` or its name), bytes. CUDA: the driver's free
    memory (``torch.cuda.mem_get_info``) after ``torch.cuda.empty_cache()`` (the blocks PyTorch's
    caching allocator holds unused, freed by an earlier step, count as free, and unfragmented); on
    anything else the CPU's available memory (``MemAvailable`` of ``/proc/meminfo``, else
    ``SC_AVPHYS_PAGES * SC_PAGE_SIZE``)."""
    name = str(device)
    if name.startswith("cuda"):
        import torch

        dev = torch.device(name)
        with torch.cuda.device(dev):
            torch.cuda.empty_cache()
        return int(torch.cuda.mem_get_info(dev)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the kernel writes kB (KiB)
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def stated() -> tuple[int, str] | None:
    """``(bytes, where from)`` of the budget stated by :func:`set_budget` or :data:`BUDGET_ENV`; None: none.

    Raises:
        HeadprobeError: a bad :data:`BUDGET_ENV`.
    """
    if _stated is not None:
        return _stated, f"stated budget {format_bytes(_stated)}"
    if os.environ.get(BUDGET_ENV):
        value = parse_bytes(os.environ[BUDGET_ENV], f"${BUDGET_ENV}")
        return value, f"stated budget {format_bytes(value)} (${BUDGET_ENV})"
    return None


def within_free(value: float, what: str, device, flag: str = "--memory-budget", default: str | None = None) -> None:
    """Refuse a stated budget of ``value`` bytes above the :func:`free_bytes` of ``device``: a plan
    filled to it would fail with out of memory mid-run. Every command's planner and ``circuit``'s
    (``flag``: the one that states it there, ``--memory-gb``; ``default``: what leaving it out
    gives, where not :data:`HEADROOM` of the free memory).

    Raises:
        HeadprobeError: one line naming ``what`` (``"the stated budget 40 GiB"``), the free memory
            and what to state instead.
    """
    free = free_bytes(device)
    if value > free:
        default = default or f"{HEADROOM:.0%} of the free memory, {format_bytes(free * HEADROOM)}"
        raise HeadprobeError(
            f"{what} is more than the {format_bytes(free)} free on {device}: state at most that with "
            f"{flag}, or leave it out ({default})"
        )


def budget(device) -> tuple[int, str]:
    """``(bytes, where from)``: the stated budget (:func:`set_budget`, then :data:`BUDGET_ENV`), else
    :data:`HEADROOM` of :func:`free_bytes`; the text says which (``"stated budget 4 GiB"``,
    ``"80% of 12.5 GiB free on cuda:0"``).

    Raises:
        HeadprobeError: a bad :data:`BUDGET_ENV`, or a stated budget above the free memory (:func:`within_free`).
    """
    given = stated()
    if given is not None:
        within_free(given[0], f"the {given[1]}", device)
        return given
    free = free_bytes(device)
    return int(free * HEADROOM), f"{HEADROOM:.0%} of {format_bytes(free)} free on {device}"


def items_that_fit(
    per_item: int, fixed: int, budget_bytes: int, need: int, what: str, where: str, skip: str | None = None
) -> int:
    """How many items of ``per_item`` bytes fit beside ``fixed`` bytes in ``budget_bytes``:
    ``(budget_bytes - fixed) // per_item``, at least ``need`` (the fewest the work can run with).
    ``skip``: the flag that leaves this step out (``--no-metrics``), offered in the refusal.

    Raises:
        HeadprobeError: fewer than ``need`` fit (one line naming ``what``, the sizes, ``where``
            the budget came from and ``skip``): refused before anything is allocated.
    """
    n = max(0, (budget_bytes - fixed) // max(1, per_item))
    if n < need:
        last = f", or skip this step with {skip}" if skip else ""
        raise HeadprobeError(
            f"{what} needs about {format_bytes(fixed + need * per_item)} of working memory ({need} x "
            f"{format_bytes(per_item)} + {format_bytes(fixed)}), more than the {where}: use fewer or shorter "
            f"sequences{',' if skip else ', or'} state a larger --memory-budget{last}"
        )
    return int(n)


def weights_fit(need: int, device, what: str, skip: str | None = None, detail: str = "") -> tuple[int, str]:
    """:func:`budget` of ``device`` where a step of ``need`` bytes fits that no batch size can shrink
    (copies of weights: the copying score's, the composition scores' factors); ``detail`` says what
    the bytes are, ``skip`` the flag that leaves the step out.

    Raises:
        HeadprobeError: ``need`` is above the budget (one line naming ``what``; no advice to use
            fewer or shorter sequences, which would not help), or a bad budget.
    """
    total, source = budget(device)
    if need > total:
        raise HeadprobeError(
            f"{what} needs about {format_bytes(need)} of working memory{f' ({detail})' if detail else ''}, more "
            f"than the {source}: state a larger --memory-budget{f', or skip this step with {skip}' if skip else ''}"
        )
    return total, source


@dataclass(frozen=True)
class BatchPlan:
    """A batch size chosen from the budget (:func:`plan`).

    Attributes:
        items: the most items per pass (sequences): ``min(cap, (budget - fixed) // per_item)``.
        per_item: the estimate of one item's working memory, bytes.
        fixed: bytes held whatever the batch (stored clean activations), bytes.
        budget: the budget, bytes. source: where it came from (:func:`budget`'s text).
        what: the work it sizes.
    """

    items: int
    per_item: int
    fixed: int
    budget: int
    source: str
    what: str

    @property
    def total(self) -> int:
        """Bytes a full pass holds: ``fixed + items * per_item``."""
        return self.fixed + self.items * self.per_item

    def line(self) -> str:
        """The header line: ``batch: 96 sequences per pass for the ablation sweep (about 1.20 MiB each ...)``."""
        return (
            f"batch: {self.items} sequences per pass for {self.what} (about {format_bytes(self.per_item)} each"
            f" + {format_bytes(self.fixed)} kept; {self.source})"
        )


def plan(
    per_item: int, device, need: int, what: str, fixed: int = 0, cap: int | None = None, skip: str | None = None
) -> BatchPlan:
    """The :class:`BatchPlan` of work whose items take ``per_item`` bytes each beside ``fixed`` bytes,
    on ``device`` under :func:`budget`: as many as fit, at most ``cap``, at least ``need``
    (``skip``: the flag that leaves the step out, for the refusal).

    Raises:
        HeadprobeError: fewer than ``need`` items fit (:func:`items_that_fit`), or a bad budget.
    """
    total, source = budget(device)
    n = items_that_fit(per_item, fixed, total, need, what, source, skip)
    return BatchPlan(n if cap is None else min(n, cap), per_item, fixed, total, source, what)
