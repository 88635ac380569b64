"""Usage errors refused fast and in one line (before torch loads), text inputs with a
byte-order mark, integer fields of KV policies, prompts longer than the context.

The speed is checked without timing: ``python -X importtime`` lists every module a process
imports, and a refusal that imports no torch module costs well under a second (torch alone is
5-25 s on this machine); :func:`test_the_import_probe_sees_torch_when_it_loads` shows the probe
is not vacuous."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _imports(argv, cwd, env=None):
    """``(exit status, the non-importtime stderr lines, the names of the modules imported)`` of
    ``headprobe ARGV``."""
    import os

    from test_loading import imported_modules

    r = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "headprobe", *argv],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        timeout=300,
    )
    imported, errors = imported_modules(r.stderr)
    return r.returncode, errors.splitlines(), imported


def _refuse(argv, cwd, env=None):
    """``(exit status, the non-importtime stderr lines, torch imported?)`` of ``headprobe ARGV``."""
    code, errors, imported = _imports(argv, cwd, env)
    return code, errors, "torch" in imported


LONG = "word " * 9000  # 9,001 tokens or so: longer than SmolLM2's 8,192 positions


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["patch", "--heads", "99.99", "--out", "o"], "head 99.99 is out of range: the model has 30 layers"),
        (
            ["circuit", "--receivers", "99.1:k", "--out", "o"],
            "head 99.1 is out of range: the model has 30 layers of 9 heads",
        ),
        (
            ["circuit", "--qk-head", "40.1", "--out", "o"],
            "head 40.1 is out of range: the model has 30 layers of 9 heads",
        ),
        (["scan", "--model", "nosuchmodel", "--out", "o"], "unknown model name nosuchmodel"),
        (["scan", "--model", "", "--out", "o"], "the model name is empty; give --model a name or a path"),
        (["ablate", "--model", " ", "--out", "o"], "the model name is empty"),
        (
            ["show", "--model", "nosuchmodel", "--head", "1.1", "--prompt", "hi", "--out", "o"],
            "unknown model name nosuchmodel",
        ),
        (["ablate", "--model", "not a/repo", "--out", "o"], "unknown model 'not a/repo'"),
        (["show", "--head", "1.1", "--prompt", "", "--out", "o"], "the prompt is empty"),
        (["show", "--head", "1.1", "--prompt", LONG, "--out", "o"], "tokens; show draws 3 to 8192"),
        (["patch", "--bogus"], "required: --out"),
        (["train", "--bogus", "--out", "o"], "unrecognized arguments: --bogus"),
        (["study", "heads", "--steps", "x", "--out", "o"], "--steps"),
        (["circuit", "--out", "o", "--n-seqs", "x"], "--n-seqs: must be a positive integer"),
        (["scnn"], "invalid choice: 'scnn'"),
        (["view", "missing-folder"], "missing-folder is not a directory"),
        (["scan", "-k", "1000", "--out", "o"], "--top-k 1000 leaves no random control: the model has 270 heads"),
        (
            ["scan", "--alpha", "1.5", "--out", "o"],
            "must be between 0 and 1 (exclusive), got 1.5 (see headprobe scan --help)",
        ),
    ],
)
def test_usage_errors_are_refused_before_torch_is_imported(tmp_path, argv, fragment):
    """Item 13: each usage error of the issue in one line, exit 2, nothing written, and no torch
    module imported (these took 9-89 s after a load; now well under 3 s)."""
    code, errors, torch = _refuse(argv, tmp_path)
    assert code == 2 and len(errors) == 1 and errors[0].startswith("headprobe: error:") and fragment in errors[0], (
        errors
    )
    assert not torch
    assert not (tmp_path / "o").exists()


# What each command needs besides the bad flag, so that the flag is what argparse refuses.
REQUIRED = {
    "scan": ["--out", "o"],
    "budget": [],
    "ablate": ["--out", "o"],
    "prune": ["--out", "o"],
    "train": ["--out", "o"],
    "study": ["heads", "--out", "o"],
    "view": ["d"],
    "show": ["--head", "1.1", "--prompt", "x", "--out", "o"],
    "atlas": ["--out", "o"],
    "patch": ["--out", "o"],
    "circuit": ["--out", "o"],
    "kv": ["--out", "o"],
    "export": ["--from", "d", "--out", "o"],
    "import": ["--heads-file", "h.txt"],
    "robustness": ["--out", "o"],
    "diff": ["a", "b", "--out", "o"],
}


def test_every_command_is_in_the_bad_flag_list():
    from headprobe.commands import COMMANDS

    assert sorted(REQUIRED) == sorted(COMMANDS.names())


@pytest.mark.parametrize("command", sorted(REQUIRED))
def test_a_bad_flag_of_every_command_is_refused_before_torch_is_imported(tmp_path, command):
    """Every command's parser is made from its settings without torch: a misspelt flag is one line, exit 2."""
    code, errors, torch = _refuse([command, *REQUIRED[command], "--no-such-flag"], tmp_path)
    assert (
        code == 2
        and len(errors) == 1
        and errors[0].startswith("headprobe: error: unrecognized arguments: --no-such-flag")
    ), errors
    assert not torch
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (
            ["scan", "--pattern-len", "1", "--out", "o"],
            "--pattern-len must be 0 (no patterns.npz) or at least 2, got 1",
        ),
        (["ablate", "--heads", "5.x", "--out", "o"], "5.x"),
        (["prune", "--step-fraction", "2", "--out", "o"], "--step-fraction must be in (0, 1], got 2.0"),
        (["train", "--lr", "-1", "--out", "o"], "--lr must be a positive number, got -1.0"),
        (["study", "layouts", "--rope", "3", "--out", "o"], "--rope must be an even positive integer"),
        (["atlas", "--model", "gpt2", "--out", "o"], "headprobe atlas takes --models (one or more), not --model"),
        (  # the base's own sequences again (same period and seed): the condition ran and said stability 1
            ["robustness", "--model", "nosuchmodel", "--period", "10", "--other-period", "10", "--out", "o"],
            "--other-period 10 is --period 10: the other-period condition would repeat the base",
        ),
    ],
)
def test_a_value_the_config_refuses_is_refused_before_torch_is_imported(tmp_path, argv, fragment):
    """The Config made from the flags checks their values before the run target (which may import torch) is."""
    code, errors, torch = _refuse(argv, tmp_path)
    assert code == 2 and len(errors) == 1 and errors[0].startswith("headprobe: error:") and fragment in errors[0], (
        errors
    )
    assert not torch
    assert not (tmp_path / "o").exists()


