"""Head files other tools read, written and read back (torch-free): DuoAttention's
``full_attention_heads.tsv`` + ``config.json``, Retrieval_Head / HeadKV's ``{"layer-head":
[scores]}`` JSON, EAP-IG / MIB circuit graphs and a plain ``layer.head`` list. The shape of each is
checked against a model's layout in one line (a file's rows and columns against the model's layers and KV heads).

Sources of each format (read, not copied):

* DuoAttention (arXiv:2410.10819): ``duo_attn/utils.py`` ``load_attn_pattern`` in
  mit-han-lab/duo-attention (fe93c31), and kvpress's ``DuoAttentionPress.load_attention_pattern``
  (``kvpress/presses/duo_attention_press.py``): ``np.loadtxt(..., dtype=float, delimiter="\\t")``
  clipped to [0, 1], ``[n_layers, n_kv_heads]``, no header; ``config.json`` gives ``sink_size`` and
  ``recent_size`` (other keys are ignored by both). A KV group keeps a full cache where its value
  is ``> 0.5`` (DuoAttention's eval patch: ``full_attention_heads > 0.5`` in
  ``duo_attn/patch/llama.py``, ``mistral.py`` and ``utils.py``). Its published patterns hold
  trained gates a little below 0 (to -0.0014), which both readers clip.
* Retrieval_Head (Wu et al. 2024, nightdessert/Retrieval_Head ``head_score/<model>.json``) and
  HeadKV (FYYFU/HeadKV): one line of JSON, ``{"<layer>-<head>": [per-sample scores]}``, read with
  ``json.loads(file.readline())`` and ranked by the mean; query heads; no other key.
* EAP-IG (hannamw/EAP-IG ``src/eap/graph.py`` at 795f560 and 7af394a, the commit MIB-circuit-track
  pins), the format of the MIB circuit track: ``Graph.to_json`` writes ``{"cfg": {"n_layers",
  "n_heads", "parallel_attn_mlp", "d_model"}, "nodes": {name: {"in_graph": bool}}, "edges":
  {"<parent>-><child>[<q|k|v>]": {"score": float, "in_graph": bool}}}``, nodes ``input``,
  ``a{l}.h{h}``, ``m{l}``, ``logits`` in that order; ``Graph.from_json`` and MIB's
  ``load_graph_from_json`` rebuild the graph from ``cfg`` (``from_model`` reads all four keys;
  ``from_pt`` the first three), read each node's ``in_graph`` by value, assert the keys ``cfg``,
  ``nodes`` and ``edges`` and look every node and edge up in ``Graph.from_model(cfg)``'s (a
  KeyError for any other name). ``Graph.to_pt`` saves ``cfg``, ``src_nodes``, ``dst_nodes`` and the
  tensors ``edges_scores``, ``edges_in_graph`` ``[n_src, n_dst]`` and ``nodes_in_graph`` ``[n_src]``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.core.heads import Head, format_head, parse_heads
from headprobe.probe.core.io import read_json, read_text_file
from headprobe.probe.layout.attention import KVPolicy, Streaming

DUO_TSV = "full_attention_heads.tsv"
DUO_CONFIG = "config.json"
DUO_THRESHOLD = 0.5
"""A KV group with a value strictly above this keeps a full cache (DuoAttention's eval patch,
``full_attention_heads > 0.5``; a group at exactly 0.5 streams)."""
DUO_SLACK = 0.01
"""How far outside [0, 1] a DuoAttention value may lie and still be clipped, as its readers clip
it (trained gates overshoot by about 1e-3); a value further out is no gate value and is refused."""
FORMATS = ("duo", "headkv", "mib", "parquet")
IMPORT_KINDS = ("duo", "headkv", "mib", "parquet", "csv", "kv-policy", "list")

_HEADKV_KEY = re.compile(r"^(\d+)-(\d+)$")
_MIB_HEAD = re.compile(r"^a(\d+)\.h(\d+)$")
_MIB_SRC = re.compile(r"^(?:input|a(\d+)\.h\d+|m(\d+))$")
"""A source node of EAP-IG's graph (``to_pt``'s ``src_nodes``): ``input``, ``a{l}.h{h}``, ``m{l}``."""
_MIB_DST = re.compile(r"^(?:a(\d+)\.h\d+<[qkv]>|m(\d+)|logits)$")
"""A destination node of EAP-IG's graph (``to_pt``'s ``dst_nodes``): ``a{l}.h{h}<q|k|v>``, ``m{l}``, ``logits``."""
_MIB_EDGE = re.compile(
    r"^(?P<parent>input|a(?P<pl>\d+)\.h(?P<ph>\d+)|m(?P<pm>\d+))->"
    r"(?P<child>a(?P<cl>\d+)\.h(?P<ch>\d+)<[qkv]>|m(?P<cm>\d+)|logits)$"
)
"""An edge name of EAP-IG's graph (``Edge.name``): ``<parent>-><child>``, ``<q|k|v>`` after a head child."""
MIB_JSON_KEYS = ("cfg", "nodes", "edges")
"""The keys of EAP-IG's graph JSON that its ``Graph.from_json`` asserts (``to_json`` writes all three)."""
MIB_PT_KEYS = ("cfg", "src_nodes", "dst_nodes", "edges_scores", "edges_in_graph", "nodes_in_graph")
"""The keys of EAP-IG's ``Graph.to_pt`` file that its ``from_pt`` requires."""
MIB_CFG_KEYS = ("n_layers", "n_heads", "parallel_attn_mlp", "d_model")
"""The keys of a graph JSON's ``cfg``: ``Graph.to_json`` writes them (a graph from a model) and
``from_json`` builds the graph from all four (``from_model(cfg, neuron_level=True)`` reads ``d_model``)."""
MIB_PT_CFG_KEYS = MIB_CFG_KEYS[:3]
"""The keys of a ``.pt`` graph's ``cfg`` that ``from_pt`` builds the graph from (``from_model(cfg)``
reads no ``d_model``; ``to_pt`` saves it where the graph has it, and it is then checked)."""
PT_SUFFIXES = (".pt", ".pth")


@dataclass(frozen=True)
class Layout:
    """What a head file is checked against: the model's name and its sizes (``n_kv_groups``: KV
    heads, or 1 per layer for MLA's latent; ``d_model``: the residual width; ``parallel_attn_mlp``:
    attention and MLP read the same residual; None where unknown)."""

    name: str
    n_layers: int
    n_heads: int
    n_kv_heads: int | None = None
    n_kv_groups: int | None = None
    d_model: int | None = None
    parallel_attn_mlp: bool | None = None

    def identity(self) -> dict[str, Any]:
        return {"model": self.name, "n_layers": self.n_layers, "n_heads": self.n_heads, "n_kv_heads": self.n_kv_heads}


