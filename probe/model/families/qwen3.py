"""Qwen3 (``Qwen3ForCausalLM``; Yang et al. 2025): Llama's block with an RMSNorm on each query
and key head before rotary (``q_norm``/``k_norm`` of size ``head_dim``), an explicit ``head_dim``
and sliding windows where ``layer_types`` says."""

from __future__ import annotations

from typing import Any

from headprobe.probe.model.config import TransformerConfig
from headprobe.probe.model.families.base import TINY_FIELDS, Family, TinySpec, Variant
from headprobe.probe.model.families.llama import llama_config, llama_weights


def config(hf_config: Any) -> TransformerConfig:
    """The native config of a ``Qwen3Config`` (:func:`~headprobe.probe.model.families.llama.llama_config`)."""
    return llama_config(hf_config, "qwen3", windows="layer_types", qk_norm="per_head")


FAMILY = Family(
    config=config,
    weights=llama_weights,
    tiny=TinySpec(
        fields=dict(TINY_FIELDS, head_dim=16),
        layout=("GQA", "none", "per_head", None),
        variants=(Variant(dict(head_dim=8), "n_heads * head_dim != d_model", layout=dict(d_head=8)),),
        unsupported=(dict(attention_bias=True),),
    ),
)
