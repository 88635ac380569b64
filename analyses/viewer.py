"""The interactive head viewer: one self-contained HTML page (``index.html``) over a scan's or an
ablate run's outputs, and the attention patterns it shows (``patterns.npz``).

The page needs no network: its JavaScript and CSS are inline (``viewer_template.html``, shipped as
package data), its data sit in a ``<script type="application/json">`` tag, and a
Content-Security-Policy forbids every fetch. It shows the layer x head score maps (GQA groups
marked), a clicked head's attention pattern on a ``<canvas>`` with the real tokens on both axes,
and a sortable table of every head. Pure functions, arrays in, text out; no model needed except by
:func:`head_patterns`, which computes the patterns a scan saves.

Pattern storage (``patterns.npz``, :func:`save_patterns`): for each example (``natural``: the first
natural-text sequence of the scan; ``repeated``: the first repeated-random-token sequence,
``[BOS] r_1..r_S r_1..r_S``) the token ids ``[pos]``, their labels ``[pos]`` and every head's
pattern ``[layer, head, q_pos, k_pos]``, cut to the first ``max_len`` tokens
(:data:`DEFAULT_PATTERN_LEN`), quantised to uint8 ``round(255 p)`` of a float16 copy (a weight within 1/510 + 2^-12, about
0.0022, of the model's; float16 on request, 5x larger). In the page the same uint8 array is deflate-compressed
and base64-encoded; the browser inflates it with its built-in ``DecompressionStream``. Sizes for
SmolLM2-135M (270 heads, 128 + 101 tokens): patterns.npz 1.3 MB, index.html 1.7 MB.
"""

from __future__ import annotations

import base64
import html
import re
import zipfile
import zlib
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

if TYPE_CHECKING:
    from headprobe.probe.backends.base import LoadedModel

from headprobe.analyses.columns import of_an_encoder
from headprobe.analyses.verdicts import LABELS, NOT_TESTED, UNITS, VerdictRule, evidence_text, label, stop_text
from headprobe.analyses.vocabulary import DEFAULT_PATTERN_LEN

"""Tokens per example kept in ``patterns.npz`` by default: the scan's natural-text sequence
length, and more than the repeated example's ``1 + 2 * 50``. 30 layers x 9 heads of SmolLM2 at
128 tokens take 4.4 MB as uint8 before compression (causal patterns are half zeros)."""

EXAMPLE_LABELS = {"natural": "the natural-text example", "repeated": "the repeated-random-token example"}
"""How the page names an example's pattern ("Head 18.6 on ..."), unless the example carries its
own ``label`` (``headprobe show``: the user's prompt)."""

_ID_COLUMNS = ("layer", "head", "kv_head")
VERDICT_DIGITS = 6
"""Decimals the page's data keeps of a verdict's numbers. The page shows 3 (2 on the map's
tooltip): kept to 4, an adjusted p of 0.076531 became 0.0765 and then showed as 0.076 (a rounding
of a rounding); kept to 6, every shown digit is the value's own."""


def _round(x: Any, digits: int = 5) -> float | None:
    """``x`` rounded, or None (JSON null) where it is missing: None, NaN, +-Inf or pandas' ``NA``
    (a removed head's cell in a nullable ``Int64`` column of a pruned model's scan)."""
    return None if x is None or pd.isna(x) or not np.isfinite(x) else round(float(x), digits)


# ----------------------------------------------------------------------------- patterns


