"""Qwen3-MoE (``Qwen3MoeForCausalLM``; Yang et al. 2025): Qwen3's attention (per-head QK-norm, an
explicit ``head_dim``) with a mixture of gated experts as the MLP of every ``decoder_sparse_step``-th
layer not in ``mlp_only_layers`` (``Qwen3MoeSparseMoeBlock``: softmax over all router logits, top-k,
renormalised where ``norm_topk_prob``); the other layers keep a dense MLP of ``intermediate_size``."""

from __future__ import annotations

from typing import Any

from headprobe.probe.model.config import TransformerConfig
from headprobe.probe.model.families.base import TINY_FIELDS, Family, TinySpec, Variant
from headprobe.probe.model.families.llama import llama_config, llama_weights


def config(hf_config: Any) -> TransformerConfig:
    """The native config of a ``Qwen3MoeConfig`` (:func:`~headprobe.probe.model.families.llama.llama_config`;
    the MoE layers as ``Qwen3MoeDecoderLayer`` picks them)."""
    n, step, dense = hf_config.num_hidden_layers, hf_config.decoder_sparse_step, hf_config.mlp_only_layers or []
    layers = tuple(l for l in range(n) if l not in dense and hf_config.num_experts > 0 and (l + 1) % step == 0)
    moe: dict[str, Any] = {}
    if layers:
        moe = dict(
            n_experts=hf_config.num_experts,
            n_experts_per_token=hf_config.num_experts_per_tok,
            d_expert=hf_config.moe_intermediate_size,
            router="softmax_topk",
            router_renorm=bool(hf_config.norm_topk_prob),
            moe_layers=None if len(layers) == n else layers,
        )
    return llama_config(hf_config, "qwen3_moe", windows="every_layer", qk_norm="per_head", **moe)


FAMILY = Family(
    config=config,
    weights=llama_weights,
    tiny=TinySpec(
        fields=dict(
            TINY_FIELDS,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            norm_topk_prob=False,
        ),
        layout=("GQA", "none", "per_head", None),
        perturb=("norm", "mlp.gate"),  # the router (and a dense layer's gate_proj)
        variants=(
            Variant(dict(norm_topk_prob=True, mlp_only_layers=[0]), "norm_topk_prob, a dense layer 0"),
            Variant(
                dict(decoder_sparse_step=2, head_dim=8),
                "MoE every other layer, n_heads * head_dim != d_model",
                layout=dict(d_head=8),
            ),
            Variant(
                dict(use_sliding_window=True, sliding_window=8),
                "sliding window on every layer",
                layout=dict(windows=(8, 8)),
            ),
        ),
        unsupported=(dict(attention_bias=True), dict(hidden_act="gelu")),
    ),
)
