"""The run of ``headprobe export`` (pandas; pyarrow for Parquet): read a scan, kv or circuit
folder, build each format's files in memory (:mod:`headprobe.analyses.exchange`), write them. The
command and its settings are :mod:`headprobe.commands.export`."""

from __future__ import annotations

import datetime
import hashlib
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from headprobe.analyses import exchange as ex
from headprobe.analyses.columns import of_an_encoder
from headprobe.analyses.latex_tables import BUILDERS as LATEX_BUILDERS
from headprobe.commands.export import (  # noqa: F401 - the light module's names, re-exported
    DUO_RECENT,
    DUO_SINK,
    HELP,
    ExportConfig,
    check_apart,
    check_out,
)
from headprobe.options import notes_flags, reports_for_readers
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.core.io import ReadsInputs, keeps_inputs
from headprobe.probe.core.registry import did_you_mean
from headprobe.probe.core.reprs import CompactRepr

_EXCHANGE = {"scan": ("duo", "headkv", "parquet"), "kv": ("duo", "headkv", "parquet"), "circuit": ("mib", "parquet")}
SUPPORTED = {
    kind: _EXCHANGE.get(kind, ()) + (("latex",) if kind in LATEX_BUILDERS else ())
    for kind in {**_EXCHANGE, **LATEX_BUILDERS}
}
"""The formats each source kind can be written in (``all``: every one of its kind's): the exchange
formats, and ``latex`` where :data:`headprobe.analyses.latex_tables.BUILDERS` has its tables."""


def formats_taken() -> str:
    """``duo: scan or kv; ...; latex: scan, kv, circuit, prune or ablate``: the runs each format takes
    (:data:`SUPPORTED`), for a refusal that cannot tell which run was meant."""

    def either(kinds: list[str]) -> str:
        return " or ".join([", ".join(kinds[:-1]), kinds[-1]] if len(kinds) > 1 else kinds)

    return "; ".join(f"{f}: {either([k for k, v in SUPPORTED.items() if f in v])}" for f in BUILDERS)


@dataclass
class Source:
    """A headprobe output folder: its ``kind`` (scan, kv, circuit), ``summary``, main ``table``
    (head_scores.csv, group_costs.csv, edges.csv; a prune or ablate folder's is not read: None), the
    model's layout (None for prune and ablate, whose tables need none) and where it came from."""

    kind: str
    path: Path
    summary: dict
    table: pd.DataFrame | None
    layout: ex.Layout | None
    provenance: dict

    @property
    def lay(self) -> ex.Layout:
        """The layout of a scan, kv or circuit source (the exchange formats need it)."""
        assert self.layout is not None, f"a {self.kind} folder has no layout"
        return self.layout

    @property
    def rows(self) -> pd.DataFrame:
        """The main table of a scan, kv or circuit source."""
        assert self.table is not None, f"a {self.kind} folder's table is not read"
        return self.table

    def identity(self) -> dict:
        model = {"model": self.summary.get("model")} if self.layout is None else self.layout.identity()
        return {**model, **self.provenance}


@dataclass(repr=False)
class ExportResult(CompactRepr, ReadsInputs):
    """The files to write (relative path -> text or bytes) and how each was made (``notes``)."""

    config: ExportConfig
    source: Source
    files: dict[str, str | bytes]
    notes: dict[str, str] = field(default_factory=dict)

    def summary(self) -> dict:
        """summary.json's content: the source (path, kind, identity), the files written and how each
        was made, and the format and score exported."""
        return {
            "format": "headprobe-export",
            "version": 1,
            **self.source.identity(),
            "source": str(self.source.path),
            "source_kind": self.source.kind,
            "files": list(self.files),
            "how": self.notes,
            "config": {"format": self.config.format, "score": self.config.score},
        }

    @reports_for_readers("export")
    def report(self) -> str:
        lay = self.source.layout
        shape = f": {lay.n_layers} layers x {lay.n_heads} heads" if lay is not None else ""
        model = self.source.identity()["model"]  # a study trains many models: none named
        lines = [f"{self.source.kind} folder {self.source.path}" + (f" ({model}{shape})" if model else "")]
        lines += [f"  {name}: {how}" for name, how in self.notes.items()]
        return "\n".join(lines)

    @keeps_inputs
    def save(self, out: str | Path, overwrite: bool = False) -> list[Path]:
        """Write the files and, last, summary.json (staged and swapped in: nothing half-written).

        Raises:
            HeadprobeError: ``out`` is a file, not writable, not empty without ``overwrite``, or is,
                holds or lies inside the source folder (:func:`check_apart`); a message naming flags has a note giving their Python spelling (``e.__notes__``)."""
        from headprobe.analyses.outputs import write_outputs
        from headprobe.probe.core.io import atomic_path

        check_apart(self.source.path, Path(out))

        def files(tmp: Path) -> list[Path]:
            for rel, data in self.files.items():
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                with atomic_path(tmp / rel) as p:
                    p.write_bytes(data if isinstance(data, bytes) else data.encode("utf-8"))
            return [tmp / rel for rel in self.files]

        return write_outputs(out, overwrite, summary=self.summary, extra=files)


