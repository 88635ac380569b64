"""Naming heads: ``(layer, head)`` pairs and their ``layer.head`` text form (the ablation kinds
are in :mod:`headprobe.probe.core.ablation_kinds`).

Pure Python (no torch), so the command line can check ``--heads`` before any heavy library is
imported.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from headprobe.probe.core.errors import HeadprobeError, InputValueError

Head = tuple[int, int]
"""A head as ``(layer, head)``, both 0-indexed; printed as ``layer.head``."""


def format_head(head: Head) -> str:
    """``(5, 1)`` -> ``"5.1"``."""
    return f"{head[0]}.{head[1]}"


def all_heads(n_layers: int, n_heads: int, layers: Sequence[int] | None = None) -> list[Head]:
    """Every ``(layer, head)`` of an ``n_layers x n_heads`` model, layer by layer; only those of
    ``layers`` where given (a hybrid's layers with heads, ``ModelSpec.attention_layers``)."""
    return [(layer, head) for layer in (range(n_layers) if layers is None else layers) for head in range(n_heads)]


_HEAD = re.compile(r"(\d+)\.(\d+)|[Ll](\d+)[Hh](\d+)")


def parse_heads(text: str, n_layers: int, n_heads: int) -> list[Head]:
    """Parse ``"5.1,7.10"`` into ``[(5, 1), (7, 10)]``, checking the range. TransformerLens'
    spelling ``L5H1`` is accepted too; headprobe always prints ``5.1``.

    Raises:
        HeadprobeError: a malformed entry or a head outside ``n_layers x n_heads``.
    """
    heads: list[Head] = []
    items = [s.strip() for s in text.split(",")]
    if "" in items and any(items):  # "5.1," or "5.1,,7.3": a head left out by mistake?
        raise HeadprobeError(
            f"empty entry in the head list {text!r}; give layer.head entries separated by single commas"
        )
    for item in filter(None, items):
        m = _HEAD.fullmatch(item)
        if m is None:
            raise HeadprobeError(f"head {item!r} is not of the form layer.head (e.g. 5.1, or L5H1)")
        layer, head = (int(g) for g in m.groups() if g is not None)
        check_head((layer, head), n_layers, n_heads, name=item)
        heads.append((layer, head))
    if not heads:
        raise HeadprobeError("no heads given")
    return heads


def check_head(head: Head, n_layers: int, n_heads: int, name: str | None = None) -> None:
    """Refuse a head outside ``n_layers x n_heads`` (``name``: the head as the user spelled it).

    Raises:
        HeadprobeError: one line naming the head and the model's layout."""
    if not (0 <= head[0] < n_layers and 0 <= head[1] < n_heads):
        raise HeadprobeError(
            f"head {name or format_head(head)} is out of range: the model has {n_layers} layers of {n_heads} heads "
            "(0-indexed)"
        )


def check_receiver(head: Head, n_layers: int, n_heads: int, name: str | None = None) -> None:
    """Refuse a receiver of path patching (a head that reads earlier heads' outputs) outside the model
    (:func:`check_head`) or in layer 0, where no head comes before it.

    Raises:
        HeadprobeError: one line naming the head."""
    check_head(head, n_layers, n_heads, name)
    if head[0] == 0:
        raise HeadprobeError(
            f"receiver {name or format_head(head)} is in layer 0: no earlier head sends to it "
            f"(a receiver is a head of layers 1-{n_layers - 1}, or logits)"
        )


def check_head_layers(heads: Sequence[Head], head_layers: Sequence[int] | None) -> None:
    """Refuse a head in a layer without heads: a hybrid model's linear-attention layers (``head_layers``
    the layers with heads, ``AttentionLayout.head_layers``; None: every layer has heads).

    Raises:
        HeadprobeError: one line naming the first such head and the layers with heads."""
    if head_layers is not None and (bad := [h for h in heads if h[0] not in head_layers]):
        raise HeadprobeError(
            f"head {bad[0][0]}.{bad[0][1]}: layer {bad[0][0]} has no heads "
            f"(linear attention); the layers with heads are {list(head_layers)}"
        )


def check_not_removed(heads: Sequence[Head], removed: Sequence[Head] | set[Head], where: str) -> None:
    """Refuse heads a pruned checkpoint no longer has (``removed``: its ``removed_heads``, ``(layer,
    head)``): loaded with zero weights, such a head draws a uniform pattern and patches or ablates to
    nothing, which reads as a finding. ``where``: the file that lists them (``DIR/config.json``).

    Raises:
        HeadprobeError: one line naming the removed heads asked for and ``where``."""
    gone = sorted(set(heads) & set(removed))
    if gone:
        one = len(gone) == 1
        raise HeadprobeError(
            f"head{'' if one else 's'} {', '.join(format_head(h) for h in gone)} "
            f"{'was' if one else 'were'} removed by pruning (removed_heads in {where})"
        )


ANY = 10**9
"""Bounds for checking the ``layer.head`` form alone, before a model's layout is known."""


def _int(value: object) -> int | None:
    """``value`` as an int where it is one (Python, numpy or 0-d torch integer; not a bool or a float)."""
    import operator

    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def is_head_pair(value: object) -> bool:
    """True for one head given as a ``(layer, head)`` pair of integers."""
    return isinstance(value, (tuple, list)) and len(value) == 2 and all(_int(v) is not None for v in value)


def _float_error(value: object, what: str) -> HeadprobeError:
    return HeadprobeError(
        f"{what}={value!r} is a number, not a head: write layer.head as the string {str(value)!r} or the pair "
        f"({str(value).replace('.', ', ')})"
    )


def read_heads(value: object, n_layers: int = ANY, n_heads: int = ANY, what: str = "heads") -> list[Head]:
    """Heads in every form the Python API takes: a ``"5.1,7.3"`` string (``L5H1`` too,
    :func:`parse_heads`), one ``(layer, head)`` pair, or a list of ``"l.h"`` strings and/or pairs.
    Each head is checked against ``n_layers x n_heads`` (:func:`check_head`; the default bounds
    check the form alone). ``what``: the argument's name in messages.

    Raises:
        HeadprobeError: a malformed or out-of-range head, an empty list, or a float such as ``18.6``
            (ambiguous: 18.6 and 18.60 are one float; write ``"18.6"`` or ``(18, 6)``).
        TypeError: anything else (one line naming ``what``).
    """
    if isinstance(value, str):
        return parse_heads(value, n_layers, n_heads)
    if isinstance(value, float):
        raise _float_error(value, what)
    if is_head_pair(value):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{what} must be 'l.h,l.h', a (layer, head) pair or a list of them, got {type(value).__name__}")
    heads: list[Head] = []
    for item in value:
        if isinstance(item, str):
            heads += parse_heads(item, n_layers, n_heads)
        elif isinstance(item, float):
            raise _float_error(item, what)
        elif is_head_pair(item):
            head = (_int(item[0]), _int(item[1]))
            check_head(head, n_layers, n_heads)  # type: ignore[arg-type]
            heads.append(head)  # type: ignore[arg-type]
        else:
            raise TypeError(f"{what}: {item!r} is not a head ('l.h' or a (layer, head) pair of integers)")
    if not heads:
        raise InputValueError(f"no heads given in {what}: give at least one, or None for all")
    return heads


def given_heads(heads: Sequence | None, what: str = "heads") -> list | None:
    """An analysis's ``heads`` argument as a list, None (every head) as None.

    Raises:
        InputValueError: an empty list (an empty head axis, or a sweep of nothing), naming ``what``.
    """
    if heads is None:
        return None
    heads = list(heads)
    if not heads:
        raise InputValueError(f"{what} is empty: give at least one (layer, head), or None for all")
    return heads


def heads_text(value: object, what: str = "heads") -> str | None:
    """A ``heads`` setting in any form :func:`read_heads` takes as the checked string ``"5.1,7.3"``
    (how commands store it; None stays None). The range is checked once the model is known.

    Raises:
        HeadprobeError, TypeError: as :func:`read_heads`.
    """
    return None if value is None else ",".join(format_head(h) for h in read_heads(value, what=what))


def indices(values: Sequence[int], n: int, what: str) -> list[int]:
    """``values`` as indices into ``n`` items (layers, heads, rows), negative ones counted from the end as
    Python does: the one check of a layer index (:func:`headprobe.capture_heads`' ``layers``,
    ``LoadedModel.W_O(layer)`` and the other per-layer weights).

    Raises:
        HeadprobeError: an index outside ``-n .. n-1`` or not an integer (one line).
    """
    import operator

    out = []
    for v in values:
        try:
            if isinstance(v, bool):
                raise TypeError
            v = operator.index(v)  # ints, numpy and 0-d integer torch scalars; not 0.9
        except TypeError:
            raise HeadprobeError(f"{what} {v!r} is not an integer index") from None
        if not -n <= v < n:
            raise HeadprobeError(
                f"{what} {v} is out of range: there are {n} (0 .. {n - 1}, or -{n} .. -1 from the end)"
            )
        out.append(v % n)
    return out
