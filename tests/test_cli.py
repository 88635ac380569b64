"""The command layer: --version, flag suggestions, case-insensitive model names, one-line usage errors."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version

import pytest

from headprobe.commands import COMMANDS


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "headprobe", *args], capture_output=True, text=True, timeout=120)


def test_version_is_the_installed_distributions():
    p = _cli("--version")
    assert p.returncode == 0 and p.stdout.strip() == f"headprobe {version('headprobe')}"


@pytest.mark.parametrize(
    "args, hint",
    [
        (["scan", "--seq_len", "3", "--out", "x"], "did you mean --seq-len?"),
        (["budget", "--presett", "llama3-8b"], "did you mean --preset?"),
        (["ablate", "--out", "x", "--Heads", "1.1"], "did you mean --heads?"),
        # an unknown flag where a required one is missing: argparse named only the missing one
        (["scan", "--outt", "x"], "did you mean --out?"),
        (["export", "--from", "x", "--to", "y"], "did you mean --out?"),  # --to: --out's name before 0.1.0
    ],
)
def test_misspelt_flags_get_a_suggestion_on_one_line(args, hint, tmp_path):
    p = _cli(*args)
    assert p.returncode == 2 and p.stdout == ""
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("headprobe: error: unrecognized arguments") and hint in lines[0]
    assert lines[0].endswith(f"(see headprobe {args[0]} --help)")


def test_unrelated_flag_gets_no_suggestion():
    p = _cli("budget", "--zzzzzz", "1")
    assert p.returncode == 2 and "did you mean" not in p.stderr


def test_model_short_names_are_case_insensitive(tmp_path, monkeypatch):
    from headprobe.probe.backends.loading import SMOLLM2_HF_NAME, _resolve, canonical_name

    assert canonical_name("SmolLM2-135M") == "smollm2-135m" and canonical_name("GPT2-Medium") == "gpt2-medium"
    assert _resolve(canonical_name("SmolLM2-135M"))[0] == SMOLLM2_HF_NAME
    assert canonical_name("HuggingFaceTB/SmolLM2-135M") == "HuggingFaceTB/SmolLM2-135M"  # hub names as written
    (tmp_path / "GPT2").mkdir()
    monkeypatch.chdir(tmp_path)
    assert canonical_name("GPT2") == "GPT2"  # an existing directory is a path, not a short name


def _main_in_a_fresh_interpreter(argv: list[str]) -> subprocess.CompletedProcess:
    """``headprobe.cli.main(argv)`` in a new interpreter; stdout: its exit status and which of torch,
    transformers, pandas and matplotlib it imported."""
    code = (
        "import sys\nfrom headprobe.cli import main\n"
        f"rc = main({argv!r})\n"
        "print(rc, [m for m in ('torch', 'transformers', 'pandas', 'matplotlib') if m in sys.modules])"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["ablate", "--heads", "40.3"], "head 40.3 is out of range: the model has 30 layers of 9 heads"),
        (["ablate", "--heads", "5.1.2"], "is not of the form layer.head"),
        (["ablate", "--kind", "bogus"], "invalid choice: 'bogus' (choose from 'zero', 'mean', 'resample')"),
        (["prune", "--step-fraction", "1.5"], "--step-fraction must be in (0, 1]"),
        (["prune", "--method", "michel,magnitude"], "--method: unknown pruning method 'magnitude'"),
        (["prune", "--l0-lambdas", "3,1"], "--l0-lambdas must be non-negative and increasing"),
        (["prune", "--l0-lambdas", "a,b"], "--l0-lambdas: expected comma-separated numbers"),
    ],
)
def test_bad_flags_are_refused_before_torch_loads(argv, message, tmp_path):
    """Ablate and prune check what the flags alone decide in their light front module: one line
    on stderr, exit 2, no output directory, and torch (and the model) never imported."""
    out = tmp_path / "out"
    proc = _main_in_a_fresh_interpreter([*argv, "--out", str(out)])
    assert proc.stdout.strip() == "2 []", proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("headprobe: error: ") and message in proc.stderr
    assert not out.exists()


def test_output_into_a_closed_pipe_ends_quietly():
    """``headprobe budget | head -0``: the reader is gone before anything is written; no traceback,
    exit status 141 (128 + SIGPIPE) as a shell reports for cat."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "headprobe", "budget", "--preset", "llama3-8b", "--compare"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    proc.stdout.close()  # long before the interpreter has started and imported anything
    assert proc.wait(timeout=60) == 141
    assert proc.stderr.read() == b""


