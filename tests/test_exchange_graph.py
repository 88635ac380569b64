"""The EAP-IG / MIB circuit graph both ways, and ``export --out``.

The expected layout is written here from EAP-IG's ``src/eap/graph.py`` (hannamw/EAP-IG at
795f560; the same at 7af394a, the commit MIB-circuit-track pins): ``Graph.from_model`` makes the
nodes ``input``, then per layer ``a{l}.h{h}`` for every head and ``m{l}``, then ``logits``, and an
edge from every earlier node of the residual stream to each head's ``<q>``, ``<k>``, ``<v>`` input,
to each MLP and to ``logits``; ``to_json`` writes ``{"cfg", "nodes": {name: {"in_graph": bool}},
"edges": {name: {"score": float, "in_graph": bool}}}`` and ``from_json`` (and MIB's
``load_graph_from_json``) builds the graph from ``cfg``'s ``n_layers``, ``n_heads``,
``parallel_attn_mlp`` and ``d_model`` and reads ``node["in_graph"]`` by value. ``to_pt`` saves
``cfg``, ``src_nodes``, ``dst_nodes``, ``edges_scores`` and ``edges_in_graph`` ``[n_forward,
n_backward]`` and ``nodes_in_graph`` ``[n_forward]``. No code of theirs is here: the names are
built from that description."""

from __future__ import annotations

import json
import re
import shutil
import warnings
from pathlib import Path

import pandas as pd
import pytest
import torch
import zoo

from headprobe.cli import main

DATA = Path(__file__).parent / "data" / "mib"


def eap_ig_names(n_layers: int, n_heads: int, parallel: bool = False) -> tuple[list[str], list[str], set[str]]:
    """EAP-IG's source nodes (forward order), destination nodes (``get_dst_nodes`` order) and edge names."""
    src, dst, edges, stream = ["input"], [], set(), ["input"]
    for layer in range(n_layers):
        heads = [f"a{layer}.h{h}" for h in range(n_heads)]
        src += [*heads, f"m{layer}"]
        dst += [f"{a}<{x}>" for x in "qkv" for a in heads] + [f"m{layer}"]
        edges |= {f"{p}->{a}<{x}>" for p in stream for a in heads for x in "qkv"}
        mlp_readers = stream if parallel else [*stream, *heads]
        edges |= {f"{p}->m{layer}" for p in mlp_readers}
        stream += [*heads, f"m{layer}"]
    edges |= {f"{p}->logits" for p in stream}
    return src, [*dst, "logits"], edges


def _heads(names) -> list[tuple[int, int]]:
    return sorted((int(n[1:].split(".h")[0]), int(n.split(".h")[1])) for n in names if n.startswith("a"))


@pytest.fixture(scope="module")
def circuit_run(tmp_path_factory, tiny_dir):
    """A circuit run of the tiny GQA Llama (2 layers x 8 heads, d_model 64)."""
    out = tmp_path_factory.mktemp("graph") / "circuit"
    assert (
        main(
            [
                "circuit",
                "--model",
                str(tiny_dir),
                "--out",
                str(out),
                "--device",
                "cpu",
                "--n-seqs",
                "2",
                "--period",
                "6",
                "--steps",
                "2",
                "--verify",
                "4",
                "--top",
                "5",
            ]
        )
        == 0
    )
    return out


