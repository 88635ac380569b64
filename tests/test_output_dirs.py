"""An output directory holds one run: ``--overwrite`` replaces the previous run's files (and says which
files it left), a run stopped while writing or failing leaves the directory as it was, and the
message on SIGTERM says what is true for the command."""

from __future__ import annotations

import json
import os
import signal

import pytest
import zoo

from headprobe.cli import main
from headprobe.probe.core.io import CHECKPOINT_NAME, OUTPUTS_NAME

SMALL = zoo.TINY_SCAN_FLAGS  # a scan of the tiny models in seconds


def _scan(tiny_dir, text_file, out, *extra):
    return main(
        ["scan", "--model", str(tiny_dir), "--out", str(out), "--text", str(text_file), *SMALL, "--no-metrics", *extra]
    )


def _names(d):
    return sorted(p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file())


@pytest.mark.figures
def test_overwrite_replaces_the_previous_runs_files_and_keeps_the_users(tiny_dir, text_file, tmp_path, capsys):
    out = tmp_path / "o"
    assert _scan(tiny_dir, text_file, out, "--types", "induction,previous_token", "--html") == 0
    first = set(_names(out))
    assert any("previous_token" in n for n in first)
    (out / "notes.txt").write_text("mine")
    capsys.readouterr()
    assert _scan(tiny_dir, text_file, out, "--types", "induction", "--overwrite") == 0
    stdout = capsys.readouterr().out
    # the reference: the same one-type scan into an empty directory
    assert _scan(tiny_dir, text_file, tmp_path / "fresh", "--types", "induction") == 0
    assert _names(out) == sorted([*_names(tmp_path / "fresh"), "notes.txt"])
    assert not any("previous_token" in n for n in _names(out)) and not (out / "index.html").exists()
    assert (out / "notes.txt").read_text() == "mine"
    assert "kept 1 file that no headprobe run recorded" in stdout and "notes.txt" in stdout
    assert json.loads((out / "summary.json").read_text())["config"]["types"] == ["induction"]


def test_a_page_view_wrote_is_replaced_by_the_next_overwrite(tiny_dir, text_file, tmp_path, capsys):
    """``headprobe view DIR`` wrote index.html without recording it: a later ``scan --out DIR
    --overwrite`` kept the old page (the earlier run's results) as a file "that no headprobe run
    recorded". Now view adds it to the run's list, before the summary; the next overwrite removes it."""
    out = tmp_path / "o"
    assert _scan(tiny_dir, text_file, out, "--types", "induction") == 0
    assert main(["view", str(out)]) == 0
    listed = json.loads((out / OUTPUTS_NAME).read_text())["files"]
    assert "index.html" in listed and listed[-1] == "summary.json"
    assert main(["view", str(out)]) == 0  # again: listed once
    assert json.loads((out / OUTPUTS_NAME).read_text())["files"] == listed
    capsys.readouterr()
    assert _scan(tiny_dir, text_file, out, "--types", "induction", "--overwrite") == 0
    assert not (out / "index.html").exists() and "no headprobe run recorded" not in capsys.readouterr().out


@pytest.mark.figures
def test_the_last_line_names_every_file_but_the_figures(tiny_dir, text_file, tmp_path, capsys):
    """The wrote line is computed from the paths a run saved: each table, summary and page by name,
    the figures counted with their format; the reference is the folder's listing."""
    out = tmp_path / "o"
    assert _scan(tiny_dir, text_file, out, "--types", "induction", "--html") == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    files = [n for n in _names(out) if n != OUTPUTS_NAME]
    figures = [n for n in files if n.endswith(".png")]
    listed = line.partition("(")[2].partition(";")[0].split(", ")
    assert line.startswith(f"wrote {len(files)} files to {out}/ (") and figures
    assert sorted(listed) == sorted(set(files) - set(figures)) and "index.html" in listed
    assert line.endswith(f"; {len(figures)} figure files, PNG)")


