"""The ``headprobe`` command.

Each subcommand is a :class:`headprobe.commands.Command` registered in
:data:`headprobe.commands.COMMANDS` (its ``help``, its Config, whose settings are its flags -- see
:mod:`headprobe.settings` -- and its run target, imported once the flags made a valid Config);
this module lists no command. Errors a
user can cause are raised as :class:`headprobe.probe.core.errors.HeadprobeError` and end the program
with one line on stderr and exit status 2 (argparse's usage errors too, see :class:`OneLineErrorParser`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import sys
import threading
from typing import Any

from headprobe.analyses.vocabulary import FIGURE_FORMATS_ENV, figure_formats
from headprobe.commands import COMMANDS
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.core.outlock import first_rank
from headprobe.probe.core.registry import did_you_mean
from headprobe.settings import GIVEN_KEY

REQUIRED_MESSAGE = "the following arguments are required: "
"""How argparse begins the usage error of required arguments left out."""


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse with usage errors as one line (``headprobe: error: ... (see headprobe scan
    --help)``) and exit status 2, like every other bad input, and no abbreviated options
    (``allow_abbrev=False``: ``scan --type induction`` is refused with "did you mean --types?",
    where argparse took it as ``--types``, and a flag added later cannot change what an
    abbreviation meant); subparsers inherit both (``add_parser`` makes this class). The parsed
    namespace lists the options given (``settings.GIVEN_KEY``: each option argparse took from the
    words, in any spelling, at any value), for :func:`~headprobe.settings.refuse_inert`. The benchmark
    scripts use it too (``prog="ablation_sweep.py"``: their errors begin with that name)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)
        self._argv: list[str] = []
        self._given: list[str] = []

    def parse_known_args(self, args=None, namespace=None):  # unannotated: argparse's overloads
        self._argv = list(sys.argv[1:] if args is None else args)  # the words an error's hint reads
        self._given = []
        parsed, extra = super().parse_known_args(args, namespace)
        # a subcommand's parser sets its own list first; argparse copies it up into this namespace
        before = [d for d in getattr(parsed, GIVEN_KEY, None) or () if d not in self._given]
        setattr(parsed, GIVEN_KEY, [*before, *self._given])
        return parsed, extra

    def _get_values(self, action: argparse.Action, arg_strings: list[str]) -> Any:
        """argparse's reading of the words of an option taken from the command line (never of a
        default left in place: argparse reads those with ``_get_value``), recording it as given."""
        if action.option_strings and action.dest not in self._given:
            self._given.append(action.dest)
        return super()._get_values(action, arg_strings)

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        """argparse's check of a flag's ``choices`` (and of the command's name), its line followed by
        the closest choices (:func:`~headprobe.probe.core.registry.did_you_mean`, as every value
        chosen from a fixed set): ``invalid choice: 'uniformm' (choose from ...) (did you mean 'uniform'?)``."""
        choices = action.choices
        if choices is not None and value not in choices:
            listed = ", ".join(map(repr, choices))
            hint = did_you_mean(str(value), [str(c) for c in choices], hints=getattr(action, "hints", None))
            raise argparse.ArgumentError(action, f"invalid choice: {value!r} (choose from {listed}){hint}")

    def error(self, message: str):
        prog = self.prog
        argv = self._argv
        if message.startswith(REQUIRED_MESSAGE + "COMMAND") and argv[:1] and argv[0][:1] == "-":
            # an unknown option before any command (`headprobe --vers`): argparse says only that none was named
            message = f"unrecognized arguments: {argv[0]}"
        if message.startswith(REQUIRED_MESSAGE):
            message = self._choices_named(message)
        unknown = self._unknown_flags() if message.startswith(REQUIRED_MESSAGE) else []
        if unknown and (meant := self._meant(unknown, message)):
            message = f"unrecognized arguments: {' '.join(unknown)}{meant}"  # the flag meant, not the gap
        elif message.startswith("unrecognized arguments:"):  # reported by the top parser, about a command's flags
            message += _did_you_mean(message.split(":", 1)[1].split(), self._known_options(), argv)
            command = next((c for c in self._known_options() if c and c in argv[:1]), None)
            prog = f"{self.prog} {command}" if command else prog
        self.exit(2, f"{self.prog.split()[0]}: error: {message} (see {prog} --help)\n")  # headprobe, or a script's name

    def _choices_named(self, message: str) -> str:
        """argparse's ``message`` that required arguments are missing, each positional argument
        with choices named by them as ``--help`` spells it (``study``'s ``which`` as
        ``{heads,layouts}``): its field's name tells the user nothing to type."""
        names = message.removeprefix(REQUIRED_MESSAGE).split(", ")
        for a in self._actions:
            if not a.option_strings and a.choices and a.metavar is None and a.dest in names:
                names[names.index(a.dest)] = "{" + ",".join(map(str, a.choices)) + "}"
        return REQUIRED_MESSAGE + ", ".join(names)

    def _unknown_flags(self) -> list[str]:
        """The words this parser was given that spell no option of it (``--to``, ``--outt=x``: their
        flags; an abbreviation is one, allow_abbrev being off; ``-out``: a long option with one dash);
        argparse says only which required flags are missing when one of these was probably meant as one."""
        known = [o for a in self._actions for o in a.option_strings]
        flags = [w.split("=", 1)[0] for w in self._argv if w.startswith("-") and w != "--"]
        return [f for f in flags if f not in known and (f.startswith("--") or "-" + f in known)]

    def _meant(self, unknown: list[str], message: str) -> str:
        """`` (did you mean --out?)`` for the ``unknown`` flags given where argparse's ``message`` says
        required flags are missing: each one's closest option (:func:`_did_you_mean`), else, for one
        unknown flag given a value where one required flag is missing, the missing one (the value
        stood where its value goes: ``--to DIR``, ``--out``'s name before 0.1.0); ``""``: none is meant."""
        if not unknown:
            return ""
        close = _did_you_mean(unknown, {"": self._known_options()[""]}, [])
        missing = [w for w in message.removeprefix(REQUIRED_MESSAGE).replace(",", " ").split() if w.startswith("--")]
        if close or len(unknown) != 1 or len(missing) != 1:
            return close
        words = self._argv
        given = [i for i, w in enumerate(words) if w.split("=", 1)[0] == unknown[0]]
        valued = any("=" in words[i] or (i + 1 < len(words) and not words[i + 1].startswith("-")) for i in given)
        return f" (did you mean {missing[0]}?)" if valued else ""

    def _known_options(self) -> dict[str, list[str]]:
        """Option strings of this parser and, per subcommand, of its subparsers."""
        known = {"": [o for a in self._actions for o in a.option_strings]}
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    known[name] = [o for a in sub._actions for o in a.option_strings]
        return known


def _did_you_mean(unknown: list[str], known: dict[str, list[str]], argv: list[str]) -> str:
    """`` (did you mean --seq-len?)`` for misspelt or abbreviated flags (``--seq_len``, ``--type``,
    ``--over``), from the options of the subcommand named on the command line (all options if none
    is): first the option of the same name with another number of dashes (``--k`` -> ``-k``,
    ``-top-k`` -> ``--top-k``), else the one option the flag abbreviates, else the closest by
    :func:`difflib.get_close_matches`; several an abbreviation fits are all named (``--n`` ->
    ``--n-natural or --n-repeated``). A flag of one dash gets only the first kind of hint. Flags are
    case-sensitive: each kind is looked for as typed first, and only where none fits without regard to
    case (``-K`` -> ``-k``, ``--Out`` -> ``--out``), the option named as it is spelt."""

    words = set(argv)
    pool = next((opts for cmd, opts in known.items() if cmd and cmd in words), None)
    pool = pool or sorted({o for opts in known.values() for o in opts})
    hints = []
    for given in (u.split("=", 1)[0] for u in unknown if u.startswith("-")):
        close = _closest(given.replace("_", "-"), given, pool, str) or _closest(
            given.replace("_", "-").lower(), given, pool, str.lower
        )
        if close:
            hints.append(" or ".join(close))
    return f" (did you mean {', '.join(hints)}?)" if hints else ""


def _closest(flag: str, given: str, pool: list[str], fold) -> list[str]:
    """:func:`_did_you_mean`'s options for ``flag`` (the ``given`` word, ``_`` read as ``-`` and, with
    ``fold`` :meth:`str.lower`, lowercased) among ``pool``, each option compared as ``fold`` gives it and
    named as it is spelt: the same name with another number of dashes (or, folded, another case), else for
    a ``--`` flag the options it abbreviates, else the closest (:func:`difflib.get_close_matches`)."""
    import difflib

    folded = {fold(o): o for o in pool}
    close = [o for o in pool if fold(o).lstrip("-") == flag.lstrip("-") and o != given]
    if not close and flag.startswith("--"):
        close = [o for o in pool if fold(o).startswith(flag)] or [
            folded[m] for m in difflib.get_close_matches(flag, list(folded), n=1, cutoff=0.7)
        ]
    return close


_NEGATIVE = re.compile(r"^-[0-9.]")
"""A word that argparse would read as an option although it is a value: a minus sign, then a digit or a
point (``-1GiB``, ``-1e5``, ``-.5``; argparse takes only plain numerals such as ``-1`` as values)."""


def negative_values_attached(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``argv`` with each value that starts with a minus sign (:data:`_NEGATIVE`) attached to the
    option before it, where that option of the command's parser takes one value (``--kv-limit
    -1GiB`` -> ``--kv-limit=-1GiB``): argparse would read ``-1GiB`` as an unknown option and answer
    "expected one argument"; attached, it reaches the option's type and checks, which refuse it by
    name ("--kv-limit must be positive, got -1GiB"). Options are matched whole, as argparse
    matches them (no abbreviations, :class:`OneLineErrorParser`); ``--`` ends the options.

    Such a word among the values of an option that takes several (``budget --flops-table 1024
    -5k``; ``nargs`` ``*``, ``+`` or a number) cannot be attached: it is read by the option's type
    now, and what the type refuses is argparse's usage error for that option ("argument
    --flops-table: must be a positive integer, got '-5k'") instead of "unrecognized arguments:
    -5k". A word the type accepts is left as it was.

    Raises:
        SystemExit: 2, the usage error printed (:meth:`OneLineErrorParser.error` of the command).
    """
    sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    command = sub.choices.get(argv[0]) if sub is not None and argv else None
    if command is None:
        return argv
    options = command._option_string_actions

    def option(word: str) -> argparse.Action | None:
        if not word.startswith("-") or "=" in word or _NEGATIVE.match(word):
            return None
        return options.get(word)

    def takes_one_value(word: str) -> bool:
        action = option(word)
        return action is not None and action.nargs is None  # store: one value (a switch takes none)

    out = argv[:1]
    several: argparse.Action | None = None  # the option whose values the words now are, if it takes several
    for word in argv[1:]:
        if "--" in out:
            out.append(word)
            continue
        if _NEGATIVE.match(word) and len(out) > 1 and takes_one_value(out[-1]):
            out[-1] = f"{out[-1]}={word}"
            continue
        if _NEGATIVE.match(word) and several is not None:
            _refused_by_type(command, several, word)
        elif word.startswith("-"):
            action = option(word)
            takes_several = action is not None and (action.nargs in ("*", "+") or isinstance(action.nargs, int))
            several = action if takes_several else None
        out.append(word)
    return out


def _refused_by_type(command: argparse.ArgumentParser, action: argparse.Action, word: str) -> None:
    """The usage error argparse gives where ``action``'s type refuses value ``word`` (its own message,
    or "invalid int value: '-5k'"); nothing where the type takes it.

    Raises:
        SystemExit: 2, through ``command.error``."""
    convert = action.type if callable(action.type) else None
    if convert is None:
        return
    name = "/".join(action.option_strings)
    try:
        convert(word)
    except argparse.ArgumentTypeError as e:
        command.error(f"argument {name}: {e}")
    except (TypeError, ValueError):
        command.error(f"argument {name}: invalid {getattr(convert, '__name__', repr(convert))} value: {word!r}")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``headprobe`` parser. With ``command`` (the subcommand about to run), only that
    command's module is imported -- the others get placeholder subparsers -- so a light command
    (``budget``) does not pay for the heavy imports of the rest; with ``--version`` none is
    (0.2 s instead of 5.5 s and 330 MB for torch), nor for a misspelt command (refused from the
    registry's names); otherwise (``--help``) every command."""
    parser = OneLineErrorParser(
        prog="headprobe",
        description="Attention-head interpretability: find head types, verify them by ablation, prune, plot.",
    )
    parser.add_argument("--version", action="version", version=f"headprobe {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    misspelt = command is not None and not command.startswith("-") and command not in COMMANDS
    for name in COMMANDS.names():
        if command in COMMANDS and name != command or command == "--version" or misspelt:
            sub.add_parser(name)  # never parsed: the command line names another command
            continue
        cmd = COMMANDS.get(name)  # a registered command that does not import is a bug: fail loudly
        p = sub.add_parser(
            name,
            help=cmd.help,
            description=cmd.help,
            epilog=cmd.epilog,
            formatter_class=argparse.RawDescriptionHelpFormatter
            if cmd.epilog and "\n" in cmd.epilog
            else argparse.HelpFormatter,
        )
        cmd.add_flags(p)
        p.set_defaults(_run=cmd.execute)
    return parser


def check_argv(argv: list[str]) -> tuple[argparse.Namespace, Any] | None:
    """Check the ``headprobe`` command line ``argv`` (``["scan", "--out", "o"]``) as :func:`main`
    does before its run, and stop there: the flags parsed (negative values attached,
    :func:`negative_values_attached`), ``--formats`` read, the Config made and checked and the
    flags that do nothing refused (:meth:`headprobe.commands.Command.checked_config`). Stops before
    the run's checks that read files or config.json (``--model``, ``--text``, ``--out``, the
    command's ``preflight``) and before any model loads; prints nothing.

    Returns:
        ``(args, config)``; None for ``--help`` and ``--version`` (which :func:`main` answers).

    Raises:
        HeadprobeError: the line :func:`main` would print after ``headprobe: error:`` (a usage
            error of argparse's too).
    """
    import io

    parser = build_parser(argv[0] if argv else None)
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(io.StringIO()):
            args = parser.parse_args(negative_values_attached(parser, list(argv)))
    except SystemExit as e:
        if e.code:
            raise HeadprobeError(said.getvalue().strip().removeprefix("headprobe: error: ")) from None
        return None
    if getattr(args, "formats", None) is not None:
        from headprobe.settings import OutputSettings

        OutputSettings(out="", formats=args.formats)
    return args, COMMANDS.get(args.command).checked_config(args)


def _version() -> str:
    from headprobe import __version__

    return __version__


@contextlib.contextmanager
def _figure_formats(formats: str | None):
    """``--formats`` (:class:`headprobe.settings.OutputSettings`) for the command's run: the figure
    writers read :func:`~headprobe.analyses.vocabulary.figure_formats`, which the flag sets for
    this process (``$HEADPROBE_FIGURE_FORMATS``, restored afterwards); None leaves it as it is.

    Raises:
        HeadprobeError: a format that is not png, pdf or svg.
    """
    if formats is None:
        yield
        return
    from headprobe.settings import OutputSettings

    checked = OutputSettings(out="", formats=formats).formats
    assert checked is not None  # formats given: stored checked
    previous = os.environ.get(FIGURE_FORMATS_ENV)
    os.environ[FIGURE_FORMATS_ENV] = checked
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(FIGURE_FORMATS_ENV, None)
        else:
            os.environ[FIGURE_FORMATS_ENV] = previous


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread like Ctrl-C so that every ``finally`` (temporary files,
    hooks) runs before the process ends."""


class _Stop:
    """The SIGINT and SIGTERM handler of a run (:func:`main`): the first signal raises
    ``KeyboardInterrupt`` (:class:`Terminated` for SIGTERM) in the main thread; once the run is
    stopping (:attr:`stopping`, set by that signal or by :func:`main` catching any interruption)
    a second Ctrl-C or SIGTERM is ignored, so that it cannot break into the ``finally`` blocks that
    clear the staging folder or the restoring of the handlers with a traceback (a Ctrl-C pressed
    twice: ``KeyboardInterrupt`` in ``signal.signal``). After a run from the command line both
    signals are ignored to the process's end (:func:`main`)."""

    def __init__(self) -> None:
        self.stopping = False

    def __call__(self, signum, frame):
        if self.stopping:
            return
        self.stopping = True
        raise Terminated if signum == signal.SIGTERM else KeyboardInterrupt


def _progress_bar_open() -> bool:
    """Whether a tqdm bar (of any tqdm class: each keeps its own ``_instances``) is still on the screen
    (a log's :class:`~headprobe.probe.core.progress.LineBar` draws nothing until it closes)."""
    tqdm = sys.modules.get("tqdm.std")
    progress = sys.modules.get("headprobe.probe.core.progress")
    drawn_at_close = (progress.LineBar,) if progress is not None else ()
    classes = [tqdm.tqdm] if tqdm is not None else []
    while classes:
        cls = classes.pop()
        if any(not isinstance(bar, drawn_at_close) for bar in vars(cls).get("_instances") or ()):
            return True
        classes += cls.__subclasses__()
    return False


def _left(out: str | None, rerun: str = "run the same command again") -> str:
    """What a command stopped before its end left in ``out`` (its ``--out``; None: it has none);
    ``rerun``: how to resume from its checkpoint, where it has one."""
    from pathlib import Path

    from headprobe.probe.core.io import CHECKPOINT_GLOB

    if out is None:
        return "files are written atomically: none was left half-written"
    out = str(Path(out))  # "x/" is said as x/, not x//
    if Path(out).is_dir() and any(Path(out).glob(CHECKPOINT_GLOB)):
        return f"{out}/ holds what it held before this run, and this run's checkpoint: {rerun} to resume from it"
    return (
        f"{out}/ is as it was before this run (a run's files are moved in together when it ends, "
        f"summary.json last); run the command again to start over"
    )


def _own_line(text: str) -> str:
    """``text`` on a line of its own: after a progress bar still on the screen, a newline first."""
    return ("\n" if _progress_bar_open() else "") + text


def _interrupted(e: KeyboardInterrupt, out: str | None) -> str:
    """What an interrupted command left, on a line of its own."""
    how = "terminated" if isinstance(e, Terminated) else "interrupted"
    return _own_line(f"headprobe: {how}; {_left(out)}")


def out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` is an allocation that failed: torch's ``OutOfMemoryError`` (CUDA), the CPU
    allocator's ``RuntimeError`` ("can't allocate memory"), or Python's / numpy's ``MemoryError``."""
    torch = sys.modules.get("torch")
    return (
        isinstance(e, MemoryError)
        or (torch is not None and isinstance(e, torch.OutOfMemoryError))
        or (isinstance(e, RuntimeError) and "can't allocate memory" in str(e))
    )


def _out_of_memory_line(e: BaseException, out: str | None, max_batch: bool = False) -> str:
    """One line for an allocation that failed mid-run (the memory plan's estimate fell short, or
    work it does not plan): what torch said, what to change, what ``out`` holds. The same command
    would fail again: a checkpoint is resumed by a rerun with a smaller ``--memory-budget`` (or
    ``--max-batch``, where the command has it: ``max_batch``), which are not part of its settings
    (:data:`headprobe.options.RUN_ONLY`)."""
    said = (str(e).strip().splitlines() or [type(e).__name__])[0]
    said = said if len(said) <= 200 else said[:197] + "..."
    smaller = "a smaller --memory-budget" + (" or --max-batch" if max_batch else "")
    return _own_line(
        f"headprobe: error: out of memory ({said}); state {smaller}, use --dtype bfloat16, or fewer or "
        f"shorter sequences; {_left(out, f'rerun with {smaller}')}"
    )


def main(argv: list[str] | None = None) -> int:
    """Run the ``headprobe`` command ``argv`` (None: ``sys.argv[1:]``, the process's own command
    line) and return its exit status: 0, 2 for bad input (one line on stderr), 130 or 143 when
    interrupted by Ctrl-C or SIGTERM (one line saying what ``--out`` holds). SIGINT and SIGTERM are
    handled by :class:`_Stop` during the run; afterwards the caller's handlers are restored, except
    for the command line's own run (``argv`` None), which ignores both until the process exits."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from_command_line = argv is None  # the process's own run (headprobe, python -m headprobe)
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv[0] if argv else None)
    try:
        args = parser.parse_args(negative_values_attached(parser, argv))
    except SystemExit as e:  # usage error (2, its line already printed), --help or --version (0)
        return int(e.code or 0)
    in_main = threading.current_thread() is threading.main_thread()  # signal handlers live there only
    stop = _Stop()
    signals = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.signal(s, stop) for s in signals} if in_main else {}
    try:
        from headprobe.options import input_values, own_run
        from headprobe.probe.core.errors import PYTHON_NOTES
        from headprobe.probe.core.io import command_line, run_inputs
        from headprobe.probe.core.outlock import output_claims

        notes = PYTHON_NOTES.set(False)  # the line printed is the message alone: no note for Python
        try:  # own_run: --threads and --memory-budget hold for this run, not for a Python caller's next
            with (
                own_run(),
                _figure_formats(getattr(args, "formats", None)),
                run_inputs(input_values(vars(args))),
                command_line(argv),  # summary.json's command: the words as typed
                output_claims(),  # the --out the run claims (prepare_output_dir) is its own until it ends
            ):
                figure_formats()  # a bad $HEADPROBE_FIGURE_FORMATS is refused before any work, not at the first figure
                return int(args._run(args) or 0)
        finally:
            PYTHON_NOTES.reset(notes)
    except HeadprobeError as e:
        if first_rank():  # under torchrun every rank fails alike: one line, from rank 0
            print(f"headprobe: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `headprobe budget | head`: the reader left; end quietly, as cat does
        # Python flushes stdout at exit and would complain again: point it at /dev/null first
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a program killed by it
    except KeyboardInterrupt as e:
        stop.stopping = True  # raised by a signal or not: a second one is ignored from now on
        if first_rank():  # Ctrl-C reaches every torchrun rank: one line, from rank 0
            print(_interrupted(e, getattr(args, "out", None)), file=sys.stderr)
        return 143 if isinstance(e, Terminated) else 130
    except (RuntimeError, MemoryError) as e:
        if not out_of_memory(e):
            raise
        print(_out_of_memory_line(e, getattr(args, "out", None), hasattr(args, "max_batch")), file=sys.stderr)
        return 2
    finally:
        for signum, handler in previous.items():  # the command line's run has ended, stopped or not:
            # the process only exits now, and a signal there killed it (status -2, not the run's) or
            # broke into a finalizer with a traceback; a caller in Python (tests) gets its own back
            signal.signal(signum, signal.SIG_IGN if from_command_line else handler)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
