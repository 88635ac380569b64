"""One live run per output folder: a run claims its ``--out`` for itself before any work, with an OS
advisory lock (``fcntl.flock``) on a lock file of its own, so that a second run into the same folder
is refused at its start in one line, not after its work (with "not empty") or, worse, while the two
remove each other's staging folders (:func:`~headprobe.probe.core.io.staging`).

The lock is the kernel's: it goes with the process, however it ends (``kill -9`` included), so a
killed run never leaves a stale claim behind, and a resumable run started again resumes. The lock
files live in a per-user folder, ``<tempfile.gettempdir()>/headprobe-locks-<uid>/``, one per output
folder (the SHA-1 of its resolved path), holding the pid of the run that claims it (for the refusal);
nothing is added to the user's folders, and a folder that does not exist yet is claimed alike.

Limits: Windows has no ``fcntl``: there nothing is claimed (:func:`claim_output` returns False). Runs
of other users, or on other machines sharing a file system, do not see each other's claims. The
claims of one process are shared by everything it runs (a command run inside another: an atlas's
scans, a study's trainings), so a process never refuses itself; under torchrun only rank 0 (the
rank that writes the outputs) claims.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import threading
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path

from headprobe.probe.core.errors import HeadprobeError

try:
    import fcntl
except ImportError:  # pragma: no cover  # Windows: no advisory locks, no claims
    fcntl = None  # type: ignore[assignment]

_HELD: dict[str, list[int]] = {}
"""Lock file -> ``[fd, count]``: the claims this process holds, and how many holders each has."""
_GUARD = threading.Lock()
_SCOPE: ContextVar[contextlib.ExitStack | None] = ContextVar("headprobe_output_claims", default=None)
"""The innermost :func:`output_claims` block: where a claim made by :func:`claim_output` is held."""


def lock_path(out: str | os.PathLike[str]) -> Path | None:
    """The lock file of the output folder ``out`` (resolved: ``d``, ``./d`` and a symlink to it are one
    folder), in this user's lock folder (created, mode 0700); None where there is no usable one (no
    ``fcntl``, a lock folder that is not a folder of this user, or cannot be made)."""
    if fcntl is None:
        return None
    folder = Path(tempfile.gettempdir()) / f"headprobe-locks-{os.getuid()}"
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        st = folder.lstat()
    except OSError:
        return None
    if not folder.is_dir() or folder.is_symlink() or st.st_uid != os.getuid():  # another user's: not trusted
        return None
    try:
        resolved = str(Path(out).resolve())
    except (OSError, RuntimeError):  # a symlink loop, an unreadable parent: the path as spelt, made absolute
        resolved = os.path.abspath(out)
    digest = hashlib.sha1(resolved.encode("utf-8", "surrogateescape")).hexdigest()
    return folder / f"{digest}.lock"


def _holder(fd: int) -> str:
    """``(pid N) `` of the run whose pid the lock file ``fd`` holds, else nothing."""
    try:
        pid = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return ""
    return f"(pid {pid}) " if pid.isdigit() else ""


def first_rank() -> bool:
    """True outside torchrun and on its rank 0: the process that claims ``--out`` and says a run's
    lines. Read from the environment torchrun sets, as the process group may be gone when a line is said."""
    return os.environ.get("RANK", "0") == "0"


def _acquire(out: str | os.PathLike[str]) -> str | None:
    """Take this process's claim on ``out`` (one more holder where it holds it already); the lock file
    taken, or None where no lock can be taken (:func:`lock_path`) or this is a torchrun rank other than 0.

    Raises:
        HeadprobeError: another process holds the claim; one line naming its pid and ``out``.
    """
    path = lock_path(out) if first_rank() else None
    if path is None:
        return None
    key = str(path)
    with _GUARD:
        if key in _HELD:
            _HELD[key][1] += 1
            return key
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _holder(fd)
            os.close(fd)
            raise HeadprobeError(
                f"another headprobe run {holder}is writing to {out}; wait for it to finish or choose another --out"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        _HELD[key] = [fd, 1]
        return key


def _release(key: str | None) -> None:
    """One holder less of the claim :func:`_acquire` returned; the lock is let go with the last."""
    if key is None:
        return
    with _GUARD:
        entry = _HELD[key]
        entry[1] -= 1
        if entry[1] == 0:
            del _HELD[key]
            with contextlib.suppress(OSError):
                os.ftruncate(entry[0], 0)  # no pid left behind
            fcntl.flock(entry[0], fcntl.LOCK_UN)
            os.close(entry[0])


@contextlib.contextmanager
def claimed(out: str | os.PathLike[str]) -> Iterator[bool]:
    """This process's claim on the output folder ``out`` within the block; yields whether a lock is
    held (False: none can be taken here, :func:`lock_path`). Reentrant in a process.

    Raises:
        HeadprobeError: another live process claims ``out`` (:func:`_acquire`).
    """
    key = _acquire(out)
    try:
        yield key is not None
    finally:
        _release(key)


@contextlib.contextmanager
def output_claims() -> Iterator[None]:
    """A run's scope: the claims :func:`claim_output` makes within the block are held until it ends.
    :func:`headprobe.cli.main` opens one around a command's run, and every command's Python function
    one around its call (:func:`headprobe.options.notes_flags`), so a command's ``--out``, claimed at
    its start, stays claimed until it has written its files."""
    with contextlib.ExitStack() as stack:
        token = _SCOPE.set(stack)
        try:
            yield
        finally:
            _SCOPE.reset(token)


def claim_output(out: str | os.PathLike[str]) -> bool:
    """Claim ``out`` for the running process until the innermost :func:`output_claims` block ends;
    outside any, only check that no other run claims it now. Returns whether a lock is held (False
    where none can be taken: Windows, :func:`lock_path`).

    Raises:
        HeadprobeError: another live process claims ``out``: ``another headprobe run (pid N) is
            writing to out; wait for it to finish or choose another --out``.
    """
    scope = _SCOPE.get()
    if scope is None:
        with claimed(out) as held:
            return held
    return scope.enter_context(claimed(out))