@pytest.mark.figures
def test_sigterm_while_writing_leaves_the_previous_run_whole(tiny_dir, text_file, tmp_path, capsys, monkeypatch):
    """Stopped after its table and before its figures, a ``--overwrite`` run leaves the folder as the
    previous run wrote it: its summary.json beside its own head_scores.csv, not another run's; the
    message starts on a line of its own and talks about scan, not about checkpoints."""
    import headprobe.analyses.figures as figs

    out = tmp_path / "o"
    assert _scan(tiny_dir, text_file, out, "--seed", "1") == 0
    before = {n: (out / n).read_bytes() for n in _names(out)}
    real_save = figs.save_figure

    def stop(fig, stem, *a, **k):  # the table is written by now
        os.kill(os.getpid(), signal.SIGTERM)
        return real_save(fig, stem, *a, **k)

    monkeypatch.setattr(figs, "save_figure", stop)
    capsys.readouterr()
    assert _scan(tiny_dir, text_file, out, "--seed", "2", "--overwrite") == 143
    err = capsys.readouterr().err
    # the previous run's files as they were, and this run's verification checkpoint (scan resumes)
    assert {n: (out / n).read_bytes() for n in _names(out) if n != CHECKPOINT_NAME} == before
    assert json.loads((out / "summary.json").read_text())["config"]["seed"] == 1
    last = err.rstrip("\n").split("\n")[-1]
    assert last.startswith("headprobe: terminated;") and "what it held before this run" in last
    assert "ablate" not in last and "resume" in last


def test_overwrite_with_a_file_list_from_an_older_headprobe(tmp_path):
    """A directory written before headprobe recorded its files: the old summary and the names only its
    writers use are replaced; figures and tables it cannot tell from the user's stay (and are listed)."""
    from headprobe.analyses.outputs import write_outputs
    from headprobe.probe.core.io import foreign_files

    out = tmp_path / "o"
    out.mkdir()
    for name in ("summary.json", "head_scores.csv", "heatmap_previous_token.png", "index.html", "notes.txt"):
        (out / name).write_text("old")
    (out / "mine").mkdir()
    with pytest.raises(Exception, match="--overwrite"):
        write_outputs(out, False, summary={"run": 2}, tables={"head_scores.csv": "x\n"})
    paths = write_outputs(out, True, summary={"run": 2}, tables={"head_scores.csv": "x\n"})
    assert [p.name for p in paths] == ["head_scores.csv", "summary.json"]
    assert _names(out) == [OUTPUTS_NAME, "head_scores.csv", "heatmap_previous_token.png", "notes.txt", "summary.json"]
    assert (out / "head_scores.csv").read_text() == "x\n" and not (out / "index.html").exists()
    assert foreign_files(out) == ["heatmap_previous_token.png", "mine", "notes.txt"]
    assert json.loads((out / OUTPUTS_NAME).read_text()) == {"files": ["head_scores.csv", "summary.json"]}
    # a third run replaces exactly what the second recorded, nested files and their folders included
    write_outputs(out, True, summary={"run": 3}, extra=lambda d: [_write(d / "sub" / "a.txt")])
    assert _names(out) == [OUTPUTS_NAME, "heatmap_previous_token.png", "notes.txt", "sub/a.txt", "summary.json"]
    write_outputs(out, True, summary={"run": 4})
    assert _names(out) == [OUTPUTS_NAME, "heatmap_previous_token.png", "notes.txt", "summary.json"]
    assert not (out / "sub").exists()


def test_overwrite_replaces_a_folder_the_previous_run_wrote_as_one_entry(tmp_path):
    """A run that lists a whole folder as one of its outputs (prune --save-pruned's pruned_model/):
    the same run again with --overwrite replaces the folder, it does not fail on it."""
    from headprobe.analyses.outputs import write_outputs

    out = tmp_path / "o"

    def folder(run):
        def extra(d):
            _write(d / "model" / f"weights-{run}.bin")
            return [d / "model"]

        return extra

    write_outputs(out, False, summary={"run": 1}, extra=folder(1))
    write_outputs(out, True, summary={"run": 2}, extra=folder(2))
    assert _names(out) == [OUTPUTS_NAME, "model/weights-2.bin", "summary.json"]
    assert json.loads((out / OUTPUTS_NAME).read_text()) == {"files": ["model", "summary.json"]}