@dataclass
class HeadFile:
    """A head file read back: its ``kind`` (:data:`IMPORT_KINDS`), the ``heads`` it names (a set, or
    the top ``k`` of its ``scores``), ``scores`` (``{(layer, head): score}``, where it has them),
    ``policy`` (DuoAttention and policy files: full groups above the threshold, the rest
    streaming), ``meta`` (what the file says of itself), how the heads were chosen (``rule``) and,
    where the top ``k`` cut through heads of equal score, that tie (``cut_tie``, :func:`cut_tie`)."""

    kind: str
    heads: list[Head]
    rule: str
    scores: dict[Head, float] = field(default_factory=dict)
    policy: KVPolicy | None = None
    meta: dict = field(default_factory=dict)
    cut_tie: dict[str, Any] | None = None


def group_heads(groups: list[tuple[int, int]], n_heads: int, n_kv_groups: int) -> list[Head]:
    """The query heads of KV groups ``(layer, kv_group)`` (``n_heads / n_kv_groups`` consecutive heads each)."""
    size = n_heads // n_kv_groups
    return [(layer, g * size + i) for layer, g in groups for i in range(size)]


# --- DuoAttention ---------------------------------------------------------------------------------


def duo_text(values: list[list[float]]) -> str:
    """The TSV: one row per layer, one tab-separated value per KV group, no header."""
    return "".join("\t".join(f"{float(v):.6f}" for v in row) + "\n" for row in values)


def duo_config(sink: int, recent: int, identity: dict, how: str) -> dict:
    """config.json: DuoAttention's two keys, then what headprobe adds (ignored by its readers)."""
    return {
        "sink_size": int(sink),
        "recent_size": int(recent),
        "headprobe": {
            **identity,
            "values": how,
            "rows": "layers",
            "columns": "KV groups (key/value heads)",
            "threshold": DUO_THRESHOLD,
            "full_cache": f"value > {DUO_THRESHOLD}",
        },
    }


def policy_values(policy: KVPolicy) -> tuple[list[list[float]], int, int]:
    """A KV policy as DuoAttention values (1 full, 0 streaming) and its one ``(sink, window)``.

    Raises:
        HeadprobeError: streaming groups with different sinks or windows (DuoAttention has one)."""
    spans = {(s.sink, s.window) for row in policy.groups for s in row if s is not None}
    if len(spans) > 1:
        raise HeadprobeError(
            f"the policy's streaming groups use {len(spans)} different (sink, window) pairs; "
            "DuoAttention's config.json has one sink_size and one recent_size"
        )
    sink, window = spans.pop() if spans else (0, 0)
    return [[1.0 if s is None else 0.0 for s in row] for row in policy.groups], sink, window


def read_duo(path: Path, layout: Layout | None) -> HeadFile:
    """A DuoAttention pattern (the TSV, or its folder), as ``load_attn_pattern`` reads it (values
    clipped to [0, 1]), checked against ``layout``; groups above :data:`DUO_THRESHOLD` keep a full cache.

    Raises:
        HeadprobeError: unreadable, not numbers, NaN or infinite values, values outside
            [-:data:`DUO_SLACK`, 1 + :data:`DUO_SLACK`], or rows/columns that are not the model's.
    """
    import numpy as np

    tsv = path / DUO_TSV if path.is_dir() else path
    check_duo_files(tsv)
    try:
        values = np.atleast_2d(np.loadtxt(tsv, dtype=float, delimiter="\t"))
    except (OSError, ValueError) as err:
        raise HeadprobeError(f"cannot read {tsv.name} as DuoAttention's tab-separated numbers: {err}") from None
    values = clip_duo(values, tsv.name)
    config_path = tsv.parent / DUO_CONFIG
    config = json.loads(config_path.read_text(encoding="utf-8-sig")) if config_path.is_file() else {}
    if layout is not None:
        check_duo_shape(values.shape, layout, tsv.name)
    rows, cols = values.shape
    full = [(int(layer), int(g)) for layer, g in zip(*np.nonzero(values > DUO_THRESHOLD))]
    policy = None
    if isinstance(config.get("sink_size"), int) and isinstance(config.get("recent_size"), int):
        policy = KVPolicy.with_full(
            rows,
            cols,
            full,
            Streaming(config["sink_size"], config["recent_size"]),
            model=str(config.get("headprobe", {}).get("model", "")),
        )
    n_heads = layout.n_heads if layout is not None else cols
    heads = group_heads(full, n_heads, cols)
    return HeadFile(
        "duo",
        heads,
        f"query heads of the KV groups with a value > {DUO_THRESHOLD}",
        {(layer, g): float(values[layer, g]) for layer in range(rows) for g in range(cols)},
        policy,
        {
            **config.get("headprobe", {}),
            "sink_size": config.get("sink_size"),
            "recent_size": config.get("recent_size"),
            "shape": [rows, cols],
        },
    )


def check_duo_files(tsv: Path) -> None:
    """Refuse, before numpy reads them, a DuoAttention TSV with no values (empty, or only blank
    and ``#`` lines, which ``np.loadtxt`` reads as an empty array), one whose rows hold different
    numbers of tab-separated values (named by line number, as ``np.loadtxt`` does not), and a
    ``config.json`` beside it that is not a JSON object (cut, or another file).

    Raises:
        HeadprobeError: one line naming the file."""
    try:
        lines = tsv.read_text(encoding="utf-8-sig").splitlines()
    except (OSError, UnicodeDecodeError):
        return  # np.loadtxt's own refusal names it
    rows = [(n, line.split("#", 1)[0]) for n, line in enumerate(lines, 1) if line.split("#", 1)[0].strip()]
    if not rows:
        raise HeadprobeError(
            f"{tsv.name} holds no values (DuoAttention's file has one row per layer, one value per KV head)"
        )
    widths = [(n, len(text.split("\t"))) for n, text in rows]
    if odd := next(((n, w) for n, w in widths if w != widths[0][1]), None):
        raise HeadprobeError(
            f"{tsv.name} line {odd[0]} has {odd[1]} values where line {widths[0][0]} has {widths[0][1]} "
            "(DuoAttention's file has one row per layer, one tab-separated value per KV head)"
        )
    config = tsv.parent / DUO_CONFIG
    if config.is_file() and not isinstance(load_json(config), dict):
        raise HeadprobeError(
            f"{config.name} beside {tsv.name} is not a JSON object (DuoAttention's sink_size and recent_size)"
        )


