"""The verdict rule (:class:`VerdictRule`: what CONFIRMED needs, its labels and its one wording)
and how a verdict's p-value and stopping are said in words, the same on the terminal, in
summary.json, ablation.caption.txt, on ablation.png, in the viewer and the atlas (torch-free: rows
are :class:`~headprobe.analyses.ablation.Verification` dicts, as in summary.json's ``ablations``).

A curtailed test's p-value is a bound (the largest p its rule could still have given, a valid
p-value) and the full test's p would have been between the smallest it could still reach and that
bound, so it is written ``p in [0.059, 0.75]`` with why the test stopped, never as a plain
``p = 0.75``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

from headprobe.analyses.vocabulary import within_level

CORRECTION_NAMES = {"bh": "BH", "holm": "Holm"}
"""Short names of the corrections in verdict texts."""
CORRECTION_LONG_NAMES = {"bh": "Benjamini-Hochberg", "holm": "Holm-Bonferroni"}
"""Full names of the corrections (the rule's wording)."""

LABELS: dict[bool | None, str] = {True: "CONFIRMED", False: "not confirmed", None: "no verdict"}
"""A tested verdict's label by its ``confirmed`` (None: no verdict)."""
VERDICTS = tuple(LABELS.values())
"""Every label, in that order."""
NOT_TESTED = "not tested"
"""What an untested row (the reported kind) says in place of a verdict."""
NOT_RUN = "not run: cannot reach alpha"
"""The ``stop_reason`` of a tested verdict none of whose control sets was ablated: the sets that
exist cannot give a p-value that reaches alpha after the correction
(:func:`headprobe.analyses.verification.verify_heads`)."""
EFFECT_RATIO = 2.0
"""The default ratio: the top-k effect must be at least this many times the mean control effect."""
MIN_EFFECT = {"loss": 0.05, "embedding_cosine": 0.01}
"""The default effect floor per metric (:class:`~headprobe.analyses.ablation.AblationMetric` name):
0.05 nats/token of loss; 0.01 of ``1 - cos`` for an encoder's sentence embedding (the embedding
turns by about 8 degrees), set before any encoder was scanned as the loss floor's analogue."""
UNITS = {"loss": "nats/token", "embedding_cosine": "1 - cos"}
"""The unit of each metric's effects (:class:`~headprobe.analyses.ablation.AblationMetric` name), as
summary.json's ``metric.unit``, the rule, the caption, the figure and the viewer write it."""


def label(confirmed: bool | None) -> str:
    """``CONFIRMED``, ``not confirmed`` or ``no verdict`` (:data:`LABELS`)."""
    return LABELS[confirmed]


def verdict_counts(confirmed: Mapping[str, bool | None]) -> str:
    """``2 CONFIRMED (induction, previous_token); 1 not confirmed (duplicate)``: head type ->
    ``confirmed`` (summary.json's ``confirmed``) counted by :func:`label`, each count's types in
    brackets; ``""`` for none."""
    groups: dict[str, list[str]] = {}
    for name, verdict in confirmed.items():
        groups.setdefault(label(verdict), []).append(name)
    return "; ".join(f"{len(names)} {said} ({', '.join(names)})" for said, names in groups.items())


@dataclass(frozen=True)
class VerdictRule:
    """The rule that makes a tested verdict CONFIRMED, in one place: the verification decides with
    it (:meth:`confirms`) and every output states it from it (:meth:`condition`,
    :meth:`description`), never in words of its own.

    CONFIRMED when the tested kind's adjusted p-value (``correction`` over the run's tested
    verdicts) is at most ``alpha`` and the top-k effect is at least ``min_effect`` (in ``unit``) and
    at least ``ratio`` times the mean effect of the control sets ablated (docs/scan.md, "How a
    verdict is reached").

    Attributes:
        alpha: significance level after the correction.
        correction: ``bh`` (Benjamini-Hochberg) or ``holm`` (Holm-Bonferroni).
        min_effect: the effect floor, in ``unit``.
        unit: the effect's unit (``nats/token``, ``1 - cos``).
        ratio: how many times the mean control effect the top-k effect must reach.
        tested_kind: the ablation kind the verdict is tested with.
        reported_kinds: the kinds reported beside it, not tested.
    """

    alpha: float = 0.05
    correction: str = "bh"
    min_effect: float = MIN_EFFECT["loss"]
    unit: str = UNITS["loss"]
    ratio: float = EFFECT_RATIO
    tested_kind: str = "mean"
    reported_kinds: tuple[str, ...] = ("zero",)

    @classmethod
    def for_metric(cls, metric: str, unit: str, alpha: float, correction: str, **kw) -> VerdictRule:
        """The rule for an effect measured by ``metric`` (its default floor, :data:`MIN_EFFECT`,
        and :data:`EFFECT_RATIO`, read when called)."""
        return cls(
            alpha=alpha,
            correction=correction,
            min_effect=MIN_EFFECT[metric],
            unit=unit,
            **{"ratio": EFFECT_RATIO, **kw},
        )

    @classmethod
    def from_dict(cls, d: Mapping) -> VerdictRule:
        """The rule a summary.json recorded (``verification.verdict_rule``, :meth:`to_dict`)."""
        names = {f.name for f in fields(cls)}
        kw: dict[str, Any] = {k: tuple(v) if k == "reported_kinds" else v for k, v in d.items() if k in names}
        return cls(**kw)

    @classmethod
    def from_rows(cls, rows: Sequence[Mapping], record: Mapping | None = None) -> VerdictRule | None:
        """The rule of a verification: ``record`` (a summary's ``verdict_rule``) where there is one,
        else what its rows carry (``alpha``, ``correction``, ``min_effect``, ``metric``; a summary
        written before the record); None where no row was tested with an alpha."""
        if record:
            return cls.from_dict(record)
        tested = [r for r in rows if r.get("alpha") is not None and (r.get("tested") or r.get("correction"))]
        if not tested:
            return None
        r = tested[0]
        metric = r.get("metric") or "loss"
        return cls(
            alpha=r["alpha"],
            correction=r.get("correction") or "bh",
            min_effect=r["min_effect"] if r.get("min_effect") is not None else MIN_EFFECT.get(metric, 0.0),
            unit=UNITS[metric],
            tested_kind=r.get("kind", "mean"),
            reported_kinds=tuple(dict.fromkeys(x["kind"] for x in rows if x.get("kind") != r.get("kind"))),
        )

    def to_dict(self) -> dict:
        """The record's fields, for summary.json's ``verification.verdict_rule``."""
        return {**asdict(self), "reported_kinds": list(self.reported_kinds)}

    @staticmethod
    def label(confirmed: bool | None) -> str:
        """A verdict's label (:func:`label`)."""
        return label(confirmed)

    def effect_is_large(self, top_effect: float, control_effects: Sequence[float]) -> bool:
        """The effect-size half of the rule: at least ``min_effect`` and at least ``ratio`` times the
        mean control effect (a p-value alone would confirm a tiny difference from a tight control
        distribution)."""
        return not self._effect_shortfall(top_effect, control_effects)

    def _effect_shortfall(self, top_effect: float, control_effects: Sequence[float]) -> list[str]:
        """The parts of :meth:`effect_is_large` that ``top_effect`` misses, in words (empty: none)."""
        import numpy as np

        mean = float(np.mean(control_effects)) if len(control_effects) else 0.0
        why = []
        if not top_effect >= self.min_effect:
            why.append(f"effect {top_effect:+.3g} < the floor {self.min_effect:g} {self.unit}")
        if not top_effect >= self.ratio * max(mean, 0.0):
            why.append(
                f"effect {top_effect:+.3g} < {self.ratio:g}x the control mean {mean:+.3g} = {self.ratio * mean:+.3g}"
            )
        return why

    def confirms(self, p_adjusted: float, top_effect: float, control_effects: Sequence[float]) -> bool:
        """Whether a tested verdict is CONFIRMED: ``p_adjusted <= alpha`` and :meth:`effect_is_large`."""
        return bool(within_level(p_adjusted, self.alpha) and self.effect_is_large(top_effect, control_effects))

    def shortfall(self, p_adjusted: float | None, top_effect: float, control_effects: Sequence[float]) -> str | None:
        """Why a tested verdict is not CONFIRMED, each unmet part of :meth:`confirms` in words
        (``effect +12.4 < 2x the control mean +7.77 = +15.5``); None where the rule is met."""
        why = []
        if p_adjusted is None or not within_level(p_adjusted, self.alpha):
            why.append(f"adjusted p {'n/a' if p_adjusted is None else f'{p_adjusted:.3g}'} > alpha {self.alpha:g}")
        return "; ".join(why + self._effect_shortfall(top_effect, control_effects)) or None

    def condition(self) -> str:
        """What CONFIRMED needs, in one line (the figure's legend, the caption, the report, the viewer):
        ``the mean-ablation test's adjusted p-value (Benjamini-Hochberg) <= alpha = 0.05, and the top-k
        effect >= 0.05 (nats/token) and >= 2x the mean effect of the control sets ablated``."""
        return (
            f"the {self.tested_kind}-ablation test's adjusted p-value "
            f"({CORRECTION_LONG_NAMES.get(self.correction, self.correction)}) <= alpha = {self.alpha:g}, and the "
            f"top-k effect >= {self.min_effect:g} ({self.unit}) and >= {self.ratio:g}x the mean effect of the "
            "control sets ablated"
        )

    def description(self) -> str:
        """The whole rule in words (summary.json's ``verification.confirmation_rule``): :meth:`condition`,
        the untested kinds, and when there is no verdict."""
        reported = " and ".join(self.reported_kinds)
        return (
            f"CONFIRMED: {self.condition()}; "
            + (f"the {reported}-ablation rows are reported, not tested; " if reported else "")
            + "no verdict (confirmed: null) when the task's clean loss is above ln(vocabulary) or more than "
            "half of the natural text is the tokenizer's unknown token; nothing is CONFIRMED when "
            "its draws cannot reach alpha after the correction (the reason in no_verdict and warnings)"
        )


def ordered_rows(rows: Sequence[Mapping], types: Sequence[str] | None) -> list[dict]:
    """Verification rows (summary.json's ``ablations``) as scan's figure, caption, report and LaTeX
    table list them: by head type in the order of ``types`` (``config.types``, the overview's panel
    order; summary.json keeps the order they were verified in), each type's kinds as verified."""
    order = {name: i for i, name in enumerate(types or ())}
    return sorted((dict(r) for r in rows), key=lambda r: order.get(r["head_type"], len(order)))  # stable


def decided(row: Mapping, primary: str | None) -> bool:
    """Whether a verification row (summary.json's ``ablations`` entry) carries its type's verdict in
    scan's table (terminal and LaTeX): a tested kind's row, or the ``primary`` (tested) kind's row of
    a type without a verdict; any other row is reported, not tested."""
    return bool(row.get("tested") or (row.get("no_verdict") and row["kind"] == primary))


def effect_digits(metric: str) -> int:
    """Decimals of an ablation effect in scan's table (terminal and LaTeX): 2 for loss (nats/token),
    3 for ``1 - cos`` (small numbers)."""
    return 2 if metric == "loss" else 3


def p_cell(p: float | None, is_bound: bool | None) -> str:
    """scan's table's p column, unpadded: ``0.0200``, ``≤0.0877`` for a curtailed test's bound, ``-``
    where no control set was ablated (no p-value)."""
    return "-" if p is None else f"{'≤' if is_bound else ''}{p:.4f}"


def p_text(row: Mapping, digits: int = 3) -> str:
    """``p = 0.0196``, or ``p in [0.059, 0.75]`` where the p-value is a curtailed test's bound
    (``p ≤ 0.75`` where the smallest reachable p is not recorded)."""
    p = row.get("p_value")
    if p is None:
        return "p n/a"
    if not row.get("p_value_is_bound"):
        return f"p = {p:.{digits}g}"
    lo = row.get("p_value_min")
    return f"p ≤ {p:.{digits}g}" if lo is None else f"p in [{lo:.{digits}g}, {p:.{digits}g}]"


def stop_text(row: Mapping) -> str | None:
    """Why the tested kind's test ended early, in words (None for one that ran to the end, or an
    untested row): ``stopped: cannot reach alpha after BH``, ``stopped: settled above alpha`` or,
    for one whose control sets were not ablated, ``not run: its control sets cannot reach alpha after BH``."""
    reason = row.get("stop_reason")
    if reason == NOT_RUN:
        return f"not run: its control sets cannot reach alpha after {CORRECTION_NAMES.get(row.get('correction') or '', row.get('correction'))}"
    if reason == "futile under the correction":
        return f"stopped: cannot reach alpha after {CORRECTION_NAMES.get(row.get('correction') or '', row.get('correction'))}"
    if reason == "settled above alpha":
        return "stopped: settled above alpha"
    return None


def own_pool_text(rows: Sequence[Mapping], k: int) -> str:
    """What to add to "control sets drawn outside every top-k set of the task" where a task's rows
    drew outside their own top-k set only (a tiny model: the task's top-k sets leave fewer than 2k
    heads, verification.control_pools; a row's ``control_excludes`` short of its task's top heads):
    ``; on the natural task outside the type's own top-2 set only, as the task's top-2 sets leave
    fewer than 4 heads``; "" where none did. The caption stated the shared pool of every run."""
    union: dict[str, set] = {}
    for r in rows:
        union.setdefault(str(r.get("task")), set()).update(r.get("top_heads") or ())
    own = sorted(
        {
            str(r.get("task"))
            for r in rows
            if r.get("control_excludes") is not None and set(r["control_excludes"]) < union[str(r.get("task"))]
        }
    )
    if not own:
        return ""
    return (
        f"; on the {' and '.join(own)} task{'s' if len(own) > 1 else ''} outside the type's own top-{k} "
        f"set only, as the task's top-{k} sets leave fewer than {2 * k} heads"
    )


def stopped_early(row: Mapping) -> bool:
    """Whether a row's sequential draws ended before its stream's last set: settled above alpha or
    curtailed (the mean-ablation row of a type without a verdict too: its draws stop by the same
    rule); not a test whose control sets were not ablated at all (:data:`NOT_RUN`, no draws to stop)."""
    return row.get("stop_reason") in ("settled above alpha", "futile under the correction")


def reached_text(row: Mapping) -> str:
    """``0 of 2 control sets reached the effect`` (``no control set ablated`` where none was)."""
    g = row.get("exceedances")
    n = row.get("draws", len(row.get("random_effects", [])))
    if n == 0:
        return "no control set ablated"
    if g is None:
        return f"{n} control sets"
    return f"{g} of {n} control set{'' if n == 1 else 's'} reached the effect"


def evidence_text(row: Mapping, digits: int = 3) -> str:
    """The p-value with how its test ended: ``p in [0.059, 0.75] (stopped: cannot reach alpha after BH;
    1 of 2 control sets reached the effect)`` or ``p = 0.0196 (0 of 50 control sets reached the effect)``."""
    why = stop_text(row)
    return f"{p_text(row, digits)} ({why + '; ' if why else ''}{reached_text(row)})"


TASK_CONSEQUENCE = "its scores describe that failure and its ablations get no verdict"
"""What a ``task`` warning (:class:`NoVerdictWarning`) says follows from its reason."""


@dataclass(frozen=True)
class NoVerdictWarning:
    """One of a scan's ``warnings``: why verdicts were withheld, as fields (the terminal report and
    the figures' caveat select by them) and as the line ``str()`` gives (summary.json's ``warnings``,
    the terminal's ``WARNING:`` lines).

    Attributes:
        kind: ``"task"``: a task's clean loss cannot carry verdicts (no type judged on it gets one);
            ``"type"``: one head type's test cannot reach a verdict; ``"other"``: a line read back
            from a summary.json (:meth:`from_text`) in neither wording, ``reason`` the whole line.
        reason: why, in words: the task's :func:`~headprobe.analyses.ablation.untrusted_task_reason`,
            or the type's ``no_verdict``.
        task: the task (``natural``, ``repeated``): the untrusted one, or the one a type is judged on
            (None where a line read back does not say it).
        head_type: the head type (``previous_token``) of a ``"type"`` warning, else None.
    """

    kind: str
    reason: str
    task: str | None = None
    head_type: str | None = None

    @classmethod
    def for_task(cls, task: str, reason: str) -> NoVerdictWarning:
        """The warning of a task whose clean loss cannot carry verdicts."""
        return cls("task", reason, task=task)

    @classmethod
    def for_type(cls, head_type: str, reason: str, task: str | None = None) -> NoVerdictWarning:
        """The warning of a head type's test that cannot reach a verdict (judged on ``task``)."""
        return cls("type", reason, task=task, head_type=head_type)

    @property
    def type_name(self) -> str | None:
        """``head_type`` as the texts write it (``previous-token``); None for a task's warning."""
        return self.head_type.replace("_", "-") if self.head_type is not None else None

    def __str__(self) -> str:
        """The line: ``natural task: <reason>; its scores ...``, ``induction: no verdict: <reason>``."""
        if self.kind == "task":
            return f"{self.task} task: {self.reason}; {TASK_CONSEQUENCE}"
        if self.kind == "type":
            return f"{self.type_name}: no verdict: {self.reason}"
        return self.reason

    @classmethod
    def from_text(cls, line: str) -> NoVerdictWarning:
        """A warning read back from a saved summary.json's ``warnings`` line (its ``str()``:
        ``str(from_text(line)) == line`` for every line); a line in neither wording is ``"other"``."""
        task, sep, rest = line.partition(" task: ")
        suffix = f"; {TASK_CONSEQUENCE}"
        if sep and task and " " not in task and rest.endswith(suffix):
            return cls.for_task(task, rest.removesuffix(suffix))
        name, sep, reason = line.partition(": no verdict: ")
        if sep and name and " " not in name:
            return cls.for_type(name.replace("-", "_"), reason)
        return cls("other", line)


def uniform_causal_score(first_query: int, seq_len: int) -> float:
    """The offset score of a head that attends uniformly over its causal context (query ``q`` gives
    ``1 / (q + 1)`` to each key ``0..q``): the scores are the mean of ``A[q, q - offset]`` over the
    queries ``q = first_query .. seq_len - 1`` (:func:`headprobe.analyses.detectors.offset_score`;
    ``offset <= first_query``, so every such key exists), so this is the mean of ``1 / (q + 1)``
    over them, exactly. Raises ValueError where no query is read (``first_query >= seq_len``)."""
    queries = range(first_query, seq_len)
    if not queries:
        raise ValueError(f"no query from {first_query} in a sequence of {seq_len} tokens")
    return sum(1.0 / (q + 1) for q in queries) / len(queries)


def uniform_baselines(tokens: Mapping, causal: bool = True) -> dict[str, float]:
    """Type -> :func:`uniform_causal_score` of the previous-token, duplicate-token and induction
    scores on a causal scan's token sets (summary.json's ``tokens``). Their definitions
    (:mod:`headprobe.analyses.detectors`): previous-token, queries ``1 .. T-1`` of the natural text
    (``T`` its ``seq_len``); on ``[BOS] r_1..r_S r_1..r_S`` (``S`` the ``period``, ``start`` 1 with
    BOS), duplicate-token queries from ``max(start, 1) + S`` (``duplicate_first_query``), induction
    from ``start + S``, to ``T - 1``. A type whose set is missing is left out. An encoder
    (``causal`` False) attends over the whole sequence: a uniform head gives every key ``1 / T``, so
    each of those scores and the next-token score is ``1 / T`` of its set."""
    out = {}
    natural, repeated = tokens.get("natural_text") or {}, tokens.get("repeated_random") or {}
    if not causal:
        lengths = {"previous_token": natural.get("seq_len", 0), "next_token": natural.get("seq_len", 0)}
        lengths |= {t: repeated.get("seq_len", 0) for t in ("duplicate_token", "induction") if repeated.get("period")}
        return {t: 1.0 / n for t, n in lengths.items() if n > 1}
    if natural.get("seq_len", 0) > 1:
        out["previous_token"] = uniform_causal_score(1, natural["seq_len"])
    if repeated.get("period") and repeated.get("seq_len"):
        start, period, n = int(bool(repeated.get("bos"))), repeated["period"], repeated["seq_len"]
        if max(start, 1) + period < n:
            out["duplicate_token"] = uniform_causal_score(max(start, 1) + period, n)
        if start + period < n:
            out["induction"] = uniform_causal_score(start + period, n)
    return out


def uniform_baselines_of(natural: Any, repeated: Any, causal: bool = True) -> dict[str, float]:
    """:func:`uniform_baselines` of a natural-text and a repeated-random token set
    (:class:`~headprobe.analyses.data.TokenSet`: ``tokens [batch, pos]``, ``start``, ``period``)."""
    return uniform_baselines(
        {
            "natural_text": {"seq_len": int(natural.tokens.shape[1])},
            "repeated_random": {
                "period": repeated.period,
                "seq_len": int(repeated.tokens.shape[1]),
                "bos": bool(repeated.start),
            },
        },
        causal,
    )


def verdict_remarks(
    top: Mapping[str, Sequence[str]],
    scores: Mapping[str, Mapping[str, float]],
    baselines: Mapping[str, float],
    no_verdict: Collection[str] = (),
    causal: bool = True,
) -> dict[str, list[str]]:
    """Type -> remarks on what its verdict tests (summary.json's ``verdict_remarks``, the report's
    NOTE lines; the verdict rule does not read them), only for types that have one:

    - its top-k set shares most of its heads (more than half) with another type's top-k set: the
      verdict re-tests those heads, whatever pattern they show;
    - some of its top-k heads score at or below ``baselines[type]``, what a head attending
      uniformly over its causal context scores, or an encoder's over the whole sequence (``causal``
      False; :func:`uniform_baselines`): the type's pattern is not shown by them more than by no pattern at all.

    ``top``: type -> its top-k heads (``"L.H"``, the ablated set); ``scores``: type -> head -> score;
    ``no_verdict``: the types whose test gives no verdict (an untrusted task, too few control sets):
    their remarks speak of the ablation, not of a verdict (a toy model's untrusted duplicate-token
    read "the verdict says ablating them matters" beside its "no verdict")."""
    out: dict[str, list[str]] = {}
    sets = {t: set(heads) for t, heads in top.items()}
    for t, heads in top.items():
        said, k, name = [], len(heads), t.replace("_", "-")
        none = t in no_verdict
        for u, other in sets.items():
            shared = [h for h in heads if h in other]
            if u != t and 2 * len(shared) > k:
                said.append(
                    f"{name}: {len(shared)} of its {k} top heads ({', '.join(shared)}) are also "
                    f"{u.replace('_', '-')}'s top heads, so its "
                    + ("ablation (no verdict here) re-tests" if none else "verdict re-tests")
                    + " much of that set"
                )
        base = baselines.get(t)
        known = scores.get(t, {})
        vals = [float(known[h]) for h in heads if h in known]
        if base is not None and heads and len(vals) == k:
            low, best = sum(v <= base for v in vals), max(vals)
            if low:
                said.append(
                    f"{name}: {low} of its {k} top heads score at or below {base:.3g}, the {name} score of a head "
                    f"attending uniformly over {'its causal context' if causal else 'the whole sequence'} (the highest, "
                    f"{best:.3g}, is {best / base:.2g}x it): "
                    + (
                        f"their ablation (no verdict here) tests these heads, not heads that attend as {name} heads do"
                        if none
                        else f"the verdict says ablating them matters, not that they attend as {name} heads do"
                    )
                )
        if said:
            out[t] = said
    return out
