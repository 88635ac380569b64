"""Every ``headprobe`` command line the docs print is still accepted by the command's checks.

README.md, CONTRIBUTING.md, docs/*.md, the notebooks' text (docs/notebooks), the Makefile and the
scripts in benchmarks/ show command lines a reader copies. Each is run through the checks the
command makes before it reads a file or loads a model (:func:`headprobe.cli.check_argv`: argparse,
the Config's checks, flags that do nothing with the others, the command's own ``check``); nothing
is read and nothing runs, so placeholders (``DIR``, ``out/x``) are fine. A command the docs show
as refused (a ``headprobe: error:`` line after it in a code block, or :data:`REFUSED_IN_PROSE`)
must be refused, with the line the docs quote. Not checked by check_argv: what the run decides from
files (``--model``'s config.json, ``--text``, ``--out``, a head past the model's last layer); a
repository path a command reads must exist (or be a documented command's ``--out``).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from headprobe.cli import check_argv
from headprobe.commands import COMMANDS
from headprobe.probe.core.errors import HeadprobeError

ROOT = Path(__file__).resolve().parents[1]

FENCE = re.compile(r"^ {0,3}(```|~~~)[^\n]*\n(.*?)^ {0,3}\1[ \t]*$", re.S | re.M)
INLINE = re.compile(r"(?<!`)`([^`]+)`(?!`)")
START = re.compile(r"(?:^|(?<=[\s/]))headprobe\s+(?P<command>[a-z][a-z-]*)\b")
PREFIX = re.compile(
    r"^(?:\$\s*)?(?:[A-Z_][A-Z0-9_]*=\S*\s+|torchrun\s.*?-m\s+|\S*python3?\s.*?-m\s+|/usr/bin/time(?:\s+-v)?\s+"
    r"|\$\(BIN\)/|!)*$"
)
"""What may stand before ``headprobe`` on a command line: a prompt, ``VAR=value``, ``torchrun ...
-m``, ``python ... -m``, ``/usr/bin/time -v``, the Makefile's ``$(BIN)/``, a notebook's ``!``."""
ERROR = "headprobe: error: "
CHOICES = re.compile(r"^\{[\w.-]+(?:,[\w.-]+)+\}$")
"""A word that lists a flag's choices (``--streaming {auto,on,off}``): each is checked."""
REQUIRED = re.compile(r"the following arguments are required: ([^(]*)")

PLACEHOLDERS = {
    ("CONTRIBUTING.md", "<name>"): ("induction", "the new head type's name: any registered type's"),
    ("docs/atlas.md", "N"): ("100", "--save-every N: a step count"),
    ("docs/patch.md", "S"): ("z", "--site S: the table below gives each site a row; z stands for them"),
}
"""(source, word) -> (value, why): a word of the docs that stands for a value the reader chooses,
and what the test puts there. Words such as ``DIR``, ``RUN`` or ``out/x`` stay: nothing is read."""

REQUIRED_VALUES = {"--out": "out", "--head": "0.0", "--heads-file": "heads.txt", "--from": "scan-out"}
"""What is put for a required flag that inline prose leaves out (``headprobe scan --no-verify``:
the prose names the flags that matter; the rest is still checked). A code block's command must be
whole, and so must a prose run (:data:`RUN_FLAGS`)."""
RUN_FLAGS = 4
"""Inline prose with this many flags or more is a run with its settings, which the docs time or quote
and a reader copies: it must be whole (its ``--out`` too), with or without ``headprobe`` before it
(README's `` `ablate --estimate second-order --n-natural 4 ... --n-probes 4` took 183 s`` left out
``--out``: neither a bare command name nor a missing required flag was checked in prose). Fewer
flags name flags (``headprobe scan --no-verify``, ``prune --save-pruned``)."""
FLAG = re.compile(r"^--?[a-z]")

NOT_COMMANDS = {
    ("CONTRIBUTING.md", "headprobe ablate --kind"): "names the flag, which reads the kind registry",
}
"""(source, text) of inline code that names a command's flag rather than showing a command line,
with the reason; each must still be found (a stale entry fails)."""

