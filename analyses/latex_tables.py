"""``headprobe export --format latex``: a finished scan, prune, ablate, kv, circuit or study folder's tables as booktabs
LaTeX, one ``latex/<table>.tex`` per table, each a ``table`` float with a caption (what the numbers
are, their units, the run's model, weights, compute dtype, tokens and settings) and a label, ready to ``\\input`` (the
preamble needs ``\\usepackage{booktabs}``). Numbers are the run's own, rounded as its terminal
table rounds them (scan: :func:`~headprobe.analyses.verdicts.effect_digits`, p to 4 decimals; prune
and ablate: 3 decimals; a study: its report's 3, :mod:`~headprobe.analyses.study_table`); scan's rows and design sentence are ablation.caption.txt's
(:func:`~headprobe.analyses.verdicts.ordered_rows`). pandas' ``Styler.to_latex`` (jinja2) lays the
table out; every cell, header and caption goes through :func:`latex_text` (LaTeX's special
characters escaped, the few non-ASCII signs headprobe writes spelled as LaTeX). No model, no torch.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from headprobe.analyses.figures import format_ci, format_interval, title_name, weights_label
from headprobe.analyses.verdicts import CORRECTION_NAMES, NOT_TESTED, decided, effect_digits, ordered_rows, p_cell
from headprobe.analyses.verdicts import label as verdict_label
from headprobe.analyses.vocabulary import KV_TABLE_DIGITS, kv_sample_sizes, kv_sample_text, unreliable_picks
from headprobe.probe.core.errors import HeadprobeError

_SPECIAL = {
    "\\": r"\textbackslash{}",
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "{": r"\{",
    "}": r"\}",
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
    "->": r"$\rightarrow$",
    "<=": r"$\leq$",
    ">=": r"$\geq$",
    "<": r"\textless{}",
    ">": r"\textgreater{}",
    "Δ": r"$\Delta$",
    "≤": r"$\leq$",
    "≥": r"$\geq$",
    "±": r"$\pm$",
    "×": r"$\times$",
    "†": r"\dag{}",
    "−": "-",
    "–": "--",
    "—": "---",
    "→": r"$\rightarrow$",
}
_SPECIAL_RE = re.compile("|".join(re.escape(c) for c in sorted(_SPECIAL, key=len, reverse=True)))


_MINUS_RE = re.compile(r"(?<![\w.$-])-(?=\d)")
"""A number's minus sign: a ``-`` before a digit that ends no word, number, dash or math."""


def latex_text(text: object) -> str:
    """``text`` as LaTeX text mode reads it: ``\\ & % $ # _ { } ~ ^ < >`` escaped (``<=``, ``>=`` as
    ≤, ≥) and headprobe's non-ASCII signs (Δ, ≤, ≥, ±, ×, †, dashes, →) as LaTeX commands, in one
    pass (nothing escaped twice); a negative number's sign as math's minus (``$-$0.04``: text
    mode sets ``-`` as a hyphen), a hyphen in a word (``top-10``) or range (``1--3``) left alone."""
    return _MINUS_RE.sub("$-$", _SPECIAL_RE.sub(lambda m: _SPECIAL[m.group(0)], str(text)))


def table_tex(
    table: pd.DataFrame, caption: str, label: str, align: str | None = None, small: bool = False, after: str = ""
) -> str:
    """A booktabs ``table`` float of ``table`` (its cells text already, index hidden) with ``caption``
    and ``label``: every cell, header and the caption escaped (:func:`latex_text`), then ``after``, LaTeX
    as given (a ``\\ref``); ``small``: set in ``\\small`` (a wide table: scan's ablations fits a 16 cm
    text width so)."""
    styler = table.style.hide(axis="index")
    styler = styler.format(latex_text).format_index(latex_text, axis=1)
    align = align or "l" * len(table.columns)
    text = styler.to_latex(
        column_format=align,
        position="htbp",
        position_float="centering",
        hrules=True,
        label=label,
        caption=latex_text(caption) + after,
        multicol_align="c",
        environment="table",
    )
    return text.replace("\\centering\n", "\\centering\n\\small\n", 1) if small else text


def tex_label(path: Path, table: str) -> str:
    """``tab:<folder>-<table>``: letters, digits, ``-`` and ``:`` only (safe in ``\\label`` and ``\\ref``)."""
    stem = re.sub(r"[^A-Za-z0-9:-]+", "-", path.resolve().name).strip("-") or "run"
    return f"tab:{stem}-{re.sub(r'[^A-Za-z0-9:-]+', '-', table)}"


def tokens_text(tokens: Mapping) -> str:
    """scan's summary.json ``tokens`` in words: ``natural text 8 x 128 tokens, repeated random 8 x 101 (period 50)``."""
    parts = []
    nat, rep = tokens.get("natural_text") or {}, tokens.get("repeated_random") or {}
    if nat:
        parts.append(f"natural text {nat.get('sequences')} × {nat.get('seq_len')} tokens")
    if rep:
        parts.append(
            f"repeated random tokens {rep.get('sequences')} × {rep.get('seq_len')} (period {rep.get('period')})"
        )
    return ", ".join(parts)


