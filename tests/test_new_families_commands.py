"""The 2025-26 families end to end: ``circuit``, a scan with streamed statistics and a
float16 scan on tiny Gemma-3 and GPT-OSS checkpoints, GPT-OSS's learned-sink mass in head_scores.csv,
and ``kv`` with their sliding-window layers."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import zoo

from headprobe.cli import main

FAMILIES = ("gemma3_text", "gpt_oss")
SCAN = [
    "--seq-len",
    "16",
    "--n-natural",
    "3",
    "--n-repeated",
    "2",
    "--period",
    "6",
    "-k",
    "3",
    "--n-random",
    "2",
    "--device",
    "cpu",
    "--formats",
    "none",
]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, tiny_tokenizer):
    root = tmp_path_factory.mktemp("new-families")
    return {f: zoo.save_dir(f, tiny_tokenizer, root / f) for f in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_circuit_runs(dirs, family, tmp_path):
    """Path patching runs (its baseline identity holds)."""
    model = str(dirs[family])
    assert (
        main(
            [
                "circuit",
                "--model",
                model,
                "--n-seqs",
                "2",
                "--period",
                "6",
                "--steps",
                "2",
                "--verify",
                "4",
                "--device",
                "cpu",
                "--out",
                str(tmp_path / "c"),
            ]
        )
        == 0
    )
    summary = json.loads((tmp_path / "c" / "summary.json").read_text())
    assert summary["agreement"]["n_edges"] >= 4 and summary["baseline_error"] < 1e-4


KV = [
    "--seq-len",
    "48",
    "--block-len",
    "6",
    "--sink",
    "2",
    "--kv-budget",
    "0.5",
    "--budgets",
    "0.75",
    "--n-random",
    "2",
    "--method",
    "measured",
    "--device",
    "cpu",
]


def _kv(model, text_file, out, *extra):
    assert main(["kv", "--model", model, "--text", str(text_file), *KV, *extra, "--out", str(out)]) == 0
    return (
        json.loads((out / "summary.json").read_text()),
        pd.read_csv(out / "group_costs.csv"),
        pd.read_csv(out / "curve.csv"),
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_kv_runs_with_sliding_layers(dirs, family, text_file, tmp_path, capsys):
    """``kv`` on models with sliding-window layers (window 8 here). With ``--window 4`` every group
    is a candidate (a sliding layer's groups stream inside its window); with ``--window 8`` the
    sliding layer's groups would be unchanged, so they are full in every policy, cost nothing
    measured, and the random controls keep the chosen policy's bytes exactly."""
    model = str(dirs[family])
    windows = json.loads(json.dumps(zoo.tiny(family).layout))  # the zoo's expected (kind, bias, qk_norm, windows)
    sliding = [layer for layer, w in enumerate(windows[3]) if w is not None]
    assert sliding and len(sliding) < len(windows[3])
    for window, excluded in ((4, False), (8, True)):
        s, groups, curve = _kv(model, text_file, tmp_path / f"w{window}", "--window", str(window))
        block = s["sliding_window_layers"]
        assert block["windows"] == list(windows[3])
        out = [f"{layer}.{g}" for layer in sliding for g in range(s["n_kv_groups"])] if excluded else []
        assert block["excluded_groups"] == out
        assert groups["candidate"].tolist() == [f"{r.layer}.{r.kv_group}" not in out for r in groups.itertuples()]
        assert (groups[~groups["candidate"]]["score"] == 0).all() and groups[~groups["candidate"]]["full_cache"].all()
        assert not any(g in out for g in s["full_groups"])
        assert s["cache_check"]["ok"] and s["cache_check"]["allocated_bytes"] == s["cache_check"]["policy_cost_bytes"]
        assert s["cache_check"]["tokens"] > 8  # past the layer window: the window decides the sliding groups' bytes
        assert s["kv_fraction"] <= 0.5 + 1e-9
        chosen = curve[(curve.policy == "chosen")]
        for b, row in chosen.set_index("budget").iterrows():
            rnd = curve[(curve.policy == "random") & (curve.budget == b)]
            assert (rnd["kv_bytes"] == row["kv_bytes"]).all()
            assert (curve[(curve.policy == "uniform") & (curve.budget == b)]["kv_bytes"] <= row["kv_bytes"]).all()
        assert "candidate KV groups" in capsys.readouterr().out if excluded else True


def test_kv_refuses_when_no_group_would_change(tiny_tokenizer, text_file, tmp_path, capsys):
    """Mistral: every layer windowed (8); with ``--window 8`` streaming would change nothing anywhere:
    one line, exit 2, nothing written."""
    model = str(zoo.save_dir("mistral", tiny_tokenizer, tmp_path / "mistral"))
    out = tmp_path / "kv"
    with pytest.raises(SystemExit) as e:
        raise SystemExit(
            main(["kv", "--model", model, "--text", str(text_file), *KV, "--window", "8", "--out", str(out)])
        )
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("headprobe: error:")]
    assert e.value.code == 2 and len(errors) == 1 and "streaming would change nothing" in errors[0]
    assert "Traceback" not in err and not out.exists()


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
