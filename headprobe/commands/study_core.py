"""The run, the Result and the Python function of ``headprobe study`` (:mod:`headprobe.commands.study`
holds the settings and the flags; this module imports pandas, matplotlib and, once training, torch)."""

from __future__ import annotations

import dataclasses
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import pandas as pd

from headprobe.analyses import figures
from headprobe.analyses.outputs import WritesOutputs
from headprobe.analyses.statistics import interval_rule, mean_ci, no_interval_reason
from headprobe.analyses.study_table import (
    FORMED_BY,
    HEADLINE_COLUMNS,
    REPORT_COLUMNS,
    REPORT_DIGITS,
    formed_column,
    formed_in_every_seed,
    variant_stats,
)
from headprobe.analyses.train_config import INDUCTION_FORMED, TrainConfig
from headprobe.commands.study import CONTEXT, StudyConfig, layout_of
from headprobe.options import check_fields, config_inputs, notes_flags, reports_for_readers
from headprobe.probe.core.io import cpu_kernels, models_self_check, summary_envelope
from headprobe.probe.core.reprs import CompactRepr
from headprobe.probe.layout.cost import attention_params_per_layer, kv_bytes_per_request, kv_bytes_per_token

__all__ = ["StudyResult", "headline", "run", "run_study", "study", "study_figure"]


def run_study(runs: list[tuple[str, TrainConfig]], seeds: list[int], progress: bool = False) -> pd.DataFrame:
    """Train every (label, config) of ``runs`` once per seed; one row per run: the variant, its
    layout and cost columns (:mod:`headprobe.probe.layout.cost`), the last evaluation's losses (nats/token)
    and scores, seconds and the self-check. ``progress`` prints one line per run."""
    from headprobe.analyses.train import induction_formed, training_tokenizer
    from headprobe.analyses.train import train as train_model  # torch: only when training

    rows: list[dict] = []
    total, started = len(runs) * len(seeds), time.perf_counter()
    if progress:
        print(
            f"training {total} runs ({len(runs)} variants x {len(seeds)} seed{'s' * (len(seeds) > 1)}: "
            f"{', '.join(r[0] for r in runs)}), "
            f"{runs[0][1].steps} steps each; one line as each run ends",
            flush=True,
        )
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = training_tokenizer(runs[0][1], tmp)  # every variant shares corpus and vocabulary
        for label, cfg in runs:
            for seed in seeds:
                t0 = time.perf_counter()
                r = train_model(dataclasses.replace(cfg, seed=seed), tokenizer)
                last = r.log.iloc[-1]
                lay = layout_of(cfg)
                rows.append(
                    {
                        "variant": label,
                        "kind": lay.kind,
                        "n_heads": cfg.n_heads,
                        "n_kv_heads": None if lay.is_mla else lay.n_kv_heads,  # MLA caches a latent, not heads
                        "kv_lora_rank": cfg.kv_lora_rank,
                        "seed": seed,
                        "corpus": cfg.corpus,
                        "steps": cfg.steps,
                        "attn_params_per_layer": attention_params_per_layer(lay),
                        "model_params": r.loaded.n_params,
                        "kv_bytes_per_token": kv_bytes_per_token(lay),
                        f"kv_bytes_at_{CONTEXT}": kv_bytes_per_request(lay, CONTEXT),
                        "eval_loss": float(last["eval_loss"]),
                        "in_context_loss": float(last["in_context_loss"]),
                        "text_in_context_loss": float(last.get("text_in_context_loss", float("nan"))),
                        "repeated_loss": float(last["repeated_loss"]),
                        "max_induction": float(last["max_induction"]),
                        "induction_ci95_low": induction_formed(r.final_scores["induction_per_sequence"])["ci95"][0],
                        "max_previous_token": float(last["max_previous_token"]),
                        "seconds": time.perf_counter() - t0,
                        "device": r.device,
                        "self_check_ok": r.loaded.self_check.ok,
                        "self_check_max_relative_error": r.loaded.self_check.max_relative_error,
                    }
                )
                if progress:
                    _progress_line(rows[-1], len(rows), total, time.perf_counter() - started)
    return pd.DataFrame(rows).astype({"n_kv_heads": "Int64", "kv_lora_rank": "Int64"})  # integers, blank if none


