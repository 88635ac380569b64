"""The head atlas: every head of many scanned models in one table, and where each head type sits
by relative depth across them.

Pure functions over what ``headprobe scan`` writes (``head_scores.csv`` and ``summary.json``);
they load no model. :func:`atlas_rows` turns one scan into rows of the atlas table,
:func:`depth_plot` draws one head type across the models, :func:`atlas_overview` every type
side by side (for a paper), :func:`over_training_plot` one model's checkpoints in training order.

Conventions (also in docs/atlas.md): ``relative_depth = layer / (n_layers - 1)`` (0 for a
one-layer model), so the first layer is 0 and the last is 1 in every model. A head is *top* for a
type when it is among the ``k`` heads that the scan ablated for that type; its verdict is the
scan's verdict for that set of heads under :data:`VERDICT_KIND` ablation (the first kind scanned
when that one was not): ``CONFIRMED``, ``not confirmed`` or ``no verdict``, and empty for heads
outside the top ``k``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from headprobe.analyses.detectors import DETECTORS
from headprobe.analyses.figures import COLUMN_WIDTH, PAGE_WIDTH, _figure, _styled
from headprobe.analyses.verdicts import LABELS, VerdictRule, label
from headprobe.analyses.verdicts import VERDICTS as _VERDICTS

if TYPE_CHECKING:  # matplotlib is imported where a figure is drawn, not by a run that draws none
    from matplotlib.figure import Figure

VERDICT_KIND = VerdictRule().tested_kind
"""The ablation kind whose verdict the atlas reports per type: the one scan tests (the verdict
rule's ``tested_kind``, mean ablation); the other kind's rows carry no verdict."""

VERDICTS = _VERDICTS
"""The labels (:data:`headprobe.analyses.verdicts.VERDICTS`)."""

ID_COLUMNS = ("model", "family", "step", "n_layers", "n_heads", "layer", "relative_depth", "head", "kv_head")
"""The first columns of atlas.csv; the score columns and each type's ``<type>_top`` /
``<type>_verdict`` follow."""


_verdict = label


def scan_rule(summary: dict) -> VerdictRule | None:
    """The verdict rule a scan's summary.json records (``verification.verdict_rule``; an older one's:
    what its rows carry), or None for a scan without verdicts."""
    return VerdictRule.from_rows(summary.get("ablations", []), (summary.get("verification") or {}).get("verdict_rule"))


def verdict_rule_text(rules: Sequence[VerdictRule]) -> str:
    """The atlas's statement of its verdicts: each type's is its scan's tested verdict of its top-k
    heads, under the scans' rule (:meth:`VerdictRule.condition`; each scan's summary.json where they differ)."""
    kinds = sorted({r.tested_kind for r in rules}) or [VERDICT_KIND]
    text = f"each type's verdict is its scan's {'/'.join(kinds)}-ablation verdict of its top-k heads"
    conditions = list(dict.fromkeys(r.condition() for r in rules))
    if len(conditions) == 1:
        return f"{text}; CONFIRMED: {conditions[0]}"
    return text + (
        "; CONFIRMED as each scan's summary.json states (verification.confirmation_rule)" if conditions else ""
    )


def type_verdicts(summary: dict) -> dict[str, tuple[list[str], str]]:
    """Head type -> (its top-k heads as ``"L.H"``, the verdict) from a scan's summary.json: the
    tested row's (``tested``), else the :data:`VERDICT_KIND` row's (a scan without the flag), else
    the type's first ablation's."""
    out: dict[str, tuple[list[str], str, tuple[bool, bool]]] = {}
    rank = lambda v: (bool(v.get("tested")), v["kind"] == VERDICT_KIND)
    for v in summary.get("ablations", []):
        t = v["head_type"]
        if t not in out or rank(v) > out[t][2]:
            out[t] = (list(v["top_heads"]), _verdict(v["confirmed"]), rank(v))
    return {t: (heads, verdict) for t, (heads, verdict, _) in out.items()}


def head_types(summary: dict) -> list[str]:
    """The head types a scan scored (its ``config.types``), in :data:`DETECTORS` order."""
    types = list(summary.get("config", {}).get("types") or [])
    return sorted(types, key=lambda t: (list(DETECTORS).index(t) if t in DETECTORS else len(DETECTORS), t))


def atlas_rows(scores: pd.DataFrame, summary: dict, model: str, family: str, step: int | None = None) -> pd.DataFrame:
    """One scanned model's rows of the atlas table.

    Args:
        scores: the scan's head_scores.csv (one row per head: ``layer``, ``head``, ``kv_head``, scores).
        summary: the scan's summary.json (its ``layout``, ``config.types`` and ``ablations`` are read).
        model: the model's label in the atlas; family: its architecture family (``llama``, ``bert``, ...).
        step: the training step of a checkpoint (None for a finished model).

    Returns:
        a DataFrame with :data:`ID_COLUMNS`, every score column of ``scores``, and per head type
        ``<type>_top`` (bool) and ``<type>_verdict`` (see the module docstring).

    Raises:
        ValueError: ``scores`` does not have one row per head of the summary's layout.
    """
    n_layers, n_heads = int(summary["layout"]["n_layers"]), int(summary["layout"]["n_heads"])
    if len(scores) != n_layers * n_heads:
        raise ValueError(f"{model}: head_scores.csv has {len(scores)} rows, the layout {n_layers}x{n_heads} heads")
    t = scores.copy()
    score_cols = [c for c in t.columns if c not in ("layer", "head", "kv_head")]
    ids = pd.DataFrame(
        {
            "model": model,
            "family": family,
            "step": step if step is not None else pd.NA,
            "n_layers": n_layers,
            "n_heads": n_heads,
            "layer": t["layer"].astype(int),
            "relative_depth": t["layer"] / max(n_layers - 1, 1),
            "head": t["head"].astype(int),
            "kv_head": t["kv_head"].astype(int),
        }
    )
    rows = pd.concat([ids, t[score_cols]], axis=1)
    names = [f"{int(layer)}.{int(head)}" for layer, head in zip(t["layer"], t["head"])]
    verdicts = type_verdicts(summary)
    for ht in head_types(summary):
        top, verdict = verdicts.get(ht, ([], ""))
        is_top = np.array([n in set(top) for n in names])
        rows[f"{ht}_top"] = is_top
        rows[f"{ht}_verdict"] = np.where(is_top, verdict, "")
    return rows


def model_remarks(scores: pd.DataFrame, summary: dict) -> dict[str, list[str]]:
    """Type -> remarks on what one model's verdict tests (:func:`~headprobe.analyses.verdicts.verdict_remarks`),
    from its scan's head_scores.csv (``scores``) and summary.json: the top-k sets of ``ablations``, the
    token sets of ``tokens`` (the uniform-attention baselines; a causal model only: an encoder's
    ``metric`` is not ``loss``). Recomputed from these files, so a resumed scan written before
    summary.json had ``verdict_remarks`` gets them too; {} where there is none."""
    from headprobe.analyses.verdicts import uniform_baselines, verdict_remarks

    top = {t: heads for t, (heads, _) in type_verdicts(summary).items() if heads}
    names = [f"{int(layer)}.{int(head)}" for layer, head in zip(scores["layer"], scores["head"])]
    values = {t: dict(zip(names, scores[t].astype(float))) for t in top if t in scores}
    causal = (summary.get("metric") or {}).get("name", "loss") == "loss"
    return verdict_remarks(top, values, uniform_baselines(summary.get("tokens") or {}) if causal else {})


def atlas_table(parts: Sequence[pd.DataFrame]) -> pd.DataFrame:
    """The atlas table: the models' :func:`atlas_rows` stacked, columns in a stable order
    (:data:`ID_COLUMNS`, then score columns, then the ``_top``/``_verdict`` pairs); a column a
    model lacks (a head type it was not scored on) is empty for it."""
    table = pd.concat(list(parts), ignore_index=True, sort=False)
    tail = [c for c in table.columns if c.endswith(("_top", "_verdict"))]
    scores = [c for c in table.columns if c not in ID_COLUMNS and c not in tail]
    return table[list(ID_COLUMNS) + scores + tail]


def table_types(table: pd.DataFrame) -> list[str]:
    """The head types with ``_top`` columns in an atlas table, in :data:`DETECTORS` order."""
    types = [c.removesuffix("_top") for c in table.columns if c.endswith("_top")]
    return sorted(types, key=lambda t: (list(DETECTORS).index(t) if t in DETECTORS else len(DETECTORS), t))


def _rank_column(head_type: str) -> str:
    return DETECTORS[head_type].rank_by if head_type in DETECTORS else head_type


DEPTH_LABEL = "depth: layer l of L drawn from l/L to (l+1)/L"
DEPTH_TICKS = (0.0, 0.5, 1.0)
"""The depth axis' ticks, each labelled (``0``, ``0.5``, ``1``): the middle one was drawn bare."""