REFUSED_IN_PROSE: dict[tuple[str, str], str | None] = {
    ("CONTRIBUTING.md", "headprobe ablate --heads 40.3"): "head 40.3 is out of range",
    ("docs/settings.md", "headprobe scan -k -3 --out x"): "must be a positive integer, got -3",
}
"""(source, text) -> a part of the line after ``headprobe: error:`` (None: not quoted) of a command
the prose shows refused. It must be refused before the model loads: by :func:`check_argv`, or by
:func:`headprobe.cli.main` before a stubbed load (a head past the embedded model's last layer)."""
FOLDERS_READ = {"--checkpoints": "checkpoints/step-000100"}
"""Flags whose Config reads the folder they name (atlas's ``--checkpoints``: a ``headprobe train
--save-every`` run): the test makes the folder, as the command before it in the docs would."""


@dataclass(frozen=True)
class Documented:
    """One command line of the docs: where (``source:line``), its text and its words after
    ``headprobe``; ``whole``: a code block's or script's line or a prose run (:data:`RUN_FLAGS`),
    not elided with ``...``;
    ``refused``: the docs show it refused (the quoted line; ``""``: none quoted)."""

    where: str
    text: str
    argv: tuple[str, ...]
    whole: bool = True
    refused: str | None = None


USED: set = set()
"""The keys of PLACEHOLDERS, NOT_COMMANDS and REFUSED_IN_PROSE the extraction used (none may be stale)."""


def _argvs(text: str, source: str) -> tuple[list[list[str]], bool]:
    """(the words after ``headprobe`` of command line ``text``, one list per choice of a
    :data:`CHOICES` word; whether the line is elided): shell quoting, a ``# comment`` dropped, a
    trailing ``...`` (the rest elided) dropped, :data:`PLACEHOLDERS` of ``source`` filled in."""
    words = shlex.split(text.replace("\\|", "|"), comments=True)  # a pipe escaped in a Markdown table
    elided = bool(words) and words[-1] == "..." and not text.rstrip().endswith(('"..."', "'...'"))
    words = words[words.index("headprobe") + 1 : len(words) - elided]
    for i, w in enumerate(words):
        if (source, w) in PLACEHOLDERS:
            USED.add((source, w))
            words[i] = PLACEHOLDERS[source, w][0]
    out = [words]
    for i, w in enumerate(words):
        if CHOICES.match(w):
            out = [[*a[:i], choice, *a[i + 1 :]] for a in out for choice in w[1:-1].split(",")]
    return out, elided


def _command_in(text: str) -> str | None:
    """``text`` from its ``headprobe <command>`` on, where that starts the line (after a
    :data:`PREFIX`) and names a registered command; else None."""
    m = START.search(text)
    if m is None or m.group("command") not in COMMANDS.names() or not PREFIX.match(text[: m.start()]):
        return None
    return text[m.start() :]


def _flag_count(text: str) -> int:
    """How many words of command line ``text`` are flags (``-k``, ``--out``; not ``-3``)."""
    return sum(bool(FLAG.match(w)) for w in text.split())


def _prose_command(text: str) -> str | None:
    """The command line of an inline code span: from its ``headprobe <command>`` on
    (:func:`_command_in`), or ``<command> --flag ...`` with :data:`RUN_FLAGS` flags or more, a run
    named without ``headprobe`` (returned with it); else None."""
    if (command := _command_in(text)) is not None:
        return command
    first = text.split(" ", 1)[0]
    if first in COMMANDS.names() and _flag_count(text) >= RUN_FLAGS:
        return f"headprobe {text}"
    return None


def _documented(where: str, text: str, source: str, whole: bool, refused: str | None = None) -> list[Documented]:
    argvs, elided = _argvs(text, source)
    return [Documented(where, text, tuple(a), whole and not elided, refused) for a in argvs]


def _logical_lines(block: str) -> list[tuple[int, str]]:
    """(line offset, line) of a code block or script, backslash continuations joined."""
    out: list[tuple[int, str]] = []
    pending, start = "", 0
    for i, line in enumerate(block.splitlines()):
        if not pending:
            start = i
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append((start, pending + line))
        pending = ""
    if pending:
        out.append((start, pending))
    return out


