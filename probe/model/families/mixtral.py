"""Mixtral (``MixtralForCausalLM``; Jiang et al. 2024, "Mixtral of Experts"): Mistral's block with
a mixture of gated experts as every layer's MLP (``MixtralSparseMoeBlock``: softmax over all
router logits, top-k, renormalised; heads are unaffected)."""

from __future__ import annotations

from typing import Any

from headprobe.probe.model.config import TransformerConfig
from headprobe.probe.model.families.base import TINY_FIELDS, Family, TinySpec, Variant
from headprobe.probe.model.families.llama import llama_config, llama_weights


def config(hf_config: Any) -> TransformerConfig:
    """The native config of a ``MixtralConfig`` (:func:`~headprobe.probe.model.families.llama.llama_config`;
    its ``hidden_act`` check covers the experts)."""
    return llama_config(
        hf_config,
        "mixtral",
        windows="every_layer",
        n_experts=hf_config.num_local_experts,
        n_experts_per_token=hf_config.num_experts_per_tok,
        router="softmax_topk",
        router_renorm=True,
    )


FAMILY = Family(
    config=config,
    weights=llama_weights,
    tiny=TinySpec(
        fields=dict(TINY_FIELDS, num_local_experts=4, num_experts_per_tok=2),
        layout=("GQA", "none", "none", None),
        perturb=("norm", "mlp.gate"),  # the router (and a dense layer's gate_proj)
        variants=(
            Variant(dict(sliding_window=8), "sliding window on every layer", layout=dict(windows=(8, 8))),
            Variant(dict(num_experts_per_tok=1), "one expert per token"),
        ),
        unsupported=(
            dict(rope_parameters={"rope_theta": 1e4, "rope_type": "linear", "factor": 2.0}),
            dict(hidden_act="gelu"),
        ),
    ),
)
