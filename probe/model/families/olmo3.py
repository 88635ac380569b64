"""OLMo-3 (``Olmo3ForCausalLM``; OLMo et al. 2025): OLMo-2's block (QK-norm over the whole q and
k projections, norms after attention and MLP) with sliding-window and full-attention layers
(``layer_types``), each type with its own rotary parameters (``rope_parameters`` keyed by layer
type)."""

from __future__ import annotations

from functools import partial
from typing import Any

from headprobe.probe.model.config import TransformerConfig
from headprobe.probe.model.families.base import TINY_FIELDS, Family, TinySpec, Variant
from headprobe.probe.model.families.llama import llama_config, llama_weights
from headprobe.probe.model.families.olmo2 import NORMS


def config(hf_config: Any) -> TransformerConfig:
    """The native config of an ``Olmo3Config`` (:func:`~headprobe.probe.model.families.llama.llama_config`)."""
    return llama_config(hf_config, "olmo3", windows="layer_types", qk_norm="full", pre_norm=False, post_norm=True)


FAMILY = Family(
    config=config,
    weights=partial(llama_weights, norms=NORMS),
    tiny=TinySpec(
        fields=dict(
            TINY_FIELDS,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                "full_attention": {"rope_type": "default", "rope_theta": 5e5},
            },
        ),
        layout=("GQA", "none", "full", (8, None)),  # layer 0 slides
        attention_output="model.layers.{l}.post_attention_layernorm",
        post_attention_norm=True,
        unprunable="QK-norm",  # one norm over all heads' queries: a head cannot be taken out alone
        variants=(
            Variant(
                dict(
                    rope_parameters={
                        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                        "full_attention": {"rope_type": "linear", "rope_theta": 5e5, "factor": 4.0},
                    }
                ),
                "linear rope scaling on the full layer",
            ),
        ),
        unsupported=(
            dict(
                rope_parameters={
                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                    "full_attention": {
                        "rope_type": "yarn",
                        "rope_theta": 5e5,
                        "factor": 8.0,
                        "original_max_position_embeddings": 64,
                    },
                }
            ),
        ),
    ),
)
