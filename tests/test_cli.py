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


@pytest.mark.parametrize(
    "argv, said",
    [
        (
            ["scan", "--type", "induction", "--out", "x"],
            "unrecognized arguments: --type induction (did you mean --types?)",
        ),
        (["scan", "--over", "--out", "x"], "unrecognized arguments: --over (did you mean --overwrite?)"),
        (["ablate", "--hea", "1.1", "--out", "x"], "unrecognized arguments: --hea 1.1 (did you mean --heads?)"),
        (["--vers"], "unrecognized arguments: --vers (did you mean --version?)"),
    ],
)
def test_an_abbreviated_flag_is_refused_with_the_flag_it_abbreviates(argv, said, capsys, tmp_path):
    """argparse took a unique prefix as the whole flag (``--type`` as ``--types``): a typo ran as
    something else, and a flag added later would change what an abbreviation meant. Old code: exit 0
    from parsing, the scan configured with ``--types induction``."""
    from headprobe.cli import main

    argv = [str(tmp_path / "x") if a == "x" else a for a in argv]
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert captured.out == "" and len(lines) == 1 and lines[0].startswith(f"headprobe: error: {said}"), lines
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    "argv, said",
    [
        (["scan", "--types", "induction", "--k", "300", "--out", "x"], "--k 300 (did you mean -k?)"),
        (["scan", "--types", "induction", "-top-k", "300", "--out", "x"], "-top-k 300 (did you mean --top-k?)"),
        (["scan", "--k=300", "--out", "x"], "--k=300 (did you mean -k?)"),
        (["scan", "-out", "x"], "-out (did you mean --out?)"),  # where --out is missing: the flag alone
        # flags are case-sensitive: compared as typed first, then without regard to case, named as spelt
        (["scan", "--types", "induction", "-K", "300", "--out", "x"], "-K 300 (did you mean -k?)"),
        (["scan", "--types", "induction", "--TOP-K", "300", "--out", "x"], "--TOP-K 300 (did you mean --top-k?)"),
    ],
)
def test_a_flag_with_another_number_of_dashes_is_pointed_to_its_option(argv, said, capsys, tmp_path):
    """The option of the same name with one dash more or fewer comes before difflib's closest and
    before the options it abbreviates. Old code: ``--k`` got "did you mean --keep-n-random?" (an
    abbreviation of it) and ``-top-k`` no hint (flags of one dash were not looked at); later, ``-K`` no
    hint (the flag was lowercased, and ``-k`` then passed over as the flag itself)."""
    from headprobe.cli import main

    argv = [str(tmp_path / "x") if a == "x" else a for a in argv]
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"headprobe: error: unrecognized arguments: {said}"), lines
    assert not (tmp_path / "x").exists()


def _required_words(sub) -> list[str]:
    """Words that satisfy ``sub``'s positionals, required flags and required exclusive groups
    (the first choice, else ``0.0``): argparse reports those before unrecognized ones."""
    import argparse

    words: list[str] = []
    one_of = [g._group_actions[0] for g in sub._mutually_exclusive_groups if g.required]
    for a in sub._actions:
        if isinstance(a, argparse._HelpAction) or not (a.required or not a.option_strings or a in one_of):
            continue
        n = a.nargs if isinstance(a.nargs, int) else 1
        words += a.option_strings[:1] + [str(next(iter(a.choices))) if a.choices else "0.0"] * n
    return words


def test_no_long_flag_of_any_command_can_be_abbreviated():
    """Every long flag of every command, less its last letter (where that is not a flag itself),
    is refused as unrecognized, naming the flag (or, where there is one, the option of that very name
    with another number of dashes: import's ``--k`` names ``-k``, not ``--kv``). Old code: each was
    read as the flag (361 of 361)."""
    import argparse

    from headprobe.cli import build_parser, check_argv
    from headprobe.commands import COMMANDS
    from headprobe.probe.core.errors import HeadprobeError

    checked = 0
    for name in COMMANDS.names():
        parser = build_parser(name)
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
        flags = [o for a in sub._actions for o in a.option_strings]
        for flag in flags:
            if not flag.startswith("--") or flag == "--help" or flag[:-1] in flags:
                continue
            with pytest.raises(HeadprobeError) as e:
                check_argv([name, *_required_words(sub), f"{flag[:-1]}=1"])
            said = str(e.value)
            same = [o for o in flags if o.lstrip("-") == flag[:-1].lstrip("-")]
            meant = f"did you mean {same[0]}?" if same else flag
            assert said.startswith(f"unrecognized arguments: {flag[:-1]}=1 (did you mean") and meant in said, said
            checked += 1
    assert checked > 300  # every command's flags, not a few


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


