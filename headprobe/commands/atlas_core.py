"""The scans and the atlas of ``headprobe atlas`` (torch): :func:`run`, :class:`AtlasResult` and the
Python function :func:`atlas`. The command, its settings (:class:`~headprobe.commands.atlas.AtlasConfig`)
and its flags are :mod:`headprobe.commands.atlas`, which imports none of this."""

from __future__ import annotations

import gc
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from headprobe import options
from headprobe.analyses import atlas as atlas_lib
from headprobe.analyses.data import WINDOW_KEYS, left_out_notes_of
from headprobe.analyses.outputs import write_outputs
from headprobe.analyses.vocabulary import figure_formats
from headprobe.commands.atlas import (  # noqa: F401 - the light module's names, re-exported
    CACHED_CANDIDATES,
    DEFAULT_MODELS,
    FAMILIES,
    HELP,
    MODELS_DIR,
    SCAN_KEY,
    TABLE,
    TOY,
    TOY_DIR,
    TOY_TRAIN,
    AtlasConfig,
    _read_json,
    default_models,
    family_of,
    holds_only_toy,
    slug,
    snapshot_dirs,
)
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.core.io import (
    RunCheckpoint,
    models_self_check,
    prepare_output_dir,
    run_inputs,
    summary_envelope,
    write_json,
)
from headprobe.probe.core.reprs import CompactRepr

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def over_training_title(table: pd.DataFrame) -> str:
    """over_training.png's title: which model family's checkpoints, how many (it read "head types over
    training (real scans)", naming neither)."""
    steps = table.dropna(subset=["step"])
    families = ", ".join(dict.fromkeys(steps["family"].dropna().astype(str))) if "family" in steps else ""
    n = steps["model"].nunique()
    return f"Head types over training{', ' + families if families else ''} ({n} checkpoint{'s' if n != 1 else ''})"


@dataclass(repr=False)
class AtlasResult(CompactRepr):
    """A finished atlas.

    Attributes:
        config: the settings.
        table: atlas.csv (see :func:`headprobe.analyses.atlas.atlas_rows`).
        models: label -> ``{"model", "family", "step", "dir", "status", "timings_s"}`` (``status``:
            ``scanned``, ``resumed`` or ``failed``; failed ones also have ``error``, one line;
            ``timings_s``: ``scan_s``, the model's scan); a scan's also ``windows_available`` and
            ``windows_left_out``, its natural-text windows (:func:`~headprobe.analyses.data.window_counts`),
            and, where the scan drew the retrieval score's haystack, ``retrieval_needles``: its two counts.
        out: the output directory.
        seconds: the whole run's.
        rules: the :class:`~headprobe.analyses.verdicts.VerdictRule` of each scan with verdicts.
        self_checks: label -> the self-check its scan's summary.json records (None where it has
            none), of each model not failed; summary.json's ``self_check`` aggregates them
            (:func:`~headprobe.probe.core.io.models_self_check`).
    """

    config: AtlasConfig
    table: pd.DataFrame
    models: dict[str, dict]
    out: Path
    seconds: float = 0.0
    files: list[Path] = field(default_factory=list)
    rules: list = field(default_factory=list)
    self_checks: dict[str, dict | None] = field(default_factory=dict)

    def figures(self) -> dict[str, Figure]:
        """``atlas`` (every type), ``atlas_<type>`` (one per type) and, with checkpoints, ``over_training``."""
        if self.table.empty:
            return {}
        n = self.table["model"].nunique()
        what = "checkpoint" if self.table["step"].notna().all() else "model"
        figs = {"atlas": atlas_lib.atlas_overview(self.table, f"Head atlas: {n} {what}{'s' if n > 1 else ''}")}
        figs.update({f"atlas_{t}": atlas_lib.depth_plot(self.table, t) for t in atlas_lib.table_types(self.table)})
        if self.table["step"].notna().any():
            figs["over_training"] = atlas_lib.over_training_plot(self.table, over_training_title(self.table))
        return figs

    def summary(self) -> dict:
        """summary.json: settings, every model's status (and error), where each type was confirmed."""
        confirmed = {}
        for t in atlas_lib.table_types(self.table):
            v = (
                self.table[self.table[f"{t}_top"].fillna(False).astype(bool)]
                .groupby("model", sort=False)[f"{t}_verdict"]
                .first()
            )
            confirmed[t] = {m: v.get(m, "") for m in atlas_lib.model_labels(self.table)}
        return summary_envelope(
            {
                "models": self.models,
                "verdicts": confirmed,
                "verdict_rule": atlas_lib.verdict_rule_text(self.rules),
                "relative_depth": "layer / (n_layers - 1)",
            },
            model=None,
            precision=None,
            device=self.config.device,
            self_check=models_self_check(
                self.self_checks, "per scanned model: patterns and the per-head W_O decomposition at its load"
            ),
            config=self.config,
            timings_s={"run_s": self.seconds},
        )

    @options.reports_for_readers("atlas")
    def report(self) -> str:
        lines = []
        for label, m in self.models.items():
            lines.append(
                f"{label:<28} {m['status']:<8} "
                + (m.get("error", "") if m["status"] == "failed" else f"{m['timings_s']['scan_s']:.0f} s")
            )
        s = self.summary()["verdicts"]
        if s:
            lines.append("")
            models = atlas_lib.model_labels(self.table)
            lines.append(
                f"verdicts (each scan's tested verdict: {atlas_lib.VERDICT_KIND} ablation of each type's top-k heads "
                f"against {self.config.control} controls): " + ", ".join(models)
            )
            for t, per in s.items():
                lines.append(f"  {t:<16} " + " | ".join(per.get(m, "") or "-" for m in models))
        remarks = [
            f"{label} {n}" for label, m in self.models.items() for r in m.get("verdict_remarks", {}).values() for n in r
        ]
        notes = [*remarks, *grouped_left_out_notes(self.models)]
        return "\n".join([*lines, *(f"NOTE: {n}" for n in notes)])


