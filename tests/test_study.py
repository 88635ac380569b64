"""headprobe study heads|layouts on tiny settings (a few steps): tables, figures, the cost columns."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from headprobe.cli import main
from headprobe.probe.core.io import OUTPUTS_NAME


def _tiny(which, out, extra=()):
    return main(
        [
            "study",
            which,
            "--out",
            str(out),
            "--steps",
            "2",
            "--eval-every",
            "2",
            "--seeds",
            "0",
            "--d-model",
            "16",
            "--device",
            "cpu",
            *extra,
        ]
    )


@pytest.mark.all_figure_formats  # checks the PDF/SVG files
def test_study_layouts(tmp_path):
    assert _tiny("layouts", tmp_path, ["--n-heads", "4", "--ranks", "2", "--rope", "2"]) == 0
    t = pd.read_csv(tmp_path / "results.csv")
    assert t["variant"].tolist() == ["MHA", "GQA 2 groups", "MQA", "MLA r=2"]
    # KV cache per token (bf16, 2 layers): 2 * n_kv_heads * d_head * 2 layers * 2 bytes; MLA (r + rope) * 2 * 2
    assert t["kv_bytes_per_token"].tolist() == [
        2 * 4 * 4 * 2 * 2,
        2 * 2 * 4 * 2 * 2,
        2 * 1 * 4 * 2 * 2,
        (2 + 2) * 2 * 2,
    ]
    s = json.loads((tmp_path / "study.json").read_text())
    assert s["mla_below_one_eighth"] is None  # 16 B is exactly 1/8 of MHA's 128 B, not below
    # integers as integers; MLA caches a latent, not per-head keys: no KV-head count for it
    rows = (tmp_path / "results.csv").read_text().splitlines()
    header = rows[0].split(",")
    cells = [dict(zip(header, r.split(","))) for r in rows[1:]]
    assert [c["kv_lora_rank"] for c in cells] == ["", "", "", "2"]
    assert [c["n_kv_heads"] for c in cells] == ["4", "2", "1", ""]
    assert (tmp_path / "quality_vs_kv.png").is_file() and (tmp_path / "quality_vs_kv.pdf").is_file()


@pytest.mark.figures
def test_study_heads(tmp_path):
    assert _tiny("heads", tmp_path, ["--n-heads-list", "1,2"]) == 0
    t = pd.read_csv(tmp_path / "results.csv")
    assert t["n_heads"].tolist() == [1, 2] and (t["attn_params_per_layer"] == 4 * 16 * 16).all()
    assert (tmp_path / "loss_vs_heads.png").is_file()
    # the default data: documentation text (character level, 96 characters + BOS) mixed with copies
    assert (t["corpus"] == "text+copy").all() and (t["model_params"] == t["model_params"].iloc[0]).all()
    s = json.loads((tmp_path / "study.json").read_text())
    assert s["base"]["corpus"] == "text+copy" and s["base"]["n_words"] == 96 and s["base"]["copy_fraction"] == 0.75


def test_study_copy_corpus(tmp_path):
    assert _tiny("heads", tmp_path, ["--n-heads-list", "2", "--corpus", "copy"]) == 0
    t = pd.read_csv(tmp_path / "results.csv")
    assert t["corpus"].tolist() == ["copy"] and t["text_in_context_loss"].isna().all()


@pytest.mark.parametrize(
    "which, extra, message",
    [
        ("heads", ["--seeds", "a"], "comma-separated"),
        ("layouts", ["--ranks", "0"], "positive"),
        ("heads", ["--n-heads-list", "3"], "not a multiple of n_heads=3"),
        # 16 heads of d_model 16 (d_head 1, which rotary positions cannot pair) died in rotate_half after
        # training the other variants
        ("heads", ["--n-heads-list", "8,16"], "the 16 heads variant cannot be built: rotary positions rotate pairs"),
        ("layouts", ["--rope", "3"], "--rope"),
        ("heads", ["--copy-fraction", "2"], "--copy-fraction"),
        # a duplicate seed trained the same model twice and reported a seed spread of 0
        ("heads", ["--seeds", "0,0"], "--seeds lists 0 more than once"),
        ("layouts", ["--ranks", "2,2"], "--ranks lists 2 more than once"),
        ("heads", ["--n-heads-list", "1,2,1"], "--n-heads-list lists 1 more than once"),
        # in study's own flags: study has no --max-period
        ("heads", ["--seq-len", "2"], "--seq-len must be at least 33"),
        ("heads", ["--seq-len", "32"], "--seq-len must be at least 33"),
        # the same words as --rope's own check: the models use rotary positions, so 0 is refused too
        ("layouts", ["--rope", "0"], "--rope must be an even positive integer"),
        # a flag of the other study, or of the other corpus, is refused rather than ignored
        ("heads", ["--ranks", "4"], "--ranks applies to study layouts only"),
        ("heads", ["--rope", "8"], "--rope applies to study layouts only"),
        ("heads", ["--n-heads", "4"], "--n-heads applies to study layouts only"),
        ("layouts", ["--n-heads-list", "2,4"], "--n-heads-list applies to study heads only"),
        ("heads", ["--corpus", "copy", "--copy-fraction", "0.5"], "--copy-fraction applies to --corpus text+copy only"),
    ],
)
def test_study_rejects_bad_input(tmp_path, capsys, which, extra, message):
    assert _tiny(which, tmp_path / "o", extra) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and message in err and not (tmp_path / "o").exists()
    assert "--max-period" not in err and "qk_rope_head_dim" not in err  # no setting study does not take


@pytest.mark.parametrize("which", ["heads", "layouts"])
@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--steps", "0", "--steps must be a positive integer, got 0"),
        ("--steps", "-3", "--steps must be a positive integer, got -3"),
        ("--eval-every", "0", "--eval-every must be a positive integer, got 0"),
        ("--batch-size", "0", "--batch-size must be a positive integer, got 0"),
        ("--d-model", "0", "--d-model must be a positive integer, got 0"),
        ("--lr", "0", "--lr must be a positive number, got 0.0"),
    ],
)
def test_a_shared_setting_is_refused_as_its_flag_not_as_a_variant(tmp_path, capsys, which, flag, value, message):
    """``study heads --steps 0`` said "the 1 heads variant cannot be built: --steps must be a positive
    integer": --steps is every variant's, not a property of one; it is refused as a bad flag value,
    one line, exit 2, before any variant is built and before the output folder."""
    assert _tiny(which, tmp_path / "o", [flag, value]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"headprobe: error: {message}" and not (tmp_path / "o").exists(), err


def test_api_study_matches_cli_and_trains_what_it_says(tmp_path, capsys):
    import dataclasses

    import headprobe
    import headprobe.commands.study as study_command
    from headprobe.analyses.train import train, training_tokenizer

    assert headprobe.study is study_command.study
    result = headprobe.study(
        "heads", steps=2, eval_every=2, seeds=[0, 1], d_model=16, n_heads_list=[1, 2], corpus="copy", device="cpu"
    )
    assert result.config.seeds == (0, 1) and result.config.n_heads_list == (1, 2)  # lists stored as tuples
    t = result.table
    assert isinstance(t, pd.DataFrame) and t["variant"].tolist() == ["1 heads", "1 heads", "2 heads", "2 heads"]
    assert t["seed"].tolist() == [0, 1, 0, 1]
    # an independent run of the same model: the study's row holds that run's last evaluation
    cfg = dataclasses.replace(result.config.base(), n_heads=2, seed=1)
    direct_run = train(cfg, training_tokenizer(cfg, tmp_path / "tok"))
    direct = direct_run.log.iloc[-1]
    row = t.iloc[3]
    for col in ("eval_loss", "in_context_loss", "repeated_loss", "max_induction", "max_previous_token"):
        assert row[col] == float(direct[col]), col
    from scipy import stats

    per_seq = direct_run.final_scores["induction_per_sequence"].reshape(-1, cfg.n_eval)  # [layer * head, sequence]
    top = per_seq[per_seq.mean(1).argmax()]  # the top head's scores; its lower bound by hand
    low = top.mean() - stats.t.ppf(0.975, cfg.n_eval - 1) * top.std(ddof=1) / np.sqrt(cfg.n_eval)
    assert row["induction_ci95_low"] == pytest.approx(low, abs=1e-6) and low < top.mean()

    assert (
        main(
            [
                "study",
                "heads",
                "--out",
                str(tmp_path / "cli"),
                "--steps",
                "2",
                "--eval-every",
                "2",
                "--seeds",
                "0,1",
                "--d-model",
                "16",
                "--n-heads-list",
                "1,2",
                "--corpus",
                "copy",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    capsys.readouterr()
    paths = result.save(tmp_path / "api")
    assert sorted(p.name for p in paths) == sorted(
        p.name for p in (tmp_path / "cli").iterdir() if p.name != OUTPUTS_NAME
    )
    cli = pd.read_csv(tmp_path / "cli" / "results.csv")
    api = pd.read_csv(tmp_path / "api" / "results.csv")
    pd.testing.assert_frame_equal(api.drop(columns="seconds"), cli.drop(columns="seconds"))

    def no_seconds(d):
        return {
            k: (
                {v: {c: x for c, x in r.items() if c != "seconds"} for v, r in d[k].items()}
                if k == "per_variant"
                else d[k]
            )
            for k in d
            if k not in ("timings_s", "command", "peak_memory")  # command: the CLI's words, null from Python
        }

    s_api, s_cli = (json.loads((tmp_path / d / "study.json").read_text()) for d in ("api", "cli"))
    assert no_seconds(s_api) == no_seconds(s_cli) and s_api["seeds"] == [0, 1] and s_api["n_heads_list"] == [1, 2]
    assert list(result.figures()) == ["loss_vs_heads"]


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(seeds=[-1]), "--seeds must list"),
        (dict(seeds=[1, 1]), "--seeds lists 1 more than once"),
        (dict(ranks=[4]), "--ranks applies to study layouts only"),
        (dict(rope=3), "--rope applies to study layouts only"),
        (dict(corpus="copy", copy_fraction=0.5), r"--copy-fraction applies to --corpus text\+copy only"),
        (dict(n_heads_list=[3]), "not a multiple"),
    ],
)
def test_api_study_rejects_bad_settings_before_training(fields, message):
    import headprobe
    from headprobe.probe.core.errors import HeadprobeError

    with pytest.raises(HeadprobeError, match=message):
        headprobe.study("heads", d_model=16, device="cpu", **fields)
    with pytest.raises(HeadprobeError, match="one of heads, layouts"):
        headprobe.study("layers")


def test_api_study_rejects_a_string_of_seeds():
    """A string is not a sequence of seeds: a HeadprobeError, or the runtime shape/type check's TypeError first
    when the tests run with jaxtyping's hook (the annotation says Sequence[int])."""
    import headprobe
    from headprobe.probe.core.errors import HeadprobeError

    with pytest.raises((HeadprobeError, TypeError), match="sequence of integers|seeds"):
        headprobe.study("heads", d_model=16, device="cpu", seeds="0,1")


