"""The files an interrupted run leaves in its output folder are ignored by git: ``make demo``
writes into the tracked figures/smollm2-135m/, and stopped there it left
``.headprobe-checkpoint.json`` untracked. Each name is made by the code that writes it
(probe/core/io.py) and asked of ``git check-ignore``, git's own reading of .gitignore."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from headprobe.probe.core.io import CHECKPOINT_NAME, STAGING_PREFIX, atomic_path, shard_checkpoint_name

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(
    shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs git and a git checkout"
)


def _ignored(paths: list[str]) -> set[str]:
    """The paths of ``paths`` (relative to the checkout) that git ignores."""
    run = subprocess.run(
        ["git", "check-ignore", "--no-index", "--stdin"],
        cwd=ROOT,
        input="\n".join(paths),
        capture_output=True,
        text=True,
    )
    assert run.returncode in (0, 1), run.stderr  # 1: none ignored
    return set(run.stdout.splitlines())


def test_every_bookkeeping_file_of_a_run_is_ignored(tmp_path):
    with atomic_path(tmp_path / "summary.json") as tmp:  # the temporary name of an atomic write
        written = tmp.name
    with atomic_path(tmp_path / "patterns") as tmp:
        written_bare = tmp.name
    names = [
        CHECKPOINT_NAME,
        shard_checkpoint_name(0, 2),
        shard_checkpoint_name(11, 12),
        f"{STAGING_PREFIX}abc_123/heatmap_induction.png",
        written,
        written_bare,
    ]
    paths = [f"figures/smollm2-135m/{n}" for n in names]
    assert _ignored(paths) == set(paths)


def test_no_output_a_run_is_meant_to_leave_is_ignored():
    """The patterns reach no tracked file (the committed figures and their .headprobe-outputs.json
    file lists) and no output name."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    outputs = ["figures/smollm2-135m/summary.json", "figures/smollm2-135m/.headprobe-outputs.json", "out/train_log.csv"]
    assert _ignored([*tracked.splitlines(), *outputs]) == set()