def _write(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("a")
    return path


@pytest.mark.figures
def test_a_failure_while_writing_leaves_the_directory_as_it_was(tmp_path):
    from headprobe.analyses.outputs import write_outputs

    out = tmp_path / "o"
    write_outputs(out, False, summary={"run": 1}, tables={"a.csv": "1\n"})
    before = {n: (out / n).read_bytes() for n in _names(out)}

    def broken():
        raise RuntimeError("a figure failed")

    with pytest.raises(RuntimeError):
        write_outputs(out, True, summary={"run": 2}, tables={"b.csv": "2\n"}, figures={"f": broken})
    assert {n: (out / n).read_bytes() for n in _names(out)} == before
    assert sorted(p.name for p in out.iterdir()) == sorted(before)  # no staging folder left


def _save_nan_llama(path, tokenizer):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        hidden_size=64,
        intermediate_size=128,
        vocab_size=101,
        max_position_embeddings=128,
        bos_token_id=100,
        eos_token_id=100,
        pad_token_id=100,
        attn_implementation="eager",
    )
    hf = LlamaForCausalLM(cfg)
    with torch.no_grad():
        hf.model.layers[1].self_attn.o_proj.weight[0, 0] = float("nan")  # offloaded: found only in a forward
    hf.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_failed_device_map_run_leaves_no_folder(tmp_path, tiny_tokenizer, text_file, capsys):
    """Item 2: the bridge on a sequential device map finds the NaN weight only after its sweeps saved
    a checkpoint; the run fails in one line and leaves no folder (:func:`out_as_it_was` removes only
    the checkpoints it added, so an existing folder stays as it was)."""
    model = _save_nan_llama(tmp_path / "m", tiny_tokenizer)
    args = [
        "--model",
        str(model),
        "--backend",
        "transformer-lens",
        "--device-map",
        "sequential",
        "--max-memory",
        "cpu=250KB,disk=1GB",
        "--text",
        str(text_file),
        "--n-natural",
        "3",
        "--seq-len",
        "16",
        "--n-repeated",
        "2",
        "--period",
        "6",
        "--device",
        "cpu",
    ]
    assert main(["ablate", "--out", str(tmp_path / "new"), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("headprobe: error:") and "NaN" in err[-1]
    assert not (tmp_path / "new").exists()


def test_interrupted_resumable_run_says_it_resumes(tmp_path):
    """The interruption message says what is in --out: a checkpoint (resume) or the folder as it was."""
    from headprobe.cli import Terminated, _interrupted

    (tmp_path / CHECKPOINT_NAME).write_text("{}")
    line = _interrupted(Terminated(), str(tmp_path))
    assert "resume" in line and str(tmp_path) in line and "\n" not in line
    line = _interrupted(KeyboardInterrupt(), str(tmp_path / "none"))
    assert line.startswith("headprobe: interrupted;") and "as it was before" in line


_PRESSED_TWICE = """
import atexit, os, signal, sys
import headprobe.cli as cli

SIG = signal.{sig}


def first():  # inside the run: the first Ctrl-C (or SIGTERM)
    os.kill(os.getpid(), SIG)


said = cli._interrupted


def again(e, out):  # a second one while headprobe says what it left
    os.kill(os.getpid(), SIG)
    return said(e, out)


cli.figure_formats, cli._interrupted = first, again
atexit.register(lambda: os.kill(os.getpid(), SIG))  # and a third while the interpreter shuts down
sys.argv = ["headprobe", "budget", "--preset", "llama3-8b"]
sys.exit(cli.main())
"""


@pytest.mark.parametrize("sig, status, word", [("SIGINT", 130, "interrupted"), ("SIGTERM", 143, "terminated")])
def test_a_second_ctrl_c_while_stopping_prints_no_traceback(tmp_path, sig, status, word):
    """Ctrl-C pressed twice (or SIGTERM sent twice): the second arrived while the first one's line
    was printed, or in cli.main's finally, and ended in a KeyboardInterrupt traceback (exit status
    1, or death by SIGINT during shutdown). Once stopping, a run from the command line ignores it."""
    import subprocess
    import sys

    script = tmp_path / "pressed_twice.py"
    script.write_text(_PRESSED_TWICE.format(sig=sig))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert r.returncode == status and r.stderr.splitlines() == [
        f"headprobe: {word}; files are written atomically: none was left half-written"
    ], r.stderr


def test_an_interrupted_call_in_python_gets_its_signal_handlers_back(monkeypatch, capsys):
    """main() called from Python (not the command line) restores the caller's handlers, so that a
    later Ctrl-C still interrupts the caller (pytest here)."""
    import headprobe.cli as cli

    def interrupt():
        raise KeyboardInterrupt

    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(cli, "figure_formats", interrupt)
    assert cli.main(["budget", "--preset", "llama3-8b"]) == 130
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_an_interrupted_torchrun_run_says_so_once(monkeypatch, capsys):
    """Ctrl-C reaches every rank of a torchrun run; the interruption line comes from rank 0 alone,
    as an error's does (each rank printed it: the same line twice on 2 ranks)."""
    import headprobe.cli as cli

    def interrupt():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "figure_formats", interrupt)
    for rank, said in (("1", 0), ("0", 1)):
        monkeypatch.setenv("RANK", rank)
        assert cli.main(["budget", "--preset", "llama3-8b"]) == 130
        assert capsys.readouterr().err.count("headprobe: interrupted;") == said, rank


@pytest.mark.parametrize(
    "error",
    [
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.80 GiB",
        "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried",
        "numpy",
    ],
)
def test_running_out_of_memory_mid_run_is_one_line_and_leaves_out_as_it_was(
    tiny_dir, text_file, tmp_path, capsys, monkeypatch, error
):
    """An allocation that fails after the memory plan (its estimate fell short, or work it does not
    plan): one line naming the allocation and what to change, exit 2, --out as it was before; any
    other RuntimeError is not taken for one."""
    import torch

    import headprobe.commands.scan_core as scan_core

    out = tmp_path / "o"
    assert _scan(tiny_dir, text_file, out, "--types", "induction") == 0
    before = {n: (out / n).read_bytes() for n in _names(out)}

    def fail(*args, **kwargs):
        if error == "numpy":
            raise MemoryError("Unable to allocate 8.00 GiB for an array with shape (1073741824,)")
        raise (torch.OutOfMemoryError if error.startswith("CUDA") else RuntimeError)(error)

    monkeypatch.setattr(scan_core, "run", fail)
    capsys.readouterr()
    assert _scan(tiny_dir, text_file, out, "--types", "induction", "--overwrite") == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]  # after the loading line
    said = "Unable to allocate 8.00 GiB" if error == "numpy" else error
    assert line.startswith(f"headprobe: error: out of memory ({said}") and "--memory-budget" in line
    assert "is as it was before this run" in line
    assert {n: (out / n).read_bytes() for n in _names(out)} == before
    monkeypatch.setattr(scan_core, "run", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):
        _scan(tiny_dir, text_file, out, "--types", "induction", "--overwrite")


