"""Cohere2 (``Cohere2ForCausalLM``; Command R7B, Command A): attention and a SwiGLU MLP in
parallel on one LayerNorm without bias (``resid + attn(ln(resid)) + mlp(ln(resid))``), rotary
positions with interleaved pairs (Cohere's ``rotate_half``) on the sliding-window layers only
(the full-attention layers have none), and logits multiplied by ``logit_scale``.

The native parallel block has a norm per branch: both load the one LayerNorm's weight, with a
zero bias.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.hooks.names import block_path
from headprobe.probe.model.config import TransformerConfig
from headprobe.probe.model.families.base import (
    GATED_MLP,
    TINY_FIELDS,
    Family,
    TinySpec,
    hf_sizes,
    layer_ropes,
    renamed,
    sliding,
)


def config(hf_config: Any) -> TransformerConfig:
    """The native config of a ``Cohere2Config``.

    Raises:
        HeadprobeError: rotary scaling, another activation than SiLU, or attention biases.
    """
    if hf_config.hidden_act != "silu":
        raise HeadprobeError(f"native cohere2 implements the silu gated MLP, not {hf_config.hidden_act}")
    if getattr(hf_config, "attention_bias", False):
        raise HeadprobeError("native cohere2 implements projections without biases only")
    windows = sliding(hf_config, "cohere2")
    full = {l for l, t in enumerate(hf_config.layer_types) if t != "sliding_attention"}  # NoPE
    n_heads, d_model = hf_config.num_attention_heads, hf_config.hidden_size
    head_dim = getattr(hf_config, "head_dim", None) or d_model // n_heads
    return TransformerConfig(
        **hf_sizes(hf_config),
        n_kv_heads=getattr(hf_config, "num_key_value_heads", None) or n_heads,
        d_head=head_dim,
        positional="rotary",
        norm="layernorm",
        mlp="swiglu",
        bias=False,
        tied_unembed=getattr(hf_config, "tie_word_embeddings", True),
        norm_eps=hf_config.layer_norm_eps,
        parallel_residual=True,
        rotary_interleaved=True,
        logit_scale=float(hf_config.logit_scale),
        **layer_ropes(hf_config, "cohere2", full),
        **windows,
    )


def weights(sd: dict[str, Tensor], cfg: TransformerConfig, rope_interleave: bool = False) -> dict[str, Tensor]:
    """Native parameter names from a ``Cohere2ForCausalLM`` state dict (``rope_interleave`` is
    ignored: the native model rotates Cohere's interleaved pairs itself, ``rotary_interleaved``)."""
    out = {"embed.W_E.weight": sd["model.embed_tokens.weight"]}
    for l in range(cfg.n_layers):
        h, b = f"model.layers.{l}.", block_path(l) + "."
        out.update(
            renamed(sd, tuple((f"attn.{n}_proj", f"self_attn.{n}_proj") for n in "qkvo"), b, h, params=("weight",))
        )
        out.update(renamed(sd, GATED_MLP, b, h, params=("weight",)))
        w = sd[h + "input_layernorm.weight"]
        for i, norm in enumerate(("ln1", "ln2")):
            out[b + f"{norm}.norm.weight"] = w if i == 0 else w.clone()
            out[b + f"{norm}.norm.bias"] = torch.zeros_like(w)
    out["ln_final.norm.weight"] = sd["model.norm.weight"]
    out["ln_final.norm.bias"] = torch.zeros_like(sd["model.norm.weight"])
    out["unembed.weight"] = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
    return out


FAMILY = Family(
    config=config,
    weights=weights,
    tiny=TinySpec(
        # layer 0 full and NoPE, layer 1 slides and rotates (full after sliding would see equal windows
        # of a repeated block as equal keys, and argmax near-ties of the streamed statistics)
        fields=dict(
            TINY_FIELDS, sliding_window=8, layer_types=["full_attention", "sliding_attention"], logit_scale=0.3
        ),
        layout=("GQA", "none", "none", (None, 8)),
        self_check_reference="resid_post - resid_pre - mlp_out",  # the parallel block has no resid_mid
        unsupported=(
            dict(rope_parameters={"rope_theta": 1e4, "rope_type": "linear", "factor": 2.0}),
            dict(hidden_act="gelu"),
            dict(attention_bias=True),
        ),
    ),
)
