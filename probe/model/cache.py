"""KV caches for generation: :class:`KVCache` keeps every position, :class:`StreamingKVCache` what a
head-level KV policy leaves each KV group.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from headprobe.probe.layout.attention import KVPolicy


@dataclass
class KVCache:
    """Keys and values of the tokens seen so far, per layer, for generation.

    ``keys[l]`` and ``values[l]`` are ``[batch, kv_head, pos, d_qk]`` and ``[batch, kv_head, pos,
    d_head]`` (keys after rotary), so a GQA/MQA cache holds ``n_kv_heads`` heads, never copies per
    query head; an MLA layer (:class:`~headprobe.probe.model.latent_attention.LatentAttention`) caches its latent ``c^KV`` ``[batch, 1,
    pos, kv_lora_rank]`` as ``keys`` and the rotary key ``k^R`` ``[batch, 1, pos,
    qk_rope_head_dim]`` as ``values``. Filled by :meth:`~headprobe.probe.model.transformer.Transformer.forward` when passed as
    ``cache``; start with ``KVCache()``.
    """

    keys: list[Tensor] = dataclasses.field(default_factory=list)
    values: list[Tensor] = dataclasses.field(default_factory=list)

    @property
    def n_tokens(self) -> int:
        """Positions cached (0 when empty)."""
        return self.keys[0].shape[2] if self.keys else 0

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds: ``n_layers * batch * n_kv_heads * pos * (d_qk + d_head) *
        element size`` (MLA: ``n_layers * batch * pos * (kv_lora_rank + qk_rope_head_dim) *
        element size``), the quantity :func:`headprobe.probe.layout.cost.kv_bytes_per_request` predicts."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def extend(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append this step's ``k``/``v`` (``[batch, kv_head, new_pos, .]``) to layer ``layer``'s
        cache and return all keys and values so far."""
        if layer == len(self.keys):
            self.keys.append(k)
            self.values.append(v)
        else:
            self.keys[layer] = torch.cat([self.keys[layer], k], dim=2)
            self.values[layer] = torch.cat([self.values[layer], v], dim=2)
        return self.keys[layer], self.values[layer]


@dataclass
class StreamingKVCache:
    """The KV cache of a head-level policy: each KV group keeps only what its queries will read.

    ``keys[l][g]`` and ``values[l][g]`` are ``[batch, pos_kept, .]`` tensors of layer ``l``'s group
    ``g`` (a key/value head's keys after rotary and values; MLA: the latent ``c^KV`` and the rotary
    key ``k^R``, one group per layer), and ``positions[l][g]`` their positions. A full group keeps
    every position; a :class:`~headprobe.probe.layout.attention.Streaming` group keeps the first ``sink``
    and the ``window`` most recent ones (those its latest query read), so after ``T`` tokens it
    holds ``min(T, sink + window)`` (a full group of a sliding-window layer, ``min(T, window_l)``; a
    streaming one there, what both masks leave, :func:`headprobe.probe.layout.cost.streaming_positions`): :func:`headprobe.probe.layout.cost.policy_cost` predicts
    :attr:`nbytes`. Keys are cached after rotary with their original positions, so the kept
    keys give exactly the attention of :func:`~headprobe.probe.model.masks.streaming_key_mask` (no re-positioning).
    """

    policy: KVPolicy
    windows: tuple[int | None, ...] | None = None  # the layers' sliding windows (a full group there keeps its window)
    keys: list[list[Tensor]] = dataclasses.field(default_factory=list)
    values: list[list[Tensor]] = dataclasses.field(default_factory=list)
    positions: list[list[Tensor]] = dataclasses.field(default_factory=list)
    seen: list[int] = dataclasses.field(default_factory=list)
    key_positions: list[Tensor] = dataclasses.field(default_factory=list)

    @property
    def n_tokens(self) -> int:
        """Tokens seen so far (positions of the next token start here), not positions kept."""
        return self.seen[0] if self.seen else 0

    @property
    def nbytes(self) -> int:
        """Bytes of the cached keys and values (the position indices are bookkeeping, not counted)."""
        return sum(t.numel() * t.element_size() for layer in (*self.keys, *self.values) for t in layer)

    def extend(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append ``k``/``v`` (``[batch, group, new_pos, .]``); return every group's kept and new
        keys and values, ``[batch, group, k_pos, .]`` zero-padded to the longest group (its
        positions, -1 in padding, in ``key_positions[layer]``), then evict what no later query reads."""
        B, G, new = k.shape[:3]
        if layer == len(self.keys):
            self.keys.append([k[:, g, :0] for g in range(G)])
            self.values.append([v[:, g, :0] for g in range(G)])
            self.positions.append([torch.zeros(0, dtype=torch.long, device=k.device)] * G)
            self.seen.append(0)
        past = self.seen[layer]
        new_pos = torch.arange(past, past + new, device=k.device)
        ks = [torch.cat([self.keys[layer][g], k[:, g]], 1) for g in range(G)]
        vs = [torch.cat([self.values[layer][g], v[:, g]], 1) for g in range(G)]
        ps = [torch.cat([self.positions[layer][g], new_pos]) for g in range(G)]
        L = max(p.numel() for p in ps)
        k_out, v_out = k.new_zeros(B, G, L, k.shape[-1]), v.new_zeros(B, G, L, v.shape[-1])
        p_out = torch.full((G, L), -1, dtype=torch.long, device=k.device)
        for g in range(G):
            n = ps[g].numel()
            k_out[:, g, :n], v_out[:, g, :n], p_out[g, :n] = ks[g], vs[g], ps[g]
        last = past + new - 1
        layer_window = self.windows[layer] if self.windows else None
        for g, spec in enumerate(self.policy.groups[layer]):
            if spec is None and layer_window is None:
                continue
            keep = torch.ones_like(ps[g], dtype=torch.bool)
            if spec is not None:
                keep = (ps[g] < spec.sink) | (ps[g] > last - spec.window)
            if layer_window is not None:  # a sliding layer's group, full or streaming, keeps its window at most
                keep = keep & (ps[g] > last - layer_window)
            ks[g], vs[g], ps[g] = ks[g][:, keep].clone(), vs[g][:, keep].clone(), ps[g][keep]
        self.keys[layer], self.values[layer], self.positions[layer] = ks, vs, ps
        self.seen[layer] = past + new
        if layer == len(self.key_positions):
            self.key_positions.append(p_out)
        self.key_positions[layer] = p_out
        return k_out, v_out
