"""A refusal that names command-line flags (``--n-random must be at least 1``) reaches a caller of
the command's Python function with a note giving their Python spelling (``in Python: --n-random
is n_random=``), the message itself untouched; the command line prints the same one line as
before, without the note. One refusal per command (every command of ``COMMANDS``), each decided
by the settings alone: no model loads and nothing is written."""

from __future__ import annotations

import re
import traceback

import pytest

import headprobe
from headprobe import cli
from headprobe.commands import COMMANDS
from headprobe.probe.core.errors import HeadprobeError

# command -> (Python arguments, keywords, the note expected, the command line's arguments); "{t}": tmp_path
CASES = {
    "scan": (
        (),
        dict(seq_len=100000),
        "in Python: --seq-len is seq_len=",
        ["scan", "--seq-len", "100000", "--out", "{t}/o"],
    ),
    "budget": (
        (),
        dict(preset="llama3-8b", model="gpt2"),
        "in Python: --preset is preset=, --model is model=",
        ["budget", "--preset", "llama3-8b", "--model", "gpt2"],
    ),
    "ablate": (
        (),
        dict(heads="0.0", estimate="atp", max_batch=4),
        "in Python: --max-batch is max_batch=, --estimate is estimate=",
        ["ablate", "--heads", "0.0", "--estimate", "atp", "--max-batch", "4", "--out", "{t}/o"],
    ),
    "prune": (
        (),
        dict(methods="nope"),
        "in Python: --method is methods=",
        ["prune", "--method", "nope", "--out", "{t}/o"],
    ),
    "train": ((), dict(steps=0), "in Python: --steps is steps=", ["train", "--steps", "0", "--out", "{t}/o"]),
    "study": (
        ("layouts",),
        dict(rope=3),
        "in Python: --rope is rope=",
        ["study", "layouts", "--rope", "3", "--out", "{t}/o"],
    ),
    "view": (
        ("{t}/none",),
        dict(pattern_len=1),
        "in Python: --pattern-len is pattern_len=",
        ["view", "{t}/none", "--pattern-len", "1"],
    ),
    "show": (
        (),
        dict(head="0.0", prompt="", out="{t}/o"),
        "in Python: --prompt is prompt=, --prompt-file is prompt=<the file's text>",
        ["show", "--head", "0.0", "--prompt", "", "--out", "{t}/o"],
    ),
    "atlas": (
        (),
        dict(out="{t}/o", models=""),
        "in Python: --models is models=",
        ["atlas", "--out", "{t}/o", "--models", ""],
    ),
    "patch": (
        (),
        dict(n_prompts=1),
        "in Python: --n-prompts is n_prompts=",
        ["patch", "--n-prompts", "1", "--out", "{t}/o"],
    ),
    "circuit": (
        (),
        dict(receivers="x"),
        "in Python: --receivers is receivers=",
        ["circuit", "--receivers", "x", "--out", "{t}/o"],
    ),
    "kv": (
        (),
        dict(kv_budget=2.0),
        "in Python: --kv-budget is kv_budget=",
        ["kv", "--kv-budget", "2", "--out", "{t}/o"],
    ),
    "export": (
        ("{t}/none",),
        dict(format="mib", sink=2),
        "in Python: --sink is sink=, --format is format=",
        ["export", "--from", "{t}/none", "--format", "mib", "--sink", "2", "--out", "{t}/o"],
    ),
    "import": (
        (),
        dict(heads_file="{t}/heads.txt", measure_kv=True),
        "in Python: --kv is measure_kv=True",
        ["import", "--heads-file", "{t}/heads.txt", "--kv"],
    ),
    "robustness": (
        (),
        dict(control_seeds=-1),
        "in Python: --control-seeds is control_seeds=",
        ["robustness", "--control-seeds", "-1", "--out", "{t}/o"],
    ),
    "diff": (
        ("a", "b"),
        dict(min_change=-1.0),
        "in Python: --min-change is min_change=",
        ["diff", "a", "b", "--min-change", "-1", "--out", "{t}/o"],
    ),
}


def _filled(value, t):
    return value.replace("{t}", str(t)) if isinstance(value, str) else value


