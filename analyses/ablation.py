"""Losses, head ablation, exact ablation sweeps, gradient importance, and verification of
detected heads against a random-head control.

A detection is *verified* when ablating the top-k heads of a type raises the loss on the task
that defines the type clearly more than ablating k random heads does (see :func:`verify`).

The ablation engine:

* :func:`ablate`: zero, mean or resample ablation (any kind of
  :data:`headprobe.probe.core.ablation_kinds.KINDS`, where each kind's replacement is defined) of any
  set of heads as a context manager whose hooks are removed in ``finally`` (both backends;
  ablation at ``hook_z``).
* :func:`exact_sweep`: the loss with each single head ablated, for every head. It runs the
  clean pass once, resumes each ablation at its own layer from the clean residual (a head in
  layer l changes nothing before layer l; its own layer changes only by ``(replacement - z_h)
  W_O^(h)``), batches several ablations along the batch axis, and (on the native backend)
  computes logits only at the scored positions. Equal to :func:`sweep_loop`, the plain
  per-head hook loop. It uses only the typed backend interface
  (:class:`headprobe.probe.backends.base.LoadedModel`), like everything here.
* :func:`head_importance`: Michel et al. 2019's gradient importance ``I_h = E_x |dL(x)/dxi_h|``
  (arXiv 1905.10650; unnormalised by default, ``normalize=True`` divides each layer's scores by
  their l2 norm as their pruning does) and attribution patching (the first-order estimate of each head's ablation
  effect, Nanda 2023), both from one forward and one backward pass.

What an ablation's effect is measured in is an :class:`AblationMetric`: the loss
(:data:`LOSS_METRIC`, nats/token, a decoder's next-token cross-entropy) or, for an encoder
without an LM head, :data:`EMBEDDING_METRIC`, ``1 - cos`` between the clean and the ablated
sentence embedding (:func:`sentence_embeddings`, :class:`EmbeddingDistance`). Both plug into
:func:`set_ablation_losses` through its ``score`` argument; the engine is the same.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from jaxtyping import Float, Int
from torch import Tensor

from headprobe.analyses import distributed
from headprobe.analyses.data import TokenSet, unknown_share
from headprobe.analyses.verdicts import UNITS, VerdictRule, label
from headprobe.probe.backends.base import LoadedModel, cross_entropy_inplace, scored_loss, token_losses  # noqa: F401 - re-exported
from headprobe.probe.core import ablation_kinds, memory
from headprobe.probe.core.ablation_kinds import AblationInputs, AblationKind, Kind
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.core.heads import all_heads, given_heads
from headprobe.probe.core.registry import did_you_mean
from headprobe.probe.hooks.ablation import (
    Head,
    batched_ablation_hooks,
    format_head,
    head_ablation_hooks,
    head_set_masks,
)
from headprobe.probe.hooks.names import attn_hook, block_hook
from headprobe.probe.layout.spec import ModelSpec


def task_loss(logits: Tensor, tokens: Tensor, task: str, start: int, period: int | None) -> float:
    """Mean loss (nats/token) on a task, from ``logits`` ``[batch, pos, d_vocab]`` of ``tokens``
    ``[batch, pos]``.

    ``natural``: every next-token prediction. ``repeated``: predictions of the repeated half's
    tokens r_2..r_S (r_1 of the repeat cannot be predicted from context), i.e. targets at
    positions ``start + S + 1 .. start + 2S - 1``.

    Raises:
        HeadprobeError: ``task`` is neither ``natural`` nor ``repeated`` (:func:`first_scored`).
    """
    return float(token_losses(logits, tokens)[:, first_scored(task, start, period) :].mean())


@torch.inference_mode()
def mean_z_from(
    z_by_layer: dict[int, Tensor], start: int, attention_mask: Int[Tensor, "batch pos"] | None = None
) -> Float[Tensor, "layer head d_head"]:
    """Mean of each head's z over the real positions of a reference batch: positions from
    ``start`` on (after BOS) where ``attention_mask`` ``[batch, pos]`` is 1 (padding never enters
    the mean).

    ``z_by_layer``: layer -> ``z`` ``[batch, pos, head, d_head]`` (as :func:`capture_z` gives it).
    Returns ``[layer, head, d_head]``, stacked in ascending layer order (row i is the i-th layer
    of ``z_by_layer``, the layer itself when every layer is there), in float32.
    """
    out = []
    for layer in sorted(z_by_layer):
        z = z_by_layer[layer][:, start:].float()  # [batch, pos, head, d_head]
        if attention_mask is None:
            out.append(z.mean(dim=(0, 1)))
        else:
            w = attention_mask[:, start:].to(z)[..., None, None]
            out.append((z * w).sum(dim=(0, 1)) / w.sum())
    return torch.stack(out)


@torch.inference_mode()
def ablated_loss(
    model: LoadedModel,
    tokens: Tensor,
    heads: Sequence[Head],
    kind: AblationKind,
    mean_z: Tensor | None,
    task: str,
    start: int,
    period: int | None,
) -> float:
    """Task loss with ``heads`` ablated (at hook_z, before W_O) by a kind that needs no source
    input (zero, or mean with ``mean_z``)."""
    require_head_ablation(model)
    # the backend's scored losses: the native one unembeds in position chunks (no [pos, d_vocab] logits)
    hooks = head_ablation_hooks(heads, kind, mean_z)
    return float(model.scored_losses(tokens, first_scored(task, start, period), fwd_hooks=hooks).double().mean())


@dataclass(frozen=True)
class AblationMetric:
    """What an ablation's effect is measured in (recorded in summary.json as ``metric``).

    Attributes:
        name: ``loss`` or ``embedding_cosine``.
        unit: how numbers are labelled (``nats/token``, ``1 - cos``).
        definition: one sentence, with its source.
    """

    name: str
    unit: str
    definition: str

    @property
    def min_effect(self) -> float:
        """The effect floor of the verdict rule for this metric, in ``unit``
        (:data:`headprobe.analyses.verdicts.MIN_EFFECT`, which owns it)."""
        from headprobe.analyses.verdicts import MIN_EFFECT

        return MIN_EFFECT[self.name]

    def verdict_rule(self, alpha: float, correction: str) -> VerdictRule:
        """The :class:`~headprobe.analyses.verdicts.VerdictRule` of effects in this metric."""
        return VerdictRule.for_metric(self.name, self.unit, alpha, correction)


LOSS_METRIC = AblationMetric(
    "loss", UNITS["loss"], "mean next-token cross-entropy of the scored predictions, ablated minus clean"
)
EMBEDDING_METRIC = AblationMetric(
    "embedding_cosine",
    UNITS["embedding_cosine"],
    "1 - cosine between the clean and the ablated sentence embedding of each sequence: the last hidden state "
    "mean-pooled over its tokens and L2-normalised (sentence-transformers' all-MiniLM-L6-v2 pooling: "
    "1_Pooling/config.json pooling_mode_mean_tokens, then Normalize); clean is 0",
)
"""The metric of encoders without an LM head (its floor: :data:`headprobe.analyses.verdicts.MIN_EFFECT`;
the random control is the main part of the rule either way)."""


def sentence_embeddings(
    model: LoadedModel,
    tokens: Int[Tensor, "batch pos"],
    fwd_hooks: Sequence = (),
    attention_mask: Int[Tensor, "batch pos"] | None = None,
) -> Float[Tensor, "batch d_model"]:
    """Sentence embeddings as sentence-transformers computes them for mean pooling: the model's
    last hidden state (:meth:`~headprobe.probe.backends.base.LoadedModel.final_residual`) averaged over
    the real tokens (``attention_mask`` 1; all tokens without one, special tokens included), then
    L2-normalised. Float32, ``[batch, d_model]``, with ``fwd_hooks`` active.

    Raises:
        HeadprobeError: the backend offers no final residual (the TransformerLens bridge).
    """
    h = model.final_residual(tokens, fwd_hooks, attention_mask).float()
    if attention_mask is None:
        pooled = h.mean(dim=1)
    else:
        w = attention_mask.to(h)[..., None]
        pooled = (h * w).sum(dim=1) / w.sum(dim=1).clamp_min(1e-9)  # sentence-transformers' clamp
    return torch.nn.functional.normalize(pooled, dim=-1)


class EmbeddingDistance:
    """The ``score`` of :func:`set_ablation_losses` for :data:`EMBEDDING_METRIC`: ``1 - cos``
    between each sequence's clean sentence embedding (computed once, here) and its embedding
    with the hooks active. Sequence ``i`` of a call is ``tokens[i % batch]`` (the engine
    repeats the batch once per head set)."""

    def __init__(self, model: LoadedModel, tokens: Int[Tensor, "batch pos"]):
        self.backend = model
        with torch.inference_mode():
            self.clean = sentence_embeddings(model, tokens.to(model.device))  # [batch, d_model]

    def __call__(self, tokens: Int[Tensor, "n pos"], first: int, fwd_hooks: Sequence = ()) -> Float[Tensor, " n"]:
        emb = sentence_embeddings(self.backend, tokens, fwd_hooks)
        clean = self.clean.repeat(tokens.shape[0] // self.clean.shape[0], 1)
        return 1 - (emb * clean).sum(dim=-1)


LOGITS_BYTES_PER_PASS = 512 * 2**20
"""The most bytes of float32 logits :func:`set_ablation_losses` lets one forward pass produce."""


SWEEP_STREAMS = 3
"""``d_model``-wide copies an exact sweep holds per resumed sequence: the clean residual, the clean
attention output plus the ablation's change, and the change itself."""