def markdown_commands(text: str, source: str, first_line: int = 1) -> list[Documented]:
    """The command lines of Markdown ``text``: each line of a code block that starts with a
    command (a ``headprobe: error:`` line next: shown refused, with that line), and each inline
    code span that does (one that is only ``headprobe <command>`` names the command: skipped) or
    is a run without ``headprobe`` (:func:`_prose_command`); a prose run must be whole."""
    found: list[Documented] = []
    for m in FENCE.finditer(text):
        line0 = first_line + text.count("\n", 0, m.start(2))
        lines = _logical_lines(m.group(2))
        for k, (i, line) in enumerate(lines):
            command = _command_in(line.strip())
            if command is None:
                continue
            after = next((x.strip() for _, x in lines[k + 1 :] if x.strip()), "")
            refused = after.removeprefix(ERROR) if after.startswith(ERROR) else None
            found += _documented(f"{source}:{line0 + i}", command, source, True, refused)
    prose = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    for m in INLINE.finditer(prose):
        command = _prose_command(" ".join(m.group(1).split()))
        if command is None or len(command.split()) < 3:
            continue
        if (source, command) in NOT_COMMANDS:
            USED.add((source, command))
            continue
        refused = None
        if (source, command) in REFUSED_IN_PROSE:
            USED.add((source, command))
            refused = REFUSED_IN_PROSE[source, command] or ""
        run = _flag_count(command) >= RUN_FLAGS
        found += _documented(
            f"{source}:{first_line + prose.count(chr(10), 0, m.start())}", command, source, run, refused
        )
    return found


def shell_commands(text: str, source: str) -> list[Documented]:
    """The command lines of a shell script or Makefile outside comments: ``headprobe <command>``,
    ``$(BIN)/headprobe`` and the scripts' ``"${HP[@]}" <command>`` (``HP=(... -m headprobe)``);
    ``$VAR`` is the script's default (``VAR=${VAR:-default}``), else the placeholder ``VAR``."""
    defaults = dict(re.findall(r"\b([A-Z_]+)=\$\{\1:-([^}]*)\}", text))
    found = []
    for i, line in _logical_lines(text):
        if line.lstrip().startswith("#"):
            continue
        m = START.search(line := line.replace('"${HP[@]}"', "headprobe"))
        if m is None or m.group("command") not in COMMANDS.names():
            continue
        command = re.sub(r"\$\{?([A-Za-z_]\w*)\}?", lambda v: defaults.get(v.group(1), v.group(1)), line[m.start() :])
        found += _documented(f"{source}:{i + 1}", command, source, True)
    return found


def planned_commands(script: str, tmp: Path, *flags: str) -> list[Documented]:
    """The headprobe steps ``script`` (benchmarks/gpu_check.sh) plans, from the ``plan.txt`` bash
    writes with ``PYTHON=false`` (no step runs; one bash process, about 0.1 s): the words after
    ``-m headprobe`` of each."""
    out = tmp / ("plan" + "".join(flags))
    env = {**os.environ, "PYTHON": "false"}
    subprocess.run(["bash", script, "--out", str(out), *flags], cwd=ROOT, env=env, capture_output=True, timeout=60)
    found = []
    for line in (out / "plan.txt").read_text().splitlines():
        words = shlex.split(line)
        if words[1] != "-" and "headprobe" in words:
            argv = words[words.index("headprobe") + 1 :]
            found.append(
                Documented(f"{script} {' '.join(flags)} step {words[0]}".strip(), shlex.join(argv), tuple(argv))
            )
    return found


def notebook_commands(path: Path, source: str) -> list[Documented]:
    """The command lines of a notebook: its Markdown cells' as Markdown's, its code cells' ``!headprobe`` lines."""
    found = []
    for n, cell in enumerate(json.loads(path.read_text(encoding="utf-8"))["cells"]):
        text = "".join(cell["source"])
        text = text if cell["cell_type"] == "markdown" else f"```\n{text}\n```"
        found += markdown_commands(text, f"{source} cell {n} line", 1 if cell["cell_type"] == "markdown" else 0)
    return found


MARKDOWN = ["README.md", "CONTRIBUTING.md", *(f"docs/{p.name}" for p in sorted((ROOT / "docs").glob("*.md")))]
SHELL = ["Makefile", *(f"benchmarks/{p.name}" for p in sorted((ROOT / "benchmarks").glob("*.sh")))]
PLANNED = "benchmarks/gpu_check.sh"
"""The script whose steps are arrays put together at run time: read from the plan it writes, in
its full and its ``--quick`` sizes."""