_MARK = {
    LABELS[True]: dict(marker="o", filled=True),
    LABELS[False]: dict(marker="o", filled=False),
    LABELS[None]: dict(marker="x", filled=True),
}
_COLOR = "#0072B2"  # Okabe-Ito blue
_GREY = "#9e9e9e"


def _marker_area(score: np.ndarray | float, scale: float) -> np.ndarray | float:
    """A top-k marker's area (points^2) for ``|score|`` on the panel's ``scale``: 6 to 36."""
    return 6 + 30 * np.clip(np.abs(score) / scale, 0, 1)


def _size_key(scales: Sequence[float]) -> list:
    """Legend entries for the marker area: three scores with their markers' sizes (the panels' one
    scale; fractions of each panel's largest score where the panels' scales differ)."""
    from matplotlib.lines import Line2D

    one = len(set(scales)) == 1
    scale = scales[0] if one else 1.0
    return [
        Line2D(
            [],
            [],
            marker="o",
            ls="",
            color=_COLOR,
            markersize=float(np.sqrt(_marker_area(v, 1.0))),
            label=(f"score {v * scale:g}" if one else f"{v:g} x the panel's largest score"),
        )
        for v in (0.1, 0.5, 1.0)
    ]


def _depth_panel(ax, table: pd.DataFrame, head_type: str, labels: Sequence[str], show_labels: bool) -> float:
    """One type across the models: row per model, x = relative depth; every head a faint tick,
    the top-k heads marked by verdict, their size by score (:func:`_marker_area`). Returns the
    score scale of the sizes."""
    col = _rank_column(head_type)
    # marker size on one scale for every model (scores in [0, 1] as they are), so a model whose best
    # head scores 0.01 does not get the markers of one whose best scores 0.9
    values = np.abs(table[col].to_numpy(dtype=float)) if col in table else np.array([1.0])
    scale = max(1.0, float(np.nanmax(values))) if np.isfinite(values).any() else 1.0
    for y, model in enumerate(labels):
        m = table[table["model"] == model]
        if m.empty:
            continue
        n_layers, n_heads = int(m["n_layers"].iloc[0]), int(m["n_heads"].iloc[0])
        # layer L is the band [L, L+1] / n_layers of the depth axis, its heads spread across the band
        x = (m["layer"].to_numpy() + (m["head"].to_numpy() + 0.5) / n_heads) / n_layers
        ax.plot([0, 1], [y, y], color="#e0e0e0", lw=0.6, zorder=0)
        bounds = np.arange(1, n_layers) / n_layers  # where one layer's band ends and the next begins
        many = n_layers > LAYER_NAMES_MAX  # thirty dividers in a row: lighter and shorter
        h = 0.22 if many else 0.32
        ax.vlines(bounds, y - h, y + h, color="#cccccc" if many else _DIVIDER, lw=0.4 if many else 0.5, zorder=0.5)
        if col not in m or f"{head_type}_top" not in m or m[col].isna().all():
            ax.text(
                0.5,
                y,
                "not scored",
                ha="center",
                va="center",
                fontsize=5.5,
                color=_GREY,
                bbox=dict(facecolor="white", edgecolor="none", pad=0.5),
            )
            continue
        score = m[col].to_numpy(dtype=float)
        ax.scatter(x, np.full(len(x), y), s=1.5, color=_GREY, lw=0, zorder=1)
        top = m[f"{head_type}_top"].fillna(False).to_numpy(dtype=bool)
        for verdict, style in _MARK.items():
            sel = top & (m[f"{head_type}_verdict"].to_numpy() == verdict)
            if not sel.any():
                continue
            sizes = _marker_area(score[sel], scale)
            if style["filled"]:
                ax.scatter(
                    x[sel], np.full(sel.sum(), y), s=sizes, marker=style["marker"], color=_COLOR, lw=0.8, zorder=3
                )
            else:
                ax.scatter(
                    x[sel],
                    np.full(sel.sum(), y),
                    s=sizes,
                    marker=style["marker"],
                    facecolors="none",
                    edgecolors=_COLOR,
                    lw=0.8,
                    zorder=3,
                )
    ax.set_xlim(-0.03, 1.03)
    _layer_names(ax, table, labels)
    ax.set_ylim(len(labels) - 0.5, -0.5)
    ax.set_yticks(range(len(labels)), labels)
    ax.tick_params(axis="y", labelleft=show_labels, length=0)
    ax.set_xticks(DEPTH_TICKS, [f"{v:g}" for v in DEPTH_TICKS])  # each labelled: a bare mid tick read as unlabelled
    ax.set_xlabel(DEPTH_LABEL)
    ax.set_title(head_type.replace("_", "-"))
    return scale


