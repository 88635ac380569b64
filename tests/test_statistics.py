"""Verdicts with statistics: batched control ablations equal one forward per set, t intervals
agree with scipy's and cover as stated, and a text the model cannot read gets a warning
and no verdict."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from headprobe.analyses.ablation import (
    head_ablation_hooks,
    scored_loss,
    set_ablation_losses,
    untrusted_task_reason,
)
from headprobe.analyses.statistics import mean_ci
from headprobe.commands.scan import ScanConfig, run


@pytest.mark.parametrize("fixture", ["tiny_llama_gqa_native", "tiny_gpt2"])
@pytest.mark.parametrize("kind", ["zero", "mean"])
def test_batched_set_ablations_equal_one_forward_per_set(fixture, kind, request):
    model = request.getfixturevalue(fixture)
    spec = model.spec
    tokens = torch.randint(0, 100, (3, 12), generator=torch.Generator().manual_seed(1))
    mean_z = torch.randn(spec.n_layers, spec.n_heads, spec.d_head, generator=torch.Generator().manual_seed(2))
    from headprobe.analyses.verification import uniform_sets

    heads = [(l, h) for l in range(spec.n_layers) for h in range(spec.n_heads)]
    sets = uniform_sets(3, heads, 5, torch.Generator().manual_seed(0)) + [[(0, 1), (1, 1)], []]
    # max_batch 6: two sets per pass, so the last pass holds one set (uneven chunks are covered)
    got = set_ablation_losses(model, tokens, sets, kind, mean_z if kind == "mean" else None, first=2, max_batch=6)
    ref = torch.stack(
        [scored_loss(model.forward(tokens, fwd_hooks=head_ablation_hooks(s, kind, mean_z)), tokens, 2) for s in sets]
    )
    assert got.shape == (len(sets), 3)
    torch.testing.assert_close(got, ref.float().cpu(), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got[0], got[-1])  # an ablation changes the loss: the hooks did act


def test_mean_interval_equals_scipys_t_interval_per_column():
    from scipy import stats

    rng = np.random.default_rng(0)
    x = rng.normal(0.3, 1.0, size=(5, 3))
    x[:, 2] = 0.7  # a constant column: a point interval
    ci = mean_ci(x)
    for j in range(2):
        ref = stats.t.interval(0.95, 4, loc=x[:, j].mean(), scale=stats.sem(x[:, j]))
        np.testing.assert_allclose(ci[:, j], ref)
    np.testing.assert_allclose(ci[:, 2], [0.7, 0.7])
    assert np.isnan(mean_ci(x[:1])).all()  # one sequence: no interval


@pytest.mark.parametrize("n", [2, 3, 8])
def test_interval_covers_the_mean_95_percent_of_the_time(n):
    """Coverage by simulation on normal per-sequence values: the stated 95% at every n (the
    percentile bootstrap it replaced covered 0.51 at n = 2, 0.74 at n = 3, 0.88 at n = 8)."""
    rng = np.random.default_rng(n)
    x = rng.normal(1.0, 2.0, size=(n, 20000))  # 20,000 samples of n sequences, one per column
    lo, hi = mean_ci(x)
    coverage = float(np.mean((lo <= 1.0) & (1.0 <= hi)))
    assert 0.94 <= coverage <= 0.96, coverage  # binomial sd of the estimate: 0.0015


def test_untrusted_task_reasons():
    assert untrusted_task_reason(3.0, 49152) is None
    assert "ln(vocabulary)" in untrusted_task_reason(math.log(64) + 0.1, 64)
    assert "unknown" in untrusted_task_reason(1.0, 64, unknown_share=0.9)


def test_unknown_text_gives_a_warning_and_no_verdict(tiny_llama_gqa, tmp_path):
    """The issue's trap: English text through a tokenizer that knows none of it (every word is the
    unknown token) on a random model (loss near ln(vocabulary)): a warning, verdicts withheld."""
    text = tmp_path / "english.txt"
    text.write_text("The quick brown fox jumps over the lazy dog while reading documentation. " * 60, encoding="utf-8")
    cfg = ScanConfig(model="tiny", n_natural=3, seq_len=16, n_repeated=3, period=6, k=2, n_random=4, text=str(text))
    result = run(tiny_llama_gqa, cfg, progress=False)
    # the natural task's warning, as fields: the report and the figures' caveat select by them
    (warned,) = [w for w in result.warnings if (w.kind, w.task) == ("task", "natural")]
    assert "unknown to the tokenizer" in warned.reason
    natural = [v for v in result.verifications if v.task == "natural"]
    assert natural and all(v.confirmed is None and v.verdict == "no verdict" and v.no_verdict for v in natural)
    summary = json.loads(json.dumps(result.summary()))
    assert summary["warnings"] == [str(w) for w in result.warnings]  # the lines, as before
    assert summary["warnings"][0].startswith("natural task: ")
    assert all(a["confirmed"] is None for a in summary["ablations"] if a["task"] == "natural")
    report = result.report()
    assert "WARNING" in report and not [line for line in report.splitlines() if line.rstrip().endswith("CONFIRMED")]
    assert any(line.rstrip().endswith("no verdict") for line in report.splitlines())
    # the figures carry the warning too (they are shared without the terminal output)
    from headprobe.commands.scan import scan_figures

    figures = scan_figures(result)
    titles = {
        stem: " ".join(t.get_text() for ax in f.axes for t in (ax.title,))
        + (f._suptitle.get_text() if f._suptitle else "")
        for stem, f in figures.items()
    }
    assert all("NO VERDICT" in t for t in titles.values()), titles  # the caveat: one line, see no_verdict_caveat


def test_verdicts_carry_p_values_and_intervals(tiny_llama_gqa, tmp_path):
    g = torch.Generator().manual_seed(0)
    text = tmp_path / "words.txt"
    text.write_text(" ".join(f"t{i}" for i in torch.randint(0, 100, (2000,), generator=g).tolist()), encoding="utf-8")
    cfg = ScanConfig(model="tiny", n_natural=4, seq_len=16, n_repeated=4, period=6, k=2, n_random=6, text=str(text))
    result = run(tiny_llama_gqa, cfg, progress=False)
    from headprobe.analyses.statistics import besag_clifford_h, sequential_mc_p_value

    for v in result.verifications:
        lo, hi = v.top_effect_ci95
        assert lo <= v.top_effect <= hi
        reached = [r >= v.top_effect - 1e-5 for r in v.random_effects]
        if v.kind == "mean":  # the tested kind: Besag & Clifford's sequential p-value over the draws it made
            assert v.p_value == sequential_mc_p_value(reached, 6, besag_clifford_h(0.05, 6))[0]
        else:
            assert v.p_value == (1 + sum(reached)) / (1 + len(reached))
        assert not set(v.top_heads) & {h for s in v.random_heads for h in s}
    top = result.summary()["top_heads"]
    assert "score_ci95" in top["induction"][0] and "score_ci95" not in top["positional"][0]
    lo, hi = top["induction"][0]["score_ci95"]
    assert lo <= top["induction"][0]["score"] <= hi


def test_score_ci95_is_clipped_to_the_scores_range():
    """A first-token score near 1 over 4 sequences: its t interval (mean_ci, the reference) passes 1,
    and score_ci95 clips it to [0, 1], the range of a share of attention; an offset (integer column,
    no range) keeps the raw interval. The reviewer's 18.8: 0.9995 with [0.9985, 1.0005]."""
    from headprobe.commands.scan_core import _score_ci95

    per_seq = torch.tensor([0.999, 1.0, 0.9995, 0.9995], dtype=torch.float64).reshape(4, 1, 1)
    offsets = torch.tensor([-1.0, -1.0, -3.0, -5.0], dtype=torch.float64).reshape(4, 1, 1)
    seqs = {"first_token": per_seq, "positional_offset": offsets}
    scores = {c: v.mean(0).numpy() for c, v in seqs.items()}
    raw = mean_ci(per_seq.numpy())[:, 0, 0]
    assert raw[1] > 1.0  # the unclipped interval leaves the range
    ci = _score_ci95(seqs, scores)
    assert ci["first_token"][:, 0, 0].tolist() == [raw[0], 1.0]
    assert ci["positional_offset"][:, 0, 0].tolist() == mean_ci(offsets.numpy())[:, 0, 0].tolist()


