"""Head-level KV-cache policies measured causally: which KV groups keep a full cache.

A policy (:class:`~headprobe.probe.layout.attention.KVPolicy`) makes some KV groups *streaming*: their
query heads read only the first ``sink`` keys and the last ``window`` ones, and their cache keeps
only those (StreamingLLM, Xiao et al. 2023, arXiv:2309.17453). DuoAttention (Xiao et al. 2024,
arXiv:2410.10819) keeps full caches for the few "retrieval heads" and streams the rest. Here:

* the quality of a policy is measured exactly, with the native model's attention masked per KV
  group (:meth:`~headprobe.probe.model.transformer.Transformer.kv_policy`): the natural-text loss (nats per
  token) and, on the long-range retrieval task (:func:`headprobe.analyses.data.long_range_tokens`),
  the loss on the repeated block and its top-1 copy accuracy, per distance (:func:`evaluate`);
* the cost of streaming each group is either measured (one group streaming at a time,
  :func:`measured_group_costs`) or estimated from the attention mass a group's heads put outside
  the sink and the window (:func:`distant_mass`, the "local fraction" complement), and then
  checked exactly on the chosen policy;
* :func:`kv_curve` compares the chosen policy with the same window on every group at the same
  memory and with random groups at the same memory (several seeds), for several budgets.

Sliding-window layers (Gemma 2/3, GPT-OSS, OLMo 3, Cohere 2): a streaming group there reads the
intersection of its layer's window and the streaming mask, and caches what that leaves
(:func:`~headprobe.probe.layout.cost.streaming_positions`). Where the layer's window is no wider
than the streaming window the two are the same, so those groups are not candidates
(:func:`streaming_candidates`): every policy, chosen, uniform or random, leaves them as the model
has them, and the random controls draw, class by class of saving, as many full groups as the
chosen policy keeps (the same bytes exactly, :func:`matched_random_policy`).

Learned attention sinks (GPT-OSS's per-head sink logit) are parameters, not cached keys: every
policy keeps them, a streaming group's ``sink`` counts its first positions only, and the
attention mass of :func:`distant_mass` is that of the real keys (the learned sink's share is
neither near nor distant).

Functions over a loaded model of the native backend (its ``kv_policy``, ``n_kv_groups``,
``streaming_cache_bytes``: :class:`~headprobe.probe.backends.native.NativeModel`) and token sets; no
printing, no argparse.
"""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field, fields

import numpy as np
import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

from headprobe.analyses.data import LongRangeSet
from headprobe.probe.backends.base import LoadedModel
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.hooks.names import attn_hook
from headprobe.probe.layout.attention import KVPolicy, Streaming

#: Positions of logits computed at once (a ``[batch, chunk, d_vocab]`` block, never a whole sequence's).
LOGIT_CHUNK = 256

_SEQUENCES_PER_FORWARD: ContextVar[int | None] = ContextVar("sequences_per_forward", default=None)


@contextlib.contextmanager
def sequences_per_forward(n: int | None) -> Iterator[None]:
    """Within the ``with`` body, every forward of this module takes at most ``n`` sequences of a
    batch at a time (None: the whole batch), as ``headprobe kv`` sizes it from the memory budget
    (:func:`headprobe.probe.core.memory.plan`). Losses are concatenated and pattern statistics
    averaged over the parts, weighted by their sequences: the results are those of one batch, up
    to the order of floating-point sums."""
    token = _SEQUENCES_PER_FORWARD.set(n)
    try:
        yield
    finally:
        _SEQUENCES_PER_FORWARD.reset(token)


def _parts(batch: int) -> list[slice]:
    """The slices of a ``batch`` of sequences each forward takes (:func:`sequences_per_forward`)."""
    n = _SEQUENCES_PER_FORWARD.get() or batch
    return [slice(a, min(a + n, batch)) for a in range(0, batch, n)]


def check_kv_backend(model: LoadedModel) -> None:
    """Raise unless ``model`` (a :class:`~headprobe.probe.backends.base.LoadedModel`) can run KV policies:
    the native backend (:class:`~headprobe.probe.backends.native.NativeModel`'s ``kv_policy``) and a decoder.

    Raises:
        HeadprobeError: another backend (the bridge has no per-group masks) or an encoder.
    """
    model.require(
        "kv_policies",
        "headprobe kv masks attention per KV group in headprobe's native model; "
        "load with --backend native (or auto) a family it supports",
    )
    if not model.spec.causal:
        from headprobe.analyses.vocabulary import KV_NEEDS_DECODER

        raise HeadprobeError(f"{model.spec.name} is an encoder; {KV_NEEDS_DECODER}")


