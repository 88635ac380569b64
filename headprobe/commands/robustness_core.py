"""The computation of ``headprobe robustness`` (torch): the conditions, each scored and verified
with scan's machinery (:func:`~headprobe.analyses.scoring.score_tokens`,
:func:`~headprobe.analyses.verification.verify_heads`), the stability table, the summary and the
figure. The settings are :mod:`headprobe.commands.robustness`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pandas as pd
import torch

from headprobe import options
from headprobe.analyses import robustness as rb
from headprobe.analyses import verification as verif
from headprobe.analyses.ablation import first_scored, set_plan, top_heads, untrusted_task_reason
from headprobe.analyses.columns import DETECTORS
from headprobe.analyses.data import (
    TokenSet,
    fit_lengths,
    left_out_notes,
    natural_text_tokens,
    repeated_random_tokens,
    window_counts,
)
from headprobe.analyses.metrics import copying_bytes
from headprobe.analyses.outputs import WritesOutputs
from headprobe.analyses.scoring import score_plan, score_tokens
from headprobe.analyses.vocabulary import PRIMARY_KIND
from headprobe.commands.robustness import DEFAULT_K, HELP, NEEDS_CAUSAL, RobustnessConfig  # noqa: F401 - HELP re-exported
from headprobe.probe.backends.base import LoadedModel
from headprobe.probe.core import ablation_kinds, memory
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.core.io import open_text_file, summary_envelope
from headprobe.probe.core.memory import BatchPlan
from headprobe.probe.core.progress import progress_bar
from headprobe.probe.core.reprs import CompactRepr, load_seconds
from headprobe.probe.hooks.ablation import format_head
from headprobe.probe.layout.spec import ModelSpec

Head = tuple[int, int]

ALTERNATIVE_DETECTORS = {"induction": "copying"}
"""Head type -> the other score it is ranked by in the ``detector`` group: induction by the OV
copying score (Elhage et al. 2021; :func:`headprobe.analyses.composition.copying_score`) instead of
the prefix-matching attention score (Olsson et al. 2022)."""


@dataclass
class Condition:
    """One way of measuring: the data, the tested ablation kind, the control seed and the ranking.

    Attributes:
        name: short label (``base``, ``text half 2``, ``kind zero``, ...). group: ``base`` or one of
            :data:`~headprobe.commands.robustness.GROUPS`.
        natural, repeated: the token sets scored and ablated.
        kind: the tested ablation kind. seed: the control draws' seed.
        detector: type -> the alternative score it is ranked by here (:data:`ALTERNATIVE_DETECTORS`).
        types: the head types this condition can change (None: all).
    """

    name: str
    group: str
    natural: TokenSet
    repeated: TokenSet
    kind: str = PRIMARY_KIND
    seed: int = 0
    detector: dict[str, str] = field(default_factory=dict)
    types: tuple[str, ...] | None = None

    def applies(self, head_type: str) -> bool:
        return self.types is None or head_type in self.types


def conditions(model: LoadedModel, cfg: RobustnessConfig, k: int) -> tuple[list[Condition], list[str]]:
    """The base condition and every varied one ``cfg.vary`` asks for, and notes on those left out
    (and on windows of the text left out as mostly one token).
    The text's ``2 n_natural`` windows are drawn once: the base uses the first half, the data
    group's ``text half 2`` the disjoint second half."""
    assert cfg.seq_len is not None and cfg.period is not None
    text = open_text_file(cfg.text) if cfg.text else None
    both = natural_text_tokens(model, 2 * cfg.n_natural, cfg.seq_len, cfg.seed, text, source=cfg.text)
    n = both.tokens.shape[0] // 2
    if n < 1:
        raise HeadprobeError(
            f"the text gives {both.tokens.shape[0]} window(s) of {cfg.seq_len} tokens: robustness "
            "needs two disjoint halves; use a longer --text or a shorter --seq-len"
        )
    half = [replace(both, tokens=both.tokens[:n]), replace(both, tokens=both.tokens[n : 2 * n])]
    rep = repeated_random_tokens(model, cfg.n_repeated, cfg.period, cfg.seed)
    base = Condition("base", "base", half[0], rep, seed=cfg.seed)
    out, notes = [base], left_out_notes(both)
    nat_types = tuple(t for t in cfg.types if DETECTORS[t].dataset == "natural" or DETECTORS[t].task == "natural")
    rep_types = tuple(t for t in cfg.types if DETECTORS[t].dataset == "repeated" or DETECTORS[t].task == "repeated")
    if "data" in cfg.vary:
        other = cfg.resolved_other_period(model.spec.n_ctx)
        out += [
            replace(base, name="text half 2", group="data", natural=half[1], types=nat_types),
            replace(
                base,
                name=f"repeats seed {cfg.seed + 1}",
                group="data",
                types=rep_types,
                repeated=repeated_random_tokens(model, cfg.n_repeated, cfg.period, cfg.seed + 1),
            ),
            replace(
                base,
                name=f"repeats period {other}",
                group="data",
                types=rep_types,
                repeated=repeated_random_tokens(model, cfg.n_repeated, other, cfg.seed),
            ),
        ]
    for c in [c for c in out if c.types == ()]:  # a data condition no asked-for type is scored on
        out.remove(c)
        notes.append(f"{c.name}: left out (none of --types is scored on its data)")
    if "kind" in cfg.vary:
        for kind in (k_ for k_ in cfg.kinds if k_ != PRIMARY_KIND):
            if ablation_kinds.KINDS.get(kind).needs == "source" and min(n, cfg.n_repeated) < 2:
                notes.append(
                    f"kind {kind}: left out (it takes each sequence's z from another sequence: needs 2 or more)"
                )
                continue
            out.append(replace(base, name=f"kind {kind}", group="kind", kind=kind))
    if "seed" in cfg.vary:
        out += [
            replace(base, name=f"controls seed {cfg.seed + i}", group="seed", seed=cfg.seed + i)
            for i in range(1, cfg.control_seeds + 1)
        ]
    if "detector" in cfg.vary:
        alt = {t: a for t, a in ALTERNATIVE_DETECTORS.items() if t in cfg.types}
        out += [
            replace(base, name=f"{t} by {a}", group="detector", detector={t: a}, types=(t,)) for t, a in alt.items()
        ]
        if not alt:
            notes.append(
                f"detector: none of the types has an alternative detector ({', '.join(ALTERNATIVE_DETECTORS)} has)"
            )
    return out, notes


