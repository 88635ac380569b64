"""Paper-ready figures. Pure functions: arrays in, a matplotlib ``Figure`` out; they know nothing
of models. :func:`save_figure` writes PNG, PDF and SVG atomically.

Sizes follow a paper's single column (:data:`COLUMN_WIDTH`, 3.25 in) unless a figure is meant to
span two (:data:`PAGE_WIDTH`, 6.75 in), the text widths of the common two-column templates.
Colour maps are colourblind-safe: ``viridis``/``cividis`` for sequential scores, ``RdBu_r``
centred at 0 for signed ones. Which of the two a quantity gets follows from its definition (a loss
change is signed, Michel et al.'s importance ``E|dL/dxi_h|`` is not), never from the values drawn.
"""

from __future__ import annotations

import contextlib
import functools
import re
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from headprobe.analyses.verdicts import (
    NOT_RUN,
    NOT_TESTED,
    UNITS,
    VerdictRule,
    decided,
    evidence_text,
    own_pool_text,
    p_text,
    stopped_early,
)
from headprobe.analyses.verdicts import label as verdict_label
from headprobe.analyses.vocabulary import FIGURE_FORMATS, figure_formats
from headprobe.probe.core.heads import format_head
from headprobe.probe.core.io import atomic_path

if TYPE_CHECKING:  # matplotlib is imported where a figure is drawn: a command run without figures never loads it
    from matplotlib.figure import Figure
    from matplotlib.typing import RcKeyType

COLUMN_WIDTH = 3.25  # inches: one column of a two-column paper
SAVE_DPI = 300
"""The PNG's resolution (:func:`save_figure`), at which :func:`_wrap_titles` measures the titles."""
PAGE_WIDTH = 6.75  # inches: both columns

_RC = {
    "font.size": 7,
    "axes.titlesize": 7.5,
    "axes.labelsize": 7,
    "xtick.labelsize": 6,
    "ytick.labelsize": 6,
    "text.parse_math": False,
}
"""``text.parse_math`` off: no figure here uses mathtext but a fixed formula (:func:`_mathtext`), and every label may carry data (tokens, prompts,
model names), where two ``$`` would be parsed as mathtext (:func:`literal_text`)."""


SEQUENTIAL_CMAP = "viridis"
"""The colour map of a non-negative quantity (a share, an importance), its scale starting at 0."""
DIVERGING_CMAP = "RdBu_r"
"""The colour map of a signed quantity (a loss change), its scale centred at 0 with symmetric limits."""


NOT_MEASURED_COLOR = "#bdbdbd"
"""Heatmap cells of heads without a value (NaN), outside every colour scale used here; they are
also hatched (:data:`NOT_MEASURED_HATCH`), so they stay distinct in greyscale print."""
NOT_MEASURED_HATCH = "////"


_SAVE_RC: dict[RcKeyType, Any] = {
    "pdf.fonttype": 42,
    "ps.fonttype": 42,
    "svg.hashsalt": "headprobe",
    "text.parse_math": False,
}
"""TrueType fonts in PDF/PS (matplotlib's default embeds Type 3 fonts, which camera-ready checks
reject); a fixed salt for the ids in SVG files, so the same figure gives the same bytes; no
mathtext in the tick labels made while saving (:func:`literal_text`)."""


def literal_text(fig: Figure) -> Figure:
    """Draw every text of ``fig`` as written: matplotlib parses a text with two ``$`` as mathtext
    (``$$x^2$$`` raises a ParseException, ``$x$`` becomes an italic x), and tokens, prompts and model
    names reach titles, tick labels, annotations and legends. Mathtext is switched off for the whole
    figure (``Text.set_parse_math(False)``) rather than escaped label by label: a text added by a
    caller after the figure function is covered too. The one exception is a fixed formula written
    here and marked by :func:`_mathtext`, never data. Called on every figure function's result
    (:func:`_styled`) and again before saving (:func:`save_figure`), whose ``rc_context`` covers the
    tick labels matplotlib makes while drawing."""
    from matplotlib.text import Text

    for text in fig.findobj(Text):
        text.set_parse_math(bool(getattr(text, _MATHTEXT, False)))
    return fig


_MATHTEXT = "_headprobe_mathtext"


def _mathtext(text):
    """``text`` (a matplotlib ``Text`` whose string is a fixed formula of this module, no data) typeset
    as mathtext (``$...$``, matplotlib's own TeX subset: no LaTeX install), which :func:`literal_text`
    leaves parsed."""
    setattr(text, _MATHTEXT, True)
    text.set_parse_math(True)
    return text


FORMATS = FIGURE_FORMATS
"""What :func:`save_figure` writes: a PNG (300 dpi) to look at, a PDF and an SVG for the paper
(unless ``$HEADPROBE_FIGURE_FORMATS`` names fewer: :func:`~headprobe.analyses.vocabulary.figure_formats`)."""


def _styled(draw):
    """Run a figure function with this module's style (:data:`_RC`) in a ``matplotlib.rc_context``,
    so that importing or calling it never changes the caller's global matplotlib settings; then
    let every axes title and the suptitle of the returned figure wrap (:func:`_wrap_titles`) and every colour
    bar's label fit its heatmap's height (:func:`_fit_colorbar_labels`)."""

    @functools.wraps(draw)
    def styled(*args, **kwargs):
        import matplotlib

        global _STYLED_DEPTH
        with matplotlib.rc_context(_RC):
            _STYLED_DEPTH += 1
            try:
                fig = literal_text(draw(*args, **kwargs))
            finally:
                _STYLED_DEPTH -= 1
            # one figure function drawing into another's axes (patching_heatmap's head_heatmap): the outer
            # one lays out the finished figure; a layout of the unfinished one could collapse its axes
            return fig if _STYLED_DEPTH else _wrap_titles(fig)

    return styled


_STYLED_DEPTH = 0
"""How many :func:`_styled` figure functions are drawing now (nested when one draws into another's axes)."""


def _agg_canvas(fig: Figure):
    """``fig``'s Agg canvas (a new one where it has another), whose renderer measures text and axes
    after ``fig.draw_without_rendering()``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    return fig.canvas if isinstance(fig.canvas, FigureCanvasAgg) else FigureCanvasAgg(fig)


def _wrap_titles(fig: Figure) -> Figure:
    """A safety net: a title too wide for the room it has breaks into lines (at spaces), so the
    layout made when the figure is saved has room for every line (matplotlib's own
    ``Text.set_wrap`` wraps only at draw time, after the layout, and pushed the first line of a
    three-line title off the top). The figure is laid out once to measure (``draw_without_rendering``:
    the layout and text positions of a draw, no pixels): a title's room is twice the distance from
    its centre to the nearer figure edge. The same layout measures the colour bars' labels
    (:func:`_fit_colorbar_labels`): a figure where everything fits is laid out no more often than before
    (each layout pass moves things by a fraction of a pixel). Measured at :data:`SAVE_DPI`, the PNG's
    resolution: hinted glyph widths do not scale with the resolution, and a title that fitted the figure
    at its own 100 dpi ran past the PNG's edge."""
    texts = [t for ax in fig.axes for t in (ax.title, ax._left_title, ax._right_title) if t.get_text()]  # type: ignore[attr-defined]  # private, not in matplotlib's stubs
    texts += [fig._suptitle] if fig._suptitle is not None and fig._suptitle.get_text() else []  # type: ignore[attr-defined]  # private, as above
    every = list(fig.axes) + [inset for ax in fig.axes for inset in ax.child_axes]  # a full-height bar is an inset
    bars = [ax for ax in every if getattr(ax, "_colorbar", None) is not None and ax.get_ylabel()]
    if not texts and not bars:
        return fig
    with _at_save_dpi(fig) as canvas:  # a title 6 px inside at 100 dpi ran 8 px past at 300
        for _ in range(3):  # again after wrapping: the new layout can move a title that fitted
            fig.draw_without_rendering()  # the constrained layout places axes and titles; nothing is rasterised
            renderer = canvas.get_renderer()
            wrapped = _wrap_to_room(texts, renderer, fig.bbox.width)
            wrapped = _separate_titles(fig, renderer) or wrapped
            if not (_fit_colorbar_labels(fig, bars, renderer) or wrapped):
                break  # every title and label fits this layout: no further pass (most figures need only the one)
    return fig


@contextlib.contextmanager
def _at_save_dpi(fig: Figure) -> Iterator[Any]:
    """``fig`` at :data:`SAVE_DPI`, the PNG's resolution, while a layout is measured (hinted glyph widths
    do not scale with the resolution); yields its Agg canvas (``get_renderer()`` after a draw) and
    restores the figure's own dpi after."""
    canvas, dpi = _agg_canvas(fig), fig.get_dpi()
    fig.set_dpi(SAVE_DPI)
    try:
        yield canvas
    finally:
        fig.set_dpi(dpi)


def _fit_colorbar_labels(fig: Figure, bars, renderer) -> bool:
    """A safety net (:func:`_wrap_titles` calls it on each layout): a vertical colour bar's label (``bars``: colour
    bar axes) taller than its heatmap (the axes of its image; a short figure of a model of 1 to 4 layers) breaks at
    spaces, each line of it apart, a parenthesised unit kept whole where it fits a line, at the widest lines that make
    it no taller than that and inside the figure: a label run off the figure's edge, or over the titles above the bar,
    no more. Labels that fit are left as they are. True when one was broken (the layout then changes)."""
    changed = False
    for ax in bars:
        label = ax.yaxis.label
        box = label.get_window_extent(renderer)
        heatmap = getattr(ax._colorbar.mappable, "axes", None) or ax  # private
        room = min(
            max(heatmap.get_window_extent(renderer).height, ax.get_window_extent(renderer).height),
            fig.bbox.height * 0.95,
        )
        if box.height <= room and box.y0 >= 0 and box.y1 <= fig.bbox.height:
            continue
        # broken from the label as given, not from an earlier pass's lines ("attention on\neach\ntype's ...")
        lines = _LABEL_AS_GIVEN.setdefault(label, label.get_text()).split("\n")
        for chars in range(max(len(line) for line in lines) - 1, 7, -1):  # the widest lines that fit, measured
            label.set_text("\n".join(p for line in lines for p in _wrap_keeping_parentheses(line, chars, False)))
            if label.get_window_extent(renderer).height <= room:
                break
        changed = label.get_text() != "\n".join(lines) or changed
    return changed


_LABEL_AS_GIVEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Each colour-bar label :func:`_fit_colorbar_labels` broke, as its figure function gave it: a later
layout pass breaks that again, not the lines of the pass before."""


def _separate_titles(fig: Figure, renderer, gap_px: float = 6.0, smallest: float = 5.0) -> bool:
    """A safety net (:func:`_wrap_titles` calls it on each layout): an axes title beside other titled axes
    in the same row may reach at most half way into the gap to the nearer of them, ``gap_px`` short of it
    ("previous-tokenduplicate-token" over two encoder panels ran together); one wider is broken at spaces
    to that room and, where a word is still wider (no spaces: "previous-token"), set in a smaller font
    (down to ``smallest`` points) until it fits. True when one changed (the layout then changes)."""
    titled = [ax for ax in fig.axes if ax.title.get_text()]
    frames = {ax: ax.get_window_extent(renderer) for ax in titled}
    changed = False
    for ax in titled:
        me = frames[ax]
        row = [frames[o] for o in titled if o is not ax and frames[o].y0 < me.y1 and me.y0 < frames[o].y1]
        gaps = [me.x0 - f.x1 for f in row if f.x1 <= me.x0] + [f.x0 - me.x1 for f in row if f.x0 >= me.x1]
        if not gaps:
            continue
        room = me.width + 2 * max(min(gaps) / 2 - gap_px / 2, 0.0)
        title = ax.title
        width = title.get_window_extent(renderer).width
        if width <= room:
            continue
        lines = title.get_text().split("\n")
        chars = max(4, int(max(len(line) for line in lines) * room / width))
        title.set_text("\n".join(p for line in lines for p in _wrap_keeping_parentheses(line, chars, False)))
        width = title.get_window_extent(renderer).width
        if width > room:
            title.set_fontsize(max(smallest, title.get_fontsize() * room / width * 0.97))
        changed = True
    return changed


def _wrap_to_room(texts, renderer, width: float) -> bool:
    """Break each of ``texts`` that reaches past the figure's edges at spaces (see :func:`_wrap_titles`);
    True when one was broken (the layout then changes)."""

    changed = False
    for text in texts:
        box = text.get_window_extent(renderer)
        if box.x0 >= 0 and box.x1 <= width:
            continue
        changed = True
        centre = (box.x0 + box.x1) / 2
        room = 2 * min(max(centre, 1.0), max(width - centre, 1.0)) * 0.85  # slack: the next layout moves it
        lines: list[str] = []
        for line in text.get_text().split("\n"):
            text.set_text(line)
            w = text.get_window_extent(renderer).width
            chars = max(12, int(len(line) * room / w))
            lines += [line] if w <= room else _wrap_keeping_parentheses(line, chars)
        text.set_text("\n".join(lines))
    return changed


def _wrap_keeping_parentheses(text: str, width: int, break_words: bool = True) -> list[str]:
    """``text`` broken at spaces into lines of at most ``width`` characters (``textwrap.wrap``; a
    word longer than a line broken only with ``break_words``; never at a hyphen: "first-token" is one term), a
    parenthesis that fits a line kept whole: "(sink 4,\nwindow 64)" read as two thoughts."""
    import re
    import textwrap

    kept = re.sub(
        r"\([^()]*\)", lambda m: m.group(0).replace(" ", "\0") if len(m.group(0)) <= width else m.group(0), text
    )
    return [
        part.replace("\0", " ")
        for part in textwrap.wrap(kept, width, break_long_words=break_words, break_on_hyphens=False)
    ]


def _figure(width: float, height: float) -> Figure:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def _fit_ylabels(fig: Figure, axes) -> None:
    """Break each of ``axes``' y labels at spaces (a parenthesised unit kept whole where it fits a line) until it is no
    taller than its axes, so the labels of panels stacked one above the other never meet. The
    figure is laid out to measure (``draw_without_rendering``), again after a label was broken."""
    canvas = _agg_canvas(fig)
    for _ in range(3):
        fig.draw_without_rendering()
        renderer, changed = canvas.get_renderer(), False
        for ax in axes:
            label = ax.yaxis.label
            room, tall = ax.get_window_extent(renderer).height, label.get_window_extent(renderer).height
            if tall <= room:
                continue
            longest = max(len(line) for line in label.get_text().split("\n"))  # the height of the rotated label
            flat, width = label.get_text().replace("\n", " "), max(8, int(longest * room / tall * 0.9))
            # never a break inside a word
            parts = _wrap_keeping_parentheses(flat, width, break_words=False)
            label.set_text("\n".join(parts))
            changed = True
        if not changed:
            return


def _head_step(n_heads: int, width_in: float) -> int:
    """Label every ``step``-th head so that the labels (``xtick.labelsize``, about 0.6 em a digit,
    4 pt apart) fit into an axes ``width_in`` inches wide: the smallest of 1, 2, 3, 4, 5, 6, 8,
    10, 12, 16, ... that does."""
    return _label_step(n_heads, len(str(n_heads - 1)), width_in)


def _label_step(n: int, chars: int, width_in: float) -> int:
    """:func:`_head_step` for ``n`` tick labels of up to ``chars`` characters (e.g. token positions, "−12")."""
    per_label = chars * 0.6 * _RC["xtick.labelsize"] + 4.0  # points
    fit = max(int(width_in * 72 / per_label), 1)
    need = -(-n // fit)
    nice = [1, 2, 3, 4, 5, 6, 8, 10, 12]
    while nice[-1] < need:
        nice += [2 * s for s in nice[-3:]]  # 16, 20, 24, 32, 40, 48, ...
    return next(s for s in nice if s >= need)


def _head_axes(ax, n_layers: int, n_heads: int, group_size: int | None, width_in: float | None = None) -> None:
    """Label a layer x head heatmap's axes; ``width_in``: the axes' width in inches (default: its
    position before layout), which sets how many head ticks fit (:func:`_head_step`). With
    ``group_size`` query heads per key/value head (GQA, MQA), white lines part the groups and the
    axis label says so, for a figure that travels without its caption."""
    _head_groups(ax, n_heads, group_size)
    ax.set_ylabel("layer")
    if width_in is None:
        width_in = ax.get_position().width * ax.figure.get_figwidth() * 0.8  # the colour bar takes some later
    ax.set_xticks(range(0, n_heads, _head_step(n_heads, width_in)))
    step = 1 if n_layers <= 16 else 2
    ax.set_yticks(range(0, n_layers, step))


def _head_groups(ax, n_heads: int, group_size: int | None) -> None:
    """The head axis' label, "head (3 per KV head)" with white lines between the key/value groups where
    ``group_size`` query heads share one (GQA, MQA), else "head": every layer x head heatmap's."""
    grouped = bool(group_size and 1 < group_size < n_heads)
    ax.set_xlabel(f"head ({group_size} per KV head)" if grouped else "head")
    if grouped:
        assert group_size is not None  # grouped says so
        for g in range(group_size, n_heads, group_size):
            ax.axvline(g - 0.5, color="white", lw=0.8)


IN_CONTEXT_LOSS_LABEL = "in-context loss (late − early, nats)"
"""The y label of the in-context loss (Olsson et al. 2022: the loss late in a context minus early in it,
negative where the context helps) in training.png and loss_vs_heads.png: "in-context loss (nats)"
left a negative loss unexplained in loss_vs_heads.png, which has no legend entry saying "late − early"."""

CATEGORY_COLORS = ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#56B4E9", "#CC79A7", "#F0E442", "#000000")
"""Okabe and Ito's eight colours, distinguishable with every common colour-vision deficiency
(Okabe & Ito 2008, "Color Universal Design"; Wong 2011, Nature Methods 8:441), for integer
categories such as offsets (:func:`head_heatmap` with ``discrete``): neighbouring integers get
unlike hues, where a sequential map made 0 and -1 look alike."""

MASK_HATCH_COLOR = "#888888"
"""The hatch over masked cells where :func:`head_heatmap` is asked for one (``mask_hatch``)."""
MASKED_COLOR = "#dddddd"
"""Heatmap cells masked by a rule (:func:`head_heatmap`'s ``mask``, e.g. the offset of a head that is
not positional): a plain pale grey, unlike the hatched grey of unmeasured heads and every colour
of the maps used here (Tol's colour for data to be left out)."""


REMOVED_LABEL = "removed (pruned checkpoint)"
"""The legend entry of the heads a pruned checkpoint no longer has, drawn pale grey
(:data:`MASKED_COLOR`) under :data:`REMOVED_HATCH` in every figure that shows them."""
REMOVED_HATCH = "xxxx"


