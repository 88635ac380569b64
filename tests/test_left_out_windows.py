"""Natural-text windows left out as mostly one token (``MAX_ONE_TOKEN_SHARE``) are said by every
command that draws them, not by ``scan`` alone: the same NOTE line, and the count in each summary.json
a command writes. The expected counts come from a plain loop over the tokenized text."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from headprobe.cli import main

DATA = ["--n-natural", "3", "--seq-len", "16", "--n-repeated", "2", "--period", "6"]
SCAN = [*DATA, "-k", "2", "--n-random", "2", "--formats", "none"]
SCORES = [*DATA, "--formats", "none", "--no-verify"]  # a scan without verification (which refuses -k and --n-random)


@pytest.fixture(scope="module")
def run_text(tmp_path_factory):
    """1,500 words of the tiny vocabulary, a run of 200 ``t1``, 1,500 words more: windows inside
    the run are all one token, the others nowhere near half."""
    rng = np.random.default_rng(0)
    words = lambda n: " ".join(f"t{i}" for i in rng.integers(0, 100, n))
    path = tmp_path_factory.mktemp("run-text") / "text.txt"
    path.write_text(f"{words(1500)} {' '.join(['t1'] * 200)} {words(1500)}\n", encoding="utf-8")
    return path


def left_out(tokenizer, path, body: int) -> tuple[int, int]:
    """``(left out, all)`` windows of ``body`` text tokens, by hand: a window is left out when one
    token fills more than half of it."""
    ids = tokenizer(path.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    windows = [ids[i : i + body] for i in range(0, len(ids) // body * body, body)]
    return sum(max(Counter(w).values()) > body / 2 for w in windows), len(windows)


def _notes(capsys) -> list[str]:
    said = capsys.readouterr()
    return [line for line in (said.out + said.err).splitlines() if line.startswith("NOTE:") and "left out" in line]


def _expect(tiny_tokenizer, run_text, body: int, what: str = "") -> str:
    skipped, total = left_out(tiny_tokenizer, run_text, body)
    assert 0 < skipped < total  # the text does what it is for
    return f"NOTE: {what + ': ' if what else ''}{skipped} of the text's {total} windows left out"


def _summary(out) -> dict:
    return json.loads((out / "summary.json").read_text(encoding="utf-8"))


@pytest.mark.parametrize("command", ["ablate", "ablate-sweep", "prune", "robustness", "diff"])
def test_commands_on_16_token_windows_say_and_record_the_windows_left_out(
    command, tiny_dir, tiny_tokenizer, run_text, tmp_path, capsys
):
    out = tmp_path / "out"
    model, text = ["--model", str(tiny_dir), "--device", "cpu"], ["--text", str(run_text), "--out", str(out)]
    argv = {
        "ablate": ["ablate", *model, *text, *DATA, "--estimate", "atp", "--formats", "none"],
        "ablate-sweep": ["ablate", *model, *text, *DATA, "--formats", "none"],  # the exact sweep's report
        "prune": ["prune", *model, *text, *DATA, "--methods", "random", "--n-seeds", "1", "--step-fraction", "0.5"],
        "robustness": ["robustness", *model, *text, *SCAN, "--vary", "seed", "--control-seeds", "1", "--n-boot", "10"],
        "diff": [
            "diff",
            str(tiny_dir),
            str(tiny_dir),
            "--requantize-b",  # B differs: identical weights are refused first
            "int8",
            "--device",
            "cpu",
            *text,
            *DATA,
            "-k",
            "2",
            "--types",
            "induction",
        ],
    }[command]
    assert main(argv) == 0
    expect = _expect(tiny_tokenizer, run_text, 15)
    notes = _notes(capsys)
    assert len(notes) == 1 and notes[0].startswith(expect), notes
    s = _summary(out)
    recorded = {
        "ablate": lambda: s["tokens"],
        "ablate-sweep": lambda: s["tokens"],
        "prune": lambda: s["tokens"],
        "robustness": lambda: s["conditions"][0]["natural"],
        "diff": lambda: s["natural_text"],
    }[command]()
    skipped, total = left_out(tiny_tokenizer, run_text, 15)
    assert (recorded["windows_left_out"], recorded["windows_available"]) == (skipped, total - skipped)


def test_kv_and_import_say_the_windows_of_each_token_set(tiny_dir, tiny_tokenizer, run_text, tmp_path, capsys):
    """kv draws natural windows of 63 text tokens and the long-range haystack's of 31 (64 - 2 blocks
    of 16 - BOS): a note and a count for each; import --kv the same, the natural windows once."""
    out = tmp_path / "kv"
    model, text = ["--model", str(tiny_dir), "--device", "cpu"], ["--text", str(run_text)]
    kv = ["kv", *model, *text, "--out", str(out), "--seq-len", "64", "--n-random", "1", "--budgets", "0.5"]
    assert main([*kv, "--formats", "none"]) == 0
    natural, long_range = (
        _expect(tiny_tokenizer, run_text, 63, "natural"),
        _expect(tiny_tokenizer, run_text, 31, "long_range"),
    )
    notes = _notes(capsys)
    assert len(notes) == 2 and notes[0].startswith(natural) and notes[1].startswith(long_range), notes
    windows = _summary(out)["windows"]
    for name, body in (("natural", 63), ("long_range", 31)):
        skipped, total = left_out(tiny_tokenizer, run_text, body)
        assert (windows[name]["windows_left_out"], windows[name]["windows_available"]) == (skipped, total - skipped)
    assert main(["export", "--from", str(out), "--out", str(tmp_path / "export")]) == 0
    capsys.readouterr()
    imp = ["import", *model, *text, "--heads-file", str(tmp_path / "export"), "--seq-len", "64", "--n-random", "2"]
    assert main([*imp, "--kv"]) == 0
    notes = _notes(capsys)
    kv_set = _expect(tiny_tokenizer, run_text, 31, "long-range set (--kv)")
    assert len(notes) == 2 and notes[0].startswith(_expect(tiny_tokenizer, run_text, 63)), notes
    assert notes[1].startswith(kv_set), notes


def test_view_and_atlas_say_the_windows_of_the_scan_they_redraw(tiny_dir, tiny_tokenizer, run_text, tmp_path, capsys):
    """view --model rebuilds a scan's token sets for patterns.npz; atlas scans each model and
    records each scan's count beside its status."""
    scan, atlas = tmp_path / "scan", tmp_path / "atlas"
    model, text = ["--model", str(tiny_dir), "--device", "cpu"], ["--text", str(run_text)]
    assert main(["scan", *model, *text, "--out", str(scan), *SCORES, "--no-metrics", "--pattern-len", "0"]) == 0
    capsys.readouterr()
    expect = _expect(tiny_tokenizer, run_text, 15)
    assert main(["view", str(scan), *model, "--pattern-len", "8"]) == 0
    notes = _notes(capsys)
    assert len(notes) == 1 and notes[0].startswith(expect), notes
    argv = ["atlas", "--models", str(tiny_dir), "--device", "cpu", *text, "--out", str(atlas), *SCAN]
    assert main([*argv, "--no-metrics", "--types", "induction", "--pattern-len", "0", "--no-model-figures"]) == 0
    notes = _notes(capsys)
    label = next(iter(_summary(atlas)["models"]))
    assert len(notes) == 1 and notes[0].startswith(expect.replace("NOTE: ", f"NOTE: {label}: ")), notes
    skipped, total = left_out(tiny_tokenizer, run_text, 15)
    rec = _summary(atlas)["models"][label]
    assert (rec["windows_left_out"], rec["windows_available"]) == (skipped, total - skipped)


