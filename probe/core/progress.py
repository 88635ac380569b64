"""Progress bars on stderr (:func:`progress_bar`): tqdm's live bar on a terminal or in a notebook;
on a stream that is not a terminal (``2>log``, a pipe, a captured stream) whole lines only: one
per phase of a bar, one when it closes and, in a long phase, one at most every 30 s and 10% of it,
or every 30 s while one step runs longer (:class:`LineBar`)."""

from __future__ import annotations

import sys
import threading
import warnings
import weakref
from collections.abc import Iterable
from typing import Any

from tqdm.std import TqdmWarning
from tqdm.std import tqdm as _std_tqdm


class LineBar(_std_tqdm):
    """A tqdm bar that draws nothing while it runs and writes whole lines instead: one when a phase
    ends (its description changes, :meth:`set_description`, after it counted something), one when
    it closes and, in a long phase, a sign of life: a line (count/total, elapsed time, rate, as
    tqdm's ``format_meter`` writes them) once both :attr:`INTERVAL_S` seconds have passed and
    :attr:`STEP_FRACTION` of ``total`` more has been counted since the last line (without a
    ``total``, the seconds alone); a phase shorter than that writes its one line. The check runs
    when the bar is counted (``update``); a single step that runs longer (a model load, one long
    forward pass) gets the same line, its elapsed time growing, from a daemon thread
    (:func:`_step_sign_of_life`) once :attr:`INTERVAL_S` seconds have passed with neither a line nor a
    count, and every :attr:`INTERVAL_S` after, written under tqdm's lock. In a log a
    live bar's redraws are ``\\r``-separated fragments of lines, and a nested bar's cursor moves are
    escape codes. A bar opened inside another (tqdm's ``pos`` > 0) or with ``leave=False`` writes
    nothing at all. Counting, ``total``, ``tqdm.write`` and the rest of tqdm's interface work as
    for any tqdm bar."""

    INTERVAL_S = 30.0  # seconds, at least, between two lines of one phase
    STEP_FRACTION = 0.1  # of total, at least, counted between two lines of one phase

    leave: bool | None  # tqdm's (set in its __init__), declared for the type checker

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._written_n: float | None = None  # the count at the last line written (None: none yet)
        self._written_t: float | None = None  # tqdm's clock at the last line written (None: none yet)
        self._closing = False
        self._beat: tuple[float, str] | None = None  # (count, description) of the last sign of life
        self._stop = threading.Event()  # set on close: the step thread's end
        super().__init__(*args, **kwargs)
        if self._writes():
            beat = (weakref.ref(self), self._stop, self.n, self.start_t)  # a weak one: never closed, still collected
            threading.Thread(target=_step_sign_of_life, args=beat, name="LineBar", daemon=True).start()

    def _writes(self) -> bool:
        """Whether this bar writes lines: an outermost bar (``pos`` 0) that is kept (``leave``)."""
        return not self.disable and abs(self.pos) == 0 and self.leave is not False

    def _write_line(self, counted: bool = True) -> None:
        """The bar's line; ``counted`` False (a step's sign of life): its count is not taken as written."""
        self.fp.write(str(self) + "\n")
        getattr(self.fp, "flush", lambda: None)()
        if counted:
            self._written_n = self.n
        self._written_t = self._time()

    def _due(self) -> bool:
        """Whether a long phase is due a line (see the class): both the seconds and the fraction
        of ``total`` since the last line (or the bar's start)."""
        start = getattr(self, "start_t", None)  # None: tqdm's __init__ is still running
        if start is None or self._closing:
            return False
        since_t = self._time() - (self._written_t if self._written_t is not None else start)
        since_n = self.n - (self._written_n if self._written_n is not None else self.initial)
        if since_t < self.INTERVAL_S or since_n <= 0:
            return False
        return not self.total or since_n >= self.STEP_FRACTION * self.total

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        """Never drawn while running, only a whole line when a long phase is due one (:meth:`_due`);
        False: tqdm's close then writes no clearing ``\\r``."""
        if self._writes() and self._due():
            self._write_line()
            self._beat = (self.n, self.desc)
        return False

    def clear(self, nolock: bool = False) -> None:
        """Nothing on the stream to clear."""

    def moveto(self, n: int) -> None:
        """No cursor moves: a log has no cursor."""

    def set_description(self, desc: str | None = None, refresh: bool | None = True) -> None:
        """A new phase: the one that ends is written as a line first, where it counted something."""
        if (
            self._writes()
            and self.n > (self._written_n or self.initial)
            and (desc or "") != self.desc.removesuffix(": ")
        ):
            self._write_line()
        super().set_description(desc, refresh)

    def close(self) -> None:
        """Close as tqdm does, then write the last line (see :meth:`_writes`) unless a sign of life
        just wrote this count."""
        self._stop.set()
        if self.disable:
            return
        writes = self._writes()
        if writes:
            self._ema_dt = lambda: None  # the overall rate, as tqdm's own close reports it
        self.leave = False  # tqdm's close then draws nothing
        self._closing = True  # nor a sign of life from its display
        super().close()
        if writes and self._beat != (self.n, self.desc):  # not the sign of life's line again
            with self.get_lock():  # not amid a step's sign of life
                self._write_line()