def clip_duo(values: Any, name: str = DUO_TSV) -> Any:
    """DuoAttention values ``[layer, kv_group]`` clipped to [0, 1] as ``load_attn_pattern`` and
    kvpress clip them (a new array).

    Raises:
        HeadprobeError: a NaN or infinite value, or one outside [-:data:`DUO_SLACK`, 1 + :data:`DUO_SLACK`]."""
    import numpy as np

    if not np.isfinite(values).all():
        raise HeadprobeError(f"{name} holds NaN or infinite values (DuoAttention's gate values are numbers in [0, 1])")
    lo, hi = float(values.min()), float(values.max())
    if lo < -DUO_SLACK or hi > 1 + DUO_SLACK:
        raise HeadprobeError(
            f"{name} holds {lo if lo < -DUO_SLACK else hi:g}, outside [{-DUO_SLACK:g}, {1 + DUO_SLACK:g}] "
            "(DuoAttention's gate values are in [0, 1]; its readers clip only a trained gate's overshoot)"
        )
    return np.clip(values, 0.0, 1.0)


def check_duo_shape(shape: tuple[int, ...], layout: Layout, name: str = DUO_TSV) -> None:
    """One line naming the mismatch of a DuoAttention file's ``[rows, columns]`` with the model."""
    rows, cols = shape
    if rows != layout.n_layers:
        raise HeadprobeError(f"{name} has {rows} rows; {layout.name} has {layout.n_layers} layers")
    if layout.n_kv_groups is not None and cols != layout.n_kv_groups:
        raise HeadprobeError(f"{name} has {cols} columns; {layout.name} has {layout.n_kv_groups} KV heads per layer")


# --- Retrieval_Head / HeadKV ----------------------------------------------------------------------


def headkv_text(scores: dict[Head, list[float]]) -> str:
    """The one-line JSON, heads in layer-major order (readers reshape the values to ``[layers, heads]``)."""
    return json.dumps({f"{layer}-{head}": [float(x) for x in v] for (layer, head), v in sorted(scores.items())}) + "\n"


def read_headkv(data: dict, name: str, layout: Layout | None, k: int) -> HeadFile:
    """A Retrieval_Head / HeadKV score file: each head's mean score; the heads are the top ``k``.

    Raises:
        HeadprobeError: a key that is not ``layer-head``, an empty or non-numeric list, or a head outside the model.
    """
    scores: dict[Head, float] = {}
    for key, values in data.items():
        m = _HEADKV_KEY.fullmatch(str(key))
        if (
            m is None
            or not isinstance(values, list)
            or not values
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
        ):
            raise HeadprobeError(f'{name}: entry {key!r} is not "layer-head": [scores] (Retrieval_Head\'s format)')
        head = (int(m.group(1)), int(m.group(2)))
        if layout is not None and (head[0] >= layout.n_layers or head[1] >= layout.n_heads):
            raise HeadprobeError(
                f"{name} names head {key}; {layout.name} has {layout.n_layers} layers of {layout.n_heads} heads"
            )
        scores[head] = mean_score(values, name, key)
    if layout is not None and len(scores) > layout.n_layers * layout.n_heads:
        raise HeadprobeError(f"{name} has {len(scores)} heads; {layout.name} has {layout.n_layers * layout.n_heads}")
    return HeadFile("headkv", top_k(scores, k), f"the top {k} heads by mean score", scores, cut_tie=cut_tie(scores, k))


def finite_score(value: Any, name: str, where: str) -> float:
    """``value`` as a float, refused unless finite (a 400-digit integer overflows a float; JSON's
    ``1e400`` reads as infinity).

    Raises:
        HeadprobeError: one line naming ``name`` and ``where`` in it."""
    try:
        x = float(value)
    except (OverflowError, TypeError, ValueError):
        x = float("nan")
    if x != x or x in (float("inf"), float("-inf")):
        raise HeadprobeError(
            f"{name}: the score of {where} is not a finite number ({str(value)[:20]}"
            f"{'...' if len(str(value)) > 20 else ''})"
        )
    return x


def mean_score(values: list, name: str, key: str) -> float:
    """The mean of a head's finite scores (:func:`finite_score`; summed as ``x / n`` so that large
    finite scores do not overflow)."""
    xs = [finite_score(v, name, key) for v in values]
    return finite_score(sum(x / len(xs) for x in xs), name, key)


TIE_ORDER = "layer-major"
"""How :func:`top_k` orders heads of equal score: by layer, then head."""


def top_k(scores: dict[Head, float], k: int) -> list[Head]:
    """The ``k`` highest-scoring heads (ties: :data:`TIE_ORDER`), NaN never among them."""
    return sorted(_ranked(scores)[:k])


def _ranked(scores: dict[Head, float]) -> list[Head]:
    return sorted((h for h, v in scores.items() if v == v), key=lambda h: (-scores[h], h))


def cut_tie(scores: dict[Head, float], k: int) -> dict[str, Any] | None:
    """The tie the top ``k`` (:func:`top_k`) cuts through, or None: where the ``k``-th and
    ``(k+1)``-th ranked heads score the same, which of the tied heads are taken is decided by
    :data:`TIE_ORDER` alone (a kv folder's HeadKV export gives a KV group's score to each of its
    query heads, so a cut inside a group splits it). Keys: ``k``, ``score``, ``n_tied`` (heads of
    that score), ``n_taken`` (of them in the top ``k``), ``order`` and ``tied_heads`` (``layer.head``,
    in that order)."""
    ranked = _ranked(scores)
    if not 0 < k < len(ranked) or scores[ranked[k - 1]] != scores[ranked[k]]:
        return None
    score = scores[ranked[k - 1]]
    tied = [h for h in ranked if scores[h] == score]
    return {
        "k": k,
        "score": score,
        "n_tied": len(tied),
        "n_taken": sum(h in ranked[:k] for h in tied),
        "order": TIE_ORDER,
        "tied_heads": [format_head(h) for h in tied],
    }


def tie_note(hf: HeadFile) -> str | None:
    """One line on the tie the file's top ``k`` cut through (:func:`cut_tie`), or None."""
    t = hf.cut_tie
    if t is None:
        return None
    names = t["tied_heads"]
    listed = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
    return (
        f"the top {t['k']} cut through a tie: {t['n_tied']} heads score {t['score']:.6g} "
        f"({listed}) and {t['n_taken']} of them "
        f"{'was' if t['n_taken'] == 1 else 'were'} taken, in {t['order']} order (layer, then head); "
        "which of them are checked is arbitrary"
    )


# --- EAP-IG / MIB ---------------------------------------------------------------------------------


def mib_node(name: str) -> str:
    """headprobe's ``5.1`` -> ``a5.h1``; ``logits`` stays."""
    if name == "logits":
        return name
    layer, head = name.split(".")
    return f"a{layer}.h{head}"


def mib_nodes(n_layers: int, n_heads: int) -> list[str]:
    """EAP-IG's nodes in its order (``Graph.from_model``): ``input``, per layer its heads then its MLP, ``logits``."""
    return [
        "input",
        *(n for layer in range(n_layers) for n in (*(f"a{layer}.h{h}" for h in range(n_heads)), f"m{layer}")),
        "logits",
    ]


