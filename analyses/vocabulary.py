"""The names the command line checks before torch loads: the verification's design choices and
defaults, the pruning methods (and which per-layer picks are noise), the gradient estimators, the
figure formats; and, re-exported from :mod:`headprobe.analyses.columns` (the head columns'
registry), the head types and tasks.
Torch-free (``headprobe scan -k -3`` is refused in a fraction of a second); the modules that
implement each name import theirs from here.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any

from headprobe.analyses.columns import HEAD_TYPES, TASKS, select_head_types  # noqa: F401 - the head columns' names, defined there
from headprobe.probe.core.errors import HeadprobeError, InputValueError, one_line_repr
from headprobe.probe.core.registry import did_you_mean

PRUNING_METHODS: tuple[str, ...] = ("michel", "l0", "random")
"""The pruning methods ``headprobe prune --method`` compares: Michel et al. 2019's iterative gradient
importance (:func:`headprobe.analyses.pruning.iterative_pruning`, ``order="importance"``), Voita et
al. 2019's L0 head gates (:func:`headprobe.analyses.pruning.l0_pruning`) and a seeded random order."""
PRUNING_ORDERS: tuple[str, ...] = ("importance", "random")
"""The orders :func:`headprobe.analyses.pruning.iterative_pruning` removes heads in."""
ESTIMATORS: tuple[str, ...] = ("atp", "attribution", "gradient", "second-order")
"""``headprobe ablate --estimate`` choices (:mod:`headprobe.analyses.attribution`): ``atp`` AtP* with
GradDrop (Kramár et al. 2024; unsigned, signed by attribution patching), ``attribution`` plain
attribution patching (signed), ``gradient`` Michel et al. 2019's importance (unsigned),
``second-order`` attribution patching plus the Monte-Carlo Gauss-Newton curvature term (signed)."""

SEED_MAX = 2**32 - 1
"""The largest seed a command takes: numpy's legacy ``RandomState`` range, which leaves room below
torch's limit (``manual_seed`` takes at most 2**64 - 1) for the offsets commands add (``seed + 11``);
numpy's ``default_rng`` refuses a negative seed."""


def seed_error(value: object) -> str | None:
    """Why ``value`` is not a seed (an integer from 0 to :data:`SEED_MAX`), or None where it is one."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return f"must be an integer from 0 to {SEED_MAX}, got {value!r}"
    if not 0 <= int(value) <= SEED_MAX:
        return f"must be from 0 to {SEED_MAX}, got {value}"
    return None


ALPHA = 0.05
"""The default significance level of the verdicts (``--alpha``)."""
CONTROLS = ("layer-matched", "uniform")
"""How control sets are drawn (``--control``)."""
CORRECTIONS = ("bh", "holm")
"""Multiple-testing corrections (``--correction``): Benjamini-Hochberg (false discovery rate) and
Holm-Bonferroni (family-wise error)."""
CORRECTION = "bh"
"""The default correction."""
PRIMARY_KIND = "mean"
"""The ablation kind each verdict is tested with; the other kind is reported beside it."""
DEFAULT_SEQ_LEN = 128
"""Natural-text tokens per sequence (``--seq-len``) unless the model's context is shorter
(:func:`headprobe.analyses.data.fit_lengths`)."""
DEFAULT_PERIOD = 50
"""The repeated block's length (``--period``) unless ``[BOS]`` and two blocks do not fit the
model's context (:func:`headprobe.analyses.data.fit_lengths`)."""


def fitted_seq_len(n_ctx: int, seq_len: int | None) -> int:
    """Natural-text tokens per sequence for a model of context ``n_ctx`` tokens: ``seq_len`` where
    given, else :data:`DEFAULT_SEQ_LEN` or ``n_ctx`` if shorter. The one rule, torch-free:
    :func:`headprobe.analyses.data.fit_lengths` after the load, ``import``'s check before it
    (``n_ctx`` from config.json). Checks nothing (:func:`~headprobe.analyses.data.check_lengths` does)."""
    return seq_len or min(DEFAULT_SEQ_LEN, n_ctx)


