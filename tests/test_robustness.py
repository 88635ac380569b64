"""``headprobe robustness`` -- the set statistics against hand computations and scipy, and
the command on a tiny model: conditions that cannot move a top-k set give stability 1 and Jaccard 1,
and the reported Jaccard and stabilities equal a hand computation from the reported top-k sets."""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd
import pytest
import torch

from headprobe.analyses import robustness as rb


def test_jaccard_by_hand():
    a, b, c = {(0, 0), (0, 1)}, {(0, 1), (1, 2)}, {(0, 0), (0, 1)}
    assert rb.jaccard(a, b) == pytest.approx(1 / 3)
    assert rb.jaccard(a, c) == 1.0 and rb.jaccard(set(), set()) == 1.0
    assert rb.mean_pairwise_jaccard([a, b, c]) == pytest.approx((1 / 3 + 1 + 1 / 3) / 3)
    assert np.isnan(rb.mean_pairwise_jaccard([a]))


def test_stability_and_its_bootstrap_interval():
    """The fraction is a count; the percentile bootstrap is degenerate for constant indicators and
    close to scipy's percentile bootstrap otherwise (both resample the conditions)."""
    from scipy.stats import bootstrap

    sets = [{(0, 0)}, {(0, 0)}, {(1, 1)}, {(0, 0)}]
    assert rb.stability(sets, (0, 0))[0] == 0.75 and rb.stability(sets, (2, 2))[0] == 0.0
    assert rb.stability([{(0, 0)}] * 5, (0, 0)) == (1.0, 1.0, 1.0)
    x = np.array([1, 0, 1, 1, 0, 1, 1, 1, 0, 1], dtype=float)
    lo, hi = rb.bootstrap_interval(x, n_boot=20000, seed=1)
    ref = bootstrap((x,), np.mean, n_resamples=20000, method="percentile", random_state=2).confidence_interval
    assert abs(lo - ref.low) <= 0.1 and abs(hi - ref.high) <= 0.1 and lo < x.mean() < hi


def test_stabilities_are_printed_as_counts_of_conditions():
    """5/8 and 7/8 read alike (``.2f`` rounds half to even: 0.62 but 0.88); a bound that is not a
    whole number of conditions keeps 2 decimals."""
    from headprobe.commands.robustness_core import stability_text

    assert stability_text(5 / 8, 3 / 8, 7 / 8, 8) == "5/8 [3/8, 7/8]"
    assert stability_text(7 / 8, 5 / 8, 1.0, 8) == "7/8 [5/8, 8/8]"
    assert stability_text(2 / 3, 0.5, 1.0, 3) == "2/3 [0.50, 3/3]"
    assert stability_text(0.8333, 0.5, 1.0, 6) == "5/6 [3/6, 6/6]"  # as robustness.csv keeps it


@pytest.mark.parametrize("n", [6, 15])
def test_sign_flip_p_against_scipy(n):
    """Exact (n < 13, every flip) and Monte Carlo (n >= 13) sign-flip p-values against
    scipy.stats.permutation_test's paired (one-sample ``samples``) test of |mean|."""
    from scipy.stats import permutation_test

    rng = np.random.default_rng(0)
    d = rng.normal(0.4, 1.0, size=(n, 3))
    d[:, 2] = 0.0  # no change at all: p = 1
    p = rb.sign_flip_p(d, n_perm=20000, seed=3)
    for j in range(2):
        ref = permutation_test(
            (d[:, j],),
            lambda x: abs(np.mean(x)),
            permutation_type="samples",
            alternative="greater",
            n_resamples=np.inf if n < 13 else 20000,
            random_state=4,
        ).pvalue
        assert p[j] == pytest.approx(ref, abs=1e-12 if n < 13 else 0.01), (j, p[j], ref)
    assert p[2] == 1.0