def _mib_dst_nodes(n_layers: int, n_heads: int) -> list[str]:
    """EAP-IG's destination nodes in its order (``Graph.get_dst_nodes``, ``to_pt``'s ``dst_nodes``):
    per layer every head's ``<q>``, then every ``<k>``, every ``<v>``, then ``m{l}``; ``logits`` last."""
    return [
        *(
            n
            for layer in range(n_layers)
            for n in (*(f"a{layer}.h{h}<{x}>" for x in "qkv" for h in range(n_heads)), f"m{layer}")
        ),
        "logits",
    ]


def mib_graph(edges: list[dict], layout: Layout, in_graph: set[str], d_model: int) -> dict:
    """EAP-IG's graph JSON (``Graph.to_json``'s layout) from headprobe edges (``edge``, ``sender``,
    ``receiver``, ``input``, ``score``, ``exact``): ``in_graph`` names the edges of the circuit.

    Every node EAP-IG makes is listed as ``{"in_graph": bool}``: in the graph, the endpoints of
    the circuit's edges and ``logits`` (always, as in EAP-IG); each scored edge as ``{"score",
    "in_graph"}``. MLP and input edges are not scored by headprobe, so not listed (``from_json``
    leaves an unlisted edge at score 0, out of the graph). ``cfg`` holds the four keys
    ``from_json`` rebuilds the graph from (``parallel_attn_mlp``: the layout's; with it true EAP-IG
    makes no edge from a layer's heads to its MLP). The path-patched effects go under the
    ``headprobe`` key, ``{"path_patched": {edge name: effect}}``.

    Raises:
        HeadprobeError: ``layout.parallel_attn_mlp`` is unknown (None)."""
    if layout.parallel_attn_mlp is None:
        raise HeadprobeError(
            f"{layout.name}: whether attention and MLP run in parallel is unknown; EAP-IG's graph "
            "(cfg parallel_attn_mlp) needs it"
        )
    nodes = {name: False for name in mib_nodes(layout.n_layers, layout.n_heads)}
    nodes["logits"] = True
    out_edges, patched = {}, {}
    for e in edges:
        child = mib_node(e["receiver"])
        name = f"{mib_node(e['sender'])}->{child}" + ("" if child == "logits" else f"<{e['input']}>")
        out_edges[name] = {"score": float(e["score"]), "in_graph": e["edge"] in in_graph}
        if e.get("exact") is not None and e["exact"] == e["exact"]:
            patched[name] = float(e["exact"])
        if out_edges[name]["in_graph"]:
            nodes[mib_node(e["sender"])] = nodes[child] = True
    cfg = {
        "n_layers": layout.n_layers,
        "n_heads": layout.n_heads,
        "parallel_attn_mlp": bool(layout.parallel_attn_mlp),
        "d_model": int(d_model),
    }
    return {
        "cfg": cfg,
        "nodes": {n: {"in_graph": v} for n, v in nodes.items()},
        "edges": out_edges,
        "headprobe": {"path_patched": patched},
    }


def _node_in_graph(name: str, node: str, value: Any) -> bool:
    """A node's ``in_graph``: ``{"in_graph": bool, ...}`` as ``to_json`` writes it, or a bare
    boolean (the form ``from_json``'s docstring describes). Checked for every node, heads or not:
    ``from_json`` sets each node's flag from the value (a string ``"false"`` would be true). A
    ``score`` (``to_json`` writes one where the graph has node scores) must be a number; NaN is
    allowed (EAP-IG's mark of a node left unscored).

    Raises:
        HeadprobeError: neither form, or a score that is no number (a boolean is none)."""
    flag = value.get("in_graph") if isinstance(value, dict) else value
    if not isinstance(flag, bool):
        raise HeadprobeError(
            f'{name}: node {node!r} is {json.dumps(value)[:60]}, not {{"in_graph": true|false}} (EAP-IG\'s graph JSON)'
        )
    score = value.get("score", 0.0) if isinstance(value, dict) else 0.0
    if not isinstance(score, (int, float)) or isinstance(score, bool):
        raise HeadprobeError(f"{name}: node {node!r} has score {json.dumps(score)[:40]}, not a number")
    return flag


def _check_mib_cfg(cfg: Any, name: str, layout: Layout | None, required: tuple[str, ...] = MIB_CFG_KEYS) -> None:
    """``cfg``'s n_layers, n_heads, d_model and parallel_attn_mlp: the ``required`` ones given
    (:data:`MIB_CFG_KEYS`, a JSON's; :data:`MIB_PT_CFG_KEYS`, a ``.pt``'s), each one of its type (a
    positive whole number; a boolean), and against the model's where both are known: a graph built
    for parallel attention and MLP lacks the edges from a layer's heads to its MLP that a sequential
    model has, and the other way round.

    Raises:
        HeadprobeError: ``cfg`` not an object, a required key missing, a key of another type, or
            another model's (one line)."""
    if not isinstance(cfg, dict):
        raise HeadprobeError(f"{name}: cfg is {json.dumps(cfg)[:40]}, not an object (EAP-IG's graph config)")
    if missing := [k for k in required if k not in cfg]:
        why = (
            "Graph.to_json writes n_layers, n_heads, parallel_attn_mlp and d_model, and from_json builds the graph "
            "from all four"
            if required == MIB_CFG_KEYS
            else "Graph.to_pt saves the graph's cfg, and from_pt builds the graph from its n_layers, n_heads and "
            "parallel_attn_mlp"
        )
        raise HeadprobeError(f"{name}: cfg has no {' or '.join(missing)} (EAP-IG's {why})")
    for key in ("n_layers", "n_heads", "d_model"):
        v = cfg.get(key)
        if key in cfg and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise HeadprobeError(f"{name}: cfg {key} is {json.dumps(v)[:40]}, not a whole number >= 1")
    if "parallel_attn_mlp" in cfg and not isinstance(cfg["parallel_attn_mlp"], bool):
        raise HeadprobeError(
            f"{name}: cfg parallel_attn_mlp is {json.dumps(cfg['parallel_attn_mlp'])[:40]}, not true or false"
        )
    if layout is None:
        return
    for key, size in (("n_layers", layout.n_layers), ("n_heads", layout.n_heads), ("d_model", layout.d_model)):
        if isinstance(cfg.get(key), int) and size is not None and cfg[key] != size:
            raise HeadprobeError(f"{name} is a graph of {key} {cfg[key]}; {layout.name} has {size}")
    flag, own = cfg.get("parallel_attn_mlp"), layout.parallel_attn_mlp
    if isinstance(flag, bool) and own is not None and flag != own:
        raise HeadprobeError(
            f"{name} is a graph of parallel_attn_mlp {str(flag).lower()}; {layout.name}'s attention and MLP run "
            f"{'in parallel' if own else 'one after the other'} (parallel_attn_mlp {str(own).lower()})"
        )


