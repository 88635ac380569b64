"""The run of ``headprobe kv`` (torch): :func:`run`, the result and the Python function
:func:`kv`. The command, its settings (:class:`~headprobe.commands.kv.KVConfig`) and its flags are
:mod:`headprobe.commands.kv`, which imports none of this."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from headprobe import options
from headprobe.analyses.outputs import WritesOutputs
from headprobe.analyses.vocabulary import KV_TABLE_DIGITS
from headprobe.commands.kv import HELP, KVConfig, check_context  # noqa: F401 - the light module's names, re-exported
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.core.io import summary_envelope, write_json
from headprobe.probe.core.reprs import CompactRepr, load_seconds

if TYPE_CHECKING:
    import pandas as pd

    from headprobe.analyses.kvpolicy import GroupCosts, Quality
    from headprobe.probe.backends.base import LoadedModel
    from headprobe.probe.core.memory import BatchPlan
    from headprobe.probe.layout.attention import AttentionLayout, KVPolicy, Streaming
    from headprobe.probe.layout.cost import PolicyCost
    from headprobe.probe.layout.spec import ModelSpec


@dataclass(repr=False)
class KVResult(CompactRepr, WritesOutputs):
    """A finished ``headprobe kv`` run.

    Attributes:
        config: the settings.
        spec: the model's spec.
        layout: its attention layout (bytes per element of its dtype).
        policy: the chosen :class:`~headprobe.probe.layout.attention.KVPolicy`.
        policy_cost: :func:`~headprobe.probe.layout.cost.policy_cost` of the policy at ``seq_len``.
        costs: :class:`~headprobe.analyses.kvpolicy.GroupCosts`.
        full: :class:`Quality` of the full cache.
        chosen: :class:`Quality` of the policy.
        comparison: the rows of ``curve`` at the written policy's memory (dicts: summary.json's).
        curve: curve.csv as a DataFrame: one row per measured policy
            (:func:`~headprobe.analyses.kvpolicy.curve_row`'s columns, losses in nats/token, and
            ``target``: ``full``, ``kv_budget``, ``budgets`` or ``loss_tolerance``; with
            ``--loss-tolerance`` also ``within_tolerance``, each row's flag of
            :func:`~headprobe.analyses.kvpolicy.tolerance_check`: True, None (an empty cell) or False).
        cache_check: the native model's allocated StreamingKVCache bytes against the formula, and
            (``loss``) the chosen policy's natural-text loss against the backend's own scoring.
        candidates: the groups whose streaming changes attention
            (:func:`~headprobe.analyses.kvpolicy.streaming_candidates`); the others, on sliding layers
            no wider than the window, are full (their window) in every policy.
        sources: where the token sets came from.
        windows: per token set (``natural``, ``long_range``), its natural-text windows
            (:func:`~headprobe.analyses.data.window_counts`: available, left out as mostly one token).
        untrusted: why the natural-text losses cannot rank policies (the full cache predicts the
            text no better than a uniform guess, or the tokenizer mostly does not know it:
            :func:`~headprobe.analyses.ablation.untrusted_task_reason`), or None.
        seconds: the run's.
        device: where the model ran.
        self_check: the model's load-time self-check.
        load_s: seconds loading the model where kv loaded it; None where the caller passed a model it loaded (:func:`~headprobe.probe.core.reprs.load_seconds`).
    """

    config: KVConfig
    spec: ModelSpec
    layout: AttentionLayout
    policy: KVPolicy
    policy_cost: PolicyCost
    costs: GroupCosts
    full: Quality
    chosen: Quality
    comparison: list[dict]
    curve: pd.DataFrame
    cache_check: dict
    sources: dict = field(default_factory=dict)
    windows: dict = field(default_factory=dict)
    untrusted: str | None = None
    seconds: float = 0.0
    device: str | None = None
    self_check: dict | None = None
    load_s: float | None = load_seconds()
    candidates: list | None = None

    def _excluded(self) -> list[tuple[int, int]]:
        """Groups of sliding layers whose window is no wider than ``--window``: left as the model has them."""
        keep = set(self.candidates) if self.candidates is not None else None
        return (
            []
            if keep is None
            else [
                (layer, g)
                for layer in range(self.policy.n_layers)
                for g in range(self.policy.n_kv_groups)
                if (layer, g) not in keep
            ]
        )

    def group_table(self):
        """group_costs.csv: one row per (layer, kv_group) with its costs and whether it stays full."""
        import pandas as pd

        c, full, out = self.costs, set(self.policy.full_groups), set(self._excluded())
        L, G = c.natural.shape
        return pd.DataFrame(
            [
                {
                    "layer": layer,
                    "kv_group": g,
                    "natural_cost": float(c.natural[layer, g]),
                    "long_range_cost": float(c.long_range[layer, g]),
                    "score": float(c.score[layer, g]),
                    **({"copy_accuracy_drop": float(c.accuracy_drop[layer, g])} if c.accuracy_drop is not None else {}),
                    "full_cache": (layer, g) in full,
                    **({"candidate": (layer, g) not in out} if self.layout.windows is not None else {}),
                }
                for layer in range(L)
                for g in range(G)
            ]
        )

    def summary(self) -> dict:
        """summary.json: the policy, its bytes, its quality against full, uniform and random; with
        ``--loss-tolerance`` the target says whether the chosen policy meets it beyond its 95% interval
        (:func:`~headprobe.analyses.kvpolicy.tolerance_check`)."""
        from headprobe.analyses.kvpolicy import tolerance_check

        by = {r["policy"]: r for r in self.comparison if r["policy"] != "random"}
        rnd = [r for r in self.comparison if r["policy"] == "random"]
        c = self.config
        excluded = set(self._excluded())
        return summary_envelope(
            {
                "hf_name": self.spec.hf_name,
                "n_layers": self.policy.n_layers,
                "n_kv_groups": self.policy.n_kv_groups,
                "unit": "latent (MLA: one per layer)" if self.layout.is_mla else "kv_head",
                "seq_len": c.seq_len,
                "sink": c.sink,
                "window": c.window,
                "method": self.costs.method,
                "target": {"kv_budget": c.kv_budget}
                if c.loss_tolerance is None
                else tolerance_check(by["chosen"], c.loss_tolerance),
                "full_groups": [f"{layer}.{g}" for layer, g in self.policy.full_groups if (layer, g) not in excluded],
                **self._sliding(),
                "kv_bytes": self.policy_cost.kv_bytes,
                "kv_bytes_full": self.policy_cost.kv_bytes_full,
                "kv_fraction": self.policy_cost.kv_fraction,
                **element_size(c.dtype, self.layout.bytes_per_element),
                "cache_check": self.cache_check,
                "full": {**self.full.to_dict(), "copy_accuracy_ci95": self._full_copy_ci()},
                "chosen": by["chosen"],
                "uniform": by["uniform"],
                "random": {
                    "rows": rnd,
                    "natural_loss_increase_mean": _mean(r["natural_loss_increase"] for r in rnd),
                    "copy_accuracy_mean": _mean(r["copy_accuracy"] for r in rnd),
                },
                "beats_uniform": _beats(by["chosen"], [by["uniform"]], "uniform"),
                "beats_random": _beats(by["chosen"], rnd, "random_mean"),
                "chosen_minus_uniform": _difference(by["chosen"], [by["uniform"]], "uniform"),
                "chosen_minus_random_mean": _difference(by["chosen"], rnd, "random_mean"),
                **({"interval_null_reasons": why} if (why := self._interval_null_reasons()) else {}),
                "sources": self.sources,
                "natural_text_sample": self._natural_counts(),
                "windows": self.windows,
                "natural_text_untrusted": self.untrusted,
                "definitions": {
                    "natural_loss": "mean next-token loss on natural text, nats/token",
                    "long_range": "a random block planted early and repeated at the end; loss and top-1 accuracy "
                    "on its tokens 2..block_len",
                    "streaming": "a KV group's query heads read only "
                    "the first sink and the last window keys; exact, the attention masked per group; "
                    "the window slides for every query, prompt included (kvpress's StreamingLLM "
                    "press instead prunes the cache once after a full-attention prefill)",
                    "uniform": "every group streaming with one window W' at the same KV memory: the widest whose "
                    "cache is at most the chosen policy's (uniform_window, tokens)",
                    "random": "as many groups full as the chosen policy, drawn at random",
                    "beats": "beats_uniform / beats_random: the chosen policy's natural loss increase no higher "
                    "and copy accuracy no lower than the other's (the random rows' mean), compared at the "
                    f"report's digits ({' and '.join(map(str, TABLE_DIGITS.values()))} decimals), as its words; "
                    "false where the chosen policy is worse on one quantity beyond its 95% interval (chosen_minus_*); "
                    "else null where a difference at those digits has an interval that covers 0 "
                    "or none: not distinguishable at this sample size",
                    "intervals": self._interval_rules(),
                },
            },
            model=self.spec.name,
            precision=self.spec.precision,
            backend=self.spec.backend,
            device=self.device,
            self_check=self.self_check,
            config=c,
            timings_s={"load_s": self.load_s, "run_s": self.seconds},
        )

    def _natural_counts(self) -> dict | None:
        """summary.json's ``natural_text_sample``: ``windows`` of natural text x ``tokens_each`` scored
        tokens (the per-token losses' shape); None without per-token losses."""
        nat = self.full.natural_token_loss
        return None if nat is None else {"windows": int(nat.shape[0]), "tokens_each": int(nat.shape[1])}

    def _interval_rules(self) -> dict:
        """summary.json's ``definitions.intervals``: how each 95% interval is made, on this run's counts."""
        from headprobe.analyses.statistics import block_bootstrap_rule, equal_units_rule, interval_rule

        nat, hits = self.full.natural_token_loss, self.full.copy_hits
        return {
            "columns": "*_ci95_lo / *_ci95_hi: the 95% interval of the quantity before it; every interval but "
            "per_distance's is of a paired difference (the same tokens under both policies, from the evaluations "
            "that give the numbers: no further forward pass); natural_loss_increase and copy_accuracy_drop are "
            "the policy against the full cache, chosen_minus_* the chosen policy's natural loss and copy accuracy "
            "minus the control's",
            "natural_loss": "unavailable (no per-token losses)"
            if nat is None
            else block_bootstrap_rule(nat.shape[1], nat.shape[0]) + "; " + natural_unit_rule(nat.shape[0]),
            "copy_accuracy": "unavailable (no per-token hits)"
            if hits is None
            else interval_rule("long-range sequences") + f" ({hits.shape[0]} here, {hits.shape[1]} copied tokens "
            "each; a sequence's copied tokens come from one planted block and succeed or fail together, so the "
            "sequence is the unit), clipped to [-1, 1]; "
            + equal_units_rule("long-range sequences")
            + "; [0, 0] exactly on a row whose policy caches every position the full cache does (the same "
            "computation)",
            "per_distance": "unavailable (no per-token hits)"
            if hits is None
            else "full.per_distance: each distance's loss (nats/token) and copy accuracy (0..1), not a difference: "
            + interval_rule("long-range sequences of the distance")
            + f" ({self.config.n_per_distance} per distance here, {hits.shape[1]} copied tokens each; each "
            "sequence's mean over its copied tokens is the unit, a cluster: a binomial interval over the tokens "
            "would be too narrow); the accuracy clipped to [0, 1], the loss to [0, inf); for the accuracy "
            + equal_units_rule("sequences of the distance"),
            "random_mean": "the chosen policy minus the random policies' mean, token by token: given these "
            f"{self.config.n_random} draws (the spread over draws is the random rows' range, not in the interval)",
        }

    def _full_copy_ci(self) -> list[float] | None:
        """summary.json's ``full.copy_accuracy_ci95``: the full cache's copy accuracy's 95% interval over the
        long-range sequences (each sequence's accuracy the unit, as ``definitions.intervals.copy_accuracy``;
        not a difference, so clipped to [0, 1]); None (JSON null) from fewer than 2 sequences."""
        from headprobe.analyses.statistics import MIN_N_FOR_CI, bounded_mean_ci

        hits = self.full.copy_hits
        if hits is None or hits.shape[0] < MIN_N_FOR_CI:
            return None
        return [float(x) for x in bounded_mean_ci(hits.double().mean(1).numpy(), 0.0, 1.0)]

    def _interval_null_reasons(self) -> dict[str, str]:
        """Why the natural-loss or copy-accuracy intervals are null (summary.json's
        ``interval_null_reasons``, absent where every interval exists)."""
        from headprobe.analyses.statistics import MIN_BLOCKS, block_length, n_blocks, no_interval_reason

        nat, hits, out = self.full.natural_token_loss, self.full.copy_hits, {}
        if nat is None:
            out["natural_loss"] = "undefined: no per-token losses (a result built from numbers alone)"
        elif (blocks := n_blocks(nat.shape[1], nat.shape[0])) < MIN_BLOCKS:
            out["natural_loss"] = (
                f"undefined: the block bootstrap needs at least {MIN_BLOCKS} blocks; {nat.numel()} tokens in "
                f"blocks of {block_length(nat.shape[1])} make {blocks} (raise --seq-len or --n-natural)"
            )
        if hits is None:
            out["copy_accuracy"] = "undefined: no per-token hits (a result built from numbers alone)"
        elif why := no_interval_reason(hits.shape[0], "long-range sequences"):
            out["copy_accuracy"] = f"{why} (raise --n-per-distance or give more --distances)"
        if hits is not None and (why := no_interval_reason(self.config.n_per_distance, "long-range sequences")):
            out["per_distance"] = f"{why} per distance (raise --n-per-distance)"
        return out

    def _interval_line(self) -> str:
        """The report's line on how the intervals were made (summary.json's ``definitions.intervals`` in full)."""
        from headprobe.analyses.statistics import MIN_BLOCKS, MIN_N_FOR_CI, block_length, bounded_mean_ci, n_blocks

        nat, hits = self.full.natural_token_loss, self.full.copy_hits
        if nat is None or hits is None:
            return "(no intervals: the full cache's Quality has no per-token values)"
        b, blocks = block_length(nat.shape[1]), n_blocks(nat.shape[1], nat.shape[0])
        few = f", fewer than {MIN_BLOCKS}: no interval" if blocks < MIN_BLOCKS else ""
        one = f", fewer than {MIN_N_FOR_CI}: no interval" if hits.shape[0] < MIN_N_FOR_CI else ""
        b0 = bounded_mean_ci([0.0] * hits.shape[0], -1.0, 1.0)[1]  # all differences 0
        eq = (
            ""
            if one
            else ", or where all differ by the same d by an exact bound (d 0: "
            f"[-{b0:.3f}, +{b0:.3f}]; [0, 0] where a policy caches every position)"
        )
        return (
            f"(95% CI of paired differences, same tokens under both policies: natural loss by a block bootstrap "
            f"over its {nat.numel()} tokens, {blocks} blocks of {b}{few}; copy accuracy by Student t over its "
            f"{hits.shape[0]} long-range sequence(s){one}, whose copied tokens succeed or fail together{eq}; "
            f"random (mean): given these {self.config.n_random} draws; summary.json's definitions.intervals)"
        )

    def _sliding(self) -> dict:
        """summary.json's ``sliding_window_layers`` where the model has them (else nothing)."""
        if self.layout.windows is None:
            return {}
        out = self._excluded()
        return {
            "sliding_window_layers": {
                "windows": list(self.layout.windows),
                "n_candidates": self.policy.n_layers * self.policy.n_kv_groups - len(out),
                "excluded_groups": [f"{layer}.{g}" for layer, g in out],
                "rule": "a streaming group of a sliding layer reads the intersection of the layer's window and sink + window, "
                "and caches what that leaves; groups of layers whose window is <= --window would be unchanged, so "
                "they are full (their window) in every policy and not drawn by the random controls, which keep "
                "as many full groups of each saving as the chosen policy (the same bytes)",
            }
        }

    @options.reports_for_readers("kv")
    def report(self) -> str:
        s = self.summary()
        n_groups = s["n_layers"] * s["n_kv_groups"]
        excluded = len(s.get("sliding_window_layers", {}).get("excluded_groups", []))
        lines = [
            f"policy: {len(s['full_groups'])} of {n_groups - excluded} candidate KV groups full, the rest "
            f"sink {s['sink']} + window {s['window']} ({excluded} groups of sliding layers no wider than the window as the model "
            f"has them); KV cache {s['kv_fraction']:.3f} of full at {s['seq_len']} tokens"
            if excluded
            else f"policy: {len(s['full_groups'])} of {n_groups} KV groups full, the rest "
            f"sink {s['sink']} + window {s['window']}; KV cache {s['kv_fraction']:.3f} of full at {s['seq_len']} tokens",
            *([_tolerance_line(s["target"])] if "loss_tolerance" in s["target"] else []),
            _bytes_line(s),
            _table_header(),
            _table_row("full", {**s["full"], "natural_loss_increase": 0.0}, interval=False),
        ]
        lines += [_table_row(name, s[name]) for name in ("chosen", "uniform")]
        lines += [_table_row(f"random {r['seed']}", r) for r in s["random"]["rows"]]
        others = {"uniform": [s["uniform"]], "random (mean)": s["random"]["rows"]}
        lines.append(
            f"chosen ({s['method']} ranking) against "
            + "; against ".join(
                f"{name}: {_comparison(s['chosen'], rows, control, name)}"
                for (name, rows), control in zip(others.items(), ("uniform", "random_mean"), strict=True)
            )
        )
        lines.append(self._interval_line())
        c = s["config"]
        n = len(c["distances"]) * c["n_per_distance"] * (c["block_len"] - 1)
        lines.append(
            f"(copy accuracy: top-1 over the {n} copied tokens, {len(c['distances'])} distances x "
            f"{c['n_per_distance']} x tokens 2..{c['block_len']} of the block: one token is {1 / n:.3f})"
        )
        from headprobe.analyses.data import left_out_notes_of

        notes = left_out_notes_of(self.windows)
        if self.full.natural_token_loss is not None and self.full.natural_token_loss.shape[0] == 1:
            notes.append(ONE_WINDOW_NOTE)
        notes += sink_notes(c["seq_len"], c["block_len"], c["sink"], c["distances"])
        if self.untrusted:
            notes.append(
                f"the natural-text losses cannot rank these policies: {self.untrusted} (summary.json's "
                "natural_text_untrusted); read the long-range columns, or give a text the model knows (--text)"
            )
        return "\n".join([*lines, *(f"NOTE: {note}" for note in notes)])

    def outputs(self) -> dict[str, Any]:
        """save's files: policy.json, policy_budget.json, group_costs.csv, curve.csv, the figure and,
        last, summary.json."""

        def policy_files(out: Path) -> list[Path]:
            from headprobe.analyses.exchange import MEASURED_SEQ_LEN

            # the length its quality was measured at: budget --policy at another length says so
            write_json(out / "policy.json", {**self.policy.to_dict(), MEASURED_SEQ_LEN: self.config.seq_len})
            write_json(
                out / "policy_budget.json",
                {
                    "layout": self.layout.to_dict(),
                    **self.policy_cost.to_dict(),
                    "command": f"headprobe budget --model {self.spec.name} --seq-len "
                    f"{self.config.seq_len} --dtype {self.config.dtype} --policy policy.json",
                },
            )
            return [out / "policy.json", out / "policy_budget.json"]

        def curve():
            return curve_figure(self.curve.to_dict("records"), self.summary())

        tables = {
            "group_costs.csv": self.group_table().to_csv(index=False, float_format="%.6f"),
            # W' a whole number of tokens (an empty cell where it does not apply), not 504.000000
            "curve.csv": self.curve.astype({"uniform_window": "Int64"}).to_csv(index=False, float_format="%.6f"),
        }
        return dict(summary=self.summary, tables=tables, figures={"kv_curve": curve}, extra=policy_files)


def curve_figure(rows: list[dict], summary: dict):
    """kv_curve's figure (:func:`~headprobe.analyses.figures.kv_policy_curve`) of curve.csv's ``rows``
    for the run ``summary`` describes (summary.json: ``model``, ``weights_precision``, ``config``'s
    ``seq_len``, ``sink``, ``window``, ``loss_tolerance`` and the sample sizes,
    :func:`~headprobe.analyses.vocabulary.kv_sample_text`): what ``headprobe kv`` draws, and what
    scripts/redraw_figures.py redraws from a committed run's curve.csv and summary.json. The title
    names the weights as every figure does; the subtitle the samples, and which intervals could not be
    made (summary.json's ``interval_null_reasons``). The title names the ranking that chose the groups
    kept full (summary.json's ``method``, else its config's; the estimate run's figure read as the default
    retrieval ranking's); a summary with neither names none."""
    from headprobe.analyses import figures
    from headprobe.analyses.vocabulary import kv_sample_text

    config = summary["config"]
    weights = summary.get("weights_precision")
    model = figures.model_tag(summary["model"], weights) if weights else summary["model"]
    why = summary.get("interval_null_reasons") or {}
    none = [f"no {k.replace('_', ' ')} interval" for k in ("natural_loss", "copy_accuracy") if k in why]
    method = summary.get("method") or config.get("method")
    ranked = f"; chosen groups ranked by --method {method}" if method else ""
    return figures.kv_policy_curve(
        rows,
        f"{model}: KV policy at {config['seq_len']} tokens "
        f"(sink {config['sink']}, window {config['window']}{ranked}; uniform: window W', same KV memory)",
        loss_tolerance=config.get("loss_tolerance"),
        subtitle=kv_sample_text(summary) + "".join(f"; {n}" for n in none),
    )


def _mean(values) -> float:
    v = list(values)
    return sum(v) / len(v)


TABLE_DIGITS = KV_TABLE_DIGITS
"""The decimals the report's table prints (:data:`~headprobe.analyses.vocabulary.KV_TABLE_DIGITS`,
shared with the LaTeX export): the one comparison of the chosen policy with the others (the
report's words and summary.json's ``beats_*``) is made at them."""


def _tolerance_line(target: dict) -> str:
    """The report's line on ``--loss-tolerance``: the chosen policy's natural-loss increase, its 95%
    interval and whether the tolerance holds beyond it (summary.json's ``target``,
    :func:`~headprobe.analyses.kvpolicy.tolerance_check`)."""
    from headprobe.analyses.figures import format_ci

    d, flag = TABLE_DIGITS["natural_loss_increase"], target["within_tolerance"]
    return (
        f"--loss-tolerance {target['loss_tolerance']:g} nats/token: the chosen policy's natural-loss increase "
        f"{target['natural_loss_increase']:+.{d}f} {format_ci(target['natural_loss_increase_ci95'], f'+.{d}f')} "
        f"{target['verdict']} (within_tolerance: {'null' if flag is None else str(flag).lower()})"
    )


def natural_unit_rule(n_windows: int) -> str:
    """What the natural-loss interval covers (summary.json's rule): its unit is a block of tokens,
    not a text, so it is conditional on the ``n_windows`` windows read."""
    return (
        f"the unit is a block of contiguous tokens, not a text: the interval is conditional on these {n_windows} "
        f"window{'s' if n_windows != 1 else ''} of text (token-to-token noise) and covers text-to-text spread only "
        "as far as several windows (--n-natural) differ; another text can fall outside it"
    )


def sink_notes(seq_len: int, block_len: int, sink: int, distances: Sequence[int]) -> list[str]:
    """The report's NOTE where a distance puts the planted block's first occurrence (it starts at
    ``seq_len - block_len - distance``) inside the first ``sink`` positions, which a streaming group
    keeps: its copy accuracy there is not a long-range measure (the default distances avoid it)."""
    inside = [d for d in distances if seq_len - block_len - d < sink]
    if not inside:
        return []
    return [
        f"--distances {','.join(map(str, inside))} put{'s' * (len(inside) == 1)} the planted block's first "
        f"occurrence inside the sink (its first {sink} positions), which a streaming group keeps: its copy "
        f"accuracy there is not long-range; at most {seq_len - block_len - sink} keeps it out"
    ]


ONE_WINDOW_NOTE = (
    "the natural-loss intervals resample blocks of tokens of one window of text (--n-natural 1): they are "
    "conditional on that text, not an interval over texts; more windows (--n-natural 8) bring text-to-text spread into the blocks it resamples"
)
"""The report's NOTE of a run whose natural text is one window (kv's default)."""


def _table_row(name: str, r: dict, interval: bool = True) -> str:
    """One row of the report's table: ``name``, then ``r``'s natural loss increase and copy accuracy at
    their :data:`TABLE_DIGITS` decimals, each followed (``interval``) by the 95% interval of the
    increase and of the accuracy drop against the full cache (:func:`~headprobe.analyses.kvpolicy.curve_row`'s
    ``*_ci95_*``; ``[n/a]`` where there is none), and its long-range loss at 3."""
    from headprobe.analyses.figures import format_interval

    nan = float("nan")
    loss, acc = (f"{r[k]:>{w}.{TABLE_DIGITS[k]}f}" for k, w in (("natural_loss_increase", 15), ("copy_accuracy", 14)))
    d = TABLE_DIGITS["natural_loss_increase"]
    loss_ci = format_interval(
        r.get("natural_loss_increase_ci95_lo", nan), r.get("natural_loss_increase_ci95_hi", nan), f"+.{d}f"
    )
    a = TABLE_DIGITS["copy_accuracy"]
    drop = f"{r.get('copy_accuracy_drop', nan):+.{a}f} " + format_interval(
        r.get("copy_accuracy_drop_ci95_lo", nan), r.get("copy_accuracy_drop_ci95_hi", nan), f"+.{a}f"
    )
    if not interval:
        loss_ci = drop = ""
    return f"{name:>10} {loss} {loss_ci:<20} {acc}  {drop:<24} {r['long_range_loss']:>16.3f}"


def _table_header() -> str:
    """The report table's header, each name over its number in :func:`_table_row` (the accuracy's
    column and its drop's two spaces apart: headed ``copy accuracy drop [95% CI]`` they read as one
    name over the two numbers)."""
    return (
        f"{'':>10} {'natural-loss Δ':>15} {'[95% CI]':<20} {'copy accuracy':>14}  {'accuracy drop [95% CI]':<24} "
        f"{'long-range loss':>16}"
    )


def _budget_default() -> str:
    """``headprobe budget``'s default ``--dtype`` and its bytes per number: ``bf16, 2 bytes``."""
    from headprobe.probe.layout.cost import BUDGET_DTYPE, DTYPE_BYTES

    return f"{BUDGET_DTYPE}, {DTYPE_BYTES[BUDGET_DTYPE]} bytes"


def element_size(dtype: str, nbytes: int) -> dict[str, Any]:
    """summary.json's ``kv_bytes_per_element`` (``nbytes``, of the run's ``dtype``: the cache is
    kept in the model's dtype) and where it comes from: ``headprobe budget`` costs its own
    ``--dtype`` (default bf16, 2 bytes), so the same cache there needs ``--dtype`` ``dtype``."""
    return {
        "kv_bytes_per_element": nbytes,
        "kv_bytes_per_element_source": f"the run's --dtype {dtype}: the KV cache is kept in the model's dtype "
        f"({nbytes} bytes per number); headprobe budget costs its own --dtype (default {_budget_default()}), "
        f"so its --policy gives these bytes with --dtype {dtype} (policy_budget.json's command)",
    }


def _bytes_line(s: dict) -> str:
    """The report's line of the policy's and the full cache's KV bytes and their element size."""
    from headprobe.probe.core.sizes import format_bytes

    dtype = s["config"]["dtype"]
    return (
        f"KV cache {format_bytes(s['kv_bytes'])} of {format_bytes(s['kv_bytes_full'])} per sequence at "
        f"{s['kv_bytes_per_element']} bytes per number ({dtype}, the run's dtype; headprobe budget costs "
        f"{_budget_default()}, unless --dtype {dtype})"
    )


def _signs(chosen: dict, others: list[dict]) -> dict[str, tuple[int, bool]]:
    """Per quantity of :data:`TABLE_DIGITS`: the sign of ``chosen`` minus the mean of ``others``
    at the table's digits, and whether the unrounded values differ where the rounded are equal."""
    out = {}
    for key, digits in TABLE_DIGITS.items():
        a, b = chosen[key], _mean(r[key] for r in others)
        x, y = round(a, digits), round(b, digits)
        out[key] = ((x > y) - (x < y), x == y and a != b)
    return out


_DIFFERENCES = {"natural_loss_increase": "natural_loss", "copy_accuracy": "copy_accuracy"}
"""Per quantity of :data:`TABLE_DIGITS`, the name of the chosen row's paired difference from a control
(:func:`~headprobe.analyses.kvpolicy.comparison_columns`: ``<name>_minus_<control>[_ci95_lo|_hi]``)."""


def _interval(chosen: dict, key: str, control: str) -> tuple[float, float]:
    """The 95% interval of chosen minus ``control`` on ``key`` (a :data:`TABLE_DIGITS` quantity), NaN
    where the row has none."""
    name, nan = f"{_DIFFERENCES[key]}_minus_{control}", float("nan")
    return chosen.get(f"{name}_ci95_lo", nan), chosen.get(f"{name}_ci95_hi", nan)


def _judged(chosen: dict, others: list[dict], control: str) -> tuple[bool | None, list[str], list[str]]:
    """The comparison of ``chosen`` with the mean of ``others`` at the report's digits (:func:`_signs`),
    judged by the 95% intervals of chosen minus ``control``: ``(beats, worse, undistinguished)``.

    * ``undistinguished``: the quantities (:data:`_DIFFERENCES`' names) on which the words claim a
      difference (nonzero at the table's digits) while the interval covers 0 or is undefined (NaN:
      too few blocks or sequences, or a row without per-token values);
    * ``worse``: those on which ``chosen`` is worse (a higher natural-loss increase, a lower copy
      accuracy) with an interval that excludes 0;
    * ``beats``: False where ``worse`` names one, whatever the other's interval; else None (not
      distinguishable at this sample size) where ``undistinguished`` names one; else no higher
      natural-loss increase and no lower copy accuracy (ties count, so a budget where both copy
      perfectly is judged on loss).
    """
    signs = _signs(chosen, others)
    unsure, worse = [], []
    for key, bad in (("natural_loss_increase", 1), ("copy_accuracy", -1)):
        lo, hi = _interval(chosen, key, control)
        if signs[key][0] != 0 and not (lo > 0 or hi < 0):
            unsure.append(_DIFFERENCES[key])
        elif signs[key][0] == bad:
            worse.append(_DIFFERENCES[key])
    if worse:
        return False, worse, unsure
    if unsure:
        return None, worse, unsure
    return signs["natural_loss_increase"][0] <= 0 and signs["copy_accuracy"][0] >= 0, worse, unsure


def _difference(chosen: dict, others: list[dict], control: str) -> dict:
    """summary.json's ``chosen_minus_<control>``: per quantity the paired difference and its 95%
    interval, the quantities :func:`_judged` calls undistinguished and the verdict: ``beats``, ``does
    not beat`` or ``not distinguishable at this sample size``."""
    out: dict[str, Any] = {}
    for key, name in _DIFFERENCES.items():
        out[name] = chosen.get(f"{name}_minus_{control}", float("nan"))
        out[f"{name}_ci95"] = list(_interval(chosen, key, control))
    beats, _, out["not_distinguishable"] = _judged(chosen, others, control)
    out["verdict"] = (
        "not distinguishable at this sample size" if beats is None else ("beats" if beats else "does not beat")
    )
    return out


def _comparison(chosen: dict, others: list[dict], control: str, name: str) -> str:
    """How ``chosen`` compares with the mean of ``others``, in words, at the digits the report's table
    prints: ``"natural loss lower|equal|higher, copy accuracy ..."``, ``"equal at N digits"`` where
    only the unrounded values differ; prefixed ``"not distinguishable from <name> at this sample
    size: "`` where :func:`_judged` gives no verdict, ``"does not beat <name> (worse beyond its
    interval on ...): "`` where it is worse on one quantity while the other's interval covers 0, and
    followed by the paired differences and their intervals."""
    from headprobe.analyses.figures import format_interval

    def word(key: str) -> str:
        sign, sub_digit = _signs(chosen, others)[key]
        return ("lower", "equal", "higher")[sign + 1] + (f" at {TABLE_DIGITS[key]} digits" if sub_digit else "")

    nan = float("nan")
    diffs = ", ".join(
        f"{label} {chosen.get(f'{_DIFFERENCES[key]}_minus_{control}', nan):+.{TABLE_DIGITS[key]}f} "
        + format_interval(*_interval(chosen, key, control), f"+.{TABLE_DIGITS[key]}f")
        for key, label in (("natural_loss_increase", "natural loss"), ("copy_accuracy", "copy accuracy"))
    )
    words = f"natural loss {word('natural_loss_increase')}, copy accuracy {word('copy_accuracy')}"
    beats, worse, unsure = _judged(chosen, others, control)
    prefix = ""
    if beats is None:
        prefix = f"not distinguishable from {name} at this sample size: "
    elif worse and unsure:
        prefix = (
            f"does not beat {name} (worse beyond its interval on {', '.join(w.replace('_', ' ') for w in worse)}): "
        )
    return f"{prefix}{words} (chosen - {name}: {diffs})"


def _beats(chosen: dict, others: list[dict], control: str) -> bool | None:
    """summary.json's ``beats_<control>``: :func:`_judged`'s verdict."""
    return _judged(chosen, others, control)[0]


def _token_sets(model: LoadedModel, config: KVConfig):
    """The natural-text windows and the long-range set (:func:`~headprobe.analyses.data.long_range_tokens`)."""
    from headprobe.analyses.data import long_range_tokens, natural_text_tokens
    from headprobe.probe.core.io import open_text_file

    text = open_text_file(config.text) if config.text else None
    check_context(config.seq_len, model.spec.n_ctx)  # where the config could not be read before the load
    natural = natural_text_tokens(model, config.n_natural, config.seq_len, config.seed, text)
    if natural.tokens.shape[0] < config.n_natural:
        raise HeadprobeError(
            f"the text holds {natural.tokens.shape[0]} windows of {config.seq_len} tokens; "
            f"{config.n_natural} are needed"
        )
    assert config.distances is not None  # filled by KVConfig.__post_init__
    lr = long_range_tokens(
        model, config.seq_len, list(config.distances), config.block_len, config.seed + 1, config.n_per_distance, text
    )
    return natural, lr


def forward_plan(model: LoadedModel, config: KVConfig) -> BatchPlan:
    """How many sequences each of kv's forwards takes: a task's whole batch (the larger: ``n_natural``
    windows, or ``n_per_distance`` long-range sequences per distance) where it fits in the memory
    budget, else as many as fit (:func:`~headprobe.analyses.kvpolicy.sequences_per_forward`). Per
    sequence :func:`~headprobe.probe.layout.cost.forward_sequence_bytes` at ``seq_len`` with logits in
    :data:`~headprobe.analyses.kvpolicy.LOGIT_CHUNK` positions, plus the pattern a statistic's hook
    reads (``4 * head * seq_len**2`` bytes, float32).

    Raises:
        HeadprobeError: not even one sequence fits in the memory budget (before any forward).
    """
    from headprobe.analyses.kvpolicy import LOGIT_CHUNK
    from headprobe.probe.core import memory

    spec, T = model.spec, config.seq_len
    batch = max(config.n_natural, len(config.distances or (0,) * 4) * config.n_per_distance)
    per = (
        spec.forward_sequence_bytes(T, model.dtype.itemsize, logit_positions=min(T, LOGIT_CHUNK))
        + 4 * spec.n_heads * T * T
    )
    return memory.plan(per, model.device, 1, f"kv's forwards (batches of up to {batch} x {T} tokens)", cap=batch)


def batch_line(model: LoadedModel, config: KVConfig) -> str:
    """The header line of :func:`forward_plan`.

    Raises:
        HeadprobeError: as :func:`forward_plan`.
    """
    return forward_plan(model, config).line()


def _checked_setup(model: LoadedModel, config: KVConfig) -> tuple[AttentionLayout, Streaming, list[tuple[int, int]]]:
    """``(layout, streaming, candidates)``: the model's KV layout, the streaming policy of
    ``--sink``/``--window`` and the groups whose streaming changes attention, after checking the
    settings, the backend and every budget before any work (see :func:`run` for what raises)."""
    from headprobe.analyses import kvpolicy as kp
    from headprobe.probe.layout.attention import KVPolicy, Streaming

    config.preflight()
    kp.check_kv_backend(model)
    # chunked attention: before any work
    model.check_kv_policy(KVPolicy.uniform(model.spec.n_layers, model.n_kv_groups))
    layout = model.kv_layout
    assert config.window is not None  # filled by KVConfig.__post_init__
    streaming = Streaming(config.sink, config.window)
    candidates = kp.streaming_candidates(layout, streaming)
    if not candidates:
        raise HeadprobeError(
            f"every layer of {model.spec.name} has a sliding window of at most --window {config.window}: "
            f"streaming would change nothing; use a smaller --window"
        )
    for b in config.budgets:  # --kv-budget among them where given (KVConfig)
        kp.check_budget(b, streaming, layout, config.seq_len, candidates)
    return layout, streaming, candidates


def run(model: LoadedModel, config: KVConfig, progress: bool = True) -> KVResult:
    """Choose and measure a head-level KV policy for the loaded ``model`` (see the module docstring),
    each forward taking as many sequences as :func:`forward_plan` allows.

    Raises:
        HeadprobeError: a non-native backend, an encoder, no group whose streaming changes attention
            (every layer's sliding window no wider than ``window``), bad lengths,
            budgets below the all-streaming floor, not one sequence within the memory budget, or an
            allocated cache that disagrees with the formula.
    """
    from headprobe.analyses.kvpolicy import sequences_per_forward

    with sequences_per_forward(forward_plan(model, config).items):
        return _chosen_and_measured(model, config, progress)


def _target(row: dict, kv_budget: float | None) -> str:
    """curve.csv's ``target`` of a budget-curve row: ``full``, ``kv_budget`` (the written policy's
    budget and its controls) or ``budgets`` (another ``--budgets`` point)."""
    if row["policy"] == "full":
        return "full"
    return "kv_budget" if row["budget"] == kv_budget else "budgets"


def _tolerance_policy(
    model: LoadedModel, config: KVConfig, data: tuple, setup: tuple, costs: GroupCosts, full: Quality, progress: bool
) -> tuple[KVPolicy, list[dict]]:
    """``(policy, comparison)`` of ``--loss-tolerance``: the policy whose full groups the binary
    search chose (:func:`~headprobe.analyses.kvpolicy.tolerance_full_groups`) and the chosen,
    uniform and random policies at its memory, rows marked ``target = "loss_tolerance"``
    (``budget``: the chosen policy's KV fraction); a progress bar for each, the search's complete
    where it ends before its bound. ``setup``:
    :func:`_checked_setup`'s."""
    from headprobe.analyses import kvpolicy as kp
    from headprobe.probe.core.progress import progress_bar
    from headprobe.probe.layout.cost import policy_cost

    tokens, start, lr = data
    layout, streaming, candidates = setup
    seeds = list(range(config.seed, config.seed + config.n_random))
    assert config.loss_tolerance is not None  # the mode
    steps = kp.tolerance_search_steps(len(candidates))
    search = progress_bar(
        total=steps, desc=f"kv policies: loss-tolerance search ({config.loss_tolerance} nats/token)", progress=progress
    )
    full_groups = kp.tolerance_full_groups(
        model, tokens, start, lr, costs.score, streaming, config.loss_tolerance, full, layout, progress=search.update
    )
    search.total = search.n  # the search may end in fewer steps than its bound: its bar ends complete
    search.close()
    bar = progress_bar(
        total=2 + len(seeds),
        desc=f"kv policies: the loss tolerance's policy ({len(full_groups)} groups full) and controls",
        progress=progress,
    )
    policy = kp.policy_with_full(layout, full_groups, streaming, candidates, model.spec.name)
    comparison = kp.compare_at(
        model,
        tokens,
        start,
        lr,
        full_groups,
        streaming,
        seeds,
        layout,
        full,
        label=policy_cost(layout, policy, config.seq_len).kv_fraction,
        progress=bar.update,
    )
    bar.close()
    return policy, [{**r, "target": "loss_tolerance"} for r in comparison]


def _chosen_and_measured(model: LoadedModel, config: KVConfig, progress: bool) -> KVResult:
    """:func:`run`'s work once the memory plan is set."""
    import time

    import pandas as pd

    from headprobe.analyses import kvpolicy as kp
    from headprobe.analyses.ablation import untrusted_task_reason
    from headprobe.analyses.data import unknown_share, window_counts
    from headprobe.probe.core.progress import progress_bar
    from headprobe.probe.layout.cost import policy_cost

    layout, streaming, candidates = _checked_setup(model, config)
    t0 = time.perf_counter()
    natural, lr = _token_sets(model, config)
    tokens, start = natural.tokens.to(model.device), natural.start
    lr = dataclasses.replace(lr, tokens=lr.tokens.to(model.device))
    seeds = list(range(config.seed, config.seed + config.n_random))
    n_evals = 1 + (len(candidates) if config.method == "measured" else 0) + len(config.budgets) * (2 + len(seeds))
    bar = progress_bar(total=n_evals, desc="kv policies: budgets", progress=progress)
    full = kp.evaluate(model, tokens, start, lr)
    bar.update()
    if config.method == "measured":
        costs = kp.measured_group_costs(
            model, tokens, start, lr, streaming, full, progress=bar.update, candidates=candidates
        )
    else:
        costs = (kp.retrieval_group_costs if config.method == "retrieval" else kp.estimated_group_costs)(
            model, tokens, lr, streaming
        )
    curve = kp.kv_curve(
        model, tokens, start, lr, costs.score, streaming, list(config.budgets), seeds, layout, full, progress=bar.update
    )
    bar.close()
    if config.loss_tolerance is None:
        assert config.kv_budget is not None  # KVConfig sets it exactly where --loss-tolerance is not given
        full_groups = kp.budget_full_groups(
            costs.score, streaming, layout, config.seq_len, config.kv_budget, candidates
        )
        policy = kp.policy_with_full(layout, full_groups, streaming, candidates, model.spec.name)
        curve = [{**r, "target": _target(r, config.kv_budget)} for r in curve]
        comparison = [r for r in curve if r["target"] == "kv_budget"]
    else:
        policy, comparison = _tolerance_policy(
            model, config, (tokens, start, lr), (layout, streaming, candidates), costs, full, progress
        )
        curve = kp.with_tolerance(
            [{**r, "target": _target(r, None)} for r in curve] + comparison, config.loss_tolerance
        )
    chosen_row = next(r for r in comparison if r["policy"] == "chosen")
    chosen = kp.Quality(chosen_row["natural_loss"], chosen_row["long_range_loss"], chosen_row["copy_accuracy"], {})
    check = {
        **kp.allocated_cache_check(model, tokens, policy, layout),
        "loss": kp.loss_identity_check(model, tokens, start, policy, chosen.natural_loss),
    }
    return KVResult(
        config,
        model.spec,
        layout,
        policy,
        policy_cost(layout, policy, config.seq_len),
        costs,
        full,
        chosen,
        comparison,
        pd.DataFrame(curve),
        check,
        sources={"natural": natural.source, "long_range": lr.source},
        windows={"natural": window_counts(natural), "long_range": window_counts(lr)},
        untrusted=untrusted_task_reason(full.natural_loss, model.spec.d_vocab, unknown_share(model, natural)),
        seconds=time.perf_counter() - t0,
        device=str(model.device),
        self_check=model.self_check.to_dict(),
        candidates=candidates,
    )


kv = options.command_function(
    KVConfig,
    run,
    "kv",
    "A head-level KV-cache policy, chosen from the heads and measured causally",
    "``seq_len=1024``, ``kv_budget=0.5``",
)
"""``headprobe kv`` as a function: :func:`headprobe.options.command_function` over :func:`run`."""


# No --device-map/--max-memory (the config refuses a device map: the per-group masks and the
# streaming cache are checked on one device only); --no-bos as scan, ablate and prune.
