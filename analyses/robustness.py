"""How stable a head's label is across conditions, and how a head changes between two models: the
set statistics of ``headprobe robustness`` (top-k Jaccard, stability with a bootstrap interval)
and the paired test of ``headprobe diff`` (sign flips over sequences). Pure functions over arrays."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

import numpy as np

Head = tuple[int, int]


def jaccard(a: Iterable[Head], b: Iterable[Head]) -> float:
    """``|A ∩ B| / |A ∪ B|`` (Jaccard 1901); 1.0 for two empty sets."""
    a, b = set(a), set(b)
    return len(a & b) / len(a | b) if a | b else 1.0


def mean_pairwise_jaccard(sets: Sequence[Iterable[Head]]) -> float:
    """The mean :func:`jaccard` over every unordered pair of ``sets``; NaN for fewer than two."""
    pairs = [jaccard(a, b) for a, b in itertools.combinations([set(s) for s in sets], 2)]
    return float(np.mean(pairs)) if pairs else float("nan")


def bootstrap_interval(
    values: Sequence[float] | np.ndarray, n_boot: int = 2000, level: float = 0.95, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``values`` (resampled with replacement
    ``n_boot`` times; Efron & Tibshirani 1993, *An Introduction to the Bootstrap*, ch. 13). The
    units resampled are the conditions; constant values give a zero-width interval. NaN for none."""
    x = np.asarray(values, dtype=float)
    if x.size == 0:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(n_boot, x.size))].mean(axis=1)
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def stability(
    sets: Sequence[Iterable[Head]], head: Head, n_boot: int = 2000, seed: int = 0
) -> tuple[float, float, float]:
    """``(fraction, lo, hi)``: the fraction of ``sets`` (one top-k set per condition) that hold
    ``head``, with its :func:`bootstrap_interval` over the conditions."""
    hits = [float(head in set(s)) for s in sets]
    lo, hi = bootstrap_interval(hits, n_boot, seed=seed)
    return float(np.mean(hits)) if hits else float("nan"), lo, hi


SIGN_FLIP_EXACT_BELOW = 13
"""Up to this many sequences the sign-flip test enumerates all ``2^n`` flips (exact); above, it draws."""


def _sign_flips(n: int, n_perm: int, seed: int) -> np.ndarray:
    """:func:`sign_flip_p`'s sign vectors ``[flips, batch]``: all ``2^n`` below
    :data:`SIGN_FLIP_EXACT_BELOW`, else ``n_perm`` drawn from ``seed``."""
    if n < SIGN_FLIP_EXACT_BELOW:
        return np.array(list(itertools.product((1.0, -1.0), repeat=n)))
    return np.random.default_rng(seed).choice((1.0, -1.0), size=(n_perm, n))


def sign_flip_p(diffs: np.ndarray, n_perm: int = 9999, seed: int = 0) -> np.ndarray:
    """Two-sided paired permutation p-values of ``mean(d) != 0`` by sign flips over sequences
    (Fisher 1935; Good 2005, *Permutation, Parametric and Bootstrap Tests of Hypotheses*, sec. 3.1):
    under no change each sequence's difference ``d_s = x_A(s) - x_B(s)`` is symmetric about 0.
    ``diffs`` ``[batch, ...]``: one test per trailing index. All ``2^batch`` flips when batch <
    :data:`SIGN_FLIP_EXACT_BELOW` (p = share of flips with ``|mean| >= observed``), else
    ``n_perm`` random flips with ``p = (1 + #) / (1 + n_perm)``. All-zero differences give p = 1;
    a NaN difference gives NaN."""
    d = np.asarray(diffs, dtype=float)
    n = d.shape[0]
    obs = np.abs(d.mean(axis=0))
    tol = 1e-12 * np.maximum(1.0, np.abs(d).max(axis=0))
    signs = _sign_flips(n, n_perm, seed)  # [flips, batch]
    hits = (np.abs(np.tensordot(signs, d, axes=(1, 0)) / n) >= obs - tol).sum(axis=0)
    p = hits / len(signs) if n < SIGN_FLIP_EXACT_BELOW else (1 + hits) / (1 + n_perm)
    return np.where(np.isnan(obs), np.nan, p)


