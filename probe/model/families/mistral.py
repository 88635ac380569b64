"""Mistral (``MistralForCausalLM``; Jiang et al. 2023): Llama's block with a sliding window on
every layer (``sliding_window``)."""

from __future__ import annotations

from typing import Any

from headprobe.probe.model.config import TransformerConfig
from headprobe.probe.model.families.base import TINY_FIELDS, Family, TinySpec
from headprobe.probe.model.families.llama import llama_config, llama_weights


def config(hf_config: Any) -> TransformerConfig:
    """The native config of a ``MistralConfig`` (:func:`~headprobe.probe.model.families.llama.llama_config`)."""
    return llama_config(hf_config, "mistral", windows="every_layer")


FAMILY = Family(
    config=config,
    weights=llama_weights,
    tiny=TinySpec(
        fields=dict(TINY_FIELDS, sliding_window=8),
        layout=("GQA", "none", "none", (8, 8)),  # windows on every layer
        unsupported=(dict(rope_parameters={"rope_theta": 1e4, "rope_type": "linear", "factor": 2.0}),),
    ),
)
