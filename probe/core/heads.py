"""Naming heads: ``(layer, head)`` pairs and their ``layer.head`` text form (the ablation kinds
are in :mod:`headprobe.probe.core.ablation_kinds`).

Pure Python (no torch), so the command line can check ``--heads`` before any heavy library is
imported.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from headprobe.probe.core.errors import HeadprobeError

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