def test_fake_quantize_by_hand():
    from headprobe.probe.requantize import fake_quantize

    w = torch.tensor([[1.0, -0.5, 0.25, 0.0], [0.1, 0.2, 0.3, -0.4]])
    s = torch.tensor([[1.0], [0.4]]) / 127
    assert torch.allclose(fake_quantize(w, "int8"), torch.round(w / s) * s)
    q = fake_quantize(w, "int3", group=4)  # one group per row: 8 levels from the row's min to max
    lo = w.min(dim=1, keepdim=True).values
    step = (w.max(dim=1, keepdim=True).values - lo) / 7
    assert torch.allclose(q, torch.round((w - lo) / step) * step + lo)
    assert (q - w).abs().max() <= step.max() / 2 + 1e-7


@pytest.fixture(scope="module")
def tiny(tiny_tokenizer):
    import zoo

    from headprobe.probe.backends.wrapping import wrap

    return wrap(zoo.make_checkpoint("llama", tiny_tokenizer), backend="native")


SMALL = {"seq_len": 32, "period": 10, "n_natural": 4, "n_repeated": 4, "k": 2, "n_random": 19}


def test_conditions_that_cannot_move_the_top_k_give_stability_one(tiny, text_file):
    """Ablation kinds and control seeds change the verdicts' draws, not the scores: every condition
    has the base's top-k set, so each of its heads has stability 1 [1, 1] and the Jaccard is 1."""
    from headprobe.commands.robustness_core import robustness

    r = robustness(tiny, types="induction,positional", vary="kind,seed", text=str(text_file), **SMALL)
    for name, rec in r.types.items():
        assert rec["conditions"] == ["base", "kind zero", "kind resample", "controls seed 1", "controls seed 2"]
        assert rec["mean_jaccard"] == 1.0
        rows = r.table[r.table["type"] == name]
        assert len(rows) == 2 and (rows["stability"] == 1.0).all() and (rows["ci95_low"] == 1.0).all()


def test_each_verdict_keeps_the_counts_its_p_is_made_of(tiny, text_file, monkeypatch):
    """robustness stored each condition's adjusted p alone: induction's 0.05 in 7 of 8 conditions, exactly alpha,
    read as borderline though it is the smallest p 19 draws allow. summary.json keeps scan's raw p, draws,
    exceedances, largest control effect and stop reason for each verdict, and the terminal's verdict line gives
    the adjusted p and the counts. (scan's verification, faked here with known counts, is tested in test_scan;
    a tiny random model's tasks are untrusted, so its own verdicts carry no p.)"""
    import dataclasses

    import headprobe.commands.robustness_core as rc

    real = rc.verif.verify_heads

    def counted(*args, **kwargs):
        rows, notes = real(*args, **kwargs)
        draws = {"base": 19, "controls seed 1": 39, "controls seed 2": 99}
        out = []
        for i, v in enumerate(rows):
            n = draws[counted.names.pop(0)] if counted.names and i == 0 else 19
            out.append(dataclasses.replace(v, draws=n, exceedances=i, p_value=(1 + i) / (1 + n), p_adjusted=0.05 + i))
        return out, notes

    counted.names = ["base", "controls seed 1", "controls seed 2"]
    monkeypatch.setattr(rc.verif, "verify_heads", counted)
    r = rc.robustness(tiny, types="induction", vary="seed", text=str(text_file), **SMALL)
    rec = r.summary()["types"]["induction"]
    said = next(x for x in r.report().splitlines() if x.startswith("  verdicts:"))
    for cond, n in (("base", 19), ("controls seed 1", 39), ("controls seed 2", 99)):
        v = rec["verdicts"][cond]
        assert v["draws"] == n and v["p_value"] == pytest.approx((1 + v["exceedances"]) / (1 + n))
        assert {"random_max", "stop_reason", "p_value_is_bound"} <= set(v)
        assert (
            f"{cond}: " in said and f"(p_adj {v['p_adjusted']:.3g}; {v['exceedances']} of {n} draws reached it)" in said
        )