def removed_cells(n_layers: int, n_heads: int, heads: Sequence[tuple[int, int]]) -> np.ndarray:
    """``[layer, head]`` booleans, True at ``heads`` (``(layer, head)``; a pruned checkpoint's
    ``spec.removed_heads``): the ``removed`` argument of every heatmap that shows them."""
    gone = np.zeros((n_layers, n_heads), dtype=bool)
    for head in heads:
        gone[head] = True
    return gone


def _removed_style() -> dict[str, Any]:
    """The removed heads' look, as ``Patch`` keywords: pale grey under :data:`REMOVED_HATCH`, the
    legend key of every figure that draws them (:func:`_draw_removed` draws the cells alike)."""
    return {"facecolor": MASKED_COLOR, "edgecolor": MASK_HATCH_COLOR, "hatch": REMOVED_HATCH, "lw": 0}


def _draw_removed(ax, gone: np.ndarray) -> None:
    """Draw the ``gone`` cells (``[layer, head]`` bool: heads a pruned checkpoint no longer has) of
    ``ax``'s layer x head heatmap as removed, whatever is under them: opaque pale grey
    (:data:`MASKED_COLOR`) under :data:`REMOVED_HATCH`. The one way :func:`head_heatmap` (each
    ``heatmap_<column>``, the ablation panels) and :func:`scores_overview` draw them."""
    _grey_cells(ax, gone)
    _hatch_cells(ax, gone, REMOVED_HATCH)


def _category_colors(values: Sequence[int]) -> list[str]:
    """A colour of :data:`CATEGORY_COLORS` per integer in ``values``, given out by distance from 0
    (ties: the negative first): 0 is always blue and -1 orange, the commonest offsets.

    Raises:
        ValueError: more integers than colours.
    """
    if len(values) > len(CATEGORY_COLORS):
        raise ValueError(f"{len(values)} categories, more than the {len(CATEGORY_COLORS)} distinguishable colours")
    order = sorted(values, key=lambda v: (abs(v), v > 0))
    return [CATEGORY_COLORS[order.index(v)] for v in values]


def _category_label(v: int, first: bool, last: bool, extend: str) -> str:
    """A discrete colour bar's tick label: ``−1``, ``+2``, ``0``; ``≤ −7`` / ``≥ +3`` at a clipped end."""
    text = "0" if v == 0 else f"{v:+d}".replace("-", "\u2212")
    if first and extend in ("min", "both"):
        return f"\u2264 {text}"
    if last and extend in ("max", "both"):
        return f"\u2265 {text}"
    return text


def _integer_levels(vmin: float | None, vmax: float | None) -> list[int]:
    """The integers ``vmin .. vmax`` of a discrete heatmap (which takes both)."""
    assert vmin is not None and vmax is not None
    return list(range(int(vmin), int(vmax) + 1))


@_styled
def head_heatmap(
    scores: np.ndarray,
    title: str,
    cbar_label: str = "score",
    cmap: str = "viridis",
    vmin: float | None = 0.0,
    vmax: float | None = 1.0,
    group_size: int | None = None,
    ax=None,
    extend: str = "neither",
    discrete: bool = False,
    mask: np.ndarray | None = None,
    mask_label: str = "masked",
    mask_hatch: str | None = None,
    removed: np.ndarray | None = None,
    cbar_full_height: bool | tuple[float, float, float, float] = False,
    cbar_math: bool = False,
) -> Figure:
    """A layer x head heatmap of ``scores`` (``[layer, head]``); white lines separate GQA groups.

    Pass ``ax`` to draw into an existing axes (the figure is then ``ax.figure``); ``extend``
    marks clipped values on the colour bar (``"min"``, ``"max"``, ``"both"``). NaN cells (heads
    not measured) are hatched grey (:data:`NOT_MEASURED_COLOR`) and named in a legend.

    Args:
        discrete: ``scores`` are integers, each from ``vmin`` to ``vmax`` (integers) its own
            category: one colour of :data:`CATEGORY_COLORS` each (``cmap`` is not used), a colour
            bar tick and label per integer; values beyond an end are drawn in the end's colour,
            whose label reads ``≤ vmin`` / ``≥ vmax`` as ``extend`` says.
        mask: ``[layer, head]`` booleans: cells drawn plain pale grey (:data:`MASKED_COLOR`) instead
            of their value, named ``mask_label`` in the legend (e.g. the rule that masks them).
        mask_hatch: a matplotlib hatch drawn in grey over the ``mask`` cells and their legend key
            (distinct from a value near white in greyscale print too); None: plain.
        removed: ``[layer, head]`` True for the heads a pruned checkpoint no longer has
            (:func:`removed_cells`): drawn as :func:`scores_overview` draws them, whatever their
            value (NaN, or the 0 of a head with zero weights), :data:`REMOVED_LABEL` in the legend,
            never "not measured" (:func:`_draw_removed`).
        cbar_full_height: the colour bar exactly as tall as the heatmap (an inset axes; its label must fit that
            height, or the layout collapses); False: matplotlib's, 0.9 of the axes' slot and at most 20 times
            its width (shorter than a tall, narrow heatmap); a tuple: that inset's bounds in axes fractions.
        cbar_math: ``cbar_label`` is a fixed formula of this package (``$...$``, no data), typeset as
            mathtext (:func:`_mathtext`); False: drawn as written (:func:`literal_text`).

    Raises:
        ValueError: ``discrete`` with more than :data:`CATEGORY_COLORS` integers in ``[vmin, vmax]``.
    """
    scores = np.asarray(scores, dtype=float)
    n_layers, n_heads = scores.shape
    if ax is None:
        fig = _figure(COLUMN_WIDTH, min(max(2.8, 1.2 + 0.16 * n_layers), 8.0))  # room for the colour bar's label
        ax = fig.add_subplot()
    else:
        fig = ax.figure
    # NaN: a head not measured (e.g. not swept) is left transparent over a hatched grey background,
    # on no colour scale used here, and a legend entry says what it means
    gone = np.zeros(scores.shape, dtype=bool) if removed is None else np.asarray(removed, dtype=bool)
    scores = np.where(gone, np.nan, scores)  # drawn as removed below, on no colour scale
    missing = (np.isnan(scores) & ~gone).any()
    masked = np.zeros(scores.shape, dtype=bool) if mask is None else np.asarray(mask, dtype=bool) & ~np.isnan(scores)
    if missing:
        ax.patch.set(facecolor=NOT_MEASURED_COLOR, hatch=NOT_MEASURED_HATCH, edgecolor="white", linewidth=0)
    im, levels = _heat_cells(ax, scores, masked, cmap, vmin, vmax, discrete)
    if mask_hatch:
        _hatch_cells(ax, masked, mask_hatch)
    _draw_removed(ax, gone)
    _head_axes(ax, n_layers, n_heads, group_size)
    if len(title) > 56 and ", " in title and "\n" not in title:  # "<what>, <model>" on two lines when long
        title = ",\n".join(title.split(", ", 1))
    ax.set_title(title)  # anything still too wide is broken by _wrap_titles
    _heat_colorbar(ax, im, levels, extend, cbar_label, cbar_full_height, cbar_math)
    if missing or masked.any() or gone.any():
        _heat_legend(ax, bool(masked.any()), bool(missing), mask_label, n_layers, mask_hatch, bool(gone.any()))
    return fig


def _heat_colorbar(ax, im, levels, extend: str, label: str, full_height: bool | tuple, math: bool) -> None:
    """:func:`head_heatmap`'s colour bar of ``im`` beside ``ax``: a tick and label per category ``levels``
    (or a scale, None), ``extend`` as there, ``label`` (typeset with ``math``: :func:`_mathtext`); with
    ``full_height`` an inset axes spanning the heatmap, which the constrained layout keeps clear of its
    neighbours."""
    fig = ax.figure
    inset = full_height if isinstance(full_height, tuple) else (1.04, 0.0, 0.06, 1.0)
    where = {"cax": ax.inset_axes(inset)} if full_height else {"ax": ax, "shrink": 0.9, "pad": 0.02}
    if levels is not None:
        cb = fig.colorbar(im, **where, ticks=levels)
        cb.set_ticklabels([_category_label(v, i == 0, i == len(levels) - 1, extend) for i, v in enumerate(levels)])
        cb.ax.tick_params(length=0)  # a label per colour block, no scale between them
    else:
        cb = fig.colorbar(im, **where, extend=extend)
    cb.set_label(label)
    if math:
        _mathtext(cb.ax.yaxis.label)


def _heat_cells(ax, scores: np.ndarray, masked: np.ndarray, cmap: str, vmin, vmax, discrete: bool):
    """Draw :func:`head_heatmap`'s cells into ``ax``: ``scores`` but the ``masked`` cells (NaN cells
    transparent), then the masked ones in plain pale grey on top. Returns ``(image, levels)``: the
    values' image, for the colour bar, and for ``discrete`` the integer levels (None otherwise)."""
    import matplotlib
    from matplotlib.colors import BoundaryNorm, ListedColormap

    shown = np.where(masked, np.nan, scores)
    levels = None
    if discrete:
        levels = _integer_levels(vmin, vmax)
        colors = ListedColormap(_category_colors(levels)).with_extremes(bad=(0, 0, 0, 0))
        norm = BoundaryNorm(np.arange(levels[0] - 0.5, levels[-1] + 1.0), len(levels))
        im = ax.imshow(
            np.clip(shown, levels[0], levels[-1]), cmap=colors, norm=norm, aspect="auto", interpolation="nearest"
        )
    else:
        colors = matplotlib.colormaps[cmap].with_extremes(bad=(0, 0, 0, 0))
        im = ax.imshow(shown, cmap=colors, vmin=vmin, vmax=vmax, aspect="auto", interpolation="nearest")
    _grey_cells(ax, masked)
    return im, levels


def _grey_cells(ax, masked: np.ndarray) -> None:
    """A second, opaque image over ``ax``'s heatmap: the ``masked`` cells (``[layer, head]`` bool) in
    plain pale grey (:data:`MASKED_COLOR`), every other cell transparent; nothing where none is masked."""
    from matplotlib.colors import ListedColormap

    if masked.any():
        ax.imshow(
            np.where(masked, 1.0, np.nan),
            cmap=ListedColormap([MASKED_COLOR]).with_extremes(bad=(0, 0, 0, 0)),
            vmin=0,
            vmax=1,
            aspect="auto",
            interpolation="nearest",
        )


def _hatch_cells(ax, masked: np.ndarray, hatch: str) -> None:
    """``hatch`` in grey (:data:`MASK_HATCH_COLOR`) over the ``masked`` cells of ``ax``'s heatmap
    (``[layer, head]`` bool): an unfilled ``Rectangle`` each, so they stay apart in greyscale print."""
    from matplotlib.patches import Rectangle

    for layer, head in np.argwhere(masked):
        ax.add_patch(Rectangle((head - 0.5, layer - 0.5), 1, 1, fill=False, hatch=hatch, ec=MASK_HATCH_COLOR, lw=0))


def _heat_legend(
    ax,
    masked: bool,
    missing: bool,
    mask_label: str,
    n_layers: int,
    mask_hatch: str | None = None,
    removed: bool = False,
) -> None:
    """:func:`head_heatmap`'s legend below ``ax``: what the pale grey (``masked`` cells, named
    ``mask_label``, hatched with ``mask_hatch``), the removed heads (``removed``, keyed as in
    :func:`scores_overview`: :func:`_removed_style`) and the hatched grey (``missing``: heads not
    measured) cells mean."""
    from matplotlib.patches import Patch

    plain = {"edgecolor": "none"} if not mask_hatch else {"edgecolor": MASK_HATCH_COLOR, "hatch": mask_hatch, "lw": 0}
    keys = [Patch(facecolor=MASKED_COLOR, label=mask_label, **plain)] if masked else []
    keys += [Patch(label=REMOVED_LABEL, **_removed_style())] if removed else []
    keys += [Patch(label="not measured", **_not_measured_style())] if missing else []
    ax.legend(
        handles=keys,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.12 if n_layers > 16 else -0.2),
        frameon=False,
        fontsize=6,
        handlelength=1.2,
    )


OVERVIEW_SCORE_LABEL = "score in [0, 1]: attention on each type's target keys"
"""The overview's colour bar: one bar for several scores, each a share of attention (docs/scan.md)."""


def overview_score_label(units: Sequence[tuple[str, str]]) -> str:
    """The overview's colour-bar label: :data:`OVERVIEW_SCORE_LABEL`, and on a second line each
    panel whose score is another share (``units``: ``(panel title, what it is a share of)``, e.g.
    ``("positional", "share of queries at one offset")``; a head type's
    :attr:`~headprobe.analyses.columns.HeadColumn.overview_unit`)."""
    return OVERVIEW_SCORE_LABEL + (f"\n({'; '.join(f'{t}: {u}' for t, u in units)})" if units else "")


OVERVIEW_MARK_WIDTH, OVERVIEW_MARK_HALO, OVERVIEW_MARK_INSET = 0.8, 2.0, 0.06
"""How :func:`scores_overview` outlines a marked cell: a black line (``OVERVIEW_MARK_WIDTH`` points)
on a white halo (``OVERVIEW_MARK_HALO`` points wide), so it stands out by lightness alone on every
colour of ``viridis``, from its dark purple to its yellow, in every colour-vision deficiency and in
greyscale print; drawn ``OVERVIEW_MARK_INSET`` of a cell inside it, so marked neighbours stay
separate boxes. Both widths shrink in proportion on cells narrower than
:data:`OVERVIEW_MARK_CELL` points, so that the cell's colour still shows inside, to half at most
(on a model of many small cells the outline still shows, over its cell)."""
OVERVIEW_MARK_CELL = 7.0
"""The cell size (points) from which :func:`scores_overview` draws its outline at full width."""


def _mark_style(scale: float = 1.0) -> dict[str, Any]:
    """The keywords of a matplotlib patch drawn as :func:`scores_overview`'s outline (the cells' and
    the legend's), both widths times ``scale``."""
    from matplotlib import patheffects

    return {
        "fill": False,
        "edgecolor": "black",
        "linewidth": OVERVIEW_MARK_WIDTH * scale,
        "path_effects": [
            patheffects.withStroke(linewidth=OVERVIEW_MARK_HALO * scale, foreground="white"),
            patheffects.Normal(),
        ],
    }


def overview_mark_label(k: int, rule: VerdictRule | None, control: str | None = None) -> str:
    """The overview's legend entry for its outlined cells: each type's ``k`` heads ablated in the
    verification against random sets (``control``: their design, e.g. ``layer-matched``), where each
    panel's verdict is written and, with ``rule``, what CONFIRMED needs
    (:meth:`~headprobe.analyses.verdicts.VerdictRule.condition`)."""
    import textwrap

    what = (
        f"outlined: each type's top-{k} heads, ablated against {control + ' ' if control else ''}random control "
        f"sets of {k} heads; under the type's name its verdict ({', '.join(verdict_label(c) for c in (True, False, None))})"
    )
    text = what + (f". CONFIRMED: {rule.condition()}" if rule is not None else "")
    return textwrap.fill(text, 135, break_on_hyphens=False)  # "Benjamini-Hochberg" stays whole


def _outline_cells(ax, heads: Sequence[tuple[int, int]], scale: float) -> None:
    """Outline ``heads`` (``(layer, head)``) of a layer x head heatmap in ``ax`` (:data:`OVERVIEW_MARK_WIDTH`,
    widths times ``scale``): one unfilled ``Rectangle`` each, centred on the cell's ``(head, layer)``."""
    from matplotlib.patches import Rectangle

    side = 1 - 2 * OVERVIEW_MARK_INSET
    for layer, head in heads:
        ax.add_patch(Rectangle((head - side / 2, layer - side / 2), side, side, zorder=3, **_mark_style(scale)))


@_styled
def scores_overview(
    panels: Sequence[tuple[str, np.ndarray]],
    group_size: int | None,
    suptitle: str,
    marked: Sequence[Sequence[tuple[int, int]]] | None = None,
    mark_label: str = "",
    score_label: str = OVERVIEW_SCORE_LABEL,
    removed: np.ndarray | None = None,
) -> Figure:
    """Layer x head heatmaps of several scores in [0, 1] side by side (page width), one shared
    colour bar labelled ``score_label``; ``panels`` are ``(title, scores)``. ``marked``: per panel, the ``(layer, head)``
    cells to outline (:data:`OVERVIEW_MARK_WIDTH`; e.g. the heads a verification ablated), explained by
    ``mark_label`` in a legend below the panels; None: no outlines. ``removed``: ``[layer, head]``
    True for the heads a pruned checkpoint no longer has, drawn pale grey (:data:`MASKED_COLOR`) under
    :data:`REMOVED_HATCH` whatever their score, :data:`REMOVED_LABEL` in the legend; any other NaN
    score is hatched grey, "not measured" (as in :func:`head_heatmap`)."""
    n_layers, n_heads = np.asarray(panels[0][1]).shape
    gone = np.zeros((n_layers, n_heads), dtype=bool) if removed is None else np.asarray(removed, dtype=bool)
    shown = [np.where(gone, np.nan, np.asarray(scores, dtype=float)) for _, scores in panels]
    missing = any((np.isnan(v) & ~gone).any() for v in shown)
    keys = _overview_keys(marked is not None, mark_label, bool(gone.any()), missing)
    # beside the long outline label the other keys take a row each, else they share one
    rows = (mark_label.count("\n") + len(keys) - 1) if marked is not None else 0
    # a few layers still leave room for a suptitle of two or three lines (else constrained layout collapses the axes)
    height = min(max(1.3 + 0.11 * n_layers, 2.6), 6.0) + (0.1 + 0.1 * rows if keys else 0.0)
    fig = _figure(PAGE_WIDTH, height)
    axes = np.atleast_1d(fig.subplots(1, len(panels), sharey=True))
    # the panels share the page width less the y axis labels and the colour bar (about 1 inch), the
    # height less the titles, tick labels and legend (about 1.8 inches)
    width_in = (PAGE_WIDTH - 1.0) / len(panels) * 0.85
    cell = min(width_in / n_heads, max(height - 1.8, 0.5) / n_layers) * 72  # points
    import matplotlib

    cmap = matplotlib.colormaps[SEQUENTIAL_CMAP].with_extremes(bad=(0, 0, 0, 0))
    for i, (ax, (title, _), values) in enumerate(zip(axes, panels, shown)):
        if (np.isnan(values) & ~gone).any():  # shows through the transparent NaN cells
            ax.patch.set(facecolor=NOT_MEASURED_COLOR, hatch=NOT_MEASURED_HATCH, edgecolor="white", linewidth=0)
        im = ax.imshow(values, cmap=cmap, vmin=0, vmax=1, aspect="auto", interpolation="nearest")
        _draw_removed(ax, gone)
        _head_axes(ax, n_layers, n_heads, group_size, width_in=width_in)
        if i:
            ax.set_ylabel("")
        ax.set_title(title)
        if marked is not None:
            _outline_cells(ax, marked[i], min(1.0, max(cell / OVERVIEW_MARK_CELL, 0.5)))
    fig.colorbar(im, ax=list(axes), shrink=0.8, pad=0.01).set_label(score_label)
    if keys:
        _overview_legend(fig, keys, 1 if marked is not None else len(keys))
    fig.suptitle(suptitle)
    return fig


