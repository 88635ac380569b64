"""The token sets the detectors and ablations run on.

* Natural text: by default CPython's own documentation text (``pydoc_data.topics``), which
  every Python installation ships, so no download is needed; any UTF-8 file otherwise.
* Repeated random tokens: ``[BOS] r_1 ... r_S r_1 ... r_S`` (Olsson et al. 2022; TransformerLens'
  induction detector), BOS only where the model uses one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import TypeVar

import torch
from jaxtyping import Float, Int
from torch import Tensor

from headprobe.analyses.vocabulary import DEFAULT_PERIOD, MIN_PERIOD, MIN_WINDOW_TOKENS, fitted_seq_len
from headprobe.probe.backends.base import LoadedModel
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.core.io import WHOLE_TEXT_BYTES, TextFile, open_text_file, read_text_file  # noqa: F401 - re-exported


@dataclass(frozen=True)
class TokenSet:
    """A batch of equal-length token sequences and what they are.

    Attributes:
        tokens: ``[batch, pos]`` token ids.
        start: index of the first non-BOS position (1 with BOS, 0 without).
        period: for repeated random tokens, the length S of the repeated block; else None.
        source: a short description (for summary.json).
        n_available: how many windows the source text held (natural text only), those left out
            (``n_skipped``) not counted.
        n_skipped: windows left out as more than :data:`MAX_ONE_TOKEN_SHARE` one token (natural text only).
    """

    tokens: Int[Tensor, "batch pos"]
    start: int
    source: str
    period: int | None = None
    n_available: int | None = None
    n_skipped: int = 0

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.numel())


def pydoc_topics() -> dict[str, str]:
    """CPython's documentation topics (``pydoc_data.topics``: topic name -> English text), in key
    order. Shipped with every Python installation; the exact text depends on the Python version."""
    from pydoc_data.topics import topics

    return {k: topics[k] for k in sorted(topics)}


def default_text() -> str:
    """The English text of CPython's documentation topics (``pydoc_data.topics``), in key order."""
    return "\n\n".join(pydoc_topics().values())


_ASCII_FOR = str.maketrans(
    {
        "\u2018": "'",
        "\u2019": "'",
        "\u201c": '"',
        "\u201d": '"',
        "\u2026": "...",
        "\u2013": "-",
        "\u2014": "--",
        "\t": "    ",
        "\r": "",
    }
)


def ascii_text(text: str) -> str:
    """``text`` in the character vocabulary of :func:`headprobe.probe.model.tokenizers.char_level_tokenizer`
    (newline and printable ASCII): typographic quotes, dashes and ellipses become their ASCII
    forms, tabs four spaces, carriage returns are dropped, and any other character becomes ``?``
    (in CPython 3.11's topics that is 3 characters of 465k)."""
    return re.sub(r"[^\n -~]", "?", text.translate(_ASCII_FOR))


MAX_ONE_TOKEN_SHARE = 0.5
"""A natural-text window whose most frequent token fills more than this share of it is left out:
runs such as a reStructuredText underline (``-----``), one token per character under WordPiece
(all-MiniLM-L6-v2: 12% of CPython's documentation in 126-token windows, one of the 8 default
windows 88% ``-``), are not the natural text the scores stand for. No window of SmolLM2's
tokenization of that text comes near (at most 27% one token). The unknown token is not counted
here: a text mostly unknown to the tokenizer has a rule of its own (no verdict, docs/scan.md)."""


def one_token_share(windows: Int[Tensor, "n pos"]) -> Float[Tensor, " n"]:
    """Per window (row), the share of its positions its most frequent token fills; vectorised
    (a sort and run lengths), ``O(n pos log pos)``."""
    n, pos = windows.shape
    s = windows.sort(dim=1).values
    runs = torch.cat([torch.zeros(n, 1, dtype=torch.long), (s[:, 1:] != s[:, :-1]).long().cumsum(1)], dim=1)
    counts = torch.bincount((runs + torch.arange(n)[:, None] * pos).flatten(), minlength=n * pos).view(n, pos)
    return counts.max(dim=1).values / pos