def test_a_prompt_too_short_for_the_scores_is_refused_before_loading(tmp_path):
    """Item 15: ``show --prompt w`` (2 tokens with BOS): refused before loading, naming the
    tokens the pattern's scores need; the count is that of the model's own tokenizer (checked in
    test_the_pre_load_token_count_is_the_loaded_tokenizers)."""
    code, errors, torch = _refuse(["show", "--head", "1.1", "--prompt", "w", "--out", "o"], tmp_path)
    assert code == 2 and len(errors) == 1 and "at least 3 tokens" in errors[0] and not torch, errors


def test_the_pre_load_token_count_is_the_loaded_tokenizers(tiny_dir, tiny_llama_gqa_native):
    """The count made before loading (tokenizers over tokenizer.json) equals the loaded model's."""
    from headprobe.options import peek_token_count

    for text in ("t1 t2 t3", "t5", "t7 t8 " * 40):
        assert peek_token_count(str(tiny_dir), text) == tiny_llama_gqa_native.to_tokens(text).shape[1]


def test_the_import_probe_sees_torch_when_it_loads(tmp_path, tiny_dir):
    """The probe above is not vacuous: the same patch command on a head in range loads the model (and
    torch). It draws no figure (``$HEADPROBE_FIGURE_FORMATS=none``, as in the whole suite), so it
    imports no matplotlib (0.3-0.5 s of each of the suite's command processes: ``figures`` and
    ``atlas`` imported it at their top)."""
    pairs = tmp_path / "p.jsonl"
    pairs.write_text(
        "\n".join(
            json.dumps({"clean": "t1 t2 t3", "corrupted": "t4 t5 t6", "correct": " t7", "wrong": " t8"})
            for _ in range(2)
        )
        + "\n",
        encoding="utf-8",
    )
    code, errors, imported = _imports(
        ["patch", "--model", str(tiny_dir), "--prompts", str(pairs), "--heads", "1.1", "--out", "o", "--device", "cpu"],
        tmp_path,
        env={"HEADPROBE_FIGURE_FORMATS": "none"},
    )
    assert code == 0 and "torch" in imported and "pandas" in imported, errors
    assert (tmp_path / "o" / "head_patching.csv").exists() and not list((tmp_path / "o").glob("*.png"))
    assert "matplotlib" not in imported


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["budget", "--seq-len", "0"], "argument --seq-len: must be a positive integer, got 0"),
        (["budget", "--json", "--bogus"], "unrecognized arguments: --bogus"),
        (["patch", "--out", "o", "--site", "w"], "argument --site: invalid choice: 'w'"),
        (
            ["show", "--head", "1.1", "--prompt", "x", "--prompt-file", "y", "--out", "o"],
            "argument --prompt-file: not allowed with argument --prompt",
        ),
        (["show", "--head", "1.1", "--out", "o"], "one of the arguments --prompt --prompt-file is required"),
        (["view", "d", "--pattern-len", "x"], "argument --pattern-len: must be a positive integer, got 'x'"),
        (["view"], "the following arguments are required: DIR"),
        (["study", "--out", "o"], "the following arguments are required: {heads,layouts} (see"),  # not "which"
        (["circuit", "--out", "o", "--method", "x"], "argument --method: invalid choice: 'x'"),
        (
            ["kv", "--out", "o", "--kv-budget", "0.5", "--loss-tolerance", "0.1"],
            "argument --loss-tolerance: not allowed with argument --kv-budget",
        ),
        (["kv", "--out", "o", "--device-map", "auto"], "unrecognized arguments: --device-map"),  # --no-bos: taken now
    ],
)
def test_generated_flags_refuse_bad_input_before_torch_is_imported(tmp_path, argv, fragment):
    """The flags generated from budget's, patch's, show's, view's, circuit's and
    kv's Configs (argument groups, mutually exclusive flags, a positional DIR) refuse a bad flag in
    one line, exit 2, with no torch module imported."""
    code, errors, torch = _refuse(argv, tmp_path)
    assert code == 2 and len(errors) == 1 and errors[0].startswith("headprobe: error:") and fragment in errors[0], (
        errors
    )
    assert not torch
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("command", ["budget", "patch", "show", "view", "circuit", "kv", "atlas"])
def test_help_imports_no_torch(tmp_path, command):
    """``headprobe COMMAND --help`` prints its flags without importing torch (kv and atlas among them,
    whose runs need it)."""
    code, errors, torch = _refuse([command, "--help"], tmp_path)
    assert code == 0 and not errors and not torch