def read_source(path: Path) -> Source:
    """The run's folder at ``path`` (a kind of :data:`SUPPORTED`).

    Raises:
        HeadprobeError: not a folder, no summary.json, or no table of a known command; a cut or odd
            summary.json or table (:func:`read_summary`, :func:`read_table`,
            :func:`~headprobe.analyses.exchange.check_head_rows`: a scan's, one row per head); a kv or circuit run
            whose layout is neither recorded nor readable (:func:`recorded_layout`)."""
    if not path.is_dir():
        raise HeadprobeError(
            f"{path} is not a folder (give the output folder of a headprobe run of a kind its --format takes: {formats_taken()})"
        )
    kind = next(
        (
            k
            for k, f in (("kv", "policy.json"), ("circuit", "edges.csv"), ("scan", "head_scores.csv"))
            if (path / f).is_file()
        ),
        None,
    )
    kind = kind or next((k for k, fs in TABLE_ONLY.items() if any((path / f).is_file() for f in fs)), None)
    if kind is None or not (path / SUMMARY_FILES.get(kind, "summary.json")).is_file():
        raise HeadprobeError(
            f"{path} holds no finished headprobe scan, kv, circuit, prune, ablate, study or train run (summary.json "
            "with head_scores.csv, policy.json, edges.csv, pruning_curve.csv, per_layer.csv, head_ablation.csv or "
            "train_log.csv; a study's study.json)"
        )
    raw, summary = read_summary(path, kind)
    if kind in TABLE_ONLY:  # LaTeX tables only: summary.json has their rows, no layout is needed
        return Source(kind, path, summary, None, None, _provenance(raw, summary))
    table = read_table(path / TABLES[kind], kind)
    model = str(summary.get("model", ""))
    summary = recorded_layout(kind, path, summary, model)
    layout = _layout(kind, model, summary, table)
    ex.check_head_rows(path / TABLES[kind], table, HEAD_NUMBERS[kind], layout if kind == "scan" else None)
    return Source(
        kind,
        path,
        summary,
        table,
        layout,
        _provenance(raw, summary),
    )


def _provenance(raw: bytes, summary: dict) -> dict:
    """The source's identity beside its model: its HF name, summary.json's SHA-256 and headprobe version."""
    return {
        "hf_name": summary.get("hf_name"),
        "source_summary_sha256": hashlib.sha256(raw).hexdigest(),
        "headprobe_version": (summary.get("versions") or {}).get("headprobe"),
    }


