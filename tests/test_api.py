"""The Python API of scan / ablate / prune (``headprobe.scan(...)`` etc.) against the CLI on the same
tiny model, ``--types``, and checks that fail before any weights load."""

from __future__ import annotations

import dataclasses
import inspect
import json

import pandas as pd
import pytest
import zoo

import headprobe
from headprobe.analyses.columns import METRICS, metric_columns
from headprobe.cli import main
from headprobe.commands import COMMANDS
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.core.io import OUTPUTS_NAME

SMALL_SCAN = dict(n_natural=3, seq_len=16, n_repeated=2, period=6, k=3, n_random=2)
SMALL_FLAGS = zoo.TINY_SCAN_FLAGS  # a scan of the tiny models in seconds


@pytest.fixture(scope="module")
def cli_scan(tiny_dir, text_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "scan"
    assert main(_cli_scan_argv(tiny_dir, text_file, out)) == 0
    return out


def _cli_scan_argv(tiny_dir, text_file, out) -> list[str]:
    return ["scan", "--model", str(tiny_dir), "--out", str(out), "--text", str(text_file), *SMALL_FLAGS]


@pytest.fixture(scope="module")
def api_scan(tiny_dir, text_file):
    model = headprobe.load_model(str(tiny_dir), device="cpu")
    return model, headprobe.scan(model, text=str(text_file), device="cpu", **SMALL_SCAN)


def test_api_scan_table_equals_the_cli_csv(cli_scan, api_scan):
    _, result = api_scan
    cli = pd.read_csv(cli_scan / "head_scores.csv")
    api = pd.read_csv(pd.io.common.StringIO(result.table.to_csv(index=False, float_format="%.5f")))
    pd.testing.assert_frame_equal(api, cli)
    assert len(cli) == 2 * 8 and list(cli.columns[:3]) == ["layer", "head", "kv_head"]


def test_scan_result_save_writes_the_cli_files(cli_scan, api_scan, tmp_path, tiny_dir, text_file):
    """The API's files are the CLI's, summary.json included but for its timings, the model's path
    and ``command``: the CLI's words as given to ``main``, null for a run from Python."""
    _, result = api_scan
    paths = result.save(tmp_path / "api")
    assert paths[-1].name == "summary.json"  # last: its presence means the directory is complete
    assert sorted(p.name for p in (tmp_path / "api").iterdir()) == sorted(p.name for p in cli_scan.iterdir())
    assert sorted(p.name for p in paths) == sorted(p.name for p in cli_scan.iterdir() if p.name != OUTPUTS_NAME)
    assert (tmp_path / "api" / "head_scores.csv").read_bytes() == (cli_scan / "head_scores.csv").read_bytes()
    a, c = (json.loads((d / "summary.json").read_text()) for d in (tmp_path / "api", cli_scan))
    assert a.pop("command") is None and result.summary()["command"] is None
    assert c.pop("command") == [*map(str, _cli_scan_argv(tiny_dir, text_file, cli_scan))]
    for s in (a, c):
        del s["timings_s"], s["peak_memory"]  # the process's, as the wall time
        s["config"].pop("model")
    assert a == c
    assert result.summary()["ablations"] == c["ablations"]
    with pytest.raises(HeadprobeError, match=r"not empty; pass --overwrite \(overwrite=True in Python\)"):
        result.save(tmp_path / "api")


@pytest.mark.figures
def test_summary_records_the_backend_the_model_ran_on(cli_scan, api_scan, tiny_dir, text_file):
    """summary.json's ``config.backend`` said ``auto`` (what was asked, or nothing at all for a model
    given loaded, whatever backend it was loaded on): it is now the backend the run used, the same
    from the command line and from Python, and scan's own ``backend`` agrees."""
    _, result = api_scan
    cli = json.loads((cli_scan / "summary.json").read_text())
    assert result.summary()["config"]["backend"] == cli["config"]["backend"] == cli["backend"] == "native"
    bridge = headprobe.load_model(str(tiny_dir), device="cpu", backend="transformer-lens", quiet=True)
    small = dict(text=str(text_file), n_natural=2, seq_len=12, n_repeated=2, period=5)
    s = headprobe.scan(bridge, types="induction", verify=False, metrics=False, **small).summary()
    assert s["config"]["backend"] == s["backend"] == "transformer-lens"
    a = headprobe.ablate(bridge, heads="0.0", **small).summary()
    assert a["config"]["backend"] == "transformer-lens" and "TransformerLens backend" in a["weights_precision"]


@pytest.mark.figures  # it checks a saved PNG; passed only after a test that left PNG on
def test_types_limit_columns_figures_and_verifications(api_scan, text_file, tmp_path):
    model, full = api_scan
    part = headprobe.scan(model, text=str(text_file), types="induction,previous-token", **SMALL_SCAN)
    assert part.config.types == ("previous_token", "induction")  # registry order, `-` spelling accepted
    assert list(part.table.columns) == ["layer", "head", "kv_head", "previous_token", "induction", *metric_columns()]
    pd.testing.assert_frame_equal(part.table, full.table[list(part.table.columns)])  # same numbers as the full scan
    # 16 tokens: no W < 16; no learned sinks or output gates in a Llama
    drawn = [
        s.column
        for m in METRICS.values()
        for s in m.figures
        if s.column not in ("distant_mass", "learned_sink_mass", "gate_closure")
    ]
    assert set(part.figures()) == {
        "heatmap_previous_token",
        "heatmap_induction",
        "overview",
        "pattern_previous_token",
        "pattern_induction",
        "ablation",
        "composition_k",
        *(f"heatmap_{c}" for c in drawn),
    }
    assert {v.head_type for v in part.verifications} == {"previous_token", "induction"}
    same = [v for v in full.verifications if v.head_type in ("previous_token", "induction")]
    # the heads under test and their effects do not depend on the other types selected; the random
    # control does (it excludes the top-k of every selected type judged on the same task)
    under_test = ("head_type", "kind", "task", "top_heads", "clean_loss", "top_loss", "top_effect", "top_effect_ci95")
    assert [{f: v.to_dict()[f] for f in under_test} for v in part.verifications] == [
        {f: v.to_dict()[f] for f in under_test} for v in same
    ]
    for v in part.verifications:
        assert set(v.top_heads) <= set(v.control_excludes)
        assert not any(set(h) & set(v.control_excludes) for h in v.random_heads)
    assert set(part.summary()["top_heads"]) == {"previous_token", "induction"}
    part.save(tmp_path / "out")
    assert not list((tmp_path / "out").glob("*first_token*")) and (tmp_path / "out" / "heatmap_induction.png").is_file()


def test_a_new_head_type_is_one_registry_entry(api_scan, text_file, request):
    """A head type registered in HEAD_COLUMNS alone is scored, verified, drawn and summarised."""
    from headprobe.analyses import detectors
    from headprobe.analyses.columns import HEAD_COLUMNS, HEAD_TYPE

    model, full = api_scan
    prev = detectors.DETECTORS["previous_token"]
    copy = dataclasses.replace(
        prev,
        name="prev_copy",
        columns=("prev_copy",),
        rank_by="prev_copy",
        score=lambda p, S, s: {"prev_copy": detectors.previous_token_score(p)},
        figures=(detectors.HeatmapStyle("prev_copy", "copied score", "attention to i-1"),),
    )
    HEAD_COLUMNS.register("prev_copy", copy, group=HEAD_TYPE)
    request.addfinalizer(lambda: HEAD_COLUMNS.unregister("prev_copy"))
    r = headprobe.scan(model, text=str(text_file), types="prev-copy", **SMALL_SCAN)
    assert list(r.table["prev_copy"]) == list(full.table["previous_token"])
    assert {"heatmap_prev_copy", "pattern_prev_copy"} <= set(r.figures())
    ref = next(v for v in full.verifications if v.head_type == "previous_token" and v.kind == "zero")
    got = next(v for v in r.verifications if v.head_type == "prev_copy" and v.kind == "zero")
    assert got.top_heads == ref.top_heads and got.top_effect == ref.top_effect
    assert r.summary()["top_heads"]["prev_copy"] == full.summary()["top_heads"]["previous_token"]


@pytest.fixture
def no_loading(monkeypatch):
    """Loading a model fails the test: the checks must come before it."""
    from headprobe.probe.backends import loading

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the bad flag was refused")

    monkeypatch.setattr(loading, "load_model", refuse)


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (
            ["scan", "--types", "inducton"],
            "unknown head type inducton (did you mean induction?); known types: previous_token, duplicate_token",
        ),
        (  # the name echoed as typed; the suggestion and the list spelled as README and --help spell them
            ["scan", "--types", "induction,prev_token"],
            "unknown head type prev_token (did you mean previous_token?); known types: previous_token,",
        ),
        (["scan", "--types", "Prev-Token"], "unknown head type Prev-Token (did you mean previous_token?)"),
        (["scan", "--types", ","], "no head type given"),
        (["scan", "--text", "{dir}"], "cannot read text file"),
        (["scan", "--text", "{dir}/missing.txt"], "cannot read text file"),
        (["scan", "--text", "{bad}"], "not UTF-8"),
        (["scan", "--seq-len", "1"], "at least 4 positions"),  # scan's floor (settings.seq_len_floor)
        (["scan", "--dtype", "fp8"], "dtype 'fp8' is not supported"),
        (["ablate", "--heads", "40.3"], "head 40.3 is out of range: the model has 30 layers of 9 heads"),
        (["ablate", "--heads", "5-1"], "not of the form layer.head"),
        (["ablate", "--heads", "0.0", "--model", "{tiny}"], None),  # in range: reaches the (refused) load
        (
            ["ablate", "--heads", "1.8", "--model", "{tiny}"],
            "head 1.8 is out of range: the model has 2 layers of 8 heads",
        ),
        (["ablate", "--text", "{bad}"], "not UTF-8"),
        (["prune", "--period", "1"], "at least 3 tokens"),
        (["prune", "--text", "{dir}"], "cannot read text file"),
    ],
)
def test_bad_flags_fail_before_the_model_loads(argv, fragment, tiny_dir, tmp_path, capsys, no_loading):
    (tmp_path / "bad.txt").write_bytes(b"caf\xe9\xff")
    argv = [a.format(dir=tmp_path, bad=tmp_path / "bad.txt", tiny=tiny_dir) for a in argv]
    out = tmp_path / "out"
    if fragment is None:
        with pytest.raises(AssertionError, match="was loaded"):
            main([*argv, "--out", str(out)])
        return
    try:
        code = main([*argv, "--out", str(out)])
    except SystemExit as e:  # argparse's type errors
        code = e.code
    assert code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("headprobe: error:") and fragment in err[0], err
    assert not out.exists()


