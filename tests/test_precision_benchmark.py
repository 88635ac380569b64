"""benchmarks/precision.py on the CPU: its three printed numbers recomputed from the file it writes
(largest |effect difference|, Spearman by pandas' ranks, heads across the effect floor), and its
signed offset line (mean, median, heads raised, crossings up and down) recomputed by numpy."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def test_printed_numbers_are_the_files(tiny_dir, tmp_path, capsys, monkeypatch):
    from headprobe.analyses import data

    # the tiny tokenizer reads the default text as one unknown word: random tokens give real effects
    tokens = torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(data, "natural_text_tokens", lambda *a, **k: SimpleNamespace(tokens=tokens))
    spec = importlib.util.spec_from_file_location("precision_benchmark", ROOT / "benchmarks" / "precision.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "effects.csv"
    module.main(["--model", str(tiny_dir), "--device", "cpu", "--out", str(out)])
    printed = capsys.readouterr().out.splitlines()
    line = next(x for x in printed if x.startswith("bfloat16:"))
    offset = next(x for x in printed if x.startswith("bfloat16 - float32:"))
    diff, rho, flips, n = re.search(
        r"difference\| (\S+) nats/token; Spearman (\S+); .*floor: (\d+) of (\d+)", line
    ).groups()
    d = pd.read_csv(out)
    assert list(d.columns) == ["layer", "head", "float32", "bfloat16"] and len(d) == 2 * 8 == int(n)
    a, b = d["float32"].to_numpy(), d["bfloat16"].to_numpy()
    assert np.abs(a).max() > 0  # real effects, not a degenerate case
    assert float(diff) == pytest.approx(np.abs(a - b).max(), abs=5e-5)
    ranks = np.corrcoef(pd.Series(a).rank(), pd.Series(b).rank())[0, 1]
    assert float(rho) == pytest.approx(ranks, abs=5e-5)
    from headprobe.analyses.verdicts import VerdictRule

    floor = VerdictRule().min_effect
    assert int(flips) == int(((a >= floor) != (b >= floor)).sum())
    mean, median, higher, m, up, down = re.search(
        r"mean (\S+), median (\S+) nats/token; higher for (\d+) of (\d+) heads; crossings up (\d+), down (\d+)", offset
    ).groups()
    signed = b - a
    assert float(mean) == pytest.approx(signed.mean(), abs=5e-5)
    assert float(median) == pytest.approx(np.median(signed), abs=5e-5)
    assert (int(higher), int(m)) == (int((signed > 0).sum()), len(d))
    assert int(up) == int(((a < floor) & (b >= floor)).sum()) and int(down) == int(((b < floor) & (a >= floor)).sum())
    assert int(up) + int(down) == int(flips)
