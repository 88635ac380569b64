"""README's "Where to add": each row names one place. Each test here adds one thing in that place
alone, at run time (removed again after the test), and finds it everywhere it must appear: the
command line (choices, help, did-you-mean), the scan's CSV columns, summary.json, the figures, the
viewer's data and the docs check. Ablation kinds and model families have their own files
(tests/test_ablation_kinds.py, tests/test_a_new_family.py); rows for commands and shared settings
are tested in functions of their own."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import headprobe
from headprobe.analyses.columns import HEAD_COLUMNS, HEAD_TYPE, METRIC, HeadColumn, HeatmapStyle
from headprobe.probe.errors import HeadprobeError

ROOT = Path(__file__).resolve().parents[1]
SMALL_SCAN = dict(n_natural=3, seq_len=16, n_repeated=2, period=6, k=3, n_random=2)


def undocumented_columns(doc: Path = ROOT / "docs" / "scan.md") -> list[str]:
    """The docs check of the head columns: every column of every registered head type and metric
    is named (in backticks) in docs/scan.md, where head types and metrics are defined."""
    text = doc.read_text(encoding="utf-8")
    return [c for name in HEAD_COLUMNS.names() for c in HEAD_COLUMNS.get(name).columns if f"`{c}`" not in text]


@pytest.fixture
def registered(request):
    """``add(name, record, group)``: register a head column for this test only."""
    added: list[str] = []

    def add(name: str, record: HeadColumn, group: str) -> HeadColumn:
        HEAD_COLUMNS.register(name, record, group=group)
        added.append(name)
        return record

    yield add
    for name in added:
        HEAD_COLUMNS.unregister(name)


@pytest.fixture(scope="module")
def model(tiny_dir):
    return headprobe.load_model(str(tiny_dir), device="cpu")


def test_every_registered_head_column_is_documented():
    assert undocumented_columns() == []


# ---- a head type: one HEAD_COLUMNS entry (group "head type") and its record ------------------------

def _prev_copy() -> HeadColumn:
    """A test-local head type: the previous-token score under another name (its column must equal
    the registry-free reference, a per-head loop over the captured patterns)."""
    from headprobe.analyses.detectors import previous_token_score

    return HeadColumn("prev_copy", ("prev_copy",), lambda p, period, start: {"prev_copy": previous_token_score(p)},
                      "natural", "natural", figures=(HeatmapStyle("prev_copy", "copied score", "attention to i-1"),))


def test_a_head_type_is_a_cli_choice(registered, capsys):
    from headprobe.analyses.columns import select_head_types
    from headprobe.cli import main

    registered("prev_copy", _prev_copy(), HEAD_TYPE)
    assert main(["scan", "--help"]) == 0
    assert "prev_copy" in " ".join(capsys.readouterr().out.split())  # --types' help lists every type
    assert select_head_types("prev-copy") == ("prev_copy",)
    with pytest.raises(HeadprobeError, match=r"did you mean prev-copy\?"):
        select_head_types("prev-cpy")


def test_a_head_type_reaches_the_csv_summary_figures_and_viewer(registered, model, text_file, tmp_path):
    from headprobe.analyses import viewer
    from headprobe.probe.capture import capture_heads

    registered("prev_copy", _prev_copy(), HEAD_TYPE)
    result = headprobe.scan(model, text=str(text_file), types="prev-copy,induction", **SMALL_SCAN)
    assert [c for c in result.table.columns if c in ("prev_copy", "induction")] == ["induction", "prev_copy"]  # registry order
    # the reference: mean attention from i to i-1 over queries 1..T-1, head by head, from captured patterns
    tokens = result.natural.tokens
    for layer in range(model.spec.n_layers):
        pattern = capture_heads(model, tokens, layers=[layer])["pattern"][layer]  # [batch, head, q, k]
        for head in range(model.spec.n_heads):
            p = pattern[:, head].double()
            want = torch.stack([p[:, i, i - 1] for i in range(1, p.shape[-1])]).mean()
            got = result.table.query(f"layer == {layer} and head == {head}")["prev_copy"].item()
            assert got == pytest.approx(float(want), abs=1e-5)
    assert {"heatmap_prev_copy", "pattern_prev_copy"} <= set(result.figures())
    assert {v.head_type for v in result.verifications} == {"prev_copy", "induction"}
    result.save(tmp_path / "out", html=True)
    csv = pd.read_csv(tmp_path / "out" / "head_scores.csv")
    assert "prev_copy" in csv.columns and (tmp_path / "out" / "heatmap_prev_copy.png").is_file()
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert "prev_copy" in summary["top_heads"] and "prev_copy" in summary["config"]["types"]
    data = viewer.viewer_data(csv, summary)
    assert any(m["column"] == "prev_copy" and m["head_type"] == "prev_copy" for m in data["maps"])
    assert "prev_copy" in (tmp_path / "out" / "index.html").read_text()


def test_a_head_type_must_be_documented(registered):
    registered("prev_copy", _prev_copy(), HEAD_TYPE)
    assert undocumented_columns() == ["prev_copy"]  # docs/scan.md must define it


# ---- a reported metric: one HEAD_COLUMNS entry (group "metric") and its record ---------------------

def _metric_records():
    """Two test-local metrics: the sink rate under another name, and one the model never allows."""
    from headprobe.analyses.metrics import SINK_RATE

    def never(model, inputs):
        raise HeadprobeError("not on this model")

    copy = dataclasses.replace(SINK_RATE, name="sink_copy", columns=("sink_copy",),
                               score=lambda model, inputs: {"sink_copy": SINK_RATE.score(model, inputs)["sink_rate"]},
                               figures=(HeatmapStyle("sink_copy", "copied sink rate", "mean attention to token 0"),))
    return copy, HeadColumn("never", ("never",), never, figures=(HeatmapStyle("never", "never", "never"),))


def test_a_metric_reaches_the_csv_summary_figures_and_viewer(registered, model, text_file, tmp_path):
    from headprobe.analyses import viewer
    from headprobe.probe.capture import capture_heads

    for record in _metric_records():
        registered(record.name, record, METRIC)
    result = headprobe.scan(model, text=str(text_file), types="induction", verify=False, **SMALL_SCAN)
    assert list(result.table.columns[-2:]) == ["sink_copy", "never"]  # after the built-in metrics
    # the reference: attention to position 0, every query included, head by head (Gu et al. 2024, eq. 1)
    pattern = capture_heads(model, result.natural.tokens)["pattern"]
    for layer, p in pattern.items():
        want = p[..., :, 0].double().mean(dim=(0, 2)).numpy()
        got = result.table.query(f"layer == {layer}").sort_values("head")["sink_copy"].to_numpy()
        np.testing.assert_allclose(got, want, atol=1e-5)
    assert result.table["never"].isna().all()
    summary = result.summary()
    assert summary["metrics"]["skipped"]["never"] == "not on this model"
    assert "sink_copy" in summary["metrics"]["top_heads"] and "never" not in summary["metrics"]["top_heads"]
    figures = set(result.figures())
    assert "heatmap_sink_copy" in figures and "heatmap_never" not in figures  # no heatmap of an all-NaN column
    result.save(tmp_path / "out", html=True)
    csv = pd.read_csv(tmp_path / "out" / "head_scores.csv")
    assert "sink_copy" in csv.columns and (tmp_path / "out" / "heatmap_sink_copy.png").is_file()
    data = viewer.viewer_data(csv, json.loads((tmp_path / "out" / "summary.json").read_text()))
    i = 3 + data["columns"].index("sink_copy")  # the viewer's table carries every CSV column, after layer, head, kv_head
    assert [row[i] for row in data["rows"]] == pytest.approx(csv.sort_values(["layer", "head"])["sink_copy"].tolist(), abs=1e-3)


def test_a_metric_must_be_documented(registered):
    for record in _metric_records():
        registered(record.name, record, METRIC)
    assert undocumented_columns() == ["sink_copy", "never"]


# ---- a backend: one BACKEND_REGISTRY entry and its LoadedModel subclass -------------------------------

@pytest.fixture
def copy_backend():
    """A test-local backend: the native model under another name (its own class, its own registry entry)."""
    from headprobe.probe.native import NativeModel
    from headprobe.probe.vocabulary import BACKEND_REGISTRY

    class CopyModel(NativeModel):
        name = "native-copy"

        @classmethod
        def wraps(cls, module: object) -> bool:
            return False  # LoadedModel(module, ...) keeps picking the native class

        @classmethod
        def supports(cls, hf_config) -> bool:
            return False  # --backend auto never takes it

    BACKEND_REGISTRY.register("native-copy", CopyModel)
    yield CopyModel
    BACKEND_REGISTRY.unregister("native-copy")


def test_a_backend_is_a_cli_choice_and_loads(copy_backend, tiny_dir, capsys):
    from transformers import AutoModelForCausalLM

    from headprobe import options
    from headprobe.cli import main

    assert main(["scan", "--help"]) == 0
    assert re.search(r"\{auto,native,transformer-lens,native-copy\}", capsys.readouterr().out)
    assert "native-copy" in options.BACKENDS
    loaded = headprobe.load_model(str(tiny_dir), backend="native-copy")
    assert type(loaded) is copy_backend and loaded.backend == "native-copy" and loaded.self_check.ok
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_dir), attn_implementation="eager").eval()
    tokens = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():  # the reference: the Hugging Face model itself
        torch.testing.assert_close(loaded.forward(tokens), hf(tokens).logits, atol=1e-4, rtol=0)
    with pytest.raises(HeadprobeError, match=r"unknown backend 'native-cpy' \(did you mean 'native-copy'"):
        headprobe.load_model(str(tiny_dir), backend="native-cpy")


def test_a_backend_runs_a_scan_from_the_cli(copy_backend, tiny_dir, text_file, tmp_path):
    from headprobe.cli import main

    out = tmp_path / "out"
    assert main(["scan", "--model", str(tiny_dir), "--backend", "native-copy", "--types", "induction", "--no-verify",
                 "--text", str(text_file), "--out", str(out), "--n-natural", "2", "--seq-len", "16",
                 "--n-repeated", "2", "--period", "6", "--device", "cpu"]) == 0
    assert json.loads((out / "summary.json").read_text())["config"]["backend"] == "native-copy"
