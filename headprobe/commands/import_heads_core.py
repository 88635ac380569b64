"""The run of ``headprobe import`` (torch): the head file read against the loaded model, scan's
token sets, clean losses and mean z, scan's verification of the one head set
(:func:`headprobe.analyses.verification.verify_heads`) and, with ``--kv``, ``headprobe kv``'s
measurement of the file's policy. The command and its flags are :mod:`headprobe.commands.import_heads`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import cast

from headprobe import options
from headprobe.analyses import exchange as ex
from headprobe.analyses.ablation import Verification
from headprobe.analyses.statistics import interval_rule
from headprobe.analyses.verdicts import verdict_counts
from headprobe.commands import scan_core
from headprobe.commands.import_heads import HELP, ImportConfig, check_policy_span, policy_span, refuse_unused  # noqa: F401 - the light module's names, re-exported
from headprobe.probe.backends.base import LoadedModel
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.core.heads import Head, check_head_layers, format_head
from headprobe.probe.core.reprs import CompactRepr, load_seconds

SET_NAME = "imported"
"""The head set's name in the verification (its test and its control streams' seed)."""


@dataclass(repr=False)
class ImportResult(CompactRepr):
    """The file (:class:`~headprobe.analyses.exchange.HeadFile`), the heads checked, the
    verifications (tested kind first) and their design, and the KV measurement (``kv``: rows
    ``policy, kv_fraction, natural_loss_increase[_ci95], long_range_loss, copy_accuracy, copy_accuracy_drop[_ci95]``,
    ``*_ci95`` the paired 95% interval against the full cache, None on the full row; or None);
    ``seconds`` the run's, ``load_s`` the model's load where import loaded it, None where the caller
    passed a model it loaded (:func:`~headprobe.probe.core.reprs.load_seconds`)."""

    config: ImportConfig
    file: ex.HeadFile
    heads: list[Head]
    verifications: list[Verification]
    design: dict
    kv: list[dict] | None = None
    kv_data: dict | None = None
    """The tokens ``kv`` was measured on (:func:`measure_policy`), or None."""
    seconds: float = 0.0
    load_s: float | None = load_seconds()
    notes: list[str] = field(default_factory=list)
    """What the flags did not do with this file, and the verification's notes (a layer whose
    heads are all under test, so its layer-matched controls come from the nearest layers)."""

    def _repr_notes(self) -> dict[str, str]:
        """The verdicts counted (:func:`~headprobe.commands.scan_core.type_verdicts`), first in ``repr``."""
        counts = verdict_counts(scan_core.type_verdicts(self.verifications))
        return {"verdicts": counts} if counts else {}

    def summary(self) -> dict:
        """What ``headprobe import`` prints, as data (it writes no file; :meth:`report`, the text, is
        formatted from it): the file read (``heads_file``, ``kind``, ``rule``), ``heads``
        (``"layer.head"``), ``ablations`` (each verification's row, as in scan's summary.json; NaN where
        undefined), the verification's ``design``, ``kv`` (the rows, or None) and ``notes``."""
        return {
            "heads_file": str(self.config.heads_file),
            "kind": self.file.kind,
            "rule": self.file.rule,
            "heads": [format_head(h) for h in self.heads],
            "ablations": [v.to_dict() if hasattr(v, "to_dict") else vars(v) for v in self.verifications],
            "design": self.design,
            "kv": self.kv,
            "kv_data": self.kv_data,
            # a CONFIRMED verdict whose interval over sequences reaches 0 says what that means, as scan's does
            "notes": [*self.notes, *scan_core.wide_interval_notes(self.verifications)],
        }

    @options.reports_for_readers("import")
    def report(self) -> str:
        """The heads read and each verdict, with what a NOT CONFIRMED one fell short of (the
        verification plan was printed as it began), from :meth:`summary` and the verifications."""
        from headprobe.analyses.verdicts import UNITS, VerdictRule, evidence_text, label

        s = self.summary()
        lines = [f"{s['heads_file']}: {s['kind']}, {len(s['heads'])} heads ({s['rule']}): {ex.describe(self.heads)}"]
        rows = s["ablations"]
        rule = VerdictRule.from_rows(rows, s["design"].get("verdict_rule"))
        for v, row in zip(self.verifications, rows, strict=True):
            if v.no_verdict and v.kind == self.design.get("primary_kind"):
                verdict = f"no verdict: {v.no_verdict}"
            elif not v.tested:
                verdict = "(reported, not tested)"
            else:
                short = rule.shortfall(v.p_adjusted, v.top_effect, v.random_effects) if rule else None
                verdict = f"{evidence_text(row)} {label(v.confirmed)}" + (f" ({short})" if short else "")
            random = f"random {v.random_mean:+.4f}" if v.draws else "no control set (none ablated)"
            unit = UNITS[row.get("metric") or "loss"]
            effect = scan_core.top_effect_text(v, 4)
            lines.append(f"{v.kind}-ablation on {v.task}: effect {effect} vs {random} {unit}; {verdict}")
        if self.verifications:
            lines.append(f"(effect [lo, hi]: {interval_rule()}; [n/a]: none)")
        if rule is not None and any(v.tested for v in self.verifications):
            lines.append(f"(the rule: a verdict is CONFIRMED when {rule.condition()})")
        if s["kv"]:
            lines += [kv_row(r) for r in s["kv"]] + ([kv_data_line(s["kv_data"])] if s["kv_data"] else [])
            lines.append(KV_INTERVALS)
        return "\n".join([*lines, *(f"NOTE: {n}" for n in s["notes"])])


