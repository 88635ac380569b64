"""Norms of the native transformer: :class:`RMSNorm`, LayerNorm or RMSNorm by the config
(:func:`make_norm`), the hooked :class:`Norm` before a branch and :class:`PostNorm` after it, and
Llama-4's weightless :func:`l2_norm`.
"""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from headprobe.probe.model.config import TransformerConfig


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * w``, computed in float32 as Hugging Face's ``LlamaRMSNorm``."""

    def __init__(self, d_model: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d_model))
        self.eps = eps

    def forward(self, x: Float[Tensor, "... d_model"]) -> Float[Tensor, "... d_model"]:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def l2_norm(x: Float[Tensor, "... d"], eps: float) -> Float[Tensor, "... d"]:
    """``x / sqrt(mean(x^2) + eps)`` over the last axis in float32, no weight (Llama-4's
    ``Llama4TextL2Norm``)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


def make_norm(cfg: TransformerConfig, width: int | None = None) -> nn.Module:
    """``nn.LayerNorm`` or :class:`RMSNorm` (``cfg.norm``) over ``width`` (default ``d_model``)."""
    width = cfg.d_model if width is None else width
    return nn.LayerNorm(width, eps=cfg.norm_eps) if cfg.norm == "layernorm" else RMSNorm(width, cfg.norm_eps)


class Norm(nn.Module):
    """LayerNorm or RMSNorm (``cfg.norm``), followed by ``hook_normalized``."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.norm = make_norm(cfg)
        self.hook_normalized = HookPoint()  # [batch, pos, d_model]

    def forward(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        return self.hook_normalized(self.norm(x))


class PostNorm(nn.Module):
    """The norm of a branch's output before it joins the residual stream (``cfg.post_norm``;
    OLMo-2, Gemma-2), between ``hook_in`` and ``hook_out`` (the names TransformerLens' bridge
    gives ``ln1_post``/``ln2_post``, which :func:`headprobe.probe.hooks.capture.capture_internal`
    reads). Called on any ``[..., d_model]`` tensor it returns the normed tensor."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.norm = make_norm(cfg)
        self.hook_in = HookPoint()  # [batch, pos, d_model], the branch output
        self.hook_out = HookPoint()  # [batch, pos, d_model], what joins the residual stream

    def forward(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        return self.hook_out(self.norm(self.hook_in(x)))
