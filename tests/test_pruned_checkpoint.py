"""``prune`` and ``ablate`` on a pruned checkpoint (``prune --save-pruned``'s directory, reloaded with
``--model DIR``: its removed heads present with zero weights), and what ``prune --save-pruned``
reports of the model it saves. Tiny GQA Llama (2 layers x 8 heads, 2 key/value heads)."""

from __future__ import annotations

import json
import re

import numpy as np
import pandas as pd
import pytest
import torch
import zoo
from matplotlib.colors import to_rgba

from headprobe.cli import main

REMOVED = [(0, 0), (0, 1), (0, 2), (0, 3), (1, 5), (1, 6)]  # a whole key/value group of layer 0, two heads of layer 1
N_PRESENT = 16 - len(REMOVED)
SMALL = ["--seq-len", "16", "--n-natural", "3", "--n-repeated", "2", "--period", "6", "--device", "cpu"]
FAST_L0 = ["--l0-steps", "12", "--l0-lambdas", "10,100"]


def _head(name: str) -> tuple[int, int]:
    layer, head = name.split(".")
    return int(layer), int(head)


@pytest.fixture(scope="module")
def pruned_dir(tiny_dir, tmp_path_factory):
    """The tiny Llama with :data:`REMOVED` removed, saved as ``prune --save-pruned`` saves it."""
    import headprobe
    from headprobe.probe.model.pruned import keep_mask_from, remove_heads, save_pruned_dir

    base = headprobe.load_model(str(tiny_dir), device="cpu", backend="native", quiet=True)
    d = tmp_path_factory.mktemp("pruned") / "pruned_model"
    save_pruned_dir(remove_heads(base.model, keep_mask_from(REMOVED, 2, 8)), d, base.tokenizer, source=str(tiny_dir))
    return d


@pytest.fixture(scope="module")
def prune_of_pruned(pruned_dir, text_file, tmp_path_factory):
    """``prune`` (every method, saving a further-pruned model) run on the pruned checkpoint."""
    out = tmp_path_factory.mktemp("prune-of-pruned") / "out"
    argv = ["prune", "--model", str(pruned_dir), "--out", str(out), "--text", str(text_file), "--n-seeds", "2"]
    argv += ["--step-fraction", "0.2", "--save-pruned", "--save-fraction", "0.4", *FAST_L0, *SMALL]
    assert main(argv) == 0
    return out


def test_prune_of_a_pruned_checkpoint_counts_only_the_heads_it_still_has(prune_of_pruned, capsys):
    """On SmolLM2 pruned once, 56 of 135 "removed" heads were heads already gone (importance 0,
    ranked first) and the curve started at 0 as if none were. Now no curve removes an already
    removed head, counts and fractions are of the checkpoint's remaining heads, and the summary
    says how many were removed before."""
    out = prune_of_pruned
    summary = json.loads((out / "summary.json").read_text())
    gone = set(REMOVED)
    for name, order in summary["removal_order"].items():
        assert not {_head(h) for h in order} & gone, (name, order)
    curve = pd.read_csv(out / "pruning_curve.csv")
    for _, rows in curve.groupby(["method", "seed"], dropna=False):
        assert rows["n_pruned"].iloc[0] == 0
        np.testing.assert_allclose(rows["fraction_pruned"], rows["n_pruned"] / N_PRESENT, atol=1e-5)
        assert rows["n_pruned"].max() <= N_PRESENT
    iterative = curve[curve.method != "l0"]
    assert iterative.groupby(["method", "seed"], dropna=False)["n_pruned"].apply(list).map(tuple).unique().tolist() == [
        (0, 2, 4, 6, 8, 10)  # 0.2 of the 10 heads left per step, until all 10 are gone
    ]
    assert summary["n_heads_present"] == N_PRESENT
    assert sorted(map(_head, summary["heads_already_removed"])) == sorted(REMOVED)
    # the saved model: the checkpoint's removed heads stay removed, and 0.4 of the 10 others go too
    meta = json.loads((out / "pruned_model" / "config.json").read_text())
    saved = {(l, h) for l, hs in enumerate(meta["pruned"]["removed_heads"]) for h in hs}
    first = {_head(h) for h in summary["removal_order"]["michel"][:4]}
    assert saved == gone | first and len(saved) == len(REMOVED) + 4
    assert summary["pruned_model"]["heads_removed"] == 4
    assert summary["pruned_model"]["heads_already_removed"] == len(REMOVED)