def head_patterns(
    model: LoadedModel, examples: Mapping[str, Any], max_len: int = DEFAULT_PATTERN_LEN
) -> dict[str, dict]:
    """Every head's attention pattern on the first sequence of each token set, for the viewer.

    Args:
        model: a :class:`~headprobe.probe.backends.loading.LoadedModel` (either backend).
        examples: example name (``natural``, ``repeated``) -> :class:`~headprobe.analyses.data.TokenSet`.
        max_len: keep the first ``max_len`` tokens (>= 2) of each sequence.

    Returns:
        name -> ``{"ids": int32 [pos], "labels": [pos] str, "pattern": float16 [layer, head, q_pos, k_pos],
        "period": int or None, "start": int}`` (rows of ``pattern`` sum to 1 up to float16 rounding).

    Raises:
        ValueError: ``max_len`` below 2.
        HeadprobeError: as :func:`~headprobe.probe.hooks.capture.patterns_by_layer`.
    """
    import torch

    from headprobe.analyses.scoring import token_labels
    from headprobe.probe.hooks.capture import patterns_by_layer

    if max_len < 2:
        raise ValueError(f"max_len must be at least 2, got {max_len}")
    spec = model.spec
    out: dict[str, dict] = {}
    for name, ts in examples.items():
        toks = ts.tokens[:1, :max_len]
        n = toks.shape[1]
        kept = np.zeros((spec.n_layers, spec.n_heads, n, n), dtype=np.float16)

        def on_pattern(layer, pattern, kept=kept):
            kept[layer] = pattern[0].detach().float().cpu().numpy().astype(np.float16)

        with torch.inference_mode():
            patterns_by_layer(model, toks, on_pattern)
        out[name] = {
            "ids": toks[0].cpu().numpy().astype(np.int32),
            "labels": token_labels(model, toks[0].cpu(), for_font=False),
            "pattern": kept,
            "period": ts.period,
            "start": int(ts.start),
        }
    return out


def quantize(pattern: np.ndarray) -> np.ndarray:
    """Attention weights in [0, 1] -> uint8 ``round(255 p)`` (absolute error <= 1/510, about 0.002)."""
    return np.clip(np.rint(np.asarray(pattern, dtype=np.float32) * 255), 0, 255).astype(np.uint8)


def save_patterns(path: str | Path, patterns: Mapping[str, dict], dtype: str = "uint8") -> Path:
    """Write :func:`head_patterns`' result as a compressed ``.npz`` (keys ``<example>_ids``,
    ``_labels``, ``_pattern``, ``_period`` (-1: none), ``_start``), atomically. Returns the path.

    ``dtype="uint8"`` (default) stores :func:`quantize`'s ``round(255 p)``, the precision the page
    shows: SmolLM2's 270 heads on 128 + 101 tokens take 1.3 MB instead of 6.7 MB as float16 (whose
    mantissa noise hardly compresses); ``"float16"`` keeps float16. :func:`load_patterns` reads both.
    """
    from headprobe.probe.core.io import atomic_path

    if dtype not in ("uint8", "float16"):
        raise ValueError(f"dtype must be uint8 or float16, got {dtype!r}")
    arrays: dict[str, Any] = {}  # numpy arrays and scalars
    for name, ex in patterns.items():
        arrays[f"{name}_ids"] = np.asarray(ex["ids"], dtype=np.int32)
        arrays[f"{name}_labels"] = np.asarray(ex["labels"], dtype=str)
        arrays[f"{name}_pattern"] = (
            quantize(ex["pattern"]) if dtype == "uint8" else np.asarray(ex["pattern"], np.float16)
        )
        arrays[f"{name}_period"] = np.int32(-1 if ex.get("period") is None else ex["period"])
        arrays[f"{name}_start"] = np.int32(ex.get("start", 0))
    path = Path(path)
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            np.savez_compressed(f, **arrays)
    return path