@dataclass(frozen=True)
class Quality:
    """What a policy leaves of the model.

    Attributes:
        natural_loss: mean next-token loss on natural text, nats/token.
        long_range_loss: mean loss on the repeated block's tokens 2..block_len, nats/token.
        copy_accuracy: share of those tokens that are the top-1 prediction, 0..1.
        per_distance: distance (tokens) -> ``{"n_sequences", "loss", "loss_ci95_lo", "loss_ci95_hi",
            "accuracy", "accuracy_ci95_lo", "accuracy_ci95_hi"}`` over that distance's sequences, each
            with its 95% interval over them (:func:`per_distance_quality`; NaN from one sequence).
        natural_token_loss: the per-token losses the natural loss averages, ``[window, pos]``
            nats (CPU), or None (a Quality built from numbers alone): what the intervals resample.
        copy_hits: the top-1 hits (0/1) the copy accuracy averages, ``[sequence, block_len - 1]``
            (CPU; a mean of several policies' hits: fractions), or None.
    """

    natural_loss: float
    long_range_loss: float
    copy_accuracy: float
    per_distance: dict[int, dict[str, float]]
    natural_token_loss: Tensor | None = field(default=None, repr=False, compare=False)
    copy_hits: Tensor | None = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict:
        """The numbers (not the per-token tensors)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.compare}


def _chunked_loss(
    model: LoadedModel, resid: Float[Tensor, "batch pos d_model"], tokens: Int[Tensor, "batch pos"], start: int
) -> Tensor:
    """Per-token next-token losses ``[batch, pos - 1 - start]`` (nats), unembedding :data:`LOGIT_CHUNK` positions at a time."""
    out = []
    T = tokens.shape[1]
    for a in range(start, T - 1, LOGIT_CHUNK):
        b = min(a + LOGIT_CHUNK, T - 1)
        logits = model.logits_from_residual(resid[:, a:b], normed=True).float()
        out.append(
            F.cross_entropy(logits.flatten(0, 1), tokens[:, a + 1 : b + 1].flatten(), reduction="none").view(
                len(tokens), -1
            )
        )
    return torch.cat(out, dim=1)


@torch.inference_mode()
def natural_token_losses(
    model: LoadedModel, tokens: Int[Tensor, "batch pos"], start: int, policy: KVPolicy | None = None
) -> Float[Tensor, "batch scored"]:
    """Next-token losses (nats) of ``tokens`` from position ``start`` on, under ``policy`` (None:
    full attention), ``[batch, pos - 1 - start]`` on the model's device. The logits are never held
    for a whole sequence."""
    losses = []
    for part in _parts(len(tokens)):
        with model.kv_policy(policy):
            resid = model.final_residual(tokens[part])
        losses.append(_chunked_loss(model, resid, tokens[part].to(resid.device), start))
    return torch.cat(losses)


def natural_loss(
    model: LoadedModel, tokens: Int[Tensor, "batch pos"], start: int, policy: KVPolicy | None = None
) -> float:
    """Mean next-token loss (nats/token) of :func:`natural_token_losses`."""
    return float(natural_token_losses(model, tokens, start, policy).mean())


@torch.inference_mode()
def long_range_quality(model: LoadedModel, lr: LongRangeSet, policy: KVPolicy | None = None) -> tuple[Tensor, Tensor]:
    """Losses (nats) and top-1 hits (0/1) of the repeated block's tokens 2..block_len,
    ``[batch, block_len - 1]`` each, under ``policy``."""
    losses, hits = [], []
    for part in _parts(len(lr.tokens)):
        with model.kv_policy(policy):
            resid = model.final_residual(lr.tokens[part])
        pos, target = (t.to(resid.device) for t in lr.rows(part).targets())
        r = resid.gather(1, pos[..., None].expand(-1, -1, resid.shape[-1]))
        logits = model.logits_from_residual(r, normed=True).float()
        losses.append(F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none").view_as(target))
        hits.append((logits.argmax(-1) == target).float())
    return torch.cat(losses), torch.cat(hits)


def evaluate(
    model: LoadedModel, natural: Int[Tensor, "batch pos"], start: int, lr: LongRangeSet, policy: KVPolicy | None = None
) -> Quality:
    """:class:`Quality` of ``policy`` (exact: the attention masked per KV group), with the per-token
    losses and hits it averages (for :func:`paired_difference`: no further forward pass)."""
    loss, hit = long_range_quality(model, lr, policy)
    loss, hit = loss.cpu(), hit.cpu()
    per = per_distance_quality(loss, hit, lr.distance.cpu())
    nat = natural_token_losses(model, natural, start, policy)
    return Quality(float(nat.mean()), float(loss.mean()), float(hit.mean()), per, nat.float().cpu(), hit)


def per_distance_quality(
    loss: Float[Tensor, "sequence copy"], hits: Float[Tensor, "sequence copy"], distance: Int[Tensor, " sequence"]
) -> dict[int, dict[str, float]]:
    """Per distance of the long-range task, the loss and the top-1 copy accuracy over that distance's
    sequences' copied tokens, each with a 95% interval.

    The interval is the Student-t interval of the mean over the distance's sequences
    (:func:`~headprobe.analyses.statistics.mean_ci`, Student 1908), each sequence's mean over its
    ``copy`` tokens the unit, as the copy accuracy's interval in :func:`paired_difference`: a
    sequence's copied tokens come from one planted block and succeed or fail together, so they are a
    cluster, and a binomial interval over the tokens (independent draws) would be too narrow by the
    design effect (Kish 1965, *Survey Sampling*, ch. 5). Every sequence has the same number of
    copied tokens, so the mean of the sequences' means is the token mean printed, and the t interval
    over them is the cluster-robust one with ``G - 1`` degrees of freedom that Cameron & Miller 2015
    (J. Human Resources 50(2):317-372, sec. VI) recommend for few clusters. The accuracy's bounds are
    clipped to [0, 1] and the loss's lower bound to 0 (a t interval over 2 or 3 sequences overshoots
    the range). Where every sequence has the same accuracy (all copied, typical of the full cache at
    short range) the t interval would have zero width, as if 4 sequences made the accuracy exact: the
    accuracy's interval is then :func:`~headprobe.analyses.statistics.bounded_mean_ci`'s exact bound
    with the sequence as the unit, whatever its number of tokens (all of 4 sequences copied:
    Clopper-Pearson's ``[0.025^(1/4), 1] = [0.398, 1]``; the loss, continuous, keeps the t interval).

    Args:
        loss: per-token losses (nats), ``[sequence, block_len - 1]``.
        hits: top-1 hits (0/1, or fractions for a mean of policies), the same shape.
        distance: each sequence's distance (tokens), ``[sequence]``.

    Returns:
        distance (int, ascending) -> ``{"n_sequences", "loss", "loss_ci95_lo", "loss_ci95_hi", "accuracy",
        "accuracy_ci95_lo", "accuracy_ci95_hi"}``; the bounds NaN (JSON ``null``) for a distance with
        fewer than :data:`~headprobe.analyses.statistics.MIN_N_FOR_CI` sequences (no interval, never a
        made-up one: the default ``--n-per-distance 1``).
    """
    from headprobe.analyses.statistics import bounded_mean_ci, mean_ci

    out: dict[int, dict[str, float]] = {}
    for d in distance.unique():
        rows = distance == d
        entry: dict[str, float] = {"n_sequences": int(rows.sum())}
        for name, x in (("loss", loss[rows]), ("accuracy", hits[rows])):
            per_seq = x.double().mean(1).numpy()
            lo, hi = bounded_mean_ci(per_seq, 0.0, 1.0) if name == "accuracy" else np.clip(mean_ci(per_seq), 0, None)
            entry.update({name: float(x.mean()), f"{name}_ci95_lo": float(lo), f"{name}_ci95_hi": float(hi)})
        out[int(d)] = entry
    return out


def mean_quality(qualities: list[Quality]) -> Quality:
    """The mean of several policies' :class:`Quality` (the random controls'): each number, and per
    token the losses and hits (hits become fractions), so that :func:`paired_difference` against it
    is the difference from the controls' mean, token by token."""
    q = qualities

    def avg(name: str) -> Tensor | None:
        values = [getattr(x, name) for x in q]
        return None if any(v is None for v in values) else torch.stack(values).mean(0)

    return Quality(
        sum(x.natural_loss for x in q) / len(q),
        sum(x.long_range_loss for x in q) / len(q),
        sum(x.copy_accuracy for x in q) / len(q),
        {},
        avg("natural_token_loss"),
        avg("copy_hits"),
    )