def scan_tables(path: Path, summary: dict) -> dict[str, str]:
    """scan's ablation check as three tables, in ablation.caption.txt's row order: ``verdicts`` (the
    tested kind's rows, one a type: head type, task, top-k Δ [95% CI], control Δ mean, p adj, verdict:
    the table a paper shows, a column wide), ``ablations`` (every kind's row with its control sets and
    raw p: an appendix's, a page wide) and ``top_heads`` (each type's top-k heads with their scores);
    the captions begin with the caption file's design sentence (rebuilt with its function where the
    file is gone) and give the model and tokens.

    Raises:
        HeadprobeError: a scan run without an ablation check (--no-verify): no verdict table."""
    from headprobe.analyses.figures import ablation_caption

    rows = ordered_rows(summary.get("ablations") or [], (summary.get("config") or {}).get("types"))
    if not rows:
        raise HeadprobeError(
            f"--format latex: {path} is a scan run without an ablation check (--no-verify): it has no "
            "verdict table; rerun headprobe scan with verification"
        )
    design = summary.get("verification") or {}
    file = path / "ablation.caption.txt"
    text = file.read_text(encoding="utf-8") if file.is_file() else ablation_caption(rows, design)
    metric = (summary.get("metric") or {}).get("name", "loss")
    unit = (summary.get("metric") or {}).get("unit", "nats/token")
    k, primary = rows[0]["k"], design.get("primary_kind", "mean")
    full = pd.DataFrame([_verdict_row(r, effect_digits(metric), primary) for r in rows])
    full.columns = [
        "head type", "ablation", "task", f"top-{k} Δ [95% CI]", "control Δ", "sets", "p", "p adj", "verdict"
    ]  # fmt: skip
    tested = full[[r["kind"] == primary for r in rows]]
    caption = (
        f"{_run_text(summary)}: {text.splitlines()[0]} "
        f"Δ ({unit}): the top-{k} set's effect and the control sets' mean effect; "
        f"CI: 95% t interval over sequences; p adj: "
        f"{CORRECTION_NAMES.get(design.get('correction') or '', design.get('correction'))} over the "
        f"{design.get('family_size')} tested verdicts, alpha = {design.get('alpha')}. "
        f"Tokens: {tokens_text(summary.get('tokens') or {})}."
    )
    raw_p = "p: sequential Monte Carlo (≤: a curtailed test's bound); sets: control sets ablated. "
    tasks = _tasks_text(rows, primary) + _no_verdict_text(rows, primary)
    return {
        "verdicts": table_tex(
            tested.drop(columns=["ablation", "task", "sets", "p"]),
            f"{caption} {tasks}; {primary} ablation. Every ablation kind's row:",
            tex_label(path, "verdicts"), "lllll", after=f" Table \\ref{{{tex_label(path, 'ablations')}}}.",
        ),
        "ablations": table_tex(
            full.drop(columns=["task"]), f"{caption} {tasks}. {raw_p}",
            tex_label(path, "ablations"), "lllrrrrl", small=True,
        ),
        "top_heads": _scan_top_heads_table(path, summary, rows, primary, k),
    }  # fmt: skip


def type_name(head_type: object) -> str:
    """A head type as the figures and the viewer name it: ``previous-token`` for ``previous_token``."""
    return str(head_type).replace("_", "-")


def _no_verdict_text(rows: list, primary: str) -> str:
    """``. No verdict for induction: only 1 distinct control set exists``: each tested type without a
    verdict and the first clause of its reason (summary.json's ``no_verdict``), where the figure's title
    and the terminal say so and the table otherwise would not."""
    why: dict[str, list[str]] = {}
    for r in rows:
        if r["kind"] == primary and r.get("confirmed") is None and r.get("no_verdict"):
            why.setdefault(str(r["no_verdict"]).split(";")[0].split(": ")[0], []).append(type_name(r["head_type"]))
    return "".join(f". No verdict for {', '.join(ts)}: {reason}" for reason, ts in why.items())


def _tasks_text(rows: list, primary: str) -> str:
    """``Tasks: natural text for previous-token, ...; repeated random tokens for induction``."""
    by_task: dict[str, list[str]] = {}
    for r in rows:
        if r["kind"] == primary:
            by_task.setdefault(str(r["task"]), []).append(type_name(r["head_type"]))
    names = {"natural": "natural text", "repeated": "repeated random tokens"}
    return "Tasks: " + "; ".join(f"{names.get(t, t)} for {', '.join(ts)}" for t, ts in by_task.items())


def _scan_top_heads_table(path: Path, summary: dict, rows: list, primary: str, k: int) -> str:
    """``top_heads``: each tested type's top-k heads, best first, with their scores (``16.0 (0.77)``):
    summary.json keeps the first 5's, the rest come from the head_scores.csv column the type ranks by
    (:func:`_rank_column`); a head without a score is named alone."""
    scores = {t: {h["head"]: h.get("score") for h in hs} for t, hs in (summary.get("top_heads") or {}).items()}
    csv = path / "head_scores.csv"
    if csv.is_file():
        table = pd.read_csv(csv)
        names = table["layer"].astype(str) + "." + table["head"].astype(str)
        for t, known in scores.items():
            column = _rank_column(table, names, t, known)
            if column is not None:
                known.update({h: v for h, v in zip(names, table[column].astype(float)) if h not in known})
    table = pd.DataFrame(
        [
            [type_name(r["head_type"]), _heads_cell(r.get("top_heads") or [], scores.get(r["head_type"], {}))]
            for r in rows
            if r["kind"] == primary
        ],
        columns=["head type", f"top-{k} heads (layer.head, score), best first"],
    )
    caption = (
        f"{_run_text(summary)}: the {k} heads of each head type that the ablation check removes together, "
        "by their score on the type's detector."
    )
    return table_tex(table, caption, tex_label(path, "top_heads"), "lp{0.7\\linewidth}")


def _rank_column(table: pd.DataFrame, names: pd.Series, head_type: str, known: Mapping) -> str | None:
    """The column of head_scores.csv (``<type>`` or ``<type>_*``) whose values at summary.json's top
    heads are their recorded scores (4 decimals): the one the type ranks by, found without importing
    the detectors (they import torch); None where no column agrees."""
    at = dict(zip(names, range(len(names))))
    for column in [c for c in table.columns if c == head_type or c.startswith(f"{head_type}_")]:
        values = table[column]
        if known and all(
            isinstance(v, float | int) and h in at and abs(float(values.iloc[at[h]]) - v) <= 5e-5
            for h, v in known.items()
        ):
            return column
    return None


def _heads_cell(heads: list, scores: Mapping) -> str:
    return ", ".join(f"{h} ({scores[h]:.2f})" if isinstance(scores.get(h), float | int) else str(h) for h in heads)