def test_ablate_of_a_pruned_checkpoint_shows_removed_heads_as_removed(pruned_dir, text_file):
    """A removed head's ablation effect was reported as a measured +0.000 (top-heads list, terminal
    and summary.json) and drawn white, the colour of no effect. Now it is never ranked or printed as
    a number, the summary lists it as removed, and the heatmap draws it in its own colour, named."""
    import headprobe
    from headprobe.analyses import figures as figs
    from headprobe.probe.core.heads import format_head

    model = headprobe.load_model(str(pruned_dir), device="cpu", quiet=True)
    result = headprobe.ablate(model, text=str(text_file), seq_len=16, n_natural=3, n_repeated=2, period=6, device="cpu")
    names = {format_head(h) for h in REMOVED}
    summary = result.summary()
    for task, tops in summary["top_heads_by_loss_delta"].items():
        assert tops and not {e["head"] for e in tops} & names, (task, tops)
    assert sorted(summary["removed_heads"]) == sorted(names)
    assert not set(summary["top_induction_score_heads"]) & names
    report = result.report()
    assert not any(re.search(rf"\b{re.escape(n)} \(", report) for n in names), report
    assert "removed" in report
    for task, r in result.tasks.items():
        for h in REMOVED:
            assert np.isnan(r.effect[h]) and np.isnan(r.importance[h]) and np.isnan(r.attribution[h]), (task, h)
    fig = result.figures()["ablation_effect"]
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend()] + list(fig.legends)  # one below both panels
    labels = [t.get_text() for legend in legends for t in legend.get_texts()]
    assert any("removed" in label for label in labels), labels
    for ax in fig.axes[:2]:  # the two heatmaps: the removed cells in the masked colour, on top of the values
        grey = [im for im in ax.get_images() if len(im.cmap.colors if hasattr(im.cmap, "colors") else []) == 1]
        assert grey, "no layer of removed cells"
        drawn = np.isfinite(np.ma.filled(np.ma.asarray(grey[0].get_array(), dtype=float), np.nan))
        assert {tuple(map(int, x)) for x in np.argwhere(drawn)} == set(REMOVED)
        assert grey[0].cmap.colors[0] == figs.MASKED_COLOR
    import matplotlib.pyplot as plt

    plt.close(fig)


@pytest.fixture(scope="module")
def prune_between_steps(tiny_dir, text_file, tmp_path_factory):
    """``prune --method random,michel`` in steps of 4 of the 16 heads, saving 6 removed (in the first
    random order): between two steps."""
    out = tmp_path_factory.mktemp("prune-between") / "out"
    argv = ["prune", "--model", str(tiny_dir), "--out", str(out), "--text", str(text_file), "--method", "random,michel"]
    argv += ["--n-seeds", "2", "--step-fraction", "0.25", "--save-pruned", "--save-fraction", "0.375", *SMALL]
    assert main(argv) == 0
    return out


def test_the_saved_models_loss_is_measured_between_curve_steps(prune_between_steps, tiny_dir, text_file, capsys):
    """--save-fraction 0.375 (6 of 16 heads) falls between the steps of 4: the saved model's own loss
    was reported nowhere. Now summary.json and the terminal give it, and it equals the unpruned
    model's loss with those 6 heads masked, on the curve's held-out tokens."""
    import headprobe
    from headprobe.analyses.pruning import masked_loss
    from headprobe.commands import prune_core
    from headprobe.commands.prune import PruneConfig

    out = prune_between_steps
    summary = json.loads((out / "summary.json").read_text())
    saved = summary["pruned_model"]
    assert "loss" in saved, sorted(saved)
    assert saved["heads_removed"] == 6 and saved["curve_step"] is None and saved["between_curve_steps"] == [1, 2]
    order = [_head(h) for h in summary["removal_order"]["random:0"][:6]]
    model = headprobe.load_model(str(tiny_dir), device="cpu", quiet=True)
    cfg = PruneConfig(model=str(tiny_dir), text=str(text_file), seq_len=16, n_natural=3, n_repeated=2, period=6)
    cfg = cfg.resolved(model.spec, None)
    _, _, evals, _ = prune_core._loss_sets(model, cfg)
    keep = torch.ones(2, 8)
    for layer, head in order:
        keep[layer, head] = 0
    for name, data in evals.items():
        assert saved["loss"][name] == pytest.approx(masked_loss(model, data, keep), abs=1e-4), name
    meta = json.loads((out / "pruned_model" / "config.json").read_text())
    assert {(l, h) for l, hs in enumerate(meta["pruned"]["removed_heads"]) for h in hs} == set(order)


