"""The scan end to end: on a tiny random model (fast), through the CLI on bad input, and on the
real SmolLM2-135M (the issue's acceptance numbers)."""

import json

import pandas as pd
import pytest
import torch

from headprobe.analyses.ablation import task_loss, token_losses
from headprobe.probe.errors import HeadprobeError
from headprobe.analyses.detectors import SCORE_COLUMNS
from headprobe.commands.scan import ScanConfig, run
from test_loading import assert_one_line_error, run_cli

EXPECTED_COLUMNS = ["layer", "head", "kv_head", "previous_token", "duplicate_token", "induction", "first_token",
                    "positional_offset", "positional_fraction", "copying", "sink_rate", "entropy", "retrieval", "dla"]


@pytest.fixture
def word_text(tmp_path):
    g = torch.Generator().manual_seed(0)
    path = tmp_path / "words.txt"
    path.write_text(" ".join(f"t{i}" for i in torch.randint(0, 100, (2000,), generator=g).tolist()), encoding="utf-8")
    return path


def test_scan_pipeline_on_tiny_gqa_model_writes_everything(tiny_llama_gqa, word_text, tmp_path):
    cfg = ScanConfig(model="tiny", n_natural=4, seq_len=24, n_repeated=3, period=8, k=3, n_random=2, text=str(word_text))
    result = run(tiny_llama_gqa, cfg, progress=False)
    out = tmp_path / "out"
    out.mkdir()
    result.save(out)
    table = pd.read_csv(out / "head_scores.csv")
    assert list(table.columns) == EXPECTED_COLUMNS
    assert len(table) == 2 * 8
    assert (table["kv_head"] == table["head"] // 4).all()
    for col in SCORE_COLUMNS:
        if col != "positional_offset":
            assert table[col].between(0, 1).all(), col
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tokens"]["natural_text"]["tokens"] == 4 * 24
    assert summary["tokens"]["repeated_random"]["seq_len"] == 1 + 2 * 8
    assert {v["head_type"] for v in summary["ablations"]} == {"previous_token", "duplicate_token", "induction", "first_token", "positional"}
    assert table["copying"].between(-1, 1).all() and table["entropy"].between(0, 5).all() and table["dla"].notna().all()
    assert summary["metrics"]["k_composition_previous_token_to_induction"]["all_pairs"]["n"] == 8 * 8
    for stem in ["overview", "ablation", "heatmap_induction", "pattern_induction", "pattern_previous_token",
                 "heatmap_copying", "heatmap_dla", "composition_k"]:
        assert (out / f"{stem}.png").stat().st_size > 1000 and (out / f"{stem}.pdf").exists()
    assert not list(out.glob(".*tmp*")), "temporary files left behind"


def test_repeated_half_loss_uses_exactly_the_predictable_targets():
    S, start, V = 4, 1, 7
    tokens = torch.randint(0, V, (2, start + 2 * S))
    logits = torch.randn(2, start + 2 * S, V)
    per_token = token_losses(logits, tokens)
    # reference: targets at positions start+S+1 .. start+2S-1, predicted from the position before
    ref = torch.stack([-logits[b, p - 1].log_softmax(-1)[tokens[b, p]] for b in range(2) for p in range(start + S + 1, start + 2 * S)])
    assert task_loss(logits, tokens, "repeated", start, S) == pytest.approx(float(ref.mean()), rel=1e-5)
    assert task_loss(logits, tokens, "natural", start, None) == pytest.approx(float(per_token.mean()), rel=1e-6)


def test_cli_refuses_a_non_empty_output_directory(tmp_path):
    (tmp_path / "keep.txt").write_text("precious")
    rc, _, err = run_cli("scan", "--out", str(tmp_path))
    assert_one_line_error(rc, err, "not empty", "--overwrite")
    assert (tmp_path / "keep.txt").read_text() == "precious"


@pytest.mark.parametrize("args, fragment", [
    (["--top-k", "0"], "--top-k: must be a positive integer, got 0"),
    (["--seq-len", "1"], "at least 2 positions"),
    (["--period", "1"], "at least 2 tokens"),
    (["--text", "{bad}"], "not UTF-8"),
    (["--text", "{empty}"], "is empty"),
])
def test_cli_bad_input_is_one_line_and_writes_nothing(tmp_path, args, fragment):
    (tmp_path / "bad.txt").write_bytes(b"caf\xe9\xff")
    (tmp_path / "empty.txt").write_text("  \n")
    args = [a.format(bad=tmp_path / "bad.txt", empty=tmp_path / "empty.txt") for a in args]
    rc, _, err = run_cli("scan", "--out", str(tmp_path / "out"), *args)
    assert_one_line_error(rc, err, fragment)
    assert not (tmp_path / "out").exists()


@pytest.mark.real_model
def test_real_smollm2_scan_confirms_induction_heads(smollm2, smollm2_native):
    """Acceptance: zero-ablating the top-10 induction heads raises the repeated-half loss by > 3
    nats, clearly more than 10 random heads; the W_O identity holds on the real GQA model."""
    from headprobe.probe.capture import capture_heads

    spec = smollm2_native.spec
    assert (spec.n_layers, spec.n_heads, spec.n_kv_heads, spec.d_head) == (30, 9, 3, 64)
    assert "4-bit" in spec.precision
    from headprobe.options import peek_layout

    assert peek_layout("smollm2-135m") == (spec.n_layers, spec.n_heads)  # what `ablate --heads` checks before loading
    tokens = smollm2_native.to_tokens("The quick brown fox jumps over the lazy dog.")
    for model in (smollm2, smollm2_native):  # both backends: sum of head results == attention output
        cap = capture_heads(model, tokens, layers=[0, 17, 29])
        for layer in (0, 17, 29):
            torch.testing.assert_close(cap["result"][layer].sum(2), cap["attn_out"][layer], atol=1e-4, rtol=0)

    # issue 24's one-test case: 10 draws reach alpha = 0.1 (1/11 = 0.091), and a single test needs no correction
    cfg = ScanConfig(n_natural=4, seq_len=96, n_repeated=6, period=40, k=10, n_random=10, alpha=0.1, types="induction")
    result = run(smollm2_native, cfg, progress=False)
    ind = {v.kind: v for v in result.verifications if v.head_type == "induction"}
    assert ind["zero"].top_effect > 3.0, ind["zero"]
    assert ind["mean"].tested and not ind["zero"].tested and ind["zero"].confirmed is None
    # layer-matched controls: every draw has as many heads per layer as the top-10 set
    layers = sorted(int(h.split(".")[0]) for h in ind["mean"].top_heads)
    assert all(sorted(int(h.split(".")[0]) for h in s) == layers for s in ind["mean"].random_heads)
    assert ind["mean"].confirmed and ind["mean"].top_effect > max(ind["mean"].random_effects), ind["mean"]
    assert ind["mean"].draws == 10 and ind["mean"].p_value == pytest.approx(1 / 11) == ind["mean"].p_adjusted
    assert "CONFIRMED" in result.report()
    assert (result.table["kv_head"] == result.table["head"] // 3).all()
    assert result.table["induction"].max() > 0.5


@pytest.mark.real_model
def test_native_and_bridge_backends_give_the_same_scores_on_smollm2(smollm2, smollm2_native):
    """Issue 3: the native backend reproduces the TransformerLens backend's head scores."""
    from headprobe.analyses.data import natural_text_tokens, repeated_random_tokens
    from headprobe.analyses.scoring import score_token_set

    nat = natural_text_tokens(smollm2, n_seqs=2, seq_len=48, seed=0)
    rep = repeated_random_tokens(smollm2, n_seqs=2, period=20, seed=0)
    for tokens, dataset in ((nat, "natural"), (rep, "repeated")):
        ours, our_logits, _ = score_token_set(smollm2_native, tokens, dataset)
        theirs, their_logits, _ = score_token_set(smollm2, tokens, dataset)
        torch.testing.assert_close(our_logits, their_logits, atol=1e-3, rtol=0)
        for col in ours:
            if col != "positional_offset":
                torch.testing.assert_close(ours[col], theirs[col], atol=1e-4, rtol=0)
    assert (smollm2_native.spec.backend, smollm2.spec.backend) == ("native", "transformer-lens")
    assert smollm2_native.spec.precision.endswith("; native backend")  # as summary.json prints it
    assert smollm2.spec.precision.endswith("; TransformerLens backend")
