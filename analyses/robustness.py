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
    if n < SIGN_FLIP_EXACT_BELOW:
        signs = np.array(list(itertools.product((1.0, -1.0), repeat=n)))  # [2^n, batch]
        stats = np.abs(np.tensordot(signs, d, axes=(1, 0)) / n)
        p = (stats >= obs - tol).mean(axis=0)
    else:
        rng = np.random.default_rng(seed)
        signs = rng.choice((1.0, -1.0), size=(n_perm, n))
        stats = np.abs(np.tensordot(signs, d, axes=(1, 0)) / n)
        p = (1 + (stats >= obs - tol).sum(axis=0)) / (1 + n_perm)
    return np.where(np.isnan(obs), np.nan, p)
