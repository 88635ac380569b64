"""docs/models.md's verified-features matrix is what the code does now.

The matrix (:mod:`models_matrix`) is measured: every registered family's tiny checkpoint and the
tiny GPT-2 on the bridge, through each command at its smallest settings (about 30 s on one core as a script,
``python tests/models_matrix.py``; about 55 s under pytest, whose jaxtyping hook checks every shape).
It is rendered and compared with the section between ``<!-- matrix:start -->`` and
``<!-- matrix:end -->`` of docs/models.md (the versions and date line aside); with
``HEADPROBE_REGENERATE=1`` the section is rewritten instead. The other tests show that the
comparison and an ``exact`` cell can fail.
"""

from __future__ import annotations

import os

import models_matrix as mm
import pytest
import torch


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    return mm.compute(tmp_path_factory.mktemp("matrix"))


def test_docs_models_matrix_is_current(matrix):
    rendered = mm.render(matrix)
    doc = mm.DOC.read_text(encoding="utf-8")
    if os.environ.get("HEADPROBE_REGENERATE") == "1":
        mm.DOC.write_text(mm.replace_section(doc, rendered), encoding="utf-8")
        doc = mm.DOC.read_text(encoding="utf-8")
    why = mm.stale(doc, rendered)
    assert why is None, f"docs/models.md is stale: run `{mm.REGENERATE}` ({why})"


def test_one_edited_cell_of_the_page_is_caught(matrix):
    """A copy of docs/models.md with one generated cell changed no longer matches the code."""
    rendered = mm.render(matrix)
    doc = mm.replace_section(mm.DOC.read_text(encoding="utf-8"), rendered)
    assert mm.stale(doc, rendered) is None
    head, _, table = doc.partition("| family |")
    edited = head + "| family |" + table.replace("| runs |", "| refused (1) |", 1)
    assert edited != doc and "line" in (mm.stale(edited, rendered) or "")


def test_every_family_and_feature_is_measured(matrix):
    from headprobe.probe.model.families import FAMILIES

    assert list(matrix.cells) == [label for label, _, _ in mm.rows()]
    assert set(FAMILIES.names()) <= set(matrix.cells)
    for label, row in matrix.cells.items():
        assert list(row) == [f.name for f in mm.FEATURES], label
        assert row["load"].state == "exact", (label, row["load"])  # every registered family loads exactly


def test_an_edited_cell_is_caught_and_the_versions_line_is_not():
    """The staleness check on a copy of the doc: a section equal to the rendering passes, one cell
    changed fails, a changed versions line does not."""
    cells = {"fam": {f.name: mm.Cell("runs") for f in mm.FEATURES}}
    cells["fam"]["kv"] = mm.Cell("refused", reason="kv says no")
    rendered = mm.render(mm.Matrix(cells, {}, {}), made_with=f"{mm.MADE_WITH}transformers 1, torch 2 on 2000-01-01.")
    doc = "# Model support\n\nprose\n\n" + rendered + "\n\nmore prose\n"
    assert mm.stale(doc, rendered) is None
    assert (
        mm.stale(
            doc.replace("transformers 1, torch 2 on 2000-01-01", "transformers 9, torch 9 on 2099-12-31"), rendered
        )
        is None
    )
    edited = doc.replace("| fam | runs |", "| fam | refused (1) |", 1)
    assert edited != doc
    assert "line" in (mm.stale(edited, rendered) or "")
    assert "no <!-- matrix:start -->" in (mm.stale("# Model support\n", rendered) or "")
    assert mm.replace_section(edited, rendered) == doc


def test_a_model_that_differs_from_hugging_face_is_not_exact(tmp_path):
    """A loaded model whose W_O is changed after its self-check: the load and decomposition cells
    say ``differs``; a refusal and a bug are told apart."""
    import zoo
    from conftest import make_tiny_tokenizer

    from headprobe.probe.core.errors import HeadprobeError

    tok = make_tiny_tokenizer(tmp_path / "tok")
    folder = zoo.save_dir("llama", tok, tmp_path / "llama")
    row = mm.Row(
        "llama",
        "llama",
        "auto",
        folder,
        zoo.make_checkpoint("llama", tok).hf_model,
        tmp_path,
        tmp_path,
        tmp_path,
        False,
    )
    row.model = mm.load(row)
    assert mm.feature_load(row).state == mm.feature_decomposition(row).state == "exact"
    with torch.no_grad():
        row.model.model.blocks[1].attn.o_proj.weight.mul_(1.01)
    assert mm.feature_load(row).state == mm.feature_decomposition(row).state == "differs"

    def refuse(row):
        raise HeadprobeError(f"{tmp_path}/x: no")

    def crash(row):
        raise KeyError("k")

    said = mm.measure(mm.Feature("f", refuse, ""), row, tmp_path, HeadprobeError)
    assert (said.state, said.reason) == ("refused", "DIR: no")
    assert mm.measure(mm.Feature("f", crash, ""), row, tmp_path, HeadprobeError).state == "fails"