DEFAULT_PATTERN_LEN = 128
"""Tokens of every head's pattern kept for the viewer (``--pattern-len``)."""
PATCH_SITES: tuple[str, ...] = ("z", "q", "k", "v", "resid")
"""Where ``headprobe patch --site`` patches (:data:`headprobe.analyses.patching.SITES`): a head's
``z`` (its output, before W_O), its query, key or value input, or the residual stream entering a
layer at one position."""
MIN_N_FOR_CI = 2
"""Intervals over sequences or prompt pairs (:func:`headprobe.analyses.statistics.mean_ci`, a
Student-t interval) are given from this many up; one has none."""
FIGURE_FORMATS: tuple[str, ...] = ("png", "pdf", "svg")
"""Every format a figure is written in (:func:`headprobe.analyses.figures.save_figure`), in order."""
NO_FIGURES = "none"
"""``--formats none``: write no figures (tables and summary only)."""
FIGURE_FORMATS_ENV = "HEADPROBE_FIGURE_FORMATS"
"""The environment variable that narrows :data:`FIGURE_FORMATS` (:func:`figure_formats`)."""

MIN_PERIOD = 3
"""The shortest repeated block: the induction target (the token after a query's earlier occurrence,
offset ``1 - S``) is the query itself at ``S = 1`` and its previous token at ``S = 2``, where a
previous-token head would score as an induction head."""
PERIOD_TARGET = {1: "the token itself", 2: "its previous token"}
MIN_SEQ_LEN = 4
"""The shortest natural-text window (positions, BOS or ``[CLS]`` and ``[SEP]`` included) on which the
head types' scores differ by construction (:mod:`headprobe.analyses.detectors`: each reads queries
``1 ..``). Below it two types read the same key at every query they score (:data:`SEQ_LEN_CLASH`),
so their columns are one number twice, as a period under :data:`MIN_PERIOD` makes induction a
previous-token score."""
SEQ_LEN_CLASH = {
    2: "the previous-token and first-token scores read query 1 alone, whose previous token is position 0",
    3: "the next-token and last-token scores read query 1 alone, whose next token is the last",
}
MIN_WINDOW_TOKENS = 2
"""The fewest text tokens of a natural-text window (BOS, ``[CLS]`` and ``[SEP]`` not counted): a
window of one token is all one token, more than :data:`headprobe.analyses.data.MAX_ONE_TOKEN_SHARE`,
and :func:`headprobe.analyses.data.natural_text_tokens` leaves every such window out, so a shorter
window draws no text and gives no loss (the floor of ``--seq-len`` in ``ablate``, ``prune``,
``import`` and, with its planted blocks, ``kv``)."""


def figure_formats(formats: str | Sequence[str] | None = None) -> tuple[str, ...]:
    """The formats figures are written in, in :data:`FIGURE_FORMATS` order: those ``formats`` names
    (a Python caller's ``save(path, formats=...)``: comma-separated names, case ignored, or a
    sequence of them; ``"none"`` (:data:`NO_FIGURES`) or ``()``: no figures), or, where it is None,
    :data:`FIGURE_FORMATS` or those named in ``$HEADPROBE_FIGURE_FORMATS`` (comma-separated, e.g.
    ``png``: a third of the writing time; ``none``, alone: no figures at all, the empty tuple --
    tables and summary only; the test suite's default, as drawing is most of a small model's run;
    ``--formats`` sets it for a command's run). Unset or empty: all.

    Raises:
        InputValueError: ``formats`` is not a string or a sequence of strings, names no format, one that is not in :data:`FIGURE_FORMATS`
            (the line names the closest), or ``none`` with another.
        HeadprobeError: the same of ``$HEADPROBE_FIGURE_FORMATS`` (``formats`` None).
    """
    import os

    if formats is None:
        asked = parse_figure_formats(os.environ.get(FIGURE_FORMATS_ENV, ""), FIGURE_FORMATS_ENV + "=")
        return FIGURE_FORMATS if asked is None else asked
    if not isinstance(formats, str) and not (
        isinstance(formats, Sequence) and all(isinstance(f, str) for f in formats)
    ):
        raise InputValueError(
            f"formats={one_line_repr(formats)}: give a string or a sequence of strings, e.g. formats='png' or ('png', 'pdf')"
        )
    if not isinstance(formats, str) and not formats:
        return ()  # formats=(): no figures
    text = formats if isinstance(formats, str) else ",".join(formats)
    asked = parse_figure_formats(text, "formats=", error=InputValueError, shown=one_line_repr(formats))
    if asked is None:
        raise InputValueError(
            f"formats={one_line_repr(formats)}: choose from {', '.join(FIGURE_FORMATS)} (comma-separated) or {NO_FIGURES}"
        )
    return asked