def test_a_saved_fraction_on_a_curve_step_gives_the_curves_loss(tiny_dir, text_file, tmp_path, capsys):
    """The identity: a saved model with exactly a curve step's heads removed (8 of 16, step 2) has
    that step's losses, the small model's weights against the curve's head mask."""
    out = tmp_path / "out"
    argv = ["prune", "--model", str(tiny_dir), "--out", str(out), "--text", str(text_file), "--method", "michel"]
    argv += ["--step-fraction", "0.25", "--save-pruned", "--save-fraction", "0.5", *SMALL]
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    saved = summary["pruned_model"]
    row = summary["curves"]["michel"][2]
    assert row["n_pruned"] == 8 and saved["curve_step"] == 2
    for name in ("natural", "repeated"):
        assert saved["loss"][name] == pytest.approx(row[f"{name}_loss"], abs=1e-4)
        assert saved["loss_minus_curve"][name] == pytest.approx(saved["loss"][name] - row[f"{name}_loss"], abs=1e-9)
    (line,) = [x for x in stdout.splitlines() if x.startswith("saved model loss")]
    assert f"{saved['loss']['natural']:.3f}" in line and "curve step 2" in line, line


def test_curve_csv_writes_integer_columns_as_integers(prune_between_steps):
    """pruning_curve.csv wrote a random curve's seed as 0.00000 (the float format applied to a column
    made float by the other methods' empty seeds). Its integer columns are written as integers."""
    lines = (prune_between_steps / "pruning_curve.csv").read_text().splitlines()
    header = lines[0].split(",")
    rows = [dict(zip(header, line.split(","))) for line in lines[1:]]
    assert {r["seed"] for r in rows if r["method"] == "random"} == {"0", "1"}
    assert {r["seed"] for r in rows if r["method"] == "michel"} == {""}
    for col in ("step", "n_pruned"):
        assert all(re.fullmatch(r"\d+", r[col]) for r in rows), col


def test_ablate_heads_all_removed_is_refused_in_one_line(pruned_dir, text_file, tmp_path, capsys):
    """--heads naming only heads the checkpoint no longer has: nothing to measure. One line, exit 2,
    nothing written."""
    out = tmp_path / "x"
    argv = ["ablate", "--model", str(pruned_dir), "--out", str(out), "--text", str(text_file), "--heads", "0.0,1.5"]
    assert main([*argv, *SMALL]) == 2
    err = capsys.readouterr().err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("headprobe: error:")]
    assert "every head asked for is removed" in line and "0.0,1.5" in line, line
    assert "Traceback" not in err and not out.exists()


def test_per_layer_best_head_of_a_pruned_checkpoint_is_a_head_it_has(pruned_dir, text_file):
    """--per-layer on a pruned checkpoint: the head kept in each layer is one of the heads present
    (a removed head "kept" alone would ablate the whole layer), its loss that of a loop over them."""
    import headprobe
    from headprobe.analyses.data import natural_text_tokens
    from headprobe.analyses.pruning import LossSet, masked_loss, per_layer_best_head

    model = headprobe.load_model(str(pruned_dir), device="cpu", backend="native", quiet=True)
    data = LossSet(natural_text_tokens(model, 3, 16, 0, text=text_file.read_text()).tokens, 1)
    rows = per_layer_best_head(model, data)
    for row in rows:
        layer = row["layer"]
        present = [h for h in range(8) if (layer, h) not in REMOVED]
        losses = []
        for h in present:
            keep = torch.ones(2, 8)
            keep[layer] = 0
            keep[layer, h] = 1
            losses.append([masked_loss(model, LossSet(data.tokens[i : i + 1], 1), keep) for i in range(3)])
        losses = np.array(losses)  # [present head, window]
        assert row["best_head"] == present[int(np.argmin(losses.mean(1)))]
        picked = [int(np.argmin(losses[:, :2].mean(1))), int(np.argmin(losses[:, 2:].mean(1)))]  # halves 2 + 1
        held_out = (losses[picked[1], :2].sum() + losses[picked[0], 2]) / 3  # each pick scored on the other half
        assert row["loss_best_only"] == pytest.approx(held_out, abs=1e-5)


