"""Weight-based head metrics: the OV circuit's copying score and the Q-, K- and V-composition
between heads of different layers (Elhage et al. 2021, "A Mathematical Framework for Transformer
Circuits").

Conventions (row vectors, as TransformerLens): a head reads ``x @ W_Q[h]``, ``x @ W_K[h]``,
``x @ W_V[h]`` (``[d_model, d_head]``) and writes ``z @ W_O[h]`` (``[d_head, d_model]``); its OV
circuit is ``W_OV = W_V W_O`` and its QK circuit ``W_QK = W_Q W_K^T`` (both ``[d_model, d_model]``).
GQA: query head h uses the W_K and W_V of its key/value group, ``h // group_size``.

Norms, as TransformerLens' processed weights (``fold_ln``, ``center_writing_weights``,
``center_reading_weights``, ``center_unembed``, its defaults): the elementwise weight of each
layer's pre-attention norm is folded into that layer's W_Q, W_K and W_V, the final norm's into
W_U; for LayerNorm models (which subtract the mean of their input) the reading matrices are
centred over ``d_model`` (the norm reads only the component orthogonal to the all-ones direction)
and so are the writing matrices W_O and W_E. W_U is centred over the vocabulary (each token's
column minus the mean column): a direction every token's unembedding shares adds the same amount
to every logit, changes no prediction, and would otherwise dominate the copying score (a shared
direction 10 times the columns' size takes every head of the tiny test Llama to +-0.99). The norms' per-token scale ``1/sigma`` and their biases are left out: every score
here is invariant to the scale of each matrix, and biases are not part of a bilinear circuit.
Embedding norms (a norm right after the embedding, as in BLOOM) are not folded in; rotary
positions and QK-norm are left out of W_QK (as Elhage et al., who study models without them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from jaxtyping import Float
from torch import Tensor

from headprobe.probe.backends.base import LoadedModel
from headprobe.probe.core import memory
from headprobe.probe.core.errors import HeadprobeError


@dataclass(frozen=True)
class HeadWeights:
    """Every head's processed weights (see the module docstring), float32 on the CPU.

    Attributes:
        W_Q, W_K, W_V: ``[layer, head, d_model, d_head]`` (W_K, W_V: the head's key/value group's).
        W_O: ``[layer, head, d_head, d_model]``.
        W_E: ``[d_vocab, d_model]``; W_U: ``[d_model, d_vocab]``, centred over ``d_vocab`` (both
            None from ``head_weights(model, vocab=False)``).
    """

    W_Q: Float[Tensor, "layer head d_model d_head"]
    W_K: Float[Tensor, "layer head d_model d_head"]
    W_V: Float[Tensor, "layer head d_model d_head"]
    W_O: Float[Tensor, "layer head d_head d_model"]
    W_E: Float[Tensor, "d_vocab d_model"] | None
    W_U: Float[Tensor, "d_model d_vocab"] | None


def _fold(W: Tensor, norm) -> Tensor:
    """``diag(w) W`` over the ``d_model`` axis (-2), centred over it when the norm centres."""
    if norm is None:
        return W
    W = W * norm.weight.to(W)[:, None]
    return W - W.mean(dim=-2, keepdim=True) if norm.centers else W


@torch.inference_mode()
def head_weights(model: LoadedModel, vocab: bool = True) -> HeadWeights:
    """The processed weights of every head of ``model`` (a :class:`~headprobe.probe.backends.base.LoadedModel`,
    either backend): pre-attention norm folded into W_Q/W_K/W_V, the final norm into W_U, centred
    for LayerNorm models, W_U centred over the vocabulary (module docstring).

    Raises:
        HeadprobeError: latent attention (MLA), which has no per-head W_Q/W_K/W_V; a hybrid model
            (linear-attention layers have no heads to compose with).
    """
    spec = model.spec
    if spec.layout.head_layers is not None:
        raise HeadprobeError(
            "head weights and composition are not implemented for hybrid models "
            "(linear-attention layers among the attention layers)"
        )
    g = spec.n_heads // spec.n_kv_heads
    Q, K, V, O = [], [], [], []
    centers = False
    for layer in range(spec.n_layers):
        norm = model.norm_weights(layer)
        centers = centers or bool(norm is not None and norm.centers)
        Q.append(_fold(model.W_Q(layer).detach().float().cpu(), norm))
        K.append(_fold(model.W_K(layer).detach().float().cpu(), norm).repeat_interleave(g, dim=0))
        V.append(_fold(model.W_V(layer).detach().float().cpu(), norm).repeat_interleave(g, dim=0))
        O.append(model.W_O(layer).detach().float().cpu())
    final = model.norm_weights(None)
    centers = centers or bool(final is not None and final.centers)
    W_O = torch.stack(O)
    if centers:  # center_writing_weights: what a LayerNorm would remove anyway
        W_O = W_O - W_O.mean(dim=-1, keepdim=True)
    if not vocab:  # the composition scores read no embedding (their copies cost 2-3 x d_vocab x d_model floats)
        return HeadWeights(torch.stack(Q), torch.stack(K), torch.stack(V), W_O, None, None)
    W_E = model.W_E().detach().float().cpu()
    if centers:
        W_E = W_E - W_E.mean(dim=-1, keepdim=True)
    W_U = _fold(model.W_U().detach().float().cpu(), final)
    W_U = W_U - W_U.mean(dim=-1, keepdim=True)  # center_unembed: a direction every token shares moves no softmax
    return HeadWeights(torch.stack(Q), torch.stack(K), torch.stack(V), W_O, W_E, W_U)


def copying_scores(
    W_E: Float[Tensor, "d_vocab d_model"],
    W_V: Float[Tensor, "layer head d_model d_head"],
    W_O: Float[Tensor, "layer head d_head d_model"],
    W_U: Float[Tensor, "d_model d_vocab"],
) -> Float[Tensor, "layer head"]:
    """Copying score of each head's OV circuit: ``sum(lambda) / sum(|lambda|)`` over the eigenvalues
    of the ``[d_vocab, d_vocab]`` matrix ``W_E W_V W_O W_U`` (Elhage et al. 2021: positive
    eigenvalues mean that attending to a token raises that token's logit; 1 for a pure copying
    head, -1 for a pure anti-copying head, ``|lambda|`` the complex modulus).

    The matrices are used as given; Elhage et al.'s and TransformerLens' convention, which
    :func:`copying_score` follows, is W_U centred over the vocabulary (``center_unembed``; see
    :func:`head_weights`). An uncentred W_U whose columns share a direction gives every head a
    score near +-1 that says nothing about copying.

    Computed without the ``d_vocab`` matrix: the nonzero eigenvalues of ``ABCD`` equal those of
    the cyclic permutation ``BCDA``, so each head needs only the eigenvalues of the ``[d_head,
    d_head]`` matrix ``W_O (W_U W_E) W_V``; ``W_U W_E`` ``[d_model, d_model]`` is formed once.
    Float64. A head whose OV circuit is zero scores NaN.
    """
    # G = W_U W_E [d_model, d_model] in float64, over vocabulary chunks: no float64 copy of the
    # [d_vocab, d_model] matrices (2 x 226 MB for a 49,152-token vocabulary)
    G = torch.zeros(W_U.shape[0], W_E.shape[1], dtype=torch.float64, device=W_E.device)
    for c in range(0, W_E.shape[0], 4096):
        G += W_U[:, c : c + 4096].double() @ W_E[c : c + 4096].double()
    small = torch.einsum("lhed,df,lhfk->lhek", W_O.double(), G, W_V.double())  # W_O G W_V, [d_head, d_head]
    lam = torch.linalg.eigvals(small)
    return (lam.sum(-1).real / lam.abs().sum(-1)).float()


@torch.inference_mode()
def copying_score(model: LoadedModel) -> Float[Tensor, "layer head"]:
    """:func:`copying_scores` of ``model``'s processed weights (:func:`head_weights`: norms folded,
    W_U centred over the vocabulary, as TransformerLens' default processing; GQA heads use their
    key/value group's W_V). Invariant to a vector added to every token's unembedding (tested).

    Raises:
        HeadprobeError: as :func:`head_weights`.
    """
    w = head_weights(model)
    assert w.W_E is not None and w.W_U is not None  # vocab=True gives them
    return copying_scores(w.W_E, w.W_V, w.W_O, w.W_U)


def _factor(A: Tensor, B: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``A B^T = P M N^T`` with ``P``, ``N`` orthonormal columns (reduced QR of ``A`` and ``B``):
    ``(P, M, N)``, so that Frobenius norms of products reduce to ``d_head``-sized matrices."""
    P, Ra = torch.linalg.qr(A)
    N, Rb = torch.linalg.qr(B)
    return P, Ra @ Rb.transpose(-1, -2), N