def parse_figure_formats(
    text: str, source: str, *, error: type[HeadprobeError] = HeadprobeError, shown: str | None = None
) -> tuple[str, ...] | None:
    """``text`` (comma-separated names, case ignored) as formats in :data:`FIGURE_FORMATS` order;
    ``()`` for ``none``; None when ``text`` names nothing. ``source`` (``--formats ``,
    ``HEADPROBE_FIGURE_FORMATS=`` or ``formats=``) and ``shown`` (what was given; None:
    ``repr(text)``) start the error line, raised as ``error``.

    Raises:
        HeadprobeError: (``error``) an unknown name, or ``none`` with another.
    """
    shown = repr(text) if shown is None else shown
    asked = [f.strip().lower() for f in text.split(",") if f.strip()]
    if not asked:
        return None
    if NO_FIGURES in asked:
        if len(asked) > 1:
            raise error(f"{source}{shown}: {NO_FIGURES!r} (no figures) cannot be combined with a format")
        return ()
    unknown = [f for f in asked if f not in FIGURE_FORMATS]
    if unknown:
        raise error(
            f"{source}{shown}: unknown figure format {unknown[0]!r}{did_you_mean(unknown[0], FIGURE_FORMATS)}; choose from "
            f"{', '.join(FIGURE_FORMATS)} (comma-separated) or {NO_FIGURES}"
        )
    return tuple(f for f in FIGURE_FORMATS if f in asked)


MAX_N_RANDOM = 100_000
"""The most control sets one verdict's test may draw (``--n-random``, or the draws an ``--alpha`` needs):
a p-value's resolution is ``1 / (n + 1)``, each set is one ablation pass, and the sets are drawn up front
(a larger count filled the memory of a 24 GiB machine before the plan was printed)."""


def check_n_random(n_random: int) -> None:
    """Refuse ``--n-random`` above :data:`MAX_N_RANDOM`.

    Raises:
        HeadprobeError: more control sets than that.
    """
    if n_random > MAX_N_RANDOM:
        raise HeadprobeError(
            f"--n-random must be at most {MAX_N_RANDOM:,} (a p-value resolves 1/(n+1); each set is one ablation "
            f"pass), got {n_random:,}"
        )


def check_verification_choices(alpha: float, control: str, correction: str) -> None:
    """The checks of ``--alpha``, ``--control`` and ``--correction`` (scan's config and the
    verification's settings share them).

    Raises:
        HeadprobeError: alpha outside (0, 1), or a control design or correction not in its list.
    """
    if not 0 < alpha < 1:
        raise HeadprobeError(f"--alpha must be between 0 and 1 (exclusive), got {alpha}")
    if control not in CONTROLS:
        raise HeadprobeError(
            f"--control must be one of {', '.join(CONTROLS)}, got {control!r}{did_you_mean(str(control), CONTROLS)}"
        )
    if correction not in CORRECTIONS:
        raise HeadprobeError(
            f"--correction must be one of {', '.join(CORRECTIONS)}, got {correction!r}{did_you_mean(str(correction), CORRECTIONS)}"
        )


@functools.lru_cache(maxsize=256)
def exact_level(alpha: float) -> Fraction:
    """``alpha`` as the exact rational of its shortest decimal (``0.072`` -> 72/1000, not the binary
    float nearest to it): the level the user typed, for the integer rules that compare draws with
    it (``floor(alpha * n)``, ``1 / (n + 1) <= alpha``), which floating point gets wrong at exact ties."""
    return Fraction(repr(float(alpha)))


LEVEL_RTOL = 1e-12
"""The relative slack of ``p <= alpha`` for a p-value computed in floating point (an adjusted
``m p / k``, a few roundings of 1e-16 each): relative, not absolute, so a level of 1e-7 is not
widened by 1e-12 (10 ppm); exact rationals of the sizes a run has differ from ``alpha`` by more."""


def within_level(p, alpha: float):
    """``p <= alpha`` up to floating-point rounding (:data:`LEVEL_RTOL`); ``p`` a float or an array."""
    return p <= alpha * (1 + LEVEL_RTOL)


