"""Run mypy over the package headprobe (probe/, analyses/, headprobe/) with pyproject.toml's [tool.mypy].

setuptools maps ``probe/`` and ``analyses/`` to ``headprobe.probe`` and ``headprobe.analyses``
(package-dir), which mypy does not follow; as tests/test_architecture.py does for grimp, this builds
a mirror ``headprobe/`` in a temporary directory whose subpackages are symlinks to the real folders,
runs ``mypy -p headprobe`` there, and prints the paths as the real files'. Extra arguments go to mypy.
Exit status: mypy's (0 clean, 1 type errors, 2 bad usage).

    .venv/bin/python scripts/typecheck.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def mirror(tmp: Path) -> Path:
    """``tmp`` holding a package ``headprobe/`` whose entries and ``probe``/``analyses`` subpackages are
    symlinks to the real folders (tools that read the file tree: mypy here, grimp in test_architecture)."""
    pkg = tmp / "headprobe"
    pkg.mkdir()
    for entry in (ROOT / "headprobe").iterdir():
        if entry.name != "__pycache__":
            (pkg / entry.name).symlink_to(entry)
    (pkg / "probe").symlink_to(ROOT / "probe")
    (pkg / "analyses").symlink_to(ROOT / "analyses")
    return tmp


def _real_path(line: str) -> str:
    for sub in ("probe", "analyses"):
        if line.startswith(f"headprobe/{sub}/"):
            return line[len("headprobe/") :]
    return line


def main(argv: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="headprobe-mypy-") as tmp:
        mirror(Path(tmp))
        cmd = [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            str(ROOT / "pyproject.toml"),
            "--cache-dir",
            str(ROOT / ".mypy_cache"),
            *argv,
            "-p",
            "headprobe",
        ]
        env = {**os.environ, "MYPYPATH": tmp}
        p = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True)
    for line in p.stdout.splitlines():
        print(_real_path(line))
    sys.stderr.write(p.stderr)
    return p.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