def sweep_plan(
    model: LoadedModel, batch: int, seq_len: int, n_layers: int, max_batch: int | None = None, first: int = 0
) -> memory.BatchPlan:
    """Sequences per forward pass of :func:`exact_sweep` on ``batch`` sequences of ``seq_len`` tokens
    sweeping heads of ``n_layers`` layers: as many as the memory budget holds
    (:func:`headprobe.probe.core.memory.plan`), at most ``max_batch`` and ``batch n_heads`` (a pass
    ablates heads of one layer), at least ``batch`` (one ablation). Per sequence
    :func:`~headprobe.probe.layout.cost.forward_sequence_bytes`
    with :data:`SWEEP_STREAMS` streams, logits at the scored positions and the model's MLP width
    (:attr:`~headprobe.probe.layout.spec.ModelSpec.d_mlp`); kept: the clean
    activations, ``min(STORED_ACTIVATION_BYTES, batch * seq_len * n_layers * (2 d_model + head d_head) * bytes)``.

    Raises:
        HeadprobeError: one ablation of the batch does not fit (one line, before any allocation).
    """
    spec, e = model.spec, model.dtype.itemsize
    per = spec.forward_sequence_bytes(seq_len, e, logit_positions=max(1, seq_len - 1 - first), streams=SWEEP_STREAMS)
    kept = min(
        STORED_ACTIVATION_BYTES, batch * seq_len * n_layers * (2 * spec.d_model + spec.n_heads * spec.d_head) * e
    )
    whole_layer = batch * spec.n_heads  # a pass ablates heads of one layer: more would never be used
    cap = whole_layer if max_batch is None else min(max_batch, whole_layer)
    return memory.plan(per, model.device, batch, f"the exact ablation sweep ({batch} x {seq_len} tokens)", kept, cap)


def set_plan(model: LoadedModel, batch: int, seq_len: int, max_batch: int | None = None) -> memory.BatchPlan:
    """Sequences per forward pass of :func:`set_ablation_losses` (a control set's full forward, one
    stream: the clean residual it starts from): as many as the memory budget holds, at most
    ``max_batch`` (None: no cap), at least ``batch`` (one set). The clean residuals are made
    before the plan, so the free memory it reads has them out already (nothing kept).

    Raises:
        HeadprobeError: one set's ablation of the batch does not fit (one line, before any allocation).
    """
    per = model.spec.forward_sequence_bytes(seq_len, model.dtype.itemsize, streams=1)
    what = f"control-set ablations ({batch} sequences x {seq_len} tokens per set)"
    return memory.plan(per, model.device, batch, what, 0, max_batch)