def read_mib(
    data: dict,
    name: str,
    layout: Layout | None,
    scores: dict[Head, float] | None = None,
    cfg_keys: tuple[str, ...] = MIB_CFG_KEYS,
) -> HeadFile:
    """An EAP-IG / MIB graph: the heads are the attention nodes whose ``in_graph`` is true; each
    head's score is the largest |score| of its outgoing edges (``scores``: given, else from ``edges``).

    Raises:
        HeadprobeError: no ``cfg``, ``nodes`` or (``scores`` not given) ``edges``, the keys
            ``Graph.from_json`` asserts; a ``cfg`` without one of ``cfg_keys`` (:data:`MIB_CFG_KEYS`),
            of another model (n_layers, n_heads, d_model, parallel_attn_mlp); a node name that is
            none of EAP-IG's graph of ``cfg`` (:func:`_mib_node_known`), a node without a boolean
            ``in_graph`` or with a score that is no number, an edge whose score is no finite number
            or whose ``in_graph`` is no boolean (:func:`_mib_edge_scores`), or an edge that graph
            does not have (:func:`_mib_edge_parent`).
    """
    missing = [k for k in MIB_JSON_KEYS if k not in data and not (k == "edges" and scores is not None)]
    if missing:  # a graph without edges was read as heads without scores
        raise HeadprobeError(
            f"{name} has no {' or '.join(map(json.dumps, missing))} (EAP-IG's graph JSON: Graph.from_json needs "
            "cfg, nodes and edges)"
        )
    cfg, nodes = data["cfg"], data["nodes"]
    if not isinstance(nodes, dict):
        raise HeadprobeError(f"{name}: nodes is {json.dumps(nodes)[:40]}, not an object of nodes (EAP-IG's graph JSON)")
    _check_mib_cfg(cfg, name, layout, cfg_keys)  # the model's sizes, where given, are cfg's
    n_layers, n_heads, parallel = cfg["n_layers"], cfg["n_heads"], cfg["parallel_attn_mlp"]
    heads = []
    for node, value in nodes.items():
        if not _mib_node_known(str(node), n_layers, n_heads):
            raise HeadprobeError(
                f"{name}: node {str(node)[:40]!r} is no node of EAP-IG's graph of {n_layers} layers x {n_heads} "
                "heads (input, a{l}.h{h}, m{l}, logits: Graph.from_json looks each one up)"
            )
        in_graph = _node_in_graph(name, node, value)  # every node's, as from_json reads each
        if in_graph and (m := _MIB_HEAD.fullmatch(str(node))):
            heads.append((int(m.group(1)), int(m.group(2))))
    if scores is None:
        scores = {}
        for edge, score in _mib_edge_scores(data["edges"], name).items():
            if (sender := _mib_edge_parent(edge, name, n_layers, n_heads, parallel)) is not None:
                scores[sender] = max(scores.get(sender, 0.0), abs(score))
    return HeadFile(
        "mib", sorted(heads), "the attention nodes in the graph (in_graph true)", scores, meta=data.get("headprobe", {})
    )


def _mib_node_known(node: str, n_layers: int, n_heads: int) -> bool:
    """Whether ``node`` is a node name of EAP-IG's graph of ``n_layers`` x ``n_heads``
    (``Graph.from_model``'s: ``input``, ``a{l}.h{h}``, ``m{l}``, ``logits``, numbers written as it
    writes them: ``a0.h01`` is none), found without listing the graph's nodes."""
    if node in ("input", "logits"):
        return True
    m = re.fullmatch(r"a(\d+)\.h(\d+)|m(\d+)", node)
    if m is None:
        return False
    layer, head = int(m.group(1) or m.group(3)), int(m.group(2) or 0)
    return node == (f"a{layer}.h{head}" if m.group(1) else f"m{layer}") and layer < n_layers and head < n_heads


def _mib_writes_at(parent: str) -> int:
    """Where source node ``parent`` (:data:`_MIB_SRC`) writes into the residual stream, in EAP-IG's
    forward order counted by layers, not by nodes (so without ``n_heads``, which EAP-IG's
    ``prev_index`` counts in): ``input`` 0, layer ``l``'s heads ``2l + 1``, its MLP ``2l + 2``. A
    destination reads a source iff the source writes before :func:`_mib_reads_before` of it: the one
    rule of both readers (the JSON's edge check, the ``.pt``'s real-edge mask).

    Raises:
        ValueError: ``parent`` is no source name (the callers match it first)."""
    m = _MIB_SRC.fullmatch(parent)
    if m is None:
        raise ValueError(parent)
    if m.group(1) is not None:
        return 2 * int(m.group(1)) + 1
    return 0 if m.group(2) is None else 2 * int(m.group(2)) + 2


def _mib_reads_before(child: str, parallel: bool) -> float:
    """The position (:func:`_mib_writes_at`) before which destination ``child`` (:data:`_MIB_DST`)
    reads every source, as EAP-IG's ``Graph.from_model`` wires it: a head of layer ``l`` (any of
    ``<q|k|v>``) the layers before its own (``2l + 1``), an MLP also its own layer's heads
    (``2l + 2``) unless ``parallel`` (then ``2l + 1``), ``logits`` every node (infinity).

    Raises:
        ValueError: ``child`` is no destination name (the callers match it first)."""
    m = _MIB_DST.fullmatch(child)
    if m is None:
        raise ValueError(child)
    if m.group(1) is not None:
        return 2 * int(m.group(1)) + 1
    return float("inf") if m.group(2) is None else 2 * int(m.group(2)) + (1 if parallel else 2)


def _mib_edge_parent(edge: str, name: str, n_layers: int, n_heads: int, parallel: bool) -> Head | None:
    """The head an edge of EAP-IG's graph leaves (None: it leaves ``input`` or an MLP), the edge
    checked against the graph ``Graph.from_model`` builds (``from_json`` looks every edge up there):
    ``<parent>-><child>`` with parent ``input``, ``a{l}.h{h}`` or ``m{l}`` and child
    ``a{l}.h{h}<q|k|v>``, ``m{l}`` or ``logits``; each node inside the sizes and the child reading
    the parent (:func:`_mib_reads_before`: a head reads the layers before its own; an MLP its own
    layer's heads too, unless ``parallel``; ``logits`` every node).

    Raises:
        HeadprobeError: another name, or an edge that graph lacks: one line naming the edge."""
    m = _MIB_EDGE.fullmatch(edge)
    if m is None:
        raise HeadprobeError(
            f"{name}: edge {edge!r} is no EAP-IG edge name (<parent>-><child>: parent input, a{{l}}.h{{h}} or "
            "m{l}; child a{l}.h{h}<q|k|v>, m{l} or logits)"
        )
    g = {k: int(v) for k, v in m.groupdict().items() if v is not None and k not in ("parent", "child")}
    layers = [g[k] for k in ("pl", "pm", "cl", "cm") if k in g]
    heads = [g[k] for k in ("ph", "ch") if k in g]
    if max(layers, default=-1) >= n_layers or max(heads, default=-1) >= n_heads:
        raise HeadprobeError(
            f"{name}: edge {edge!r} names a node outside the graph's {n_layers} layers of {n_heads} heads"
        )
    parent_head = "ph" in g
    if _mib_writes_at(m.group("parent")) >= _mib_reads_before(m.group("child"), parallel):
        raise HeadprobeError(
            f"{name}: edge {edge!r} is no edge of EAP-IG's graph (its child does not read its parent"
            + ("; parallel_attn_mlp true)" if parent_head and "cm" in g else ")")
        )
    return (g["pl"], g["ph"]) if parent_head else None


