"""Path patching and edge attribution: how much head s matters to head r through r's q, k or v.

**Edges.** A sender is a head ``s = (l_s, h_s)``; a receiver is a head ``r = (l_r, h_r)`` with
``l_s < l_r`` and one of its inputs, its query ``q``, key ``k`` or value ``v``, or the logits (the
final residual stream, read through the final norm and the unembedding). The sender's *output* is
its result ``z_s W_O^(s)`` (``hook_result``; after the post-attention norm with its scale frozen
where the block has one, :func:`headprobe.probe.hooks.capture.capture_internal`), and its change between
a corrupted and the clean run is ``delta_s = result_s(corrupted) - result_s(clean)``
``[batch, pos, d_model]``.

**Direct-path patching** (after Wang et al. 2022, "Interpretability in the Wild", arXiv 2211.00593,
sec. 3.1, who also recompute the MLPs between sender and receiver, which this does not;
Goldowsky-Dill et al. 2023, "Localizing Model Behavior with Path Patching", arXiv 2304.05969): the
clean run, with only receiver ``r``'s chosen input recomputed from the residual stream
``resid_pre(l_r) + delta_s`` at every position: the sender's corrupted output reaches ``r`` along the
direct path only (every other head, MLP and the sender's own paths into anything else stay clean),
and everything after ``r`` is recomputed, so the change reaches the metric through ``r``. The
effect is ``M(patched) - M(clean)`` (the metric's units; the default metric is the next-token loss
in nats/token, so a positive effect means the edge carries what the clean run needs). ``r``'s input
norm is **recomputed** on the patched residual (not frozen): the receiver then sees exactly what
its own norm makes of a residual whose only change is the sender's, and the edge attribution's
gradient, taken through the same norm, is the first-order expansion of this very quantity. Only
``r``'s own query, key or value changes (GQA: a key/value head is shared by ``group_size`` query
heads, so the key/value is copied per query head for the patched forward and only ``h_r``'s copy
changes; Qwen3/OLMo-2-style QK-norm is applied after that as in the forward). The logits receiver
adds ``delta_s`` to the final residual stream before the final norm.

**Edge attribution patching** (EAP; Syed et al. 2023, "Attribution Patching Outperforms Automated
Circuit Discovery", arXiv 2310.10348) approximates every edge's effect at once by
``delta_s . dM/d(input_r)``, the gradient of the metric at the clean run with respect to the
residual stream as ``r``'s input reads it (summed over batch and positions). **EAP-IG** (Hanna,
Pezzelle, Belinkov 2024, "Have Faith in Faithfulness", arXiv 2403.17806) averages that gradient
over ``m`` inputs whose token embeddings interpolate from the corrupted to the clean prompt,
``e(alpha) = e_corrupted + alpha (e_clean - e_corrupted)``, ``alpha = k/m`` for ``k = 1..m``
(integrated gradients, Sundararajan et al. 2017; the right Riemann sum, :func:`ig_alphas`). Both cost one corrupted forward plus one
forward and backward per step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float, Int
from scipy.stats import pearsonr, spearmanr
from torch import Tensor

from headprobe.analyses.vocabulary import CIRCUIT_NEEDS_DECODER, CIRCUIT_NEEDS_NATIVE
from headprobe.probe.backends.base import LoadedModel, token_losses
from headprobe.probe.core import memory
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.core.heads import check_head, check_receiver, format_head, is_head_pair, read_heads
from headprobe.probe.core.registry import did_you_mean
from headprobe.probe.core.reprs import CompactRepr
from headprobe.probe.core.sizes import format_bytes
from headprobe.probe.hooks.ablation import HookFn
from headprobe.probe.hooks.capture import capture_internal
from headprobe.probe.hooks.names import EMBED, attn_hook, block_hook
from headprobe.probe.layout.cost import mlp_width

INPUTS = ("q", "k", "v")
"""A receiver head's inputs; the logits receiver is ``"logits"``."""
Metric = Callable[[Tensor, Tensor], Tensor]
"""``metric(logits [batch, pos, d_vocab], tokens [batch, pos]) -> [batch]``, differentiable."""