def _layout(model: LoadedModel) -> ex.Layout:
    spec = model.spec
    groups = 1 if str(getattr(spec, "kind", "")).upper() == "MLA" else spec.n_kv_heads
    return ex.Layout(
        spec.name, spec.n_layers, spec.n_heads, spec.n_kv_heads, groups, spec.d_model, model.parallel_attn_mlp
    )


def run(model: LoadedModel, config: ImportConfig, progress: bool = True) -> ImportResult:
    """Verify the heads of ``config.heads_file`` on ``model`` as scan verifies a head type's top-k set.

    Raises:
        HeadprobeError: a file of another shape than the model, a head in a hybrid's
            linear-attention layer, no heads, as many heads as the model has (no control), a model
            whose self-check forbids ablation, or as scan's token sets.
    """
    from headprobe.analyses import verification as verif
    from headprobe.analyses.ablation import EMBEDDING_METRIC, EmbeddingDistance, first_scored, untrusted_task_reason
    from headprobe.analyses.data import left_out_notes, natural_text_tokens, repeated_random_tokens
    from headprobe.analyses.scoring import score_tokens

    t0 = time.perf_counter()
    spec = model.spec
    hf = _head_file(model, config)
    heads = hf.heads
    cfg = cast(ImportConfig, replace(config, k=len(heads), types=("induction",)).resolved(spec, model.trained_periods))
    assert cfg.seq_len is not None and cfg.period is not None
    text = cfg.read_text()
    natural = natural_text_tokens(
        model, cfg.n_natural, cfg.seq_len, cfg.seed, text, source=str(cfg.text) if cfg.text else None
    )
    repeated = repeated_random_tokens(model, cfg.n_repeated, cfg.period, cfg.seed)
    _, nat_loss, mean_z = score_tokens(
        model,
        natural,
        "natural",
        first_scored("natural", natural.start, None),
        mean_z=True,
        types=(),
        streaming=cfg.streaming,
    )
    _, rep_loss, _ = score_tokens(
        model,
        repeated,
        "repeated",
        first_scored("repeated", repeated.start, repeated.period),
        types=(),
        streaming=cfg.streaming,
    )
    assert mean_z is not None  # asked for
    clean = {"natural": nat_loss, "repeated": rep_loss}
    untrusted = {
        "natural": untrusted_task_reason(
            float(nat_loss.double().mean()), spec.d_vocab, scan_core.unknown_share(model, natural)
        ),
        "repeated": untrusted_task_reason(float(rep_loss.double().mean()), spec.d_vocab),
    }
    sets = {"natural": natural, "repeated": repeated}
    metric = scan_core.scan_metric(spec)
    scorers = (
        {task: EmbeddingDistance(model, ts.tokens) for task, ts in sets.items()} if metric is EMBEDDING_METRIC else None
    )
    verifications, design = verif.verify_heads(
        model,
        {SET_NAME: heads},
        {SET_NAME: cfg.task},
        sets,
        clean,
        mean_z,
        scan_core.verification_settings(cfg),
        metric=metric,
        scorers=scorers,
        untrusted=untrusted,
        removed=scan_core.removed_heads(model),
        progress=progress,
        say=scan_core._say,
        ranked=False,  # a file's heads: -k picks them only from a score file, with its ties cut
    )
    kv, kv_notes, kv_data = measure_policy(model, cfg, hf) if config.measure_kv else (None, [], None)
    notes = [*_notes(hf), *left_out_notes(natural), *kv_notes]
    notes += design.get("notes", [])  # the verification's, as scan prints them
    return ImportResult(config, hf, heads, verifications, design, kv, kv_data, time.perf_counter() - t0, notes=notes)


