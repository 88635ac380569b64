"""README's "Where to add": each row names one place. Each test here adds one thing in that place
alone, at run time (removed again after the test), and finds it everywhere it must appear: the
command line (choices, help, did-you-mean), the scan's CSV columns, summary.json, the figures, the
viewer's data and the docs check. Ablation kinds and model families have their own files
(tests/test_ablation_kinds.py, tests/test_a_new_family.py); rows for commands and shared settings
are tested in functions of their own."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import headprobe
from headprobe.analyses.columns import HEAD_COLUMNS, HEAD_TYPE, METRIC, HeadColumn, HeatmapStyle
from headprobe.probe.core.errors import HeadprobeError

ROOT = Path(__file__).resolve().parents[1]
SMALL_SCAN = dict(n_natural=3, seq_len=16, n_repeated=2, period=6, k=3, n_random=2)


def undocumented_columns(doc: Path = ROOT / "docs" / "scan.md") -> list[str]:
    """The docs check of the head columns: every column of every registered head type and metric
    is named (in backticks) in docs/scan.md, where head types and metrics are defined."""
    text = doc.read_text(encoding="utf-8")
    return [c for name in HEAD_COLUMNS.names() for c in HEAD_COLUMNS.get(name).columns if f"`{c}`" not in text]


@pytest.fixture
def registered(request):
    """``add(name, record, group)``: register a head column for this test only."""
    added: list[str] = []

    def add(name: str, record: HeadColumn, group: str) -> HeadColumn:
        HEAD_COLUMNS.register(name, record, group=group)
        added.append(name)
        return record

    yield add
    for name in added:
        HEAD_COLUMNS.unregister(name)


@pytest.fixture(scope="module")
def model(tiny_dir):
    return headprobe.load_model(str(tiny_dir), device="cpu")


def scan_rows_missing(doc: Path = ROOT / "docs" / "scan.md") -> dict[str, list[str]]:
    """The stricter docs check: the head types that docs/scan.md's ``--types`` row does not name, and the
    columns of every head type and metric that its head_scores.csv row does not name (each in backticks)."""
    lines = doc.read_text(encoding="utf-8").splitlines()
    row = {k: next(line for line in lines if line.startswith(f"| `{k}` |")) for k in ("--types", "head_scores.csv")}
    columns = [c for name in HEAD_COLUMNS.names() for c in HEAD_COLUMNS.get(name).columns]
    return {
        "--types": [t for t in HEAD_COLUMNS.names(HEAD_TYPE) if f"`{t}`" not in row["--types"]],
        "head_scores.csv": [c for c in columns if f"`{c}`" not in row["head_scores.csv"]],
    }


def test_every_registered_head_column_is_documented():
    missing = undocumented_columns()
    assert missing == [], (
        f"docs/scan.md does not name the columns {missing} (in backticks): define a head type's columns in its "
        "section there and a metric's in the head-metrics table (CONTRIBUTING.md, 'Where to add')"
    )


def test_the_types_row_and_the_csv_row_of_scan_md_name_every_type_and_column():
    """A type named anywhere in docs/scan.md passed the check above while its ``--types`` row and its
    head_scores.csv row stayed stale (the encoders' ``next_token`` and ``last_token`` were missing from the
    CSV row)."""
    missing = scan_rows_missing()
    assert missing == {"--types": [], "head_scores.csv": []}, (
        f"docs/scan.md: add these head types to the `--types` row of its flags table and these columns to the "
        f"`head_scores.csv` row of its outputs table: {missing}"
    )


def test_the_torch_free_column_meanings_are_the_records_heatmap_titles_and_labels():
    """export's dataset card reads COLUMN_MEANINGS (no export imports torch; the records' modules do):
    it must say of each drawn column what its heatmap says."""
    from headprobe.analyses.columns import COLUMN_MEANINGS, HEAD_COLUMNS

    drawn = {f.column: (f.title, f.label) for n in HEAD_COLUMNS.names() for f in HEAD_COLUMNS.get(n).figures}
    assert COLUMN_MEANINGS == drawn, (
        "analyses/columns.py: COLUMN_MEANINGS must give each drawn column its HeatmapStyle's (title, label)"
    )


def test_the_torch_free_encoder_only_list_is_the_records_flags():
    from headprobe.analyses.columns import DETECTORS, ENCODER_ONLY_TYPES

    assert set(ENCODER_ONLY_TYPES) == {n for n, d in DETECTORS.items() if d.encoder_only}, (
        "analyses/columns.py: ENCODER_ONLY_TYPES must name exactly the head types whose record says encoder_only"
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["diff", "no-such-model-a", "no-such-model-b", "--types", "induction,next_token"],
        ["robustness", "--model", "no-such-model", "--types", "last-token"],
    ],
)
def test_diff_and_robustness_refuse_an_encoder_only_type_before_loading(argv, capsys, tmp_path):
    """They need causal models: diff refused ``--types next_token`` after loading (as "no head type
    given"), robustness ran it for minutes. Now one line before the model loads (a load of these
    names would fail with another message) and no folder."""
    from headprobe.cli import main

    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "scored on encoders only" in err and "causal" in err, err
    assert not (tmp_path / "out").exists()


def test_the_readme_counts_of_the_default_scan_are_the_registrys():
    """README says how many control sets the default scan of a decoder plans, "for five types": true
    only while five head types apply to decoders. The number is plan_draws' for the decoders' type count."""
    from headprobe.analyses.columns import DETECTORS
    from headprobe.analyses.verification import VerificationSettings, plan_draws

    n = sum(d.applies_to(True) for d in DETECTORS.values())
    text = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    claims = re.findall(
        r"(\d+) (?:layer-matched )?control sets per (?:head )?type (?:for|that) (\w+) (?:types|verdicts)", text
    )
    assert len(claims) == 2, claims
    words = {5: "five", 6: "six", 7: "seven", 8: "eight"}
    draws = plan_draws(n, VerificationSettings(k=10, n_random=50, alpha=0.05))
    assert all(c == (str(draws), words.get(n, str(n))) for c in claims), (claims, n, draws)


# ---- a head type: one HEAD_COLUMNS entry (group "head type") and its record ------------------------


def _prev_copy() -> HeadColumn:
    """A test-local head type: the previous-token score under another name (its column must equal
    the registry-free reference, a per-head loop over the captured patterns)."""
    from headprobe.analyses.detectors import previous_token_score

    return HeadColumn(
        "prev_copy",
        ("prev_copy",),
        lambda p, period, start: {"prev_copy": previous_token_score(p)},
        "natural",
        "natural",
        figures=(HeatmapStyle("prev_copy", "copied score", "attention to i-1"),),
    )


def vocab_types() -> tuple[str, ...]:
    from headprobe.analyses.columns import HEAD_TYPES

    return tuple(HEAD_TYPES)


def test_a_head_type_is_a_cli_choice(registered, capsys):
    from headprobe.analyses.columns import select_head_types
    from headprobe.cli import main

    registered("prev_copy", _prev_copy(), HEAD_TYPE)
    assert main(["scan", "--help"]) == 0
    words = capsys.readouterr().out.split()
    # --types' help lists every type, none cut at a line end ("first_" / "token" when listed without spaces)
    assert {"prev_copy", *vocab_types()} <= {w.strip(",;()") for w in words}
    assert select_head_types("prev-copy") == ("prev_copy",)
    with pytest.raises(HeadprobeError, match=r"did you mean prev_copy\?"):
        select_head_types("prev-cpy")


@pytest.mark.figures
def test_a_head_type_reaches_the_csv_summary_figures_and_viewer(registered, model, text_file, tmp_path):
    from headprobe.analyses import viewer
    from headprobe.probe.hooks.capture import capture_heads

    registered("prev_copy", _prev_copy(), HEAD_TYPE)
    # no metrics: a head type's way to the files is not theirs (the next test's), and their ten heatmaps were
    # most of the figures save drew here
    result = headprobe.scan(model, text=str(text_file), types="prev-copy,induction", metrics=False, **SMALL_SCAN)
    assert [c for c in result.table.columns if c in ("prev_copy", "induction")] == [
        "induction",
        "prev_copy",
    ]  # registry order
    # the reference: mean attention from i to i-1 over queries 1..T-1, head by head, from captured patterns
    tokens = result.natural.tokens
    for layer in range(model.spec.n_layers):
        pattern = capture_heads(model, tokens, layers=[layer])["pattern"][layer]  # [batch, head, q, k]
        for head in range(model.spec.n_heads):
            p = pattern[:, head].double()
            want = torch.stack([p[:, i, i - 1] for i in range(1, p.shape[-1])]).mean()
            got = result.table.query(f"layer == {layer} and head == {head}")["prev_copy"].item()
            assert got == pytest.approx(float(want), abs=1e-5)
    assert {"heatmap_prev_copy", "pattern_prev_copy"} <= set(result.figures())
    assert {v.head_type for v in result.verifications} == {"prev_copy", "induction"}
    result.save(tmp_path / "out", html=True)
    csv = pd.read_csv(tmp_path / "out" / "head_scores.csv")
    assert "prev_copy" in csv.columns and (tmp_path / "out" / "heatmap_prev_copy.png").is_file()
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert "prev_copy" in summary["top_heads"] and "prev_copy" in summary["config"]["types"]
    data = viewer.viewer_data(csv, summary)
    assert any(m["column"] == "prev_copy" and m["head_type"] == "prev_copy" for m in data["maps"])
    assert "prev_copy" in (tmp_path / "out" / "index.html").read_text()


def test_a_head_type_must_be_documented(registered):
    before = set(undocumented_columns())
    rows_before = scan_rows_missing()
    registered("prev_copy", _prev_copy(), HEAD_TYPE)
    assert set(undocumented_columns()) - before == {"prev_copy"}  # docs/scan.md must define it
    rows = scan_rows_missing()  # and name it in its --types row and its head_scores.csv row
    assert {k: set(v) - set(rows_before[k]) for k, v in rows.items()} == {
        "--types": {"prev_copy"},
        "head_scores.csv": {"prev_copy"},
    }


# ---- a reported metric: one HEAD_COLUMNS entry (group "metric") and its record ---------------------


def _metric_records():
    """Two test-local metrics: the sink rate under another name, and one the model never allows."""
    from headprobe.analyses.metrics import SINK_RATE

    def never(model, inputs):
        raise HeadprobeError("not on this model")

    copy = dataclasses.replace(
        SINK_RATE,
        name="sink_copy",
        columns=("sink_copy",),
        score=lambda model, inputs: {"sink_copy": SINK_RATE.score(model, inputs)["sink_rate"]},
        figures=(HeatmapStyle("sink_copy", "copied sink rate", "mean attention to token 0"),),
    )
    return copy, HeadColumn("never", ("never",), never, figures=(HeatmapStyle("never", "never", "never"),))


@pytest.mark.figures
def test_a_metric_reaches_the_csv_summary_figures_and_viewer(registered, model, text_file, tmp_path):
    from headprobe.analyses import viewer
    from headprobe.probe.hooks.capture import capture_heads

    for record in _metric_records():
        registered(record.name, record, METRIC)
    unverified = {k: v for k, v in SMALL_SCAN.items() if k not in ("k", "n_random")}  # refused with verify=False
    result = headprobe.scan(model, text=str(text_file), types="induction", verify=False, **unverified)
    assert list(result.table.columns[-2:]) == ["sink_copy", "never"]  # after the built-in metrics
    # the reference: attention to position 0, every query included, head by head (Gu et al. 2024, eq. 1)
    pattern = capture_heads(model, result.natural.tokens)["pattern"]
    for layer, p in pattern.items():
        want = p[..., :, 0].double().mean(dim=(0, 2)).numpy()
        got = result.table.query(f"layer == {layer}").sort_values("head")["sink_copy"].to_numpy()
        np.testing.assert_allclose(got, want, atol=1e-5)
    assert result.table["never"].isna().all()
    summary = result.summary()
    assert summary["metrics"]["skipped"]["never"] == "not on this model"
    assert "sink_copy" in summary["metrics"]["top_heads"] and "never" not in summary["metrics"]["top_heads"]
    figures = set(result.figures())
    assert "heatmap_sink_copy" in figures and "heatmap_never" not in figures  # no heatmap of an all-NaN column
    result.save(tmp_path / "out", html=True)
    csv = pd.read_csv(tmp_path / "out" / "head_scores.csv")
    assert "sink_copy" in csv.columns and (tmp_path / "out" / "heatmap_sink_copy.png").is_file()
    data = viewer.viewer_data(csv, json.loads((tmp_path / "out" / "summary.json").read_text()))
    i = 3 + data["columns"].index(
        "sink_copy"
    )  # the viewer's table carries every CSV column, after layer, head, kv_head
    assert [row[i] for row in data["rows"]] == pytest.approx(
        csv.sort_values(["layer", "head"])["sink_copy"].tolist(), abs=1e-3
    )


def test_a_metric_must_be_documented(registered):
    before = set(undocumented_columns())
    for record in _metric_records():
        registered(record.name, record, METRIC)
    assert set(undocumented_columns()) - before == {"sink_copy", "never"}
    assert set(scan_rows_missing()["head_scores.csv"]) >= {"sink_copy", "never"}


# ---- a backend: one BACKEND_REGISTRY entry and its LoadedModel subclass -------------------------------


@pytest.fixture
def copy_backend():
    """A test-local backend: the native model under another name (its own class, its own registry entry)."""
    from headprobe.probe.backends.native import NativeModel
    from headprobe.probe.core.vocabulary import BACKEND_REGISTRY

    class CopyModel(NativeModel):
        name = "native-copy"

        @classmethod
        def wraps(cls, module: object) -> bool:
            return False  # LoadedModel(module, ...) keeps picking the native class

        @classmethod
        def supports(cls, hf_config) -> bool:
            return False  # --backend auto never takes it

    BACKEND_REGISTRY.register("native-copy", CopyModel)
    yield CopyModel
    BACKEND_REGISTRY.unregister("native-copy")


def test_a_backend_is_a_cli_choice_and_loads(copy_backend, tiny_dir, capsys):
    from transformers import AutoModelForCausalLM

    from headprobe import options
    from headprobe.cli import main

    assert main(["scan", "--help"]) == 0
    assert re.search(r"\{auto,native,transformer-lens,native-copy\}", capsys.readouterr().out)
    assert "native-copy" in options.BACKENDS
    loaded = headprobe.load_model(str(tiny_dir), backend="native-copy")
    assert type(loaded) is copy_backend and loaded.backend == "native-copy" and loaded.self_check.ok
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_dir), attn_implementation="eager").eval()
    tokens = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():  # the reference: the Hugging Face model itself
        torch.testing.assert_close(loaded.forward(tokens), hf(tokens).logits, atol=1e-4, rtol=0)
    with pytest.raises(HeadprobeError, match=r"unknown backend 'native-cpy' \(did you mean 'native-copy'"):
        headprobe.load_model(str(tiny_dir), backend="native-cpy")


def test_a_backend_runs_a_scan_from_the_cli(copy_backend, tiny_dir, text_file, tmp_path):
    from headprobe.cli import main

    out = tmp_path / "out"
    assert (
        main(
            [
                "scan",
                "--model",
                str(tiny_dir),
                "--backend",
                "native-copy",
                "--types",
                "induction",
                "--no-verify",
                "--text",
                str(text_file),
                "--out",
                str(out),
                "--n-natural",
                "2",
                "--seq-len",
                "16",
                "--n-repeated",
                "2",
                "--period",
                "6",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    assert json.loads((out / "summary.json").read_text())["config"]["backend"] == "native-copy"


# ---- a backend's capabilities: class flags on LoadedModel decide every gated feature, never its name ---

FLAGGED = "native-flags"


@pytest.fixture
def flagged():
    """``make(*flags)``: register, for this test, the native model under the name ``native-flags``
    with only ``flags`` of :data:`~headprobe.probe.backends.base.CAPABILITIES` on (its own class, its own
    registry entry; ``--backend auto`` never takes it)."""
    from headprobe.probe.backends.base import CAPABILITIES
    from headprobe.probe.backends.native import NativeModel
    from headprobe.probe.core.vocabulary import BACKEND_REGISTRY

    def make(*on: str) -> type:
        assert set(on) <= set(CAPABILITIES), on
        cls = type(
            "FlaggedModel",
            (NativeModel,),
            {
                "name": FLAGGED,
                "wraps": classmethod(lambda c, m: False),
                "supports": classmethod(lambda c, h: False),
                **{flag: flag in on for flag in CAPABILITIES},
            },
        )
        BACKEND_REGISTRY.register(FLAGGED, cls, replace=True)
        return cls

    yield make
    if FLAGGED in BACKEND_REGISTRY:
        BACKEND_REGISTRY.unregister(FLAGGED)


@dataclasses.dataclass
class Subject:
    """What the gated features run on: a tiny native model to re-wrap, its Hugging Face directory and
    a headprobe checkpoint directory of it."""

    base: object
    hf_dir: Path
    native_dir: Path
    tokens: torch.Tensor

    def model(self, cls):
        return cls(self.base.model, self.base.tokenizer, self.base.spec)


@pytest.fixture
def subject(tiny_llama_gqa_native, tiny_dir, tmp_path):
    (tmp_path / "native").mkdir()
    tiny_llama_gqa_native.save(tmp_path / "native")
    tiny_llama_gqa_native.tokenizer.save_pretrained(tmp_path / "native")
    tokens = torch.randint(1, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    return Subject(tiny_llama_gqa_native, tiny_dir, tmp_path / "native", tokens)


def _streams(cls, s):
    from headprobe.probe.hooks.online_stats import online_head_stats

    seen = []
    online_head_stats(s.model(cls), s.tokens, lambda layer, stats: seen.append(stats.lse.shape))
    assert len(seen) == s.base.spec.n_layers


def _kv_preflight(cls, s):
    from headprobe.commands.kv import KVConfig

    KVConfig(model=str(s.hf_dir), seq_len=64, backend=cls.name).preflight()


def _kv_check(cls, s):
    from headprobe.analyses.kvpolicy import check_kv_backend

    check_kv_backend(s.model(cls))


def _paths(cls, s):
    from headprobe.analyses.circuit import prepare_runs

    assert prepare_runs(s.model(cls), s.tokens, s.tokens.flip(1)) is not None


def _float16(cls, s):
    from headprobe.options import load_model

    m = load_model(str(s.hf_dir), device="cpu", dtype="float16", backend=cls.name)
    assert type(m) is cls and m.dtype == torch.float16


def _native_dir(cls, s):
    m = headprobe.load_model(str(s.native_dir), backend=cls.name, quiet=True)
    assert type(m) is cls


def _half_split(cls, s):
    from headprobe.options import load_model

    m = load_model(str(s.hf_dir), dtype="bfloat16", backend=cls.name, device_map="auto", max_memory="cpu=100KB")
    assert type(m) is cls and m.dtype == torch.bfloat16 and m.device_map


def _split(cls, s):
    m = headprobe.load_model(str(s.hf_dir), backend=cls.name, quiet=True, device_map="auto")
    assert type(m) is cls and m.device_map is not None


def _prune_preflight(cls, s):
    from headprobe.commands.prune import PruneConfig

    PruneConfig(backend=cls.name, save_pruned=True)


def _prunable(cls, s):
    s.model(cls).check_prunable()


GATED = {
    "streams_statistics": (_streams,),
    "kv_policies": (_kv_preflight, _kv_check),
    "path_patching": (_paths,),
    "half_precision": (_float16,),
    "native_weights": (_native_dir,),
    "splits_after_load": (_half_split, _split),
    "removes_heads": (_prune_preflight, _prunable),
}
"""Capability -> the ways in to a feature it gates (each runs the feature on backend ``cls``)."""


def test_every_capability_flag_is_declared_off_on_loaded_model_and_has_its_gated_features():
    from headprobe.probe.backends.base import CAPABILITIES, LoadedModel
    from headprobe.probe.backends.bridge import BridgeModel
    from headprobe.probe.backends.native import NativeModel

    flags = sorted(
        n
        for n, v in vars(LoadedModel).items()
        if isinstance(v, bool) and n not in ("supports_padding", "residual_with_logits")
    )
    assert flags == sorted(CAPABILITIES) == sorted(GATED)
    assert not any(getattr(LoadedModel, f) or getattr(BridgeModel, f) for f in CAPABILITIES)
    assert all(getattr(NativeModel, f) is True for f in CAPABILITIES)


def test_the_declared_capabilities_of_each_backend_equal_its_class_flags():
    """``BACKEND_CAPABILITIES`` (torch-free, read by the refusals before the load) declares every
    registered backend, each with exactly the flags its class sets True: they cannot drift apart."""
    from headprobe.probe.backends.base import CAPABILITIES
    from headprobe.probe.core.vocabulary import BACKEND_CAPABILITIES, BACKEND_REGISTRY, backend_has

    assert set(BACKEND_CAPABILITIES) == set(BACKEND_REGISTRY.names())
    for name, declared in BACKEND_CAPABILITIES.items():
        cls = BACKEND_REGISTRY.get(name)
        assert declared == {flag for flag in CAPABILITIES if getattr(cls, flag)}, name
        assert all(backend_has(name, flag) == getattr(cls, flag) for flag in CAPABILITIES), name


def test_a_backend_without_capabilities_is_refused_every_gated_feature_naming_the_flag(flagged, subject):
    """All flags off: each way in to each gated feature is refused in one line that names the missing
    flag and the backend; what needs no flag runs (the materialised pattern instead of streaming)."""
    from headprobe.analyses.scoring import use_online_stats
    from headprobe.probe.hooks.capture import capture_heads

    cls = flagged()
    for flag, ways in GATED.items():
        for way in ways:
            with pytest.raises(HeadprobeError) as e:
                way(cls, subject)
            assert f"(the {FLAGGED} backend lacks {flag})" in str(e.value) and "\n" not in str(e.value), (way, e.value)
    bare, native = subject.model(cls), subject.base
    assert not use_online_stats(bare, 100_000) and use_online_stats(native, 100_000)
    rows = capture_heads(bare, subject.tokens, rows=[3, 11])["pattern"]  # materialised, then rows cut
    want = capture_heads(native, subject.tokens, rows=[3, 11])["pattern"]  # streamed from q and k
    for layer in want:
        torch.testing.assert_close(rows[layer], want[layer], atol=1e-5, rtol=0)


@pytest.mark.parametrize("flag", sorted(GATED))
def test_a_backend_with_one_capability_reaches_its_features(flagged, subject, flag):
    cls = flagged(flag)
    for way in GATED[flag]:
        way(cls, subject)


BACKEND_NAME_COMPARISON = re.compile(
    r"""backend\w*\s*(?:[!=]=|(?<!for )\bnot in\b|(?<!for \w{7})\bin\b)\s*[("'\[]"""  # backend == "x", backend in ("x", ...)
    r"""|getattr\([^)]*["']backend["']"""  # getattr(model, "backend", None)
    r"""|["'](?:native|transformer-lens|auto)["']\s*(?:[!=]=|\bin\b)\s*\w*backend"""  # "x" == backend
    r"""|\.name\s*[!=]=\s*["'](?:native|transformer-lens)["']"""
)
"""A comparison of a backend's name (what ``grep '"native"\\|backend ==\\|.backend'`` looked for)."""


def backend_name_comparisons(text: str) -> list[str]:
    """The lines of ``text`` that compare a backend's name (:data:`BACKEND_NAME_COMPARISON`)."""
    return [
        line.strip()
        for line in text.splitlines()
        if BACKEND_NAME_COMPARISON.search(line) and not line.lstrip().startswith("for ")
    ]


def test_only_the_backend_registry_compares_backend_names():
    """Features ask a capability flag; names are compared in probe/core/vocabulary.py only."""
    found = {
        str(f.relative_to(ROOT)): backend_name_comparisons(f.read_text(encoding="utf-8"))
        for folder in ("probe", "analyses", "headprobe")
        for f in sorted((ROOT / folder).rglob("*.py"))
        if f != ROOT / "probe" / "core" / "vocabulary.py"
    }
    assert {k: v for k, v in found.items() if v} == {}


def test_the_name_comparison_check_can_fail():
    planted = [
        '    if getattr(model, "backend", None) != "native":',
        '    if model.backend != "native":',
        '        if backend not in ("auto", "native"):',
        '    if self.backend == "transformer-lens":',
        '    if backend == "auto":',
        '    stream = rows is not None and getattr(model, "backend", None) == "native"',
        '    if cls.name == "native":',
    ]
    fine = [
        '    for backend in ("native", "transformer-lens"):',
        "    if not model.kv_policies:",
        '    backend: str = "native"',
        '    """backend in one line."""',
    ]
    assert backend_name_comparisons("\n".join(planted + fine)) == [p.strip() for p in planted]


# A command (one module and one entry in headprobe.commands.COMMANDS) and a shared setting (one field
# of a settings dataclass in headprobe/settings.py).

HELLO = '''
"""A command written in a test: ``headprobe hello``."""
import argparse
from dataclasses import dataclass

from headprobe.commands import Command
from headprobe.probe.core.errors import HeadprobeError
from headprobe.settings import DataSettings, setting

HELP = "say hello a given number of times (a command added by a test)"


@dataclass(frozen=True)
class HelloConfig(DataSettings):
    times: int = setting(2, "how many times to say it (default %(default)s)", type=int)

    def __post_init__(self):
        super().__post_init__()
        if self.times < 1:
            raise HeadprobeError(f"--times must be at least 1, got {self.times}")


def hello(**fields) -> str:
    cfg = HelloConfig(**fields)
    return " ".join(["hello"] * cfg.times) + f" (seed {cfg.seed})"


def main(args: argparse.Namespace, cfg: HelloConfig) -> int:
    print(hello(times=cfg.times, seed=cfg.seed))
    return 0


COMMAND = Command(HELP, config=HelloConfig, run="hp_hello_command:main", api=hello)
'''


@pytest.fixture
def hello_command(tmp_path, monkeypatch):
    """``headprobe hello``: a module in a temporary folder and one registry entry, removed afterwards."""
    import headprobe
    from headprobe.commands import COMMANDS

    (tmp_path / "hp_hello_command.py").write_text(HELLO, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    COMMANDS.register("hello", "hp_hello_command:COMMAND")
    try:
        yield
    finally:
        COMMANDS.unregister("hello")
        vars(headprobe).pop("hello", None)  # the API caches what it resolved
        sys.modules.pop("hp_hello_command", None)


def _cli(capsys, *argv) -> tuple[int, str, str]:
    from headprobe.cli import main

    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_a_command_is_one_module_and_one_registry_entry(hello_command, capsys):
    import headprobe

    code, out, _ = _cli(capsys, "--help")
    assert code == 0 and "hello" in out and "say hello a given number of times" in out
    code, out, _ = _cli(capsys, "hello", "--help")
    assert code == 0 and "--times" in out and "how many times to say it (default 2)" in out
    assert "--seed" in out and "--seq-len" in out  # the settings it composes (DataSettings) come as flags
    code, out, _ = _cli(capsys, "hello", "--times", "3", "--seed", "7")
    assert code == 0 and out.strip() == "hello hello hello (seed 7)"
    code, _, err = _cli(capsys, "hello", "--times", "0")
    assert code == 2 and err.strip() == "headprobe: error: --times must be at least 1, got 0"
    code, _, err = _cli(capsys, "helo")
    assert code == 2 and "did you mean 'hello'?" in err
    assert headprobe.hello(times=1, seed=4) == "hello (seed 4)"  # the Python API, same keywords as the flags
    assert "hello" in headprobe.__all__ and "hello" in dir(headprobe)


def test_a_command_not_registered_is_nowhere(capsys):
    """The check above can fail: without the registry entry there is no command and no function."""
    import headprobe

    code, out, _ = _cli(capsys, "--help")
    assert code == 0 and "hello" not in out
    assert _cli(capsys, "hello")[0] == 2
    assert "hello" not in headprobe.__all__
    with pytest.raises(AttributeError):
        headprobe.hello  # noqa: B018


# A field added to ModelSettings or DataSettings in headprobe/settings.py, and nowhere else: the
# edited module is executed as headprobe.settings before any command imports it.
ADD_SETTING = textwrap.dedent("""
    import json, sys, types
    from pathlib import Path

    group, field_src = sys.argv[1], sys.argv[2]
    path = Path("headprobe/settings.py")
    src = path.read_text(encoding="utf-8")
    anchor = "    def __post_init__(self):\\n        check_settings(self)\\n"
    start = src.index(f"class {group}:")
    at = src.index(anchor, start)
    src = src[:at] + field_src + "\\n" + src[at:]
    module = types.ModuleType("headprobe.settings")
    module.__file__ = str(path)
    sys.modules["headprobe.settings"] = module
    exec(compile(src, str(path), "exec"), module.__dict__)

    import argparse, dataclasses, importlib
    from headprobe import options, settings
    from headprobe.cli import build_parser
    from headprobe.commands import COMMANDS

    assert settings is module
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    flagged = sorted(name for name, p in sub.choices.items()
                     if any("--trust-remote-code" in a.option_strings for a in p._actions))
    configs = {}
    for name, module_name, config in [("scan", "headprobe.commands.scan", "ScanConfig"),
                                      ("ablate", "headprobe.commands.ablate", "AblateConfig"),
                                      ("prune", "headprobe.commands.prune", "PruneConfig"),
                                      ("patch", "headprobe.commands.patch", "PatchConfig"),
                                      ("show", "headprobe.commands.show", "ShowConfig"),
                                      ("kv", "headprobe.commands.kv", "KVConfig"),
                                      ("circuit", "headprobe.commands.circuit", "CircuitConfig"),
                                      ("view", "headprobe.commands.view", "ViewConfig"),
                                      ("atlas", "headprobe.commands.atlas", "AtlasConfig"),
                                      ("import", "headprobe.commands.import_heads", "ImportConfig"),
                                      ("robustness", "headprobe.commands.robustness", "RobustnessConfig"),
                                      ("diff", "headprobe.commands.diff", "DiffConfig")]:
        cls = getattr(importlib.import_module(module_name), config)
        if "trust_remote_code" in {f.name for f in dataclasses.fields(cls)}:
            extra = ["--head", "1.1", "--prompt", "x"] if name == "show" else ["a", "b"] if name == "diff" else []
            where = ["x"] if name == "view" else ["--heads-file", "x"] if name == "import" else ["--out", "x"]  # view writes into its DIR
            args = build_parser(name).parse_args([name, *where, "--trust-remote-code", *extra])
            changes = {"prompt": "x"} if name == "show" else {}
            options.check_fields(cls, {"trust_remote_code": True})  # the Python API takes it as a keyword
            configs[name] = settings.from_args(cls, args, **changes).trust_remote_code
    if "atlas" in configs:
        atlas = importlib.import_module("headprobe.commands.atlas").AtlasConfig(models="m", trust_remote_code=True)
        configs_scan = atlas.scan_config("m").trust_remote_code
    help_text = " ".join(sub.choices["scan"].format_help().split())
    print(json.dumps({"flagged": flagged, "configs": configs, "help": "run the repository's own code" in help_text,
                      "atlas_scan": configs_scan if "atlas" in configs else None}))
""")

FIELD = (
    '    trust_remote_code: bool = setting(False, "run the repository\'s own code", action="store_true")\n'
    '    """Run the model repository\'s own code."""'
)


SETTINGS_GROUPS = [
    (
        "ModelSettings",
        ["ablate", "atlas", "circuit", "diff", "import", "kv", "patch", "prune", "robustness", "scan", "show", "view"],
    ),
    ("DataSettings", ["ablate", "atlas", "diff", "import", "prune", "robustness", "scan"]),
]
"""Each shared settings group and the commands whose Config composes it (the flag reaches exactly these)."""


@pytest.mark.parametrize("group, commands", SETTINGS_GROUPS)
def test_the_settings_page_names_every_command_of_a_group(group, commands):
    """docs/settings.md's "composed by" column lists the commands that compose the group (it had
    left out import, robustness and diff)."""
    import re

    page = (ROOT / "docs" / "settings.md").read_text(encoding="utf-8")
    row = next(line for line in page.splitlines() if line.startswith(f"| `{group}` |"))
    listed = re.findall(r"`([a-z]+)`", row.split("|")[3].split("(")[0])
    assert sorted(listed) == commands, row


@pytest.mark.parametrize("group, commands", SETTINGS_GROUPS)
def test_a_shared_setting_is_one_field(group, commands):
    r = subprocess.run([sys.executable, "-c", ADD_SETTING, group, FIELD], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    found = json.loads(r.stdout.strip().splitlines()[-1])
    assert found["flagged"] == commands  # every command that composes the group, and no other
    assert found["configs"] == {c: True for c in commands}  # the flag sets the config's field
    assert found["atlas_scan"] is True  # atlas hands its model and data settings to every model's load and scan
    assert found["help"]  # its help is the field's


def test_an_output_setting_reaches_every_command_that_writes_files():
    """A field added to OutputSettings (where the files go, not part of any Config: the Config is
    the checkpoint's key and summary.json's record) becomes a flag of every command with --out,
    and of no other (budget prints, view writes into the scan's folder); no Config gains it, so
    the exact list above is not what every field gets."""
    script = ADD_SETTING.replace(
        'anchor = "    def __post_init__(self):\\n        check_settings(self)\\n"',
        'anchor = "    def __post_init__(self):\\n        if self.formats is not None:"',
    )
    r = subprocess.run(
        [sys.executable, "-c", script, "OutputSettings", FIELD], capture_output=True, text=True, cwd=ROOT
    )
    assert r.returncode == 0, r.stderr[-3000:]
    found = json.loads(r.stdout.strip().splitlines()[-1])
    assert found["flagged"] == [
        "ablate",
        "atlas",
        "circuit",
        "diff",
        "kv",
        "patch",
        "prune",
        "robustness",
        "scan",
        "show",
        "study",
        "train",
    ]
    assert found["configs"] == {}


def _where_to_add_row(name: str) -> str:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    rows = [line for line in readme.split("## Where to add", 1)[1].splitlines() if line.startswith(f"| {name} |")]
    assert len(rows) == 1, f"README's Where to add has {len(rows)} rows for {name!r}"
    return rows[0]


PATH_IN_BACKTICKS = re.compile(r"`((?:probe|analyses|headprobe|tests|docs|benchmarks|scripts)/[\w./-]+\.(?:py|md))`")
"""A file of the repository named in backticks (``probe/model/config.py``); templates such as
``probe/model/families/<model_type>.py`` are not paths."""


def missing_paths(text: str) -> list[str]:
    """The files ``text`` names in backticks that do not exist."""
    return [p for p in PATH_IN_BACKTICKS.findall(text) if not (ROOT / p).exists()]


def _where_to_add_sections() -> dict[str, str]:
    """README's Where-to-add table and CONTRIBUTING's Where-to-add section (to the next heading)."""
    out = {}
    for name in ("README.md", "CONTRIBUTING.md"):
        text = (ROOT / name).read_text(encoding="utf-8").split("## Where to add", 1)[1]
        out[name] = text.split("\n## ", 1)[0]
    return out


def test_every_file_a_where_to_add_row_names_exists():
    """A row names real files: moving code (the model split by concern) moves the rows with it."""
    sections = _where_to_add_sections()
    assert {name: missing_paths(text) for name, text in sections.items()} == {"README.md": [], "CONTRIBUTING.md": []}
    option = _where_to_add_row("an architecture option of the native model")
    assert "`probe/model/config.py`" in option and "`probe/model/attention.py`" in option
    assert "`probe/model/config.py`" in sections["CONTRIBUTING.md"]


def test_the_missing_path_check_can_fail():
    text = (
        "`probe/model/config.py`, `probe/model/transformers.py`, `probe/model/families/<model_type>.py`, `docs/nope.md`"
    )
    assert missing_paths(text) == ["probe/model/transformers.py", "docs/nope.md"]


def test_the_readme_names_the_places_these_tests_use():
    """The rows say where the tests above add things: the registry entry and the settings module."""
    command = _where_to_add_row("a command")
    assert "`COMMANDS` in `headprobe/commands/__init__.py`" in command and "headprobe/commands/<name>.py" in command
    setting = _where_to_add_row("a shared setting")
    assert "`headprobe/settings.py`" in setting and "SUBCOMMANDS" not in command and "options.py" not in setting


def unmapped_modules(code_map: str, root: Path) -> list[str]:
    """Files of probe/, analyses/, headprobe/, benchmarks/ and scripts/ that CONTRIBUTING.md's code map
    ``code_map`` does not name (a family module and a command module are named by their pattern)."""
    missing = []
    for folder in ("probe", "analyses", "headprobe", "benchmarks", "scripts"):
        for f in sorted((root / folder).rglob("*")):
            if f.suffix not in (".py", ".sh", ".html") or f.name == "__init__.py":
                continue
            if {"families", "commands", "__pycache__"} & set(f.parts):
                continue
            if not re.search(r"(?<![\w.])" + re.escape(f.name) + r"(?!\w)", code_map):
                missing.append(str(f.relative_to(root)))
    return missing


def test_the_code_map_names_every_module(tmp_path):
    """A new module is named in CONTRIBUTING.md's code map (a newcomer reads the tree there); the
    check fails on a module it does not name."""
    text = (ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")
    code_map = text.split("## Code map", 1)[1].split("\n## ", 1)[0]
    assert unmapped_modules(code_map, ROOT) == []
    (tmp_path / "analyses").mkdir()
    (tmp_path / "analyses" / "new_detector.py").write_text("")
    (tmp_path / "analyses" / "data.py").write_text("")
    assert unmapped_modules(code_map, tmp_path) == ["analyses/new_detector.py"]


@pytest.mark.parametrize("model", ["smollm2-135m", "tiny_dir"])
def test_scan_refuses_only_encoder_only_types_for_a_decoder_before_loading(
    model, tiny_dir, capsys, tmp_path, monkeypatch
):
    """``scan --types next-token`` on a decoder was refused only after the model loaded (seconds to
    minutes): the embedded SmolLM2 and a Llama folder's config.json say causal, so now before the load
    (a load is made to fail here: the refusal must come first), one line, no folder."""
    from headprobe.cli import main
    from headprobe.probe.backends import loading

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(loading, "load_model", no_load)
    name = str(tiny_dir) if model == "tiny_dir" else model
    assert main(["scan", "--model", name, "--types", "next-token", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "scored on encoders only" in err and "is causal" in err, err
    assert "head type next-token is scored" in err  # one type: not "head types next-token are" (walk 'bert')
    assert not (tmp_path / "out").exists()