def _mib_edge_scores(edges: Any, name: str) -> dict[str, float]:
    """Every edge's score of a graph JSON's ``edges`` (``{name: {"score": number, "in_graph": bool}}``,
    as ``Graph.to_json`` writes and ``from_json`` reads both keys), MLP and input edges included.

    Raises:
        HeadprobeError: ``edges`` not an object, or an edge that is not such an object, whose score
            is missing, not a number (a boolean is none) or not finite, or whose in_graph is missing
            or not a boolean: one line naming the edge and the value."""
    if not isinstance(edges, dict):
        raise HeadprobeError(f"{name}: edges is {json.dumps(edges)[:40]}, not an object of edges")
    out = {}
    for edge, info in edges.items():
        if not isinstance(info, dict):
            raise HeadprobeError(
                f'{name}: edge {edge!r} is {json.dumps(info)[:40]}, not {{"score": number, "in_graph": true|false}}'
            )
        for key in ("score", "in_graph"):
            if key not in info:
                raise HeadprobeError(f"{name}: edge {edge!r} has no {key} (EAP-IG's graph JSON gives every edge both)")
        score, flag = info["score"], info["in_graph"]
        if not isinstance(score, (int, float)) or isinstance(score, bool):
            raise HeadprobeError(f"{name}: edge {edge!r} has score {json.dumps(score)[:40]}, not a number")
        if not isinstance(flag, bool):
            raise HeadprobeError(f"{name}: edge {edge!r} has in_graph {json.dumps(flag)[:40]}, not true or false")
        out[str(edge)] = finite_score(score, name, edge)
    return out


def read_mib_pt(path: Path, layout: Layout | None) -> HeadFile:
    """An EAP-IG graph saved by ``Graph.to_pt`` (read with ``torch.load(weights_only=True)``: tensors,
    lists, dicts and numbers only, so no code in the file runs), as :func:`read_mib` reads its JSON.
    A head's score is the largest |score| of its real edges (those to a node that reads it:
    :func:`_mib_writes_at` and :func:`_mib_reads_before`, EAP-IG's ``prev_index``).

    Raises:
        HeadprobeError: not a PyTorch file, Python objects besides those, no ``to_pt`` keys,
            a ``cfg`` without one of :data:`MIB_PT_CFG_KEYS`, tensors whose shapes are not those of
            ``cfg``'s graph, ``nodes_in_graph`` or ``edges_in_graph`` not a bool tensor, or
            ``src_nodes`` and ``dst_nodes`` not EAP-IG's nodes in its order.
    """
    import torch

    name = path.name
    d = _load_pt_graph(path)
    parallel = _check_pt_graph(d, name)
    cfg, src, dst = d["cfg"], d["src_nodes"], d["dst_nodes"]
    writes = torch.tensor([float(_mib_writes_at(str(n))) for n in src], dtype=torch.float64)
    reads = torch.tensor([_mib_reads_before(str(n), parallel) for n in dst], dtype=torch.float64)
    real = writes[:, None] < reads[None, :]  # EAP-IG's real edges (its real_edge_mask)
    nonfinite = (real & ~torch.isfinite(d["edges_scores"].float())).nonzero().tolist()
    if nonfinite:
        i, j = nonfinite[0]
        finite_score(float(d["edges_scores"][i, j]), name, f"{src[i]}->{dst[j]}")
    best = torch.where(real, d["edges_scores"].float().abs(), 0.0).amax(dim=1)
    scores = {
        (int(m.group(1)), int(m.group(2))): float(best[i])
        for i, n in enumerate(src)
        if (m := _MIB_HEAD.fullmatch(str(n)))
    }
    nodes = {str(n): bool(v) for n, v in zip(src, d["nodes_in_graph"].tolist())}
    return read_mib({"cfg": cfg, "nodes": nodes}, name, layout, scores, MIB_PT_CFG_KEYS)


def _load_pt_graph(path: Path) -> dict:
    """:func:`read_mib_pt`'s ``torch.load(weights_only=True)`` of ``path``, with every ``to_pt`` key.

    Raises:
        HeadprobeError: not a PyTorch file, Python objects besides tensors, lists, dicts and
            numbers, or a ``to_pt`` key missing.
    """
    import pickle
    import zipfile

    import torch

    name = path.name
    try:
        d = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        if zipfile.is_zipfile(path):
            raise HeadprobeError(
                f"{name} holds not only tensors, lists, dicts and numbers (torch.load with "
                f"weights_only=True refuses it; it is not run): {str(err).splitlines()[-1][:120]}"
            ) from None
        raise HeadprobeError(f"cannot read {name} as a PyTorch file (torch.save's archive)") from None
    except (OSError, EOFError, RuntimeError, ValueError) as err:
        raise HeadprobeError(
            f"cannot read {name} as a PyTorch file: {type(err).__name__}: {(str(err).splitlines() or [''])[0][:120]}"
        ) from None
    missing = [k for k in MIB_PT_KEYS if not isinstance(d, dict) or k not in d]
    if missing:
        raise HeadprobeError(
            f"{name} is no EAP-IG graph (Graph.to_pt's {', '.join(MIB_PT_KEYS)}): it lacks {', '.join(missing)}"
        )
    return d