@dataclass
class Outcome:
    """One condition's result: each type's top-k set, its tested verdict and the evidence."""

    condition: Condition
    top: dict[str, list[Head]]
    confirmed: dict[str, bool | None]
    p_adjusted: dict[str, float | None]
    top_effect: dict[str, float]
    no_verdict: dict[str, str | None]
    evidence: dict[str, dict] = field(default_factory=dict)
    """type -> the counts behind its p (:data:`EVIDENCE`): raw p, control sets drawn, how many
    reached the top-k effect, the largest control effect, why the sequential test stopped."""


EVIDENCE = ("p_value", "p_value_is_bound", "draws", "exceedances", "random_max", "stop_reason")
"""The fields of scan's :class:`~headprobe.analyses.ablation.Verification` each condition's verdict
keeps in summary.json: ``p = (1 + exceedances) / (1 + draws)`` checks against them."""


@dataclass(repr=False)
class RobustnessResult(CompactRepr, WritesOutputs):
    """What ``headprobe robustness`` found.

    Attributes:
        config: the settings, model-dependent defaults filled in.
        spec: the model's ModelSpec.
        outcomes: one :class:`Outcome` per condition, the base first.
        table: robustness.csv, one row per (type, head in any condition's top-k set).
        types: type -> ``{"conditions", "mean_jaccard", "verdict_holds_everywhere", ...}``.
        notes: conditions left out and why, and windows of the text left out as mostly one token.
        timings: seconds of the run (``run_s``).
        load_s: seconds spent loading the model where robustness loaded it; None where the caller passed a model it loaded (:func:`~headprobe.probe.core.reprs.load_seconds`).
    """

    config: RobustnessConfig
    spec: ModelSpec
    outcomes: list[Outcome]
    table: pd.DataFrame
    types: dict[str, dict]
    notes: list[str]
    timings: dict[str, float]
    device: str = "cpu"
    self_check: dict | None = None
    load_s: float | None = load_seconds()

    def summary(self) -> dict:
        """summary.json's content (the house envelope, :func:`~headprobe.probe.core.io.summary_envelope`)."""
        return summary_envelope(
            {
                "conditions": [
                    {
                        "name": o.condition.name,
                        "group": o.condition.group,
                        "kind": o.condition.kind,
                        "seed": o.condition.seed,
                        "detector": o.condition.detector,
                        "types": list(o.condition.types) if o.condition.types is not None else None,
                        "natural": {
                            "sequences": int(o.condition.natural.tokens.shape[0]),
                            **window_counts(o.condition.natural),
                        },
                        "repeated": {
                            "sequences": int(o.condition.repeated.tokens.shape[0]),
                            "period": o.condition.repeated.period,
                        },
                    }
                    for o in self.outcomes
                ],
                "types": self.types,
                "notes": self.notes,
                "stability_rule": "stability: the fraction of a type's conditions whose top-k set holds the head; "
                "stability_ci95: percentile bootstrap over those conditions (Efron & Tibshirani 1993, "
                f"{self.config.n_boot} resamples); mean_jaccard: the mean Jaccard index |A∩B|/|A∪B| "
                "over every pair of its conditions' top-k sets; verdict_holds_everywhere: CONFIRMED "
                "(scan's rule) in every one of its conditions; least_top_k_overlap: the condition whose top-k set "
                "shares the fewest heads with the base's, and how many",
            },
            model=self.spec.name,
            precision=self.spec.precision,
            backend=self.spec.backend,
            device=self.device,
            self_check=self.self_check,
            config=self.config,
            timings_s={"load_s": self.load_s, **self.timings},
        )

    def figures(self) -> dict:
        return {"robustness": lambda: stability_figure(self)}

    @options.reports_for_readers("robustness")
    def report(self) -> str:
        return format_report(self)

    def outputs(self) -> dict[str, Any]:
        """save's files: robustness.csv, the figure and, last, summary.json."""
        return dict(
            summary=self.summary,
            figures=self.figures,
            tables={"robustness.csv": self.table.to_csv(index=False, float_format="%.4f")},
        )


