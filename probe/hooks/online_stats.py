"""Head statistics of long sequences without the ``[head, q_pos, k_pos]`` pattern.

:func:`online_head_stats` runs the native model with its fused attention kernel and hooks only
each layer's queries and keys (``hook_rot_q``/``hook_rot_k`` where the layer has rotary
positions, else ``hook_q``/``hook_k``; latent attention's ``hook_q``/``hook_k`` are after rotary),
then recomputes the layer's scores ``cap(q k^T * scale)`` (the layer's own scale and soft-cap,
under its causal, sliding-window or bidirectional mask; a GQA query head reads its KV head) in
query x key blocks of at most ``block`` x ``block`` positions. Over the key blocks of a query
block it keeps the online-softmax running maximum ``m`` and sum ``l = sum_j exp(s_j - m)`` (the
FlashAttention recurrence: Milakov & Gimelshein 2018, "Online normalizer calculation for
softmax"; Dao et al. 2022, "FlashAttention", Algorithm 1), rescaled by ``exp(m_old - m_new)``
whenever the maximum grows, and beside them, rescaled the same way:

* the entropy's numerator ``a = sum_j exp(s_j - m) (m - s_j)``: ``H = ln l + a / l`` nats
  (``-sum_j A_j ln A_j`` with ``A_j = exp(s_j - m) / l``, no cancellation: both terms >= 0);
* per window ``W``, the mass of the keys with ``|i - j| < W`` (the last ``W`` keys of a causal
  query ``i``, itself included): ``local_W = l_W / l``;
* the argmax key (the first of equal maxima, as ``torch.argmax``).

Learned attention sinks (GPT-OSS: the softmax runs over ``[scores, sink]`` and the sink's column is
dropped) enter the normaliser after the last key block, as one more term of ``l`` (``e_sink =
exp(sink - m)``, with ``m`` raised to the sink logit where it is larger), and nowhere else: ``lse``
is then the log of the whole normaliser, so every entry ``exp(s - lse)`` is the real key's weight as
``hook_pattern`` has it, ``local_W = l_W / l``, the entropy is ``-sum_j A_j ln A_j`` over the real
keys (``(a + l_keys ln l) / l``), the argmax is over the real keys, and ``sink`` holds the sink
mass ``e_sink / l`` of every query.

Single entries of the pattern (a diagonal ``A[i, i - o]``, a key column ``A[:, j]``) and a few
whole rows are computed afterwards from ``q``, ``k`` and ``lse = m + ln l``: ``exp(s - lse)``.
Memory per layer: ``q`` and ``k`` (``[batch, pos, head, d_qk]``), a few ``[batch, head, pos]``
statistics and one ``[batch, head, block, block]`` block, linear in the sequence length.

The numbers equal those read from the materialised pattern (``hook_pattern``) to float32
rounding (tests/test_streaming.py, every zoo family and SmolLM2).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.hooks.ablation import HookCounter
from headprobe.probe.hooks.names import attn_hook

DEFAULT_BLOCK = 256
"""Query and key positions per block of :func:`online_head_stats`: a block of SmolLM2's 9 heads
is 2.25 MiB of float32 scores, about a core's L2 cache (on this CPU 256 was faster than 128 or 512)."""

STREAMING_MIN_LEN = 1024
"""Sequences of at least this many tokens are scored by streaming (``auto``); shorter ones from
the materialised pattern (the same numbers; below this the pattern is at most 36 MiB per layer for
9 heads and the materialised path is faster)."""

DEFAULT_WINDOWS = (16, 64, 256)
"""The windows ``W`` (keys) of the local-fraction metric."""


