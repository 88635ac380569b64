"""Real head removal: a native :class:`~headprobe.probe.model.Transformer` whose pruned heads' weights are gone.

:func:`remove_heads` returns a copy of a native model in which each layer keeps only the query
heads not pruned: the rows of ``q_proj`` and the columns of ``o_proj`` of a removed query head
are dropped, so the projections are smaller. Under GQA a key/value head is removable only when
all the query heads of its group are (any kept query head still reads it), so ``k_proj`` and
``v_proj`` keep the key/value heads that at least one kept query head reads. A layer with no
query head left returns only the output bias (zero for Llama). The result equals the original
model with the removed heads' ``z`` multiplied by 0 (``head_mask``), to float rounding.

:func:`save_pruned` writes config, kept heads and state dict with ``torch.save`` (loaded back
with ``weights_only=True``); :func:`load_pruned` rebuilds the model from that file.
Pruning itself: Michel, Levy, Neubig 2019, arXiv 1905.10650.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import pickle
import warnings
from collections.abc import Sequence

from typing import Any

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor, nn

from headprobe.probe.errors import HeadprobeError
from headprobe.probe.io import atomic_path
from headprobe.probe.model import Attention, Transformer, TransformerConfig

FORMAT = "headprobe-pruned-v1"


class PrunedAttention(Attention):
    """Causal attention over a subset of query heads (and the key/value heads they read).

    Attributes:
        kept_heads: original indices of the kept query heads, ascending.
        kept_kv_heads: original indices of the kept key/value heads, ascending.
        kv_index: buffer ``[kept head]``: for each kept query head, the position of its key/value
            head among the kept ones (moves with ``.to(device)``).

    Hook points ``hook_q`` ``[batch, pos, kept head, d_head]``, ``hook_k``/``hook_v`` ``[batch,
    pos, kept kv_head, d_head]`` and ``hook_z`` ``[batch, pos, kept head, d_head]`` exist; the
    pattern is never materialised (fused attention), and ``head_mask`` is not accepted.
    """

    def __init__(self, cfg: TransformerConfig, kept_heads: Sequence[int]):
        nn.Module.__init__(self)
        self.cfg = cfg
        kept = sorted(set(int(h) for h in kept_heads))
        if any(not 0 <= h < cfg.n_heads for h in kept):
            raise HeadprobeError(f"kept heads {kept} out of range for {cfg.n_heads} heads")
        kept_kv = sorted({h // cfg.group_size for h in kept})
        self.kept_heads, self.kept_kv_heads = kept, kept_kv
        H, KV, d_head, D = len(kept), len(kept_kv), cfg.d_head, cfg.d_model
        with warnings.catch_warnings():  # a layer with every head removed has zero-size projections
            warnings.filterwarnings("ignore", "Initializing zero-element tensors")
            self.q_proj = nn.Linear(D, H * d_head, bias=cfg.bias)
            self.k_proj = nn.Linear(D, KV * d_head, bias=cfg.bias)
            self.v_proj = nn.Linear(D, KV * d_head, bias=cfg.bias)
            self.o_proj = nn.Linear(H * d_head, D, bias=cfg.bias)
        self.register_buffer("kv_index", torch.tensor([kept_kv.index(h // cfg.group_size) for h in kept], dtype=torch.long))
        from headprobe.probe.model import Rotary
        from transformer_lens.hook_points import HookPoint

        self.rotary = Rotary(d_head, cfg.rope_theta) if cfg.positional == "rotary" else None
        self.scale = cfg.d_head ** -0.5
        self.force_eager = False
        self.hook_q = HookPoint()  # [batch, pos, kept head, d_head]
        self.hook_k = HookPoint()  # [batch, pos, kept kv_head, d_head]
        self.hook_v = HookPoint()  # [batch, pos, kept kv_head, d_head]
        self.hook_rot_q = HookPoint()
        self.hook_rot_k = HookPoint()
        self.hook_z = HookPoint()  # [batch, pos, kept head, d_head]

    @property
    def n_kept(self) -> int:
        return len(self.kept_heads)

    @property
    def W_O(self) -> Float[Tensor, "head d_head d_model"]:
        """The kept heads' output projection, ``[kept head, d_head, d_model]``."""
        return self.o_proj.weight.T.unflatten(0, (self.n_kept, self.cfg.d_head))

    def needs_pattern(self) -> bool:
        return False

    @torch.no_grad()
    def load_from(self, attn: Attention) -> "PrunedAttention":
        """Copy the kept heads' slices of a full :class:`Attention`'s weights into this module."""
        d = self.cfg.d_head
        q_rows = torch.cat([torch.arange(h * d, (h + 1) * d) for h in self.kept_heads]) if self.kept_heads else torch.zeros(0, dtype=torch.long)
        kv_rows = torch.cat([torch.arange(h * d, (h + 1) * d) for h in self.kept_kv_heads]) if self.kept_kv_heads else torch.zeros(0, dtype=torch.long)
        self.to(attn.q_proj.weight)
        self.q_proj.weight.copy_(attn.q_proj.weight[q_rows.to(attn.q_proj.weight.device)])
        self.k_proj.weight.copy_(attn.k_proj.weight[kv_rows.to(attn.k_proj.weight.device)])
        self.v_proj.weight.copy_(attn.v_proj.weight[kv_rows.to(attn.v_proj.weight.device)])
        self.o_proj.weight.copy_(attn.o_proj.weight[:, q_rows.to(attn.o_proj.weight.device)])
        if self.cfg.bias:
            self.q_proj.bias.copy_(attn.q_proj.bias[q_rows.to(attn.q_proj.bias.device)])
            self.k_proj.bias.copy_(attn.k_proj.bias[kv_rows.to(attn.k_proj.bias.device)])
            self.v_proj.bias.copy_(attn.v_proj.bias[kv_rows.to(attn.v_proj.bias.device)])
            self.o_proj.bias.copy_(attn.o_proj.bias)
        return self

    def forward(
        self,
        x: Float[Tensor, "batch pos d_model"],
        positions: Int[Tensor, "batch pos"],
        key_mask: Bool[Tensor, "batch 1 q_pos k_pos"] | None = None,
        head_mask: Tensor | None = None,
        cache: Any = None,
    ) -> Float[Tensor, "batch pos d_model"]:
        if head_mask is not None:
            raise HeadprobeError("a pruned model takes no head_mask: its removed heads are gone")
        if cache is not None:
            raise HeadprobeError("KV-cache generation is not implemented for pruned models; run them without a cache")
        B, T, D = x.shape
        if self.n_kept == 0:
            out = x.new_zeros(B, T, D)
            return out if self.o_proj.bias is None else out + self.o_proj.bias
        H, KV, d_head = self.n_kept, len(self.kept_kv_heads), self.cfg.d_head
        q = self.hook_q(self.q_proj(x).view(B, T, H, d_head))
        k = self.hook_k(self.k_proj(x).view(B, T, KV, d_head))
        v = self.hook_v(self.v_proj(x).view(B, T, KV, d_head))
        if self.rotary is not None:
            q = self.hook_rot_q(self.rotary(q, positions))
            k = self.hook_rot_k(self.rotary(k, positions))
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if KV != H:  # groups are no longer uniform: give each kept query head its key/value head
            k, v = k.index_select(1, self.kv_index), v.index_select(1, self.kv_index)
        kwargs = dict(is_causal=True) if key_mask is None else dict(attn_mask=key_mask)
        z = F.scaled_dot_product_attention(q, k, v, scale=self.scale, **kwargs).transpose(1, 2)
        z = self.hook_z(z)  # [batch, pos, kept head, d_head]
        return self.o_proj(z.reshape(B, T, H * d_head))