def _step_sign_of_life(ref: weakref.ref[LineBar], stop: threading.Event, n: float, counted_t: float) -> None:
    """A writing :class:`LineBar`'s thread (``ref``, started at count ``n`` at tqdm's clock ``counted_t``):
    every quarter of :attr:`LineBar.INTERVAL_S` until ``stop`` (set on close) or the bar is collected,
    write its line (not as counted) where :attr:`LineBar.INTERVAL_S` seconds have passed since both its
    last line and the last change of its count. Ends quietly where the stream no longer takes writes."""
    while (bar := ref()) is not None:
        tick = bar.INTERVAL_S / 4
        del bar  # no strong reference while waiting: a bar never closed is still collected (tqdm's __del__)
        if stop.wait(tick) or (bar := ref()) is None:
            return
        try:
            with bar.get_lock():
                if bar._closing:
                    return
                now = bar._time()
                if bar.n != n:
                    n, counted_t = bar.n, now
                last = max(counted_t, bar._written_t if bar._written_t is not None else counted_t)
                if now - last >= bar.INTERVAL_S:
                    bar._write_line(counted=False)
        except (ValueError, OSError):  # a closed stream (a test's capture after it ended)
            return


def is_terminal(stream: Any) -> bool:
    """Whether ``stream`` is an interactive terminal (``isatty``; False where it cannot say)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed stream
        return False


def auto_tqdm() -> type[_std_tqdm]:
    """``tqdm.auto``'s bar class, imported without the ``TqdmWarning: IProgress not found`` it gives
    (once, at its first import) in a Jupyter kernel without ipywidgets; it then chooses tqdm's plain
    bar, which :func:`progress_bar` replaces with a :class:`LineBar` (a kernel's stderr is no terminal)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="IProgress not found", category=TqdmWarning)
        from tqdm.auto import tqdm as auto
    return auto


def quiet_notebook_tqdm() -> None:
    """In a Jupyter kernel, import ``tqdm.auto`` now (:func:`auto_tqdm`), before transformers'
    huggingface_hub does so with the ipywidgets warning; elsewhere nothing (``import headprobe``
    stays light)."""
    if "ipykernel.zmqshell" in sys.modules and "tqdm.auto" not in sys.modules:
        auto_tqdm()


def progress_bar(iterable: Iterable | None = None, *, progress: bool = True, file: Any = None, **kwargs: Any) -> Any:
    """A progress bar over ``iterable`` (or counted with ``update``) on ``file`` (default stderr):
    ``tqdm.auto``'s live bar on a terminal or in a notebook, a :class:`LineBar` (one line when it
    closes, nothing for a nested bar) on anything else, a silent one without ``progress``. The
    ``kwargs`` are tqdm's (``total``, ``desc``, ``unit``, ...); ``file``: a text stream (``write``)."""
    auto = auto_tqdm()
    stream = file if file is not None else sys.stderr
    notebook = auto.__module__.startswith("tqdm.notebook")  # tqdm.auto's widget in Jupyter
    live = notebook or is_terminal(stream)
    cls = auto if live or not progress else LineBar
    return cls(iterable, file=stream, disable=not progress, **kwargs)
