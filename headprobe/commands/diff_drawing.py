"""diff.png: one heatmap of each head's change per quantity, its labels, colour limits and title,
and :func:`redraw`, the same figure from a run's saved diff.csv and summary.json. A run's figure
is :func:`headprobe.commands.diff_core.diff_figure`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from headprobe.analyses.columns import DETECTORS
from headprobe.probe.core.heads import format_head, parse_heads

SCORE_UNITS = {"positional_fraction": "share of queries"}
"""The unit of a head type's ranking score where it is not an attention weight (0-1)."""


def quantity_labels(quantity: str) -> tuple[str, str]:
    """``(title, colour bar label)`` of a quantity of diff.png: a head type's ranking score (an
    attention weight, or :data:`SCORE_UNITS`) or ``ablation_<task>``, the single-head ablation
    effect (nats/token); the label names the quantity and its unit."""
    from headprobe.analyses.figures import TASK_LABELS

    if quantity.startswith("ablation_"):
        return f"ablation effect on the {TASK_LABELS[quantity.removeprefix('ablation_')]}", (
            "Δ ablation effect\n(nats/token)"
        )
    style = next(s for d in DETECTORS.values() for s in d.figures if s.column == quantity)
    return style.title, f"Δ {style.title}\n({SCORE_UNITS.get(quantity, 'attention weight')})"


def colour_limit(a_values: np.ndarray, b_values: np.ndarray) -> float:
    """A diff.png panel's colour limit: the quantity's largest ``|value|`` over the heads of A and B, so
    a change's shade is its share of the quantity's range (a 0.001 change of scores up to 0.02 stays
    pale beside a 0.08 change of effects up to 0.3); NaN where no value is finite."""
    v = np.abs(np.concatenate([np.ravel(a_values), np.ravel(b_values)]).astype(float))
    return float(np.nanmax(v)) if np.isfinite(v).any() else float("nan")


def no_box_caveat(detection: dict, tasks, correction: str) -> str:
    """The line diff.png's title carries where no head of some panels could be boxed, whatever the
    models did: the paired test over so few sequences cannot reach the corrected threshold (the
    report's "none could be"). ``detection``: summary.json's (task -> :func:`~headprobe.analyses.robustness.detection_limit`);
    ``tasks``: the drawn quantities' tasks. E.g. "NO VERDICT: no head could be boxed (p >= 0.125 from
    4 sequences, bh needs <= 0.05)"; "for natural sequences" where the other task's panels could
    be; "" where every panel could be."""
    tasks = list(dict.fromkeys(tasks))
    blind = [t for t in tasks if t in detection and not detection[t]["detectable"]]
    if not blind:
        return ""
    limits = [detection[t] for t in blind]
    counts = {d["n_sequences"] for d in limits}
    seqs = (
        f"{counts.pop()} sequences"
        if len(counts) == 1
        else ", ".join(f"{d['n_sequences']} {t}" for t, d in zip(blind, limits)) + " sequences"
    )
    scope = "" if len(blind) == len(tasks) else f" for {' and '.join(blind)} sequences"
    p = min(d["smallest_p"] for d in limits)
    needed = min(d["p_needed_every_head"] for d in limits)
    return f"NO VERDICT{scope}: no head could be boxed (p >= {p:.3g} from {seqs}, {correction} needs <= {needed:.3g})"


CORRECTION_TITLES = {"bh": "Benjamini-Hochberg", "holm": "Holm"}
"""How diff.png's title names the correction over heads: in full, as the scan's overview and ablation
figures do ("bh" there read as an unexplained abbreviation)."""


def figure_title(
    a: str,
    b: str,
    requantize_b,
    correction: str,
    alpha: float,
    min_change: float,
    k: int | None,
    caveat: str = "",
) -> str:
    """diff.png's title: the two models, ``caveat`` (:func:`no_box_caveat`) on a line of its own where
    given, and what the boxes and dots mean (``correction`` named by :data:`CORRECTION_TITLES`, the
    top-k set by its ``k``)."""
    correction = CORRECTION_TITLES.get(correction, correction)
    return (
        f"Change B − A per head: A = {a}, B = {b}"
        + (f" re-quantized to {requantize_b}" if requantize_b else "")
        + (f"\n{caveat}" if caveat else "")
        + f"\nboxed: changed (significant, {correction} over heads at alpha {alpha}, paired sign-flip test "
        f"over sequences, and >= {min_change} pooled sd over heads); filled dot: role flipped (top-{k} "
        f"membership, a change its way, above a uniform head); hollow: crossed the top-{k} boundary without a flip; colours: −m to +m, "
        "m the quantity's largest |value| in A or B"
    )