def grouped_left_out_notes(models: dict[str, dict], show: int = 3) -> list[str]:
    """The left-out NOTEs of the atlas's models (:func:`~headprobe.analyses.data.left_out_notes_of`
    of :func:`_window_sets`), one per distinct count: an atlas over 26 checkpoints of one model on one
    text printed the same NOTE 26 times, once per label. Token sets with the same ``(left out,
    available)`` counts (and kind: natural text or retrieval haystack) share one line, ``for N
    checkpoints (a, b, ..., z)`` (``models`` where any record has no ``step``) naming the first
    ``show`` and the last; a count met once keeps its label as before."""
    noun = "checkpoints" if models and all(r.get("step") is not None for r in models.values()) else "models"
    groups: dict[tuple, dict[str, dict]] = {}
    for name, counts in _window_sets(models).items():
        hay = name.endswith(" retrieval haystack")
        key = (counts.get("windows_left_out"), counts.get("windows_available"), hay)
        groups.setdefault(key, {})[name] = counts
    notes = []
    for (skipped, available, hay), sets in groups.items():
        if len(sets) == 1:
            notes += left_out_notes_of(sets)
            continue
        labels = [n.removesuffix(" retrieval haystack") for n in sets]
        shown = ", ".join(labels if len(labels) <= show + 1 else [*labels[:show], "...", labels[-1]])
        what = f"for {len(labels)} {noun}{' (retrieval haystack)' if hay else ''} ({shown})"
        notes += left_out_notes_of({what: {"windows_left_out": skipped, "windows_available": available}})
    return notes


def _window_record(tokens: dict) -> dict:
    """A model's record of its scan's windows, from summary.json's ``tokens``: the natural text's
    counts and, where the scan drew the retrieval score's haystack, ``retrieval_needles``: its counts."""
    natural, needles = tokens.get("natural_text", {}), tokens.get("retrieval_needles", {})
    rec: dict[str, Any] = {k: natural[k] for k in WINDOW_KEYS if k in natural}
    if any(k in needles for k in WINDOW_KEYS):
        rec["retrieval_needles"] = {k: needles[k] for k in WINDOW_KEYS if k in needles}
    return rec


def _window_sets(models: dict[str, dict]) -> dict[str, dict]:
    """Each model's token sets by the name its left-out NOTE gives: ``label`` (the natural text) and
    ``label retrieval haystack`` (the retrieval score's windows), model by model."""
    sets = {}
    for label, rec in models.items():
        sets[label] = rec
        if "retrieval_needles" in rec:
            sets[f"{label} retrieval haystack"] = rec["retrieval_needles"]
    return sets