def next_token_loss(first: int, attention_mask: Int[Tensor, "batch pos"] | None = None) -> Metric:
    """The default metric: per-sequence mean next-token cross-entropy (nats/token) of the
    predictions from index ``first`` on (index ``i`` predicts token ``i + 1``).

    With ``attention_mask`` ``[batch, pos]`` (1 real, 0 padding, either side) ``first`` counts real
    tokens: a prediction counts when it is made from the ``first``-th real token or a later one and
    its target is real, so each row's value is the one of its text run alone. The metric then takes
    ``k * batch`` rows too (path patching stacks ``k`` copies of the batch), the mask repeated."""

    def metric(logits: Tensor, tokens: Tensor) -> Tensor:
        losses = token_losses(logits, tokens)
        if attention_mask is None:
            return losses[:, first:].mean(dim=1)
        real = attention_mask.to(losses.device, torch.bool)
        real = real.repeat(losses.shape[0] // real.shape[0], 1)
        index = real.long().cumsum(-1) - 1  # each real token's index among the real tokens
        scored = (real[:, :-1] & real[:, 1:] & (index[:, :-1] >= first)).to(losses.dtype)
        return (losses * scored).sum(dim=1) / scored.sum(dim=1)

    return metric


@dataclass(frozen=True)
class Edge:
    """One edge: sender head ``(layer, head)`` -> receiver head's ``input`` (``q``, ``k``, ``v``)
    or the logits (``receiver`` None, ``input`` ``"logits"``)."""

    sender: tuple[int, int]
    receiver: tuple[int, int] | None
    input: str

    @property
    def name(self) -> str:
        """``"5.1 -> 18.6:k"`` or ``"5.1 -> logits"``."""
        s = f"{self.sender[0]}.{self.sender[1]}"
        return (
            f"{s} -> logits" if self.receiver is None else f"{s} -> {self.receiver[0]}.{self.receiver[1]}:{self.input}"
        )


def parse_edge(text: str) -> Edge:
    """``"5.1 -> 18.6:k"`` / ``"5.1->logits"`` as an :class:`Edge`.

    Raises:
        HeadprobeError: not of that form.
    """
    try:
        s, r = (p.strip() for p in text.split("->"))
        sl, sh = (int(x) for x in s.split("."))  # ValueError unless two numbers
        if r == "logits":
            return Edge((sl, sh), None, "logits")
        head, inp = r.split(":")
        rl, rh = (int(x) for x in head.split("."))
        if inp not in INPUTS:
            raise ValueError
    except ValueError:
        raise HeadprobeError(f"edge {text!r} is not 'L.H -> L.H:q|k|v' or 'L.H -> logits'") from None
    return Edge((sl, sh), (rl, rh), inp)


@dataclass
class PathRuns:
    """The clean and corrupted runs path patching and edge attribution start from.

    Attributes:
        clean, corrupted: token ids ``[batch, pos]`` (same shape).
        metric: the per-sequence metric.
        deltas: ``[layer, batch, pos, head, d_model]`` float32, ``result(corrupted) - result(clean)``
            (0 at padding positions).
        resid_pre: ``[layer, batch, pos, d_model]`` of the clean run.
        resid_final: ``[batch, pos, d_model]``, the clean final residual stream before the final norm.
        clean_metric: ``[batch]`` of the clean run.
    """

    clean: Tensor
    corrupted: Tensor
    metric: Metric
    deltas: Tensor
    resid_pre: Tensor
    resid_final: Tensor
    clean_metric: Tensor
    embed_clean: Tensor
    embed_corrupted: Tensor
    mask: Tensor | None = None
    """``[batch, pos]`` (1 real, 0 padding) shared by the clean and corrupted prompts; None: no padding."""

    def mask_for(self, copies: int = 1) -> Tensor | None:
        """The mask of ``copies`` stacked copies of the batch (None without padding)."""
        return None if self.mask is None else self.mask.repeat(copies, 1)


def _check_model(model: LoadedModel) -> None:
    spec = model.spec
    if not spec.causal:
        raise HeadprobeError(CIRCUIT_NEEDS_DECODER.format(model=spec.name))
    model.require("path_patching", CIRCUIT_NEEDS_NATIVE.format(backend=model.backend))
    if spec.layout.is_mla:
        raise HeadprobeError(
            "path patching into q/k/v is not defined for latent attention (MLA): its keys and values share one latent"
        )
    model.self_check.require_decomposition("path patching")


def check_first(first: int, pos: int) -> None:
    """Refuse a ``first`` with no prediction of :func:`next_token_loss` from it on (the mean of none is NaN):
    prompts of ``pos`` tokens make predictions at positions ``0 .. pos - 2``.

    Raises:
        HeadprobeError: ``first`` not an integer in ``0 .. pos - 2`` (one line naming the range)."""
    ok = isinstance(first, int) and not isinstance(first, bool) and 0 <= first <= pos - 2
    if not ok:
        raise HeadprobeError(
            f"first={first!r} is out of range for prompts of {pos} tokens: the default metric scores the "
            f"next-token predictions from position first on, so first must be an integer 0..{pos - 2}"
        )


@torch.inference_mode()
def prepare_runs(
    model: LoadedModel,
    clean: Int[Tensor, "batch pos"],
    corrupted: Int[Tensor, "batch_c pos_c"],
    metric: Metric | None = None,
    first: int = 0,
    attention_mask: Int[Tensor, "batch pos"] | None = None,
) -> PathRuns:
    """Run ``clean`` and ``corrupted`` once each and keep what every edge needs (:class:`PathRuns`).
    ``metric`` None: :func:`next_token_loss` from ``first`` (with the mask). ``attention_mask``
    ``[batch, pos]`` (1 real, 0 padding, from ``model.to_tokens(list_of_texts)``): a padded batch,
    the same padding for both prompts of a row (a clean and a corrupted prompt of one length); a
    ``metric`` of the caller's must leave padding positions out itself.

    Raises:
        HeadprobeError: shapes differ, not the native backend, an encoder, MLA, a failed self-check,
            ``first`` outside ``0 .. pos - 2`` (:func:`check_first`), or a clean metric that is not finite.
    """
    _check_model(model)
    if clean.shape != corrupted.shape or clean.dim() != 2:
        raise HeadprobeError(
            f"clean {tuple(clean.shape)} and corrupted {tuple(corrupted.shape)} prompts must be "
            f"[batch, pos] of the same shape"
        )
    if attention_mask is not None and tuple(attention_mask.shape) != tuple(clean.shape):
        raise HeadprobeError(
            f"attention_mask {tuple(attention_mask.shape)} must have the prompts' shape {tuple(clean.shape)}"
        )
    if metric is None:
        check_first(first, clean.shape[1])
    mask = None if attention_mask is None or bool(attention_mask.bool().all()) else attention_mask.to(model.device)
    if mask is not None and metric is None and int(mask.sum(1).min()) < first + 2:
        raise HeadprobeError(
            f"a padded prompt of {int(mask.sum(1).min())} real tokens has no prediction from its "
            f"real token {first} on to score (the metric would be NaN)"
        )
    metric = next_token_loss(first, mask) if metric is None else metric
    L = model.spec.n_layers
    embeds: list[Tensor] = []
    with model.hooks([(EMBED, lambda x, hook: embeds.append(x.detach().clone()))]):
        # the fused kernel (no pattern hook), as the clean run and the resumed runs use: bitwise the same residuals
        cap = capture_internal(model, clean, residual=True, attention_mask=mask, patterns=False)
        deltas = torch.stack([-cap["result"].pop(l).float() for l in range(L)])  # one layer's capture freed at a time
        resid_pre = torch.stack([cap["resid_pre"].pop(l).float() for l in range(L)])
        resid_final = cap["resid_post"][L - 1].float()
        del cap
        cap = capture_internal(model, corrupted, attention_mask=mask, patterns=False)
        for l in range(L):
            deltas[l] += cap["result"].pop(l).float()
        del cap
    if mask is not None:  # a padding position's change reaches no real one; left out of every score
        deltas *= mask.to(deltas.device, deltas.dtype)[None, :, :, None, None]
    clean_metric = metric(model.forward(clean, attention_mask=mask).float(), clean.to(model.device)).float()
    if not bool(torch.isfinite(clean_metric).all()):
        raise HeadprobeError(
            f"the metric of the clean run is not finite ({clean_metric.tolist()[:4]}): no effect can be measured from it"
        )
    return PathRuns(clean, corrupted, metric, deltas, resid_pre, resid_final, clean_metric, embeds[0], embeds[1], mask)


GIB = 2**30
DEFAULT_BUDGET = 1.0 * GIB
"""The most working memory (bytes) the circuit engines take beyond the model's weights on a CPU
when no budget is stated (on a GPU: the shared rule, a share of its free memory)."""


MAX_STACK = 32
"""The most stacked sequences per path-patched forward, whatever the budget allows (more gain no speed)."""


def row_bytes(model: LoadedModel, pos: int) -> tuple[int, int]:
    """Estimated bytes of working memory per sequence of ``pos`` tokens: ``(scoring, patching)``.

    ``scoring``: one sequence's share of :func:`prepare_runs` and one EAP(-IG) step: its deltas
    ``[layer, pos, head, d_model]`` twice while they are built, the clean residuals, the autograd
    graph of a forward (per layer about ``8 d_model + d_mlp + 2 head pos + 6 head d_head`` floats
    per token, :attr:`~headprobe.probe.layout.spec.ModelSpec.d_mlp`, ``4 d_model`` where not known), the logits three times (logits, log-probabilities,
    their gradient) and one layer's pull-back ``[3, head, pos, d_model]`` four times. ``patching``:
    one stacked copy of a path-patched forward (logits three times, a layer's activations).
    float32 throughout (the engines keep float32 copies whatever the weights' dtype)."""
    sp = model.spec
    L, H, D, V, dh = sp.n_layers, sp.n_heads, sp.d_model, sp.d_vocab, sp.d_head
    mlp = mlp_width(D, sp.d_mlp)
    scoring = 2 * L * H * D + 2 * L * D + L * (8 * D + mlp + 2 * H * pos + 6 * H * dh) + 3 * V + 12 * H * D
    patching = 3 * V + 16 * D + 2 * H * pos + 2 * D
    return 4 * pos * scoring, 4 * pos * patching


def plan_rows(model: LoadedModel, batch: int, pos: int, budget: float | None = None) -> tuple[int, int]:
    """How many sequences to score at a time and how many stacked copies to path patch per forward,
    so that the working memory (:func:`row_bytes`) stays within ``budget`` bytes (None: the stated
    budget, :func:`headprobe.probe.core.memory.stated`, else :data:`~headprobe.probe.core.memory.HEADROOM`
    of the device's free memory, on a CPU at most :data:`DEFAULT_BUDGET`).

    Raises:
        HeadprobeError: ``budget`` exceeds the device's free memory, or one sequence does not fit in it.
    """
    available = memory.free_bytes(model.device)
    given = memory.stated()
    where = f"a budget of {format_bytes(budget)}" if budget is not None else "budget"
    # on a CPU at most DEFAULT_BUDGET; a GPU's batches take what is free, as other commands'
    cap = float("inf") if model.device.type == "cuda" else DEFAULT_BUDGET
    default = min(cap, available * memory.HEADROOM)
    said = f"{format_bytes(default)}: {memory.HEADROOM:.0%} of the free memory" + (
        f", at most {format_bytes(DEFAULT_BUDGET)} on a CPU" if cap == DEFAULT_BUDGET else ""
    )
    if budget is not None:  # above the free memory: refused, the rule of every command's planner (memory.budget)
        memory.within_free(budget, f"--memory-gb's budget of {format_bytes(budget)}", model.device, "--memory-gb", said)
    elif given is not None:
        budget, where = given[0], given[1]
        memory.within_free(budget, f"the {where}", model.device, default=said)
    else:
        budget = default
        where = f"budget of {format_bytes(budget)}"
    scoring, patching = row_bytes(model, pos)
    if scoring > budget or patching > budget:
        raise HeadprobeError(
            f"one sequence of {pos} tokens needs about {format_bytes(max(scoring, patching))} of "
            f"working memory, more than the {where} (free {format_bytes(available)} on "
            f"{model.device}): use shorter sequences or a larger --memory-gb"
        )
    return max(1, min(batch, int(budget // scoring))), max(1, min(MAX_STACK, int(budget // patching)))


class RunChunks:
    """The clean and corrupted runs of a batch taken ``rows`` sequences at a time, so that memory does
    not grow with the batch: each pass over :meth:`parts` prepares one chunk's :class:`PathRuns`
    (:func:`prepare_runs`) at a time (kept, not recomputed, when one chunk holds the whole batch).
    Every engine that takes a :class:`PathRuns` also takes this and returns the batch mean, each
    chunk weighted by its share of the sequences (the metric is a per-sequence mean).

    Attributes:
        stack_rows: the most stacked sequences per path-patched forward.
    """

    def __init__(
        self,
        model: LoadedModel,
        clean: Tensor,
        corrupted: Tensor,
        rows: int,
        stack_rows: int = 32,
        metric: Metric | None = None,
        first: int = 0,
        attention_mask: Tensor | None = None,
    ):
        self.loaded, self.clean, self.corrupted, self.rows, self.stack_rows = (
            model,
            clean,
            corrupted,
            max(1, rows),
            stack_rows,
        )
        self.metric, self.first, self.mask = metric, first, attention_mask
        self._whole: PathRuns | None = None

    def parts(self):
        """Yields ``(weight, PathRuns)`` per chunk, ``weight`` its share of the batch."""
        B = self.clean.shape[0]
        if self.rows >= B:
            if self._whole is None:
                self._whole = prepare_runs(self.loaded, self.clean, self.corrupted, self.metric, self.first, self.mask)
            yield 1.0, self._whole
            return
        for i in range(0, B, self.rows):
            j = min(i + self.rows, B)
            mask = None if self.mask is None else self.mask[i:j]
            yield (
                (j - i) / B,
                prepare_runs(self.loaded, self.clean[i:j], self.corrupted[i:j], self.metric, self.first, mask),
            )

    def clean_metric(self) -> float:
        """The clean run's metric, the batch mean (one pass when chunked)."""
        return sum(w * float(r.clean_metric.mean()) for w, r in self.parts())


def _parts(runs: PathRuns | RunChunks):
    return runs.parts() if isinstance(runs, RunChunks) else [(1.0, runs)]


def _bar(runs: PathRuns | RunChunks, per_part: int, desc: str, unit: str, progress: bool) -> Any:
    """A progress bar (:func:`~headprobe.probe.core.progress.progress_bar`, silent without ``progress``)
    over ``per_part`` units of each of ``runs``' chunks."""
    from headprobe.probe.core.progress import progress_bar

    n_parts = -(-runs.clean.shape[0] // runs.rows) if isinstance(runs, RunChunks) else 1
    return progress_bar(total=n_parts * per_part, desc=desc, unit=unit, progress=progress)


def _stack_rows(runs: PathRuns | RunChunks, max_rows: int | None) -> int:
    return max_rows if max_rows is not None else (runs.stack_rows if isinstance(runs, RunChunks) else 32)


def _group(model: LoadedModel) -> int:
    return model.spec.n_heads // model.spec.n_kv_heads


def _input_weight(model: LoadedModel, layer: int, head: int, inp: str) -> Tensor:
    """``W`` ``[d_model, d]`` of head ``head``'s ``inp`` (its key/value head's for k, v)."""
    if inp == "q":
        return model.W_Q(layer)[head]
    W = model.W_K(layer) if inp == "k" else model.W_V(layer)
    return W[head // _group(model)]


def _expand_hook(model: LoadedModel, layer: int, inp: str, edit: Callable[[Tensor], Tensor]):
    """A hook on ``hook_{inp}`` that copies a key/value per query head (GQA) and applies ``edit``."""
    G = _group(model)

    def hook(x: Tensor, hook: Any) -> Tensor:
        if inp != "q" and G > 1:
            x = x.repeat_interleave(G, dim=2)
        return edit(x)

    return (attn_hook(layer, inp), hook)


def _check_expandable(model: LoadedModel, inputs: Sequence[str]) -> None:
    if _group(model) > 1 and any(i in ("k", "v") for i in inputs) and model.spec.layout.qk_norm == "full":
        raise HeadprobeError("one query head's key cannot be patched under a QK-norm over all key/value heads with GQA")


def _chunks(n: int, batch: int, max_rows: int) -> list[range]:
    size = max(1, max_rows // max(batch, 1))
    return [range(i, min(i + size, n)) for i in range(0, n, size)]


@torch.inference_mode()
def path_patch_effects(
    model: LoadedModel,
    runs: PathRuns | RunChunks,
    senders: Sequence[tuple[int, int]],
    receiver: tuple[int, int] | None,
    inp: str = "k",
    max_rows: int | None = None,
) -> Float[np.ndarray, " sender"]:
    """Exact direct-path patching (module docstring) of each sender into one receiver's input ``inp``
    (``receiver`` None: the logits), several senders per batched forward (at most ``max_rows``
    sequences; None: 32, or the :class:`RunChunks`' ``stack_rows``). Returns ``M(patched) - M(clean)``
    averaged over the batch, one per sender.

    Raises:
        HeadprobeError: a sender not before its receiver, or a bad input name.
    """
    L, H = model.spec.n_layers, model.spec.n_heads
    if receiver is not None and inp not in INPUTS:
        raise HeadprobeError(f"receiver input must be one of {INPUTS}, got {inp!r}{did_you_mean(str(inp), INPUTS)}")
    if receiver is not None:
        check_receiver(receiver, L, H)
    for s in senders:
        check_head(s, L, H)
        if receiver is not None and s[0] >= receiver[0]:
            raise HeadprobeError(
                f"sender {format_head(s)} is not a head before its receiver {format_head(receiver)} "
                f"(a sender's layer must be below {receiver[0]})"
            )
    _check_expandable(model, [inp])
    if isinstance(runs, RunChunks):
        return sum(
            w * _patch_part(model, r, senders, receiver, inp, _stack_rows(runs, max_rows)) for w, r in runs.parts()
        )
    return _patch_part(model, runs, senders, receiver, inp, _stack_rows(runs, max_rows))


def _patch_part(
    model: LoadedModel,
    runs: PathRuns,
    senders: Sequence[tuple[int, int]],
    receiver: tuple[int, int] | None,
    inp: str,
    max_rows: int,
) -> np.ndarray:
    """:func:`path_patch_effects` on one :class:`PathRuns` (checks done)."""
    B = runs.clean.shape[0]
    out = np.zeros(len(senders))
    for idx in _chunks(len(senders), B, max_rows):
        delta = torch.cat([runs.deltas[senders[i][0], :, :, senders[i][1]] for i in idx])  # [n*B, pos, d_model]
        tokens = runs.clean.repeat(len(idx), 1).to(model.device)
        if receiver is None:  # the final residual plus delta_s, through the final norm and unembedding
            resid = runs.resid_final.repeat(len(idx), 1, 1).to(model.device)
            logits = model.logits_from_residual(resid + delta.to(resid))
        else:  # the clean run up to the receiver's layer, resumed there with its input patched
            resid = runs.resid_pre[receiver[0]].repeat(len(idx), 1, 1)
            logits = model.forward_from(
                receiver[0],
                resid,
                _receiver_hooks(model, runs, receiver, inp, delta, len(idx)),
                attention_mask=runs.mask_for(len(idx)),
            )
        m = runs.metric(logits.float(), tokens).float()
        out[list(idx)] = (m.view(len(idx), B) - runs.clean_metric.to(m)).mean(1).cpu().numpy()
    return out


def _receiver_hooks(
    model: LoadedModel, runs: PathRuns, receiver: tuple[int, int], inp: str, delta: Tensor, n: int
) -> list:
    """The hooks that add ``(attn_in(resid + delta) - attn_in(resid)) W`` to head ``receiver``'s ``inp``
    (with GQA, keys and values both copied per query head, so that their head counts agree)."""
    layer, head = receiver
    resid = runs.resid_pre[layer].repeat(n, 1, 1).to(model.device, model.dtype)
    change = (model.attention_input(layer, resid + delta.to(resid)) - model.attention_input(layer, resid)).float()
    d = change @ _input_weight(model, layer, head, inp).float()  # [n*B, pos, d]

    def edit(x: Tensor) -> Tensor:  # a key/value is copied per query head by now: column ``head`` is r's own
        x = x.clone()
        x[:, :, head] += d.to(x)
        return x

    hooks = [_expand_hook(model, layer, inp, edit)]
    if inp != "q" and _group(model) > 1:
        other = "v" if inp == "k" else "k"
        hooks.append(_expand_hook(model, layer, other, lambda x: x))
    return hooks


@dataclass(frozen=True, repr=False)
class EdgeScores(CompactRepr):
    """Edge attribution of every head -> head (q/k/v) and head -> logits edge.

    Attributes:
        method: ``eap`` or ``eap-ig``.
        steps: integration steps (1 for EAP).
        head_scores: ``[input (q, k, v), layer_r, head_r, layer_s, head_s]`` float64, 0 where
            ``layer_s >= layer_r`` (no such edge); in the metric's units.
        logit_scores: ``[layer_s, head_s]``, edges into the logits.
    """

    method: str
    steps: int
    head_scores: np.ndarray
    logit_scores: np.ndarray

    @property
    def table(self) -> pd.DataFrame:
        """One row per edge: ``edge, sender, receiver, input, score``, largest ``|score|`` first (a
        property, as every result's ``table``; built on each access)."""
        rows = []
        n_in, L, H = self.head_scores.shape[:3]
        for i in range(n_in):
            for lr in range(1, L):
                for hr in range(H):
                    for ls in range(lr):
                        for hs in range(H):
                            rows.append((f"{ls}.{hs}", f"{lr}.{hr}", INPUTS[i], self.head_scores[i, lr, hr, ls, hs]))
        rows += [(f"{ls}.{hs}", "logits", "logits", self.logit_scores[ls, hs]) for ls in range(L) for hs in range(H)]
        df = pd.DataFrame(rows, columns=["sender", "receiver", "input", "score"])
        df.insert(
            0,
            "edge",
            df["sender"] + " -> " + np.where(df["input"] == "logits", "logits", df["receiver"] + ":" + df["input"]),
        )
        return df.reindex(df["score"].abs().sort_values(ascending=False, kind="stable").index).reset_index(drop=True)


def _input_gradients(
    model: LoadedModel, runs: PathRuns, alpha: float
) -> tuple[dict[tuple[int, str], Tensor], Tensor, list[Tensor]]:
    """One forward and backward with the token embedding at ``e_corrupted + alpha (e_clean -
    e_corrupted)``: ``dM/d hook_{q,k,v}`` per (layer, input) ``[batch, pos, head, d]`` (keys and
    values copied per query head), ``dM/d resid_final`` and each layer's ``resid_pre`` (detached)."""
    L = model.spec.n_layers
    e = (runs.embed_corrupted + alpha * (runs.embed_clean - runs.embed_corrupted)).clone().requires_grad_(True)
    stored: dict[tuple[int, str], Tensor] = {}
    resid_pre: list[Tensor] = []

    def keep(key):
        def store(x: Tensor) -> Tensor:
            stored[key] = x
            return x

        return store

    hooks: list[tuple[str, HookFn]] = [(EMBED, lambda x, hook: e.to(x))]
    hooks += [(block_hook(l, "resid_pre"), lambda x, hook: resid_pre.append(x.detach().clone())) for l in range(L)]
    hooks += [_expand_hook(model, l, inp, keep((l, inp))) for l in range(1, L) for inp in INPUTS]
    hooks.append((block_hook(L - 1, "resid_post"), lambda x, hook: keep((L, "final"))(x)))
    with torch.enable_grad():
        tokens = runs.clean.to(model.device)
        M = runs.metric(model.forward(tokens, fwd_hooks=hooks, attention_mask=runs.mask).float(), tokens).float().mean()
        keys = list(stored)
        grads = torch.autograd.grad(M, [stored[k] for k in keys], allow_unused=True)
    out = {k: (torch.zeros_like(stored[k]) if g is None else g).detach().float() for k, g in zip(keys, grads)}
    return out, out.pop((L, "final")), resid_pre


def _pull_back(model: LoadedModel, layer: int, grads: dict[tuple[int, str], Tensor], resid: Tensor) -> Tensor:
    """``dM/d resid`` as each head's q, k, v of ``layer`` reads the residual: ``[input, head, batch, pos,
    d_model]``, the input gradients through ``W`` and the (recomputed) pre-attention norm's Jacobian."""
    H = model.spec.n_heads
    cot = torch.stack(
        [
            torch.stack(
                [
                    grads[(layer, inp)][:, :, h] @ _input_weight(model, layer, h, inp).detach().float().T
                    for h in range(H)
                ]
            )
            for inp in INPUTS
        ]
    )  # [3, H, B, pos, d_model]
    with torch.enable_grad():
        x = resid.float().expand(3 * H, *resid.shape).reshape(-1, *resid.shape[1:]).clone().requires_grad_(True)
        y = model.attention_input(layer, x.to(model.dtype)).float()
        (g,) = torch.autograd.grad(y, x, grad_outputs=cot.reshape(y.shape))
    return g.detach().view(cot.shape)


def ig_alphas(method: str, steps: int) -> list[float]:
    """The interpolation points: EAP ``[1.0]`` (the clean run); EAP-IG the right Riemann sum
    ``k/m``, ``k = 1..m``: it includes the clean run (alpha = 1), where EAP's gradient is taken, and
    leaves out the corrupted one (alpha = 0), so that EAP-IG with one step is EAP. This is the rule of
    Hanna et al.'s paper and of hannamw/EAP-IG's node attribution. That repository's edge
    attribution (its code from 2025-02 on) sums ``k = 0..m-1`` (left Riemann), which at 5 steps
    ranks edges differently (Spearman 0.81 between the two rules)."""
    return [1.0] if method == "eap" else [k / steps for k in range(1, steps + 1)]


def edge_scores(
    model: LoadedModel, runs: PathRuns | RunChunks, method: str = "eap-ig", steps: int = 5, progress: bool = False
) -> EdgeScores:
    """EAP or EAP-IG scores (module docstring) of every head -> head (q/k/v) edge and head -> logits
    edge: ``delta_s . mean_alpha dM/d(input_r)(alpha)``, summed over batch and positions, in the
    metric's units (an estimate of :func:`path_patch_effects`). The products are taken one sender
    layer at a time (no ``[layer, batch, pos, head, d_model]`` copy), and a :class:`RunChunks` is
    scored chunk by chunk, so memory grows with neither the layers nor the batch.

    Args:
        runs: from :func:`prepare_runs`, or a :class:`RunChunks`.
        method: ``eap`` (the gradient at the clean run) or ``eap-ig`` (``steps`` points, :func:`ig_alphas`).
        steps: integration steps of EAP-IG (>= 1).
        progress: a progress bar on stderr, one count per forward and backward (per step and chunk).

    Raises:
        HeadprobeError: an unknown method or ``steps < 1``; GQA under a QK-norm over all key heads.
    """
    if method not in ("eap", "eap-ig"):
        raise HeadprobeError(
            f"method must be 'eap' or 'eap-ig', got {method!r}{did_you_mean(str(method), ('eap', 'eap-ig'))}"
        )
    if steps < 1:
        raise HeadprobeError(f"EAP-IG needs at least 1 step, got {steps}")
    _check_expandable(model, INPUTS)
    L, H = model.spec.n_layers, model.spec.n_heads
    alphas = ig_alphas(method, steps)
    head_scores, logit_scores = torch.zeros(3, L, H, L, H, dtype=torch.float64), torch.zeros(L, H, dtype=torch.float64)
    bar = _bar(runs, len(alphas), f"edge attribution ({method})", "step", progress)
    for weight, part in _parts(runs):
        heads, logits = _score_part(model, part, alphas, bar)
        head_scores += weight * heads
        logit_scores += weight * logits
    bar.close()
    n = len(alphas)
    return EdgeScores("eap" if method == "eap" else "eap-ig", n, (head_scores / n).numpy(), (logit_scores / n).numpy())


def _score_part(model: LoadedModel, runs: PathRuns, alphas: Sequence[float], bar: Any) -> tuple[Tensor, Tensor]:
    """The sums over ``alphas`` of :func:`edge_scores`' products on one :class:`PathRuns`; ``bar``
    counted once per alpha."""
    L, H = model.spec.n_layers, model.spec.n_heads
    head_scores, logit_scores = torch.zeros(3, L, H, L, H, dtype=torch.float64), torch.zeros(L, H, dtype=torch.float64)
    deltas = runs.deltas.to(model.device)
    for alpha in alphas:
        grads, final, resid_pre = _input_gradients(model, runs, alpha)
        for layer in range(1, L):
            g = _pull_back(model, layer, grads, resid_pre[layer])
            with torch.no_grad():
                for ls in range(layer):
                    head_scores[:, layer, :, ls] += torch.einsum("ihbpd,bpsd->ihs", g, deltas[ls]).double().cpu()
            del g
        with torch.no_grad():
            for ls in range(L):
                logit_scores[ls] += torch.einsum("bpd,bpsd->s", final, deltas[ls]).double().cpu()
        del grads, final, resid_pre
        bar.update(1)
    return head_scores, logit_scores


def agreement(exact: np.ndarray, estimate: np.ndarray, k: int = 10) -> dict[str, Any]:
    """How well edge scores ``estimate`` track exact path patching ``exact`` over the same edges:
    Spearman's and Pearson's correlation (scipy) and the top-``k`` recall, the fraction of the ``k``
    edges largest in ``|exact|`` that are among the ``k`` largest in ``|estimate|`` (Hanna et al.
    2024 compare EAP and EAP-IG with patching by the circuits' overlap and faithfulness; these are
    edge-level stand-ins). A correlation that is undefined (one side
    the same on every edge: a model whose W_O is zero patches to no effect at all) is None, and
    ``null_reasons`` (present only then) says why, keyed like the correlation; so is the recall
    where ``k`` is not below the number of edges (every edge in both top-``k`` sets: 1 by construction).

    Raises:
        HeadprobeError: fewer than 3 edges, or arrays of different lengths.
    """
    exact, estimate = np.asarray(exact, dtype=float), np.asarray(estimate, dtype=float)
    if exact.shape != estimate.shape or exact.size < 3:
        raise HeadprobeError(
            f"agreement needs two equally long arrays of at least 3 edges, got {exact.shape} and {estimate.shape}"
        )
    top = lambda v: set(np.argsort(-np.abs(v), kind="stable")[:k].tolist())
    flat = [
        name
        for name, v in (("the exact path-patching effect", exact), ("the edge score", estimate))
        if np.isfinite(v).all() and v.min() == v.max()
    ]
    why = (
        f"undefined: {' and '.join(flat)} {'is' if len(flat) == 1 else 'are'} the same on every verified edge"
        if flat
        else "undefined: an exact effect or an edge score is not finite"
    )
    out: dict[str, Any] = {
        "spearman": None,
        "pearson": None,
        "top_k": k,
        "top_k_recall": len(top(exact) & top(estimate)) / k if k < exact.size else None,
        "n_edges": int(exact.size),
    }
    reasons = {}
    if k >= exact.size:  # every edge is in both top-k sets
        reasons["top_k_recall"] = (
            f"undefined: {exact.size} verified edges, not more than k = {k} (recall 1 by construction)"
        )
    for name, corr in (("spearman", spearmanr), ("pearson", pearsonr)):
        if flat or not (np.isfinite(exact).all() and np.isfinite(estimate).all()):
            reasons[name] = why  # scipy would warn and give NaN
            continue
        value = float(corr(exact, estimate).statistic)
        out[name] = value if np.isfinite(value) else None
        if out[name] is None:
            reasons[name] = why
    return {**out, "null_reasons": reasons} if reasons else out


def exact_effects(
    model: LoadedModel,
    runs: PathRuns | RunChunks,
    edges: Sequence[Edge],
    max_rows: int | None = None,
    progress: bool = False,
) -> np.ndarray:
    """Exact path patching (:func:`path_patch_effects`) of each edge, edges of one receiver input batched
    together (a :class:`RunChunks` prepared once per chunk for all of them); ``progress``: a progress
    bar on stderr counting the edges patched."""
    out = np.zeros(len(edges))
    groups: dict[tuple, list[int]] = {}
    for i, e in enumerate(edges):
        groups.setdefault((e.receiver, e.input), []).append(i)
    bar = _bar(runs, len(edges), f"path patching {len(edges)} edges", "edge", progress)
    for weight, part in _parts(runs):
        for (receiver, inp), idx in groups.items():
            out[idx] += weight * path_patch_effects(
                model,
                part,
                [edges[i].sender for i in idx],
                receiver,
                "k" if receiver is None else inp,
                max_rows=_stack_rows(runs, max_rows),
            )
            bar.update(len(idx))
    bar.close()
    return out


def _graph_key(name: str) -> tuple[int, ...]:
    """Where edge ``name`` stands in :attr:`EdgeScores.table`'s graph order (before its sort): input
    (q, k, v, then logits), receiver layer and head, sender layer and head."""
    e = parse_edge(name)
    if e.receiver is None:
        return (len(INPUTS), 0, 0, *e.sender)
    return (INPUTS.index(e.input), *e.receiver, *e.sender)


def verification_picks(table: pd.DataFrame, n: int, seed: int = 0) -> np.ndarray:
    """Row positions in ``table`` (sorted by ``|score|``) :func:`verify_edges` path patches: the first
    ``n``, then ``n`` drawn at random (``seed``) from the rest, the rest taken in graph order
    (:func:`_graph_key`), not in ``|score|`` order, so that the draw depends only on which edges are
    eligible: near-zero scores tied in ``|score|`` (``+s``, ``-s``) or 1e-7 apart sort otherwise on
    another host and would put other edges at the drawn positions."""
    top = np.arange(min(n, len(table)))
    names = table["edge"].to_numpy()[len(top) :]
    rest = len(top) + np.array(sorted(range(len(names)), key=lambda i: _graph_key(names[i])), dtype=int)
    drawn = np.random.default_rng(seed).choice(len(rest), size=min(n, len(rest)), replace=False)
    return np.concatenate([top, np.sort(rest[drawn])])


def verify_edges(
    model: LoadedModel,
    runs: PathRuns | RunChunks,
    table: pd.DataFrame,
    n: int,
    seed: int = 0,
    k: int = 10,
    progress: bool = False,
) -> tuple[pd.DataFrame, dict | None]:
    """Path patch the ``n`` edges of ``table`` (:attr:`EdgeScores.table`, sorted by ``|score|``) largest
    in ``|score|`` and ``n`` drawn at random (seeded) from the rest, exactly (:func:`verification_picks`).
    Returns the table with an ``exact`` column (NaN where not patched) and :func:`agreement` over the
    patched edges (None if fewer than 3); ``progress``: :func:`exact_effects`' bar."""
    table = table.copy()
    table["exact"] = np.nan
    if n <= 0:
        return table, None
    pick = verification_picks(table, n, seed)
    edges = [parse_edge(name) for name in table["edge"].to_numpy()[pick]]
    table.loc[table.index[pick], "exact"] = exact_effects(model, runs, edges, progress=progress)
    done = table.dropna(subset=["exact"])
    return table, (agreement(done["exact"].to_numpy(), done["score"].to_numpy(), k) if len(done) >= 3 else None)


def receiver_sweep(
    model: LoadedModel,
    runs: PathRuns | RunChunks,
    receivers: Sequence[tuple[tuple[int, int] | None, str]],
    scores: EdgeScores | None = None,
    progress: bool = False,
) -> pd.DataFrame:
    """Exact path patching from every earlier head into each receiver (``(head, input)`` or ``(None,
    "logits")``): ``receiver, sender, effect`` (and ``score``, the edge attribution, when given), each
    receiver's senders largest effect first; ``progress``: a progress bar on stderr counting the edges.

    Raises:
        HeadprobeError: a receiver head outside the model.
    """
    L, H = model.spec.n_layers, model.spec.n_heads
    rows = []
    for receiver, _inp in receivers:
        if receiver is not None:
            check_receiver(receiver, L, H)
    effects: dict[int, Any] = {i: 0.0 for i in range(len(receivers))}  # 0.0, then an array [sender]
    n_edges = sum(H * (L if receiver is None else receiver[0]) for receiver, _ in receivers)
    bar = _bar(runs, n_edges, f"path patching {len(receivers)} receivers", "edge", progress)
    for weight, part in _parts(runs):
        for i, (receiver, inp) in enumerate(receivers):
            senders = [(l, h) for l in range(L if receiver is None else receiver[0]) for h in range(H)]
            effects[i] = effects[i] + weight * path_patch_effects(
                model, part, senders, receiver, "k" if receiver is None else inp, max_rows=_stack_rows(runs, None)
            )
            bar.update(len(senders))
    bar.close()
    for i, (receiver, inp) in enumerate(receivers):
        senders = [(l, h) for l in range(L if receiver is None else receiver[0]) for h in range(H)]
        name = "logits" if receiver is None else f"{receiver[0]}.{receiver[1]}:{inp}"
        for (l, h), eff in zip(senders, effects[i]):
            score = (
                np.nan
                if scores is None
                else (
                    scores.logit_scores[l, h]
                    if receiver is None
                    else scores.head_scores[INPUTS.index(inp), receiver[0], receiver[1], l, h]
                )
            )
            rows.append((name, f"{l}.{h}", float(eff), float(score)))
    df = pd.DataFrame(rows, columns=["receiver", "sender", "effect", "score"])
    order = {name: i for i, name in enumerate(dict.fromkeys(df["receiver"]))}
    df = df.assign(rank=df["receiver"].map(order)).sort_values(
        ["rank", "effect"], ascending=[True, False], kind="stable"
    )
    return df.drop(columns="rank").reset_index(drop=True)


@torch.inference_mode()
def baseline_error(model: LoadedModel, runs: PathRuns | RunChunks, layers: Sequence[int]) -> float:
    """Largest ``|M(resumed at layer, unpatched) - M(clean)|`` (nats/token with the default metric)
    over ``layers`` (and the logits receiver's unembedding) and the sequences: 0 when the resumed
    runs are bitwise the clean run (as on the native backend, both on the fused kernel).

    One pass per chunk: a forward resumed at the first of ``layers`` whose residual is set back to
    the clean one at every later layer shows which blocks, resumed, do not give the clean residual
    bitwise. A forward resumed at layer ``l`` runs blocks ``l ..`` only, so where every one of them
    does it is the clean run and its error is that of the last block; forwards resumed at the
    layers at or before a block that does not are run one by one, as the definition says."""
    return max(_baseline_part(model, part, layers) for _, part in _parts(runs))


def baseline_tolerance(model: LoadedModel, clean_metric: float) -> tuple[float, str]:
    """The largest :func:`baseline_error` taken for float rounding, and the rule: ``1e-4`` in float32;
    in half precision ``eps(dtype) * max(1, |M(clean)|)`` (bfloat16's eps is 2^-7, float16's 2^-10),
    since a resumed run may round differently from the clean one there."""
    if model.dtype in (torch.float32, torch.float64):
        return 1e-4, "1e-4 (float32)"
    eps = torch.finfo(model.dtype).eps
    return eps * max(1.0, abs(clean_metric)), f"eps({str(model.dtype).removeprefix('torch.')}) * max(1, |clean metric|)"


def _baseline_part(model: LoadedModel, runs: PathRuns, layers: Sequence[int]) -> float:
    tokens = runs.clean.to(model.device)

    def error(logits: Tensor) -> float:
        return float((runs.metric(logits.float(), tokens).float() - runs.clean_metric.to(model.device)).abs().max())

    errors = [error(model.logits_from_residual(runs.resid_final.to(model.device)))]
    layers = sorted(set(layers))
    if not layers:
        return errors[0]
    drifted: list[int] = []  # blocks whose resumed output is not the clean residual bitwise

    def set_clean(layer: int) -> HookFn:
        def hook(resid: Tensor, hook: Any) -> Tensor:
            clean = runs.resid_pre[layer].to(device=resid.device, dtype=resid.dtype)
            if not torch.equal(resid, clean):
                drifted.append(layer - 1)
            return clean

        return hook

    hooks = [(block_hook(l, "resid_pre"), set_clean(l)) for l in range(layers[0] + 1, model.spec.n_layers)]
    errors.append(
        error(model.forward_from(layers[0], runs.resid_pre[layers[0]], fwd_hooks=hooks, attention_mask=runs.mask))
    )
    if drifted:
        errors += [
            error(model.forward_from(l, runs.resid_pre[l], attention_mask=runs.mask))
            for l in layers
            if l <= max(drifted)
        ]
    return max(errors)


def path_patch(
    model: LoadedModel,
    clean: Int[Tensor, "batch pos"],
    corrupted: Int[Tensor, "batch_c pos_c"],
    senders: str | tuple[int, int] | Sequence[str | tuple[int, int]],
    receiver: str | tuple[int, int],
    input: str = "k",
    metric: Metric | None = None,
    first: int = 0,
    attention_mask: Int[Tensor, "batch pos"] | None = None,
) -> float | np.ndarray:
    """Exact path patching (defined in :mod:`headprobe.analyses.circuit`; Wang et al. 2022,
    Goldowsky-Dill et al. 2023) of sender head(s) into ``receiver``'s ``input`` (``"q"``, ``"k"``,
    ``"v"``) or, with ``receiver="logits"``, into the logits: ``M(patched) - M(clean)`` averaged over
    the batch, in the metric's units (default :func:`next_token_loss` from ``first``, nats/token).

    Args:
        model: a loaded model (:func:`headprobe.load_model`, :func:`headprobe.wrap`).
        clean: token ids ``[batch, pos]``.
        corrupted: token ids of the same shape.
        senders: one head, ``(layer, head)`` or ``"layer.head"`` (returns a float), or several:
            a list of those or ``"l.h,l.h"`` (returns ``[sender]``).
        receiver: one head (either form) after every sender's layer, or ``"logits"``.
        input: the receiver's input the senders' direct paths are patched into: ``"q"``, ``"k"``
            or ``"v"`` (unused with ``"logits"``).
        metric: ``metric(logits [batch, pos, d_vocab], tokens) -> [batch]``.
        first: the first position the default metric scores (its next-token loss from there on),
            ``0 .. pos - 2`` (counted from the start; negative values are refused).
        attention_mask: ``[batch, pos]``, 1 real and 0 padding (:func:`prepare_runs`): a padded
            batch gives the mean of each row's effect run alone.

    Returns:
        float | np.ndarray: the effect in the metric's units, a float for one sender, else an
            array ``[sender]`` in the senders' order.

    Raises:
        HeadprobeError: a head out of range or not before its receiver (:func:`~headprobe.probe.core.heads.read_heads`),
            as :func:`prepare_runs` and :func:`path_patch_effects`.
        TypeError: a head that is neither a pair nor a ``"layer.head"`` string.
    """
    L, H = model.spec.n_layers, model.spec.n_heads
    one = is_head_pair(senders) or (isinstance(senders, str) and "," not in senders)
    sender_list = read_heads(senders, L, H, "senders")
    rec = None if receiver == "logits" else read_heads(receiver, L, H, "receiver")
    if rec is not None and len(rec) != 1:
        raise HeadprobeError(f"receiver must be one head or 'logits', got {len(rec)} heads")
    if rec is not None:
        check_receiver(rec[0], L, H)
    runs = prepare_runs(model, clean, corrupted, metric, first, attention_mask)
    out = path_patch_effects(model, runs, sender_list, None if rec is None else rec[0], input)
    return float(out[0]) if one else out


def edge_attribution(
    model: LoadedModel,
    clean: Int[Tensor, "batch pos"],
    corrupted: Int[Tensor, "batch_c pos_c"],
    method: str = "eap-ig",
    steps: int = 5,
    metric: Metric | None = None,
    first: int = 0,
    attention_mask: Int[Tensor, "batch pos"] | None = None,
) -> EdgeScores:
    """EAP or EAP-IG scores of every head -> head (q/k/v) and head -> logits edge (defined in
    :mod:`headprobe.analyses.circuit`; Syed et al. 2023; Hanna et al. 2024): :func:`edge_scores` after
    :func:`prepare_runs`; ``.table`` lists the edges. Scores estimate :func:`path_patch`'s effects,
    in the metric's units.

    Args:
        model: a loaded model (:func:`headprobe.load_model`, :func:`headprobe.wrap`).
        clean: token ids ``[batch, pos]``.
        corrupted: token ids of the same shape.
        method: ``eap`` (the gradient at the clean run; Syed et al. 2023) or ``eap-ig`` (integrated
            gradients over ``steps`` points between corrupted and clean; Hanna et al. 2024).
        steps: integration steps of EAP-IG (>= 1; 1 for EAP).
        metric: ``metric(logits [batch, pos, d_vocab], tokens) -> [batch]`` (default
            :func:`next_token_loss` from ``first``, nats/token).
        first: the first position the default metric scores, ``0 .. pos - 2``.
        attention_mask: ``[batch, pos]``, 1 real and 0 padding: a padded batch, as :func:`path_patch`.

    Returns:
        EdgeScores: ``head_scores`` ``[3 (q, k, v), layer_r, head_r, layer_s, head_s]`` and
            ``logit_scores`` ``[layer_s, head_s]``, float64, in the metric's units.

    Raises:
        HeadprobeError: as :func:`prepare_runs` and :func:`edge_scores` (an unknown ``method``,
            ``steps < 1``).
    """
    return edge_scores(model, prepare_runs(model, clean, corrupted, metric, first, attention_mask), method, steps)