def _scored(
    model: LoadedModel, cond: Condition, types: tuple[str, ...], cache: dict
) -> tuple[dict, dict, torch.Tensor]:
    """``(scores, clean per-sequence losses by task, mean_z)`` of a condition's data (cached by data)."""
    key = (id(cond.natural), id(cond.repeated))
    if key not in cache:
        nat, rep = cond.natural, cond.repeated
        s1, l1, mean_z = score_tokens(
            model, nat, "natural", first_scored("natural", nat.start, None), mean_z=True, types=types
        )
        s2, l2, _ = score_tokens(model, rep, "repeated", first_scored("repeated", rep.start, rep.period), types=types)
        cache[key] = ({c: v.numpy() for c, v in {**s1, **s2}.items()}, {"natural": l1, "repeated": l2}, mean_z)
    return cache[key]


def evaluate(
    model: LoadedModel, cond: Condition, cfg: RobustnessConfig, k: int, cache: dict, alternatives: dict[str, np.ndarray]
) -> Outcome:
    """One condition: scores (or the alternative ranking), top-k sets and scan's verification
    (:func:`~headprobe.analyses.verification.verify_heads`) with the condition's kind and seed."""
    assert isinstance(cfg.types, tuple)
    scores, clean, mean_z = _scored(model, cond, cfg.types, cache)
    rank = {
        t: alternatives[cond.detector[t]] if t in cond.detector else scores[DETECTORS[t].rank_by] for t in cfg.types
    }
    top = {t: top_heads(torch.as_tensor(rank[t]), k) for t in cfg.types}
    task_of = {t: task for t in cfg.types if (task := DETECTORS[t].task) is not None}
    sets = {"natural": cond.natural, "repeated": cond.repeated}
    untrusted = {task: untrusted_task_reason(float(v.double().mean()), model.spec.d_vocab) for task, v in clean.items()}
    settings = verif.VerificationSettings(
        k=k,
        n_random=cfg.n_random,
        alpha=cfg.alpha,
        control=cfg.control,
        correction=cfg.correction,
        seed=cond.seed,
        primary_kind=cond.kind,
    )
    sources = (
        {task: ts.tokens.roll(1, dims=0) for task, ts in sets.items()}
        if ablation_kinds.KINDS.get(cond.kind).needs == "source"
        else None
    )
    removed = list(getattr(model.spec, "removed_heads", ()) or ())
    rows, _ = verif.verify_heads(
        model, top, task_of, sets, clean, mean_z, settings, untrusted=untrusted, removed=removed, sources=sources
    )
    tested = {v.head_type: v for v in rows if v.kind == cond.kind}
    return Outcome(
        cond,
        top,
        {t: v.confirmed for t, v in tested.items()},
        {t: v.p_adjusted for t, v in tested.items()},
        {t: v.top_effect for t, v in tested.items()},
        {t: v.no_verdict for t, v in tested.items()},
        {t: {f: getattr(v, f) for f in EVIDENCE} for t, v in tested.items()},
    )


