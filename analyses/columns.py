"""Head columns: every per-head quantity of head_scores.csv, one record type in one registry.

A :class:`HeadColumn` is either a **head type** (``task`` set: scored from one token set's attention
pattern, its top-k heads verified by ablation on ``task``; :mod:`headprobe.analyses.detectors`)
or a **reported metric** (``task`` None: computed from the model, reported and drawn, not
verified; :mod:`headprobe.analyses.metrics`). :data:`HEAD_COLUMNS` (a
:class:`~headprobe.probe.core.registry.Registry`, as lm-evaluation-harness keeps its tasks) maps each
name to its record as a lazy ``"module:ATTR"`` target, filed in the group ``"head type"`` or
``"metric"``: so the command line lists and checks ``--types`` before torch loads (this module
imports neither torch nor numpy), and the scan, the CSV, the summary, the figures and the viewer
read the records from here. Adding one is one ``register`` call here and its record in the file
it points to (CONTRIBUTING.md, "Where to add").

``scan --types`` selects head types (:func:`select_head_types`); every metric is computed when
metrics are on (``--no-metrics`` turns them off).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.core.registry import Choices, Registry

HEAD_TYPE = "head type"
"""The registry group of head types (verified by ablation)."""
METRIC = "metric"
"""The registry group of reported metrics (not verified)."""
NATURAL, REPEATED = "natural", "repeated"
"""The two token sets and the two tasks (the loss on natural text; the loss on the repeated half of
repeated random tokens, the induction task). A task is named by its token set everywhere."""
TASKS: tuple[str, ...] = (NATURAL, REPEATED)
"""The tasks a head type's ablation is judged on (:attr:`HeadColumn.task`), in order."""


@dataclass(frozen=True)
class HeatmapStyle:
    """How one head_scores.csv column is drawn as a layer x head heatmap (``heatmap_<column>``).

    Attributes:
        column: the score column drawn.
        title: the figure's title, e.g. ``"induction score"`` (the overview panel drops " score").
        label: the colour bar's label (what the number measures).
        options: extra keyword arguments of :func:`headprobe.analyses.figures.head_heatmap`
            (colour map, range, ``discrete`` categories); empty: ``viridis`` on [0, 1].
        encoder_options: options that replace those of ``options`` for an encoder (bidirectional
            attention), e.g. a range with positive offsets.
        mask_below: ``(column, threshold)``: heads whose ``column`` is below ``threshold`` are drawn
            masked (grey, named in the legend) rather than with their value, e.g. the offset of a
            head that is not positional; None: every head is drawn.
        signed: a signed quantity, drawn by :func:`headprobe.analyses.figures.signed_head_heatmap`
            (``RdBu_r`` centred at 0, symmetric limits; ``options`` unused).
        math_label: the colour bar's label with its formula typeset (matplotlib mathtext, ``$...$``;
            a fixed string, no ``{name}`` fields, no data), drawn in place of ``label``; None: ``label``
            as written (``label`` stays the plain text elsewhere).
    """

    column: str
    title: str
    label: str
    options: tuple[tuple[str, object], ...] = ()
    encoder_options: tuple[tuple[str, object], ...] = ()
    mask_below: tuple[str, float] | None = None
    signed: bool = False
    math_label: str | None = None

    def options_for(self, causal: bool) -> dict[str, object]:
        """The heatmap's keyword arguments for a causal model or an encoder."""
        return dict(self.options) if causal else {**dict(self.options), **dict(self.encoder_options)}

    def figure_options(self, scores: Mapping, causal: bool) -> dict[str, object]:
        """:meth:`options_for`, plus the ``mask`` (``[layer, head]`` booleans) and its legend label
        that :attr:`mask_below` asks for, computed from ``scores`` (column -> ``[layer, head]``)."""
        import numpy as np

        opts = self.options_for(causal)
        if self.mask_below is not None:
            column, threshold = self.mask_below
            opts["mask"] = np.asarray(scores[column], dtype=float) < threshold
            opts["mask_label"] = f"{column.replace('_', ' ')} < {threshold:g}: not drawn"
        return opts