def test_scan_says_and_records_the_windows_its_retrieval_needles_left_out(
    tiny_dir, tiny_tokenizer, run_text, tmp_path, capsys
):
    """scan's retrieval score draws its own haystack windows (16 tokens less BOS and two needles of
    3: windows of 9 text tokens), apart from the natural text's 15: a note and a count for each."""
    out = tmp_path / "scan"
    model, text = ["--model", str(tiny_dir), "--device", "cpu"], ["--text", str(run_text), "--out", str(out)]
    assert main(["scan", *model, *text, *SCORES, "--pattern-len", "0"]) == 0
    notes = _notes(capsys)
    natural, needles = _expect(tiny_tokenizer, run_text, 15), _expect(tiny_tokenizer, run_text, 9, "retrieval haystack")
    assert len(notes) == 2 and notes[0].startswith(natural) and notes[1].startswith(needles), notes
    tokens = _summary(out)["tokens"]
    for name, body in (("natural_text", 15), ("retrieval_needles", 9)):
        skipped, total = left_out(tiny_tokenizer, run_text, body)
        assert (tokens[name]["windows_left_out"], tokens[name]["windows_available"]) == (skipped, total - skipped)
    assert tokens["retrieval_needles"]["needle_len"] == 3 and tokens["retrieval_needles"]["sequences"] == 3


def test_atlas_says_and_records_the_windows_its_scans_retrieval_needles_left_out(
    tiny_dir, tiny_tokenizer, run_text, tmp_path, capsys
):
    """Each scan of an atlas draws the retrieval score's haystack apart (windows of 9 text tokens,
    the natural text's of 15): the atlas names both in its NOTEs and records both in the model's record."""
    atlas = tmp_path / "atlas"
    argv = ["atlas", "--models", str(tiny_dir), "--device", "cpu", "--text", str(run_text), "--out", str(atlas), *SCAN]
    assert main([*argv, "--types", "induction", "--pattern-len", "0", "--no-model-figures"]) == 0
    notes = _notes(capsys)
    label = next(iter(_summary(atlas)["models"]))
    natural = _expect(tiny_tokenizer, run_text, 15, label)
    needles = _expect(tiny_tokenizer, run_text, 9, f"{label} retrieval haystack")
    assert len(notes) == 2 and notes[0].startswith(natural) and notes[1].startswith(needles), notes
    rec = _summary(atlas)["models"][label]
    for counts, body in ((rec, 15), (rec["retrieval_needles"], 9)):
        skipped, total = left_out(tiny_tokenizer, run_text, body)
        assert (counts["windows_left_out"], counts["windows_available"]) == (skipped, total - skipped)