def _verdict_row(r: Mapping, d: int, primary: str) -> list[str]:
    """One row of a verification row ``r`` (summary.json's ``ablations``), ``d`` decimals; as scan's
    terminal table, a kind not tested reads ``not tested`` unless it is the ``primary`` (tested)
    kind of a type without a verdict."""
    verdict = verdict_label(r.get("confirmed")) if decided(r, primary) else NOT_TESTED
    return [
        type_name(r["head_type"]),
        str(r["kind"]),
        str(r["task"]),
        f"{r['top_effect']:+.{d}f} {format_ci(r.get('top_effect_ci95'), f'+.{d}f')}",
        f"{r['random_mean']:+.{d}f}" if r.get("draws") else "-",
        str(r.get("draws", 0)),
        p_cell(r.get("p_value"), r.get("p_value_is_bound")),
        "-" if r.get("p_adjusted") is None else f"{r['p_adjusted']:.4f}",
        verdict,
    ]


def prune_tables(path: Path, summary: dict) -> dict[str, str]:
    """``pruning_curve``: each method's loss (natural, repeated; nats/token) at each step, random orders
    as the mean over seeds with their range ``[min, max]`` (the figure's band), as prune's terminal
    table rounds them (fraction 2 decimals, loss 3), and with ``--save-pruned`` the saved model's own
    losses as a last row (the figure's star); ``per_layer`` where the run has it.

    Raises:
        HeadprobeError: summary.json without curves or per-layer rows."""
    out = {}
    curves = summary.get("curves") or {}
    if curves:
        out["pruning_curve"] = _curve_table(path, summary, curves)
    if summary.get("per_layer"):
        out["per_layer"] = _per_layer_table(path, summary)
    if not out:
        raise HeadprobeError(f"--format latex: {path}/summary.json has no pruning curves or per-layer rows to tabulate")
    return out


def _run_text(summary: dict) -> str:
    """``smollm2-135m (4-bit weights, float32 compute, seed 0)``: the model, its weights' precision
    (summary.json's ``weights_precision`` in the figures' titles' words,
    :func:`~headprobe.analyses.figures.weights_label`), the run's compute dtype and seed; every
    caption names the run with it. A part the summary lacks is left out."""
    cfg = summary.get("config") or {}
    dtype, seed = summary.get("dtype") or cfg.get("dtype"), cfg.get("seed", summary.get("seed"))
    parts = [weights_label(str(summary["weights_precision"])) if summary.get("weights_precision") else None]
    parts += [f"{dtype} compute" if dtype else None, None if seed is None else f"seed {seed}"]
    model = title_name(str(summary.get("model")), str(summary.get("weights_precision") or ""))
    return f"{model} ({', '.join(p for p in parts if p)})"


def _curve_table(path: Path, summary: dict, curves: Mapping) -> str:
    """prune_tables' ``pruning_curve`` table."""
    methods: dict[str, list] = {}
    for name, rows in curves.items():
        methods.setdefault(name.split(":")[0], []).append(rows)
    cells = []
    for method, runs in methods.items():
        for i, row in enumerate(runs[0]):
            cell = [method if i == 0 else "", str(row["n_pruned"]), f"{row['fraction_pruned']:.2f}"]
            for col in ("natural_loss", "repeated_loss"):
                vals = [r[i][col] for r in runs]
                mean = sum(vals) / len(vals)
                band = f" [{min(vals):.3f}, {max(vals):.3f}]" if len(vals) > 1 else ""
                cell.append(f"{mean:.3f}{band}")
            cells.append(cell)
    saved = summary.get("pruned_model") or {}
    if "loss" in saved:  # the figure's star: the really smaller model's own losses
        row = ["saved model", str(saved["heads_removed"]), f"{saved['fraction_removed']:.2f}"]
        cells.append(row + [f"{saved['loss'][k]:.3f}" for k in ("natural", "repeated")])
    table = pd.DataFrame(cells, columns=["method", "heads removed", "fraction", "natural loss", "repeated loss"])
    tok = summary.get("tokens") or {}
    seeds = {m: len(r) for m, r in methods.items() if len(r) > 1}
    band = "; ".join(f"{m}: mean over {n} seeds [min, max]" for m, n in seeds.items())
    caption = (
        f"Loss (nats/token; lower is better) of {_run_text(summary)} as attention heads are removed, per method "
        f"({', '.join(methods)}){'; ' + band if band else ''}; of its {summary.get('n_heads_present')} heads"
        f"{'; saved model: the pruned model written with --save-pruned, its own losses' if 'loss' in saved else ''}. "
        f"Evaluation ({summary.get('evaluation', '')}): held-out natural text {' × '.join(map(str, tok.get('held_out_natural', [])))} "
        f"tokens, repeated random tokens {' × '.join(map(str, tok.get('repeated', [])))} (period {tok.get('period')})."
    )
    return table_tex(table, caption, tex_label(path, "pruning-curve"), "lrrll")


def _per_layer_table(path: Path, summary: dict) -> str:
    """prune_tables' ``per_layer`` table: per layer the loss with one head kept (the best, the worst),
    with the layer ablated, and the best head's cost over the clean loss."""
    rows = summary["per_layer"]
    inverted = set(unreliable_picks(rows)["inverted"])
    table = pd.DataFrame(
        [
            [
                str(r["layer"]),
                str(r["best_head"]),
                f"{r['loss_best_only']:.3f}{'†' if r['layer'] in inverted else ''}",
                f"{r['loss_worst_only']:.3f}",
                f"{r['loss_layer_ablated']:.3f}",
                f"{r['delta_best_only']:+.3f}",
                "yes" if r.get("best_head_halves_agree") else "no",
            ]
            for r in rows
        ],
        columns=["layer", "best head", "best only", "worst only", "layer ablated", "Δ best only", "halves agree"],
    )
    tok = summary.get("tokens") or {}
    clean = rows[0].get("clean_loss")
    caption = (
        f"Per layer, natural-text loss (nats/token) of {_run_text(summary)} with one head of the layer kept "
        f"(the best, the worst) and the others removed, and with the whole layer removed; Δ best only: over "
        f"the clean loss{f' ({clean:.3f})' if clean is not None else ''}; halves agree: the two halves of the "
        f"text pick the same best head. Tokens: {' × '.join(map(str, tok.get('held_out_natural', [])))}."
        + (
            " †: the head picked best on one half lost more on the other than the one picked worst: there the pick "
            "is noise (more held-out windows rank the heads)."
            if inverted
            else ""
        )
    )
    return table_tex(table, caption, tex_label(path, "per-layer"), "rrrrrrl")