def load_patterns(path: str | Path) -> dict[str, dict]:
    """Read a ``patterns.npz`` written by :func:`save_patterns` (same dict layout as :func:`head_patterns`).

    Raises:
        ValueError: the file is not such an archive (not a zip archive, a missing key, a pattern that is not
            ``[layer, head, pos, pos]`` or disagrees with its token count).
    """
    if not zipfile.is_zipfile(path):  # else numpy reads it as a pickle and says to load it unsafely
        raise ValueError("not an .npz archive (cut, or not headprobe's patterns.npz)")
    with np.load(path, allow_pickle=False) as z:
        names = sorted({k.rsplit("_", 1)[0] for k in z.files if k.endswith("_pattern")})
        out = {}
        for name in names:
            try:
                pattern = z[f"{name}_pattern"]
                ids, labels = z[f"{name}_ids"], z[f"{name}_labels"]
                period, start = int(z[f"{name}_period"]), int(z[f"{name}_start"])
            except KeyError as e:
                raise ValueError(f"{path}: not a headprobe patterns file (missing {e})") from None
            if (
                pattern.ndim != 4
                or pattern.shape[2] != pattern.shape[3]
                or pattern.shape[2] != len(ids)
                or len(ids) != len(labels)
            ):
                raise ValueError(f"{path}: {name} pattern of shape {pattern.shape} does not match {len(ids)} tokens")
            if pattern.dtype == np.uint8:  # quantize()'s round(255 p)
                pattern = pattern.astype(np.float32) / np.float32(255)
            out[name] = {
                "ids": ids,
                "labels": [str(s) for s in labels],
                "pattern": pattern,
                "period": None if period < 0 else period,
                "start": start,
            }
    return out


def encode_pattern(pattern: np.ndarray) -> str:
    """``[layer, head, q_pos, k_pos]`` weights in [0, 1] -> base64 of the deflated (zlib) uint8
    array ``round(255 * p)``, C order: what the page decodes (:func:`decode_pattern` is its inverse)."""
    q = quantize(pattern)
    return base64.b64encode(zlib.compress(q.tobytes(), 6)).decode("ascii")


def decode_pattern(text: str, shape: tuple[int, ...]) -> np.ndarray:
    """The inverse of :func:`encode_pattern`: float32 weights (multiples of 1/255) of ``shape``."""
    return np.frombuffer(zlib.decompress(base64.b64decode(text)), dtype=np.uint8).reshape(shape) / np.float32(255)


# ----------------------------------------------------------------------------- page data


def _colormap(name: str) -> list[str]:
    import matplotlib

    rgba = matplotlib.colormaps[name](np.linspace(0, 1, 256))
    return ["#" + "".join(f"{int(round(c * 255)):02x}" for c in row[:3]) for row in rgba]


def _score_maps(table: pd.DataFrame) -> list[dict]:
    """One map entry per drawable score column of head_scores.csv, styled as scan's heatmaps."""
    from headprobe.analyses.detectors import DETECTORS

    maps = []
    for det in DETECTORS.values():
        for style in det.figures:
            if style.column not in table:
                continue
            opts = dict(style.options)
            maps.append(
                {
                    "column": style.column,
                    "title": style.title,
                    "label": style.label,
                    "cmap": opts.get("cmap", "viridis"),
                    "vmin": opts.get("vmin", 0.0),
                    "vmax": opts.get("vmax", 1.0),
                    "example": "repeated" if det.dataset == "repeated" else "natural",
                    "head_type": det.name,
                    "source": "scan",
                }
            )
    return maps


def _delta_maps(table: pd.DataFrame) -> list[dict]:
    """Map entries for an ablate run's loss increases (diverging, centred at 0)."""
    maps = []
    # induction_loss_delta: the repeated task's column in head_ablation.csv files written before it took scan's name
    for col, example in (
        ("natural_loss_delta", "natural"),
        ("repeated_loss_delta", "repeated"),
        ("induction_loss_delta", "repeated"),
    ):
        if col in table:
            vmax = float(np.nanmax(np.abs(table[col].to_numpy()))) or 1.0
            maps.append(
                {
                    "column": col,
                    "title": f"{col.split('_')[0]} loss increase when ablated (nats/token)",
                    "label": "loss increase, nats/token",
                    "cmap": "RdBu_r",
                    "vmin": -vmax,
                    "vmax": vmax,
                    "example": example,
                    "head_type": None,
                    "source": "ablate run",
                }
            )
    if "induction_score" in table and not any(m["column"] == "induction_score" for m in maps):
        maps.append(
            {
                "column": "induction_score",
                "title": "induction score",
                "label": "attention to token after copy",
                "cmap": "viridis",
                "vmin": 0.0,
                "vmax": 1.0,
                "example": "repeated",
                "head_type": "induction",
                "source": "ablate run",  # its own repeated tokens (ablate_core._induction_score), not the scan's
            }
        )
    return maps


