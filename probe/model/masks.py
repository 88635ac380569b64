"""Which keys a query reads: :func:`key_mask` (causality, a sliding window, chunks, padding, a KV
cache's offset), the one mask of every attention path, and :func:`streaming_key_mask`, the mask of
a head-level KV policy; :func:`with_sink_key`, learned sink logits as one more key every query
reads.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.layout.attention import Streaming


def key_mask(
    n_queries: int,
    n_keys: int,
    device: torch.device,
    *,
    causal: bool = True,
    window: int | None = None,
    padding: Bool[Tensor, "batch k_pos"] | None = None,
    implicit: bool = False,
    chunk: int | None = None,
) -> Bool[Tensor, "#batch 1 #q_pos k_pos"] | Bool[Tensor, "q_pos k_pos"] | None:
    """Which keys each query reads, True where it may: the one mask of every attention path.

    The ``n_queries`` queries are the last of ``n_keys`` positions (a KV cache holds the first
    ``n_keys - n_queries``), so query ``i`` sits at position ``p_i = n_keys - n_queries + i``.

    Args:
        causal: query ``i`` reads key ``j`` only if ``j <= p_i`` (decoders); False: every key
            (encoders; ``window`` is then not allowed).
        window: also only if ``j > p_i - window``: the ``window`` most recent keys, itself
            included (Hugging Face's sliding window; Mistral, Beltagy et al. 2020).
        padding: ``[batch, k_pos]``, True for real tokens: padding keys are never read, except
            that a causal query reads itself, so that no row is empty (a padding query with no
            real key before it; its output is never scored).
        implicit: return None where no tensor is needed because the fused kernel's own masking is
            exact (``is_causal`` for a causal mask with ``n_queries == n_keys``; nothing for a
            bidirectional one), i.e. without window, chunk and padding.
        chunk: also only if ``j`` and ``p_i`` are in the same chunk of ``chunk`` positions, counted
            over real tokens where there is padding (Hugging Face's ``chunked_overlay``, Llama-4). The eager path asks for the
            tensor (``implicit=False``); it is then None only when nothing is masked at all.

    Returns:
        ``[q_pos, k_pos]``, or ``[batch, 1, q_pos, k_pos]`` with causal padding and
        ``[batch, 1, 1, k_pos]`` with bidirectional padding (broadcast over heads and, for the
        latter, queries); None as described under ``implicit``.

    Raises:
        HeadprobeError: a ``window`` with ``causal=False``.
    """
    if not causal:
        if window is not None:
            raise HeadprobeError("bidirectional attention (causal=False) with a sliding window is not implemented")
        return None if padding is None else padding[:, None, None, :]
    if padding is None and window is None and chunk is None and implicit and n_queries == n_keys:
        return None
    i = torch.arange(n_keys - n_queries, n_keys, device=device)[:, None]  # the queries' positions
    j = torch.arange(n_keys, device=device)[None, :]
    mask = j <= i
    if window is not None:
        mask = mask & (j > i - window)
    if chunk is not None:  # chunks of real-token positions
        pos = (j[0] if padding is None else padding.long().cumsum(-1) - 1) // chunk  # [k_pos] | [batch, k_pos]
        q_chunk = pos[..., n_keys - n_queries :, None]  # [q_pos, 1] | [batch, q_pos, 1]
        mask = mask & (pos[..., None, :] == q_chunk if padding is None else (pos[:, None, :] == q_chunk)[:, None])
    if padding is not None:
        mask = (mask & padding[:, None, None, :]) | (j == i)
    return mask


def streaming_key_mask(
    q_pos: Int[Tensor, " q_pos"],
    key_pos: Int[Tensor, "group k_pos"],
    groups: Sequence[Streaming | None],
    n_heads: int,
    window: int | None = None,
) -> Bool[Tensor, "head q_pos k_pos"]:
    """Which keys each query head reads under a head-level KV policy, True where it may.

    Query head ``h`` belongs to KV group ``g = h * G // n_heads`` (``h // group_size`` for
    MHA/GQA/MQA; 0 for MLA, whose one latent is the layer's only group). It reads the key at
    position ``j`` from query position ``i`` when ``j <= i`` (causal), ``j >= 0`` (-1 marks an empty
    slot of a :class:`~headprobe.probe.model.cache.StreamingKVCache`), and, for a :class:`~headprobe.probe.layout.attention.Streaming`
    group, ``j < sink`` or ``j > i - window`` (StreamingLLM's sink + recent window, Xiao et al.
    2023, arXiv:2309.17453; DuoAttention's streaming heads, arXiv:2410.10819). ``window`` is the
    layer's own sliding window, if any. Built for one block of queries at a time: ``[head,
    q_pos, k_pos]``, never ``[pos, pos]`` for a whole sequence unless asked.

    Args:
        q_pos: positions of the queries.
        key_pos: ``[group, k_pos]`` positions of each group's keys (all groups the same without a cache).
        groups: the layer's policy, one entry per KV group (None: full).
        n_heads: query heads of the layer.
    """
    G = len(groups)
    far = torch.iinfo(torch.long).max // 4
    head_group = torch.arange(n_heads, device=key_pos.device) * G // n_heads
    sink = torch.tensor([0 if g is None else g.sink for g in groups], device=key_pos.device)[head_group]
    recent = torch.tensor([far if g is None else g.window for g in groups], device=key_pos.device)[head_group]
    j = key_pos[head_group][:, None, :]  # [head, 1, k_pos]
    i = q_pos.to(key_pos.device)[None, :, None]  # [1, q_pos, 1]
    mask = (j >= 0) & (j <= i) & ((j < sink[:, None, None]) | (j > i - recent[:, None, None]))
    if window is not None:
        mask = mask & (j > i - window)
    return mask


def with_sink_key(
    q: Float[Tensor, "batch head q_pos d_qk"],
    k: Float[Tensor, "batch kv_head k_pos d_qk"],
    v: Float[Tensor, "batch kv_head k_pos d_head"],
    mask: Tensor | None,
    sinks: Float[Tensor, " head"],
    scale: float,
    causal: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Learned sink logits as one more key a fused kernel can read: every query gets one more
    dimension, ``sink_h / scale``; real keys get 0 there and the sink key (first, value 0) is 1
    there and 0 elsewhere. Its score is then ``sink_h`` and every real key's is unchanged, so
    ``softmax`` over the keys is the softmax over ``[scores, sink]``, and the zero value adds
    nothing to ``z``. The mask gains a first column that every query reads (a causal mask is
    made explicit: the kernel's own would align it top-left). A sink of ``-inf`` (removed) is
    masked for its head instead (``-inf`` times a real key's 0 would be NaN)."""
    B, H, T, _ = q.shape
    KV, S = k.shape[1], k.shape[2]
    finite = torch.isfinite(sinks)
    extra = torch.where(finite, sinks / scale, 0.0).to(q.dtype)[None, :, None, None].expand(B, H, T, 1)
    q = torch.cat([q, extra], dim=-1)
    k = torch.cat([k, k.new_zeros(B, KV, S, 1)], dim=-1)
    sink_key = torch.zeros(B, KV, 1, k.shape[-1], dtype=k.dtype, device=k.device)
    sink_key[..., -1] = 1
    k = torch.cat([sink_key, k], dim=2)
    v = torch.cat([v.new_zeros(B, KV, 1, v.shape[-1]), v], dim=2)
    if mask is None and (causal or not bool(finite.all())):
        mask = key_mask(T, S, q.device, causal=True) if causal else torch.ones(T, S, dtype=torch.bool, device=q.device)
    if mask is None:
        return q, k, v, None
    if bool(finite.all()):
        return q, k, v, torch.cat([mask.new_ones(*mask.shape[:-1], 1), mask], dim=-1)
    m = mask if mask.dim() == 4 else mask[None, None]  # [batch | 1, head | 1, q_pos | 1, k_pos]
    m = m.expand(m.shape[0], H, T, S)
    return q, k, v, torch.cat([finite.to(m.device)[None, :, None, None].expand(m.shape[0], H, T, 1), m], dim=-1)
