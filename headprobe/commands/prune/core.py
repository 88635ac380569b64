"""``headprobe prune``'s computation: the run, its result and how it is saved (see
:mod:`headprobe.commands.prune` for the command and its settings). Imports torch, pandas and
matplotlib; the package's ``__init__`` does not."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from headprobe import options
from headprobe.analyses import figures as figs
from headprobe.analyses.ablation import first_scored
from headprobe.analyses.data import TokenSet, read_text_file, task_tokens
from headprobe.analyses.pruning import LossSet, PruningRun, build_pruned, iterative_pruning
from headprobe.probe.errors import HeadprobeError
from headprobe.commands.prune import ORDERS, PRUNED_FILE, PruneConfig
from headprobe.probe.heads import format_head
from headprobe.probe.io import package_versions, prepare_output_dir, write_json, write_text

@dataclass
class PruneResult:
    """Two pruning curves (losses in nats/token) and, with ``save_pruned``, the pruned model.

    Attributes:
        config: the settings.
        spec: the model's :class:`~headprobe.probe.loading.ModelSpec`.
        runs: order (``importance``, ``random``) -> :class:`~headprobe.analyses.pruning.PruningRun`.
        table: pruning_curve.csv: one row per order and step (``order, step, n_pruned, fraction_pruned,
            natural_loss, induction_loss, removed``).
        score_shape, natural_shape: ``[batch, pos]`` of the scoring and held-out natural-text sets.
        repeated: the induction task's token set.
        device: where the model ran. self_check: the model's load-time self-check.
        pruned: the pruned :class:`~headprobe.probe.model.Transformer` (``save_pruned``) or None.
        pruned_info: its checks and timings (see :func:`headprobe.analyses.pruning.build_pruned`) or None.
        run_s: seconds of :func:`run`; load_s: seconds loading the model (set by the caller that loaded it).
    """

    config: PruneConfig
    spec: object
    runs: dict[str, PruningRun]
    table: pd.DataFrame
    score_shape: list[int]
    natural_shape: list[int]
    repeated: TokenSet
    device: str
    self_check: dict
    pruned: object = None
    pruned_info: dict | None = None
    run_s: float = 0.0
    load_s: float = 0.0

    def summary(self) -> dict:
        """summary.json's content (as a dict; package versions included)."""
        cfg, spec = self.config, self.spec
        out = {
            "model": spec.name, "weights_precision": spec.precision, "dtype": cfg.dtype, "device": self.device,
            "self_check": self.self_check,
            "units": "nats/token", "n_heads_total": spec.n_layers * spec.n_heads,
            "method": "Michel et al. 2019 gradient importance I_h = E_x |dL/dxi_h|"
                      + (", per-layer L2-normalised" if cfg.normalize else "")
                      + ("; rescored after every step" if cfg.rescore else "; scored once"),
            "tokens": {"score": self.score_shape, "held_out_natural": self.natural_shape,
                       "induction": list(self.repeated.tokens.shape), "period": cfg.period},
            "curves": {o: [{k: v for k, v in row.items() if k != "removed"} for row in r.rows] for o, r in self.runs.items()},
            "importance_removal_order": [format_head(h) for h in self.runs["importance"].removal_order],
            "config": asdict(cfg),
            "versions": package_versions(),
        }
        if self.pruned_info is not None:
            out["pruned_model"] = {"file": PRUNED_FILE, **self.pruned_info}
        out["timings_s"] = {"total": round(self.run_s + self.load_s, 1)}
        return out

    def figures(self) -> dict[str, object]:
        """``{"pruning_curve": Figure}``: held-out text loss and induction loss against the fraction pruned."""
        cfg, spec = self.config, self.spec
        label = {"importance": "gradient importance" + ("" if cfg.rescore else " (scored once)"), "random": "random order"}
        curves = [(label[o], np.array([row["fraction_pruned"] for row in r.rows]),
                   {c: np.array([row[c] for row in r.rows]) for c in ("natural_loss", "induction_loss")})
                  for o, r in self.runs.items()]
        fig = figs.pruning_curve_plot(curves, [("natural_loss", "held-out text loss (nats)"),
                                               ("induction_loss", "induction loss (nats)")],
                                      f"Head pruning, {spec.name}\n({figs.weights_label(spec.weights)}, {cfg.dtype} compute)")
        return {"pruning_curve": fig}

    def save(self, out_dir: str | Path, overwrite: bool = False) -> list[Path]:
        """Write pruning_curve.csv, pruning_curve.png/pdf, pruned_model.pt (with ``save_pruned``) and,
        last, summary.json into ``out_dir`` (each atomically; a directory holding only a run
        checkpoint counts as empty). Returns the paths.

        Raises:
            HeadprobeError: ``out_dir`` is a file, not writable, or holds other files and ``overwrite`` is False.
        """
        from headprobe.probe.pruned import save_pruned

        out = prepare_output_dir(out_dir, overwrite, resumable=True)
        write_text(out / "pruning_curve.csv", self.table.to_csv(index=False, float_format="%.5f"))
        paths = [out / "pruning_curve.csv"]
        for stem, fig in self.figures().items():
            paths += figs.save_figure(fig, out / stem)
        if self.pruned is not None:
            save_pruned(self.pruned, out / PRUNED_FILE)
            paths.append(out / PRUNED_FILE)
        write_json(out / "summary.json", self.summary())  # last: a directory with summary.json is complete
        return [*paths, out / "summary.json"]

    def report(self) -> str:
        """The terminal table: both curves side by side, and the pruned model's checks."""
        imp, rnd = self.runs["importance"].rows, self.runs["random"].rows
        lines = [f"{'removed':>8} {'fraction':>8}  {'natural (imp / rand)':>22}  {'induction (imp / rand)':>24}"]
        for a, b in zip(imp, rnd):
            lines.append(f"{a['n_pruned']:>8} {a['fraction_pruned']:>8.2f}  {a['natural_loss']:>10.3f} / {b['natural_loss']:<9.3f}  "
                         f"{a['induction_loss']:>11.3f} / {b['induction_loss']:<9.3f}")
        if self.pruned_info is not None:
            p = self.pruned_info
            lines.append(f"pruned model: {p['heads_removed']} heads removed ({p['kv_heads_removed']} KV heads), attention "
                         f"parameters {p['attention_parameters']['full']:,} -> {p['attention_parameters']['pruned']:,}; max "
                         f"|logit diff| vs masked {p['max_abs_logit_diff_vs_masked']:.2e}; forward {p['forward_s']['masked']:.3f} s "
                         f"masked vs {p['forward_s']['pruned']:.3f} s pruned ({p['speedup']:.2f}x)")
        return "\n".join(lines)


