"""Issue 39 (items 1, 2): ``headprobe export`` writes the files DuoAttention/kvpress,
Retrieval_Head/HeadKV, EAP-IG/MIB and pandas/datasets read; ``headprobe import`` reads them back,
refuses a file of another shape in one line and gives scan's verdict on its heads.

The readers of the other tools are copied here (a few lines each, sources cited) as the
independent reference; nothing in them is headprobe's code."""

from __future__ import annotations

import json
import subprocess
import sys
from io import StringIO
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from headprobe.cli import main

SMALL_SCAN = ["--device", "cpu", "--n-random", "4", "--keep-n-random", "--types", "induction,previous-token", "-k", "2",
              "--seq-len", "24", "--n-natural", "3", "--n-repeated", "3", "--period", "8", "--pattern-len", "0"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_dir, text_file):
    """A scan, a kv and a circuit run of the tiny GQA Llama (2 layers x 8 heads, 2 KV heads)."""
    base = tmp_path_factory.mktemp("runs")
    assert main(["scan", "--model", str(tiny_dir), "--text", str(text_file), "--out", str(base / "scan"), *SMALL_SCAN]) == 0
    assert main(["kv", "--model", str(tiny_dir), "--text", str(text_file), "--seq-len", "64", "--out", str(base / "kv"),
                 "--device", "cpu", "--n-random", "1", "--budgets", "0.5"]) == 0
    assert main(["circuit", "--model", str(tiny_dir), "--out", str(base / "circuit"), "--device", "cpu", "--n-seqs", "2",
                 "--period", "6", "--steps", "2", "--verify", "4", "--top", "5"]) == 0
    return base


def _export(src: Path, out: Path, *flags: str) -> Path:
    assert main(["export", "--from", str(src), "--out", str(out), *flags]) == 0
    return out


def _layout(tiny_dir):
    from headprobe.analyses.exchange import Layout
    return Layout(str(tiny_dir), 2, 8, 2, 2)


def kvpress_load(directory: Path):
    """kvpress ``DuoAttentionPress.load_attention_pattern`` (NVIDIA/kvpress,
    kvpress/presses/duo_attention_press.py), its file reading with the HTTP GET replaced by a local read."""
    config = json.loads((directory / "config.json").read_text())
    text = (directory / "full_attention_heads.tsv").read_text()
    head_scores = np.loadtxt(StringIO(text), dtype=float, delimiter="\t")
    head_scores = np.clip(head_scores, 0, 1)
    return config["sink_size"], config["recent_size"], head_scores


def retrieval_head_load(path: Path):
    """Retrieval_Head's README reader (nightdessert/Retrieval_Head, also HeadKV's): one line of
    JSON, each head's mean score, ``[layer, head]`` from the key."""
    with open(path) as file:
        head_list = json.loads(file.readline())
    return [([int(ll) for ll in l[0].split("-")], np.mean(l[1])) for l in head_list.items()]


def test_duo_round_trip_of_a_kv_policy(runs, tmp_path, tiny_dir):
    """kv policy -> TSV + config.json -> kvpress's reader (shape [layers, KV heads], sink, window)
    and headprobe's reader (the same policy)."""
    from headprobe.analyses.exchange import read_head_file, read_kv_policy

    out = _export(runs / "kv", tmp_path / "e", "--format", "duo")
    policy = read_kv_policy(runs / "kv" / "policy.json")
    sink, recent, scores = kvpress_load(out)
    assert scores.shape == (2, 2)
    assert (sink, recent) == next((s.sink, s.window) for row in policy.groups for s in row if s is not None)
    assert [[bool(v) for v in row] for row in scores] == [[s is None for s in row] for row in policy.groups]
    back = read_head_file(out / "full_attention_heads.tsv", _layout(tiny_dir), 2)
    assert back.policy is not None and back.policy.groups == policy.groups
    assert back.heads == [(layer, g * 4 + i) for layer, g in policy.full_groups for i in range(4)]
    meta = json.loads((out / "config.json").read_text())["headprobe"]
    assert (meta["n_layers"], meta["n_heads"], meta["n_kv_heads"]) == (2, 8, 2)