def _long_pairs(path, n_tokens):
    words = " ".join(f"t{i % 100}" for i in range(n_tokens))
    path.write_text(
        "\n".join(json.dumps({"clean": words, "corrupted": words, "correct": " t1", "wrong": " t2"}) for _ in range(2))
        + "\n",
        encoding="utf-8",
    )
    return path


def test_patch_refuses_prompts_longer_than_the_context_before_loading(tmp_path, tiny_dir):
    """Item 10: 201-word prompts (202 tokens with BOS) on a rotary model of 128 positions: refused from
    config.json and tokenizer.json, before torch loads (it used to run and write results)."""
    pairs = _long_pairs(tmp_path / "long.jsonl", 201)
    code, errors, torch = _refuse(["patch", "--model", str(tiny_dir), "--prompts", str(pairs), "--out", "o"], tmp_path)
    assert code == 2 and len(errors) == 1 and not torch, errors
    assert "the clean prompt is 202 tokens, longer than the model's context of 128 positions" in errors[0]
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("backend", ["native", "bridge"])
def test_patch_refuses_prompts_longer_than_the_context_on_a_loaded_model(
    tmp_path, backend, tiny_llama_gqa_native, tiny_llama_gqa
):
    """Item 10, after loading (a model given as a LoadedModel, where no config.json is read): both backends."""
    import headprobe
    from headprobe.probe.core.errors import HeadprobeError

    model = tiny_llama_gqa_native if backend == "native" else tiny_llama_gqa
    assert model.spec.n_ctx == 128
    with pytest.raises(HeadprobeError, match="202 tokens, longer than the model's context of 128 positions"):
        headprobe.patch(model, prompts=str(_long_pairs(tmp_path / "long.jsonl", 201)), heads="0.1")
    headprobe.patch(model, prompts=str(_long_pairs(tmp_path / "ok.jsonl", 127)), heads="0.1")  # 128 tokens: fits