ABLATE_TOP = 10
"""Heads per task in ablate's table (summary.json lists its top 10)."""


def ablate_tables(path: Path, summary: dict) -> dict[str, str]:
    """``top_heads``: per task the top :data:`ABLATE_TOP` heads by loss increase when ablated alone,
    with 95% CIs (``top_heads_by_loss_delta``, 3 decimals as ablate's terminal line), or an
    estimate's ``top_heads_by_estimate``; the tasks side by side.

    Raises:
        HeadprobeError: summary.json has neither list."""
    exact = summary.get("top_heads_by_loss_delta")
    tops = exact or summary.get("top_heads_by_estimate")
    if not tops:
        raise HeadprobeError(
            f"--format latex: {path}/summary.json has no top heads (top_heads_by_loss_delta) to tabulate"
        )
    n = max(min(len(v), ABLATE_TOP) for v in tops.values())
    what = "Δ loss [95% CI]" if exact else "estimated Δ loss"
    columns, data = [], {}
    for task, heads in tops.items():
        heads = heads[:ABLATE_TOP] + [None] * (n - min(len(heads), ABLATE_TOP))
        columns += [(task, "head"), (task, what)]
        data[(task, "head")] = ["" if e is None else str(e["head"]) for e in heads]
        data[(task, what)] = ["" if e is None else _ablate_cell(e, exact is not None) for e in heads]
    table = pd.DataFrame(data, columns=pd.MultiIndex.from_tuples(columns))
    table.insert(0, ("", "rank"), [str(i + 1) for i in range(n)])
    tok, clean = summary.get("tokens") or {}, summary.get("clean_loss") or {}
    how = (
        "mean over sequences with its 95% Student-t interval"
        if exact
        else f"an ESTIMATE, not an exact ablation ({(summary.get('estimate') or {}).get('description', '')})"
    )
    caption = (
        f"The heads of {_run_text(summary)} whose {summary.get('ablation')} ablation, one head at a time, most "
        f"raises the loss (nats/token), per task: the top {n}, {how}. Tokens: natural text "
        f"{' × '.join(map(str, tok.get('natural', [])))}, repeated random {' × '.join(map(str, tok.get('repeated', [])))} "
        f"(period {tok.get('period')}). Clean loss: "
        + ", ".join(f"{t} {v:.3f}" for t, v in clean.items())
        + " nats/token."
    )
    return {"top_heads": table_tex(table, caption, tex_label(path, "top-heads"), "r" + "ll" * len(tops))}


def _ablate_cell(entry: Mapping, exact: bool) -> str:
    """``+0.371 [+0.162, +0.580]`` (an exact sweep's Δ loss and CI) or ``+0.371`` (an estimate)."""
    if not exact:
        return f"{entry['estimate']:+.3f}"
    return f"{entry['loss_delta']:+.3f} {format_ci(entry.get('ci95'), '+.3f')}"


def kv_tables(path: Path, summary: dict) -> dict[str, str]:
    """``policies``: kv's report table: the full cache (the reference), the chosen policy, one window
    on every group and each random policy at the same memory: KV groups full, cache fraction, natural-loss
    Δ, copy accuracy, its drop (kv's :data:`~headprobe.analyses.vocabulary.KV_TABLE_DIGITS`) and
    long-range loss (3 decimals); each Δ and drop's 95% interval on the line below it (the full cache's: its
    copy accuracy's, :func:`_full_copy_ci`), the headers on two lines, the units, samples, interval methods
    and the report's paired differences in the caption (:func:`_kv_samples_caption`,
    :func:`_kv_differences_caption`), so that it fits a 397 pt text width (NeurIPS) in ``\\small`` with
    4 pt between columns (382 pt on the committed run).

    Raises:
        HeadprobeError: summary.json without the policies' rows."""
    if not all(isinstance(summary.get(k), dict) for k in ("full", "chosen", "uniform")):
        raise HeadprobeError(f"--format latex: {path}/summary.json has no full, chosen and uniform rows to tabulate")
    d, a = KV_TABLE_DIGITS["natural_loss_increase"], KV_TABLE_DIGITS["copy_accuracy"]
    full = {**summary["full"], "natural_loss_increase": 0.0, "copy_accuracy_ci95": _full_copy_ci(summary)}
    named = [("full", full), ("chosen", summary["chosen"])]
    named += [("uniform", summary["uniform"])]
    named += [(f"random {r.get('seed')}", r) for r in (summary.get("random") or {}).get("rows", [])]
    cells = [line for name, r in named for line in _kv_lines(name, r, d, a)]
    columns = [("", "policy"), ("full", "groups"), ("KV", "cache"), ("natural", "loss Δ")]
    columns += [("copy", "acc."), ("copy", "drop"), ("long-range", "loss")]
    table = pd.DataFrame(cells, columns=pd.MultiIndex.from_tuples(columns))
    cfg = summary.get("config") or {}
    caption = (
        f"KV-cache policies of {_run_text(summary)} at "
        f"{summary.get('seq_len')} tokens: {str(summary.get('unit')).replace('_', ' ')}s chosen by {summary.get('method')} ranking "
        f"(target {', '.join(f'{k} {v}' for k, v in (summary.get('target') or {}).items())}) keep a full cache, the "
        f"rest stream (sink {summary.get('sink')} + window {summary.get('window')}); against the full cache, one "
        f"window on every group (uniform) and random groups at the same memory. Full groups: KV groups that keep "
        f"a full cache; KV cache: fraction of the full cache's bytes. Natural loss Δ: the natural text's loss "
        f"increase over the full cache in nats/token; copy acc.: top-1 on a random block planted "
        f"{', '.join(map(str, cfg.get('distances') or []))} tokens before its repeat, its drop against the full "
        f"cache; long-range loss: nats/token on that block. Below each loss Δ and drop: its 95% paired interval; "
        f"below the full cache's copy accuracy: its 95% interval over the sequences. {_kv_samples_caption(summary)} "
        f"{_kv_differences_caption(summary, d, a)} Text: {(summary.get('sources') or {}).get('natural')}."
    )
    text = table_tex(table, caption, tex_label(path, "policies"), "lrrcrcr", small=True)
    # 4 pt between columns (6 by default): the full cache's copy-accuracy interval widens its column
    return {"policies": text.replace("\n\\begin{tabular}", "\n\\setlength{\\tabcolsep}{4pt}\n\\begin{tabular}", 1)}