def _overview_keys(marked: bool, mark_label: str, removed: bool, missing: bool) -> list[tuple[str, dict]]:
    """:func:`scores_overview`'s legend entries, ``(label, Patch keywords)``: the outlined cells
    (``marked``, named ``mark_label``), the removed heads, the heads not measured; only those drawn."""
    keys = [(mark_label, _mark_style())] if marked else []
    if removed:
        keys.append((REMOVED_LABEL, _removed_style()))
    if missing:
        keys.append(("not measured", _not_measured_style()))
    return keys


def _not_measured_style() -> dict[str, Any]:
    """The heads not measured (NaN scores) as ``Patch`` keywords: hatched grey, every figure's key."""
    return {"facecolor": NOT_MEASURED_COLOR, "hatch": NOT_MEASURED_HATCH, "edgecolor": "white"}


def _overview_legend(fig: Figure, keys: Sequence[tuple[str, dict]], ncols: int) -> None:
    """:func:`scores_overview`'s legend below the panels: one patch a key (:func:`_overview_keys`),
    in ``ncols`` columns."""
    from matplotlib.patches import Patch

    fig.legend(
        handles=[Patch(label=label, **style) for label, style in keys],
        loc="outside lower center",
        frameon=False,
        fontsize=6,
        handlelength=1.0,
        handleheight=1.0,
        ncols=ncols,
    )


PATTERN_CMAP = "viridis"
"""The colour map of attention weights in [0, 1], in :func:`pattern_plot` and in the HTML viewer's
pattern (:mod:`headprobe.analyses.viewer`), so that a head looks the same in both; masked future
keys in :data:`NOT_MEASURED_COLOR` in both."""

MAX_TICK_LABELS = 40
"""A pattern plot labels every token up to this many positions per axis, else every n-th (still real tokens)."""


def _runs(positions: Sequence[int]) -> list[tuple[int, int]]:
    """The index ranges ``[i0, i1)`` of ``positions`` that hold consecutive positions, in order."""
    starts = [0] + [i for i in range(1, len(positions)) if positions[i] != positions[i - 1] + 1]
    return list(zip(starts, [*starts[1:], len(positions)]))


def _range_text(first: int, last: int) -> str:
    return f"{first}" if first == last else f"{first}–{last}"


def _span(positions: Sequence[int], total: int) -> str:
    """``0–27 of 101`` for a crop, ``0–3 and 96–99 of 100 (4–95 not drawn)`` for one with positions
    left out between those drawn, ``0–31`` for a whole axis (the example's own length, which a scan's
    natural-text example cuts from a longer sequence: no "of 32"): every pattern figure's axes say
    which positions they show in the same words."""
    if list(positions) == list(range(total)):
        return _range_text(0, total - 1)
    runs = _runs(positions)
    drawn = " and ".join(_range_text(positions[a], positions[b - 1]) for a, b in runs)
    gaps = [
        _range_text(positions[b - 1] + 1, positions[b] - 1)
        for (_, b), _next in zip(runs, runs[1:])
        if positions[b] > positions[b - 1] + 1
    ]
    return f"{drawn} of {total}" + (f" ({', '.join(gaps)} not drawn)" if gaps else "")


def _break_marks(axes: Sequence[Any]) -> None:
    """The broken-axis marks between side-by-side panels (matplotlib's broken axis example): the
    facing spines hidden, two short diagonal strokes at the top and bottom of each facing edge."""
    style = dict(marker=[(-0.5, -1), (0.5, 1)], markersize=6, linestyle="none", color="k", mec="k", mew=0.8)
    if len(axes) > 1:  # equal-aspect panels shrink inside their cells: pushed together, not centred apart
        axes[0].set_anchor("E")
        axes[-1].set_anchor("W")
    for left, right in zip(axes, axes[1:]):
        left.spines["right"].set_visible(False)
        right.spines["left"].set_visible(False)
        right.tick_params(left=False, labelleft=False)
        left.plot([1, 1], [0, 1], transform=left.transAxes, clip_on=False, **style)
        right.plot([0, 0], [0, 1], transform=right.transAxes, clip_on=False, **style)


def _pattern_ticks(ax, axis: Sequence[int], span: range, labels: Sequence[str], step: int, fs: float, x: bool) -> None:
    """Token labels of the positions ``axis[i]`` for the indices ``i`` of ``span`` drawn on ``ax``
    (every ``step``-th index of the whole axis)."""
    idx = [i for i in span if i % step == 0]
    names = [labels[axis[i]] if step == 1 else f"{labels[axis[i]]} ({axis[i]})" for i in idx]
    if x:
        ax.set_xticks(idx, names, fontsize=fs, rotation=90)
    else:
        ax.set_yticks(idx, names, fontsize=fs)


PATTERN_QUERY_LABEL = "query position"
"""How :func:`pattern_plot`'s query axis begins, whatever its crop (then ``, 47–74 of 101``) and sequence."""