def test_report_counts_only_conditions_that_apply_and_gives_the_least_top_k_overlap(tiny, text_file):
    """With ``--types induction`` the text's second half changes no type: it is left out (a note),
    not counted among the run's conditions; the type's line says how many conditions CONFIRM it and
    which condition's top-k set shares the fewest heads with the base's (a hand count of the sets)."""
    from headprobe.commands.robustness_core import robustness

    r = robustness(tiny, types="induction", vary="data,detector", text=str(text_file), **SMALL)
    rec = r.summary()["types"]["induction"]
    assert (
        [o.condition.name for o in r.outcomes]
        == rec["conditions"]
        == [
            "base",
            "repeats seed 1",
            "repeats period 6",
            "induction by copying",
        ]
    )
    assert any(n.startswith("text half 2: left out") for n in r.notes)
    report = r.report()
    assert report.startswith(f"{r.spec.name}: 4 conditions, k = 2")
    base = set(rec["top_k"]["base"])
    shared = {c: len(base & set(t)) for c, t in rec["top_k"].items() if c != "base"}
    least = min(shared.values())
    where = next(c for c, n in shared.items() if n == least)
    held = sum(v["confirmed"] is True for v in rec["verdicts"].values())
    none = sum(v["confirmed"] is None for v in rec["verdicts"].values())
    # all "?" (a random tiny model's) is no "CONFIRMED in 0 of 4", which read as four failures
    said = "no verdict in any of the 4 conditions" if none == 4 else f"CONFIRMED in {held} of 4 conditions"
    said += f" (no verdict in {none})" if 0 < none < 4 else ""
    line = next(x for x in report.splitlines() if x.startswith("induction:"))
    assert line.endswith(f"; {said}; top-2 least shared with base: {least}/2 heads ({where})"), line
    assert "holds everywhere" not in report


def test_reported_jaccard_and_stability_equal_a_hand_computation(tiny, text_file, tmp_path):
    """With disjoint data and the copying detector the top-k sets move; the summary's Jaccard and
    the CSV's stabilities equal plain set arithmetic over the reported top-k sets."""
    from headprobe.commands.robustness_core import robustness

    r = robustness(tiny, types="induction,positional", vary="data,detector", text=str(text_file), **SMALL)
    summary = r.summary()
    moved = False
    for rec in summary["types"].values():
        sets = [set(v) for v in rec["top_k"].values()]
        pairs = [len(a & b) / len(a | b) for a, b in itertools.combinations(sets, 2)]
        assert rec["mean_jaccard"] == pytest.approx(sum(pairs) / len(pairs))
        moved |= rec["mean_jaccard"] < 1
        for head, st in rec["stability"].items():
            assert st["stability"] == pytest.approx(sum(head in s for s in sets) / len(sets))
    assert moved  # not a vacuous check: some condition changed a top-k set
    assert summary["types"]["induction"]["conditions"] == [
        "base",
        "repeats seed 1",
        "repeats period 6",
        "induction by copying",
    ]
    assert summary["types"]["positional"]["conditions"] == ["base", "text half 2"]
    # the report says which of the run's conditions a type does not have, so its counts add up
    report = r.report()
    assert "induction: mean top-k Jaccard" in report and "over 4 conditions (text half 2: not for this type)" in report
    left = "repeats seed 1, repeats period 6, induction by copying: not for this type"
    assert f"over 2 conditions ({left})" in report and report.startswith(f"{r.spec.name}: 5 conditions")
    # robustness.csv names a head as head_scores.csv does: its layer and its index within the layer,
    # integers when read back, one row per head of the type's top-k sets (a "5.10" read as 5.1 cannot clash)
    import io

    csv = pd.read_csv(io.StringIO(r.table.to_csv(index=False)))
    assert csv["layer"].dtype.kind == "i" and csv["head"].dtype.kind == "i"
    for name, rec in summary["types"].items():
        rows = csv[csv["type"] == name]
        assert {f"{l}.{h}" for l, h in zip(rows["layer"], rows["head"])} == set().union(
            *map(set, rec["top_k"].values())
        )
    # each condition's column is 0/1 as written (empty where the condition is not the type's), never
    # the 0.0000/1.0000 of a float column that a type's missing conditions turned into NaN
    r.save(tmp_path / "out")
    written = pd.read_csv(tmp_path / "out" / "robustness.csv", dtype=str, keep_default_na=False)
    for name in summary["types"]["induction"]["conditions"] + summary["types"]["positional"]["conditions"]:
        assert set(written[name]) <= {"0", "1", ""}, (name, set(written[name]))


