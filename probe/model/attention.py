"""Attention of the native transformer: one class per mechanism, nanoGPT style, on a shared base
(:class:`SelfAttention`: the mask, the two paths below, ``W_O`` and the hook points):

* :class:`Attention` covers multi-head (MHA, ``n_kv_heads == n_heads``), grouped-query (GQA,
  ``1 < n_kv_heads < n_heads``) and multi-query attention (MQA, ``n_kv_heads == 1``). Query
  head ``h`` reads key/value head ``h // group_size`` with ``group_size = n_heads //
  n_kv_heads`` (Ainslie et al. 2023, "GQA", arXiv 2305.13245; Shazeer 2019, "Fast Transformer
  Decoding", arXiv 1911.02150). Keys and values are computed for ``n_kv_heads`` only and never
  copied per query head.
* :class:`~headprobe.probe.model.latent_attention.LatentAttention` (its own module) is multi-head
  latent attention (MLA; DeepSeek-V2, arXiv 2405.04434).

Which keys a query reads (causality, a sliding window, a KV cache's offset, padding) is decided
by one function, :func:`~headprobe.probe.model.masks.key_mask`. Widths: ``d_head`` is the width
of ``z`` and of the values, ``d_qk`` that of a query and a key (the same number except for MLA).

Two attention paths give the same numbers (to 1e-5 in float32):

* the eager path writes the scores and the pattern ``softmax(q k^T / sqrt(d_qk))`` out and
  runs whenever a hook on ``hook_attn_scores`` or ``hook_pattern`` is active (``run_with_cache``
  included), or when ``Transformer.force_eager`` is set;
* otherwise ``torch.nn.functional.scaled_dot_product_attention``, a fused kernel that never
  materialises the ``[q_pos, k_pos]`` pattern.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import einops
import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.layout.attention import Streaming
from headprobe.probe.model.cache import KVCache, StreamingKVCache
from headprobe.probe.model.config import TransformerConfig
from headprobe.probe.model.masks import key_mask, streaming_key_mask, with_sink_key
from headprobe.probe.model.norms import RMSNorm, l2_norm
from headprobe.probe.model.positions import Rotary, rotary_scaling


def split_heads(x: Float[Tensor, "batch pos d"], n_heads: int) -> Float[Tensor, "batch head pos d_head"]:
    """``[batch, pos, head * d_head] -> [batch, head, pos, d_head]``: reshape to ``[batch, pos, head,
    d_head]``, then transpose. Head ``h`` holds columns ``h*d_head:(h+1)*d_head`` of every token
    (a direct reshape to ``[batch, head, pos, d_head]`` would mix tokens into heads)."""
    B, T, d = x.shape
    return x.view(B, T, n_heads, d // n_heads).transpose(1, 2)


def merge_heads(x: Float[Tensor, "batch head pos d_head"]) -> Float[Tensor, "batch pos d"]:
    """Inverse of :func:`split_heads`: ``[batch, head, pos, d_head] -> [batch, pos, head * d_head]``."""
    B, H, T, d_head = x.shape
    return x.transpose(1, 2).reshape(B, T, H * d_head)


#: The most mask entries (``head x q_pos x k_pos``) one block of queries builds under a KV policy.
STREAMING_MASK_ENTRIES = 2**24


@functools.cache
def _sdpa_has_enable_gqa() -> bool:
    """``scaled_dot_product_attention(..., enable_gqa=True)`` exists from torch 2.5 on (it is a
    builtin without a Python signature, so the version decides)."""
    major, minor = (int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    return (major, minor) >= (2, 5)


#: What :meth:`SelfAttention.qkv` returns: queries, keys and values, heads before positions.
QKV = tuple[
    Float[Tensor, "batch head q_pos d_qk"],
    Float[Tensor, "batch kv_head k_pos d_qk"],
    Float[Tensor, "batch kv_head k_pos d_head"],
]


class SelfAttention(nn.Module):
    """What every attention mechanism shares; a subclass adds its projections and :meth:`qkv`.

    The forward pass is ``qkv`` (queries ``[batch, head, q_pos, d_qk]``, keys ``[batch,
    kv_head, k_pos, d_qk]``, values ``[batch, kv_head, k_pos, d_head]``, the KV cache extended),
    then :meth:`attend` (the :func:`~headprobe.probe.model.masks.key_mask` of causality, this layer's sliding window and
    padding; ``softmax(cap(q k^T * scale) + mask) v`` on the eager path with the scores and
    pattern hooked, else the fused kernel), then :meth:`output`: ``head_mask``, ``hook_z`` and
    ``attn_out = sum_h z_h W_O^(h) + b_O`` (Elhage et al. 2021), which equals ``Concat(z_0,
    ..., z_{H-1}) W_O + b_O``. ``scale`` is ``attn_scale``, else ``1/sqrt(d_qk)``; ``cap`` is
    ``c * tanh(s / c)`` with ``attn_softcap``, else the identity.

    Hook points (TransformerLens' names; shapes beside each in :meth:`_add_output`):
    ``hook_q``, ``hook_k``, ``hook_v``, ``hook_attn_scores``, ``hook_pattern``, ``hook_z``,
    ``hook_result``; :class:`Attention` adds ``hook_rot_q``/``hook_rot_k``.
    """

    def __init__(self, cfg: TransformerConfig, layer: int, n_heads: int):
        super().__init__()
        self.cfg = cfg
        self.layer = layer
        self.n_heads = n_heads
        self.window = cfg.sliding_window if cfg.is_sliding(layer) else None
        self.chunk = cfg.attention_chunk if cfg.is_chunked(layer) else None
        self.softcap = cfg.attn_softcap
        self.scale = 1.0 / math.sqrt(cfg.d_qk) if cfg.attn_scale is None else cfg.attn_scale
        self.force_eager = False
        self.streaming: tuple[Streaming | None, ...] | None = None  # this layer's KV policy (Transformer.kv_policy)
        self._gate: Tensor | None = (
            None  # this forward's output gate [batch, pos, head, d_head] (attn_gate), set by qkv
        )

    def _add_output(self, rotary_hooks: bool) -> None:
        """W_O and the hook points, made after the subclass's projections (so that parameters,
        and a seeded initialisation, come in forward order)."""
        cfg = self.cfg
        assert cfg.d_head is not None  # filled by TransformerConfig.__post_init__
        self.o_proj = nn.Linear(self.n_heads * cfg.d_head, cfg.d_model, bias=cfg.bias)
        self.hook_q = HookPoint()  # [batch, pos, head, d_qk]
        self.hook_k = HookPoint()  # [batch, pos, kv_head, d_qk]
        self.hook_v = HookPoint()  # [batch, pos, kv_head, d_head]
        if rotary_hooks:
            self.hook_rot_q = HookPoint()  # [batch, pos, head, d_qk]     (rotary layers only)
            self.hook_rot_k = HookPoint()  # [batch, pos, kv_head, d_qk]  (rotary layers only)
        self.hook_attn_scores = HookPoint()  # [batch, head, q_pos, k_pos], scaled, capped, masked keys exactly -inf
        self.hook_pattern = (
            HookPoint()
        )  # [batch, head, q_pos, k_pos], rows sum to 1 (less the sink mass), masked keys 0
        # learned sink logits (GPT-OSS): softmax over [scores, sink], the sink's column dropped
        self.sinks = nn.Parameter(torch.zeros(self.n_heads)) if cfg.attn_sinks else None
        if cfg.attn_sinks:
            self.hook_sinks = HookPoint()  # [head], the sink logits this forward uses (-inf removes the sink)
        if cfg.attn_gate:
            self.hook_gate = HookPoint()  # [batch, pos, head, d_head], sigmoid of the output gate (attn_gate only)
        self.hook_z = HookPoint()  # [batch, pos, head, d_head], after head_mask
        self.hook_result = HookPoint()  # [batch, pos, head, d_model], z_h W_O^(h)

    @property
    def W_O(self) -> Float[Tensor, "head d_head d_model"]:
        """The output projection split by head, a view of ``o_proj.weight``: ``result_h = z_h @ W_O[h]``."""
        return self.o_proj.weight.T.unflatten(0, (self.n_heads, self.cfg.d_head))

    @property
    def b_O(self) -> Float[Tensor, " d_model"] | None:
        """The output bias (None without biases)."""
        return self.o_proj.bias

    def needs_pattern(self) -> bool:
        """Whether this forward must materialise the pattern (a scores/pattern hook is active,
        or soft-capping, which the fused kernel cannot do)."""
        return (
            self.force_eager
            or self.softcap is not None
            or self.hook_pattern.has_hooks()
            or self.hook_attn_scores.has_hooks()
            or (self.sinks is not None and self.hook_sinks.has_hooks())
        )

    def sink_logits(self) -> Float[Tensor, " head"] | None:
        """This forward's sink logits, float32, through ``hook_sinks`` (None without sinks)."""
        return None if self.sinks is None else self.hook_sinks(self.sinks).float()

    def qkv(
        self,
        x: Float[Tensor, "batch pos d_model"],
        positions: Int[Tensor, "batch pos"],
        cache: KVCache | StreamingKVCache | None = None,
    ) -> QKV:
        """Queries of ``x``'s positions; keys and values of the cached positions and ``x``'s
        (this call's are added to ``cache``). The mechanism: a subclass's."""
        raise NotImplementedError

    def forward(
        self,
        x: Float[Tensor, "batch pos d_model"],
        positions: Int[Tensor, "batch pos"],
        padding: Bool[Tensor, "batch pos"] | None = None,
        head_mask: Float[Tensor, " head"] | Float[Tensor, "batch head"] | None = None,
        cache: KVCache | StreamingKVCache | None = None,
    ) -> Float[Tensor, "batch pos d_model"]:
        """Attention output ``[batch, pos, d_model]`` for the normalised residual ``x``.

        Args:
            x: input, ``[batch, pos, d_model]``.
            positions: position index of every token (rotary only).
            padding: ``[batch, pos]``, True for real tokens (see :func:`~headprobe.probe.model.masks.key_mask`); None: none.
            head_mask: per-head factor ``xi_h`` multiplying ``z_h`` (Michel et al. 2019), for
                all sequences (``[head]``) or per sequence (``[batch, head]``).
            cache: keys and values of earlier positions (generation); this call's are appended.
        """
        q, k, v = self.qkv(x, positions, cache)
        if isinstance(cache, StreamingKVCache):
            z = self._attend_streaming(
                q, k, v, cache.policy.groups[self.layer], cache.key_positions[self.layer], padding
            )
        elif self.streaming is not None:
            z = self._attend_streaming(q, k, v, self.streaming, None, padding)
        else:
            z = self.attend(q, k, v, padding)
        gate, self._gate = self._gate, None
        if gate is not None:  # gated attention (attn_gate): z_h = sigmoid(g_h) * pattern_h v
            z = z * self.hook_gate(torch.sigmoid(gate))
        return self.output(z, head_mask)

    def _attend_streaming(
        self,
        q: Float[Tensor, "batch head q_pos d_qk"],
        k: Float[Tensor, "batch kv_head k_pos d_qk"],
        v: Float[Tensor, "batch kv_head k_pos d_head"],
        groups: Sequence[Streaming | None],
        key_pos: Int[Tensor, "group k_pos"] | None,
        padding: Tensor | None,
    ) -> Float[Tensor, "batch q_pos head d_head"]:
        """:meth:`attend` under a KV policy (:func:`~headprobe.probe.model.masks.streaming_key_mask`): the eager path with the
        mask of all queries when a pattern is asked for (it is materialised anyway), else the
        fused kernel one block of queries at a time (at most :data:`STREAMING_MASK_ENTRIES` per block), so
        no ``[pos, pos]`` mask exists. ``key_pos`` None: the keys are positions ``0..k_pos-1``.

        Raises:
            HeadprobeError: padding or a bidirectional model (a policy is for causal decoders).
        """
        if padding is not None or not self.cfg.causal:
            raise HeadprobeError("a KV policy needs causal attention without padding (one unpadded batch)")
        T, L = q.shape[2], k.shape[2]
        if key_pos is None:
            key_pos = torch.arange(L, device=q.device).expand(len(groups), L)
        last = int(key_pos.max())
        q_pos = torch.arange(last - T + 1, last + 1, device=q.device)

        def mask(a: int, b: int) -> Tensor:
            return streaming_key_mask(q_pos[a:b], key_pos, groups, self.n_heads, self.window)[None]

        if self.needs_pattern():
            return self._eager(q, k, v, mask(0, T)).transpose(1, 2)
        block = max(1, STREAMING_MASK_ENTRIES // (self.n_heads * L))
        z = torch.cat(
            [self._fused(q[:, :, a : a + block], k, v, mask(a, a + block)) for a in range(0, T, block)], dim=2
        )
        return z.transpose(1, 2)

    def attend(
        self,
        q: Float[Tensor, "batch head q_pos d_qk"],
        k: Float[Tensor, "batch kv_head k_pos d_qk"],
        v: Float[Tensor, "batch kv_head k_pos d_head"],
        padding: Bool[Tensor, "batch k_pos"] | None = None,
    ) -> Float[Tensor, "batch q_pos head d_head"]:
        """``z`` of every head: the eager path when :meth:`needs_pattern`, else the fused kernel,
        both under this layer's :func:`~headprobe.probe.model.masks.key_mask`."""
        eager = self.needs_pattern()
        mask = key_mask(
            q.shape[2],
            k.shape[2],
            q.device,
            causal=self.cfg.causal,
            window=self.window,
            padding=padding,
            implicit=not eager,
            chunk=self.chunk,
        )
        z = self._eager(q, k, v, mask) if eager else self._fused(q, k, v, mask)
        return z.transpose(1, 2)

    def output(
        self,
        z: Float[Tensor, "batch pos head d_head"],
        head_mask: Float[Tensor, " head"] | Float[Tensor, "batch head"] | None = None,
    ) -> Float[Tensor, "batch pos d_model"]:
        """``sum_h xi_h z_h W_O^(h) + b_O``: ``z`` times ``head_mask``, through ``hook_z``, then
        W_O (per head through ``hook_result`` when a hook reads it, else one merged matmul)."""
        if head_mask is not None:
            xi = head_mask.to(z.dtype)
            z = z * (xi[:, None, :, None] if xi.dim() == 2 else xi[:, None])
        z = self.hook_z(z)
        if self.hook_result.has_hooks():
            result = self.hook_result(
                einops.einsum(z, self.W_O, "batch pos head d_head, head d_head d_model -> batch pos head d_model")
            )
            out = result.sum(dim=2)
            return out if self.b_O is None else out + self.b_O
        return self.o_proj(z.flatten(2))  # merge heads: Concat(z_h) W_O + b_O

    def _eager(
        self,
        q: Float[Tensor, "batch head q_pos d_qk"],
        k: Float[Tensor, "batch kv_head k_pos d_qk"],
        v: Float[Tensor, "batch kv_head k_pos d_head"],
        mask: Tensor | None,
    ) -> Float[Tensor, "batch head q_pos d_head"]:
        """Explicit ``softmax(cap(q k^T * scale) + mask) v`` with the pattern hooked (``cap`` is
        ``c * tanh(s / c)`` with ``attn_softcap``, else the identity).

        Precision: scores, soft-capping and softmax are computed in float32 whatever the weights'
        dtype (``q`` and ``k`` are upcast before the product), so half precision cannot overflow
        here: float16 tops out at 65504, and in half precision a model with large queries and keys
        would give ``inf`` scores and NaN pattern rows where the fused kernel (which accumulates in
        float32) gives none. ``hook_attn_scores`` sees the float32 scores; the pattern is cast back to the
        model's dtype before ``hook_pattern`` (as Hugging Face's eager attention does), and
        ``pattern @ v`` runs in that dtype. In float32 the upcast changes nothing.

        GQA without copies: the ``group_size`` query heads of one key/value head are stacked
        along the query-position axis, ``[batch, kv_head, group * q_pos, d_qk]``, so one batched
        matmul against that key/value head serves the whole group.
        """
        B, H, T, d_qk = q.shape
        KV, S = k.shape[1], k.shape[2]
        q_grouped = q.reshape(B, KV, (H // KV) * T, d_qk)  # head h = kv_head * group + g
        scores = (q_grouped.float() @ k.float().transpose(-1, -2)).view(B, H, T, S) * self.scale  # float32
        if self.softcap is not None:  # Gemma-2, before the mask (as Hugging Face)
            scores = torch.tanh(scores / self.softcap) * self.softcap
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        scores = self.hook_attn_scores(scores)
        sinks = self.sink_logits()
        if sinks is None:
            probs = scores.softmax(dim=-1)
        else:  # GPT-OSS: the sink takes part in the softmax, then its column is dropped
            probs = torch.cat([scores, sinks[:, None, None].expand(B, H, T, 1)], dim=-1).softmax(dim=-1)[..., :-1]
        pattern = self.hook_pattern(probs.to(v.dtype))  # [batch, head, q_pos, k_pos]
        z = pattern.reshape(B, KV, (H // KV) * T, S) @ v
        return z.view(B, H, T, v.shape[-1])  # MLA: values are narrower than queries/keys

    def _fused(
        self,
        q: Float[Tensor, "batch head q_pos d_qk"],
        k: Float[Tensor, "batch kv_head k_pos d_qk"],
        v: Float[Tensor, "batch kv_head k_pos d_head"],
        mask: Tensor | None,
    ) -> Float[Tensor, "batch head q_pos d_head"]:
        """``scaled_dot_product_attention``; no pattern exists on this path. ``mask`` None is the
        kernel's own causal mask (``is_causal``) for a decoder, no mask for an encoder. Learned
        sinks enter as one extra key (:func:`~headprobe.probe.model.masks.with_sink_key`)."""
        if self.sinks is not None:
            d_v = v.shape[-1]
            q, k, v, mask = with_sink_key(q, k, v, mask, self.sinks.float(), self.scale, self.cfg.causal)
            v = F.pad(v, (0, q.shape[-1] - d_v))  # equal widths for the fused kernels (as MLA below)
            return self._sdpa(q, k, v, mask)[..., :d_v]
        return self._sdpa(q, k, v, mask)

    def _sdpa(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        """:meth:`_fused` after the learned sinks are a key."""
        kwargs: dict[str, Any] = dict(is_causal=self.cfg.causal) if mask is None else dict(attn_mask=mask)
        if v.shape[-1] < q.shape[-1]:
            # MLA: values (d_head) are narrower than queries/keys (d_qk). PyTorch's fused kernels
            # need equal widths and fall back to the slow math path otherwise (2-3x slower
            # training on CPU), so pad the values with zeros and drop the padding afterwards (exact).
            d_v = v.shape[-1]
            return self._sdpa(q, k, F.pad(v, (0, q.shape[-1] - d_v)), mask)[..., :d_v]
        if k.shape[1] != q.shape[1]:
            if _sdpa_has_enable_gqa():
                kwargs["enable_gqa"] = True
            else:  # torch < 2.5: expand (a view) and let SDPA copy as it must
                G = q.shape[1] // k.shape[1]
                k = k.repeat_interleave(G, dim=1)
                v = v.repeat_interleave(G, dim=1)
        return F.scaled_dot_product_attention(q, k, v, scale=self.scale, **kwargs)


class Attention(SelfAttention):
    """Multi-head (MHA), grouped-query (GQA) and multi-query attention (MQA): ``n_heads`` query
    heads on ``n_kv_heads`` key/value heads, query head ``h`` reading key/value head ``h //
    group_size``; causal, or bidirectional with ``cfg.causal=False``.

    Heads are split from the fused projections by reshaping ``[batch, pos, head * d]`` to
    ``[batch, pos, head, d]`` and then transposing to ``[batch, head, pos, d]``: head ``h``
    holds columns ``h*d:(h+1)*d`` of every token (``d`` is ``d_qk`` for queries and keys,
    ``d_head`` for values; the two are equal here).

    Options from the config, in forward order: biases on q/k/v (``qkv_bias``), a norm on
    queries and keys (``qk_norm``, after ``hook_q``/``hook_k``), rotary positions on all or the
    first ``rotary_dim`` dimensions (``hook_rot_q``/``hook_rot_k``), then :class:`SelfAttention`'s
    scale, soft-cap and sliding window.

    Raises:
        HeadprobeError: ``cfg`` is MLA (that is :class:`~headprobe.probe.model.latent_attention.LatentAttention`).
    """

    def __init__(
        self, cfg: TransformerConfig, layer: int = 0, n_heads: int | None = None, n_kv_heads: int | None = None
    ):
        """``n_heads``/``n_kv_heads`` (default: the config's) are fewer in a pruned copy
        (:class:`headprobe.probe.model.pruned.PrunedAttention`)."""
        if cfg.is_mla:
            raise HeadprobeError("an MLA config (kv_lora_rank) is attention of its own: use LatentAttention")
        super().__init__(cfg, layer, cfg.n_heads if n_heads is None else n_heads)
        H, KV = self.n_heads, cfg.n_kv_heads if n_kv_heads is None else n_kv_heads
        self.n_kv_heads = KV
        D, d_qk, d_head = cfg.d_model, cfg.d_qk, cfg.d_head
        assert (
            KV is not None and d_head is not None and cfg.qkv_bias is not None
        )  # filled by TransformerConfig.__post_init__
        self.q_proj = nn.Linear(
            D, H * (d_qk + (d_head if cfg.attn_gate else 0)), bias=cfg.qkv_bias
        )  # gate: [q_h, g_h] per head
        self.k_proj = nn.Linear(D, KV * d_qk, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(D, KV * d_head, bias=cfg.qkv_bias)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if cfg.qk_norm == "per_head":  # Qwen3: over each head's d_qk, one weight for all heads
            self.q_norm, self.k_norm = RMSNorm(d_qk, cfg.norm_eps), RMSNorm(d_qk, cfg.norm_eps)
        elif cfg.qk_norm == "full":  # OLMo-2: over the whole projection
            self.q_norm, self.k_norm = RMSNorm(H * d_qk, cfg.norm_eps), RMSNorm(KV * d_qk, cfg.norm_eps)
        rotary_dim = d_qk if cfg.rotary_dim is None else cfg.rotary_dim
        rope = cfg.layer_rope(layer)  # None: learned positions or a NoPE layer
        self.rotary = (
            None
            if rope is None
            else Rotary(rotary_dim, *rope, interleaved=cfg.rotary_interleaved, scaling=rotary_scaling(cfg))
        )
        self.qk_l2 = cfg.qk_l2_norm and self.rotary is not None  # Llama-4: on the rotary layers only
        self.temperature = cfg.attn_temperature if cfg.is_nope(layer) else None
        self._add_output(rotary_hooks=True)

    def qkv(
        self,
        x: Float[Tensor, "batch pos d_model"],
        positions: Int[Tensor, "batch pos"],
        cache: KVCache | StreamingKVCache | None = None,
    ) -> QKV:
        """``q`` ``[batch, head, pos, d_qk]``; ``k``, ``v`` ``[batch, kv_head, k_pos, .]`` of the
        cached positions and this call's (appended to ``cache``)."""
        B, T, _ = x.shape
        H, KV, d_qk, d_head = self.n_heads, self.n_kv_heads, self.cfg.d_qk, self.cfg.d_head
        # Split heads: reshape to [batch, pos, head, d] (head h = columns h*d:(h+1)*d) ...
        q = self.q_proj(x).view(B, T, H, -1)
        if self.cfg.attn_gate:  # Qwen3-Next: each head's query, then its output gate
            q, self._gate = q[..., :d_qk], q[..., d_qk:]
        q = self.hook_q(q)  # [batch, pos, head, d_qk]
        k = self.hook_k(self.k_proj(x).view(B, T, KV, d_qk))  # [batch, pos, kv_head, d_qk]
        v = self.hook_v(self.v_proj(x).view(B, T, KV, d_head))  # [batch, pos, kv_head, d_head]
        if self.cfg.qk_norm == "per_head":
            assert self.q_norm is not None and self.k_norm is not None
            q, k = self.q_norm(q), self.k_norm(k)
        elif self.cfg.qk_norm == "full":
            assert self.q_norm is not None and self.k_norm is not None
            q, k = self.q_norm(q.flatten(2)).view_as(q), self.k_norm(k.flatten(2)).view_as(k)
        if self.rotary is not None:
            q = self.hook_rot_q(self.rotary(q, positions))
            k = self.hook_rot_k(self.rotary(k, positions))
        if self.qk_l2:  # Llama-4: weightless RMSNorm after rotary
            q, k = l2_norm(q, self.cfg.norm_eps), l2_norm(k, self.cfg.norm_eps)
        if self.temperature is not None:  # Llama-4's temperature tuning of NoPE layers
            floor_scale, attn_scale = self.temperature
            scale = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0
            q = (q * scale[:, :, None, None]).to(q.dtype)
        # ... then transpose to [batch, head, pos, d].
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if cache is not None:
            k, v = cache.extend(self.layer, k, v)
        return q, k, v