def python_refusal(command: str, tmp_path) -> HeadprobeError:
    """The refusal of ``CASES[command]``'s Python call (``tmp_path`` holds a layer.head list)."""
    (tmp_path / "heads.txt").write_text("0.1\n1.0\n")
    args, keywords, _, _ = CASES[command]
    with pytest.raises(HeadprobeError) as e:
        getattr(headprobe, command)(
            *(_filled(a, tmp_path) for a in args), **{k: _filled(v, tmp_path) for k, v in keywords.items()}
        )
    return e.value


def test_the_cases_cover_every_command():
    """Every registered command has its case: a new command's function must be wrapped too."""
    assert sorted(CASES) == sorted(COMMANDS.names())


@pytest.mark.parametrize("command", sorted(CASES))
def test_a_refusal_from_python_notes_the_keywords_of_its_flags(command, tmp_path):
    """The refusal's message names flags (as the command line's), its one note the keyword of
    each, in the order the message names them; a traceback shows the note under the message."""
    error = python_refusal(command, tmp_path)
    assert "\n" not in str(error) and str(error).startswith(("--", "give --", "the prompt is empty"))
    assert error.__notes__ == [CASES[command][2]]
    shown = "".join(traceback.format_exception(error)).splitlines()
    assert shown[-1] == CASES[command][2]
    assert shown[-2].endswith(f"{type(error).__name__}: {error}")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("command", sorted(CASES))
def test_the_command_line_prints_the_same_one_line_without_the_note(command, tmp_path, capsys):
    """``headprobe <command>`` with the same values prints ``headprobe: error: <the Python
    refusal's message>``: one line, no note, exit status 2, nothing written."""
    message = str(python_refusal(command, tmp_path))
    capsys.readouterr()
    assert cli.main([_filled(a, tmp_path) for a in CASES[command][3]]) == 2
    said = capsys.readouterr()
    assert said.err == f"headprobe: error: {message}\n"
    assert "in Python" not in said.err + said.out
    assert not (tmp_path / "o").exists()


def test_a_switch_is_its_keyword_and_value():
    """A store_false flag spelled apart from its setting (``--fixed-draws``: ``sequential=False``)."""
    with pytest.raises(HeadprobeError) as e:
        headprobe.scan(verify=False, sequential=False)
    assert str(e.value) == "--fixed-draws only acts without --no-verify: leave one of them out"
    assert e.value.__notes__ == ["in Python: --fixed-draws is sequential=False, --no-verify is verify=False"]


@pytest.mark.parametrize(
    ("command", "message", "note"),
    [
        # output flags the function does not take: where they go in Python
        (
            "ablate",
            "--overwrite of x would remove x/a, a file of this run's input: write to another --out",
            "in Python: --overwrite is result.save(path, overwrite=True), --out is result.save(path)",
        ),
        ("scan", "--formats 'x': choose from png", 'in Python: --formats is result.save(path, formats="png")'),
        ("budget", "--json and --compare", "in Python: --json is result.to_dict(), --compare is compare=True"),
        # a flag the function takes as a keyword, output or not
        ("show", "--out x is a file", "in Python: --out is out="),
        # a short flag; not the -negative of non-negative, nor a flag the command lacks
        ("scan", "a non-negative -k or -x or --nope", "in Python: -k is k="),
        # flags of another command named beside them, or spelled for Python already: left out
        (
            "atlas",
            "--checkpoints r: w; give the --out folder of headprobe train --save-every N",
            "in Python: --checkpoints is checkpoints=",
        ),
        ("scan", "check with headprobe ablate --heads 0.1 --n-random 5", None),
        ("scan", "--n-random 3 is low; check with headprobe ablate --n-random 5", "in Python: --n-random is n_random="),
        ("view", "x is not a directory (give the --out directory of headprobe scan or ablate)", None),
        ("scan", "x is not empty; pass --overwrite (overwrite=True in Python)", None),
        ("scan", "no flag here", None),
    ],
)
def test_flag_note(command, message, note):
    """:func:`headprobe.options.flag_note` of a message: the flags of the command it spells in Python."""
    from headprobe.options import flag_note

    assert flag_note(command, message) == note


