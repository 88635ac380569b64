"""Llama-4's text model (``Llama4ForCausalLM``, ``model_type`` ``llama4_text``; Meta 2025):
Llama's block with chunked local attention on the rotary layers (``attention_chunk_size``),
NoPE layers (``no_rope_layers`` 0: no rotary) with query temperature tuning, a weightless
L2 (RMS) norm on queries and keys after rotary on the rotary layers (``use_qk_norm``), an
explicit ``head_dim``, the dense MLP's own width (``intermediate_size_mlp``) and mixture-of-experts
MLPs on ``moe_layers`` (sigmoid of the top-k router logits weighting the expert's input, plus a
shared expert; :class:`~headprobe.probe.model.feedforward.MoE`).

Llama-4's rotary multiplies adjacent pairs ``(2i, 2i+1)`` as complex numbers; ordering each
head's query and key rows evens-then-odds turns it into the ``rotate_half`` rotation the native
model applies (as DeepSeek's ``rope_interleave``; the L2 norm and the scores are unchanged by
the permutation).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.model.config import TransformerConfig
from headprobe.probe.model.families.base import (
    TINY_FIELDS,
    Family,
    TinySpec,
    Variant,
    hf_sizes,
    layer_ropes,
)
from headprobe.probe.model.families.llama import llama_weights


def config(hf_config: Any) -> TransformerConfig:
    """The native config of a ``Llama4TextConfig``.

    Raises:
        HeadprobeError: rotary scaling, biases, an activation other than SiLU, or a layer type
            other than full or chunked attention.
    """
    moe = tuple(hf_config.moe_layers)
    experts = (
        dict(
            n_experts=hf_config.num_local_experts,
            n_experts_per_token=hf_config.num_experts_per_tok,
            d_expert=hf_config.intermediate_size,
            router="topk_sigmoid",
            router_on_input=True,
            d_shared_expert=hf_config.intermediate_size,
            moe_layers=moe,
        )
        if moe
        else {}
    )
    if getattr(hf_config, "attention_bias", False) or hf_config.hidden_act != "silu":
        raise HeadprobeError("native llama4_text implements bias-free attention and a SwiGLU MLP only")
    types = list(hf_config.layer_types)
    unknown = sorted(set(types) - {"full_attention", "chunked_attention"})
    if unknown:
        raise HeadprobeError(f"native llama4_text implements full and chunked attention layers, not {unknown[0]}")
    chunked = tuple(l for l, t in enumerate(types) if t == "chunked_attention")
    nope = tuple(l for l, rope in enumerate(hf_config.no_rope_layers) if not rope)
    n_heads, d_model = hf_config.num_attention_heads, hf_config.hidden_size
    head_dim = getattr(hf_config, "head_dim", None) or d_model // n_heads
    return TransformerConfig(
        **hf_sizes(hf_config, d_mlp=hf_config.intermediate_size_mlp),
        n_kv_heads=hf_config.num_key_value_heads,
        positional="rotary",
        norm="rmsnorm",
        mlp="swiglu",
        bias=False,
        tied_unembed=hf_config.tie_word_embeddings,
        norm_eps=hf_config.rms_norm_eps,
        **layer_ropes(hf_config, "llama4_text", nope),
        d_head=None if head_dim * n_heads == d_model else head_dim,
        attention_chunk=hf_config.attention_chunk_size if chunked else None,
        chunked_layers=None if len(chunked) == len(types) else chunked,
        qk_l2_norm=bool(hf_config.use_qk_norm),
        attn_temperature=(float(hf_config.floor_scale), float(hf_config.attn_scale))
        if hf_config.attn_temperature_tuning and nope
        else None,
        **experts,
    )


NORMS = {"ln1": "input_layernorm", "ln2": "post_attention_layernorm"}


def weights(sd: dict[str, Tensor], cfg: TransformerConfig, rope_interleave: bool = False) -> dict[str, Tensor]:
    """Native parameter names from a ``Llama4ForCausalLM`` state dict: Llama's, with the MLP under
    ``feed_forward`` (a mixture of experts by :func:`~headprobe.probe.model.families.base.moe_weights`) and
    each head's q/k rows of a rotary layer ordered evens-then-odds (module docstring)."""
    d = cfg.d_qk
    perm = torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])
    sd = {k.replace(".feed_forward.", ".mlp."): v for k, v in sd.items()}
    for l in range(cfg.n_layers):
        if cfg.is_nope(l):
            continue
        for name in ("q_proj", "k_proj"):
            key = f"model.layers.{l}.self_attn.{name}.weight"
            W = sd[key]
            sd[key] = W.view(-1, d, W.shape[-1])[:, perm].reshape(W.shape)
    return llama_weights(sd, cfg, norms=NORMS, moe=dict(router="router", layout="transposed", shared="shared_expert"))


FAMILY = Family(
    config=config,
    weights=weights,
    tiny=TinySpec(
        fields=dict(
            TINY_FIELDS,
            head_dim=16,
            intermediate_size=48,
            intermediate_size_mlp=128,
            moe_layers=[1],
            num_local_experts=4,
            num_experts_per_tok=2,
            no_rope_layers=[1, 0],
            attention_chunk_size=8,
            floor_scale=4,
        ),  # layer 0: rotary, chunks of 8, dense; layer 1: NoPE, full, MoE
        layout=("GQA", "none", "none", (8, None)),  # a chunk is the layer's window in the layout
        perturb=("norm", "router"),
        variants=(
            Variant(dict(use_qk_norm=False, attn_temperature_tuning=False), "no QK L2 norm, no temperature"),
            Variant(dict(moe_layers=[]), "dense MLPs only"),
            Variant(dict(no_rope_layers=[0, 1], attention_chunk_size=6), "NoPE first, chunks of 6"),
        ),
        unsupported=(
            dict(attention_bias=True),
            dict(rope_parameters={"rope_theta": 5e5, "rope_type": "linear", "factor": 2.0}),
        ),
    ),
)
