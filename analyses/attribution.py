"""Gradient estimates of every head's single-head ablation effect, without a sweep: attribution
patching (AtP), AtP* with GradDrop (Kramár, Lieberum, Shah & Nanda 2024, "AtP*: An efficient
and scalable method for localizing LLM behaviour to components", arXiv 2403.00745), and AtP plus
a Monte-Carlo Gauss-Newton curvature term (the second-order estimate, :func:`second_order`).

What is estimated is :attr:`headprobe.analyses.ablation.SweepResult.effect`: the change of the
mean scored loss (nats/token) when head ``h`` of layer ``m`` has its ``z`` (``hook_z``, before
W_O) replaced by ``r``, its ablation kind's replacement (:mod:`headprobe.probe.core.ablation_kinds`: 0 for
zero ablation, the head's mean z for mean ablation, its z on another input for resample).

**AtP** (Nanda 2023; Kramár et al. eq. 4): ``c_AtP(m, h) = mean_x sum_pos (r - z_h) . dL(x)/dz_h``,
the first-order Taylor term, from one forward and one backward pass.

**The QK fix does not apply here.** Kramár et al.'s first fix (section 3.1.1) is for patching a
head's *queries or keys*: the patch moves that head's attention logits, and linearising the
softmax at a saturated pattern gives a near-zero estimate of a large effect; they compute the
patched logits exactly, take the exact softmax, and linearise only from the attention pattern on.
Ablating ``z_h`` does not touch head h's queries, keys or pattern: the head's output
``z_h W_O^(h)`` is linear in ``z_h`` and the intervention enters the graph after the softmax, so
there is no softmax of the patched head between the intervention and the residual stream to
correct. The downstream heads whose queries and keys the ablation moves are *indirect* effects;
the paper's AtP* linearises those through the gradient (it applies the QK fix only to the
patched node's own attention), and so does this module. With no q/k node in the estimate, AtP*
reduces to AtP with GradDrop.

**GradDrop** (section 3.1.2) is against cancellation: a head's direct effect and its effect
through later layers can cancel in the sum that the gradient computes, giving a false negative.
For each layer l, ``c_l(m, h)`` is AtP with the gradient through layer l's residual
contribution set to zero (the residual stream skips it in the backward pass; the forward is
unchanged). A head in layer m reaches the loss only through layers m..L-1, so ``c_l = c_AtP`` for
``l < m`` and ``c_m = 0`` (everything the head writes is layer m's contribution). The estimate is
``c_AtP*(m, h) = 1/(L-1) sum_l |c_l(m, h)|``, the paper's definition: an **unsigned** magnitude
(it ranks heads by how much ablating them matters, not in which direction). Each ``c_l`` is
taken on the batch-mean loss (the quantity the sweep measures), before the absolute value.

**Cost.** Counting a backward pass as two forwards: AtP is 1 forward + 1 backward = 3
forward-equivalents. GradDrop reuses that pass: the gradient arriving at layer l's output,
``g_{l+1}`` (at ``resid_pre`` of layer l+1, or ``resid_post`` of the last layer), is what the
skip connection alone carries to ``resid_pre`` of layer l when layer l is dropped, so ``c_l`` of
the heads below layer l is one vector-Jacobian product from layer l's ``resid_pre`` with
``g_{l+1}`` back through layers 0..l-1 (``l / L`` of a backward, ignoring the unembedding). In
all ``3 + 2 * sum_{l=1}^{L-1} l / L = L + 2`` forward-equivalents (:func:`forward_equivalents`):
32 for a 30-layer model, against ``1 + sum_m n_heads * (L - m) / L`` for the exact sweep.

**Second order** (:func:`second_order`). Ablating a whole head is not a small perturbation: on
SmolLM2-135M the exact effect exceeds the first-order term for every one of the benchmark's 60
heads, by a median 0.0064 nats, more than the median effect itself (0.0053); the curvature, not
cancellation, is what limits AtP and AtP* there (Spearman 0.81 and 0.80 against the signed
effect). The estimate adds the second-order Taylor term with the Hessian replaced by the
Gauss-Newton matrix ``G`` of the cross-entropy (positive semi-definite; Optimal Brain Damage's
term, LeCun, Denker & Solla 1990, with the generalised Gauss-Newton curvature of Schraudolph 2002):
``c_2(m, h) = c_AtP(m, h) + 1/2 d^T G d`` with ``d = r - z_h``. For one sequence with loss
``l = 1/T sum_t CE_t``, ``G = 1/T sum_t J_t^T (diag(p_t) - p_t p_t^T) J_t`` (``J_t``: the Jacobian of
position t's logits with respect to z, ``p_t`` the model's next-token distribution), and
``d^T G d`` is estimated without any Jacobian: with targets ``y_t`` *sampled from the model's own
p_t* (the Monte-Carlo Fisher of K-FAC, Martens & Grosse 2015, arXiv 1503.05671; the empirical
Fisher, with the true targets, is biased: Kunstner, Balles & Hennig 2019, arXiv 1905.12558),
``s = d . dl_y/dz`` has ``E[s^2] = 1/T^2 sum_t Var_{p_t}(J_t d) = d^T G d / T``, so
``1/2 d^T G d ~ T/2 * mean over probes of s^2``, for every head at once from one backward pass
per probe (the forward is shared). Its cost: ``3 + 2 n_probes`` forward-equivalents.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from headprobe.analyses.ablation import (
    ablation_directions,
    importance_sequence_bytes,
    kind_inputs,
    require_head_ablation,
)
from headprobe.analyses.vocabulary import ESTIMATORS  # the --estimate choices, defined once (torch-free)
from headprobe.probe.backends.base import LoadedModel, scored_loss
from headprobe.probe.core import memory
from headprobe.probe.hooks.names import attn_hook, block_hook

N_PROBES = 8
"""Default sampled-target probes of :func:`second_order`. On SmolLM2-135M's 60 benchmark heads
(8 x 100 tokens of CPython's docs) the Spearman correlation with the signed exact effect over
independent probe draws was: 1 probe mean 0.86 (min 0.81 of 16 draws), 2: 0.90 (0.87 of 8), 4: 0.92
(0.905 of 4), 8: 0.93 (0.916 of 2), 16: 0.934; attribution patching alone 0.81."""


def forward_equivalents(method: str, n_layers: int, n_probes: int = N_PROBES) -> float:
    """Cost of an estimator in forward passes over the same tokens (a backward counted as two
    forwards): ``attribution`` and ``gradient`` 3, ``atp`` ``n_layers + 2``, ``second-order``
    ``3 + 2 n_probes`` (see the module docstring).

    Raises:
        ValueError: unknown ``method``.
    """
    if method in ("attribution", "gradient"):
        return 3.0
    if method == "atp":
        return 3.0 + 2.0 * sum(l / n_layers for l in range(1, n_layers))
    if method == "second-order":
        return 3.0 + 2.0 * n_probes
    raise ValueError(f"unknown estimator {method!r}; expected one of {', '.join(ESTIMATORS)}")


def estimate_plan(
    model: LoadedModel,
    method: str,
    batch: int,
    seq_len: int,
    n_probes: int = N_PROBES,
    kind: str = "zero",
    work: str | None = None,
    split: bool = False,
) -> memory.BatchPlan:
    """The working memory of one ``--estimate`` of ``batch`` sequences of ``seq_len`` tokens, all
    in one pass, planned by :func:`headprobe.probe.core.memory.plan`; ``work`` names it in the header
    and the refusal (default ``ablate's <method> estimate``). ``split``: the estimator takes its batch
    in chunks (:func:`~headprobe.analyses.ablation.head_importance`'s ``max_batch``, the gradient
    methods), so one sequence must fit and :attr:`~headprobe.probe.core.memory.BatchPlan.items` is the
    chunk; otherwise the whole batch must (AtP* and second-order take it in one pass).

    Per sequence (``T`` tokens, ``L`` layers, ``D = d_model``, ``V`` the vocabulary, ``e`` the
    model's element bytes): :func:`~headprobe.analyses.ablation.importance_sequence_bytes` (the
    gradient methods' whole need, as :func:`~headprobe.analyses.ablation.importance_plan`: a forward
    and a backward, whose six float32 ``[T, V]`` tensors at the loss cover second-order's logits,
    distribution, cotangent and its gradient, and the ablation directions); ``atp``: ``2 (L + 1) T D e``, the zero
    probe at every layer boundary and its gradient, held through the ``L - 1`` partial backwards;
    ``second-order``: ``16 T n_probes``, its uniforms and draws. Kept beside the batch
    (``second-order``): the inverse-CDF draws' two float64 ``[rows, V]`` tensors,
    ``rows = min(batch T, DRAW_ROWS)`` (:func:`categorical_draws`).

    Raises:
        HeadprobeError: the batch (``split``: one sequence) does not fit in the memory budget (one
            line, before any allocation).
        ValueError: unknown ``method``.
    """
    if method not in ESTIMATORS:
        raise ValueError(f"unknown estimator {method!r}; expected one of {', '.join(ESTIMATORS)}")
    spec, e = model.spec, model.dtype.itemsize
    L, T = spec.n_layers, seq_len
    per = importance_sequence_bytes(model, T, kind)
    kept, passes = 0, "forward and backward"
    if method == "atp":
        per += 2 * (L + 1) * T * spec.d_model * e
        passes = f"forward, backward and {L - 1} partial backward{'s' if L != 2 else ''}"
    elif method == "second-order":
        per += 16 * T * n_probes
        kept = 2 * min(batch * T, DRAW_ROWS) * spec.d_vocab * 8
        passes = f"forward and {1 + n_probes} backwards"
    name = work if work is not None else f"ablate's {method} estimate"
    what = f"{name} ({batch} x {seq_len} tokens, {passes})"
    return memory.plan(per, model.device, 1 if split else batch, what, kept, cap=batch)


def _z_probes(n_layers: int) -> tuple[list, dict[int, Tensor], dict[int, Tensor]]:
    """``hook_z`` hooks for every layer that record ``z`` and return ``z + delta`` with ``delta`` a
    zero tensor that requires grad: the forward is unchanged and ``dL/d delta = dL/dz``.
    Returns ``(hooks, zs, deltas)``; the dicts fill during the forward."""
    zs: dict[int, Tensor] = {}
    deltas: dict[int, Tensor] = {}

    def z_hook(layer: int):
        def hook(z: Tensor, hook: Any) -> Tensor:
            zs[layer] = z.detach()
            deltas[layer] = torch.zeros_like(z, requires_grad=True)
            return z + deltas[layer]

        return hook

    return [(attn_hook(layer, "z"), z_hook(layer)) for layer in range(n_layers)], zs, deltas


def _per_sequence(diff: list[Tensor], grads: Sequence[Tensor]) -> Float[Tensor, "batch layer head"]:
    """``sum_{pos, d_head} diff * grad`` for every sequence and head."""
    return torch.stack([(d * g.float()).sum(dim=(1, 3)) for d, g in zip(diff, grads)], dim=1)


@dataclass
class AtPStar:
    """AtP and AtP* estimates of every head's single-head ablation effect (nats/token).

    Attributes:
        attribution: ``[layer, head]`` plain AtP, signed (equals
            :attr:`headprobe.analyses.ablation.HeadImportance.attribution`).
        graddrop: ``[layer, layer, head]``: ``graddrop[l, m, h]`` is AtP of head ``m.h`` with the
            gradient through layer l's residual contribution dropped (signed).
        estimate: ``[layer, head]`` AtP* = ``sum_l |graddrop[l]| / (L - 1)`` (unsigned; ``|attribution|``
            when the model has one layer).
        clean_loss: mean scored loss of the clean pass. kind: the ablation estimated.
    """

    attribution: Float[Tensor, "layer head"]
    graddrop: Float[Tensor, "layer layer head"]
    estimate: Float[Tensor, "layer head"]
    clean_loss: float
    kind: str

    @property
    def signed(self) -> Float[Tensor, "layer head"]:
        """``sign(attribution) * estimate``: AtP*'s magnitude with AtP's sign (not in the paper)."""
        return torch.sign(self.attribution) * self.estimate


def atp_star(
    model: LoadedModel,
    tokens: Int[Tensor, "batch pos"],
    first: int = 0,
    kind: str = "zero",
    mean_z: Float[Tensor, "layer head d_head"] | None = None,
    source_tokens: Int[Tensor, "batch pos"] | None = None,
    graddrop: bool = True,
) -> AtPStar:
    """AtP and AtP* (GradDrop) for every head at once, from one forward pass, one backward pass
    and ``L - 1`` partial backward passes (see the module docstring for the definitions and why
    the QK fix does not apply to z ablation).

    Hooks (both backends, the :class:`~headprobe.probe.backends.base.LoadedModel` protocol): ``hook_z`` of
    every layer returns ``z + delta`` and ``hook_resid_pre`` of every layer (and ``hook_resid_post``
    of the last) ``x + eps``, with ``delta`` and ``eps`` zero tensors that require grad, so the
    values of the forward are unchanged and the gradients at z and at every layer boundary come
    from one backward of ``sum_x L(x)``.

    Args:
        model: a LoadedModel. tokens: ``[batch, pos]``.
        first: first scored prediction (:func:`headprobe.analyses.ablation.first_scored`).
        kind: a kind of :data:`headprobe.probe.core.ablation_kinds.KINDS`: ``zero``, ``mean`` (needs
            ``mean_z``) or ``resample`` (needs ``source_tokens``).
        graddrop: False skips the partial backward passes (``graddrop`` and ``estimate`` are then
            built from AtP alone, as if no layer could cancel: 3 forward-equivalents).

    Raises:
        HeadprobeError: unknown ``kind`` or its reference input missing, or the model failed its
            self-check (:func:`headprobe.analyses.ablation.require_head_ablation`).
    """
    require_head_ablation(model)
    ablation, second = kind_inputs(model, kind, mean_z, source_tokens)
    spec = model.spec
    L = spec.n_layers
    tokens = tokens.to(model.device)
    z_hooks, zs, deltas = _z_probes(L)
    resid: dict[int, Tensor] = {}  # resid[l]: the residual entering layer l (l = L: the last resid_post)
    eps: dict[int, Tensor] = {}

    def resid_hook(index: int):
        def hook(x: Tensor, hook: Any) -> Tensor:
            eps[index] = torch.zeros_like(x, requires_grad=True)
            resid[index] = x + eps[index]
            return resid[index]

        return hook

    hooks = z_hooks + [(block_hook(layer, "resid_pre"), resid_hook(layer)) for layer in range(L)]
    hooks += [(block_hook(L - 1, "resid_post"), resid_hook(L))]
    B = tokens.shape[0]
    with torch.inference_mode(False), torch.enable_grad():
        per_seq = scored_loss(model.forward(tokens, fwd_hooks=hooks), tokens, first)  # [batch]
        total = per_seq.sum() / B  # the batch-mean loss: its gradients give batch-mean estimates
        grads = torch.autograd.grad(
            total, [deltas[l] for l in range(L)] + [eps[i] for i in range(L + 1)], retain_graph=graddrop
        )
        g_z, g_resid = grads[:L], grads[L:]
        diff = ablation_directions(zs, ablation, second)  # [batch, pos, head, d_head] per layer
        attribution = torch.stack([(diff[m] * g_z[m].float()).sum(dim=(0, 1, 3)) for m in range(L)])  # [layer, head]
        gd = attribution[None].repeat(L, 1, 1)  # gd[l, m] = attribution[m] for l < m
        for l in range(L):
            gd[l, l] = 0.0
            if l == 0 or not graddrop:
                continue
            # layer l dropped: only the skip connection carries g_{l+1} down to layer l's resid_pre
            below = torch.autograd.grad(
                resid[l],
                [deltas[m] for m in range(l)],
                grad_outputs=g_resid[l + 1],
                retain_graph=l < L - 1,
                allow_unused=True,
            )
            for m, g in enumerate(below):
                gd[l, m] = 0.0 if g is None else (diff[m] * g.float()).sum(dim=(0, 1, 3))
    gd = gd.detach().cpu()
    attribution = attribution.detach().cpu()
    estimate = gd.abs().sum(dim=0) / (L - 1) if L > 1 else attribution.abs()
    return AtPStar(attribution, gd, estimate, float(per_seq.detach().mean()), kind)


@dataclass
class SecondOrder:
    """Attribution patching plus the Monte-Carlo Gauss-Newton term (nats/token), every head.

    Attributes:
        attribution: ``[layer, head]`` attribution patching, the first-order term (signed; equals
            :attr:`AtPStar.attribution` on the same tokens).
        curvature: ``[layer, head]`` the estimate of ``1/2 d^T G d`` (>= 0; see the module docstring).
        curvature_se: ``[layer, head]`` its standard error over the ``n_probes x batch`` samples.
        n_probes: sampled-target probes. clean_loss: mean scored loss of the clean pass. kind: the
            ablation estimated.
    """

    attribution: Float[Tensor, "layer head"]
    curvature: Float[Tensor, "layer head"]
    curvature_se: Float[Tensor, "layer head"]
    n_probes: int
    clean_loss: float
    kind: str

    @property
    def estimate(self) -> Float[Tensor, "layer head"]:
        """``attribution + curvature``: the second-order estimate of the effect (signed)."""
        return self.attribution + self.curvature


DRAW_ROWS = 256
"""Rows of :func:`categorical_draws` per float64 CDF (256 x 128,256 vocabulary entries: 256 MiB)."""


def categorical_draws(probs: Float[Tensor, "row vocab"], n: int, seed: int) -> Int[Tensor, "row n"]:
    """``n`` draws with replacement from each row's categorical distribution ``probs`` (rows need
    not sum to 1: each is scaled by its sum), by inverse CDF from uniforms of a CPU generator seeded
    ``seed``: the same draws on every device (``torch.multinomial`` on a CUDA generator draws others).
    Returns indices on ``probs``' device. Float64 CDFs, :data:`DRAW_ROWS` rows at a time."""
    u = torch.rand(probs.shape[0], n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    parts = []
    for start in range(0, probs.shape[0], DRAW_ROWS):
        cdf = probs[start : start + DRAW_ROWS].double().cumsum(dim=-1)
        parts.append(torch.searchsorted(cdf, u[start : start + DRAW_ROWS].to(cdf.device) * cdf[:, -1:], right=True))
    return torch.cat(parts).clamp_(max=probs.shape[-1] - 1)


def second_order(
    model: LoadedModel,
    tokens: Int[Tensor, "batch pos"],
    first: int = 0,
    kind: str = "zero",
    mean_z: Float[Tensor, "layer head d_head"] | None = None,
    source_tokens: Int[Tensor, "batch pos"] | None = None,
    n_probes: int = N_PROBES,
    seed: int = 0,
) -> SecondOrder:
    """Second-order estimate of every head's single-head ablation effect on the batch-mean scored
    loss: attribution patching plus ``1/2 d^T G d`` with the Gauss-Newton matrix ``G`` estimated
    from ``n_probes`` sets of targets sampled from the model's own predictions (definitions and
    sources in the module docstring).

    One forward pass with ``hook_z`` probes on every layer; one backward from the logits with the
    true targets' cotangent ``(p - e_y) / T`` (attribution patching), then one per probe with a
    sampled target ``y_t ~ p_t`` at every scored position, all through the same graph. The
    ``[batch, pos, d_vocab]`` distribution is kept in float32 (``4 * batch * pos * d_vocab`` bytes).

    Args:
        model: a LoadedModel (either backend). tokens: ``[batch, pos]``.
        first: first scored prediction (:func:`headprobe.analyses.ablation.first_scored`).
        kind: a kind of :data:`headprobe.probe.core.ablation_kinds.KINDS`: ``zero``, ``mean`` (needs
            ``mean_z``) or ``resample`` (needs ``source_tokens``).
        n_probes: sampled-target backward passes (>= 1; :data:`N_PROBES` by default; the
            curvature's standard error falls as ``1 / sqrt(n_probes * batch)``).
        seed: seed of the sampled targets (the estimate is deterministic given it).

    Raises:
        HeadprobeError: unknown ``kind`` or its reference input missing, or the model failed its
            self-check (:func:`headprobe.analyses.ablation.require_head_ablation`).
        ValueError: ``n_probes < 1``.
    """
    if n_probes < 1:
        raise ValueError(f"n_probes must be >= 1, got {n_probes}")
    require_head_ablation(model)
    ablation, second = kind_inputs(model, kind, mean_z, source_tokens)
    L = model.spec.n_layers
    tokens = tokens.to(model.device)
    hooks, zs, deltas = _z_probes(L)
    with torch.inference_mode(False), torch.enable_grad():
        logits = model.forward(tokens, fwd_hooks=hooks)[:, first:-1]  # the scored predictions
        targets = tokens[:, first + 1 :].to(logits.device)
        B, T, V = logits.shape
        probs = torch.softmax(logits.detach().float(), dim=-1)
        clean_loss = float(-torch.log(probs.gather(-1, targets[..., None]).clamp_min(1e-45)).mean())
        inputs = [deltas[layer] for layer in range(L)]
        diff = ablation_directions(zs, ablation, second)

        def per_sequence(y: Int[Tensor, "batch pos"], last: bool) -> Float[Tensor, "batch layer head"]:
            # d(1/T sum_t CE(logits_t, y_t)) / d logits_t = (p_t - e_{y_t}) / T: the gradient of each
            # sequence's mean loss (sequences do not mix, so one backward of the sum gives all of them)
            cot = probs.clone().scatter_add_(-1, y[..., None], torch.full_like(probs[..., :1], -1.0)).div_(T)
            grads = torch.autograd.grad(logits, inputs, grad_outputs=cot.to(logits.dtype), retain_graph=not last)
            return _per_sequence(diff, grads)

        attribution = per_sequence(targets, last=False).mean(dim=0)
        sampled = categorical_draws(probs.reshape(-1, V), n_probes, seed).reshape(B, T, n_probes)
        samples = torch.stack([per_sequence(sampled[..., k], last=k == n_probes - 1) for k in range(n_probes)])
    curv = 0.5 * T * samples.square()  # [probe, batch, layer, head]: unbiased draws of 1/2 d^T G_b d
    n = n_probes * B
    se = curv.reshape(n, L, -1).std(dim=0) / math.sqrt(n) if n > 1 else torch.full_like(curv[0, 0], float("nan"))
    return SecondOrder(
        attribution.detach().cpu(), curv.mean(dim=(0, 1)).detach().cpu(), se.detach().cpu(), n_probes, clean_loss, kind
    )
