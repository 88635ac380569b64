"""``headprobe ablate``'s computation: the run, its result and how it is saved (see
:mod:`headprobe.commands.ablate` for the command and its settings). Imports torch, pandas and
matplotlib; the package's ``__init__`` does not, so flags are checked before they load."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from headprobe import options
from headprobe.analyses import figures as figs
from headprobe.analyses.ablation import (
    SweepResult, capture_z, exact_sweep, first_scored, head_importance, mean_z_from, spearman, top_heads,
)
from headprobe.analyses.data import TokenSet, read_text_file, task_tokens
from headprobe.analyses.scoring import score_token_set
from headprobe.probe.capture import kv_head_of
from headprobe.probe.errors import HeadprobeError
from headprobe.commands.ablate import TASKS, AblateConfig
from headprobe.probe.heads import format_head
from headprobe.probe.io import package_versions, prepare_output_dir, write_json, write_text

@dataclass(frozen=True)
class TaskResult:
    """One task's sweep and gradient scores; arrays are ``[layer, head]``, losses in nats/token.

    Attributes:
        clean_loss: the task's loss with no head ablated.
        effect: loss increase from ablating each head alone (NaN where not swept).
        importance: Michel et al.'s gradient importance ``E|dL/dxi_h|``.
        attribution: attribution patching's estimate of each head's effect.
        sweep_s, gradient_s: seconds spent on the sweep and on the gradient scores.
    """

    clean_loss: float
    effect: np.ndarray
    importance: np.ndarray
    attribution: np.ndarray
    sweep_s: float
    gradient_s: float


CHUNK_LAYERS = 5
"""Layers swept between two checkpoints (each chunk costs one extra clean forward pass)."""


def checkpointed_sweep(model, tokens, heads, kind, mean_z, source_tokens, first, max_batch, done: dict, save,
                       desc: str = "ablation sweep", progress: bool = True) -> SweepResult:
    """:func:`~headprobe.analyses.ablation.exact_sweep` in chunks of :data:`CHUNK_LAYERS` layers, recording
    each chunk's losses in ``done`` (``{"clean": float, "loss": {"layer.head": float}}``) and
    calling ``save()`` after it; chunks already in ``done`` are skipped. Every chunk is
    deterministic, so a resumed sweep equals an uninterrupted one."""
    from tqdm.auto import tqdm

    spec = model.spec
    layers = sorted({layer for layer, _ in heads})
    chunks = [[h for h in heads if h[0] in layers[i:i + CHUNK_LAYERS]] for i in range(0, len(layers), CHUNK_LAYERS)]
    for chunk in tqdm(chunks, desc=desc, unit="chunk", disable=not progress):
        if all(format_head(h) in done["loss"] for h in chunk):
            continue
        part = exact_sweep(model, tokens, heads=chunk, kind=kind, mean_z=mean_z, source_tokens=source_tokens,
                           first=first, max_batch=max_batch)
        done["clean"] = part.clean_loss
        done["loss"].update({format_head(h): float(part.loss[h]) for h in chunk})
        save()
    loss = torch.full((spec.n_layers, spec.n_heads), float("nan"))
    for name, value in done["loss"].items():
        layer, head = map(int, name.split("."))
        loss[layer, head] = value
    return SweepResult(done["clean"], loss, kind)


MIN_RANKED_HEADS = 8
"""Fewest swept heads a rank correlation is reported for: over 5 heads a Spearman coefficient of
0.9 arises by chance with probability ~0.04 and is no finding (``--heads 18.6,17.3,...``)."""


def _rank_correlation(a, b) -> float | None:
    """:func:`spearman` over the heads finite in both; None (JSON null, ``n/a`` on screen) when
    fewer than :data:`MIN_RANKED_HEADS` heads were swept, too few to rank."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    return spearman(a, b) if (np.isfinite(a) & np.isfinite(b)).sum() >= MIN_RANKED_HEADS else None


TOP_N = 10


