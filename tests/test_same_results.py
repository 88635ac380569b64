"""benchmarks/same_results.py, the check of a GPU run against the committed one: equal runs read
equal; a changed p-value, control set or verdict reads unequal and is named; effects that differ
by rounding read equal with the largest difference printed; a pruning curve that parts is found at
its step, with the cut's margin there."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]
DEMO, PRUNE = ROOT / "figures" / "smollm2-135m", ROOT / "figures" / "smollm2-135m-prune"


def _same():
    spec = importlib.util.spec_from_file_location("same_results", ROOT / "benchmarks" / "same_results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _copy(src: Path, dst: Path, files: tuple[str, ...]) -> Path:
    dst.mkdir()
    for f in files:
        shutil.copy(src / f, dst / f)
    return dst


def _edit_summary(folder: Path, edit) -> None:
    s = json.loads((folder / "summary.json").read_text())
    edit(s)
    (folder / "summary.json").write_text(json.dumps(s))


def test_a_scan_against_itself_and_against_a_rounded_copy(tmp_path, capsys):
    same = _same()
    b = _copy(DEMO, tmp_path / "b", ("summary.json", "head_scores.csv"))
    assert same.main(["scan", str(DEMO), str(b)]) == 0

    def nudge(s):
        s["ablations"][2]["random_effects"][5] += 3e-6
        s["ablations"][0]["top_effect"] -= 1e-6

    _edit_summary(b, nudge)
    scores = pd.read_csv(b / "head_scores.csv")
    scores.loc[7, "induction"] += 2e-5
    scores.to_csv(b / "head_scores.csv", index=False)
    capsys.readouterr()
    assert same.main(["scan", str(DEMO), str(b)]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    effect, score = (float(x.split("=")[1]) for x in last.split()[-2:])
    assert effect == pytest.approx(3e-6, rel=1e-3) and score == pytest.approx(2e-5, rel=1e-2)


@pytest.mark.parametrize("field", ["p_value", "random_heads", "confirmed", "draws"])
def test_a_scan_whose_tests_differ_is_named(tmp_path, capsys, field):
    same = _same()
    b = _copy(DEMO, tmp_path / "b", ("summary.json", "head_scores.csv"))

    def change(s):
        row = s["ablations"][1]
        row[field] = {
            "p_value": 0.5,
            "random_heads": row["random_heads"][::-1],
            "confirmed": not row["confirmed"],
            "draws": 98,
        }[field]

    _edit_summary(b, change)
    capsys.readouterr()
    assert same.main(["scan", str(DEMO), str(b)]) == 1
    out = capsys.readouterr().out
    assert f"differ in {field}" in out and "equal=no" in out


def test_scores_are_paired_by_head_and_other_heads_differ(tmp_path, capsys):
    """A table in another row order is the same table; one with a head missing, or another
    model's summary, reads unequal."""
    same = _same()
    b = _copy(DEMO, tmp_path / "b", ("summary.json", "head_scores.csv"))
    scores = pd.read_csv(b / "head_scores.csv")
    scores.iloc[::-1].to_csv(b / "head_scores.csv", index=False)
    capsys.readouterr()
    assert same.main(["scan", str(DEMO), str(b)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith("max_score_diff=0")
    scores.iloc[1:].to_csv(b / "head_scores.csv", index=False)
    assert same.main(["scan", str(DEMO), str(b)]) == 1
    assert f"head_scores.csv: {len(scores)} heads vs {len(scores) - 1}" in capsys.readouterr().out
    scores.to_csv(b / "head_scores.csv", index=False)
    _edit_summary(b, lambda s: s.update(model="another"))
    assert same.main(["scan", str(DEMO), str(b)]) == 1
    assert "models differ: smollm2-135m vs another" in capsys.readouterr().out


def test_a_pruning_curve_that_parts_is_found_at_its_step(tmp_path, capsys):
    same = _same()
    b = _copy(PRUNE, tmp_path / "b", ("summary.json", "pruning_curve.csv"))
    assert same.main(["prune", str(PRUNE), str(b)]) == 0
    t = pd.read_csv(b / "pruning_curve.csv", dtype={"removed": str})
    michel = t.index[t["method"] == "michel"]
    at3, at4 = michel[3], michel[4]
    one, other = t.loc[at3, "removed"].split(), t.loc[at4, "removed"].split()
    one[0], other[0] = other[0], one[0]  # a head swapped between steps 3 and 4
    t.loc[at3, "removed"], t.loc[at4, "removed"] = " ".join(one), " ".join(other)
    t["margin"] = [2.5e-7 if i == at3 else float("nan") for i in t.index]
    t.to_csv(b / "pruning_curve.csv", index=False)
    capsys.readouterr()
    assert same.main(["prune", str(PRUNE), str(b)]) == 1
    out = capsys.readouterr().out
    committed = pd.read_csv(PRUNE / "pruning_curve.csv").loc[at3, "margin"]  # n/a in a run from before margins
    assert f"michel: parts at step 3 (30% removed); cut margin {committed:.3g} vs 2.5e-07" in out
    assert "random:0: same heads at every step" in out and "equal=no" in out


def test_a_folder_without_a_summary_is_one_line(tmp_path, capsys):
    assert _same().main(["scan", str(DEMO), str(tmp_path)]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_a_cut_summary_or_a_missing_table_is_one_line(tmp_path, capsys):
    b = _copy(DEMO, tmp_path / "b", ("summary.json",))  # no head_scores.csv
    assert _same().main(["scan", str(DEMO), str(b)]) == 2
    (b / "summary.json").write_text('{"confirmed": ')
    assert _same().main(["scan", str(DEMO), str(b)]) == 2
    assert capsys.readouterr().err.count("\n") == 2


def test_each_run_is_described_by_its_device_dtype_and_tf32(tmp_path, capsys):
    """The first two lines say what made each run, from its summary.json (a GPU run's name and TF32)."""
    same = _same()
    b = _copy(DEMO, tmp_path / "b", ("summary.json", "head_scores.csv"))

    def on_gpu(s):
        s.update(device="cuda:0", device_name="NVIDIA H200", tf32=False)
        s["versions"]["torch"] = "2.11.0+cu130"

    _edit_summary(b, on_gpu)
    assert same.main(["scan", str(DEMO), str(b)]) == 0
    first, second = capsys.readouterr().out.splitlines()[:2]
    demo = json.loads((DEMO / "summary.json").read_text())
    assert first.startswith(f"{DEMO}: {demo['device']} (") and f"torch {demo['versions']['torch']}" in first
    assert second == f"{b}: cuda:0 (NVIDIA H200), float32, TF32 off, torch 2.11.0+cu130"
