"""Gradient estimates of every head's single-head ablation effect, without a sweep: attribution
patching (AtP) and AtP* with GradDrop (Kramár, Lieberum, Shah & Nanda 2024, "AtP*: An efficient
and scalable method for localizing LLM behaviour to components", arXiv 2403.00745).

What is estimated is :attr:`headprobe.analyses.ablation.SweepResult.effect`: the change of the
mean scored loss (nats/token) when head ``h`` of layer ``m`` has its ``z`` (``hook_z``, before
W_O) replaced by ``r`` (0 for zero ablation, the head's mean z for mean ablation).

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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from headprobe.analyses.ablation import _check_kind, capture_z, require_head_ablation
from headprobe.probe.backend import Backend, scored_loss
from headprobe.probe.hooks import attn_hook

ESTIMATORS: tuple[str, ...] = ("atp", "attribution", "gradient")
"""``headprobe ablate --estimate`` choices: ``atp`` (AtP* with GradDrop, unsigned), ``attribution``
(plain attribution patching, signed), ``gradient`` (Michel et al.'s importance, unsigned)."""


def forward_equivalents(method: str, n_layers: int) -> float:
    """Cost of an estimator in forward passes over the same tokens (a backward counted as two
    forwards): ``attribution`` and ``gradient`` 3, ``atp`` ``n_layers + 2`` (see the module docstring).

    Raises:
        ValueError: unknown ``method``.
    """
    if method in ("attribution", "gradient"):
        return 3.0
    if method == "atp":
        return 3.0 + 2.0 * sum(l / n_layers for l in range(1, n_layers))
    raise ValueError(f"unknown estimator {method!r}; expected one of {', '.join(ESTIMATORS)}")


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


def atp_star(model: Backend, tokens: Int[Tensor, "batch pos"], first: int = 0, kind: str = "zero",
             mean_z: Float[Tensor, "layer head d_head"] | None = None,
             source_tokens: Int[Tensor, "batch pos"] | None = None, graddrop: bool = True) -> AtPStar:
    """AtP and AtP* (GradDrop) for every head at once, from one forward pass, one backward pass
    and ``L - 1`` partial backward passes (see the module docstring for the definitions and why
    the QK fix does not apply to z ablation).

    Hooks (both backends, the :class:`~headprobe.probe.backend.Backend` protocol): ``hook_z`` of
    every layer returns ``z + delta`` and ``hook_resid_pre`` of every layer (and ``hook_resid_post``
    of the last) ``x + eps``, with ``delta`` and ``eps`` zero tensors that require grad, so the
    values of the forward are unchanged and the gradients at z and at every layer boundary come
    from one backward of ``sum_x L(x)``.

    Args:
        model: a LoadedModel. tokens: ``[batch, pos]``.
        first: first scored prediction (:func:`headprobe.analyses.ablation.first_scored`).
        kind: ``zero``, ``mean`` (needs ``mean_z``) or ``resample`` (needs ``source_tokens``).
        graddrop: False skips the partial backward passes (``graddrop`` and ``estimate`` are then
            built from AtP alone, as if no layer could cancel: 3 forward-equivalents).

    Raises:
        HeadprobeError: unknown ``kind`` or its reference input missing, or the model failed its
            self-check (:func:`headprobe.analyses.ablation.require_head_ablation`).
    """
    _check_kind(kind, mean_z, source_tokens)
    require_head_ablation(model)
    spec = model.spec
    L, H = spec.n_layers, spec.n_heads
    tokens = tokens.to(model.device)
    source_z = capture_z(model, source_tokens.to(model.device)) if kind == "resample" else None
    deltas: dict[int, Tensor] = {}
    zs: dict[int, Tensor] = {}
    resid: dict[int, Tensor] = {}  # resid[l]: the residual entering layer l (l = L: the last resid_post)
    eps: dict[int, Tensor] = {}

    def z_hook(layer: int):
        def hook(z: Tensor, hook: Any) -> Tensor:
            zs[layer] = z.detach()
            deltas[layer] = torch.zeros_like(z, requires_grad=True)
            return z + deltas[layer]
        return hook

    def resid_hook(index: int):
        def hook(x: Tensor, hook: Any) -> Tensor:
            eps[index] = torch.zeros_like(x, requires_grad=True)
            resid[index] = x + eps[index]
            return resid[index]
        return hook

    hooks = [(attn_hook(layer, "z"), z_hook(layer)) for layer in range(L)]
    hooks += [(f"blocks.{layer}.hook_resid_pre", resid_hook(layer)) for layer in range(L)]
    hooks += [(f"blocks.{L - 1}.hook_resid_post", resid_hook(L))]
    B = tokens.shape[0]
    with torch.inference_mode(False), torch.enable_grad():
        per_seq = scored_loss(model.forward(tokens, fwd_hooks=hooks), tokens, first)  # [batch]
        total = per_seq.sum() / B  # the batch-mean loss: its gradients give batch-mean estimates
        grads = torch.autograd.grad(total, [deltas[l] for l in range(L)] + [eps[i] for i in range(L + 1)],
                                    retain_graph=graddrop)
        g_z, g_resid = grads[:L], grads[L:]
        diff = []
        for layer in range(L):
            z = zs[layer].float()
            if kind == "zero":
                r = torch.zeros_like(z)
            elif kind == "mean":
                r = mean_z[layer].to(z)[None, None].expand_as(z)
            else:
                r = source_z[layer].to(z)
            diff.append(r - z)  # [batch, pos, head, d_head]
        attribution = torch.stack([(diff[m] * g_z[m].float()).sum(dim=(0, 1, 3)) for m in range(L)])  # [layer, head]
        gd = attribution[None].repeat(L, 1, 1)  # gd[l, m] = attribution[m] for l < m
        for l in range(L):
            gd[l, l] = 0.0
            if l == 0 or not graddrop:
                continue
            # layer l dropped: only the skip connection carries g_{l+1} down to layer l's resid_pre
            below = torch.autograd.grad(resid[l], [deltas[m] for m in range(l)], grad_outputs=g_resid[l + 1],
                                        retain_graph=l < L - 1, allow_unused=True)
            for m, g in enumerate(below):
                gd[l, m] = 0.0 if g is None else (diff[m] * g.float()).sum(dim=(0, 1, 3))
    gd = gd.detach().cpu()
    attribution = attribution.detach().cpu()
    estimate = gd.abs().sum(dim=0) / (L - 1) if L > 1 else attribution.abs()
    return AtPStar(attribution, gd, estimate, float(per_seq.detach().mean()), kind)
