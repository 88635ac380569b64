"""Intervals for the numbers headprobe reports, and the Monte Carlo tests of its verdicts.

A head's score, an ablation's effect and a patch's effect are means over sequences (or prompt
pairs) of a per-sequence value, so their interval is the Student-t interval of a mean over those
units: ``mean +- t_{n-1, 0.975} * sd / sqrt(n)``, from 2 units up (:data:`MIN_N_FOR_CI`); one unit
has none. One rule for every command. Its coverage (tests/test_statistics.py simulates it, 20,000
samples each): exactly 0.95 at every n for normal per-unit values; for skewed values below that
(lognormal sigma 1: 0.89 at n = 2, 0.83 at n = 8, 0.87 at n = 20; exponential 0.88-0.92; a 0/1 value
with p = 0.2: 0.32 at n = 2, 0.83 at n = 8). The percentile bootstrap this replaced covered 0.51 at
n = 2, 0.74 at n = 3 and 0.88 at n = 8 even for normal values (Efron & Tibshirani 1993, ch. 13,
warn it is too narrow in small samples).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Sequence

import numpy as np

from headprobe.analyses.vocabulary import MIN_N_FOR_CI, exact_level, within_level

LEVEL = 0.95


def interval_rule(units: str = "sequences", over: str | None = None) -> str:
    """The one-line statement of :func:`mean_ci` that outputs carry: ``units``, a plural noun, what
    is averaged over; ``over`` (default ``units``) what the mean is said to be over, where that names
    them (``the 64 held-out copy sequences``). train passed that phrase as ``units`` and its summary
    read "none from fewer than 2 the 64 held-out copy sequences"."""
    return (
        f"95% Student-t interval of the mean over {over or units} (mean +- t(n-1) sd / sqrt(n)); none from fewer "
        f"than {MIN_N_FOR_CI} {units}"
    )


def mean_ci(per_unit: np.ndarray, level: float = LEVEL) -> np.ndarray:
    """Student-t confidence interval of the mean over axis 0 (sequences or prompt pairs).

    Args:
        per_unit: ``[n, ...]`` one value per sequence (and per head, ...).
        level: confidence level.

    Returns:
        ``[2, ...]``: lower and upper bounds (same units as the values); NaN where fewer than
        :data:`MIN_N_FOR_CI` units (no interval). A constant column gives ``[value, value]``.

    Source: Student (1908); the t quantile from :func:`scipy.special.stdtrit`, the function
    :func:`scipy.stats.t.ppf` evaluates (equal to it; ``scipy.special`` imports in a fifth of the time).
    """
    x = np.asarray(per_unit, dtype=float)
    n = x.shape[0]
    if n < MIN_N_FOR_CI:
        return np.full((2, *x.shape[1:]), np.nan)
    from scipy.special import stdtrit

    half = stdtrit(n - 1, 0.5 + level / 2) * x.std(axis=0, ddof=1) / np.sqrt(n)
    m = x.mean(axis=0)
    return np.stack([m - half, m + half])


EQUAL_ATOL = 1e-9
"""Per-unit values closer than this (a float sum's rounding) count as equal in :func:`bounded_mean_ci`."""


def bounded_mean_ci(
    per_unit: np.ndarray | Sequence[float], low: float, high: float, level: float = LEVEL
) -> np.ndarray:
    """95% interval of the mean of a per-unit value bounded in ``[low, high]`` (an accuracy in
    [0, 1], a difference of two in [-1, 1]) over ``n`` independent units (sequences).

    Units that differ: :func:`mean_ci` clipped to the range. All ``n`` equal to ``v`` (to
    :data:`EQUAL_ATOL`; a t interval would have zero width, as if the mean were known exactly):
    the share of units in the population unlike ``v`` is at most ``b``, the exact Clopper-Pearson
    upper bound for 0 of ``n`` (Clopper & Pearson 1934, Biometrika 26:404; ``1 - c``,
    ``c = ((1 - level) / 2) ** (1 / n)``, two-sided as scipy's ``binomtest(0, n).proportion_ci()``;
    the "rule of three" 3/n is its one-sided approximation, Hanley & Lippman-Hand 1983, JAMA
    249:1743), and such a unit lies anywhere in the range, so the mean lies in
    ``[low + (v - low) c, high - (high - v) c]``. At an edge (all 1 of an accuracy: ``[c, 1]``) this is
    the Clopper-Pearson interval of ``n`` of ``n`` units; for all 0 of a difference ``[c - 1, 1 - c]``
    (miss probability at most ``c ** n``, a 2.5% tail: conservative). The unit is the cluster
    whatever its size ``m``: the Kish design effect ``1 + (m - 1) rho`` cannot be estimated when all
    clusters agree, and at its largest (``rho = 1``, ``m``) the effective sample is the ``n`` units
    (Korn & Graubard 1998, Survey Methodology 24:193, take Clopper-Pearson at the effective sample);
    tokens as independent units would assume ``rho = 0`` (60 of 60: ``[0.940, 1]``; 4 sequences of
    15: ``[0.398, 1]``). Near an edge but not at it (3 sequences at 1.0, one at 0.95) the t interval
    stays, narrower than this bound: its known weakness with few units, not made wider here.

    Args:
        per_unit: ``[n]`` one value per unit, in ``[low, high]``.

    Returns:
        ``[2]``: lower and upper bound; NaN from fewer than :data:`MIN_N_FOR_CI` units or a NaN value.
    """
    x = np.asarray(per_unit, dtype=float)
    n = x.shape[0]
    if n >= MIN_N_FOR_CI and np.ptp(x) <= EQUAL_ATOL:  # NaN compares False: mean_ci's NaN below
        v, c = float(x.mean()), ((1.0 - level) / 2) ** (1.0 / n)
        return np.array([low + (v - low) * c, high - (high - v) * c])
    return np.clip(mean_ci(x, level), low, high)


def equal_units_rule(units: str = "sequences") -> str:
    """The one-line statement of :func:`bounded_mean_ci`'s rule where every unit agrees, for outputs."""
    return (
        f"where all n {units} have the same value v (a t interval would have zero width), the mean lies in "
        "[lo + (v - lo) c, hi - (hi - v) c] over the quantity's range [lo, hi], c = 0.025^(1/n): at most a share "
        f"1 - c of {units} (the exact Clopper-Pearson bound for 0 of n) differ from v, by anything (all 1.0 of "
        "4: [0.398, 1]; a difference all 0 over 4: [-0.602, +0.602])"
    )


def no_interval_reason(n_sequences: int, units: str = "sequences") -> str | None:
    """Why :func:`mean_ci` over ``n_sequences`` units gives no interval (NaN bounds, JSON
    ``null``), or None when it gives one."""
    if n_sequences >= MIN_N_FOR_CI:
        return None
    return f"undefined: an interval over {units} needs at least {MIN_N_FOR_CI} {units}, the task has {n_sequences}"


SPEARMAN_INTERVAL_RULE = (
    "95% interval of each Spearman rho over the heads ranked: Fisher's z = atanh(rho) +- 1.96 "
    "sqrt((1 + rho^2 / 2) / (n - 3)), back through tanh (Bonett & Wright 2000); no interval from fewer "
    "than 4 heads (n - 3 > 0) or at |rho| = 1"
)
"""The one-line statement of :func:`spearman_ci` that outputs carry."""


def spearman_ci(rho: float, n: int, level: float = LEVEL) -> np.ndarray:
    """Confidence interval of a Spearman rank correlation ``rho`` over ``n`` units (heads).

    Fisher's z-transform ``atanh(rho)`` with the variance Bonett & Wright give for Spearman's rho,
    ``(1 + rho^2 / 2) / (n - 3)`` (Bonett & Wright 2000, Psychometrika 65(1):23-28; Fieller, Hartley
    & Pearson 1957 used 1.06 / (n - 3)), then ``tanh`` back. Its coverage for bivariate-normal
    values (4,000 samples each, rho 0 to 0.93): 0.955-0.966 at n = 10, 0.953-0.956 at n = 60,
    0.951-0.958 at n = 270.

    Returns:
        ``[2]``: lower and upper bounds (unitless, within [-1, 1]); NaN for ``n < 4``, a ``rho``
        that is not finite, or ``|rho| = 1`` (infinite z: no interval).
    """
    if n < 4 or not np.isfinite(rho) or abs(rho) >= 1:
        return np.full(2, np.nan)
    from scipy.special import ndtri

    half = ndtri(0.5 + level / 2) * math.sqrt((1 + rho**2 / 2) / (n - 3))
    z = math.atanh(rho)
    return np.tanh([z - half, z + half])


def rank_p_value(value: float, null: Sequence[float]) -> float:
    """One-sided rank p-value of ``value`` being low among ``k`` draws ``null`` of the same quantity
    under the null hypothesis (e.g. a pruning method's curve area among ``k`` random orders'):
    ``(1 + #{null <= value}) / (k + 1)``, exact when ``value`` and the draws are exchangeable under
    it. Never below ``1 / (k + 1)``: "below all 3 random orders" is p = 0.25; 19 draws reach 0.05.

    Source: Davison & Hinkley 1997, "Bootstrap Methods and their Application", eq. 4.11.
    """
    return (1 + sum(x <= value for x in null)) / (len(null) + 1)


# --- A block bootstrap for the mean of an autocorrelated per-token series --------------------------

BOOTSTRAP_RESAMPLES = 10_000
"""Resamples of :func:`block_bootstrap_ci` (the percentile bounds' Monte Carlo error is then about
1% of the interval's width)."""
BOOTSTRAP_SEED = 0
"""The seed of :func:`block_bootstrap_ci`'s draws: a run's intervals are reproducible."""
MIN_BLOCKS = 10
"""The fewest blocks :func:`block_bootstrap_ci` gives an interval from: a percentile bootstrap of a
mean over fewer units covers under 0.9 (this module's docstring: 0.88 at n = 8)."""


def block_length(n_tokens: int) -> int:
    """The block length of :func:`block_bootstrap_ci` for a window of ``n_tokens`` tokens:
    ``ceil(n ** (1/3))`` (11 at 1,022 tokens, 4 at 46). Block length of order ``n^(1/3)`` minimises the
    error of a block-bootstrap estimate of a mean's variance and of its two-sided distribution (Hall,
    Horowitz & Jing 1995, Biometrika 82(3):561-574; Lahiri 2003, *Resampling Methods for Dependent
    Data*, ch. 7): blocks long enough to keep a token's dependence on its neighbours, enough of them
    to resample."""
    return max(1, math.ceil(n_tokens ** (1 / 3) - 1e-9))


def n_blocks(n_tokens: int, n_windows: int = 1) -> int:
    """The blocks :func:`block_bootstrap_ci` cuts ``n_windows`` windows of ``n_tokens`` tokens into
    (:func:`block_length` tokens each, a window's last block shorter)."""
    return n_windows * -(-n_tokens // block_length(n_tokens))


def block_bootstrap_ci(
    per_token: np.ndarray,
    block_len: int | None = None,
    n_boot: int = BOOTSTRAP_RESAMPLES,
    level: float = LEVEL,
    seed: int = BOOTSTRAP_SEED,
) -> np.ndarray:
    """Percentile block-bootstrap interval of the mean of an autocorrelated per-token series.

    Each window (row) is cut into non-overlapping blocks of ``block_len`` contiguous tokens (its last
    block shorter where ``block_len`` does not divide it; no block crosses a window); the blocks of
    every window are pooled and ``n_blocks`` of them drawn with replacement ``n_boot`` times; each
    resample's statistic is its mean over tokens (sum over the drawn blocks / their tokens); the
    bounds are the resampled means' ``(1 -+ level) / 2`` quantiles (Carlstein 1986, Ann. Statist.
    14(3):1171-1179; Efron & Tibshirani 1993, ch. 13). Tokens are autocorrelated, so resampling them one
    by one would understate the variance; blocks keep the dependence within ``block_len``.

    Args:
        per_token: ``[window, pos]`` (or ``[pos]``: one window) values, e.g. paired per-token loss
            differences in nats.
        block_len: tokens per block (None: :func:`block_length` of ``pos``).
        n_boot: resamples. level: confidence level. seed: of ``numpy.random.default_rng``.

    Returns:
        ``[2]``: lower and upper bounds (the values' units); NaN where fewer than :data:`MIN_BLOCKS`
        blocks or a value is not finite. A constant series gives ``[c, c]``.
    """
    x = np.asarray(per_token, dtype=float)
    x = x[None] if x.ndim == 1 else x
    n_windows, n = x.shape
    block_len = block_length(n) if block_len is None else block_len
    starts = np.arange(0, n, block_len)
    sums = np.add.reduceat(x, starts, axis=1).ravel() if n else np.zeros(0)  # [window * block]
    sizes = np.tile(np.diff(np.append(starts, n)), n_windows).astype(float)
    if len(sums) < MIN_BLOCKS or not np.isfinite(x).all():
        return np.full(2, np.nan)
    means = np.concatenate([counts @ sums / (counts @ sizes) for counts in _block_counts(len(sums), n_boot, seed)])
    return np.quantile(means, [(1 - level) / 2, (1 + level) / 2])


_COUNTS_CACHE_ENTRIES = 1 << 22
"""The largest ``[resample, block]`` count matrix :func:`_block_counts` keeps (32 MiB of float64)."""


def _block_counts(n_blocks: int, n_boot: int, seed: int) -> Iterator[np.ndarray]:
    """:func:`block_bootstrap_ci`'s draws: ``[resample, block]`` counts of each block in each
    resample (``n_blocks`` draws with replacement, ``numpy.random.default_rng(seed)``), in chunks of
    at most :data:`_COUNTS_CACHE_ENTRIES` entries; one chunk is computed once per shape and seed and
    shared (every series of a run has the same shape: the same draws, a matrix product each)."""
    chunk = max(1, _COUNTS_CACHE_ENTRIES // n_blocks)
    if n_boot <= chunk:
        yield _cached_counts(n_blocks, n_boot, seed)
        return
    rng = np.random.default_rng(seed)
    for a in range(0, n_boot, chunk):
        yield _draw_counts(rng, n_blocks, min(chunk, n_boot - a))


def _draw_counts(rng: np.random.Generator, n_blocks: int, n: int) -> np.ndarray:
    idx = rng.integers(0, n_blocks, size=(n, n_blocks)) + n_blocks * np.arange(n)[:, None]  # [resample, draw]
    return np.bincount(idx.ravel(), minlength=n * n_blocks).reshape(n, n_blocks).astype(float)


@functools.lru_cache(maxsize=4)
def _cached_counts(n_blocks: int, n_boot: int, seed: int) -> np.ndarray:
    counts = _draw_counts(np.random.default_rng(seed), n_blocks, n_boot)
    counts.flags.writeable = False
    return counts


def block_bootstrap_rule(n_tokens: int, n_windows: int) -> str:
    """The one-line statement of :func:`block_bootstrap_ci` over ``n_windows`` windows of ``n_tokens``
    scored tokens each, as outputs carry it."""
    b, blocks = block_length(n_tokens), n_blocks(n_tokens, n_windows)
    return (
        f"95% percentile block bootstrap of the mean over {n_windows * n_tokens} tokens "
        f"({n_windows} window{'s' if n_windows != 1 else ''} of {n_tokens}), paired by token: {blocks} non-overlapping "
        f"blocks of {b} contiguous tokens (ceil(n^(1/3)), Hall, Horowitz & Jing 1995; none crosses a window) "
        f"resampled {BOOTSTRAP_RESAMPLES} times, seed {BOOTSTRAP_SEED}; none from fewer than {MIN_BLOCKS} blocks"
    )


# --- Monte Carlo tests of a top-k effect against random control sets ------------------------------
#
# The design (docs/scan.md, "How a verdict is reached"):
# * Besag & Clifford (1991), "Sequential Monte Carlo p-values", Biometrika 78(2):301-304: draw
#   controls in batches and stop once h of them reach the observed effect; the p-value h / L
#   (L draws used) or, when the n-th draw comes first, (g + 1) / (n + 1), is exact.
#   :func:`besag_clifford_h`, :func:`sequential_mc_p_value`, :class:`SequentialMCTest`.
# * Benjamini & Hochberg (1995) over the verdicts of one run (scipy's ``false_discovery_control``),
#   or Holm (1979) (its step-down from the definition): :func:`adjust_p_values`.
# A generalized-Pareto tail for p below 1/(n+1) (Knijnenburg et al. 2009) was tried and is not
# used: with 20-50 draws it was anti-conservative under the null (benchmarks/tail_calibration.py).


def besag_clifford_h(alpha: float, n_max: int) -> int:
    """The number of reaching draws that stops a sequential test, ``floor(alpha * n_max) + 1``:
    the smallest ``h`` with ``h / n_max > alpha``, so a test stopped early (p = h / L >= h / n_max)
    can never be significant at ``alpha``, and one that is not stopped early could be. Computed
    in integers from ``alpha`` as a decimal (:func:`~headprobe.analyses.vocabulary.exact_level`): in
    floating point 0.072 * 375 is 26.999999999999996, which floors one too small."""
    a = exact_level(alpha)
    return a.numerator * n_max // a.denominator + 1


def sequential_mc_p_value(reached: Sequence[bool], n_max: int, h: int) -> tuple[float, int]:
    """Besag & Clifford's (1991) sequential Monte Carlo p-value and the draws it used.

    Args:
        reached: for each control draw in order, whether its effect reached the observed one.
            Only the first ``min(len, n_max)`` are read; fewer than ``n_max`` are allowed only
            when they already hold ``h`` reaching draws (the test stopped).
        n_max: the most draws the test would make. h: reaching draws that stop it.

    Returns:
        ``(p, L)``: ``h / L`` where the ``h``-th reaching draw is draw ``L``; else
        ``(g + 1) / (n_max + 1)`` with ``g`` reaching draws among ``L = n_max``. Valid (P(p <= u)
        <= u under exchangeability, exact at the values p takes), tested against the closed form.

    Raises:
        ValueError: fewer than ``n_max`` draws without ``h`` reaching ones.
    """
    g = 0
    for i, r in enumerate(list(reached)[:n_max], start=1):
        g += bool(r)
        if g == h:
            return h / i, i
    if len(reached) < n_max:
        raise ValueError(f"{len(reached)} draws of {n_max} and only {g} of {h} reaching ones: the test has not ended")
    return (g + 1) / (n_max + 1), n_max


def sequential_mc_null_cdf(u: float, n_max: int, h: int) -> float:
    """P(p <= u) of :func:`sequential_mc_p_value` under the null hypothesis, in closed form: the
    observed effect's rank among the ``n_max + 1`` values is uniform, so the number ``g`` of
    reaching draws among ``n_max`` is uniform on ``0..n_max`` and, given ``g >= h``, the ``h``-th
    reaching draw is draw ``L`` with probability ``C(L-1, h-1) C(n_max-L, g-h) / C(n_max, g)``.
    The reference the tests compare the implementation with."""
    from math import comb

    total = 0.0
    for g in range(n_max + 1):
        if g < h:
            total += float((g + 1) / (n_max + 1) <= u + 1e-15)
            continue
        total += sum(
            comb(L - 1, h - 1) * comb(n_max - L, g - h) for L in range(h, n_max + 1) if h / L <= u + 1e-15
        ) / comb(n_max, g)
    return total / (n_max + 1)


def sequential_mc_p_bound(reached: Sequence[bool], n_max: int, h: int) -> float:
    """The largest p-value :func:`sequential_mc_p_value` could still give after the draws in
    ``reached`` (fewer than ``n_max``, fewer than ``h`` reaching): the p of a test *curtailed*
    there, whose remaining draws are never made.

    The next ``h - g`` draws all reaching the observed effect give the largest, ``h / (L + h - g)``
    (``L`` draws so far, ``g`` of them reaching); when that many draws are not left, every remaining
    draw reaching gives ``(g + n_max - L + 1) / (n_max + 1)``. Because it is at least the p-value the
    full sequential test would give on every continuation, ``P(bound <= u) <= u`` under the null for
    any rule that decides when to curtail from the draws seen (tested exhaustively in
    tests/test_verification.py, where the naive ``(g + 1) / (L + 1)`` fails).
    """
    L, g = len(reached), sum(bool(r) for r in reached)
    if L >= n_max or g >= h:
        return sequential_mc_p_value(reached, n_max, h)[0]
    if L + h - g <= n_max:
        return h / (L + h - g)
    return (g + n_max - L + 1) / (n_max + 1)


def sequential_mc_best_p(reached: Sequence[bool], n_max: int, h: int) -> float:
    """The smallest p-value :func:`sequential_mc_p_value` could still give after ``reached``: no
    later draw reaching the observed effect, ``(g + 1) / (n_max + 1)`` (or the final p of a test
    that has ended)."""
    L, g = len(reached), sum(bool(r) for r in reached)
    if L >= n_max or g >= h:
        return sequential_mc_p_value(reached, n_max, h)[0]
    return (g + 1) / (n_max + 1)


def unwinnable(best_p: Sequence[float], open_: Sequence[bool], method: str, alpha: float) -> list[int]:
    """The open tests of a family that no continuation can make significant after the correction.

    Test ``i`` is unwinnable when, with every test at its best p-value (``best_p``,
    :func:`sequential_mc_best_p`: an open test's smallest reachable one, a test stopped by the
    Besag-Clifford rule its final one, above ``alpha``, and a curtailed test the best it had when
    it was curtailed, *not* the bound it reports), its adjusted p-value is above ``alpha``. Every
    coordinate of that vector is at most what the same test gives with fixed draws, so by the
    monotonicity of both corrections such a test is rejected on no continuation and in no
    fixed-draw run; a test outside the rejected set whose p-value changes (to its bound) keeps
    that set. docs/scan.md, "Curtailment", has the whole argument.

    Returns:
        indices of the open tests that can stop.
    """
    adjusted = adjust_p_values(best_p, method)
    return [i for i, (o, a) in enumerate(zip(open_, adjusted)) if o and not within_level(a, alpha)]


class SequentialMCTest:
    """One Monte Carlo test of an observed effect against control draws that arrive in batches,
    stopped as soon as its outcome at ``alpha`` is settled: once ``h`` draws reached the observed
    effect (:func:`besag_clifford_h`), its p-value ``h / L`` exceeds ``alpha`` whatever comes next.

    Args:
        observed: the top-k effect. n_max: the most draws (``--n-random``). alpha: the level.
        sequential: stop early (False: always ``n_max`` draws; the p-value is then the plain
            ``(g + 1) / (n_max + 1)``).
        tie: draws within ``tie`` below ``observed`` count as reaching it.
    """

    def __init__(self, observed: float, n_max: int, alpha: float, sequential: bool = True, tie: float = 0.0):
        self.observed, self.n_max, self.alpha = float(observed), n_max, alpha
        self.sequential, self.tie = sequential, tie
        self.h = besag_clifford_h(alpha, n_max) if sequential else n_max + 1
        self.draws: list[float] = []
        self.stopped = False  # stopped before n_max draws (h reached, or curtailed)
        self.curtailed = False  # stopped because no continuation could make it significant

    @property
    def reached(self) -> list[bool]:
        """Per draw: did it reach the observed effect (within ``tie``)? A NaN draw (or a NaN
        observed effect) counts as reaching it: a loss that could not be measured is no evidence
        against the null (``d >= observed`` alone is False for NaN and would give a NaN effect p = 1/51)."""
        return [not d < self.observed - self.tie for d in self.draws]

    @property
    def exceedances(self) -> int:
        """How many draws so far reached the observed effect (``g``)."""
        return sum(self.reached)

    @property
    def done(self) -> bool:
        return self.stopped or len(self.draws) >= self.n_max

    def add(self, draws: Sequence[float] | np.ndarray) -> None:
        """Take the next batch of draws; stop after it once ``h`` draws reached the observed effect."""
        self.draws += [float(d) for d in draws][: self.n_max - len(self.draws)]
        if len(self.draws) < self.n_max and sum(self.reached) >= self.h:
            self.stopped = True

    def curtail(self) -> None:
        """Stop now because the test cannot be significant (:func:`unwinnable`, or an effect-size
        condition it cannot meet); its p-value becomes :func:`sequential_mc_p_bound`."""
        if not self.done:
            self.stopped = self.curtailed = True

    @property
    def best_p(self) -> float:
        """:func:`sequential_mc_best_p` of the draws taken."""
        return sequential_mc_best_p(self.reached, self.n_max, self.h)

    def p_value(self) -> float:
        """:func:`sequential_mc_p_value` of the draws taken (the test must be :attr:`done`); a
        curtailed test's :func:`sequential_mc_p_bound`."""
        if self.curtailed:
            return sequential_mc_p_bound(self.reached, self.n_max, self.h)
        return sequential_mc_p_value(self.reached, self.n_max, self.h)[0]


from headprobe.analyses.vocabulary import CORRECTIONS, lone_draws_needed  # noqa: E402, F401 - the names live in the torch-free vocabulary


def adjust_p_values(p_values: Sequence[float], method: str) -> np.ndarray:
    """Adjusted p-values; hypothesis i is rejected at level ``alpha`` when its adjusted p <= alpha.

    ``bh``: Benjamini & Hochberg (1995), J. R. Stat. Soc. B 57(1):289-300, by
    :func:`scipy.stats.false_discovery_control` (controls the false discovery rate for independent
    or positively dependent tests, Benjamini & Yekutieli 2001). ``holm``: Holm (1979), Scand. J.
    Stat. 6(2):65-70, computed from its definition (family-wise error, any dependence; checked against
    statsmodels' ``multipletests`` in the tests).

    Raises:
        ValueError: an unknown method.
    """
    p = np.asarray(p_values, dtype=float)
    if method not in CORRECTIONS:
        raise ValueError(f"unknown correction {method!r}; expected one of {', '.join(CORRECTIONS)}")
    if p.size == 0:
        return p
    if method == "bh":
        from scipy.stats import false_discovery_control

        return false_discovery_control(p, method="bh")
    # Holm's step-down from its definition (statsmodels' multipletests gives the same numbers, the
    # tests check it, but runs a full garbage collection per call: 0.29 s a curtailment round with
    # torch loaded): sorted p_(j) times (m - j + 1), a running maximum, capped at 1
    m = p.size
    order = np.argsort(p, kind="stable")
    steps = np.minimum(np.maximum.accumulate(p[order] * (m - np.arange(m))), 1.0)
    out = np.empty(m)
    out[order] = steps
    return out


def confirmable(smallest_p: Sequence[float], method: str, alpha: float) -> list[str]:
    """Per test of a family, what its draws allow before any is made: ``alone`` (its smallest
    possible p-value, ``1 / (n + 1)`` for n control sets, is rejected after the correction even
    with every other test at p = 1), ``with others`` (rejected only when the others are rejected
    too: every test at its smallest p) or ``never`` (not rejected even then). Both corrections are
    monotone, so these two extreme p-vectors decide it.

    For ``m`` tests of ``n`` draws each, BH and Holm reject a lone test iff ``1 / (n + 1) <= alpha / m``,
    i.e. ``n >= m / alpha - 1`` (:func:`lone_draws_needed`)."""
    best = [float(p) for p in smallest_p]
    together = within_level(adjust_p_values(best, method), alpha)
    out = []
    for i in range(len(best)):
        lone = [1.0] * len(best)
        lone[i] = best[i]
        out.append(
            "alone"
            if within_level(adjust_p_values(lone, method)[i], alpha)
            else "with others"
            if together[i]
            else "never"
        )
    return out
