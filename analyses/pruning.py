"""Iterative head pruning (Michel, Levy, Neubig 2019, "Are Sixteen Heads Really Better than
One?", arXiv 1905.10650) with a random-order baseline.

At each step the ``step_fraction`` of *all* heads (default 10%) with the lowest importance among
the heads still present is removed; the importance is Michel et al.'s gradient score
``I_h = E_x |dL(x)/dxi_h|`` (:func:`headprobe.analyses.ablation.head_importance`), l2-normalised per
layer unless ``normalize=False`` (``ablate`` reports the unnormalised ``I_h``), on a scoring set, taken
at the current head mask after every step (``rescore``) or once before pruning (as in the
paper). After every step the loss on held-out sets is recorded. The random baseline removes the
heads in one seeded random order, in the same steps. Removal here is by the head mask (z_h
multiplied by 0); :mod:`headprobe.probe.model.pruned` turns a mask into a model without those weights.

:func:`l0_pruning` is the other method: Voita, Talbot, Moiseev, Sennrich, Titov 2019 ("Analyzing
Multi-Head Self-Attention", arXiv 1905.09418), one stochastic Hard Concrete gate per head
(Louizos, Welling, Kingma 2018, arXiv 1712.01312) on the frozen model, trained on the task loss
plus a penalty on the expected number of open gates; a sweep over the penalty's weight gives
the curve. :func:`curve_auc` compares curves by their area, :func:`per_layer_best_head` is
Michel et al.'s per-layer table (each layer reduced to its single best head).

Under ``torchrun`` (:mod:`headprobe.analyses.distributed`) every rank runs every curve, in the
same order, and shares the work inside each step: the gradient importance and the held-out
losses (:func:`masked_loss`) are data-parallel over the batch rows, and the per-layer table's
head sets are sharded over the ranks. The curves themselves are sequential (each step's mask
depends on the last) and are not split; the L0 gates are trained on every rank alike (same seed,
same minibatches), not data-parallel.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from headprobe.analyses import distributed
from headprobe.analyses.ablation import head_importance, importance_plan, require_head_ablation, scored_loss
from headprobe.analyses.vocabulary import PRUNING_METHODS as METHODS  # noqa: F401 - defined once (torch-free)
from headprobe.analyses.vocabulary import PRUNING_ORDERS as ORDERS
from headprobe.analyses.vocabulary import unreliable_picks  # noqa: F401 - defined once (torch-free: the LaTeX export reads it)
from headprobe.probe.backends.base import LoadedModel
from headprobe.probe.core import memory
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.core.registry import did_you_mean
from headprobe.probe.hooks.ablation import Head, format_head
from headprobe.probe.hooks.names import attn_hook


@dataclass(frozen=True)
class LossSet:
    """Tokens to evaluate (or score) on and the first scored prediction (see
    :func:`headprobe.analyses.ablation.first_scored`)."""

    tokens: Int[Tensor, "batch pos"]
    first: int = 0


def present_heads(model: LoadedModel) -> Float[Tensor, "layer head"]:
    """``[layer, head]``: 1 for the heads ``model`` has, 0 for those a pruned checkpoint no longer
    has (``spec.removed_heads``, loaded with zero weights). Every pruning method here starts from
    this mask: a removed head is never a candidate, and counts and fractions are of the heads present.

    Raises:
        HeadprobeError: every head of the model is already removed (nothing to prune).
    """
    spec = model.spec
    present = torch.ones(spec.n_layers, spec.n_heads)
    for layer, head in spec.removed_heads:
        present[layer, head] = 0.0
    if not present.any():
        raise HeadprobeError(f"{spec.name}: every head is already removed; there is nothing left to prune")
    return present


@torch.inference_mode()
def masked_loss(model: LoadedModel, data: LossSet, keep: Float[Tensor, "layer head"]) -> float:
    """Mean scored loss (nats/token) with each head's z multiplied by ``keep[layer, head]``
    (a hook at ``hook_z``; either backend). Data-parallel under ``torchrun``: each rank sums the
    losses of its slice of the rows (:func:`~headprobe.analyses.distributed.batch_slice`, float64)
    and an all-reduce adds them, so every rank returns the one-process mean (to ~1e-12: both add in float64)."""

    def make(layer: int):
        def hook(z: Tensor, hook: Any) -> Tensor:
            return z * keep[layer].to(z.device, z.dtype)[None, None, :, None]

        return hook

    require_head_ablation(model)
    hooks = [
        (attn_hook(layer, "z"), make(layer)) for layer in range(model.spec.n_layers) if not bool(keep[layer].all())
    ]
    if distributed.active():
        n = data.tokens.shape[0]
        tokens = data.tokens[distributed.batch_slice(n)].to(model.device)
        total = torch.zeros(1, dtype=torch.float64)
        if len(tokens):
            total += scored_loss(model.forward(tokens, fwd_hooks=hooks), tokens, data.first).double().sum().cpu()
        return float(distributed.all_reduce_sum(total) / n)
    tokens = data.tokens.to(model.device)  # the mean in float64, as the ranks' sums above
    return float(scored_loss(model.forward(tokens, fwd_hooks=hooks), tokens, data.first).double().mean())


L0_BATCH = 4
"""Sequences per Adam step of the L0 gates (:func:`l0_pruning`'s ``batch_size``)."""
IMPORTANCE_WORK = "prune's gradient importance"
"""How the memory plan names Michel et al.'s importance (header and refusal)."""


def memory_plan(
    model: LoadedModel,
    methods: Sequence[str],
    score: tuple[int, int],
    evals: Mapping[str, tuple[int, int]],
    save_pruned: bool = False,
    per_layer: bool = False,
) -> memory.BatchPlan:
    """The working memory of a pruning run's largest step: the gradient importance (``michel`` in
    ``methods``: the ``score = (batch, seq_len)`` sequences forward and backward in chunks of as many
    as fit: :func:`~headprobe.analyses.ablation.importance_plan`, the plan of ablate's gradient scores),
    an L0 gates' step (``l0``: :data:`L0_BATCH` of them), each held-out loss (``evals``: name ->
    ``(batch, seq_len)``, one forward with logits at every position,
    :func:`~headprobe.probe.layout.cost.forward_sequence_bytes`), with ``per_layer`` the per-layer
    table's ablations of the ``natural`` set (at least one set a pass, as
    :func:`~headprobe.analyses.ablation.set_plan`) and, with ``save_pruned``, the
    pruned model's check (three more copies of the weights at most: the pruned model, its reloaded
    copy and the state dict read for it; four float32 logits tensors on the ``natural`` set). Each step is planned (:func:`headprobe.probe.core.memory.plan`, its whole
    batch at once but the gradient importance's, one sequence of which must fit); the plan of the
    largest total is returned.

    Raises:
        HeadprobeError: a step that does not fit in the memory budget (one line, before any allocation).
    """
    spec, e = model.spec, model.dtype.itemsize

    def fwd(t: int) -> int:
        return spec.forward_sequence_bytes(t, e)

    plans = [importance_plan(model, *score, work=IMPORTANCE_WORK)] if "michel" in methods else []
    steps = []  # (what, bytes a sequence, sequences, bytes kept)
    b, t = score
    if "l0" in methods:
        n = min(b, L0_BATCH)
        backward = spec.backward_sequence_bytes(t, e)
        steps.append((f"prune's L0 gates ({n} x {t} tokens, forward and backward)", backward, n, 0))
    for name, (b, t) in evals.items():
        steps.append((f"prune's held-out {name} loss ({b} x {t} tokens)", fwd(t), b, 0))
    if per_layer:
        b, t = evals["natural"]
        per = spec.forward_sequence_bytes(t, e, streams=1)
        steps.append((f"prune's per-layer table ({b} x {t} tokens a set)", per, b, 0))
    if save_pruned:
        b, t = evals["natural"]
        weights = 3 * model.n_params * e  # the pruned copy, its reloaded copy and the state dict read for it
        logits = 4 * 4 * t * spec.d_vocab  # both models' logits, their difference and its absolute value
        steps.append((f"the pruned model's check ({b} x {t} tokens)", fwd(t) + logits, b, weights))
    plans += [memory.plan(per, model.device, need, what, kept, cap=need) for what, per, need, kept in steps]
    return max(plans, key=lambda p: p.total)


@dataclass
class PruningRun:
    """One pruning curve.

    Attributes:
        order: ``importance`` or ``random``.
        rows: one dict per step: ``order, step, n_pruned, fraction_pruned, <set>_loss`` for each
            evaluation set (nats/token), ``removed`` (heads removed at this step, ``layer.head``),
            and for ``importance`` ``margin`` (:func:`cut_margin`; NaN at step 0).
        removal_order: every removed head, in the order removed.
    """

    order: str
    rows: list[dict] = field(default_factory=list)
    removal_order: list[Head] = field(default_factory=list)

    def keep_mask_after(self, n_pruned: int, n_layers: int, n_heads: int) -> Bool[Tensor, "layer head"]:
        """The keep mask once the first ``n_pruned`` heads of :attr:`removal_order` are removed."""
        keep = torch.ones(n_layers, n_heads, dtype=torch.bool)
        for layer, head in self.removal_order[:n_pruned]:
            keep[layer, head] = False
        return keep


def iterative_pruning(
    model: LoadedModel,
    score_set: LossSet,
    eval_sets: Mapping[str, LossSet],
    order: str = "importance",
    step_fraction: int | float = 0.1,
    rescore: bool = True,
    normalize: bool = True,
    max_fraction: float = 1.0,
    seed: int = 0,
    progress: bool = False,
    resume: dict | None = None,
    on_step: Callable[[dict], None] | None = None,
    max_batch: int | None = None,
) -> PruningRun:
    """Prune heads in steps, recording the loss on ``eval_sets`` before pruning and after each step.

    Args:
        model: a LoadedModel (either backend).
        score_set: where the gradient importance is measured (``order="importance"``).
        eval_sets: name -> held-out set; each gives a ``<name>_loss`` column.
        order: ``importance`` (lowest first, Michel et al.) or ``random`` (seeded baseline).
        step_fraction: fraction of all heads removed per step (the paper: 0.1); of every head present (:func:`present_heads`).
        rescore: recompute importance at the current mask after each step (else once, as in the paper).
        normalize: rank by ``I_h`` / its layer's l2 norm (Michel et al. §4.1); False: raw ``I_h`` (as ``ablate``).
        max_fraction: stop once this fraction of heads is removed.
        resume: a state ``on_step`` (called after each step with the JSON-serialisable state) gave: go on from it.
        max_batch: sequences per gradient pass (None: all at once; :func:`~headprobe.analyses.ablation.importance_plan` sizes it).

    Raises:
        HeadprobeError: ``order`` unknown, a fraction outside (0, 1], or no head left to prune.
    """
    _check_pruning_args(order, step_fraction, max_fraction)
    keep = present_heads(model)
    n_present = int(keep.sum())
    per_step, n_max, _ = step_plan(n_present, step_fraction, max_fraction)
    run = PruningRun(order)
    random_order = _random_order(keep, seed)
    scores = _resume_pruning(run, keep, resume) if resume else None

    def state() -> dict:
        return {
            "rows": run.rows,
            "removal_order": [list(h) for h in run.removal_order],
            "scores": None if scores is None else scores.tolist(),
        }

    def record(step: int, removed: list[Head], margin: float = float("nan")) -> None:
        run.rows.append(_pruning_row(model, eval_sets, keep, n_present, order, step, removed))
        if order == "importance":
            run.rows[-1]["margin"] = margin

    if not run.rows:
        record(0, [])
        if on_step:
            on_step(state())
    steps = range(len(run.rows), (n_max + per_step - 1) // per_step + 1)
    if progress:
        from headprobe.probe.core.progress import progress_bar

        steps = progress_bar(steps, desc=f"pruning ({'michel' if order == 'importance' else order})", unit="step")
    for step in steps:
        n_now = min(per_step, n_max - len(run.removal_order))
        if order == "random":
            flat, margin = random_order[len(run.removal_order) : len(run.removal_order) + n_now], float("nan")
        else:
            if scores is None or rescore:
                scores = head_importance(
                    model, score_set.tokens, score_set.first, head_mask=keep, normalize=normalize, max_batch=max_batch
                ).importance.clone()
            flat, margin = least_important_cut(scores, keep, n_now)
        removed = [(i // model.spec.n_heads, i % model.spec.n_heads) for i in flat]
        for layer, head in removed:
            keep[layer, head] = 0.0
        run.removal_order += removed
        record(step, removed, margin)
        if on_step:
            on_step(state())
    return run


def step_plan(n_present: int, step_fraction: float, max_fraction: float) -> tuple[int, int, int]:
    """``(heads per step, heads removed at the end, steps)`` of :func:`iterative_pruning` over
    ``n_present`` heads: ``round(step_fraction n)`` a step (at least 1), up to ``round(max_fraction n)``."""
    per_step = max(1, round(step_fraction * n_present))
    n_max = min(n_present, round(max_fraction * n_present))
    return per_step, n_max, -(-n_max // per_step)


def _check_pruning_args(order: str, step_fraction: float, max_fraction: float) -> None:
    """Refuse :func:`iterative_pruning`'s arguments where ``order`` is unknown or a fraction outside (0, 1].

    Raises:
        HeadprobeError: as described.
    """
    if order not in ORDERS:
        raise HeadprobeError(
            f"unknown pruning order {order!r}{did_you_mean(str(order), ORDERS)}; expected one of {ORDERS}"
        )
    if not 0 < step_fraction <= 1 or not 0 < max_fraction <= 1:
        raise HeadprobeError(f"step fraction {step_fraction} and max fraction {max_fraction} must be in (0, 1]")


def _random_order(present: Tensor, seed: int) -> list[int]:
    """The random baseline's order: one seeded permutation of every head's flat index
    (``layer * n_heads + head``), the heads not ``present`` left out."""
    flat = present.flatten()
    return [i for i in torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(seed)).tolist() if flat[i]]


def _resume_pruning(run: PruningRun, keep: Tensor, resume: dict) -> Tensor | None:
    """Restore :func:`iterative_pruning`'s ``run`` (rows, removal order) and ``keep`` mask (in place)
    from a saved state; the saved importance scores, or None."""
    run.rows = [dict(r) for r in resume["rows"]]
    run.removal_order = [tuple(h) for h in resume["removal_order"]]
    for layer, head in run.removal_order:
        keep[layer, head] = 0.0
    return None if resume.get("scores") is None else torch.tensor(resume["scores"])


def _pruning_row(
    model: LoadedModel,
    eval_sets: Mapping[str, LossSet],
    keep: Tensor,
    n_present: int,
    order: str,
    step: int,
    removed: list[Head],
) -> dict:
    """One curve row of :func:`iterative_pruning`: the held-out losses (nats/token) with the heads
    of ``keep`` (1 kept, 0 removed), the heads removed so far (``n_pruned``, of the ``n_present``
    heads the model had) and the heads removed at this step."""
    n = n_present - int(keep.sum())
    row = {"order": order, "step": step, "n_pruned": n, "fraction_pruned": n / n_present}
    for name, data in eval_sets.items():
        row[f"{name}_loss"] = masked_loss(model, data, keep)
    row["removed"] = " ".join(format_head(h) for h in removed)
    return row


def least_important_cut(scores: Tensor, keep: Tensor, n: int) -> tuple[list[int], float]:
    """The ``n`` kept heads (``keep`` nonzero) of lowest ``scores`` and how far that cut is from a tie.

    Returns:
        The heads' flat indices (``layer * n_heads + head``), lowest score first, ties in head
        order (one stable sort on the host, in float64: the same cut on every device); and the
        margin: the score of the least important head kept minus that of the most important head
        removed (units of ``scores``; NaN when no head is left kept). Near 0, a rounding difference
        (another device, dtype or thread count) can swap the two heads and part the orders.
    """
    flat = scores.detach().flatten().cpu().double()
    kept = (keep.flatten().cpu() != 0).nonzero().flatten()
    values, order = flat[kept].sort(stable=True)
    margin = float(values[n] - values[n - 1]) if 0 < n < len(values) else float("nan")
    return kept[order[:n]].tolist(), margin


TIMING_PAIRS = 7
"""Interleaved pairs of forwards :func:`paired_speedup` times (after one warm-up of each)."""


def paired_speedup(slow: Callable[[], Any], fast: Callable[[], Any], pairs: int = TIMING_PAIRS, clock=None) -> dict:
    """How much faster ``fast`` runs than ``slow``, timed in ``pairs`` interleaved pairs (which goes
    first alternates), so that a change of the machine's load between two blocks of runs (a shared
    CPU) does not land on one of them alone: ``{"slow_s", "fast_s"`` (median seconds of each),
    ``"speedup"`` (``slow_s / fast_s``), ``"speedup_range"`` (the pairs' least and most ``slow /
    fast``), ``"pairs"}``. ``clock``: seconds (default ``time.perf_counter``)."""
    import statistics
    import time

    clock = clock or time.perf_counter

    def seconds(f: Callable[[], Any]) -> float:
        t0 = clock()
        f()
        return clock() - t0

    slow(), fast()  # warm-up
    times = []
    for i in range(pairs):
        if i % 2:
            b = seconds(fast)
            a = seconds(slow)
        else:
            a = seconds(slow)
            b = seconds(fast)
        times.append((a, b))
    ratios = [a / b for a, b in times]
    slow_s, fast_s = statistics.median(a for a, _ in times), statistics.median(b for _, b in times)
    return {
        "slow_s": slow_s,
        "fast_s": fast_s,
        "speedup": slow_s / fast_s,  # of the two medians printed beside it (the pairs' median ratio can differ)
        "speedup_range": [min(ratios), max(ratios)],
        "pairs": pairs,
    }


@torch.inference_mode()
def build_pruned(
    model: LoadedModel,
    keep: Bool[Tensor, "layer head"],
    tokens: Int[Tensor, "batch pos"],
    eval_sets: Mapping[str, LossSet] | None = None,
) -> tuple[Any, dict]:
    """Remove the heads ``keep`` marks False for real (:func:`headprobe.probe.model.pruned.remove_heads`),
    round-trip the result through a saved model directory, compare it with the masked model and
    measure the saved model's own losses.

    Args:
        model: a LoadedModel whose heads can be removed (:meth:`~headprobe.probe.backends.base.LoadedModel.check_prunable`).
        keep: True for the heads kept; a pruned checkpoint's removed heads (:func:`present_heads`)
            are removed whatever it says.
        tokens: the input the two are compared and timed on.
        eval_sets: name -> set the reloaded small model's loss is measured on (``loss``), e.g. a
            pruning curve's held-out sets; None: no loss.

    Returns:
        (pruned, info): the pruned :class:`~headprobe.probe.model.transformer.Transformer` and
        ``{"heads_removed", "fraction_removed"`` (of the heads ``model`` has), ``"heads_already_removed"``
        (by a pruned checkpoint, before), ``"kv_heads_removed", "attention_parameters": {"full"``
        (``model``'s, a pruned checkpoint's without its removed heads), ``"pruned"}, "max_abs_logit_diff_vs_masked",
        "forward_s": {"masked", "pruned"} (median seconds per forward), "speedup"`` (the ratio of
        the two medians of :func:`paired_speedup`'s interleaved pairs) ``, "speedup_range", "timing_pairs", "tokens",
        "bytes"`` (size of the saved weights and config, :func:`headprobe.probe.model.pruned.save_pruned_dir`,
        without the tokenizer) ``, "loss": {name: nats/token}}`` (with ``eval_sets``).

    Raises:
        HeadprobeError: the model's heads cannot be removed exactly (not native, MLA, all-head
            QK-norm), or ``keep`` has the wrong shape.
    """
    import tempfile
    from pathlib import Path

    from headprobe.probe.model.pruned import load_pruned_dir, save_pruned_dir

    present = present_heads(model).bool()
    keep = keep.bool().cpu() & present
    pruned = model.remove_heads(keep)
    with tempfile.TemporaryDirectory() as tmp:
        save_pruned_dir(pruned, Path(tmp))
        size = sum(f.stat().st_size for f in Path(tmp).iterdir())
        reloaded = load_pruned_dir(Path(tmp), model.device).to(model.dtype)
    tokens = tokens.to(model.device)
    mask = keep.to(model.device, model.dtype)
    masked_logits = model.forward(tokens, head_mask=mask)
    diff = float((reloaded(tokens).float() - masked_logits.float()).abs().max())
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)

    def synced(f):
        def g():
            f()
            sync()

        return g

    timing = paired_speedup(synced(lambda: model.forward(tokens, head_mask=mask)), synced(lambda: reloaded(tokens)))
    return pruned, {
        **_removal_counts(model, present, keep, pruned),
        "max_abs_logit_diff_vs_masked": diff,
        "forward_s": {"masked": timing["slow_s"], "pruned": timing["fast_s"]},
        "speedup": timing["speedup"],
        "speedup_range": timing["speedup_range"],
        "timing_pairs": timing["pairs"],
        "tokens": list(tokens.shape),
        "bytes": size,
        **({} if eval_sets is None else {"loss": _own_losses(reloaded, eval_sets)}),
    }


def _removal_counts(model: LoadedModel, present: Tensor, keep: Tensor, pruned: Any) -> dict:
    """:func:`build_pruned`'s counts: heads and key/value heads removed from the ``present`` ones
    (``keep`` False), the heads a pruned checkpoint had removed before, and the attention
    parameters of ``model`` (without those heads) and of ``pruned``."""
    from headprobe.probe.model.pruned import count_attention_parameters, count_kv_heads

    spec = model.spec
    n_present, n = int(present.sum()), int((present & ~keep).sum())
    full = model.attention_parameters()
    kv_present = spec.n_layers * spec.n_kv_heads
    if n_present < present.numel():  # a pruned checkpoint: its removed heads' zero weights are not its own
        before = model.remove_heads(present)
        full, kv_present = count_attention_parameters(before), count_kv_heads(before)
    return {
        "heads_removed": n,
        "fraction_removed": n / n_present,
        "heads_already_removed": present.numel() - n_present,
        "kv_heads_removed": kv_present - count_kv_heads(pruned),
        "attention_parameters": {"full": full, "pruned": count_attention_parameters(pruned)},
    }


def _own_losses(net: Any, eval_sets: Mapping[str, LossSet]) -> dict[str, float]:
    """The mean scored loss (nats/token, float64 mean as :func:`masked_loss`) of the native
    Transformer ``net`` on each set, run on its own (no hooks, no mask)."""
    device = next(net.parameters()).device
    out = {}
    for name, data in eval_sets.items():
        tokens = data.tokens.to(device)
        out[name] = float(scored_loss(net(tokens), tokens, data.first).double().mean())
    return out


# --- Voita et al. 2019: L0 head gates (Hard Concrete, Louizos et al. 2018) ---------------------------

HC_BETA, HC_GAMMA, HC_ZETA = 2 / 3, -0.1, 1.1
"""The Hard Concrete distribution's temperature and stretch interval (Louizos et al. 2018,
section 4; the values Voita et al. 2019 use)."""


def hard_concrete_sample(log_alpha: Tensor, u: Tensor) -> Tensor:
    """Gate values in [0, 1] from uniform noise ``u`` (same shape as ``log_alpha``): ``s =
    sigmoid((log u - log(1-u) + log_alpha) / beta)``, stretched to (gamma, zeta) and clamped
    (Louizos et al. 2018, eq. 10). Differentiable in ``log_alpha``."""
    s = torch.sigmoid((torch.log(u) - torch.log1p(-u) + log_alpha) / HC_BETA)
    return (s * (HC_ZETA - HC_GAMMA) + HC_GAMMA).clamp(0.0, 1.0)


def expected_open(log_alpha: Tensor) -> Tensor:
    """``P(gate > 0)`` per gate, ``sigmoid(log_alpha - beta log(-gamma / zeta))`` (Louizos et al.
    2018, eq. 12): the expected L0 norm is its sum."""
    return torch.sigmoid(log_alpha - HC_BETA * torch.log(torch.tensor(-HC_GAMMA / HC_ZETA)))


def _gated_loss(model: LoadedModel, data: LossSet, gates: Float[Tensor, "layer head"]) -> Tensor:
    """Mean scored loss (nats/token) with each head's z multiplied by its gate (a hook at
    ``hook_z``), differentiable in ``gates``."""

    def make(layer: int):
        def hook(z: Tensor, hook: Any) -> Tensor:
            return z * gates[layer].to(z.dtype)[None, None, :, None]

        return hook

    hooks = [(attn_hook(layer, "z"), make(layer)) for layer in range(model.spec.n_layers)]
    tokens = data.tokens.to(model.device)
    return scored_loss(model.forward(tokens, fwd_hooks=hooks), tokens, data.first).float().mean()


def l0_pruning(
    model: LoadedModel,
    train_set: LossSet,
    eval_sets: Mapping[str, LossSet],
    lambdas: tuple[float, ...] = (0.1, 0.3, 1.0, 3.0, 10.0),
    steps: int = 30,
    lr: float = 0.1,
    init: float = 1.0,
    batch_size: int = L0_BATCH,
    seed: int = 0,
    progress: bool = False,
    resume: dict | None = None,
    on_step: Callable[[dict], None] | None = None,
) -> PruningRun:
    """Voita et al. 2019's head gates, one curve point per penalty weight.

    One gate per head, ``g = HardConcrete(log_alpha)`` (:func:`hard_concrete_sample`), multiplies
    the head's ``z`` at ``hook_z``; the model is frozen and only ``log_alpha`` ``[layer, head]``
    (initialised to ``init``: gates open) is trained, by Adam, on ``task loss + lam * E[open
    gates] / n_heads_total`` (:func:`expected_open`; ``lam`` is in nats per whole model's heads,
    so one sweep suits models of any size; Voita et al. write ``lam * L0`` with the count). The
    sweep is a continuation: ``lambdas`` in increasing order, each starting from the gates the
    previous one left, ``steps`` Adam steps each on minibatches of ``batch_size`` sequences of
    ``train_set`` (the Hard Concrete noise and the minibatches drawn from ``seed``). After each
    ``lam`` the heads whose deterministic gate is above 1/2 (``log_alpha > 0``) are kept, the
    others removed, and the held-out losses are those of that binary mask (z multiplied by 1 or
    0, as for the other methods). Row 0 is the unpruned model. On a pruned checkpoint the gates,
    the penalty and the counts are those of the heads it has (:func:`present_heads`): ``n_heads_total``
    is their number, and a removed head's gate stays shut and is never counted.

    Args:
        model: a LoadedModel (either backend); its parameters are not changed.
        train_set: where the gates are trained (the task loss).
        eval_sets: name -> held-out set; each gives a ``<name>_loss`` column.
        resume, on_step: as :func:`iterative_pruning` (one step is one ``lam``).

    Returns:
        a :class:`PruningRun` with ``order="l0"``; rows also hold ``lambda`` and
        ``expected_open`` (the expected number of open gates); :attr:`PruningRun.removal_order`
        lists heads by the ``lam`` at which they were first removed (ties by the gate's
        ``log_alpha``, lowest first).

    Raises:
        HeadprobeError: a negative or unsorted ``lambdas``, ``steps`` or ``batch_size`` below 1.
    """
    lambdas = _check_l0_args(lambdas, steps, batch_size)
    require_head_ablation(model)
    present = present_heads(model)
    run, log_alpha, gen, opt_state = _l0_start(model, init, seed, resume)
    log_alpha = log_alpha.to(model.device).requires_grad_(True)
    opt = _adam(log_alpha, lr, opt_state)

    def finish(step: int, lam: float | None, removed: list[Head]) -> None:
        run.rows.append(_l0_row(model, eval_sets, log_alpha, present, step, lam, removed))
        if on_step:
            on_step(_l0_state(run, log_alpha, gen, opt))

    if not run.rows:
        with torch.no_grad():
            log_alpha.fill_(float(init))
        finish(0, None, [])
    todo = list(enumerate(lambdas, start=1))[len(run.rows) - 1 :]
    bar = None
    if progress:
        from headprobe.probe.core.progress import progress_bar

        bar = progress_bar(total=len(todo) * steps, desc="pruning (l0 gates)", unit="step")
    for step, lam in todo:
        for _ in range(steps):
            _l0_step(model, train_set, log_alpha, present, opt, gen, lam, batch_size)
            if bar is not None:
                bar.update(1)
        newly = _newly_closed(log_alpha, set(run.removal_order), present)
        run.removal_order += newly
        finish(step, lam, newly)
    if bar is not None:
        bar.close()
    return run


def _check_l0_args(lambdas: tuple[float, ...], steps: int, batch_size: int) -> tuple[float, ...]:
    """:func:`l0_pruning`'s ``lambdas`` as floats, once they and ``steps`` and ``batch_size`` are checked.

    Raises:
        HeadprobeError: a negative or unsorted (or empty) ``lambdas``, ``steps`` or ``batch_size`` below 1.
    """
    lambdas = tuple(float(x) for x in lambdas)
    if not lambdas or any(x < 0 for x in lambdas) or list(lambdas) != sorted(lambdas):
        raise HeadprobeError(f"L0 penalties must be non-negative and increasing, got {lambdas}")
    if steps < 1 or batch_size < 1:
        raise HeadprobeError(f"L0 steps ({steps}) and batch size ({batch_size}) must be at least 1")
    return lambdas


def _l0_start(
    model: LoadedModel, init: float, seed: int, resume: dict | None
) -> tuple[PruningRun, Tensor, torch.Generator, dict | None]:
    """:func:`l0_pruning`'s starting point: the run, the gates' ``log_alpha`` (on the CPU), the noise
    generator and Adam's saved state; fresh (gates at ``init``, generator from ``seed``, no Adam state)
    or restored from ``resume`` (:func:`_l0_state`)."""
    spec = model.spec
    gen = torch.Generator().manual_seed(seed)
    log_alpha = torch.full((spec.n_layers, spec.n_heads), float(init))
    run = PruningRun("l0")
    opt_state = None
    if resume:
        run.rows = [dict(r) for r in resume["rows"]]
        run.removal_order = [tuple(h) for h in resume["removal_order"]]
        log_alpha = torch.tensor(resume["log_alpha"])
        gen.set_state(torch.tensor(resume["rng"], dtype=torch.uint8))
        opt_state = resume.get("adam")
    return run, log_alpha, gen, opt_state


def _adam(log_alpha: Tensor, lr: float, saved: dict | None) -> torch.optim.Adam:
    """:func:`l0_pruning`'s optimiser over ``log_alpha``, with the moments and step count of
    ``saved`` (:func:`_l0_state`'s ``"adam"``) when resuming."""
    opt = torch.optim.Adam([log_alpha], lr=lr)
    if saved is not None:
        opt.load_state_dict(
            {
                "state": {0: {k: torch.tensor(v) if k != "step" else torch.tensor(float(v)) for k, v in saved.items()}},
                "param_groups": opt.state_dict()["param_groups"],
            }
        )
    return opt


def _l0_state(run: PruningRun, log_alpha: Tensor, gen: torch.Generator, opt: torch.optim.Adam) -> dict:
    """Everything :func:`l0_pruning` needs to resume (JSON-ready): rows, removal order, gates,
    the noise generator's state and Adam's."""
    st = opt.state_dict()["state"].get(0)
    return {
        "rows": run.rows,
        "removal_order": [list(h) for h in run.removal_order],
        "log_alpha": log_alpha.detach().cpu().tolist(),
        "rng": gen.get_state().tolist(),
        "adam": None if st is None else {k: (float(v) if k == "step" else v.cpu().tolist()) for k, v in st.items()},
    }


def _l0_row(
    model: LoadedModel,
    eval_sets: Mapping[str, LossSet],
    log_alpha: Tensor,
    present: Tensor,
    step: int,
    lam: float | None,
    removed: list[Head],
) -> dict:
    """One curve row of :func:`l0_pruning`: the held-out losses (nats/token) with the heads whose
    gate is closed (``log_alpha <= 0``) removed, counted among the ``present`` heads (1 present, 0
    removed from a pruned checkpoint: never counted), the penalty ``lam`` and the expected number of
    open gates of the present heads."""
    keep = (log_alpha.detach() > 0).float().cpu() * present
    n_present = int(present.sum())
    n = n_present - int(keep.sum())
    row = {"order": "l0", "step": step, "n_pruned": n, "fraction_pruned": n / n_present}
    for name, data in eval_sets.items():
        row[f"{name}_loss"] = masked_loss(model, data, keep)
    row["lambda"] = lam
    row["expected_open"] = float((expected_open(log_alpha.detach()).cpu() * present).sum())
    row["removed"] = " ".join(format_head(h) for h in removed)
    return row


def _l0_step(
    model: LoadedModel,
    train_set: LossSet,
    log_alpha: Tensor,
    present: Tensor,
    opt: torch.optim.Adam,
    gen: torch.Generator,
    lam: float,
    batch_size: int,
) -> None:
    """One Adam step of :func:`l0_pruning` on ``task loss + lam * E[open gates] / n_heads``, the
    gates and heads those of the ``present`` heads (1 present, 0 removed from a pruned checkpoint),
    on ``batch_size`` sequences of ``train_set`` and one Hard Concrete sample (both drawn from
    ``gen``); only ``log_alpha`` gets a gradient."""
    rows = torch.randperm(train_set.tokens.shape[0], generator=gen)[:batch_size]
    u = torch.rand(log_alpha.shape, generator=gen).clamp(1e-6, 1 - 1e-6).to(model.device)
    on = present.to(log_alpha.device)
    with torch.inference_mode(False), torch.enable_grad():
        gates = hard_concrete_sample(log_alpha, u) * on
        loss = _gated_loss(model, LossSet(train_set.tokens[rows], train_set.first), gates)
        total = loss + lam * (expected_open(log_alpha) * on).sum() / on.sum()
        (log_alpha.grad,) = torch.autograd.grad(total, [log_alpha])  # the model's weights get no gradient
    opt.step()


def _newly_closed(log_alpha: Tensor, before: set[Head], present: Tensor) -> list[Head]:
    """The ``present`` heads (nonzero) whose gate is closed (``log_alpha <= 0``) and not in
    ``before``, lowest ``log_alpha`` first."""
    la = log_alpha.detach().cpu()
    n_layers, n_heads = la.shape
    closed = ~(la > 0) & (present != 0)
    return sorted(
        ((l, h) for l in range(n_layers) for h in range(n_heads) if closed[l, h] and (l, h) not in before),
        key=lambda lh: float(la[lh]),
    )


def curve_auc(fraction: Any, loss: Any, upto: float) -> float:
    """Area under a pruning curve, loss (nats/token) against the fraction of heads removed, from
    0 to ``upto`` (trapezoids; the curve linearly interpolated at ``upto``), divided by ``upto``:
    the mean loss over that range (nats/token; lower is better). Points are sorted by fraction.

    Raises:
        HeadprobeError: ``upto`` outside (0, 1] or beyond the curve's reach, or a curve not starting at 0.
    """
    import numpy as np

    f, y = np.asarray(fraction, dtype=float), np.asarray(loss, dtype=float)
    order = np.argsort(f, kind="stable")
    f, y = f[order], y[order]
    if not 0 < upto <= 1 or f[0] > 0 or f[-1] < upto - 1e-12:
        raise HeadprobeError(f"cannot integrate a curve over [0, {upto}] reaching [{f[0]}, {f[-1]}]")
    inside = f < upto
    xs = np.append(f[inside], upto)
    ys = np.append(y[inside], np.interp(upto, f, y))
    return float(np.trapezoid(ys, xs) / upto)


def cross_fit_pick(losses: Float[Tensor, "candidate window"], worst: bool = False) -> tuple[float, list[int]]:
    """The loss of the lowest-loss candidate (``worst``: highest) scored on windows it was not picked on.

    The windows are split in two halves (the first ``ceil(n / 2)`` and the rest); the candidate
    picked on each half's mean loss is scored on the other half, and the two held-out scores are
    averaged window by window (cross-fitting). Picking and scoring on the same windows would
    favour the pick (selection bias): for candidates of equal true loss, the same-window minimum
    is below their common mean, the held-out one is not on average.

    Args:
        losses: ``[candidate, window]`` per-window losses (nats/token), at least 2 windows.

    Returns:
        ``(loss, [pick on the first half, pick on the second half])`` (candidate indices).

    Raises:
        HeadprobeError: fewer than 2 windows.
    """
    n = losses.shape[1]
    if n < 2:
        raise HeadprobeError(f"picking a head on half the windows and scoring it on the other needs 2 windows, got {n}")
    halves = (torch.arange(n) < (n + 1) // 2).to(losses.device)
    scored, picks = [], []
    for fit in (halves, ~halves):
        means = losses[:, fit].mean(dim=1)
        pick = int(means.argmax() if worst else means.argmin())
        picks.append(pick)
        scored.append(losses[pick, ~fit])
    return float(torch.cat(scored).mean()), picks


@torch.inference_mode()
def per_layer_best_head(model: LoadedModel, data: LossSet, progress: bool = False) -> list[dict]:
    """Michel et al. 2019 (section 3.3, Tables 2 and 3): each layer reduced to one head, the other
    layers intact. For every layer and head, the loss with every *other* head of that layer
    zero-ablated (at ``hook_z``; :func:`headprobe.analyses.ablation.set_ablation_losses`; under
    ``torchrun`` the sets are sharded over the ranks); the best head is the one with the lowest loss.
    A pruned checkpoint's removed heads (:func:`present_heads`) are never the head kept.

    The best and worst one-head losses are held out (:func:`cross_fit_pick`): the head is picked on
    one half of ``data``'s windows and its loss taken on the other, both ways, so the pick does not
    flatter its own loss; ``best_head`` is the pick on all windows.

    Returns:
        one dict per layer: ``layer, best_head, loss_best_only, loss_worst_only`` (held out),
        ``loss_layer_ablated`` (the whole layer's heads ablated), ``clean_loss``, ``delta_best_only``
        (``loss_best_only - clean_loss``), all nats/token on ``data``, and ``best_head_halves_agree``
        (both halves picked ``best_head``); a layer without a head left: ``best_head`` None and NaN
        for the one-head losses.

    Raises:
        HeadprobeError: ``data`` of fewer than 2 windows.
    """
    from headprobe.analyses.ablation import set_ablation_losses

    spec = model.spec
    if data.tokens.shape[0] < 2:
        raise HeadprobeError(f"--per-layer needs at least 2 held-out windows (--n-natural), got {data.tokens.shape[0]}")
    present = present_heads(model)
    kept = [[h for h in range(spec.n_heads) if present[layer, h]] for layer in range(spec.n_layers)]
    sets = []
    for layer in range(spec.n_layers):
        sets += [[(layer, o) for o in range(spec.n_heads) if o != h] for h in kept[layer]]
        sets.append([(layer, o) for o in range(spec.n_heads)])
    sets.append([])
    per_window = distributed.map_sharded(  # under torchrun: each rank ablates its slice of the sets
        lambda part: set_ablation_losses(
            model, data.tokens, part, "zero", None, data.first, progress=progress, desc="one head per layer"
        ),
        sets,
    )  # [set, window]
    losses = per_window.mean(dim=1)
    clean = float(losses[-1])
    out, at = [], 0
    for layer in range(spec.n_layers):
        one, at = per_window[at : at + len(kept[layer])], at + len(kept[layer]) + 1
        best = int(one.mean(dim=1).argmin()) if len(one) else None
        loss_best, picks = cross_fit_pick(one) if len(one) else (float("nan"), [])
        out.append(
            {
                "layer": layer,
                "best_head": kept[layer][best] if best is not None else None,
                "loss_best_only": loss_best,
                "loss_worst_only": cross_fit_pick(one, worst=True)[0] if len(one) else float("nan"),
                "loss_layer_ablated": float(losses[at - 1]),
                "clean_loss": clean,
                "delta_best_only": loss_best - clean,
                "best_head_halves_agree": best is not None and picks == [best, best],
            }
        )
    return out
