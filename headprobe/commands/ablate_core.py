"""``headprobe ablate``'s computation: the run, its result and how it is saved (see
:mod:`headprobe.commands.ablate` for the command and its settings). Imports torch, pandas and
matplotlib; the package's ``__init__`` does not, so flags are checked before they load."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import torch

from headprobe import options
from headprobe.analyses import distributed
from headprobe.analyses import figures as figs
from headprobe.analyses.ablation import (
    SweepResult,
    capture_z,
    capture_z_plan,
    exact_sweep,
    first_scored,
    head_importance,
    importance_plan,
    layer_normalized,
    mean_z_from,
    spearman,
    sweep_plan,
    top_heads,
    unknown_text_reason,
    untrusted_text_note,
)
from headprobe.analyses.attribution import atp_star, estimate_plan, forward_equivalents, second_order
from headprobe.analyses.data import TokenSet, left_out_notes, window_counts
from headprobe.analyses.outputs import WritesOutputs
from headprobe.analyses.scoring import score_plan, score_tokens
from headprobe.analyses.statistics import SPEARMAN_INTERVAL_RULE, interval_rule, no_interval_reason, spearman_ci
from headprobe.commands.ablate import ESTIMATES, NEEDS_CAUSAL, TASKS, AblateConfig
from headprobe.probe.backends.base import LoadedModel
from headprobe.probe.core import ablation_kinds
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.core.heads import format_head
from headprobe.probe.core.io import summary_envelope
from headprobe.probe.core.memory import BatchPlan
from headprobe.probe.core.reprs import CompactRepr, load_seconds
from headprobe.probe.hooks.capture import kv_head_of
from headprobe.probe.layout.spec import ModelSpec

if TYPE_CHECKING:
    from matplotlib.figure import Figure


@dataclass(frozen=True)
class TaskResult:
    """One task's sweep and gradient scores; arrays are ``[layer, head]``, losses in nats/token.

    Attributes:
        clean_loss: the task's loss with no head ablated.
        effect: loss change from ablating each head alone, ablated − clean (nats/token; NaN where not swept).
        importance: Michel et al.'s gradient importance ``I_h = E_x |dL(x)/dxi_h|``, unnormalised
            (``head_importance(..., normalize=False)``; ``prune`` ranks by the per-layer
            l2-normalised one), nats per unit of the head mask.
        attribution: attribution patching's estimate of each head's effect.
        sweep_s, gradient_s: seconds spent on the sweep and on the gradient scores.
        estimated: with ``--estimate``: the estimate of each head's effect (``effect`` is then all NaN:
            nothing was swept); None otherwise.
        effect_ci: ``[2, layer, head]`` the 95% Student-t interval of ``effect`` over the task's
            sequences (:func:`~headprobe.analyses.statistics.mean_ci`; NaN where not swept or from
            one sequence); None with ``--estimate``.
    """

    clean_loss: float
    effect: np.ndarray
    importance: np.ndarray
    attribution: np.ndarray
    sweep_s: float
    gradient_s: float
    estimated: np.ndarray | None = None
    effect_ci: np.ndarray | None = None

    @property
    def estimate(self) -> np.ndarray:
        """:attr:`estimated` of an ``--estimate`` run (never None there)."""
        assert self.estimated is not None
        return self.estimated


CHUNK_LAYERS = 5
"""Layers swept between two checkpoints (each chunk costs one extra clean forward pass)."""


def checkpointed_sweep(
    model: LoadedModel,
    tokens,
    heads,
    kind,
    mean_z,
    source_tokens,
    first,
    max_batch,
    done: dict,
    save,
    desc: str = "ablation sweep",
    progress: bool = True,
) -> SweepResult:
    """:func:`~headprobe.analyses.ablation.exact_sweep` in chunks of :data:`CHUNK_LAYERS` layers, recording
    each chunk's losses in ``done`` (``{"clean": float, "loss": {"layer.head": float}, "clean_seq":
    [float], "seq": {"layer.head": [float]}}``: means and per-sequence losses) and calling ``save()``
    after it; heads already in ``done["seq"]`` are skipped (a checkpoint written before per-sequence
    losses were kept is swept again). Every chunk is deterministic, so a resumed sweep equals an
    uninterrupted one. The result holds the per-sequence losses (``per_sequence``, ``clean_per_sequence``).

    Under ``torchrun`` (:mod:`headprobe.analyses.distributed`) each rank sweeps its slice
    (:func:`~headprobe.analyses.distributed.shard_of`) of the heads not yet in ``done`` (which
    must be the same on every rank when the call starts), saving only its own progress, and the
    ranks' losses are then gathered into every rank's ``done``: the result is the one-process
    sweep's (to float rounding, < 1e-6 nats; the heads sharing a batched pass differ)."""
    from headprobe.probe.core.progress import progress_bar

    spec = model.spec
    done.setdefault("seq", {})
    todo = [h for h in heads if format_head(h) not in done["seq"]]
    mine = set(distributed.shard_of(todo))
    layers = sorted({layer for layer, _ in heads})
    chunks = [
        [h for h in heads if h[0] in layers[i : i + CHUNK_LAYERS] and h in mine]
        for i in range(0, len(layers), CHUNK_LAYERS)
    ]
    for chunk in progress_bar([c for c in chunks if c], desc=desc, unit="chunk", progress=progress):
        part = exact_sweep(
            model,
            tokens,
            heads=chunk,
            kind=kind,
            mean_z=mean_z,
            source_tokens=source_tokens,
            first=first,
            max_batch=max_batch,
            per_sequence=True,
        )
        assert part.per_sequence is not None and part.clean_per_sequence is not None  # per_sequence=True
        done["clean"] = part.clean_loss
        done["clean_seq"] = part.clean_per_sequence.tolist()
        done["loss"].update({format_head(h): float(part.loss[h]) for h in chunk})
        done["seq"].update({format_head(h): part.per_sequence[h].tolist() for h in chunk})
        save()
    if distributed.active():
        parts = distributed.all_gather_objects(done)
        for part in parts:
            done["loss"].update(part["loss"])
            done["seq"].update(part.get("seq", {}))
        done["clean"] = next((p["clean"] for p in parts if p["clean"] is not None), None)
        done["clean_seq"] = next((p["clean_seq"] for p in parts if p.get("clean_seq") is not None), None)
    loss = torch.full((spec.n_layers, spec.n_heads), float("nan"))
    clean_seq = torch.tensor(done["clean_seq"], dtype=torch.float) if done.get("clean_seq") is not None else None
    seq = torch.full((spec.n_layers, spec.n_heads, len(done.get("clean_seq") or ())), float("nan"))
    for name, value in done["loss"].items():
        layer, head = map(int, name.split("."))
        loss[layer, head] = float("nan") if value is None else value  # a checkpoint holds NaN as null
        if name in done["seq"]:
            seq[layer, head] = torch.tensor([float("nan") if x is None else x for x in done["seq"][name]])
    return SweepResult(done["clean"], loss, kind, seq, clean_seq)


