"""One compact ``repr`` for the commands' result objects (:class:`CompactRepr`): ``print(result)``
shows the class, its scalar settings and, for arrays, tensors and tables, their dtype and shape
(``scores={induction: float32[30, 9], ...}``, ``table=DataFrame[270 rows x 12]``), never their
values; a dataclass's own repr printed every value (about 180 kB for a scan of SmolLM2-135M).

Reads attributes only (no ``.item()``, no copy, no sum): cheap on any device. Torch-, numpy- and
pandas-free: arrays and tables are known by their ``shape`` and ``dtype`` (or ``columns``).
"""

from __future__ import annotations

import dataclasses
import numbers
import os
from collections.abc import Mapping

REPR_LIMIT = 2000
"""The most characters :meth:`CompactRepr.__repr__` returns."""
LINE_WIDTH = 160
"""The most characters of one field's line (cut with ``...``)."""
_ITEMS = 4
"""Items of a mapping or sequence shown before ``... N more``."""
NONE_TEXT = "repr_none"
"""A dataclass field's metadata key: the words :meth:`CompactRepr.__repr__` shows for its None."""
LOADED_BY_CALLER = "model loaded by the caller"
"""What ``load_s`` None means (:func:`load_seconds`)."""


def load_seconds():
    """A result's ``load_s`` field: the seconds the command spent loading its model, set by the
    code that loaded it (the CLI's runner, a Python function given a name); None -- the default --
    where the caller passed a model it had loaded, shown as :data:`LOADED_BY_CALLER` by ``repr``
    and left out of summary.json's ``timings_s`` (:func:`~headprobe.probe.core.io.summary_envelope`),
    never a load of 0 s."""
    return dataclasses.field(default=None, metadata={NONE_TEXT: LOADED_BY_CALLER})


def shape_text(value) -> str | None:
    """``float32[30, 9]`` for an array or tensor, ``DataFrame[270 rows x 12]`` for a table,
    ``Series[270]``; None for anything else."""
    shape = getattr(value, "shape", None)
    if not isinstance(shape, tuple):  # torch.Size is a tuple
        return None
    kind = type(value).__name__
    if kind == "DataFrame" and len(shape) == 2:
        return f"DataFrame[{shape[0]} rows x {shape[1]}]"
    if kind == "Series" and len(shape) == 1:
        return f"Series[{shape[0]}]"
    dtype = getattr(value, "dtype", None)
    if dtype is None:
        return None
    return f"{str(dtype).removeprefix('torch.')}[{', '.join(str(int(n)) for n in shape)}]"


def value_text(value, depth: int = 0) -> str:
    """``value`` in a few words: scalars and short strings as they are, arrays, tensors and tables
    by :func:`shape_text`, dataclasses by their scalar fields (a frozen settings dataclass: those
    that differ from its defaults), mappings and sequences by their first items (deeper down: their
    length), any other object by its class name (an ``nn.Module``'s repr can be megabytes)."""
    if value is None or isinstance(value, (bool, numbers.Number)):
        return _number(value)
    if isinstance(value, (str, bytes)):
        return _short(repr(value), 60) if isinstance(value, str) else f"bytes[{len(value)}]"
    if isinstance(value, os.PathLike):
        return _short(repr(os.fspath(value)), 80)
    shape = shape_text(value)
    if shape is not None:
        return shape
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _dataclass_text(value, depth)
    if isinstance(value, Mapping):
        return _mapping_text(value, depth)
    if isinstance(value, (list, tuple, set, frozenset)):
        return _sequence_text(value, depth)
    return f"<{type(value).__name__}>"


def _number(value) -> str:
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, numbers.Integral)):
        return f"{float(value):.4g}"
    return repr(value) if value is None or isinstance(value, bool) else str(value)


def _short(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(width - 3, 0)] + "..."


def _is_plain(value) -> bool:
    return value is None or isinstance(value, (bool, numbers.Number, str, os.PathLike))