def paired_difference(a: Quality, b: Quality, identical: bool = False) -> dict[str, float]:
    """``a`` minus ``b`` on the same tokens, with 95% intervals, from the evaluations' per-token
    values (no forward pass): NaN everywhere where either lacks them. ``identical``: the two are one
    computation (the full cache against itself, or a policy that caches every position it does):
    the difference is 0 on any sequence, not on these alone, and the copy accuracy's interval is
    ``[0, 0]`` exactly.

    * ``natural_loss``: the mean of the per-token loss differences (nats/token) and its
      :func:`~headprobe.analyses.statistics.block_bootstrap_ci` (blocks of contiguous tokens
      within the windows: a token's loss change is correlated with its neighbours');
    * ``copy_accuracy``: the mean over long-range sequences of each sequence's accuracy difference
      (0..1) and its Student-t interval over the sequences
      (:func:`~headprobe.analyses.statistics.mean_ci`): a sequence's copied tokens come from one
      planted block and succeed or fail together, so the sequence is the unit; clipped to [-1, 1],
      the range of a difference of two accuracies (a t interval over 3 or 4 sequences overshoots it).
      Where every sequence differs by the same amount (typically 0: both policies copy the same
      tokens) the t interval would have zero width; it is then
      :func:`~headprobe.analyses.statistics.bounded_mean_ci`'s exact bound: at most a share
      ``1 - 0.025^(1/n)`` of sequences (Clopper-Pearson, 0 of ``n``) differ otherwise, by at most the
      range, so all 0 over 4 sequences gives ``[-0.602, +0.602]``, not ``[0, 0]``.

    Returns:
        ``{"natural_loss", "natural_loss_ci95_lo", "natural_loss_ci95_hi", "copy_accuracy",
        "copy_accuracy_ci95_lo", "copy_accuracy_ci95_hi"}``.
    """
    from headprobe.analyses.statistics import block_bootstrap_ci, bounded_mean_ci

    nan = float("nan")
    out = dict.fromkeys(
        ("natural_loss", "natural_loss_ci95_lo", "natural_loss_ci95_hi", "copy_accuracy")
        + ("copy_accuracy_ci95_lo", "copy_accuracy_ci95_hi"),
        nan,
    )
    if a.natural_token_loss is not None and b.natural_token_loss is not None:
        d = (a.natural_token_loss.double() - b.natural_token_loss.double()).numpy()  # [window, pos]
        lo, hi = block_bootstrap_ci(d)
        out.update(natural_loss=float(d.mean()), natural_loss_ci95_lo=float(lo), natural_loss_ci95_hi=float(hi))
    if a.copy_hits is not None and b.copy_hits is not None:
        per_seq = (a.copy_hits.double().mean(1) - b.copy_hits.double().mean(1)).numpy()  # [sequence]
        # a difference of two accuracies lies in [-1, 1]; one computation differs by 0 on any sequence
        lo, hi = (0.0, 0.0) if identical else bounded_mean_ci(per_seq, -1.0, 1.0)
        out.update(
            copy_accuracy=float(per_seq.mean()), copy_accuracy_ci95_lo=float(lo), copy_accuracy_ci95_hi=float(hi)
        )
    return out


# ---------------------------------------------------------------------------------------------
# Costs of streaming each group: estimated (attention mass outside sink + window) or measured
# ---------------------------------------------------------------------------------------------


def distant_mass_of_pattern(
    pattern: Float[Tensor, "batch head q_pos k_pos"], sink: int, window: int, rows: Int[Tensor, "batch n"] | None = None
) -> Float[Tensor, " head"]:
    """Mean attention mass each head puts on keys a streaming group would drop: ``sink <= k <=
    q - window`` (1 minus the local-plus-sink fraction), over the queries ``rows`` (``[batch,
    n]`` positions; None: every query at ``q >= sink + window``, the first that lose a key). A
    number in [0, 1] per head. Pure: the pattern is not modified."""
    B, H, T, _ = pattern.shape
    if rows is None:
        q = torch.arange(sink + window, T, device=pattern.device)
        if q.numel() == 0:
            return pattern.new_zeros(H)
        rows = q.expand(B, -1)
    p = pattern.gather(2, rows[:, None, :, None].expand(B, H, rows.shape[1], T))  # [batch, head, n, k_pos]
    k = torch.arange(T, device=pattern.device)
    drop = (k[None, None, :] >= sink) & (k[None, None, :] <= rows[:, :, None] - window)  # [batch, n, k_pos]
    return (p * drop[:, None]).sum(-1).mean(dim=(0, 2))


def retrieval_mass_of_pattern(
    pattern: Float[Tensor, "batch head q_pos k_pos"], lr: LongRangeSet
) -> Float[Tensor, " head"]:
    """Mean attention mass each head puts, from the repeat's queries (``second + i``, the ones
    that predict the repeat's tokens 2..block_len), on the block's first occurrence ``[first,
    first + block_len)``, in [0, 1]: a soft stand-in for the retrieval score of Wu et al. 2024
    (arXiv:2404.15574), which counts the copied tokens on which the head's maximum attention lands
    (:func:`headprobe.analyses.metrics.retrieval_score`). A diffuse head puts about ``block_len / pos`` there,
    a head that copies from far back most of its mass. Pure."""
    B, H, T, _ = pattern.shape
    rows, _ = (t.to(pattern.device) for t in lr.targets())
    p = pattern.gather(2, rows[:, None, :, None].expand(B, H, rows.shape[1], T))  # [batch, head, n, k_pos]
    k = torch.arange(T, device=pattern.device)
    first = lr.first.to(pattern.device)[:, None]
    block = (k[None, :] >= first) & (k[None, :] < first + lr.block_len)  # [batch, k_pos]
    return (p * block[:, None, None, :]).sum(-1).mean(dim=(0, 2))