@pytest.mark.parametrize(
    "argv, capability",
    [
        (["circuit"], "path_patching"),
        (["kv"], "kv_policies"),
        (["prune", "--save-pruned"], "removes_heads"),
    ],
)
def test_a_backend_lacking_a_capability_is_refused_before_torch_loads(argv, capability, tmp_path):
    """``--backend transformer-lens`` where a command needs a capability it lacks: one line naming the
    flag, exit 2, no output directory, and torch never imported (the capability is read from
    ``BACKEND_CAPABILITIES``, not the backend's class; importing it took 3-8 s)."""
    out = tmp_path / "out"
    proc = _main_in_a_fresh_interpreter([*argv, "--backend", "transformer-lens", "--out", str(out)])
    assert proc.stdout.strip() == "2 []", proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1 and f"(the transformer-lens backend lacks {capability})" in proc.stderr
    assert not out.exists()


@pytest.mark.parametrize("command", ["scan", "show", "ablate"])
def test_float16_on_a_backend_lacking_half_precision_is_refused_before_torch_loads(command, tmp_path):
    """``--backend transformer-lens --dtype float16`` was refused in load_model, after torch and the
    loader were imported (10.7-11.3 s on 2 busy cores, 2026-12-06; 0.27 s now): the settings check
    refuses it as the capability refusals above, from ``BACKEND_CAPABILITIES``."""
    from headprobe.settings import FLOAT16_BRIDGE

    out = tmp_path / "out"
    argv = [command, "--backend", "transformer-lens", "--dtype", "fp16", "--out", str(out)]
    more = {"show": ["--head", "0.0", "--prompt", "the cat sat on the mat"], "ablate": ["--heads", "0.0"]}
    proc = _main_in_a_fresh_interpreter([*argv, *more.get(command, [])])
    assert proc.stdout.strip() == "2 []", proc.stdout + proc.stderr
    said = f"headprobe: error: {FLOAT16_BRIDGE} (the transformer-lens backend lacks half_precision)\n"
    assert proc.stderr == said
    assert not out.exists()


@pytest.mark.parametrize("command", ["scan", "ablate"])
def test_device_map_in_half_precision_on_a_backend_lacking_splits_after_load_is_refused_before_torch_loads(
    command, tmp_path
):
    """``--backend transformer-lens --device-map auto --dtype bfloat16`` was refused in load_model, after
    torch and the loader were imported: the settings check refuses it as the float16 line above."""
    out = tmp_path / "out"
    argv = [command, "--backend", "transformer-lens", "--device-map", "auto", "--dtype", "bf16", "--out", str(out)]
    proc = _main_in_a_fresh_interpreter([*argv, *(["--heads", "0.0"] if command == "ablate" else [])])
    assert proc.stdout.strip() == "2 []", proc.stdout + proc.stderr
    assert proc.stderr == (
        "headprobe: error: --device-map on the transformer-lens backend loads float32 only (transformers splits "
        "the model as it loads, before any cast): use --dtype float32 or --backend native (the transformer-lens "
        "backend lacks splits_after_load)\n"
    )
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