def test_a_byte_order_mark_is_dropped_from_text_inputs(tmp_path, tiny_dir, tiny_llama_gqa_native):
    """Item 9: a prompts file and a --text file saved with a UTF-8 byte-order mark read as without it
    (the prompts were refused as 'line 1: expected a JSON object'; --text's first word became unknown)."""
    from headprobe.commands.patch import PatchConfig
    from headprobe.probe.core.io import open_text_file, read_text_file

    line = json.dumps({"clean": "t1 t2 t3", "corrupted": "t4 t5 t6", "correct": " t7", "wrong": " t8"})
    plain, marked = tmp_path / "plain.jsonl", tmp_path / "marked.jsonl"
    plain.write_text(f"{line}\n{line}\n", encoding="utf-8")
    marked.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    assert (
        PatchConfig(model=str(tiny_dir), prompts=str(marked)).read_pairs()
        == PatchConfig(model=str(tiny_dir), prompts=str(plain)).read_pairs()
    )
    text = tmp_path / "text.txt"
    text.write_bytes("\ufeff".encode() + b"t3 t4 t5\n")
    assert read_text_file(text) == "t3 t4 t5\n"
    assert "".join(piece for piece, _ in open_text_file(text).pieces(piece_bytes=2)) == "t3 t4 t5\n"
    ids = tiny_llama_gqa_native.to_tokens(read_text_file(text))[0].tolist()
    assert ids == tiny_llama_gqa_native.to_tokens("t3 t4 t5\n")[0].tolist() and ids[1] == 3
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xef\xbb\xbfab\xffc")
    with pytest.raises(Exception, match="byte 5 is invalid"):  # byte numbers still count the mark
        read_text_file(bad)