def reachable(n_random: int, alpha: float) -> bool:
    """Whether ``n_random`` Monte Carlo draws can give a p-value at or below ``alpha``: ``1 /
    (n_random + 1) <= alpha``, i.e. at least ``1 / alpha - 1`` draws (exactly, :func:`exact_level`)."""
    return Fraction(1, n_random + 1) <= exact_level(alpha)


def lone_draws_needed(m: int, alpha: float) -> int:
    """The fewest control sets with which one test of a family of ``m`` can be confirmed on its
    own under BH or Holm: a lone rejection needs ``p <= alpha / m``, and the smallest exact Monte
    Carlo p-value of n draws is ``1 / (n + 1)``, so ``n >= m / alpha - 1`` (39 for m = 2 at
    alpha 0.05, 99 for m = 5)."""
    return max(1, math.ceil(max(m, 1) / exact_level(alpha)) - 1)


def together_draws_needed(m: int, alpha: float, correction: str) -> int:
    """The fewest control sets with which all ``m`` tests of a family can be confirmed together (each at its
    smallest p-value ``1 / (n + 1)``): under BH all m at ``p <= alpha`` are rejected together, so ``n >= 1 /
    alpha - 1`` (19 at alpha 0.05); Holm compares the smallest p with ``alpha / m`` whatever the others are, so
    its number is the lone one (:func:`lone_draws_needed`, 99 for five tests)."""
    if correction == "holm":
        return lone_draws_needed(m, alpha)
    return max(1, math.ceil(1 / exact_level(alpha)) - 1)


def draws_advice(alpha: float, tests: int = 1, correction: str = "") -> str:
    """``use --n-random 19 or more ...``: the draws a family of ``tests`` verdicts under ``correction`` needs,
    explained: the number for all confirmed together (BH) and the number for one on its own, or one number
    where they agree (one test, or Holm)."""
    together, lone = together_draws_needed(tests, alpha, correction), lone_draws_needed(tests, alpha)
    if lone <= together:
        why = f"p <= {alpha:g}" if tests <= 1 else f"{correction} compares the smallest p with {alpha:g}/{tests}"
        return f"use --n-random {lone} or more ({why})"
    return (
        f"use --n-random {together} or more, enough under {correction} when the {tests} tests are CONFIRMED "
        f"together (each p <= {alpha:g}); {lone} or more for one verdict on its own (p <= {alpha:g}/{tests})"
    )


def unreachable_note(n_random: int, alpha: float, tests: int = 1, correction: str = "") -> str | None:
    """The one line said before a verification whose draws cannot reach ``alpha`` (None if they can):
    what the draws allow, and the draws ``tests`` verdicts under ``correction`` need (:func:`draws_advice`)."""
    alone = reachable(n_random, alpha)  # one test could reach alpha: the correction over the family cannot
    if alone and n_random >= together_draws_needed(tests, alpha, correction):
        return None
    return (
        f"--n-random {n_random} cannot reach alpha {alpha:g} (the smallest p-value of {n_random} draws is "
        f"1/{n_random + 1} = {1 / (n_random + 1):.3f}"
        + (f", and {correction} over {tests} tests needs <= {alpha:g}/{tests}" if alone else "")
        + "): no verdict can be CONFIRMED; the ablations still run and report their p-values; "
        + draws_advice(alpha, tests, correction)
    )


KV_NEEDS_DECODER = "KV-cache policies are for causal decoders"
"""Why ``headprobe kv`` refuses an encoder (``"<name> is an encoder; "`` before it), before the load where its
config says so (:meth:`headprobe.commands.kv.KVConfig.preflight`) and after
(:func:`headprobe.analyses.kvpolicy.check_kv_backend`)."""

CIRCUIT_NEEDS_NATIVE = "path patching and edge attribution need the native backend (--backend native), not {backend}"
"""Why ``headprobe circuit`` refuses a backend without path patching, before the load
(:meth:`headprobe.commands.circuit.CircuitConfig.preflight`) and after (:mod:`headprobe.analyses.circuit`)."""
CIRCUIT_NEEDS_DECODER = (
    "{model} is an encoder: path patching and edge attribution need a decoder (an encoder's post-LN blocks have "
    "no direct paths)"
)
"""Why ``headprobe circuit`` refuses an encoder, before the load where its config says so
(:meth:`headprobe.commands.circuit.CircuitConfig.preflight`) and after (:mod:`headprobe.analyses.circuit`)."""


