"""SmolLM3 (``SmolLM3ForCausalLM``; Hugging Face 2025): Llama's block in which some layers have no
positions at all (NoPE: ``no_rope_layers[l] == 0``, by default every ``no_rope_layer_interval``-th
layer; Kazemnejad et al. 2023, arXiv 2305.19466), and sliding windows where ``layer_types`` says
(the mask Hugging Face builds follows ``layer_types``)."""

from __future__ import annotations

from typing import Any

from headprobe.probe.model.config import TransformerConfig
from headprobe.probe.model.families.base import TINY_FIELDS, Family, TinySpec, Variant
from headprobe.probe.model.families.llama import llama_config, llama_weights


def config(hf_config: Any) -> TransformerConfig:
    """The native config of a ``SmolLM3Config`` (:func:`~headprobe.probe.model.families.llama.llama_config`):
    its NoPE layers (``no_rope_layers``, 1 = rotary, 0 = none) are None in ``rope_thetas``."""
    uses_rope = hf_config.no_rope_layers
    return llama_config(
        hf_config, "smollm3", windows="layer_types", no_rope_layers={l for l, r in enumerate(uses_rope) if not r}
    )


FAMILY = Family(
    config=config,
    weights=llama_weights,
    tiny=TinySpec(
        fields=dict(TINY_FIELDS, no_rope_layer_interval=2),  # layer 0 rotary, layer 1 NoPE
        layout=("GQA", "none", "none", None),
        variants=(
            Variant(dict(no_rope_layers=[0, 1]), "NoPE layer 0, rotary layer 1"),
            Variant(
                dict(use_sliding_window=True, sliding_window=8),
                "a window on the NoPE layer",
                layout=dict(windows=(None, 8)),
            ),
        ),
        unsupported=(
            dict(rope_parameters={"rope_theta": 1e4, "rope_type": "linear", "factor": 2.0}),
            dict(attention_bias=True),
        ),
    ),
)
