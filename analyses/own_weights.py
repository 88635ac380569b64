"""Which heads' OWN parameters changed between two models of one layout (``headprobe diff``'s
``own_change``): per head, the relative change ``||W_B - W_A||_F / ||W_A||_F`` of its weight slices,
read with the per-head accessors the W_O decomposition uses (:meth:`~headprobe.probe.backends.base.LoadedModel.W_Q`,
``W_K``, ``W_V``, ``W_O``, ``qkv_bias``).

A head's slices: ``W_Q[h]`` (with ``b_Q[h]``), ``W_O[h]``, and the key/value head it reads,
``W_K[h // g]`` and ``W_V[h // g]`` (with their biases; ``g`` query heads per key/value head): under
GQA a shared key/value head's change is attributed, whole, to each of the ``g`` query heads reading
it. The output bias ``b_O`` is the layer's, no head's, and is left out. An ablation effect is a total
effect (it moves when any head downstream changes); this is the head's own change only.
"""

from __future__ import annotations

import numpy as np
import torch

from headprobe.probe.backends.base import LoadedModel
from headprobe.probe.core.errors import HeadprobeError

PARTS = ("W_Q", "W_K", "W_V", "W_O")
"""The weight slices of a head, each with its bias where the model has one (none for ``W_O``)."""


def _slices(model: LoadedModel, layer: int) -> dict[str, torch.Tensor]:
    """Part -> ``[n_heads, n]`` float64: each query head's flattened slice of that part (its key/value
    head's for ``W_K``, ``W_V``) with the part's bias appended; a part the model lacks per head (latent
    attention's W_Q/W_K/W_V) is left out."""
    n_heads = model.spec.n_heads
    out = {"W_O": model.W_O(layer).detach().double().cpu().flatten(1)}
    for which in "qkv":
        try:
            w = getattr(model, f"W_{which.upper()}")(layer).detach().double().cpu().flatten(1)
        except HeadprobeError:  # latent attention: no per-head W_Q, W_K, W_V
            continue
        bias = model.qkv_bias(layer, which)
        if bias is not None:
            w = torch.cat([w, bias.detach().double().cpu().flatten(1)], dim=1)
        out[f"W_{which.upper()}"] = w.repeat_interleave(n_heads // w.shape[0], dim=0)  # a KV head per query head
    return {p: out[p] for p in PARTS if p in out}


def own_weight_change(a: LoadedModel, b: LoadedModel) -> dict[str, np.ndarray]:
    """Each head's own parameter change from ``a`` to ``b`` (loaded models of one layout).

    Returns:
        ``"own_change"``: ``[layer, head]`` ``||W_B - W_A||_F / ||W_A||_F`` over the head's slices together
        (:data:`PARTS`, biases included); per part ``p`` present, ``p``: that slice's relative change and
        ``p + "_norm_ratio"``: ``||W_B|| / ||W_A||`` (below 1: the slice shrank). NaN for a layer without
        attention heads; a slice zero in A gives 0 where B's is zero too, else inf. Exact zeros mean
        bit-identical slices.
    """
    spec = a.spec
    shape = (spec.n_layers, spec.n_heads)
    out: dict[str, np.ndarray] = {"own_change": np.full(shape, np.nan)}
    layers = getattr(spec, "attention_layers", None) or range(spec.n_layers)
    for layer in layers:
        sa, sb = _slices(a, layer), _slices(b, layer)
        num = den = torch.zeros(spec.n_heads, dtype=torch.float64)
        for part, wa in sa.items():
            wb = sb[part]
            d, na = (wb - wa).norm(dim=1), wa.norm(dim=1)
            num, den = num + d**2, den + na**2
            for key, val in ((part, _ratio(d, na)), (f"{part}_norm_ratio", _ratio(wb.norm(dim=1), na))):
                out.setdefault(key, np.full(shape, np.nan))[layer] = val
        out["own_change"][layer] = _ratio(num.sqrt(), den.sqrt())
    return out


def _ratio(num: torch.Tensor, den: torch.Tensor) -> np.ndarray:
    """``num / den`` per head, 0 where both are 0 (an all-zero slice unchanged)."""
    r = (num / den).numpy()
    r[(num == 0).numpy()] = 0.0
    return r


def describe(own: dict[str, np.ndarray], layer: int, head: int) -> str:
    """A head's largest-changed part, e.g. ``W_O -100%`` (the relative change in percent, its sign
    whether the slice's norm grew or shrank)."""
    parts = [p for p in PARTS if p in own]
    part = max(parts, key=lambda p: float(np.nan_to_num(own[p][layer, head], nan=-1.0)))
    change, ratio = float(own[part][layer, head]), float(own[f"{part}_norm_ratio"][layer, head])
    return f"{part} {'-' if ratio < 1 else '+'}{100 * change:.3g}%"


def moved_heads(own: dict[str, np.ndarray]) -> list[tuple[int, int]]:
    """The ``(layer, head)`` whose own slices changed (``own_change`` finite and not 0), largest first."""
    change = own["own_change"]
    moved = [(int(x), int(y)) for x, y in zip(*np.nonzero(np.isfinite(change) & (change != 0)))]
    return sorted(moved, key=lambda h: -change[h])


def own_change_line(own: dict[str, np.ndarray], n_largest: int = 6) -> str:
    """The report's line naming the heads whose own weights changed most, e.g. ``own weights changed:
    2 of 12 heads, the other 10 identical; most: 1.2 58% (W_O -100%), 2.0 ...``."""
    from headprobe.probe.hooks.ablation import format_head

    change = own["own_change"]
    moved, total = moved_heads(own), int(np.isfinite(change).sum())
    if not moved:
        return f"own weights changed: none (all {total} heads' W_Q, W_K, W_V, W_O slices identical in A and B)"
    most = ", ".join(f"{format_head(h)} {100 * change[h]:.3g}% ({describe(own, *h)})" for h in moved[:n_largest])
    rest = total - len(moved)
    return (
        f"own weights changed: {len(moved)} of {total} heads"
        + (f", the other {rest} identical" if rest else "")
        + f"; most: {most}"
    )
