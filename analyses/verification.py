"""Verification of detected heads: ablate each head type's top-k heads against random control
sets of k heads, with a stated significance level, sequential stopping, layer-matched controls
and a multiple-testing correction over the verdicts of one run.

The design (docs/scan.md, "How a verdict is reached"):

* **The family.** One hypothesis per head type and task: "ablating this type's top-k heads raises
  the task's loss more than ablating k like-for-like random heads". It is tested with the
  *primary* ablation kind (:data:`PRIMARY_KIND`, mean ablation: it keeps each head's output on
  the data's distribution, where zero ablation also measures the damage of an off-distribution
  input, Wang et al. 2022 sec. 2.1; Heimersheim & Nanda 2024). The other kind (zero) is ablated on
  the first :data:`SECONDARY_DRAWS` of the same control sets and reported with its raw p-value,
  not tested.
* **Controls** (:func:`layer_matched_sets`, default): each random set has as many heads in each
  layer as the top-k set it is compared with, drawn from the heads outside every top-k of the
  task (and never a removed head of a pruned model); ``uniform`` draws from all those heads.
* **Sequential Monte Carlo p-values** (:class:`~headprobe.analyses.statistics.SequentialMCTest`):
  controls are ablated one set per test a round (:data:`BATCH`); a test stops as soon as ``h = floor(alpha n) + 1``
  draws reach the top-k effect (Besag & Clifford 1991: its p-value ``h / L`` is then above
  ``alpha``, so no later draw can change the verdict). ``--n-random`` (n) is the most draws a test
  makes; a test no draw beats ends at n with ``p = 1 / (n + 1)``.
* **The correction** over the primary tests with a verdict: Benjamini-Hochberg by default (a scan
  screens m head types; with exact Monte Carlo p-values, Holm needs ``m / alpha - 1`` draws for
  every confirmed test, BH ``m / (r alpha) - 1`` when r are confirmed), Holm on request. CONFIRMED
  by the :class:`~headprobe.analyses.verdicts.VerdictRule` (:meth:`VerificationSettings.rule`).
"""

from __future__ import annotations

import itertools
import math
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from headprobe.analyses import distributed, verdicts
from headprobe.analyses import statistics as st
from headprobe.analyses.ablation import (
    LOSS_METRIC,
    P_VALUE_TIE,
    AblationMetric,
    CleanResiduals,
    Verification,
    first_scored,
    names,
    set_ablation_losses,
)
from headprobe.analyses.data import TokenSet
from headprobe.analyses.verdicts import VerdictRule
from headprobe.analyses.vocabulary import (
    ALPHA,
    CORRECTION,
    MAX_N_RANDOM,
    PRIMARY_KIND,
    check_n_random,
    check_verification_choices,
    draws_advice,
    reachable,
    together_draws_needed,
)
from headprobe.analyses.vocabulary import unreachable_note as _unreachable_note
from headprobe.probe.backends.base import LoadedModel
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.hooks.ablation import Head
from headprobe.probe.layout.spec import ModelSpec

KINDS = ("zero", "mean")
"""The kinds a verification ablates (both need no second input)."""
BATCH = 1
"""Control sets ablated per test between two looks: 1, Besag & Clifford's rule as published (a
look after every draw), so that a test ends at the very draw that settles it. A round ablates the
next set of every open test of a task in one call, so a GPU pass or the ranks of a torchrun run
still share several sets. (It was 10: every test then ran to the end of the batch in which it was
settled; on the demo 36 sets of 270 were made after their test was settled.)"""
SECONDARY_DRAWS = 5
"""Control sets on which the untested kind (zero ablation) is reported: the first 5 of each
test's stream. A description of that kind's scale beside the controls, not a test (its p-value
cannot go below 1/6); it was 10."""
EFFECT_RATIO = verdicts.EFFECT_RATIO
"""The default ratio of the rule (:data:`headprobe.analyses.verdicts.EFFECT_RATIO`, which owns it)."""


@dataclass(frozen=True)
class VerificationSettings:
    """What a verification needs beyond the model and the data.

    Attributes:
        k: heads per set (the top-k of each type; each control set as many).
        n_random: the most control sets a test ablates (its Monte Carlo draws).
        alpha: family-wise significance level of the verdicts (Holm-corrected).
        control: ``layer-matched`` (default) or ``uniform``.
        correction: ``bh`` (Benjamini-Hochberg, default) or ``holm`` over the run's tested verdicts.
        seed: seeds the control draws.
        batch: control sets ablated per test between looks.
        sequential: stop tests early and ablate the untested kind on the first
            :data:`SECONDARY_DRAWS` sets only (False: every test ablates ``n_random`` sets of both
            kinds; the benchmark's fixed-size reference).
        keep_n_random: keep ``n_random`` where it is below the draws a lone verdict needs under
            the correction (:func:`plan_draws`; default: raise it to that number).
        primary_kind: the tested kind (:data:`PRIMARY_KIND`; ``headprobe robustness`` varies it).
    """

    k: int
    n_random: int = 50
    alpha: float = ALPHA
    control: str = "layer-matched"
    correction: str = CORRECTION
    seed: int = 0
    batch: int = BATCH
    sequential: bool = True
    keep_n_random: bool = False
    primary_kind: str = PRIMARY_KIND

    def __post_init__(self):
        check_verification_choices(self.alpha, self.control, self.correction)
        if self.n_random < 1 or self.k < 1 or self.batch < 1:
            raise HeadprobeError("--n-random and --top-k must be at least 1")
        check_n_random(self.n_random)

    @property
    def kinds(self) -> tuple[str, ...]:
        """The kinds ablated: :data:`KINDS`, with ``primary_kind`` (the tested one) added where it is another."""
        return KINDS if self.primary_kind in KINDS else (*KINDS, self.primary_kind)

    def rule(self, metric: AblationMetric = LOSS_METRIC) -> VerdictRule:
        """The verdict rule of these settings for effects in ``metric`` (its floor)."""
        return VerdictRule.for_metric(
            metric.name,
            metric.unit,
            self.alpha,
            self.correction,
            tested_kind=self.primary_kind,
            reported_kinds=tuple(k for k in self.kinds if k != self.primary_kind),
        )

    @property
    def reachable(self) -> bool:
        """Whether ``n_random`` draws can give a p-value at or below ``alpha`` at all: ``1 /
        (n_random + 1) <= alpha``, i.e. at least ``1 / alpha - 1`` draws."""
        return reachable(self.n_random, self.alpha)


def unreachable_note(settings: VerificationSettings) -> str | None:
    """The one line said before a verification whose draws cannot reach ``alpha`` (None if they can)."""
    return _unreachable_note(settings.n_random, settings.alpha)


# --- control sets ----------------------------------------------------------------------------------


def layer_matched_sets(
    top: Sequence[Head], available: Iterable[Head], n_layers: int, n_draws: int, gen: torch.Generator
) -> tuple[list[list[Head]], str | None]:
    """``n_draws`` distinct random sets with as many heads in each layer as ``top`` has, from
    ``available`` (fewer where fewer exist: every one of them, :func:`distinct_sets`).

    Where a layer has fewer available heads than ``top`` has there, all of them are taken and the
    rest come from the nearest layers (by distance, then the later layer first) that still have
    heads; the note says so (:func:`layer_parts`).

    Returns:
        ``(sets, note)``: sets sorted ``(layer, head)`` lists; note None when every layer matched.

    Raises:
        HeadprobeError: fewer available heads than ``len(top)``.
    """
    avail = sorted(set(available))
    if len(avail) < len(top):
        raise HeadprobeError(
            f"a random control of {len(top)} heads needs {len(top)} heads outside those under test; "
            f"{len(avail)} are left"
        )
    parts, moved = layer_parts(top, avail, n_layers)

    def draw() -> list[Head]:
        s: list[Head] = []
        for pool, n in parts:
            s += [pool[i] for i in torch.randperm(len(pool), generator=gen)[:n].tolist()]
        return sorted(s)

    def every() -> Iterable[list[Head]]:
        for combo in itertools.product(*(itertools.combinations(pool, n) for pool, n in parts)):
            yield sorted(h for part in combo for h in part)

    sets = distinct_sets(draw, every, n_control_sets(parts), n_draws, gen)
    note = (
        f"layer matching: too few heads outside those under test in some layers; drew {', '.join(moved)}"
        if moved
        else None
    )
    return sets, note


