"""Head metrics reported beside the head types (not verified by ablation): the attention sink
rate, the attention entropy, the retrieval score, the direct logit attribution, and the weight
metrics of :mod:`headprobe.analyses.composition` (copying score, composition).

Pattern metrics take ``pattern: [batch, head, q_pos, k_pos]`` (rows sum to 1, causal) and score
every head of a layer at once, without modifying the pattern. With learned attention sinks
(GPT-OSS: the softmax runs over the keys and one sink logit per head, whose column is dropped) the
pattern holds the real keys' weights and a row sums to ``1 - s``, ``s`` the sink's mass, which
``learned_sink_mass`` reports (:data:`NO_OP`, how a head says nothing). Every mass is then a share
of the whole softmax: ``sink_rate`` is the weight on token 0, ``local_<W>`` the mass on the last
``W`` keys and ``distant_mass`` the mass on the keys ``W`` or more back, so that ``local_<W> +
distant_mass + s = 1`` per query (the sink is neither near nor far); ``entropy`` is that of the
whole softmax, the sink one outcome of it. Each metric is one
:class:`~headprobe.analyses.columns.HeadColumn` record here (``COPYING``, ``SINK_RATE``, ``ENTROPY``,
``RETRIEVAL``, ``DLA``), registered by name in :data:`headprobe.analyses.columns.HEAD_COLUMNS`;
:func:`scan_metrics` computes every registered one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from headprobe.analyses import composition
from headprobe.analyses.columns import METRICS, HeadColumn, HeatmapStyle, metric_columns
from headprobe.analyses.data import NeedleSet, TokenSet
from headprobe.probe.backends.base import LoadedModel
from headprobe.probe.core import memory
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.core.io import TextFile
from headprobe.probe.hooks.capture import patterns_by_layer
from headprobe.probe.hooks.names import attn_hook, block_hook

Pattern = Float[Tensor, "batch head q_pos k_pos"]

SINK_THRESHOLD = 0.3
"""Gu et al. 2024's epsilon: a head is a sink head for token k when its sink rate exceeds it
(here the batch-mean rate; see :func:`sink_rate` for how Gu et al.'s code differs)."""

LOCAL_WINDOWS = (16, 64, 256)
"""The windows ``W`` (keys) of the ``local_<W>`` columns; ``distant_mass`` is read at the largest
one shorter than the sequence."""


def sink_rate(pattern: Pattern, key: int = 0) -> Float[Tensor, " head"]:
    """Attention to key ``key`` averaged over the queries that can see it (Gu et al. 2024, "When
    Attention Sink Emerges in Language Models", eq. 1: ``alpha_k = 1/(T-k+1) sum_{i>=k} A_{i,k}``,
    1-indexed), then over the batch. For the first token (``key`` 0) that is every query, query 0
    included (which attends only to itself, weight 1); the first-token score
    (:func:`headprobe.analyses.detectors.first_token_score`) excludes it, so on one length T
    ``sink_rate = (1 + (T-1) first_token) / T``. Gu et al. call the head a sink head when this
    exceeds :data:`SINK_THRESHOLD` (0.3) and report the share of such heads as ``Sink_k^eps``.

    Convention: the rate is averaged over the batch *before* the threshold, so a scan's
    ``sink_heads_share`` is the share of heads whose batch-mean rate exceeds 0.3. Gu et al.'s
    released code thresholds each sample's rate and averages the per-sample shares: on the demo
    model (SmolLM2-135M) 62.41% against headprobe's 64.81%; per head the rates agree.

    Raises:
        ValueError: ``pattern`` is not ``[batch, head, q, q]``, or ``key`` is outside it.
    """
    if pattern.ndim != 4 or pattern.shape[-1] != pattern.shape[-2] or not 0 <= key < pattern.shape[-1]:
        raise ValueError(
            f"pattern must be [batch, head, q_pos, k_pos] (q_pos == k_pos > key={key}), got {tuple(pattern.shape)}"
        )
    return pattern[..., key:, key].float().mean(dim=(0, 2))


def attention_entropy(pattern: Pattern, learned_sink: bool = False) -> Float[Tensor, " head"]:
    """Mean entropy (nats) of each query's attention distribution, ``-sum_k A_{q,k} ln A_{q,k}``
    (``0 ln 0 = 0``), over queries ``q >= 1`` and the batch. Query 0 is excluded (it sees one
    key, entropy 0), as in every detector. A uniform causal pattern gives ``ln(q + 1)`` at query q;
    a one-hot pattern 0. Source: the attention entropy of Vig & Belinkov 2019 and Clark et al. 2019
    ("What does BERT look at?", their per-head entropy).

    ``learned_sink``: the layer has learned sinks (rows sum to ``1 - s``); the sink is one more
    outcome of the softmax and adds ``-s ln s``, so a head that puts its mass on the sink scores
    low, as one that puts it on token 0 does.

    Raises:
        ValueError: ``pattern`` is not ``[batch, head, q, q]`` with q >= 2.
    """
    if pattern.ndim != 4 or pattern.shape[-1] != pattern.shape[-2] or pattern.shape[-1] < 2:
        raise ValueError(
            f"pattern must be [batch, head, q_pos, k_pos] with q_pos == k_pos >= 2, got {tuple(pattern.shape)}"
        )
    p = pattern[..., 1:, :].float()
    ent = -torch.special.xlogy(p, p).sum(-1)
    if learned_sink:
        sink = (1.0 - p.sum(-1)).clamp(0.0, 1.0)
        ent = ent - torch.special.xlogy(sink, sink)
    return ent.mean(dim=(0, 2))


def local_fraction(pattern: Pattern, window: int) -> Float[Tensor, " head"]:
    """Local fraction: the attention mass on the keys ``j`` with ``|i - j| < window`` (for a causal
    query ``i`` its last ``window`` keys, itself included), averaged over the queries ``i >=
    window`` (those that can read a key outside the window) and the batch. A head that reads only
    recent tokens scores 1; a sink or retrieval head little. The rest of the row is the
    :func:`distant_fraction` and, with learned sinks, the sink's mass. The per-head split of DuoAttention (Xiao et al. 2024, arXiv 2410.10819:
    "streaming heads" that need only an attention sink and recent tokens) and of the sliding
    windows of Beltagy et al. 2020 (Longformer), measured from the pattern.

    Raises:
        ValueError: ``pattern`` is not ``[batch, head, q, q]`` with q > ``window``.
    """
    return _window_mass(pattern, window, local=True)


def distant_fraction(pattern: Pattern, window: int) -> Float[Tensor, " head"]:
    """Distant mass: the attention mass on the keys ``j <= i - window`` (``window`` or more back),
    averaged over the queries ``i >= window`` and the batch, the keys a streaming head with a
    ``window``-key cache and no sink tokens would drop (DuoAttention, arXiv 2410.10819). Without
    learned sinks ``1 -`` :func:`local_fraction`; with them the sink's share is in neither.

    Raises:
        ValueError: ``pattern`` is not ``[batch, head, q, q]`` with q > ``window``.
    """
    return _window_mass(pattern, window, local=False)


def _window_mass(pattern: Pattern, window: int, local: bool) -> Float[Tensor, " head"]:
    """The attention mass on the keys with ``|i - j| < window`` (``local``) or ``j <= i - window``,
    averaged over the queries ``i >= window`` and the batch: :func:`local_fraction`, :func:`distant_fraction`.

    Raises:
        ValueError: ``pattern`` is not ``[batch, head, q, q]`` with q > ``window``.
    """
    T = pattern.shape[-1]
    if pattern.ndim != 4 or T != pattern.shape[-2] or T <= window:
        raise ValueError(
            f"pattern must be [batch, head, q_pos, k_pos] with q_pos == k_pos > window={window}, "
            f"got {tuple(pattern.shape)}"
        )
    i = torch.arange(T, device=pattern.device)
    offset = i[:, None] - i[None, :]  # [q_pos, k_pos]: i - j
    keys = offset.abs() < window if local else offset >= window
    return (pattern.float() * keys).sum(-1)[..., window:].mean(dim=(0, 2))


def local_columns(windows: tuple[int, ...]) -> tuple[str, ...]:
    """head_scores.csv's local-fraction columns, ``local_<W>`` per window, then ``distant_mass``."""
    return (*(f"local_{w}" for w in windows), "distant_mass")


def learned_sink_mass(pattern: Pattern) -> Float[Tensor, " head"]:
    """The learned sink's mass (GPT-OSS's per-head sink logit), ``1 - sum_k A[q, k]`` of the
    real-key pattern, averaged over every query and the batch: 0 for a model without sinks."""
    return (1.0 - pattern.float().sum(-1)).mean(dim=(0, 2))


def gate_closure(gate: Float[Tensor, "batch pos head ..."]) -> Float[Tensor, " head"]:
    """How closed an output gate is: ``1 - mean gate value`` of each head (gated attention, e.g.
    Qwen3-Next: ``z_h`` times a gate in [0, 1]; Qiu et al. 2025, "Gated Attention for Large
    Language Models", arXiv 2505.06708), over the batch, the positions and any per-dimension axes.

    Raises:
        ValueError: ``gate`` has fewer than 3 axes.
    """
    if gate.ndim < 3:
        raise ValueError(f"gate must be [batch, pos, head, ...], got {tuple(gate.shape)}")
    g = gate.float().movedim(2, 0).flatten(1)
    return 1.0 - g.mean(dim=1)


def value_norms(
    v: Float[Tensor, "batch pos kv_head d_head"], W_O: Float[Tensor, "head d_head d_model"]
) -> Float[Tensor, "batch head pos"]:
    """``||f_h(x_j)|| = ||v_j W_O^(h)||`` of every head and key (query head h reads key/value head
    ``h // (head / kv_head)``), through the Gram matrix ``W_O^(h) W_O^(h)T`` (no ``[.., d_model]``
    product); Kobayashi et al. 2020, "Attention is Not Only a Weight", eq. 5 without ``b_V``."""
    H, KV = W_O.shape[0], v.shape[2]
    gram = W_O.float() @ W_O.float().transpose(1, 2)  # [head, d_head, d_head]
    vh = v.float()[:, :, torch.arange(H, device=v.device) // (H // KV)]  # [batch, pos, head, d_head]
    sq = torch.einsum("bphd,hde,bphe->bhp", vh, gram.to(vh.device), vh)
    return sq.clamp_min(0).sqrt()


def value_weighted_share(
    pattern: Pattern, norms: Float[Tensor, "batch head k_pos"], key: int = 0
) -> Float[Tensor, " head"]:
    """The share of the value-weighted attention ``||A_ij f(x_j)|| = A_ij ||f(x_j)||`` that goes to
    key ``key``: ``A_i,key n_key / sum_j A_ij n_j`` (Kobayashi et al. 2020, "Attention is Not Only a
    Weight", the norm ``||alpha f(x)||``), over queries ``i > key`` and the batch (query ``key``
    reads only itself at ``key`` 0). A learned sink's value is zero, so it takes no share.

    Raises:
        ValueError: ``pattern`` is not ``[batch, head, q, q]`` with q > ``key + 1``, or ``norms`` not ``[batch, head, q]``.
    """
    T = pattern.shape[-1]
    if pattern.ndim != 4 or T != pattern.shape[-2] or T <= key + 1 or tuple(norms.shape) != (*pattern.shape[:2], T):
        raise ValueError(
            f"pattern must be [batch, head, q, q] with q > {key + 1} and norms [batch, head, q], got "
            f"{tuple(pattern.shape)} and {tuple(norms.shape)}"
        )
    w = pattern.float() * norms.float()[:, :, None, :]
    share = w[..., key] / w.sum(-1).clamp_min(1e-30)
    return share[..., key + 1 :].mean(dim=(0, 2))


def copy_paste_hits(
    top: Int[Tensor, "batch n head"],
    tokens: Int[Tensor, "batch pos"],
    predicted: Int[Tensor, "batch n"],
    first: Int[Tensor, " batch"],
    length: int,
) -> Bool[Tensor, "batch n head"]:
    """Wu et al.'s copy-paste test of each head at each scored query: the key the head attends to
    most (``top``) lies in the needle's first occurrence ``[first, first + length)`` and holds the
    token the model predicts there (``predicted``), whichever needle position that is (the
    authors' ``check_if_attend_ref``: ``needle_start <= i < needle_end and inp == prompt_ids[i]``)."""
    device = top.device
    first = first.to(device)[:, None, None]
    in_needle = (top >= first) & (top < first + length)
    key_token = tokens.to(device).gather(1, top.flatten(1)).view(top.shape)
    return in_needle & (key_token == predicted.to(device)[..., None])


def retrieval_hits(
    pattern: Pattern,
    queries: Int[Tensor, "batch n"],
    tokens: Int[Tensor, "batch pos"],
    predicted: Int[Tensor, "batch n"],
    first: Int[Tensor, " batch"],
    length: int,
) -> Float[Tensor, " head"]:
    """Retrieval score (Wu et al. 2024, "Retrieval Head Mechanistically Explains Long-Context
    Factuality"): the share of needle tokens that a head copy-pastes, ``|g_h ∩ k| / |k|``. At
    query ``queries[b, i]`` the model predicts ``predicted[b, i]``; head h copy-pastes it when its
    maximum attention falls on a key of the needle's first occurrence (``first[b]``, ``length``
    tokens) that holds that token (:func:`copy_paste_hits`). The denominator is every needle token
    scored (``batch * n``), copied or not, as in the paper.

    Raises:
        ValueError: shapes that do not match.
    """
    if queries.shape != predicted.shape or queries.shape[0] != pattern.shape[0] or tokens.shape[0] != pattern.shape[0]:
        raise ValueError(
            f"queries {tuple(queries.shape)} and predicted {tuple(predicted.shape)} must both be [batch, n] and "
            f"tokens {tuple(tokens.shape)} [batch, pos], with batch {pattern.shape[0]}"
        )
    B = pattern.shape[0]
    rows = pattern[
        torch.arange(B, device=pattern.device)[:, None], :, queries.to(pattern.device)
    ]  # [batch, n, head, k_pos]
    return copy_paste_hits(rows.argmax(-1), tokens, predicted, first, length).float().mean(dim=(0, 1))


def needle_queries(needles: NeedleSet) -> tuple[Int[Tensor, "batch n"], Int[Tensor, "batch n"], Int[Tensor, "batch n"]]:
    """The scored queries of a :class:`~headprobe.analyses.data.NeedleSet`: inside the second
    needle, position ``second + i`` predicts needle token ``i + 1`` (i < needle_len - 1; the
    needle's first token has no cue), whose earlier occurrence is at ``first + i + 1``.

    Returns:
        (queries, sources, targets): query positions, source positions, target token ids.
    """
    return needles.queries()


@torch.inference_mode()
def retrieval_score(model: LoadedModel, needles: NeedleSet, streaming: bool = False) -> Float[Tensor, "layer head"]:
    """:func:`retrieval_hits` of every head on ``needles`` in one forward pass (teacher forced:
    the second needle is in the input, and the model's top prediction at each of its positions is
    the token a head may copy-paste). Also see :func:`needle_queries`. ``streaming``: each
    head's argmax from :func:`headprobe.probe.hooks.online_stats.online_head_stats` instead of the
    pattern (the same keys; native backend); the logits only at the scored queries either way."""
    spec = model.spec
    queries = needle_queries(needles)[0].cpu()  # moved to each tensor it indexes
    B = queries.shape[0]
    top: dict[int, Tensor] = {}
    rows_b = torch.arange(B)[:, None]

    def on_pattern(layer: int, pattern: Tensor) -> None:
        rows = pattern[rows_b.to(pattern.device), :, queries.to(pattern.device)]
        top[layer] = rows.argmax(-1).cpu()  # [batch, n, head]

    def on_stats(layer: int, st: Any) -> None:  # the same argmax from the scored rows alone: [batch, n, head]
        top[layer] = torch.stack([st.select(b).rows(queries[b])[0].argmax(-1).T for b in range(B)]).cpu()

    if streaming:
        from headprobe.probe.hooks.online_stats import online_head_stats

        resid = online_head_stats(model, needles.tokens, on_stats, windows=(), statistics=False)
    else:
        hooks = [
            (attn_hook(layer, "pattern"), (lambda layer: lambda p, hook: on_pattern(layer, p))(layer))  # noqa: B023 - bound by the call
            for layer in range(spec.n_layers)
        ]
        resid = model.final_residual(needles.tokens, fwd_hooks=hooks)
    assert resid is not None  # online_head_stats returns it (final_residual defaults to True)
    # the model's prediction at the scored queries only: no [batch, pos, d_vocab] logits
    logits = model.logits_from_residual(resid[rows_b.to(resid.device), queries.to(resid.device)], normed=True)
    if len(top) != spec.n_layers:
        raise HeadprobeError(
            f"attention of {spec.n_layers - len(top)} layers was not seen: the model probably runs a "
            f"fused attention kernel that hides attention patterns"
        )
    pred = logits.argmax(-1).cpu()
    out = torch.zeros(spec.n_layers, spec.n_heads)
    for layer, t in top.items():
        hits = copy_paste_hits(t, needles.tokens.cpu(), pred, needles.first, needles.length)
        out[layer] = hits.float().mean(dim=(0, 1))
    return out


@torch.inference_mode()
def direct_logit_attribution(
    model: LoadedModel, tokens: Int[Tensor, "batch pos"], first: int
) -> Float[Tensor, "batch n layer head"]:
    """Each head's direct contribution to the logit of the correct next token, through the final
    norm with its per-token scale frozen at the clean run's (Elhage et al. 2021; TransformerLens'
    ``apply_ln_to_stack``): at position i (``first <= i <= pos - 2``, target ``tokens[:, i+1]``),
    ``dla_h = (z_h W_O^(h)) . (s_i P (w * g_i))`` with ``w`` the final norm's weight, ``P`` the
    centring (LayerNorm only), ``s_i = 1/sigma_i`` fitted from the run by least squares, and
    ``g_i`` the gradient of the target's logit with respect to the normed residual, taken through
    the backend's own logits function
    (:meth:`~headprobe.probe.backends.base.LoadedModel.logits_from_residual`, soft-cap left out):
    ``W_U[:, target]`` times the family's logit scale where it has one (Cohere, Granite),
    ``W_U[:, target]`` itself otherwise. The heads, ``b_O``, embeddings and MLP outputs (the terms
    of the final residual) through the same map, plus the constant (the final norm's bias and
    ``b_U`` through the unembedding), sum to the logit before any soft-cap (tested against
    Hugging Face's logits). A final soft-cap (Gemma-2) is not linear and is not attributed
    through: the pre-cap logit is attributed (as TransformerLens' ``logit_attrs``, which unembeds
    without the cap).

    Convention: ``W_U`` as the model has it, so the terms sum to the model's own logit.
    TransformerLens' default processing centres ``W_U`` over the vocabulary (``center_unembed``),
    so its attribution is that of ``logit(target) - mean_v logit(v)`` (the same softmax, another
    number; on SmolLM2-135M its ranking of the heads has Spearman 0.61 with this one).
    The centred form is not offered: its terms sum to no logit the model computes,
    so the identity that guards this one (tested) would not guard it; to compare with
    TransformerLens, load it with ``center_unembed=False``. See docs/scan.md, "Comparing with
    other tools".

    Two forward passes: one for the final residual stream, one reading each layer's ``hook_z``.

    Returns:
        ``[batch, n, layer, head]`` logit units, ``n = pos - 1 - first`` positions.

    Raises:
        HeadprobeError: the model normalises attention outputs before the residual stream
            (OLMo-2, Gemma-2: a head's contribution there is not linear in z).
    """
    spec = model.spec
    if model.has_post_attention_norm:
        raise HeadprobeError("direct logit attribution of single heads needs a model without post-attention norms")
    tokens = tokens.to(model.device)
    last = block_hook(spec.n_layers - 1, "resid_post")
    kept: dict[str, Tensor] = {}
    # final_residual: the forward without the [batch, pos, d_vocab] logits (native backend)
    model.final_residual(tokens, fwd_hooks=[(last, lambda x, hook: kept.__setitem__("x", x.detach().float()))])
    x = kept["x"][:, first:-1]  # [batch, n, d_model]
    target = tokens[:, first + 1 :]
    y_model = model.final_norm(x.to(model.dtype))  # the normed residual the unembedding reads
    with torch.inference_mode(False), torch.enable_grad():  # the unembedding's gradient: its linear part
        y_in = y_model.clone().requires_grad_(True)
        vocab = target[..., None].clone()  # not an inference tensor: autograd saves the index of W_U[vocab]
        logit = model.logits_from_residual(y_in, vocab=vocab, normed=True, softcap=False)
        (g,) = torch.autograd.grad(logit.sum(), y_in)  # [batch, n, d_model]: positions are independent
    g = g.detach().float()
    norm = model.norm_weights(None)
    if norm is None:
        u = g
    else:
        y = y_model.float() - norm.bias.to(x.device)
        xc = x - x.mean(-1, keepdim=True) if norm.centers else x
        wx = norm.weight.to(x.device) * xc
        s = (y * wx).sum(-1, keepdim=True) / (wx * wx).sum(-1, keepdim=True).clamp_min(1e-30)
        u = s * norm.weight.to(x.device) * g
        if norm.centers:
            u = u - u.mean(-1, keepdim=True)
    out = torch.zeros(*u.shape[:2], spec.n_layers, spec.n_heads, device=u.device)

    def make(layer: int):
        W_O = model.W_O(layer).detach().float()

        def hook(z: Tensor, hook: Any) -> None:
            dirs = torch.einsum("hed,bnd->bnhe", W_O.to(z.device), u)  # W_O^(h) u, [batch, n, head, d_head]
            out[:, :, layer] = (z[:, first:-1].float() * dirs).sum(-1)

        return hook

    model.final_residual(tokens, fwd_hooks=[(attn_hook(layer, "z"), make(layer)) for layer in range(spec.n_layers)])
    return out


@dataclass(frozen=True)
class MetricInputs:
    """What a metric's score function (:attr:`~headprobe.analyses.columns.HeadColumn.score`) is given
    besides the model: the scan's natural-text token set, its needle set (None where the sequences
    are too short for two needles) and the first scored prediction of the natural text."""

    natural: TokenSet
    needles: NeedleSet | None
    first: int
    streaming: str = "auto"
    """``auto``, ``on`` or ``off``: pattern metrics from streamed statistics or from the pattern."""
    notes: dict[str, str] = field(default_factory=dict)
    """Column -> why it is NaN, for a column one metric leaves NaN while the others are filled."""
    cache: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    """Results shared by several metrics (the natural-text pattern pass), computed once."""


def _natural_pattern_metrics(model: LoadedModel, inputs: MetricInputs) -> dict[str, np.ndarray]:
    """``sink_rate``, ``entropy``, ``local_<W>`` and ``distant_mass`` of the natural text, from one
    forward (:func:`_pattern_metrics`) the first time a metric asks."""
    from headprobe.analyses.scoring import use_online_stats

    if "pattern" not in inputs.cache:
        stream = use_online_stats(model, inputs.natural.tokens.shape[1], inputs.streaming)
        inputs.cache["pattern"] = _pattern_metrics(model, inputs.natural, stream, LOCAL_WINDOWS, inputs.notes)
    return inputs.cache["pattern"]


def _from_pattern_pass(*columns: str) -> Callable[[LoadedModel, MetricInputs], dict[str, np.ndarray]]:
    """A metric whose ``columns`` come from the natural-text pattern pass."""

    def score(model: LoadedModel, inputs: MetricInputs) -> dict[str, np.ndarray]:
        res = _natural_pattern_metrics(model, inputs)
        return {c: res[c] for c in columns}

    return score


def _copying(model: LoadedModel, inputs: MetricInputs) -> dict[str, np.ndarray]:
    return {"copying": composition.copying_score(model).numpy()}


def _retrieval(model: LoadedModel, inputs: MetricInputs) -> dict[str, np.ndarray]:
    if inputs.needles is None:
        raise HeadprobeError("sequences too short for two needles")
    from headprobe.analyses.scoring import use_online_stats

    stream = use_online_stats(model, inputs.needles.tokens.shape[1], inputs.streaming)
    return {"retrieval": retrieval_score(model, inputs.needles, stream).numpy()}


def _dla(model: LoadedModel, inputs: MetricInputs) -> dict[str, np.ndarray]:
    model.self_check.require_decomposition("direct logit attribution")
    return {"dla": direct_logit_attribution(model, inputs.natural.tokens, inputs.first).mean(dim=(0, 1)).cpu().numpy()}


NO_SINKS = "the model has no learned attention sinks"
"""Why ``learned_sink_mass`` is NaN on a model without them."""
NO_GATE = "the model has no attention output gate (hook_gate)"
"""Why ``gate_closure`` is NaN on a model without a gate."""


@torch.inference_mode()
def value_share_token0(model: LoadedModel, tokens: Int[Tensor, "batch pos"]) -> Float[Tensor, "layer head"]:
    """:func:`value_weighted_share` of token 0 for every head, from one forward reading each layer's
    ``hook_v`` and ``hook_pattern`` (``f(x_j) = v_j W_O^(h)``, before any post-attention norm).

    Raises:
        HeadprobeError: ``hook_v`` is not ``[batch, pos, kv_head, d_head]`` with W_O's ``d_head``.
    """
    spec = model.spec
    out = torch.full((spec.n_layers, spec.n_heads), float("nan"))
    values: dict[int, Tensor] = {}

    def keep_v(layer: int):
        def hook(v: Tensor, hook: Any) -> None:
            values[layer] = v.detach()

        return hook

    def on_pattern(layer: int, pattern: Tensor) -> None:
        v, W_O = values.pop(layer), model.W_O(layer).detach()
        if v.ndim != 4 or v.shape[-1] != W_O.shape[1] or spec.n_heads % v.shape[2]:
            raise HeadprobeError(
                f"hook_v of layer {layer} is {tuple(v.shape)}, not [batch, pos, kv_head, d_head={W_O.shape[1]}]: "
                f"value-weighted attention cannot be read"
            )
        out[layer] = value_weighted_share(pattern, value_norms(v, W_O.to(v.device))).cpu()

    patterns_by_layer(
        model, tokens, on_pattern, extra_hooks=[(attn_hook(l, "v"), keep_v(l)) for l in range(spec.n_layers)]
    )
    return out


@torch.inference_mode()
def gate_closures(model: LoadedModel, tokens: Int[Tensor, "batch pos"]) -> Float[Tensor, "layer head"]:
    """:func:`gate_closure` of every head from each attention layer's ``hook_gate`` in one forward
    (a hybrid's linear-attention layers, which have no heads, NaN).

    Raises:
        HeadprobeError: no attention layer has ``hook_gate`` (:data:`NO_GATE`), only some do, or a
            gate whose head axis is not ``n_heads``.
    """
    spec = model.spec
    names = {l: attn_hook(l, "gate") for l in spec.attention_layers}
    hooks = set(model.hook_names())
    gated = [l for l, n in names.items() if n in hooks]
    if not gated:
        raise HeadprobeError(NO_GATE)
    if len(gated) < len(names):
        raise HeadprobeError(
            f"hook_gate exists in attention layers {gated} but not in "
            f"{[l for l in names if l not in gated]}: an output gate on some layers only is not read"
        )
    out = torch.full((spec.n_layers, spec.n_heads), float("nan"))

    def make(layer: int):
        def hook(gate: Tensor, hook: Any) -> None:
            if gate.ndim < 3 or gate.shape[2] != spec.n_heads:
                raise HeadprobeError(
                    f"hook_gate of layer {layer} is {tuple(gate.shape)}, not [batch, pos, head={spec.n_heads}, ...]"
                )
            out[layer] = gate_closure(gate).cpu()

        return hook

    model.final_residual(tokens, fwd_hooks=[(n, make(l)) for l, n in names.items()])
    return out


def _no_op(model: LoadedModel, inputs: MetricInputs) -> dict[str, np.ndarray]:
    """The columns of :data:`NO_OP`, each NaN with its reason (``inputs.notes``) where it does not apply."""
    from headprobe.analyses.scoring import use_online_stats

    spec = model.spec
    out: dict[str, np.ndarray] = {}

    def nan(column: str, why: str) -> None:
        out[column] = np.full((spec.n_layers, spec.n_heads), np.nan, dtype=np.float32)
        inputs.notes[column] = why

    hybrid = spec.layout.head_layers is not None  # only the gate is read per attention layer
    if all(model.sink_logits(l) is None for l in spec.attention_layers):
        nan("learned_sink_mass", NO_SINKS)
    elif hybrid:
        nan("learned_sink_mass", HYBRID_SKIP)
    else:
        out["learned_sink_mass"] = _natural_pattern_metrics(model, inputs)["learned_sink_mass"]
    try:
        out["gate_closure"] = gate_closures(model, inputs.natural.tokens).numpy()
    except HeadprobeError as e:
        nan("gate_closure", str(e))
    tokens = inputs.natural.tokens
    if hybrid:
        nan("value_share_token0", HYBRID_SKIP)
    elif use_online_stats(model, tokens.shape[1], inputs.streaming):
        nan(
            "value_share_token0",
            f"value-weighted attention needs the materialised pattern; the {tokens.shape[1]}-token "
            f"sequences are streamed (--streaming off materialises it)",
        )
    else:
        try:
            out["value_share_token0"] = value_share_token0(model, tokens).numpy()
        except HeadprobeError as e:
            nan("value_share_token0", str(e))
    return out


# The reported metrics, each registered by name in headprobe.analyses.columns.HEAD_COLUMNS
# (group "metric"; headprobe.analyses.columns.METRICS views them in column order).
COPYING = HeadColumn(
    "copying",
    ("copying",),
    _copying,
    figures=(
        HeatmapStyle(
            "copying",
            "copying score (OV eigenvalues)",
            "Σλ / Σ|λ|",
            (("cmap", "RdBu_r"), ("vmin", -1.0), ("vmax", 1.0)),
        ),
    ),
)
SINK_RATE = HeadColumn(
    "sink_rate",
    ("sink_rate",),
    _from_pattern_pass("sink_rate"),
    figures=(HeatmapStyle("sink_rate", "sink rate (first token)", "mean attention to token 0"),),
)
ENTROPY = HeadColumn(
    "entropy",
    ("entropy",),
    _from_pattern_pass("entropy"),
    figures=(HeatmapStyle("entropy", "attention entropy", "nats (mean over queries)", (("vmax", None),)),),
)
RETRIEVAL = HeadColumn(
    "retrieval",
    ("retrieval",),
    _retrieval,
    causal_only=True,
    figures=(HeatmapStyle("retrieval", "retrieval score (needle copy-paste)", "share of needle tokens"),),
)
DLA = HeadColumn(
    "dla",
    ("dla",),
    _dla,
    causal_only=True,
    figures=(
        HeatmapStyle(
            "dla", "direct logit attribution", "contribution to the next token's logit (logit units)", signed=True
        ),
    ),
)
LOCAL_FRACTION = HeadColumn(
    "local_fraction",
    local_columns(LOCAL_WINDOWS),
    _from_pattern_pass(*local_columns(LOCAL_WINDOWS)),
    figures=(
        HeatmapStyle(
            "distant_mass",
            "distant mass (beyond the last {W} keys)",
            "attention on keys {W} or more back (token 0 included)",
        ),
    ),
)
VALUE_SHARE_LABEL = (
    r"share on token 0: $A_{i0}\,\Vert v_0W_O\Vert\,/\,\Sigma_j\,A_{ij}\,\Vert v_jW_O\Vert$, mean over queries $i$"
)
r"""``heatmap_value_share_token0``'s colour-bar label, :func:`value_weighted_share` typeset (no space inside the
formula: a label too tall for its bar breaks at spaces; ``\Sigma_j``, as mathtext sets ``\sum``'s index below it)."""
NO_OP = HeadColumn(
    "no_op",
    ("learned_sink_mass", "gate_closure", "value_share_token0"),
    _no_op,
    figures=(
        HeatmapStyle("learned_sink_mass", "learned sink mass", "1 - row sum: weight on the learned sink"),
        HeatmapStyle("gate_closure", "output gate closure", "1 - mean gate value"),
        HeatmapStyle(
            "value_share_token0",
            "value-weighted attention to token 0",
            "share on token 0: A_i0 |v_0 W_O| / sum_j A_ij |v_j W_O|, mean over queries i",
            math_label=VALUE_SHARE_LABEL,
        ),
    ),
)
"""How a head says nothing (with ``sink_rate``, the first token's mass): the learned sink's mass,
the closure of an output gate and the share of the value-weighted attention on token 0."""

ENCODER_SKIP = "an encoder makes no next-token prediction"
"""Why a :attr:`~headprobe.analyses.columns.HeadColumn.causal_only` metric is NaN on an encoder."""


HYBRID_SKIP = "not implemented for hybrid models (linear-attention layers among the attention layers)"
"""Why every metric column is NaN on a hybrid model (``AttentionLayout.head_layers``)."""


@torch.inference_mode()
def scan_metrics(
    model: LoadedModel, natural: TokenSet, needles: NeedleSet | None, first: int, streaming: str = "auto"
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Every metric column of a scan (:data:`~headprobe.analyses.columns.METRICS`, in order),
    ``[layer, head]`` each: ``copying`` (weights), ``sink_rate``, ``entropy``, ``local_<W>`` and
    ``distant_mass`` (natural text, one forward for the four), ``retrieval`` (``needles``), ``dla``
    (mean over the natural-text predictions from index ``first`` on), ``learned_sink_mass``,
    ``gate_closure`` and ``value_share_token0`` (:data:`NO_OP`). ``streaming`` (``auto``,
    ``on``, ``off``; :func:`headprobe.analyses.scoring.use_online_stats`): the pattern metrics from
    streamed statistics (the same numbers) or from the pattern.

    A metric the model does not allow is NaN, with the reason in the second dict (column ->
    reason): ``copying`` for latent attention (no per-head W_V), ``dla`` for post-attention norms
    or a failed per-head self-check, ``retrieval`` without ``needles``; ``retrieval`` and ``dla``
    for encoders (``spec.causal`` False: no next-token prediction to copy or attribute);
    ``learned_sink_mass`` without learned sinks, ``gate_closure`` without ``hook_gate``,
    ``value_share_token0`` on streamed sequences; every metric but ``gate_closure`` on a hybrid model
    (:data:`HYBRID_SKIP`; the gate is read in its attention layers, the linear layers' rows NaN); a
    ``local_<W>`` whose window is not shorter than the sequence. ``distant_mass`` is the
    :func:`distant_fraction` at the largest window shorter than the sequence (:func:`distant_window`):
    ``1 - local`` there, less the learned sink's share where the model has sinks.
    """
    spec = model.spec
    inputs = MetricInputs(natural, needles, first, streaming)
    out: dict[str, np.ndarray] = {}
    skipped: dict[str, str] = {}
    for metric in METRICS.values():
        try:
            if not metric.applies_to(spec.causal):
                raise HeadprobeError(ENCODER_SKIP)
            if spec.layout.head_layers is not None and metric is not NO_OP:  # NO_OP reads the gate of a hybrid
                raise HeadprobeError(HYBRID_SKIP)
            out.update(metric.score(model, inputs))
        except HeadprobeError as e:
            for c in metric.columns:
                out[c], skipped[c] = np.full((spec.n_layers, spec.n_heads), np.nan, dtype=np.float32), str(e)
    skipped.update({c: why for c, why in inputs.notes.items() if c not in skipped})
    return {c: out[c] for c in metric_columns()}, skipped


DLA_STREAMS = 10
"""Float32 ``d_model``-wide tensors per scored position that :func:`direct_logit_attribution` holds
beside its forwards (the kept residual, the normed one and its grad-enabled copy, the gradient,
the least-squares scale's three terms, the unembedding direction and its gathered ``W_U`` rows)."""


def metric_plans(
    model: LoadedModel, n_seqs: int, seq_len: int, first: int, streaming: str = "auto", what: str = "scan's"
) -> list[memory.BatchPlan]:
    """The working memory of each step :func:`scan_metrics` runs over ``n_seqs`` natural-text
    windows of ``seq_len`` tokens (the whole batch, one forward each; ``first`` as there), in
    the order it runs them, those the model does not run left out (an encoder: no ``retrieval``,
    ``dla``; a hybrid: the output gate's forward alone; ``value_share_token0`` on materialised
    patterns only). Each is :func:`headprobe.probe.core.memory.plan` of a per-sequence
    :func:`~headprobe.probe.layout.cost.forward_sequence_bytes` (logits, no loss, of
    :attr:`~headprobe.probe.backends.base.LoadedModel.logit_entry_bytes` an entry where the step
    unembeds: every position of a pattern pass, the needles' queries of ``retrieval``, every or no
    position of ``final_residual`` by ``residual_with_logits``) plus the step's own:

    * the pattern metrics (``sink_rate``, ``entropy``, ``local_<W>``, ``distant_mass``,
      ``learned_sink_mass``): two float32 ``[head, T, T]`` temporaries of a layer's pattern (its
      float copy and one product, ``xlogy`` or a window mask's) where it is materialised; streamed
      (:func:`~headprobe.analyses.scoring.use_online_stats`), no logits, the layer's ``[head, T]``
      statistics and four float32 ``[head, block, block]`` temporaries of a block's scores;
    * ``retrieval`` on :func:`scan_needles`' windows (the same count and length): the logits at
      ``needle_len - 1`` queries a sequence;
    * ``dla``: :data:`DLA_STREAMS` float32 ``d_model`` vectors and the ``[layer, head]``
      contributions per scored position, and a layer's float32 ``z`` and ``W_O u`` directions;
    * ``value_share_token0``: the pattern's two temporaries, the layer's kept values and their
      float32 per-head copy ``[T, head, d_head]``;
    * ``gate_closure`` (a hybrid; elsewhere the pattern pass holds more): the forward alone;
    * ``copying`` (no forward; on a CPU only, its copies' memory): :func:`copying_bytes`, one item;
    * the composition scores, last (no forward): :func:`~headprobe.analyses.composition.composition_plan`,
      items being later heads per pass.

    ``what`` prefixes each step's name (``"scan's retrieval needles (3 x 16 tokens, one forward)"``).

    Returns:
        the plans: ``n_seqs`` sequences each (``copying``: one item, the copies; composition: later heads).

    Raises:
        HeadprobeError: a step does not fit in the memory budget (one line naming the step and
            ``--no-metrics``, before any allocation); a bad budget.
    """
    from headprobe.analyses.scoring import use_online_stats
    from headprobe.probe.hooks.online_stats import DEFAULT_BLOCK

    spec, e, T = model.spec, model.dtype.itemsize, seq_len
    H, D, dh = spec.n_heads, spec.d_model, spec.d_head
    resid_logits = T if model.residual_with_logits else 0  # final_residual's unembedding, where it runs one

    def forward(logit_positions: int) -> int:
        return spec.forward_sequence_bytes(T, e, logit_positions=logit_positions, logit_bytes=model.logit_entry_bytes)

    steps: list[tuple[str, int, str]] = []
    pattern_temps = 2 * 4 * H * T * T
    if spec.layout.head_layers is not None:  # a hybrid: every metric but the output gate is skipped
        if any(attn_hook(l, "gate") in set(model.hook_names()) for l in spec.attention_layers):
            steps.append(("output-gate closure", forward(resid_logits), "one forward"))
    else:
        if str(model.device) == "cpu" and not spec.layout.is_mla:  # its copies are host memory, not a GPU's
            steps.append(("copying score", copying_bytes(spec), "weights"))
        stream = use_online_stats(model, T, streaming)
        # streamed, no logits: a layer's [head, T] statistics, four float32 [head, block, block] temporaries
        block = min(T, DEFAULT_BLOCK)
        stats = 4 * H * T * (8 + len(LOCAL_WINDOWS)) + 4 * 4 * H * block * block
        steps.append(("pattern metrics", forward(0) + stats if stream else forward(T) + pattern_temps, "one forward"))
        start = int(model.prepend_bos)
        needle = min(NEEDLE_LEN, (T - start) // 4)
        if spec.causal and needle >= 2:
            steps.append(("retrieval needles", forward(resid_logits or needle - 1), "one forward"))
        if spec.causal and model.self_check.decomposition_ok and not model.has_post_attention_norm:
            n = max(1, T - 1 - first)
            own = 4 * n * (DLA_STREAMS * D + spec.n_layers * H) + 4 * T * 3 * H * dh
            steps.append(("direct logit attribution", forward(resid_logits) + own, "two forwards"))
        if not stream:
            kv = H if spec.layout.is_mla else (spec.n_kv_heads or H)
            own = pattern_temps + T * kv * dh * e + 2 * 4 * T * H * dh
            steps.append(("value-weighted attention", forward(T) + own, "one forward"))
    plans = [_step_plan(model, step, n_seqs, T, what) for step in steps]
    if _composes(model):
        plans.append(composition.composition_plan(spec, model.device, f"{what} composition scores (weights)"))
    return plans


def _step_plan(model: LoadedModel, step: tuple[str, int, str], n_seqs: int, T: int, what: str) -> memory.BatchPlan:
    """:func:`metric_plans`' plan of one step ``(name, bytes per sequence or in all, passes)``:
    ``n_seqs`` sequences of ``T`` tokens, or one item where ``passes`` is ``"weights"``.

    Raises:
        HeadprobeError: the step does not fit in the memory budget (naming it and ``--no-metrics``)."""
    name, per, passes = step
    if passes != "weights":
        label = f"{what} {name} ({n_seqs} x {T} tokens, {passes})"
        return memory.plan(per, model.device, n_seqs, label, 0, cap=n_seqs, skip="--no-metrics")
    label = f"{what} {name} (float32 copies of the embedding, unembedding and head weights)"
    total, source = memory.weights_fit(per, model.device, label, "--no-metrics")  # one item, the weights' size
    return memory.BatchPlan(1, per, 0, total, source, label)


def copying_bytes(spec: Any) -> int:
    """Bytes :func:`~headprobe.analyses.composition.copying_score` holds at once on the host, from
    ``spec`` (a :class:`~headprobe.probe.layout.spec.ModelSpec`): three float32 ``[d_vocab,
    d_model]`` copies (the embedding and the unembedding as read, folded and centred), every head's
    float32 ``W_Q``, ``W_K``, ``W_V``, ``W_O`` twice (per layer and stacked), the float64
    ``W_U W_E`` and two float64 vocabulary chunks of (at most) 4,096 rows."""
    D, V = spec.d_model, spec.d_vocab
    heads = 4 * spec.n_layers * spec.n_heads * D * spec.d_head
    return 4 * (3 * V * D + 2 * heads) + 8 * (D * D + 2 * min(4096, V) * D)


def distant_window(seq_len: int, windows: tuple[int, ...] = LOCAL_WINDOWS) -> int | None:
    """The window ``distant_mass`` is read at: the largest of ``windows`` shorter than ``seq_len``
    (None: none is)."""
    shorter = [w for w in windows if w < seq_len]
    return max(shorter) if shorter else None


def _pattern_metrics(
    model: LoadedModel, natural: TokenSet, stream: bool, windows: tuple[int, ...], skipped: dict[str, str]
) -> dict[str, np.ndarray]:
    """``sink_rate``, ``entropy``, ``local_<W>`` and ``distant_mass`` on ``natural`` in one forward."""
    spec = model.spec
    T = natural.tokens.shape[1]
    kept = [w for w in windows if w < T]
    far = distant_window(T, windows)
    cols = ("sink_rate", "entropy", "learned_sink_mass", *(f"local_{w}" for w in windows), "distant_mass")
    res = {c: torch.full((spec.n_layers, spec.n_heads), float("nan")) for c in cols}

    def on_pattern(layer: int, pattern: Tensor) -> None:
        res["sink_rate"][layer] = sink_rate(pattern).cpu()
        res["entropy"][layer] = attention_entropy(pattern, model.sink_logits(layer) is not None).cpu()
        res["learned_sink_mass"][layer] = learned_sink_mass(pattern).cpu()
        for w in kept:
            res[f"local_{w}"][layer] = local_fraction(pattern, w).cpu()
        if far is not None:
            res["distant_mass"][layer] = distant_fraction(pattern, far).cpu()

    def on_stats(layer: int, st: Any) -> None:  # st.local and st.sink are shares of the whole softmax
        sink = None if st.sink is None else st.sink.float()
        ent = st.entropy.float() if sink is None else st.entropy.float() - torch.special.xlogy(sink, sink)
        res["sink_rate"][layer] = st.key_column(0).float().mean(dim=(0, 2)).cpu()
        res["entropy"][layer] = ent[..., 1:].mean(dim=(0, 2)).cpu()
        res["learned_sink_mass"][layer] = 0.0 if sink is None else sink.mean(dim=(0, 2)).cpu()
        for w in kept:
            res[f"local_{w}"][layer] = st.local[w][..., w:].float().mean(dim=(0, 2)).cpu()
        if far is not None:
            rest = 1.0 - st.local[far].float() - (0.0 if sink is None else sink)
            res["distant_mass"][layer] = rest[..., far:].mean(dim=(0, 2)).cpu()

    if stream:
        from headprobe.probe.hooks.online_stats import online_head_stats

        online_head_stats(model, natural.tokens, on_stats, windows=tuple(kept), final_residual=False, argmax=False)
    else:
        patterns_by_layer(model, natural.tokens, on_pattern)
    for w in windows:
        if w not in kept:
            skipped[f"local_{w}"] = f"the window of {w} keys is not shorter than the sequences ({T} tokens)"
    if far is None:
        skipped["distant_mass"] = f"no window shorter than the sequences ({T} tokens)"
    return {c: v.numpy() for c, v in res.items()}


class _Fields(dict):
    """``str.format_map`` fields that leave a field not given as its name (``{W}`` -> ``W``)."""

    def __missing__(self, key: str) -> str:
        return key


def heatmap_makers(
    records: Sequence[HeadColumn],
    scores: dict[str, np.ndarray],
    group_size: int | None,
    tag: str,
    causal: bool = True,
    fields: Mapping[str, object] | None = None,
    removed: np.ndarray | None = None,
) -> dict[str, Any]:
    """``heatmap_<column>`` -> a function of no arguments that draws it, for every
    :class:`~headprobe.analyses.columns.HeatmapStyle` of ``records`` (head types and metrics alike);
    a metric's heatmap only where its column has a finite value. ``fields`` fill the styles'
    ``{name}`` fields in titles and labels (``W``: the window of ``distant_mass``, :func:`distant_window`).
    ``removed``: ``[layer, head]`` True for a pruned checkpoint's heads, drawn as removed, as the
    overview draws them (:func:`headprobe.analyses.figures.removed_cells`); None: none."""
    from functools import partial

    from headprobe.analyses import figures as figs

    out: dict[str, Any] = {}
    for record in records:
        for style in record.figures:
            values = scores.get(style.column)
            if values is None or (not record.is_head_type and not np.isfinite(values).any()):
                continue
            title = f"{style.title.format_map(_Fields(fields or {}))}, {tag}"
            label = style.math_label or style.label.format_map(_Fields(fields or {}))
            math = {"cbar_math": True} if style.math_label else {}  # typeset, not drawn as written
            out[f"heatmap_{style.column}"] = (
                partial(figs.signed_head_heatmap, values, title, label, group_size=group_size, removed=removed, **math)
                if style.signed
                else partial(
                    figs.head_heatmap,
                    values,
                    title,
                    label,
                    group_size=group_size,
                    removed=removed,
                    **style.figure_options(scores, causal),
                    **math,
                )
            )
    return out


def metric_figure_makers(
    scores: dict[str, np.ndarray],
    group_size: int | None,
    tag: str,
    fields: Mapping[str, object] | None = None,
    removed: np.ndarray | None = None,
) -> dict[str, Any]:
    """:func:`heatmap_makers` of every metric (:data:`~headprobe.analyses.columns.METRICS`)."""
    return heatmap_makers(list(METRICS.values()), scores, group_size, tag, fields=fields, removed=removed)


NEEDLE_LEN = 16
"""Needle length (tokens) of the retrieval score, unless a quarter of the sequence is shorter."""


def scan_needles(
    model: LoadedModel,
    n_seqs: int,
    seq_len: int,
    seed: int,
    text: str | TextFile | None = None,
    source: str | None = None,
) -> NeedleSet | None:
    """The retrieval score's token set for a scan: ``n_seqs`` windows of ``seq_len`` tokens with a
    needle of :data:`NEEDLE_LEN` tokens (or a quarter of the sequence if shorter) inserted twice;
    None where that leaves fewer than 2 needle tokens."""
    from headprobe.analyses.data import needle_tokens

    start = 1 if model.prepend_bos else 0
    m = min(NEEDLE_LEN, (seq_len - start) // 4)
    return None if m < 2 else needle_tokens(model, n_seqs, seq_len, m, seed, text, source)


@torch.inference_mode()
def scan_composition(model: LoadedModel) -> dict[str, np.ndarray] | None:
    """:func:`headprobe.analyses.composition.composition_scores` of ``model`` as numpy arrays
    ``[layer_j, head_j, layer_i, head_i]``, or None where the weights do not allow it (MLA, a
    hybrid), in passes of as many later heads as the memory budget holds.

    Raises:
        HeadprobeError: one later head's products do not fit in the budget (``composition_plan``).
    """
    if not _composes(model):
        return None
    plan = composition.composition_plan(model.spec, model.device, "scan's composition scores")  # raises: no room
    try:
        weights = composition.head_weights(model, vocab=False)
    except HeadprobeError:
        return None
    return {k: v.numpy() for k, v in composition.composition_scores(weights, model.device, plan.items).items()}


def _composes(model: LoadedModel) -> bool:
    """Whether ``model`` has per-head weights to compose: not latent attention, not a hybrid, not an
    encoder (its post-LN blocks renormalise the residual between heads, as ``circuit`` refuses it, and
    it has no induction heads for the previous-token -> induction composition scan reports)."""
    return model.spec.layout.head_layers is None and not model.spec.layout.is_mla and model.spec.causal


def composition_summary(k_scores: np.ndarray, earlier: list[tuple[int, int]], later: list[tuple[int, int]]) -> dict:
    """K-composition of the pairs ``earlier -> later`` (e.g. top previous-token -> top induction
    heads) beside two baselines: every pair of heads in different layers, and every earlier head
    into the same later heads. Pairs with the earlier head not in an earlier layer are left out;
    a pair without a score (NaN: a zero W_OV or W_QK) is null in ``pairs``, left out of the stats,
    and ``pairs_null_reason`` says why."""
    pairs = [
        (float(k_scores[lj, hj, li, hi]), f"{li}.{hi}->{lj}.{hj}") for lj, hj in later for li, hi in earlier if li < lj
    ]
    allv = k_scores[np.isfinite(k_scores)]
    into = (
        np.concatenate([k_scores[lj, hj][np.isfinite(k_scores[lj, hj])] for lj, hj in later]) if later else np.array([])
    )

    def stats(v: np.ndarray) -> dict:
        return (
            {
                "n": int(v.size),
                "mean": round(float(v.mean()), 4),
                "median": round(float(np.median(v)), 4),
                "p95": round(float(np.percentile(v, 95)), 4),
            }
            if v.size
            else {"n": 0}
        )

    vals = np.array([p[0] for p in pairs])
    vals = vals[np.isfinite(vals)]  # a head whose W_QK or W_OV is zero has no score (0/0), as in allv and into
    return {
        "pairs": {name: round(v, 4) for v, name in pairs},
        "pairs_stats": stats(vals),
        "all_pairs": stats(allv),
        "into_same_heads": stats(into),
        "pairs_percentile_in_all": (
            round(float((allv[None] < vals[:, None]).mean(1).mean() * 100), 1) if vals.size else None
        ),
        **(
            {
                "pairs_null_reason": "undefined where the earlier head's W_OV or the later head's W_QK is zero: the "
                "score divides by their norms (0/0); left out of the stats"
            }
            if len(vals) < len(pairs)
            else {}
        ),
    }