def _name_sources(maps: list[dict]) -> list[dict]:
    """``maps`` with each title that two runs share (a scan's induction score and a merged ablate
    run's, on other tokens) followed by its run, ``"induction score (scan)"``: the menu named two
    maps alike and nothing told them apart. Titles of one run only are left as they are."""
    titles = [m["title"] for m in maps]
    return [{**m, "title": f"{m['title']} ({m['source']})"} if titles.count(m["title"]) > 1 else m for m in maps]


def _verdicts(summary: Mapping | None) -> list[dict]:
    """scan's ablation checks, compact: type, kind, task, heads ablated, effect, control mean/max, sets
    ablated, p, adjusted p, whether the row is the tested one, the effect's unit (its metric's),
    verdict (the rule of summary.json's ``verification``; the untested kind says ``not tested``)."""
    rows = []
    d = VERDICT_DIGITS
    for a in (summary or {}).get("ablations", []):
        rows.append(
            {
                "head_type": a["head_type"],
                "kind": a["kind"],
                "task": a["task"],
                "heads": a["top_heads"],
                "effect": _round(a["top_effect"], d),
                "random_mean": _round(a["random_mean"], d),
                "random_max": _round(a["random_max"], d),
                "p_value": _round(a.get("p_value"), d),
                "p_adjusted": _round(a.get("p_adjusted"), d),
                "draws": a.get("draws", len(a.get("random_effects", []))),
                "tested": bool(a.get("tested", True)),
                "alpha": a.get("alpha"),
                "correction": a.get("correction"),
                "min_effect": a.get("min_effect"),
                "ci95": [_round(x, d) for x in a.get("top_effect_ci95") or []],
                "confirmed": a["confirmed"],  # None: no verdict (see the summary's warnings)
                "exceedances": a.get("exceedances"),
                "p_bound": bool(a.get("p_value_is_bound")),
                "p_min": a.get("p_value_min"),
                "stop": stop_text(a),
                "evidence": evidence_text(a),
                "unit": UNITS.get(a.get("metric") or "loss", a.get("metric")),
                "verdict": (
                    NOT_TESTED if not a.get("tested", True) and not a.get("no_verdict") else label(a["confirmed"])
                ),
            }
        )
    return rows


def _rule(summary: Mapping | None) -> dict | None:
    """The page's statement of the verdict rule: its text (:meth:`VerdictRule.description`, from the
    summary's ``verification.verdict_rule`` or, for an older summary, its rows) and the labels; None
    without a tested verdict."""
    rule = VerdictRule.from_rows(
        (summary or {}).get("ablations", []), ((summary or {}).get("verification") or {}).get("verdict_rule")
    )
    if rule is None:
        return None
    return {
        "text": rule.description(),
        "labels": {
            "confirmed": LABELS[True],
            "not_confirmed": LABELS[False],
            "no_verdict": LABELS[None],
            "not_tested": NOT_TESTED,
        },
    }


CIRCUIT_EDGES = 20
"""Edges of a ``headprobe circuit`` run listed on the page (the summary's ``top_edges``, at most this many)."""


def _data_image(figure: str | Path | None) -> str | None:
    """``figure`` (an .svg or .png file) as a ``data:`` URI for an ``<img>`` (which runs no script,
    whatever the file holds); None for None.

    Raises:
        ValueError: the file is neither SVG nor PNG.
    """
    if figure is None:
        return None
    figure = Path(figure)
    mime = {".svg": "image/svg+xml", ".png": "image/png"}.get(figure.suffix.lower())
    if mime is None:
        raise ValueError(f"{figure}: a circuit figure must be .svg or .png")
    return f"data:{mime};base64," + base64.b64encode(figure.read_bytes()).decode("ascii")