def merge_states(states: list[dict]) -> dict:
    """One resumable state from the checkpoints of a sharded run (one per rank, plus any
    one-process checkpoint): each task's swept heads, united (every head's loss is the same
    whichever rank swept it). Used by :func:`headprobe.options.main_resumable` under torchrun."""
    merged: dict = {}
    for state in states:
        for task, done in state.items():
            into = merged.setdefault(task, {"clean": None, "loss": {}, "clean_seq": None, "seq": {}})
            into["loss"].update(done.get("loss", {}))
            into["seq"].update(done.get("seq", {}))
            if into["clean"] is None:
                into["clean"] = done.get("clean")
            if into["clean_seq"] is None:
                into["clean_seq"] = done.get("clean_seq")
    return merged


MIN_RANKED_HEADS = 8
"""Fewest swept heads a rank correlation is reported for: over 5 heads a Spearman coefficient of
0.9 arises by chance with probability ~0.04 and is no finding (``--heads 18.6,17.3,...``)."""


def _rank_correlation(
    a, b, names: tuple[str, str] = ("one ranking", "the other")
) -> tuple[float | None, str | None, list[float] | None]:
    """:func:`spearman` of ``a`` and ``b`` (named ``names``) over the heads finite in both, None, and
    its 95% interval over those heads (:func:`~headprobe.analyses.statistics.spearman_ci`, rounded to
    3 decimals; None at ``|rho| = 1``); or None (JSON null, ``n/a`` on screen), the reason and None: fewer than :data:`MIN_RANKED_HEADS`
    such heads (too few to rank), or one side equal on all of them (Spearman's rho divides by its
    zero spread; a model whose W_O is zero has no effect at all)."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    ok = np.isfinite(a) & np.isfinite(b)
    if ok.sum() < MIN_RANKED_HEADS:
        return (
            None,
            f"rho needs at least {MIN_RANKED_HEADS} heads swept, {int(ok.sum())} {'was' if int(ok.sum()) == 1 else 'were'}: too few to rank",
            None,
        )
    flat = [name for name, x in zip(names, (a[ok], b[ok])) if x.min() == x.max()]
    if flat:
        why = f"undefined: {' and '.join(flat)} {'is' if len(flat) == 1 else 'are'} the same for every head"
        return None, why, None
    rho = spearman(a, b)
    ci = spearman_ci(rho, int(ok.sum()))
    return rho, None, None if np.isnan(ci).any() else [round(float(x), 3) for x in ci]


def _rounded_ci(ci: np.ndarray | None, head: tuple[int, int]) -> list[float] | None:
    """``[lo, hi]`` of ``ci`` (``[2, layer, head]``) at ``head``, rounded to 5 decimals; None (JSON null) where
    there is none (one sequence)."""
    if ci is None or not np.isfinite(ci[:, head[0], head[1]]).all():
        return None
    return [round(float(x), 5) for x in ci[:, head[0], head[1]]]


def _rank_correlations(tasks: dict, induction_score) -> dict[str, tuple[float | None, str | None, list[float] | None]]:
    """summary.json's rank correlations, keyed ``<task>.<name>`` (:data:`SPEARMAN_NAMES`) and
    ``induction_score_vs_repeated_loss_delta``: ``(rho, None, ci95)`` or ``(None, why, None)``
    (:func:`_rank_correlation`). ``layer_normalized_importance_vs_abs_effect`` ranks by the score
    ``prune --method michel`` ranks by (:func:`~headprobe.analyses.ablation.layer_normalized`)."""
    out = {}
    for t, r in tasks.items():
        out[f"{t}.gradient_importance_vs_abs_effect"] = _rank_correlation(
            r.importance, np.abs(r.effect), ("gradient importance", "|exact effect|")
        )
        out[f"{t}.layer_normalized_importance_vs_abs_effect"] = _rank_correlation(
            layer_normalized(torch.as_tensor(r.importance)).numpy(),
            np.abs(r.effect),
            ("layer-normalised gradient importance", "|exact effect|"),
        )
        out[f"{t}.gradient_importance"] = _rank_correlation(
            r.importance, r.effect, ("gradient importance", "exact effect")
        )
        out[f"{t}.attribution_patching"] = _rank_correlation(
            r.attribution, r.effect, ("attribution patching", "exact effect")
        )
    out["induction_score_vs_repeated_loss_delta"] = _rank_correlation(
        induction_score, tasks["repeated"].effect, ("induction score", "exact repeated-tokens effect")
    )
    return out


TOP_N = 10
SPEARMAN_NAMES = (
    "gradient_importance_vs_abs_effect",
    "layer_normalized_importance_vs_abs_effect",
    "gradient_importance",
    "attribution_patching",
)
"""summary.json's ``spearman_with_exact_sweep[<task>]`` keys, in order: the unnormalised importance
``I_h`` and its per-layer l2-normalised form (what prune ranks by) against the effect's size, ``I_h``
against the signed effect, attribution patching against the signed effect."""


@dataclass(repr=False)
class AblateResult(CompactRepr, WritesOutputs):
    """What ``ablate`` measured (losses in nats/token).

    Attributes:
        config: the settings.
        spec: the model's :class:`~headprobe.probe.layout.spec.ModelSpec`.
        table: head_ablation.csv: one row per head (``layer``, ``head``, ``kv_head``, ``<task>_loss_delta``,
            ``<task>_importance``: Michel et al.'s ``I_h``, unnormalised, not prune's per-layer
            l2-normalised score; ``<task>_attribution``, ``induction_score``).
        tasks: task (:data:`~headprobe.analyses.columns.TASKS`: ``natural``, ``repeated``) -> :class:`TaskResult`.
        induction_score: ``[layer, head]`` prefix-matching score on the repeated task's tokens.
        natural: the natural-text token set (both halves).
        repeated: the repeated-random token set.
        device: where the model ran.
        self_check: the model's load-time self-check.
        natural_untrusted: why the natural text cannot support its numbers (most of its tokens unknown to
            the tokenizer, :func:`~headprobe.analyses.ablation.untrusted_task_reason`), or None.
        run_s: seconds of :func:`run`.
        load_s: seconds loading the model where ablate loaded it; None where the caller passed a model it loaded (:func:`~headprobe.probe.core.reprs.load_seconds`).
        swept: head ablations this run computed (both tasks, all ranks; the rest came from a checkpoint).
        ranks: processes the sweep was sharded over (1 without torchrun).
    """

    config: AblateConfig
    spec: ModelSpec
    table: pd.DataFrame
    tasks: dict[str, TaskResult]
    induction_score: np.ndarray
    natural: TokenSet
    repeated: TokenSet
    device: str
    self_check: dict
    run_s: float
    load_s: float | None = load_seconds()
    swept: int = 0
    ranks: int = 1
    natural_untrusted: str | None = None

    def summary(self) -> dict:
        """summary.json's content (as a dict; package versions included)."""
        if self.config.estimate:
            return self._estimate_summary()
        results = self.tasks
        rho = _rank_correlations(results, self.induction_score)
        return self._envelope(
            {
                **self._run_fields(),
                "units": "nats/token",
                "top_heads_by_loss_delta": {
                    t: [
                        {
                            "head": format_head(h),
                            "loss_delta": round(float(r.effect[h]), 5),
                            "ci95": _rounded_ci(r.effect_ci, h),
                        }
                        for h in top_heads(torch.as_tensor(r.effect), TOP_N)
                    ]
                    for t, r in results.items()
                },
                "interval_rule": interval_rule() + ": ci95 of each head's loss increase, and the "
                "<task>_loss_delta_ci95_low/high columns of head_ablation.csv",
                **({"interval_null_reasons": no_ci} if (no_ci := self._interval_null_reasons()) else {}),
                **({"ablated_loss_above_uniform": worse} if (worse := self._above_uniform()) else {}),
                # importance is unsigned (E|dL/dxi|): compared with the effect's size, and with the signed effect
                "spearman_with_exact_sweep": {
                    t: {name: rho[f"{t}.{name}"][0] for name in SPEARMAN_NAMES} for t in results
                },
                "top_induction_score_heads": [
                    format_head(h) for h in top_heads(torch.as_tensor(self.induction_score), TOP_N)
                ],
                "spearman_with_exact_sweep_ci95": {
                    t: {name: rho[f"{t}.{name}"][2] for name in SPEARMAN_NAMES} for t in results
                },
                "spearman_induction_score_vs_repeated_loss_delta": rho["induction_score_vs_repeated_loss_delta"][0],
                "spearman_induction_score_vs_repeated_loss_delta_ci95": rho["induction_score_vs_repeated_loss_delta"][
                    2
                ],
                "spearman_interval_rule": SPEARMAN_INTERVAL_RULE,
                "spearman_null_reasons": {k: why for k, (_, why, _) in rho.items() if why},
            },
            {
                **{f"{t}_sweep": r.sweep_s for t, r in results.items()},
                **{f"{t}_gradient": r.gradient_s for t, r in results.items()},
            },
        )

    def _above_uniform(self) -> dict | None:
        """summary.json's ``ablated_loss_above_uniform``, or None (the key absent) where no head's
        ablated loss (clean loss + its effect, nats/token) exceeds ``ln(d_vocab)``, the loss of a
        uniform guess over the vocabulary: ``ln_d_vocab`` (nats), ``d_vocab`` and per task with any
        such head (:data:`TASKS` order) those heads, worst first, ``{"head", "ablated_loss"}``."""
        import math

        bound = math.log(self.spec.d_vocab)
        heads = {}
        for task, r in self.tasks.items():
            ablated = r.clean_loss + np.asarray(r.effect, dtype=float)  # NaN (not swept) compares False
            over = sorted(((int(i), int(j)) for i, j in zip(*np.nonzero(ablated > bound))), key=lambda h: -ablated[h])
            if over:
                heads[task] = [{"head": format_head(h), "ablated_loss": round(float(ablated[h]), 5)} for h in over]
        return {"ln_d_vocab": round(bound, 5), "d_vocab": self.spec.d_vocab, "heads": heads} if heads else None

    def _interval_null_reasons(self) -> dict[str, str]:
        """Task -> why its intervals are null (fewer than 2 sequences: ``--n-natural 1``, ``--n-repeated 1``)."""
        n = {"natural": self.config.n_natural, "repeated": int(self.repeated.tokens.shape[0])}
        return {t: why for t, k in n.items() if (why := no_interval_reason(k))}

    def _envelope(self, body: dict, timings: dict[str, float]) -> dict:
        """``body`` in the summary envelope (:func:`~headprobe.probe.core.io.summary_envelope`), with
        ``timings`` and the load's and the whole run's seconds."""
        return summary_envelope(
            body,
            model=self.spec.name,
            precision=self.spec.precision,
            backend=self.spec.backend,
            device=self.device,
            self_check=self.self_check,
            config=self.config,
            timings_s={"load_s": self.load_s, **timings, "total": self.run_s + (self.load_s or 0.0)},
        )

    def _run_fields(self) -> dict:
        """What summary.json says of the run whether it swept or estimated beyond the envelope:
        dtype, ablation kind, the token sets and the clean losses."""
        cfg = self.config
        return {
            "dtype": cfg.dtype,
            "ablation": cfg.kind,
            "tokens": {
                "natural": [cfg.n_natural, int(self.natural.tokens.shape[1])],
                "repeated": list(self.repeated.tokens.shape),
                "period": cfg.period,
                "natural_source": self.natural.source,
                **window_counts(self.natural),
                "natural_untrusted": self.natural_untrusted,
            },
            "clean_loss": {t: r.clean_loss for t, r in self.tasks.items()},
            # a pruned checkpoint's heads: not swept, null in every table and never ranked
            "removed_heads": sorted(format_head(h) for h in _removed(self.spec)),
        }

    def _estimate_summary(self) -> dict:
        """summary.json of an ``--estimate`` run: what was estimated, how, at what cost; no sweep."""
        cfg, spec, results = self.config, self.spec, self.tasks
        assert cfg.estimate is not None  # an --estimate run
        return self._envelope(
            {
                **self._run_fields(),
                "estimate": {
                    "method": cfg.estimate,
                    "description": ESTIMATE_LABELS[cfg.estimate],
                    "exact": False,
                    "signed": ESTIMATE_SIGNED[cfg.estimate],
                    "units": ESTIMATE_UNITS[cfg.estimate],
                    "forward_equivalents_per_task": forward_equivalents(cfg.estimate, spec.n_layers, cfg.n_probes),
                    **({"n_probes": cfg.n_probes} if cfg.estimate == "second-order" else {}),
                    "note": "a gradient estimate of each head's single-head ablation effect, not an exact "
                    "ablation; check the heads it ranks high with `headprobe ablate --heads`",
                },
                "top_heads_by_estimate": {
                    t: [
                        {"head": format_head(h), "estimate": round(float(r.estimate[h]), 5)}
                        for h in top_heads(torch.as_tensor(r.estimated), TOP_N)
                    ]
                    for t, r in results.items()
                },
                "top_induction_score_heads": [
                    format_head(h) for h in top_heads(torch.as_tensor(self.induction_score), TOP_N)
                ],
            },
            {f"{t}_estimate": r.gradient_s for t, r in results.items()},
        )

    def figures(self) -> dict[str, Figure]:
        """``{"ablation_effect": Figure, "importance_vs_exact": Figure}``: each head's loss change on both
        tasks, signed, and its gradient importance against it, from :attr:`table` (or, with
        ``--estimate``, ``{"ablation_estimate": Figure}``: the estimate, titled as one):
        :func:`ablation_figures`."""
        spec, estimate = self.spec, self.config.estimate
        maps = [self.tasks[t].estimated if estimate else self.tasks[t].effect for t in ("natural", "repeated")]
        return ablation_figures(
            maps,  # type: ignore[arg-type]
            f"{figs.model_tag(spec.name, spec.weights)}, {self.config.kind}-ablated",
            spec.group_size,
            figs.removed_cells(spec.n_layers, spec.n_heads, sorted(_removed(spec))),
            estimate,
            table=self.table,
            tokens=self._run_fields()["tokens"],
        )

    def html(self) -> str:
        """The viewer page (``headprobe view``'s index.html) of this sweep: loss-change maps (ablated − clean) and the table."""
        from headprobe.analyses.viewer import build_page

        return build_page(ablation=self.table, ablation_summary=self.summary())

    def _repr_html_(self) -> str:
        """Jupyter shows the viewer page, in a sandboxed iframe."""
        from headprobe.analyses.viewer import notebook_html

        return notebook_html(self.html())

    def outputs(self) -> dict[str, Any]:
        """save's files: head_ablation.csv, ablation_effect.<format> and importance_vs_exact.<format>
        (ablation_estimate.<format> alone with ``estimate``) for each of ``formats`` and, last, summary.json."""
        return dict(
            resumable=True,
            summary=self.summary,
            figures=self.figures,
            tables={"head_ablation.csv": self.table.to_csv(index=False, float_format="%.6f")},
        )

    @options.reports_for_readers("ablate")
    def report(self) -> str:
        """The terminal summary: clean losses, top heads per task, rank correlations, timings, notes."""
        s = self.summary()
        lines = self._estimate_lines(s) if self.config.estimate else self._sweep_lines(s)
        lines.append(
            "timings: "
            + ", ".join(f"{k.removesuffix('_s').replace('_', ' ')} {v:.1f} s" for k, v in s["timings_s"].items())
        )
        untrusted = self.natural_untrusted
        said = [untrusted_text_note(untrusted, "summary.json's tokens.natural_untrusted")] if untrusted else []
        return "\n".join([*lines, *(f"NOTE: {n}" for n in [*left_out_notes(self.natural), *said])])

    def _estimate_lines(self, s: dict) -> list[str]:
        """The report's lines of an estimate (``--estimate``): what it is, clean losses, top heads."""
        t = self.tasks
        lines = [
            f"ESTIMATE, not an exact ablation: {s['estimate']['description']} "
            f"(~{s['estimate']['forward_equivalents_per_task']:.0f} forward passes per task)",
            f"clean loss: natural {t['natural'].clean_loss:.3f}, repeated {t['repeated'].clean_loss:.3f} nats/token",
            *_removed_lines(s["removed_heads"]),
        ]
        for task in TASKS:
            tops = ", ".join(f"{e['head']} ({e['estimate']:+.3f})" for e in s["top_heads_by_estimate"][task][:5])
            lines.append(f"{task:<10} top heads by estimate: {tops}")
        return lines

    def _sweep_lines(self, s: dict) -> list[str]:
        """The report's lines of the exact sweep: clean losses, top heads and rank correlations per
        task, heads swept and resumed, the top induction-score heads."""
        t = self.tasks
        lines = [
            f"clean loss: natural {t['natural'].clean_loss:.3f}, repeated {t['repeated'].clean_loss:.3f} nats/token",
            *_removed_lines(s["removed_heads"]),
        ]
        for task in TASKS:
            tops = ", ".join(
                f"{e['head']} ({e['loss_delta']:+.3f} {figs.format_ci(e['ci95'], '+.3f')})"
                for e in s["top_heads_by_loss_delta"][task][:5]
            )
            rho = s["spearman_with_exact_sweep"][task]
            cis = s["spearman_with_exact_sweep_ci95"][task]
            r = {k: "n/a" if v is None else f"{v:.2f} {figs.format_ci(cis[k], '.2f')}" for k, v in rho.items()}
            reasons = dict.fromkeys(
                "undefined: one side is the same for every head (spearman_null_reasons in summary.json)"
                if why.startswith("undefined")
                else why
                for k, why in s["spearman_null_reasons"].items()
                if k.startswith(f"{task}.")
            )
            why = f" (n/a: {'; '.join(reasons)})" if reasons else ""
            lines.append(
                f"{task:<10} top heads by Δ loss [95% CI]: {tops}; Spearman with exact sweep: importance vs |Δ| "
                f"{r['gradient_importance_vs_abs_effect']} (layer-normalised, as prune ranks: "
                f"{r['layer_normalized_importance_vs_abs_effect']}; signed {r['gradient_importance']}), "
                f"attribution {r['attribution_patching']}{why}"
            )
        lines.append(  # two thresholds, each named with its quantity: rho's (here) and its interval's (the rule)
            f"(Spearman rho: reported where {MIN_RANKED_HEADS} or more heads are swept; its interval [lo, hi]: "
            f"{s['spearman_interval_rule']})"
        )
        resumed = sum(len(r.effect[np.isfinite(r.effect)]) for r in t.values()) - self.swept
        lines.append(
            f"head ablations (one per head and task): {self.swept} swept on {self.ranks} rank{'s' * (self.ranks > 1)}, "
            f"{resumed} resumed from a checkpoint"
        )
        lines.append(f"top induction-score heads: {', '.join(s['top_induction_score_heads'][:5])}")
        if worse := s.get("ablated_loss_above_uniform"):
            per = ", ".join(
                f"{task} {len(h)} head{'s' * (len(h) > 1)} (worst {h[0]['head']}: {h[0]['ablated_loss']:.2f})"
                for task, h in worse["heads"].items()
            )
            lines.append(
                f"NOTE: ablated loss above ln(vocabulary) = {worse['ln_d_vocab']:.2f} nats, worse than a uniform "
                f"guess over the {worse['d_vocab']} tokens: {per} (summary.json's ablated_loss_above_uniform)"
            )
        return lines


