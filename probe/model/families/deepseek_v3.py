"""DeepSeek-V3 with dense MLPs only (``DeepseekV3ForCausalLM`` with ``first_k_dense_replace >=
num_hidden_layers``; DeepSeek-AI 2024): Llama's block around multi-head latent attention (MLA)
with its own nope/rope/value widths, an optional query latent (``q_lora_rank``) and interleaved
rotary pairs (``rope_interleave``). Mixture-of-experts layers are refused.
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
    Variant,
    hf_sizes,
    plain_rope,
    renamed,
    rope_theta,
)


def config(hf_config: Any) -> TransformerConfig:
    """The native config of a dense ``DeepseekV3Config``.

    Raises:
        HeadprobeError: rotary scaling, a mixture-of-experts layer, attention biases, a non-SwiGLU
            MLP, or an ``rms_norm_eps`` other than its latent norms' 1e-6.
    """
    plain_rope(hf_config, "DeepSeek-V3")
    n_layers = hf_config.num_hidden_layers
    if hf_config.first_k_dense_replace < n_layers:
        raise HeadprobeError(
            f"native DeepSeek-V3 implements dense MLPs only; layers {hf_config.first_k_dense_replace}.."
            f"{n_layers - 1} are mixture-of-experts: use --backend transformer-lens"
        )
    if getattr(hf_config, "attention_bias", False) or hf_config.hidden_act != "silu":
        raise HeadprobeError("native DeepSeek-V3 implements bias-free attention and a SwiGLU MLP only")
    if hf_config.rms_norm_eps != 1e-6:  # the latent norms keep DeepseekV3RMSNorm's default eps
        raise HeadprobeError(
            f"native DeepSeek-V3 needs rms_norm_eps 1e-6 (that of its latent norms), got {hf_config.rms_norm_eps}"
        )
    n_heads, d_model, d_v = hf_config.num_attention_heads, hf_config.hidden_size, hf_config.v_head_dim
    return TransformerConfig(
        **hf_sizes(hf_config),
        positional="rotary",
        norm="rmsnorm",
        mlp="swiglu",
        bias=False,
        tied_unembed=getattr(hf_config, "tie_word_embeddings", False),
        norm_eps=hf_config.rms_norm_eps,
        rope_theta=rope_theta(hf_config),
        d_head=None if d_v * n_heads == d_model else d_v,
        kv_lora_rank=hf_config.kv_lora_rank,
        qk_rope_head_dim=hf_config.qk_rope_head_dim,
        qk_nope_head_dim=None if hf_config.qk_nope_head_dim == d_v else hf_config.qk_nope_head_dim,
        q_lora_rank=hf_config.q_lora_rank,
    )


LAYER = (
    ("attn.kv_norm", "self_attn.kv_a_layernorm"),
    ("attn.kv_up", "self_attn.kv_b_proj"),
    ("attn.o_proj", "self_attn.o_proj"),
    *GATED_MLP,
    ("ln1.norm", "input_layernorm"),
    ("ln2.norm", "post_attention_layernorm"),
)
"""Native name -> Hugging Face name of a layer's weights that load as they are (the rotary rows
of the query and the latent's ``kv_a_proj_with_mqa`` are reordered, see :func:`weights`)."""


def weights(sd: dict[str, Tensor], cfg: TransformerConfig, rope_interleave: bool = False) -> dict[str, Tensor]:
    """Native parameter names from a dense ``DeepseekV3ForCausalLM`` state dict.

    ``kv_b_proj`` holds, per head, the key's non-rotary part then the value (as ``kv_up``).
    With ``rope_interleave`` Hugging Face rotates adjacent pairs ``(2i, 2i+1)`` of the rotary
    query/key parts; ordering those rows evens-then-odds turns that into the ``rotate_half``
    rotation the native model applies (the same permutation on queries and keys, so scores are
    unchanged).
    """
    H, R, N, r = cfg.n_heads, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.kv_lora_rank
    assert N is not None and r is not None  # MLA, filled by TransformerConfig.__post_init__
    perm = torch.cat([torch.arange(0, R, 2), torch.arange(1, R, 2)]) if rope_interleave else torch.arange(R)

    def q_rows(W: Tensor) -> Tensor:  # [H * (N + R), in]: permute each head's rotary rows
        W = W.view(H, N + R, -1)
        return torch.cat([W[:, :N], W[:, N:][:, perm]], dim=1).reshape(H * (N + R), -1)

    out = {"embed.W_E.weight": sd["model.embed_tokens.weight"]}
    for l in range(cfg.n_layers):
        h, b = f"model.layers.{l}.", block_path(l) + "."
        if cfg.q_lora_rank is None:
            out[b + "attn.q_proj.weight"] = q_rows(sd[h + "self_attn.q_proj.weight"])
        else:
            out[b + "attn.q_down.weight"] = sd[h + "self_attn.q_a_proj.weight"]
            out[b + "attn.q_down_norm.weight"] = sd[h + "self_attn.q_a_layernorm.weight"]
            out[b + "attn.q_up.weight"] = q_rows(sd[h + "self_attn.q_b_proj.weight"])
        W_kv = sd[h + "self_attn.kv_a_proj_with_mqa.weight"]  # [r + R, d_model]
        out[b + "attn.kv_down.weight"] = torch.cat([W_kv[:r], W_kv[r:][perm]])
        out.update(renamed(sd, LAYER, b, h, params=("weight",)))
    out["ln_final.norm.weight"] = sd["model.norm.weight"]
    out["unembed.weight"] = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
    return out


FAMILY = Family(
    config=config,
    weights=weights,
    tiny=TinySpec(
        fields=dict(
            TINY_FIELDS,
            num_key_value_heads=4,
            kv_lora_rank=32,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=2,
        ),  # MLA, dense MLPs
        layout=("MLA", "none", "none", None),
        unprunable="MLA",  # heads share the latent projections
        variants=(
            Variant(
                dict(q_lora_rank=24, rope_interleave=True),
                "the query latent",
                layout=dict(qk_nope_head_dim=16, d_head=16, q_lora_rank=24),
            ),
            Variant(
                dict(qk_nope_head_dim=12, v_head_dim=28, rope_interleave=False),
                "values wider than q/k",
                layout=dict(qk_nope_head_dim=12, d_head=28, q_lora_rank=None),
            ),
        ),
        unsupported=(dict(first_k_dense_replace=1), dict(rms_norm_eps=1e-5)),
    ),
)
