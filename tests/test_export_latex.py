"""``headprobe export --format latex``: the committed scan, prune and ablate runs (figures/, read
only) written as booktabs tables into a temporary folder, read back as text and their cells
compared with the run's own CSV tables, ablation.caption.txt and summary.json (the reference:
parsed here, never through the writer's code); LaTeX's special characters escaped; a folder with no
table refused in one line, with nothing written. No LaTeX compiler is needed (none is assumed)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from headprobe.cli import main

FIGURES = Path(__file__).resolve().parents[1] / "figures"
SCAN = FIGURES / "smollm2-135m"
PRUNE = FIGURES / "smollm2-135m-prune"
PER_LAYER = FIGURES / "smollm2-135m" / "prune-per-layer"
ABLATE = FIGURES / "smollm2-135m-ablate"
KV = FIGURES / "smollm2-135m-kv"
CIRCUIT = FIGURES / "smollm2-135m-circuit"


def _export(source: Path, out: Path, *flags: str) -> int:
    return main(["export", "--from", str(source), "--out", str(out), *flags])


@pytest.fixture(scope="module")
def tex(tmp_path_factory) -> dict[str, str]:
    """``{"scan/verdicts": text, ...}``: every table of the four committed runs, written by the CLI."""
    base = tmp_path_factory.mktemp("latex")
    out = {}
    runs = (("scan", SCAN), ("prune", PRUNE), ("per_layer_run", PER_LAYER), ("ablate", ABLATE))
    for name, src in (*runs, ("kv", KV), ("circuit", CIRCUIT)):
        assert _export(src, base / name, "--format", "latex") == 0
        listed = json.loads((base / name / "summary.json").read_text())["files"]
        assert sorted(listed) == sorted(str(p.relative_to(base / name)) for p in (base / name / "latex").iterdir())
        out.update({f"{name}/{Path(f).stem}": (base / name / f).read_text() for f in listed})
    return out


def rows(text: str) -> list[list[str]]:
    """The body rows (between ``\\midrule`` and ``\\bottomrule``), cells split at unescaped ``&``."""
    body = text.split("\\midrule\n", 1)[1].split("\\bottomrule", 1)[0]
    return [
        [c.strip().replace("$-$", "-") for c in re.split(r"(?<!\\)&", line.removesuffix("\\\\").strip())]
        for line in body.splitlines()
    ]


def num(cell: str) -> float:
    return float(cell.replace("$\\leq$", ""))


def interval(cell: str) -> tuple[float, float, float]:
    """``+0.99 [+0.51, +1.47]`` -> (0.99, 0.51, 1.47)."""
    m = re.fullmatch(r"(\S+) \[(\S+), (\S+)\]", cell)
    assert m, cell
    return tuple(float(x) for x in m.groups())  # type: ignore[return-value]


def test_every_table_is_a_booktabs_float_with_caption_and_label(tex):
    assert set(tex) == {
        "scan/verdicts",
        "scan/ablations",
        "scan/top_heads",
        "prune/pruning_curve",
        "per_layer_run/pruning_curve",
        "per_layer_run/per_layer",
        "ablate/top_heads",
        "kv/policies",
        "circuit/edges",
        "circuit/path_patching",
    }
    for name, text in tex.items():
        assert text.replace("\\small\n", "", 1).startswith("\\begin{table}[htbp]\n\\centering\n\\caption{"), name
        assert text.rstrip().endswith("\\end{tabular}\n\\end{table}"), name
        assert re.search(r"\\label\{tab:[A-Za-z0-9:-]+\}", text), name
        assert [text.count(r) for r in ("\\toprule", "\\midrule", "\\bottomrule")] == [1, 1, 1], name
        spec = re.search(r"\\begin\{tabular\}\{(.*)\}\n", text).group(1)
        n_cols = len(re.sub(r"p\{[^}]*\}", "p", spec))
        assert all(len(r) == n_cols for r in rows(text)), name
        caption = re.search(r"\\caption\{(.*)\}\n\\label", text).group(1)
        assert "smollm2-135m" in caption and ("nats/token" in caption or name == "scan/top_heads"), name  # scores


def test_every_caption_names_the_model_its_compute_dtype_and_its_weights(tex):
    """Every table's caption says what ran: the model, the compute dtype and the precision of its weights
    (each committed run is of SmolLM2's 4-bit Q4_1 weights, dequantized to float32); the scan's said
    "smollm2-135m:" alone and circuit's "(float32)", as if the weights were float32. The words are the
    figures' titles' ("4-bit weights"), read here off each run's own summary.json."""
    sources = {"scan": SCAN, "prune": PRUNE, "per_layer_run": PER_LAYER, "ablate": ABLATE, "kv": KV, "circuit": CIRCUIT}
    for name, text in tex.items():
        summary = json.loads((sources[name.split("/")[0]] / "summary.json").read_text())
        dtype = summary.get("dtype") or summary["config"]["dtype"]
        assert "4-bit Q4_1" in summary["weights_precision"] and dtype == "float32", name
        caption = re.search(r"\\caption\{(.*)\}\n\\label", text).group(1)
        assert "smollm2-135m (4-bit weights, float32 compute" in caption, (name, caption[:120])


def _assert_escaped(name: str, text: str) -> None:
    """No bare _ % # ^ ~ < >, dollars paired, braces balanced, ASCII only."""
    assert text.isascii(), name
    assert not re.search(r"(?<!\\)[_%#]", text), name
    assert not re.search(r"[<>^~]", text), name
    assert text.count("$") % 2 == 0 and len(re.findall(r"(?<!\\)\$", text)) % 2 == 0, name
    unescaped = re.sub(r"\\[{}]", "", text)
    assert unescaped.count("{") == unescaped.count("}"), name


def test_special_characters_are_escaped(tex):
    """No bare _ % # ^ ~ < >, dollars paired, braces balanced, ASCII only (Δ, ≤, × as commands)."""
    for name, text in tex.items():
        _assert_escaped(name, text)
    assert "previous-token" in tex["scan/verdicts"] and "95\\% CI" in tex["scan/verdicts"]
    assert "$\\leq$0.0877" in tex["scan/ablations"]  # the curtailed test's bound


def test_latex_text_escapes_once():
    from headprobe.analyses.latex_tables import latex_text

    assert latex_text("a_b 5% {x} & $ # ~ ^ \\ Δ ≤ <= >= < > † ×") == (
        "a\\_b 5\\% \\{x\\} \\& \\$ \\# \\textasciitilde{} \\textasciicircum{} \\textbackslash{} $\\Delta$ "
        "$\\leq$ $\\leq$ $\\geq$ \\textless{} \\textgreater{} \\dag{} $\\times$"
    )


def test_a_negative_number_gets_a_minus_and_a_hyphen_stays():
    from headprobe.analyses.latex_tables import latex_text

    assert latex_text("-0.04 [-0.10, +0.20] (−1.5)") == "$-$0.04 [$-$0.10, +0.20] ($-$1.5)"
    assert latex_text("top-10, 1–3, l0-2, 1e-5, a-1") == "top-10, 1--3, l0-2, 1e-5, a-1"


def _caption_lines() -> dict[tuple[str, str], dict]:
    """ablation.caption.txt's type lines, parsed: (type, kind) -> effect, CI, control mean, p, p_adj, verdict."""
    out = {}
    pat = re.compile(
        r"(?P<type>[\w-]+) \((?P<kind>\w+), (?P<task>\w+)\): top-\d+ effect (?P<e>\S+) \[95% CI (?P<lo>\S+), (?P<hi>\S+)\] "
        r"vs control mean (?P<c>\S+), max \S+ over (?P<n>\d+) sets; p (?:= (?P<p>[\d.]+)|in \[\S+, (?P<pb>[\d.]+)\])"
        r".*?; (?:p_adj = (?P<padj>[\d.]+), (?P<v>CONFIRMED|not confirmed)|(?P<nt>not tested))\.$"
    )
    for line in (SCAN / "ablation.caption.txt").read_text().splitlines()[1:]:
        m = pat.match(line)
        assert m, line
        out[(m["type"], m["kind"])] = m.groupdict()
    return out


def test_scan_verdict_table_equals_the_caption_file_and_summary(tex):
    """Each row's numbers are ablation.caption.txt's (4 significant digits there, 2 decimals here:
    within half the table's last digit plus the caption's rounding), in its order; p and p adj to 4
    decimals from summary.json; the scores those of head_scores.csv."""
    caption = _caption_lines()
    got = rows(tex["scan/ablations"])
    assert [(r[0], r[1]) for r in got] == list(caption)  # the caption file's order, its names (previous-token)
    summary = json.loads((SCAN / "summary.json").read_text())
    ablations = {(a["head_type"], a["kind"]): a for a in summary["ablations"]}
    for r in got:
        ref = caption[(r[0], r[1])]
        a = ablations[(r[0].replace("-", "_"), r[1])]
        e, lo, hi = interval(r[2])
        for cell, want in ((e, ref["e"]), (lo, ref["lo"]), (hi, ref["hi"]), (num(r[3]), ref["c"])):
            assert abs(cell - float(want)) <= 0.005 + 5e-4 * abs(float(want)), (r, want)
        assert int(r[4]) == int(ref["n"]) == a["draws"]
        p = float(ref["p"] or ref["pb"])
        assert abs(num(r[5]) - p) <= 5e-5 + 5e-4 * p and r[5].startswith("$\\leq$") == bool(ref["pb"])
        assert abs(num(r[5]) - a["p_value"]) <= 5e-5
        if ref["nt"]:
            assert r[6] == "-" and r[7] == "not tested"
        else:
            assert abs(float(r[6]) - a["p_adjusted"]) <= 5e-5 and r[7] == ref["v"]
    # the paper's table: the tested (mean) rows, type, effect, control, p adj and verdict; tasks in its caption
    tested = [[r[0], r[2], r[3], r[6], r[7]] for r in got if r[1] == summary["verification"]["primary_kind"]]
    assert rows(tex["scan/verdicts"]) == tested and len(tested) == len(summary["top_heads"])
    assert "natural text for previous-token, duplicate-token" in tex["scan/verdicts"]
    assert "\\_token" not in tex["scan/verdicts"] + tex["scan/top_heads"]  # the figures' and the viewer's names
    assert "Table \\ref{tab:smollm2-135m-ablations}" in tex["scan/verdicts"]
    assert "repeated random tokens for induction" in tex["scan/verdicts"]


def test_scan_top_heads_table_is_every_ablated_head_with_its_head_scores_csv_score(tex):
    """Each type's k ablated heads (summary.json's ablations), best first, each with its score in
    head_scores.csv's ranking column (the positional type's: positional_fraction)."""
    summary = json.loads((SCAN / "summary.json").read_text())
    scores = pd.read_csv(SCAN / "head_scores.csv")
    tops = {a["head_type"]: a["top_heads"] for a in summary["ablations"]}
    got = rows(tex["scan/top_heads"])
    order = [r[0] for r in rows(tex["scan/ablations"]) if r[1] == summary["verification"]["primary_kind"]]
    assert [r[0] for r in got] == order and len(got) == len(tops)  # the verdict tables' order
    for r in got:
        t = r[0].replace("-", "_")
        heads = re.findall(r"(\d+)\.(\d+) \(([\d.]+)\)", r[1])
        assert [f"{la}.{h}" for la, h, _ in heads] == tops[t] and len(heads) == 10
        column = {"positional": "positional_fraction"}.get(t, t)
        for la, h, s in heads:
            want = scores.loc[(scores["layer"] == int(la)) & (scores["head"] == int(h)), column].item()
            assert abs(float(s) - want) <= 0.005 + 1e-5, (t, la, h, s, want)


def test_prune_curve_table_equals_pruning_curve_csv(tex):
    """Per method and step the loss (random: the mean over seeds, [min, max]) of pruning_curve.csv."""
    csv = pd.read_csv(PRUNE / "pruning_curve.csv")
    got = rows(tex["prune/pruning_curve"])
    assert len(got) == csv.groupby(["method", "step"]).ngroups
    method = ""
    for r in got:
        method = r[0] or method
        part = csv[(csv.method == method) & (csv.n_pruned == int(r[1]))]
        assert len(part) and abs(float(r[2]) - part.fraction_pruned.iloc[0]) <= 0.005 + 1e-9
        for cell, col in ((r[3], "natural_loss"), (r[4], "repeated_loss")):
            if method == "random":
                mean, lo, hi = interval(cell)
                assert abs(lo - part[col].min()) <= 5e-4 + 1e-5 and abs(hi - part[col].max()) <= 5e-4 + 1e-5
            else:
                mean = float(cell)
            assert abs(mean - part[col].mean()) <= 5e-4 + 1e-5, (r, col)
    assert sum(bool(r[0]) for r in got) == csv.method.nunique()


def test_per_layer_table_equals_per_layer_csv(tex):
    csv = pd.read_csv(PER_LAYER / "per_layer.csv")
    got = rows(tex["per_layer_run/per_layer"])
    assert [int(r[0]) for r in got] == csv.layer.tolist() and [int(r[1]) for r in got] == csv.best_head.tolist()
    cols = ["loss_best_only", "loss_worst_only", "loss_layer_ablated", "delta_best_only"]
    for r, (_, ref) in zip(got, csv.iterrows()):
        for cell, col in zip(r[2:6], cols):
            assert abs(float(cell.removesuffix("\\dag{}")) - ref[col]) <= 5e-4 + 1e-5, (r, col)
        assert r[6] == ("yes" if ref.best_head_halves_agree else "no")
        # a dagger where the held-out best lost to the held-out worst (the run's NOTE; 11 layers here)
        assert r[2].endswith("\\dag{}") == (ref.loss_best_only > ref.loss_worst_only), r
    assert sum(csv.loss_best_only > csv.loss_worst_only) == 11 and "the pick is noise" in tex["per_layer_run/per_layer"]


def test_ablate_table_is_head_ablation_csv_top_heads(tex):
    """Per task the 10 heads of largest loss increase in head_ablation.csv, with their CIs."""
    csv = pd.read_csv(ABLATE / "head_ablation.csv")
    got = rows(tex["ablate/top_heads"])
    assert [r[0] for r in got] == [str(i) for i in range(1, 11)]
    for i, task in enumerate(("natural", "repeated")):
        top = csv.sort_values(f"{task}_loss_delta", ascending=False).head(10)
        assert [r[1 + 2 * i] for r in got] == [f"{la}.{h}" for la, h in zip(top.layer, top["head"])]
        for r, (_, ref) in zip(got, top.iterrows()):
            d, lo, hi = interval(r[2 + 2 * i])
            for cell, col in ((d, ""), (lo, "_ci95_low"), (hi, "_ci95_high")):
                assert abs(cell - ref[f"{task}_loss_delta{col}"]) <= 5e-4 + 2e-5, (task, r, col)


def policy_rows(text: str) -> list[list[str]]:
    """kv's table's body lines, each interval line (empty policy cell) joined to the line above it:
    ``0.0217`` over ``[+0.0089, +0.0352]`` -> ``0.0217 [+0.0089, +0.0352]``; every other cell of an
    interval line is empty."""
    out: list[list[str]] = []
    for line in rows(text):
        if line[0]:
            out.append(line)
            continue
        # under loss Δ and drop; the full cache's (the first row) under its copy accuracy
        assert out and [i for i, c in enumerate(line) if c] == ([4] if len(out) == 1 else [3, 5]), line
        out[-1] = [f"{a} {b}" if b else a for a, b in zip(out[-1], line)]
    return out


def test_kv_table_is_curve_csv_at_the_policy_budget(tex):
    """The chosen, uniform and random rows of curve.csv at the run's budget, the full cache's row as
    the reference; each interval on the line under its estimate."""
    csv = pd.read_csv(KV / "curve.csv")
    budget = json.loads((KV / "summary.json").read_text())["target"]["kv_budget"]
    got = policy_rows(tex["kv/policies"])
    full = csv[csv.policy == "full"].iloc[0]
    assert got[0][:2] == ["full", "all"] and float(got[0][3]) == 0 and got[0][5] == "-"
    assert abs(interval(got[0][4])[0] - full.copy_accuracy) <= 5e-4 + 1e-6
    assert abs(float(got[0][6]) - full.long_range_loss) <= 5e-4 + 1e-6
    at = csv[(csv.budget == budget) & (csv.policy != "full")]
    assert [r[0] for r in got[1:]] == [p if p != "random" else f"random {int(s)}" for p, s in zip(at.policy, at.seed)]
    for r, (_, ref) in zip(got[1:], at.iterrows()):
        assert int(r[1]) == ref.n_full_groups and abs(float(r[2]) - ref.kv_fraction) <= 5e-4 + 1e-6
        loss, lo, hi = interval(r[3])
        want = (ref.natural_loss_increase, ref.natural_loss_increase_ci95_lo, ref.natural_loss_increase_ci95_hi)
        assert all(abs(x - y) <= 5e-5 + 1e-6 for x, y in zip((loss, lo, hi), want)), (r, want)
        drop, lo, hi = interval(r[5])
        want = (ref.copy_accuracy_drop, ref.copy_accuracy_drop_ci95_lo, ref.copy_accuracy_drop_ci95_hi)
        assert all(abs(x - y) <= 5e-4 + 1e-6 for x, y in zip((drop, lo, hi), want)), (r, want)
        assert abs(float(r[4]) - ref.copy_accuracy) <= 5e-4 + 1e-6
        assert abs(float(r[6]) - ref.long_range_loss) <= 5e-4 + 1e-6


def test_kv_full_rows_copy_accuracy_has_its_interval_over_the_sequences(tex):
    """The full cache's copy accuracy (0.733) had no interval. Under it now: the Student-t interval over the
    run's 3 long-range sequences (one per distance, so full.per_distance's accuracies are the sequences'),
    computed here with scipy and clipped to [0, 1]."""
    import numpy as np
    from scipy import stats

    summary = json.loads((KV / "summary.json").read_text())
    acc = np.array([p["accuracy"] for p in summary["full"]["per_distance"].values()])
    assert all(p["n_sequences"] == 1 for p in summary["full"]["per_distance"].values()) and len(acc) == 3
    half = stats.t.ppf(0.975, len(acc) - 1) * acc.std(ddof=1) / np.sqrt(len(acc))
    value, lo, hi = interval(policy_rows(tex["kv/policies"])[0][4])
    assert abs(value - acc.mean()) <= 5e-4 + 1e-6
    assert (lo, hi) == pytest.approx((max(acc.mean() - half, 0.0), min(acc.mean() + half, 1.0)), abs=5e-4 + 1e-6)


def test_kv_caption_gives_the_samples_the_interval_methods_and_the_paired_differences(tex):
    """policies.tex's caption lacked the sample sizes (1 window of 1,022 natural tokens; 3 sequences, 45 copied
    tokens), the interval methods and the chosen-minus-uniform / -random differences the report prints. Each is
    read here off the run's summary.json: the counts from its config and interval rule, the method names from
    ``definitions.intervals``, the differences and verdicts from ``chosen_minus_*`` at the report's digits."""
    summary = json.loads((KV / "summary.json").read_text())
    caption = re.search(r"\\caption\{(.*)\}\n\\label", tex["kv/policies"]).group(1).replace("$-$", "-")
    cfg = summary["config"]
    n_seq = len(cfg["distances"]) * cfg["n_per_distance"]
    assert f"copy: {n_seq} sequences" in caption and f"{n_seq * (cfg['block_len'] - 1)} copied tokens" in caption
    assert "natural text: 1 window x 1,022 tokens" in caption and "over 1022 tokens (1 window of 1022)" in str(
        summary["definitions"]["intervals"]["natural_loss"]
    )
    assert "that window's token noise" in caption  # one window: the interval is conditional on it
    for key, method in (("natural_loss", "percentile block bootstrap"), ("copy_accuracy", "Student-t interval")):
        assert method in summary["definitions"]["intervals"][key] and f"95\\% {method}" in caption, method
    for key, name in (("chosen_minus_uniform", "uniform"), ("chosen_minus_random_mean", "the random policies' mean")):
        c = summary[key]
        nat = f"{c['natural_loss']:+.4f} [{c['natural_loss_ci95'][0]:+.4f}, {c['natural_loss_ci95'][1]:+.4f}]"
        acc = f"{c['copy_accuracy']:+.3f} [{c['copy_accuracy_ci95'][0]:+.3f}, {c['copy_accuracy_ci95'][1]:+.3f}]"
        want = f"chosen minus {name}: natural loss {nat} nats/token, copy accuracy {acc}: {c['verdict']}"
        assert want in caption, (want, caption)
    assert "+0.422 [-0.576, +1.000]: not distinguishable at this sample size" in caption  # the walk's numbers


def test_circuit_table_is_edges_csv_largest_edges(tex):
    """The 10 edges of largest |score| in edges.csv, their scores and exact effects."""
    csv = pd.read_csv(CIRCUIT / "edges.csv")
    top = csv.reindex(csv.score.abs().sort_values(ascending=False).index).head(10)
    got = rows(tex["circuit/edges"])
    assert [r[1].replace(" $\\rightarrow$ ", " -> ") for r in got] == top.edge.tolist()
    for r, (_, ref) in zip(got, top.iterrows()):
        assert abs(float(r[2]) - ref.score) <= 5e-5 + 1e-5 and abs(float(r[3]) - ref.exact) <= 5e-5 + 1e-5


def test_circuit_path_patching_table_is_path_patching_csv_largest_effects(tex):
    """Each --receivers receiver's 5 senders of largest effect, in path_patching.csv's order (the
    terminal report's), their effects and scores; the caption says how many senders each had."""
    csv = pd.read_csv(CIRCUIT / "path_patching.csv")
    top = csv.groupby("receiver", sort=False).head(5)
    got = rows(tex["circuit/path_patching"])
    receivers = [r[0] for r in got]
    filled = [next(x for x in reversed(receivers[: i + 1]) if x) for i in range(len(got))]  # named once per group
    assert [x.replace("\\_", "_") for x in filled] == top.receiver.tolist()
    assert [r[0] != "" for r in got] == (top.receiver != top.receiver.shift()).tolist()  # at each group's start
    assert [r[1] for r in got] == top.sender.astype(str).tolist()
    for r, (_, ref) in zip(got, top.iterrows()):
        assert abs(float(r[2]) - ref.effect) <= 5e-5 + 1e-5 and abs(float(r[3]) - ref.score) <= 5e-5 + 1e-5
    caption = re.search(r"\\caption\{(.*)\}\n\\label", tex["circuit/path_patching"]).group(1)
    sizes = csv.groupby("receiver", sort=False).size()
    for receiver, n in sizes.items():
        assert f"{receiver} ({n})" in caption, (receiver, n, caption)
    summary = json.loads((CIRCUIT / "summary.json").read_text())
    assert summary["weights_precision"].startswith("4-bit") and summary["dtype"] == "float32"
    assert "smollm2-135m (4-bit weights, float32 compute, seed 0)" in caption, caption  # _run_text, as every table


def _one_line_refusal(argv, cwd) -> tuple[int, list[str]]:
    r = subprocess.run([sys.executable, "-m", "headprobe", *argv], capture_output=True, text=True, cwd=cwd, timeout=300)
    return r.returncode, r.stderr.splitlines()


@pytest.mark.parametrize(
    ("source", "flags", "said"),
    [
        (FIGURES / "smollm2-135m-diff-int8", ["--format", "latex"], "holds no finished headprobe"),
        (FIGURES / "smollm2-135m-robustness", ["--format", "latex"], "holds no finished headprobe"),
        (PRUNE, ["--format", "latex", "--score", "induction"], "--score"),
        (PRUNE, ["--sink", "4"], "--sink"),
    ],
)
def test_a_folder_without_tables_or_a_flag_nothing_uses_is_refused_in_one_line(source, flags, said, tmp_path):
    code, err = _one_line_refusal(["export", "--from", str(source), "--out", str(tmp_path / "o"), *flags], tmp_path)
    assert code == 2 and len(err) == 1 and err[0].startswith("headprobe: error:") and said in err[0], err
    assert not (tmp_path / "o").exists()


def test_a_missing_folder_is_told_what_each_format_takes(tmp_path):
    """``export --from`` a folder that is not there said "scan, kv or circuit" for every format, though
    --format latex also takes prune and ablate runs: the one line names, for each format, the runs it
    takes, LaTeX's being the kinds latex_tables has a table builder for."""
    from headprobe.analyses.latex_tables import BUILDERS

    code, err = _one_line_refusal(["export", "--from", str(tmp_path / "gone"), "--out", str(tmp_path / "o")], tmp_path)
    assert code == 2 and len(err) == 1 and "is not a folder" in err[0], err
    said = dict(re.findall(r"(\w+): ([\w ,]+?)(?:;|\)|$)", err[0].split("(", 1)[1]))
    kinds = {f: set(re.split(r", | or ", v.removesuffix(" run").removesuffix(" runs"))) for f, v in said.items()}
    assert kinds["latex"] == set(BUILDERS) == {"scan", "kv", "circuit", "prune", "ablate", "study", "train"}, err
    assert kinds["mib"] == {"circuit"} and kinds["duo"] == kinds["headkv"] == {"scan", "kv"}, err
    assert kinds["parquet"] == {"scan", "kv", "circuit"} and not (tmp_path / "o").exists(), err


def test_a_scan_without_verification_has_no_verdict_table(tmp_path, capsys):
    """--format latex is refused (one line, nothing written); all leaves LaTeX out and writes the rest."""
    scan = tmp_path / "scan"
    scan.mkdir()
    shutil.copy(SCAN / "head_scores.csv", scan)
    summary = json.loads((SCAN / "summary.json").read_text())
    (scan / "summary.json").write_text(json.dumps({**summary, "ablations": [], "verification": None}))
    capsys.readouterr()
    assert _export(scan, tmp_path / "o", "--format", "latex") == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "without an ablation check" in err[0] and not (tmp_path / "o").exists()
    assert _export(scan, tmp_path / "all", "--format", "all") == 0
    assert not (tmp_path / "all" / "latex").exists() and (tmp_path / "all" / "heads.parquet").is_file()


def export_without_torch(source: Path, out: Path, *flags: str) -> None:
    """``headprobe export --from source --out out *flags`` in a fresh process: exit 0, torch never imported."""
    argv = ["export", "--from", str(source), "--out", str(out), *flags]
    code = (
        f"import sys; from headprobe.cli import main; rc = main({argv!r}); "
        "assert rc == 0 and 'torch' not in sys.modules, (rc, 'torch' in sys.modules)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr


def test_all_includes_latex_and_imports_no_torch(tmp_path):
    """``--format all`` of the scan writes latex/verdicts.tex beside the exchange files, in a process that never imports torch."""
    export_without_torch(SCAN, tmp_path / "o")
    files = json.loads((tmp_path / "o" / "summary.json").read_text())["files"]
    assert "latex/verdicts.tex" in files and "heads.parquet" in files and "full_attention_heads.tsv" in files


# A text width each table is set in (pt): a NeurIPS page's (397 pt) for the tables a paper's body
# shows, 16 cm (455 pt) for scan's appendix table (docs/export.md).
_WIDTH = {"scan/ablations": 455}


@pytest.mark.skipif(shutil.which("pdflatex") is None, reason="no pdflatex (Debian: texlive-latex-recommended)")
def test_every_table_compiles_and_fits_its_page(tex, tmp_path):
    """LaTeX itself reads each table (pdflatex, booktabs): no error, and no line wider than the text
    width it is meant for (an overfull box is how TeX says a table runs into the margin)."""
    for name, text in tex.items():
        _assert_compiles_within(name, text, _WIDTH.get(name, 397), tmp_path)


def _assert_compiles_within(name: str, text: str, width: int, tmp_path: Path) -> None:
    """pdflatex reads ``text`` (booktabs) at a ``width`` pt text width without an error or an overfull box."""
    doc = tmp_path / f"{name.replace('/', '-')}.tex"
    setting = f"\\setlength{{\\textwidth}}{{{width}pt}}"
    doc.write_text(
        f"\\documentclass{{article}}\\usepackage{{booktabs}}{setting}\\begin{{document}}\n{text}\\end{{document}}\n"
    )
    r = subprocess.run(
        ["pdflatex", "-interaction=nonstopmode", "-halt-on-error", doc.name],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    log = r.stdout
    assert r.returncode == 0 and "! " not in log, (name, log[-2000:])
    assert "Overfull \\hbox" not in log, (name, width, re.findall(r"Overfull \\hbox \(\S+", log))


STUDIES = {"heads": FIGURES / "study-heads", "layouts": FIGURES / "study-layouts"}
"""The committed ``headprobe study`` runs (results.csv, study.json)."""


@pytest.fixture(scope="module")
def study_tex(tmp_path_factory) -> dict[str, str]:
    """``{"heads": text, "layouts": text}``: latex/study.tex of each committed study, by the CLI's ``--format all``."""
    base = tmp_path_factory.mktemp("study")
    out = {}
    for which, src in STUDIES.items():
        assert _export(src, base / which) == 0  # all: a study's every format is its table
        listed = json.loads((base / which / "summary.json").read_text())["files"]
        assert listed == ["latex/study.tex"], listed
        out[which] = (base / which / "latex" / "study.tex").read_text()
    return out


def study_rows(text: str) -> list[list[str]]:
    """The study table's body, each range line (empty first cell) joined to the mean above it:
    ``2.525`` over ``[2.485, 2.564]`` -> ``2.525 [2.485, 2.564]``; only the loss cells have a range."""
    out: list[list[str]] = []
    for line in rows(text):
        if line[0]:
            out.append(line)
            continue
        assert out and [i for i, c in enumerate(line) if c] == [3, 4], line
        out[-1] = [f"{a} {b}" if b else a for a, b in zip(out[-1], line)]
    return out


@pytest.mark.parametrize("which", list(STUDIES))
def test_study_table_is_results_csv_per_variant(study_tex, which):
    """One row per variant in results.csv's order: its heads (or name), KV cache bytes per token,
    attention parameters per layer, held-out and in-context loss as the mean over seeds [min, max],
    the mean top induction score (3 decimals, as the report) and whether the top induction head's
    95% lower bound is above 0.5 in every seed; aggregated here with pandas from the CSV."""
    csv = pd.read_csv(STUDIES[which] / "results.csv")
    variants = list(dict.fromkeys(csv["variant"]))
    got = study_rows(study_tex[which])
    assert [r[0] for r in got] == [
        str(csv.loc[csv.variant == v, "n_heads"].iloc[0]) if which == "heads" else v for v in variants
    ]
    for r, v in zip(got, variants):
        part = csv[csv.variant == v]
        assert part.kv_bytes_per_token.nunique() == part.attn_params_per_layer.nunique() == 1 and len(part) == 2
        assert (
            int(r[1]) == part.kv_bytes_per_token.iloc[0]
            and int(r[2].replace(",", "")) == part.attn_params_per_layer.iloc[0]
        )
        for cell, col in ((r[3], "eval_loss"), (r[4], "in_context_loss")):
            want = (part[col].mean(), part[col].min(), part[col].max())
            assert all(abs(x - y) <= 5e-4 + 1e-9 for x, y in zip(interval(cell), want)), (v, col, cell, want)
        assert abs(float(r[5]) - part.max_induction.mean()) <= 5e-4 + 1e-9, (v, r[5])
        assert r[6] == ("yes" if (part.induction_ci95_low > 0.5).all() else "no"), (v, r[6])
    formed = {r[0]: r[6] for r in got}
    if which == "heads":  # docs/results.md: 1-8 heads formed induction in both seeds, 16 in neither
        assert formed == {"1": "yes", "2": "yes", "4": "yes", "8": "yes", "16": "no"}
    else:  # MLA r=8's bounds, 0.492 and 0.481, fall short (its figure marker is open)
        assert [k for k, f in formed.items() if f == "yes"] == ["MHA", "GQA 4 groups", "GQA 2 groups", "MLA r=16"]


@pytest.mark.parametrize("which", list(STUDIES))
def test_study_caption_says_the_models_training_and_units(study_tex, which):
    """A study has no one model: the caption gives the models' layers and width, steps, batch, lr,
    seeds, corpus and device from study.json, and every column's meaning and units."""
    text = study_tex[which]
    summary = json.loads((STUDIES[which] / "study.json").read_text())
    base = summary["base"]
    caption = re.search(r"\\caption\{(.*)\}\n\\label", text).group(1)
    want = [
        f"headprobe study {which}:",
        f"{base['n_layers']}-layer attention-only transformers of d\\_model {base['d_model']}",
        f"trained {base['steps']} steps (batch {base['batch_size']} $\\times$ {base['seq_len']} tokens, AdamW lr {base['lr']})",
        f"(seeds {', '.join(map(str, summary['seeds']))}) on {base['corpus']}",
        f"{base['copy_fraction'] * 100:g}\\% of every batch copy sequences",
        f"device {summary['device']}",
        "KV cache: bytes per token over all layers at bf16",
        "attn. params: attention parameters per layer",
        "Held-out loss: nats/char",
        "in-context loss: late minus early loss on held-out copy sequences (nats/token",
        f"mean over {len(summary['seeds'])} seeds, their [min, max] on the line below",
        "lower 95\\% bound above 0.5 in every seed",
    ]
    want.append(
        f"the width split into {', '.join(map(str, summary['n_heads_list']))} heads"
        if which == "heads"
        else f"{base['n_heads']} query heads as {', '.join(dict.fromkeys(pd.read_csv(STUDIES[which] / 'results.csv').variant))}"
        f" (MLA r: latent rank; decoupled rotary key {summary['rope']} wide)"
    )
    assert [w for w in want if w not in caption] == [], caption
    assert "None" not in caption and f"\\label{{tab:study-{which}-study}}" in text
    _assert_escaped(which, text)
    assert text.startswith("\\begin{table}[htbp]\n\\centering\n\\small\n\\caption{")


def test_a_study_caption_names_only_the_variants_and_seeds_it_ran(tmp_path):
    """walk-layouts: ``study layouts --seeds 0 --ranks none`` (no MLA, one seed) was captioned "as MHA,
    GQA, MQA and MLA of latent rank r" and "mean over seeds": the caption names the variants of
    results.csv, MLA's rank only where an MLA variant ran, and a mean over seeds only over several."""
    src, study = STUDIES["layouts"], tmp_path / "study"
    study.mkdir()
    csv = pd.read_csv(src / "results.csv")
    csv[(csv.seed == 0) & ~csv.variant.str.startswith("MLA")].to_csv(study / "results.csv", index=False)
    summary = json.loads((src / "study.json").read_text())
    (study / "study.json").write_text(json.dumps({**summary, "seeds": [0]}))
    assert _export(study, tmp_path / "out", "--format", "latex") == 0
    text = (tmp_path / "out" / "latex" / "study.tex").read_text()
    caption = re.search(r"\\caption\{(.*)\}\n\\label", text).group(1)
    assert "8 query heads as MHA, GQA 4 groups, GQA 2 groups, MQA," in caption, caption
    assert "MLA" not in caption and "mean over" not in caption and "(seed 0)" in caption, caption


def test_study_table_numbers_are_the_reports(study_tex):
    """The table and ``headprobe study``'s terminal report round the same per-variant numbers
    (one aggregation, analyses.study_table): every mean of the report's table is in the LaTeX row."""
    from headprobe.commands.study import StudyConfig
    from headprobe.commands.study_core import StudyResult

    csv = pd.read_csv(STUDIES["layouts"] / "results.csv")
    report = StudyResult(StudyConfig("layouts"), csv).report().splitlines()
    got = {r[0]: r for r in study_rows(study_tex["layouts"])}
    for line in report[2:-1]:
        v, numbers = line[:12].strip(), line[12:].split()  # variant names are at most 12 characters here
        loss, _, ic, _, ind, _ = numbers
        assert got[v][3].split()[0] == loss and got[v][4].split()[0].replace("$-$", "-") == ic and got[v][5] == ind


@pytest.mark.parametrize(
    ("damage", "said"),
    [("gone", "results.csv"), ("cut", "no column"), ("empty", "no rows")],
)
def test_a_study_without_its_results_table_is_refused_in_one_line(tmp_path, damage, said):
    study = tmp_path / "study"
    study.mkdir()
    shutil.copy(STUDIES["heads"] / "study.json", study)
    text = (STUDIES["heads"] / "results.csv").read_text()
    if damage == "cut":
        (study / "results.csv").write_text(text[:40])
    elif damage == "empty":
        (study / "results.csv").write_text(text.splitlines()[0] + "\n")
    code, err = _one_line_refusal(
        ["export", "--from", str(study), "--out", str(tmp_path / "o"), "--format", "latex"], tmp_path
    )
    assert code == 2 and len(err) == 1 and said in err[0], err
    assert not (tmp_path / "o").exists()


@pytest.mark.skipif(shutil.which("pdflatex") is None, reason="no pdflatex (Debian: texlive-latex-recommended)")
def test_study_tables_compile_and_fit_a_neurips_page(study_tex, tmp_path):
    for which, text in study_tex.items():
        _assert_compiles_within(f"study-{which}", text, 397, tmp_path)


def test_a_study_export_imports_no_torch(tmp_path):
    """A study's table is read from results.csv and study.json in a process that never imports torch."""
    export_without_torch(STUDIES["layouts"], tmp_path / "o", "--format", "latex")
    assert (tmp_path / "o" / "latex" / "study.tex").is_file()


def test_a_one_seed_studys_caption_says_seed_not_seeds(tmp_path):
    """The caption of a study trained with one seed read "(seeds 0)"; it says "(seed 0)" and "one seed"."""
    import shutil

    src = tmp_path / "one-seed"
    shutil.copytree(STUDIES["heads"], src)
    rows = pd.read_csv(src / "results.csv")
    rows[rows["seed"] == 0].to_csv(src / "results.csv", index=False)
    summary = json.loads((src / "study.json").read_text())
    (src / "study.json").write_text(json.dumps({**summary, "seeds": [0]}))
    assert _export(src, tmp_path / "out") == 0
    caption = re.search(r"\\caption\{(.*)\}\n\\label", (tmp_path / "out" / "latex" / "study.tex").read_text()).group(1)
    assert "once per seed (seed 0) on" in caption and "seeds 0" not in caption, caption


def test_a_pruning_table_ends_with_the_saved_models_own_losses(tmp_path):
    """The figure's star (the --save-pruned model's own losses) was missing from pruning_curve.tex
    (walk-paper): its last row is that model, with summary.json's heads removed, fraction and losses."""
    src = FIGURES / "smollm2-135m-prune-2x64"
    saved = json.loads((src / "summary.json").read_text())["pruned_model"]
    assert _export(src, tmp_path / "out", "--format", "latex") == 0
    text = (tmp_path / "out" / "latex" / "pruning_curve.tex").read_text()
    last = rows(text)[-1]
    loss = saved["loss"]
    want = ["saved model", str(saved["heads_removed"]), f"{saved['fraction_removed']:.2f}"]
    assert last == [*want, f"{loss['natural']:.3f}", f"{loss['repeated']:.3f}"], last
    assert "saved model: the pruned model written with --save-pruned" in text.replace("-{}-", "--")


def test_a_verdict_table_says_why_a_type_has_no_verdict(tmp_path):
    """A quick scan (--n-random 10 --keep-n-random) wrote five rows of "no verdict" whose caption said nothing of
    why, where overview.png's title and the terminal did: the caption names each such type and its reason."""
    from headprobe.analyses.latex_tables import scan_tables

    summary = json.loads((SCAN / "summary.json").read_text())
    primary = summary["verification"]["primary_kind"]
    reason = "its smallest p-value 1/11 = 0.0909 cannot reach alpha = 0.05 after bh over 5 tests; raise --n-random"
    for r in summary["ablations"]:
        if r["kind"] == primary and r["head_type"] in ("induction", "previous_token"):
            r.update(confirmed=None, no_verdict=reason)
    text = scan_tables(tmp_path, summary)["verdicts"]
    said = "No verdict for previous-token, induction: its smallest p-value 1/11 = 0.0909 cannot reach alpha = 0.05"
    assert said in " ".join(text.split()), text
    assert "raise" not in text  # the first clause only: the caption is long already
