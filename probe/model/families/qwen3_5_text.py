"""Qwen3.5's text model (``Qwen3_5ForCausalLM``, ``model_type`` ``qwen3_5_text``): the attention of
Qwen3-Next (gated, partial rotary, ``(1 + w)`` norms and QK-norm; text positions, where the
multimodal rotary sections all take the same position) with dense MLPs; its Gated-DeltaNet
layers run Hugging Face's module, as Qwen3-Next's (:mod:`headprobe.probe.model.families.qwen3_next`)."""

from __future__ import annotations

from typing import Any

from headprobe.probe.model.config import TransformerConfig
from headprobe.probe.model.families.base import Family, TinySpec
from headprobe.probe.model.families.qwen3_next import HYBRID, TINY, gated_config, weights


def config(hf_config: Any) -> TransformerConfig:
    """The native config of a ``Qwen3_5TextConfig`` (:func:`~headprobe.probe.model.families.qwen3_next.gated_config`)."""
    return gated_config(hf_config, "qwen3_5_text")


FAMILY = Family(
    config=config,
    weights=weights,
    tiny=TinySpec(
        fields={k: v for k, v in TINY.items() if k != "num_experts"},
        layout=("GQA", "none", "per_head", None),
        norm_offset=1.0,
        unprunable="gated attention",
        unsupported=(dict(attention_bias=True),),
        hybrid=HYBRID,
    ),
)