_DIVIDER = "#9e9e9e"
"""The colour of the layer boundaries on a depth row."""
LAYER_NAMES_MAX = 8
"""The most layers whose bands :func:`_layer_names` names above a panel (more would crowd the axis)."""


def _layer_names(ax, table: pd.DataFrame, labels: Sequence[str]) -> None:
    """Name each layer's band (``L0``, ``L1``, ...) on a depth panel's top axis where every model of the
    panel has the same number of layers, at most :data:`LAYER_NAMES_MAX`: in a toy of 2 layers, which
    dot is in which layer (the rows' dividers alone do not say which band is which)."""
    counts = {int(n) for n in table.loc[table["model"].isin(labels), "n_layers"].dropna()}
    if len(counts) != 1 or (n := counts.pop()) > LAYER_NAMES_MAX:
        return
    top = ax.secondary_xaxis("top")
    top.set_xticks((np.arange(n) + 0.5) / n, [f"L{i}" for i in range(n)])
    top.tick_params(length=0, labelsize=5, pad=1, colors="#555555")


def _legend_handles() -> list:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    return [
        Line2D([], [], marker="o", ls="", color=_COLOR, label=f"top-k, {LABELS[True]}"),
        Line2D(
            [], [], marker="o", ls="", markerfacecolor="none", markeredgecolor=_COLOR, label=f"top-k, {LABELS[False]}"
        ),
        Line2D([], [], marker="x", ls="", color=_COLOR, label=f"top-k, {LABELS[None]}"),
        Line2D([], [], marker="o", ls="", color=_GREY, markersize=2, label="other heads"),
        Patch(
            color="none",
            label="x: depth, layer l of L spanning l/L to (l+1)/L, its heads side by side between grey "
            "dividers (atlas.csv's relative_depth is l/(L-1)); marker area: score",
        ),
    ]


