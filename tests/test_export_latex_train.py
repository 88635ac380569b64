"""``headprobe export --format latex`` of a ``headprobe train`` folder: latex/training.tex against
the run's own train_log.csv (read here with pandas) and summary.json, the sampling of a long log,
the one-line refusals of a damaged log, and pdflatex at a NeurIPS page's width."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
from test_export_latex import _assert_compiles_within, _one_line_refusal, export_without_torch, rows

from headprobe.analyses.latex_tables import TRAIN_ROWS
from headprobe.cli import main

TRAIN = Path(__file__).resolve().parents[1] / "figures" / "train-default"


def _training_tex(source: Path, out: Path) -> str:
    assert (
        main(["export", "--from", str(source), "--out", str(out)]) == 0
    )  # all: a train run's every format is its table
    assert json.loads((out / "summary.json").read_text())["files"] == ["latex/training.tex"]
    return (out / "latex" / "training.tex").read_text()


def test_training_table_is_train_log_csv_at_every_evaluation(tmp_path):
    """One row per evaluation of the committed run (11: steps 0 to 1,000): held-out loss, in-context
    loss [95% CI], top induction score (its 95% lower bound) and top previous-token score, each the
    CSV's value at 3 decimals."""
    text = _training_tex(TRAIN, tmp_path / "o")
    log = pd.read_csv(TRAIN / "train_log.csv").dropna(subset=["eval_loss"])
    expected = [
        [
            f"{int(r.step):,}",
            f"{r.eval_loss:.3f}",
            f"{r.in_context_loss:.3f} [{r.in_context_loss_ci95_low:.3f}, {r.in_context_loss_ci95_high:.3f}]",
            f"{r.max_induction:.3f} ({r.top_induction_ci95_low:.3f})",
            f"{r.max_previous_token:.3f}",
        ]
        for r in log.itertuples()
    ]
    assert len(expected) == 11 and rows(text) == expected


def test_training_caption_gives_the_model_data_and_the_runs_findings(tmp_path):
    text = " ".join(_training_tex(TRAIN, tmp_path / "o").split())
    s = json.loads((TRAIN / "summary.json").read_text())
    cfg = s["config"]
    for fact in (
        f"{s['n_params']:,} parameters",
        f"{cfg['steps']} steps of batch {cfg['batch_size']}",
        f"evaluated every {s['eval_every']} steps.",
        f"chance ln {cfg['n_words']} = {s['chance_loss_nats']}",
        f"first at step {s['first_step_induction_formed']}",
        "phase change between steps {} and {}".format(*s["phase_change_between"]),
        "float32 compute, seed 0",
    ):
        assert fact in text, fact


def test_a_long_log_is_sampled_with_its_ends_and_phase_change(tmp_path):
    """A 10,000-step log evaluated every 100 steps (101 evaluations) shows at most TRAIN_ROWS rows,
    among them the first, the last and both evaluations around the phase change; the caption says so."""
    run = tmp_path / "run"
    shutil.copytree(TRAIN, run)
    one = pd.read_csv(TRAIN / "train_log.csv").dropna(subset=["eval_loss"]).iloc[-1]
    log = pd.DataFrame([one] * 101).assign(step=range(0, 10_001, 100))
    log.to_csv(run / "train_log.csv", index=False)
    summary = json.loads((run / "summary.json").read_text())
    summary["phase_change_between"] = [4_300, 4_400]
    (run / "summary.json").write_text(json.dumps(summary))
    text = _training_tex(run, tmp_path / "o")
    steps = [int(r[0].replace(",", "")) for r in rows(text)]
    assert len(steps) <= TRAIN_ROWS and steps == sorted(set(steps))
    assert {0, 4_300, 4_400, 10_000} <= set(steps)
    assert f"({len(steps)} of its 101 evaluations, evenly spaced)" in " ".join(text.split())


@pytest.mark.parametrize(("damage", "said"), [("cut", "no column"), ("empty", "no evaluation rows")])
def test_a_damaged_log_is_refused_in_one_line(tmp_path, damage, said):
    run = tmp_path / "run"
    shutil.copytree(TRAIN, run)
    text = (TRAIN / "train_log.csv").read_text()
    (run / "train_log.csv").write_text(text[:30] if damage == "cut" else text.splitlines()[0] + "\n")
    code, err = _one_line_refusal(["export", "--from", str(run), "--out", str(tmp_path / "o")], tmp_path)
    assert code == 2 and len(err) == 1 and said in err[0], err
    assert not (tmp_path / "o").exists()


@pytest.mark.skipif(shutil.which("pdflatex") is None, reason="no pdflatex (Debian: texlive-latex-recommended)")
def test_training_table_compiles_and_fits_a_neurips_page(tmp_path):
    _assert_compiles_within("train", _training_tex(TRAIN, tmp_path / "o"), 397, tmp_path)


def test_a_train_export_imports_no_torch(tmp_path):
    export_without_torch(TRAIN, tmp_path / "o", "--format", "latex")