def test_commands_do_not_import_each_other():
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, headprobe.commands.study; print('headprobe.commands.train' in sys.modules)",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "False"
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, headprobe.analyses.train; print(any(m.startswith('headprobe.commands') for m in sys.modules))",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "False"


def test_layouts_without_mla_and_a_plan_before_the_first_run(tmp_path, capsys):
    """A class comparing MHA, GQA and MQA trained an MLA variant per seed too (``--ranks ""`` was refused), and
    ``study`` printed nothing until its first run ended (up to 1.5 min on a laptop): ``--ranks none`` leaves MLA
    out, and the run count and names come first, then each run's line with how many are done and left."""
    assert _tiny("layouts", tmp_path, ["--n-heads", "4", "--ranks", "none"]) == 0
    out = capsys.readouterr().out.splitlines()
    t = pd.read_csv(tmp_path / "results.csv")
    assert t["variant"].tolist() == ["MHA", "GQA 2 groups", "MQA"] and t["kv_lora_rank"].isna().all()
    assert (
        out[0]
        == "training 3 runs (3 variants x 1 seed: MHA, GQA 2 groups, MQA), 2 steps each; one line as each run ends"
    )
    ends = [line.rsplit("(", 1)[1] for line in out[1:4]]
    assert [e.split("; ")[1].split(",")[0].rstrip(")") for e in ends] == ["1/3", "2/3", "3/3"]
    assert "left" in ends[0] and "left" not in ends[2]
    s = json.loads((tmp_path / "study.json").read_text())
    assert (
        s["mla_below_one_eighth"] is None and s["mla_below_one_eighth_null_reason"] == "no MLA variant (--ranks none)"
    )
    assert s["config"]["ranks"] == []