def test_duo_from_a_scan_states_its_aggregation(runs, tmp_path):
    """A scan's column per KV group: the max over the group's query heads (hand-computed here)."""
    out = _export(runs / "scan", tmp_path / "e", "--format", "duo", "--score", "induction", "--sink", "4", "--recent", "8")
    _, _, scores = kvpress_load(out)
    table = pd.read_csv(runs / "scan" / "head_scores.csv")
    want = [[min(1.0, max(table[(table.layer == layer) & (table["head"] // 4 == g)].induction)) for g in range(2)]
            for layer in range(2)]
    np.testing.assert_allclose(scores, want, atol=1e-6)
    assert "max over each KV group" in json.loads((out / "config.json").read_text())["headprobe"]["values"]


def test_headkv_round_trip(runs, tmp_path, tiny_dir):
    """Retrieval_Head's reader gets every head's score; headprobe reads back the same top-k."""
    from headprobe.analyses.exchange import read_head_file

    out = _export(runs / "scan", tmp_path / "e", "--format", "headkv", "--score", "induction")
    path = out / "head_score" / f"{Path(str(tiny_dir)).name}.json"
    table = pd.read_csv(runs / "scan" / "head_scores.csv")
    got = {tuple(h): s for h, s in retrieval_head_load(path)}
    assert len(got) == 16
    for r in table.itertuples():
        assert got[(r.layer, r.head)] == pytest.approx(r.induction, abs=1e-9)
    top = sorted(sorted(got, key=lambda h: -got[h])[:3])
    assert read_head_file(path, _layout(tiny_dir), 3).heads == top
    assert json.loads(path.with_suffix(".provenance.json").read_text())["n_kv_heads"] == 2


def test_parquet_reads_in_pandas_and_datasets(runs, tmp_path):
    """pandas reads the table (scores as head_scores.csv, verdict columns as summary.json's), the
    card's YAML front matter names the model, and ``datasets`` loads it where installed."""
    out = _export(runs / "scan", tmp_path / "e", "--format", "parquet")
    table = pd.read_parquet(out / "heads.parquet")
    csv = pd.read_csv(runs / "scan" / "head_scores.csv")
    pd.testing.assert_frame_equal(table[csv.columns], csv, check_dtype=False)
    summary = json.loads((runs / "scan" / "summary.json").read_text())
    for a in (a for a in summary["ablations"] if a["kind"] == "mean"):
        rows = table[table[f"top_{a['head_type']}"]]
        assert sorted(f"{r.layer}.{r.head}" for r in rows.itertuples()) == sorted(a["top_heads"])
        assert set(rows[f"confirmed_{a['head_type']}"].dropna()) <= {a["confirmed"]}
    card = (out / "README.md").read_text()
    yaml = pytest.importorskip("yaml")
    meta = yaml.safe_load(card.split("---\n")[1])
    assert meta["headprobe"]["model"] == summary["model"] and meta["headprobe"]["n_kv_heads"] == 2
    datasets = pytest.importorskip("datasets")
    ds = datasets.load_dataset("parquet", data_files=str(out / "heads.parquet"), cache_dir=str(tmp_path / "cache"))
    assert ds["train"].num_rows == 16


def test_mib_round_trip(runs, tmp_path, tiny_dir):
    """EAP-IG names; the graph's heads are the endpoints of the circuit's top edges (edges.csv)."""
    from headprobe.analyses.exchange import read_head_file

    out = _export(runs / "circuit", tmp_path / "e", "--format", "mib")
    graph = json.loads((out / "circuit_graph.json").read_text())
    edges = pd.read_csv(runs / "circuit" / "edges.csv", dtype=str).head(5)
    want = sorted({tuple(map(int, h.split("."))) for h in [*edges.sender, *edges.receiver] if h != "logits"})
    assert read_head_file(out / "circuit_graph.json", _layout(tiny_dir), 2).heads == want
    names = [k for k, v in graph["edges"].items() if v["in_graph"]]
    assert len(names) == 5 and all(n.endswith(("<q>", "<k>", "<v>", "->logits")) for n in names)
    assert len(graph["headprobe"]["path_patched"]) == graph["headprobe"]["n_path_patched"] > 0
    assert graph["cfg"]["n_layers"] == 2 and {"input", "m0", "logits", "a1.h7"} <= set(graph["nodes"])


def test_a_format_the_source_lacks_is_refused_and_nothing_is_written(runs, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        raise SystemExit(main(["export", "--from", str(runs / "scan"), "--out", str(tmp_path / "o"), "--format", "mib"]))
    assert e.value.code == 2 and "needs a circuit folder" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def _refuse(argv, cwd):
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "headprobe", *argv], capture_output=True, text=True,
                       cwd=cwd, timeout=300)
    lines = r.stderr.splitlines()
    errors = [x for x in lines if not x.startswith("import time:")]
    torch = any(x.startswith("import time:") and x.rsplit("|", 1)[-1].strip() == "torch" for x in lines)
    return r.returncode, errors, torch


def test_a_32_row_tsv_for_a_30_layer_model_is_refused_in_one_line(tmp_path):
    """duo-attention#23: a 32-row file for SmolLM2 (30 layers), refused from its config, before torch."""
    np.savetxt(tmp_path / "full_attention_heads.tsv", np.full((32, 3), 0.5), delimiter="\t")
    code, errors, torch = _refuse(["import", "--heads-file", "full_attention_heads.tsv", "--model", "smollm2-135m"], tmp_path)
    assert code == 2 and errors == ["headprobe: error: full_attention_heads.tsv has 32 rows; smollm2-135m has 30 layers"]
    assert not torch
    np.savetxt(tmp_path / "full_attention_heads.tsv", np.full((30, 4), 0.5), delimiter="\t")
    code, errors, _ = _refuse(["import", "--heads-file", "full_attention_heads.tsv", "--model", "smollm2-135m"], tmp_path)
    assert code == 2 and errors == ["headprobe: error: full_attention_heads.tsv has 4 columns; smollm2-135m has 3 KV heads "
                                    "per layer"]


def test_import_gives_scans_verdict_on_scans_own_heads(runs, tmp_path, tiny_dir, text_file, capsys):
    """A list of scan's induction top-k heads: import ablates the same set on the same tokens, so
    its top-set effect is scan's; the verdict comes from the same verification."""
    summary = json.loads((runs / "scan" / "summary.json").read_text())
    scan_row = next(a for a in summary["ablations"] if a["head_type"] == "induction" and a["kind"] == "mean")
    (tmp_path / "heads.txt").write_text("\n".join(scan_row["top_heads"]) + "\n")
    from headprobe.commands.import_heads import import_heads

    result = import_heads(str(tiny_dir), heads_file=str(tmp_path / "heads.txt"), text=str(text_file),
                                    task="repeated", device="cpu", n_random=4, keep_n_random=True, seq_len=24,
                                    n_natural=3, n_repeated=3, period=8)
    tested = next(v for v in result.verifications if v.tested)
    assert sorted(tested.top_heads) == sorted(scan_row["top_heads"]) and tested.task == "repeated"
    assert tested.top_effect == pytest.approx(scan_row["top_effect"], abs=1e-6)
    assert tested.draws is not None and tested.draws >= 1
    assert "mean-ablation on repeated" in result.report()


def test_import_measures_a_duo_files_policy(runs, tmp_path, tiny_dir, text_file):
    """--kv: the exported policy measured again equals the kv run's own measurement of it."""
    out = _export(runs / "kv", tmp_path / "e", "--format", "duo")
    from headprobe.commands.import_heads import import_heads

    result = import_heads(str(tiny_dir), heads_file=str(out), text=str(text_file), device="cpu", n_random=2,
                                    keep_n_random=True, seq_len=64, n_natural=1, period=8, measure_kv=True, task="natural")
    kv = json.loads((runs / "kv" / "summary.json").read_text())
    row = next(r for r in result.kv if r["policy"] == "file")
    assert row["natural_loss_increase"] == pytest.approx(kv["chosen"]["natural_loss_increase"], abs=1e-5)
    assert row["kv_fraction"] == pytest.approx(kv["kv_fraction"], abs=1e-9)