@pytest.mark.parametrize(
    "argv, said",
    [
        (["scan", "--control", "uniformm", "--out", "x"], "invalid choice: 'uniformm' (choose from"),  # argparse's
        (["scan", "--dtype", "bflaot16", "--out", "x"], "unknown dtype 'bflaot16'"),
        (["scan", "--formats", "pnng", "--out", "x"], "unknown figure format 'pnng'"),
        (["prune", "--method", "michel,randm", "--out", "x"], "unknown pruning method 'randm'"),
        (["robustness", "--vary", "kindd", "--out", "x"], "got kindd"),
        (["budget", "--preset", "llama3-8"], "unknown preset 'llama3-8'"),
        (["budget", "--preset", "gpt2-small", "--dtype", "bf61"], "unknown dtype 'bf61'"),
        (["sccan"], "invalid choice: 'sccan'"),
        # a word no spelling distance finds, given as a hint (export's FORMAT_HINTS): no suggestion before
        (
            ["export", "--from", "x", "--out", "x", "--format", "kvpress"],
            "'duo'? DuoAttention's format, which kvpress reads)",
        ),
        (["export", "--from", "x", "--out", "x", "--format", "DuoAttention"], "invalid choice: 'DuoAttention'"),
    ],
)
def test_a_value_from_a_fixed_set_gets_the_closest_names(argv, said, capsys, tmp_path):
    """Every value chosen from a fixed set, checked by argparse's ``choices`` or by our own code,
    names the closest choices (the registry's :func:`did_you_mean`). Old code: no suggestion for
    any of these but the command's."""
    from headprobe.cli import main

    argv = [str(tmp_path / "x") if a == "x" else a for a in argv]
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("headprobe: error: ") and said in lines[0], lines
    meant = {
        "uniformm": "uniform",
        "bflaot16": "bfloat16",
        "pnng": "png",
        "randm": "random",
        "kindd": "kind",
        "llama3-8": "llama3-8b",
        "bf61": "bf16",
        "sccan": "scan",
        "kvpress": "duo",
        "DuoAttention": "duo",
    }
    typo = next(w for w in meant if w in said)
    assert f"did you mean '{meant[typo]}'" in lines[0] and not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    "config, field, typo, meant",
    [
        ("headprobe.commands.kv:KVConfig", "method", "retrival", "retrieval"),
        ("headprobe.commands.export:ExportConfig", "format", "headkvv", "headkv"),
        ("headprobe.commands.export:ExportConfig", "format", "kvpress", "duo"),
        ("headprobe.commands.circuit:CircuitConfig", "method", "eap-igg", "eap-ig"),
        ("headprobe.commands.ablate:AblateConfig", "estimate", "atpp", "atp"),
        ("headprobe.commands.patch:PatchConfig", "site", "residd", "resid"),
        ("headprobe.commands.scan:ScanConfig", "correction", "hlom", "holm"),
        ("headprobe.commands.scan:ScanConfig", "device", "cpuu", "cpu"),
        ("headprobe.commands.scan:ScanConfig", "backend", "nativ", "native"),
        ("headprobe.commands.scan:ScanConfig", "streaming", "onn", "on"),
    ],
)
def test_a_fixed_set_value_given_from_python_gets_the_closest_names(config, field, typo, meant):
    """The same values given as the Python functions' keywords, where no argparse ``choices`` runs:
    our own checks name the closest choice. Old code: "--method must be one of ..., got 'retrival'"."""
    from headprobe.commands import resolve
    from headprobe.probe.core.errors import HeadprobeError

    cls = resolve(config)
    required = {"out": "o"} if config.endswith("ExportConfig") else {}
    required |= {"source": "s"} if config.endswith("ExportConfig") else {}
    with pytest.raises(HeadprobeError) as e:
        cls(**required, **{field: typo})
    assert repr(typo) in str(e.value) and f"did you mean '{meant}'" in str(e.value), str(e.value)