@torch.inference_mode()
def pattern_statistic(model: LoadedModel, tokens: Int[Tensor, "batch pos"], reduce) -> Float[Tensor, "layer head"]:
    """``reduce(pattern, part) -> [head]`` of every layer's pattern, one layer at a time (the hook
    reduces it and lets the forward pass go on; no layer's pattern outlives its layer). ``reduce``
    is a mean over the sequences ``part`` (a slice of the batch) of ``pattern``
    ``[part, head, q_pos, k_pos]``; the parts' means are averaged, weighted by their sequences."""
    L, B = model.spec.n_layers, len(tokens)
    out = torch.zeros(L, model.spec.n_heads)
    for part in _parts(B):

        def hook(layer, part=part):
            def fn(pattern, hook):
                out[layer] += reduce(pattern.float(), part).cpu() * ((part.stop - part.start) / B)

            return fn

        hooks = [(attn_hook(layer, "pattern"), hook(layer)) for layer in range(L)]
        model.final_residual(tokens[part], fwd_hooks=hooks)
    return out


def distant_mass(
    model: LoadedModel,
    tokens: Int[Tensor, "batch pos"],
    sink: int,
    window: int,
    rows: Int[Tensor, "batch n"] | None = None,
) -> Float[Tensor, "layer head"]:
    """:func:`distant_mass_of_pattern` of every head, one layer's pattern at a time (the hook
    reduces it and lets the forward pass go on; no layer's pattern outlives its layer)."""

    def reduce(pattern, part):
        return distant_mass_of_pattern(pattern, sink, window, None if rows is None else rows[part].to(pattern.device))

    return pattern_statistic(model, tokens, reduce)


