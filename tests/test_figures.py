"""Figures show what was measured: unmeasured heads apart from every colour, axes fitted to the
run, special tokens readable. Checked on the matplotlib objects, not on pixels."""

from __future__ import annotations

import re
from types import SimpleNamespace

import matplotlib.colors
import numpy as np
import torch

from headprobe.analyses import figures as figs
from headprobe.analyses.scoring import LABEL_CHARS, token_labels


def test_unmeasured_heads_are_grey_and_named_in_the_colour_bar():
    values = np.array([[0.5, -0.2, np.nan], [np.nan, 0.0, 0.1]])
    fig = figs.signed_head_heatmap(values, "effect", "Δ loss")
    (ax, cax) = fig.axes
    image = ax.images[0]
    assert matplotlib.colors.to_hex(image.cmap.get_bad()) == figs.NOT_MEASURED_COLOR
    # grey is on neither end nor in the middle (white: zero effect) of the diverging scale
    scale = [matplotlib.colors.to_hex(image.cmap(x)) for x in np.linspace(0, 1, 257)]
    assert figs.NOT_MEASURED_COLOR not in scale
    assert "not measured" in cax.get_ylabel()
    full = figs.signed_head_heatmap(np.nan_to_num(values), "effect", "Δ loss")
    assert "not measured" not in full.axes[1].get_ylabel()


def test_pruning_axis_ends_where_the_run_stopped():
    frac = np.array([0.0, 0.1, 0.2])
    curves = [(order, frac, {"loss": np.array([3.0, 3.1, 3.4])}) for order in ("importance", "random")]
    lo, hi = figs.pruning_curve_plot(curves, [("loss", "loss")], "t").axes[-1].get_xlim()
    assert lo < 0 < 0.2 < hi < 0.21


class _Tokenizer:
    all_special_ids = [0]
    words = {0: "<|im_start|>", 1: "Instrumentation", 2: "why", 3: "\n"}

    def decode(self, ids):
        return self.words[ids[0]]


def test_token_labels_keep_special_tokens_whole_and_mark_cuts():
    labels = token_labels(SimpleNamespace(tokenizer=_Tokenizer()), torch.tensor([0, 1, 2, 3]))
    assert labels == ["<|im_start|>", "Instrumen…", "why", "\\n"]
    assert all(len(s) <= LABEL_CHARS for s in labels[1:])


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
    assert subtypes & {b"TrueType", b"CIDFontType2"}  # TrueType outlines (matplotlib's fonttype 42: a CID TrueType font)
