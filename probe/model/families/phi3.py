"""Phi-3 (``Phi3ForCausalLM``; Abdin et al. 2024): Llama's block with fused projections, q|k|v in
one ``qkv_proj`` and gate|up in one ``gate_up_proj`` (split at load), rotary on the first
``partial_rotary_factor`` of each head (Phi-4-mini) and a ``sliding_window`` on every layer where
the config has one."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from headprobe.probe.model.config import TransformerConfig
from headprobe.probe.model.families.base import TINY_FIELDS, Family, TinySpec, Variant, rope_parameters
from headprobe.probe.model.families.llama import llama_config, llama_weights


def config(hf_config: Any) -> TransformerConfig:
    """The native config of a ``Phi3Config`` (:func:`~headprobe.probe.model.families.llama.llama_config`;
    ``rotary_dim`` as ``Phi3RotaryEmbedding``: ``int(head_dim * partial_rotary_factor)``)."""
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    rotary_dim = int(head_dim * rope_parameters(hf_config).get("partial_rotary_factor", 1.0))
    return llama_config(
        hf_config, "phi3", windows="every_layer", rotary_dim=None if rotary_dim == head_dim else rotary_dim
    )


def weights(sd: dict[str, Tensor], cfg: TransformerConfig, rope_interleave: bool = False) -> dict[str, Tensor]:
    """:func:`~headprobe.probe.model.families.llama.llama_weights` after splitting ``qkv_proj`` into its
    query, key and value rows and ``gate_up_proj`` into gate then up rows (``Phi3Attention``,
    ``Phi3MLP``: views, no copy)."""
    assert cfg.n_kv_heads is not None and cfg.d_head is not None  # filled by TransformerConfig.__post_init__
    q, kv = cfg.n_heads * cfg.d_head, cfg.n_kv_heads * cfg.d_head
    sd = dict(sd)
    for l in range(cfg.n_layers):
        h = f"model.layers.{l}."
        W = sd.pop(h + "self_attn.qkv_proj.weight")
        sd[h + "self_attn.q_proj.weight"], sd[h + "self_attn.k_proj.weight"], sd[h + "self_attn.v_proj.weight"] = (
            W.split([q, kv, kv])
        )
        sd[h + "mlp.gate_proj.weight"], sd[h + "mlp.up_proj.weight"] = sd.pop(h + "mlp.gate_up_proj.weight").chunk(2)
    return llama_weights(sd, cfg, rope_interleave)


FAMILY = Family(
    config=config,
    weights=weights,
    tiny=TinySpec(
        fields=dict(TINY_FIELDS),
        layout=("GQA", "none", "none", None),
        variants=(
            Variant(
                dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
                "partial rotary",
            ),
            Variant(dict(sliding_window=8), "sliding window on every layer", layout=dict(windows=(8, 8))),
        ),
        unsupported=(
            dict(
                rope_parameters={
                    "rope_type": "longrope",
                    "rope_theta": 1e4,
                    "short_factor": [1.0] * 8,
                    "long_factor": [1.0] * 8,
                    "original_max_position_embeddings": 64,
                }
            ),
            dict(hidden_act="gelu"),
        ),
    ),
)
