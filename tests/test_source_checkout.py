"""``python -m headprobe`` from the project root with headprobe installed without ``-e``: the
checkout's ``headprobe/`` folder shadows the installed package (the current directory comes first
on ``sys.path``) and finds its ``probe/`` and ``analyses/`` beside it (headprobe/__init__.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _installed(site: Path) -> Path:
    """The layout ``pip install .`` writes (pyproject.toml's package-dir): ``headprobe/`` with
    ``probe/`` and ``analyses/`` inside it; copied, as building the wheel takes seconds."""
    skip = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "headprobe", site / "headprobe", ignore=skip)
    for floor in ("probe", "analyses"):
        shutil.copytree(ROOT / floor, site / "headprobe" / floor, ignore=skip)
    return site


def _python(site: Path, cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    """This interpreter without its site-packages' .pth files (``-S``: no editable finder), with the
    installed copy and the dependencies on ``PYTHONPATH``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), sysconfig.get_paths()["purelib"]])}
    return subprocess.run([sys.executable, "-S", *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_python_m_headprobe_runs_from_the_root_of_a_non_editable_install(tmp_path):
    site = _installed(tmp_path / "site")
    proc = _python(site, ROOT, "-m", "headprobe", "--help")
    assert proc.returncode == 0 and proc.stdout.startswith("usage: headprobe"), proc.stderr[-2000:]
    where = _python(
        site,
        ROOT,
        "-c",
        "import headprobe.analyses, headprobe.probe.core.io as io; "
        "print(headprobe.__file__, headprobe.analyses.__file__, io.__file__)",
    )
    assert where.returncode == 0, where.stderr[-2000:]
    assert where.stdout.split() == [
        str(ROOT / "headprobe" / "__init__.py"),
        str(ROOT / "analyses" / "__init__.py"),
        str(ROOT / "probe" / "core" / "io.py"),
    ]  # all of the checkout, none installed
    elsewhere = _python(
        site, tmp_path, "-c", "import headprobe, headprobe.analyses as a; print(headprobe.__path__, a.__file__)"
    )
    assert elsewhere.stdout.split() == [
        f"[{str(site / 'headprobe')!r}]",
        str(site / "headprobe" / "analyses" / "__init__.py"),
    ]