def _progress_line(x: dict, done: int, total: int, elapsed: float) -> None:
    """One finished run of :func:`run_study`: its numbers, ``done`` of ``total``, and the time the rest
    take at the mean pace so far (``elapsed`` seconds; runs differ in size, so a rough guide)."""
    rest = elapsed / done * (total - done)
    left = "" if done == total else f", about {rest / 60:.0f} min left" if rest >= 90 else f", about {rest:.0f} s left"
    print(
        f"{x['variant']:<16} seed {x['seed']}: loss {x['eval_loss']:.3f}  in-context {x['in_context_loss']:+.3f}  "
        f"induction {x['max_induction']:.2f}  KV/token {x['kv_bytes_per_token']} B  ({x['seconds']:.0f} s; "
        f"{done}/{total}{left})",
        flush=True,
    )


def headline(which: str, table: pd.DataFrame) -> dict:
    """Per-variant means and, for layouts, the smallest MLA rank whose cache is below 1/8 of MHA's."""
    stats = variant_stats(table)
    agg = stats[list(HEADLINE_COLUMNS)]
    n_seeds = stats["n_seeds"]
    one_seed = "undefined: one seed; a standard deviation over seeds needs at least 2 (--seeds)"
    out: dict[str, Any] = {
        "per_variant": {
            k: {
                **{c: (None if pd.isna(v) else round(float(v), 4)) for c, v in row.items()},
                **({"sd_null_reason": one_seed} if n_seeds[k] < 2 else {}),
            }
            for k, row in agg.iterrows()
        }
    }
    if which == "layouts" and "MHA" in agg.index:
        mha = agg.loc["MHA"]
        mla = agg[[v.startswith("MLA") for v in agg.index]]
        small = mla[mla["kv_bytes_per_token"] < mha["kv_bytes_per_token"] / 8]
        if len(small):
            best = small["eval_loss"].idxmin()
            paired = _paired_gaps(table, best, "MHA")
            out["mla_below_one_eighth"] = {
                "variant": best,
                "kv_fraction_of_mha": round(
                    float(small.loc[best, "kv_bytes_per_token"] / mha["kv_bytes_per_token"]), 4
                ),
                "loss_gap_vs_mha": round(float(small.loc[best, "eval_loss"] - mha["eval_loss"]), 4),
                "mha_loss_seed_sd": None if pd.isna(mha["eval_loss_sd"]) else round(float(mha["eval_loss_sd"]), 4),
                **({"mha_loss_seed_sd_null_reason": one_seed} if pd.isna(mha["eval_loss_sd"]) else {}),
                # the held-out loss alone hides a missing induction circuit: report the in-context loss too
                "in_context_loss_gap_vs_mha": round(
                    float(small.loc[best, "in_context_loss"] - mha["in_context_loss"]), 4
                ),
                **paired,
                "selection": (
                    "the variant of lowest mean held-out loss among the ranks below 1/8, picked on the same "
                    "evaluations its gaps are measured on: the gaps lean in its favour and their intervals "
                    "do not account for the choice"
                ),
                "induction_formed": bool(formed_in_every_seed(table)[best]),
                "every_rank_below": {
                    v: {
                        "eval_loss": round(float(r["eval_loss"]), 4),
                        "in_context_loss": round(float(r["in_context_loss"]), 4),
                        "max_induction": round(float(r["max_induction"]), 4),
                    }
                    for v, r in small.iterrows()
                },
            }
        else:
            out["mla_below_one_eighth"] = None
            out["mla_below_one_eighth_null_reason"] = (
                "no MLA rank of --ranks has a KV cache below 1/8 of MHA's "
                f"({float(mha['kv_bytes_per_token']) / 8:g} bytes per token)"
                if len(mla)
                else "no MLA variant (--ranks none)"
            )
    return out


def _paired_gaps(table: pd.DataFrame, variant: str, reference: str) -> dict:
    """The 95% Student-t intervals (:func:`~headprobe.analyses.statistics.mean_ci` over seeds) of
    ``variant``'s held-out and in-context loss gaps to ``reference``, paired seed by seed (the seeds
    both ran): ``loss_gap_vs_mha_ci95``, ``in_context_loss_gap_vs_mha_ci95`` (nats, None from fewer
    than 2 seeds, with ``ci95_null_reason``), ``n_paired_seeds`` and ``interval_rule``."""
    cols = ["eval_loss", "in_context_loss"]
    a = table[table["variant"] == variant].set_index("seed")[cols]
    b = table[table["variant"] == reference].set_index("seed")[cols]
    gaps = (a - b).dropna()  # seed by seed, on the seeds both ran
    ci = mean_ci(gaps.to_numpy())
    reason = no_interval_reason(len(gaps), "seeds")
    rounded = [None if reason else [round(float(x), 4) for x in ci[:, j]] for j in range(len(cols))]
    return {
        "loss_gap_vs_mha_ci95": rounded[0],
        "in_context_loss_gap_vs_mha_ci95": rounded[1],
        **({"ci95_null_reason": reason} if reason else {}),
        "n_paired_seeds": len(gaps),
        "interval_rule": "of the per-seed gaps (the variant's loss minus MHA's, same seed): " + interval_rule("seeds"),
    }


