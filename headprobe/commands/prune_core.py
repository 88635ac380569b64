"""``headprobe prune``'s computation: the run, its result and how it is saved (see
:mod:`headprobe.commands.prune` for the command and its settings). Imports torch, pandas and
matplotlib; the package's ``__init__`` does not."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from headprobe import options
from headprobe.analyses import figures as figs
from headprobe.analyses.ablation import first_scored, importance_plan, unknown_text_reason, untrusted_text_note
from headprobe.analyses.data import TokenSet, left_out_notes, window_counts
from headprobe.analyses.outputs import WritesOutputs
from headprobe.analyses.pruning import (
    IMPORTANCE_WORK,
    LossSet,
    PruningRun,
    build_pruned,
    curve_auc,
    iterative_pruning,
    l0_pruning,
    per_layer_best_head,
    present_heads,
    step_plan,
    unreliable_picks,
)
from headprobe.analyses.pruning import memory_plan as pruning_memory_plan
from headprobe.commands.prune import NEEDS_CAUSAL, PRUNED_DIR, PruneConfig
from headprobe.probe.backends.base import LoadedModel
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.core.heads import format_head
from headprobe.probe.core.io import summary_envelope
from headprobe.probe.core.memory import BatchPlan
from headprobe.probe.core.reprs import CompactRepr, load_seconds
from headprobe.probe.layout.spec import ModelSpec

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from headprobe.probe.model.transformer import Transformer

METRICS = (("natural_loss", "held-out text loss (nats/token)"), ("repeated_loss", "repeated-tokens loss (nats/token)"))
LABELS = {"michel": "Michel et al. gradient importance", "l0": "Voita et al. L0 gates", "random": "random order"}


def run_names(cfg: PruneConfig) -> list[str]:
    """The curves a config asks for, in order: ``michel``, ``l0``, ``random:<seed>`` per seed."""
    out = []
    for m in cfg.methods:
        out += [f"random:{cfg.seed + i}" for i in range(cfg.n_seeds)] if m == "random" else [m]
    return out


def method_label(method: str, rescore: bool) -> str:
    """A pruning method's legend label (:data:`LABELS`; Michel's importance "scored once" without rescoring)."""
    return LABELS[method] + (" (scored once)" if method == "michel" and not rescore else "")


def per_layer_figure(t: pd.DataFrame, model: str, weights: str) -> Figure:
    """per_layer.png from per_layer.csv's rows ``t`` (a row per layer: ``layer``, ``clean_loss``,
    ``loss_best_only``, ``loss_worst_only``, ``loss_layer_ablated``, ``best_head``) of ``model`` with
    ``weights`` (the spec's or summary.json's description), titled as pruning_curve is
    (:func:`headprobe.analyses.figures.per_layer_plot`); what ``prune --per-layer`` draws and
    scripts/redraw_figures.py redraws."""
    return figs.per_layer_plot(
        t.layer.to_numpy(),
        float(t.clean_loss.iloc[0]),
        t.loss_best_only.to_numpy(),
        t.loss_worst_only.to_numpy(),
        t.loss_layer_ablated.to_numpy(),
        t.best_head.to_numpy(),
        f"One head per layer, {figs.model_tag(model, weights)}",
        inverted=t.layer.isin(unreliable_picks(t.to_dict("records"))["inverted"]).to_numpy(),
    )


def per_layer_notes(rows: Sequence[dict], natural_shape: Sequence[int]) -> list[str]:
    """The NOTE on a per-layer table whose held-out pick is unreliable: one line when some layer's
    best head, picked on one half of the ``natural_shape`` (``[windows, tokens]``) held-out windows,
    scored worse on the other half than its worst head (:func:`~headprobe.analyses.pruning.unreliable_picks`),
    naming those layers and counting the layers whose halves disagree; none otherwise."""
    bad = unreliable_picks(rows)
    if not bad["inverted"]:
        return []
    n, tokens = int(natural_shape[0]), int(natural_shape[1])
    halves = f"{n // 2} window{'s' * (n > 3)}" if n % 2 == 0 else f"{(n + 1) // 2} and {n // 2} windows"
    by = max(r["loss_best_only"] - r["loss_worst_only"] for r in rows if r["layer"] in bad["inverted"])
    of = len(bad["layers"])
    layers = ", ".join(map(str, bad["inverted"]))
    return [
        f"per layer: in {len(bad['inverted'])} of {of} layers ({layers}) the head picked as best on one half "
        f"of the held-out windows lost more on the other half than the head picked as worst (loss_best_only > "
        f"loss_worst_only, by up to {by:.3f} nats; drawn hollow in the per_layer figure), and the two halves "
        f"picked different best heads in {len(bad['disagree'])} of {of} (best_head_halves_agree false): with "
        f'{halves} of {tokens} tokens per half, "best" there is noise, not the layer\'s best head. To rank the '
        f"heads give more held-out windows: --n-natural (now {n}; the default 8), the windows --per-layer picks "
        "and scores on (--n-repeated does not enter it); its time grows with them"
    ]


def figure_labels(
    name: str, weights: str, dtype: str, present: int, total: int, pruned: dict | None
) -> tuple[str, str, tuple[str, float, dict[str, float]] | None]:
    """The pruning figure's title, x label and saved-model star (``pruned``: summary.json's
    ``pruned_model``; None or without ``loss``: no star) for model ``name`` (``weights``: its
    weights' label) run in ``dtype`` on a checkpoint with ``present`` of its ``total`` heads."""
    title = f"Head pruning, {name}\n({weights}, {dtype} compute)"
    xlabel = "fraction of heads removed"
    if gone := total - present:  # a pruned checkpoint: fractions of the heads it has
        xlabel = f"fraction of the checkpoint's {present} heads removed"
        title += f"\n{gone} of {total} heads removed before this run"
    saved = None
    if pruned is not None and "loss" in pruned:
        saved = (
            f"saved model ({pruned['heads_removed']} heads removed)",
            pruned["fraction_removed"],
            {f"{k}_loss": v for k, v in pruned["loss"].items()},
        )
    return title, xlabel, saved


@dataclass(repr=False)
class PruneResult(CompactRepr, WritesOutputs):
    """Every method's pruning curve (losses in nats/token) and, with ``save_pruned``, the pruned model.

    Attributes:
        config: the settings.
        spec: the model's :class:`~headprobe.probe.layout.spec.ModelSpec`.
        runs: curve name (``michel``, ``l0``, ``random:<seed>``; see :func:`run_names`) ->
            :class:`~headprobe.analyses.pruning.PruningRun`.
        table: pruning_curve.csv: one row per curve and step (``method, seed, step, n_pruned,
            fraction_pruned, natural_loss, repeated_loss, lambda, expected_open, margin, removed``;
            ``seed`` for random only, ``lambda`` and ``expected_open`` for l0 only, ``margin`` for
            michel only: :func:`~headprobe.analyses.pruning.least_important_cut`).
        score_shape: ``[batch, pos]`` of the scoring set.
        natural_shape: ``[batch, pos]`` of the held-out natural-text set.
        repeated: the repeated task's token set.
        device: where the model ran.
        self_check: the model's load-time self-check.
        per_layer: rows of :func:`headprobe.analyses.pruning.per_layer_best_head` (``per_layer``) or None.
        pruned: the pruned :class:`~headprobe.probe.model.transformer.Transformer` (``save_pruned``) or None.
        pruned_info: its checks and timings (see :func:`headprobe.analyses.pruning.build_pruned`) or None.
        tokenizer: the model's tokenizer (saved with the pruned model).
        run_s: seconds of :func:`run`.
        load_s: seconds loading the model where prune loaded it; None where the caller passed a model it loaded (:func:`~headprobe.probe.core.reprs.load_seconds`).
        method_s: seconds each method took (this process; 0 for curves resumed from a checkpoint).
        natural_text: the natural-text draw (summary.json records its windows, the report says when
            some were left out), or None.
        natural_untrusted: why the natural text cannot support its numbers (most of its tokens unknown
            to the tokenizer, :func:`~headprobe.analyses.ablation.untrusted_task_reason`), or None.
    """

    config: PruneConfig
    spec: ModelSpec
    runs: dict[str, PruningRun]
    table: pd.DataFrame
    score_shape: list[int]
    natural_shape: list[int]
    repeated: TokenSet
    device: str
    self_check: dict
    per_layer: list[dict] | None = None
    pruned: Transformer | None = None
    pruned_info: dict | None = None
    tokenizer: object = None
    run_s: float = 0.0
    load_s: float | None = load_seconds()
    method_s: dict | None = None
    natural_text: TokenSet | None = None
    natural_untrusted: str | None = None

    @property
    def already_removed(self) -> list[tuple[int, int]]:
        """The heads the model had lost before this run (a pruned checkpoint's ``spec.removed_heads``):
        never candidates; every count and fraction is of the other heads."""
        return sorted(self.spec.removed_heads)

    @property
    def heads_present(self) -> tuple[int, int]:
        """``(present, total)``: the heads the model has, and those of its unpruned layout
        (``n_layers * n_heads``); they differ by :attr:`already_removed`."""
        total = self.spec.n_layers * self.spec.n_heads
        return total - len(self.already_removed), total

    def _curves(self, method: str) -> list[PruningRun]:
        return [r for name, r in self.runs.items() if name.split(":")[0] == method]

    def auc(self) -> dict:
        """summary.json's ``auc``: per method and metric, the mean loss over the fraction of heads
        removed from 0 to ``range`` (:func:`~headprobe.analyses.pruning.curve_auc`; nats/token,
        lower is better), ``range`` being the largest fraction every curve reaches; random gives
        the mean and standard deviation over its seeds."""
        upto = min(max(row["fraction_pruned"] for row in r.rows) for r in self.runs.values())
        out: dict = {"range": [0.0, upto], "units": "nats/token (mean loss over the range)"}
        if upto <= 0:
            out["note"] = "some curve removed no head; no common range to integrate over"
            return out
        for method in self.config.methods:
            out[method] = {}
            for col, _ in METRICS:
                vals = [
                    curve_auc([row["fraction_pruned"] for row in r.rows], [row[col] for row in r.rows], upto)
                    for r in self._curves(method)
                ]
                key = col.removesuffix("_loss")
                out[method][key] = (
                    vals[0]
                    if len(vals) == 1
                    else {"mean": float(np.mean(vals)), "std": float(np.std(vals, ddof=1)), "per_seed": vals}
                )
        return out

    def summary(self) -> dict:
        """summary.json's content (as a dict; package versions included)."""
        cfg, spec = self.config, self.spec
        methods = {
            "michel": "Michel et al. 2019 (arXiv 1905.10650) gradient importance I_h = E_x |dL/dxi_h|"
            + (", l2-normalised per layer (normalize=true)" if cfg.normalize else ", unnormalised (normalize=false)")
            + ("; rescored after every step" if cfg.rescore else "; scored once")
            + f"; {cfg.step_fraction:g} of all heads per step",
            "l0": "Voita et al. 2019 (arXiv 1905.09418) Hard Concrete head gates (Louizos et al. 2018) on the frozen "
            f"model, task loss + lambda * E[open gates] / n_heads, lambda swept {list(cfg.l0_lambdas)} as a "
            f"continuation, {cfg.l0_steps} Adam steps each; heads with log_alpha > 0 kept",
            "random": f"seeded random orders, seeds {cfg.seed}..{cfg.seed + cfg.n_seeds - 1}, {cfg.step_fraction:g} of all heads per step",
        }
        if self.already_removed:
            methods = {k: v.replace("of all heads", "of the heads present") for k, v in methods.items()}
        present, total = self.heads_present
        out = {
            "dtype": cfg.dtype,
            "units": "nats/token",
            "n_heads_total": total,
            # a pruned checkpoint: its removed heads are no candidates; counts and fractions are of the others
            "n_heads_present": present,
            "heads_already_removed": [format_head(h) for h in self.already_removed],
            "methods": {m: methods[m] for m in cfg.methods},
            "evaluation": "every curve: the same held-out natural text and repeated tokens, heads removed by z * 0 at hook_z",
            "tokens": {
                "score": self.score_shape,
                "held_out_natural": self.natural_shape,
                "repeated": list(self.repeated.tokens.shape),
                "period": cfg.period,
                **(window_counts(self.natural_text) if self.natural_text is not None else {}),
                "natural_untrusted": self.natural_untrusted,
            },
            "auc": (auc := self.auc()),
            "curves": {
                name: [{k: v for k, v in row.items() if k != "removed"} for row in r.rows]
                for name, r in self.runs.items()
            },
            "removal_order": {name: [format_head(h) for h in r.removal_order] for name, r in self.runs.items()},
        }
        if (ranks := rank_vs_random(auc, cfg.methods)) is not None:
            out["rank_vs_random"] = ranks
        if self.per_layer is not None:
            out["per_layer"] = self.per_layer
        if self.pruned_info is not None:
            out["pruned_model"] = {"dir": PRUNED_DIR, **self.pruned_info}
        out["notes"] = self.notes()
        return summary_envelope(
            out,
            model=spec.name,
            precision=spec.precision,
            backend=spec.backend,
            device=self.device,
            self_check=self.self_check,
            config=cfg,
            timings_s={"load_s": self.load_s, "total": self.run_s + (self.load_s or 0.0), **(self.method_s or {})},
        )

    def figures(self) -> dict[str, Figure]:
        """``{"pruning_curve": Figure}`` (every method's held-out text and repeated-tokens loss against the
        fraction pruned, random as a band over seeds) and, with ``per_layer``, ``{"per_layer": Figure}``."""
        cfg, spec = self.config, self.spec

        def arrays(r):
            return np.array([row["fraction_pruned"] for row in r.rows]), {
                c: np.array([row[c] for row in r.rows]) for c, _ in METRICS
            }

        curves, bands = [], []
        present, total = self.heads_present
        title, xlabel, saved = figure_labels(
            figs.title_name(spec.name, spec.weights),
            figs.weights_label(spec.weights),
            cfg.dtype,
            present,
            total,
            self.pruned_info,
        )
        for m in cfg.methods:
            rs = self._curves(m)
            label = method_label(m, cfg.rescore)
            if m == "random":
                frac = arrays(rs[0])[0]
                bands.append((label, frac, {c: np.stack([arrays(r)[1][c] for r in rs]) for c, _ in METRICS}))
            else:
                curves.append((label, *arrays(rs[0])))
        out = {"pruning_curve": figs.pruning_methods_plot(curves, bands, METRICS, title, saved=saved, xlabel=xlabel)}
        if self.per_layer is not None:
            out["per_layer"] = per_layer_figure(pd.DataFrame(self.per_layer), spec.name, spec.weights)
        return out

    def outputs(self) -> dict[str, Any]:
        """save's files: pruning_curve.csv and pruning_curve.<format>, per_layer.csv and
        per_layer.<format> (``per_layer``), each figure for each of ``formats``, the pruned model
        directory (``save_pruned``) and, last, summary.json."""
        from headprobe.probe.model.checkpoint import source_weights
        from headprobe.probe.model.pruned import save_pruned_dir

        curve = self.table.assign(margin=self.table["margin"].map(lambda v: "" if v != v else f"{v:.4g}"))
        tables = {"pruning_curve.csv": curve.to_csv(index=False, float_format="%.5f")}  # a margin near a tie in full
        if self.per_layer is not None:
            tables["per_layer.csv"] = pd.DataFrame(self.per_layer).to_csv(index=False, float_format="%.5f")

        def pruned_model(out: Path) -> list[Path]:
            if self.pruned is None:
                return []
            save_pruned_dir(
                self.pruned,
                out / PRUNED_DIR,
                self.tokenizer,
                source=self.spec.name,
                source_weights=source_weights(self.spec.weights),  # a 4-bit model's stay so named
            )
            return [out / PRUNED_DIR]

        return dict(
            resumable=True,
            summary=self.summary,
            tables=tables,
            figures=self.figures,
            extra=pruned_model,
            models=(PRUNED_DIR,) if self.pruned is not None else (),
        )

    @options.reports_for_readers("prune")
    def report(self) -> str:
        """The terminal table: each method's curve, random as mean over seeds, then the areas."""
        names = {
            m: m if len(self._curves(m)) == 1 else f"{m} (mean of {len(self._curves(m))})" for m in self.config.methods
        }
        w = max(len("curve"), *map(len, names.values()))
        lines = []
        present, total = self.heads_present
        if gone := total - present:
            lines.append(
                f"pruned checkpoint: {gone} of its {total} heads were removed before this run; they are no "
                f"candidates, and every count and fraction below is of the {present} heads it has"
            )
        lines.append(f"{'curve':<{w}} {'removed':>7} {'fraction':>8} {'natural':>8} {'repeated':>9}")
        for m in self.config.methods:
            rs = self._curves(m)
            for i, row in enumerate(rs[0].rows):
                nat = np.mean([r.rows[i]["natural_loss"] for r in rs])
                ind = np.mean([r.rows[i]["repeated_loss"] for r in rs])
                lines.append(
                    f"{names[m]:<{w}} {row['n_pruned']:>7} {row['fraction_pruned']:>8.2f} {nat:>8.3f} {ind:>9.3f}"
                )
        auc = self.auc()
        if "note" not in auc:
            lo, hi = auc["range"]
            for m in self.config.methods:
                a = auc[m]
                fmt = lambda v: (
                    f"{v:.3f}" if isinstance(v, float) else f"{v['mean']:.3f} (sd {v['std']:.3f} over seeds)"
                )
                lines.append(
                    f"area (mean loss over {lo:.2f}-{hi:.2f} removed) {m}: natural {fmt(a['natural'])}, repeated {fmt(a['repeated'])}"
                )
            lines += rank_lines(rank_vs_random(auc, self.config.methods))
        if self.per_layer is not None:
            best = min(self.per_layer, key=lambda r: r["delta_best_only"])
            lines.append(
                f"per layer: one head kept costs {min(r['delta_best_only'] for r in self.per_layer):+.3f} .. "
                f"{max(r['delta_best_only'] for r in self.per_layer):+.3f} nats (least: layer {best['layer']})"
            )
        if self.pruned_info is not None:
            lines += saved_lines(self.pruned_info)
        return "\n".join([*lines, *(f"NOTE: {n}" for n in self.notes())])

    def notes(self) -> list[str]:
        """What the terminal prints as NOTE lines and summary.json keeps as ``notes``: natural-text
        windows left out, and a per-layer pick that is noise (:func:`per_layer_notes`)."""
        notes = left_out_notes(self.natural_text) if self.natural_text is not None else []
        if self.natural_untrusted:
            notes.append(untrusted_text_note(self.natural_untrusted, "summary.json's tokens.natural_untrusted"))
        return notes + (per_layer_notes(self.per_layer, self.natural_shape) if self.per_layer is not None else [])


def rank_vs_random(auc: dict, methods: Sequence[str]) -> dict | None:
    """summary.json's ``rank_vs_random``: per method other than random and per task, its curve's
    area (``auc``, :meth:`PruneResult.auc`) ranked among the random orders' (``n_random``,
    ``n_random_at_or_below``, ``p``: :func:`~headprobe.analyses.statistics.rank_p_value`), and the
    rule; None without random orders, without another method or without a common range."""
    from headprobe.analyses.statistics import rank_p_value

    others = [m for m in methods if m != "random"]
    if "random" not in methods or not others or "note" in auc:
        return None
    out: dict = {
        "rule": "each method's area against each random order's: p = (1 + #random orders at or below) / (k + 1), "
        "one-sided, exact if the method's order were one more random order; never below 1 / (k + 1)"
    }
    for m in others:
        out[m] = {}
        for key, rnd in auc["random"].items():
            null = rnd["per_seed"] if isinstance(rnd, dict) else [rnd]
            below = sum(x <= auc[m][key] for x in null)
            out[m][key] = {"n_random": len(null), "n_random_at_or_below": below, "p": rank_p_value(auc[m][key], null)}
    return out


def rank_lines(ranks: dict | None) -> list[str]:
    """The report's lines of :func:`rank_vs_random` (none for None)."""
    if ranks is None:
        return []
    lines = []
    for m, tasks in ranks.items():
        if m == "rule":
            continue
        k = next(iter(tasks.values()))["n_random"]
        parts = [
            f"{t} below {r['n_random'] - r['n_random_at_or_below']} of {k} (rank p = {r['p']:.2f})"
            for t, r in tasks.items()
        ]
        lines.append(
            f"area rank {m} vs {k} random orders: {', '.join(parts)}; p is never below 1/(k+1) = {1 / (k + 1):.2f}"
        )
    return lines


def _speedup_text(p: dict) -> str:
    """``1.27x, 0.98x to 1.41x over 7 interleaved pairs``; a range across 1x says the machine's timing
    cannot tell the two apart (a summary from before the pairs: the one ratio)."""
    if "speedup_range" not in p:
        return f"{p['speedup']:.2f}x"
    lo, hi = p["speedup_range"]
    text = f"{p['speedup']:.2f}x, {lo:.2f}x to {hi:.2f}x over {p['timing_pairs']} interleaved pairs"
    return text + ("; not told apart from 1x on this machine" if lo < 1 < hi else "")


def saved_lines(p: dict) -> list[str]:
    """The report's lines on the saved pruned model (:attr:`PruneResult.pruned_info`): what was
    removed and its check against the masked model, then its own losses and, where its heads are
    a curve step's, that step's losses beside them (:func:`saved_vs_curve`)."""
    before = f", besides the {p['heads_already_removed']} removed before" if p.get("heads_already_removed") else ""
    lines = [
        f"pruned model: {p['heads_removed']} heads removed ({p['kv_heads_removed']} KV heads){before}; attention "
        f"parameters {p['attention_parameters']['full']:,} -> {p['attention_parameters']['pruned']:,}; max "
        f"|logit diff| vs masked {p['max_abs_logit_diff_vs_masked']:.2e}; forward {p['forward_s']['masked']:.3f} s "
        f"masked vs {p['forward_s']['pruned']:.3f} s pruned ({_speedup_text(p)})"
    ]
    if "loss" not in p:
        return lines
    own = ", ".join(f"{k} {v:.3f}" for k, v in p["loss"].items())
    line = (
        f"saved model loss ({p['heads_removed']} heads removed, fraction {p['fraction_removed']:.3f}): {own} nats/token"
    )
    if p["curve_step"] is not None:
        diffs = ", ".join(f"{v:+.1e}" for v in p["loss_minus_curve"].values())
        line += f"; curve step {p['curve_step']} ({p['method']}), the same heads: saved minus curve {diffs}"
    else:
        lo, hi = p["between_curve_steps"]
        line += f"; between curve steps {lo} and {hi} ({p['method']}): no curve point removes these heads"
    return [*lines, line]


def saved_vs_curve(curve: PruningRun, n: int, saved_loss: dict[str, float]) -> dict:
    """Where the saved model (the first ``n`` heads of ``curve``'s removal order removed) stands on
    ``curve``: ``curve_step`` (the step whose mask removes exactly those heads) with
    ``loss_minus_curve`` (per set, the saved model's loss minus the step's: 0 to float rounding, the
    small model's weights against the head mask), or ``curve_step`` None and ``between_curve_steps``
    (the steps around ``n``; an L0 curve's heads may reopen, so a step of ``n`` heads may remove others)."""
    union: set = set()
    for row in curve.rows:
        union |= set(row["removed"].split())
        if row["n_pruned"] == n and len(union) == n:
            diff = {k: v - row[f"{k}_loss"] for k, v in saved_loss.items()}
            return {"curve_step": row["step"], "loss_minus_curve": diff}
    below = [r["step"] for r in curve.rows if r["n_pruned"] < n]
    above = [r["step"] for r in curve.rows if r["n_pruned"] > n]
    return {"curve_step": None, "between_curve_steps": [max(below, default=None), min(above, default=None)]}


def _rename_old_task(saved: dict) -> dict:
    """``saved`` (a checkpoint's state) brought to today's form in place; returns it.

    Its curves' ``induction_loss`` is renamed ``repeated_loss`` (a checkpoint written when the repeated
    task was called "induction"), and a per-layer table without ``best_head_halves_agree`` is dropped
    (written when the best head was picked and scored on the same windows; recomputed held out).
    """
    for state in saved.values():
        if isinstance(state, dict) and "rows" in state:
            state["rows"] = [
                {"repeated_loss" if k == "induction_loss" else k: v for k, v in row.items()} for row in state["rows"]
            ]
    if saved.get("per_layer") and "best_head_halves_agree" not in saved["per_layer"][0]:
        del saved["per_layer"]
    return saved


def memory_plan(model: LoadedModel, config: PruneConfig) -> BatchPlan:
    """:func:`~headprobe.analyses.pruning.memory_plan` of ``config`` on ``model``: ``n_natural``
    scored sequences of ``seq_len`` tokens, as many held out, ``n_repeated`` repeated sequences of
    ``2 period`` tokens (BOS added where the model prepends one).

    Raises:
        HeadprobeError: a step that does not fit in the memory budget, or as ``config.resolved``.
    """
    cfg = config.resolved(model.spec, model.trained_periods)
    assert cfg.seq_len is not None and cfg.period is not None  # set by resolved()
    assert not isinstance(cfg.methods, str)  # set by __post_init__
    evals = {
        "natural": (cfg.n_natural, cfg.seq_len),
        "repeated": (cfg.n_repeated, 2 * cfg.period + int(model.prepend_bos)),
    }
    return pruning_memory_plan(model, cfg.methods, (cfg.n_natural, cfg.seq_len), evals, cfg.save_pruned, cfg.per_layer)


def batch_line(model: LoadedModel, config: PruneConfig) -> str:
    """The header line of :func:`memory_plan` (its largest step).

    Raises:
        HeadprobeError: as :func:`memory_plan`.
    """
    return "\n".join(filter(None, (memory_plan(model, config).line(), steps_line(model, config))))


def steps_line(model: LoadedModel, cfg: PruneConfig) -> str:
    """``steps: 27 of the 270 heads a step, 10 steps to 270 removed`` for the michel and random curves
    (:func:`~headprobe.analyses.pruning.step_plan`), saying where a step fraction rounds up to one
    head; empty where neither runs (l0 sweeps its lambdas)."""
    if not {"michel", "random"} & set(cfg.methods):
        return ""
    n = int(present_heads(model).sum())
    per_step, n_max, n_steps = step_plan(n, cfg.step_fraction, cfg.max_fraction)
    exact = cfg.step_fraction * n
    up = (
        f" (--step-fraction {cfg.step_fraction:g} x {n} = {exact:.3g} heads, rounded up to 1)"
        if round(exact) == 0
        else ""
    )
    return (
        f"steps: {per_step} of the {n} heads a step{up}, {n_steps} step{'s' * (n_steps != 1)} to {n_max} removed "
        f"(--max-fraction {cfg.max_fraction:g})"
    )


def _refuse_early(model: LoadedModel, cfg: PruneConfig) -> None:
    """Raise, before any computation, what :func:`run` refuses of the model itself."""
    options.require_causal(model.spec, NEEDS_CAUSAL, options.ENCODER_HINT)
    model.self_check.require_decomposition("head ablation (ablate, prune)")
    n = int(present_heads(model).sum())  # refuses a pruned checkpoint with no head left
    if (head_layers := model.spec.layout.head_layers) is not None:  # its fractions and masks span every layer's heads
        raise HeadprobeError(
            f"headprobe prune is not implemented for hybrid models (heads only in layers {list(head_layers)}, "
            "the others linear attention)"
        )
    if cfg.save_pruned:
        model.check_prunable()  # the native backend only; MLA and all-head QK-norm cannot be pruned exactly
        if round(cfg.save_fraction * n) == 0:
            raise HeadprobeError(
                f"--save-fraction {cfg.save_fraction:g} of the {n} heads removes none (it rounds to 0 heads): the "
                f"saved model would be the whole model; give --save-fraction {math.ceil(1000 / n) / 1000:g} or more"
            )


def _loss_sets(model: LoadedModel, cfg: PruneConfig) -> tuple[TokenSet, LossSet, dict[str, LossSet], TokenSet]:
    """``(repeated, score, evals, natural)``: the repeated task's token set, the natural-text windows the
    heads are scored on, the held-out sets every curve is evaluated on (``natural``: the other
    natural-text windows; ``repeated``), and the whole natural-text draw."""
    data = cfg.task_tokens(model)
    natural, repeated = data.natural, data.repeated
    score = LossSet(natural.tokens[: cfg.n_natural], first_scored("natural", natural.start, None))
    evals = {
        "natural": LossSet(natural.tokens[cfg.n_natural :], score.first),
        "repeated": LossSet(repeated.tokens, first_scored("repeated", repeated.start, repeated.period)),
    }
    return repeated, score, evals, natural


def _prune_curve(
    model: LoadedModel,
    cfg: PruneConfig,
    name: str,
    score: LossSet,
    evals: dict[str, LossSet],
    saved: dict,
    on_save: Callable[[dict], None] | None,
    progress: bool,
) -> PruningRun:
    """The curve ``name`` (see :func:`run_names`), resumed from ``saved[name]``; every step's state
    is stored there and the whole state passed to ``on_save``."""

    def on_step(state):
        saved[name] = state
        if on_save is not None:
            on_save(saved)

    method, _, seed = name.partition(":")
    if method == "l0":
        assert not isinstance(cfg.l0_lambdas, str)  # set by __post_init__
        return l0_pruning(
            model,
            score,
            evals,
            lambdas=cfg.l0_lambdas,
            steps=cfg.l0_steps,
            seed=cfg.seed,
            progress=progress,
            resume=saved.get(name),
            on_step=on_step,
        )
    return iterative_pruning(
        model,
        score,
        evals,
        order="importance" if method == "michel" else "random",
        step_fraction=cfg.step_fraction,
        rescore=cfg.rescore,
        normalize=cfg.normalize,
        max_fraction=cfg.max_fraction,
        seed=int(seed or cfg.seed),
        progress=progress,
        resume=saved.get(name),
        on_step=on_step,
        max_batch=importance_plan(model, score.tokens.shape[0], score.tokens.shape[1], work=IMPORTANCE_WORK).items
        if method == "michel"
        else None,
    )


def _save_pruned(
    model: LoadedModel, cfg: PruneConfig, runs: dict[str, PruningRun], evals: dict[str, LossSet]
) -> tuple[Transformer, dict]:
    """The model with the first ``save_fraction`` of the present heads removed in the first curve's
    order (a pruned checkpoint's removed heads removed too), its checks, and its own losses on the
    curve's held-out sets beside the curve (:func:`saved_vs_curve`)."""
    spec = model.spec
    present = present_heads(model)
    n = round(cfg.save_fraction * int(present.sum()))
    name = run_names(cfg)[0]
    keep = runs[name].keep_mask_after(n, spec.n_layers, spec.n_heads)
    pruned, info = build_pruned(model, keep, evals["natural"].tokens, evals)
    info["method"] = name
    info.update(saved_vs_curve(runs[name], n, info["loss"]))
    return pruned, info


def _curve_table(runs: dict[str, PruningRun]) -> pd.DataFrame:
    """pruning_curve.csv: one row per curve and step, in :attr:`PruneResult.table`'s columns."""
    rows = []
    for name, r in runs.items():
        method, _, seed = name.partition(":")
        for row in r.rows:
            rows.append(
                {
                    "method": method,
                    "seed": int(seed) if seed else None,
                    **{k: v for k, v in row.items() if k != "order"},
                }
            )
    table = pd.DataFrame(rows)
    for col in ("lambda", "expected_open", "margin"):
        if col not in table:
            table[col] = np.nan
    for col in ("seed", "step", "n_pruned"):  # integers, blank where not given: never the float format
        table[col] = table[col].astype("Int64")
    return table[
        [
            "method",
            "seed",
            "step",
            "n_pruned",
            "fraction_pruned",
            "natural_loss",
            "repeated_loss",
            "lambda",
            "expected_open",
            "margin",
            "removed",
        ]
    ]


def run(
    model: LoadedModel,
    config: PruneConfig,
    *,
    resume: dict | None = None,
    on_save: Callable[[dict], None] | None = None,
    progress: bool = True,
) -> PruneResult:
    """Run every method of ``config.methods`` on the same data (see the module docstring).

    Args:
        model: a :class:`~headprobe.probe.backends.loading.LoadedModel`, used as given (the native backend for ``save_pruned``).
        config: the settings. progress: show progress bars.
        resume: a state saved by an interrupted run with the same config (``on_save``'s argument);
            every curve continues after its last saved step. Updated in place.
        on_save: called with the whole state after every step (e.g. :meth:`RunCheckpoint.save`).

    Raises:
        HeadprobeError: the model's self-check forbids head ablation, a hybrid model, ``save_pruned`` on a
            non-native model, sequences longer than the context, too little text, a step that does not
            fit in the memory budget (:func:`memory_plan`).
    """
    t_start = time.perf_counter()
    saved = _rename_old_task({} if resume is None else resume)
    _refuse_early(model, config)
    memory_plan(model, config)  # refuses a step that cannot fit, before any allocation
    spec = model.spec
    cfg = config.resolved(spec, model.trained_periods)  # the lengths it runs with and summary.json records
    assert not isinstance(cfg.l0_lambdas, str)  # set by __post_init__
    repeated, score, evals, natural = _loss_sets(model, cfg)
    runs, method_s = dict[str, PruningRun](), dict[str, float]()
    for name in run_names(cfg):
        t0 = time.perf_counter()
        runs[name] = _prune_curve(model, cfg, name, score, evals, saved, on_save, progress)
        method = name.partition(":")[0]
        method_s[method] = method_s.get(method, 0.0) + time.perf_counter() - t0
    table = _curve_table(runs)
    per_layer = None
    if cfg.per_layer:
        t0 = time.perf_counter()
        per_layer = saved.get("per_layer") or per_layer_best_head(model, evals["natural"], progress=progress)
        saved["per_layer"] = per_layer
        if on_save is not None:
            on_save(saved)
        method_s["per_layer"] = time.perf_counter() - t0
    pruned = info = None
    if cfg.save_pruned:
        pruned, info = _save_pruned(model, cfg, runs, evals)
    return PruneResult(
        cfg,
        spec,
        runs,
        table,
        list(score.tokens.shape),
        list(evals["natural"].tokens.shape),
        repeated,
        str(model.device),
        model.self_check.to_dict(),
        per_layer,
        pruned,
        info,
        getattr(model, "tokenizer", None),
        time.perf_counter() - t_start,
        method_s=method_s,
        natural_text=natural,
        natural_untrusted=unknown_text_reason(model, natural),
    )


prune = options.command_function(
    PruneConfig, run, "prune", "Pruning methods compared on one curve (no checkpoint)", "``step_fraction=0.25``"
)
"""``headprobe prune`` as a function: :func:`headprobe.options.command_function` over :func:`run`."""
