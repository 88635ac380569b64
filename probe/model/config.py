"""The native transformer's configuration: :class:`TransformerConfig`, every architecture option a
family's conversion sets, the checks of their values (those of the MoE, MLA and per-layer rotary
fields in :mod:`headprobe.probe.model.config_checks`), and the aliases of field names and values that
saved configs may carry (:data:`OLD_FIELDS`, :data:`OLD_QK_NORM`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.core.registry import did_you_mean
from headprobe.probe.layout.attention import QK_NORM_KINDS, AttentionLayout
from headprobe.probe.model.config_checks import ROUTERS as ROUTERS
from headprobe.probe.model.config_checks import check_layer_rope, check_mla, check_moe

#: Aliases of ``TransformerConfig.qk_norm`` values that saved configs may carry -> the layout's names
#: (:data:`~headprobe.probe.layout.attention.QK_NORM_KINDS`); accepted and stored as those.
OLD_QK_NORM = {None: "none", "head": "per_head", "all": "full"}

#: Aliases of :class:`TransformerConfig` field names that saved configs may carry (checkpoints,
#: pruned models, weights-cache entries) -> the field's name, mapped by ``from_json``.
OLD_FIELDS = {"head_dim": "d_head"}


@dataclass(frozen=True)
class TransformerConfig:
    """The layout and architecture options of a :class:`~headprobe.probe.model.transformer.Transformer`.

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
            2023, arXiv 2302.05442). The aliases ``"head"``, ``"all"`` and None are
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
            (:class:`~headprobe.probe.model.feedforward.MoE`; Shazeer et al. 2017, Mixtral); None: dense MLPs only.
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
            DeltaNet, :class:`~headprobe.probe.model.linear_attention.LinearAttention`) instead of heads; None: none. They have no heads
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
        llama3_rope: Llama-3.1's rotary scaling (Hugging Face's ``rope_type="llama3"``,
            ``_compute_llama3_parameters``): ``(factor, low_freq_factor, high_freq_factor,
            original_max_position_embeddings)``; frequencies of wavelength over ``original /
            low_freq_factor`` are divided by ``factor``, those under ``original / high_freq_factor``
            kept, those between blended (:class:`~headprobe.probe.model.positions.Llama3Rope`). None: none.

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
    llama3_rope: tuple[float, float, float, int] | None = None

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
                raise HeadprobeError(
                    f"config {field}={value!r} is not one of {allowed}{did_you_mean(str(value), map(str, allowed))}"
                )
        check_mla(self)
        check_layer_rope(self)
        if self.rotary_dim is not None and not (0 < self.rotary_dim <= self.d_qk and self.rotary_dim % 2 == 0):
            raise HeadprobeError(f"rotary_dim must be even and in (0, d_qk={self.d_qk}], got {self.rotary_dim}")
        if self.positional == "rotary" and self.rotary_dim is None and not self.is_mla and self.d_qk % 2:
            raise HeadprobeError(
                f"rotary positions rotate pairs of dimensions: the head dimension d_qk={self.d_qk} must be even "
                f"(d_model {self.d_model} and {self.n_heads} heads give it; choose an even d_model / n_heads)"
            )
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
            raise HeadprobeError(
                "post_ln (BERT's post-LN blocks) needs pre_norm=False, post_norm=False and parallel_residual=False"
            )
        if not self.causal and (self.sliding_window is not None or self.attention_chunk is not None):
            raise HeadprobeError(
                "bidirectional attention (causal=False) with a sliding window or chunks is not implemented"
            )
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
        check_moe(self)

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
        Aliased names and values in saved configs (:data:`OLD_FIELDS`, :data:`OLD_QK_NORM`:
        checkpoints, pruned models, weights-cache entries) are read as the config's own.

        Raises:
            TypeError: a field the config does not have. HeadprobeError: as the constructor.
        """
        kwargs: dict[str, Any] = {
            OLD_FIELDS.get(k, k): tuple(v) if isinstance(v, list) else v for k, v in fields.items()
        }
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
            (bool(self.bias), bool(self.qkv_bias))
        ]
        windows = tuple(
            self.sliding_window if self.is_sliding(l) else self.attention_chunk if self.is_chunked(l) else None
            for l in range(self.n_layers)
        )  # a chunked layer caches at most a chunk, as layout_from_hf_config
        common: dict[str, Any] = dict(
            d_model=self.d_model,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            d_head=self.d_head,
            bias=bias,
            windows=windows,
            sinks=self.attn_sinks,
            head_layers=None if self.linear_layers is None else self.attention_layers,
        )
        if self.is_mla:
            return AttentionLayout(
                kv_lora_rank=self.kv_lora_rank,
                q_lora_rank=self.q_lora_rank,
                qk_rope_head_dim=self.qk_rope_head_dim,
                qk_nope_head_dim=self.qk_nope_head_dim,
                **common,
            )
        assert self.qk_norm is not None  # None is read as "none" by __post_init__
        return AttentionLayout(n_kv_heads=self.n_kv_heads, qk_norm=self.qk_norm, output_gate=self.attn_gate, **common)
