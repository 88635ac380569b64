"""Whether two runs of the same command on the same settings (another device, dtype or thread count)
gave the same results: a committed run against a new one.

    python benchmarks/same_results.py scan figures/smollm2-135m  gpu/scan     # the demo on CUDA
    python benchmarks/same_results.py prune figures/smollm2-135m-prune gpu/prune

``scan``: the verdicts (``confirmed``), and per test (head type, ablation kind, task) the top-k heads,
the control sets drawn (``random_heads``, in order), the number of draws, the p-value, the adjusted
p-value and the stop reason must be equal; the effects (top-k and every control set's, nats/token)
and head_scores.csv's scores (paired by layer and head; both runs must have the same heads of the same
model) may differ by rounding: their largest differences are printed.
``prune``: per curve (method and seed) the heads removed at each step, as sets; the first step where
they part, the cut's margin there in each run (``margin``, michel only, where recorded: near 0 the
step was a near-tie) and the losses there; the largest loss difference before it.
The last line sums up (``same_results kind=... equal=yes|no ...``); exit status 0 when equal, 1 when
not, 2 on unreadable input.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import pandas as pd

EXACT = ("top_heads", "random_heads", "draws", "p_value", "p_adjusted", "stop_reason", "confirmed")
"""Per test, what must be equal on every device."""


def _summary(folder: Path) -> dict:
    return json.loads((folder / "summary.json").read_text(encoding="utf-8"))


def _max_diff(a, b) -> float:
    """The largest |a - b| over paired numbers (NaN paired with NaN counts 0)."""
    pairs = [(x, y) for x, y in zip(a, b, strict=False) if x is not None and y is not None]
    return max((0.0 if math.isnan(x) and math.isnan(y) else abs(x - y) for x, y in pairs), default=0.0)


def compare_scan(a: Path, b: Path) -> tuple[bool, list[str]]:
    """``(equal, lines)`` for two scan folders (see the module docstring)."""
    sa, sb = _summary(a), _summary(b)
    lines, equal = [], sa.get("confirmed") == sb.get("confirmed")
    lines.append(f"verdicts: {sa.get('confirmed')}" + ("" if equal else f" vs {sb.get('confirmed')}"))
    rows_b = {(r["head_type"], r["kind"], r["task"]): r for r in sb.get("ablations", [])}
    effect = 0.0
    for ra in sa.get("ablations", []):
        key = (ra["head_type"], ra["kind"], ra["task"])
        rb = rows_b.pop(key, None)
        if rb is None:
            equal = False
            lines.append(f"{'/'.join(key)}: missing in {b}")
            continue
        differ = [k for k in EXACT if ra.get(k) != rb.get(k)]
        effect = max(
            effect,
            _max_diff([ra["top_effect"], *ra["random_effects"]], [rb["top_effect"], *rb["random_effects"]]),
        )
        if differ:
            equal = False
            lines.append(f"{'/'.join(key)}: differ in {', '.join(differ)}")
    if rows_b:
        equal = False
        lines.append(f"only in {b}: {', '.join('/'.join(k) for k in rows_b)}")
    if sa.get("model") != sb.get("model"):
        equal = False
        lines.append(f"models differ: {sa.get('model')} vs {sb.get('model')}")
    ta, tb = (pd.read_csv(d / "head_scores.csv").set_index(["layer", "head"]) for d in (a, b))
    if set(ta.index) != set(tb.index):  # scores are paired by head, in any row order
        equal = False
        lines.append(f"head_scores.csv: {len(ta)} heads vs {len(tb)}, {len(ta.index.intersection(tb.index))} in both")
    both = ta.index.intersection(tb.index)
    cols = [c for c in ta.columns if c in tb.columns and pd.api.types.is_numeric_dtype(ta[c])]
    score = (ta.loc[both, cols] - tb.loc[both, cols]).abs().max().fillna(0.0)
    lines.append(f"largest effect difference {effect:.3g} nats/token")
    lines.append(f"largest head-score difference {score.max():.3g} ({score.idxmax()}, heads in both)")
    tail = f"max_effect_diff={effect:.3g} max_score_diff={score.max():.3g}"
    return equal, [*lines, f"same_results kind=scan equal={'yes' if equal else 'no'} {tail}"]


def _steps(table: pd.DataFrame) -> dict[tuple[str, str], list[pd.Series]]:
    curves: dict[tuple[str, str], list[pd.Series]] = {}
    table = table.rename(columns={"order": "method", "induction_loss": "repeated_loss"})  # older runs' names
    table["method"] = table["method"].replace({"importance": "michel"})
    if "seed" not in table:
        table["seed"] = [0 if m == "random" else None for m in table["method"]]
    for _, row in table.sort_values("step", kind="stable").iterrows():
        seed = "" if pd.isna(row["seed"]) else str(int(row["seed"]))
        curves.setdefault((str(row["method"]), seed), []).append(row)
    return curves


def compare_prune(a: Path, b: Path) -> tuple[bool, list[str]]:
    """``(equal, lines)`` for two prune folders (see the module docstring)."""
    ca, cb = (_steps(pd.read_csv(d / "pruning_curve.csv", dtype={"removed": str})) for d in (a, b))
    equal, lines = True, []
    losses = ["natural_loss", "repeated_loss"]
    for key, steps_a in ca.items():
        steps_b, name = cb.get(key, []), ":".join(k for k in key if k)
        before, parted = 0.0, None
        for sa, sb in zip(steps_a, steps_b, strict=False):
            if set(str(sa["removed"]).split()) != set(str(sb["removed"]).split()):
                parted = (sa, sb)
                break
            before = max(before, *(abs(float(sa[c]) - float(sb[c])) for c in losses))
        if parted is None and len(steps_a) == len(steps_b):
            lines.append(f"{name}: same heads at every step; largest loss difference {before:.3g} nats/token")
            continue
        equal = False
        if parted is None:
            lines.append(f"{name}: {len(steps_a)} steps vs {len(steps_b)}")
            continue
        sa, sb = parted
        margins = " vs ".join(
            "n/a" if "margin" not in s or pd.isna(s["margin"]) else f"{float(s['margin']):.3g}" for s in (sa, sb)
        )
        lines.append(
            f"{name}: parts at step {int(sa['step'])} ({float(sa['fraction_pruned']):.0%} removed); cut margin "
            f"{margins}; losses there {float(sa['natural_loss']):.4f}/{float(sa['repeated_loss']):.4f} vs "
            f"{float(sb['natural_loss']):.4f}/{float(sb['repeated_loss']):.4f} (natural/repeated); largest loss "
            f"difference before {before:.3g}"
        )
    if set(cb) - set(ca):
        equal = False
        lines.append(f"only in {b}: {', '.join(':'.join(k for k in key if k) for key in set(cb) - set(ca))}")
    return equal, [*lines, f"same_results kind=prune equal={'yes' if equal else 'no'}"]


def describe_run(d: Path) -> str:
    """One line on what made a run: its device and hardware, dtype, TF32 and torch version (summary.json)."""
    s = json.loads((d / "summary.json").read_text())
    tf32 = {None: "", True: ", TF32 on", False: ", TF32 off"}[s.get("tf32")]
    return (
        f"{d}: {s.get('device')} ({s.get('device_name') or 'hardware not recorded'}), "
        f"{s.get('config', {}).get('dtype', s.get('dtype'))}{tf32}, torch {s.get('versions', {}).get('torch')}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("kind", choices=("scan", "prune"))
    p.add_argument("a", type=Path, help="the reference run's folder (e.g. the committed one)")
    p.add_argument("b", type=Path, help="the run compared with it")
    args = p.parse_args(argv)
    for d in (args.a, args.b):
        if not (d / "summary.json").is_file():
            print(f"same_results: {d} holds no summary.json (not a finished run)", file=sys.stderr)
            return 2
    try:
        equal, lines = (compare_scan if args.kind == "scan" else compare_prune)(args.a, args.b)
    except (OSError, ValueError, KeyError) as err:  # a cut or foreign file: one line
        print(f"same_results: cannot read {args.a} and {args.b} as {args.kind} runs: {err!r}", file=sys.stderr)
        return 2
    print("\n".join([describe_run(args.a), describe_run(args.b), *lines]))
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
