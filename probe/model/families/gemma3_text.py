"""Gemma-3 text models (``Gemma3ForCausalLM``, ``model_type`` ``gemma3_text``; Gemma Team 2025,
arXiv 2503.19786): Gemma-2's block (norms before and after attention and MLP with the ``(1 + w)``
RMSNorm, GeGLU, embeddings times ``sqrt(d_model)``, scores scaled by ``query_pre_attn_scalar **
-0.5``) with a per-head QK-norm (the ``(1 + w)`` RMSNorm over each query and key head, before
rotary), local sliding-window and global layers (``layer_types``) whose rotary bases differ
(``rope_local_base_freq`` on local layers, ``rope_theta`` and any linear scaling on global ones),
and no attention soft-cap: Hugging Face's ``Gemma3Attention`` keeps ``attn_logit_softcapping`` but
never passes it to the attention, so neither does the native model (a final soft-cap applies
where the config sets one)."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.hooks.names import block_path
from headprobe.probe.model.config import TransformerConfig
from headprobe.probe.model.families.base import TINY_FIELDS, Family, TinySpec, Variant
from headprobe.probe.model.families.gemma2 import NORMS, one_plus
from headprobe.probe.model.families.llama import llama_config, llama_weights


def config(hf_config: Any) -> TransformerConfig:
    """The native config of a ``Gemma3TextConfig`` (:func:`~headprobe.probe.model.families.llama.llama_config`).

    Raises:
        HeadprobeError: bidirectional attention (``use_bidirectional_attention``), and what
            :func:`~headprobe.probe.model.families.llama.llama_config` refuses.
    """
    if getattr(hf_config, "use_bidirectional_attention", False):
        raise HeadprobeError("native gemma3_text implements causal attention only, not use_bidirectional_attention")
    return llama_config(
        hf_config,
        "gemma3_text",
        act_field="hidden_activation",
        act="gelu_pytorch_tanh",
        mlp="geglu",
        windows="layer_types",
        qk_norm="per_head",
        post_norm=True,
        embed_scale=True,
        attn_scale=float(hf_config.query_pre_attn_scalar) ** -0.5,
        final_softcap=hf_config.final_logit_softcapping,
    )  # attn_logit_softcapping: never applied


def weights(sd: dict[str, Tensor], cfg: TransformerConfig, rope_interleave: bool = False) -> dict[str, Tensor]:
    """Gemma-2's conversion (every norm weight ``w`` loads as ``1 + w``), the QK-norms' too."""
    out = llama_weights(sd, cfg, norms=NORMS, norm=one_plus)
    for l in range(cfg.n_layers):
        for name in ("q_norm", "k_norm"):
            key = block_path(l) + f".attn.{name}.weight"
            out[key] = one_plus(out[key])
    return out


ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    "full_attention": {"rope_type": "default", "rope_theta": 1e6},
}
"""The tiny model's rotary bases: Gemma-3's local 10,000 and global 1,000,000."""

FAMILY = Family(
    config=config,
    weights=weights,
    tiny=TinySpec(
        fields=dict(
            TINY_FIELDS,
            head_dim=16,
            sliding_window=8,
            query_pre_attn_scalar=16,
            rope_parameters=ROPE,
            layer_types=["sliding_attention", "full_attention"],
        ),
        layout=("GQA", "none", "per_head", (8, None)),  # layer 0 of 2 slides
        attention_output="model.layers.{l}.post_attention_layernorm",
        post_attention_norm=True,
        norm_offset=1.0,
        variants=(
            Variant(
                dict(
                    rope_parameters={
                        **ROPE,
                        "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
                    }
                ),
                "linear rope scaling on the global layer",
            ),
            Variant(
                dict(head_dim=24, query_pre_attn_scalar=20, attn_logit_softcapping=5.0),
                "head_dim 24; attn_logit_softcapping is not applied",
                layout=dict(d_head=24),
            ),
        ),
        unsupported=(
            dict(use_bidirectional_attention=True),
            dict(hidden_activation="silu"),
            dict(
                rope_parameters={**ROPE, "full_attention": {"rope_type": "dynamic", "rope_theta": 1e6, "factor": 8.0}}
            ),
        ),
    ),
)