def circuit_data(summary: Mapping, figure: str | Path | None = None, path_figure: str | Path | None = None) -> dict:
    """The page's circuit section from a ``headprobe circuit`` run: its summary.json (``top_edges``
    with each edge's attribution ``score`` and, where verified, the ``exact`` path-patching effect
    in nats/token; ``agreement``; ``receivers``, the path-patching sweeps; ``qk_attribution``), its
    figure (``circuit.svg`` or ``.png``) and, for a run with ``--receivers``, its path-patching
    figure (``path_patching.svg`` or ``.png``), each inlined as a ``data:`` image.

    Raises:
        ValueError: ``summary`` is not a circuit run's (no ``top_edges``), or a figure is not SVG/PNG.
    """
    edges = summary.get("top_edges")
    if not isinstance(edges, list) or not all(isinstance(e, Mapping) and "edge" in e for e in edges):
        raise ValueError("not a headprobe circuit summary.json (it has no top_edges)")
    image, path_image = _data_image(figure), _data_image(path_figure)
    receivers = {
        r: [
            {"sender": str(x["sender"]), "effect": _round(x["effect"], 4), "score": _round(x.get("score"), 4)}
            for x in rows[:5]
        ]
        for r, rows in (summary.get("receivers") or {}).items()
    }
    qk = summary.get("qk_attribution")
    return {
        "method": summary.get("method"),
        "metric": summary.get("metric"),
        "task": summary.get("task"),
        "n_edges": summary.get("n_edges"),
        "agreement": summary.get("agreement"),
        "image": image,
        "path_image": path_image,
        "edges": [
            {"edge": str(e["edge"]), "score": _round(e.get("score"), 4), "exact": _round(e.get("exact"), 4)}
            for e in edges[:CIRCUIT_EDGES]
        ],
        "receivers": receivers,
        "qk": None
        if not qk
        else {
            "head": qk.get("head"),
            "q_pos": qk.get("q_pos"),
            "k_pos": qk.get("k_pos"),
            "score": _round(qk.get("score"), 4),
            "identity_error": qk.get("identity_error"),
            "key_side": {k: _round(v, 4) for k, v in list((qk.get("key_side_top") or {}).items())[:5]},
            "query_side": {k: _round(v, 4) for k, v in list((qk.get("query_side_top") or {}).items())[:5]},
        },
    }