def model_labels(table: pd.DataFrame) -> list[str]:
    """The models of an atlas table in their order of appearance."""
    return list(dict.fromkeys(table["model"]))


DEPTH_PLOT_FRAME_IN = 1.45
"""Inches of :func:`depth_plot` around its axes: a title of up to two lines, the depth axis and
its label, and the four-row legend with its title (1.33 in measured at one-line titles)."""
DEPTH_PLOT_ROW_IN = 0.2
"""Inches of :func:`depth_plot`'s axes per model: the figure grows by a row per model, so one or
two models keep their row instead of the legend taking the axes' height (the constrained layout
then collapsed the axes to nothing)."""


@_styled
def depth_plot(table: pd.DataFrame, head_type: str) -> Figure:
    """Where ``head_type``'s top-k heads sit by relative depth in each model of ``table``
    (one row per model; marker = the scan's tested verdict of the type (:data:`VERDICT_KIND`
    ablation), area = score on one scale for all models)."""
    labels = model_labels(table)
    fig = _figure(COLUMN_WIDTH, DEPTH_PLOT_FRAME_IN + DEPTH_PLOT_ROW_IN * len(labels))
    ax = fig.subplots()
    scale = _depth_panel(ax, table, head_type, labels, show_labels=True)
    over = "over training" if "step" in table and table["step"].notna().all() else "across models"
    ax.set_title(f"{head_type.replace('_', '-')} heads {over}")
    fig.legend(
        handles=_legend_handles()[:4] + _size_key([scale]),
        loc="outside lower center",
        ncol=2,
        frameon=False,
        fontsize=5.5,
        title="marker area: score",
        title_fontsize=5.5,
    )
    return fig


