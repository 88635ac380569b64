"""A cache of dequantized GGUF checkpoints, kept as ordinary Hugging Face model directories.

transformers reads a GGUF file slowly (for SmolLM2-135M's 98 MB Q4_1 file, ~25 s of a ~30 s load
go to the ``gguf`` reader's metadata parsing and the tensor-name mapping, see
``transformers.modeling_gguf_pytorch_utils``), while the same weights saved as safetensors load in
about a second. So the first load of a GGUF file dequantizes it and writes the result here; later
loads read the directory with ``from_pretrained(dir)``.

Where: ``$HEADPROBE_CACHE`` if set, else ``$XDG_CACHE_HOME/headprobe``, else ``~/.cache/headprobe``;
entries live in ``<root>/gguf/<file stem>-<key>/`` (``config.json``, ``model.safetensors``,
tokenizer files, what the caller adds, e.g. the native model's description, ``manifest.json``). ``HEADPROBE_CACHE=off`` turns the cache off. Clearing it is
always safe: ``rm -rf ~/.cache/headprobe`` (or the ``$HEADPROBE_CACHE`` directory); the next load
rebuilds what it needs.

Key: the SHA-256 of the whole GGUF file (0.23 s for the 98 MB SmolLM2 file on this project's
machine) and the versions of headprobe, torch, transformers, gguf and safetensors plus this
module's :data:`FORMAT`, so an upgrade of any of them makes a new entry instead of reusing
weights another version dequantized. Old entries are not removed automatically.

Safety: an entry is written into a temporary directory beside its final place and renamed onto
it (``os.replace``) with its manifest already inside, so a reader sees a whole entry or none.
Writers take a ``filelock.FileLock`` per entry (``filelock`` is a dependency of
``huggingface_hub``), so two processes loading the same cold file build it once: the second
waits, then reads the first one's entry. An entry whose manifest is missing or does not match its
files (sizes, and SHA-256 digests, see :func:`file_digest`), or that fails to load, is reported
with one warning, never used, and rebuilt. Problems with the cache itself (a read-only
directory, a full disk) never fail a load: it proceeds without the cache, with one warning.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

ENV_VAR = "HEADPROBE_CACHE"
"""Environment variable: the cache root directory, or ``off`` to disable the cache."""

FORMAT = "headprobe-weights-cache-2"  # 2: entries carry the native model description (hf_checkpoint.NATIVE_SOURCE_FILE)
"""Version of the entry layout; part of every key."""

MANIFEST = "manifest.json"
LOCK_TIMEOUT_S = 600.0
"""How long a process waits for another one that is writing the same entry (seconds) before it
loads without the cache."""

KEY_DISTRIBUTIONS = ("headprobe", "torch", "transformers", "gguf", "safetensors")

_DIGEST_WHOLE_MAX = 4 << 20  # bytes; larger files are digested by their first and last MiB
_DIGEST_PART = 1 << 20


def cache_root() -> Path | None:
    """The cache root directory, or None when ``HEADPROBE_CACHE=off`` (or ``0``) turns it off.

    ``$HEADPROBE_CACHE`` if set (``~`` expanded), else ``$XDG_CACHE_HOME/headprobe``, else
    ``~/.cache/headprobe`` (the XDG base directory specification's default). Nothing is created.
    """
    value = os.environ.get(ENV_VAR, "").strip()
    if value.lower() in ("off", "0"):
        return None
    if value:
        return Path(value).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "headprobe"


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Hex SHA-256 of the whole file at ``path``.

    Raises:
        OSError: the file cannot be read.
    """
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def file_digest(path: str | os.PathLike[str]) -> str:
    """A cheap content digest for checking cache files: the hex SHA-256 of the whole file when it
    is at most 4 MiB, else of its first and last MiB (so checking a 540 MB ``model.safetensors``
    costs milliseconds, not the ~1.3 s a full hash takes; a truncated or partly rewritten end is
    caught, a flipped bit in the middle is not).

    Raises:
        OSError: the file cannot be read.
    """
    size = os.path.getsize(path)
    if size <= _DIGEST_WHOLE_MAX:
        return sha256_file(path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(_DIGEST_PART))
        f.seek(size - _DIGEST_PART)
        h.update(f.read(_DIGEST_PART))
    return h.hexdigest()


def versions() -> dict[str, str]:
    """Installed versions of :data:`KEY_DISTRIBUTIONS` (``none`` for one that is missing)."""
    out = {}
    for dist in KEY_DISTRIBUTIONS:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "none"
    return out


class Entry:
    """The cache entry of one GGUF file under ``root``.

    Attributes:
        source: the GGUF file. key: what the entry depends on (format, the file's SHA-256 and size,
            :func:`versions`). path: the entry directory, ``<root>/gguf/<stem>-<20 hex digits>``.

    Raises:
        OSError: the GGUF file cannot be read (from the constructor, which hashes it).
    """

    def __init__(self, root: str | os.PathLike[str], source: str | os.PathLike[str]):
        self.source = Path(source)
        self.key = {
            "format": FORMAT,
            "sha256": sha256_file(self.source),
            "size": self.source.stat().st_size,
            **versions(),
        }
        digest = hashlib.sha256(json.dumps(self.key, sort_keys=True).encode()).hexdigest()[:20]
        stem = re.sub(r"[^A-Za-z0-9._-]+", "_", self.source.stem)[:80] or "model"
        self.path = Path(root) / "gguf" / f"{stem}-{digest}"

    def problem(self) -> str | None:
        """Why the entry cannot be used (``None``: it is complete and matches its manifest), or
        ``"absent"`` when there is no entry."""
        manifest = self.path / MANIFEST
        if not manifest.is_file():
            return "absent" if not self.path.exists() else "it has no manifest"
        try:
            meta = json.loads(manifest.read_text(encoding="utf-8"))
            if meta.get("key") != self.key:
                return "its manifest belongs to another file or other library versions"
            files = meta["files"]
            for name, want in files.items():
                f = self.path / name
                if not f.is_file():
                    return f"{name} is missing"
                if f.stat().st_size != want["size"]:
                    return f"{name} has {f.stat().st_size} bytes, the manifest says {want['size']}"
                if file_digest(f) != want["digest"]:
                    return f"{name} does not match its digest"
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            return f"its manifest is unreadable ({type(e).__name__})"
        return None

    def lock(self, on_wait: Callable[[], None] | None = None):
        """Acquire and return the entry's write lock (a ``filelock.FileLock`` on
        ``<root>/gguf/<entry name>.lock``); the caller releases it (``lock.release()``).

        ``on_wait`` is called once if another process holds it. The lock file stays behind (as
        ``filelock`` intends); it is empty.

        Raises:
            OSError: the lock file cannot be created.
            filelock.Timeout (a TimeoutError): still held by another process after :data:`LOCK_TIMEOUT_S`.
        """
        from filelock import FileLock, Timeout

        self.path.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(self.path) + ".lock")
        try:
            lock.acquire(timeout=0)
        except Timeout:
            if on_wait is not None:
                on_wait()
            lock.acquire(timeout=LOCK_TIMEOUT_S)
        return lock

    def write(self, hf_model: Any, tokenizer: Any, extra: dict[str, Any] | None = None) -> None:
        """Save ``hf_model`` (its config without ``quantization_config``, its weights as
        ``model.safetensors``), ``tokenizer`` and ``extra`` (file name -> JSON-able data, e.g. the
        native model's description) as the entry, atomically. Call it holding :meth:`lock`; a
        damaged entry already there is replaced.

        Raises:
            OSError, safetensors.SafetensorError: the directory cannot be written (nothing is
                left behind).
        """
        import copy

        from safetensors.torch import save_model

        parent = self.path.parent
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=parent))
        try:
            config = copy.deepcopy(hf_model.config)
            if hasattr(config, "quantization_config"):  # a GGUF load marks the model quantized; the copy is plain float
                del config.quantization_config
            config.save_pretrained(tmp)
            save_model(
                hf_model, str(tmp / "model.safetensors"), metadata={"format": "pt"}
            )  # de-duplicates tied weights
            tokenizer.save_pretrained(tmp)
            for file_name, data in (extra or {}).items():
                (tmp / file_name).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
            files = {
                p.name: {"size": p.stat().st_size, "digest": file_digest(p)}
                for p in sorted(tmp.iterdir())
                if p.is_file()
            }
            manifest = {
                "key": self.key,
                "source": str(self.source),
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "files": files,
            }
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
            mask = os.umask(0)
            os.umask(mask)
            tmp.chmod(0o777 & ~mask)  # mkdtemp makes 0700: give the entry the modes a plain mkdir/open would
            for p in tmp.iterdir():
                p.chmod(0o666 & ~mask)
            if self.path.exists():  # damaged (the caller checked under the lock): move it aside, then drop it
                trash = Path(tempfile.mkdtemp(prefix=f".{self.path.name}.", suffix=".trash", dir=parent))
                os.replace(self.path, trash / "old")
                shutil.rmtree(trash, ignore_errors=True)
            os.replace(tmp, self.path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def remove(self) -> None:
        """Delete the entry directory (if any)."""
        shutil.rmtree(self.path, ignore_errors=True)


def ready_entry(source: str | os.PathLike[str]) -> Path | None:
    """The directory of the complete entry of GGUF file ``source``, matching its manifest, or
    None (cache off, no entry, a damaged one, an unreadable file): a reader that takes only a
    ready entry and leaves every other case to :func:`load_cached`."""
    root = cache_root()
    if root is None:
        return None
    try:
        entry = Entry(root, source)
        return entry.path if entry.problem() is None else None
    except OSError:
        return None


def load_cached(
    source: str | os.PathLike[str],
    build: Callable[[], tuple[Any, Any]],
    load_dir: Callable[[Path], tuple[Any, Any]],
    say: Callable[[str], None],
    name: str,
    what: str,
    eta: str = "",
    extra: Callable[[Any], dict[str, Any]] | None = None,
) -> tuple[Any, Any]:
    """(hf_model, tokenizer) of the GGUF file ``source``, through the cache.

    Args:
        build: loads ``source`` itself (the slow, uncached load).
        load_dir: loads a Hugging Face model directory (an entry).
        extra: ``extra(hf_model)``: more files for a new entry (see :meth:`Entry.write`).
        say: prints one progress line: ``loading <name>: dequantizing <what> (first time<, eta>;
            cached for next time) ...`` before ``build``, ``loading <name> from cache ...``
            before ``load_dir``.
        name, what, eta: the model's name, what is dequantized (``4-bit GGUF``), the expected
            time of a cold load or ``""``: then the time the last cold load of this file took on
            this machine (:data:`LOAD_TIMES`, ``last took 168 s``), or nothing where none was measured.

    A cold load returns ``build()``'s own objects after writing the entry, so the first load and
    every later one hold the same tensors and tokenizer (checked in tests/test_weights_cache.py).
    Errors of ``build`` propagate; cache problems are logged as warnings (logger
    ``headprobe.probe.backends.weights_cache``) and the load goes on without the cache.
    """
    root = cache_root()
    eta = eta or _recorded_eta(root, source)
    eta_part = f", {eta}" if eta else ""

    def cold(note: str, record: bool = True) -> tuple[Any, Any]:
        say(f"loading {name}: dequantizing {what} ({note}) ...")
        t0 = time.perf_counter()
        got = build()
        if record:  # not where the cache was said unusable: a second warning about the same folder
            _record_seconds(root, source, time.perf_counter() - t0)
        return got

    if root is None:
        return cold(f"{eta + '; ' if eta else ''}cache off: {ENV_VAR}=off")
    try:
        entry = Entry(root, source)
    except OSError as e:
        log.warning(
            "headprobe: cannot hash %s for the weights cache (%s); loading without the cache", source, e.strerror
        )
        return cold(f"{eta + '; ' if eta else ''}not cached")

    from_entry = _EntryReader(entry, load_dir, lambda: say(f"loading {name} from cache ..."))
    try:
        got = from_entry()
    except OSError:  # the entry vanished between the checks (another process replaced a damaged one)
        got = None
    if got is not None:
        return got
    try:
        lock = entry.lock(
            on_wait=lambda: say(f"loading {name}: waiting for another process that is dequantizing it ...")
        )
    except (OSError, TimeoutError) as e:  # filelock.Timeout is a TimeoutError
        log.warning(
            "headprobe: cannot use the weights cache at %s (%s); loading without it",
            root,
            getattr(e, "strerror", None) or e,
        )
        return cold(f"{eta + '; ' if eta else ''}not cached", record=False)
    try:
        if entry.problem() is None:  # written by another process while we waited for the lock
            got = from_entry()
            if got is not None:
                return got
        model, tokenizer = cold(f"first time{eta_part}; cached for next time")
        _write_entry(entry, model, tokenizer, extra)
        return model, tokenizer
    finally:
        lock.release()


LOAD_TIMES = "load-times.json"
"""In the cache root: GGUF file name -> seconds its last cold load (dequantization) took here, the
estimate a later cold load prints (a new entry after an upgrade, ``HEADPROBE_CACHE`` elsewhere)."""


def _recorded_eta(root: Path | None, source: str | os.PathLike[str]) -> str:
    """``last took N s`` from :data:`LOAD_TIMES`, or ``""`` (none recorded, unreadable, cache off)."""
    try:
        seconds = json.loads((root / LOAD_TIMES).read_text(encoding="utf-8"))[Path(source).name] if root else None
    except (OSError, ValueError, KeyError, TypeError):
        return ""
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not seconds > 0:
        return ""
    return f"last took {format_seconds(seconds)} here"


def format_seconds(seconds: float) -> str:
    """``seconds`` as a person reads a load time: ``"168 s"``, ``"2.5 s"``, ``"under 0.1 s"`` (never ``"0 s"``)."""
    if seconds >= 9.95:
        return f"{seconds:.0f} s"
    return f"{seconds:.1f} s" if seconds >= 0.05 else "under 0.1 s"


def _record_seconds(root: Path | None, source: str | os.PathLike[str], seconds: float) -> None:
    """Record a cold load's ``seconds`` in :data:`LOAD_TIMES` (best effort: a failure is logged, not raised)."""
    if root is None:
        return
    try:
        path = root / LOAD_TIMES
        times = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        times = times if isinstance(times, dict) else {}
        times[Path(source).name] = max(round(seconds, 4), 1e-4)  # a fast load is short, never 0
        root.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{LOAD_TIMES}.{os.getpid()}")
        tmp.write_text(json.dumps(times, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except (OSError, ValueError) as e:
        log.warning("headprobe: cannot record the load time in %s (%s)", root, e)


class _EntryReader:
    """:func:`load_cached`'s reader of one entry: ``reader()`` is ``load_dir(entry.path)`` when
    the entry is complete and matches its manifest (after ``announce()``), else None, with one
    warning when the entry exists but is damaged or fails to load. An entry that failed to load
    is not tried again while its manifest (inode and mtime) is the same one.

    Raises:
        OSError: the entry vanished between the checks.
    """

    def __init__(self, entry: Entry, load_dir: Callable[[Path], tuple[Any, Any]], announce: Callable[[], None]):
        self.entry, self.load_dir, self.announce = entry, load_dir, announce
        self.failed_manifest: tuple[int, int] | None = None  # (inode, mtime) of a manifest whose entry failed to load

    def __call__(self) -> tuple[Any, Any] | None:
        problem = self.entry.problem()
        if problem == "absent":
            return None
        if problem is None:
            stat = (self.entry.path / MANIFEST).stat()
            if (stat.st_ino, stat.st_mtime_ns) == self.failed_manifest:
                return None
            self.announce()
            try:
                return self.load_dir(self.entry.path)
            except Exception as e:  # any library's failure on a damaged file
                self.failed_manifest = (stat.st_ino, stat.st_mtime_ns)
                problem = f"it fails to load ({type(e).__name__}: {' '.join(str(e).split())[:120]})"
        log.warning("headprobe: weights cache entry %s is damaged: %s; rebuilding it", self.entry.path, problem)
        return None


def _write_entry(entry: Entry, model: Any, tokenizer: Any, extra: Callable[[Any], dict[str, Any]] | None) -> None:
    """Write ``entry`` (:meth:`Entry.write`, with ``extra(model)``'s files); a failure (a full
    disk shows up as OSError or as safetensors' own error) is one warning, not an error: the next
    load dequantizes again."""
    try:
        entry.write(model, tokenizer, extra(model) if extra is not None else None)
    except Exception as e:
        log.warning(
            "headprobe: cannot write the weights cache entry %s (%s: %s); the next load will dequantize again",
            entry.path,
            type(e).__name__,
            getattr(e, "strerror", None) or e,
        )