Parts = list[tuple[list[Head], int]]
"""A control design: ``(pool, n)`` pairs, a set takes ``n`` distinct heads of each disjoint ``pool``."""


def layer_parts(top: Sequence[Head], avail: Sequence[Head], n_layers: int) -> tuple[Parts, list[str]]:
    """The layer-matched design of :func:`layer_matched_sets` for ``top`` over the sorted heads
    ``avail`` (at least ``len(top)`` of them): each layer gives as many heads as ``top`` has there,
    a layer's shortfall moved to its nearest layers (by distance, then the later layer first).

    Returns:
        ``(parts, moved)``: the pools (a layer's available heads) and their head counts, and one
        phrase per move (``"1 of layer 0's from layer 1"``)."""
    by_layer: dict[int, list[Head]] = {layer: [] for layer in range(n_layers)}
    for h in avail:
        by_layer[h[0]].append(h)
    want = {layer: sum(1 for h in top if h[0] == layer) for layer in range(n_layers)}
    give = {layer: min(want[layer], len(by_layer[layer])) for layer in range(n_layers)}
    moved = []
    for layer in range(n_layers):
        short = want[layer] - give[layer]
        for other in sorted(range(n_layers), key=lambda o: (abs(o - layer), -o)):
            if short == 0:
                break
            spare = len(by_layer[other]) - give[other]
            take = min(spare, short)
            if take > 0:
                give[other] += take
                short -= take
                moved.append(f"{take} of layer {layer}'s from layer {other}")
    return [(by_layer[layer], n) for layer, n in give.items() if n], moved


def n_control_sets(parts: Parts) -> int:
    """The distinct control sets of a design: ``prod C(len(pool), n)`` over its parts (a uniform
    design is one part, ``C(available, k)``); the one count :func:`layer_matched_sets`,
    :func:`uniform_sets` and the smaller ``-k`` advice (:func:`rerun_set_counts`) use."""
    return math.prod(math.comb(len(pool), n) for pool, n in parts)


ENUMERATE_BELOW = 4
"""Control sets are enumerated (and shuffled) rather than drawn when fewer than this many times
``n_draws`` distinct sets exist: drawing without repeats would then mostly draw repeats."""


def distinct_sets(
    draw: Callable[[], list[Head]],
    every: Callable[[], Iterable[list[Head]]],
    n_sets: int,
    n_draws: int,
    gen: torch.Generator,
) -> list[list[Head]]:
    """``min(n_draws, n_sets)`` distinct control sets: ``draw()`` (a uniformly random set) with
    repeats skipped, or, when fewer than :data:`ENUMERATE_BELOW` x ``n_draws`` sets exist, all
    ``n_sets`` of ``every()`` in a random order, cut to ``n_draws``.

    Why distinct: the Monte Carlo p-value ``(g + 1) / (n + 1)`` counts each draw as one more
    comparison. Where the heads outside the top-k leave one possible layer-matched set (a tiny
    model), 50 draws with repeats would be that set 50 times and give p = 1/51 from one
    comparison. Drawn without replacement, the rank of the
    top-k effect among the ``n + 1`` is uniform under the null, so the p-value is exact; when all
    ``n_sets`` sets are used, it is the exact permutation p-value over them, at least
    ``1 / (n_sets + 1)``. On a model with many heads no repeat occurs and the draws are those
    ``draw()`` makes anyway.
    """
    if n_sets < ENUMERATE_BELOW * n_draws:
        sets = list(every())
        return [sets[i] for i in torch.randperm(len(sets), generator=gen)[:n_draws].tolist()]
    out: list[list[Head]] = []
    seen: set[tuple[Head, ...]] = set()
    while len(out) < n_draws:
        s = draw()
        if tuple(s) not in seen:
            seen.add(tuple(s))
            out.append(s)
    return out


def uniform_sets(k: int, available: Iterable[Head], n_draws: int, gen: torch.Generator) -> list[list[Head]]:
    """``n_draws`` distinct sets of ``k`` distinct heads drawn uniformly from ``available`` (fewer
    where fewer exist: every one of them, :func:`distinct_sets`).

    Raises:
        HeadprobeError: fewer than ``k`` available heads.
    """
    pool = sorted(set(available))
    if len(pool) < k:
        raise HeadprobeError(
            f"a random control of {k} heads needs {k} heads outside those under test; {len(pool)} are left"
        )
    return distinct_sets(
        lambda: sorted(pool[i] for i in torch.randperm(len(pool), generator=gen)[:k].tolist()),
        lambda: (list(c) for c in itertools.combinations(pool, k)),
        n_control_sets([(pool, k)]),
        n_draws,
        gen,
    )


def effect_is_large(top_effect: float, control_effects: Sequence[float], min_effect: float) -> bool:
    """The effect-size half of the default rule with floor ``min_effect``
    (:meth:`~headprobe.analyses.verdicts.VerdictRule.effect_is_large`)."""
    return VerdictRule(min_effect=min_effect, ratio=verdicts.EFFECT_RATIO).effect_is_large(top_effect, control_effects)


# --- the whole verification ------------------------------------------------------------------------


@dataclass
class _Test:
    """One (head type, task) test: its top-k set, its control stream and its effects per kind."""

    head_type: str
    task: str
    top: list[Head]
    stream: int
    top_effect: dict[str, float] = field(default_factory=dict)
    top_per_seq: dict[str, np.ndarray] = field(default_factory=dict)
    top_loss: dict[str, float] = field(default_factory=dict)
    effects: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in KINDS})
    mc: st.SequentialMCTest = None  # type: ignore[assignment]  # None until verify_heads sets it, before any use
    no_verdict: str | None = None
    reach: str | None = None  # what its draws allow: alone, with others, never (statistics.confirmable)
    capped: bool = False  # its stream cut: more sets could decide nothing (_cap_undecidable)
    not_run: bool = False  # its stream emptied: no control set of it is ablated (_cap_undecidable)
    n_sets: int = 0  # control sets its stream held before any cut
    own_pool: bool = False  # its pool excludes only its own top-k set (ControlPool.shared False: a tiny model)
    # (control, k) -> (distinct sets, confirmable) of a rerun of it so (_rerun_reach; tests that cannot be CONFIRMED)
    rerun: dict[tuple[str, int], tuple[int, str]] = field(default_factory=dict)

    def judged_sets(self, streams: list[list[list[Head]]]) -> int:
        """The control sets its reach and p-value floor are stated for: those of its stream, or
        where none is ablated (:attr:`not_run`) those it held before (what made it unreachable)."""
        return self.n_sets if self.not_run else len(streams[self.stream])


def stream_seed(seed: int, name: str) -> int:
    """The seed of one control stream: a function of ``--seed`` and the stream's name (its head
    type; ``task:<task>`` for a task's shared uniform stream) only, so a type's control sets do not
    depend on which other types are scanned (numpy's ``SeedSequence`` mixes the two)."""
    return int(np.random.SeedSequence([seed, zlib.crc32(name.encode())]).generate_state(1)[0])


