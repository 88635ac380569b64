"""Positions: the token and learned-position :class:`Embedding`, and rotary positions
(:class:`Rotary`: Hugging Face's halves or interleaved pairs, partial, linear, YaRN and Llama-3 scaling).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from jaxtyping import Bool, Float, Int, Shaped
from torch import Tensor, nn

from headprobe.probe.core.padding import padding_mask
from headprobe.probe.model.config import TransformerConfig


def padding_and_positions(
    batch: int,
    n_tokens: int,
    device: torch.device | str,
    attention_mask: Shaped[Tensor, "batch pos"] | None = None,
    past: int = 0,
) -> tuple[Bool[Tensor, "batch pos"] | None, Int[Tensor, "batch pos"]]:
    """``(padding, positions)`` of a batch of ``batch`` sequences of ``n_tokens`` tokens, as the
    model's forward pass and a run resumed at a block (the native backend's ``forward_from``) give
    them to every layer: without ``attention_mask`` no padding and positions ``past .. past +
    n_tokens - 1`` on ``device``; with it (1 real, 0 padding, any side) its bool form
    (:func:`~headprobe.probe.core.padding.padding_mask`, on the mask's device) and positions that
    count real tokens only, so a left-padded sequence gets its unpadded positions.

    Raises:
        InputValueError: a mask value other than 0 and 1.
    """
    if attention_mask is None:
        return None, torch.arange(past, past + n_tokens, device=device).expand(batch, n_tokens)
    padding = padding_mask(attention_mask)
    return padding, (padding.long().cumsum(-1) - 1).clamp(min=0)


class Embedding(nn.Module):
    """Token embedding ``W_E`` (times ``sqrt(d_model)`` with ``embed_scale``, as Gemma, the
    factor rounded to the weights' dtype; times ``embedding_multiplier``, Granite) and, for ``positional="learned"``, the position table
    ``W_pos``.

    Returns the two terms separately so that the model's root hook points ``hook_embed`` and
    ``hook_pos_embed`` (TransformerLens' names) see each.
    """

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.W_E = nn.Embedding(cfg.d_vocab, cfg.d_model)
        self.W_pos = nn.Embedding(cfg.n_ctx, cfg.d_model) if cfg.positional == "learned" else None
        self.scale = cfg.d_model**0.5 if cfg.embed_scale else None
        self.multiplier = cfg.embedding_multiplier

    def forward(
        self, tokens: Int[Tensor, "batch pos"], positions: Int[Tensor, "batch pos"]
    ) -> tuple[Float[Tensor, "batch pos d_model"], Float[Tensor, "batch pos d_model"] | None]:
        tok = self.W_E(tokens)
        if self.scale is not None:
            tok = tok * torch.tensor(self.scale, dtype=tok.dtype, device=tok.device)
        if self.multiplier is not None:  # Granite: inputs_embeds * embedding_multiplier
            tok = tok * self.multiplier
        return tok, None if self.W_pos is None else self.W_pos(positions)


def rotate_half(x: Float[Tensor, "... d_head"]) -> Float[Tensor, "... d_head"]:
    """``[x1, x2] -> [-x2, x1]`` on the two halves of the last axis (Hugging Face's RoPE layout,
    which pairs dimension ``i`` with ``i + d_head/2``, not adjacent dimensions)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_pairs(x: Float[Tensor, "... d_head"]) -> Float[Tensor, "... d_head"]:
    """``(x_2i, x_2i+1) -> (-x_2i+1, x_2i)`` on adjacent pairs of the last axis (the interleaved
    RoPE layout of the original paper and of Hugging Face's Cohere ``rotate_half``)."""
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


@dataclass(frozen=True)
class YaRN:
    """YaRN's rotary scaling (Peng et al. 2023, arXiv 2309.00071), as Hugging Face's
    ``_compute_yarn_parameters`` computes it: see :class:`~headprobe.probe.model.config.TransformerConfig` ``yarn_factor``."""

    factor: float
    original_ctx: int
    beta_fast: float
    beta_slow: float
    truncate: bool
    attention_factor: float

    @classmethod
    def of(cls, cfg: TransformerConfig) -> YaRN | None:
        """The config's YaRN scaling, or None (plain rotary)."""
        if cfg.yarn_factor is None:
            return None
        f = cfg.yarn_factor
        attention = cfg.yarn_attention_factor
        if attention is None:
            attention = 0.1 * math.log(f) + 1.0 if f > 1 else 1.0
        return cls(f, cfg.yarn_original_ctx, cfg.yarn_beta[0], cfg.yarn_beta[1], cfg.yarn_truncate, float(attention))

    def blend(self, pos_freqs: Float[Tensor, " half_dim"], dim: int, theta: float) -> Float[Tensor, " half_dim"]:
        """``inv_freq = 1 / pos_freqs`` blended with ``1 / (factor pos_freqs)`` by the linear ramp between the correction
        dimensions of ``beta_fast`` and ``beta_slow`` rotations (extrapolated above, interpolated below)."""

        def correction(rotations: float) -> float:
            return dim * math.log(self.original_ctx / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = correction(self.beta_fast), correction(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # as Hugging Face: no division by zero
        ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=pos_freqs.device) - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp
        return 1.0 / (self.factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation


@dataclass(frozen=True)
class Llama3Rope:
    """Llama-3.1's rotary scaling, as Hugging Face's ``_compute_llama3_parameters`` computes it
    (``rope_type="llama3"``): see :class:`~headprobe.probe.model.config.TransformerConfig` ``llama3_rope``."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_ctx: int
    attention_factor: float = 1.0  # cos and sin unscaled

    @classmethod
    def of(cls, cfg: TransformerConfig) -> Llama3Rope | None:
        """The config's Llama-3 scaling, or None."""
        return None if cfg.llama3_rope is None else cls(*cfg.llama3_rope)

    def blend(self, pos_freqs: Float[Tensor, " half_dim"], dim: int, theta: float) -> Float[Tensor, " half_dim"]:
        """``inv_freq = 1 / pos_freqs`` kept where its wavelength ``2 pi / inv_freq`` is under
        ``original_ctx / high_freq_factor``, divided by ``factor`` where it is over ``original_ctx /
        low_freq_factor``, and blended between the two in between (by ``original_ctx / wavelength``)."""
        inv_freq = 1.0 / pos_freqs
        wavelength = 2 * math.pi / inv_freq
        long_wave, short_wave = self.original_ctx / self.low_freq_factor, self.original_ctx / self.high_freq_factor
        scaled = torch.where(wavelength > long_wave, inv_freq / self.factor, inv_freq)
        smooth = (self.original_ctx / wavelength - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        blended = (1 - smooth) * scaled / self.factor + smooth * scaled
        return torch.where((wavelength >= short_wave) & (wavelength <= long_wave), blended, scaled)


def rotary_scaling(cfg: TransformerConfig) -> YaRN | Llama3Rope | None:
    """The config's rotary scaling that blends frequencies (YaRN or Llama-3's), or None."""
    return YaRN.of(cfg) or Llama3Rope.of(cfg)


class Rotary(nn.Module):
    """Rotary position embedding (Su et al. 2021) in the convention of ``transformers``' Llama:
    ``inv_freq_i = theta^(-2i/dim)``, angle ``pos * inv_freq`` repeated over both halves,
    ``x_rot = x cos + rotate_half(x) sin``. Frequencies and angles in float32 whatever the weights' dtype
    (as Hugging Face's reference); ``cos``/``sin`` are cast to the dtype of ``x`` for the rotation.

    With ``dim`` below the head width only the first ``dim`` dimensions of each head rotate
    and the rest pass through (GPT-NeoX's partial rotary, ``rotary_pct``). ``factor`` divides the
    frequencies (linear scaling), ``scaling`` blends them (YaRN, Llama-3); ``interleaved`` rotates adjacent pairs (:func:`rotate_pairs`,
    the angles repeated per pair) instead of halves."""

    def __init__(
        self,
        dim: int,
        theta: float,
        factor: float = 1.0,
        interleaved: bool = False,
        scaling: YaRN | Llama3Rope | None = None,
    ):
        super().__init__()
        self.dim = dim
        self.theta = theta
        self.factor = factor
        self.interleaved = interleaved
        self.scaling = scaling
        self.attention_factor = 1.0 if scaling is None else scaling.attention_factor
        self.register_buffer("inv_freq", self.frequencies(), persistent=False)

    def _apply(self, fn, recurse=True):
        """Moves and casts (``.to(device)``, ``.to(torch.bfloat16)``, ...) apply as to any module,
        except that ``inv_freq`` stays float32, recomputed on its new device: cast to bfloat16
        the frequencies keep 3 significant digits and the angle at position 8,000 would be off by
        several radians. Hugging Face's reference keeps them float32 when it loads a model in
        half precision; so do we."""
        super()._apply(fn, recurse)
        if self.inv_freq.dtype != torch.float32:
            self.inv_freq = self.frequencies().to(self.inv_freq.device)
        return self

    def frequencies(self) -> Float[Tensor, " half_dim"]:
        """``inv_freq_i = theta^(-2i/dim) / factor``, float32 on the CPU (a fresh tensor)."""
        arange = torch.arange(0, self.dim, 2, dtype=torch.int64, device="cpu")
        pos_freqs = self.theta ** (arange.float() / self.dim)
        if self.scaling is not None:
            return self.scaling.blend(pos_freqs, self.dim, self.theta)
        inv_freq = 1.0 / pos_freqs
        return inv_freq if self.factor == 1.0 else inv_freq / self.factor

    def forward(
        self,
        x: Float[Tensor, "batch pos head d_head"],
        positions: Int[Tensor, "batch pos"],
    ) -> Float[Tensor, "batch pos head d_head"]:
        if x.shape[-1] > self.dim:
            return torch.cat((self(x[..., : self.dim], positions), x[..., self.dim :]), dim=-1)
        angles = positions[..., None].float() * self.inv_freq  # [batch, pos, dim/2]
        if self.interleaved:
            angles = angles.repeat_interleave(2, dim=-1)[:, :, None, :]  # [batch, pos, 1, dim]
        else:
            angles = torch.cat((angles, angles), dim=-1)[:, :, None, :]  # [batch, pos, 1, dim]
        cos, sin = angles.cos(), angles.sin()
        if self.attention_factor != 1.0:  # YaRN: as Hugging Face, on cos and sin in float32
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        return x * cos + (rotate_pairs(x) if self.interleaved else rotate_half(x)) * sin
