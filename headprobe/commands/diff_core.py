"""The computation of ``headprobe diff`` (torch): both models scored on the same tokens and swept
head by head (:mod:`headprobe.commands.diff_measure`), each head's paired test, the correction over
heads and the flipped roles (:mod:`headprobe.commands.diff_stats`), and the result: its table,
summary, report and figure (drawn by :mod:`headprobe.commands.diff_drawing`); ``run``, ``diff``."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pandas as pd
import torch

from headprobe import options
from headprobe.analyses.ablation import first_scored, sweep_plan, top_heads, unknown_text_reason, untrusted_text_note
from headprobe.analyses.columns import DETECTORS
from headprobe.analyses.data import (
    fit_lengths,
    left_out_notes,
    natural_text_tokens,
    repeated_random_tokens,
    window_counts,
)
from headprobe.analyses.outputs import WritesOutputs
from headprobe.analyses.own_weights import own_change_line, own_weight_change
from headprobe.analyses.scoring import score_plan
from headprobe.analyses.verdicts import uniform_baselines_of
from headprobe.commands.diff import HELP, NEEDS_CAUSAL, DiffConfig, check_resample_sources, layout_refusal  # noqa: F401 - HELP re-exported
from headprobe.commands.diff_drawing import CORRECTION_TITLES, colour_limit, draw_diff, figure_title, no_box_caveat
from headprobe.commands.diff_measure import _measured, tokenizer_refusal
from headprobe.commands.diff_stats import (
    FLAG_OF_TASK,
    _detection,
    _table,
    change_floor,
    changed_heads,
    compare,
    detection_notes,
    quantity_task,
    role_changes,
)
from headprobe.probe.backends.base import LoadedModel
from headprobe.probe.core import memory
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.core.io import open_text_file, summary_envelope
from headprobe.probe.core.reprs import CompactRepr, load_seconds
from headprobe.probe.hooks.ablation import format_head
from headprobe.probe.layout.spec import ModelSpec

DEFAULT_K = 10
"""A type's top-k set, unless that is more than a quarter of the heads (scan's rule)."""


def _layout(model: LoadedModel) -> tuple[int, int, int]:
    s = model.spec
    return s.n_layers, s.n_heads, s.n_kv_heads


@dataclass(repr=False)
class DiffResult(CompactRepr, WritesOutputs):
    """What ``headprobe diff`` found: per quantity the two models' values and the tests, the top-k
    sets of each type in each model, the flipped heads, the table (diff.csv) and the settings.
    ``load_s``: seconds loading model A where diff loaded it, None where the caller passed A loaded
    (:func:`~headprobe.probe.core.reprs.load_seconds`); ``timings``: seconds loading model B (``load_b_s``, left
    out where the caller passed B loaded) and measuring both (``measure_s``)."""

    config: DiffConfig
    spec_a: ModelSpec
    spec_b: ModelSpec
    means: dict[str, dict[str, np.ndarray]]
    tests: dict[str, dict[str, np.ndarray]]
    top: dict[str, dict[str, list]]
    flipped: list[dict]
    table: pd.DataFrame
    timings: dict[str, float]
    n_sequences: dict[str, int]
    requantized: int = 0
    device: str = "cpu"
    self_check: dict | None = None
    load_s: float | None = load_seconds()
    detection: dict = field(default_factory=dict)
    """What the paired test could detect per task (:func:`~headprobe.analyses.robustness.detection_limit`
    over the heads tested), ``{"natural": ..., "repeated": ...}``; summary.json's ``detection``."""
    natural_windows: dict = field(default_factory=dict)
    """The natural-text draw's windows (:func:`~headprobe.analyses.data.window_counts`); summary.json's ``natural_text``."""
    natural_untrusted: str | None = None
    """Why the natural text's scores and effects describe no mechanism (most of its tokens unknown to
    the tokenizer, :func:`~headprobe.analyses.ablation.untrusted_task_reason`), or None; ``natural_text.untrusted``."""
    own: dict = field(default_factory=dict, repr=False)
    """Each head's own parameter change, ``[layer, head]`` arrays (:func:`~headprobe.analyses.own_weights.own_weight_change`)."""
    not_roles: list = field(default_factory=list)
    """Changed top-k crossings at or below a uniformly attending head's score: no role in either model
    (:func:`~headprobe.commands.diff_stats.role_changes`)."""
    baselines: dict = field(default_factory=dict)
    """Type -> the score of a head attending uniformly (:func:`~headprobe.analyses.verdicts.uniform_baselines`)."""

    def _repr_notes(self) -> dict[str, str]:
        q = self.config.requantize_b
        b = (
            f"{self.spec_b.name} re-quantized to {q} (a copy; {self.requantized} matrices rounded)"
            if q
            else self.spec_b.name
        )
        return {"models": f"A = {self.spec_a.name}, B = {b}"}

    def quantity_task(self, quantity: str) -> str:
        """The token set (task) whose sequences a quantity's test pairs."""
        return quantity_task(quantity, self.config.types or ())

    def undetectable(self, quantity: str) -> str | None:
        """Why no change of ``quantity`` could pass the test, in short (the report's "none could be"), or None."""
        task = self.quantity_task(quantity)
        d = self.detection.get(task)
        if d is None or d["detectable"]:
            return None
        need = d["sequences_needed"]
        return (
            f"p >= {d['smallest_p']:.3g} from {d['n_sequences']} {task} sequences, {self.config.correction} needs "
            f"<= {d['p_needed_every_head']:.3g}; "
            + (f"{FLAG_OF_TASK[task]} {need} or more" if need is not None else "raise --n-perm")
        )

    def summary(self) -> dict:
        """summary.json's content: model B and its precision, the layout, the paired test, per
        quantity the significant and changed heads, the top-k sets and flipped roles, and the rules."""
        c = self.config
        return summary_envelope(
            {
                "model_b": self.spec_b.name,
                "weights_precision_b": self.spec_b.precision,
                "requantize_b": c.requantize_b,
                "requantized_matrices": self.requantized,
                "layout": dict(zip(("n_layers", "n_heads", "n_kv_heads"), _spec_layout(self.spec_a))),
                "sequences": self.n_sequences,
                "natural_text": {**self.natural_windows, "untrusted": self.natural_untrusted},
                "test": "paired: d_s = x_B(s) - x_A(s) per sequence; two-sided sign-flip permutation test of mean(d) "
                "(Fisher 1935; exact over all 2^n flips below 13 sequences, else n_perm random flips, p = (1+#)/(1+n_perm)); "
                f"{c.correction} over the heads per quantity; significant: p_adjusted <= {c.alpha}; change: mean(d), "
                "b - a of diff.csv's pooled scores but for positional_fraction (a share of queries at a modal offset, "
                "per sequence in d)",
                "detection": self.detection,
                "quantities": {
                    q: {
                        "task": self.quantity_task(q),
                        "detectable": self.detection[self.quantity_task(q)]["detectable"],
                        "significant": [format_head(h) for h in _heads(t["p_adjusted"] <= c.alpha)],
                        "changed": [format_head(h) for h in _heads(self.changed(q))],
                        "min_change": change_floor(self.means["A"][q], self.means["B"][q], c.min_change),
                        "max_abs_change": float(np.nanmax(np.abs(t["change"]))),
                    }
                    for q, t in self.tests.items()
                },
                "top_k": {t: {m: [format_head(h) for h in hs] for m, hs in v.items()} for t, v in self.top.items()},
                "flipped": self.flipped,
                "not_roles": self.not_roles,
                "uniform_baselines": self.baselines,
                "own_weights": self.own_summary(),
                "changed_rule": f"changed: significant and |change| >= {c.min_change} standard deviations of the quantity over "
                "the heads, pooled over A and B (min_change, in the quantity's units)",
                "role_rule": f"a head's role flipped: in the top-{c.k} set of a type in one model and not the other, its "
                "score of that type changed (changed_rule) in the crossing's direction (up where it entered, down where it left: "
                "one that left while its score rose left because a neighbour rose more), and where it is top-k it scores above uniform_baselines[type] "
                "(a head attending uniformly over its causal context); a top-k swap within the noise is not a flip, and a "
                "changed crossing at or below that score is listed in not_roles (no role in either model)",
            },
            model=self.spec_a.name,
            precision=self.spec_a.precision,
            backend=self.spec_a.backend if self.spec_a.backend == self.spec_b.backend else None,
            device=self.device,
            self_check=self.self_check,
            config=c,
            timings_s={"load_s": self.load_s, **self.timings},
        )

    def own_summary(self) -> dict:
        """summary.json's ``own_weights``: the rule, the heads whose own slices changed (largest first,
        with the largest part) and how many are identical."""
        from headprobe.analyses.own_weights import PARTS, describe, moved_heads

        ch = self.own.get("own_change")
        if ch is None:
            return {}
        moved = moved_heads(self.own)
        return {
            "rule": "own_change: ||W_B - W_A||_F / ||W_A||_F over the head's W_Q, W_K, W_V, W_O slices together "
            "(q/k/v biases with their slices; b_O is the layer's, no head's); under GQA a key/value head's slices "
            "count, whole, for each query head reading it; per part own_change_<part> in diff.csv; 0 = identical. "
            "An ablation effect is a total effect: it changes when a head downstream changes, this does not",
            "parts": [p for p in PARTS if p in self.own],
            "changed": [
                {"head": format_head(h), "own_change": float(ch[h]), "largest_part": describe(self.own, *h)}
                for h in moved
            ],
            "identical": int((np.isfinite(ch) & (ch == 0)).sum()),
        }

    def changed(self, quantity: str) -> np.ndarray:
        """``[layer, head]`` bool: :func:`~headprobe.commands.diff_stats.changed_heads` of ``quantity`` at the run's alpha and floor."""
        m = self.means
        return changed_heads(
            self.tests[quantity], m["A"][quantity], m["B"][quantity], self.config.alpha, self.config.min_change
        )

    def figures(self) -> dict:
        return {"diff": lambda: diff_figure(self)}

    @options.reports_for_readers("diff")
    def report(self) -> str:
        lines = [
            f"{self.spec_a.name} vs {self.spec_b.name}"
            + (f" re-quantized to {self.config.requantize_b}" if self.config.requantize_b else ""),
            "",
        ]
        if self.own:
            lines += [own_change_line(self.own), ""]
        for q, t in self.tests.items():
            sig, changed = _heads(t["p_adjusted"] <= self.config.alpha), _heads(self.changed(q))
            change = t["change"]
            big = ", ".join(
                f"{format_head(h)} ({change[h]:+.3g})" for h in sorted(changed, key=lambda h: -abs(change[h]))[:6]
            )
            none = self.undetectable(q)
            lines.append(
                f"{q:<22} max |change| {np.nanmax(np.abs(change)):.4g}; significant: {len(sig)} heads"
                + (f" (none could be: {none})" if none and not sig else "")
                + f", changed by >= {self.config.min_change} sd: {len(changed)}"
                + (f", largest {big}" if big else "")
            )
        moved = {t: sorted(set(v["A"]) ^ set(v["B"])) for t, v in self.top.items()}
        nones = [self.undetectable(DETECTORS[t].rank_by) for t in self.top]
        lines.append(
            f"\nflipped roles: {len(self.flipped)} heads"
            + (
                f" (none could be: {'; '.join(dict.fromkeys(n for n in nones if n))})"
                if nones and all(nones) and not self.flipped
                else ""
            )
            + (
                f" ({', '.join(f['head'] for f in self.flipped)}; summary.json's flipped says why)"
                if self.flipped
                else ""
            )
            + f"; top-{self.config.k} membership changes, flips or not: "
            + (
                "; ".join(f"{t} {', '.join(format_head(h) for h in hs)}" for t, hs in moved.items() if hs)
                or "unchanged"
            )
        )
        if self.not_roles:
            bases = ", ".join(f"{t} {v:.3g}" for t, v in self.baselines.items() if t in self.top)
            lines.append(
                f"not a role (top-k only where it scores at or below a uniformly attending head): {len(self.not_roles)} heads "
                f"({', '.join(f['head'] for f in self.not_roles)}; uniform: {bases}; summary.json's not_roles)"
            )
        return "\n".join(lines)

    def outputs(self) -> dict[str, Any]:
        """save's files: diff.csv, the figure and, last, summary.json."""
        return dict(
            summary=self.summary,
            figures=self.figures,
            tables={"diff.csv": self.table.to_csv(index=False, float_format="%.6g")},
        )