def test_api_functions_check_before_loading(no_loading):
    with pytest.raises(HeadprobeError, match="unknown head type"):
        headprobe.scan("smollm2-135m", types="sink")
    with pytest.raises(HeadprobeError, match="out of range"):
        headprobe.ablate("smollm2-135m", heads=[(30, 0)])
    with pytest.raises(HeadprobeError, match=r"must be in \(0, 1\]"):
        headprobe.prune("smollm2-135m", step_fraction=0)


@pytest.mark.parametrize("estimate", [None, "gradient"])
def test_ablate_refuses_a_loaded_models_head_out_of_range_before_any_forward(tiny_gpt2_native, monkeypatch, estimate):
    """``headprobe.ablate(model, heads="18.9")`` on a loaded model of 9 heads a layer was refused only
    after the load-time self-check's forward and the token sets (1-2 s on SmolLM2), where the
    command line and ``show`` refuse at once: the heads are now checked against ``model.spec`` first
    (the check the command line's preflight makes against config.json). Counted here: no forward
    (the self-check reset, so it would run one) and no token set is built before the refusal; the
    same call with a head in range does run the forward (the counting sees it)."""
    from headprobe.options import ModelRunConfig

    model = tiny_gpt2_native  # 2 layers of 4 heads: 1.4 is the head past a layer's last, as 18.9 is in SmolLM2
    calls = {"forward": 0, "task_tokens": 0}

    def forward(self, *args, **kwargs):
        calls["forward"] += 1
        raise RuntimeError("forward called")

    def task_tokens(self, *args, **kwargs):
        calls["task_tokens"] += 1
        raise RuntimeError("token sets built")

    monkeypatch.setattr(model, "_self_check", None)  # so that a check reached would run its forward
    monkeypatch.setattr(type(model), "forward", forward)
    monkeypatch.setattr(ModelRunConfig, "task_tokens", task_tokens)
    small = dict(n_natural=2, seq_len=12, n_repeated=2, period=5, estimate=estimate)
    with pytest.raises(HeadprobeError, match=r"^head 1\.4 is out of range: the model has 2 layers of 4 heads"):
        headprobe.ablate(model, heads="1.4", **small)
    assert calls == {"forward": 0, "task_tokens": 0}
    with pytest.raises(HeadprobeError):  # in range: the self-check's forward runs (and fails here)
        headprobe.ablate(model, heads="1.3", **small)
    assert calls["forward"] > 0


