"""The computation of ``headprobe scan`` (torch): scoring, verification, the result, its files
and report. The pipeline is described in :mod:`headprobe.commands.scan`, whose flags and settings
import none of this."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from headprobe import options
from headprobe.analyses import distributed, viewer
from headprobe.analyses import figures as figs
from headprobe.analyses import metrics as head_metrics
from headprobe.analyses import verification as verif
from headprobe.analyses.ablation import (
    EMBEDDING_METRIC,
    LOSS_METRIC,
    P_VALUE_TIE,
    EmbeddingDistance,
    Verification,
    first_scored,
    top_heads,
    untrusted_task_reason,
)
from headprobe.analyses.columns import DETECTORS, METRICS, metric_columns
from headprobe.analyses.data import (
    NeedleSet,
    TokenSet,
    left_out_notes,
    natural_text_tokens,
    repeated_random_tokens,
    unknown_share,
    window_counts,
)
from headprobe.analyses.scoring import example_patterns, score_plan, score_token_set, score_tokens  # noqa: F401 - score_token_set re-exported
from headprobe.analyses.statistics import interval_rule, mean_ci
from headprobe.analyses.verdicts import (
    NoVerdictWarning,
    VerdictRule,
    decided,
    effect_digits,
    evidence_text,
    ordered_rows,
    own_pool_text,
    p_cell,
    verdict_counts,
)
from headprobe.analyses.verdicts import label as verdict_label
from headprobe.commands.scan import DEFAULT_K, DEFAULT_PERIOD, DEFAULT_SEQ_LEN, EPILOG, HELP, ScanConfig  # noqa: F401
from headprobe.probe.backends.base import LoadedModel
from headprobe.probe.core.heads import parse_heads
from headprobe.probe.core.io import (
    ReadsInputs,
    command_words,
    keeps_inputs,
    prepare_output_dir,
    summary_envelope,
    write_text,
)
from headprobe.probe.core.memory import BatchPlan
from headprobe.probe.core.progress import progress_bar
from headprobe.probe.core.reprs import NONE_TEXT, CompactRepr, load_seconds
from headprobe.probe.hooks.ablation import format_head
from headprobe.probe.hooks.capture import kv_head_of
from headprobe.probe.layout.spec import ModelSpec, precision_lines

if TYPE_CHECKING:
    from matplotlib.figure import Figure


@dataclass(repr=False)
class ScanResult(CompactRepr, ReadsInputs):
    """What a scan found. Losses in nats/token, scores as defined in :mod:`headprobe.analyses.detectors`.

    Attributes:
        config: the settings, model-dependent defaults filled in.
        spec: the model's :class:`~headprobe.probe.layout.spec.ModelSpec`.
        table: head_scores.csv: one row per head (``layer``, ``head``, ``kv_head``, then the selected types' columns).
        scores: column -> ``[layer, head]`` array (the selected types' columns).
        verifications: one :class:`~headprobe.analyses.ablation.Verification` per selected type and ablation kind.
        clean_loss: task (``natural``, ``repeated``) -> loss with no head ablated (nats/token); None
            for an encoder, which measures no loss (summary.json's ``clean_loss_nats`` is then null).
        natural: the natural-text token set scored.
        repeated: the repeated-random token set scored.
        examples: head type -> ``{"head", "pattern", "labels", "positions", ...}``, its top head's pattern on a
            short example (a repeated sequence longer than 28 tokens: the window around the repeat's start,
            :func:`~headprobe.analyses.scoring.example_patterns`).
        timings: seconds per stage (``score_s``, ``ablate_s``, the plan's estimate).
        device: where the model ran.
        dtype: the precision the model ran in.
        self_check: the model's load-time self-check (:meth:`SelfCheck.to_dict`).
        warnings: why verdicts were withheld: a task's numbers cannot carry them (unknown text, loss
            above ln(vocabulary)) or a type's test cannot reach one, one
            :class:`~headprobe.analyses.verdicts.NoVerdictWarning` each (``str()``: summary.json's line).
        score_ci95: column -> ``[2, layer, head]`` 95% t interval over sequences (columns that are a
            mean over sequences; not ``positional_*``, a most-frequent offset), clipped to the score's range.
        patterns: every head's pattern on each token set's first sequence (``natural``, ``repeated``;
            :func:`headprobe.analyses.viewer.head_patterns`), or None (``pattern_len`` 0).
        metrics: the head metrics' summary (:func:`metrics_summary`): why a metric is missing, the
            sink-head share, the composition of previous-token into induction heads; {} without metrics.
        composition: ``{"q", "k", "v"}`` -> ``[layer_j, head_j, layer_i, head_i]`` composition scores, or None.
        verification: the verification's design (:func:`headprobe.analyses.verification.verify_heads`):
            alpha, correction, family size, control design, sets ablated, notes; {} without verification.
        removed_heads: ``(layer, head)`` of a pruned model's removed heads (their scores are NaN).
        load_s: seconds spent loading the model where scan loaded it; None where the caller passed a model it loaded (:func:`~headprobe.probe.core.reprs.load_seconds`).
        needles: the retrieval score's needle set, its haystack windows drawn apart from ``natural``
            (None: no metrics, or sequences too short for two needles).
    """

    config: ScanConfig
    spec: ModelSpec
    table: pd.DataFrame
    scores: dict[str, np.ndarray]
    verifications: list[Verification]
    clean_loss: dict[str, float] | None = field(
        metadata={NONE_TEXT: "none measured (an encoder: its effects are 1 - cos of the sentence embedding)"}
    )
    natural: TokenSet
    repeated: TokenSet
    examples: dict[str, dict]
    timings: dict[str, float]
    device: str = "cpu"
    dtype: str = "float32"
    self_check: dict | None = None
    warnings: list[NoVerdictWarning] = field(default_factory=list)
    score_ci95: dict[str, np.ndarray] = field(default_factory=dict)
    patterns: dict | None = None
    metrics: dict = field(default_factory=dict)
    composition: dict | None = None
    verification: dict = field(default_factory=dict)
    removed_heads: list = field(default_factory=list)
    load_s: float | None = load_seconds()
    needles: NeedleSet | None = None

    @property
    def rule(self) -> VerdictRule | None:
        """The verdict rule the verification decided with (None without one)."""
        record = self.verification.get("verdict_rule")
        return VerdictRule.from_dict(record) if record else None

    def summary(self) -> dict:
        """summary.json's content (as a dict; package versions included)."""
        return summary(self)

    def figures(self) -> dict[str, Figure]:
        """The figures scan writes, by file stem (``heatmap_induction``, ``overview``, ``pattern_induction``,
        ``ablation``): matplotlib Figures of the selected types only."""
        return scan_figures(self)

    @options.reports_for_readers("scan")
    def report(self) -> str:
        """The short terminal table: top heads per type and the ablation verdicts."""
        return format_report(self)

    def html(self) -> str:
        """The viewer page (``headprobe view``'s index.html) of this result: self-contained, offline."""
        return viewer.build_page(self.table, self.summary(), self.patterns)

    def _repr_notes(self) -> dict[str, str]:
        """The verdicts counted (:func:`type_verdicts`), first in ``repr``; none without verification."""
        counts = verdict_counts(type_verdicts(self.verifications))
        return {"verdicts": counts} if counts else {}

    def _repr_html_(self) -> str:
        """Jupyter shows the viewer page, in a sandboxed iframe."""
        return viewer.notebook_html(self.html())

    @keeps_inputs
    def save(
        self,
        out_dir: str | Path,
        overwrite: bool = False,
        html: bool = False,
        progress: bool = False,
        *,
        formats: str | Sequence[str] | None = None,
    ) -> list[Path]:
        """Write head_scores.csv, the figures (in ``formats``), patterns.npz (if kept), with ``html``
        the viewer page index.html, and, last, summary.json into ``out_dir``, each file atomically,
        so a directory with summary.json in it is complete. Returns the paths. ``progress``: a
        progress bar over the figures (stderr).

        Args:
            formats: the figures' formats, as ``--formats`` (:func:`~headprobe.analyses.vocabulary.figure_formats`):
                ``"none"`` writes no figure (the tables, patterns.npz and summary.json only).

        Raises:
            HeadprobeError: ``out_dir`` is a file, not writable, or not empty and ``overwrite`` is False;
                a message naming flags has a note giving their Python spelling (``e.__notes__``).
            InputValueError: ``formats`` not of png, pdf, svg or none (one line naming the closest),
                before anything is written.
        """
        from headprobe.analyses.vocabulary import figure_formats

        formats = figure_formats(formats)  # checked before out_dir is made
        out = prepare_output_dir(out_dir, overwrite)
        return write_outputs(self, out, html=html, progress=progress, formats=formats)


def verification_settings(cfg: ScanConfig) -> verif.VerificationSettings:
    """The verification's parameters from a resolved scan config (k set)."""
    assert cfg.k is not None  # set by ScanConfig.resolved
    return verif.VerificationSettings(
        k=cfg.k,
        n_random=cfg.n_random,
        alpha=cfg.alpha,
        control=cfg.control,
        correction=cfg.correction,
        seed=cfg.seed,
        sequential=cfg.sequential,
        keep_n_random=cfg.keep_n_random,
    )


def verify(
    model: LoadedModel,
    scores: dict[str, np.ndarray],
    natural: TokenSet,
    repeated: TokenSet,
    clean: dict[str, torch.Tensor],
    mean_z: torch.Tensor | None,
    cfg: ScanConfig,
    progress: bool = True,
    untrusted: dict[str, str | None] | None = None,
    cache: verif.SetLosses | None = None,
) -> tuple[list[Verification], dict]:
    """Ablate the top-k heads of each of ``cfg.types`` against random control sets
    (:func:`headprobe.analyses.verification.verify_heads`); ``cfg`` is resolved (k set).
    ``clean``: task -> per-sequence clean loss ``[batch]``. Under ``torchrun`` each rank ablates
    its slice of every batch of sets and every rank gets all the losses. The plan's lines
    (:func:`headprobe.analyses.verification.plan_lines`) go to stderr before the first control
    set. Returns the verifications and the design record of summary.json's ``verification``."""
    spec = model.spec
    metric = scan_metric(spec)
    sets = {"natural": natural, "repeated": repeated}
    assert cfg.k is not None and cfg.types is not None  # set by ScanConfig.resolved and __post_init__
    assert mean_z is not None  # score_tokens gives it when the scan verifies
    top = {name: top_heads(torch.as_tensor(scores[DETECTORS[name].rank_by]), cfg.k) for name in cfg.types}
    task_of = {
        name: task for name in cfg.types if (task := DETECTORS[name].task) is not None
    }  # every head type has one
    scorers = (
        {task: EmbeddingDistance(model, ts.tokens) for task, ts in sets.items()} if metric is EMBEDDING_METRIC else None
    )
    return verif.verify_heads(
        model,
        top,
        task_of,
        sets,
        clean,
        mean_z,
        verification_settings(cfg),
        metric=metric,
        scorers=scorers,
        untrusted=untrusted,
        removed=removed_heads(model),
        progress=progress,
        say=_say,
        cache=cache,
    )


def _set_losses(resume: dict | None, on_save: Callable[[dict], None] | None) -> verif.SetLosses:
    """The verification's set losses: a resumed run's, saved under ``"verification"`` as they grow."""
    return verif.SetLosses(
        (resume or {}).get("verification"),
        (lambda state: on_save({"verification": state})) if on_save is not None else None,
    )


_SAID: ContextVar[dict[str, int] | None] = ContextVar("headprobe_scan_notes_said", default=None)
"""Within :func:`notes_once`: each plan NOTE line said, with how many scans said it."""


@contextlib.contextmanager
def notes_once() -> Iterator[dict[str, int]]:
    """Scans run within say each plan ``NOTE:`` line once (:func:`_say`): ``headprobe atlas`` over 26
    checkpoints printed the same NOTE 26 times. Yields ``{line: how many scans said it}``, for the
    caller's closing count (:func:`repeated_notes`)."""
    token = _SAID.set({})
    try:
        said = _SAID.get()
        assert said is not None
        yield said
    finally:
        _SAID.reset(token)


def repeated_notes(said: dict[str, int], noun: str) -> list[str]:
    """The NOTE lines of :func:`notes_once` said by more than one scan, each once with its count:
    ``NOTE: <text> (for 26 checkpoints; shown once above)``; ``noun``: what the scans were of."""
    return [f"{line} (for {n} {noun}; shown once above)" for line, n in said.items() if n > 1]


def _say(line: str) -> None:
    """One line of the verification's plan on stderr (rank 0 only under torchrun), clear of a progress
    bar, its flags as keywords in a Python call (:func:`headprobe.options.in_python`); within
    :func:`notes_once` a NOTE line said before is counted, not said again."""
    import sys

    if command_words() is None:  # a Python call: its keywords, not the command line's flags
        line = options.in_python("scan", line)
    said = _SAID.get()
    if said is not None and line.startswith("NOTE: "):
        said[line] = said.get(line, 0) + 1
        if said[line] > 1:
            return
    if distributed.is_main():
        tqdm.write(line, file=sys.stderr)


def removed_heads(model: LoadedModel) -> list[tuple[int, int]]:
    """The heads a pruned model no longer has (``spec.removed_heads``) and the head slots of a hybrid
    model's layers without heads (linear attention): NaN scores, never drawn as controls; none for others."""
    spec = model.spec
    headless = [(l, h) for l in range(spec.n_layers) if l not in spec.attention_layers for h in range(spec.n_heads)]
    return list(getattr(spec, "removed_heads", ()) or ()) + headless


def scan_metric(spec: ModelSpec):
    """What scan's ablations measure on a model of ``spec``: the loss (decoders) or, for an
    encoder (``spec.causal`` False, no LM head), the sentence-embedding cosine distance."""
    return LOSS_METRIC if spec.causal else EMBEDDING_METRIC


def batch_line(model: LoadedModel, config: ScanConfig) -> str | None:
    """The header line of the verification's control-set batch
    (:func:`~headprobe.analyses.ablation.set_plan` for each task's sequences at the lengths the run
    resolves: repeated tokens ``2 * period`` after BOS where the model prepends one, natural text
    ``seq_len``), after the data's line (:func:`data_line`, alone without verification). First,
    with or without it, each task's scoring forward over its whole batch is checked to fit
    (:func:`_scoring_plans`), then with ``config.metrics`` each head-metric forward (:func:`_metric_plans`).

    Raises:
        HeadprobeError: a task's scoring forward, a metric's forward (naming it and ``--no-metrics``),
            or one set's ablation of a task's sequences, does not fit in the memory budget; lengths
            that cannot run (``config.resolved``).
    """
    from headprobe.analyses.ablation import set_plan

    cfg = config.resolved(model.spec, model.trained_periods)  # the lengths the run uses, defaults included
    _scoring_plans(model, cfg)
    _metric_plans(model, cfg)
    assert cfg.seq_len is not None and cfg.period is not None  # set by resolved()
    data = data_line(cfg, model.bos_name if model.prepend_bos else None)
    if not config.verify or not model.self_check.decomposition_ok:
        return data
    shapes = [(cfg.n_repeated, int(model.prepend_bos) + 2 * cfg.period), (cfg.n_natural, cfg.seq_len)]
    b, plan = max(((b, set_plan(model, b, t)) for b, t in shapes), key=lambda x: x[1].per_item)
    return f"{data}\n{plan.line()}: {plan.items // b} control sets of {b} sequences per pass"


def data_line(cfg: ScanConfig, bos: str | None) -> str:
    """The header line of the token sets at the lengths the run resolves (``cfg``): natural text, ``--n-natural``
    windows of ``--seq-len`` tokens; repeated tokens, ``--n-repeated`` random blocks of ``--period`` tokens, each
    twice (after ``bos``, the name of the token the model prepends: ``BOS``, an encoder's ``[CLS]``
    (``LoadedModel.bos_name``); None where it prepends none), whatever ``--seq-len`` is."""
    assert cfg.period is not None  # set by ScanConfig.resolved
    return (
        f"data: natural text: {cfg.n_natural} window{'s' * (cfg.n_natural != 1)} of {cfg.seq_len} tokens (--seq-len); "
        f"repeated: {cfg.n_repeated} random block{'s' * (cfg.n_repeated != 1)} of {cfg.period} tokens, each twice = {int(bos is not None) + 2 * cfg.period} "
        f"tokens{f' with {bos}' if bos else ''} (--period; --seq-len sets natural text only)"
    )


def _scoring_plans(model: LoadedModel, cfg: ScanConfig) -> list[BatchPlan]:
    """The plans of the two scoring forwards (:func:`score_tokens` over each task's whole batch:
    ``n_natural`` windows of ``seq_len`` tokens, ``n_repeated`` sequences of ``2 period`` tokens and
    BOS where the model prepends one; :func:`~headprobe.analyses.scoring.score_plan`); ``cfg`` gives
    the lengths (``config.resolved``, as :func:`batch_line` passes it).

    Raises:
        HeadprobeError: a forward that does not fit in the memory budget.
    """
    assert cfg.seq_len is not None and cfg.period is not None  # set by resolved()
    start = int(model.prepend_bos)
    return [
        score_plan(
            model, cfg.n_natural, cfg.seq_len, first_scored("natural", start, None), "scan's natural-text scores"
        ),
        score_plan(
            model,
            cfg.n_repeated,
            start + 2 * cfg.period,
            first_scored("repeated", start, cfg.period),
            "scan's repeated-token scores",
        ),
    ]


def _metric_plans(model: LoadedModel, cfg: ScanConfig) -> list[BatchPlan]:
    """The plans of the head metrics' forwards over the natural-text batch (``n_natural`` windows of
    ``seq_len`` tokens, ``cfg`` resolved as :func:`batch_line` passes it;
    :func:`headprobe.analyses.metrics.metric_plans`); [] with ``cfg.metrics`` off.

    Raises:
        HeadprobeError: a metric's forward does not fit in the memory budget (naming the step and
            ``--no-metrics``).
    """
    if not cfg.metrics:
        return []
    assert cfg.seq_len is not None  # set by resolved()
    first = first_scored("natural", int(model.prepend_bos), None)
    return head_metrics.metric_plans(model, cfg.n_natural, cfg.seq_len, first, cfg.streaming)


def run(
    model: LoadedModel,
    config: ScanConfig,
    progress: bool = True,
    resume: dict | None = None,
    on_save: Callable[[dict], None] | None = None,
) -> ScanResult:
    """Run the scan (see the module docstring) on a loaded model.

    Args:
        model: a :class:`~headprobe.probe.backends.loading.LoadedModel`, used as given (``config``'s device,
            dtype, backend and prepend_bos apply only where :func:`scan` or the CLI load it).
        config: the settings. progress: show progress bars (stderr).
        resume: the state an interrupted run with the same config saved (``on_save``'s argument):
            its verification goes on from the control sets it had ablated.
        on_save: called with the whole state after every batch of ablated sets (the CLI's
            checkpoint, :class:`~headprobe.probe.core.io.RunCheckpoint`).

    Raises:
        HeadprobeError: bad text, sequences longer than the context, k too large, a model whose
            self-check forbids patterns (or, with ``verify``, head ablation), or NaN activations.
    """
    timings: dict[str, float] = {}
    text = config.read_text()
    spec = model.spec
    model.self_check.require_patterns("head scores")
    if config.verify:
        model.self_check.require_decomposition("verification by ablation (pass --no-verify to score patterns only)")

    t0 = time.perf_counter()
    cfg = config.resolved(spec, model.trained_periods)
    assert cfg.seq_len is not None and cfg.period is not None and cfg.types is not None  # set by resolved()
    natural, repeated = _token_sets(model, cfg, text)
    per_seq: dict[str, torch.Tensor] = {}
    scores, clean_seq, mean_z = _score_tasks(model, cfg, natural, repeated, per_seq, progress)
    removed = removed_heads(model)
    _mark_removed(scores, removed)
    clean = {task: float(v.double().mean()) for task, v in clean_seq.items()}
    untrusted, warnings = _untrusted_tasks(model, natural, clean)
    timings["score_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    verifications, design = (
        verify(
            model, scores, natural, repeated, clean_seq, mean_z, cfg, progress, untrusted, _set_losses(resume, on_save)
        )
        if cfg.verify
        else ([], {})
    )
    timings["ablate_s"] = time.perf_counter() - t0
    warnings += verif.no_verdict_warnings(verifications)  # design["warnings"]: their lines
    timings.update(design.pop("timings_s", {}))  # the plan's time estimate

    examples, patterns = _patterns(model, cfg, scores, natural, repeated)

    composition, metric_notes, needles = _metrics(model, cfg, text, natural, scores, removed)
    table = _head_table(spec, scores, cfg.types)
    return ScanResult(
        cfg,
        spec,
        table,
        scores,
        verifications,
        clean if scan_metric(spec) is LOSS_METRIC else None,
        natural,
        repeated,
        examples,
        timings,
        device=str(model.device),
        dtype=str(model.dtype).removeprefix("torch."),
        self_check=model.self_check.to_dict(),
        warnings=warnings,
        score_ci95=_score_ci95(per_seq, scores),
        patterns=patterns,
        composition=composition,
        metrics=metrics_summary(scores, composition, cfg.types, metric_notes) if cfg.metrics else {},
        verification=design,
        removed_heads=removed,
        needles=needles,
    )


def _token_sets(model: LoadedModel, cfg: ScanConfig, text) -> tuple[TokenSet, TokenSet]:
    """``(natural, repeated)``: the natural-text windows and the repeated random tokens of a
    resolved ``cfg`` (``text``: the text read from ``--text``, or None)."""
    assert cfg.seq_len is not None and cfg.period is not None  # set by resolved()
    natural = natural_text_tokens(
        model, cfg.n_natural, cfg.seq_len, cfg.seed, text, source=str(cfg.text) if cfg.text else None
    )
    return natural, repeated_random_tokens(model, cfg.n_repeated, cfg.period, cfg.seed)


def _patterns(
    model: LoadedModel, cfg: ScanConfig, scores: dict[str, np.ndarray], natural: TokenSet, repeated: TokenSet
):
    """``(examples, patterns)``: the example attention patterns of each type's best head, and
    with ``pattern_len`` every head's patterns for the HTML viewer (None without)."""
    assert cfg.types is not None  # set by ScanConfig.__post_init__
    best = {name: top_heads(torch.as_tensor(scores[DETECTORS[name].rank_by]), 1)[0] for name in cfg.types}
    examples = example_patterns(model, best, natural, repeated, streaming=cfg.streaming)
    patterns = (
        viewer.head_patterns(model, {"natural": natural, "repeated": repeated}, cfg.pattern_len)
        if cfg.pattern_len
        else None
    )
    return examples, patterns


def _score_tasks(
    model: LoadedModel,
    cfg: ScanConfig,
    natural: TokenSet,
    repeated: TokenSet,
    per_seq: dict[str, torch.Tensor],
    progress: bool,
) -> tuple[dict[str, np.ndarray], dict[str, torch.Tensor], torch.Tensor | None]:
    """Score every head on both tasks (one pass each; per-sequence scores into ``per_seq``):
    ``(scores, clean_seq, mean_z)``: the ``[layer, head]`` score columns, each task's per-sequence
    clean loss (zeros for an encoder: its effects are 1 - cos), and the natural text's mean z
    (when ``cfg.verify``)."""
    assert cfg.types is not None  # set by ScanConfig.__post_init__
    steps = progress_bar(total=2, desc="scoring heads", unit="pass", progress=progress)
    nat_scores, nat_loss, mean_z = score_tokens(
        model,
        natural,
        "natural",
        first_scored("natural", natural.start, None),
        mean_z=cfg.verify,
        types=cfg.types,
        per_sequence=per_seq,
        streaming=cfg.streaming,
    )
    steps.update()
    rep_scores, rep_loss, _ = score_tokens(
        model,
        repeated,
        "repeated",
        first_scored("repeated", repeated.start, repeated.period),
        types=cfg.types,
        per_sequence=per_seq,
        streaming=cfg.streaming,
    )
    steps.update()
    steps.close()
    scores = {c: v.numpy() for c, v in {**nat_scores, **rep_scores}.items()}
    return scores, {"natural": nat_loss, "repeated": rep_loss}, mean_z


def _untrusted_tasks(
    model: LoadedModel, natural: TokenSet, clean: dict[str, float]
) -> tuple[dict[str, str | None], list[NoVerdictWarning]]:
    """``(untrusted, warnings)``: each task's reason not to trust its clean loss
    (:func:`~headprobe.analyses.ablation.untrusted_task_reason`; None where trusted), and the
    ``"task"`` warning of each untrusted task."""
    untrusted = {
        "natural": untrusted_task_reason(clean["natural"], model.spec.d_vocab, unknown_share(model, natural)),
        "repeated": untrusted_task_reason(clean["repeated"], model.spec.d_vocab),
    }
    warnings = [NoVerdictWarning.for_task(task, reason) for task, reason in untrusted.items() if reason]
    return untrusted, warnings


def _score_ci95(per_seq: dict[str, torch.Tensor], scores: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each score column's 95% interval over the sequences (``[2, layer, head]``), only where the
    score is the mean of its per-sequence scores (``per_seq``: column -> ``[sequence, layer, head]``),
    clipped to the score's range where its record states one (a share of attention, [0, 1]: a t
    interval of 0.9995 read [0.9985, 1.0005]); a column no record bounds is left as it is."""
    ranges = {c: d.column_range(c) for d in DETECTORS.values() for c in d.columns}
    out = {}
    for c, v in per_seq.items():
        if not np.allclose(v.double().mean(0).numpy(), scores[c], atol=1e-5):
            continue
        ci, bounds = mean_ci(v.double().numpy()), ranges.get(c)
        out[c] = ci if bounds is None else np.clip(ci, *bounds)
    return out


def _metrics(model: LoadedModel, cfg: ScanConfig, text, natural: TokenSet, scores: dict, removed: list):
    """The head metrics' columns, added to ``scores`` (removed heads blank): ``(composition, notes,
    needles)``, ``needles`` the retrieval score's token set (None: sequences too short for it);
    ``(None, {}, None)`` without ``cfg.metrics``."""
    if not cfg.metrics:
        return None, {}, None
    assert cfg.seq_len is not None  # set by ScanConfig.resolved
    needles = head_metrics.scan_needles(model, cfg.n_natural, cfg.seq_len, cfg.seed, text, natural.source)
    metric_scores, notes = head_metrics.scan_metrics(
        model, natural, needles, first_scored("natural", natural.start, None), streaming=cfg.streaming
    )
    scores.update(metric_scores)
    _mark_removed(scores, removed)
    return head_metrics.scan_composition(model), notes, needles


def _head_table(spec: ModelSpec, scores: dict[str, np.ndarray], types: Sequence[str]) -> pd.DataFrame:
    """head_scores.csv: one row per head (``layer``, ``head``, ``kv_head``), then the columns of
    each detector of ``types`` and every head metric in ``scores`` (each ``[layer, head]``); a
    detector's integer columns are ``int``, or pandas' nullable ``Int64`` where a removed head
    leaves them empty."""
    layer, head = np.meshgrid(np.arange(spec.n_layers), np.arange(spec.n_heads), indexing="ij")
    dets = [DETECTORS[name] for name in types]
    table = pd.DataFrame(
        {
            "layer": layer.ravel(),
            "head": head.ravel(),
            "kv_head": kv_head_of(head.ravel(), spec.n_heads, spec.n_kv_heads),
            **{c: scores[c].ravel() for d in dets for c in d.columns},
            **{c: scores[c].ravel() for c in metric_columns() if c in scores},
        }
    )
    for d in dets:
        for c in d.integer_columns:
            table[c] = table[c].astype("Int64" if table[c].isna().any() else int)  # a removed head's is empty
    return table


def _mark_removed(scores: dict[str, np.ndarray], removed: Sequence[tuple[int, int]]) -> None:
    """Blank (NaN) every score of the heads a pruned model no longer has: a removed head's pattern
    is that of zero query/key weights, not a finding, and it never ranks among the top-k."""
    for c, v in scores.items():
        if removed and v.ndim == 2:
            v = scores[c] = v.astype(float, copy=True)
            for layer, head in removed:
                v[layer, head] = np.nan


def metrics_summary(
    scores: dict[str, np.ndarray],
    composition: dict | None,
    types: Sequence[str],
    skipped: dict[str, str],
    top_n: int = 5,
) -> dict:
    """summary.json's ``metrics``: top heads of each metric column, why a column is NaN, Gu et al.'s
    share of sink heads (sink rate > 0.3), and the K-composition of the top previous-token into
    the top induction heads beside its baselines (:func:`~headprobe.analyses.metrics.composition_summary`)."""
    out: dict = {"skipped": skipped, "top_heads": {}}
    for c in (s.column for metric in METRICS.values() for s in metric.figures):  # each drawn metric column
        v = scores.get(c)
        if v is not None and np.isfinite(v).any():
            # only heads with a score: a removed head's NaN is no rank (top_heads does the same)
            order = np.argsort(-np.nan_to_num(v, nan=-np.inf), axis=None)[: min(top_n, int(np.isfinite(v).sum()))]
            out["top_heads"][c] = [
                {"head": format_head(divmod(int(i), v.shape[1])), "score": round(float(v.flat[i]), 4)} for i in order
            ]
    if np.isfinite(scores.get("sink_rate", np.nan)).all():
        out["sink_heads_share"] = round(float((scores["sink_rate"] > head_metrics.SINK_THRESHOLD).mean()), 4)
    if composition is not None and {"previous_token", "induction"} <= set(types):
        prev = top_heads(torch.as_tensor(scores["previous_token"]), top_n)
        ind = top_heads(torch.as_tensor(scores["induction"]), top_n)
        out["k_composition_previous_token_to_induction"] = head_metrics.composition_summary(composition["k"], prev, ind)
    return out


scan = options.command_function(
    ScanConfig, run, "scan", "Score, verify and draw the heads of ``model``", '``types=("induction",)``, ``k=5``'
)
"""``headprobe scan`` as a function: :func:`headprobe.options.command_function` over :func:`run`."""


def run_scan(cfg: ScanConfig, model: LoadedModel | None = None, progress: bool = True) -> ScanResult:
    """Compatibility: :func:`run` on ``model``, or on ``cfg.model`` loaded when ``model`` is None;
    ``cfg.threads`` and ``cfg.memory_budget`` hold for this run only (:func:`~headprobe.options.own_run`)."""
    with options.own_run():
        t0 = time.perf_counter()
        loaded = options.load_for(cfg) if model is None else model
        load_s = time.perf_counter() - t0
        result = run(loaded, cfg, progress=progress)
    result.load_s = load_s if model is None else None
    return result


def summary(result: ScanResult, top_n: int = 5) -> dict:
    """summary.json's content: layout, token sets, settings, clean losses, each selected type's
    top ``top_n`` heads, the ablation verdicts and evidence, timings and package versions."""
    spec, cfg = result.spec, result.config
    top = _top_heads_summary(result, top_n)
    confirmed = type_verdicts(result.verifications)
    return summary_envelope(
        {
            "hf_name": spec.hf_name,
            "layout": spec.layout_summary(),
            "tokens": {
                "natural_text": {
                    "source": result.natural.source,
                    "sequences": int(result.natural.tokens.shape[0]),
                    "requested": cfg.n_natural,
                    "seq_len": int(result.natural.tokens.shape[1]),
                    "tokens": result.natural.n_tokens,
                    **window_counts(result.natural),
                    "bos": bool(result.natural.start),
                },
                "repeated_random": {
                    "sequences": int(result.repeated.tokens.shape[0]),
                    "period": result.repeated.period,
                    "seq_len": int(result.repeated.tokens.shape[1]),
                    "tokens": result.repeated.n_tokens,
                    "bos": bool(result.repeated.start),
                },
                **_needle_record(result.needles),
            },
            "seed": cfg.seed,
            "dtype": str(result.dtype).removeprefix("torch."),
            "backend": spec.backend,
            # an encoder measures no loss (its effects are the metric's, clean 0 by definition): null, not 0.0
            "clean_loss_nats": result.clean_loss,
            "metric": {
                "name": scan_metric(spec).name,
                "unit": scan_metric(spec).unit,
                "definition": scan_metric(spec).definition,
                "min_effect": (result.rule or scan_metric(spec)).min_effect,
            },
            "top_heads": top,
            "confirmed": confirmed,
            **({"confirmed_ci_includes_zero": wide} if (wide := wide_interval_notes(result.verifications)) else {}),
            **({"verdict_remarks": said} if (said := verdict_remarks(result)) else {}),
            "warnings": [str(w) for w in result.warnings],
            "verification": {**result.verification, **verification_rules(spec, result.rule)}
            if result.verifications
            else {},
            "removed_heads": [format_head(h) for h in result.removed_heads],
            "interval_rule": interval_rule() + ": top_effect_ci95 of each "
            "ablation's mean per-sequence effect, score_ci95 of each listed head's mean per-sequence score "
            "(not for positional scores, a most-frequent offset), clipped to the score's range ([0, 1], a share)",
            **({"interval_null_reasons": no_ci} if (no_ci := interval_null_reasons(result)) else {}),
            "ablations": [v.to_dict() for v in result.verifications],
            "metrics": result.metrics,
        },
        model=spec.name,
        precision=spec.precision,
        backend=spec.backend,
        device=str(result.device),
        self_check=result.self_check,
        config=cfg,
        timings_s={"load_s": result.load_s, **result.timings},
    )


def _needle_record(needles: NeedleSet | None) -> dict[str, dict]:
    """summary.json's ``tokens.retrieval_needles``: the retrieval score's set and its haystack's
    windows (:func:`~headprobe.analyses.data.window_counts`); {} without one."""
    if needles is None:
        return {}
    return {
        "retrieval_needles": {
            "source": needles.source,
            "sequences": int(needles.tokens.shape[0]),
            "seq_len": int(needles.tokens.shape[1]),
            "needle_len": needles.needle_len,
            **window_counts(needles),
        }
    }


def _top_heads_summary(result: ScanResult, top_n: int) -> dict[str, list[dict]]:
    """summary.json's ``top_heads``: each selected type's top ``top_n`` heads by its ranking
    column, with KV head, score, its interval where there is one, and the type's extra columns."""
    spec, cfg = result.spec, result.config
    assert cfg.types is not None  # set by ScanConfig.__post_init__
    top = {}
    for name in cfg.types:
        det = DETECTORS[name]
        col = result.scores[det.rank_by]
        entries = []
        for layer, head in top_heads(torch.as_tensor(col), top_n):
            e = {
                "head": format_head((layer, head)),
                "kv_head": int(kv_head_of(head, spec.n_heads, spec.n_kv_heads)),
                "score": round(float(col[layer, head]), 4),
            }
            if det.rank_by in result.score_ci95:
                e["score_ci95"] = [round(float(x), 4) for x in result.score_ci95[det.rank_by][:, layer, head]]
            for key, column in det.top_head_extras:
                e[key] = int(result.scores[column][layer, head])
            entries.append(e)
        top[name] = entries
    return top


def interval_null_reasons(result: ScanResult) -> dict[str, str]:
    """Task (``natural``, ``repeated``) -> why its intervals (``score_ci95`` of the types scored on
    it, ``top_effect_ci95`` of its ablations) are null, for each task of fewer than 2 sequences
    (:func:`~headprobe.analyses.statistics.no_interval_reason`; ``--n-natural 1``, ``--n-repeated 1``)."""
    from headprobe.analyses.statistics import no_interval_reason

    sets = {"natural": result.natural, "repeated": result.repeated}
    return {task: why for task, tokens in sets.items() if (why := no_interval_reason(int(tokens.tokens.shape[0])))}


def verification_rules(spec: ModelSpec, rule: VerdictRule | None = None) -> dict:
    """summary.json's statement of the verdict rule (``rule``'s own words; None: the default rule of
    ``spec``'s metric), the controls and the p-values (docs/scan.md)."""
    rule = rule or scan_metric(spec).verdict_rule(verif.ALPHA, verif.CORRECTION)
    return {
        "confirmation_rule": rule.description(),
        "control_rule": "per type, control sets of k heads from the heads outside the top-k of every type judged on the "
        "same task, or, where those leave fewer than 2k heads (a tiny model), outside its own top-k (its rows' "
        "control_excludes; never a removed head); layer-matched: as many heads in each layer as the top-k set; "
        f"uniform: any of those heads; drawn {verif.BATCH} per test a round, a test stopping when settled; the "
        f"zero-ablation rows use the first {verif.SECONDARY_DRAWS} of the same sets",
        "p_value_rule": "sequential Monte Carlo p (Besag & Clifford 1991): a test stops at the draw at which h = "
        "floor(alpha*n_random)+1 control draws reached the top-k effect (within "
        f"{P_VALUE_TIE:g}); p = h/L where the h-th such draw is draw L, else (g+1)/(n_random+1) with g "
        "reaching draws of n_random (a non-finite effect counts as reaching); a test curtailed because no "
        "later draw could make it a rejection after the correction (stop_reason 'futile under the "
        "correction', only once a draw reached its effect) reports the largest p its rule could still "
        "give (p_value_is_bound); n_random is first raised to m/alpha-1, what one of m tests needs to "
        "be confirmed alone (verification.plan); p_adjusted: the correction (bh: Benjamini-Hochberg, "
        "holm: Holm-Bonferroni) over the tested verdicts of this run",
    }


def data_label(result: ScanResult) -> str:
    """What the scores were measured on, for a figure's title: the same head scores differ with the
    sequence length and the text (SmolLM2's 18.6 scores induction tenfold apart at 64 and 4,096 tokens)."""
    nat, rep = result.natural, result.repeated
    source = Path(nat.source).name if nat.source and ("/" in nat.source or "\\" in nat.source) else nat.source
    n, m = nat.tokens.shape[0], rep.tokens.shape[0]
    return (
        f"on {n} sequence{'s' * (n != 1)} of {result.config.seq_len} tokens of {source}; "
        f"{m} random block{'s' * (m != 1)} of {rep.period} tokens, repeated once"
    )


CAVEAT_CHARS = 52
"""The longest no-verdict caveat that names its tasks and types: one line of the narrowest scan figure's
title (a heatmap's, 3.25 in wide: about 55 characters); a longer one becomes :data:`NO_VERDICT_SHORT`."""

NO_VERDICT_SHORT = "NO VERDICT: see summary.json warnings"


def no_verdict_caveat(warnings: Sequence[NoVerdictWarning]) -> str:
    """The line a scan figure's title carries when some verdicts were withheld (a figure travels without
    the terminal's WARNING lines, and one without verdicts must not look like one with them): "NO VERDICT
    for induction: see summary.json" where that fits :data:`CAVEAT_CHARS`, else
    :data:`NO_VERDICT_SHORT`; "" when ``warnings`` (``ScanResult.warnings``) withhold none."""
    tasks = [w.task for w in warnings if w.kind == "task" and w.task is not None]  # a task's warning names it
    types = [w.type_name for w in warnings if w.kind == "type" and w.type_name is not None]
    if not tasks and not types:
        return ""
    what = [f"the {' and '.join(tasks)} task{'s' if len(tasks) > 1 else ''}"] if tasks else []
    what += [", ".join(types)] if types else []
    named = f"NO VERDICT for {' and '.join(what)}: see summary.json"
    return named if len(named) <= CAVEAT_CHARS else NO_VERDICT_SHORT


def ablation_rows(result: ScanResult) -> list[dict]:
    """The verification rows as the ablation figure and its caption list them: by head type in the
    order of ``config.types``, the one order the overview's panels follow too (summary.json keeps the
    order the types were verified in), each type's kinds as verified."""
    return ordered_rows([v.to_dict() for v in result.verifications], result.config.types)


def figure_makers(result: ScanResult) -> dict[str, Callable[[], Figure]]:
    """File stem -> a function of no arguments that draws that figure (a matplotlib Figure): what
    :func:`scan_figures` draws, not drawn yet, so that :func:`write_outputs` can draw, write and
    drop them one at a time and count them in a progress bar."""
    spec = result.spec
    assert result.config.types is not None  # set by ScanConfig.__post_init__
    dets = [DETECTORS[name] for name in result.config.types]
    tag = figs.model_tag(spec.name, spec.weights)
    caveat = no_verdict_caveat(result.warnings)
    tag += f"\n{caveat}" if caveat else ""
    out: dict[str, Callable[[], Figure]] = {}
    removed = figs.removed_cells(spec.n_layers, spec.n_heads, spec.removed_heads)  # as the overview draws them
    out.update(head_metrics.heatmap_makers(dets, result.scores, spec.group_size, tag, spec.causal, removed=removed))
    # the widest figure: the caveat on the model's line leaves the title 3 lines with the data's two
    out["overview"] = overview_maker(result, dets, f"Head scores of {tag.replace(chr(10), '; ')}\n{data_label(result)}")
    for head_type, ex in result.examples.items():
        det = DETECTORS[head_type]
        score = result.scores[det.rank_by][ex["head"]]
        setting = f", period {ex['period']}" if ex.get("period") else ""
        title = (
            f"top {head_type.replace('_', '-')} head {format_head(ex['head'])}: score {score:.2f}{setting}\n"
            f"{tag}"
        )  # on the first scored sequence: the axis label says so
        out[f"pattern_{head_type}"] = partial(
            figs.pattern_plot,
            ex["pattern"],
            ex["labels"],
            title,
            ex.get("marks", ()),
            causal=spec.causal,
            ylabel=f"query position ({ex['sequence']})",
            positions=ex.get("positions"),
        )
    fields = {"W": head_metrics.distant_window(int(result.natural.tokens.shape[1]))}  # as the metric reads it
    out.update(head_metrics.metric_figure_makers(result.scores, spec.group_size, tag, fields, removed=removed))
    if result.composition is not None and {"previous_token", "induction"} <= set(result.config.types):
        out["composition_k"] = partial(
            figs.composition_plot,
            result.composition["k"],
            top_heads(torch.tensor(result.scores["previous_token"]), 5),
            top_heads(torch.tensor(result.scores["induction"]), 5),
            f"K-composition: top previous-token → top induction heads, {tag}",
        )
    rows = ablation_rows(result)  # the overview's type order (dets, from config.types)
    if rows:
        out["ablation"] = partial(figs.ablation_plot, rows, f"Ablation check\n{tag}", rule=result.rule)
    return out


def type_verdicts(verifications: Sequence[Verification]) -> dict[str, bool | None]:
    """Head type -> its verdict's ``confirmed`` (True, False, None: no verdict), from the row it was
    tested with or that says why it has no verdict (summary.json's ``confirmed``); {} without verification."""
    return {v.head_type: v.confirmed for v in verifications if v.tested or v.no_verdict}


def overview_maker(result: ScanResult, dets: Sequence, suptitle: str) -> Callable[[], Figure]:
    """The ``overview`` figure of :func:`figure_makers`, not drawn yet: a panel per type of ``dets``
    (its ranking score). After verification each panel outlines the heads that type's verification
    ablated (its top k) and its title says the verdict (:data:`~headprobe.analyses.verdicts.LABELS`);
    with none, no outlines and the type's name alone. A pruned checkpoint's removed heads
    (``spec.removed_heads``) are drawn as removed, not as unmeasured."""
    verdicts = type_verdicts(result.verifications)
    ablated = {v.head_type: v.top_heads for v in result.verifications}
    panels = [
        (
            det.panel_title + (f"\n{verdict_label(verdicts[det.name])}" if det.name in verdicts else ""),
            result.scores[det.rank_by],
        )
        for det in dets
    ]
    label = figs.overview_score_label([(det.panel_title, det.overview_unit) for det in dets if det.overview_unit])
    n_layers, n_heads = result.spec.n_layers, result.spec.n_heads
    removed = figs.removed_cells(n_layers, n_heads, result.spec.removed_heads)  # drawn as removed
    if not result.verifications:
        return partial(
            figs.scores_overview, panels, result.spec.group_size, suptitle, score_label=label, removed=removed
        )
    marked = [
        parse_heads(",".join(ablated[det.name]), n_layers, n_heads) if ablated.get(det.name) else [] for det in dets
    ]
    first = result.verifications[0]
    mark = figs.overview_mark_label(first.k, result.rule, first.control)
    return partial(
        figs.scores_overview,
        panels,
        result.spec.group_size,
        suptitle,
        marked=marked,
        mark_label=mark,
        score_label=label,
        removed=removed,
    )


def scan_figures(result: ScanResult) -> dict[str, Figure]:
    """File stem -> matplotlib Figure: one heatmap per registered figure of each selected type
    (``heatmap_<column>``), the ``overview`` of their ranking scores, each type's top-head
    ``pattern_<type>``, the metric heatmaps and ``composition_k`` (with metrics) and, after
    verification, the ``ablation`` bars (:func:`figure_makers`, all drawn)."""
    return {stem: make() for stem, make in figure_makers(result).items()}


def write_outputs(
    result: ScanResult,
    out: Path,
    html: bool = False,
    progress: bool = False,
    formats: str | Sequence[str] | None = None,
) -> list[Path]:
    """Write head_scores.csv, all figures in ``formats`` (none with ``"none"`` or ``()``)
    (:func:`headprobe.analyses.outputs.write_outputs`), patterns.npz (if kept), with ``html``
    index.html, and, last, summary.json into the existing directory ``out`` (each file
    atomically), so a directory with summary.json in it is complete. ``progress``: a progress bar
    (stderr) over the figures, each drawn and written as PNG, PDF and SVG in turn (0.5-1 s of CPU
    a figure: 18 for a full scan)."""
    from headprobe.analyses.outputs import write_outputs as write_directory

    def others(out: Path) -> list[Path]:
        written = []
        if result.verifications:
            write_text(
                out / "ablation.caption.txt",
                figs.ablation_caption(ablation_rows(result), result.verification, rule=result.rule),
            )
            written.append(out / "ablation.caption.txt")
        if result.patterns:
            written.append(viewer.save_patterns(out / "patterns.npz", result.patterns))
        if html:
            write_text(out / "index.html", result.html())
            written.append(out / "index.html")
        return written

    return write_directory(
        out,
        True,
        summary=result.summary,
        figures=figure_makers(result),  # none drawn with formats "none"
        tables={"head_scores.csv": result.table.to_csv(index=False, float_format="%.5f")},
        extra=others,
        progress=progress,
        formats=formats,
    )


def top_effect_text(v: Verification, digits: int, width: int = 0) -> str:
    """A verification's top-k effect and its 95% interval over sequences (``top_effect_ci95``), as
    scan's table and import's report print them: ``-0.0235 [-0.0301, -0.0169]``, ``[n/a]`` where there
    is none (fewer than 2 sequences). ``digits`` after the point; ``width`` pads the effect (0: none)."""
    lo, hi = v.top_effect_ci95
    effect = f"{v.top_effect:+{width}.{digits}f}" if width else f"{v.top_effect:+.{digits}f}"
    return f"{effect} {figs.format_interval(lo, hi, f'+.{digits}f')}"


def format_report(result: ScanResult) -> str:
    """The short terminal table: top heads per type and the ablation verdicts."""
    spec = result.spec
    weights, *source = precision_lines(spec.precision)  # a pruned checkpoint's source on a line of its own
    lines = [f"{spec.name}: weights {weights}", *source, ""]
    lines += [f"NOTE: {n}" for n in short_text_notes(result) + bare_encoder_notes(result)]
    plan = (result.verification or {}).get("plan") or {}
    # every verdict withheld by too few draws: the plan's NOTE said why, once; here one line names the types
    short = plan.get("family", []) if plan and verif.short_draws(plan) else []
    warnings = [w for w in result.warnings if not (w.kind == "type" and w.head_type in short)]
    said = [str(w) for w in warnings]
    if short:
        said.insert(
            0,
            f"no verdict for {', '.join(t.replace('_', '-') for t in short)}: --n-random {plan['n_random']} is "
            f"too few (the NOTE before the verification says how many are enough)",
        )
    lines += [f"WARNING: {w}" for w in said] + ([""] if said else [])
    lines += _top_heads_table(result)
    if not result.verifications:
        lines.append("no ablation check (--no-verify): these are pattern scores, not verified findings")
        return "\n".join(lines)
    design, rule = result.verification, result.rule
    assert rule is not None  # a verification records the rule it decided with
    lines.append(
        f"{'ablation (k=' + str(result.config.k) + ')':<22} {'task':<9} {'clean':>6} {'top-k Δ [95% CI]':>22} "
        f"{'control Δ mean/max':>18} {'sets':>4} {'p':>7} {'p adj':>7}  verdict"
    )
    metric = scan_metric(spec)
    d = effect_digits(metric.name)  # 1 - cos effects are small numbers
    for v in result.verifications:
        p_adj = f"{v.p_adjusted:7.4f}" if v.p_adjusted is not None else f"{'-':>7}"
        # a type without a verdict says so on its tested kind's row; the other kind is reported as ever
        says = decided(v.to_dict(), design.get("primary_kind"))
        verdict = v.verdict if says else f"(reported, not tested{reported_on(v, design)})"
        clean = f"{v.clean_loss:6.2f}" if v.clean_loss is not None else f"{'-':>6}"  # an encoder measures no loss
        controls = f"{v.random_mean:+9.{d}f}/{v.random_max:+.{d}f}" if v.draws else f"{'none':>9}/{'-':<{d + 2}}"
        lines.append(
            f"{v.head_type + ' ' + v.kind:<22} {v.task:<9} {clean} {top_effect_text(v, d, 8)} {controls} {v.draws:>4} "
            f"{_p_cell(v)} {p_adj}  {verdict}"
        )
    lines += [
        f"  {v.head_type.replace('_', '-')}: {evidence_text(v.to_dict(), 4)}"
        + _no_verdict_text(v, plan, short, warnings)
        + (
            f"; not confirmed: {rule.shortfall(v.p_adjusted, v.top_effect, v.random_effects)}"
            if v.confirmed is False
            else ""
        )
        for v in result.verifications
        if v.tested or (v.kind == verif.PRIMARY_KIND and v.no_verdict)
    ]
    units = f"losses in {metric.unit}" if metric is LOSS_METRIC else f"Δ in {metric.unit}: {metric.definition}"
    m = design.get("family_size")
    lines.append(
        f"({units}. control: {design.get('control')} sets of k heads outside the task's top-k"
        f"{_own_pool_words(result.verifications)}, at most "
        f"{design.get('max_draws')} per test, stopped early only once it cannot be significant (sets: ablated). p: sequential Monte Carlo "
        f"(Besag & Clifford; ≤: a curtailed test's bound, its range on the lines below); p adj: {design.get('correction')} over the {m} tested "
        f"verdict{'' if m == 1 else 's'}. "
        f"CI: 95% t interval over sequences.\n CONFIRMED: {rule.condition()}; "
        "docs/scan.md has the rule)"
    )
    lines += [f"NOTE: {n}" for n in design.get("notes", [])]
    lines += [f"NOTE: {n}" for n in wide_interval_notes(result.verifications)]
    lines += [f"NOTE: {n}" for said in verdict_remarks(result).values() for n in said]
    return "\n".join(lines)


def _own_pool_words(verifications: Sequence[Verification]) -> str:
    """`` (on the natural task outside the type's own top-2 set only, ...)`` after the report's "outside
    the task's top-k" where a task's types drew outside their own top-k set only (:func:`own_pool_text`)."""
    own = own_pool_text([v.to_dict() for v in verifications], verifications[0].k) if verifications else ""
    return f" ({own.removeprefix('; ')})" if own else ""


def _p_cell(v: Verification) -> str:
    """The report's p column, 7 wide: ``≤0.0877`` for a curtailed test's bound, ``-`` where no control
    set was ablated (no p-value)."""
    cell = p_cell(v.p_value, v.p_value_is_bound)
    return f"{cell:>7}" if cell.startswith(("-", "≤")) else f" {cell:>6}"


def _no_verdict_text(v: Verification, plan: dict, short: list[str], warnings: Sequence[NoVerdictWarning]) -> str:
    """The end of ``v``'s evidence line in :func:`format_report` where it has no verdict: the draws'
    count alone where the report's WARNING names its type (``short``: withheld by too few draws), a
    pointer to its task's WARNING (of ``warnings``, those the report prints) where that says the
    reason, else the reason; "" with a verdict."""
    if v.head_type in short:
        return f"; no verdict: --n-random {plan['n_random']} too few (WARNING above)"
    if not v.no_verdict:
        return ""
    if any(w.kind == "task" and w.task == v.task and w.reason == v.no_verdict for w in warnings):
        return f"; no verdict: see the {v.task} task's WARNING above"
    return f"; no verdict: {v.no_verdict}"


TOP_SHOWN = 4
"""The most top heads per type the terminal table shows (all k of them are in summary.json)."""


def _top_heads_table(result: ScanResult) -> list[str]:
    """:func:`format_report`'s table of each type's top heads, then a blank line; its header says
    what ran: the top k ablated (at most :data:`TOP_SHOWN` of them shown), or nothing with --no-verify."""
    k = result.config.k
    assert k is not None  # set by ScanConfig.resolved
    shown = min(k, TOP_SHOWN) if result.verifications else TOP_SHOWN
    checked = (
        f"the top {k} of each type were ablated" + (f", the first {shown} shown" if shown < k else "")
        if result.verifications
        else f"the top {shown}; no head was ablated (--no-verify)"
    )
    lines = [f"{'head type':<16} top heads (score: see docs/scan.md; {checked}; all in summary.json)"]
    assert result.config.types is not None  # set by ScanConfig.__post_init__
    for name in result.config.types:
        col = result.scores[DETECTORS[name].rank_by]
        tops = top_heads(torch.as_tensor(col), shown)
        lines.append(f"{name:<16} " + ", ".join(f"{format_head(h)} ({col[h]:.2f})" for h in tops))
    return [*lines, ""]


def reported_on(v: Verification, design: dict) -> str:
    """``": the first 5 control sets"``: which sets an untested kind's row was reported on, where its draws
    are fewer than the tested kind's (sequential tests report the other kind on the first
    :data:`~headprobe.analyses.verification.SECONDARY_DRAWS` sets of the same stream); "" where it has all."""
    if not v.draws or v.draws >= (design.get("max_draws") or 0):
        return ""
    return f": the first {v.draws} control sets"


def bare_encoder_notes(result: ScanResult) -> list[str]:
    """A note when an encoder ran without its special tokens (``--no-bos``: no ``[CLS]``, no
    ``[SEP]``): its first-token and last-token columns then score the first and the last word."""
    if result.spec.causal or result.natural.start:
        return []
    return [
        "an encoder scanned without [CLS] and [SEP] (--no-bos): first-token scores attention to the first word "
        "and last-token to the last word, not to the special tokens"
    ]


def short_text_notes(result: ScanResult) -> list[str]:
    """A note when windows of the text were left out as mostly one token, and when it held fewer
    windows than ``--n-natural`` asked for: the natural-text scores and ablations then rest on the
    windows it has (:func:`~headprobe.analyses.data.natural_text_tokens`)."""
    got, asked = int(result.natural.tokens.shape[0]), result.config.n_natural
    notes = left_out_notes(result.natural)
    if result.needles is not None:  # the retrieval score's haystack: windows of another length
        notes += left_out_notes(result.needles, "retrieval haystack")
    if got >= asked:
        return notes
    return notes + [
        f"the text ({result.natural.source}) holds {got} window{'' if got == 1 else 's'} of "
        f"{int(result.natural.tokens.shape[1])} tokens: {got} natural-text sequence{'' if got == 1 else 's'} scored, "
        f"not the {asked} asked for (--n-natural); give more text or a shorter --seq-len"
    ]


def verdict_remarks(result: ScanResult) -> dict[str, list[str]]:
    """Type -> remarks on what its verdict tests (:func:`~headprobe.analyses.verdicts.verdict_remarks`:
    a top-k set sharing most of its heads with another type's; top-k heads scoring at or below a head
    attending uniformly: over its causal context, or an encoder's whole sequence); summary.json's ``verdict_remarks``
    and the report's NOTE lines, only where there is one. {} without verdicts."""
    from headprobe.analyses.verdicts import uniform_baselines_of
    from headprobe.analyses.verdicts import verdict_remarks as remarks

    if not result.verifications:
        return {}
    primary = (result.verification or {}).get("primary_kind", verif.PRIMARY_KIND)
    top = {v.head_type: list(v.top_heads) for v in result.verifications if v.kind == primary}
    scores = {
        t: {f"{layer}.{head}": float(x) for (layer, head), x in np.ndenumerate(result.scores[t])}
        for t in top
        if t in result.scores
    }
    baselines = uniform_baselines_of(result.natural, result.repeated, causal=result.spec.causal)
    no_verdict = {v.head_type for v in result.verifications if v.kind == primary and v.confirmed is None}
    return remarks(top, scores, baselines, no_verdict=no_verdict, causal=result.spec.causal)


def wide_interval_notes(verifications) -> list[str]:
    """A note per CONFIRMED verdict whose 95% t interval over sequences reaches 0 (the report's
    NOTE lines; summary.json's ``confirmed_ci_includes_zero``, import's ``notes``). Two different
    uncertainties: the verdict's permutation test is over control head sets (the top-k set beats
    random heads on these sequences), the interval over the sequences (how large the effect is on
    text like them); a CONFIRMED verdict with an interval reaching 0 was measured on too few
    sequences to size the effect. The verdict rule is not changed by it."""
    return [
        f"{v.head_type.replace('_', '-')} is CONFIRMED against control sets on these sequences, but its 95% "
        f"interval over sequences [{v.top_effect_ci95[0]:+.3g}, {v.top_effect_ci95[1]:+.3g}] reaches 0: the head "
        "set beats random heads (a test over control sets), but on so few sequences the effect's size is "
        "uncertain (the interval is over sequences); use more sequences (--n-natural, --n-repeated)"
        for v in verifications
        if v.confirmed and v.top_effect_ci95[0] <= 0
    ]