def _kv_lines(name: str, r: Mapping, d: int, a: int) -> list[list[str]]:
    """One policy's lines of kv's table: ``r`` (summary.json's policy row) at ``d`` (loss) and ``a``
    (accuracy) decimals, then its loss Δ and drop intervals under them (empty cells elsewhere); the
    full cache, the reference, without drop: under its copy accuracy the interval of the accuracy itself
    (``copy_accuracy_ci95``, :func:`_full_copy_ci`)."""
    ref = name == "full"
    values = [
        name,
        "all" if ref else str(r.get("n_full_groups")),
        f"{1.0 if ref else r.get('kv_fraction'):.3f}",
        f"{r['natural_loss_increase']:.{d}f}",
        f"{r['copy_accuracy']:.{a}f}",
        "-" if ref else f"{r.get('copy_accuracy_drop'):+.{a}f}",
        f"{r['long_range_loss']:.3f}",
    ]
    if ref:
        return [values, ["", "", "", "", format_ci(r.get("copy_accuracy_ci95"), f".{a}f"), "", ""]]

    def ci(key: str, spec: str) -> str:
        nan = float("nan")  # no interval: [n/a]
        return format_ci([r.get(f"{key}_ci95_lo", nan), r.get(f"{key}_ci95_hi", nan)], spec)

    return [values, ["", "", "", ci("natural_loss_increase", f"+.{d}f"), "", ci("copy_accuracy_drop", f"+.{a}f"), ""]]


def _full_copy_ci(summary: Mapping) -> list[float] | None:
    """The full cache's copy accuracy's 95% interval over the long-range sequences: summary.json's
    ``full.copy_accuracy_ci95`` (runs since it was written); for an older run whose distances each
    have one sequence (``n_sequences`` 1), ``full.per_distance``'s accuracies are the sequences' own,
    and the interval is kv's rule over them (:func:`~headprobe.analyses.statistics.bounded_mean_ci`
    in [0, 1], as the run computes it); else None (``[n/a]``)."""
    from headprobe.analyses.statistics import MIN_N_FOR_CI, bounded_mean_ci

    full = summary.get("full") or {}
    if "copy_accuracy_ci95" in full:
        return full["copy_accuracy_ci95"]
    per = list((full.get("per_distance") or {}).values())
    if len(per) < MIN_N_FOR_CI or any(p.get("n_sequences") != 1 for p in per):
        return None
    return [float(x) for x in bounded_mean_ci([p["accuracy"] for p in per], 0.0, 1.0)]


def _interval_method(summary: Mapping, key: str) -> str:
    """The method of summary.json's ``definitions.intervals[key]`` as the run names it, up to "of the
    mean" (``95% percentile block bootstrap``, ``95% Student-t interval``); "n/a" where it has none."""
    rule = str(((summary.get("definitions") or {}).get("intervals") or {}).get(key) or "n/a")
    return rule.split(" of the mean")[0]


def _kv_samples_caption(summary: Mapping) -> str:
    """kv's caption on its samples and interval methods (:func:`~headprobe.analyses.vocabulary.kv_sample_text`,
    summary.json's ``definitions.intervals``) and on the intervals it could not make."""
    n = kv_sample_sizes(summary)
    why = summary.get("interval_null_reasons") or {}
    none = "".join(
        f" No {k.replace('_', ' ')} interval: {why[k]}." for k in ("natural_loss", "copy_accuracy") if k in why
    )
    one = (
        " With one window the natural-loss interval is that window's token noise, not the spread from text to text."
        if n["natural_windows"] == 1
        else ""
    )
    return (
        f"Samples: {kv_sample_text(summary)}. Intervals: natural loss by a "
        f"{_interval_method(summary, 'natural_loss')} over the tokens, paired by token; copy accuracy by a "
        f"{_interval_method(summary, 'copy_accuracy')} over the {n['copy_sequences']} sequences (the unit: a "
        f"sequence's copied tokens succeed or fail together; an exact bound where all agree), paired by "
        f"sequence.{one}{none}"
    )


def _kv_differences_caption(summary: Mapping, d: int, a: int) -> str:
    """kv's caption on the chosen policy against uniform and the random mean: summary.json's
    ``chosen_minus_*`` (the report's numbers, at its digits) with their 95% intervals and verdicts."""
    parts = []
    for key, name in (("chosen_minus_uniform", "uniform"), ("chosen_minus_random_mean", "the random policies' mean")):
        c = summary.get(key)
        if not c:
            continue
        nat, acc = c.get("natural_loss", float("nan")), c.get("copy_accuracy", float("nan"))
        parts.append(
            f"chosen minus {name}: natural loss {nat:+.{d}f} {format_ci(c.get('natural_loss_ci95'), f'+.{d}f')} "
            f"nats/token, copy accuracy {acc:+.{a}f} {format_ci(c.get('copy_accuracy_ci95'), f'+.{a}f')}: "
            f"{c.get('verdict')}"
        )
    if not parts:
        return ""
    return (
        "Paired differences (lower loss and higher accuracy are better; an interval that covers 0 cannot tell "
        f"the two apart at this sample size): {'; '.join(parts)}."
    )


CIRCUIT_TOP = 10
"""Edges in circuit's table, as its terminal report lists (summary.json's ``top_edges``)."""