def _layer_factors(weights: HeadWeights, device: torch.device | str | None) -> list[Tensor]:
    """The factors ``(P, M, N)`` of W_OV and W_QK of every head and their Frobenius norms, taken in
    float64 one layer at a time (so the float64 copies of a whole model's matrices never exist at
    once: 1.4 GB of peak for SmolLM2-135M before) and kept in float32 (the pair products need no
    more: scores ~0.1, ~10^5 pairs); norms ``[layer, head]`` in float64."""
    out: list[Tensor] | None = None
    L = weights.W_Q.shape[0]
    for layer in range(L):
        W_Q, W_K, W_V, W_O = (
            t[layer].to(device).double() for t in (weights.W_Q, weights.W_K, weights.W_V, weights.W_O)
        )
        # W_OV = W_V W_O = W_V (W_O^T)^T ; W_QK = W_Q W_K^T
        Pov, Mov, Nov = _factor(W_V, W_O.transpose(-1, -2))
        Pqk, Mqk, Nqk = _factor(W_Q, W_K)
        parts = (
            Pov.float(),
            Mov.float(),
            Nov.float(),
            Pqk.float(),
            Mqk.float(),
            Nqk.float(),
            torch.linalg.matrix_norm(Mov),
            torch.linalg.matrix_norm(Mqk),
        )
        if out is None:  # preallocated: no list of per-layer copies beside the stacked result
            out = [torch.empty(L, *t.shape, dtype=t.dtype, device=t.device) for t in parts]
        for o, t in zip(out, parts):
            o[layer] = t
    assert out is not None  # a model has at least one layer
    return out