@pytest.fixture
def cli_args(tiny_tokenizer, text_file, tmp_path):
    """``headprobe robustness`` on the tiny llama saved at ``tmp_path/m``, two conditions (SMALL's settings)."""
    import zoo

    m = str(zoo.save_dir("llama", tiny_tokenizer, tmp_path / "m"))
    args = ["robustness", "--model", m, "--device", "cpu", "--text", str(text_file), "--vary", "seed"]
    args += ["--control-seeds", "1", "--seq-len", "32", "--period", "10", "--n-natural", "4", "--n-repeated", "4"]
    return [*args, "--top-k", "2", "--n-random", "19"]


def test_the_control_set_batch_is_planned_in_the_header(cli_args, tmp_path, capsys):
    """robustness prints its plan after the load: the verification's control-set batch of its larger
    token set, :func:`set_plan` of the 4 natural windows of 32 tokens (the repeated sequences are
    2 x 10 tokens after BOS), computed here by hand in scan's words."""
    from headprobe.analyses.ablation import set_plan
    from headprobe.cli import main
    from headprobe.probe.backends.loading import load_model
    from headprobe.probe.core import memory

    capsys.readouterr()
    assert main([*cli_args, "--out", str(tmp_path / "o"), "--memory-budget", "64MiB"]) == 0
    out = capsys.readouterr().out
    model = load_model(str(tmp_path / "m"), device="cpu", backend="native")
    with memory.budget_restored():
        memory.set_budget("64MiB")
        plan = set_plan(model, 4, 32)
    want = f"{plan.line()}: {plan.items // 4} control sets of 4 sequences per pass"
    assert want in out.splitlines(), out