def _type_record(
    name: str, outcomes: list[Outcome], base_scores: np.ndarray, n_boot: int, seed: int
) -> tuple[dict, list[dict]]:
    """One type's summary record and its rows of robustness.csv."""
    mine = [o for o in outcomes if o.condition.applies(name)]
    sets = [o.top[name] for o in mine]
    heads = sorted({h for s in sets for h in s}, key=lambda h: (-float(np.nan_to_num(base_scores[h], nan=-np.inf)), h))
    rows = []
    for h in heads:
        frac, lo, hi = rb.stability(sets, h, n_boot, seed)
        rows.append(
            {
                "type": name,
                "layer": h[0],
                "head": h[1],  # the index within the layer, as in head_scores.csv and diff.csv
                "base_score": base_scores[h],
                "stability": frac,
                "ci95_low": lo,
                "ci95_high": hi,
                "conditions": len(sets),
                **{o.condition.name: int(h in o.top[name]) for o in mine},
            }
        )
    record = {
        "conditions": [o.condition.name for o in mine],
        "top_k": {o.condition.name: [format_head(h) for h in o.top[name]] for o in mine},
        "verdicts": {
            o.condition.name: {
                "confirmed": o.confirmed.get(name),
                "p_adjusted": o.p_adjusted.get(name),
                "top_effect": o.top_effect.get(name),
                "no_verdict": o.no_verdict.get(name),
                **o.evidence.get(name, {}),
            }
            for o in mine
        },
        "mean_jaccard": rb.mean_pairwise_jaccard(sets),
        "verdict_holds_everywhere": all(o.confirmed.get(name) is True for o in mine),
        "least_top_k_overlap": _least_overlap(name, mine),
        "stability": {
            format_head((r["layer"], r["head"])): {"stability": r["stability"], "ci95": [r["ci95_low"], r["ci95_high"]]}
            for r in rows
        },
    }
    return record, rows


def _least_overlap(name: str, mine: list[Outcome]) -> dict | None:
    """The condition whose top-k set of type ``name`` shares the fewest heads with the base's
    (the first such), as ``{"condition", "shared", "k"}``; None with no condition beside the base."""
    base = set(mine[0].top[name])
    shared = [(len(base & set(o.top[name])), o.condition.name) for o in mine[1:]]
    if not shared:
        return None
    n, where = min(shared, key=lambda s: s[0])
    return {"condition": where, "shared": n, "k": len(base)}


def _verdict_words(rec: dict, overlap: bool = True) -> str:
    """The report's words for what holds of one type: how many of its conditions confirm its
    verdict and how many reached none ("?"; all of them: said so, not "CONFIRMED in 0"), and
    (``overlap``) its least top-k overlap with the base's set and where."""
    n = len(rec["conditions"])
    held = sum(v["confirmed"] is True for v in rec["verdicts"].values())
    none = sum(v["confirmed"] is None for v in rec["verdicts"].values())  # "?": no verdict could be reached
    if none == n:
        words = f"no verdict in any of the {n} conditions"
    else:
        words = f"CONFIRMED in {held} of {n} conditions" + (f" (no verdict in {none})" if none else "")
    least = rec.get("least_top_k_overlap")
    if least and overlap:
        words += (
            f"; top-{least['k']} least shared with base: {least['shared']}/{least['k']} heads ({least['condition']})"
        )
    return words