@dataclass
class AttentionGeometry:
    """What recomputing one layer's attention scores needs: ``scale`` (factor of ``q k^T``),
    ``softcap`` (``c`` of ``c tanh(s / c)`` or None), ``window`` (keys of a sliding window, or
    None), ``causal``, and the head counts (query head ``h`` reads key head ``h // (n_heads //
    n_kv_heads)``)."""

    scale: float
    softcap: float | None
    window: int | None
    causal: bool
    n_heads: int
    n_kv_heads: int
    sinks: Tensor | None = None
    """Learned sink logits ``[head]`` (float32), or None."""

    def softmax(self, s: Float[Tensor, "batch head n_q n_k"]) -> Float[Tensor, "batch head n_q n_k"]:
        """The pattern of whole rows of scores: the softmax, over ``[s, sink]`` with the sink's
        column dropped where the layer has learned sinks."""
        if self.sinks is None:
            return s.softmax(dim=-1)
        sink = self.sinks.to(s.device)[None, :, None, None].expand(*s.shape[:-1], 1)
        return torch.cat([s, sink], dim=-1).softmax(dim=-1)[..., :-1]

    def scores(
        self,
        q: Float[Tensor, "batch head n_q d_qk"],
        k: Float[Tensor, "batch kv_head n_k d_qk"],
        q_pos: Int[Tensor, " n_q"],
        k_pos: Int[Tensor, " n_k"],
    ) -> Float[Tensor, "batch head n_q n_k"]:
        """Masked scores (float32, masked keys ``-inf``) of queries at positions ``q_pos`` against
        keys at ``k_pos``, computed as the native eager path does (q grouped per KV head)."""
        B, H, nq, d = q.shape
        KV, nk = k.shape[1], k.shape[2]
        s = (q.reshape(B, KV, (H // KV) * nq, d).float() @ k.float().transpose(-1, -2)).view(B, H, nq, nk) * self.scale
        if self.softcap is not None:
            s = torch.tanh(s / self.softcap) * self.softcap
        if not self.masks_block(q_pos, k_pos):
            return s  # every key of the block is read by every query: no mask
        allowed = self.allowed(q_pos, k_pos)
        return s if allowed is None else s.masked_fill_(~allowed, float("-inf"))

    def masks_block(self, q_pos: Int[Tensor, " n_q"], k_pos: Int[Tensor, " n_k"]) -> bool:
        """Whether some query of ``q_pos`` does not read some key of ``k_pos`` (any positions, in any
        order: ``capture_heads(rows=[-1, 1])`` asks for the last row first)."""
        if not self.causal:
            return False
        q_first, q_last, k_first, k_last = int(q_pos.min()), int(q_pos.max()), int(k_pos.min()), int(k_pos.max())
        return not (q_first >= k_last and (self.window is None or q_last - k_first < self.window))

    def allowed(self, q_pos: Int[Tensor, " n_q"], k_pos: Int[Tensor, " n_k"]) -> torch.Tensor | None:
        """``[n_q, n_k]`` True where query ``q_pos[i]`` reads key ``k_pos[j]`` (None: all)."""
        if not self.causal:
            return None
        diff = q_pos[:, None] - k_pos[None, :]
        ok = diff >= 0
        return ok & (diff < self.window) if self.window is not None else ok


@dataclass
class HeadStats:
    """One layer's streamed attention statistics on a batch of ``T``-token sequences.

    Attributes:
        lse: ``[batch, head, q_pos]`` the log of each query's softmax normaliser (natural log of
            ``sum_j exp(s_j)`` over the keys it reads).
        entropy: ``[batch, head, q_pos]`` nats, ``-sum_j A_ij ln A_ij``.
        argmax: ``[batch, head, q_pos]`` the key of each query's maximum attention (first of ties).
        local: window ``W`` -> ``[batch, head, q_pos]``, attention mass on the keys ``|i - j| < W``.
        q, k: the layer's queries ``[batch, head, pos, d_qk]`` and keys ``[batch, kv_head, pos, d_qk]``
            (post-rotary), for :meth:`diagonal`, :meth:`key_column` and :meth:`rows`.
        geometry: the layer's :class:`AttentionGeometry`.
        sink: ``[batch, head, q_pos]`` the learned sink's mass of each query (None without sinks).
    """

    lse: Tensor | None
    entropy: Tensor | None
    argmax: Tensor | None
    local: dict[int, Tensor]
    q: Tensor
    k: Tensor
    geometry: AttentionGeometry
    sink: Tensor | None = None
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def n_pos(self) -> int:
        """Sequence length ``T``."""
        return self.q.shape[2]

    def select(self, i: int) -> HeadStats:
        """The statistics of sequence ``i`` alone (batch 1)."""
        sl = slice(i, i + 1)

        def cut(t: Tensor | None) -> Tensor | None:
            return None if t is None else t[sl]

        return HeadStats(
            cut(self.lse),
            cut(self.entropy),
            cut(self.argmax),
            {W: v[sl] for W, v in self.local.items()},
            self.q[sl],
            self.k[sl],
            self.geometry,
            cut(self.sink),
        )

    def _kv(self) -> Tensor:
        """Keys repeated per query head, ``[batch, head, pos, d_qk]`` (one layer's copy, cached)."""
        if "kv" not in self._cache:
            g = self.geometry.n_heads // self.geometry.n_kv_heads
            self._cache["kv"] = self.k.repeat_interleave(g, dim=1) if g > 1 else self.k
        return self._cache["kv"]

    def _entries(self, qi: Tensor, kj: Tensor) -> Float[Tensor, "batch head n"]:
        """``A[q_i, k_j]`` for pairs of positions ``(qi[n], kj[n])`` (0 where masked)."""
        g = self.geometry
        s = (self.q[:, :, qi].float() * self._kv()[:, :, kj].float()).sum(-1) * g.scale
        if g.softcap is not None:
            s = torch.tanh(s / g.softcap) * g.softcap
        assert self.lse is not None  # layer_stats always fills it
        p = torch.exp(s - self.lse[:, :, qi])
        if g.causal:
            d = qi - kj
            ok = (d >= 0) & (d < g.window) if g.window is not None else d >= 0
            p = p * ok.to(p.dtype)
        return p

    def diagonal(self, offset: int) -> Float[Tensor, "batch head n"]:
        """``A[i, i - offset]`` over the queries where that key exists, ordered by query; equal to
        ``pattern.diagonal(offset=-offset, dim1=-2, dim2=-1)`` (a negative ``offset`` reads ahead)."""
        T = self.n_pos
        qi = torch.arange(max(offset, 0), T + min(offset, 0), device=self.q.device)
        return self._entries(qi, qi - offset)

    def key_column(self, key: int) -> Float[Tensor, "batch head q_pos"]:
        """``A[:, key]`` for every query (``key`` may be negative, counted from the end)."""
        T = self.n_pos
        qi = torch.arange(T, device=self.q.device)
        return self._entries(qi, torch.full_like(qi, key % T))

    def rows(
        self, queries: Sequence[int] | Tensor, heads: Sequence[int] | None = None
    ) -> Float[Tensor, "batch head n k_pos"]:
        """Whole pattern rows ``A[queries, :]`` (float32; of ``heads`` only, default all)."""
        qi = torch.as_tensor(queries, device=self.q.device, dtype=torch.long)
        T = self.n_pos
        s = self.geometry.scores(self.q[:, :, qi], self.k, qi, torch.arange(T, device=self.q.device))
        p = self.geometry.softmax(s)
        return p if heads is None else p[:, list(heads)]


STREAMING_REFUSAL = (
    "streaming head statistics need the native backend, not {backend}; load the model with "
    "--backend native, or use the materialised path (--streaming off)"
)
"""Why streaming refuses a backend without ``streams_statistics`` (:class:`~headprobe.probe.backends.base.LoadedModel`)."""
MODEL_STREAMING_REFUSAL = (
    "streaming head statistics (--streaming on) do not apply to this model; use the materialised path (--streaming off)"
)
"""Why streaming refuses a model whose backend streams but which does not (a hybrid's linear-attention layers)."""


def streaming_refusal(model: Any) -> str:
    """The sentence refusing streaming on ``model``: the backend's (:data:`STREAMING_REFUSAL`) where
    its class lacks ``streams_statistics``, else the model's (:data:`MODEL_STREAMING_REFUSAL`; the
    capability's own reason, e.g. a hybrid's linear layers, is added by ``LoadedModel.lacks``)."""
    if getattr(type(model), "streams_statistics", False):
        return MODEL_STREAMING_REFUSAL
    return STREAMING_REFUSAL.format(backend=model.name)


def geometry_and_hooks(model: Any, layer: int) -> tuple[AttentionGeometry, str, str]:
    """The layer's :class:`AttentionGeometry` and the hook names of its final queries and keys
    (:meth:`~headprobe.probe.backends.base.LoadedModel.online_stats_geometry`).

    Raises:
        HeadprobeError: a backend without ``streams_statistics``, or a layer whose hooked queries are
            not the ones attention reads (a query/key norm without rotary positions).
    """
    model.require("streams_statistics", streaming_refusal(model))
    geom, rotary = model.online_stats_geometry(layer)
    q, k = ("rot_q", "rot_k") if rotary else ("q", "k")
    return geom, attn_hook(layer, q), attn_hook(layer, k)


def _block_kinds(q0: int, q1: int, k0: int, k1: int, W: int) -> str:
    """Whether every pair of the block has ``|i - j| < W`` (``"in"``), none (``"out"``), or some."""
    if max(q1 - 1 - k0, k1 - 1 - q0) < W:
        return "in"
    if q0 - (k1 - 1) >= W or k0 - (q1 - 1) >= W:
        return "out"
    return "mixed"


def _key_range(geom: AttentionGeometry, q0: int, q1: int, T: int) -> tuple[int, int]:
    """The keys any query in ``[q0, q1)`` reads: causal ``[.., q1)``, windowed from ``q0 - W + 1``."""
    if not geom.causal:
        return 0, T
    lo = 0 if geom.window is None else max(0, q0 - geom.window + 1)
    return lo, q1


def layer_stats(
    q: Float[Tensor, "batch head pos d_qk"],
    k: Float[Tensor, "batch kv_head pos d_qk"],
    geom: AttentionGeometry,
    windows: Sequence[int] = DEFAULT_WINDOWS,
    block: int = DEFAULT_BLOCK,
    argmax: bool = True,
    entropy: bool = True,
) -> HeadStats:
    """Stream one layer's statistics (see the module docstring) from its queries and keys.
    ``argmax`` / ``entropy`` False skip those (about a fifth and a quarter of the time; the
    field is then None).

    Returns:
        :class:`HeadStats` of the layer.
    """
    B, H, T, _ = q.shape
    dev = q.device
    lse = torch.empty(B, H, T, device=dev)
    ent = torch.empty(B, H, T, device=dev) if entropy else None
    arg = torch.empty(B, H, T, dtype=torch.long, device=dev) if argmax else None
    local = {W: torch.empty(B, H, T, device=dev) for W in windows}
    sink = None if geom.sinks is None else torch.empty(B, H, T, device=dev)
    for q0 in range(0, T, block):
        q1 = min(q0 + block, T)
        m, l, a, idx, lw = _query_block(q, k, geom, q0, q1, windows, block, argmax, entropy)
        l_keys = l
        if geom.sinks is not None:  # the sink enters the normaliser only
            m, l, a, lw, e_sink = _add_sink(m, l, a, lw, geom.sinks.to(dev))
            l_keys = l - e_sink
            assert sink is not None
            sink[..., q0:q1] = e_sink / l
        lse[..., q0:q1] = m + l.log()
        if ent is not None:  # entropy of the real keys' weights: ln l + a / l, with a sink (a + l_keys ln l) / l
            ent[..., q0:q1] = l.log() + a / l if sink is None else (a + l_keys * l.log()) / l
        if arg is not None:  # argmax
            arg[..., q0:q1] = idx
        for W in windows:
            local[W][..., q0:q1] = lw[W] / l
    return HeadStats(lse, ent, arg, local, q, k, geom, sink)


def _add_sink(
    m: Tensor, l: Tensor, a: Tensor, lw: dict[int, Tensor], sinks: Float[Tensor, " head"]
) -> tuple[Tensor, Tensor, Tensor, dict[int, Tensor], Tensor]:
    """The learned sink folded into a query block's running statistics ``[batch, head, n_q]``: the
    maximum raised to the sink logit where larger (``l``, ``a``, ``l_W`` rescaled as for a key
    block), then ``e_sink = exp(sink - m)`` added to ``l`` only. Returns ``m, l, a, l_W, e_sink``."""
    s = sinks[None, :, None].expand_as(m)
    m_new = torch.maximum(m, s)
    alpha = torch.exp(m - m_new)
    a = alpha * (a + l * (m_new - m))
    lw = {W: v * alpha for W, v in lw.items()}
    e_sink = torch.exp(s - m_new)
    return m_new, alpha * l + e_sink, a, lw, e_sink


def _query_block(
    q: Tensor,
    k: Tensor,
    geom: AttentionGeometry,
    q0: int,
    q1: int,
    windows: Sequence[int],
    block: int,
    argmax: bool,
    entropy: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, dict[int, Tensor]]:
    """The online-softmax recurrence over the key blocks of queries ``[q0, q1)``: running
    maximum ``m``, sum ``l``, entropy numerator ``a``, argmax and per-window sums, ``[batch, head, n_q]``.

    Per block ``t = s - m_new`` is computed in place and ``e = exp(t)``; the block's entropy
    term is ``-sum_j e_j t_j`` (0 for a masked key: ``0 * -inf`` is set to 0)."""
    B, H, T, _ = q.shape
    dev = q.device
    n = q1 - q0
    m = torch.full((B, H, n), float("-inf"), device=dev)
    l = torch.zeros(B, H, n, device=dev)
    a = torch.zeros(B, H, n, device=dev)
    idx = torch.zeros(B, H, n, dtype=torch.long, device=dev)
    lw = {W: torch.zeros(B, H, n, device=dev) for W in windows}
    q_pos = torch.arange(q0, q1, device=dev)
    qb = q[:, :, q0:q1]
    lo, hi = _key_range(geom, q0, q1, T)
    for k0 in range(lo, hi, block):
        k1 = min(k0 + block, hi)
        k_pos = torch.arange(k0, k1, device=dev)
        s = geom.scores(qb, k[:, :, k0:k1], q_pos, k_pos)
        masked = geom.masks_block(q_pos, k_pos)
        if argmax:
            bmax, barg = s.max(dim=-1)
            idx = torch.where(bmax > m, barg + k0, idx)  # strictly: an earlier block keeps a tie (first maximum)
        else:
            bmax = s.amax(dim=-1)
        m_new = torch.maximum(m, bmax)
        # a row with no key yet keeps m_new = -inf: shift by 0 there (its e are all exp(-inf) = 0)
        safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new)) if masked else m_new
        alpha = torch.exp(m - safe)  # 0 where m = -inf
        t = s.sub_(safe[..., None])  # in place: s is not needed again
        e = t.exp()
        if entropy:
            dm = torch.where(torch.isfinite(m), safe - m, torch.zeros_like(m))
            et = e * t
            if masked:
                et = et.nan_to_num_(nan=0.0)
            a = alpha * (a + l * dm) - et.sum(-1)
        esum = e.sum(-1)
        l = alpha * l + esum
        for W in windows:
            kind = _block_kinds(q0, q1, k0, k1, W)
            lw[W].mul_(alpha)
            if kind == "in":
                lw[W].add_(esum)
            elif kind == "mixed":
                near = (q_pos[:, None] - k_pos[None, :]).abs() < W
                lw[W].add_((e * near).sum(-1))
        m = m_new
    return m, l, a, idx, lw


StatsCallback = Callable[[int, HeadStats], None]


@torch.inference_mode()
def online_head_stats(
    model: Any,
    tokens: Int[Tensor, "batch pos"],
    on_stats: StatsCallback,
    layers: Sequence[int] | None = None,
    windows: Sequence[int] = DEFAULT_WINDOWS,
    block: int = DEFAULT_BLOCK,
    extra_hooks: Sequence[tuple[str, Callable]] = (),
    final_residual: bool = True,
    statistics: bool = True,
    argmax: bool = True,
    entropy: bool = True,
) -> Float[Tensor, "batch pos d_model"] | None:
    """Run ``model`` (native backend) on ``tokens`` with the fused attention kernel, calling
    ``on_stats(layer, stats)`` (:class:`HeadStats`) for each of ``layers`` (default: all) as soon as
    its queries and keys exist. The callback must not keep ``stats``. No N x N pattern is made
    (except inside a layer whose soft-cap forces the eager path, Gemma-2: the model's own).
    ``statistics`` False skips the recurrence: ``stats`` then only serves :meth:`HeadStats.rows`
    (its ``lse``, ``entropy``, ``argmax`` are None and ``local`` empty); ``argmax``, ``entropy``
    False skip those (:func:`layer_stats`).

    Returns:
        The final residual stream (after the final norm, what the unembedding reads), or None
        with ``final_residual`` False (then the forward stops being run for logits at all: the
        residual is still computed, never unembedded).

    Raises:
        HeadprobeError: not the native backend, a layer's hooks did not fire once, or a layer
            whose queries cannot be read (:func:`geometry_and_hooks`).
    """
    layers = list(range(model.spec.n_layers) if layers is None else layers)
    counter = HookCounter()
    hooks, names = [], []
    for layer in layers:
        geom, q_name, k_name = geometry_and_hooks(model, layer)
        kept: dict[str, Tensor] = {}

        def keep_q(x: Tensor, hook: Any, kept=kept) -> None:
            kept["q"] = x.detach().transpose(1, 2)  # [batch, head, pos, d_qk]

        def use_k(x: Tensor, hook: Any, kept=kept, layer=layer, geom=geom, name=k_name) -> None:
            counter.tick(name)
            k = x.detach().transpose(1, 2)
            if geom.n_kv_heads == geom.n_heads and k.shape[1] != geom.n_heads:
                raise HeadprobeError(f"layer {layer}: keys have {k.shape[1]} heads, expected {geom.n_heads}")
            q = kept.pop("q")
            on_stats(
                layer,
                layer_stats(q, k, geom, windows, block, argmax, entropy)
                if statistics
                else HeadStats(None, None, None, {}, q, k, geom),
            )

        hooks += [(q_name, keep_q), (k_name, use_k)]
        names.append(k_name)
    resid = model.final_residual(tokens, fwd_hooks=[*hooks, *extra_hooks])
    counter.check_once(names)
    return resid if final_residual else None


def windowed_means(stats: HeadStats) -> dict[int, Float[Tensor, " head"]]:
    """The local fraction of every window of ``stats`` with ``W < T``: the batch mean of
    ``local_W`` over the queries ``i >= W`` (those with keys outside the window)."""
    return {W: v[..., W:].float().mean(dim=(0, 2)) for W, v in stats.local.items() if W < stats.n_pos}


__all__ = ["AttentionGeometry", "HeadStats", "layer_stats", "online_head_stats", "windowed_means"]