def group_mean(per_head: Float[Tensor, "layer head"], n_kv_groups: int) -> Float[Tensor, "layer kv_group"]:
    """Mean over each KV group's query heads (head ``h`` is in group ``h * G // n_heads``)."""
    L, H = per_head.shape
    return per_head.view(L, n_kv_groups, H // n_kv_groups).mean(-1)


def group_max(per_head: Float[Tensor, "layer head"], n_kv_groups: int) -> Float[Tensor, "layer kv_group"]:
    """Max over each KV group's query heads: a group must stay full if any of its heads needs it."""
    L, H = per_head.shape
    return per_head.view(L, n_kv_groups, H // n_kv_groups).amax(-1)


@dataclass(frozen=True)
class GroupCosts:
    """Cost of making each KV group streaming, ``[layer, kv_group]`` tensors.

    Attributes:
        method: ``"estimate"`` (attention mass outside sink + window, 0..1, natural text and the
            repeat's queries; mean over a group's heads), ``"retrieval"`` (the long-range cost is
            the mass on the block's first occurrence; max over a group's heads) or ``"measured"`` (the policy with only that group streaming:
            increases in nats/token and the drop in copy accuracy, 0..1).
        natural: natural-text cost. long_range: long-range cost (the repeat's loss or mass).
        accuracy_drop: measured only: full copy accuracy minus the group-streaming one; else None.
    """

    method: str
    natural: Tensor
    long_range: Tensor
    accuracy_drop: Tensor | None = None

    @property
    def score(self) -> Tensor:
        """The ranking score: ``natural + long_range`` (higher = keep full)."""
        return self.natural + self.long_range


def estimated_group_costs(model: LoadedModel, natural: Tensor, lr: LongRangeSet, streaming: Streaming) -> GroupCosts:
    """:class:`GroupCosts` from :func:`distant_mass`: the natural text's queries past ``sink +
    window``, and the repeated block's queries (where copying reads the first occurrence)."""
    pos, _ = lr.targets()
    G = model.n_kv_groups
    nat = group_mean(distant_mass(model, natural, streaming.sink, streaming.window), G)
    far = group_mean(distant_mass(model, lr.tokens, streaming.sink, streaming.window, rows=pos), G)
    return GroupCosts("estimate", nat, far)


def retrieval_group_costs(model: LoadedModel, natural: Tensor, lr: LongRangeSet, streaming: Streaming) -> GroupCosts:
    """:class:`GroupCosts` ``"retrieval"``: the long-range cost is each group's largest
    :func:`retrieval_mass_of_pattern` (the heads that copy from the block's first occurrence),
    the natural cost its largest :func:`distant_mass_of_pattern` on natural text; max over the
    group's heads (:func:`group_max`)."""
    G = model.n_kv_groups
    nat = group_max(
        pattern_statistic(model, natural, lambda p, _: distant_mass_of_pattern(p, streaming.sink, streaming.window)), G
    )
    far = group_max(pattern_statistic(model, lr.tokens, lambda p, part: retrieval_mass_of_pattern(p, lr.rows(part))), G)
    return GroupCosts("retrieval", nat, far)


def measured_group_costs(
    model: LoadedModel,
    natural: Tensor,
    start: int,
    lr: LongRangeSet,
    streaming: Streaming,
    full: Quality,
    progress=None,
    candidates: list[tuple[int, int]] | None = None,
) -> GroupCosts:
    """:class:`GroupCosts` measured: for each group, the policy with only it streaming, against
    ``full``; only the ``candidates`` (None: every group; :func:`streaming_candidates`), the
    others' costs are 0 (their streaming changes nothing)."""
    L, G = model.spec.n_layers, model.n_kv_groups
    nat, far, acc = torch.zeros(L, G), torch.zeros(L, G), torch.zeros(L, G)
    for layer in range(L):
        for g in range(G):
            if candidates is not None and (layer, g) not in candidates:
                continue
            rows: list[list[Streaming | None]] = [[None] * G for _ in range(L)]
            rows[layer][g] = streaming
            q = evaluate(model, natural, start, lr, KVPolicy(tuple(map(tuple, rows))))
            nat[layer, g] = q.natural_loss - full.natural_loss
            far[layer, g] = q.long_range_loss - full.long_range_loss
            acc[layer, g] = full.copy_accuracy - q.copy_accuracy
            if progress is not None:
                progress()
    return GroupCosts("measured", nat, far, acc)


# ---------------------------------------------------------------------------------------------
# Policies at a memory budget and the quality-memory curve
# ---------------------------------------------------------------------------------------------


def n_full_for_budget(n_groups: int, seq_len: int, span: int, budget: float) -> int:
    """The most groups that can keep full caches with the rest streaming (``span = sink +
    window`` positions each) within ``budget`` of the all-full cache at ``seq_len`` tokens:
    ``k * T + (N - k) * min(T, span) <= budget * N * T``. A count in 0..N.

    Raises:
        HeadprobeError: ``budget`` outside (0, 1], or one below what all-streaming costs.
    """
    if not 0 < budget <= 1:
        raise HeadprobeError(f"--kv-budget must be in (0, 1], got {budget}")
    span = min(span, seq_len)
    if span == seq_len:
        return n_groups
    k = math.floor(n_groups * (budget * seq_len - span) / (seq_len - span) + 1e-9)
    if k < 0:
        raise HeadprobeError(
            f"--kv-budget {budget} is below what every group streaming costs "
            f"({span / seq_len:.3f} of the full cache at {seq_len} tokens): use a smaller --window or --sink"
        )
    return min(k, n_groups)


def ranked_groups(score: Tensor) -> list[tuple[int, int]]:
    """``(layer, kv_group)`` by descending score (ties: lower layer, then group, first)."""
    L, G = score.shape
    order = sorted(((float(score[l_, g]), -l_, -g) for l_ in range(L) for g in range(G)), reverse=True)
    return [(-a, -b) for _, a, b in order]


def chosen_policy(score: Tensor, k: int, streaming: Streaming, model: str = "") -> KVPolicy:
    """The ``k`` highest-scoring groups full, every other group ``streaming``."""
    L, G = score.shape
    return KVPolicy.with_full(L, G, ranked_groups(score)[:k], streaming, model)


def random_policy(n_layers: int, n_groups: int, k: int, streaming: Streaming, seed: int) -> KVPolicy:
    """``k`` groups drawn uniformly (``random.Random(seed)``) full, the rest ``streaming``."""
    groups = [(layer, g) for layer in range(n_layers) for g in range(n_groups)]
    return KVPolicy.with_full(n_layers, n_groups, random.Random(seed).sample(groups, k), streaming)


def uniform_policy(n_layers: int, n_groups: int, k: int, streaming: Streaming, seq_len: int) -> KVPolicy:
    """Every group streaming with ``streaming.sink`` sinks and one window ``W'`` chosen so that the
    cache is at most that of ``k`` full groups and ``N - k`` streaming ones at ``seq_len``:
    ``N (S + W') <= k T + (N - k)(S + W)``, the largest such ``W'``. All full when ``W' + S >= T``."""
    N = n_layers * n_groups
    per_group = (k * seq_len + (N - k) * min(seq_len, streaming.span)) // N
    w = per_group - streaming.sink
    if per_group >= seq_len:
        return KVPolicy.uniform(n_layers, n_groups)
    return KVPolicy.uniform(n_layers, n_groups, Streaming(streaming.sink, max(1, w)))


def streaming_candidates(layout, streaming: Streaming) -> list[tuple[int, int]]:
    """``(layer, kv_group)`` of the groups whose streaming changes attention: every group of a
    global layer, and of a sliding-window layer whose window is wider than ``streaming.window``.
    On a layer whose own window ``W <= window`` the streaming mask (sink + recent window,
    intersected with the layer's) reads exactly the layer's window, and caches as much
    (:func:`~headprobe.probe.layout.cost.streaming_positions`): such groups are left as the model
    has them (full: their window) in every policy, chosen, uniform or random, and are not candidates."""
    from headprobe.probe.layout.cost import n_kv_groups

    windows = layout.windows or (None,) * layout.n_layers
    return [
        (layer, g)
        for layer, w in enumerate(windows)
        if w is None or w > streaming.window
        for g in range(n_kv_groups(layout))
    ]


def policy_with_full(
    layout, full, streaming: Streaming, candidates: list[tuple[int, int]], model: str = ""
) -> KVPolicy:
    """The policy whose ``candidates`` stream except those in ``full`` (and every other group is full)."""
    from headprobe.probe.layout.cost import n_kv_groups

    keep, streamable, G = set(map(tuple, full)), set(candidates), n_kv_groups(layout)
    full_groups = [
        (layer, g)
        for layer in range(layout.n_layers)
        for g in range(G)
        if (layer, g) in keep or (layer, g) not in streamable
    ]
    return KVPolicy.with_full(layout.n_layers, G, full_groups, streaming, model)


def _positions(layout, policy: KVPolicy, seq_len: int) -> int:
    """Positions the policy caches over all groups after ``seq_len`` tokens (bytes / bytes per position)."""
    from headprobe.probe.layout.cost import group_positions

    return sum(group_positions(layout, layer, s, seq_len) for layer, row in enumerate(policy.groups) for s in row)


def _saving(layout, group: tuple[int, int], streaming: Streaming, seq_len: int) -> int:
    """Positions a candidate group caches full minus streaming at ``seq_len``."""
    from headprobe.probe.layout.cost import group_positions

    return group_positions(layout, group[0], None, seq_len) - group_positions(layout, group[0], streaming, seq_len)


def _budget_floor(
    layout, streaming: Streaming, seq_len: int, candidates: list[tuple[int, int]]
) -> tuple[int, int, float]:
    """``(positions of the all-full cache, positions with every candidate streaming, rounding slack)`` at ``seq_len``."""
    from headprobe.probe.layout.cost import n_kv_groups

    total = _positions(layout, KVPolicy.uniform(layout.n_layers, n_kv_groups(layout)), seq_len)
    used = _positions(layout, policy_with_full(layout, [], streaming, candidates), seq_len)
    return total, used, 1e-9 * max((_saving(layout, c, streaming, seq_len) for c in candidates), default=0)


def check_budget(budget: float, streaming: Streaming, layout, seq_len: int, candidates: list[tuple[int, int]]) -> None:
    """Raise unless ``budget`` (a fraction of the all-full cache at ``seq_len``) can be met: in (0, 1]
    and no less than what every candidate group streaming costs (the layers' windows included).

    Raises:
        HeadprobeError: ``budget`` outside (0, 1], or one below what all-streaming costs.
    """
    if not 0 < budget <= 1:
        raise HeadprobeError(f"--kv-budget must be in (0, 1], got {budget}")
    total, used, slack = _budget_floor(layout, streaming, seq_len, candidates)
    if used > budget * total + slack:
        raise HeadprobeError(
            f"--kv-budget {budget} is below what every group streaming costs "
            f"({used / total:.3f} of the full cache at {seq_len} tokens): use a smaller --window or --sink"
        )


def budget_full_groups(
    score: Tensor, streaming: Streaming, layout, seq_len: int, budget: float, candidates: list[tuple[int, int]]
) -> list[tuple[int, int]]:
    """The candidate groups kept full within ``budget`` of the all-full cache at ``seq_len`` (the
    layers' windows included): by descending ``score``, a group is kept when its extra positions
    still fit (one that does not is passed over). Without sliding-window layers every group costs
    the same and this is the top :func:`n_full_for_budget` groups.

    Raises:
        HeadprobeError: as :func:`check_budget`.
    """
    check_budget(budget, streaming, layout, seq_len, candidates)
    total, used, slack = _budget_floor(layout, streaming, seq_len, candidates)
    savings = {c: _saving(layout, c, streaming, seq_len) for c in candidates}
    out = []
    for c in (c for c in ranked_groups(score) if c in savings):
        if used + savings[c] <= budget * total + slack:
            out.append(c)
            used += savings[c]
    return out


def matched_random_policy(
    layout,
    full: list[tuple[int, int]],
    streaming: Streaming,
    candidates: list[tuple[int, int]],
    seq_len: int,
    seed: int,
) -> KVPolicy:
    """As many candidate groups full as ``full`` holds of each saving (positions full minus
    streaming at ``seq_len``: global layers' groups, each sliding window's), drawn uniformly
    (``random.Random(seed)``, class by class): the same KV bytes as ``full``'s policy exactly.
    Without sliding-window layers this is :func:`random_policy`."""
    rnd = random.Random(seed)
    classes: dict[int, list[tuple[int, int]]] = {}
    for c in candidates:
        classes.setdefault(_saving(layout, c, streaming, seq_len), []).append(c)
    kept = set(map(tuple, full))
    drawn = []
    for _, groups in sorted(classes.items(), reverse=True):
        drawn += rnd.sample(groups, len(kept.intersection(groups)))
    return policy_with_full(layout, drawn, streaming, candidates)


def uniform_window_policy(
    layout, window: int | None, streaming: Streaming, candidates: list[tuple[int, int]]
) -> KVPolicy:
    """Every candidate streaming with ``streaming.sink`` sinks and the window ``window`` (tokens;
    None: every candidate full), other groups as the model has them."""
    if window is None:
        return policy_with_full(layout, candidates, streaming, candidates)
    return policy_with_full(layout, [], Streaming(streaming.sink, window), candidates)


def matched_uniform_window(
    layout, positions: int, streaming: Streaming, candidates: list[tuple[int, int]], seq_len: int
) -> int | None:
    """``W'`` (tokens): the largest window, at least 1, whose :func:`uniform_window_policy` caches at
    most ``positions`` (KV positions over all groups at ``seq_len``: :func:`_positions`, the KV
    memory in bytes over the bytes of one position); None where every candidate full fits (or no
    window is shorter than ``seq_len - sink``). The one place the uniform control's window is chosen:
    :func:`matched_uniform_policy` and curve.csv's ``uniform_window`` take it from here."""
    hi = seq_len - streaming.sink
    if hi < 1 or _positions(layout, uniform_window_policy(layout, hi, streaming, candidates), seq_len) <= positions:
        return None
    lo = 1  # the widest window that fits, at least 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        fits = _positions(layout, uniform_window_policy(layout, mid, streaming, candidates), seq_len) <= positions
        lo, hi = (mid, hi) if fits else (lo, mid)
    return lo


def matched_uniform_policy(
    layout, positions: int, streaming: Streaming, candidates: list[tuple[int, int]], seq_len: int
) -> KVPolicy:
    """Every candidate streaming with ``streaming.sink`` sinks and one window ``W'``
    (:func:`matched_uniform_window`: the largest whose cache is at most ``positions``; all candidates
    full when that fits), other groups as the model has them. Without sliding-window layers this is
    :func:`uniform_policy`."""
    w = matched_uniform_window(layout, positions, streaming, candidates, seq_len)
    return uniform_window_policy(layout, w, streaming, candidates)


def curve_row(
    kind: str,
    budget: float,
    seed: int | None,
    policy: KVPolicy,
    quality: Quality,
    full: Quality,
    layout,
    seq_len: int,
    uniform_window: int | None = None,
) -> dict:
    """One row of the quality-memory curve: the policy's exact KV bytes
    (:func:`~headprobe.probe.layout.cost.policy_cost` at ``seq_len``, one sequence) and its quality
    against the full cache's (increases in nats/token, accuracy drop in 0..1), with the 95% intervals
    of the increase and the drop (:func:`against_full`: ``*_ci95_lo``/``*_ci95_hi``, NaN where a
    Quality lacks its per-token values). ``uniform_window``: the uniform control's window ``W'``
    (tokens, :func:`matched_uniform_window`), None on every other row and where that control is the
    full cache."""
    from headprobe.probe.layout.cost import policy_cost

    pc = policy_cost(layout, policy, seq_len)
    return {
        "policy": kind,
        "budget": budget,
        "seed": seed,
        "n_full_groups": pc.n_full_groups,
        "uniform_window": uniform_window,
        "kv_bytes": pc.kv_bytes,
        "kv_fraction": pc.kv_fraction,
        "natural_loss": quality.natural_loss,
        "natural_loss_increase": quality.natural_loss - full.natural_loss,
        "long_range_loss": quality.long_range_loss,
        "long_range_loss_increase": quality.long_range_loss - full.long_range_loss,
        "copy_accuracy": quality.copy_accuracy,
        "copy_accuracy_drop": full.copy_accuracy - quality.copy_accuracy,
        **against_full(quality, full, identical=quality is full or pc.kv_fraction == 1.0),
    }


def against_full(quality: Quality, full: Quality, identical: bool = False) -> dict[str, float]:
    """The 95% intervals of ``quality``'s natural-loss increase (nats/token) and copy-accuracy drop
    (0..1) against the full cache's ``full``, from :func:`paired_difference` (no forward pass):
    ``natural_loss_increase_ci95_lo``/``_hi``, ``copy_accuracy_drop_ci95_lo``/``_hi`` (the drop is
    full minus policy: the accuracy difference's bounds negated and swapped); NaN where a Quality
    lacks its per-token values. ``identical``: the policy is the full cache in effect (it caches
    every position the full cache does, :func:`curve_row`'s full row and a uniform row without a
    window): the drop's interval is ``[0, 0]`` exactly, not the bound of sequences that agree."""
    d = paired_difference(quality, full, identical)
    return {
        "natural_loss_increase_ci95_lo": d["natural_loss_ci95_lo"],
        "natural_loss_increase_ci95_hi": d["natural_loss_ci95_hi"],
        "copy_accuracy_drop_ci95_lo": 0.0 - d["copy_accuracy_ci95_hi"],  # 0.0 - x: never -0.0
        "copy_accuracy_drop_ci95_hi": 0.0 - d["copy_accuracy_ci95_lo"],
    }


COMPARED = ("uniform", "random_mean")
"""The controls the chosen policy's row is compared with, token by token (:func:`compare_at`)."""


def comparison_columns(control: str, d: dict[str, float]) -> dict[str, float]:
    """The chosen row's columns of :func:`paired_difference` ``d`` (chosen minus ``control``):
    ``natural_loss_minus_<control>`` (nats/token), ``copy_accuracy_minus_<control>`` (0..1), each
    with ``_ci95_lo``/``_ci95_hi``."""
    return {
        f"{q}_minus_{control}{end}": d[f"{q}{end}"]
        for q in ("natural_loss", "copy_accuracy")
        for end in ("", "_ci95_lo", "_ci95_hi")
    }


def compare_at(
    model: LoadedModel,
    natural: Tensor,
    start: int,
    lr: LongRangeSet,
    full_groups: list[tuple[int, int]],
    streaming: Streaming,
    seeds: list[int],
    layout,
    full: Quality,
    label: float,
    progress=None,
) -> list[dict]:
    """The chosen policy (``full_groups`` full, the other :func:`streaming_candidates` streaming),
    the same window on every candidate at the same memory (:func:`matched_uniform_policy`) and
    random candidates full at the same memory (:func:`matched_random_policy`, one per seed), each
    measured exactly (:func:`evaluate`); rows as :func:`curve_row` with ``budget = label`` (the
    uniform row with its window ``W'``, :func:`matched_uniform_window`), the
    chosen row with :func:`comparison_columns` against uniform and the random rows' mean (the
    differences token by token, from the same evaluations; exactly 0 where both cache every position the
    full cache does: :func:`paired_difference`'s ``identical``)."""
    T = natural.shape[1]
    cands = streaming_candidates(layout, streaming)
    chosen = policy_with_full(layout, full_groups, streaming, cands)
    w = matched_uniform_window(layout, _positions(layout, chosen, T), streaming, cands, T)
    policies: list[tuple[str, int | None, KVPolicy]] = [
        ("chosen", None, chosen),
        ("uniform", None, uniform_window_policy(layout, w, streaming, cands)),
    ]
    policies += [("random", s, matched_random_policy(layout, full_groups, streaming, cands, T, s)) for s in seeds]
    rows, qualities = [], []
    for kind, seed, policy in policies:
        qualities.append(evaluate(model, natural, start, lr, policy))
        rows.append(
            curve_row(kind, label, seed, policy, qualities[-1], full, layout, T, w if kind == "uniform" else None)
        )
        if progress is not None:
            progress()
    chosen_q, uniform_q, random_q = qualities[0], qualities[1], qualities[2:]
    full_cache = [r["kv_fraction"] == 1.0 for r in rows]  # every position the full cache holds: the same computation
    rows[0].update(comparison_columns("uniform", paired_difference(chosen_q, uniform_q, all(full_cache[:2]))))
    if random_q:
        d = paired_difference(chosen_q, mean_quality(random_q), all(full_cache))
        rows[0].update(comparison_columns("random_mean", d))
    return rows


def kv_curve(
    model: LoadedModel,
    natural: Tensor,
    start: int,
    lr: LongRangeSet,
    score: Tensor,
    streaming: Streaming,
    budgets: list[float],
    seeds: list[int],
    layout,
    full: Quality,
    progress=None,
) -> list[dict]:
    """:func:`compare_at` for each budget (the groups of :func:`budget_full_groups`), plus the full
    cache's row (``policy = "full"``, budget 1)."""
    L, G = score.shape
    T = natural.shape[1]
    cands = streaming_candidates(layout, streaming)
    rows = [curve_row("full", 1.0, None, KVPolicy.uniform(L, G), full, full, layout, T)]
    for b in budgets:
        chosen = budget_full_groups(score, streaming, layout, T, b, cands)
        rows += compare_at(model, natural, start, lr, chosen, streaming, seeds, layout, full, b, progress)
    return rows


def tolerance_search_steps(n_candidates: int) -> int:
    """The most evaluations :func:`tolerance_full_groups` makes over ``n_candidates`` groups: a binary
    search over the ``n_candidates + 1`` counts of full groups, ``ceil(log2(n_candidates + 1))``."""
    return n_candidates.bit_length()


def tolerance_full_groups(
    model: LoadedModel,
    natural: Tensor,
    start: int,
    lr: LongRangeSet,
    score: Tensor,
    streaming: Streaming,
    tolerance: float,
    full: Quality,
    layout,
    progress=None,
) -> list[tuple[int, int]]:
    """The fewest candidate groups (:func:`streaming_candidates`, the top ones by ``score``) kept full
    whose policy's natural-text loss increase is at most ``tolerance`` nats/token: a binary search,
    each step measured exactly (it assumes the increase does not grow as groups are made full; the
    answer itself is always measured). At most :func:`tolerance_search_steps` evaluations, each
    followed by a call of ``progress`` (when given)."""
    cands = streaming_candidates(layout, streaming)
    streamable = set(cands)
    ranked = [c for c in ranked_groups(score) if c in streamable]
    lo, hi = 0, len(ranked)  # all full: increase 0
    while lo < hi:
        mid = (lo + hi) // 2
        q = evaluate(model, natural, start, lr, policy_with_full(layout, ranked[:mid], streaming, cands))
        if progress is not None:
            progress()
        if q.natural_loss - full.natural_loss <= tolerance:
            hi = mid
        else:
            lo = mid + 1
    return ranked[:lo]


TOLERANCE_RULE = (
    "within_tolerance: true where the upper bound of the 95% interval of the chosen policy's natural-loss "
    "increase is at most loss_tolerance; null where the point estimate is but the interval reaches above it "
    "(or there is no interval): within as a point estimate only; false where the point estimate (or the whole "
    "interval) is above it. The search decides on point estimates; the interval is the paired block bootstrap "
    "of definitions.intervals.natural_loss, from the same evaluation"
)
"""summary.json's ``target.rule`` with ``--loss-tolerance`` (:func:`tolerance_check`)."""


def tolerance_check(row: dict, tolerance: float) -> dict:
    """Whether the policy of ``row`` (:func:`curve_row`'s: ``natural_loss_increase`` and its
    ``natural_loss_increase_ci95_lo``/``_hi``, nats/token, from the evaluation that gave it: no further
    forward pass) keeps its natural-text loss increase within ``tolerance`` nats/token
    (:data:`TOLERANCE_RULE`): ``within_tolerance`` True (the interval's upper bound is at most the
    tolerance), None (the point estimate is, but the interval straddles the tolerance or is undefined)
    or False (the point estimate, or the whole interval, is above it).

    Returns:
        ``{"loss_tolerance", "natural_loss_increase", "natural_loss_increase_ci95": [lo, hi] (NaN:
        none), "within_tolerance", "verdict", "rule"}``: ``verdict`` the flag in words, ``rule``
        :data:`TOLERANCE_RULE`.
    """
    x, lo, hi = (row[f"natural_loss_increase{end}"] for end in ("", "_ci95_lo", "_ci95_hi"))
    within: bool | None
    if x > tolerance:
        within, verdict = False, "does not hold: the point estimate is above the tolerance"
    elif not (math.isfinite(lo) and math.isfinite(hi)):
        within, verdict = None, "holds as a point estimate only: no 95% interval (too few blocks of tokens)"
    elif lo > tolerance:
        within, verdict = False, "does not hold: the 95% interval lies above the tolerance"
    elif hi <= tolerance:
        within, verdict = True, "holds beyond the 95% interval: its upper bound is within the tolerance"
    else:
        within, verdict = None, "holds as a point estimate only: the 95% interval straddles the tolerance"
    return {
        "loss_tolerance": tolerance,
        "natural_loss_increase": x,
        "natural_loss_increase_ci95": [lo, hi],
        "within_tolerance": within,
        "verdict": verdict,
        "rule": TOLERANCE_RULE,
    }


def with_tolerance(rows: list[dict], tolerance: float) -> list[dict]:
    """``rows`` (:func:`curve_row`'s, as curve.csv holds them) each with ``within_tolerance``: the
    flag :func:`tolerance_check` gives that row at ``tolerance`` nats/token (True, None or False),
    new dicts (``rows`` unchanged)."""
    return [{**r, "within_tolerance": tolerance_check(r, tolerance)["within_tolerance"]} for r in rows]


def allocated_cache_check(model: LoadedModel, tokens: Tensor, policy: KVPolicy, layout) -> dict:
    """Prefill the native model's :class:`~headprobe.probe.model.cache.StreamingKVCache` for ``policy``
    with one sequence (a little past the largest streaming span and layer window, so both evict)
    and compare its bytes with :func:`~headprobe.probe.layout.cost.policy_cost`'s on ``layout`` (its
    windows included: a layout without them predicts more for a sliding layer's groups).

    Raises:
        HeadprobeError: they differ (the formula does not describe the cache).
    """
    from headprobe.probe.layout.cost import policy_cost

    spans = [s.span for row in policy.groups for s in row if s is not None] + [
        w for w in layout.windows or () if w is not None
    ]
    n = min(tokens.shape[1], max(spans, default=0) + 32)
    allocated = model.streaming_cache_bytes(tokens[:1, :n], policy)
    want = policy_cost(layout, policy, n).kv_bytes
    if allocated != want:
        raise HeadprobeError(
            f"the policy's allocated KV cache ({allocated} bytes at {n} tokens) differs from "
            f"budget's formula ({want} bytes)"
        )
    return {"tokens": n, "allocated_bytes": allocated, "policy_cost_bytes": want, "ok": True}


def loss_identity_check(
    model: LoadedModel, tokens: Tensor, start: int, policy: KVPolicy, natural: float, atol: float = 1e-4
) -> dict:
    """The policy's natural-text loss again through the backend's own scoring
    (:meth:`~headprobe.probe.backends.base.LoadedModel.scored_losses`, unchunked, under ``kv_policy``):
    the printed number is checked by a second computation.

    Raises:
        HeadprobeError: they differ by more than ``atol`` nats/token.
    """
    with torch.inference_mode(), model.kv_policy(policy):
        scored = float(torch.cat([model.scored_losses(tokens[part], start) for part in _parts(len(tokens))]).mean())
    if abs(scored - natural) > atol:
        raise HeadprobeError(
            f"the policy's natural-text loss {natural:.6f} differs from the backend's scored loss {scored:.6f}"
        )
    return {"natural_loss": natural, "backend_scored_loss": scored, "ok": True}