def test_only_the_function_called_notes():
    """One command's function run inside another's: the note is of the function the caller called
    (view has no --top-k: no note), not of the inner one (scan's ``k=``)."""
    from headprobe.options import notes_flags

    with pytest.raises(HeadprobeError) as e:
        notes_flags("view")(lambda: headprobe.scan(k=0))()
    assert str(e.value) == "--top-k must be at least 1, got 0"
    assert getattr(e.value, "__notes__", None) is None
    with pytest.raises(HeadprobeError) as e:
        headprobe.scan(k=0)
    assert e.value.__notes__ == ["in Python: --top-k is k="]


# A refusal of a result's save(): the output flags it names, as save's caller spells them
SAVE_NOTE = "in Python: --overwrite is overwrite=True, --out is the path given to save()"
FUNCTION_NOTE = "in Python: --overwrite is overwrite=True, --out is out="  # a function that writes as it goes


def _holds_a_model(d):
    """``d``: a folder an earlier run wrote a model into (``sub/``), which an overwrite would remove."""
    import json

    from headprobe.probe.core.io import OUTPUTS_NAME

    (d / "sub").mkdir(parents=True)
    (d / "sub" / "config.json").write_text("{}")
    (d / "sub" / "model.safetensors").write_bytes(b"weights")
    files = ["sub/config.json", "sub/model.safetensors", "summary.json"]
    (d / OUTPUTS_NAME).write_text(json.dumps({"files": files}))
    return d


@pytest.fixture(scope="module")
def saved_runs(tmp_path_factory, text_file):
    """A tiny trained model m, its scan s and the results of train, scan and export (each kind of
    ``save``: :class:`~headprobe.analyses.outputs.WritesOutputs`, ScanResult, ExportResult)."""
    t = tmp_path_factory.mktemp("saves")
    trained = headprobe.train(steps=4, warmup=1)
    trained.save(t / "m", formats="none")
    small = dict(n_natural=2, seq_len=12, n_repeated=2, period=5, device="cpu")
    scanned = headprobe.scan(str(t / "m"), text=str(text_file), types="induction", verify=False, metrics=False, **small)
    scanned.save(t / "s", formats="none")
    exported = headprobe.export(str(t / "s"), format="duo")
    return t, {"train": trained, "scan": scanned, "export": exported}


def _command_line(kind, t, text_file, out):
    return {
        "train": ["train", "--steps", "4", "--warmup", "1", "--formats", "none"],
        "scan": ["scan", "--model", f"{t}/m", "--text", str(text_file), "--types", "induction", "--no-verify"]
        + ["--no-metrics", "--n-natural", "2", "--seq-len", "12", "--n-repeated", "2", "--period", "5"],
        "export": ["export", "--from", f"{t}/s", "--format", "duo"],
        "show": ["show", "--model", f"{t}/m", "--head", "0.0", "--prompt", "a b a b"],
        "atlas": ["atlas"],
    }[kind] + ["--out", str(out), "--overwrite"]


@pytest.mark.parametrize("kind", ["train", "scan", "export", "show", "atlas"])
def test_a_save_refusal_from_python_notes_the_output_flags(kind, saved_runs, text_file, tmp_path, capsys):
    """``result.save(d, overwrite=True)`` over a folder holding another run's model refuses with the
    command line's message (``--overwrite would remove it: write to another --out``) and a note of
    save's spelling; a function that writes as it goes (``show``, ``atlas``: ``out=``) notes its
    keywords, once. The command line prints the same message, one line, no note; d stays as it was."""
    t, results = saved_runs
    out = _holds_a_model(tmp_path / "d")
    before = sorted(p.name for p in out.rglob("*"))
    with pytest.raises(HeadprobeError) as e:
        if kind in results:
            results[kind].save(out, overwrite=True)
        elif kind == "show":
            headprobe.show(f"{t}/m", head="0.0", prompt="a b a b", out=out, overwrite=True)
        else:
            headprobe.atlas(out=out, overwrite=True)
    message = str(e.value)
    assert message.endswith("--overwrite would remove it: write to another --out") and "\n" not in message
    assert e.value.__notes__ == [SAVE_NOTE if kind in results else FUNCTION_NOTE]
    capsys.readouterr()
    assert cli.main(_command_line(kind, t, text_file, out)) == 2
    said = capsys.readouterr()
    assert said.err == f"headprobe: error: {message}\n"
    assert "in Python" not in said.err + said.out
    assert sorted(p.name for p in out.rglob("*")) == before