def test_a_budget_below_one_scoring_forward_is_refused_before_the_run(
    cli_args, text_file, tmp_path, capsys, monkeypatch
):
    """A 1 KiB budget is refused after the load and before any condition is drawn or scored (the old
    code refused it only at the verification's first control set, after scoring): one line naming
    the scoring forward, exit 2, no traceback, no --out folder; the Python function refuses it too,
    for a model given by name or loaded."""
    from headprobe.cli import main
    from headprobe.commands import robustness_core
    from headprobe.commands.robustness_core import robustness
    from headprobe.probe.backends.loading import load_model
    from headprobe.probe.core.errors import HeadprobeError

    def ran(*args, **kwargs):
        raise AssertionError("a condition was drawn before the budget was checked")

    monkeypatch.setattr(robustness_core, "conditions", ran)
    capsys.readouterr()
    code = main([*cli_args, "--out", str(tmp_path / "p"), "--memory-budget", "1KiB"])
    err = capsys.readouterr().err
    errors = [x for x in err.splitlines() if x.startswith("headprobe: error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err and not (tmp_path / "p").exists(), err
    assert "robustness's natural scores" in errors[0] and "--memory-budget" in errors[0], errors[0]
    for model in (str(tmp_path / "m"), load_model(str(tmp_path / "m"), device="cpu", backend="native")):
        with pytest.raises(HeadprobeError, match="robustness's natural scores .* working memory"):
            robustness(model, device="cpu", text=str(text_file), memory_budget="1KiB", **SMALL)


def test_a_given_period_4_gets_the_other_period_3():
    """``--period 4`` was refused: its default other period max(4, 3 * 4 // 5) = 4 is --period; 3 is taken.
    Other periods keep the rule (10 -> 6, 3 -> 4), and a given --other-period equal to --period is refused."""
    from headprobe.commands.robustness import RobustnessConfig
    from headprobe.probe.core.errors import HeadprobeError

    assert [RobustnessConfig(model="m", period=p).resolved_other_period() for p in (4, 10, 3)] == [3, 6, 4]
    with pytest.raises(HeadprobeError, match="--other-period 10 is --period 10"):
        RobustnessConfig(model="m", period=10, other_period=10)


@pytest.mark.parametrize("n_ctx, other", [(10, 3), (7, None)])
def test_the_default_other_period_is_never_the_fitted_period(tiny_tokenizer, text_file, n_ctx, other):
    """Without --period a 10-token context fits period (10 - 1) // 2 = 4, and the default other period
    max(4, 3 * 4 // 5) = 4 drew the base's own sequences ("repeats period 4"): the next shorter, 3, is
    taken. At 7 tokens (period 3) no other block of 3 tokens or more fits: refused in one line."""
    import zoo

    from headprobe.commands.robustness import RobustnessConfig
    from headprobe.commands.robustness_core import conditions, resolved
    from headprobe.probe.backends.wrapping import wrap
    from headprobe.probe.core.errors import HeadprobeError

    model = wrap(zoo.make_checkpoint("llama", tiny_tokenizer, max_position_embeddings=n_ctx), backend="native")
    config = RobustnessConfig(model="m", types="induction", vary="data", text=str(text_file), n_natural=2, n_repeated=2)
    if other is None:
        with pytest.raises(HeadprobeError) as e:
            resolved(model, config)
        assert "--period 3" in str(e.value) and "7 tokens" in str(e.value) and "\n" not in str(e.value)
        return
    cfg = resolved(model, config)
    assert cfg.period == 4
    conds, _ = conditions(model, cfg, 2)
    base = conds[0].repeated.tokens
    repeats = [c for c in conds if c.name.startswith("repeats period")]
    assert [c.name for c in repeats] == [f"repeats period {other}"]
    assert repeats[0].repeated.tokens.shape[1] == base.shape[1] - 2 * (4 - other)  # [BOS] + 2 x period


@pytest.mark.figures
def test_the_stability_figure_has_a_legend_and_axis_labels_with_units():
    """robustness.png's y label read "head  stability [95% bootstrap]" over two columns of tick text, like a table
    header, and only its title said what dark and light meant. The committed run redrawn: a legend keys the dark
    (in the top-k set), light (not in it) and blank cells in their drawn colours and the marks above the columns;
    the left axis names the heads, the right one the stability with its unit and interval; the title is a title."""
    import json
    from pathlib import Path

    import matplotlib.colors as mcolors

    from headprobe.commands.robustness_core import IN_TOP_K, NOT_IN_TOP_K, stability_plot

    d = Path(__file__).resolve().parents[1] / "figures" / "smollm2-135m-robustness"
    meta = json.loads((d / "summary.json").read_text())
    table = pd.read_csv(d / "robustness.csv")
    conds = [c["name"] for c in meta["conditions"]]
    fig = stability_plot(table, meta["types"], conds, meta["model"], meta["config"]["k"])
    (legend,) = fig.legends
    keys = {t.get_text(): h for t, h in zip(legend.get_texts(), legend.legend_handles)}
    dark = next(h for label, h in keys.items() if "in the condition's top-k set" in label)
    light = next(h for label, h in keys.items() if "not in" in label)
    assert mcolors.same_color(dark.get_facecolor(), IN_TOP_K) and mcolors.same_color(
        light.get_facecolor(), NOT_IN_TOP_K
    )
    assert any("blank" in label for label in keys) and any("✓ CONFIRMED" in label for label in keys), list(keys)
    panels = [ax for ax in fig.axes if ax.images]
    assert len(panels) == len(meta["types"])
    for ax, name in zip(panels, meta["types"]):
        cmap = ax.images[0].get_cmap()
        assert mcolors.same_color(cmap(1.0), IN_TOP_K) and mcolors.same_color(cmap(0.0), NOT_IN_TOP_K)
        assert ax.get_ylabel() == "head (layer.head)"
        (right,) = ax.child_axes
        assert "conditions with" in right.get_ylabel() and "95% bootstrap CI" in right.get_ylabel()
        rows = table[table["type"] == name]
        assert [t.get_text() for t in ax.get_yticklabels()] == [f"{l}.{h}" for l, h in zip(rows["layer"], rows["head"])]
        # the count before the interval is the head's 0/1 cells in the type's condition columns
        held = rows[[c for c in conds if c in rows and rows[c].notna().all()]].iloc[0]
        assert right.get_yticklabels()[0].get_text().startswith(f"{int(held.sum())}/{len(held)} [")
    assert fig.get_suptitle() == "Label stability of smollm2-135m, k = 10"


@pytest.mark.figures
def test_a_condition_with_no_verdict_is_the_same_question_mark_in_the_terminal_and_the_figure():
    """A condition that ran and reached no verdict printed "-" in the terminal's verdict line (the
    mark docs/robustness.md keeps for a condition that is not the type's) while robustness.png drew
    "?", and its reason was only in summary.json. The committed run with one verdict made "no
    verdict": the terminal prints "?" where the figure does, every other column alike, and a NOTE
    gives the reason."""
    import copy
    import json
    from pathlib import Path
    from types import SimpleNamespace

    from headprobe.commands.robustness_core import RobustnessResult, format_report, stability_plot

    d = Path(__file__).resolve().parents[1] / "figures" / "smollm2-135m-robustness"
    meta = json.loads((d / "summary.json").read_text())
    types = copy.deepcopy(meta["types"])
    types["induction"]["verdicts"]["repeats seed 1"] = {
        "confirmed": None,
        "p_adjusted": None,
        "top_effect": 0.02,
        "no_verdict": "clean loss 7.62 nats is above ln(vocabulary) = 7.60",
    }
    table = pd.read_csv(d / "robustness.csv")
    conds = [c["name"] for c in meta["conditions"]]
    result = RobustnessResult.__new__(RobustnessResult)  # what format_report reads of a run, no run
    for field, value in {
        "spec": SimpleNamespace(name=meta["model"]),
        "config": SimpleNamespace(k=meta["config"]["k"]),
        "outcomes": [SimpleNamespace(condition=SimpleNamespace(name=c)) for c in conds],
        "table": table,
        "types": types,
        "notes": [],
    }.items():
        object.__setattr__(result, field, value)
    report = format_report(result).splitlines()
    fig = stability_plot(table, types, conds, meta["model"], meta["config"]["k"])
    words = {"CONFIRMED": "✓", "not confirmed": "✗"}
    for ax, name in zip([ax for ax in fig.axes if ax.images], types):
        drawn = {round(t.get_position()[0]): t.get_text() for t in ax.texts}
        line = report[report.index(next(x for x in report if x.startswith(f"{name}:"))) + 1]
        printed = dict(part.split(": ", 1) for part in line.removeprefix("  verdicts: ").split(", "))
        assert list(printed) == list(types[name]["verdicts"]), line
        for j, c in enumerate(conds):
            if c in printed:
                assert words.get(printed[c], printed[c][:1]) == drawn[j], (name, c, printed[c], drawn[j])
            else:
                assert drawn[j] == "–", (name, c)
    assert "repeats seed 1: ? (no verdict: NOTE below)" in "\n".join(report)
    assert (
        "NOTE: repeats seed 1: no verdict (?) for induction: clean loss 7.62 nats is above ln(vocabulary) = 7.60"
        in report
    )