def _check_pt_graph(d: dict, name: str) -> bool:
    """``cfg``'s ``parallel_attn_mlp`` of a loaded ``to_pt`` graph ``d`` whose tensors have
    the shapes of ``cfg``'s graph, bool node and edge flags and EAP-IG's source and destination
    nodes in its order.

    Raises:
        HeadprobeError: as :func:`read_mib_pt`, naming the first fault.
    """
    import torch

    cfg, src, dst = d["cfg"], d["src_nodes"], d["dst_nodes"]
    _check_mib_cfg(cfg, name, None, MIB_PT_CFG_KEYS)  # read_mib checks it against the model
    n_layers, n_heads, parallel = cfg["n_layers"], cfg["n_heads"], cfg["parallel_attn_mlp"]
    n_src, n_dst = 1 + n_layers * (n_heads + 1), n_layers * (3 * n_heads + 1) + 1
    shapes = {
        "src_nodes": (len(src),) if isinstance(src, list) else None,
        "dst_nodes": (len(dst),) if isinstance(dst, list) else None,
    }
    shapes.update(
        {
            k: tuple(d[k].shape) if isinstance(d[k], torch.Tensor) else None
            for k in ("edges_scores", "edges_in_graph", "nodes_in_graph")
        }
    )
    want = {
        "src_nodes": (n_src,),
        "dst_nodes": (n_dst,),
        "edges_scores": (n_src, n_dst),
        "edges_in_graph": (n_src, n_dst),
        "nodes_in_graph": (n_src,),
    }
    bad = [k for k in want if shapes[k] != want[k]]
    if bad:
        raise HeadprobeError(
            f"{name}: {bad[0]} has shape {shapes[bad[0]]}; a graph of {n_layers} layers x {n_heads} "
            f"heads has {want[bad[0]]} (EAP-IG's to_pt)"
        )
    for key, what in (("nodes_in_graph", "node"), ("edges_in_graph", "edge")):
        if d[key].dtype != torch.bool:  # bool(0.7) read as in the graph, as JSON's 1 is not
            raise HeadprobeError(
                f"{name}: {key} is a {str(d[key].dtype).removeprefix('torch.')} tensor, not bool "
                f"(EAP-IG's to_pt saves the {what} flags as bool)"
            )
    # row i of the tensors is src_nodes[i], column j dst_nodes[j]: from_pt takes them by place, not by name
    for key, names, order, how in (
        ("src_nodes", src, mib_nodes(n_layers, n_heads)[:-1], "forward order: input, per layer a{l}.h{h} then m{l}"),
        ("dst_nodes", dst, _mib_dst_nodes(n_layers, n_heads), "get_dst_nodes order: per layer <q>, <k>, <v>, m{l}"),
    ):
        if list(map(str, names)) != order:
            i = next(i for i, (a, b) in enumerate(zip(map(str, names), order)) if a != b)
            raise HeadprobeError(f"{name}: {key}[{i}] is {str(names[i])[:40]!r}, not {order[i]!r} (EAP-IG's {how})")
    return parallel


# --- reading any of them --------------------------------------------------------------------------


def sniff(path: Path) -> str:
    """The kind of head file at ``path`` (:data:`IMPORT_KINDS`), from its name and, for JSON, its keys
    (``.pt``/``.pth``: an EAP-IG graph saved by ``Graph.to_pt``, ``mib``).

    Raises:
        HeadprobeError: missing, or a JSON file of none of the known shapes.
    """
    if path.is_dir():
        if (path / DUO_TSV).is_file():
            return "duo"
        raise HeadprobeError(f"{path} is a folder without {DUO_TSV}; give the head file itself")
    if not path.is_file():
        raise HeadprobeError(f"head file {path} does not exist")
    if path.suffix == ".tsv":
        return "duo"
    if path.suffix == ".parquet":
        return "parquet"
    if path.suffix in PT_SUFFIXES:
        return "mib"
    if path.suffix == ".json":
        data = load_json(path)
        if isinstance(data, dict) and data.get("format") == "headprobe-kv-policy":
            return "kv-policy"
        if isinstance(data, dict) and ("nodes" in data or "edges" in data):
            return "mib"  # read_mib names a missing key of cfg, nodes and edges
        if isinstance(data, dict) and data and all(_HEADKV_KEY.fullmatch(str(k)) for k in data):
            return "headkv"
        raise HeadprobeError(
            f"{path.name} is JSON of no known head format (a Retrieval_Head/HeadKV score file, "
            "an EAP-IG graph or a headprobe KV policy)"
        )
    with path.open(encoding="utf-8-sig", errors="replace") as f:
        first = f.readline().strip().lower().split(",")
    if first[:2] == ["layer", "head"]:  # a CSV head table (headprobe's head_scores.csv, head_ablation.csv)
        return "csv"
    return "list"


