"""The one writer of a command's output directory: tables, figures, other files and, last,
``summary.json``, each file atomically, so a directory with its summary in it is complete.

Every command that writes a summary calls :func:`write_outputs` (``scan``, ``ablate``, ``prune``,
``patch``, ``circuit``, ``kv``, ``atlas``, ``train``, ``study``); the order of its steps is the guarantee ``headprobe`` prints on
Ctrl-C ("files already written are complete (summary.json comes last)").
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path

from matplotlib.figure import Figure

from headprobe.probe.io import prepare_output_dir, write_json, write_text


def write_outputs(out_dir: str | os.PathLike[str], overwrite: bool, *, summary: dict | Callable[[], dict],
                  tables: Mapping[str, str] | None = None,
                  figures: Mapping[str, Figure | Callable[[], Figure]] | Callable[[], Mapping[str, Figure]] | None = None,
                  extra: Callable[[Path], list[Path]] | None = None, summary_name: str = "summary.json",
                  resumable: bool = False, progress: bool = False) -> list[Path]:
    """Write into ``out_dir`` (created; checked by :func:`~headprobe.probe.io.prepare_output_dir`
    with ``overwrite`` and ``resumable``): each of ``tables`` (file name -> text, usually a CSV),
    each of ``figures`` (stem -> a figure or a function drawing it, or a function returning that
    mapping; none is drawn with ``--formats none``), written in
    :func:`~headprobe.analyses.vocabulary.figure_formats` by
    :func:`~headprobe.analyses.figures.save_figure`; ``progress``: a progress bar on stderr), the
    files ``extra(out)`` writes (it returns their paths), and, last, ``summary`` (a dict or a
    function returning it, written by :func:`~headprobe.probe.io.write_json`: no bare NaN) as
    ``summary_name``.

    Returns:
        The paths written, in that order (``summary_name`` last).

    Raises:
        HeadprobeError: ``out_dir`` is a file, not writable, or not empty without ``overwrite``
            (a directory holding only a run checkpoint counts as empty with ``resumable``).
    """
    from tqdm.auto import tqdm

    from headprobe.analyses.figures import save_figure
    from headprobe.analyses.vocabulary import figure_formats

    out = prepare_output_dir(out_dir, overwrite, resumable=resumable)
    written: list[Path] = []
    for name, text in (tables or {}).items():
        write_text(out / name, text)
        written.append(out / name)
    formats = figure_formats()
    if not formats:  # --formats none: no figure function is called
        figures = {}
    elif callable(figures):
        figures = figures()
    figures = figures or {}
    for stem, fig in tqdm(figures.items(), total=len(figures), desc=f"writing figures ({', '.join(formats)})",
                          unit="figure", disable=not progress or not figures):
        written += save_figure(fig() if callable(fig) else fig, out / stem)
    if extra is not None:
        written += extra(out)
    write_json(out / summary_name, summary() if callable(summary) else summary)
    return [*written, out / summary_name]