def circuit_tables(path: Path, summary: dict) -> dict[str, str]:
    """``edges``: circuit's largest edges (its report's list): edge, attribution score and, where
    path patching checked it, the exact effect (4 decimals each, as the report).

    Raises:
        HeadprobeError: summary.json without ``top_edges``."""
    top = (summary.get("top_edges") or [])[:CIRCUIT_TOP]
    if not top:
        raise HeadprobeError(f"--format latex: {path}/summary.json has no top_edges to tabulate")
    table = pd.DataFrame(
        [
            [str(i + 1), str(t["edge"]), f"{t['score']:+.4f}", "-" if t.get("exact") is None else f"{t['exact']:+.4f}"]
            for i, t in enumerate(top)
        ],
        columns=["rank", "edge", "score", "exact"],
    )
    ag = summary.get("agreement") or {}
    said = {k: "n/a" if ag.get(k) is None else format(ag[k], ".3f") for k in ("spearman", "pearson", "top_k_recall")}
    agree = (
        f" Scores against exact path patching on {ag.get('n_edges')} edges: Spearman {said['spearman']}, "
        f"Pearson {said['pearson']}, top-{ag.get('top_k')} recall {said['top_k_recall']}."
        if ag
        else ""
    )
    caption = (
        f"The largest of the {summary.get('n_edges')} head-to-head and head-to-logits edges of {_run_text(summary)} "
        f"scored by {summary.get('method')} ({summary.get('steps')} steps; receiver:q/k/v "
        f"names the input the edge writes to). Task: {summary.get('task')}; metric: {summary.get('metric')}; clean "
        f"loss {summary.get('clean_loss'):.3f} nats/token. Exact: the edge's direct-path patching effect "
        f"(nats/token), where checked.{agree}"
    )
    return {"edges": table_tex(table, caption, tex_label(path, "edges"), "rlrr")}


PATH_PATCHING_TOP = 5
"""Senders per receiver in circuit's path_patching table, as its terminal report lists them."""


def path_patching_tables(path: Path, summary: dict) -> dict[str, str]:
    """``path_patching``: a circuit run's ``--receivers`` sweep, path_patching.csv's first
    :data:`PATH_PATCHING_TOP` rows per receiver (largest effect first, as the report): receiver (named
    on its first row), sender, exact effect and the edge's attribution score (nats/token, 4 decimals
    each); none without the CSV (a run without --receivers)."""
    csv = path / "path_patching.csv"
    if not csv.is_file():
        return {}
    sweep = pd.read_csv(csv, dtype={"receiver": str, "sender": str})
    top = sweep.groupby("receiver", sort=False).head(PATH_PATCHING_TOP)
    first = top["receiver"] != top["receiver"].shift()
    cell = lambda x: "-" if pd.isna(x) else f"{x:+.4f}"
    table = pd.DataFrame(
        [
            [r if f else "", s, cell(e), cell(c)]
            for r, s, e, c, f in zip(top["receiver"], top["sender"], top["effect"], top["score"], first)
        ],
        columns=["receiver", "sender", "effect", "score"],
    )
    sizes = ", ".join(f"{r} ({n})" for r, n in sweep.groupby("receiver", sort=False).size().items())
    caption = (
        f"Direct-path patching into each receiver of {_run_text(summary)}: the {PATH_PATCHING_TOP} senders of largest effect among every earlier "
        f"head patched into each (receiver:q/k/v names the input; senders patched: {sizes}; all in "
        f"path_patching.csv). Effect: the metric's change (nats/token) when only the sender's corrupted minus clean "
        f"output reaches the receiver's input; score: the edge's {summary.get('method')} attribution "
        f"({summary.get('steps')} steps), an estimate of the effect in the same units. Task: {summary.get('task')}; "
        f"metric: {summary.get('metric')}; clean loss {summary.get('clean_loss'):.3f} nats/token."
    )
    return {"path_patching": table_tex(table, caption, tex_label(path, "path_patching"), "llrr")}


def circuit_all_tables(path: Path, summary: dict) -> dict[str, str]:
    """A circuit folder's tables: :func:`circuit_tables`' ``edges`` and :func:`path_patching_tables`'."""
    return {**circuit_tables(path, summary), **path_patching_tables(path, summary)}


STUDY_COLUMNS = (
    "variant", "n_heads", "seed", "corpus", "eval_loss", "in_context_loss", "max_induction",
    "kv_bytes_per_token", "attn_params_per_layer",
)  # fmt: skip
"""The results.csv columns the study table reads."""

_CORPORA = {
    "text+copy": "CPython documentation text at character level, {copy}% of every batch copy sequences over the same characters",
    "copy": "random-token copy sequences only",
}
"""What a study's ``--corpus`` trains on (docs/study.md), for the caption."""


def study_tables(path: Path, summary: dict) -> dict[str, str]:
    """``study``: a ``headprobe study`` run's comparison, one row per variant in results.csv's order:
    heads (study heads) or variant (study layouts), KV cache bytes per token, attention parameters per
    layer, held-out and in-context loss as the mean over seeds with their ``[min, max]`` on the line
    below (a variant of one seed: the mean alone), the mean top induction
    score and whether induction formed in every seed; the numbers of
    :func:`~headprobe.analyses.study_table.variant_stats` and
    :func:`~headprobe.analyses.study_table.formed_in_every_seed` (the terminal report's and the
    figure's), at the report's 3 decimals; the models, training and data in the caption (study.json).

    Raises:
        HeadprobeError: results.csv missing, cut, empty or without a column the table reads."""
    from headprobe.analyses.study_table import REPORT_DIGITS, formed_in_every_seed, variant_stats

    table = _study_results(path)
    stats, formed = variant_stats(table), formed_in_every_seed(table)
    d, heads = REPORT_DIGITS, summary.get("which") == "heads"
    first = table.groupby("variant", sort=False)["n_heads"].first()
    cells = []
    for v, r in stats.iterrows():
        cells.append(
            [
                str(first[v]) if heads else str(v),
                f"{r['kv_bytes_per_token']:g}",
                f"{int(r['attn_params_per_layer']):,}",
                f"{r['eval_loss']:.{d}f}",
                f"{r['in_context_loss']:.{d}f}",
                f"{r['max_induction']:.{d}f}",
                "yes" if formed[v] else "no",
            ]
        )
        if r["n_seeds"] > 1:  # the seeds' range on the line below the mean (a page's width: docs/export.md)
            ranges = [f"[{r[f'{c}_min']:.{d}f}, {r[f'{c}_max']:.{d}f}]" for c in ("eval_loss", "in_context_loss")]
            cells.append(["", "", "", *ranges, "", ""])
    columns = [("", "heads" if heads else "variant"), ("KV cache", "B/token"), ("attn.", "params")]
    columns += [("loss", "held-out"), ("loss", "in-context"), ("induction", "max"), ("induction", "formed")]
    out = pd.DataFrame(cells, columns=pd.MultiIndex.from_tuples(columns))
    caption = _study_caption(summary, table, stats)
    align = ("r" if heads else "l") + "rrccrc"
    return {"study": table_tex(out, caption, tex_label(path, "study"), align, small=True)}