@dataclass(frozen=True)
class HeadColumn:
    """One per-head quantity, everything about it in one entry: its columns, how it is computed,
    which column ranks it, whether and on which task it is verified, and how it is drawn.

    Attributes:
        name: its registry name, e.g. ``"induction"`` or ``"sink_rate"``.
        columns: the head_scores.csv columns it fills.
        score: a head type's ``(pattern [batch, head, q_pos, k_pos], period, start) -> {column:
            [head]}`` (every head of a layer at once; never modifies the pattern), or a metric's
            ``(model, inputs: MetricInputs) -> {column: [layer, head] ndarray}``, raising
            :class:`~headprobe.probe.core.errors.HeadprobeError` where the model does not allow it (the
            column is then NaN, the message its reason in summary.json).
        dataset: a head type's token set, ``"natural"`` or ``"repeated"``; None for a metric.
        task: a head type's ablation task, ``"natural"`` or ``"repeated"`` (:data:`TASKS`); None: a
            reported metric, not verified.
        rank_by: the column its top heads are chosen by (a head type's overview panel); default
            the first of ``columns``.
        overview_unit: what the ``rank_by`` score is a share of, where it is not a share of
            attention (the overview's shared colour bar says so for this panel, e.g. ``share of
            queries at one offset``); empty: a share of attention on the type's target keys.
        figures: one :class:`HeatmapStyle` per heatmap drawn.
        integer_columns: columns that hold integers (written without decimals).
        top_head_extras: ``(key, column)`` pairs: each top head in summary.json also reports
            ``key: int(column)`` (e.g. the positional head's offset).
        encoder_only: scored only on bidirectional models (the score reads keys after the query).
        causal_only: computed only on causal models (a next-token prediction is needed: retrieval,
            direct logit attribution); NaN for an encoder, with that reason.
        score_stats: a head type's ``score`` from streamed attention statistics instead of a
            pattern, ``(stats: headprobe.probe.hooks.online_stats.HeadStats, period, start) -> {column:
            [head]}`` (the same numbers, for long contexts; docs/long-context.md); None: the head
            type needs the pattern, and a streamed scan refuses it in one line.
        score_range: ``(low, high)``, the range every column but ``integer_columns`` lies in by its
            definition (a share of attention or of queries: ``(0.0, 1.0)``); an interval of a column's
            mean is clipped to it (:meth:`column_range`). None: not bounded.
    """

    name: str
    columns: tuple[str, ...]
    score: Callable
    dataset: str | None = None
    task: str | None = None
    rank_by: str = ""
    overview_unit: str = ""
    figures: tuple[HeatmapStyle, ...] = ()
    integer_columns: tuple[str, ...] = ()
    top_head_extras: tuple[tuple[str, str], ...] = ()
    encoder_only: bool = False
    causal_only: bool = False
    score_stats: Callable | None = None
    score_range: tuple[float, float] | None = None

    def column_range(self, column: str) -> tuple[float, float] | None:
        """``column``'s range by definition (:attr:`score_range`); None for an integer column (an
        offset) or a column not bounded."""
        return None if column in self.integer_columns else self.score_range

    def __post_init__(self) -> None:
        if not self.rank_by:
            object.__setattr__(self, "rank_by", self.columns[0])
        if self.task is not None and (self.task not in TASKS or self.dataset not in TASKS):
            raise ValueError(
                f"head type {self.name!r}: task and dataset must be among {TASKS}, got {self.task!r}, {self.dataset!r}"
            )

    @property
    def is_head_type(self) -> bool:
        """Verified by ablation (a head type), not only reported (a metric)."""
        return self.task is not None

    def applies_to(self, causal: bool) -> bool:
        """Whether it is computed on a model with (``causal``) or without causal attention."""
        return not (self.encoder_only and causal) and not (self.causal_only and not causal)

    @property
    def panel_title(self) -> str:
        """The overview panel's title: the ``rank_by`` heatmap's title without " score"."""
        style = next((f for f in self.figures if f.column == self.rank_by), None)
        return (style.title if style else self.name.replace("_", "-")).removesuffix(" score")


HEAD_COLUMNS: Registry[HeadColumn] = Registry("head column")
"""Every head column, head types first (head_scores.csv's column order), each a lazy target."""
for _name in (
    "previous_token",
    "duplicate_token",
    "induction",
    "first_token",
    "positional",
    "next_token",
    "last_token",
):
    HEAD_COLUMNS.register(_name, f"headprobe.analyses.detectors:{_name.upper()}", group=HEAD_TYPE)
for _name in ("copying", "sink_rate", "entropy", "retrieval", "dla", "local_fraction", "no_op"):
    HEAD_COLUMNS.register(_name, f"headprobe.analyses.metrics:{_name.upper()}", group=METRIC)
del _name

ENCODER_ONLY_TYPES: tuple[str, ...] = ("next_token", "last_token")
"""The head types whose records say ``encoder_only``, named here, torch-free, so that a command that
needs a causal model (diff, robustness) refuses them before the model loads
(:func:`refuse_encoder_only`); tests/test_where_to_add.py checks it equals the records' flags."""

COLUMN_MEANINGS: dict[str, tuple[str, str]] = {
    "previous_token": ("previous-token score", "attention to i−1"),
    "duplicate_token": ("duplicate-token score", "attention to earlier copy"),
    "induction": ("induction score", "attention to token after copy"),
    "first_token": ("first-token (sink) score", "attention to position 0"),
    "positional_fraction": ("positional score", "share of queries at top offset"),
    "positional_offset": ("positional offset k − q", "most frequent offset of the maximum"),
    "next_token": ("next-token score", "attention to i+1"),
    "last_token": ("last-token score", "attention to the last position ([SEP])"),
    "copying": ("copying score (OV eigenvalues)", "Σλ / Σ|λ|"),
    "sink_rate": ("sink rate (first token)", "mean attention to token 0"),
    "entropy": ("attention entropy", "nats (mean over queries)"),
    "retrieval": ("retrieval score (needle copy-paste)", "share of needle tokens"),
    "dla": ("direct logit attribution", "contribution to the next token's logit (logit units)"),
    "distant_mass": (
        "distant mass (beyond the last {W} keys)",
        "attention on keys {W} or more back (token 0 included)",
    ),
    "learned_sink_mass": ("learned sink mass", "1 - row sum: weight on the learned sink"),
    "gate_closure": ("output gate closure", "1 - mean gate value"),
    "value_share_token0": (
        "value-weighted attention to token 0",
        "share on token 0: A_i0 |v_0 W_O| / sum_j A_ij |v_j W_O|, mean over queries i",
    ),
}
"""Drawn column -> ``(title, label)``: what it is and what it is measured as, its heatmap's
:class:`HeatmapStyle` title and colour-bar label, here torch-free for ``export``'s dataset card
(the records' modules import torch; tests/test_where_to_add.py checks the two agree)."""