POOL_WINDOWS = 8
"""From a ``--text`` file larger than :data:`~headprobe.probe.core.io.WHOLE_TEXT_BYTES`, pieces are
read until their tokens make this many times the windows asked for, for the seed to draw from."""


def file_token_ids(tokenizer, text: TextFile, need: int) -> tuple[list[int], int]:
    """Token ids of ``text`` (no special tokens) and the bytes read for them.

    A file up to :data:`~headprobe.probe.core.io.WHOLE_TEXT_BYTES` is read and tokenized whole (the ids
    its text as a ``str`` gives). Of a larger one only the beginning is read, in pieces ending at
    line breaks (:meth:`~headprobe.probe.core.io.TextFile.pieces`), each tokenized alone, until the ids
    number at least ``need`` or :data:`~headprobe.probe.core.io.MAX_TEXT_READ_BYTES` are read: time and
    memory grow with ``need``, not with the file (tokenized whole, a 20 MB file took 3.1 GB).

    Raises:
        HeadprobeError: the part read is binary or not UTF-8, or the file cannot be read.
    """
    if text.size <= WHOLE_TEXT_BYTES:  # verbose=False: as in natural_text_tokens (no context-length warning)
        return tokenizer(text.read(), add_special_tokens=False, verbose=False)["input_ids"], text.size
    ids: list[int] = []
    read = 0
    for piece, read in text.pieces():  # noqa: B007 - the last value is read after the loop
        ids += tokenizer(piece, add_special_tokens=False, verbose=False)["input_ids"]
        if len(ids) >= need:
            break
    return ids, read