def _removed_lines(removed: list[str], show: int = 12) -> list[str]:
    """The report's line on a pruned checkpoint's removed heads (none without any): how many, the
    first ``show`` by name, and that they were not measured."""
    if not removed:
        return []
    names = ", ".join(removed[:show]) + (f", ... ({len(removed) - show} more)" if len(removed) > show else "")
    return [
        f"removed heads (pruned checkpoint): {len(removed)}, not measured: blank in head_ablation.csv, "
        f"grey in the figure, never ranked: {names}"
    ]


ESTIMATE_LABELS = {
    "atp": "AtP* (Kramár et al. 2024, arXiv 2403.00745): attribution patching with GradDrop, the magnitude "
    "averaged over dropped layers, signed by attribution patching",
    "attribution": "attribution patching (Nanda 2023): first-order estimate of the loss change",
    "gradient": "Michel et al. 2019 gradient importance I_h = E_x |dL(x)/dxi_h| (unsigned), unnormalised "
    "(normalize=false; prune --methods michel ranks by it l2-normalised per layer)",
    "second-order": "attribution patching plus half the Gauss-Newton curvature d^T G d, estimated with targets "
    "sampled from the model (LeCun et al. 1990; Martens & Grosse 2015)",
}
ESTIMATE_SIGNED = {"atp": True, "attribution": True, "gradient": False, "second-order": True}
"""Whether each ``--estimate`` can be negative by its definition: the signed ones estimate a loss
change (drawn on a diverging scale centred at 0); Michel et al.'s importance ``E|dL/dxi_h|`` is an
expected absolute value, >= 0 (drawn on a sequential scale from 0; summary.json's ``signed``)."""
ESTIMATE_UNITS = {
    "atp": "nats/token",
    "attribution": "nats/token",
    "gradient": "nats per unit of head mask",
    "second-order": "nats/token",
}
"""The units of each ``--estimate`` (summary.json's ``units``, and its colour bar's,
:func:`estimate_axis_label`): the signed ones estimate a loss change in nats/token; Michel et
al.'s importance ``E|dL/dxi_h|`` is a derivative of the loss (nats) by the head's mask ``xi_h``
(1 kept, 0 ablated)."""