def _digests(d):
    import hashlib

    return {n: hashlib.sha256((d / n).read_bytes()).hexdigest() for n in _names(d)}


def test_overwrite_never_removes_the_runs_own_input(text_file, tmp_path, capsys):
    """``scan --model m --out m --overwrite`` on a model ``headprobe train`` wrote removed the
    model's config, weights and tokenizer (the train run listed them as its outputs) and wrote the
    scan in their place. Refused in one line before the load; every file of m stays as it was. A
    scan into a folder inside the model's (m/scan) still overwrites its own earlier run."""
    m = tmp_path / "m"
    assert main(["train", "--out", str(m), "--steps", "4", "--warmup", "1", "--formats", "none"]) == 0
    before = _digests(m)
    capsys.readouterr()
    argv = ["scan", "--model", str(m), "--text", str(text_file), *zoo.TINY_SCORE_FLAGS, "--no-metrics", "--no-verify"]
    assert main([*argv, "--out", str(m), "--overwrite"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "would remove" in err[0] and str(m) in err[0], err
    assert _digests(m) == before
    for _ in range(2):  # a scan inside the model's folder, then its overwrite
        assert main([*argv, "--out", str(m / "scan"), "--overwrite", "--formats", "none"]) == 0
    assert {n: d for n, d in _digests(m).items() if not n.startswith("scan/")} == before


def test_a_python_results_save_never_removes_its_runs_input(text_file, tmp_path, monkeypatch, capsys):
    """``headprobe.scan("m").save("m", overwrite=True)`` removed the trained model m (as prune's, or
    show's ``out="m"``): only the command line's run knew its inputs. A function's result now keeps
    the paths its run read, resolved when it ran (a relative name, then another working directory),
    and its save refuses with the command line's line; m stays whole, a save elsewhere works."""
    import headprobe
    from headprobe.probe.core.errors import HeadprobeError

    m = tmp_path / "m"
    assert main(["train", "--out", str(m), "--steps", "4", "--warmup", "1", "--formats", "none"]) == 0
    before = _digests(m)
    argv = ["scan", "--model", str(m), "--text", str(text_file), *zoo.TINY_SCORE_FLAGS, "--no-metrics", "--no-verify"]
    assert main([*argv, "--out", str(m), "--overwrite"]) == 2
    cli_line = capsys.readouterr().err.strip().removeprefix("headprobe: error: ")
    small = dict(text=str(text_file), n_natural=2, seq_len=12, n_repeated=2, period=5, device="cpu")
    monkeypatch.chdir(tmp_path)
    scan = dict(types="induction", verify=False, metrics=False, **small)
    results = {
        "scan": headprobe.scan("m", **scan),
        "scan of a loaded model": headprobe.scan(headprobe.load_model("m", device="cpu", quiet=True), **scan),
        "prune": headprobe.prune("m", step_fraction=0.5, l0_steps=2, n_seeds=1, **small),
    }
    monkeypatch.chdir(tmp_path / "m")  # the paths were resolved when the functions ran
    for name, result in results.items():
        with pytest.raises(HeadprobeError) as e:
            result.save(m, overwrite=True)
        assert str(e.value) == cli_line, name
        assert _digests(m) == before, name
    with pytest.raises(HeadprobeError) as e:
        headprobe.show(str(m), head="0.0", prompt="a b a b", out=m, overwrite=True)
    assert str(e.value) == cli_line and _digests(m) == before
    assert results["scan"].save(tmp_path / "other", formats="none")[-1].name == "summary.json"


def test_overwrite_refuses_a_folder_entry_that_is_the_input(tmp_path):
    """prune --save-pruned lists pruned_model/ as one entry: a run reading that folder (``prune --model
    P/pruned_model --out P --overwrite``) would remove it whole; the same run into another folder does not."""
    from headprobe.analyses.outputs import write_outputs
    from headprobe.probe.core.errors import HeadprobeError
    from headprobe.probe.core.io import run_inputs

    out = tmp_path / "P"
    write_outputs(out, False, summary={"run": 1}, extra=lambda d: [_write(d / "pruned_model" / "w.bin").parent])
    with (
        run_inputs([str(out / "pruned_model"), "smollm2-135m", 3]),
        pytest.raises(HeadprobeError, match="would remove"),
    ):
        write_outputs(out, True, summary={"run": 2})
    assert _names(out) == [OUTPUTS_NAME, "pruned_model/w.bin", "summary.json"]
    with run_inputs([str(out / "pruned_model")]):
        write_outputs(tmp_path / "Q", False, summary={"run": 2})
    write_outputs(out, True, summary={"run": 3})  # no input read from it: replaced as before
    assert _names(out) == [OUTPUTS_NAME, "summary.json"]


def test_an_embedded_models_name_is_no_input_path_even_beside_a_folder_of_that_name(tmp_path, monkeypatch):
    """``scan --model smollm2-135m --out smollm2-135m --overwrite`` run twice in one folder: the model
    comes from its wheel, not from ./smollm2-135m (the first scan), so the overwrite is not refused; a
    local model folder and a comma-separated list's local items are inputs."""
    from headprobe.options import model_paths as _model_paths

    monkeypatch.chdir(tmp_path)
    (tmp_path / "smollm2-135m").mkdir()
    (tmp_path / "m").mkdir()
    assert _model_paths("smollm2-135m") == [] and _model_paths("all-MiniLM-L6-v2".lower()) == []
    assert _model_paths("m") == ["m"] and _model_paths("smollm2-135m,m") == ["m"] and _model_paths(["m"]) == ["m"]
    assert _model_paths(None) == []


def _model(d, weights="model.safetensors"):
    """A model folder as ``save_pretrained`` or headprobe's checkpoints leave it: config.json and weights."""
    _write(d / "config.json")
    _write(d / weights)
    return [d / "config.json", d / weights]


def test_a_folder_holding_a_model_takes_only_the_run_that_wrote_it(tmp_path):
    """A Hugging Face model's folder, a trained model's (config.json + headprobe_model.pt, listed by
    its run) and a pruning's (pruned_model/): a run of another kind is refused, with or without
    ``--overwrite``, and the folder stays as it was; the run that wrote the model replaces it. Old
    code: the Hugging Face folder took a scan's files beside its weights, and ``--overwrite`` over
    the trained or pruned model removed it."""
    from headprobe.analyses.outputs import write_outputs
    from headprobe.probe.core.errors import HeadprobeError

    hf = tmp_path / "hf"
    _model(hf)
    before = _names(hf)
    for models in ((), (".",)):  # not even a training: it did not write this model
        with pytest.raises(HeadprobeError, match=r"holds a model \(.*hf: config.json and weights\).*mixed into"):
            write_outputs(hf, True, summary={"run": 2}, models=models)
        assert _names(hf) == before

    trained = tmp_path / "trained"
    write_outputs(trained, False, summary={"run": 1}, extra=lambda d: _model(d, "headprobe_model.pt"), models=(".",))
    before = _names(trained)
    with pytest.raises(HeadprobeError, match="--overwrite would remove it: write to another --out$") as e:
        write_outputs(trained, True, summary={"run": 2}, tables={"head_scores.csv": "x"})
    assert "\n" not in str(e.value) and _names(trained) == before
    write_outputs(trained, True, summary={"run": 2}, extra=lambda d: _model(d, "headprobe_model.pt"), models=(".",))
    assert json.loads((trained / "summary.json").read_text()) == {"run": 2}

    pruned = tmp_path / "pruned"
    extra = lambda d: [_model(d / "pruned_model", "headprobe_model.safetensors")[0].parent]
    write_outputs(pruned, False, summary={"run": 1}, extra=extra, models=("pruned_model",))
    before = _names(pruned)
    with pytest.raises(HeadprobeError, match=r"pruned_model: config.json and weights\)"):
        write_outputs(pruned, True, summary={"run": 2})  # a pruning without --save-pruned, or a scan
    assert _names(pruned) == before
    write_outputs(pruned, True, summary={"run": 2}, extra=extra, models=("pruned_model",))
    assert _names(pruned) == before and json.loads((pruned / "summary.json").read_text()) == {"run": 2}


def test_scan_into_a_model_folder_is_refused_before_the_load(tiny_dir, text_file, tmp_path, capsys):
    """``scan --out M --overwrite`` where M is a saved Hugging Face model (not the one scanned):
    one line, exit 2, M as it was. Old code: the scan ran and wrote its files beside M's weights."""
    import shutil

    m = tmp_path / "m"
    shutil.copytree(tiny_dir, m)
    before = _digests(m)
    capsys.readouterr()
    assert _scan(tiny_dir, text_file, m, "--overwrite", "--formats", "none") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"headprobe: error: output directory {m} holds a model"), err
    assert "loading" not in err[0] and _digests(m) == before


def test_a_training_replaces_its_own_earlier_model(tmp_path, capsys):
    m = tmp_path / "m"
    argv = ["train", "--out", str(m), "--steps", "4", "--warmup", "1", "--formats", "none"]
    assert main(argv) == 0
    assert main([*argv, "--overwrite", "--seed", "1"]) == 0
    assert json.loads((m / "summary.json").read_text())["config"]["seed"] == 1


def _show(tiny_dir, out, *extra):
    argv = ["show", "--model", str(tiny_dir), "--head", "1.5", "--prompt", "t1 t2 t3 t4", "--device", "cpu"]
    return main([*argv, "--out", str(out), "--formats", "none", *extra])


def _listed(out):
    return json.loads((out / OUTPUTS_NAME).read_text())["files"]


def test_overwrite_says_which_runs_files_it_replaced(tiny_dir, text_file, tmp_path, capsys):
    """``show --overwrite`` into a scan's folder replaced the whole scan in silence: now one line names
    the previous run's command (its summary's ``command``; show's, which writes no summary, from the
    file list) and counts its files (the reference: the list the previous run recorded)."""
    out = tmp_path / "o"
    assert _scan(tiny_dir, text_file, out, "--types", "induction", "--formats", "none") == 0
    scan_files = _listed(out)
    assert "replaced" not in capsys.readouterr().out  # written into no folder: nothing replaced
    assert _show(tiny_dir, out, "--overwrite") == 0
    lines = capsys.readouterr().out.splitlines()
    assert f"replaced the previous run in {out}/ (headprobe scan, {len(scan_files)} files)" in lines
    show_files = _listed(out)
    assert _scan(tiny_dir, text_file, out, "--types", "induction", "--formats", "none", "--overwrite") == 0
    lines = capsys.readouterr().out.splitlines()
    assert show_files == ["index.html"]  # --formats none: the page alone
    assert f"replaced the previous run in {out}/ (headprobe show, 1 file)" in lines


def test_overwrite_of_an_older_runs_folder_names_no_command(tiny_dir, text_file, tmp_path, capsys):
    """A run written before summaries and file lists recorded the command: the line says "a previous
    headprobe run" (a study's ``study.json`` names its command); an empty folder gets no line."""
    from headprobe.probe.core.io import previous_run

    out = tmp_path / "o"
    out.mkdir()
    assert _show(tiny_dir, out) == 0  # an empty folder: nothing replaced
    assert "replaced" not in capsys.readouterr().out
    assert _scan(tiny_dir, text_file, out, "--types", "induction", "--formats", "none", "--overwrite") == 0
    summary = json.loads((out / "summary.json").read_text())
    del summary["command"]
    (out / "summary.json").write_text(json.dumps(summary))
    (out / OUTPUTS_NAME).write_text(json.dumps({"files": _listed(out)}))
    n = len(_listed(out))
    capsys.readouterr()
    assert _show(tiny_dir, out, "--overwrite") == 0
    assert f"replaced the previous run in {out}/ (a previous headprobe run, {n} files)" in capsys.readouterr().out
    old = tmp_path / "study"
    old.mkdir()
    (old / "study.json").write_text("{}")
    assert previous_run(old) is not None and previous_run(old).command == "study"
    assert previous_run(tmp_path / "empty") is None


def test_a_python_save_over_a_run_records_what_it_replaced(tmp_path, capsys):
    """From Python nothing is printed (as for the kept files); ``replaced_run(out)`` tells it."""
    from headprobe.analyses.outputs import write_outputs
    from headprobe.probe.core.io import replaced_run

    out = tmp_path / "o"
    write_outputs(out, False, summary={"run": 1}, tables={"a.csv": "x\n", "b.csv": "y\n"})
    assert replaced_run(out) is None
    write_outputs(out, True, summary={"run": 2})
    replaced = replaced_run(out)
    assert replaced is not None and (replaced.command, replaced.files) == (None, 3)
    assert capsys.readouterr().out == ""
    resumed = tmp_path / "resumed"  # a resumed run's folder holds only its checkpoint: nothing replaced
    resumed.mkdir()
    (resumed / CHECKPOINT_NAME).write_text("{}")
    write_outputs(resumed, True, summary={"run": 1}, resumable=True)
    assert replaced_run(resumed) is None and replaced_run(resumed, forget=True) is None