def test_per_layer_never_keeps_a_removed_head_where_ablating_the_layer_helps(pruned_dir, monkeypatch):
    """Where ablating a whole layer lowers the loss, "keeping" a removed head alone (= the whole
    layer ablated) would win the layer: a loss that falls with every present head ablated."""
    import headprobe
    from headprobe.analyses import ablation
    from headprobe.analyses.pruning import LossSet, per_layer_best_head

    def fake(model, tokens, sets, *args, **kwargs):  # loss = minus the present heads each set ablates
        return torch.tensor([[-float(sum(h not in REMOVED for h in s))] * 2 for s in sets])

    monkeypatch.setattr(ablation, "set_ablation_losses", fake)
    model = headprobe.load_model(str(pruned_dir), device="cpu", backend="native", quiet=True)
    rows = per_layer_best_head(model, LossSet(torch.zeros(2, 4, dtype=torch.long), 1))
    assert [(r["layer"], r["best_head"]) for r in rows if (r["layer"], r["best_head"]) in REMOVED] == []
    assert all(r["loss_best_only"] > r["loss_layer_ablated"] for r in rows)


@pytest.mark.figures
def test_the_pruning_figure_redrawn_from_the_saved_folder_is_the_runs(pruned_dir, text_file, tmp_path, monkeypatch):
    """scripts/redraw_figures.py redrew pruning_curve.png without the saved model's star and without
    a pruned checkpoint's title line and x label (the run's figure has them): redrawn from
    pruning_curve.csv and summary.json, the figure gets the run's title, labels, star and curves (to
    the CSV's 5 decimals)."""
    import importlib.util
    from pathlib import Path

    from headprobe.analyses import figures as figs

    drawn = []
    plot = figs.pruning_methods_plot
    monkeypatch.setattr(figs, "pruning_methods_plot", lambda *a, **k: drawn.append((a, k)) or plot(*a, **k))
    out = tmp_path / "out"
    argv = ["prune", "--model", str(pruned_dir), "--out", str(out), "--text", str(text_file), "--n-seeds", "2"]
    argv += ["--method", "michel,random", "--step-fraction", "0.2", "--save-pruned", "--save-fraction", "0.4", *SMALL]
    assert main(argv) == 0
    spec = importlib.util.spec_from_file_location("redraw", Path(__file__).parents[1] / "scripts" / "redraw_figures.py")
    redraw = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(redraw)
    redraw.redraw_prune(out)
    (run_args, run_kw), (again_args, again_kw) = drawn
    (curves, bands, metrics, title), (curves2, bands2, metrics2, title2) = run_args, again_args
    assert (title2, metrics2, again_kw["xlabel"]) == (title, metrics, run_kw["xlabel"])
    assert "heads removed before this run" in title and "checkpoint's" in run_kw["xlabel"]
    (label, frac, loss), (label2, frac2, loss2) = run_kw["saved"], again_kw["saved"]
    assert (label2, frac2) == (label, frac) and loss2 == pytest.approx(loss)
    for lines, lines2 in ((curves, curves2), (bands, bands2)):
        assert [c[0] for c in lines2] == [c[0] for c in lines]
        for (_, x, ys), (_, x2, ys2) in zip(lines, lines2):
            np.testing.assert_allclose(x2, x, atol=1e-5)
            for col in ys:
                np.testing.assert_allclose(ys2[col], ys[col], atol=1e-5)


def _overview(model_dir, text_file):
    """scan's overview figure (no verification, every head type) of the model in ``model_dir``."""
    import headprobe
    from headprobe.commands.scan_core import figure_makers

    model = headprobe.load_model(str(model_dir), device="cpu", quiet=True)
    result = headprobe.scan(model, text=str(text_file), seq_len=16, n_natural=3, n_repeated=2, period=6, verify=False)
    return figure_makers(result)["overview"]()