def ablation_figures(
    maps: list[np.ndarray],
    tag: str,
    group_size: int,
    removed: np.ndarray,
    estimate: str | None,
    table: pd.DataFrame | None = None,
    tokens: dict | None = None,
) -> dict[str, Figure]:
    """ablate's figures: ``{"ablation_effect": Figure}``, the natural-text and repeated-tokens tasks'
    ``maps`` (``[layer, head]`` loss changes, nats/token; NaN: a removed head), signed, titled with
    ``tag`` (model, weights, ablation kind), and with ``table`` (head_ablation.csv's columns)
    ``"importance_vs_exact"`` (:func:`importance_figure`, its title naming ``tokens``' sizes, summary.json's
    ``tokens``); with ``estimate`` ``{"ablation_estimate": Figure}``, the
    maps that estimate (:data:`ESTIMATE_COLUMN`), titled as one (:func:`estimate_title`).
    ``removed``: ``[layer, head]`` booleans (:func:`~headprobe.analyses.figures.removed_cells`).
    What ``headprobe ablate`` draws, and what scripts/redraw_figures.py redraws from head_ablation.csv."""
    panels = list(zip(("natural text", "repeated tokens (repeated half)"), maps, strict=True))
    if estimate:
        fig = figs.ablation_effect_panels(
            panels,
            group_size,
            estimate_title(estimate, tag),
            cbar_label=estimate_axis_label(estimate),
            removed=removed,
            signed=ESTIMATE_SIGNED[estimate],
        )
        return {"ablation_estimate": fig}
    fig = figs.ablation_effect_panels(
        panels,
        group_size,
        f"Loss change from ablating one head\n{tag}",
        cbar_label=ABLATION_EFFECT_LABEL,
        removed=removed,
    )
    if table is None:
        return {"ablation_effect": fig}
    return {"ablation_effect": fig, "importance_vs_exact": importance_figure(table, tag, tokens)}