@dataclass(frozen=True)
class ControlPool:
    """Where one type's control sets come from (:func:`control_pools`).

    Attributes:
        task: the task the type is judged on.
        excluded: the heads no control set of it holds, sorted.
        avail: the heads its control sets are drawn from, sorted ``(layer, head)``.
        shared: whether ``excluded`` is every top-k set of the task (else only its own: a tiny model).
    """

    task: str
    excluded: list[Head]
    avail: list[Head]
    shared: bool


def control_pools(
    top: Mapping[str, Sequence[Head]], task_of: Mapping[str, str], all_heads: list[Head], removed: set, k: int
) -> dict[str, ControlPool]:
    """Each type's control pool in a verification of ``k`` heads a type: the heads outside every
    top-k set of its task, or, where those leave fewer than ``2 k`` heads (a tiny model), outside its
    own; never a ``removed`` head. In the order of the tests (:func:`_draw_controls`): by task, in
    the order the tasks first appear in ``top``, then ``top``'s order."""
    out = {}
    for task in dict.fromkeys(task_of[t] for t in top):
        judged = [t for t in top if task_of[t] == task]
        union = {h for t in judged for h in top[t]}
        shared = len(all_heads) - len(union | removed) >= 2 * k  # else (a tiny model) only its own
        for t in judged:
            excluded = union if shared else set(top[t])
            avail = [h for h in all_heads if h not in excluded and h not in removed]
            out[t] = ControlPool(task, sorted(excluded), avail, shared)
    return out


def _draw_controls(
    top: dict[str, list[Head]],
    task_of: dict[str, str],
    all_heads: list[Head],
    removed: set,
    settings: VerificationSettings,
) -> tuple[list[_Test], list[list[list[Head]]], dict, list[str]]:
    """The tests, their control streams (``n_random`` distinct sets each, or every distinct set
    where fewer exist, seeded by :func:`stream_seed`; types of one task share one under
    ``uniform``), each type's excluded heads, and notes on layers that could not be matched.
    A type's pool (:func:`control_pools`: the heads outside the task's top-k sets) still depends on
    the other types judged on the same task."""
    tests: list[_Test] = []
    streams: list[list[list[Head]]] = []
    notes: list[str] = []
    pools = control_pools(top, task_of, all_heads, removed, settings.k)
    uniform_stream: dict[str, int] = {}  # task -> the stream its types share under uniform
    for t, pool in pools.items():
        if settings.control != "uniform":
            gen = torch.Generator().manual_seed(stream_seed(settings.seed, t))
            sets, note = layer_matched_sets(top[t], pool.avail, _n_layers(all_heads), settings.n_random, gen)
            streams.append(sets)
            if note:
                notes.append(f"{t.replace('_', '-')}: {note}")
        elif not pool.shared or pool.task not in uniform_stream:  # else the task's one uniform stream
            gen = torch.Generator().manual_seed(stream_seed(settings.seed, f"task:{pool.task}" if pool.shared else t))
            streams.append(uniform_sets(settings.k, pool.avail, settings.n_random, gen))
            if pool.shared:
                uniform_stream[pool.task] = len(streams) - 1
        stream = uniform_stream[pool.task] if settings.control == "uniform" and pool.shared else len(streams) - 1
        tests.append(
            _Test(t, pool.task, list(top[t]), stream, effects={k: [] for k in settings.kinds}, own_pool=not pool.shared)
        )
    return tests, streams, {t: pool.excluded for t, pool in pools.items()}, notes


def _n_layers(all_heads: list[Head]) -> int:
    return max(h[0] for h in all_heads) + 1


def rerun_set_counts(
    top: Mapping[str, Sequence[Head]],
    task_of: Mapping[str, str],
    all_heads: list[Head],
    removed: set,
    k: int,
    control: str,
) -> dict[str, int]:
    """Each type's distinct control sets in a verification of ``k`` heads a type under ``control``
    whose top-k sets are ``top[t][:k]`` (:func:`~headprobe.analyses.ablation.top_heads` of a smaller
    k is a prefix of its list): the pools of :func:`control_pools`, the designs of
    :func:`layer_parts` (or one uniform part of k heads) counted by :func:`n_control_sets`; 0 where
    a pool has too few heads for one set (that run raises)."""
    tops = {t: list(heads[:k]) for t, heads in top.items()}
    out = {}
    for t, pool in control_pools(tops, task_of, all_heads, removed, k).items():
        size = k if control == "uniform" else len(tops[t])
        if len(pool.avail) < size:
            out[t] = 0
            continue
        parts = [(pool.avail, k)] if control == "uniform" else layer_parts(tops[t], pool.avail, _n_layers(all_heads))[0]
        out[t] = n_control_sets(parts)
    return out


def plan_draws(m: int, settings: VerificationSettings) -> int:
    """The most control sets each test draws: ``--n-random``, raised to what one test of a
    family of ``m`` needs to be CONFIRMED on its own under the correction
    (:func:`~headprobe.analyses.statistics.lone_draws_needed`), unless ``keep_n_random``."""
    if settings.keep_n_random or m == 0:
        return settings.n_random
    need = st.lone_draws_needed(m, settings.alpha)
    if need > MAX_N_RANDOM:  # drawn up front: refused before the sets fill the memory
        raise HeadprobeError(
            f"--alpha {settings.alpha:g} needs {need:,} control sets for a verdict among {m} to be CONFIRMED on its "
            f"own, more than {MAX_N_RANDOM:,}: use a larger --alpha, or --keep-n-random to keep --n-random"
        )
    return max(settings.n_random, need)


def _cap_undecidable(
    tests: list[_Test], streams: list[list[list[Head]]], requested: int, skip_unreachable: bool
) -> bool:
    """Cut the streams whose tests can decide nothing (no verdict, or ``never`` confirmable: their
    draws change no verdict of the family either, as both corrections reject the same others with
    such a test at p = 1). A stream whose tests are all tested and ``never`` confirmable is emptied
    when ``skip_unreachable`` (sequential tests, draws not kept by the user): none of its sets is
    ablated, its tests ``not_run`` (p = 1, the p-value of a test of no draws); any other such stream
    (untrusted tests, fixed draws, or ``--keep-n-random``'s sets, which the user asked to see) is
    cut to the ``requested`` draws, for the p-value it reports. Returns whether a stream was cut;
    the tests' ``capped`` and ``not_run`` say which."""
    cut = False
    for s, sets in enumerate(streams):
        users = [x for x in tests if x.stream == s]
        if not users or not all(x.no_verdict is not None or x.reach == "never" for x in users):
            continue
        empty = skip_unreachable and all(x.no_verdict is None for x in users)
        keep = 0 if empty else requested
        if len(sets) > keep:
            streams[s] = sets[:keep]
            for x in users:
                x.capped, x.not_run = True, empty
            cut = True
    return cut


def make_plan(
    tests: list[_Test],
    streams: list[list[list[Head]]],
    settings: VerificationSettings,
    requested: int,
    n_secondary: int,
) -> dict:
    """The verification's plan, before any control set is ablated (summary.json's
    ``verification.plan``): the family, the draws a lone verdict needs, the draws asked for and
    used, each test's control sets and what they allow (:func:`~headprobe.analyses.statistics.confirmable`),
    and the most sets the whole verification ablates."""
    family = [x for x in tests if x.no_verdict is None]
    sizes = [x.judged_sets(streams) for x in family]
    reach = st.confirmable([1 / (n + 1) for n in sizes], settings.correction, settings.alpha) if family else []
    for x, r in zip(family, reach):
        x.reach = r
    return {
        "family": [x.head_type for x in family],
        "family_size": len(family),
        "correction": settings.correction,
        "alpha": settings.alpha,
        "lone_draws_needed": st.lone_draws_needed(len(family), settings.alpha) if family else None,
        "n_random_requested": requested,
        "n_random": settings.n_random,
        "raised": settings.n_random > requested,
        "kept": settings.keep_n_random,
        "tests": [  # control_sets: those that exist up to the draws; capped: fewer ablated; not_run: none
            {
                "head_type": x.head_type,
                "task": x.task,
                "control_sets": n,
                "confirmable": r,
                "capped": x.capped,
                "not_run": x.not_run,
            }
            for x, n, r in zip(family, sizes, reach)
        ],
        **_planned_sets(tests, streams, settings.kinds, settings.primary_kind, n_secondary),
    }