def load_json(path: Path) -> Any:
    """``path`` as JSON (UTF-8, a byte-order mark allowed).

    Raises:
        HeadprobeError: unreadable or not JSON."""
    try:
        return json.loads(path.read_text(encoding="utf-8-sig"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise HeadprobeError(f"cannot read {path.name} as JSON: {err}") from None


def read_head_file(path: str | Path, layout: Layout | None, k: int, score: str | None = None) -> HeadFile:
    """Any head file (:func:`sniff`), its shape checked against ``layout`` where given (None: not checked).

    Args:
        k: how many heads a score file (HeadKV, Parquet) names: its top ``k``.
        score: the Parquet column ranked (None: ``retrieval``, else ``induction``).

    Raises:
        HeadprobeError: unreadable, of no known format, or of another shape than the model's.
    """
    path = Path(path)
    kind = sniff(path)
    if kind == "mib" and path.suffix in PT_SUFFIXES:
        return read_mib_pt(path, layout)
    if kind == "duo":
        return read_duo(path, layout)
    if kind in ("parquet", "csv"):
        return read_table(path, layout, k, score)
    if kind == "list":
        text = read_text_file(path)  # one line for a file not UTF-8 (read_text raised UnicodeDecodeError)
        items = ",".join(s.strip() for s in text.replace("\n", ",").split(",") if s.strip() and not s.startswith("#"))
        bound = (layout.n_layers, layout.n_heads) if layout is not None else (10**9, 10**9)
        return HeadFile("list", sorted(set(parse_heads(items, *bound))), "the heads listed")
    data = load_json(path)
    if kind == "headkv":
        return read_headkv(data, path.name, layout, k)
    if kind == "mib":
        return read_mib(data, path.name, layout)
    policy = KVPolicy.from_dict(data, path.name)
    if layout is not None and layout.n_kv_groups is not None:
        policy.check_layout(layout.n_layers, layout.n_kv_groups, layout.name)
    n_heads = layout.n_heads if layout is not None else policy.n_kv_groups
    return HeadFile(
        "kv-policy",
        group_heads(policy.full_groups, n_heads, policy.n_kv_groups),
        "query heads of the full-cache KV groups",
        policy=policy,
    )


def read_table(path: Path, layout: Layout | None, k: int, score: str | None) -> HeadFile:
    """A head table (one row per ``layer``, ``head``), Parquet (``.parquet``) or CSV (a first line
    ``layer,head,...``: headprobe's own ``head_scores.csv``): the top ``k`` by ``score``.

    Raises:
        HeadprobeError: unreadable, no layer/head columns, a layer or head not a whole number >= 0, no such
            score column, or heads outside the model.
    """
    import pandas as pd

    kind = "parquet" if path.suffix == ".parquet" else "csv"
    try:
        table = pd.read_parquet(path) if kind == "parquet" else pd.read_csv(path)
    except Exception as err:  # pyarrow and pandas raise their own errors for a bad file
        raise HeadprobeError(f"cannot read {path.name} as {kind.upper()}: {type(err).__name__}: {err}") from None
    if not {"layer", "head"} <= set(table.columns):
        raise HeadprobeError(f"{path.name} has no layer and head columns (a head table)")
    for name in ("layer", "head"):  # int() of "x" raised ValueError; -1 and 0.5 were read as heads
        values = pd.to_numeric(table[name], errors="coerce")
        bad = values.isna() | (values < 0) | (values % 1 != 0)
        if bad.any():
            row = int(bad.to_numpy().argmax())
            raise HeadprobeError(
                f"{path.name} row {row + 1}: {name} {str(table[name].iloc[row])!r} is not a whole number >= 0"
            )
        table[name] = values.astype(int)
    column = score or next((c for c in ("retrieval", "induction") if c in table.columns), None)
    if column is None or column not in table.columns:
        what = f"column {column!r}" if column else "retrieval or induction column (give --score COLUMN)"
        raise HeadprobeError(f"{path.name} has no {what}; it has {', '.join(map(str, table.columns))}")
    if layout is not None:
        n_layers, n_heads = int(table["layer"].max()) + 1, int(table["head"].max()) + 1
        if n_layers != layout.n_layers or n_heads > layout.n_heads:
            raise HeadprobeError(
                f"{path.name} has {n_layers} layers of {n_heads} heads; {layout.name} has "
                f"{layout.n_layers} of {layout.n_heads}"
            )
    values = score_values(table, column, path.name)
    scores = {(int(layer), int(head)): float(v) for layer, head, v in zip(table["layer"], table["head"], values)}
    return HeadFile(kind, top_k(scores, k), f"the top {k} heads by {column}", scores, cut_tie=cut_tie(scores, k))


def check_head_rows(
    path: Path, table: Any, columns: Sequence[str] = ("layer", "head"), layout: Layout | None = None
) -> None:
    """A headprobe head table read back from CSV file ``path`` (``table``, its pandas frame) is
    whole: no row has fewer fields than the header (a file cut while written or copied; pandas
    pads such a row with NaN and reads on), each of ``columns`` (head numbers: ``layer``, ``head``,
    ``kv_head``) holds whole numbers >= 0 in every row, and, with ``layout``, every head of the model
    has exactly one row (a scan's table: one per query head, a linear-attention layer's too).

    Raises:
        HeadprobeError: one line naming the file and the first row or head at fault.
    """
    import csv

    import pandas as pd

    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            rows = csv.reader(f)
            width = len(next(rows, []))
            short = next((n for n, row in enumerate(rows, start=2) if row and len(row) < width), None)
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        raise HeadprobeError(f"cannot read {path} as a CSV table: {err}") from None
    if short is not None:
        raise HeadprobeError(f"{path} line {short} has fewer fields than its header: the file is cut")
    for column in columns:
        if column not in table:
            raise HeadprobeError(f"{path} has no {column} column: not headprobe's table")
        values = pd.to_numeric(table[column], errors="coerce")
        bad = (values.isna() | (values < 0) | (values % 1 != 0)).to_numpy()
        if bad.any():
            raise HeadprobeError(
                f"{path} has a {column} that is not a whole number >= 0 (line {int(bad.argmax()) + 2}): "
                f"not headprobe's table"
            )
    if layout is None:
        return
    seen = list(zip(table["layer"].astype(int), table["head"].astype(int)))
    every = [(layer, head) for layer in range(layout.n_layers) for head in range(layout.n_heads)]
    if sorted(seen) != every:
        extra = sorted(set(seen) - set(every)) or [h for h in seen if seen.count(h) > 1]
        missing = sorted(set(every) - set(seen))
        why = (
            f"head {format_head(extra[0])} is outside the model or listed twice"
            if extra
            else f"{len(missing)} of its {len(every)} heads have no row, {format_head(missing[0])} the first"
        )
        raise HeadprobeError(
            f"{path} does not hold one row per head of {layout.name} ({layout.n_layers} layers x "
            f"{layout.n_heads} heads): {why}; the table is cut or not this run's"
        )


def score_values(table: Any, column: str, name: str) -> Any:
    """A head table's ``column`` as float64 ``[row]``, a missing value (NaN, or pandas' ``NA`` of a
    nullable numeric column) as NaN: no score, never among the top k (:func:`top_k`).

    Raises:
        HeadprobeError: missing layer or head numbers, a column that is not numeric (booleans,
            text), or an infinite score."""
    import numpy as np
    import pandas as pd

    if table[["layer", "head"]].isna().any().any():
        raise HeadprobeError(f"{name} has rows without a layer or head number")
    values = table[column]
    if pd.api.types.is_bool_dtype(values) or not pd.api.types.is_numeric_dtype(values):
        raise HeadprobeError(
            f"{name}: column {column!r} is not a numeric score column ({values.dtype}); "
            "give a column of numbers with --score"
        )
    out = values.astype("Float64").to_numpy(dtype="float64", na_value=np.nan)
    if np.isinf(out).any():
        raise HeadprobeError(f"{name}: column {column!r} holds an infinite score")
    return out


def describe(heads: list[Head], limit: int = 12) -> str:
    """``5.1, 7.3, ...`` (at most ``limit`` named)."""
    names = [format_head(h) for h in heads]
    return ", ".join(names[:limit]) + (f", ... ({len(names)} heads)" if len(names) > limit else "")


MEASURED_SEQ_LEN = "measured_seq_len"
"""The policy file's field (headprobe kv writes it): the tokens per sequence its quality was measured at."""


def kv_policy_measured_length(path: str | Path) -> tuple[int | None, str | None]:
    """The tokens per sequence the quality of KV policy file ``path`` was measured at, and the file
    that says so: its own :data:`MEASURED_SEQ_LEN`, else (a kv run's policy.json written before the
    field) the ``seq_len`` of the policy_budget.json or kv summary.json beside it; ``(None, None)``
    where none records it (a hand-made policy). A file beside it that cannot be read counts as none."""
    path = Path(path)
    candidates = [(path, MEASURED_SEQ_LEN, None), (path.with_name("policy_budget.json"), "seq_len", "layout")]
    candidates.append((path.with_name("summary.json"), "seq_len", "full_groups"))  # kv's: full_groups beside seq_len
    for file, key, kind in candidates:
        try:
            d = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError):
            continue
        value = d.get(key) if isinstance(d, dict) and (kind is None or kind in d) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value, file.name
    return None, None


def read_kv_policy(path: str | Path) -> KVPolicy:
    """The ``headprobe-kv-policy`` v1 file ``path`` (docs/kv.md).

    Raises:
        HeadprobeError: the file is missing, not JSON, or not a valid policy (:meth:`KVPolicy.from_dict`).
    """
    return KVPolicy.from_dict(read_json(path, "the KV policy"), source=str(path))