def test_a_save_inside_a_command_function_notes_once(saved_runs, tmp_path):
    """``export(source, out=d, overwrite=True)`` saves inside the function: the one note is the
    function's (``out=``), not save's as well."""
    t, _ = saved_runs
    out = _holds_a_model(tmp_path / "d")
    with pytest.raises(HeadprobeError, match="write to another --out") as e:
        headprobe.export(str(t / "s"), out=str(out), format="duo", overwrite=True)
    assert e.value.__notes__ == [FUNCTION_NOTE]


@pytest.mark.parametrize(
    ("message", "note"),
    [
        (
            "the output directory name is empty; give --out a directory name",
            "in Python: --out is the path given to save()",
        ),
        ("--overwrite of x would remove x/a, a file of this run's input p: write to another --out", SAVE_NOTE),
        ("--formats 'x': choose from png", "in Python: --formats is formats="),
        ("output directory x is not empty; pass --overwrite (overwrite=True in Python) to replace its files", None),
        ("--threads x; --outer", None),
    ],
)
def test_save_flag_note(message, note):
    """:func:`headprobe.probe.core.io.save_flag_note`: only the output flags, only those not spelled for Python."""
    from headprobe.probe.core.io import save_flag_note

    assert save_flag_note(message) == note


def test_every_public_function_and_save_says_its_refusals_carry_the_note():
    """The Raises section of every command's function (generated or written by hand) and of each
    kind of result's ``save`` says, in one sentence, that a refusal naming flags carries the note."""
    import inspect

    from headprobe.analyses.outputs import WritesOutputs
    from headprobe.commands.export_core import ExportResult
    from headprobe.commands.scan_core import ScanResult

    sentence = "a message naming flags has a note giving their Python spelling (``e.__notes__``)"
    functions = [getattr(headprobe, c) for c in COMMANDS.names()] + [headprobe.import_heads]
    for f in [*functions, WritesOutputs.save, ScanResult.save, ExportResult.save]:
        doc = " ".join(inspect.getdoc(f).split())
        raises = doc[doc.index("Raises:") :]
        assert sentence in raises, f.__qualname__


