"""``headprobe atlas`` and training snapshots: the atlas table against each model's own scan, the
verdict/top columns against hand-made summaries, failures recorded while the rest goes on,
resuming, and snapshots that reload as the model they were taken from."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import zoo

import headprobe
from headprobe.analyses import atlas as atlas_lib
from headprobe.analyses.columns import DETECTORS
from headprobe.analyses.vocabulary import FIGURE_FORMATS_ENV
from headprobe.cli import main
from headprobe.commands import atlas as atlas_cmd

SCAN = dict(n_natural=3, seq_len=16, n_repeated=2, period=6, k=2, n_random=3, pattern_len=0, device="cpu")
SMALL = dict(SCAN, model_figures=False)
SMALL_FLAGS = [
    "--n-natural",
    "3",
    "--seq-len",
    "16",
    "--n-repeated",
    "2",
    "--period",
    "6",
    "-k",
    "2",
    "--n-random",
    "3",
    "--pattern-len",
    "0",
    "--device",
    "cpu",
    "--no-model-figures",
]


@pytest.fixture(scope="module")
def gpt2_dir(tiny_tokenizer, tmp_path_factory):
    return zoo.save_dir("gpt2", tiny_tokenizer, tmp_path_factory.mktemp("zoo") / "gpt2")


# ---------------------------------------------------------------------------------------------
# The table from hand-made scan outputs
# ---------------------------------------------------------------------------------------------


def _summary(n_layers=3, n_heads=2):
    return {
        "layout": {"n_layers": n_layers, "n_heads": n_heads},
        "config": {"types": ["positional", "induction"]},
        "ablations": [
            {"head_type": "induction", "kind": "zero", "top_heads": ["2.1"], "confirmed": None, "tested": False},
            {"head_type": "induction", "kind": "mean", "top_heads": ["2.1"], "confirmed": True, "tested": True},
            {
                "head_type": "positional",
                "kind": "zero",
                "top_heads": ["0.0", "1.1"],
                "confirmed": None,
                "tested": False,
            },
            {
                "head_type": "positional",
                "kind": "mean",
                "top_heads": ["0.0", "1.1"],
                "confirmed": False,
                "tested": True,
            },
        ],
    }


def test_atlas_rows_mark_top_heads_with_their_types_tested_verdict():
    layer, head = np.meshgrid(range(3), range(2), indexing="ij")
    scores = pd.DataFrame(
        {
            "layer": layer.ravel(),
            "head": head.ravel(),
            "kv_head": head.ravel(),
            "induction": np.linspace(0, 1, 6),
            "positional_fraction": np.linspace(1, 0, 6),
        }
    )
    rows = atlas_lib.atlas_rows(scores, _summary(), "m", "llama", step=None)
    assert rows["relative_depth"].tolist() == [0, 0, 0.5, 0.5, 1, 1]
    by_name = rows.set_index(rows["layer"].astype(str) + "." + rows["head"].astype(str))
    assert by_name.loc["2.1", "induction_verdict"] == "CONFIRMED" and by_name["induction_top"].sum() == 1
    # the tested (mean-ablation) verdict, not the untested zero-ablation row's, although zero came first
    assert by_name.loc[["0.0", "1.1"], "positional_verdict"].tolist() == ["not confirmed", "not confirmed"]
    assert (by_name.drop(["0.0", "1.1"])["positional_verdict"] == "").all()
    assert rows["induction"].tolist() == scores["induction"].tolist()
    with pytest.raises(ValueError, match="rows"):
        atlas_lib.atlas_rows(scores.iloc[:5], _summary(), "m", "llama")


def test_no_verdict_and_one_layer_models():
    s = _summary(n_layers=1, n_heads=2)
    s["ablations"][2:] = [{**a, "top_heads": ["0.0", "0.1"]} for a in s["ablations"][2:]]
    s["ablations"][:2] = [{"head_type": "induction", "kind": "mean", "top_heads": ["0.1"], "confirmed": None}]
    scores = pd.DataFrame(
        {"layer": [0, 0], "head": [0, 1], "kv_head": [0, 0], "induction": [0.1, 0.9], "positional_fraction": [0.5, 0.5]}
    )
    rows = atlas_lib.atlas_rows(scores, s, "one-layer", "gpt2")
    assert rows["relative_depth"].tolist() == [0, 0]
    assert rows["induction_verdict"].tolist() == ["", "no verdict"]


# ---------------------------------------------------------------------------------------------
# End to end on tiny models
# ---------------------------------------------------------------------------------------------


def _unloadable(d: Path) -> Path:
    """A folder that looks like a model (config.json, a weights file, a tokenizer file) but does not load:
    its architecture is unknown (a folder without tokenizer files is refused before, for that)."""
    (d / "config.json").write_text('{"model_type": "no_such_architecture"}')
    (d / "tokenizer_config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"")
    return d


@pytest.fixture(scope="module")
def atlas_run(tiny_dir, gpt2_dir, text_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("atlas") / "a"
    models = [str(tiny_dir), str(_unloadable(tmp_path_factory.mktemp("bad"))), str(gpt2_dir)]  # the middle one fails
    with pytest.MonkeyPatch.context() as mp:  # every figure format, which a test checks (conftest: PNG only)
        mp.delenv(FIGURE_FORMATS_ENV)
        code = main(["atlas", "--models", *models, "--out", str(out), "--text", str(text_file), *SMALL_FLAGS])
    return out, models, code


def test_atlas_table_equals_each_models_own_scan(atlas_run, text_file):
    out, models, code = atlas_run
    assert code == 0
    table = pd.read_csv(out / "atlas.csv")
    assert list(dict.fromkeys(table["model"])) == [models[0], models[2]]
    sizes = table.groupby("model", sort=False)[["n_layers", "n_heads"]].first()
    assert len(table) == (sizes["n_layers"] * sizes["n_heads"]).sum()
    assert sorted(zip(sizes["n_layers"], sizes["n_heads"])) == [(2, 4), (2, 8)]
    for model, family in ((models[0], "llama"), (models[2], "gpt2")):
        ref = headprobe.scan(model, text=str(text_file), **SCAN).table
        got = table[table["model"] == model].reset_index(drop=True)
        assert (got["family"] == family).all()
        for col in ref.columns:
            np.testing.assert_allclose(got[col].to_numpy(float), ref[col].to_numpy(float), atol=1e-5, err_msg=col)
        assert got["relative_depth"].tolist() == (got["layer"] / (got["n_layers"] - 1)).tolist()


def test_atlas_records_a_failing_model_and_goes_on(atlas_run):
    out, models, _ = atlas_run
    summary = json.loads((out / "summary.json").read_text())
    status = {m: r["status"] for m, r in summary["models"].items()}
    assert status == {models[0]: "scanned", models[1]: "failed", models[2]: "scanned"}
    assert (
        "cannot load model" in summary["models"][models[1]]["error"]
        and "\n" not in summary["models"][models[1]]["error"]
    )
    types = atlas_lib.table_types(pd.read_csv(out / "atlas.csv"))
    assert set(types) == {t for t, d in DETECTORS.items() if d.applies_to(True)}  # decoders' types
    for stem in ["atlas", *(f"atlas_{t}" for t in types)]:
        assert (out / f"{stem}.png").is_file() and (out / f"{stem}.pdf").is_file(), stem
    # --no-model-figures: each model's scan folder holds its tables, no figure in any format
    assert len(list((out / "models").glob("*/head_scores.csv"))) == 2
    assert not [p for p in (out / "models").rglob("*") if p.suffix in (".png", ".pdf", ".svg")]
    # the verdict columns are the per-model scans' own
    table = pd.read_csv(out / "atlas.csv", keep_default_na=False)
    for m in (models[0], models[2]):
        scan = json.loads((out / "models" / summary["models"][m]["dir"].split("/", 1)[1] / "summary.json").read_text())
        verdicts = atlas_lib.type_verdicts(scan)
        # atlas loaded the model: the scan records that load's seconds, not none (nor a 0 s one)
        assert scan["timings_s"]["load_s"] > 0  # a tiny model's weights and tokenizer: tens of ms
        sub = table[table["model"] == m]
        for t, (top, verdict) in verdicts.items():
            marked = sub[sub[f"{t}_top"].astype(str) == "True"]
            assert sorted(f"{a}.{b}" for a, b in zip(marked["layer"], marked["head"])) == sorted(top)
            assert set(marked[f"{t}_verdict"]) == {verdict}


def test_atlas_resumes_without_rescanning(atlas_run, text_file):
    out, models, _ = atlas_run
    before = (
        (out / "models").stat().st_mtime_ns,
        sorted(p.stat().st_mtime_ns for p in (out / "models").rglob("head_scores.csv")),
    )
    first_csv = (out / "atlas.csv").read_text()
    result = headprobe.atlas(models=models, out=out, overwrite=True, text=str(text_file), **SMALL)
    assert [r["status"] for r in result.models.values()] == ["resumed", "failed", "resumed"]
    assert sorted(p.stat().st_mtime_ns for p in (out / "models").rglob("head_scores.csv")) == before[1]
    assert (out / "atlas.csv").read_text() == first_csv  # rebuilt from the reused scans, the same table


def test_a_local_model_rewritten_since_is_rescanned(gpt2_dir, text_file, tmp_path):
    """A resumed atlas reuses a model's scan only while the model's files are the ones it scanned:
    after one weight file is rewritten, that model is scanned again, and its table follows."""
    import shutil

    from safetensors.torch import load_file, save_file

    model = tmp_path / "gpt2"
    shutil.copytree(gpt2_dir, model)
    out = tmp_path / "a"
    first = headprobe.atlas(models=[str(model)], out=out, text=str(text_file), **SMALL)
    assert [r["status"] for r in first.models.values()] == ["scanned"]
    again = headprobe.atlas(models=[str(model)], out=out, overwrite=True, text=str(text_file), **SMALL)
    assert [r["status"] for r in again.models.values()] == ["resumed"]
    (weights,) = model.glob("*.safetensors")
    state = load_file(weights)
    state = {k: v * 0.5 if k.endswith("attn.c_attn.weight") else v for k, v in state.items()}
    save_file(state, weights, metadata={"format": "pt"})
    third = headprobe.atlas(models=[str(model)], out=out, overwrite=True, text=str(text_file), **SMALL)
    assert [r["status"] for r in third.models.values()] == ["scanned"]
    ref = headprobe.scan(str(model), text=str(text_file), **SCAN).table
    np.testing.assert_allclose(third.table["induction"].to_numpy(float), ref["induction"].to_numpy(float), atol=1e-5)
    assert not np.allclose(third.table["induction"], first.table["induction"], atol=1e-5)


TRICKY_LABELS = [
    "smollm2-135m",
    "all-minilm-l6-v2",
    "toy",
    "step 0",
    "step 100",
    "step_100",
    "step 0100",
    "x/llama",
    "x_llama",
    "x__llama",
    "x llama",
    "X_llama",
    "x_LLAMA",
    "..",
    ".",
    "/",
    "",
    "-",
    ".hidden",
    "/abs/path/model",
    "abs/path/model",
    "../up",
    "a" * 300,
    "a" * 300 + "b",
    "model",
    "model-0123456789",
    "EleutherAI/pythia-70m",
    "caf\u00e9",
    "cafe",
    "con",
    "con.d",
    "nul\x00",
    "model.",
    "model..",
    "a\\b",
    "~",
    "-rf",
]


def test_model_folder_names_are_one_to_one_and_safe():
    """Every label gets its own folder (also where the file system ignores case), one path component,
    never '.' or '..', hidden or too long; the names of committed atlases stay as they were."""
    from headprobe.commands.atlas import slug

    names = {label: slug(label) for label in TRICKY_LABELS}
    assert len({n.lower() for n in names.values()}) == len(TRICKY_LABELS), names
    for label, name in names.items():
        assert re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*[A-Za-z0-9_-]", name) and len(name) <= 64, (label, name)
        assert name.split(".")[0].lower() not in ("con", "nul"), (label, name)  # Windows device names
        assert name == slug(label)  # the same every run, so a resumed atlas finds its scans
    # unambiguous names of committed atlases (figures/atlas, figures/atlas-training) are kept
    assert [names[x] for x in ("smollm2-135m", "all-minilm-l6-v2", "toy", "step 0", "step 100")] == [
        "smollm2-135m",
        "all-minilm-l6-v2",
        "toy",
        "step_0",
        "step_100",
    ]
    assert names["x/llama"].startswith("x_llama-") and names["x_llama"] == "x_llama"


def test_colliding_and_hostile_model_names_keep_their_own_folders(tiny_dir, gpt2_dir, text_file, tmp_path, monkeypatch):
    """x/llama and x_llama used to share a folder (the second scan overwrote the first), and '..' wrote
    its scan into OUT itself, outside OUT/models."""
    import shutil

    root = tmp_path / "models"
    shutil.copytree(tiny_dir, root / "x" / "llama")  # 2 layers x 8 heads
    shutil.copytree(gpt2_dir, root / "x_llama")  # 2 layers x 4 heads
    shutil.copytree(gpt2_dir, root / "m")
    (root / "m" / "cwd").mkdir()
    monkeypatch.chdir(root / "m" / "cwd")
    out = tmp_path / "out"
    labels = ["../../x/llama", "../../x_llama", ".."]  # '..' is the model m
    assert (
        main(
            [
                "atlas",
                "--models",
                *labels,
                "--out",
                str(out),
                "--text",
                str(text_file),
                *SMALL_FLAGS,
                "--types",
                "induction",
                "--no-metrics",
            ]
        )
        == 0
    )
    summary = json.loads((out / "summary.json").read_text())
    dirs = [out / summary["models"][m]["dir"] for m in labels]
    assert len(set(dirs)) == 3 and all(d.parent == out / "models" for d in dirs)
    assert [summary["models"][m]["status"] for m in labels] == ["scanned"] * 3
    heads = [len(pd.read_csv(d / "head_scores.csv")) for d in dirs]
    assert heads == [16, 8, 8]  # each folder holds its own model's scan
    assert not (out / "head_scores.csv").exists() and sorted(p.name for p in (out / "models").iterdir()) == sorted(
        d.name for d in dirs
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["atlas", "--model", "x"], "--models"),
        (["atlas", "--models", "a", "--checkpoints", "/nonexistent"], "--checkpoints /nonexistent: no such folder"),
        (["atlas", "--models", "a", "a"], "named twice"),
        (["atlas", "--models", "a", "--n-random", "0"], "n-random"),
        (["atlas", "--models", "toy", "--seq-len", "64"], "the toy model: --seq-len 64 is longer than the model's"),
        (["atlas", "--seq-len", "49"], "the toy model: --seq-len 49 is longer than the model's context (48 tokens)"),
        (["atlas", "--models", "toy", "--period", "24"], "the toy model: --period 24 gives sequences longer"),
    ],
)
def test_bad_atlas_input_is_one_line_and_exit_2(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        raise SystemExit(main([*argv, "--out", str(tmp_path / "o")]))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o").exists()


def test_a_seq_len_beyond_the_toys_context_is_refused_before_it_trains(tmp_path, monkeypatch):
    """``atlas(models=("toy",), seq_len=64)`` trained the toy (about 40 s) and only then failed its
    scan (a 48-token context); the toy's context is known from its training settings, so the
    refusal comes first, with nothing trained or written."""
    from headprobe.commands import atlas_core
    from headprobe.probe.core.errors import HeadprobeError

    trained = []
    monkeypatch.setattr(atlas_core, "_train_toy", lambda *a, **k: trained.append(1))
    with pytest.raises(HeadprobeError, match=r"the toy model: --seq-len 64 .* context \(48 tokens\)"):
        headprobe.atlas(models=("toy",), out=tmp_path / "o", seq_len=64)
    assert not trained and not (tmp_path / "o").exists()


def test_checkpoints_folder_without_snapshots_says_so(tmp_path, capsys):
    """An existing folder with no snapshots is told apart from a missing one."""
    (tmp_path / "run").mkdir()
    _atlas_refused(
        ["--models", "a", "--checkpoints", str(tmp_path / "run")], tmp_path / "o", "no checkpoints/step-*", capsys
    )


def _atlas_refused(argv, out: Path, message: str, capsys, loaded: bool = False) -> str:
    """``headprobe atlas ARGV --out OUT``: exit 2 and one ``headprobe: error:`` line holding
    ``message``: the only stderr line, or (``loaded``: models were tried) the last, after the
    loading progress and the loader's warnings, with no traceback."""
    capsys.readouterr()
    code = main(["atlas", *argv, "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and (loaded or len(err) == 1) and "Traceback" not in "".join(err), (code, err)
    assert [x for x in err if x.startswith("headprobe: error:")] == err[-1:] and message in err[-1], err
    return err[-1]


def test_every_model_that_cannot_be_found_is_named_before_any_scan(tiny_dir, tmp_path, capsys, monkeypatch):
    """Offline, two hub names not in the cache and a folder without config.json among a local
    model: one line names all three (not only the first), before anything is trained, loaded or written."""
    from headprobe.probe.backends import sources

    monkeypatch.setattr(sources, "_hub_reachable", lambda *a, **k: False)
    (tmp_path / "empty").mkdir()
    missing = ["nosuch-org/model-a", "nosuch-org/model-b", str(tmp_path / "empty")]
    line = _atlas_refused(["--models", str(tiny_dir), *missing, "toy"], tmp_path / "o", missing[0], capsys)
    assert all(f"{m}: " in line for m in missing) and str(tiny_dir) not in line
    assert "not in the local Hugging Face cache" in line and "no config.json" in line
    assert not (tmp_path / "o").exists()


def test_an_atlas_where_every_model_fails_writes_nothing(tmp_path, capsys):
    """Every model is found but fails to load: one line naming each, exit 2, no output folder; in
    an existing folder, no new file."""
    models = [_unloadable(tmp_path / f"bad{i}") for i in (1, 2) if not (tmp_path / f"bad{i}").mkdir()]
    argv = ["--models", *map(str, models), *SMALL_FLAGS]
    line = _atlas_refused(argv, tmp_path / "o", "every model failed", capsys, loaded=True)
    assert all(f"{m}: cannot load model" in line for m in models)
    assert not (tmp_path / "o").exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    _atlas_refused([*argv, "--overwrite"], kept, "every model failed", capsys, loaded=True)
    assert sorted(p.name for p in kept.rglob("*")) == ["notes.txt"]


def test_a_hub_name_the_hub_does_not_hold_is_refused_before_the_toy_trains(tmp_path, capsys, monkeypatch):
    """With the hub reachable, a mistyped name (``gpt2-typo``) passed the look-up and failed only
    at its turn, after the toy had trained for minutes; the hub is asked first (``repo_exists``,
    mocked: this machine has no network) and the run refuses in one line with nothing trained."""
    from huggingface_hub import HfApi

    from headprobe.commands import atlas_core
    from headprobe.probe.backends import sources
    from headprobe.probe.core.errors import HeadprobeError

    asked, trained = [], []

    def train(*args, **kwargs):
        trained.append(1)
        raise HeadprobeError("the toy was trained")

    monkeypatch.setattr(sources, "_hub_reachable", lambda *a, **k: True)
    monkeypatch.setattr(
        HfApi, "repo_exists", lambda self, repo_id, **k: asked.append(repo_id) or repo_id != "gpt2-typo"
    )
    monkeypatch.setattr(atlas_core, "_train_toy", train)
    line = _atlas_refused(["--models", "toy,gpt2-typo", *SMALL_FLAGS], tmp_path / "o", "gpt2-typo", capsys)
    assert "nor on the hub" in line and "did you mean gpt2" in line and asked == ["gpt2-typo"]
    assert not trained and not (tmp_path / "o").exists()
    monkeypatch.setattr(HfApi, "repo_exists", lambda self, repo_id, **k: 1 / 0)  # no answer: left to the load
    sources.check_model("gpt2-typo")


def test_a_trained_toy_is_kept_when_every_model_fails_and_reused(tmp_path, text_file, capsys, monkeypatch):
    """The toy trains, then its scan (a --seq-len beyond its 48-token context) and the other model
    fail: the atlas is refused as before, but the trained toy stays in OUT/toy/ (nothing else the
    run added does), and the next atlas there, without --overwrite, says so in one line and scans
    it without training again; one that would train another toy there is refused."""
    bad = _unloadable(tmp_path / "bad") if not (tmp_path / "bad").mkdir() else None
    # a toy scan that fails after training: --seq-len 60 with the check before training left out
    monkeypatch.setattr(atlas_cmd.AtlasConfig, "check_toy_layout", lambda self: None)
    out, flags = tmp_path / "o", [*SMALL_FLAGS, "--toy-steps", "2", "--text", str(text_file)]
    long = [*flags[: flags.index("--seq-len") + 1], "60", *flags[flags.index("--seq-len") + 2 :]]
    line = _atlas_refused(["--models", "toy", str(bad), *long], out, "every model failed", capsys, loaded=True)
    assert f"kept in {out / 'toy'}/" in line and "toy: " in line and f"{bad}: " in line
    assert (out / "toy" / "config.json").is_file()
    assert {p.relative_to(out).parts[0] for p in out.rglob("*")} == {"toy"}  # no models/, no checkpoint
    assert "and the same toy settings reuses it" in line
    other = ["--models", "toy", *SMALL_FLAGS, "--toy-steps", "3", "--text", str(text_file)]  # another toy
    assert "not empty; pass --overwrite" in _atlas_refused(other, out, "not empty", capsys)
    assert main(["atlas", "--models", "toy", *flags, "--types", "induction", "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "training the toy model" not in said
    assert [x for x in said.splitlines() if "reusing the toy model" in x] == [
        f"reusing the toy model kept in {out / 'toy'}/ by an earlier atlas here whose models all failed"
    ]
    assert json.loads((out / "summary.json").read_text())["models"]["toy"]["status"] == "scanned"


# ---------------------------------------------------------------------------------------------
# Training snapshots, and the atlas over them
# ---------------------------------------------------------------------------------------------

TRAIN = dict(
    n_layers=2,
    d_model=16,
    n_heads=2,
    n_words=20,
    seq_len=24,
    min_period=4,
    max_period=8,
    batch_size=4,
    steps=6,
    eval_every=3,
    n_eval=4,
    eval_period=6,
    save_every=3,
    device="cpu",
)


@pytest.fixture(scope="module")
def train_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("train") / "run"
    result = headprobe.train(**TRAIN)
    result.save(out)
    return result, out


def test_snapshots_reload_as_the_model_they_were_taken_from(train_run):
    from headprobe.probe.model.transformer import Transformer, init_weights

    result, out = train_run
    steps = sorted(int(p.name.split("-")[1]) for p in (out / "checkpoints").iterdir())
    assert steps == [0, 3, 6]
    tokens = torch.randint(0, TRAIN["n_words"], (2, 12), generator=torch.Generator().manual_seed(1))
    last = headprobe.load_model(str(out / "checkpoints" / "step-000006"), device="cpu")
    torch.testing.assert_close(last.forward(tokens), result.loaded.forward(tokens), rtol=0, atol=0)
    torch.manual_seed(TRAIN.get("seed", 0))
    fresh = init_weights(Transformer(result.config.model_config()))  # train's own initialisation, rebuilt
    first = headprobe.load_model(str(out / "checkpoints" / "step-000000"), device="cpu")
    torch.testing.assert_close(first.forward(tokens), fresh(tokens), rtol=0, atol=0)
    middle = json.loads((out / "checkpoints" / "step-000003" / "config.json").read_text())
    assert middle["step"] == 3 and middle["train"]["save_every"] == 3


@pytest.mark.figures
def test_atlas_over_checkpoints_is_in_step_order(train_run, tmp_path):
    _, run = train_run
    result = headprobe.atlas(
        checkpoints=str(run),
        out=tmp_path / "a",
        n_natural=2,
        seq_len=16,
        n_repeated=2,
        period=6,
        k=1,
        n_random=2,
        pattern_len=0,
        device="cpu",
        types="induction,previous_token",
        model_figures=False,
    )
    assert list(dict.fromkeys(result.table["step"])) == [0, 3, 6]
    assert list(result.models) == ["step 0", "step 3", "step 6"]
    assert (tmp_path / "a" / "over_training.png").is_file()
    # each step's rows are the scan of that snapshot
    ref = headprobe.scan(
        str(run / "checkpoints" / "step-000003"),
        n_natural=2,
        seq_len=16,
        n_repeated=2,
        period=6,
        k=1,
        n_random=2,
        pattern_len=0,
        device="cpu",
        types="induction,previous_token",
    ).table
    got = result.table[result.table["step"] == 3].reset_index(drop=True)
    np.testing.assert_allclose(
        got["induction"].to_numpy(float), ref["induction"].to_numpy(float), atol=1e-5
    )  # atlas.csv keeps 5 decimals


@pytest.mark.figures
def test_atlas_overview_has_a_key_for_marker_size():
    """The top-k markers' area encodes the score; the legend gives three scores at their markers' sizes."""
    from headprobe.analyses import atlas

    table = pd.read_csv(Path(__file__).resolve().parents[1] / "figures" / "atlas" / "atlas.csv")
    fig = atlas.atlas_overview(table)
    legend = fig.legends[0]
    sizes = {t.get_text(): h.get_markersize() for t, h in zip(legend.get_texts(), legend.legend_handles)}
    for v in (0.1, 0.5, 1.0):
        assert sizes[f"score {v:g}"] ** 2 == pytest.approx(6 + 30 * v)  # scatter's s: area in points^2
    markers = [c for ax in fig.axes for c in ax.collections if hasattr(c, "get_sizes")]  # not the layer dividers
    drawn = [c for c in markers if len(c.get_sizes()) and c.get_sizes().max() > 6]
    assert drawn and max(c.get_sizes().max() for c in drawn) <= 36 + 1e-9


@pytest.mark.figures
@pytest.mark.parametrize("n_types, n_models", [(1, 1), (2, 1), (4, 1), (1, 3), (5, 1)])
def test_an_overview_of_one_row_of_panels_keeps_its_axes(n_types, n_models, tmp_path):
    """An atlas of one model and at most four types (one row of panels, as a tiny atlas of
    ``--types induction`` draws) was as tall as the legend and title under and over it: the
    constrained layout collapsed the axes ("constrained_layout not applied"). Each panel keeps a
    row a model, inside the figure, under its title."""
    import warnings

    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from headprobe.analyses import atlas, figures

    table = pd.read_csv(Path(__file__).resolve().parents[1] / "figures" / "atlas" / "atlas.csv")
    names, types = atlas.model_labels(table)[:n_models], atlas.table_types(table)
    table = table[table["model"].isin(names)].drop(columns=[f"{t}_top" for t in types[n_types:]])
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the collapse is only a warning in matplotlib
        fig = atlas.atlas_overview(table, "Head atlas: a test")
        figures.save_figure(fig, tmp_path / "overview")
        canvas = FigureCanvasAgg(fig)
        canvas.draw()
    drawn = [ax for ax in fig.axes if ax.axison]
    assert len(drawn) == n_types
    for ax in drawn:
        box = ax.get_window_extent(canvas.get_renderer())
        assert box.height >= 0.15 * n_models * fig.dpi and box.y0 > 0 and box.y1 < fig.bbox.height


@pytest.mark.figures
@pytest.mark.parametrize("n_models", [1, 2, 3])
def test_a_depth_plot_of_one_or_two_models_keeps_a_row_for_each(n_models, tmp_path):
    """atlas_<type>.png was as tall as the legend under it plus 0.28 in a model: with one model the
    constrained layout collapsed the axes ("constrained_layout not applied"), with two the model
    names overlapped. Each model's name now lies inside the axes, apart from the others'."""
    import warnings

    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from headprobe.analyses import atlas, figures

    table = pd.read_csv(Path(__file__).resolve().parents[1] / "figures" / "atlas" / "atlas.csv")
    names = atlas.model_labels(table)[:n_models]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the collapse is only a warning in matplotlib
        fig = atlas.depth_plot(table[table["model"].isin(names)], "induction")
        figures.save_figure(fig, tmp_path / "depth")
        canvas = FigureCanvasAgg(fig)
        canvas.draw()
    renderer = canvas.get_renderer()
    ax = fig.axes[0]
    axes_box = ax.get_window_extent(renderer)
    boxes = sorted((t.get_window_extent(renderer) for t in ax.get_yticklabels()), key=lambda b: b.y0)
    assert [t.get_text() for t in ax.get_yticklabels()] == names
    assert all(axes_box.y0 <= b.y0 and b.y1 <= axes_box.y1 for b in boxes)
    assert all(lower.y1 <= upper.y0 for lower, upper in zip(boxes, boxes[1:]))


def test_over_training_legend_names_the_no_verdict_cross_when_drawn():
    """A checkpoint whose scan gave no verdict is drawn as a cross; the legend listed only the
    filled and hollow markers. It names the cross where one is drawn, and only then."""
    import pandas as pd

    from headprobe.analyses.atlas import over_training_plot
    from headprobe.analyses.verdicts import LABELS

    def table(verdicts):
        return pd.DataFrame(
            {
                "step": [0, 100, 200],
                "induction": [0.1, 0.5, 0.9],
                "induction_top": ["0.1", "0.1", "0.1"],
                "induction_verdict": verdicts,
            }
        )

    def labels(fig):
        return [t.get_text() for t in fig.legends[0].get_texts()]

    with_none = labels(over_training_plot(table([LABELS[None], LABELS[False], LABELS[True]]), "t"))
    without = labels(over_training_plot(table([LABELS[False], LABELS[True], LABELS[True]]), "t"))
    assert LABELS[None] in with_none and LABELS[None] not in without
    assert {"induction", LABELS[True], LABELS[False]} <= set(without)  # "CONFIRMED", as every figure writes it


def test_over_training_title_names_the_family_and_the_checkpoints():
    """over_training.png was titled "head types over training (real scans)": neither the model nor how
    many checkpoints. It names the family of the checkpoints and counts them."""
    import pandas as pd

    from headprobe.commands.atlas_core import over_training_title

    table = pd.DataFrame(
        {
            "model": ["step 0", "step 0", "step 100", "other"],
            "family": ["headprobe toy", "headprobe toy", "headprobe toy", "gpt2"],
            "step": [0, 0, 100, None],
        }
    )
    assert over_training_title(table) == "Head types over training, headprobe toy (2 checkpoints)"
    assert over_training_title(table.iloc[:2]) == "Head types over training, headprobe toy (1 checkpoint)"


def test_over_training_reads_its_markers_from_a_saved_atlas_csv():
    """atlas.csv writes the verdict of a head outside the top k as an empty cell, which pandas reads
    back as NaN: over_training_plot took that NaN (the step's first head) as the step's verdict and
    drew no marker at all. Drawn from the CSV, it puts the same markers as from the table in memory."""
    import io

    import pandas as pd

    from headprobe.analyses.atlas import over_training_plot
    from headprobe.analyses.verdicts import LABELS

    table = pd.DataFrame(
        {
            "step": [0, 0, 100, 100],
            "induction": [0.1, 0.2, 0.5, 0.9],
            "induction_top": [False, True, False, True],
            "induction_verdict": ["", LABELS[False], "", LABELS[True]],
        }
    )
    saved = pd.read_csv(io.StringIO(table.to_csv(index=False)))

    def markers(fig):  # (facecolour is white: hollow, filled) per scatter, in drawing order
        return [tuple(c.get_facecolor()[0]) == (1.0, 1.0, 1.0, 1.0) for c in fig.axes[0].collections]

    drawn = markers(over_training_plot(table, "t"))
    assert drawn == [True, False]  # hollow at step 0 (not confirmed), filled at 100
    assert markers(over_training_plot(saved, "t")) == drawn


def test_the_readmes_atlas_time_is_the_committed_runs():
    """The README quotes the committed atlas run's time; it drifted once (1,305 s beside a rerun's
    1,856 s): it must be ``timings_s.run_s`` of figures/atlas/summary.json, rounded."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    run_s = json.loads((root / "figures" / "atlas" / "summary.json").read_text())["timings_s"]["run_s"]
    quoted = re.search(r"committed rerun of [0-9-]+ took ([0-9,]+) s", (root / "README.md").read_text())
    assert quoted is not None and int(quoted.group(1).replace(",", "")) == round(run_s), (quoted, run_s)


@pytest.mark.figures
def test_a_toy_atlas_marks_and_names_its_layers_on_the_depth_axis():
    """A 2-layer toy's atlas row had no layer dividers: which dot is in which layer could not be told. Each row
    carries a divider at every layer boundary (1/2 for 2 layers; 29 of them for 30), and a panel whose models all
    have the same few layers names their bands (L0, L1) on the top axis; panels of models of different depths do
    not."""
    from matplotlib.collections import LineCollection

    from headprobe.analyses import atlas

    def dividers(ax) -> list[float]:
        segments = [seg for c in ax.collections if isinstance(c, LineCollection) for seg in c.get_segments()]
        return sorted(float(seg[0][0]) for seg in segments if seg[0][0] == seg[1][0])

    table = pd.read_csv(Path(__file__).resolve().parents[1] / "figures" / "atlas" / "atlas.csv")
    toy = table[table["model"] == "toy"]
    assert set(toy["n_layers"]) == {2}
    for fig in (atlas.depth_plot(toy, "induction"), atlas.atlas_overview(toy)):
        ax = fig.axes[0]
        assert dividers(ax) == [0.5], dividers(ax)
        named = [a for a in ax.child_axes if hasattr(a, "get_xticklabels")]
        assert [t.get_text() for a in named for t in a.get_xticklabels()] == ["L0", "L1"]
        assert [t for a in named for t in a.get_xticks()] == pytest.approx([0.25, 0.75])
    mixed = atlas.depth_plot(table, "induction")
    assert len(dividers(mixed.axes[0])) == sum(n - 1 for n in table.groupby("model")["n_layers"].first())
    assert not mixed.axes[0].child_axes


def test_atlas_summary_states_each_models_self_check(atlas_run):
    """summary.json's ``self_check`` gives, per scanned model, which identity checks held (patterns,
    per-head W_O decomposition), read against each model's own scan summary.json, and all_ok over
    them (it was null although every scan had one). A failed model has no scan and is not listed."""
    out, models, _ = atlas_run
    summary = json.loads((out / "summary.json").read_text())
    got = summary["self_check"]
    scans = {
        m: json.loads((out / summary["models"][m]["dir"] / "summary.json").read_text())["self_check"]
        for m in (models[0], models[2])
    }
    assert set(got["models"]) == set(scans)
    for m, ref in scans.items():
        want = {k: ref[k] for k in ("ok", "patterns_ok", "decomposition_ok", "max_relative_error")}
        assert got["models"][m] == want, m
    assert got["all_ok"] is all(ref["ok"] for ref in scans.values())
    assert got["max_relative_error"] == max(ref["max_relative_error"] for ref in scans.values())


@pytest.mark.figures
def test_every_depth_tick_of_an_atlas_is_labelled():
    """The depth axis had ticks at 0, 0.5 and 1 and labelled only the ends: the middle tick read as a
    forgotten label. Every tick of a depth plot and of each overview panel carries its number."""
    from headprobe.analyses import atlas

    table = pd.read_csv(Path(__file__).resolve().parents[1] / "figures" / "atlas" / "atlas.csv")
    for fig in (atlas.depth_plot(table, "induction"), atlas.atlas_overview(table)):
        for ax in [a for a in fig.axes if a.get_xlabel() == atlas.DEPTH_LABEL]:
            ticks = [float(v) for v in ax.get_xticks()]
            assert ticks == [0.0, 0.5, 1.0], ticks
            assert [t.get_text() for t in ax.get_xticklabels()] == ["0", "0.5", "1"]


@pytest.mark.figures
def test_the_depth_axis_says_how_a_layer_is_drawn_and_how_the_csv_differs():
    """The atlas figure's axis read "first layer (0) to last (1)" while each layer l of L is drawn across
    l/L to (l+1)/L, and atlas.csv's relative_depth is l/(L-1): the toy's last-layer induction heads (1.00 in the
    CSV) sat at 0.6-0.97. Each top head's dot lies inside its layer's band, and the axis and the legend say both."""
    from headprobe.analyses import atlas

    table = pd.read_csv(Path(__file__).resolve().parents[1] / "figures" / "atlas" / "atlas.csv")
    fig = atlas.depth_plot(table, "induction")
    (ax,) = [a for a in fig.axes if a.get_xlabel() == atlas.DEPTH_LABEL]
    assert "l/L to (l+1)/L" in atlas.DEPTH_LABEL
    assert any("relative_depth is l/(L-1)" in h.get_label() for h in atlas._legend_handles())
    toy = table[(table["model"] == "toy") & table["induction_top"].fillna(False).astype(bool)]
    y = atlas.model_labels(table).index("toy")
    drawn = np.concatenate([c.get_offsets() for c in ax.collections if len(c.get_offsets())])
    dots = drawn[np.isclose(drawn[:, 1], y)]
    for layer in toy["layer"]:
        n = int(toy["n_layers"].iloc[0])
        assert ((dots[:, 0] >= layer / n) & (dots[:, 0] <= (layer + 1) / n)).any(), (layer, dots)


# ---------------------------------------------------------------------------------------------
# Remarks on what a verdict tests: shared top-k sets, scores no higher than uniform attention
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n_natural", "period", "bos"), [(48, 23, True), (128, 50, True), (16, 6, False), (9, 4, True)]
)
def test_the_uniform_attention_baselines_are_the_detectors_scores_of_a_uniform_causal_head(n_natural, period, bos):
    """uniform_baselines (the mean of 1/(q+1) over the queries each score reads) against the
    detectors themselves on a head that attends uniformly over its causal context
    (``tril(ones) / (q + 1)``): previous-token on a natural sequence of ``n_natural`` tokens,
    duplicate-token and induction on ``[BOS] r_1..r_S r_1..r_S``, with and without BOS."""
    from headprobe.analyses import detectors as det
    from headprobe.analyses.verdicts import uniform_baselines

    def uniform(T: int) -> torch.Tensor:
        return (torch.tril(torch.ones(T, T, dtype=torch.float64)) / torch.arange(1, T + 1)[:, None])[None, None]

    start = int(bos)
    T = start + 2 * period
    got = uniform_baselines(
        {"natural_text": {"seq_len": n_natural}, "repeated_random": {"period": period, "seq_len": T, "bos": bos}}
    )
    ref = {
        "previous_token": det.previous_token_score(uniform(n_natural)).item(),
        "duplicate_token": det.duplicate_token_score(uniform(T), period, start).item(),
        "induction": det.induction_score(uniform(T), period, start).item(),
    }
    assert got == pytest.approx(ref, rel=1e-6)  # the detectors read the pattern as float32


def _committed_atlas_model(model: str) -> tuple[pd.DataFrame, dict]:
    """A committed atlas model's head_scores.csv and the summary.json parts model_remarks reads,
    rebuilt from figures/atlas/atlas.csv (the models' own scan folders are not committed): the
    ablated sets are the ``<type>_top`` heads; the toy's token sets are those scan fits to its
    48-token context and its trained periods 4-23 (fit_lengths: 48 natural tokens, period 23 with BOS)."""
    from headprobe.analyses.data import fit_lengths

    table = pd.read_csv(Path(__file__).parents[1] / "figures" / "atlas" / "atlas.csv")
    rows = table[table["model"] == model].reset_index(drop=True)
    types = [c.removesuffix("_top") for c in rows.columns if c.endswith("_top") and rows[c].fillna(False).any()]
    heads = {t: [f"{a}.{b}" for a, b in zip(rows["layer"], rows["head"])] for t in types}
    ablations = [
        {"head_type": t, "kind": "mean", "tested": True, "confirmed": None,
         "top_heads": [h for h, top in zip(heads[t], rows[f"{t}_top"].fillna(False)) if top]}
        for t in types
    ]  # fmt: skip
    seq_len, period = fit_lengths(48, None, None, (4, 23, 12))
    tokens = {
        "natural_text": {"seq_len": seq_len},
        "repeated_random": {"period": period, "seq_len": 1 + 2 * period, "bos": True},
    }
    return rows, {"ablations": ablations, "tokens": tokens if model == "toy" else {}, "metric": {"name": "loss"}}


def test_the_committed_toy_atlas_remarks_its_duplicate_token_verdict():
    """The committed atlas's toy model: four duplicate-token heads CONFIRMED with scores 0.021-0.039,
    three of them also previous-token's top heads. model_remarks says both (read off atlas.csv
    here: 0.6, 1.2 and 1.6 in both sets; 1.0 (0.0376) and 1.2 (0.0388) above the uniform head's
    (H_47 - H_24) / 23 = 0.0288, 0.6 (0.0213) and 1.6 (0.0264) below); SmolLM2's sets share at most
    half their heads and get none. The old code said nothing (no model_remarks)."""
    from fractions import Fraction

    rows, summary = _committed_atlas_model("toy")
    said = atlas_lib.model_remarks(rows, summary)
    base = float(sum(Fraction(1, q + 1) for q in range(24, 47)) / 23)
    assert set(said) == {"previous_token", "duplicate_token"}
    assert said["previous_token"] == [
        "previous-token: 3 of its 4 top heads (0.6, 1.2, 1.6) are also duplicate-token's top heads, so its verdict "
        "re-tests much of that set"
    ]
    assert said["duplicate_token"][0].startswith(
        "duplicate-token: 3 of its 4 top heads (0.6, 1.2, 1.6) are also previous-token's"
    )
    assert said["duplicate_token"][1].startswith(
        f"duplicate-token: 2 of its 4 top heads score at or below {base:.3g}, the duplicate-token score of a head "
        f"attending uniformly over its causal context (the highest, 0.0388, is {0.03882 / base:.2g}x it)"
    )
    for model in ("smollm2-135m", "all-minilm-l6-v2"):
        assert atlas_lib.model_remarks(*_committed_atlas_model(model)) == {}, model


def test_the_atlas_records_and_prints_each_models_verdict_remarks(atlas_run, text_file, monkeypatch):
    """summary.json's ``models.<label>.verdict_remarks`` holds the remarks of each model's own scan
    files (absent where a model has none: the random tiny models' top-2 heads score above a uniform
    head's and share no set), and the report prints each as a NOTE naming the model (a scripted
    remark on a resumed run: the remarks are recomputed from the scan's files)."""
    out, models, _ = atlas_run
    summary = json.loads((out / "summary.json").read_text())
    for m in (models[0], models[2]):
        d = out / "models" / summary["models"][m]["dir"].split("/", 1)[1]
        scan = json.loads((d / "summary.json").read_text())
        ref = atlas_lib.model_remarks(pd.read_csv(d / "head_scores.csv"), scan)
        assert summary["models"][m].get("verdict_remarks", {}) == ref, m
    monkeypatch.setattr(
        atlas_lib, "model_remarks", lambda scores, s: {"induction": [f"induction: {len(scores)} heads"]}
    )
    result = headprobe.atlas(models=models, out=out, overwrite=True, text=str(text_file), **SMALL)
    written = json.loads((out / "summary.json").read_text())["models"]
    assert written[models[0]]["verdict_remarks"] == {"induction": ["induction: 16 heads"]}
    assert "verdict_remarks" not in written[models[1]]  # the failed model
    notes = [ln for ln in result.report().splitlines() if ln.startswith("NOTE: ") and " heads" in ln]
    assert notes == [f"NOTE: {models[0]} induction: 16 heads", f"NOTE: {models[2]} induction: 8 heads"]


def test_a_note_shared_by_many_checkpoints_is_printed_once_with_a_count():
    """An atlas over checkpoints of one model on one text printed the same left-out NOTE once per
    checkpoint (26 times for 26). The committed atlas-training run (13 checkpoints, each 545 of
    9,896 windows left out, read from its summary.json): one NOTE, 'for 13 checkpoints'. The mixed
    atlas run (three models, no count shared): each NOTE as before, by its model's name."""
    from headprobe.analyses.data import left_out_notes_of
    from headprobe.commands.atlas_core import _window_sets, grouped_left_out_notes

    root = Path(__file__).resolve().parents[1] / "figures"
    models = json.loads((root / "atlas-training" / "summary.json").read_text())["models"]
    counts = {(m["windows_left_out"], m["windows_available"]) for m in models.values()}
    assert len(models) == 13 and counts == {(545, 9351)}  # the reference: one count shared by all
    (note,) = grouped_left_out_notes(models)
    first = list(models)[:3]
    assert note.startswith(
        f"for 13 checkpoints ({', '.join(first)}, ..., {list(models)[-1]}): 545 of the text's 9896 windows"
    )
    mixed = json.loads((root / "atlas" / "summary.json").read_text())["models"]
    sets = _window_sets(mixed)  # each model's natural text and retrieval haystack, by name
    left = [(s["windows_left_out"], s["windows_available"]) for s in sets.values() if s.get("windows_left_out")]
    assert len(left) == len(set(left)) == 4  # no count shared: each NOTE as before, by its name
    assert grouped_left_out_notes(mixed) == left_out_notes_of(sets)


def test_an_atlas_says_a_plan_note_every_checkpoint_shares_once_with_its_count(train_run, tmp_path, capsys):
    """Each checkpoint's scan printed its verification plan's NOTE (here: 2 control sets cannot give a
    verdict), the same line once per checkpoint. Now it is said once as the first scan plans, and once
    at the end with the count. Reference: each checkpoint's own scan, run alone, says the line."""
    _, run = train_run
    small = dict(n_natural=2, seq_len=16, n_repeated=2, period=6, k=1, n_random=2, device="cpu", types="induction")
    headprobe.atlas(
        checkpoints=str(run), out=tmp_path / "a", pattern_len=0, model_figures=False, progress=True, **small
    )
    err = capsys.readouterr().err
    headprobe.scan(str(run / "checkpoints" / "step-000003"), progress=True, **small)
    alone = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("NOTE: ")]
    assert alone  # the scan of one checkpoint has a plan NOTE
    lines = err.splitlines()
    for note in alone:
        assert lines.count(note) == 1, (note, err[-3000:])
        assert lines.count(f"{note} (for 3 checkpoints; shown once above)") == 1, err[-3000:]


def test_keep_n_random_reaches_every_models_scan():
    """``atlas --n-random 19`` printed "raised to 99 (--keep-n-random keeps it)", and ``atlas --keep-n-random`` was
    an unrecognized argument: an atlas could not be kept small. The flag is atlas's and every model's scan takes it."""
    from headprobe.cli import build_parser
    from headprobe.commands.atlas import AtlasConfig
    from headprobe.settings import from_args

    parse = lambda *argv: from_args(AtlasConfig, build_parser().parse_args(["atlas", "--out", "o", *argv]))
    scan = parse("--n-random", "19", "--keep-n-random").scan_config("smollm2-135m")
    assert (scan.n_random, scan.keep_n_random) == (19, True)
    assert parse().scan_config("smollm2-135m").keep_n_random is False


def test_a_type_figure_over_checkpoints_says_over_training():
    """walk-atlas: atlas_induction.png of `--checkpoints` was titled "induction heads across models"
    where its rows are one model's training steps; the models' atlas keeps its title."""
    from pathlib import Path

    import pandas as pd

    from headprobe.analyses.atlas import depth_plot

    figures = Path(__file__).resolve().parents[1] / "figures"
    steps = depth_plot(pd.read_csv(figures / "atlas-training" / "atlas.csv"), "induction")
    models = depth_plot(pd.read_csv(figures / "atlas" / "atlas.csv"), "induction")
    assert steps.axes[0].get_title() == "induction heads over training"
    assert models.axes[0].get_title() == "induction heads across models"