def keep_mask_from(removed: Sequence[tuple[int, int]], n_layers: int, n_heads: int) -> Bool[Tensor, "layer head"]:
    """``[layer, head]`` True for kept heads, False for the ``(layer, head)`` pairs in ``removed``."""
    keep = torch.ones(n_layers, n_heads, dtype=torch.bool)
    for layer, head in removed:
        keep[layer, head] = False
    return keep


def _install(net: Transformer, keep: Tensor) -> Transformer:
    cfg = net.cfg
    if tuple(keep.shape) != (cfg.n_layers, cfg.n_heads):
        raise HeadprobeError(f"keep mask has shape {tuple(keep.shape)}; expected [{cfg.n_layers}, {cfg.n_heads}]")
    for layer, block in enumerate(net.blocks):
        kept = keep[layer].nonzero().flatten().tolist()
        new = PrunedAttention(cfg, kept)
        if not isinstance(block.attn, PrunedAttention):
            new.load_from(block.attn)
        block.attn = new
    net.kept_heads = [keep[layer].nonzero().flatten().tolist() for layer in range(cfg.n_layers)]
    net.setup()  # re-register the hook points of the new modules
    return net


def remove_heads(net: Transformer, keep: Bool[Tensor, "layer head"]) -> Transformer:
    """A copy of the native model ``net`` with the heads where ``keep`` is False removed.

    Raises:
        HeadprobeError: ``net`` is not a full native Transformer, or ``keep`` has the wrong shape.
    """
    if not isinstance(net, Transformer) or any(isinstance(b.attn, PrunedAttention) for b in net.blocks):
        raise HeadprobeError("real head removal needs an unpruned native model (load it with --backend native)")
    return _install(copy.deepcopy(net), keep.bool().cpu())


def count_attention_parameters(net: Transformer) -> int:
    """Parameters in all attention projections (q, k, v, o; biases included)."""
    return sum(p.numel() for b in net.blocks for p in b.attn.parameters())


def save_pruned(net: Transformer, path: str | os.PathLike[str]) -> None:
    """Write a pruned model (config, kept heads per layer, state dict) to ``path`` atomically.

    Raises:
        HeadprobeError: ``net`` is not a model from :func:`remove_heads`.
    """
    if not hasattr(net, "kept_heads"):
        raise HeadprobeError("save_pruned needs a model from remove_heads")
    payload = {
        "format": FORMAT,
        "config": dataclasses.asdict(net.cfg),
        "kept_heads": net.kept_heads,
        "state_dict": {k: v.detach().cpu() for k, v in net.state_dict().items()},
    }
    with atomic_path(path) as tmp:
        torch.save(payload, tmp)


def load_pruned(path: str | os.PathLike[str], device: str | torch.device = "cpu") -> Transformer:
    """Rebuild a pruned model saved by :func:`save_pruned`, on ``device``.

    Raises:
        HeadprobeError: the file is missing, unreadable or not a headprobe pruned model.
    """
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as e:
        raise HeadprobeError(f"cannot read pruned model {path}: {' '.join(str(e).split())[:200]}") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise HeadprobeError(f"{path} is not a headprobe pruned model (format {FORMAT})")
    cfg = TransformerConfig(**payload["config"])
    net = Transformer(cfg)
    keep = torch.zeros(cfg.n_layers, cfg.n_heads, dtype=torch.bool)
    for layer, kept in enumerate(payload["kept_heads"]):
        keep[layer, kept] = True
    _install(net, keep)
    dtype = next(iter(payload["state_dict"].values())).dtype
    net.to(dtype)
    net.load_state_dict(payload["state_dict"], strict=True)
    return net.to(device).eval()
