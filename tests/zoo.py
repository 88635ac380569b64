"""The architecture zoo: tiny seeded random-init Hugging Face checkpoints of every family headprobe
claims (2 layers, d_model 64, 4 query heads on 2 KV heads where the family has GQA), made on the
fly with transformers, no download. Each is a few hundred KB.

``ZOO`` maps a family (Hugging Face ``model_type``) to the config fields that make it tiny;
:func:`make_checkpoint` builds the model and :func:`save_dir` writes a Hugging Face model
directory (config, safetensors, tokenizer) for the command-line tests.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 101  # word-level t0..t99 plus <|endoftext|> (id 100)
_COMMON = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64, intermediate_size=128,
               vocab_size=VOCAB, max_position_embeddings=128, bos_token_id=100, eos_token_id=100, pad_token_id=100)

ZOO: dict[str, dict] = {
    "gpt2": dict(n_layer=2, n_head=4, n_embd=64, vocab_size=VOCAB, n_positions=128, bos_token_id=100, eos_token_id=100),
    "llama": dict(_COMMON),
    "mistral": dict(_COMMON, sliding_window=8),
    "qwen2": dict(_COMMON),  # q/k/v biases
    "qwen3": dict(_COMMON, head_dim=16),  # QK-norm
    "olmo2": dict(_COMMON),  # QK-norm, post-attention RMSNorm
    "gemma2": dict(_COMMON, head_dim=16, sliding_window=8, query_pre_attn_scalar=16),  # pre+post norms, softcapping
    "gpt_neox": dict(num_hidden_layers=2, num_attention_heads=4, hidden_size=64, intermediate_size=128, vocab_size=VOCAB,
                     max_position_embeddings=128, bos_token_id=100, eos_token_id=100, rotary_pct=0.25),  # parallel block
    "deepseek_v3": dict(_COMMON, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8,
                        qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                        topk_group=1, first_k_dense_replace=2),  # MLA, dense MLPs
}
"""Family -> tiny config fields."""


def make_checkpoint(family: str, tokenizer, seed: int = 0, **change):
    """A :class:`~headprobe.probe.loading.Checkpoint` holding a tiny random ``family`` model
    (float32, eager attention; every bias and norm weight randomised so that each term is tested);
    ``change`` overrides config fields of :data:`ZOO` (variants of a family)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from headprobe.probe.loading import Checkpoint

    cfg = AutoConfig.for_model(family, **{**ZOO[family], **change})
    cfg.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family]]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return Checkpoint(f"tiny-{family}", f"tiny-{family}", "float32 (random init)", model, tokenizer)


def save_dir(family: str, tokenizer, out: Path) -> Path:
    """Write the tiny ``family`` checkpoint as a Hugging Face model directory at ``out``."""
    ckpt = make_checkpoint(family, tokenizer)
    ckpt.hf_model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


ENCODER_VOCAB = 104  # word-level t0..t99, [CLS] 100, [SEP] 101, [UNK] 102, [PAD] 103
ENCODER_ZOO: dict[str, dict] = {
    "bert": dict(num_hidden_layers=2, num_attention_heads=4, hidden_size=64, intermediate_size=128,
                 vocab_size=ENCODER_VOCAB, max_position_embeddings=128, type_vocab_size=2, pad_token_id=103),
}
"""Encoder family -> tiny config fields (kept apart from :data:`ZOO`, whose families are causal LMs)."""


def encoder_tokenizer(save_dir: Path):
    """A word-level tokenizer over ``t0 .. t99`` with BERT's special tokens ``[CLS]`` (100),
    ``[SEP]`` (101), ``[UNK]`` (102), ``[PAD]`` (103) and no BOS, as a BERT tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    vocab = {**{f"t{i}": i for i in range(100)}, "[CLS]": 100, "[SEP]": 101, "[UNK]": 102, "[PAD]": 103}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tk, cls_token="[CLS]", sep_token="[SEP]", unk_token="[UNK]",
                            pad_token="[PAD]").save_pretrained(save_dir)
    return AutoTokenizer.from_pretrained(save_dir)


def make_encoder_checkpoint(family: str, tokenizer, seed: int = 0, **change):
    """A :class:`~headprobe.probe.loading.Checkpoint` holding a tiny random encoder (``AutoModel``:
    ``BertModel``, no head), every bias and norm weight randomised as in :func:`make_checkpoint`."""
    from transformers import AutoConfig, AutoModel

    from headprobe.probe.loading import Checkpoint

    cfg = AutoConfig.for_model(family, **{**ENCODER_ZOO[family], **change})
    torch.manual_seed(seed)
    model = AutoModel.from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "LayerNorm" in name or "token_type" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return Checkpoint(f"tiny-{family}", f"tiny-{family}", "float32 (random init)", model, tokenizer)