LABELLED_HEADS = 5
"""How many heads ``importance_vs_exact.png`` names in each panel: the largest exact loss increases."""


def _head_map(table: pd.DataFrame, column: str) -> np.ndarray:
    """``[layer, head]`` of ``table``'s ``column`` (head_ablation.csv's), NaN where blank or absent."""
    shape = (int(table["layer"].max()) + 1, int(table["head"].max()) + 1)
    out = np.full(shape, np.nan)
    out[table["layer"].to_numpy(dtype=int), table["head"].to_numpy(dtype=int)] = table[column].to_numpy(dtype=float)
    return out


def importance_figure(table: pd.DataFrame, tag: str, tokens: dict | None = None) -> Figure:
    """``importance_vs_exact``: per task each head's gradient importance ``I_h`` (unnormalised, the
    ``<task>_importance`` column) against its exact loss change (``<task>_loss_delta``), from
    head_ablation.csv's columns alone, the :data:`LABELLED_HEADS` largest changes named (the top of
    summary.json's ``top_heads_by_loss_delta``, :func:`~headprobe.analyses.ablation.top_heads`). Each
    panel's title gives Spearman's rho of ``I_h`` and ``|Δ|`` with its 95% interval from
    :func:`_rank_correlation`, what summary.json and the terminal report; the suptitle ``tag`` (model,
    weights, ablation kind) and, where ``tokens`` (summary.json's) has them, each task's sequences × tokens."""
    panels = []
    for task, name in (("natural", "natural text"), ("repeated", "repeated tokens (repeated half)")):
        effect, importance = _head_map(table, f"{task}_loss_delta"), _head_map(table, f"{task}_importance")
        rho, why, ci = _rank_correlation(importance, np.abs(effect), ("gradient importance", "|exact effect|"))
        n = int((np.isfinite(effect) & np.isfinite(importance)).sum())
        stat = f"{rho:.2f} {figs.format_ci(ci, '.2f')}" if rho is not None else "n/a"
        top = top_heads(torch.as_tensor(effect), LABELLED_HEADS) if n else []
        title = f"{name}\nSpearman ρ(I_h, |Δ|) = {stat}, {n} heads" + (f"\n({why})" if why else "")
        panels.append((title, effect, importance, top))
    sizes = ""
    if tokens and "natural" in tokens and "repeated" in tokens:
        (nn, nt), (rn, rt) = tokens["natural"], tokens["repeated"]
        sizes = f"; natural text {nn} × {nt}, repeated {rn} × {rt} (sequences × tokens)"
    return figs.importance_vs_effect(
        panels,
        f"Gradient importance (Michel et al. 2019) vs exact loss change of ablating one head\n{tag}{sizes}",
        f"exact {ABLATION_EFFECT_LABEL}",
        f"gradient importance\nI_h = E|dL/dξ_h|, unnormalised\n({ESTIMATE_UNITS['gradient']})",
    )


def estimate_axis_label(method: str) -> str:
    """The colour-bar label of ``ablation_estimate.png``: what ``method`` estimates and its units
    (:data:`ESTIMATE_UNITS`, as summary.json gives them)."""
    what = "estimated Δ loss" if ESTIMATE_SIGNED[method] else "importance ≥ 0"
    return f"{what} ({ESTIMATE_UNITS[method]})"


ESTIMATE_SHORT = {
    "atp": "AtP*: attribution patching with GradDrop",
    "attribution": "attribution patching, first order",
    "gradient": "gradient importance E|dL/dxi_h|, unsigned",
    "second-order": "second-order: attribution patching + Gauss-Newton term",
}
"""Figure-title names of each ``--estimate`` (short enough for a figure's width); the full
:data:`ESTIMATE_LABELS`, with sources, go to summary.json and the terminal report."""

ABLATION_EFFECT_LABEL = "Δ loss = ablated − clean (nats/token)"
"""ablation_effect.png's colour-bar label: the sign convention of a loss change (a head whose ablation
lowers the loss is blue, below 0), under a title that says "change", not "increase"."""


def estimate_title(method: str, tag: str) -> str:
    """The suptitle of ``ablation_estimate.png``: says ESTIMATE and the method's short name
    (:data:`ESTIMATE_SHORT`) on the first lines (at most 50 characters each), then ``tag`` (model, weights, ablation kind)."""
    import textwrap

    return (
        textwrap.fill(f"ESTIMATE ({ESTIMATE_SHORT[method]}), not an exact ablation", 50, break_on_hyphens=False)
        + f"\n{tag}"
    )