HEAD_TYPES: Choices = HEAD_COLUMNS.choices(group=HEAD_TYPE)
"""The head types' names (a live view: a type registered at run time is in it), in column order."""


class _Group(Mapping):
    """Name -> :class:`HeadColumn` of one registry group, read from :data:`HEAD_COLUMNS` on every
    use (listing names imports nothing; a value imports its module)."""

    def __init__(self, group: str) -> None:
        self.group = group

    def __getitem__(self, name: str) -> HeadColumn:
        if name not in HEAD_COLUMNS or HEAD_COLUMNS.group_of(name) != self.group:
            raise KeyError(name)
        return HEAD_COLUMNS.get(name)

    def __iter__(self) -> Iterator[str]:
        return iter(HEAD_COLUMNS.names(self.group))

    def __len__(self) -> int:
        return len(HEAD_COLUMNS.names(self.group))


DETECTORS: Mapping[str, HeadColumn] = _Group(HEAD_TYPE)
"""Head type -> its record (a view of :data:`HEAD_COLUMNS`), in head_scores.csv's column order."""
METRICS: Mapping[str, HeadColumn] = _Group(METRIC)
"""Metric -> its record (a view of :data:`HEAD_COLUMNS`), in head_scores.csv's column order."""


def of_an_encoder(summary: Mapping, columns: Sequence[str]) -> bool:
    """Whether a saved run (its summary.json, its table's ``columns``) is of an encoder: its layout's
    ``causal`` where it records one, else by its metric (``1 - cos`` of the sentence embedding) or
    an encoder-only column (a run written before the layout had the field)."""
    causal = (summary.get("layout") or {}).get("causal")
    if causal is not None:
        return not causal
    metric = (summary.get("metric") or {}).get("name")
    return metric == "embedding_cosine" or any(t in columns for t in ENCODER_ONLY_TYPES)


def score_columns(causal: bool = True) -> tuple[str, ...]:
    """head_scores.csv's head-type columns for a causal model (no encoder-only types) or an encoder."""
    return tuple(c for d in DETECTORS.values() if d.applies_to(causal) for c in d.columns)


def metric_columns() -> tuple[str, ...]:
    """head_scores.csv's metric columns, after the head types' columns, in order."""
    return tuple(c for m in METRICS.values() for c in m.columns)


def refuse_encoder_only(types: Sequence[str] | None, why: str) -> None:
    """Refuse encoder-only head types (:data:`ENCODER_ONLY_TYPES`) among ``types`` (registry names)
    for a command that needs causal models, before anything loads; ``why`` says what it needs.

    Raises:
        HeadprobeError: one line naming them, e.g. ``next-token is scored on encoders only ...``.
    """
    if bad := [t.replace("_", "-") for t in types or () if t in ENCODER_ONLY_TYPES]:
        verb = "is" if len(bad) == 1 else "are"
        raise HeadprobeError(f"{', '.join(bad)} {verb} scored on encoders only (bidirectional attention); {why}")


def select_head_types(types: str | Sequence[str] | None = None) -> tuple[str, ...]:
    """Registry names of the head types asked for, in :data:`HEAD_TYPES` order.

    Args:
        types: None (all), a comma-separated string (``"induction,previous-token"``) or a
            sequence of names; ``-`` and ``_`` are interchangeable, case is ignored.

    Raises:
        HeadprobeError: an unknown name (echoed as given, the known names and the closest one
            with underscores, as ``--help`` spells them) or an empty selection.
    """
    import difflib

    names = tuple(HEAD_TYPES)
    if types is None:
        return names
    items = types.split(",") if isinstance(types, str) else list(types)
    typed: dict[str, str] = {}  # registry spelling -> the name as given, which the refusal echoes
    for item in items:
        if str(item).strip():
            typed.setdefault(str(item).strip().lower().replace("-", "_"), str(item).strip())
    wanted = set(typed)
    known = ", ".join(names)  # the spelling of README, --help and the Python keywords
    unknown = sorted(wanted - set(names))
    if unknown:
        close = [m for u in unknown for m in difflib.get_close_matches(u, names, n=1, cutoff=0.7)]
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise HeadprobeError(f"unknown head type {', '.join(typed[u] for u in unknown)}{hint}; known types: {known}")
    if not wanted:
        raise HeadprobeError(f"no head type given; known types: {known}")
    return tuple(n for n in names if n in wanted)