TABLES = {"kv": "group_costs.csv", "circuit": "edges.csv", "scan": "head_scores.csv"}
"""Each source kind's main table."""
COLUMNS = {
    "scan": ("layer", "head", "kv_head"),
    "kv": ("layer", "kv_group", "score"),
    "circuit": ("edge", "sender", "receiver", "input", "score"),
}
"""The columns export reads of each table."""
HEAD_NUMBERS = {"scan": ("layer", "head", "kv_head"), "kv": ("layer", "kv_group"), "circuit": ()}
"""The columns of each table that number heads, layers or KV groups (whole numbers >= 0)."""
TABLE_ONLY = {
    "ablate": ("head_ablation.csv",),
    "prune": ("pruning_curve.csv", "per_layer.csv"),
    "study": ("study.json",),
    "train": ("train_log.csv",),
}
"""Source kinds written as LaTeX tables only, and the files that mark their folders."""
SUMMARY_FILES = {"study": "study.json"}
"""The summary of a kind whose file is not summary.json (a study's: study.json; results.csv beside it)."""
SUMMARY_KEYS = {
    "scan": ("layout",),
    "kv": ("n_layers", "n_kv_groups"),
    "circuit": (),
    "prune": (),
    "ablate": (),
    "study": ("which", "per_variant"),
    "train": ("final",),
}
"""The summary.json keys export reads of each source kind."""


def read_summary(path: Path, kind: str) -> tuple[bytes, dict]:
    """``(bytes, JSON object)`` of ``path/summary.json`` (a study's study.json, :data:`SUMMARY_FILES`),
    with the keys a ``kind`` run's has (:data:`SUMMARY_KEYS`; a scan's ``layout`` with integer sizes).

    Raises:
        HeadprobeError: unreadable, cut (not JSON), not an object, or lacking a key."""
    file = path / SUMMARY_FILES.get(kind, "summary.json")
    try:
        raw = file.read_bytes()
        summary = json.loads(raw)
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise HeadprobeError(f"cannot read {file} as JSON (cut, or not headprobe's): {err}") from None
    if not isinstance(summary, dict):
        raise HeadprobeError(f"{file} is not a JSON object (not a headprobe {kind} {file.name})")
    lay = summary.get("layout")
    missing = [k for k in SUMMARY_KEYS[kind] if k not in summary]
    missing += [
        f"layout.{k}"
        for k in ("n_layers", "n_heads", "n_kv_heads")
        if kind == "scan" and isinstance(lay, dict) and not _positive_int(lay.get(k))
    ]
    missing += [
        k for k in ("n_layers", "n_kv_groups") if kind == "kv" and k in summary and not _positive_int(summary[k])
    ]
    if missing or (kind == "scan" and not isinstance(lay, dict)):
        raise HeadprobeError(
            f"{file} lacks {', '.join(missing) or 'layout'} (or not as positive integers): not a "
            f"finished headprobe {kind} run's summary"
        )
    return raw, summary


def _positive_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


def read_table(file: Path, kind: str) -> pd.DataFrame:
    """A source's main table (:data:`TABLES`), heads read as text (``"16.0"`` is a head, not 16.0).

    Raises:
        HeadprobeError: unreadable, empty, cut, or without a column export reads (:data:`COLUMNS`)."""
    try:
        table = pd.read_csv(file, dtype={c: str for c in ("edge", "sender", "receiver", "input")})
    except (OSError, UnicodeDecodeError, ValueError, pd.errors.EmptyDataError, pd.errors.ParserError) as err:
        raise HeadprobeError(
            f"cannot read {file} as a CSV table: {str(err).splitlines()[0] if str(err) else type(err).__name__}"
        ) from None
    missing = [c for c in COLUMNS[kind] if c not in table.columns]
    if missing or table.empty:
        raise HeadprobeError(
            f"{file} has {'no rows' if not missing else 'no column ' + ', '.join(missing)}: not a "
            f"finished headprobe {kind} run's table"
        )
    return table


def recorded_layout(kind: str, path: Path, summary: dict, model: str) -> dict:
    """``summary`` with the model's layout the run recorded (a kv run's policy_budget.json
    ``layout``; a scan's and a circuit's summary.json ``layout``), so that the files are written
    for the model the run measured, not for whatever now sits at its ``model`` path.

    Raises:
        HeadprobeError: a kv or circuit run with no recorded layout whose model's config cannot be
            read either (the model folder moved): the query heads per layer would be guessed."""
    from headprobe.options import peek_config

    if kind == "kv" and not isinstance(summary.get("layout"), dict) and (path / "policy_budget.json").is_file():
        try:
            lay = json.loads((path / "policy_budget.json").read_text(encoding="utf-8")).get("layout")
        except (OSError, UnicodeDecodeError, ValueError, AttributeError):
            lay = None
        if isinstance(lay, dict) and all(_positive_int(lay.get(k)) for k in ("n_layers", "n_heads")):
            summary = {**summary, "layout": lay}
    if kind != "scan" and not isinstance(summary.get("layout"), dict) and not peek_config(model):
        raise HeadprobeError(
            f"{path} records no model layout and {model or 'its model'}'s config cannot be read (moved "
            f"or deleted?): the query heads per layer and per KV group are unknown; put the model back "
            f"at that path or rerun headprobe {kind}"
        )
    return summary