def _dataclass_text(value, depth: int) -> str:
    name = type(value).__name__
    if depth > 1:
        return f"<{name}>"
    parts = []
    for f in dataclasses.fields(value):
        if not f.repr or f.name.startswith("_"):
            continue
        v = getattr(value, f.name, None)
        if depth > 0 and not _is_plain(v) and shape_text(v) is None:
            continue  # one level down: scalars and shapes only
        if _is_default(f, v):
            continue
        parts.append(f"{f.name}={value_text(v, depth + 1)}")
    return f"{name}({', '.join(parts)})"


def _is_default(f: dataclasses.Field, v) -> bool:
    """Whether ``v`` is ``f``'s default, compared only where that is cheap and plain (scalars,
    strings, tuples of them), never an array's elementwise comparison."""
    if f.default is dataclasses.MISSING or not (_is_plain(v) or isinstance(v, tuple)):
        return False
    if isinstance(v, tuple) and not all(_is_plain(x) for x in v):
        return False
    try:
        return bool(type(v) is type(f.default) and v == f.default)
    except Exception:  # a comparison that fails is not a default
        return False


def _mapping_text(value: Mapping, depth: int) -> str:
    if depth > 1:
        return f"{{{len(value)} items}}" if value else "{}"
    keys = list(value)[:_ITEMS]
    shown = [f"{_short(str(k), 30)}: {value_text(value[k], depth + 1)}" for k in keys]
    more = f", ... {len(value) - len(keys)} more" if len(value) > len(keys) else ""
    return "{" + ", ".join(shown) + more + "}"


def _sequence_text(value, depth: int) -> str:
    items = list(value) if isinstance(value, (set, frozenset)) else value
    kind = type(value).__name__
    if all(_is_plain(x) for x in items) and len(items) <= 2 * _ITEMS:
        text = ", ".join(value_text(x, depth + 1) for x in items)
        return f"({text}{',' if len(items) == 1 else ''})" if kind == "tuple" else f"[{text}]"
    names = {type(x).__name__ for x in items}
    if depth > 0 or len(names) == 1 and not all(_is_plain(x) for x in items):
        return f"{kind}[{len(items)}{' ' + names.pop() if len(names) == 1 else ''}]"
    shown = [value_text(x, depth + 1) for x in items[:_ITEMS]]
    more = f", ... {len(items) - len(shown)} more" if len(items) > len(shown) else ""
    return f"[{', '.join(shown)}{more}]"


class CompactRepr:
    """A mixin for result dataclasses (declared ``@dataclass(repr=False)``, else the dataclass's
    own repr replaces this one): ``repr(result)`` is the class name and one line per field
    (:func:`value_text`; a None field with :data:`NONE_TEXT` metadata: ``name: <its words>``), at most :data:`REPR_LIMIT` characters, after any lines of
    :meth:`_repr_notes` (a verdict count, ...)."""

    def _repr_notes(self) -> dict[str, str]:
        """Lines ``name: text`` shown first, computed from attributes already there (override)."""
        return {}

    def __repr__(self) -> str:
        notes = [_short(f"{name}: {text}", LINE_WIDTH) for name, text in self._repr_notes().items()]
        lines: list[str] = []
        if dataclasses.is_dataclass(self):
            for f in dataclasses.fields(self):
                if f.repr and not f.name.startswith("_"):
                    v = getattr(self, f.name, None)
                    none = f.metadata.get(NONE_TEXT) if v is None else None
                    lines.append(f"{f.name}: {none}" if none else f"{f.name}={value_text(v)}")
        head = f"{type(self).__name__}("
        room = REPR_LIMIT - len(head) - 2 - sum(len(x) + 6 for x in notes) - 6 * len(lines)
        width = _fitting_width([len(x) for x in lines], room)
        body = "".join(f"\n    {x}," for x in [*notes, *(_short(x, width) for x in lines)])
        return _short(f"{head}{body}\n)", REPR_LIMIT)


def _fitting_width(lengths: list[int], room: int) -> int:
    """The widest cut (at most :data:`LINE_WIDTH`, at least 24) that fits lines of ``lengths`` in
    ``room`` characters: short lines stay whole, only the longest are cut."""
    width = LINE_WIDTH
    while width > 24 and sum(min(n, width) for n in lengths) > room:
        width -= 4
    return width
