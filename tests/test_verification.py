"""The verdict's statistics. The sequential Monte Carlo p-value against its closed-form
null distribution, layer matching on the drawn sets, the corrections against hand-computed
examples, and the verification's stopping, reachability and bookkeeping on a tiny model."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from headprobe.analyses import statistics as st
from headprobe.analyses.ablation import Verification
from headprobe.analyses.verification import (
    BATCH,
    SECONDARY_DRAWS,
    VerificationSettings,
    effect_is_large,
    layer_matched_sets,
    uniform_sets,
    unreachable_note,
)
from headprobe.options import in_python
from headprobe.probe.core.errors import HeadprobeError


def test_sequential_p_value_by_hand():
    assert st.besag_clifford_h(0.05, 50) == 3 and st.besag_clifford_h(0.1, 10) == 2
    assert st.sequential_mc_p_value([False] * 50, 50, 3) == (1 / 51, 50)  # nothing reached it: the floor
    assert st.sequential_mc_p_value([True, False, True, True], 50, 3) == (3 / 4, 4)  # h-th reaching draw is draw 4
    assert st.sequential_mc_p_value([False] * 48 + [True, True], 50, 3) == (3 / 51, 50)  # g = 2 < h at the end
    with pytest.raises(ValueError, match="not ended"):
        st.sequential_mc_p_value([False] * 10, 50, 3)


@pytest.mark.parametrize("n_max, alpha", [(30, 0.05), (50, 0.05), (10, 0.1)])
def test_sequential_p_value_matches_its_closed_form_null_distribution(n_max, alpha):
    """Simulate the test under the null (top effect and draws i.i.d.; each test's n_max draws made
    up front, so the sample does not depend on the batch) fed in batches of BATCH, as the
    verification runs it, and compare P(p <= u) with the closed form at every value p takes; the
    closed form itself never exceeds u (a valid p-value)."""
    rng = np.random.default_rng(0)
    n_sim = 6000
    ps, draws = [], []
    for _ in range(n_sim):
        test = st.SequentialMCTest(rng.random(), n_max, alpha)
        sample = rng.random(n_max)
        while not test.done:
            test.add(sample[len(test.draws) : len(test.draws) + BATCH])
        ps.append(test.p_value())
        draws.append(len(test.draws))
    ps = np.array(ps)
    h = st.besag_clifford_h(alpha, n_max)
    support = sorted(set(ps))
    for u in support:
        exact = st.sequential_mc_null_cdf(u, n_max, h)
        assert exact <= u + 1e-12, (u, exact)
        se = np.sqrt(exact * (1 - exact) / n_sim)
        assert abs((ps <= u + 1e-15).mean() - exact) <= 4 * se + 1e-9, (u, (ps <= u).mean(), exact)
    if n_max > 10:  # a test of 10 draws at alpha 0.1 (h = 2) has little room to stop early
        assert np.mean(draws) < n_max / 2  # under the null most tests stop early
    # the comparison can fail: an off-by-one p-value (h / (L + 1)) does not match the closed form
    wrong = np.where(ps < 1, ps * 0.8, ps)
    assert any(abs((wrong <= u).mean() - st.sequential_mc_null_cdf(u, n_max, h)) > 0.01 for u in support)


def test_the_curtailed_p_value_is_the_largest_any_continuation_gives():
    """Sequential_mc_p_bound against a brute force over every continuation of every prefix."""
    import itertools

    n_max, h = 7, 3
    for L in range(n_max):
        for prefix in itertools.product([False, True], repeat=L):
            if sum(prefix) >= h:
                continue
            finals = [
                st.sequential_mc_p_value(list(prefix) + list(rest), n_max, h)[0]
                for rest in itertools.product([False, True], repeat=n_max - L)
            ]
            assert st.sequential_mc_p_bound(list(prefix), n_max, h) == pytest.approx(max(finals))
            assert st.sequential_mc_best_p(list(prefix), n_max, h) == pytest.approx(min(finals))


def _null_distribution(rule, n_max, h, batch, naive=False):
    """Every draw order under the null, exactly: the observed effect's rank among the n_max + 1 values
    is uniform, so g reaching draws (uniform on 0..n_max) sit in a uniformly chosen subset. Run in
    batches; after each batch the test ends (h reached, or n_max), or ``rule(prefix)`` curtails it.
    Returns {p: probability}."""
    import itertools
    from math import comb

    dist: dict[float, float] = {}
    for seq in itertools.product([False, True], repeat=n_max):
        prob = 1 / ((n_max + 1) * comb(n_max, sum(seq)))
        for L in range(batch, n_max + batch, batch):
            prefix = list(seq[: min(L, n_max)])
            if sum(prefix) >= h or len(prefix) == n_max:
                p = st.sequential_mc_p_value(prefix, n_max, h)[0]
                break
            if rule(prefix):
                p = (sum(prefix) + 1) / (len(prefix) + 1) if naive else st.sequential_mc_p_bound(prefix, n_max, h)
                break
        dist[p] = dist.get(p, 0.0) + prob
    return dist


@pytest.mark.parametrize(
    "rule, naive_fails",
    [
        (
            lambda pre: len(pre) == 2 and sum(pre) == 0,
            True,
        ),  # curtails a test that looks good: the naive p's worst case
        (lambda pre: sum(pre) >= 1, False),  # curtails one that looks bad (as the verification does)
        (lambda pre: hash(tuple(pre)) % 3 == 0, False),  # any rule at all
    ],
)
def test_a_curtailed_test_keeps_a_valid_p_value_under_any_curtailing_rule(rule, naive_fails):
    n_max, h, batch = 10, 2, 2
    dist = _null_distribution(rule, n_max, h, batch)
    assert sum(dist.values()) == pytest.approx(1.0)
    for u in sorted(dist):
        assert sum(q for p, q in dist.items() if p <= u + 1e-12) <= u + 1e-12, u
    if naive_fails:  # the check can fail: the naive (g + 1) / (L + 1) is not a valid p-value under this rule
        naive = _null_distribution(rule, n_max, h, batch, naive=True)
        assert any(sum(q for p, q in naive.items() if p <= u + 1e-12) > u + 1e-9 for u in naive)


def _run_family(effects, observed, n_max, alpha, batch, curtail, threshold=None):
    """The verification's loop on precomputed control effects: each test's draws in batches, then
    (``curtail``) statistics.unwinnable over the family. Returns (rejected, draws per test)."""
    tests = [st.SequentialMCTest(o, n_max, alpha) for o in observed]
    while not all(t.done for t in tests):
        for t, e in zip(tests, effects):
            if not t.done:
                t.add(e[len(t.draws) : len(t.draws) + batch])
        if curtail:
            best = [t.best_p for t in tests]
            for i in st.unwinnable(best, [not t.done for t in tests], "bh", alpha if threshold is None else threshold):
                tests[i].curtail()
    adjusted = st.adjust_p_values([t.p_value() for t in tests], "bh")
    return [bool(a <= alpha + 1e-12) for a in adjusted], [len(t.draws) for t in tests]


def test_curtailment_changes_no_verdict_and_saves_draws():
    """Families of five tests (effects a mix of null and shifted), each run to the end and with
    curtailment on the same draws: the same rejections every time; curtailment stops tests early;
    and a wrong curtailment (at alpha / 2) changes verdicts, so the comparison can fail."""
    rng = np.random.default_rng(1)
    n_max, alpha, batch = 50, 0.05, 10
    saved, wrong_differs = 0, 0
    for _ in range(300):
        shift = rng.choice([0.0, 1.5, 2.5, 3.5], size=5)
        effects = rng.standard_normal((5, n_max))
        observed = rng.standard_normal(5) + shift
        full, d_full = _run_family(effects, observed, n_max, alpha, batch, curtail=False)
        cut, d_cut = _run_family(effects, observed, n_max, alpha, batch, curtail=True)
        assert full == cut
        saved += sum(d_full) - sum(d_cut)
        wrong, _ = _run_family(effects, observed, n_max, alpha, batch, curtail=True, threshold=alpha / 2)
        wrong_differs += wrong != full
    assert saved > 0 and wrong_differs > 0


def test_a_fixed_size_test_is_the_plain_monte_carlo_p_value():
    test = st.SequentialMCTest(0.5, 20, 0.05, sequential=False)
    test.add([0.9, 0.8, 0.7] + [0.1] * 17)
    assert test.done and not test.stopped and test.p_value() == pytest.approx(4 / 21)


def test_corrections_against_hand_computed_examples():
    p = [0.01, 0.04, 0.03, 0.5]
    # BH: sorted 0.01, 0.03, 0.04, 0.5 times m/rank = 0.04, 0.06, 0.0533, 0.5; then running minimum from the top
    np.testing.assert_allclose(st.adjust_p_values(p, "bh"), [0.04, 0.16 / 3, 0.16 / 3, 0.5])
    # Holm: sorted times (m - rank + 1) = 0.04, 0.09, 0.08, 0.5; then running maximum from the bottom
    np.testing.assert_allclose(st.adjust_p_values(p, "holm"), [0.04, 0.09, 0.09, 0.5])
    with pytest.raises(ValueError):
        st.adjust_p_values(p, "bonferonni")


def test_layer_matched_sets_have_the_top_sets_layer_counts():
    top = [(17, 3), (17, 4), (18, 6), (18, 7), (20, 6)]
    heads = [(l, h) for l in range(30) for h in range(9)]
    avail = [x for x in heads if x not in top]
    sets, note = layer_matched_sets(top, avail, 30, 40, torch.Generator().manual_seed(0))
    assert note is None and len(sets) == 40 and len({tuple(s) for s in sets}) == 40  # no set drawn twice
    for s in sets:
        assert sorted(l for l, _ in s) == [17, 17, 18, 18, 20] and not set(s) & set(top) and len(set(s)) == 5
    # a layer with too few heads outside the top-k: its shortfall comes from the nearest layer, and the note says so
    tiny = [(l, h) for l in range(3) for h in range(4)]
    top = [(1, 0), (1, 1), (1, 2)]
    avail = [x for x in tiny if x not in top and x != (1, 3)]
    sets, note = layer_matched_sets(top, avail, 3, 20, torch.Generator().manual_seed(0))
    assert note and "layer 1" in note
    assert all(len(s) == 3 and not set(s) & set(top) and (1, 3) not in s for s in sets)
    with pytest.raises(HeadprobeError, match="needs 3 heads"):
        layer_matched_sets(top, [(0, 0), (0, 1)], 3, 1, torch.Generator())
    u = uniform_sets(3, avail, 50, torch.Generator().manual_seed(1))
    assert len({h for s in u for h in s}) == len(avail)  # uniform draws reach every available head


def test_control_sets_are_distinct_and_every_one_where_few_exist():
    """A p-value (g + 1) / (n + 1) counts each control set as one more comparison: a set drawn twice
    is one comparison counted twice. Where k heads outside the top-k leave one possible layer-matched
    set (layer 0 of 4 heads, 2 under test, 2 left), the stream is that one set, not 50 copies of it
    (its p can then be no smaller than 1/2); where few exist, every one of them, in a random order;
    where many, n distinct draws. The same for uniform sets."""
    import itertools

    from headprobe.analyses.verification import ENUMERATE_BELOW

    gen = torch.Generator().manual_seed(0)
    heads = [(0, h) for h in range(4)]
    sets, _ = layer_matched_sets([(0, 0), (0, 1)], heads[2:], 1, 50, gen)
    assert sets == [[(0, 2), (0, 3)]]
    # two layers of 6 heads, 2 under test in each: C(4, 2)^2 = 36 < 4 x 50 possible sets, all of them
    heads = [(l, h) for l in range(2) for h in range(6)]
    top = [(0, 0), (0, 1), (1, 0), (1, 1)]
    avail = [x for x in heads if x not in top]
    sets, _ = layer_matched_sets(top, avail, 2, 50, gen)
    every = {
        tuple(sorted(a + b)) for a in itertools.combinations(avail[:4], 2) for b in itertools.combinations(avail[4:], 2)
    }
    assert len(sets) == 36 and {tuple(s) for s in sets} == every
    assert sets != sorted(sets)  # in a random order: the first sets of a stream are a random sample
    sets, _ = layer_matched_sets(top, avail, 2, 5, gen)  # 36 >= 4 x 5: drawn, repeats skipped
    assert len(sets) == 5 and len({tuple(s) for s in sets}) == 5 and 36 >= ENUMERATE_BELOW * 5
    sets, _ = layer_matched_sets(top, avail, 2, 10, gen)  # 36 < 40: enumerated, cut to 10
    assert len(sets) == 10 and len({tuple(s) for s in sets}) == 10 and {tuple(s) for s in sets} <= every
    u = uniform_sets(2, avail[:4], 50, gen)  # C(4, 2) = 6 sets of 2
    assert sorted(map(tuple, u)) == sorted(itertools.combinations(avail[:4], 2))


def test_a_test_with_few_distinct_control_sets_is_exact_and_says_so(tiny_llama_gqa, text_file):
    """K = 8 of the tiny model's 16 heads: few layer-matched sets of 8 exist among the other 8
    (C(8 - a, ...) per layer), so each stream holds every distinct set, no set twice, and the
    notes say how many; a test whose sets cannot give p <= alpha is not CONFIRMED."""
    result = _scan(tiny_llama_gqa, text_file, n_random=30, k=8, types="induction", sequential=False)
    (v,) = [v for v in result.verifications if v.kind == "mean"]
    assert len({tuple(s) for s in v.random_heads}) == len(v.random_heads) == v.draws < 30
    assert any(f"only {v.draws} distinct layer-matched control set" in n for n in result.verification["notes"])
    assert v.p_value >= 1 / (v.draws + 1) - 1e-12
    if 1 / (v.draws + 1) > 0.05:
        assert v.confirmed is not True


def test_settings_reachability_and_effect_rule():
    assert not VerificationSettings(k=3, n_random=10).reachable
    note = unreachable_note(VerificationSettings(k=3, n_random=10))
    assert "no verdict can be CONFIRMED" in note and "--n-random 19" in note
    # scan's first note said 19 where the plan's later lines said 39 (two types under BH): it gives both, each
    # explained; it is now said once, by the plan, which knows the family (tests/test_statistics.py checks it)
    from headprobe.analyses import statistics, vocabulary

    both = vocabulary.unreachable_note(10, 0.05, 2, "bh")
    lone = statistics.lone_draws_needed(2, 0.05)
    assert lone == 39 and both.endswith(
        "use --n-random 19 or more, enough under bh when the 2 tests are CONFIRMED together (each p <= 0.05); "
        f"{lone} or more for one verdict on its own (p <= 0.05/2)"
    )
    assert vocabulary.unreachable_note(10, 0.05, 1, "bh").endswith("use --n-random 19 or more (p <= 0.05)")
    assert (
        VerificationSettings(k=3, n_random=10, alpha=0.1).reachable and VerificationSettings(k=3, n_random=19).reachable
    )
    for bad in ({"alpha": 0.0}, {"alpha": 1.5}, {"control": "matched"}, {"correction": "fdr"}):
        with pytest.raises(HeadprobeError):
            VerificationSettings(k=3, **bad)
    assert effect_is_large(1.0, [0.1, 0.4], 0.05) and not effect_is_large(1.0, [0.6, 0.5], 0.05)
    assert not effect_is_large(0.04, [0.0], 0.05)


def _scan(model, text, **kw):
    from headprobe.commands.scan import ScanConfig, run

    kw = {"n_natural": 4, "seq_len": 24, "n_repeated": 3, "period": 8, "k": 3, "metrics": False, "pattern_len": 0, **kw}
    cfg = ScanConfig(model="tiny", text=str(text), **kw)
    return run(model, cfg, progress=False)


def test_scan_records_the_design_and_stops_settled_tests_early(tiny_llama_gqa, text_file):
    seq = _scan(tiny_llama_gqa, text_file, n_random=30)
    fixed = _scan(tiny_llama_gqa, text_file, n_random=30, sequential=False)
    summary = json.loads(json.dumps(seq.summary()))
    for a in summary["ablations"]:
        for key in ("alpha", "p_value", "p_adjusted", "draws", "control", "correction"):
            assert key in a, key
        assert a["control"] == "layer-matched" and a["alpha"] == 0.05
        assert len(a["random_effects"]) == a["draws"] == len(a["random_heads"])
    tested = [v for v in seq.verifications if v.tested]
    assert {v.kind for v in tested} == {"mean"} and all(v.correction == "bh" for v in tested)
    np.testing.assert_allclose([v.p_adjusted for v in tested], st.adjust_p_values([v.p_value for v in tested], "bh"))
    # a random model: every top-k set is beaten by draws, so every sequential test stops early, a stop
    # for futility at the very draw that settles it (the h-th reaching one; draw by draw: BATCH == 1)
    h = st.besag_clifford_h(0.05, 30)
    for v in (v for v in seq.verifications if v.kind == "mean"):
        assert v.stop_reason in ("settled above alpha", "futile under the correction") and v.draws < 30, v.head_type
        reached = [e >= v.top_effect - 1e-5 for e in v.random_effects]
        assert v.exceedances == sum(reached) >= 1 and v.p_value_is_bound == (v.stop_reason != "settled above alpha")
        assert v.p_value_is_bound or (sum(reached) == h and reached[-1] and BATCH == 1), (v.head_type, reached)
    # the untested kind: its first SECONDARY_DRAWS sets, whenever the tested one stopped
    assert all(v.draws == SECONDARY_DRAWS for v in seq.verifications if v.kind == "zero")
    for v in fixed.verifications:  # distinct sets: 30, or every one where this 16-head model allows fewer (noted)
        assert len({tuple(s) for s in v.random_heads}) == len(v.random_heads) == v.draws
        assert v.draws == 30 or any(f"only {v.draws} distinct" in n for n in fixed.verification["notes"]), v.head_type
    assert seq.verification["sets_ablated"] < fixed.verification["sets_ablated"] / 2
    assert [v.confirmed for v in seq.verifications] == [v.confirmed for v in fixed.verifications]
    # the first batch is the same sets either way
    assert all(
        a.random_heads == b.random_heads[: len(a.random_heads)] for a, b in zip(seq.verifications, fixed.verifications)
    )


def test_too_few_draws_confirm_nothing_and_say_so(tiny_llama_gqa, text_file, monkeypatch):
    # make every test look significant: the effect rule is all that stands, and reachability must still refuse
    from headprobe.analyses.verdicts import VerdictRule

    monkeypatch.setattr(VerdictRule, "effect_is_large", lambda *a: True)
    result = _scan(tiny_llama_gqa, text_file, n_random=5, types="induction", keep_n_random=True)
    assert all(
        v.confirmed is None and "cannot reach alpha = 0.05" in v.no_verdict for v in result.verifications if v.tested
    )
    # the reason in full in summary.json's warnings; the report names the type once and says why in short
    assert any(
        (w.kind, w.head_type, w.task) == ("type", "induction", "repeated")
        and str(w).startswith("induction: no verdict: 5 control sets: its smallest p-value 1/6")
        for w in result.warnings
    )
    assert "WARNING: no verdict for induction: n_random=5 is too few" in result.report()  # from Python: keywords


def test_cli_says_once_why_no_verdict_can_be_confirmed(tiny_dir, text_file, tmp_path, capsys):
    from headprobe.cli import main

    out = tmp_path / "out"
    assert (
        main(
            [
                "scan",
                "--model",
                str(tiny_dir),
                "--text",
                str(text_file),
                "--n-random",
                "10",
                "--keep-n-random",
                "--n-natural",
                "2",
                "--seq-len",
                "16",
                "--n-repeated",
                "2",
                "--period",
                "6",
                "-k",
                "2",
                "--types",
                "induction",
                "--no-metrics",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    said = capsys.readouterr()
    # it said so before the load and again, with other numbers, after; now once, in the plan, which knows the
    # family: here none (the random model's tasks are untrusted, each said in its WARNING), so no such line at all
    assert "cannot reach alpha" not in said.out + said.err, said
    assert said.out.count("no better than a uniform guess") == 2 and "WARNING above" in said.out, said.out


def test_a_pruned_models_removed_heads_are_blank_and_never_drawn(tiny_tokenizer, tmp_path, text_file):
    """A reloaded pruned model scanned as if its removed heads were alive gave them
    ordinary scores, filled the random control with zero-effect heads and drove every p to its floor."""
    import pandas as pd
    import zoo

    import headprobe
    from headprobe.probe.model.pruned import remove_heads, save_pruned_dir

    base = headprobe.load_model(
        str(zoo.save_dir("llama", tiny_tokenizer, tmp_path / "llama")), device="cpu", quiet=True
    )
    spec = base.spec
    removed = {(0, 0), (1, 1)}
    keep = torch.ones(spec.n_layers, spec.n_heads, dtype=torch.bool)
    for layer, head in removed:
        keep[layer, head] = False
    save_pruned_dir(remove_heads(base.model, keep), tmp_path / "pruned", tokenizer=base.tokenizer)
    model = headprobe.load_model(str(tmp_path / "pruned"), device="cpu", quiet=True)
    assert set(model.spec.removed_heads) == removed
    result = _scan(model, text_file, n_random=20, k=2)
    table = result.table.set_index(["layer", "head"])
    score_cols = [c for c in table.columns if c not in ("kv_head",)]
    for head in removed:
        assert table.loc[head, score_cols].isna().all(), head  # blank, not an ordinary score
    alive = [h for h in table.index if h not in removed]
    assert table.loc[alive, "induction"].notna().all()
    drawn = {tuple(int(x) for x in h.split(".")) for v in result.verifications for s in v.random_heads for h in s}
    assert drawn and not drawn & removed
    assert not {tuple(int(x) for x in h.split(".")) for v in result.verifications for h in v.top_heads} & removed
    assert result.summary()["removed_heads"] == sorted(f"{l}.{h}" for l, h in removed)
    csv = tmp_path / "scan.csv"
    result.table.to_csv(csv, index=False)
    assert pd.read_csv(csv).query("layer == 0 and head == 0")["induction"].isna().all()


def test_curtail_family_stops_what_cannot_be_confirmed_and_nothing_else():
    """The one curtailment rule (the scan's and benchmarks/verification.py's replay), on hand-made
    tests of at most 50 draws at alpha 0.05 (h = 3; 10 draws taken): one whose 2 draws reached its
    effect can reach p = 3/51 at best, above 0.05 with any correction, and stops; the ones no draw
    reached stay open, the one with an effect below the floor too (it may be a rejection that
    lowers the others' adjusted p); and with 10 draws of at most 24 (h = 2; BH over three at 1/25
    and one at 2/25: 4/3 x 1/25 = 0.053 > 0.05, every test unwinnable) a test no draw reached
    still stays open."""
    from headprobe.analyses import statistics as st
    from headprobe.analyses.verification import curtail_family

    def test(effect, reached, n_max=50):
        t = st.SequentialMCTest(effect, n_max, 0.05)
        t.add([2.0] * reached + [0.0] * (10 - reached))
        return t

    tests = [test(1.0, 0), test(1.0, 0), test(1.0, 2), test(0.01, 0)]
    assert [t.best_p for t in tests] == pytest.approx([1 / 51, 1 / 51, 3 / 51, 1 / 51])
    curtail_family(tests, "bh", 0.05)
    assert [t.curtailed for t in tests] == [False, False, True, False]
    short = [test(1.0, 0, 24), test(1.0, 0, 24), test(1.0, 0, 24), test(1.0, 1, 24)]
    assert st.unwinnable([t.best_p for t in short], [True] * 4, "bh", 0.05) == [0, 1, 2, 3]
    curtail_family(short, "bh", 0.05)
    assert [t.curtailed for t in short] == [False, False, False, True]


# --- the plan, honest curtailment, per-type streams, NaN losses ---------------------------


def _scripted(monkeypatch, model, text, effect_of, **kw):
    """A scripted ablation engine on the tiny model: the loss of ablating a head set is the task's
    clean loss plus ``effect_of(task, heads)`` (so the set's mean effect) (``heads``: sorted (layer, head) tuples), whatever the model
    does; the task is told from the token set's shape. Both tasks carry verdicts (the random tiny
    model's natural-text loss is above ln(vocabulary)). Returns a run without verification."""
    import headprobe.analyses.verification as verif
    from headprobe.commands.scan import core

    monkeypatch.setattr(core, "untrusted_task_reason", lambda *a, **k: None)

    base = _scan(model, text, verify=False, **kw)
    shapes = {tuple(base.natural.tokens.shape): "natural", tuple(base.repeated.tokens.shape): "repeated"}

    def losses(backend, tokens, sets, kind, mean_z, first, score=None, clean=None):
        task = shapes[tuple(tokens.shape)]
        return torch.stack(
            [
                torch.full((tokens.shape[0],), base.clean_loss[task] + effect_of(task, tuple(map(tuple, s))))
                for s in sets
            ]
        )

    monkeypatch.setattr(verif, "set_ablation_losses", losses)
    return base


def _noise(heads, scale=1.0, power=1):
    import random

    return scale * random.Random(str(heads)).random() ** power


def _planted(top_ind):
    """Induction's top-k set raises the loss by 8 nats; every other set by 0-0.7 (previous-token's top-k among them)."""
    return lambda task, heads: 8.0 if list(heads) == top_ind else _noise(heads, 0.7)


def test_a_strong_effect_is_planned_for_and_confirmed_or_said_unreachable(
    tiny_llama_gqa, text_file, monkeypatch, capsys
):
    """Two types, n_random=20. By default the plan raises the draws to the 39
    a lone BH verdict needs (p <= 0.05 / 2 needs 1/(n+1) <= 0.025) and confirms the planted
    induction effect; with keep_n_random it says before the ablations that no lone verdict can
    reach alpha, and induction (beating every draw) is never curtailed: p = 1/21, not a bound."""
    from headprobe.analyses.ablation import top_heads

    kw = {"types": "induction,previous_token", "n_random": 20, "control": "uniform"}
    base = _scripted(monkeypatch, tiny_llama_gqa, text_file, lambda *a: 0.0, **kw)
    top_ind = top_heads(torch.as_tensor(base.scores["induction"]), 3)
    _scripted(monkeypatch, tiny_llama_gqa, text_file, _planted(top_ind), **kw)
    capsys.readouterr()
    result = _scan(tiny_llama_gqa, text_file, **kw)
    err = capsys.readouterr().err
    ind = next(v for v in result.verifications if v.tested and v.head_type == "induction")
    assert "n_random=20 raised to 39" in err and "a lone CONFIRMED needs p <= 0.025" in err
    assert ind.draws == 39 and ind.exceedances == 0 and ind.stop_reason == "ran to the end"
    assert ind.p_value == pytest.approx(1 / 40) and ind.confirmed is True and not ind.p_value_is_bound
    plan = result.summary()["verification"]["plan"]
    assert plan["n_random"] == 39 and plan["n_random_requested"] == 20 and plan["lone_draws_needed"] == 39
    assert plan["max_sets"] >= 2 * 39 and result.summary()["timings_s"]["plan_estimated_s"] >= 0
    estimate = ("about", "under a second")  # a timing: on the terminal, not in summary.json's lines
    assert any(e in err for e in estimate) and not any(e in line for e in estimate for line in plan["lines"])

    kept = _scan(tiny_llama_gqa, text_file, keep_n_random=True, **kw)
    err = capsys.readouterr().err
    assert err.index("no verdict of this run can be CONFIRMED on its own") < len(err)
    ind = next(v for v in kept.verifications if v.tested and v.head_type == "induction")
    assert ind.draws == 20 and ind.exceedances == 0 and ind.stop_reason == "ran to the end"
    assert ind.p_value == pytest.approx(1 / 21) and not ind.p_value_is_bound and ind.confirmed is False
    report = kept.report()
    assert "0 of 20 control sets reached the effect" in report
    for v in kept.verifications:  # a bound is never printed as a plain p
        if v.p_value_is_bound:
            assert (
                f"p in [{v.p_value_min:.4g}, {v.p_value:.4g}]" in report
                and "stopped: cannot reach alpha after BH" in report
            )
            assert v.p_value_min <= v.p_value and f"p = {v.p_value:.4g}" not in report


def test_holm_with_too_few_draws_gives_no_verdict_with_the_reason(tiny_llama_gqa, text_file, monkeypatch):
    """Where a test's draws cannot reach alpha after the correction
    (Holm over 2 tests: its first rejection needs p <= 0.025, 20 draws give 1/21 at best), its
    verdict is null with the reason, and summary.json's warnings carry it; the control sets
    --keep-n-random asked for are still ablated and reported (unreachable by the user's choice,
    not for want of sets; sequential tests may stop early as futile)."""
    kw = {"types": "induction,previous_token", "n_random": 20, "control": "uniform", "correction": "holm"}
    _scripted(monkeypatch, tiny_llama_gqa, text_file, lambda task, heads: _noise(heads), **kw)
    result = _scan(tiny_llama_gqa, text_file, keep_n_random=True, **kw)
    summary = result.summary()
    for v in result.verifications:
        if v.tested:
            assert v.confirmed is None and "cannot reach alpha = 0.05 after holm over 2 tests" in v.no_verdict
            assert v.draws > 0 and v.stop_reason != "not run: cannot reach alpha" and "not run" not in v.no_verdict
            assert summary["confirmed"][v.head_type] is None
            assert any(v.head_type.replace("_", "-") in w and "no verdict" in w for w in summary["warnings"])


def test_sequential_and_fixed_draws_give_the_same_verdicts_with_a_test_below_the_floor(
    tiny_llama_gqa, text_file, monkeypatch
):
    """Previous-token's effect (0.03 nats) is below the 0.05 floor but beats every
    control (natural-text controls 0-0.02): a BH rejection that is not CONFIRMED. Induction's
    effect is beaten by one of its 59 controls (p = 2/60). With fixed draws BH adjusts induction
    to 3 x (2/60) / 2 = 0.05: CONFIRMED. Curtailing previous-token at its first draw for the floor
    gave it the bound 3/4 and induction 0.1 (not confirmed); the sequential run must agree."""
    kw = {"types": "induction,previous_token,duplicate_token", "n_random": 59, "control": "uniform"}
    heavy = {"natural": lambda h: _noise(h, 0.02), "repeated": lambda h: _noise(h, 2.0, power=6)}
    _scripted(monkeypatch, tiny_llama_gqa, text_file, lambda task, heads: heavy[task](heads), **kw)
    probe = _scan(tiny_llama_gqa, text_file, sequential=False, **kw)
    ind = next(v for v in probe.verifications if v.tested and v.head_type == "induction")
    second, first = sorted(ind.random_effects)[-2:]
    tops = {
        v.head_type: tuple(map(tuple, (map(int, h.split(".")) for h in v.top_heads)))
        for v in probe.verifications
        if v.tested
    }
    planted = {tops["induction"]: (first + second) / 2, tops["previous_token"]: 0.03, tops["duplicate_token"]: 0.0}
    _scripted(monkeypatch, tiny_llama_gqa, text_file, lambda task, heads: planted.get(heads, heavy[task](heads)), **kw)
    fixed = _scan(tiny_llama_gqa, text_file, sequential=False, **kw)
    seq = _scan(tiny_llama_gqa, text_file, **kw)
    by = {r.head_type: r for r in fixed.verifications if r.tested}
    assert by["induction"].p_value == pytest.approx(2 / 60) and by["previous_token"].p_value == pytest.approx(1 / 60)
    assert by["induction"].confirmed is True and by["previous_token"].confirmed is False
    assert [v.confirmed for v in seq.verifications] == [v.confirmed for v in fixed.verifications]
    assert seq.verification["sets_ablated"] < fixed.verification["sets_ablated"]  # duplicate-token still stops early
    dup = next(v for v in seq.verifications if v.tested and v.head_type == "duplicate_token")
    assert dup.stop_reason == "settled above alpha" and dup.draws < 59


def test_a_nan_effect_never_confirms(tiny_llama_gqa, text_file, monkeypatch):
    """A NaN top-k loss got the best p (1/n+1) because NaN >= x is False. It now
    leaves the family with the reason; NaN control losses count as reaching the effect."""
    from headprobe.analyses.ablation import top_heads

    kw = {"types": "induction,previous_token", "n_random": 39, "control": "uniform"}
    base = _scripted(monkeypatch, tiny_llama_gqa, text_file, lambda *a: 0.0, **kw)
    top_ind = top_heads(torch.as_tensor(base.scores["induction"]), 3)
    _scripted(
        monkeypatch,
        tiny_llama_gqa,
        text_file,
        lambda task, heads: float("nan") if list(heads) == top_ind else _noise(heads, 0.7),
        **kw,
    )
    result = _scan(tiny_llama_gqa, text_file, **kw)
    ind = [v for v in result.verifications if v.head_type == "induction"]
    assert all(v.confirmed is None and "non-finite" in v.no_verdict for v in ind)
    assert result.verification["family_size"] == 1
    mc = st.SequentialMCTest(1.0, 10, 0.05)
    mc.add([float("nan"), 0.0])
    assert mc.reached == [True, False]
    nan_top = st.SequentialMCTest(float("nan"), 10, 0.05)
    nan_top.add([0.0] * 10)
    assert nan_top.p_value() > 0.05


def test_a_types_control_sets_do_not_depend_on_the_other_types(tiny_llama_gqa, text_file):
    """Control streams are seeded per (seed, type)."""
    both = _scan(
        tiny_llama_gqa, text_file, types="induction,previous_token", n_random=6, keep_n_random=True, sequential=False
    )
    alone = _scan(tiny_llama_gqa, text_file, types="induction", n_random=6, keep_n_random=True, sequential=False)
    a = next(v for v in both.verifications if v.tested and v.head_type == "induction")
    b = next(v for v in alone.verifications if v.tested and v.head_type == "induction")
    assert a.random_heads == b.random_heads and a.p_value == b.p_value and a.draws == 6


def test_holm_from_its_definition_matches_statsmodels(monkeypatch):
    """Holm is computed from its definition (statsmodels' multipletests ran a
    full garbage collection per curtailment round); the same numbers, ties included."""
    import gc

    from statsmodels.stats.multitest import multipletests

    monkeypatch.setattr(gc, "collect", lambda *a, **k: 0)  # the reference's collections: seconds each under xdist

    rng = np.random.default_rng(0)
    for m in (1, 2, 3, 5, 8):
        for _ in range(50):
            p = rng.choice([1 / 51, 2 / 51, 0.01, 0.3, 0.9, 1.0], size=m) if m > 2 else rng.uniform(0, 0.2, size=m)
            np.testing.assert_allclose(st.adjust_p_values(p.tolist(), "holm"), multipletests(p, method="holm")[1])


def test_draws_the_docs_state_for_bh_and_a_lone_verdict():
    """BH confirms three of five types at 1/(n+1) only from n = 33 (at 32 the
    adjusted p is 5/3 x 1/33 = 0.0505); a lone verdict of m tests needs m/alpha - 1 draws."""
    three = lambda n: st.adjust_p_values([1 / (n + 1)] * 3 + [1.0, 1.0], "bh")[0]
    assert three(32) == pytest.approx(0.0505, abs=1e-4) and three(32) > 0.05 >= three(33)
    assert "33 for three" in (Path(__file__).parents[1] / "docs" / "scan.md").read_text()
    for m in (1, 2, 5):
        n = st.lone_draws_needed(m, 0.05)
        for method in ("bh", "holm"):
            assert st.confirmable([1 / (n + 1)] + [1 / (n + 1)] * (m - 1), method, 0.05)[0] == "alone"
            assert st.confirmable([1 / n] + [1 / (n + 1)] * (m - 1), method, 0.05)[0] != "alone"
    assert [st.lone_draws_needed(m, 0.05) for m in (1, 2, 5)] == [19, 39, 99]


def test_tests_that_cannot_be_confirmed_get_no_raised_draws(tiny_llama_gqa, text_file, monkeypatch):
    """At alpha 1e-4 a lone verdict of two tests needs 19,999 control sets and the tiny model has a
    few hundred distinct ones: no verdict can be CONFIRMED, so no control set is ablated at all
    (only the two top-k sets, each kind; p = 1, a test of no draws), and the plan and the verdicts
    say so, before the control sets and after."""
    import headprobe.analyses.verification as verif
    from headprobe.analyses.ablation import top_heads

    kw = {"types": "induction,previous_token", "n_random": 9, "control": "uniform", "alpha": 1e-4}
    base = _scripted(monkeypatch, tiny_llama_gqa, text_file, lambda *a: 0.0, **kw)
    tops = [tuple(map(tuple, top_heads(torch.as_tensor(base.scores[t]), 3))) for t in ("induction", "previous_token")]
    _scripted(
        monkeypatch, tiny_llama_gqa, text_file, lambda task, heads: 8.0 if heads in tops else _noise(heads, 0.7), **kw
    )
    scripted, ablated = verif.set_ablation_losses, []

    def counted(backend, tokens, sets, *a, **k):
        ablated.extend(sets)
        return scripted(backend, tokens, sets, *a, **k)

    monkeypatch.setattr(verif, "set_ablation_losses", counted)
    result = _scan(tiny_llama_gqa, text_file, **kw)
    tested = [v for v in result.verifications if v.tested]
    assert len(tested) == 2
    for v in tested:
        # a test of no draws has no p-value (it read p = 1.0, p_adjusted 1.0, as if a test had run)
        assert v.draws == 0 and v.exceedances == 0 and v.p_value is None and v.confirmed is None, v
        assert "cannot reach alpha" in v.no_verdict and "not run: none of them was ablated" in v.no_verdict
        assert v.stop_reason == "not run: cannot reach alpha" and v.p_adjusted is None
        # how to get a verdict: BH over 2 tests at alpha 1e-4 needs 1 / 1e-4 - 1 = 9999 sets at the least; each
        # type's task is its own, so -k 2 draws 2 of the 14 heads outside its own 2: C(14, 2) = 91, -k 1 C(15, 1)
        assert v.no_verdict.endswith(
            "for a verdict a test needs at least 9999 distinct control sets: no smaller -k gives that many "
            "(at most 91 sets, at -k 2): use a model with more heads"
        ), v.no_verdict
    assert all(v.draws == 0 and v.random_heads == [] and v.p_value is None for v in result.verifications)
    rows = {(r["head_type"], r["kind"]): r for r in result.summary()["ablations"]}  # summary.json's rows
    assert rows["induction", "mean"]["p_value"] is None and rows["induction", "mean"]["p_adjusted"] is None
    assert Verification.from_dict(json.loads(json.dumps(rows["induction", "mean"]))).p_value is None
    table = [ln for ln in result.report().splitlines() if ln.split()[1:2] in (["mean"], ["zero"])]
    assert len(table) == 4 and all(ln.split()[-5:-2] == ["0", "-", "-"] for ln in table[::2]), table
    assert all("1.0000" not in ln for ln in table), table
    kinds = len({v.kind for v in result.verifications})
    controls = len(ablated) - 2 * kinds  # the two top-k sets, each kind
    assert controls == 0 and result.verification["sets_ablated"] == len(ablated), (controls, len(ablated))
    assert all(t["capped"] and t["confirmable"] == "never" for t in result.verification["plan"]["tests"])
    lines = "\n".join(result.verification["plan"]["lines"])  # what the scan prints before the control sets
    assert lines.count("it cannot be CONFIRMED at all (bh over 2 tests): not run: none of its control sets") == 2, lines
    assert "not run: its control sets cannot reach alpha after BH; no control set ablated" in result.report()


def test_a_verdicts_shortfall_names_each_unmet_part_and_only_those():
    """shortfall() is None exactly where confirms() is True (random cases), and names each unmet part
    in hand-made ones: the import run's p = 0.0196, effect +12.4 against a control mean of +7.77."""
    from headprobe.analyses.verdicts import VerdictRule

    rule = VerdictRule(alpha=0.05, min_effect=0.05, ratio=2.0)
    rng = np.random.default_rng(0)
    for _ in range(2000):
        p, top = float(rng.choice([0.01, 0.05, 0.2])), float(rng.normal(0.3, 0.3))
        controls = rng.normal(float(rng.choice([0.0, 0.1, 0.3])), 0.1, size=int(rng.integers(1, 6))).tolist()
        assert (rule.shortfall(p, top, controls) is None) == rule.confirms(p, top, controls)
    assert rule.shortfall(0.0196, 12.4038, [7.7720]) == "effect +12.4 < 2x the control mean +7.77 = +15.5"
    assert rule.shortfall(0.2, 0.01, [0.0]) == "adjusted p 0.2 > alpha 0.05; effect +0.01 < the floor 0.05 nats/token"
    assert rule.shortfall(None, 1.0, [0.1]) == "adjusted p n/a > alpha 0.05"
    # alpha itself passes; a negative control mean asks only the floor
    assert rule.shortfall(0.05, 0.06, [-1.0]) is None


def test_a_test_that_cannot_be_confirmed_ablates_no_control_set(tiny_llama_gqa, monkeypatch):
    """Two tests on one task, k = 3, layer-matched controls outside both top-k sets. ``induction``'s
    three heads are in layer 0, where 4 heads are left: C(4, 3) = 4 distinct control sets, p >= 1/5,
    never CONFIRMED under BH over 2 tests, so none of its sets is ablated (its top-k set alone, each
    kind). ``duplicate_token`` (one head in layer 0, two in layer 1: 4 x C(6, 2) = 60 sets) is
    reachable; its numbers are those of the engine that still ablates induction's sets."""
    import headprobe.analyses.verification as verif
    from headprobe.analyses.data import repeated_random_tokens

    top = {"induction": [(0, 0), (0, 1), (0, 2)], "duplicate_token": [(0, 3), (1, 0), (1, 1)]}
    tops = [tuple(t) for t in top.values()]
    rep = repeated_random_tokens(tiny_llama_gqa, 3, 8, 0)
    ablated: list[tuple[str, tuple]] = []

    def scripted(backend, tokens, sets, kind, *a, **k):  # a top-k set raises the loss by 8 nats, others by 0-0.7
        ablated.extend((kind, tuple(map(tuple, s))) for s in sets)
        return torch.stack(
            [torch.full((tokens.shape[0],), 8.0 if tuple(map(tuple, s)) in tops else _noise(s, 0.7)) for s in sets]
        )

    monkeypatch.setattr(verif, "set_ablation_losses", scripted)

    def verify():
        ablated.clear()
        settings = VerificationSettings(k=3, n_random=20)
        out, design = verif.verify_heads(
            tiny_llama_gqa,
            top,
            dict.fromkeys(top, "repeated"),
            {"repeated": rep},
            {"repeated": torch.zeros(3)},
            torch.zeros(1),
            settings,
        )
        return {(v.head_type, v.kind): v for v in out}, design, list(ablated)

    rows, design, sets = verify()
    induction_controls = [s for _, s in sets if all(h[0] == 0 for h in s) and s != tops[0]]
    assert induction_controls == [] and sets.count(("mean", tops[0])) == sets.count(("zero", tops[0])) == 1
    assert design["sets_ablated"] == len(sets) and [t["confirmable"] for t in design["plan"]["tests"]] == [
        "never",
        "alone",
    ]
    for kind in ("mean", "zero"):
        v = rows["induction", kind]
        assert v.draws == 0 and v.random_effects == [] and v.p_value is None and v.confirmed is None
    assert "only 4 distinct control sets exist" in rows["induction", "mean"].no_verdict

    monkeypatch.setattr(verif, "_cap_undecidable", lambda *a: False)  # the engine that ablates every test's sets
    ref_rows, _, ref_sets = verify()
    assert len([s for _, s in ref_sets if all(h[0] == 0 for h in s) and s != tops[0]]) == 2 * 4
    dup, ref = rows["duplicate_token", "mean"], ref_rows["duplicate_token", "mean"]
    assert dup.draws == 39 and dup.exceedances == 0 and dup.confirmed is True
    for field in (
        "draws",
        "random_effects",
        "random_heads",
        "exceedances",
        "p_value",
        "p_adjusted",
        "confirmed",
        "stop_reason",
    ):
        assert getattr(dup, field) == getattr(ref, field), field
    assert rows["duplicate_token", "zero"].random_effects == ref_rows["duplicate_token", "zero"].random_effects


# Hand-made layouts for the rerun counts: (layers, heads a layer, removed heads, each type's ranked heads and task),
# and per (type, k', control): the heads its pool leaves out (its task's union of top-k' sets, or its own where that
# union leaves fewer than 2 k' heads), its heads per layer ({} for uniform: any k' heads), and the count by hand.
_RERUN_CASES = [
    (  # one layer of 12 heads: C(11, 1) = 11, C(9, 3) = 84, C(7, 5) = 21; 5 heads cannot make a set of 7 (0)
        (1, 12, set(), {"induction": ([(0, h) for h in range(7)], "repeated")}),
        [
            ("induction", k, "layer-matched", "own", {0: k}, n)
            for k, n in [(1, 11), (2, 45), (3, 84), (4, 70), (5, 21), (6, 1), (7, 0)]
        ]
        + [("induction", 3, "uniform", "own", {}, 84)],
    ),
    (  # 3 x 4 heads, (2, 3) removed, two types on one task and one on the other
        (
            3,
            4,
            {(2, 3)},
            {
                "induction": ([(0, 0), (0, 1), (0, 2), (1, 0)], "repeated"),
                "duplicate_token": ([(0, 3), (2, 0), (1, 1), (2, 1)], "repeated"),
                "previous_token": ([(1, 2), (1, 3)], "natural"),
            },
        ),
        [
            # k' 2: 12 - 5 >= 4 heads outside the task's union: it is left out; layer 0 keeps 1 of 2, 1 more from layer 1
            ("induction", 2, "layer-matched", "task", {0: 1, 1: 1}, 4),
            ("duplicate_token", 2, "layer-matched", "task", {0: 1, 2: 1}, 1 * 2),
            ("induction", 2, "uniform", "task", {}, 21),
            # k' 3: 12 - 7 < 6: its own; layer 0 has one head left, its two others from layer 1
            ("induction", 3, "layer-matched", "own", {0: 1, 1: 2}, 6),
            ("duplicate_token", 3, "layer-matched", "own", {0: 1, 1: 1, 2: 1}, 3 * 3 * 2),
            ("induction", 4, "layer-matched", "own", {0: 1, 1: 3}, 1),
            # two heads in all; layer-matched sets of 2, uniform ones of k' = 3 (as the run draws them)
            ("previous_token", 3, "layer-matched", "task", {1: 2}, 1),
            ("previous_token", 3, "uniform", "task", {}, 84),
        ],
    ),
    (  # 3 x 3 heads, (0, 2) removed: layer 1's shortfall comes from layer 2 (the later of two as near), not layer 0
        (3, 3, {(0, 2)}, {"induction": ([(1, 0), (1, 1), (1, 2)], "repeated")}),
        [
            ("induction", 1, "layer-matched", "own", {1: 1}, 2),
            ("induction", 2, "layer-matched", "own", {1: 1, 2: 1}, 3),
            ("induction", 3, "layer-matched", "own", {2: 3}, 1),
        ],
    ),
]


def test_a_smaller_k_takes_a_prefix_of_the_top_k():
    """The advice counts -k k' on each type's top-k list cut to k' heads: top_heads of k' is that prefix, with
    ties (stable), NaN scores (ranked last, left out while finite ones remain) and all-NaN scores."""
    from headprobe.analyses.ablation import top_heads

    rng = np.random.default_rng(0)
    for _ in range(200):
        scores = torch.as_tensor(rng.integers(0, 4, size=(3, 4)).astype(float))  # many ties
        scores[torch.as_tensor(rng.random((3, 4)) < rng.choice([0.0, 0.5, 0.9, 1.0]))] = float("nan")
        for k in range(1, 12):
            assert all(top_heads(scores, j) == top_heads(scores, k)[:j] for j in range(1, k + 1)), (scores, k)


@pytest.mark.parametrize("layout, cases", _RERUN_CASES)
def test_rerun_set_counts_match_every_set_enumerated_by_brute_force(layout, cases):
    """The distinct control sets a rerun with -k k' has, against brute force: every k'-subset of the
    heads outside the pool's excluded heads (written out by hand per case) with the case's heads per
    layer, from itertools over the head tuples; and the sets a run of layer_matched_sets enumerates
    (where there are fewer than 4 x its draws) are exactly those. Counts that fall as k' rises (84
    at k' 3, 21 at 5) are why the advice counts every smaller -k."""
    import itertools
    from collections import Counter

    from headprobe.analyses.verification import rerun_set_counts

    n_layers, n_heads, removed, types = layout
    all_heads = [(layer, head) for layer in range(n_layers) for head in range(n_heads)]
    top = {t: heads for t, (heads, _) in types.items()}
    task_of = {t: task for t, (_, task) in types.items()}
    for t, k, control, pool, per_layer, by_hand in cases:
        mine = list(top[t][:k])
        union = {h for u in top if task_of[u] == task_of[t] for h in top[u][:k]}
        excluded = union if pool == "task" else set(mine)
        avail = [h for h in all_heads if h not in excluded and h not in removed]
        size = k if control == "uniform" else len(mine)
        every = {
            c
            for c in itertools.combinations(avail, size)
            if not per_layer or Counter(layer for layer, _ in c) == Counter(per_layer)
        }
        assert len(every) == by_hand, (t, k, control)
        assert rerun_set_counts(top, task_of, all_heads, removed, k, control)[t] == by_hand, (t, k, control)
        if control == "layer-matched" and by_hand:
            sets, _ = layer_matched_sets(mine, avail, n_layers, 10**4, torch.Generator().manual_seed(0))
            assert {tuple(s) for s in sets} == every and len(sets) == by_hand
        elif control == "uniform":
            assert {tuple(s) for s in uniform_sets(k, avail, 10**4, torch.Generator())} == every


def _advice(model, monkeypatch, top: dict, k: int, n_random: int = 20) -> tuple[dict, dict]:
    """verify_heads on the tiny model (2 layers x 8 heads) with ``top`` judged on the repeated task, layer-matched,
    and a scripted engine (a top-k set +8 nats, others 0-0.7): each type's tested row, and each type's test in
    the plan."""
    import headprobe.analyses.verification as verif
    from headprobe.analyses.data import repeated_random_tokens

    tops = [tuple(t) for t in top.values()]

    def scripted(backend, tokens, sets, kind, *a, **kw):
        return torch.stack(
            [torch.full((tokens.shape[0],), 8.0 if tuple(map(tuple, s)) in tops else _noise(s, 0.7)) for s in sets]
        )

    monkeypatch.setattr(verif, "set_ablation_losses", scripted)
    out, design = verif.verify_heads(
        model,
        top,
        dict.fromkeys(top, "repeated"),
        {"repeated": repeated_random_tokens(model, 3, 8, 0)},
        {"repeated": torch.zeros(3)},
        torch.zeros(1),
        VerificationSettings(k=k, n_random=n_random),
    )
    return {v.head_type: v for v in out if v.kind == "mean"}, {t["head_type"]: t for t in design["plan"]["tests"]}


def test_the_advice_names_the_smaller_k_a_rerun_could_confirm_with(tiny_llama_gqa, monkeypatch):
    """k = 4, both types' heads 3 + 1 over the two layers: the 8 heads outside both top-k sets give
    C(4, 3) x C(4, 1) = 16 < 19 sets each, no verdict. -k 3 gives each C(5, 2) x 5 = 50 >= 39: a rerun
    could confirm either alone. -k 2 gives induction 7 x 5 = 35 >= 19 sets, but duplicate-token (both
    heads in layer 1) C(5, 2) = 10: 1/36 is no BH rejection beside 1/11, so -k 2 is not named; nor -k 1
    (7 sets). Uniform controls at -k 4: C(8, 4) = 70."""
    top = {"induction": [(0, 0), (1, 0), (0, 1), (0, 2)], "duplicate_token": [(1, 1), (1, 2), (0, 3), (1, 3)]}
    rows, _ = _advice(tiny_llama_gqa, monkeypatch, top, 4)
    for t in top:
        assert rows[t].confirmed is None and rows[t].no_verdict.startswith("only 16 distinct control sets exist")
        assert rows[t].no_verdict.endswith(
            "; for a verdict a test needs at least 19 distinct control sets: use -k 3 (50 sets); "
            "--control uniform also does (70 sets)"
        ), rows[t].no_verdict
    # the reruns themselves (-k k' ablates each type's best k' heads; 100 draws: every set that exists), where -k 3
    # confirms both and -k 2 cannot confirm induction
    rows, plan = _advice(tiny_llama_gqa, monkeypatch, {t: h[:3] for t, h in top.items()}, 3, 100)
    assert [(plan[t]["control_sets"], plan[t]["confirmable"], rows[t].confirmed) for t in top] == [
        (50, "alone", True)
    ] * 2
    _, plan = _advice(tiny_llama_gqa, monkeypatch, {t: h[:2] for t, h in top.items()}, 2, 100)
    assert [(plan[t]["control_sets"], plan[t]["confirmable"]) for t in top] == [(35, "never"), (10, "never")]


def test_the_advice_says_when_no_smaller_k_helps(tiny_llama_gqa, monkeypatch):
    """induction's 3 heads in layer 0, duplicate-token's 1 + 2: induction has C(4, 3) = 4 sets; a smaller -k
    does not help (-k 2: C(5, 2) = 10; -k 1: 6), so the advice must not suggest one; uniform controls at -k 3
    give C(10, 3) = 120. (It said "use a smaller -k or a model with more heads".)"""
    top = {"induction": [(0, 0), (0, 1), (0, 2)], "duplicate_token": [(0, 3), (1, 0), (1, 1)]}
    reason = _advice(tiny_llama_gqa, monkeypatch, top, 3)[0]["induction"].no_verdict
    assert reason.endswith(
        "; for a verdict a test needs at least 19 distinct control sets: no smaller -k gives that many "
        "(at most 10 sets, at -k 2): use a model with more heads or --control uniform (120 sets)"
    ), reason
    assert "use a smaller -k" not in reason and "use -k" not in reason


def test_a_type_without_verdict_says_so_on_its_tested_row_only(tiny_llama_gqa, text_file):
    """The random tiny model's natural-text task is untrusted (loss above ln(vocabulary)): its
    types get no verdict, said on the tested (mean) row; the zero-ablation row is reported, not
    tested, as on every other run (it said "no verdict" too, as if it could have had one)."""
    result = _scan(tiny_llama_gqa, text_file, n_random=3, types="previous_token")
    rows = {v.kind: v for v in result.verifications if v.head_type == "previous_token"}
    assert rows["mean"].no_verdict and not rows["mean"].tested  # the premise: no verdict
    lines = [ln for ln in result.report().splitlines() if ln.startswith("previous_token ")]
    verdicts = {ln.split()[1]: ln for ln in lines}
    assert verdicts["mean"].endswith("no verdict"), verdicts["mean"]
    assert verdicts["zero"].endswith("(reported, not tested)"), verdicts["zero"]


def test_a_family_of_one_test_is_one_test_in_the_plan():
    """The plan's note of a family of one reads ``bh over 1 test`` (it read ``over 1 tests``); two read ``tests``."""
    from headprobe.analyses.verification import plan_lines

    def plan(m: int) -> dict:
        test = {"head_type": "induction", "confirmable": "never", "control_sets": 1, "capped": True, "not_run": True}
        return {
            "family_size": m, "lone_draws_needed": 19 * m, "n_random": 50, "family": ["induction"] * m,
            "correction": "bh", "alpha": 0.05, "raised": False, "kept": False, "n_random_requested": 50,
            "max_sets": 2, "tests": [test] * m,
        }  # fmt: skip

    assert "cannot be CONFIRMED at all (bh over 1 test): not run" in plan_lines(plan(1))[1]
    assert "(bh over 2 tests)" in plan_lines(plan(2))[1]


def test_the_plans_time_estimate_never_reads_about_0_s():
    """A tiny model's plan said "about 0 s at 0.00 s a set": under half a second it says "under a
    second" with the time a set in milliseconds; a longer plan reads as before."""
    from headprobe.analyses.verification import plan_lines

    def line(est: float, per_set: float) -> str:
        return plan_lines(
            {
                "family_size": 1,
                "lone_draws_needed": 19,
                "n_random": 50,
                "family": ["induction"],
                "correction": "bh",
                "alpha": 0.05,
                "raised": False,
                "kept": False,
                "n_random_requested": 50,
                "max_sets": 50,
                "tests": [],
                "estimated_s": est,
                "seconds_per_set": per_set,
            }  # fmt: skip
        )[0]

    assert line(0.02, 0.0004).endswith("at most 50 sets, under a second (0.4 ms a set)")
    assert line(276.0, 0.276).endswith("at most 50 sets, about 276 s at 0.28 s a set")
    assert "0.00 s" not in line(0.2, 0.004) and "about 0 s" not in line(0.2, 0.004)


def test_a_saved_verification_row_reads_back_with_its_nans(tmp_path):
    """A test whose control stream was never ablated has NaN control means; summary.json stores
    them as null, and a Verification rebuilt from the row (scripts/redraw_figures.py) held None
    where its fields are floats. Read back through the project's own JSON writer, every field
    equals the original, NaN for NaN."""
    import math
    from dataclasses import fields

    from headprobe.analyses.ablation import Verification
    from headprobe.probe.core.io import write_json

    nan = float("nan")
    v = Verification(
        head_type="induction", kind="mean", task="repeated", k=3, top_heads=["1.2", "0.1", "1.0"],
        clean_loss=2.08, top_loss=3.9, top_effect=1.81, random_effects=[], random_mean=nan,
        random_max=nan, confirmed=None, p_value=1.0, top_effect_ci95=[1.67, nan],
    )  # fmt: skip
    write_json(tmp_path / "s.json", {"ablations": [v.to_dict() | {"not_a_field": 1}]})
    row = json.loads((tmp_path / "s.json").read_text())["ablations"][0]
    assert row["random_mean"] is None  # as the writer stores a NaN
    back = Verification.from_dict(row)
    for f in fields(Verification):
        a, b = getattr(v, f.name), getattr(back, f.name)
        same = lambda x, y: x == y or (isinstance(x, float) and math.isnan(x) and math.isnan(y))
        if isinstance(a, list) and a and isinstance(a[0], float):
            assert all(same(x, y) for x, y in zip(a, b, strict=True)), f.name
        else:
            assert same(a, b), f.name


def test_a_confirmed_verdict_whose_interval_over_sequences_reaches_0_says_what_that_means(
    tiny_llama_gqa, text_file, monkeypatch
):
    """The verdict's test is over control head sets, the interval over sequences: induction's top-k
    set raises the loss by 20, -5 and 15 nats on the 3 repeated sequences (mean +10; 95% t interval
    10 +- t(0.975, 2) * sd / sqrt(3) = [-22.9, +42.9], computed here with scipy), every control set
    by 0-0.7 on each (each plus the task's mean clean loss less the sequence's own: the interval
    within 0.5 of scipy's): CONFIRMED (p = 1/20 beats alpha over 1 test), and the report and summary.json
    (``confirmed_ci_includes_zero``) say the set beats random heads but the effect's size is
    uncertain on so few sequences. The old code wrote the NOTE in the report only, not in
    summary.json. The verdict itself is unchanged by it."""
    from scipy import stats

    import headprobe.analyses.verification as verif
    from headprobe.analyses.ablation import top_heads

    kw = {"types": "induction", "n_random": 19, "control": "uniform"}
    base = _scripted(monkeypatch, tiny_llama_gqa, text_file, lambda *a: 0.0, **kw)
    top = tuple(map(tuple, top_heads(torch.as_tensor(base.scores["induction"]), 3)))
    per_seq = torch.tensor([20.0, -5.0, 15.0])

    def losses(backend, tokens, sets, kind, *a, **k):
        clean = base.clean_loss["repeated"]
        rows = [clean + (per_seq if tuple(map(tuple, s)) == top else torch.full((3,), _noise(s, 0.7))) for s in sets]
        return torch.stack(rows)

    monkeypatch.setattr(verif, "set_ablation_losses", losses)
    result = _scan(tiny_llama_gqa, text_file, **kw)
    v = next(v for v in result.verifications if v.tested)
    lo, hi = stats.t.interval(0.95, 2, loc=10.0, scale=stats.sem([20.0, -5.0, 15.0]))
    assert v.confirmed is True and v.top_effect_ci95 == pytest.approx([lo, hi], abs=0.5) and lo < 0 < hi
    said = json.loads(json.dumps(result.summary()))["confirmed_ci_includes_zero"]
    assert len(said) == 1 and said[0].startswith(
        f"induction is CONFIRMED against control sets on these sequences, but its 95% interval over sequences [{v.top_effect_ci95[0]:+.3g}, {v.top_effect_ci95[1]:+.3g}] reaches 0: the head set beats random heads"
    ), said
    assert "use more sequences" in said[0] and in_python("scan", f"NOTE: {said[0]}") in result.report()  # keywords
    # an interval above 0: no such key (the committed summaries stay byte-identical)
    narrow = dataclasses.replace(
        result, verifications=[dataclasses.replace(x, top_effect_ci95=[1.0, 2.0]) for x in result.verifications]
    )
    assert "confirmed_ci_includes_zero" not in narrow.summary() and "reaches 0" not in narrow.report()


def test_a_scan_remarks_shared_top_k_sets_and_scores_no_higher_than_uniform_attention(
    tiny_llama_gqa, text_file, monkeypatch
):
    """scan hands verdicts.verdict_remarks each type's ablated top-k set, its scores and the
    uniform-attention baselines of its token sets (checked here against the detectors on a
    uniform causal pattern of the run's lengths), and writes what it returns to summary.json's
    ``verdict_remarks`` and the report's NOTE lines; with no remark, no key (the committed runs'
    summaries stay byte-identical). The old code had neither."""
    from headprobe.analyses import detectors as det
    from headprobe.analyses import verdicts

    seen = []

    def scripted(top, scores, baselines, no_verdict=(), causal=True):
        assert causal  # a decoder's context is its causal one
        seen.append((top, scores, baselines))
        return {"induction": ["induction: a remark"]}

    kw = {"types": "previous_token,duplicate_token,induction", "n_random": 3}
    result = _scan(tiny_llama_gqa, text_file, **kw)
    assert "verdict_remarks" not in result.summary() or result.summary()["verdict_remarks"]  # {} is never written
    monkeypatch.setattr(verdicts, "verdict_remarks", scripted)
    summary, report = result.summary(), result.report()
    assert summary["verdict_remarks"] == {"induction": ["induction: a remark"]}
    assert "NOTE: induction: a remark" in report.splitlines()
    top, scores, baselines = seen[0]
    assert top == {v.head_type: v.top_heads for v in result.verifications if v.kind == "mean"}
    for t in top:
        for (layer, head), x in np.ndenumerate(result.scores[t]):
            assert scores[t][f"{layer}.{head}"] == pytest.approx(float(x))

    def uniform(T: int) -> torch.Tensor:
        return (torch.tril(torch.ones(T, T)) / torch.arange(1, T + 1)[:, None])[None, None]

    T, S, start = result.repeated.tokens.shape[1], result.repeated.period, result.repeated.start
    ref = {
        "previous_token": det.previous_token_score(uniform(result.natural.tokens.shape[1])).item(),
        "duplicate_token": det.duplicate_token_score(uniform(T), S, start).item(),
        "induction": det.induction_score(uniform(T), S, start).item(),
    }
    assert baselines == pytest.approx(ref, rel=1e-6)


def _untrusted_task_run(tiny_llama_gqa, monkeypatch):
    """A newcomer's toy-model scan in miniature (a scripted engine on the tiny Llama, 2 layers x 8
    heads, k = 3): induction on the repeated task, its top heads in layer 1, where 5 are left:
    C(5, 3) = 10 distinct layer-matched sets, p >= 1/11, never CONFIRMED, not run. Four types on the
    natural task, untrusted (no verdict), their top-k sets holding 12 of the 16 heads, fewer than 2k
    left: each draws outside its own top-k set only. Their top-k sets raise the loss by 0, every
    control set by 0-0.7, so their sequential draws settle above alpha at the h-th set. Returns
    ``(rows by (type, kind), design, the plan's lines as said)``."""
    import headprobe.analyses.verification as verif
    from headprobe.analyses.data import repeated_random_tokens

    top = {
        "previous_token": [(0, 0), (0, 1), (0, 2)],
        "duplicate_token": [(0, 3), (0, 4), (1, 4)],
        "first_token": [(0, 5), (0, 6), (0, 7)],
        "positional": [(1, 5), (1, 6), (1, 7)],
        "induction": [(1, 0), (1, 1), (1, 2)],
    }
    tops = {tuple(hs): 8.0 if t == "induction" else 0.0 for t, hs in top.items()}

    def scripted(backend, tokens, sets, kind, *a, **kw):
        return torch.stack(
            [torch.full((tokens.shape[0],), tops.get(tuple(map(tuple, s)), _noise(s, 0.7))) for s in sets]
        )

    monkeypatch.setattr(verif, "set_ablation_losses", scripted)
    rep = repeated_random_tokens(tiny_llama_gqa, 3, 8, 0)
    said: list[str] = []
    out, design = verif.verify_heads(
        tiny_llama_gqa,
        top,
        {t: "repeated" if t == "induction" else "natural" for t in top},
        {"repeated": rep, "natural": rep},
        {"repeated": torch.zeros(3), "natural": torch.zeros(3)},
        torch.zeros(1),
        VerificationSettings(k=3, n_random=20),
        untrusted={"natural": "100% of the text's tokens are unknown to the tokenizer"},
        say=said.append,
    )
    return {(v.head_type, v.kind): v for v in out}, design, said


def test_the_plan_line_says_which_sets_are_not_the_familys(tiny_llama_gqa, monkeypatch):
    """The plan line named the family only ("1 test (induction) ... at most 42 sets") while its one
    test was not run and every control set ablated was an untested type's: it now splits its most
    sets into the top-k sets, the family's control sets and the untested types'."""
    rows, design, said = _untrusted_task_run(tiny_llama_gqa, monkeypatch)
    plan = design["plan"]
    assert rows["induction", "mean"].stop_reason == "not run: cannot reach alpha"  # the premise
    # 5 types x 2 kinds top-k sets; each untested stream's sets + its first 5 for the zero rows:
    # 10 sets (C(5, 3)) for previous-token, first-token and positional, 20 drawn for duplicate-token
    assert (plan["top_sets"], plan["untested_sets"], plan["max_sets"]) == (10, 3 * 15 + 25, 10 + 70)
    assert (
        said[0]
        .split("; ")[-1]
        .startswith(
            "at most 80 sets (10 top-k sets, 0 control sets for the 1 test, 70 for the 4 types reported without a "
            "verdict: previous-token, duplicate-token, first-token, positional)"
        )
    ), said[0]
    control_ablated = sum(v.draws for v in rows.values())
    assert design["sets_ablated"] == 10 + control_ablated and control_ablated <= plan["untested_sets"]


def test_a_pool_note_names_its_pool_and_the_sets_its_row_ablated(tiny_llama_gqa, monkeypatch):
    """A toy model's NOTE said previous-token "only 9 distinct control sets exist (the heads outside the
    task's top-k sets allow no more)" beside a row of 1 set: its pool was outside its own top-k set (the
    task's top-k sets left too few heads) and its draws settled above alpha at the first. The note now
    names the pool the sets came from and how many of them its row ablated, counted here by hand."""
    rows, design, _ = _untrusted_task_run(tiny_llama_gqa, monkeypatch)
    notes = {n.split(":")[0]: n for n in design["notes"]}
    prev = rows["previous_token", "mean"]
    # its own pool: layer 0 less its 3 heads, C(5, 3) = 10 sets; h = floor(0.05 x 10) + 1 = 1: settled at the first
    assert prev.control_excludes == ["0.0", "0.1", "0.2"] and prev.draws == 1
    assert prev.stop_reason == "settled above alpha"
    assert notes["previous-token"] == (
        "previous-token: only 10 distinct layer-matched control sets exist (the heads outside its own top-3 set "
        "allow no more: the task's top-3 sets leave fewer than 6 heads), so its smallest possible p-value is 1/11; "
        "its mean-ablation draws stopped after 1 of them: settled above alpha"
    )
    assert "duplicate-token" not in notes  # C(6, 2) x 7 = 105 sets: its 20 drawn, no "only n exist" note
    # induction, the only type on its task: its pool is outside the task's top-k sets (its own); not run
    assert rows["induction", "mean"].control_excludes == ["1.0", "1.1", "1.2"]
    assert notes["induction"] == (
        "induction: only 10 distinct layer-matched control sets exist (the heads outside the task's top-3 sets "
        "allow no more), so its smallest possible p-value is 1/11: it cannot be CONFIRMED; none of them was "
        "ablated: not run"
    )
    # the caption said "drawn outside every top-3 set of the task" of them all
    from headprobe.analyses import figures as figs

    caption = figs.ablation_caption([v.to_dict() for v in rows.values()], design).splitlines()[0]
    assert (
        "(layer-matched, drawn outside every top-3 set of the task; on the natural task outside the type's own "
        "top-3 set only, as the task's top-3 sets leave fewer than 6 heads)" in caption
    ), caption


@pytest.mark.parametrize("k, own", [(3, False), (5, True)])
def test_the_reports_control_line_names_a_task_drawn_outside_each_types_own_top_k(tiny_llama_gqa, text_file, k, own):
    """The report said "control: ... sets of k heads outside the task's top-k" also where the natural
    task's top-k sets leave fewer than 2k of the tiny Llama's 16 heads (at -k 5), so that each type drew
    outside its own top-k set only (its rows' ``control_excludes``): it says so then, naming the task,
    and reads as before where they leave enough (-k 3)."""
    result = _scan(tiny_llama_gqa, text_file, n_random=3, k=k)
    natural = [v for v in result.verifications if v.task == "natural"]
    union = sorted({h for v in natural for h in v.top_heads})
    assert (16 - len(union) < 2 * k) == own  # the premise, by the documented rule
    assert all(sorted(v.control_excludes) == (sorted(v.top_heads) if own else union) for v in natural)
    (line,) = [ln for ln in result.report().splitlines() if "control: layer-matched" in ln]
    said = (
        f"sets of k heads outside the task's top-k (on the natural task outside the type's own top-{k} set only, "
        f"as the task's top-{k} sets leave fewer than {2 * k} heads), at most"
    )
    assert (said in line) == own and ("outside the task's top-k, at most" in line) != own, line


def test_a_remark_on_a_type_without_verdict_speaks_of_its_ablation_not_a_verdict(
    tiny_llama_gqa, text_file, monkeypatch
):
    """A toy model's untrusted duplicate-token (no verdict) got the NOTE "... the verdict says ablating them
    matters, not that they attend as duplicate-token heads do". scan hands verdicts.verdict_remarks the
    types without a verdict (their tested row's ``confirmed`` null); their remarks speak of the ablation."""
    from headprobe.analyses import verdicts

    top = {"previous_token": ["0.0", "0.1"], "induction": ["0.0", "0.1"]}
    scores = {"previous_token": {"0.0": 0.01, "0.1": 0.02}, "induction": {"0.0": 0.01, "0.1": 0.02}}
    said = verdicts.verdict_remarks(
        top, scores, {"previous_token": 0.05, "induction": 0.05}, no_verdict={"previous_token"}
    )
    assert said["previous_token"] == [
        "previous-token: 2 of its 2 top heads (0.0, 0.1) are also induction's top heads, so its ablation (no verdict "
        "here) re-tests much of that set",
        "previous-token: 2 of its 2 top heads score at or below 0.05, the previous-token score of a head attending "
        "uniformly over its causal context (the highest, 0.02, is 0.4x it): their ablation (no verdict here) tests "
        "these heads, not heads that attend as previous-token heads do",
    ]
    assert said["induction"][0].endswith("so its verdict re-tests much of that set")  # a type with a verdict: as before
    assert said["induction"][1].endswith(
        "the verdict says ablating them matters, not that they attend as induction heads do"
    )

    import headprobe.commands.scan_core as core

    result = _scan(tiny_llama_gqa, text_file, n_random=3, types="previous_token,induction")
    rows = {v.head_type: v for v in result.verifications if v.kind == "mean"}
    assert rows["previous_token"].confirmed is None  # the premise: the random model's natural task is untrusted
    seen: dict = {}
    monkeypatch.setattr(verdicts, "verdict_remarks", lambda *a, **kw: seen.update(kw) or {})
    core.verdict_remarks(result)
    assert seen["no_verdict"] == {t for t, v in rows.items() if v.confirmed is None}


def test_the_control_rule_states_the_own_pool_of_a_tiny_model(tiny_llama_gqa, text_file):
    """summary.json's control_rule said "from the heads outside the top-k of every type judged on the same
    task" in every run; at -k 5 the tiny Llama's natural types draw outside their own top-5 set only (their
    rows' control_excludes), which the rule now states."""
    result = _scan(tiny_llama_gqa, text_file, n_random=3, k=5)
    assert all(sorted(v.control_excludes) == sorted(v.top_heads) for v in result.verifications if v.task == "natural")
    rule = result.summary()["verification"]["control_rule"]
    assert "or, where those leave fewer than 2k heads (a tiny model), outside its own top-k" in rule, rule


def test_the_plan_line_says_what_its_most_sets_count_when_every_type_is_tested():
    """import's plan line read "--n-random 10 kept (--keep-n-random); at most 17 sets" with nothing on
    the 17: one test's top-k set under each of 2 kinds, its 10 control sets, and the first 5 of them
    (SECONDARY_DRAWS) ablated again by zero-ablation. The counts are the plan's, counted here by hand."""
    from headprobe.analyses.verification import _planned_sets, _Test, plan_lines

    tests = [_Test("imported", "repeated", [(0, 0)], stream=0)]
    counts = _planned_sets(tests, [[[(1, 0)]] * 10], ("mean", "zero"), "mean", 5)
    assert (counts["max_sets"], counts["top_sets"], counts["secondary_sets"]) == (1 * 2 + 10 + 5, 2, 5)
    plan = {
        "family_size": 1,
        "lone_draws_needed": 19,
        "n_random": 10,
        "family": ["imported"],
        "correction": "bh",
        "alpha": 0.05,
        "raised": False,
        "kept": True,
        "n_random_requested": 10,
        "tests": [],
        **counts,
    }  # fmt: skip
    line = plan_lines(plan)[0]
    assert line.endswith(
        "--n-random 10 kept (--keep-n-random); at most 17 sets (2 top-k sets: 1 test x 2 kinds; 10 control sets; "
        "5 of them again as zero-ablation)"
    ), line


def test_control_set_counts_past_the_cap_are_refused_before_any_set_is_drawn(tmp_path, capsys):
    """``scan --n-random 99999999999999999999`` was taken, and its control sets, drawn up front, filled
    22 GB until the kernel killed the process (exit 137, no line; walk fuzz). Above
    MAX_N_RANDOM it is refused in one line before a model loads, and so is an ``--alpha`` whose lone
    verdict needs more draws than that (with ``--keep-n-random`` the count given stands)."""
    from headprobe.analyses.verification import plan_draws
    from headprobe.analyses.vocabulary import MAX_N_RANDOM
    from headprobe.cli import main

    for command in ("scan", "robustness"):
        argv = [command, "--model", str(tmp_path / "no-model"), "--out", str(tmp_path / command)]
        assert main([*argv, "--n-random", "99999999999999999999"]) == 2
        err = capsys.readouterr().err.splitlines()
        assert err == ["headprobe: error: --n-random must be at most 100,000 (a p-value resolves 1/(n+1); each set "
                       "is one ablation pass), got 99,999,999,999,999,999,999"], err  # fmt: skip
        assert not (tmp_path / command).exists()
    with pytest.raises(HeadprobeError, match="at most 100,000"):
        VerificationSettings(k=3, n_random=MAX_N_RANDOM + 1)
    settings = VerificationSettings(k=3, alpha=1e-9)
    with pytest.raises(HeadprobeError, match="needs 4,999,999,999 control sets .* use a larger --alpha"):
        plan_draws(5, settings)  # Bonferroni or BH over 5 types: 5 / alpha - 1 draws for one verdict alone
    assert plan_draws(5, dataclasses.replace(settings, keep_n_random=True)) == settings.n_random
    assert plan_draws(5, VerificationSettings(k=3, n_random=MAX_N_RANDOM)) == MAX_N_RANDOM  # the cap itself is taken