def _planned_sets(
    tests: list[_Test], streams: list[list[list[Head]]], kinds: Sequence[str], primary: str, n_secondary: int
) -> dict:
    """The most sets a verification ablates (``max_sets``) and what they are: ``top_sets`` (every
    test's top-k set, each kind), ``untested_sets``, the control sets of the streams only tests
    without a verdict draw from (``untested``: those types, reported, not in the family), and
    ``secondary_sets``, the control sets ablated again by the reported kinds (``secondary_kinds``:
    each stream's first ``n_secondary``); the rest are the family's control sets."""
    n_kinds = len(kinds)
    per_stream = [len(s) + min(n_secondary, len(s)) * (n_kinds - 1) for s in streams]
    untested = [x for x in tests if x.no_verdict is not None]
    only_untested = {x.stream for x in untested} - {x.stream for x in tests if x.no_verdict is None}
    return {
        "max_sets": len(tests) * n_kinds + sum(per_stream),
        "top_sets": len(tests) * n_kinds,
        "untested": [x.head_type for x in untested],
        "untested_sets": sum(per_stream[s] for s in only_untested),
        "secondary_sets": sum(min(n_secondary, len(s)) * (n_kinds - 1) for s in streams),
        "secondary_kinds": [k for k in kinds if k != primary],
    }


def _tests(m: int) -> str:
    """``"1 test"``, ``"5 tests"``: the size of the corrected family, in words."""
    return f"{m} test{'' if m == 1 else 's'}"


def _distinct_sets(n: int) -> str:
    return f"{n} distinct control set{' exists' if n == 1 else 's exist'}"


def _unreachable_reason(x: _Test, n: int, plan: dict, settings: VerificationSettings) -> str:
    """Why a test's ``n`` control sets cannot give a verdict (its ``no_verdict``), that none was
    ablated where so, and, where too few distinct sets exist, how to get more (the fewest a
    verdict needs, :func:`~headprobe.analyses.vocabulary.together_draws_needed`; :func:`_more_sets`)."""
    few = f"only {_distinct_sets(n)}" if n < plan["n_random"] else f"{n} control sets"
    need = together_draws_needed(plan["family_size"], plan["alpha"], plan["correction"])
    return (
        f"{few}: its smallest p-value 1/{n + 1} = {1 / (n + 1):.3f} cannot reach alpha = {plan['alpha']:g} after "
        f"{plan['correction']} over {_tests(plan['family_size'])}"
        + (f"; {draws_advice(plan['alpha'], plan['family_size'], plan['correction'])}" if n >= plan["n_random"] else "")
        + ("; not run: none of them was ablated, as they could decide nothing" if x.not_run else "")
        + (_more_sets(x, need, settings.control, settings.k) if n < plan["n_random"] and n < need else "")
    )


def _more_sets(x: _Test, need: int, control: str, k: int) -> str:
    """How a test with fewer than ``need`` distinct control sets could get a verdict, from what a
    rerun would have (:attr:`_Test.rerun`, :func:`_rerun_reach`): the smaller ``-k`` with which it
    could be CONFIRMED, largest first, with their sets; else that no smaller one can (the most
    sets one gives) and a model with more heads; ``--control uniform`` where that rerun could."""

    def can(c: str) -> list[tuple[int, int]]:  # (k, sets) of the reruns under c that can confirm it
        return sorted(((kk, n) for (cc, kk), (n, r) in x.rerun.items() if cc == c and r != "never"), reverse=True)

    smaller = [(kk, n) for kk, n in can(control) if kk < k]
    uni = can("uniform")[0] if control != "uniform" and can("uniform") else None  # the largest such k
    uniform = "" if uni is None else f"--control uniform{'' if uni[0] == k else f' with -k {uni[0]}'}"
    uniform_sets = "" if uni is None else f" ({_sets(uni[1])})"
    out = f"; for a verdict a test needs at least {need} distinct control sets: "
    if smaller:
        named = [f"-k {kk} ({_sets(n)})" for kk, n in smaller[:3]]
        rest = sorted(kk for kk, _ in smaller[3:])
        return (
            out
            + "use "
            + (f"{', '.join(named[:-1])} or {named[-1]}" if len(named) > 1 else named[0])
            + (f"; -k {_ranges(rest)} also do{'es' if len(rest) == 1 else ''}" if rest else "")
            + (f"; {uniform} also does{uniform_sets}" if uniform else "")
        )
    tried = [(n, kk) for (cc, kk), (n, _) in x.rerun.items() if cc == control and kk < k]
    if tried:
        n, kk = max(tried)
        out += (
            f"no smaller -k gives that many (at most {_sets(n)}, at -k {kk}): "
            if n < need
            else f"no smaller -k allows one (-k {kk} gives {_sets(n)}, but the family's other tests have too few): "
        )
    return out + "use a model with more heads" + (f" or {uniform}{uniform_sets}" if uniform else "")


def _sets(n: int) -> str:
    """``"84 sets"``, ``"1 set"``, ``"10^21 or more sets"`` (a count past a billion by its order)."""
    return f"{n:,} set{'' if n == 1 else 's'}" if n < 10**9 else f"10^{len(str(n)) - 1} or more sets"


def _ranges(ks: Sequence[int]) -> str:
    """Sorted whole numbers in runs: ``[1, 2, 3, 5]`` -> ``"1-3, 5"``."""
    runs: list[list[int]] = []
    for k in ks:
        if runs and k == runs[-1][-1] + 1:
            runs[-1].append(k)
        else:
            runs.append([k])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else f"{r[0]}" for r in runs)


def _rerun_reach(
    tests: list[_Test],
    top: Mapping[str, Sequence[Head]],
    task_of: Mapping[str, str],
    all_heads: list[Head],
    removed: set,
    settings: VerificationSettings,
    ranked: bool,
) -> None:
    """Fill :attr:`_Test.rerun` of each test that cannot be CONFIRMED: for each smaller ``-k`` (where
    ``ranked``: ``top``'s lists are the types' heads best first, as ``-k`` picks them) and for
    ``--control uniform`` at every ``-k`` up to this one, its distinct control sets in that rerun
    (:func:`rerun_set_counts`) and what they allow with the family's other tests at theirs
    (:func:`~headprobe.analyses.statistics.confirmable`: each at its smallest p-value, ``1 / (n + 1)``
    for its n sets, as the rerun's plan judges them; the family, the trusted types, does not depend on k)."""
    family = [x for x in tests if x.no_verdict is None]
    if not any(x.reach == "never" for x in family):
        return
    reruns = [(settings.control, k) for k in range(1, settings.k) if ranked]
    if settings.control != "uniform":
        reruns += [("uniform", k) for k in range(1 if ranked else settings.k, settings.k + 1)]
    for control, k in reruns:
        counts = rerun_set_counts(top, task_of, all_heads, removed, k, control)
        sizes = [counts[x.head_type] for x in family]
        reach = st.confirmable([1 / (n + 1) for n in sizes], settings.correction, settings.alpha)
        for x, n, r in zip(family, sizes, reach):
            if x.reach == "never":
                x.rerun[control, k] = (n, r)


