"""GPT-2 (``GPT2LMHeadModel``; Radford et al. 2019): learned positions, pre-LN blocks, biases,
tanh-GELU MLP.

Its projections are ``Conv1D`` modules whose weight is stored ``[in, out]`` (``y = x W + b``),
the transpose of ``nn.Linear``'s ``[out, in]``; the fused ``c_attn`` holds ``W_Q | W_K | W_V``
side by side along ``out``.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.hooks.names import block_path
from headprobe.probe.model.config import TransformerConfig
from headprobe.probe.model.families.base import TINY_VOCAB, Family, TinySpec, hf_sizes, renamed


def config(hf_config: Any) -> TransformerConfig:
    """The native config of a ``GPT2Config``.

    Raises:
        HeadprobeError: an activation other than ``gelu_new``/``gelu_pytorch_tanh``, or attention
            not scaled by ``1/sqrt(d_head)`` alone.
    """
    act = hf_config.activation_function
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise HeadprobeError(f"native GPT-2 implements activation gelu_new, not {act}")
    if getattr(hf_config, "scale_attn_by_inverse_layer_idx", False) or not getattr(
        hf_config, "scale_attn_weights", True
    ):
        raise HeadprobeError("native GPT-2 implements attention scaled by 1/sqrt(d_head) only")
    return TransformerConfig(
        **hf_sizes(hf_config, d_mlp=hf_config.n_inner or 4 * hf_config.n_embd),
        positional="learned",
        norm="layernorm",
        mlp="gelu",
        bias=True,
        norm_eps=hf_config.layer_norm_epsilon,
        tied_unembed=getattr(hf_config, "tie_word_embeddings", True),
    )


CONV1D = (("attn.o_proj", "attn.c_proj"), ("mlp.fc_in", "mlp.c_fc"), ("mlp.fc_out", "mlp.c_proj"))
"""Native name -> Hugging Face name of a layer's ``Conv1D`` projections other than the fused ``c_attn``."""


def weights(sd: dict[str, Tensor], cfg: TransformerConfig, rope_interleave: bool = False) -> dict[str, Tensor]:
    """Native parameter names and layouts from a ``GPT2LMHeadModel`` state dict.

    ``Conv1D`` weights are ``[in, out]``; ``nn.Linear`` wants ``[out, in]``, hence every ``.T``.
    ``rope_interleave`` is ignored (no rotary positions).
    """
    D = cfg.d_model
    out = {
        "embed.W_E.weight": sd["transformer.wte.weight"],
        "embed.W_pos.weight": sd["transformer.wpe.weight"],
        **renamed(sd, (("ln_final.norm", "transformer.ln_f"),)),
    }
    for l in range(cfg.n_layers):
        h, b = f"transformer.h.{l}.", block_path(l) + "."
        W_qkv, b_qkv = sd[h + "attn.c_attn.weight"], sd[h + "attn.c_attn.bias"]  # [d_model, 3 d_model], [3 d_model]
        for i, name in enumerate("qkv"):
            out[b + f"attn.{name}_proj.weight"] = W_qkv[:, i * D : (i + 1) * D].T
            out[b + f"attn.{name}_proj.bias"] = b_qkv[i * D : (i + 1) * D]
        out.update(renamed(sd, CONV1D, b, h, transposed=True))
        out.update(renamed(sd, (("ln1.norm", "ln_1"), ("ln2.norm", "ln_2")), b, h))
    out["unembed.weight"] = sd.get("lm_head.weight", sd["transformer.wte.weight"])
    return out


FAMILY = Family(
    config=config,
    weights=weights,
    embedding_names=("transformer.wte.weight", "lm_head.weight"),
    tiny=TinySpec(
        fields=dict(
            n_layer=2, n_head=4, n_embd=64, vocab_size=TINY_VOCAB, n_positions=128, bos_token_id=100, eos_token_id=100
        ),
        layout=("MHA", "all", "none", None),  # c_attn and c_proj carry biases
        attention_output="transformer.h.{l}.attn",
        unsupported=(dict(activation_function="relu"), dict(scale_attn_by_inverse_layer_idx=True)),
    ),
)