def _study_results(path: Path) -> pd.DataFrame:
    """A study folder's results.csv (one row per variant and seed), the :data:`STUDY_COLUMNS` checked.

    Raises:
        HeadprobeError: missing, unreadable, cut, empty or lacking a column."""
    return _run_table(
        path / "results.csv",
        "a study's results table",
        STUDY_COLUMNS,
        "no rows",
        "study's results.csv",
        dtype={"variant": str, "corpus": str},
    )


def _run_table(
    file: Path,
    what: str,
    columns: Sequence[str],
    no_rows: str,
    run: str,
    rows: Callable[[pd.DataFrame], pd.DataFrame] | None = None,
    **read_csv: Any,
) -> pd.DataFrame:
    """A run's CSV ``file`` (``read_csv``: pandas' keywords) with ``columns`` checked and, where it has
    them, the ``rows`` its table reads kept.

    Raises:
        HeadprobeError: missing, unreadable or cut (``cannot read <file> as <what>``), lacking a column
            or without rows (``no_rows``): not a finished headprobe ``run``."""
    try:
        table = pd.read_csv(file, **read_csv)
    except (OSError, UnicodeDecodeError, ValueError, pd.errors.EmptyDataError, pd.errors.ParserError) as err:
        why = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise HeadprobeError(f"--format latex: cannot read {file} as {what}: {why}") from None
    missing = [c for c in columns if c not in table.columns]
    if not missing and rows is not None:
        table = rows(table)
    if missing or table.empty:
        raise HeadprobeError(
            f"--format latex: {file} has {no_rows if not missing else 'no column ' + ', '.join(missing)}: "
            f"not a finished headprobe {run}"
        )
    return table


def _study_caption(summary: dict, table: pd.DataFrame, stats: pd.DataFrame) -> str:
    """The study table's caption: what each column is and its units, then the models (study.json's
    ``base``: layers, d_model, positions, heads; no one model: a study trains many), training (steps,
    batch, lr, seeds), data and device."""
    from headprobe.analyses.study_table import formed_column

    base, which = summary.get("base") or {}, summary.get("which")
    seeds = summary.get("seeds") or sorted(table["seed"].unique().tolist())
    n = int(stats["n_seeds"].max())
    corpus = str(base.get("corpus") or table["corpus"].iloc[0])
    copy = base.get("copy_fraction")
    data = _CORPORA.get(corpus, corpus).format(copy=f"{100 * copy:g}" if isinstance(copy, int | float) else "?")
    unit = "nats/char" if corpus == "text+copy" else "nats/token"
    over = f"the mean over {n} seeds, their [min, max] on the line below" if n > 1 else "one seed"
    if which == "heads":
        grid = f"the width split into {', '.join(map(str, summary.get('n_heads_list') or _first_heads(table)))} heads (MHA)"
    else:
        variants = [str(v) for v in stats.index]  # the variants this run trained, in its order
        mla = any(v.startswith("MLA") for v in variants)
        grid = f"{base.get('n_heads')} query heads as {', '.join(variants)}" + (
            f" (MLA r: latent rank; decoupled rotary key {summary.get('rope')} wide)" if mla else ""
        )
    formed_by = "lower 95% bound" if formed_column(table) == "induction_ci95_low" else "score"
    return (
        f"headprobe study {which}: {base.get('n_layers')}-layer attention-only transformers of d_model "
        f"{base.get('d_model')} ({base.get('positional')} positions, {'biases' if base.get('bias') else 'no biases'}), "
        f"{grid}, each trained {base.get('steps')} steps (batch {base.get('batch_size')} × {base.get('seq_len')} "
        f"tokens, AdamW lr {base.get('lr')}) once per seed ({'seeds' if len(seeds) > 1 else 'seed'} {', '.join(map(str, seeds))}) on {corpus}: {data}; "
        f"device {summary.get('device')}. KV cache: bytes per token over all layers at bf16; attn. params: "
        f"attention parameters per layer. Held-out loss: {unit} on {base.get('n_eval')} held-out "
        f"{'text windows' if corpus == 'text+copy' else 'sequences'}; in-context loss: late minus early loss on "
        f"held-out copy sequences (nats/token; about -4.5 once induction heads work, near 0 before); each is {over}. "
        f"Induction max: the top induction score (repeated block of {base.get('eval_period')})"
        f"{', mean over seeds' if n > 1 else ''}; "
        f"formed: the top induction head's {formed_by} above 0.5 in every seed."
    )


def _first_heads(table: pd.DataFrame) -> list[int]:
    """The head counts of a heads study's variants, in results.csv's order."""
    return [int(h) for h in table.groupby("variant", sort=False)["n_heads"].first()]


TRAIN_ROWS = 21
"""The most evaluations train's table shows: a longer log is sampled evenly (first and last kept, and
the two evaluations around the phase change); the caption says which."""