@pytest.mark.figures
def test_the_overview_of_a_pruned_checkpoint_draws_removed_heads_hatched_grey_and_names_them(
    pruned_dir, text_file, tmp_path
):
    """The overview drew a removed head (NaN score) plain white, like no colour of its scale and
    with no legend entry. Now every panel draws exactly the removed heads in the pale grey of
    ablate's figure (:data:`MASKED_COLOR`), cross-hatched, and the legend names them."""
    import matplotlib.pyplot as plt

    from headprobe.analyses import figures as figs

    fig = _overview(pruned_dir, text_file)
    panels = [ax for ax in fig.axes if ax.get_images() and ax.get_title()]
    assert len(panels) >= 2
    for ax in panels:
        grey = [im for im in ax.get_images() if getattr(im.cmap, "colors", None) == [figs.MASKED_COLOR]]
        assert len(grey) == 1, (ax.get_title(), "no layer of removed cells")
        drawn = np.isfinite(np.ma.filled(np.ma.asarray(grey[0].get_array(), dtype=float), np.nan))
        assert {tuple(map(int, x)) for x in np.argwhere(drawn)} == set(REMOVED), ax.get_title()
        hatched = {
            (round(p.get_y() + p.get_height() / 2), round(p.get_x() + p.get_width() / 2))
            for p in ax.patches
            if p.get_hatch() == figs.REMOVED_HATCH
        }
        assert hatched == set(REMOVED), ax.get_title()
        scores = np.ma.filled(np.ma.asarray(ax.get_images()[0].get_array(), dtype=float), np.nan)
        assert np.isnan([scores[h] for h in REMOVED]).all()  # no colour of the scale under them
    labels = [t.get_text() for legend in fig.legends for t in legend.get_texts()]
    assert figs.REMOVED_LABEL in labels, labels
    fig.savefig(tmp_path / "overview.png")  # draws (the hatches and legend keys included)
    plt.close(fig)


@pytest.mark.figures
def test_every_scan_heatmap_of_a_pruned_checkpoint_draws_removed_heads_as_the_overview_does(
    pruned_dir, text_file, tmp_path
):
    """The per-type and metric heatmaps (heatmap_*.png) drew a removed head as any NaN score, hatched
    grey and named "not measured", where the overview says "removed (pruned checkpoint)". Now each
    draws exactly the removed heads as the overview does: the pale grey layer (:data:`MASKED_COLOR`),
    :data:`REMOVED_HATCH` over them, :data:`REMOVED_LABEL` in the legend with the overview's key, and
    "not measured" only where a head it still has has no score."""
    import matplotlib.pyplot as plt

    import headprobe
    from headprobe.analyses import figures as figs
    from headprobe.commands.scan_core import figure_makers

    model = headprobe.load_model(str(pruned_dir), device="cpu", quiet=True)
    result = headprobe.scan(model, text=str(text_file), seq_len=16, n_natural=3, n_repeated=2, period=6, verify=False)
    makers = {stem: make for stem, make in figure_makers(result).items() if stem.startswith("heatmap_")}
    assert len(makers) >= 5, sorted(makers)
    gone = np.zeros((2, 8), dtype=bool)
    gone[tuple(zip(*REMOVED))] = True
    for stem, make in makers.items():
        fig = make()
        ax = fig.axes[0]
        grey = [im for im in ax.get_images() if getattr(im.cmap, "colors", None) == [figs.MASKED_COLOR]]
        assert grey, (stem, "no layer of removed cells")
        drawn = np.isfinite(np.ma.filled(np.ma.asarray(grey[-1].get_array(), dtype=float), np.nan))
        assert {tuple(map(int, x)) for x in np.argwhere(drawn)} >= set(REMOVED), stem  # a rule's mask may add cells
        hatched = {
            (round(p.get_y() + p.get_height() / 2), round(p.get_x() + p.get_width() / 2))
            for p in ax.patches
            if p.get_hatch() == figs.REMOVED_HATCH
        }
        assert hatched == set(REMOVED), stem
        scores = np.ma.filled(np.ma.asarray(ax.get_images()[0].get_array(), dtype=float), np.nan)
        assert np.isnan(scores[gone]).all(), stem  # no colour of the scale under them
        legend = ax.get_legend()
        keys = {t.get_text(): h for t, h in zip(legend.get_texts(), legend.legend_handles)}
        assert figs.REMOVED_LABEL in keys, (stem, list(keys))
        key = keys[figs.REMOVED_LABEL]
        assert key.get_hatch() == figs.REMOVED_HATCH and key.get_facecolor() == to_rgba(figs.MASKED_COLOR), stem
        column = np.asarray(result.scores[stem.removeprefix("heatmap_")], dtype=float)
        assert ("not measured" in keys) == bool(np.isnan(column[~gone]).any()), (stem, list(keys))
        if stem == "heatmap_induction":
            fig.savefig(tmp_path / f"{stem}.png")  # draws (the hatches and legend keys included)
        plt.close(fig)