@dataclass
class AblateResult:
    """What ``ablate`` measured (losses in nats/token).

    Attributes:
        config: the settings.
        spec: the model's :class:`~headprobe.probe.loading.ModelSpec`.
        table: head_ablation.csv: one row per head (``layer``, ``head``, ``kv_head``, ``<task>_loss_delta``,
            ``<task>_importance``, ``<task>_attribution``, ``induction_score``).
        tasks: task (``natural``, ``induction``) -> :class:`TaskResult`.
        induction_score: ``[layer, head]`` prefix-matching score on the induction task's tokens.
        natural, repeated: the token sets (natural: both halves).
        device: where the model ran. self_check: the model's load-time self-check.
        run_s: seconds of :func:`run`; load_s: seconds loading the model (set by the caller that loaded it).
    """

    config: AblateConfig
    spec: object
    table: pd.DataFrame
    tasks: dict[str, TaskResult]
    induction_score: np.ndarray
    natural: TokenSet
    repeated: TokenSet
    device: str
    self_check: dict
    run_s: float
    load_s: float = 0.0

    def summary(self) -> dict:
        """summary.json's content (as a dict; package versions included)."""
        cfg, spec, results = self.config, self.spec, self.tasks
        return {
            "model": spec.name, "weights_precision": spec.precision, "dtype": cfg.dtype, "device": self.device,
            "self_check": self.self_check, "ablation": cfg.kind, "units": "nats/token",
            "tokens": {"natural": [cfg.n_natural, int(self.natural.tokens.shape[1])],
                       "induction": list(self.repeated.tokens.shape), "period": cfg.period,
                       "natural_source": self.natural.source},
            "clean_loss": {t: r.clean_loss for t, r in results.items()},
            "top_heads_by_loss_delta": {t: [{"head": format_head(h), "loss_delta": round(float(r.effect[h]), 5)}
                                            for h in top_heads(torch.as_tensor(r.effect), TOP_N)] for t, r in results.items()},
            # importance is unsigned (E|dL/dxi|): compared with the effect's size, and with the signed effect
            "spearman_with_exact_sweep": {t: {
                "gradient_importance_vs_abs_effect": _rank_correlation(r.importance, np.abs(r.effect)),
                "gradient_importance": _rank_correlation(r.importance, r.effect),
                "attribution_patching": _rank_correlation(r.attribution, r.effect)} for t, r in results.items()},
            "top_induction_score_heads": [format_head(h) for h in top_heads(torch.as_tensor(self.induction_score), TOP_N)],
            "spearman_induction_score_vs_induction_loss_delta": _rank_correlation(self.induction_score,
                                                                                  results["induction"].effect),
            "timings_s": {**{f"{t}_sweep": round(r.sweep_s, 2) for t, r in results.items()},
                          **{f"{t}_gradient": round(r.gradient_s, 2) for t, r in results.items()},
                          "total": round(self.run_s + self.load_s, 1)},
            "config": asdict(cfg),
            "versions": package_versions(),
        }

    def figures(self) -> dict[str, object]:
        """``{"ablation_effect": Figure}``: each head's loss increase on both tasks."""
        spec = self.spec
        tag = f"{spec.name} ({figs.weights_label(spec.weights)}), {self.config.kind}-ablated"
        fig = figs.ablation_effect_panels(
            [("natural text", self.tasks["natural"].effect), ("induction (repeated half)", self.tasks["induction"].effect)],
            spec.group_size, f"Loss increase from ablating one head\n{tag}")
        return {"ablation_effect": fig}

    def html(self) -> str:
        """The viewer page (``headprobe view``'s index.html) of this sweep: loss-increase maps and the table."""
        from headprobe.analyses.viewer import build_page

        return build_page(ablation=self.table, ablation_summary=self.summary())

    def _repr_html_(self) -> str:
        """Jupyter shows the viewer page, in a sandboxed iframe."""
        from headprobe.analyses.viewer import notebook_html

        return notebook_html(self.html())

    def save(self, out_dir: str | Path, overwrite: bool = False) -> list[Path]:
        """Write head_ablation.csv, ablation_effect.png/pdf and, last, summary.json into ``out_dir``
        (each atomically; a directory holding only a run checkpoint counts as empty). Returns the paths.

        Raises:
            HeadprobeError: ``out_dir`` is a file, not writable, or holds other files and ``overwrite`` is False.
        """
        out = prepare_output_dir(out_dir, overwrite, resumable=True)
        write_text(out / "head_ablation.csv", self.table.to_csv(index=False, float_format="%.6f"))
        paths = [out / "head_ablation.csv"]
        for stem, fig in self.figures().items():
            paths += figs.save_figure(fig, out / stem)
        write_json(out / "summary.json", self.summary())  # last: a directory with summary.json is complete
        return [*paths, out / "summary.json"]

    def report(self) -> str:
        """The terminal summary: clean losses, top heads per task, rank correlations, timings."""
        s = self.summary()
        t = self.tasks
        lines = [f"clean loss: natural {t['natural'].clean_loss:.3f}, induction {t['induction'].clean_loss:.3f} nats/token"]
        for task in TASKS:
            tops = ", ".join(f"{e['head']} ({e['loss_delta']:+.3f})" for e in s["top_heads_by_loss_delta"][task][:5])
            rho = s["spearman_with_exact_sweep"][task]
            r = {k: "n/a" if v is None else f"{v:.2f}" for k, v in rho.items()}
            lines.append(f"{task:<10} top heads by Δ loss: {tops}; Spearman with exact sweep: importance vs |Δ| "
                         f"{r['gradient_importance_vs_abs_effect']} (signed {r['gradient_importance']}), "
                         f"attribution {r['attribution_patching']}")
        lines.append(f"top induction-score heads: {', '.join(s['top_induction_score_heads'][:5])}")
        lines.append("timings: " + ", ".join(f"{k.replace('_', ' ')} {v:.1f} s" for k, v in s["timings_s"].items()))
        return "\n".join(lines)