def flips_by_type(flipped: list[dict]) -> dict[str, set[str]]:
    """Head type -> the heads (``"L.H"``) whose role flipped in it, from the report's flips (summary.json's
    ``flipped``; one older than its ``types`` names each type at the start of a ``why``)."""
    out: dict[str, set[str]] = {}
    for f in flipped:
        for t in f.get("types") or [w.split(":", 1)[0] for w in f["why"]]:
            out.setdefault(t, set()).add(f["head"])
    return out


def role_dots(top: dict, flipped: list[dict], quantities: set[str]) -> dict[str, dict[tuple[int, int], bool]]:
    """Ranking quantity -> ``{head: filled}`` for each head that crossed a type's top-k boundary
    (``top``): filled where its role flipped (``flipped``, the report's), hollow (False) otherwise;
    only the ``quantities`` drawn."""
    dotted: dict[str, dict[tuple[int, int], bool]] = {}
    flips = flips_by_type(flipped)
    for t, sets in top.items():
        q = DETECTORS[t].rank_by
        moved = {tuple(h) for h in sets["A"]} ^ {tuple(h) for h in sets["B"]}
        if q in quantities:
            dotted[q] = {(int(h[0]), int(h[1])): format_head(h) in flips.get(t, set()) for h in moved}
    return dotted


def draw_diff(
    changes: dict,
    changed: dict,
    top: dict,
    title: str,
    flipped: list[dict],
    group_size: int | None = None,
    limits: dict | None = None,
    min_change: float | None = None,
):
    """One heatmap per quantity (:func:`~headprobe.analyses.figures.diff_heatmaps`): each head's mean
    paired change B - A (``changes``, ``[layer, head]``; diverging colours, 0 white); heads that
    changed (``changed``, :func:`~headprobe.commands.diff_stats.changed_heads`) boxed; for a type's ranking score, a filled dot
    where the head's role flipped (``flipped``: the report's flips, :func:`~headprobe.commands.diff_stats.role_changes`)
    and a hollow one where it crossed the top-k boundary (``top``: type -> ``{"A": heads, "B": heads}``)
    without a flip. ``limits``: quantity -> colour limit
    (:func:`colour_limit`); ``min_change``: the floor named in a panel where no head is boxed."""
    from headprobe.analyses.figures import diff_heatmaps

    dotted = role_dots(top, flipped, set(changed))
    panels = [(*quantity_labels(q), changes[q], changed[q], dotted.get(q, {})) for q in changes]
    empty = None if min_change is None else f"no head changed significantly by >= {min_change:g} sd"
    lims = None if limits is None else [limits.get(q, float("nan")) for q in changes]
    return diff_heatmaps(panels, title, group_size, lims, empty)


def redraw(out: str | Path) -> dict:
    """diff.png's figure from a run's saved numbers (diff.csv's changes, summary.json's changed heads,
    top-k sets and settings), as ``{"diff": Figure}``: the figure is a function of those alone."""
    import json

    out = Path(out)
    summary = json.loads((out / "summary.json").read_text())
    table = pd.read_csv(out / "diff.csv")
    L, H = summary["layout"]["n_layers"], summary["layout"]["n_heads"]

    def grid(values) -> np.ndarray:
        g = np.full((L, H), np.nan)
        g[table["layer"].to_numpy(), table["head"].to_numpy()] = values
        return g

    def heads(names) -> list[tuple[int, int]]:
        return parse_heads(",".join(names), L, H) if names else []

    quantities = summary["quantities"]
    changed = {}
    for q, v in quantities.items():
        changed[q] = np.zeros((L, H), dtype=bool)
        for h in heads(v["changed"]):
            changed[q][h] = True
    top = {t: {m: heads(hs) for m, hs in v.items()} for t, v in summary["top_k"].items()}
    c = summary["config"]
    named = CORRECTION_TITLES.get(c["correction"], c["correction"])
    caveat = no_box_caveat(summary.get("detection", {}), [v["task"] for v in quantities.values()], named)
    title = figure_title(
        summary["model"],
        summary["model_b"],
        c["requantize_b"],
        c["correction"],
        c["alpha"],
        c["min_change"],
        c["k"],
        caveat,
    )
    kv = summary["layout"].get("n_kv_heads")  # absent from a summary.json older than the field: no groups
    group = H // kv if kv else None
    limits = {q: colour_limit(table[f"{q}_a"].to_numpy(), table[f"{q}_b"].to_numpy()) for q in quantities}
    changes = {q: grid(table[f"{q}_change"]) for q in quantities}
    return {"diff": draw_diff(changes, changed, top, title, summary["flipped"], group, limits, c["min_change"])}
