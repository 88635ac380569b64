"""headprobe train: tiny runs (a few steps, d_model 16) for loss, reproducibility, checkpoint
round trip and CLI errors. The real phase-change run is the default CLI run (minutes), not a test."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pandas as pd
import pytest
import torch
from zoo import tiny_train_flags

from headprobe.analyses.train import TrainConfig, copy_sequences, in_context_loss, phase_change_interval, train
from headprobe.cli import main
from headprobe.commands.train import run
from headprobe.probe.core.io import OUTPUTS_NAME

TINY = TrainConfig(
    n_layers=2,
    d_model=16,
    n_heads=2,
    n_words=16,
    seq_len=33,
    min_period=4,
    max_period=12,
    batch_size=8,
    steps=30,
    lr=3e-3,
    warmup=1,
    eval_every=10,
    n_eval=8,
    eval_period=8,
    device="cpu",
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from headprobe.probe.model.tokenizers import word_level_tokenizer

    return word_level_tokenizer(tmp_path_factory.mktemp("tok16"), TINY.n_words)


@pytest.fixture(scope="module")
def tiny_run():
    return run(TINY)  # the command's run: its own tokenizer, a TrainResult that can save itself


def test_copy_sequences_repeat_and_are_deterministic():
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    x = copy_sequences(16, 41, 10, 3, 6, g1, periodic=True)
    assert torch.equal(x, copy_sequences(16, 41, 10, 3, 6, g2, periodic=True))
    assert x.shape == (16, 41) and (x[:, 0] == 10).all() and (x[:, 1:] < 10).all()
    for row in x[:, 1:]:  # the tail is periodic with some period in [3, 6], at least two whole copies
        assert any(torch.equal(row[-2 * S : -S], row[-S:]) for S in range(3, 7))
    y = copy_sequences(64, 41, 1000, 5, 5, torch.Generator().manual_seed(4))
    for row in y[:, 1:].tolist():  # one segment of 5 reappears: some window of 5 occurs twice, non-overlapping
        windows = [tuple(row[i : i + 5]) for i in range(len(row) - 4)]
        assert any(windows[j] == windows[i] for i in range(len(windows)) for j in range(i + 5, len(windows)))


def test_training_decreases_loss(tiny_run):
    log = tiny_run.log
    assert log["step"].tolist() == [0, 10, 20, 30]
    assert log["train_loss"].iloc[-1] < log["train_loss"].iloc[1]
    assert log["eval_loss"].iloc[-1] < log["eval_loss"].iloc[0]
    head_cols = [c for c in log.columns if c.startswith("induction_")]
    assert head_cols == ["induction_0.0", "induction_0.1", "induction_1.0", "induction_1.1"]
    assert tiny_run.final_scores["induction"].shape == (2, 2)


def test_seeded_runs_are_identical(tiny_run, tokenizer):
    again = train(dataclasses.replace(TINY, steps=10), tokenizer)
    cols = [c for c in again.log.columns]
    np.testing.assert_array_equal(again.log[cols].to_numpy(), tiny_run.log[cols].iloc[:2].to_numpy())
    other = train(dataclasses.replace(TINY, steps=10, seed=1), tokenizer)
    assert not np.array_equal(other.log["train_loss"].to_numpy()[1:], again.log["train_loss"].to_numpy()[1:])


def test_gqa_run(tokenizer):
    r = train(dataclasses.replace(TINY, n_heads=4, n_kv_heads=2, steps=2, eval_every=2), tokenizer)
    assert r.loaded.spec.kind == "GQA" and r.loaded.model.blocks[0].attn.k_proj.out_features == 2 * 4


@pytest.mark.all_figure_formats  # checks the PDF/SVG files
def test_checkpoint_reloads_with_same_logits(tiny_run, tmp_path):
    from headprobe.probe.backends.loading import load_model

    tiny_run.save(tmp_path)
    for name in ("train_log.csv", "summary.json", "config.json", "headprobe_model.pt", "training.png", "training.pdf"):
        assert (tmp_path / name).is_file(), name
    loaded = load_model(str(tmp_path))
    assert loaded.spec.kind == "MHA" and loaded.model.cfg == tiny_run.loaded.model.cfg
    tokens = copy_sequences(4, TINY.seq_len, TINY.n_words, 4, 12, torch.Generator().manual_seed(9))
    with torch.no_grad():
        torch.testing.assert_close(loaded.forward(tokens), tiny_run.loaded.forward(tokens), rtol=0, atol=0)
    assert loaded.to_tokens("t3 t5")[0, 0].item() == TINY.n_words  # BOS from the saved tokenizer
    from headprobe.probe.core.errors import HeadprobeError

    with pytest.raises(HeadprobeError, match="native"):
        load_model(str(tmp_path), backend="transformer-lens")
    (tmp_path / "headprobe_model.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(HeadprobeError, match="cannot load headprobe checkpoint"):
        load_model(str(tmp_path))


def test_scan_reads_the_checkpoint(tiny_run, tmp_path):
    from headprobe.commands.scan import ScanConfig, run_scan
    from headprobe.probe.backends.loading import load_model

    tiny_run.save(tmp_path)
    cfg = ScanConfig(
        model=str(tmp_path), n_natural=2, seq_len=16, n_repeated=2, period=8, k=2, n_random=2, device="cpu"
    )
    result = run_scan(cfg, model=load_model(str(tmp_path)))
    assert len(result.table) == 4


def test_in_context_loss_and_phase_step():
    losses = torch.cat([torch.full((2, 20), 3.0), torch.full((2, 80), 1.0)], dim=1)
    assert in_context_loss(losses) == pytest.approx(-2.0)
    steps = np.arange(0, 1000, 100)
    icl = np.where(steps < 500, 0.0, -2.0)
    assert phase_change_interval(steps, icl)[1] in (400, 500, 600)
    assert phase_change_interval(steps[:2], icl[:2]) is None
    formed = np.where(steps < 500, 0.05, 0.8)  # induction scores that cross 0.5 with the drop
    assert phase_change_interval(steps, icl, formed)[1] in (400, 500, 600)
    assert phase_change_interval(steps, icl, np.full(len(steps), 0.05)) is None  # a loss drop without induction heads


def test_cli_reports_no_phase_change_without_induction_and_counts_its_files(tmp_path, capsys):
    from headprobe.cli import main

    out = tmp_path / "t"
    assert (
        main(
            [
                "train",
                "--out",
                str(out),
                *tiny_train_flags(20, 10),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    # before training, one line says what trains and when the first progress line comes (none did: tens of
    # silent seconds on a busy CPU before step eval_every's line); its numbers are the run's config
    c = summary["config"]
    assert text.splitlines()[0] == (
        f"training {c['n_layers']} layers x 2 heads (2 KV heads), d_model 16, on {c['corpus']} data: 20 steps of "
        f"{c['batch_size']} x 33 tokens; a line every 10 steps"
    )
    assert summary["phase_change_step"] is None and "no phase change yet" in text and "None" not in text
    # the number beside the top head says what it is, and is summary.json's score
    final = summary["final"]
    head, score = final["top_induction_head"], final["top_induction_score"]
    assert f"top induction head {head} (layer.head), induction score {score:.2f};" in text
    n_files = len([p for p in out.iterdir() if p.is_file() and not p.name.startswith(".")])  # not the file list
    assert f"wrote {n_files} files" in text
    # each evaluation's line printed "in-context -4.145", a negative "loss" defined nowhere on the console: it
    # now reads as the figure's legend, "in-context loss (late − early)", with train_log.csv's value
    log = pd.read_csv(out / "train_log.csv").set_index("step")
    steps = [ln for ln in text.splitlines() if ln.startswith("step ")]
    assert steps, text
    for line in steps:
        icl = log.loc[int(line.split()[1]), "in_context_loss"]
        assert f"  in-context loss (late - early) {icl:+.3f}  " in line, line
    assert f"in-context loss (late - early) {final['in_context_loss']:+.3f} [" in text


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "0"], "--steps must be a positive integer"),
        (["--n-heads", "3"], "not a multiple of n_heads=3"),
        (["--n-kv-heads", "3"], "not a multiple of n_kv_heads=3"),
        (["--max-period", "60"], "does not fit twice"),
        (["--lr", "-1"], "--lr must be a positive number"),
        # one sequence gives no interval: it was refused as "training diverged at step 0" after the model was built
        (["--n-eval", "1"], "--n-eval must be at least 2"),
        (["--device", "cuda"], None),
        # copy sequences alone have no text to mix them with: refused, as study refuses it, not ignored
        (["--copy-fraction", "0.3"], "--copy-fraction applies to --corpus text+copy only, not to --corpus copy"),
        (
            ["--corpus", "text+copy", "--n-words", "96", "--copy-fraction", "2"],
            "--copy-fraction must be between 0 and 1",
        ),
    ],
)
def test_cli_rejects_bad_input(argv, message, tmp_path, capsys):
    if message is None:
        if torch.cuda.is_available():
            pytest.skip("a GPU is present")
        message = "no CUDA GPU"
    assert (
        main(
            ["train", "--out", str(tmp_path / "out"), "--steps", "1", *argv]
            if "--steps" not in argv
            else ["train", "--out", str(tmp_path / "out"), *argv]
        )
        == 2
    )
    out, err = capsys.readouterr()
    err = err.strip()
    assert err.count("\n") == 0 and message in err
    assert out == ""  # refused before the plan line ("training 2 layers x 4 heads ..."), as other commands
    assert not (tmp_path / "out").exists()


def test_copy_fraction_is_the_text_corpus_setting_and_refused_elsewhere():
    """``--copy-fraction`` sets a text+copy batch's share of copy sequences (0.5 when not given);
    with copy sequences alone it would do nothing: headprobe.train and TrainConfig.validate refuse
    it in one line, as study does, where it was taken and ignored."""
    import headprobe
    from headprobe.cli import build_parser
    from headprobe.commands.train import config_from_args
    from headprobe.probe.core.errors import HeadprobeError

    def flags(*argv):
        return config_from_args(build_parser().parse_args(["train", "--out", "o", *argv]))

    assert flags("--corpus", "text+copy", "--n-words", "96", "--copy-fraction", "0.25").copy_fraction == 0.25
    assert flags("--corpus", "text+copy", "--n-words", "96").copy_fraction == 0.5
    assert flags().copy_fraction is None  # corpus copy: no fraction, and summary.json records none
    with pytest.raises(HeadprobeError) as e:
        headprobe.train(corpus="copy", copy_fraction=0.3, steps=1, device="cpu")
    # the message as the command line prints it; Python's note (which pytest's match= reads too) below
    assert str(e.value) == "--copy-fraction applies to --corpus text+copy only, not to --corpus copy"
    assert e.value.__notes__ == ["in Python: --copy-fraction is copy_fraction=, --corpus is corpus="]
    with pytest.raises(HeadprobeError, match=r"--copy-fraction applies to --corpus text\+copy only"):
        dataclasses.replace(TEXT, corpus="copy", n_words=64).validate()


def test_a_warmup_longer_than_the_run_is_refused(tmp_path, capsys, monkeypatch):
    """The schedule's multiplier at step k (0-based) is ``min(1, (k+1)/warmup)``: the peak --lr is
    reached at step --warmup, so --warmup > --steps never reaches it (was accepted). Refused in one
    line before a model is built; not given, the warm-up is ``min(50, steps)``."""
    import headprobe.analyses.train as tr
    from headprobe.analyses.train import _optimizer

    def lrs(warmup: int, steps: int) -> list[float]:  # the learning rates the steps run with
        opt, sched = _optimizer(dataclasses.replace(TINY, warmup=warmup, steps=steps), torch.nn.Linear(1, 1))
        out = []
        for _ in range(steps):
            out.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        return out

    assert lrs(5, 5)[-1] == TINY.lr and max(lrs(6, 5)) < TINY.lr  # the exact condition: warmup <= steps
    monkeypatch.setattr(tr, "_untrained_model", lambda *a, **k: pytest.fail("a model was built"))
    out = tmp_path / "out"
    assert main(["train", "--out", str(out), *tiny_train_flags(5, 5), "--warmup", "100"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--warmup 100" in err and "--steps 5" in err and "Traceback" not in err
    assert not out.exists()
    assert TrainConfig(steps=5).warmup == 5 and TrainConfig(steps=500).warmup == 50
    TrainConfig(steps=5, warmup=5).validate()


def test_cli_refuses_non_empty_out(tmp_path, capsys):
    (tmp_path / "x").write_text("keep")
    assert main(["train", "--out", str(tmp_path), "--steps", "1"]) == 2
    assert "--overwrite" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# corpus="text+copy": natural text (CPython documentation, character level) mixed with copies
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus():
    from headprobe.analyses.train import text_corpus

    return text_corpus()


@pytest.fixture(scope="module")
def char_tokenizer(tmp_path_factory):
    from headprobe.probe.model.tokenizers import char_level_tokenizer

    return char_level_tokenizer(tmp_path_factory.mktemp("chars"))


def _decode(ids) -> str:
    from headprobe.probe.model.tokenizers import TEXT_CHARS

    return "".join(TEXT_CHARS[i] for i in ids.tolist())


def test_char_tokenizer_matches_lookup_and_round_trips(corpus, char_tokenizer):
    from headprobe.analyses.data import ascii_text
    from headprobe.analyses.train import char_ids

    text = _decode(corpus.held_out[:5000])
    hf = char_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert hf == corpus.held_out[:5000].tolist() == char_ids(text).tolist()
    assert char_tokenizer.decode(hf) == text  # no spaces inserted, whitespace kept
    assert char_tokenizer.bos_token_id == 96 and len(char_tokenizer) == 97
    assert ascii_text("\u201cit\u2019s\u201d \u2014 caf\u00e9\u2026\tx") == '"it\'s" -- caf?...    x'


def test_text_split_is_by_topic_and_disjoint(corpus):
    from headprobe.analyses.data import ascii_text, pydoc_topics

    topics = pydoc_topics()
    assert corpus.held_out_topics and corpus.train_topics
    assert set(corpus.held_out_topics).isdisjoint(corpus.train_topics)
    assert set(corpus.held_out_topics) | set(corpus.train_topics) == set(topics)
    train_text, held_text = _decode(corpus.train), _decode(corpus.held_out)
    assert held_text == ascii_text("\n\n".join(topics[k] for k in corpus.held_out_topics))
    assert 0.05 < len(held_text) / (len(held_text) + len(train_text)) < 0.3
    # pydoc's topics quote each other; the shared paragraphs are dropped from training, leaving only
    # paragraphs that differ slightly (6 of 249 are contained in training text, 0.3% of it)
    held_pars = [p for k in corpus.held_out_topics for p in ascii_text(topics[k]).split("\n\n") if len(p) > 80]
    leaked = [p for p in held_pars if p in train_text]
    assert len(held_pars) > 50 and sum(map(len, leaked)) < 0.01 * len(train_text)


def test_text_windows_decode_to_the_source(corpus):
    from headprobe.analyses.train import held_out_text_windows, text_windows

    train_text = _decode(corpus.train)
    x = text_windows(corpus.train, 16, 50, 96, torch.Generator().manual_seed(0))
    assert x.shape == (16, 50) and (x[:, 0] == 96).all() and (x[:, 1:] < 96).all()
    for row in x[:, 1:]:
        assert _decode(row) in train_text
    h = held_out_text_windows(corpus.held_out, 8, 50, 96, seed=1)
    held_text = _decode(corpus.held_out)
    starts = [held_text.index(_decode(row)) for row in h[:, 1:]]
    assert all(s % 49 == 0 for s in starts) and starts == sorted(set(starts))  # aligned, distinct, in order
    assert torch.equal(h, held_out_text_windows(corpus.held_out, 8, 50, 96, seed=1))


@pytest.mark.parametrize("fraction", [0.0, 0.25, 0.5, 1.0])
def test_mixed_batch_fraction_and_determinism(corpus, fraction):
    from headprobe.analyses.train import mixed_batch

    def batch(seed):
        return mixed_batch(20, 41, corpus.train, 96, 4, 8, fraction, torch.Generator().manual_seed(seed))

    x, is_copy = batch(5)
    assert x.shape == (20, 41) and (x[:, 0] == 96).all() and int(is_copy.sum()) == round(20 * fraction)
    train_text = _decode(corpus.train)
    for row, copy in zip(x[:, 1:], is_copy.tolist()):
        periodic_tail = any(torch.equal(row[-2 * S : -S], row[-S:]) for S in range(4, 9))
        if copy:
            assert periodic_tail
        else:
            assert _decode(row) in train_text
    y, y_copy = batch(5)
    assert torch.equal(x, y) and torch.equal(is_copy, y_copy)
    if 0 < fraction < 1:
        assert not torch.equal(x, batch(6)[0])


TEXT = dataclasses.replace(TINY, n_words=96, corpus="text+copy", steps=20, eval_every=10)


def test_text_copy_run_logs_text_loss(char_tokenizer, tokenizer):
    r = train(TEXT, char_tokenizer)
    log = r.log
    assert log["step"].tolist() == [0, 10, 20] and "text_in_context_loss" in log.columns
    assert log["eval_loss"].iloc[-1] < log["eval_loss"].iloc[0] < 5.0  # nats on held-out text; ln 97 = 4.57
    again = train(dataclasses.replace(TEXT, steps=10), char_tokenizer)
    np.testing.assert_array_equal(again.log.to_numpy(), log.iloc[:2].to_numpy())
    from headprobe.probe.core.errors import HeadprobeError

    with pytest.raises(HeadprobeError, match="character-level tokenizer"):
        train(TEXT, tokenizer)
    with pytest.raises(HeadprobeError, match="--n-words must be 96"):
        train(dataclasses.replace(TEXT, n_words=64), char_tokenizer)


# --------------------------------------------------------------------------------------------
# The Python API: headprobe.train(...) is the CLI without the flags
# --------------------------------------------------------------------------------------------

API = dict(
    d_model=16,
    n_heads=2,
    n_kv_heads=1,
    n_words=16,
    seq_len=33,
    max_period=12,
    eval_period=8,
    n_eval=8,
    steps=20,
    eval_every=10,
    seed=3,
    periodic=False,
    device="cpu",
)
API_FLAGS = [
    "--d-model",
    "16",
    "--n-heads",
    "2",
    "--n-kv-heads",
    "1",
    "--n-words",
    "16",
    "--seq-len",
    "33",
    "--max-period",
    "12",
    "--eval-period",
    "8",
    "--n-eval",
    "8",
    "--steps",
    "20",
    "--eval-every",
    "10",
    "--seed",
    "3",
    "--data",
    "pair",
    "--device",
    "cpu",
]


@pytest.mark.all_figure_formats  # checks the PDF/SVG files
def test_api_train_matches_cli(tmp_path, capsys):
    import headprobe
    import headprobe.commands.train as train_command

    assert headprobe.train is train_command.train  # the lazy export is the command's function
    result = headprobe.train(**API)
    assert isinstance(result.log, pd.DataFrame) and result.log["step"].tolist() == [0, 10, 20]
    assert main(["train", "--out", str(tmp_path / "cli"), *API_FLAGS]) == 0
    capsys.readouterr()
    cli_log = (tmp_path / "cli" / "train_log.csv").read_text()
    assert result.log.to_csv(index=False, float_format="%.5f") == cli_log  # the same numbers, as the CLI wrote them

    paths = result.save(tmp_path / "api")
    api, cli = tmp_path / "api", tmp_path / "cli"
    names = sorted(p.name for p in cli.iterdir() if p.name != OUTPUTS_NAME)
    assert sorted(p.name for p in api.iterdir() if p.name != OUTPUTS_NAME) == names == sorted(p.name for p in paths)
    for name in names:
        if name.endswith((".csv", ".png", ".pdf")) or name.startswith("tokenizer") or name == "config.json":
            assert (api / name).read_bytes() == (cli / name).read_bytes(), name
    ours, theirs = (torch.load(d / "headprobe_model.pt", weights_only=True) for d in (api, cli))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    s_api, s_cli = (json.loads((d / "summary.json").read_text()) for d in (api, cli))
    assert s_api.pop("command") is None and s_cli.pop("command") == ["train", "--out", str(cli), *API_FLAGS]
    assert (
        s_api.pop("timings_s")["train_s"] >= 0 and s_cli.pop("timings_s")["train_s"] >= 0
    )  # wall time differs, and the process's peak memory, nothing else
    assert s_api.pop("peak_memory") and s_cli.pop("peak_memory")
    volatile = ("timings_s", "command", "peak_memory")
    assert s_api == s_cli and s_api == {k: v for k, v in result.summary().items() if k not in volatile}
    assert s_api["config"]["periodic"] is False and s_api["config"]["n_kv_heads"] == 1 and s_api["layout"] == "MQA"
    # summary.json is written last: a directory holding it is complete
    assert (
        max(p.stat().st_mtime_ns for p in api.iterdir() if p.name != OUTPUTS_NAME)
        == (api / "summary.json").stat().st_mtime_ns
    )
    from headprobe.probe.core.errors import HeadprobeError

    with pytest.raises(HeadprobeError, match="--overwrite"):
        result.save(api)
    result.save(api, overwrite=True)
    with pytest.raises(TypeError):
        headprobe.train(stepz=3)
    with pytest.raises(TypeError):
        headprobe.train(TINY)  # a config goes to headprobe.commands.train.run, fields to headprobe.train
    with pytest.raises(HeadprobeError, match="--steps must be a positive integer"):
        headprobe.train(steps=0)
    with pytest.raises(HeadprobeError, match="--device must be one of auto, cpu, cuda"):
        headprobe.train(device="gpu")
    cfg = train_command.TrainConfig(**API)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.steps = 3


def test_training_module_neither_prints_nor_parses(tokenizer, capsys):
    import headprobe.analyses.train as training

    seen = []
    r = training.train(
        dataclasses.replace(TINY, steps=4, eval_every=2),
        tokenizer,
        on_eval=lambda row, seconds: seen.append((row["step"], row["train_loss"], seconds)),
    )
    assert capsys.readouterr().out == ""
    assert [s for s, _, _ in seen] == [2, 4] and [x for _, x, _ in seen] == r.log["train_loss"].tolist()[1:]
    assert all(sec >= 0 for _, _, sec in seen)
    src = open(training.__file__, encoding="utf-8").read()
    assert "import argparse" not in src and "print(" not in src


def test_tokenizers_and_checkpoint_format_live_outside_loading():
    """Training tokenizers and the native checkpoint format have their own modules; loading.py only reads
    checkpoints (it does not re-export the writers)."""
    import headprobe.probe.backends.loading as loading
    import headprobe.probe.model.checkpoint as checkpoint
    import headprobe.probe.model.tokenizers as tokenizers

    for name in ("TEXT_CHARS", "char_level_tokenizer", "word_level_tokenizer"):
        assert hasattr(tokenizers, name) and not hasattr(loading, name)
    assert hasattr(checkpoint, "save_native") and not hasattr(loading, "save_native")
    assert loading.is_native_dir is checkpoint.is_native_dir


def test_scan_of_a_trained_model_uses_a_period_it_was_trained_on(tiny_run, tmp_path):
    """TINY trains on periods 4-12 with a 33-token context: scan's usual default (16, what fits
    twice) is a repeat length the model never saw, so the scan takes its eval period (8); an
    explicit --period and a default inside the trained range are kept."""
    from headprobe.commands.scan import ScanConfig
    from headprobe.probe.backends.native_loading import load_native

    tiny_run.save(tmp_path)
    model = load_native(tmp_path)
    assert model.trained_periods == (4, 12, 8)
    cfg = ScanConfig(model=str(tmp_path))
    assert cfg.resolved(model.spec).period == 16
    assert cfg.resolved(model.spec, model.trained_periods).period == 8
    assert ScanConfig(model=str(tmp_path), period=11).resolved(model.spec, model.trained_periods).period == 11
    assert cfg.resolved(model.spec, (4, 20, 8)).period == 16


def test_the_trained_model_in_memory_has_the_periods_its_saved_copy_reloads_with(tiny_run, tmp_path):
    """``scan(result.loaded)`` took period 16 where ``scan(saved folder)`` took the eval period 8
    (walk-api: 47 against 24): the model ``train`` returns carried no trained periods. It carries
    those its saved copy reloads with, so both resolve the same default."""
    from headprobe.commands.scan import ScanConfig
    from headprobe.probe.backends.native_loading import load_native

    tiny_run.save(tmp_path / "saved")
    saved = load_native(tmp_path / "saved")
    assert tiny_run.loaded.trained_periods == saved.trained_periods == (4, 12, 8)
    cfg = ScanConfig(model="x")
    assert cfg.resolved(tiny_run.loaded.spec, tiny_run.loaded.trained_periods).period == 8


def test_train_summary_records_the_cpu_threads_and_kernels():
    """As study.json: training losses move in the 4th decimal with torch's thread count and the CPU's
    vector kernels, so a CPU run's summary names both; a CUDA run's names neither."""
    import torch

    import headprobe
    from headprobe.probe.core.io import cpu_kernels

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        s = headprobe.train(steps=2, eval_every=2, d_model=16, n_eval=4, device="cpu").summary()
    finally:
        torch.set_num_threads(before)
    assert (s["cpu_threads"], s["cpu_capability"]) == (1, torch.backends.cpu.get_cpu_capability())
    assert cpu_kernels("cuda:0") == {} and cpu_kernels(["cuda:0", "cuda:1"]) == {} and cpu_kernels(None) == {}


def test_copying_without_an_induction_stripe_is_said_not_called_no_phase_change():
    """A GQA run (4 heads on 2 KV heads, seed 0, 1000 steps) reached in-context loss -3.62 with no
    head's induction score above 0.02 (layer-0 heads at fixed offsets 14 and 15 feed a shifted
    induction circuit): "no phase change yet" misread it. The rule, -ln(n_words)/2, by hand."""
    import math

    import headprobe

    result = headprobe.train(steps=2, eval_every=2, d_model=16, n_eval=4, device="cpu")
    floor = -0.5 * math.log(result.config.n_words)
    result.log["max_induction"] = result.log["top_induction_ci95_low"] = 0.02  # no phase change by the induction rule
    for icl, copies in ((floor - 0.01, True), (floor + 0.01, False)):
        result.log.loc[result.log.index[-1], "in_context_loss"] = icl
        s, text = result.summary(), result.report()
        assert s["phase_change_step"] is None and s["copies_in_context"] is copies
        assert ("no phase change yet" in text) is not copies
        assert ("yet the in-context loss says the model copies" in text) is copies
        assert f"= {floor:.2f})" in text or not copies


def test_every_train_flag_says_its_default_in_help(capsys):
    """docs/train.md gives each flag's default; ``train --help`` must say it too (``--positional``,
    ``--batch-size`` and ``--weight-decay`` had no help at all). Reference: TrainConfig's defaults."""
    assert main(["train", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    defaults = TrainConfig()
    for flag, field in [
        ("--positional", "positional"),
        ("--batch-size", "batch_size"),
        ("--weight-decay", "weight_decay"),
    ]:
        entry = text.split(flag, 2)[2].split(" --", 1)[0]  # the option's own entry, after the usage line's mention
        assert f"default {getattr(defaults, field)}" in entry, (flag, entry)


def test_the_phase_change_is_named_by_the_evaluations_around_it():
    """``headprobe train`` (seed 0, 1000 steps, evaluated every 100) printed "phase change at step 400",
    where the max induction score was 0.06, and marked step 400 in training.png: the 3-point running
    mean already falls fastest into the last evaluation before the jump. The jump lies between the
    evaluations at 400 and 500 (in-context loss -0.74 -> -4.12, induction 0.06 -> 0.82: that run's
    log, by hand); the step named (the later end) is now 500, the first that shows it, and the report, summary.json
    and the figure's band give both ends and the evaluation interval."""
    import dataclasses

    import headprobe

    steps = np.arange(0, 1001, 100)
    icl = np.array([-0.018, -0.226, -0.444, -0.591, -0.737, -4.123, -4.128, -4.151, -4.134, -4.148, -4.145])
    induction = np.array([0.03, 0.03, 0.02, 0.02, 0.06, 0.82, 0.83, 0.88, 0.89, 0.89, 0.90])
    assert phase_change_interval(steps, icl, induction) == (400, 500)
    # a fall spread over two intervals: the steeper one, wherever it lies in the running mean's window
    gradual = np.array([0.0, 0.0, 0.0, 0.0, -1.0, -3.0, -3.2, -3.2, -3.2, -3.2, -3.2])
    assert phase_change_interval(steps, gradual, induction) == (400, 500)
    assert phase_change_interval(steps, gradual, np.full(len(steps), 0.05)) is None

    result = headprobe.train(steps=2, eval_every=2, d_model=16, n_eval=4, device="cpu")
    result.config = dataclasses.replace(result.config, eval_every=100)
    result.log = pd.DataFrame(
        {
            "step": steps,
            "train_loss": np.r_[np.nan, np.linspace(4.1, 2.2, 10)],
            "eval_loss": np.linspace(4.1, 2.2, 11),
            "in_context_loss": icl,
            "repeated_loss": np.linspace(4.0, 1.0, 11),
            "max_induction": induction,
            "max_previous_token": induction,
        }
    )
    s, text = result.summary(), result.report()
    assert s["phase_change_step"] == 500 and s["phase_change_between"] == [400, 500] and s["eval_every"] == 100
    assert s["first_step_induction_formed"] == 500  # a log without top_induction_ci95_low: its max_induction
    assert "phase change between steps 400 and 500 (evaluated every 100)" in text and "at step 400" not in text
    fig = result.figures()["training"]
    bands = [p for p in fig.axes[0].patches if p.get_x() == 400]
    assert bands and bands[0].get_width() == 100  # a band over 400-500, no line at one step
    assert "steps 400–500" in " ".join(t.get_text() for t in fig.axes[0].texts)


@pytest.mark.figures
@pytest.mark.parametrize("n_kv_heads,named", [(None, "(4 heads, d_model 16)"), (2, "(4 heads on 2 KV heads, d_model 16)"),
                                              (1, "(4 heads on 1 KV head, d_model 16)")])  # fmt: skip
def test_the_training_figure_names_its_kv_heads_and_says_when_it_copies_without_the_stripe(n_kv_heads, named):
    """Three training.png side by side on a slide (MHA, GQA, MQA) were all titled "(4 heads, d_model 64)", and a
    GQA run that copied in context without an induction stripe said so only in the terminal's closing line.
    The title names the KV heads of GQA and MQA, and a run that copies with no phase change says it (the
    summary's own two flags decide, as the report's line)."""
    import headprobe

    result = headprobe.train(steps=2, eval_every=2, d_model=16, n_eval=4, n_kv_heads=n_kv_heads, device="cpu")
    steps = np.arange(0, 501, 100)
    result.log = pd.DataFrame(
        {
            "step": steps,
            "train_loss": np.r_[np.nan, np.linspace(4.1, 2.2, 5)],
            "eval_loss": np.linspace(4.1, 2.2, 6),
            "in_context_loss": [-0.01, -0.2, -1.0, -3.5, -3.6, -3.62],  # copies: at or below -ln(64)/2 = -2.08
            "repeated_loss": np.linspace(4.0, 2.1, 6),
            "max_induction": np.full(6, 0.04),  # no induction stripe
            "max_previous_token": np.full(6, 0.1),
        }
    )
    s = result.summary()
    assert s["copies_in_context"] and s["phase_change_step"] is None
    title = result.figures()["training"].axes[0].get_title()
    assert named in title and "copies in context without an induction stripe" in title, title
    result.log["in_context_loss"] = np.linspace(0, -0.5, 6)  # neither copies nor forms: no such line
    assert "without an induction stripe" not in result.figures()["training"].axes[0].get_title()


def test_atlas_docs_train_command_is_the_toy_models_settings():
    """docs/atlas.md's ``headprobe train ... --save-every 100`` line trains the atlas's toy model
    (TOY_TRAIN, 1200 steps: the run its over-training figure shows); the flags once left the default
    model (4 heads, 96-token context, biases), which never formed induction heads."""
    import shlex
    from pathlib import Path

    from headprobe.cli import build_parser
    from headprobe.commands.atlas import TOY_TRAIN
    from headprobe.commands.train import config_from_args

    doc = (Path(__file__).resolve().parents[1] / "docs" / "atlas.md").read_text()
    (line,) = [x for x in doc.splitlines() if x.startswith("headprobe train ") and "--save-every 100" in x]
    argv = shlex.split(line, comments=True)[1:]
    config = config_from_args(build_parser().parse_args(argv))
    expected = TrainConfig(**{**TOY_TRAIN, "n_words": 96, "steps": 1200, "save_every": 100})
    assert config == expected


def test_in_context_loss_carries_its_t_interval_over_the_held_out_sequences():
    """The final in-context loss, on which train calls a model copying or not, was printed bare from
    --n-eval sequences. Its 95% interval, against a reference by hand: each held-out sequence's mean
    loss at positions 27-31 minus 1-5 (seq_len 33: 32 predictions, +-2 around 0.98 and 0.10 of them,
    clamped) and scipy's t interval; a mean the per-sequence values do not average to is refused."""
    from scipy import stats

    import headprobe
    from headprobe.analyses.ablation import token_losses
    from headprobe.analyses.train import _eval_data
    from headprobe.probe.core.errors import HeadprobeError

    result = headprobe.train(
        steps=20, eval_every=10, d_model=16, n_eval=6, seq_len=33, max_period=12, eval_period=8, device="cpu"
    )
    held_out = _eval_data(result.config, result.loaded, "cpu")[0]
    with torch.no_grad():
        losses = token_losses(result.loaded.forward(held_out), held_out).double().numpy()
    assert losses.shape == (6, 32)
    d = losses[:, 27:32].mean(axis=1) - losses[:, 1:6].mean(axis=1)
    lo, hi = stats.t.interval(0.95, len(d) - 1, loc=d.mean(), scale=stats.sem(d))
    s = result.summary()
    assert s["final"]["in_context_loss"] == pytest.approx(d.mean(), abs=1e-4)
    assert s["final"]["in_context_loss_ci95"] == pytest.approx([lo, hi], abs=1e-4)
    last = result.log.iloc[-1]
    assert [last["in_context_loss_ci95_low"], last["in_context_loss_ci95_high"]] == pytest.approx([lo, hi], abs=1e-6)
    assert (
        f"in-context loss (late - early) {d.mean():+.3f} [{lo:+.3f}, {hi:+.3f}] (95% CI over 6 held-out sequences)"
        in result.report()
    )
    from headprobe.analyses.train import in_context_ci  # the identity check behind the interval

    with pytest.raises(HeadprobeError, match="per-sequence in-context losses average to"):
        in_context_ci(torch.as_tensor(losses), float(d.mean()) + 0.01)


def test_induction_formed_needs_the_top_heads_lower_bound_above_one_half(tiny_run):
    """A top mean of 0.55 over 8 noisy sequences (lower 95% bound 0.36, by hand: mean - t(7, 0.975)
    sd / sqrt(8)) is not a formed induction head; the same mean with little spread is. The old
    rule, the largest mean above 0.5, called both formed."""
    from scipy import stats

    from headprobe.analyses.train import induction_formed
    from headprobe.commands.train_core import TrainResult

    noisy = np.array([0.25, 0.85, 0.40, 0.70, 0.55, 0.30, 0.80, 0.55])  # mean 0.55
    tight = np.array([0.54, 0.56, 0.55, 0.53, 0.57, 0.55, 0.54, 0.56])
    others = np.full(8, 0.1)
    for head, formed in ((noisy, False), (tight, True)):
        scores = np.stack([[others, others], [others, head]])  # [layer, head, sequence]: the top head is 1.1
        lo = head.mean() - stats.t.ppf(0.975, 7) * head.std(ddof=1) / np.sqrt(8)
        got = induction_formed(scores)
        assert got["head"] == (1, 1) and got["score"] == pytest.approx(0.55) and got["formed"] is formed
        assert got["ci95"][0] == pytest.approx(lo) and bool(lo > 0.5) is formed
        fields = {f.name: getattr(tiny_run, f.name) for f in dataclasses.fields(tiny_run)}
        final = {**tiny_run.final_scores, "induction": scores.mean(-1), "induction_per_sequence": scores}
        summary = TrainResult(**{**fields, "final_scores": final}).summary()
        assert summary["induction_formed"] is formed and summary["final"]["top_induction_score"] == 0.55
        assert summary["final"]["top_induction_score_ci95"][0] == round(lo, 4)
    assert induction_formed(np.full((1, 1, 1), 0.9))["formed"] is False  # one sequence: no interval
    near_one = np.array([[[0.999, 1.0, 0.95, 1.0]]])  # t interval [0.9477, 1.0268]: past the score's range
    raw_hi = near_one.mean() + stats.t.ppf(0.975, 3) * near_one.std(ddof=1) / 2
    assert raw_hi > 1 and induction_formed(near_one)["ci95"][1] == 1.0  # clipped, as scan's score_ci95


def test_the_top_induction_interval_is_around_the_logged_score(tiny_run):
    """The per-sequence scores of the last evaluation average to the logged score of every head."""
    per_seq = tiny_run.final_scores["induction_per_sequence"]
    assert per_seq.shape == (2, 2, TINY.n_eval)
    np.testing.assert_allclose(per_seq.mean(-1), tiny_run.final_scores["induction"], atol=1e-6)
    s = tiny_run.summary()
    lo, hi = s["final"]["top_induction_score_ci95"]
    assert lo <= s["final"]["top_induction_score"] <= hi and s["induction_formed"] is (lo > 0.5)


def test_first_step_and_phase_change_gate_use_the_rule_of_induction_formed():
    """induction_formed asked for the top head's lower 95% bound above 0.5, but first_step_induction_above_0.5,
    the phase-change gate and the closing line still used the largest mean score (a maximum of noisy means,
    leaning upward). Each evaluation now logs that bound (top_induction_ci95_low), checked against a
    Student-t bound by scipy.stats on the last evaluation's per-sequence scores; the step and the gate read it."""
    import dataclasses

    from scipy import stats

    import headprobe

    result = headprobe.train(steps=2, eval_every=2, d_model=16, n_eval=4, device="cpu")
    per_seq = result.final_scores["induction_per_sequence"]
    top = per_seq[np.unravel_index(np.argmax(per_seq.mean(-1)), per_seq.shape[:2])].astype(np.float64)  # as logged
    lo = top.mean() - stats.t.ppf(0.975, len(top) - 1) * top.std(ddof=1) / np.sqrt(len(top))
    assert result.log["top_induction_ci95_low"].iloc[-1] == pytest.approx(lo, abs=1e-9)

    steps = np.arange(0, 1001, 100)
    icl = np.array([-0.018, -0.226, -0.444, -0.591, -0.737, -4.123, -4.128, -4.151, -4.134, -4.148, -4.145])
    top_mean = np.array([0.03, 0.03, 0.02, 0.02, 0.06, 0.55, 0.83, 0.88, 0.89, 0.89, 0.90])
    result.config = dataclasses.replace(result.config, eval_every=100)
    for low, first in ((top_mean - np.where(steps == 500, 0.2, 0.01), 600), (np.minimum(top_mean, 0.45), None)):
        result.log = pd.DataFrame(
            {
                "step": steps,
                "train_loss": np.linspace(4.1, 2.2, 11),
                "eval_loss": np.linspace(4.1, 2.2, 11),
                "in_context_loss": icl,
                "repeated_loss": np.linspace(4.0, 1.0, 11),
                "max_induction": top_mean,  # passes 0.5 at step 500 in both
                "top_induction_ci95_low": low,
                "max_previous_token": top_mean,
            }
        )
        s, text = result.summary(), result.report()
        assert s["first_step_induction_formed"] == first
        assert s["phase_change_between"] == ([400, 500] if first else None)
        assert (f"induction formed first at step {first}" in text) is bool(first)
        assert ("no induction head formed" in text) is not first


def test_evaluate_reads_each_layers_induction_diagonal_once_with_the_logged_numbers(tiny_run):
    """``evaluate`` scored induction twice per layer (pooled, then per sequence: two reads of the
    pattern's ``q - period + 1`` diagonal); now once, both from that one read. The pooled score is
    bit-identical to :func:`induction_score`'s (the committed training logs stay reproducible) and
    both match a loop over the captured patterns (float64)."""
    from torch.overrides import TorchFunctionMode

    from headprobe.analyses.detectors import induction_score
    from headprobe.analyses.train import _eval_data, evaluate
    from headprobe.probe.hooks.capture import patterns_by_layer

    loaded = tiny_run.loaded
    held_out, repeated, _, _ = _eval_data(TINY, loaded, "cpu")
    period, start = repeated.period, repeated.start
    reads = []

    class Diagonals(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.Tensor.diagonal and kwargs.get("offset", args[1] if len(args) > 1 else 0) == 1 - period:
                reads.append(1)
            return func(*args, **kwargs)

    with Diagonals():
        ev = evaluate(loaded, held_out, repeated)
    n_layers = loaded.spec.n_layers
    assert len(reads) == n_layers, f"{len(reads)} reads of the induction diagonal for {n_layers} layers"

    patterns = {}
    with torch.inference_mode():
        patterns_by_layer(loaded, repeated.tokens, lambda layer, p: patterns.__setitem__(layer, p.clone()))
    for layer, p in patterns.items():
        assert torch.equal(ev["induction"][layer], induction_score(p, period, start))  # the old pooled path
        p64 = p.double()
        ref = torch.zeros(p.shape[0], p.shape[1], dtype=torch.float64)
        queries = range(start + period, p.shape[-1])
        for q in queries:
            ref += p64[:, :, q, q - period + 1]
        ref /= len(queries)  # [batch, head]
        torch.testing.assert_close(ev["induction_per_sequence"][layer].double(), ref.T, rtol=0, atol=1e-6)
        torch.testing.assert_close(ev["induction"][layer].double(), ref.mean(0), rtol=0, atol=1e-6)


def test_the_interval_rule_reads_as_a_sentence():
    """train's summary said "...; none from fewer than 2 the 64 held-out copy sequences": the phrase
    naming the sequences went where the helper puts its plural noun. Every command's interval_rule
    built by the helper ends "fewer than 2 <plural noun>", never with an article or a count."""
    import re

    import headprobe

    s = headprobe.train(steps=2, eval_every=2, d_model=16, n_eval=4, device="cpu").summary()
    assert s["interval_rule"].startswith(
        "95% Student-t interval of the mean over the 4 held-out copy sequences (mean +- t(n-1) sd / sqrt(n)); "
        "none from fewer than 2 held-out copy sequences: final.in_context_loss_ci95"
    ), s["interval_rule"]
    from headprobe.analyses.statistics import interval_rule

    for units in ("sequences", "prompt pairs", "seeds", "long-range sequences", "long-range sequences of the distance"):
        assert not re.search(r"fewer than \d+ (the|a|an|\d)", interval_rule(units)), interval_rule(units)