def run(model, config: AblateConfig, *, resume: dict | None = None, on_save: Callable[[dict], None] | None = None,
        progress: bool = True) -> AblateResult:
    """Sweep every head (or ``config.heads``) on both tasks, with gradient importance and
    attribution patching beside the exact effects (see the module docstring).

    Args:
        model: a :class:`~headprobe.probe.loading.LoadedModel`, used as given.
        config: the settings.
        resume: a state saved by an interrupted run with the same config (``on_save``'s argument);
            its finished chunks are not recomputed. Updated in place.
        on_save: called with the whole state after every finished chunk (e.g. :meth:`RunCheckpoint.save`).
        progress: show progress bars.

    Raises:
        HeadprobeError: the model's self-check forbids head ablation, a head out of range,
            sequences longer than the context, too little text.
    """
    t_start = time.perf_counter()
    saved = {} if resume is None else resume
    save = (lambda: on_save(saved)) if on_save is not None else (lambda: None)
    cfg = config
    model.self_check.require_decomposition("head ablation (ablate, prune)")
    spec = model.spec
    if 2 * cfg.period + 1 > spec.n_ctx:
        raise HeadprobeError(f"--period {cfg.period} gives sequences longer than the model's context ({spec.n_ctx})")
    heads = cfg.head_list(spec.n_layers, spec.n_heads)
    text = read_text_file(cfg.text) if cfg.text else None
    data = task_tokens(model, cfg.n_natural, cfg.seq_len, cfg.n_repeated, cfg.period, cfg.seed, text,
                       source=str(cfg.text) if cfg.text else None)
    natural, repeated, repeated_src = data.natural, data.repeated, data.repeated_source
    nat, nat_ref = natural.tokens[: cfg.n_natural], natural.tokens[cfg.n_natural:]
    ref_z = capture_z(model, nat_ref)
    mean_z = mean_z_from(ref_z, natural.start) if cfg.kind == "mean" else None
    sets = {
        "natural": (nat, first_scored("natural", natural.start, None), nat_ref),
        "induction": (repeated.tokens, first_scored("repeated", repeated.start, repeated.period), repeated_src.tokens),
    }
    results: dict[str, TaskResult] = {}
    for task, (tokens, first, source) in sets.items():
        src = source if cfg.kind == "resample" else None
        t0 = time.perf_counter()
        sweep = checkpointed_sweep(model, tokens, heads, cfg.kind, mean_z, src, first, cfg.max_batch,
                                   saved.setdefault(task, {"clean": None, "loss": {}}), save,
                                   desc=f"ablation sweep ({task})", progress=progress)
        t1 = time.perf_counter()
        grad = head_importance(model, tokens, first, kind=cfg.kind, mean_z=mean_z, source_tokens=src)
        t2 = time.perf_counter()
        results[task] = TaskResult(sweep.clean_loss, sweep.effect.numpy(), grad.importance.numpy(),
                                   grad.attribution.numpy(), t1 - t0, t2 - t1)

    # prefix-matching (induction) score of every head, to check the induction ranking against
    induction_score = score_token_set(model, repeated, "repeated", types=("induction",))[0]["induction"].numpy()

    layer, head = np.meshgrid(np.arange(spec.n_layers), np.arange(spec.n_heads), indexing="ij")
    cols = {"layer": layer.ravel(), "head": head.ravel(), "kv_head": kv_head_of(head.ravel(), spec.n_heads, spec.n_kv_heads)}
    for task, r in results.items():
        cols[f"{task}_loss_delta"] = r.effect.ravel()
    for task, r in results.items():
        cols[f"{task}_importance"] = r.importance.ravel()
        cols[f"{task}_attribution"] = r.attribution.ravel()
    cols["induction_score"] = induction_score.ravel()
    return AblateResult(cfg, spec, pd.DataFrame(cols), results, induction_score, natural, repeated, str(model.device),
                        model.self_check.to_dict(), time.perf_counter() - t_start)




def ablate(model="smollm2-135m", *, progress: bool = False, **config_fields) -> AblateResult:
    """Every head's single-head ablation effect: ``headprobe ablate`` as a function (no checkpoint).

    Args:
        model: a model name or path (loaded as ``config_fields`` ask, after :meth:`AblateConfig.preflight`),
            or a :class:`~headprobe.probe.loading.LoadedModel` (used as given).
        progress: show progress bars.
        **config_fields: any :class:`AblateConfig` field but ``model`` (e.g. ``kind="mean"``, ``heads="5.1,7.3"``).

    Raises:
        HeadprobeError: bad settings (before anything loads), or as :func:`run`.
    """
    config, loaded, load_s = options.config_and_model(AblateConfig, model, config_fields)
    result = run(loaded, config, progress=progress)
    result.load_s = load_s
    return result