def documented(tmp: Path) -> list[Documented]:
    """Every command line of the docs, the notebooks, the Makefile and the benchmark scripts
    (``tmp``: where gpu_check.sh writes its plans)."""
    found: list[Documented] = []
    for name in MARKDOWN:
        found += markdown_commands((ROOT / name).read_text(encoding="utf-8"), name)
    for path in sorted((ROOT / "docs" / "notebooks").glob("*.ipynb")):
        found += notebook_commands(path, f"docs/notebooks/{path.name}")
    for name in SHELL:
        if name != PLANNED:
            found += shell_commands((ROOT / name).read_text(encoding="utf-8"), name)
    return found + planned_commands(PLANNED, tmp) + planned_commands(PLANNED, tmp, "--quick")


def _refusal(argv: list[str], whole: bool) -> tuple[str | None, list[str]]:
    """(the line :func:`check_argv` refuses ``argv`` with, None where it accepts it; ``argv`` as
    checked). Not ``whole`` (prose): the required flags it leaves out are given
    :data:`REQUIRED_VALUES` first. The folders of :data:`FOLDERS_READ` are made in the cwd."""
    for flag, folder in FOLDERS_READ.items():
        if flag in argv[:-1] and not os.path.isabs(argv[argv.index(flag) + 1]):
            (Path(argv[argv.index(flag) + 1]) / folder).mkdir(parents=True, exist_ok=True)
    try:
        check_argv(argv)
    except HeadprobeError as e:
        missing = REQUIRED.search(str(e))
        names = [n.strip() for n in missing.group(1).split(",")] if missing else []
        if whole or not names or not all(n in REQUIRED_VALUES for n in names):
            return str(e), argv
        return _refusal([*argv, *(w for n in names for w in (n, REQUIRED_VALUES[n]))], True)
    return None, argv


def _refusal_before_load(argv: list[str], monkeypatch, capsys) -> str | None:
    """The line :func:`headprobe.cli.main` refuses ``argv`` with before it loads a model (stubbed:
    a command that gets that far is not refused, None)."""
    from headprobe import options
    from headprobe.cli import main

    def stop(config):
        raise HeadprobeError("stub: the model would load now")

    monkeypatch.setattr(options, "load_for", stop)
    capsys.readouterr()
    status, said = main(argv), capsys.readouterr().err.strip()
    return None if status == 0 or "stub: the model would load now" in said else said.removeprefix(ERROR)


def verdict(d: Documented, monkeypatch=None, capsys=None) -> str | None:
    """Why ``d`` disagrees with the code (None: it agrees): the checks refuse a command the docs
    run, accept one they show refused (checked up to the model's load, with ``monkeypatch`` and
    ``capsys``), or refuse it with another line."""
    said, argv = _refusal(list(d.argv), d.whole)
    if d.refused is not None and said is None and monkeypatch is not None:
        said = _refusal_before_load(argv, monkeypatch, capsys)
    shown = f"{d.where}: `headprobe {shlex.join(d.argv)}`"
    if d.refused is None:
        return None if said is None else f"{shown} is refused: {said}"
    if said is None:
        return f"{shown} is shown refused, but it is accepted"
    if d.refused.rstrip(". ") not in said:
        return f"{shown} is refused with {said!r}; the docs say {d.refused!r}"
    return None


@pytest.fixture(scope="module")
def commands(tmp_path_factory) -> list[Documented]:
    return documented(tmp_path_factory.mktemp("plans"))


def test_every_documented_command_line_is_accepted(commands, tmp_path, monkeypatch, capsys):
    """Each is accepted by the checks, or refused as the docs show (run in an empty folder)."""
    monkeypatch.chdir(tmp_path)
    bad = [v for d in commands if (v := verdict(d, monkeypatch, capsys))]
    assert not bad, f"{len(bad)} of {len(commands)} documented command lines disagree with the code:\n" + "\n".join(bad)


REPO_FOLDERS = ("figures/", "docs/", "tests/", "benchmarks/", "scripts/")
"""A word starting so names a file of the repository (a model folder, a policy, a run)."""