def train_tables(path: Path, summary: dict) -> dict[str, str]:
    """``training``: a ``headprobe train`` run's evaluations from train_log.csv, one row a step:
    held-out loss, in-context loss with its 95% interval over the held-out copy sequences, the top
    induction score with its 95% lower bound and the top previous-token score (training.png's
    curves, 3 decimals, the closing line's rounding); at most :data:`TRAIN_ROWS` rows. The model,
    data, phase change and the rules in the caption (summary.json).

    Raises:
        HeadprobeError: train_log.csv missing, unreadable, empty or without a column the table reads."""
    log = _train_log(path)
    steps = _train_rows(log["step"].tolist(), summary.get("phase_change_between") or [])
    rows = log.set_index("step").loc[steps]
    has_ci = {"in_context_loss_ci95_low", "in_context_loss_ci95_high"} <= set(log.columns)
    has_low = "top_induction_ci95_low" in log.columns
    cells = []
    for step, r in rows.iterrows():
        ci = (
            " " + format_interval(r["in_context_loss_ci95_low"], r["in_context_loss_ci95_high"], ".3f")
            if has_ci
            else ""
        )
        low = f" ({r['top_induction_ci95_low']:.3f})" if has_low else ""
        cells.append(
            [
                f"{int(step):,}",
                f"{r['eval_loss']:.3f}",
                f"{r['in_context_loss']:.3f}{ci}",
                f"{r['max_induction']:.3f}{low}",
                f"{r['max_previous_token']:.3f}",
            ]
        )
    columns = ["step", "held-out loss", "in-context loss" + (" [95% CI]" if has_ci else "")]
    columns += ["induction" + (" (95% low)" if has_low else ""), "previous-token"]
    table = pd.DataFrame(cells, columns=columns)
    return {
        "training": table_tex(table, _train_caption(summary, len(log), steps), tex_label(path, "training"), "rrlll")
    }


TRAIN_COLUMNS = ("step", "eval_loss", "in_context_loss", "max_induction", "max_previous_token")
"""The train_log.csv columns the training table reads (the intervals where the log has them)."""


def _train_log(path: Path) -> pd.DataFrame:
    """A train folder's train_log.csv, its evaluation rows (``eval_loss`` given), :data:`TRAIN_COLUMNS` checked.

    Raises:
        HeadprobeError: missing, unreadable, cut, without evaluations or lacking a column."""
    return _run_table(
        path / "train_log.csv",
        "a training log",
        TRAIN_COLUMNS,
        "no evaluation rows",
        "train run's log",
        rows=lambda log: log.dropna(subset=["eval_loss"]),
    )


def _train_rows(steps: list[int], around: list[int]) -> list[int]:
    """The evaluation steps the training table shows: all of ``steps`` up to :data:`TRAIN_ROWS`, else
    an even sample with the first, the last and the phase change's two evaluations (``around``)."""
    if len(steps) <= TRAIN_ROWS:
        return steps
    picks = {steps[round(i * (len(steps) - 1) / (TRAIN_ROWS - 3))] for i in range(TRAIN_ROWS - 2)}
    return sorted(picks | {s for s in around if s in steps})


def _train_caption(summary: dict, n_evaluations: int, steps: list[int]) -> str:
    """The training table's caption: the run, model and data, what each column is, the rules of
    induction formed and the phase change, and the rows shown of ``n_evaluations``."""
    cfg = summary.get("config") or {}
    shown = "" if len(steps) == n_evaluations else f" ({len(steps)} of its {n_evaluations} evaluations, evenly spaced)"
    phase = summary.get("phase_change_between")
    caption = (
        f"Training of {_run_text(summary)}: {summary.get('layout')}, {cfg.get('n_layers')} layers, d_model "
        f"{cfg.get('d_model')}, {cfg.get('n_heads')} heads, {summary.get('n_params', 0):,} parameters; "
        f"{cfg.get('steps')} steps of batch {cfg.get('batch_size')} on {cfg.get('corpus')} data, evaluated every "
        f"{summary.get('eval_every')} steps{shown}. Losses in nats/token (chance ln {cfg.get('n_words')} = "
        f"{summary.get('chance_loss_nats')}); in-context loss: a held-out sequence's loss late in the context minus "
        f"early, mean over {cfg.get('n_eval')} sequences with the 95% Student-t interval. Induction and previous-token: "
        f"the top head's score on {cfg.get('n_eval')} repeated random sequences (period {cfg.get('eval_period')}), "
        "the induction score's 95% lower bound in parentheses. "
    )
    formed = summary.get("first_step_induction_formed")
    caption += (
        f"Induction formed (lower bound above 0.5) first at step {formed}"
        if formed is not None
        else ("Induction did not form (lower bound above 0.5 at no evaluation)")
    )
    return caption + (f"; phase change between steps {phase[0]} and {phase[1]}." if phase else ".")


BUILDERS = {
    "scan": scan_tables,
    "prune": prune_tables,
    "ablate": ablate_tables,
    "kv": kv_tables,
    "circuit": circuit_all_tables,
    "study": study_tables,
    "train": train_tables,
}
"""The source kinds ``--format latex`` writes tables of, and each one's tables."""


def has_tables(kind: str, summary: Mapping) -> bool:
    """Whether a ``kind`` run with ``summary`` has a table :func:`latex_files` writes (``all`` leaves
    LaTeX out where not: a scan with --no-verify)."""
    keys = {
        "scan": ("ablations",),
        "prune": ("curves", "per_layer"),
        "ablate": ("top_heads_by_loss_delta", "top_heads_by_estimate"),
        "kv": ("chosen",),
        "circuit": ("top_edges",),
        "study": ("per_variant",),
        "train": ("final",),
    }
    return any(summary.get(k) for k in keys.get(kind, ()))


def latex_files(kind: str, path: Path, summary: dict) -> tuple[dict[str, str], str]:
    """``({"latex/<table>.tex": text}, how)`` for a ``kind`` folder at ``path`` with ``summary``.

    Raises:
        HeadprobeError: a kind without tables, or a run without the rows its tables need."""
    if kind not in BUILDERS:
        raise HeadprobeError(f"--format latex needs a {', '.join(BUILDERS)} folder; {path} is a {kind} run")
    tables = BUILDERS[kind](path, summary)
    files = {f"latex/{name}.tex": text for name, text in tables.items()}
    return files, f"booktabs tables ({', '.join(tables)}), one .tex each, for \\input (needs \\usepackage{{booktabs}})"