def _layout(kind: str, model: str, summary: dict, table: pd.DataFrame) -> ex.Layout:
    """The model's layout from what the run recorded (:func:`recorded_layout`), else its config
    (:func:`headprobe.options.peek_config`)."""
    from headprobe.options import peek_config

    if kind == "scan":
        lay = summary["layout"]
        return ex.Layout(
            model, lay["n_layers"], lay["n_heads"], lay["n_kv_heads"], lay["n_kv_heads"], lay.get("d_model")
        )
    cfg = {**(peek_config(model) or {}), **{k: v for k, v in (summary.get("layout") or {}).items() if v is not None}}
    if kind == "kv":
        n_layers, groups = int(summary["n_layers"]), int(summary["n_kv_groups"])
        return ex.Layout(
            model, n_layers, cfg.get("n_heads") or groups, cfg.get("n_kv_heads") or groups, groups, cfg.get("d_model")
        )
    heads = [h for c in ("sender", "receiver") for h in table[c].astype(str) if h != "logits"]
    n_layers = cfg.get("n_layers") or 1 + max(int(h.split(".")[0]) for h in heads)
    return ex.Layout(
        model,
        n_layers,
        cfg.get("n_heads") or 1 + max(int(h.split(".")[1]) for h in heads),
        cfg.get("n_kv_heads"),
        cfg.get("n_kv_groups"),
        cfg.get("d_model"),
        cfg.get("parallel_attn_mlp"),
    )


def _score_column(src: Source, asked: str | None) -> str:
    """The scan column written as DuoAttention values and HeadKV scores.

    Raises:
        HeadprobeError: the scan has no such column (or neither default)."""
    table = src.rows
    column = asked or next((c for c in ("retrieval", "induction") if c in table and table[c].notna().any()), None)
    if column is None or column not in table or column in ("layer", "head", "kv_head"):
        columns = [str(c) for c in table.columns if c not in ("layer", "head", "kv_head")]
        raise HeadprobeError(
            f"--score {column}{did_you_mean(str(column), columns)}: {src.path} has no such score column; it has "
            f"{', '.join(columns)}"
        )
    check_scored(src, column)
    return column


def check_scored(src: Source, column: str) -> None:
    """A score column export can write: numeric, finite where given, and with a score for some head.

    Raises:
        HeadprobeError: text or booleans, an infinite value, or no head scored (every value NaN)."""
    import numpy as np

    values = src.rows[column]
    if pd.api.types.is_bool_dtype(values) or not pd.api.types.is_numeric_dtype(values):
        raise HeadprobeError(f"--score {column}: {src.path}'s column {column} is not numeric ({values.dtype})")
    if values.isna().all():
        raise HeadprobeError(
            f"--score {column}: {src.path}'s column {column} has no score for any head (all NaN); give another --score"
        )
    if np.isinf(values.to_numpy(dtype=float, na_value=np.nan)).any():
        raise HeadprobeError(f"--score {column}: {src.path}'s column {column} holds an infinite value")