def test_a_pruned_checkpoint_keeps_its_sources_4_bit_note(tiny_dir, text_file, tmp_path):
    """``prune --save-pruned`` of the 4-bit SmolLM2 wrote a checkpoint whose figures said
    ``float32 weights``: the saved model is the dequantized 4-bit model, as the unpruned one whose
    figures say ``4-bit weights`` (:func:`~headprobe.analyses.figures.weights_label`). Now the
    checkpoint records its source's weights and the overview's title keeps the note; a checkpoint
    written before that, of the embedded ``smollm2-135m``, gets it from its ``source``."""
    import dataclasses
    import shutil

    import headprobe
    from headprobe.analyses import figures as figs
    from headprobe.probe.backends.sources import SMOLLM2_NAME, SMOLLM2_PRECISION

    model = headprobe.load_model(str(tiny_dir), device="cpu", backend="native", quiet=True)
    model.spec = dataclasses.replace(model.spec, weights=SMOLLM2_PRECISION)  # stands in for the 4-bit SmolLM2
    assert figs.weights_label(model.spec.weights) == "4-bit weights"
    curve = headprobe.prune(
        model, methods=("random",), n_seeds=1, step_fraction=0.25, max_fraction=0.25, save_pruned=True,
        save_fraction=0.25, text=str(text_file), seq_len=16, n_natural=3,
    )  # fmt: skip
    curve.save(tmp_path / "prune")
    saved = tmp_path / "prune" / "pruned_model"
    loaded = headprobe.load_model(str(saved), device="cpu", quiet=True)
    assert "pruned headprobe checkpoint" in loaded.spec.weights and SMOLLM2_PRECISION in loaded.spec.weights
    assert figs.weights_label(loaded.spec.weights) == "4-bit weights"
    title = _overview(saved, text_file).get_suptitle()
    assert f"({figs.weights_label(SMOLLM2_PRECISION)})" in title, title
    # a checkpoint of the embedded model saved without the record: its source names the weights
    old = tmp_path / "old"
    shutil.copytree(saved, old)
    meta = json.loads((old / "config.json").read_text())
    meta["pruned"].pop("source_weights", None)
    meta["source"] = SMOLLM2_NAME
    (old / "config.json").write_text(json.dumps(meta))
    assert figs.weights_label(headprobe.load_model(str(old), device="cpu", quiet=True).spec.weights) == "4-bit weights"
    # and one of another model says nothing of 4 bits
    meta["source"] = str(tiny_dir)
    (old / "config.json").write_text(json.dumps(meta))
    assert (
        figs.weights_label(headprobe.load_model(str(old), device="cpu", quiet=True).spec.weights) == "float32 weights"
    )


