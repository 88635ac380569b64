"""``headprobe diff`` -- two tiny models that differ in one planted head: the diff finds that
head and no other at the stated alpha; identical models: nothing; layouts that differ: refused in
one line before torch loads."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.hooks.ablation import format_head

SMALL = {"seq_len": 32, "period": 10, "n_natural": 16, "n_repeated": 16, "k": 2}
PLANTED = (1, 2)


def _pair(tokenizer, scale: float):
    """Two native copies of the tiny GQA Llama; in the second, head 1.2's query rows are multiplied by
    ``scale`` (its pattern sharpens; layer 1 is the last, so no other head's pattern can change). A
    W_O or W_V plant is invisible here: the random-init unembedding keeps every loss within 0.01
    nats of ln(vocabulary) whatever a head writes."""
    import zoo

    from headprobe.probe.backends.wrapping import wrap

    a, b = zoo.make_checkpoint("llama", tokenizer), zoo.make_checkpoint("llama", tokenizer)
    cfg = b.hf_model.config
    d = cfg.hidden_size // cfg.num_attention_heads
    with torch.no_grad():
        b.hf_model.model.layers[PLANTED[0]].self_attn.q_proj.weight[PLANTED[1] * d : (PLANTED[1] + 1) * d] *= scale
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
    # change is the mean of the per-sequence differences: b - a of the pooled columns for every quantity that is a
    # mean over queries or tokens; positional_fraction (a share of queries at a modal offset) is the one that is not
    for q in set(r.tests) - {"positional_fraction"}:
        gap = (r.table[f"{q}_change"] - (r.table[f"{q}_b"] - r.table[f"{q}_a"])).abs().max()
        assert gap < 1e-5, (q, gap)


def test_identical_models_are_refused_before_any_measurement(tiny_tokenizer, text_file, monkeypatch):
    """``diff smollm2-135m smollm2-135m --requantize-b int4`` ran 11 minutes of sweeps and then said every head's
    weights were identical (int4 rounding leaves a Q4_1 GGUF's weights as they are) while summary.json counted 210
    re-quantized matrices. Two models with equal weights are one line before anything is measured; rounding
    weights already on the scheme's grid counts 0 matrices changed and says so."""
    import headprobe.commands.diff_core as diff_core
    from headprobe.probe.requantize import requantize, requantized

    monkeypatch.setattr(diff_core, "memory_plan", lambda *a, **k: pytest.fail("went on to plan a measurement"))
    a, b = _pair(tiny_tokenizer, 1.0)
    with pytest.raises(HeadprobeError, match=r"^B's weights equal A's in every tensor: A and B are the same weights"):
        diff_core.diff(a, b, text=str(text_file), **SMALL)
    on_grid, n = requantized(a, "int4")
    assert n == 14  # every block matrix moved; rounded again (float32 scales) until none does: on int4's grid
    assert [requantize(on_grid, "int4") for _ in range(4)][-1] == 0
    with pytest.raises(HeadprobeError, match=r"re-quantizing B to int4 changed no weight") as e:
        diff_core.diff(on_grid, on_grid, text=str(text_file), requantize_b="int4", **SMALL)
    assert "\n" not in str(e.value)


def test_requantized_b_is_int3(tiny_tokenizer, text_file):
    """--requantize-b int3: every block matrix of B's copy takes at most 8 values per group of 32
    (the caller's A and B keep theirs)."""
    from headprobe.commands.diff_core import diff
    from headprobe.probe.requantize import requantized

    a, b = _pair(tiny_tokenizer, 1.0)
    r = diff(a, b, text=str(text_file), requantize_b="int3", **SMALL)
    assert r.requantized == 14  # 2 layers x (q, k, v, o, fc_in, fc_gate, fc_out)

    def groups(model):  # W_O [head, d_head, d_model] -> o_proj's rows [d_model, head * d_head] in runs of 32 inputs
        return model.W_O(1).permute(2, 0, 1).reshape(-1, 32)

    assert max(len(torch.unique(row)) for row in groups(requantized(b, "int3")[0])) <= 8
    assert min(len(torch.unique(row)) for m in (a, b) for row in groups(m)) == 32


def test_layouts_that_differ_are_refused_in_one_line(tmp_path, tiny_tokenizer):
    import os

    import zoo

    zoo.save_dir("llama", tiny_tokenizer, tmp_path / "a")
    other = zoo.make_checkpoint("llama", tiny_tokenizer, num_key_value_heads=4)
    other.hf_model.save_pretrained(tmp_path / "b")
    tiny_tokenizer.save_pretrained(tmp_path / "b")
    r = subprocess.run(
        [
            sys.executable,
            "-X",
            "importtime",
            "-m",
            "headprobe",
            "diff",
            str(tmp_path / "a"),
            str(tmp_path / "b"),
            "--out",
            "o",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    lines = [x for x in r.stderr.splitlines() if not x.startswith("import time:")]
    torch_loaded = any(
        x.startswith("import time:") and x.rsplit("|", 1)[-1].strip() == "torch" for x in r.stderr.splitlines()
    )
    assert r.returncode == 2 and len(lines) == 1, lines
    assert lines[0].startswith("headprobe: error:") and "different layouts (n_kv_heads 2 vs 4)" in lines[0]
    assert not torch_loaded and not (tmp_path / "o").exists()


def test_loaded_models_of_other_layouts_are_refused(tiny_tokenizer):
    """The same refusal where the layout is known only after loading (the Python API on loaded models)."""
    import zoo

    from headprobe.commands.diff_core import diff
    from headprobe.probe.backends.wrapping import wrap
    from headprobe.probe.core.errors import HeadprobeError

    a = wrap(zoo.make_checkpoint("llama", tiny_tokenizer), backend="native")
    b = wrap(zoo.make_checkpoint("llama", tiny_tokenizer, num_key_value_heads=4), backend="native")
    with pytest.raises(HeadprobeError, match=r"different layouts \(n_kv_heads 2 vs 4\)"):
        diff(a, b, **SMALL)


def test_a_top_k_swap_counts_as_a_flip_only_with_a_real_change():
    """The rule on hand-made tests: two heads swap across the top-1 boundary; only the one whose
    score moved significantly by more than the floor (half a pooled sd over the heads) flipped."""
    from headprobe.commands.diff_stats import changed_heads, role_changes

    a = np.array([[0.50, 0.49, 0.10, 0.12]])
    change = np.array([[-0.02, 0.30, 0.0, 0.001]])
    p_adj = np.array([[0.01, 0.01, 1.0, 0.01]])
    test = {"change": change, "p_adjusted": p_adj}
    b = a + change
    floor = 0.5 * np.sqrt((a.var() + b.var()) / 2)  # 0.5 pooled sd: about 0.08
    assert changed_heads(test, a, b, 0.05, 0.5).tolist() == [[abs(-0.02) >= floor, True, False, False]]
    top = {"induction": {"A": [(0, 0)], "B": [(0, 1)]}}
    means = {"A": {"induction": a}, "B": {"induction": b}}
    flips, _ = role_changes({"induction": test}, means, top, 0.05, 0.5, {})
    assert [f["head"] for f in flips] == ["0.1"] and "changed by +0.3" in flips[0]["why"][0]
    # without the floor the boundary neighbour 0.0 (a significant but tiny change) would flip too
    assert [f["head"] for f in role_changes({"induction": test}, means, top, 0.05, 0.0, {})[0]] == ["0.0", "0.1"]


def test_a_head_that_left_the_top_k_while_its_score_rose_did_not_flip():
    """walk-atlas: between two checkpoints head 1.0's induction score rose 0.035 -> 0.422 and it left
    the top-k only because 1.3 rose more, yet it was reported as a flip: a crossing against the
    head's own change is a neighbour's move; the head that entered with a rise still flips. diff.png
    fills the dot of the report's flips only (it filled every changed crossing, not_roles too)."""
    from headprobe.commands.diff_drawing import role_dots
    from headprobe.commands.diff_stats import role_changes

    a = np.array([[0.035, 0.30, 0.02, 0.010]])
    b = np.array([[0.422, 0.516, 0.02, 0.013]])  # 0.0 rose but left (0.1 rose more); 0.1 entered with a rise
    test = {"change": b - a, "p_adjusted": np.full(a.shape, 0.001)}
    top = {"induction": {"A": [(0, 0), (0, 3)], "B": [(0, 1), (0, 2)]}}
    means = {"A": {"induction": a}, "B": {"induction": b}}
    flipped, low = role_changes({"induction": test}, means, top, 0.05, 0.0, {"induction": 0.0288})
    assert [f["head"] for f in flipped] == ["0.1"] and flipped[0]["types"] == ["induction"], flipped
    assert low == []  # 0.3 left with a rise too: no flip, no not_role; 0.2 did not change
    dots = role_dots(top, flipped, {"induction"})
    assert dots == {"induction": {(0, 0): False, (0, 1): True, (0, 2): False, (0, 3): False}}
    old = [{"head": "0.1", "why": ["induction: top-k in B only, ..."]}]  # a summary.json older than "types"
    assert role_dots(top, old, {"induction"}) == dots


def _permuted_tokenizer(tmp_path):
    """The tiny tokenizer's 100 words with their ids reversed (``t0`` is id 99): the same size, other tokens."""
    from tokenizers import pre_tokenizers

    from headprobe.probe.model.tokenizers import _word_level_tokenizer

    return _word_level_tokenizer({f"t{99 - i}": i for i in range(100)}, tmp_path, pre_tokenizers.WhitespaceSplit())


def test_a_permuted_vocabulary_of_the_same_size_is_refused(tiny_tokenizer, tmp_path):
    """Two models of one layout and one vocabulary size whose ids name other words: B would be run on
    A's ids as if they meant the same; refused in one line naming an id that differs."""
    import zoo

    from headprobe.commands.diff_core import diff
    from headprobe.probe.backends.wrapping import wrap
    from headprobe.probe.core.errors import HeadprobeError

    permuted = _permuted_tokenizer(tmp_path / "tok")
    assert len(permuted) == len(tiny_tokenizer) and permuted("t1")["input_ids"] != tiny_tokenizer("t1")["input_ids"]
    a = wrap(zoo.make_checkpoint("llama", tiny_tokenizer), backend="native")
    b = wrap(zoo.make_checkpoint("llama", permuted), backend="native")
    with pytest.raises(
        HeadprobeError, match=r"different tokenizers: 100 of 101 ids .*id 0 is 't0' in .* and 't99' in"
    ) as e:
        diff(a, b, **SMALL)
    assert "\n" not in str(e.value)


def test_another_special_token_is_refused(tiny_tokenizer, tmp_path):
    """The same vocabulary with another BOS: the sequences B would see start with another token."""
    import zoo

    from headprobe.commands.diff_measure import tokenizer_refusal

    other = type(tiny_tokenizer).from_pretrained(tiny_tokenizer.name_or_path, bos_token="t5")
    assert other.get_vocab() == tiny_tokenizer.get_vocab()
    why = tokenizer_refusal(tiny_tokenizer, other, "A", "B")
    assert why is not None and "bos_token" in why and "\n" not in why
    assert tokenizer_refusal(tiny_tokenizer, zoo.make_checkpoint("llama", tiny_tokenizer).tokenizer, "A", "B") is None


def test_a_permuted_vocabulary_is_refused_on_the_command_line(tiny_tokenizer, tmp_path, capsys):
    import zoo

    from headprobe.cli import main

    zoo.save_dir("llama", tiny_tokenizer, tmp_path / "a")
    zoo.make_checkpoint("llama", tiny_tokenizer).hf_model.save_pretrained(tmp_path / "b")
    _permuted_tokenizer(tmp_path / "b")
    capsys.readouterr()  # the progress bars of saving
    code = main(
        [
            "diff",
            str(tmp_path / "a"),
            str(tmp_path / "b"),
            "--out",
            str(tmp_path / "o"),
            "--device",
            "cpu",
            "--seq-len",
            "16",
            "--n-natural",
            "2",
            "--n-repeated",
            "2",
        ]
    )
    err = capsys.readouterr().err
    errors = [x for x in err.splitlines() if x.startswith("headprobe: error:")]  # after "loading ..." lines
    assert code == 2 and len(errors) == 1 and "different tokenizers" in errors[0] and "Traceback" not in err
    assert err.splitlines()[-1] == errors[0]
    assert not (tmp_path / "o").exists()


def _state(model) -> dict:
    return {k: v.detach().clone() for k, v in model.model.state_dict().items()}


def test_requantizing_one_loaded_model_leaves_the_callers_model_and_compares_copies(tiny_tokenizer, text_file):
    """``diff(m, m, requantize_b=...)``: the caller's weights bit-equal after; the changes are those of
    two separate loads (A the model, B a re-quantized twin), not 0 (A and B the same object)."""
    import zoo

    from headprobe.commands.diff_core import diff
    from headprobe.probe.backends.wrapping import wrap

    m = wrap(zoo.make_checkpoint("llama", tiny_tokenizer), backend="native")
    before = _state(m)
    one = diff(m, m, text=str(text_file), requantize_b="int3", **SMALL)
    after = _state(m)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    a, b = (wrap(zoo.make_checkpoint("llama", tiny_tokenizer), backend="native") for _ in range(2))
    two = diff(a, b, text=str(text_file), requantize_b="int3", **SMALL)
    assert one.requantized == two.requantized == 14
    for q in two.tests:
        assert np.abs(two.tests[q]["change"]).max() > 0, q  # re-quantization changes something
        np.testing.assert_allclose(one.tests[q]["change"], two.tests[q]["change"], rtol=0, atol=1e-12, err_msg=q)


def test_a_loaded_b_is_not_requantized_in_place(tiny_tokenizer, text_file):
    """A B given loaded is the caller's too: compared re-quantized, left as it was."""
    import zoo

    from headprobe.commands.diff_core import diff
    from headprobe.probe.backends.wrapping import wrap

    a, b = (wrap(zoo.make_checkpoint("llama", tiny_tokenizer), backend="native") for _ in range(2))
    before = _state(b)
    diff(a, b, text=str(text_file), requantize_b="int8", **SMALL)
    assert all(torch.equal(before[k], v) for k, v in _state(b).items())


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_requantization_changes_every_weight_matrix_of_a_moe_block(tiny_tokenizer, family):
    """Every weight matrix of the blocks, the stacked experts ``[expert, out, in]`` included, is rounded
    (int3: at most 8 values per group of 32 inputs of each expert's rows); norms, biases and sinks are not."""
    import zoo

    from headprobe.probe.backends.wrapping import wrap
    from headprobe.probe.requantize import requantize

    m = wrap(zoo.make_checkpoint(family, tiny_tokenizer), backend="native")
    before = _state(m)
    n = requantize(m, "int3")  # in place: the test's own model
    after = _state(m)
    matrices = [k for k, v in before.items() if k.startswith("blocks.") and v.dim() >= 2 and "bias" not in k]
    experts = [k for k in matrices if before[k].dim() == 3]
    assert len(experts) == 2 * m.spec.n_layers and n == len(matrices)
    for k in matrices:
        assert not torch.equal(before[k], after[k]), k
        rows = after[k].reshape(-1, 32)
        assert max(len(torch.unique(r)) for r in rows) <= 8, k
    for k in before.keys() - set(matrices):  # embeddings, norms, biases (GPT-OSS's expert biases are 2-D), sinks
        assert torch.equal(before[k], after[k]), k
    share = sum(before[k].numel() for k in experts) / sum(before[k].numel() for k in matrices)
    assert share > 0.5  # the experts are most of the block's weights


def test_resample_with_one_sequence_per_task_is_refused(tiny_tokenizer, text_file):
    """--kind resample takes each sequence's source from another sequence; with one there is none (every
    effect would be 0): refused in one line, before any forward."""
    from headprobe.commands.diff_core import diff
    from headprobe.probe.core.errors import HeadprobeError

    a, b = _pair(tiny_tokenizer, 1.0)
    for counts in ({"n_natural": 1, "n_repeated": 4}, {"n_natural": 4, "n_repeated": 1}):
        with pytest.raises(HeadprobeError, match="--kind resample needs at least 2 sequences") as e:
            diff(a, b, text=str(text_file), kind="resample", **{**SMALL, **counts})
        assert "\n" not in str(e.value)


def test_resample_refused_when_the_text_gives_one_sequence(tiny_tokenizer, tmp_path):
    """--n-natural 16 asked, a text of one sequence's length given: the natural task has 1 sequence."""
    from headprobe.commands.diff_core import diff
    from headprobe.probe.core.errors import HeadprobeError

    short = tmp_path / "short.txt"
    short.write_text(" ".join(f"t{i % 100}" for i in range(40)))
    a, b = _pair(tiny_tokenizer, 2.0)  # B differs: identical weights are refused first
    with pytest.raises(HeadprobeError, match="--kind resample needs at least 2 sequences.*natural.* 1"):
        diff(a, b, text=str(short), kind="resample", **SMALL)


@pytest.mark.parametrize("n", [1, 2, 4, 6, 12, 13, 14, 16])
def test_the_smallest_p_is_what_the_test_gives_all_effects_one_way(n):
    """The bound against the p-values the test produces: every sequence's difference of one sign
    (distinct sizes) gives the smallest p; mixed signs never go below it; exact below 13 sequences
    (2 of 2^n flips), drawn above (counting the draws whose signs are all alike)."""
    from headprobe.analyses.robustness import sign_flip_min_p, sign_flip_p

    rng = np.random.default_rng(n)
    one_way = rng.uniform(0.5, 1.5, size=(n, 3, 4))
    for n_perm, seed in ((9999, 0), (99, 3)):
        bound = sign_flip_min_p(n, n_perm, seed)
        p = sign_flip_p(one_way, n_perm, seed)
        assert np.all(p == bound)
        mixed = one_way * rng.choice((1.0, -1.0), size=one_way.shape)
        assert np.all(sign_flip_p(mixed, n_perm, seed) >= bound)
        if n < 13:  # by hand: only the two flips of all signs alike reach |mean(d)|
            assert bound == 2 / 2**n
        else:  # drawn flips: (1 + draws of all signs alike) / (1 + n_perm), never below 1 / (1 + n_perm)
            assert bound >= 1 / (1 + n_perm)


@pytest.mark.parametrize("correction", ["bh", "holm"])
@pytest.mark.parametrize("n", [4, 5, 6, 9, 13, 16])
def test_detection_limit_agrees_with_the_corrected_p_values_of_compare(n, correction):
    """A hand-made diff of 30 heads: every head moved one way, then one head alone; compare()'s
    adjusted p-values pass alpha exactly when detection_limit says a change (any, or a lone one)
    is detectable; the sequences it names are the fewest that allow it."""
    from headprobe.analyses.robustness import detection_limit
    from headprobe.commands.diff_stats import compare

    rng = np.random.default_rng(0)
    a = {"q": rng.normal(size=(n, 5, 6))}
    every = {"q": a["q"] + rng.uniform(0.5, 1.5, size=(n, 5, 6))}
    lone = {"q": a["q"].copy()}
    lone["q"][:, 2, 3] += rng.uniform(0.5, 1.5, size=n)
    d = detection_limit(n, 30, 0.05, correction, 9999, 0)
    got_every = bool((compare(a, every, correction, 9999, 0)["q"]["p_adjusted"] <= 0.05).any())
    got_lone = compare(a, lone, correction, 9999, 0)["q"]["p_adjusted"]
    assert got_every == d["detectable"] and bool(got_lone[2, 3] <= 0.05) == d["detectable_alone"]
    assert d["smallest_p"] == pytest.approx(2 / 2**n) if n < 13 else d["smallest_p"] <= 10 / 1e4
    # by hand for bh at alpha 0.05 over 30 heads: any change needs 2/2^n <= 0.05 (6 sequences),
    # a lone one 2/2^n <= 0.05/30 = 0.00167 (11 sequences: 2/2^11 = 0.00098, 2/2^10 = 0.00195); holm needs
    # alpha / 30 for both
    assert d["sequences_needed"] == (6 if correction == "bh" else 11) and d["sequences_needed_alone"] == 11
    if n >= 6 and correction == "bh":
        assert d["detectable"]
    if d["detectable"]:  # the fewest heads moved one way that pass, and one fewer that does not
        k = d["heads_needed"]
        for count, passes in ((k, True), (k - 1, False)):
            some = {"q": a["q"].copy()}
            some["q"].reshape(n, -1)[:, :count] += rng.uniform(0.5, 1.5, size=(n, count))
            assert bool((compare(a, some, correction, 9999, 0)["q"]["p_adjusted"] <= 0.05).any()) == passes
        if correction == "bh" and n < 13:  # by hand: k tests at p pass bh when p * 30 / k <= 0.05
            assert k == math.ceil(2 / 2**n * 30 / 0.05 - 1e-9)
    else:
        assert d["heads_needed"] is None
    assert d["detectable"] == (n >= d["sequences_needed"])


def test_few_sequences_say_no_change_could_be_detected(tiny_tokenizer, text_file, capsys):
    """4 sequences per task: the smallest p (1/8) cannot pass BH at 0.05, so diff says so before the
    measurements (naming --n-natural/--n-repeated 6), in summary.json and in the report's lines; the
    run's own p-values are never below that bound; and the progress bar names its steps."""
    from headprobe.commands.diff_core import diff

    a, b = _pair(tiny_tokenizer, 1000.0)
    capsys.readouterr()
    r = diff(a, b, text=str(text_file), seq_len=32, period=10, n_natural=4, n_repeated=4, k=2, progress=True)
    err = capsys.readouterr().err
    notes = [x for x in err.splitlines() if x.startswith("NOTE:")]
    assert len(notes) == 2 and all("can detect no change" in x for x in notes)
    assert "--n-natural 6 or more" in notes[0] and "--n-repeated 6 or more" in notes[1]
    assert err.index("NOTE:") < err.index("diff: model A")  # said before the measurements
    assert "diff: model B, ablation sweep repeated" in err and "8/8" in err
    # the steps take seconds (scoring) or minutes (sweeps): a rate and a time left from them misled ("<00:05"
    # through a 5-minute sweep), so the bar gives the steps done and the time so far only
    bar = [x for x in err.replace("\r", "\n").splitlines() if x.startswith("diff: model")]
    assert bar and all("so far]" in x and "step/s" not in x and "<" not in x for x in bar), bar
    s = r.summary()
    assert s["detection"]["natural"]["detectable"] is False and s["detection"]["natural"]["smallest_p"] == 2 / 2**4
    assert s["detection"]["natural"]["n_tests"] == 2 * 4  # the tiny Llama's heads
    assert all(q["detectable"] is False for q in s["quantities"].values())
    assert min(np.nanmin(t["p"]) for t in r.tests.values()) >= 2 / 2**4  # the planted head reaches the bound
    report = r.report()
    assert report.count("significant: 0 heads (none could be: p >= 0.125 from 4 ") == len(r.tests)
    assert "flipped roles: 0 heads (none could be:" in report


def _synthetic_result(n_layers: int = 30, n_heads: int = 9):
    """A DiffResult of SmolLM2's layout with made-up numbers: scores in [0, 1], ablation effects in
    nats/token, one head changed in each quantity."""
    import pandas as pd

    from headprobe.commands.diff_core import DiffConfig, DiffResult
    from headprobe.probe.layout.attention import AttentionLayout
    from headprobe.probe.layout.spec import ModelSpec

    rng = np.random.default_rng(0)
    qs = ["previous_token", "duplicate_token", "induction", "first_token", "positional_fraction"]
    qs += ["ablation_natural", "ablation_repeated"]
    means = {m: {q: rng.random((n_layers, n_heads)) for q in qs} for m in "AB"}
    tests = {}
    for q in qs:
        p = np.ones((n_layers, n_heads))
        p[3, 4] = 1e-4
        change = means["B"][q] - means["A"][q]
        change[3, 4] = 5.0
        tests[q] = {"change": change, "p": p, "p_adjusted": p}
    types = ("previous_token", "duplicate_token", "induction", "first_token", "positional")
    top = {t: {"A": [(3, 4), (5, 1)], "B": [(3, 4), (6, 2)]} for t in types}
    layout = AttentionLayout(d_model=576, n_layers=n_layers, n_heads=n_heads, n_kv_heads=3)
    spec = ModelSpec("smollm2-135m", "HuggingFaceTB/SmolLM2-135M", layout, 49152, 8192, "float32")
    cfg = DiffConfig(model="smollm2-135m", b="smollm2-135m", requantize_b="int8", k=2)
    return DiffResult(cfg, spec, spec, means, tests, top, [], pd.DataFrame(), {}, {})


@pytest.mark.figures
def test_diff_figure_labels_every_colour_bar_and_is_readable_at_its_size():
    """diff.png (4635 x 5580 px, 15.5 x 18.6 in) had colour bars with no label, though its panels
    mix scores (attention weights, 0-1) and ablation effects (nats/token), and 6-point text on a
    figure that a page shrinks 2.3 times. Every colour bar names its quantity and unit now, the
    figure is a page wide (analyses.figures.PAGE_WIDTH), and no text is below 5 points there."""
    import matplotlib.text

    from headprobe.analyses.figures import PAGE_WIDTH

    fig = _synthetic_result().figures()["diff"]()
    fig.draw_without_rendering()
    bars = {ax.get_title(): im.colorbar.ax.get_ylabel() for ax in fig.axes for im in ax.images if im.colorbar}
    assert len(bars) == 7, bars
    for title, label in bars.items():
        assert label, f"colour bar of {title!r} has no label"
        unit = "nats/token" if "ablation" in title else ("share of queries" if "positional" in title else "attention")
        assert unit in label, (title, label)
    assert fig.get_figwidth() <= PAGE_WIDTH + 1e-9 and fig.get_figheight() <= 9.5
    sizes = [t.get_fontsize() for t in fig.findobj(matplotlib.text.Text) if t.get_text() and t.get_visible()]
    assert min(sizes) >= 5, min(sizes)


def test_diff_png_redrawn_from_the_saved_folder_is_the_runs_figure(tiny_tokenizer, text_file, tmp_path):
    """scripts/redraw_figures.py redraws diff.png from diff.csv and summary.json
    (``diff_drawing.redraw``): the same panels, changes (to diff.csv's 6 digits), boxes and dots as the
    figure drawn from the run itself."""
    from matplotlib.patches import Rectangle

    from headprobe.commands.diff_core import diff
    from headprobe.commands.diff_drawing import redraw

    a, b = _pair(tiny_tokenizer, 1000.0)
    r = diff(a, b, text=str(text_file), **SMALL)
    r.save(tmp_path / "o")
    live, again = r.figures()["diff"](), redraw(tmp_path / "o")["diff"]

    def panels(fig):
        out = []
        for ax in fig.axes:
            if ax.images:
                boxes = sorted((p.get_x(), p.get_y()) for p in ax.patches if isinstance(p, Rectangle))
                dots = sorted((ln.get_xdata()[0], ln.get_ydata()[0], ln.get_markerfacecolor()) for ln in ax.get_lines())
                out.append((ax.get_title(), np.ma.getdata(ax.images[0].get_array()), boxes, dots))
        return out

    assert any(p[2] for p in panels(live))  # the planted head is boxed: the comparison has something to compare
    assert len(panels(live)) == len(panels(again)) == len(r.tests)
    for (t1, c1, b1, d1), (t2, c2, b2, d2) in zip(panels(live), panels(again)):
        assert t1 == t2 and b1 == b2 and d1 == d2
        np.testing.assert_allclose(c2, c1, rtol=1e-5, atol=1e-9)
    assert live._suptitle.get_text().replace("\n", " ") == again._suptitle.get_text().replace("\n", " ")


def test_a_text_the_tokenizer_does_not_know_is_said(tiny_tokenizer, tmp_path, capsys):
    """A natural text of words outside the tiny tokenizer's vocabulary is all unknown tokens: its
    scores and ablation effects measure that, not a mechanism (scan and kv say so). diff says it too,
    before measuring and in summary.json's ``natural_text``; a known text says nothing."""
    from headprobe.commands.diff_core import diff

    unknown = tmp_path / "unknown.txt"
    unknown.write_text(" ".join(f"w{i % 7}" for i in range(3000)), encoding="utf-8")
    a, b = _pair(tiny_tokenizer, 2.0)  # B differs: identical weights are refused first
    capsys.readouterr()
    r = diff(a, b, text=str(unknown), **SMALL, progress=True)
    err = capsys.readouterr().err
    said = [x for x in err.splitlines() if x.startswith("NOTE:") and "unknown to the tokenizer" in x]
    assert len(said) == 1 and err.index(said[0]) < err.index("diff: model A")
    assert r.summary()["natural_text"]["untrusted"] == "100% of the text's tokens are unknown to the tokenizer"
    known = tmp_path / "known.txt"
    known.write_text(" ".join(f"t{i % 97}" for i in range(3000)), encoding="utf-8")
    r = diff(a, b, text=str(known), **SMALL)
    assert (
        r.summary()["natural_text"]["untrusted"] is None and "unknown to the tokenizer" not in capsys.readouterr().err
    )


def test_the_default_sequence_counts_let_a_lone_heads_change_pass_on_smollm2():
    """diff exists to find the heads that changed: with its default --n-natural/--n-repeated (and
    alpha, correction, flips, seed) one head's change over SmolLM2-135M's 270 heads can pass BH, which
    it could not at the shared default 8 (43 heads had to change as much); the detection limit is
    analyses.robustness.detection_limit's, itself checked against hand-made differences above."""
    from headprobe.analyses.robustness import detection_limit
    from headprobe.commands.diff import DiffConfig

    cfg = DiffConfig(model="smollm2-135m", b="smollm2-135m")
    for n in (cfg.n_natural, cfg.n_repeated):
        d = detection_limit(n, 30 * 9, cfg.alpha, cfg.correction, cfg.n_perm, cfg.seed)
        assert d["detectable_alone"] and d["heads_needed"] == 1, d
        assert n >= d["sequences_needed_alone"] == 15, d
    # docs/robustness.md: how many of seeds 0-39 let a lone head's change pass (drawn flips from 13 sequences)
    alone = {
        n: sum(detection_limit(n, 270, cfg.alpha, cfg.correction, cfg.n_perm, s)["detectable_alone"] for s in range(40))
        for n in (15, 16, 20)
    }
    assert alone == {15: 23, 16: 33, 20: 40}


def test_the_batch_is_planned_in_the_header_and_what_cannot_fit_is_refused_before_the_run(
    tiny_tokenizer, tmp_path, capsys
):
    """diff prints its plan (the exact sweep's sequences per pass, :func:`sweep_plan` of its larger
    task, checked here by hand) after A loads, and a budget below one forward is refused in one line
    with no --out folder, as ablate's; the Python function refuses it too."""
    import zoo

    from headprobe.analyses.ablation import sweep_plan
    from headprobe.cli import main
    from headprobe.commands.diff_core import diff
    from headprobe.probe.backends.loading import load_model
    from headprobe.probe.core.errors import HeadprobeError

    zoo.save_dir("llama", tiny_tokenizer, tmp_path / "a")
    a = str(tmp_path / "a")
    args = [
        "diff",
        a,
        a,
        "--requantize-b",  # B differs: identical weights are refused first
        "int8",
        "--device",
        "cpu",
        "--seq-len",
        "16",
        "--period",
        "6",
        "--n-natural",
        "4",
        "--n-repeated",
        "4",
    ]
    capsys.readouterr()
    assert main([*args, "--out", str(tmp_path / "o"), "--memory-budget", "64MiB"]) == 0
    out = capsys.readouterr().out
    model = load_model(a, device="cpu", backend="native")
    from headprobe.probe.core import memory

    memory.set_budget("64MiB")
    try:  # the natural task (4 x 16 tokens) is the longer one: its plan is the header's
        want = sweep_plan(model, 4, 16, model.spec.n_layers).line()
    finally:
        memory.set_budget(None)
    assert want in out.splitlines(), out
    code = main([*args, "--out", str(tmp_path / "p"), "--memory-budget", "1KiB"])
    err = capsys.readouterr().err
    errors = [x for x in err.splitlines() if x.startswith("headprobe: error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err and not (tmp_path / "p").exists()
    assert "working memory" in errors[0] and "--memory-budget" in errors[0], errors[0]
    with pytest.raises(HeadprobeError, match="working memory"):
        diff(model, model, requantize_b="int8", seq_len=16, period=6, n_natural=4, n_repeated=4, memory_budget="1KiB")


def _limit(n: int, detectable: bool) -> dict:
    """A detection_limit entry of summary.json as 4 (or 8) sequences and 270 tests give it."""
    return {
        "n_sequences": n,
        "smallest_p": 2 / 2**n,
        "p_needed_every_head": 0.05,
        "detectable": detectable,
        "sequences_needed": 6,
    }


@pytest.mark.figures
def test_a_diff_figure_where_no_head_could_be_boxed_says_so(tmp_path):
    """diff.png of 4 sequences a task showed no boxed head and nothing said why (the terminal said "none could
    be: p >= 0.125 from 4 natural sequences ..."). Its title carries that caveat on a line of its own, inside
    the 300-dpi PNG, drawn from summary.json's detection as scripts/redraw_figures.py redraws it."""
    import json

    import pandas as pd

    from headprobe.analyses import figures
    from headprobe.commands.diff_drawing import redraw

    quantities = {"previous_token": "natural", "induction": "repeated"}
    rng = np.random.default_rng(0)
    pd.DataFrame(
        {"layer": np.repeat(range(3), 4), "head": np.tile(range(4), 3)}
        | {f"{q}_{c}": rng.normal(size=12) for q in quantities for c in ("a", "b", "change")}  # diff.csv's columns
    ).to_csv(tmp_path / "diff.csv", index=False)
    summary = {
        "model": "a",
        "model_b": "b",
        "layout": {"n_layers": 3, "n_heads": 4},
        "quantities": {q: {"task": t, "changed": []} for q, t in quantities.items()},
        "top_k": {},
        "flipped": [],
        "detection": {"natural": _limit(4, False), "repeated": _limit(4, False)},
        "config": {"requantize_b": "int3", "correction": "bh", "alpha": 0.05, "min_change": 0.5, "k": 10},
    }
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    fig = redraw(tmp_path)["diff"]
    text = " ".join(fig.get_suptitle().split())  # wrapped to the figure's width
    assert (
        "NO VERDICT: no head could be boxed (p >= 0.125 from 4 sequences, Benjamini-Hochberg needs <= 0.05)" in text
    ), text
    fig.set_dpi(figures.SAVE_DPI)
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig).draw()
    box = fig._suptitle.get_window_extent(fig.canvas.get_renderer())
    assert 0 <= box.x0 and box.x1 <= fig.bbox.width and box.y1 <= fig.bbox.height
    summary["detection"] = {"natural": _limit(8, True), "repeated": _limit(8, True)}  # boxes possible: no caveat
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    assert "NO VERDICT" not in redraw(tmp_path)["diff"].get_suptitle()


def test_the_no_box_caveat_names_the_tasks_it_covers():
    """Where only one task's panels cannot be boxed, the caveat says which sequences; different counts are each
    named; every task detectable: no caveat."""
    from headprobe.commands.diff_drawing import no_box_caveat

    both = {"natural": _limit(4, False), "repeated": _limit(5, False)}
    assert no_box_caveat(both, ["natural", "repeated", "natural"], "bh") == (
        "NO VERDICT: no head could be boxed (p >= 0.0625 from 4 natural, 5 repeated sequences, bh needs <= 0.05)"
    )
    one = {"natural": _limit(4, False), "repeated": _limit(8, True)}
    assert no_box_caveat(one, ["natural", "repeated"], "holm").startswith(
        "NO VERDICT for natural sequences: no head could be boxed (p >= 0.125 from 4 sequences, holm"
    )
    assert no_box_caveat(one, ["repeated"], "bh") == ""


def test_the_diff_title_names_the_correction_and_the_top_k_as_the_other_figures_do():
    """diff.png's title read "bh over heads" and "crossed the top-k boundary" beside "top-10 membership";
    the scan's overview and ablation figures name Benjamini-Hochberg in full. The title names the
    correction (Benjamini-Hochberg, Holm) and the run's k, and no bare "bh" or "top-k" is left."""
    import re

    from headprobe.commands.diff_drawing import figure_title

    for correction, name in (("bh", "Benjamini-Hochberg"), ("holm", "Holm")):
        title = figure_title("a", "b", "int3", correction, 0.05, 0.5, 10)
        assert f"{name} over heads at alpha 0.05" in title, title
        assert "top-10 membership" in title and "crossed the top-10 boundary" in title, title
        assert not re.search(r"\bbh\b|top-k", title), title


def _hf_own_change(hf_a, hf_b) -> np.ndarray:
    """The reference: each head's ||dW|| / ||W_A|| over its q rows (+ q bias), its KV head's k and v rows
    (+ biases) and its o_proj columns, looped head by head on the raw Hugging Face weights."""
    hf_a, hf_b = hf_a.requires_grad_(False), hf_b.requires_grad_(False)
    cfg = hf_a.config
    n, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // n
    out = np.zeros((cfg.num_hidden_layers, n))
    for layer in range(cfg.num_hidden_layers):
        ma, mb = hf_a.model.layers[layer].self_attn, hf_b.model.layers[layer].self_attn
        for h in range(n):
            g = h // (n // kv)
            num = den = 0.0
            for name, rows in (("q_proj", h), ("k_proj", g), ("v_proj", g), ("o_proj", None)):
                pa, pb = getattr(ma, name), getattr(mb, name)
                wa = pa.weight[:, h * d : (h + 1) * d] if rows is None else pa.weight[rows * d : (rows + 1) * d]
                wb = pb.weight[:, h * d : (h + 1) * d] if rows is None else pb.weight[rows * d : (rows + 1) * d]
                parts = [(wa, wb)]
                if rows is not None and pa.bias is not None:
                    parts.append((pa.bias[rows * d : (rows + 1) * d], pb.bias[rows * d : (rows + 1) * d]))
                for x, y in parts:
                    num += float(((y.double() - x.double()) ** 2).sum())
                    den += float((x.double() ** 2).sum())
            out[layer, h] = np.sqrt(num / den)
    return out


@pytest.fixture(scope="module")
def zeroed_pair(tiny_tokenizer):
    """The tiny Qwen2 (GQA, q/k/v biases) and a copy with head 1.2's W_O slice (o_proj's columns) zeroed."""
    import zoo

    from headprobe.probe.backends.wrapping import wrap

    a, b = zoo.make_checkpoint("qwen2", tiny_tokenizer), zoo.make_checkpoint("qwen2", tiny_tokenizer)
    cfg = b.hf_model.config
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    with torch.no_grad():
        b.hf_model.model.layers[PLANTED[0]].self_attn.o_proj.weight[:, PLANTED[1] * d : (PLANTED[1] + 1) * d] = 0
    return a, b, wrap(a, backend="native"), wrap(b, backend="native")


def test_own_change_is_nonzero_for_exactly_the_edited_head_and_matches_the_raw_weights(zeroed_pair, tiny_tokenizer):
    """diff's ablation effects are total effects (a downstream head's change moves them), so they
    named untouched layer-0 heads and missed the edited ones; own_change reads the head's own slices."""
    from headprobe.analyses.own_weights import own_change_line, own_weight_change

    ca, cb, a, b = zeroed_pair
    assert ca.hf_model.model.layers[0].self_attn.q_proj.bias is not None  # biases are in the comparison
    own = own_weight_change(a, b)
    ref = _hf_own_change(ca.hf_model, cb.hf_model)
    np.testing.assert_allclose(own["own_change"], ref, rtol=1e-9, atol=0)
    nonzero = {(int(x), int(y)) for x, y in zip(*np.nonzero(own["own_change"]))}
    assert nonzero == {PLANTED} and own["W_O"][PLANTED] == 1.0 and own["W_O_norm_ratio"][PLANTED] == 0.0
    assert np.count_nonzero(own["own_change"] == 0.0) == own["own_change"].size - 1
    line = own_change_line(own)
    assert "1 of " in line and "identical" in line and "1.2 " in line and "(W_O -100%)" in line
    # a bias-only edit of a shared KV head counts, whole, for each query head reading it
    import zoo

    from headprobe.probe.backends.wrapping import wrap

    cc = zoo.make_checkpoint("qwen2", tiny_tokenizer)
    with torch.no_grad():
        cc.hf_model.model.layers[0].self_attn.k_proj.bias[:1] += 1.0
    own = own_weight_change(a, wrap(cc, backend="native"))
    np.testing.assert_allclose(own["own_change"], _hf_own_change(ca.hf_model, cc.hf_model), rtol=1e-9, atol=0)
    group = a.spec.n_heads // a.spec.n_kv_heads
    assert (own["own_change"][0, :group] > 0).all() and (own["own_change"][0, group:] == 0).all()
    assert (own["own_change"][1:] == 0).all()


def test_diff_reports_own_change_in_its_table_report_and_summary(zeroed_pair, text_file, tmp_path):
    import json

    from headprobe.commands.diff_core import diff

    *_, a, b = zeroed_pair
    r = diff(a, b, text=str(text_file), **SMALL)
    row = r.table.set_index(["layer", "head"])
    assert row.loc[PLANTED, "own_change"] > 0 and row.loc[PLANTED, "own_change_W_O"] == 1.0
    assert (row.drop(index=[PLANTED])["own_change"] == 0).all()
    assert "own weights changed: 1 of" in r.report() and "1.2 " in r.report()
    r.save(tmp_path / "o")
    s = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert [c["head"] for c in s["own_weights"]["changed"]] == ["1.2"]
    assert s["own_weights"]["identical"] == a.spec.n_layers * a.spec.n_heads - 1
    assert "total effect" in s["own_weights"]["rule"] and "uniform_baselines" in s and "not_roles" in s
    q = diff(a, a, text=str(text_file), requantize_b="int4", **SMALL)  # every head changes a little
    assert (q.table["own_change"] > 0).all() and (q.table["own_change"] < 0.5).all()
    text = repr(q)
    assert f"B = {a.spec.name} re-quantized to int4 (a copy" in text, text


def test_a_top_k_crossing_at_or_below_a_uniform_heads_score_is_not_a_role():
    """qwen-a vs its fine-tune reported duplicate-token flips of heads scoring about what a head
    attending uniformly scores; the scan's rule (analyses.verdicts.uniform_baselines) now decides."""
    from headprobe.commands.diff_stats import role_changes

    base = 0.0136
    a = np.array([[0.010, 0.030, 0.005, 0.004]])
    b = np.array([[0.013, 0.001, 0.016, 0.004]])  # 0.0 enters at 0.013 <= base; 0.2 enters at 0.016 > base
    test = {"change": b - a, "p_adjusted": np.full(a.shape, 0.001)}
    top = {"duplicate_token": {"A": [(0, 1)], "B": [(0, 0), (0, 2)]}}
    means = {"A": {"duplicate_token": a}, "B": {"duplicate_token": b}}
    flipped, low = role_changes({"duplicate_token": test}, means, top, 0.05, 0.0, {"duplicate_token": base})
    assert [f["head"] for f in flipped] == ["0.1", "0.2"] and [f["head"] for f in low] == ["0.0"]
    assert "at or below 0.0136" in low[0]["why"][0] and "1.18x" in flipped[1]["why"][0]
    assert [f["head"] for f in role_changes({"duplicate_token": test}, means, top, 0.05, 0.0, {})[0]] == [
        "0.0",
        "0.1",
        "0.2",
    ]


@pytest.mark.figures
def test_diff_panels_share_the_quantitys_scale_say_when_nothing_changed_and_stay_on_the_page():
    """Each panel auto-scaled to its largest change, so a 0.001 score change was as dark as a 0.08
    ablation change; a panel with no boxed head said nothing; a long title left the page."""
    from headprobe.commands.diff_drawing import draw_diff

    n = np.zeros((3, 4))
    small, big = n.copy(), n.copy()
    small[2, 1], big[0, 1] = 0.001, 0.08
    boxed = n.astype(bool).copy()
    boxed_big = boxed.copy()
    boxed_big[0, 1] = True
    fig = draw_diff(
        {"induction": small, "ablation_repeated": big},
        {"induction": boxed, "ablation_repeated": boxed_big},
        {},
        "t",
        [],
        2,
        {"induction": 0.025, "ablation_repeated": 0.3},
        0.5,
    )
    fig.draw_without_rendering()
    axes = [ax for ax in fig.axes if ax.images]
    assert [ax.images[0].get_clim() for ax in axes] == [(-0.025, 0.025), (-0.3, 0.3)]
    said = [ax.get_title().replace("\n", " ") for ax in axes]  # under the panel's title, over no cell
    assert said[0].endswith("(no head changed significantly by >= 0.5 sd)") and "no head changed" not in said[1], said
    assert not [t for ax in axes for t in ax.texts]
    width = fig.get_figwidth() * fig.dpi
    for ax in axes:
        box = ax.title.get_window_extent()
        assert box.x0 >= 0 and box.x1 <= width, (ax.get_title(), box)