def duo_files(src: Source, cfg: ExportConfig) -> tuple[dict, str]:
    """full_attention_heads.tsv and config.json."""
    if src.kind == "kv":
        from headprobe.analyses.exchange import read_kv_policy

        values, sink, recent = ex.policy_values(read_kv_policy(src.path / "policy.json"))
        if not sink and not recent:  # every group full: the kv run's own streaming span
            sink, recent = int(src.summary["sink"]), int(src.summary["window"])
        how = "the kv policy: 1 = full cache, 0 = streaming (sink_size + recent_size)"
    else:
        column = _score_column(src, cfg.score)
        grid = src.rows.groupby(["layer", "kv_head"])[column].max().unstack().sort_index()
        values = grid.fillna(0.0).clip(0.0, 1.0).to_numpy().tolist()
        sink = DUO_SINK if cfg.sink is None else cfg.sink
        recent = DUO_RECENT if cfg.recent is None else cfg.recent
        how = f"scan column {column}: the max over each KV group's query heads, clipped to [0, 1], NaN as 0"
    return {
        ex.DUO_TSV: ex.duo_text(values),
        ex.DUO_CONFIG: json.dumps(ex.duo_config(sink, recent, src.identity(), how), indent=2) + "\n",
    }, how


def headkv_files(src: Source, cfg: ExportConfig) -> tuple[dict, str]:
    """head_score/<model>.json (scores only: its readers take every key as a head) and its provenance."""
    lay = src.lay
    if src.kind == "kv":
        size = lay.n_heads // (lay.n_kv_groups or lay.n_heads)
        scores = {
            (int(r.layer), int(r.kv_group) * size + i): [float(r.score)]
            for r in src.rows.itertuples()
            for i in range(size)
        }
        how = "kv group score (group_costs.csv) given to each query head of the group, one sample"
    else:
        column = _score_column(src, cfg.score)
        scores, filled, fill = headkv_scores(src.rows, column)
        how = f"scan column {column}, one value per head (the scan's mean over its sequences)" + (
            f"; {len(filled)} heads without a score (NaN: a linear-attention layer, a head not scored) written as "
            f"{fill:g}, the column's lowest value or 0 if lower (provenance: filled)"
            if filled
            else ""
        )
    stem = f"head_score/{Path(lay.name).name or 'model'}"
    meta = {
        **src.identity(),
        "values": how,
        "keys": "layer-head (query heads, 0-indexed)",
        **({"filled": filled, "fill": fill} if src.kind == "scan" else {}),
    }
    return {f"{stem}.json": ex.headkv_text(scores), f"{stem}.provenance.json": json.dumps(meta, indent=2) + "\n"}, how


def headkv_scores(table: pd.DataFrame, column: str) -> tuple[dict, list[str], float]:
    """``({(layer, head): [score]}, the heads filled, the fill)``: every head of the table, those
    without a score (NaN) given ``min(0, the column's lowest score)``, so that HeadKV's readers,
    which reshape the values to ``[layers, heads]``, get every head and rank a filled one last."""
    fill = min(0.0, float(table[column].min()))
    scores, filled = {}, []
    for layer, head, v in zip(table["layer"], table["head"], table[column]):
        if v != v:
            filled.append(f"{int(layer)}.{int(head)}")
        scores[(int(layer), int(head))] = [fill if v != v else float(v)]
    return scores, filled, fill


def mib_files(src: Source, cfg: ExportConfig) -> tuple[dict, str]:
    """circuit_graph.json: the circuit's ``--top`` edges in the graph, every scored edge listed.

    Raises:
        HeadprobeError: the model's d_model, or whether its attention and MLP run in parallel, is
            unknown (EAP-IG's ``from_json`` builds the graph from both)."""
    lay = src.lay
    if lay.d_model is None or lay.parallel_attn_mlp is None:
        what = " and ".join(
            k for k, v in (("d_model", lay.d_model), ("parallel_attn_mlp", lay.parallel_attn_mlp)) if v is None
        )
        raise HeadprobeError(
            f"--format mib needs the model's {what} (EAP-IG's Graph.from_json reads it): "
            f"{src.path}/summary.json records no {what} and {lay.name}'s config.json does not give it or is "
            "not at hand; rerun headprobe circuit, which records it"
        )
    top = int(src.summary.get("config", {}).get("top", 20))
    edges = src.rows.to_dict("records")
    in_graph = {e["edge"] for e in edges[:top]}  # edges.csv is sorted by |score|
    graph = ex.mib_graph(edges, lay, in_graph, lay.d_model)
    patched = graph["headprobe"]["path_patched"]
    graph["headprobe"] = {
        **src.identity(),
        "method": src.summary.get("method"),
        "in_graph": f"the top {top} edges by |score|",
        "path_patched_means": "the exact direct-path patching effect of each edge patched",
        "n_path_patched": len(patched),
        "path_patched": patched,
        "task": src.summary.get("task"),
        "metric": src.summary.get("metric"),
    }
    return {"circuit_graph.json": json.dumps(graph) + "\n"}, f"{len(edges)} edges, the top {top} in the graph"