def test_every_public_name_resolves():
    """``headprobe.__all__`` is the API: each name imports (a renamed target fails here, not in a user's notebook)."""
    import headprobe

    for name in headprobe.__all__:
        assert getattr(headprobe, name) is not None, name
    assert isinstance(headprobe.LoadedModel, type) and not hasattr(headprobe, "Backend")  # one model interface


def test_flags_match_the_python_keywords_they_set(capsys):
    """The README's rule (keyword = flag with underscores) holds for prune's methods (--methods, with
    --method kept) and atlas does not list the --model it refuses."""
    from headprobe.cli import build_parser

    parser = build_parser()
    a = parser.parse_args(["prune", "--out", "x", "--methods", "michel,random"])
    b = parser.parse_args(["prune", "--out", "x", "--method", "michel,random"])
    assert a.methods == b.methods == "michel,random"
    with pytest.raises(SystemExit):
        build_parser("atlas").parse_args(["atlas", "--help"])
    help_text = capsys.readouterr().out
    assert "--models" in help_text and "--model " not in help_text and "--model\n" not in help_text


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["scan", "-k", "-3", "--out", "x"], "-k/--top-k: must be a positive integer"),
        (
            ["scan", "--alpha", "1.5", "--out", "x"],
            "--alpha: must be between 0 and 1 (exclusive), got 1.5 (see headprobe scan --help)",
        ),
        (["scan", "--types", "inductoin", "--out", "x"], "did you mean induction"),
        (
            ["show", "--head", "40.2", "--prompt", "hi", "--out", "x"],
            "head 40.2 is out of range: the model has 30 layers",
        ),
    ],
)
def test_flag_errors_are_refused_before_torch_is_imported(tmp_path, argv, fragment):
    """Fast refusals: a usage or config error costs a fraction of a second, not the 25-50 s
    of importing torch or loading weights first (checked with -X importtime: no torch module at all)."""
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "headprobe", *argv], capture_output=True, text=True, cwd=tmp_path
    )
    errors = [line for line in r.stderr.splitlines() if not line.startswith("import time:")]
    assert r.returncode == 2 and len(errors) == 1 and fragment in errors[0], r.stderr[-2000:]
    assert not [line for line in r.stderr.splitlines() if line.startswith("import time:") and " torch" in line]
    assert not (tmp_path / "x").exists()


