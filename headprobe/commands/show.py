"""``headprobe show --head 18.6 --prompt "..."``: one head's attention pattern on your own text.

Writes ``pattern_<layer.head>.{png,pdf,svg}`` (the pattern with the real tokens on both axes,
:func:`headprobe.analyses.figures.pattern_plot`) and ``index.html``, the offline viewer
(:mod:`headprobe.analyses.viewer`) over every head of the model on the same text, opened on the
head asked for, with each head's previous-token, first-token and positional scores on this text.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
from collections.abc import Sequence
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from headprobe import options
from headprobe.commands import Command
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.core.heads import check_head_layers, heads_text, parse_heads
from headprobe.probe.core.reprs import CompactRepr
from headprobe.settings import OUTPUT, Flags, ModelSettings, setting

if TYPE_CHECKING:
    from headprobe.probe.backends.base import LoadedModel

HELP = "draw one head's attention pattern on your own text (PNG/PDF/SVG and an offline HTML page)"

MAX_TOKENS = 1024
"""Longest prompt drawn whole: the HTML page keeps every head's pattern (n_layers x n_heads x T^2 bytes).
A longer prompt (up to the model's context) is drawn as a window (:data:`LONG_WINDOW`)."""

MIN_TOKENS = 3
"""Shortest prompt shown: the page's scores (previous-token, first-token) need 3 positions."""

LONG_WINDOW = 64
"""A prompt longer than :data:`MAX_TOKENS`: the figure shows its last ``LONG_WINDOW`` queries
against the first 4 keys (the attention sink) and the last ``LONG_WINDOW - 4`` keys, computed from
those rows alone (streamed from q and k on the native backend), and the page every head on the
first :data:`MAX_TOKENS` tokens (a causal model's pattern on a prefix is that corner of the whole one)."""


@dataclass(frozen=True)
class ShowConfig(ModelSettings):
    """Settings of ``headprobe show``: the shared :class:`~headprobe.settings.ModelSettings` (how
    the model is loaded, :func:`headprobe.options.load_model`) composed, and these (keyword-only).

    Attributes:
        head: ``layer.head`` (or ``L5H1``), checked against the model once it is loaded.
        prompt: the text (or ``prompt_file``'s content, read by :func:`main`; None until then); at
            most :data:`MAX_TOKENS` tokens.
        why: a query position (negative: from the end) whose score for its most-attended key is
            split by QK attribution (:func:`why_attends`); None: none.
        out: output directory.
    """

    head: str = setting(
        MISSING, "the head, as layer.head (e.g. 18.6; L18H6 also accepted)", required=True, kw_only=True
    )
    prompt: str | None = setting(
        MISSING, "the text to run the model on", exclusive="text", required=True, kw_only=True
    )  # None: --prompt-file given, read into it by main before the run
    why: int | None = setting(
        None,
        "also say why the head attends where it does from this query (a token position, 0-based; -1: the last): "
        "QK attribution of its score for the key it attends to most there, written to why_<head>.csv with its "
        "largest terms printed (native backend, a decoder; default: none)",
        type=int,
        kw_only=True,
    )
    out: str = field(kw_only=True)  # its flag is OutputSettings'


@dataclass(frozen=True)
class PromptFile:
    """``--prompt-file``, the other way to give ``show``'s text: a flag of the command line, not
    part of :class:`ShowConfig` (:func:`main` reads the file into ``prompt``)."""

    prompt_file: str | None = setting(
        None, "a UTF-8 file holding the text (its final newline dropped)", exclusive="text", required=True
    )
    """A UTF-8 file holding the prompt."""


@dataclass(repr=False)
class ShowResult(CompactRepr):
    """The head's pattern and where it was written.

    Attributes:
        head: ``(layer, head)``.
        pattern: ``[q_pos, k_pos]`` the head's attention weights (float32, rows sum to 1; a long
            prompt's window of them).
        labels: the tokens' labels.
        paths: the files written.
        why: with ``why``, the :class:`~headprobe.analyses.qk_attribution.QKAttribution` of the
            query's score for its most-attended key; else None.
    """

    head: tuple[int, int]
    pattern: object
    labels: list[str]
    paths: list[Path]
    _summary: dict = field(default_factory=dict)
    why: object = None

    def summary(self) -> dict:
        """What index.html is built from (show writes no summary.json): ``model``, ``weights_precision``,
        ``layout`` (``n_layers``, ``n_heads``, ``n_kv_heads``), ``selected_head`` (``"18.6"``) and
        ``notes`` (what the page's duplicate-token and induction columns mean on this prompt)."""
        return copy.deepcopy(self._summary)


def run(
    cfg: ShowConfig,
    overwrite: bool = False,
    model: LoadedModel | None = None,
    formats: str | Sequence[str] | None = None,
) -> ShowResult:
    """Load the model (unless ``model``, loaded as ``cfg`` asks, is given), capture every head's
    pattern on the prompt, write the figure (in ``formats``, as :func:`show`) and the page.

    Raises:
        HeadprobeError: an empty or too long prompt, a head outside the model or in a hybrid's
            linear-attention layer, a model whose self-check forbids patterns, or an output directory
            that is not empty (without ``overwrite``); InputValueError: a bad ``formats`` (:func:`show`
            checks it before loading; here it is refused before anything is written).
    """
    prompt = cfg.prompt or ""
    if not prompt.strip():
        raise HeadprobeError("the prompt is empty; give --prompt TEXT or --prompt-file FILE")

    from headprobe.analyses import figures as figs
    from headprobe.analyses.data import TokenSet
    from headprobe.analyses.outputs import write_outputs
    from headprobe.analyses.scoring import drawable, score_tokens, token_labels
    from headprobe.analyses.viewer import build_page, head_patterns
    from headprobe.probe.core.heads import format_head
    from headprobe.probe.core.io import prepare_output_dir

    out = prepare_output_dir(cfg.out, overwrite, create=False)
    if model is None:
        model = options.load_for(cfg)
    model.self_check.require_patterns("attention patterns")
    spec = model.spec
    layer, head = _selected_head(cfg, model)
    tokens = model.to_tokens(prompt)
    assert not isinstance(tokens, tuple)  # one text: one tensor, no mask
    n = tokens.shape[1]
    start = _prompt_start(model, cfg, tokens)
    ts = TokenSet(tokens=tokens, start=start, source="prompt")
    shown = min(n, MAX_TOKENS)
    patterns = head_patterns(
        model, {"prompt": TokenSet(tokens=tokens[:, :shown], start=start, source="prompt")}, max_len=shown
    )
    scores, _, _ = score_tokens(model, ts, "natural", first=0)
    labels = [drawable(label) for label in token_labels(model, tokens[0].cpu())]  # the viewer's are for a browser
    pattern, positions = _head_pattern(model, tokens, layer, head)
    why = None if cfg.why is None else why_attends(model, tokens, layer, head, cfg.why)

    name = format_head((layer, head))
    title = f"head {name}, {figs.model_tag(spec.name, spec.weights)}\nyour prompt ({n} tokens)"
    # drawn only when a figure is written (--formats none: the page alone)
    figure = {
        f"pattern_{name}": lambda: figs.pattern_plot(
            pattern, labels, title, causal=model.spec.causal, positions=positions
        )
    }
    table, notes = head_table(spec, scores, patterns["prompt"], n)
    summary = {
        "model": spec.name,
        "weights_precision": spec.precision,
        "layout": {k: getattr(spec, k) for k in ("n_layers", "n_heads", "n_kv_heads", "causal")},
        "selected_head": name,
        "notes": notes,
    }
    patterns["prompt"]["label"] = (
        f"your prompt ({n} tokens)" if n == shown else f"your prompt (first {shown} of {n} tokens)"
    )
    page = build_page(
        table,
        summary,
        patterns,
        title=f"{figs.title_name(spec.name, spec.weights)}: head {name} on your prompt",
        verdicts=False,
    )

    paths = write_outputs(
        out, overwrite, summary=None, figures=figure, extra=_page_writer(page, why, name), formats=formats
    )
    return ShowResult((layer, head), pattern, labels, paths, summary, why)


def _page_writer(page: str, why, name: str):
    """show's ``extra`` writer: index.html and, with ``--why`` (``why`` a QKAttribution), why_<head>.csv."""
    from headprobe.probe.core.io import write_text

    def write(d: Path) -> list[Path]:
        write_text(d / "index.html", page)
        if why is None:
            return [d / "index.html"]
        write_text(d / f"why_{name}.csv", why.totals().to_csv(index=False, float_format="%.6g"))
        return [d / "index.html", d / f"why_{name}.csv"]

    return write


def why_attends(model: LoadedModel, tokens, layer: int, head: int, query: int):
    """The :func:`~headprobe.analyses.qk_attribution.qk_attribution` of head ``layer.head``'s score at
    position ``query`` of the prompt's ``[1, pos]`` ``tokens`` (negative: from the end) for the key it
    attends to most there (the argmax of its pattern's row; the first of a tie).

    Raises:
        HeadprobeError: a query outside the prompt; as qk_attribution (the transformer-lens backend, an
            encoder, an identity that fails).
    """
    from headprobe.analyses.qk_attribution import qk_attribution
    from headprobe.probe.hooks.capture import capture_heads

    n = tokens.shape[1]
    if not -n <= query < n:
        raise HeadprobeError(f"--why {query}: the prompt has {n} tokens (positions 0 to {n - 1}, or -1 for the last)")
    q = query % n
    row = capture_heads(model, tokens, layers=[layer], heads=[head], rows=[q])["pattern"][layer][0, 0, 0]
    return qk_attribution(model, tokens, layer, head, q, int(row.float().argmax()))


def why_lines(why, labels: Sequence[str], top: int = 5) -> list[str]:
    """What ``show --why`` prints: the query and key with their tokens, the score, and the ``top``
    components of the key side and of the query side by size (:meth:`~headprobe.analyses.qk_attribution.QKAttribution.totals`)."""
    t = why.totals()

    def largest(column: str) -> str:
        part = t.reindex(t[column].abs().sort_values(ascending=False).index).head(top)
        return ", ".join(f"{c} {v:+.3g}" for c, v in zip(part["component"], part[column]))

    return [
        f"why {why.layer}.{why.head} attends from {why.q_pos} ({labels[why.q_pos]!r}) to {why.k_pos} "
        f"({labels[why.k_pos]!r}): score {why.score:.4g} = sum of the terms (identity error {why.identity_error:.1g})",
        f"  key side, largest: {largest('key_side')}",
        f"  query side, largest: {largest('query_side')}",
    ]


def _head_pattern(model: LoadedModel, tokens, layer: int, head: int) -> tuple:
    """``(pattern, positions)``: head ``(layer, head)``'s own float32 ``[q_pos, k_pos]`` attention
    weights on the prompt's ``[1, pos]`` ``tokens`` (the page stores every head's in float16), and
    ``positions`` None; for a prompt longer than :data:`MAX_TOKENS`, the window :func:`long_window`
    picks, with ``positions`` its ``(rows, cols)`` (absolute positions)."""
    from headprobe.probe.hooks.capture import capture_heads

    n = tokens.shape[1]
    rows, cols = long_window(n, LONG_WINDOW) if n > MAX_TOKENS else (None, None)
    cap = capture_heads(model, tokens, layers=[layer], heads=[head], rows=rows)
    pattern = cap["pattern"][layer][0, 0].float().cpu().numpy()
    if cols is None:
        return pattern, None
    return pattern[:, cols], (rows, cols)


def _selected_head(cfg: ShowConfig, model: LoadedModel) -> tuple[int, int]:
    """``(layer, head)`` of ``--head``.

    Raises:
        HeadprobeError: not exactly one head, a head outside the model, in a hybrid's
            linear-attention layer or removed by pruning (:func:`headprobe.options.refuse_removed`).
    """
    spec = model.spec
    heads = parse_heads(cfg.head, spec.n_layers, spec.n_heads)
    if len(heads) != 1:
        raise HeadprobeError(f"show draws one head, got {cfg.head!r}")
    check_head_layers(heads, spec.layout.head_layers)
    options.refuse_removed(heads, model)  # a removed head draws a uniform pattern under its name
    ((layer, head),) = heads
    return layer, head


def _prompt_start(model: LoadedModel, cfg: ShowConfig, tokens) -> int:
    """The first real position of the prompt's ``[1, pos]`` ``tokens``: 1 where they begin with a
    BOS token, else 0, once their length is checked against the longest prompt the model takes
    (:func:`check_length`)."""
    spec = model.spec
    n = tokens.shape[1]
    longest = spec.n_ctx if spec.causal else min(MAX_TOKENS, spec.n_ctx)
    check_length(n, longest)
    start = int(
        n > 1
        and cfg.prepend_bos
        and model.tokenizer.bos_token_id is not None
        and int(tokens[0, 0]) == model.tokenizer.bos_token_id
    )
    return start


def head_table(spec, scores: dict, prompt: dict, n: int) -> tuple[object, list[str]]:
    """The page's table: one row per head with the head types' scores on the prompt that apply to
    the model (a decoder has no next-token or last-token column: encoder-only types), and the
    duplicate-token and induction scores wherever the prompt's tokens repeat
    (:func:`~headprobe.analyses.detectors.text_repeat_scores`, on the tokens the page keeps); with
    the notes the page shows under its heading (what those two mean here, or why they are empty)."""
    import numpy as np
    import pandas as pd
    import torch

    from headprobe.analyses.columns import score_columns
    from headprobe.analyses.detectors import text_repeat_scores

    applies = set(score_columns(causal=spec.causal))
    L, H = np.meshgrid(np.arange(spec.n_layers), np.arange(spec.n_heads), indexing="ij")
    repeat = text_repeat_scores(
        torch.from_numpy(np.asarray(prompt["pattern"], dtype=np.float32)),
        torch.from_numpy(np.asarray(prompt["ids"], dtype=np.int64)),
        prompt["start"],
    )
    columns = {
        c: v.numpy().ravel() for c, v in {**scores, **repeat}.items() if c in applies and c != "positional_offset"
    }
    table = pd.DataFrame(
        {
            "layer": L.ravel(),
            "head": H.ravel(),
            "kv_head": H.ravel() // max(1, spec.n_heads // spec.n_kv_heads),
            **{c: columns[c] for c in score_columns(causal=spec.causal) if c in columns},
        }
    )
    kept = len(prompt["ids"])
    where = "" if kept == n else f" (on the first {kept} of {n} tokens)"
    notes = (
        [
            f"duplicate-token and induction scores on your prompt{where}: the attention of each token that "
            "occurred before on its earlier occurrences (duplicate-token) and on the tokens right after them "
            "(induction), averaged over those tokens; on a repeated block they are scan's scores"
        ]
        if np.isfinite(repeat["induction"].numpy()).any() or np.isfinite(repeat["duplicate_token"].numpy()).any()
        else [
            f"no token of your prompt{where} repeats: no duplicate-token or induction score (empty columns); "
            "repeat a phrase to see them"
        ]
    )
    if "next_token" in table:  # an encoder's types, scored on its whole prompt
        notes.append(
            f"next-token and last-token scores on your prompt{where}: each token's attention to the token after it "
            "(next-token) and to the last token, an encoder's [SEP] (last-token), averaged over the tokens between "
            "the first and the last (Clark et al. 2019)"
        )
    return table, notes


def check_length(n: int, longest: int | None) -> None:
    """Refuse a prompt of ``n`` tokens outside :data:`MIN_TOKENS` .. ``longest`` (None: no upper bound known).

    Raises:
        HeadprobeError: one line giving the prompt's length and the range.
    """
    if n < MIN_TOKENS:
        raise HeadprobeError(
            f"the prompt is {n} tokens; the pattern's scores need at least {MIN_TOKENS} tokens (BOS included)"
        )
    if longest is not None and n > longest:
        raise HeadprobeError(f"the prompt is {n} tokens; show draws {MIN_TOKENS} to {longest} (the model's context)")


def _preflight(args: argparse.Namespace, prompt: str) -> None:
    """What ``show`` refuses before torch loads: an empty prompt, a model that cannot be loaded, and a
    prompt too short or longer than the context where the tokenizer and config.json can be read
    without loading (:func:`headprobe.options.peek_token_count`, :func:`headprobe.options.peek_config`)."""
    if not prompt.strip():
        raise HeadprobeError("the prompt is empty; give --prompt TEXT or --prompt-file FILE")
    options.check_model(args.model)
    n = options.peek_token_count(args.model, prompt, args.prepend_bos)
    if n is not None:
        cfg = options.peek_config(args.model) or {}
        check_length(n, cfg.get("n_ctx"))


def long_window(n: int, size: int = LONG_WINDOW, sink: int = 4) -> tuple[list[int], list[int]]:
    """The part of an ``n``-token pattern a long prompt's figure shows: the last ``size`` queries
    against keys ``0 .. sink-1`` and the last ``size - sink`` keys (absolute positions)."""
    rows = list(range(n - size, n))
    return rows, [*range(sink), *range(n - (size - sink), n)]


@options.notes_flags("show")
def show(
    model: str | LoadedModel = options.DEFAULT_MODEL,
    *,
    head: str | tuple[int, int],
    prompt: str,
    out: str | Path,
    overwrite: bool = False,
    formats: str | Sequence[str] | None = None,
    why: int | None = None,
    **load,
) -> ShowResult:
    """``headprobe show`` from Python: ``head``'s pattern on ``prompt`` written into ``out``.

    Args:
        model: a model name or path, loaded as ``load`` asks (``device``, ``dtype``, ``backend``,
            ``prepend_bos``, ``device_map``, ``max_memory``), or a loaded model (used as given, as
            by every other command function: ``device`` left at ``auto`` or the model's own).
        head: one head, ``"18.6"`` (or ``"L18H6"``) or ``(18, 6)``.
        formats: the figure's formats, as ``--formats``: ``"png"``, ``"png,svg"`` or ``("png", "pdf")``;
            ``"none"`` or ``()``: the page alone; None: ``$HEADPROBE_FIGURE_FORMATS``, or all three.
        why: a query position (negative: from the end): also split the head's score there for its
            most-attended key by QK attribution (``result.why``, ``why_<head>.csv``; :func:`why_attends`).

    Returns:
        ShowResult: ``head`` ``(layer, head)``, its ``pattern`` ``[q_pos, k_pos]`` (float32 attention
            weights, rows summing to 1), the tokens' ``labels`` and the ``paths`` written into ``out``.

    Raises:
        HeadprobeError: as :func:`run`; a message naming flags has a note giving their Python spelling (``e.__notes__``).
        InputValueError: ``formats`` not of png, pdf, svg or none (one line naming the closest), before loading.
        TypeError: an unknown setting.
    """
    import os

    from headprobe.analyses.vocabulary import figure_formats
    from headprobe.probe.core.io import run_inputs

    formats = figure_formats(formats)

    fields = dict(head=heads_text(head, "head"), prompt=prompt, out=str(out), why=why, **load)
    options.check_fields(ShowConfig, fields, "show", accepts=show)
    options.check_model_argument(model, "show")
    if isinstance(model, (str, os.PathLike)):
        cfg, loaded = ShowConfig(model=str(model), **fields), None
    else:
        cfg, loaded = ShowConfig(model=model.spec.name, **options.loaded_fields(model, fields)), model
    with options.own_run(), run_inputs(options.config_inputs(cfg)):  # as the command line's run
        return run(cfg, overwrite=overwrite, model=loaded, formats=formats)


FLAGS = (
    Flags(group=ModelSettings, helps={"prepend_bos": "do not put BOS in front of the text"}),
    Flags(only=("head", "prompt", "why")),
    Flags(PromptFile),
    OUTPUT,
)
"""``--help``'s blocks: the model's flags, the head and the text (``--prompt`` or ``--prompt-file``), the output's."""


def check(args: argparse.Namespace, config: ShowConfig) -> None:
    """``--head``'s form (one head, ``L.H``), before anything is read (:attr:`Command.check`).

    Raises:
        HeadprobeError: not one head in that form.
    """
    if len(parse_heads(args.head, 10**9, 10**9)) != 1:
        raise HeadprobeError(f"--head takes one head, got {args.head!r}")


def main(args: argparse.Namespace, config: ShowConfig) -> int:
    """``headprobe show`` (``--head``'s form checked by :func:`check`): check the head's range, the text (``--prompt`` or ``--prompt-file``, read
    into the config's ``prompt``) and the output directory, load, print the model's line
    (:func:`headprobe.options.describe_model`), draw, print the files."""
    from headprobe.probe.core.io import prepare_output_dir, read_text_file

    layout = options.peek_layout(args.model)  # the range from config.json, before any weight loads (else after loading)
    if layout is not None:
        options.refuse_removed(parse_heads(args.head, *layout), args.model)  # a pruned checkpoint's config.json
    # a file's final newline is the editor's, not part of the text to show
    prompt = read_text_file(args.prompt_file).rstrip("\r\n") if args.prompt_file else args.prompt
    _preflight(args, prompt)
    prepare_output_dir(args.out, args.overwrite, create=False)
    cfg = dataclasses.replace(config, prompt=prompt)
    with options.out_as_it_was(args.out):
        model = options.load_for(cfg)
        print(options.describe_model(model), flush=True)  # the header every command that loads a model prints
        result = run(cfg, overwrite=args.overwrite, model=model)
    if result.why is not None:
        print("\n".join(why_lines(result.why, result.labels)))
    print(
        f"head {result.head[0]}.{result.head[1]} on {len(result.labels)} tokens; wrote "
        + ", ".join(str(p) for p in result.paths)
    )
    options.say_replaced_and_kept(args.out)
    return 0


COMMAND = Command(
    HELP,
    config=ShowConfig,
    run="headprobe.commands.show:main",
    flags=FLAGS,
    api=show,
    check="headprobe.commands.show:check",
)
"""``headprobe show``, registered in :data:`headprobe.commands.COMMANDS`."""