def _repo_paths_read(d: Documented) -> list[str]:
    """The repository paths ``d`` reads: its words under :data:`REPO_FOLDERS` (a ``--flag=value``'s
    value, each of a comma-separated list), not the value of ``--out``."""
    read = []
    for i, word in enumerate(d.argv):
        if word.startswith("--out=") or (i and d.argv[i - 1] == "--out"):
            continue
        read += [p.rstrip("/") for p in word.split("=")[-1].split(",") if p.startswith(REPO_FOLDERS)]
    return read


def test_every_repository_path_a_documented_command_reads_exists(commands):
    """What check_argv leaves to the run: ``--model figures/train-default``, ``--policy docs/...``,
    ``headprobe view figures/...`` name committed files, or the output of a documented command
    (``--out``) that a reader runs first."""
    outs = {
        w.split("=", 1)[-1].rstrip("/")
        for d in commands
        for i, w in enumerate(d.argv)
        if w.startswith("--out=") or (i and d.argv[i - 1] == "--out")
    }
    missing = [
        f"{d.where}: {p}"
        for d in commands
        for p in _repo_paths_read(d)
        if not (ROOT / p).exists() and not any(p == o or p.startswith(o + "/") for o in outs)
    ]
    assert not missing, "documented commands read repository paths that no one makes:\n" + "\n".join(missing)
    assert sum(len(_repo_paths_read(d)) for d in commands) >= 10  # the docs do read committed runs


def test_every_source_and_listed_exception_is_read(commands):
    """The extraction finds commands in every kind of source, every registered command at least
    once in the docs, and uses every entry of the lists above (a stale one would hide nothing)."""
    sources = {d.where.split(":")[0].split(" ")[0] for d in commands}
    for name in (
        "README.md",
        "CONTRIBUTING.md",
        "docs/scan.md",
        "docs/budget.md",
        "Makefile",
        PLANNED,
        "benchmarks/gpu_session.sh",
        "docs/notebooks/kv_policy.ipynb",
    ):
        assert name in sources, name
    assert set(COMMANDS.names()) <= {d.argv[0] for d in commands if d.argv}
    assert len(commands) >= 150
    stale = (set(PLACEHOLDERS) | set(NOT_COMMANDS) | set(REFUSED_IN_PROSE)) - USED
    assert not stale, stale


SAMPLE = """\
Run `headprobe scan --types induction
--no-verify` (prose: --out left out), or `headprobe scan` by name, or `headprobe prune --out o ...`.

```
$ OMP_NUM_THREADS=1 headprobe scan --model smollm2-135m \\
    --out out/x --top-k 3   # a comment
$ headprobe scan --streaming {auto,off} --out o
wrote 3 files to out/x (headprobe scan --model out/x reads them)
$ headprobe scan --out o --top-k 0
headprobe: error: argument -k/--top-k: must be a positive integer, got 0
```
"""


def test_the_extraction_reads_blocks_prose_continuations_and_refusals():
    found = markdown_commands(SAMPLE, "sample.md")
    assert [(d.where, d.argv, d.whole, d.refused) for d in found] == [
        ("sample.md:5", ("scan", "--model", "smollm2-135m", "--out", "out/x", "--top-k", "3"), True, None),
        ("sample.md:7", ("scan", "--streaming", "auto", "--out", "o"), True, None),
        ("sample.md:7", ("scan", "--streaming", "off", "--out", "o"), True, None),
        (
            "sample.md:9",
            ("scan", "--out", "o", "--top-k", "0"),
            True,
            "argument -k/--top-k: must be a positive integer, got 0",
        ),
        ("sample.md:1", ("scan", "--types", "induction", "--no-verify"), False, None),
        ("sample.md:2", ("prune", "--out", "o"), False, None),
    ]
    assert all(verdict(d) is None for d in found)