def natural_text_tokens(
    model: LoadedModel,
    n_seqs: int,
    seq_len: int,
    seed: int,
    text: str | TextFile | None = None,
    source: str | None = None,
) -> TokenSet:
    """``n_seqs`` windows of ``seq_len`` tokens (BOS included when the model uses one) of natural text;
    an encoder's windows are ``[CLS] text [SEP]`` (``seq_len`` counts both).

    The text (a string, a :class:`~headprobe.probe.core.io.TextFile` or, if None, CPython's
    documentation) is tokenized once and cut into consecutive non-overlapping windows; ``n_seqs``
    of them are drawn without replacement with ``seed``, leaving out a window more than
    :data:`MAX_ONE_TOKEN_SHARE` one token (``n_skipped``: the same permutation is drawn, and the window after it in that order
    takes its place; a text without such windows gives the windows of that permutation). The whole text may be longer than the
    model's context (the windows are not): transformers' warning that it is, meant for a
    sequence about to be run as one, is not printed for this call. A text shorter than ``n_seqs``
    windows gives fewer sequences (all it has), never a truncated or padded one. Of a file larger
    than :data:`~headprobe.probe.core.io.WHOLE_TEXT_BYTES` only the beginning is read,
    :data:`POOL_WINDOWS` times the windows needed (:func:`file_token_ids`); ``source`` then says how much.

    Raises:
        HeadprobeError: ``seq_len < 2`` or too short for a window of
            :data:`~headprobe.analyses.vocabulary.MIN_WINDOW_TOKENS` text tokens, the text holds fewer than ``seq_len`` tokens or only windows
            more than half one token, a text
            file that is binary or not UTF-8 in the part read, or a drawn window with a token id
            outside the model's vocabulary (:meth:`~headprobe.probe.backends.base.LoadedModel.check_token_ids`).
    """
    if seq_len < 2:
        raise HeadprobeError(f"sequence length {seq_len} is too short: scores need at least 2 positions")
    if text is None:
        text, source = default_text(), "pydoc_data.topics (CPython documentation)"
    start = 1 if model.prepend_bos else 0
    end_id = getattr(model, "end_token_id", None)  # an encoder's [SEP]: windows are [CLS] text [SEP]
    body = seq_len - start - (end_id is not None)
    if body < MIN_WINDOW_TOKENS:  # a 1-token window is all one token: every window would be left out below
        raise HeadprobeError(
            f"sequence length {seq_len} is too short: it leaves {body} text token{'s' * (body != 1)}"
            f"{' between [CLS] and [SEP]' if end_id is not None else ' after BOS' if start else ''}, and a "
            f"natural-text window needs {MIN_WINDOW_TOKENS} (one token is all one token)"
        )
    # the whole text at once, longer than the model's context by design (it is cut into windows
    # below): verbose=False silences exactly transformers' "Token indices sequence length is longer
    # than the specified maximum ... will result in indexing errors" for this call, nothing global
    if isinstance(text, TextFile):
        ids, read = file_token_ids(model.tokenizer, text, POOL_WINDOWS * n_seqs * body)
        source = text.describe(read) if read < text.size else source or str(text.path)
    else:
        ids = model.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    n_windows = len(ids) // body
    if n_windows == 0:
        raise HeadprobeError(
            f"the text has {len(ids)} tokens, fewer than one sequence of {body}; give more text or a shorter --seq-len"
        )
    windows = torch.tensor(ids[: n_windows * body], dtype=torch.long).view(n_windows, body)
    unk = getattr(model.tokenizer, "unk_token_id", None)  # unknown tokens: the no-verdict rule's (docs/scan.md)
    counted = windows
    if unk is not None:  # each unknown token a value of its own, never "one token"
        counted = torch.where(windows == unk, -1 - torch.arange(windows.numel()).view_as(windows), windows)
    usable = one_token_share(counted) <= MAX_ONE_TOKEN_SHARE
    if not usable.any():
        raise HeadprobeError(
            f"every {body}-token window of the text is more than half one token; give text with words in it"
        )
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(n_windows, generator=gen)  # the same draw with or without windows left out
    pick = order[usable[order]][:n_seqs].sort().values
    tokens = windows[pick]
    if start:
        assert model.bos_token_id is not None  # a model that prepends BOS has one
        tokens = torch.cat([torch.full((len(tokens), 1), model.bos_token_id), tokens], dim=1)
    if end_id is not None:
        tokens = torch.cat([tokens, torch.full((len(tokens), 1), end_id)], dim=1)
    model.check_token_ids(tokens, f"the text ({source or 'text'})")
    n_usable = int(usable.sum())
    return TokenSet(
        tokens=tokens, start=start, source=source or "text", n_available=n_usable, n_skipped=n_windows - n_usable
    )


def left_out_note(skipped: int, available: int | None, what: str = "") -> str | None:
    """The NOTE every command prints (without ``NOTE: ``) when ``skipped`` of the text's windows were
    left out as more than :data:`MAX_ONE_TOKEN_SHARE` one token (``available``: those kept), or None
    when none were; ``what`` names the token set where a command draws more than one."""
    if not skipped:
        return None
    return (
        f"{what + ': ' if what else ''}{skipped} of the text's {skipped + (available or 0)} windows left out: one token "
        f"fills more than {MAX_ONE_TOKEN_SHARE:.0%} of each (e.g. a run of '-'; docs/scan.md)"
    )


def left_out_notes(tokens: TokenSet | PlantedSpan, what: str = "") -> list[str]:
    """:func:`left_out_note` of a natural-text token set, as a list (empty when no window was left out)."""
    note = left_out_note(tokens.n_skipped, tokens.n_available, what)
    return [note] if note else []


def left_out_notes_of(counts: dict[str, dict]) -> list[str]:
    """:func:`left_out_note` of each named token set's saved :func:`window_counts` (``counts``:
    name -> counts; a record without them, e.g. a failed model's, gives none), the name as ``what``."""
    notes = [left_out_note(c.get("windows_left_out", 0), c.get("windows_available"), k) for k, c in counts.items()]
    return [n for n in notes if n]