def run(model, config: PruneConfig, *, resume: dict | None = None, on_save: Callable[[dict], None] | None = None,
        progress: bool = True) -> PruneResult:
    """Prune by importance and in a random order, recording both curves (see the module docstring).

    Args:
        model: a :class:`~headprobe.probe.loading.LoadedModel`, used as given (the native backend for ``save_pruned``).
        config: the settings.
        resume: a state saved by an interrupted run with the same config (``on_save``'s argument);
            both curves continue after their last saved step. Updated in place.
        on_save: called with the whole state after every step (e.g. :meth:`RunCheckpoint.save`).
        progress: show progress bars.

    Raises:
        HeadprobeError: the model's self-check forbids head ablation, ``save_pruned`` on a
            non-native model, sequences longer than the context, too little text.
    """
    t_start = time.perf_counter()
    cfg = config
    saved = {} if resume is None else resume
    model.self_check.require_decomposition("head ablation (ablate, prune)")
    if cfg.save_pruned:
        model.check_prunable()  # before any computation: the native backend only; MLA and all-head QK-norm cannot be pruned exactly
    spec = model.spec
    if 2 * cfg.period + 1 > spec.n_ctx:
        raise HeadprobeError(f"--period {cfg.period} gives sequences longer than the model's context ({spec.n_ctx})")
    text = read_text_file(cfg.text) if cfg.text else None
    data = task_tokens(model, cfg.n_natural, cfg.seq_len, cfg.n_repeated, cfg.period, cfg.seed, text,
                       source=str(cfg.text) if cfg.text else None)
    natural, repeated = data.natural, data.repeated
    score = LossSet(natural.tokens[: cfg.n_natural], first_scored("natural", natural.start, None))
    evals = {"natural": LossSet(natural.tokens[cfg.n_natural:], score.first),
             "induction": LossSet(repeated.tokens, first_scored("repeated", repeated.start, repeated.period))}
    runs = {}
    for order in ORDERS:
        def on_step(state, order=order):
            saved[order] = state
            if on_save is not None:
                on_save(saved)

        runs[order] = iterative_pruning(model, score, evals, order=order, step_fraction=cfg.step_fraction,
                                        rescore=cfg.rescore, normalize=cfg.normalize, max_fraction=cfg.max_fraction,
                                        seed=cfg.seed, progress=progress, resume=saved.get(order), on_step=on_step)
    table = pd.DataFrame([row for r in runs.values() for row in r.rows])
    pruned = info = None
    if cfg.save_pruned:
        n = round(cfg.save_fraction * spec.n_layers * spec.n_heads)
        keep = runs["importance"].keep_mask_after(n, spec.n_layers, spec.n_heads)
        pruned, info = build_pruned(model, keep, evals["natural"].tokens)
    return PruneResult(cfg, spec, runs, table, list(score.tokens.shape), list(evals["natural"].tokens.shape), repeated,
                       str(model.device), model.self_check.to_dict(), pruned, info, time.perf_counter() - t_start)




def prune(model="smollm2-135m", *, progress: bool = False, **config_fields) -> PruneResult:
    """Iterative head pruning against a random order: ``headprobe prune`` as a function (no checkpoint).

    Args:
        model: a model name or path (loaded as ``config_fields`` ask), or a
            :class:`~headprobe.probe.loading.LoadedModel` (used as given).
        progress: show progress bars.
        **config_fields: any :class:`PruneConfig` field but ``model`` (e.g. ``step_fraction=0.25``).

    Raises:
        HeadprobeError: bad settings (before anything loads), or as :func:`run`.
    """
    config, loaded, load_s = options.config_and_model(PruneConfig, model, config_fields)
    result = run(loaded, config, progress=progress)
    result.load_s = load_s
    return result