def verify_heads(
    model: LoadedModel,
    top: dict[str, list[Head]],
    task_of: dict[str, str],
    tokens: Mapping[str, TokenSet],
    clean: dict[str, torch.Tensor],
    mean_z: torch.Tensor,
    settings: VerificationSettings,
    metric: AblationMetric = LOSS_METRIC,
    scorers: Mapping[str, Callable] | None = None,
    untrusted: dict[str, str | None] | None = None,
    removed: Iterable[Head] = (),
    progress: bool = False,
    say: Callable[[str], None] | None = None,
    cache: SetLosses | None = None,
    sources: Mapping[str, torch.Tensor] | None = None,
    ranked: bool = True,
) -> tuple[list[Verification], dict]:
    """Ablate each type's top-k heads and its control sets; the verdicts, corrected for their number.

    Args:
        model: a :class:`~headprobe.probe.backends.base.LoadedModel` (its self-check allows head ablation).
        top: head type -> its top-k heads. task_of: head type -> the task it is judged on.
        tokens: task -> :class:`~headprobe.analyses.data.TokenSet` (``tokens``, ``start``, ``period``).
        clean: task -> per-sequence clean loss ``[batch]`` (nats/token; zeros for an encoder).
        mean_z: ``[layer, head, d_head]`` mean ``z`` over the natural text (mean ablation).
        settings: k, draws, alpha, control design, correction, seed.
        metric: what an effect is measured in (its ``min_effect`` enters the rule).
        scorers: task -> the ``score`` argument of :func:`set_ablation_losses` (an encoder's
            :class:`~headprobe.analyses.ablation.EmbeddingDistance`); None: the loss.
        untrusted: task -> why its losses cannot carry a verdict (those tests are reported with
            ``confirmed=None`` and are not in the corrected family).
        removed: heads a pruned model no longer has: never drawn into a control set.
        progress: one tqdm bar over every set to ablate; its total shrinks when a test stops.
        say: called with each line of the plan (:func:`plan_lines`) before the first control set.
        cache: the set losses of an interrupted run and where to save them as they grow
            (:class:`SetLosses`, a scan's checkpoint); None: a fresh one that saves nowhere.
        sources: task -> source tokens ``[batch, pos]`` of a kind that needs one (``resample``).
        ranked: ``top``'s lists are each type's heads best first, as ``-k`` picks them (a smaller
            ``-k`` takes a prefix): a test with too few control sets names the smaller ``-k`` that
            gives enough (:func:`_more_sets`); False (a file's heads): it names none.

    Returns:
        ``(verifications, design)``: one :class:`Verification` per type and kind (the tested kind
        first), and the design record for summary.json (alpha, correction, family size, the plan,
        sets ablated, notes, warnings: the tests whose draws cannot reach alpha).

    Raises:
        HeadprobeError: too few heads for a control set, or as :func:`set_ablation_losses`.
    """
    from headprobe.probe.core.progress import progress_bar

    untrusted, scorers, removed = untrusted or {}, scorers or {}, set(removed)
    requested, spec = settings.n_random, model.spec
    settings, tests, streams, excluded, notes = _drawn_tests(top, task_of, spec, untrusted, removed, settings)
    plan, n_secondary = _capped_plan(tests, streams, settings, requested)
    _rerun_reach(tests, top, task_of, _all_heads(spec), removed, settings, ranked)
    at = len(notes)  # the pool notes go here, once the draws say how many sets were ablated
    run = _Ablator(
        model,
        tokens,
        clean,
        mean_z,
        scorers,
        progress_bar(total=plan["max_sets"], desc="verification", unit="set", progress=progress),
        _clean_residuals(model, tests, streams, tokens),
        cache=cache if cache is not None else SetLosses(),
        sources=sources or {},
    )
    estimate = _timed_top_sets(run, tests, settings, plan)
    notes += _non_finite_top(tests, settings.primary_kind)
    plan["lines"] = plan_lines(plan)  # stored without the time estimate (a timing: the design's "timings_s")
    for line in plan_lines({**plan, **estimate}):
        (say or (lambda _: None))(line)
    run.controls(tests, streams, settings, n_secondary)
    run.bar.close()
    notes[at:at] = _pool_notes(tests, streams, settings)
    out, design = _verdicts(tests, streams, excluded, settings, metric, clean, plan, notes, run.ablated)
    design["timings_s"] = {f"plan_{k}": v for k, v in estimate.items()}
    return out, design


def _drawn_tests(
    top: dict[str, list[Head]],
    task_of: dict[str, str],
    spec: ModelSpec,
    untrusted: dict[str, str | None],
    removed: set,
    settings: VerificationSettings,
) -> tuple[VerificationSettings, list[_Test], list[list[list[Head]]], dict, list[str]]:
    """:func:`verify_heads`' tests and control streams (:func:`_draw_controls`) over every head of
    ``spec``: ``settings`` with the draws the trusted tests' family needs (:func:`plan_draws`), the
    tests (each marked with its task's ``untrusted`` reason), their streams, excluded heads and notes."""
    all_heads = _all_heads(spec)
    m = len([t for t in top if not untrusted.get(task_of[t])])
    settings = replace(settings, n_random=plan_draws(m, settings))
    tests, streams, excluded, notes = _draw_controls(top, task_of, all_heads, removed, settings)
    for x in tests:
        x.no_verdict = untrusted.get(x.task)
        x.n_sets = len(streams[x.stream])
    return settings, tests, streams, excluded, notes


def _all_heads(spec: ModelSpec) -> list[Head]:
    """Every ``(layer, head)`` of ``spec``, sorted."""
    return [(layer, head) for layer in range(spec.n_layers) for head in range(spec.n_heads)]


def _capped_plan(
    tests: list[_Test], streams: list[list[list[Head]]], settings: VerificationSettings, requested: int
) -> tuple[dict, int]:
    """:func:`verify_heads`' plan (:func:`make_plan`) of the sets that are ablated, once the tests that
    cannot reach a verdict are capped (:func:`_cap_undecidable`), and the draws of the untested kind."""
    # the untested kind: the first sets of each test's stream (fixed-size, --fixed-draws: all of them)
    n_secondary = min(SECONDARY_DRAWS, settings.n_random) if settings.sequential else settings.n_random
    plan = make_plan(tests, streams, settings, requested, n_secondary)
    skip = settings.sequential and not settings.keep_n_random
    if _cap_undecidable(tests, streams, requested, skip):  # the plan of the sets that are ablated
        plan = make_plan(tests, streams, settings, requested, n_secondary)
    return plan, n_secondary


def _timed_top_sets(run: _Ablator, tests: list[_Test], settings: VerificationSettings, plan: dict) -> dict:
    """Ablate every test's top-k set (each of ``settings.kinds``) and time it: the seconds per set
    (kept in ``run.cache``; a resumed run keeps the first run's) and the estimate for the plan's
    ``max_sets``."""
    import time

    t0 = time.perf_counter()
    run.top_sets(tests, settings.kinds)
    if run.cache.seconds_per_set is None:  # a resumed run keeps the first run's timing
        run.cache.seconds_per_set = (time.perf_counter() - t0) / max(run.ablated, 1)
        run.cache.save()
    return {
        "seconds_per_set": run.cache.seconds_per_set,
        "estimated_s": run.cache.seconds_per_set * plan["max_sets"],
    }


