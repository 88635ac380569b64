"""``print(result)`` of every command's Python result: the class, its settings and the shapes of
its arrays, tensors and tables in at most 2 kB (the dataclass repr printed every value: ~180 kB
for a scan of SmolLM2-135M), each command run at tiny settings on the tiny model."""

from __future__ import annotations

import dataclasses
import inspect
import json

import numpy as np
import pandas as pd
import pytest
import torch
from test_patch import _pairs

import headprobe
from headprobe.commands import COMMANDS

LIMIT = 2000
DATA = dict(n_natural=3, seq_len=16, n_repeated=2, period=6, device="cpu")
SCAN = dict(DATA, k=2, n_random=2)


@pytest.fixture(scope="module")
def results(tiny_dir, text_file, tmp_path_factory):
    """``{command: its result}`` for every command with a Python function that returns an object."""
    out = tmp_path_factory.mktemp("repr")
    prompts = out / "pairs.jsonl"
    prompts.write_text("\n".join(json.dumps(vars(p)) for p in _pairs(4)) + "\n", encoding="utf-8")
    model = headprobe.load_model(str(tiny_dir), device="cpu", quiet=True)
    text = str(text_file)
    r = {"scan": headprobe.scan(model, text=text, **SCAN)}
    r["ablate"] = headprobe.ablate(model, text=text, **DATA)
    r["prune"] = headprobe.prune(model, text=text, n_seeds=1, l0_lambdas=(1.0,), l0_steps=2, step_fraction=0.5, **DATA)
    r["budget"] = headprobe.budget(preset="llama3-8b", seq_len=4096)
    r["patch"] = headprobe.patch(model, prompts=str(prompts))
    r["circuit"] = headprobe.circuit(model, n_seqs=2, period=6, steps=2, verify=4, top=5, qk_head="1.3")
    r["kv"] = headprobe.kv(model, text=text, seq_len=64, n_random=1, budgets=(0.5,))
    r["kv"].save(out / "kv")
    r["export"] = headprobe.export(str(out / "kv"))
    r["export"].save(out / "export")
    r["import"] = getattr(headprobe, "import")(model, text=text, heads_file=str(out / "export"), seq_len=64, n_random=2)
    r["robustness"] = headprobe.robustness(model, text=text, kinds=("zero",), control_seeds=1, n_boot=10, **SCAN)
    r["diff"] = headprobe.diff(model, str(tiny_dir), text=text, k=2, requantize_b="int8", **DATA)  # B must differ
    r["show"] = headprobe.show(model, head="1.2", prompt="t1 t2 t3 t4 t1 t2 t3", out=str(out / "show"))
    r["atlas"] = headprobe.atlas(
        out=str(out / "atlas"), models=str(tiny_dir), text=text, types=("induction",), pattern_len=0, **SCAN
    )
    tiny_train = dict(d_model=16, n_heads=2, n_words=16, seq_len=33, max_period=12, eval_period=8, device="cpu")
    r["train"] = headprobe.train(steps=4, eval_every=2, n_eval=8, **tiny_train)
    r["study"] = headprobe.study(
        "layouts", steps=2, eval_every=2, seeds=(0,), d_model=16, n_heads=4, ranks=(2,), rope=2, device="cpu"
    )
    return r


def _shapes(value) -> list[str]:
    """The shape texts the repr must show for a field's value: a table's rows and columns, an
    array's or tensor's dtype and shape, for the value and a mapping's values (written here from
    pandas', numpy's and torch's own attributes)."""
    if isinstance(value, pd.DataFrame):
        return [f"DataFrame[{len(value)} rows x {len(value.columns)}]"]
    if isinstance(value, np.ndarray):
        return [f"{value.dtype.name}[{', '.join(map(str, value.shape))}]"]
    if isinstance(value, torch.Tensor):
        return [f"{str(value.dtype).split('.')[1]}[{', '.join(map(str, value.shape))}]"]
    if isinstance(value, dict) and len(value) <= 4:
        return [s for v in value.values() for s in _shapes(v) if not isinstance(v, dict)]
    return []


def test_every_command_result_has_the_one_compact_repr():
    """Every class a command's Python function returns uses the shared repr (a new result that
    forgets ``repr=False`` on its dataclass gets the dataclass's own, which prints every value)."""
    from headprobe.probe.core.reprs import CompactRepr

    classes = {}
    for name in COMMANDS.names():
        function = COMMANDS.get(name).function()
        returned = inspect.signature(function).return_annotation
        cls = returned if inspect.isclass(returned) else getattr(inspect.getmodule(function), str(returned), None)
        if cls is not None and dataclasses.is_dataclass(cls):
            classes[name] = cls
    assert len(classes) >= 14, sorted(classes)
    assert [n for n, c in classes.items() if c.__repr__ is not CompactRepr.__repr__] == []