def test_peek_layout_agrees_with_the_loaded_model(tiny_dir, api_scan, tmp_path):
    from headprobe.options import peek_layout

    model, _ = api_scan
    assert peek_layout(str(tiny_dir)) == (model.spec.n_layers, model.spec.n_heads)
    assert peek_layout(str(tmp_path)) is None  # no config.json: checked after loading instead
    assert peek_layout("gpt2") is None


def test_api_ablate_and_prune_equal_their_cli(tiny_dir, text_file, tmp_path):
    small = dict(n_natural=2, seq_len=12, n_repeated=2, period=5, device="cpu")
    flags = ["--n-natural", "2", "--seq-len", "12", "--n-repeated", "2", "--period", "5", "--device", "cpu"]
    model = headprobe.load_model(str(tiny_dir), device="cpu")
    a = headprobe.ablate(model, text=str(text_file), heads="1.3,0.0", **small)
    assert (
        main(
            [
                "ablate",
                "--model",
                str(tiny_dir),
                "--out",
                str(tmp_path / "a"),
                "--text",
                str(text_file),
                "--heads",
                "1.3,0.0",
                *flags,
            ]
        )
        == 0
    )
    a.save(tmp_path / "a_api")
    assert (tmp_path / "a_api" / "head_ablation.csv").read_bytes() == (
        tmp_path / "a" / "head_ablation.csv"
    ).read_bytes()
    assert a.table["natural_loss_delta"].notna().sum() == 2
    p = headprobe.prune(
        model, text=str(text_file), step_fraction=0.5, l0_steps=2, l0_lambdas=(1.0, 10.0), n_seeds=2, **small
    )
    assert (
        main(
            [
                "prune",
                "--model",
                str(tiny_dir),
                "--out",
                str(tmp_path / "p"),
                "--text",
                str(text_file),
                "--step-fraction",
                "0.5",
                "--l0-steps",
                "2",
                "--l0-lambdas",
                "1,10",
                "--n-seeds",
                "2",
                *flags,
            ]
        )
        == 0
    )
    p.save(tmp_path / "p_api")
    assert (tmp_path / "p_api" / "pruning_curve.csv").read_bytes() == (
        tmp_path / "p" / "pruning_curve.csv"
    ).read_bytes()
    assert set(p.figures()) == {"pruning_curve"} and set(a.figures()) == {"ablation_effect", "importance_vs_exact"}
    for d in ("a", "p"):
        s, t = (json.loads((tmp_path / x / "summary.json").read_text()) for x in (d, f"{d}_api"))
        assert s.pop("command")[:2] == [{"a": "ablate", "p": "prune"}[d], "--model"] and t.pop("command") is None
        for x in (s, t):
            del x["timings_s"], x["peak_memory"]  # the process's, as the wall time
            x["config"].pop("model")
        assert s == t