def test_a_pruned_checkpoints_header_gives_its_source_a_line_of_its_own(tiny_dir, text_file, tmp_path, capsys):
    """The line a command prints for the model it loaded (and scan's report) ran past 200 characters
    for a pruned 4-bit SmolLM2: its own weights, the source's and the backend in one. Now the source
    is a second line, ``  pruned from <its weights>``; summary.json's ``weights_precision`` stays
    the one string (``; pruned from `` splits it, :func:`~headprobe.probe.model.checkpoint.source_weights`)."""
    import headprobe
    from headprobe.probe.backends.sources import SMOLLM2_PRECISION
    from headprobe.probe.model.pruned import keep_mask_from, remove_heads, save_pruned_dir

    base = headprobe.load_model(str(tiny_dir), device="cpu", backend="native", quiet=True)
    d = tmp_path / "pruned_model"
    net = remove_heads(base.model, keep_mask_from(REMOVED, 2, 8))
    save_pruned_dir(net, d, base.tokenizer, source=str(tiny_dir), source_weights=SMOLLM2_PRECISION)
    own = f"float32 (pruned headprobe checkpoint, {len(REMOVED)} heads removed, zero weights); native backend"
    capsys.readouterr()
    out = tmp_path / "scan"
    argv = ["scan", "--model", str(d), "--text", str(text_file), "--out", str(out), "--no-verify", "--no-metrics"]
    assert main([*argv, "--formats", "none", *zoo.TINY_SCORE_FLAGS]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith(f"model {d} on cpu"))
    assert f"; weights: {own}" in lines[header] and "pruned from" not in lines[header], lines[header]
    assert lines[header + 1] == f"  pruned from {SMOLLM2_PRECISION}"
    report = lines.index(f"{d}: weights {own}")  # scan's report
    assert lines[report + 1] == f"  pruned from {SMOLLM2_PRECISION}"
    precision = json.loads((out / "summary.json").read_text())["weights_precision"]
    assert precision == own.replace("; native", f"; pruned from {SMOLLM2_PRECISION}; native")


def test_the_pruned_models_speedup_is_timed_in_interleaved_pairs():
    """prune's speedup of the small model timed every masked forward, then every pruned one: a
    machine whose load rose between the two blocks (walk-paper: "0.65x", where the median of 7 runs
    by hand gave 1.27x) read the faster model as slower. On a clock that runs 3x slower from the
    7th call on, with the masked forward taking 2 units and the pruned 1, interleaved pairs give 2.0
    (each pair under one load), where the two blocks' medians give 0.67."""
    import statistics

    from headprobe.analyses.pruning import paired_speedup
    from headprobe.commands.prune_core import _speedup_text

    now, calls = [0.0], [0]

    def run(cost: float):
        def f():
            calls[0] += 1
            now[0] += cost * (3.0 if calls[0] > 6 else 1.0)

        return f

    t = paired_speedup(run(2.0), run(1.0), pairs=7, clock=lambda: now[0])
    assert t["speedup"] == 2.0 and t["speedup_range"] == [2.0, 2.0] and t["pairs"] == 7, t
    assert t["slow_s"] == 6.0 and t["fast_s"] == 3.0  # the medians fall in the loaded half
    now[0], calls[0] = 0.0, 0  # the blocks, on the same clock: one warm-up and three runs each

    def block(f):
        f()
        out = []
        for _ in range(3):
            t0 = now[0]
            f()
            out.append(now[0] - t0)
        return statistics.median(out)

    assert block(run(2.0)) / block(run(1.0)) == pytest.approx(2 / 3)
    # the ratio printed is that of the two medians printed beside it: "0.994 s masked vs 0.982 s pruned
    # (0.95x)" read the faster model as slower (walk 'prune': the pairs' median ratio, 0.95, went the other way)
    pairs = [(1, 1.2), (1.1, 1.0), (1.2, 1.1), (2, 1.5), (0.9, 0.95), (1.05, 1.0), (3, 2.9)]  # (masked, pruned)
    order = [c for i, (a, b) in enumerate(pairs) for c in ((a, b) if i % 2 == 0 else (b, a))]  # odd pairs: pruned first
    costs = iter([1.0, 1.0, *order])  # after a warm-up of each
    now[0] = 0.0

    def step():
        now[0] += next(costs)

    t = paired_speedup(step, step, pairs=7, clock=lambda: now[0])
    assert (t["slow_s"], t["fast_s"]) == pytest.approx((1.1, 1.1)) and t["speedup"] == pytest.approx(
        1.0
    )  # the pairs' median: 1.05
    line = _speedup_text({"speedup": 1.1, "speedup_range": [0.9, 1.3], "timing_pairs": 7})
    assert line == "1.10x, 0.90x to 1.30x over 7 interleaved pairs; not told apart from 1x on this machine"
    assert _speedup_text({"speedup": 0.65}) == "0.65x"  # a summary from before the pairs