def resolved(model: LoadedModel, config: RobustnessConfig) -> RobustnessConfig:
    """``config`` with the model-dependent defaults filled in: ``k`` (10, or a quarter of the heads
    if fewer) and the lengths fitted to the context (:func:`fit_lengths`).

    Raises:
        HeadprobeError: an encoder, a model whose self-check forbids head ablation, k at least the
            head count, a given --seq-len/--period/--other-period longer than the context, or with the
            data group no other period beside the period (:meth:`RobustnessConfig.resolved_other_period`).
    """
    spec = model.spec
    options.require_causal(spec, NEEDS_CAUSAL)
    model.self_check.require_decomposition("headprobe robustness (its verdicts are ablations)")
    n_heads = spec.n_layers * spec.n_heads
    k = config.k or max(1, min(DEFAULT_K, n_heads // 4))
    if k >= n_heads:
        raise HeadprobeError(f"--top-k {k} leaves no control heads: the model has {n_heads} heads")
    seq_len, period = fit_lengths(spec.n_ctx, config.seq_len, config.period, model.trained_periods)
    config.check_other_period(spec.n_ctx)  # its sequences ran past the context without a word
    cfg = replace(config, k=k, seq_len=seq_len, period=period)
    if "data" in cfg.vary:
        cfg.resolved_other_period(spec.n_ctx)  # none beside a fitted period: refused before any work
    return cfg


def _task_shapes(model: LoadedModel, cfg: RobustnessConfig) -> list[tuple[str, int, int, int]]:
    """``(task, sequences, tokens, first scored)`` of every token set a condition scores and ablates
    (``cfg`` :func:`resolved`): ``n_natural`` windows of ``seq_len`` tokens (each half of the text),
    ``n_repeated`` sequences of two blocks of ``period`` tokens after BOS where the model prepends one
    and, with the data group, of ``other_period`` tokens (:func:`conditions`)."""
    assert cfg.seq_len is not None and cfg.period is not None  # set by resolved
    start = int(model.prepend_bos)
    periods = [cfg.period]
    if "data" in cfg.vary:
        periods.append(cfg.resolved_other_period(model.spec.n_ctx))
    return [("natural", cfg.n_natural, cfg.seq_len, first_scored("natural", start, None))] + [
        ("repeated", cfg.n_repeated, start + 2 * p, first_scored("repeated", start, p)) for p in dict.fromkeys(periods)
    ]


def memory_plan(model: LoadedModel, config: RobustnessConfig) -> tuple[BatchPlan, int]:
    """``(plan, sequences)``: the verification's control-set batch of the token set with the larger
    per-sequence estimate (:func:`~headprobe.analyses.ablation.set_plan`, as scan's) and that set's
    sequence count. First each token set's scoring forward over its whole batch is checked to fit
    (:func:`~headprobe.analyses.scoring.score_plan`, :func:`_task_shapes`) and, where a condition ranks
    induction by the OV copying score on a CPU, the copying score's float32 weight copies
    (:func:`~headprobe.analyses.metrics.copying_bytes`).

    Raises:
        HeadprobeError: a scoring forward, the copying score or one control set's ablation of a token
            set does not fit in the memory budget (one line, before any allocation); or as :func:`resolved`.
    """
    cfg = resolved(model, config)
    shapes = _task_shapes(model, cfg)
    for task, b, t, first in shapes:
        score_plan(model, b, t, first, f"robustness's {task} scores")  # refused where it does not fit
    alternative = "detector" in cfg.vary and any(t in ALTERNATIVE_DETECTORS for t in cfg.types)
    if alternative and torch.device(model.device).type == "cpu":  # its copies are host memory, not a GPU's
        what = "robustness's copying score (float32 copies of the embedding, unembedding and head weights)"
        memory.weights_fit(copying_bytes(model.spec), model.device, what)
    return max(((set_plan(model, b, t), b) for _, b, t, _ in shapes), key=lambda x: x[0].per_item)


def batch_line(model: LoadedModel, config: RobustnessConfig) -> str:
    """The header line of :func:`memory_plan`: the control-set batch, as scan's.

    Raises:
        HeadprobeError: as :func:`memory_plan`.
    """
    plan, b = memory_plan(model, config)
    return f"{plan.line()}: {plan.items // b} control sets of {b} sequences per pass"


def run(model: LoadedModel, config: RobustnessConfig, progress: bool = True) -> RobustnessResult:
    """Every condition of ``config`` on a loaded (causal) model; see the module docstring.

    Raises:
        HeadprobeError: an encoder, a model whose self-check forbids head ablation, k too large, a
            given --seq-len/--period longer than the context (:func:`fit_lengths`), a step that
            does not fit in the memory budget (:func:`memory_plan`), or a text too short for two halves.
    """
    spec = model.spec
    cfg = resolved(model, config)
    memory_plan(model, cfg)  # refuses a step that cannot fit, before any allocation
    k = cfg.k
    assert k is not None  # set by resolved
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    conds, notes = conditions(model, cfg, k)
    alternatives = {}
    if any(c.detector for c in conds):
        from headprobe.analyses.composition import copying_score

        alternatives["copying"] = copying_score(model).numpy()
    cache: dict = {}
    outcomes = [
        evaluate(model, c, cfg, k, cache, alternatives)
        for c in progress_bar(conds, desc="conditions", unit="condition", progress=progress)
    ]
    timings["run_s"] = time.perf_counter() - t0
    base_scores, _, _ = _scored(model, conds[0], cfg.types, cache)  # type: ignore[arg-type]
    types, rows = {}, []
    for name in cfg.types:
        types[name], r = _type_record(name, outcomes, base_scores[DETECTORS[name].rank_by], cfg.n_boot, cfg.seed)
        rows += r
    table = pd.DataFrame(rows)
    # a condition's 0/1 column is empty on the rows of a type it does not apply to: nullable integers
    # keep it 0/1 there (a float column would be written 0.0000/1.0000 beside the integer ones)
    table = table.astype({o.condition.name: "Int64" for o in outcomes if o.condition.name in table})
    return RobustnessResult(
        cfg, spec, outcomes, table, types, notes, timings, str(model.device), model.self_check.to_dict()
    )


IN_TOP_K, NOT_IN_TOP_K = "#1f4e8c", "#e8e8e8"
""":func:`stability_plot`'s cell colours: the head in the condition's top-k set (dark), not in it (light)."""
VERDICT_MARKS = {True: "✓", False: "✗", None: "?"}
""":func:`stability_plot`'s mark above a condition's column: its verdict (``–``: the condition is not the type's)."""
STABILITY_LABEL = "stability: the type's conditions with\nthe head in top-k [95% bootstrap CI]"
""":func:`stability_plot`'s right axis label: what the numbers beside each row are, with their unit."""


def verdict_mark(verdict: dict | None) -> str:
    """The mark robustness.png draws above a condition's column and the terminal's verdict line
    prints for it (the same one): a :data:`VERDICT_MARKS` mark where the condition ran for the type
    (``?``: it ran and reached no verdict), ``–`` where it is not the type's (``verdict`` None)."""
    return "–" if verdict is None else VERDICT_MARKS[verdict["confirmed"]]


def _no_verdict_notes(types: dict[str, dict]) -> list[str]:
    """One NOTE per condition that ran and reached no verdict (its ``?``): the types and the reason
    (summary.json's ``types.<type>.verdicts.<condition>.no_verdict``)."""
    why: dict[tuple[str, str], list[str]] = {}
    for name, rec in types.items():
        for c, v in rec["verdicts"].items():
            if v["confirmed"] is None:
                why.setdefault((c, v.get("no_verdict") or "no reason recorded"), []).append(name)
    return [f"{c}: no verdict (?) for {', '.join(names)}: {reason}" for (c, reason), names in why.items()]


def stability_text(fraction: float, lo: float, hi: float, n: int) -> str:
    """``"7/8 [5/8, 8/8]"``: a stability and its interval as counts of the ``n`` conditions where
    each is a whole number of them to robustness.csv's 4 decimals (the fraction always is; a bootstrap
    quantile usually is), else to 2 decimals. Counts avoid ``.2f``'s round-half-to-even, which printed 5/8 as 0.62 but 7/8 as 0.88."""

    def part(x: float) -> str:
        count = x * n
        if np.isfinite(count) and abs(count - round(count)) < 1e-4 * n:  # robustness.csv keeps 4 decimals
            return f"{round(count)}/{n}"
        return f"{x:.2f}"

    return f"{part(fraction)} [{part(lo)}, {part(hi)}]"


def stability_figure(result: RobustnessResult):
    """robustness.png of ``result`` (:func:`stability_plot`)."""
    conds, k = [o.condition.name for o in result.outcomes], result.config.k
    assert k is not None  # set by resolved() before the run
    return stability_plot(result.table, result.types, conds, result.spec.name, k, result.spec.weights)


def stability_plot(
    table: pd.DataFrame, types: dict[str, dict], conds: list[str], model: str, k: int, weights: str = ""
):
    """Heads x conditions for each type of ``types`` (summary.json's ``types``): a cell dark where the head
    is in the condition's top-``k`` set, light where not, blank where the condition is not the type's (a
    legend says so); the verdict of each condition above its column; each row's head on the left and its
    stability with its 95% bootstrap interval on the right axis. ``table``: robustness.csv (``type``,
    ``layer``, ``head``, ``stability``, ``ci95_low``, ``ci95_high`` and one 0/1 column per condition of
    ``conds``, in summary.json's order); the model as titles name it (:func:`~headprobe.analyses.figures.title_name`
    of ``model`` and its ``weights``); what the command draws and scripts/redraw_figures.py redraws."""
    from matplotlib.figure import Figure

    from headprobe.analyses.figures import title_name

    names = list(types)
    n_rows = [max(1, sum(table["type"] == t)) for t in names] if len(table) else [1] * len(names)
    fig = Figure(figsize=(3.4 + 0.55 * len(conds), 2.2 + 0.26 * sum(n_rows) + 0.9 * len(names)), layout="constrained")
    axes = fig.subplots(len(names), 1, squeeze=False, gridspec_kw={"height_ratios": [r + 3 for r in n_rows]})[:, 0]
    for ax, name in zip(axes, names):
        _stability_panel(ax, table[table["type"] == name], types[name], conds)
        ax.set_title(
            f"{name.replace('_', '-')}: mean top-k Jaccard {types[name]['mean_jaccard']:.2f}; "
            f"{_verdict_words(types[name], overlap=False)}",
            fontsize=9,
        )
    fig.legend(handles=_stability_keys(), loc="outside lower center", ncols=2, frameon=False, fontsize=7)
    fig.suptitle(f"Label stability of {title_name(model, weights)}, k = {k}", fontsize=10)
    return fig


def _stability_panel(ax, rows: pd.DataFrame, rec: dict, conds: list[str]) -> None:
    """One type's panel of :func:`stability_plot`: its rows' cells, the verdict marks, both y axes."""
    from matplotlib.colors import ListedColormap

    grid = np.full((len(rows), len(conds)), np.nan)
    for j, c in enumerate(conds):
        if c in rows:
            grid[:, j] = rows[c].to_numpy(dtype=float, na_value=np.nan)
    cmap = ListedColormap([NOT_IN_TOP_K, IN_TOP_K])
    ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, vmin=0, vmax=1, aspect="auto", interpolation="nearest")
    ax.set_yticks(range(len(rows)), [format_head((l, h)) for l, h in zip(rows["layer"], rows["head"])], fontsize=7)
    ax.set_ylabel("head (layer.head)", fontsize=7)
    right = ax.secondary_yaxis("right")
    right.set_yticks(
        range(len(rows)),
        [
            stability_text(s, lo, hi, n)
            for s, lo, hi, n in zip(rows["stability"], rows["ci95_low"], rows["ci95_high"], rows["conditions"])
        ],
        fontsize=7,
    )
    right.set_ylabel(STABILITY_LABEL, fontsize=7)
    ax.set_xticks(range(len(conds)), conds, rotation=40, ha="right", fontsize=7)
    for j, c in enumerate(conds):
        mark = verdict_mark(rec["verdicts"].get(c))
        color = {"✓": "#1a7f37", "✗": "#b42318"}.get(mark, "#555")
        ax.text(j, -0.8, mark, ha="center", va="bottom", fontsize=9, color=color)
    ax.set_ylim(len(rows) - 0.5, -1.6)


def _stability_keys() -> list:
    """:func:`stability_plot`'s legend: the three kinds of cell and the marks above the columns."""
    from matplotlib.patches import Patch

    marks = f"{VERDICT_MARKS[True]} CONFIRMED, {VERDICT_MARKS[False]} not confirmed, {VERDICT_MARKS[None]} no verdict"
    return [
        Patch(facecolor=IN_TOP_K, label="head in the condition's top-k set"),
        Patch(facecolor=NOT_IN_TOP_K, label="head not in it"),
        Patch(facecolor="white", edgecolor="#999999", lw=0.5, label="blank: condition not run for this type"),
        Patch(color="none", label=f"above each column, the condition's verdict: {marks}, – not run"),
    ]


def _counts(v: dict) -> str:
    """`` (p_adj 0.05; 0 of 19 draws reached it)``: a verdict's adjusted p and the control sets behind
    its raw p, ``(1 + exceedances) / (1 + draws)``; nothing where no control set was drawn."""
    if not v.get("draws") or v.get("p_adjusted") is None or v.get("exceedances") is None:
        return ""
    return f" (p_adj {v['p_adjusted']:.3g}; {v['exceedances']} of {v['draws']} draws reached it)"


def format_report(result: RobustnessResult) -> str:
    """The terminal table: per type the Jaccard, the verdicts and the least stable top heads."""
    lines = [f"{result.spec.name}: {len(result.outcomes)} conditions, k = {result.config.k}", ""]
    for name, rec in result.types.items():
        words = {VERDICT_MARKS[True]: "CONFIRMED", VERDICT_MARKS[False]: "not confirmed"}
        verdicts = ", ".join(
            f"{c}: {words.get(verdict_mark(v), verdict_mark(v) + ' (no verdict: NOTE below)')}{_counts(v)}"
            for c, v in rec["verdicts"].items()
        )
        left = [o.condition.name for o in result.outcomes if o.condition.name not in rec["conditions"]]
        lines.append(
            f"{name}: mean top-k Jaccard {rec['mean_jaccard']:.3f} over {len(rec['conditions'])} conditions"
            + (f" ({', '.join(left)}: not for this type)" if left else "")
            + f"; {_verdict_words(rec)}"
        )
        lines.append(f"  verdicts: {verdicts}")
        rows = result.table[result.table["type"] == name].head(12)
        lines.append(
            "  "
            + ", ".join(
                f"{format_head((l, h))} {stability_text(s, lo, hi, n)}"
                for l, h, s, lo, hi, n in zip(
                    rows["layer"],
                    rows["head"],
                    rows["stability"],
                    rows["ci95_low"],
                    rows["ci95_high"],
                    rows["conditions"],
                )
            )
        )
    lines += [f"NOTE: {n}" for n in [*result.notes, *_no_verdict_notes(result.types)]]
    return "\n".join(lines)


robustness = options.command_function(
    RobustnessConfig,
    run,
    "robustness",
    "Each head type's top-k set and verdict under varied data, ablation kinds, control seeds and detectors, and "
    "each head's stability (see ``headprobe robustness --help``).",
    example='``types="induction,positional"``',
)

__all__ = [
    "RobustnessConfig",
    "RobustnessResult",
    "Condition",
    "Outcome",
    "conditions",
    "evaluate",
    "resolved",
    "memory_plan",
    "batch_line",
    "run",
    "robustness",
]