@_styled
def pattern_plot(
    pattern: np.ndarray,
    labels: Sequence[str],
    title: str,
    marks: Sequence[int] = (),
    causal: bool = False,
    ylabel: str = PATTERN_QUERY_LABEL,
    positions: tuple[Sequence[int], Sequence[int]] | None = None,
) -> Figure:
    """One head's attention pattern ``[q_pos, k_pos]`` with token labels on both axes (every
    token, or every n-th beyond :data:`MAX_TICK_LABELS` positions); dashed lines at ``marks``
    (positions where a repeated block starts). With ``causal``, the masked future keys
    (``k_pos > q_pos``) are grey like unmeasured cells elsewhere, not the colour of zero
    attention; a note under the axis says what grey and the dashed lines mean. Keys left out
    between kept ones (a long prompt's sink and last keys) break the key axis: one panel per kept
    range, broken-axis marks between them, and the axis label names the keys not drawn.

    Args:
        pattern: ``[q, k]`` attention weights in [0, 1]: the whole pattern, or the crop that
            ``positions`` names.
        labels: one token label per position of the whole sequence.
        positions: ``(q_positions, k_positions)``, the absolute positions of ``pattern``'s rows
            and columns (e.g. :func:`headprobe.analyses.scoring.repeat_window`); each axis label
            (the axis labels say which positions are shown: ``key position, 0–27 of 101``). None: all.
        ylabel: :data:`PATTERN_QUERY_LABEL`, then what the sequence is (``query position (first
            scored sequence)``): the query axis reads ``query position, 0–31`` (a crop: ``, 47–74 of 101``) and
            that, on its own line.
    """
    import matplotlib

    pattern = np.asarray(pattern, dtype=float).copy()
    rows, cols = (
        (list(range(pattern.shape[0])), list(range(pattern.shape[1]))) if positions is None else map(list, positions)
    )
    if pattern.shape != (len(rows), len(cols)):
        raise ValueError(f"pattern {pattern.shape} does not match {len(rows)} query and {len(cols)} key positions")
    future = np.asarray(cols)[None, :] > np.asarray(rows)[:, None]
    if causal:
        pattern[future] = np.nan
    fig = _figure(COLUMN_WIDTH, COLUMN_WIDTH * 0.95)
    runs = _runs(cols)
    grid = fig.add_gridspec(1, len(runs), width_ratios=[b - a for a, b in runs])
    axes = [fig.add_subplot(grid[0, i]) for i in range(len(runs))]
    cmap = matplotlib.colormaps[PATTERN_CMAP].with_extremes(bad=NOT_MEASURED_COLOR)
    n = max(len(rows), len(cols))
    step = 1 if n <= MAX_TICK_LABELS else int(np.ceil(n / 16))  # "token (position)" labels are long: fewer
    fs = max(3.0, min(6.0, (140.0 if step == 1 else 110.0) / -(-n // step)))
    for ax, (a, b) in zip(axes, runs):  # x in index units of the whole key axis: ticks and marks as one axes
        extent = (a - 0.5, b - 0.5, len(rows) - 0.5, -0.5)
        im = ax.imshow(pattern[:, a:b], cmap=cmap, vmin=0.0, vmax=1.0, interpolation="nearest", extent=extent)
        _pattern_ticks(ax, cols, range(a, b), labels, step, fs, x=True)
        _pattern_ticks(ax, rows, range(len(rows)), labels, step, fs, x=False)
        for m in marks:  # a block starting at position m: a line before it, on each axis that shows m
            if m in cols[a:b]:
                ax.axvline(cols.index(m) - 0.5, color="white", lw=0.5, ls="--")
            if m in rows:
                ax.axhline(rows.index(m) - 0.5, color="white", lw=0.5, ls="--")
    _break_marks(axes)
    notes = (["grey: masked future keys"] if causal and future.any() else []) + (
        ["dashed: a repeated block starts"] if any(m in rows or m in cols for m in marks) else []
    )
    _pattern_labels(fig, axes, (rows, cols), len(labels), ylabel, title, step, notes)
    # a broken key axis: the colour bar leaves the panels' anchors (_break_marks) as they are
    anchor: dict[str, Any] = {"panchor": False} if len(axes) > 1 else {}
    fig.colorbar(im, ax=axes, shrink=0.8, pad=0.02, **anchor).set_label("attention weight")
    _fit_ylabels(_wrap_titles(fig), axes[:1])  # a long title leaves shorter axes: the label no taller than them
    return fig


def _pattern_labels(fig, axes, positions, total: int, ylabel: str, title: str, step: int, notes: list[str]) -> None:
    """:func:`pattern_plot`'s axis labels and title: on its axes, or across its panels where the key
    axis is broken."""
    rows, cols = positions
    xlabel = (
        f"key position, {_span(cols, total)}".replace(" (", "\n(", 1)
        + ("" if step == 1 else f"\n(every {step} positions: token (position))")
        + ("\n" + "\n".join(notes) if notes else "")
    )
    # one wording, cropped or whole: "query position, 47–74 of 101" and what follows ``ylabel``'s
    # "query position", e.g. "(first scored sequence)", on a line of its own
    what = ylabel.removeprefix(PATTERN_QUERY_LABEL).strip()
    axes[0].set_ylabel(
        f"{PATTERN_QUERY_LABEL}, {_span(rows, total)}".replace(" (", "\n(", 1) + (f"\n{what}" if what else "")
    )
    if len(axes) == 1:
        axes[0].set_xlabel(xlabel)
    else:
        fig.supxlabel(xlabel, fontsize=_RC["axes.labelsize"])
    fig.suptitle(title, fontsize=_RC["axes.titlesize"])


TASK_LABELS = {"natural": "text loss", "repeated": "repeat loss"}
"""How the ablation figure names the loss a head type is judged on (under each type's name)."""
EMBEDDING_TASK_LABELS = {"natural": "text", "repeated": "repeat"}
"""The same for an encoder's embedding metric (the text whose embedding is compared)."""
EFFECT_LABELS = {"loss": "Δ loss ({unit})", "embedding_cosine": "{unit} (embedding)"}
"""The ablation figure's y label per metric (:data:`~headprobe.analyses.verdicts.UNITS` fills in the unit)."""
EFFECT_MEANINGS = {"loss": "loss increase", "embedding_cosine": "between the clean and the ablated sentence embedding"}
"""What an effect of each metric is, in the caption's words."""


def effect_metric(rows: Sequence[dict]) -> str:
    """The metric the ablation ``rows`` measured (``loss`` for rows that name none)."""
    return (rows[0].get("metric") if rows else None) or "loss"


def rule_legend(rule: VerdictRule) -> str:
    """The ablation figure's legend entry of the verdict rule: its :meth:`~VerdictRule.condition`, wrapped."""
    return _legend_entry(f"CONFIRMED: {rule.condition()}")


def _legend_entry(text: str) -> str:
    """A text-only entry of the ablation figure's legend, wrapped at 60 characters (never at a hyphen)."""
    import textwrap

    return textwrap.fill(text, 60, break_on_hyphens=False)


@_styled
def ablation_plot(rows: Sequence[dict], title: str, rule: VerdictRule | None = None) -> Figure:
    """Each head type's top-k ablation effect beside every control set's effect, with the rule.

    ``rows`` are :class:`headprobe.analyses.ablation.Verification` dicts. One panel per ablation
    kind, the tested kind (mean) first. Per type: every control set's effect (grey dots, jittered),
    their maximum (a short black bar), the top-k effect (a blue diamond; whiskers: its 95%
    t interval over sequences) and, above, the verdict's numbers: the control sets
    ablated (n), the p-value and, for the tested kind, the adjusted p and the verdict (CONFIRMED,
    not confirmed, no verdict); the other kind says "not tested". Each type's tick says which loss it
    is judged on. Effects are in the rows' metric's unit (:data:`~headprobe.analyses.verdicts.UNITS`:
    nats/token of loss, or ``1 - cos`` of an encoder's sentence embedding); the y axis is
    symmetric-log (linear within +-0.1) where they exceed 0.1 (losses span 0.01 to 10 nats). The
    figure widens (up to :data:`PAGE_WIDTH`) until the texts above the columns lie apart. The legend states ``rule`` (None: the one the rows carry, :meth:`VerdictRule.from_rows`).
    """
    kinds = sorted(
        {r["kind"] for r in rows},
        key=lambda k: (
            not any(r["kind"] == k and r.get("tested") for r in rows),
            ["mean", "zero"].index(k) if k in ("mean", "zero") else 9,
        ),
    )
    types = list(dict.fromkeys(r["head_type"] for r in rows))
    k = rows[0]["k"]
    rule = rule or VerdictRule.from_rows(rows)
    fig = _figure(COLUMN_WIDTH, 2.5 * len(kinds) + 0.9)
    axes = np.atleast_1d(fig.subplots(len(kinds), 1, sharex=True))
    rng = np.random.default_rng(0)
    for ax, kind in zip(axes, kinds):
        _ablation_panel(ax, kind, rows, types, rng)
    fig.legend(
        handles=_ablation_handles(rows, k, rule), loc="outside lower center", frameon=False, fontsize=5.5, ncols=1
    )
    fig.suptitle(title, fontsize=_RC["axes.titlesize"])
    task_of = {r["head_type"]: r["task"] for r in rows}
    labels = EMBEDDING_TASK_LABELS if effect_metric(rows) == "embedding_cosine" else TASK_LABELS
    many = len(types) > 4
    axes[-1].set_xticks(
        np.arange(len(types)),
        [f"{t.replace('_', '-')}\n({labels.get(task_of[t], task_of[t])})" for t in types],
        fontsize=5 if many else 5.5,
        rotation=50 if many else 25,
        ha="right",
        rotation_mode="anchor",
    )
    _widen_for_column_texts(fig, axes)
    return fig


def _widen_for_column_texts(fig: Figure, axes, gap_pt: float = 3.0) -> None:
    """Widen ``fig`` (up to :data:`PAGE_WIDTH`) until the texts each of ``axes`` holds (one per
    column, :func:`ablation_plot`'s verdict texts) are at least ``gap_pt`` points apart: seven
    types' texts in a column-wide figure printed over each other. The figure is laid out to measure
    (``draw_without_rendering``), again after each widening; a figure whose texts fit keeps its size."""
    canvas = _agg_canvas(fig)
    for _ in range(4):
        fig.draw_without_rendering()
        renderer, gap = canvas.get_renderer(), gap_pt * fig.dpi / 72
        stretch = 1.0  # how much wider the columns must get
        for ax in axes:
            boxes = sorted((t.get_window_extent(renderer) for t in ax.texts), key=lambda b: b.x0)
            for a, b in zip(boxes, boxes[1:]):
                apart = (b.x0 + b.x1 - a.x0 - a.x1) / 2  # centre to centre, which widening scales
                stretch = max(stretch, ((a.width + b.width) / 2 + gap) / max(apart, 1e-9))
        width, height = fig.get_size_inches()
        if stretch <= 1.0 or width >= PAGE_WIDTH:
            return
        inner = axes[0].get_window_extent(renderer).width / fig.dpi  # the axes' width; margins stay
        fig.set_size_inches(min(PAGE_WIDTH, width + inner * (stretch - 1.0) * 1.02), height)


_SMALL_SYMLOG_TICKS = (-0.5, -0.3, -0.2, -0.1, -0.05, 0.0, 0.05, 0.1, 0.2, 0.3, 0.5)
""":func:`ablation_plot`'s y ticks on a symmetric-log axis (linear within ±0.1) whose effects stay under 1."""

_TOP_COLOR, _CONTROL_COLOR = "#0072B2", "#999999"
""":func:`ablation_plot`'s colours: the top-k effect in Okabe-Ito blue, the control sets in grey."""


def _ablation_panel(ax, kind: str, rows: Sequence[dict], types: list[str], rng: np.random.Generator) -> None:
    """One panel of :func:`ablation_plot`: ``kind``'s rows, a column per head type of ``types``
    (controls jittered by ``rng``), its y scale (symmetric-log where effects exceed 0.1) and label."""
    import matplotlib.ticker

    by_type = {r["head_type"]: r for r in rows if r["kind"] == kind}
    top_all = []
    for i, t in enumerate(types):
        r = by_type.get(t)
        if r is None:
            continue
        draws = np.asarray(r["random_effects"], dtype=float)
        ax.scatter(i + rng.uniform(-0.22, 0.22, len(draws)), draws, s=3, color=_CONTROL_COLOR, lw=0, zorder=2)
        if len(draws):  # none where the test was not run (its verdict known before any set)
            ax.plot([i - 0.27, i + 0.27], [draws.max()] * 2, color="black", lw=0.9, zorder=3)
        lo, hi = r.get("top_effect_ci95") or [np.nan, np.nan]
        err = None if not np.isfinite([lo, hi]).all() else [[r["top_effect"] - lo], [hi - r["top_effect"]]]
        ax.errorbar([i], [r["top_effect"]], yerr=err, fmt="D", ms=4, color=_TOP_COLOR, lw=0.8, capsize=2, zorder=4)
        top_all += [r["top_effect"], *([float(draws.max())] if len(draws) else [])]
        ax.annotate(
            _ablation_verdict_text(r),
            (i, 1.0),
            xycoords=("data", "axes fraction"),
            ha="center",
            va="bottom",
            fontsize=4.5,
            fontweight="bold" if r.get("confirmed") else "normal",
            annotation_clip=False,
        )
    if max(np.abs(top_all), default=0) > 0.1:  # losses span 0.01 to 10 nats: symmetric-log
        ax.set_yscale("symlog", linthresh=0.1)
        if max(np.abs(top_all)) < 1:  # under a decade of log: 0.05 and 0.2, 0.3, 0.5 too, not only 0 and 0.1
            ax.yaxis.set_major_locator(matplotlib.ticker.FixedLocator(_SMALL_SYMLOG_TICKS))
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.axhline(0, color="black", lw=0.5)
    tested = any(r.get("tested") for r in by_type.values())
    metric = effect_metric(rows)
    ax.set_ylabel(
        f"{kind} ablation{' (tested)' if tested else ' (reported)'}\n"
        + EFFECT_LABELS.get(metric, "{unit}").format(unit=UNITS[metric])
    )


STOPPED_MARK = "†"
""":func:`ablation_plot`'s mark after a p-value whose draws stopped early
(:func:`~headprobe.analyses.verdicts.stopped_early`, a row without a verdict too): why, and the range
in full, are in the caption (:func:`ablation_caption`), not above the column. Not after a test that
was not run (its column says "no control set", "p n/a"): it sat there, its legend saying "the test
stopped early", and was missing from an untested row whose caption line said "stopped"."""


def _ablation_p(r: dict) -> str:
    """The p-value above a column, one short line: ``p = 0.02``; a stopped test's range ``p 0.05–0.0877``
    (its bound ``p ≤ 0.0877`` where the smallest is not recorded) and :data:`STOPPED_MARK`."""
    text = p_text(r)
    if r.get("p_value") is not None and r.get("p_value_is_bound") and r.get("p_value_min") is not None:
        text = f"p {r['p_value_min']:.3g}–{r['p_value']:.3g}"
    return text + (STOPPED_MARK if stopped_early(r) else "")


def _stopped_legend(stopped: Sequence[dict]) -> str:
    """The legend's line for :data:`STOPPED_MARK`, naming the forms of p the ``stopped`` rows show
    (:func:`_ablation_p`): ``p a–b`` a curtailed test's range, ``p ≤ b`` its bound without the
    smallest, ``p = h/n`` a test settled above alpha, whose p is exact (Besag & Clifford: h of n
    control sets reached the effect). It said "p a–b: its range" over a settled ``p = 0.143†``.
    Wrapped as :func:`rule_legend` (:func:`_legend_entry`)."""
    bound = [r for r in stopped if r.get("p_value") is not None and r.get("p_value_is_bound")]
    forms = [
        *(["p a–b: its range"] if any(r.get("p_value_min") is not None for r in bound) else []),
        *(["p ≤ b: its bound"] if any(r.get("p_value_min") is None for r in bound) else []),
        *(["p = h/n: settled, exact"] if any(r.get("p_value") is not None and r not in bound for r in stopped) else []),
    ]
    which = f" ({'; '.join(forms)})" if forms else ""
    return _legend_entry(f"{STOPPED_MARK}: the test stopped early{which}; why: the caption")


def _ablation_verdict_text(r: dict) -> str:
    """The numbers :func:`ablation_plot` writes above a head type's column for row ``r``, at most four
    short lines (five columns side by side): control sets that reached the effect, p (:func:`_ablation_p`)
    and, where tested, the adjusted p and the verdict. Why a test stopped is the caption's."""
    reached = (
        "no control set"
        if not r["draws"]
        else f"{r['exceedances']}/{r['draws']} reached"
        if r.get("exceedances") is not None
        else f"n={r['draws']}"
    )
    if r.get("tested"):
        adj = "-" if r["p_adjusted"] is None else f"{r['p_adjusted']:.3g}"  # None: no control set ablated
        return f"{reached}\n{_ablation_p(r)}\nadj {adj}\n{verdict_label(r['confirmed'])}"
    if r["confirmed"] is None and r.get("no_verdict"):
        return f"{reached}\n{_ablation_p(r)}\n{verdict_label(None)}"
    return f"{reached}\n{_ablation_p(r)}\n{NOT_TESTED}"


def _ablation_handles(rows: Sequence[dict], k: int, rule: VerdictRule | None) -> list:
    """:func:`ablation_plot`'s legend entries: the markers (``k`` heads a set), ``rule``
    (:func:`rule_legend`; none without one) and what the y axis' scale is."""
    from matplotlib.lines import Line2D

    handles = [
        Line2D([], [], ls="", marker="D", ms=4, color=_TOP_COLOR, label=f"top-{k} heads (bars: 95% CI over sequences)"),
        Line2D(
            [],
            [],
            ls="",
            marker="o",
            ms=2,
            color=_CONTROL_COLOR,
            label=f"control sets of {k} random heads (g/n reached: g of n sets\nreached the top-k Δ)",
        ),
        Line2D([], [], color="black", lw=0.9, label="largest control effect"),
    ]
    unit = UNITS[effect_metric(rows)]
    within = unit.removesuffix("/token") if unit.endswith("/token") else f"({unit})"  # ±0.1 nats, ±0.1 (1 - cos)
    if stopped := [r for r in rows if stopped_early(r)]:
        handles.append(Line2D([], [], ls="", label=_stopped_legend(stopped)))
    if rule is not None:
        handles.append(Line2D([], [], ls="", label=rule_legend(rule)))
    handles.append(
        Line2D([], [], ls="", label=f"y axis: symmetric log (linear within ±0.1 {within}) where effects exceed 0.1")
    )
    return handles


def format_interval(lo: float | None, hi: float | None, spec: str, prefix: str = "") -> str:
    """``[<prefix>lo, hi]`` with both bounds in format ``spec``, or ``[<prefix>n/a]`` where there is
    no interval (a bound NaN or None: an interval over one sequence), never ``[+nan, +nan]``."""
    if lo is None or hi is None or not np.isfinite([lo, hi]).all():
        return f"[{prefix}n/a]"
    return f"[{prefix}{lo:{spec}}, {hi:{spec}}]"


def format_ci(ci: Sequence[float] | None, spec: str) -> str:
    """:func:`format_interval` of a summary.json ``ci95`` pair ``[lo, hi]``, or None (JSON null: ``[n/a]``)."""
    return format_interval(None, None, spec) if ci is None else format_interval(ci[0], ci[1], spec)


def _stop_counts(rows: Sequence[dict], primary: str | None) -> str:
    """How the sequential draws of ``rows`` ended, for :func:`ablation_caption`: ``2 of 5 did, the
    others ran all their sets``, with the tests not run, and then the rows of ``primary`` kind
    reported without a verdict (their draws stop by the same rule): ``0 of 1 did, 1 was not run (...);
    of the 4 mean-ablation rows reported without a verdict, 2 did, the others ran all their sets``.
    It counted the tested rows only, so "0 of 1 did" stood over untested rows saying "stopped"."""

    def counts(group: list[dict], of: bool = True) -> str:
        early = sum(stopped_early(r) for r in group)
        not_run = sum(r.get("stop_reason") == NOT_RUN for r in group)
        return (
            f"{early}{f' of {len(group)}' if of else ''} did"
            + (
                f", {not_run} {'was' if not_run == 1 else 'were'} not run (its control sets cannot reach alpha: none ablated)"
                if not_run
                else ""
            )
            + (", the others ran all their sets" if early + not_run < len(group) else "")
        )

    tested = [r for r in rows if r.get("tested")]
    untested = [r for r in rows if not r.get("tested") and r.get("stop_reason") is not None]
    if not untested:
        return counts(tested)
    kind = primary or untested[0].get("kind")
    return (
        f"{counts(tested)}; of the {len(untested)} {kind}-ablation row{'' if len(untested) == 1 else 's'} "
        f"reported without a verdict, {counts(untested, of=False)}"
    )


def ablation_caption(rows: Sequence[dict], design: dict, rule: VerdictRule | None = None) -> str:
    """The numbers a paper's caption of ``ablation.png`` needs, as plain text: the design (k, the
    control, draws, the family), the verdict rule (``rule``; None: the design's ``verdict_rule``, else
    what the rows carry) and per tested type its effect, interval, control mean and maximum, sets
    ablated, p, adjusted p and verdict. A row carries a verdict where
    :func:`~headprobe.analyses.verdicts.decided` says so (the design's ``primary_kind``), as in scan's
    table and the LaTeX export; any other row says "not tested"."""
    if not rows:
        return ""
    k = rows[0]["k"]
    rule = rule or VerdictRule.from_rows(rows, design.get("verdict_rule"))
    n = design.get("family_size")
    lines = [
        f"Ablation check: the top-{k} heads of each head type against random control sets of {k} heads "
        f"({design.get('control')}, drawn outside every top-{k} set of the task{own_pool_text(rows, k)}), "
        f"{design.get('primary_kind')} "
        f"ablation tested, at most {design.get('max_draws')} sets per test; a test stops early only once it "
        f"cannot be significant (Besag & Clifford 1991): {_stop_counts(rows, design.get('primary_kind'))}; "
        f"{n} test{'' if n == 1 else 's'}"
        + (f". CONFIRMED: {rule.condition()}" if rule is not None else "")
        + f". Effects in {UNITS[effect_metric(rows)]} ({EFFECT_MEANINGS[effect_metric(rows)]}) unless stated."
    ]
    for r in rows:
        lo, hi = r.get("top_effect_ci95") or [float("nan")] * 2
        verdict = verdict_label(r["confirmed"]) + (f" ({r.get('no_verdict')})" if r["confirmed"] is None else "")
        role = (  # which rows carry a verdict: scan's table's and the LaTeX export's rule
            f"p_adj = {'n/a' if r['p_adjusted'] is None else format(r['p_adjusted'], '.4g')}, {verdict}"
            if r.get("tested")
            else f"{verdict_label(None)} ({r['no_verdict']})"
            if decided(r, design.get("primary_kind"))
            else NOT_TESTED
        )
        lines.append(
            f"{r['head_type'].replace('_', '-')} ({r['kind']}, {r['task']}): top-{k} effect {r['top_effect']:+.4g} "
            f"{format_interval(lo, hi, '+.4g', '95% CI ')} vs "
            + (
                f"control mean {r['random_mean']:+.4g}, max {r['random_max']:+.4g} over {r['draws']} sets"
                if r["draws"]
                else "no control set"
            )
            + f"; {evidence_text(r, 4)}; {role}."
        )
    return "\n".join(lines) + "\n"


@_styled
def diff_heatmaps(
    panels: Sequence[tuple],
    title: str,
    group_size: int | None = None,
    limits: Sequence[float] | None = None,
    empty: str | None = None,
) -> Figure:
    """A page-wide grid of layer x head heatmaps of signed changes (``headprobe diff``'s B − A), three
    panels a row, each on ``RdBu_r`` centred at 0 with its own symmetric limits and its own
    labelled colour bar.

    Args:
        panels: ``(title, colour bar label, change [layer, head], boxed [layer, head] bool,
            dotted {(layer, head): filled})`` per panel; a boxed head is outlined, a dotted one gets a
            dot (filled or hollow).
        title: the figure's title (wrapped to the page).
        group_size: query heads per key/value head: the groups parted and named as the scan's
            heatmaps part them (:func:`_head_groups`; it read plain "head" beside their "head (3 per KV head)").
        limits: per panel, the colour limit ``m`` (colours from ``-m`` to ``+m``), raised to the panel's
            largest ``|change|`` where that is larger; None: that largest ``|change|`` alone.
        empty: the words written under a panel's title, in parentheses, where no head is boxed (None: nothing);
            over no cell.

    Each boxed head has a box of its own, inset in its cell (:func:`_box_cells`): two changed neighbours read
    as two boxes, not one outline round both.
    """
    import textwrap

    n_layers, n_heads = np.shape(panels[0][2])
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    panel_height = max(1.1, 0.06 * n_layers)  # a 30-layer model: 1.8 in, three rows on one page
    # a cell's side in points (x, y), a little under the laid-out axes' (1.1 in wide beside the colour bar)
    cell_pt = ((PAGE_WIDTH / cols - 1.15) * 72 / n_heads, panel_height * 72 / n_layers)
    fig = _figure(PAGE_WIDTH, 0.9 + rows * (panel_height + 0.75))
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    bars = []
    for i, (ax, (name, label, change, boxed, dotted)) in enumerate(zip(axes, panels)):
        change = np.asarray(change, dtype=float)
        lim = float(np.nanmax(np.abs(change))) if np.isfinite(change).any() else 0.0
        lim = max(lim, float(limits[i]) if limits is not None and np.isfinite(limits[i]) else 0.0) or 1.0
        im = ax.imshow(change, cmap=DIVERGING_CMAP, vmin=-lim, vmax=lim, aspect="auto", interpolation="nearest")
        _box_cells(ax, boxed, cell_pt)
        for (layer, head), filled in dotted.items():
            ax.plot(head, layer, "o", ms=2.5, mec="#222", mfc="#222" if filled else "none", mew=0.6)
        ax.set_xticks(range(0, n_heads, _head_step(n_heads, PAGE_WIDTH / cols - 0.9)))
        ax.set_yticks(range(0, n_layers, max(1, -(-n_layers // 10))))
        heading = textwrap.fill(name, 28)  # a title wider than its panel passes the page's edge
        if empty and not np.any(boxed):  # under the title, over no cell (a box in the panel hid cells)
            heading += "\n" + "\n".join(_wrap_keeping_parentheses(f"({empty})", 32))
        ax.set(title=heading, ylabel="layer")
        _head_groups(ax, n_heads, group_size)
        bars.append(fig.colorbar(im, ax=ax, shrink=0.9, pad=0.02))
        bars[-1].set_label(label)
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(title)
    _fit_ylabels(fig, [bar.ax for bar in bars])  # a label no taller than its bar
    return fig


def _box_cells(ax, boxed: np.ndarray, cell_pt: tuple[float, float], gap_pt: float = 1.0) -> None:
    """Outline each ``True`` cell of ``boxed`` (``[layer, head]``) on its own: a black box inset in its
    cell, so that the strokes of two neighbours' boxes stay apart, ``2 * gap_pt`` points where the cell has
    room (one rectangle a cell on the cell's edges drew neighbours as one merged outline). ``cell_pt``: a
    cell's width and height in points (a little under the drawn ones, so the gap is at least that); the
    stroke thins on small cells (15% of the shorter side, at most 1 pt), the inset at most 25% of a side
    (a 30-layer model's 4.6 pt rows: about 1.7 pt apart)."""
    from matplotlib.patches import Rectangle

    lw = min(1.0, 0.15 * min(cell_pt))
    dx, dy = (min(0.25, (lw / 2 + gap_pt) / side) for side in cell_pt)  # data units: a cell is 1 x 1
    for layer, head in zip(*np.nonzero(boxed)):  # zorder 3: a box's edge over the group lines
        corner = (head - 0.5 + dx, layer - 0.5 + dy)
        ax.add_patch(Rectangle(corner, 1 - 2 * dx, 1 - 2 * dy, fill=False, lw=lw, ec="black", zorder=3))


@_styled
def signed_head_heatmap(
    values: np.ndarray,
    title: str,
    cbar_label: str,
    group_size: int | None = None,
    ax=None,
    removed: np.ndarray | None = None,
    cbar_math: bool = False,
) -> Figure:
    """A layer x head heatmap of a signed quantity (e.g. a loss change in nats) on ``RdBu_r``,
    centred at 0 with symmetric limits over the heads not ``removed`` (:func:`head_heatmap`'s;
    ``cbar_math`` as there)."""
    values = np.asarray(values, dtype=float)
    kept = values if removed is None else values[~np.asarray(removed, dtype=bool)]
    vmax = float(np.nanmax(np.abs(kept))) if np.isfinite(kept).any() else 1.0
    return head_heatmap(
        values,
        title,
        cbar_label,
        cmap=DIVERGING_CMAP,
        vmin=-vmax,
        vmax=vmax,
        group_size=group_size,
        ax=ax,
        removed=removed,
        cbar_math=cbar_math,
    )


PATCHING_GRID_IN = (2.0, 5.4, 5.5, 0.45, 0.12)
"""The room (inches) of :func:`patching_heatmap`'s grid: its width in a column (the column less the
layer axis and the colour bar) and across the page, its height, the largest cell side, and the smallest
cell side in a column (narrower cells take the page's width)."""


@_styled
def patching_heatmap(
    values: np.ndarray,
    title: str,
    cbar_label: str,
    group_size: int | None = None,
    positions: Sequence[int] | None = None,
) -> Figure:
    """patching.png: :func:`signed_head_heatmap` of ``values`` (``[layer, head]``, or ``[layer, position]``
    with ``positions``, the token positions of the columns) with square cells: the cell's side the largest
    that fits :data:`PATCHING_GRID_IN`, the figure as tall as the grid needs (a fixed column and a height
    from the layers alone stretched 2 x 4 heads to cells half as wide as tall, 3 positions to wide bars),
    the colour bar as tall as the grid (at least 1.1 in, for its label). Every ``step``-th row and column labelled, at the tick label size,
    so that no two labels meet."""
    values = np.asarray(values, dtype=float)
    n_rows, n_cols = values.shape
    column_w, page_w, grid_h, most, least = PATCHING_GRID_IN
    wide = column_w / n_cols < least
    cell = min((page_w if wide else column_w) / n_cols, grid_h / n_rows, most)
    # title (up to two lines), x tick labels and axis label, the legend of unmeasured cells
    fig = _figure(PAGE_WIDTH if wide else COLUMN_WIDTH, max(n_rows * cell + 1.4, 2.0))
    ax = fig.add_subplot()
    kept = values[np.isfinite(values)]
    vmax = float(np.abs(kept).max()) if kept.size else 1.0
    grouped = group_size if positions is None else None
    grid_w = n_cols * cell
    tall = max(1.0, 1.1 / (n_rows * cell))  # as tall as the grid, or 1.1 in about its middle: room for the label
    bar = (1 + 0.08 / grid_w, (1 - tall) / 2, 0.1 / grid_w, tall)  # 0.08 in right of the grid, 0.1 in wide
    head_heatmap(values, title, cbar_label, DIVERGING_CMAP, -vmax, vmax, grouped, ax=ax, cbar_full_height=bar)
    ax.set_aspect("equal")
    labels = [str(h) for h in range(n_cols)] if positions is None else [str(p) for p in positions]
    step = _label_step(n_cols, max(len(t) for t in labels), grid_w)
    ax.set_xticks(range(0, n_cols, step), labels[::step])
    row_step = next(k for k in (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32) if k * cell * 72 >= 9 or k >= n_rows)
    ax.set_yticks(range(0, n_rows, row_step))
    return fig


@_styled
def composition_plot(
    k_scores: np.ndarray,
    earlier: Sequence[tuple[int, int]],
    later: Sequence[tuple[int, int]],
    title: str,
    earlier_name: str = "previous-token",
    later_name: str = "induction",
) -> Figure:
    """K-composition of chosen head pairs against the typical pair (double-column width); heads
    are named ``layer.head`` (:func:`~headprobe.probe.core.heads.format_head`) as everywhere else.

    Left: the scores of ``earlier -> later`` pairs (``k_scores[layer_j, head_j, layer_i, head_i]``,
    rows the later heads), blank where the earlier head is not in an earlier layer. Right: the
    distribution of every pair of heads in different layers (histogram, its median dashed), the
    chosen pairs as ticks along the top; the legend below both panels, where it covers no bar."""
    vals = np.array([[k_scores[lj, hj, li, hi] if li < lj else np.nan for li, hi in earlier] for lj, hj in later])
    allv = k_scores[np.isfinite(k_scores)]
    fig = _figure(PAGE_WIDTH, 3.0)
    left, right = fig.subplots(1, 2, width_ratios=[1, 1.4])
    vmax = float(np.nanmax(vals)) if np.isfinite(vals).any() else 1.0
    im = left.imshow(vals, cmap="viridis", vmin=0, vmax=max(vmax, float(np.percentile(allv, 99))), aspect="auto")
    # heads named layer.head, as in every other figure, table and summary.json
    left.set_xticks(range(len(earlier)), [format_head(h) for h in earlier], rotation=90)
    left.set_yticks(range(len(later)), [format_head(h) for h in later])
    left.set_xlabel(f"{earlier_name} head (writes)")
    left.set_ylabel(f"{later_name} head (keys read)")
    for (r, c), v in np.ndenumerate(vals):
        if np.isfinite(v):
            left.text(
                c, r, f"{v:.2f}", ha="center", va="center", fontsize=5, color="white" if v < 0.6 * vmax else "black"
            )
        else:
            left.text(c, r, "not\nearlier", ha="center", va="center", fontsize=4, color="0.4")
    fig.colorbar(im, ax=left, shrink=0.9, pad=0.02).set_label("K-composition")
    right.hist(allv, bins=60, color="0.7", label=f"all {allv.size} pairs (earlier → later layer)")
    right.axvline(
        float(np.median(allv)), color="0.3", ls="--", lw=0.8, label=f"median of all pairs {np.median(allv):.3f}"
    )
    right.axvline(
        float(np.percentile(allv, 95)),
        color="0.3",
        ls=":",
        lw=0.8,
        label=f"95th percentile of all pairs {np.percentile(allv, 95):.3f}",
    )
    chosen = vals[np.isfinite(vals)]
    ymax = right.get_ylim()[1]
    right.vlines(
        chosen,
        ymax * 0.9,
        ymax,
        color="C3",
        lw=0.8,
        label=f"{earlier_name} → {later_name} ({chosen.size}), median {np.median(chosen):.3f}"
        if chosen.size
        else "no pair",
    )
    # Elhage et al. (2021)'s K-composition of head i into head j, Frobenius norms (composition.py)
    _mathtext(
        right.set_xlabel(
            r"K-composition  $\Vert W_\mathrm{OV}^{i}\,W_\mathrm{QK}^{j\top} \Vert_\mathrm{F} \,/\, "
            r"(\Vert W_\mathrm{OV}^{i} \Vert_\mathrm{F} \, \Vert W_\mathrm{QK}^{j} \Vert_\mathrm{F})$"
        )
    )
    right.set_ylabel("pairs")
    # below both panels: anywhere inside the axes it can cover bars (the histogram's mode moves with the model)
    fig.legend(*right.get_legend_handles_labels(), fontsize=6, frameon=False, loc="outside lower center", ncols=2)
    fig.suptitle(title)
    return fig


LOCAL_WEIGHTS = ("local Hugging Face directory", "GGUF file", "headprobe checkpoint")
"""What a ModelSpec's ``weights`` says of a model loaded from a local folder or file
(:func:`headprobe.probe.backends.sources.resolve`, a headprobe checkpoint, a pruned one)."""


def title_name(name: str, weights: str = "") -> str:
    """How titles and captions name the model ``name`` (a ModelSpec's, or summary.json's ``model``): a
    registered or Hugging Face name as it is; one loaded from a local folder or file (``weights``, the
    spec's or summary.json's ``weights_precision``, says so: :data:`LOCAL_WEIGHTS`, or the name starts
    with ``.``, ``/`` or ``~``) by that folder's or file's own name: a path is no name, and one
    without spaces cannot wrap (``Head pruning, /tmp/run/pruned_mode`` was cut at the edge)."""
    local = name.startswith((".", "/", "~")) or any(w in weights for w in LOCAL_WEIGHTS)
    return (Path(name).name or name) if local else name


def model_tag(name: str, weights: str) -> str:
    """``title_name (weights_label)``: the model as a figure's title names it, e.g.
    ``smollm2-135m (4-bit weights)`` or ``pruned_model (float32 weights)``."""
    return f"{title_name(name, weights)} ({weights_label(weights)})"


def weights_label(weights: str) -> str:
    """Short form of a ModelSpec's ``weights`` for figure titles: ``4-bit weights`` for the
    quantized default model, else the first word (``float32 weights``)."""
    return "4-bit weights" if "4-bit" in weights else f"{weights.split(' ')[0]} weights"


@_styled
def ablation_effect_panels(
    panels: Sequence[tuple[str, np.ndarray]],
    group_size: int | None,
    suptitle: str,
    cbar_label: str = "Δ loss (nats/token)",
    removed: np.ndarray | None = None,
    signed: bool = True,
) -> Figure:
    """Layer x head heatmaps side by side (one per task), each on its own scale.

    ``signed``: the quantity can be negative by its definition (a loss change; an estimate of one):
    :data:`DIVERGING_CMAP` centred at 0 with symmetric limits. False: it cannot (Michel et al.'s
    importance ``E|dL/dxi_h|``): :data:`SEQUENTIAL_CMAP` from 0 to the largest value.
    ``removed``: ``[layer, head]`` True for heads a pruned checkpoint no longer has: drawn pale
    grey (:data:`MASKED_COLOR`), cross-hatched, named in the legend, whatever their value (NaN, or the 0 of a
    head with zero weights), never as a measured effect."""
    n_layers = np.asarray(panels[0][1]).shape[0]
    # at least 2.2 in: a model of few layers (1 to 6) leaves its heatmaps room for a colour bar tall enough for its
    # label in two or three lines (_fit_colorbar_labels) beneath a suptitle of up to three
    fig = _figure(COLUMN_WIDTH if len(panels) == 1 else PAGE_WIDTH * 0.62, min(max(1.4 + 0.13 * n_layers, 2.2), 8.0))
    axes = np.atleast_1d(fig.subplots(1, len(panels)))
    gone = np.zeros(np.shape(panels[0][1]), dtype=bool) if removed is None else np.asarray(removed, dtype=bool)
    tall = n_layers >= 16  # a tall, narrow heatmap's bar fell short of it (3/4 at 30 layers); a short one's did not
    if tall:  # its label no taller than the heatmap (the figure's height less ~1.5 in; ~0.05 in a character at 7 pt)
        room = int((fig.get_figheight() - 1.5) / 0.05)
        cbar_label = "\n".join(_wrap_keeping_parentheses(cbar_label, room, break_words=False))
    for ax, (title, values) in zip(axes, panels):
        values = np.asarray(values, dtype=float)
        finite = np.abs(values[np.isfinite(values) & ~gone])
        top = float(finite.max()) if finite.size and finite.max() > 0 else 1.0
        head_heatmap(
            values,
            title,
            cbar_label,
            cmap=DIVERGING_CMAP if signed else SEQUENTIAL_CMAP,
            vmin=-top if signed else 0.0,
            vmax=top,
            group_size=group_size,
            ax=ax,
            removed=gone,
            cbar_full_height=tall,
        )
    _merge_legends(fig, axes)
    fig.suptitle(suptitle)
    if tall:
        from matplotlib.layout_engine import ConstrainedLayoutEngine

        engine = fig.get_layout_engine()
        assert isinstance(engine, ConstrainedLayoutEngine)  # _figure's layout="constrained"
        engine.set(wspace=0.12)  # a bar's label clear of the next panel's "layer"
    return fig


LOG_SPREAD = 30.0
"""Spread (largest over 5th-percentile magnitude, :func:`_spread`) above which :func:`importance_vs_effect`
draws an axis on a log scale (symmetric-log for a signed one): past ~1.5 decades a linear axis piles
most heads into a corner."""


@_styled
def importance_vs_effect(
    panels: Sequence[tuple[str, np.ndarray, np.ndarray, Sequence[tuple[int, int]]]],
    suptitle: str,
    xlabel: str,
    ylabel: str,
) -> Figure:
    """One scatter panel per task: each head's exact loss change when ablated (x, signed) against its
    gradient importance (y, >= 0), one dot per head finite in both, one ``PathCollection`` per panel.

    ``panels``: ``(title, effect, importance, labelled)`` with ``effect`` and ``importance``
    ``[layer, head]`` (NaN: not measured, not drawn) and ``labelled`` the heads named ``L.H`` beside
    their dots (filled :data:`POSITIVE_COLOR`), placed apart by :func:`_place_point_labels`. An axis
    whose magnitudes spread more than :data:`LOG_SPREAD` is drawn on a log scale: the importance's
    (positive) on ``log``, the effect's (either sign) on ``symlog``, linear within the decade of its
    10th-percentile magnitude (:func:`_symlog_threshold`), a dotted line at 0."""
    import matplotlib.ticker as mticker
    from matplotlib.lines import Line2D

    fig = _figure(PAGE_WIDTH, 3.2)
    axes = np.atleast_1d(fig.subplots(1, len(panels)))
    notes: list = []
    left: list[bool] = []
    crowd: list = []
    for ax, (title, effect, importance, labelled) in zip(axes, panels):
        x, y = np.asarray(effect, dtype=float), np.asarray(importance, dtype=float)
        ok = np.isfinite(x) & np.isfinite(y)
        named = np.zeros_like(ok)
        for h in labelled:
            named[h] = ok[h]
        face = np.where(named[ok], POSITIVE_COLOR, "#7f7f7f")
        crowd.append(ax.scatter(x[ok], y[ok], s=np.where(named[ok], 9, 5), c=face, alpha=0.75, lw=0, zorder=2))
        ax.axvline(0, color="black", lw=0.5, ls=":", zorder=1)
        edge = _symlog_threshold(x[ok]) if ok.any() and _spread(x[ok]) > LOG_SPREAD else None
        if edge is not None:  # its +-edge ticks unlabelled: "−0.001" ran into "0" in the narrow linear part
            ax.set_xscale("symlog", linthresh=edge, linscale=0.5)
        if ok.any() and (y[ok] > 0).all() and _spread(y[ok]) > LOG_SPREAD:
            ax.set_yscale("log")
        for axis, skip in ((ax.xaxis, edge), (ax.yaxis, None)):
            axis.set_major_formatter(mticker.FuncFormatter(functools.partial(_tick_text, skip=skip)))
        notes += [
            ax.annotate(
                format_head(h),
                (x[h], y[h]),
                xytext=(3, 3),
                textcoords="offset points",
                fontsize=5.5,
                arrowprops={"arrowstyle": "-", "lw": 0.3, "color": "#404040", "shrinkA": 0, "shrinkB": 2},
            )
            for h in labelled
            if ok[h]
        ]
        left += [True] * (len(notes) - len(left))  # the largest effects sit at the right edge
        ax.margins(x=0.1, y=0.08)  # the outermost dots and their labels inside the frame
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.grid(True, which="major", lw=0.3, alpha=0.4)
    axes[0].set_ylabel(ylabel)
    fig.suptitle(suptitle)
    k = max(len(p[3]) for p in panels)
    keys = [
        ("#7f7f7f", 5, "one head"),
        *([(POSITIVE_COLOR, 9, f"top {k} by loss increase (layer.head)")] * (k > 0)),
    ]
    handles = [Line2D([], [], ls="", marker="o", ms=np.sqrt(size), color=c, alpha=0.75) for c, size, _ in keys]
    fig.legend(handles, [t for *_, t in keys], loc="outside lower center", ncols=2, frameon=False, fontsize=6)
    _fit_ylabels(fig, axes[:1])
    _wrap_titles(fig)  # the final layout, before the labels are measured
    _place_point_labels(fig, notes, left, crowd=crowd, spots=_LEADER_SPOTS)
    return fig


_LEADER_SPOTS = [
    (side * dx, dy, "left" if side > 0 else "right", "bottom" if dy > 0 else "top")
    for far in (8, 16, 26)
    for side in (1, -1)
    for dx, dy in ((far, far * 0.6), (far, -far * 0.6), (far * 0.4, far), (far * 0.4, -far))
]
"""Offsets (points) :func:`importance_vs_effect` tries for a head's label, each far enough from its
dot for the leader line to show which dot it names (two heads' dots can touch)."""


def _tick_text(v: float, _pos: Any = None, skip: float | None = None) -> str:
    """A tick label as a plain number (``0.01``, ``−1``; no mathtext ``10^-2``), blank at ``±skip``."""
    return "" if skip is not None and np.isclose(abs(v), skip) else f"{v:g}".replace("-", "−")


def _spread(values: np.ndarray) -> float:
    """Largest over 5th-percentile magnitude of ``values`` (inf where that is 0)."""
    size = np.abs(values)
    low = float(np.quantile(size, 0.05))
    return float(size.max()) / low if low > 0 else float("inf")


def _symlog_threshold(values: np.ndarray) -> float:
    """The power of 10 at or below the 10th-percentile magnitude of ``values`` (the nonzero ones): a
    symmetric-log axis is linear within it, so that the ~10% of heads nearest 0 share one decade."""
    size = np.abs(values[values != 0])
    return 10.0 ** np.floor(np.log10(np.quantile(size, 0.1))) if size.size else 1.0


def _merge_legends(fig: Figure, axes) -> None:
    """The legends :func:`head_heatmap` put below each of ``axes`` (what removed and unmeasured cells mean) as one
    legend below the figure, each key once: a legend at a fraction of a short heatmap's height (a model of 2 layers)
    lay over its "head" label, and one wider than its heatmap squeezed the heatmap in the constrained layout."""
    keys: dict[str, Any] = {}
    for ax in axes:
        legend = ax.get_legend()
        if legend is None:
            continue
        for handle, text in zip(legend.legend_handles, legend.get_texts()):
            keys.setdefault(text.get_text(), handle)
        legend.remove()
    if keys:
        fig.legend(
            list(keys.values()),
            list(keys),
            loc="outside lower center",
            frameon=False,
            fontsize=6,
            handlelength=1.2,
            ncols=len(keys),
        )


@_styled
def training_curves(
    steps: np.ndarray,
    max_induction: np.ndarray,
    max_previous_token: np.ndarray,
    in_context_loss: np.ndarray,
    train_loss: np.ndarray,
    phase_between: tuple[int, int] | None,
    title: str,
) -> Figure:
    """The induction-head phase change (Olsson et al. 2022, Fig. 1 style): top induction and
    previous-token scores (upper panel) and the in-context loss and training loss (lower panel,
    nats) against training step; a grey band marks ``phase_between``, the two evaluation steps
    between which it happened (:func:`headprobe.analyses.train.phase_change_interval`): evaluations
    locate it no finer, so no line claims one step."""
    fig = _figure(COLUMN_WIDTH, 3.6)
    ax1, ax2 = fig.subplots(2, 1, sharex=True)
    ax1.plot(steps, max_induction, color="#0072B2", lw=1.2, label="max induction score")
    ax1.plot(steps, max_previous_token, color="#E69F00", lw=1.0, ls="--", label="max previous-token score")
    ax1.set_ylim(0, 1.02)
    ax1.set_ylabel("head score")
    ax1.set_title(title)
    ax2.plot(steps, in_context_loss, color="#009E73", lw=1.2, label="in-context loss (late − early)")
    ax2.axhline(0, color="black", lw=0.5)
    ax2.set_ylabel(IN_CONTEXT_LOSS_LABEL)
    ax2.set_xlabel("training step")
    tw = ax2.twinx()
    tw.plot(steps[1:], train_loss[1:], color="#CC79A7", lw=0.9, ls=":", label="training loss")
    tw.set_ylabel("training loss (nats)")
    lines = ax1.get_lines() + ax2.get_lines()[:1] + tw.get_lines()
    # one legend below the panels, over no data: no corner of either panel is free in every run
    # (a previous-token score that stays low lay under the upper panel's lower-right legend)
    ax2.legend(
        lines,
        [ln.get_label() for ln in lines],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.32),
        ncols=2,
        frameon=False,
        fontsize=6,
    )
    if phase_between is not None:
        before, after = phase_between
        for ax in (ax1, ax2):
            ax.axvspan(before, after, color="grey", alpha=0.18, lw=0, zorder=0)
        # label on the left of the band, above the low scores before the phase change, unless too close to the left edge
        early = before < 0.25 * float(np.max(steps))
        ax1.annotate(
            f"phase change\n(steps {before}–{after})",
            (after if early else before, 0.95),
            xytext=(3 if early else -3, 0),
            textcoords="offset points",
            fontsize=6,
            va="top",
            color="grey",
            ha="left" if early else "right",
        )
    _fit_ylabels(fig, [ax1, ax2])  # the in-context label, no taller than its panel
    return fig


@_styled
def loss_vs_heads(
    n_heads: np.ndarray,
    loss: np.ndarray,
    title: str,
    in_context: np.ndarray | None = None,
    loss_label: str = "held-out loss (nats/token)",
) -> Figure:
    """Held-out loss (nats/token) against the number of heads at a fixed width: one hollow ring per
    seed, the line through the means drawn over them (neither hides the other); log2 x axis. With
    ``in_context`` (one value per run, nats), a second panel below shows the in-context loss the same way (near -4.5: induction formed; near 0: not)."""
    n_heads, loss = np.asarray(n_heads), np.asarray(loss, dtype=float)
    panels = [(loss, loss_label)] + (
        [] if in_context is None else [(np.asarray(in_context, dtype=float), IN_CONTEXT_LOSS_LABEL)]
    )
    fig = _figure(COLUMN_WIDTH, 2.4 if len(panels) == 1 else 3.6)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    xs = np.unique(n_heads)
    for ax, (y, label) in zip(axes, panels):
        means = [y[n_heads == x].mean() for x in xs]  # drawn over the seeds' hollow rings, which never hide it
        ax.plot(xs, means, color="#0072B2", lw=1.2, marker="o", ms=3, mec="white", mew=0.4, zorder=4, label="mean")
        ax.scatter(n_heads, y, facecolors="none", edgecolors="#E69F00", s=14, lw=0.8, zorder=3, label="one seed")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_ylabel(label)
    axes[-1].set_xlabel("heads per layer (same d_model)")
    axes[0].set_title(title)
    axes[0].legend(frameon=False, fontsize=6)
    _fit_ylabels(fig, axes)  # each label no taller than its panel
    return fig


@_styled
def quality_vs_kv(
    labels: Sequence[str],
    kv_bytes: np.ndarray,
    loss: np.ndarray,
    lo: np.ndarray,
    hi: np.ndarray,
    title: str,
    loss_label: str = "held-out loss (nats/token)",
    formed: np.ndarray | None = None,
    n_seeds: int | None = None,
    formed_by: str = "induction score",
    in_context: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
) -> Figure:
    """Held-out loss (nats, mean with the seed range as bars where ``n_seeds`` >= 2) against KV cache
    per token (bytes, log x). With ``formed`` (one bool per variant: ``formed_by`` above 0.5 in every
    seed, the top head's induction score or its 95% lower bound), the other variants are drawn as open
    circles and the legend names both kinds by that rule; it says "bars: seed range" only over 2+
    seeds (``n_seeds``; None: where some ``hi`` exceeds its ``lo``). With ``in_context`` (``(mean, min,
    max)`` per variant, nats: late minus early loss on copy sequences) a second panel below shows it
    the same way: the held-out loss alone ranked MQA, which copied without an induction head, best."""
    kv = np.asarray(kv_bytes, dtype=float)
    formed = np.ones(len(kv), dtype=bool) if formed is None else np.asarray(formed, dtype=bool)
    seeds = (2 if bool(np.any(np.asarray(hi) > np.asarray(lo))) else 1) if n_seeds is None else n_seeds
    every, some = (" in every seed", " in some seed") if seeds > 1 else ("", "")
    keys = (
        (formed, "#0072B2", f"top head's {formed_by} > 0.5{every}"),
        (~formed, "white", f"top head's {formed_by} ≤ 0.5{some}"),
    )
    panels = [(loss, lo, hi, loss_label)] + ([] if in_context is None else [(*in_context, IN_CONTEXT_LOSS_LABEL)])
    fig = _figure(COLUMN_WIDTH, 2.6 if len(panels) == 1 else 3.9)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    notes, left = [], []
    for ax, (y, y_lo, y_hi, ylabel) in zip(axes, panels):
        y, y_lo, y_hi = (np.asarray(v, dtype=float) for v in (y, y_lo, y_hi))
        for mask, face, text in keys:
            if mask.any():
                ax.errorbar(
                    kv[mask],
                    y[mask],
                    yerr=[y[mask] - y_lo[mask], y_hi[mask] - y[mask]] if seeds > 1 else None,
                    fmt="o",
                    ms=3.5,
                    color="#0072B2",
                    mfc=face,
                    ecolor="#E69F00",
                    capsize=2,
                    lw=0.8,
                    label=text,
                )
        notes += [
            ax.annotate(t, (x, v), xytext=(3, 3), textcoords="offset points", fontsize=5.5, ha="left", va="bottom")
            for x, v, t in zip(kv, y, labels)
        ]
        span = max(float(np.ptp(y)), 1e-9)
        # a label whose right-hand neighbour sits at about the same height tries the left first
        left += [bool(np.any((kv > x) & (kv < 1.45 * x) & (np.abs(y - v) < 0.1 * span))) for x, v in zip(kv, y)]
        ax.set_xscale("log", base=2)
        ax.margins(x=0.1, y=0.12)  # room for the labels of the outermost points
        ax.xaxis.set_major_formatter(lambda x, _: f"{x:g}")  # 32, 64, ... rather than 2^5, 2^6
        ax.set_ylabel(ylabel)
    axes[-1].set_xlabel("KV cache per token, all layers (bytes, bf16)")
    axes[0].set_title(title)
    if not formed.all():
        fig.legend(  # below the axes: inside, its two lines hid points' bars (2026-12-06 layouts study)
            *axes[0].get_legend_handles_labels(),
            loc="outside lower center",
            frameon=False,
            fontsize=5.5,
            title=f"bars: range over {seeds} seeds" if seeds > 1 else None,
            title_fontsize=5.5,
        )
    _fit_ylabels(fig, axes)  # each label no taller than its panel
    _wrap_titles(fig)  # the final layout, before the labels are measured
    _place_point_labels(fig, notes, left)
    return fig


_LABEL_SPOTS = [
    (3 * side, dy, "left" if side > 0 else "right", "bottom" if dy > 0 else "top")
    for far in (0, 9, 18, 27)
    for side in (1, -1)
    for dy in (3 + far, -3 - far)
]
"""Offsets (points) and alignments :func:`_place_point_labels` tries for a point's label, nearest first."""


def _place_point_labels(
    fig: Figure,
    notes,
    left: Sequence[bool],
    gap_px: float = 1.0,
    marker_pt: float = 4.0,
    crowd: Sequence = (),
    spots: Sequence[tuple[float, float, str, str]] | None = None,
) -> None:
    """Move each annotation of ``notes`` (text beside a data point, offset in points) to the first
    spot of :data:`_LABEL_SPOTS` (mirrored, left side first, where ``left`` says so) where its box
    keeps ``gap_px`` pixels from every label placed before it and from every other point's marker
    (``marker_pt`` points around it) and stays inside the axes, else where it clashes least: two
    variants with the same KV cache and nearly the same loss printed their names over each other, and
    a label under a neighbour's marker reads as that neighbour's. ``crowd``: scatter collections whose
    other dots a label also keeps off where it can (a tenth of a clash each, less than one in all).
    ``spots``: the offsets to try instead of :data:`_LABEL_SPOTS`. The figure is laid out
    once to measure (``draw_without_rendering``)."""
    from matplotlib.transforms import Bbox

    canvas = _agg_canvas(fig)
    fig.draw_without_rendering()
    renderer = canvas.get_renderer()
    placed: list = []  # the boxes of the labels placed so far
    r = marker_pt * fig.dpi / 72
    centres = [n.axes.transData.transform(n.xy) for n in notes]
    points = [Bbox.from_bounds(x - r, y - r, 2 * r, 2 * r) for x, y in centres]
    dots = np.concatenate([c.get_offset_transform().transform(c.get_offsets()) for c in crowd] or [np.empty((0, 2))])

    def put(
        note, spot
    ) -> float:  # move the label; its clashes (a label or marker overlapped: 1, outside the axes: 0.5)
        dx, dy, ha, va = spot
        note.xyann = (dx, dy)
        note.set(ha=ha, va=va)
        box, room = _text_box(note, renderer).padded(gap_px), note.axes.get_window_extent(renderer)
        others = [p for n, p in zip(notes, points) if n is not note]
        markers = sum(box.overlaps(p) for p in others)
        # nearer another point than its own: it reads as that point's label
        nearer = any(_box_distance(box, p) < _box_distance(box, points[notes.index(note)]) for p in others)
        # past the frame's side: 0.5; past its top or bottom, over the ticks and the next panel: 2
        outside = 0.5 * (box.x0 < room.x0 or box.x1 > room.x1) + 2 * (box.y0 < room.y0 or box.y1 > room.y1)
        crowded = min(0.1 * _points_in(box, dots, r / 2), 0.9) if len(dots) else 0.0  # less than one clash
        return sum(box.overlaps(b) for b in placed) + markers + nearer + outside + crowded

    right = _LABEL_SPOTS if spots is None else spots
    mirrored = [(-dx, dy, "right" if ha == "left" else "left", va) for dx, dy, ha, va in right]
    for note, to_left in zip(notes, left):
        tried = mirrored if to_left else right
        put(note, min(tried, key=lambda spot: put(note, spot)))  # the first spot with the fewest clashes
        placed.append(_text_box(note, renderer))


def _text_box(note: Any, renderer: Any) -> Any:
    """The box of an annotation's text alone, its leader line left out (``get_window_extent`` unites them)."""
    from matplotlib.text import Text

    note.update_positions(renderer)
    return Text.get_window_extent(note, renderer)


def _box_distance(box, point) -> float:
    """Pixels from the box ``box`` to the centre of the box ``point`` (0 inside)."""
    x, y = (point.x0 + point.x1) / 2, (point.y0 + point.y1) / 2
    return float(np.hypot(max(box.x0 - x, 0.0, x - box.x1), max(box.y0 - y, 0.0, y - box.y1)))


POSITIVE_COLOR, NEGATIVE_COLOR = "#B2182B", "#2166AC"
"""The ends of ``RdBu_r`` (the signed heatmaps' scale): bars of signed values use the same two colours."""


@_styled
def effect_bars(
    labels: Sequence[str],
    effects: np.ndarray,
    ci: np.ndarray,
    title: str,
    ylabel: str,
    signs: np.ndarray | None = None,
    sign_labels: tuple[str, str] = ("above zero", "below zero"),
    ci_label: str = "whiskers: 95% t interval over prompts",
    label_prefix: str = "head ",
) -> Figure:
    """Horizontal bars of signed per-head effects (largest first, top to bottom) with their 95%
    intervals as whiskers (``ci``: ``[2, n]`` lower and upper bounds; NaN: no whisker, and
    ``ci_label`` should then say why). ``label_prefix`` goes before each label on the axis.

    A bar is red (:data:`POSITIVE_COLOR`) where ``signs`` (default: ``effects``) is positive, else
    blue, as on the ``RdBu_r`` heatmaps; pass the values a companion heatmap shows (e.g. a
    normalised effect whose sign differs from the raw one) so that both figures agree. A legend
    names the colours drawn with ``sign_labels`` (positive, negative; a colour no bar has is left
    out). The x axis holds every bar, whisker and 0 with a margin of 5% of their span."""
    from matplotlib.patches import Patch

    effects, ci = np.asarray(effects, dtype=float), np.asarray(ci, dtype=float)
    signs = effects if signs is None else np.asarray(signs, dtype=float)
    n = len(labels)
    fig = _figure(COLUMN_WIDTH, 1.2 + 0.17 * n)
    ax = fig.subplots()
    y = np.arange(n)
    err = np.where(np.isfinite(ci), np.abs(ci - effects[None]), 0.0) if np.isfinite(ci).any() else None
    ax.barh(
        y,
        effects,
        0.7,
        color=np.where(signs > 0, POSITIVE_COLOR, NEGATIVE_COLOR),
        xerr=err,
        capsize=1.5,
        error_kw={"lw": 0.6},
    )
    ax.axvline(0, color="black", lw=0.5)
    ends = np.concatenate([effects, ci[np.isfinite(ci)], [0.0]])  # bars, whiskers and the zero line
    pad = 0.05 * (float(ends.max() - ends.min()) or 1.0)
    ax.set_xlim(float(ends.min()) - pad, float(ends.max()) + pad)  # a bar's sticky 0 ended the axis on the frame
    ax.set_yticks(y, [f"{label_prefix}{label}" for label in labels])
    ax.invert_yaxis()
    ax.set_xlabel(ylabel)
    ax.set_title(title)
    handles = [Patch(color=POSITIVE_COLOR, label=sign_labels[0])] if (signs > 0).any() else []
    handles += [Patch(color=NEGATIVE_COLOR, label=sign_labels[1])] if (signs <= 0).any() else []
    handles.append(Patch(color="none", label=ci_label))
    fig.legend(handles=handles, loc="outside lower center", frameon=False, fontsize=5.5, ncols=1)
    return fig


def save_figure(
    fig: Figure, stem: str | Path, dpi: int = SAVE_DPI, formats: str | Sequence[str] | None = None
) -> list[Path]:
    """Write ``stem.png``, ``stem.pdf`` and ``stem.svg`` (:data:`FORMATS`) atomically, PDF fonts
    embedded as TrueType (:data:`_SAVE_RC`); returns the paths. ``formats`` (``"png"``, ``("png",
    "svg")``, ``"none"``; None: ``$HEADPROBE_FIGURE_FORMATS=png``, a comma-separated subset, or all
    three) writes only those, in this order: the PNG alone is the test suite's setting, as the PDF
    and SVG take two thirds of the writing time (:func:`~headprobe.analyses.vocabulary.figure_formats`).

    The figure's layout (matplotlib's constrained layout) is made once, for the PNG, and kept for
    the PDF and the SVG: it is a third of a figure's drawing time, and each format would redo it
    to within 0.01 in (its own text metrics). The figure keeps its layout engine afterwards.

    Raises:
        InputValueError: a ``formats`` not of png, pdf, svg or none (HeadprobeError: the same of
            ``$HEADPROBE_FIGURE_FORMATS``), before any file is written.
    """
    import matplotlib

    # no creation date in PDF and SVG: the same run gives the same bytes (clean diffs of figures/)
    metadata = {"pdf": {"CreationDate": None}, "svg": {"Date": None}}
    paths = []
    literal_text(fig)
    engine = fig.get_layout_engine()
    try:
        for i, ext in enumerate(figure_formats(formats)):
            path = Path(f"{stem}.{ext}")
            with atomic_path(path) as tmp, matplotlib.rc_context(_SAVE_RC):
                fig.savefig(tmp, format=ext, dpi=dpi, metadata=metadata.get(ext))
            paths.append(path)
            if i == 0 and engine is not None:
                fig.set_layout_engine("none")  # the axes stay where the first format's layout put them
    finally:
        if engine is not None:
            fig.set_layout_engine(engine)
    return paths


@_styled
def pruning_methods_plot(
    curves: Sequence[tuple[str, np.ndarray, dict[str, np.ndarray]]],
    bands: Sequence[tuple[str, np.ndarray, dict[str, np.ndarray]]],
    metrics: Sequence[tuple[str, str]],
    title: str,
    saved: tuple[str, float, dict[str, float]] | None = None,
    xlabel: str = "fraction of heads removed",
) -> Figure:
    """Loss against the fraction of heads removed for several pruning methods, one panel per metric.

    Args:
        curves: ``(label, fraction_pruned [n], {metric column: loss [n]})``, one line per method.
        bands: ``(label, fraction_pruned [n], {metric column: loss [seed, n]})``: drawn as the mean
            over seeds (a line) and the range over seeds (a shaded band), e.g. random orders.
        metrics: ``(column, panel y label)`` pairs.
        saved: ``(label, fraction_pruned, {metric column: loss})`` of one model measured on its own
            (e.g. the saved pruned model), drawn as a black star; None: none.
        xlabel: the x axis' label.
    """
    entries = len(curves) + len(bands) + (saved is not None)
    fig = _figure(COLUMN_WIDTH, 1.5 * len(metrics) + 0.6 + 0.12 * entries)  # the legend's rows under the panels
    axes = np.atleast_1d(fig.subplots(len(metrics), 1, sharex=True))
    styles = [("#0072B2", "o", "-"), ("#009E73", "^", "-."), ("#CC79A7", "D", ":"), ("#D55E00", "v", "-")]
    band_color = "#E69F00"
    reach = 0.0
    for ax, (col, ylabel) in zip(axes, metrics):
        for label, frac, losses in bands:
            y = np.asarray(losses[col], dtype=float)
            n = y.shape[0]
            ax.fill_between(frac, y.min(axis=0), y.max(axis=0), color=band_color, alpha=0.3, lw=0)
            ax.plot(
                frac,
                y.mean(axis=0),
                color=band_color,
                ls="--",
                lw=1,
                marker="s",  # the measured steps: with few, a bare dashed line read as data between them
                ms=2,
                label=f"{label} (mean, range of {n} seeds)" if n > 1 else f"{label} (1 seed)",
            )
            reach = max(reach, float(np.max(frac)))
        for (label, frac, losses), (color, marker, ls) in zip(curves, styles):
            ax.plot(frac, losses[col], color=color, marker=marker, ls=ls, ms=3, lw=1, label=label)
            reach = max(reach, float(np.max(frac)))
        if saved is not None and col in saved[2]:
            ax.plot([saved[1]], [saved[2][col]], ls="none", marker="*", ms=7, color="black", label=saved[0], zorder=5)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3, lw=0.4)
    # below the panels: inside the top one it covered the random band's upper edge (pruning_curve.png)
    fig.legend(*axes[0].get_legend_handles_labels(), frameon=False, fontsize=6, loc="outside lower center", ncols=1)
    axes[0].set_title(title)
    axes[-1].set_xlabel(xlabel)
    axes[-1].set_xlim(-0.02 * reach, 1.02 * reach)
    _fit_ylabels(fig, axes)
    return fig


@_styled
def per_layer_plot(
    layers: np.ndarray,
    clean: float,
    best_only: np.ndarray,
    worst_only: np.ndarray,
    layer_ablated: np.ndarray,
    best_head: np.ndarray,
    title: str,
    inverted: np.ndarray | None = None,
) -> Figure:
    """Michel et al. 2019's per-layer reduction: for each layer (x), the loss (nats/token) with
    that layer reduced to its best single head, to its worst single head, and with all its heads
    ablated, against the unpruned model's loss (a horizontal line); the best head's index is
    written along the top axis over its layer, clear of the markers (written beside each point, the
    other markers overprinted it). ``inverted`` (a bool per layer): the layers whose held-out best
    head lost more than their worst (the pick is noise there), drawn hollow and named in the legend."""
    fig = _figure(COLUMN_WIDTH, 2.4)
    ax = fig.subplots()
    ax.axhline(clean, color="black", lw=0.8, label="all heads")
    ax.plot(layers, layer_ablated, color="#D55E00", marker="x", ls="", ms=3, label="layer's heads all ablated")
    ax.plot(layers, worst_only, color="#E69F00", marker="s", ls="", ms=2.5, label="only its worst head kept")
    ax.plot(layers, best_only, color="#0072B2", marker="o", ls="-", ms=3, lw=0.8, label="only its best head kept")
    if inverted is not None and np.any(inverted):
        ax.plot(
            np.asarray(layers)[inverted],
            np.asarray(best_only)[inverted],
            color="#0072B2",
            marker="o",
            mfc="white",
            ls="",
            ms=3,
            label=f"best above worst, held out ({int(np.sum(inverted))} layers): pick is noise",
        )
    top = ax.secondary_xaxis("top")
    top.set_xticks(np.asarray(layers, dtype=float), [str(int(h)) for h in best_head])
    top.tick_params(length=0, pad=1.5, labelsize=4.5, labelcolor="#0072B2")
    top.set_xlabel("best head of the layer", fontsize=5.5, color="#0072B2")
    ax.set_xlabel("layer")
    ax.set_ylabel("held-out text loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3, lw=0.4)
    ax.legend(frameon=False, fontsize=5.5)
    return fig


CIRCUIT_INPUT_COLORS = {"q": "#0072B2", "k": "#D55E00", "v": "#009E73", "logits": "#CC79A7"}
"""Edge colours of :func:`circuit_graph` by the receiver's input (Okabe-Ito, colourblind-safe)."""
_CIRCUIT_BEND = {"q": 0.08, "k": 0.22, "v": 0.36, "logits": 0.15}
"""Arc of each input's edges, so that a sender's q, k and v edges into one receiver do not overlap."""


@_styled
def circuit_graph(
    edges: Sequence[tuple[tuple[int, int], tuple[int, int] | None, str, float]],
    n_layers: int,
    n_heads: int,
    title: str,
    score_label: str,
    checked: Sequence[bool] | None = None,
    exact: np.ndarray | Sequence[float] | None = None,
) -> Figure:
    """The top edges of a circuit as a graph: each head a node at (head, layer), the logits one node
    above the last layer, each edge ``(sender, receiver or None, input, score)`` an arrow from the
    sender to the receiver coloured by the receiver's input (:data:`CIRCUIT_INPUT_COLORS`), its width
    proportional to ``|score|``; a negative score is dashed and drawn in a paler tint of that colour
    (:data:`CIRCUIT_NEGATIVE_TINT`), both named in the legend. ``checked`` (one bool per edge): the
    edges whose effect exact path patching measured, drawn with a black outline (dashed on a dashed
    edge, so its gaps stay open) and counted in the legend ("outlined: ..."). Node labels sit in
    opaque white boxes above the edges, each beside its dot where no edge crosses it
    (:func:`_place_circuit_labels`); every node lies inside the axes with room for its label.
    ``exact`` (one float per edge, NaN where not measured; default: none): the edges' exact effects,
    which the widths do not show; the legend then calls the width an estimate and gives the largest
    exact effect of the outlined edges (``checked`` defaults to the finite ones), so a thin edge is
    not read as a small effect (16.0 -> 18.6:k, exact +1.47 nats/token, scored 0.35 by EAP-IG).

    Raises:
        ValueError: no edges.
    """
    import matplotlib.ticker

    if not edges:
        raise ValueError("circuit_graph needs at least one edge")
    fig = _figure(COLUMN_WIDTH, 3.6)
    ax = fig.add_subplot()
    top = max(abs(e[3]) for e in edges) or 1.0
    lowest = min(e[0][0] for e in edges)
    span = n_layers - lowest  # layers drawn, the logits' row included
    pad = max(0.4, 0.08 * span)  # about 0.2 in of the axes' 2.5 in at any number of layers
    logits_y = n_layers - 1 + max(1.5, 0.12 * span)
    where = lambda node: ((n_heads - 1) / 2, logits_y) if node is None else (node[1], node[0])
    labels = _circuit_nodes(ax, {e[0] for e in edges} | {e[1] for e in edges}, where)
    measured = None if exact is None else np.asarray(exact, dtype=float)
    if checked is None:
        checked = [False] * len(edges) if measured is None else [bool(f) for f in np.isfinite(measured)]
    checked = [bool(c) for c in checked]
    arrows = _circuit_edges(ax, edges, checked, where, top, labels)
    ax.set_xlim(-1.1, n_heads - 1 + 1.1)  # the outer columns' labels, beside their nodes, inside
    ax.set_ylim(max(-0.8, lowest - pad), logits_y + max(0.4, 0.128 * span))  # the layers the edges span; "logits" above
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_title(title)
    ax.yaxis.set_major_locator(
        matplotlib.ticker.FixedLocator(
            [
                t
                for t in matplotlib.ticker.MaxNLocator(integer=True).tick_values(max(0, lowest - 1), n_layers - 1)
                if t < n_layers
            ]
        )
    )
    ax.xaxis.set_major_locator(
        matplotlib.ticker.FixedLocator(
            [t for t in matplotlib.ticker.MaxNLocator(integer=True).tick_values(0, n_heads - 1) if 0 <= t < n_heads]
        )
    )
    fig.legend(
        handles=_circuit_handles(edges, checked, score_label, top, measured),
        loc="outside lower center",
        fontsize=5,
        frameon=False,
        ncols=2,
    )
    _place_circuit_labels(fig, ax, labels, arrows)
    return fig


PATH_PATCHING_SCORE_MARKER: dict[str, Any] = {
    "marker": "D",
    "color": "black",
    "markeredgecolor": "white",
    "markersize": 3.5,
}
"""How :func:`path_patching_bars` marks an edge's score (the estimate) on its exact effect's bar."""


@_styled
def path_patching_bars(
    panels: Sequence[tuple[str, Sequence[str], np.ndarray, np.ndarray, int]],
    title: str,
    score_label: str,
) -> Figure:
    """path_patching.png: per receiver one panel (``panels``: ``(receiver, senders, exact, score,
    n_senders)``, the senders drawn largest ``|exact|`` first, ``n_senders`` how many it was patched
    with) of horizontal bars of each sender's exact direct-path patching effect (nats/token, signed:
    red above zero, blue below, as :func:`effect_bars`), and the same edge's score (``score_label``,
    e.g. "EAP-IG score", an estimate of that effect in the same units) as a black diamond on the same
    axis (:data:`PATH_PATCHING_SCORE_MARKER`; none where NaN), so a bar running past its diamond is
    an underestimate. Each panel has its own x axis holding 0, every bar and every diamond; the
    legend lies below the panels.

    Raises:
        ValueError: no panels, or a panel without senders.
    """
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    if not panels or any(len(p[1]) == 0 for p in panels):
        raise ValueError("path_patching_bars needs at least one panel, each with at least one sender")
    rows = [len(p[1]) for p in panels]
    fig = _figure(COLUMN_WIDTH, 1.05 + sum(0.3 + 0.13 * n for n in rows))
    axes = fig.subplots(len(panels), 1, height_ratios=[0.3 / 0.13 + n for n in rows], squeeze=False)[:, 0]
    signs = []
    for ax, (receiver, senders, exact, score, n_senders) in zip(axes, panels):
        exact, score = np.asarray(exact, dtype=float), np.asarray(score, dtype=float)
        y = np.arange(len(senders))
        ax.barh(y, exact, 0.7, color=np.where(exact > 0, POSITIVE_COLOR, NEGATIVE_COLOR))
        finite = np.isfinite(score)
        ax.plot(score[finite], y[finite], linestyle="none", zorder=3, **PATH_PATCHING_SCORE_MARKER)
        ax.axvline(0, color="black", lw=0.5)
        ends = np.concatenate([exact, score[finite], [0.0]])
        pad = 0.06 * (float(ends.max() - ends.min()) or 1.0)
        ax.set_xlim(float(ends.min()) - pad, float(ends.max()) + pad)
        ax.set_ylim(len(senders) - 0.5, -0.5)  # the largest on top
        ax.set_yticks(y, list(senders))
        ax.tick_params(axis="y", length=0, pad=2)
        ax.set_title(f"into {receiver}: top {len(senders)} of {n_senders} senders by |exact effect|", fontsize=6.5)
        signs += [bool((exact > 0).any()), bool((exact <= 0).any())]
    axes[-1].set_xlabel("effect on the loss (nats/token; each panel its own scale)")
    fig.suptitle(title)
    handles = [Patch(color=POSITIVE_COLOR, label="bar: exact effect > 0 (path patched)")] if any(signs[0::2]) else []
    handles += (
        [Patch(color=NEGATIVE_COLOR, label="bar: exact effect \u2264 0 (path patched)")] if any(signs[1::2]) else []
    )
    marker = Line2D(
        [], [], linestyle="none", label=f"{score_label} of the same edge (its estimate)", **PATH_PATCHING_SCORE_MARKER
    )
    fig.legend(handles=[*handles, marker], loc="outside lower center", frameon=False, fontsize=5.5, ncols=1)
    return fig


CIRCUIT_NEGATIVE_TINT = 0.5
"""How far a negative edge's colour of :func:`circuit_graph` is mixed toward white (0: none, 1: white)."""


def _tint(color: str, amount: float = CIRCUIT_NEGATIVE_TINT) -> tuple[float, float, float]:
    """``color`` mixed ``amount`` of the way toward white."""
    import matplotlib.colors as mcolors

    rgb = np.asarray(mcolors.to_rgb(color))
    return tuple(float(c) for c in rgb + (1.0 - rgb) * amount)  # type: ignore[return-value]


CIRCUIT_NODE_SIZE = {"head": 30.0, "logits": 60.0}
"""Marker areas (points squared) of :func:`circuit_graph`'s head nodes and its logits node."""


def _node_radius(node) -> float:
    """The radius (points) of ``node``'s dot in :func:`circuit_graph` (None: the logits)."""
    return float(np.sqrt(CIRCUIT_NODE_SIZE["logits" if node is None else "head"])) / 2


def _circuit_nodes(ax, nodes, where) -> dict:
    """:func:`circuit_graph`'s nodes: a dot and a label (``L.H``, or ``logits`` for None) for each of
    ``nodes``, at ``where(node)``; dots above the edges, labels above both in opaque white boxes.
    Returns ``{node: its label (Text)}``."""
    labels = {}
    for node in nodes:
        x, y = where(node)
        ax.scatter([x], [y], s=CIRCUIT_NODE_SIZE["logits" if node is None else "head"], color="#333333", zorder=4)
        labels[node] = ax.annotate(
            "logits" if node is None else format_head(node),
            (x, y),
            xytext=(0, 5) if node is None else (4, 3),
            textcoords="offset points",
            fontsize=5.5,
            zorder=5,
            ha="center" if node is None else "left",
            va="bottom",
            bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none"},  # opaque: legible over edges
        )
    return labels


_CIRCUIT_DASHES = (0.0, (3.0, 2.0))
"""A negative edge's dash pattern (offset, on/off in points), the same for the line and its outline."""

CIRCUIT_NODE_CLEARANCE = 3.0
"""How far (points) an edge of :func:`circuit_graph` keeps from the rim of every dot but its own two,
and from every node label's box, where some arc allows it (:class:`_RoutedArc`)."""


class _RoutedArc:
    """A :func:`circuit_graph` edge's connection style: the quadratic arc of matplotlib's ``arc3``
    whose ``rad`` is the first of ``rads`` (the input's own bend first, then bends ever further from it,
    either side) whose path, in display space at draw time, stays :data:`CIRCUIT_NODE_CLEARANCE`
    points clear of every other node's dot (``dots``: ``(x, y, radius in points)`` in data
    coordinates), of every node label (``labels``: Text; its receiver's too, so no arrowhead
    hides under a label; not its sender's, which it leaves from) and inside the axes; where none does, the one that comes closest. A
    straight edge from 16.0 to 17.3 ran through 16.1 and 16.2, its arrowhead under "16.2"."""

    def __init__(self, ax, rads: Sequence[float], dots: Sequence[tuple[float, float, float]], labels: Sequence) -> None:
        self.ax, self.rads, self.dots, self.labels = ax, list(rads), list(dots), list(labels)
        self.chosen = self.rads[0]  # the bend of the last path drawn (:func:`_place_circuit_labels` keeps it)

    def clearance(self, path, skip_pt: float, boxes: Sequence) -> float:
        """The least room (points) between ``path`` (display space) and the dots, labels and
        frame less the clearance wanted (< 0: too close), ignoring its first and last ``skip_pt``;
        ``boxes``: the labels' display boxes (``labels``' ``get_window_extent``), measured by the caller."""
        from matplotlib.bezier import BezierSegment

        px = self.ax.figure.dpi / 72.0
        curve = BezierSegment(np.asarray(path.vertices))(np.linspace(0.0, 1.0, 64))
        ends = np.minimum(np.hypot(*(curve - curve[0]).T), np.hypot(*(curve - curve[-1]).T))
        curve = curve[ends > skip_pt * px]
        if not len(curve):
            return 0.0
        room = [np.inf]
        if self.dots:
            centres = self.ax.transData.transform([(x, y) for x, y, _ in self.dots])
            radii = np.array([r for _, _, r in self.dots]) * px
            gaps = np.hypot(curve[:, None, 0] - centres[None, :, 0], curve[:, None, 1] - centres[None, :, 1]) - radii
            room.append(float(gaps.min()))
        for box in boxes:
            dx = np.maximum(np.maximum(box.x0 - curve[:, 0], curve[:, 0] - box.x1), 0.0)
            dy = np.maximum(np.maximum(box.y0 - curve[:, 1], curve[:, 1] - box.y1), 0.0)
            inside = (dx == 0) & (dy == 0)
            room.append(float(np.where(inside, -1.0, np.hypot(dx, dy)).min()))
        frame = self.ax.bbox
        room.append(
            float(
                np.min([curve[:, 0] - frame.x0, frame.x1 - curve[:, 0], curve[:, 1] - frame.y0, frame.y1 - curve[:, 1]])
            )
        )
        return min(room) / px - CIRCUIT_NODE_CLEARANCE

    def connect(self, posA, posB):
        from matplotlib.patches import ConnectionStyle

        best, best_room = None, -np.inf
        # the labels stand still while one edge tries its bends: measured once (an annotation's box is
        # most of the time of a circuit figure with many edges), not once per bend
        boxes = [t.get_window_extent() for t in self.labels]
        for rad in self.rads:
            path = ConnectionStyle.Arc3(rad=rad).connect(posA, posB)
            room = self.clearance(path, skip_pt=_node_radius(None) + 1.0, boxes=boxes)
            if room >= 0:
                self.chosen = rad
                return path
            if room > best_room:
                best, best_room, self.chosen = path, room, rad
        return best

    def __call__(self, posA, posB, shrinkA=2.0, shrinkB=2.0, patchA=None, patchB=None):
        from matplotlib.patches import ConnectionStyle

        style = ConnectionStyle.Arc3()  # its clipping and shrinking, on this class's path
        style.connect = self.connect
        return style(posA, posB, shrinkA, shrinkB, patchA, patchB)


def _circuit_rads(bend: float, step: float = 0.12, furthest: float = 1.5) -> list[float]:
    """The bends :class:`_RoutedArc` tries for an edge of the input bent ``bend``: ``bend`` first, then
    ``bend`` +- ``step``, +- 2 ``step`` ... up to ``furthest`` from it."""
    out = [bend]
    for k in range(1, int(round(furthest / step)) + 1):
        out += [bend + k * step, bend - k * step]
    return out


def _circuit_edges(ax, edges: Sequence, checked: list[bool], where, top: float, labels: dict) -> list:
    """:func:`circuit_graph`'s arrows, the weakest first: coloured by the receiver's input (paler and
    dashed where negative), as wide as ``|score|`` against ``top``, outlined in black where ``checked``;
    each routed around the other nodes and every label (:class:`_RoutedArc`), its tip at its receiver's
    dot's rim (``labels``: ``{node: label}`` of :func:`_circuit_nodes`). Returns the arrows (FancyArrowPatch)."""
    import matplotlib.patheffects as pe
    from matplotlib.patches import FancyArrowPatch

    arrows = []
    for (sender, receiver, inp, score), ok in sorted(zip(edges, checked), key=lambda e: abs(e[0][3])):
        width = 0.4 + 2.6 * abs(score) / top
        negative = score < 0
        color = _tint(CIRCUIT_INPUT_COLORS[inp]) if negative else CIRCUIT_INPUT_COLORS[inp]
        outline: dict[str, Any] = {"dashes": {"dash_offset": 0.0, "dash_list": _CIRCUIT_DASHES[1]}} if negative else {}
        others = [(*where(n), _node_radius(n)) for n in labels if n != sender and n != receiver]
        clear = [t for n, t in labels.items() if n != sender]  # an edge leaves its sender under its label
        arrow = FancyArrowPatch(
            where(sender),
            where(receiver),
            arrowstyle="-|>",
            mutation_scale=6,
            connectionstyle=_RoutedArc(ax, _circuit_rads(_CIRCUIT_BEND[inp]), others, clear),  # type: ignore[arg-type]
            shrinkA=_node_radius(sender),
            shrinkB=_node_radius(receiver) + 0.5,  # the tip at the dot's rim, not under the dot
            color=color,
            linewidth=width,
            linestyle=_CIRCUIT_DASHES if negative else "-",
            alpha=0.9,
            zorder=2.5 if ok else 2,
            path_effects=[pe.Stroke(linewidth=width + 1.0, foreground="black", **outline), pe.Normal()] if ok else None,
        )
        arrows.append(ax.add_patch(arrow))
    return arrows


_CIRCUIT_LABEL_SPOTS = (
    ((4, 3), "left", "bottom"),
    ((-4, 3), "right", "bottom"),
    ((4, -3), "left", "top"),
    ((-4, -3), "right", "top"),
    ((0, 5), "center", "bottom"),
    ((0, -5), "center", "top"),
    ((6, 0), "left", "center"),
    ((-6, 0), "right", "center"),
    ((3, 6), "left", "bottom"),
    ((-3, 6), "right", "bottom"),
    ((3, -6), "left", "top"),
    ((-3, -6), "right", "top"),
    ((0, 8), "center", "bottom"),
    ((0, -8), "center", "top"),
    ((10, 0), "left", "center"),
    ((-10, 0), "right", "center"),
)
"""Where :func:`_place_circuit_labels` may put a head's label: ``(offset from the dot's centre in points,
ha, va)``, the first preferred (upper right); the logits' label tries "above" first."""


def _place_circuit_labels(fig: Figure, ax, labels: dict, arrows: Sequence, passes: int = 4) -> None:
    """Move each of :func:`circuit_graph`'s node ``labels`` (``{node: Text}``) to the first spot of
    :data:`_CIRCUIT_LABEL_SPOTS` whose box (widened by each edge's half width, its outline and 1 pt) no
    edge of ``arrows`` enters, off the other labels and dots and inside the axes; where none is free,
    the one crossed least. Labels over edges, even in opaque boxes, cut the edges and read as covered
    (23.2 and 27.1 of smollm2-135m sat on their own outgoing edges). Measured at :data:`SAVE_DPI` on the
    drawn (routed) edges; again after a move, since the edges are routed around the labels. After
    ``passes`` such passes each edge keeps the bend it has (a plain ``arc3``) and the labels are placed
    once more against those fixed edges, so a label never ends where a last re-routing put an edge."""
    from matplotlib.patches import ConnectionStyle

    with _at_save_dpi(fig) as canvas:
        for fixed in (False, True):
            for a in arrows if fixed else ():
                a.set_connectionstyle(ConnectionStyle.Arc3(rad=a.get_connectionstyle().chosen))
            for _ in range(passes):
                fig.draw_without_rendering()
                renderer = canvas.get_renderer()
                strokes = [(_stroke_points(ax, a), (a.get_linewidth() + 1.0) / 2 + 0.5) for a in arrows]
                boxes = {node: text.get_window_extent(renderer) for node, text in labels.items()}
                if not any(
                    [_relabel(ax, node, text, labels, strokes, renderer, boxes) for node, text in labels.items()]
                ):
                    break


def _stroke_points(ax, arrow, step_px: float = 1.0) -> np.ndarray:
    """A drawn FancyArrowPatch's outline (shaft and head, curves flattened) in display pixels, sampled
    every ``step_px``."""
    out = [np.zeros((0, 2))]
    for poly in arrow.get_path().to_polygons(ax.transData, closed_only=False):
        for a, b in zip(poly[:-1], poly[1:]):
            n = max(2, int(np.hypot(*(b - a)) / step_px) + 1)
            out.append(a + np.linspace(0, 1, n)[:, None] * (b - a))
    return np.concatenate(out)


def _relabel(ax, node, text, labels: dict, strokes: Sequence, renderer, boxes: dict) -> bool:
    """Put ``text`` (``node``'s label; None: the logits) at its least crossed spot (:func:`_place_circuit_labels`):
    cost 1 per edge sample under its box (``strokes``: ``(points, half width in points)``), 1,000 per other
    label it overlaps (5 one within 3 pt) or other dot within 4 pt, 10,000 outside the axes. True when it moved.
    ``boxes``: every label's display box as it stands (``{node: Bbox}``), this one's updated to where it ends
    (each label's measured once a pass, not again for every other label placed)."""
    px = ax.figure.dpi / 72.0
    frame = ax.get_window_extent(renderer)
    others = [boxes[n] for n in labels if n is not node]
    dots = ax.transData.transform([t.xy for n, t in labels.items() if n is not node]).reshape(-1, 2)
    spots = _CIRCUIT_LABEL_SPOTS if node is not None else (_CIRCUIT_LABEL_SPOTS[4], *_CIRCUIT_LABEL_SPOTS)
    now = (tuple(text.xyann), text.get_ha(), text.get_va())
    best, best_cost = now, np.inf
    for offset, ha, va in spots:
        text.xyann = offset
        text.set(ha=ha, va=va)
        b = text.get_window_extent(renderer)
        cost = sum(_points_in(b, p, w * px) for p, w in strokes) + 1_000 * _points_in(b, dots, 4 * px)
        cost += sum(1_000 if b.overlaps(o) else 5 * b.padded(3 * px).overlaps(o) for o in others)
        cost += 10_000 * (b.x0 < frame.x0 or b.x1 > frame.x1 or b.y0 < frame.y0 or b.y1 > frame.y1)
        if cost < best_cost:
            best, best_cost = (offset, ha, va), cost
        if cost == 0:
            break
    text.xyann = best[0]
    text.set(ha=best[1], va=best[2])
    boxes[node] = text.get_window_extent(renderer)
    return (tuple(best[0]), best[1], best[2]) != now


def _points_in(box, points: np.ndarray, margin: float) -> int:
    """How many of ``points`` (``[n, 2]``, display pixels) lie inside ``box`` widened by ``margin`` pixels."""
    x, y = points[:, 0], points[:, 1]
    inside = (box.x0 - margin < x) & (x < box.x1 + margin) & (box.y0 - margin < y) & (y < box.y1 + margin)
    return int(inside.sum())


def _circuit_handles(
    edges: Sequence, checked: list[bool], score_label: str, top: float, exact: np.ndarray | None = None
) -> list:
    """:func:`circuit_graph`'s legend entries: the inputs its ``edges`` go into, the two signs (each
    only where an edge has it), the width (``top``: the largest ``|score|``; "an estimate" where
    ``exact`` is given) and how many edges are ``checked`` (outlined), with the largest ``|exact|``
    of those (signed, in the score's unit) where ``exact`` has one."""
    import matplotlib.patheffects as pe
    from matplotlib.lines import Line2D

    handles = [
        Line2D([], [], color=c, label=f"into {k}" if k != "logits" else "into the logits")
        for k, c in CIRCUIT_INPUT_COLORS.items()
        if any(e[2] == k for e in edges)
    ]
    if any(e[3] >= 0 for e in edges):
        handles.append(Line2D([], [], color="#555555", label="positive: solid"))
    if any(e[3] < 0 for e in edges):
        handles.append(
            Line2D(
                [],
                [],
                color=_tint("#555555"),
                linestyle=_CIRCUIT_DASHES,
                label="negative: dashed, paler",
            )
        )
    named = re.fullmatch(r"(.*?) \(([^()]*)\)", score_label)  # the unit, "(nats/token)", outside |...|
    name, unit = named.groups() if named else (score_label, "")
    largest = f"largest {top:.3g}" + (f" {unit}" if unit else "")
    estimate = " (an estimate)" if exact is not None else ""
    handles.append(Line2D([], [], color="none", label=f"width: |{name}|{estimate}, {largest}"))
    outlined = f"outlined: checked by path patching ({sum(checked)} of {len(edges)})"
    known = np.array([]) if exact is None else exact[np.asarray(checked, dtype=bool) & np.isfinite(exact)]
    if known.size:
        biggest = float(known[np.argmax(np.abs(known))])
        outlined = f"outlined: path patched ({sum(checked)} of {len(edges)}),\nlargest exact effect {biggest:+.3g}" + (
            f" {unit}" if unit else ""
        )
    handles.append(
        Line2D(
            [],
            [],
            color="#666666",
            lw=1.5,
            path_effects=[pe.Stroke(linewidth=2.5, foreground="black"), pe.Normal()],
            label=outlined,
        )
    )
    return handles


_TOLERANCE_LINE = "--loss-tolerance {:g} nats/token (upper panel)"
"""The legend entry of :func:`kv_policy_curve`'s tolerance line."""


def _tolerance_flag(row: dict) -> str:
    """A curve row's ``within_tolerance`` as summary.json writes it: ``true``, ``false`` or ``null``
    (None, or NaN as pandas reads curve.csv's empty cell)."""
    flag = row["within_tolerance"]
    return "null" if flag is None or flag != flag else str(bool(flag)).lower()


def _tolerance_point(axes, rows: Sequence[dict], loss_tolerance: float | None) -> None:
    """:func:`kv_policy_curve`'s point of the policy ``--loss-tolerance`` chose (and the tolerance):
    in the upper panel with the 95% interval of its loss increase as whiskers (where the row has
    one), its legend entry ending in the row's ``within_tolerance`` (where the row has it)."""
    chosen = next((r for r in rows if r.get("target") == "loss_tolerance" and r["policy"] == "chosen"), None)
    if chosen is None:
        return
    color = "#D55E00"
    label = (
        f"chosen for --loss-tolerance {loss_tolerance:g} nats/token ({chosen['n_full_groups']} groups full)"
        if loss_tolerance is not None
        else f"chosen for the loss tolerance ({chosen['n_full_groups']} groups full)"
    )
    x, y = chosen["kv_fraction"], chosen["natural_loss_increase"]
    lo, hi = chosen.get("natural_loss_increase_ci95_lo", np.nan), chosen.get("natural_loss_increase_ci95_hi", np.nan)
    interval = bool(np.isfinite(lo) and np.isfinite(hi))
    if "within_tolerance" in chosen:
        what = "whiskers: its 95% interval" if interval else "no 95% interval"
        label += f",\n{what}; within_tolerance: {_tolerance_flag(chosen)}"
    if loss_tolerance is not None:  # in the legend too (kv_policy_curve takes the lower panel's entries and this)
        axes[0].axhline(loss_tolerance, color=color, lw=0.7, ls=":", label=_TOLERANCE_LINE.format(loss_tolerance))
    marker: dict[str, Any] = {"color": color, "ms": 5, "mec": "black", "mew": 0.5, "label": label}
    if interval:  # one errorbar artist, the diamond and its whisker: the legend's glyph shows both
        bars = axes[0].errorbar(
            [x], [y], yerr=[[max(y - lo, 0.0)], [max(hi - y, 0.0)]], fmt="D", lw=0.9, capsize=2, **marker
        )
        bars.lines[2][0].set_gid("tolerance_interval")
    else:
        axes[0].plot([x], [y], "D", **marker)
    axes[1].plot([x], [chosen["copy_accuracy"]], "D", **marker)


def _uniform_windows(rows: Sequence[dict]) -> str:
    """The uniform entry's end, a comma and a second line ``W' = 504, 1016 tokens, left to right``: the
    uniform rows' ``uniform_window`` (curve.csv's column, tokens; ``full`` where the control is the full
    cache) in the order of their KV fractions (one row: ``W' = 504 tokens``, no order to give); ""
    where the rows have no such column (a curve.csv written before it)."""
    if not rows or not any("uniform_window" in r for r in rows):
        return ""
    ws = [r.get("uniform_window") for r in sorted(rows, key=lambda r: r["kv_fraction"])]
    order = ", left to right" if len(ws) > 1 else ""
    return ",\nW' = " + ", ".join("full" if w is None or w != w else f"{int(w)}" for w in ws) + f" tokens{order}"


@_styled
def kv_policy_curve(
    rows: Sequence[dict], title: str, loss_tolerance: float | None = None, subtitle: str | None = None
) -> Figure:
    """Quality against KV memory for head-level KV policies (``headprobe kv``): natural-text loss
    increase (nats/token) and long-range copy accuracy against the cache's fraction of the full
    one, for the chosen policy, one window W' on every group sized to the same KV memory (uniform)
    and random groups (mean over seeds, whiskers and their legend glyph their range, only where a
    budget has several seeds) at each budget. The chosen and uniform lines carry a band: curve.csv's
    95% paired interval against the full cache (the loss increase's; the copy accuracy's is the full
    cache's accuracy minus the drop's interval, clipped to [0, 1]); a row without one is named in the
    legend (no interval drawn), never left bare silently (:func:`_kv_bands`). ``subtitle`` (the sample
    sizes) is set over the upper panel in small type, ``title`` above it as the figure's title. ``rows`` as :func:`headprobe.analyses.kvpolicy.curve_row`;
    a row with ``target == "loss_tolerance"`` (the policy ``--loss-tolerance`` chose, and its
    controls) is not on the budget lines: its chosen policy is drawn as its own labelled point and
    ``loss_tolerance`` (nats/token) as a dotted line. The uniform entry lists each budget's ``W'``
    (tokens, left to right) where the rows have curve.csv's ``uniform_window``. Where the budgets lie close
    together far from the full cache (:func:`_kv_broken_axes`), the x axis is broken: the budgets spread
    over the wide panels, the full cache in a narrow pair at its right."""
    fig = _figure(COLUMN_WIDTH, 4.0 if subtitle is None else 4.7)
    full = next((r for r in rows if r["policy"] == "full"), None)
    axes, ends = _kv_axes(fig, rows, full)
    styles = {
        "chosen": ("#0072B2", "o", "chosen groups full"),
        "uniform": ("#E69F00", "s", "uniform: one window W' on every group, same KV memory"),  # + W' where known
        "random": ("#009E73", "^", "random groups full"),
    }
    on_curve = [r for r in rows if r.get("target") != "loss_tolerance"]
    for kind, (color, marker, label) in styles.items():
        sel = [r for r in on_curve if r["policy"] == kind]
        label += _uniform_windows(sel) if kind == "uniform" else ""
        budgets = sorted({r["budget"] for r in sel})
        # whiskers (and their legend glyph) only where a budget has several runs (random seeds) to span
        spread = any(sum(r["budget"] == b for r in sel) > 1 for b in budgets)
        for ax, key in zip(axes, ("natural_loss_increase", "copy_accuracy")):
            x = np.array([np.mean([r["kv_fraction"] for r in sel if r["budget"] == b]) for b in budgets])
            vals = [np.array([r[key] for r in sel if r["budget"] == b]) for b in budgets]
            y = np.array([v.mean() for v in vals])
            if not spread:
                ax.plot(x, y, color=color, marker=marker, ms=3, lw=0.9, label=label)
                continue
            err = np.array([[y_ - v.min() for y_, v in zip(y, vals)], [v.max() - y_ for y_, v in zip(y, vals)]])
            n_seeds = max(sum(r["budget"] == b for r in sel) for b in budgets)
            ax.errorbar(
                x,
                y,
                yerr=err,
                color=color,
                marker=marker,
                ms=3,
                lw=0.9,
                capsize=2,
                label=f"{label} (whiskers: range over {n_seeds} seeds)",
            )
    band_entries = _kv_bands(axes, on_curve, full, {k: v[0] for k, v in styles.items()})
    _tolerance_point(axes, rows, loss_tolerance)
    for pair in (axes, ends) if ends else (axes,):
        if full is not None:
            pair[1].axhline(full["copy_accuracy"], color="black", lw=0.6, ls="--")
            pair[0].plot([full["kv_fraction"]], [0.0], "k*", ms=6)
            pair[1].plot([full["kv_fraction"]], [full["copy_accuracy"]], "k*", ms=6, label="full cache")
        pair[0].axhline(0, color="black", lw=0.6, ls="--")
    if ends:
        _kv_break(axes, ends, rows, full, loss_tolerance)
    axes[0].set_ylabel("natural-text loss\nincrease (nats/token)")
    axes[1].set_ylabel("long-range copy\naccuracy (top-1)")
    axes[1].set_xlabel("KV cache (fraction of the full cache)")
    if subtitle is None:
        axes[0].set_title(title)
    else:  # the title over the figure, the sample sizes over the upper panel in small type
        fig.suptitle(title, fontsize=_RC["axes.titlesize"])
        axes[0].set_title(subtitle, fontsize=5.5)
    _kv_legend(fig, axes, band_entries)
    return fig


def _kv_broken_axes(rows: Sequence[dict], full: dict | None) -> bool:
    """Whether :func:`kv_policy_curve` breaks its x axis: the KV fractions of the rows but the full cache's
    span less than a third of their gap to the full cache (``--loss-tolerance`` 0.0572 at 256 tokens: budgets
    0.703-0.733 and the full cache at 1.0 drew every band in the left tenth of the axis, one strip over another)."""
    xs = [r["kv_fraction"] for r in rows if r["policy"] != "full"]
    if full is None or not xs or max(xs) <= min(xs):
        return False
    return full["kv_fraction"] - max(xs) > 3 * (max(xs) - min(xs))


def _kv_axes(fig: Figure, rows: Sequence[dict], full: dict | None) -> tuple[list, list]:
    """:func:`kv_policy_curve`'s upper and lower panels (sharing x), and where the x axis is broken
    (:func:`_kv_broken_axes`) a narrow pair at their right for the full cache, each sharing its row's y
    (else no pair). The wide panels are ``fig.axes[0]`` and ``[1]``."""
    if not _kv_broken_axes(rows, full):
        return list(fig.subplots(2, 1, sharex=True)), []
    grid = fig.add_gridspec(2, 2, width_ratios=(6, 1))
    upper = fig.add_subplot(grid[0, 0])
    lower = fig.add_subplot(grid[1, 0], sharex=upper)
    end_upper = fig.add_subplot(grid[0, 1], sharey=upper)
    end_lower = fig.add_subplot(grid[1, 1], sharey=lower, sharex=end_upper)
    for ax in (upper, end_upper):
        ax.tick_params(labelbottom=False)
    return [upper, lower], [end_upper, end_lower]


def _kv_break(axes, ends, rows: Sequence[dict], full: dict | None, loss_tolerance: float | None) -> None:
    """The broken x axis of :func:`kv_policy_curve`: the wide panels (``axes``) span the rows' KV fractions
    but the full cache's (5% margins), the narrow ones (``ends``) the full cache's (1.0 +- 0.02), with the
    tolerance line across both and the broken-axis marks between (:func:`_break_marks`). Nothing moves:
    each mark is at its own KV fraction."""
    xs = [r["kv_fraction"] for r in rows if r["policy"] != "full"]
    margin = 0.05 * (max(xs) - min(xs))
    axes[0].set_xlim(min(xs) - margin, max(xs) + margin)
    at = full["kv_fraction"] if full is not None else 1.0
    ends[0].set_xlim(at - 0.02, at + 0.02)
    ends[1].set_xticks([at], [f"{at:.1f}"])  # as the wide panels' ticks read (1.0, not 1)
    if loss_tolerance is not None:
        ends[0].axhline(loss_tolerance, color="#D55E00", lw=0.7, ls=":")
    for pair in zip(axes, ends):
        _break_marks(pair)


def _kv_legend(fig: Figure, axes, extra: list[tuple[Any, str]]) -> None:
    """:func:`kv_policy_curve`'s legend below both panels: the lower panel's entries, the upper panel's
    tolerance line, then ``extra`` (the bands' entries, :func:`_kv_bands`), in one column."""
    from matplotlib.container import ErrorbarContainer
    from matplotlib.legend_handler import HandlerErrorbar

    handles, labels = axes[1].get_legend_handles_labels()
    upper = dict(zip(*reversed(axes[0].get_legend_handles_labels())))
    # the glyph with whiskers where only the upper panel draws them (the --loss-tolerance point's interval),
    # whiskers long enough to show past the diamond (matplotlib's default, half the font size, hides them)
    only_upper = {
        t: upper[t]
        for h, t in zip(handles, labels)
        if isinstance(upper.get(t), ErrorbarContainer) and not isinstance(h, ErrorbarContainer)
    }
    handles = [only_upper.get(t, h) for h, t in zip(handles, labels)]
    tolerance = [(h, t) for h, t in zip(*axes[0].get_legend_handles_labels()) if t.startswith("--loss-tolerance ")]
    handles, labels = handles + [h for h, _ in tolerance], labels + [t for _, t in tolerance]
    handles, labels = handles + [h for h, _ in extra], labels + [t for _, t in extra]
    # one column: the uniform entry and the tolerance point's are long (two columns ran past the figure's edges)
    fig.legend(
        handles,
        labels,
        loc="outside lower center",
        frameon=False,
        fontsize=5.5,
        ncols=1,
        handler_map={h: HandlerErrorbar(yerr_size=1.0) for h in only_upper.values()},
    )


_KV_BAND_KEYS = {"natural_loss_increase": "natural loss", "copy_accuracy_drop": "copy accuracy"}


def _kv_bands(axes, rows: Sequence[dict], full: dict | None, colors: dict[str, str]) -> list[tuple[Any, str]]:
    """:func:`kv_policy_curve`'s 95% bands of the chosen and uniform policies (``rows`` on the budget
    lines, curve.csv's ``*_ci95_lo/hi``): the natural loss increase's interval in the upper panel; in
    the lower one the copy accuracy's, ``full`` accuracy minus the drop's interval (paired, against the
    full cache), clipped to [0, 1]. Returns the legend entries (handle, text): the band's meaning, and a
    line naming the quantities of rows with no interval (NaN or absent: too few samples), so that a bare
    line is never silent."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    missing: dict[str, list[str]] = {}
    drawn = False
    for kind in ("chosen", "uniform"):
        sel = sorted((r for r in rows if r["policy"] == kind), key=lambda r: r["kv_fraction"])
        for ax, key in zip(axes, _KV_BAND_KEYS):
            if not sel or (key == "copy_accuracy_drop" and full is None):
                continue
            lo = np.array([float(r.get(f"{key}_ci95_lo", np.nan)) for r in sel])
            hi = np.array([float(r.get(f"{key}_ci95_hi", np.nan)) for r in sel])
            if not np.isfinite(lo + hi).all():
                missing.setdefault(_KV_BAND_KEYS[key], []).append(kind)
            if key == "copy_accuracy_drop" and full is not None:
                lo, hi = np.clip(full["copy_accuracy"] - hi, 0, 1), np.clip(full["copy_accuracy"] - lo, 0, 1)
            x = np.array([r["kv_fraction"] for r in sel])
            ok = np.isfinite(lo + hi)
            if ok.any():
                ax.fill_between(x, lo, hi, where=ok, color=colors[kind], alpha=0.18, lw=0, gid=f"band:{kind}")
                for edge in (lo, hi):  # the band's edges in its policy's colour: overlapping bands stay apart
                    ax.plot(x[ok], edge[ok], color=colors[kind], lw=0.4, alpha=0.7)
                drawn = True
    entries: list[tuple[Any, str]] = []
    if drawn:
        entries.append(
            (
                Patch(facecolor="0.6", alpha=0.4, lw=0),
                "bands: 95% paired interval against the full cache (chosen, uniform)",
            )
        )
    if missing:
        what = "; ".join(f"{q} ({', '.join(kinds)})" for q, kinds in missing.items())
        entries.append((Line2D([], [], color="none"), f"no 95% interval (too few samples):\n{what}"))
    return entries