def parquet_files(src: Source, cfg: ExportConfig) -> tuple[dict, str]:
    """heads.parquet (groups.parquet, edges.parquet) with the identity in its schema metadata, and README.md."""
    table = _with_verdicts(src) if src.kind == "scan" else src.rows
    name = {"scan": "heads", "kv": "groups", "circuit": "edges"}[src.kind]
    buf = io.BytesIO()
    try:
        import pyarrow as pa  # type: ignore[import-untyped]
        import pyarrow.parquet as pq  # type: ignore[import-untyped]
    except ImportError:
        raise HeadprobeError("--format parquet needs pyarrow: pip install 'headprobe[exchange]'") from None
    arrow = pa.Table.from_pandas(table, preserve_index=False)
    arrow = arrow.replace_schema_metadata(
        {**(arrow.schema.metadata or {}), b"headprobe": json.dumps(src.identity()).encode()}
    )
    pq.write_table(arrow, buf)
    return (
        {f"{name}.parquet": buf.getvalue(), "README.md": dataset_card(src, f"{name}.parquet", table)},
        f"{len(table)} rows x {len(table.columns)} columns",
    )


def _with_verdicts(src: Source) -> pd.DataFrame:
    """head_scores.csv with, per verified head type, ``top_<type>`` (in its ablated top-k set) and
    ``confirmed_<type>`` (its tested verdict, for those heads; empty elsewhere)."""
    table = src.rows.copy()
    names = [f"{layer}.{head}" for layer, head in zip(table["layer"], table["head"])]
    primary = (src.summary.get("verification") or {}).get("primary_kind", "mean")
    for a in src.summary.get("ablations") or []:
        if a.get("kind") != primary:
            continue
        top = set(a.get("top_heads") or [])
        table[f"top_{a['head_type']}"] = [n in top for n in names]
        table[f"confirmed_{a['head_type']}"] = pd.array(
            [a.get("confirmed") if n in top else None for n in names], dtype="boolean"
        )
    return table


def dataset_card(src: Source, data_file: str, table: pd.DataFrame) -> str:
    """README.md of a Hugging Face dataset: YAML front matter (values written as JSON, which YAML reads)."""
    meta: dict[str, Any] = {
        "configs": [{"config_name": "default", "data_files": data_file}],
        "tags": ["interpretability", "attention-heads", "headprobe"],
        "headprobe": {
            **src.identity(),
            "source_kind": src.kind,
            "settings": src.summary.get("config", {}),
            "date": datetime.date.today().isoformat(),
        },
    }
    front = "".join(f"{k}: {json.dumps(v)}\n" for k, v in meta.items())
    return (
        f"---\n{front}---\n\n# headprobe {src.kind}: {src.lay.name}\n\n"
        f"One row per {'head' if src.kind == 'scan' else 'KV group' if src.kind == 'kv' else 'edge'} of "
        f"{src.lay.name} ({src.lay.n_layers} layers x {src.lay.n_heads} heads, {src.lay.n_kv_heads} KV "
        f"heads), written by `headprobe export` from a `headprobe {src.kind}` run. Definitions: headprobe's "
        f"docs/{src.kind}.md.\n\n{_columns_text(src, table)}\n"
        f'```python\nimport pandas as pd\npd.read_parquet("{data_file}")\n# or: datasets.load_dataset("parquet", '
        f'data_files="{data_file}")\n```\n'
    )