def study_figure(which: str, table: pd.DataFrame, title: str):
    """The study's figure from its ``results.csv`` table, as ``(name, Figure)``: ``loss_vs_heads``
    (held-out loss and in-context loss against heads, every seed shown) or ``quality_vs_kv`` (mean
    held-out loss and in-context loss, each with the seed range, against KV cache per token; a filled marker: some head's
    induction head formed in every seed, :func:`formed_in_every_seed`, the rule of study.json's ``induction_formed``)."""
    label = "held-out text loss (nats/char)" if (table["corpus"] == "text+copy").all() else "held-out loss (nats/token)"
    if which == "heads":
        fig = figures.loss_vs_heads(
            table["n_heads"].to_numpy(),
            table["eval_loss"].to_numpy(),
            title,
            table["in_context_loss"].to_numpy(),
            label,
        )
        return "loss_vs_heads", fig
    stats = variant_stats(table)  # the report's and the LaTeX table's own aggregation
    fig = figures.quality_vs_kv(
        list(stats.index),
        stats["kv_bytes_per_token"].to_numpy(),
        stats["eval_loss"].to_numpy(),
        stats["eval_loss_min"].to_numpy(),
        stats["eval_loss_max"].to_numpy(),
        title,
        label,
        formed=formed_in_every_seed(table)[stats.index].to_numpy(),
        n_seeds=int(stats["n_seeds"].min()),
        formed_by=FORMED_BY[formed_column(table)],
        in_context=(
            stats["in_context_loss"].to_numpy(),
            stats["in_context_loss_min"].to_numpy(),
            stats["in_context_loss_max"].to_numpy(),
        ),
    )
    return "quality_vs_kv", fig


