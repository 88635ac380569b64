"""``headprobe export --from DIR --out OUT --format duo|headkv|mib|parquet|all``: a scan, kv or circuit
output folder written in the files other tools read (formats and sources: docs/export.md,
:mod:`headprobe.analyses.exchange`):

* ``duo``: DuoAttention's ``full_attention_heads.tsv`` (``[n_layers, n_kv_heads]`` in [0, 1], no
  header) and ``config.json`` (``sink_size``, ``recent_size``; kvpress's ``DuoAttentionPress``
  reads the same): from a kv folder the policy (1 full, 0 streaming), from a scan ``--score``
  aggregated per KV group (the max over the group's query heads, clipped to [0, 1]);
* ``headkv``: Retrieval_Head / HeadKV's ``head_score/<model>.json`` (``{"layer-head": [score]}``);
* ``mib``: EAP-IG / MIB's circuit graph JSON (``Graph.to_json``'s layout) from a circuit folder
  (q/k/v receivers, scores; the path-patched edges' exact effects under its ``headprobe`` key);
* ``parquet``: ``heads.parquet`` (one row per head: scores, metrics, verdicts; a kv folder's
  groups, a circuit folder's edges) and its dataset card ``README.md``.

Every file records the model, n_layers, n_heads and n_kv_heads where its format has room (the TSV
and the HeadKV JSON have none: config.json and ``head_score/<model>.provenance.json`` beside them).
The folder is written as every command's (a staging folder swapped in, ``summary.json`` last), so a
refusal leaves nothing half-written. No model is loaded and no torch imported.
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, dataclass
from pathlib import Path

from headprobe import options
from headprobe.analyses.exchange import FORMATS
from headprobe.commands import Command, lazy_names, resolve
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.core.registry import did_you_mean
from headprobe.settings import Needs, setting

_CORE = ("ExportResult", "run", "export")
"""Names of :mod:`headprobe.commands.export_core` (pandas, pyarrow), imported on first use."""

__all__ = ["HELP", "COMMAND", "ExportConfig", "main", *_CORE]

__getattr__ = lazy_names(__name__, "headprobe.commands.export_core", _CORE)

HELP = (
    "write a scan, kv or circuit folder as DuoAttention, HeadKV, MIB/EAP-IG or Parquet files for other tools, "
    "or a scan, prune, ablate, kv, circuit or study folder's tables as booktabs LaTeX"
)
CHOICES = (*FORMATS, "latex", "all")
"""``--format``: the exchange formats, LaTeX tables, or every one the source has."""

FORMAT_HINTS = {
    name: ("duo", "DuoAttention's format, which kvpress reads")
    for name in ("kvpress", "duoattention", "duo-attention", "duo_attention")
}
"""``--format`` words that name a format by its tool (refused with the format as the hint)."""
DUO_SINK, DUO_RECENT = 128, 256
"""``sink_size`` and ``recent_size`` written for a scan source when ``--sink`` / ``--recent`` are not given."""


@dataclass(frozen=True)
class ExportConfig:
    """Settings of ``headprobe export`` (every field's help is its flag's).

    Attributes:
        source: a folder written by ``headprobe scan``, ``kv`` or ``circuit`` (``prune`` and ``ablate`` too
            for ``latex``) (flag ``--from``).
        out: the folder the files go to (empty or absent unless ``overwrite``; None: nothing is
            written, :func:`~headprobe.commands.export_core.export` returns the files).
        format: ``duo``, ``headkv``, ``mib``, ``parquet``, ``latex`` (booktabs tables of a scan, prune,
            ablate, kv or circuit folder) or ``all`` (every one the source has).
        score: a scan's column written as DuoAttention values and HeadKV scores (None:
            ``retrieval`` where the scan computed it, else ``induction``); refused for a kv or
            circuit folder and for formats without a score (Parquet writes every column).
        sink: DuoAttention's ``sink_size`` for a scan source's duo files (None: :data:`DUO_SINK`);
            refused for a kv folder (its policy gives its own) and without the duo format (a
            ``--format`` other than duo or all: before the source is read, :class:`~headprobe.settings.Needs`).
        recent: DuoAttention's ``recent_size``, likewise (None: :data:`DUO_RECENT`).
        overwrite: replace the files of a non-empty ``out``.

    Raises:
        HeadprobeError: an unknown format, an empty --from, or a negative sink or recent size.
    """

    source: str = setting(
        MISSING,
        "output folder of headprobe scan, kv or circuit (prune, ablate and study too for --format latex)",
        flag="--from",
        metavar="DIR",
        required=True,
        kw_only=True,
    )
    out: str | None = setting(
        None,
        "folder to write (empty or absent unless --overwrite)",
        metavar="OUT",
        required=True,
        kw_only=True,
    )
    format: str = setting(
        "all",
        f"{', '.join(CHOICES[:-1])} or all (every format the source has; default %(default)s)",
        choices=CHOICES,
        hints=FORMAT_HINTS,
    )
    score: str | None = setting(
        None,
        "a scan's column for the DuoAttention and HeadKV files (default: retrieval, else induction)",
        metavar="COLUMN",
        needs=Needs("format", ("duo", "headkv", "all")),
    )
    sink: int | None = setting(
        None,
        f"DuoAttention sink_size for a scan source's duo files (default {DUO_SINK}; a kv policy gives its own)",
        type=int,
        needs=Needs("format", ("duo", "all")),
    )
    recent: int | None = setting(
        None,
        f"DuoAttention recent_size for a scan source's duo files (default {DUO_RECENT})",
        type=int,
        needs=Needs("format", ("duo", "all")),
    )
    overwrite: bool = setting(False, "replace files in a non-empty --out folder", action="store_true")

    def __post_init__(self):
        if self.format not in CHOICES:
            raise HeadprobeError(
                f"--format must be one of {', '.join(CHOICES)}, got {self.format!r}{did_you_mean(str(self.format), CHOICES, hints=FORMAT_HINTS)}"
            )
        if not str(self.source).strip():  # "" is the current folder to Path: refuse it as --out "" is
            raise HeadprobeError(
                "the source folder name is empty; give --from the output folder of a headprobe run (scan, kv, circuit; prune, ablate and study for --format latex)"
            )
        if self.sink is not None and self.sink < 0:
            raise HeadprobeError(f"--sink must be >= 0, got {self.sink}")
        if self.recent is not None and self.recent < 1:
            raise HeadprobeError(f"--recent must be >= 1, got {self.recent}")


def check_apart(source: Path, out: Path) -> None:
    """Refuse an output folder that is the source folder, lies inside it or holds it (paths resolved,
    links followed): writing there, with ``--overwrite``, would replace or delete the run's own files.

    Raises:
        HeadprobeError: one line naming both folders."""
    src, dst = source.resolve(), out.resolve()
    where = "is" if src == dst else "is inside" if src in dst.parents else "holds" if dst in src.parents else None
    if where:
        raise HeadprobeError(
            f"the output folder {out} {where} the source folder {source}: give an output folder apart "
            "from it (writing there would replace the run's own files)"
        )


def check_out(config: ExportConfig) -> None:
    """Refuse ``config.out`` before the source is read or pandas imported (seconds): a folder not
    empty without ``overwrite``, a file, not writable
    (:func:`~headprobe.probe.core.io.prepare_output_dir`, nothing created), or one that is, holds
    or lies inside the source folder (:func:`check_apart`). Nothing to check where ``out`` is None.

    Raises:
        HeadprobeError: one line naming the folder."""
    from headprobe.probe.core.io import prepare_output_dir

    if config.out is not None:
        if not str(config.out).strip():  # before check_apart, which reads "" as the current folder
            prepare_output_dir(config.out, config.overwrite, create=False)  # refuses the empty name
        check_apart(Path(config.source), Path(config.out))
        prepare_output_dir(config.out, config.overwrite, create=False)


def main(args: argparse.Namespace, config: ExportConfig) -> int:
    """Check ``--out`` (:func:`check_out`), read the source folder, build every file in memory, then
    write the folder (nothing on a refusal)."""
    assert config.out is not None  # --out is required on the command line
    check_out(config)
    result = resolve("headprobe.commands.export_core:run")(config)  # named as a string: no import cycle
    paths = result.save(config.out, overwrite=config.overwrite)
    print(result.report())
    print(f"\nwrote {len(paths)} files to {Path(config.out)}/")  # Path: "duo/" is written duo/, not duo//
    options.say_replaced_and_kept(config.out)
    return 0


COMMAND = Command(
    HELP, config=ExportConfig, run="headprobe.commands.export:main", api="headprobe.commands.export_core:export"
)
"""``headprobe export``, registered in :data:`headprobe.commands.COMMANDS`."""
