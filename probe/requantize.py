"""Weights rounded to fewer bits and back (fake quantization), made here in torch so that
``headprobe diff`` can compare a model with a re-quantization of its own weights (no GGUF writer
needed)."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch

from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.core.registry import did_you_mean
from headprobe.probe.hooks.names import block_path

if TYPE_CHECKING:
    from headprobe.probe.backends.base import LoadedModel

REQUANTIZE = ("int8", "int4", "int3")
"""The re-quantizations :func:`requantize` makes: ``int8`` symmetric per output channel; ``int4`` and
``int3`` asymmetric (scale and minimum) per group of 32 input weights, as GGUF's Q4_1 (ggml)."""
GROUP = 32
"""Input weights per group of the grouped re-quantizations (ggml's block size)."""


def fake_quantize(w: torch.Tensor, scheme: str, group: int = GROUP) -> torch.Tensor:
    """``w`` ``[..., out, in]`` (a matrix, or stacked experts' matrices) rounded to ``scheme`` (:data:`REQUANTIZE`) and dequantized (float32).

    ``int8``: ``round(w / s) s`` with ``s = max|w_row| / 127`` per row (per output channel).
    ``int<b>`` (b = 4, 3): each run of ``group`` inputs of a row gets ``s = (max - min) / (2^b - 1)``
    and ``q = round((w - min) / s)`` clamped to ``[0, 2^b - 1]``, back to ``q s + min`` (ggml's
    Q4_1 with b = 4). An ``in`` not divisible by ``group`` is grouped by ``in`` alone (one group).

    Raises:
        HeadprobeError: an unknown scheme.
    """
    if scheme not in REQUANTIZE:
        raise HeadprobeError(
            f"unknown re-quantization {scheme!r}{did_you_mean(str(scheme), REQUANTIZE)}; use one of {', '.join(REQUANTIZE)}"
        )
    x = w.detach().float()
    if scheme == "int8":
        s = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / 127
        return (torch.round(x / s).clamp(-127, 127) * s).to(w.dtype)
    levels = 2 ** int(scheme[3:]) - 1
    g = group if x.shape[-1] % group == 0 else x.shape[-1]
    xg = x.reshape(*x.shape[:-1], -1, g)
    lo, hi = xg.amin(dim=-1, keepdim=True), xg.amax(dim=-1, keepdim=True)
    s = ((hi - lo) / levels).clamp_min(1e-12)
    q = torch.round((xg - lo) / s).clamp(0, levels)
    return (q * s + lo).reshape(x.shape).to(w.dtype)


EXPERT_WEIGHTS = ("gate_up", "down")
"""The native mixture of experts' stacked expert weights ``[expert, out, in]``
(:class:`headprobe.probe.model.feedforward.MoE`)."""


def _is_weight_matrix(name: str, p: torch.Tensor) -> bool:
    """A block's projection weight: a 2-D ``[out, in]`` matrix (not a bias: GPT-OSS's expert biases
    are 2-D) or a mixture of experts' stacked :data:`EXPERT_WEIGHTS`; not a norm, a sink or a
    linear-attention layer's 3-D convolution."""
    last = name.rsplit(".", 1)[-1]
    return (p.dim() == 2 and not last.endswith("bias")) or (p.dim() == 3 and last in EXPERT_WEIGHTS)


@torch.no_grad()
def requantize(model: LoadedModel, scheme: str, group: int = GROUP) -> int:
    """Replace, in place, every weight matrix of ``model``'s transformer blocks by its
    :func:`fake_quantize`: the attention and MLP projections ``[out, in]``, the router, and a
    mixture of experts' stacked expert weights ``[expert, out, in]`` (each expert's rows grouped
    along its inputs, as GGUF quantizes each expert's matrix); not embeddings, norms, biases or
    sinks. Returns the number of tensors whose values changed (0 where the weights already lie on
    the scheme's grid: int4 on a Q4_1 GGUF model). A model the caller keeps should be given as
    :func:`requantized`'s copy.

    Raises:
        HeadprobeError: an unknown scheme, or no block weight found.
    """
    prefixes = tuple(block_path(layer) + "." for layer in range(model.spec.n_layers))
    n = found = 0
    for name, p in model.model.named_parameters():
        if name.startswith(prefixes) and _is_weight_matrix(name, p):
            rounded = fake_quantize(p.data, scheme, group)
            n += not torch.equal(rounded, p.data)
            p.data, found = rounded, found + 1
    if found == 0:
        raise HeadprobeError(
            f"re-quantization found no 2-D block weight in {model.spec.name} ({model.backend} backend)"
        )
    return n


def requantized(model: LoadedModel, scheme: str, group: int = GROUP) -> tuple[LoadedModel, int]:
    """A copy of ``model`` (its module deep-copied, the tokenizer and spec shared) with
    :func:`requantize` applied, and the number of tensors changed; ``model`` is left as it was.

    Raises:
        HeadprobeError: as :func:`requantize`.
    """
    twin = copy.copy(model)
    twin.model = copy.deepcopy(model.model)
    twin._post_norm_weights = {}  # derived from the module's weights: the copy's own
    return twin, requantize(twin, scheme, group)
