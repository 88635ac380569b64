"""An interrupted scan resumes its verification: killed after some control sets,
rerun with the same flags and --out, it ends with the summary.json of an uninterrupted run
(timings aside), and the rerun ablates only the sets the first run had not."""

from __future__ import annotations

import json

from headprobe.cli import main
from headprobe.probe.core.io import CHECKPOINT_NAME

ARGS = [
    "--n-natural",
    "3",
    "--seq-len",
    "16",
    "--n-repeated",
    "2",
    "--period",
    "6",
    "-k",
    "2",
    "--n-random",
    "9",
    "--device",
    "cpu",
    "--no-metrics",
    "--types",
    "induction,previous_token,first_token",
    "--threads",
    "1",
]


def _without_timings(summary: dict) -> dict:
    summary = dict(summary)
    for key in ("timings_s", "timings", "seconds", "command", "peak_memory"):  # command: each run's own --out
        summary.pop(key, None)
    return summary


def test_killed_scan_resumes_to_the_uninterrupted_summary(tiny_dir, text_file, tmp_path):
    """The module's check; besides, the rerun (a whole scan, in a process of its own) draws no figure
    (``$HEADPROBE_FIGURE_FORMATS=none``, as in the whole suite) and so imports no matplotlib: it cost
    0.3-0.5 s of each of the suite's command processes (``figures`` imported it at its top, the token
    labels' font check read the font's character map for every label)."""
    from test_loading import imported_modules, run_cli

    args = ["--model", str(tiny_dir), "--text", str(text_file), *ARGS]
    assert main(["scan", "--out", str(tmp_path / "whole"), *args]) == 0
    whole = json.loads((tmp_path / "whole" / "summary.json").read_text())
    sets = whole["verification"]["sets_ablated"]
    assert sets > 8  # enough rounds to be cut in the middle

    cut = tmp_path / "cut"
    rc, _, err = run_cli("scan", "--out", str(cut), *args, env={"HEADPROBE_KILL_AFTER_SAVES": "8"})
    assert rc == -9, err  # killed (SIGKILL) after its 8th checkpoint: in the control rounds
    saved = json.loads((cut / CHECKPOINT_NAME).read_text())["state"]["verification"]["losses"]
    top_sets = 3 * 2  # three types' top-k sets, two kinds: the first keys saved
    assert top_sets < len(saved) < sets and not (cut / "summary.json").exists()

    rc, out, err = run_cli("scan", "--out", str(cut), *args, python=("-X", "importtime"))
    imported, err = imported_modules(err)
    assert rc == 0, err
    assert "torch" in imported and "matplotlib" not in imported
    assert "resuming from" in out and f"{len(saved)} head sets already ablated" in out
    resumed = json.loads((cut / "summary.json").read_text())
    assert _without_timings(resumed) == _without_timings(whole)
    assert (cut / "head_scores.csv").read_text() == (tmp_path / "whole" / "head_scores.csv").read_text()
    assert not (cut / CHECKPOINT_NAME).exists()