def test_api_functions_record_the_load_time(tiny_dir, text_file, monkeypatch):
    """A function given a model name records the seconds it spent loading (summary.json's timings),
    as the CLI does; given a loaded model, None. The load is slowed by a known 0.2 s to see it counted."""
    import time

    from headprobe import options

    load_for = options.load_for
    monkeypatch.setattr(options, "load_for", lambda cfg: (time.sleep(0.2), load_for(cfg))[1])
    small = dict(text=str(text_file), n_natural=2, seq_len=12, n_repeated=2, period=5, device="cpu")
    a = headprobe.ablate(str(tiny_dir), heads="1.3", **small)
    s = headprobe.scan(str(tiny_dir), types="induction", verify=False, metrics=False, **small)
    assert a.load_s >= 0.2 and a.summary()["timings_s"]["total"] >= 0.2
    assert s.load_s >= 0.2 and s.summary()["timings_s"]["load_s"] == round(s.load_s, 2)
    d = headprobe.diff(  # two loads: A's and B's (B rounded: equal weights are refused)
        str(tiny_dir), str(tiny_dir), types="induction", n_perm=99, requantize_b="int8", **small
    )
    timings = d.summary()["timings_s"]
    assert d.load_s >= 0.2 and timings["load_s"] == round(d.load_s, 2) and timings["load_b_s"] >= 0.2
    model = load_for(a.config)
    assert headprobe.ablate(model, heads="1.3", **small).load_s is None  # not a load of 0 s


def test_a_model_the_caller_loaded_claims_no_load_time(tiny_dir, text_file, tmp_path):
    """Given a loaded model, a result says the caller loaded it -- ``load_s`` None, ``repr`` in
    words, summary.json's ``timings_s`` without ``load_s`` (with diff's B: without ``load_b_s``) --
    never a 0 s load; the same model named by its path records its load's seconds (> 0)."""
    small = dict(text=str(text_file), n_natural=2, seq_len=12, n_repeated=2, period=5, device="cpu")
    model = headprobe.load_model(str(tiny_dir), device="cpu")
    s = headprobe.scan(model, types="induction", verify=False, metrics=False, **small)
    assert s.load_s is None and "load_s: model loaded by the caller" in repr(s)
    assert "load_s" not in s.summary()["timings_s"]
    s.save(tmp_path / "scan")
    assert "load_s" not in json.loads((tmp_path / "scan" / "summary.json").read_text())["timings_s"]
    d = headprobe.diff(model, model, types="induction", n_perm=99, requantize_b="int8", **small)  # B must differ
    assert d.load_s is None and not {"load_s", "load_b_s"} & set(d.summary()["timings_s"])
    named = headprobe.scan(str(tiny_dir), types="induction", verify=False, metrics=False, **small)
    assert named.load_s > 0 and named.summary()["timings_s"]["load_s"] == round(named.load_s, 2)
    assert "load_s=" in repr(named) and "loaded by the caller" not in repr(named)