WINDOW_KEYS = ("windows_available", "windows_left_out")
"""The keys of :func:`window_counts`, as summary.json records them."""


def window_counts(tokens: TokenSet | PlantedSpan) -> dict[str, int | None]:
    """What a summary.json records of a natural-text draw's windows (:data:`WINDOW_KEYS`):
    ``windows_available`` (those that could be drawn) and ``windows_left_out`` (more than
    :data:`MAX_ONE_TOKEN_SHARE` one token)."""
    return dict(zip(WINDOW_KEYS, (tokens.n_available, tokens.n_skipped)))


def unknown_share(model: LoadedModel, tokens: TokenSet | PlantedSpan) -> float:
    """Share of ``tokens``' real positions (after BOS) that are the tokenizer's unknown token (0 without one)."""
    unk = getattr(getattr(model, "tokenizer", None), "unk_token_id", None)
    if unk is None:
        return 0.0
    return float((tokens.tokens[:, tokens.start :] == unk).double().mean())


def random_token_ids(tokenizer, d_vocab: int) -> Tensor:
    """Token ids to draw random sequences from: the tokenizer's vocabulary without special tokens."""
    n = min(len(tokenizer), d_vocab)
    allowed = torch.ones(n, dtype=torch.bool)
    special = [i for i in tokenizer.all_special_ids if i is not None and i < n]
    allowed[special] = False
    return allowed.nonzero().squeeze(-1)


def repeated_random_tokens(model: LoadedModel, n_seqs: int, period: int, seed: int) -> TokenSet:
    """``n_seqs`` sequences ``[BOS] r_1..r_S r_1..r_S`` with ``r`` uniform over non-special tokens.

    Raises:
        HeadprobeError: ``period <`` :data:`MIN_PERIOD`.
    """
    if period < MIN_PERIOD:
        raise HeadprobeError(f"repeat length {period} is too short: induction needs at least {MIN_PERIOD} tokens")
    ids = random_token_ids(model.tokenizer, model.spec.d_vocab)
    gen = torch.Generator().manual_seed(seed)
    half = ids[torch.randint(len(ids), (n_seqs, period), generator=gen)]
    tokens = torch.cat([half, half], dim=1)
    start = 1 if model.prepend_bos else 0
    if start:
        assert model.bos_token_id is not None  # a model that prepends BOS has one
        tokens = torch.cat([torch.full((n_seqs, 1), model.bos_token_id), tokens], dim=1)
    return TokenSet(
        tokens=tokens, start=start, period=period, source=f"{n_seqs} random sequences of {period} tokens, repeated once"
    )


@dataclass(frozen=True)
class TaskTokens:
    """The token sets of the two tasks ``ablate`` and ``prune`` measure (losses in nats/token).

    Attributes:
        natural: ``2 n_natural`` natural-text windows ``[2 n_natural, seq_len]``; the first half and
            the second half are disjoint (scored / held out, or ablated / mean-z reference).
        repeated: repeated random tokens ``[n_repeated, start + 2 period]`` (the induction task).
        repeated_source: a second repeated set (seed + 1), the source input of resample ablation.
    """

    natural: TokenSet
    repeated: TokenSet
    repeated_source: TokenSet


def check_lengths(n_ctx: int, seq_len: int | None, period: int | None) -> None:
    """Refuse natural-text windows of ``seq_len`` tokens or repeated sequences ``[BOS] + 2 x period``
    longer than a model's context ``n_ctx``, in one line that says which lengths fit.

    Raises:
        HeadprobeError: as described.
    """
    long = [f"--seq-len {seq_len}"] if seq_len is not None and seq_len > n_ctx else []
    long += [f"--period {period}"] if period is not None and 2 * period + 1 > n_ctx else []
    if long:
        raise HeadprobeError(
            f"{' and '.join(long)} give{'' if len(long) > 1 else 's'} sequences longer than the model's context "
            f"({n_ctx} tokens): use --seq-len {n_ctx} or less and --period {(n_ctx - 1) // 2} or less"
        )


