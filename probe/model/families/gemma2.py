"""Gemma-2 (``Gemma2ForCausalLM``; Gemma Team 2024): Llama's block with sliding windows on
alternate layers (``layer_types``), attention and final logit soft-capping, an explicit
``head_dim``, scores scaled by ``query_pre_attn_scalar ** -0.5``, norms before and after both
attention and MLP with the ``(1 + w)`` RMSNorm, embeddings times ``sqrt(d_model)`` and a GeGLU
MLP (tanh GELU).

Gemma's RMSNorm multiplies by ``1 + w`` (``Gemma2RMSNorm``), so its weights load as ``1 + w``
into the plain RMSNorm (the same float32 product).
"""

from __future__ import annotations

from functools import partial
from typing import Any

from torch import Tensor

from headprobe.probe.model.config import TransformerConfig
from headprobe.probe.model.families.base import TINY_FIELDS, Family, TinySpec, Variant
from headprobe.probe.model.families.llama import llama_config, llama_weights

NORMS = {
    "ln1": "input_layernorm",
    "ln1_post": "post_attention_layernorm",
    "ln2": "pre_feedforward_layernorm",
    "ln2_post": "post_feedforward_layernorm",
}
"""Native norm of a Gemma-2 layer -> the Hugging Face norm it loads."""


def config(hf_config: Any) -> TransformerConfig:
    """The native config of a ``Gemma2Config`` (:func:`~headprobe.probe.model.families.llama.llama_config`)."""
    return llama_config(
        hf_config,
        "gemma2",
        act_field="hidden_activation",
        act="gelu_pytorch_tanh",
        mlp="geglu",
        windows="layer_types",
        post_norm=True,
        embed_scale=True,
        attn_scale=float(hf_config.query_pre_attn_scalar) ** -0.5,
        attn_softcap=hf_config.attn_logit_softcapping,
        final_softcap=hf_config.final_logit_softcapping,
    )


def one_plus(w: Tensor) -> Tensor:
    """``1 + w``: a ``Gemma2RMSNorm`` weight as the plain RMSNorm's."""
    return 1 + w


FAMILY = Family(
    config=config,
    weights=partial(llama_weights, norms=NORMS, norm=one_plus),
    tiny=TinySpec(
        fields=dict(TINY_FIELDS, head_dim=16, sliding_window=8, query_pre_attn_scalar=16),
        layout=("GQA", "none", "none", (8, None)),  # layer 0 of 2 slides
        attention_output="model.layers.{l}.post_attention_layernorm",
        post_attention_norm=True,
        norm_offset=1.0,
        variants=(
            Variant(
                dict(head_dim=24, query_pre_attn_scalar=20), "n_heads * head_dim != d_model", layout=dict(d_head=24)
            ),
        ),
        unsupported=(dict(hidden_activation="silu"),),
    ),
)
