"""A ``headprobe study`` run's per-variant numbers from its results.csv (one row per variant and
seed), torch-free: the one aggregation behind study.json's ``per_variant``, the terminal report and
``headprobe export --format latex``'s study table, and the rule of "induction formed in every seed"
the figure and study.json use, so that none of them can differ."""

from __future__ import annotations

import pandas as pd

from headprobe.analyses.train_config import INDUCTION_FORMED

FORMED_BY = {"induction_ci95_low": "induction 95% lower bound", "max_induction": "induction score"}
"""results.csv's column that says whether an induction head formed -> its name in the figure's legend."""


def formed_column(table: pd.DataFrame) -> str:
    """The :data:`FORMED_BY` column of ``table``: the top head's lower 95% bound (``induction_ci95_low``,
    :func:`headprobe.analyses.train.induction_formed`); in a results.csv written before it, the top
    score (``max_induction``)."""
    return "induction_ci95_low" if "induction_ci95_low" in table.columns else "max_induction"


def formed_in_every_seed(table: pd.DataFrame) -> pd.Series:
    """Per variant of ``table`` (results.csv), whether an induction head formed in every seed: its
    :func:`formed_column` above 0.5 in each."""
    return table.groupby("variant", sort=False)[formed_column(table)].min() > INDUCTION_FORMED


def variant_stats(table: pd.DataFrame) -> pd.DataFrame:
    """One row per variant of ``table`` (results.csv), in its order: the held-out and in-context
    losses' mean, standard deviation over seeds (NaN from one seed), min and max (nats/token, or
    nats/char on text), the mean and least of the top induction score, the cost columns (KV cache
    bytes per token, attention parameters per layer: the same in every seed), the mean seconds and
    ``n_seeds`` (distinct seeds)."""
    g = table.groupby("variant", sort=False)
    agg = g.agg(
        eval_loss=("eval_loss", "mean"),
        eval_loss_sd=("eval_loss", "std"),
        eval_loss_min=("eval_loss", "min"),
        eval_loss_max=("eval_loss", "max"),
        in_context_loss=("in_context_loss", "mean"),
        in_context_loss_sd=("in_context_loss", "std"),
        in_context_loss_min=("in_context_loss", "min"),
        in_context_loss_max=("in_context_loss", "max"),
        max_induction=("max_induction", "mean"),
        min_max_induction=("max_induction", "min"),
        kv_bytes_per_token=("kv_bytes_per_token", "first"),
        seconds=("seconds", "mean"),
    )
    if "attn_params_per_layer" in table.columns:
        agg.insert(
            agg.columns.get_loc("kv_bytes_per_token") + 1, "attn_params_per_layer", g["attn_params_per_layer"].first()
        )
    agg["n_seeds"] = g["seed"].nunique()
    return agg


HEADLINE_COLUMNS = (
    "eval_loss", "eval_loss_sd", "eval_loss_min", "eval_loss_max", "in_context_loss", "in_context_loss_sd",
    "max_induction", "min_max_induction", "kv_bytes_per_token", "seconds",
)  # fmt: skip
"""The :func:`variant_stats` columns study.json's ``per_variant`` records (4 decimals)."""

REPORT_COLUMNS = ("eval_loss", "in_context_loss", "max_induction", "kv_bytes_per_token")
"""The means ``headprobe study`` prints per variant (3 decimals), each loss with its ``_sd``."""

REPORT_DIGITS = 3
"""Decimals of the terminal report's (and the LaTeX table's) numbers."""
