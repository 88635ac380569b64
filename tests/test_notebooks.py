"""The notebooks of docs/notebooks/ run top to bottom (a failing cell fails the test), at tiny settings:
``HEADPROBE_NOTEBOOK_TINY=1`` switches each to the toy model ``figures/train-default`` and a few
sequences. Executed with nbclient in a fresh kernel of this interpreter; nothing is written back (the
committed notebooks keep the outputs of their real settings, which
:func:`test_committed_outputs_are_the_real_settings` checks from their JSON; README, "Documentation site")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "docs" / "notebooks").glob("*.ipynb"))
TINY_MODEL = "figures/train-default"  # each notebook prints its model's name first: this at tiny settings
REAL_MODEL = "smollm2-135m"  # and this at its real settings


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


def output_text(cell: nbformat.NotebookNode) -> str:
    """The text a code cell's outputs show: streams, plain-text results and tracebacks."""
    parts = []
    for o in cell.get("outputs", []):
        if o.output_type == "stream":
            parts.append(o.text)
        elif o.output_type in ("execute_result", "display_data"):
            parts.append(o.data.get("text/plain", ""))
        elif o.output_type == "error":
            parts.append("\n".join(o.traceback))
    return "".join(parts)


def test_the_three_notebooks_are_there():
    assert [p.name for p in NOTEBOOKS] == ["induction_heads.ipynb", "kv_policy.ipynb", "pruning_study.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path):
    nb = execute(path)
    errors = [
        o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", []) if o.output_type == "error"
    ]
    assert not errors
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert TINY_MODEL in output_text(code[0])  # what test_committed_outputs_are_the_real_settings looks for
    warned = [i for i, cell in enumerate(code) if "Warning" in output_text(cell)]  # e.g. tqdm's IProgress one
    assert not warned, [output_text(code[i]) for i in warned]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_committed_outputs_are_the_real_settings(path):
    """The committed notebook (the docs site shows it as is, README says its outputs are SmolLM2-135M's)
    was executed top to bottom in one run at its real settings: every code cell has an output and
    numbered 1, 2, ... in order, no error, its model is SmolLM2-135M and the tiny model appears nowhere."""
    nb = nbformat.read(path, as_version=4)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert [cell.execution_count for cell in code] == list(range(1, len(code) + 1))
    assert all(cell.outputs for cell in code)
    assert not [o for cell in code for o in cell.outputs if o.output_type == "error"]
    assert REAL_MODEL in output_text(code[0])
    assert not [i for i, cell in enumerate(code) if TINY_MODEL in output_text(cell)]


def test_a_failing_cell_fails(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1"), nbformat.v4.new_code_cell("1 / 0")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = tmp_path / "fails.ipynb"
    nbformat.write(nb, path)
    with pytest.raises(CellExecutionError, match="ZeroDivisionError"):
        execute(path)


def _saves(tiny: Path, out: Path) -> dict[str, Any]:
    """Per output folder a notebook's text names (``curve.save("prune-out/")``), the call that writes it
    into ``out``/that folder at tiny settings, with every optional output on (``save_pruned``)."""
    import headprobe

    return {
        "prune-out": lambda: headprobe.prune(
            str(tiny), methods="random", n_natural=2, n_repeated=2, seq_len=64, period=24, n_seeds=1,
            step_fraction=0.5, save_pruned=True, progress=False,
        ).save(out / "prune-out"),
        "kv-out": lambda: headprobe.kv(
            str(tiny), kv_budget=0.5, seq_len=96, block_len=8, n_random=2, budgets=(0.5,), progress=False
        ).save(out / "kv-out"),
    }  # fmt: skip


def test_each_saved_output_a_notebook_names_is_one_its_command_writes(tmp_path):
    """A path under a notebook's output folder (``prune-out/pruned_model``, ``kv-out/policy.json``) names
    a file or folder the result's ``save`` really writes there, as written at tiny settings."""
    import re

    named: dict[str, set[str]] = {}
    for path in NOTEBOOKS:
        text = "\n".join(cell.source for cell in nbformat.read(path, as_version=4).cells)
        for folder in re.findall(r"\.save\(\"([\w-]+)/\"\)", text):
            named.setdefault(folder, set()).update(re.findall(rf"(?<![\w-]){re.escape(folder)}/([\w.-]+)", text))
    named = {folder: names for folder, names in named.items() if names}  # scan.save("out/") names no path in it
    saves = _saves(ROOT / TINY_MODEL, tmp_path)
    assert set(named) <= set(saves), named  # a notebook saving elsewhere: add its call to _saves
    assert named["prune-out"] and named["kv-out"], named  # the check below can fail
    for folder, names in named.items():
        saves[folder]()
        missing = sorted(n for n in names if not (tmp_path / folder / n).exists())
        assert not missing, (folder, missing, sorted(p.name for p in (tmp_path / folder).iterdir()))
