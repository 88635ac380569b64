"""Iterative head pruning (Michel, Levy, Neubig 2019, "Are Sixteen Heads Really Better than
One?", arXiv 1905.10650) with a random-order baseline.

At each step the ``step_fraction`` of *all* heads (default 10%) with the lowest importance among
the heads still present is removed; the importance is Michel et al.'s gradient score
``I_h = E_x |dL(x)/dxi_h|`` (:func:`headprobe.analyses.ablation.head_importance`) on a scoring set, taken
at the current head mask after every step (``rescore``) or once before pruning (as in the
paper). After every step the loss on held-out sets is recorded. The random baseline removes the
heads in one seeded random order, in the same steps. Removal here is by the head mask (z_h
multiplied by 0); :mod:`headprobe.probe.pruned` turns a mask into a model without those weights.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from headprobe.analyses.ablation import head_importance, require_head_ablation, scored_loss
from headprobe.probe.backend import Backend
from headprobe.probe.errors import HeadprobeError
from headprobe.probe.hooks import Head, attn_hook, format_head

ORDERS = ("importance", "random")


@dataclass(frozen=True)
class LossSet:
    """Tokens to evaluate (or score) on and the first scored prediction (see
    :func:`headprobe.analyses.ablation.first_scored`)."""

    tokens: Int[Tensor, "batch pos"]
    first: int = 0


@torch.inference_mode()
def masked_loss(model: Any, data: LossSet, keep: Float[Tensor, "layer head"]) -> float:
    """Mean scored loss (nats/token) with each head's z multiplied by ``keep[layer, head]``
    (a hook at ``hook_z``; either backend)."""

    def make(layer: int):
        def hook(z: Tensor, hook: Any) -> Tensor:
            return z * keep[layer].to(z.device, z.dtype)[None, None, :, None]
        return hook

    require_head_ablation(model)
    hooks = [(attn_hook(layer, "z"), make(layer)) for layer in range(model.spec.n_layers) if not bool(keep[layer].all())]
    tokens = data.tokens.to(model.device)
    return float(scored_loss(model.forward(tokens, fwd_hooks=hooks), tokens, data.first).mean())


@dataclass
class PruningRun:
    """One pruning curve.

    Attributes:
        order: ``importance`` or ``random``.
        rows: one dict per step: ``order, step, n_pruned, fraction_pruned, <set>_loss`` for each
            evaluation set (nats/token), ``removed`` (heads removed at this step, ``layer.head``).
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


