"""headprobe's own transformer: one readable decoder-only model with TransformerLens hook points.

One attention class per mechanism, nanoGPT style, on a shared base (:class:`SelfAttention`:
the mask, the two paths below, ``W_O`` and the hook points):

* :class:`Attention` covers multi-head (MHA, ``n_kv_heads == n_heads``), grouped-query (GQA,
  ``1 < n_kv_heads < n_heads``) and multi-query attention (MQA, ``n_kv_heads == 1``). Query
  head ``h`` reads key/value head ``h // group_size`` with ``group_size = n_heads //
  n_kv_heads`` (Ainslie et al. 2023, "GQA", arXiv 2305.13245; Shazeer 2019, "Fast Transformer
  Decoding", arXiv 1911.02150). Keys and values are computed for ``n_kv_heads`` only and never
  copied per query head.
* :class:`LatentAttention` is multi-head latent attention (MLA; DeepSeek-V2, arXiv 2405.04434).

Which keys a query reads (causality, a sliding window, a KV cache's offset, padding) is decided
by one function, :func:`key_mask`. Widths: ``d_head`` is the width of ``z`` and of the values,
``d_qk`` that of a query and a key (the same number except for MLA).

Two attention paths give the same numbers (to 1e-5 in float32):

* the eager path writes the scores and the pattern ``softmax(q k^T / sqrt(d_qk))`` out and
  runs whenever a hook on ``hook_attn_scores`` or ``hook_pattern`` is active (``run_with_cache``
  included), or when ``Transformer.force_eager`` is set;
* otherwise ``torch.nn.functional.scaled_dot_product_attention``, a fused kernel that never
  materialises the ``[q_pos, k_pos]`` pattern.

The architecture options load these families exactly (see :mod:`headprobe.probe.model.convert`):
GPT-2 (learned positions, LayerNorm, GELU with the tanh approximation, biases, tied
unembedding; Radford et al. 2019), Llama / SmolLM2 (rotary positions with Hugging Face's
``rotate_half`` convention, RMSNorm, SwiGLU, no biases, GQA; Touvron et al. 2023), Mistral,
Qwen2, Qwen3, OLMo-2, Gemma-2, GPT-NeoX / Pythia and dense DeepSeek-V3 (MLA), through the
options of :class:`TransformerConfig` (sliding windows, soft-capping, QK-norm, post norms,
parallel blocks, partial rotary, ...). ``mlp=None`` gives attention-only models. The same
model read as an encoder (``causal=False``, ``post_ln``, ``embed_norm``) loads BERT (Devlin et
al. 2019; e.g. sentence-transformers' all-MiniLM-L6-v2).

Every hook point is named as TransformerLens names it and declared with its shape where it is
created. Classes appear in forward order: config, embedding, norms, rotary, attention, MLP,
block, model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

import einops
import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int, Shaped
from torch import Tensor, nn
from transformer_lens import HookedRootModule
from transformer_lens.hook_points import HookPoint

from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.layout.attention import QK_NORM_KINDS, AttentionLayout, KVPolicy, Streaming

# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------


#: ``TransformerConfig.qk_norm`` as headprobe spelled it before it took the layout's names
#: (:data:`~headprobe.probe.layout.attention.QK_NORM_KINDS`); still accepted, read as the new ones.
OLD_QK_NORM = {None: "none", "head": "per_head", "all": "full"}

#: ``TransformerConfig.router``: how router logits become the top-k expert weights (:class:`MoE`).
ROUTERS = ("softmax_topk", "topk_softmax", "topk_sigmoid")

#: Field names of :class:`TransformerConfig` in configs saved before they took the layout's
#: names (checkpoints, pruned models, weights-cache entries): old -> new, mapped by ``from_json``.
OLD_FIELDS = {"head_dim": "d_head"}


@dataclass(frozen=True)
class TransformerConfig:
    """The layout and architecture options of a :class:`Transformer`.

    Widths and QK-norm are named as :class:`~headprobe.probe.layout.attention.AttentionLayout` names
    them, and :attr:`layout` is that layout.

    Attributes:
        n_layers: number of blocks.
        d_model: width of the residual stream.
        n_heads: query heads per layer.
        d_vocab: vocabulary size.
        n_ctx: longest sequence (the size of the learned position table; rotary ignores it).
        n_kv_heads: key/value heads per layer (None: ``n_heads``, i.e. MHA; 1: MQA).
        d_mlp: hidden width of the MLP (None: ``4 * d_model``). Ignored when ``mlp`` is None.
        positional: ``"learned"`` (GPT-2's table added to the embedding) or ``"rotary"`` (RoPE
            applied to queries and keys, Su et al. 2021, arXiv 2104.09864).
        norm: ``"layernorm"`` (GPT-2) or ``"rmsnorm"`` (Llama; Zhang & Sennrich 2019). Gemma's
            ``(1 + w)`` RMSNorm is ``"rmsnorm"`` with the weight ``1 + w`` (see ``convert``).
        mlp: ``"gelu"`` (GPT-2: ``W_out gelu_tanh(W_in x)``), ``"gelu_erf"`` (GPT-NeoX: the
            same with the exact erf GELU), ``"swiglu"`` (Llama: ``W_out (silu(W_gate x) * W_in
            x)``), ``"geglu"`` (Gemma: ``W_out (gelu_tanh(W_gate x) * W_in x)``; Shazeer 2020,
            arXiv 2002.05202), or None for an attention-only model.
        bias: whether the attention and MLP projections have biases (GPT-2 yes, Llama no).
        tied_unembed: the unembedding is the transpose of the embedding (GPT-2, SmolLM2).
        norm_eps: epsilon of the norms.
        rope_theta: base of the rotary frequencies (Llama 2: 1e4, SmolLM2-135M: 1e5).
        final_norm: apply a norm (``ln_final``) before the unembedding.
        kv_lora_rank: MLA (multi-head latent attention, DeepSeek-V2, arXiv 2405.04434): keys
            and values of all heads are reconstructed from one per-token latent of this rank,
            the only thing cached besides the decoupled rotary key. None: MHA/GQA/MQA.
        qk_rope_head_dim: MLA only: width of the decoupled rotary key (shared by all heads) and
            of each head's rotary query part; 0 for none (then use learned positions).
        qk_nope_head_dim: MLA only: width of each head's non-rotary query/key part; None:
            ``d_head``. A query and a key are :attr:`d_qk` ``= qk_nope_head_dim +
            qk_rope_head_dim`` wide, the softmax scale is ``1/sqrt(d_qk)``.
        q_lora_rank: MLA only: queries pass through a per-token latent of this rank, ``W_UQ
            RMSNorm(W_DQ x)`` (DeepSeek-V2 eqs. 12-13); None: one projection ``W_Q x``.
        d_head: width of each head's value, of ``z`` (``hook_z``'s last axis) and of each
            head's block of W_O rows (Hugging Face ``head_dim``, DeepSeek's ``v_head_dim``; saved
            configs before this name: ``head_dim``); None: ``d_model // n_heads`` (Gemma-2, Qwen3
            allow any). A query and a key are :attr:`d_qk` wide: ``d_head`` too except for MLA.
        qkv_bias: whether the query/key/value projections have biases; None: as ``bias``
            (Qwen2: ``bias=False, qkv_bias=True``, biases on q, k, v only).
        rotary_dim: rotary positions act on the first ``rotary_dim`` dimensions of every query and
            key head only, the rest pass unrotated (GPT-NeoX/Pythia: ``rotary_pct * d_qk``);
            None: all of ``d_qk``.
        qk_norm: an RMSNorm on queries and keys after their projections, before rotary, named as
            the layout names it: ``"per_head"`` normalises each head over its ``d_qk`` (Qwen3,
            one weight shared by the heads), ``"full"`` the whole ``n_heads * d_qk`` query and
            ``n_kv_heads * d_qk`` key projection (OLMo-2), ``"none"`` no norm (Dehghani et al.
            2023, arXiv 2302.05442). The old spellings ``"head"``, ``"all"`` and None are
            accepted and stored as these (:data:`OLD_QK_NORM`).
        sliding_window: a query reads only the ``sliding_window`` most recent keys, itself
            included (key ``k`` is read from query ``q`` iff ``q - sliding_window < k <= q``,
            Hugging Face's definition; Mistral, Beltagy et al. 2020); None: all earlier keys.
        sliding_layers: the layers that use ``sliding_window`` (Gemma-2: every other, from 0);
            None: every layer.
        attn_scale: factor of the attention scores ``q k^T``; None: ``1 / sqrt(d_qk)``
            (Gemma-2: ``query_pre_attn_scalar ** -0.5``).
        attn_softcap: scores become ``c * tanh(scores / c)`` before the mask and softmax (Gemma-2's
            attention logit soft-capping, ``c = 50``); None: no cap. Forces the eager path.
        final_softcap: logits become ``c * tanh(logits / c)`` (Gemma-2, ``c = 30``); None: no cap.
        embed_scale: multiply the token embedding by ``sqrt(d_model)`` (Gemma).
        parallel_residual: attention and MLP read the same residual, ``resid_post = resid_pre +
            attn(ln1(resid_pre)) + mlp(ln2(resid_pre))`` (GPT-NeoX/Pythia, GPT-J); the block then
            has no ``hook_resid_mid``.
        pre_norm: normalise the residual before attention and MLP (``ln1``, ``ln2``); False:
            they read the raw residual (OLMo-2).
        post_norm: normalise the attention and MLP outputs before adding them to the residual
            (``ln1_post``, ``ln2_post``; OLMo-2, Gemma-2 with ``pre_norm`` too).
        post_ln: post-LN blocks (BERT; Vaswani et al. 2017): the residual is normalised after
            each addition, ``ln1(resid_pre + attn_out)`` and ``ln2(. + mlp_out)``; needs
            ``pre_norm=False`` and no ``post_norm`` or ``parallel_residual``. Hooks as
            TransformerLens' ``HookedEncoder``: ``hook_resid_mid`` and ``hook_resid_post`` hold the
            sums before the norms, ``hook_normalized_resid_post`` the block's output.
        embed_norm: a LayerNorm on the embedding sum before the first block (``ln_embed``, BERT).
        causal: every query reads only keys at or before it (decoders); False: bidirectional
            attention, every query reads every (non-padding) key (encoders such as BERT; Devlin
            et al. 2019). Not combined with sliding windows or a KV cache.
        attention_chunk: chunked local attention (Llama-4's ``attention_chunk_size``): a query at
            position ``p`` reads only keys at ``k <= p`` with ``k // attention_chunk == p //
            attention_chunk``; None: none.
        chunked_layers: the layers that use ``attention_chunk``; None: every layer.
        qk_l2_norm: a weightless RMSNorm on each query and key head after rotary, on the rotary
            layers only (Llama-4's ``use_qk_norm``, ``Llama4TextL2Norm``, eps ``norm_eps``).
        attn_gate: gated attention (Qwen3-Next): ``q_proj`` gives each head its query and an
            output gate ``g_h`` (``[q_h, g_h]`` per head), and ``z_h`` (``hook_z``) is
            ``sigmoid(g_h) * pattern_h v`` (``sigmoid(g_h)`` at ``hook_gate``), so ``sum_h z_h
            W_O^(h)`` is still the attention output.
        attn_temperature: ``(floor_scale, attn_scale)``: on the NoPE layers queries are scaled by
            ``log1p(floor((p + 1) / floor_scale)) * attn_scale + 1`` at position ``p`` (Llama-4's
            ``attn_temperature_tuning``, arXiv 2501.19399); None: no scaling.
        embedding_multiplier: the token embedding is multiplied by it (Granite); None: not.
        residual_multiplier: Granite's factor of what attention and MLP add to the residual
            stream, recorded for the conversion, which folds it into ``o_proj`` and the MLP's
            ``fc_out`` (so that the heads' results are what the residual receives); the forward
            pass does not apply it again. None: 1.
        n_experts: the MLP of the MoE layers is a mixture of this many gated experts
            (:class:`MoE`; Shazeer et al. 2017, Mixtral); None: dense MLPs only.
        n_experts_per_token: experts each token is routed to (top-k).
        d_expert: hidden width of each expert; None: ``d_mlp``.
        router: how router logits become the top-k weights: ``"softmax_topk"`` (softmax over all
            experts, then top-k; Mixtral, Qwen3-MoE, Qwen3-Next), ``"topk_softmax"`` (top-k logits,
            then softmax over them; GPT-OSS) or ``"topk_sigmoid"`` (sigmoid of the top-k logits; Llama-4).
        router_renorm: ``"softmax_topk"`` only: the k weights are divided by their sum (Mixtral;
            Qwen3-MoE's ``norm_topk_prob``).
        router_bias: the router has a bias (GPT-OSS).
        router_on_input: the weight multiplies the expert's input, not its output (Llama-4).
        expert_bias: the experts' projections have biases (GPT-OSS).
        swiglu_limit: GPT-OSS's clamped SwiGLU in the experts, ``(clamp(up, -l, l) + 1) * g *
            sigmoid(swiglu_alpha * g)`` with ``g = clamp(gate, max=l)``; None: ``act(gate) * up``.
        swiglu_alpha: GPT-OSS's ``alpha`` (with ``swiglu_limit``).
        d_shared_expert: hidden width of an always-on gated expert added to the routed ones
            (Llama-4, Qwen3-Next); None: none.
        shared_expert_gate: the shared expert's output is multiplied by ``sigmoid(w . x)`` (Qwen3-Next).
        moe_layers: the layers whose MLP is the mixture; None: every layer (with ``n_experts``).
        linear_layers: the layers whose token mixer is linear attention (Qwen3-Next's Gated
            DeltaNet, :class:`LinearAttention`) instead of heads; None: none. They have no heads
            and no attention hook points; heads keep the model's own layer numbers.
        linear_mixer: the Hugging Face config fields that build those layers' module
            (``model_type`` and the ``linear_*`` sizes); given with ``linear_layers``.
        rope_thetas: per-layer rotary bases, ``n_layers`` entries (``positional="rotary"``); an
            entry None is a layer without positions (NoPE: no rotary, no ``hook_rot_q``/``hook_rot_k``;
            SmolLM3's ``no_rope_layers``, Cohere2's full layers); None: ``rope_theta`` on every
            layer (Gemma-3: ``rope_local_base_freq`` on sliding layers, ``rope_theta`` on global ones).
        rope_factors: per-layer linear rotary scaling, ``n_layers`` entries: ``inv_freq / factor``
            (Hugging Face's ``rope_type="linear"``, position interpolation, Chen et al. 2023, arXiv
            2306.15595; Gemma-3's global layers); None: 1 on every layer.
        rotary_interleaved: rotary pairs adjacent dimensions ``(2i, 2i+1)`` (Cohere's
            ``rotate_half``, the angles repeated per pair); False: ``i`` with ``i + dim/2`` (Llama).
        logit_scale: the logits are multiplied by it after the unembedding (Cohere's
            ``logit_scale``; Granite's ``1 / logits_scaling``); None: 1.
        attn_sinks: every head has a learned sink logit ``attn.sinks`` ``[head]`` (GPT-OSS): the
            softmax runs over ``[scores, sink]`` and the sink's column is dropped, so a pattern
            row sums to ``1 - sink mass`` and the sink adds nothing to ``z``.
        yarn_factor: YaRN rotary scaling (Peng et al. 2023, arXiv 2309.00071; Hugging Face's
            ``_compute_yarn_parameters``): the frequencies are blended between ``inv_freq`` and
            ``inv_freq / yarn_factor`` over the dimensions between the corrections of
            ``yarn_beta`` (fast, slow) rotations in ``yarn_original_ctx`` positions (rounded out
            with ``yarn_truncate``), and ``cos``/``sin`` are multiplied by
            ``yarn_attention_factor`` (None: ``0.1 ln(factor) + 1``). None: plain rotary.

    ``n_kv_heads``, ``d_mlp``, ``qkv_bias``, ``d_head`` (and for MLA ``qk_nope_head_dim``) given
    as None hold their derived value after construction.

    Raises:
        HeadprobeError: ``d_model`` is not a multiple of ``n_heads`` (without ``d_head``), or
            ``n_heads`` is not a multiple of ``n_kv_heads``, or an option has an unknown value.
    """

    n_layers: int
    d_model: int
    n_heads: int
    d_vocab: int
    n_ctx: int = 1024
    n_kv_heads: int | None = None
    d_mlp: int | None = None
    positional: Literal["learned", "rotary"] = "learned"
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    mlp: Literal["gelu", "gelu_erf", "swiglu", "geglu"] | None = "gelu"
    bias: bool = True
    tied_unembed: bool = True
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    final_norm: bool = True
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int | None = None
    q_lora_rank: int | None = None
    d_head: int | None = None
    qkv_bias: bool | None = None
    rotary_dim: int | None = None
    qk_norm: Literal["none", "per_head", "full", "head", "all"] | None = "none"  # old spellings stored as new
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] | None = None
    attn_scale: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    embed_scale: bool = False
    parallel_residual: bool = False
    pre_norm: bool = True
    post_norm: bool = False
    post_ln: bool = False
    embed_norm: bool = False
    causal: bool = True
    attention_chunk: int | None = None
    chunked_layers: tuple[int, ...] | None = None
    qk_l2_norm: bool = False
    attn_temperature: tuple[float, float] | None = None
    attn_gate: bool = False
    embedding_multiplier: float | None = None
    residual_multiplier: float | None = None
    n_experts: int | None = None
    n_experts_per_token: int = 2
    d_expert: int | None = None
    router: Literal["softmax_topk", "topk_softmax", "topk_sigmoid"] = "softmax_topk"
    router_renorm: bool = True
    router_bias: bool = False
    router_on_input: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    d_shared_expert: int | None = None
    shared_expert_gate: bool = False
    moe_layers: tuple[int, ...] | None = None
    linear_layers: tuple[int, ...] | None = None
    linear_mixer: dict[str, Any] | None = dataclasses.field(default=None, hash=False)
    rope_thetas: tuple[float | None, ...] | None = None
    rope_factors: tuple[float, ...] | None = None
    rotary_interleaved: bool = False
    logit_scale: float | None = None
    attn_sinks: bool = False
    yarn_factor: float | None = None
    yarn_original_ctx: int = 4096
    yarn_beta: tuple[float, float] = (32.0, 1.0)
    yarn_truncate: bool = True
    yarn_attention_factor: float | None = None

    def __post_init__(self) -> None:
        if self.qk_norm in OLD_QK_NORM:
            object.__setattr__(self, "qk_norm", OLD_QK_NORM[self.qk_norm])
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.d_mlp is None:
            object.__setattr__(self, "d_mlp", 4 * self.d_model)
        if self.qkv_bias is None:
            object.__setattr__(self, "qkv_bias", self.bias)
        for field in ("sliding_layers", "chunked_layers", "linear_layers"):  # JSON gives a list
            if getattr(self, field) is not None:
                object.__setattr__(self, field, tuple(int(l) for l in getattr(self, field)))
        if self.attn_temperature is not None:
            object.__setattr__(self, "attn_temperature", tuple(float(x) for x in self.attn_temperature))
        object.__setattr__(self, "yarn_beta", tuple(float(b) for b in self.yarn_beta))
        assert self.n_kv_heads is not None  # filled above
        if min(self.n_layers, self.d_model, self.n_heads, self.n_kv_heads, self.d_vocab, self.n_ctx) < 1:
            raise HeadprobeError(f"config sizes must be positive: {self}")
        if self.d_head is None and self.d_model % self.n_heads:
            raise HeadprobeError(f"d_model={self.d_model} is not a multiple of n_heads={self.n_heads}")
        if self.d_head is None:
            object.__setattr__(self, "d_head", self.d_model // self.n_heads)
        assert self.d_head is not None  # filled above
        if self.d_head < 1:
            raise HeadprobeError(f"d_head must be positive, got {self.d_head}")
        if self.n_heads % self.n_kv_heads:
            raise HeadprobeError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        for field, value, allowed in (
            ("positional", self.positional, ("learned", "rotary")),
            ("norm", self.norm, ("layernorm", "rmsnorm")),
            ("mlp", self.mlp, ("gelu", "gelu_erf", "swiglu", "geglu", None)),
            ("qk_norm", self.qk_norm, QK_NORM_KINDS),
        ):
            if value not in allowed:
                raise HeadprobeError(f"config {field}={value!r} is not one of {allowed}")
        self._check_mla()
        self._check_layer_rope()
        if self.rotary_dim is not None and not (0 < self.rotary_dim <= self.d_qk and self.rotary_dim % 2 == 0):
            raise HeadprobeError(f"rotary_dim must be even and in (0, d_qk={self.d_qk}], got {self.rotary_dim}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise HeadprobeError(f"sliding_window must be positive, got {self.sliding_window}")
        if self.sliding_layers is not None and any(not 0 <= l < self.n_layers for l in self.sliding_layers):
            raise HeadprobeError(f"sliding_layers {self.sliding_layers} out of range for {self.n_layers} layers")
        for field in ("attn_softcap", "final_softcap", "attn_scale"):
            if getattr(self, field) is not None and not getattr(self, field) > 0:
                raise HeadprobeError(f"{field} must be positive, got {getattr(self, field)}")
        if self.parallel_residual and self.post_norm:
            raise HeadprobeError("parallel_residual with post_norm is not implemented")
        if self.post_ln and (self.pre_norm or self.post_norm or self.parallel_residual):
            raise HeadprobeError("post_ln (BERT's post-LN blocks) needs pre_norm=False, post_norm=False and parallel_residual=False")
        if not self.causal and (self.sliding_window is not None or self.attention_chunk is not None):
            raise HeadprobeError("bidirectional attention (causal=False) with a sliding window or chunks is not implemented")
        if self.attention_chunk is not None and self.attention_chunk < 1:
            raise HeadprobeError(f"attention_chunk must be positive, got {self.attention_chunk}")
        if any(not 0 <= l < self.n_layers for l in self.chunked_layers or ()):
            raise HeadprobeError(f"chunked_layers {self.chunked_layers} out of range for {self.n_layers} layers")
        if not self.causal and self.sliding_window is not None:
            raise HeadprobeError("bidirectional attention (causal=False) with a sliding window is not implemented")
        if self.yarn_factor is not None and not (self.yarn_factor > 0 and self.positional == "rotary"):
            raise HeadprobeError(f"yarn_factor needs rotary positions and a positive factor, got {self.yarn_factor}")
        if self.attn_sinks and self.is_mla:
            raise HeadprobeError("learned attention sinks (attn_sinks) are implemented for MHA/GQA/MQA, not MLA")
        for field in ("embedding_multiplier", "residual_multiplier"):
            if getattr(self, field) is not None and not getattr(self, field) > 0:
                raise HeadprobeError(f"{field} must be positive, got {getattr(self, field)}")
        self._check_moe()

    def _check_moe(self) -> None:
        """The mixture-of-experts fields: sizes in range, a gated MLP, known router; fills
        ``d_expert`` (None: ``d_mlp``)."""
        if self.moe_layers is not None:  # JSON gives a list
            object.__setattr__(self, "moe_layers", tuple(int(l) for l in self.moe_layers))
        if self.n_experts is None:
            if self.moe_layers is not None or self.d_shared_expert is not None:
                raise HeadprobeError("moe_layers and d_shared_expert describe a mixture of experts; give n_experts too")
            return
        if self.d_expert is None:
            object.__setattr__(self, "d_expert", self.d_mlp)
        assert self.d_expert is not None  # filled above
        if not 1 <= self.n_experts_per_token <= self.n_experts or min(self.d_expert, self.d_shared_expert or 1) < 1:
            raise HeadprobeError(f"a mixture of experts needs 1 <= n_experts_per_token <= n_experts and positive widths, "
                                 f"got {self.n_experts_per_token} of {self.n_experts}")
        if self.mlp not in ("swiglu", "geglu"):
            raise HeadprobeError(f"experts are gated MLPs (mlp swiglu or geglu), not {self.mlp}")
        if self.router not in ROUTERS:
            raise HeadprobeError(f"config router={self.router!r} is not one of {ROUTERS}")
        if self.moe_layers is not None and any(not 0 <= l < self.n_layers for l in self.moe_layers):
            raise HeadprobeError(f"moe_layers {self.moe_layers} out of range for {self.n_layers} layers")
        if self.swiglu_limit is not None and not self.swiglu_limit > 0:
            raise HeadprobeError(f"swiglu_limit must be positive, got {self.swiglu_limit}")
        if (self.linear_layers is None) != (self.linear_mixer is None):
            raise HeadprobeError("linear_layers and linear_mixer come together")
        if self.linear_layers is not None and any(not 0 <= l < self.n_layers for l in self.linear_layers):
            raise HeadprobeError(f"linear_layers {self.linear_layers} out of range for {self.n_layers} layers")

    def is_linear(self, layer: int) -> bool:
        """Whether layer ``layer`` mixes tokens by linear attention (no heads; ``linear_layers``)."""
        return self.linear_layers is not None and layer in self.linear_layers

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers with heads, in order (every layer but ``linear_layers``)."""
        return tuple(l for l in range(self.n_layers) if not self.is_linear(l))

    def is_moe(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is the mixture of experts."""
        return self.n_experts is not None and (self.moe_layers is None or layer in self.moe_layers)

    def _check_mla(self) -> None:
        """The MLA fields: all or none, sizes positive, no option MLA is not implemented with;
        fills ``qk_nope_head_dim`` (None: ``d_head``)."""
        if self.kv_lora_rank is None:
            if self.qk_rope_head_dim or self.qk_nope_head_dim is not None or self.q_lora_rank is not None:
                raise HeadprobeError("qk_rope_head_dim, qk_nope_head_dim and q_lora_rank describe MLA; give kv_lora_rank too")
            return
        if self.qk_nope_head_dim is None:
            object.__setattr__(self, "qk_nope_head_dim", self.d_head)
        if self.kv_lora_rank < 1 or self.qk_rope_head_dim < 0 or self.qk_rope_head_dim % 2:
            raise HeadprobeError(f"MLA needs kv_lora_rank >= 1 and an even qk_rope_head_dim >= 0, got "
                                 f"{self.kv_lora_rank} and {self.qk_rope_head_dim}")
        if self.n_kv_heads != self.n_heads:
            raise HeadprobeError(f"MLA reconstructs keys and values for every head: n_kv_heads={self.n_kv_heads} "
                                 f"must equal n_heads={self.n_heads}")
        if self.positional == "rotary" and self.qk_rope_head_dim == 0:
            raise HeadprobeError("MLA with rotary positions needs qk_rope_head_dim > 0 (the decoupled rotary key)")
        if self.bias:
            raise HeadprobeError("MLA is implemented without biases (DeepSeek-V2); pass bias=False")
        if self.qk_norm != "none" or self.rotary_dim is not None or self.sliding_window or self.attn_softcap or self.attn_gate:
            raise HeadprobeError("MLA is implemented without qk_norm, rotary_dim, sliding windows, soft-capping and gates")
        assert self.qk_nope_head_dim is not None  # filled above
        if min(self.qk_nope_head_dim, self.q_lora_rank or 1) < 1:
            raise HeadprobeError(f"MLA needs positive qk_nope_head_dim and q_lora_rank, got "
                                 f"{self.qk_nope_head_dim} and {self.q_lora_rank}")

    def _check_layer_rope(self) -> None:
        """``rope_thetas``/``rope_factors``: tuples (JSON gives lists) of ``n_layers`` positive
        entries (``rope_thetas`` also None), on a rotary model; ``logit_scale`` positive."""
        for field in ("rope_thetas", "rope_factors"):
            values = getattr(self, field)
            if values is None:
                continue
            values = tuple(None if v is None else float(v) for v in values)
            object.__setattr__(self, field, values)
            if len(values) != self.n_layers or any(not v > 0 if v is not None else field == "rope_factors" for v in values):
                raise HeadprobeError(f"{field} must hold {self.n_layers} positive values, got {values}")
            if self.positional != "rotary" or self.is_mla:
                raise HeadprobeError(f"{field} needs rotary positions (positional='rotary', not MLA)")
        if self.rotary_interleaved and (self.positional != "rotary" or self.is_mla):
            raise HeadprobeError("rotary_interleaved needs rotary positions (positional='rotary', not MLA)")
        if self.logit_scale is not None and not self.logit_scale > 0:
            raise HeadprobeError(f"logit_scale must be positive, got {self.logit_scale}")

    def layer_rope(self, layer: int) -> tuple[float, float] | None:
        """Layer ``layer``'s rotary ``(base, linear factor)``, or None where it has no positions
        (learned positions, or a NoPE entry of ``rope_thetas``)."""
        if self.positional != "rotary":
            return None
        theta = self.rope_theta if self.rope_thetas is None else self.rope_thetas[layer]
        factor = 1.0 if self.rope_factors is None else self.rope_factors[layer]
        return None if theta is None else (theta, factor)

    @property
    def is_mla(self) -> bool:
        """Whether attention is multi-head latent attention (``kv_lora_rank`` is set)."""
        return self.kv_lora_rank is not None

    @property
    def d_qk(self) -> int:
        """Width of each head's query and key: ``qk_nope_head_dim + qk_rope_head_dim`` for MLA
        (DeepSeek-V2 eq. 16), else ``d_head`` (the layout's :attr:`~AttentionLayout.d_qk`)."""
        assert self.d_head is not None  # filled by __post_init__, as qk_nope_head_dim for MLA
        if self.is_mla:
            assert self.qk_nope_head_dim is not None
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.d_head

    def is_sliding(self, layer: int) -> bool:
        """Whether layer ``layer`` attends within ``sliding_window`` only."""
        return self.sliding_window is not None and (self.sliding_layers is None or layer in self.sliding_layers)

    def is_chunked(self, layer: int) -> bool:
        """Whether layer ``layer`` attends within its ``attention_chunk`` only."""
        return self.attention_chunk is not None and (self.chunked_layers is None or layer in self.chunked_layers)

    def is_nope(self, layer: int) -> bool:
        """Whether layer ``layer`` has no rotary positions (a NoPE layer of a rotary model: a None
        entry of ``rope_thetas``)."""
        return self.positional == "rotary" and self.layer_rope(layer) is None

    @property
    def group_size(self) -> int:
        """Query heads per key/value head: ``n_heads // n_kv_heads``."""
        assert self.n_kv_heads is not None  # filled by __post_init__
        return self.n_heads // self.n_kv_heads

    @classmethod
    def from_json(cls, fields: dict) -> TransformerConfig:
        """The config whose ``dataclasses.asdict`` is ``fields`` after a JSON round trip (JSON
        turns the tuple fields, e.g. ``sliding_layers``, into lists; they come back as tuples).
        Configs saved under the old names (:data:`OLD_FIELDS`, :data:`OLD_QK_NORM`: checkpoints,
        pruned models and weights-cache entries written before) are read as the new ones.

        Raises:
            TypeError: a field the config does not have. HeadprobeError: as the constructor.
        """
        kwargs: dict[str, Any] = {OLD_FIELDS.get(k, k): tuple(v) if isinstance(v, list) else v for k, v in fields.items()}
        return cls(**kwargs)

    @property
    def layout(self) -> AttentionLayout:
        """The attention layout of this config (:class:`~headprobe.probe.layout.attention.AttentionLayout`),
        the one place a model config becomes a layout: what a loaded native model's
        ``spec.layout`` is and what the cost formulas (:mod:`headprobe.probe.layout.cost`) take.

        The widths, MLA sizes and ``qk_norm`` are this config's, under the same names. Biases:
        ``"all"`` (``bias`` with ``qkv_bias``), ``"qkv"``, ``"out"`` (W_O only) or ``"none"``.
        Windows: ``sliding_window`` on :meth:`is_sliding` layers, ``attention_chunk`` on :meth:`is_chunked` ones. ``bytes_per_element`` is the
        layout's default (2); ``name`` is empty.
        """
        bias = {(True, True): "all", (False, True): "qkv", (True, False): "out", (False, False): "none"}[
            (bool(self.bias), bool(self.qkv_bias))]
        windows = tuple(self.sliding_window if self.is_sliding(l) else self.attention_chunk if self.is_chunked(l) else None
                        for l in range(self.n_layers))  # a chunked layer caches at most a chunk, as layout_from_hf_config
        common: dict[str, Any] = dict(d_model=self.d_model, n_layers=self.n_layers, n_heads=self.n_heads, d_head=self.d_head,
                      bias=bias, windows=windows, sinks=self.attn_sinks,
                      head_layers=None if self.linear_layers is None else self.attention_layers)
        if self.is_mla:
            return AttentionLayout(kv_lora_rank=self.kv_lora_rank, q_lora_rank=self.q_lora_rank,
                                   qk_rope_head_dim=self.qk_rope_head_dim, qk_nope_head_dim=self.qk_nope_head_dim,
                                   **common)
        assert self.qk_norm is not None  # None is read as "none" by __post_init__
        return AttentionLayout(n_kv_heads=self.n_kv_heads, qk_norm=self.qk_norm, output_gate=self.attn_gate, **common)


# --------------------------------------------------------------------------------------------
# Embedding and norms
# --------------------------------------------------------------------------------------------


class Embedding(nn.Module):
    """Token embedding ``W_E`` (times ``sqrt(d_model)`` with ``embed_scale``, as Gemma, the
    factor rounded to the weights' dtype; times ``embedding_multiplier``, Granite) and, for ``positional="learned"``, the position table
    ``W_pos``.

    Returns the two terms separately so that the model's root hook points ``hook_embed`` and
    ``hook_pos_embed`` (TransformerLens' names) see each.
    """

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.W_E = nn.Embedding(cfg.d_vocab, cfg.d_model)
        self.W_pos = nn.Embedding(cfg.n_ctx, cfg.d_model) if cfg.positional == "learned" else None
        self.scale = cfg.d_model ** 0.5 if cfg.embed_scale else None
        self.multiplier = cfg.embedding_multiplier

    def forward(
        self, tokens: Int[Tensor, "batch pos"], positions: Int[Tensor, "batch pos"]
    ) -> tuple[Float[Tensor, "batch pos d_model"], Float[Tensor, "batch pos d_model"] | None]:
        tok = self.W_E(tokens)
        if self.scale is not None:
            tok = tok * torch.tensor(self.scale, dtype=tok.dtype, device=tok.device)
        if self.multiplier is not None:  # Granite: inputs_embeds * embedding_multiplier
            tok = tok * self.multiplier
        return tok, None if self.W_pos is None else self.W_pos(positions)


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * w``, computed in float32 as Hugging Face's ``LlamaRMSNorm``."""

    def __init__(self, d_model: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d_model))
        self.eps = eps

    def forward(self, x: Float[Tensor, "... d_model"]) -> Float[Tensor, "... d_model"]:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def l2_norm(x: Float[Tensor, "... d"], eps: float) -> Float[Tensor, "... d"]:
    """``x / sqrt(mean(x^2) + eps)`` over the last axis in float32, no weight (Llama-4's
    ``Llama4TextL2Norm``)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


def make_norm(cfg: TransformerConfig, width: int | None = None) -> nn.Module:
    """``nn.LayerNorm`` or :class:`RMSNorm` (``cfg.norm``) over ``width`` (default ``d_model``)."""
    width = cfg.d_model if width is None else width
    return nn.LayerNorm(width, eps=cfg.norm_eps) if cfg.norm == "layernorm" else RMSNorm(width, cfg.norm_eps)


class Norm(nn.Module):
    """LayerNorm or RMSNorm (``cfg.norm``), followed by ``hook_normalized``."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.norm = make_norm(cfg)
        self.hook_normalized = HookPoint()  # [batch, pos, d_model]

    def forward(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        return self.hook_normalized(self.norm(x))


class PostNorm(nn.Module):
    """The norm of a branch's output before it joins the residual stream (``cfg.post_norm``;
    OLMo-2, Gemma-2), between ``hook_in`` and ``hook_out`` (the names TransformerLens' bridge
    gives ``ln1_post``/``ln2_post``, which :func:`headprobe.probe.hooks.capture.capture_internal`
    reads). Called on any ``[..., d_model]`` tensor it returns the normed tensor."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.norm = make_norm(cfg)
        self.hook_in = HookPoint()  # [batch, pos, d_model], the branch output
        self.hook_out = HookPoint()  # [batch, pos, d_model], what joins the residual stream

    def forward(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        return self.hook_out(self.norm(self.hook_in(x)))


# --------------------------------------------------------------------------------------------
# Rotary positions
# --------------------------------------------------------------------------------------------


def rotate_half(x: Float[Tensor, "... d_head"]) -> Float[Tensor, "... d_head"]:
    """``[x1, x2] -> [-x2, x1]`` on the two halves of the last axis (Hugging Face's RoPE layout,
    which pairs dimension ``i`` with ``i + d_head/2``, not adjacent dimensions)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_pairs(x: Float[Tensor, "... d_head"]) -> Float[Tensor, "... d_head"]:
    """``(x_2i, x_2i+1) -> (-x_2i+1, x_2i)`` on adjacent pairs of the last axis (the interleaved
    RoPE layout of the original paper and of Hugging Face's Cohere ``rotate_half``)."""
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


@dataclass(frozen=True)
class YaRN:
    """YaRN's rotary scaling (Peng et al. 2023, arXiv 2309.00071), as Hugging Face's
    ``_compute_yarn_parameters`` computes it: see :class:`TransformerConfig` ``yarn_factor``."""

    factor: float
    original_ctx: int
    beta_fast: float
    beta_slow: float
    truncate: bool
    attention_factor: float

    @classmethod
    def of(cls, cfg: TransformerConfig) -> YaRN | None:
        """The config's YaRN scaling, or None (plain rotary)."""
        if cfg.yarn_factor is None:
            return None
        f = cfg.yarn_factor
        attention = cfg.yarn_attention_factor
        if attention is None:
            attention = 0.1 * math.log(f) + 1.0 if f > 1 else 1.0
        return cls(f, cfg.yarn_original_ctx, cfg.yarn_beta[0], cfg.yarn_beta[1], cfg.yarn_truncate, float(attention))

    def blend(self, pos_freqs: Float[Tensor, " half_dim"], dim: int, theta: float) -> Float[Tensor, " half_dim"]:
        """``inv_freq = 1 / pos_freqs`` blended with ``1 / (factor pos_freqs)`` by the linear ramp between the correction
        dimensions of ``beta_fast`` and ``beta_slow`` rotations (extrapolated above, interpolated below)."""
        def correction(rotations: float) -> float:
            return dim * math.log(self.original_ctx / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = correction(self.beta_fast), correction(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # as Hugging Face: no division by zero
        ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=pos_freqs.device) - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp
        return 1.0 / (self.factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation


class Rotary(nn.Module):
    """Rotary position embedding (Su et al. 2021) in the convention of ``transformers``' Llama:
    ``inv_freq_i = theta^(-2i/dim)``, angle ``pos * inv_freq`` repeated over both halves,
    ``x_rot = x cos + rotate_half(x) sin``. Frequencies and angles in float32 whatever the weights' dtype
    (as Hugging Face's reference); ``cos``/``sin`` are cast to the dtype of ``x`` for the rotation.

    With ``dim`` below the head width only the first ``dim`` dimensions of each head rotate
    and the rest pass through (GPT-NeoX's partial rotary, ``rotary_pct``). ``factor`` divides the
    frequencies (linear scaling); ``interleaved`` rotates adjacent pairs (:func:`rotate_pairs`,
    the angles repeated per pair) instead of halves."""

    def __init__(self, dim: int, theta: float, factor: float = 1.0, interleaved: bool = False, yarn: YaRN | None = None):
        super().__init__()
        self.dim = dim
        self.theta = theta
        self.factor = factor
        self.interleaved = interleaved
        self.yarn = yarn
        self.attention_factor = 1.0 if yarn is None else yarn.attention_factor
        self.register_buffer("inv_freq", self.frequencies(), persistent=False)

    def _apply(self, fn, recurse=True):
        """Moves and casts (``.to(device)``, ``.to(torch.bfloat16)``, ...) apply as to any module,
        except that ``inv_freq`` stays float32, recomputed on its new device: cast to bfloat16
        the frequencies keep 3 significant digits and the angle at position 8,000 would be off by
        several radians. Hugging Face's reference keeps them float32 when it loads a model in
        half precision; so do we."""
        super()._apply(fn, recurse)
        if self.inv_freq.dtype != torch.float32:
            self.inv_freq = self.frequencies().to(self.inv_freq.device)
        return self

    def frequencies(self) -> Float[Tensor, " half_dim"]:
        """``inv_freq_i = theta^(-2i/dim) / factor``, float32 on the CPU (a fresh tensor)."""
        arange = torch.arange(0, self.dim, 2, dtype=torch.int64, device="cpu")
        pos_freqs = self.theta ** (arange.float() / self.dim)
        if self.yarn is not None:
            return self.yarn.blend(pos_freqs, self.dim, self.theta)
        inv_freq = 1.0 / pos_freqs
        return inv_freq if self.factor == 1.0 else inv_freq / self.factor

    def forward(
        self,
        x: Float[Tensor, "batch pos head d_head"],
        positions: Int[Tensor, "batch pos"],
    ) -> Float[Tensor, "batch pos head d_head"]:
        if x.shape[-1] > self.dim:
            return torch.cat((self(x[..., :self.dim], positions), x[..., self.dim:]), dim=-1)
        angles = positions[..., None].float() * self.inv_freq  # [batch, pos, dim/2]
        if self.interleaved:
            angles = angles.repeat_interleave(2, dim=-1)[:, :, None, :]  # [batch, pos, 1, dim]
        else:
            angles = torch.cat((angles, angles), dim=-1)[:, :, None, :]  # [batch, pos, 1, dim]
        cos, sin = angles.cos(), angles.sin()
        if self.attention_factor != 1.0:  # YaRN: as Hugging Face, on cos and sin in float32
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        return x * cos + (rotate_pairs(x) if self.interleaved else rotate_half(x)) * sin


# --------------------------------------------------------------------------------------------
# Attention: what every mechanism shares (masks, cache, eager/fused paths, W_O, hooks), then
# one class per mechanism: Attention (MHA/GQA/MQA) and LatentAttention (MLA)
# --------------------------------------------------------------------------------------------


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
        q_chunk = pos[..., n_keys - n_queries:, None]  # [q_pos, 1] | [batch, q_pos, 1]
        mask = mask & (pos[..., None, :] == q_chunk if padding is None else (pos[:, None, :] == q_chunk)[:, None])
    if padding is not None:
        mask = (mask & padding[:, None, None, :]) | (j == i)
    return mask


@dataclass
class KVCache:
    """Keys and values of the tokens seen so far, per layer, for generation.

    ``keys[l]`` and ``values[l]`` are ``[batch, kv_head, pos, d_qk]`` and ``[batch, kv_head, pos,
    d_head]`` (keys after rotary), so a GQA/MQA cache holds ``n_kv_heads`` heads, never copies per
    query head; an MLA layer (:class:`LatentAttention`) caches its latent ``c^KV`` ``[batch, 1,
    pos, kv_lora_rank]`` as ``keys`` and the rotary key ``k^R`` ``[batch, 1, pos,
    qk_rope_head_dim]`` as ``values``. Filled by :meth:`Transformer.forward` when passed as
    ``cache``; start with ``KVCache()``.
    """

    keys: list[Tensor] = dataclasses.field(default_factory=list)
    values: list[Tensor] = dataclasses.field(default_factory=list)

    @property
    def n_tokens(self) -> int:
        """Positions cached (0 when empty)."""
        return self.keys[0].shape[2] if self.keys else 0

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds: ``n_layers * batch * n_kv_heads * pos * (d_qk + d_head) *
        element size`` (MLA: ``n_layers * batch * pos * (kv_lora_rank + qk_rope_head_dim) *
        element size``), the quantity :func:`headprobe.probe.layout.cost.kv_bytes_per_request` predicts."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def extend(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append this step's ``k``/``v`` (``[batch, kv_head, new_pos, .]``) to layer ``layer``'s
        cache and return all keys and values so far."""
        if layer == len(self.keys):
            self.keys.append(k)
            self.values.append(v)
        else:
            self.keys[layer] = torch.cat([self.keys[layer], k], dim=2)
            self.values[layer] = torch.cat([self.values[layer], v], dim=2)
        return self.keys[layer], self.values[layer]


#: The most mask entries (``head x q_pos x k_pos``) one block of queries builds under a KV policy.
STREAMING_MASK_ENTRIES = 2**24


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
    slot of a :class:`StreamingKVCache`), and, for a :class:`~headprobe.probe.layout.attention.Streaming`
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


@dataclass
class StreamingKVCache:
    """The KV cache of a head-level policy: each KV group keeps only what its queries will read.

    ``keys[l][g]`` and ``values[l][g]`` are ``[batch, pos_kept, .]`` tensors of layer ``l``'s group
    ``g`` (a key/value head's keys after rotary and values; MLA: the latent ``c^KV`` and the rotary
    key ``k^R``, one group per layer), and ``positions[l][g]`` their positions. A full group keeps
    every position; a :class:`~headprobe.probe.layout.attention.Streaming` group keeps the first ``sink``
    and the ``window`` most recent ones (those its latest query read), so after ``T`` tokens it
    holds ``min(T, sink + window)`` (a full group of a sliding-window layer, ``min(T, window_l)``; a
    streaming one there, what both masks leave, :func:`headprobe.probe.layout.cost.streaming_positions`): :func:`headprobe.probe.layout.cost.policy_cost` predicts
    :attr:`nbytes`. Keys are cached after rotary with their original positions, so the kept
    keys give exactly the attention of :func:`streaming_key_mask` (no re-positioning).
    """

    policy: KVPolicy
    windows: tuple[int | None, ...] | None = None  # the layers' sliding windows (a full group there keeps its window)
    keys: list[list[Tensor]] = dataclasses.field(default_factory=list)
    values: list[list[Tensor]] = dataclasses.field(default_factory=list)
    positions: list[list[Tensor]] = dataclasses.field(default_factory=list)
    seen: list[int] = dataclasses.field(default_factory=list)
    key_positions: list[Tensor] = dataclasses.field(default_factory=list)

    @property
    def n_tokens(self) -> int:
        """Tokens seen so far (positions of the next token start here), not positions kept."""
        return self.seen[0] if self.seen else 0

    @property
    def nbytes(self) -> int:
        """Bytes of the cached keys and values (the position indices are bookkeeping, not counted)."""
        return sum(t.numel() * t.element_size() for layer in (*self.keys, *self.values) for t in layer)

    def extend(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append ``k``/``v`` (``[batch, group, new_pos, .]``); return every group's kept and new
        keys and values, ``[batch, group, k_pos, .]`` zero-padded to the longest group (its
        positions, -1 in padding, in ``key_positions[layer]``), then evict what no later query reads."""
        B, G, new = k.shape[:3]
        if layer == len(self.keys):
            self.keys.append([k[:, g, :0] for g in range(G)])
            self.values.append([v[:, g, :0] for g in range(G)])
            self.positions.append([torch.zeros(0, dtype=torch.long, device=k.device)] * G)
            self.seen.append(0)
        past = self.seen[layer]
        new_pos = torch.arange(past, past + new, device=k.device)
        ks = [torch.cat([self.keys[layer][g], k[:, g]], 1) for g in range(G)]
        vs = [torch.cat([self.values[layer][g], v[:, g]], 1) for g in range(G)]
        ps = [torch.cat([self.positions[layer][g], new_pos]) for g in range(G)]
        L = max(p.numel() for p in ps)
        k_out, v_out = k.new_zeros(B, G, L, k.shape[-1]), v.new_zeros(B, G, L, v.shape[-1])
        p_out = torch.full((G, L), -1, dtype=torch.long, device=k.device)
        for g in range(G):
            n = ps[g].numel()
            k_out[:, g, :n], v_out[:, g, :n], p_out[g, :n] = ks[g], vs[g], ps[g]
        last = past + new - 1
        layer_window = self.windows[layer] if self.windows else None
        for g, spec in enumerate(self.policy.groups[layer]):
            if spec is None and layer_window is None:
                continue
            keep = torch.ones_like(ps[g], dtype=torch.bool)
            if spec is not None:
                keep = (ps[g] < spec.sink) | (ps[g] > last - spec.window)
            if layer_window is not None:  # a sliding layer's group, full or streaming, keeps its window at most
                keep = keep & (ps[g] > last - layer_window)
            ks[g], vs[g], ps[g] = ks[g][:, keep].clone(), vs[g][:, keep].clone(), ps[g][keep]
        self.keys[layer], self.values[layer], self.positions[layer] = ks, vs, ps
        self.seen[layer] = past + new
        if layer == len(self.key_positions):
            self.key_positions.append(p_out)
        self.key_positions[layer] = p_out
        return k_out, v_out


@functools.cache
def _sdpa_has_enable_gqa() -> bool:
    """``scaled_dot_product_attention(..., enable_gqa=True)`` exists from torch 2.5 on (it is a
    builtin without a Python signature, so the version decides)."""
    major, minor = (int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    return (major, minor) >= (2, 5)


#: What :meth:`SelfAttention.qkv` returns: queries, keys and values, heads before positions.
QKV = tuple[Float[Tensor, "batch head q_pos d_qk"], Float[Tensor, "batch kv_head k_pos d_qk"],
            Float[Tensor, "batch kv_head k_pos d_head"]]


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


class SelfAttention(nn.Module):
    """What every attention mechanism shares; a subclass adds its projections and :meth:`qkv`.

    The forward pass is ``qkv`` (queries ``[batch, head, q_pos, d_qk]``, keys ``[batch,
    kv_head, k_pos, d_qk]``, values ``[batch, kv_head, k_pos, d_head]``, the KV cache extended),
    then :meth:`attend` (the :func:`key_mask` of causality, this layer's sliding window and
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
        self._gate: Tensor | None = None  # this forward's output gate [batch, pos, head, d_head] (attn_gate), set by qkv

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
        self.hook_pattern = HookPoint()  # [batch, head, q_pos, k_pos], rows sum to 1 (less the sink mass), masked keys 0
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
        return (self.force_eager or self.softcap is not None or self.hook_pattern.has_hooks()
                or self.hook_attn_scores.has_hooks() or (self.sinks is not None and self.hook_sinks.has_hooks()))

    def sink_logits(self) -> Float[Tensor, " head"] | None:
        """This forward's sink logits, float32, through ``hook_sinks`` (None without sinks)."""
        return None if self.sinks is None else self.hook_sinks(self.sinks).float()

    def qkv(self, x: Float[Tensor, "batch pos d_model"], positions: Int[Tensor, "batch pos"],
            cache: KVCache | StreamingKVCache | None = None) -> QKV:
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
            padding: ``[batch, pos]``, True for real tokens (see :func:`key_mask`); None: none.
            head_mask: per-head factor ``xi_h`` multiplying ``z_h`` (Michel et al. 2019), for
                all sequences (``[head]``) or per sequence (``[batch, head]``).
            cache: keys and values of earlier positions (generation); this call's are appended.
        """
        q, k, v = self.qkv(x, positions, cache)
        if isinstance(cache, StreamingKVCache):
            z = self._attend_streaming(q, k, v, cache.policy.groups[self.layer], cache.key_positions[self.layer], padding)
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
        """:meth:`attend` under a KV policy (:func:`streaming_key_mask`): the eager path with the
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
        z = torch.cat([self._fused(q[:, :, a:a + block], k, v, mask(a, a + block)) for a in range(0, T, block)], dim=2)
        return z.transpose(1, 2)

    def attend(
        self,
        q: Float[Tensor, "batch head q_pos d_qk"],
        k: Float[Tensor, "batch kv_head k_pos d_qk"],
        v: Float[Tensor, "batch kv_head k_pos d_head"],
        padding: Bool[Tensor, "batch k_pos"] | None = None,
    ) -> Float[Tensor, "batch q_pos head d_head"]:
        """``z`` of every head: the eager path when :meth:`needs_pattern`, else the fused kernel,
        both under this layer's :func:`key_mask`."""
        eager = self.needs_pattern()
        mask = key_mask(q.shape[2], k.shape[2], q.device, causal=self.cfg.causal, window=self.window,
                        padding=padding, implicit=not eager, chunk=self.chunk)
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
        here: float16 tops out at 65504, and a model with large queries and keys gave ``inf``
        scores and NaN pattern rows where the fused kernel (which accumulates in float32) gave
        none. ``hook_attn_scores`` sees the float32 scores; the pattern is cast back to the
        model's dtype before ``hook_pattern`` (as Hugging Face's eager attention does), and
        ``pattern @ v`` runs in that dtype. In float32 every step is the same as before.

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
        sinks enter as one extra key (:func:`with_sink_key`)."""
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
        HeadprobeError: ``cfg`` is MLA (that is :class:`LatentAttention`).
    """

    def __init__(self, cfg: TransformerConfig, layer: int = 0, n_heads: int | None = None, n_kv_heads: int | None = None):
        """``n_heads``/``n_kv_heads`` (default: the config's) are fewer in a pruned copy
        (:class:`headprobe.probe.model.pruned.PrunedAttention`)."""
        if cfg.is_mla:
            raise HeadprobeError("an MLA config (kv_lora_rank) is attention of its own: use LatentAttention")
        super().__init__(cfg, layer, cfg.n_heads if n_heads is None else n_heads)
        H, KV = self.n_heads, cfg.n_kv_heads if n_kv_heads is None else n_kv_heads
        self.n_kv_heads = KV
        D, d_qk, d_head = cfg.d_model, cfg.d_qk, cfg.d_head
        assert KV is not None and d_head is not None and cfg.qkv_bias is not None  # filled by TransformerConfig.__post_init__
        self.q_proj = nn.Linear(D, H * (d_qk + (d_head if cfg.attn_gate else 0)), bias=cfg.qkv_bias)  # gate: [q_h, g_h] per head
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
        self.rotary = (None if rope is None else
                       Rotary(rotary_dim, *rope, interleaved=cfg.rotary_interleaved, yarn=YaRN.of(cfg)))
        self.qk_l2 = cfg.qk_l2_norm and self.rotary is not None  # Llama-4: on the rotary layers only
        self.temperature = cfg.attn_temperature if cfg.is_nope(layer) else None
        self._add_output(rotary_hooks=True)

    def qkv(self, x: Float[Tensor, "batch pos d_model"], positions: Int[Tensor, "batch pos"],
            cache: KVCache | StreamingKVCache | None = None) -> QKV:
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


class LatentAttention(SelfAttention):
    """Multi-head latent attention (MLA; DeepSeek-V2, arXiv 2405.04434, eqs. 9-14; DeepSeek-V3):
    keys and values of every head are decompressed from one per-token latent ``c^KV`` of width
    ``kv_lora_rank``, and positions enter through a decoupled rotary key ``k^R`` shared by all
    heads; only ``c^KV`` and ``k^R`` are cached.

    Queries: ``W_Q x`` (or ``W_UQ RMSNorm(W_DQ x)`` with ``q_lora_rank``), per head a non-rotary
    part (``qk_nope_head_dim``) and a rotary part (``qk_rope_head_dim``). ``W_DKV|W_KR x`` gives
    ``c^KV`` and ``k^R``; ``W_UK|W_UV RMSNorm(c^KV)`` each head's non-rotary key part and its value
    (``d_head``). A key is ``[k_nope, rope(k^R)]``, ``d_qk = qk_nope + qk_rope`` wide like a query.
    ``hook_q``/``hook_k`` hold queries and keys after rotary (there are no ``hook_rot_*``), all
    ``n_heads`` wide (``n_kv_heads == n_heads``).

    Raises:
        HeadprobeError: ``cfg`` is not MLA.
    """

    def __init__(self, cfg: TransformerConfig, layer: int = 0):
        if not cfg.is_mla:
            raise HeadprobeError("LatentAttention needs an MLA config (kv_lora_rank)")
        super().__init__(cfg, layer, cfg.n_heads)
        self.n_kv_heads = cfg.n_heads
        H, D, R, r, N = cfg.n_heads, cfg.d_model, cfg.qk_rope_head_dim, cfg.kv_lora_rank, cfg.qk_nope_head_dim
        assert r is not None and N is not None and cfg.d_head is not None  # MLA, filled by TransformerConfig.__post_init__
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(D, H * (N + R), bias=False)
        else:  # the query latent c^Q
            self.q_down = nn.Linear(D, cfg.q_lora_rank, bias=False)
            self.q_down_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
            self.q_up = nn.Linear(cfg.q_lora_rank, H * (N + R), bias=False)
        self.kv_down = nn.Linear(D, r + R, bias=False)  # latent c^KV and the shared rotary key k^R
        self.kv_norm = RMSNorm(r, cfg.norm_eps)
        self.kv_up = nn.Linear(r, H * (N + cfg.d_head), bias=False)  # keys and values of every head
        self.rotary = Rotary(R, cfg.rope_theta, yarn=YaRN.of(cfg)) if R else None
        self._add_output(rotary_hooks=False)

    def qkv(self, x: Float[Tensor, "batch pos d_model"], positions: Int[Tensor, "batch pos"],
            cache: KVCache | StreamingKVCache | None = None) -> QKV:
        """Queries ``[q_nope, rope(q_rope)]`` per head; keys ``[W_UK norm(c), rope(k^R)]`` and
        values ``W_UV norm(c)`` of every head, decompressed from the latent ``c^KV`` of all
        positions so far (the cache holds ``c^KV`` as ``keys`` ``[batch, 1, pos, rank]`` and
        ``k^R`` as ``values`` ``[batch, 1, pos, rope]``). Returns ``[batch, head, pos, .]`` tensors."""
        cfg = self.cfg
        B, T, _ = x.shape
        H, R, r, N = self.n_heads, cfg.qk_rope_head_dim, cfg.kv_lora_rank, cfg.qk_nope_head_dim
        assert r is not None and N is not None and cfg.d_head is not None  # MLA, filled by TransformerConfig.__post_init__
        q = self.q_proj(x) if cfg.q_lora_rank is None else self.q_up(self.q_down_norm(self.q_down(x)))
        q = q.view(B, T, H, N + R)
        ckv = self.kv_down(x)
        c, k_rope = ckv[..., :r], ckv[..., r:][:, :, None, :]  # [batch, pos, r], [batch, pos, 1, R]
        if self.rotary is not None:
            q = torch.cat([q[..., :N], self.rotary(q[..., N:], positions)], dim=-1)
            k_rope = self.rotary(k_rope, positions)
        q = self.hook_q(q)  # [batch, pos, head, d_qk]
        c, k_rope = c[:, None], k_rope.transpose(1, 2)  # [batch, 1, pos, r], [batch, 1, pos, R]
        if cache is not None:
            c, k_rope = cache.extend(self.layer, c, k_rope)
        S = c.shape[2]
        kv = self.kv_up(self.kv_norm(c[:, 0])).view(B, S, H, N + cfg.d_head)
        k = torch.cat([kv[..., :N], k_rope.transpose(1, 2).expand(B, S, H, R)], dim=-1)
        k = self.hook_k(k)  # [batch, pos, head, d_qk]
        v = self.hook_v(kv[..., N:])  # [batch, pos, head, d_head]
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def make_attention(cfg: TransformerConfig, layer: int = 0) -> SelfAttention:
    """Layer ``layer``'s attention: :class:`LatentAttention` for an MLA config, else :class:`Attention`."""
    return LatentAttention(cfg, layer) if cfg.is_mla else Attention(cfg, layer)


_LINEAR_MIXERS = {  # model_type -> (module, config class, mixer class) in transformers
    "qwen3_next": ("transformers.models.qwen3_next.modeling_qwen3_next", "Qwen3NextConfig", "Qwen3NextGatedDeltaNet"),
    "qwen3_5_text": ("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5TextConfig", "Qwen3_5GatedDeltaNet"),
}


class LinearAttention(nn.Module):
    """A linear-attention layer's token mixer, run by Hugging Face's own module (``mixer``:
    ``Qwen3NextGatedDeltaNet``, Yang et al. 2024's Gated DeltaNet, built from ``cfg.linear_mixer``
    and holding the checkpoint's tensors under their Hugging Face names). It has no heads: no
    attention hook points, ``head_mask`` and KV policies do not reach it.

    Raises (forward):
        HeadprobeError: with a KV cache (its recurrent state is not cached here).
    """

    force_eager = False
    streaming = None

    def __init__(self, cfg: TransformerConfig, layer: int):
        super().__init__()
        import importlib

        fields = dict(cfg.linear_mixer or {})
        kind = fields.pop("model_type", None)
        if kind not in _LINEAR_MIXERS:
            raise HeadprobeError(f"linear attention of model_type {kind!r} is not one of {sorted(_LINEAR_MIXERS)}")
        module, config_class, mixer_class = _LINEAR_MIXERS[kind]
        lib = importlib.import_module(module)
        hf_cfg = getattr(lib, config_class)(**fields)
        self.mixer = getattr(lib, mixer_class)(hf_cfg, layer)

    def forward(self, x: Float[Tensor, "batch pos d_model"], positions: Int[Tensor, "batch pos"],
                padding: Bool[Tensor, "batch pos"] | None = None, head_mask: Tensor | None = None,
                cache: KVCache | StreamingKVCache | None = None) -> Float[Tensor, "batch pos d_model"]:
        """The mixer's output ``[batch, pos, d_model]``; padding positions are zeroed at its input, as Hugging Face's."""
        if cache is not None:
            raise HeadprobeError("a KV cache is not implemented for linear-attention layers (Gated DeltaNet)")
        return self.mixer(x, attention_mask=None if padding is None else padding.long())


# --------------------------------------------------------------------------------------------
# MLP, block, model
# --------------------------------------------------------------------------------------------


_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "gelu": functools.partial(F.gelu, approximate="tanh"),  # GPT-2's gelu_new
    "gelu_erf": F.gelu,
    "swiglu": F.silu,
    "geglu": functools.partial(F.gelu, approximate="tanh"),  # Gemma's gelu_pytorch_tanh
}


class MLP(nn.Module):
    """GPT-2: ``W_out gelu_tanh(W_in x + b_in) + b_out`` (GPT-NeoX: exact GELU); Llama:
    ``W_out (silu(W_gate x) * W_in x)``; Gemma: ``W_out (gelu_tanh(W_gate x) * W_in x)``."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        assert cfg.mlp is not None and cfg.d_mlp is not None  # an MLP is made only with cfg.mlp; d_mlp filled by __post_init__
        self.gated = cfg.mlp in ("swiglu", "geglu")
        self.act = _ACTIVATIONS[cfg.mlp]
        self.fc_in = nn.Linear(cfg.d_model, cfg.d_mlp, bias=cfg.bias)
        self.fc_gate = nn.Linear(cfg.d_model, cfg.d_mlp, bias=cfg.bias) if self.gated else None
        self.fc_out = nn.Linear(cfg.d_mlp, cfg.d_model, bias=cfg.bias)
        self.hook_pre = HookPoint()  # [batch, pos, d_mlp], the activation's input
        self.hook_pre_linear = HookPoint()  # [batch, pos, d_mlp], W_in x (gated only)
        self.hook_post = HookPoint()  # [batch, pos, d_mlp]

    def forward(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        if self.gated:
            assert self.fc_gate is not None
            post = self.act(self.hook_pre(self.fc_gate(x))) * self.hook_pre_linear(self.fc_in(x))
        else:
            post = self.act(self.hook_pre(self.fc_in(x)))
        return self.fc_out(self.hook_post(post))


class SharedExpert(nn.Module):
    """An always-on gated expert beside the routed ones, ``W_out (act(W_gate x) * W_in x)``
    without biases or hook points (Llama-4's ``shared_expert``, Qwen3-Next's)."""

    def __init__(self, cfg: TransformerConfig, width: int):
        super().__init__()
        assert cfg.mlp is not None  # a mixture of experts is gated (TransformerConfig._check_moe)
        self.act = _ACTIVATIONS[cfg.mlp]
        self.fc_gate = nn.Linear(cfg.d_model, width, bias=False)
        self.fc_in = nn.Linear(cfg.d_model, width, bias=False)
        self.fc_out = nn.Linear(width, cfg.d_model, bias=False)

    def forward(self, x: Float[Tensor, "... d_model"]) -> Float[Tensor, "... d_model"]:
        return self.fc_out(self.act(self.fc_gate(x)) * self.fc_in(x))


class MoE(nn.Module):
    """Mixture-of-experts MLP (Shazeer et al. 2017; Fedus et al. 2022): a router ``W_r x (+ b_r)``
    picks ``n_experts_per_token`` of ``n_experts`` gated experts per token and weights them
    (``cfg.router``), the output is the weighted sum of their outputs, plus a shared expert
    (times ``sigmoid(w . x)`` with ``shared_expert_gate``). Expert ``e`` is ``W_down[e] f(W_gate_up[e]
    x + b)``, ``W_gate_up[e]`` the gate rows then the up rows, ``f`` the gated activation (or
    GPT-OSS's clamped one, ``swiglu_limit``). The weight multiplies the expert's output, or its
    input (``router_on_input``, Llama-4).

    Sources (transformers): ``MixtralSparseMoeBlock``, ``Qwen3MoeSparseMoeBlock``, ``GptOssMLP``,
    ``Llama4TextMoe``, ``Qwen3NextSparseMoeBlock``. A loop over the experts each token picked, in
    expert order (as Hugging Face's); no hook points inside (``hook_mlp_out`` holds the sum).
    """

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        E, D, d = cfg.n_experts, cfg.d_model, cfg.d_expert
        assert E is not None and d is not None and cfg.mlp is not None  # a MoE config (TransformerConfig._check_moe)
        self.cfg = cfg
        self.act = _ACTIVATIONS[cfg.mlp]
        self.router = nn.Linear(D, E, bias=cfg.router_bias)
        self.gate_up = nn.Parameter(torch.randn(E, 2 * d, D) * 0.02)  # [expert, gate rows | up rows, d_model]
        self.down = nn.Parameter(torch.randn(E, D, d) * 0.02)  # [expert, d_model, d_expert]
        self.gate_up_bias = nn.Parameter(torch.zeros(E, 2 * d)) if cfg.expert_bias else None
        self.down_bias = nn.Parameter(torch.zeros(E, D)) if cfg.expert_bias else None
        self.shared = None if cfg.d_shared_expert is None else SharedExpert(cfg, cfg.d_shared_expert)
        self.shared_gate = nn.Linear(D, 1, bias=False) if cfg.shared_expert_gate else None

    def route(self, x: Float[Tensor, "token d_model"]) -> tuple[Float[Tensor, "token k"], Int[Tensor, "token k"]]:
        """The top-k experts of every token and their weights (``cfg.router``)."""
        cfg, k = self.cfg, self.cfg.n_experts_per_token
        logits = self.router(x)  # [token, expert]
        if cfg.router == "softmax_topk":  # Mixtral, Qwen3-MoE: softmax over all experts, then top-k
            weights, index = torch.topk(logits.float().softmax(dim=-1), k, dim=-1)
            if cfg.router_renorm:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return weights.to(logits.dtype), index
        top, index = torch.topk(logits, k, dim=-1)
        if cfg.router == "topk_softmax":  # GPT-OSS: softmax over the k logits
            return top.softmax(dim=-1), index
        return torch.sigmoid(top.float()).to(top.dtype), index  # Llama-4: sigmoid of each

    def expert(self, e: int, x: Float[Tensor, "token d_model"]) -> Float[Tensor, "token d_model"]:
        """Expert ``e``'s output."""
        b_gu = None if self.gate_up_bias is None else self.gate_up_bias[e]
        gate, up = F.linear(x, self.gate_up[e], b_gu).chunk(2, dim=-1)
        limit = self.cfg.swiglu_limit
        if limit is None:
            h = self.act(gate) * up
        else:  # GPT-OSS (GptOssExperts._apply_gate)
            gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
            h = (up + 1) * (gate * torch.sigmoid(gate * self.cfg.swiglu_alpha))
        return F.linear(h, self.down[e], None if self.down_bias is None else self.down_bias[e])

    def forward(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        flat = x.reshape(-1, x.shape[-1])
        weights, index = self.route(flat)  # [token, k]
        out = torch.zeros_like(flat)
        for e in index.unique().tolist():
            token, slot = torch.where(index == e)
            w = weights[token, slot, None]
            if self.cfg.router_on_input:
                y = self.expert(e, flat[token] * w)
            else:
                y = self.expert(e, flat[token]) * w
            out.index_add_(0, token, y.to(out.dtype))
        if self.shared is not None:
            shared = self.shared(flat)
            out = out + (shared if self.shared_gate is None else torch.sigmoid(self.shared_gate(flat)) * shared)
        return out.view_as(x)


def make_mlp(cfg: TransformerConfig, layer: int = 0) -> nn.Module | None:
    """Layer ``layer``'s MLP: :class:`MoE` on a mixture-of-experts layer, else :class:`MLP`, or
    None for an attention-only model."""
    if cfg.mlp is None:
        return None
    return MoE(cfg) if cfg.is_moe(layer) else MLP(cfg)


class Block(nn.Module):
    """Residual block. Sequential (default): ``resid_mid = resid_pre + attn_out``,
    ``resid_post = resid_mid + mlp_out``; parallel (``parallel_residual``): ``resid_post =
    resid_pre + attn_out + mlp_out`` with the MLP reading ``resid_pre`` (no ``resid_mid``).
    Here ``attn_out = ln1_post(attn(ln1(resid_pre)))`` and ``mlp_out = ln2_post(mlp(ln2(.)))``,
    each norm present only where the config has it (``pre_norm``: ``ln1``/``ln2``,
    ``post_norm``: ``ln1_post``/``ln2_post``); no MLP in attention-only models.

    ``hook_attn_out`` and ``hook_mlp_out`` hold what is added to the residual stream (after
    the post norms, as TransformerLens). :meth:`resume` is everything after the attention.
    """

    def __init__(self, cfg: TransformerConfig, layer: int = 0):
        super().__init__()
        has_mlp = cfg.mlp is not None
        self.post_ln = cfg.post_ln  # BERT: ln1/ln2 normalise the residual after each addition
        self.ln1 = Norm(cfg) if cfg.pre_norm or cfg.post_ln else None
        # a linear layer's mixer stands where the heads are; code over heads visits cfg.attention_layers only
        self.attn = cast("SelfAttention", LinearAttention(cfg, layer)) if cfg.is_linear(layer) else make_attention(cfg, layer)
        self.ln1_post = PostNorm(cfg) if cfg.post_norm else None
        self.ln2 = Norm(cfg) if (has_mlp and cfg.pre_norm) or cfg.post_ln else None
        self.mlp = make_mlp(cfg, layer)
        self.ln2_post = PostNorm(cfg) if has_mlp and cfg.post_norm else None
        self.parallel = cfg.parallel_residual
        self.hook_resid_pre = HookPoint()  # [batch, pos, d_model]
        self.hook_attn_out = HookPoint()  # [batch, pos, d_model]
        self.hook_resid_mid = None if self.parallel else HookPoint()  # [batch, pos, d_model]
        self.hook_mlp_out = HookPoint()  # [batch, pos, d_model]
        self.hook_resid_post = HookPoint()  # [batch, pos, d_model]
        # post_ln only: ln2(resid_post), what the block passes on
        self.hook_normalized_resid_post = HookPoint() if self.post_ln else None  # [batch, pos, d_model]

    def forward(self, resid: Float[Tensor, "batch pos d_model"], positions: Int[Tensor, "batch pos"],
                padding: Bool[Tensor, "batch pos"] | None = None, head_mask: Tensor | None = None,
                cache: KVCache | StreamingKVCache | None = None) -> Float[Tensor, "batch pos d_model"]:
        """``resid_post`` from ``resid_pre``; the other arguments as :meth:`SelfAttention.forward`'s."""
        resid = self.hook_resid_pre(resid)
        x = resid if self.ln1 is None or self.post_ln else self.ln1(resid)
        return self.resume(resid, self.attn(x, positions, padding, head_mask, cache))

    def resume(
        self, resid_pre: Float[Tensor, "batch pos d_model"], attn_out: Float[Tensor, "batch pos d_model"]
    ) -> Float[Tensor, "batch pos d_model"]:
        """The rest of the block from its attention's raw output ``attn_out`` (``sum_h z_h W_O^(h)
        + b_O``, before any post norm): ``resid_post``. ``forward`` is ``resume(resid_pre,
        attn(ln1(resid_pre)))``; an ablation that changes one head adds ``(r_h - z_h) W_O^(h)``
        to ``attn_out`` and resumes here, so post norms and parallel MLPs are applied as in the
        forward pass (:func:`headprobe.analyses.ablation.exact_sweep`).

        Post-LN blocks (``post_ln``, BERT): ``resid_mid = resid_pre + attn_out``, ``x =
        ln1(resid_mid)``, ``resid_post = x + mlp(x)``, and the block returns ``ln2(resid_post)``."""
        if self.post_ln:
            # post_ln: not parallel, both norms (TransformerConfig.__post_init__)
            assert self.hook_resid_mid is not None and self.ln1 is not None and self.ln2 is not None
            assert self.hook_normalized_resid_post is not None
            resid = self.hook_resid_mid(resid_pre + self.hook_attn_out(attn_out))
            x = self.ln1(resid)
            resid_post = self.hook_resid_post(x + self.hook_mlp_out(self.mlp(x)) if self.mlp is not None else x)
            return self.hook_normalized_resid_post(self.ln2(resid_post))
        if self.ln1_post is not None:
            attn_out = self.ln1_post(attn_out)
        attn_out = self.hook_attn_out(attn_out)
        if self.parallel:
            mlp_out = self.hook_mlp_out(self._mlp(resid_pre)) if self.mlp is not None else 0
            return self.hook_resid_post(mlp_out + attn_out + resid_pre)  # Hugging Face's GPT-NeoX order
        assert self.hook_resid_mid is not None  # not parallel
        resid = self.hook_resid_mid(resid_pre + attn_out)
        if self.mlp is not None:
            resid = resid + self.hook_mlp_out(self._mlp(resid))
        return self.hook_resid_post(resid)

    def _mlp(self, resid: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        assert self.mlp is not None  # called only with an MLP
        out = self.mlp(resid if self.ln2 is None else self.ln2(resid))
        return out if self.ln2_post is None else self.ln2_post(out)


class Transformer(HookedRootModule):
    """Decoder-only transformer with TransformerLens hook points (``run_with_hooks``,
    ``run_with_cache``, ``hooks(...)`` all work).

    Hook names: ``hook_embed``, ``hook_pos_embed``, ``blocks.{l}.hook_resid_pre``,
    ``blocks.{l}.ln1.hook_normalized``, ``blocks.{l}.attn.hook_{q,k,v,rot_q,rot_k,attn_scores,
    pattern,z,result}``, ``blocks.{l}.hook_attn_out``, ``blocks.{l}.hook_resid_mid``,
    ``blocks.{l}.mlp.hook_{pre,pre_linear,post}``, ``blocks.{l}.hook_mlp_out``,
    ``blocks.{l}.hook_resid_post``, ``ln_final.hook_normalized`` (an MLA layer has no
    ``hook_rot_q``/``hook_rot_k``: its ``hook_q``/``hook_k`` are after rotary; a layer without
    positions, a NoPE entry of ``rope_thetas``, never calls them); with ``post_norm`` also
    ``blocks.{l}.ln1_post.hook_{in,out}`` and ``blocks.{l}.ln2_post.hook_{in,out}``; parallel
    blocks have no ``hook_resid_mid``, blocks without ``pre_norm`` no ``ln1``/``ln2``. An
    encoder (BERT) adds ``ln_embed.hook_normalized`` and, per post-LN block,
    ``blocks.{l}.hook_normalized_resid_post``, where ``ln1``/``ln2`` follow the residual sums.
    """

    kept_heads: list[list[int]]  # a pruned copy's query heads per layer (set by headprobe.probe.model.pruned)

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg)
        self.ln_embed = Norm(cfg) if cfg.embed_norm else None
        # nn.ModuleList is typed as holding nn.Module; these are Blocks
        self.blocks = cast("Sequence[Block]", nn.ModuleList(Block(cfg, layer) for layer in range(cfg.n_layers)))
        self.ln_final = Norm(cfg) if cfg.final_norm else None
        self.unembed = nn.Linear(cfg.d_model, cfg.d_vocab, bias=False)
        if cfg.tied_unembed:
            self.unembed.weight = self.embed.W_E.weight
        self.hook_embed = HookPoint()  # [batch, pos, d_model]
        self.hook_pos_embed = HookPoint()  # [batch, pos, d_model] (learned positions only)
        self.setup()

    @classmethod
    def from_state_dict(cls, cfg: TransformerConfig, state: dict[str, Tensor]) -> Transformer:
        """A model of ``cfg`` holding ``state``'s tensors themselves (``load_state_dict(...,
        assign=True)``, no copy): built on the meta device, so no weight is initialised only to
        be overwritten (for SmolLM2-135M that saved ~2 s of a load); the only buffers, the rotary
        frequencies, are computed afterwards. The caller must not keep using ``state`` for
        something else (clone it first if so). In eval mode.

        Raises:
            RuntimeError: ``state`` misses a parameter of ``cfg``'s model or has one it lacks.
        """
        with torch.device("meta"):
            model = cls(cfg)
        model.load_state_dict(state, strict=True, assign=True)
        if cfg.tied_unembed:  # assigning replaced the shared parameter by two: one again, as __init__ ties it
            model.unembed.weight = model.embed.W_E.weight
        for module in model.modules():
            if isinstance(module, Rotary):
                module.inv_freq = module.frequencies()
        left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
        if left:  # a module grew a tensor that neither the state dict nor the code above fills
            raise RuntimeError(f"from_state_dict left {left[0]} uninitialised")
        return model.eval()

    @property
    def force_eager(self) -> bool:
        """Whether every layer takes the eager attention path even without pattern hooks."""
        return all(b.attn.force_eager for b in self.blocks)

    @force_eager.setter
    def force_eager(self, value: bool) -> None:
        for b in self.blocks:
            b.attn.force_eager = bool(value)

    @property
    def n_kv_groups(self) -> int:
        """KV groups per layer, the units a :class:`~headprobe.probe.layout.attention.KVPolicy` addresses:
        ``n_kv_heads``, or 1 for MLA (the latent is shared by every head of the layer)."""
        assert self.cfg.n_kv_heads is not None  # filled by TransformerConfig.__post_init__
        return 1 if self.cfg.is_mla else self.cfg.n_kv_heads

    def check_kv_policy(self, policy: KVPolicy) -> None:
        """Raise HeadprobeError unless ``policy`` fits: ``n_layers`` x :attr:`n_kv_groups`, and no
        chunked attention. On a sliding-window layer a streaming group reads what both its layer's
        window and the policy allow (:func:`streaming_key_mask`)."""
        policy.check_layout(self.cfg.n_layers, self.n_kv_groups, "the model")
        if self.cfg.attention_chunk is not None:
            raise HeadprobeError("KV policies are not implemented for chunked attention (attention_chunk)")

    def streaming_cache(self, policy: KVPolicy) -> StreamingKVCache:
        """An empty :class:`StreamingKVCache` for ``policy`` on this model (its sliding windows included).

        Raises:
            HeadprobeError: see :meth:`check_kv_policy`.
        """
        self.check_kv_policy(policy)
        return StreamingKVCache(policy, windows=self.cfg.layout.windows)

    @contextlib.contextmanager
    def kv_policy(self, policy: KVPolicy | None) -> Iterator[Transformer]:
        """Within the block, each KV group's query heads read only the keys ``policy`` leaves them
        (:func:`streaming_key_mask`: a streaming group's first ``sink`` and last ``window``
        positions); exact attention, not an estimate. None: no change. Restored in ``finally``.

        Raises:
            HeadprobeError: see :meth:`check_kv_policy`.
        """
        if policy is not None:
            self.check_kv_policy(policy)
        before = [b.attn.streaming for b in self.blocks]
        try:
            for layer, b in enumerate(self.blocks):
                row = None if policy is None else policy.groups[layer]
                b.attn.streaming = None if row is None or all(g is None for g in row) else row
            yield self
        finally:
            for b, row in zip(self.blocks, before):
                b.attn.streaming = row

    def forward(
        self,
        tokens: Int[Tensor, "batch pos"],
        head_mask: Float[Tensor, ...] | None = None,
        attention_mask: Shaped[Tensor, "batch pos"] | None = None,
        return_type: Literal["logits", "resid"] = "logits",
        cache: KVCache | StreamingKVCache | None = None,
    ) -> Float[Tensor, "batch pos d_vocab"]:
        """Logits ``[batch, pos, d_vocab]`` (or the final residual, ``return_type="resid"``).

        Args:
            tokens: token ids ``[batch, pos]`` (a 1-D tensor is treated as one sequence).
            head_mask: factors ``xi[layer, head]`` (or ``[batch, layer, head]``) multiplying each
                head's ``z``; 0 removes a head's output contribution (zero ablation), 1 keeps it.
                Differentiable, for gradient importance ``|dL/dxi|`` (Michel et al. 2019).
            attention_mask: 1 for real tokens, 0 for padding (any side). Positions count real
                tokens only, so a left-padded sequence gets the same positions as unpadded.
            cache: a :class:`KVCache` holding the keys and values of the tokens before
                ``tokens`` (empty for the first call); this call's are appended, and ``tokens``
                get positions after the cached ones. Not combined with ``attention_mask``.

        Raises:
            HeadprobeError: ``head_mask`` has the wrong shape, or the sequence is longer than
                ``n_ctx`` with learned positions.
        """
        cfg = self.cfg
        if tokens.dim() == 1:
            tokens = tokens[None]
        B, T = tokens.shape
        if cfg.positional == "learned" and T > cfg.n_ctx:
            raise HeadprobeError(f"sequence of {T} tokens is longer than the model's n_ctx={cfg.n_ctx}")
        if head_mask is not None and tuple(head_mask.shape[-2:]) != (cfg.n_layers, cfg.n_heads) or (
            head_mask is not None and head_mask.dim() == 3 and head_mask.shape[0] != B
        ):
            raise HeadprobeError(
                f"head_mask has shape {tuple(head_mask.shape)}; expected [{cfg.n_layers}, {cfg.n_heads}] "
                f"or [{B}, {cfg.n_layers}, {cfg.n_heads}]"
            )

        past = 0 if cache is None else cache.n_tokens
        if cache is not None and not cfg.causal:
            raise HeadprobeError("a KV cache needs causal attention; this model is bidirectional (an encoder)")
        if cache is not None and attention_mask is not None:
            raise HeadprobeError("a KV cache cannot be combined with attention_mask (padding)")
        if cfg.positional == "learned" and past + T > cfg.n_ctx:
            raise HeadprobeError(f"{past + T} tokens with the cache are longer than the model's n_ctx={cfg.n_ctx}")
        if attention_mask is None:
            positions = torch.arange(past, past + T, device=tokens.device).expand(B, T)
            padding = None
        else:  # each layer's attention masks the padding keys (key_mask)
            padding = attention_mask.to(torch.bool)
            positions = (padding.long().cumsum(-1) - 1).clamp(min=0)

        tok_embed, pos_embed = self.embed(tokens, positions)
        resid = self.hook_embed(tok_embed)
        if pos_embed is not None:
            resid = resid + self.hook_pos_embed(pos_embed)
        if self.ln_embed is not None:
            resid = self.ln_embed(resid)
        for layer, block in enumerate(self.blocks):
            mask_l = None if head_mask is None else head_mask[..., layer, :]
            resid = block(resid, positions, padding, mask_l, cache)
        if self.ln_final is not None:
            resid = self.ln_final(resid)
        if return_type == "resid":
            return resid
        return self.logits(resid, normed=True)

    def logits(self, resid: Float[Tensor, "... d_model"], normed: bool = False,
               vocab: Int[Tensor, "... k"] | None = None, out: Tensor | None = None, softcap: bool = True
               ) -> Float[Tensor, "... d_vocab"] | Float[Tensor, "... k"]:
        """Logits from a final residual stream: ``ln_final`` (unless ``normed``), the unembedding
        (``@ W_U + b_U``), ``logit_scale`` (Cohere, Granite) and ``final_softcap`` (``c * tanh(logits / c)``,
        Gemma-2) where the config has them. The one place the native model turns a residual into logits: the forward
        pass, the losses of the exact sweep and patching's logit difference all end here.

        Args:
            resid: ``[..., d_model]``.
            normed: ``resid`` has been through ``ln_final`` already.
            vocab: token ids ``[..., k]`` (the leading axes as ``resid``'s): only those logits,
                ``[..., k]``, without the ``[..., d_vocab]`` product.
            out: a ``[n, d_vocab]`` buffer of ``resid``'s dtype for a 2-D ``resid`` ``[n, d_model]``
                (``vocab`` None): the logits are written into it and it is returned.
            softcap: False leaves ``final_softcap`` out (the logit before the cap).
        """
        if not normed and self.ln_final is not None:
            resid = self.ln_final(resid)
        W, b = self.unembed.weight, self.unembed.bias  # [d_vocab, d_model], [d_vocab] | None
        if vocab is not None:
            logits = torch.einsum("...d,...kd->...k", resid, W[vocab])
            if b is not None:
                logits = logits + b[vocab]
        elif out is not None:
            logits = torch.mm(resid, W.T, out=out)
            if b is not None:
                logits += b
        else:
            logits = self.unembed(resid)
        if self.cfg.logit_scale is not None:  # Cohere; Granite's 1 / logits_scaling
            logits = logits.mul_(self.cfg.logit_scale) if out is not None and vocab is None else logits * self.cfg.logit_scale
        cap = self.cfg.final_softcap
        if cap is None or not softcap:
            return logits
        if out is not None and vocab is None:
            return logits.div_(cap).tanh_().mul_(cap)
        return torch.tanh(logits / cap) * cap


def init_weights(model: Transformer, std: float = 0.02) -> Transformer:
    """GPT-2's initialisation for training from scratch (Radford et al. 2019): every linear and
    embedding weight ``N(0, std)``, output projections of the residual branches (``o_proj``,
    ``fc_out``) ``N(0, std / sqrt(2 n_layers))``, biases 0, norms 1. In place; returns ``model``.

    (PyTorch's default ``N(0, 1)`` embedding, tied to the unembedding, starts with logits of
    standard deviation ``sqrt(d_model)`` and a loss far above chance.)
    """
    resid_std = std / math.sqrt(2 * model.cfg.n_layers)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                last = name.rsplit(".", 1)[-1]
                module.weight.normal_(0.0, resid_std if last in ("o_proj", "fc_out") else std)
                bias = getattr(module, "bias", None)  # nn.Embedding has none
                if bias is not None:
                    bias.zero_()
    return model


@torch.inference_mode()
def generate(model: Transformer, tokens: Int[Tensor, "batch pos"], n_new: int, use_cache: bool = True,
             policy: KVPolicy | None = None) -> tuple[Int[Tensor, "batch pos_plus_new"], KVCache | StreamingKVCache | None]:
    """Greedy decoding of ``n_new`` tokens after ``tokens``.

    With ``use_cache`` the prompt runs once and each new token runs alone against a
    :class:`KVCache` (MHA, GQA and MQA cache ``n_kv_heads`` keys and values per layer), or with
    ``policy`` a :class:`StreamingKVCache` (each KV group keeps what the policy leaves it); without
    it the whole sequence is recomputed every step (the reference the cache must equal), under
    :meth:`Transformer.kv_policy` when ``policy`` is given.

    Returns:
        (tokens with the ``n_new`` generated ones appended, the cache or None).

    Raises:
        HeadprobeError: a policy that does not fit the model (:meth:`Transformer.check_kv_policy`).
    """
    if policy is not None:
        model.check_kv_policy(policy)
    cache = (KVCache() if policy is None else model.streaming_cache(policy)) if use_cache else None
    out = tokens
    step_in = tokens
    with model.kv_policy(None if use_cache else policy):
        for _ in range(n_new):
            logits = model(step_in, cache=cache) if use_cache else model(out)
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            out = torch.cat([out, nxt], dim=1)
            step_in = nxt
    return out, cache