def _verdicts(
    tests: list[_Test],
    streams: list,
    excluded: dict,
    settings: VerificationSettings,
    metric: AblationMetric,
    clean: dict,
    plan: dict,
    notes: list[str],
    ablated: int,
) -> tuple[list[Verification], dict]:
    """The corrected verdicts of the finished tests and the design record (:func:`verify_heads`)."""
    family = [x for x in tests if x.no_verdict is None]
    adjusted = dict(
        zip((x.head_type for x in family), st.adjust_p_values([x.mc.p_value() for x in family], settings.correction))
    )
    out = [
        _verification(
            x,
            kind,
            streams[x.stream],
            excluded[x.head_type],
            adjusted.get(x.head_type),
            settings,
            metric,
            float(clean[x.task].double().mean()) if metric is LOSS_METRIC else None,  # 1 - cos: 0 clean, by definition
            plan,
        )
        for x in tests
        for kind in (settings.primary_kind, *(k for k in settings.kinds if k != settings.primary_kind))
    ]
    notes += [
        f"{t.replace('_', '-')}: {n} control set{'s' if n > 1 else ''} gave a non-finite loss, counted as "
        "reaching the effect"
        for t, n in ((x.head_type, sum(not np.isfinite(e) for e in x.effects[settings.primary_kind])) for x in tests)
        if n
    ]
    design = {
        "alpha": settings.alpha,
        "correction": settings.correction,
        "verdict_rule": settings.rule(metric).to_dict(),
        "family_size": len(family),
        "primary_kind": settings.primary_kind,
        "control": settings.control,
        "max_draws": settings.n_random,
        "batch": settings.batch,
        "secondary_draws": min(SECONDARY_DRAWS, settings.n_random) if settings.sequential else settings.n_random,
        "sequential": settings.sequential,
        "besag_clifford_h": next((x.mc.h for x in tests if not x.not_run), None),
        "sets_ablated": ablated,  # the top-k sets and every control set, each kind counted
        "plan": plan,
        "notes": notes,
        "warnings": [str(w) for w in no_verdict_warnings(out)],
    }
    return out, design


def no_verdict_warnings(verifications: Sequence[Verification]) -> list[verdicts.NoVerdictWarning]:
    """A ``"type"`` warning (:class:`~headprobe.analyses.verdicts.NoVerdictWarning`) for each tested
    verdict withheld (``no_verdict``: its draws cannot reach alpha, its task is untrusted), in
    ``verifications``' order; the design record's ``warnings`` are their lines."""
    return [
        verdicts.NoVerdictWarning.for_type(v.head_type, v.no_verdict, v.task)
        for v in verifications
        if v.tested and v.no_verdict
    ]


def _pool_notes(tests: list[_Test], streams: list, settings: VerificationSettings) -> list[str]:
    """A note per test whose stream is shorter than ``n_random`` (fewer distinct sets exist): which
    heads its pool leaves out (the task's top-k sets, or its own where those leave too few,
    :func:`control_pools`) and, once its draws are done, how many of the sets were ablated where
    not all (its row's ``draws``). It said "9 distinct control sets exist (the heads outside the
    task's top-k sets allow no more)" of a pool outside its own top-k set, beside a row of 1 set."""
    out = []
    for x in tests:
        if (n := x.judged_sets(streams)) < settings.n_random:
            pool = (
                f"the heads outside its own top-{settings.k} set allow no more: the task's top-{settings.k} sets "
                f"leave fewer than {2 * settings.k} heads"
                if x.own_pool
                else f"the heads outside the task's top-{settings.k} sets allow no more"
            )
            out.append(
                f"{x.head_type.replace('_', '-')}: only {n} distinct {settings.control} control "
                f"{'set exists' if n == 1 else 'sets exist'} ({pool}), so its smallest possible p-value is 1/{n + 1}"
                + {
                    "never": ": it cannot be CONFIRMED",
                    "with others": ": it can be CONFIRMED only together with other tests",
                }.get(x.reach or "", "")
                + _ablated_of(x, n, settings.primary_kind)
            )
    return out


def _ablated_of(x: _Test, n: int, primary: str) -> str:
    """``; its mean-ablation draws stopped after 1 of them: settled above alpha`` where its tested
    kind's draws ended before its ``n`` sets (its row's ``draws``, ``stop_reason``; the other kind's
    rows use the first sets of the same stream); ``; none of them was ablated: not run``; "" where all were."""
    done = len(x.effects[primary])
    if done >= n:
        return ""
    if done == 0:
        return "; none of them was ablated: not run" if x.not_run else "; none of them was ablated"
    why = {SETTLED: "settled above alpha", FUTILE: "curtailed (futile under the correction)"}
    return f"; its {primary}-ablation draws stopped after {done} of them: {why.get(stop_reason(x.mc), 'stopped')}"


def _non_finite_top(tests: list[_Test], primary: str = PRIMARY_KIND) -> list[str]:
    """Tests whose top-k effect is not finite (a NaN or infinite ablated loss) leave the family
    with that reason (``no_verdict``): a loss that could not be measured confirms nothing."""
    out = []
    for x in tests:
        if x.no_verdict is None and not np.isfinite(x.top_effect[primary]):
            x.no_verdict = (
                f"ablating its top-k heads gave a non-finite loss ({x.top_effect[primary]}); "
                "it leaves the corrected family"
            )
            out.append(f"{x.head_type.replace('_', '-')}: {x.no_verdict}")
    return out


def short_draws(plan: dict) -> bool:
    """Whether every verdict of the plan's family is withheld by the draws asked for alone (``--keep-n-random``
    below what the family needs, :func:`~headprobe.analyses.vocabulary.unreachable_note`): then the plan says
    so in one line, the verdicts' reasons name the count only, and scan's report points to that line."""
    m, n = plan["family_size"], plan["n_random"]
    if not m or _unreachable_note(n, plan["alpha"], m, plan["correction"]) is None:
        return False
    return all(t["confirmable"] == "never" and not t.get("not_run") and t["control_sets"] >= n for t in plan["tests"])


def plan_lines(plan: dict) -> list[str]:
    """The plan as printed before the control sets are ablated: one line, and one more per
    verdict the draws cannot reach on its own."""
    m, need, n = plan["family_size"], plan["lone_draws_needed"], plan["n_random"]
    if not m:
        return []
    est = plan.get("estimated_s")
    line = (
        f"verification plan: {m} test{'s' if m > 1 else ''} ({', '.join(t.replace('_', '-') for t in plan['family'])}),"
        f" {plan['correction']} at alpha {plan['alpha']:g}: a lone CONFIRMED needs p <= {plan['alpha'] / m:.4g}, "
        f"i.e. {need} control sets; "
    )
    if plan["raised"]:
        line += f"--n-random {plan['n_random_requested']} raised to {n} (--keep-n-random keeps it); "
    elif plan["kept"] and n < need:
        line += f"--n-random {n} kept (--keep-n-random); "
    else:
        line += f"--n-random {n}; "
    line += (
        f"at most {plan['max_sets']} sets"
        + _sets_breakdown(plan)
        + (
            f", about {est:.0f} s at {plan['seconds_per_set']:.2f} s a set"
            if est is not None and est >= 0.5
            else f", under a second ({plan['seconds_per_set'] * 1e3:.2g} ms a set)"
            if est is not None
            else ""
        )
    )
    out = [line]
    if short_draws(plan):  # every verdict held back by the draws alone: one line, not one per type
        return [*out, f"NOTE: {_unreachable_note(n, plan['alpha'], m, plan['correction'])}"]
    hard = [t for t in plan["tests"] if t["confirmable"] != "alone"]
    for t in hard:
        short = (
            f"{t['control_sets']} control sets, the {plan['n_random_requested']} asked for"
            if t.get("capped") and not t.get("not_run")
            else f"only {_distinct_sets(t['control_sets'])}"
            if t["control_sets"] < n
            else f"{t['control_sets']} control sets are below the {need} a lone verdict needs"
        )
        what = (
            "it cannot be CONFIRMED at all"
            if t["confirmable"] == "never"
            else "it can be CONFIRMED only together with other tests"
        )
        why = (
            ": not run: none of its control sets is ablated, as they could decide nothing"
            if t.get("not_run")
            else ": no more are ablated, as they could decide nothing; its p-value is reported from these"
            if t.get("capped")
            else ""
        )
        out.append(
            f"NOTE: {t['head_type'].replace('_', '-')}: {short}: {what} ({plan['correction']} over {_tests(m)}){why}"
        )
    if (
        hard
        and len(hard) == m
        and all(t["control_sets"] >= n or (t.get("capped") and not t.get("not_run")) for t in hard)
    ):
        out.append(f"NOTE: no verdict of this run can be CONFIRMED on its own; use --n-random {need} or more")
    return out


