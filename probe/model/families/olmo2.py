"""OLMo-2 (``Olmo2ForCausalLM``; OLMo et al. 2024): Llama's attention with an RMSNorm over the
whole q and k projections (``q_norm``/``k_norm`` of size ``n_heads * head_dim``), and norms after
attention and after the MLP instead of before them."""

from __future__ import annotations

from functools import partial
from typing import Any

from headprobe.probe.model.config import TransformerConfig
from headprobe.probe.model.families.base import TINY_FIELDS, Family, TinySpec
from headprobe.probe.model.families.llama import llama_config, llama_weights

NORMS = {"ln1_post": "post_attention_layernorm", "ln2_post": "post_feedforward_layernorm"}
"""Native norm of an OLMo-2 layer -> the Hugging Face norm it loads (no pre norms)."""


def config(hf_config: Any) -> TransformerConfig:
    """The native config of an ``Olmo2Config`` (:func:`~headprobe.probe.model.families.llama.llama_config`)."""
    return llama_config(hf_config, "olmo2", qk_norm="full", pre_norm=False, post_norm=True)


FAMILY = Family(
    config=config,
    weights=partial(llama_weights, norms=NORMS),
    tiny=TinySpec(
        fields=dict(TINY_FIELDS),
        layout=("GQA", "none", "full", None),
        attention_output="model.layers.{l}.post_attention_layernorm",
        post_attention_norm=True,
        unprunable="QK-norm",  # one norm over all heads' queries: a head cannot be taken out alone
        unsupported=(dict(sliding_window=8),),
    ),
)
