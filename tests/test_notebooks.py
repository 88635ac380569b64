"""The notebooks of docs/notebooks/ run top to bottom (a failing cell fails the test), at tiny settings:
``HEADPROBE_NOTEBOOK_TINY=1`` switches each to the toy model ``figures/train-default`` and a few
sequences. Executed with nbclient in a fresh kernel of this interpreter; nothing is written back (the
committed notebooks keep the outputs of their real settings; README, "Documentation site")."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "docs" / "notebooks").glob("*.ipynb"))


def execute(path: Path, tiny: bool = True) -> nbformat.NotebookNode:
    """``path`` executed in a new kernel from its folder (with ``HEADPROBE_NOTEBOOK_TINY=1`` when ``tiny``)."""
    import os

    nb = nbformat.read(path, as_version=4)
    env = {
        **os.environ,
        "HEADPROBE_NOTEBOOK_TINY": "1" if tiny else "0",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }
    client = NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}})
    client.execute(env=env)
    return nb


def test_the_three_notebooks_are_there():
    assert [p.name for p in NOTEBOOKS] == ["induction_heads.ipynb", "kv_policy.ipynb", "pruning_study.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path):
    nb = execute(path)
    errors = [
        o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", []) if o.output_type == "error"
    ]
    assert not errors


def test_a_failing_cell_fails(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1"), nbformat.v4.new_code_cell("1 / 0")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = tmp_path / "fails.ipynb"
    nbformat.write(nb, path)
    with pytest.raises(CellExecutionError, match="ZeroDivisionError"):
        execute(path)
