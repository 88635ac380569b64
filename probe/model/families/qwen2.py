"""Qwen2 (``Qwen2ForCausalLM``; Yang et al. 2024): Llama's block with biases on the q, k and v
projections (not on o), and sliding windows where ``layer_types`` says."""

from __future__ import annotations

from typing import Any

from headprobe.probe.model.config import TransformerConfig
from headprobe.probe.model.families.base import TINY_FIELDS, Family, TinySpec, Variant
from headprobe.probe.model.families.llama import llama_config, llama_weights


def config(hf_config: Any) -> TransformerConfig:
    """The native config of a ``Qwen2Config`` (:func:`~headprobe.probe.model.families.llama.llama_config`)."""
    return llama_config(hf_config, "qwen2", qkv_bias=True, windows="layer_types")


FAMILY = Family(
    config=config,
    weights=llama_weights,
    tiny=TinySpec(
        fields=dict(TINY_FIELDS),
        layout=("GQA", "qkv", "none", None),
        variants=(
            Variant(
                dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),
                "layer 1 slides",
                layout=dict(windows=(None, 8)),
            ),
        ),
        unsupported=(dict(hidden_act="gelu"),),
    ),
)
