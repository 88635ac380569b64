"""One head's query and key as sums of terms, with every norm inside the attention frozen.

The QK attribution (:mod:`headprobe.analyses.qk_attribution`) splits a head's pre-softmax score
``scale * q_i . k_j`` into the contributions of the components of its input. That needs the map
from the attention's (normalised) input ``x`` at one position to the head's rotated query or key to
be affine: with QK-norm (Qwen3's per-head RMSNorm, OLMo-2's norm over the whole projection) and
MLA's latent norm that holds once each norm's per-token scale ``1 / rms`` is frozen at its value in
the clean forward (the frozen-norm linearisation of Elhage et al. 2021, as the self-check freezes
the post-attention norm, :func:`headprobe.probe.hooks.capture.post_norm_factor`). Rotary positions (Su et
al. 2021) are a rotation at the token's position, linear already.

:func:`head_qk_terms` is the native backend's implementation of
:meth:`headprobe.probe.backends.base.LoadedModel.qk_terms`.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from jaxtyping import Float
from torch import Tensor

from headprobe.probe.core.errors import HeadprobeError


def _frozen_rms(norm: Any, ref: Tensor) -> Tensor:
    """``1 / sqrt(mean(ref^2) + eps)`` of an RMS norm over ``ref``'s last axis (its frozen scale)."""
    return torch.rsqrt(ref.float().pow(2).mean(-1, keepdim=True) + norm.eps)


def _rotate(rotary: Any, terms: Tensor, pos: int) -> Tensor:
    """Each row of ``terms`` ``[n, d]`` rotated as a query/key at position ``pos``."""
    positions = torch.full((1, terms.shape[0]), pos, dtype=torch.long, device=terms.device)
    return rotary(terms[None, :, None, :], positions)[0, :, 0]


def _linear_terms(proj: torch.nn.Linear, rows: slice, terms: Tensor) -> Tensor:
    """``terms @ W[rows].T`` ``[n, d]`` and, as one more row, the bias ``b[rows]`` (zeros without one)."""
    W = proj.weight[rows]
    bias = proj.bias[rows] if proj.bias is not None else torch.zeros(W.shape[0], dtype=W.dtype, device=W.device)
    return torch.cat([terms.to(W) @ W.T, bias[None]])


def _mla_terms(attn: Any, head: int, side: str, terms: Tensor, ref: Tensor, pos: int) -> Tensor:
    """:func:`head_qk_terms` for latent attention (DeepSeek-V2/V3, no query latent)."""
    cfg = attn.cfg
    N, R, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    if side == "q":
        if cfg.q_lora_rank is not None:
            raise HeadprobeError(
                "QK attribution of latent attention with a query latent (q_lora_rank) is not implemented"
            )
        d = N + R
        out = _linear_terms(attn.q_proj, slice(head * d, (head + 1) * d), terms)
        if attn.rotary is not None:
            out = torch.cat([out[:, :N], _rotate(attn.rotary, out[:, N:], pos)], dim=-1)
        return out
    latent = _linear_terms(attn.kv_down, slice(0, r), terms)  # [n+1, r]: c^KV's terms
    c_ref = attn.kv_down(ref[None].to(attn.kv_down.weight))[0, :r]
    latent = latent * (attn.kv_norm.weight * _frozen_rms(attn.kv_norm, c_ref))
    up = attn.kv_up.weight[head * (N + cfg.d_head) : head * (N + cfg.d_head) + N]  # [N, r]
    k_nope = latent @ up.T
    if attn.kv_up.bias is not None:
        k_nope[-1] += attn.kv_up.bias[head * (N + cfg.d_head) : head * (N + cfg.d_head) + N]
    k_rope = _linear_terms(attn.kv_down, slice(r, r + R), terms)
    if attn.rotary is not None:
        k_rope = _rotate(attn.rotary, k_rope, pos)
    return torch.cat([k_nope, k_rope], dim=-1)


def head_qk_terms(
    net: Any,
    layer: int,
    head: int,
    side: Literal["q", "k"],
    terms: Float[Tensor, "n d_model"],
    ref: Float[Tensor, " d_model"],
    pos: int,
) -> Float[Tensor, "n_plus_1 d_qk"]:
    """Query (``side="q"``) or key (``"k"``) of query head ``head`` of layer ``layer`` of the native
    :class:`~headprobe.probe.model.transformer.Transformer` ``net`` as a sum of terms: row ``i < n`` is what
    ``terms[i]`` (a term of the attention input at position ``pos``, after the pre-attention norm)
    contributes, the last row the projection bias. QK-norm and MLA's latent norm are frozen at
    their scale for ``ref`` (the whole attention input at ``pos``); rotary is applied at ``pos``.
    A key is the one of the head's key/value head (``head // group_size``, GQA). The rows sum to
    the query or key the forward computes (after QK-norm and rotary, before the score scale).

    Raises:
        HeadprobeError: ``side`` is not ``q``/``k``, MLA with a query latent, gated attention, a QK L2
            norm or a query temperature (Llama-4, Qwen3-Next).
    """
    if side not in ("q", "k"):
        raise HeadprobeError(f"side must be 'q' or 'k', got {side!r}")
    attn = net.blocks[layer].attn
    cfg = net.cfg
    if cfg.is_mla:
        return _mla_terms(attn, head, side, terms, ref, pos)
    if cfg.attn_gate or cfg.qk_l2_norm or cfg.attn_temperature is not None:
        raise HeadprobeError(
            "QK attribution of gated attention, a QK L2 norm or a query temperature is not implemented"
        )
    d = cfg.d_qk
    idx = head if side == "q" else head // (attn.n_heads // attn.n_kv_heads)
    proj, norm = (attn.q_proj, attn.q_norm) if side == "q" else (attn.k_proj, attn.k_norm)
    out = _linear_terms(proj, slice(idx * d, (idx + 1) * d), terms)
    if norm is not None:  # QK-norm with its scale frozen at ref's query/key
        full = proj(ref[None].to(proj.weight))[0]
        if cfg.qk_norm == "per_head":
            out = out * (norm.weight * _frozen_rms(norm, full[idx * d : (idx + 1) * d]))
        else:  # "full": one RMS over the whole projection, this head's slice of the weight
            out = out * (norm.weight[idx * d : (idx + 1) * d] * _frozen_rms(norm, full))
    if attn.rotary is not None:
        out = _rotate(attn.rotary, out, pos)
    return out