def test_besag_clifford_h_is_exact_at_every_decimal_level():
    """``h = floor(alpha n) + 1`` against ``fractions.Fraction`` over alpha in 0.001..0.499 (step
    0.001) and n in 5..2000: in floating point 0.072 * 375 = 26.999999999999996 gave h one too small."""
    from fractions import Fraction

    from headprobe.analyses.statistics import besag_clifford_h, lone_draws_needed
    from headprobe.analyses.vocabulary import reachable

    ns = np.arange(5, 2001)
    wrong = []
    for i in range(1, 500):
        alpha = i / 1000  # the float the user's "0.072" parses to
        a = Fraction(str(alpha))
        got = np.array([besag_clifford_h(alpha, n) for n in ns.tolist()])
        wrong += [(alpha, int(n)) for n in ns[got != a.numerator * ns // a.denominator + 1]]
    assert not wrong, f"{len(wrong)} (alpha, n) pairs with h off, first {wrong[:3]}"
    # the other rules that compare draws with alpha: 1/(n+1) <= alpha, and n >= m/alpha - 1
    assert reachable(19, 0.05) and not reachable(18, 0.05) and reachable(999, 0.001) and not reachable(998, 0.001)
    for i in (1, 7, 50, 72, 123, 499):
        alpha, a = i / 1000, Fraction(i, 1000)
        for m in (1, 2, 3, 7):
            n = lone_draws_needed(m, alpha)
            assert Fraction(1, n + 1) <= a / m and (n == 1 or Fraction(1, n) > a / m), (alpha, m, n)


def test_the_draws_advice_gives_the_numbers_each_correction_needs():
    """The quick scan's first note said "use --n-random 19 or more; 99 or more for one verdict on its own" and its
    later lines "(use --n-random 99 or more)"; under Holm 19 confirms nothing of five. Now one form, whose numbers
    are the fewest draws with which the corrected smallest p-values (``adjust_p_values``, the reference) reject
    all m tests together and one test alone; the plan says it in one line, not one per type."""
    from headprobe.analyses import statistics as st
    from headprobe.analyses.vocabulary import unreachable_note

    def fewest(m: int, correction: str, alone: bool) -> int:
        for n in range(1, 1000):
            p = [1 / (n + 1)] + [1.0 if alone else 1 / (n + 1)] * (m - 1)
            if st.adjust_p_values(p, correction)[0] <= 0.05 * (1 + 1e-12):
                return n
        raise AssertionError

    bh = unreachable_note(10, 0.05, 5, "bh")
    together, lone = fewest(5, "bh", False), fewest(5, "bh", True)
    assert (together, lone) == (19, 99)
    assert f"use --n-random {together} or more, enough under bh when the 5 tests are CONFIRMED together" in bh, bh
    assert f"{lone} or more for one verdict on its own (p <= 0.05/5)" in bh, bh
    holm = unreachable_note(19, 0.05, 5, "holm")  # 19 draws reach 0.05, but Holm compares the first with 0.05/5
    assert holm is not None and fewest(5, "holm", False) == fewest(5, "holm", True) == 99
    assert "use --n-random 99 or more (holm compares the smallest p with 0.05/5)" in holm and "19 or more" not in holm
    assert unreachable_note(10, 0.05, 1, "bh").endswith("use --n-random 19 or more (p <= 0.05)")
    assert unreachable_note(99, 0.05, 5, "holm") is None and unreachable_note(19, 0.05, 5, "bh") is None

    from headprobe.analyses.verification import plan_lines, short_draws

    def plan(control_sets: int) -> dict:
        test = {"head_type": "induction", "confirmable": "never", "control_sets": control_sets, "capped": False}
        return {
            "family_size": 5, "lone_draws_needed": 99, "n_random": 10, "family": ["induction"] * 5,
            "correction": "bh", "alpha": 0.05, "raised": False, "kept": True, "n_random_requested": 10,
            "max_sets": 2, "tests": [test] * 5,
        }  # fmt: skip

    lines = plan_lines(plan(10))
    assert short_draws(plan(10)) and lines[1:] == [f"NOTE: {bh}"], lines
    few = plan_lines(plan(3))  # fewer distinct sets than asked: each test's own reason, per type
    assert not short_draws(plan(3)) and len(few) == 6 and all("only 3 distinct" in ln for ln in few[1:]), few