def _spec_layout(spec) -> tuple[int, int, int]:
    return spec.n_layers, spec.n_heads, spec.n_kv_heads


def _heads(mask: np.ndarray) -> list[tuple[int, int]]:
    return [(int(layer), int(head)) for layer, head in zip(*np.nonzero(mask))]


def memory_plan(model: LoadedModel, config: DiffConfig) -> memory.BatchPlan:
    """The plan of :func:`~headprobe.commands.diff_measure.measure`'s largest batches on ``model``
    (B runs the same, one model at a time): the scores of ``n_natural`` natural-text windows of
    ``seq_len`` tokens and ``n_repeated`` sequences of ``2 period`` tokens plus BOS where the model prepends one
    (:func:`~headprobe.analyses.scoring.score_plan`, one forward each) and each task's exact sweep
    (:func:`~headprobe.analyses.ablation.sweep_plan`); the lengths fitted to ``model``'s context
    (B's, where shorter, only shortens them). Returns the sweep's plan with the larger per-sequence
    estimate, the batch the run's header reports.

    Raises:
        HeadprobeError: one forward of a task's scores or one ablation of its sequences does not fit in
            the memory budget (one line, before any allocation); lengths that cannot run (:func:`fit_lengths`).
    """
    seq_len, period = fit_lengths(model.spec.n_ctx, config.seq_len, config.period, model.trained_periods)
    start = int(model.prepend_bos)
    shapes = [("natural", config.n_natural, seq_len, 0), ("repeated", config.n_repeated, start + 2 * period, None)]
    plans = []
    for task, batch, length, first in shapes:
        first = first_scored(task, start, period) if first is None else first
        score_plan(model, batch, length, first, f"diff's {task} scores")  # refused where it does not fit
        plans.append(sweep_plan(model, batch, length, model.spec.n_layers, first=first))
    return max(plans, key=lambda p: p.per_item)