def viewer_data(
    scores: pd.DataFrame | None = None,
    summary: Mapping | None = None,
    patterns: Mapping[str, dict] | None = None,
    ablation: pd.DataFrame | None = None,
    ablation_summary: Mapping | None = None,
    title: str | None = None,
    verdicts: bool = True,
    circuit: Mapping | None = None,
) -> dict:
    """The JSON the page reads: layout, maps, table, verdicts, patterns. At least one of ``scores``
    (head_scores.csv) and ``ablation`` (head_ablation.csv) must be given.

    Args:
        scores: head_scores.csv as a DataFrame (``layer``, ``head``, ``kv_head``, score columns).
        summary: scan's summary.json (layout, verdicts with p-values).
        patterns: :func:`head_patterns` / :func:`load_patterns`' result, or None (the page says so).
            An example may carry a ``label``, how the page names it (default :data:`EXAMPLE_LABELS`).
        ablation: head_ablation.csv (``<task>_loss_delta`` etc.); merged into the table by (layer, head).
        ablation_summary: the ablate run's summary.json.
        title: the page's heading (default: the model's name).
        verdicts: the page has a section for scan's ablation checks (saying so when there are
            none); False for a page that no scan made (``headprobe show``): no section,
            ``"verdicts"`` is None.
        circuit: :func:`circuit_data` of a ``headprobe circuit`` run of the same model: a section
            with its figure, top edges, path-patching sweeps and QK attribution (None: no section).

    Raises:
        ValueError: neither table given, tables of different head layouts, or patterns whose
            layer/head counts disagree with the table's.
    """
    from headprobe.analyses.figures import NOT_MEASURED_COLOR, PATTERN_CMAP  # the PNG's pattern colours

    table, n_layers, n_heads = _head_table(scores, ablation)
    info = dict(summary or ablation_summary or {})
    layout = dict(info.get("layout") or {})
    n_kv = int(layout.get("n_kv_heads") or (table["kv_head"].max() + 1 if "kv_head" in table else n_heads))
    maps = _name_sources(
        (_score_maps(table) if scores is not None else []) + (_delta_maps(table) if ablation is not None else [])
    )
    columns = [c for c in table.columns if c not in _ID_COLUMNS]
    data: dict[str, Any] = {
        "title": title or info.get("model") or "headprobe",
        "model": info.get("model"),
        "weights": info.get("weights_precision"),
        "n_layers": n_layers,
        "n_heads": n_heads,
        "n_kv_heads": n_kv,
        "group_size": max(1, n_heads // n_kv),
        "clean_loss": info.get("clean_loss_nats") or info.get("clean_loss"),
        "maps": maps,
        "columns": columns,
        "rows": _table_rows(table, columns, n_heads, n_kv),
        "verdicts": _verdicts(summary) if verdicts else None,
        "rule": _rule(summary) if verdicts else None,
        "warnings": list((summary or {}).get("warnings", [])),
        "notes": list((summary or {}).get("notes", [])),  # what a column means on this page (headprobe show)
        "selected": (summary or {}).get("selected_head"),  # a head to open the page on (headprobe show)
        "colormaps": {name: _colormap(name) for name in sorted({m["cmap"] for m in maps} | {PATTERN_CMAP})},
        "pattern_cmap": PATTERN_CMAP,
        "masked_color": NOT_MEASURED_COLOR,  # the pattern as pattern_plot draws it
        "causal": not of_an_encoder(info, list(table.columns)),  # an encoder's queries read later keys too: drawn whole
        "patterns": {},
        "circuit": _checked_circuit(circuit, n_layers, n_heads),
    }
    data["patterns"].update(_page_patterns(patterns, n_layers, n_heads))
    return data


def _head_table(scores: pd.DataFrame | None, ablation: pd.DataFrame | None) -> tuple[pd.DataFrame, int, int]:
    """:func:`viewer_data`'s table, ``(table, n_layers, n_heads)``: ``scores``, with ``ablation``'s
    columns merged in by (layer, head) (those of the same name kept from ``scores``), or either alone,
    sorted by layer and head.

    Raises:
        ValueError: neither given, tables of different head counts, or not one row per head.
    """
    tables = [t for t in (scores, ablation) if t is not None]
    if not tables:
        raise ValueError("nothing to show: need head_scores.csv (scan) or head_ablation.csv (ablate)")
    table = tables[0].copy()
    if len(tables) == 2:
        assert ablation is not None
        a = ablation.drop(columns=[c for c in ablation.columns if c in table and c not in ("layer", "head")])
        if len(a) != len(table):
            raise ValueError(f"head_scores.csv has {len(table)} heads but head_ablation.csv {len(a)}")
        table = table.merge(a, on=["layer", "head"], how="left")
    table = table.sort_values(["layer", "head"]).reset_index(drop=True)
    n_layers, n_heads = int(table["layer"].max()) + 1, int(table["head"].max()) + 1
    if len(table) != n_layers * n_heads:
        raise ValueError(f"the table has {len(table)} rows, not one per head of {n_layers} layers x {n_heads} heads")
    return table, n_layers, n_heads


def _table_rows(table: pd.DataFrame, columns: list[str], n_heads: int, n_kv: int) -> list[list]:
    """The page's table rows: ``[layer, head, kv_head, *columns]`` per head, the values rounded
    (:func:`_round`); ``kv_head`` from the table, else the head's GQA group of ``n_kv``."""
    return [  # records, not itertuples: a column whose name is no identifier ("Unnamed: 0") is read too
        [
            int(r["layer"]),
            int(r["head"]),
            int(r["kv_head"]) if "kv_head" in table else int(r["head"]) // max(1, n_heads // n_kv),
            *[_round(r[c]) for c in columns],
        ]
        for r in table.to_dict("records")
    ]


def _page_patterns(patterns: Mapping[str, dict] | None, n_layers: int, n_heads: int) -> dict[str, dict]:
    """The page's patterns: per example its length, token labels, period, start, the pattern encoded
    (:func:`encode_pattern`) and how the page names it.

    Raises:
        ValueError: an example's layer/head counts are not ``n_layers`` x ``n_heads``.
    """
    shown = {}
    for name, ex in (patterns or {}).items():
        p = np.asarray(ex["pattern"])
        if p.shape[:2] != (n_layers, n_heads):
            raise ValueError(
                f"{name} patterns are for {p.shape[0]} layers x {p.shape[1]} heads, "
                f"the table for {n_layers} x {n_heads}"
            )
        shown[name] = {
            "n": int(p.shape[-1]),
            "labels": list(ex["labels"]),
            "period": ex.get("period"),
            "start": int(ex.get("start", 0)),
            "data": encode_pattern(p),
            "label": ex.get("label") or EXAMPLE_LABELS.get(name, f"the {name} example"),
        }
    return shown


def _checked_circuit(circuit: Mapping | None, n_layers: int, n_heads: int) -> dict | None:
    """``circuit`` as given, after checking that every head its edges name exists in the table's
    layout (a circuit run of another model would name heads the page does not have)."""
    if circuit is None:
        return None
    for e in circuit["edges"]:
        for end in re.findall(r"(\d+)\.(\d+)", e["edge"]):
            if int(end[0]) >= n_layers or int(end[1]) >= n_heads:
                raise ValueError(
                    f"the circuit's edge {e['edge']} names a head outside the table's "
                    f"{n_layers} layers x {n_heads} heads: a circuit run of another model?"
                )
    return dict(circuit)


def _template() -> str:
    return resources.files("headprobe.analyses").joinpath("viewer_template.html").read_text(encoding="utf-8")


def render(data: Mapping) -> str:
    """The page for :func:`viewer_data`'s dict: the template with the JSON inlined and the title
    (HTML-escaped) put in, in one pass, so neither can bring in the other's placeholder.

    The JSON is Jinja2's ``htmlsafe_json_dumps`` (its ``|tojson``): ``<``, ``>``, ``&`` and ``'``
    become ``\\u003c`` ... escapes, the same characters to ``JSON.parse``. With no ``<`` left, no
    string in the data can end the script element (``</script>``) or open the HTML parser's
    escaped states (``<!--`` then ``<script>``: the element's own closing tag would no longer
    close it, and the page's script would become data).
    """
    from jinja2.utils import htmlsafe_json_dumps

    payload = str(htmlsafe_json_dumps(data, separators=(",", ":"), allow_nan=False))
    fill = {"__TITLE__": html.escape(str(data.get("title", "headprobe"))), "__DATA__": payload}
    return re.sub("__TITLE__|__DATA__", lambda m: fill[m.group(0)], _template())


def build_page(
    scores: pd.DataFrame | None = None,
    summary: Mapping | None = None,
    patterns: Mapping[str, dict] | None = None,
    ablation: pd.DataFrame | None = None,
    ablation_summary: Mapping | None = None,
    title: str | None = None,
    verdicts: bool = True,
    circuit: Mapping | None = None,
) -> str:
    """The whole self-contained HTML page (arguments and errors as :func:`viewer_data`)."""
    return render(viewer_data(scores, summary, patterns, ablation, ablation_summary, title, verdicts, circuit))


def notebook_html(page: str, height: int = 900) -> str:
    """``page`` inside an ``<iframe srcdoc>``, for Jupyter's ``_repr_html_``: its script runs
    isolated from the notebook and from other viewers in it."""
    return (
        f'<iframe srcdoc="{html.escape(page, quote=True)}" style="width:100%;height:{height}px;border:0" '
        f'sandbox="allow-scripts"></iframe>'
    )
