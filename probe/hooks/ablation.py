"""Hook functions (head ablation), on TransformerLens' hook-point infrastructure; their names come from
:mod:`headprobe.probe.hooks.names`.

Hooks are registered for a ``with`` body only (:meth:`headprobe.probe.backends.base.LoadedModel.hooks`,
TransformerLens' ``model.hooks(...)``) and removed in its ``finally``, so an exception inside an
analysis never leaves a hook behind. Hook functions never edit the activation they receive in place: they return a new one.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from headprobe.probe.core import ablation_kinds
from headprobe.probe.core.ablation_kinds import AblationInputs, AblationKind
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.core.heads import Head, format_head, parse_heads  # noqa: F401 - re-exported
from headprobe.probe.hooks.names import attn_hook

HookFn = Callable[[Tensor, Any], Tensor | None]


def _group_by_layer(heads: Iterable[Head]) -> dict[int, list[int]]:
    by_layer: dict[int, list[int]] = defaultdict(list)
    for layer, head in heads:
        by_layer[layer].append(head)
    return by_layer


def head_ablation_hooks(
    heads: Iterable[Head],
    kind: AblationKind = "zero",
    mean_z: Float[Tensor, "layer head d_head"] | None = None,
    source_z: Mapping[int, Float[Tensor, "batch pos head d_head"]] | None = None,
) -> list[tuple[str, HookFn]]:
    """Hooks that ablate query heads at ``hook_z``, before the output projection.

    Ablating at ``hook_z`` (the head's value-weighted sum, ``[batch, pos, head, d_head]``)
    removes exactly the head's output contribution ``z_h W_O^(h)`` and leaves the bias ``b_O``;
    zeroing a slice of the projected attention output would not be a head ablation. Each hook
    returns a new z with the heads' slices replaced by their kind's ``r_h``
    (:mod:`headprobe.probe.core.ablation_kinds`).

    Args:
        heads: ``(layer, head)`` pairs; under GQA ``head`` is a query head.
        kind: a name in :data:`headprobe.probe.core.ablation_kinds.KINDS`: ``"zero"`` sets z_h to 0;
            ``"mean"`` to ``mean_z[layer, head]``, the head's mean z over a reference set of real
            tokens; ``"resample"`` to the head's z on another input, ``source_z[layer][:, :, head]``
            (same ``[batch, pos]`` shape).
        mean_z: ``[layer, head, d_head]``, for the kinds that need it (``mean``).
        source_z: ``{layer: z [batch, pos, head, d_head]}`` from a clean run on the source input,
            for every ablated layer, for the kinds that need a source (``resample``).

    Raises:
        HeadprobeError: unknown ``kind``, or the input it needs missing (also for one layer).
    """
    ablation = ablation_kinds.check(kind, mean_z, source_z, source_arg="source_z")
    inputs = AblationInputs(mean_z, source_z)
    hooks: list[tuple[str, HookFn]] = []
    for layer, idx in sorted(_group_by_layer(heads).items()):
        if ablation.needs == "source" and layer not in (source_z or {}):  # None: refused by check()
            raise HeadprobeError(f"{kind} ablation of layer {layer} needs source_z[{layer}]")
        index = torch.tensor(sorted(set(idx)))

        def hook(z: Tensor, hook: Any, layer: int = layer, index: Tensor = index) -> Tensor:
            z = z.clone()
            i = index.to(z.device)
            z[:, :, i] = ablation.replace(z[:, :, i], layer, index, inputs)
            return z

        hooks.append((attn_hook(layer, "z"), hook))
    return hooks


def head_set_masks(head_sets: Sequence[Iterable[Head]], n_layers: int, n_heads: int) -> Bool[Tensor, "set layer head"]:
    """``masks[i, layer, head]`` is True where ``(layer, head)`` is in ``head_sets[i]`` (for
    :func:`batched_ablation_hooks`)."""
    masks = torch.zeros(len(head_sets), n_layers, n_heads, dtype=torch.bool)
    for i, heads in enumerate(head_sets):
        for layer, head in heads:
            masks[i, layer, head] = True
    return masks


def batched_ablation_hooks(
    masks: Bool[Tensor, "copy layer head"],
    batch: int,
    kind: AblationKind = "zero",
    mean_z: Float[Tensor, "layer head d_head"] | None = None,
    source_z: Mapping[int, Float[Tensor, "batch pos head d_head"]] | None = None,
) -> list[tuple[str, HookFn]]:
    """Hooks for one forward pass over ``copy * batch`` sequences, a batch repeated once per copy
    (``tokens.repeat(copy, 1)``): in copy ``i`` the heads where ``masks[i]`` is True are ablated
    at ``hook_z`` as :func:`head_ablation_hooks` ablates them, so each copy's output equals one
    forward with those hooks (several head sets in one pass; ``source_z`` has the ``batch`` of one
    copy). Layers where no copy ablates a head get no hook.

    Args:
        masks: ``[copy, layer, head]``, True where that copy ablates that head
            (:func:`head_set_masks`). batch: sequences per copy.
        kind, mean_z, source_z: as for :func:`head_ablation_hooks`.

    Raises:
        HeadprobeError: unknown ``kind``, or the input it needs missing.
    """
    ablation = ablation_kinds.check(kind, mean_z, source_z, source_arg="source_z")
    inputs = AblationInputs(mean_z, source_z)

    def make(layer: int) -> HookFn:
        sel = masks[:, layer].repeat_interleave(batch, dim=0)[:, None, :, None]  # [copy * batch, 1, head, 1]

        def hook(z: Tensor, hook: Any) -> Tensor:
            r = ablation.replace(z, layer, slice(None), inputs.tiled(masks.shape[0], layer))
            return torch.where(sel.to(z.device), r, z)

        return hook

    return [(attn_hook(layer, "z"), make(layer)) for layer in range(masks.shape[1]) if masks[:, layer].any()]


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


def sink_removal_hooks(heads: Iterable[Head]) -> list[tuple[str, HookFn]]:
    """Hooks that remove the learned attention sinks of ``heads`` (GPT-OSS): their sink logits
    (``hook_sinks``, ``[head]``) become ``-inf``, so the softmax runs over the real keys alone
    (rows sum to 1) and the other heads keep theirs. A model without sinks has no ``hook_sinks``
    and the forward refuses the hook name."""

    def make(remove: list[int]) -> HookFn:
        def hook(sinks: Tensor, hook: Any) -> Tensor:
            out = sinks.clone()
            out[remove] = float("-inf")
            return out

        return hook

    return [(attn_hook(layer, "sinks"), make(sorted(hs))) for layer, hs in sorted(_group_by_layer(heads).items())]