@pytest.mark.parametrize(
    "command",
    [
        "scan",
        "ablate",
        "prune",
        "budget",
        "patch",
        "circuit",
        "kv",
        "export",
        "import",
        "robustness",
        "diff",
        "show",
        "atlas",
        "train",
        "study",
    ],
)
def test_repr_is_short_and_names_the_class_and_shapes(results, command):
    result = results[command]
    text = repr(result)
    assert len(text) <= LIMIT, f"{len(text)} characters"
    assert text.startswith(f"{type(result).__name__}(") and str(result) == text
    shown = [s for f in dataclasses.fields(result) for s in _shapes(getattr(result, f.name))]
    assert all(s in text for s in shown), (shown, text)
    if command in (
        "scan",
        "ablate",
        "prune",
        "patch",
        "circuit",
        "kv",
        "robustness",
        "diff",
        "atlas",
        "study",
        "train",
    ):
        assert "DataFrame[" in text  # each has a table


def test_repr_reads_no_values_and_stays_under_the_limit():
    """Shapes come from attributes alone: a tensor on the meta device (no data: ``.item()`` or a
    sum would raise) is shown, and fifty long fields still fit in the limit with the notes whole."""
    from headprobe.probe.core.reprs import CompactRepr

    fields = [("x", object), ("t", object), ("df", object)] + [(f"f{i}", str) for i in range(50)]
    Big = dataclasses.make_dataclass("Big", fields, bases=(CompactRepr,), repr=False)
    Big._repr_notes = lambda self: {"verdicts": "2 CONFIRMED (induction, previous_token)"}
    big = Big(
        {"scores": np.zeros((30, 9), np.float32)},
        torch.empty(1000, 1000, 64, device="meta", dtype=torch.bfloat16),
        pd.DataFrame({"a": range(270), "b": 0.0}),
        *(["word " * 200] * 50),
    )
    text = repr(big)
    assert len(text) <= LIMIT and "verdicts: 2 CONFIRMED (induction, previous_token)," in text
    assert "x={scores: float32[30, 9]}" in text and "t=bfloat16[1000, 1000, 64]" in text
    assert "df=DataFrame[270 rows x 2]" in text and text.count("f49=") == 1


FIGURE_SUFFIXES = {".png", ".pdf", ".svg"}
DRAWING = ("scan", "ablate", "prune", "patch", "circuit", "kv", "robustness", "diff", "train", "study")
"""The commands whose result's ``save`` writes figures (``--formats``)."""


def _files(out) -> tuple[set[str], set[str]]:
    """``(figure files, other files)`` under ``out``, as paths relative to it (read from the folder)."""
    files = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    figures = {f for f in files if f[f.rfind(".") :] in FIGURE_SUFFIXES}
    return figures, files - figures


@pytest.mark.parametrize("command", DRAWING)
def test_save_writes_the_figure_formats_it_is_given(results, command, tmp_path, monkeypatch):
    """``save(path, formats=...)`` is ``--formats``: ``"png"`` writes PNGs alone (the suite's
    ``$HEADPROBE_FIGURE_FORMATS=none`` notwithstanding), ``"none"`` no figure and the same other
    files, and with ``formats`` left None the environment variable still decides (``png``: the
    same files as ``formats="png"``)."""
    from headprobe.analyses.vocabulary import FIGURE_FORMATS_ENV

    result = results[command]
    monkeypatch.setenv(FIGURE_FORMATS_ENV, "none")
    result.save(tmp_path / "png", formats="png")
    pngs, others = _files(tmp_path / "png")
    assert pngs and {f[f.rfind(".") :] for f in pngs} == {".png"}
    monkeypatch.setenv(FIGURE_FORMATS_ENV, "png")
    result.save(tmp_path / "none", formats=())
    assert _files(tmp_path / "none") == (set(), others)
    result.save(tmp_path / "env")  # formats=None: $HEADPROBE_FIGURE_FORMATS
    assert _files(tmp_path / "env") == (pngs, others)


@pytest.mark.parametrize("command", DRAWING)
def test_a_bad_figure_format_is_one_line_before_anything_is_written(results, command, tmp_path):
    """A misspelt format is refused as ``--formats`` refuses it (one line naming the closest
    format), as an InputValueError (a HeadprobeError and a ValueError), and nothing is written."""
    from headprobe.probe.core.errors import HeadprobeError, InputValueError

    for formats, said in [
        ("png,sgv", "formats='png,sgv': unknown figure format 'sgv' (did you mean 'svg'?); choose from png, pdf, svg"),
        (["pdf", "PMG"], "formats=['pdf', 'PMG']: unknown figure format 'pmg' (did you mean 'png'?); choose from"),
        ("none,png", "formats='none,png': 'none' (no figures) cannot be combined with a format"),
        ("", "formats='': choose from png, pdf, svg (comma-separated) or none"),
    ]:
        with pytest.raises(InputValueError) as e:
            results[command].save(tmp_path / "out", formats=formats)
        assert isinstance(e.value, HeadprobeError) and isinstance(e.value, ValueError)
        assert str(e.value).startswith(said) and "\n" not in str(e.value)
        assert not (tmp_path / "out").exists()


