"""Hook names and hook functions (head ablation), on TransformerLens' hook-point infrastructure.

Hooks are registered for a ``with`` body only (:meth:`headprobe.probe.backend.LoadedModel.hooks`,
TransformerLens' ``model.hooks(...)``) and removed in its ``finally``, so an exception inside an
analysis never leaves a hook behind. Hook functions never edit the activation they receive in place: they return a new one.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from headprobe.probe.errors import HeadprobeError
from headprobe.probe.heads import ABLATION_KINDS, AblationKind, Head, format_head, parse_heads  # noqa: F401 - re-exported

HookFn = Callable[[Tensor, Any], Tensor | None]


def attn_hook(layer: int, name: str) -> str:
    """TransformerLens name of an attention hook, e.g. ``attn_hook(5, "pattern")`` ->
    ``blocks.5.attn.hook_pattern``."""
    return f"blocks.{layer}.attn.hook_{name}"


def _group_by_layer(heads: Iterable[Head]) -> dict[int, list[int]]:
    by_layer: dict[int, list[int]] = defaultdict(list)
    for layer, head in heads:
        by_layer[layer].append(head)
    return by_layer


def head_ablation_hooks(
    heads: Iterable[Head],
    kind: AblationKind = "zero",
    mean_z: Float[Tensor, "layer head d_head"] | None = None,
    source_z: dict[int, Float[Tensor, "batch pos head d_head"]] | None = None,
) -> list[tuple[str, HookFn]]:
    """Hooks that ablate query heads at ``hook_z``, before the output projection.

    Ablating at ``hook_z`` (the head's value-weighted sum, ``[batch, pos, head, d_head]``)
    removes exactly the head's output contribution ``z_h W_O^(h)`` and leaves the bias ``b_O``;
    zeroing a slice of the projected attention output would not be a head ablation.

    Args:
        heads: ``(layer, head)`` pairs; under GQA ``head`` is a query head.
        kind: ``"zero"`` sets z_h to 0; ``"mean"`` sets it to ``mean_z[layer, head]``, the head's
            mean z over a reference set of real tokens; ``"resample"`` sets it to the head's z on
            another input, ``source_z[layer][:, :, head]`` (same ``[batch, pos]`` shape).
        mean_z: required for ``kind="mean"``.
        source_z: required for ``kind="resample"``: ``{layer: z [batch, pos, head, d_head]}``
            from a clean run on the source input, for every ablated layer.

    Raises:
        ValueError: unknown ``kind``, or ``mean_z`` / ``source_z`` missing for its kind.
    """
    if kind not in ABLATION_KINDS:
        raise ValueError(f"unknown ablation kind {kind!r}; expected one of {ABLATION_KINDS}")
    if kind == "mean" and mean_z is None:
        raise ValueError("mean ablation needs mean_z")
    if kind == "resample" and source_z is None:
        raise ValueError("resample ablation needs source_z")
    hooks: list[tuple[str, HookFn]] = []
    for layer, idx in sorted(_group_by_layer(heads).items()):
        index = torch.tensor(sorted(set(idx)))
        if kind == "resample" and layer not in source_z:
            raise ValueError(f"resample ablation of layer {layer} needs source_z[{layer}]")

        def hook(z: Tensor, hook: Any, layer: int = layer, index: Tensor = index) -> Tensor:
            z = z.clone()
            i = index.to(z.device)
            if kind == "zero":
                z[:, :, i] = 0.0
            elif kind == "mean":
                z[:, :, i] = mean_z[layer, index].to(z.device, z.dtype)
            else:
                z[:, :, i] = source_z[layer][:, :, index].to(z.device, z.dtype)
            return z

        hooks.append((attn_hook(layer, "z"), hook))
    return hooks


class HookCounter:
    """Counts how often each hook fired; used to prove every pattern hook fires once per forward."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = defaultdict(int)

    def tick(self, name: str) -> None:
        self.counts[name] += 1

    def check_once(self, names: Iterable[str]) -> None:
        """Raise HeadprobeError if any of ``names`` fired other than exactly once.

        A hook that never fires means the model ran a fused attention kernel that returns no
        weights (SDPA, FlashAttention); patterns need the eager path.
        """
        for name in names:
            n = self.counts.get(name, 0)
            if n != 1:
                raise HeadprobeError(
                    f"hook {name} fired {n} times in one forward pass (expected 1); the model probably runs a fused "
                    f"attention kernel that hides attention patterns: load it with attn_implementation='eager'"
                )
