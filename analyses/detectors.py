"""Head-type detectors: each scores every head of a layer at once from its attention pattern.

A detector takes ``pattern: [batch, head, q_pos, k_pos]`` (rows sum to 1; causal for a
decoder, bidirectional for an encoder) and returns a score per head, averaged over the batch and
over the queries the definition uses. With learned attention sinks (GPT-OSS) the pattern holds the
real keys' weights (rows sum to ``1 -`` the sink mass) and is scored as it is: a head that parks
its attention on the learned sink scores low on every type, and ``first-token`` reads token 0, not
the learned sink (``learned_sink_mass`` in :mod:`headprobe.analyses.metrics` reports that). None of them modifies its input. They are collected in
:data:`DETECTORS` (a view of :data:`headprobe.analyses.columns.HEAD_COLUMNS`), keyed by head type.

Conventions: positions are 0-indexed; ``start`` is the first position that is not BOS (1 with
BOS, 0 without; an encoder's ``[CLS]`` is its BOS). Query 0 is excluded everywhere: in a decoder
it can attend only to itself, and an encoder's ``[CLS]`` query is kept out the same way so that
both read the same queries.

Comparing with TransformerLens' ``detect_head`` (``error_measure="mul"``, its default): it divides
the attention on the detection pattern by the attention of *all* T queries, query 0 and the
first block included, where these scores average over the queries their definition uses. So on
the same pattern the previous-token score is TransformerLens' times ``T / (T - 1)``, and the
duplicate-token and induction scores on ``[BOS] r_1..r_S r_1..r_S`` (T tokens, 2S + 1 with
BOS) its times ``T / S`` (measured by running its code on the same tokens; every
head agrees).

Encoders (bidirectional attention, e.g. BERT): the natural-text sequences end with ``[SEP]``
(``[CLS] text [SEP]``), the repeated ones do not (``[CLS] r r``, as for decoders, so duplicate
and induction offsets are the same). Every score is defined on a bidirectional pattern as
written; two look forward and are scored for encoders only (:attr:`Detector.encoder_only`):
next-token (key ``q + 1``) and last-token (the ``[SEP]`` sink, key ``T - 1``). Duplicate-token
and induction keep the decoders' direction (a query of the repeat reading the earlier copy);
a query of the first block reading its later copy is not counted. Positional offsets ``k - q``
range over both signs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from jaxtyping import Float, Int
from torch import Tensor

from headprobe.analyses.columns import DETECTORS, HeadColumn, HeatmapStyle, score_columns, select_head_types  # noqa: F401 - re-exported
from headprobe.probe.core.errors import HeadprobeError

Pattern = Float[Tensor, "batch head q_pos k_pos"]


def _check(pattern: Tensor, min_len: int = 2) -> None:
    if pattern.ndim != 4 or pattern.shape[-1] != pattern.shape[-2]:
        raise ValueError(f"pattern must be [batch, head, q_pos, k_pos] with q_pos == k_pos, got {tuple(pattern.shape)}")
    if pattern.shape[-1] < min_len:
        raise HeadprobeError(
            f"sequence length {pattern.shape[-1]} is too short: this score needs at least {min_len} positions"
        )


def offset_score(
    pattern: Pattern, offset: int, first_query: int, per_sequence: bool = False
) -> Float[Tensor, "*batch head"]:
    """Mean attention from query ``q`` to key ``q - offset``, over queries ``q >= first_query``
    (and the batch; ``per_sequence``: each sequence's, ``[batch, head]``, whose mean over the
    batch is the score, every sequence having the same queries).

    The building block of the previous-token, duplicate-token and induction scores.
    """
    _check(pattern, max(offset + 1, first_query + 1))
    diag = pattern.diagonal(offset=-offset, dim1=-2, dim2=-1)  # [batch, head, T - offset], entry i is q = i + offset
    return diagonal_mean(diag, offset, first_query, per_sequence)


def diagonal_mean(
    diag: Float[Tensor, "batch head n"], offset: int, first_query: int, per_sequence: bool = False
) -> Float[Tensor, "*batch head"]:
    """Mean of ``diag`` (``A[q, q - offset]``, entry i is query ``i + offset``) over queries
    ``q >= first_query`` and the batch (``per_sequence``: not the batch, ``[batch, head]``):
    :func:`offset_score` from a diagonal (the streamed path's)."""
    kept = _kept_queries(diag, offset, first_query)
    return kept.mean(dim=2) if per_sequence else kept.mean(dim=(0, 2))


def _kept_queries(diag: Float[Tensor, "batch head n"], offset: int, first_query: int) -> Float[Tensor, "batch head m"]:
    """``diag``'s entries of queries ``q >= first_query`` (entry i is query ``i + offset``), as float32."""
    return diag[..., max(first_query - offset, 0) :].float()


def previous_token_score(pattern: Pattern) -> Float[Tensor, " head"]:
    """Previous-token score: mean attention from position i to i-1, over i >= 1.

    A pure previous-token pattern scores 1; a uniform causal pattern gives 1/(i+1) at query i.
    Source: Clark et al. 2019 ("What does BERT look at?"); Elhage et al. 2021. TransformerLens'
    ``detect_head(..., "previous_token_head")`` ("mul") gives this times ``(T - 1) / T``.
    """
    return offset_score(pattern, offset=1, first_query=1)


def first_token_score(pattern: Pattern) -> Float[Tensor, " head"]:
    """First-token (attention-sink) score: mean attention to position 0 over queries i >= 1.

    Source: Xiao et al. 2023 (StreamingLLM). Gu et al. 2024 threshold a related rate at 0.3,
    :func:`headprobe.analyses.metrics.sink_rate`, which also counts query 0.
    """
    _check(pattern)
    return pattern[..., 1:, 0].float().mean(dim=(0, 2))


def next_token_score(pattern: Pattern) -> Float[Tensor, " head"]:
    """Next-token score: mean attention from position i to i+1, over queries 1 <= i <= T-2
    (the mirror of :func:`previous_token_score`; 0 for a causal pattern). On natural text the
    last query's next token is ``[SEP]``.

    Source: Clark et al. 2019 ("What does BERT look at?", heads attending to the next token).
    """
    _check(pattern, 3)
    diag = pattern.diagonal(offset=1, dim1=-2, dim2=-1)  # [batch, head, T - 1], entry i is q = i, k = i + 1
    return diag[..., 1:].float().mean(dim=(0, 2))


def last_token_score(pattern: Pattern) -> Float[Tensor, " head"]:
    """Last-token score: mean attention to position T-1 over queries 1 <= i <= T-2; on an
    encoder's natural text (``[CLS] ... [SEP]``) the ``[SEP]`` sink (0 for a causal pattern).

    Source: Clark et al. 2019 (BERT heads attending to [SEP], "a no-op"); Kovaleva et al. 2019.
    """
    _check(pattern, 3)
    return pattern[..., 1:-1, -1].float().mean(dim=(0, 2))


def duplicate_token_score(pattern: Pattern, period: int, start: int) -> Float[Tensor, " head"]:
    """Duplicate-token score on ``[BOS] r_1..r_S r_1..r_S``: mean attention from each token of
    the repeat to its earlier occurrence (key ``q - S``), over the repeat's queries.

    Without BOS (``start == 0``) the first query of the repeat is left out: its earlier
    occurrence is position 0, where a first-token (sink) head attends anyway, which would give a
    pure sink head ``1/S``. With BOS every earlier occurrence is at position >= 1.

    Source: TransformerLens' head detector; Wang et al. 2022 (IOI). Its ``detect_head`` ("mul",
    over all T queries) gives this times ``S / T`` (with BOS).
    """
    return offset_score(pattern, offset=period, first_query=duplicate_first_query(period, start))


def duplicate_first_query(period: int, start: int) -> int:
    """The first query the duplicate-token score reads: ``start + period``, but never the query
    whose earlier occurrence is position 0 (the sink position, when there is no BOS)."""
    return max(start, 1) + period


def induction_score(
    pattern: Pattern, period: int, start: int, per_sequence: bool = False
) -> Float[Tensor, "*batch head"]:
    """Induction (prefix-matching) score on ``[BOS] r_1..r_S r_1..r_S``: mean attention from
    each token of the repeat to the token right after its earlier occurrence (key ``q - S + 1``);
    ``per_sequence``: each sequence's, ``[batch, head]`` (:func:`offset_score`).

    Source: Olsson et al. 2022, "In-context Learning and Induction Heads" (prefix-matching
    score); TransformerLens' induction detector, whose ``detect_head`` ("mul", over all T
    queries) gives this times ``S / T``.
    """
    return offset_score(pattern, offset=period - 1, first_query=start + period, per_sequence=per_sequence)


def induction_scores(
    pattern: Pattern, period: int, start: int
) -> tuple[Float[Tensor, " head"], Float[Tensor, "batch head"]]:
    """:func:`induction_score` pooled over the batch, ``[head]``, and per sequence, ``[batch, head]``,
    from one read of the pattern's diagonal: the pooled one the same numbers, bit for bit, as
    ``induction_score(pattern, period, start)`` (the mean over batch and queries at once, not the
    mean of the per-sequence means, which differs by float32 rounding, ~2e-7)."""
    offset, first_query = period - 1, start + period
    _check(pattern, max(offset + 1, first_query + 1))
    kept = _kept_queries(pattern.diagonal(offset=-offset, dim1=-2, dim2=-1), offset, first_query)
    return kept.mean(dim=(0, 2)), kept.mean(dim=2)


def positional_score(pattern: Pattern) -> tuple[Float[Tensor, " head"], Float[Tensor, " head"]]:
    """Positional heads (Voita et al. 2019): for each query i >= 1, the relative position
    ``k - i`` of its maximum attention; the head's most frequent offset and how often it wins.

    Voita et al. call a head positional when one offset wins at least 90% of the time (in
    practice -1, the previous token; a causal model has offsets <= 0, an encoder's may be
    positive, e.g. +1 for a next-token head). Ties between offsets go to the one nearest
    behind the query (0, -1, -2, ...), then to the positive ones (+1, +2, ...).

    Returns:
        (offset, fraction): the winning relative offset ``k - q`` (e.g. -1) and its frequency in [0, 1].
    """
    _check(pattern)
    return positional_from_argmax(pattern[..., 1:, :].argmax(dim=-1), pattern.shape[-1])


def positional_from_argmax(
    argmax: Int[Tensor, "batch head n"], T: int
) -> tuple[Float[Tensor, " head"], Float[Tensor, " head"]]:
    """:func:`positional_score` from the argmax key of queries ``1 .. T-1`` (``argmax[..., i]`` is
    query ``i + 1``'s), the streamed path's input."""
    queries = torch.arange(1, T, device=argmax.device)
    back = queries - argmax  # how far back the maximum lies, in (-(T-1), T-1); negative: ahead (encoders)
    # bin b < T: b back (offset -b); bin b >= T: b - (T - 1) ahead, so ties go 0, -1, ..., then +1, +2, ...
    bins = torch.where(back >= 0, back, T - 1 - back)
    H = bins.shape[1]
    flat = bins.transpose(0, 1).reshape(H, -1)  # [head, batch * n]; a one-hot [.., n, 2T - 1] would be O(T^2)
    counts = torch.zeros(H, 2 * T - 1, dtype=torch.long, device=bins.device).scatter_add_(
        1, flat, torch.ones_like(flat)
    )
    top, b = counts.max(dim=1)
    offset = torch.where(b < T, -b, b - (T - 1))
    return offset.float(), top.float() / (back.shape[0] * back.shape[-1])


def _stats_scores(name: str, st, S: int | None, start: int) -> dict[str, Tensor]:
    """The scores of head type ``name`` from streamed statistics ``st``
    (:class:`headprobe.probe.hooks.online_stats.HeadStats`): the same definitions as the pattern functions
    above, read from diagonals, key columns and argmaxes instead of the ``[q_pos, k_pos]`` pattern."""
    T = st.n_pos
    if name == "previous_token":
        _check_len(T, 2)
        return {name: diagonal_mean(st.diagonal(1), 1, 1)}
    if name in ("duplicate_token", "induction"):
        assert S is not None  # these types are scored on repeated sequences of period S
        off, first = (S, duplicate_first_query(S, start)) if name == "duplicate_token" else (S - 1, start + S)
        _check_len(T, max(off + 1, first + 1))
        return {name: diagonal_mean(st.diagonal(off), off, first)}
    if name == "first_token":
        _check_len(T, 2)
        return {name: st.key_column(0)[..., 1:].float().mean(dim=(0, 2))}
    if name == "positional":
        _check_len(T, 2)
        return dict(zip(("positional_offset", "positional_fraction"), positional_from_argmax(st.argmax[..., 1:], T)))
    if name == "next_token":
        _check_len(T, 3)
        return {name: st.diagonal(-1)[..., 1:].float().mean(dim=(0, 2))}
    if name == "last_token":
        _check_len(T, 3)
        return {name: st.key_column(T - 1)[..., 1:-1].float().mean(dim=(0, 2))}
    raise KeyError(name)


def _check_len(T: int, min_len: int) -> None:
    if T < min_len:
        raise HeadprobeError(f"sequence length {T} is too short: this score needs at least {min_len} positions")


POSITIONAL_FIGURE_FRACTION = 0.5
"""heatmap_positional_offset.png draws the offset of a head only where it wins for at least this
share of queries (``positional_fraction``): below half, the most frequent offset is not what the
head does (18.6, an induction head, has offset -10 at 0.02), and those heads are masked grey.
Voita et al. 2019's "positional" is stricter (>= 0.9, docs/scan.md); the fraction map shows both."""


SHARE = (0.0, 1.0)
"""The range of every head type's score: a share of a query's attention (or of queries, the positional
fraction), averaged; :attr:`~headprobe.analyses.columns.HeadColumn.score_range`."""

Detector = HeadColumn
"""A head type's record (:class:`headprobe.analyses.columns.HeadColumn` with ``task`` set)."""


def _one(column: str, fn: Callable[..., Tensor], *args: str) -> Callable[[Pattern, int | None, int], dict[str, Tensor]]:
    """A score function filling ``column`` with ``fn(pattern)`` (``args`` ``"period"``/``"start"``: also those)."""

    def score(p: Pattern, period: int | None, start: int) -> dict[str, Tensor]:
        extra = {"period": period, "start": start}
        return {column: fn(p, *(extra[a] for a in args))}

    return score


def _stats(name: str) -> Callable:
    """Head type ``name``'s :attr:`~headprobe.analyses.columns.HeadColumn.score_stats` (:func:`_stats_scores`)."""

    def score(st, period: int | None, start: int) -> dict[str, Tensor]:
        return _stats_scores(name, st, period, start)

    return score


def text_repeat_scores(
    pattern: Float[Tensor, "... q_pos k_pos"], ids: Int[Tensor, " pos"], start: int
) -> dict[str, Float[Tensor, ...]]:
    """Duplicate-token and induction scores on any text (``headprobe show``'s prompt), where the
    tokens repeat wherever they happen to, not in one block: for each query ``q >= start`` whose
    token occurred at earlier positions ``start <= j < q``, the attention on those ``j``
    (duplicate-token) and on the tokens right after them, ``j + 1 < q`` (induction), averaged over
    the queries that have such keys. On ``[BOS] r_1..r_S r_1..r_S`` of distinct tokens this is
    :func:`duplicate_token_score` and :func:`induction_score` (one earlier occurrence per query of
    the repeat). NaN where no query has such keys (no token repeats). Source: TransformerLens'
    ``detect_head`` detection patterns, built from token equality the same way (it divides by all
    queries; see the module's notes).

    Args:
        pattern: attention weights ``[..., q_pos, k_pos]`` (e.g. ``[layer, head, pos, pos]``).
        ids: the token ids ``[pos]``. start: the first position that is not BOS.

    Returns:
        ``{"duplicate_token": [...], "induction": [...]}``, float32, one score per leading index.
    """
    n = ids.shape[0]
    if pattern.shape[-2:] != (n, n):
        raise ValueError(f"pattern {tuple(pattern.shape)} does not match {n} tokens")
    pos = torch.arange(n, device=ids.device)
    kept = pos >= start
    dup = (ids[:, None] == ids[None, :]) & (pos[None, :] < pos[:, None]) & kept[:, None] & kept[None, :]
    ind = torch.zeros_like(dup)
    ind[:, 1:] = dup[:, :-1] & (pos[None, 1:] < pos[:, None])  # the key after each earlier occurrence, before q
    out = {}
    for name, mask in (("duplicate_token", dup), ("induction", ind)):
        rows = mask.any(dim=1)
        on = (pattern.float() * mask.to(pattern.device)).sum(dim=-1)[..., rows.to(pattern.device)]
        out[name] = (
            on.mean(dim=-1) if rows.any() else torch.full(pattern.shape[:-2], float("nan"), device=pattern.device)
        )
    return out


def _positional(p: Pattern, period: int | None, start: int) -> dict[str, Tensor]:
    return dict(zip(("positional_offset", "positional_fraction"), positional_score(p)))


PREVIOUS_TOKEN = Detector(
    "previous_token",
    ("previous_token",),
    _one("previous_token", previous_token_score),
    "natural",
    "natural",
    figures=(HeatmapStyle("previous_token", "previous-token score", "attention to i−1"),),
    score_stats=_stats("previous_token"),
    score_range=SHARE,
)
DUPLICATE_TOKEN = Detector(
    "duplicate_token",
    ("duplicate_token",),
    _one("duplicate_token", duplicate_token_score, "period", "start"),
    "repeated",
    "natural",
    figures=(HeatmapStyle("duplicate_token", "duplicate-token score", "attention to earlier copy"),),
    score_stats=_stats("duplicate_token"),
    score_range=SHARE,
)
INDUCTION = Detector(
    "induction",
    ("induction",),
    _one("induction", induction_score, "period", "start"),
    "repeated",
    "repeated",
    figures=(HeatmapStyle("induction", "induction score", "attention to token after copy"),),
    score_stats=_stats("induction"),
    score_range=SHARE,
)
FIRST_TOKEN = Detector(
    "first_token",
    ("first_token",),
    _one("first_token", first_token_score),
    "natural",
    "natural",
    figures=(HeatmapStyle("first_token", "first-token (sink) score", "attention to position 0"),),
    score_stats=_stats("first_token"),
    score_range=SHARE,
)
POSITIONAL = Detector(
    "positional",
    ("positional_offset", "positional_fraction"),
    _positional,
    "natural",
    "natural",
    rank_by="positional_fraction",
    overview_unit="share of queries at one offset",
    figures=(
        HeatmapStyle("positional_fraction", "positional score", "share of queries at top offset"),
        # one colour per offset (0 and -1 apart), heads that are not positional masked
        HeatmapStyle(
            "positional_offset",
            "positional offset k − q",
            "most frequent offset of the maximum",
            (("cmap", "cividis"), ("discrete", True), ("vmin", -7), ("vmax", 0), ("extend", "min")),
            (("cmap", "RdBu_r"), ("vmin", -3), ("vmax", 3), ("extend", "both")),
            mask_below=("positional_fraction", POSITIONAL_FIGURE_FRACTION),
        ),
    ),
    integer_columns=("positional_offset",),
    top_head_extras=(("offset", "positional_offset"),),
    score_stats=_stats("positional"),
    score_range=SHARE,
)
NEXT_TOKEN = Detector(
    "next_token",
    ("next_token",),
    _one("next_token", next_token_score),
    "natural",
    "natural",
    figures=(HeatmapStyle("next_token", "next-token score", "attention to i+1"),),
    encoder_only=True,
    score_stats=_stats("next_token"),
    score_range=SHARE,
)
LAST_TOKEN = Detector(
    "last_token",
    ("last_token",),
    _one("last_token", last_token_score),
    "natural",
    "natural",
    figures=(HeatmapStyle("last_token", "last-token score", "attention to the last position ([SEP])"),),
    encoder_only=True,
    score_stats=_stats("last_token"),
    score_range=SHARE,
)
"""The head types, each registered by name in :data:`headprobe.analyses.columns.HEAD_COLUMNS`
(which :data:`DETECTORS` views, in head_scores.csv's column order)."""


def __getattr__(name: str) -> tuple[str, ...]:
    """``SCORE_COLUMNS`` (a decoder's head-type columns) and ``ENCODER_SCORE_COLUMNS`` (an encoder's),
    read from the registry when asked (:func:`headprobe.analyses.columns.score_columns`)."""
    if name == "SCORE_COLUMNS":
        return score_columns(causal=True)
    if name == "ENCODER_SCORE_COLUMNS":
        return score_columns(causal=False)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def select_detectors(types: str | Sequence[str] | None = None) -> tuple[str, ...]:
    """:func:`headprobe.analyses.columns.select_head_types` (the torch-free home of the names)."""
    return select_head_types(types)