ESTIMATE_COLUMN = {
    "atp": "atp_star_estimate",
    "attribution": "attribution_estimate",
    "gradient": "importance_estimate",
    "second-order": "second_order_estimate",
}
"""head_ablation.csv column (after ``<task>_``) of each ``--estimate``: never ``loss_delta``, the exact effect."""
assert (
    set(ESTIMATE_LABELS)
    == set(ESTIMATE_SHORT)
    == set(ESTIMATE_COLUMN)
    == set(ESTIMATE_SIGNED)
    == set(ESTIMATE_UNITS)
    == set(ESTIMATES)
)


GRADIENT_METHODS = ("attribution", "gradient")
"""The ``--estimate`` methods of :func:`~headprobe.analyses.ablation.head_importance`, which takes its
batch in chunks that fit (:func:`gradient_chunk`); AtP* and second-order take theirs in one pass."""
GRADIENT_WORK = "the sweep's gradient scores"
"""How the memory plan names the exact sweep's gradient scores (header and refusal)."""


def _estimate(
    model: LoadedModel, method: str, tokens, first: int, kind: str, mean_z, source, heads, n_probes: int
) -> TaskResult:
    """One task's ``--estimate``: the estimator's ``[layer, head]`` values (NaN outside ``heads``)."""
    spec = model.spec
    t0 = time.perf_counter()
    if method == "second-order":
        est = second_order(model, tokens, first, kind=kind, mean_z=mean_z, source_tokens=source, n_probes=n_probes)
        values, clean = est.estimate, est.clean_loss
    elif method == "atp":
        star = atp_star(model, tokens, first, kind=kind, mean_z=mean_z, source_tokens=source)
        values, clean = star.signed, star.clean_loss
    else:
        chunk = gradient_chunk(model, method, tokens, kind)
        grad = head_importance(model, tokens, first, kind=kind, mean_z=mean_z, source_tokens=source, max_batch=chunk)
        values, clean = (grad.attribution if method == "attribution" else grad.importance), grad.clean_loss
    keep = torch.zeros(spec.n_layers, spec.n_heads, dtype=torch.bool)
    keep[tuple(torch.tensor(heads).T)] = True
    estimated = torch.where(keep, values.float(), torch.tensor(float("nan"))).numpy()
    nan = np.full((spec.n_layers, spec.n_heads), np.nan)
    return TaskResult(clean, nan, nan, nan, 0.0, time.perf_counter() - t0, estimated=estimated)


def gradient_chunk(model: LoadedModel, method: str, tokens: torch.Tensor, kind: str, work: str | None = None) -> int:
    """How many of ``tokens``' sequences (``[batch, pos]``) one forward and backward of a gradient method
    (``gradient``, ``attribution``: :func:`~headprobe.analyses.ablation.head_importance`) takes at once
    under the memory budget (:func:`~headprobe.analyses.ablation.importance_plan`, prune's too; ``work``
    names it, default ``ablate's <method> estimate``).

    Raises:
        HeadprobeError: not even one sequence fits (refused before the run by :func:`memory_plan`)."""
    batch, seq_len = tokens.shape
    return importance_plan(model, batch, seq_len, kind, work or f"ablate's {method} estimate").items


def _task_sets(model: LoadedModel, cfg: AblateConfig) -> tuple[TokenSet, TokenSet, dict, torch.Tensor | None]:
    """``(natural, repeated, sets, mean_z)``: the token sets, each task's ``(tokens, first scored,
    source tokens)`` (the source None unless the kind needs one: the natural task's is the other
    natural-text windows, the repeated task's other repeated sequences), and ``mean_z`` (over the
    other natural-text windows, where the kind needs it)."""
    data = cfg.task_tokens(model)
    natural, repeated = data.natural, data.repeated
    nat, nat_ref = natural.tokens[: cfg.n_natural], natural.tokens[cfg.n_natural :]
    needs = ablation_kinds.KINDS.get(cfg.kind).needs
    mean_z = mean_z_from(capture_z(model, nat_ref), natural.start) if needs == "mean_z" else None
    source = needs == "source"
    sets = {
        "natural": (nat, first_scored("natural", natural.start, None), nat_ref if source else None),
        "repeated": (
            repeated.tokens,
            first_scored("repeated", repeated.start, repeated.period),
            data.repeated_source.tokens if source else None,
        ),
    }
    return natural, repeated, sets, mean_z


def memory_plan(model: LoadedModel, config: AblateConfig) -> BatchPlan:
    """:func:`memory_plans`' first: the plan of the run's batches.

    Raises:
        HeadprobeError: as :func:`memory_plans`.
    """
    return memory_plans(model, config)[0]


def memory_plans(model: LoadedModel, config: AblateConfig) -> tuple[BatchPlan, BatchPlan | None]:
    """``(plan, gradient plan)``. ``plan``: the plan of the larger of the two tasks' batches (the
    larger per-sequence estimate): the exact sweep's (:func:`~headprobe.analyses.ablation.sweep_plan`; its gradient scores, taken in
    chunks of the task's sequences (:func:`gradient_chunk`), are checked to fit one sequence), or with
    ``estimate`` the largest step (:attr:`BatchPlan.total`) of the estimator's over each task's batch
    (:func:`~headprobe.analyses.attribution.estimate_plan`: whole for AtP* and second-order, in chunks
    for :data:`GRADIENT_METHODS`) and the forwards beside them
    (:func:`_forward_plans`, which the sweep checks too). The batches, either way: ``n_natural``
    windows of ``seq_len`` tokens, ``n_repeated`` sequences of ``2 period`` tokens and BOS where the
    model prepends one (``model.prepend_bos``, as the run's tokens). ``gradient plan`` (the exact
    sweep's only, None with ``estimate``): its gradient scores' of the task whose sequence needs more.

    Raises:
        HeadprobeError: one ablation of a task's sequences, an estimate of a task's batch (of one
            sequence for :data:`GRADIENT_METHODS`) or a forward beside them does not fit in the memory budget; lengths that cannot run
            (``config.resolved``); before all of these, a head out of range (:func:`swept_heads`).
    """
    swept_heads(model, config)  # a head out of range is refused first, before any plan, data or forward
    config = config.resolved(model.spec, model.trained_periods)  # refuses lengths that cannot run, before a plan
    assert config.period is not None and config.seq_len is not None  # set by resolved
    # the repeated task's sequences: two blocks of period tokens after BOS where the model prepends one
    shapes = [(config.n_natural, config.seq_len), (config.n_repeated, 2 * config.period + int(model.prepend_bos))]
    if config.estimate:
        method, n_probes = config.estimate, config.n_probes
        split = method in GRADIENT_METHODS
        plans = [estimate_plan(model, method, b, t, n_probes, config.kind, split=split) for b, t in shapes]
        return max([*plans, *_forward_plans(model, config)], key=lambda p: p.total), None
    # the sweep's gradient scores: forwards and backwards of as many sequences as fit
    gradients = [importance_plan(model, b, t, config.kind, GRADIENT_WORK) for b, t in shapes]
    _forward_plans(model, config)  # refused where they do not fit, as the gradient scores
    plans = [sweep_plan(model, b, t, model.spec.n_layers, config.max_batch) for b, t in shapes]
    return max(plans, key=lambda p: p.per_item), max(gradients, key=lambda p: p.per_item)


