"""``headprobe view DIR``: write ``DIR/index.html``, one self-contained page (no network: inline
JavaScript and CSS) over the outputs of ``headprobe scan`` (head_scores.csv, summary.json,
patterns.npz) or ``headprobe ablate`` (head_ablation.csv, summary.json) in DIR.

It uses whatever is there: the score maps and the table always, the attention patterns when
``patterns.npz`` exists (else the page says how to get them). ``--model NAME`` computes the
patterns of a scan directory that has none (the token sets are rebuilt from summary.json's
settings, so they are the scan's) and writes ``patterns.npz`` first; ``--ablation DIR2`` adds an
ablate run's per-head loss increases to a scan's table; ``--circuit DIR3`` adds a ``headprobe
circuit`` run's section (its figure, top edges, path-patching sweeps, QK attribution). The page builder is
:mod:`headprobe.analyses.viewer`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import zipfile
from dataclasses import MISSING, dataclass
from pathlib import Path

from headprobe import options
from headprobe.commands import Command
from headprobe.probe.core.errors import HeadprobeError
from headprobe.settings import Flags, ModelSettings, Needs, given_in_python, positive_int, refuse_inert, setting, shared

HELP = "write DIR/index.html: an interactive, offline page of a scan's (or ablate run's) head scores and patterns"

EPILOG = "--model NAME computes patterns.npz when DIR (a scan) has none; without it no model is loaded"
SCORES, ABLATION, PATTERNS, SUMMARY, PAGE = (
    "head_scores.csv",
    "head_ablation.csv",
    "patterns.npz",
    "summary.json",
    "index.html",
)


@dataclass(frozen=True)
class ViewConfig(ModelSettings):
    """Settings of ``headprobe view``: the shared :class:`~headprobe.settings.ModelSettings` (how
    ``model`` is loaded where one is, :func:`headprobe.options.load_model`) composed, and the view's own.

    Attributes:
        dir: a directory written by ``headprobe scan`` or ``headprobe ablate``; index.html goes there.
        ablation: another directory holding an ablate run's head_ablation.csv, merged into the table.
        circuit: a ``headprobe circuit`` output directory (summary.json, circuit.svg or .png) of
            the same model, shown in a section of its own.
        model: compute patterns.npz with this model when DIR (a scan) has none; None: never load a model.
        device: where ``model`` loads; this and the other loading settings (``dtype``, ``backend``,
            ``device_map``, ``max_memory``, ``threads``, ``memory_budget``) given without ``model``
            would do nothing and are refused (:class:`~headprobe.settings.Needs`).
        prepend_bos: not view's to set (no flag): the patterns are computed with the scan's BOS
            setting (its summary.json); False is refused.
        pattern_len: tokens per example when computing patterns (>= 2).

    Raises:
        HeadprobeError: a bad shared setting, ``prepend_bos`` False or ``pattern_len`` below 2.
    """

    dir: str = setting(
        MISSING,
        "output directory of headprobe scan or ablate; index.html is written there",
        metavar="DIR",
        positional=True,
        kw_only=True,
    )  # required: keyword-only, as it follows the group's defaulted fields
    ablation: str | None = setting(
        None,
        "an ablate run's directory: add its per-head loss increases to the table and maps (default: none)",
        metavar="DIR2",
    )
    circuit: str | None = setting(
        None,
        "a headprobe circuit run's directory: add its figure, top edges and path patching as a section (default: none)",
        metavar="DIR3",
    )
    model: str | None = None  # type: ignore[assignment]  # optional here (the patterns need it), required by the other commands
    # how the model loads: without --model none loads, so each is refused there (settings.refuse_inert)
    device: str = shared(ModelSettings, "device", needs=Needs("model"))
    dtype: str = shared(ModelSettings, "dtype", needs=Needs("model"))
    backend: str = shared(ModelSettings, "backend", needs=Needs("model"))
    device_map: str | None = shared(ModelSettings, "device_map", needs=Needs("model"))
    max_memory: str | dict | None = shared(ModelSettings, "max_memory", needs=Needs("model"))
    threads: int | None = shared(ModelSettings, "threads", needs=Needs("model"))
    memory_budget: str | None = shared(ModelSettings, "memory_budget", needs=Needs("model"))
    pattern_len: int = setting(
        128,
        "with --model: tokens per example in the computed patterns.npz (default %(default)s)",
        type=positive_int,
        needs=Needs("model"),
    )

    def __post_init__(self):
        super().__post_init__()  # the shared settings' checks (headprobe.settings.check_settings)
        if not self.prepend_bos:
            raise HeadprobeError(
                "headprobe view computes patterns with the scan's own BOS setting (its summary.json); "
                "prepend_bos is not view's to change"
            )
        if self.pattern_len < 2:
            raise HeadprobeError(f"--pattern-len must be at least 2, got {self.pattern_len}")


def _read_dir(d: Path) -> dict:
    """The files of a scan or ablate directory that exist: ``scores``, ``ablation`` (DataFrames),
    ``summary`` (dict), ``patterns`` (path). Raises HeadprobeError for a missing/unusable directory."""
    import pandas as pd

    from headprobe.analyses.exchange import check_head_rows

    if not d.is_dir():
        raise HeadprobeError(f"{d} is not a directory (give the --out directory of headprobe scan or ablate)")
    out: dict = {"scores": None, "ablation": None, "summary": None, "patterns": None}
    for key, fname in (("scores", SCORES), ("ablation", ABLATION)):
        if (d / fname).is_file():
            try:
                out[key] = pd.read_csv(d / fname)
            except (OSError, ValueError) as e:
                raise HeadprobeError(f"cannot read {d / fname}: {e}") from None
            if not {"layer", "head"} <= set(out[key].columns):
                raise HeadprobeError(f"{d / fname} has no layer and head columns: not written by headprobe")
            numbers = [c for c in ("layer", "head", "kv_head") if c in out[key].columns]
            check_head_rows(d / fname, out[key], numbers)  # not cut, whole head numbers
    if out["scores"] is None and out["ablation"] is None:
        raise HeadprobeError(f"{d} holds neither {SCORES} (headprobe scan) nor {ABLATION} (headprobe ablate)")
    if (d / SUMMARY).is_file():
        try:
            out["summary"] = json.loads((d / SUMMARY).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise HeadprobeError(f"cannot read {d / SUMMARY}: {e}") from None
    if (d / PATTERNS).is_file():
        out["patterns"] = d / PATTERNS
    return out


MERGED_SETTINGS = ("seq_len", "period", "n_natural", "n_repeated", "seed", "text")
"""The token settings a scan and an ``--ablation`` run are compared on (their summary.json's ``config``)."""


def _merge_notes(scan: dict | None, ablation: dict | None, where: str | None) -> list[str]:
    """What the page's merged table mixes: the ``--ablation`` run's token settings where they differ
    from the scan's (its loss increases are on other tokens; ablate scores other natural-text
    windows than scan even at the same settings, docs/ablate.md).

    Raises:
        HeadprobeError: the two runs are of different models.
    """
    if not scan or not ablation:
        return []
    if scan.get("model") and ablation.get("model") and str(scan["model"]).lower() != str(ablation["model"]).lower():
        raise HeadprobeError(f"--ablation {where} is a run of {ablation['model']}, the scan one of {scan['model']}")
    a, b = scan.get("config") or {}, ablation.get("config") or {}
    differ = [f"{k} {b.get(k)} vs {a.get(k)}" for k in MERGED_SETTINGS if k in a and k in b and a[k] != b[k]]
    return (
        [
            f"the ablation run's settings differ from the scan's ({', '.join(differ)}): its loss increases are on other tokens"
        ]
        if differ
        else []
    )


def _read_circuit(d: Path) -> dict:
    """:func:`~headprobe.analyses.viewer.circuit_data` of circuit output directory ``d``.
    Raises HeadprobeError for a directory that no ``headprobe circuit`` run wrote."""
    from headprobe.analyses.viewer import circuit_data

    if not (d / SUMMARY).is_file():
        raise HeadprobeError(f"--circuit {d}: no {SUMMARY} there (give the --out directory of headprobe circuit)")
    try:
        summary = json.loads((d / SUMMARY).read_text(encoding="utf-8"))
        figure, path_figure = (
            next((d / f"{name}.{ext}" for ext in ("svg", "png") if (d / f"{name}.{ext}").is_file()), None)
            for name in ("circuit", "path_patching")
        )
        return circuit_data(summary, figure, path_figure)
    except (OSError, ValueError, AttributeError) as e:
        raise HeadprobeError(f"--circuit {d}: {e}") from None


def compute_patterns(cfg: ViewConfig, summary: dict | None, path: Path) -> list[str]:
    """Load ``cfg.model``, rebuild the scan's token sets from ``summary``'s config and write ``path``
    (patterns.npz); returns the NOTE on windows of the text left out as mostly one token, if any."""
    from headprobe.analyses.data import left_out_notes, natural_text_tokens, open_text_file, repeated_random_tokens
    from headprobe.analyses.viewer import head_patterns, save_patterns

    sc = (summary or {}).get("config")
    if not sc or "n_natural" not in sc:
        raise HeadprobeError(f"--model needs the scan's {SUMMARY} (its token settings); {path.parent} has none")
    assert summary is not None and cfg.model is not None  # sc came from the summary; called with --model only
    if summary.get("model") and cfg.model.lower() != str(summary["model"]).lower() and cfg.model != sc.get("model"):
        raise HeadprobeError(f"{path.parent} is a scan of {summary['model']}, not of {cfg.model}")
    model = options.load_for(dataclasses.replace(cfg, prepend_bos=sc.get("prepend_bos", True)))
    print(options.describe_model(model), flush=True)  # the header every command that loads a model prints
    text = open_text_file(sc["text"]) if sc.get("text") else None
    natural = natural_text_tokens(
        model, sc["n_natural"], sc["seq_len"], sc["seed"], text, source=str(sc["text"]) if sc.get("text") else None
    )
    repeated = repeated_random_tokens(model, sc["n_repeated"], sc["period"], sc["seed"])
    save_patterns(path, head_patterns(model, {"natural": natural, "repeated": repeated}, cfg.pattern_len))
    return left_out_notes(natural)


def run(cfg: ViewConfig) -> Path:
    """Write ``cfg.dir``/index.html (atomically) and return its path.

    Raises:
        HeadprobeError: DIR (or --ablation's) missing or without headprobe tables, tables of
            different head layouts, an unreadable patterns.npz, or as :func:`compute_patterns`.
    """
    d = Path(cfg.dir)
    for folder, flag in ((d, ""), (cfg.ablation, "--ablation "), (cfg.circuit, "--circuit ")):  # before pandas loads
        if folder is not None and not Path(folder).is_dir():
            raise HeadprobeError(
                f"{flag}{folder} is not a directory (give the --out directory of headprobe "
                f"{'circuit' if flag == '--circuit ' else 'scan or ablate'})"
            )
    from headprobe.analyses.viewer import build_page, load_patterns
    from headprobe.probe.core.io import record_output, write_text

    found = _read_dir(d)
    if cfg.ablation and not (Path(cfg.ablation) / ABLATION).is_file():
        raise HeadprobeError(
            f"--ablation {cfg.ablation} holds no {ABLATION} (give the --out directory of headprobe ablate)"
        )
    extra = _read_dir(Path(cfg.ablation)) if cfg.ablation else None
    notes = _merge_notes(found["summary"], extra["summary"] if extra else None, cfg.ablation)
    if cfg.model and found["patterns"] is not None:
        notes.append(
            f"{found['patterns']} is already there: --model and --pattern-len are not used (delete it to recompute)"
        )
    made = [PAGE]  # what this call writes into d
    if cfg.model and found["patterns"] is None and found["scores"] is not None:
        notes += compute_patterns(cfg, found["summary"], d / PATTERNS)
        found["patterns"] = d / PATTERNS
        made.append(PATTERNS)
    for note in notes:
        print(f"NOTE: {note}", flush=True)
    circuit = _read_circuit(Path(cfg.circuit)) if cfg.circuit else None
    patterns = None
    if found["patterns"] is not None:
        try:
            patterns = load_patterns(found["patterns"])
        except (OSError, ValueError, zipfile.BadZipFile) as e:
            raise HeadprobeError(f"cannot read {found['patterns']}: {e}") from None
    is_scan = found["scores"] is not None
    try:
        page = build_page(
            scores=found["scores"],
            summary=found["summary"] if is_scan else None,
            patterns=patterns,
            ablation=extra["ablation"] if extra else found["ablation"],
            ablation_summary=extra["summary"] if extra else (None if is_scan else found["summary"]),
            circuit=circuit,
        )
    except ValueError as e:
        raise HeadprobeError(str(e)) from None
    write_text(d / PAGE, page)
    for name in made:
        record_output(d, name)  # the run's own files now: the next --overwrite into d replaces them
    return d / PAGE


@options.notes_flags("view")
def view(
    dir: str | Path,
    *,
    ablation: str | Path | None = None,
    model: str | None = None,
    circuit: str | Path | None = None,
    **load,
) -> Path:
    """Write ``dir``/index.html: ``headprobe view`` as a function.

    Args:
        dir: a ``headprobe scan`` or ``headprobe ablate`` output directory.
        ablation: an ablate run's directory, merged into the table and maps.
        circuit: a ``headprobe circuit`` run's directory, shown in a section of its own.
        model: compute patterns.npz with this model where ``dir`` (a scan) has none.
        **load: ``pattern_len`` and how ``model`` is loaded: ``device``, ``dtype``, ``backend``,
            ``device_map``, ``max_memory`` (see :class:`ViewConfig`).

    Returns:
        Path: the page written, ``dir``/index.html (self-contained, offline).

    Raises:
        HeadprobeError: as :func:`run`; a loading setting or ``pattern_len`` given without ``model``;
            a message naming flags has a note giving their Python spelling (``e.__notes__``).
        TypeError: an unknown keyword (naming the setting meant, :func:`headprobe.options.check_fields`).
    """
    options.check_fields(ViewConfig, load, "view", positional=("dir", "ablation", "model", "circuit"), accepts=view)
    config = ViewConfig(
        dir=str(dir),
        ablation=None if ablation is None else str(ablation),
        model=model,
        circuit=None if circuit is None else str(circuit),
        **load,
    )
    refuse_inert(config, given_in_python(ViewConfig, {"model": model, **load}))  # device= without model=: as the flags
    if model is None:  # no model loads (nor torch)
        return run(config)
    with options.own_run():  # threads= is this run's, not the process's from now on
        return run(config)


FLAGS = (
    Flags(only=("dir", "ablation", "circuit")),
    Flags(
        group=ModelSettings,
        skip=("prepend_bos",),
        helps={
            "model": "compute patterns.npz with this model (e.g. smollm2-135m) when DIR, a scan, has none; default: load no model"
        },
    ),
    Flags(only=("pattern_len",)),
)
"""``--help``'s blocks: the directories, the model's flags (no ``--no-bos``), the patterns' length."""


def main(args: argparse.Namespace, config: ViewConfig) -> int:
    """``headprobe view``: config -> run -> print the page's path."""
    path = run(config)
    size = path.stat().st_size
    print(f"wrote {path} ({size / 1e6:.1f} MB); open it in a browser (works offline, from file://)")
    return 0


COMMAND = Command(HELP, config=ViewConfig, run="headprobe.commands.view:main", flags=FLAGS, api=view, epilog=EPILOG)
"""``headprobe view``, registered in :data:`headprobe.commands.COMMANDS`."""