def _columns_text(src: Source, table: pd.DataFrame) -> str:
    """The card's columns: a scan's as a Markdown table of what each measures and in what unit (the
    heatmaps' titles and colour-bar labels, :data:`~headprobe.analyses.columns.COLUMN_MEANINGS`);
    other kinds' names."""
    if src.kind != "scan":
        return f"Columns: {', '.join(f'`{c}`' for c in table.columns)}.\n"
    from headprobe.analyses.columns import COLUMN_MEANINGS  # torch-free: no export imports torch

    said = {"layer": ("layer", "index from 0"), "head": ("query head in its layer", "index from 0")}
    said["kv_head"] = ("the KV head (group) it reads keys and values from", "index from 0")
    said.update(COLUMN_MEANINGS)
    k = (src.summary.get("config") or {}).get("k", "k")
    rows = ["| column | what | measured as |", "|---|---|---|"]
    for column in table.columns:
        head_type = column.split("_", 1)[1].replace("_", "-") if "_" in column else ""
        if column.startswith("top_"):
            what, unit = f"in the top-{k} set the {head_type} check ablated", "bool"
        elif column.startswith("confirmed_"):
            what, unit = f"the {head_type} verdict, for the heads ablated", "bool; empty: not ablated or no verdict"
        elif column.startswith("local_") and column[6:].isdigit():
            what, unit = f"attention on the last {column[6:]} keys", "share of the row, mean over queries"
        else:
            what, unit = said.get(column, ("see the docs", ""))
        cells = [c.replace("{W}", "W").replace("|", "\\|") for c in (what, unit)]
        if "{W}" in what:
            cells[0] += "; W is the largest local window shorter than the sequence"
        rows.append(f"| `{column}` | {cells[0]} | {cells[1]} |")
    return "\n".join(rows) + "\n"


def latex_files(src: Source, cfg: ExportConfig) -> tuple[dict, str]:
    """latex/<table>.tex: the run's tables as booktabs LaTeX (:mod:`headprobe.analyses.latex_tables`)."""
    from headprobe.analyses.latex_tables import latex_files as tables

    return tables(src.kind, src.path, src.summary)


BUILDERS = {"duo": duo_files, "headkv": headkv_files, "mib": mib_files, "parquet": parquet_files, "latex": latex_files}


def run(config: ExportConfig) -> ExportResult:
    """Every file of ``config.format`` from ``config.source``, in memory (nothing written).

    Raises:
        HeadprobeError: a bad source folder, a format the source cannot give, or no such score column."""
    src = read_source(Path(config.source))
    formats = all_formats(src) if config.format == "all" else (config.format,)
    if formats[0] not in SUPPORTED[src.kind]:
        raise HeadprobeError(
            f"--format {config.format} needs a {' or '.join(k for k, v in SUPPORTED.items() if config.format in v)} "
            f"folder; {src.path} is a {src.kind} run, written as {', '.join(SUPPORTED[src.kind])}"
        )
    formats, notes = _formats_written(config, src, formats)
    check_flags_apply(config, src, formats)
    files: dict = {}
    for fmt in formats:
        made, how = BUILDERS[fmt](src, config)
        files.update(made)
        notes[fmt] = how
    return ExportResult(config, src, files, notes)


def _formats_written(config: ExportConfig, src: Source, formats: tuple[str, ...]) -> tuple[tuple[str, ...], dict]:
    """The formats of ``formats`` written, and a ``left out: why`` note for each ``--format all`` leaves
    out: Parquet without pyarrow, LaTeX of a run with no table, an encoder scan's KV-cache files.

    Raises:
        HeadprobeError: ``--format duo`` or ``headkv`` of an encoder's scan."""
    notes: dict[str, str] = {}
    if config.format == "all" and "parquet" in formats and not _have_pyarrow():
        formats = tuple(f for f in formats if f != "parquet")  # the others need no extra: written, and this said
        notes["parquet"] = "left out: pyarrow is not installed (pip install 'headprobe[exchange]')"
    encoder = src.kind == "scan" and of_an_encoder(src.summary, list(src.rows.columns))
    if encoder and (cache := [f for f in formats if f in ("duo", "headkv")]):
        why = "KV-cache policies for causal decoders (headprobe kv refuses encoders too)"
        if config.format != "all":
            raise HeadprobeError(
                f"--format {config.format}: {src.path} is a scan of an encoder ({src.lay.name}); DuoAttention and "
                f"HeadKV files are {why}"
            )
        formats = tuple(f for f in formats if f not in cache)
        notes.update({f: f"left out: the scan is of an encoder; its files are {why}" for f in cache})
    if config.format == "all" and "latex" in SUPPORTED[src.kind] and "latex" not in formats:
        notes["latex"] = f"left out: this {src.kind} run has no table to set (a scan with --no-verify has no verdicts)"
    return formats, notes