def _forward_plans(model: LoadedModel, config: AblateConfig) -> list[BatchPlan]:
    """The plans of the inference forwards that run beside the sweep or the estimates, each over its
    whole batch (``config`` resolved): the induction score over the repeated task's ``n_repeated``
    sequences (:func:`~headprobe.analyses.scoring.score_plan`) and, for a kind that ablates with the
    mean ``z``, its capture over the other ``n_natural`` natural-text windows
    (:func:`~headprobe.analyses.ablation.capture_z_plan`). Each is one forward over a batch of the
    shape an estimate (or the sweep's gradient scores) runs forward and backward, so it never needs
    more than that step: planned so that every step of a run is, not because it raises the need.

    Raises:
        HeadprobeError: one of them does not fit in the memory budget.
    """
    assert config.period is not None and config.seq_len is not None  # set by resolved
    start = int(model.prepend_bos)
    first = first_scored("repeated", start, config.period)
    plans = [score_plan(model, config.n_repeated, start + 2 * config.period, first, "ablate's induction score")]
    if ablation_kinds.KINDS.get(config.kind).needs == "mean_z":
        plans.append(capture_z_plan(model, config.n_natural, config.seq_len, "ablate's mean z capture"))
    return plans


def batch_line(model: LoadedModel, config: AblateConfig) -> str:
    """The header lines of :func:`memory_plan` and, for the exact sweep, of its gradient scores (the
    task whose sequence needs more; at 8B and 1,024 tokens the plan that binds, said only in a
    refusal before).

    Raises:
        HeadprobeError: as :func:`memory_plans`.
    """
    plan, gradient = memory_plans(model, config)
    return plan.line() if gradient is None else f"{plan.line()}\n{gradient.line()}"


def _sweep_task(
    model: LoadedModel, cfg: AblateConfig, task: str, task_set: tuple, heads, mean_z, done: dict, save, progress: bool
) -> TaskResult:
    """One task's exact sweep (:func:`checkpointed_sweep`, resuming from ``done``) and gradient scores;
    ``task_set`` is the task's ``(tokens, first scored, source tokens)``."""
    tokens, first, src = task_set
    t0 = time.perf_counter()
    sweep = checkpointed_sweep(
        model,
        tokens,
        heads,
        cfg.kind,
        mean_z,
        src,
        first,
        cfg.max_batch,
        done,
        save,
        desc=f"ablation sweep ({task})",
        progress=progress,
    )
    t1 = time.perf_counter()
    effect_ci = _effect_ci(model, task, sweep)
    chunk = min(gradient_chunk(model, "gradient", tokens, cfg.kind, GRADIENT_WORK), cfg.max_batch or len(tokens))
    grad = head_importance(model, tokens, first, kind=cfg.kind, mean_z=mean_z, source_tokens=src, max_batch=chunk)
    t2 = time.perf_counter()
    return TaskResult(
        sweep.clean_loss,
        sweep.effect.numpy(),
        grad.importance.numpy(),
        grad.attribution.numpy(),
        t1 - t0,
        t2 - t1,
        effect_ci=effect_ci,
    )


def _effect_ci(model: LoadedModel, task: str, sweep: SweepResult) -> np.ndarray:
    """``[2, layer, head]``: the 95% Student-t interval of each swept head's loss increase over the
    task's sequences (:func:`~headprobe.analyses.statistics.mean_ci` of ``per_sequence -
    clean_per_sequence``), after checking the identity that makes it the effect's interval: the mean of
    each head's per-sequence increases equals its effect ``loss - clean_loss``, within
    :func:`~headprobe.analyses.circuit.baseline_tolerance` (1e-4 nats in float32).

    Raises:
        HeadprobeError: the identity fails (e.g. a checkpoint whose per-sequence losses are not its means').
    """
    from headprobe.analyses.circuit import baseline_tolerance
    from headprobe.analyses.statistics import mean_ci

    assert sweep.per_sequence is not None and sweep.clean_per_sequence is not None  # checkpointed_sweep keeps them
    deltas = (sweep.per_sequence.double() - sweep.clean_per_sequence.double()).permute(2, 0, 1).numpy()
    effect = sweep.effect.double().numpy()
    tol, rule = baseline_tolerance(model, float(sweep.clean_loss))
    gap = np.abs(deltas.mean(axis=0) - effect)
    bad = np.isfinite(effect) & ~(gap <= tol)  # a NaN mean (a head without per-sequence losses) fails too
    if bad.any():
        layer, head = map(int, np.argwhere(bad)[0])
        raise HeadprobeError(
            f"{task} task: head {layer}.{head}'s per-sequence loss increases average to "
            f"{deltas[:, layer, head].mean():+.6f} nats/token, its effect is {effect[layer, head]:+.6f} "
            f"(tolerance {rule}): the interval would not be the effect's; rerun with --overwrite"
        )
    return mean_ci(deltas)


def _induction_score(model: LoadedModel, repeated: TokenSet) -> np.ndarray:
    """Prefix-matching (induction) score of every head, to check the repeated task's ranking against
    (score_tokens: streamed on long sequences, losses in position chunks: no pattern or logits of the
    whole sequence)."""
    return score_tokens(
        model, repeated, "repeated", first_scored("repeated", repeated.start, repeated.period), types=("induction",)
    )[0]["induction"].numpy()