def _head_file(model: LoadedModel, config: ImportConfig) -> ex.HeadFile:
    """The file's heads, checked against the model (see :func:`run` for what raises)."""
    spec = model.spec
    hf = ex.read_head_file(config.heads_file, _layout(model), config.k or scan_core.DEFAULT_K, config.score)
    refuse_unused(config, hf)  # the command line's preflight did so already; a loaded model skips it
    check_head_layers(hf.heads, spec.layout.head_layers)
    options.refuse_removed(hf.heads, model)  # a pruned checkpoint's removed head ablates to nothing
    if not hf.heads:
        raise HeadprobeError(f"{config.heads_file} names no heads ({hf.rule})")
    if len(hf.heads) >= spec.n_layers * spec.n_heads:
        raise HeadprobeError(
            f"{config.heads_file} names all {len(hf.heads)} heads of {spec.name}: no head is left for a control set"
        )
    model.self_check.require_decomposition("verification by ablation")
    return hf


def _notes(hf: ex.HeadFile) -> list[str]:
    """A top --top-k that cut through a tie (:func:`~headprobe.analyses.exchange.tie_note`); flags the
    file makes do nothing were refused before the run (:func:`~headprobe.commands.import_heads.refuse_unused`)."""
    tie = ex.tie_note(hf)
    return [] if tie is None else [tie]


def measure_policy(
    model: LoadedModel, cfg: ImportConfig, hf: ex.HeadFile
) -> tuple[list[dict] | None, list[str], dict | None]:
    """``(rows, notes, data)``: ``headprobe kv``'s measurement of the file's policy at ``cfg.seq_len``: full caches, the
    policy and one window on every group at the same KV memory (``kv_core``'s token sets,
    :mod:`headprobe.analyses.kvpolicy`'s exact per-group masks), and the NOTE on the long-range
    set's windows left out as mostly one token (the natural ones are the verification's), and the
    tokens measured on (:func:`kv_data_line`: import's --n-natural, kv's other data defaults). Rows
    and data None: the file has no policy.

    Raises:
        HeadprobeError: a backend without per-group KV masks, or a window covering the whole sequence."""
    if hf.policy is None:
        return None, [], None
    from headprobe.analyses import kvpolicy as kp
    from headprobe.analyses.data import left_out_notes
    from headprobe.commands import kv_core
    from headprobe.commands.kv import KVConfig
    from headprobe.probe.layout.attention import Streaming

    policy = hf.policy
    sink, window = policy_span(policy)
    assert cfg.seq_len is not None
    check_policy_span(policy, cfg.seq_len)  # where the fitted --seq-len was not known before the load
    kp.check_kv_backend(model)
    kvc = KVConfig(
        model=cfg.model,
        seq_len=cfg.seq_len,
        n_natural=cfg.n_natural,
        text=cfg.text,
        sink=sink,
        window=window,
        seed=cfg.seed,
    )
    natural, lr = kv_core._token_sets(model, kvc)
    tokens = natural.tokens.to(model.device)
    lr = replace(lr, tokens=lr.tokens.to(model.device))
    full = kp.evaluate(model, tokens, natural.start, lr)
    k = len(policy.full_groups)
    uniform = kp.uniform_policy(policy.n_layers, policy.n_kv_groups, k, Streaming(sink, window), cfg.seq_len)
    rows = []
    for name, p in (("full", None), ("file", policy), ("uniform", uniform)):
        cached = sum(map(sum, p.cached_positions(cfg.seq_len))) if p is not None else None
        q = full if p is None else kp.evaluate(model, tokens, natural.start, lr, p)
        row = {
            "policy": name,
            "kv_fraction": 1.0 if cached is None else cached / (policy.n_layers * policy.n_kv_groups * cfg.seq_len),
            "natural_loss_increase": q.natural_loss - full.natural_loss,
            "natural_loss_increase_ci95": None,  # the full row: the reference, no difference to bound
            "long_range_loss": q.long_range_loss,
            "copy_accuracy": q.copy_accuracy,
            "copy_accuracy_drop": full.copy_accuracy - q.copy_accuracy,
            "copy_accuracy_drop_ci95": None,
        }
        if p is not None:  # paired with the full cache on the same tokens, from these evaluations (as kv's rows)
            ci = kp.against_full(q, full, identical=row["kv_fraction"] == 1.0)  # every position cached: [0, 0]
            for name in ("natural_loss_increase", "copy_accuracy_drop"):
                row[f"{name}_ci95"] = [ci[f"{name}_ci95_lo"], ci[f"{name}_ci95_hi"]]
        rows.append(row)
    data = {
        "natural_windows": int(natural.tokens.shape[0]),
        "seq_len": cfg.seq_len,
        "text": str(cfg.text) if cfg.text else None,
        "long_range_sequences": int(lr.tokens.shape[0]),
        "distances": list(kvc.distances or ()),
        "n_per_distance": kvc.n_per_distance,
        "block_len": kvc.block_len,
        "seed": cfg.seed,
        "long_range_seed": cfg.seed + 1,
    }
    return rows, left_out_notes(lr, "long-range set (--kv)"), data