KV_TABLE_DIGITS = {"natural_loss_increase": 4, "copy_accuracy": 3}
"""The decimals ``headprobe kv``'s report table (and its LaTeX export) prints: the one comparison of
the chosen policy with the others (the report's words and summary.json's ``beats_*``) is made at them."""


def unreliable_picks(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[int]]:
    """The layers of a :func:`~headprobe.analyses.pruning.per_layer_best_head` table (or per_layer.csv's
    rows) whose held-out pick did not hold up: prune's NOTE, its figure's hollow points and the LaTeX
    table's daggers all read it.

    Returns:
        ``inverted``: the layers whose best-head loss is above their worst-head loss, both held out
        (``loss_best_only > loss_worst_only``: the head one half of the windows ranked best did worse
        on the other half than the head it ranked worst, so within this layer the ranking is noise at
        this number of windows); ``disagree``: the layers with a head left whose two halves picked
        different best heads (``best_head_halves_agree`` false); ``layers``: the layers with a head
        left. A layer without one (NaN losses) is in none.
    """
    with_heads = [r for r in rows if r["loss_best_only"] == r["loss_best_only"]]  # NaN: no head left
    agree = lambda v: v is True or str(v).lower() == "true"  # a bool, or per_layer.csv's "True"/"False"
    return {
        "inverted": [int(r["layer"]) for r in with_heads if r["loss_best_only"] > r["loss_worst_only"]],
        "disagree": [int(r["layer"]) for r in with_heads if not agree(r["best_head_halves_agree"])],
        "layers": [int(r["layer"]) for r in with_heads],
    }


def kv_sample_sizes(summary: Mapping[str, Any]) -> dict[str, int | None]:
    """The samples behind a ``headprobe kv`` run's numbers, from its summary.json: ``natural_windows`` x
    ``natural_tokens`` scored tokens of natural text (``natural_text_sample``; in a run written before it,
    as ``definitions.intervals.natural_loss`` states them; None where the summary has neither), and
    ``copy_sequences`` long-range sequences (``config``: distances x ``n_per_distance``) of
    ``copy_tokens_each`` copied tokens (``block_len - 1``: the block's tokens 2..block_len)."""
    import re

    cfg = summary.get("config") or {}
    counts = summary.get("natural_text_sample") or {}  # written since 2026-12-07; older runs: the rule's words
    rule = str(((summary.get("definitions") or {}).get("intervals") or {}).get("natural_loss", ""))
    found = re.search(r"over \d+ tokens \((\d+) windows? of (\d+)\)", rule)
    windows, each = counts.get("windows"), counts.get("tokens_each")
    if windows is None and found:
        windows, each = int(found[1]), int(found[2])
    n_seq = len(cfg.get("distances") or []) * int(cfg.get("n_per_distance") or 0)
    return {
        "natural_windows": windows,
        "natural_tokens": each,
        "copy_sequences": n_seq or None,
        "copy_tokens_each": int(cfg["block_len"]) - 1 if cfg.get("block_len") else None,
        "distances": len(cfg.get("distances") or []) or None,
    }


def kv_sample_text(summary: Mapping[str, Any]) -> str:
    """``natural text: 1 window x 1,022 tokens; copy: 3 sequences (3 distances x 1), 45 copied tokens``:
    :func:`kv_sample_sizes` in words, as kv's figure and LaTeX caption print them (``n/a`` for a count the
    summary lacks)."""
    n = kv_sample_sizes(summary)
    w, t, s, each = n["natural_windows"], n["natural_tokens"], n["copy_sequences"], n["copy_tokens_each"]
    natural = "n/a" if w is None or t is None else f"{w:,} window{'s' if w != 1 else ''} x {t:,} tokens"
    if s is None or each is None:
        return f"natural text: {natural}; copy: n/a"
    per = (summary.get("config") or {}).get("n_per_distance")
    return (
        f"natural text: {natural}; copy: {s:,} sequence{'s' if s != 1 else ''} "
        f"({n['distances']} distance{'s' if n['distances'] != 1 else ''} x {per}), {s * each:,} copied tokens"
    )
