"""GPT-OSS (``GptOssForCausalLM``; OpenAI 2025, "gpt-oss-120b & gpt-oss-20b Model Card"): Llama's
block with sliding-window and full attention layers alternating (``layer_types``), biases on every
attention projection, a learned sink logit per head (``self_attn.sinks``: the softmax runs over
``[scores, sink]`` and the sink's column is dropped), YaRN rotary scaling, and a mixture-of-experts
MLP (top-k router with a bias and a softmax over the k logits; experts with biases and a clamped
SwiGLU, their gate and up columns interleaved).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.hooks.names import block_path
from headprobe.probe.model.config import TransformerConfig
from headprobe.probe.model.families.base import (
    TINY_FIELDS,
    Family,
    TinySpec,
    Variant,
    hf_sizes,
    rope_parameters,
    rope_theta,
    sliding,
)
from headprobe.probe.model.families.llama import llama_weights

YARN_KEYS = {
    "rope_type",
    "rope_theta",
    "factor",
    "beta_fast",
    "beta_slow",
    "truncate",
    "original_max_position_embeddings",
    "attention_factor",
}
"""The ``rope_parameters`` of YaRN that the native rotary implements (``mscale`` and ``mscale_all_dim`` are refused)."""


def yarn_fields(hf_config: Any, kind: str) -> dict[str, Any]:
    """:class:`TransformerConfig`'s ``yarn_*`` fields of a config's ``rope_parameters`` (none for
    plain rotary), read as Hugging Face's ``_compute_yarn_parameters`` reads them.

    Raises:
        HeadprobeError: another rotary scaling, or YaRN options the native rotary does not implement.
    """
    params = rope_parameters(hf_config)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return {}
    if rope_type != "yarn" or set(params) - YARN_KEYS or params.get("factor") is None:
        extra = sorted(set(params) - YARN_KEYS)
        raise HeadprobeError(
            f"native {kind} implements plain and YaRN rotary positions (factor, beta_fast, beta_slow, "
            f"truncate, attention_factor), not rope_type={rope_type}" + (f" with {extra[0]}" if extra else "")
        )
    return dict(
        yarn_factor=float(params["factor"]),
        yarn_original_ctx=int(params["original_max_position_embeddings"]),
        yarn_beta=(float(params.get("beta_fast") or 32), float(params.get("beta_slow") or 1)),
        yarn_truncate=bool(params.get("truncate", True)),
        yarn_attention_factor=params.get("attention_factor"),
    )


def config(hf_config: Any) -> TransformerConfig:
    """The native config of a ``GptOssConfig``.

    Raises:
        HeadprobeError: a rotary scaling other than YaRN's, an activation other than SiLU, or
            layer types other than full and sliding attention.
    """
    if hf_config.hidden_act != "silu":
        raise HeadprobeError(f"native gpt_oss implements the clamped SwiGLU experts, not {hf_config.hidden_act}")
    n_heads, d_model, head_dim = hf_config.num_attention_heads, hf_config.hidden_size, hf_config.head_dim
    bias = bool(hf_config.attention_bias)
    return TransformerConfig(
        **hf_sizes(hf_config),
        n_kv_heads=hf_config.num_key_value_heads,
        d_head=head_dim if head_dim * n_heads != d_model else None,
        positional="rotary",
        norm="rmsnorm",
        mlp="swiglu",
        bias=bias,
        qkv_bias=bias,
        tied_unembed=bool(hf_config.tie_word_embeddings),
        norm_eps=hf_config.rms_norm_eps,
        rope_theta=rope_theta(hf_config),
        attn_sinks=True,
        n_experts=hf_config.num_local_experts,
        n_experts_per_token=hf_config.num_experts_per_tok,
        d_expert=hf_config.intermediate_size,
        router="topk_softmax",
        router_bias=True,
        expert_bias=True,
        swiglu_limit=float(hf_config.swiglu_limit),
        swiglu_alpha=float(hf_config.swiglu_alpha),
        **sliding(hf_config, "gpt_oss"),
        **yarn_fields(hf_config, "gpt_oss"),
    )


def weights(sd: dict[str, Tensor], cfg: TransformerConfig, rope_interleave: bool = False) -> dict[str, Tensor]:
    """Native parameter names from a GPT-OSS state dict: Llama's
    (:func:`~headprobe.probe.model.families.llama.llama_weights`, the mixture of experts with GPT-OSS's
    router and interleaved gate/up) plus each layer's learned sinks."""
    out = llama_weights(sd, cfg, rope_interleave, moe=dict(router="router", layout="interleaved"))
    for l in range(cfg.n_layers):
        out[block_path(l, "attn.sinks")] = sd[f"model.layers.{l}.self_attn.sinks"]
    return out


FAMILY = Family(
    config=config,
    weights=weights,
    tiny=TinySpec(
        fields=dict(TINY_FIELDS, head_dim=16, sliding_window=8, num_local_experts=4, num_experts_per_tok=2),
        layout=("GQA", "all", "none", (8, None)),  # layer 0 of 2 slides; biases on q, k, v and o
        perturb=("norm", "sinks", "router"),
        variants=(
            Variant(dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4}), "plain rotary"),
            Variant(
                dict(
                    rope_parameters={
                        "rope_type": "yarn",
                        "rope_theta": 100.0,
                        "factor": 4.0,
                        "beta_fast": 8.0,
                        "beta_slow": 1.0,
                        "original_max_position_embeddings": 16,
                        "truncate": True,
                    }
                ),
                "YaRN moving the frequencies of 20 tokens",
            ),
            Variant(dict(attention_bias=False), "no attention biases", layout=dict(bias="none")),
        ),
        unsupported=(
            dict(rope_parameters={"rope_theta": 1e4, "rope_type": "linear", "factor": 2.0}),
            dict(
                rope_parameters={
                    "rope_theta": 1.5e5,
                    "rope_type": "yarn",
                    "factor": 32.0,
                    "mscale": 1.0,
                    "mscale_all_dim": 1.0,
                    "original_max_position_embeddings": 4096,
                }
            ),
        ),
    ),
)