def batch_line(model: LoadedModel, config: DiffConfig) -> str:
    """The header line of :func:`memory_plan` (for model A; B's batches are the same).

    Raises:
        HeadprobeError: as :func:`memory_plan`.
    """
    return memory_plan(model, config).line()


def _say(line: str) -> None:
    """One line of the plan on stderr, clear of a progress bar."""
    from tqdm.auto import tqdm

    tqdm.write(line, file=sys.stderr)


def compare_models(
    a: LoadedModel, b: LoadedModel, cfg: DiffConfig, progress: bool = False, requantized: int | None = None
) -> DiffResult:
    """Both models measured on the same tokens (A's tokenizer) and compared head by head.
    ``requantized``: how many of B's matrices its re-quantization changed (read where ``cfg.requantize_b``
    is set; None or 0 otherwise).

    Raises:
        HeadprobeError: layouts or vocabularies that differ, B's weights all equal to A's
            (:func:`_refuse_identical`), an encoder, a model whose self-check forbids head ablation, or a
            given --seq-len/--period longer than the shorter context (:func:`fit_lengths`).
    """
    if why := layout_refusal(_layout(a), _layout(b), a.spec.name, b.spec.name):
        raise HeadprobeError(why)
    if a.spec.d_vocab != b.spec.d_vocab:
        raise HeadprobeError(
            f"{a.spec.name} and {b.spec.name} have different vocabularies ({a.spec.d_vocab} vs "
            f"{b.spec.d_vocab} tokens): diff runs both on the same tokens"
        )
    if why := tokenizer_refusal(a.tokenizer, b.tokenizer, a.spec.name, b.spec.name):
        raise HeadprobeError(why)
    _refuse_identical(a, b, cfg, requantized)
    if not (a.spec.causal and b.spec.causal):
        raise HeadprobeError(NEEDS_CAUSAL)
    for m in (a, b):
        m.self_check.require_decomposition("headprobe diff (single-head ablations)")
    spec = a.spec
    types = tuple(t for t in (cfg.types or DETECTORS) if DETECTORS[t].applies_to(True))
    n_total = spec.n_layers * spec.n_heads
    k = cfg.k or max(1, min(DEFAULT_K, n_total // 4))
    seq_len, period = fit_lengths(min(spec.n_ctx, b.spec.n_ctx), cfg.seq_len, cfg.period, a.trained_periods)
    cfg = replace(cfg, types=types, k=k, seq_len=seq_len, period=period)
    memory_plan(a, cfg)  # refused in one line where a batch cannot fit, before any allocation
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    natural = natural_text_tokens(
        a, cfg.n_natural, seq_len, cfg.seed, open_text_file(cfg.text) if cfg.text else None, source=cfg.text
    )
    repeated = repeated_random_tokens(a, cfg.n_repeated, period, cfg.seed)
    if cfg.kind == "resample":
        check_resample_sources({"natural": int(natural.tokens.shape[0]), "repeated": int(repeated.tokens.shape[0])})
    counts = {"natural": int(natural.tokens.shape[0]), "repeated": int(repeated.tokens.shape[0])}
    detection = _detection(spec, counts, cfg)
    untrusted = unknown_text_reason(a, natural)  # the clean loss is not measured yet
    where, what = "summary.json's natural_text.untrusted", "its scores and ablation effects in both models"
    untrusted_notes = [untrusted_text_note(untrusted, where, what)] if untrusted else []
    for note in [*left_out_notes(natural), *untrusted_notes, *detection_notes(detection, cfg)]:
        _say(f"NOTE: {note}")
    per, means = _measured(a, b, natural, repeated, cfg, progress)
    timings["measure_s"] = time.perf_counter() - t0
    tests = compare(per["A"], per["B"], cfg.correction, cfg.n_perm, cfg.seed)
    top = {t: {m: top_heads(torch.as_tensor(means[m][DETECTORS[t].rank_by]), k) for m in ("A", "B")} for t in types}
    baselines = uniform_baselines_of(natural, repeated)
    flipped, not_roles = role_changes(tests, means, top, cfg.alpha, cfg.min_change, baselines)
    own = own_weight_change(a, b)
    return DiffResult(
        cfg,
        a.spec,
        b.spec,
        means,
        tests,
        top,
        flipped,
        _table(means, tests, top, spec.n_layers, spec.n_heads, own),
        timings,
        counts,
        device=str(a.device),
        self_check=a.self_check.to_dict(),
        detection=detection,
        natural_windows=window_counts(natural),
        natural_untrusted=untrusted,
        own=own,
        not_roles=not_roles,
        baselines=baselines,
    )


def run(model: LoadedModel, config: DiffConfig, progress: bool = True) -> DiffResult:
    """The CLI's run: ``model`` is A (loaded by the runner); B is loaded here as the settings ask,
    re-quantized when ``requantize_b`` says so (:func:`headprobe.probe.requantize.requantize`)."""
    t0 = time.perf_counter()
    other = options.load_for(replace(config, model=config.b))
    load_b = time.perf_counter() - t0
    return diff(model, other, progress=progress, _load_b=load_b, _b_loaded_here=True, **_fields(config))


def _fields(config: DiffConfig) -> dict:
    import dataclasses

    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name not in ("model", "b")}


@options.notes_flags("diff")
def diff(
    a: str | LoadedModel,
    b: str | LoadedModel,
    *,
    progress: bool = False,
    _load_b: float = 0.0,
    _b_loaded_here: bool = False,
    **fields,
) -> DiffResult:
    """``headprobe diff A B`` as a Python function: ``a`` and ``b`` are names or loaded models; the
    other keywords are :class:`~headprobe.commands.diff.DiffConfig`'s fields.

    Returns:
        DiffResult: per quantity A's and B's ``[layer, head]`` means (``means``) and the paired tests
            (``tests``: change, p-values), ``table`` (diff.csv, one row per head), top-k sets and flipped
            roles; ``save(out)`` writes what ``headprobe diff`` writes.

    Raises:
        HeadprobeError: bad settings, layouts that differ (one line), or as :func:`compare_models`;
            a message naming flags has a note giving their Python spelling (``e.__notes__``).
    """
    name = lambda m: m if isinstance(m, str) else m.spec.name
    options.check_fields(DiffConfig, fields, "diff", positional=("model", "b"), accepts=diff)
    a, b = (os.fspath(m) if isinstance(m, os.PathLike) else m for m in (a, b))
    for m in (b, a):  # a loaded model runs where it is: the device recorded is A's, else B's
        options.check_model_argument(m, "diff")
        fields = fields if isinstance(m, str) else options.loaded_fields(m, fields)
    cfg = DiffConfig(model=name(a), b=name(b), **fields)
    with options.own_run():  # threads= is this run's, not the process's from now on
        result = _diff(a, b, cfg, progress, _load_b, _b_loaded_here)
    result.inputs = options.config_inputs(cfg)  # what result.save(overwrite=True) must not remove
    return result


def _diff(
    a: str | LoadedModel, b: str | LoadedModel, cfg: DiffConfig, progress: bool, _load_b: float, _b_loaded_here: bool
) -> DiffResult:
    """:func:`diff` once its settings are checked (``cfg``)."""
    from headprobe.probe.requantize import requantize, requantized

    if isinstance(a, str) or isinstance(b, str):
        cfg.preflight()
    memory.set_budget(cfg.memory_budget)  # load_for states it too; two models given loaded need it here
    t0 = time.perf_counter()
    ma = options.load_for(cfg) if isinstance(a, str) else a
    t1 = time.perf_counter()
    mb = options.load_for(replace(cfg, model=cfg.b)) if isinstance(b, str) else b
    load_b = time.perf_counter() - t1 + _load_b if isinstance(b, str) or _b_loaded_here else None
    n = 0
    if cfg.requantize_b and (isinstance(b, str) or _b_loaded_here):  # B is diff's own: rounded in place
        n = requantize(mb, cfg.requantize_b)
    elif cfg.requantize_b:  # the caller's model (maybe A itself): a rounded copy, the caller's left as it was
        mb, n = requantized(mb, cfg.requantize_b)
    result = compare_models(ma, mb, cfg, progress, requantized=n)
    result.requantized = n
    result.load_s = t1 - t0 if isinstance(a, str) else None  # the runner sets A's where it loaded A
    result.timings = {**({} if load_b is None else {"load_b_s": load_b}), **result.timings}
    return result


def _refuse_identical(ma: LoadedModel, mb: LoadedModel, cfg: DiffConfig, n_requantized: int | None) -> None:
    """Refuse, before any measurement, a B whose every weight equals A's (names, shapes and values of
    the two modules' state): each paired test would read 0 and every head "unchanged" after the
    whole run (11 minutes for ``smollm2-135m`` against itself re-quantized to int4, which changes no
    weight of its Q4_1 GGUF: its 16 levels a block already are int4's)."""
    if not ma.same_weights(mb):  # None: weights not in memory to compare (offloaded): measured as usual
        return
    why = (
        f"re-quantizing B to {cfg.requantize_b} changed no weight (they already lie on its grid: "
        f"a Q4_1 GGUF's are int4's; int3 or int8 change them)"
        if cfg.requantize_b and not n_requantized
        else "A and B are the same weights"
    )
    raise HeadprobeError(f"B's weights equal A's in every tensor: {why}; a diff would find no change")


def diff_figure(result: DiffResult):
    """diff.png of a run (:func:`draw_diff`)."""
    c = result.config
    tasks = [result.quantity_task(q) for q in result.tests] if result.detection else []  # none measured: no caveat
    caveat = no_box_caveat(result.detection, tasks, CORRECTION_TITLES.get(c.correction, c.correction))
    title = figure_title(
        result.spec_a.name, result.spec_b.name, c.requantize_b, c.correction, c.alpha, c.min_change, c.k, caveat
    )
    return draw_diff(
        {q: t["change"] for q, t in result.tests.items()},
        {q: result.changed(q) for q in result.tests},
        result.top,
        title,
        result.flipped,
        result.spec_a.n_heads // result.spec_a.n_kv_heads if result.spec_a.n_kv_heads else None,
        {q: colour_limit(result.means["A"][q], result.means["B"][q]) for q in result.tests},
        c.min_change,
    )
