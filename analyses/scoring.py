"""Scoring every head with the registered detectors (:data:`headprobe.analyses.detectors.DETECTORS`)
in one streamed forward pass, and the example pattern of a type's top head.

Used by ``headprobe scan`` (all scores), ``headprobe ablate`` (the induction score beside the
ablation sweep) and the tests that compare backends.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from headprobe.analyses.data import TokenSet
from headprobe.analyses.detectors import DETECTORS
from headprobe.probe.backends.base import LOSS_ROWS, LoadedModel
from headprobe.probe.core import memory
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.core.registry import did_you_mean
from headprobe.probe.hooks.ablation import Head, HookCounter
from headprobe.probe.hooks.capture import patterns_by_layer
from headprobe.probe.hooks.names import attn_hook, block_hook
from headprobe.probe.layout.spec import ModelSpec


def score_token_set(
    model: LoadedModel,
    tokens: TokenSet,
    dataset: str,
    mean_z: bool = False,
    types: Sequence[str] | None = None,
    per_sequence: dict[str, Tensor] | None = None,
) -> tuple[
    dict[str, Float[Tensor, "layer head"]],
    Float[Tensor, "batch pos d_vocab"],
    Float[Tensor, "layer head d_head"] | None,
]:
    """Stream one forward pass over ``tokens``, scoring every head with the detectors of ``dataset``.

    Args:
        model: a :class:`~headprobe.probe.backends.loading.LoadedModel` (either backend).
        tokens: the token set (``tokens.tokens`` is ``[batch, pos]``).
        dataset: ``"natural"`` or ``"repeated"``: which detectors run (their ``dataset``).
        mean_z: also return each head's mean z over the real positions (for mean ablation).
        types: head types to score (registry names); None: all of ``dataset``'s.
        per_sequence: a dict to fill with ``column -> [batch, layer, head]``: each score computed on
            each sequence alone (for intervals over sequences; their mean over the batch is the
            score for the columns that average over sequences, not for ``positional_*``).

    Returns:
        (scores, logits, mean_z): ``scores[column]`` is ``[layer, head]`` on the CPU; ``logits``
        ``[batch, pos, d_vocab]``; ``mean_z`` ``[layer, head, d_head]`` (each head's mean z over
        positions from ``tokens.start`` on) or None.

    Raises:
        HeadprobeError: activations or logits become NaN/Inf (naming the first such layer).
    """
    spec = model.spec
    dets = [d for name, d in DETECTORS.items() if d.dataset == dataset and (types is None or name in types)]
    scores = {c: torch.zeros(spec.n_layers, spec.n_heads) for d in dets for c in d.columns}
    z_mean = torch.zeros(spec.n_layers, spec.n_heads, spec.d_head) if mean_z else None

    B = tokens.tokens.shape[0]
    if per_sequence is not None:
        per_sequence.update({c: torch.zeros(B, spec.n_layers, spec.n_heads) for d in dets for c in d.columns})

    def on_pattern(layer: int, pattern: Tensor) -> None:
        for det in dets:
            for col, v in det.score(pattern, tokens.period, tokens.start).items():
                scores[col][layer] = v.cpu()
            if per_sequence is not None:
                for i in range(B):
                    for col, v in det.score(pattern[i : i + 1], tokens.period, tokens.start).items():
                        per_sequence[col][i, layer] = v.cpu()

    first_bad: list[int] = []

    def make_finite_check(layer: int):
        def hook(resid, hook):
            if not first_bad and not torch.isfinite(resid).all():
                first_bad.append(layer)

        return hook

    extra = [(block_hook(layer, "resid_post"), make_finite_check(layer)) for layer in range(spec.n_layers)]
    if mean_z:

        def make(layer: int):
            def hook(z, hook):
                z_mean[layer] = z[:, tokens.start :].float().mean(dim=(0, 1)).cpu()

            return hook

        extra += [(attn_hook(layer, "z"), make(layer)) for layer in range(spec.n_layers)]

    logits = patterns_by_layer(model, tokens.tokens, on_pattern, extra_hooks=extra)
    if first_bad:
        raise HeadprobeError(
            f"activations become NaN or Inf in layer {first_bad[0]} (residual stream after the block); "
            f"check the weights of that layer"
        )
    if not torch.isfinite(logits).all():
        raise HeadprobeError("the model produced NaN or Inf logits on the scan's input")
    return scores, logits, z_mean


STREAMING_CHOICES = ("auto", "on", "off")
"""How head statistics are computed: ``on`` streamed (:mod:`headprobe.probe.hooks.online_stats`, no
``[head, q_pos, k_pos]`` pattern, native backend only), ``off`` from the materialised pattern,
``auto`` streamed from :data:`~headprobe.probe.hooks.online_stats.STREAMING_MIN_LEN` tokens on where the
backend has ``streams_statistics`` (native)."""


def use_online_stats(model: LoadedModel, seq_len: int, streaming: str = "auto") -> bool:
    """Whether a sequence of ``seq_len`` tokens is scored by streaming under ``streaming``
    (:data:`STREAMING_CHOICES`).

    Raises:
        HeadprobeError: an unknown choice.
    """
    from headprobe.probe.hooks.online_stats import STREAMING_MIN_LEN

    if streaming not in STREAMING_CHOICES:
        raise HeadprobeError(
            f"streaming must be one of {', '.join(STREAMING_CHOICES)}, got {streaming!r}{did_you_mean(str(streaming), STREAMING_CHOICES)}"
        )
    if streaming != "auto":
        return streaming == "on"
    pruned = bool(getattr(model.spec, "removed_heads", ()) or ())  # layers with fewer heads: the pattern path
    return model.streams_statistics and not pruned and seq_len >= STREAMING_MIN_LEN  # off for a hybrid (HYBRID_LACKS)


def _finite_checks(n_layers: int, first_bad: list[int]) -> list[tuple[str, Any]]:
    def make(layer: int):
        def hook(resid, hook):
            if not first_bad and not torch.isfinite(resid).all():
                first_bad.append(layer)

        return hook

    return [(block_hook(layer, "resid_post"), make(layer)) for layer in range(n_layers)]


def score_tokens(
    model: LoadedModel,
    tokens: TokenSet,
    dataset: str,
    first: int,
    mean_z: bool = False,
    types: Sequence[str] | None = None,
    per_sequence: dict[str, Tensor] | None = None,
    streaming: str = "auto",
) -> tuple[dict[str, Float[Tensor, "layer head"]], Float[Tensor, " batch"], Float[Tensor, "layer head d_head"] | None]:
    """:func:`score_token_set` with the clean loss instead of the logits, for sequences of any
    length: the detectors read streamed statistics (:func:`use_online_stats`; the same numbers) or the
    materialised pattern, and the loss is unembedded in position chunks
    (:func:`~headprobe.probe.backends.base.chunked_token_losses`), so neither a ``[head, q_pos, k_pos]``
    pattern (streamed) nor ``[pos, d_vocab]`` logits of a whole sequence exist.

    Args:
        first: the first scored prediction (:func:`~headprobe.analyses.ablation.first_scored`).
        streaming: ``auto``, ``on`` or ``off`` (:data:`STREAMING_CHOICES`).
        (the others as :func:`score_token_set`.)

    Returns:
        (scores, loss, mean_z): ``loss`` ``[batch]`` nats/token over the predictions from
        ``first`` on (zeros for an encoder, which has no next-token loss).

    Raises:
        HeadprobeError: NaN/Inf activations or losses; streaming asked of a non-native backend.
    """
    from headprobe.probe.backends.base import chunked_token_losses
    from headprobe.probe.hooks.online_stats import online_head_stats

    spec = model.spec
    dets = [d for name, d in DETECTORS.items() if d.dataset == dataset and (types is None or name in types)]
    scores = _empty_scores(spec, dets)
    B = tokens.tokens.shape[0]
    if per_sequence is not None:
        per_sequence.update({c: torch.zeros(B, spec.n_layers, spec.n_heads) for d in dets for c in d.columns})
    stream = use_online_stats(model, tokens.tokens.shape[1], streaming)
    if stream and (lacking := [d.name for d in dets if d.score_stats is None]):
        raise HeadprobeError(
            f"head type {', '.join(lacking)} has no streamed score (score_stats): scan it with "
            f"--streaming off, or give it one"
        )
    score = _scorer(dets, scores, per_sequence, B)
    first_bad: list[int] = []
    extra = _finite_checks(spec.n_layers, first_bad)
    z_mean = torch.zeros(spec.n_layers, spec.n_heads, spec.d_head) if mean_z else None
    if z_mean is not None:  # mean_z
        extra += [(attn_hook(layer, "z"), _mean_z_hook(z_mean, layer, tokens.start)) for layer in spec.attention_layers]
    with torch.inference_mode():
        if stream:
            resid = online_head_stats(
                model,
                tokens.tokens,
                lambda l, st: score(l, st, lambda d, x: d.score_stats(x, tokens.period, tokens.start)),
                extra_hooks=extra,
                windows=(),
                argmax=any(d.name == "positional" for d in dets),
                entropy=False,
            )
        else:
            resid = _pattern_pass(model, tokens, score, extra)
        if first_bad:
            raise HeadprobeError(
                f"activations become NaN or Inf in layer {first_bad[0]} (residual stream after the "
                f"block); check the weights of that layer"
            )
        if not spec.causal:
            return scores, torch.zeros(B), z_mean
        assert resid is not None  # online_head_stats returns it (final_residual defaults to True)
        loss = chunked_token_losses(model, resid, tokens.tokens.to(resid.device), first).mean(dim=1).cpu()
    if not torch.isfinite(loss).all():
        raise HeadprobeError("the model produced NaN or Inf logits on the scan's input")
    return scores, loss, z_mean


def score_plan(model: LoadedModel, batch: int, seq_len: int, first: int, what: str) -> memory.BatchPlan:
    """The working memory of :func:`score_tokens` over ``batch`` sequences of ``seq_len`` tokens (one
    forward, the whole batch; ``what`` names it), planned by :func:`headprobe.probe.core.memory.plan`:
    per sequence :func:`~headprobe.probe.layout.cost.forward_sequence_bytes` with float32 logits at
    ``min(seq_len - 1 - first, LOSS_ROWS // batch)`` positions (the loss is unembedded in chunks of
    :data:`~headprobe.probe.backends.base.LOSS_ROWS` rows, :func:`chunked_token_losses`; ``first``
    as there). Its float32 attention weights bound a layer's materialised pattern and the streamed
    statistics; a detector's own temporaries are not counted (the offset scores read one diagonal,
    ``[batch, head, seq_len]``).

    Raises:
        HeadprobeError: the batch does not fit in the memory budget (one line, before any allocation).
    """
    spec = model.spec
    positions = max(1, min(seq_len - 1 - first, LOSS_ROWS // batch))
    per = spec.forward_sequence_bytes(seq_len, model.dtype.itemsize, logit_positions=positions)
    return memory.plan(per, model.device, batch, f"{what} ({batch} x {seq_len} tokens, one forward)", 0, cap=batch)


def _empty_scores(spec: ModelSpec, dets: Sequence[Any]) -> dict[str, Tensor]:
    """:func:`score_tokens`' score tables, column -> ``[layer, head]``: zeros, NaN in a hybrid's
    linear-attention layers (no heads to score)."""
    scores = {c: torch.zeros(spec.n_layers, spec.n_heads) for d in dets for c in d.columns}
    for v in scores.values():  # a hybrid's linear-attention layers have no heads to score
        v[[l for l in range(spec.n_layers) if l not in spec.attention_layers]] = float("nan")
    return scores


def _scorer(
    dets: Sequence[Any], scores: dict[str, Tensor], per_sequence: dict[str, Tensor] | None, B: int
) -> Callable[[int, Any, Any], None]:
    """:func:`score_tokens`' per-layer callback ``(layer, x, fn)``: writes each detector's ``fn(det, x)``
    columns into ``scores`` at ``layer``, and (with ``per_sequence``) those of each of the ``B``
    sequences alone (:func:`_one`)."""

    def score(layer: int, x: Any, fn) -> None:
        for det in dets:
            for col, v in fn(det, x).items():
                scores[col][layer] = v.cpu()
            if per_sequence is not None:
                for i in range(B):
                    for col, v in fn(det, _one(x, i)).items():
                        per_sequence[col][i, layer] = v.cpu()

    return score


def _pattern_pass(model: LoadedModel, tokens: TokenSet, score: Callable, extra: list) -> Tensor:
    """:func:`score_tokens`' forward on materialised patterns: each attention layer's pattern scored
    (``score``, each hook run exactly once; headless layers stay 0) with the ``extra`` hooks; the
    final residual stream (the whole output for an encoder)."""
    spec = model.spec
    counter = HookCounter()
    pat = [
        (
            attn_hook(layer, "pattern"),
            _pattern_hook(
                layer, counter, lambda l, p: score(l, p, lambda d, x: d.score(x, tokens.period, tokens.start))
            ),
        )
        for layer in spec.attention_layers
    ]  # headless layers stay 0
    resid = (
        model.final_residual(tokens.tokens, fwd_hooks=[*pat, *extra])
        if spec.causal
        else model.forward(tokens.tokens, fwd_hooks=[*pat, *extra])
    )
    counter.check_once([name for name, _ in pat])
    return resid


def _one(x: Any, i: int) -> Any:
    """Sequence ``i`` of a pattern ``[batch, ...]`` or of streamed statistics."""
    if isinstance(x, Tensor):
        return x[i : i + 1]
    return x.select(i)


def _pattern_hook(layer: int, counter: Any, fn):
    def hook(pattern: Tensor, hook: Any) -> None:
        counter.tick(attn_hook(layer, "pattern"))
        fn(layer, pattern)

    return hook


def _mean_z_hook(z_mean: Tensor, layer: int, start: int):
    def hook(z: Tensor, hook: Any) -> None:
        z_mean[layer] = z[:, start:].float().mean(dim=(0, 1)).cpu()

    return hook


LABEL_CHARS = 10
"""Longest token label in pattern plots; a longer token is cut and ends in ``…``."""


LABEL_FONT = "DejaVu Sans"
"""The font the figures draw token labels in (matplotlib's default)."""


@functools.cache
def _drawable() -> frozenset[int]:
    """Code points :data:`LABEL_FONT` has a glyph for (its character map)."""
    from matplotlib import font_manager
    from matplotlib.ft2font import FT2Font

    path = font_manager.findfont(font_manager.FontProperties(family=LABEL_FONT), fallback_to_default=False)
    return frozenset(FT2Font(path).get_charmap())


FONT_HAS = frozenset(range(0x20, 0x7F)) | {ord("…"), ord("·")}
"""Code points :data:`LABEL_FONT` is known to draw (printable ASCII, the cut's ``…``, an empty
token's ``·``; tests/test_figures.py checks them against its character map): :func:`drawable` keeps a
label of these alone without reading the font, so that a run drawing no figure (``--formats none``)
does not import matplotlib for its token labels (0.3-0.5 s a process)."""


def drawable(text: str) -> str:
    """``text`` with every character :data:`LABEL_FONT` cannot draw written as a Python escape
    (``\\u0bae`` for the Tamil letter ma), so that a figure shows which character it was rather
    than an empty box (and matplotlib has no missing glyph to warn of)."""
    if all(ord(c) in FONT_HAS for c in text):
        return text
    have = _drawable()
    return "".join(
        c if ord(c) in have else (f"\\u{ord(c):04x}" if ord(c) <= 0xFFFF else f"\\U{ord(c):08x}") for c in text
    )


def token_labels(model: LoadedModel, ids: Tensor, for_font: bool = True) -> list[str]:
    """Short printable labels of token ids ``[pos]``, for pattern plots: at most
    :data:`LABEL_CHARS` characters (a cut one ends in ``…``), except special tokens, which are
    shown whole (``<|im_start|>``) so that BOS is recognisable. With ``for_font`` (matplotlib
    figures), characters the figures' font cannot draw are escaped after the cut
    (:func:`drawable`; an escape counts as one character and is never cut); a browser draws
    them, so the viewer passes False."""
    keep = drawable if for_font else (lambda text: text)
    special = set(getattr(model.tokenizer, "all_special_ids", ()) or ())
    labels = []
    for i in ids.tolist():
        s = model.tokenizer.decode([i]).replace("\n", "\\n")
        s = s if s.strip() else repr(s)[1:-1] or "·"
        labels.append(keep(s if i in special or len(s) <= LABEL_CHARS else s[: LABEL_CHARS - 1] + "…"))
    return labels


NATURAL_EXAMPLE_LEN = 28
"""Tokens of the natural-text example: the first ones of the first scored window (a causal
model's pattern on a prefix is exactly that corner of the pattern on the whole window)."""
EXAMPLE_WINDOW = NATURAL_EXAMPLE_LEN
"""Most positions per axis of an example pattern, so that the figure labels every token (the
whole 101-token repeated sequence labelled only every 7th); a longer example is cropped
(:func:`repeat_window`)."""
REPEAT_LEAD = 4
"""Queries of a cropped repeated example before the repeat starts (their attention has no earlier copy to use)."""


def repeat_window(seq_len: int, start: int, period: int, size: int = EXAMPLE_WINDOW) -> tuple[list[int], list[int]]:
    """The part of a ``[BOS] r_1..r_S r_1..r_S`` pattern (``[q_pos, k_pos]``, ``seq_len`` positions)
    that carries the duplicate-token and induction scores, at most ``size`` positions per axis.

    Queries: the last :data:`REPEAT_LEAD` tokens of the first block and the first of the second
    (the repeat starts at ``start + period``); keys: position 0 on, BOS and the start of the first
    block, where those queries' earlier copy (key ``q - S``, duplicate-token) and the token after it
    (``q - S + 1``, induction; Olsson et al. 2022) lie. A sequence of at most ``size`` positions
    is shown whole.

    Returns:
        ``(q_positions, k_positions)``: the rows and columns shown, absolute positions in order.
    """
    if seq_len <= size:
        return list(range(seq_len)), list(range(seq_len))
    q0 = max(0, min(start + period - REPEAT_LEAD, seq_len - size))
    return list(range(q0, q0 + size)), list(range(size))


@torch.inference_mode()
def example_patterns(
    model: LoadedModel, best: dict[str, Head], natural: TokenSet, repeated: TokenSet, streaming: str = "auto"
) -> dict[str, dict]:
    """The attention pattern of the top head of each type on an example from its own token set,
    with the scoring settings: the first :data:`NATURAL_EXAMPLE_LEN` tokens of the first
    natural-text window (an encoder's: the first ``NATURAL_EXAMPLE_LEN - 1`` and its final
    separator token), or the first repeated-random-token sequence (BOS, the block of
    ``repeated.period`` tokens, and the block again), cropped to the :func:`repeat_window` around
    the repeat's start when longer than :data:`EXAMPLE_WINDOW`, so that every token can be labelled.

    Args:
        best: head type -> its top ``(layer, head)``.
        streaming: as :func:`use_online_stats`: a long example's window is computed from the rows
            it shows (:meth:`headprobe.probe.hooks.online_stats.HeadStats.rows`), never the whole pattern.

    Returns:
        head type -> ``{"head": (layer, head), "pattern": [q, k] array (the rows ``positions[0]``
        and columns ``positions[1]`` of the whole pattern), "labels": [pos] str (every position
        of the example), "positions": (q_positions, k_positions), "marks": positions where a
        repeated block starts (for the plot), "period": the block length or None, "sequence": what
        the example is, for an axis label}``.
    """
    first = natural.tokens[:1]
    sequence = {"natural": "first scored sequence", "repeated": "first scored sequence"}
    if not getattr(model.spec, "causal", True) and first.shape[1] > NATURAL_EXAMPLE_LEN:
        # an encoder's window ends with its separator ([SEP]), which the last-token score is about:
        # the example keeps it, as a short sentence the model reads both ways -- a new input, not a
        # crop of the scored pattern (patterns.npz), and the axis label says so
        first = torch.cat([first[:, : NATURAL_EXAMPLE_LEN - 1], first[:, -1:]], dim=1)
        sequence["natural"] = (
            f"first {NATURAL_EXAMPLE_LEN - 1} and last tokens\nof the first scored sequence, read alone"
        )
    short = {
        "natural": first[:, :NATURAL_EXAMPLE_LEN],
        "repeated": repeated.tokens[:1],
    }
    assert repeated.period is not None  # a repeated token set has one
    marks = {"natural": [], "repeated": [repeated.start, repeated.start + repeated.period]}
    period = {"natural": None, "repeated": repeated.period}
    out: dict[str, dict] = {}
    for dataset, toks in short.items():
        wanted = {t: h for t, h in best.items() if DETECTORS[t].dataset == dataset}
        layers = sorted({h[0] for h in wanted.values()})
        if not layers:
            continue
        n = toks.shape[1]
        rows, cols = (
            repeat_window(n, repeated.start, repeated.period)
            if dataset == "repeated"
            else (list(range(n)), list(range(n)))
        )
        kept = _example_windows(model, toks, layers, rows, cols, use_online_stats(model, n, streaming))
        labels = token_labels(model, toks[0])
        for t, (layer, head) in wanted.items():
            out[t] = {
                "head": (layer, head),
                "pattern": kept[layer][head].numpy(),
                "labels": labels,
                "positions": (rows, cols),
                "marks": marks[dataset],
                "period": period[dataset],
                "sequence": sequence[dataset],
            }
    return out


def _example_windows(
    model: LoadedModel, toks: Tensor, layers: list[int], rows: list[int], cols: list[int], stream: bool
) -> dict[int, Tensor]:
    """Layer -> ``[head, len(rows), len(cols)]`` of the first sequence's pattern: from whole rows
    computed from q and k (``stream``) or cut from the materialised pattern."""
    kept: dict[int, Tensor] = {}
    if stream:
        from headprobe.probe.hooks.online_stats import online_head_stats

        def on_stats(layer, st):
            kept[layer] = st.rows(rows)[0][:, :, cols].float().cpu()

        online_head_stats(model, toks, on_stats, layers=layers, windows=(), final_residual=False, statistics=False)
        return kept

    def on_pattern(layer, pattern):
        kept[layer] = pattern[0][:, rows][:, :, cols].detach().float().cpu().clone()

    patterns_by_layer(model, toks, on_pattern, layers=layers)
    return kept
