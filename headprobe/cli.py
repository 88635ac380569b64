"""The ``headprobe`` command.

Each subcommand lives in its own module under :mod:`headprobe.commands`, which provides ``HELP``
(one line), ``add_arguments(parser)`` (flags shared by several commands come from
:mod:`headprobe.options`) and ``main(args) -> int``, which only maps the flags to the command's
config and calls its ``run``; add a module to :data:`SUBCOMMANDS` to add a subcommand. Errors a user can cause are raised as :class:`headprobe.probe.errors.HeadprobeError` and end the
program with one line on stderr and exit status 2 (argparse's usage errors too, see :class:`OneLineErrorParser`).
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import threading

from headprobe.probe.errors import HeadprobeError

# subcommand -> module providing HELP, add_arguments(parser), run(args)
SUBCOMMANDS: dict[str, str] = {
    "scan": "headprobe.commands.scan",
    "budget": "headprobe.commands.budget",
    "ablate": "headprobe.commands.ablate",
    "prune": "headprobe.commands.prune",
    "train": "headprobe.commands.train",
    "study": "headprobe.commands.study",
}


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse with usage errors as one line (``headprobe: error: ... (see headprobe scan
    --help)``) and exit status 2, like every other bad input; subparsers inherit it."""

    def error(self, message: str):
        self.exit(2, f"headprobe: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="headprobe",
        description="Attention-head interpretability: find head types, verify them by ablation, prune, plot.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module_name in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)  # a registered command that does not import is a bug: fail loudly
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_run=getattr(module, "main", None) or module.run)  # main(args) -> int; run(args) until converted
    return parser


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread like Ctrl-C so that every ``finally`` (temporary files,
    hooks) runs before the process ends."""


def _raise_terminated(signum, frame):
    raise Terminated


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = build_parser()
    args = parser.parse_args(argv)
    in_main = threading.current_thread() is threading.main_thread()  # signal handlers live there only
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if in_main else None
    try:
        return int(args._run(args) or 0)
    except HeadprobeError as e:
        print(f"headprobe: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        how = "terminated" if isinstance(e, Terminated) else "interrupted"
        print(f"headprobe: {how}; files already written are complete (summary.json comes last), "
              f"the rest were not written", file=sys.stderr)
        return 143 if isinstance(e, Terminated) else 130
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