@pytest.mark.figures
def test_layouts_figure_labels_do_not_overlap(tmp_path):
    """The default layouts study puts MQA and MLA r=8 at the same KV cache (64 B/token) with nearly
    the same loss: their labels, and every other pair, must not cover each other."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from headprobe.analyses import figures

    labels = ["MHA", "GQA 4 groups", "GQA 2 groups", "MQA", "MLA r=4", "MLA r=6", "MLA r=8", "MLA r=16"]
    kv = np.array([512, 256, 128, 64, 48, 56, 64, 96], dtype=float)
    loss = np.array([2.85, 2.87, 2.89, 2.908, 2.95, 2.93, 2.906, 2.88])
    fig = figures.quality_vs_kv(labels, kv, loss, loss - 0.01, loss + 0.01, "8 heads", formed=loss < 2.9)
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    boxes = {t.get_text(): t.get_window_extent(renderer) for t in fig.axes[0].texts}
    assert sorted(boxes) == sorted(labels)
    clashes = [(a, b) for i, a in enumerate(labels) for b in labels[i + 1 :] if boxes[a].overlaps(boxes[b])]
    assert clashes == []
    fig.savefig(tmp_path / "quality_vs_kv.png", dpi=200)


def test_study_records_the_device_it_used():
    """``device="auto"`` is resolved: study.json and every results.csv row name the device that trained."""
    import headprobe
    from headprobe.probe.backends.loading import device_auto

    result = headprobe.study(
        "heads", steps=2, eval_every=2, seeds=[0], d_model=16, n_heads_list=[2], corpus="copy", device="auto"
    )
    assert result.config.device == "auto"
    assert result.table["device"].tolist() == [device_auto("auto")]
    assert result.summary()["device"] == device_auto("auto")


def test_study_json_records_the_cpu_threads_and_kernels():
    """float32 training on the CPU depends on torch's thread count and vector kernels (1200 steps
    move the losses in the 4th decimal), so study.json names the ones its runs used."""
    import torch

    import headprobe

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        result = headprobe.study(
            "heads", steps=2, eval_every=2, seeds=[0], d_model=16, n_heads_list=[2], corpus="copy", device="cpu"
        )
        s = result.summary()
    finally:
        torch.set_num_threads(before)
    assert s["cpu_threads"] == 1
    assert s["cpu_capability"] in {"DEFAULT", "AVX2", "AVX512", "NEON", "SVE256", "ZVECTOR", "VSX"}
    assert s["cpu_capability"] == torch.backends.cpu.get_cpu_capability()


def test_layouts_figure_fills_a_marker_by_study_json_rule(monkeypatch):
    """A marker is filled when some head's induction score passed 0.5 in every seed (study.json's
    ``induction_formed`` takes the minimum over seeds), not when the mean over seeds did."""
    import headprobe.commands.study_core as study_command

    seen = {}
    monkeypatch.setattr(study_command.figures, "quality_vs_kv", lambda *a, **kw: seen.update(kw))
    table = pd.DataFrame(
        {
            "variant": ["MHA", "MHA", "MQA", "MQA"],
            "seed": [0, 1, 0, 1],
            "corpus": "copy",
            "kv_bytes_per_token": [128, 128, 32, 32],
            "eval_loss": [3.0, 3.1, 3.2, 3.3],
            "max_induction": [0.9, 0.2, 0.7, 0.6],  # MHA: mean 0.55, minimum 0.2
            "in_context_loss": [1.0, 1.1, 1.2, 1.3],
            "seconds": 1.0,
        }
    )
    study_command.study_figure("layouts", table, "t")
    in_every_seed = table.groupby("variant", sort=False)["max_induction"].apply(lambda x: all(x > 0.5))
    assert seen["formed"].tolist() == in_every_seed.tolist() == [False, True]
    # a results.csv with the top head's lower bound: MQA's scores pass 0.5 but seed 1's bound does not
    study_command.study_figure("layouts", table.assign(induction_ci95_low=[0.8, 0.1, 0.6, 0.45]), "t")
    assert seen["formed"].tolist() == [False, False]


def test_d_model_says_its_default_in_help(capsys):
    """docs/study.md gives d_model 64; ``study heads --help`` must say it (``--d-model`` had no help)."""
    from headprobe.commands.study import StudyConfig

    assert main(["study", "heads", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    entry = text.split("--d-model", 2)[2].split(" --", 1)[0]  # the option's own entry, after the usage line
    assert f"default {StudyConfig.__dataclass_fields__['d_model'].default}" in entry, entry


@pytest.mark.figures
@pytest.mark.parametrize("seeds", [1, 2])
def test_the_layouts_legend_names_induction_and_speaks_of_bars_only_over_seeds(seeds):
    """quality_vs_kv.png of a 1-seed study said "bars: seed range" with no bar drawn, and "not in every seed"
    without naming what (an induction head). The legend names induction in both entries and gives the bars
    (and "every"/"some seed") only where results.csv holds 2+ seeds."""
    import pandas as pd

    from headprobe.commands.study_core import study_figure

    rows = [
        {
            "variant": v,
            "kv_bytes_per_token": kv,
            "eval_loss": 2.9 + 0.01 * s + 0.02 * i,
            "max_induction": ind,
            "in_context_loss": 1.0,
            "seconds": 1.0,
            "seed": s,
        }
        for i, (v, kv, ind) in enumerate([("MHA", 512, 0.9), ("MQA", 64, 0.2)])
        for s in range(seeds)
    ]
    table = pd.DataFrame(rows).assign(corpus="text+copy")
    _, fig = study_figure("layouts", table, "8 heads")
    (legend,) = fig.legends  # below both panels
    texts = [t.get_text() for t in legend.get_texts()]
    assert len(texts) == 2 and all("induction" in t for t in texts), texts
    title = legend.get_title().get_text()
    bars = [c for c in fig.axes[0].collections if len(c.get_segments())]
    if seeds == 1:
        assert title == "" and not any("seed" in t for t in texts) and not bars, (title, texts)
    else:
        assert title == "bars: range over 2 seeds" and "in every seed" in texts[0] and "in some seed" in texts[1]
        assert bars


def _layouts_table(seeds, mha, mla, mha_ic, mla_ic):
    """A hand-made layouts results table: MHA (128 B/token) and one MLA rank below 1/8 of it (8 B)."""
    n = len(seeds)
    return pd.DataFrame(
        {
            "variant": ["MHA"] * n + ["MLA r=2"] * n,
            "seed": [*seeds, *seeds],
            "kv_bytes_per_token": [128] * n + [8] * n,
            "eval_loss": [*mha, *mla],
            "in_context_loss": [*mha_ic, *mla_ic],
            "max_induction": [0.9] * (2 * n),
            "seconds": 1.0,
        }
    )


def test_the_mla_gap_carries_the_interval_of_its_paired_seed_gaps():
    """mla_below_one_eighth's gaps come with the 95% Student-t interval of the seed-by-seed paired
    gaps (scipy's t.interval as reference; it carried MHA's seed sd only), over "seeds", and say the
    variant was picked on the same evaluations; one seed gives null and the reason."""
    from scipy import stats

    from headprobe.commands.study_core import headline

    mha, mla = [3.00, 3.20, 3.05], [3.10, 3.24, 3.21]
    mha_ic, mla_ic = [1.0, 1.3, 1.1], [1.4, 1.2, 1.6]
    got = headline("layouts", _layouts_table([0, 1, 2], mha, mla, mha_ic, mla_ic))["mla_below_one_eighth"]
    for key, a, b in (("loss_gap_vs_mha", mla, mha), ("in_context_loss_gap_vs_mha", mla_ic, mha_ic)):
        gaps = np.subtract(a, b)
        want = stats.t.interval(0.95, len(gaps) - 1, loc=gaps.mean(), scale=stats.sem(gaps))
        np.testing.assert_allclose(got[f"{key}_ci95"], want, atol=1e-4, err_msg=key)
        assert got[key] == pytest.approx(gaps.mean(), abs=1e-4)
    assert got["n_paired_seeds"] == 3 and "seeds" in got["interval_rule"]
    assert "same evaluations" in got["selection"]
    one = headline("layouts", _layouts_table([0], mha[:1], mla[:1], mha_ic[:1], mla_ic[:1]))["mla_below_one_eighth"]
    assert one["loss_gap_vs_mha_ci95"] is None and one["in_context_loss_gap_vs_mha_ci95"] is None
    assert "2 seeds" in one["ci95_null_reason"]


def test_study_report_gives_the_seed_spread_where_there_are_two_seeds():
    """report() prints each variant's seed sd beside its mean (numpy's ddof=1 sd as reference) where
    there are 2+ seeds, and no sd column from one seed."""
    from headprobe.commands.study import StudyConfig
    from headprobe.commands.study_core import StudyResult

    mha, mla = [3.00, 3.20, 3.05], [3.10, 3.24, 3.21]
    table = _layouts_table([0, 1, 2], mha, mla, [1.0, 1.3, 1.1], [1.4, 1.2, 1.6])
    text = StudyResult(StudyConfig("layouts"), table).report()
    assert "eval_loss_sd" in text and "in_context_loss_sd" in text, text
    mha_row = next(line for line in text.splitlines() if line.startswith("MHA"))
    assert f"{np.std(mha, ddof=1):.3f}" in mha_row.split(), text
    one = StudyResult(StudyConfig("layouts"), _layouts_table([0], mha[:1], mla[:1], [1.0], [1.4])).report()
    assert "_sd" not in one, one


def test_a_study_where_no_variant_formed_induction_says_so():
    """walk-paper's 200-step study printed its table (and an MLA-vs-MHA headline) with no word that no
    model had an induction head yet; now a NOTE says it, naming the steps. One variant formed in one
    seed: no NOTE."""
    from headprobe.commands.study import StudyConfig
    from headprobe.commands.study_core import StudyResult

    mha, mla = [3.00, 3.20], [3.10, 3.24]
    table = _layouts_table([0, 1], mha, mla, [1.0, 1.3], [1.4, 1.2]).assign(max_induction=0.2)
    text = StudyResult(StudyConfig("layouts", steps=200), table).report()
    note = [line for line in text.splitlines() if line.startswith("NOTE:")]
    assert len(note) == 1 and "no variant formed an induction head in any seed" in note[0], text
    assert "in 200 steps" in note[0] and "train longer" in note[0], note
    table.loc[1, "max_induction"] = 0.8
    assert "NOTE" not in StudyResult(StudyConfig("layouts", steps=200), table).report()


@pytest.mark.figures
def test_the_layouts_figure_shows_in_context_loss_beside_text_loss():
    """quality_vs_kv.png plotted held-out text loss only: MQA, which formed no induction head (in-context loss
    -0.79 where the others read -4.4), was its lowest point, "best at 1/8 of the cache". A second panel
    shows each variant's mean in-context loss (results.csv's, by a groupby here) at the same KV cache, its
    seed range as bars, and every point's label lies inside its own panel."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from headprobe.commands.study_core import study_figure

    rows = [
        {"variant": v, "kv_bytes_per_token": kv, "eval_loss": loss + 0.01 * s, "max_induction": ind,
         "in_context_loss": icl - 0.1 * s, "seconds": 1.0, "seed": s}
        for v, kv, loss, ind, icl in [
            ("MHA", 512, 2.52, 0.9, -4.5), ("GQA 2 groups", 128, 2.70, 0.9, -4.35),
            ("MQA", 64, 2.52, 0.2, -0.79), ("MLA r=16", 96, 2.60, 0.9, -4.37),
        ]
        for s in (0, 1)
    ]  # fmt: skip
    table = pd.DataFrame(rows).assign(corpus="text+copy")
    _, fig = study_figure("layouts", table, "8 heads")
    assert len(fig.axes) == 2 and "in-context" in fig.axes[1].get_ylabel()
    means = table.groupby("variant", sort=False)[["kv_bytes_per_token", "in_context_loss"]].mean()
    drawn = np.concatenate([c.get_xydata() for c in fig.axes[1].lines if len(c.get_xydata()) and c.get_marker() == "o"])
    assert sorted(map(tuple, drawn.round(6))) == sorted(map(tuple, means.to_numpy().round(6)))
    bars = [c for c in fig.axes[1].collections if len(c.get_segments())]
    assert bars and max(abs(seg[1][1] - seg[0][1]) for c in bars for seg in c.get_segments()) == pytest.approx(0.1)
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    for ax in fig.axes:
        frame = ax.get_window_extent(canvas.get_renderer())
        for t in ax.texts:
            box = t.get_window_extent(canvas.get_renderer())
            assert frame.y0 <= box.y0 and box.y1 <= frame.y1, t.get_text()
