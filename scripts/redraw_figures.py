"""Redraw the committed study, training, prune, circuit, diff, atlas, kv, ablate, robustness and scan figures from the numbers their runs saved.

Usage: ``.venv/bin/python scripts/redraw_figures.py [--check] [figures | figures/RUN]``

For maintainers: when the figure code changes (style, legends, formats), the committed figures
of the long runs (``headprobe study`` ~10 min, ``train``, the 5-9 minute ``make demo`` scan) are
redrawn from their saved tables with the same result objects the commands use, instead of
rerunning the runs; the numbers and the tables are not touched. Writes PNG, PDF and SVG beside
the old ones.

A scan directory (``summary.json`` + ``head_scores.csv``, e.g. figures/smollm2-135m) is redrawn
from its head_scores.csv (the heatmaps and the overview) and, for the example patterns and the
K-composition, from its model, loaded as summary.json's config says: those come from a forward
pass on the scan's own first sequences (rebuilt from the seed) and from the weights, the
functions the scan calls. The overview outlines the heads each type's verification ablated and
titles its verdict, read from summary.json's ``ablations``, and the ablation figure and its caption
(ablation.caption.txt) are drawn from those rows (every control set's effect is saved there). The
redraw checks that it reproduces the run (the same top heads as summary.json, each type's ablated
heads the top k of the saved table, the same K-composition numbers, the patterns of patterns.npz to
its uint8 precision) and stops otherwise.

A kv directory (``summary.json`` + ``curve.csv``) is redrawn from its curve.csv and summary.json's
model and config (:func:`redraw_kv`), an ablate directory (``summary.json`` + ``head_ablation.csv``)
from its table (:func:`redraw_ablate`), a robustness directory from its robustness.csv and summary.json
(:func:`redraw_robustness`) and a ``prune --per-layer`` directory's per_layer figure from its per_layer.csv
(:func:`redraw_per_layer`) and a circuit directory (``summary.json`` + ``edges.csv``) from its edges.csv and
path_patching.csv (:func:`redraw_circuit`), each with the function the command draws with. A run kept inside another's
folder (figures/smollm2-135m/prune-per-layer) is found there too (:func:`_run_dirs`).

``--check`` writes nothing: it draws each scan, kv, ablate, robustness, per-layer prune and circuit directory's
figures as PNGs (a scan's ablation caption as text) elsewhere
and says which committed PNG differs from them (:func:`check_scan`, :func:`check_run`; exit status 1
if one does): whether the committed figures still are what the code draws. Other runs are named as
not checked (their tables are rounded to 5 decimals, so a redraw differs from the run's own figure by
a little).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

import pandas as pd


def redraw_study(d: Path) -> list[Path]:
    from headprobe.analyses.figures import save_figure
    from headprobe.commands.study import StudyConfig, StudyResult

    meta = json.loads((d / "study.json").read_text())
    fields = set(StudyConfig.__dataclass_fields__)
    base = {k: v for k, v in meta["base"].items() if k in fields}
    grid = {
        k: tuple(meta[k]) if isinstance(meta[k], list) else meta[k]
        for k in ("n_heads_list", "ranks", "rope")
        if k in meta
    }
    config = StudyConfig(**{**base, **grid, "which": meta["which"], "seeds": tuple(meta["seeds"])})
    result = StudyResult(config, pd.read_csv(d / "results.csv"))
    return [p for name, fig in result.figures().items() for p in save_figure(fig, d / name)]


def redraw_train(d: Path) -> list[Path]:
    from headprobe.analyses.figures import save_figure
    from headprobe.analyses.train import TrainConfig
    from headprobe.commands.train import TrainResult
    from headprobe.probe.backends.loading import load_model

    config = TrainConfig(**json.loads((d / "config.json").read_text())["train"])
    result = TrainResult(
        config=config,
        loaded=load_model(str(d), quiet=True),
        log=pd.read_csv(d / "train_log.csv"),
        final_scores={},
        seconds=0.0,
        device="cpu",
    )
    return [p for name, fig in result.figures().items() for p in save_figure(fig, d / name)]


def redraw_circuit(d: Path, out: Path | None = None, formats=None) -> list[Path]:
    """Redraw a circuit run's figures with today's figure code, into ``out`` (default ``d``): circuit
    from its edges.csv (:func:`headprobe.commands.circuit_core.circuit_figure`) and, where the run had
    ``--receivers``, path_patching from its path_patching.csv
    (:func:`headprobe.commands.circuit_core.path_patching_figure`), what the command draws; the model's
    name, weights and shape from summary.json. No model is loaded (``--check`` compares them)."""
    from headprobe.commands.circuit_core import circuit_figure, path_patching_figure

    meta = json.loads((d / "summary.json").read_text())
    lay, cfg = meta["layout"], meta["config"]
    edges = pd.read_csv(d / "edges.csv")
    weights = meta.get("weights_precision") or ""
    shape = (meta["model"], lay["n_layers"], lay["n_heads"], weights)
    figs = {"circuit": circuit_figure(edges, cfg["top"], cfg["method"], *shape)}
    if (d / "path_patching.csv").is_file():  # heads as written ("16.10" is no float)
        paths = pd.read_csv(d / "path_patching.csv", dtype={"receiver": str, "sender": str})
        figs["path_patching"] = path_patching_figure(paths, cfg["method"], *shape)
    return _save(figs, d, out, formats)


def redraw_diff(d: Path) -> list[Path]:
    """A ``headprobe diff`` folder's diff.png from its diff.csv and summary.json
    (:func:`headprobe.commands.diff_drawing.redraw`), once each quantity's largest change in diff.csv
    is the one summary.json recorded (to diff.csv's 6 digits)."""
    import numpy as np

    from headprobe.analyses.figures import save_figure
    from headprobe.commands.diff_drawing import redraw

    summary, table = json.loads((d / "summary.json").read_text()), pd.read_csv(d / "diff.csv")
    for q, v in summary["quantities"].items():
        largest = float(np.nanmax(np.abs(table[f"{q}_change"])))
        if not np.isclose(largest, v["max_abs_change"], rtol=1e-5, atol=1e-12):
            raise SystemExit(
                f"{d}: {q}'s largest change is {largest:.6g} in diff.csv, {v['max_abs_change']:.6g} in summary.json"
            )
    return [p for name, fig in redraw(d).items() for p in save_figure(fig, d / name)]


def redraw_prune(d: Path) -> list[Path]:
    """Redraw a prune run's pruning_curve figure from its pruning_curve.csv and summary.json with
    today's figure code (the curves as :meth:`PruneResult.figures` draws them: Michel and L0 as lines,
    random orders as a band over seeds, the saved model's star; the same title and axis labels).
    Reads the first CSV layout too (``order`` importance/random, ``induction_loss``)."""
    import numpy as np

    from headprobe.analyses import figures as figs
    from headprobe.commands.prune_core import METRICS, figure_labels, method_label

    t = pd.read_csv(d / "pruning_curve.csv").rename(columns={"induction_loss": "repeated_loss"})
    if "order" in t.columns:  # importance (Michel's) and one random order
        t = t.assign(method=t["order"].map({"importance": "michel", "random": "random"}), seed=0)
    summary = json.loads((d / "summary.json").read_text())
    rescore = summary["config"].get("rescore", True)
    curves, bands = [], []
    for method in dict.fromkeys(t["method"]):
        rows = t[t["method"] == method]
        runs = [g.sort_values("step") for _, g in rows.groupby(rows["seed"].fillna(0))]
        frac = runs[0]["fraction_pruned"].to_numpy()
        label = method_label(method, rescore)
        if method == "random":
            bands.append((label, frac, {c: np.stack([r[c].to_numpy() for r in runs]) for c, _ in METRICS}))
        else:
            curves.append((label, frac, {c: runs[0][c].to_numpy() for c, _ in METRICS}))
    dtype = summary.get("dtype") or summary["config"].get("dtype", "float32")
    total = summary.get("n_heads_total", 0)
    title, xlabel, saved = figure_labels(
        figs.title_name(summary["model"], summary["weights_precision"]),
        figs.weights_label(summary["weights_precision"]),
        dtype,
        summary.get("n_heads_present", total),
        total,
        summary.get("pruned_model"),
    )
    fig = figs.pruning_methods_plot(curves, bands, METRICS, title, saved=saved, xlabel=xlabel)
    return figs.save_figure(fig, d / "pruning_curve")


def _save(figures: dict, d: Path, out: Path | None, formats) -> list[Path]:
    """Save ``figures`` (``{stem: Figure}``) into ``out`` (default ``d``) in ``formats`` (None: the
    formats ``d`` holds of each, else ``$HEADPROBE_FIGURE_FORMATS`` or all three)."""
    from headprobe.analyses.figures import FORMATS, save_figure

    written = []
    for name, fig in figures.items():
        kept = [f for f in FORMATS if (d / f"{name}.{f}").is_file()]
        written += save_figure(fig, (out or d) / name, formats=formats or kept or None)
    return written


def redraw_kv(d: Path, out: Path | None = None, formats=None) -> list[Path]:
    """Redraw a kv run's kv_curve figure from its curve.csv and summary.json (model, weights, config, sample sizes) with
    today's figure code (:func:`headprobe.commands.kv_core.curve_figure`, what the command draws), into
    ``out`` (default ``d``). A curve.csv written before the ``uniform_window`` column draws the
    uniform entry without W'."""
    from headprobe.commands.kv_core import curve_figure

    meta = json.loads((d / "summary.json").read_text())
    rows = pd.read_csv(d / "curve.csv").to_dict("records")
    return _save({"kv_curve": curve_figure(rows, meta)}, d, out, formats)


def redraw_ablate(d: Path, out: Path | None = None, formats=None) -> list[Path]:
    """Redraw an ablate run's figures (ablation_effect and importance_vs_exact, or ablation_estimate with
    ``--estimate``) from its head_ablation.csv and summary.json (model, weights, ablation kind, removed
    heads, token counts) with today's
    figure code (:func:`headprobe.commands.ablate_core.ablation_figures`, what the command draws),
    into ``out`` (default ``d``)."""
    from headprobe.analyses.figures import model_tag, removed_cells
    from headprobe.commands.ablate_core import ESTIMATE_COLUMN, ablation_figures
    from headprobe.probe.core.heads import parse_heads

    meta, t = json.loads((d / "summary.json").read_text()), pd.read_csv(d / "head_ablation.csv")
    shape = (int(t["layer"].max()) + 1, int(t["head"].max()) + 1)
    t = t.sort_values(["layer", "head"])
    estimate = meta["config"].get("estimate")
    column = ESTIMATE_COLUMN[estimate] if estimate else "loss_delta"
    maps = [t[f"{task}_{column}"].to_numpy(dtype=float).reshape(shape) for task in ("natural", "repeated")]
    removed = parse_heads(",".join(meta.get("removed_heads", [])), *shape) if meta.get("removed_heads") else []
    tag = f"{model_tag(meta['model'], meta['weights_precision'])}, {meta['config']['kind']}-ablated"
    group_size = shape[1] // (int(t["kv_head"].max()) + 1)
    table = None if estimate else t  # importance_vs_exact: from the table alone
    figures = ablation_figures(
        maps, tag, group_size, removed_cells(*shape, removed), estimate, table=table, tokens=meta.get("tokens")
    )
    return _save(figures, d, out, formats)


def redraw_robustness(d: Path, out: Path | None = None, formats=None) -> list[Path]:
    """Redraw a robustness run's figure from its robustness.csv and summary.json (each type's record, the
    conditions in their order, the model, k) with today's figure code
    (:func:`headprobe.commands.robustness_core.stability_plot`, what the command draws), into ``out``
    (default ``d``)."""
    from headprobe.commands.robustness_core import stability_plot

    meta = json.loads((d / "summary.json").read_text())
    conds = [c["name"] for c in meta["conditions"]]
    table = pd.read_csv(d / "robustness.csv")
    fig = stability_plot(
        table, meta["types"], conds, meta["model"], meta["config"]["k"], meta.get("weights_precision", "")
    )
    return _save({"robustness": fig}, d, out, formats)


def redraw_per_layer(d: Path, out: Path | None = None, formats=None) -> list[Path]:
    """Redraw a ``prune --per-layer`` run's per_layer figure from its per_layer.csv and summary.json's model
    and weights with today's figure code (:func:`headprobe.commands.prune_core.per_layer_figure`, what the
    command draws), into ``out`` (default ``d``)."""
    from headprobe.commands.prune_core import per_layer_figure

    meta = json.loads((d / "summary.json").read_text())
    fig = per_layer_figure(pd.read_csv(d / "per_layer.csv"), meta["model"], meta["weights_precision"])
    return _save({"per_layer": fig}, d, out, formats)


def redraw_atlas(d: Path) -> list[Path]:
    """Redraw an atlas's figures from its atlas.csv with today's figure code (the figures
    :meth:`AtlasResult.figures` draws from the table), each only where the run wrote it and in the
    formats it wrote."""
    from headprobe.analyses.figures import FORMATS, save_figure
    from headprobe.commands.atlas_core import AtlasResult

    table = pd.read_csv(d / "atlas.csv")
    written = []
    for name, fig in AtlasResult(None, table, {}, d).figures().items():  # type: ignore[arg-type]
        formats = [f for f in FORMATS if (d / f"{name}.{f}").is_file()]
        if formats:  # the formats the run wrote of this figure, whatever $HEADPROBE_FIGURE_FORMATS says
            written += save_figure(fig, d / name, formats=formats)
    return written


def _check_patterns(d: Path, examples: dict, fail) -> None:
    """Call ``fail`` where a recomputed example pattern (``examples``, as
    :func:`~headprobe.analyses.scoring.example_patterns`) is not the run's own attention, to
    patterns.npz's uint8 steps (1/255); nothing to compare without patterns.npz or beyond its length."""
    import numpy as np

    from headprobe.analyses import viewer
    from headprobe.analyses.detectors import DETECTORS

    saved = viewer.load_patterns(d / "patterns.npz") if (d / "patterns.npz").is_file() else {}
    for name, ex in examples.items():
        kept = saved.get(DETECTORS[name].dataset)
        rows, cols = ex["positions"]
        if kept is not None and max(max(rows), max(cols)) < kept["pattern"].shape[-1]:
            layer, head = ex["head"]
            diff = np.abs(
                np.asarray(kept["pattern"][layer, head], dtype=float)[np.ix_(rows, cols)] - ex["pattern"]
            ).max()
            if diff > 1 / 255:
                fail(f"{name} pattern differs from patterns.npz by {diff:.4f}")


def scan_result(d: Path, model=None, with_composition: bool = True):
    """The :class:`~headprobe.commands.scan.ScanResult` a scan directory's figures are drawn from (see
    the module docstring): its saved numbers, the patterns and (``with_composition``; 8 s of
    SmolLM2-135M's 9) the K-composition recomputed with ``model`` (None: loaded as summary.json's
    config says).

    Raises:
        SystemExit: the redraw does not reproduce the run's numbers.
    """
    import torch

    from headprobe import options
    from headprobe.analyses import metrics as head_metrics
    from headprobe.analyses.ablation import Verification, top_heads
    from headprobe.analyses.data import natural_text_tokens, read_text_file, repeated_random_tokens
    from headprobe.analyses.detectors import DETECTORS
    from headprobe.analyses.scoring import example_patterns
    from headprobe.analyses.verdicts import NoVerdictWarning
    from headprobe.commands.scan import ScanConfig, ScanResult
    from headprobe.probe.core.heads import format_head

    summary = json.loads((d / "summary.json").read_text())
    table = pd.read_csv(d / "head_scores.csv")
    fields = set(ScanConfig.__dataclass_fields__)
    config = ScanConfig(**{k: v for k, v in summary["config"].items() if k in fields})
    model = model if model is not None else options.load_for(config)
    spec = model.spec
    shape = (spec.n_layers, spec.n_heads)
    scores = {c: table[c].to_numpy().reshape(shape) for c in table.columns if c not in ("layer", "head", "kv_head")}

    def fail(what: str):
        raise SystemExit(f"{d}: the redraw does not reproduce the run ({what}); rerun the scan instead")

    text = read_text_file(config.text) if config.text else None
    natural = natural_text_tokens(
        model, config.n_natural, config.seq_len, config.seed, text, source=str(config.text) if config.text else None
    )
    repeated = repeated_random_tokens(model, config.n_repeated, config.period, config.seed)
    best = {name: top_heads(torch.tensor(scores[DETECTORS[name].rank_by]), 1)[0] for name in config.types}
    for name, head in best.items():
        if format_head(head) != summary["top_heads"][name][0]["head"]:
            fail(f"top {name} head {format_head(head)}, summary.json {summary['top_heads'][name][0]['head']}")
    examples = example_patterns(model, best, natural, repeated)
    _check_patterns(d, examples, fail)
    composition = head_metrics.scan_composition(model) if config.metrics and with_composition else None
    recorded = summary.get("metrics", {}).get("k_composition_previous_token_to_induction")
    if composition is not None and recorded is not None:
        prev = top_heads(torch.tensor(scores["previous_token"]), 5)
        ind = top_heads(torch.tensor(scores["induction"]), 5)
        if head_metrics.composition_summary(composition["k"], prev, ind) != recorded:
            fail("K-composition")
    verifications = [Verification.from_dict(row) for row in summary.get("ablations", [])]
    for v in verifications:  # the overview outlines each type's ablated heads: the top k of its saved scores
        top = [format_head(h) for h in top_heads(torch.tensor(scores[DETECTORS[v.head_type].rank_by]), v.k)]
        if set(top) != set(v.top_heads):
            fail(f"{v.head_type} ablated {', '.join(v.top_heads)}, the table's top {v.k} {', '.join(top)}")
    return ScanResult(
        config,
        spec,
        table,
        scores,
        verifications,
        summary.get("clean_loss_nats") or {},  # null for an encoder (no loss measured); the figures do not read it
        natural,
        repeated,
        examples,
        {},
        warnings=[NoVerdictWarning.from_text(w) for w in summary.get("warnings", [])],  # the lines, as fields
        composition=composition,
        verification=summary.get("verification", {}),
    )


def redraw_scan(
    d: Path,
    model=None,
    stems: Sequence[str] | None = None,
    out: Path | None = None,
    formats: str | Sequence[str] | None = None,
) -> list[Path]:
    """Redraw a scan's figures (see the module docstring) into ``out`` (default: ``d``), those of
    ``stems`` only where given, in ``formats`` (as :func:`~headprobe.analyses.figures.save_figure`;
    None: ``$HEADPROBE_FIGURE_FORMATS`` or all three); ``model`` as :func:`scan_result`. With the
    ablation figure, its caption (ablation.caption.txt, :func:`~headprobe.analyses.figures.ablation_caption`,
    its rows in the figure's order) too. Returns the paths.

    Raises:
        SystemExit: the redraw does not reproduce the run's numbers.
    """
    from headprobe.analyses.figures import ablation_caption, save_figure
    from headprobe.commands.scan_core import ablation_rows, figure_makers

    result = scan_result(d, model, with_composition=stems is None or "composition_k" in stems)
    makers = figure_makers(result)
    chosen = [stem for stem in makers if stems is None or stem in stems]
    written = [p for stem in chosen for p in save_figure(makers[stem](), (out or d) / stem, formats=formats)]
    if "ablation" in chosen:  # the caption lists the rows as the figure does
        caption = (out or d) / "ablation.caption.txt"
        caption.write_text(ablation_caption(ablation_rows(result), result.verification, rule=result.rule))
        written.append(caption)
    return written


def _kind(d: Path) -> str | None:
    """Which command's run directory ``d`` is, by the files it holds: ``scan``, ``kv``, ``ablate``,
    ``robustness``, ``per_layer`` (a ``prune --per-layer`` run) or ``circuit`` (the runs ``--check`` compares), or None."""
    if not (d / "summary.json").is_file():
        return None
    tables = (
        ("scan", "head_scores.csv"),
        ("kv", "curve.csv"),
        ("ablate", "head_ablation.csv"),
        ("robustness", "robustness.csv"),
        ("per_layer", "per_layer.csv"),
        ("circuit", "edges.csv"),
    )
    for kind, table in tables:
        if (d / table).is_file():
            return kind
    return None


def check_run(d: Path, redraw, tol: float = 1.0) -> list[str]:
    """Whether a run directory's committed PNGs are what ``redraw`` (:func:`redraw_kv`,
    :func:`redraw_ablate`; ``redraw(d, out, formats)``) draws today: drawn as PNGs into a temporary
    folder and compared as :func:`check_scan` does. Returns one line per figure that differs or is
    missing (empty: all equal)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        return _differ(d, redraw(d, Path(tmp), "png"), tol)


def _differ(d: Path, drawn: list[Path], tol: float) -> list[str]:
    """One line per PNG of ``drawn`` whose namesake in ``d`` is missing or differs (:func:`_compare`),
    and per text file (a caption) that is not byte for byte the committed one."""
    out = []
    for p in drawn:
        kept = d / p.name
        if not kept.is_file():
            out.append(f"{kept}: not committed")
        elif p.suffix != ".png":
            if kept.read_bytes() != p.read_bytes():
                out.append(f"{kept}: differs from today's text")
        elif (why := _compare(kept, p, tol)) is not None:
            out.append(f"{kept}: differs from today's drawing ({why})")
    return out


def check_scan(d: Path, model=None, stems: Sequence[str] | None = None, tol: float = 1.0) -> list[str]:
    """Whether a scan directory's committed PNGs are what today's code draws from its numbers: each
    figure :func:`redraw_scan` draws (``stems`` only, where given) is drawn as a PNG into a temporary
    folder and compared with ``d``'s by matplotlib's image comparison (RMS of the pixel differences,
    0-255, at most ``tol``: the same figure drawn by another matplotlib or FreeType differs by a few
    anti-aliased pixels). Returns one line per figure that differs or is missing (empty: all equal).

    Raises:
        SystemExit: the redraw does not reproduce the run's numbers.
    """
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        return _differ(d, redraw_scan(d, model, stems, Path(tmp), formats="png"), tol)


def _compare(expected: Path, actual: Path, tol: float) -> str | None:
    """matplotlib's image comparison of two PNGs: None where equal to ``tol``, else why, in one line."""
    from matplotlib.testing.compare import compare_images
    from matplotlib.testing.exceptions import ImageComparisonFailure

    try:
        why = compare_images(str(expected), str(actual), tol)
    except ImageComparisonFailure as e:  # raised, not returned, for images of different sizes
        why = str(e)
    return None if why is None else why.splitlines()[0]


REDRAWS = {
    "kv": redraw_kv,
    "ablate": redraw_ablate,
    "robustness": redraw_robustness,
    "per_layer": redraw_per_layer,
    "circuit": redraw_circuit,
}
"""The redraw of each kind of run (:func:`_kind`) but scan, which ``--check`` compares with :func:`check_run`."""
RUN_FILES = ("study.json", "train_log.csv", "summary.json")
"""A run's own directory holds one of these."""


def _run_dirs(root: Path) -> list[Path]:
    """The directories :func:`main` redraws or checks: ``root`` where it is a run's (:data:`RUN_FILES`),
    else each folder in it; after each run, the runs kept inside it (``figures/smollm2-135m/prune-per-layer``,
    a prune run beside the scan it was made for), which a loop over ``figures/`` alone passed by."""
    is_run = lambda p: any((p / f).is_file() for f in RUN_FILES)
    tops = [root] if is_run(root) else sorted(p for p in root.iterdir() if p.is_dir())
    out = []
    for d in tops:
        out.append(d)
        if is_run(d):
            out += sorted(p for p in d.iterdir() if p.is_dir() and is_run(p))
    return out


def main(argv: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(
        prog="redraw_figures.py",
        allow_abbrev=False,  # as headprobe's commands and benchmarks/: --che is no --check
        description="Redraw committed figures from the numbers their runs saved.",
    )
    parser.add_argument("root", nargs="?", default="figures", help="a run's directory or a folder of them (figures)")
    parser.add_argument(
        "--check",
        action="store_true",
        help="write nothing; say which committed PNG differs (scan, kv, ablate, robustness, per-layer prune, circuit runs)",
    )
    args = parser.parse_args(argv)
    check, root = args.check, Path(args.root)
    if not root.is_dir():
        parser.error(f"{root} is not a directory")
    written, differ, unchecked = [], [], []
    for d in _run_dirs(root):
        kind = _kind(d)
        if check:
            if kind == "scan":
                differ += check_scan(d)
            elif kind is not None:
                differ += check_run(d, REDRAWS[kind])
            else:
                unchecked.append(d.name if d == root else str(d.relative_to(root)))
        elif (d / "study.json").is_file():
            written += redraw_study(d)
        elif (d / "train_log.csv").is_file():
            written += redraw_train(d)
        elif kind == "scan":
            written += redraw_scan(d)
        elif kind is not None:
            written += REDRAWS[kind](d)
            if (d / "pruning_curve.csv").is_file():  # a prune run with --per-layer: its curves too
                written += redraw_prune(d)
        elif (d / "pruning_curve.csv").is_file():
            written += redraw_prune(d)
        elif (d / "diff.csv").is_file():
            written += redraw_diff(d)
        elif (d / "atlas.csv").is_file():
            written += redraw_atlas(d)
    for line in [str(p) for p in written] + differ:
        print(line)
    if unchecked:
        print(
            f"not checked (--check compares scan, kv, ablate, robustness, per-layer prune, circuit runs): {', '.join(unchecked)}"
        )
    if differ:
        raise SystemExit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