def _have_pyarrow() -> bool:
    """Whether pandas' Parquet engine imports (the ``exchange`` extra; usually there through datasets)."""
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        return False
    return True


def all_formats(src: Source) -> tuple[str, ...]:
    """What ``--format all`` writes of ``src``: every format of its kind, LaTeX where the run has a
    table (not a scan run with --no-verify, which has no verdicts)."""
    from headprobe.analyses.latex_tables import has_tables

    return tuple(f for f in SUPPORTED[src.kind] if f != "latex" or has_tables(src.kind, src.summary))


def check_flags_apply(config: ExportConfig, src: Source, formats: tuple[str, ...]) -> None:
    """Refuse a flag that nothing written would use, where the source decides it (the format alone
    decides before the source is read: :class:`~headprobe.commands.export.ExportConfig`'s ``needs``):
    ``--score`` but for a scan's duo or headkv files, ``--sink`` / ``--recent`` but for a scan's duo
    files (a kv policy has its own).

    Raises:
        HeadprobeError: one line naming the flag and why it cannot apply."""
    given = [f for f, v in (("--sink", config.sink), ("--recent", config.recent)) if v is not None]
    if given and src.kind == "kv" and "duo" in formats:
        raise HeadprobeError(
            f"{' and '.join(given)}: {src.path} is a kv run, whose policy.json gives its own sink and recent "
            "sizes (written as sink_size and recent_size); leave them out, or run headprobe kv with other ones"
        )
    if given and (src.kind != "scan" or "duo" not in formats):
        raise HeadprobeError(
            f"{' and '.join(given)}: for a scan folder's duo files; --format {config.format} of a {src.kind} run "
            f"writes {', '.join(formats)}, which have no sink or recent size"
        )
    if config.score is not None and (src.kind != "scan" or not {"duo", "headkv"} & set(formats)):
        why = (
            f"{src.path} is a {src.kind} run, which has "
            + ("one score" if src.kind in ("kv", "circuit") else "no DuoAttention or HeadKV files")
            if src.kind != "scan"
            else f"--format {config.format} writes every score column"
        )
        raise HeadprobeError(f"--score {config.score}: for a scan folder's duo and headkv files; {why}")


@notes_flags("export")
def export(source: str, out: str | None = None, **fields) -> ExportResult:
    """``headprobe export`` as a function: the files built (``result.files``) and, with ``out``,
    written.

    Returns:
        ExportResult: ``files`` (relative path -> text or bytes) and ``notes`` (format -> how its files
            were made); written into ``out`` already where given, else by ``save(out)``.

    Raises:
        HeadprobeError: as :func:`run`, a bad ``out``, or ``sink``, ``recent`` or ``score`` with a
            ``format`` that has no room for them; a message naming flags has a note giving their Python spelling (``e.__notes__``).
        TypeError: an unknown field (naming the setting meant, :func:`headprobe.options.check_fields`)."""
    from headprobe.options import check_fields, config_inputs
    from headprobe.settings import given_in_python, refuse_inert

    check_fields(ExportConfig, fields, "export", positional=("source", "out"), accepts=export)
    config = ExportConfig(source=source, out=out, **fields)
    refuse_inert(config, given_in_python(ExportConfig, fields))  # sink= with format="headkv": as the flags
    if config.out:
        check_out(config)  # before the source is read
    result = run(config)
    result.inputs = config_inputs(config)  # what result.save(overwrite=True) must not remove
    if config.out:
        result.save(config.out, overwrite=config.overwrite)
    return result