def fit_lengths(
    n_ctx: int, seq_len: int | None, period: int | None, trained_periods: tuple[int, int, int] | None = None
) -> tuple[int, int]:
    """``(seq_len, period)`` for a model of context ``n_ctx``: each as given, or where None its
    default fitted to the context: :data:`~headprobe.analyses.vocabulary.DEFAULT_SEQ_LEN` or
    ``n_ctx`` if shorter (:func:`~headprobe.analyses.vocabulary.fitted_seq_len`); :data:`~headprobe.analyses.vocabulary.DEFAULT_PERIOD` or the longest
    block that fits ``[BOS]`` and twice, ``(n_ctx - 1) // 2``. ``trained_periods``: ``(min, max,
    eval)`` periods of a model ``headprobe train`` made (``LoadedModel.trained_periods``); where the
    fitted period falls outside ``[min, max]`` the model never saw repeats that long, and its eval
    period is the default instead. The one rule of ``scan``, ``import``, ``atlas``, ``ablate``, ``prune``, ``robustness`` and ``diff``.

    Raises:
        HeadprobeError: a given length that does not fit the context (:func:`check_lengths`).
    """
    check_lengths(n_ctx, seq_len, period)
    if period is None:
        period = min(DEFAULT_PERIOD, (n_ctx - 1) // 2)
        if trained_periods is not None:
            low, high, eval_period = trained_periods
            if not low <= period <= high and 2 * eval_period + 1 <= n_ctx:
                period = eval_period
    return fitted_seq_len(n_ctx, seq_len), period


def task_tokens(
    model: LoadedModel,
    n_natural: int,
    seq_len: int,
    n_repeated: int,
    period: int,
    seed: int,
    text: str | TextFile | None = None,
    source: str | None = None,
) -> TaskTokens:
    """The natural-text and induction token sets of ``ablate`` and ``prune`` (see :class:`TaskTokens`).

    Raises:
        HeadprobeError: a sequence longer than the model's context, or a text holding fewer than
            ``2 n_natural`` windows of ``seq_len`` tokens.
    """
    check_lengths(model.spec.n_ctx, seq_len, period)
    natural = natural_text_tokens(model, 2 * n_natural, seq_len, seed, text, source=source)
    if natural.tokens.shape[0] < 2 * n_natural:
        raise HeadprobeError(
            f"the text holds {natural.tokens.shape[0]} windows of {seq_len} tokens; "
            f"{2 * n_natural} are needed: give more text or a shorter --seq-len"
        )
    repeated = repeated_random_tokens(model, n_repeated, period, seed)
    repeated_source = repeated_random_tokens(model, n_repeated, period, seed + 1)
    return TaskTokens(natural, repeated, repeated_source)


_Span = TypeVar("_Span", bound="PlantedSpan")


@dataclass(frozen=True)
class PlantedSpan:
    """Natural text with a span of random tokens planted twice: the record :class:`NeedleSet` and
    :class:`LongRangeSet` share (each says how its sequences are built). A model that copies
    predicts the second occurrence's tokens 2..length from the first (induction heads, Olsson et
    al. 2022; retrieval heads, Wu et al. 2024, arXiv:2404.15574).

    Attributes:
        tokens: ``[batch, pos]`` token ids.
        start: index of the first non-BOS position.
        first: ``[batch]`` position of the span's first token in its first occurrence.
        second: ``[batch]`` the same in the second occurrence.
        length: the span's length in tokens (>= 2).
        source: a short description (for summary.json).
        n_available, n_skipped: the natural-text windows of the haystack, as :class:`TokenSet`'s.
    """

    tokens: Int[Tensor, "batch pos"]
    start: int
    first: Int[Tensor, " batch"]
    second: Int[Tensor, " batch"]
    length: int
    source: str
    n_available: int | None = None
    n_skipped: int = 0

    @property
    def distance(self) -> Int[Tensor, " batch"]:
        """``second - first``: how far back the span's first occurrence is, in tokens."""
        return self.second - self.first

    def rows(self: _Span, sequences: slice) -> _Span:
        """The same set restricted to ``sequences`` (a slice of the batch): the tokens, ``first`` and
        ``second`` of those sequences."""
        return replace(self, tokens=self.tokens[sequences], first=self.first[sequences], second=self.second[sequences])

    def queries(self) -> tuple[Int[Tensor, "batch copy"], Int[Tensor, "batch copy"], Int[Tensor, "batch copy"]]:
        """``(query positions, source positions, target tokens)``, ``[batch, length - 1]`` each:
        inside the second occurrence the logits at ``second + i`` predict its token ``i + 1``
        (``i = 0..length - 2``; the span's first token has no cue), whose earlier occurrence is at
        ``first + i + 1``. On the device of :attr:`tokens`."""
        device = self.tokens.device  # where the tokens are: the model's device once a command moved them
        i = torch.arange(self.length - 1, device=device)
        queries = self.second.to(device)[:, None] + i[None, :]
        return queries, self.first.to(device)[:, None] + i[None, :] + 1, self.tokens.gather(1, queries + 1)


@dataclass(frozen=True)
class NeedleSet(PlantedSpan):
    """Natural text with a random-token needle inserted twice (the retrieval score's token set): a
    :class:`PlantedSpan` whose span is the needle.

    Sequence b is ``[BOS] hay_1 needle hay_2 needle hay_3`` (``seq_len`` tokens): ``hay_*`` are
    consecutive pieces of one natural-text window, ``needle`` is ``needle_len`` tokens drawn
    uniformly from the non-special vocabulary; ``first`` and ``second`` are the needle's two starts.
    """

    @property
    def needle_len(self) -> int:
        """The needle's length in tokens (:attr:`PlantedSpan.length`)."""
        return self.length


def needle_tokens(
    model: LoadedModel,
    n_seqs: int,
    seq_len: int,
    needle_len: int,
    seed: int,
    text: str | TextFile | None = None,
    source: str | None = None,
) -> NeedleSet:
    """``n_seqs`` natural-text windows with a random-token needle inserted twice (:class:`NeedleSet`),
    after Wu et al. 2024 ("Retrieval Head Mechanistically Explains Long-Context Factuality"),
    whose needle-in-a-haystack test asks the model to reproduce a needle from its context.

    The first needle starts at a seeded position in the first half of the haystack, the second
    after at least ``needle_len`` more haystack tokens.

    Raises:
        HeadprobeError: ``needle_len < 2``, a ``seq_len`` with room for fewer than ``needle_len``
            haystack tokens, or a text too short for one window (:func:`natural_text_tokens`).
    """
    start = 1 if model.prepend_bos else 0
    hay_len = seq_len - start - 2 * needle_len
    if needle_len < 2:
        raise HeadprobeError(f"needle length {needle_len} is too short: retrieval needs at least 2 tokens")
    if hay_len < needle_len:
        raise HeadprobeError(f"sequence length {seq_len} is too short for two needles of {needle_len} tokens")
    hay = natural_text_tokens(model, n_seqs, hay_len + start, seed, text, source)
    gen = torch.Generator().manual_seed(seed + 7)
    ids = random_token_ids(model.tokenizer, model.spec.d_vocab)
    rows, first, second = [], [], []
    for row in hay.tokens:
        body = row[start:]
        needle = ids[torch.randint(len(ids), (needle_len,), generator=gen)]
        a = int(torch.randint(0, (hay_len - needle_len) // 2 + 1, (1,), generator=gen))
        c = int(torch.randint(a + needle_len, hay_len + 1, (1,), generator=gen))
        rows.append(torch.cat([row[:start], body[:a], needle, body[a:c], needle, body[c:]]))
        first.append(start + a)
        second.append(start + a + needle_len + (c - a))
    return NeedleSet(
        torch.stack(rows),
        start,
        torch.tensor(first),
        torch.tensor(second),
        needle_len,
        f"{len(rows)} natural-text windows of {hay.source} with a random needle of {needle_len} tokens, twice",
        hay.n_available,
        hay.n_skipped,
    )


@dataclass(frozen=True)
class LongRangeSet(PlantedSpan):
    """Natural text with a block of random tokens planted early and repeated at the end, at a
    chosen distance (the long-range retrieval task of ``headprobe kv``): a :class:`PlantedSpan`
    whose span is the block.

    Sequence b is ``[BOS] hay_1 block hay_2 block`` (``seq_len`` tokens; the repeat is the last
    ``block_len`` tokens, ``second = seq_len - block_len``): ``hay_*`` are consecutive pieces of
    one natural-text window, ``block`` is ``block_len`` tokens drawn uniformly from the
    non-special vocabulary, and the repeat starts ``distance[b]`` positions after the first
    occurrence. A model that copies predicts the repeat's tokens 2..block_len from the first
    occurrence, however far back it is.
    """

    @property
    def block_len(self) -> int:
        """The block's length in tokens (:attr:`PlantedSpan.length`)."""
        return self.length

    def targets(self) -> tuple[Int[Tensor, "batch copy"], Int[Tensor, "batch copy"]]:
        """``(query positions, target tokens)``, ``[batch, block_len - 1]`` each, of :meth:`PlantedSpan.queries`:
        the logits at ``second + i`` predict the repeat's token ``i + 1``, which only the first occurrence tells."""
        queries, _, targets = self.queries()
        return queries, targets


def long_range_tokens(
    model: LoadedModel,
    seq_len: int,
    distances: list[int],
    block_len: int,
    seed: int,
    n_per_distance: int = 1,
    text: str | TextFile | None = None,
    source: str | None = None,
) -> LongRangeSet:
    """``n_per_distance`` sequences per distance of the long-range retrieval task (:class:`LongRangeSet`).

    Raises:
        HeadprobeError: ``block_len < 2``, a distance below ``block_len`` (the two blocks would
            overlap) or one that puts the first block before the text starts, or a text too short
            for the windows (:func:`natural_text_tokens`).
    """
    start = 1 if model.prepend_bos else 0
    if block_len < 2:
        raise HeadprobeError(f"block length {block_len} is too short: copying needs at least 2 tokens")
    second = seq_len - block_len
    bad = [d for d in distances if d < block_len or second - d < start]
    if bad or not distances:
        raise HeadprobeError(
            f"distances must lie in [{block_len}, {second - start}] for --seq-len {seq_len} and a block of "
            f"{block_len} tokens; got {', '.join(map(str, bad or distances)) or 'none'}"
        )
    n = len(distances) * n_per_distance
    hay = natural_text_tokens(model, n, seq_len - 2 * block_len, seed, text, source)
    if hay.tokens.shape[0] < n:
        raise HeadprobeError(f"the text holds {hay.tokens.shape[0]} windows of {seq_len} tokens; {n} are needed")
    gen = torch.Generator().manual_seed(seed + 11)
    ids = random_token_ids(model.tokenizer, model.spec.d_vocab)
    rows, first = [], []
    for b, row in enumerate(hay.tokens):
        d = distances[b // n_per_distance]
        block = ids[torch.randint(len(ids), (block_len,), generator=gen)]
        a = second - d  # first occurrence, counted with BOS
        body = row[start:]
        rows.append(torch.cat([row[:start], body[: a - start], block, body[a - start :], block]))
        first.append(a)
    tokens = torch.stack(rows)  # [BOS] hay block hay block: seq_len tokens by construction
    return LongRangeSet(
        tokens,
        start,
        torch.tensor(first),
        torch.full((n,), second),
        block_len,
        f"{n} natural-text windows of {hay.source} with a random block of {block_len} tokens planted "
        f"{', '.join(map(str, distances))} tokens before its repeat at the end",
        hay.n_available,
        hay.n_skipped,
    )