def _sets_breakdown(plan: dict) -> str:
    """What the plan's ``max_sets`` are, where some are not the family's: `` (10 top-k sets, 0 control
    sets for the 1 test, 32 for the 4 types reported without a verdict: previous-token, ...)``. The
    plan line named only the family, so a family whose one test was not run read "at most 42 sets"
    over sets that were the untested types'. Empty where every type is in the family."""
    untested = plan.get("untested") or []
    if not untested:
        return _family_sets(plan)
    m, top, rest = plan["family_size"], plan["top_sets"], plan["untested_sets"]
    names = ", ".join(t.replace("_", "-") for t in untested)
    return (
        f" ({top} top-k sets, {plan['max_sets'] - top - rest} control sets for the {_tests(m)}, {rest} for the "
        f"{len(untested)} type{'' if len(untested) == 1 else 's'} reported without a verdict: {names})"
    )


def _family_sets(plan: dict) -> str:
    """:func:`_sets_breakdown` where every type is in the family: `` (2 top-k sets: 1 test x 2 kinds;
    10 control sets; 5 of them again as zero-ablation)``. "--n-random 10 ...; at most 17 sets" did not
    say what the 17 counted. Empty for a plan without the counts (written before them)."""
    if "top_sets" not in plan or "secondary_sets" not in plan:
        return ""
    m, top, again = plan["family_size"], plan["top_sets"], plan["secondary_sets"]
    kinds = "/".join(plan.get("secondary_kinds") or [])
    return (
        f" ({top} top-k sets: {_tests(m)} x {top // max(m, 1)} kinds; {plan['max_sets'] - top - again} control sets"
        + (f"; {again} of them again as {kinds}-ablation" if again else "")
        + ")"
    )


def _clean_residuals(
    model: LoadedModel, tests: list[_Test], streams: list[list[list[Head]]], tokens: Mapping[str, TokenSet]
) -> dict:
    """Task -> :class:`CleanResiduals` at the first layer of each set its tests will ablate (a
    layer-matched set starts where its top-k set starts)."""
    starts: dict[str, set[int]] = {}
    for x in tests:
        starts.setdefault(x.task, set()).update(min(layer for layer, _ in hs) for hs in [x.top, *streams[x.stream]])
    return {task: CleanResiduals(model, tokens[task].tokens, layers) for task, layers in starts.items()}


class SetLosses:
    """The per-sequence losses of every head set a verification ablates, by task, kind and set:
    what a scan's checkpoint holds. Every set goes through it, in an uninterrupted run too, so a
    run resumed from a checkpoint makes the same calls on the same batches from where it stopped
    and ends with the same numbers. Non-finite losses are stored as text (``"nan"``), as JSON
    allows no NaN."""

    def __init__(self, saved: dict | None = None, on_save: Callable[[dict], None] | None = None):
        saved = saved or {}
        self.losses: dict[str, list[float]] = {k: [float(v) for v in row] for k, row in saved.get("losses", {}).items()}
        self.seconds_per_set: float | None = saved.get("seconds_per_set")
        self.resumed = len(self.losses)
        self.on_save = on_save

    @staticmethod
    def key(task: str, kind: str, heads: Sequence[Head]) -> str:
        return f"{task}|{kind}|" + ",".join(f"{layer}.{head}" for layer, head in heads)

    def state(self) -> dict:
        """The JSON-able record a checkpoint saves (:meth:`__init__` reads it back)."""
        return {
            "losses": {k: [v if math.isfinite(v) else str(v) for v in row] for k, row in self.losses.items()},
            "seconds_per_set": self.seconds_per_set,
        }

    def save(self) -> None:
        if self.on_save is not None:
            self.on_save(self.state())


