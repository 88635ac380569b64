"""scripts/redraw_figures.py on kv and ablate runs: it redraws each from its CSV and summary.json as the
command draws it (a run's own PNG equals the redraw), and ``--check`` compares the committed kv and ablate
folders with today's drawing (before, it named them "not checked" and they were redrawn by one-off scripts)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pandas as pd
import pytest
import zoo

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import redraw_figures  # noqa: E402


@pytest.mark.figures
def test_a_kv_runs_figure_is_what_the_redraw_draws_from_its_csv(tiny_tokenizer, text_file, tmp_path):
    """A tiny kv run (--loss-tolerance: the tolerance point and its whisker too) saved with its PNG: the
    redraw from curve.csv and summary.json gives the same image; its curve.csv without ``uniform_window``
    (a run older than the column) still draws, and differs (the legend loses W')."""
    from headprobe.commands.kv import KVConfig, run
    from headprobe.probe.backends.wrapping import wrap

    model = wrap(zoo.make_checkpoint("gpt2", tiny_tokenizer), backend="native")
    cfg = KVConfig(model="gpt2", seq_len=48, block_len=6, sink=2, window=6, text=str(text_file), loss_tolerance=0.0)
    r = run(model, dataclasses.replace(cfg, budgets=(0.3, 0.6), n_random=2), progress=False)
    out = tmp_path / "kv"
    r.save(out)
    assert redraw_figures._kind(out) == "kv"
    assert redraw_figures.check_run(out, redraw_figures.redraw_kv) == []
    curve = pd.read_csv(out / "curve.csv")
    curve.drop(columns="uniform_window").to_csv(out / "curve.csv", index=False)
    (why,) = redraw_figures.check_run(out, redraw_figures.redraw_kv)
    assert "kv_curve.png: differs from today's drawing" in why


@pytest.mark.figures
@pytest.mark.parametrize("estimate", [None, "atp"])
def test_an_ablate_runs_figure_is_what_the_redraw_draws_from_its_csv(estimate, tiny_dir, text_file, tmp_path):
    """A tiny ablate run saved with its PNGs (ablation_effect and importance_vs_exact, or ablation_estimate with --estimate): the
    redraw from head_ablation.csv and summary.json gives the same image; a table whose numbers changed
    does not (the check can fail)."""
    import headprobe

    small = {"n_natural": 3, "seq_len": 16, "n_repeated": 2, "period": 6, "device": "cpu"}
    a = headprobe.ablate(str(tiny_dir), text=str(text_file), estimate=estimate, **small)
    out = tmp_path / "ablate"
    a.save(out)
    stem = "ablation_estimate" if estimate else "ablation_effect"
    assert (out / f"{stem}.png").is_file() and redraw_figures._kind(out) == "ablate"
    assert (out / "importance_vs_exact.png").is_file() is (estimate is None)
    assert redraw_figures.check_run(out, redraw_figures.redraw_ablate) == []
    table = pd.read_csv(out / "head_ablation.csv")
    column = "natural_atp_star_estimate" if estimate else "natural_loss_delta"
    table[column] = table[column][::-1].to_numpy()  # the heads' numbers in another order
    table.to_csv(out / "head_ablation.csv", index=False)
    whys = redraw_figures.check_run(out, redraw_figures.redraw_ablate)
    stems = [stem] + ([] if estimate else ["importance_vs_exact"])  # the scatter draws the effect too
    assert len(whys) == len(stems), whys
    assert all(any(f"{s}.png: differs from today's drawing" in why for why in whys) for s in stems), whys


def test_the_committed_kv_and_ablate_figures_are_what_the_code_draws():
    """Every committed kv and ablate folder (figures/) is one ``--check`` compares, and its PNG is what
    today's figure code draws from its CSV (``scripts/redraw_figures.py figures/RUN`` redraws it)."""
    runs = {d.name: redraw_figures._kind(d) for d in sorted((ROOT / "figures").iterdir()) if d.is_dir()}
    kv = [n for n, k in runs.items() if k == "kv"]
    ablate = [n for n, k in runs.items() if k == "ablate"]
    assert len(kv) >= 4 and ablate == ["smollm2-135m-ablate"], runs
    for name in kv + ablate:
        redraw = redraw_figures.redraw_kv if runs[name] == "kv" else redraw_figures.redraw_ablate
        assert redraw_figures.check_run(ROOT / "figures" / name, redraw) == [], name


def test_the_committed_robustness_and_per_layer_figures_are_redrawn_and_checked():
    """robustness.png and figures/smollm2-135m/prune-per-layer/per_layer.png were redrawn by one-off scripts: the
    robustness folder was "not checked" and the per-layer run, inside the scan's folder, was passed by. Both are
    runs ``--check`` compares now (the nested one found under figures/), each PNG what today's code draws from its
    CSV and summary.json; a table whose numbers changed differs (the check can fail)."""
    import shutil
    import tempfile

    runs = [str(d.relative_to(ROOT / "figures")) for d in redraw_figures._run_dirs(ROOT / "figures")]
    assert "smollm2-135m/prune-per-layer" in runs, runs
    for name, kind in (("smollm2-135m-robustness", "robustness"), ("smollm2-135m/prune-per-layer", "per_layer")):
        d = ROOT / "figures" / name
        assert redraw_figures._kind(d) == kind
        assert redraw_figures.check_run(d, redraw_figures.REDRAWS[kind]) == [], name
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "per-layer"
        shutil.copytree(ROOT / "figures" / "smollm2-135m" / "prune-per-layer", d)
        t = pd.read_csv(d / "per_layer.csv")
        t["loss_best_only"] = t["loss_best_only"][::-1].to_numpy()  # the layers' numbers in another order
        t.to_csv(d / "per_layer.csv", index=False)
        (why,) = redraw_figures.check_run(d, redraw_figures.redraw_per_layer)
        assert "per_layer.png: differs from today's drawing" in why
