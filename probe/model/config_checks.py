"""The checks of :class:`~headprobe.probe.model.config.TransformerConfig`'s option groups that
fill fields of their own: the mixture of experts, multi-head latent attention (MLA) and the
per-layer rotary fields. ``TransformerConfig.__post_init__`` runs them on the frozen config
(they set the fields they fill with ``object.__setattr__``, as it does). ``cfg`` is typed ``Any``:
this module may not import :mod:`headprobe.probe.model.config`, which imports it (no import cycles).
"""

from __future__ import annotations

from typing import Any

from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.core.registry import did_you_mean

#: ``TransformerConfig.router``: how router logits become the top-k expert weights (:class:`~headprobe.probe.model.feedforward.MoE`).
ROUTERS = ("softmax_topk", "topk_softmax", "topk_sigmoid")


def check_moe(cfg: Any) -> None:
    """The mixture-of-experts fields: sizes in range, a gated MLP, known router; fills
    ``d_expert`` (None: ``d_mlp``)."""
    if cfg.moe_layers is not None:  # JSON gives a list
        object.__setattr__(cfg, "moe_layers", tuple(int(l) for l in cfg.moe_layers))
    if cfg.n_experts is None:
        if cfg.moe_layers is not None or cfg.d_shared_expert is not None:
            raise HeadprobeError("moe_layers and d_shared_expert describe a mixture of experts; give n_experts too")
        return
    if cfg.d_expert is None:
        object.__setattr__(cfg, "d_expert", cfg.d_mlp)
    assert cfg.d_expert is not None  # filled above
    if not 1 <= cfg.n_experts_per_token <= cfg.n_experts or min(cfg.d_expert, cfg.d_shared_expert or 1) < 1:
        raise HeadprobeError(
            f"a mixture of experts needs 1 <= n_experts_per_token <= n_experts and positive widths, "
            f"got {cfg.n_experts_per_token} of {cfg.n_experts}"
        )
    if cfg.mlp not in ("swiglu", "geglu"):
        raise HeadprobeError(f"experts are gated MLPs (mlp swiglu or geglu), not {cfg.mlp}")
    if cfg.router not in ROUTERS:
        raise HeadprobeError(
            f"config router={cfg.router!r} is not one of {ROUTERS}{did_you_mean(str(cfg.router), ROUTERS)}"
        )
    if cfg.moe_layers is not None and any(not 0 <= l < cfg.n_layers for l in cfg.moe_layers):
        raise HeadprobeError(f"moe_layers {cfg.moe_layers} out of range for {cfg.n_layers} layers")
    if cfg.swiglu_limit is not None and not cfg.swiglu_limit > 0:
        raise HeadprobeError(f"swiglu_limit must be positive, got {cfg.swiglu_limit}")
    if (cfg.linear_layers is None) != (cfg.linear_mixer is None):
        raise HeadprobeError("linear_layers and linear_mixer come together")
    if cfg.linear_layers is not None and any(not 0 <= l < cfg.n_layers for l in cfg.linear_layers):
        raise HeadprobeError(f"linear_layers {cfg.linear_layers} out of range for {cfg.n_layers} layers")


def check_mla(cfg: Any) -> None:
    """The MLA fields: all or none, sizes positive, no option MLA is not implemented with;
    fills ``qk_nope_head_dim`` (None: ``d_head``)."""
    if cfg.kv_lora_rank is None:
        if cfg.qk_rope_head_dim or cfg.qk_nope_head_dim is not None or cfg.q_lora_rank is not None:
            raise HeadprobeError(
                "qk_rope_head_dim, qk_nope_head_dim and q_lora_rank describe MLA; give kv_lora_rank too"
            )
        return
    if cfg.qk_nope_head_dim is None:
        object.__setattr__(cfg, "qk_nope_head_dim", cfg.d_head)
    if cfg.kv_lora_rank < 1 or cfg.qk_rope_head_dim < 0 or cfg.qk_rope_head_dim % 2:
        raise HeadprobeError(
            f"MLA needs kv_lora_rank >= 1 and an even qk_rope_head_dim >= 0, got "
            f"{cfg.kv_lora_rank} and {cfg.qk_rope_head_dim}"
        )
    if cfg.n_kv_heads != cfg.n_heads:
        raise HeadprobeError(
            f"MLA reconstructs keys and values for every head: n_kv_heads={cfg.n_kv_heads} "
            f"must equal n_heads={cfg.n_heads}"
        )
    if cfg.positional == "rotary" and cfg.qk_rope_head_dim == 0:
        raise HeadprobeError("MLA with rotary positions needs qk_rope_head_dim > 0 (the decoupled rotary key)")
    if cfg.bias:
        raise HeadprobeError("MLA is implemented without biases (DeepSeek-V2); pass bias=False")
    if cfg.qk_norm != "none" or cfg.rotary_dim is not None or cfg.sliding_window or cfg.attn_softcap or cfg.attn_gate:
        raise HeadprobeError("MLA is implemented without qk_norm, rotary_dim, sliding windows, soft-capping and gates")
    assert cfg.qk_nope_head_dim is not None  # filled above
    if min(cfg.qk_nope_head_dim, cfg.q_lora_rank or 1) < 1:
        raise HeadprobeError(
            f"MLA needs positive qk_nope_head_dim and q_lora_rank, got {cfg.qk_nope_head_dim} and {cfg.q_lora_rank}"
        )


def check_layer_rope(cfg: Any) -> None:
    """``rope_thetas``/``rope_factors``: tuples (JSON gives lists) of ``n_layers`` positive
    entries (``rope_thetas`` also None), on a rotary model; ``logit_scale`` positive; ``llama3_rope``
    a tuple of a positive factor, ``0 < low_freq_factor < high_freq_factor`` and a positive context."""
    for field in ("rope_thetas", "rope_factors"):
        values = getattr(cfg, field)
        if values is None:
            continue
        values = tuple(None if v is None else float(v) for v in values)
        object.__setattr__(cfg, field, values)
        if len(values) != cfg.n_layers or any(not v > 0 if v is not None else field == "rope_factors" for v in values):
            raise HeadprobeError(f"{field} must hold {cfg.n_layers} positive values, got {values}")
        if cfg.positional != "rotary" or cfg.is_mla:
            raise HeadprobeError(f"{field} needs rotary positions (positional='rotary', not MLA)")
    if cfg.rotary_interleaved and (cfg.positional != "rotary" or cfg.is_mla):
        raise HeadprobeError("rotary_interleaved needs rotary positions (positional='rotary', not MLA)")
    if cfg.logit_scale is not None and not cfg.logit_scale > 0:
        raise HeadprobeError(f"logit_scale must be positive, got {cfg.logit_scale}")
    if cfg.llama3_rope is not None:  # JSON gives a list
        factor, low, high, ctx = cfg.llama3_rope
        object.__setattr__(cfg, "llama3_rope", (float(factor), float(low), float(high), int(ctx)))
        if not (cfg.positional == "rotary" and cfg.yarn_factor is None and factor > 0 and 0 < low < high and ctx > 0):
            raise HeadprobeError(
                "llama3_rope needs rotary positions without YaRN, a positive factor, 0 < low_freq_factor < "
                f"high_freq_factor and a positive original context, got {cfg.llama3_rope}"
            )