def test_a_checkpoint_of_other_settings_spells_overwrite_for_python_too(tmp_path, capsys):
    """A run folder holding the checkpoint of a run with other settings is refused with a line that
    spells ``overwrite=True`` itself (as ``prepare_output_dir``'s refusal): from ``RunCheckpoint``
    and ``atlas_core.run`` (no command function to note it) and from ``headprobe.atlas`` (no note
    repeating it); the command line prints the same line."""
    from headprobe.commands.atlas import AtlasConfig
    from headprobe.commands.atlas_core import run as atlas_run
    from headprobe.probe.core.io import RunCheckpoint

    said = "pass --overwrite (overwrite=True in Python) to start over"
    RunCheckpoint(tmp_path, {"models": "other"}).save({})
    with pytest.raises(HeadprobeError, match=rf"other settings \(models: 'other' there.*; {re.escape(said)}$"):
        RunCheckpoint(tmp_path, {"models": "toy"}).load()
    with pytest.raises(HeadprobeError, match=re.escape(said)):
        atlas_run(AtlasConfig(models="toy"), tmp_path, progress=False)
    with pytest.raises(HeadprobeError, match=re.escape(said)) as e:
        headprobe.atlas(out=tmp_path, models="toy")
    assert not getattr(e.value, "__notes__", None)
    capsys.readouterr()
    assert cli.main(["atlas", "--models", "toy", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"headprobe: error: {e.value}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".headprobe-checkpoint.json"]


def test_a_save_into_a_folder_that_is_not_empty_is_as_the_api_page_says(saved_runs, tmp_path):
    """docs/api.md said every refusal of ``result.save(...)`` carries a note in ``e.__notes__``; the most
    common one, a folder that is not empty, spells ``overwrite=True`` in its message and has none
    (``__notes__`` absent). The page now quotes that message; this pins it to what save raises."""
    from pathlib import Path

    _, results = saved_runs
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(HeadprobeError) as e:
        results["train"].save(out)
    assert getattr(e.value, "__notes__", None) is None
    page = " ".join((Path(__file__).parents[1] / "docs" / "api.md").read_text(encoding="utf-8").split())
    quoted = "a folder that is not empty is `" + str(e.value).replace(str(out), "out") + "`"
    assert quoted in page, str(e.value)
    assert (out / "notes.txt").read_text() == "mine" and [p.name for p in out.iterdir()] == ["notes.txt"]


def test_the_plan_speaks_in_keywords_from_python_and_in_flags_on_the_command_line(capsys):
    """The verification plan's lines a scan prints (ten control sets kept where one induction verdict
    needs 19: 1/11 > 0.05) spoke in flags to a Python caller too: ``use --n-random 19 or more``,
    ``--n-random 10 kept (--keep-n-random)``. Said in a Python call (``headprobe.scan(...,
    n_random=10, keep_n_random=True)``) they name the keywords; in the command line's run
    (:func:`~headprobe.probe.core.io.command_line`, as ``cli.main`` opens it) the flags, as before."""
    from headprobe.analyses.verification import plan_lines
    from headprobe.commands.scan_core import _say
    from headprobe.probe.core.io import command_line

    test = {"head_type": "induction", "confirmable": "never", "control_sets": 10, "capped": False}
    plan = {
        "family_size": 1, "lone_draws_needed": 19, "n_random": 10, "family": ["induction"], "correction": "bh",
        "alpha": 0.05, "raised": False, "kept": True, "n_random_requested": 10, "max_sets": 11, "tests": [test],
    }  # fmt: skip
    lines = plan_lines(plan)
    for line in lines:
        _say(line)
    python = capsys.readouterr().err.splitlines()
    with command_line(["scan", "--n-random", "10", "--keep-n-random"]):
        for line in lines:
            _say(line)
    flags = capsys.readouterr().err.splitlines()
    assert flags == lines and len(lines) == 2  # the plan line and its NOTE, unchanged on the command line
    assert "--n-random 10 kept (--keep-n-random)" in flags[0] and flags[1].endswith(
        "use --n-random 19 or more (p <= 0.05)"
    )
    assert "; n_random=10 kept (keep_n_random=True); " in python[0], python
    assert python[1] == flags[1].replace("--n-random ", "n_random="), python  # "n_random=10 cannot reach ..."
    assert not any(re.search(r"--[a-z]", ln) for ln in python), python


@pytest.mark.parametrize(
    ("line", "python"),
    [
        ("use --n-random 19 or more", "use n_random=19 or more"),
        (
            "--n-random 10 raised to 99 (--keep-n-random keeps it)",
            "n_random=10 raised to 99 (keep_n_random=True keeps it)",
        ),
        ("--fixed-draws: every set drawn", "sequential=False: every set drawn"),
        (
            "a switch or a flag alone: --keep-n-random, --n-random",
            "a switch or a flag alone: keep_n_random=True, n_random",
        ),
        ("written; pass --overwrite to replace it", "written; pass --overwrite to replace it"),  # save's, not a keyword
        ("check with headprobe ablate --n-random 5", "check with headprobe ablate --n-random 5"),  # another command's
    ],
)
def test_in_python_spells_a_line_s_flags_as_keywords(line, python):
    """:func:`headprobe.options.in_python`: a printed line's flags of ``headprobe scan`` that are keywords
    of ``headprobe.scan``, with the number after them; the rest as printed."""
    from headprobe.options import in_python

    assert in_python("scan", line) == python


def test_a_report_speaks_in_keywords_from_python_and_in_flags_on_the_command_line(saved_runs, text_file, capsys):
    """``report()`` of a result called from Python spelled the command line's flags (``(--no-verify)``); now its
    keywords (``verify=False``), while the command line's run prints the same report with its flags."""
    t, results = saved_runs
    python = results["scan"].report()
    assert "no ablation check (verify=False)" in python and not re.search(r"--[a-z]", python), python
    assert cli.main(_command_line("scan", t, text_file, t / "cli")) == 0
    printed = capsys.readouterr().out.splitlines()
    assert "no ablation check (--no-verify): these are pattern scores, not verified findings" in printed
    assert python.replace("(verify=False)", "(--no-verify)").strip() in "\n".join(printed)  # but the flag, the same
