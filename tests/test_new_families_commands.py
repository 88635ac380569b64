"""The 2025-26 families end to end (issue 38): ``circuit``, a scan with streamed statistics and a
float16 scan on tiny Gemma-3 and GPT-OSS checkpoints, GPT-OSS's learned-sink mass in head_scores.csv,
and ``kv``'s one-line refusal of their sliding-window layers (not yet supported)."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import zoo

from headprobe.cli import main

FAMILIES = ("gemma3_text", "gpt_oss")
SCAN = ["--seq-len", "16", "--n-natural", "3", "--n-repeated", "2", "--period", "6", "-k", "3", "--n-random", "2",
        "--device", "cpu", "--formats", "none"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, tiny_tokenizer):
    root = tmp_path_factory.mktemp("new-families")
    return {f: zoo.save_dir(f, tiny_tokenizer, root / f) for f in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_circuit_runs_and_kv_refuses_sliding_layers_in_one_line(dirs, family, text_file, tmp_path, capsys):
    """Path patching runs (its baseline identity holds); ``kv`` does not yet choose policies for
    models with sliding-window layers (both families have them) and says so in one line."""
    model = str(dirs[family])
    assert main(["circuit", "--model", model, "--n-seqs", "2", "--period", "6", "--steps", "2", "--verify", "4",
                 "--device", "cpu", "--out", str(tmp_path / "c")]) == 0
    summary = json.loads((tmp_path / "c" / "summary.json").read_text())
    assert summary["agreement"]["n_edges"] >= 4 and summary["baseline_error"] < 1e-4
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        raise SystemExit(main(["kv", "--model", model, "--text", str(text_file), "--seq-len", "64", "--device", "cpu",
                               "--out", str(tmp_path / "kv")]))
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("headprobe: error:")]
    assert e.value.code == 2 and len(errors) == 1 and "sliding-window layers" in errors[0]
    assert not (tmp_path / "kv").exists()


@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_and_float16_scans_run(dirs, family, text_file, tmp_path):
    model = str(dirs[family])
    for name, extra in (("streamed", ["--streaming", "on"]), ("fp16", ["--dtype", "float16"])):
        out = tmp_path / name
        assert main(["scan", "--model", model, "--text", str(text_file), *SCAN, *extra, "--out", str(out)]) == 0
        summary = json.loads((out / "summary.json").read_text())
        assert summary["dtype"] == ("float16" if name == "fp16" else "float32")


def test_learned_sink_mass_is_reported_where_the_model_has_sinks(dirs, text_file, tmp_path):
    """GPT-OSS: a learned-sink mass in (0, 1) for every head (its identity with ``1 - row sum`` is
    tests/test_metrics.py's and tests/test_selfcheck.py's); Gemma-3 has no sinks: NaN, and the
    summary says why."""
    for family in FAMILIES:
        out = tmp_path / family
        assert main(["scan", "--model", str(dirs[family]), "--text", str(text_file), *SCAN, "--out", str(out)]) == 0
        mass = pd.read_csv(out / "head_scores.csv")["learned_sink_mass"]
        if family == "gpt_oss":
            assert len(mass) == 2 * 4 and ((mass > 0) & (mass < 1)).all()
        else:
            assert mass.isna().all()
            assert "learned_sink_mass" in json.dumps(json.loads((out / "summary.json").read_text()))