@pytest.mark.parametrize(
    "text, said",
    [
        ("`headprobe scan --no-verify --top-k 3 --out o`", "--top-k only acts without --no-verify"),
        (
            "```\nheadprobe scan --no-verify --keep-n-random --out o\n```",
            "--keep-n-random only acts without --no-verify",
        ),
        ("```\nheadprobe scan --no-verify\n```", "the following arguments are required: --out"),
        (
            "`ablate --estimate second-order --n-natural 4 --seq-len 64\n--n-repeated 4 --period 25 --n-probes 4` took",
            "the following arguments are required: --out",
        ),
        ("`headprobe scan --n-natural 1 --n-repeated 1 --period 40 --no-verify` took", "required: --out"),
        ("`headprobe circuit --method eap --steps 3`", "--steps only acts with --method eap-ig"),
        ("`headprobe scan --seq-len`", "expected one argument"),
        ("```\nheadprobe scan --out o\nheadprobe: error: nothing\n```", "is shown refused, but it is accepted"),
        ("```\nheadprobe scan -k 0 --out o\nheadprobe: error: another line\n```", "the docs say 'another line'"),
    ],
)
def test_a_command_the_code_refuses_is_reported(text, said):
    """Old docs a reader would copy and get refused (an inert flag, a code block without its
    required ``--out``, a flag without its value), and refusals shown that do not happen."""
    (d,) = markdown_commands(text, "sample.md")
    assert said in (verdict(d) or "")


@pytest.mark.parametrize(
    "argv, said",
    [
        (["budget", "--preset", "llama3-8b", "--compare", "--flops-table"], "are separate modes"),
        (["budget", "--preset", "llama3-8b", "--kv-limit", "2GiB"], "--kv-limit belongs to --recommend"),
        (["budget", "--d-model", "4096"], "missing --n-layers, --n-heads"),
        (["train", "--out", "o", "--d-model", "16", "--n-heads", "3"], "not a multiple of n_heads=3"),
        (["study", "heads", "--out", "o", "--seeds", "1,1"], "--seeds lists 1 more than once"),
        (["show", "--head", "1.2,3.4", "--prompt", "x", "--out", "o"], "--head takes one head"),
    ],
)
def test_check_argv_refuses_what_main_refuses_before_its_run(argv, said, tmp_path, capsys, monkeypatch):
    """The commands' own checks (``Command.check``: budget's modes and layout, train's and study's
    settings, show's head) are made by check_argv with the same line as main prints."""
    from headprobe.cli import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(HeadprobeError, match=re.escape(said)) as e:
        check_argv(argv)
    assert main(argv) == 2 and capsys.readouterr().err.strip() == f"{ERROR}{e.value}"


def test_check_argv_reads_no_file(tmp_path):
    """A model folder, a text file and a policy file that do not exist (main refuses each) pass:
    nothing is read; --help and --version are None."""
    missing = str(tmp_path / "none")
    assert check_argv(["scan", "--model", missing, "--text", missing, "--out", missing]) is not None
    assert check_argv(["budget", "--preset", "llama3-8b", "--policy", missing]) is not None
    assert check_argv(["view", missing]) is not None
    assert check_argv(["scan", "--help"]) is None and check_argv(["--version"]) is None


def test_the_readme_names_what_the_code_names_and_glosses_its_terms_at_first_use():
    """A newcomer's README walk: the encoder's scores were "next-token and [SEP]-sink" where the output and
    ``--types`` say ``next_token`` and ``last_token``; the command table promised ``budget`` "recommendations",
    which need ``--recommend``; and the opening used "control sets", "layer-matched", "BH" and "sequential Monte
    Carlo" before saying what they are."""
    from headprobe.analyses.columns import DETECTORS
    from headprobe.settings import flag_names

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    (encoder,) = [b for b in readme.split("\n- ") if b.startswith("**An encoder comes in a wheel too.**")]
    encoder = " ".join(encoder.split())
    for name in (t for t, d in DETECTORS.items() if d.encoder_only):  # the encoder's own scores, by their names
        assert f"`{name}`" in encoder, (name, encoder)
    (row,) = [ln for ln in readme.splitlines() if ln.startswith("| `headprobe budget` |")]
    assert "recommend" in row and "--recommend" in flag_names(COMMANDS.get("budget").config_class()).values()
    assert "`--recommend`" in row, row
    flat = " ".join(readme.split())
    glosses = {  # the term -> words said at (or before) its first use
        "control set": "layer-matched",
        "layer-matched": "same layers",
        "BH": "Benjamini-Hochberg",
        "sequential Monte Carlo": "drawn until",
    }
    for term, gloss in glosses.items():
        first = flat.index(term)
        assert gloss in flat[: first + 160], (term, flat[first - 80 : first + 160])