@pytest.fixture(scope="module")
def graph(circuit_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("graph-export") / "e"
    assert main(["export", "--from", str(circuit_run), "--out", str(out), "--format", "mib"]) == 0
    return json.loads((out / "circuit_graph.json").read_text())


def _layout(tiny_dir):
    from headprobe.analyses.exchange import Layout

    return Layout(str(tiny_dir), 2, 8, 2, 2)


# --- export: EAP-IG's layout, field by field ------------------------------------------------------


def test_exported_cfg_is_what_from_json_reads(graph, tiny_dir):
    """cfg: the four keys ``from_model`` takes from a model (the real d_model: config.json's hidden_size)."""
    hidden = json.loads((Path(tiny_dir) / "config.json").read_text())["hidden_size"]
    assert graph["cfg"] == {"n_layers": 2, "n_heads": 8, "parallel_attn_mlp": False, "d_model": hidden}
    assert isinstance(graph["cfg"]["d_model"], int)


def test_exported_nodes_are_eap_igs_in_order_each_an_in_graph_dict(graph, circuit_run):
    """Every node EAP-IG makes, in its order, as ``{"in_graph": bool}``; in the graph: the endpoints
    of the circuit's top edges (and logits, which EAP-IG always keeps)."""
    src, _, _ = eap_ig_names(2, 8)
    assert list(graph["nodes"]) == [*src, "logits"]
    assert all(v == {"in_graph": v["in_graph"]} and isinstance(v["in_graph"], bool) for v in graph["nodes"].values())
    top = pd.read_csv(circuit_run / "edges.csv", dtype=str).head(5)
    endpoints = {f"a{h.replace('.', '.h')}" for h in [*top.sender, *top.receiver] if h != "logits"} | {"logits"}
    assert {n for n, v in graph["nodes"].items() if v["in_graph"]} == endpoints


def test_exported_edges_are_eap_ig_edges_with_headprobes_scores(graph, circuit_run):
    """Each edge named as EAP-IG names it (one of the graph's), exactly ``{"score", "in_graph"}``;
    scores those of edges.csv, the top ``--top`` in the graph."""
    _, _, names = eap_ig_names(2, 8)
    table = pd.read_csv(circuit_run / "edges.csv", dtype={c: str for c in ("sender", "receiver", "input")})
    want = {}
    for r in table.itertuples():
        child = "logits" if r.receiver == "logits" else f"a{r.receiver.replace('.', '.h')}<{r.input}>"
        want[f"a{r.sender.replace('.', '.h')}->{child}"] = (float(r.score), r.Index < 5)
    assert set(graph["edges"]) == set(want) and set(want) <= names
    for name, v in graph["edges"].items():
        assert set(v) == {"score", "in_graph"} and isinstance(v["in_graph"], bool)
        assert (v["score"], v["in_graph"]) == (pytest.approx(want[name][0], abs=1e-12), want[name][1])
    patched = graph["headprobe"]["path_patched"]
    assert len(patched) == graph["headprobe"]["n_path_patched"] > 0 and set(patched) <= set(want)


def test_d_model_comes_from_the_circuits_summary(circuit_run, tmp_path):
    """A hub name (no config.json to read): the layout the circuit run recorded gives d_model."""
    src = tmp_path / "src"
    shutil.copytree(circuit_run, src)
    summary = json.loads((src / "summary.json").read_text())
    summary["model"] = "no-such-org/no-such-model"
    (src / "summary.json").write_text(json.dumps(summary))
    assert main(["export", "--from", str(src), "--out", str(tmp_path / "o"), "--format", "mib"]) == 0
    assert json.loads((tmp_path / "o" / "circuit_graph.json").read_text())["cfg"]["d_model"] == 64


def test_export_refuses_a_graph_without_d_model(circuit_run, tmp_path, capsys):
    """No d_model to be had (a hub name whose config is not read without loading, a recorded layout
    without it): refused in one line, nothing written (EAP-IG's from_model needs it)."""
    src = tmp_path / "src"
    shutil.copytree(circuit_run, src)
    summary = json.loads((src / "summary.json").read_text())
    summary["layout"] = {k: v for k, v in summary["layout"].items() if k != "d_model"}
    summary["model"] = "no-such-org/no-such-model"
    (src / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(SystemExit) as e:
        raise SystemExit(main(["export", "--from", str(src), "--out", str(tmp_path / "o"), "--format", "mib"]))
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "d_model" in err[0], err
    assert not (tmp_path / "o").exists()


# --- parallel attention and MLP: cfg parallel_attn_mlp --------------------------------------------

_ATTN_0 = re.compile(r"(layers|h)\.0\.(self_attn|attn|attention|self_attention)$")
_MLP_0 = re.compile(r"(layers|h)\.0\.mlp$")


def _mlp_reads_its_attention(hf_model) -> bool:
    """The reference, from the Hugging Face modules alone: whether layer 0's MLP input changes when
    its attention output is perturbed (random noise: a constant shift would vanish in a LayerNorm)."""
    mods = dict(hf_model.named_modules())
    attn = next(m for n, m in mods.items() if _ATTN_0.search(n))
    mlp = next(m for n, m in mods.items() if _MLP_0.search(n))
    g, seen = torch.Generator().manual_seed(0), []

    def bump(module, args, out):
        first = out[0] if isinstance(out, tuple) else out
        first = first + torch.randn(first.shape, generator=g)
        return (first, *out[1:]) if isinstance(out, tuple) else first

    tokens = torch.tensor([[1, 2, 3, 4, 5]])
    pre = mlp.register_forward_pre_hook(lambda module, args: seen.append(args[0].detach().clone()))
    try:
        with torch.no_grad():
            hf_model(tokens)
            post = attn.register_forward_hook(bump)
            try:
                hf_model(tokens)
            finally:
                post.remove()
    finally:
        pre.remove()
    return not torch.equal(seen[0], seen[1])


_HF_SIZES = dict(
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    intermediate_size=64,
    max_position_embeddings=64,
    n_embd=32,
    n_layer=1,
    n_head=4,
    n_positions=64,
)


@pytest.mark.parametrize(
    "model_type, change",
    [
        ("llama", {}),
        ("gpt2", {}),
        ("gpt_neox", {}),
        ("gpt_neox", {"use_parallel_residual": False}),
        ("gptj", {"rotary_dim": 4}),
        ("codegen", {"rotary_dim": 4}),
        ("phi", {}),
        ("cohere", {}),
        ("cohere2", {}),
        ("falcon", {}),
        ("falcon", {"parallel_attn": False}),
        ("falcon", {"new_decoder_architecture": True, "num_kv_heads": 2}),
        ("stablelm", {}),
        ("stablelm", {"use_parallel_residual": True}),
    ],
)
def test_config_json_says_what_the_hugging_face_block_does(tmp_path, model_type, change):
    """peek_config's parallel_attn_mlp from a config.json against what the Hugging Face block of that
    config computes (its MLP reads its own attention's output, or not)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from headprobe.options import peek_config

    cfg = AutoConfig.for_model(model_type, **{**_HF_SIZES, **change})
    cfg.to_json_file(tmp_path / "config.json")
    hf_model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    assert peek_config(str(tmp_path))["parallel_attn_mlp"] is not _mlp_reads_its_attention(hf_model)


@pytest.mark.parametrize(
    "family, change", [("llama", {}), ("gpt_neox", {}), ("gpt_neox", {"use_parallel_residual": False})]
)
@pytest.mark.parametrize("backend", ["native", "transformer-lens"])
def test_a_loaded_model_says_whether_its_mlp_reads_its_attention(tiny_tokenizer, family, change, backend):
    """LoadedModel.parallel_attn_mlp on both backends against the Hugging Face block (the
    sequential NeoX variant included)."""
    from headprobe.probe.backends.wrapping import wrap

    ckpt = zoo.make_checkpoint(family, tiny_tokenizer, **change)
    want = not _mlp_reads_its_attention(ckpt.hf_model)
    assert wrap(ckpt, backend=backend).parallel_attn_mlp is want


@pytest.fixture(scope="module")
def neox_dir(tmp_path_factory, tiny_tokenizer):
    """The tiny GPT-NeoX (parallel attention and MLP, 2 layers x 4 heads, d_model 64) as a model directory."""
    return zoo.save_dir("gpt_neox", tiny_tokenizer, tmp_path_factory.mktemp("neox"))


@pytest.fixture(scope="module")
def neox_circuit_run(tmp_path_factory, neox_dir):
    out = tmp_path_factory.mktemp("neox-graph") / "circuit"
    argv = ["circuit", "--model", str(neox_dir), "--out", str(out), "--device", "cpu", "--n-seqs", "2"]
    assert main([*argv, "--period", "6", "--steps", "2", "--verify", "4", "--top", "5"]) == 0
    return out


def _export_mib(src: Path, out: Path) -> dict:
    assert main(["export", "--from", str(src), "--out", str(out), "--format", "mib"]) == 0
    return json.loads((out / "circuit_graph.json").read_text())


def test_a_parallel_models_graph_is_eap_igs_parallel_graph(neox_circuit_run, neox_dir, tiny_tokenizer, tmp_path):
    """GPT-NeoX's MLP does not read its own layer's heads (the Hugging Face block shows it): cfg
    says parallel_attn_mlp true, as the run recorded, so EAP-IG's from_json builds no a{l}.h{h} ->
    m{l} edge; the nodes are its parallel graph's, every edge one of that graph's."""
    assert not _mlp_reads_its_attention(zoo.make_checkpoint("gpt_neox", tiny_tokenizer).hf_model)
    graph = _export_mib(neox_circuit_run, tmp_path / "e")
    assert graph["cfg"] == {"n_layers": 2, "n_heads": 4, "parallel_attn_mlp": True, "d_model": 64}
    assert json.loads((neox_circuit_run / "summary.json").read_text())["layout"]["parallel_attn_mlp"] is True
    src, _, names = eap_ig_names(2, 4, parallel=True)
    assert list(graph["nodes"]) == [*src, "logits"] and graph["edges"] and set(graph["edges"]) <= names


def test_an_older_circuit_summary_reads_parallel_from_the_models_config(neox_circuit_run, tmp_path):
    """A summary.json from before the layout recorded it: the model's config.json says it."""
    src = tmp_path / "src"
    shutil.copytree(neox_circuit_run, src)
    summary = json.loads((src / "summary.json").read_text())
    summary["layout"].pop("parallel_attn_mlp", None)
    (src / "summary.json").write_text(json.dumps(summary))
    assert _export_mib(src, tmp_path / "o")["cfg"]["parallel_attn_mlp"] is True


def test_export_refuses_a_graph_when_parallel_is_unknown(neox_circuit_run, tmp_path, capsys):
    """Neither the summary nor a config.json at hand (a hub name) says it: one line, exit 2, nothing written."""
    src = tmp_path / "src"
    shutil.copytree(neox_circuit_run, src)
    summary = json.loads((src / "summary.json").read_text())
    summary["layout"].pop("parallel_attn_mlp", None)
    summary["model"] = "no-such-org/no-such-model"
    (src / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(SystemExit) as e:
        raise SystemExit(main(["export", "--from", str(src), "--out", str(tmp_path / "o"), "--format", "mib"]))
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("headprobe: error: "), err
    assert "parallel_attn_mlp" in err[0] and "d_model" not in err[0].split("(")[0], err
    assert not (tmp_path / "o").exists()


def test_import_refuses_a_graph_whose_parallel_flag_is_not_the_models(
    neox_circuit_run, neox_dir, tiny_dir, tiny_tokenizer, tmp_path, capsys
):
    """The NeoX graph imports back onto its model; onto the sequential NeoX (same sizes) it is refused
    in one line; a graph saying false onto the parallel NeoX too, from its config.json before
    loading and from the loaded model (LoadedModel.parallel_attn_mlp, for a model whose config is
    not read cheaply)."""
    from headprobe.analyses.exchange import read_head_file
    from headprobe.commands.import_heads import ImportConfig
    from headprobe.commands.import_heads_core import _layout
    from headprobe.probe.backends.wrapping import wrap
    from headprobe.probe.core.errors import HeadprobeError

    graph = tmp_path / "e" / "circuit_graph.json"
    _export_mib(neox_circuit_run, tmp_path / "e")
    ImportConfig(model=str(neox_dir), heads_file=str(graph)).preflight()
    sequential = zoo.make_checkpoint("gpt_neox", tiny_tokenizer, use_parallel_residual=False, rotary_pct=0.5)
    sequential.hf_model.save_pretrained(tmp_path / "seq")
    tiny_tokenizer.save_pretrained(tmp_path / "seq")
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        raise SystemExit(main(["import", "--heads-file", str(graph), "--model", str(tmp_path / "seq")]))
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert re.fullmatch(r"headprobe: error: circuit_graph\.json is a graph of parallel_attn_mlp true; .*", err[0]), err
    flipped = json.loads(graph.read_text())
    flipped["cfg"]["parallel_attn_mlp"] = False
    (tmp_path / "false.json").write_text(json.dumps(flipped))
    with pytest.raises(HeadprobeError, match="parallel_attn_mlp false; .* in parallel"):
        ImportConfig(model=str(neox_dir), heads_file=str(tmp_path / "false.json")).preflight()
    loaded = _layout(wrap(zoo.make_checkpoint("gpt_neox", tiny_tokenizer), backend="native"))
    assert read_head_file(graph, loaded, 3).kind == "mib"
    with pytest.raises(HeadprobeError, match="parallel_attn_mlp false; .* in parallel"):
        read_head_file(tmp_path / "false.json", loaded, 3)


# --- import: in_graph by value, MIB's own graph, .pt graphs ---------------------------------------


def test_a_node_with_in_graph_false_is_not_in_the_circuit(tmp_path):
    from headprobe.analyses.exchange import Layout, read_head_file

    src, _, _ = eap_ig_names(2, 4)
    inside = {"a0.h1", "a1.h2"}
    nodes = {n: {"in_graph": n in inside or n == "input"} for n in src} | {"logits": {"in_graph": True}}
    path = tmp_path / "g.json"
    path.write_text(
        json.dumps(
            {
                "cfg": {"n_layers": 2, "n_heads": 4, "parallel_attn_mlp": False, "d_model": 32},
                "nodes": nodes,
                "edges": {"a0.h1->a1.h2<q>": {"score": 0.5, "in_graph": True}},
            }
        )
    )
    assert read_head_file(path, Layout("m", 2, 4), 3).heads == [(0, 1), (1, 2)]


def test_node_scores_are_read_past_nan_included_but_a_string_flag_is_refused(tmp_path):
    """``to_json`` of a graph with node scores writes ``{"in_graph", "score"}`` per node, NaN for a
    node left unscored: read as the same heads. A node flag ``"false"`` (true to Python, so
    ``from_json`` would put the node in the graph) is refused, an MLP node's as a head's."""
    from headprobe.analyses.exchange import Layout, read_head_file
    from headprobe.probe.core.errors import HeadprobeError

    src, _, _ = eap_ig_names(2, 4)
    inside = {"a0.h1", "a1.h2"}
    nodes = {n: {"in_graph": n in inside, "score": float("nan") if n[0] == "m" else 0.25} for n in src}
    graph = {
        "cfg": {"n_layers": 2, "n_heads": 4, "parallel_attn_mlp": False, "d_model": 32},
        "nodes": nodes | {"logits": {"in_graph": True, "score": float("nan")}},
        "edges": {"a0.h1->a1.h2<q>": {"score": 0.5, "in_graph": True}},
    }
    path = tmp_path / "g.json"
    path.write_text(json.dumps(graph))  # NaN written as EAP-IG's json.dump writes it
    assert "NaN" in path.read_text()
    assert read_head_file(path, Layout("m", 2, 4), 3).heads == [(0, 1), (1, 2)]
    for node in ("m1", "a0.h2"):
        graph["nodes"][node] = {"in_graph": "false"}
        path.write_text(json.dumps(graph))
        with pytest.raises(HeadprobeError, match=f"node '{node}' is .*not .*true.false"):
            read_head_file(path, Layout("m", 2, 4), 3)
        graph["nodes"][node] = {"in_graph": False}


def test_mibs_ioi_graph_imports_as_the_heads_it_names():
    """MIB's shipped IOI circuit (GPT-2 small; tests/data/mib/README.md): its attention nodes with
    ``in_graph`` true, 67 of the 144."""
    from headprobe.analyses.exchange import Layout, read_head_file

    path = DATA / "ioi-eap-ig.json"
    nodes = json.loads(path.read_text())["nodes"]
    named = _heads(n for n, v in nodes.items() if v["in_graph"])
    assert len(named) == 67 and len(_heads(nodes)) == 144
    got = read_head_file(path, Layout("gpt2", 12, 12, 12, 12), 5)
    assert got.kind == "mib" and got.heads == named


def _graph_pt(n_layers: int, n_heads: int, inside: set[str], seed: int = 0) -> dict:
    """A graph in ``to_pt``'s layout: real edges scored at random, the rest (no edge of EAP-IG's:
    a later node into an earlier one) 100, which no reader may take; ``inside`` in the graph."""
    src, dst, names = eap_ig_names(n_layers, n_heads)
    g = torch.Generator().manual_seed(seed)
    scores = torch.full((len(src), len(dst)), 100.0)
    in_graph = torch.zeros(len(src), len(dst), dtype=torch.bool)
    for name in names:
        parent, child = name.split("->")
        i, j = src.index(parent), dst.index(child)
        scores[i, j] = torch.randn((), generator=g)
        in_graph[i, j] = parent in inside and (child.split("<")[0] in inside or child == "logits")
    return {
        "cfg": {"n_layers": n_layers, "n_heads": n_heads, "parallel_attn_mlp": False, "d_model": 32},
        "src_nodes": src,
        "dst_nodes": dst,
        "edges_scores": scores,
        "edges_in_graph": in_graph,
        "nodes_in_graph": torch.tensor([n in inside for n in src]),
    }


def _as_json(d: dict) -> dict:
    """The same graph in ``to_json``'s layout."""
    src, dst = d["src_nodes"], d["dst_nodes"]
    _, _, names = eap_ig_names(d["cfg"]["n_layers"], d["cfg"]["n_heads"])
    edges = {}
    for name in sorted(names):
        parent, child = name.split("->")
        i, j = src.index(parent), dst.index(child)
        edges[name] = {"score": float(d["edges_scores"][i, j]), "in_graph": bool(d["edges_in_graph"][i, j])}
    nodes = {n: {"in_graph": bool(v)} for n, v in zip(src, d["nodes_in_graph"])} | {"logits": {"in_graph": True}}
    return {"cfg": d["cfg"], "nodes": nodes, "edges": edges}


def test_an_eap_ig_pt_graph_reads_as_its_json(tmp_path):
    """A ``to_pt`` graph gives the heads of ``nodes_in_graph`` and the same scores as the same graph as JSON."""
    from headprobe.analyses.exchange import Layout, read_head_file

    d = _graph_pt(2, 4, {"input", "a0.h1", "a0.h3", "a1.h2"})
    torch.save(d, tmp_path / "g.pt")
    (tmp_path / "g.json").write_text(json.dumps(_as_json(d)))
    pt = read_head_file(tmp_path / "g.pt", Layout("m", 2, 4), 3)
    js = read_head_file(tmp_path / "g.json", Layout("m", 2, 4), 3)
    assert pt.kind == "mib" and pt.heads == [(0, 1), (0, 3), (1, 2)] == js.heads
    assert pt.scores.keys() == js.scores.keys() and all(pt.scores[h] == pytest.approx(js.scores[h]) for h in pt.scores)


class _NotAGraph:
    pass


@pytest.mark.parametrize(
    "make, fragment",
    [
        (lambda p: torch.save({"weight": torch.zeros(2)}, p), "no EAP-IG graph"),
        (lambda p: torch.save({"cfg": _NotAGraph()}, p), "not only tensors"),
        (lambda p: p.write_bytes(b"\x80\x02\xff\xfe not a torch file"), "cannot read"),
        (
            lambda p: torch.save({**_graph_pt(2, 4, {"a0.h1"}), "nodes_in_graph": torch.zeros(3, dtype=torch.bool)}, p),
            "nodes_in_graph",
        ),
    ],
)
def test_a_pt_file_of_another_shape_is_refused_in_one_line(tmp_path, make, fragment):
    from headprobe.analyses.exchange import Layout, read_head_file
    from headprobe.probe.core.errors import HeadprobeError

    make(tmp_path / "g.pt")
    with pytest.raises(HeadprobeError) as e:
        read_head_file(tmp_path / "g.pt", Layout("m", 2, 4), 3)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_a_pt_graph_with_a_nan_edge_score_is_refused_naming_the_edge(tmp_path):
    """A NaN score on a real edge made that head's score NaN (amax passes NaN on): refused in one
    line naming the edge; NaN where EAP-IG has no edge (never read) is left alone."""
    from headprobe.analyses.exchange import Layout, read_head_file
    from headprobe.probe.core.errors import HeadprobeError

    d = _graph_pt(2, 4, {"a0.h1"})
    src, dst = d["src_nodes"], d["dst_nodes"]
    d["edges_scores"][src.index("a1.h2"), dst.index("a0.h0<q>")] = float("nan")  # no edge: a later node
    torch.save(d, tmp_path / "g.pt")
    assert read_head_file(tmp_path / "g.pt", Layout("m", 2, 4), 3).heads == [(0, 1)]
    d["edges_scores"][src.index("a0.h1"), dst.index("a1.h2<k>")] = float("nan")
    torch.save(d, tmp_path / "g.pt")
    with pytest.raises(HeadprobeError) as e:
        read_head_file(tmp_path / "g.pt", Layout("m", 2, 4), 3)
    assert str(e.value) == "g.pt: the score of a0.h1->a1.h2<k> is not a finite number (nan)"


def test_import_refuses_a_bad_pt_file_in_one_line(tmp_path, tiny_dir, capsys):
    """The command: one line, exit 2 (never a UnicodeDecodeError traceback)."""
    (tmp_path / "g.pt").write_bytes(bytes(range(256)) * 4)
    with pytest.raises(SystemExit) as e:
        raise SystemExit(main(["import", "--heads-file", str(tmp_path / "g.pt"), "--model", str(tiny_dir)]))
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("headprobe: error: cannot read g.pt"), err


def test_a_graph_of_another_model_width_is_refused(tmp_path, tiny_dir):
    """cfg's d_model against the model's (a 2 x 8 graph of another width is another model)."""
    from headprobe.commands.import_heads import ImportConfig
    from headprobe.probe.core.errors import HeadprobeError

    src, _, _ = eap_ig_names(2, 8)
    (tmp_path / "g.json").write_text(
        json.dumps(
            {
                "cfg": {"n_layers": 2, "n_heads": 8, "parallel_attn_mlp": False, "d_model": 768},
                "nodes": {n: {"in_graph": True} for n in src},
                "edges": {},
            }
        )
    )
    with pytest.raises(HeadprobeError, match="d_model 768; .* has 64"):
        ImportConfig(model=str(tiny_dir), heads_file=str(tmp_path / "g.json")).preflight()


# --- export --out (its old name --to is gone: no release ever had it) ---------------------------------


def test_export_writes_to_out_and_refuses_the_old_to_with_a_suggestion(circuit_run, tmp_path, capsys):
    """``--to``, ``--out``'s name before the commands shared it, was kept as a deprecated alias for a
    release that never came: it is now an unknown flag like any other, refused in one line that
    points at ``--out`` (argparse alone says only that --out is missing), and nothing is written."""
    assert main(["export", "--from", str(circuit_run), "--out", str(tmp_path / "a"), "--format", "mib"]) == 0
    assert (tmp_path / "a" / "circuit_graph.json").is_file()
    capsys.readouterr()
    assert main(["export", "--from", str(circuit_run), "--to", str(tmp_path / "b"), "--format", "mib"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == (
        "headprobe: error: unrecognized arguments: --to (did you mean --out?) (see headprobe export --help)\n"
    )
    assert not (tmp_path / "b").exists()


def test_export_function_takes_out_and_not_the_old_to(circuit_run, tmp_path):
    import headprobe

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        headprobe.export(str(circuit_run), out=str(tmp_path / "a"), format="mib")
    assert (tmp_path / "a" / "circuit_graph.json").is_file()
    with pytest.raises(TypeError, match=r"export\(\) got an unknown setting 'to' \(settings: source, out, format"):
        headprobe.export(str(circuit_run), to=str(tmp_path / "b"), format="mib")
    assert not (tmp_path / "b").exists()


# --- import: what EAP-IG's graph JSON requires, its edge names, a .pt's node flags -----------------


def _small_graph(**change) -> dict:
    """A 2 x 4 sequential graph in ``to_json``'s layout with one head edge, one MLP and one input edge."""
    src, _, _ = eap_ig_names(2, 4)
    graph = {
        "cfg": {"n_layers": 2, "n_heads": 4, "parallel_attn_mlp": False, "d_model": 32},
        "nodes": {n: {"in_graph": n in ("input", "a0.h1")} for n in src} | {"logits": {"in_graph": True}},
        "edges": {
            "a0.h1->a1.h2<q>": {"score": -0.5, "in_graph": True},
            "input->a0.h1<k>": {"score": 0.9, "in_graph": True},
            "m0->logits": {"score": 0.7, "in_graph": False},
        },
    }
    return graph | change


@pytest.mark.parametrize("key", ["edges", "cfg", "nodes"])
def test_a_graph_json_without_cfg_nodes_or_edges_is_refused_naming_it(key, tmp_path, tiny_dir, capsys):
    """EAP-IG's ``Graph.from_json`` asserts ``cfg``, ``nodes`` and ``edges``: a graph without edges
    was read as heads without scores (read_mib) or as no known format (the command); now one line
    names the key. Old code: read_mib returned the heads; the command said "no known head format"."""
    from headprobe.analyses.exchange import Layout, read_mib
    from headprobe.probe.core.errors import HeadprobeError

    graph = _small_graph()
    del graph[key]
    with pytest.raises(HeadprobeError, match=f'g.json has no "{key}" '):
        read_mib(graph, "g.json", Layout("m", 2, 4))
    graph = _small_graph(cfg={"n_layers": 2, "n_heads": 8, "parallel_attn_mlp": False, "d_model": 64})
    del graph[key]
    (tmp_path / "g.json").write_text(json.dumps(graph))
    with pytest.raises(SystemExit) as e:
        raise SystemExit(main(["import", "--heads-file", str(tmp_path / "g.json"), "--model", str(tiny_dir)]))
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert err[0].startswith(f'headprobe: error: g.json has no "{key}" (EAP-IG\'s graph JSON'), err


def test_a_graph_with_mlp_and_input_edges_scores_its_heads_by_their_edges_only():
    """MLP and input edges are EAP-IG's (``from_model`` makes them) and are read, but give no head a score."""
    from headprobe.analyses.exchange import Layout, read_mib

    got = read_mib(_small_graph(), "g.json", Layout("m", 2, 4))
    assert got.heads == [(0, 1)] and got.scores == {(0, 1): 0.5}


@pytest.mark.parametrize(
    "edge, fragment",
    [
        ("a0.h1", "no EAP-IG edge name"),  # read as a0.h1's edge
        ("a0.h1->", "no EAP-IG edge name"),
        ("a0.h1->junk", "no EAP-IG edge name"),  # read as a0.h1's edge
        ("junk->a1.h2<q>", "no EAP-IG edge name"),  # skipped
        ("a0.h1->a1.h2", "no EAP-IG edge name"),  # a head's input without <q|k|v>
        ("a0.h1->a1.h2<x>", "no EAP-IG edge name"),
        ("a0.h1->logits<q>", "no EAP-IG edge name"),
        ("logits->a1.h2<q>", "no EAP-IG edge name"),
        ("a2.h0->logits", "outside the graph's 2 layers of 4 heads"),
        ("a0.h4->logits", "outside the graph's 2 layers of 4 heads"),
        ("a0.h1->m2", "outside the graph's 2 layers of 4 heads"),
        ("a1.h2->a0.h1<q>", "no edge of EAP-IG's graph"),  # a later head into an earlier one
        ("a0.h1->a0.h2<q>", "no edge of EAP-IG's graph"),  # heads of one layer read each other
        ("m0->m0", "no edge of EAP-IG's graph"),
        ("m1->a1.h0<v>", "no edge of EAP-IG's graph"),
    ],
)
def test_an_edge_eap_ig_has_not_is_refused_naming_it(edge, fragment):
    """``from_json`` looks every edge up in ``from_model(cfg)``'s graph (a KeyError for any other):
    a name of another form, or outside the graph, was skipped or read as a head's edge. Old code:
    no error (these twelve returned heads)."""
    from headprobe.analyses.exchange import Layout, read_mib
    from headprobe.probe.core.errors import HeadprobeError

    graph = _small_graph()
    graph["edges"][edge] = {"score": 3.0, "in_graph": False}
    with pytest.raises(HeadprobeError) as e:
        read_mib(graph, "g.json", Layout("m", 2, 4))
    assert str(e.value).startswith(f"g.json: edge {edge!r} ") and fragment in str(e.value), e.value
    assert "\n" not in str(e.value)


def test_a_parallel_graph_has_no_edge_from_a_layers_heads_to_its_mlp():
    """With ``parallel_attn_mlp`` true EAP-IG builds no ``a{l}.h{h}->m{l}``; sequential, it does."""
    from headprobe.analyses.exchange import read_mib
    from headprobe.probe.core.errors import HeadprobeError

    graph = _small_graph()
    graph["edges"]["a0.h1->m0"] = {"score": 2.0, "in_graph": False}
    assert read_mib(graph, "g.json", None).scores == {(0, 1): 2.0}
    graph["cfg"]["parallel_attn_mlp"] = True
    with pytest.raises(HeadprobeError, match=r"edge 'a0.h1->m0' is no edge of EAP-IG's graph .*parallel_attn_mlp true"):
        read_mib(graph, "g.json", None)


@pytest.mark.parametrize(
    "change, fragment",
    [
        ({"nodes_in_graph": torch.tensor([0.0, 0.7, 0, 0, 0, 0, 0, 0, 0, 0, 0])}, "nodes_in_graph is a float32 tensor"),
        ({"nodes_in_graph": torch.tensor([0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0])}, "nodes_in_graph is a int64 tensor"),
        (
            {
                "src_nodes": [
                    "input",
                    "a0.h1",
                    "a0.h0",
                    "a0.h2",
                    "a0.h3",
                    "m0",
                    "a1.h0",
                    "a1.h1",
                    "a1.h2",
                    "a1.h3",
                    "m1",
                ]
            },
            "src_nodes[1] is 'a0.h1', not 'a0.h0'",
        ),
    ],
)
def test_a_pt_graphs_node_flags_and_names_are_checked_as_the_jsons(tmp_path, change, fragment):
    """``nodes_in_graph`` was read with ``bool()`` (0.7 in the graph; JSON refuses 1 for true), the
    node names it flags were not checked. Old code: heads returned."""
    from headprobe.analyses.exchange import Layout, read_head_file
    from headprobe.probe.core.errors import HeadprobeError

    torch.save(_graph_pt(2, 4, {"a0.h1"}) | change, tmp_path / "g.pt")
    with pytest.raises(HeadprobeError) as e:
        read_head_file(tmp_path / "g.pt", Layout("m", 2, 4), 3)
    assert fragment in str(e.value) and "\n" not in str(e.value), e.value


# --- import: cfg's keys, node names, a .pt's edge flags (each passed silently before) -------------------


def _import(path: Path, tiny_dir, capsys) -> tuple[int, list[str]]:
    """``(exit status, stderr's lines)`` of ``headprobe import --heads-file PATH`` on the tiny Llama."""
    capsys.readouterr()
    code = main(["import", "--heads-file", str(path), "--model", str(tiny_dir), "--device", "cpu"])
    return code, capsys.readouterr().err.splitlines()


def _tiny_graph(**change) -> dict:
    """:func:`_small_graph` with the tiny Llama's cfg (2 layers x 8 heads, d_model 64, sequential)."""
    return _small_graph(cfg={"n_layers": 2, "n_heads": 8, "parallel_attn_mlp": False, "d_model": 64}, **change)


@pytest.mark.parametrize("key", ["n_layers", "n_heads", "parallel_attn_mlp", "d_model"])
def test_a_graph_json_whose_cfg_lacks_a_key_is_refused_naming_it(key, tmp_path, tiny_dir, capsys):
    """``Graph.to_json`` writes ``cfg`` as ``{n_layers, n_heads, parallel_attn_mlp, d_model}`` and
    ``from_json`` builds the graph from all four (``from_model`` with ``neuron_level=True`` reads
    ``d_model``): a cfg without one is no graph EAP-IG reads. Old code: read, sizes taken from the
    model where given, else left unchecked (an MLP's own-layer edge taken as sequential)."""
    from headprobe.analyses.exchange import Layout, read_mib
    from headprobe.probe.core.errors import HeadprobeError

    for layout in (None, Layout("m", 2, 4)):
        graph = _small_graph()
        del graph["cfg"][key]
        with pytest.raises(HeadprobeError) as e:
            read_mib(graph, "g.json", layout)
        assert str(e.value).startswith(f"g.json: cfg has no {key} (EAP-IG's Graph.to_json"), e.value
        assert "\n" not in str(e.value)
    graph = _tiny_graph()
    del graph["cfg"][key]
    (tmp_path / "g.json").write_text(json.dumps(graph))
    code, err = _import(tmp_path / "g.json", tiny_dir, capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith(f"headprobe: error: g.json: cfg has no {key} "), err


@pytest.mark.parametrize("key", ["n_layers", "n_heads", "parallel_attn_mlp"])
def test_a_pt_graph_whose_cfg_lacks_a_key_from_pt_reads_is_refused(key, tmp_path):
    """``from_pt`` builds the graph with ``from_model(cfg)``, which reads ``n_layers``, ``n_heads``
    and ``parallel_attn_mlp`` (not ``d_model``): without one it fails, so does this reader. Old code:
    a missing ``parallel_attn_mlp`` was read as false (sequential); a missing size refused, in other words."""
    from headprobe.analyses.exchange import Layout, read_head_file
    from headprobe.probe.core.errors import HeadprobeError

    d = _graph_pt(2, 4, {"a0.h1"})
    del d["cfg"]["d_model"]  # from_pt never reads it: still a graph
    torch.save(d, tmp_path / "g.pt")
    assert read_head_file(tmp_path / "g.pt", Layout("m", 2, 4), 3).heads == [(0, 1)]
    del d["cfg"][key]
    torch.save(d, tmp_path / "g.pt")
    with pytest.raises(HeadprobeError) as e:
        read_head_file(tmp_path / "g.pt", Layout("m", 2, 4), 3)
    assert str(e.value).startswith(f"g.pt: cfg has no {key} (EAP-IG's Graph.to_pt"), e.value
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "node",
    [
        "a2.h0",  # a layer the graph has not (read as head 2.0 where no model was given)
        "a0.h4",  # a head the graph has not
        "a0.h01",  # read as head 0.1; EAP-IG names it a0.h1
        "m2",
        "junk",
        "a0.h1<q>",  # a destination name, no node
        "Input",
    ],
)
def test_a_node_eap_ig_has_not_is_refused_naming_it(node, tmp_path, tiny_dir, capsys):
    """``from_json`` looks every node name but ``logits`` up in ``from_model(cfg)``'s nodes (a
    KeyError for any other). Old code: ignored, or read as a head when no model was given."""
    from headprobe.analyses.exchange import Layout, read_mib
    from headprobe.probe.core.errors import HeadprobeError

    for layout in (None, Layout("m", 2, 4)):
        graph = _small_graph()
        graph["nodes"][node] = {"in_graph": True}
        with pytest.raises(HeadprobeError) as e:
            read_mib(graph, "g.json", layout)
        assert str(e.value).startswith(f"g.json: node {node!r} is no node of EAP-IG's graph of 2 layers x 4 heads"), (
            e.value
        )
        assert "\n" not in str(e.value)
    if node in ("m2", "junk"):  # through the command: exit 2, one line, before any weights load
        graph = _tiny_graph()
        graph["nodes"][node] = {"in_graph": False}
        (tmp_path / "g.json").write_text(json.dumps(graph))
        code, err = _import(tmp_path / "g.json", tiny_dir, capsys)
        assert code == 2 and len(err) == 1, err
        assert err[0].startswith(f"headprobe: error: g.json: node {node!r} is no node of EAP-IG's graph"), err


@pytest.mark.parametrize(
    "flags, dtype",
    [(lambda t: t.float(), "float32"), (lambda t: t.long(), "int64"), (lambda t: t.to(torch.uint8), "uint8")],
)
def test_a_pt_graphs_edge_flags_must_be_bool_as_its_node_flags(flags, dtype, tmp_path, tiny_dir, capsys):
    """``to_pt`` saves ``edges_in_graph`` as a bool tensor, as ``nodes_in_graph`` (already checked).
    Old code: any dtype passed unchecked."""
    from headprobe.analyses.exchange import Layout, read_head_file
    from headprobe.probe.core.errors import HeadprobeError

    d = _graph_pt(2, 4, {"input", "a0.h1", "a1.h2"})
    torch.save(d | {"edges_in_graph": flags(d["edges_in_graph"])}, tmp_path / "g.pt")
    with pytest.raises(HeadprobeError) as e:
        read_head_file(tmp_path / "g.pt", Layout("m", 2, 4), 3)
    assert str(e.value) == (
        f"g.pt: edges_in_graph is a {dtype} tensor, not bool (EAP-IG's to_pt saves the edge flags as bool)"
    )
    if dtype == "float32":  # through the command: exit 2, one line
        d = _graph_pt(2, 8, {"input", "a0.h1"})
        d["cfg"]["d_model"] = 64
        torch.save(d | {"edges_in_graph": d["edges_in_graph"].float()}, tmp_path / "t.pt")
        code, err = _import(tmp_path / "t.pt", tiny_dir, capsys)
        assert code == 2 and err == [f"headprobe: error: {e.value}".replace("g.pt", "t.pt")], err


@pytest.mark.parametrize(
    "move, fragment",
    [
        (lambda dst: [dst[-1], *dst[:-1]], "dst_nodes[0] is 'logits', not 'a0.h0<q>'"),  # logits first
        (lambda dst: [*dst[13:], *dst[:13]], "dst_nodes[0] is 'a1.h0<q>', not 'a0.h0<q>'"),  # layer 1 before layer 0
        (lambda dst: [*dst[:-1], "junk"], "dst_nodes[26] is 'junk', not 'logits'"),
    ],
)
def test_a_pt_graphs_dst_nodes_must_be_eap_igs_in_its_order(move, fragment, tmp_path, tiny_dir, capsys):
    """``from_pt`` takes the columns by place (``get_dst_nodes``' order), never by ``dst_nodes``'
    names; this reader took them by name, so columns in another order were read as EAP-IG never
    reads them. Old code: heads and scores returned (a bad name: refused, in other words)."""
    from headprobe.analyses.exchange import Layout, read_head_file
    from headprobe.probe.core.errors import HeadprobeError

    d = _graph_pt(2, 4, {"input", "a0.h1", "a1.h2"})
    _, dst, _ = eap_ig_names(2, 4)
    assert (
        d["dst_nodes"]
        == dst
        == [f"a0.h{h}<{x}>" for x in "qkv" for h in range(4)]
        + ["m0"]
        + [f"a1.h{h}<{x}>" for x in "qkv" for h in range(4)]
        + ["m1", "logits"]
    )
    torch.save(d | {"dst_nodes": move(dst)}, tmp_path / "g.pt")
    with pytest.raises(HeadprobeError) as e:
        read_head_file(tmp_path / "g.pt", Layout("m", 2, 4), 3)
    assert str(e.value).startswith(f"g.pt: {fragment} (EAP-IG's get_dst_nodes order"), e.value
    if fragment.startswith("dst_nodes[0] is 'logits'"):  # through the command: exit 2, one line
        d = _graph_pt(2, 8, {"input", "a0.h1"})
        d["cfg"]["d_model"] = 64
        torch.save(d | {"dst_nodes": move(d["dst_nodes"])}, tmp_path / "t.pt")
        code, err = _import(tmp_path / "t.pt", tiny_dir, capsys)
        assert code == 2 and len(err) == 1, err
        assert err[0].startswith("headprobe: error: t.pt: dst_nodes[0] is 'logits', not 'a0.h0<q>'"), err