@pytest.mark.parametrize("value", ["1e999", "Infinity", "0.9", "true", '"3"'])
def test_kv_policy_integers_must_be_json_integers(tmp_path, capsys, value):
    """Item 7: 1e999 / Infinity in an integer field ended in an OverflowError traceback, 0.9 was
    truncated to layer 0; each is now one line, exit 2. A byte-order mark is read."""
    from headprobe.cli import main

    groups = [{"layer": layer, "kv_group": g, "cache": "full"} for layer in range(32) for g in range(8)]
    good = {"format": "headprobe-kv-policy", "version": 1, "n_layers": 32, "n_kv_groups": 8, "groups": groups}
    ok = tmp_path / "ok.json"
    ok.write_bytes(b"\xef\xbb\xbf" + json.dumps(good).encode())
    assert main(["budget", "--preset", "llama3-8b", "--policy", str(ok)]) == 0
    capsys.readouterr()
    for where in ("n_layers", "layer"):
        text = (
            json.dumps(good).replace('"n_layers": 32', f'"n_layers": {value}')
            if where == "n_layers"
            else json.dumps(good).replace('"layer": 0,', f'"layer": {value},', 1)
        )
        bad = tmp_path / "bad.json"
        bad.write_text(text, encoding="utf-8")
        assert main(["budget", "--preset", "llama3-8b", "--policy", str(bad)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("headprobe: error:") and "\n" not in err and f"'{where}' must be an integer" in err, err


def test_write_json_takes_numpy_scalars_and_pandas_missing_values(tmp_path):
    """Item 15: numpy float32/int64/bool_ are written as the numbers they hold (NaN float32 as null,
    the rule NaN follows), pandas NA and NaT as null; the file is strict JSON (json.loads with no NaN)."""
    import numpy as np
    import pandas as pd

    from headprobe.probe.core.io import write_json

    obj = {
        "f": np.float32(0.25),
        "i": np.int64(3),
        "b": np.bool_(True),
        "nan": np.float32("nan"),
        "na": pd.NA,
        "nat": pd.NaT,
        "list": [np.float64(1.5), np.float16("inf")],
    }
    write_json(tmp_path / "x.json", obj)
    strict = json.loads((tmp_path / "x.json").read_text(), parse_constant=lambda c: pytest.fail(f"bare {c}"))
    assert strict == {"f": 0.25, "i": 3, "b": True, "nan": None, "na": None, "nat": None, "list": [1.5, None]}


@pytest.mark.parametrize(
    "call, said", [("scan", "the flag --top-k is the setting k"), ("budget", "did you mean preset\\?")]
)
def test_api_keyword_errors_suggest_the_nearest_keyword(call, said):
    """Item 15: scan(top_k=3) (the flag is --top-k, the keyword k) and budget(prest=...) name the keyword meant."""
    import headprobe

    with pytest.raises(TypeError, match=said):
        getattr(headprobe, call)(**({"top_k": 3} if call == "scan" else {"prest": "llama3-8b"}))


def test_atlas_refuses_unknown_models_before_writing(tmp_path):
    """Item 11: --models a,b exited 1 with an atlas of 0 heads; hub-style names ended in HFValidationError."""
    for models in ("a,b", "smollm2-135m,x y/z"):
        code, errors, torch = _refuse(["atlas", "--models", models, "--out", "o"], tmp_path)
        assert code == 2 and len(errors) == 1 and "unknown model" in errors[0] and "HFValidation" not in errors[0], (
            errors
        )
        assert not (tmp_path / "o").exists()  # (atlas's module still imports torch: not item 13's list)


@pytest.mark.parametrize("backend", ["native", "bridge"])
def test_capture_heads_counts_negative_indices_from_the_end(backend, tiny_llama_gqa_native, tiny_llama_gqa):
    """Item 5: rows=[-1] gave an all-NaN pattern on the native backend (its causal mask built from
    position -1) and the last row on the bridge; now both give the full capture's last row, layer -1 is
    the last layer (keyed by its index), head -1 the last head; out of range: one HeadprobeError line."""
    import torch

    from headprobe.probe.core.errors import HeadprobeError
    from headprobe.probe.hooks.capture import capture_heads

    model = tiny_llama_gqa_native if backend == "native" else tiny_llama_gqa
    tokens = model.to_tokens("t1 t2 t3 t4 t5")
    full = capture_heads(model, tokens)
    T, L, H = tokens.shape[1], model.spec.n_layers, model.spec.n_heads
    got = capture_heads(model, tokens, layers=[-1], heads=[-1, 0], rows=[-1, 1])
    assert list(got["pattern"]) == [L - 1]
    want = full["pattern"][L - 1][:, [H - 1, 0]][:, :, [T - 1, 1]]
    torch.testing.assert_close(got["pattern"][L - 1], want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got["z"][L - 1], full["z"][L - 1][:, :, [H - 1, 0]])
    for bad in ({"rows": [T]}, {"rows": [-T - 1]}, {"layers": [L]}, {"heads": [-H - 1]}):
        with pytest.raises(HeadprobeError, match="out of range|not an integer index") as e:
            capture_heads(model, tokens, **bad)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "argv, line",
    [
        (
            ["robustness", "--model", "{model}"],
            "robustness needs a causal language model (its verdicts are loss effects); {name} is an encoder",
        ),
        (
            ["diff", "smollm2-135m", "{model}"],
            "diff needs two causal language models (its ablation effects are loss effects)",
        ),
        (
            ["patch", "--model", "{model}"],
            "{name} is an encoder: patching's logit difference needs a language-model head",
        ),
        (["kv", "--model", "{model}"], "{name} is an encoder; KV-cache policies are for causal decoders"),
        (
            ["circuit", "--model", "{model}"],
            "{name} is an encoder: path patching and edge attribution need a decoder (an encoder's post-LN blocks "
            "have no direct paths)",
        ),
    ],
    ids=["robustness", "diff", "patch", "kv", "circuit"],
)
def test_an_encoder_is_refused_before_the_load(tmp_path_factory, tmp_path, argv, line):
    """The embedded all-MiniLM-L6-v2 and a BERT folder (its config.json's model_type) are known as encoders
    before any weights load (diff: as model B): the one line each command gives after the load (robustness: require_causal's),
    exit 2, torch never imported, nothing written (as ablate and prune: tests/test_ablate_prune_cli.py)."""
    import zoo

    d = zoo.save_dir("bert", zoo.encoder_tokenizer(tmp_path_factory.mktemp("bert_tok")), tmp_path / "bert")
    for model, name in (("all-MiniLM-L6-v2", "all-minilm-l6-v2"), (str(d), str(d))):
        out = tmp_path / "x"
        code, errors, torch_loaded = _refuse([*(a.format(model=model) for a in argv), "--out", str(out)], tmp_path)
        assert (code, errors) == (2, [f"headprobe: error: {line.format(name=name)}"]), errors
        assert not torch_loaded
        assert not out.exists()


def test_every_command_with_a_text_file_checks_it_before_the_model_loads(tmp_path):
    """``kv --text /nonexistent`` was refused only after the model's load (its preflight did not
    read the file, scan's did): every command whose settings have ``text`` refuses an unreadable
    one in its preflight, which runs before the load (:func:`headprobe.options.run_command`)."""
    import dataclasses

    from headprobe.commands import COMMANDS
    from headprobe.probe.core.errors import HeadprobeError

    missing, checked = tmp_path / "nonexistent.txt", []
    required = {"heads_file": str(tmp_path / "heads.tsv"), "b": "smollm2-135m", "model": "smollm2-135m"}
    for name in COMMANDS.names():
        cls = COMMANDS.get(name).config_class()
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if "text" not in fields:
            continue
        needed = {k: v for k, v in required.items() if k in fields and fields[k].default is dataclasses.MISSING}
        with pytest.raises(HeadprobeError, match=f"cannot read text file {missing}"):
            cls(text=str(missing), **needed).preflight()  # atlas refuses it when its config is made
        checked.append(name)
    assert {"scan", "kv", "import", "diff"} <= set(checked), checked