@dataclass
class _Ablator:
    """Ablates head sets of a task (batched, sharded under torchrun) and keeps one progress bar over
    the whole verification, made with every set planned; a settled stream's unneeded sets leave its total."""

    backend: LoadedModel
    tokens: Mapping[str, TokenSet]
    clean: dict
    mean_z: torch.Tensor
    scorers: Mapping[str, Callable]
    bar: Any  # a tqdm bar (tqdm ships no types)
    resid: dict = field(default_factory=dict)  # task -> CleanResiduals: each set starts at its first layer
    ablated: int = 0
    cache: SetLosses = field(default_factory=SetLosses)
    sources: Mapping[str, torch.Tensor] = field(default_factory=dict)  # task -> source tokens (resample)

    def effects(self, task: str, sets: list[list[Head]], kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(losses [set, batch], effects [set, batch])`` of ablating each of ``sets`` (kind
        ``kind``); sets already in :attr:`cache` (a resumed run's) are not ablated again."""
        ts = self.tokens[task]
        first = first_scored(task, ts.start, ts.period)
        keys = [SetLosses.key(task, kind, hs) for hs in sets]
        todo = {k: hs for k, hs in zip(keys, sets) if k not in self.cache.losses}
        source: dict[str, Any] = {"source_tokens": self.sources[task]} if task in self.sources else {}
        if todo:
            new = distributed.map_sharded(  # under torchrun each rank ablates its slice of the sets
                lambda part: set_ablation_losses(
                    self.backend,
                    ts.tokens,
                    part,
                    kind,
                    self.mean_z,
                    first,
                    score=self.scorers.get(task),
                    clean=self.resid.get(task),
                    **source,
                ),
                list(todo.values()),
            )
            self.cache.losses.update(zip(todo, new.float().tolist()))
            self.cache.save()
        losses = torch.tensor([self.cache.losses[k] for k in keys], dtype=torch.float32)
        self.ablated += len(sets)
        self.bar.update(len(sets))
        return losses, (losses - self.clean[task][None]).double()

    def top_sets(self, tests: list[_Test], kinds: Sequence[str] = KINDS) -> None:
        """Every test's top-k effect, per kind: one call per task and kind."""
        for task in dict.fromkeys(x.task for x in tests):
            group = [x for x in tests if x.task == task]
            for kind in kinds:
                losses, eff = self.effects(task, [x.top for x in group], kind)
                for x, row, loss in zip(group, eff.numpy(), losses):
                    x.top_per_seq[kind], x.top_effect[kind] = row, float(row.mean())
                    x.top_loss[kind] = float(loss.double().mean())

    def controls(
        self,
        tests: list[_Test],
        streams: list[list[list[Head]]],
        settings: VerificationSettings,
        n_secondary: int,
    ) -> None:
        """Ablate the control sets in rounds, ``settings.batch`` sets of each open stream a round
        (the open streams of one task and kind in one call), feeding the tests on each stream,
        until every test is done (:func:`_curtail` after each round); the untested kind on the
        first ``n_secondary`` sets of each stream, in the first round."""
        for x in tests:  # a stream holds n_random sets, or every distinct set where there are fewer
            x.mc = st.SequentialMCTest(
                x.top_effect[settings.primary_kind],
                len(streams[x.stream]),
                settings.alpha,
                sequential=settings.sequential,
                tie=P_VALUE_TIE,
            )
        primary, kinds = settings.primary_kind, settings.kinds
        planned = [len(sets) + min(n_secondary, len(sets)) * (len(kinds) - 1) for sets in streams]
        done = [0] * len(streams)
        task_of = {x.stream: x.task for x in tests}
        while any(not x.mc.done for x in tests):
            spans = {
                s: (done[s], min(done[s] + settings.batch, len(streams[s])))
                for s in sorted({x.stream for x in tests if not x.mc.done})
            }
            for task in dict.fromkeys(task_of[s] for s in spans):
                for kind in kinds:
                    cut = {
                        s: streams[s][lo:hi] if kind == primary else streams[s][:n_secondary] if lo == 0 else []
                        for s, (lo, hi) in spans.items()
                        if task_of[s] == task
                    }
                    self._ablate_round(tests, task, kind, cut, planned)
            for s, (lo, hi) in spans.items():
                for x in tests:
                    if x.stream == s and not x.mc.done:
                        x.mc.add(x.effects[primary][lo:hi])
                done[s] = hi
            _curtail(tests, settings)
            for s in range(len(streams)):  # a stream whose tests are all settled: its sets are not needed
                if planned[s] and all(x.mc.done for x in tests if x.stream == s):
                    self.bar.total -= planned[s]
                    planned[s] = 0
                    self.bar.refresh()

    def _ablate_round(
        self, tests: list[_Test], task: str, kind: str, cut: dict[int, list[list[Head]]], planned: list[int]
    ) -> None:
        """Ablate ``cut`` (stream -> its sets this round) of one task and kind in one call; each open
        test on a stream gets its sets' effects; ``planned`` (sets left per stream) loses them."""
        flat = [hs for sets in cut.values() for hs in sets]
        if not flat:
            return
        eff = iter(self.effects(task, flat, kind)[1].mean(dim=1).tolist())
        for s, sets in cut.items():
            part = [next(eff) for _ in sets]
            for x in tests:
                if x.stream == s and not x.mc.done:
                    x.effects[kind] += part
            planned[s] -= len(sets)


def _curtail(tests: list[_Test], settings: VerificationSettings) -> None:
    """Stop the open tests of the family that can no longer be rejected after the correction
    (:func:`curtail_family`). Off for fixed-size runs and when ``n_random`` cannot reach ``alpha``
    (then every test runs to the end, for its p-value)."""
    if not settings.sequential or not settings.reachable:
        return
    curtail_family([x.mc for x in tests if x.no_verdict is None], settings.correction, settings.alpha)


def curtail_family(tests: Sequence[st.SequentialMCTest], correction: str, alpha: float) -> None:
    """The curtailment rule of a family of sequential tests (one per tested head type), applied
    in place after every round of draws: stop each open test that at least one control draw has
    reached and whose adjusted p-value (``correction`` over the family, every test at its best
    p-value) stays above ``alpha`` even if no later draw reached its effect
    (:func:`~headprobe.analyses.statistics.unwinnable`).

    Two things are deliberately *not* reasons to stop: an effect below the effect floor (such a
    test may still be a rejection that lowers the others' adjusted p-values, so stopping it with a
    bound changed verdicts), and the other tests' outcomes alone while no draw has reached this
    test's effect (it keeps drawing to the planned number, and reports p = 1/(n+1) if none ever
    does). With these two exclusions the verdicts are those of fixed draws (docs/scan.md,
    "Curtailment"). The scan applies it in :func:`verify_heads`; ``benchmarks/verification.py``
    replays it on a fixed-size run's draws."""
    for i in st.unwinnable([t.best_p for t in tests], [not t.done for t in tests], correction, alpha):
        if tests[i].exceedances >= 1:
            tests[i].curtail()


def _verification(
    x: _Test,
    kind: str,
    stream: list[list[Head]],
    excluded: list[Head],
    p_adj: float | None,
    settings: VerificationSettings,
    metric: AblationMetric,
    clean_loss: float | None,
    plan: dict,
) -> Verification:
    """One row of evidence: the tested kind with its sequential p and adjusted p, or the other kind
    (reported on the control sets it ablated, plain Monte Carlo p). A tested test whose draws
    cannot reach alpha (``reach`` never) has no verdict, with the reason; where none of its
    control sets was ablated (:attr:`_Test.not_run`) both rows have no draws and no p-value
    (``p_value`` and ``p_adjusted`` None; the correction still counts the test, at p = 1, as the
    plan's family was fixed before any ablation), no control mean or maximum (NaN), ``stop_reason``
    :data:`NOT_RUN`."""
    primary = settings.primary_kind
    effects = x.effects[kind]
    n = len(effects)
    tested = kind == primary and x.no_verdict is None
    if kind == primary:
        p, g = x.mc.p_value(), x.mc.exceedances
    else:
        g = sum(not e < x.top_effect[kind] - P_VALUE_TIE for e in effects)  # NaN counts as reaching
        p = (1 + g) / (1 + n)
    confirmed, no_verdict = None, x.no_verdict
    if tested and x.reach == "never":
        no_verdict = _unreachable_reason(x, x.n_sets if x.not_run else len(stream), plan, settings)
    elif tested:
        assert p_adj is not None  # a tested row has an adjusted p
        confirmed = settings.rule(metric).confirms(p_adj, x.top_effect[kind], effects)
    return Verification(
        head_type=x.head_type,
        kind=kind,
        task=x.task,
        k=settings.k,
        top_heads=names(x.top),
        clean_loss=clean_loss,
        top_loss=x.top_loss[kind] if metric is LOSS_METRIC else None,  # 1 - cos ablated: top_effect (0 clean)
        top_effect=x.top_effect[kind],
        random_effects=effects,
        random_mean=float(np.mean(effects)) if n else float("nan"),
        random_max=float(np.max(effects)) if n else float("nan"),
        confirmed=confirmed,
        random_heads=[names(s) for s in stream[:n]],
        control_excludes=names(excluded),
        p_value=float(p) if n else None,  # no control set ablated: no Monte Carlo p-value at all
        top_effect_ci95=[float(v) for v in st.mean_ci(x.top_per_seq[kind])],
        no_verdict=no_verdict,
        metric=metric.name,
        alpha=settings.alpha,
        min_effect=settings.rule(metric).min_effect,
        p_adjusted=None if p_adj is None or kind != primary or not n else float(p_adj),
        draws=n,
        control=settings.control,
        correction=settings.correction if tested else None,
        tested=tested,
        p_method=_p_method(x) if kind == primary or x.not_run else "monte-carlo (reported, not tested)",
        stop_reason=stop_reason(x.mc, x.not_run) if kind == primary else None,
        exceedances=int(g),
        p_value_is_bound=bool(kind == primary and x.mc.curtailed),
        p_value_min=float(x.mc.best_p) if kind == primary and x.mc.curtailed else None,
    )


SETTLED, FUTILE, RAN_TO_END = "settled above alpha", "futile under the correction", "ran to the end"
"""The values of a verdict's ``stop_reason``: ``h`` draws reached its effect (Besag-Clifford: its
p is above alpha whatever came next); curtailed (:func:`curtail_family`: its p is a bound); all of
its stream's sets drawn."""
NOT_RUN = verdicts.NOT_RUN
"""``stop_reason`` of a test none of whose control sets was ablated: its control sets cannot give
a p-value that reaches alpha after the correction, so its verdict (none) was known before any
(:func:`_cap_undecidable`)."""


def stop_reason(mc: st.SequentialMCTest, not_run: bool = False) -> str:
    """Why a tested kind's test ended: :data:`NOT_RUN`, :data:`SETTLED`, :data:`FUTILE` or :data:`RAN_TO_END`."""
    return NOT_RUN if not_run else FUTILE if mc.curtailed else SETTLED if mc.stopped else RAN_TO_END


def _p_method(x: _Test) -> str:
    mc = x.mc
    if x.not_run:
        return (
            "not run (no control set ablated: its sets cannot reach alpha after the correction; no p-value, "
            "counted in the correction's family at p = 1)"
        )
    if mc.curtailed:
        return "sequential monte-carlo (curtailed: the largest p still reachable, a bound)"
    return "sequential monte-carlo (stopped early)" if mc.stopped else "sequential monte-carlo"
