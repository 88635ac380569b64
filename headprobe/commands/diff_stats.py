"""``headprobe diff``'s statistics (numpy): each head's paired change and its sign-flip test
(:func:`~headprobe.analyses.robustness.sign_flip_p`) corrected over the heads
(:func:`~headprobe.analyses.statistics.adjust_p_values`), the changed heads and flipped roles,
diff.csv's table, and what the test could detect per task
(:func:`~headprobe.analyses.robustness.detection_limit`) with the notes that say so. Used by
:mod:`headprobe.commands.diff_core`."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from headprobe.analyses import robustness as rb
from headprobe.analyses.columns import DETECTORS
from headprobe.analyses.statistics import adjust_p_values
from headprobe.commands.diff import DiffConfig
from headprobe.probe.hooks.ablation import format_head
from headprobe.probe.layout.spec import ModelSpec


def compare(
    a: dict[str, np.ndarray], b: dict[str, np.ndarray], correction: str, n_perm: int, seed: int
) -> dict[str, dict[str, np.ndarray]]:
    """Quantity -> ``{"change", "p", "p_adjusted"}`` ``[layer, head]``: the mean paired change ``B - A``
    over sequences, its sign-flip p and the p adjusted over the heads (NaN p's left out)."""
    out = {}
    for q in a:
        d = b[q] - a[q]  # [batch, layer, head]
        p = rb.sign_flip_p(d, n_perm, seed)
        adj = np.full(p.shape, np.nan)
        ok = ~np.isnan(p)
        adj[ok] = adjust_p_values(p[ok].tolist(), correction)
        out[q] = {"change": d.mean(axis=0), "p": p, "p_adjusted": adj}
    return out


def change_floor(a_values: np.ndarray, b_values: np.ndarray, min_change: float) -> float:
    """``min_change`` standard deviations of a quantity over the heads, pooled over the two models
    (``sqrt((var_A + var_B) / 2)``: symmetric in A and B, and not near 0 when one model, e.g. a
    random initialisation, has all heads alike), in the quantity's units."""
    return min_change * float(np.sqrt((np.nanvar(a_values) + np.nanvar(b_values)) / 2))


def changed_heads(
    test: dict, a_values: np.ndarray, b_values: np.ndarray, alpha: float, min_change: float
) -> np.ndarray:
    """``[layer, head]`` bool: the change is significant (``p_adjusted <= alpha``) and at least
    :func:`change_floor` (an effect-size floor: with many paired sequences the test alone detects
    shifts of a thousandth)."""
    floor = change_floor(a_values, b_values, min_change)
    with np.errstate(invalid="ignore"):
        return (test["p_adjusted"] <= alpha) & (np.abs(test["change"]) >= floor)


def role_changes(
    tests: dict, means: dict, top: dict, alpha: float, min_change: float, baselines: dict
) -> tuple[list[dict], list[dict]]:
    """``(flipped, not_roles)``, each ``[{"head", "why"}]`` (a flip's also ``"types"``: the head types it flipped in). A head's role flipped: it entered or left a
    type's top-k set AND its score of that type changed (:func:`changed_heads`; a swap at the top-k
    boundary within the noise is not a flip) in the crossing's direction (up where it entered, down
    where it left: one that left while its score rose left because a neighbour rose more) AND, in
    the model where it is top-k, it scores above
    ``baselines[type]`` (:func:`~headprobe.analyses.verdicts.uniform_baselines`: what a head attending
    uniformly over its causal context scores; a type without one is not checked). A changed top-k
    crossing at or below that score is no role in either model: ``not_roles``."""
    why: dict[tuple[int, int], list[str]] = {}
    low: dict[tuple[int, int], list[str]] = {}
    types: dict[tuple[int, int], list[str]] = {}
    for t, sets in top.items():
        q = DETECTORS[t].rank_by
        changed = changed_heads(tests[q], means["A"][q], means["B"][q], alpha, min_change)
        for h in set(sets["A"]) ^ set(sets["B"]):
            if not changed[h]:
                continue
            where = "A" if h in sets["A"] else "B"
            if (tests[q]["change"][h] > 0) != (where == "B"):  # moved against its crossing: a neighbour moved
                continue
            score, base = float(means[where][q][h]), baselines.get(t)
            if base is not None and score <= base:
                low.setdefault(h, []).append(
                    f"{t}: top-k in {where} only with score {score:.4g}, at or below {base:.4g}, the {t} score "
                    "of a head attending uniformly over its causal context"
                )
                continue
            above = "" if base is None else f", {score / base:.3g}x a uniformly attending head's {base:.4g} in {where}"
            types.setdefault(h, []).append(t)
            why.setdefault(h, []).append(
                f"{t}: top-k in {where} only, {q} changed by "
                f"{tests[q]['change'][h]:+.4g} (p adj {tests[q]['p_adjusted'][h]:.3g}{above})"
            )
    return [{"head": format_head(h), "types": types[h], "why": w} for h, w in sorted(why.items())], [
        {"head": format_head(h), "why": w} for h, w in sorted(low.items())
    ]


def _table(means: dict, tests: dict, top: dict, n_layers: int, n_heads: int, own: dict | None = None) -> pd.DataFrame:
    """diff.csv: one row per head; ``own_change`` and ``own_change_<part>`` from :func:`~headprobe.analyses.own_weights.own_weight_change` (``own``)."""
    rows = []
    for layer in range(n_layers):
        for head in range(n_heads):
            row: dict = {"layer": layer, "head": head}
            for key, v in (own or {}).items():
                if not key.endswith("_norm_ratio"):
                    row["own_change" if key == "own_change" else f"own_change_{key}"] = v[layer, head]
            for q, t in tests.items():
                row.update(
                    {
                        f"{q}_a": means["A"][q][layer, head],
                        f"{q}_b": means["B"][q][layer, head],
                        f"{q}_change": t["change"][layer, head],
                        f"{q}_p": t["p"][layer, head],
                        f"{q}_p_adjusted": t["p_adjusted"][layer, head],
                    }
                )
            for name, sets in top.items():
                row[f"{name}_top_a"] = int((layer, head) in sets["A"])
                row[f"{name}_top_b"] = int((layer, head) in sets["B"])
            rows.append(row)
    return pd.DataFrame(rows)


def quantity_task(quantity: str, types: Sequence[str]) -> str:
    """The token set a quantity is measured on: ``ablation_<task>``'s task, a type's ranking column's dataset."""
    if quantity.startswith("ablation_"):
        return quantity.removeprefix("ablation_")
    return next(str(DETECTORS[t].dataset) for t in types if DETECTORS[t].rank_by == quantity)


FLAG_OF_TASK = {"natural": "--n-natural", "repeated": "--n-repeated"}
"""The setting that gives a task's sequence count."""


def undetectable_reason(d: dict, task: str, cfg: DiffConfig) -> str:
    """The clause of the NOTE and the report saying why no change on ``task`` could pass (``d``:
    :func:`~headprobe.analyses.robustness.detection_limit`) and what would allow one."""
    flag, need = FLAG_OF_TASK[task], d["sequences_needed"]
    fix = (
        f"{flag} {need} or more would allow one"
        + (
            f" ({d['sequences_needed_alone']} for one head's change alone)"
            if d["sequences_needed_alone"] not in (None, need)
            else ""
        )
        if need is not None
        else f"no sequence count would: the test's {d['flips']} flips give at best {d['smallest_p']:.3g}; raise --n-perm"
    )
    return (
        f"{d['n_sequences']} {task} sequences give p >= {d['smallest_p']:.3g} at best, and {cfg.correction} over "
        f"{d['n_tests']} heads at alpha {cfg.alpha} needs p <= {d['p_needed_every_head']:.3g}; {fix}"
    )


def detection_notes(detection: dict, cfg: DiffConfig) -> list[str]:
    """The plan's NOTE lines (without ``NOTE: ``): a task on which no change can pass, or on which
    a head's change can pass only with many others changed too."""
    out = []
    for task, d in detection.items():
        if not d["detectable"]:
            out.append(f"diff can detect no change on {task}: {undetectable_reason(d, task, cfg)}")
        elif not d["detectable_alone"]:
            need = d["sequences_needed_alone"]
            out.append(
                f"on {task}, {d['n_sequences']} sequences give p >= {d['smallest_p']:.3g} at best: a head's change "
                f"passes {cfg.correction} over {d['n_tests']} heads only with at least {d['heads_needed']} heads "
                f"changed that much (alone it needs p <= {d['p_needed_one_head']:.3g}"
                + (f"; {FLAG_OF_TASK[task]} {need} or more)" if need is not None else "; raise --n-perm)")
            )
    return out


def _detection(spec: ModelSpec, counts: dict[str, int], cfg: DiffConfig) -> dict:
    """:func:`~headprobe.analyses.robustness.detection_limit` per task over the model's attention heads."""
    m = spec.n_heads * len(spec.attention_layers)
    return {
        task: rb.detection_limit(n, m, cfg.alpha, cfg.correction, cfg.n_perm, cfg.seed) for task, n in counts.items()
    }
