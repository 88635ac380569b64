"""The package's import rules (CONTRIBUTING.md), checked with import-linter on the real sources.

setuptools maps ``probe/`` and ``analyses/`` to ``headprobe.probe`` and ``headprobe.analyses``
(package-dir); grimp, import-linter's graph builder, reads the file tree instead, so the test
builds a mirror ``headprobe/`` whose subpackages are symlinks to the real folders.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _mirror(tmp_path: Path) -> Path:
    pkg = tmp_path / "headprobe"
    pkg.mkdir()
    for entry in (ROOT / "headprobe").iterdir():
        if entry.name != "__pycache__":
            (pkg / entry.name).symlink_to(entry)
    (pkg / "probe").symlink_to(ROOT / "probe")
    (pkg / "analyses").symlink_to(ROOT / "analyses")
    return tmp_path


def _lint(tmp_path: Path, config: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(_mirror(tmp_path))}
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run([sys.executable, "-c", code, "--no-cache", str(config)], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=300)


def test_import_rules_hold(tmp_path):
    p = _lint(tmp_path, ROOT / "pyproject.toml")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert "Contracts: 3 kept, 0 broken" in p.stdout


def test_import_rules_can_fail(tmp_path):
    """The same check reports a forbidden import (probe importing analyses) in a copy of the config."""
    config = tmp_path / "strict.toml"
    config.write_text(
        '[tool.importlinter]\nroot_packages = ["headprobe"]\n\n[[tool.importlinter.contracts]]\nname = "inverted"\n'
        'type = "layers"\nlayers = ["headprobe.probe", "headprobe.analyses"]\n')
    (tmp_path / "m").mkdir()
    p = _lint(tmp_path / "m", config)
    assert p.returncode != 0 and "headprobe.analyses" in p.stdout and "broken" in p.stdout.lower()


def test_shape_annotations_are_checked_when_tests_run():
    """pyproject's addopts turn on jaxtyping's import hook for headprobe: a call whose shapes contradict its
    annotation fails the type check (without the hook, einsum would raise a RuntimeError instead)."""
    import jaxtyping
    import pytest
    import torch

    from headprobe.probe.capture import head_results

    z = torch.zeros(1, 3, 4, 8)  # [batch, pos, head=4, d_head=8]
    W_O = torch.zeros(2, 8, 16)  # [head=2, d_head, d_model]: head disagrees
    with pytest.raises(jaxtyping.TypeCheckError):
        head_results(z, W_O)
    assert head_results(z, torch.zeros(4, 8, 16)).shape == (1, 3, 4, 16)
