"""The intervals of ``headprobe kv``: the block bootstrap of a per-token mean against scipy's bootstrap
on blocks cut by a loop, its known answers (identical losses, a constant shift, too few blocks), its
coverage on an autocorrelated series where a token-by-token bootstrap under-covers, and the paired
differences of two policies' per-token values (the copy accuracy's Student-t interval over sequences
against scipy's). No model: numpy, scipy and hand-made Quality objects."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from headprobe.analyses import kvpolicy as kp
from headprobe.analyses.statistics import MIN_BLOCKS, block_bootstrap_ci, block_length


def ar1(n_series: int, n: int, phi: float, seed: int) -> np.ndarray:
    """``[n_series, n]`` stationary AR(1) series of mean 0 and unit innovations (a token's loss change
    carries over to its neighbours)."""
    rng = np.random.default_rng(seed)
    e = rng.normal(size=(n_series, n))
    x = np.empty_like(e)
    x[:, 0] = e[:, 0] / np.sqrt(1 - phi**2)
    for t in range(1, n):
        x[:, t] = phi * x[:, t - 1] + e[:, t]
    return x


def test_block_length_is_the_cube_root_rounded_up():
    assert [block_length(n) for n in (1, 8, 9, 46, 1000, 1022, 4094)] == [1, 2, 3, 4, 10, 11, 16]


def test_block_bootstrap_equals_scipys_bootstrap_of_the_blocks():
    """Blocks cut by a loop (none crossing a window, the last one short), then scipy's percentile
    bootstrap of sum / tokens over them (paired: a block's sum and size are drawn together). The two
    draw different resamples, so they agree to the Monte Carlo error (about 1% of the width each)."""
    from scipy.stats import bootstrap

    x = ar1(2, 301, 0.6, seed=3) + 0.1  # 301 = 43 * 7: blocks of 7, none short; then blocks of 10 (31 short)
    for block in (7, 10):
        sums, sizes = [], []
        for w in range(2):
            for a in range(0, 301, block):
                sums.append(x[w, a : a + block].sum())
                sizes.append(len(x[w, a : a + block]))
        ref = bootstrap(
            (np.array(sums), np.array(sizes, dtype=float)),
            lambda s, n, axis=-1: s.sum(axis) / n.sum(axis),
            paired=True,
            n_resamples=10_000,
            method="percentile",
            random_state=7,
        ).confidence_interval
        got = block_bootstrap_ci(x, block_len=block)
        width = ref.high - ref.low
        assert got == pytest.approx([ref.low, ref.high], abs=0.05 * width), (block, got, ref)
    # blocks of one token: the ordinary bootstrap of the mean (scipy's, on the tokens themselves)
    y = x[:1, :200]
    ref = bootstrap((y[0],), np.mean, n_resamples=10_000, method="percentile", random_state=1).confidence_interval
    assert block_bootstrap_ci(y, block_len=1) == pytest.approx([ref.low, ref.high], abs=0.05 * (ref.high - ref.low))


def test_block_bootstrap_known_answers():
    """Identical losses: a zero-width interval at 0; a constant shift: one at the shift; too few
    blocks or a NaN: no interval (NaN, JSON null), never a made-up one."""
    assert block_bootstrap_ci(np.zeros((1, 1022))).tolist() == [0.0, 0.0]
    assert block_bootstrap_ci(np.full((3, 46), 0.0125)) == pytest.approx([0.0125, 0.0125], abs=1e-15)
    n = MIN_BLOCKS * 4 - 1  # blocks of 4 (ceil(39^(1/3))): 10 blocks, the last short
    assert np.isfinite(block_bootstrap_ci(np.ones(n))).all()
    assert np.isnan(block_bootstrap_ci(np.ones(n), block_len=n // (MIN_BLOCKS - 1) + 1)).all()  # 9 blocks
    x = np.ones(100)
    x[5] = np.nan
    assert np.isnan(block_bootstrap_ci(x)).all()
    # the interval is of the mean over tokens: a shift moves both bounds by it exactly
    z = ar1(1, 500, 0.5, seed=0)
    assert block_bootstrap_ci(z + 2.0) == pytest.approx(block_bootstrap_ci(z) + 2.0, abs=1e-12)


def test_blocks_keep_the_coverage_a_token_bootstrap_loses():
    """300 AR(1) series (phi 0.5, 1,022 tokens, mean 0): the block bootstrap's 95% interval holds the
    mean 0 in about 0.9 of them; resampling tokens one by one (blocks of 1) ignores the correlation
    (variance ratio (1 + phi) / (1 - phi) = 3) and covers about P(|Z| < 1.96 / sqrt 3) = 0.74."""
    x = ar1(300, 1022, 0.5, seed=11)
    block = np.array([block_bootstrap_ci(s, n_boot=2000) for s in x])
    token = np.array([block_bootstrap_ci(s, block_len=1, n_boot=2000) for s in x])
    cover_block = np.mean((block[:, 0] <= 0) & (0 <= block[:, 1]))
    cover_token = np.mean((token[:, 0] <= 0) & (0 <= token[:, 1]))
    assert cover_block >= 0.86 and cover_token <= 0.82, (cover_block, cover_token)


def _quality(nat: torch.Tensor, hits: torch.Tensor) -> kp.Quality:
    return kp.Quality(float(nat.mean()), 0.0, float(hits.mean()), {}, nat, hits)


def test_paired_difference_of_two_policies():
    """The chosen minus a control, token by token: identical values give [0, 0] for the loss, and for the
    copy accuracy over 4 sequences the bound of sequences that agree, [-0.602, +0.602] (exactly [0, 0]
    only where the two are one computation: ``identical``); a policy that loses
    0.02 nats on every token gives [0.02, 0.02]; the copy accuracy's interval is scipy's t interval of
    the per-sequence accuracy differences; against the random policies' mean (:func:`mean_quality`)
    the difference is the mean of the differences. No interval without per-token values."""
    from scipy.stats import ttest_1samp

    g = torch.Generator().manual_seed(0)
    nat = torch.rand(2, 60, generator=g) * 3
    hits = (torch.rand(4, 5, generator=g) > 0.5).float()
    a = _quality(nat, hits)
    same = kp.paired_difference(a, _quality(nat.clone(), hits.clone()))
    assert [same[k] for k in ("natural_loss_ci95_lo", "natural_loss_ci95_hi")] == [0.0, 0.0]
    b = 1 - 0.025 ** (1 / 4)  # Clopper-Pearson's upper bound for 0 of 4 (scipy's in the test below)
    assert [same[k] for k in ("copy_accuracy_ci95_lo", "copy_accuracy_ci95_hi")] == pytest.approx([-b, b])
    exact = kp.paired_difference(a, _quality(nat.clone(), hits.clone()), identical=True)
    assert [exact[k] for k in ("copy_accuracy_ci95_lo", "copy_accuracy_ci95_hi")] == [0.0, 0.0]
    shifted = kp.paired_difference(_quality(nat + 0.02, hits), a)
    assert shifted["natural_loss"] == pytest.approx(0.02, abs=1e-6)
    assert [shifted["natural_loss_ci95_lo"], shifted["natural_loss_ci95_hi"]] == pytest.approx([0.02, 0.02], abs=1e-6)
    other = (torch.rand(4, 5, generator=g) > 0.3).float()
    d = kp.paired_difference(a, _quality(nat, other))
    per_seq = (hits.mean(1) - other.mean(1)).double().numpy()
    ref = ttest_1samp(per_seq, 0.0).confidence_interval(0.95)
    assert d["copy_accuracy"] == pytest.approx(float(hits.mean() - other.mean()))
    assert [d["copy_accuracy_ci95_lo"], d["copy_accuracy_ci95_hi"]] == pytest.approx([ref.low, ref.high])
    b1, b2 = _quality(nat + 0.1, other), _quality(nat - 0.3, hits)
    mean = kp.paired_difference(a, kp.mean_quality([b1, b2]))
    one, two = kp.paired_difference(a, b1), kp.paired_difference(a, b2)
    assert mean["natural_loss"] == pytest.approx((one["natural_loss"] + two["natural_loss"]) / 2, abs=1e-6)
    assert mean["copy_accuracy"] == pytest.approx((one["copy_accuracy"] + two["copy_accuracy"]) / 2)
    # 3 sequences that differ by 1, 0 and 1: the t interval [-0.77, 2.10] overshoots what a difference
    # of accuracies can be; the interval is clipped to [-1, 1] (the SmolLM2 run printed +1.456)
    wide = kp.paired_difference(_quality(nat, torch.tensor([[1.0], [0.0], [1.0]])), _quality(nat, torch.zeros(3, 1)))
    t = ttest_1samp([1.0, 0.0, 1.0], 0.0).confidence_interval(0.95)
    assert t.high > 2 and [wide["copy_accuracy_ci95_lo"], wide["copy_accuracy_ci95_hi"]] == pytest.approx([t.low, 1.0])
    bare = kp.paired_difference(a, kp.Quality(1.0, 0.0, 0.5, {}))
    assert all(np.isnan(v) for v in bare.values())
    assert "natural_token_loss" not in a.to_dict() and set(a.to_dict()) == {
        "natural_loss",
        "long_range_loss",
        "copy_accuracy",
        "per_distance",
    }


def _increase_row(chosen: kp.Quality, full: kp.Quality) -> dict:
    """The chosen policy's natural-loss increase over ``full`` with its interval, as :func:`kp.curve_row`
    writes them (without the bytes, which need a layout)."""
    d = kp.paired_difference(chosen, full)
    return {
        "natural_loss_increase": chosen.natural_loss - full.natural_loss,
        "natural_loss_increase_ci95_lo": d["natural_loss_ci95_lo"],
        "natural_loss_increase_ci95_hi": d["natural_loss_ci95_hi"],
    }


def test_the_loss_tolerance_holds_beyond_the_interval_or_only_as_a_point_estimate():
    """--loss-tolerance decided on the point estimate alone. Hand-made per-token losses: the chosen
    policy loses 0.01 nats/token on average over 1,022 tokens, with independent noise of sd 0.3
    (standard error 0.0094: the normal-theory interval is about [-0.008, +0.028]) or of sd 0.003
    (about [0.0098, 0.0102]). At a tolerance of 0.015 the point estimate is within it either way;
    the noisy interval straddles it (null), the quiet one lies below it (true). At 0.005 the point
    estimate is above it (false); too few tokens for an interval: null, a point estimate only. Old
    code: no tolerance_check (the report said nothing about the interval)."""
    from headprobe.commands.kv_core import _tolerance_line

    rng = np.random.default_rng(5)
    base = torch.tensor(rng.uniform(1.0, 4.0, size=(1, 1022)))
    noise = rng.normal(size=(1, 1022))
    noise = torch.tensor((noise - noise.mean()) / noise.std())  # mean 0 exactly, sd 1
    full = _quality(base, torch.ones(4, 5))
    for sd, want in ((0.3, None), (0.003, True)):
        chosen = _quality(base + 0.01 + sd * noise, torch.ones(4, 5))
        row = _increase_row(chosen, full)
        assert row["natural_loss_increase"] == pytest.approx(0.01, abs=1e-9)
        half = 1.96 * sd / np.sqrt(1022)  # the normal-theory reference the bootstrap should be near
        lo, hi = row["natural_loss_increase_ci95_lo"], row["natural_loss_increase_ci95_hi"]
        assert (lo, hi) == pytest.approx((0.01 - half, 0.01 + half), abs=0.15 * half + 1e-6)
        check = kp.tolerance_check(row, 0.015)
        assert check["within_tolerance"] is want, (sd, lo, hi)
        assert check["natural_loss_increase_ci95"] == [lo, hi] and check["loss_tolerance"] == 0.015
        line = _tolerance_line(check)
        assert f"+0.0100 [{lo:+.4f}, {hi:+.4f}]" in line
        assert line.endswith("(within_tolerance: null)" if want is None else "(within_tolerance: true)"), line
        assert ("straddles" in line) is (want is None) and ("beyond the 95% interval" in line) is bool(want)
    assert kp.tolerance_check(row, 0.005)["within_tolerance"] is False  # the point estimate 0.01 > 0.005
    short = _increase_row(_quality(base[:, :20] + 0.01, torch.ones(4, 5)), _quality(base[:, :20], torch.ones(4, 5)))
    assert np.isnan(short["natural_loss_increase_ci95_hi"])  # 7 blocks of 3 tokens: no interval
    none = kp.tolerance_check(short, 0.015)
    assert none["within_tolerance"] is None and "no 95% interval" in none["verdict"]
    assert "[n/a]" in _tolerance_line(none)


def test_each_curve_row_says_whether_the_tolerance_holds_beyond_its_interval():
    """curve.csv's ``within_tolerance`` (with --loss-tolerance) on hand-made rows of known intervals
    at a tolerance of 0.015 nats/token, the flags written out by hand from the rule: the full cache
    (0, [0, 0]) true; 0.01 in [0.0098, 0.0102] true; an upper bound exactly at the tolerance true (at
    most); 0.01 in [-0.008, +0.028] null (straddles); no interval null; 0.02 in [0.016, 0.024] false
    (the point estimate above). Each flag is tolerance_check's for its row, the other columns kept,
    the rows given unchanged. Old code: curve.csv had no such column (no with_tolerance)."""
    nan = float("nan")
    cases = [  # (increase, lo, hi, the flag by hand)
        (0.0, 0.0, 0.0, True),
        (0.01, 0.0098, 0.0102, True),
        (0.01, 0.005, 0.015, True),
        (0.01, -0.008, 0.028, None),
        (0.01, nan, nan, None),
        (0.02, 0.016, 0.024, False),
    ]
    rows = [
        {
            "policy": "chosen",
            "natural_loss_increase": x,
            "natural_loss_increase_ci95_lo": lo,
            "natural_loss_increase_ci95_hi": hi,
        }
        for x, lo, hi, _ in cases
    ]
    given = [dict(r) for r in rows]
    got = kp.with_tolerance(rows, 0.015)
    assert [r["within_tolerance"] for r in got] == [want for *_, want in cases]
    assert [r["within_tolerance"] for r in got] == [kp.tolerance_check(r, 0.015)["within_tolerance"] for r in rows]
    # the other columns kept, the given rows unchanged (one NaN object: dict equality compares it by identity)
    assert [{k: v for k, v in r.items() if k != "within_tolerance"} for r in got] == given == rows


def _evaluated(monkeypatch, loss: torch.Tensor, hits: torch.Tensor, distance: list[int]) -> kp.Quality:
    """:func:`kp.evaluate` on hand-made per-token losses and hits (its forward passes replaced, the
    model a stand-in): the long-range set needs only its ``distance``."""
    from unittest.mock import Mock

    from headprobe.analyses.data import LongRangeSet
    from headprobe.probe.backends.base import LoadedModel

    monkeypatch.setattr(kp, "long_range_quality", lambda model, lr, policy=None: (loss, hits))
    monkeypatch.setattr(kp, "natural_token_losses", lambda model, tokens, start, policy=None: torch.ones(1, 30))
    lr = Mock(spec=LongRangeSet, distance=torch.tensor(distance))
    return kp.evaluate(Mock(spec=LoadedModel), torch.zeros(1, 31, dtype=torch.long), 0, lr)


def test_per_distance_intervals_by_hand(monkeypatch):
    """Each distance's copy accuracy and loss carry a 95% interval over its sequences, worked out by
    hand (t quantiles from a table: t(3, 0.975) = 3.182446, t(2, 0.975) = 4.302653):

    * distance 8, 4 sequences of 4 copied tokens with 1, 2, 2 and 3 hits: accuracy 0.5, the
      sequences' accuracies 0.25, 0.5, 0.5, 0.75 have sd sqrt(0.125 / 3) = 0.204124, so
      0.5 +- 3.182446 * 0.204124 / 2 = [0.175192, 0.824808]. A binomial (Wilson) interval over the 16
      tokens as if independent would be [0.280, 0.720]: narrower, the clustering ignored.
      Their losses 1, 2, 3, 2 nats: mean 2, sd sqrt(2 / 3) = 0.816497, [0.700771, 3.299229];
    * distance 20, 2 sequences all copied and 1 all wrong: 2/3 +- 4.302653 * 0.577350 / sqrt 3 =
      [-0.768, 2.101], clipped to [0, 1]; losses 0.5, 0.5, 3.5: 1.5 +- 4.302653 * sqrt 3 / sqrt 3,
      the lower bound clipped to 0: [0, 5.802653];
    * distance 40, 3 sequences all copied: the accuracy's Clopper-Pearson interval of 3 of 3 sequences,
      [0.025^(1/3), 1] = [0.292402, 1] (it was [1, 1]: zero width); their losses all 0.25: [0.25, 0.25]
      (the loss keeps the t interval);
    * distance 60, one sequence: no interval (NaN, JSON null).

    Old code: per_distance held only ``loss`` and ``accuracy`` (no interval)."""
    blocks = {  # distance -> per sequence (hits of its 4 copied tokens, its loss per token)
        8: [([1, 0, 0, 0], 1.0), ([1, 1, 0, 0], 2.0), ([0, 1, 0, 1], 3.0), ([1, 1, 1, 0], 2.0)],
        20: [([1, 1, 1, 1], 0.5), ([0, 0, 0, 0], 3.5), ([1, 1, 1, 1], 0.5)],
        40: [([1, 1, 1, 1], 0.25)] * 3,
        60: [([0, 1, 1, 1], 1.0)],
    }
    distance = [d for d, seqs in blocks.items() for _ in seqs]
    hits = torch.tensor([h for seqs in blocks.values() for h, _ in seqs], dtype=torch.float32)
    loss = torch.tensor([[x] * 4 for seqs in blocks.values() for _, x in seqs], dtype=torch.float32)
    loss[1] += torch.tensor([0.1, -0.1, 0.2, -0.2])  # token losses vary within a sequence; its mean is still 2
    per = _evaluated(monkeypatch, loss, hits, distance).per_distance
    assert list(per) == [8, 20, 40, 60] and [per[d]["n_sequences"] for d in per] == [4, 3, 3, 1]

    def ci(d: int, q: str) -> list[float]:
        return [per[d][f"{q}_ci95_lo"], per[d][f"{q}_ci95_hi"]]

    assert per[8]["accuracy"] == 0.5 and ci(8, "accuracy") == pytest.approx([0.175192, 0.824808], abs=1e-6)
    assert per[8]["loss"] == pytest.approx(2.0) and ci(8, "loss") == pytest.approx([0.700771, 3.299229], abs=1e-6)
    assert per[20]["accuracy"] == pytest.approx(2 / 3) and ci(20, "accuracy") == [0.0, 1.0]
    assert per[20]["loss"] == pytest.approx(1.5) and ci(20, "loss") == pytest.approx([0.0, 5.802653], abs=1e-6)
    assert per[40]["accuracy"] == 1.0 and ci(40, "accuracy") == pytest.approx([0.292402, 1.0], abs=1e-6)
    assert ci(40, "loss") == [0.25, 0.25]
    assert per[60]["accuracy"] == 0.75 and all(np.isnan(ci(60, q)).all() for q in ("loss", "accuracy"))
    # the interval over sequences is wider than a binomial one over the tokens (Wilson, 16 tokens at 0.5)
    z, n = 1.959964, 16
    wilson_half = z * np.sqrt(0.25 / n + z**2 / (4 * n**2)) / (1 + z**2 / n)
    assert ci(8, "accuracy")[1] - ci(8, "accuracy")[0] > 2 * wilson_half + 0.2


def test_per_distance_interval_widens_with_fewer_sequences(monkeypatch):
    """The same sequences' accuracies (0.25, 0.5, 0.5, 0.75 repeated), the first 16, 8, 4 and 2 of them
    at one distance: the accuracy stays 0.5 while the interval widens as the sequences get fewer
    (sd / sqrt(n), and a larger t quantile), each bound the t interval of the sequences' accuracies
    (scipy's); one sequence gives none."""
    from scipy.stats import ttest_1samp

    pattern = [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [1, 1, 1, 0]]
    widths = []
    for n in (16, 8, 4, 2, 1):
        hits = torch.tensor((pattern * 4)[:n], dtype=torch.float32)
        per = _evaluated(monkeypatch, torch.ones(n, 4), hits, [30] * n).per_distance[30]
        lo, hi = per["accuracy_ci95_lo"], per["accuracy_ci95_hi"]
        if n == 1:
            assert np.isnan([lo, hi]).all() and per["accuracy"] == 0.25
            break
        ref = ttest_1samp(hits.double().mean(1).numpy(), 0.0).confidence_interval(0.95)
        assert [lo, hi] == pytest.approx(np.clip([ref.low, ref.high], 0, 1)) and lo <= per["accuracy"] <= hi
        widths.append(hi - lo)
    assert widths == sorted(widths) and len(set(widths)) == len(widths), widths  # strictly wider as n falls


def test_sequences_that_all_agree_give_an_exact_bound_not_a_zero_width_interval(monkeypatch):
    """4 sequences of 15 copied tokens, every token copied: the accuracy 1.0 from 4 sequences is not
    exact. The interval is scipy's exact (Clopper-Pearson) interval of 4 successes in 4 sequences,
    [0.025^(1/4), 1] = [0.397635, 1]; treating the 60 tokens as independent would claim
    [0.940, 1] (60 of 60), and the t interval [1, 1]. None copied: [0, 0.602365] (0 of 4). Every
    sequence at 6 of 15 (0.4, all equal): [0.4 c, 1 - 0.6 c], c = 0.397635. The paired difference from
    a policy that copies the same tokens: all 0, so [-0.602365, +0.602365] (1 - c: Clopper-Pearson's
    upper bound for 0 of 4 sequences that differ), and against the full cache the drop the same;
    exactly [0, 0] only against itself. One sequence: no interval (NaN), not Clopper-Pearson's
    [0.025, 1]. Old code: [1, 1], [0, 0], [0.4, 0.4] and [0, 0] (zero width)."""
    from scipy.stats import binomtest

    def cp(k: int, n: int) -> list[float]:
        ci = binomtest(k, n).proportion_ci(0.95, method="exact")
        return [ci.low, ci.high]

    m, n = 15, 4
    assert cp(4, 4) == pytest.approx([0.397635, 1.0], abs=1e-6) and cp(60, 60)[0] == pytest.approx(0.940, abs=1e-3)
    c = cp(4, 4)[0]
    for hits, want in (
        (torch.ones(n, m), cp(4, 4)),
        (torch.zeros(n, m), cp(0, 4)),
        (torch.tensor([[1.0] * 6 + [0.0] * 9] * n), [0.4 * c, 1 - 0.6 * c]),
    ):
        per = _evaluated(monkeypatch, torch.rand(n, m) + 0.5, hits, [30] * n).per_distance[30]
        assert [per["accuracy_ci95_lo"], per["accuracy_ci95_hi"]] == pytest.approx(want, abs=1e-12)
        assert per["accuracy_ci95_hi"] > per["accuracy_ci95_lo"]  # never zero width
    one = _evaluated(monkeypatch, torch.ones(1, m), torch.ones(1, m), [30]).per_distance[30]
    assert np.isnan([one["accuracy_ci95_lo"], one["accuracy_ci95_hi"]]).all() and one["accuracy"] == 1.0
    nat = torch.rand(1, 60) + 1.0
    full, policy = _quality(nat, torch.ones(n, m)), _quality(nat + 0.01, torch.ones(n, m))
    b = cp(0, 4)[1]
    d = kp.paired_difference(policy, full)
    assert d["copy_accuracy"] == 0.0 and [d["copy_accuracy_ci95_lo"], d["copy_accuracy_ci95_hi"]] == pytest.approx(
        [-b, b], abs=1e-12
    )
    drop = kp.against_full(policy, full)
    assert [drop["copy_accuracy_drop_ci95_lo"], drop["copy_accuracy_drop_ci95_hi"]] == pytest.approx([-b, b])
    itself = kp.against_full(full, full, identical=True)
    assert [itself["copy_accuracy_drop_ci95_lo"], itself["copy_accuracy_drop_ci95_hi"]] == [0.0, 0.0]


def test_sequences_that_vary_keep_the_t_interval(monkeypatch):
    """Where the sequences' accuracies differ the interval is the t interval as before (scipy's, clipped
    to [0, 1]), even near the edge: 3 sequences all copied and one with 14 of 15 give 0.983333 +-
    3.182446 * 0.033333 / 2 = [0.930293, 1] (clipped), narrower than the bound of 4 that agree
    ([0.398, 1]): the t interval's own weakness with few sequences, documented, not widened. The
    paired differences 1/15, 0, 0, 0: the t interval as before."""
    from scipy.stats import ttest_1samp

    hits = torch.ones(4, 15)
    hits[3, 0] = 0.0
    per = _evaluated(monkeypatch, torch.ones(4, 15), hits, [30] * 4).per_distance[30]
    ref = ttest_1samp(hits.double().mean(1).numpy(), 0.0).confidence_interval(0.95)
    assert [per["accuracy_ci95_lo"], per["accuracy_ci95_hi"]] == pytest.approx([ref.low, 1.0])
    assert per["accuracy_ci95_lo"] == pytest.approx(0.930293, abs=1e-6) and ref.high > 1.0
    nat = torch.ones(1, 60)
    d = kp.paired_difference(_quality(nat, torch.ones(4, 15)), _quality(nat, hits))
    ref = ttest_1samp([0.0, 0.0, 0.0, 1 / 15], 0.0).confidence_interval(0.95)
    assert [d["copy_accuracy_ci95_lo"], d["copy_accuracy_ci95_hi"]] == pytest.approx([ref.low, ref.high])