def test_every_result_keeps_its_load_time_in_one_field():
    """``load_s`` is a plain dataclass field (default None: a model the caller loaded) on every
    command's result that has one, never a property over another attribute, so the runner and the
    Python functions set it alike."""
    import importlib
    import inspect

    from headprobe.commands import COMMANDS

    found = {}
    for name in COMMANDS.names():
        for suffix in ("", "_core"):
            try:
                module = importlib.import_module(f"headprobe.commands.{name}{suffix}")
            except ModuleNotFoundError:
                continue
            for cls in vars(module).values():
                if inspect.isclass(cls) and cls.__module__ == module.__name__ and hasattr(cls, "load_s"):
                    fields = {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
                    found[cls.__name__] = "load_s" in fields and fields["load_s"].default is None
    assert {"ScanResult", "RobustnessResult", "DiffResult", "AblateResult", "KVResult"} <= set(found)
    assert [name for name, ok in found.items() if not ok] == []


@pytest.mark.figures
def test_scan_dtype_flag_casts_the_weights(tiny_dir, text_file, tmp_path):
    """``scan --dtype bf16`` computes in bfloat16 as ``ablate --dtype`` does; recorded in summary.json."""
    out = tmp_path / "bf16"
    assert (
        main(
            [
                "scan",
                "--model",
                str(tiny_dir),
                "--out",
                str(out),
                "--text",
                str(text_file),
                "--dtype",
                "bf16",
                "--types",
                "induction",
                "--no-verify",
                "--no-metrics",
                *zoo.TINY_SCORE_FLAGS,  # no -k or --n-random: --no-verify refuses them
            ]
        )
        == 0
    )
    s = json.loads((out / "summary.json").read_text())
    assert s["dtype"] == "bfloat16" and s["config"]["dtype"] == "bfloat16" and s["config"]["types"] == ["induction"]
    table = pd.read_csv(out / "head_scores.csv")
    assert list(table.columns) == ["layer", "head", "kv_head", "induction"] and table["induction"].between(0, 1).all()
    assert sorted(p.name for p in out.glob("*.png")) == [
        "heatmap_induction.png",
        "overview.png",
        "pattern_induction.png",
    ]


def test_a_misspelt_setting_names_the_function_and_the_nearest_setting():
    """Before anything loads: the TypeError names ``scan()`` (not its config class) and the
    setting meant."""
    with pytest.raises(TypeError, match=r"scan\(\) got an unknown setting 'n_randm'; did you mean n_random\?"):
        headprobe.scan("smollm2-135m", n_randm=3)
    with pytest.raises(TypeError, match=r"ablate\(\) got an unknown setting 'hedas'; did you mean heads\?"):
        headprobe.ablate("smollm2-135m", hedas="1.1")


@pytest.mark.parametrize(
    ("name", "call", "keyword", "said"),
    [
        ("train", lambda **kw: headprobe.train(**kw), "stepz", "did you mean steps?"),
        ("train", lambda **kw: headprobe.train(**kw), "data", "the flag --data is the setting periodic"),
        ("study", lambda **kw: headprobe.study("heads", **kw), "step", "did you mean steps?"),
        ("atlas", lambda **kw: headprobe.atlas(out="never-written", **kw), "toysteps", "did you mean toy_steps?"),
        ("export", lambda **kw: headprobe.export("never-read", **kw), "fromat", "did you mean format?"),
    ],
    ids=["train", "train-flag", "study", "atlas", "export"],
)
def test_every_function_names_the_setting_meant(name, call, keyword, said, tmp_path, monkeypatch):
    """train, study, atlas and export take their settings as keywords like scan: a misspelt one is
    a TypeError naming the function and the setting meant, before anything runs."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TypeError, match=rf"^{name}\(\) got an unknown setting '{keyword}'; {said}"):
        call(**{keyword: 3})
    assert list(tmp_path.iterdir()) == []  # nothing written


_REQUIRED = {
    "show": {"head": "1.1", "prompt": "a", "out": "never-written"},
    "study": {"which": "heads"},
    "view": {"dir": "never-read"},
    "diff": {"a": "smollm2-135m", "b": "smollm2-135m"},
    "export": {"source": "never-read"},
    "atlas": {"out": "never-written"},
    "import": {"heads_file": "never-read"},
}
"""Each command function's required arguments, at values that pass before its keyword check."""


def _unknown_setting(function, name: str, keywords: dict) -> str:
    """The keyword ``function(**keywords)`` refuses first: the name its TypeError gives."""
    import re

    with pytest.raises(TypeError) as e:
        function(**keywords)
    said = re.search(r"(?:unknown setting|unexpected keyword argument) '(\w+)'", str(e.value))
    assert said, (name, str(e.value))
    return said.group(1)


def _keywords_taken(command: str) -> tuple:
    """``(function, its signature's parameters, the names it takes)`` for a command: every name of its
    signature or its Config is passed beside an unknown one; it takes the name where the refusal
    (:func:`_unknown_setting`) is of the unknown one."""
    function, config = COMMANDS.get(command).function(), COMMANDS.get(command).config_class()
    required = _REQUIRED.get(command, {})
    params = inspect.signature(function).parameters
    defaults = {f.name: f.default for f in dataclasses.fields(config) if f.default is not dataclasses.MISSING}
    defaults |= {n: p.default for n, p in params.items() if p.default is not inspect.Parameter.empty}
    names = {n for n in params if not n.startswith("_")} | {f.name for f in dataclasses.fields(config)}
    names -= {n for n, p in params.items() if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    takes = {
        n
        for n in names
        if _unknown_setting(function, n, {**required, n: required.get(n, defaults.get(n, "x")), "not_a_setting": 1})
        == "not_a_setting"
    }
    return function, params, takes


def test_an_unknown_keyword_lists_exactly_the_keywords_each_command_function_takes(tmp_path, monkeypatch):
    """``show(..., bogus=1)``'s TypeError listed show's settings without ``overwrite``, which show()
    takes (and scan's without ``progress``, atlas's without ``out``, diff's with ``model``, which it
    refuses; view's was the dataclass's own, listing none). The reference is each function itself:
    every name of its signature or its Config is passed beside an unknown one, and it takes the name
    where the refusal is of the unknown one; the names listed are exactly those (in signature order)."""

    monkeypatch.chdir(tmp_path)
    for command in COMMANDS:
        function, params, takes = _keywords_taken(command)
        with pytest.raises(TypeError, match=r"'not_a_setting'") as e:
            function(**_REQUIRED.get(command, {}), not_a_setting=1)
        listed = str(e.value).rsplit("(settings: ", 1)[1].removesuffix(")").split(", ")
        assert set(listed) == takes and len(listed) == len(takes), (command, set(listed) ^ takes)
        order = [n for n in params if n in takes]
        assert listed[: len(order)] == order, (command, listed)
    assert list(tmp_path.iterdir()) == []  # nothing ran


@pytest.mark.parametrize(
    ("keyword", "said"),
    [
        ("fixed_draws", "the flag --fixed-draws is the setting sequential=False"),
        ("no_verify", "the flag --no-verify is the setting verify=False"),
        ("no_bos", "the flag --no-bos is the setting prepend_bos=False"),
        ("top_k", "the flag --top-k is the setting k"),
    ],
)
def test_a_flags_spelling_names_its_setting(keyword, said):
    """Where a flag's underscored spelling is not its setting's name (a --no-X switch, a flag named
    otherwise), the TypeError says which setting, and which value, the flag is."""
    import dataclasses

    from headprobe.commands.scan import ScanConfig

    field = next(f for f in dataclasses.fields(ScanConfig) if said.split("setting ")[1].split("=")[0] == f.name)
    assert keyword.replace("_", "-") in [
        field.metadata.get("flag", "").lstrip("-"),
        *(a.lstrip("-") for a in field.metadata.get("aliases", ())),
    ]
    with pytest.raises(TypeError, match=rf"scan\(\) got an unknown setting '{keyword}'; {said} \(settings:"):
        headprobe.scan("smollm2-135m", **{keyword: True})


@pytest.mark.parametrize("call", ["scan", "ablate"])
def test_a_no_switchs_stem_names_its_setting(call):
    """The README's rule "a --no-X switch is X=False" predicts ``bos=False`` for ``--no-bos``, whose
    setting is ``prepend_bos``: the TypeError said no more than "unknown setting 'bos'"."""
    function = getattr(headprobe, call)
    with pytest.raises(TypeError) as e:
        function("smollm2-135m", bos=False)
    said = str(e.value).split(" (settings:")[0]
    assert said == f"{call}() got an unknown setting 'bos'; the flag --no-bos is the setting prepend_bos=False", said


def test_load_model_has_the_commands_defaults_and_takes_their_dtype(tiny_dir, monkeypatch):
    """``headprobe.load_model`` loads as the commands' flags do: its device, dtype and backend
    defaults are every model config's (``--device auto``: CUDA when present; it was ``cpu``), and it
    takes ``dtype`` (a TypeError before), cast after the float32 self-check."""
    import inspect

    import torch

    from headprobe.commands.scan import ScanConfig
    from headprobe.probe.backends import loading

    params = inspect.signature(headprobe.load_model).parameters
    defaults = {f.name: f.default for f in dataclasses.fields(ScanConfig)}
    for name in ("device", "dtype", "backend", "prepend_bos", "device_map", "max_memory"):
        assert params[name].default == defaults[name], name
    asked = []
    real = loading.device_auto
    monkeypatch.setattr(loading, "device_auto", lambda d: asked.append(d) or real(d))
    model = headprobe.load_model(str(tiny_dir), dtype="bf16", quiet=True)
    assert asked == ["auto"] and model.dtype == torch.bfloat16 and model.self_check.dtype == "float32"
    assert str(model.device) == ("cuda:0" if torch.cuda.is_available() else "cpu")


def test_every_command_function_says_what_it_returns():
    """Each ``headprobe.<command>`` function's docstring has a ``Returns:`` section (atlas, budget,
    diff, export, show, study, train and view had none, or a sentence in the summary)."""
    import inspect

    from headprobe.commands import COMMANDS

    functions = {name: COMMANDS.get(name).function() for name in COMMANDS.names()}
    missing = [n for n, f in functions.items() if f is not None and "Returns:" not in inspect.getdoc(f).splitlines()]
    assert missing == []


SCAN_CALL = lambda **kw: headprobe.scan("smollm2-135m", **kw)  # the calls of the next test
FORMATS = r'formats is an output setting: pass it to result\.save\(path, formats="png"\) \('


@pytest.mark.parametrize(
    ("call", "keyword", "said"),
    [
        (SCAN_CALL, "out", r"out is an output setting: pass the folder to result\.save\(path\) \("),
        (SCAN_CALL, "overwrite", r"overwrite is an output setting: pass it to result\.save\(path, overwrite=True\) \("),
        (SCAN_CALL, "html", r"html is an output setting: pass it to result\.save\(path, html=True\) \("),
        (SCAN_CALL, "formats", FORMATS),
        (lambda **kw: headprobe.ablate("smollm2-135m", **kw), "formats", FORMATS + "settings"),
        (
            lambda **kw: headprobe.diff("a", "b", **kw),
            "out",
            r"out is an output setting: pass the folder to result\.save\(path\)",
        ),
        (
            lambda **kw: headprobe.study("heads", **kw),
            "overwrite",
            r"overwrite is an output setting: pass it to result\.save\(path, overwrite=True\)",
        ),
        (
            lambda **kw: headprobe.budget(**kw),
            "json",
            r"json is an output setting: budget\(\) returns the result; result\.to_dict\(\) is what --json prints",
        ),
        (
            lambda **kw: headprobe.budget(**kw),
            "latex",
            r"latex is an output setting: budget\(\) returns the result; result\.latex\(\) is what --latex prints",
        ),
        (
            lambda **kw: headprobe.show("smollm2-135m", head="1.1", prompt="a b", out="never-written", **kw),
            "prompt_file",
            r"prompt_file is a flag of the command line: pass the file's text as prompt=",
        ),
    ],
    ids=[
        "scan-out",
        "scan-overwrite",
        "scan-html",
        "scan-formats",
        "ablate-formats",
        "diff-out",
        "study-overwrite",
        "budget-json",
        "budget-latex",
        "show-prompt-file",
    ],
)
def test_an_output_flag_given_to_a_function_says_where_it_goes(call, keyword, said, tmp_path, monkeypatch, no_loading):
    """A flag of the command line that says where and how the files are written is no keyword of
    the function: the TypeError says where it goes in Python (the result's ``save``, checked here
    to take what it is told to: ``formats`` too, as ``atlas`` and ``show``, which write their
    files themselves, take it)."""
    from headprobe.commands.scan_core import ScanResult
    from headprobe.commands.study import StudyResult

    monkeypatch.chdir(tmp_path)
    with pytest.raises(TypeError, match=rf"\(\) got an unknown setting '{keyword}'; {said}"):
        call(**{keyword: "png" if keyword == "formats" else True})
    assert list(tmp_path.iterdir()) == []  # nothing written
    assert {"overwrite", "html", "formats"} <= set(inspect.signature(ScanResult.save).parameters)
    assert {"overwrite", "formats"} <= set(inspect.signature(StudyResult.save).parameters)
    assert all("formats" in inspect.signature(f).parameters for f in (headprobe.atlas, headprobe.show))


def test_import_heads_is_the_import_commands_function():
    """``import`` is a Python keyword: its function is public as ``headprobe.import_heads``, the same
    object as ``getattr(headprobe, "import")`` (one function, one signature and docstring), listed in
    ``headprobe.__all__``; the README, docs/api.md and the package docstring name it so."""
    from pathlib import Path

    assert headprobe.import_heads is getattr(headprobe, "import") is COMMANDS.get("import").function()
    assert "import_heads" in headprobe.__all__ and "import_heads" in dir(headprobe)
    root = Path(__file__).resolve().parents[1]
    for text in ((root / "README.md").read_text(), (root / "docs/api.md").read_text(), headprobe.__doc__):
        assert "headprobe.import_heads" in text and 'getattr(headprobe, "import")' not in text


def test_the_api_page_says_what_each_result_has():
    """docs/api.md promised every result a ``table``, ``summary()`` and ``save(out)``; five lack a table,
    three a summary, four a save. Its table of results (between ``<!-- result-members -->`` markers)
    must match the classes: each command once, its result class as the page's ``:::`` entry names it,
    yes/no read off the class (a dataclass field or attribute ``table``; callable ``summary``, ``save``),
    and every name the last column gives is the class's."""
    import dataclasses
    import importlib
    import re
    from pathlib import Path

    from headprobe.commands import COMMANDS

    page = (Path(__file__).parents[1] / "docs" / "api.md").read_text(encoding="utf-8")
    block = page.split("<!-- result-members -->")[1].split("<!-- /result-members -->")[0]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in block.strip().splitlines()[2:]]
    assert [r[0] for r in rows] == list(COMMANDS.names())
    classes = {p.rsplit(".", 1)[1]: p for p in re.findall(r"^::: (headprobe\.commands\.\S+Result)$", page, re.M)}
    for command, returns, table, summary, save, otherwise in rows:
        name = returns.strip("`")
        if name == "Path":  # view: the page it wrote
            assert (command, table, summary, save) == ("view", "no", "no", "no")
            continue
        module, _, cls_name = classes[name].rpartition(".")
        cls = getattr(importlib.import_module(module), cls_name)
        fields = {f.name for f in dataclasses.fields(cls)}

        def has(attr, cls=cls, fields=fields):
            return attr in fields or hasattr(cls, attr)

        actual = (
            "yes" if has("table") else "no",
            "yes" if callable(getattr(cls, "summary", None)) else "no",
            "yes" if callable(getattr(cls, "save", None)) else "no",
        )
        assert (table, summary, save) == actual, (command, name, actual)
        for attr in re.findall(r"`(\w+)(?:\(\))?`", otherwise):
            assert attr in {"out", "dir", "json"} or has(attr), (command, attr)


def test_the_api_page_names_only_members_the_loaded_model_has(tiny_gpt2_native):
    """docs/api.md had no entry for the model object the README's examples use (``model.to_tokens``,
    ``model.W_O``, ...). Its LoadedModel table (between ``<!-- loaded-model-members -->`` markers)
    must name only what the class has: each backticked ``name(args)`` a member of
    :class:`LoadedModel` whose signature has those parameters, each plain name an attribute of a
    loaded model, and every ``spec`` field the row names one of :class:`ModelSpec`. Two claims of
    the table are checked on the tiny GPT-2 too: ``to_tokens`` of a string is a tensor and of a list
    a ``(tokens, mask)`` tuple; ``W_O(layer)`` is ``[n_heads, d_head, d_model]``."""
    import re
    from pathlib import Path

    import torch

    from headprobe.probe.layout.spec import ModelSpec

    page = (Path(__file__).parents[1] / "docs" / "api.md").read_text(encoding="utf-8")
    block = page.split("<!-- loaded-model-members -->")[1].split("<!-- /loaded-model-members -->")[0]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in block.strip().splitlines()[2:]]
    assert len(rows) >= 10
    cls, model = headprobe.LoadedModel, tiny_gpt2_native
    assert isinstance(model, cls)
    for member, what in rows:
        for name, args in re.findall(r"`(\w+)(?:\(([^)]*)\))?`", member):
            assert hasattr(cls, name) or hasattr(model, name), name
            params = inspect.signature(getattr(cls, name)).parameters if args or "(" in member else {}
            for arg in filter(None, (a.strip() for a in args.split(","))):
                assert arg in params, (name, arg)
        if member == "`spec`":
            for field in re.findall(r"`(\w+)`", what):
                assert hasattr(ModelSpec, field) or field in ModelSpec.__dataclass_fields__, field
    spec = model.spec
    assert isinstance(model.to_tokens("t1 t2"), torch.Tensor)
    tokens, mask = model.to_tokens(["t1 t2", "t3"], padding_side="left")
    assert tokens.shape == mask.shape == (2, 3)
    assert tuple(model.W_O(0).shape) == (spec.n_heads, spec.d_head, spec.d_model)


