"""Qwen3-Next (``Qwen3NextForCausalLM``; Qwen Team 2025) with full-attention layers only: Qwen3's block with gated attention (``q_proj`` gives each head its query and an output
gate, ``o_proj(attn * sigmoid(gate))``), partial rotary (``partial_rotary_factor``) and the
``(1 + w)`` RMSNorm (``Qwen3NextRMSNorm``, its QK-norm too; loaded as ``1 + w``, the same float32
product), mixture-of-experts MLPs with a sigmoid-gated shared expert (:class:`~headprobe.probe.model.feedforward.MoE`).
Its Gated-DeltaNet linear-attention layers (``layer_types``) run Hugging Face's own module
(:class:`~headprobe.probe.model.linear_attention.LinearAttention`): they have no heads, and heads keep the model's layer numbers.
"""

from __future__ import annotations

import copy
from typing import Any

from torch import Tensor

from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.hooks.names import block_path
from headprobe.probe.model.config import TransformerConfig
from headprobe.probe.model.families.base import TINY_FIELDS, Family, TinySpec, Variant, rope_parameters
from headprobe.probe.model.families.gemma2 import one_plus
from headprobe.probe.model.families.llama import llama_config, llama_weights


def sparse_layers(hf_config: Any) -> list[int]:
    """The layers whose MLP is a mixture of experts (``Qwen3NextDecoderLayer``'s rule)."""
    n_experts, step = getattr(hf_config, "num_experts", 0) or 0, getattr(hf_config, "decoder_sparse_step", 1)
    only = set(getattr(hf_config, "mlp_only_layers", None) or ())
    return [l for l in range(hf_config.num_hidden_layers) if l not in only and n_experts > 0 and (l + 1) % step == 0]


LINEAR_FIELDS = (
    "hidden_size",
    "rms_norm_eps",
    "hidden_act",
    "layer_types",
    "num_hidden_layers",
    "linear_num_value_heads",
    "linear_num_key_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
)
"""The Hugging Face config fields its Gated-DeltaNet module reads (``TransformerConfig.linear_mixer``)."""


def gated_config(hf_config: Any, kind: str) -> TransformerConfig:
    """The native config of a Qwen3-Next-like text config with full attention.

    Raises:
        HeadprobeError: linear-attention layers, or what :func:`~headprobe.probe.model.families.llama.llama_config` refuses.
    """
    linear = tuple(l for l, t in enumerate(hf_config.layer_types) if t == "linear_attention")
    other = sorted({t for t in hf_config.layer_types if t not in ("full_attention", "linear_attention")})
    if other:
        raise HeadprobeError(f"native {kind} does not implement layer types {other}: use --backend transformer-lens")
    mixer = {k: getattr(hf_config, k) for k in LINEAR_FIELDS} if linear else None
    hybrid: dict[str, Any] = (
        dict(linear_layers=linear, linear_mixer=dict(mixer or {}, model_type=kind)) if linear else {}
    )
    moe = tuple(sparse_layers(hf_config))
    experts = (
        dict(
            n_experts=hf_config.num_experts,
            n_experts_per_token=hf_config.num_experts_per_tok,
            d_expert=hf_config.moe_intermediate_size,
            router="softmax_topk",
            router_renorm=bool(hf_config.norm_topk_prob),
            d_shared_expert=hf_config.shared_expert_intermediate_size,
            shared_expert_gate=True,
            moe_layers=moe,
        )
        if moe
        else {}
    )
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    rotary_dim = int(head_dim * rope_parameters(hf_config).get("partial_rotary_factor", 1.0))
    if linear:  # the attention layers' options are read as Llama's, the linear layers standing as full ones
        hf_config = copy.copy(hf_config)
        hf_config.layer_types = ["full_attention"] * len(hf_config.layer_types)
    return llama_config(
        hf_config,
        kind,
        qk_norm="per_head",
        attn_gate=True,
        rotary_dim=None if rotary_dim == head_dim else rotary_dim,
        **experts,
        **hybrid,
    )


def config(hf_config: Any) -> TransformerConfig:
    """The native config of a ``Qwen3NextConfig`` (:func:`gated_config`)."""
    return gated_config(hf_config, "qwen3_next")


def weights(sd: dict[str, Tensor], cfg: TransformerConfig, rope_interleave: bool = False) -> dict[str, Tensor]:
    """Native parameter names: Llama's (``q_proj`` keeps its per-head ``[query, gate]`` rows), every
    norm weight, QK-norms included, as ``1 + w``; the mixtures of experts by :func:`~headprobe.probe.model.families.base.moe_weights`."""
    out = llama_weights(sd, cfg, norm=one_plus, moe=dict(shared="shared_expert", shared_gate="shared_expert_gate"))
    for l in cfg.attention_layers:
        for name in ("q_norm", "k_norm"):
            key = block_path(l, f"attn.{name}.weight")
            out[key] = one_plus(out[key])
    return out


TINY = dict(
    TINY_FIELDS,
    head_dim=16,
    layer_types=["full_attention"] * 2,
    num_experts=0,
    rope_parameters={"rope_theta": 1e4, "rope_type": "default", "partial_rotary_factor": 0.5},
)
"""Two full-attention layers, dense MLPs, half of each head rotary (Qwen3.5's text model's too)."""

HYBRID = dict(
    num_hidden_layers=4,
    layer_types=["linear_attention", "full_attention"] * 2,
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
)
"""Qwen3-Next's pattern in four layers: Gated DeltaNet at 0 and 2, gated attention (heads) at 1 and 3."""

FAMILY = Family(
    config=config,
    weights=weights,
    tiny=TinySpec(
        fields=dict(
            TINY,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            mlp_only_layers=[0],
        ),  # layer 0 dense, layer 1 a mixture of experts
        layout=("GQA", "none", "per_head", None),
        norm_offset=1.0,
        perturb=("norm", "gate"),
        unprunable="gated attention",
        variants=(
            Variant(
                dict(rope_parameters={"rope_theta": 1e4, "rope_type": "default", "partial_rotary_factor": 1.0}),
                "full rotary",
            ),
            Variant(dict(num_experts=0), "dense MLPs only"),
        ),
        unsupported=(dict(attention_bias=True),),
        hybrid=dict(HYBRID, mlp_only_layers=[0, 1]),  # layers 2 and 3 mixtures of experts
    ),
)
