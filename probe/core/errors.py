"""The one exception type the CLI turns into a single line on stderr and exit code 2."""

from __future__ import annotations

from contextvars import ContextVar

PYTHON_NOTES: ContextVar[bool] = ContextVar("headprobe_python_notes", default=True)
"""Whether a refusal raised now may take a note for a Python caller (the Python spelling of the
command-line flags its message names, ``BaseException.add_note``): True at the top of a Python
caller's call; False inside a command's Python function or a result's ``save`` (the outermost one
notes: :func:`headprobe.options.notes_flags`, :func:`headprobe.probe.core.io.keeps_inputs`) and
in the command line's run (:func:`headprobe.cli.main` prints the message alone)."""


class HeadprobeError(Exception):
    """A problem with the user's input or environment (not a bug in headprobe).

    The message is one line, says what is wrong and, where possible, how to fix it. The CLI
    prints it as ``headprobe: error: <message>`` and exits with status 2, without a traceback.
    """


class InputValueError(HeadprobeError, ValueError):
    """A bad value of a Python function's argument (an empty ``heads=[]``, an ``attention_mask``
    holding a 2): a :class:`HeadprobeError` (one line; the CLI's exit status 2) that ``except
    ValueError`` catches too, as the standard library's own bad-value errors."""


def one_line_repr(value: object, width: int = 60) -> str:
    """``repr(value)`` on one line (its runs of whitespace, newlines included, as one space) and at
    most ``width`` characters: what an error message shows of an argument, so that a
    ``torch.nn.Module`` given where a name or a loaded model belongs (its repr spans many lines)
    keeps the message one line."""
    text = " ".join(repr(value).split())
    return text if len(text) <= width else text[: width - 3] + "..."