def kv_data_line(d: dict) -> str:
    """The report's line on the tokens the ``--kv`` rows were measured on (``ImportResult.kv_data``):
    import's own natural windows (--n-natural, default 8; kv's is 1) and kv's default long-range set,
    so a kv run's numbers differ unless its data flags are these."""
    w = d["natural_windows"]
    return (
        f"(kv data: {w} natural-text window{'s' if w != 1 else ''} x {d['seq_len']} tokens of "
        f"{d['text'] or 'the default text'} (--n-natural {w}), {d['long_range_sequences']} long-range sequences "
        f"({d['n_per_distance']} per distance at {','.join(map(str, d['distances']))}, blocks of {d['block_len']}), "
        f"seed {d['seed']} (long-range {d['long_range_seed']}): a kv run measures these tokens with the same "
        "--seq-len, --n-natural, --seed and --text and kv's default distances, block length and sequences per distance)"
    )


KV_INTERVALS = (
    "(kv [lo, hi]: 95% CI of the paired difference from the full cache on the same tokens, as headprobe kv: natural "
    "loss by a block bootstrap over contiguous tokens, copy accuracy drop by Student t over the long-range "
    "sequences, or where every sequence's drop is the same d, [d - (1 + d)(1 - c), d + (1 - d)(1 - c)], "
    "c = 0.025^(1/n) (Clopper-Pearson for 0 of n sequences differing), [0, 0] where every position is cached; "
    "[n/a]: none)"
)
"""The report's line on the intervals of ``--kv``'s rows (:func:`kv_row`)."""


def kv_row(r: dict) -> str:
    """One row of ``--kv`` in the report (:func:`measure_policy`'s ``r``): the KV fraction, the natural
    loss increase and the copy accuracy with its drop, each difference with its 95% interval
    (:func:`~headprobe.analyses.figures.format_ci`); the full cache's row, the reference, has none and
    says it holds point estimates."""
    from headprobe.analyses.figures import format_ci

    label = f"kv {r['policy']:>8}"
    nums = f"KV {r['kv_fraction']:.3f} of full, natural loss {r['natural_loss_increase']:+.4f}"
    if r.get("natural_loss_increase_ci95") is None:  # the full cache: the reference
        return f"{label} (reference, point estimates): {nums}, copy accuracy {r['copy_accuracy']:.3f}"
    return (
        f"{label}: {nums} {format_ci(r['natural_loss_increase_ci95'], '+.4f')}, copy accuracy {r['copy_accuracy']:.3f} "
        f"(drop {r['copy_accuracy_drop']:+.3f} {format_ci(r['copy_accuracy_drop_ci95'], '+.3f')})"
    )


import_heads = options.command_function(
    ImportConfig,
    run,
    "import_heads",
    "Check a head file against ``model`` and verify its heads causally",
    '``heads_file="full_attention_heads.tsv"``, ``task="repeated"``',
    command="import",
)
"""``headprobe import`` as a function (``import`` is a Python keyword)."""
