"""The one writer of a command's output directory: tables, figures, other files and, last,
``summary.json``, each file atomically, so a directory with its summary in it is complete.

Every command that writes a summary calls :func:`write_outputs` (``scan``, ``ablate``, ``prune``,
``patch``, ``circuit``, ``kv``, ``atlas``, ``train``, ``study``; ``show`` without a summary). It writes
into a staging folder and swaps the files in at the end, the summary last: what ``headprobe`` says
on Ctrl-C (the directory is as it was before the run, or holds the whole new run).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from headprobe.probe.core.io import (
    ReadsInputs,
    keeps_inputs,
    prepare_output_dir,
    staging,
    swap_in,
    write_json,
    write_text,
)
from headprobe.probe.core.outlock import output_claims

if TYPE_CHECKING:  # matplotlib is imported where a figure is drawn, not by the commands' light modules
    from matplotlib.figure import Figure


def write_outputs(
    out_dir: str | os.PathLike[str],
    overwrite: bool,
    *,
    summary: dict | Callable[[], dict] | None,
    tables: Mapping[str, str] | None = None,
    figures: Mapping[str, Figure | Callable[[], Figure]] | Callable[[], Mapping[str, Figure]] | None = None,
    extra: Callable[[Path], list[Path]] | None = None,
    summary_name: str = "summary.json",
    resumable: bool = False,
    progress: bool = False,
    produced: Sequence[Path] = (),
    models: Sequence[str] = (),
    formats: str | Sequence[str] | None = None,
) -> list[Path]:
    """Write into ``out_dir`` (created; checked by :func:`~headprobe.probe.core.io.prepare_output_dir`
    with ``overwrite`` and ``resumable``): each of ``tables`` (file name -> text, usually a CSV),
    each of ``figures`` (stem -> a figure or a function drawing it, or a function returning that
    mapping; none is drawn with ``formats`` ``"none"`` or ``()``), written in the ``formats``
    given (``"png"``, ``("png", "svg")``; None: ``$HEADPROBE_FIGURE_FORMATS``, which ``--formats``
    sets, or all three: :func:`~headprobe.analyses.vocabulary.figure_formats`, checked before
    anything is written) by :func:`~headprobe.analyses.figures.save_figure`; ``progress``: a progress bar on stderr), the
    files ``extra(out)`` writes (it returns their paths), and, last, ``summary`` (a dict or a
    function returning it, written by :func:`~headprobe.probe.core.io.write_json`: no bare NaN) as
    ``summary_name`` (None: no summary).

    Everything is written into a staging folder first and then swapped in
    (:func:`~headprobe.probe.core.io.swap_in`): the previous run's summary goes first, then its other
    files (``--overwrite``), and the new summary comes last, so a directory never mixes two runs and
    a run that fails or is interrupted while writing leaves it as it was. Files headprobe did not
    write stay (:func:`~headprobe.probe.core.io.foreign_files`); a model folder in ``out_dir`` is
    refused unless it is one of ``models``, the model folders this run writes (``"."``, ``out_dir``
    itself), written there by an earlier run (:func:`~headprobe.probe.core.io.check_no_model`). ``produced``: paths in ``out_dir`` this run
    already wrote itself (atlas's per-model scans), recorded as its own. ``extra`` is called with the
    staging folder and writes relative to it.

    Returns:
        The paths written, in that order (``summary_name`` last).

    Raises:
        HeadprobeError: ``out_dir`` is a file, not writable, or not empty without ``overwrite``
            (a directory holding only a run checkpoint counts as empty with ``resumable``), or holds
            a model this run does not write; InputValueError (a HeadprobeError): a ``formats`` not
            of png, pdf, svg or none (:func:`~headprobe.analyses.vocabulary.figure_formats`).
    """
    from headprobe.analyses.figures import save_figure
    from headprobe.analyses.vocabulary import figure_formats
    from headprobe.probe.core.progress import progress_bar

    formats = figure_formats(formats)  # a bad one is refused before out_dir is touched
    with output_claims():  # out_dir claimed from its check to the last file moved in (outlock)
        out = prepare_output_dir(out_dir, overwrite, resumable=resumable, models=models)
        with staging(out) as tmp:
            written: list[Path] = []
            for name, text in (tables or {}).items():
                write_text(tmp / name, text)
                written.append(tmp / name)
            if not formats:  # --formats none: no figure function is called
                figures = {}
            elif callable(figures):
                figures = figures()
            figures = figures or {}
            for stem, fig in progress_bar(
                figures.items(),
                total=len(figures),
                desc=f"writing figures ({', '.join(formats)})",
                unit="figure",
                progress=progress and bool(figures),
            ):
                written += save_figure(fig() if callable(fig) else fig, tmp / stem, formats=formats)
            if extra is not None:
                written += extra(tmp)
            if summary is not None:
                write_json(tmp / summary_name, summary() if callable(summary) else summary)
                written.append(tmp / summary_name)
            files = [Path(p).relative_to(tmp).as_posix() for p in written]
            swap_in(out, tmp, files, [Path(p).relative_to(out).as_posix() for p in produced])
    return [out / f for f in files]


class WritesOutputs(ReadsInputs):
    """A command's result whose :meth:`save` writes its :meth:`outputs` with :func:`write_outputs`
    (``ablate``, ``prune``, ``patch``, ``circuit``, ``kv``, ``diff``, ``robustness``, ``train``, ``study``)."""

    def outputs(self) -> dict[str, Any]:
        """The keywords of :func:`write_outputs` besides ``out_dir``, ``overwrite`` and ``formats``
        (``summary``, ``tables``, ``figures``, ``extra``, ...): what :meth:`save` writes."""
        raise NotImplementedError

    @keeps_inputs
    def save(
        self, out_dir: str | Path, overwrite: bool = False, *, formats: str | Sequence[str] | None = None
    ) -> list[Path]:
        """Write the result's files (:meth:`outputs`) and, last, its summary into ``out_dir`` (created
        if absent; staged and swapped in, each file atomically: :func:`write_outputs`). Returns the
        paths written.

        Args:
            formats: the figures' formats, as ``--formats`` (:func:`~headprobe.analyses.vocabulary.figure_formats`).

        Raises:
            HeadprobeError: ``out_dir`` is a file, not writable, or not empty without ``overwrite``
                (a directory holding only a run checkpoint counts as empty for ``ablate`` and ``prune``);
                a message naming flags has a note giving their Python spelling (``e.__notes__``).
            InputValueError: ``formats`` not of png, pdf, svg or none (one line naming the closest),
                before anything is written.
        """
        return write_outputs(out_dir, overwrite, formats=formats, **self.outputs())