def toy_train_config(config: AtlasConfig):
    """The :class:`~headprobe.analyses.train.TrainConfig` of the ``toy`` model (:data:`TOY_TRAIN`
    with the atlas's ``toy_steps`` and ``seed``, on CPU unless ``device`` asks for CUDA)."""
    from headprobe.analyses.train import N_CHARS, TrainConfig

    return TrainConfig(
        **{**TOY_TRAIN, "steps": config.toy_steps, "seed": config.seed, "device": config.device}, n_words=N_CHARS
    )


def _train_toy(config: AtlasConfig, out: Path, progress: bool) -> Path:
    """Train the ``toy`` model into ``out`` (skipped when a finished one is there); returns ``out``."""
    import tempfile

    from headprobe.analyses.train import train, training_tokenizer

    cfg = toy_train_config(config)
    if _toy_done(out, config):
        return out
    if progress:
        print(f"training the toy model ({cfg.steps} steps, text+copy) ...", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        run = train(cfg, training_tokenizer(cfg, tmp))
    out.mkdir(parents=True, exist_ok=True)
    run.loaded.tokenizer.save_pretrained(out)
    run.loaded.save(out, {"train": asdict(cfg)})  # config.json last: the directory is complete
    return out


def _toy_done(toy: Path, config: AtlasConfig) -> bool:
    """``toy`` holds a complete toy model trained with ``config``'s toy settings (its config.json,
    written last, records them)."""
    done = toy / "config.json"
    return done.is_file() and (_read_json(done) or {}).get("train") == asdict(toy_train_config(config))


def _kept_toy(out: Path, config: AtlasConfig, models: list) -> bool:
    """``out`` holds nothing but the toy model an atlas whose models all failed kept there, trained
    as ``config`` would train it and among its ``models``: the run reuses it without ``--overwrite``."""
    return holds_only_toy(out) and TOY in [name for _, name, _ in models] and _toy_done(out / TOY_DIR, config)


def files_stamp(name: str) -> str | None:
    """A local model's stamp: SHA-256 of the sorted ``(relative path, size, mtime_ns)`` of the files
    under ``name`` (a directory or one file); None for a name that is not a local path (the embedded
    model, a hub name: fixed weights). Cheap (no byte is read): a rewritten, added or removed file
    changes it, a copy without kept times too (a rescan, never a stale scan)."""
    import hashlib

    root = Path(name)
    if not root.exists():
        return None
    files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
    h = hashlib.sha256()
    for p in files:
        st = p.stat()
        h.update(f"{p.relative_to(root) if root.is_dir() else p.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def _scan_model(
    config: AtlasConfig, out: Path, model: tuple, counter: str, rec: dict, progress: bool, formats: tuple[str, ...]
) -> None:
    """Scan one model (``model`` is its ``(label, name, directory, checkpoint key)``; the toy is
    trained first) into its directory, its figures in ``formats``, and record the outcome in ``rec``:
    ``status`` ``scanned``, or ``failed`` with the ``error`` (a model that fails is recorded, not
    raised); ``counter`` prefixes the progress line (``[i/n]``)."""
    from headprobe.commands.scan_core import run as run_scan

    label, name, d, key = model
    t0 = time.perf_counter()
    try:
        path = str(_train_toy(config, out / TOY_DIR, progress)) if name == TOY else name
        if progress:
            print(f"{counter} scanning {label} ...", flush=True)
        loaded_at = time.perf_counter()
        loaded = options.load_for(config.scan_config(path))
        load_s = time.perf_counter() - loaded_at
        scanned = run_scan(loaded, config.scan_config(path), progress=progress)
        scanned.load_s = load_s  # the model's summary.json records the load atlas made
        shown = formats if config.model_figures else ()  # --no-model-figures: no scan figure in any format
        scanned.save(d, overwrite=True, html=bool(config.pattern_len), formats=shown)
        del loaded, scanned
        rec.update(status="scanned", timings_s={"scan_s": round(time.perf_counter() - t0, 2)})
        # last: this model's scan is complete and reusable
        write_json(d / SCAN_KEY, {"key": key, "timings_s": rec["timings_s"]})
    except HeadprobeError as e:
        rec.update(
            status="failed",
            timings_s={"scan_s": round(time.perf_counter() - t0, 2)},
            error=str(e).splitlines()[0],
        )
    except Exception as e:
        rec.update(
            status="failed",
            timings_s={"scan_s": round(time.perf_counter() - t0, 2)},
            error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
        )
    finally:
        gc.collect()
    if rec["status"] == "failed" and progress:
        print(f"  {label} failed: {rec['error']}", flush=True)


def _model_record(
    config: AtlasConfig, out: Path, model: tuple, counter: str, progress: bool, formats: tuple[str, ...]
) -> dict[str, Any]:
    """The record of one model of the atlas (``model``: its ``(label, name, step)``): ``status``
    ``resumed`` where its directory holds a finished scan of the same key (the model, its scan
    settings, a toy's training settings, a local model's files' stamp), else scanned now
    (:func:`_scan_model`: ``scanned`` or ``failed``); ``counter`` prefixes the progress line."""
    label, name, step = model
    d = out / MODELS_DIR / slug(label)
    rec: dict[str, Any] = {"model": name, "family": family_of(name), "step": step, "dir": str(d.relative_to(out))}
    key = {"model": name, "scan": json.loads(json.dumps(asdict(config.scan_config(name)), default=str))}
    if name == TOY:  # the toy is retrained (and rescanned) when its training settings change
        key["train"] = asdict(toy_train_config(config))
    elif (stamp := files_stamp(name)) is not None:  # a local model rewritten since: rescanned
        key["files"] = stamp
    saved = _read_json(d / SCAN_KEY) or {}
    if saved.get("key") == key and (d / "summary.json").is_file():
        rec.update(
            status="resumed",
            timings_s={"scan_s": saved.get("timings_s", {}).get("scan_s", saved.get("seconds", 0.0))},
        )
    else:
        _scan_model(config, out, (label, name, d, key), counter, rec, progress, formats)
    return rec


def run(
    config: AtlasConfig,
    out: str | Path,
    overwrite: bool = False,
    progress: bool = True,
    formats: str | Sequence[str] | None = None,
) -> AtlasResult:
    """Scan every model of ``config`` into ``out`` and write the atlas (see the module docstring),
    its figures and the models' in ``formats`` (as :func:`atlas`).

    Raises:
        HeadprobeError: bad settings, ``out`` not writable / holding another run's files without
            ``overwrite``, or every model failed (one line naming each error; nothing new is left
            in ``out``). A model that fails among others that do not is recorded, not raised.
        InputValueError: ``formats`` not of png, pdf, svg or none, before anything is written.
    """
    formats = figure_formats(formats)
    t_start = time.perf_counter()
    models = config.model_list()
    before = set(Path(out).rglob("*")) if Path(out).is_dir() else None  # what a run where all fail leaves
    reuse = _kept_toy(Path(out), config, models)
    out = prepare_output_dir(out, overwrite or reuse, resumable=True, models=(TOY_DIR,))
    if reuse and progress:
        print(f"reusing the toy model kept in {out / TOY_DIR}/ by an earlier atlas here whose models all failed")
    # where the models run is not part of the key: a run resumed on another device (or split) reads the same checkpoint
    ckpt = RunCheckpoint(
        out, {k: v for k, v in asdict(config).items() if k not in ("device", "device_map", "max_memory")}
    )
    ckpt.load(overwrite=overwrite)
    ckpt.save({})  # from now on the directory is resumable without --overwrite
    records, parts, rules, checks = _scan_models(config, out, models, progress, formats)
    if records and all(r["status"] == "failed" for r in records.values()):
        _all_failed(out, before, records)
    table = atlas_lib.atlas_table(parts) if parts else pd.DataFrame(columns=list(atlas_lib.ID_COLUMNS))
    result = AtlasResult(
        config,
        table,
        records,
        out,
        seconds=time.perf_counter() - t_start,
        rules=[r for r in rules if r is not None],
        self_checks=checks,
    )
    # --out was checked when the run began; it now holds the models' directories
    produced = [
        p for p in [*(out / r["dir"] for r in records.values()), out / TOY_DIR] if p.exists()
    ]  # recorded as this atlas's
    files = write_outputs(
        out,
        True,
        summary=result.summary,
        tables={TABLE: table.to_csv(index=False, float_format="%.5f")},
        figures=result.figures,
        produced=produced,
        models=(TOY_DIR,),  # the toy model this atlas trained there
        formats=formats,
    )
    ckpt.clear()
    result.files = files
    return result


def _scan_models(
    config: AtlasConfig, out: Path, models: list, progress: bool, formats: tuple[str, ...]
) -> tuple[dict[str, dict], list, list, dict[str, dict | None]]:
    """Each model's record (:func:`_model_record`), and of those scanned their atlas rows, verdict
    rules and self-checks: ``(records, parts, rules, checks)``. A plan NOTE every scan says is
    printed once, then once more at the end with the count of scans that said it
    (:func:`~headprobe.commands.scan_core.notes_once`)."""
    import sys

    from headprobe.commands.scan_core import notes_once, repeated_notes

    records: dict[str, dict] = {}
    parts, rules = [], []
    checks: dict[str, dict | None] = {}
    with notes_once() as said:  # a scan's plan NOTE shared by every model: once, counted below
        for label, name, step in models:
            counter = f"[{len(records) + 1}/{len(models)}]"
            rec = records[label] = _model_record(config, out, (label, name, step), counter, progress, formats)
            d = out / rec["dir"]
            if rec["status"] != "failed":
                summary = json.loads((d / "summary.json").read_text(encoding="utf-8"))
                rec.update(_window_record(summary.get("tokens", {})))
                scores = pd.read_csv(d / "head_scores.csv")
                parts.append(atlas_lib.atlas_rows(scores, summary, label, rec["family"], step))
                if remarks := atlas_lib.model_remarks(scores, summary):  # only where there is one
                    rec["verdict_remarks"] = remarks
                rules.append(atlas_lib.scan_rule(summary))
                checks[label] = summary.get("self_check")
    noun = "checkpoints" if all(step is not None for _, _, step in models) else "models"
    for line in repeated_notes(said, noun) if progress else ():
        print(line, file=sys.stderr, flush=True)
    return records, parts, rules, checks


def _all_failed(out: Path, before: set[Path] | None, records: dict[str, dict]) -> None:
    """Every model failed: remove what this run put in ``out`` but a ``toy`` model it trained
    (complete: its config.json is written last; minutes of training the next atlas there reuses),
    and raise.

    Raises:
        HeadprobeError: always; one line naming each model's error and what was kept.
    """
    toy = out / TOY_DIR
    keep = toy if (toy / "config.json").is_file() else None
    _remove_new(out, before, keep)
    kept = (
        f" (the toy model trained is kept in {toy}/: an atlas with --out {out} and the same toy settings reuses it)"
        if keep
        else ""
    )
    raise HeadprobeError(
        f"every model failed, so no atlas was written{kept}: "
        + "; ".join(f"{label}: {r['error']}" for label, r in records.items())
    )


def _remove_new(out: Path, before: set[Path] | None, keep: Path | None = None) -> None:
    """Remove what this run put in ``out`` but ``keep`` (a folder in it, with what it holds): the
    folder itself where it did not exist (``before`` None) and nothing is kept, else every path
    not in ``before``, deepest first."""
    import shutil

    if before is None and keep is None:
        shutil.rmtree(out, ignore_errors=True)
        return
    for p in sorted(set(out.rglob("*")) - (before or set()), key=lambda p: len(p.parts), reverse=True):
        if keep is not None and (p == keep or keep in p.parents):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


@options.notes_flags("atlas")
def atlas(
    *,
    out: str | Path,
    overwrite: bool = False,
    progress: bool = False,
    formats: str | Sequence[str] | None = None,
    **config_fields,
) -> AtlasResult:
    """``headprobe atlas`` as a function: :func:`run` on ``AtlasConfig(**config_fields)``.

    Args:
        formats: the figures' formats (the atlas's and each model's scan), as ``--formats``: ``"png"``,
            ``"png,svg"`` or ``("png", "pdf")``; ``"none"`` or ``()``: no figures; None:
            ``$HEADPROBE_FIGURE_FORMATS``, or all three.

    Returns:
        AtlasResult: already written into ``out`` (``files``, summary.json last): ``table`` (atlas.csv,
            one row per model and head), ``models`` (label -> status, scan seconds), ``seconds`` (the run's).

    Raises:
        HeadprobeError: as :func:`run`; ``toy_steps`` where no toy model is trained; a message naming flags has a note giving their Python spelling (``e.__notes__``).
        InputValueError: ``formats`` not of png, pdf, svg or none (one line naming the closest).
        TypeError: an unknown field (naming the setting meant, :func:`headprobe.options.check_fields`).
    """
    from headprobe.settings import given_in_python, refuse_inert

    options.check_fields(AtlasConfig, config_fields, "atlas", accepts=atlas)
    config = AtlasConfig(**config_fields)
    refuse_inert(config, given_in_python(AtlasConfig, config_fields))  # toy_steps= without toy: as the flag
    with options.own_run(), run_inputs(options.config_inputs(config)):  # as the command line's run
        return run(config, out, overwrite=overwrite, progress=progress, formats=formats)