def test_every_refusal_that_lists_a_fixed_set_names_the_closest_choice():
    """Structural: each ``raise HeadprobeError(...)`` (or argparse's ``ArgumentTypeError``) whose line
    lists choices ("one of", "choose from", ...) calls :func:`did_you_mean`, so a new validator
    cannot forget it. The listed exceptions name no value a user chose from the set."""
    import ast
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    phrases = re.compile(r"one of|choose from|takes names from")
    no_value_chosen = {
        ("headprobe/commands/budget.py", "separate modes"),  # two modes given: no value to match
        ("headprobe/commands/view.py", "is a run of"),  # two runs of different models
        ("headprobe/settings.py", "bad --max-memory entry"),  # a malformed entry, not a name
        ("headprobe/settings.py", "--formats {self.formats!r}: choose from"),  # nothing named at all
        ("probe/backends/sources.py", "has no weights"),  # files a folder lacks
    }
    missing = []
    for folder in ("headprobe", "probe", "analyses"):
        for path in sorted((root / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args):
                    continue
                if not ast.unparse(node.exc.func).endswith(("HeadprobeError", "ArgumentTypeError")):
                    continue
                text = ast.unparse(node.exc.args[0])
                rel = path.relative_to(root).as_posix()
                if not phrases.search(text) or "did_you_mean" in text or "hint" in text:
                    continue
                if not any(rel == f and part in text for f, part in no_value_chosen):
                    missing.append(f"{rel}:{node.lineno}")
    assert not missing, missing


@pytest.mark.parametrize("command", [["scan"], ["atlas", "--models", "toy"], ["robustness"], ["diff", "a", "b"]])
@pytest.mark.parametrize("seq_len", [2, 3])
def test_a_seq_len_under_the_head_types_minimum_is_refused(command, seq_len, capsys, tmp_path):
    """Old code: ``--seq-len 3`` (and 2) ran, and the next-token and last-token columns (2: the
    previous-token and first-token ones) were one number twice."""
    from headprobe.analyses.vocabulary import MIN_SEQ_LEN
    from headprobe.cli import main

    out = tmp_path / "o"
    assert main([*command, "--seq-len", str(seq_len), "--out", str(out)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"headprobe: error: --seq-len {seq_len} is too short"), lines
    assert f"at least {MIN_SEQ_LEN} positions" in lines[0] and "the same number" in lines[0]
    assert not out.exists()


def test_seq_len_at_the_minimum_is_accepted_and_runs(tiny_dir, text_file, tmp_path):
    from headprobe.analyses.vocabulary import MIN_SEQ_LEN
    from headprobe.cli import check_argv, main

    for command in (["scan"], ["atlas", "--models", "toy"], ["robustness"], ["diff", "a", "b"]):
        assert check_argv([*command, "--seq-len", str(MIN_SEQ_LEN), "--out", "o"]) is not None
    out = tmp_path / "o"
    argv = ["scan", "--model", str(tiny_dir), "--text", str(text_file), "--seq-len", str(MIN_SEQ_LEN)]
    assert main([*argv, "--no-verify", "--formats", "none", "--n-natural", "2", "--out", str(out)]) == 0
    assert (out / "summary.json").exists()


def test_min_seq_len_is_the_shortest_window_where_no_two_natural_scores_coincide():
    """The reference is the score functions themselves, on a random full (encoder-like) pattern:
    below MIN_SEQ_LEN some two natural-text head types read the same keys (equal columns), at
    it none do. Also ties MIN_SEQ_LEN to the detectors: a change to a score's queries moves it."""
    import torch

    from headprobe.analyses import detectors as D
    from headprobe.analyses.vocabulary import MIN_SEQ_LEN, SEQ_LEN_CLASH

    def scores(T: int) -> dict[str, torch.Tensor]:
        p = torch.rand(3, 4, T, T, generator=torch.Generator().manual_seed(T)).softmax(-1)
        out = {"previous_token": D.previous_token_score(p), "first_token": D.first_token_score(p)}
        if T >= 3:
            out |= {"next_token": D.next_token_score(p), "last_token": D.last_token_score(p)}
        return out

    def clashes(T: int) -> set[tuple[str, str]]:
        s = scores(T)
        return {(a, b) for a in s for b in s if a < b and torch.equal(s[a], s[b])}

    assert clashes(2) == {("first_token", "previous_token")}
    assert clashes(3) == {("last_token", "next_token")}
    assert clashes(MIN_SEQ_LEN) == set() and sorted(SEQ_LEN_CLASH) == list(range(2, MIN_SEQ_LEN))


# The fewest --seq-len positions each command without head types needs, counted by hand: BOS (unless
# --no-bos), a natural-text window of 2 tokens (one token is always all one token, and
# natural_text_tokens leaves windows more than half one token out), and kv's planted block twice
# (--block-len, default 16; import --kv measures with kv's default).
_LOSS_FLOORS = [
    (["ablate", "--out", "o"], 3),
    (["ablate", "--out", "o", "--no-bos"], 2),
    (["prune", "--out", "o"], 3),
    (["import", "--heads-file", "h.tsv"], 3),
    (["import", "--heads-file", "h.tsv", "--kv"], 1 + 2 + 2 * 16),
    (["kv", "--out", "o"], 1 + 2 + 2 * 16),
    (["kv", "--out", "o", "--block-len", "2", "--sink", "0"], 1 + 2 + 2 * 2),
    (["kv", "--out", "o", "--block-len", "2", "--sink", "0", "--no-bos"], 2 + 2 * 2),
]


@pytest.mark.parametrize("command, least", _LOSS_FLOORS, ids=lambda x: " ".join(x) if isinstance(x, list) else None)
def test_seq_len_floor_of_commands_without_head_types(command, least, capsys, tmp_path, monkeypatch):
    """Old code: ablate and prune took --seq-len 2, loaded the model and failed with "every 1-token
    window of the text is more than half one token"; import refused 3 for the head types' scores,
    which it does not compute, and took --kv at 34 (failing after the load the same way); kv
    refused below a fixed 8, without a reason, and took 8 .. 34 at --block-len 16."""
    from headprobe.cli import check_argv, main

    monkeypatch.chdir(tmp_path)
    assert check_argv([*command, "--seq-len", str(least)]) is not None
    assert main([*command, "--seq-len", str(least - 1)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"headprobe: error: --seq-len {least - 1} is too short"), lines
    assert f"at least {least} positions" in lines[0] and "window of 2 tokens" in lines[0], lines[0]
    assert list(tmp_path.iterdir()) == []  # nothing written, and refused before the model (none given) loads


def test_seq_len_floor_is_what_the_text_windows_need(tiny_llama_gqa, text_file):
    """The reference for the floor of 3: natural_text_tokens itself draws windows at 3 on a model
    that prepends BOS, and none at 2 (a 1-token window); and says so, where the old message blamed
    the text ("every 1-token window of the text is more than half one token")."""
    from headprobe.analyses.data import natural_text_tokens
    from headprobe.probe.core.errors import HeadprobeError

    text = text_file.read_text(encoding="utf-8")
    assert tiny_llama_gqa.prepend_bos
    assert natural_text_tokens(tiny_llama_gqa, 2, 3, 0, text).tokens.shape == (2, 3)
    with pytest.raises(HeadprobeError, match="sequence length 2 is too short: it leaves 1 text token after BOS"):
        natural_text_tokens(tiny_llama_gqa, 2, 2, 0, text)


def test_ablate_runs_at_its_seq_len_floor(tiny_dir, text_file, tmp_path):
    from headprobe.cli import main

    out = tmp_path / "o"
    argv = ["ablate", "--model", str(tiny_dir), "--text", str(text_file), "--seq-len", "3", "--formats", "none"]
    assert main([*argv, "--n-natural", "2", "--n-repeated", "2", "--out", str(out)]) == 0
    assert (out / "summary.json").exists()


def test_the_torch_free_dtype_names_are_torchs():
    """probe/core/vocabulary.py's TORCH_DTYPES (read before torch loads) against torch itself."""
    import torch

    from headprobe.probe.core.vocabulary import TORCH_DTYPES

    assert TORCH_DTYPES == {n for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype)}


@pytest.mark.parametrize(
    "command, dtype",
    [
        (["scan", "--out", "o"], "float64"),
        (["scan", "--out", "o"], "double"),
        (["scan", "--out", "o"], "torch.complex64"),
        (["ablate", "--out", "o"], "fp64"),
        (["ablate", "--out", "o"], "int8"),
        (["budget", "--preset", "llama3-8b"], "float64"),
        (["budget", "--preset", "llama3-8b"], "uint8"),
    ],
)
def test_a_real_dtype_we_do_not_support_is_refused_as_unsupported(command, dtype, capsys, tmp_path, monkeypatch):
    """Old code: ``--dtype float64`` got "unknown dtype 'float64' (did you mean 'float16' or 'float'?)",
    a spelling suggestion for a dtype spelt right. Now it says that it is not supported and what is,
    with no suggestion; a misspelling still gets one (bflaot16 above)."""
    from headprobe.cli import main
    from headprobe.probe.core.vocabulary import DTYPES

    monkeypatch.chdir(tmp_path)
    assert main([*command, "--dtype", dtype]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and out == "" and f"dtype {dtype!r} is not supported: " in lines[0], lines
    assert "did you mean" not in lines[0] and all(d in lines[0] for d in DTYPES), lines[0]
    assert list(tmp_path.iterdir()) == []


def test_every_benchmark_and_script_parser_refuses_abbreviated_flags():
    """benchmarks/*.py and scripts/*.py made their own parsers with argparse's default allow_abbrev=True, so
    ``tail_calibration.py --sim 1`` ran as ``--sims 1`` and ``redraw_figures.py --che`` as ``--check`` (and a
    flag added later could silently take over an abbreviation), unlike headprobe's commands. Every
    ``ArgumentParser`` made there now has ``allow_abbrev=False``; one of each is run to show the refusal.
    Old code: scripts/redraw_figures.py and scripts/viewer_screenshot.py's parsers allowed them."""
    import ast
    from pathlib import Path

    top = Path(__file__).resolve().parents[1]
    root = top / "benchmarks"
    made = {}
    for path in [*sorted(root.glob("*.py")), *sorted((top / "scripts").glob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("ArgumentParser"):
                kw = {k.arg: k.value for k in node.keywords}
                made[f"{path.parent.name}/{path.name}:{node.lineno}"] = isinstance(
                    kw.get("allow_abbrev"), ast.Constant
                ) and (kw["allow_abbrev"].value is False)
    assert sum(k.startswith("scripts/") for k in made) >= 2 and len(made) >= 12, made
    assert all(made.values()), [k for k, v in made.items() if not v]
    p = subprocess.run(
        [sys.executable, str(root / "tail_calibration.py"), "--sim", "1", "--n", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2 and "unrecognized arguments: --sim" in p.stderr, (p.returncode, p.stderr[-300:])
    p = subprocess.run(
        [sys.executable, str(top / "scripts" / "redraw_figures.py"), str(top / "figures"), "--che"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2 and "unrecognized arguments: --che" in p.stderr, (p.returncode, p.stderr[-300:])


def test_scan_n_random_help_says_the_default_is_raised():
    """``scan --n-random``'s help said only "default 50", while a scan raises it to the draws one
    verdict needs unless ``--keep-n-random`` (the plan line said so, --help did not). The help must
    name --keep-n-random and its example must be :func:`~headprobe.analyses.verification.plan_draws`'s."""
    import re
    from dataclasses import replace

    from headprobe.analyses.verification import VerificationSettings, plan_draws

    parser = dict(_subcommand_parsers())["scan"]
    text = " ".join(next(a for a in parser._actions if "--n-random" in a.option_strings).help.split())
    assert "--keep-n-random" in text, text
    example = re.search(r"e\.g\. (\d+) for five at ([0-9.]+)", text)
    assert example is not None, text
    settings = VerificationSettings(k=10, n_random=parser.get_default("n_random"), alpha=float(example.group(2)))
    assert int(example.group(1)) == plan_draws(5, settings) > settings.n_random
    assert plan_draws(5, replace(settings, keep_n_random=True)) == settings.n_random


def test_model_help_names_the_weights_cache_where_cache_root_puts_it(monkeypatch, tmp_path):
    """--model's help names $HEADPROBE_CACHE and its defaults (the README never mentioned the cache,
    ~540 MB for SmolLM2-135M); each default it states must be where
    :func:`~headprobe.probe.backends.weights_cache.cache_root` puts the cache, and ``off`` must turn it off."""
    import re
    from pathlib import Path

    from headprobe.probe.backends.weights_cache import ENV_VAR, cache_root
    from headprobe.settings import MODEL_HELP

    said = re.search(rf"\${ENV_VAR} \(default (\S+), or \$XDG_CACHE_HOME(/\S+?);.*; off: no cache\)", MODEL_HELP)
    assert said is not None, MODEL_HELP
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_root() == Path(said.group(1)).expanduser()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == Path(str(tmp_path / "xdg") + said.group(2))
    monkeypatch.setenv(ENV_VAR, "off")
    assert cache_root() is None


def test_no_help_page_or_the_readme_cites_a_lesson_the_reader_has_not_seen():
    """``budget --as-mha`` said "as the lesson's table does": a newcomer has never seen the lesson
    (the project's seed texts). Every command's --help, the top-level one and the README say what a
    flag does in the field's terms instead."""
    import re
    from pathlib import Path

    from headprobe.cli import build_parser

    pages = {name: parser.format_help() for name, parser in _subcommand_parsers()}
    pages["headprobe"] = build_parser().format_help()
    pages["README.md"] = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    assert len(pages) > 10 and "budget" in pages and "--as-mha" in pages["budget"]
    cited = {name: re.findall(r".{40}\blesson.{20}", " ".join(text.split()), re.I) for name, text in pages.items()}
    assert not {name: found for name, found in cited.items() if found}, cited