@dataclass(repr=False)
class StudyResult(CompactRepr, WritesOutputs):
    """A finished study.

    Attributes:
        config: the settings it ran with.
        table: one row per (variant, seed) run, as :func:`run_study` builds it (results.csv).
    """

    config: StudyConfig
    table: pd.DataFrame

    def summary(self) -> dict:
        """The content of study.json: the study, seeds, the shared training settings (``base``), the
        grid and the headline numbers of :func:`headline`, in the summary envelope
        (:func:`~headprobe.probe.core.io.summary_envelope`: no one model, so ``model`` and
        ``weights_precision`` are null; the self-check over every trained model; ``timings_s``:
        ``train_s``, the runs' training time). Runs on the CPU also record ``cpu_threads`` (torch's
        intra-op threads) and ``cpu_capability`` (the vector kernels torch picked, e.g. ``AVX512``):
        float32 training sums in an order both set, so after 1200 steps the losses differ in the
        4th decimal between thread counts or CPUs; a rerun reproduces a table bit for bit only with both equal."""
        c, table = self.config, self.table
        grid = (
            {"n_heads_list": list(c.n_heads_list or ())}
            if c.which == "heads"
            else {"ranks": list(c.ranks or ()), "rope": c.rope}
        )
        base = dataclasses.asdict(c.base())
        if c.which == "heads":
            del base["n_heads"]  # each variant's own: n_heads_list
        self_check = models_self_check(
            {
                f"{r.variant} seed {r.seed}": {
                    "ok": bool(r.self_check_ok),
                    "max_relative_error": None
                    if pd.isna(r.self_check_max_relative_error)
                    else float(r.self_check_max_relative_error),
                }
                for r in table.itertuples()
            },
            "per trained model: patterns and the per-head W_O decomposition (headprobe.probe.hooks.selfcheck)",
        )
        return summary_envelope(
            {
                "which": c.which,
                "seeds": list(c.seeds),
                "base": base,
                **grid,
                **headline(c.which, table),
                **cpu_kernels(list(table["device"]) if "device" in table else "cpu"),
            },
            model=None,
            precision=None,
            device=",".join(sorted(set(table["device"]))) if "device" in table else c.device,
            self_check=self_check,
            config=c,
            timings_s={"train_s": float(table["seconds"].sum())},
        )

    def figures(self) -> dict:
        """``{"loss_vs_heads": Figure}`` or ``{"quality_vs_kv": Figure}`` (see :func:`study_figure`)."""
        c = self.config
        prefix = f"{c.n_heads} heads, " if c.which == "layouts" else ""
        title = (
            f"d_model {c.d_model}, {c.steps} steps, {len(c.seeds)} seed{'s' if len(c.seeds) > 1 else ''}, {c.corpus}"
        )
        name, fig = study_figure(c.which, self.table, prefix + title)
        return {name: fig}

    def outputs(self) -> dict[str, Any]:
        """save's files: results.csv, the figure and, last, study.json."""
        return dict(
            summary=self.summary,
            summary_name="study.json",
            figures=self.figures,
            tables={"results.csv": self.table.to_csv(index=False, float_format="%.5f")},
        )

    @reports_for_readers("study")
    def report(self) -> str:
        """The per-variant means ``headprobe study`` prints (:func:`~headprobe.analyses.study_table.variant_stats`,
        :data:`~headprobe.analyses.study_table.REPORT_COLUMNS`), with the losses' standard deviation over
        seeds (``_sd``) where a variant ran 2+ seeds."""
        stats = variant_stats(self.table)
        means = stats[list(REPORT_COLUMNS)].copy()
        note = self._none_formed_note()
        if stats[["eval_loss_sd", "in_context_loss_sd"]].notna().any().any():
            for c in ("in_context_loss", "eval_loss"):
                means.insert(means.columns.get_loc(c) + 1, f"{c}_sd", stats[f"{c}_sd"].astype(float))
            n = stats["n_seeds"]
            seeds = f"{n.min()}" if n.min() == n.max() else f"{n.min()}-{n.max()}"
            text = f"{means.round(REPORT_DIGITS).to_string(na_rep='n/a')}\n(_sd: standard deviation over {seeds} seeds)"
            return text + note
        return str(means.round(REPORT_DIGITS)) + note

    def _none_formed_note(self) -> str:
        """A NOTE where no variant formed an induction head in any seed: the models compared are all before
        the phase change (at the defaults MHA passes it at steps 600-800, docs/study.md), so the table
        compares models without induction heads."""
        column = formed_column(self.table)
        if (self.table[column] > INDUCTION_FORMED).any():
            return ""
        return (
            f"\nNOTE: no variant formed an induction head in any seed ({column} above {INDUCTION_FORMED}) in "
            f"{self.config.steps} steps: the table compares models before the phase change (at the defaults MHA "
            "passes it at steps 600-800, docs/study.md); train longer (--steps) to compare models that have them"
        )


def run(config: StudyConfig, progress: bool = False) -> StudyResult:
    """Train every variant of ``config`` once per seed (:func:`run_study`); ``progress`` prints one
    line per run. Every setting is checked before any training.

    Raises:
        HeadprobeError: settings that cannot run (:meth:`StudyConfig.validate`), no GPU for
            ``device="cuda"``, a diverged loss.
    """
    config.validate()
    return StudyResult(config, run_study(config.variants(), list(config.seeds), progress))


@notes_flags("study")
def study(which: str, *, progress: bool = False, **config_fields) -> StudyResult:
    """``headprobe.study("layouts", steps=600, seeds=(0,), ...)``: :func:`run` on
    ``StudyConfig(which, **config_fields)`` (see :class:`StudyConfig` for every field and its default).

    Returns:
        StudyResult: ``table`` (results.csv: one row per variant and seed, losses in nats/token or
            nats/char, KV-cache bytes per token); ``save(out)`` writes what ``headprobe study`` writes.

    Raises:
        TypeError: an unknown field (naming the setting meant, :func:`headprobe.options.check_fields`).
        HeadprobeError: as :func:`run`; a message naming flags has a note giving their Python spelling (``e.__notes__``).
    """
    check_fields(StudyConfig, config_fields, "study", positional=("which",), accepts=study)
    config = StudyConfig(which, **config_fields)
    result = run(config, progress=progress)
    result.inputs = config_inputs(config)  # what result.save(overwrite=True) must not remove
    return result