OVERVIEW_FRAME_IN = 1.0
"""Inches of :func:`atlas_overview` outside its rows of panels: the title and the legend under
them (its title and four rows)."""
OVERVIEW_PANEL_IN, OVERVIEW_ROW_IN = 0.35, 0.22
"""Inches of a row of :func:`atlas_overview`'s panels: their titles and depth ticks, plus one row
per model (with one model and one row of panels the legend took the axes' height: the
constrained layout collapsed them)."""


@_styled
def atlas_overview(table: pd.DataFrame, title: str = "Head atlas", ncols: int = 4) -> Figure:
    """Every head type of ``table`` in a grid of ``ncols`` columns (page width): the paper figure of
    the atlas; model names on the first column, depth from 0 (first layer) to 1 (last)."""
    labels, types = model_labels(table), table_types(table)
    ncols = min(ncols, len(types))
    nrows = -(-len(types) // ncols)
    fig = _figure(PAGE_WIDTH, OVERVIEW_FRAME_IN + nrows * (OVERVIEW_PANEL_IN + OVERVIEW_ROW_IN * len(labels)))
    axes = np.atleast_2d(fig.subplots(nrows, ncols, sharey=True, squeeze=False))
    scales = []
    for i, ax in enumerate(axes.flat):
        if i >= len(types):
            ax.set_axis_off()
            continue
        scales.append(_depth_panel(ax, table, types[i], labels, show_labels=i % ncols == 0))
        ax.set_xlabel("")
    fig.legend(
        handles=_legend_handles()[:4] + _size_key(scales),
        loc="outside lower center",
        ncol=2,
        frameon=False,
        fontsize=6,
        title=_legend_handles()[4].get_label(),
        title_fontsize=6,
    )
    fig.suptitle(title)
    return fig


@_styled
def over_training_plot(table: pd.DataFrame, title: str) -> Figure:
    """One model's checkpoints (``step`` column) in training order: per head type, the highest
    score of any head at each step; a filled marker where the scan confirmed the type (its tested
    :data:`VERDICT_KIND` ablation of the top-k heads), hollow where it did not, a cross where it
    gave no verdict."""
    from matplotlib.lines import Line2D

    t = table.dropna(subset=["step"]).copy()
    t["step"] = t["step"].astype(int)
    types = table_types(t)
    fig = _figure(COLUMN_WIDTH, 3.0)
    ax = fig.subplots()
    colors = ["#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000"]
    for ht, color in zip(types, colors * 3):
        col = _rank_column(ht)
        if col not in t:
            continue
        steps = sorted(t["step"].unique())
        best = [t.loc[t["step"] == s, col].max() for s in steps]
        verdict = [
            next(iter(v[v.fillna("") != ""]), "") for v in (t.loc[t["step"] == s, f"{ht}_verdict"] for s in steps)
        ]
        ax.plot(steps, best, color=color, lw=1, label=ht.replace("_", "-"))
        for s, b, v in zip(steps, best, verdict):
            if v == LABELS[True]:
                ax.scatter([s], [b], color=color, s=14, zorder=3)
            elif v == LABELS[False]:
                ax.scatter([s], [b], facecolors="white", edgecolors=color, s=14, zorder=3)
            elif v == LABELS[None]:
                ax.scatter([s], [b], color=color, marker="x", s=14, zorder=3)
    ax.set_xlabel("training step")
    ax.set_ylabel("highest score of any head")
    ax.set_title(title)
    handles, _ = ax.get_legend_handles_labels()
    handles += [
        Line2D([], [], marker="o", ls="", color="k", label=LABELS[True]),  # "CONFIRMED", as every figure
        Line2D([], [], marker="o", ls="", markerfacecolor="white", markeredgecolor="k", label=LABELS[False]),
    ]
    verdicts = t[[f"{ht}_verdict" for ht in types if f"{ht}_verdict" in t]].to_numpy().ravel()
    if LABELS[None] in set(verdicts):  # the crosses drawn above
        handles.append(Line2D([], [], marker="x", ls="", color="k", label=LABELS[None]))
    fig.legend(handles=handles, fontsize=5.5, frameon=False, loc="outside lower center", ncol=3)
    return fig