def iterative_pruning(model: Any, score_set: LossSet, eval_sets: Mapping[str, LossSet], order: str = "importance",
                      step_fraction: int | float = 0.1, rescore: bool = True, normalize: bool = True,
                      max_fraction: float = 1.0, seed: int = 0, progress: bool = False,
                      resume: dict | None = None, on_step: Callable[[dict], None] | None = None) -> PruningRun:
    """Prune heads in steps, recording the loss on ``eval_sets`` before pruning and after each step.

    Args:
        model: a LoadedModel (either backend).
        score_set: where the gradient importance is measured (``order="importance"``).
        eval_sets: name -> held-out set; each gives a ``<name>_loss`` column.
        order: ``importance`` (lowest first, Michel et al.) or ``random`` (seeded baseline).
        step_fraction: fraction of all heads removed per step (the paper: 0.1).
        rescore: recompute importance at the current mask after each step (else once, as in the paper).
        normalize: per-layer L2 normalisation of the importance (Michel et al. section 4.2).
        max_fraction: stop once this fraction of heads is removed.
        resume: a state that ``on_step`` handed out earlier; the run continues after its last step.
        on_step: called after every step with the run's state (JSON-serialisable), to checkpoint it.

    Raises:
        HeadprobeError: ``order`` unknown, or a fraction outside (0, 1].
    """
    if order not in ORDERS:
        raise HeadprobeError(f"unknown pruning order {order!r}; expected one of {ORDERS}")
    if not 0 < step_fraction <= 1 or not 0 < max_fraction <= 1:
        raise HeadprobeError(f"step fraction {step_fraction} and max fraction {max_fraction} must be in (0, 1]")
    spec = model.spec
    n_total = spec.n_layers * spec.n_heads
    per_step = max(1, round(step_fraction * n_total))
    n_max = min(n_total, round(max_fraction * n_total))
    keep = torch.ones(spec.n_layers, spec.n_heads)
    run = PruningRun(order)
    random_order = torch.randperm(n_total, generator=torch.Generator().manual_seed(seed)).tolist()
    scores = None
    if resume:
        run.rows = [dict(r) for r in resume["rows"]]
        run.removal_order = [tuple(h) for h in resume["removal_order"]]
        for layer, head in run.removal_order:
            keep[layer, head] = 0.0
        scores = None if resume.get("scores") is None else torch.tensor(resume["scores"])

    def state() -> dict:
        return {"rows": run.rows, "removal_order": [list(h) for h in run.removal_order],
                "scores": None if scores is None else scores.tolist()}

    def record(step: int, removed: list[Head]) -> None:
        n = n_total - int(keep.sum())
        row = {"order": order, "step": step, "n_pruned": n, "fraction_pruned": n / n_total}
        for name, data in eval_sets.items():
            row[f"{name}_loss"] = masked_loss(model, data, keep)
        row["removed"] = " ".join(format_head(h) for h in removed)
        run.rows.append(row)

    if not run.rows:
        record(0, [])
        if on_step:
            on_step(state())
    steps = range(len(run.rows), (n_max + per_step - 1) // per_step + 1)
    if progress:
        from tqdm.auto import tqdm
        steps = tqdm(steps, desc=f"pruning ({order})", unit="step")
    for step in steps:
        n_now = min(per_step, n_max - len(run.removal_order))
        if order == "random":
            flat = random_order[len(run.removal_order): len(run.removal_order) + n_now]
        else:
            if scores is None or rescore:
                scores = head_importance(model, score_set.tokens, score_set.first, head_mask=keep,
                                         normalize=normalize).importance.clone()
            masked = scores.flatten().clone()
            masked[keep.flatten() == 0] = float("inf")
            flat = masked.argsort()[:n_now].tolist()
        removed = [(i // spec.n_heads, i % spec.n_heads) for i in flat]
        for layer, head in removed:
            keep[layer, head] = 0.0
        run.removal_order += removed
        record(step, removed)
        if on_step:
            on_step(state())
    return run


def _median_time(fn, repeats: int = 3) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` after one warm-up call."""
    import statistics
    import time

    fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


@torch.inference_mode()
def build_pruned(model: Backend, keep: Bool[Tensor, "layer head"], tokens: Int[Tensor, "batch pos"]) -> tuple[Any, dict]:
    """Remove the heads ``keep`` marks False for real (:func:`headprobe.probe.pruned.remove_heads`),
    round-trip the result through a saved file, and compare it with the masked model.

    Args:
        model: a LoadedModel whose heads can be removed (:meth:`~headprobe.probe.backend.Backend.check_prunable`).
        keep: True for the heads kept.
        tokens: the input the two are compared and timed on.

    Returns:
        (pruned, info): the pruned :class:`~headprobe.probe.model.Transformer` and
        ``{"heads_removed", "fraction_removed", "kv_heads_removed", "attention_parameters": {"full",
        "pruned"}, "max_abs_logit_diff_vs_masked", "forward_s": {"masked", "pruned"} (median seconds
        per forward), "speedup", "tokens", "bytes"}`` (size of the saved file).

    Raises:
        HeadprobeError: the model's heads cannot be removed exactly (not native, MLA, all-head
            QK-norm), or ``keep`` has the wrong shape.
    """
    import tempfile
    from pathlib import Path

    from headprobe.probe.pruned import count_attention_parameters, count_kv_heads, load_pruned, save_pruned

    spec = model.spec
    n = int((~keep.bool()).sum())
    pruned = model.remove_heads(keep)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "pruned_model.pt"
        save_pruned(pruned, path)
        size = path.stat().st_size
        reloaded = load_pruned(path, model.device).to(model.dtype)
    tokens = tokens.to(model.device)
    mask = keep.to(model.device, model.dtype)
    masked_logits = model.forward(tokens, head_mask=mask)
    diff = float((reloaded(tokens).float() - masked_logits.float()).abs().max())
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)

    def timed(f):
        def g():
            f()
            sync()
        return _median_time(g)

    t_masked = timed(lambda: model.forward(tokens, head_mask=mask))
    t_pruned = timed(lambda: reloaded(tokens))
    return pruned, {
        "heads_removed": n, "fraction_removed": n / (spec.n_layers * spec.n_heads),
        "kv_heads_removed": spec.n_layers * spec.n_kv_heads - count_kv_heads(pruned),
        "attention_parameters": {"full": model.attention_parameters(), "pruned": count_attention_parameters(pruned)},
        "max_abs_logit_diff_vs_masked": diff, "forward_s": {"masked": t_masked, "pruned": t_pruned},
        "speedup": t_masked / t_pruned, "tokens": list(tokens.shape), "bytes": size}