@torch.inference_mode()
def set_ablation_losses(
    model: LoadedModel,
    tokens: Int[Tensor, "batch pos"],
    head_sets: Sequence[Sequence[Head]],
    kind: AblationKind,
    mean_z: Float[Tensor, "layer head d_head"] | None,
    first: int,
    max_batch: int | None = None,
    progress: bool = False,
    desc: str = "ablations",
    score: Any = None,
    source_tokens: Int[Tensor, "batch pos"] | None = None,
    attention_mask: Int[Tensor, "batch pos"] | None = None,
    clean: CleanActivations | None = None,
) -> Float[Tensor, "n_sets batch"]:
    """Per-sequence scored loss (nats/token) with each of ``head_sets`` ablated, one set at a time.

    Several sets share a forward pass along the batch axis (``tokens`` repeated once per set;
    :func:`~headprobe.probe.hooks.ablation.batched_ablation_hooks` replaces, in each copy, the heads of that
    copy's set by their kind's ``r_h``), at most ``max_batch`` sequences (None: as many as the
    memory budget holds, :func:`set_plan`) and :data:`LOGITS_BYTES_PER_PASS` of logits per pass. Equal to one :func:`ablated_loss`-style
    forward per set (tested), in fewer passes on a GPU; on a CPU the work is the same.

    Args:
        tokens: ``[batch, pos]``. head_sets: ``n_sets`` sets of ``(layer, head)``.
        kind: a kind of :data:`headprobe.probe.core.ablation_kinds.KINDS`: ``zero``, ``mean`` (needs
            ``mean_z`` ``[layer, head, d_head]``) or ``resample`` (needs ``source_tokens``, the
            shape of ``tokens``).
        first: first scored prediction (see :func:`first_scored`).
        progress: a tqdm bar over the sets (``desc`` its label).
        score: ``(tokens [n, pos], first, fwd_hooks) -> [n]``, what is measured per sequence; None:
            ``model.scored_losses`` (nats/token). :class:`EmbeddingDistance` for an encoder.
        attention_mask: ``[batch, pos]``, 1 real, 0 padding (``model.to_tokens(texts)``), for a
            padded batch (``source_tokens`` padded alike): the loss is then
            :func:`masked_scored_losses`, equal to each sequence's unpadded loss (tested).
        clean: the clean residual streams of ``tokens`` (:class:`CleanResiduals`): each set's
            forwards start at its first ablated layer from there
            (:meth:`~headprobe.probe.backends.base.LoadedModel.scored_losses_from`; nothing before that
            layer changes), sets of one first layer sharing passes. Ignored with ``score`` or
            ``attention_mask``.

    Raises:
        HeadprobeError: unknown ``kind`` or its input missing, the model failed its self-check
            (see :func:`require_head_ablation`), ``attention_mask`` with a custom ``score`` or on a
            backend without padding, or one set's ablation does not fit in memory (:func:`set_plan`).
    """
    require_head_ablation(model)
    score = _padded_score(model, score, attention_mask)
    _, inputs = kind_inputs(model, kind, mean_z, source_tokens, attention_mask)
    spec = model.spec
    tokens = tokens.to(model.device)
    B, T = tokens.shape
    masks = head_set_masks(head_sets, spec.n_layers, spec.n_heads)
    fit = set_plan(model, B, T, max_batch).items
    per_pass = max(1, min(fit // B, LOGITS_BYTES_PER_PASS // max(1, B * T * spec.d_vocab * 4)))
    out = torch.empty(len(head_sets), B)
    from headprobe.probe.core.progress import progress_bar

    bar = progress_bar(total=len(head_sets), desc=desc, unit="set", progress=progress)
    starts = [
        min((layer for layer, _ in hs), default=0) if clean is not None and score is None else 0 for hs in head_sets
    ]
    for start in sorted(set(starts)):  # sets that start at one layer share passes
        idx = [i for i, s in enumerate(starts) if s == start]
        kept = clean.at(start) if start and clean is not None else None  # (resid_pre,), or None: not kept
        pre = kept[0] if kept else None
        for lo in range(0, len(idx), per_pass):
            sel = idx[lo : lo + per_pass]
            chunk = masks[sel].to(model.device)  # [m, layer, head]
            out[sel] = _set_chunk_losses(model, tokens, chunk, kind, inputs, first, score, start, pre).float().cpu()
            bar.update(chunk.shape[0])
    bar.close()
    return out


def _padded_score(model: LoadedModel, score: Any, attention_mask: Tensor | None) -> Any:
    """:func:`set_ablation_losses`' ``score`` for a padded batch: :func:`masked_scored_losses` with
    ``attention_mask`` repeated once per set in the pass (``score`` itself where there is no mask).

    Raises:
        HeadprobeError: ``attention_mask`` together with a custom ``score``.
    """
    if attention_mask is None:
        return score
    if score is not None:
        raise HeadprobeError(
            "set ablations of a padded batch (attention_mask) are scored by the loss only, not a custom score"
        )
    mask = attention_mask.to(model.device)
    return lambda toks, first_, hooks: masked_scored_losses(
        model, toks, first_, hooks, mask.repeat(toks.shape[0] // mask.shape[0], 1)
    )


def _set_chunk_losses(
    model: LoadedModel,
    tokens: Int[Tensor, "batch pos"],
    chunk: Tensor,
    kind: AblationKind,
    inputs: AblationInputs,
    first: int,
    score: Any,
    start: int,
    pre: Tensor | None,
) -> Tensor:
    """One pass of :func:`set_ablation_losses`: the ``[m, batch]`` scores with each of the ``m`` head
    sets of ``chunk`` (``[m, layer, head]`` masks) ablated in its own copy of ``tokens``; a whole
    forward where ``pre`` is None, else resumed at layer ``start`` from the clean residual ``pre``."""
    m, B = chunk.shape[0], tokens.shape[0]
    hooks = batched_ablation_hooks(chunk, B, kind, inputs.mean_z, inputs.source_z)
    if pre is None:
        losses = (score or model.scored_losses)(tokens.repeat(m, 1), first, hooks)
    else:
        losses = model.scored_losses_from(start, tokens.repeat(m, 1), pre.repeat(m, 1, 1), first, hooks)
    return losses.view(m, B)


def masked_scored_losses(
    model: LoadedModel,
    tokens: Int[Tensor, "batch pos"],
    first: int,
    fwd_hooks: Sequence = (),
    attention_mask: Int[Tensor, "batch pos"] | None = None,
) -> Float[Tensor, " batch"]:
    """Per-sequence mean next-token cross-entropy (nats/token) of a padded batch, as
    :func:`~headprobe.probe.backends.base.scored_loss` gives it for each sequence alone: the predictions
    of a real token by the real token before it, from each sequence's ``first``-th real token on
    (either padding side; padding is never scored). Full logits from one forward with ``fwd_hooks``.

    Raises:
        HeadprobeError: ``attention_mask`` on a backend without padding (the TransformerLens bridge).
    """
    if attention_mask is None:
        return model.scored_losses(tokens, first, fwd_hooks)
    losses = token_losses(model.forward(tokens, fwd_hooks, attention_mask), tokens)  # [batch, pos - 1]
    real = attention_mask.to(losses.device).bool()
    index = real.long().cumsum(1) - 1  # each position's index among its sequence's real tokens
    scored = (real[:, :-1] & real[:, 1:] & (index[:, :-1] >= first)).to(losses.dtype)
    return (losses * scored).sum(1) / scored.sum(1).clamp_min(1)


@dataclass
class Verification:
    """Ablation evidence for one head type and one ablation kind (losses in nats/token, or in
    ``1 - cos`` of sentence embeddings where ``metric`` is ``embedding_cosine``, an encoder's).
    ``clean_loss`` and ``top_loss`` are the task's mean loss clean and with the top-k heads
    ablated (``top_effect`` their difference); for an encoder both are None: no loss is measured,
    the metric is 0 clean by definition, and its value ablated is ``top_effect``.

    Made by :func:`headprobe.analyses.verification.verify_heads`, which documents the rule:
    ``tested`` is True for the one ablation kind each type's verdict is tested with (mean); its
    ``p_value`` is the sequential Monte Carlo p-value (``p_method`` says how its test ended), ``p_adjusted`` that p after
    the correction over the run's tested verdicts (``correction``: ``bh`` or ``holm``), and ``confirmed`` holds when
    ``p_adjusted <= alpha`` and the effect is large (the
    :class:`~headprobe.analyses.verdicts.VerdictRule`: at least ``min_effect`` and its ratio times the
    mean control effect). The other kind is reported beside it on the same control sets (``tested``
    False, ``confirmed`` None, ``p_value`` the plain ``(1 + #{random >= top}) / (1 + draws)``).
    ``confirmed`` is also ``None`` (no verdict) when ``no_verdict`` gives a reason the task's loss
    cannot be trusted (see :func:`untrusted_task_reason`). ``draws`` control sets were ablated
    (``random_effects``, ``random_heads``); ``control`` is ``layer-matched`` or ``uniform``; they
    never include the heads under test (``control_excludes``) or a removed head. ``stop_reason``
    says how the tested kind's test ended (``settled above alpha``: h draws reached its effect;
    ``futile under the correction``: curtailed, no later draw could have made it a rejection;
    ``ran to the end``; ``not run: cannot reach alpha``: no control set was ablated, as its sets
    could not give a verdict: ``draws`` 0, ``p_value`` and ``p_adjusted`` None (a test of no draws has
    no p-value; ``tested`` stays True: the correction counts it in its family, at p = 1),
    ``random_mean``/``random_max`` NaN, on both kinds' rows), ``exceedances`` how many control sets reached the top-k effect, and
    ``p_value_is_bound`` whether ``p_value`` is a curtailed test's bound (the largest p the rule
    could still have given: the full test's p is at most this), and then ``p_value_min`` the
    smallest it could still have given (the full test's p lies between the two). ``no_verdict`` is also set, with
    ``confirmed`` None, for a test whose draws cannot reach alpha after the correction, or whose
    top-k loss is not finite. ``top_effect_ci95`` is the 95% Student-t
    interval of the top-k effect over the task's sequences
    (:func:`headprobe.analyses.statistics.mean_ci`), ``[nan, nan]`` from one sequence.
    """

    head_type: str
    kind: str
    task: str
    k: int
    top_heads: list[str]
    clean_loss: float | None
    top_loss: float | None
    top_effect: float
    random_effects: list[float]
    random_mean: float
    random_max: float
    confirmed: bool | None
    random_heads: list[list[str]] = field(default_factory=list)
    control_excludes: list[str] = field(default_factory=list)
    p_value: float | None = float("nan")  # None: no control set ablated (draws 0), no p-value
    top_effect_ci95: list[float] = field(default_factory=lambda: [float("nan"), float("nan")])
    no_verdict: str | None = None
    metric: str = LOSS_METRIC.name
    alpha: float | None = None
    min_effect: float | None = None  # the effect floor of the CONFIRMED rule, in the metric's unit
    p_adjusted: float | None = None
    draws: int | None = None
    control: str | None = None
    correction: str | None = None
    tested: bool = False
    p_method: str | None = None
    stop_reason: str | None = None
    exceedances: int | None = None
    p_value_is_bound: bool = False
    p_value_min: float | None = (
        None  # a curtailed test's smallest reachable p: its full test's p lies in [this, p_value]
    )

    @property
    def verdict(self) -> str:
        """``CONFIRMED``, ``not confirmed`` or ``no verdict`` (:func:`~headprobe.analyses.verdicts.label`)."""
        return label(self.confirmed)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, row: dict) -> Verification:
        """A row of summary.json's ``ablations`` (:meth:`to_dict` as JSON wrote it) as a Verification:
        keys it does not hold are passed over, and a NaN that JSON wrote as null is NaN again."""
        nan = float("nan")
        kept = {k: v for k, v in row.items() if k in cls.__dataclass_fields__}
        for k in ("top_effect", "random_mean", "random_max", "p_value"):
            if k in kept and kept[k] is None and not (k == "p_value" and kept.get("draws") == 0):
                kept[k] = nan
        if kept.get("top_effect_ci95") is not None:
            kept["top_effect_ci95"] = [nan if x is None else x for x in kept["top_effect_ci95"]]
        return cls(**kept)


def untrusted_task_reason(
    clean_loss: float, d_vocab: int, unknown_share: float = 0.0, max_unknown_share: float = 0.5
) -> str | None:
    """Why a task's losses cannot support a verdict, or None when they can.

    A model that predicts the task's tokens no better than a uniform guess over its vocabulary
    (clean loss above ``ln(d_vocab)`` nats) has nothing an ablation could take away, and a text
    the tokenizer mostly does not know (more than ``max_unknown_share`` of its tokens are the
    unknown token) is not the text the scores claim to describe: in both cases every head's
    score and effect measures the failure, not a mechanism.
    """
    import math

    if unknown_share > max_unknown_share:
        return f"{unknown_share:.0%} of the text's tokens are unknown to the tokenizer"
    if clean_loss > math.log(d_vocab):
        return f"clean loss {clean_loss:.2f} nats is above ln(vocabulary) = {math.log(d_vocab):.2f}: no better than a uniform guess"
    return None


def unknown_text_reason(model: LoadedModel, natural: TokenSet) -> str | None:
    """:func:`untrusted_task_reason`'s unknown-token rule alone, for a natural text measured before (or
    without) its clean loss: why ``natural`` cannot support a command's numbers, or None."""
    return untrusted_task_reason(0.0, model.spec.d_vocab, unknown_share(model, natural))


def untrusted_text_note(reason: str, where: str, what: str = "its losses and ablation effects") -> str:
    """The NOTE (without ``NOTE: ``) that the natural text cannot support ``what`` a command measured
    (:func:`untrusted_task_reason`'s ``reason``; ``where``: the summary.json key that keeps it)."""
    return (
        f"natural text: {reason} ({where}): {what} measure that, not a mechanism; give a text the model knows (--text)"
    )


P_VALUE_TIE = 1e-5
"""Effects closer than this (nats, or 1 - cos for encoders) count as ties in the verification's p-values
(:mod:`headprobe.analyses.verification`):
float32 rounding of a mean loss near 8 nats is ~1e-6, so a "top effect" of 2e-6 above draws of 1e-6
is noise, not evidence."""


def top_heads(scores: Float[Tensor, "layer head"], k: int) -> list[Head]:
    """The ``k`` heads with the highest scores, best first; NaN (not measured) ranks last."""
    n_heads = scores.shape[1]
    flat = torch.nan_to_num(torch.as_tensor(scores, dtype=torch.float64).flatten(), nan=float("-inf"))
    idx = flat.argsort(descending=True, stable=True)[: min(k, int(flat.isfinite().sum()) or k)].tolist()
    return [(i // n_heads, i % n_heads) for i in idx]


def names(heads: Sequence[Head]) -> list[str]:
    return [format_head(h) for h in heads]


# --------------------------------------------------------------------------------------------
# Ablation engine
# --------------------------------------------------------------------------------------------


def first_scored(task: str, start: int, period: int | None) -> int:
    """Index into :func:`token_losses`' position axis (``[batch, pos - 1]``) of the first prediction
    a task scores (``natural``: 0, every prediction; ``repeated``: ``start + period``, the repeated
    half; loss index i predicts position i + 1). :func:`task_loss` and :func:`scored_loss` both use it.

    Raises:
        HeadprobeError: ``task`` is neither ``natural`` nor ``repeated``.
    """
    if task == "natural":
        return 0
    if task == "repeated":
        assert period is not None  # a repeated token set has one
        return start + period
    raise HeadprobeError(
        f"unknown task {task!r}{did_you_mean(str(task), ('natural', 'repeated'))}; expected 'natural' or 'repeated'"
    )


def require_head_ablation(model: LoadedModel) -> None:
    """Refuse head ablation on a model whose load-time self-check found its per-head W_O
    decomposition wrong (:mod:`headprobe.probe.hooks.selfcheck`): indexing heads at ``hook_z`` is then
    not known to remove one head's contribution.

    Raises:
        HeadprobeError: one line naming the architecture and the identity that failed.
    """
    check = getattr(model, "self_check", None)
    if check is not None:
        check.require_decomposition("head ablation")


@contextlib.contextmanager
def ablate(
    model: LoadedModel,
    heads: Sequence[Head],
    kind: AblationKind = "zero",
    mean_z: Float[Tensor, "layer head d_head"] | None = None,
    source_z: dict[int, Float[Tensor, "batch pos head d_head"]] | None = None,
) -> Iterator[Any]:
    """Ablate ``heads`` for the ``with`` body: every forward of ``model`` (a LoadedModel, either
    backend) inside it sees them zero-, mean- or resample-ablated at ``hook_z``
    (see :func:`headprobe.probe.hooks.ablation.head_ablation_hooks`). The hooks are removed on exit, also when the
    body raises.

    Raises:
        HeadprobeError: unknown ``kind`` or the input it needs missing, or the model failed its
            self-check (see :func:`require_head_ablation`).
    """
    require_head_ablation(model)
    with model.hooks(head_ablation_hooks(heads, kind, mean_z, source_z)):
        yield model


@torch.inference_mode()
def capture_z(
    model: LoadedModel, tokens: Int[Tensor, "batch pos"], attention_mask: Int[Tensor, "batch pos"] | None = None
) -> dict[int, Float[Tensor, "batch pos head d_head"]]:
    """Every layer's ``z`` on a clean forward pass over ``tokens`` (for mean and resample ablation;
    ``attention_mask`` for a padded batch)."""
    out: dict[int, Tensor] = {}

    def saver(layer: int):
        def hook(z: Tensor, hook: Any) -> None:
            out[layer] = z.detach().clone()

        return hook

    model.forward(
        tokens,
        fwd_hooks=[(attn_hook(layer, "z"), saver(layer)) for layer in model.spec.attention_layers],
        attention_mask=attention_mask,
    )
    return out


def capture_z_plan(model: LoadedModel, batch: int, seq_len: int, what: str) -> memory.BatchPlan:
    """The working memory of :func:`capture_z` over ``batch`` sequences of ``seq_len`` tokens (one
    forward, the whole batch; ``what`` names it), planned by :func:`headprobe.probe.core.memory.plan`:
    per sequence :func:`~headprobe.probe.layout.cost.forward_sequence_bytes` with logits at every
    position (the forward returns them), plus every attention layer's ``z`` it keeps,
    ``layers * seq_len * n_heads * d_head`` elements.

    Raises:
        HeadprobeError: the batch does not fit in the memory budget (one line, before any allocation).
    """
    spec, e = model.spec, model.dtype.itemsize
    z = len(spec.attention_layers) * seq_len * spec.n_heads * spec.d_head * e
    per = spec.forward_sequence_bytes(seq_len, e) + z
    return memory.plan(per, model.device, batch, f"{what} ({batch} x {seq_len} tokens, one forward)", 0, cap=batch)


def kind_inputs(
    model: LoadedModel,
    kind: AblationKind,
    mean_z: Float[Tensor, "layer head d_head"] | None,
    source_tokens: Int[Tensor, "batch pos"] | None,
    attention_mask: Int[Tensor, "batch pos"] | None = None,
) -> tuple[Kind, AblationInputs]:
    """The ablation kind called ``kind`` (:mod:`headprobe.probe.core.ablation_kinds`) and the second
    inputs of its replacement: ``mean_z`` as given, and, for a kind that needs a source, every
    layer's z on ``source_tokens`` (:func:`capture_z`, ``{layer: [batch, pos, head, d_head]}``).

    Raises:
        HeadprobeError: unknown ``kind``, or the input it needs missing.
    """
    ablation = ablation_kinds.check(kind, mean_z, source_tokens)
    source_z = (
        capture_z(
            model, source_tokens.to(model.device), None if attention_mask is None else attention_mask.to(model.device)
        )
        if ablation.needs == "source" and source_tokens is not None
        else None
    )  # None: refused by check()
    return ablation, AblationInputs(mean_z, source_z)


@dataclass
class SweepResult:
    """Single-head ablation sweep (losses in nats/token).

    Attributes:
        clean_loss: mean scored loss with no head ablated.
        loss: ``[layer, head]`` mean scored loss with that one head ablated; NaN where not swept.
        kind: the ablation kind (a name in :data:`headprobe.probe.core.ablation_kinds.KINDS`).
        per_sequence: ``[layer, head, batch]`` each sequence's scored loss with that head ablated
            (:func:`exact_sweep` with ``per_sequence``), else None.
        clean_per_sequence: ``[batch]`` each sequence's clean scored loss, with ``per_sequence``.
    """

    clean_loss: float
    loss: Float[Tensor, "layer head"]
    kind: str
    per_sequence: Float[Tensor, "layer head batch"] | None = None
    clean_per_sequence: Float[Tensor, " batch"] | None = None

    @property
    def effect(self) -> Float[Tensor, "layer head"]:
        """Loss increase from ablating each head, ``loss - clean_loss`` (nats/token)."""
        return self.loss - self.clean_loss


def __getattr__(name: str):
    if name == "SINGLE_INPUT_KINDS":  # kept for importers: the kinds needing no source input, read from the registry
        return ablation_kinds.names(source=False)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@torch.inference_mode()
def sweep_loop(
    model: LoadedModel,
    tokens: Int[Tensor, "batch pos"],
    heads: Sequence[Head] | None = None,
    kind: str = "zero",
    mean_z: Tensor | None = None,
    source_tokens: Int[Tensor, "batch pos"] | None = None,
    first: int = 0,
) -> SweepResult:
    """The plain reference: one full forward pass per head, with that head ablated by a hook.

    Works on either backend. Same arguments and result as :func:`exact_sweep`: ``tokens`` and
    ``source_tokens`` ``[batch, pos]``, ``mean_z`` ``[layer, head, d_head]``; the
    :class:`SweepResult`'s losses in nats/token, ``loss`` ``[layer, head]`` (NaN where not swept).

    Raises:
        HeadprobeError: unknown ``kind`` or its reference input missing, or the model failed its
            self-check (see :func:`require_head_ablation`).
    """
    require_head_ablation(model)
    _, inputs = kind_inputs(model, kind, mean_z, source_tokens)
    spec = model.spec
    heads = given_heads(heads) or all_heads(spec.n_layers, spec.n_heads, spec.attention_layers)
    tokens = tokens.to(model.device)
    clean = float(model.scored_losses(tokens, first).mean())
    loss = torch.full((spec.n_layers, spec.n_heads), float("nan"))
    for layer, head in heads:
        hooks = head_ablation_hooks([(layer, head)], kind, inputs.mean_z, inputs.source_z)
        loss[layer, head] = float(model.scored_losses(tokens, first, fwd_hooks=hooks).mean())
    return SweepResult(clean, loss, kind)


STORED_ACTIVATION_BYTES = 256 * 2**20
"""The most bytes of clean activations :func:`exact_sweep` keeps at once (float32 estimate);
beyond that it records the swept layers in chunks, one clean pass per chunk."""


class _CleanPrefixDone(Exception):
    """Raised by :class:`CleanActivations`' last recording hook of a chunk to end that clean pass early."""


CLEAN_PARTS = ("resid_pre", "z", "attn_out")
"""What :class:`CleanActivations` can record of a layer: the residual stream entering it
``[batch, pos, d_model]``, its heads' ``z`` ``[batch, pos, head, d_head]``, its raw attention output
``[batch, pos, d_model]``."""


class CleanActivations:
    """Clean activations of ``tokens`` at chosen layers (``parts``, a subset of :data:`CLEAN_PARTS`),
    recorded by clean forwards when first asked, never more than :data:`STORED_ACTIVATION_BYTES`
    (float32) of them alive at once. The one recorder of clean activations: :func:`exact_sweep`
    resumes each ablation from all three parts, :func:`set_ablation_losses` starts each head set's
    forwards at its first ablated layer from ``resid_pre`` (:class:`CleanResiduals`).

    Two ways to stay within the bytes:

    * ``drop=False`` (:func:`exact_sweep`, which asks for its layers in order): the layers in
      chunks that fit (at least one layer each), one chunk's activations kept at a time; each chunk
      costs a clean pass up to its last layer, made when :meth:`at` first asks for one of its
      layers, so memory stays flat in ``n_layers``;
    * ``drop=True`` (the verification's set ablations, which ask in any order again and again): the
      deepest layers that fit (the deepest save the most) from one clean pass; :meth:`at` gives
      None for the others (those sets run whole forwards).

    Args:
        model, tokens: the model and its clean input ``[batch, pos]``.
        layers: the layers to record (any order; duplicates ignored).
        first: first scored prediction of the clean loss (:func:`first_scored`).
        clean_loss: record the first chunk now, in a whole clean pass, and keep that pass's mean scored
            loss (nats/token) as :attr:`clean_loss` (``model.scored_losses`` alone when ``layers`` is empty).
    """

    def __init__(
        self,
        model: LoadedModel,
        tokens: Int[Tensor, "batch pos"],
        layers: Iterable[int],
        first: int = 0,
        parts: Sequence[str] = CLEAN_PARTS,
        drop: bool = False,
        clean_loss: bool = False,
    ):
        self.backend, self.tokens, self.first, self.parts = model, tokens.to(model.device), first, tuple(parts)
        B, T = tokens.shape
        spec = model.spec
        width = {"resid_pre": spec.d_model, "z": spec.n_heads * spec.d_head, "attn_out": spec.d_model}
        fit = STORED_ACTIVATION_BYTES // max(1, B * T * sum(width[p] for p in self.parts) * 4)
        layers = sorted(set(layers))
        if drop:
            self.chunks = [sorted(sorted(layers, reverse=True)[:fit])] if fit and layers else []
        else:
            size = max(1, fit)
            self.chunks = [layers[i : i + size] for i in range(0, len(layers), size)]
        self.chunk_of = {layer: c for c, chunk in enumerate(self.chunks) for layer in chunk}
        self.stores: dict[str, dict[int, Tensor]] = {p: {} for p in self.parts}
        self.current: int | None = None
        if clean_loss:
            self.current = 0
            self.clean_loss = (
                self._capture(self.chunks[0], whole=True)
                if self.chunks
                else float(model.scored_losses(self.tokens, first).mean())
            )

    def _capture(self, chunk: Sequence[int], whole: bool) -> float | None:
        """Record ``chunk``'s clean activations; the clean loss if ``whole``, else the pass stops
        after the chunk's last recorded activation (nothing later is needed)."""
        for store in self.stores.values():
            store.clear()

        def save(store: dict, layer: int, stop: bool = False):
            def hook(x: Tensor, hook: Any) -> None:
                store[layer] = x.clone()
                if stop:
                    raise _CleanPrefixDone

            return hook

        names = {
            "resid_pre": lambda layer: block_hook(layer, "resid_pre"),
            "z": lambda layer: attn_hook(layer, "z"),
            "attn_out": self.backend.attn_out_hook,
        }
        parts = [p for p in CLEAN_PARTS if p in self.parts]  # in forward order: the last part's last layer comes last
        hooks = [
            (names[p](layer), save(self.stores[p], layer, stop=not whole and p == parts[-1] and layer == chunk[-1]))
            for p in parts
            for layer in chunk
        ]
        with torch.inference_mode():
            if whole:
                return float(self.backend.scored_losses(self.tokens, self.first, hooks).mean())
            try:
                self.backend.scored_losses(self.tokens, self.first, hooks)
            except _CleanPrefixDone:
                pass
        return None

    def at(self, layer: int) -> tuple[Tensor, ...] | None:
        """Layer ``layer``'s clean activations, one tensor per part (in the order of ``parts``), or
        None where ``layer`` was not asked for or was dropped."""
        if layer not in self.chunk_of:
            return None
        if self.chunk_of[layer] != self.current:
            self.current = self.chunk_of[layer]
            self._capture(self.chunks[self.current], whole=False)
        return tuple(self.stores[p][layer] for p in self.parts)


class CleanResiduals(CleanActivations):
    """The clean ``resid_pre`` entering ``layers`` (but layer 0: its forward starts at the embedding)
    of ``tokens``: where :func:`set_ablation_losses` starts each head set's forwards. The deepest
    layers that fit :data:`STORED_ACTIVATION_BYTES` are kept (:class:`CleanActivations` with ``drop``)."""

    def __init__(self, model: LoadedModel, tokens: Int[Tensor, "batch pos"], layers: Iterable[int]):
        super().__init__(model, tokens, [layer for layer in layers if layer > 0], parts=("resid_pre",), drop=True)


@torch.inference_mode()
def exact_sweep(
    model: LoadedModel,
    tokens: Int[Tensor, "batch pos"],
    heads: Sequence[Head] | None = None,
    kind: str = "zero",
    mean_z: Float[Tensor, "layer head d_head"] | None = None,
    source_tokens: Int[Tensor, "batch pos"] | None = None,
    first: int = 0,
    max_batch: int | None = None,
    progress: bool = False,
    per_sequence: bool = False,
) -> SweepResult:
    """The scored loss with each of ``heads`` (default: all) ablated alone, exactly.

    One clean forward pass records each swept layer's ``resid_pre``, ``z`` and raw attention
    output (in chunks of layers where they would exceed :data:`STORED_ACTIVATION_BYTES`: one
    clean pass per chunk, each ending after its chunk's last layer, so the memory they take is
    bounded whatever ``n_layers``; :class:`CleanActivations`).
    Ablating head h of layer l changes nothing before layer l, and changes layer l's raw
    attention output ``sum_h z_h W_O^(h) + b_O`` only by ``(r_h - z_h) W_O^(h)`` (r_h: the kind's
    replacement, :mod:`headprobe.probe.core.ablation_kinds`: 0, the mean z, or the z on
    ``source_tokens``), so each ablation adds that to the clean raw attention output and resumes
    the forward from layer l
    (:meth:`~headprobe.probe.backends.base.LoadedModel.resume_scored_losses`: the native backend runs the
    rest of the block, the later blocks and the unembedding at the scored positions only; the
    TransformerLens bridge runs a forward with both replaced through hooks). ``max_batch //
    batch`` ablations of one layer share a pass along the batch axis. Equal to :func:`sweep_loop`
    to float rounding (tested to 1e-4 nats on every native family and on the bridge).

    Args:
        model: a :class:`~headprobe.probe.backends.base.LoadedModel` (either backend). tokens: ``[batch, pos]``, no padding.
        heads: ``(layer, head)`` pairs to ablate one at a time.
        kind: a kind of :data:`headprobe.probe.core.ablation_kinds.KINDS`: ``zero``, ``mean`` (needs
            ``mean_z``) or ``resample`` (needs ``source_tokens``, same shape as ``tokens``).
        first: first scored prediction (see :func:`first_scored`).
        max_batch: most sequences in one forward pass (ablations x batch); None: as many as the
            memory budget holds (:func:`sweep_plan`, which also refuses a batch that cannot fit).
        per_sequence: also keep each sequence's losses (:attr:`SweepResult.per_sequence`; one more clean pass).

    Raises:
        HeadprobeError: unknown ``kind`` or its reference input missing, or the model failed its
            self-check (see :func:`require_head_ablation`), or one ablation of the batch does not fit
            in memory (:func:`sweep_plan`).
    """
    require_head_ablation(model)
    ablation, inputs = kind_inputs(model, kind, mean_z, source_tokens)
    spec = model.spec
    heads = given_heads(heads) or all_heads(spec.n_layers, spec.n_heads, spec.attention_layers)
    device = model.device
    tokens = tokens.to(device)
    B, T = tokens.shape
    per_pass = max(1, sweep_plan(model, B, T, len({layer for layer, _ in heads}), max_batch, first).items // B)
    clean = CleanActivations(model, tokens, {layer for layer, _ in heads}, first, clean_loss=True)
    loss = torch.full((spec.n_layers, spec.n_heads), float("nan"))
    seq = torch.full((spec.n_layers, spec.n_heads, B), float("nan")) if per_sequence else None
    it = _sweep_passes(heads, per_pass)
    if progress:
        from headprobe.probe.core.progress import progress_bar

        it = progress_bar(it, desc="ablation sweep", unit="pass")
    for layer, group in it:
        kept = clean.at(layer)
        assert kept is not None  # every swept layer was asked for
        k, idx = len(group), torch.tensor(group, device=device)
        per_seq = _resumed_losses(model, tokens, layer, idx, kept, ablation, inputs, first)  # [k * batch]
        loss[layer, idx.cpu()] = per_seq.view(k, B).mean(dim=1).float().cpu()
        if seq is not None:
            seq[layer, idx.cpu()] = per_seq.view(k, B).float().cpu()
    assert clean.clean_loss is not None  # recorded by clean_loss=True
    clean_seq = model.scored_losses(tokens, first).float().cpu() if per_sequence else None
    return SweepResult(clean.clean_loss, loss, kind, seq, clean_seq)


def _sweep_passes(heads: Sequence[Head], per_pass: int) -> list[tuple[int, list[int]]]:
    """:func:`exact_sweep`'s passes: ``(layer, heads of that layer)``, layers in order, at most
    ``per_pass`` heads each, the heads in the order given."""
    by_layer: dict[int, list[int]] = {}
    for layer, head in heads:
        by_layer.setdefault(layer, []).append(head)
    return [
        (layer, hs[i : i + per_pass]) for layer, hs in sorted(by_layer.items()) for i in range(0, len(hs), per_pass)
    ]


def _resumed_losses(
    model: LoadedModel,
    tokens: Int[Tensor, "batch pos"],
    layer: int,
    idx: Tensor,
    kept: tuple[Tensor, ...],
    ablation: Kind,
    inputs: AblationInputs,
    first: int,
) -> Float[Tensor, " k_batch"]:
    """One pass of :func:`exact_sweep`: the per-sequence scored losses ``[k * batch]`` with each of
    the ``k`` heads ``idx`` of ``layer`` ablated alone, resumed at ``layer`` from its clean
    ``kept = (resid_pre, z, attn_out)`` plus that head's change ``(r_h - z_h) W_O^(h)``."""
    pre, zs, attn = kept
    B, T = tokens.shape
    k = idx.shape[0]
    W_O = model.W_O(layer)  # [head, d_head, d_model]
    z = zs[:, :, idx]  # [batch, pos, k, d_head]
    r = ablation.replace(z, layer, idx, inputs)
    delta = torch.einsum("bpkd,kdm->kbpm", r - z, W_O[idx].to(z))  # [k, batch, pos, d_model]
    return model.resume_scored_losses(
        layer,
        tokens,
        pre[None].expand(k, -1, -1, -1).reshape(k * B, T, -1),
        (attn[None] + delta).reshape(k * B, T, -1),
        first,
    )


@dataclass
class HeadImportance:
    """Gradient scores of every head from one forward and one backward pass.

    Attributes:
        importance: ``[layer, head]`` Michel et al. 2019's ``I_h = E_x |dL(x)/dxi_h|`` (nats per
            unit of the head mask): unnormalised (their definition of ``I_h``) with
            ``normalize=False``, the default and what ``headprobe ablate`` reports; with
            ``normalize=True`` (what ``headprobe prune`` ranks by) each layer's row divided by its
            l2 norm, so unitless and ``<= 1``. NaN in a layer without heads.
        attribution: ``[layer, head]`` attribution patching: the first-order estimate of the
            ablation effect ``E_x (r_h - z_h) . dL(x)/dz_h`` summed over positions (nats/token),
            to compare with :attr:`SweepResult.effect`.
        clean_loss: mean scored loss at the given head mask (nats/token).
        kind: the ablation the attribution estimates.
    """

    importance: Float[Tensor, "layer head"]
    attribution: Float[Tensor, "layer head"]
    clean_loss: float
    kind: str


def importance_sequence_bytes(model: LoadedModel, seq_len: int, kind: str = "zero") -> int:
    """Bytes of one sequence of ``seq_len`` tokens in :func:`head_importance`'s forward and backward
    (``T`` tokens, ``L`` layers, ``H`` heads of ``d_head``, ``e`` the model's element bytes):
    :func:`~headprobe.probe.layout.cost.backward_sequence_bytes` plus ``L T H d_head (4 + e)``, the
    ablation directions ``r - z`` in float32 (:func:`ablation_directions`) beside the gradients at
    ``z``, held while the graph is; ``L T H d_head e`` more for a kind that ablates with a source
    (its z on every layer). The base of every gradient estimator's plan
    (:func:`~headprobe.analyses.attribution.estimate_plan`)."""
    spec, e = model.spec, model.dtype.itemsize
    z = spec.n_layers * seq_len * spec.n_heads * spec.d_head
    per = spec.backward_sequence_bytes(seq_len, e) + z * (4 + e)
    return per + (z * e if ablation_kinds.KINDS.get(kind).needs == "source" else 0)


def importance_plan(
    model: LoadedModel, batch: int, seq_len: int, kind: str = "zero", work: str = "gradient importance"
) -> memory.BatchPlan:
    """The plan of :func:`head_importance` over ``batch`` sequences of ``seq_len`` tokens taken in
    chunks (its ``max_batch`` is :attr:`~headprobe.probe.core.memory.BatchPlan.items`), each sequence
    :func:`importance_sequence_bytes`; ``work`` names it in the header and the refusal. ablate's
    gradient scores and prune's Michel importance are sized by it.

    Raises:
        HeadprobeError: not one sequence fits in the memory budget (one line, before any allocation).
    """
    what = f"{work} ({batch} x {seq_len} tokens, forward and backward)"
    return memory.plan(importance_sequence_bytes(model, seq_len, kind), model.device, 1, what, cap=batch)


def head_importance(
    model: LoadedModel,
    tokens: Int[Tensor, "batch pos"],
    first: int = 0,
    kind: str = "zero",
    mean_z: Float[Tensor, "layer head d_head"] | None = None,
    source_tokens: Int[Tensor, "batch pos"] | None = None,
    head_mask: Float[Tensor, "layer head"] | None = None,
    normalize: bool = False,
    max_batch: int | None = None,
) -> HeadImportance:
    """Gradient importance (Michel, Levy, Neubig 2019, arXiv 1905.10650) and attribution patching.

    Args:
        model: the model, used where and as it is loaded (either backend; a backward pass runs).
        tokens: ``[batch, pos]`` token ids (int64), each row one sequence, BOS included where the
            model prepends one; moved to ``model.device``.
        first: position index (0-based, into ``pos``) of the first *prediction* scored: the loss
            ``L(x)`` is the mean next-token cross-entropy (nats/token) of the predictions made at
            positions ``first .. pos - 2`` (each of the token after it), the scored window of
            :meth:`~headprobe.probe.backends.base.LoadedModel.scored_losses`; e.g. ``0`` scores every
            prediction, ``1 + period`` only the repeated half of ``[BOS] r r``
            (:func:`first_scored`). At most ``pos - 2``: a larger one scores nothing, and every
            score is NaN (not refused).
        kind: the ablation ``A_h`` estimates: ``zero``, ``mean`` or ``resample``
            (:data:`~headprobe.probe.core.ablation_kinds.KINDS`).
        mean_z: ``[layer, head, d_head]`` each head's mean ``z`` (``kind="mean"``; :func:`mean_z_from`).
        source_tokens: ``[batch, pos]`` token ids, the same shape as ``tokens``, whose ``z`` replaces
            each head's (``kind="resample"``).
        head_mask: ``[layer, head]`` the mask ``xi`` the gradients are taken at (1 kept, 0 removed;
            float); default all ones. Pruning rescores at its current mask.
        normalize: divide each layer's ``I_h`` by that layer's l2 norm (Michel et al. section 4.1,
            what ``headprobe prune`` does by default); default False: the raw ``I_h``, as ``headprobe
            ablate`` reports it. Attribution is never normalised.
        max_batch: at most this many sequences per forward and backward (None: the whole batch in
            one); sequences do not interact, so the scores are one pass's to float rounding (a
            budget sized by :func:`importance_plan`).

    Returns:
        :class:`HeadImportance`: ``importance`` and ``attribution`` ``[layer, head]`` (NaN in a
        layer without heads), the mean scored loss at ``head_mask`` (nats/token) and ``kind``.

    One backward pass (:func:`_importance_gradients`) gives each sequence's ``dL(x)/dxi_h`` and
    ``dL(x)/dz_h``:

    * ``I_h = mean_x |dL(x)/dxi_h|``, unnormalised (Michel et al.'s definition of ``I_h``);
      ``normalize`` divides each layer's scores by their l2 norm (their section 4.1, before pruning). The absolute value is taken per sequence, the paper's
      definition, equal to Hugging Face's bertology loop at batch size 1 with the gradient reset
      each step; the authors' released code takes it per token, which ranks heads differently
      (Spearman 0.65 on SmolLM2-135M);
    * attribution ``A_h = mean_x sum_pos (r_h - z_h) . dL(x)/dz_h``, with ``r_h`` the ablated value
      of ``kind`` (:mod:`headprobe.probe.core.ablation_kinds`: 0, ``mean_z``, or the z on
      ``source_tokens``): the first-order change of the mean loss.

    Data-parallel under ``torchrun`` (:func:`_sharded_importance`).

    Raises:
        HeadprobeError: unknown ``kind`` or its reference input missing, or the model failed its
            self-check (see :func:`require_head_ablation`).
    """
    ablation_kinds.check(kind, mean_z, source_tokens)  # before any rank returns early
    require_head_ablation(model)
    if distributed.active():
        return _sharded_importance(model, tokens, first, kind, mean_z, source_tokens, head_mask, normalize, max_batch)
    g_xi, attr, per_seq = _chunked_gradients(model, tokens, first, kind, mean_z, source_tokens, head_mask, max_batch)
    importance = _by_layer(model.spec, [g.abs().float().mean(dim=0) for g in g_xi], torch.float32)
    if normalize:
        importance = layer_normalized(importance)
    attribution = _by_layer(model.spec, [a.mean(dim=0) for a in attr], torch.float32)
    return HeadImportance(importance, attribution, float(per_seq.detach().mean()), kind)


def layer_normalized(importance: Float[Tensor, "layer head"]) -> Float[Tensor, "layer head"]:
    """Michel et al.'s per-layer normalisation (arXiv 1905.10650, section 4.1): each layer's row of
    ``importance`` (``I_h``, :func:`head_importance`) divided by that row's l2 norm, what ``headprobe
    prune`` ranks by (``normalize=True``) and ``headprobe ablate`` correlates with the exact effect.
    The norm is over the row's finite entries (a NaN, a head not measured, counts as 0, as a pruned
    head's zero gradient does in prune); a row of zeros stays 0, a row of NaN (a layer without heads)
    NaN. No unit (each row's squares sum to 1)."""
    finite = torch.where(importance.isfinite(), importance, torch.zeros_like(importance))
    return importance / finite.norm(dim=1, keepdim=True).clamp_min(1e-20)


def _by_layer(spec: ModelSpec, per_layer: list[Tensor], dtype: torch.dtype) -> Tensor:
    """``[n_layers, n_heads]`` from one ``[head]`` row per attention layer; NaN in a layer without
    heads (a hybrid's linear-attention layers)."""
    out = torch.full((spec.n_layers, spec.n_heads), float("nan"), dtype=dtype)
    out[list(spec.attention_layers)] = torch.stack(per_layer).cpu().to(dtype)
    return out


def _chunked_gradients(
    model: LoadedModel,
    tokens: Tensor,
    first: int,
    kind: str,
    mean_z: Tensor | None,
    source_tokens: Tensor | None,
    head_mask: Tensor | None,
    max_batch: int | None,
) -> tuple[list[Tensor], list[Tensor], Tensor]:
    """:func:`_importance_gradients` over consecutive chunks of at most ``max_batch`` sequences (None:
    one pass), each chunk's per-sequence results concatenated in order: sequences do not interact."""
    n = tokens.shape[0]
    step = max(1, n if max_batch is None else min(max_batch, n))
    parts = [
        _importance_gradients(
            model,
            tokens[i : i + step],
            first,
            kind,
            mean_z,
            None if source_tokens is None else source_tokens[i : i + step],
            head_mask,
        )
        for i in range(0, max(n, 1), step)
    ]
    if len(parts) == 1:
        return parts[0]
    g_xi = [torch.cat([p[0][j] for p in parts]) for j in range(len(parts[0][0]))]
    attr = [torch.cat([p[1][j] for p in parts]) for j in range(len(parts[0][1]))]
    return g_xi, attr, torch.cat([p[2].detach() for p in parts])


def _importance_gradients(
    model: LoadedModel,
    tokens: Tensor,
    first: int,
    kind: str,
    mean_z: Tensor | None,
    source_tokens: Tensor | None,
    head_mask: Tensor | None,
) -> tuple[list[Tensor], list[Tensor], Tensor]:
    """The one backward pass of :func:`head_importance` (same arguments): a hook at every
    attention layer's ``hook_z`` (both backends) returns ``z * xi + delta`` with the head mask
    ``xi`` (``[batch, head]``, at ``head_mask``, default all ones) and ``delta = 0``, both requiring
    grad; with ``L = sum_x L(x)`` over sequences, one backward gives every sequence's gradients.

    Returns:
        ``(g_xi, attr, per_seq)``: per attention layer ``dL(x)/dxi`` ``[batch, head]`` and the
        attribution ``sum_pos (r_h - z_h) . dL(x)/dz_h`` ``[batch, head]``; the scored loss per
        sequence ``[batch]`` (nats/token)."""
    spec = model.spec
    tokens = tokens.to(model.device)
    ablation, inputs = kind_inputs(model, kind, mean_z, source_tokens)
    base = torch.ones(spec.n_layers, spec.n_heads) if head_mask is None else head_mask.detach().float().cpu()
    layers = list(spec.attention_layers)
    hooks, xis, deltas, zs = _mask_probes(base, tokens.shape[0], layers)
    with torch.inference_mode(False), torch.enable_grad():
        logits = model.forward(tokens, fwd_hooks=hooks)
        per_seq = scored_loss(logits, tokens, first)  # [batch]
        grads = torch.autograd.grad(per_seq.sum(), [xis[l] for l in layers] + [deltas[l] for l in layers])
    g_xi, g_z = grads[: len(layers)], grads[len(layers) :]
    diff = ablation_directions(zs, ablation, inputs)
    attr = [(d * g.float()).sum(dim=(1, 3)) for d, g in zip(diff, g_z)]
    return list(g_xi), attr, per_seq


def _sharded_importance(
    model: LoadedModel,
    tokens: Tensor,
    first: int,
    kind: str,
    mean_z: Tensor | None,
    source_tokens: Tensor | None,
    head_mask: Tensor | None,
    normalize: bool,
    max_batch: int | None = None,
) -> HeadImportance:
    """:func:`head_importance` under ``torchrun`` (:mod:`headprobe.analyses.distributed`): each rank
    takes its contiguous slice of the batch (:func:`~headprobe.analyses.distributed.batch_slice`;
    sequences do not interact), sums its per-sequence scores in float64, and an all-reduce adds the
    sums, so every rank returns the one-process result (to float32 rounding, ~1e-7 relative)."""
    spec = model.spec
    B_total = tokens.shape[0]
    rows = distributed.batch_slice(B_total)
    tokens = tokens[rows]
    source_tokens = source_tokens[rows] if source_tokens is not None else None
    if tokens.shape[0] == 0:
        sums = torch.zeros(2 * spec.n_layers * spec.n_heads + 1, dtype=torch.float64)
        return _reduced_importance(sums, spec, B_total, kind, normalize)
    g_xi, attr, per_seq = _chunked_gradients(model, tokens, first, kind, mean_z, source_tokens, head_mask, max_batch)
    sums = torch.cat(
        [
            _by_layer(spec, [g.abs().double().sum(dim=0) for g in g_xi], torch.float64).flatten(),
            _by_layer(spec, [a.double().sum(dim=0) for a in attr], torch.float64).flatten(),
            per_seq.detach().double().sum().cpu().view(1),
        ]
    )
    return _reduced_importance(sums, spec, B_total, kind, normalize)


def _mask_probes(base: Float[Tensor, "layer head"], batch: int, layers: Sequence[int]) -> tuple[list, dict, dict, dict]:
    """:func:`head_importance`'s ``hook_z`` hooks for each of ``layers`` (those with heads): each returns ``z * xi + delta``
    with the head mask ``xi`` ``[batch, head]`` (at ``base``) and ``delta`` (zeros), both requiring
    grad. Returns ``(hooks, xis, deltas, zs)``; the dicts (``zs``: the masked z, detached) fill
    during the forward."""
    xis: dict[int, Tensor] = {}
    deltas: dict[int, Tensor] = {}
    zs: dict[int, Tensor] = {}

    def make(layer: int):
        def hook(z: Tensor, hook: Any) -> Tensor:
            xi = base[layer].to(z.device, z.dtype).expand(batch, -1).clone().requires_grad_(True)
            delta = torch.zeros_like(z, requires_grad=True)
            xis[layer], deltas[layer] = xi, delta
            out = z * xi[:, None, :, None]
            zs[layer] = out.detach()
            return out + delta

        return hook

    return [(attn_hook(layer, "z"), make(layer)) for layer in layers], xis, deltas, zs


def ablation_directions(
    zs: dict[int, Tensor], kind: Kind, inputs: AblationInputs
) -> list[Float[Tensor, "batch pos head d_head"]]:
    """``r_h - z_h`` for every head of every layer of ``zs`` (``{layer: z [batch, pos, head,
    d_head]}``), in layer order, in float32: the change of z that ablating each head
    by ``kind`` makes, the direction of attribution patching and its relatives."""
    diff = []
    for layer in sorted(zs):
        z = zs[layer].float()
        diff.append(kind.replace(z, layer, slice(None), inputs) - z)
    return diff


def _reduced_importance(sums: Tensor, spec: ModelSpec, n: int, kind: str, normalize: bool) -> HeadImportance:
    """:func:`head_importance`'s result from this rank's float64 sums over its sequences
    (``[importance (layer*head), attribution (layer*head), loss]``), added over the ranks."""
    distributed.all_reduce_sum(sums)
    means = (sums / n).float()
    size = spec.n_layers * spec.n_heads
    importance = means[:size].view(spec.n_layers, spec.n_heads).clone()
    if normalize:
        importance = layer_normalized(importance)
    attribution = means[size : 2 * size].view(spec.n_layers, spec.n_heads).clone()
    return HeadImportance(importance, attribution, float(means[-1]), kind)


def spearman(a: Tensor | np.ndarray, b: Tensor | np.ndarray) -> float:
    """Spearman rank correlation of two score tables over the entries finite in both
    (``scipy.stats.spearmanr``).

    ``a`` and ``b``: the same number of entries, any shape (e.g. ``[layer, head]``), compared
    flattened. Returns rho in [-1, 1] (no unit); NaN where fewer than 2 entries are finite in
    both or one table is constant there.
    """
    from scipy.stats import spearmanr

    a, b = torch.as_tensor(a).flatten().double(), torch.as_tensor(b).flatten().double()
    ok = torch.isfinite(a) & torch.isfinite(b)
    return float(spearmanr(a[ok].numpy(), b[ok].numpy()).statistic)
