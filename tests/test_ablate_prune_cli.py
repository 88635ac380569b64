"""``headprobe ablate`` and ``headprobe prune`` end to end on a tiny GQA model saved as a local
Hugging Face directory, their errors, and the engine on the real SmolLM2 (shared session model)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pandas as pd
import pytest
import torch

from headprobe.cli import main


def _text(tmp_path):
    g = torch.Generator().manual_seed(0)
    words = " ".join(f"t{i}" for i in torch.randint(0, 100, (2000,), generator=g).tolist())
    p = tmp_path / "text.txt"
    p.write_text(words)
    return str(p)


SMALL = ["--seq-len", "16", "--n-natural", "3", "--n-repeated", "2", "--period", "6", "--device", "cpu"]


@pytest.mark.all_figure_formats  # checks the PDF/SVG files
def test_ablate_cli(tiny_dir, tmp_path, capsys):
    out = tmp_path / "ablate"
    assert main(["ablate", "--model", str(tiny_dir), "--out", str(out), "--text", _text(tmp_path), *SMALL]) == 0
    stdout = capsys.readouterr().out
    table = pd.read_csv(out / "head_ablation.csv")
    assert len(table) == 16
    assert {
        "layer",
        "head",
        "kv_head",
        "natural_loss_delta",
        "repeated_loss_delta",
        "natural_importance",
        "repeated_attribution",
        "induction_score",
    } <= set(table.columns)
    assert table["kv_head"].tolist() == [h // 4 for h in range(8)] * 2
    summary = json.loads((out / "summary.json").read_text())
    assert summary["units"] == "nats/token"
    from scipy.stats import spearmanr  # the summary's correlations, recomputed from the table's 6-digit columns

    rho = summary["spearman_with_exact_sweep"]["natural"]
    imp, delta = table["natural_importance"], table["natural_loss_delta"]
    assert abs(rho["gradient_importance_vs_abs_effect"] - spearmanr(imp, delta.abs()).statistic) < 0.05
    assert abs(rho["gradient_importance"] - spearmanr(imp, delta).statistic) < 0.05
    # each rho carries its 95% interval (Fisher z, Bonett-Wright variance), recomputed from rho and the 16 heads
    ci = summary["spearman_with_exact_sweep_ci95"]["natural"]
    for name, r in rho.items():
        np.testing.assert_allclose(ci[name], _bonett_wright(r, 16), atol=1e-3, err_msg=name)
    assert "Fisher" in summary["spearman_interval_rule"]
    lo, hi = ci["attribution_patching"]
    line = next(x for x in stdout.splitlines() if x.startswith("natural "))
    assert f"attribution {rho['attribution_patching']:.2f} [{lo:.2f}, {hi:.2f}]" in line, line
    assert (out / "ablation_effect.png").is_file() and (out / "ablation_effect.pdf").is_file()


def _bonett_wright(rho: float, n: int) -> list[float]:
    """Bonett & Wright's (2000) Spearman interval, written out: Fisher's z = atanh(rho) +- z_0.975
    sqrt((1 + rho^2 / 2) / (n - 3)), back through tanh."""
    from scipy.stats import norm

    half = norm.ppf(0.975) * np.sqrt((1 + rho**2 / 2) / (n - 3))
    return list(np.tanh(np.arctanh(rho) + np.array([-half, half])))


def test_spearman_ci_is_fishers_interval_of_the_ranks_widened_by_bonett_wright():
    """statistics.spearman_ci against scipy: pearsonr of the ranks (Spearman's rho) gives Fisher's
    interval, variance 1 / (n - 3); Bonett & Wright's multiplies that variance by 1 + rho^2 / 2, so
    the half-width in z is sqrt(1 + rho^2 / 2) times scipy's. Too few heads or |rho| = 1: no interval."""
    from scipy.stats import pearsonr, rankdata

    from headprobe.analyses.statistics import spearman_ci

    g = np.random.default_rng(0)
    for n, mix in ((12, 0.3), (60, 0.9), (270, 0.6)):
        a = g.standard_normal(n)
        b = mix * a + (1 - mix) * g.standard_normal(n)
        res = pearsonr(rankdata(a), rankdata(b))
        z_lo, z_hi = np.arctanh(res.confidence_interval(0.95))
        r = float(res.statistic)
        z = np.arctanh(r)
        want = np.tanh(z + (np.array([z_lo, z_hi]) - z) * np.sqrt(1 + r**2 / 2))
        np.testing.assert_allclose(spearman_ci(r, n), want, rtol=1e-9, err_msg=str(n))
    assert np.isnan(spearman_ci(0.5, 3)).all() and np.isnan(spearman_ci(1.0, 40)).all()


FAST_L0 = ["--l0-steps", "12", "--l0-lambdas", "10,100", "--n-seeds", "2"]


@pytest.mark.figures
def test_prune_cli_saves_reloadable_model(tiny_dir, tmp_path, capsys):
    """Every method on one CSV and figure, areas in summary.json, and the pruned model a
    directory that ``load_model`` and ``scan --model DIR`` load, equal to the masked model."""
    out = tmp_path / "prune"
    args = [
        "prune",
        "--model",
        str(tiny_dir),
        "--out",
        str(out),
        "--text",
        _text(tmp_path),
        "--step-fraction",
        "0.25",
        "--save-pruned",
        "--save-fraction",
        "0.5",
        *FAST_L0,
        *SMALL,
    ]
    assert main(args) == 0
    table = [x for x in capsys.readouterr().out.splitlines() if x.startswith(("curve", "michel", "random", "l0 "))]
    assert len({len(x) for x in table if not x.startswith("l0 ")}) == 1, table  # every row as wide as the header
    assert any(x.startswith("random (mean of 2)") for x in table)
    curve = pd.read_csv(out / "pruning_curve.csv")
    assert set(curve["method"]) == {"michel", "l0", "random"}
    assert sorted(curve.loc[curve.method == "random", "seed"].unique().tolist()) == [0, 1]
    iterative = curve[curve.method != "l0"]
    assert iterative.groupby(["method", "seed"], dropna=False)["fraction_pruned"].max().tolist() == [1.0, 1.0, 1.0]
    assert curve.loc[curve.method == "l0", "lambda"].dropna().tolist() == [10.0, 100.0]
    assert curve.loc[curve.method == "l0", "n_pruned"].max() > 0
    summary = json.loads((out / "summary.json").read_text())
    auc = summary["auc"]
    lo, hi = auc["range"]
    from headprobe.analyses.pruning import curve_auc

    mich = curve[curve.method == "michel"]
    assert auc["michel"]["natural"] == pytest.approx(curve_auc(mich.fraction_pruned, mich.natural_loss, hi), abs=1e-4)
    assert len(auc["random"]["natural"]["per_seed"]) == 2
    below = sum(a <= auc["michel"]["natural"] for a in auc["random"]["natural"]["per_seed"])  # rank among 2 orders
    assert summary["rank_vs_random"]["michel"]["natural"] == {
        "n_random": 2,
        "n_random_at_or_below": below,
        "p": (1 + below) / 3,
    }
    assert summary["pruned_model"]["heads_removed"] == 8
    assert summary["pruned_model"]["max_abs_logit_diff_vs_masked"] < 1e-4
    # the saved directory: small tensors, the removed heads in the original numbering, a tokenizer
    import headprobe
    from headprobe.probe.model.pruned import load_pruned_dir

    d = out / "pruned_model"
    meta = json.loads((d / "config.json").read_text())
    removed = {(l, h) for l, hs in enumerate(meta["pruned"]["removed_heads"]) for h in hs}
    order = [tuple(int(x) for x in h.split(".")) for h in summary["removal_order"]["michel"][:8]]
    assert removed == set(order)
    small = load_pruned_dir(d)
    assert sum(len(k) for k in small.kept_heads) == 8
    loaded = headprobe.load_model(str(d), device="cpu")  # full shape, removed heads' weights zero
    base = headprobe.load_model(str(tiny_dir), device="cpu")
    keep = torch.ones(2, 8)
    for l, h in removed:
        keep[l, h] = 0
    tokens = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        masked = base.model(tokens, head_mask=keep)
        torch.testing.assert_close(loaded.forward(tokens), masked, atol=1e-4, rtol=0)
        torch.testing.assert_close(small(tokens), masked, atol=1e-4, rtol=0)
    assert loaded.self_check.ok
    assert (
        main(
            [
                "scan",
                "--model",
                str(d),
                "--out",
                str(tmp_path / "scan"),
                "--text",
                _text(tmp_path),
                "--n-random",
                "2",
                "--types",
                "induction",
                "--seq-len",
                "16",
                "--n-natural",
                "3",
                "--n-repeated",
                "2",
                "--period",
                "6",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    scores = pd.read_csv(tmp_path / "scan" / "head_scores.csv")
    assert len(scores) == 16
    assert (out / "pruning_curve.png").is_file()


NO_CUDA = ["--device", "cuda"] if not torch.cuda.is_available() else ["--n-natural", "0"]


@pytest.mark.parametrize(
    "command, extra",
    [
        ("prune", ["--step-fraction", "0"]),
        ("prune", ["--period", "1"]),
        ("prune", ["--seq-len", "0"]),
        ("prune", NO_CUDA),
        ("ablate", ["--period", "1"]),
        ("ablate", ["--seq-len", "0"]),
        ("ablate", ["--max-batch", "-1"]),
        ("ablate", NO_CUDA),
    ],
)
def test_bad_input_exits_2(tiny_dir, tmp_path, capsys, extra, command):
    try:  # HeadprobeError returns 2; argparse's type errors exit 2
        code = main([command, "--model", str(tiny_dir), "--out", str(tmp_path / "x"), *SMALL, *extra])
    except SystemExit as e:
        code = e.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("headprobe: error:"), err
    assert not (tmp_path / "x").exists()


def test_a_save_fraction_of_no_head_is_refused_and_a_step_of_under_one_head_is_said(tiny_dir, tmp_path, capsys):
    """walk 'prune': --save-fraction 1e-9 saved the whole model as "pruned" (0 heads removed), and
    --step-fraction 0.0001 became one head a step (270 steps) without a word. The first is refused in
    one line before the curves run; the second's header says it, and its curve has that many steps."""
    base = ["prune", "--model", str(tiny_dir), "--text", _text(tmp_path), *SMALL, "--formats", "none"]
    assert main([*base, "--out", str(tmp_path / "x"), "--save-pruned", "--save-fraction", "0.01"]) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("loading ")]
    assert err == [
        "headprobe: error: --save-fraction 0.01 of the 16 heads removes none (it rounds to 0 heads): the saved "
        "model would be the whole model; give --save-fraction 0.063 or more"
    ]
    assert not (tmp_path / "x").exists() and round(0.063 * 16) == 1
    out = tmp_path / "steps"
    assert (
        main([*base, "--out", str(out), "--method", "random", "--step-fraction", "0.01", "--max-fraction", "0.25"]) == 0
    )
    said = "steps: 1 of the 16 heads a step (--step-fraction 0.01 x 16 = 0.16 heads, rounded up to 1), 4 steps to 4 removed"
    assert said in capsys.readouterr().out
    curve = pd.read_csv(out / "pruning_curve.csv")
    assert all(list(c) == [0, 1, 2, 3, 4] for _, c in curve.groupby("seed")["n_pruned"]) and curve["seed"].nunique() > 1


@pytest.mark.parametrize("command", ["ablate", "prune"])
def test_lengths_past_the_context_say_what_fits_before_any_plan(tiny_dir, tmp_path, capsys, command):
    """A model of a short context (a trained toy): the lengths that do not fit are named with the
    longest that do, in one line, before a batch plan for them is printed."""
    import headprobe

    n_ctx = headprobe.load_model(str(tiny_dir), quiet=True).spec.n_ctx
    argv = [command, "--model", str(tiny_dir), "--out", str(tmp_path / "x"), *SMALL]
    assert main([*argv, "--seq-len", str(n_ctx + 1), "--period", str(n_ctx // 2)]) == 2
    out, err = capsys.readouterr()
    want = f"use --seq-len {n_ctx} or less and --period {(n_ctx - 1) // 2} or less"
    (line,) = [ln for ln in err.splitlines() if ln.startswith("headprobe: error:")]
    assert f"--seq-len {n_ctx + 1} and --period {n_ctx // 2} give" in line and want in line and "Traceback" not in err
    assert "batch:" not in out and not (tmp_path / "x").exists()


@pytest.fixture(scope="module")
def short_dir(tiny_dir, tmp_path_factory):
    """The tiny model with a 40-token context (rotary: the same weights fit it), shorter than the
    128-token windows and the two 50-token blocks of the fixed defaults."""
    d = tmp_path_factory.mktemp("short-context")
    shutil.copytree(tiny_dir, d, dirs_exist_ok=True)
    cfg = json.loads((d / "config.json").read_text())
    cfg["max_position_embeddings"] = 40
    (d / "config.json").write_text(json.dumps(cfg))
    return d


FAST_PRUNE = ["--method", "random", "--n-seeds", "1", "--step-fraction", "0.5"]


@pytest.mark.parametrize("command, extra", [("ablate", []), ("prune", FAST_PRUNE)])
def test_default_lengths_fit_a_short_context_and_are_recorded(short_dir, tmp_path, command, extra):
    """At their defaults ablate and prune fit a 40-token context as scan does: windows of
    min(128, 40) = 40 tokens and a block of min(50, (40 - 1) // 2) = 19 ([BOS] + 2 x 19 = 39 tokens);
    summary.json records those lengths and the token sets have them."""
    out = tmp_path / command
    argv = [command, "--model", str(short_dir), "--out", str(out), "--text", _text(tmp_path)]
    assert main([*argv, "--n-natural", "2", "--n-repeated", "2", "--device", "cpu", *extra]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["config"]["seq_len"], summary["config"]["period"], summary["tokens"]["period"]) == (40, 19, 19)
    natural = summary["tokens"]["natural" if command == "ablate" else "score"]
    assert natural == [2, 40] and summary["tokens"]["repeated"] == [2, 1 + 2 * 19], summary["tokens"]


@pytest.mark.parametrize("command", ["ablate", "prune", "robustness", "diff"])
def test_a_given_period_past_a_short_context_is_refused_alone(short_dir, tmp_path, capsys, command):
    """A --period that does not fit is refused in one line naming it alone (the default --seq-len
    fits), exit 2, nothing written; robustness and diff (of the model with itself) too, where they
    shortened a given length without a word."""
    model = ["--model", str(short_dir)] if command != "diff" else [str(short_dir), str(short_dir)]
    argv = [command, *model, "--out", str(tmp_path / "x"), "--text", _text(tmp_path)]
    assert main([*argv, "--period", "20", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("headprobe: error:")]
    assert line == (
        "headprobe: error: --period 20 gives sequences longer than the model's context (40 tokens): "
        "use --seq-len 40 or less and --period 19 or less"
    ), line
    assert "Traceback" not in err and not (tmp_path / "x").exists()


def test_an_other_period_past_a_short_context_is_refused(short_dir, tmp_path, capsys, monkeypatch):
    """``robustness --other-period 20`` on a 40-token context ran its "repeats period 20" condition on
    41-token sequences without a word; refused as --period is, before the load where config.json
    gives the context and after it (peek_config made blind) alike."""
    from headprobe import options

    argv = ["robustness", "--model", str(short_dir), "--out", str(tmp_path / "x"), "--text", _text(tmp_path)]
    said = (
        "headprobe: error: --other-period 20 gives sequences longer than the model's context (40 tokens): "
        "use --other-period 19 or less"
    )
    for blind in (False, True):
        if blind:
            monkeypatch.setattr(options, "peek_config", lambda model: None)
        assert main([*argv, "--other-period", "20", "--device", "cpu"]) == 2
        err = capsys.readouterr().err
        assert [ln for ln in err.splitlines() if ln.startswith("headprobe: error:")] == [said], err
        assert "Traceback" not in err and not (tmp_path / "x").exists()


def test_bad_model_exits_2(tmp_path, capsys):
    assert main(["ablate", "--model", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2


def test_engine_on_smollm2(smollm2, smollm2_native):
    """The real GQA model: engine vs the bridge's hook loop, and real removal vs the mask."""
    from headprobe.analyses.ablation import exact_sweep, sweep_loop
    from headprobe.probe.model.pruned import keep_mask_from, remove_heads

    tokens = torch.randint(0, 49000, (2, 24), generator=torch.Generator().manual_seed(0))
    heads = [(0, 4), (14, 0), (29, 8)]
    fast = exact_sweep(smollm2_native, tokens, heads=heads)
    ref = sweep_loop(smollm2, tokens, heads=heads)
    idx = torch.tensor(heads).T
    assert (fast.loss[idx[0], idx[1]] - ref.loss[idx[0], idx[1]]).abs().max() < 1e-3
    keep = keep_mask_from([(0, 0), (0, 1), (0, 2), (5, 4), *[(7, h) for h in range(9)]], 30, 9)
    net = smollm2_native.model
    with torch.inference_mode():
        pruned = remove_heads(net, keep)
        assert pruned.blocks[0].attn.kept_kv_heads == [1, 2]
        # float32 rounding through 30 layers: the masked model's own eager and SDPA paths differ by
        # ~2e-4 on logits of size ~30 (in float64 pruned and masked agree exactly)
        torch.testing.assert_close(pruned(tokens), net(tokens, head_mask=keep.float()), atol=1e-3, rtol=0)


def test_parse_heads_checks_form_and_range():
    from headprobe.probe.core.errors import HeadprobeError
    from headprobe.probe.hooks.ablation import parse_heads

    assert parse_heads("5.1, 7.10", 12, 12) == [(5, 1), (7, 10)]
    assert parse_heads("L5H1,l7h10", 12, 12) == [(5, 1), (7, 10)]  # TransformerLens' spelling too
    for text in ("L5.1", "5H1", "L5H"):
        with pytest.raises(HeadprobeError, match="layer.head"):
            parse_heads(text, 12, 12)
    with pytest.raises(HeadprobeError, match="out of range: the model has 30 layers of 9 heads"):
        parse_heads("40.3", 30, 9)
    with pytest.raises(HeadprobeError, match="layer.head"):
        parse_heads("5-1", 30, 9)
    for text in ("18.6,", "5.1,,7.3", " , 5.1"):
        with pytest.raises(HeadprobeError, match="empty entry in the head list"):
            parse_heads(text, 30, 9)
    with pytest.raises(HeadprobeError, match="no heads given"):
        parse_heads(" ", 30, 9)


def test_ablate_cli_heads_subset_and_out_of_range(tiny_dir, tmp_path):
    from test_loading import assert_one_line_error, run_cli

    out = tmp_path / "subset"
    assert (
        main(
            [
                "ablate",
                "--model",
                str(tiny_dir),
                "--out",
                str(out),
                "--text",
                _text(tmp_path),
                "--heads",
                "1.3,0.0",
                *SMALL,
            ]
        )
        == 0
    )
    table = pd.read_csv(out / "head_ablation.csv")
    swept = table.dropna(subset=["natural_loss_delta"])
    assert sorted(zip(swept.layer, swept["head"])) == [(0, 0), (1, 3)]
    one = tmp_path / "one"  # too few heads to rank (< MIN_RANKED_HEADS): null in the JSON, n/a on screen, never NaN
    rc, stdout, _ = run_cli(
        "ablate",
        "--model",
        str(tiny_dir),
        "--out",
        str(one),
        "--text",
        _text(tmp_path),
        "--heads",
        "1.3,0.0,0.1,1.1,1.2",
        *SMALL,
    )
    assert rc == 0 and "n/a" in stdout and "nan" not in stdout.lower()
    # the two thresholds, each named with its quantity (they read as one rule: "fewer than 8 heads swept" beside
    # "none from fewer than 4 heads"): rho needs 8 heads, its interval 4
    assert "n/a: rho needs at least 8 heads swept, 5 were: too few to rank" in stdout, stdout
    assert "Spearman rho: reported where 8 or more heads are swept; its interval [lo, hi]: 95% interval" in stdout, (
        stdout
    )
    assert "no interval from fewer than 4 heads (n - 3 > 0)" in stdout, stdout
    text = (one / "summary.json").read_text()
    assert "NaN" not in text and json.loads(text)["spearman_with_exact_sweep"]["natural"]["gradient_importance"] is None
    rc, _, err = run_cli("ablate", "--model", str(tiny_dir), "--out", str(tmp_path / "bad"), "--heads", "40.3", *SMALL)
    assert_one_line_error(rc, err, "head 40.3 is out of range")
    assert not (tmp_path / "bad").exists()


def test_a_head_named_twice_is_swept_once(tiny_dir, tmp_path):
    """``--heads 0.1,L0H1,0.1`` names one head: it was swept three times per task and the report
    said "6 swept on 1 rank, -4 resumed from a checkpoint"."""
    from test_loading import run_cli

    out = tmp_path / "twice"
    rc, stdout, _ = run_cli(
        "ablate", "--model", str(tiny_dir), "--out", str(out), "--text", _text(tmp_path), "--heads", "0.1,L0H1,0.1",
        "--formats", "none", *SMALL,
    )  # fmt: skip
    assert rc == 0 and "2 swept on 1 rank, 0 resumed from a checkpoint" in stdout, stdout
    swept = pd.read_csv(out / "head_ablation.csv").dropna(subset=["natural_loss_delta"])
    assert list(zip(swept.layer, swept["head"])) == [(0, 1)]


@pytest.mark.parametrize(
    "command, kill_after, csv",
    [
        ("ablate", 1, "head_ablation.csv"),  # killed after the natural-text sweep, before the repeated-tokens sweep
        ("prune", 3, "pruning_curve.csv"),  # killed in the middle of the importance-order run
    ],
)
def test_killed_run_resumes_to_the_same_results(tiny_dir, tmp_path, capsys, command, kill_after, csv):
    """A run killed midway (SIGKILL) resumes from its checkpoint, in a new process as a user
    would rerun it, and ends with the same results as an uninterrupted run (the reference, run in
    this process, as is the refusal at the end: each process start is seconds)."""
    from test_loading import run_cli

    from headprobe.probe.core.io import CHECKPOINT_NAME

    # prune: one method keeps it short (L0's own resume is tested in test_prune_methods.py)
    args = [
        "--model",
        str(tiny_dir),
        "--text",
        _text(tmp_path),
        *(["--method", "michel"] if command == "prune" else []),
        *SMALL,
        "--threads",  # without it each process counts the idle cores: another count rounds otherwise
        "1",
    ]
    assert main([command, "--out", str(tmp_path / "whole"), *args]) == 0
    rc, _, _ = run_cli(
        command, "--out", str(tmp_path / "cut"), *args, env={"HEADPROBE_KILL_AFTER_SAVES": str(kill_after)}
    )
    assert rc == -9  # killed, as a power cut or `kill -9` would
    assert (tmp_path / "cut" / CHECKPOINT_NAME).is_file() and not (tmp_path / "cut" / csv).exists()
    shutil.copytree(tmp_path / "cut", tmp_path / "other")  # the killed run's folder, for the other-settings check
    rc, out, err = run_cli(command, "--out", str(tmp_path / "cut"), *args)
    assert rc == 0, err
    assert "resuming from" in out
    assert (tmp_path / "cut" / csv).read_text() == (tmp_path / "whole" / csv).read_text()
    assert not (tmp_path / "cut" / CHECKPOINT_NAME).exists()
    # a checkpoint from other settings is not silently mixed in
    capsys.readouterr()
    rc = main([command, "--out", str(tmp_path / "other"), *args[:-2], "--seed", "5"])
    err = capsys.readouterr().err
    assert rc == 2 and "other settings" in err and "--overwrite" in err
    # with --overwrite it is discarded, and said (it was silent: an interrupted run's work gone unsaid)
    assert main([command, "--out", str(tmp_path / "other"), *args[:-2], "--seed", "5", "--overwrite"]) == 0
    notes = [x for x in capsys.readouterr().err.splitlines() if x.startswith("NOTE: --overwrite")]
    assert len(notes) == 1 and "seed: 0 there, 5 now" in notes[0] and notes[0].endswith("is discarded; starting over")


def test_out_of_memory_mid_run_resumes_with_a_smaller_budget_or_batch(tiny_dir, tmp_path, monkeypatch, capsys):
    """An ablate that ran out of memory after its first checkpoint said "run the same command again
    to resume from it", which failed again the same way (walk-gpu trip 5). It now says to rerun with
    a smaller --memory-budget or --max-batch, and that rerun resumes (neither is part of the
    checkpoint's settings) and ends with the uninterrupted run's table."""
    import torch

    from headprobe.probe.core.io import CHECKPOINT_NAME, RunCheckpoint

    args = ["--model", str(tiny_dir), "--text", _text(tmp_path), *SMALL, "--formats", "none"]
    assert main(["ablate", "--out", str(tmp_path / "whole"), *args]) == 0
    real_save = RunCheckpoint.save

    def save_then_fail(self, state):
        real_save(self, state)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(RunCheckpoint, "save", save_then_fail)
    capsys.readouterr()
    assert main(["ablate", "--out", str(tmp_path / "cut"), *args, "--memory-budget", "1GiB"]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("headprobe: error: out of memory (CUDA out of memory.") and "same command" not in line
    assert "checkpoint: rerun with a smaller --memory-budget or --max-batch to resume from it" in line, line
    assert (tmp_path / "cut" / CHECKPOINT_NAME).is_file()
    monkeypatch.setattr(RunCheckpoint, "save", real_save)
    rerun = ["ablate", "--out", str(tmp_path / "cut"), *args, "--memory-budget", "512MiB", "--max-batch", "2"]
    assert main(rerun) == 0
    out = capsys.readouterr().out
    assert "resuming from" in out and "0 resumed from a checkpoint" not in out, out
    csv = "head_ablation.csv"
    assert (tmp_path / "cut" / csv).read_text() == (tmp_path / "whole" / csv).read_text()


def test_checkpoint_from_when_the_repeated_task_was_called_induction_resumes(tiny_dir, tmp_path):
    """The repeated task took scan's name ``repeated`` (it was ``induction`` in ablate and prune):
    a checkpoint written under the old name is read, not silently redone or broken. Ablate: a
    marked loss under the old key shows up in the result, so the old sweep was used; prune: the
    resumed curve's ``repeated_loss`` equals the uninterrupted run's."""
    import headprobe
    from headprobe.commands.ablate import AblateConfig
    from headprobe.commands.ablate import core as ablate_core
    from headprobe.commands.prune import PruneConfig
    from headprobe.commands.prune import core as prune_core

    model = headprobe.load_model(str(tiny_dir), device="cpu")
    data = dict(
        model=str(tiny_dir), text=_text(tmp_path), seq_len=16, n_natural=3, n_repeated=2, period=6, device="cpu"
    )
    states = []
    whole = ablate_core.run(
        model, AblateConfig(**data), on_save=lambda s: states.append(json.loads(json.dumps(s))), progress=False
    )
    old = states[-1]
    old["induction"] = old.pop("repeated")
    old["induction"]["loss"]["1.2"] = old["induction"]["clean"] + 7.0
    old["induction"]["seq"]["1.2"] = [x + 7.0 for x in old["induction"]["clean_seq"]]  # their mean is the loss
    resumed = ablate_core.run(model, AblateConfig(**data), resume=old, progress=False)
    assert resumed.tasks["repeated"].effect[1, 2] == pytest.approx(7.0, abs=1e-5)
    assert resumed.swept == 0 and set(resumed.tasks) == {"natural", "repeated"}
    np.testing.assert_array_equal(
        np.delete(resumed.tasks["repeated"].effect.ravel(), 1 * 8 + 2),
        np.delete(whole.tasks["repeated"].effect.ravel(), 1 * 8 + 2),
    )

    states = []
    cfg = PruneConfig(**data, methods="michel", step_fraction=0.25)
    whole = prune_core.run(model, cfg, on_save=lambda s: states.append(json.loads(json.dumps(s))), progress=False)
    old = states[1]
    old["michel"]["rows"] = [
        {("induction_loss" if k == "repeated_loss" else k): v for k, v in r.items()} for r in old["michel"]["rows"]
    ]
    resumed = prune_core.run(model, cfg, resume=old, progress=False)
    pd.testing.assert_frame_equal(resumed.table, whole.table)
    assert "induction_loss" not in resumed.table


def test_a_per_layer_table_picked_on_its_scoring_windows_is_recomputed_on_resume(tiny_dir, tmp_path):
    """A checkpoint written when --per-layer picked each layer's best head on the windows it scored it
    on (no ``best_head_halves_agree``): the resumed run recomputes the table held out, not reusing it."""
    import headprobe
    from headprobe.commands.prune import PruneConfig
    from headprobe.commands.prune import core as prune_core

    model = headprobe.load_model(str(tiny_dir), device="cpu")
    data = dict(
        model=str(tiny_dir), text=_text(tmp_path), seq_len=16, n_natural=3, n_repeated=2, period=6, device="cpu"
    )
    states = []
    cfg = PruneConfig(**data, methods="random", n_seeds=1, step_fraction=1.0, per_layer=True)
    whole = prune_core.run(model, cfg, on_save=lambda s: states.append(json.loads(json.dumps(s))), progress=False)
    old = states[-1]  # as written before held-out picks: no halves column, and a same-window loss
    old["per_layer"] = [
        {k: (v - 1.0 if k == "loss_best_only" else v) for k, v in r.items() if k != "best_head_halves_agree"}
        for r in old["per_layer"]
    ]
    resumed = prune_core.run(model, cfg, resume=old, progress=False)
    assert resumed.per_layer == whole.per_layer  # recomputed held out, not reused


@pytest.mark.parametrize("command", ["ablate", "prune"])
def test_an_encoder_is_refused_in_one_line(tmp_path_factory, tmp_path, capsys, command):
    """An encoder has no next-token loss: ablate's effects and prune's curve would read its chance-level
    "loss" through tied embeddings (all-MiniLM-L6-v2: 10.19 nats, ln 30522 = 10.33) as results. One
    line, exit 2, nothing written."""
    import zoo

    d = zoo.save_dir("bert", zoo.encoder_tokenizer(tmp_path_factory.mktemp("bert_tok")), tmp_path / "bert")
    capsys.readouterr()
    out = tmp_path / "x"
    assert main([command, "--model", str(d), "--out", str(out), "--device", "cpu", "--text", _text(tmp_path)]) == 2
    err = capsys.readouterr().err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("headprobe: error:")]
    assert f"{command} needs a causal language model" in line and "is an encoder" in line, line
    assert "Traceback" not in err and not out.exists()


def test_a_save_fraction_beyond_the_curve_is_refused(tmp_path, capsys):
    """--save-pruned saves the first --save-fraction of the removal order, which stops at
    --max-fraction: 0.5 of a curve that stops at 0.2 saved 0.2 without a word. One line, exit 2."""
    out = tmp_path / "x"
    argv = ["prune", "--model", "nowhere", "--out", str(out), "--save-pruned", "--max-fraction", "0.2"]
    assert main([*argv, "--save-fraction", "0.5"]) == 2
    err = capsys.readouterr().err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("headprobe: error:")]
    assert line == (
        "headprobe: error: --save-fraction 0.5 is beyond --max-fraction 0.2: the removal order stops there; "
        "give --max-fraction 0.5 or more, or a smaller --save-fraction"
    ), line
    assert not out.exists()


@pytest.mark.parametrize("command", ["ablate", "prune"])
def test_an_encoder_is_refused_before_the_load(tmp_path_factory, tmp_path, command):
    """The embedded all-MiniLM-L6-v2 and a BERT folder (its config.json's model_type) are known as encoders
    before any weights load: the same one line as after the load, exit 2, torch never imported, nothing written."""
    import subprocess
    import sys

    import zoo

    d = zoo.save_dir("bert", zoo.encoder_tokenizer(tmp_path_factory.mktemp("bert_tok")), tmp_path / "bert")
    for model in ("all-MiniLM-L6-v2", str(d)):
        out = tmp_path / "x"
        r = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "headprobe", command, "--model", model, "--out", str(out)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        lines = r.stderr.splitlines()
        errors = [x for x in lines if not x.startswith("import time:")]
        assert r.returncode == 2 and len(errors) == 1, errors
        name = "all-minilm-l6-v2" if model.startswith("all") else model
        assert errors[0].startswith(f"headprobe: error: {command} needs a causal language model"), errors
        assert errors[0].endswith(
            f"; {name} is an encoder: headprobe scan verifies an encoder's heads by 1 - cos of its output"
        )
        assert not any(x.rsplit("|", 1)[-1].strip() == "torch" for x in lines if x.startswith("import time:"))
        assert not out.exists()


def test_the_encoder_group_of_the_families_is_their_encoder_flag():
    """The torch-free group that names encoder families before a load is exactly the families whose
    ``Family.encoder`` is set (each family module imported and read)."""
    from headprobe.probe.model.families import FAMILIES, is_encoder_type

    assert {t for t in FAMILIES if is_encoder_type(t)} == {t for t in FAMILIES if FAMILIES.get(t).encoder} == {"bert"}


def test_ablate_effect_intervals_equal_a_hooked_reference(tiny_dir, tmp_path):
    """Each head's loss increase carries the 95% Student-t interval over the task's sequences (it
    was printed bare, and a top-heads list from 8 sequences read as a finding). The reference: each
    sequence's scored loss with the head zero-ablated through hooks on a full forward pass (not the
    sweep's resumed forward), and scipy's t interval; the summary's top heads and the report carry it."""
    from scipy import stats

    import headprobe
    from headprobe.commands.ablate import AblateConfig
    from headprobe.commands.ablate import core as ablate_core
    from headprobe.probe.backends.base import scored_loss
    from headprobe.probe.hooks.ablation import head_ablation_hooks

    model = headprobe.load_model(str(tiny_dir), device="cpu")
    cfg = AblateConfig(
        model=str(tiny_dir), text=_text(tmp_path), seq_len=16, n_natural=4, n_repeated=3, period=6, device="cpu"
    )
    r = ablate_core.run(model, cfg, progress=False)
    _, _, sets, _ = ablate_core._task_sets(model, r.config)
    summary, report = r.summary(), r.report()
    for task, (tokens, first, _) in sets.items():
        with torch.no_grad():
            clean = scored_loss(model.forward(tokens), tokens, first).double()
            ablated = {
                (layer, head): scored_loss(
                    model.forward(tokens, fwd_hooks=head_ablation_hooks([(layer, head)], "zero")), tokens, first
                ).double()
                for layer, head in [(0, 4), (1, 1), (1, 6)]
            }
        for (layer, head), loss in ablated.items():
            d = (loss - clean).numpy()
            lo, hi = stats.t.interval(0.95, len(d) - 1, loc=d.mean(), scale=stats.sem(d))
            row = r.table[(r.table["layer"] == layer) & (r.table["head"] == head)].iloc[0]
            assert row[f"{task}_loss_delta"] == pytest.approx(d.mean(), abs=1e-5)
            assert row[f"{task}_loss_delta_ci95_low"] == pytest.approx(lo, abs=1e-5)
            assert row[f"{task}_loss_delta_ci95_high"] == pytest.approx(hi, abs=1e-5)
        top = summary["top_heads_by_loss_delta"][task][0]
        layer, head = map(int, top["head"].split("."))
        row = r.table[(r.table["layer"] == layer) & (r.table["head"] == head)].iloc[0]
        want = [round(row[f"{task}_loss_delta_ci95_low"], 5), round(row[f"{task}_loss_delta_ci95_high"], 5)]
        assert top["ci95"] == pytest.approx(want, abs=1e-5)
        line = next(x for x in report.splitlines() if x.startswith(task))
        assert f"{top['head']} (+{top['loss_delta']:.3f} [{want[0]:+.3f}, {want[1]:+.3f}])" in line, line
    assert "Student-t" in summary["interval_rule"]


def test_ablate_refuses_per_sequence_losses_that_do_not_average_to_the_effect(tiny_dir, tmp_path):
    """The identity behind the interval: the mean over sequences of each head's per-sequence loss
    increase is its printed effect. A checkpoint whose per-sequence losses disagree with its mean
    (here one head's shifted by 0.5 nats) is refused in one line, not printed beside a wrong interval."""
    import headprobe
    from headprobe.commands.ablate import AblateConfig
    from headprobe.commands.ablate import core as ablate_core
    from headprobe.probe.core.errors import HeadprobeError

    model = headprobe.load_model(str(tiny_dir), device="cpu")
    cfg = AblateConfig(
        model=str(tiny_dir), text=_text(tmp_path), seq_len=16, n_natural=3, n_repeated=2, period=6, device="cpu"
    )
    states = []
    ablate_core.run(model, cfg, on_save=lambda s: states.append(json.loads(json.dumps(s))), progress=False)
    bad = states[-1]
    bad["natural"]["seq"]["1.2"] = [x + 0.5 for x in bad["natural"]["seq"]["1.2"]]
    with pytest.raises(HeadprobeError, match=r"natural task: head 1\.2's per-sequence loss increases average to"):
        ablate_core.run(model, cfg, resume=bad, progress=False)


def test_the_ablation_figure_names_a_change_and_its_sign(tiny_dir, tmp_path):
    """ablation_effect.png of ``ablate --heads 0.8,18.6`` on smollm2-135m was titled "Loss increase from ablating
    one head" over mostly decreases (0.8: -1.02 nats/token). Its title says "change", and each colour bar's
    label the sign convention (ablated minus clean), whatever the signs drawn; here some effect is negative."""
    import headprobe

    a = headprobe.ablate(
        str(tiny_dir), text=_text(tmp_path), n_natural=3, seq_len=16, n_repeated=2, period=6, device="cpu"
    )
    fig = a.figures()["ablation_effect"]
    effects = a.table[["natural_loss_delta", "repeated_loss_delta"]].to_numpy()
    assert (effects < 0).any() and (effects > 0).any()  # both signs drawn
    title = fig._suptitle.get_text()
    assert title.split("\n")[0] == "Loss change from ablating one head" and "increase" not in title, title
    bars = [ax for ax in fig.axes if getattr(ax, "_colorbar", None) is not None]
    assert len(bars) == 2
    for bar in bars:
        assert " ".join(bar.get_ylabel().split()).startswith("Δ loss = ablated − clean (nats/token"), bar.get_ylabel()


def _small_ablate_run(tiny_dir, tmp_path):
    """A tiny ablate run (16 heads) saved into ``tmp_path/ablate``: the result, its head_ablation.csv,
    summary.json and the terminal report."""
    import headprobe

    a = headprobe.ablate(
        str(tiny_dir), text=_text(tmp_path), n_natural=3, seq_len=16, n_repeated=2, period=6, device="cpu"
    )
    out = tmp_path / "ablate"
    a.save(out, formats="png")
    summary = json.loads((out / "summary.json").read_text())
    return a, pd.read_csv(out / "head_ablation.csv"), summary, a.report(), out


@pytest.mark.figures
def test_importance_vs_exact_draws_the_csv_with_the_reports_rho_and_names_the_top_heads(tiny_dir, tmp_path):
    """importance_vs_exact.png puts the two rankings side by side: per task one dot per head at (exact Δ
    loss, gradient importance) as head_ablation.csv has them, read back from the panel's one scatter
    collection, both as the run draws it and as a redraw from the CSV alone does; its title's Spearman rho
    of importance vs |Δ| is scipy's over the CSV, with the Bonett-Wright interval, the very text of the
    terminal line; the labelled heads are the top 5 by exact Δ (the CSV's, largest first)."""
    from scipy.stats import spearmanr

    from headprobe.commands.ablate import core as ablate_core

    a, table, summary, report, out = _small_ablate_run(tiny_dir, tmp_path)
    assert (out / "importance_vs_exact.png").is_file()
    drawn = {
        "run": a.figures()["importance_vs_exact"],
        "redraw": ablate_core.importance_figure(table, "tiny", summary["tokens"]),
    }
    for how, fig in drawn.items():
        panels = [ax for ax in fig.axes if ax.get_title()]
        assert len(panels) == 2, how
        for ax, task in zip(panels, ("natural", "repeated")):
            (dots,) = ax.collections  # one dot per head, nothing else
            delta, imp = table[f"{task}_loss_delta"], table[f"{task}_importance"]
            np.testing.assert_allclose(dots.get_offsets(), np.c_[delta, imp], atol=1e-6, err_msg=f"{how} {task}")
            rho = spearmanr(imp, delta.abs()).statistic
            lo, hi = _bonett_wright(rho, len(table))
            stat = f"{rho:.2f} [{lo:.2f}, {hi:.2f}]"
            title = " ".join(ax.get_title().split())  # wrapped to the panel's width
            assert f"ρ(I_h, |Δ|) = {stat}, {len(table)} heads" in title, (how, title)
            line = next(x for x in report.splitlines() if x.startswith(f"{task} "))
            assert f"importance vs |Δ| {stat} " in line, line
            top = table.sort_values(f"{task}_loss_delta", ascending=False, kind="stable").head(5)
            names = [f"{r.layer}.{r.head}" for r in top.itertuples()]
            assert [t.get_text() for t in ax.texts] == names, how
            for note, r in zip(ax.texts, top.itertuples()):  # each label points at its own head's dot
                np.testing.assert_allclose(
                    note.xy, (getattr(r, f"{task}_loss_delta"), getattr(r, f"{task}_importance")), atol=1e-6
                )
        title = fig._suptitle.get_text()
        n, t = summary["tokens"]["natural"]
        assert f"natural text {n} × {t}" in title and "sequences × tokens" in title, title
        assert "nats per unit of head mask" in " ".join(panels[0].get_ylabel().split())  # docs/ablate.md's unit


def test_ablate_reports_the_layer_normalised_importances_rank_agreement_as_prune_ranks(tiny_dir, tmp_path):
    """prune --method michel ranks by I_h divided by its layer's l2 norm (Michel et al. section 4.1);
    summary.json and the terminal line give that score's Spearman rho with |Δ| beside the raw one's,
    with its interval: equal to scipy's over a per-layer normalisation written out here (a different
    number from the raw importance's on this model)."""
    from scipy.stats import spearmanr

    a, table, summary, report, _ = _small_ablate_run(tiny_dir, tmp_path)
    exact = a.table  # the run's own numbers, not the CSV's 6 digits
    for task in ("natural", "repeated"):
        imp = exact[f"{task}_importance"].to_numpy(dtype=float)
        norm = exact.groupby("layer")[f"{task}_importance"].transform(lambda v: np.sqrt((v.astype(float) ** 2).sum()))
        normalised = imp / norm.to_numpy()
        delta = exact[f"{task}_loss_delta"].abs()
        want = spearmanr(normalised, delta).statistic
        assert abs(want - spearmanr(imp, delta).statistic) > 1e-3  # the normalisation changes the ranking here
        rho = summary["spearman_with_exact_sweep"][task]["layer_normalized_importance_vs_abs_effect"]
        ci = summary["spearman_with_exact_sweep_ci95"][task]["layer_normalized_importance_vs_abs_effect"]
        assert rho == pytest.approx(want, abs=1e-9)
        np.testing.assert_allclose(ci, _bonett_wright(want, len(exact)), atol=1e-3)
        line = next(x for x in report.splitlines() if x.startswith(f"{task} "))
        assert f"(layer-normalised, as prune ranks: {rho:.2f} [{ci[0]:.2f}, {ci[1]:.2f}]; signed " in line, line


def test_ablated_losses_worse_than_a_uniform_guess_are_remarked(tiny_dir, tmp_path):
    """A head whose ablation leaves the loss above ln(d_vocab) (worse than guessing uniformly over the
    vocabulary) is named in summary.json's ``ablated_loss_above_uniform`` and one NOTE line of the
    report; none such: no key and no line. The reference: each head's ablated loss on a full forward
    pass through hooks and ln of config.json's vocab_size (the tiny random model's losses sit near it)."""
    import dataclasses
    import math

    import headprobe
    from headprobe.commands.ablate import AblateConfig
    from headprobe.commands.ablate import core as ablate_core
    from headprobe.probe.backends.base import scored_loss
    from headprobe.probe.hooks.ablation import head_ablation_hooks

    model = headprobe.load_model(str(tiny_dir), device="cpu")
    cfg = AblateConfig(
        model=str(tiny_dir), text=_text(tmp_path), seq_len=16, n_natural=2, n_repeated=2, period=6, device="cpu"
    )
    r = ablate_core.run(model, cfg, progress=False)
    bound = math.log(json.loads((tiny_dir / "config.json").read_text())["vocab_size"])
    _, _, sets, _ = ablate_core._task_sets(model, r.config)
    want = {}
    for task, (tokens, first, _) in sets.items():
        with torch.no_grad():
            losses = {
                f"{layer}.{head}": float(
                    scored_loss(
                        model.forward(tokens, fwd_hooks=head_ablation_hooks([(layer, head)], "zero")), tokens, first
                    )
                    .double()
                    .mean()
                )
                for layer in range(model.spec.n_layers)
                for head in range(model.spec.n_heads)
            }
        if over := {h: x for h, x in losses.items() if x > bound}:
            want[task] = over
    assert want, "the tiny model's ablated losses were meant to cross ln(d_vocab)"
    summary, report = r.summary(), r.report()
    got = summary["ablated_loss_above_uniform"]
    assert got["ln_d_vocab"] == pytest.approx(bound, abs=1e-5)
    assert {t: {e["head"]: e["ablated_loss"] for e in hs} for t, hs in got["heads"].items()} == {
        t: pytest.approx(o, abs=1e-4) for t, o in want.items()
    }
    notes = [x for x in report.splitlines() if "above ln(vocabulary)" in x]
    assert len(notes) == 1 and f"= {bound:.2f} nats" in notes[0]
    assert all(f"{t} {len(o)} head" in notes[0] for t, o in want.items())
    # a vocabulary so large that no loss reaches ln(d_vocab): no key, no line, the rest unchanged
    r.spec = dataclasses.replace(r.spec, d_vocab=10**9)
    assert "ablated_loss_above_uniform" not in r.summary()
    assert [x for x in r.report().splitlines() if "above ln(vocabulary)" not in x] == [
        x for x in report.splitlines() if "above ln(vocabulary)" not in x
    ] and "above ln(vocabulary)" not in r.report()


@pytest.mark.parametrize("command", ["ablate", "prune"])
def test_a_text_the_tokenizer_does_not_know_is_said_in_ablate_and_prune(command, tmp_path, capsys):
    """walk-pipeline: the committed toy model knows only t0..t63, so the default natural text is all
    its unknown token; scan said so, ablate and prune printed natural losses and effects without a
    word: both say it in a NOTE and in summary.json's tokens.natural_untrusted, and a text of the
    model's own words is not flagged."""
    from pathlib import Path

    toy = Path(__file__).resolve().parents[1] / "figures" / "train-default"
    small = ["--model", str(toy), "--n-natural", "4", "--seq-len", "32", "--n-repeated", "4", "--period", "10"]
    assert main([command, *small, "--out", str(tmp_path / "unknown")]) == 0
    out = capsys.readouterr().out
    said = [line for line in out.splitlines() if line.startswith("NOTE: natural text: 100% of the text's tokens")]
    assert len(said) == 1 and "not a mechanism" in said[0], out
    summary = json.loads((tmp_path / "unknown" / "summary.json").read_text())
    assert summary["tokens"]["natural_untrusted"] == "100% of the text's tokens are unknown to the tokenizer"
    if command == "ablate":
        known = tmp_path / "known.txt"
        known.write_text(" ".join(f"t{i % 64}" for i in range(400)))
        assert main([command, *small, "--text", str(known), "--out", str(tmp_path / "known")]) == 0
        assert "unknown to the tokenizer" not in capsys.readouterr().out
        assert json.loads((tmp_path / "known" / "summary.json").read_text())["tokens"]["natural_untrusted"] is None
