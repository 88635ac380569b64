"""``prune --per-layer``'s NOTE and figure mark for an unreliable held-out pick: the layers whose
best head, picked on one half of the windows, lost more on the other half than their worst head.
Hand-made tables (the layers expected are written out by hand) through the command's own note,
figure and, on the tiny model, its terminal and summary.json."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from headprobe.cli import main
from headprobe.commands import prune_core


def table(best: list[float], worst: list[float], agree: list[bool]) -> list[dict]:
    """A per-layer table of ``len(best)`` layers, clean loss 3.0, every other column filled in."""
    return [
        {
            "layer": i,
            "best_head": i % 4,
            "loss_best_only": b,
            "loss_worst_only": w,
            "loss_layer_ablated": 4.0,
            "clean_loss": 3.0,
            "delta_best_only": b - 3.0,
            "best_head_halves_agree": a,
        }
        for i, (b, w, a) in enumerate(zip(best, worst, agree, strict=True))
    ]


# layers 1 and 3: best above worst (by 0.2 and 0.05); layer 2: a tie (not above); layer 4: no head left
INVERTED = table(
    [3.1, 3.5, 3.3, 3.25, float("nan")], [3.9, 3.3, 3.3, 3.2, float("nan")], [True, False, False, False, False]
)
SOUND = table([3.1, 3.2, 3.3], [3.9, 3.4, 3.3], [True, False, False])  # halves disagree, but best <= worst everywhere


def test_the_note_names_the_layers_whose_best_head_lost_to_the_worst():
    (note,) = prune_core.per_layer_notes(INVERTED, [2, 64])
    assert "in 2 of 4 layers (1, 3)" in note  # layer 4 has no head: not counted
    assert "by up to 0.200 nats" in note
    assert "different best heads in 3 of 4" in note
    assert "with 1 window of 64 tokens per half" in note
    assert "--n-natural (now 2; the default 8)" in note
    (odd,) = prune_core.per_layer_notes(INVERTED, [5, 32])
    assert "with 3 and 2 windows of 32 tokens per half" in odd


def test_no_note_where_every_best_head_is_at_or_below_its_worst():
    assert prune_core.per_layer_notes(SOUND, [2, 64]) == []


@pytest.mark.parametrize(("rows", "marked"), [(INVERTED, [1, 3]), (SOUND, [])])
def test_the_figure_draws_the_noted_layers_hollow(tmp_path, rows, marked):
    """The hollow markers sit at exactly the noted layers, also redrawn from per_layer.csv (bools as text)."""
    (tmp_path / "per_layer.csv").write_text(pd.DataFrame(rows).to_csv(index=False))
    for t in (pd.DataFrame(rows), pd.read_csv(tmp_path / "per_layer.csv")):
        fig = prune_core.per_layer_figure(t, "m", "float32")
        (ax,) = [a for a in fig.axes if a.get_legend() is not None]
        hollow = [line for line in ax.get_lines() if line.get_markerfacecolor() == "white"]
        assert [list(line.get_xdata()) for line in hollow] == ([marked] if marked else [])
        for line in hollow:
            assert list(line.get_ydata()) == [rows[i]["loss_best_only"] for i in marked]
            assert line.get_label() == f"best above worst, held out ({len(marked)} layers): pick is noise"
        labels = [x.get_text() for x in ax.get_legend().get_texts()]
        assert any("pick is noise" in x for x in labels) == bool(marked)


@pytest.mark.parametrize(("rows", "noted"), [(INVERTED, True), (SOUND, False)])
def test_prune_prints_and_saves_the_note(tiny_dir, tmp_path, capsys, monkeypatch, rows, noted):
    """End to end on the tiny model with the per-layer table replaced by a hand-made one: the NOTE on the
    terminal and in summary.json's ``notes``, only for the table with a best head above its worst."""
    monkeypatch.setattr(prune_core, "per_layer_best_head", lambda *a, **k: [dict(r) for r in rows])
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"t{i % 97}" for i in range(0, 20000, 7)))
    out = tmp_path / "prune"
    args = ["prune", "--model", str(tiny_dir), "--out", str(out), "--text", str(text), "--method", "random"]
    args += ["--n-seeds", "1", "--step-fraction", "1", "--per-layer", "--seq-len", "16", "--n-natural", "3"]
    assert main([*args, "--n-repeated", "2", "--period", "6", "--device", "cpu"]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("NOTE: per layer")]
    notes = [n for n in json.loads((out / "summary.json").read_text())["notes"] if n.startswith("per layer")]
    assert len(lines) == len(notes) == int(noted)
    if noted:
        assert lines[0] == f"NOTE: {notes[0]}"
        assert "(1, 3)" in notes[0] and "2 and 1 windows of 16 tokens per half" in notes[0]
