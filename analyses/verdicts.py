"""How a verdict's p-value and stopping are said in words, the same on the terminal, in
ablation.caption.txt, on ablation.png and in the viewer (torch-free: rows are
:class:`~headprobe.analyses.ablation.Verification` dicts, as in summary.json's ``ablations``).

A curtailed test's p-value is a bound (the largest p its rule could still have given, a valid
p-value) and the full test's p would have been between the smallest it could still reach and that
bound, so it is written ``p in [0.059, 0.75]`` with why the test stopped, never as a plain
``p = 0.75``.
"""

from __future__ import annotations

from collections.abc import Mapping

CORRECTION_NAMES = {"bh": "BH", "holm": "Holm"}
"""Short names of the corrections in verdict texts."""


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
    untested row): ``stopped: cannot reach alpha after BH`` or ``stopped: settled above alpha``."""
    reason = row.get("stop_reason")
    if reason == "futile under the correction":
        return f"stopped: cannot reach alpha after {CORRECTION_NAMES.get(row.get('correction') or '', row.get('correction'))}"
    if reason == "settled above alpha":
        return "stopped: settled above alpha"
    return None


def reached_text(row: Mapping) -> str:
    """``0 of 2 control sets reached the effect``."""
    g = row.get("exceedances")
    n = row.get("draws", len(row.get("random_effects", [])))
    if g is None:
        return f"{n} control sets"
    return f"{g} of {n} control set{'' if n == 1 else 's'} reached the effect"


def evidence_text(row: Mapping, digits: int = 3) -> str:
    """The p-value with how its test ended: ``p in [0.059, 0.75] (stopped: cannot reach alpha after BH;
    1 of 2 control sets reached the effect)`` or ``p = 0.0196 (0 of 50 control sets reached the effect)``."""
    why = stop_text(row)
    return f"{p_text(row, digits)} ({why + '; ' if why else ''}{reached_text(row)})"