def run(
    model: LoadedModel,
    config: AblateConfig,
    *,
    resume: dict | None = None,
    on_save: Callable[[dict], None] | None = None,
    progress: bool = True,
) -> AblateResult:
    """Sweep every head (or ``config.heads``) on both tasks, with gradient importance and
    attribution patching beside the exact effects (see the module docstring); with
    ``config.estimate``, no sweep: the estimate of every head's effect instead (:func:`_estimate`).

    Args:
        model: a :class:`~headprobe.probe.backends.loading.LoadedModel`, used as given.
        config: the settings.
        resume: a state saved by an interrupted run with the same config (``on_save``'s argument);
            its finished chunks are not recomputed. Updated in place.
        on_save: called with the whole state after every finished chunk (e.g. :meth:`RunCheckpoint.save`).
        progress: show progress bars.

    Under ``torchrun`` (a process group set up by :func:`headprobe.analyses.distributed.init_from_env`)
    every rank calls this with the same ``resume``: the sweep's heads are sharded over the ranks
    (:func:`checkpointed_sweep`), the gradient scores are data-parallel over the batch
    (:func:`~headprobe.analyses.ablation.head_importance`), and every rank returns the whole result.

    Raises:
        HeadprobeError: an encoder, the model's self-check forbids head ablation, a head out of
            range, sequences longer than the context, too little text, an estimate that does not fit in
            the memory budget (:func:`memory_plan`).
    """
    t_start = time.perf_counter()
    saved = {} if resume is None else resume
    if "induction" in saved:  # a checkpoint written when the repeated task was called "induction"
        saved.setdefault("repeated", saved.pop("induction"))
    save = (lambda: on_save(saved)) if on_save is not None else (lambda: None)
    spec = model.spec
    options.require_causal(spec, NEEDS_CAUSAL, options.ENCODER_HINT)
    heads = swept_heads(model, config)  # before the self-check's forward and the token sets
    model.self_check.require_decomposition("head ablation (ablate, prune)")
    if config.estimate:
        memory_plan(model, config)  # refuses an estimate that cannot fit, before any allocation
    cfg = config.resolved(spec, model.trained_periods)  # the lengths it runs with and summary.json records
    natural, repeated, sets, mean_z = _task_sets(model, cfg)
    results: dict[str, TaskResult] = {}
    swept = 0
    for task, (tokens, first, src) in sets.items():
        if cfg.estimate:
            results[task] = _estimate(model, cfg.estimate, tokens, first, cfg.kind, mean_z, src, heads, cfg.n_probes)
            continue
        done = saved.setdefault(task, {"clean": None, "loss": {}})
        swept += sum(format_head(h) not in done.get("seq", {}) for h in heads)
        results[task] = _sweep_task(model, cfg, task, (tokens, first, src), heads, mean_z, done, save, progress)

    induction_score = _induction_score(model, repeated)
    results, induction_score = _blank_removed(spec, results, induction_score)
    table = _head_table(spec, results, induction_score, cfg.estimate)
    # an --estimate run swept nothing (swept stays 0) and reports the default one rank
    return AblateResult(
        cfg,
        spec,
        table,
        results,
        induction_score,
        natural,
        repeated,
        str(model.device),
        model.self_check.to_dict(),
        time.perf_counter() - t_start,
        swept=swept,
        ranks=1 if cfg.estimate else distributed.world_size(),
        natural_untrusted=unknown_text_reason(model, natural),
    )


def swept_heads(model: LoadedModel, config: AblateConfig) -> list:
    """The heads ``config`` asks to sweep in ``model`` (:meth:`AblateConfig.head_list`, the check
    the command line's ``preflight`` makes against the model's config.json, here against the
    loaded ``model.spec``; a pruned checkpoint's removed heads left out, :func:`_present`). Reads
    the layout only: no data, no forward, so :func:`memory_plan` and :func:`run` call it first.

    Raises:
        HeadprobeError: a head out of range or in a layer without heads (one line naming the
            model's layout); every head asked for removed in a pruned checkpoint.
    """
    spec = model.spec
    return _present(config.head_list(spec.n_layers, spec.n_heads, spec.layout.head_layers), spec)


def _removed(spec: ModelSpec) -> set[tuple[int, int]]:
    """The heads a pruned checkpoint no longer has (``spec.removed_heads``; loaded with zero weights)."""
    return set(spec.removed_heads)


def _present(heads: list, spec: ModelSpec) -> list:
    """``heads`` without a pruned checkpoint's removed heads (:func:`_removed`): a removed head has no
    effect to measure, only the 0 of its zero weights.

    Raises:
        HeadprobeError: every head asked for is removed.
    """
    removed = _removed(spec)
    kept = [h for h in heads if tuple(h) not in removed]
    if heads and not kept:
        raise HeadprobeError(
            f"every head asked for is removed in the pruned checkpoint {spec.name}: "
            f"{','.join(format_head(h) for h in heads)}"
        )
    return kept


def _blank_removed(
    spec: ModelSpec, results: dict[str, TaskResult], induction_score: np.ndarray
) -> tuple[dict[str, TaskResult], np.ndarray]:
    """``results`` and ``induction_score`` with a pruned checkpoint's removed heads (:func:`_removed`)
    NaN in every ``[layer, head]`` array, so that no ranking, correlation or summary counts them."""
    removed = _removed(spec)
    if not removed:
        return results, induction_score
    idx = tuple(np.array(sorted(removed)).T)

    def blank(a: np.ndarray) -> np.ndarray:
        a = np.array(a, dtype=float)
        a[idx] = np.nan
        return a

    out = {
        t: dataclasses.replace(
            r,
            effect=blank(r.effect),
            importance=blank(r.importance),
            attribution=blank(r.attribution),
            estimated=None if r.estimated is None else blank(r.estimated),
            effect_ci=None if r.effect_ci is None else np.stack([blank(b) for b in r.effect_ci]),
        )
        for t, r in results.items()
    }
    return out, blank(induction_score)


def _head_table(
    spec: ModelSpec, results: dict[str, TaskResult], induction_score: np.ndarray, estimate: str | None
) -> pd.DataFrame:
    """head_ablation.csv: one row per head (``layer``, ``head``, ``kv_head``), then each task's
    ``<task>_loss_delta``, each task's ``<task>_importance`` and ``<task>_attribution`` (nats/token)
    and the ``induction_score``; with ``estimate``, the same rows with one column per task named as
    that estimate (:data:`ESTIMATE_COLUMN`) instead of the exact effects. A pruned model's removed
    heads are marked (:func:`_mark_removed`)."""
    layer, head = np.meshgrid(np.arange(spec.n_layers), np.arange(spec.n_heads), indexing="ij")
    cols = {
        "layer": layer.ravel(),
        "head": head.ravel(),
        "kv_head": kv_head_of(head.ravel(), spec.n_heads, spec.n_kv_heads),
    }
    if estimate:
        for task, r in results.items():
            cols[f"{task}_{ESTIMATE_COLUMN[estimate]}"] = r.estimate.ravel()
    else:
        for task, r in results.items():
            cols[f"{task}_loss_delta"] = r.effect.ravel()
        for task, r in results.items():
            ci = r.effect_ci if r.effect_ci is not None else np.full((2, *r.effect.shape), np.nan)
            cols[f"{task}_loss_delta_ci95_low"], cols[f"{task}_loss_delta_ci95_high"] = ci[0].ravel(), ci[1].ravel()
        for task, r in results.items():
            cols[f"{task}_importance"] = r.importance.ravel()
            cols[f"{task}_attribution"] = r.attribution.ravel()
    cols["induction_score"] = induction_score.ravel()
    return _mark_removed(pd.DataFrame(cols), spec)


def _mark_removed(table: pd.DataFrame, spec) -> pd.DataFrame:
    """A pruned model's removed heads (``spec.removed_heads``): a ``removed`` column, and their
    numbers blanked (an effect of exactly 0 is the removal, not a measurement)."""
    removed = set(getattr(spec, "removed_heads", ()) or ())
    if not removed:
        return table
    mask = np.array([(int(l), int(h)) in removed for l, h in zip(table["layer"], table["head"])])
    values = [c for c in table.columns if c not in ("layer", "head", "kv_head")]
    table[values] = table[values].astype(float)
    table.loc[mask, values] = np.nan
    table["removed"] = mask
    return table


ablate = options.command_function(
    AblateConfig,
    run,
    "ablate",
    "Every head's single-head ablation effect (no checkpoint)",
    '``kind="mean"``, ``heads="5.1,7.3"``',
)
"""``headprobe ablate`` as a function: :func:`headprobe.options.command_function` over :func:`run`."""
