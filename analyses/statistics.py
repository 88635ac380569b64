"""Intervals for the numbers a scan reports: percentile bootstrap over sequences (scipy).

A head's score and an ablation's effect are means over sequences of a per-sequence value (each
sequence contributes the same number of queries or predictions), so resampling the sequences
with replacement gives the interval a reviewer asks for (Efron & Tibshirani 1993, ch. 13,
percentile method), computed by :func:`scipy.stats.bootstrap`.
"""

from __future__ import annotations

import numpy as np

LEVEL = 0.95
N_RESAMPLES = 2000


def bootstrap_ci(per_sequence: np.ndarray, level: float = LEVEL, n_resamples: int = N_RESAMPLES,
                 seed: int = 0) -> np.ndarray:
    """Percentile-bootstrap interval of the mean over axis 0 (sequences).

    Args:
        per_sequence: ``[n_seq, ...]`` one value per sequence (and per head, ...).
        level: confidence level. n_resamples: bootstrap resamples. seed: their random state.

    Returns:
        ``[2, ...]``: lower and upper bounds; NaN where fewer than 2 sequences (no interval).
    """
    x = np.asarray(per_sequence, dtype=float)
    if x.shape[0] < 2:
        return np.full((2, *x.shape[1:]), np.nan)
    from scipy.stats import bootstrap

    res = bootstrap((x,), np.mean, axis=0, vectorized=True, confidence_level=level, n_resamples=n_resamples,
                    method="percentile", random_state=np.random.default_rng(seed))
    lo, hi = res.confidence_interval
    # a constant column gives a degenerate interval (scipy returns it, with a warning, as NaN on some versions)
    const = np.all(x == x[:1], axis=0)
    lo, hi = np.where(const, x[0], lo), np.where(const, x[0], hi)
    return np.stack([lo, hi])
