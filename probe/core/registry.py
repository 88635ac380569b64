"""One registry type for headprobe's extension points: names mapped to targets, imported lazily.

Modelled on lm-evaluation-harness' ``lm_eval/api/registry.py``: a target is the object itself or
a ``"module:attr"`` string that :meth:`Registry.get` imports on first use, so listing the names
imports nothing; an unknown name raises :class:`~headprobe.probe.core.errors.HeadprobeError` (one line)
naming the closest registered names (:func:`difflib.get_close_matches`). Torch-free: this module
imports only the standard library and :mod:`headprobe.probe.core.errors`, so a command can list or
check names before torch loads.

Example (the model families of the native backend, :mod:`headprobe.probe.model.families`)::

    FAMILIES = Registry("model type", hint="the native backend supports only these: use --backend transformer-lens")
    FAMILIES.register("llama", "headprobe.probe.model.families.llama:FAMILY")
    FAMILIES.names()        # ('llama',): nothing imported
    FAMILIES.get("llama")   # imports headprobe.probe.model.families.llama, returns its FAMILY
    FAMILIES.get("lama")    # HeadprobeError: unknown model type: 'lama' (did you mean 'llama'?); known: llama; the ...
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Generic, TypeVar

from headprobe.probe.core.errors import HeadprobeError

T = TypeVar("T")


def did_you_mean(
    name: str,
    choices: Iterable[str],
    n: int = 2,
    cutoff: float = 0.6,
    hints: Mapping[str, tuple[str, str]] | None = None,
) -> str:
    """``" (did you mean 'a' or 'b'?)"`` for the ``n`` choices closest to ``name`` by
    :func:`difflib.get_close_matches` (ratio at least ``cutoff``), or ``""`` where none is close.
    ``hints``: a word no spelling distance finds (lower case) -> ``(choice, why)``, e.g. ``"kvpress"``
    -> ``("duo", "DuoAttention's format, which kvpress reads")``: ``" (did you mean 'duo'? why)"``."""
    if hints and (hint := hints.get(str(name).lower())):
        return f" (did you mean {hint[0]!r}? {hint[1]})"
    close = difflib.get_close_matches(str(name), list(choices), n=n, cutoff=cutoff)
    return f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""


class Registry(Generic[T]):
    """Names (in registration order) mapped to targets of one kind.

    Args:
        kind: what a name names, for messages (``"model type"``).
        hint: appended to the unknown-name message (what to do instead), or ``""``.
    """

    def __init__(self, kind: str, hint: str = "") -> None:
        self.kind = kind
        self.hint = hint
        self._targets: dict[str, T | str] = {}
        self._groups: dict[str, str] = {}

    def register(self, name: str, target: T | str, *, replace: bool = False, group: str = "") -> None:
        """Register ``target`` under ``name``: the object itself, or ``"module:attr"`` (imported by
        :meth:`get` on first use). ``group`` files the name under a subset that :meth:`names` can
        list without importing anything (the head columns' ``"head type"`` and ``"metric"``).

        Raises:
            ValueError: ``name`` is taken (unless ``replace``), or a string target is not
                ``"module:attr"`` (a programming error, not the user's).
        """
        if name in self._targets and not replace:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        if isinstance(target, str) and (target.count(":") != 1 or not all(target.split(":"))):
            raise ValueError(f"a lazy {self.kind} target is 'module:attr', got {target!r}")
        self._targets[name] = target
        self._groups[name] = group

    def unregister(self, name: str) -> None:
        """Remove ``name`` (a target registered for a while, as tests do).

        Raises:
            KeyError: ``name`` is not registered.
        """
        del self._targets[name]
        del self._groups[name]

    def get(self, name: str | None) -> T:
        """The target registered under ``name``, importing a ``"module:attr"`` one (once).

        Raises:
            HeadprobeError: ``name`` is not registered (:meth:`unknown`).
            ImportError, AttributeError: a lazy target names a module or attribute that does not
                exist (a programming error, not the user's).
        """
        if name not in self._targets:
            raise self.unknown(name)
        target = self._targets[name]
        if isinstance(target, str):
            module, _, attr = target.partition(":")
            target = getattr(importlib.import_module(module), attr)
            self._targets[name] = target
        return target

    def loaded(self, name: str) -> T | None:
        """The target registered under ``name`` where it is an object already (registered as one, or
        imported by :meth:`get`), else None (a lazy target not yet imported, or no such name); imports nothing."""
        target = self._targets.get(name)
        return None if isinstance(target, str) else target

    def unknown(self, name: object) -> HeadprobeError:
        """The one-line error for a name that is not registered: the name, the closest
        registered ones, every registered one and the hint."""
        hint = f"; {self.hint}" if self.hint else ""
        return HeadprobeError(
            f"unknown {self.kind}: {name!r}{did_you_mean(str(name), self._targets)}; "
            f"known: {', '.join(self._targets) or 'none'}{hint}"
        )

    def names(self, group: str | None = None) -> tuple[str, ...]:
        """Every registered name (of ``group`` only, if given), in registration order (imports nothing)."""
        return tuple(n for n in self._targets if group is None or self._groups[n] == group)

    def group_of(self, name: str) -> str:
        """The group ``name`` was registered in (``""`` for none).

        Raises:
            HeadprobeError: ``name`` is not registered.
        """
        if name not in self._groups:
            raise self.unknown(name)
        return self._groups[name]

    def __contains__(self, name: object) -> bool:
        return name in self._targets

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._targets)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self._targets)})"

    def choices(self, *extra: str, group: str | None = None) -> Choices:
        """A live tuple-like view ``(*extra, *names(group))`` (e.g. ``("auto", "native", ...)``): an
        argparse ``choices=`` or a ``" ".join`` that sees names registered later."""
        return Choices(self, extra, group)


class Choices(Sequence[str]):
    """``(*extra, *registry.names(group))``, read from the registry on every use (:meth:`Registry.choices`);
    compares equal to the tuple it stands for."""

    def __init__(self, registry: Registry, extra: tuple[str, ...] = (), group: str | None = None) -> None:
        self.registry = registry
        self.extra = tuple(extra)
        self.group = group

    def _items(self) -> tuple[str, ...]:
        return (*self.extra, *self.registry.names(self.group))

    def __getitem__(self, index):  # unannotated: Sequence's int and slice overloads in one
        return self._items()[index]

    def __len__(self) -> int:
        return len(self._items())

    def __contains__(self, name: object) -> bool:
        return name in self._items()

    def __eq__(self, other: object) -> bool:
        return tuple(self) == (tuple(other) if isinstance(other, Sequence) and not isinstance(other, str) else other)

    def __hash__(self) -> int:
        return hash(self._items())

    def __repr__(self) -> str:
        return repr(self._items())
