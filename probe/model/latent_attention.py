"""Multi-head latent attention (MLA; DeepSeek-V2, arXiv 2405.04434; DeepSeek-V3): :class:`LatentAttention`,
the attention mechanism beside :class:`~headprobe.probe.model.attention.Attention` on their shared base
:class:`~headprobe.probe.model.attention.SelfAttention` (the mask, the eager and the fused path, ``W_O``
and the hook points).
"""

from __future__ import annotations

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn

from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.model.attention import QKV, SelfAttention
from headprobe.probe.model.cache import KVCache, StreamingKVCache
from headprobe.probe.model.config import TransformerConfig
from headprobe.probe.model.norms import RMSNorm
from headprobe.probe.model.positions import Rotary, rotary_scaling


class LatentAttention(SelfAttention):
    """Multi-head latent attention (MLA; DeepSeek-V2, arXiv 2405.04434, eqs. 9-14; DeepSeek-V3):
    keys and values of every head are decompressed from one per-token latent ``c^KV`` of width
    ``kv_lora_rank``, and positions enter through a decoupled rotary key ``k^R`` shared by all
    heads; only ``c^KV`` and ``k^R`` are cached.

    Queries: ``W_Q x`` (or ``W_UQ RMSNorm(W_DQ x)`` with ``q_lora_rank``), per head a non-rotary
    part (``qk_nope_head_dim``) and a rotary part (``qk_rope_head_dim``). ``W_DKV|W_KR x`` gives
    ``c^KV`` and ``k^R``; ``W_UK|W_UV RMSNorm(c^KV)`` each head's non-rotary key part and its value
    (``d_head``). A key is ``[k_nope, rope(k^R)]``, ``d_qk = qk_nope + qk_rope`` wide like a query.
    ``hook_q``/``hook_k`` hold queries and keys after rotary (there are no ``hook_rot_*``), all
    ``n_heads`` wide (``n_kv_heads == n_heads``).

    Raises:
        HeadprobeError: ``cfg`` is not MLA.
    """

    def __init__(self, cfg: TransformerConfig, layer: int = 0):
        if not cfg.is_mla:
            raise HeadprobeError("LatentAttention needs an MLA config (kv_lora_rank)")
        super().__init__(cfg, layer, cfg.n_heads)
        self.n_kv_heads = cfg.n_heads
        H, D, R, r, N = cfg.n_heads, cfg.d_model, cfg.qk_rope_head_dim, cfg.kv_lora_rank, cfg.qk_nope_head_dim
        assert (
            r is not None and N is not None and cfg.d_head is not None
        )  # MLA, filled by TransformerConfig.__post_init__
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(D, H * (N + R), bias=False)
        else:  # the query latent c^Q
            self.q_down = nn.Linear(D, cfg.q_lora_rank, bias=False)
            self.q_down_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
            self.q_up = nn.Linear(cfg.q_lora_rank, H * (N + R), bias=False)
        self.kv_down = nn.Linear(D, r + R, bias=False)  # latent c^KV and the shared rotary key k^R
        self.kv_norm = RMSNorm(r, cfg.norm_eps)
        self.kv_up = nn.Linear(r, H * (N + cfg.d_head), bias=False)  # keys and values of every head
        self.rotary = Rotary(R, cfg.rope_theta, scaling=rotary_scaling(cfg)) if R else None
        self._add_output(rotary_hooks=False)

    def qkv(
        self,
        x: Float[Tensor, "batch pos d_model"],
        positions: Int[Tensor, "batch pos"],
        cache: KVCache | StreamingKVCache | None = None,
    ) -> QKV:
        """Queries ``[q_nope, rope(q_rope)]`` per head; keys ``[W_UK norm(c), rope(k^R)]`` and
        values ``W_UV norm(c)`` of every head, decompressed from the latent ``c^KV`` of all
        positions so far (the cache holds ``c^KV`` as ``keys`` ``[batch, 1, pos, rank]`` and
        ``k^R`` as ``values`` ``[batch, 1, pos, rope]``). Returns ``[batch, head, pos, .]`` tensors."""
        cfg = self.cfg
        B, T, _ = x.shape
        H, R, r, N = self.n_heads, cfg.qk_rope_head_dim, cfg.kv_lora_rank, cfg.qk_nope_head_dim
        assert (
            r is not None and N is not None and cfg.d_head is not None
        )  # MLA, filled by TransformerConfig.__post_init__
        q = self.q_proj(x) if cfg.q_lora_rank is None else self.q_up(self.q_down_norm(self.q_down(x)))
        q = q.view(B, T, H, N + R)
        ckv = self.kv_down(x)
        c, k_rope = ckv[..., :r], ckv[..., r:][:, :, None, :]  # [batch, pos, r], [batch, pos, 1, R]
        if self.rotary is not None:
            q = torch.cat([q[..., :N], self.rotary(q[..., N:], positions)], dim=-1)
            k_rope = self.rotary(k_rope, positions)
        q = self.hook_q(q)  # [batch, pos, head, d_qk]
        c, k_rope = c[:, None], k_rope.transpose(1, 2)  # [batch, 1, pos, r], [batch, 1, pos, R]
        if cache is not None:
            c, k_rope = cache.extend(self.layer, c, k_rope)
        S = c.shape[2]
        kv = self.kv_up(self.kv_norm(c[:, 0])).view(B, S, H, N + cfg.d_head)
        k = torch.cat([kv[..., :N], k_rope.transpose(1, 2).expand(B, S, H, R)], dim=-1)
        k = self.hook_k(k)  # [batch, pos, head, d_qk]
        v = self.hook_v(kv[..., N:])  # [batch, pos, head, d_head]
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