def sign_flip_min_p(n: int, n_perm: int = 9999, seed: int = 0) -> float:
    """The smallest p-value :func:`sign_flip_p` can give for ``n`` sequences (with its ``n_perm``
    and ``seed``): reached when every difference has one sign, so that only the flips of all signs
    alike reach ``|mean(d)|``: ``2 / 2^n`` exact, ``(1 + k) / (1 + n_perm)`` drawn, ``k`` the draws
    whose signs are all alike."""
    signs = _sign_flips(n, n_perm, seed)
    alike = int((np.abs(signs.sum(axis=1)) == n).sum())
    return alike / len(signs) if n < SIGN_FLIP_EXACT_BELOW else (1 + alike) / (1 + n_perm)


DETECTION_SEARCH = 64
"""The most sequences :func:`detection_limit` tries when it looks for the count that allows a detection."""


def _passes_with(k: int, p: float, n_tests: int, alpha: float, correction: str) -> bool:
    """Whether ``k`` tests at ``p`` (the others at p = 1) pass ``alpha`` after ``correction`` over ``n_tests``."""
    from headprobe.analyses.statistics import adjust_p_values

    return float(adjust_p_values([p] * k + [1.0] * (n_tests - k), correction)[0]) <= alpha


def _passes(p: float, n_tests: int, alpha: float, correction: str) -> tuple[bool, bool]:
    """``(every, alone)``: whether ``p`` passes when every test has it, and when one test has it and
    the others p = 1 (the corrections are monotone, so these two extremes bound every outcome)."""
    return _passes_with(n_tests, p, n_tests, alpha, correction), _passes_with(1, p, n_tests, alpha, correction)


def _heads_needed(p: float, n_tests: int, alpha: float, correction: str) -> int | None:
    """The fewest tests at ``p`` (the others at 1) of which the correction passes any; None: not even all."""
    if not _passes_with(n_tests, p, n_tests, alpha, correction):
        return None
    lo, hi = 1, n_tests  # passing is monotone in the count
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if _passes_with(mid, p, n_tests, alpha, correction) else (mid + 1, hi)
    return lo


def detection_limit(n: int, n_tests: int, alpha: float, correction: str, n_perm: int = 9999, seed: int = 0) -> dict:
    """What ``headprobe diff``'s paired test over ``n`` sequences can detect among ``n_tests`` heads:
    its smallest p (:func:`sign_flip_min_p`), the p the correction needs (``bh``: ``alpha`` with every
    head at that p, ``alpha / n_tests`` for one head alone; ``holm``: ``alpha / n_tests`` either way),
    whether any change can pass (``detectable``: every head at the smallest p), the fewest heads
    changed at that p that can (``heads_needed``), whether one head's change can pass alone
    (``detectable_alone``), and the fewest sequences that allow each (None: none up to
    :data:`DETECTION_SEARCH`; then only a larger ``n_perm`` helps)."""
    n_tests = max(1, n_tests)
    p = sign_flip_min_p(n, n_perm, seed)
    every, alone = _passes(p, n_tests, alpha, correction)
    need: dict[str, int | None] = {"every": None, "alone": None}
    for k in range(1, DETECTION_SEARCH + 1):
        if need["alone"] is not None:
            break
        ok = dict(zip(("every", "alone"), _passes(sign_flip_min_p(k, n_perm, seed), n_tests, alpha, correction)))
        for key in need:
            if need[key] is None and ok[key]:
                need[key] = k
    return {
        "n_sequences": n,
        "n_tests": n_tests,
        "flips": "all 2^n (exact)" if n < SIGN_FLIP_EXACT_BELOW else f"{n_perm} random",
        "smallest_p": p,
        "p_needed_every_head": alpha if correction == "bh" else alpha / n_tests,
        "p_needed_one_head": alpha / n_tests,
        "detectable": every,
        "heads_needed": _heads_needed(p, n_tests, alpha, correction),
        "detectable_alone": alone,
        "sequences_needed": need["every"],
        "sequences_needed_alone": need["alone"],
    }
