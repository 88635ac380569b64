"""Issue 40: ``headprobe diff`` -- two tiny models that differ in one planted head: the diff finds that
head and no other at the stated alpha; identical models: nothing; layouts that differ: refused in
one line before torch loads."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from headprobe.probe.hooks.ablation import format_head

SMALL = {"seq_len": 32, "period": 10, "n_natural": 16, "n_repeated": 16, "k": 2}
PLANTED = (1, 2)


def _pair(tokenizer, scale: float):
    """Two native copies of the tiny GQA Llama; in the second, head 1.2's query rows are multiplied by
    ``scale`` (its pattern sharpens; layer 1 is the last, so no other head's pattern can change). A
    W_O or W_V plant is invisible here: the random-init unembedding keeps every loss within 0.01
    nats of ln(vocabulary) whatever a head writes."""
    import zoo

    from headprobe.probe.backends.loading import wrap

    a, b = zoo.make_checkpoint("llama", tokenizer), zoo.make_checkpoint("llama", tokenizer)
    cfg = b.hf_model.config
    d = cfg.hidden_size // cfg.num_attention_heads
    with torch.no_grad():
        b.hf_model.model.layers[PLANTED[0]].self_attn.q_proj.weight[PLANTED[1] * d:(PLANTED[1] + 1) * d] *= scale
    return wrap(a, backend="native"), wrap(b, backend="native")


def _significant(result) -> set[tuple[int, int]]:
    alpha = result.config.alpha
    return {(int(x), int(y)) for t in result.tests.values() for x, y in zip(*np.nonzero(t["p_adjusted"] <= alpha))}


def test_diff_finds_the_planted_head_and_no_other(tiny_tokenizer, text_file):
    from headprobe.commands.diff_core import diff

    a, b = _pair(tiny_tokenizer, 1000.0)
    r = diff(a, b, text=str(text_file), **SMALL)
    assert _significant(r) == {PLANTED}
    assert {format_head((int(x), int(y))) for q in r.tests for x, y in zip(*np.nonzero(r.changed(q)))} == {"1.2"}
    flipped = {f["head"]: f["why"] for f in r.flipped}
    moved = {h for sets in r.top.values() for h in set(sets["A"]) ^ set(sets["B"])}
    assert moved - {PLANTED}, "the plant should push other heads across a top-k boundary"
    # those neighbours crossed the boundary without changing: no flip; the planted head's flips name its change
    assert set(flipped) <= {"1.2"} and all("changed by" in w for w in flipped.get("1.2", []))
    row = r.table[(r.table["layer"] == 0) & (r.table["head"] == 1)].iloc[0]
    assert row["induction_change"] == 0 and row["induction_p"] == 1  # layer 0 is untouched: identical patterns


def test_identical_models_differ_nowhere(tiny_tokenizer, text_file):
    from headprobe.commands.diff_core import diff

    a, b = _pair(tiny_tokenizer, 1.0)
    r = diff(a, b, text=str(text_file), **SMALL)
    assert _significant(r) == set() and r.flipped == []
    assert not any(r.changed(q).any() for q in r.tests)
    assert all(np.all(t["change"] == 0) for t in r.tests.values())


def test_requantized_b_is_int3(tiny_tokenizer, text_file):
    """--requantize-b int3: every block matrix of B (and none of A) takes at most 8 values per group of 32."""
    from headprobe.commands.diff_core import diff

    a, b = _pair(tiny_tokenizer, 1.0)
    r = diff(a, b, text=str(text_file), requantize_b="int3", **SMALL)
    assert r.requantized == 14  # 2 layers x (q, k, v, o, fc_in, fc_gate, fc_out)
    def groups(model):  # W_O [head, d_head, d_model] -> o_proj's rows [d_model, head * d_head] in runs of 32 inputs
        return model.W_O(1).permute(2, 0, 1).reshape(-1, 32)

    assert max(len(torch.unique(row)) for row in groups(b)) <= 8
    assert min(len(torch.unique(row)) for row in groups(a)) == 32


def test_layouts_that_differ_are_refused_in_one_line(tmp_path, tiny_tokenizer):
    import os

    import zoo

    zoo.save_dir("llama", tiny_tokenizer, tmp_path / "a")
    other = zoo.make_checkpoint("llama", tiny_tokenizer, num_key_value_heads=4)
    other.hf_model.save_pretrained(tmp_path / "b")
    tiny_tokenizer.save_pretrained(tmp_path / "b")
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "headprobe", "diff", str(tmp_path / "a"),
                        str(tmp_path / "b"), "--out", "o"], capture_output=True, text=True, cwd=tmp_path,
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    lines = [x for x in r.stderr.splitlines() if not x.startswith("import time:")]
    torch_loaded = any(x.startswith("import time:") and x.rsplit("|", 1)[-1].strip() == "torch" for x in r.stderr.splitlines())
    assert r.returncode == 2 and len(lines) == 1, lines
    assert lines[0].startswith("headprobe: error:") and "different layouts (n_kv_heads 2 vs 4)" in lines[0]
    assert not torch_loaded and not (tmp_path / "o").exists()


def test_loaded_models_of_other_layouts_are_refused(tiny_tokenizer):
    """The same refusal where the layout is known only after loading (the Python API on loaded models)."""
    import zoo

    from headprobe.commands.diff_core import diff
    from headprobe.probe.backends.loading import wrap
    from headprobe.probe.core.errors import HeadprobeError

    a = wrap(zoo.make_checkpoint("llama", tiny_tokenizer), backend="native")
    b = wrap(zoo.make_checkpoint("llama", tiny_tokenizer, num_key_value_heads=4), backend="native")
    with pytest.raises(HeadprobeError, match=r"different layouts \(n_kv_heads 2 vs 4\)"):
        diff(a, b, **SMALL)


def test_a_top_k_swap_counts_as_a_flip_only_with_a_real_change():
    """The rule on hand-made tests: two heads swap across the top-1 boundary; only the one whose
    score moved significantly by more than the floor (half a pooled sd over the heads) flipped."""
    from headprobe.commands.diff_core import _flips, changed_heads

    a = np.array([[0.50, 0.49, 0.10, 0.12]])
    change = np.array([[-0.02, 0.30, 0.0, 0.001]])
    p_adj = np.array([[0.01, 0.01, 1.0, 0.01]])
    test = {"change": change, "p_adjusted": p_adj}
    b = a + change
    floor = 0.5 * np.sqrt((a.var() + b.var()) / 2)  # 0.5 pooled sd: about 0.08
    assert changed_heads(test, a, b, 0.05, 0.5).tolist() == [[abs(-0.02) >= floor, True, False, False]]
    top = {"induction": {"A": [(0, 0)], "B": [(0, 1)]}}
    means = {"A": {"induction": a}, "B": {"induction": b}}
    flips = _flips({"induction": test}, means, top, 0.05, 0.5)
    assert [f["head"] for f in flips] == ["0.1"] and "changed by +0.3" in flips[0]["why"][0]
    # without the floor the boundary neighbour 0.0 (a significant but tiny change) would flip too
    assert [f["head"] for f in _flips({"induction": test}, means, top, 0.05, 0.0)] == ["0.0", "0.1"]
