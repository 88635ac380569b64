"""Granite (``GraniteForCausalLM``; IBM Granite 3): Llama's block with four scalars: the token
embedding times ``embedding_multiplier``, attention scores scaled by ``attention_multiplier``
(instead of ``1/sqrt(d_head)``), what attention and the MLP add to the residual times
``residual_multiplier``, and the logits divided by ``logits_scaling``."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from headprobe.probe.hooks.names import block_path
from headprobe.probe.model.config import TransformerConfig
from headprobe.probe.model.families.base import TINY_FIELDS, Family, TinySpec, Variant
from headprobe.probe.model.families.llama import llama_config, llama_weights


def config(hf_config: Any) -> TransformerConfig:
    """The native config of a ``GraniteConfig`` (:func:`~headprobe.probe.model.families.llama.llama_config`;
    full attention only)."""
    return llama_config(
        hf_config,
        "granite",
        attn_scale=float(hf_config.attention_multiplier),
        embedding_multiplier=_unless_one(hf_config.embedding_multiplier),
        logit_scale=None if hf_config.logits_scaling == 1 else 1 / float(hf_config.logits_scaling),
        residual_multiplier=_unless_one(hf_config.residual_multiplier),
    )


def _unless_one(x: float) -> float | None:
    return None if x == 1 else float(x)


def weights(sd: dict[str, Tensor], cfg: TransformerConfig, rope_interleave: bool = False) -> dict[str, Tensor]:
    """:func:`~headprobe.probe.model.families.llama.llama_weights` with ``residual_multiplier`` folded
    into every ``o_proj`` and MLP ``fc_out`` (``GraniteDecoderLayer``: ``residual + out *
    residual_multiplier``), so that the heads' results are what the residual stream receives."""
    out = llama_weights(sd, cfg, rope_interleave)
    if cfg.residual_multiplier is not None:
        for l in range(cfg.n_layers):
            for name in ("attn.o_proj.weight", "mlp.fc_out.weight"):
                key = f"{block_path(l)}.{name}"
                out[key] = out[key] * cfg.residual_multiplier
    return out


FAMILY = Family(
    config=config,
    weights=weights,
    tiny=TinySpec(
        fields=dict(TINY_FIELDS, embedding_multiplier=6.0, attention_multiplier=0.3, logits_scaling=0.5),
        layout=("GQA", "none", "none", None),
        variants=(
            Variant(dict(residual_multiplier=0.22, logits_scaling=8.0), "residual_multiplier, logits_scaling 8"),
            Variant(dict(residual_multiplier=0.22, tie_word_embeddings=True), "tied, residual_multiplier"),
        ),
        unsupported=(dict(attention_bias=True), dict(mlp_bias=True), dict(sliding_window=8)),
    ),
)