def test_show_and_atlas_take_the_figure_formats(tiny_dir, text_file, tmp_path):
    """``show`` and ``atlas`` write their files themselves: ``formats=`` as ``--formats`` (PNGs
    alone, the atlas's and each model's scan; ``"none"``: the page alone), a bad one refused before
    the model loads or anything is written."""
    from headprobe.probe.core.errors import InputValueError

    show = dict(head="1.2", prompt="t1 t2 t3 t4 t1 t2 t3")
    page = {"index.html", ".headprobe-outputs.json"}  # the page and the list of the files written
    headprobe.show(str(tiny_dir), out=str(tmp_path / "show-png"), formats="png", device="cpu", **show)
    assert _files(tmp_path / "show-png") == ({"pattern_1.2.png"}, page)
    headprobe.show(str(tiny_dir), out=str(tmp_path / "show-none"), formats="none", device="cpu", **show)
    assert _files(tmp_path / "show-none") == (set(), page)
    with pytest.raises(InputValueError, match=r"^formats='jpg': unknown figure format 'jpg'"):
        headprobe.show("no/such/model", out=str(tmp_path / "bad"), formats="jpg", **show)
    atlas = dict(models=str(tiny_dir), text=str(text_file), types=("induction",), pattern_len=0, **SCAN)
    headprobe.atlas(out=str(tmp_path / "atlas"), formats=("png",), **atlas)
    figures, _ = _files(tmp_path / "atlas")
    assert {f[f.rfind(".") :] for f in figures} == {".png"}
    assert any("/" not in f for f in figures) and any(f.startswith("models/") for f in figures)
    with pytest.raises(
        InputValueError, match=r"^formats=\('svgz',\): unknown figure format 'svgz' \(did you mean 'svg'"
    ):
        headprobe.atlas(out=str(tmp_path / "bad"), formats=("svgz",), **atlas)
    assert not (tmp_path / "bad").exists()


def test_analysis_results_have_the_compact_repr():
    """The analyses' results a user prints from Python (``edge_attribution``'s EdgeScores,
    ``qk_attribution``'s QKAttribution) show shapes and the first labels, not every value: at
    SmolLM2-135M's sizes their dataclass reprs printed whole arrays and 200 labels."""
    from headprobe.analyses.circuit import EdgeScores
    from headprobe.analyses.qk_attribution import QKAttribution

    edges = EdgeScores("eap-ig", 5, np.zeros((3, 30, 9, 30, 9)), np.zeros((30, 9)))
    labels = ["embed"] + [f"{l}.{h}" for l in range(22) for h in range(9)] + ["mlp 21"]
    qk = QKAttribution(18, 6, 19, 8, labels, labels, np.zeros((200, 200)), 11.55, 1e-7)
    for result, shown in [
        (edges, ["method='eap-ig'", "head_scores=float64[3, 30, 9, 30, 9]", "logit_scores=float64[30, 9]"]),
        (qk, ["layer=18", "contributions=float64[200, 200]", "q_labels=['embed', '0.0', '0.1', '0.2', ... 196 more]"]),
    ]:
        text = repr(result)
        assert len(text) <= LIMIT and text.startswith(f"{type(result).__name__}("), text[:300]
        assert all(s in text for s in shown), text


@pytest.mark.parametrize(
    ("fixture", "cls", "backend", "layout"),
    [
        ("tiny_gpt2", "BridgeModel", "transformer-lens", "MHA"),
        ("tiny_gpt2_native", "NativeModel", "native", "MHA"),
        ("tiny_llama_gqa", "BridgeModel", "transformer-lens", "GQA, 2 kv heads"),
        ("tiny_llama_gqa_native", "NativeModel", "native", "GQA, 2 kv heads"),
    ],
)
def test_a_loaded_model_has_a_one_line_repr(fixture, cls, backend, layout, request):
    """``print(model)`` showed ``<headprobe.probe.backends.native.NativeModel object at 0x...>``: now one
    line with the name, backend, layers and heads (the Hugging Face config's), layout, device and dtype."""
    model = request.getfixturevalue(fixture)
    hf = request.getfixturevalue(fixture.removesuffix("_native") + "_checkpoint").hf_model.config
    name = request.getfixturevalue(fixture.removesuffix("_native") + "_checkpoint").name
    said = (
        f"{cls}(name={name!r}, backend={backend!r}, layers={hf.num_hidden_layers}, "
        f"heads={hf.num_attention_heads}, layout={layout!r}, device='cpu', dtype='float32')"
    )
    assert repr(model) == said and str(model) == said


def test_a_scans_dtype_is_the_name_summary_json_gives(tiny_dir, text_file, tmp_path):
    """ScanResult's repr said ``dtype='torch.float32'`` while summary.json (and the docstring) say
    ``float32``: the field is torch's name without the module now, the same as the file's."""
    model = headprobe.load_model(str(tiny_dir), device="cpu", quiet=True)
    scan = headprobe.scan(
        model, text=str(text_file), types="induction", verify=False, metrics=False, pattern_len=0, **DATA
    )
    assert scan.dtype == "float32" and "dtype='float32'" in repr(scan)
    scan.save(tmp_path / "s", formats="none")
    assert json.loads((tmp_path / "s" / "summary.json").read_text())["dtype"] == scan.dtype
