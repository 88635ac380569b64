"""headprobe study heads|layouts on tiny settings (a few steps): tables, figures, the cost columns."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from headprobe.cli import main


def _tiny(which, out, extra=()):
    return main(["study", which, "--out", str(out), "--steps", "2", "--eval-every", "2", "--seeds", "0",
                 "--d-model", "16", "--device", "cpu", *extra])


def test_study_layouts(tmp_path):
    assert _tiny("layouts", tmp_path, ["--n-heads", "4", "--ranks", "2", "--rope", "2"]) == 0
    t = pd.read_csv(tmp_path / "results.csv")
    assert t["variant"].tolist() == ["MHA", "GQA 2 groups", "MQA", "MLA r=2"]
    # KV cache per token (bf16, 2 layers): 2 * n_kv_heads * d_head * 2 layers * 2 bytes; MLA (r + rope) * 2 * 2
    assert t["kv_bytes_per_token"].tolist() == [2 * 4 * 4 * 2 * 2, 2 * 2 * 4 * 2 * 2, 2 * 1 * 4 * 2 * 2, (2 + 2) * 2 * 2]
    s = json.loads((tmp_path / "study.json").read_text())
    assert s["mla_below_one_eighth"] is None  # 16 B is exactly 1/8 of MHA's 128 B, not below
    assert (tmp_path / "quality_vs_kv.png").is_file() and (tmp_path / "quality_vs_kv.pdf").is_file()


def test_study_heads(tmp_path):
    assert _tiny("heads", tmp_path, ["--n-heads-list", "1,2"]) == 0
    t = pd.read_csv(tmp_path / "results.csv")
    assert t["n_heads"].tolist() == [1, 2] and (t["attn_params_per_layer"] == 4 * 16 * 16).all()
    assert (tmp_path / "loss_vs_heads.png").is_file()
    # the default data: documentation text (character level, 96 characters + BOS) mixed with copies
    assert (t["corpus"] == "text+copy").all() and (t["model_params"] == t["model_params"].iloc[0]).all()
    s = json.loads((tmp_path / "study.json").read_text())
    assert s["base"]["corpus"] == "text+copy" and s["base"]["n_words"] == 96 and s["base"]["copy_fraction"] == 0.75


def test_study_copy_corpus(tmp_path):
    assert _tiny("heads", tmp_path, ["--n-heads-list", "2", "--corpus", "copy"]) == 0
    t = pd.read_csv(tmp_path / "results.csv")
    assert t["corpus"].tolist() == ["copy"] and t["text_in_context_loss"].isna().all()


@pytest.mark.parametrize("extra, message", [(["--seeds", "a"], "comma-separated"), (["--ranks", "0"], "positive"),
                                            (["--n-heads-list", "3"], "not a multiple of n_heads=3"),
                                            (["--rope", "3"], "--rope"), (["--copy-fraction", "2"], "--copy-fraction"),
                                            (["--seq-len", "10"], "--max-period 16 does not fit")])
def test_study_rejects_bad_input(tmp_path, capsys, extra, message):
    assert _tiny("heads", tmp_path / "o", extra) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and message in err and not (tmp_path / "o").exists()
