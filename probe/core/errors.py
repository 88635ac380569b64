"""The one exception type the CLI turns into a single line on stderr and exit code 2."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from contextvars import ContextVar

PYTHON_NOTES: ContextVar[bool] = ContextVar("headprobe_python_notes", default=True)
"""Whether a refusal raised now may take a note for a Python caller (the Python spelling of the
command-line flags its message names, ``BaseException.add_note``): True at the top of a Python
caller's call; False inside a command's Python function or a result's ``save`` (the outermost one
notes: :func:`headprobe.options.notes_flags`, :func:`headprobe.probe.core.io.keeps_inputs`) and
in the command line's run (:func:`headprobe.cli.main` prints the message alone)."""

FLAG_IN_MESSAGE = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*|-[a-zA-Z])(?![\w-])")
"""A command-line flag named in a message: ``--n-random``, ``-k`` (not the ``-negative`` of ``non-negative``)."""


class HeadprobeError(ValueError):
    """A problem with the user's input or environment (not a bug in headprobe).

    The message is one line, says what is wrong and, where possible, how to fix it. The CLI
    prints it as ``headprobe: error: <message>`` and exits with status 2, without a traceback.
    A ``ValueError``: a Python caller's ``except ValueError`` catches a bad argument or file, as it
    catches the standard library's bad-value errors (a :class:`TypeError` of an unknown keyword
    stays a ``TypeError``).
    """


class InputValueError(HeadprobeError):
    """A bad value of a Python function's argument (an empty ``heads=[]``, an ``attention_mask``
    holding a 2). Every :class:`HeadprobeError` is a ``ValueError`` now; this name, kept for the
    code that catches it, marks the refusals of an argument's value."""


def one_line_repr(value: object, width: int = 60) -> str:
    """``repr(value)`` on one line (its runs of whitespace, newlines included, as one space) and at
    most ``width`` characters: what an error message shows of an argument, so that a
    ``torch.nn.Module`` given where a name or a loaded model belongs (its repr spans many lines)
    keeps the message one line."""
    text = " ".join(repr(value).split())
    return text if len(text) <= width else text[: width - 3] + "..."


@contextlib.contextmanager
def python_note(note: Callable[[str], str | None]) -> Iterator[None]:
    """Add ``note(message)`` (where not None) to a :class:`HeadprobeError` leaving the block, the same
    exception object, its message untouched, when the block is the outermost of its kind in a Python
    caller's call (:data:`PYTHON_NOTES`; the blocks inside it and the command line's run add none).
    :func:`headprobe.options.notes_flags` and :func:`headprobe.probe.core.io.keeps_inputs` run in it."""
    if not PYTHON_NOTES.get():
        yield
        return
    token = PYTHON_NOTES.set(False)
    try:
        yield
    except HeadprobeError as error:
        if (text := note(str(error))) is not None:
            error.add_note(text)
        raise
    finally:
        PYTHON_NOTES.reset(token)
