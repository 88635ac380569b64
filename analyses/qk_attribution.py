"""Why a head attends: its pre-softmax score split over the components on the query and key sides.

For head ``h`` of layer ``L`` and a (query, key) pair ``(i, j)`` of one prompt, the score is
``s_ij = scale * q_i . k_j`` (before any soft-cap and the softmax). The residual stream entering
layer ``L`` at a position is a sum of components (Elhage et al. 2021, "A Mathematical Framework
for Transformer Circuits"): the token embedding (and a learned position embedding), each earlier
head's result ``z_h W_O^(h)`` (``hook_result``), each earlier layer's ``b_O`` and each earlier MLP's
output. With the pre-attention norm's per-token scale frozen (its bias a component of its own),
QK-norm frozen likewise and rotary applied at ``i`` and ``j`` (:meth:`~headprobe.probe.backends.base.
LoadedModel.qk_terms`), the query and key are sums of per-component terms, so ``s_ij`` is the sum
of the (query-component x key-component) matrix ``C[a, b] = scale * q_i^(a) . k_j^(b)``: the
bilinear QK circuit ``x_i W_Q^h W_K^h^T x_j^T`` of the framework paper, on one prompt. The key
side's totals ``sum_a C[a, b]`` say what at key ``j`` drew the attention (for an induction head:
the previous-token head that wrote the token before ``j``). This answers the "attention QK"
question of circuit-tracer's issue 53 and Anthropic's 2025 notes on attention QK attributions.

Every result carries the identity ``|sum C - s_ij| / max(|s_ij|, 1)`` against the score the model computed
(``hook_attn_scores``; for a soft-capped head the score before the cap, ``scale * q_i . k_j`` from the
query and key the attention multiplies, :func:`pre_cap_score`), and the residual identity (components summing to
``resid_pre``) is checked before anything is split: either off by more than
:data:`IDENTITY_TOLERANCE` raises.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pandas as pd
import torch
from jaxtyping import Int
from torch import Tensor

from headprobe.probe.backends.base import LoadedModel
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.core.heads import indices
from headprobe.probe.core.reprs import CompactRepr
from headprobe.probe.hooks.capture import capture_internal
from headprobe.probe.hooks.names import EMBED, POS_EMBED, attn_hook, block_hook, norm_hook

IDENTITY_TOLERANCE = 1e-4
"""Largest relative error allowed of the residual identity and of ``sum C = s_ij`` (float32)."""


@dataclass(frozen=True, repr=False)
class QKAttribution(CompactRepr):
    """Outcome of :func:`qk_attribution`.

    Attributes:
        layer: the head's layer.
        head: the head.
        q_pos: the query position.
        k_pos: the key position.
        q_labels: component names, one per row of ``contributions``: ``embed``, ``pos_embed``,
            ``L.H`` (a head's result), ``b_O L``, ``mlp L``, ``ln1 bias`` (the pre-attention
            norm's bias), ``q bias`` (the projection's).
        k_labels: component names, one per column of ``contributions``, as ``q_labels`` (``k bias``
            for the key projection's).
        contributions: ``[n_q, n_k]`` float64, in score units (the pre-softmax logit ``scale * q . k``).
        score: the score the model computed (before any soft-cap: :func:`pre_cap_score`), float.
        identity_error: ``|contributions.sum() - score| / max(|score|, 1)`` (absolute below 1: a
            score near 0 is a difference of large float32 terms).
    """

    layer: int
    head: int
    q_pos: int
    k_pos: int
    q_labels: list[str]
    k_labels: list[str]
    contributions: np.ndarray
    score: float
    identity_error: float

    def key_side(self) -> pd.Series:
        """Each key-side component's total ``sum_a C[a, b]``, largest first."""
        return pd.Series(self.contributions.sum(0), index=self.k_labels).sort_values(ascending=False)

    def query_side(self) -> pd.Series:
        """Each query-side component's total ``sum_b C[a, b]``, largest first."""
        return pd.Series(self.contributions.sum(1), index=self.q_labels).sort_values(ascending=False)

    def totals(self) -> pd.DataFrame:
        """Each component's totals, ``component, key_side, query_side`` (score units), in
        :meth:`key_side`'s order (the key bias's row holds the query bias's query side): what
        ``headprobe circuit --qk-head`` and ``headprobe show --why`` write as a CSV. A bias term
        (``b_O L``, ``q bias``/``k bias``, ``ln1 bias``) that is exactly 0 on both sides, as every
        bias of a model without biases, is left out."""
        q, k = self.query_side(), self.key_side()
        table = pd.DataFrame(
            {
                "component": k.index,
                "key_side": k.to_numpy(),
                "query_side": q.reindex(k.index.str.replace("k bias", "q bias")).to_numpy(),
            }
        )
        bias = table["component"].str.startswith("b_O ") | table["component"].str.endswith(" bias")
        absent = bias & (table["key_side"] == 0) & (table["query_side"] == 0)
        return table[~absent].reset_index(drop=True)

    @property
    def table(self) -> pd.DataFrame:
        """One row per (query component, key component): ``q_component, k_component, contribution``,
        largest ``|contribution|`` first (a property, as every result's ``table``)."""
        q, k = np.meshgrid(np.arange(len(self.q_labels)), np.arange(len(self.k_labels)), indexing="ij")
        df = pd.DataFrame(
            {
                "q_component": np.asarray(self.q_labels)[q.ravel()],
                "k_component": np.asarray(self.k_labels)[k.ravel()],
                "contribution": self.contributions.ravel(),
            }
        )
        return df.reindex(df["contribution"].abs().sort_values(ascending=False).index).reset_index(drop=True)


def _rel(a: Tensor, b: Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def residual_components(
    model: LoadedModel, tokens: Int[Tensor, "1 pos"], layer: int
) -> tuple[list[str], Tensor, Tensor, Tensor, Tensor | None]:
    """The components of the residual stream entering ``layer``, the attention input and scores.

    Returns ``(labels, comps [n, pos, d_model], resid_pre [pos, d_model], attn_in [pos, d_model],
    scores [head, q_pos, k_pos] or None)`` (float32, ``hook_attn_scores`` of ``layer``), where ``comps.sum(0) == resid_pre`` to :data:`IDENTITY_TOLERANCE` (checked) and
    ``attn_in`` is what layer ``layer``'s attention reads (after the pre-attention norm).

    Raises:
        HeadprobeError: an encoder (post-LN blocks renormalise the stream), or the identity fails.
    """
    if not model.spec.causal:
        raise HeadprobeError(
            "QK attribution needs a pre-norm decoder: an encoder's post-LN blocks renormalise "
            "the residual stream, which is then not a sum of its components"
        )
    grabbed: dict[str, Tensor] = {}

    def grab(name: str):
        def hook(x: Tensor, hook: Any) -> None:
            grabbed[name] = x.detach()[0].float()

        return hook

    names = set(model.hook_names())
    extra = [
        n
        for n in (
            EMBED,
            POS_EMBED,
            block_hook(layer, "resid_pre"),
            norm_hook(layer, "ln1", "normalized"),
            attn_hook(layer, "attn_scores"),
        )
        if n in names
    ]
    with model.hooks([(n, grab(n)) for n in extra]):
        cap = capture_internal(model, tokens, layers=range(layer), residual=True) if layer else {}
        if not layer:
            model.forward(tokens)
    labels, comps = ["embed"], [grabbed[EMBED]]
    if POS_EMBED in grabbed:
        labels.append("pos_embed")
        comps.append(grabbed[POS_EMBED])
    for l in range(layer):
        H = cap["result"][l].shape[2]
        labels += [f"{l}.{h}" for h in range(H)] + [f"b_O {l}"]
        comps += [cap["result"][l][0, :, h].float() for h in range(H)]
        comps.append(
            cap["b_O"][l].float().expand_as(comps[-1]) if cap["b_O"][l].dim() == 1 else cap["b_O"][l][0].float()
        )
        if l in cap.get("mlp_out", {}):
            labels.append(f"mlp {l}")
            comps.append(cap["mlp_out"][l][0].float())
    comps_t = torch.stack(comps)
    resid = grabbed[block_hook(layer, "resid_pre")]
    err = _rel(comps_t.sum(0), resid)
    if err > IDENTITY_TOLERANCE:
        raise HeadprobeError(
            f"the residual stream entering layer {layer} is not the sum of its components "
            f"(off by {err:.2g} relative): this architecture is not split by QK attribution"
        )
    attn_in = grabbed.get(norm_hook(layer, "ln1", "normalized"), resid)
    return labels, comps_t, resid, attn_in, grabbed.get(attn_hook(layer, "attn_scores"))


def frozen_norm_terms(
    model: LoadedModel, layer: int, comps: Tensor, resid: Tensor, attn_in: Tensor
) -> tuple[Tensor, Tensor | None]:
    """``comps`` ``[n, pos, d_model]`` through layer ``layer``'s pre-attention norm with its per-token
    scale frozen: ``w * s_t * (c - mean(c))`` (LayerNorm) or ``w * s_t * c`` (RMS-type), ``s_t``
    fitted by least squares to the norm's output ``attn_in`` (exact for either form, as
    :func:`headprobe.probe.hooks.capture.post_norm_factor`). Returns the terms and the norm's bias
    ``[d_model]`` (None where zero or no norm)."""
    nw = model.norm_weights(layer)
    if nw is None:
        return comps, None
    w, b = nw.weight.float(), nw.bias.float()
    x = resid - resid.mean(-1, keepdim=True) if nw.centers else resid
    wx = w * x
    s = ((attn_in - b) * wx).sum(-1, keepdim=True) / (wx * wx).sum(-1, keepdim=True).clamp_min(1e-30)  # [pos, 1]
    c = comps - comps.mean(-1, keepdim=True) if nw.centers else comps
    return w * s * c, (b if bool(b.abs().max() > 0) else None)


@torch.inference_mode()
def pre_cap_score(
    model: LoadedModel, tokens: Int[Tensor, "1 pos"], layer: int, head: int, q_pos: int, k_pos: int
) -> float:
    """``scale * q_i . k_j`` of head ``layer.head`` before its soft-cap, from the query and key the
    attention multiplies (``hook_rot_q``/``hook_rot_k``, after QK-norm and rotary; ``hook_q``/``hook_k``
    where the model has no rotary hooks), in float64. Undoing the cap, ``cap * atanh(s / cap)``, is
    not used: float32's ``tanh`` saturates from a few times the cap on (and ``atanh(1)`` is infinite).

    Raises:
        HeadprobeError: a QK-norm with no hook after it (the query the attention multiplies is not visible).
    """
    names = set(model.hook_names())
    kind = "rot_" if attn_hook(layer, "rot_q") in names else ""
    if not kind and model.spec.layout.qk_norm != "none":
        raise HeadprobeError(
            f"layer {layer}'s soft-capped score cannot be read before its cap: its QK-norm has no hook after it"
        )
    grabbed: dict[str, Tensor] = {}

    def grab(side: str):
        def hook(x: Tensor, hook: Any) -> None:
            grabbed[side] = x.detach()[0].double()  # [pos, head or kv_head, d_qk]

        return hook

    with model.hooks([(attn_hook(layer, kind + side), grab(side)) for side in ("q", "k")]):
        model.forward(tokens)
    q, k = grabbed["q"][q_pos, head], grabbed["k"][k_pos, model.spec.kv_head(head)]
    return float(model.attention_scale(layer)[0] * (q @ k))


@torch.inference_mode()
def qk_attribution(
    model: LoadedModel, tokens: Int[Tensor, "1 pos"], layer: int, head: int, q_pos: int, k_pos: int
) -> QKAttribution:
    """Split head ``layer.head``'s pre-softmax score for query ``q_pos`` and key ``k_pos`` of one
    prompt into (query-component x key-component) contributions (defined in
    :mod:`headprobe.analyses.qk_attribution`; Elhage et al. 2021's QK circuit with the norms' scales
    frozen).

    Args:
        model: a :class:`~headprobe.probe.backends.base.LoadedModel` (native backend).
        tokens: one prompt ``[1, pos]``.
        layer: the query head's layer (``-1``: the last).
        head: the query head (GQA: its key is its key/value head's, ``head // group_size``; ``-1``: the last).
        q_pos: the query position.
        k_pos: the key position, ``k_pos <= q_pos`` for a decoder.

    Returns:
        The score's terms, one per pair of query and key component: ``contributions.sum()`` equals
            the model's score to :data:`IDENTITY_TOLERANCE` relative (checked).

    Raises:
        HeadprobeError: a layer or head out of range (``LoadedModel.layer_index``'s line), bad positions, a masked key, the bridge, an encoder, or an identity that fails.
    """
    spec = model.spec
    T = tokens.shape[-1]
    if tokens.dim() != 2 or tokens.shape[0] != 1:
        raise HeadprobeError(f"qk_attribution takes one prompt [1, pos], got shape {tuple(tokens.shape)}")
    layer = model.layer_index(layer)  # negative ones count from the end, as every per-layer method's
    head = indices([head], spec.n_heads, "head")[0]
    if not (0 <= k_pos <= q_pos < T):
        raise HeadprobeError(
            f"query {q_pos} and key {k_pos} must satisfy 0 <= key <= query < {T} (the prompt's length)"
        )
    model.self_check.require_decomposition("QK attribution")
    labels, comps, resid, attn_in, scores = residual_components(model, tokens, layer)
    terms, bias = frozen_norm_terms(model, layer, comps, resid, attn_in)
    side_labels = labels + (["ln1 bias"] if bias is not None else [])

    def side(kind: Literal["q", "k"], pos: int) -> Tensor:
        rows = terms[:, pos] if bias is None else torch.cat([terms[:, pos], bias[None]])
        return model.qk_terms(layer, head, kind, rows, attn_in[pos], pos).double()

    q, k = side("q", q_pos), side("k", k_pos)
    scale, cap = model.attention_scale(layer)
    contributions = (scale * q @ k.T).cpu().numpy()
    if scores is None or not math.isfinite(float(scores[head, q_pos, k_pos])):
        raise HeadprobeError(
            f"the model gave no finite score for head {layer}.{head} at ({q_pos}, {k_pos}) "
            f"(a key outside its sliding window?)"
        )
    score = (
        float(scores[head, q_pos, k_pos]) if cap is None else pre_cap_score(model, tokens, layer, head, q_pos, k_pos)
    )
    err = abs(float(contributions.sum()) - score) / max(abs(score), 1.0)  # a score near 0: absolute error
    if err > IDENTITY_TOLERANCE:
        raise HeadprobeError(
            f"QK attribution of {layer}.{head} does not sum to its score ({contributions.sum():.6g} "
            f"against {score:.6g}, {err:.2g} relative)"
        )
    return QKAttribution(
        layer, head, q_pos, k_pos, side_labels + ["q bias"], side_labels + ["k bias"], contributions, score, err
    )
