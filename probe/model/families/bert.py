"""BERT encoders (``BertModel``; Devlin et al. 2019; e.g. sentence-transformers'
all-MiniLM-L6-v2; a ``bert.`` prefix, as in ``BertForMaskedLM``, is stripped, its MLM head is
not loaded): bidirectional attention, post-LN blocks, learned absolute positions, an embedding
LayerNorm, exact-GELU MLP.

The token-type embedding of type 0 (every token of a single-segment input) is added to the
position table, so ``hook_pos_embed`` holds ``position + token_type[0]``. The model has no LM
head: the tied word embedding stands in as unembedding, so its logits and LM losses carry no
meaning (``headprobe scan`` verifies encoders with a sentence-embedding metric instead;
:mod:`headprobe.analyses.ablation`).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.hooks.names import block_path
from headprobe.probe.model.config import TransformerConfig
from headprobe.probe.model.families.base import TINY_ENCODER_VOCAB, Family, TinySpec, gelu_mlp, hf_sizes, renamed


def config(hf_config: Any) -> TransformerConfig:
    """The native config of a ``BertConfig``: bidirectional attention, post-LN blocks, learned
    absolute positions, embedding LayerNorm, biases, GELU MLP.

    Raises:
        HeadprobeError: a non-GELU MLP, relative positions, or BERT as a causal decoder.
    """
    mlp = gelu_mlp(hf_config.hidden_act, "BERT")
    if getattr(hf_config, "position_embedding_type", "absolute") != "absolute":
        raise HeadprobeError(f"native BERT implements absolute positions, not {hf_config.position_embedding_type}")
    if getattr(hf_config, "is_decoder", False):
        raise HeadprobeError("native BERT implements the bidirectional encoder, not BERT as a causal decoder")
    return TransformerConfig(
        **hf_sizes(hf_config),
        positional="learned",
        norm="layernorm",
        mlp=mlp,
        bias=True,
        tied_unembed=True,
        norm_eps=hf_config.layer_norm_eps,
        final_norm=False,
        pre_norm=False,
        post_ln=True,
        embed_norm=True,
        causal=False,
    )


LAYER = (
    ("attn.q_proj", "attention.self.query"),
    ("attn.k_proj", "attention.self.key"),
    ("attn.v_proj", "attention.self.value"),
    ("attn.o_proj", "attention.output.dense"),
    ("ln1.norm", "attention.output.LayerNorm"),
    ("mlp.fc_in", "intermediate.dense"),
    ("mlp.fc_out", "output.dense"),
    ("ln2.norm", "output.LayerNorm"),
)
"""Native name -> Hugging Face name of every module of an encoder layer."""


def weights(sd: dict[str, Tensor], cfg: TransformerConfig, rope_interleave: bool = False) -> dict[str, Tensor]:
    """Native parameter names from a ``BertModel`` state dict (or a ``BertFor...`` one, whose
    names start with ``bert.``; heads such as the pooler or the MLM head are not loaded).

    The type-0 token-type embedding is folded into the position table (see the module docstring).
    ``rope_interleave`` is ignored (no rotary positions).
    """
    p = "bert." if "bert.embeddings.word_embeddings.weight" in sd else ""
    e = p + "embeddings."
    out = {
        "embed.W_E.weight": sd[e + "word_embeddings.weight"],
        "embed.W_pos.weight": sd[e + "position_embeddings.weight"][: cfg.n_ctx]
        + sd[e + "token_type_embeddings.weight"][0],
        **renamed(sd, (("ln_embed.norm", "LayerNorm"),), theirs=e),
    }
    for l in range(cfg.n_layers):
        out.update(renamed(sd, LAYER, block_path(l) + ".", f"{p}encoder.layer.{l}."))
    out["unembed.weight"] = out["embed.W_E.weight"]
    return out


FAMILY = Family(
    config=config,
    weights=weights,
    encoder=True,
    tiny=TinySpec(
        fields=dict(
            num_hidden_layers=2,
            num_attention_heads=4,
            hidden_size=64,
            intermediate_size=128,
            vocab_size=TINY_ENCODER_VOCAB,
            max_position_embeddings=128,
            type_vocab_size=2,
            pad_token_id=103,
        ),
        layout=("MHA", "all", "none", None),  # query/key/value and the output dense carry biases
        attention_output="encoder.layer.{l}.attention.output.dense",
        bridge=False,  # TransformerLens' BERT adapter wants BertForMaskedLM; the bare encoder is refused
        perturb=("LayerNorm", "token_type"),
        unsupported=(dict(position_embedding_type="relative_key"), dict(hidden_act="relu"), dict(is_decoder=True)),
    ),
)
