"""``headprobe export`` writes the files DuoAttention/kvpress,
Retrieval_Head/HeadKV, EAP-IG/MIB and pandas/datasets read; ``headprobe import`` reads them back,
refuses a file of another shape in one line and gives scan's verdict on its heads.

The readers of the other tools are copied here (a few lines each, sources cited) as the
independent reference; nothing in them is headprobe's code."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from io import StringIO
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from headprobe.cli import main
from headprobe.options import in_python
from headprobe.probe.core.errors import HeadprobeError

SMALL_SCAN = [
    "--device",
    "cpu",
    "--n-random",
    "4",
    "--keep-n-random",
    "--types",
    "induction,previous-token",
    "-k",
    "2",
    "--seq-len",
    "24",
    "--n-natural",
    "3",
    "--n-repeated",
    "3",
    "--period",
    "8",
    "--pattern-len",
    "0",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_dir, text_file):
    """A scan, a kv and a circuit run of the tiny GQA Llama (2 layers x 8 heads, 2 KV heads)."""
    base = tmp_path_factory.mktemp("runs")
    assert (
        main(["scan", "--model", str(tiny_dir), "--text", str(text_file), "--out", str(base / "scan"), *SMALL_SCAN])
        == 0
    )
    assert (
        main(
            [
                "kv",
                "--model",
                str(tiny_dir),
                "--text",
                str(text_file),
                "--seq-len",
                "64",
                "--out",
                str(base / "kv"),
                "--device",
                "cpu",
                "--n-random",
                "1",
                "--budgets",
                "0.5",
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "circuit",
                "--model",
                str(tiny_dir),
                "--out",
                str(base / "circuit"),
                "--device",
                "cpu",
                "--n-seqs",
                "2",
                "--period",
                "6",
                "--steps",
                "2",
                "--verify",
                "4",
                "--top",
                "5",
            ]
        )
        == 0
    )
    return base


def _export(src: Path, out: Path, *flags: str) -> Path:
    assert main(["export", "--from", str(src), "--out", str(out), *flags]) == 0
    return out


def _layout(tiny_dir):
    from headprobe.analyses.exchange import Layout

    return Layout(str(tiny_dir), 2, 8, 2, 2)


def kvpress_load(directory: Path):
    """Kvpress ``DuoAttentionPress.load_attention_pattern`` (NVIDIA/kvpress,
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


def test_duo_round_trip_of_a_kv_policy(runs, tmp_path, tiny_dir, capsys):
    """Kv policy -> TSV + config.json -> kvpress's reader (shape [layers, KV heads], sink, window)
    and headprobe's reader (the same policy)."""
    from headprobe.analyses.exchange import read_head_file, read_kv_policy

    capsys.readouterr()
    out = tmp_path / "e"
    assert main(["export", "--from", str(runs / "kv"), "--out", f"{out}/", "--format", "duo"]) == 0  # "e/" as typed
    assert f"files to {out}/\n" in capsys.readouterr().out  # said e/, not e//
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
    out = _export(
        runs / "scan", tmp_path / "e", "--format", "duo", "--score", "induction", "--sink", "4", "--recent", "8"
    )
    _, _, scores = kvpress_load(out)
    table = pd.read_csv(runs / "scan" / "head_scores.csv")
    want = [
        [min(1.0, max(table[(table.layer == layer) & (table["head"] // 4 == g)].induction)) for g in range(2)]
        for layer in range(2)
    ]
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
    """Pandas reads the table (scores as head_scores.csv, verdict columns as summary.json's), the
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
    # the card's column table: one row per column, in order, each saying what it measures and in what unit
    lines = [line for line in card.splitlines() if line.startswith("| `")]
    cells = [[c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]] for line in lines]
    assert [c[0].strip("`") for c in cells] == list(table.columns) and all(len(c) == 3 and c[2] for c in cells)
    unit = {c[0].strip("`"): c[2] for c in cells}
    assert "nats" in unit["entropy"] and "logit" in unit["dla"] and unit["top_induction"] == "bool"
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
        raise SystemExit(
            main(["export", "--from", str(runs / "scan"), "--out", str(tmp_path / "o"), "--format", "mib"])
        )
    assert e.value.code == 2 and "needs a circuit folder" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def _refuse(argv, cwd):
    r = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "headprobe", *argv],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
    )
    lines = r.stderr.splitlines()
    errors = [x for x in lines if not x.startswith("import time:")]
    torch = any(x.startswith("import time:") and x.rsplit("|", 1)[-1].strip() == "torch" for x in lines)
    return r.returncode, errors, torch


def test_a_32_row_tsv_for_a_30_layer_model_is_refused_in_one_line(tmp_path):
    """A 32-row file (Mistral 7B's shape) for SmolLM2 (30 layers), refused from its config, before torch."""
    np.savetxt(tmp_path / "full_attention_heads.tsv", np.full((32, 3), 0.5), delimiter="\t")
    code, errors, torch = _refuse(
        ["import", "--heads-file", "full_attention_heads.tsv", "--model", "smollm2-135m"], tmp_path
    )
    assert code == 2 and errors == [
        "headprobe: error: full_attention_heads.tsv has 32 rows; smollm2-135m has 30 layers"
    ]
    assert not torch
    np.savetxt(tmp_path / "full_attention_heads.tsv", np.full((30, 4), 0.5), delimiter="\t")
    code, errors, _ = _refuse(
        ["import", "--heads-file", "full_attention_heads.tsv", "--model", "smollm2-135m"], tmp_path
    )
    assert code == 2 and errors == [
        "headprobe: error: full_attention_heads.tsv has 4 columns; smollm2-135m has 3 KV heads per layer"
    ]


def test_import_gives_scans_verdict_on_scans_own_heads(runs, tmp_path, tiny_dir, text_file, capsys):
    """A list of scan's induction top-k heads: import ablates the same set on the same tokens, so
    its top-set effect is scan's; the verdict comes from the same verification."""
    summary = json.loads((runs / "scan" / "summary.json").read_text())
    scan_row = next(a for a in summary["ablations"] if a["head_type"] == "induction" and a["kind"] == "mean")
    (tmp_path / "heads.txt").write_text("\n".join(scan_row["top_heads"]) + "\n")
    from headprobe.commands.import_heads import import_heads

    result = import_heads(
        str(tiny_dir),
        heads_file=str(tmp_path / "heads.txt"),
        text=str(text_file),
        task="repeated",
        device="cpu",
        n_random=4,
        keep_n_random=True,
        seq_len=24,
        n_natural=3,
        n_repeated=3,
        period=8,
    )
    tested = next(v for v in result.verifications if v.tested)
    assert sorted(tested.top_heads) == sorted(scan_row["top_heads"]) and tested.task == "repeated"
    assert tested.top_effect == pytest.approx(scan_row["top_effect"], abs=1e-6)
    assert tested.draws is not None and tested.draws >= 1
    report = result.report()
    rule_line = f"(the rule: a verdict is CONFIRMED when {result_rule(result).condition()})"
    assert "mean-ablation on repeated" in report and rule_line in report.splitlines()  # the rule, not a verdict
    # the plan is said once, as the run begins (stderr), not again in the report
    assert result.design["plan"]["lines"] and "verification plan:" not in report
    if tested.no_verdict:  # a Python call's report spells the flags as keywords (n_random=19)
        assert in_python("import", f"no verdict: {tested.no_verdict}") in report
    if tested.confirmed is False:  # what it fell short of, on its line
        assert (
            f"({result_rule(result).shortfall(tested.p_adjusted, tested.top_effect, tested.random_effects)})" in report
        )


def result_rule(result):
    from headprobe.analyses.verdicts import VerdictRule

    return VerdictRule.from_dict(result.design["verdict_rule"])


def test_import_measures_a_duo_files_policy(runs, tmp_path, tiny_dir, text_file):
    """--kv: the exported policy measured again equals the kv run's own measurement of it."""
    out = _export(runs / "kv", tmp_path / "e", "--format", "duo")
    from headprobe.analyses.figures import format_ci
    from headprobe.commands.import_heads import import_heads

    result = import_heads(
        str(tiny_dir),
        heads_file=str(out),
        text=str(text_file),
        device="cpu",
        n_random=2,
        keep_n_random=True,
        seq_len=64,
        n_natural=1,
        period=8,
        measure_kv=True,
        task="natural",
    )
    kv = json.loads((runs / "kv" / "summary.json").read_text())
    row = next(r for r in result.kv if r["policy"] == "file")
    assert row["natural_loss_increase"] == pytest.approx(kv["chosen"]["natural_loss_increase"], abs=1e-5)
    assert row["kv_fraction"] == pytest.approx(kv["kv_fraction"], abs=1e-9)
    # the paired 95% intervals of the same evaluation, as the kv run's own of its policy (the same tokens, the
    # same bootstrap seed), printed with kv's formatter; the full row, without one, says it is a point estimate.
    # Old code: the rows had no intervals and printed none.
    c = kv["chosen"]
    assert row["natural_loss_increase_ci95"] == pytest.approx(
        [c["natural_loss_increase_ci95_lo"], c["natural_loss_increase_ci95_hi"]], abs=1e-5
    )
    assert row["copy_accuracy_drop_ci95"] == pytest.approx(
        [c["copy_accuracy_drop_ci95_lo"], c["copy_accuracy_drop_ci95_hi"]], abs=1e-9
    )
    lines = {ln.split(":")[0]: ln for ln in result.report().splitlines() if ln.startswith("kv ")}
    ci = format_ci(row["natural_loss_increase_ci95"], "+.4f")
    assert f"natural loss {row['natural_loss_increase']:+.4f} {ci}," in lines["kv     file"]
    drop = format_ci(row["copy_accuracy_drop_ci95"], "+.3f")
    assert lines["kv     file"].endswith(f"(drop {row['copy_accuracy_drop']:+.3f} {drop})")
    assert (
        "kv     full (reference, point estimates)" in lines
        and "[" not in lines["kv     full (reference, point estimates)"]
    )
    assert "(kv [lo, hi]: 95% CI of the paired difference from the full cache" in result.report()
    # the tokens measured on, named (a walker's import --kv, on import's 8 windows, differed from the kv run's
    # numbers without saying why): here kv's data, 1 window and kv's default long-range set, hence its numbers
    assert (result.kv_data["natural_windows"], result.kv_data["long_range_sequences"]) == (
        1,
        len(kv["config"]["distances"]),
    )
    data = next(ln for ln in result.report().splitlines() if ln.startswith("(kv data: "))
    assert data.startswith(
        f"(kv data: 1 natural-text window x 64 tokens of {text_file} (n_natural=1), 4 long-range "
    ), data
    assert "seed 0 (long-range 1)" in data and result.summary()["kv_data"] == result.kv_data


def _cli(argv, capsys) -> tuple[int, list[str]]:
    """``(exit status, stderr's lines)`` of ``headprobe ARGV`` run in this process."""
    capsys.readouterr()
    code = main(argv)
    return code, capsys.readouterr().err.splitlines()


def _one_line(code, err, fragment):
    assert code == 2 and len(err) == 1 and err[0].startswith("headprobe: error:") and fragment in err[0], err


def _copy(folder: Path, to: Path) -> Path:
    import shutil

    return Path(shutil.copytree(folder, to))


def test_a_kv_folder_whose_model_moved_exports_the_recorded_layout(runs, tmp_path, capsys):
    """The model folder the kv run names is gone: the layout comes from what the run recorded
    (policy_budget.json), 8 query heads in 2 KV groups, not the KV groups taken as query heads."""
    kv = _copy(runs / "kv", tmp_path / "kv")
    summary = json.loads((kv / "summary.json").read_text())
    summary["model"] = str(tmp_path / "moved-away")
    (kv / "summary.json").write_text(json.dumps(summary))
    out = _export(kv, tmp_path / "e", "--format", "headkv")
    got = retrieval_head_load(out / "head_score" / "moved-away.json")
    assert sorted(tuple(h) for h, _ in got) == [(layer, h) for layer in range(2) for h in range(8)]
    meta = json.loads((out / "head_score" / "moved-away.provenance.json").read_text())
    assert (meta["n_layers"], meta["n_heads"], meta["n_kv_heads"]) == (2, 8, 2)
    (kv / "policy_budget.json").unlink()  # nothing recorded, nothing to read: refused
    code, err = _cli(["export", "--from", str(kv), "--out", str(tmp_path / "f")], capsys)
    _one_line(code, err, "query heads")
    assert not (tmp_path / "f").exists()


@pytest.mark.parametrize("where", ["same", "inside", "containing"])
def test_an_output_folder_that_is_in_or_around_the_source_is_refused(runs, tmp_path, capsys, where):
    scan = _copy(runs / "scan", tmp_path / "runs" / "scan")
    before = {p.name: p.read_bytes() for p in scan.iterdir() if p.is_file()}
    to = {"same": scan / ".", "inside": scan / "export", "containing": tmp_path / "runs"}[where]
    code, err = _cli(["export", "--from", str(scan), "--out", str(to), "--overwrite"], capsys)
    _one_line(code, err, "source")
    assert {p.name: p.read_bytes() for p in scan.iterdir() if p.is_file()} == before
    assert not (scan / "export").exists()


def _scan_with(runs, tmp_path, column: str, nan_heads) -> Path:
    scan = _copy(runs / "scan", tmp_path / "scan")
    table = pd.read_csv(scan / "head_scores.csv")
    for layer, head in nan_heads:
        table.loc[(table.layer == layer) & (table["head"] == head), column] = np.nan
    table.to_csv(scan / "head_scores.csv", index=False)
    return scan


def test_headkv_export_writes_every_head_with_a_stated_fill(runs, tmp_path):
    """Heads without a score (a hybrid's linear-attention layer: layer 0 here) are written with the
    stated fill, so HeadKV's reshape to [layers, heads] works; the provenance names them."""
    scan = _scan_with(runs, tmp_path, "induction", [(0, h) for h in range(8)])
    out = _export(scan, tmp_path / "e", "--format", "headkv", "--score", "induction")
    name = next(p for p in (out / "head_score").glob("*.json") if not p.name.endswith(".provenance.json"))
    got = dict((tuple(h), s) for h, s in retrieval_head_load(name))
    assert sorted(got) == [(layer, h) for layer in range(2) for h in range(8)]
    np.array(list(got.values())).reshape(2, 8)  # HeadKV's reshape
    meta = json.loads(name.with_suffix(".provenance.json").read_text())
    table = pd.read_csv(scan / "head_scores.csv")
    fill = min(0.0, float(table.induction.min()))
    assert meta["filled"] == [f"0.{h}" for h in range(8)] and all(got[(0, h)] == fill for h in range(8))
    for r in table[table.layer == 1].itertuples():
        assert got[(1, r.head)] == pytest.approx(r.induction, abs=1e-9)


def test_an_all_nan_score_column_is_refused(runs, tmp_path, capsys):
    scan = _scan_with(runs, tmp_path, "induction", [(layer, h) for layer in range(2) for h in range(8)])
    for fmt in ("headkv", "duo"):
        code, err = _cli(
            ["export", "--from", str(scan), "--out", str(tmp_path / fmt), "--format", fmt, "--score", "induction"],
            capsys,
        )
        _one_line(code, err, "no score")
        assert not (tmp_path / fmt).exists()


def test_a_misspelt_score_column_names_the_closest_columns(runs, tmp_path, capsys):
    """``--score`` is checked against the scan's own columns (no argparse choices): a typo gets the
    closest one. Old code: "--score inductoin: ... has no such score column; it has ..." alone."""
    out = tmp_path / "e"
    code, err = _cli(["export", "--from", str(runs / "scan"), "--out", str(out), "--score", "inductoin"], capsys)
    _one_line(code, err, "--score inductoin (did you mean 'induction'")
    assert "has no such score column" in err[0] and not out.exists()


def _odd_file(case: str, d: Path) -> tuple[Path, list[str]]:
    """An odd head file of ``case`` in ``d``, and the flags it is imported with."""
    if case == "empty tsv":
        (d / "full_attention_heads.tsv").write_text("")
        return d / "full_attention_heads.tsv", []
    if case == "cut config.json":
        np.savetxt(d / "full_attention_heads.tsv", np.full((2, 2), 0.5), delimiter="\t")
        (d / "config.json").write_text('{"sink_size": 4, "rec')
        return d / "full_attention_heads.tsv", []
    if case == "config.json not an object":
        np.savetxt(d / "full_attention_heads.tsv", np.full((2, 2), 0.5), delimiter="\t")
        (d / "config.json").write_text("[4, 8]")
        return d / "full_attention_heads.tsv", []
    if case == "ragged tsv":
        (d / "full_attention_heads.tsv").write_text("1\t0\t0\t1\n0\t1\t0\t0\n# a comment\n\n1\t0\t1\n")
        return d / "full_attention_heads.tsv", []
    if case in ("400 digits", "1e400"):
        (d / "h.json").write_text('{"0-1": [' + ("9" * 400 if case == "400 digits" else "1e400") + "]}")
        return d / "h.json", []
    if case == "400 digits in a graph":
        graph = {
            "cfg": {"n_layers": 2, "n_heads": 8, "parallel_attn_mlp": False, "d_model": 64},
            "nodes": {"a0.h1": True},
            "edges": {"a0.h1->logits": {"score": int("9" * 400), "in_graph": True}},
        }
        (d / "graph.json").write_text(json.dumps(graph))
        return d / "graph.json", []
    if case in GRAPH_FAULTS:  # EAP-IG graphs the old reader took: a bad edge was skipped, a bad cfg key unchecked
        graph = {
            "cfg": {"n_layers": 2, "n_heads": 8, "parallel_attn_mlp": False, "d_model": 64},
            "nodes": {"a0.h1": True, "m0": False},
            "edges": {
                "a0.h1->logits": {"score": 0.5, "in_graph": True},
                "m0->logits": {"score": 0.1, "in_graph": False},
            },
        }
        where, key, value = GRAPH_FAULTS[case]
        part = graph if where is None else graph[where]
        if value is _MISSING:
            del part[key]
        else:
            part[key] = value
        (d / "graph.json").write_text(json.dumps(graph))
        return d / "graph.json", []
    if case == "list not UTF-8":  # read_text raised UnicodeDecodeError: a traceback
        (d / "heads.txt").write_bytes(b"0.1\n\xff\xfe1.2\n")
        return d / "heads.txt", []
    if case in ("a word as layer", "head -1", "layer 0.5"):  # int("x") raised ValueError; -1 and 0.5 were read
        layer, head = {"a word as layer": ("x", 1), "head -1": (0, -1), "layer 0.5": (0.5, 1)}[case]
        (d / "t.csv").write_text(f"layer,head,induction\n{layer},{head},0.5\n1,2,0.3\n")
        return d / "t.csv", []
    if case == "no score column":  # said "has no column None"
        (d / "t.csv").write_text("layer,head,other\n0,1,0.5\n1,2,0.3\n")
        return d / "t.csv", []
    assert case == "NA in a boolean --score column"
    table = pd.DataFrame(
        {"layer": [0, 0, 1], "head": [0, 1, 2], "flag": pd.array([True, None, False], dtype="boolean")}
    )
    table.to_parquet(d / "t.parquet")
    return d / "t.parquet", ["--score", "flag"]


_MISSING = object()
#: case -> (where, key, value): graph[where][key] (graph[key] where None) set to value, or deleted.
GRAPH_FAULTS = {
    "a word as an edge score": ("edges", "a0.h1->logits", {"score": "high", "in_graph": True}),
    "null as an edge score": ("edges", "a0.h1->logits", {"score": None, "in_graph": True}),
    "true as an edge score": ("edges", "a0.h1->logits", {"score": True, "in_graph": True}),
    "an edge without a score": ("edges", "a0.h1->logits", {"in_graph": True}),
    "NaN as an edge score": ("edges", "a0.h1->logits", {"score": float("nan"), "in_graph": True}),
    "a word as an MLP edge's score": ("edges", "m0->logits", {"score": "x", "in_graph": False}),
    "a word as an edge's in_graph": ("edges", "a0.h1->logits", {"score": 0.5, "in_graph": "yes"}),
    "an edge without in_graph": ("edges", "a0.h1->logits", {"score": 0.5}),
    "a number as an edge": ("edges", "a0.h1->logits", 0.5),
    "a list as the edges": (None, "edges", []),
    "a word as an MLP node's in_graph": ("nodes", "m0", {"in_graph": "false"}),
    "a number as the input node's in_graph": ("nodes", "input", {"in_graph": 0}),
    "a word as a node's score": ("nodes", "m0", {"in_graph": False, "score": "high"}),
    "a word as cfg n_heads": ("cfg", "n_heads", "8"),
    "a fraction as cfg d_model": ("cfg", "d_model", 64.5),
    "a word as cfg parallel_attn_mlp": ("cfg", "parallel_attn_mlp", "false"),
}

ODD = {
    "empty tsv": "no values",
    "cut config.json": "config.json",
    "config.json not an object": "config.json",
    "ragged tsv": "line 5 has 3 values where line 1 has 4",
    "400 digits": "not a finite number",
    "1e400": "not a finite number",
    "400 digits in a graph": "not a finite number",
    "NA in a boolean --score column": "not a numeric",
    "list not UTF-8": "heads.txt is not UTF-8 (byte 4 is invalid)",
    "a word as layer": "t.csv row 1: layer 'x' is not a whole number >= 0",
    "head -1": "t.csv row 1: head '-1' is not a whole number >= 0",
    "layer 0.5": "t.csv row 1: layer '0.5' is not a whole number >= 0",
    "no score column": "t.csv has no retrieval or induction column (give --score COLUMN); it has layer, head, other",
    "a word as an edge score": """graph.json: edge 'a0.h1->logits' has score "high", not a number""",
    "null as an edge score": "graph.json: edge 'a0.h1->logits' has score null, not a number",
    "true as an edge score": "graph.json: edge 'a0.h1->logits' has score true, not a number",
    "an edge without a score": "graph.json: edge 'a0.h1->logits' has no score",
    "NaN as an edge score": "graph.json: the score of a0.h1->logits is not a finite number (nan)",
    "a word as an MLP edge's score": """graph.json: edge 'm0->logits' has score "x", not a number""",
    "a word as an edge's in_graph": """graph.json: edge 'a0.h1->logits' has in_graph "yes", not true or false""",
    "an edge without in_graph": "graph.json: edge 'a0.h1->logits' has no in_graph",
    "a number as an edge": """graph.json: edge 'a0.h1->logits' is 0.5, not {"score": number, "in_graph": true|false}""",
    "a list as the edges": "graph.json: edges is [], not an object of edges",
    "a word as an MLP node's in_graph": """graph.json: node 'm0' is {"in_graph": "false"}, not {"in_graph": true|false}""",
    "a number as the input node's in_graph": """graph.json: node 'input' is {"in_graph": 0}, not {"in_graph": true|false}""",
    "a word as a node's score": """graph.json: node 'm0' has score "high", not a number""",
    "a word as cfg n_heads": """graph.json: cfg n_heads is "8", not a whole number""",
    "a fraction as cfg d_model": "graph.json: cfg d_model is 64.5, not a whole number",
    "a word as cfg parallel_attn_mlp": """graph.json: cfg parallel_attn_mlp is "false", not true or false""",
}


@pytest.mark.parametrize("case", list(ODD))
def test_an_odd_head_file_is_refused_in_one_line(case, tmp_path, tiny_dir, capsys):
    """Empty, cut or odd files given to import: one line, exit 2, no traceback (before any load)."""
    path, flags = _odd_file(case, tmp_path)
    code, err = _cli(["import", "--heads-file", str(path), "--model", str(tiny_dir), "--device", "cpu", *flags], capsys)
    _one_line(code, err, ODD[case])


@pytest.mark.parametrize("cut", ["half", "a list"])
def test_a_cut_summary_given_to_export_is_refused_in_one_line(cut, runs, tmp_path, capsys):
    scan = _copy(runs / "scan", tmp_path / "scan")
    raw = (scan / "summary.json").read_text()
    (scan / "summary.json").write_text(raw[: len(raw) // 2] if cut == "half" else "[]")
    code, err = _cli(["export", "--from", str(scan), "--out", str(tmp_path / "o")], capsys)
    _one_line(code, err, "summary.json")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "damage, said",
    [
        ("cut mid-row", "has fewer fields than its header: the file is cut"),
        ("cut after a row", "2 of its 16 heads have no row, 1.6 the first"),
        ("a head twice", "head 0.0 is outside the model or listed twice"),
        ("a kv_head in words", "has a kv_head that is not a whole number >= 0 (line 2)"),
    ],
)
def test_a_cut_or_odd_scan_table_given_to_export_is_refused_in_one_line(damage, said, runs, tmp_path, capsys):
    """A head_scores.csv cut short or edited by hand: export wrote a DuoAttention file of the heads
    that were left (a 1 x 1 grid for a 2 x 2 model from a table cut in its first row) and exited 0."""
    scan = _copy(runs / "scan", tmp_path / "scan")
    table = scan / "head_scores.csv"
    lines = table.read_text().splitlines(keepends=True)
    if damage == "cut mid-row":
        table.write_text("".join(lines[:-1]) + lines[-1][:8])
    elif damage == "cut after a row":
        table.write_text("".join(lines[:-2]))
    elif damage == "a head twice":
        table.write_text("".join([lines[0], lines[1], *lines[1:-1]]))
    else:
        table.write_text("".join([lines[0], "0,0,abc," + lines[1].split(",", 3)[3], *lines[2:]]))
    code, err = _cli(["export", "--from", str(scan), "--out", str(tmp_path / "o"), "--format", "all"], capsys)
    _one_line(code, err, said)
    assert not (tmp_path / "o").exists()


def test_pandas_na_in_a_numeric_score_column_is_a_missing_score(tmp_path, tiny_dir):
    """A nullable Float64 column's NA is read as NaN (no score, never among the top k), as a float column's NaN."""
    from headprobe.analyses.exchange import read_head_file

    scores = [0.9, None, 0.5, 0.7]
    base = {"layer": [0, 0, 1, 1], "head": [0, 1, 2, 3]}
    pd.DataFrame({**base, "s": pd.array(scores, dtype="Float64")}).to_parquet(tmp_path / "na.parquet")
    pd.DataFrame({**base, "s": np.array(scores, dtype=float)}).to_parquet(tmp_path / "nan.parquet")
    na, nan = (read_head_file(tmp_path / f, _layout(tiny_dir), 2, "s") for f in ("na.parquet", "nan.parquet"))
    assert na.heads == nan.heads == [(0, 0), (1, 3)]
    assert np.isnan(na.scores[(0, 1)]) and {h: v for h, v in na.scores.items() if h != (0, 1)} == {
        h: v for h, v in nan.scores.items() if h != (0, 1)
    }


def hybrid_dir(tokenizer, path: Path) -> Path:
    """The tiny Qwen3-Next hybrid (layers 0 and 2 linear attention, heads in layers 1 and 3) as a model folder."""
    import zoo

    ckpt = zoo.make_checkpoint("qwen3_next", tokenizer, **zoo.tiny("qwen3_next").hybrid)
    ckpt.hf_model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_import_refuses_a_head_in_a_linear_attention_layer(tmp_path, tiny_tokenizer, text_file, capsys):
    """Layer 0 of the hybrid has no heads (no hook_z to ablate): one line, as ablate's."""
    model = hybrid_dir(tiny_tokenizer, tmp_path / "hybrid")
    (tmp_path / "heads.txt").write_text("0.1\n1.0\n")
    capsys.readouterr()
    code = main(
        [
            "import",
            "--heads-file",
            str(tmp_path / "heads.txt"),
            "--model",
            str(model),
            "--device",
            "cpu",
            "--text",
            str(text_file),
            "--seq-len",
            "16",
            "--n-natural",
            "2",
            "--n-repeated",
            "2",
            "--n-random",
            "2",
        ]
    )
    err = capsys.readouterr().err
    errors = [x for x in err.splitlines() if x.startswith("headprobe: error:")]
    assert (
        code == 2
        and errors
        == ["headprobe: error: head 0.1: layer 0 has no heads (linear attention); the layers with heads are [1, 3]"]
        and "Traceback" not in err
    )


def _import_three_heads(tiny_dir, tmp_path, capsys) -> tuple[Path, list[str]]:
    """``headprobe import`` of heads 0.1, 1.2, 1.3 (a list file) on the tiny model at small settings
    (those :func:`test_import_summary_is_what_the_cli_prints` repeats through the API): the file and
    the printed lines."""
    heads = tmp_path / "heads.txt"
    heads.write_text("0.1\n1.2\n1.3\n")
    small = ["--n-natural", "2", "--seq-len", "16", "--n-repeated", "2", "--period", "6", "--n-random", "4"]
    capsys.readouterr()
    assert main(["import", "--heads-file", str(heads), "--model", str(tiny_dir), "--device", "cpu", *small]) == 0
    return heads, capsys.readouterr().out.splitlines()


def test_import_prints_the_model_header_first_as_the_other_commands_do(tiny_dir, tmp_path, capsys):
    """The line the other commands print for the model they loaded (``describe_model``) comes first."""
    from headprobe import options
    from headprobe.commands.import_heads import ImportConfig

    heads, lines = _import_three_heads(tiny_dir, tmp_path, capsys)
    header = options.describe_model(
        options.load_for(ImportConfig(model=str(tiny_dir), device="cpu", heads_file=str(heads)))
    )
    assert lines[0] == header and header.startswith(f"model {tiny_dir} on cpu"), lines[:2]


def test_import_summary_is_what_the_cli_prints(tiny_dir, tmp_path, capsys):
    """ImportResult had no ``summary()`` (docs/api.md's table said no; import writes no file): it is
    the data :meth:`report` formats, and the command prints ``report()``. Here the command's lines
    against ``summary()`` of ``import_heads`` on the same input (same seed, same control draws)."""
    from headprobe.commands.import_heads import import_heads
    from headprobe.probe.core.io import finite_json

    heads, printed = _import_three_heads(tiny_dir, tmp_path, capsys)
    result = import_heads(
        str(tiny_dir), heads_file=str(heads), device="cpu", n_natural=2, seq_len=16, n_repeated=2, period=6, n_random=4
    )
    s, report = result.summary(), result.report().splitlines()
    assert printed[-len(report) :] == report
    assert s["heads"] == ["0.1", "1.2", "1.3"]
    assert printed[-len(report)] == f"{heads}: {s['kind']}, 3 heads ({s['rule']}): 0.1, 1.2, 1.3"
    assert s["ablations"] and all(row["draws"] for row in s["ablations"])
    for row in s["ablations"]:
        line = [x for x in printed if x.startswith(f"{row['kind']}-ablation on {row['task']}: effect ")]
        assert len(line) == 1 and f" vs random {row['random_mean']:+.4f} " in line[0], (line, row)
    assert [x.removeprefix("NOTE: ") for x in printed if x.startswith("NOTE: ")] == s["notes"]
    assert s["kv"] is None and json.loads(json.dumps(finite_json(s), allow_nan=False))["heads"] == s["heads"]


def test_import_reads_scans_own_csv_table_and_says_when_top_k_does_not_apply(runs, tmp_path, tiny_dir, text_file):
    """scan's head_scores.csv is a head table: import checks its top k by the column asked (the
    reference: the table's own ranking in pandas); a list file names its heads, and -k is refused."""
    import pandas as pd

    from headprobe.analyses.exchange import read_head_file
    from headprobe.commands.import_heads import import_heads

    table = runs / "scan" / "head_scores.csv"
    got = read_head_file(table, None, 3, "induction")
    ranked = pd.read_csv(table).sort_values(["induction", "layer", "head"], ascending=[False, True, True])
    want = sorted(zip(ranked["layer"].head(3).astype(int), ranked["head"].head(3).astype(int)))
    assert got.kind == "csv" and sorted(got.heads) == want and got.rule == "the top 3 heads by induction"
    (tmp_path / "heads.txt").write_text("0.1\n1.2\n")
    small = dict(text=str(text_file), device="cpu", n_random=2, keep_n_random=True, seq_len=16, n_natural=2)
    with pytest.raises(HeadprobeError, match="^--top-k only acts on score files .* a list file, which names its heads"):
        import_heads(str(tiny_dir), heads_file=str(tmp_path / "heads.txt"), k=4, period=6, n_repeated=2, **small)


@pytest.mark.parametrize("kind", ["kv", "circuit"])
def test_every_exported_source_names_its_hugging_face_model(runs, tmp_path, kind):
    """A kv or circuit folder's export recorded hf_name null (only scan's summary had it): each
    summary carries the model's Hugging Face name, and the export's provenance says it."""
    scan_name = json.loads((runs / "scan" / "summary.json").read_text())["hf_name"]
    assert scan_name and json.loads((runs / kind / "summary.json").read_text())["hf_name"] == scan_name
    out = _export(runs / kind, tmp_path / "e")
    metas = [json.loads(p.read_text()) for p in out.rglob("*.provenance.json")]  # kv: beside each file
    metas += [json.loads(p.read_text())["headprobe"] for p in out.rglob("circuit_graph.json")]  # in the graph
    assert metas and all(m["hf_name"] == scan_name for m in metas), metas


def _headkv_file(path: Path, scores: dict[str, float]) -> Path:
    """A hand-made HeadKV score file (one line of JSON, one-sample lists)."""
    path.write_text(json.dumps({key: [value] for key, value in scores.items()}) + "\n")
    return path


def test_a_top_k_cut_inside_a_tie_is_named_and_a_clean_cut_is_not(tmp_path):
    """A kv folder's HeadKV export gives a KV group's score to each of its query heads: with 3 query
    heads per KV head and -k 4, the cut falls inside the second group's 3-way tie. The file's
    reading says so (score, heads tied, taken, order); which heads are taken does not change."""
    from headprobe.analyses.exchange import Layout, read_head_file, tie_note

    layout = Layout("m", 2, 6, 2, 2)  # 2 layers x 6 query heads, 3 per KV head
    group = {f"{layer}-{head}": [0.9, 0.5][head // 3] if layer == 1 else 0.1 for layer in range(2) for head in range(6)}
    tied = read_head_file(_headkv_file(tmp_path / "tied.json", group), layout, 4)
    # by hand: 1.0-1.2 score 0.9 (taken), 1.3-1.5 score 0.5 tie at the cut; layer-major order takes 1.3
    assert tied.heads == [(1, 0), (1, 1), (1, 2), (1, 3)]
    assert tied.cut_tie == {
        "k": 4,
        "score": 0.5,
        "n_tied": 3,
        "n_taken": 1,
        "order": "layer-major",
        "tied_heads": ["1.3", "1.4", "1.5"],
    }
    assert "3 heads score 0.5 (1.3, 1.4, 1.5) and 1 of them was taken" in (tie_note(tied) or "")
    clean = read_head_file(_headkv_file(tmp_path / "clean.json", group), layout, 3)
    assert clean.heads == [(1, 0), (1, 1), (1, 2)] and clean.cut_tie is None  # the tie at 0.9 is taken whole
    assert tie_note(clean) is None
    distinct = {key: float(i) for i, key in enumerate(group)}
    assert read_head_file(_headkv_file(tmp_path / "distinct.json", distinct), layout, 4).cut_tie is None


def test_import_prints_one_note_for_a_cut_inside_a_tie(tmp_path, tiny_dir, text_file):
    """The tiny GQA Llama (2 layers x 8 heads): three heads tie at the 4th place of -k 4; the report
    has one NOTE line naming the tie, and the heads are the reading's (layer-major order takes 0.5)."""
    from headprobe.analyses.exchange import read_head_file
    from headprobe.commands.import_heads import import_heads

    scores = {f"{layer}-{head}": 0.0 for layer in range(2) for head in range(8)}
    scores |= {"1-0": 0.9, "1-1": 0.8, "1-2": 0.7, "0-5": 0.3, "1-4": 0.3, "1-6": 0.3}
    path = _headkv_file(tmp_path / "tied.json", scores)
    small = dict(text=str(text_file), device="cpu", n_random=2, keep_n_random=True, seq_len=16, n_natural=2)
    result = import_heads(str(tiny_dir), heads_file=str(path), k=4, period=6, n_repeated=2, **small)
    notes = [x for x in result.report().splitlines() if x.startswith("NOTE: ")]
    assert result.heads == [(0, 5), (1, 0), (1, 1), (1, 2)] and len(notes) == 1, result.report()
    assert all(w in notes[0] for w in ("score 0.3", "3 heads", "1 of them", "layer-major", "0.5, 1.4, 1.6")), notes
    assert result.file.cut_tie is not None and result.file.cut_tie["n_tied"] == 3
    assert read_head_file(path, None, 3).cut_tie is None  # -k 3 cuts between 0.7 and 0.3: nothing to say


def test_export_overwrite_names_the_files_it_kept_as_every_command_does(runs, tmp_path, capsys):
    """``export --out X --overwrite`` kept a file it had not written without a word, where show,
    scan and the others print "kept 1 file that no headprobe run recorded in X/: notes.txt"."""
    out = tmp_path / "o"
    _export(runs / "scan", out)
    (out / "notes.txt").write_text("mine")
    capsys.readouterr()
    _export(runs / "scan", out, "--overwrite")
    stdout = capsys.readouterr().out
    assert (out / "notes.txt").read_text() == "mine"
    assert stdout.rstrip().splitlines()[-1] == f"kept 1 file that no headprobe run recorded in {out}/: notes.txt"


def test_import_says_when_a_set_that_fills_a_layer_has_no_layer_matched_control(tmp_path, tiny_dir, text_file):
    """The tiny GQA Llama (2 layers x 8 heads): a set of all 8 heads of layer 0 leaves layer 0 no
    head for a layer-matched control, so every control head comes from layer 1. By hand: the one
    control set is layer 1's 8 heads; the report (what the command prints) says so in a NOTE, as
    scan's does, and the result keeps it."""
    from headprobe.commands.import_heads import import_heads

    path = tmp_path / "heads.txt"
    path.write_text(",".join(f"0.{h}" for h in range(8)) + "\n")
    small = dict(text=str(text_file), device="cpu", n_random=4, seq_len=16, n_natural=2, period=6, n_repeated=2)
    result = import_heads(str(tiny_dir), heads_file=str(path), **small)
    assert all(sorted(s) == [f"1.{h}" for h in range(8)] for v in result.verifications for s in v.random_heads)
    notes = [x for x in result.report().splitlines() if x.startswith("NOTE: ") and "layer matching" in x]
    assert len(notes) == 1 and "8 of layer 0's from layer 1" in notes[0], result.report()
    assert any("8 of layer 0's from layer 1" in n for n in result.notes)


def test_import_advice_for_more_control_sets_names_no_k(tmp_path, tiny_dir, text_file, monkeypatch):
    """A file's heads are not a top-k that -k shortens, so a test with too few control sets (layer 0's
    8 heads: one layer-matched set, and one uniform, C(8, 8)) is told of a model with more heads only
    (it was told to use a smaller -k). The random tiny model's tasks are trusted here (its loss is
    above ln(vocabulary)), so the test carries a verdict."""
    import headprobe.analyses.ablation as ablation
    from headprobe.commands.import_heads import import_heads

    monkeypatch.setattr(ablation, "untrusted_task_reason", lambda *a, **k: None)  # import_heads imports it late
    path = tmp_path / "heads.txt"
    path.write_text(",".join(f"0.{h}" for h in range(8)) + "\n")
    small = dict(text=str(text_file), device="cpu", n_random=4, seq_len=16, n_natural=2, period=6, n_repeated=2)
    (v,) = [v for v in import_heads(str(tiny_dir), heads_file=str(path), **small).verifications if v.tested]
    assert v.confirmed is None and v.no_verdict.startswith("only 1 distinct control set exists"), v.no_verdict
    assert v.no_verdict.endswith(
        "; for a verdict a test needs at least 19 distinct control sets: use a model with more heads"
    ), v.no_verdict


EXPORT_FLAGS_THAT_CANNOT_APPLY = [
    ("kv", ["--format", "headkv", "--score", "induction"], "--score"),
    ("kv", ["--format", "duo", "--sink", "64", "--recent", "512"], "--sink"),
    ("kv", ["--format", "duo", "--recent", "512"], "--recent"),
    ("circuit", ["--format", "mib", "--score", "score"], "--score"),
    ("circuit", ["--sink", "8"], "--sink"),
    ("scan", ["--format", "parquet", "--score", "induction"], "--score"),
    ("scan", ["--format", "headkv", "--sink", "8"], "--sink"),
]


@pytest.mark.parametrize("kind, flags, named", EXPORT_FLAGS_THAT_CANNOT_APPLY)
def test_an_export_flag_that_cannot_apply_is_refused_in_one_line(kind, flags, named, runs, tmp_path, capsys):
    """A flag the source or format has no use for (a kv policy's own sink and recent sizes, a
    score column for a kv or circuit folder or for Parquet, which writes every column) would be
    dropped without a word: refused in one line naming it, and nothing is written."""
    out = tmp_path / "o"
    code, err = _cli(["export", "--from", str(runs / kind), "--out", str(out), *flags], capsys)
    _one_line(code, err, named)
    assert not out.exists()


def test_export_sink_and_recent_apply_to_a_scan_source(runs, tmp_path):
    """Given for a scan, --sink and --recent are the config.json DuoAttention reads (kvpress's
    loader as the reference); left out, DuoAttention's defaults 128 and 256."""
    given = _export(runs / "scan", tmp_path / "given", "--format", "duo", "--sink", "64", "--recent", "512")
    default = _export(runs / "scan", tmp_path / "default", "--format", "duo")
    assert kvpress_load(given)[:2] == (64, 512) and kvpress_load(default)[:2] == (128, 256)


def test_import_report_signs_the_kv_loss_change_once():
    """The report's kv lines give the natural-loss change with its own sign: a policy that lowers the
    loss reads ``-0.0123``, never ``+-0.0123`` (the sign was a literal ``+`` before the number)."""
    from headprobe.analyses.exchange import HeadFile
    from headprobe.commands.import_heads_core import ImportConfig, ImportResult

    rows = [
        {"policy": "file", "kv_fraction": 0.5, "natural_loss_increase": -0.0123, "copy_accuracy": 0.5},
        {"policy": "uniform", "kv_fraction": 0.5, "natural_loss_increase": 0.0456, "copy_accuracy": 0.25},
    ]
    r = ImportResult(ImportConfig(heads_file="h.txt"), HeadFile("list", [(0, 1)], "listed"), [(0, 1)], [], {}, kv=rows)
    kv_lines = [line for line in r.report().splitlines() if line.startswith("kv ")]
    assert [line.split("natural loss ")[1].split(",")[0] for line in kv_lines] == ["-0.0123", "+0.0456"]


def test_import_kv_refuses_a_policy_covering_seq_len_before_the_load(tmp_path):
    """--kv with a DuoAttention policy whose sink + window cover --seq-len (or the default 128 fitted
    to SmolLM2's context): refused from the file and config.json, before torch loads."""
    duo = tmp_path / "duo"
    duo.mkdir()
    np.savetxt(duo / "full_attention_heads.tsv", np.array([[1.0, 0.0, 0.0]] * 30), delimiter="\t")
    (duo / "config.json").write_text(json.dumps({"sink_size": 64, "recent_size": 100}))
    for given, n in ((["--seq-len", "160"], 160), ([], 128)):
        code, errors, torch = _refuse(
            ["import", "--heads-file", "duo", "--model", "smollm2-135m", "--kv", *given], tmp_path
        )
        assert code == 2 and errors == [
            f"headprobe: error: the policy's sink 64 + window 100 cover all {n} tokens of --seq-len: "
            "nothing would stream; give a longer --seq-len"
        ], errors
        assert not torch


def test_export_refuses_a_full_out_folder_before_reading_the_source(tmp_path, capsys, monkeypatch):
    """A non-empty ``--out`` without ``--overwrite`` (and an ``--out`` inside the source) was
    refused only after the source was read and every file built (9.7 s on SmolLM2-135M's circuit
    folder): the folder alone decides it, so the source is never read here (reading fails the test)."""
    import headprobe
    from headprobe.commands import export_core

    def no_read(path):
        raise AssertionError("the source was read before --out was checked")

    monkeypatch.setattr(export_core, "read_source", no_read)
    src, full = tmp_path / "src", tmp_path / "full"
    src.mkdir()
    full.mkdir()
    (full / "kept.txt").write_text("mine")
    code, err = _cli(["export", "--from", str(src), "--out", str(full)], capsys)
    _one_line(code, err, f"output directory {full} is not empty; pass --overwrite")
    code, err = _cli(["export", "--from", str(src), "--out", str(src / "e"), "--overwrite"], capsys)
    _one_line(code, err, f"the output folder {src / 'e'} is inside the source folder {src}")
    with pytest.raises(HeadprobeError, match="is not empty; pass --overwrite"):
        headprobe.export(str(src), str(full))
    assert [p.name for p in full.iterdir()] == ["kept.txt"] and not (src / "e").exists()


@pytest.mark.parametrize(
    "flags, said",
    [
        (["--from", "", "--out", "OUT"], "the source folder name is empty; give --from"),
        (["--from", "SRC", "--out", ""], "the output directory name is empty; give --out"),
        (["--from", "SRC", "--out", "OUT", "--sink", "-1"], "--sink must be >= 0, got -1"),
        (["--from", "SRC", "--out", "OUT", "--recent", "0"], "--recent must be >= 1, got 0"),
    ],
)
def test_an_empty_folder_name_or_size_given_to_export_is_named_in_its_refusal(
    flags, said, tmp_path, capsys, monkeypatch
):
    """``--from ""`` and ``--out ""`` were read as the current folder: "." holds no finished run, or
    the output folder "." "holds the source folder"; a bad ``--sink`` alone printed "--recent ... None"."""
    monkeypatch.chdir(tmp_path)  # the current folder holds the source, as a user's would
    src = tmp_path / "src"
    src.mkdir()
    argv = [str(src) if f == "SRC" else str(tmp_path / "o") if f == "OUT" else f for f in flags]
    code, err = _cli(["export", *argv], capsys)
    _one_line(code, err, said)
    assert "None" not in err[0] and not (tmp_path / "o").exists()


def test_import_report_prints_the_effects_interval_as_scans_table_does():
    """import's effect line carries the top-k effect's 95% interval over sequences, as scan's table
    prints it (it printed the effect alone). Reference: scipy's Student-t interval of made-up
    per-sequence effects; one sequence has none (``[n/a]``, never ``[+nan, +nan]``)."""
    from scipy import stats

    from headprobe.analyses.ablation import Verification
    from headprobe.analyses.exchange import HeadFile
    from headprobe.commands.import_heads_core import ImportConfig, ImportResult

    per_seq = np.array([-0.031, -0.012, -0.027, -0.019])
    lo, hi = stats.t.interval(0.95, len(per_seq) - 1, loc=per_seq.mean(), scale=stats.sem(per_seq))

    def row(task, ci):
        return Verification(
            "imported",
            "mean",
            task,
            2,
            ["0.1", "1.0"],
            5.0,
            5.0,
            per_seq.mean(),
            [0.0],
            -0.0036,
            0.0,
            None,
            top_effect_ci95=ci,
            draws=1,
        )

    rows = [row("repeated", [lo, hi]), row("natural", [float("nan")] * 2)]
    hf = HeadFile("list", [(0, 1), (1, 0)], "listed")
    lines = ImportResult(ImportConfig(heads_file="h.txt"), hf, hf.heads, rows, {}).report().splitlines()
    assert f"effect {per_seq.mean():+.4f} [{lo:+.4f}, {hi:+.4f}] vs random -0.0036" in lines[1], lines[1]
    assert f"effect {per_seq.mean():+.4f} [n/a] vs random" in lines[2], lines[2]


def test_import_notes_a_confirmed_effect_whose_interval_over_sequences_reaches_0():
    """The import run of the brief: effect +10.5061 [-1.7349, +22.7471], p = 0.05, CONFIRMED. The
    permutation test is over control head sets, the interval over sequences: a NOTE (report and
    summary()'s notes) says the set beats random heads but the effect's size is uncertain on so few
    sequences (the old code said nothing). An interval above 0, or one not CONFIRMED: no note."""
    import dataclasses

    from headprobe.analyses.ablation import Verification
    from headprobe.analyses.exchange import HeadFile
    from headprobe.commands.import_heads_core import ImportConfig, ImportResult

    row = Verification(
        "imported", "mean", "repeated", 2, ["0.1", "1.0"], 5.0, 15.5061, 10.5061, [0.3] * 19, 0.3, 0.3, True,
        top_effect_ci95=[-1.7349, 22.7471], draws=19, tested=True, p_value=0.05, p_adjusted=0.05,
    )  # fmt: skip
    hf = HeadFile("list", [(0, 1), (1, 0)], "listed")

    def result(v):
        return ImportResult(ImportConfig(heads_file="h.txt"), hf, hf.heads, [v], {})

    notes = result(row).summary()["notes"]
    assert notes == [
        "imported is CONFIRMED against control sets on these sequences, but its 95% interval over sequences "
        "[-1.73, +22.7] reaches 0: the head set beats random heads (a test over control sets), but on so few "
        "sequences the effect's size is uncertain (the interval is over sequences); use more sequences "
        "(--n-natural, --n-repeated)"
    ]
    assert result(row).report().endswith(in_python("import", f"NOTE: {notes[0]}"))  # flags as keywords
    for other in (dataclasses.replace(row, top_effect_ci95=[0.5, 22.7]), dataclasses.replace(row, confirmed=False)):
        assert result(other).summary()["notes"] == [] and "NOTE" not in result(other).report()


def test_format_all_without_pyarrow_writes_the_other_formats_and_says_so(tmp_path, capsys, monkeypatch):
    """With pyarrow missing, ``--format all`` refused everything ("--format parquet needs pyarrow") where the
    DuoAttention, HeadKV and LaTeX files need nothing more: they are written, and the report says why Parquet is
    not (pandas here has imported pyarrow already, so its absence is the check's answer)."""
    from pathlib import Path

    import headprobe.commands.export_core as export_core

    scan = Path(__file__).resolve().parents[1] / "figures" / "smollm2-135m"
    monkeypatch.setattr(export_core, "_have_pyarrow", lambda: False)
    out = tmp_path / "o"
    capsys.readouterr()
    assert main(["export", "--from", str(scan), "--out", str(out), "--format", "all"]) == 0
    written = {p.name for p in out.rglob("*") if p.is_file()}
    assert "heads.parquet" not in written and {"full_attention_heads.tsv", "verdicts.tex"} <= written, written
    assert "parquet: left out: pyarrow is not installed (pip install 'headprobe[exchange]')" in capsys.readouterr().out


def test_format_all_of_a_scan_without_verdicts_says_latex_is_left_out(tmp_path, capsys):
    """A --no-verify scan has no verdict table: ``--format all`` wrote the other formats and left LaTeX
    out without a word, where a missing pyarrow is said (the walk 'peer')."""
    import json
    import shutil
    from pathlib import Path

    scan = Path(__file__).resolve().parents[1] / "figures" / "smollm2-135m"
    src = tmp_path / "scan"
    src.mkdir()
    shutil.copy(scan / "head_scores.csv", src)
    summary = json.loads((scan / "summary.json").read_text())
    (src / "summary.json").write_text(json.dumps({**summary, "ablations": [], "verification": None}))
    out = tmp_path / "o"
    capsys.readouterr()
    assert main(["export", "--from", str(src), "--out", str(out), "--format", "all"]) == 0
    written = {p.name for p in out.rglob("*") if p.is_file()}
    assert "full_attention_heads.tsv" in written and not any(n.endswith(".tex") for n in written), written
    assert "latex: left out: this scan run has no table to set (a scan with --no-verify has no verdicts)" in (
        capsys.readouterr().out
    )