def test_formats_flag_sets_the_figure_formats_of_one_run(tmp_path, capsys, monkeypatch):
    """``--formats`` (OutputSettings): checked before any work (one line, exit 2, nothing written),
    in force for the run only, and in the canonical order whatever order it was given in."""
    import os

    from headprobe.analyses.vocabulary import FIGURE_FORMATS_ENV, figure_formats
    from headprobe.cli import _figure_formats, main

    assert main(["scan", "--formats", "gif", "--out", str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err.strip() == (
        "headprobe: error: --formats 'gif': unknown figure format 'gif'; "
        "choose from png, pdf, svg (comma-separated) or none"
    )
    assert not (tmp_path / "x").exists()
    monkeypatch.setenv(FIGURE_FORMATS_ENV, "png")
    with _figure_formats("SVG,pdf"):
        assert figure_formats() == ("pdf", "svg")
    with _figure_formats("NONE"):  # no figures at all
        assert figure_formats() == ()
    assert os.environ[FIGURE_FORMATS_ENV] == "png" and figure_formats() == ("png",)


def test_the_model_line_counts_one_kv_head_in_the_singular():
    """An MQA model's header reads ``(MQA, 1 KV head)`` (it read ``1 KV heads``); GQA keeps the plural."""
    from types import SimpleNamespace

    import torch

    from headprobe.options import describe_model

    def line(kind: str, n_kv: int) -> str:
        spec = SimpleNamespace(name="m", n_layers=2, n_heads=4, kind=kind, n_kv_heads=n_kv, precision="float32")
        return describe_model(SimpleNamespace(spec=spec, dtype=torch.float32, device=torch.device("cpu")))

    assert "(MQA, 1 KV head); weights" in line("MQA", 1)
    assert "(GQA, 2 KV heads); weights" in line("GQA", 2)


def _subcommand_parsers():
    import argparse

    from headprobe.cli import build_parser

    def subparsers(parser):
        return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices

    for name in subparsers(build_parser()):
        yield name, subparsers(build_parser(name))[name]


NO_DEFAULT_IN_WORDS: dict[tuple[str, str], str] = {}
"""``(command, flag) -> why`` for an optional flag whose help cannot state its default in words
(none today): :func:`_unsaid_defaults` passes them."""


def _unsaid_defaults(name: str, parser) -> list[tuple[str, str, str]]:
    """``(command, flag, why)`` for each option of ``parser`` with no help, and each optional one
    taking a value whose help, expanded as --help prints it, does not say ``default``."""
    import argparse
    import re

    required_groups = {id(a) for g in parser._mutually_exclusive_groups if g.required for a in g._group_actions}
    found = []
    for action in parser._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS:
            continue
        flag = action.option_strings[-1]
        text = parser._get_formatter()._expand_help(action) if action.help else ""
        if not text.strip():
            found.append((name, flag, "no help"))
        elif action.nargs == 0 or action.required or id(action) in required_groups:
            continue  # a switch, --help, --version or a required flag: no default to state
        elif (name, flag) not in NO_DEFAULT_IN_WORDS and not re.search(r"\bdefault\b", text):
            found.append((name, flag, f"no default in {text!r}"))
    return found


def test_every_optional_flag_states_its_default_in_words():
    """Each option of each subcommand is explained in --help, and each optional one that takes a
    value says its default in the project's words (``(default %(default)s)``, ``(default: none)``);
    switches, ``--help``/``--version`` and required flags (a required exclusive group's too) have
    none to state. ``--device`` said only "auto: cuda when ...", budget's ``--d-model`` "residual
    width D"; train's --positional and study's --d-model had no help at all. Reference: the
    parsers' own actions."""
    missing = [m for name, parser in _subcommand_parsers() for m in _unsaid_defaults(name, parser)]
    assert not missing, missing


def test_the_default_check_finds_a_help_without_one():
    """:func:`_unsaid_defaults` is not vacuous: on a hand-made parser it finds exactly the option
    whose help gives no default and the one with no help, not a switch, a required flag or an
    option that says its default."""
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=4, help="residual width D")
    parser.add_argument("--depth", type=int, default=2, help="layers (default %(default)s)")
    parser.add_argument("--name", default="x")
    parser.add_argument("--quiet", action="store_true", help="say less")
    parser.add_argument("--out", required=True, help="where")
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--prompt", help="the text")
    group.add_argument("--prompt-file", help="a file")
    assert _unsaid_defaults("t", parser) == [
        ("t", "--width", "no default in 'residual width D'"),
        ("t", "--name", "no help"),
    ]


@pytest.mark.parametrize("name", sorted(COMMANDS.names()))
def test_every_command_refuses_a_bad_flag_before_heavy_imports(name):
    """A mistyped flag costs an interpreter start, not pandas, matplotlib or torch (``study``'s front
    module imported pandas and matplotlib: 2-4 s before its one line)."""
    proc = _main_in_a_fresh_interpreter([name, *(["heads"] if name == "study" else []), "--bogus-flag"])
    assert proc.stdout.strip() == "2 []", proc.stdout + proc.stderr
    assert proc.stderr.startswith("headprobe: error: ") and proc.stderr.count("\n") == 1
