"""GPT-NeoX / Pythia (``GPTNeoXForCausalLM``; Black et al. 2022, Biderman et al. 2023): parallel
attention and MLP (``use_parallel_residual``), rotary on the first ``rotary_pct`` of each head, a
fused per-head q|k|v projection, biases, exact-GELU MLP, an untied unembedding.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.hooks.names import block_path
from headprobe.probe.model.config import TransformerConfig
from headprobe.probe.model.families.base import (
    TINY_VOCAB,
    Family,
    TinySpec,
    Variant,
    gelu_mlp,
    hf_sizes,
    plain_rope,
    renamed,
    rope_parameters,
    rope_theta,
)


def config(hf_config: Any) -> TransformerConfig:
    """The native config of a ``GPTNeoXConfig``.

    Raises:
        HeadprobeError: rotary scaling, a non-GELU MLP, attention without biases, or an odd
            rotary width.
    """
    plain_rope(hf_config, "GPT-NeoX")
    mlp = gelu_mlp(hf_config.hidden_act, "GPT-NeoX")
    if not getattr(hf_config, "attention_bias", True):
        raise HeadprobeError("native GPT-NeoX implements attention with biases only")
    n_heads, d_model = hf_config.num_attention_heads, hf_config.hidden_size
    d_head = d_model // n_heads
    factor = rope_parameters(hf_config).get("partial_rotary_factor", getattr(hf_config, "rotary_pct", 1.0))
    rotary_dim = int(d_head * factor)
    if rotary_dim % 2 or rotary_dim < 2:
        raise HeadprobeError(f"native GPT-NeoX needs an even rotary width, got {rotary_dim} of d_head {d_head}")
    return TransformerConfig(
        **hf_sizes(hf_config),
        positional="rotary",
        norm="layernorm",
        mlp=mlp,
        bias=True,
        norm_eps=hf_config.layer_norm_eps,
        tied_unembed=getattr(hf_config, "tie_word_embeddings", False),
        rope_theta=rope_theta(hf_config),
        rotary_dim=None if rotary_dim == d_head else rotary_dim,
        parallel_residual=bool(hf_config.use_parallel_residual),
    )


LAYER = (
    ("attn.o_proj", "attention.dense"),
    ("mlp.fc_in", "mlp.dense_h_to_4h"),
    ("mlp.fc_out", "mlp.dense_4h_to_h"),
    ("ln1.norm", "input_layernorm"),
    ("ln2.norm", "post_attention_layernorm"),
)
"""Native name -> Hugging Face name of a layer's modules other than the fused ``query_key_value``."""


def weights(sd: dict[str, Tensor], cfg: TransformerConfig, rope_interleave: bool = False) -> dict[str, Tensor]:
    """Native parameter names and layouts from a ``GPTNeoXForCausalLM`` state dict.

    The fused ``query_key_value`` (``[3 d_model, d_model]``) is laid out per head: its output,
    viewed as ``[head, 3, d_head]``, holds head ``h``'s query, key and value side by side
    (Hugging Face's ``view(..., -1, 3 * head_size).chunk(3, -1)``), not ``W_Q | W_K | W_V``.
    ``rope_interleave`` is ignored (NeoX rotates halves).
    """
    H, d_head, D = cfg.n_heads, cfg.d_head, cfg.d_model
    assert d_head is not None  # filled by TransformerConfig.__post_init__
    out = {
        "embed.W_E.weight": sd["gpt_neox.embed_in.weight"],
        **renamed(sd, (("ln_final.norm", "gpt_neox.final_layer_norm"),)),
    }
    for l in range(cfg.n_layers):
        h, b = f"gpt_neox.layers.{l}.", block_path(l) + "."
        W = sd[h + "attention.query_key_value.weight"].view(H, 3, d_head, D)
        bias = sd[h + "attention.query_key_value.bias"].view(H, 3, d_head)
        for i, name in enumerate("qkv"):
            out[b + f"attn.{name}_proj.weight"] = W[:, i].reshape(H * d_head, D)
            out[b + f"attn.{name}_proj.bias"] = bias[:, i].reshape(H * d_head)
        out.update(renamed(sd, LAYER, b, h))
    unembed = sd.get("lm_head.weight", sd.get("embed_out.weight"))
    if unembed is None and cfg.tied_unembed:  # safetensors keeps one name of a tied pair
        unembed = sd["gpt_neox.embed_in.weight"]
    if unembed is None:
        raise KeyError("lm_head.weight")
    out["unembed.weight"] = unembed
    return out


FAMILY = Family(
    config=config,
    weights=weights,
    embedding_names=("gpt_neox.embed_in.weight", "embed_out.weight"),
    tiny=TinySpec(
        fields=dict(
            num_hidden_layers=2,
            num_attention_heads=4,
            hidden_size=64,
            intermediate_size=128,
            vocab_size=TINY_VOCAB,
            max_position_embeddings=128,
            bos_token_id=100,
            eos_token_id=100,
            rotary_pct=0.25,
        ),
        layout=("MHA", "all", "none", None),  # query_key_value and dense carry biases
        attention_output="gpt_neox.layers.{l}.attention",
        self_check_reference="resid_post - resid_pre - mlp_out",  # the parallel block has no resid_mid
        variants=(Variant(dict(use_parallel_residual=False, rotary_pct=0.5), "sequential NeoX"),),
        unsupported=(dict(hidden_act="relu"),),
    ),
)