def _parser_settings(command: str) -> set[str]:
    """The settings of ``headprobe <command>``'s parser (each flag's ``dest``), read from argparse
    itself, less the output flags a result's ``save`` takes instead (``out``, ``overwrite``, ``formats``,
    ``html``, ``json``, ``latex``, ``prompt_file``) and atlas's hidden ``--model`` (refused)."""
    import argparse

    parser = argparse.ArgumentParser(add_help=False)
    COMMANDS.get(command).add_flags(parser)
    dests = {a.dest for a in parser._actions}
    return (
        dests
        - {"out", "overwrite", "formats", "html", "json", "latex", "prompt_file"}
        - ({"model"} if command == "atlas" else set())
    )


def test_every_function_takes_exactly_its_commands_flags(tmp_path, monkeypatch):
    """``import_heads(model, heads_file=..., types=("previous_token",))`` ran (and echoed types into
    its config), and took ``pattern_len``, ``metrics``, ``verify``, ``streaming``, though ``headprobe
    import`` has none of those flags (ImportConfig inherits ScanConfig's fields); kv() took
    ``device_map``, train() ``kv_lora_rank``. Reference: the command's argparse parser. Every config
    field or keyword a function takes is a flag of its parser (or ``progress``; diff's ``a`` is its
    first model), and every flag but the output ones is taken (show, atlas and export take ``out``,
    ``overwrite``, ``formats`` themselves: README)."""
    monkeypatch.chdir(tmp_path)
    for command in COMMANDS:
        function, params, takes = _keywords_taken(command)
        takes -= {"progress", "out", "overwrite", "formats"} | ({"a"} if command == "diff" else set())
        flags = _parser_settings(command) - ({"model"} if command == "diff" else set())
        assert takes == flags, (command, "python only:", takes - flags, "flag only:", flags - takes)
    assert list(tmp_path.iterdir()) == []  # nothing ran


@pytest.mark.parametrize("keyword", ["types", "pattern_len", "metrics", "verify", "streaming"])
def test_import_refuses_a_setting_import_has_no_flag_for(keyword, tmp_path):
    """The newcomer's calls: each a TypeError naming the setting, before the file is read."""
    value = {"types": ("previous_token",), "pattern_len": 7}.get(keyword, False)
    with pytest.raises(TypeError, match=rf"^import_heads\(\) got an unknown setting '{keyword}'"):
        headprobe.import_heads("smollm2-135m", heads_file=str(tmp_path / "never-read"), **{keyword: value})
    assert "types" not in inspect.signature(headprobe.import_heads).parameters


def test_progress_lines_of_a_function_go_to_stderr(tiny_dir, text_file, capsys):
    """With progress=True scan printed its ``data:`` and ``batch:`` lines to stdout; README: progress on
    stderr. Now stdout stays empty and stderr has them."""
    model = headprobe.load_model(str(tiny_dir), device="cpu", quiet=True)
    capsys.readouterr()
    headprobe.scan(model, text=str(text_file), progress=True, **SMALL_SCAN)
    out, err = capsys.readouterr()
    assert out == "" and "data: natural text" in err, (out[-500:], err[-500:])