def composition_plan(spec, device, what: str = "composition scores") -> memory.BatchPlan:
    """The working memory of :func:`composition_scores` on ``device`` for a model of ``spec`` (a
    :class:`~headprobe.probe.layout.spec.ModelSpec`), items being later heads scored per pass:
    fixed, the float32 factors (four ``[layer, head, d_model, d_head]`` stacks ``P``, the
    ``d_head``-sized middles), the three ``[layer, head, layer, head]`` results, and the larger of
    one layer's float64 factorisation and the einsum's copy of the earlier layers' factors (one
    ``P``); on a CPU also the float32 head weights (four ``P``; :func:`head_weights` peaks at
    seven while stacking them, before the factors exist).
    Per later head, six float32 ``[layer - 1, head, d_head, d_head]`` products (measured: 3-4.8
    on SmolLM2-135M).

    Raises:
        HeadprobeError: one later head does not fit in the memory budget (one line, naming ``what``
            and ``--no-metrics``).
    """
    L, H, D, dh = spec.n_layers, spec.n_heads, spec.d_model, spec.d_head
    P = 4 * L * H * D * dh
    factors = 4 * P + 2 * 4 * L * H * dh * dh + 2 * 8 * L * H
    layer = (
        6 * 8 * 4 * H * D * dh
    )  # a layer's float64 W_Q, W_K, W_V, W_O, their QR factors, workspace (measured 3.7-4.4)
    host = 4 * P if torch.device(device).type == "cpu" else 0
    fixed = host + factors + 3 * 4 * (L * H) ** 2 + max(layer, P)
    per = 6 * 4 * max(1, L - 1) * H * dh * dh
    detail = "the weights' factors and one later head's products"
    total, source = memory.weights_fit(fixed + per, device, what, "--no-metrics", detail)
    return memory.BatchPlan(min(H, (total - fixed) // per), per, fixed, total, source, what)


def composition_scores(
    weights: HeadWeights, device: torch.device | str | None = None, heads_per_pass: int | None = None
) -> dict[str, Float[Tensor, "layer_j head_j layer_i head_i"]]:
    """Q-, K- and V-composition of every later head j with every earlier head i (Elhage et al. 2021):

    * ``q``: ``||W_OV^i W_QK^j||_F / (||W_OV^i||_F ||W_QK^j||_F)`` (head i's output read by j's queries),
    * ``k``: ``||W_OV^i W_QK^j^T||_F / (...)`` (read by j's keys),
    * ``v``: ``||W_OV^i W_OV^j||_F / (...)`` (read by j's values),

    in the row-vector convention, as TransformerLens' ``composition_scores`` (its ``OV @ QK``,
    ``OV @ QK.T``, ``OV @ OV``). Each matrix is kept factored (``A B^T = P M N^T`` with
    orthonormal P, N), so a pair costs ``d_head``-sized products. Scale-invariant: multiplying
    any head's matrices by a constant leaves every score unchanged. Entries with
    ``layer_i >= layer_j`` are NaN.

    ``device``: where to compute (e.g. the model's GPU; a 30-layer, 270-head model needs about
    2.5e11 multiply-adds); the result is on the CPU. ``heads_per_pass``: later heads j scored at
    once (None: a layer's; :func:`composition_plan` sizes it to a memory budget); the scores do
    not depend on it.

    Returns:
        ``{"q", "k", "v"}`` -> ``[layer_j, head_j, layer_i, head_i]`` float32 arrays.
    """
    L, H = weights.W_Q.shape[:2]
    Pov, Mov, Nov, Pqk, Mqk, Nqk, norm_ov, norm_qk = _layer_factors(weights, device)
    out = {kind: torch.full((L, H, L, H), float("nan"), dtype=torch.float32, device=Pov.device) for kind in "qkv"}
    step = H if heads_per_pass is None else max(1, heads_per_pass)
    for j in range(1, L):
        for h in range(0, H, step):
            later = slice(h, h + step)
            for kind, (right_P, right_M, right_norm, transpose) in {
                "q": (Pqk[j, later], Mqk[j, later], norm_qk[j, later], False),
                "k": (Nqk[j, later], Mqk[j, later], norm_qk[j, later], True),
                "v": (Pov[j, later], Mov[j, later], norm_ov[j, later], False),
            }.items():
                # ||M_i (N_i^T P_j) M_j||: earlier heads [j_layers, H_i], later heads [H_j]
                cross = torch.einsum("ihdk,jde->jihke", Nov[:j], right_P)  # [H_j, layer_i, H_i, d_head, d_head]
                Mr = right_M.transpose(-1, -2) if transpose else right_M  # [H_j, d_head, d_head]
                prod = Mov[:j][None] @ cross @ Mr[:, None, None]
                score = torch.linalg.matrix_norm(prod) / (norm_ov[:j][None] * right_norm[:, None, None])
                out[kind][j, later, :j] = score.float()
    return {k: v.cpu() for k, v in out.items()}
